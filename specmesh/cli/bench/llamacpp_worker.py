"""llama.cpp in a child process: the benchmark's llama.cpp peers run here, so a crash
inside llama.cpp (a segmentation fault kills the whole process) cannot take the
benchmark down. ``LlamaCppWorker`` (parent side) starts ``python -m
specmesh.cli.bench.llamacpp_worker`` and speaks JSON lines over its stdin/stdout; the
child loads one GGUF with llama-cpp-python and answers greedy generations of given
prompt token ids (the same ids our systems get, already templated: no chat-completion
path, no re-tokenisation), timing each generation itself.

What was found on the development machine (llama-cpp-python 0.3.36 built from its
sdist with ``-DGGML_NATIVE=ON``, a CPU with AMX): every forward died with SIGSEGV in
``ggml_backend_amx_mul_mat`` (llama.cpp's AMX weight buffers: one of its "extra
buffer types"), with or without torch in the process. With
``llama_model_params.use_extra_bufts = False`` (no AMX / repacked weight buffers)
it runs. The parent first tries llama.cpp's defaults and, when the child dies of a
signal, restarts it once with extra buffer types off and says so in ``info``.

The child imports only llama_cpp and the standard library (no torch, no specmesh
module beyond this one). This module knows nothing about workloads, reports or our
engine.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from typing import Optional, Sequence


class PeerFailed(RuntimeError):
    """The peer cannot (or can no longer) run; the message says why."""


def _describe_exit(rc: Optional[int]) -> str:
    if rc is None:
        return "did not answer"
    if rc < 0:
        try:
            return f"died of {signal.Signals(-rc).name} (signal {-rc})"
        except ValueError:
            return f"died of signal {-rc}"
    return f"exited with status {rc}"


class LlamaCppWorker:
    """Parent side: one child process holding one ``llama_cpp.Llama``."""

    def __init__(self, gguf: str, threads: int, n_ctx: int, pld_tokens: int = 0, timeout_s: float = 600.0,
                 argv: Optional[Sequence[str]] = None, draft_gguf: Optional[str] = None, draft_tokens: int = 0,
                 logits_all: bool = False):
        """``argv``: the child's command line before its JSON config (default: this module
        under the running interpreter; tests put a stand-in child there). ``draft_gguf``:
        llama.cpp's speculative decoding with that model drafting ``draft_tokens`` greedy
        tokens a round (``DraftLM``). ``logits_all``: keep every position's logits (the
        probe's agreement run)."""
        self.argv = list(argv) if argv else [sys.executable, "-m", "specmesh.cli.bench.llamacpp_worker"]
        self.cfg = {"gguf": str(gguf), "threads": int(threads), "n_ctx": int(n_ctx), "pld_tokens": int(pld_tokens),
                    "extra_bufts": True, "draft_gguf": draft_gguf, "draft_tokens": int(draft_tokens),
                    "logits_all": bool(logits_all)}
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.info: dict = {}
        self.notes: list[str] = []
        self._tried_fallback = False

    # ------------------------------------------------------------ process
    def _start(self) -> None:
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve a shared small machine
        self._err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child cannot block on it
        self.proc = subprocess.Popen(self.argv + [json.dumps(self.cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, env=env)
        hello = self._read()
        if "error" in hello:
            self.close()
            raise PeerFailed(f"llama.cpp could not load {self.cfg['gguf']}: {hello['error']}")
        self.info = hello.get("info", {})

    def _read(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            rc = self._exit_code() if ready else None  # EOF: the child is exiting (reap it for its status)
            if rc is None:
                self.proc.kill()
                self.proc.wait()
                raise PeerFailed(f"llama.cpp worker gave no answer within {self.timeout_s:.0f} s")
            self._err.seek(0)
            err = self._err.read().strip().splitlines()
            raise _Died(rc, err[-1][:300] if err else "")
        return json.loads(line)

    def _exit_code(self) -> Optional[int]:
        try:
            return self.proc.wait(timeout=10) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None

    # ------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> tuple[list[int], float]:
        """(tokens without the stop token, seconds measured in the child). Raises
        ``PeerFailed`` when the child dies (after the one fallback restart)."""
        ans = self._ask({"ids": [int(t) for t in prompt_ids], "max_new": int(max_new_tokens),
                         "stops": [int(t) for t in stop_ids]})
        return ans["tokens"], float(ans["seconds"])

    def probe(self, ctx: Sequence[int], rows: Sequence[int], reps: int, prefill: Sequence[int],
              sequences: Optional[list] = None, logits_file: Optional[str] = None) -> dict:
        """The engine probe's measures (``specmesh.cli.bench.engine_probe``) in the child: forward ms
        per scored row count after ``ctx``, the prefill rate of ``prefill``, memory, and the
        logits of ``sequences`` into ``logits_file`` (needs ``logits_all``)."""
        return self._ask({"probe": {"ctx": list(map(int, ctx)), "rows": list(map(int, rows)), "reps": int(reps),
                                    "prefill": list(map(int, prefill)), "sequences": sequences,
                                    "logits_file": logits_file}})["probe"]

    def _ask(self, msg: dict) -> dict:
        req = json.dumps(msg)
        while True:
            try:
                if self.proc is None:
                    self._start()
                self.proc.stdin.write(req + "\n")
                self.proc.stdin.flush()
                ans = self._read()
            except (_Died, BrokenPipeError) as e:
                rc = e.rc if isinstance(e, _Died) else self._exit_code()
                tail = e.stderr_tail if isinstance(e, _Died) else ""
                self.close()
                why = f"llama.cpp worker {_describe_exit(rc)}" + (f" ({tail})" if tail else "")
                if rc is not None and rc < 0 and self.cfg["extra_bufts"] and not self._tried_fallback:
                    self._tried_fallback = True
                    self.cfg["extra_bufts"] = False
                    self.notes.append(f"{why} with llama.cpp's default weight buffers; restarted with "
                                      "use_extra_bufts=False (no AMX / repacked weight buffers)")
                    continue
                raise PeerFailed(why) from None
            if "error" in ans:
                raise PeerFailed(f"llama.cpp: {ans['error']}")
            return ans


class _Died(Exception):
    def __init__(self, rc: int, stderr_tail: str):
        super().__init__(rc)
        self.rc, self.stderr_tail = rc, stderr_tail


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


def _mem() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    k, v = line.split(":", 1)
                    out[k] = round(int(v.split()[0]) / 1024, 1)
    except OSError:
        pass
    return {"peak_rss_mb": out.get("VmHWM"), "rss_mb": out.get("VmRSS")}


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
        return _mem()  # memory only
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
    res.update(_mem())
    return res


def _child(cfg: dict) -> int:
    import time

    try:
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
    except Exception as e:  # noqa: BLE001 - reported to the parent
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps({"info": {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
                               "extra_bufts": cfg["extra_bufts"], "threads": cfg["threads"]}}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if "probe" in req:
            try:
                ans = {"probe": _probe(llm, req["probe"])}
            except Exception as e:  # noqa: BLE001 - reported to the parent
                ans = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(ans), flush=True)
            continue
        stops, out = set(req["stops"]), []
        try:
            t0 = time.perf_counter()
            llm.reset()
            for tok in llm.generate(req["ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                    reset=True):
                if tok in stops:
                    break
                out.append(int(tok))
                if len(out) >= req["max_new"]:
                    break
            ans = {"tokens": out, "seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - reported to the parent
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
