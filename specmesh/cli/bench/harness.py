"""Run a benchmark in one process: build the systems, warm each up, then run every
prompt on every system back to back (the order rotates per prompt) so machine
drift hits all systems alike, and aggregate one record per (system, workload).
With ``repeats`` N > 1 the whole rotation runs N times (each pass rotated once more,
our systems built afresh for each pass so no drafter learns from an earlier pass's
outputs) and each (system, prompt) keeps its fastest run, as ``timeit`` does: on a
shared machine a neighbour's burst slows a few runs in a row, whichever system they
belong to, and the fastest of N filters it for every system alike.

Records carry new tokens, seconds, tokens/s, speedup over the system's own AR
(measured side by side in this run), τ, the acceptance histogram, token identity
with the reference AR (per prompt, all identical), for a peer also with our plain
decoding (``ours_ar``), and the process-wide peak RSS at the time the record's last
prompt finished (a peer in a child process: the child's own).

This module knows nothing about report formats or charts (``report``, ``charts``)
or about gRPC (``sweep``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from ...seqs import common_prefix_len
from ...types import InvalidArgument
from ... import workloads as wl
from .peer_process import PeerFailed
from .peers import HFModels, make_hf, make_llamacpp, make_openvino, peer_unavailable
from .systems import CHILD_FAMILIES, DEFAULT_SYSTEMS, DTYPES, RunOutput, System, expand, make_ours, parse_ours

WARMUP_PROMPT = "Say hello and name three colours."
RECORD_FIELDS = ("system", "workload", "prompts", "new_tokens", "seconds", "tokens_per_s", "speedup_vs_own_ar",
                 "tau", "acceptance_hist", "identical_to_ar", "identical_prompts", "token_agreement", "reference",
                 "draft_s", "verify_s", "peak_rss_mb", "dtype", "budget", "identical_to_ours_ar",
                 "agreement_with_ours_ar")


@dataclass
class BenchConfig:
    workloads: Optional[list[str]] = None  # None = every file in the workloads directory
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    max_new_tokens: int = 128
    prompts: Optional[int] = None  # per workload; None = all
    dtype: str = "bf16"
    budget: int = 8
    adaptive: bool = True  # ours_*: AdaptiveBudget(budget) (what users run); False = always draft budget
    out: str = "bench-out"
    model: str = "smollm2-135m-instruct"
    workloads_dir: Optional[str] = None
    slots: int = 2
    max_seq_len: int = 2048
    threads: Optional[int] = None
    progress: bool = True
    charts: bool = True
    device: str = "cpu"  # auto | cpu | cuda | cuda:N: our engines and the HF peers
    cuda_graphs: bool = True  # on CUDA: GraphedEngine (False: the eager engine)
    hf_dtype: str = "fp32"  # the HF peers' dtype (fp32 | bf16)
    repeats: int = 1  # passes over every prompt and system; each (system, prompt) keeps its fastest
    # with llama.cpp in the run: both engines below the loop (forward cost by scored rows, prefill,
    # memory, teacher-forced agreement on our plain decoding's outputs; ``engine_probe``)
    probe: bool = True


def rotated(systems: list, k: int) -> list:
    """The systems in the order the ``k``-th prompt runs them: rotated by ``k``, so no
    system always follows the same one (the bench bumps ``k`` once per prompt and once
    more per pass; ``specmesh demo`` runs the same schedule)."""
    n = len(systems)
    return systems[k % n:] + systems[: k % n] if n else []


def faster(new_seconds: float, kept_seconds: Optional[float]) -> bool:
    """Whether a repeated pass replaces the one kept: each (system, prompt) keeps its
    fastest pass, as ``timeit`` does (a neighbour's burst slows a few runs in a row,
    whichever system they belong to; the fastest of N filters it for all alike)."""
    return kept_seconds is None or new_seconds < kept_seconds


def peak_rss_mb() -> float:
    """Process-wide peak resident set size (max of VmHWM and ru_maxrss), MiB."""
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak_kb = max(peak_kb, int(line.split()[1]))
    except OSError:
        pass
    return peak_kb / 1024.0


class Bench:
    """One benchmark run; ``run()`` returns ``{"meta": ..., "records": [...], "outputs": [...]}``."""

    def __init__(self, cfg: BenchConfig, log=print, runtimes: Optional[dict] = None):
        """``runtimes``: already loaded ``Runtime`` objects by dtype to reuse (tests)."""
        self.cfg = cfg
        self.log = log
        self.runtimes: dict = dict(runtimes or {})
        self.systems: list[System] = []
        self.skipped: dict[str, str] = {}
        self.rss_stages: list[dict] = []

    # ------------------------------------------------------------ setup
    def runtime(self, dtype: str):
        if dtype not in self.runtimes:
            from ...runtime import Runtime

            main = self.runtimes.get(self.cfg.dtype)
            self.runtimes[dtype] = Runtime(self.cfg.model, dtype=dtype, n_slots=self.cfg.slots,
                                           max_seq_len=main.max_seq_len if main else self.cfg.max_seq_len,
                                           quiet=True, device=self.cfg.device, cuda_graphs=self.cfg.cuda_graphs)
        return self.runtimes[dtype]

    def _stage(self, what: str) -> None:
        self.rss_stages.append({"stage": what, "peak_rss_mb": round(peak_rss_mb(), 1)})

    def build(self, names: list[str]) -> None:
        from ...runtime import default_draft_model

        main = self.runtime(self.cfg.dtype)
        ours = [n for n in names if n.startswith("ours_")]
        peers = [n for n in names if not n.startswith("ours_")]
        for n in ours:
            self.systems.append(self._ours(n))
        self._stage("specmesh systems loaded")
        self._warmup(self.systems)
        self._stage("specmesh systems warmed up (before any peer is loaded)")
        hf = HFModels(main.model_dir, lambda: default_draft_model(self.cfg.model), device=_device_of(main),
                      dtype=self.cfg.hf_dtype)
        threads = self.cfg.threads or _torch_threads()
        first_peer = len(self.systems)
        for n in peers:
            if n == "hf_static_compile":  # compiled at its warm-up: a refusal skips it, with the reason
                try:
                    static = make_hf(n, hf, main.stop_ids, max_cache_len=main.max_seq_len)
                    self._warmup([static])
                except Exception as e:  # noqa: BLE001 - reported, the rest of the run goes on
                    why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                    self.skipped[n] = why
                    self.log(f"note: skipping {n}: {why}")
                    continue
                self.systems.append(static)
            elif n.startswith("hf_"):
                self.systems.append(make_hf(n, hf, main.stop_ids))
            else:  # llama.cpp, OpenVINO GenAI: a child process each
                why = peer_unavailable(n, self.cfg.model, main.model_dir)
                if why:
                    self.skipped[n] = why
                    self.log(f"note: skipping {n}: {why}")
                    continue
                try:
                    child = (make_llamacpp(n, self.cfg.model, main.model_dir, main.stop_ids, threads,
                                           self.cfg.max_seq_len) if n.startswith("llamacpp_") else
                             make_openvino(n, self.cfg.model, main.model_dir, main.stop_ids, threads, log=self.log))
                except Exception as e:  # noqa: BLE001 - preparing its model failed: reported, the run goes on
                    self.skipped[n] = f"{type(e).__name__}: {e}"
                    self.log(f"note: skipping {n}: {self.skipped[n]}")
                    continue
                try:  # warmed up here: a peer that cannot run is skipped with the reason
                    self._warmup([child])
                except PeerFailed as e:
                    self._drop(child, f"{e} (during warm-up)")
                    continue
                self.systems.append(child)
        self._warmup([s for s in self.systems[first_peer:] if s.name != "hf_static_compile"
                      and s.family not in CHILD_FAMILIES])
        self._stage("all systems loaded and warmed up")

    def _ours(self, name: str) -> System:
        """An ``ours_*`` system on the runtime of its dtype (a new drafter where it has one)."""
        return make_ours(name, self.runtime(parse_ours(name, self.cfg.dtype)[1]), self.cfg.budget, self.cfg.dtype,
                         adaptive=self.cfg.adaptive)

    def _drop(self, s: System, why: str) -> None:
        """Skip a peer from here on (its child process died or cannot start)."""
        self.skipped[s.name] = why
        self.log(f"note: skipping {s.name}: {why}")
        close = getattr(s, "close", None)
        if close is not None:
            close()
        if s in self.systems:
            self.systems.remove(s)

    def _warmup(self, systems: list[System]) -> None:
        if not systems:
            return
        ids = self.runtime(self.cfg.dtype).encode(WARMUP_PROMPT)
        for s in systems:
            s.run(ids, min(16, self.cfg.max_new_tokens))

    # ------------------------------------------------------------ run
    def run(self) -> dict:
        cfg = self.cfg
        if cfg.dtype not in DTYPES:
            raise InvalidArgument("dtype", f"must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
        if cfg.max_new_tokens <= 0:
            raise InvalidArgument("max_new_tokens", f"must be positive, got {cfg.max_new_tokens}")
        if cfg.budget <= 0:
            raise InvalidArgument("budget", f"must be positive, got {cfg.budget}")
        if cfg.repeats < 1:
            raise InvalidArgument("repeats", f"must be at least 1, got {cfg.repeats}")
        names = expand(cfg.systems)
        loads = wl.load(cfg.workloads, cfg.prompts, Path(cfg.workloads_dir) if cfg.workloads_dir else None)
        if not cfg.threads:
            return self._run(cfg, names, loads)
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(cfg.threads)  # process-wide; restored afterwards
        try:
            return self._run(cfg, names, loads)
        finally:
            torch.set_num_threads(before)

    def _run(self, cfg: BenchConfig, names: list[str], loads: dict) -> dict:
        t_start = time.time()
        main = self.runtime(cfg.dtype)
        encoded = {w: [(p, main.encode(p.prompt, p.messages)) for p in ps] for w, ps in loads.items()}
        longest = max(len(ids) for ps in encoded.values() for _, ids in ps)
        if longest + cfg.max_new_tokens + cfg.budget + 2 > main.max_seq_len:
            raise InvalidArgument("max_new_tokens", f"prompt ({longest} tokens) + max_new_tokens exceeds "
                                                    f"max_seq_len {main.max_seq_len}")
        self.build(names)
        runs: dict[tuple[str, str], list[tuple[str, RunOutput, float]]] = {}
        times: dict[tuple[str, str, str], list[float]] = {}  # (system, workload, prompt) -> every pass's seconds
        unstable: list[str] = []  # (system prompt) whose passes generated different tokens
        total = sum(len(v) for v in encoded.values()) * len(self.systems) * cfg.repeats
        bar = _progress(total, cfg.progress)
        k = 0
        for rep in range(cfg.repeats):
            if rep:  # our systems afresh: no drafter state (a suffix tree's outputs) carried into this pass
                self.systems = [self._ours(s.name) if s.family == "ours" else s for s in self.systems]
                self._warmup([s for s in self.systems if s.family == "ours"])
                k += 1  # each pass rotated once more, so no system always follows the same one
            for w, items in encoded.items():
                for p, ids in items:
                    order = rotated(self.systems, k)
                    k += 1
                    for s in order:
                        if s not in self.systems:  # dropped earlier in this rotation
                            continue
                        bar.set_description(f"{w} {p.id} {s.name}" + (f" (pass {rep + 1})" if cfg.repeats > 1 else ""))
                        try:
                            out = s.run(ids, p.budget(cfg.max_new_tokens))
                        except PeerFailed as e:  # a peer's child process died: the run goes on without it
                            done = sum(len(v) for (n, _), v in runs.items() if n == s.name)
                            self._drop(s, f"{e} (after {done} generations; its partial results are dropped)")
                            for key in [key for key in runs if key[0] == s.name]:
                                del runs[key]
                            continue
                        times.setdefault((s.name, w, p.id), []).append(out.seconds)
                        rs = runs.setdefault((s.name, w), [])
                        old = next((i for i, r in enumerate(rs) if r[0] == p.id), None)
                        peak = out.peak_rss_mb or peak_rss_mb()  # a child process's own, else this one's
                        if old is None:
                            rs.append((p.id, out, peak))
                        else:
                            if out.tokens != rs[old][1].tokens:  # a pass generated other tokens: reported
                                unstable.append(f"{s.name} {p.id}")
                            if faster(out.seconds, rs[old][1].seconds):  # the fastest pass of this prompt
                                rs[old] = (p.id, out, peak)
                        bar.update(1)
        bar.close()
        for s in self.systems:
            close = getattr(s, "close", None)
            if close is not None:
                close()
        self._stage("end of run")
        probe = self._probe(cfg, main, encoded, runs) if cfg.probe else None
        from .engine_probe import cpu_model, kernel_path

        records = self.aggregate(list(encoded), runs)
        outputs = [{"system": s, "workload": w, "id": pid, "tokens": o.tokens, "seconds": round(o.seconds, 4),
                    "seconds_all": [round(t, 4) for t in times.get((s, w, pid), [])],
                    "text": main.decode(o.tokens)} for (s, w), rs in runs.items() for pid, o, _ in rs]
        meta = {
            "config": asdict(cfg), "systems": [s.name for s in self.systems], "skipped": self.skipped,
            "workloads": {w: len(v) for w, v in encoded.items()}, "verifier": _info(main),
            "peers": {s.name: s.info for s in self.systems if s.family != "ours"},
            "rss_stages": self.rss_stages, "peak_rss_mb": round(peak_rss_mb(), 1),
            "torch_threads": _torch_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "(unset)"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
            "wall_s": round(time.time() - t_start, 1), "python": sys.version.split()[0],
            "hf_pld_tokens": 10, "device": str(_device_of(main)), "repeats": cfg.repeats,
            "cpu": cpu_model(), "cpus": os.cpu_count(), "int8_path": kernel_path(cfg.dtype),
            "unstable_outputs": unstable,
            "cuda_graphs": type(main.engine).__name__ == "GraphedEngine",
        }
        if probe is not None:
            meta["vs_llamacpp"] = probe
        return {"meta": meta, "records": records, "outputs": outputs}

    def _probe(self, cfg: BenchConfig, main, encoded: dict, runs: dict) -> Optional[dict]:
        """``engine_probe.vs_llamacpp`` where llama.cpp ran in this run: the agreement on the
        prompts with our plain decoding's outputs (at most 2 sequences per workload, 256
        positions each)."""
        if "llamacpp_ar" not in [s.name for s in self.systems] or _device_of(main).type != "cpu":
            return None
        from .engine_probe import vs_llamacpp

        ref = f"ours_ar_{cfg.dtype}" if any(n == f"ours_ar_{cfg.dtype}" for n, _ in runs) else "ours_ar"
        seqs = []
        for w, items in encoded.items():
            outs = {pid: o.tokens for pid, o, _ in runs.get((ref, w), [])}
            for p, ids in items[:2]:
                if p.id in outs:
                    seqs.append((list(ids) + list(outs[p.id]))[:256])
        return vs_llamacpp(cfg.model, cfg.dtype, main.model_dir, cfg.threads or _torch_threads(), seqs,
                           Path(cfg.out), log=self.log, n_ctx_plain=cfg.max_seq_len)

    def aggregate(self, workloads: list[str], runs: dict) -> list[dict]:
        by_name = {s.name: s for s in self.systems}
        tokens = {key: {pid: o.tokens for pid, o, _ in rs} for key, rs in runs.items()}
        records = []
        for s in self.systems:
            for w in workloads:
                rs = runs.get((s.name, w), [])
                new = sum(len(o.tokens) for _, o, _ in rs)
                secs = sum(o.seconds for _, o, _ in rs)
                rec = {"system": s.name, "workload": w, "prompts": len(rs), "new_tokens": new,
                       "seconds": round(secs, 4), "tokens_per_s": round(new / secs, 3) if secs > 0 else 0.0,
                       "dtype": s.dtype, "budget": s.budget, "reference": s.reference,
                       "peak_rss_mb": round(max((m for _, _, m in rs), default=peak_rss_mb()), 1)}
                dt = sum(o.decode_tokens or 0 for _, o, _ in rs)
                df = sum(o.decode_forwards or 0 for _, o, _ in rs)
                have_tau = all(o.decode_forwards is not None for _, o, _ in rs) and df > 0
                rec["tau"] = round(dt / df, 4) if have_tau else None
                hists = [o.accept_hist for _, o, _ in rs]
                rec["acceptance_hist"] = _sum_hists(hists) if s.speculative and hists and all(
                    h is not None for h in hists) else None
                for key in ("draft_s", "verify_s"):
                    vals = [getattr(o, key) for _, o, _ in rs]
                    rec[key] = round(sum(vals), 4) if vals and all(v is not None for v in vals) else None
                same, both, agree = _compare(tokens.get((s.name, w), {}),
                                             tokens.get((s.reference, w)) if s.reference in by_name else None)
                rec.update(identical_to_ar=None if same is None else same == both, identical_prompts=same,
                           token_agreement=agree)
                if s.family != "ours":  # a peer's outputs against our plain decoding (of the run's dtype) too
                    same, _, agree = _compare(tokens.get((s.name, w), {}),
                                              tokens.get(("ours_ar", w)) if "ours_ar" in by_name else None)
                    rec.update(identical_to_ours_ar=same, agreement_with_ours_ar=agree)
                records.append(rec)
        tps = {(r["system"], r["workload"]): r["tokens_per_s"] for r in records}
        for r in records:
            base = tps.get((by_name[r["system"]].reference, r["workload"]))
            r["speedup_vs_own_ar"] = round(r["tokens_per_s"] / base, 4) if base else None
        return [{k: r.get(k) for k in RECORD_FIELDS} for r in records]


def _compare(mine: dict, ref: Optional[dict]) -> tuple[Optional[int], int, Optional[float]]:
    """(prompts whose tokens equal the reference's, prompts compared, agreement: the common
    prefixes' share of the reference's tokens) over the prompts both have ({prompt id:
    tokens} each); (None, 0, None) without a reference."""
    if ref is None:
        return None, 0, None
    both = [pid for pid in mine if pid in ref]  # a reference that broke early lacks some
    agree = sum(common_prefix_len(mine[pid], ref[pid]) for pid in both)
    ref_len = sum(len(ref[pid]) for pid in both)
    return sum(mine[pid] == ref[pid] for pid in both), len(both), round(agree / ref_len, 4) if ref_len else 1.0


def _sum_hists(hists: list[list[int]]) -> list[int]:
    out = [0] * max((len(h) for h in hists), default=0)
    for h in hists:
        for i, c in enumerate(h):
            out[i] += c
    return out


def _info(runtime) -> dict:
    i = runtime.verifier.info()
    return {k: i.get(k) for k in ("model", "dtype", "vocab_size", "slots_total", "max_seq_len", "kv_bytes_per_slot",
                                  "kv_bytes_total", "weight_bytes", "self_drafters")}


def _device_of(runtime):
    import torch

    return getattr(runtime, "device", None) or torch.device("cpu")


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class _NoBar:
    def set_description(self, *_a): pass

    def update(self, *_a): pass

    def close(self): pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="gen", file=sys.stderr, dynamic_ncols=True)


def save(result: dict, out_dir: Path) -> Path:
    """results.json (meta + records) and outputs.jsonl (every generation's tokens and text)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"meta": result["meta"], "records": result["records"]},
                                                     indent=2))
    with open(out_dir / "outputs.jsonl", "w", encoding="utf-8") as f:
        for o in result["outputs"]:
            f.write(json.dumps(o) + "\n")
    return out_dir / "results.json"
