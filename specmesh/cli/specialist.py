"""``specmesh train-specialist``: LoRA-tune a domain specialist of the target for
divergence decoding (the training itself: ``specmesh.drafters.specialist.train``).

This module only parses the flags and prints the result.
"""

from __future__ import annotations

from ..models.loading import DEFAULT_MODEL


def register(sub) -> None:
    p = sub.add_parser("train-specialist", help="LoRA-tune a domain specialist of the target (divergence decoding)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--domain", default="code", help="the specialist's domain (specialists know: code)")
    p.add_argument("--steps", type=int, default=150, help="AdamW steps of --batch x --seq-len tokens")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-minutes", type=float, default=15.0, help="stop training after this long (recorded)")
    p.add_argument("--eval-chunks", type=int, default=24, help="held-out rows of --seq-len tokens per eval set")
    p.add_argument("--out", default=None, help="adapter directory (default: the committed one under checkpoints/)")
    p.add_argument("--no-merged", dest="merged", action="store_false",
                   help="do not write the merged model directory into the cache")
    p.set_defaults(module="specmesh.cli.specialist", func="train_main")


def train_main(args) -> int:
    from ..drafters.specialist import DOMAINS, train  # imports torch: only to run

    if args.domain not in DOMAINS:
        from ..types import InvalidArgument

        raise InvalidArgument("--domain", f"must be one of {list(DOMAINS)}, got {args.domain!r}")
    m = train(args.model, args.domain, steps=args.steps, seq_len=args.seq_len, batch=args.batch, lr=args.lr,
              rank=args.rank, alpha=args.alpha, seed=args.seed, threads=args.threads, eval_chunks=args.eval_chunks,
              out=args.out, save_merged=args.merged, max_minutes=args.max_minutes)
    ppl = m["heldout_ppl"]
    print(f"{m['steps']} steps ({m['train_tokens']} tokens) in {m['train_seconds']:.0f} s; held-out perplexity "
          f"base -> specialist: {args.domain} {ppl['base']['code']:.2f} -> {ppl['specialist']['code']:.2f}, "
          f"off-domain prose {ppl['base']['prose']:.2f} -> {ppl['specialist']['prose']:.2f}")
    return 0
