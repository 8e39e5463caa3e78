"""Divergence Decoding (``acceptance="divergence"``): a specialist drafts, the target
(the generalist) verifies, drafts are accepted up to the first position where
JSD(p_specialist, p_target) > tau, and there the target's token is emitted.

- JSD: in bits, symmetric, 0 on equal rows, 1 on disjoint ones, scipy's value.
- The rule's law on random full distributions: the accepted length is the first
  position whose JSD (computed independently, from both full distributions) exceeds
  tau; the emitted token is the target's argmax (greedy) or the inverse-CDF draw of
  p_target with that position's uniform (sampled); tau = 1 accepts every draft.
- Through the in-process loop with a tiny target and a perturbed copy as specialist:
  greedy tau = 0 is exact greedy decoding token for token; larger tau accepts more and
  every round obeys the law (re-checked from the two engines' logits); sampled
  tau = 0 is seed-for-seed the exact rule's plain decoding.
- Validation: bad thresholds name ``jsd_threshold``; a verifier without a specialist,
  or a draft tree not drafted by the specialist, is INVALID_ARGUMENT saying so; the
  specialist re-syncs after losing a session.
- ``merge_lora`` is peft's ``merge_and_unload``.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.spatial.distance import jensenshannon

from specmesh import acceptance as A
from specmesh.drafters.specialist import SpecialistDrafter
from specmesh.engine import LlamaEngine
from specmesh.loop import generate_tokens
from specmesh.types import InvalidArgument, SamplingParams, SelfDraft, SessionLost, TokenTree, VerifyRequest
from specmesh.verifier import EngineVerifier
from tests.support import tiny_divergence_verifier, tiny_layerskip_verifier, tiny_specialist_weights, tiny_weights

V = 7


def _jsd_scipy(p, q) -> float:
    return float(jensenshannon(p.double().numpy(), q.double().numpy(), base=2)) ** 2


# ---------------------------------------------------------------- JSD


def test_jsd_bits_properties_and_scipy():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(50, V, generator=g) * 2, -1)
    js = A.jsd_bits(p, q)
    assert torch.allclose(js, A.jsd_bits(q, p))
    assert torch.allclose(js, torch.tensor([_jsd_scipy(a, b) for a, b in zip(p, q)], dtype=torch.float64),
                          atol=1e-9)
    assert float(A.jsd_bits(p, p).abs().max()) < 1e-12
    one = torch.zeros(2, V, dtype=torch.float64)
    one[0, 0] = one[1, 3] = 1.0
    assert float(A.jsd_bits(one[:1], one[1:])[0]) == pytest.approx(1.0)
    assert ((js >= 0) & (js <= 1)).all()


# ---------------------------------------------------------------- the rule's law


def _law(target_logits, spec_logits, tau):
    """The first position whose JSD of the two full softmax distributions exceeds tau
    (k when none), computed here with scipy."""
    k = spec_logits.shape[0]
    for i in range(k):
        if _jsd_scipy(torch.softmax(spec_logits[i].double(), -1), torch.softmax(target_logits[i].double(), -1)) > tau:
            return i
    return k


def test_acceptance_iff_jsd_within_threshold_greedy_and_sampled():
    g = torch.Generator().manual_seed(3)
    seen = set()
    for trial in range(400):
        k = int(torch.randint(0, 6, (1,), generator=g))
        target = torch.randn(k + 1, V, generator=g) * 2
        # the specialist: the target's rows plus noise of random size (close to far)
        spec = target[:k] + torch.randn(k, V, generator=g) * float(torch.rand(1, generator=g)) * 3
        draft = [int(torch.randint(0, V, (1,), generator=g)) for _ in range(k)]  # any tokens: the law ignores them
        tau = float(torch.rand(1, generator=g)) * 0.4
        n = _law(target, spec, tau)
        seen.add((n > 0, n < k))
        res = A.divergence_chain(target, spec, draft, tau)
        assert res.path == list(range(n)) and res.next_token == int(target[n].argmax())
        # sampled: same accepted length; the emitted token is p_target[n]'s inverse-CDF draw with u_sample[n]
        sp = SamplingParams(temperature=0.8, top_k=5, acceptance="divergence", jsd_threshold=tau, seed=trial)
        probs = A.target_probs(target, sp)
        _, us = A.uniforms(trial, 0, k)
        res = A.divergence_chain(target, spec, draft, tau, probs, us)
        assert res.path == list(range(n)) and res.next_token == A.sample(probs[n].double(), float(us[n]))
        # through the dispatcher (the verifier's entry point): the same decision
        tree = TokenTree.chain(draft)
        assert A.accept(target, tree, sp, trial, specialist=spec) == res
        assert A.accept(target, tree, SamplingParams(acceptance="divergence", jsd_threshold=tau), 0,
                        specialist=spec) == A.divergence_chain(target, spec, draft, tau)
        # tau = 1 (the JSD's maximum in bits) accepts every draft
        assert A.divergence_chain(target, spec, draft, 1.0).path == list(range(k))
    assert {(True, True), (False, True), (True, False)} <= seen  # partial, none and full acceptance all occurred


def test_threshold_zero_accepts_only_equal_distributions():
    g = torch.Generator().manual_seed(4)
    target = torch.randn(4, V, generator=g)
    same = target[:3].clone()
    assert A.divergence_chain(target, same, [1, 2, 3], 0.0).path == [0, 1, 2]
    other = same.clone()
    other[1, 0] += 1e-3
    assert A.divergence_chain(target, other, [1, 2, 3], 0.0).path == [0]


def test_rule_refuses_missing_rows_and_trees():
    lg = torch.randn(3, V)
    sp = SamplingParams(acceptance="divergence")
    assert A.accept(lg[:1], TokenTree(), sp, 0).path == []  # no draft: the target's token, no specialist needed
    with pytest.raises(ValueError):
        A.accept(lg, TokenTree.chain([1, 2]), sp, 0)
    with pytest.raises(ValueError):
        A.accept(lg, TokenTree([1, 2], [-1, -1]), sp, 0, specialist=lg[:2])
    with pytest.raises(ValueError):
        A.divergence_chain(lg, lg[:1], [1, 2], 0.3)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), True, "0.3"])
def test_bad_threshold_names_the_field(bad):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(acceptance="divergence", jsd_threshold=bad)
    assert e.value.field == "jsd_threshold"


def test_threshold_through_the_proto_names_the_field():
    from specmesh.wire.convert import sampling_from_proto, sampling_to_proto
    from specmesh.v1 import common_pb2

    sp = SamplingParams(temperature=0.5, acceptance="divergence", jsd_threshold=0.25)
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    assert sampling_from_proto(common_pb2.SamplingParams(acceptance="divergence")).jsd_threshold == 0.3
    with pytest.raises(InvalidArgument) as e:
        sampling_from_proto(common_pb2.SamplingParams(acceptance="divergence", jsd_threshold=2.0))
    assert e.value.field == "sampling.jsd_threshold"


def test_verifier_without_specialist_refuses_divergence():
    v = tiny_layerskip_verifier()
    with pytest.raises(InvalidArgument) as e:
        v.verify(VerifyRequest("s", 0, [1, 2, 3], sampling=SamplingParams(acceptance="divergence")))
    assert e.value.field == "sampling.acceptance" and "specialist" in e.value.message


def test_divergence_refuses_drafts_the_specialist_did_not_make():
    v = tiny_divergence_verifier()
    sp = SamplingParams(acceptance="divergence")
    v.verify(VerifyRequest("s", 0, [1, 2, 3], sampling=sp))  # prefill: no draft, fine
    with pytest.raises(InvalidArgument) as e:
        v.verify(VerifyRequest("s", 3, [5], tree=TokenTree.chain([6, 7]), sampling=sp))
    assert e.value.field == "sampling.acceptance" and "specialist" in e.value.message
    with pytest.raises(InvalidArgument):  # nor the layer-skip drafter's
        v.verify(VerifyRequest("s", 3, [5], sampling=sp, self_draft=SelfDraft("layerskip", 3)))
    res = v.verify(VerifyRequest("s", 3, [5], sampling=sp, self_draft=SelfDraft("specialist", 3)))
    assert res.drafted == 3


# ---------------------------------------------------------------- through the loop


PROMPT = [3, 17, 42, 5, 9, 11, 42, 5, 60, 2]


def _engines(noise):
    cfg, sd = tiny_weights()
    return (cfg, sd), tiny_specialist_weights(cfg, sd, noise=noise)


class _Recording(EngineVerifier):
    """Keeps every round's (target logits, specialist logits, tree, decision) to re-check the law."""

    def __init__(self, engine):
        super().__init__(engine)
        self.rounds = []

    def verify_batch(self, reqs, limits=None):
        out = super().verify_batch(reqs, limits)
        for r, res in zip(reqs, out):
            if r.self_draft is not None and not isinstance(res, BaseException) and res.drafted:
                spec = self.self_drafters["specialist"].draft_logits(r.session_id)
                self.rounds.append((r, spec.clone(), res))
        return out


def _verifier(noise, n_slots=4):
    (cfg, sd), (scfg, ssd) = _engines(noise)
    v = _Recording(LlamaEngine(cfg, sd, n_slots=n_slots, max_seq_len=256))
    v.self_drafters["specialist"] = SpecialistDrafter(lambda: LlamaEngine(scfg, ssd, n_slots=n_slots,
                                                                          max_seq_len=256), vocab_size=cfg["vocab_size"])
    return v, (cfg, sd)


def _plain(weights, sampling, n=40):
    v = EngineVerifier(LlamaEngine(*weights, n_slots=2, max_seq_len=256))
    return generate_tokens(None, v, PROMPT, sampling=sampling, max_new_tokens=n)[0]


def test_greedy_threshold_zero_is_exact_greedy():
    v, w = _verifier(noise=0.05)
    ref = _plain(w, SamplingParams())
    out, st = generate_tokens(None, v, PROMPT, sampling=SamplingParams(acceptance="divergence", jsd_threshold=0.0),
                              max_new_tokens=40, self_draft="specialist", budget=4)
    assert out == ref
    assert st.rounds > 0 and st.drafted_tokens > 0 and st.accepted_tokens == 0  # nothing is exactly equal


def test_specialist_equal_to_target_at_threshold_zero_is_exact():
    """A "specialist" with the target's own weights: every draft is the target's argmax and
    the output stays greedy decoding whatever the rounds accept."""
    v, w = _verifier(noise=0.0)
    out, _ = generate_tokens(None, v, PROMPT, sampling=SamplingParams(acceptance="divergence", jsd_threshold=0.0),
                             max_new_tokens=40, self_draft="specialist", budget=4)
    assert out == _plain(w, SamplingParams())


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_more_threshold_accepts_more_and_one_accepts_all(temperature):
    rates = []
    for tau in (0.05, 0.2, 1.0):
        v, _ = _verifier(noise=0.02)
        sp = SamplingParams(temperature=temperature, seed=7, acceptance="divergence", jsd_threshold=tau)
        out, st = generate_tokens(None, v, PROMPT, sampling=sp, max_new_tokens=40, self_draft="specialist", budget=4)
        assert len(out) == 40 and v.rounds and st.drafted_tokens > 0
        assert all(spec.shape[0] == res.drafted for _, spec, res in v.rounds)
        rates.append(st.accepted_tokens / st.drafted_tokens)
    assert rates[0] <= rates[1] <= rates[2] == 1.0 and rates[0] < 1.0


def test_rounds_match_the_law_recomputed_from_both_models():
    """Replay each round: the target's logits of the drafted rows from a fresh target engine
    and the specialist's from a fresh specialist engine; the accepted length must be the
    first position with JSD > tau and the emitted token the target's argmax."""
    tau = 0.2
    v, (cfg, sd) = _verifier(noise=0.02)
    _, (scfg, ssd) = _engines(0.02)
    sp = SamplingParams(acceptance="divergence", jsd_threshold=tau)
    out, st = generate_tokens(None, v, PROMPT, sampling=sp, max_new_tokens=30, self_draft="specialist", budget=4)
    committed = list(PROMPT) + out
    tgt, spc = LlamaEngine(cfg, sd, n_slots=1, max_seq_len=256), LlamaEngine(scfg, ssd, n_slots=1, max_seq_len=256)
    partial = 0
    for req, spec_rows, res in v.rounds:
        ctx = committed[: req.keep_len + len(req.append_tokens)]
        # the specialist's draft is its own greedy chain: recompute it and its rows
        spc.reset(0)
        lg = spc.prefill(0, ctx)
        chain, srows = [], []
        for _ in range(res.drafted):
            srows.append(lg.float())
            chain.append(int(lg.argmax()))
            lg = spc.prefill(0, [chain[-1]])
        assert chain[: len(res.accepted)] == res.accepted
        tgt.reset(0)
        out_t = tgt.score(0, ctx + chain, list(range(-1, len(ctx) + len(chain) - 1)),
                          rows=list(range(len(ctx) - 1, len(ctx) + len(chain))))
        trows = out_t.logits.float()
        n = _law(trows, torch.stack(srows), tau)
        assert len(res.accepted) == n, (n, res)
        assert res.next_token == int(trows[n].argmax())
        assert torch.allclose(torch.stack(srows), spec_rows, atol=1e-4)
        partial += 0 < n < res.drafted
    assert partial > 0  # rounds stopped mid-chain: the law was exercised, not just all-or-nothing


def test_sampled_threshold_zero_is_the_exact_rule_seed_for_seed():
    """Sampled, tau = 0: nothing is accepted and each emitted token is the draw plain
    decoding makes with the same round seed (divergence draws no accept uniforms, so
    u_sample[0] is plain decoding's uniform): the output is the target's, seed for seed."""
    for seed in range(3):
        v, w = _verifier(noise=0.05)
        sp = SamplingParams(temperature=0.9, seed=seed, acceptance="divergence", jsd_threshold=0.0)
        out, st = generate_tokens(None, v, PROMPT, sampling=sp, max_new_tokens=24, self_draft="specialist",
                                  budget=3)
        assert out == _plain(w, SamplingParams(temperature=0.9, seed=seed), 24)
        assert st.accepted_tokens == 0


def test_specialist_resyncs_after_losing_the_session():
    v, w = _verifier(noise=0.0)
    sp = SamplingParams(acceptance="divergence", jsd_threshold=0.0)
    spec = v.self_drafters["specialist"]
    calls = {"n": 0}
    orig = spec.sync

    def forgetful(sid, keep, app):
        calls["n"] += 1
        if calls["n"] == 3:
            spec.history.pop(sid, None)  # as if the specialist had dropped the session
        return orig(sid, keep, app)

    spec.sync = forgetful
    out, st = generate_tokens(None, v, PROMPT, sampling=sp, max_new_tokens=20, self_draft="specialist", budget=3)
    assert out == _plain(w, SamplingParams(), 20)
    with pytest.raises(SessionLost):
        orig("nobody", 5, [1])


# ---------------------------------------------------------------- LoRA merge


def test_merge_lora_is_peft_merge_and_unload(tmp_path):
    """The adapter as ``save_pretrained`` writes it (the committed format), merged here
    without peft, equals peft's own merge."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from specmesh.drafters.specialist import LORA_TARGETS, merge_lora
    from tests.support import tiny_hf

    model, hf_cfg = tiny_hf()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    pm.save_pretrained(str(tmp_path))
    adapter = load_file(str(tmp_path / "adapter_model.safetensors"))
    import json

    ours = merge_lora(base, adapter, json.loads((tmp_path / "adapter_config.json").read_text()))
    theirs = pm.merge_and_unload().state_dict()
    changed = 0
    for k, w in theirs.items():
        assert torch.allclose(ours[k], w, atol=1e-6), k
        changed += not torch.equal(w, base[k])
    assert changed == hf_cfg["num_hidden_layers"] * len(LORA_TARGETS)  # every adapted matrix moved
    assert math.isfinite(float(sum(v.sum() for v in ours.values())))
