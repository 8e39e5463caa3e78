"""Domain types shared by every specmesh component.

Plain dataclasses: sampling parameters (validated), token trees with their draft
distributions, verify requests/results and per-generation statistics. This module
knows nothing about models, tensors on devices, gRPC or tokenizers; servicers
convert protos to and from these types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from . import trees


class InvalidArgument(ValueError):
    """Bad input. ``field`` names the offending field (mapped to INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class ResourceExhausted(RuntimeError):
    """A bounded resource (KV slots, sequence length) is full (RESOURCE_EXHAUSTED)."""


class SessionLost(RuntimeError):
    """The session's state is gone or out of sync; the caller should re-prefill
    from its committed tokens (FAILED_PRECONDITION / NOT_FOUND)."""


@dataclass(frozen=True)
class SamplingParams:
    """Target-side sampling. ``temperature == 0`` means greedy decoding.

    top_k == 0 disables top-k; top_p == 1.0 disables nucleus filtering.
    ``acceptance`` selects the verify rule (``ACCEPTANCE_RULES``): "exact" (lossless,
    default); the relaxed, LOSSY rules "typical" (``typical_epsilon``, ``typical_delta``),
    "lenient" (``lenience`` l in (0, 1]: accept w.p. min(1, p / (l q))) and "topk"
    (``accept_top_k`` k >= 1: accept a draft in the target's top k); and "contrastive":
    the target becomes contrastive decoding (``cd_alpha`` plausibility, ``cd_beta``
    strength, ``cd_amateur`` the amateur model) and the exact rules apply to it, so the
    output follows vanilla contrastive decoding exactly — but it is not the plain
    model's distribution, so it is labelled ``lossy`` like the relaxed rules (responses,
    metrics and traces carry the rule's name). "divergence" (Divergence Decoding): a
    domain *specialist* drafts, the target (the generalist) verifies, and a draft is
    accepted up to the first position where JSD(p_specialist, p_target) > ``jsd_threshold``
    (bits, in [0, 1]); there the target's own token is emitted. LOSSY: tokens the target
    would not pick pass where the two models agree in distribution; threshold 0 is exact.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    acceptance: str = "exact"
    typical_epsilon: float = 0.3
    typical_delta: float = 0.09
    lenience: float = 0.5
    accept_top_k: int = 4
    cd_alpha: float = 0.1
    cd_beta: float = 0.5
    cd_amateur: str = "layerskip"
    jsd_threshold: float = 0.3
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()  # ((token id, bias), ...), ids distinct
    min_p: float = 0.0
    logprobs: int = -1
    grammar_kind: str = ""
    grammar: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or math.isnan(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise InvalidArgument("acceptance", f"must be one of {', '.join(map(repr, ACCEPTANCE_RULES))}, "
                                  f"got {self.acceptance!r}")
        _check_real("typical_epsilon", self.typical_epsilon, lambda x: x > 0, "> 0")
        _check_real("typical_delta", self.typical_delta, lambda x: x >= 0, ">= 0")
        _check_real("lenience", self.lenience, lambda x: 0 < x <= 1, "in (0, 1]")
        if isinstance(self.accept_top_k, bool) or not isinstance(self.accept_top_k, int) or self.accept_top_k < 1:
            raise InvalidArgument("accept_top_k", f"must be an integer >= 1, got {self.accept_top_k!r}")
        _check_real("cd_alpha", self.cd_alpha, lambda x: 0 <= x <= 1, "in [0, 1]")
        _check_real("cd_beta", self.cd_beta, lambda x: x >= 0, ">= 0")
        if self.cd_amateur not in CD_AMATEURS:
            raise InvalidArgument("cd_amateur", f"must be one of {', '.join(map(repr, CD_AMATEURS))}, "
                                  f"got {self.cd_amateur!r}")
        _check_real("jsd_threshold", self.jsd_threshold, lambda x: 0 <= x <= 1, "in [0, 1] (bits)")
        _check_real("presence_penalty", self.presence_penalty, lambda x: -2 <= x <= 2, "in [-2, 2]")
        _check_real("frequency_penalty", self.frequency_penalty, lambda x: -2 <= x <= 2, "in [-2, 2]")
        _check_real("repetition_penalty", self.repetition_penalty, lambda x: 0 < x <= 10, "in (0, 10]")
        _check_real("min_p", self.min_p, lambda x: 0 <= x <= 1, "in [0, 1]")
        if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or not -1 <= self.logprobs <= 20:
            raise InvalidArgument("logprobs", f"must be -1 (none) or 0..20 top log-probabilities, got "
                                  f"{self.logprobs!r}")
        seen = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidArgument("logit_bias", f"entries are (token id, bias) pairs, got {pair!r}")
            t, b = pair
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidArgument("logit_bias", f"token id {t!r} must be an integer >= 0")
            if t in seen:
                raise InvalidArgument("logit_bias", f"token id {t} appears twice")
            seen.add(t)
            _check_real("logit_bias", b, lambda x: -100 <= x <= 100, f"in [-100, 100] (token {t})")
        if self.grammar_kind not in GRAMMAR_KINDS:
            raise InvalidArgument("grammar_kind", f"must be one of {', '.join(map(repr, GRAMMAR_KINDS))}, got "
                                  f"{self.grammar_kind!r}")
        if self.grammar and not self.grammar_kind:
            raise InvalidArgument("grammar_kind", "a grammar needs its kind")
        if self.processed and self.acceptance in ("contrastive", "divergence"):
            raise InvalidArgument("acceptance", f"{self.acceptance!r} has its own target: logit_bias, penalties "
                                  "and grammars apply to the plain target's rows only (acceptance exact, typical, "
                                  "lenient or topk)")

    @property
    def penalized(self) -> bool:
        """Penalties or a logit bias: the rows' logits depend on the tokens before them."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def constrained(self) -> bool:
        """A grammar masks the rows."""
        return bool(self.grammar_kind)

    @property
    def processed(self) -> bool:
        """Logits processors run on the scored rows (``specmesh.processors``)."""
        return self.penalized or self.constrained

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below ``GREEDY_BELOW``: as vLLM does, such a temperature is
        greedy decoding (logits / 1e-38 overflow to inf and the softmax to NaN)."""
        return self.temperature < GREEDY_BELOW

    @property
    def lossy(self) -> bool:
        """Not the plain target model's distribution: every rule but "exact" (the relaxed
        rules and "divergence", and "contrastive", which is exact for the contrastive
        target instead)."""
        return self.acceptance != "exact"


# temperatures below this are greedy decoding (vLLM's _SAMPLING_EPS): logits / t overflow far sooner
# than t reaches 0 (t = 1e-38 makes inf logits and a NaN softmax)
GREEDY_BELOW = 1e-5
ACCEPTANCE_RULES = ("exact", "typical", "lenient", "topk", "contrastive", "divergence")
GRAMMAR_KINDS = ("", "json_schema", "json_object", "regex", "choice", "lark")
CD_AMATEURS = ("layerskip",)  # the amateur of "contrastive": the target's own layer-skip exit


def _check_real(name: str, x, ok, want: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not ok(x):
        raise InvalidArgument(name, f"must be a finite number {want}, got {x!r}")


SIBLINGS_IID = "iid"
SIBLINGS_WOR = "without_replacement"


@dataclass
class TokenTree:
    """A flattened draft tree.

    tokens[i]  : drafted token id of node i
    parents[i] : index of node i's parent, -1 = child of the last committed token.
                 Parents always precede children (parents[i] < i).
    q_ids[i], q_probs[i] : the sparse draft distribution node i was drawn from
                 (the drafter's distribution at the parent position). Siblings share
                 it. ``None`` (or empty) means a deterministic, one-hot draft.
    siblings   : how siblings carrying q were drawn — ``SIBLINGS_IID`` (independent
                 draws, each from its own q: i.i.d. when they share one, may
                 repeat; a node without q is a deterministic draft) or
                 ``SIBLINGS_WOR`` (distinct, each from the shared q renormalised
                 over the tokens not drawn before it).
                 Required when two or more siblings carry q: each scheme has its
                 own exact acceptance rule (``acceptance.rejection_tree``) and
                 neither is exact for the other, so an unlabelled tree is refused.
    A chain is a tree with parents = [-1, 0, 1, ...].
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q_ids: Optional[list[list[int]]] = None
    q_probs: Optional[list[list[float]]] = None
    source: str = ""  # where the drafter found it ("lexical", "retrieval", "cache", ...): stats only
    siblings: str = ""  # SIBLINGS_IID / SIBLINGS_WOR when siblings carry q (see above)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int], q_ids=None, q_probs=None) -> "TokenTree":
        tokens = list(tokens)
        return cls(tokens, list(range(-1, len(tokens) - 1)), q_ids, q_probs)

    @property
    def is_chain(self) -> bool:
        return trees.is_chain(self.parents)

    def depths(self) -> list[int]:
        """Depth of each node: 0 for children of the committed context."""
        return trees.depths(self.parents)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1 = root) in sibling order."""
        return trees.children_index(self.parents).get(node, [])

    def validate(self, vocab_size: int, max_nodes: int = 1024) -> None:
        """Raise InvalidArgument naming the field when the tree is malformed."""
        n = len(self.tokens)
        if len(self.parents) != n:
            raise InvalidArgument("tree.parents", f"has {len(self.parents)} entries for {n} tokens")
        if n > max_nodes:
            raise InvalidArgument("tree.tokens", f"{n} nodes exceed the limit of {max_nodes}")
        for i, t in enumerate(self.tokens):
            if not isinstance(t, int) or t < 0 or t >= vocab_size:
                raise InvalidArgument("tree.tokens", f"node {i} has token id {t!r} outside [0, {vocab_size})")
        for i, p in enumerate(self.parents):
            if not isinstance(p, int) or p < -1 or p >= i:
                raise InvalidArgument("tree.parents", f"node {i} has parent {p!r}; parents must be -1 or an earlier node")
        for name, val in (("tree.q_ids", self.q_ids), ("tree.q_probs", self.q_probs)):
            if val is not None and len(val) != n:
                raise InvalidArgument(name, f"has {len(val)} rows for {n} nodes")
        if self.q_ids is not None and self.q_probs is not None:
            for i, (ids, ps) in enumerate(zip(self.q_ids, self.q_probs)):
                if len(ids) != len(ps):
                    raise InvalidArgument("tree.q_probs", f"node {i}: {len(ids)} ids but {len(ps)} probabilities")
                for t in ids:
                    if t < 0 or t >= vocab_size:
                        raise InvalidArgument("tree.q_ids", f"node {i} has id {t} outside [0, {vocab_size})")
                if any((not math.isfinite(x)) or x < 0 for x in ps):
                    raise InvalidArgument("tree.q_probs", f"node {i} has a negative or non-finite probability")
                if ids and abs(sum(ps) - 1.0) > 1e-3:
                    raise InvalidArgument("tree.q_probs", f"node {i} probabilities sum to {sum(ps):.4f}, not 1")
                if ids and self.tokens[i] not in ids:
                    raise InvalidArgument("tree.q_ids", f"node {i}'s token {self.tokens[i]} is not in its q support")
                if ids and ps[ids.index(self.tokens[i])] <= 0:
                    raise InvalidArgument("tree.q_probs", f"node {i}'s token {self.tokens[i]} has q = 0: "
                                          "a drafted token must have positive draft probability")
            self._validate_siblings()
        elif (self.q_ids is None) != (self.q_probs is None):
            raise InvalidArgument("tree.q_probs", "q_ids and q_probs must be given together")
        if self.siblings not in ("", SIBLINGS_IID, SIBLINGS_WOR):
            raise InvalidArgument("tree.siblings", f"must be {SIBLINGS_IID!r} or {SIBLINGS_WOR!r}, "
                                  f"got {self.siblings!r}")

    def _validate_siblings(self) -> None:
        """A sibling group in which any node carries q must say how it was drawn;
        drawn without replacement means one shared q on every sibling and distinct tokens."""
        for par, kids in trees.children_index(self.parents).items():
            if len(kids) < 2 or not any(self.q_ids[i] for i in kids):
                continue
            if not self.siblings:
                raise InvalidArgument("tree.siblings", f"children of node {par} carry q: say how they were drawn "
                                      f"({SIBLINGS_IID!r} or {SIBLINGS_WOR!r})")
            if self.siblings != SIBLINGS_WOR:
                continue
            first = kids[0]
            if any(self.q_ids[i] != self.q_ids[first] or self.q_probs[i] != self.q_probs[first] or not self.q_ids[i]
                   for i in kids):
                raise InvalidArgument("tree.q_probs", f"children of node {par} were drawn without replacement from "
                                      "one q: every sibling must carry that same q")
            toks = [self.tokens[i] for i in kids]
            if len(set(toks)) != len(toks):
                raise InvalidArgument("tree.tokens", f"children of node {par} repeat a token but were "
                                      "drawn without replacement")


@dataclass
class DraftContext:
    """What a drafter sees for one proposal.

    tokens      : all committed tokens of the session (prompt + generated so far);
                  the last one is the "pending" token the next verify will score.
    prompt_len  : how many of ``tokens`` are the prompt.
    cache_id    : the draft cache (anticipated or SSR texts) the cache drafter reads.
    round_seed  : the round's seed (``seeding.round_seed(sampling.seed, committed
                  length)``, the value the verify request carries); None = derive it
                  from ``tokens`` (they are all committed tokens). Drafters that
                  sample draw only from ``seeding.draft_generator(ctx)``.
    """

    session_id: str
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_id: str = ""  # draft cache to read (proactive / SSR texts); "" = none
    round_seed: Optional[int] = None


@dataclass
class SelfDraft:
    """Ask the verifier to draft with the target's own weights (``self`` strategy)."""

    method: str = "layerskip"
    budget: int = 4


FEATURE_DTYPE = "bfloat16"  # the one dtype hidden-state features travel in


@dataclass
class FeatureRows:
    """The target's hidden-state features of consecutive committed positions
    ``[start, start + rows)``: per position, the residual streams of ``layers``
    concatenated (``dim`` = len(layers) x hidden size), ``dtype`` values (only
    ``"bfloat16"``), row-major, little-endian, in ``data`` (rows x dim x 2 bytes).
    What a block drafter outside the verifier conditions on; bytes, so this
    module stays free of tensors."""

    start: int
    rows: int
    dim: int
    layers: tuple[int, ...]
    dtype: str = FEATURE_DTYPE
    data: bytes = b""

    @property
    def end(self) -> int:
        return self.start + self.rows

    def check(self, layers: Sequence[int], dim: int, name: str = "features") -> None:
        """Raise InvalidArgument naming the field unless the rows are well formed for a
        reader expecting ``layers`` and ``dim``."""
        if self.dtype != FEATURE_DTYPE:
            raise InvalidArgument(f"{name}.dtype", f"must be {FEATURE_DTYPE!r}, got {self.dtype!r}")
        if tuple(self.layers) != tuple(layers):
            raise InvalidArgument(f"{name}.layers", f"must be {list(layers)}, got {list(self.layers)}")
        if self.dim != dim:
            raise InvalidArgument(f"{name}.dim", f"must be {dim} (len(layers) x hidden), got {self.dim}")
        if self.start < 0 or self.rows < 0:
            raise InvalidArgument(f"{name}.start" if self.start < 0 else f"{name}.rows",
                                  f"must be >= 0, got start {self.start}, rows {self.rows}")
        if len(self.data) != self.rows * self.dim * 2:
            raise InvalidArgument(f"{name}.data", f"holds {len(self.data)} bytes; {self.rows} rows x {self.dim} "
                                  f"bfloat16 values need {self.rows * self.dim * 2}")


@dataclass
class VerifyRequest:
    """One extend-and-verify step of a session.

    The verifier truncates the session's KV to ``keep_len`` tokens, appends
    ``append_tokens`` (all committed tokens not yet in its KV; the last of them
    is the pending token whose logits start the draft), scores ``tree`` (or a
    tree it drafts itself, ``self_draft``) under an ancestor-only mask, accepts by
    the rule in ``sampling`` and commits the accepted path's KV.
    ``feature_layers`` (empty: none): also return, in ``VerifyResult.features``,
    those layers' hidden features of every position this step committed
    (``[keep_len, cache_len)``): an external block drafter's input.
    """

    session_id: str
    keep_len: int
    append_tokens: list[int]
    tree: TokenTree = field(default_factory=TokenTree)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    round_seed: int = 0
    self_draft: Optional[SelfDraft] = None
    want_entropy: bool = False
    feature_layers: tuple[int, ...] = ()
    # how many of the session's committed tokens are the prompt (-1: unknown): where the
    # output starts, whose tokens the penalties count and the grammar matches
    prompt_len: int = -1
    # a grammar's forced tokens join the draft as free drafts (``processors.constrain``)
    jump_forward: bool = False
    # set by the verifier on the last step of a prefill it ran in chunks: the keep_len of the
    # request this step ends (its features start there; a fused drafter's first round is decided by it)
    first_keep_len: Optional[int] = None
    # the prefix cache's tenant: a new session (keep_len 0) reuses and stores blocks under it only
    cache_salt: str = ""


@dataclass
class TokenLogprob:
    """The target's log-probability of one emitted token (``token_id``) and, when asked,
    the ``top`` most likely tokens of its row as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: list = field(default_factory=list)


@dataclass
class VerifyResult:
    """accepted: drafted tokens accepted (path from the root); next_token: the
    target's own token after them (correction or bonus). The session's KV now
    holds every token before ``next_token``."""

    accepted: list[int]
    next_token: int
    drafted: int
    tree_size: int
    accepted_nodes: list[int] = field(default_factory=list)
    entropy: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    cache_len: int = 0
    batch_size: int = 1
    features: Optional[FeatureRows] = None  # asked for by VerifyRequest.feature_layers
    # rows the batched forward scored for all its requests (appended tokens + tree nodes
    # of each): with verify_ms, a point of the forward's cost line (loop.ForwardCosts);
    # 0: unknown
    batch_rows: int = 0
    cached_tokens: int = 0  # a new session's first tokens served from the verifier's prefix cache
    # where the round's answer came from: "verify" (a Verify call, or in process) or
    # "decode_stream" (a step the verifier decoded ahead on a Decode stream: plain decoding)
    source: str = "verify"
    # sampling.logprobs >= 0: one ``TokenLogprob`` per token of accepted + [next_token]
    logprobs: Optional[list] = None
    # drafted tokens the grammar forced (jump-forward: no drafter asked), of ``drafted``
    forced: int = 0


@dataclass
class GenerationStats:
    """Per-generation statistics filled by the draft–verify loop."""

    strategy: str = "autoregressive"
    strategy_reason: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accept_hist: list[int] = field(default_factory=list)
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0
    ttft_s: float = 0.0
    finish_reason: str = ""
    lossy: bool = False
    acceptance: str = "exact"  # the verify rule (SamplingParams.acceptance); lossy = any but "exact"
    fallbacks: int = 0
    # draft caches (proactive / ssr): drafted and accepted tokens whose draft came from the cache
    cache_hit: bool = False
    cache_drafted_tokens: int = 0
    cache_accepted_tokens: int = 0
    warm_prefix_tokens: int = 0  # prompt tokens whose KV was already warm (not prefilled by this request)
    cached_tokens: int = 0  # prompt tokens the verifier's prefix cache held (not computed by this request)
    # reasoning requests: the answer phase (after the end of thinking) and SSR side branches
    thinking_tokens: int = 0
    answer_tokens: int = 0
    answer_s: float = 0.0
    side_branches: int = 0
    side_tokens: int = 0
    # draft-ahead (specmesh.ahead): rounds whose draft came from a drafted-ahead round, rounds that
    # asked for one and drafted afresh, and drafted-ahead tokens of outcomes that did not happen
    ahead_hits: int = 0
    ahead_misses: int = 0
    ahead_wasted: int = 0
    forced_tokens: int = 0  # drafted tokens a grammar forced (jump-forward), of drafted_tokens
    # predicted outputs: predicted tokens drafted and accepted / drafted and rejected
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def tau(self) -> float:
        """Tokens per target forward in the decode phase: (accepted + rounds) / rounds."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def record_round(self, drafted: int, accepted: int, depth: int) -> None:
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.accept_hist) <= max(accepted, depth):
            self.accept_hist.append(0)
        self.accept_hist[accepted] += 1
        while len(self.position_drafted) < depth:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for k in range(depth):
            self.position_drafted[k] += 1
            if k < accepted:
                self.position_accepted[k] += 1

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["tau"] = self.tau
        d["tokens_per_s"] = self.tokens_per_s
        d["position_acceptance"] = self.position_acceptance
        return d
