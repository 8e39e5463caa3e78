"""``specmesh train-uno``: train the mask-gated adapter (``specmesh.uno``).

``train-uno`` trains the adapter by self-distillation (``uno.trainer``) on the block
drafter's records (the bundled Magpie records and/or ``specmesh distill-data``
shards), evaluates it on the held-out split (per-slot accuracy, acceptance
histogram, τ, by kind), fits the tree calibration, and writes the checkpoint:
``adapter.safetensors``, ``config.json``, ``calibration.json``, ``metrics.json``
(with the command), ``train.log`` and ``accept_hist.png``. Runs on the CPU
(``--dtype fp32``) or a GPU (``--device cuda --dtype bf16``). Knows nothing about gRPC.
"""

from __future__ import annotations

import json
import lzma
import random
import sys
import time
from pathlib import Path

M = "specmesh.cli.uno"
BUNDLED_RECORDS = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-block-drafter" / "magpie-records.jsonl.xz"


def register(sub) -> None:
    p = sub.add_parser("train-uno", help="train the mask-gated adapter (the target drafting for itself)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", action="append", default=None,
                   help="training records: a distill-data directory (train split) or a JSONL(.xz) file; repeatable "
                        "(default: the block drafter's bundled Magpie records)")
    p.add_argument("--heldout", default="data/distill",
                   help="distill-data directory whose heldout split is the evaluation set "
                        "(`specmesh distill-data --split heldout`)")
    p.add_argument("--out", default="checkpoints/smollm2-uno")
    p.add_argument("--init", default=None, help="continue from this adapter checkpoint")
    p.add_argument("--block", type=int, default=6,
                   help="M: gated rows per training block (block-causal: serving may use fewer; the diffusion "
                        "mode's blocks hold up to M + 1 positions)")
    p.add_argument("--diffusion", type=float, default=0.3,
                   help="fraction of training blocks in the diffusion form (some later positions filled, no readout)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--readout", type=int, default=512, help="inner width of the correction-conditioned readout")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds of training")
    p.add_argument("--seqs", type=int, default=4, help="sequences per step")
    p.add_argument("--anchors", type=int, default=24, help="anchors (mask blocks) per sequence")
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--soft", type=float, default=0.5,
                   help="weight of the soft loss (CE against the target's distribution); the rest is --loss")
    p.add_argument("--loss", default="ce", choices=["plain", "ce", "auf", "focal", "dpace", "chain", "combined"])
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="matmul dtype of the frozen target")
    p.add_argument("--device", default="cpu")
    p.add_argument("--eval-seqs", type=int, default=120, help="held-out sequences evaluated")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(module=M, func="train_main")


def read_records(src) -> list[dict]:
    """Records from a distill-data directory (train split) or a JSONL / JSONL.xz file."""
    p = Path(src)
    if p.is_dir():
        from ..blockdraft.data import load_records

        return load_records(p, "train")
    opener = lzma.open if p.suffix == ".xz" else open
    with opener(p, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def plot_hist(hist, path, title) -> None:
    from .blockdraft import plot_hist as _plot

    _plot(hist, path, title)


def calibrate(target, adapter, seqs, M: int, width: int = 4, seed: int = 2):
    """(slot, prob, accepted | parent accepted) on held-out anchors -> ``tree.Calibration``
    for ``uno_tree`` (as the block drafter's: a deeper slot counts only while the true
    token was among the drafted candidates)."""
    import torch

    from ..blockdraft.losses import IGNORE
    from ..blockdraft.tree import Calibration
    from ..uno.trainer import make_batch, step_logits

    rng = random.Random(seed)
    samples = []
    with torch.no_grad():
        for b in range(0, len(seqs), 4):
            logits, tgt, _ = step_logits(target, adapter, make_batch(seqs[b:b + 4], 16, M, rng, target.device), M,
                                         soft=False)
            top = torch.topk(torch.softmax(logits.float(), -1), width, -1)
            for a in range(logits.shape[0]):
                for k in range(M):
                    if tgt[a, k] == IGNORE:
                        break
                    for p, i in zip(top.values[a, k], top.indices[a, k]):
                        samples.append((k, float(p), bool(i == tgt[a, k])))
                    if not bool((top.indices[a, k] == tgt[a, k]).any()):
                        break
    return Calibration.fit(samples, M)


def train_main(args) -> int:
    import torch

    from ..models.loading import load_config, load_state_dict, resolve_model
    from ..uno.adapter import GatedAdapter, new_adapter
    from ..uno.trainer import FrozenTarget, evaluate, sequences, train

    t0 = time.time()
    torch.manual_seed(args.seed)
    d = resolve_model(args.model)
    cfg = load_config(d)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target = FrozenTarget(cfg, load_state_dict(d), dtype=dtype, device=args.device, max_len=max(1024, args.max_len))
    recs = [r for src in (args.data or [BUNDLED_RECORDS]) for r in read_records(src)]
    seqs = sequences(recs, args.max_len)
    held = []
    if args.heldout and Path(args.heldout).is_dir():
        from ..blockdraft.data import load_records

        held = sequences(load_records(Path(args.heldout), "heldout"), args.max_len)
        random.Random(7).shuffle(held)
        held = held[: args.eval_seqs]
    if args.init:
        ad = GatedAdapter.load(args.init, device=args.device)
        if ad.cfg.block != args.block:
            print(f"note: --init was trained with block {ad.cfg.block}; using {args.block}", file=sys.stderr)
            ad.cfg.block = args.block
    else:
        ad = new_adapter(cfg, rank=args.rank, readout=args.readout, block=args.block, embed=target.embed,
                         target=args.model, seed=args.seed).to(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"adapter: {sum(p.numel() for p in ad.parameters()) / 1e6:.2f}M params, block {args.block}; "
          f"{len(seqs)} training / {len(held)} held-out sequences; target {args.dtype} on {args.device}")
    base = evaluate(target, ad, held, args.block) if held and not args.init else None
    logf = (out / "train.log").open("w")

    def on_log(row):
        logf.write(json.dumps(row) + "\n")
        logf.flush()

    log = train(target, ad, seqs, args.steps, args.block, seqs_per_step=args.seqs, anchors_per_seq=args.anchors,
                lr=args.lr, loss=args.loss, soft=args.soft, gamma=args.gamma, seconds=args.seconds, seed=args.seed,
                on_log=on_log, diffusion=args.diffusion)
    logf.close()
    train_s = time.time() - t0
    metrics = {"command": "specmesh " + " ".join(sys.argv[1:]), "train_log_tail": log[-5:],
               "steps": log[-1]["step"] if log else 0, "train_seconds": round(log[-1]["seconds"], 1) if log else 0,
               "sequences_seen": (log[-1]["step"] if log else 0) * args.seqs,
               "anchor_blocks_seen": (log[-1]["step"] if log else 0) * args.seqs * args.anchors,
               "device": args.device, "dtype": args.dtype}
    if held:
        ev = evaluate(target, ad, held, args.block)
        by_kind = {}
        for k in sorted({s.kind for s in held}):
            e = evaluate(target, ad, [s for s in held if s.kind == k], args.block)
            by_kind[k] = {"tau_measured": e["tau_measured"], "slot_accuracy": e["slot_accuracy"], "rounds": e["rounds"]}
        metrics.update(heldout=ev, by_kind=by_kind, untrained=base)
        print(f"held-out: tau {ev['tau_measured']:.3f} (untrained {base['tau_measured']:.3f})" if base else
              f"held-out: tau {ev['tau_measured']:.3f}")
        print("slot accuracy: " + ", ".join(f"{a:.3f}" for a in ev["slot_accuracy"]))
        print(f"accepted-length histogram: {ev['accept_hist']} (last bin = ceiling)")
        (out / "calibration.json").write_text(json.dumps(calibrate(target, ad, held, args.block).to_dict()))
        plot_hist(ev["accept_hist"], out / "accept_hist.png", f"uno adapter, held-out acceptance, block {args.block}")
    ad.cfg.target = args.model
    ad.save(out)
    metrics["minutes"] = round((time.time() - t0) / 60, 1)
    metrics["train_minutes"] = round(train_s / 60, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"saved {out} ({ad.nbytes() / 1e6:.1f} MB in memory) in {metrics['minutes']} min")
    return 0
