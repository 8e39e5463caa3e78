"""``specmesh device-check``: what a CUDA machine says about specmesh, in a few minutes.

On a machine where ``torch.cuda.is_available()``:

1. runs the CUDA tests and the Triton kernel tests (``pytest -m cuda tests/deploy/test_cuda.py
   tests/kernels``; a failed capture fails them) in a subprocess;
2. times one engine forward scoring 1, 4, 16 tokens (and 4 sessions x 9 tokens) on
   ``GraphedEngine`` (CUDA graphs) and on the eager ``LlamaEngine``;
3. a short benchmark, same prompts for every system, order rotating per prompt, bf16,
   greedy, ``--max-new-tokens`` (128): our plain decoding and ``self:block_tree`` on
   both engines, ``self:block`` (its chain: on CPUs without the key-list attention
   it was the faster one) and ``self:uno`` / ``self:uno_tree`` (the mask-gated adapter's fused rounds)
   on the graphed one, Hugging Face ``generate`` eager and with ``cache_implementation=
   "static"`` + ``torch.compile`` (``hf_static_compile``), on a few ``open_writing`` and
   ``chat_multiturn`` bench prompts;
4. with the time left, the services side by side (``specmesh bench-strategies
   --device ...`` in a subprocess: verifier, drafter and router servers on loopback):
   plain, ``self:block_tree`` and ``external:block_tree`` (the block drafter on the
   drafter service, fed hidden features through the router), with the
   external/self ratio it prints;
5. with the time left, concurrent streams through the services (``specmesh bench-sweep
   --serve --device ...``: 1, 8 and 32 streams, plain against ``self:block_tree``);
6. last, the diffusion mode (``specmesh.uno.diffusion`` on the eager engine with the adapter):
   plain unmasking against trajectory speculation with the guess tree (block 5 with 64
   states, block 7 with 128), target forwards per block, rows per forward, tokens/s
   and identity, on the same prompts (``--diffusion-tokens``, 48) — whether the wide
   forwards that cost tokens/s on a CPU are free here;

and writes ``results.json`` and ``report.md`` to ``--out``, again after every phase (a
check stopped from outside leaves what it measured); a phase that breaks is reported and
the next one runs. Each phase, and each compile or capture inside one (the runtimes'
start-up warm-up, the Hugging Face ``torch.compile`` warm-up), checks the time left
(``--budget-s``, default 280 s) first and is skipped, with a note, when it would not
fit; what each took is reported (``warmups``).

``--phase`` splits the check over the calls of a staged loan (``scripts/gpu-stage``):
``model-free`` needs no model weights (the first call, while the GGUF's parts are still
arriving): the kernel tests and the tiny-model CUDA tests (``pytest -m "cuda and not
slow"``), then a random-weight model with the target's config (``config.json`` staged
in the first part; speed does not depend on the weights): one forward on
``GraphedEngine`` and on the eager engine, and plain greedy decoding of a fixed length,
ours (graphed) against Hugging Face static cache + ``torch.compile``. ``model`` (the
last call, the GGUF assembled): the real-model CUDA tests (``-m "cuda and slow"``) and
phases 2-6. ``all`` (the default): everything the real model needs, as before. Exit status: 0 all ran and the tests passed, 1 a test failed or a phase
broke, 3 no CUDA here (said in one line; nothing crashes). ``--allow-cpu`` runs the
same steps on the CPU to check the script itself (numbers meaningless there).

Imports nothing heavy at module level (the CLI parser imports it).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[3]
WORKLOADS = ("open_writing", "chat_multiturn")


def add_arguments(p) -> None:
    p.add_argument("--out", default="device-check-out", help="directory for results.json and report.md")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cuda", help="cuda | cuda:N (cpu only with --allow-cpu)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload (open_writing, chat_multiturn)")
    p.add_argument("--budget-s", type=float, default=280.0, help="wall-clock budget of the whole check")
    p.add_argument("--diffusion-tokens", type=int, default=48, help="new tokens per prompt in the diffusion phase")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m cuda")
    p.add_argument("--no-hf", action="store_true", help="leave the Hugging Face systems out")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU (checks the script, not the GPU)")
    p.add_argument("--phase", choices=("all", "model-free", "model"), default="all",
                   help="model-free: what needs no model weights (the first call of a staged loan); model: the rest")


def _env(device) -> dict:
    import torch

    d = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_build": torch.version.cuda,
         "device": str(device)}
    try:
        import transformers

        d["transformers"] = transformers.__version__
    except ImportError:
        d["transformers"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        d.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    return d


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- phases
TEST_SETS = {"all": ("cuda", ["tests/deploy/test_cuda.py", "tests/kernels"]),
             "model-free": ("cuda and not slow", ["tests/deploy/test_cuda.py", "tests/kernels"]),
             "model": ("cuda and slow", ["tests/deploy/test_cuda.py"])}


def run_tests(timeout_s: float, phase: str = "all") -> dict:
    """``pytest -m <marks> <files>`` (``TEST_SETS[phase]``: the CUDA tests and the Triton
    kernel tests) in a subprocess; counts and the output's tail."""
    marks, files = TEST_SETS[phase]
    paths = [ROOT / f for f in files]
    missing = [str(f) for f in paths if not f.exists()]
    if missing:
        return {"ran": False, "reason": f"{', '.join(missing)} not found (run from a source checkout)"}
    cmd = [sys.executable, "-m", "pytest", "-m", marks, *map(str, paths), "-q", "-rs", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-3000:]
        return {"ran": True, "rc": None, "reason": f"timed out after {timeout_s:.0f} s",
                "tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    text = out.stdout + out.stderr
    last = text.strip().splitlines()[-1] if text.strip() else ""
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", last)}
    return {"ran": True, "rc": out.returncode, "seconds": round(time.perf_counter() - t0, 1), "counts": counts,
            "tail": text[-3000:], "command": " ".join(cmd[2:])}


def time_forwards(engine, prompt: list[int], device, reps: int = 20) -> list[dict]:
    """Median / p10 / p90 ms of one ``score`` (chain of n tokens after the prompt) and of a
    4-session ``score_batch``; the slots are reset afterwards."""
    rows = []
    engine.reset(0)
    engine.prefill(0, prompt)
    cases = [(f"1 x {n}", [(0, prompt[:n], list(range(-1, n - 1)))]) for n in (1, 4, 16)]
    if engine.n_slots >= 4:
        for s in range(1, 4):
            engine.reset(s)
            engine.prefill(s, prompt[: len(prompt) - 3 * s])
        cases.append(("4 x 9", [(s, prompt[:9], list(range(-1, 8))) for s in range(4)]))
    for label, items in cases:
        for _ in range(3):
            engine.score_batch(items)
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            out = engine.score_batch(items)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            del out
        q = statistics.quantiles(times, n=10)
        rows.append({"engine": type(engine).__name__, "sessions x tokens": label,
                     "median_ms": round(statistics.median(times), 3), "p10_ms": round(q[0], 3),
                     "p90_ms": round(q[-1], 3)})
    for s in range(min(engine.n_slots, 4)):
        engine.reset(s)
    return rows


HF_COMPILE_S = 150.0  # what the Hugging Face static-cache torch.compile warm-up may take (checked before it)


def build_systems(rts: dict, hf_models, budget: int, log, deadline: Optional[float] = None,
                  warmups: Optional[dict] = None) -> tuple[list, dict]:
    """Our systems on each runtime (tag -> Runtime), then the HF peers; (systems, skipped).
    ``deadline``: the HF compile is skipped (noted) when less than ``HF_COMPILE_S`` is
    left; ``warmups`` gets the seconds it took."""
    from dataclasses import replace

    from .peers import make_hf
    from .systems import make_ours

    systems, skipped = [], {}
    for i, (tag, rt) in enumerate(rts.items()):
        # the mask-gated adapter's fused rounds on the first (graphed) engine only: where extra
        # scored rows are nearly free, a round that verifies and drafts in one forward pays most;
        # there too the block drafter's chain beside its tree (which is faster decides auto.BLOCK_SELF)
        first = ("ours_block", "ours_uno", "ours_uno_tree") if i == 0 else ()
        for name in ("ours_ar", "ours_block_tree") + first:
            try:
                s = make_ours(name, rt, budget, rt.dtype, adaptive=True)
            except Exception as e:  # noqa: BLE001 - e.g. no block drafter checkpoint for this model
                skipped[f"{name}_{tag}"] = f"{type(e).__name__}: {e}"
                continue
            systems.append(replace(s, name=f"{name}_{tag}", reference=f"ours_ar_{tag}"))
    if hf_models is not None:
        rt = next(iter(rts.values()))
        systems.append(make_hf("hf_ar", hf_models, rt.stop_ids))
        left = None if deadline is None else deadline - time.monotonic()
        try:
            if left is not None and left < HF_COMPILE_S:
                raise TimeoutError(f"{left:.0f} s left, the compile may take {HF_COMPILE_S:.0f}")
            t0 = time.monotonic()
            static = make_hf("hf_static_compile", hf_models, rt.stop_ids, max_cache_len=rt.max_seq_len)
            static.run(rt.encode("Say hello."), 16)  # compiles (outside any timing)
            if warmups is not None:
                warmups["hf_static_compile"] = round(time.monotonic() - t0, 1)
            systems.append(static)
        except Exception as e:  # noqa: BLE001 - reported as skipped
            skipped["hf_static_compile"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            log(f"note: skipping hf_static_compile: {skipped['hf_static_compile']}")
    return systems, skipped


def run_bench(systems: list, encoded: dict, max_new_tokens: int, deadline: float, log) -> tuple[dict, list]:
    """Every prompt on every system, the order rotating per prompt; stops early (noted)
    when the deadline passes. Returns (runs, notes)."""
    runs: dict = {}
    notes: list[str] = []
    broken: set = set()
    k = 0
    for w, items in encoded.items():
        for pid, ids in items:
            if time.monotonic() > deadline:
                notes.append(f"stopped before {w}/{pid}: out of time")
                return runs, notes
            order = systems[k % len(systems):] + systems[: k % len(systems)]
            k += 1
            for s in order:
                if s.name in broken:
                    continue
                try:
                    out = s.run(ids, max_new_tokens)
                except Exception as e:  # noqa: BLE001 - one broken system must not end the others' runs
                    broken.add(s.name)
                    notes.append(f"{s.name} failed on {w}/{pid} and was dropped: {type(e).__name__}: {e}")
                    log(f"  {w} {pid} {s.name}: FAILED {type(e).__name__}: {e}")
                    continue
                runs.setdefault((s.name, w), []).append((pid, out, 0.0))
                log(f"  {w} {pid} {s.name}: {len(out.tokens)} tokens in {out.seconds:.2f} s")
    return runs, notes


# ---------------------------------------------------------------- report
def render(result: dict) -> str:
    env = result["env"]
    lines = ["# specmesh device-check", "",
             f"{env.get('gpu', env['device'])}, torch {env['torch']} (CUDA {env['cuda_build']}), "
             f"transformers {env.get('transformers')}, python {env['python']}; {result['wall_s']} s in all.", ""]
    t = result.get("tests")
    lines += ["## CUDA tests", ""]
    if not t or not t.get("ran"):
        lines.append(f"not run: {(t or {}).get('reason', 'skipped')}")
    else:
        lines.append(f"`{t.get('command', 'pytest -m cuda')}`: rc {t.get('rc')}, {t.get('counts')}, "
                     f"{t.get('seconds', '?')} s" + (f" ({t['reason']})" if t.get("reason") else ""))
        lines += ["", "```", t.get("tail", "").strip()[-1500:], "```"]
    lines += ["", "## One forward (ms; bf16, after a prompt)", ""]
    fw = result.get("forwards") or []
    if fw:
        lines += ["| engine | sessions x tokens | median | p10 | p90 |", "|---|---|---|---|---|"]
        lines += [f"| {r['engine']} | {r['sessions x tokens']} | {r['median_ms']} | {r['p10_ms']} | {r['p90_ms']} |"
                  for r in fw]
    else:
        lines.append("not run")
    dec = result.get("decode") or []
    if dec:
        lines += ["", "## Plain decoding, random weights with the target's config (bf16, greedy, no stop)", "",
                  "| system | new tokens | s | tok/s |", "|---|---|---|---|"]
        lines += [f"| {r['system']} | {r['new_tokens']} | {r['seconds']} | {r['tokens_per_s']} |" for r in dec]
    if result.get("warmups"):
        lines += ["", "Start-up compiles and captures (s, outside every timing): "
                  + ", ".join(f"{k} {v}" for k, v in result["warmups"].items())]
    lines += ["", f"## Benchmark (bf16, greedy, {result['max_new_tokens']} new tokens, "
                  f"{', '.join(f'{w}: {n}' for w, n in result.get('workloads', {}).items())} prompts)", ""]
    recs = result.get("records") or []
    if recs:
        lines += ["| system | workload | tok/s | speedup vs own AR | τ | identical to own AR | tokens |",
                  "|---|---|---|---|---|---|---|"]
        for r in recs:
            lines.append(f"| {r['system']} | {r['workload']} | {r['tokens_per_s']} | {r['speedup_vs_own_ar']} | "
                         f"{r['tau']} | {r['identical_prompts']}/{r['prompts']} | {r['new_tokens']} |")
    else:
        lines.append("not run")
    for name, why in (result.get("skipped") or {}).items():
        lines.append(f"- skipped {name}: {why}")
    for n in result.get("notes") or []:
        lines.append(f"- {n}")
    if result.get("engine_calls"):
        lines += ["", f"GraphedEngine calls: {result['engine_calls']}"]
    dif = result.get("diffusion")
    if dif:
        lines += ["", "## Diffusion mode (eager engine, bf16, greedy, one position a step)", "",
                  "| decoder | block | target forwards / block | forward reduction | rows / forward | tok/s "
                  "| identical to plain unmasking |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['decoder']} | {r['block']} | {r['forwards_per_block']} | {r['forward_reduction']}x | "
                  f"{r['rows_per_forward']} | {r['tokens_per_s']} | {r['identical']}/{r['prompts']} |" for r in dif]
    for key, title in (("services", "Through the services (bench-strategies): external vs self block tree"),
                       ("sweep", "Concurrent streams through the services (bench-sweep --serve)")):
        ph = result.get(key)
        if ph:
            lines += ["", f"## {title}", ""]
            lines += (["```", ph.get("tail", "").strip(), "```"] if ph.get("ran") else [f"not run: {ph.get('reason')}"])
    lines += ["", "Speedups are ratios to the same family's AR measured in this run; bf16 greedy outputs may "
                  "differ at near-ties, so 'identical' is reported, not asserted (fp32 identity is a CUDA test). "
                  "Compilation and graph capture happen before timing.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- main
def main(args) -> int:
    import torch

    from ...engine.device import resolve_device
    from ...types import InvalidArgument

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(f"specmesh device-check: no CUDA device here (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}). Run it on a machine with an "
              f"NVIDIA GPU and a CUDA build of torch (or --allow-cpu to check the script itself).", file=sys.stderr)
        return 3
    try:
        device = resolve_device(args.device)
    except InvalidArgument as e:
        print(f"specmesh device-check: {e}", file=sys.stderr)
        return 3
    if device.type != "cuda" and not args.allow_cpu:
        print("specmesh device-check: --device must be cuda or cuda:N (or pass --allow-cpu)", file=sys.stderr)
        return 3
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    phase_name = getattr(args, "phase", "all")
    result: dict = {"env": _env(device), "phase": phase_name, "max_new_tokens": args.max_new_tokens,
                    "skipped": {}, "notes": [], "warmups": {}}
    status = 0

    def save() -> None:  # after every phase: a check stopped from outside still leaves what it measured
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        (out_dir / "results.json").write_text(json.dumps(result, indent=2, default=str))
        (out_dir / "report.md").write_text(render(result))

    save()
    if args.skip_tests:
        result["tests"] = {"ran": False, "reason": "--skip-tests"}
    else:
        log(f"device-check: pytest -m '{TEST_SETS[phase_name][0]}' ...")
        result["tests"] = run_tests(min(180.0, max(30.0, deadline - time.monotonic() - 90)), phase_name)
        if result["tests"].get("rc") not in (0, 5):  # 5: nothing collected
            status = 1
    save()
    ctx: dict = {"save": save}  # the benchmark phase's runtimes and encoded prompts, for the diffusion phase
    phases = (("model-free", lambda: model_free_phase(args, device, deadline, result, log, save)),) \
        if phase_name == "model-free" else \
        (("benchmark", lambda: _bench_phase(args, device, deadline, result, log, ctx)),
         ("services", lambda: _services_phase(args, device, deadline, out_dir, result, log)),
         ("sweep", lambda: _sweep_phase(args, device, deadline, out_dir, result, log)),
         ("diffusion", lambda: _diffusion(args, deadline, result, log, ctx)))
    for name, phase in phases:
        try:
            status = max(status, phase())
        except Exception as e:  # noqa: BLE001 - a broken phase is a result too; the next one still runs
            import traceback

            result["notes"].append(f"{name} phase failed: {type(e).__name__}: {e}")
            result.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
            log(result["tracebacks"][name])
            status = 1
        save()
    print(f"wrote {out_dir}/results.json, report.md ({result['wall_s']} s); status {status}")
    return status


RUNTIME_S = 90.0  # what a Runtime's start-up may take on the GPU (kernel compiles, every bucket's capture)


def _config_dir(model: str) -> Path:
    """Where the model's config.json and tokenizer are (the converted cache's folder; in a
    staged loan's first call ``scripts/gpu-assemble --no-model`` put them there without weights)."""
    from ...models.loading import cache_root

    d = cache_root() / "models" / model.lower()
    if (d / "config.json").is_file():
        return d
    p = Path(model)
    if (p / "config.json").is_file():
        return p
    raise FileNotFoundError(f"no config.json for {model!r} under {d} (run scripts/gpu-assemble --no-model)")


def random_model_dir(model: str, out: Path) -> Path:
    """A Hugging Face folder with ``model``'s config and tokenizer and random weights (bf16
    safetensors): what the model-free phase times (speed does not depend on the weights)."""
    import json as _json
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = _config_dir(model)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    cfg = AutoConfig.for_model(**{k: v for k, v in _json.loads((src / "config.json").read_text()).items()
                                  if k not in ("architectures", "transformers_version")})
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def model_free_phase(args, device, deadline: float, result: dict, log, save) -> int:
    """The first call of a staged loan (module docstring): a random-weight model with the
    target's config; forward timings on ``GraphedEngine`` and the eager engine, then plain
    greedy decoding of ``--max-new-tokens`` (no stop token: every system makes them all),
    ours on the graphed engine against Hugging Face static cache + ``torch.compile``.
    Each step checks the deadline first; ``result`` is saved after each."""
    import torch

    from ...engine import LlamaEngine
    from ...loop import generate_tokens
    from ...runtime import Runtime

    rand = random_model_dir(args.model, Path(os.environ.get("TMPDIR", "/tmp")) / "specmesh-random-model")
    result["notes"].append(f"model-free phase: random weights with {args.model}'s config ({rand})")
    if time.monotonic() > deadline - RUNTIME_S:
        result["notes"].append("model-free phase skipped: out of time before the runtime")
        return 1
    t0 = time.monotonic()
    graphs = True if device.type == "cuda" else "always"
    rt = Runtime(str(rand), dtype="bf16", n_slots=4, max_seq_len=2048, quiet=True, device=device, cuda_graphs=graphs,
                 block_drafter=False, uno=False, specialist=None, layerskip_exit=8)
    result["warmups"]["runtime_graphed"] = round(time.monotonic() - t0, 1)
    eager = LlamaEngine.from_pretrained(str(rand), dtype="bf16", n_slots=4, max_seq_len=2048, quiet=True,
                                        device=device)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, rt.engine.vocab_size, (64,), generator=gen).tolist()
    reps = 20 if device.type == "cuda" else 5
    result["forwards"] = []
    for eng in (rt.engine, eager):
        result["forwards"] += time_forwards(eng, prompt, device, reps=reps)
        save()
    log("device-check: forwards " + json.dumps(result["forwards"]))
    n = args.max_new_tokens
    rows = result["decode"] = []

    def timed(name, run):
        for _ in range(3):
            if time.monotonic() > deadline - 15:
                result["notes"].append(f"decode {name}: out of time")
                return
            _sync(device)
            t = time.perf_counter()
            made = run()
            _sync(device)
            dt = time.perf_counter() - t
            rows.append({"system": name, "new_tokens": made, "seconds": round(dt, 3),
                         "tokens_per_s": round(made / dt, 1)})
            save()

    def ours():
        out, _ = generate_tokens(None, rt.verifier, prompt, max_new_tokens=n, stop_ids=())
        return len(out)

    generate_tokens(None, rt.verifier, prompt, max_new_tokens=8, stop_ids=())  # first round outside the timing
    timed("ours_ar_graphed (random weights)", ours)
    if not args.no_hf:
        from .peers import HFModels, make_hf

        left = deadline - time.monotonic()
        if left < HF_COMPILE_S:
            result["skipped"]["hf_static_compile"] = f"{left:.0f} s left, the compile may take {HF_COMPILE_S:.0f}"
        else:
            t0 = time.monotonic()
            # a stop id is needed by generate(); the last id of a random model's vocabulary rarely comes
            # (the tokens counted are those made)
            hf = make_hf("hf_static_compile", HFModels(rand, None, device=device, dtype="bf16"),
                         [rt.engine.vocab_size - 1], max_cache_len=rt.max_seq_len)
            hf.run(prompt, n)  # compiles and captures, outside the timing
            result["warmups"]["hf_static_compile"] = round(time.monotonic() - t0, 1)
            save()
            timed("hf_static_compile (random weights)", lambda: len(hf.run(prompt, n).tokens))
    best = {}
    for r in rows:
        best[r["system"]] = max(best.get(r["system"], 0.0), r["tokens_per_s"])
    o, h = best.get("ours_ar_graphed (random weights)"), best.get("hf_static_compile (random weights)")
    if o and h:
        result["notes"].append(f"plain decoding, ours (graphed) / HF static + compile: {o / h:.2f}x "
                               f"(best of 3 each; target >= 2x)")
    fw = {(r["engine"], r["sessions x tokens"]): r["median_ms"] for r in result["forwards"]}
    one, six = fw.get(("GraphedEngine", "1 x 1")), fw.get(("GraphedEngine", "1 x 16"))
    if one and six:
        result["notes"].append(f"GraphedEngine: 16 scored tokens cost {six / one:.2f}x one (target <= 1.2x)")
    result["engine_calls"] = dict(rt.engine.calls)
    return 0


def _bench_phase(args, device, deadline: float, result: dict, log, ctx: dict) -> int:
    from ...runtime import Runtime
    from ... import workloads as wl
    from .harness import Bench, BenchConfig
    from .peers import HFModels

    if os.environ.get("SPECMESH_BLOCK_DRAFTER") == "":
        result["notes"].append("SPECMESH_BLOCK_DRAFTER is empty: no block drafter")
    log(f"device-check: loading {args.model} (bf16) on {device}, graphed and eager ...")
    graphs = True if device.type == "cuda" else "always"  # on the CPU: the static forward without capture
    rts = ctx["rts"] = {}
    for tag, cg in (("graphed", graphs), ("eager", False)):
        if time.monotonic() > deadline - RUNTIME_S:  # its start-up compiles kernels and captures every bucket
            result["notes"].append(f"benchmark skipped before the {tag} runtime: out of time")
            return 1
        t0 = time.monotonic()
        rts[tag] = Runtime(args.model, dtype="bf16", n_slots=4, max_seq_len=2048, quiet=True, device=device,
                           cuda_graphs=cg)
        result["warmups"][f"runtime_{tag}"] = round(time.monotonic() - t0, 1)
        ctx["save"]()
    g = rts["graphed"]
    loads = wl.load(list(WORKLOADS), args.prompts)
    encoded = {w: [(p.id, g.encode(p.prompt, p.messages)) for p in ps] for w, ps in loads.items()}
    result["workloads"] = {w: len(v) for w, v in encoded.items()}
    if hasattr(g.engine, "warm_up"):
        result["notes"].append(f"GraphedEngine: {len(g.engine._steps)} buckets prepared at start-up in "
                               f"{g.warmup_s or 0:.1f} s ({g.engine.calls.get('captures', 0)} captured, "
                               f"{g.engine.calls.get('capture_errors', 0)} failed)")
    prompt = next(iter(encoded.values()))[0][1]
    result["forwards"] = []
    reps = 20 if device.type == "cuda" else 5  # fewer repetitions on the CPU (--allow-cpu checks the script)
    for rt in (g, rts["eager"]):
        try:
            result["forwards"] += time_forwards(rt.engine, prompt, device, reps=reps)
        except Exception as e:  # noqa: BLE001 - reported; the benchmark still runs
            result["notes"].append(f"forward timing on {type(rt.engine).__name__} failed: {type(e).__name__}: {e}")
    if device.type == "cuda":  # the batch-invariant graphs: every forward one bucket (4 slots x 64 tokens)
        from ...engine.cudagraph import GraphedEngine

        try:
            inv = GraphedEngine.from_pretrained(str(g.model_dir), dtype="bf16", n_slots=4, max_seq_len=2048,
                                                quiet=True, device=device, invariant=True)
            for r in time_forwards(inv, prompt, device, reps=reps):
                result["forwards"].append(dict(r, engine="GraphedEngine (invariant)"))
            del inv
        except Exception as e:  # noqa: BLE001 - reported; the benchmark still runs
            result["notes"].append(f"forward timing on the invariant graphs failed: {type(e).__name__}: {e}")
    log("device-check: forwards " + json.dumps(result["forwards"]))
    if time.monotonic() > deadline - 30:
        result["notes"].append("benchmark skipped: out of time")
        return 1
    hf = None if args.no_hf else HFModels(g.model_dir, None, device=device, dtype="bf16")
    systems, skipped = build_systems(rts, hf, 8, log, deadline=deadline, warmups=result["warmups"])
    result["skipped"].update(skipped)
    ctx["save"]()
    warm = g.encode("Say hello and name three colours.")
    for s in list(systems):
        if time.monotonic() > deadline - 40:
            result["notes"].append(f"{s.name} left out: out of time before its warm-up")
            systems.remove(s)
            continue
        t0 = time.monotonic()
        s.run(warm, 16)
        result["warmups"].setdefault(s.name, round(time.monotonic() - t0, 1))
    result["engine_calls_after_warmup"] = dict(getattr(g.engine, "calls", {}) or {})
    runs, notes = run_bench(systems, encoded, args.max_new_tokens, deadline - 10, log)
    result["notes"] += notes
    bench = Bench(BenchConfig(dtype="bf16", max_new_tokens=args.max_new_tokens, out=str(args.out)), log=log)
    bench.systems = systems
    result["records"] = bench.aggregate(list(encoded), runs)
    result["outputs"] = [{"system": s, "workload": w, "id": pid, "tokens": o.tokens}
                         for (s, w), rs in runs.items() for pid, o, _ in rs]
    result["engine_calls"] = getattr(g.engine, "calls", None)  # serving_captures: buckets the warm-up missed
    toks = {(o["system"], o["workload"], o["id"]): o["tokens"] for o in result["outputs"]}
    pairs = [(k, k2) for k in toks if k[0] == "ours_ar_graphed" for k2 in [("ours_ar_eager",) + k[1:]] if k2 in toks]
    if pairs:
        same = sum(toks[a] == toks[b] for a, b in pairs)
        result["notes"].append(f"plain decoding, GraphedEngine vs eager engine (bf16): {same}/{len(pairs)} "
                               "outputs identical")
    ctx["encoded"] = encoded
    return 1 if notes else 0


def _diffusion(args, deadline: float, result: dict, log, ctx: dict) -> int:
    """The diffusion phase (last: it matters least to the GPU's figures) on the eager runtime."""
    rts, encoded = ctx.get("rts", {}), ctx.get("encoded")
    if "eager" not in rts or encoded is None:
        result["notes"].append("diffusion phase skipped: the benchmark phase did not load the runtimes")
        return 0
    if time.monotonic() > deadline - 40:
        result["notes"].append("diffusion phase skipped: out of time")
        return 0
    result["diffusion"] = diffusion_phase(rts["eager"], encoded, args.diffusion_tokens, deadline - 30, log)
    return 0


DIFFUSION_CONFIGS = ((5, 64), (7, 128))  # (block, guessed states of the tree)


def diffusion_phase(rt, encoded: dict, new_tokens: int, deadline: float, log) -> list[dict]:
    """Plain unmasking vs the guess tree per (block, states) of ``DIFFUSION_CONFIGS``, on
    ``rt``'s engine with its mask-gated adapter: one row per decoder and block."""
    from ...uno.diffusion import Unmasking

    if rt.engine.adapter is None:
        log("device-check: no mask-gated adapter: diffusion phase skipped")
        return []
    rows = []
    trained = getattr(rt.engine.adapter.cfg, "block", 0)
    for block, budget in DIFFUSION_CONFIGS:
        if block - 1 > trained:
            log(f"device-check: the adapter has {trained} mask slots: diffusion block {block} skipped")
            continue
        dec = Unmasking(rt.engine, block=block, per_step=1, slot=rt.engine.n_slots - 1)
        agg = {m: {"forwards": 0, "blocks": 0, "rows": 0, "tokens": 0, "seconds": 0.0, "identical": 0, "prompts": 0}
               for m in ("plain", "tree")}
        for pid, ids in (x for ps in encoded.values() for x in ps):
            if time.monotonic() > deadline:
                break
            outs = {}
            for m in ("plain", "tree"):
                out, st = dec.generate(ids, new_tokens, stop_ids=rt.stop_ids, speculate=None if m == "plain" else m,
                                       depth=block, budget=budget)
                a = agg[m]
                for k, v in (("forwards", st.forwards), ("blocks", st.blocks), ("rows", st.rows),
                             ("tokens", st.new_tokens), ("seconds", st.seconds)):
                    a[k] += v
                a["prompts"] += 1
                outs[m] = out
            agg["tree"]["identical"] += int(outs["tree"] == outs["plain"])
            agg["plain"]["identical"] += 1
        plain_fpb = agg["plain"]["forwards"] / max(agg["plain"]["blocks"], 1)
        for m, a in agg.items():
            fpb = a["forwards"] / max(a["blocks"], 1)
            rows.append({"decoder": "plain unmasking" if m == "plain" else f"guess tree ({budget} states)",
                         "block": block, "prompts": a["prompts"], "forwards_per_block": round(fpb, 2),
                         "forward_reduction": round(plain_fpb / fpb, 2) if fpb else 0.0,
                         "rows_per_forward": round(a["rows"] / max(a["forwards"], 1), 1),
                         "tokens_per_s": round(a["tokens"] / a["seconds"], 1) if a["seconds"] else 0.0,
                         "identical": a["identical"]})
        log("device-check: diffusion " + json.dumps(rows[-2:]))
    return rows


def _cli_phase(key: str, cli_args: list, need_s: float, deadline: float, result: dict, log) -> int:
    """``python -m specmesh.cli *cli_args`` in a subprocess when ``need_s`` seconds are left;
    ``result[key]``: whether it ran, its exit status and its output's tail."""
    left = deadline - time.monotonic() - 10
    if left < need_s:
        result[key] = {"ran": False, "reason": f"{max(0, left):.0f} s left (needs {need_s:.0f})"}
        return 0
    cmd = [sys.executable, "-m", "specmesh.cli", *cli_args]
    log("device-check: " + " ".join(cmd[2:]))
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        result[key] = {"ran": True, "rc": None, "reason": f"timed out after {left:.0f} s", "tail": out[-3000:]}
        return 1
    result[key] = {"ran": True, "rc": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
    return 0 if p.returncode == 0 else 1


def _services_phase(args, device, deadline: float, out_dir: Path, result: dict, log) -> int:
    """``bench-strategies`` on the device: external vs self block tree through the services."""
    return _cli_phase("services", ["bench-strategies", "--device", str(device), "--dtype", "bf16", "--model",
                                   args.model, "--workloads", ",".join(WORKLOADS), "--prompts", str(args.prompts),
                                   "--systems", "autoregressive,self:block_tree,external:block_tree",
                                   "--max-new-tokens", str(args.max_new_tokens), "--proactive", "0",
                                   "--out", str(out_dir / "services")],
                      90, deadline, result, log)


def _sweep_phase(args, device, deadline: float, out_dir: Path, result: dict, log) -> int:
    """``bench-sweep --serve`` on the device: 1, 8 and 32 concurrent streams through the
    services, plain against ``self:block_tree`` (total tokens/s, latency percentiles)."""
    return _cli_phase("sweep", ["bench-sweep", "--serve", "--device", str(device), "--dtype", "bf16", "--streams",
                                "1,8,32", "--systems", "autoregressive,self:block_tree", "--requests", "32",
                                "--workloads", ",".join(WORKLOADS), "--prompts", str(args.prompts),
                                "--max-new-tokens", str(min(args.max_new_tokens, 64)), "--out", str(out_dir / "sweep")],
                      100, deadline, result, log)
