"""The one draft–verify loop.

``speculative_generate`` drives any ``Drafter`` (or none: plain decoding, or an
in-verifier self drafter named by ``self_draft``) against any ``Verifier``
(in-process or a gRPC adapter) and yields the new tokens of each round. The
caller's token list is the source of truth: when the verifier lost the session
(``SessionLost``) the loop re-prefills it from the committed tokens, and when
the drafter fails the round falls back to plain decoding, so no token is lost
and greedy output never changes.

This module knows nothing about models, tokenizers or gRPC.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable, ContextManager, Iterator, Optional, Sequence

from .drafters import registry
from .seeding import round_seed
from .types import (DraftContext, GenerationStats, InvalidArgument, SamplingParams, SelfDraft, SessionLost,
                    TokenTree, VerifyRequest, VerifyResult)


BLOCK_DRAFTERS = registry.PER_ROUND  # propose a whole block in one pass: draft cost per round, not per token
MODEL_TOKEN_DRAFTERS = registry.names(cost="token")  # a model drafting token by token (the draft LM)
TREE_DRAFTERS = registry.PER_ROUND_TREES  # of those, the ones that grow a best-first tree of the budget's size


class BudgetPolicy:
    """Fixed draft budget. ``AdaptiveBudget`` adapts it from what the rounds measure."""

    uses_entropy = False  # whether ``update``'s entropy changes what ``next`` returns
    off_why = ""  # why the last ``next`` drafted nothing, in words ("" where it drafted)

    def __init__(self, budget: int):
        self.budget = budget

    def next(self) -> int:
        return self.budget

    def update(self, drafted: int, accepted: int, entropy: float = 0.0, draft_s: float = 0.0,
               verify_s: float = 0.0) -> None:
        pass

    def observe_load(self, batch: int, drafted_inside: bool = False, rows: int = 0,
                     forward_s: float = 0.0) -> None:
        """The sessions that shared the round's verify forward (the verifier's dynamic batch);
        ``drafted_inside``: the draft ran inside that forward's work (a self drafter);
        ``rows``: the rows that forward scored for all its sessions (``VerifyResult.batch_rows``,
        0: unknown) and ``forward_s`` its seconds (``VerifyResult.verify_ms``)."""

    def drafts_inside(self) -> None:
        """The generation's drafts are made in the verifier's turn (a self drafter): priced
        so from its first round, before ``observe_load`` has said so."""


class ForwardCosts:
    """The verifier's batched forward as a line in the rows it scores for all its
    sessions: t = a + b * rows, from (``VerifyResult.batch_rows``, the forward's seconds)
    of every round that reports them (each session of a batch reports its forward once).
    A least-squares fit over EMAs (weight ``ema``) of rows, t, rows^2 and rows * t; where
    the rows hardly varied (variance below ``MIN_VAR``: e.g. every session plain) the line
    cannot be told from a flat one, so the last good fit is kept (None before one, or
    before ``MIN_OBS`` observations: the caller falls back to ``VerifyCosts.beta``).
    One per verifier (``VerifyCosts.forward``). Why: alone a forward is bound by reading
    the weights (beta ~ 0.017), but a batch of several sessions' rows on 2 CPU cores is
    compute-bound, so under load a scored draft row costs nearly what another session's
    plain token does, which the per-session beta cannot see (issue 48)."""

    MIN_OBS = 8
    MIN_VAR = 1.0  # rows^2: below it (rows within ~1 of their mean) the slope is not identifiable

    def __init__(self, ema: float = 0.05):
        self.ema = ema
        self._m: Optional[tuple[float, float, float, float]] = None  # EMAs of rows, t, rows^2, rows t
        self._n = 0
        self._ab: Optional[tuple[float, float]] = None  # the last good fit
        self._lock = threading.Lock()

    def observe(self, rows: int, forward_s: float) -> None:
        if rows <= 0 or forward_s <= 0:
            return
        x, t, w = float(rows), float(forward_s), self.ema
        with self._lock:
            new = (x, t, x * x, x * t)
            self._m = new if self._m is None else tuple((1 - w) * o + w * v for o, v in zip(self._m, new))
            self._n += 1
            mx, mt, mxx, mxt = self._m
            var = mxx - mx * mx
            if self._n >= self.MIN_OBS and var >= self.MIN_VAR:
                b = max(0.0, (mxt - mx * mt) / var)
                self._ab = (max(0.0, mt - b * mx), b)

    def fit(self) -> Optional[tuple[float, float]]:
        """(a, b) in seconds and seconds per row, or None before a fit."""
        with self._lock:
            return self._ab

    def beta_load(self, sessions: float) -> Optional[float]:
        """The system's price of one scored draft row with ``sessions`` in the batch, in
        a session's share of a plain forward: b * B / (a + b * B) (a plain step costs each
        session (a + b B) / B, k draft rows cost b k; B = 1: b / (a + b), beta's meaning).
        None before a fit."""
        ab = self.fit()
        if ab is None:
            return None
        a, b = ab
        den = a + b * sessions
        return b * sessions / den if den > 0 else None


class VerifyCosts:
    """A verifier's extra cost per scored draft token (beta, in target forwards), learned
    from the rounds of every generation that shares this object — one per verifier (a
    ``Runtime``, a router), so a new request starts from what earlier ones measured
    instead of a prior. EMAs of (verify seconds, drafted) of short (k <= 2) and long
    (k >= 4) rounds, fitted by the cost model's line t(k) = t1 (1 + beta k):
    beta = (t_long - t_short) / (t_short k_long - t_long k_short), in [0, 0.5], and a
    one-token forward t1 = t_short / (1 + beta k_short); the prior until both groups were
    seen. (Short rounds are often drafted ones, k_short > 0: taking t_short for t1 and
    (t_long / t_short - 1) / (k_long - k_short) for beta would price a one-token round
    too high and a scored token too low — on an AVX2 CPU in bf16, 0.16 for a measured
    0.24 — so drafting that loses would look as if it paid.) On CPUs with bf16 matrix
    units scoring 8 tokens costs little more than 1 (beta ~ 0.01-0.02); in fp32 about
    0.12. ``forward``: the same verifier's batched forward as a line in its scored rows
    (``ForwardCosts``), which prices a draft row under load (``AdaptiveBudget.beta``);
    ``load``: the sessions its recent forwards held (an EMA over every session's rounds),
    where a new generation's ``AdaptiveBudget.load`` starts."""

    STALE = 32  # long rounds after the last short one: the unit is measured afresh (``needs_unit``)
    ACCEPT_EMA = 0.02  # a drafted round's weight in the drafter's acceptance across sessions (~50 rounds)
    CURVE_MIN = 2  # rounds of a row count before its EMA enters the curve (``round_cost``)

    def __init__(self, prior: float = 0.06, ema: float = 0.2):
        self.prior, self.ema = prior, ema
        self._groups: dict[int, tuple[float, float]] = {}  # 0 short / 1 long: EMA (seconds, k)
        self._since_short = 0  # long rounds observed since the last short one
        self._lock = threading.Lock()
        self.forward = ForwardCosts()  # t = a + b * rows of the batched forwards (shared like this object)
        self.load = 1.0  # EMA of the sessions in this verifier's forwards, every session's rounds: a new
        # generation's policy starts from it (under load its first rounds would otherwise draft as if alone)
        self.probe_gaps: dict[str, int] = {}  # drafter -> the re-probe wait its sessions' probes left
        # (``AdaptiveBudget.probe_key``): a new generation under load starts from it
        # drafter -> what its last drafted round left its session measuring (``AdaptiveBudget.learned``):
        # a new generation of that drafter starts from it, not from the priors
        self.learned: dict[str, tuple] = {}
        self._rows: dict[int, tuple[float, int]] = {}  # scored rows (drafted + 1) -> (EMA seconds, rounds)
        # drafter -> slow EMAs (accepted, accepted + rejections) of its drafted rounds over every session
        # (``ACCEPT_EMA`` a round): where a new session's acceptance starts (``AdaptiveBudget``) when its
        # caller knows none of its own
        self.accept: dict[str, tuple[float, float]] = {}

    def observe(self, drafted: int, verify_s: float) -> None:
        if verify_s > 0 and drafted >= 0:
            with self._lock:
                old = self._rows.get(drafted + 1)
                self._rows[drafted + 1] = (verify_s, 1) if old is None else \
                    ((1 - self.ema) * old[0] + self.ema * verify_s, old[1] + 1)
        group = 0 if drafted <= 2 else 1 if drafted >= 4 else None
        if group is None or verify_s <= 0:
            return
        w = self.ema
        with self._lock:
            old = self._groups.get(group)
            if group == 0 and self._since_short >= self.STALE:
                old = None  # a stale short EMA is replaced, not blended: the machine's speed moves
            self._since_short = 0 if group == 0 else self._since_short + 1
            self._groups[group] = (verify_s, drafted) if old is None else \
                ((1 - w) * old[0] + w * verify_s, (1 - w) * old[1] + w * drafted)

    def _fit(self) -> tuple[Optional[float], float]:
        """(t1 or None before a short round, beta)."""
        with self._lock:
            short, long = self._groups.get(0), self._groups.get(1)
        if short is None or short[0] <= 0:
            return None, self.prior
        (vs, ks) = short
        beta = self.prior
        if long is not None:
            vl, kl = long
            den = vs * kl - vl * ks
            if kl > ks and den > 0:
                beta = min(0.5, max(0.0, (vl - vs) / den))
        return vs / (1 + beta * ks), beta

    @property
    def needs_unit(self) -> bool:
        """Long rounds were measured but no short one, or none for ``STALE`` long rounds: the
        long rounds' times alone cannot separate a one-token forward from a scored token's
        cost (``beta`` stays at its prior), and an old short EMA no longer says what a plain
        round costs (measured on 2 Xeon cores: a short EMA of 10.5 ms taken in a slow minute
        against 5-6 ms plain rounds later fitted beta 0 and kept a losing block drafter on
        for a whole request, 0.81x plain decoding)."""
        with self._lock:
            return 1 in self._groups and (0 not in self._groups or self._since_short >= self.STALE)

    @property
    def short_seconds(self) -> Optional[float]:
        """A one-token forward's seconds (the cost model's unit): the short rounds' EMA
        less their drafted tokens' share; None before a short round."""
        return self._fit()[0]

    @property
    def beta(self) -> float:
        with self._lock:
            if len(self._groups) < 2:
                return self.prior
        return self._fit()[1]

    def observe_accept(self, key: str, accepted: int, fails: int, start: float) -> None:
        """A drafted round of drafter ``key`` into its acceptance across sessions (from
        ``start`` at its first round)."""
        g = self.ACCEPT_EMA
        with self._lock:
            a, t = self.accept.get(key, (start, 1.0))
            self.accept[key] = ((1 - g) * a + g * accepted, (1 - g) * t + g * (accepted + fails))

    def prior_alpha(self, key: Optional[str]) -> Optional[float]:
        """The drafter's acceptance across sessions (a new session's start), None before
        its first drafted round."""
        with self._lock:
            a, t = self.accept.get(key, (0.0, 0.0)) if key is not None else (0.0, 0.0)
        return a / t if t > 0 else None

    def round_cost(self, k: int) -> float:
        """A verify of k drafted tokens (k + 1 scored rows) in plain rounds: T(k + 1) / T(1)
        on this verifier's measured curve. The curve is the rounds' verify seconds by scored
        rows (EMAs, each row count once seen ``CURVE_MIN`` times), joined by straight lines
        from a one-token forward (``short_seconds``) and continued past the last measured
        count at the fitted beta; before any of that, 1 + beta k. A forward's cost is not a
        line in its rows (on the int8 paths 2 rows cost ~1.1 forwards, 8 ~1.5-2.4 by the
        CPU's path): the line through a short and a long group priced the rows between
        them wrongly, and drafts of the wrong length were chosen."""
        if k <= 0:
            return 1.0
        t1, beta = self._fit()
        with self._lock:
            pts = sorted((r, t) for r, (t, n) in self._rows.items() if n >= self.CURVE_MIN)
        if pts and pts[0][0] == 1:  # plain rounds measured: their own seconds are the unit
            t1, pts = pts[0][1], pts[1:]
        if t1 is None or t1 <= 0 or not pts:
            return 1 + beta * k
        rows = k + 1
        x0, y0 = 1, t1
        for x1, y1 in pts:
            if rows <= x1:
                return max(1.0, (y0 + (y1 - y0) * (rows - x0) / (x1 - x0)) / t1)
            x0, y0 = x1, y1
        return max(1.0, y0 / t1 + beta * (rows - x0))


@dataclass
class TreeSchedule:
    """Entropy-switched tree budgets (after EntMTP): per bin of the target's entropy
    where it predicted the pending token (the last round's ``VerifyResult.entropy``),
    the τ that best-first trees of each node budget reached on held-out text
    (``specmesh tree-study``, stored as ``tree_schedule.json`` next to the block
    drafter). ``budget`` picks the node count maximising τ / (1 + c + beta n) with the
    caller's live costs (0: drafting does not pay in this bin)."""

    edges: list[float]  # interior bin edges, ascending (nats)
    taus: list[dict[int, float]]  # per bin: node budget -> τ

    def _row(self, entropy: float) -> dict[int, float]:
        return self.taus[min(sum(entropy >= e for e in self.edges), len(self.taus) - 1)]

    def budget(self, entropy: float, c: float, beta: float, cap: int, scale: float = 1.0) -> int:
        """``scale``: the caller's live correction of the table's accepted tokens (τ - 1),
        served / offline (``AdaptiveBudget.tau_scale``)."""
        best, best_n = 1.0, 0
        for n, tau in sorted(self._row(entropy).items()):
            tau = 1 + scale * (tau - 1)
            if 0 < n <= cap and tau / (1 + c + beta * n) > best + 1e-12:
                best, best_n = tau / (1 + c + beta * n), n
        return best_n

    def tau(self, entropy: float, n: int) -> float:
        """The table's τ for a draft of n nodes in this entropy's bin (the largest measured
        budget not above n; 1.0 below them all)."""
        row = self._row(entropy)
        fit = [b for b in row if b <= n]
        return row[max(fit)] if fit else 1.0

    def to_dict(self) -> dict:
        return {"edges": self.edges, "taus": [{str(n): t for n, t in r.items()} for r in self.taus]}

    @classmethod
    def from_dict(cls, d: dict) -> "TreeSchedule":
        return cls([float(e) for e in d["edges"]], [{int(n): float(t) for n, t in r.items()} for r in d["taus"]])


class AdaptiveBudget(BudgetPolicy):
    """Draft length from the cost model in docs/design.md ("Adaptive draft length: the cost model").

    With per-token acceptance alpha (EMA of accepted / EMA of accepted + rejections), a
    chain of k drafts yields E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per round,
    at a cost of 1 + k * (c + beta) target forwards, where c = measured draft time per
    drafted token / verify time, and beta the extra verify cost per scored token.
    Pick k in [0, max_budget] maximising E(k) / cost(k). When no k pays (speedup
    < 1) drafting is switched off, re-probed with one round after ``probe_every``
    off rounds so a session whose text turns repetitive picks it back up; each probe
    that leaves it off doubles the wait, up to ``PROBE_BACKOFF`` x ``probe_every``
    (a probe of a one-pass drafter costs a draft and a full verify: on open text,
    where nothing pays, probing every 8 rounds cost ~5% of plain decoding). Every
    drafter is also held to what its rounds measured: when drafted rounds cost more
    seconds per committed token than a plain round (``measured_pays``), drafting is off
    whatever the model says (its acceptance EMAs lag, it leaves out the round's
    bookkeeping, and a verify's cost is not linear in its rows: on the int4 engine two
    rows cost ~1.2 forwards, eight ~1.6-1.9), re-probed as above (before 2026-12-05 only
    one-pass drafters were; in a same-process A/B on int4, 6 prompts each, prompt lookup
    and suffix decoding stayed within noise of the old policy: open writing 0.95 / 1.01x
    plain decoding against 0.97 / 0.96x, code edits 1.54 / 1.86x against 1.52 / 1.84x; the
    draft LM on open writing 0.85 / 0.88x against 0.92 / 0.80x in two runs).
    Every round's verify time feeds ``costs`` (a plain round's time is the unit the
    guard compares with). High target
    entropy at the last round shortens the draft (entropy-guided scheduling).

    ``per_round_draft``: the drafter proposes a whole block in one pass (the block
    drafter), so its cost is per round, not per token: c = draft seconds per round /
    verify seconds and cost(k) = 1 + c + k * beta for k > 0; beta is measured from
    short vs long rounds' verify times in ``costs`` (pass the verifier's shared
    ``VerifyCosts`` so it carries over between requests); E(max_budget) is the accepted
    length measured on full-block rounds, refreshed with a full block after
    ``probe_every`` shorter rounds, each refresh that leaves the draft shorter doubling
    that wait (up to ``PROBE_BACKOFF`` x); drafting that was switched off is re-probed
    with a full block while one is cheap to verify (``max_budget * beta <=
    TREE_CHEAP``), else with the length that pays best at the prior acceptance
    ``alpha0`` (``_probe_size``); no entropy cap (a shorter block saves no drafting). ``tree`` (with
    ``per_round_draft``): while verifying the full tree costs at most ``TREE_CHEAP`` of
    a forward more than verifying none (max_budget * beta; bf16 matrix units), the
    draft is the full budget or nothing — extra best-first tree nodes accept more than
    the chain model credits them with, so it would under-draft; drafting is on while
    some length pays (the chain model at shorter lengths — a lower bound for the tree —
    or the measured full-budget acceptance). Where scored tokens are dear (fp32 on a
    CPU: beta ~ 0.12) the chain model's length is kept: a full tree would not pay.
    ``schedule`` (tree drafters): the node budget follows the target's entropy at the
    last round through a ``TreeSchedule`` measured offline, with the live costs, capped
    at ``max_budget`` (drafting that was switched off is re-probed the same way). The
    table's accepted tokens are scaled by ``tau_scale`` = EMA(accepted) / EMA(the
    table's τ - 1 for the drafted size and bin) over the drafted rounds, so a drafter
    that accepts less in serving than on held-out text (a shorter context, another
    engine's numerics) drafts only where that still pays. For one-pass drafters c is
    the draft's seconds over a short round's verify seconds (``VerifyCosts``: about a
    one-token forward, the cost model's unit), not over the drafted round's.
    Where the shared ``costs`` have long rounds but no short round's time (none yet, or
    none for ``VerifyCosts.STALE`` long rounds), the policy first asks for one plain
    round (``VerifyCosts.needs_unit``), and c is over that one-token forward for every
    drafter (until 2026-12-06 per-token drafters had neither: a draft LM that drafts
    every round never measured a plain round, so ``measured_pays`` could not switch it
    off, and its c over the drafted round's verify priced a draft token ~3x too low:
    through the services with the Qwen pair on open writing, one core each, it drafted
    6 a round at tau 2.35 and ran at 0.47-0.52x plain decoding). A tree drafting full blocks would
    otherwise price a scored token at the prior beta and measure its rounds against no
    plain round (int4 on 2 Xeon cores: a first request drafted all 69 rounds at 0.60x
    plain decoding; in a same-process A/B over four workloads the block tree went
    0.94 / 0.92 / 0.83 / 0.89x -> 1.10 / 0.91 / 0.92 / 0.91x plain decoding on
    code_write / reasoning / open_writing / chat_multiturn).
    Under load (``observe_load``: the verifier batched this session's forwards with
    others) a scored token costs beta times the sessions in the forward, the delay it
    adds to all of them, and so does a self drafter's draft pass (it runs in the
    verifier's turn): drafting shrinks, then stops, as the batches grow (a concurrency
    sweep through the services: speculation must not cost the other streams more than it
    buys this one). From a load of ``LOAD_PRICED`` on, a scored row is priced at least
    at what it costs the whole batch (``ForwardCosts.beta_load``, fitted from the batched
    forwards' rows and times): beta measured alone (a memory-bound forward, ~0.017) times
    the load priced 4 streams of ``self:block_tree`` at break-even on 2 CPU cores, where
    the batched forward is compute-bound and the streams ran at 0.70-0.74x plain decoding
    (issue 48). A lone stream (load ~1) is priced as before.
    ``probe_key`` (the drafter's name; ``for_drafter`` sets it): the re-probe wait is shared
    through ``costs.probe_gaps`` — each probe writes the doubled wait there, drafting that
    pays resets it — and a generation that starts under load (``LOAD_PRICED``) waits that
    long before its first probe instead of ``probe_every``: requests of 64 tokens each
    probed 2-3 times (a full tree, in the verifier's turn, and on the services the round
    leaves the Decode stream, missing the batch the others are in) to learn again what the
    sessions before them had learned. A probe only re-measures acceptance, so none is made
    where the costs alone rule drafting out (the probe's draft would not pay accepted
    whole: 16 streams of ``self:block_tree`` on 2 cores, where a scored row costs a
    session several plain rounds of wall time, still probed 3-4 times a request).
    ``for_drafter`` picks these settings by drafter name."""

    TREE_CHEAP = 0.5  # bf16 on CPU matrix units: 8 x 0.01-0.03; fp32 on a CPU: 8 x 0.12
    ALPHA0 = 0.6  # a session's starting acceptance where nothing was measured
    PROBE_BACKOFF = 4  # re-probes of switched-off drafting: every probe_every rounds, up to 4x that apart
    SPEED_EMA = 0.1  # the measured seconds per token of drafted rounds (~10 rounds)
    SPEED_MIN = 8  # ... from this many drafted rounds on

    def __init__(self, max_budget: int = 8, beta: float = 0.06, ema: float = 0.3, probe_every: int = 8,
                 alpha0: Optional[float] = None, entropy_scale: float = 3.0, per_round_draft: bool = False,
                 costs: Optional[VerifyCosts] = None, tree: bool = False,
                 schedule: Optional[TreeSchedule] = None, probe_key: Optional[str] = None, load: float = 1.0,
                 catches_up: bool = False):
        """``catches_up``: a per-token drafter that runs a model, so a round after rounds
        without a draft also feeds it the tokens it missed (``update``)."""
        super().__init__(max_budget)
        self.catches_up = catches_up and not per_round_draft
        self.schedule = schedule
        self.per_round_draft = per_round_draft
        self.tree = tree and per_round_draft
        self.costs = costs if costs is not None else VerifyCosts(beta, ema)
        if alpha0 is None:  # the caller knows no acceptance of this session's: the drafter's across sessions
            prior = self.costs.prior_alpha(probe_key)
            alpha0 = self.ALPHA0 if prior is None else prior
        self.max_budget = max_budget
        self.ema, self.probe_every = ema, probe_every
        self.alpha = alpha0
        self._acc, self._tot = alpha0, 1.0  # EMAs of accepted and accepted + rejections per round
        self.full_accepted: Optional[float] = None  # per_round_draft: EMA of accepted on full-block rounds
        self.cost = 0.0  # draft seconds per drafted token (per round: per_round_draft) / verify seconds
        self.entropy = 0.0
        self.entropy_scale = entropy_scale
        self.off_rounds = 0
        self._probe_gap = probe_every  # off rounds before the next re-probe
        self.short_rounds = 0
        self._refresh_gap = probe_every  # short rounds before the next full block (per_round_draft)
        self.alpha0 = alpha0
        self.last_speedup = 1.0
        self._seen, self._pred = 1.0, 1.0  # schedule: EMAs of accepted and of the table's τ - 1
        # drafted rounds: EMAs of their verify's seconds over a plain round's (at the time), of their draft's
        # seconds and of their tokens, and their count (``measured_pays``)
        self._spd = (0.0, 0.0, 0.0, 0)
        self._updates = 0
        self._after_draft = False  # the last round ``update`` saw drafted (the drafter's context is current)
        self._drafted_rounds = 0  # rounds that drafted (``update``)
        self._pending: Optional[float] = None  # the table's τ - 1 for the round in flight
        # EMA of the sessions in this session's verify forwards (``observe_load``), from the verifier's
        # recent load, or the caller's count of sessions decoding now where that is more (a burst of
        # requests arrives while the EMA still says the quiet before it): a request arriving under load
        # prices its first rounds' drafts as loaded (in a concurrency sweep of 64-token requests, a fresh
        # policy at load 1 drafted full trees for its first rounds at every stream count; with the EMA
        # alone, 16 requests starting together each drafted their first rounds at load 1, then 5.5)
        self.load = max(1.0, self.costs.load, load)  # ``load``: the caller's count of sessions decoding now
        self.draft_load = 1.0  # the same where the draft runs in the verifier's turn (self drafters), else 1
        self.probe_key = probe_key
        if probe_key is not None and self.load > self.LOAD_PRICED:
            self._probe_gap = self.costs.probe_gaps.get(probe_key, probe_every)
        if probe_key is not None and probe_key in self.costs.learned:
            if per_round_draft:
                self.learned = self.costs.learned[probe_key]
            else:  # the draft's cost is the drafter's; what its rounds bought is this session's text
                self.cost = self.costs.learned[probe_key][0]
        self.off_why = ""  # why the last ``next`` drafted nothing ("" where it drafted)
        self.asked = 0  # rounds ``next`` asked for a draft

    @classmethod
    def for_drafter(cls, drafter: Optional[str], max_budget: int, costs: Optional[VerifyCosts] = None, **kw):
        """The policy for a drafter by name: block drafters (``BLOCK_DRAFTERS``) cost per
        round, their tree variant drafts all or nothing, and their acceptance EMAs are slow
        (0.1: one rejected round says little about the next when a draft costs ~0.15 of a
        forward); the others keep the per-token model."""
        kw.setdefault("probe_key", drafter)
        if drafter in BLOCK_DRAFTERS:
            kw.setdefault("ema", 0.1)
            kw.update(per_round_draft=True, tree=drafter in TREE_DRAFTERS)
        if drafter not in TREE_DRAFTERS:
            kw.pop("schedule", None)
        kw.setdefault("catches_up", drafter in MODEL_TOKEN_DRAFTERS)
        return cls(max_budget, costs=costs, **kw)

    LOAD_EMA = 0.3  # the verify forwards' batch size (~3 rounds)
    LOAD_PRICED = 1.2  # from this load on a scored row costs at least its share of the batched forward

    def extra(self, k: int) -> float:
        """What scoring k drafted tokens adds to a round, in one-token forwards of this
        session: the verifier's measured curve (``VerifyCosts.round_cost``) less the plain
        round, times the sessions sharing its forwards (``load``): a batched forward made
        longer by my drafts delays every session in it, so under load a draft must buy that
        many times more to raise the verifier's total tokens/s. Above ``LOAD_PRICED``, once
        the verifier's batched forwards were fitted (``costs.forward``), at least k b B / (a
        + b B) with B = ``load``: a compute-bound batch (a small) prices a row near a whole
        plain step, so drafting stops."""
        if k <= 0:
            return 0.0
        own = (self.costs.round_cost(k) - 1.0) * self.load
        if self.load > self.LOAD_PRICED:
            shared = self.costs.forward.beta_load(self.load)
            if shared is not None:
                return max(own, k * shared)
        return own

    @property
    def beta(self) -> float:
        """The mean cost of a scored token over the full budget (``extra(max_budget) /
        max_budget``): what the tree rules and the schedule price a node at."""
        return self.extra(self.max_budget) / max(1, self.max_budget)

    def drafts_inside(self) -> None:
        self.draft_load = self.load

    def observe_load(self, batch: int, drafted_inside: bool = False, rows: int = 0,
                     forward_s: float = 0.0) -> None:
        self.load = (1 - self.LOAD_EMA) * self.load + self.LOAD_EMA * max(1, batch)
        self.costs.load = (1 - self.LOAD_EMA) * self.costs.load + self.LOAD_EMA * max(1, batch)
        self.draft_load = self.load if drafted_inside else 1.0
        if rows > 0 and forward_s > 0:
            self.costs.forward.observe(rows, forward_s)

    @property
    def uses_entropy(self) -> bool:
        """The entropy caps per-token drafters' length and picks a schedule's tree size;
        a one-pass block without a schedule ignores it."""
        return not self.per_round_draft or (self.tree and self.schedule is not None)

    @property
    def tau_scale(self) -> float:
        """Served / offline accepted tokens on the schedule's drafted rounds (1.0 before any)."""
        return min(1.5, max(0.0, self._seen / self._pred)) if self._pred > 0 else 1.0

    def expected_speedup(self, k: int, alpha: Optional[float] = None, measured_full: bool = True) -> float:
        """E(k) / cost(k) at the acceptance EMA (or ``alpha``); one-pass drafters' full
        block uses its measured accepted length unless ``measured_full`` is False."""
        a = min(max(self.alpha if alpha is None else alpha, 1e-3), 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        if self.per_round_draft:
            if k == self.max_budget and measured_full and self.full_accepted is not None:
                tokens = 1 + self.full_accepted
            return tokens / (1 + (self.cost * self.draft_load if k > 0 else 0.0) + self.extra(k))
        return tokens / (1 + k * self.cost * self.draft_load + self.extra(k))

    def next(self) -> int:
        k = self._next()
        self.asked += k > 0
        if k > 0:
            self.off_why = ""
        return k

    def _next(self) -> int:
        if self.costs.needs_unit:  # no plain round's time, or a stale one: this round measures
            self.off_why = "a plain round measured the verifier's unit cost"
            return 0  # it (class docstring; at most one in STALE + 1)
        cap = self.max_budget
        if self.entropy > 0 and not self.per_round_draft:  # entropy-guided: at high entropy draft shorter
            # (not for one-pass block drafters: their draft costs the same at any length)
            cap = max(1, min(cap, int(round(self.max_budget * self.entropy_scale / (self.entropy_scale + self.entropy)))))
        best_k, best = 0, 1.0
        for k in range(1, cap + 1):
            s = self.expected_speedup(k)
            if s > best + 1e-9:
                best_k, best = k, s
        self.last_speedup = best
        self._pending = None
        if self.tree and self.schedule is not None:
            best_k = self.schedule.budget(self.entropy, self.cost * self.draft_load, self.beta, self.max_budget,
                                          self.tau_scale)
        elif self.tree and best_k and self.max_budget * self.beta <= self.TREE_CHEAP:
            best_k = self.max_budget  # a tree whose full size is cheap to verify: its full budget or nothing
        if best_k and not self.measured_pays():  # the model says it pays; the rounds say it does not
            best_k = 0
            self.off_why = self._slow_why()
        elif best_k == 0:
            self.off_why = self._cost_why(cap)
        if best_k == 0:
            self.off_rounds += 1
            if self.off_rounds >= self._probe_gap:  # re-probe; each probe that finds it still off waits twice as long
                self.off_rounds = 0
                self._probe_gap = min(2 * self._probe_gap, self.PROBE_BACKOFF * self.probe_every)
                self._share_gap()
                best_k = self._probe_size()
                if self.expected_speedup(best_k, 0.999, False) <= 1.0:
                    self.off_why = self._cost_why(cap, whole=True)
                    return 0  # not even a draft accepted whole would pay at these costs: nothing to learn
                self._predict(best_k)
                return best_k
            return 0
        self.off_rounds = 0
        self._probe_gap = self.probe_every
        self._share_gap()  # it pays for this session: the others re-probe at the usual rate
        self._predict(best_k)
        if self.per_round_draft and self.schedule is None:
            if best_k == self.max_budget:
                self._refresh_gap = self.probe_every
            else:  # keep the full block's measured acceptance fresh; each refresh that leaves
                # it shorter waits twice as long (a full block costs 1 + c + max_budget beta)
                self.short_rounds += 1
                if self.short_rounds >= self._refresh_gap:
                    self.short_rounds = 0
                    self._refresh_gap = min(2 * self._refresh_gap, self.PROBE_BACKOFF * self.probe_every)
                    return self.max_budget
        return best_k

    def _cost_why(self, cap: int, whole: bool = False) -> str:
        """Why the cost model finds no draft length that pays, in its own numbers."""
        k = max(1, min(cap, self.max_budget))
        rows = f"a round of {k} drafts costs {1 + self.extra(k):.2f} plain rounds"
        draft = (f", the draft {self.cost * self.draft_load:.2f} of a forward" +
                 ("" if self.per_round_draft else " per token")) if self.cost > 0 else ""
        acc = "even accepted whole" if whole else f"at acceptance {self.alpha:.2f}"
        return f"no draft length pays {acc} ({rows}{draft})"

    def _slow_why(self) -> str:
        spt, plain = self.drafted_spt, self.costs.short_seconds
        if spt is None or plain is None:
            return "its drafted rounds measured slower than plain rounds"
        return (f"its drafted rounds measured {spt * 1e3:.1f} ms a token against {plain * 1e3:.1f} ms for a "
                "plain round")

    @property
    def learned(self) -> tuple:
        """What the drafted rounds measured that is the drafter's and the verifier's more
        than this request's: the draft's cost (``cost``), the served / offline acceptance
        of a schedule (``tau_scale``'s EMAs), the drafted rounds' seconds per token
        (``drafted_spt``'s EMAs and count) and the full block's accepted length. Shared by
        ``probe_key`` through ``costs.learned`` (each drafted round writes it, a new
        generation starts from it): with fresh priors every request of a 4-stream sweep of
        ``self:block_tree`` drafted its first 8-16 rounds (a draft pass priced free until
        its EMA caught up, the offline table trusted, the seconds-per-token guard not yet
        armed) at 0.7 accepted a round, 20% of its rounds, while the batch's forward slowed
        for every stream (0.85-0.90x plain decoding through the services). The acceptance
        EMAs stay the request's own: the router starts them from the session's history, a
        session without one from the drafter's acceptance across sessions
        (``VerifyCosts.prior_alpha``, a slow EMA of every session's drafted rounds, so one
        short request moves it a little; a fixed low prior would price a dear drafter, a
        draft LM, out of every new request however well its sessions accept)."""
        return self.cost, self._seen, self._pred, self._spd, self.full_accepted

    @learned.setter
    def learned(self, v: tuple) -> None:
        self.cost, self._seen, self._pred, self._spd, self.full_accepted = v

    def _share_gap(self) -> None:
        if self.probe_key is not None:
            self.costs.probe_gaps[self.probe_key] = self._probe_gap

    def _probe_size(self) -> int:
        """The draft of a re-probe: a one-pass drafter its full block while that is cheap
        to verify (``max_budget * beta <= TREE_CHEAP``: it drafts the same at any length);
        else, and for per-token drafters, the length that would pay best at the prior
        acceptance ``alpha0`` (bf16 on an AVX2 CPU, beta ~ 0.24: 2, not a full block
        costing ~3.3 forwards). A per-token drafter probed with one token could not show
        that its longer drafts pay: a round of 1 token buys at most 2, and a draft LM
        switched off by one short request's rounds stayed off for every later one."""
        if self.per_round_draft and self.max_budget * self.beta <= self.TREE_CHEAP:
            return self.max_budget
        a = max(self.alpha, self.alpha0)
        return max(range(1, self.max_budget + 1), key=lambda k: (self.expected_speedup(k, a, False), -k))

    @property
    def drafted_spt(self) -> Optional[float]:
        """Seconds per committed token of the drafted rounds (draft and verify; EMAs of
        seconds and of tokens, weight ``SPEED_EMA``; after the first round), once
        ``SPEED_MIN`` were measured; else None."""
        dv, d, tok, n = self._spd
        plain = self.costs.short_seconds or 0.0
        return (plain + dv + d) / tok if n >= self.SPEED_MIN and tok > 0 else None

    def measured_pays(self) -> bool:
        """False once drafted rounds cost the verifier more seconds than the tokens they
        bought, each at a plain round's seconds (``VerifyCosts.short_seconds``); True
        before both are measured. Alone that is ``drafted_spt`` <= a plain round. Under
        load the seconds a drafted round adds over a plain one are waited by every
        session of its forward: its longer verify by all ``load`` of them, its draft by
        all where it runs in the verifier's turn (``draft_load``: self drafters), else by
        this session only. So it pays only where load x (verify - plain) + draft_load x
        draft <= plain x (tokens - 1), verify - plain being kept as measured against the
        plain round of its time (a drafter's next generation starts from these, ``learned``,
        and a load that has passed leaves the extra seconds, not the loaded ones). Per
        session alone, 4 streams of ``self:block_tree`` on 2 cores measured drafted rounds
        at 15.8 ms a token against 18 ms for a plain round and kept drafting, while each
        such round (+11 ms for 0.9 tokens) held up three other sessions: 0.85-0.90x plain
        decoding in total."""
        plain = self.costs.short_seconds
        dv, d, tok, n = self._spd
        if plain is None or n < self.SPEED_MIN or tok <= 0:
            return True
        return self.load * dv + self.draft_load * d <= plain * (tok - 1)

    def _predict(self, n: int) -> None:
        if self.tree and self.schedule is not None:
            self._pending = self.schedule.tau(self.entropy, n) - 1

    def update(self, drafted: int, accepted: int, entropy: float = 0.0, draft_s: float = 0.0,
               verify_s: float = 0.0) -> None:
        self.entropy = entropy
        self._updates += 1
        if verify_s > 0:
            self.costs.observe(drafted, verify_s)
        pending, self._pending = self._pending, None
        after_draft, self._after_draft = self._after_draft, drafted > 0
        if drafted <= 0:
            return
        fails = 1 if accepted < drafted else 0
        w = self.ema
        # what the round bought (not the first round: it carries the prefill; nor, for a drafter that
        # ``catches_up``, a round after rounds without a draft: it feeds the drafter's model the tokens it
        # missed, a cost drafting on does not pay); a ratio of EMAs (an EMA of per-round ratios would be
        # biased high: a round accepting 0 costs its seconds for 1 token)
        if self.catches_up and not after_draft and self._updates > 1 and accepted >= drafted:
            # a re-probe accepted its whole draft: the text has changed since the rounds that switched
            # drafting off, so their verdict is dropped and the rounds from here on make a new one (kept,
            # a hard opening's verdict would hold the drafter off however well the probes did)
            self._spd = (0.0, 0.0, 0.0, 0)
        elif verify_s > 0 and self._updates > 1 and (after_draft or not self.catches_up):
            dv, d, tok, n = self._spd
            g = self.SPEED_EMA if n else 1.0
            extra = verify_s - (self.costs.short_seconds or verify_s)  # over a plain round now
            self._spd = ((1 - g) * dv + g * extra, (1 - g) * d + g * draft_s, (1 - g) * tok + g * (accepted + 1),
                         n + 1)
        if pending is not None:  # the schedule's prediction for this round against what it accepted
            self._seen = (1 - w) * self._seen + w * accepted
            self._pred = (1 - w) * self._pred + w * pending
        # alpha = EMA(accepted) / EMA(accepted + rejections): the geometric acceptance's
        # estimate from recent rounds (an EMA of per-round ratios would be biased low:
        # every fully rejected round counts 0 whatever the others accepted)
        if self.probe_key is not None:
            self.costs.observe_accept(self.probe_key, accepted, fails, self.alpha0)
        self._acc = (1 - w) * self._acc + w * accepted
        self._tot = (1 - w) * self._tot + w * (accepted + fails)
        self.alpha = self._acc / self._tot if self._tot > 0 else self.alpha
        if self.per_round_draft and drafted >= self.max_budget:
            self.full_accepted = accepted if self.full_accepted is None else \
                (1 - w) * self.full_accepted + w * accepted
        # a per-token drafter's cost from its second drafted round on (its first propose of a session feeds
        # it the whole context: a draft LM prefills the prompt), and for one that ``catches_up`` only from
        # rounds right after a drafted one (a round after rounds without a draft feeds it the tokens it
        # missed); counted, those price its tokens at several times their cost and switch drafting off
        # for good, a re-probe never looking cheap enough
        self._drafted_rounds += 1
        settled = after_draft if self.catches_up else self._drafted_rounds > 1
        if verify_s > 0 and (self.per_round_draft or settled):
            per = draft_s if self.per_round_draft else draft_s / drafted
            unit = self.costs.short_seconds or verify_s  # a one-token forward, once measured
            self.cost = (1 - w) * self.cost + w * per / unit
        if self.probe_key is not None:
            self.costs.learned[self.probe_key] = self.learned


def validate_request(prompt_ids: Sequence[int], max_new_tokens: int, vocab_size: int,
                     max_new_limit: Optional[int] = None) -> None:
    if not prompt_ids:
        raise InvalidArgument("prompt", "is empty")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InvalidArgument("max_new_tokens", f"must be a positive integer, got {max_new_tokens!r}")
    if max_new_limit is not None and max_new_tokens > max_new_limit:
        raise InvalidArgument("max_new_tokens", f"{max_new_tokens} exceeds the limit {max_new_limit}")
    for t in prompt_ids:
        if not isinstance(t, int) or t < 0 or t >= vocab_size:
            raise InvalidArgument("prompt_ids", f"token id {t!r} outside [0, {vocab_size})")


@dataclass
class LoopOptions:
    """What one generation asks of the loop (everything but the parties and the prompt).

    ``budget``: a fixed draft size or a ``BudgetPolicy``. ``self_draft``: the verifier
    drafts with this in-verifier drafter (``drafter`` is then unused). ``on_drafter_error``:
    called with the exception of a failed ``propose``; returning False stops drafting
    for the rest of the generation. ``max_new_limit``: the caller's cap on
    ``max_new_tokens`` (INVALID_ARGUMENT above it). ``round_scope(index)``: entered
    around each round (index 0 is the prefill) — drafting and verifying run inside it,
    so a tracing span opened there parents the RPCs — and the dict it yields is filled
    with the round's facts: drafted, accepted, depth, tree_size, draft_ms, verify_ms
    (server side), wall_ms, batch_size, prefill (and on the prefill cached_tokens and
    computed_tokens: its prompt tokens the verifier's prefix cache held, and the others). ``draft_first``: the first round
    drafts too (worth it when the verifier already holds most of the prompt, e.g. a
    resumed session); it still counts as the prefill, so its drafts are not in the
    round counters (tau, histograms). ``draft_ahead``: an ``ahead.OverlapPolicy`` (the
    budget policy's overlap half; None: off); with a drafter that can draft ahead
    (``propose_ahead``: ``ahead.AheadDrafter`` in process, ``RemoteDrafter`` over gRPC),
    each round asks it, before the verify, to draft the next round for the likely
    outcomes; the facts then add ahead (hit / miss:<why> / off), ahead_ms, wasted
    and the drafter's and verifier's busy and idle ms. ``resumed``: the last ``resumed`` of the prompt ids
    are output an earlier, interrupted run of this request already delivered (a resumed
    generation): they count toward ``max_new_tokens`` and are not prompt to the drafter,
    and the first round drafts like any other after a prefill of all but the last token
    (``_Generation.prefill_resumed``), so from a round boundary of the interrupted run
    the rounds are its rounds (every draw is keyed by the absolute committed length:
    ``seeding``)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop_ids: Sequence[int] = ()
    session_id: Optional[str] = None
    budget: int | BudgetPolicy = 6
    self_draft: Optional[str] = None
    on_drafter_error: Optional[Callable] = None
    max_new_limit: Optional[int] = None
    round_scope: Optional[Callable[[int], ContextManager[dict]]] = None
    draft_first: bool = False
    draft_ahead: Optional[object] = None  # an ahead.OverlapPolicy: draft the next round during the verify
    resumed: int = 0
    # called with the ``TokenLogprob`` of each token a round emits (sampling.logprobs >= 0), before the
    # round's tokens are yielded
    on_logprobs: Optional[Callable[[list], None]] = None
    # a grammar's forced tokens are drafted for free in every round (jump-forward; VerifyRequest.jump_forward)
    jump_forward: bool = True
    # the drafter drafts its argmax (a one-hot draft) even where the request samples: the verifier then
    # emits the target's own draws by position (``acceptance.match_tree``), so the output of a seeded
    # request does not depend on the drafter, the draft sizes or the strategy (the router's ``auto``).
    # Not for a self drafter: it drafts in the verifier with the request's sampling
    one_hot_drafts: bool = False


@dataclass
class _Round:
    """One round in flight: the draft, its timing, the verify result."""

    tree: TokenTree = field(default_factory=TokenTree)
    draft_s: float = 0.0
    self_draft: Optional[SelfDraft] = None
    result: Optional[VerifyResult] = None
    wall_s: float = 0.0  # the verify call's wall time
    want: int = 0  # the budget asked of the drafter
    ahead: Optional[object] = None  # how the draft was obtained (ahead.AheadInfo), when the drafter says
    ahead_asked: bool = False  # this round asked the drafter to draft the next one ahead


class _Generation:
    """The state of one generation: committed tokens (the source of truth), what the
    verifier holds, counters. ``draft`` / ``verify`` / ``record`` / ``commit`` are the
    steps of a round."""

    def __init__(self, drafter, verifier, prompt_ids: list[int], o: LoopOptions, stats: GenerationStats):
        self.drafter, self.verifier, self.o, self.stats = drafter, verifier, o, stats
        self.prompt_len = len(prompt_ids) - o.resumed
        self.tokens = list(prompt_ids)  # committed: prompt + generated; tokens[-1] is pending after the first round
        self.kv_len = 0  # how many of ``tokens`` the verifier holds
        self.n_new = o.resumed  # a resumed generation counts from the original start
        self.first = True
        self.drafter_ok = drafter is not None
        self.policy = o.budget if isinstance(o.budget, BudgetPolicy) else BudgetPolicy(int(o.budget))
        if o.self_draft is not None:
            self.policy.drafts_inside()
        self.sid = o.session_id or uuid.uuid4().hex
        self.stops = set(o.stop_ids)
        self.t_start = time.perf_counter()
        # what the drafter is told the request samples with (``LoopOptions.one_hot_drafts``: greedy)
        self.draft_sampling = replace(o.sampling, temperature=0.0) if o.one_hot_drafts else o.sampling

    def draft(self, rs: int) -> _Round:
        """Ask the policy for a size and the drafter (or the verifier's self drafter) for a draft."""
        rnd = _Round()
        if self.first and not (self.o.draft_first or self.o.resumed) and self.o.self_draft not in registry.FUSED:
            return rnd
        want = max(0, min(self.policy.next(), self.o.max_new_tokens - self.n_new - 1))
        if want > 0 and self.o.self_draft is not None:
            rnd.self_draft = SelfDraft(self.o.self_draft, want)
        elif want > 0 and self.drafter_ok:
            if getattr(self.drafter, "computes", False) and hasattr(self.verifier, "drafting"):
                self.verifier.drafting()  # no decoding ahead beside a draft model's work
            t0 = time.perf_counter()
            rnd.want = want
            try:
                ctx = DraftContext(self.sid, list(self.tokens), self.prompt_len, self.draft_sampling, round_seed=rs)
                if hasattr(self.drafter, "propose_info"):  # can draft ahead: says whether this draft was
                    rnd.tree, rnd.ahead = self.drafter.propose_info(ctx, want)
                else:
                    rnd.tree = self.drafter.propose(ctx, want)
            except Exception as e:  # noqa: BLE001 - a lost drafter degrades to plain decoding
                rnd.tree = TokenTree()
                self.stats.fallbacks += 1
                if self.o.on_drafter_error is not None and self.o.on_drafter_error(e) is False:
                    self.drafter_ok = False
            rnd.draft_s = time.perf_counter() - t0
        return rnd

    def ahead(self, rnd: _Round) -> None:
        """Overlap on and a drafter that drafts ahead: ask it to draft the next round for
        this one's likely outcomes while this one verifies (it returns at once)."""
        pol = self.o.draft_ahead
        if pol is None or not self.drafter_ok or self.o.self_draft is not None \
                or not hasattr(self.drafter, "propose_ahead"):
            return
        budget = rnd.want if rnd.want else (self.policy.budget if self.first else 0)
        budget = min(budget, self.o.max_new_tokens - self.n_new - 2)
        if rnd.want and not len(rnd.tree):  # asked and found nothing (a lookup without a match): drafting
            return  # after the outcome costs no more than drafting ahead, and the ahead call is not free
        if budget <= 0 or not pol.on():
            return
        try:
            rnd.ahead_asked = bool(self.drafter.propose_ahead(
                DraftContext(self.sid, list(self.tokens), self.prompt_len, self.draft_sampling), rnd.tree, budget))
        except Exception:  # noqa: BLE001 - draft-ahead is an optimisation: the next round drafts afresh
            pass

    def prefill_resumed(self) -> None:
        """A resumed generation: prefill all but the last committed token, dropping the
        sampled token, so the verifier holds what it held at this round boundary of the
        interrupted run (and a drafter fed its hidden features has their rows) and the
        first round is that run's round: the last token pending, drafted, verified."""
        req = VerifyRequest(self.sid, 0, self.tokens[:-1], TokenTree(), self.o.sampling,
                            round_seed(self.o.sampling.seed, len(self.tokens) - 1), prompt_len=self.prompt_len,
                            jump_forward=self.o.jump_forward)
        t0 = time.perf_counter()
        res = self.verifier.verify(req)
        self.kv_len = len(self.tokens) - 1
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.target_forwards += 1
        self.stats.cached_tokens = min(res.cached_tokens, self.prompt_len)

    def verify(self, rnd: _Round, rs: int) -> None:
        """Send the committed tokens the verifier lacks and the draft; re-prefill a lost session."""
        # the target's entropy feeds the budget policy: only where there is something to draft
        # and the policy uses it (a softmax, a log and a sum over the vocabulary: ~0.1 ms a
        # round on a CPU)
        drafts = self.drafter is not None or self.o.self_draft is not None
        want = drafts and not self.first and getattr(self.policy, "uses_entropy", True)
        req = VerifyRequest(self.sid, self.kv_len, self.tokens[self.kv_len:], rnd.tree, self.o.sampling, rs,
                            self_draft=rnd.self_draft, want_entropy=want, prompt_len=self.prompt_len,
                            jump_forward=self.o.jump_forward)
        t0 = time.perf_counter()
        try:
            rnd.result = self.verifier.verify(req)
        except SessionLost:
            req.keep_len, req.append_tokens = 0, list(self.tokens)
            rnd.result = self.verifier.verify(req)
        rnd.wall_s = time.perf_counter() - t0

    def record(self, rnd: _Round, facts: Optional[dict]) -> None:
        """Counters, the budget policy's feedback and the round's facts."""
        res, st = rnd.result, self.stats
        st.target_forwards += 1
        depth = 0
        if self.first:
            st.prefill_s += rnd.wall_s
            if not self.o.resumed:  # (a resumed one counted its prefill's, prefill_resumed)
                st.cached_tokens = min(res.cached_tokens, self.prompt_len)
        else:
            self_draft_s = res.draft_ms / 1e3
            # a step a Decode stream decided ahead arrives after a wait shorter than its own draft:
            # the phases split this round's wall, so its draft counts no more than the wall
            within = min(self_draft_s, rnd.wall_s)
            st.verify_s += rnd.wall_s - within
            st.draft_s += rnd.draft_s + within
            depth = max(rnd.tree.depths()) + 1 if len(rnd.tree) else res.drafted
            depth = max(depth, len(res.accepted))  # grammar-forced drafts (jump-forward) lengthen a chain
            st.record_round(res.drafted, len(res.accepted), depth)
            st.forced_tokens += res.forced
            self.policy.observe_load(res.batch_size, self.o.self_draft is not None, res.batch_rows,
                                     res.verify_ms / 1e3)
            verify_s = rnd.wall_s - self_draft_s
            if res.source == "decode_stream" and res.verify_ms > 0:
                # a step the verifier decoded ahead: the wait for it is not what a round costs (near 0, it
                # made a plain round look cheap and every draft dear, and drafting stayed off); its forward is
                verify_s = res.verify_ms / 1e3
            self.policy.update(res.drafted, len(res.accepted), res.entropy, rnd.draft_s + self_draft_s,
                               max(verify_s, 1e-6))
            if self.o.draft_ahead is not None and self.drafter_ok and self.o.self_draft is None:
                self.o.draft_ahead.observe(rnd.ahead_asked or getattr(rnd.ahead, "result", "off") != "off",
                                           rnd.draft_s + rnd.wall_s, len(res.accepted) + 1,
                                           getattr(rnd.ahead, "result", "off"))
        a = rnd.ahead
        if a is not None:
            st.ahead_hits += a.result == "hit"
            st.ahead_misses += a.result == "miss"
            st.ahead_wasted += a.wasted
        if facts is not None and a is not None:  # busy / idle: this round's wall, draft + verify
            wall = rnd.draft_s + rnd.wall_s
            busy_d = min(wall, rnd.draft_s + a.ahead_s)
            facts.update(ahead=a.result if a.result != "miss" else f"miss:{a.reason}", ahead_ms=a.ahead_s * 1e3,
                         wasted=a.wasted, ahead_outcomes=a.outcomes, ahead_span=a.span,
                         drafter_busy_ms=busy_d * 1e3, drafter_idle_ms=(wall - busy_d) * 1e3,
                         verifier_busy_ms=rnd.wall_s * 1e3, verifier_idle_ms=rnd.draft_s * 1e3)
        if facts is not None and self.first and not self.o.resumed:  # the prefill: the prompt tokens the
            # verifier's prefix cache held, and the ones it computed
            facts.update(cached_tokens=res.cached_tokens, computed_tokens=max(0, len(self.tokens) - res.cached_tokens))
        if facts is not None:
            facts.update(prefill=self.first, drafted=res.drafted, accepted=len(res.accepted), depth=depth,
                         tree_size=res.tree_size, draft_ms=rnd.draft_s * 1e3 + res.draft_ms,
                         verify_ms=res.verify_ms, wall_ms=(rnd.draft_s + rnd.wall_s) * 1e3,
                         batch_size=res.batch_size, verify_source=res.source)

    def commit(self, rnd: _Round) -> tuple[list[int], bool]:
        """Commit the accepted tokens and the target's own; return (tokens to emit, done)."""
        res = rnd.result
        new = list(res.accepted) + [res.next_token]
        self.kv_len = len(self.tokens) + len(res.accepted)
        out, done = [], False
        lps = res.logprobs
        for t in new:
            if t in self.stops:
                self.stats.finish_reason, done = "stop", True
                break
            out.append(t)
            self.n_new += 1
            if self.n_new >= self.o.max_new_tokens:
                self.stats.finish_reason, done = "length", True
                break
        self.tokens += new
        if lps is not None and self.o.on_logprobs is not None and out:
            self.o.on_logprobs(list(lps[: len(out)]))
        if self.first:
            self.stats.ttft_s = time.perf_counter() - self.t_start
            self.first = False
        self.stats.new_tokens = self.n_new
        self.stats.total_s = time.perf_counter() - self.t_start
        return out, done

    def close(self) -> None:
        self.stats.new_tokens = self.n_new
        self.stats.total_s = time.perf_counter() - self.t_start
        try:
            if self.drafter is not None:
                self.drafter.finish(self.sid, self.tokens[: self.prompt_len + self.n_new], self.prompt_len)
        except Exception:  # noqa: BLE001 - cleanup must not mask the result
            pass
        try:
            self.verifier.release(self.sid)
        except Exception:  # noqa: BLE001
            pass


def speculative_generate(drafter, verifier, prompt_ids: Sequence[int], options: Optional[LoopOptions] = None, *,
                         stats: Optional[GenerationStats] = None, **kw) -> Iterator[list[int]]:
    """Yield lists of new tokens, one per round, until ``max_new_tokens`` or a stop id
    (not yielded). ``stats`` is filled in place. ``drafter`` None and no ``self_draft``
    is plain autoregressive decoding through the same verifier. The options come as a
    ``LoopOptions`` or as its fields by keyword (not both)."""
    if options is not None and kw:
        raise TypeError("pass LoopOptions or its fields, not both")
    o = options if options is not None else LoopOptions(**kw)
    prompt_ids = list(prompt_ids)
    validate_request(prompt_ids, o.max_new_tokens, verifier.vocab_size, o.max_new_limit)
    if not 0 <= o.resumed < len(prompt_ids) or o.resumed > o.max_new_tokens:
        raise InvalidArgument("resume.token_ids", f"{o.resumed} resumed tokens: must be in [0, max_new_tokens "
                              f"{o.max_new_tokens}] and leave a prompt")
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids) - o.resumed
    stats.lossy = o.sampling.lossy
    stats.acceptance = o.sampling.acceptance
    g = _Generation(drafter, verifier, prompt_ids, o, stats)
    try:
        index = 0
        if g.n_new >= o.max_new_tokens:  # resumed with every token: only the final message was lost
            stats.finish_reason, stats.new_tokens = "length", g.n_new
            return
        if o.resumed:
            g.prefill_resumed()
        while True:
            scope = o.round_scope(index) if o.round_scope is not None else contextlib.nullcontext({})
            with scope as facts:
                rs = round_seed(o.sampling.seed, len(g.tokens))  # fresh every round: seeding.py
                rnd = g.draft(rs)
                g.ahead(rnd)
                g.verify(rnd, rs)
                g.record(rnd, facts)
            index += 1
            out, done = g.commit(rnd)
            if out:
                yield out
            if done:
                break
    finally:
        g.close()


def generate_tokens(drafter, verifier, prompt_ids, **kw) -> tuple[list[int], GenerationStats]:
    """Run the loop to the end; return (new tokens, stats)."""
    stats = kw.pop("stats", None) or GenerationStats()
    out: list[int] = []
    for chunk in speculative_generate(drafter, verifier, prompt_ids, stats=stats, **kw):
        out += chunk
    return out, stats
