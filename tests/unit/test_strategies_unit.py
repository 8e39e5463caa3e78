"""Fast tests of the strategy layer (no real model): auto's rules and session
stats, entropy-guided tree depth, the loop adapters (resume a warm prefix, meter
cache drafts), adaptive prompt lookup and the cache drafter (and their
losslessness on a tiny random model), the reasoning / SSR driver on a scripted
target, the proactive anticipator (preemption, bounds) and calibration records."""

from __future__ import annotations

import json
import threading
import time

import pytest

from specmesh.drafters import CacheDrafter, SuffixDrafter, make_drafter
from specmesh.drafters.adaptive_lookup import build_trie, rank_continuations
from specmesh.loop import AdaptiveBudget, VerifyCosts, generate_tokens
from specmesh.strategies import auto
from specmesh.strategies.adapt import CacheMeter, ResumePrefix, TreeBudget
from specmesh.strategies.proactive import Anticipator, Config, Gate, parse_turns
from specmesh.strategies.ssr import (ThinkFormat, local_side_answer, partial_thought, reasoning_generate,
                                     thinking_end)
from specmesh.types import (DraftContext, GenerationStats, InvalidArgument, SamplingParams, SessionLost, TokenTree,
                            VerifyRequest, VerifyResult)
from specmesh.verifier import EngineVerifier
from tests.support import tiny_engine

PROMPT = [5, 17, 33, 2, 64, 12, 12, 80]


@pytest.fixture()
def ver():
    eng, _ = tiny_engine(n_slots=4, max_seq_len=256)
    return EngineVerifier(eng)


# ---------------------------------------------------------------- auto

def test_auto_rules_in_order():
    F = auto.Features
    assert auto.choose(F(anticipation_ready=True, reasoning=True)).strategy == "proactive"
    assert auto.choose(F(reasoning=True, code_block=True)).strategy == "ssr"
    c = auto.choose(F(turns=3))
    assert (c.strategy, c.drafter) == ("external", "suffix") and "3-message" in c.reason
    assert auto.choose(F(prompt_tokens=2000)).drafter == "suffix"
    c = auto.choose(F(code_block=True, edit_cue=True))
    assert (c.strategy, c.drafter) == ("external", "suffix") and "code block" in c.reason
    assert auto.choose(F(layerskip_speedup=1.3)).strategy == "self"
    c = auto.choose(F(layerskip_speedup=0.8))
    assert (c.strategy, c.drafter) == ("external", "suffix") and "0.80x" in c.reason
    lm = {"external:draft_lm": auto.Measured(speedup=1.2, n=2)}
    assert auto.choose(F(), lm).drafter == "draft_lm"
    # the drafter service is down: self if it pays, else plain decoding
    assert auto.choose(F(code_block=True, drafter_up=False, layerskip_speedup=1.2)).strategy == "self"
    c = auto.choose(F(reasoning=True, drafter_up=False))
    assert c.strategy == "autoregressive" and "down" in c.reason
    for c in (auto.choose(F()), auto.choose(F(turns=5))):
        assert c.reason.startswith("auto:")


def test_auto_switches_off_what_does_not_pay_and_reprobes():
    F = auto.Features(code_block=True)
    stats = {"external:suffix": auto.Measured(speedup=0.8, n=1)}
    c = auto.choose(F, stats)
    assert c.strategy == "autoregressive" and "0.80x" in c.reason and "off" in c.reason
    stats["external:suffix"].n = 4  # every probe_every-th request re-tries it
    assert auto.choose(F, stats).drafter == "suffix"
    stats["external:suffix"] = auto.Measured(speedup=1.4, n=3)
    assert auto.choose(F, stats).drafter == "suffix"


def test_auto_prefers_the_block_tree_on_fresh_text_when_the_verifier_has_it():
    F = auto.Features
    # without a block drafter: unchanged (suffix on fresh text; layer-skip only when calibrated above 1x)
    c = auto.choose(F())
    assert (c.strategy, c.drafter) == ("external", "suffix")
    # with one: fresh text (open writing, chat without copy cues) -> self block_tree
    c = auto.choose(F(block_drafter=True))
    assert (c.strategy, c.drafter) == ("self", "block_tree") and "block drafter" in c.reason
    assert auto.choose(F(block_drafter=True, layerskip_speedup=1.3)).drafter == "block_tree"
    # copy cues, long conversations, reasoning and anticipation keep their choices
    assert auto.choose(F(block_drafter=True, code_block=True)).drafter == "suffix"
    assert auto.choose(F(block_drafter=True, turns=4)).drafter == "suffix"
    assert auto.choose(F(block_drafter=True, reasoning=True)).strategy == "ssr"
    assert auto.choose(F(block_drafter=True, anticipation_ready=True)).strategy == "proactive"
    # the drafter service down: a copy-cue request falls back to the block tree, not to plain decoding
    c = auto.choose(F(block_drafter=True, code_block=True, drafter_up=False))
    assert (c.strategy, c.drafter) == ("self", "block_tree") and "down" in c.reason
    assert auto.choose(F(block_drafter=True, drafter_up=False)).drafter == "block_tree"
    assert auto.features_from([1, 2], "Write a poem about autumn.", 1, False, False, True, None,
                              block_drafter=True).block_drafter


def test_auto_under_a_grammar_prefers_a_chain_drafter_that_drafts_the_forced_tokens():
    """Issue 67: a schema of fixed keys ran at τ 1.18 with the block tree auto picked (a tree
    gets no forced tokens) and τ 6.0 with prompt lookup (4.8x plain decoding)."""
    F = auto.Features
    for f in (F(grammar="json_schema", block_drafter=True), F(grammar="json_schema", draft_model="qwen-0.5b"),
              F(grammar="tool calls", turns=4), F(grammar="regex", code_block=True),
              F(grammar="json_schema", drafter_up=False, in_verifier=frozenset({"prompt_lookup"}))):
        c = auto.choose(f)
        assert (c.strategy, c.drafter) == ("external", "prompt_lookup"), f
        assert f.grammar in c.reason and "forced" in c.reason
    assert auto.choose(F(grammar="json_schema", reasoning=True)).strategy == "ssr"  # (refused later: no grammars)
    # no drafter to run it: the usual fallbacks
    assert auto.choose(F(grammar="json_schema", drafter_up=False, block_drafter=True)).drafter == "block_tree"
    # measured slower in this session: off, as any choice
    stats = {"external:prompt_lookup": auto.Measured(speedup=0.8, n=1)}
    assert auto.choose(F(grammar="json_schema"), stats).strategy == "autoregressive"
    assert auto.features_from([1], "x", 1, False, False, True, None, grammar="choice").grammar == "choice"


def test_auto_switches_the_block_tree_away_where_it_does_not_pay_and_reprobes():
    F = auto.Features(block_drafter=True)
    stats = {"self:block_tree": auto.Measured(speedup=0.8, n=1)}
    c = auto.choose(F, stats)  # the next fresh-text choice: suffix decoding
    assert (c.strategy, c.drafter) == ("external", "suffix") and "0.80x" in c.reason
    assert c.switched_from == ("self:block_tree",)
    # suffix also measured a slowdown here: speculation off, both counted as switched away
    stats["external:suffix"] = auto.Measured(speedup=0.9, n=1)
    c = auto.choose(F, stats)
    assert c.strategy == "autoregressive" and c.switched_from == ("self:block_tree", "external:suffix")
    # a calibrated layer-skip is the next choice before suffix
    assert auto.choose(auto.Features(block_drafter=True, layerskip_speedup=1.2), stats).drafter == "layerskip"
    # it paid: kept
    assert auto.choose(F, {"self:block_tree": auto.Measured(speedup=1.5, n=3)}).drafter == "block_tree"
    # every probe_every-th request of the session re-tries it: the session book counts the switches
    book = auto.SessionBook()
    book.record("s", "self:block_tree", 1.2, 0.8)
    seen = []
    for _ in range(8):
        c = auto.choose(F, book.get("s"))
        seen.append(c.drafter)
        if c.switched_from:
            book.skip("s", c.switched_from)
        elif c.drafter == "block_tree":
            book.record("s", "self:block_tree", 1.2, 0.8)  # re-probed and still slow
    assert seen == ["suffix", "suffix", "suffix", "block_tree", "suffix", "suffix", "suffix", "block_tree"]


def test_auto_tries_a_real_draft_model_on_fresh_text_and_keeps_it_where_it_pays():
    """Issue 62: where the drafter service runs a real draft model (the target's paired one),
    fresh text gets the draft LM first; the session's measurement then keeps it (faster) or
    switches to the next fresh-text choice (slower), re-probed every probe_every-th request."""
    F = auto.Features
    pair = F(draft_model="qwen2.5-coder-0.5b-instruct")
    c = auto.choose(pair)
    assert (c.strategy, c.drafter) == ("external", "draft_lm") and "qwen2.5-coder-0.5b-instruct" in c.reason
    assert "first try" in c.reason
    # without a real draft model (the stand-in), nothing changes: suffix decoding on fresh text
    assert auto.choose(F()).drafter == "suffix"
    # measured faster: kept
    c = auto.choose(pair, {"external:draft_lm": auto.Measured(speedup=1.4, n=1)})
    assert c.drafter == "draft_lm" and "1.40x" in c.reason
    # measured slower: the next fresh-text choice, the switch counted
    slow = {"external:draft_lm": auto.Measured(speedup=0.7, n=1)}
    c = auto.choose(pair, slow)
    assert (c.strategy, c.drafter) == ("external", "suffix") and "0.70x" in c.reason
    assert c.switched_from == ("external:draft_lm",)
    book = auto.SessionBook()
    book.record("s", "external:draft_lm", 1.5, 0.7)
    seen = []
    for _ in range(8):
        c = auto.choose(pair, book.get("s"))
        seen.append(c.drafter)
        if c.switched_from:
            book.skip("s", c.switched_from)
        elif c.drafter == "draft_lm":
            book.record("s", "external:draft_lm", 1.5, 0.7)  # re-probed and still slow
    assert seen == ["suffix", "suffix", "suffix", "draft_lm", "suffix", "suffix", "suffix", "draft_lm"]
    # copy cues, long conversations, the block drafter and a down drafter service keep their choices
    assert auto.choose(F(draft_model="d", code_block=True)).drafter == "suffix"
    assert auto.choose(F(draft_model="d", turns=4)).drafter == "suffix"
    assert auto.choose(F(draft_model="d", block_drafter=True)).drafter == "block_tree"
    c = auto.choose(F(draft_model="d", drafter_up=False, in_verifier=frozenset({"suffix"})))
    assert (c.strategy, c.drafter) == ("external", "suffix")  # drafted in the verifier: no drafter service needed
    # the block tree measured slow: the draft model is the next fresh-text choice
    c = auto.choose(F(draft_model="d", block_drafter=True), {"self:block_tree": auto.Measured(speedup=0.8, n=1)})
    assert c.drafter == "draft_lm" and c.switched_from == ("self:block_tree",)
    assert auto.features_from([1], "Write a poem.", 1, False, False, True, None, draft_model="d").draft_model == "d"


def test_auto_reprobes_a_switched_off_choice_every_probe_every_requests():
    F = auto.Features(code_block=True)
    book = auto.SessionBook()
    book.record("s", "external:suffix", 1.0, 0.5)
    got = []
    for _ in range(8):
        c = auto.choose(F, book.get("s"))
        got.append(c.strategy)
        book.skip("s", c.switched_from)
        if c.strategy == "external":
            book.record("s", "external:suffix", 1.0, 0.5)
    assert got == ["autoregressive"] * 3 + ["external"] + ["autoregressive"] * 3 + ["external"]


def test_text_features_and_measured_speedup():
    f = auto.text_features("Fix this:\n```python\nx = 1\n```")
    assert f["code_block"] and f["edit_cue"]
    assert auto.text_features('Summarise: she said "the light tells them where the rocks are".')["quoted"]
    assert not any(auto.text_features("Write a poem about autumn.").values())
    assert auto.measured_speedup(11, 1.1, 0.1, 0.2) == pytest.approx(2.0)
    assert auto.measured_speedup(1, 1.0, 0.1, 0.2) is None
    est = auto.measured_speedup(11, 1.1, 0.1, None, verify_s=0.5, rounds=5, drafted=0)
    assert est == pytest.approx(1.0)
    book = auto.SessionBook(ema=0.5)
    book.record("k", "external:suffix", 2.0, 1.5, 0.8)
    book.record("k", "external:suffix", 1.0, 0.5, 0.4)
    m = book.get("k")["external:suffix"]
    assert (m.tau, m.speedup, m.n) == (1.5, 1.0, 2) and book.initial_alpha("k", "external:suffix") == pytest.approx(0.6)
    assert book.initial_alpha("other", "x") == 0.6
    book.record_ar(11, 2.1, 0.1)
    assert book.ar_token_s == pytest.approx(0.2)


# ---------------------------------------------------------------- adapters

def test_draft_size_follows_entropy():
    b = TreeBudget(8, max_depth=8, fixed_length=True)
    assert b.depth() == 8 and b.next() == 8
    b.update(8, 8, entropy=0.1)
    low = b.depth()
    assert b.next() == low
    b.update(8, 1, entropy=4.0)
    assert low > b.depth() >= 1 and b.next() == b.depth()
    a = TreeBudget(8, alpha0=0.05)  # cost model: nothing pays -> no draft (probed now and then)
    assert a.next() == 0


def test_adaptive_budget_alpha_and_per_round_cost_model():
    b = AdaptiveBudget(8, alpha0=0.5, ema=0.5)
    b.update(7, 0)  # fully rejected round
    b.update(7, 3)  # then 3 accepted: alpha is the ratio of the EMAs, not an EMA of ratios
    acc, tot = 0.5 * (0.5 * 0.5) + 0.5 * 3, 0.5 * 1.0 + 0.5 * 4  # EMAs after the two rounds
    assert b.alpha == pytest.approx(acc / tot)  # an EMA of per-round ratios would say 0.5
    # a one-pass block drafter: its cost is charged once per round, whatever the length
    blk = AdaptiveBudget(8, alpha0=0.6, beta=0.0, per_round_draft=True)
    blk.cost = 0.15
    tok = AdaptiveBudget(8, alpha0=0.6, beta=0.0)
    tok.cost = 0.15
    assert blk.expected_speedup(8) > tok.expected_speedup(8) and blk.next() > tok.next()
    # the extra verify cost per token is learned from short vs long rounds
    m = AdaptiveBudget(8, per_round_draft=True, ema=1.0)
    m.update(1, 1, verify_s=0.10)
    m.update(7, 2, verify_s=0.16)
    assert m.beta == pytest.approx(0.06 / (0.10 * 7 - 0.16 * 1))  # the line through (1, 0.10) and (7, 0.16)
    m.update(7, 2, verify_s=0.09)  # long rounds as cheap as short ones (bf16 matrix units)
    assert m.beta == 0.0
    # switched off, it re-probes with a full block (a shorter one would not cost less)
    off = AdaptiveBudget(8, alpha0=0.01, per_round_draft=True, probe_every=2)
    off.cost = 0.5
    # each probe that leaves it off doubles the wait, up to PROBE_BACKOFF x probe_every
    assert [off.next() for _ in range(14)] == [0, 8] + [0, 0, 0, 8] + [0] * 7 + [8]
    assert [off.next() for _ in range(8)] == [0] * 7 + [8]  # the cap: 8 = 4 x 2 off rounds
    off.cost, off.alpha = 0.0, 0.95  # drafting pays again: on, and the wait starts over
    assert off.next() > 0
    off.cost, off.alpha = 0.5, 0.01
    assert [off.next() for _ in range(2)] == [0, 8]
    assert AdaptiveBudget(8, alpha0=0.01, probe_every=2).next() == 0
    # the wait is shared by the drafter's sessions on one verifier: one starting under load waits as
    # long as the last probe left it; one alone, or of another drafter, probes at the usual rate
    costs = VerifyCosts()
    first = AdaptiveBudget(8, alpha0=0.01, per_round_draft=True, probe_every=2, costs=costs, probe_key="b")
    first.cost = 0.5
    assert [first.next() for _ in range(6)] == [0, 8, 0, 0, 0, 8] and costs.probe_gaps == {"b": 8}
    costs.load = 6.0

    def fresh(key="b"):
        p = AdaptiveBudget(8, alpha0=0.01, per_round_draft=True, probe_every=2, costs=costs, probe_key=key)
        p.cost = 0.5
        return [int(p.next() > 0) for _ in range(8)]  # the rounds that probe (under load: a shorter block)

    assert fresh() == [0] * 7 + [1] and fresh("other")[:3] == [0, 1, 0]
    costs.load = 1.0
    assert fresh()[:3] == [0, 1, 0]
    first.cost, first.alpha = 0.0, 0.95  # drafting pays for a session: the shared wait starts over
    assert first.next() > 0 and costs.probe_gaps["b"] == 2
    costs.load = 6.0
    assert fresh()[:2] == [0, 1]
    assert AdaptiveBudget.for_drafter("block_tree", 8).probe_key == "block_tree"
    # what drafted rounds measured (the draft's cost, the seconds-per-token guard) carries over to the
    # drafter's next generation on that verifier: it does not start from free drafts and an unarmed guard
    costs = VerifyCosts()
    costs.observe(0, 0.010)  # a plain round: 10 ms
    one = AdaptiveBudget(8, alpha0=0.6, per_round_draft=True, costs=costs, probe_key="b", ema=1.0)
    assert one.next() > 0  # fresh priors: a draft pass priced free, acceptance 0.6
    for _ in range(AdaptiveBudget.SPEED_MIN + 1):  # drafted rounds: a 9 ms draft, 1 token for 25 ms
        one.update(8, 0, draft_s=0.009, verify_s=0.016)
    assert one.cost == pytest.approx(0.9) and one.drafted_spt > 0.010 and not one.measured_pays()
    two = AdaptiveBudget(8, alpha0=0.6, per_round_draft=True, costs=costs, probe_key="b")
    assert two.learned == one.learned and two.next() == 0  # the guard is armed from its first round
    other = AdaptiveBudget(8, alpha0=0.6, per_round_draft=True, costs=costs, probe_key="other")
    assert other.cost == 0.0 and other.next() > 0  # another drafter: its own priors
    # where a full block is dear to verify (bf16 on AVX2: 8 x 0.24 forwards), the probe
    # drafts the length that pays best at the prior acceptance: 2 at alpha0 0.6, c 0.4
    dear = AdaptiveBudget(8, alpha0=0.6, beta=0.24, per_round_draft=True, probe_every=2)
    dear.cost, dear.alpha = 0.4, 0.01
    assert [dear.next() for _ in range(2)] == [0, 2]


def test_every_policy_is_held_to_the_seconds_per_token_its_rounds_measured():
    """The cost model says a full block pays; the drafted rounds cost more seconds per
    committed token than a plain round: drafting goes off (re-probed later); cheap
    rounds keep it on. The first round (it carries the prefill) is not counted. A
    per-token drafter (prompt lookup) is held to the same measure, and its rounds feed
    the shared costs."""
    costs = VerifyCosts(ema=1.0)
    costs.observe(0, 0.010)  # a plain round: 10 ms for its one token
    slow = AdaptiveBudget.for_drafter("block_tree", 8, costs=costs, alpha0=0.9, beta=0.01)
    fast = AdaptiveBudget.for_drafter("block_tree", 8, costs=costs, alpha0=0.9, beta=0.01)
    for pol, accepted in ((slow, 1), (fast, 4)):
        pol.update(8, 7, draft_s=0.5, verify_s=0.5)  # the first round: a prefill, not counted
        for i in range(AdaptiveBudget.SPEED_MIN):
            assert pol.measured_pays()  # not enough rounds measured yet
            pol.update(8, accepted, draft_s=0.002, verify_s=0.020)
            pol.alpha, pol.full_accepted = 0.9, 6.0  # the model keeps saying drafting pays
    assert slow.drafted_spt == pytest.approx(0.022 / 2) and fast.drafted_spt == pytest.approx(0.022 / 5)
    assert not slow.measured_pays() and slow.next() == 0  # 11 ms a token > 10 ms: off
    assert fast.measured_pays() and fast.next() == 8  # 4.4 ms a token: on
    # under load the 10 ms its verify adds (and its 2 ms draft, in the verifier's turn) hold up every
    # session of the forward: at 4 sessions 48 ms of theirs for the 4 tokens (40 ms) it bought: off
    fast.load = fast.draft_load = 4.0
    assert not fast.measured_pays() and fast.next() == 0
    loaded = AdaptiveBudget(8, load=4.0)
    assert loaded.draft_load == 1.0
    loaded.drafts_inside()  # the loop says so for a self drafter before its first round
    assert loaded.draft_load == 4.0
    fast.draft_load = 1.0  # the same drafted on a drafter service: only its own session waits the draft
    fast.load = 3.0
    assert fast.measured_pays()  # 3 x 10 + 2 = 32 ms <= 40
    own = VerifyCosts(ema=1.0)
    tok = AdaptiveBudget.for_drafter("prompt_lookup", 8, costs=own, alpha0=0.9)
    tok.update(0, 0, verify_s=0.010)  # the first round (a prefill): a plain one, 10 ms
    tok.update(0, 0, verify_s=0.010)  # a plain round: the unit
    assert own.short_seconds == pytest.approx(0.010)
    for _ in range(AdaptiveBudget.SPEED_MIN):
        assert tok.measured_pays()
        tok.update(4, 0, draft_s=0.001, verify_s=0.013)  # 14 ms for its one token
        tok.alpha = 0.9  # the model keeps saying drafting pays
    assert tok.drafted_spt == pytest.approx(0.014) and not tok.measured_pays() and tok.next() == 0


def test_verify_costs_shared_across_requests_and_block_policies():
    costs = VerifyCosts(prior=0.06, ema=1.0)
    first = AdaptiveBudget.for_drafter("block", 8, costs=costs)
    assert first.per_round_draft and not first.tree and first.ema == 0.1 and first.beta == 0.06  # the prior
    first.update(1, 1, verify_s=0.100)
    first.update(8, 3, verify_s=0.114)
    fit = 0.014 / (0.100 * 8 - 0.114 * 1)  # the line t1 (1 + beta k) through (1, 100 ms) and (8, 114 ms)
    assert first.beta == pytest.approx(fit)
    later = AdaptiveBudget.for_drafter("block_tree", 8, costs=costs)  # a new request starts from what was measured
    assert later.tree and later.beta == pytest.approx(fit)
    assert AdaptiveBudget.for_drafter("block", 8).beta == 0.06  # no shared costs: its own, from the prior
    tok = AdaptiveBudget.for_drafter("prompt_lookup", 8, costs=costs)
    assert not tok.per_round_draft and tok.beta == pytest.approx(fit) and tok.ema == 0.3  # the same measured rows
    costs.observe(3, 5.0)  # k = 3 is in neither group: ignored
    assert costs.beta == pytest.approx(fit)


def test_verify_costs_fit_the_cost_line_when_short_rounds_are_drafted():
    """Short rounds that drafted two tokens (a one-token forward t1 = 15 ms, beta = 0.24,
    what bf16 on an AVX2 CPU measures): the fit gives back t1 and beta, where the short
    rounds' own seconds would price a plain round at 22 ms and a scored token at 0.16."""
    costs = VerifyCosts(prior=0.06, ema=1.0)
    assert costs.short_seconds is None and costs.beta == 0.06
    costs.observe(2, 0.015 * (1 + 0.24 * 2))
    assert costs.beta == 0.06 and costs.short_seconds == pytest.approx(0.015 * 1.48 / (1 + 0.06 * 2))
    costs.observe(8, 0.015 * (1 + 0.24 * 8))
    assert costs.beta == pytest.approx(0.24) and costs.short_seconds == pytest.approx(0.015)
    costs.observe(0, 0.015)  # plain rounds pull the short group's mean k down; the line stays
    assert costs.beta == pytest.approx(0.24) and costs.short_seconds == pytest.approx(0.015)


def test_block_policy_full_budget_measured_and_tree_all_or_nothing():
    # the full block's measured acceptance replaces the chain model at max_budget
    b = AdaptiveBudget(8, alpha0=0.4, beta=0.02, per_round_draft=True, ema=1.0)
    b.cost = 0.15
    chain_k = b.next()
    assert 0 < chain_k < 8  # the chain model at alpha 0.4 prefers a short block
    b.update(8, 4, draft_s=0.015, verify_s=0.1)  # but a full block accepted 4 (alpha -> 0.8 too)
    assert b.full_accepted == 4 and b.next() == 0  # first a plain round: no short round measured yet
    b.update(0, 0, verify_s=0.095)  # a plain round nearly as long as the full block's: tokens nearly free
    assert b.next() == 8
    # a short block is refreshed by a full one every probe_every rounds
    s = AdaptiveBudget(8, alpha0=0.4, beta=0.02, per_round_draft=True, probe_every=3)
    s.cost = 0.15
    seq = [s.next() for _ in range(33)]
    # each refresh that leaves it short doubles the wait: after 3, 6, then 12 (= 4 x 3) rounds
    assert [i for i, k in enumerate(seq) if k == 8] == [2, 8, 20, 32] and 0 < seq[0] < 8
    # a tree drafts its whole budget whenever drafting pays, and nothing when it does not
    t = AdaptiveBudget.for_drafter("block_tree", 8, alpha0=0.4, beta=0.02)
    t.cost = 0.15
    assert t.next() == 8
    dear = AdaptiveBudget.for_drafter("block_tree", 8, alpha0=0.6, beta=0.12)  # fp32: scored tokens are dear
    dear.cost = 0.1
    assert 0 < dear.next() < 8  # the chain model's length, not a full tree that would not pay
    dead = AdaptiveBudget.for_drafter("block_tree", 8, alpha0=0.4, beta=0.02, probe_every=4, ema=1.0)
    dead.update(8, 0, draft_s=0.05, verify_s=0.1)  # nothing accepted, a draft costing half a forward
    dead.costs.observe(0, 0.1)  # a plain round measured (else the next round would be one)
    assert [dead.next() for _ in range(4)] == [0, 0, 0, 8]  # off, re-probed with the full tree


def test_block_policy_measures_a_plain_round_when_the_unit_is_missing_or_stale():
    """A one-pass drafter's policy with only long rounds measured (no short one, or none for
    ``VerifyCosts.STALE`` long rounds) asks for one plain round: the cost model's unit; a
    stale short EMA is replaced by the new round, not blended with it."""
    costs = VerifyCosts(prior=0.01)
    pol = AdaptiveBudget.for_drafter("block_tree", 8, costs=costs, alpha0=0.9)
    assert pol.next() == 8  # nothing measured: the prior (a full tree that pays)
    pol.update(8, 7, draft_s=0.001, verify_s=0.012)
    assert costs.needs_unit and pol.next() == 0  # a long round only: measure a plain one
    pol.update(0, 0, verify_s=0.010)
    assert not costs.needs_unit and costs.short_seconds == pytest.approx(0.010) and pol.next() == 8
    for _ in range(VerifyCosts.STALE - 1):
        costs.observe(8, 0.012)
    assert not costs.needs_unit
    costs.observe(8, 0.012)
    assert costs.needs_unit and pol.next() == 0  # STALE long rounds since the last short one
    pol.update(0, 0, verify_s=0.005)  # the machine got faster: the new round replaces the old EMA
    assert not costs.needs_unit and costs.short_seconds == pytest.approx(0.005)
    tok = AdaptiveBudget.for_drafter("draft_lm", 8, costs=VerifyCosts())
    tok.costs.observe(8, 0.012)
    assert tok.next() == 0  # per-token drafters too (since 2026-12-06: measured_pays needs the unit)
    tok.update(0, 0, verify_s=0.010)
    assert tok.next() > 0


def test_a_draft_lm_that_costs_more_than_it_buys_is_switched_off():
    """Per-token drafters measure a plain round, price a draft token over it, and are held
    to what their rounds measured: a draft LM accepting under one token a round whatever
    its length, at 23 ms a draft token, against a 55 ms plain round and a 158 ms six-token
    verify (the Qwen pair on one core each, open writing), drafts nothing after a few
    rounds (its re-probes draft the length that would pay at the prior acceptance)."""
    pol = AdaptiveBudget.for_drafter("draft_lm", 6, costs=VerifyCosts())
    sizes = []
    for i in range(40):
        k = pol.next()
        sizes.append(k)
        if k == 0:
            pol.update(0, 0, verify_s=0.055)
        else:
            acc = min(k, (0, 1, 0, 2)[i % 4])  # under one accepted a round
            pol.update(k, acc, draft_s=0.023 * k, verify_s=0.055 + 0.017 * k)
    assert sizes[0] > 0 and sizes[1] == 0, sizes  # a drafted round, then the unit
    assert sum(1 for k in sizes[20:] if k > 0) <= 3, sizes  # off, bar re-probes


def test_cache_meter_counts_accepted_cache_drafts(ver):
    eng = ver.engine
    plain, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=20)
    cache = CacheDrafter()
    cache.seed("c", [PROMPT[-3:] + plain])  # a perfect anticipation of the reply

    class Bound:
        def propose(self, ctx, b):
            ctx.cache_id = "c"
            return cache.propose(ctx, b)

        def release(self, sid):
            cache.release(sid)

        def finish(self, sid, toks, p):
            cache.finish(sid, toks, p)

    meter = CacheMeter(Bound())
    st = GenerationStats()
    out, st = generate_tokens(meter, ver, PROMPT, max_new_tokens=20, budget=AdaptiveBudget(8), stats=st)
    assert out == plain
    meter.fill(st)
    assert st.cache_hit and st.cache_accepted_tokens == st.accepted_tokens > 10
    assert st.cache_drafted_tokens >= st.cache_accepted_tokens
    assert CacheMeter.accepted_len(TokenTree([4, 5, 9], [-1, 0, -1]), [9, 1]) == 1
    assert CacheMeter.accepted_len(TokenTree([4, 5, 9], [-1, 0, -1]), [4, 5, 7]) == 2
    del eng


def test_resume_prefix_uses_the_warm_kv_and_falls_back(ver):
    plain, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=12)
    ver.prefill("warm", PROMPT[:6])
    f0 = ver.forwards
    r = ResumePrefix(ver, 6)
    out, _ = generate_tokens(None, r, PROMPT, max_new_tokens=12, session_id="warm")
    assert out == plain and r.used == 6 and ver.forwards - f0 == 12
    assert ver.slot_of("warm") is None  # released at the end
    r = ResumePrefix(ver, 6)  # the warm session is gone: a full prefill, same output
    out, _ = generate_tokens(None, r, PROMPT, max_new_tokens=12, session_id="gone")
    assert out == plain and r.used == 0


def test_verifier_fork_copies_a_kv_prefix(ver):
    full = PROMPT + [7, 8, 9]
    ref, _ = generate_tokens(None, ver, full, max_new_tokens=10)
    ver.prefill("main", PROMPT)
    f0 = ver.forwards
    assert ver.fork("main", "side", 6) == 6 and ver.forwards == f0  # no forward
    r = ResumePrefix(ver, 6)
    out, _ = generate_tokens(None, r, full, max_new_tokens=10, session_id="side")
    assert out == ref and r.used == 6
    assert ver.engine.length(ver.slot_of("main")) == len(PROMPT)  # the source is untouched
    assert ver.fork("main", "side2", 100) == len(PROMPT)  # clamped
    with pytest.raises(SessionLost):
        ver.fork("nobody", "x", 3)
    with pytest.raises(InvalidArgument):
        ver.fork("main", "main", 3)


# ---------------------------------------------------------------- drafters

def test_adaptive_lookup_lexical_branches_and_retrieval():
    d = make_drafter("adaptive_lookup", vocab_size=100)
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5, 20, 30, 31, 32, 33, 34, 35, 36, 37, 3, 4]
    t = d.propose(DraftContext("s", toks, 5), 6)  # a 2-token match: at most 2 * 2 nodes
    assert t.source == "lexical" and t.tokens == [5, 20, 6, 7] and t.parents == [-1, 0, 0, 2]
    t = make_drafter("adaptive_lookup", vocab_size=100, spec_factor=None).propose(DraftContext("s", toks, 5), 6)
    assert t.tokens[:2] == [5, 20] and len(t) == 6
    assert t.children(0) == [1, 4] and t.tokens[4] == 6  # the older continuation branches after the shared "5"
    # no n-gram of length 2 matches: the reordered window is found by similarity
    toks2 = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 60, 61, 62, 45, 44, 43, 42, 41, 40]
    t = d.propose(DraftContext("t", toks2, 5), 4)
    assert t.source == "retrieval" and t.tokens == [46, 47, 48, 49]
    assert d.propose(DraftContext("u", [90, 91, 92], 1), 4).tokens == []
    t = d.propose(DraftContext("s", toks[:14], 5), 3)  # rollback: the state follows the shorter context
    assert t.tokens[:1] == [5]
    with pytest.raises(InvalidArgument):
        make_drafter("adaptive_lookup")  # needs embeddings or vocab_size
    tr = build_trie([[1, 2, 3, 4], [1, 2, 9, 9], [7, 7]], 6, 2, 3)
    assert tr.tokens == [1, 2, 3, 9, 9, 7] and tr.parents == [-1, 0, 1, 1, 3, -1]  # 3 nodes reserved for branches
    assert rank_continuations([[5, 1], [6, 1], [6, 2], [6, 1]]) == [[6, 1], [6, 2], [5, 1]]


def test_model_free_drafters_are_lossless(ver):
    import torch

    plain, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=30)
    emb = torch.randn(ver.vocab_size, 16)
    for d in (make_drafter("adaptive_lookup", embeddings=emb, min_similarity=0.0), CacheDrafter()):
        out, st = generate_tokens(d, ver, PROMPT, max_new_tokens=30, budget=6)
        assert out == plain and st.drafted_tokens > 0, d


def test_cache_drafter_seed_ttl_and_bounds():
    now = [0.0]
    c = CacheDrafter(max_caches=2, ttl_s=10.0, max_tokens=64, clock=lambda: now[0])
    assert c.seed("a", [[1, 2, 3, 4, 5, 6]]) == (1, 6)
    t = c.propose(DraftContext("s", [9, 2, 3], 1, cache_id="a"), 4)
    assert t.tokens == [4, 5, 6] and t.source == "cache"
    t = c.propose(DraftContext("s2", [7, 8, 7, 8, 7], 1, cache_id="a"), 3)
    assert t.source == "context" and t.tokens[0] == 8
    assert c.info("a")["texts"] == 1
    c.seed("a", [], replace=True)
    assert c.info("a")["tokens"] == 0
    c.seed("b", [[1]])
    c.seed("c", [[2]])
    assert c.info("a") is None  # LRU: at most 2 caches
    now[0] = 11.0
    assert c.info("b") is None and len(c) == 0  # expired
    c.seed("d", [list(range(50)), list(range(50, 100))])
    assert c.info("d")["tokens"] <= 64  # oldest texts evicted past max_tokens
    with pytest.raises(InvalidArgument):
        c.seed("", [[1]])


def test_drafter_host_seeds_and_reads_caches():
    from specmesh.drafter_service.host import DrafterHost

    host = DrafterHost({"cache": CacheDrafter, "suffix": SuffixDrafter}, vocab_size=50)
    assert host.seed("conv:x", [[1, 2, 3, 4, 5]]) == (1, 5)
    tree, held, _ = host.propose("s", "cache", 0, [9, 2, 3], 1, SamplingParams(), 4, "conv:x")
    assert tree.tokens == [4, 5] and tree.source == "cache" and held == 3
    for bad in (dict(cache_id="", texts=[[1]]), dict(cache_id="c", texts=[[99]]), dict(cache_id="c" * 200, texts=[])):
        with pytest.raises(InvalidArgument):
            host.seed(bad["cache_id"], bad["texts"])
    with pytest.raises(InvalidArgument):
        DrafterHost({"suffix": SuffixDrafter}, vocab_size=50).seed("c", [[1]])


def test_drafter_service_preloads_a_draft_lm_of_its_own():
    """A paired or configured draft LM is built when the service starts (its load must not
    count against the first request's drafter deadline); the layer-subset one waits."""
    from specmesh.drafter_service.host import DrafterHost
    from specmesh.drafter_service.servicer import preload_draft_lm
    from specmesh.serving.settings import load_settings

    built = []
    host = DrafterHost({"draft_lm": lambda: built.append("draft_lm") or SuffixDrafter(),
                        "suffix": SuffixDrafter}, vocab_size=50)
    host.preload(["draft_lm", "not_hosted"])
    host.preload(["draft_lm"])
    assert built == ["draft_lm"]  # built once, kept; unknown names ignored
    assert preload_draft_lm(load_settings(model="qwen2.5-coder-1.5b-instruct"))
    assert preload_draft_lm(load_settings(draft_model="/some/dir"))
    assert not preload_draft_lm(load_settings(model="smollm2-135m-instruct"))
    assert not preload_draft_lm(load_settings(model="qwen2.5-coder-1.5b-instruct", preload_draft_lm=False))


# ---------------------------------------------------------------- reasoning / SSR on a scripted target

class ScriptVerifier:
    """A deterministic target: the token at absolute position i >= base is
    script[i - base] (past the script: ``stop``). Greedy acceptance of chains/trees."""

    def __init__(self, base: int, script: list[int], stop: int = 0, vocab: int = 100):
        self.base, self.script, self.stop, self.vocab_size = base, script, stop, vocab
        self.sessions: dict[str, list[int]] = {}
        self.forwards = 0

    def _at(self, i: int) -> int:
        return self.script[i - self.base] if 0 <= i - self.base < len(self.script) else self.stop

    def verify(self, req: VerifyRequest) -> VerifyResult:
        held = self.sessions.get(req.session_id)
        if held is None and req.keep_len:
            raise SessionLost("gone")
        ctx = (held or [])[: req.keep_len] + list(req.append_tokens)
        self.forwards += 1
        node, acc = -1, []
        while True:
            want = self._at(len(ctx) + len(acc))
            nxt = next((i for i in req.tree.children(node) if req.tree.tokens[i] == want), None)
            if nxt is None:
                break
            node = nxt
            acc.append(want)
        self.sessions[req.session_id] = ctx + acc
        return VerifyResult(acc, self._at(len(ctx) + len(acc)), len(req.tree), len(req.tree))

    def release(self, sid: str) -> None:
        self.sessions.pop(sid, None)


FMT = ThinkFormat(open_ids=(90,), close_ids=(91, 92, 93), end_seqs=((92, 93),), line_ids=(10,), answer_cue=(94,))


def _reasoning(v, prompt, **kw):
    st = GenerationStats()
    out = [t for ch in reasoning_generate(v, prompt, FMT, stats=st, stop_ids=[0], **kw) for t in ch]
    return out, st


def test_thinking_end_and_partial_thought():
    assert thinking_end([1, 92, 93, 4], FMT.end_seqs) == 3
    assert thinking_end([1, 92, 5, 93], FMT.end_seqs) is None
    assert thinking_end([1, 2, 92, 93], FMT.end_seqs, start=3) == 4
    assert partial_thought([1, 10, 2, 3], [10]) == [1, 10]
    assert partial_thought([1, 2, 3], [10]) == [1, 2, 3]


def test_reasoning_forces_the_end_of_thinking_at_the_budget():
    prompt = [1, 2, 3, 90]
    script = list(range(20, 60))  # never closes its thinking by itself, never stops
    out, st = _reasoning(ScriptVerifier(len(prompt), script), prompt, max_new_tokens=20, thinking_budget=8)
    assert out[:8] == script[:8] and out[8:11] == [91, 92, 93]  # forced close after the budget
    assert out[11:] == script[11:20] and st.thinking_tokens == 8 and st.answer_tokens == 9
    assert st.finish_reason == "length" and st.answer_s > 0


def test_reasoning_natural_end_and_stop_inside_thinking():
    prompt = [1, 2, 3, 90]
    script = [20, 21, 92, 93, 30, 31, 32, 0]  # closes at 4 tokens, answers, stops
    out, st = _reasoning(ScriptVerifier(len(prompt), script), prompt, max_new_tokens=30, thinking_budget=10)
    assert out == script[:-1] and st.thinking_tokens == 4 and st.answer_tokens == 3 and st.finish_reason == "stop"
    script = [20, 21, 0]  # a stop token while thinking: the close is forced, then the answer
    out, st = _reasoning(ScriptVerifier(len(prompt), script), prompt, max_new_tokens=10, thinking_budget=10)
    assert out[:5] == [20, 21, 91, 92, 93] and st.thinking_tokens == 2


def test_ssr_equals_plain_full_cot_and_seeds_the_cache():
    prompt = [1, 2, 3, 90]
    answer = [94, 40, 41, 42, 43, 44, 45, 46]
    # thinking of 24 tokens with line breaks; the target's answer after its close equals the side answers
    script = [20 + (i % 7) if i % 6 else 10 for i in range(24)] + [92, 93] + answer + [0]
    v = ScriptVerifier(len(prompt), script)
    plain, s0 = _reasoning(v, prompt, max_new_tokens=60, thinking_budget=40)
    cache = CacheDrafter()

    class Bound(CacheMeter):
        def propose(self, ctx, b):
            ctx.cache_id = "ssr"
            return super().propose(ctx, b)

    meter = Bound(cache)
    side_v = ScriptVerifier(0, [])

    def side(context, shared, main):  # the scripted target answers the same thing from any partial thinking
        side_v.base, side_v.script = len(context), answer[1:] + [0]
        return generate_tokens(None, side_v, context, max_new_tokens=16, stop_ids=[0])[0]

    out, s1 = _reasoning(v, prompt, max_new_tokens=60, thinking_budget=40, drafter=SuffixDrafter(),
                         answer_drafter=meter, side_answer=side, seed=lambda t: cache.seed("ssr", t),
                         fractions=(0.25, 0.5), side_async=False)
    meter.fill(s1)
    assert out == plain and s1.answer_tokens == s0.answer_tokens == len(answer)
    assert s1.side_branches == 2 and s1.cache_accepted_tokens >= 4 and s1.cache_hit
    assert s1.rounds < s0.rounds and not v.sessions  # fewer forwards; every session released


def test_ssr_on_a_tiny_model_is_lossless(ver):
    prompt = PROMPT + [90]
    plain, _ = _reasoning(ver, prompt, max_new_tokens=40, thinking_budget=16)
    cache = CacheDrafter()

    class Bound(CacheMeter):
        def propose(self, ctx, b):
            ctx.cache_id = "k"
            return super().propose(ctx, b)

    out, st = _reasoning(ver, prompt, max_new_tokens=40, thinking_budget=16, drafter=SuffixDrafter(),
                         answer_drafter=Bound(cache), side_answer=local_side_answer(ver, [0], 8),
                         seed=lambda t: cache.seed("k", t))  # side branches in a background thread
    assert out == plain and st.side_branches <= 2
    assert not ver.pool.slots  # main and side sessions all released


# ---------------------------------------------------------------- proactive

class FakeBackend:
    """Scripted replies; each generate round yields 2 tokens and can be slowed."""

    stop_ids = [0]

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.seeds: list = []
        self.warmed: list = []
        self.released: list = []
        self.rounds = 0

    def encode(self, messages, generation_prompt=True):
        return [len(m["content"]) % 50 + 1 for m in messages] + ([99] if generation_prompt else [])

    def decode(self, ids):
        return "\n".join(f"question {t}?" for t in ids)

    def generate(self, prompt_ids, max_new_tokens, session_id, cache_salt=""):
        def gen():
            i = len(prompt_ids)
            n = 0
            while n < max_new_tokens:
                time.sleep(self.delay)
                self.rounds += 1
                chunk = [(i + n + k) % 40 + 1 for k in range(min(2, max_new_tokens - n))]
                n += len(chunk)
                yield chunk
        return gen()

    def seed(self, cache_id, texts, ttl_s, replace):
        self.seeds.append((cache_id, texts, replace))

    def warm(self, session_id, tokens, cache_salt=""):
        self.warmed.append(session_id)
        return "here"

    def forget(self, session_id):
        pass

    def release(self, session_id):
        self.released.append(session_id)


CONV = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


def test_anticipation_job_seeds_replies_within_budget():
    b = FakeBackend()
    a = Anticipator(b, config=Config(next_turns=2, reply_tokens=6, question_tokens=4, token_budget=100)).start()
    try:
        e = a.submit("c1", CONV)
        assert a.wait("c1", 10).state == "ready"
        assert len(e.predicted_turns) == 2 and e.texts == 3 and a.ready("c1")
        assert b.seeds[0] == ("conv:c1", [], True)  # a new job replaces the conversation's cache
        assert all(len(t[0]) == 4 + 6 for _, t, _ in b.seeds[1:])  # anchor + reply
        sid, toks, addr = a.claim_warm("c1")
        assert sid and toks and addr == "here" and a.claim_warm("c1")[0] == ""
        e2 = a.submit("c2", CONV, max_tokens=5)
        a.wait("c2", 10)
        assert e2.tokens <= 5 + 1  # bounded by the job's token budget (one round may overshoot by its chunk)
        with pytest.raises(InvalidArgument):
            a.submit("", CONV)
    finally:
        a.stop()


def test_real_requests_preempt_idle_work_and_it_resumes_identically():
    ref_b = FakeBackend()
    ref = Anticipator(ref_b, config=Config(next_turns=0, reply_tokens=20, token_budget=100, warm=False)).start()
    ref.submit("c", CONV)
    ref.wait("c", 10)
    ref.stop()
    b = FakeBackend(delay=0.01)
    gate = Gate()
    a = Anticipator(b, gate, Config(next_turns=0, reply_tokens=20, token_budget=100, warm=False, quiet_s=0.02)).start()
    try:
        e = a.submit("c", CONV)
        while e.tokens < 4:
            time.sleep(0.002)
        gate.enter()  # a real request arrives
        time.sleep(0.05)
        before = b.rounds
        time.sleep(0.1)
        assert b.rounds == before and e.state == "preempted"  # no idle round runs while it is active
        gate.exit()
        a.wait("c", 10)
        assert e.state == "ready" and e.preemptions >= 1 and a.preemptions >= 1
        assert b.seeds[-1][1] == ref_b.seeds[-1][1]  # resumed from its partial output: the same text
    finally:
        a.stop()


def test_anticipation_ttl_lru_and_warm_limits():
    now = [0.0]
    b = FakeBackend()
    a = Anticipator(b, config=Config(next_turns=0, reply_tokens=2, ttl_s=5, max_conversations=2, max_warm=1),
                    clock=lambda: now[0]).start()
    try:
        for c in ("a", "b", "c"):
            a.submit(c, CONV)
            a.wait(c, 10)
        assert a.get("a") is None and a.get("c") is not None  # LRU bound
        assert len(b.warmed) == 3 and len(b.released) >= 2  # at most one warm KV session kept
        now[0] = 6.0
        assert a.get("c") is None and not a.ready("c")  # TTL
    finally:
        a.stop()


def test_parse_turns_and_gate():
    assert parse_turns("Here are two questions:\n1. What about Berlin?\n- Tell me more\n- And Rome?\n\nok\n"
                       "2) What about Berlin?", 3) == ["What about Berlin?", "And Rome?", "Tell me more"]
    g, stop = Gate(), threading.Event()
    g.enter()
    assert not g.wait_idle(0.01, stop, timeout=0.05)
    g.exit()
    assert g.wait_idle(0.01, stop, timeout=1.0)


# ---------------------------------------------------------------- calibration

def test_calibration_record_roundtrip(tmp_path, ver):
    from specmesh.drafters.model_drafters import LayerSkipDrafter
    from specmesh.cli.bench import calibrate as cal

    class FakeRuntime:
        verifier, stop_ids, dtype, model_dir = ver, [0], "fp32", "tiny"

        def encode(self, prompt):
            return [3 + len(prompt) % 50, 7, 9, 11]

    ver.self_drafters["layerskip"] = LayerSkipDrafter(ver, 1)
    rec = cal.calibrate(FakeRuntime(), [1, 2], ["a", "bb"], max_new_tokens=8, budget=3, progress=lambda *_: None)
    assert rec["exit_layer"] in (1, 2) and len(rec["results"]) == 2
    assert all(r["tau"] >= 1.0 and r["speedup"] > 0 for r in rec["results"])
    assert ver.self_drafters["layerskip"].exit_layer == 1  # restored
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(rec))
    got = cal.load_calibration("x", "fp32", str(p))
    assert got["exit_layer"] == rec["exit_layer"] and cal.speedup_of(got) == rec["speedup"]
    assert cal.speedup_of(got, 99) is None and cal.load_calibration("x", "fp32", str(tmp_path / "no.json")) is None
