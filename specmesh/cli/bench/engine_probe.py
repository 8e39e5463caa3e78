"""Our engine and llama.cpp side by side below the generation loop: what a forward of 1 ..
16 scored rows costs after a context, the prefill rate, peak and steady memory, and how
closely the two agree on the same GGUF (teacher-forced top-1 agreement and KL).

Each side runs in a child process of its own, one after the other, so its memory is its
own (the bench process holds every system; a child's ``VmHWM`` is what loading that
engine alone costs) and nothing else computes beside it:

- ours: ``python -m specmesh.cli.bench.engine_probe '<json>'`` loads ``LlamaEngine`` (the
  bench's model and dtype), measures, and prints one JSON line;
- llama.cpp: the bench's ``llamacpp_worker`` child answers a ``probe`` request the same
  way (llama-cpp-python's ``eval`` of M tokens after the context is a forward scoring
  M rows).

The agreement: both sides score the same token sequences (the bench's prompts with our
plain decoding's outputs) in one chain, write their fp32 logits to a file, and the
parent compares them position by position. Knows nothing about workloads or reports.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from .peer_process import child_memory

ROWS = (1, 2, 4, 8, 16)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor elsewhere) and its
    int8 extensions, as figures are labelled: "Intel(R) Xeon(R) Processor (AVX-512 VNNI, AMX-INT8)"."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    isa = [n for f, n in (("avx2", "AVX2"), ("avx_vnni", "AVX-VNNI"), ("avx512_vnni", "AVX-512 VNNI"),
                          ("amx_int8", "AMX-INT8")) if f in flags]
    return f"{name} ({', '.join(isa)})" if isa else name


def kernel_path(dtype: str) -> str:
    """The int8 path the GGUF block kernels take here (int4), e.g. "amx (...)"; "" otherwise."""
    if dtype != "int4":
        return ""
    from ...engine import qmatmul

    k = qmatmul.load()
    return k.describe() if k is not None else f"none ({qmatmul.load_error()})"


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 3)


def ours(cfg: dict) -> dict:
    """The child's work for our engine: load, forward curve, prefill, logits."""
    import specmesh

    specmesh.spin_threads()
    import torch

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    from ...engine import LlamaEngine

    t0 = time.perf_counter()
    eng = LlamaEngine.from_pretrained(cfg["model"], dtype=cfg["dtype"], n_slots=2,
                                      max_seq_len=max(2048, cfg["ctx"] + 64, cfg["prefill"] + 8), quiet=True)
    res = {"load_s": round(time.perf_counter() - t0, 2), "after_load": child_memory(), "kernel": kernel_path(cfg["dtype"])}
    V = eng.vocab_size
    if cfg["rows"]:
        ctx = [(100 + i) % V for i in range(cfg["ctx"])]
        eng.reset(0)
        eng.prefill(0, ctx)
        fwd = {}
        for m in cfg["rows"]:
            fwd[str(m)] = _median_ms(lambda m=m: eng.score(0, [(7 * i + 11) % V for i in range(m)],
                                                           list(range(-1, m - 1))), cfg["reps"])
        res["forward_ms"] = fwd
    if cfg["prefill"]:
        pre = [(13 * i + 5) % V for i in range(cfg["prefill"])]

        def prefill():
            eng.reset(1)
            eng.prefill(1, pre)

        res["prefill_tok_s"] = round(cfg["prefill"] / (_median_ms(prefill, max(1, cfg["reps"] // 8)) / 1e3), 1)
    if cfg.get("logits_file") and cfg.get("sequences"):
        rows = []
        for seq in cfg["sequences"]:
            eng.reset(0)
            rows.append(eng.score(0, seq, list(range(-1, len(seq) - 1))).logits.float())
        _save(cfg["logits_file"], torch.cat(rows).numpy())
    res["end"] = child_memory()
    return res


def _save(path: str, arr) -> None:
    import numpy as np

    np.save(path, np.ascontiguousarray(arr, dtype=np.float32))


def run_ours(model: str, dtype: str, threads: int, ctx: int = 300, rows: Sequence[int] = ROWS, reps: int = 15,
             prefill: int = 500, sequences: Optional[list] = None, logits_file: Optional[str] = None,
             timeout_s: float = 1800) -> dict:
    """``ours`` in a child process (its JSON line)."""
    cfg = {"model": model, "dtype": dtype, "threads": threads, "ctx": ctx, "rows": list(rows), "reps": reps,
           "prefill": prefill, "sequences": sequences, "logits_file": logits_file}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        r = subprocess.run([sys.executable, "-m", "specmesh.cli.bench.engine_probe", f.name], capture_output=True,
                           text=True, timeout=timeout_s)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"engine probe failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-400:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def agreement(ours_file: str, peer_file: str, chunk: int = 64) -> dict:
    """Teacher-forced top-1 agreement and mean KL(peer || ours) over the positions both
    files hold (fp32 logits [positions, V] each)."""
    if not (Path(ours_file).exists() and Path(peer_file).exists()):
        return {}
    import numpy as np
    import torch

    a, b = np.load(ours_file, mmap_mode="r"), np.load(peer_file, mmap_mode="r")
    n = min(a.shape[0], b.shape[0])
    same, kl = 0, 0.0
    for i in range(0, n, chunk):
        x = torch.from_numpy(np.array(a[i: i + chunk])).double()
        y = torch.from_numpy(np.array(b[i: i + chunk])).double()
        same += int((x.argmax(-1) == y.argmax(-1)).sum())
        lp, lq = torch.log_softmax(y, -1), torch.log_softmax(x, -1)
        kl += float((lp.exp() * (lp - lq)).sum())
    return {"positions": n, "top1_agreement": round(same / max(n, 1), 4), "kl": round(kl / max(n, 1), 5)}


if __name__ == "__main__":
    cfg = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(ours(cfg)), flush=True)


def vs_llamacpp(model: str, dtype: str, model_dir: Path, threads: int, sequences: list, out_dir: Path,
                ctx: int = 300, rows: Sequence[int] = ROWS, reps: int = 15, prefill: int = 500, log=print,
                reference: bool = True, n_ctx_plain: int = 2048) -> dict:
    """Both probes, one after the other, and their agreement: {"ours": ..., "llamacpp": ...,
    "agreement": ..., "ours_vs_fp32": ..., "llamacpp_vs_fp32": ...}; a side that cannot run
    gives {"error": why}. ``sequences``: token id lists both sides score (the agreement's
    positions); ``reference``: also score them with our fp32 engine on the same weights (the
    GGUF dequantised), so each side's distance from the model's own values shows beside
    their distance from each other."""
    from .llamacpp_worker import LlamaCppWorker, PeerFailed
    from .peers import gguf_path

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx_ids = [(100 + i) % 1000 for i in range(ctx)]
    pre_ids = [(13 * i + 5) % 1000 for i in range(prefill)]
    res: dict = {"ctx": ctx, "rows": list(rows), "reps": reps, "prefill_tokens": prefill, "threads": threads,
                 "n_ctx_plain": n_ctx_plain,
                 "sequences": len(sequences), "positions": sum(len(s) for s in sequences)}
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        ours_file, peer_file = str(Path(tmp) / "ours.npy"), str(Path(tmp) / "llamacpp.npy")
        ref_file = str(Path(tmp) / "fp32.npy")
        log(f"probe: our engine ({dtype}) in a child process")
        try:
            res["ours"] = run_ours(model, dtype, threads, ctx, rows, reps, prefill, sequences, ours_file)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            res["ours"] = {"error": str(e)}
        gguf = gguf_path(model, model_dir)
        log("probe: llama.cpp in a child process")
        if gguf is None:
            res["llamacpp"] = {"error": "no GGUF"}
        else:
            n_ctx = max(ctx + max(rows) + 8, prefill + 8, max((len(s) for s in sequences), default=0) + 8)
            w = LlamaCppWorker(str(gguf), threads, n_ctx, logits_all=True)
            try:
                res["llamacpp"] = w.probe(ctx_ids, rows, reps, pre_ids, sequences, peer_file)
                res["llamacpp"]["notes"] = w.notes
            except PeerFailed as e:
                res["llamacpp"] = {"error": str(e)}
            finally:
                w.close()
            # its memory as a user runs it (the bench's n_ctx, only the last row's logits kept: a
            # logits_all instance holds n_ctx x vocab fp32 scores, 1.2 GB for Qwen at 2048)
            w = LlamaCppWorker(str(gguf), threads, n_ctx_plain)
            try:
                w.generate(ctx_ids[:64], 16, [])
                res["llamacpp"]["memory"] = w.probe([], [], 1, [])
            except PeerFailed as e:
                res["llamacpp"]["memory"] = {"error": str(e)}
            finally:
                w.close()
        if reference and sequences:  # both against the model's own values: the GGUF dequantised, fp32 throughout
            log("probe: the fp32 engine on the same weights (the reference both are measured against)")
            try:
                run_ours(model, "fp32", threads, rows=(), prefill=0, sequences=sequences, logits_file=ref_file)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                res["reference_error"] = str(e)
        res["agreement"] = agreement(ours_file, peer_file)
        res["ours_vs_fp32"] = agreement(ours_file, ref_file)
        res["llamacpp_vs_fp32"] = agreement(peer_file, ref_file)
    return res
