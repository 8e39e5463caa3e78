"""The ``specmesh`` command line, and every other command and composition root: this
package is the top of the layers (docs/design.md, "Layering rules"). The library
packages below it (``serving``, ``observability``, ``blockdraft``, ``uno`` ...) hold
no entry points; ``python -m specmesh.cli`` is ``specmesh`` (``__main__``).

Each subcommand registers its arguments here or in the module of this package that owns it
(imported lazily so ``specmesh --help`` stays fast) and runs its code, which calls
the library; ``specmesh --help`` lists them in groups (``COMMAND_GROUPS``: serving,
benchmarking, training and studies). Beside them: ``stack`` (``LocalStack``, the
three services in one process, for tests and the benchmarks) and ``serve_ray``
(``specmesh serve --ray``).

  demo               in-process demo: plain decoding vs each drafter, alternating passes (specmesh.cli.demo)
  convert            resolve/convert a model alias into the safetensors cache
  make-draft-model   write a draft LM made of a subset of the target's layers
  serve              run the gRPC services (specmesh.cli.serve)
  generate           stream a generation from a running router (specmesh.cli.serve)
  bench              benchmarks (specmesh.cli.bench)
  trace, stats       trace timelines and acceptance histograms (specmesh.cli.observability)
  calibrate-layerskip  choose the layer-skip exit layer by measurement (specmesh.cli.bench.calibrate)
  bench-services     the same prompts in process and through `specmesh serve`, side by side
                     (specmesh.cli.bench.services)
  bench-serving      serving workloads through the OpenAI API beside llama-cpp-python's server
                     (specmesh.cli.bench.serving)
  bench-strategies   workloads x strategies through the services (specmesh.cli.bench.strategies)
  bench-tools        tool calling on BFCL's categories beside llama-cpp-python's server (specmesh.cli.bench.tools)
  device-check       on a CUDA machine: the CUDA tests and a short GPU benchmark (specmesh.cli.bench.device_check)
  costs              the speculation cost model measured on this device (specmesh.cli.bench.costs)
  quality            speed vs quality of each acceptance rule, and speculative vs vanilla CD
                     (specmesh.cli.bench.quality)
  train-specialist   LoRA-tune a domain specialist of the target for divergence decoding (specmesh.cli.specialist)
  distill-data, train-drafter, accel-drafter, floor, tree-study  the block drafter (specmesh.cli.blockdraft)
  train-uno          train the mask-gated adapter: the target drafting for itself (specmesh.cli.uno)
  uno-study          its layouts (fused / separate) and diffusion mode side by side (specmesh.cli.uno_study)
"""

from __future__ import annotations

import argparse
import importlib
import sys


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda | cuda:N (auto: CUDA when torch.cuda.is_available(), else cpu)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on CUDA, run the eager engine instead of replaying CUDA graphs")
    p.add_argument("--invariant-graphs", dest="cuda_graphs", action="store_const", const="invariant",
                   help="on CUDA, the batch-invariant graphs: one bucket shape for every forward (prompts in "
                        "chunks), so bf16 greedy speculation equals plain decoding")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local Hugging Face model directory")
    # auto: the fastest lossless path measured on a CPU (runtime.AUTO_DTYPE)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   help="auto: int4 (the GGUF's own blocks on the int8 kernels) for a GGUF on a CPU with those "
                        "kernels, else bf16")
    add_device_args(p)


# ``specmesh --help`` lists the subcommands in these groups (in this order); a
# subcommand registered but named in no group is listed under "other".
COMMAND_GROUPS = (
    ("serving", ("serve", "generate", "demo", "stats", "trace", "convert", "make-draft-model")),
    ("benchmarking", ("bench", "bench-services", "bench-serving", "bench-strategies", "bench-sweep", "bench-tools",
                      "costs", "quality", "calibrate-layerskip", "device-check")),
    ("training and studies", ("distill-data", "train-drafter", "accel-drafter", "floor", "tree-study",
                              "train-specialist", "train-uno", "uno-study")),
)

# command -> (the module whose ``register(subparsers)`` adds it, its one-line help): ``specmesh
# --help`` lists them from here and a command's module is imported only to parse and run it,
# so the listing, a command's --help and an argument error import neither torch nor grpc
# (issue 62; tests/unit/test_cli.py checks this table against the modules' own parsers)
HERE = "specmesh.cli"
COMMANDS = {
    "demo": (HERE, "plain decoding vs each drafter on built-in prompts"),
    "convert": (HERE, "convert a model alias into the safetensors cache (one time)"),
    "make-draft-model": (HERE, "draft LM from a subset of the target's layers"),
    "device-check": (HERE, "on a CUDA machine: the CUDA tests and a short GPU benchmark"),
    "serve": ("specmesh.cli.serve", "run the gRPC services (one, or all three as processes)"),
    "generate": ("specmesh.cli.serve", "stream a generation from a running router"),
    "bench": ("specmesh.cli.bench", "benchmark our decoding vs HF generate and llama.cpp on workloads"),
    "bench-sweep": ("specmesh.cli.bench", "concurrency sweep through the gRPC services (1/4/8 streams)"),
    "bench-services": ("specmesh.cli.bench", "the same prompts in process and through `specmesh serve` (SDK and "
                       "OpenAI HTTP), side by side: the services' ratio to their own engine"),
    "bench-serving": ("specmesh.cli.bench", "serving workloads through the OpenAI API beside llama-cpp-python's "
                      "server: multi-turn chat (TTFT per turn), shared system prompt, streams while long prompts "
                      "arrive, Poisson arrival sweep"),
    "distill-data": ("specmesh.cli.blockdraft", "target self-distillation data (resumable shards)"),
    "train-drafter": ("specmesh.cli.blockdraft", "train the DFlash-style block drafter"),
    "floor": ("specmesh.cli.blockdraft", "per-slot information floor and the drafter's model gap"),
    "tree-study": ("specmesh.cli.blockdraft", "draft trees on held-out bench prompts: prefix-blind vs "
                   "path-conditioned scoring per node budget, entropy-switched budgets (writes JSON, table, PNG)"),
    "accel-drafter": ("specmesh.cli.blockdraft", "the whole drafter recipe on one accelerator in a time budget "
                      "(synthesised instructions, greedy responses, batched training, held-out τ)"),
    "trace": ("specmesh.cli.observability", "read a JSON-lines trace file (SPECMESH_TRACE_FILE)"),
    "stats": ("specmesh.cli.observability", "acceptance histogram, ceiling bin and block-size verdict"),
    "calibrate-layerskip": ("specmesh.cli.bench.calibrate", "measure tau and tokens/s per layer-skip exit layer E; "
                            "write the best E"),
    "bench-strategies": ("specmesh.cli.bench.strategies", "workloads x router strategies through the services"),
    "bench-tools": ("specmesh.cli.bench.tools", "tool calling on BFCL's categories through the OpenAI API, beside "
                    "llama-cpp-python's server on the same GGUF"),
    "costs": ("specmesh.cli.bench.costs", "measure the speculation cost model (verify/draft times, break-even tau, "
              "the S <= tau/2 bound) for this device and dtype"),
    "quality": ("specmesh.cli.bench.quality", "speed vs quality of each acceptance rule against the target, and "
                "speculative vs vanilla contrastive decoding, in one run"),
    "train-specialist": ("specmesh.cli.specialist", "LoRA-tune a domain specialist of the target (divergence "
                         "decoding)"),
    "train-uno": ("specmesh.cli.uno", "train the mask-gated adapter (the target drafting for itself)"),
    "uno-study": ("specmesh.cli.uno_study", "the mask-gated adapter's layouts and diffusion mode, side by side"),
}


def _grouped_commands(sub) -> str:
    """The subcommands' one-line helps, grouped (``COMMAND_GROUPS``), as the text
    ``specmesh --help`` ends with; the flat list argparse would print is dropped."""
    import textwrap

    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    named = [c for _, cmds in COMMAND_GROUPS for c in cmds]
    groups = [(title, [c for c in cmds if c in helps]) for title, cmds in COMMAND_GROUPS]
    groups.append(("other", [c for c in helps if c not in named]))
    width = max(len(c) for c in helps) + 4
    out = []
    for title, cmds in groups:
        if not cmds:
            continue
        out.append(f"{title}:")
        for c in cmds:
            out.append(textwrap.fill(helps[c], 100, initial_indent=f"  {c:<{width - 2}}",
                                     subsequent_indent=" " * width))
        out.append("")
    out.append("`specmesh COMMAND --help` shows a command's options.")
    return "\n".join(out)


def _draft_lm_note() -> str:
    from ..drafters.registry import DRAFT_LM_NOTE

    return DRAFT_LM_NOTE.replace("%", "%%")


def register(sub) -> None:
    """The commands of this module: demo, convert, make-draft-model, device-check."""
    p = sub.add_parser("demo", help=COMMANDS["demo"][1])
    _add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", default="prompt_lookup,suffix,draft_lm,layerskip,block,block_tree",
                   help="external drafters and in-verifier ones (layerskip, block, block_tree; uno, uno_tree, "
                        "uno_separate: the mask-gated adapter). " + _draft_lm_note())
    p.add_argument("--repeats", type=int, default=2,
                   help="passes over every prompt and system, the order rotated as in `specmesh bench`; each "
                        "keeps its fastest (default 2; 1 is faster and noisier)")
    p.add_argument("--budget", type=int, default=8, help="draft tokens per round")
    p.add_argument("--fixed-budget", action="store_true", help="always draft --budget tokens (default: adaptive)")
    p.add_argument("--show-text", action="store_true")
    p.set_defaults(module="specmesh.cli.demo", func="main")

    p = sub.add_parser("convert", help=COMMANDS["convert"][1])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.set_defaults(module="specmesh.cli", func="convert_main")

    p = sub.add_parser("make-draft-model", help=COMMANDS["make-draft-model"][1])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--layers", default="0,1,2,29")
    p.add_argument("--out", required=True)
    p.set_defaults(module="specmesh.cli", func="make_draft_main")

    p = sub.add_parser("device-check", help=COMMANDS["device-check"][1])
    from .bench.device_check import add_arguments

    add_arguments(p)
    p.set_defaults(module="specmesh.cli.bench.device_check", func="main")


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The ``specmesh`` parser. ``argv`` given: only the module of the command it names
    (its first word that is not an option) registers its commands; the others are listed
    from ``COMMANDS`` without importing anything. None: every module registers (the
    full parser, as the tests read it)."""
    from .helpfmt import Parser

    ap = argparse.ArgumentParser(prog="specmesh", description="speculative decoding served as microservices",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands",
                            help="one of the commands below", parser_class=Parser)
    modules = list(dict.fromkeys(m for m, _ in COMMANDS.values()))
    if argv is not None:
        cmd = next((a for a in argv if not a.startswith("-")), None)
        modules = [COMMANDS[cmd][0]] if cmd in COMMANDS else []
    for mod in modules:
        fn = register if mod == HERE else getattr(importlib.import_module(mod), "register")
        try:
            fn(sub)
        except ModuleNotFoundError as e:
            if e.name is None or not mod.startswith(e.name):
                raise
    for name, (mod, hlp) in COMMANDS.items():
        if mod not in modules:
            sub.add_parser(name, help=hlp, add_help=False)  # listed; parsed only by its module's parser
    ap.epilog = _grouped_commands(sub)
    ap.command_helps = {a.dest: a.help for a in sub._choices_actions}  # each command's line in the epilog
    sub._choices_actions[:] = []  # listed, grouped, in the epilog instead of one flat list
    return ap


def convert_main(args) -> int:
    from ..models.loading import resolve_model

    print(resolve_model(args.model))
    return 0


def make_draft_main(args) -> int:
    from ..runtime import make_draft_model

    print(make_draft_model(args.model, [int(x) for x in args.layers.split(",")], args.out))
    return 0


# Subcommands whose OpenMP threads spin briefly between ops (``specmesh.spin_threads``):
# those that run their whole job in this one process, and ``serve``, whose services
# each run their model on one thread (``specmesh.threads``: then a bounded spin leaves
# the co-located services the cores between forwards; measured in docs/performance.md).
# ``bench-sweep`` (a client of the services it starts), ``device-check`` and
# the clients keep sleeping threads.
SPINNING = frozenset({"demo", "bench", "distill-data", "train-drafter", "floor", "tree-study",
                      "accel-drafter", "calibrate-layerskip", "bench-strategies", "costs", "quality",
                      "train-specialist", "train-uno", "uno-study", "serve", "bench-services"})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if next((a for a in argv if not a.startswith("-")), None) in SPINNING:
        from .. import spin_threads

        spin_threads()  # before build_parser imports torch
    args = build_parser(argv).parse_args(argv)
    fn = getattr(importlib.import_module(args.module), args.func)
    try:
        return int(fn(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line for known user errors
        from ..models.loading import ModelNotFound
        from ..types import InvalidArgument

        if isinstance(e, (InvalidArgument, ModelNotFound)):
            print(f"specmesh: error: {e}", file=sys.stderr)
            return 2
        if type(e).__name__ == "ValidationError" and type(e).__module__.startswith("pydantic"):  # bad settings
            print(f"specmesh: error: invalid settings: {e}", file=sys.stderr)
            return 2
        raise

