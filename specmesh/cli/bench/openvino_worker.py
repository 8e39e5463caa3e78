"""OpenVINO GenAI in a child process: the benchmark's ``openvino_*`` peers run here
(``peer_process``: a crash cannot end the benchmark, the peer's memory is its own).
``OpenVinoWorker`` (parent side) starts ``python -m specmesh.cli.bench.openvino_worker``;
the child builds one ``openvino_genai.LLMPipeline`` on the target's GGUF (OpenVINO
GenAI's own GGUF reader; it keeps the 4-bit weights) on the CPU with ``threads``
inference threads, and answers greedy generations of given prompt token ids (the ids
our systems get, already templated: no chat template, no re-tokenisation), timing
each ``generate`` itself. Modes:

  ar        plain decoding
  draft_lm  its speculative decoding: ``draft_model=`` the paired draft model, which
            ``draft_model()`` takes as an exported OpenVINO model directory, not a GGUF.
            The directory is made once, here (``prepared_draft``): the draft GGUF re-packed
            where OpenVINO's reader lacks its block types (``specmesh.models.gguf_repack``,
            in this child so its memory is not the bench's), then ``LLMPipeline(draft_gguf,
            enable_save_ov_model=True)`` writes ``openvino_model.xml``/``.bin`` and the
            tokenizer models beside the GGUF it read; ``exported.json`` marks it done.
  pld       its prompt-lookup decoding (``prompt_lookup=True``; ``num_assistant_tokens``
            and ``max_ngram_size`` in the generation config)

Each answer carries the tokens (without the stop token), the seconds, the tokens and
target inference steps after the prefill as OpenVINO GenAI's perf metrics count them
(``raw_metrics.token_infer_durations``: one entry a step of the target), and the
child's peak RSS.

The child imports only openvino_genai, openvino, numpy, the standard library,
``peer_process`` and (to prepare the draft) ``specmesh.models.gguf_repack`` with gguf-py. This module knows nothing about workloads, reports or our engine.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .peer_process import PeerProcess, child_memory, serve_child

MODES = ("ar", "draft_lm", "pld")
EXPORTED = "exported.json"  # written into the draft's directory once its OpenVINO model is saved there


class OpenVinoWorker(PeerProcess):
    """Parent side: one child process holding one ``openvino_genai.LLMPipeline``."""

    label = "OpenVINO GenAI"
    module = "specmesh.cli.bench.openvino_worker"

    def __init__(self, gguf: str, threads: int, mode: str = "ar", draft_gguf: Optional[str] = None,
                 draft_source: Optional[str] = None, assistant_tokens: int = 0, max_ngram_size: int = 0,
                 timeout_s: float = 1200.0, argv: Optional[Sequence[str]] = None):
        """``draft_gguf`` (mode draft_lm): where the draft's GGUF that OpenVINO GenAI's reader
        takes is (or is made from ``draft_source``), alone in its directory: the exported
        model is written beside it. ``assistant_tokens``: draft tokens a round (draft_lm) or
        looked-up tokens a round (pld); ``max_ngram_size``: the longest n-gram prompt lookup
        matches (pld)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        super().__init__({"gguf": str(gguf), "threads": int(threads), "mode": mode, "draft_gguf": draft_gguf,
                          "draft_source": draft_source, "assistant_tokens": int(assistant_tokens),
                          "max_ngram_size": int(max_ngram_size)}, timeout_s=timeout_s, argv=argv)


# ---------------------------------------------------------------- child side
def prepared_draft(draft_gguf: str, source: Optional[str], threads: int) -> str:
    """The OpenVINO model directory of the draft (``draft_gguf``'s own directory), made
    once: ``draft_gguf`` re-packed from ``source`` where it is missing
    (``specmesh.models.gguf_repack``: the block types OpenVINO's reader lacks), then
    exported there by loading it with ``enable_save_ov_model``."""
    import openvino_genai as ov_genai

    d = Path(draft_gguf).parent
    if not Path(draft_gguf).exists():
        from ...models.gguf_repack import repack_gguf

        done = repack_gguf(Path(source), Path(draft_gguf))
        (d / "repacked.json").write_text(json.dumps({"from": source, "repacked": done}))
    if not (d / EXPORTED).exists() or not (d / "openvino_model.xml").exists():
        t0 = time.perf_counter()
        pipe = ov_genai.LLMPipeline(str(draft_gguf), "CPU", enable_save_ov_model=True, INFERENCE_NUM_THREADS=threads)
        del pipe
        missing = [f for f in ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml")
                   if not (d / f).exists()]
        if missing:
            raise RuntimeError(f"loading {draft_gguf} with enable_save_ov_model=True wrote no {', '.join(missing)} "
                               f"in {d}")
        (d / EXPORTED).write_text(json.dumps({"from": str(draft_gguf), "openvino_genai": ov_genai.__version__,
                                              "seconds": round(time.perf_counter() - t0, 1)}))
    return str(d)


def _load(cfg: dict):
    import openvino_genai as ov_genai

    t0 = time.perf_counter()
    props = {"INFERENCE_NUM_THREADS": cfg["threads"]}
    kw: dict = {}
    info = {"openvino_genai": ov_genai.__version__, "threads": cfg["threads"], "mode": cfg["mode"],
            "properties": dict(props)}
    if cfg["mode"] == "draft_lm":
        d = prepared_draft(cfg["draft_gguf"], cfg["draft_source"], cfg["threads"])
        kw["draft_model"] = ov_genai.draft_model(d, "CPU", **props)
        info.update(draft_model_dir=d, num_assistant_tokens=cfg["assistant_tokens"])
    elif cfg["mode"] == "pld":
        kw["prompt_lookup"] = True
        info.update(num_assistant_tokens=cfg["assistant_tokens"], max_ngram_size=cfg["max_ngram_size"])
    pipe = ov_genai.LLMPipeline(cfg["gguf"], "CPU", **kw, **props)
    info.update(load_s=round(time.perf_counter() - t0, 1), after_load=child_memory())
    return (pipe, cfg), info


def _answer(peer, req: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    pipe, cfg = peer
    gc = ov_genai.GenerationConfig(max_new_tokens=int(req["max_new"]), do_sample=False)
    gc.stop_token_ids = set(int(t) for t in req["stops"])
    if cfg["mode"] in ("draft_lm", "pld"):
        gc.num_assistant_tokens = cfg["assistant_tokens"]
    if cfg["mode"] == "pld":
        gc.max_ngram_size = cfg["max_ngram_size"]
    ids = ov.Tensor(np.array([req["ids"]], dtype=np.int64))
    t0 = time.perf_counter()
    res = pipe.generate(ids, gc)
    secs = time.perf_counter() - t0
    raw = [int(t) for t in res.tokens[0]]
    stops, out = set(req["stops"]), []
    for t in raw[: req["max_new"]]:
        if t in stops:
            break
        out.append(t)
    produced = min(len(raw), len(out) + 1)  # the stop token, where one ended the generation, was produced too
    steps = len(res.perf_metrics.raw_metrics.token_infer_durations)  # target inference steps, prefill included
    return {"tokens": out, "seconds": secs, "decode_tokens": max(produced - 1, 0),
            "decode_forwards": max(steps - 1, 0), **child_memory()}


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    sys.exit(serve_child(lambda: _load(cfg), _answer))
