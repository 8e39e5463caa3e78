"""The draft-length policy prices a draft on the verifier's measured forward-cost curve and
keeps a drafter's on/off state with the session that measured it (issue 66).

- ``VerifyCosts.round_cost``: T(k + 1) / T(1) from the rounds' verify seconds by scored
  rows, straight lines between measured row counts, not one line through a short and a
  long group (a forward's cost is not a line in its rows);
- a per-token drafter (the draft LM) picks its length on that curve and its draft cost;
- one request whose drafted rounds were slow (a short reply) does not switch the drafter
  off for the next request: what is shared between requests is the draft's cost, not what
  its rounds bought on another text;
- a drafter switched off within a request is re-probed with the length that would pay at
  the prior acceptance, not with one token (which could never show that longer drafts pay);
- a request that drafted nothing says why (``router.strategies.drafted_nothing``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specmesh.loop import AdaptiveBudget, VerifyCosts

from specmesh.router.strategies import drafted_nothing


def _curve(points: dict[int, float], t1: float = 0.010) -> VerifyCosts:
    """Costs that measured a plain round of ``t1`` and rounds of k drafts at ``points[k]``."""
    c = VerifyCosts(ema=1.0)
    for _ in range(VerifyCosts.CURVE_MIN):
        c.observe(0, t1)
        for k, t in points.items():
            c.observe(k, t)
    return c


def test_round_cost_follows_the_measured_rows_not_a_line():
    # a curve like the int8 paths': 2 rows ~1.1 forwards, 8 rows 1.5, 16 rows 2.3
    c = _curve({1: 0.011, 7: 0.015, 15: 0.023})
    assert c.round_cost(0) == 1.0
    assert c.round_cost(1) == pytest.approx(1.1)
    assert c.round_cost(7) == pytest.approx(1.5)
    assert c.round_cost(4) == pytest.approx(1.1 + 0.4 * 3 / 6)  # between rows 2 and 8
    assert c.round_cost(15) == pytest.approx(2.3)
    assert c.round_cost(20) > c.round_cost(15)  # past the last measured count: the fitted slope
    assert VerifyCosts(prior=0.06).round_cost(4) == pytest.approx(1.24)  # nothing measured: the prior line


def test_the_draft_lm_drafts_the_length_that_pays_on_the_curve():
    cheap_rows = _curve({1: 0.0105, 3: 0.011, 5: 0.0115, 7: 0.012})  # 8 rows for 1.2 forwards
    dear_rows = _curve({1: 0.012, 3: 0.016, 5: 0.021, 7: 0.026})  # 8 rows for 2.6 forwards
    picks = []
    for costs in (cheap_rows, dear_rows):
        p = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=0.8)
        p.cost = 0.15  # a draft token: 0.15 of a target forward
        picks.append(p.next())
    assert picks[0] > picks[1] > 0, picks


def test_one_slow_request_does_not_switch_the_draft_lm_off_for_the_next():
    costs = _curve({3: 0.012, 5: 0.013})
    short = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=0.8)
    short.update(0, 0, verify_s=0.010)  # its prefill round
    for _ in range(AdaptiveBudget.SPEED_MIN + 2):  # a short reply: drafts rejected, slow rounds
        short.update(4, 0, draft_s=0.006, verify_s=0.013)
        short.alpha = 0.8  # the model keeps saying drafting pays; the rounds' seconds say it does not
    assert not short.measured_pays() and short.next() == 0
    assert "drafted rounds measured" in short.off_why
    nxt = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=0.8)
    assert nxt.cost == pytest.approx(short.cost)  # the draft's measured cost carries over ...
    assert nxt.measured_pays() and nxt.next() > 0  # ... its rounds' verdict does not


def test_a_new_session_starts_from_the_drafters_acceptance_across_sessions():
    costs = _curve({3: 0.012, 5: 0.013, 7: 0.014})
    assert AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs).alpha == AdaptiveBudget.ALPHA0  # nothing seen
    good = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs)
    for _ in range(200):  # sessions whose drafts were accepted nearly whole
        good.update(6, 6, draft_s=0.003, verify_s=0.014)
    fresh = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs)
    assert fresh.alpha > 0.95 and fresh.alpha0 == fresh.alpha
    bad = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs)
    for _ in range(8):  # one short request that accepted nothing
        bad.update(4, 0, draft_s=0.002, verify_s=0.013)
    after = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs)
    assert 0.8 < after.alpha < fresh.alpha  # moved a little, not switched off
    after.update(0, 0, verify_s=0.010)  # a plain round: the unit measured afresh after the long ones
    after.cost = 0.55  # a draft token at 0.55 of a target forward: pays at this acceptance, not at 0.6
    assert after.next() > 0
    at_prior = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=AdaptiveBudget.ALPHA0)
    at_prior.cost = 0.55
    assert at_prior.next() == 0 and "no draft length pays" in at_prior.off_why
    assert AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=0.3).alpha == 0.3  # the session's own
    assert AdaptiveBudget.for_drafter("suffix", 8, costs=costs).alpha == AdaptiveBudget.ALPHA0  # per drafter


def test_the_draft_lms_prompt_prefill_is_not_the_price_of_its_tokens():
    costs = _curve({3: 0.012, 5: 0.013})
    p = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=0.9)
    p.update(4, 4, draft_s=0.4, verify_s=0.013)  # its first drafted round: the prompt's prefill as well
    assert p.cost == 0.0 and p.next() > 0
    for _ in range(3):
        p.update(4, 4, draft_s=0.014, verify_s=0.013)  # 3.5 ms a drafted token, 0.35 of a 10 ms forward
    assert 0.2 < p.cost <= 0.35 and p.next() > 0


def test_a_draft_after_rounds_without_one_is_not_the_price_of_its_tokens():
    """A re-probe after plain rounds feeds the draft LM the tokens it missed (and through the
    services it may share the CPUs with a step the verifier had decoded ahead): 6 drafts took
    255 ms instead of ~110 on the Qwen pair, and priced at that the probe never looked cheap
    enough to keep drafting."""
    costs = _curve({3: 0.012, 5: 0.013})
    p = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=0.9)
    p.update(4, 4, draft_s=0.4, verify_s=0.013)  # the first drafted round (the prompt's prefill)
    for _ in range(3):
        p.update(4, 4, draft_s=0.014, verify_s=0.013)
    steady = p.cost
    for _ in range(3):
        p.update(0, 0, verify_s=0.010)  # rounds without a draft
    p.update(4, 4, draft_s=0.1, verify_s=0.013)  # the re-probe: catching up as well
    assert p.cost == steady and p.next() > 0
    p.update(4, 4, draft_s=0.014, verify_s=0.013)  # drafting on: measured again
    assert p.cost != steady


def test_a_reprobe_that_accepts_its_whole_draft_switches_drafting_back_on():
    """Rounds of a hard opening measured drafting slower than plain decoding; the text then
    became predictable and the re-probes accepted everything: the old verdict goes, and the
    draft LM drafts again (through serve it had stayed off for the rest of the reply)."""
    costs = _curve({1: 0.0105, 3: 0.011, 5: 0.0115, 7: 0.012})
    p = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=0.9, probe_every=2)
    for _ in range(10):  # 6 drafts a round, 0 accepted, each round slower than a plain one
        p.update(6, 0, draft_s=0.03, verify_s=0.014)
    assert not p.measured_pays()
    for _ in range(50):  # rounds without a draft until the re-probe
        probe = p.next()
        if probe:
            break
        p.update(0, 0, verify_s=0.010)
    assert probe > 0
    p.update(probe, probe, draft_s=0.05, verify_s=0.012)  # the re-probe, catching up as well: all accepted
    assert p.measured_pays() and p.next() > 0


def test_a_switched_off_draft_lm_is_reprobed_with_a_draft_that_could_pay():
    costs = _curve({1: 0.0105, 3: 0.011, 5: 0.0115})
    p = AdaptiveBudget.for_drafter("draft_lm", 8, costs=costs, alpha0=0.8, probe_every=2)
    p.cost = 0.1
    p.alpha = 0.05  # the text so far accepted nothing: no length pays
    assert p.next() == 0 and "no draft length pays" in p.off_why
    assert p.next() > 1 and p.off_why == ""  # the probe drafts the length the prior acceptance would make pay


def test_a_request_that_drafted_nothing_says_why():
    plan = SimpleNamespace(drafter="draft_lm", self_draft="")
    stats = SimpleNamespace(drafted_tokens=0, rounds=10)
    off = AdaptiveBudget.for_drafter("draft_lm", 8, costs=_curve({7: 0.05}), alpha0=0.2)
    off.cost = 0.5
    assert off.next() == 0
    assert drafted_nothing(plan, stats, [off]).startswith("no draft length pays")
    asked = SimpleNamespace(asked=3, off_why="")
    assert "proposed no tokens in the 3 rounds" in drafted_nothing(plan, stats, [asked])
    assert drafted_nothing(plan, SimpleNamespace(drafted_tokens=5, rounds=10), [off]) == ""
    assert drafted_nothing(SimpleNamespace(drafter="", self_draft=""), stats, []) == ""
