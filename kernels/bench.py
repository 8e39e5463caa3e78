"""Microbenchmark: Triton kernels vs the torch references on CUDA.

``python -m specmesh.kernels.bench [--batch N] [--depth K] [--vocab V] [--tree T]`` times each op
(median of CUDA-event timed repeats, after warm-up) on random inputs and reports how
many sessions' outputs differ between the two (expected: 0). Without CUDA or triton it
prints a note and exits 0. Knows nothing about models; inputs are synthetic.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from specmesh import kernels


def _time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _diff(x, y) -> int:
    """Sessions whose outputs differ (each output has the batch first)."""
    bad = torch.zeros(x[0].shape[0], dtype=torch.bool, device=x[0].device)
    for a, b in zip(x, y):
        bad |= (a != b).reshape(a.shape[0], -1).any(1)
    return int(bad.sum())


def _random_tree(n: int, t: int, g: torch.Generator) -> torch.Tensor:
    """[N, T] parents: each node hangs under a random earlier node (or the root)."""
    hi = torch.arange(t).expand(n, t).float()
    return ((torch.rand(n, t, generator=g) * (hi + 1)).long() - 1).clamp_max(hi.long() - 1)


def cases(dev: str, n: int, k: int, t: int, v: int) -> dict:
    """name -> fn(backend) running one op on random inputs on ``dev``."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, max(k, t) + 1, v, generator=g) * 4
    probs = torch.softmax(logits, -1).to(dev)
    q = torch.softmax(logits + torch.randn(logits.shape, generator=g), -1).to(dev)
    logits = logits.to(dev)
    tok = torch.multinomial(q[:, :-1].reshape(-1, v).cpu(), 1, generator=g).view(n, -1).to(dev)
    lens = torch.randint(0, k + 1, (n,), generator=g).to(dev)
    ua = torch.rand(n, max(k, t), generator=g, dtype=torch.float64).to(dev)
    us = torch.rand(n, max(k, t) + 1, generator=g, dtype=torch.float64).to(dev)
    parents = _random_tree(n, t, g).to(dev)
    sizes = torch.full((n,), t, device=dev)
    prefix = torch.randint(0, 512, (n,), generator=g).to(dev)
    topk = q[:, :t].topk(min(16, v), -1)
    return {
        "chain greedy": lambda b: kernels.chain_accept(logits[:, : k + 1], tok[:, :k], None, None, None, lens,
                                                       True, backend=b),
        "chain reject dense q": lambda b: kernels.chain_accept(probs[:, : k + 1], tok[:, :k], q[:, :k], ua[:, :k],
                                                               us[:, : k + 1], lens, backend=b),
        "tree reject sparse q": lambda b: kernels.tree_accept(probs[:, : t + 1], tok[:, :t], parents, sizes,
                                                              (topk.indices, topk.values), ua[:, :t], us, backend=b),
        "tree reject one-hot": lambda b: kernels.tree_accept(probs[:, : t + 1], tok[:, :t], parents, sizes, None,
                                                             ua[:, :t], us, backend=b),
        "tree greedy": lambda b: kernels.tree_accept(logits[:, : t + 1], tok[:, :t], parents, sizes, greedy=True,
                                                     backend=b),
        "residual_sample": lambda b: (kernels.residual_sample(probs[:, 0], q[:, 0], us[:, 0], backend=b),),
        "tree_mask_and_positions": lambda b: kernels.tree_mask_and_positions(parents, sizes, prefix, backend=b),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--depth", type=int, default=8, help="chain drafts per session (K)")
    ap.add_argument("--tree", type=int, default=32, help="tree nodes per session (T)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench: no CUDA device here; nothing to benchmark (the Triton kernels run on CUDA).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernels.bench: triton is not installed; nothing to benchmark.")
        return 0
    n, k, t, v = args.batch, args.depth, args.tree, args.vocab
    print(f"batch={n} chain K={k} tree T={t} vocab={v}  ({torch.cuda.get_device_name()})")
    print(f"{'op':26s} {'triton ms':>10s} {'torch ms':>10s} {'speedup':>8s} {'differ':>7s}")
    for name, fn in cases("cuda", n, k, t, v).items():
        tri, ref = fn("triton"), fn("torch")
        ms_t = _time_ms(lambda: fn("triton"), args.reps)
        ms_r = _time_ms(lambda: fn("torch"), args.reps)
        print(f"{name:26s} {ms_t:10.3f} {ms_r:10.3f} {ms_r / ms_t:7.1f}x {_diff(tri, ref):7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
