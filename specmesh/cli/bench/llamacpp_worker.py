"""llama.cpp in a child process: the benchmark's llama.cpp peers run here, so a crash
inside llama.cpp (a segmentation fault kills the whole process) cannot take the
benchmark down. ``LlamaCppWorker`` (parent side, a ``peer_process.PeerProcess``) starts
``python -m specmesh.cli.bench.llamacpp_worker`` and speaks JSON lines over its
stdin/stdout; the child loads one GGUF with llama-cpp-python and answers greedy generations of given
prompt token ids (the same ids our systems get, already templated: no chat-completion
path, no re-tokenisation), timing each generation itself.

What was found on the development machine (llama-cpp-python 0.3.36 built from its
sdist with ``-DGGML_NATIVE=ON``, a CPU with AMX): every forward died with SIGSEGV in
``ggml_backend_amx_mul_mat`` (llama.cpp's AMX weight buffers: one of its "extra
buffer types"), with or without torch in the process. With
``llama_model_params.use_extra_bufts = False`` (no AMX / repacked weight buffers)
it runs. The parent first tries llama.cpp's defaults and, when the child dies of a
signal, restarts it once with extra buffer types off and says so in ``info``.

The child imports only llama_cpp, the standard library and ``peer_process`` (no torch,
no other specmesh module); each answer carries the child's peak RSS. This module knows nothing about workloads, reports or our
engine.
"""

from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

from .peer_process import PeerFailed, PeerProcess, child_memory, serve_child

__all__ = ["LlamaCppWorker", "PeerFailed"]


class LlamaCppWorker(PeerProcess):
    """Parent side: one child process holding one ``llama_cpp.Llama``."""

    label = "llama.cpp"
    module = "specmesh.cli.bench.llamacpp_worker"

    def __init__(self, gguf: str, threads: int, n_ctx: int, pld_tokens: int = 0, timeout_s: float = 600.0,
                 argv: Optional[Sequence[str]] = None, draft_gguf: Optional[str] = None, draft_tokens: int = 0,
                 logits_all: bool = False):
        """``argv``: the child's command line before its JSON config (default: this module
        under the running interpreter; tests put a stand-in child there). ``draft_gguf``:
        llama.cpp's speculative decoding with that model drafting ``draft_tokens`` greedy
        tokens a round (``DraftLM``). ``logits_all``: keep every position's logits (the
        probe's agreement run)."""
        super().__init__({"gguf": str(gguf), "threads": int(threads), "n_ctx": int(n_ctx),
                          "pld_tokens": int(pld_tokens), "extra_bufts": True, "draft_gguf": draft_gguf,
                          "draft_tokens": int(draft_tokens), "logits_all": bool(logits_all)},
                         timeout_s=timeout_s, argv=argv)
        self._tried_fallback = False

    def retry(self, rc: Optional[int], why: str) -> bool:
        """Once, after a death by a signal: again with llama.cpp's extra buffer types off."""
        if rc is not None and rc < 0 and self.cfg["extra_bufts"] and not self._tried_fallback:
            self._tried_fallback = True
            self.cfg["extra_bufts"] = False
            self.notes.append(f"{why} with llama.cpp's default weight buffers; restarted with "
                              "use_extra_bufts=False (no AMX / repacked weight buffers)")
            return True
        return False

    def probe(self, ctx: Sequence[int], rows: Sequence[int], reps: int, prefill: Sequence[int],
              sequences: Optional[list] = None, logits_file: Optional[str] = None) -> dict:
        """The engine probe's measures (``specmesh.cli.bench.engine_probe``) in the child: forward ms
        per scored row count after ``ctx``, the prefill rate of ``prefill``, memory, and the
        logits of ``sequences`` into ``logits_file`` (needs ``logits_all``)."""
        return self._ask({"probe": {"ctx": list(map(int, ctx)), "rows": list(map(int, rows)), "reps": int(reps),
                                    "prefill": list(map(int, prefill)), "sequences": sequences,
                                    "logits_file": logits_file}})["probe"]


# ---------------------------------------------------------------- child side
def without_extra_bufts(C=None) -> None:
    """Load every later model with ``use_extra_bufts = False`` (no AMX / repacked weight
    buffers): ``llama_cpp.llama`` reads its model defaults from ``llama_model_default_params``."""
    if C is None:
        import llama_cpp.llama_cpp as C
    default = C.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    C.llama_model_default_params = params


def _truncate(llm, n: int) -> None:
    """Drop a Llama's tokens after the first n (its KV cache too)."""
    if llm.n_tokens > n:
        ctx = llm._ctx
        rm = getattr(ctx, "memory_seq_rm", None) or getattr(ctx, "kv_cache_seq_rm")
        rm(-1, n, -1)
        llm.n_tokens = n


def _draft_model(cfg: dict):
    """llama-cpp-python's draft-model hook (``LlamaDraftModel``) run by a second Llama on the
    draft GGUF: it follows the target's tokens (the longest common prefix kept, the rest
    evaluated) and drafts ``draft_tokens`` greedy tokens; llama-cpp-python's ``generate``
    verifies them with the target in one batch (its speculative decoding)."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class DraftLM(LlamaDraftModel):
        def __init__(self):
            self.llm = Llama(model_path=cfg["draft_gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
                             n_threads_batch=cfg["threads"], seed=0, verbose=False)
            self.n = cfg["draft_tokens"]

        def __call__(self, input_ids, /, **kwargs):
            ids = [int(t) for t in input_ids]
            have = [int(t) for t in self.llm.input_ids[: self.llm.n_tokens]]
            keep = 0
            while keep < min(len(have), len(ids) - 1) and have[keep] == ids[keep]:
                keep += 1
            _truncate(self.llm, keep)
            self.llm.eval(ids[keep:])
            out = []
            vocab = self.llm.n_vocab()
            for _ in range(self.n):  # the last row's logits, the only ones computed (no logits_all)
                tok = int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(vocab,))))
                out.append(tok)
                self.llm.eval([tok])
            return np.array(out, dtype=np.intc)

    return DraftLM()


def _probe(llm, req: dict) -> dict:
    """Forward ms per row count after a context (median of ``reps``), prefill tok/s,
    memory, and the logits of given sequences into a .npy file."""
    import statistics
    import time

    def median_ms(fn, reps):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return round(statistics.median(ts) * 1e3, 3)

    if not req["rows"] and not req["prefill"] and not req.get("sequences"):
        return child_memory()  # memory only
    llm.reset()
    llm.eval(req["ctx"])
    n0 = llm.n_tokens
    fwd = {}
    for m in req["rows"]:
        toks = [(7 * i + 11) % llm.n_vocab() for i in range(m)]

        def step(toks=toks):
            _truncate(llm, n0)
            llm.eval(toks)

        fwd[str(m)] = median_ms(step, req["reps"])
    pre = req["prefill"]

    def prefill():
        llm.reset()
        _truncate(llm, 0)
        llm.eval(pre)

    res = {"forward_ms": fwd,
           "prefill_tok_s": round(len(pre) / (median_ms(prefill, max(1, req["reps"] // 8)) / 1e3), 1)}
    if req.get("sequences") and req.get("logits_file"):
        import numpy as np

        rows = []
        for seq in req["sequences"]:
            llm.reset()
            _truncate(llm, 0)
            llm.eval(seq)
            rows.append(np.array(llm.scores[: len(seq)], dtype=np.float32))
        np.save(req["logits_file"], np.concatenate(rows))
    res.update(child_memory())
    return res


def _load(cfg: dict):
    import llama_cpp
    import llama_cpp.llama_cpp as C
    from llama_cpp import Llama

    if not cfg["extra_bufts"]:
        without_extra_bufts(C)
    kw: dict = {}
    if cfg["pld_tokens"]:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=cfg["pld_tokens"])
    elif cfg.get("draft_gguf"):
        kw["draft_model"] = _draft_model(cfg)
    # a draft model's rounds are sampled at every drafted row: llama-cpp-python needs those rows'
    # logits (without logits_all its verify reads logits that were not computed)
    llm = Llama(model_path=cfg["gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
                n_threads_batch=cfg["threads"], seed=0, verbose=False,
                logits_all=bool(cfg.get("logits_all") or kw.get("draft_model")), **kw)
    return llm, {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "extra_bufts": cfg["extra_bufts"],
                 "threads": cfg["threads"]}


def _answer(llm, req: dict) -> dict:
    import time

    if "probe" in req:
        return {"probe": _probe(llm, req["probe"])}
    stops, out = set(req["stops"]), []
    t0 = time.perf_counter()
    llm.reset()
    for tok in llm.generate(req["ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if tok in stops:
            break
        out.append(int(tok))
        if len(out) >= req["max_new"]:
            break
    return {"tokens": out, "seconds": time.perf_counter() - t0, **child_memory()}


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    sys.exit(serve_child(lambda: _load(cfg), _answer))
