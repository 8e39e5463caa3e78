"""Block drafter: masks (a block never sees later blocks or future context), the
truncated head, losses vs hand-computed values, the floor estimator on a
synthetic target with a known floor, best-first trees, serving identity."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specmesh.blockdraft import losses as L
from specmesh.blockdraft.floor import FunctionTarget, floors
from specmesh.blockdraft.model import BlockDrafter, BlockDrafterConfig, expected_tau
from specmesh.blockdraft.serve import BlockSelfDrafter
from specmesh.blockdraft.train import Example, evaluate, expand_block, new_model, train
from specmesh.blockdraft.tree import Calibration, best_first_tree
from specmesh.loop import generate_tokens
from specmesh.types import SamplingParams
from specmesh.verifier import EngineVerifier
from tests.support import tiny_engine


def _drafter(eng, model, block=4, keep=None, seed=0, fuse_last=False, fuse_norm=False):
    torch.manual_seed(seed)
    cfg = BlockDrafterConfig(block=block, n_layers=1, hidden=64, n_heads=4, ffn=96, feature_layers=[0, 2],
                             context_window=32, vocab_size=96, n_keep=len(keep) if keep is not None else 96,
                             fuse_last=fuse_last, fuse_norm=fuse_norm)
    keep = torch.arange(96) if keep is None else keep
    return new_model(cfg, model.state_dict(), keep)


def test_block_mask_layout():
    m = BlockDrafter.block_mask([3, 5], 2, n_ctx=6, ctx_start=0, window=None)
    assert m.shape == (4, 10)
    assert m[0, :6].tolist() == [True, True, True, False, False, False]
    assert m[2, :6].tolist() == [True] * 5 + [False]
    assert m[0, 6:].tolist() == [True, True, False, False] and m[3, 6:].tolist() == [False, False, True, True]
    w = BlockDrafter.block_mask([5], 2, n_ctx=6, ctx_start=0, window=2)
    assert w[0, :6].tolist() == [False, False, False, True, True, False]


@pytest.mark.parametrize("fuse_last,fuse_norm", [(False, False), (True, False), (True, True)])
def test_block_sees_no_future_and_no_other_block(fuse_last, fuse_norm):
    eng, model = tiny_engine()
    d = _drafter(eng, model, fuse_last=fuse_last, fuse_norm=fuse_norm).eval()
    feats = torch.randn(10, 128)
    anchors = [4, 7]
    mask = BlockDrafter.block_mask(anchors, 4, 10)
    base = d(torch.tensor([11, 12]), feats, mask)
    f2 = feats.clone()
    f2[4:] += 5.0  # context at/after the first anchor
    out = d(torch.tensor([11, 12]), f2, mask)
    torch.testing.assert_close(out[0], base[0])  # block 0 unchanged
    assert not torch.allclose(out[1], base[1])  # block 1 sees positions 4..6
    out = d(torch.tensor([11, 40]), feats, mask)  # change block 1's anchor token
    torch.testing.assert_close(out[0], base[0])
    assert out.shape == (2, 3, 96)


def test_truncated_head_maps_ids():
    eng, model = tiny_engine()
    keep = torch.tensor([3, 10, 50, 95])
    d = _drafter(eng, model, keep=keep).eval()
    assert d.vocab_to_keep[50] == 2 and d.vocab_to_keep[4] == -1
    full = model.state_dict()["lm_head.weight"] if "lm_head.weight" in model.state_dict() else \
        model.state_dict()["model.embed_tokens.weight"]
    torch.testing.assert_close(d.head, full[keep].float())


def test_losses_hand_computed():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])  # A=1, K=3, N=2
    tgt = torch.tensor([[0, 0, 0]])
    ce = [math.log(1 + math.exp(-2)), math.log(1 + math.exp(1)), math.log(1 + math.exp(-1))]
    w = [1, math.exp(-1 / 2), math.exp(-2 / 2)]
    exp = sum(c * x for c, x in zip(ce, w)) / sum(w)
    assert abs(float(L.position_weighted_ce(logits, tgt, gamma=2.0)) - exp) < 1e-5
    assert abs(float(L.plain_ce(logits, tgt)) - sum(ce) / 3) < 1e-5
    # slot 1 is the first predicted failure (argmax 1 != 0): AUF keeps slots 0 and 1
    assert abs(float(L.auf_ce(logits, tgt)) - (ce[0] + ce[1]) / 2) < 1e-5
    p = [math.exp(-c) for c in ce]
    reach = [1, p[0], p[0] * p[1]]
    exp = sum(c * r for c, r in zip(ce, reach)) / sum(reach)
    assert abs(float(L.dpace_ce(logits, tgt)) - exp) < 1e-5
    fw = [(1 - p[0]) ** 2, (1 - p[1]) ** 2 * 2, (1 - p[2]) ** 2]
    exp = sum(c * x for c, x in zip(ce, fw)) / sum(fw)
    assert abs(float(L.first_error_focal(logits, tgt)) - exp) < 1e-5
    ign = torch.tensor([[0, L.IGNORE, L.IGNORE]])
    assert abs(float(L.position_weighted_ce(logits, ign)) - ce[0]) < 1e-5
    # chain: -(q1 + q1 q2 + q1 q2 q3) / K; an ignored slot ends the chain
    assert abs(float(L.chain_loss(logits, tgt)) + (p[0] + p[0] * p[1] + p[0] * p[1] * p[2]) / 3) < 1e-5
    assert abs(float(L.chain_loss(logits, ign)) + p[0] / 3) < 1e-5
    assert abs(float(L.combined(logits, tgt, gamma=2.0)) - float(L.position_weighted_ce(logits, tgt, gamma=2.0))
               - float(L.first_error_focal(logits, tgt)) - float(L.chain_loss(logits, tgt))) < 1e-5
    assert L.loss_kwargs("combined", gamma=2.0) == {"gamma": 2.0} and L.loss_kwargs("chain", gamma=2.0) == {}


def test_chain_loss_gradient_reaches_every_slot_and_raises_expected_length():
    """Unlike D-PACE's detached weights, the chain surrogate's gradient moves every
    factor; a step along it raises the expected accepted length."""
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 5, requires_grad=True)
    tgt = torch.randint(0, 5, (4, 3))
    L.chain_loss(logits, tgt).backward()
    g = logits.grad
    assert all(float(g[:, k].abs().sum()) > 0 for k in range(3))
    with torch.no_grad():
        before = float(L.chain_loss(logits, tgt))
        after = float(L.chain_loss(logits - 1.0 * g, tgt))
    assert after < before


def test_floor_estimator_on_synthetic_target():
    # target: slot 1 ~ [0.6, 0.4]; slot 2 given slot 1: a deterministic copy; slot 3 independent [0.7, 0.3]
    # (exact conditionals, enumerated exactly: tests/unit/test_floor.py has the estimator's other cases)
    def fn(seq):
        k = len(seq) - 1
        return [0.6, 0.4] if k == 0 else ([1.0, 0.0] if seq[1] == 0 else [0.0, 1.0]) if k == 1 else [0.7, 0.3]

    zero = torch.tensor([1.0, 0.0], dtype=torch.float64)
    f = floors(FunctionTarget(fn, 2), [[0]] * 3, slots=3, drafts=[[zero] * 3] * 3)
    assert f["order0"] == pytest.approx([0.4, 0.4, 0.3], abs=1e-12)
    assert f["order1"] == pytest.approx([0.4, 0.0, 0.3], abs=1e-12)  # knowing slot 1 makes slot 2 certain
    # sampled drafts: slot 2 is one-hot on an unseen token, so no q beats q = (1, 0) (q = (0.6, 0.4) accepts 0.52)
    assert f["tv_order0"] == pytest.approx([0.0, 0.4, 0.0], abs=1e-12)
    assert f["measured"] == pytest.approx([0.4, 0.4, 0.3], abs=1e-12)


def test_best_first_tree():
    cands = [[(5, 0.9), (6, 0.05)], [(7, 0.6), (8, 0.3)], [(9, 0.6)]]
    t = best_first_tree(cands, 4, Calibration())
    t.validate(96)
    assert t.tokens[:3] == [5, 7, 9] and t.parents[:3] == [-1, 0, 1]
    assert len(t) == 4 and t.tokens[3] == 8 and t.parents[3] == 0
    cal = Calibration.fit([(0, 0.9, True)] * 10 + [(0, 0.9, False)] * 10, 1)
    assert 0.45 < cal(0, 0.9) < 0.6
    assert expected_tau([1.0, 0.5]) == 2.5


@pytest.mark.parametrize("tree,fuse_last", [(False, False), (True, False), (False, True)])
def test_self_strategy_with_block_drafter_is_lossless(tree, fuse_last):
    eng, model = tiny_engine(n_slots=3)
    ver = EngineVerifier(eng)
    ref, _ = generate_tokens(None, ver, [5, 9, 13, 2, 7], max_new_tokens=30)
    d = _drafter(eng, model, fuse_last=fuse_last)
    ver.self_drafters["block"] = BlockSelfDrafter(ver, d, tree=tree)
    out, st = generate_tokens(None, ver, [5, 9, 13, 2, 7], max_new_tokens=30, budget=4, self_draft="block")
    assert out == ref and st.drafted_tokens > 0
    s = SamplingParams(temperature=0.9, seed=3)
    a, _ = generate_tokens(None, ver, [5, 9, 13], sampling=s, max_new_tokens=12, budget=3, self_draft="block")
    assert len(a) == 12


def test_expand_block_keeps_the_weights_and_gives_the_new_slots_distinct_positions():
    """Extrapolated new slots differ from the last trained one (copies would make the block's
    layers give them the last slot's output), every other weight is carried over."""
    eng, model = tiny_engine(n_slots=1)
    d = _drafter(eng, model, block=4)
    with torch.no_grad():
        d.pos_emb.copy_(torch.randn_like(d.pos_emb))
    pos = d.pos_emb.detach()
    big = expand_block(d, 7, model.state_dict())
    new = big.pos_emb.detach()
    assert torch.equal(new[:4], pos)
    for j in range(1, 4):
        assert torch.allclose(new[3 + j], pos[3] + j * (pos[3] - pos[2]))
    assert len({tuple(r.tolist()) for r in new}) == 7
    old, grown = d.state_dict(), big.state_dict()
    assert all(torch.equal(old[k], grown[k]) for k in old if k != "pos_emb")
    copied = expand_block(d, 6, model.state_dict(), init="copy").pos_emb.detach()
    assert torch.equal(copied[4], pos[3]) and torch.equal(copied[5], pos[3])
    x, ctx = torch.tensor([11]), torch.randn(4, 128)
    out = expand_block(d, 6, model.state_dict(), init="copy")(x, ctx, BlockDrafter.block_mask([4], 6, 4))
    assert torch.allclose(out[0, 3], out[0, 4], atol=1e-5)  # the copied slots' outputs are the last slot's
    with pytest.raises(ValueError, match="init must be"):
        expand_block(d, 6, model.state_dict(), init="zeros")


@pytest.mark.parametrize("fuse_last,amp", [(False, False), (True, True)])
def test_training_learns_a_copy_task_and_expands(fuse_last, amp):
    eng, model = tiny_engine(n_slots=1)
    torch.manual_seed(0)
    seqs = []
    for i in range(12):
        pat = [random.Random(i).randrange(10, 90) for _ in range(5)]
        toks = pat * 6
        seqs.append(Example(torch.tensor(toks), 5, torch.randn(len(toks), 128).to(torch.bfloat16)))
    d = _drafter(eng, model, block=3, fuse_last=fuse_last)
    before = evaluate(d, seqs)["tau_measured"]
    curve = train(d, seqs, steps=60, loss="ce", lr=3e-3, batch=4, anchors_per_seq=8, quiet=True, amp=amp)
    after = evaluate(d, seqs)
    assert curve[-1] < curve[0] and after["tau_measured"] > before
    big = expand_block(d, 5, model.state_dict())
    assert big.cfg.block == 5 and big(torch.tensor([11]), torch.randn(4, 128),
                                      BlockDrafter.block_mask([4], 5, 4)).shape == (1, 4, 96)
    # DBloom: the new slots (2, 3) phased in and emphasised; their loss falls
    from specmesh.blockdraft.losses import plain_ce
    from specmesh.blockdraft.train import block_batch

    def new_ce(m):
        with torch.no_grad():
            lg, tg = block_batch(m, seqs[0], [5, 9, 13])
            return float(plain_ce(lg[:, 2:], tg[:, 2:]))

    before_new = new_ce(big)
    train(big, seqs, steps=40, loss="ce", lr=3e-3, batch=4, anchors_per_seq=8, quiet=True, amp=amp,
          curriculum_from=2, emphasis=2.0)
    assert new_ce(big) < before_new


def test_training_features_are_cached_next_to_the_data(tmp_path):
    import argparse
    import json

    from specmesh.cli.blockdraft import _examples

    eng, _ = tiny_engine(n_slots=1)
    recs = [{"id": f"p{i}", "kind": "chat", "split": "heldout" if i == 0 else "train",
             "prompt_ids": [1, 2, 3 + i], "response_ids": [10 + i, 11, 12, 13]} for i in range(4)]
    (tmp_path / "shard-0000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = argparse.Namespace(data=str(tmp_path), feature_dtype="fp32")
    calls = []

    def engine():
        calls.append(1)
        return eng

    _, tr, he = _examples(args, engine, [0, 2])
    assert calls and len(tr) == 3 and len(he) == 1 and tr[0].features.shape == (7, 128)
    calls.clear()

    def no_engine():
        raise AssertionError("features should come from the cache")

    _, tr2, he2 = _examples(args, no_engine, [0, 2])
    torch.testing.assert_close(tr2[0].features, tr[0].features)
    recs.append({"id": "p9", "kind": "chat", "split": "train", "prompt_ids": [4], "response_ids": [5, 6, 7]})
    (tmp_path / "shard-0001.jsonl").write_text(json.dumps(recs[-1]) + "\n")
    _, tr3, _ = _examples(args, engine, [0, 2])  # new shard: the stale cache is not used
    assert calls and len(tr3) == 4


@pytest.mark.slow
def test_train_drafter_cli_trains_expands_and_compares(tmp_path):
    """``specmesh train-drafter`` end to end on the real target with a few records:
    train and save (checkpoint, calibration, metrics, histogram), continue a
    saved checkpoint at a larger block (``--expand-block``), compare losses."""
    import json

    from specmesh.cli import main
    from specmesh.blockdraft.model import load_block_drafter
    from specmesh.models.loading import load_state_dict, resolve_model

    rng = random.Random(0)
    recs = [{"id": f"r{i}", "kind": "chat", "split": "heldout" if i < 2 else "train",
             "prompt_ids": [rng.randrange(100, 5000) for _ in range(6)],
             "response_ids": [rng.randrange(100, 5000) for _ in range(6)] * 3} for i in range(8)]
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-0000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    common = ["--data", str(data), "--steps", "3", "--batch", "2", "--anchors", "2", "--n-keep", "512",
              "--feature-dtype", "fp32", "--no-amp"]
    out = tmp_path / "ckpt"
    assert main(["train-drafter", "--out", str(out), "--block", "3"] + common) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 3 and (out / "calibration.json").exists() and (out / "accept_hist.png").exists()
    big = tmp_path / "big"
    assert main(["train-drafter", "--out", str(big), "--init", str(out), "--expand-block", "5"] + common) == 0
    tsd = load_state_dict(resolve_model("smollm2-135m-instruct"))
    assert load_block_drafter(big, tsd).cfg.block == 5
    cmp = tmp_path / "cmp"
    assert main(["train-drafter", "--out", str(cmp), "--block", "3", "--compare-losses", "ce,combined"] + common) == 0
    table = (cmp / "compare_losses.md").read_text()
    assert "| ce |" in table and "| combined |" in table
    # from a checkpoint: each loss continues it, and the checkpoint itself is the first row
    cont = tmp_path / "cont"
    assert main(["train-drafter", "--out", str(cont), "--init", str(out), "--compare-losses", "ce"] + common) == 0
    table = (cont / "compare_losses.md").read_text()
    assert f"from {out}" in table and "| (init, not trained) |" in table and "| ce |" in table
    rows = json.loads((cont / "compare_losses.json").read_text())
    assert set(rows) == {"(init, not trained)", "ce"}
