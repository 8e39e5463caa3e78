#!/usr/bin/env python3
"""Where a decode step's and a speculative round's time goes, on one engine dtype.

Part 1, the engine's decode step (one token after a prompt, ``engine.score`` as the
verifier calls it), split three ways by replaying its pieces alone, in the same
process, alternating with the full step:

- matmuls: every weight matmul of the step (per layer qkv, o, gate_up, down; the LM
  head) on inputs of the step's shapes, back to back (where the int4 or bf16 layers run in one
  C call, ``layer_stack``, the layer matmuls are replayed as bare kernel calls, as the
  driver makes them);
- attention: the step's attention calls (one per layer: the key-list kernel, which
  also applies RoPE and writes the K/V cache, or SDPA on its padded key length with
  ``SPECMESH_CPU_ATTENTION=sdpa``);
- rest: the full step minus those two: elementwise ops, norms (and, with SDPA, RoPE
  and KV writes), indexing, and Python (the per-layer loop, plans, argument checks).

"overhead" below = rest / step: what the issue asks to keep under 10%.
It also counts the torch ops one step dispatches (torch.profiler, one extra step).

Part 2, speculative rounds through the real loop (``generate_tokens`` with a self
drafter, default ``block_tree``) on bench prompts: wall time split into the engine's
forwards (``score_batch``), the drafter (``propose``), acceptance (``accept_batch``),
and the rest (verifier bookkeeping: commit, features, tree assembly; loop and policy),
by wrapping those calls with timers (a few microseconds each).

Medians over repeats; the machine may be shared, so the shares matter more than the
milliseconds. Deterministic in what it runs, not in its timings (it asserts nothing).

    .venv/bin/python scripts/step_profile.py --dtype int4
    .venv/bin/python scripts/step_profile.py --dtype int8 --drafter block --prompts 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.spin_threads()

import torch
import torch.nn.functional as F


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def engine_step(rt, ctx_len: int, reps: int, rows: int = 1) -> dict:
    """Part 1 for a forward scoring ``rows`` tokens as a chain (1: a decode step; 8: an
    8-token chain verify)."""
    eng = rt.engine
    slot = 0
    prompt = [int(t) % eng.vocab_size for t in range(100, 100 + ctx_len)]
    eng.reset(slot)
    eng.prefill(slot, prompt)
    feats = tuple(rt.verifier.feature_layers)  # what the verifier asks for (the block drafter's layers)

    toks, parents = [42 + i for i in range(rows)], [i - 1 for i in range(rows)]

    def step():
        eng.score(slot, toks, parents, hidden_layers=feats)

    # the step's matmuls, replayed alone with inputs of the step's shapes
    ad = eng.act_dtype
    n = eng._padded_rows(rows) if eng.batch_invariant else rows
    H, nq, hd = eng.hidden, eng.n_heads, eng.head_dim
    inter = eng.layers[0].gate_up.out_features // 2
    x_h = torch.randn(n, H, dtype=ad)
    x_o = torch.randn(n, nq * hd, dtype=ad)
    x_d = torch.randn(n, inter, dtype=ad)

    def matmuls():
        for L in eng.layers:
            L.qkv(x_h)
            L.o(x_o)
            L.gate_up(x_h)
            L.down(x_d)
        eng.head(x_h)

    if eng._layer_stack() is not None:  # the fused step calls the kernel from C: replay it with no Python wrapper
        calls = []
        for L in eng.layers:
            for lin, x in ((L.qkv, x_h), (L.o, x_o), (L.gate_up, x_h), (L.down, x_d)):
                y = torch.empty(n, lin.out_features, dtype=ad)
                if lin._k4 is not None:  # int4_mm
                    xs = torch.empty(n, lin.in_features // lin.group)
                    calls.append((lin._k4._mm, (x.data_ptr(), n, lin.in_features, lin.w.data_ptr(), lin.out_features,
                                                lin.group, xs.data_ptr(), y.data_ptr()), (x, y, xs)))
                else:  # bf16_mm (AMX where the matrix's inputs allow, as Linear picks it)
                    calls.append((lin._kb.fn(lin.in_features), (x.data_ptr(), n, lin.in_features, lin.w.data_ptr(), lin.out_features,
                                       y.data_ptr()), (x, y)))

        def matmuls():  # noqa: F811 - the stack's matmuls, as the driver makes them
            for fn, args, _ in calls:
                fn(*args)
            eng.head(x_h)

    # the step's attention, one call per layer as the forward makes it
    nk = eng.n_kv
    g = nq // nk
    base = eng.length(slot)
    if eng.batch_invariant and eng.attention == "keylist":  # one kernel call per layer, as the forward
        posi = torch.tensor(list(range(base, base + rows)) + [0] * (n - rows))
        kplan = eng._keylist_plan([(slot, 0, rows, base, parents)], n, posi)  # RoPE, K/V writes from base, attention
        qkv = torch.randn(n, (nq + 2 * nk) * hd, dtype=ad)

        def attention():
            for li in range(eng.n_layers):
                eng._keylist.layer(kplan, li, qkv)
    elif rows != 1:
        raise SystemExit("--rows above 1 replays the key-list attention only (SPECMESH_CPU_ATTENTION=keylist)")
    elif eng.batch_invariant:
        Lp = -(-(base + 1) // eng.key_block) * eng.key_block
        t, R = eng._split(1, *eng.attn_tiles)
        q = torch.randn(t, nk, R * g, hd, dtype=ad)
        mask = torch.zeros(t, 1, R * g, Lp, dtype=ad)
        mask[..., base + 1:] = float("-inf")
        kv = [(eng._k_buf[li, slot][:, :Lp].unsqueeze(0), eng._v_buf[li, slot][:, :Lp].unsqueeze(0))
              for li in range(eng.n_layers)]

        def attention():
            for k, v in kv:
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        q = torch.randn(1, nq, 1, hd, dtype=ad)
        kv = [(eng.k_cache[li, slot][:, : base + 1].unsqueeze(0), eng.v_cache[li, slot][:, : base + 1].unsqueeze(0))
              for li in range(eng.n_layers)]

        def attention():
            for k, v in kv:
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def step_per_call():  # the layers one kernel call at a time (fused_stack off)
        eng.fused_stack = False
        try:
            step()
        finally:
            eng.fused_stack = True

    parts = {"step": step, "matmuls": matmuls, "attention": attention}
    if eng._layer_stack() is not None:
        parts["step, per-call layers"] = step_per_call
    with torch.inference_mode():
        for f in parts.values():
            f()
        res = {k: [] for k in parts}
        for _ in range(reps):  # alternate, so drift hits all alike
            for k, f in parts.items():
                res[k].append(_median_ms(f, 3))
    out = {k: statistics.median(v) for k, v in res.items()}
    out["rest"] = out["step"] - out["matmuls"] - out["attention"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    ops = Counter()
    for e in prof.events():
        if e.name.startswith("aten::") and e.cpu_parent is None:
            ops[e.name] += 1
    out["top_level_ops"] = sum(ops.values())
    out["ops"] = ops.most_common(12)
    eng.reset(slot)
    return out


def rounds(rt, drafter: str, prompts, max_new: int) -> dict:
    from specmesh import acceptance as acc
    from specmesh import verifier as vmod
    from specmesh.loop import AdaptiveBudget, generate_tokens

    eng = rt.engine
    t = Counter()
    calls = Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t[name] += time.perf_counter() - t0
                calls[name] += 1
        return wrapper

    orig_score, orig_accept = eng.score_batch, vmod.acc.accept_batch
    d = rt.verifier.self_drafters[drafter] if drafter in rt.verifier.self_drafters else None
    orig_propose = d.propose if d is not None else None
    eng.score_batch = timed("engine forward", orig_score)
    vmod.acc.accept_batch = timed("acceptance", orig_accept)
    if d is not None:
        d.propose = timed("drafter", orig_propose)
    wall = 0.0
    toks = 0
    st_rounds = 0
    try:
        for ids in prompts:  # prefill outside the timing: the first call fills the KV
            pol = AdaptiveBudget.for_drafter(drafter, 8, costs=rt.verify_costs,  # as the bench builds it
                                             schedule=getattr(rt, "tree_schedule", None))
            t0 = time.perf_counter()
            out, st = generate_tokens(None, rt.verifier, ids, max_new_tokens=max_new, stop_ids=rt.stop_ids,
                                      budget=pol, self_draft=drafter if d is not None else None)
            wall += time.perf_counter() - t0
            toks += len(out)
            st_rounds += st.rounds
    finally:
        eng.score_batch, vmod.acc.accept_batch = orig_score, orig_accept
        if d is not None:
            d.propose = orig_propose
    t["rest (verifier bookkeeping, loop)"] = wall - sum(t.values())
    return {"wall_s": wall, "tokens": toks, "rounds": st_rounds, "parts": dict(t), "calls": dict(calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--ctx", type=int, default=300, help="context length of the profiled step")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, default=1, help="tokens the profiled forward scores (a chain; 8: a verify)")
    ap.add_argument("--drafter", default="block_tree", help="self drafter for part 2 ('' skips part 2)")
    ap.add_argument("--workloads", default="open_writing,code_edit")
    ap.add_argument("--prompts", type=int, default=1, help="per workload, part 2")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    from specmesh.workloads import load
    from specmesh.runtime import Runtime

    rt = Runtime(a.model, dtype=a.dtype, n_slots=2, max_seq_len=2048, quiet=True)
    torch_threads = torch.get_num_threads()
    s = engine_step(rt, a.ctx, a.reps, a.rows)
    print(f"\n{a.model} {a.dtype}, torch threads {torch_threads}, batch-invariant {rt.engine.batch_invariant} "
          f"(attention {rt.engine.attention}); "
          f"{'decode step' if a.rows == 1 else f'{a.rows}-token chain forward'} after {a.ctx} tokens "
          f"(median of {a.reps} x 3)\n")
    print("| part | ms | share |\n|---|---:|---:|")
    for k in ("matmuls", "attention", "rest"):
        print(f"| {k} | {s[k]:.2f} | {s[k] / s['step']:.1%} |")
    print(f"| **step** | **{s['step']:.2f}** | 100% |")
    if "step, per-call layers" in s:  # the same step with the layers one kernel call at a time
        print(f"| step, per-call layers (`fused_stack` off) | {s['step, per-call layers']:.2f} | "
              f"{s['step, per-call layers'] / s['step']:.0%} |")
    print(f"\n{s['top_level_ops']} top-level torch ops per step; most frequent: "
          + ", ".join(f"{n.removeprefix('aten::')} {c}" for n, c in s["ops"]))
    if a.drafter:
        ps = [p for ps in load(a.workloads.split(","), a.prompts).values() for p in ps]
        ids = [rt.encode(p.prompt, p.messages) for p in ps]
        rounds(rt, a.drafter, ids[:1], 16)  # warm-up
        r = rounds(rt, a.drafter, ids, a.max_new_tokens)
        print(f"\n{a.drafter} rounds: {len(ids)} prompts, {r['tokens']} tokens in {r['rounds']} rounds, "
              f"{r['wall_s']:.2f} s ({r['tokens'] / r['wall_s']:.1f} tok/s, prefill included)\n")
        print("| part | s | share | calls |\n|---|---:|---:|---:|")
        for k, v in sorted(r["parts"].items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.3f} | {v / r['wall_s']:.1%} | {r['calls'].get(k, '')} |")


if __name__ == "__main__":
    main()
