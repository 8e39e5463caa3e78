"""CLI for the block drafter (``specmesh.blockdraft``): ``distill-data``, ``train-drafter``, ``floor``,
``tree-study``, ``accel-drafter``.

``train-drafter`` prints per-slot accuracy, the held-out acceptance histogram
with its ceiling bin and preflight verdict, expected τ, and writes the checkpoint
(drafter.safetensors, config.json, calibration.json, metrics.json) plus a
histogram PNG. Knows nothing about gRPC.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

M = "specmesh.cli.blockdraft"


def register(sub) -> None:
    p = sub.add_parser("distill-data", help="target self-distillation data (resumable shards)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", default="data/distill")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--slots", type=int, default=16, help="sessions decoded together per forward")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--split", default=None, choices=["train", "heldout"],
                   help="only the prompts of this split (e.g. heldout: evaluation data in minutes)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="target precision while generating (bf16: ~1.5x faster on AMX CPUs; its greedy "
                        "text differs from fp32 only at near-ties)")
    p.set_defaults(module=M, func="distill_main")

    p = sub.add_parser("train-drafter", help="train the DFlash-style block drafter")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", default="data/distill")
    p.add_argument("--out", default="checkpoints/block-drafter")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--feature-layers", default="2,14,27")
    p.add_argument("--n-keep", type=int, default=8192)
    p.add_argument("--context-window", type=int, default=256)
    p.add_argument("--loss", default="ce", choices=["plain", "ce", "auf", "focal", "dpace", "chain", "combined"],
                   help="plain: CE, every slot alike; ce: position-weighted CE; auf: CE up to the first failure; focal: first-error focal; "
                        "dpace: CE weighted by reach probability; chain: -expected accepted length; "
                        "combined: ce + focal + chain")
    p.add_argument("--gamma", type=float, default=4.0,
                   help="position weight exp(-(k-1)/gamma) for --loss ce / combined")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fuse-last", action=argparse.BooleanOptionalAction, default=True,
                   help="add the last context position's features to the block inputs (EAGLE-style fusion)")
    p.add_argument("--fuse-norm", action=argparse.BooleanOptionalAction, default=False,
                   help="RMS-normalise the fused features to the embeddings' scale (so they do not drown the anchor)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for training (fp32 master weights); default: on where this CPU has "
                   "bf16 matrix instructions (AMX / AVX-512 BF16), off on AVX2-only CPUs where it is ~20x slower")
    p.add_argument("--feature-dtype", default="bf16", choices=["fp32", "bf16"],
                   help="target precision when computing the training features")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training at this wall-clock budget")
    p.add_argument("--init", default=None, help="start from this checkpoint")
    p.add_argument("--expand-block", type=int, default=None, help="DBloom: continue --init at a larger block")
    p.add_argument("--expand-init", default="extrapolate", choices=["extrapolate", "copy"],
                   help="with --expand-block: the new slots' position embeddings, extrapolated from the last two "
                        "trained slots' or copies of the last one's")
    p.add_argument("--emphasize-new", type=float, default=1.0,
                   help="with --expand-block: add this weight x the loss of the new slots alone (DBloom's emphasis; "
                        "0 = none)")
    p.add_argument("--compare-losses", default=None, help="e.g. ce,auf,dpace: train each briefly, print held-out tau")
    p.add_argument("--eval-only", action="store_true",
                   help="no training: evaluate --init on the held-out data, calibrate its trees, write --out")
    p.set_defaults(module=M, func="train_main")

    p = sub.add_parser("floor", help="per-slot information floor and the drafter's model gap")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", default="data/distill")
    p.add_argument("--drafter", default=None, help="checkpoint whose model gap to measure")
    p.add_argument("--contexts", type=int, default=16)
    p.add_argument("--rollouts", type=int, default=64,
                   help="sampled prefixes per context where the prefix space is too large to enumerate")
    p.add_argument("--max-prefixes", type=int, default=256,
                   help="enumerate a slot's prefixes exactly while there are at most this many")
    p.add_argument("--slots", type=int, default=7)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0,
                   help="target samples from its top-k renormalised (0 = full softmax); small k makes "
                        "the early slots exactly enumerable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", default=None,
                   help="e.g. open_writing,chat_multiturn: one report per bench workload, contexts from the target's "
                        "greedy answers to its prompts (instead of --data's held-out records)")
    p.add_argument("--out", default="floor.png", help="PNG; the numbers go to the same name with .json")
    p.set_defaults(module=M, func="floor_main")
    p = sub.add_parser("tree-study", help="draft trees on held-out bench prompts: prefix-blind vs path-conditioned "
                       "scoring per node budget, entropy-switched budgets (writes JSON, table, PNG)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default=None, help="checkpoint (default: the bundled one)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--workloads", default="open_writing,chat_multiturn,code_edit,summarize_quotes")
    p.add_argument("--prompts", type=int, default=None, help="first N prompts of each workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--width", type=int, default=6, help="candidates per slot")
    p.add_argument("--entropy-bins", type=int, default=4)
    p.add_argument("--beta", type=float, default=None,
                   help="a linear verify cost per scored token, in forwards (default: each budget's forward time "
                        "measured here)")
    p.add_argument("--out", default="tree-study", help="directory for results.json, report.md, tree-study.png")
    p.add_argument("--write-calibration", default=None,
                   help="also fit both scorers on every anchor and write calibration.json into this checkpoint dir")
    p.set_defaults(module=M, func="tree_study_main")
    p = sub.add_parser("accel-drafter", help="the whole drafter recipe on one accelerator in a time budget "
                       "(synthesised instructions, greedy responses, batched training, held-out τ)")
    add_accel_arguments(p)
    p.set_defaults(module="specmesh.blockdraft.accel", func="run")


def add_accel_arguments(ap: argparse.ArgumentParser) -> None:
    """Arguments of ``accel-drafter`` (kept here: building the CLI must not import torch)."""
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target alias or HF model directory")
    ap.add_argument("--model-dir", default=None,
                    help="instead of --model: a directory of config + tokenizer files (weights too unless --gguf)")
    ap.add_argument("--gguf", default=None, help="take the weights from this GGUF file (exact dequantisation)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    ap.add_argument("--seconds", type=float, default=480, help="wall-clock budget of the whole run")
    ap.add_argument("--instructions", type=int, default=20000, help="instructions to synthesise (at most)")
    ap.add_argument("--extra-train", action="append", default=[],
                    help="records to train on as well: a distill-data directory (its train split) or a JSONL(.xz) "
                         "file, e.g. a previous run's records.jsonl.xz; repeatable")
    ap.add_argument("--heldout", action="append", default=[],
                    help="held-out records: a distill-data directory (its held-out split) or a JSONL(.xz) file; repeatable")
    ap.add_argument("--heldout-prompts", action="append", default=[],
                    help="bench workload JSONL whose prompts get greedy responses here and join held-out")
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=640)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--feature-layers", default="2,14,27")
    ap.add_argument("--n-keep", type=int, default=8192)
    ap.add_argument("--losses", default="ce", help="comma list: one drafter per loss, same batches")
    ap.add_argument("--init", default=None, help="continue this checkpoint instead of a new drafter")
    ap.add_argument("--expand-block", type=int, default=None, help="with --init: continue at this larger block")
    ap.add_argument("--expand-init", default="extrapolate", choices=["extrapolate", "copy"],
                    help="with --expand-block: the new slots' position embeddings (see train-drafter)")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--seqs", type=int, default=64, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default="0.15,0.45,0.52,0.92",
                    help="budget fractions at which instructions, responses, features, training end")


def distill_main(args) -> int:
    from ..runtime import Runtime
    from ..blockdraft.data import generate_shards

    rt = Runtime(args.model, dtype=args.dtype, n_slots=args.slots, max_seq_len=1024, block_drafter=False)
    out = generate_shards(rt, Path(args.out), args.max_new_tokens, limit=args.limit, only_split=args.split)
    print(f"wrote {out}")
    return 0


def _examples(args, engine, layers):
    """Training and held-out examples with their target features. Features are cached
    next to the data (``features-<dtype>-<layers>.pt``, keyed by the shards' ids) so a
    second run (--compare-losses, --expand-block) skips the target passes."""
    import hashlib

    import torch

    from ..blockdraft.data import load_records
    from ..blockdraft.train import prepare, usable

    train_recs = load_records(Path(args.data), "train")
    held = load_records(Path(args.data), "heldout")
    if not train_recs:
        raise SystemExit(f"no training records in {args.data}; run `specmesh distill-data --out {args.data}` first")
    key = hashlib.sha256(" ".join(r["id"] for r in train_recs + held).encode()).hexdigest()[:12]
    cache = Path(args.data) / f"features-{args.feature_dtype}-{'-'.join(map(str, layers))}.pt"
    if cache.exists():
        saved = torch.load(cache, weights_only=False)
        if saved.get("key") == key:
            print(f"target features from {cache}")
            for recs, exs in ((train_recs, saved["train"]), (held, saved["heldout"])):
                kept = [r for r in recs if usable(r, saved.get("max_len", 1024))]
                for r, e in zip(kept, exs):
                    e.kind = r.get("kind", "")
            return train_recs, saved["train"], saved["heldout"]
    tr = prepare(engine(), train_recs, layers, "target features (train)")
    he = prepare(engine(), held, layers, "target features (held-out)")
    tmp = cache.with_suffix(".tmp")
    torch.save({"key": key, "train": tr, "heldout": he, "max_len": engine().max_seq_len}, tmp)
    tmp.rename(cache)
    return train_recs, tr, he


def _verdict(ev: dict) -> str:
    c = ev["ceiling_fraction"]
    if c > 0.10:
        return f"ceiling bin {c:.1%} > 10%: the block size binds; a longer block (--expand-block) should pay"
    return f"ceiling bin {c:.1%} <= 10%: the block size does not bind"


def _report(ev: dict, label: str) -> None:
    print(f"[{label}] per-slot accuracy (given earlier slots correct): "
          + " ".join(f"{a:.2f}" for a in ev["slot_accuracy"]))
    print(f"[{label}] accepted-length histogram: {ev['accept_hist']} (last bin = ceiling)")
    print(f"[{label}] expected tau {ev['tau_expected']:.3f}, measured tau {ev['tau_measured']:.3f}")
    print(f"[{label}] preflight: {_verdict(ev)}")


def _calibrate(model, examples, width: int = 3, seed: int = 2):
    """(slot, prob, accepted | parent accepted) samples on held-out -> Calibration."""
    import torch

    from ..blockdraft.losses import IGNORE
    from ..blockdraft.train import _anchors, block_batch
    from ..blockdraft.tree import Calibration

    rng = random.Random(seed)
    samples = []
    with torch.no_grad():
        for ex in examples:
            anchors = _anchors(ex, 16, rng)
            if not anchors:
                continue
            logits, tgt = block_batch(model, ex, anchors)
            top = torch.topk(torch.softmax(logits, -1), width, -1)
            for a in range(len(anchors)):
                for k in range(logits.shape[1]):
                    if tgt[a, k] == IGNORE:
                        break
                    for p, i in zip(top.values[a, k], top.indices[a, k]):
                        samples.append((k, float(p), bool(i == tgt[a, k])))
                    if not bool((top.indices[a, k] == tgt[a, k]).any()):
                        break  # deeper slots: parent not in the tree
    return Calibration.fit(samples, logits.shape[1])


def plot_hist(hist, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    colors = ["tab:blue"] * (len(hist) - 1) + ["tab:red"]
    ax.bar(range(len(hist)), hist, color=colors)
    ax.set_xlabel("accepted draft tokens per round (red = ceiling bin)")
    ax.set_ylabel("rounds")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_main(args) -> int:
    import torch

    from ..engine import LlamaEngine
    from ..models.loading import load_state_dict, resolve_model
    from ..blockdraft.model import load_block_drafter

    if args.eval_only and not args.init:
        from ..types import InvalidArgument

        raise InvalidArgument("--eval-only", "needs --init CHECKPOINT")
    t0 = time.time()
    if args.amp is None:
        from ..engine.device import cpu_bf16_is_fast

        args.amp = cpu_bf16_is_fast()
    torch.manual_seed(args.seed)
    target_dir = resolve_model(args.model)
    tsd = load_state_dict(target_dir)
    engines = []

    def engine():  # loaded only when the features are not cached yet
        if not engines:
            engines.append(LlamaEngine.from_pretrained(str(target_dir), dtype=args.feature_dtype, n_slots=1,
                                                       max_seq_len=1024, quiet=True))
        return engines[0]

    model = load_block_drafter(Path(args.init), tsd) if args.init else None
    layers = model.cfg.feature_layers if model is not None else [int(x) for x in args.feature_layers.split(",")]
    train_recs, train_ex, held_ex = _examples(args, engine, layers)
    engines.clear()
    model, curriculum = _initial_model(args, model, tsd, target_dir, layers, train_recs)
    print(f"drafter: {model.n_params() / 1e6:.2f}M trainable+buffers params, block {model.cfg.block}, "
          f"{len(train_ex)} train / {len(held_ex)} held-out sequences")
    if args.compare_losses:
        return _compare_losses(args, model, tsd, train_ex, held_ex)
    return _train_and_save(args, model, train_ex, held_ex, curriculum, t0)


def _initial_model(args, model, tsd, target_dir, layers, train_recs):
    """The model to train (a new one unless ``--init``), block-expanded with
    ``--expand-block``; and the curriculum's first new slot (None: no expansion)."""
    from ..models.loading import load_config
    from ..blockdraft.model import BlockDrafterConfig
    from ..blockdraft.train import expand_block, keep_ids_from, new_model

    if model is None:
        tcfg = load_config(target_dir)
        cfg = BlockDrafterConfig(block=args.block, n_layers=args.layers, hidden=tcfg["hidden_size"],
                                 n_heads=tcfg["num_attention_heads"], vocab_size=tcfg["vocab_size"],
                                 feature_layers=layers, context_window=args.context_window, target=args.model,
                                 n_keep=args.n_keep, fuse_last=args.fuse_last,
                                 fuse_norm=args.fuse_last and args.fuse_norm)
        model = new_model(cfg, tsd, keep_ids_from(train_recs, args.n_keep, cfg.vocab_size))
    if not args.expand_block:
        return model, None
    first_new = model.cfg.block - 1  # the curriculum phases in the slots from here on
    return expand_block(model, args.expand_block, tsd, args.expand_init), first_new


def _compare_losses(args, model, tsd, train_ex, held_ex) -> int:
    """``--compare-losses a,b``: each loss on the same data, seed and budget, from scratch, or
    with ``--init`` from that checkpoint (then its untrained evaluation is the first row);
    one table."""
    import copy

    import torch

    from ..blockdraft.train import evaluate, evaluate_by_kind, new_model, train

    rows = []

    def row(m, label: str, name: str) -> None:  # held-out evaluation, overall and per kind
        ev = evaluate(m, held_ex, amp=args.amp)
        ev["by_kind"] = evaluate_by_kind(m, held_ex, amp=args.amp)
        rows.append((label, ev))
        _report(ev, name)

    if args.init:
        row(model, "(init, not trained)", "init")
    for loss in args.compare_losses.split(","):
        torch.manual_seed(args.seed)
        m = copy.deepcopy(model) if args.init else new_model(model.cfg, tsd, model.keep_ids)
        train(m, train_ex, args.steps, loss=loss, lr=args.lr, batch=args.batch, anchors_per_seq=args.anchors,
              gamma=args.gamma, seed=args.seed, amp=args.amp, max_minutes=args.max_minutes)
        row(m, loss, loss)
    kinds = sorted(rows[0][1]["by_kind"])
    table = ["| loss | held-out τ (all) | " + " | ".join(f"τ {k}" for k in kinds) + " | slot-1 acc | slot-2 acc |",
             "|---|---|" + "---|" * len(kinds) + "---|---|"]
    for loss, ev in rows:
        acc = ev["slot_accuracy"] + [0.0, 0.0]
        table.append(f"| {loss} | {ev['tau_measured']:.3f} | "
                     + " | ".join(f"{ev['by_kind'][k]['tau_measured']:.3f}" for k in kinds)
                     + f" | {acc[0]:.3f} | {acc[1]:.3f} |")
    print("\n" + "\n".join(table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = f"from {args.init}" if args.init else "from scratch"
    (out / "compare_losses.md").write_text(
        f"Each loss trained {start} for {args.steps} steps on the same data and seed "
        f"(`specmesh {' '.join(sys.argv[1:])}`).\n\n" + "\n".join(table) + "\n")
    (out / "compare_losses.json").write_text(json.dumps({loss: ev for loss, ev in rows}, indent=2))
    print(f"wrote {out / 'compare_losses.md'}")
    return 0


def _train_and_save(args, model, train_ex, held_ex, curriculum, t0: float) -> int:
    """Train (unless ``--eval-only``), evaluate on the held-out set, calibrate the
    tree, and write the checkpoint with its metrics and acceptance histogram."""
    from ..blockdraft.model import save_block_drafter
    from ..blockdraft.train import evaluate, evaluate_by_kind, train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curve: list[float] = []
    if not args.eval_only:
        with open(out / "train.log", "a") as logf:
            curve = train(model, train_ex, args.steps, loss=args.loss, lr=args.lr, batch=args.batch,
                          anchors_per_seq=args.anchors, gamma=args.gamma, seed=args.seed,
                          curriculum_from=curriculum, log=lambda s: logf.write(s + "\n"), amp=args.amp,
                          max_minutes=args.max_minutes, emphasis=args.emphasize_new if curriculum is not None else 0.0)
    ev = evaluate(model, held_ex, amp=args.amp)
    _report(ev, "held-out")
    ev["by_kind"] = evaluate_by_kind(model, held_ex, amp=args.amp)
    for kind, e in ev["by_kind"].items():
        print(f"[held-out {kind}] tau {e['tau_measured']:.3f}, per-slot accuracy "
              + " ".join(f"{a:.2f}" for a in e["slot_accuracy"]) + f" ({e['rounds']} rounds)")
    cal = _calibrate(model, held_ex)
    save_block_drafter(model, out)
    (out / "calibration.json").write_text(json.dumps(cal.to_dict()))
    cmd = "specmesh " + " ".join(sys.argv[1:])
    metrics = dict(ev, loss=args.loss, steps=len(curve), final_loss=sum(curve[-20:]) / max(1, len(curve[-20:])),
                   minutes=(time.time() - t0) / 60, command=cmd)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    plot_hist(ev["accept_hist"], out / "accept_hist.png", f"held-out acceptance, block {model.cfg.block}")
    print(f"saved {out} in {(time.time() - t0) / 60:.1f} min")
    return 0


def floor_main(args) -> int:
    """Per-slot floors from the target's exact conditionals (``floor.floors``) on
    held-out contexts, optionally the drafter's measured rejection and model gap;
    with ``--workloads``, one report per bench workload (contexts cut from the
    target's greedy answers to its prompts: ``treestudy.heldout_sequences``)."""
    from ..runtime import Runtime
    from ..blockdraft.data import load_records

    rt = Runtime(args.model, dtype="fp32", n_slots=4, max_seq_len=1024, quiet=True, block_drafter=False,
                 specialist=None)
    drafter = None
    if args.drafter:
        from ..blockdraft.serve import BlockSelfDrafter

        drafter = BlockSelfDrafter.from_checkpoint(rt.verifier, args.drafter)
    if not args.workloads:
        recs = load_records(Path(args.data), "heldout")[: args.contexts]
        if not recs:
            raise SystemExit(f"no held-out records in {args.data} (or pass --workloads)")
        res = _floor_report(rt, drafter, _floor_contexts(recs, args.slots), args)
        plot_path = Path(args.out)
        _write_floor(res, plot_path)
        return 0
    from ..models.loading import cache_root
    from ..blockdraft.treestudy import heldout_sequences

    root = cache_root() / "tree-study"
    have = sorted(root.glob(f"{Path(rt.model_dir).name}-*.jsonl")) if root.exists() else []
    cache = have[0] if have else root / f"{Path(rt.model_dir).name}-fp32-128.jsonl"
    workloads = [w for w in args.workloads.split(",") if w]
    recs = heldout_sequences(rt, _workload_prompts(workloads), 128, cache)
    out: dict = {}
    for w in workloads:
        print(f"## {w}")
        res = _floor_report(rt, drafter, _floor_contexts([r for r in recs if r["workload"] == w][: args.contexts],
                                                         args.slots), args)
        out[w] = res
        _write_floor(res, Path(args.out).with_name(f"{Path(args.out).stem}-{w}.png"), title=f"{w}: floor vs drafter")
    if drafter is not None:
        print("\nper workload, mean over slots: drafter's one-token rejection vs the order-0 floor (and the "
              "autoregressive floor 'all')")
        for w, res in out.items():
            m = sum(res["measured"]) / len(res["measured"])
            f0 = sum(res["order0"]) / len(res["order0"])
            fa = sum(res["order_all"]) / len(res["order_all"])
            print(f"  {w:18s} measured {m:.3f}  floor order0 {f0:.3f}  gap {m - f0:+.3f}  (all {fa:.3f})")
    summary = Path(args.out).with_suffix(".json")
    summary.write_text(json.dumps(out, indent=2))
    print(f"wrote {summary}")
    return 0


def _workload_prompts(workloads: list[str], per_workload=None) -> list:
    from ..workloads import load

    loads = load(workloads, per_workload=per_workload)
    return [p for w in workloads for p in loads[w]]


def _floor_contexts(recs: list[dict], slots: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for r in recs:
        cut = rng.randrange(0, max(1, len(r["response_ids"]) - slots))
        out.append(r["prompt_ids"] + r["response_ids"][:cut])
    return out


def _write_floor(res: dict, png: Path, title=None) -> None:
    from ..blockdraft.floor import plot_floor

    plot_floor(res, png, title)
    png.with_suffix(".json").write_text(json.dumps(res, indent=2))
    print(f"wrote {png} and {png.with_suffix('.json')}")


def _floor_report(rt, drafter, contexts: list[list[int]], args) -> dict:
    """``floors`` over ``contexts`` (with the drafter's served distributions when given); prints the table."""
    import torch
    from tqdm import tqdm

    from ..blockdraft.floor import EngineTarget, floors

    slots = args.slots
    drafts = None
    if drafter is not None:
        from ..types import DraftContext

        keep = drafter.model.keep_ids
        drafts = []
        for i, ctx in enumerate(contexts):
            sid = f"floor-pred-{i}"
            rt.verifier.prefill(sid, ctx[:-1])
            lg = drafter.slot_logits(DraftContext(sid, ctx, len(ctx))).float()
            rt.verifier.release(sid)
            qs = []
            for k in range(lg.shape[0]):  # what the served drafter proposes from (serve.BlockSelfDrafter.propose)
                q = torch.zeros(rt.vocab_size, dtype=torch.float64)
                if args.temperature == 0:
                    q[int(keep[int(lg[k].argmax())])] = 1.0
                else:
                    vals, idx = torch.topk(lg[k] / args.temperature, drafter.top_k)
                    q[keep[idx]] = torch.softmax(vals.double(), -1)
                qs.append(q)
            drafts.append(qs)
        slots = min(slots, len(drafts[0]))
    target = EngineTarget(rt.verifier, args.temperature, args.top_k)
    bar = tqdm(total=len(contexts), desc="target conditionals", file=sys.stderr)
    try:
        res = floors(target, contexts, slots, rollouts=args.rollouts, seed=args.seed, max_prefixes=args.max_prefixes,
                     drafts=drafts, progress=bar.update)
    finally:
        bar.close()
        target.close()
    res.update(temperature=args.temperature, top_k=args.top_k, model=args.model, drafter=args.drafter)

    def rng_(key: str, k: int) -> str:  # "a" where exact (or the bracket is closed), else "plug-in-upper"
        lo, hi = res[key][k], res[key + "_upper"][k]
        return f"{lo:.3f}" if abs(hi - lo) < 5e-4 else f"{lo:.3f}-{hi:.3f}"

    head = (f"{'slot':>4}  {'exact':>5}  {'order0':>11}  {'order1':>11}  {'all':>5}  {'TV order0':>11}  "
            f"{'TV order1':>11}")
    if drafts is not None:
        head += "  measured  gap0  meas.TV  gapTV"
    print(head)
    for k in range(slots):
        line = (f"{k + 1:4d}  {res['exact'][k]:5.2f}  {rng_('order0', k):>11}  {rng_('order1', k):>11}  "
                f"{res['order_all'][k]:5.3f}  {rng_('tv_order0', k):>11}  {rng_('tv_order1', k):>11}")
        if drafts is not None:
            line += (f"  {res['measured'][k]:8.3f}  {res['gap_order0'][k]:+.3f}  {res['measured_tv'][k]:7.3f}"
                     f"  {res['gap_tv_order0'][k]:+.3f}")
        print(line)
    print("one-token drafts: 1 - P(draft = target's sample); TV: drafts sampled from q under rejection sampling. "
          "a-b: Monte Carlo bracket (plug-in, biased low - cross-fitted, biased high); exact: share of contexts "
          "whose slot was enumerated exactly")
    return res


def tree_study_main(args) -> int:
    """``treestudy``: held-out answers, drafts at every position, scorers and budgets compared."""
    from ..models.loading import cache_root
    from ..runtime import Runtime, block_drafter_path
    from ..blockdraft.serve import SCHEDULE_FILE, BlockSelfDrafter
    from ..blockdraft.treestudy import collect, evaluate, fit_scorers, forward_costs, heldout_sequences, plot, \
        schedule_from, schedule_table, workload_table

    ckpt = Path(args.drafter) if args.drafter else block_drafter_path(args.model)
    if ckpt is None:
        raise SystemExit(f"no block drafter checkpoint for {args.model}; pass --drafter DIR")
    rt = Runtime(args.model, dtype=args.dtype, n_slots=2, max_seq_len=2048, quiet=True, block_drafter=False,
                 specialist=None)
    drafter = BlockSelfDrafter.from_checkpoint(rt.verifier, ckpt)
    workloads = [w for w in args.workloads.split(",") if w]
    cache = cache_root() / "tree-study" / f"{Path(rt.model_dir).name}-{args.dtype}-{args.max_new_tokens}.jsonl"
    recs = heldout_sequences(rt, _workload_prompts(workloads, args.prompts), args.max_new_tokens, cache)
    data = collect(rt, drafter, recs, args.width)
    costs = forward_costs(rt)
    c = data.draft_ms / costs["forward_ms"][0]
    res = evaluate(data, c=c, beta=args.beta or 0.0, bins=args.entropy_bins,
                   verify_cost=None if args.beta is not None else costs["verify_cost"])
    res.update(model=args.model, drafter=str(ckpt), dtype=args.dtype, max_new_tokens=args.max_new_tokens,
               width=args.width, forward_ms=costs["forward_ms"], prompts=len(recs))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = (f"# tree study: {args.model}, {ckpt}, {args.dtype}, {len(recs)} held-out prompts, {res['anchors']} "
              f"rounds\n\nτ of greedy verification per node budget (cross-fitted scorers):\n\n{workload_table(res)}"
              f"\n\nacceptance given parent accepted, per path class (non-top nodes on the path): "
              f"{json.dumps(res['path_class_acceptance'])}\n\nτ (path scorer) by the target's entropy at the "
              f"pending token:\n\n{schedule_table(res)}\n\nforward ms by drafted nodes (n + 1 scored tokens): "
              f"{ {n: round(v, 2) for n, v in costs['forward_ms'].items()} }; draft {data.draft_ms:.2f} ms "
              f"(c = {c:.3f} of a 1-token forward)\n")
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    plot(res, out / "tree-study.png")
    print(report)
    print(f"wrote {out / 'report.md'}, {out / 'results.json'}, {out / 'tree-study.png'}")
    if args.write_calibration:
        blind, path = fit_scorers(data.anchors, res["n_slots"])
        dest = Path(args.write_calibration) / "calibration.json"
        dest.write_text(json.dumps({**blind.to_dict(), "path": path.to_dict()}))
        sched = Path(args.write_calibration) / SCHEDULE_FILE
        sched.write_text(json.dumps(schedule_from(data.anchors, path, bins=args.entropy_bins).to_dict(), indent=1))
        print(f"wrote {dest} (prefix-blind and path-conditioned) and {sched} (entropy-switched tree budgets), "
              f"fitted on all {res['anchors']} rounds")
    return 0
