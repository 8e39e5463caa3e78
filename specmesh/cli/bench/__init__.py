"""The benchmark commands and their harness: ``specmesh bench`` (in-process, one
stream) and ``specmesh bench-sweep`` (concurrency sweep through the gRPC services);
``calibrate`` and ``strategies`` add ``specmesh calibrate-layerskip`` and ``specmesh
bench-strategies`` themselves.

``register(subparsers)`` adds the first two subcommands to the ``specmesh`` CLI; their
functions import the heavy modules lazily so ``specmesh --help`` stays fast.

  workloads  find and read bench/workloads/*.jsonl
  systems    the system contract and our systems (ours_*)
  peers      Hugging Face, llama.cpp and OpenVINO GenAI systems (hf_*, llamacpp_*, openvino_*)
  peer_process  a peer in a child process (llamacpp_worker, openvino_worker)
  device_check  ``specmesh device-check``: CUDA tests and a short GPU benchmark
  harness    one-process run, alternating systems per prompt; records
  report     report.md with the table and verdict lines
  charts     PNG charts
  sweep      concurrency sweep over gRPC (1, 4, 8 streams)
  strategies ``specmesh bench-strategies``: workloads x strategies through the services
  calibrate  ``specmesh calibrate-layerskip``: measure the layer-skip exit layer E and
             write it where ``specmesh.drafters.calibration`` reads it

This package knows nothing about gRPC except in ``sweep`` and ``strategies`` (through
the SDK and ``specmesh.cli.stack``).
"""

from __future__ import annotations

import argparse

SYSTEMS_HELP = ("comma list of systems or groups (all, ours, hf, llamacpp, openvino). ours_ar, ours_prompt_lookup, "
                "ours_suffix, ours_draft_lm (a stand-in unless the target has a paired draft model: make setup-qwen), "
                "ours_layerskip (append _fp32/_bf16/_int8/_int4 to run on another engine "
                "dtype, e.g. ours_ar_fp32,ours_suffix_fp32 for the greedy-identity check), hf_ar, hf_pld, "
                "hf_assisted, llamacpp_ar, llamacpp_pld, llamacpp_draft_lm, openvino_ar, openvino_draft_lm, openvino_pld "
                "(OpenVINO GenAI on the same GGUF: the bench-openvino extra); hf_static_compile (HF static cache + "
                "torch.compile, in no group). Default: all")


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark our decoding vs HF generate and llama.cpp on workloads",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local Hugging Face model directory")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "int8", "int4"], help="our engine's dtype")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (ours and the HF peers)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on CUDA, run our eager engine instead of replaying CUDA graphs")
    p.add_argument("--invariant-graphs", dest="cuda_graphs", action="store_const", const="invariant",
                   help="on CUDA, the batch-invariant graphs (one bucket shape, prompts in chunks: bf16 identity)")
    p.add_argument("--hf-dtype", default="fp32", choices=["fp32", "bf16"], help="dtype of the HF peers")
    p.add_argument("--workloads", default="", help="comma list of workloads (default: all in --workloads-dir)")
    p.add_argument("--workloads-dir", default=None, help="directory of *.jsonl workloads (default: bench/workloads)")
    p.add_argument("--systems", default="all", help=SYSTEMS_HELP)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=None, help="prompts per workload (default: all)")
    p.add_argument("--budget", type=int, default=8, help="max draft tokens per round for ours_* systems")
    p.add_argument("--fixed-budget", action="store_true", help="ours_*: always draft --budget (default: adaptive)")
    p.add_argument("--slots", type=int, default=2, help="KV slots of our engine")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV positions per slot of our engine")
    p.add_argument("--threads", type=int, default=None, help="torch/llama.cpp/OpenVINO threads (default: torch's)")
    p.add_argument("--out", default="bench-out", help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over every prompt and system (each rotated once more, our systems built afresh); "
                        "each (system, prompt) keeps its fastest run: filters a shared machine's bursts")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="with llama.cpp in the run, skip the engine probe (forward cost by scored rows, prefill, "
                        "memory and teacher-forced agreement, ours and llama.cpp side by side in child processes)")
    p.set_defaults(module="specmesh.cli.bench", func="main")

    s = subparsers.add_parser("bench-sweep", help="concurrency sweep through the gRPC services (1/4/8 streams)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .sweep import add_arguments

    add_arguments(s)
    s.set_defaults(module="specmesh.cli.bench", func="sweep_main")

    s = subparsers.add_parser("bench-services", help="the same prompts in process and through `specmesh serve` (SDK "
                              "and OpenAI HTTP), side by side: the services' ratio to their own engine",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .services import add_arguments as add_services_arguments

    add_services_arguments(s)
    s.set_defaults(module="specmesh.cli.bench.services", func="main")

    s = subparsers.add_parser("bench-serving", help="serving workloads through the OpenAI API beside "
                              "llama-cpp-python's server: multi-turn chat (TTFT per turn), shared system prompt, "
                              "streams while long prompts arrive, Poisson arrival sweep",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .serving import add_arguments as add_serving_arguments

    add_serving_arguments(s)
    s.set_defaults(module="specmesh.cli.bench.serving", func="main")


def config_from_args(args):
    from .harness import BenchConfig

    split = lambda v: [x.strip() for x in v.split(",") if x.strip()] if v else None  # noqa: E731
    return BenchConfig(workloads=split(args.workloads), systems=split(args.systems) or ["all"],
                       max_new_tokens=args.max_new_tokens, prompts=args.prompts, dtype=args.dtype,
                       budget=args.budget, adaptive=not args.fixed_budget, out=args.out, model=args.model, workloads_dir=args.workloads_dir,
                       slots=args.slots, max_seq_len=args.max_seq_len, threads=args.threads,
                       progress=not args.no_progress, charts=not args.no_charts, device=args.device,
                       cuda_graphs=args.cuda_graphs, hf_dtype=args.hf_dtype, repeats=args.repeats,
                       probe=getattr(args, "probe", True))


def run(cfg, log=print, runtimes=None) -> dict:
    """Run the benchmark described by ``cfg`` (a ``BenchConfig``) and write its reports
    into ``cfg.out``; returns the result dict (meta, records, outputs). ``runtimes``
    maps a dtype to an already loaded ``Runtime`` to reuse."""
    from pathlib import Path

    from . import report
    from .harness import Bench, save

    result = Bench(cfg, log=log, runtimes=runtimes).run()
    out = Path(cfg.out)
    save(result, out)
    report.write(result, out)
    if cfg.charts:
        from . import charts

        charts.write_all(result["records"], out, result["meta"])
    return result


def main(args) -> int:
    from . import report

    cfg = config_from_args(args)
    result = run(cfg)
    print(f"wrote {cfg.out}/results.json, report.md" + (", *.png" if cfg.charts else ""))
    for v, text in report.verdicts(result["records"], result["meta"]):
        print(f"  {v:4}  {text}")
    return 0


def sweep_main(args) -> int:
    from .sweep import main as _main

    return _main(args)
