"""The mask-gated adapter (specmesh.uno): the gate leaves normal rows bitwise alone,
the engine's mask rows compute what the training forward computes, training lowers
the loss, and the uno self drafters keep greedy output identical to plain decoding."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support import tiny_engine
from specmesh.uno.adapter import GatedAdapter, new_adapter
from specmesh.uno.trainer import FrozenTarget, Sequence_, evaluate, make_batch, soft_ce, step_logits, train

M = 3


def _random_adapter(cfg, seed=0, scale=0.3):
    ad = new_adapter(cfg, rank=4, readout=16, block=M, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for d in ad.B:
        for p in d:
            d[p] = torch.randn(d[p].shape, generator=g) * scale
    ad.mask = torch.randn(ad.mask.shape, generator=g)
    ad.r2 = torch.randn(ad.r2.shape, generator=g) * 0.1
    return ad


def _fused_tree(n_drafts, m):
    """pending + a chain of n drafts + a block of m masks after every node."""
    toks = [5] + [7 + i for i in range(n_drafts)]
    par = list(range(-1, n_drafts))
    blocks = []
    for e in range(n_drafts + 1):
        p, blk = e, []
        for _ in range(m):
            toks.append(-1)
            par.append(p)
            p = len(toks) - 1
            blk.append(p)
        blocks.append(blk)
    return toks, par, blocks


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_gate_leaves_normal_rows_bitwise(dtype):
    eng, model = tiny_engine(dtype, n_slots=2, max_seq_len=128)
    cfg = model.config.to_dict()
    prompt = [3, 9, 11, 20, 4, 8]
    toks, par, blocks = _fused_tree(3, M)
    normal = list(range(4))
    outs = []
    for seed in (0, 1):
        eng.attach_adapter(_random_adapter(cfg, seed))
        t = [eng.mask_id if x < 0 else x for x in toks]
        eng.reset(0)
        eng.prefill(0, prompt)
        o = eng.score(0, t, par, hidden_layers=[eng.n_layers - 1])
        outs.append(o)
    # the verification rows do not see the adapter: bitwise the same under two adapters
    assert torch.equal(outs[0].logits[normal], outs[1].logits[normal])
    h0, h1 = outs[0].hidden[eng.n_layers - 1], outs[1].hidden[eng.n_layers - 1]
    assert torch.equal(h0[normal], h1[normal])
    assert not torch.allclose(h0[blocks[0]], h1[blocks[0]])  # the mask rows do
    if eng.batch_invariant:  # and equal a forward with no mask rows at all
        eng.attach_adapter(None)
        eng.reset(0)
        eng.prefill(0, prompt)
        plain = eng.score(0, toks[:4], par[:4])
        assert torch.equal(plain.logits, outs[0].logits[normal])


def test_mask_tokens_need_an_adapter():
    from specmesh.types import InvalidArgument

    eng, _ = tiny_engine("fp32", n_slots=1)
    eng.prefill(0, [1, 2, 3])
    with pytest.raises(InvalidArgument):
        eng.score(0, [eng.mask_id], [-1])
    with pytest.raises(InvalidArgument):
        eng.score(0, [4], [-1], gated=[0])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_mask_rows_equal_training_forward(dtype):
    """The rows the verifier serves are the rows the adapter was trained on: a block of M
    masks after anchor p, through the engine (KV cache, tree mask, gate) and through
    ``FrozenTarget.masks`` (cached context K/V, block-causal mask), agree."""
    eng, model = tiny_engine(dtype, n_slots=1, max_seq_len=128)
    cfg = model.config.to_dict()
    ad = _random_adapter(cfg, 3, scale=0.2)
    seq = [3, 9, 11, 20, 4, 8, 30, 31, 2, 17, 50, 60]
    p = 7  # anchor: the last known token
    eng.attach_adapter(ad)
    eng.prefill(0, seq[:p])
    out = eng.score(0, [seq[p]] + [eng.mask_id] * M, list(range(-1, M)), hidden_layers=[eng.n_layers - 1])
    h_eng = out.hidden[eng.n_layers - 1][1:]
    tgt = FrozenTarget(cfg, model.state_dict())
    ad32 = GatedAdapter(ad.cfg, {k: v.float() for k, v in ad.state_dict().items()})
    kv, _ = tgt.context(torch.tensor([seq]))
    h_tr = tgt.masks(ad32, kv, torch.tensor([[p]]), M)[0, 0]
    if dtype == "fp32":
        assert torch.allclose(h_eng, h_tr, atol=1e-4, rtol=1e-4), (h_eng - h_tr).abs().max()
    else:  # bf16 matmuls against the fp32 training forward: rounding only
        rel = float((h_eng.float() - h_tr).norm() / h_tr.norm())
        assert rel < 0.03, rel
    # the diffusion form: gated rows holding real tokens after a mask
    toks = [seq[p], eng.mask_id, seq[p + 2], eng.mask_id]
    out = eng.score(0, toks, list(range(-1, M)), gated=[1, 2, 3], hidden_layers=[eng.n_layers - 1])
    inp = torch.tensor([[[-1, seq[p + 2], -1]]])
    h_tr = tgt.masks(ad32, kv, torch.tensor([[p]]), M, inp)[0, 0]
    h_eng = out.hidden[eng.n_layers - 1][1:]
    rel = float((h_eng.float() - h_tr).norm() / h_tr.norm())
    assert rel < (1e-5 if dtype == "fp32" else 0.03), rel
    # and without the adapter the training forward's context pass is the target's
    logits_ctx = tgt.logits(tgt.context(torch.tensor([seq[:p + 1]]))[1][0, -1])
    ref = model(torch.tensor([seq[:p + 1]])).logits[0, -1]
    assert torch.allclose(logits_ctx, ref, atol=1e-4)


def test_training_lowers_the_loss_and_raises_accuracy():
    eng, model = tiny_engine("fp32")
    cfg = model.config.to_dict()
    rng = random.Random(0)
    # the tiny target's own greedy continuations as data
    seqs = []
    for k in range(12):
        prompt = [rng.randrange(96) for _ in range(5)]
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False).tolist()[0]
        seqs.append(Sequence_(ids, 5))
    tgt = FrozenTarget(cfg, model.state_dict())
    ad = new_adapter(cfg, rank=8, readout=32, block=M, embed=tgt.embed)
    before = evaluate(tgt, ad, seqs, M, anchors_per_seq=8)
    b0 = make_batch(seqs[:4], 8, M, random.Random(5))
    def kl():  # soft cross-entropy minus the target's own entropy
        with torch.no_grad():
            lg, t, p = step_logits(tgt, ad, b0, M)
            ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
            return float(soft_ce(lg, p, t, gamma=1e9) - ent[t != -100].mean())

    k0 = kl()
    train(tgt, ad, seqs, steps=60, M=M, seqs_per_step=4, anchors_per_seq=8, lr=3e-3, quiet=True)
    k1 = kl()
    after = evaluate(tgt, ad, seqs, M, anchors_per_seq=8)
    print(k0, k1, before["tau_measured"], after["tau_measured"])
    assert k1 < k0 * 0.7, (k0, k1)
    assert after["tau_measured"] > before["tau_measured"], (before, after)


def test_adapter_round_trip(tmp_path):
    _, model = tiny_engine("fp32")
    ad = _random_adapter(model.config.to_dict(), 2)
    ad.save(tmp_path)
    back = GatedAdapter.load(tmp_path)
    for k, v in ad.state_dict().items():
        w = back.state_dict()[k]
        tol = 1e-2 if v.dim() == 2 else 0  # matrices are stored in bf16
        assert torch.allclose(v.float(), w.float(), atol=tol * v.abs().max().item() + 1e-8), k


# ---------------------------------------------------------------- the uno self drafters through the loop

@pytest.fixture(scope="module")
def tiny_uno():
    """The tiny target, its own greedy continuations, and an adapter trained on them."""
    from tests.support import train_tiny_uno

    _, model = tiny_engine("fp32")
    rng = random.Random(1)
    records, prompts = [], []
    for _ in range(16):
        prompt = [rng.randrange(96) for _ in range(6)]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False).tolist()[0][6:]
        records.append({"prompt_ids": prompt, "response_ids": out})
        prompts.append(prompt)
    ad = train_tiny_uno(model.config.to_dict(), model.state_dict(), records, block=M, steps=80)
    return model, ad, prompts


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["uno", "uno_tree", "uno_separate"])
def test_uno_greedy_output_equals_plain_decoding(tiny_uno, dtype, name):
    from specmesh.loop import generate_tokens
    from specmesh.uno.serve import UnoDrafter
    from specmesh.verifier import EngineVerifier

    model, ad, prompts = tiny_uno
    eng, _ = tiny_engine(dtype, n_slots=2, max_seq_len=128)
    ver = EngineVerifier(eng)
    d = UnoDrafter(ver, ad, tree=name == "uno_tree", layout="separate" if name == "uno_separate" else "fused")
    ver.self_drafters[name] = d
    drafted = accepted = 0
    for prompt in prompts[:6]:
        plain, _ = generate_tokens(None, ver, prompt, max_new_tokens=24)
        out, st = generate_tokens(None, ver, prompt, max_new_tokens=24, self_draft=name, budget=4)
        assert out == plain, (name, dtype, prompt)
        drafted += st.drafted_tokens
        accepted += st.accepted_tokens
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    if d.fused:  # the next round's draft came out of the previous round's forward
        assert d.rounds["kept"] > 0 and d.rounds["drafted"] > 0, d.rounds


def test_diffusion_form_batches():
    seq = Sequence_(list(range(10, 40)), 5)
    b = make_batch([seq] * 2, 6, 4, random.Random(0), diffusion=1.0)
    assert b.diffusion is not None and bool(b.diffusion.all())
    for s in range(2):
        for a in range(6):
            p = int(b.anchors[s, a])
            assert b.inputs[s, a, 0] == -1  # the first row is always a mask
            for i in range(4):
                if i + 1 < 4 and b.inputs[s, a, i + 1] >= 0:  # the next token is known: not scored
                    assert b.tgt[s, a, i] == -100
                    assert b.inputs[s, a, i + 1] == seq.ids[p + 2 + i]
                elif p + 2 + i < len(seq.ids):
                    assert b.tgt[s, a, i] == seq.ids[p + 2 + i]


# ---------------------------------------------------------------- the diffusion mode

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("speculate,width", [("self", 1), ("draft", 1), ("both", 1), ("self", 3), ("both", 2),
                                             ("tree", 1)])
def test_trajectory_speculation_equals_plain_unmasking(tiny_uno, dtype, speculate, width):
    """Speculating over the unmasking trajectory returns exactly what plain unmasking
    returns, in fewer forwards (one guessed branch, or the runners-up too)."""
    from specmesh.uno.diffusion import Unmasking

    model, ad, prompts = tiny_uno
    eng, _ = tiny_engine(dtype, n_slots=1, max_seq_len=256)
    eng.attach_adapter(ad)
    dec = Unmasking(eng, block=M + 1, per_step=1)

    def ar_draft(tokens, n):  # the target's own greedy continuation (no adapter): an AR drafter
        return model.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False).tolist()[0][len(tokens):]

    plain_f = spec_f = ahead = 0
    for prompt in prompts[:4]:
        plain, ps = dec.generate(prompt, 16)
        spec, ss = dec.generate(prompt, 16, speculate=speculate, depth=3, drafter=ar_draft, width=width)
        assert spec == plain, (speculate, dtype, prompt)
        assert ps.forwards <= ps.steps and ss.steps == ps.steps and ps.lookahead_blocks == 0
        plain_f += ps.forwards
        spec_f += ss.forwards
        ahead += ss.lookahead_blocks
    assert spec_f < plain_f, (spec_f, plain_f)
    if speculate == "tree":  # a verified complete guess ran the next block's first forward (and it held)
        assert ahead > 0


def test_tree_guesser_never_guesses_against_exact_predictions(tiny_uno):
    """Left of every fill since the exact outputs, predictions are exact (block-causal
    attention): the tree guesses only the most confident such offset, with its argmax;
    right of them it tries each offset's top tokens."""
    from specmesh.uno.diffusion import Unmasking

    _, ad, _ = tiny_uno
    eng, _ = tiny_engine("fp32", n_slots=1)
    eng.attach_adapter(ad)
    dec = Unmasking(eng, block=6, per_step=1) if ad.cfg.block >= 5 else Unmasking(eng, block=M + 1, per_step=1)
    B = dec.B
    g = torch.Generator().manual_seed(0)
    probs = {o: torch.softmax(3 * torch.randn(eng.vocab_size, generator=g), -1) for o in range(B)}
    o0 = B - 2  # the step just taken; offsets < o0 keep their exact predictions
    fills = [None] * B
    fills[o0] = int(probs[o0].argmax())
    conf = {o: float(probs[o].max()) for o in range(B) if o != o0}
    best_left = min((o for o in conf if o < o0), key=lambda o: (-conf[o], o))
    branches = dec._tree(probs, fills, ((o0, fills[o0]),), depth=B, budget=64)
    firsts = set()
    for br in branches:
        assert len(br) <= B - 1
        (o, t), = [(o, t) for o, t in enumerate(br[0]) if fills[o] is None and t is not None]
        firsts.add((o, t))
    left = {(o, t) for o, t in firsts if o < o0}
    assert left == {(best_left, int(probs[best_left].argmax()))}
    right = {(o, t) for o, t in firsts if o > o0}
    assert right == {(B - 1, t) for t in torch.topk(probs[B - 1], len(dec.prior.token_rank)).indices.tolist()}


def test_tree_prior_fit_counts_the_rules_choices():
    from specmesh.uno.diffusion import TreePrior

    def p(*tops):  # offset -> distribution with the given (token, prob) leaders
        out = {}
        for o, lead in tops:
            v = torch.full((10,), 0.01)
            for t, a in lead:
                v[t] = a
            out[o] = v / v.sum()
        return out

    # block of 3: step 1 fills offset 1 (most confident), then the rule takes offset 2 with its
    # stale runner-up token 4, then offset 0 (exact, alone)
    s0 = p((0, [(1, 0.3)]), (1, [(2, 0.9)]), (2, [(3, 0.5), (4, 0.2)]))
    s1 = p((0, [(1, 0.3)]), (2, [(4, 0.6)]))
    s2 = p((0, [(1, 0.3)]))
    trace = [[(s0, ((1, 2),)), (s1, ((2, 4),)), (s2, ((0, 1),))]]
    pr = TreePrior.fit(trace, tokens=3)
    # offset 2 beat exact offset 0 once (confidences 0.77 vs 0.64: the close bin): (0 + 1) / (1 + 2)
    assert pr.exact == (pytest.approx(1 / 3), pytest.approx(1 / 2))
    assert pr.offset_rank == (1.0,)  # one competing offset right of the fill, rank 0 (+1 smoothing)
    # the runner-up token (+1 smoothing each, and +1 for a token beyond the candidates)
    assert pr.token_rank == (pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.2))
    assert pr.offset(3) < pr.offset(2) < pr.offset(0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_wide_guess_trees_are_cut_to_the_slots_room(tiny_uno, dtype):
    """A guess tree wider than the slot's room is cut to fit, so speculation generates
    as far as plain unmasking does (it used to stop where the widest tree would not fit)."""
    from specmesh.uno.diffusion import Unmasking

    _, ad, prompts = tiny_uno
    eng, _ = tiny_engine(dtype, n_slots=1, max_seq_len=64)
    eng.attach_adapter(ad)
    dec = Unmasking(eng, block=M + 1, per_step=1)
    for prompt in prompts[:3]:
        plain, _ = dec.generate(prompt, 40)
        spec, st = dec.generate(prompt, 40, speculate="tree", budget=64)
        assert spec == plain and len(plain) >= 40 - M, (len(spec), len(plain))
        assert st.rows / st.forwards < 64 * M


def test_device_check_diffusion_phase_reports_each_decoder(tiny_uno, monkeypatch):
    """The device check's diffusion phase: plain unmasking and the guess tree per block it
    can run (blocks beyond the adapter's mask slots skipped), forwards, reduction, identity."""
    from types import SimpleNamespace

    from specmesh.cli.bench import device_check

    _, ad, prompts = tiny_uno
    eng, _ = tiny_engine("bf16", n_slots=1, max_seq_len=256)
    eng.attach_adapter(ad)
    monkeypatch.setattr(device_check, "DIFFUSION_CONFIGS", ((M + 1, 16), (M + 3, 16)))
    rt = SimpleNamespace(engine=eng, stop_ids=[])
    rows = device_check.diffusion_phase(rt, {"w": [("a", prompts[0]), ("b", prompts[1])]}, 12, float("inf"),
                                        lambda *a: None)
    assert [(r["decoder"], r["block"]) for r in rows] == [("plain unmasking", M + 1), ("guess tree (16 states)", M + 1)]
    plain, tree = rows
    assert plain["forward_reduction"] == 1.0 and tree["forward_reduction"] > 1.0
    assert tree["identical"] == tree["prompts"] == 2 and tree["rows_per_forward"] > plain["rows_per_forward"]
    assert "guess tree (16 states)" in device_check.render(
        {"env": {"device": "cpu", "torch": "t", "cuda_build": None, "python": "3"}, "wall_s": 0,
         "max_new_tokens": 12, "diffusion": rows})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_draft_and_refine_returns_greedy_decoding(tiny_uno, dtype):
    from specmesh.loop import generate_tokens
    from specmesh.uno.diffusion import Unmasking
    from specmesh.verifier import EngineVerifier

    model, ad, prompts = tiny_uno
    eng, _ = tiny_engine(dtype, n_slots=2, max_seq_len=256)
    eng.attach_adapter(ad)
    dec = Unmasking(eng, block=M + 1, slot=1)
    ver = EngineVerifier(eng)
    fwd = toks = 0
    for prompt in prompts[:4]:
        plain, _ = generate_tokens(None, ver, prompt, max_new_tokens=20)
        out, st = dec.refine(prompt, 20)
        assert out == plain, (dtype, prompt)
        fwd, toks = fwd + st.forwards, toks + len(out)
    assert fwd < toks, (fwd, toks)  # more than one token per target forward


def test_truncated_adapter_keeps_the_products():
    _, model = tiny_engine("fp32")
    ad = _random_adapter(model.config.to_dict(), 4)
    for d in ad.A:  # products of rank 2 at most: truncating to 2 keeps them exactly
        for p in d:
            d[p][:, 2:] = 0
    low = ad.truncated(2)
    assert low.cfg.rank == 2 and ad.truncated(8) is ad
    x = torch.randn(5, ad.cfg.dims["qkv"][0])
    torch.testing.assert_close(low.delta(1, "qkv", x), ad.delta(1, "qkv", x), atol=1e-4, rtol=1e-4)
    assert torch.equal(low.mask, ad.mask)


def test_mask_blocks_shallowest_first_and_capped(tiny_uno):
    from specmesh.types import TokenTree
    from specmesh.uno.serve import UnoDrafter
    from specmesh.verifier import EngineVerifier

    _, ad, _ = tiny_uno
    eng, _ = tiny_engine("fp32", n_slots=1)
    d = UnoDrafter(EngineVerifier(eng), ad)
    tree = TokenTree([5, 6, 7, 8], [-1, 0, -1, 1])  # depths 0, 1, 0, 2
    assert d.mask_blocks(tree, 100) == [-1, 0, 2, 1, 3]
    d.max_blocks = 2
    assert d.mask_blocks(tree, 100) == [-1, 0]
    assert d.mask_blocks(tree, 4 + M) == [-1]  # what fits
