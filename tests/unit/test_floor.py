"""The information floor from exact conditionals (specmesh/blockdraft/floor.py)
against targets with known floors: uniform over 100 tokens (one-token floor 0.99
at every slot, TV floor 0), a deterministic target (0 everywhere), a two-token
copy mixture with analytic floors (exact enumeration, and Monte Carlo with its
bracket), the TV knapsack against brute force, and the engine-backed target on a
tiny random model. Deterministic (seeded); no real model."""

from __future__ import annotations

import itertools

import pytest
import torch

from specmesh.blockdraft.floor import (EngineTarget, FunctionTarget, best_q, floors, slot_floors, target_probs,
                                       tv_value)

KEYS = ("order0", "order1", "tv_order0", "tv_order1")


def _uniform(V=100):
    return FunctionTarget(lambda seq: [1.0 / V] * V, V)


def _copy_mixture(c=0.9):
    """x1 ~ (a, 1-a) with a = 0.6 after context [0] and 0.8 after [1]; x2 copies x1
    with probability c; x3 ~ (0.7, 0.3) whatever came before."""

    def fn(seq):
        a = 0.6 if seq[0] == 0 else 0.8
        k = len(seq) - 1  # tokens after the one-token context
        if k == 0:
            return [a, 1 - a]
        if k == 1:
            return [c, 1 - c] if seq[1] == 0 else [1 - c, c]
        return [0.7, 0.3]

    return FunctionTarget(fn, 2)


def _mixture_truth(c=0.9):
    """Analytic floors of ``_copy_mixture`` averaged over a = 0.6, 0.8 (module docstring of floor.py):
    slot 2's marginal is m0 = a c + (1-a)(1-c); order 1 sees x1, so slot 2 costs only 1 - c; the best
    sampled q at slot 2 is (c, 1-c) (not the marginal): TV floor (1-a)(2c-1)."""
    out = {k: [0.0, 0.0, 0.0] for k in ("order0", "order1", "order_all", "tv_order0", "tv_order1")}
    for a in (0.6, 0.8):
        m0 = a * c + (1 - a) * (1 - c)
        for key, vals in (("order0", [1 - a, 1 - max(m0, 1 - m0), 0.3]), ("order1", [1 - a, 1 - c, 0.3]),
                          ("order_all", [1 - a, 1 - c, 0.3]), ("tv_order0", [0.0, (1 - a) * (2 * c - 1), 0.0]),
                          ("tv_order1", [0.0, 0.0, 0.0])):
            for k in range(3):
                out[key][k] += vals[k] / 2
    return out


def test_uniform_target_floor_is_099_with_16_rollouts():
    # the count-based estimator gave 0.05 here for order 1: empirical maxima over 16 samples
    res = floors(_uniform(), [[1, 2], [3, 4], [5, 6]], slots=4, rollouts=16)
    for key in ("order0", "order1", "order_all", "order0_upper", "order1_upper"):
        assert res[key] == pytest.approx([0.99] * 4, abs=1e-9), key
    for key in ("tv_order0", "tv_order1", "tv_order0_upper", "tv_order1_upper"):
        assert res[key] == pytest.approx([0.0] * 4, abs=1e-9), key  # sampling from the uniform q is perfect
    assert res["exact"] == [1.0, 1.0, 0.0, 0.0]  # 100 prefixes enumerated at slot 2, then Monte Carlo


def test_deterministic_target_floor_is_zero():
    V = 50

    def fn(seq):
        p = [0.0] * V
        p[(7 * sum(seq) + 3 * len(seq)) % V] = 1.0
        return p

    res = floors(FunctionTarget(fn, V), [[1, 2, 3], [9]], slots=6, rollouts=8)
    for key in KEYS + ("order_all",):
        assert res[key] == pytest.approx([0.0] * 6, abs=1e-12), key
    assert res["exact"] == [1.0] * 6


def test_copy_mixture_exact_floors_match_the_analytic_values():
    truth = _mixture_truth()
    res = floors(_copy_mixture(), [[0], [1]], slots=3)
    assert res["exact"] == [1.0, 1.0, 1.0]
    for key, want in truth.items():
        assert res[key] == pytest.approx(want, abs=1e-12), key
        if key != "order_all":
            assert res[key + "_upper"] == pytest.approx(want, abs=1e-12), key
    assert truth["tv_order0"][1] == pytest.approx(0.24)
    # the marginal is not the best q: for a = 0.6 it loses 0.384 vs the optimum's 0.32
    P = torch.tensor([[0.9, 0.1], [0.1, 0.9]], dtype=torch.float64)
    w = torch.tensor([0.6, 0.4], dtype=torch.float64)
    val, q = best_q(P, w)
    assert 1 - val == pytest.approx(0.32) and q.tolist() == pytest.approx([0.9, 0.1])
    assert 1 - tv_value(P, w, w @ P) == pytest.approx(0.384)


def test_copy_mixture_monte_carlo_brackets_the_truth():
    truth = _mixture_truth()
    res = floors(_copy_mixture(), [[0], [1]], slots=3, rollouts=4000, max_prefixes=1, seed=3)
    assert res["exact"] == [1.0, 0.0, 0.0]
    for key in KEYS:
        assert res[key] == pytest.approx(truth[key], abs=0.02), key
        assert res[key + "_upper"] == pytest.approx(truth[key], abs=0.02), key
        # plug-in <= upper up to noise (biased low / biased high)
        assert all(lo <= hi + 0.01 for lo, hi in zip(res[key], res[key + "_upper"])), key
    assert res["order_all"] == pytest.approx(truth["order_all"], abs=0.02)


def test_measured_rejection_of_a_drafter_is_exact():
    one_hot = torch.tensor([1.0, 0.0], dtype=torch.float64)
    best = torch.tensor([0.9, 0.1], dtype=torch.float64)
    drafts = [[one_hot, one_hot, one_hot], [one_hot, best, one_hot]]
    res = floors(_copy_mixture(), [[0], [1]], slots=3, drafts=drafts)
    # one-token draft "0" at every slot: 1 - m_k(0)
    assert res["measured"] == pytest.approx([0.3, (0.42 + 0.26) / 2, 0.3], abs=1e-12)
    # sampled: q one-hot accepts P_0; q = (0.9, 0.1) at slot 2 of context [1] accepts 1 - (1-a)(2c-1)
    assert res["measured_tv"] == pytest.approx([0.3, (0.42 + 0.2 * 0.8) / 2, 0.3], abs=1e-12)
    assert res["gap_order0"] == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)
    assert res["gap_tv_order0"][0] == pytest.approx(0.3)


@pytest.mark.parametrize("seed", range(5))
def test_best_q_is_the_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.rand(4, 3, generator=g, dtype=torch.float64) ** 3
    P /= P.sum(-1, keepdim=True)
    w = torch.rand(4, generator=g, dtype=torch.float64)
    w /= w.sum()
    val, q = best_q(P, w)
    assert float(q.sum()) == pytest.approx(1.0) and val == pytest.approx(tv_value(P, w, q))
    grid = [i / 100 for i in range(101)]
    brute = max(tv_value(P, w, torch.tensor([a, b, 1 - a - b], dtype=torch.float64))
                for a, b in itertools.product(grid, grid) if a + b <= 1 + 1e-12)
    assert brute <= val + 1e-12 and val - brute < 0.01


def test_slot_floors_order1_groups_by_previous_token():
    P = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    w = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    f = slot_floors(P, w, [7, 8, 8], exact=True)
    assert f["order0"] == pytest.approx(0.5) and f["order_all"] == pytest.approx(0.25)
    assert f["order1"] == pytest.approx(1 - (0.25 + 0.5))  # y=7: token 0 (0.25); y=8: J = (0.25, 0.5)
    # y=8, weights (1/3, 2/3) within the group: q = (0.5, 0.5) accepts 1/3 * 0.5 + 2/3 * 1 = 5/6 of 0.75
    assert f["tv_order1"] == pytest.approx(1 - (0.25 + 0.75 * 5 / 6))


def test_engine_target_gives_the_exact_conditionals():
    from specmesh.verifier import EngineVerifier
    from tests.support import tiny_engine

    eng, _ = tiny_engine(n_slots=3, max_seq_len=64)
    ver = EngineVerifier(eng)
    ctx = [5, 17, 33, 2]
    t = EngineTarget(ver, temperature=1.0)
    prefixes = [(), (4,), (4, 9), (11, 3, 8), (4, 10)]
    got = t.next_probs(ctx, prefixes)
    for p, row in zip(prefixes, got):
        eng.reset(2)
        want = target_probs(eng.prefill(2, ctx + list(p)), 1.0)
        assert torch.allclose(row, want, atol=1e-5), p
    t.close()
    # a greedy target is deterministic: every floor is 0, enumerated exactly
    g = EngineTarget(ver, temperature=0.0)
    res = floors(g, [ctx, [1, 2, 3]], slots=4)
    g.close()
    assert res["exact"] == [1.0] * 4 and all(v == pytest.approx(0.0) for k in KEYS for v in res[k])
    # a top-2 target: slot 2's order-0 floor equals brute-force enumeration of its first token
    t2 = EngineTarget(ver, temperature=1.0, top_k=2)
    res = floors(t2, [ctx], slots=2)
    t2.close()
    eng.reset(2)
    p1 = target_probs(eng.prefill(2, ctx), 1.0, 2)
    m = torch.zeros_like(p1)
    for x in p1.nonzero().flatten().tolist():
        eng.reset(2)
        m += p1[x] * target_probs(eng.prefill(2, ctx + [x]), 1.0, 2)
    assert res["exact"] == [1.0, 1.0]
    assert res["order0"] == pytest.approx([1 - float(p1.max()), 1 - float(m.max())], abs=1e-5)


def test_monte_carlo_bias_directions_on_a_flat_marginal():
    """Slot 1 uniform over 20 tokens, slot 2 copies it: the true order-0 floor at slot 2 is 0.95
    (one-token and TV alike). 16 sampled prefixes per context: the plug-in maximum over a noisy
    marginal is optimistic (biased low), the cross-fitted drafter's rejection is not (biased high,
    here unbiased since every choice is equally good)."""
    V = 20

    def fn(seq):
        p = [0.0] * V
        if len(seq) == 1:
            return [1.0 / V] * V
        p[seq[1]] = 1.0
        return p

    res = floors(FunctionTarget(fn, V), [[i] for i in range(120)], slots=2, rollouts=16, max_prefixes=4, seed=1)
    assert res["exact"] == [1.0, 0.0]
    for key in ("order0", "tv_order0"):
        assert res[key][1] < 0.95 - 0.05, key  # optimistic
        assert res[key + "_upper"][1] == pytest.approx(0.95, abs=0.015), key
    assert res["order_all"][1] == pytest.approx(0.0)  # seeing slot 1, slot 2 is certain
    assert res["order1"][1] == pytest.approx(0.0) and res["tv_order1"][1] == pytest.approx(0.0)


@pytest.mark.slow
def test_floor_cli_on_the_real_target(tmp_path, capsys):
    """``specmesh floor`` end to end: the real SmolLM2 target, the bundled block drafter, one held-out
    context; prints the table and writes the PNG and the JSON."""
    import argparse
    import json
    from pathlib import Path

    from specmesh.cli import blockdraft as cli
    from specmesh.runtime import block_drafter_path
    from specmesh.models.loading import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m-instruct", quiet=True))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    rec = {"id": "t0", "kind": "chat", "split": "heldout", "prompt_ids": list(prompt),
           "response_ids": tok.encode("The sea is wide and blue, it sings to me and you.")}
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-0000.jsonl").write_text(json.dumps(rec) + "\n")
    ckpt = block_drafter_path("smollm2-135m-instruct")
    ap = argparse.ArgumentParser()
    cli.register(ap.add_subparsers())
    out = tmp_path / "floor.png"
    argv = ["floor", "--data", str(data), "--contexts", "1", "--rollouts", "8", "--slots", "3", "--out", str(out)]
    args = ap.parse_args(argv + (["--drafter", str(ckpt)] if ckpt else []))
    assert cli.floor_main(args) == 0
    printed = capsys.readouterr().out
    assert "order0" in printed and "TV order0" in printed
    assert out.read_bytes()[:4] == b"\x89PNG"
    res = json.loads(Path(out).with_suffix(".json").read_text())
    assert len(res["order0"]) == 3 and res["exact"][0] == 1.0 and res["tv_order0"][0] == pytest.approx(0.0, abs=1e-9)
    assert all(0 <= res[k][i] <= 1 for k in ("order0", "order1", "tv_order0", "tv_order1") for i in range(3))
    assert all(a <= b + 1e-12 for a, b in zip(res["tv_order0"], res["order0"]))  # TV floor <= one-token floor
    if ckpt:
        # on the same prefixes the plug-in floor maximises over every drafter, so no drafter measures below it
        assert len(res["measured"]) == 3
        assert all(m >= f - 1e-9 for m, f in zip(res["measured"], res["order0"]))
        assert all(m >= f - 1e-9 for m, f in zip(res["measured_tv"], res["tv_order0"]))
