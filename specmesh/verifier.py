"""The verifier core: sessions in KV slots, extend-and-verify, batched verify.

``EngineVerifier`` owns a ``LlamaEngine`` and maps session ids to its slots
(bounded pool, least-recently-used idle sessions evicted, ``ResourceExhausted``
when none can be). One ``verify`` call truncates the session to ``keep_len``,
appends the committed tokens it lacks, scores the draft tree in the same forward,
applies the acceptance rule and commits the accepted path. Prefill is a verify
with the prompt as ``append_tokens`` and an empty tree. All input is validated
before any state changes. A request naming ``feature_layers`` gets the hidden
features of the positions it committed (kept per slot, ``enable_features``; a
rejected draft's positions are never kept) as bf16 bytes, for a block drafter
that runs elsewhere. A *fused* self drafter (``uno``: ``fused``, ``block``,
``mask_blocks``, ``absorb``) gets blocks of mask rows hung on the draft in the same
forward, after every node where acceptance may stop, and the last hidden states of
the block after the node where it stopped: the next round's draft. The verifier
keeps each session's committed token ids (``history``: prompt_len, tokens) beside its
KV, so a context-only drafter it hosts for external requests
(``host_context_drafters``: prompt lookup, suffix decoding; ``drafters.in_verifier``)
drafts from them in the verifier's own turn, with no hop a round. The prefix cache
(``prefix_reuse``, on by default) starts a new session from the longest cached prefix
of its tokens and stores the committed blocks of every session; ``verify_batch``'s
``limits`` cut a long prefill into steps (``Partial``: the rest continues in a later
forward, the session pinned in the pool meanwhile) for the batcher's chunked prefill.

The ``Verifier`` protocol is what the draft–verify loop calls; gRPC adapters
implement the same protocol. This module knows nothing about gRPC, tokenizers or
drafting strategies other than the in-verifier (self) drafters it is given.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Optional, Protocol, Sequence

import torch

from . import acceptance as acc
from . import prefix_reuse, processors, trees
from .engine import LlamaEngine
from .engine.device import to_device, to_host
from .types import (FEATURE_DTYPE, DraftContext, FeatureRows, InvalidArgument, ResourceExhausted, SessionLost,
                    VerifyRequest, VerifyResult)


class Verifier(Protocol):
    vocab_size: int

    def verify(self, req: VerifyRequest) -> VerifyResult: ...

    def release(self, session_id: str) -> None: ...

    def info(self) -> dict: ...


class SessionPool:
    """session id -> engine slot, LRU order; sessions in use (``busy``) or in the middle of a
    prefill run in chunks (``pinned``) are never evicted; ``on_evict(session)`` hears of
    each eviction."""

    def __init__(self, n_slots: int, on_evict: Optional[Callable[[str], None]] = None):
        self.free = list(range(n_slots))[::-1]
        self.slots: "OrderedDict[str, int]" = OrderedDict()
        self.busy: set[str] = set()
        self.pinned: set[str] = set()
        self.evictions = 0
        self.on_evict = on_evict

    def get(self, session_id: str) -> Optional[int]:
        slot = self.slots.get(session_id)
        if slot is not None:
            self.slots.move_to_end(session_id)
        return slot

    def allocate(self, session_id: str) -> int:
        if not self.free:
            victim = next((s for s in self.slots if s not in self.busy and s not in self.pinned), None)
            if victim is None:
                raise ResourceExhausted(f"all {len(self.slots)} KV slots are in use")
            self.free.append(self.slots.pop(victim))
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim)
        slot = self.free.pop()
        self.slots[session_id] = slot
        return slot

    def release(self, session_id: str) -> Optional[int]:
        self.pinned.discard(session_id)
        slot = self.slots.pop(session_id, None)
        if slot is not None:
            self.free.append(slot)
        return slot


@dataclass
class Partial:
    """One step of a prefill run in chunks (``verify_batch``'s ``limits``): the session now
    holds ``cache_len`` tokens; ``rest`` is the request that continues it (the same
    request, its keep_len moved past what is done). ``cached_tokens``: what the step found
    in the prefix cache. ``verify_ms`` / ``batch_rows``: the step's forward."""

    rest: VerifyRequest
    cache_len: int
    cached_tokens: int = 0
    verify_ms: float = 0.0
    batch_rows: int = 0


class EngineVerifier:
    def __init__(self, engine: LlamaEngine, max_tree_nodes: int = 64, max_append: Optional[int] = None,
                 prefix_cache: bool = True, prefix_cache_bytes: Optional[int] = None,
                 prefix_block: int = prefix_reuse.DEFAULT_BLOCK):
        """``prefix_cache``: keep the KV of committed tokens in blocks that later sessions
        starting with the same tokens reuse (``specmesh.prefix_reuse``; ``prefix_cache_bytes``
        of storage, default ``prefix_reuse.DEFAULT_BUDGET``, ``prefix_block`` tokens a block)."""
        self.engine = engine
        self.vocab_size = engine.vocab_size
        self.max_tree_nodes = max_tree_nodes
        self.max_append = max_append or engine.max_seq_len
        self.pool = SessionPool(engine.n_slots, on_evict=self._evicted)
        self.prefix: Optional[prefix_reuse.PrefixReuse] = prefix_reuse.make(engine, prefix_cache, prefix_cache_bytes,
                                                                            prefix_block)
        self.lock = threading.RLock()
        self.self_drafters: dict = {}  # SelfDraft.method -> drafter (context-only hosted ones among them)
        self.context_drafters: list[str] = []  # of those, the context-only drafters hosted for external requests
        # session -> [prompt_len, committed token ids] (the KV's tokens; what hosted context drafters read)
        self.history: dict[str, list] = {}
        self.forwards = 0
        self.feature_layers: list[int] = []
        self.features: Optional[torch.Tensor] = None  # [n_slots, max_seq_len, F] hidden states of committed tokens
        # per slot and position: a stamp that changes whenever that position's features are written
        # (a drafter caching what it computed from them checks these, not the features: no device read)
        self.feature_stamps: list[list[int]] = [[0] * engine.max_seq_len for _ in range(engine.n_slots)]
        self._stamp = 0
        # batched acceptance kernels (one host read per round): default where the logits are on CUDA
        self.batched_acceptance: Optional[bool] = None
        # contrastive acceptance: the amateur is the target's first ``amateur_exit`` layers
        # + its final norm and head (the layer-skip exit), read from the same verify forward
        self.amateur_exit: Optional[int] = None
        # grammars (structured outputs): the vocabulary as the grammar engine sees it
        # (``grammar.Vocab``; None: requests with a grammar are refused) and each
        # constrained session's matcher, synced with its committed output every round
        self.grammar_vocab = None
        self.matchers: dict = {}

    def set_grammar_vocab(self, vocab) -> None:
        """Serve grammars (``SamplingParams.grammar_kind``) over this ``grammar.Vocab``, or
        over the one a zero-argument factory builds at the first grammar request."""
        if not callable(vocab) and vocab.vocab_size != self.vocab_size:
            raise InvalidArgument("grammar_vocab", f"{vocab.vocab_size} tokens, the model has {self.vocab_size}")
        self.grammar_vocab = vocab

    def _vocab(self):
        if callable(self.grammar_vocab):
            self.grammar_vocab = self.grammar_vocab()
        return self.grammar_vocab

    def configure_prefix_cache(self, enabled: bool, budget_bytes: Optional[int] = None,
                               block: int = prefix_reuse.DEFAULT_BLOCK) -> None:
        """Turn the prefix cache on (``budget_bytes`` of storage, ``block`` tokens a block) or
        off, empty; refused (InvalidArgument, nothing changes) where the budget cannot hold
        one sequence of ``max_seq_len`` tokens with the features this verifier keeps."""
        with self.lock:
            new = prefix_reuse.make(self.engine, False, None, block)
            if enabled:
                dim = 0 if self.features is None else self.features.shape[-1]
                new = prefix_reuse.PrefixReuse(self.engine, prefix_reuse.DEFAULT_BUDGET if budget_bytes is None
                                               else budget_bytes, block, dim)
            self.prefix = None  # the old storage goes first
            self.prefix = new

    def _evicted(self, session_id: str) -> None:
        """The pool evicted an idle session to free its slot."""
        if self.prefix is not None:
            self.prefix.ended(session_id)

    def host_context_drafters(self, drafters: dict) -> None:
        """Host these context-only drafters (name -> a ``drafters.base.Drafter``: prompt
        lookup, suffix decoding) as ``SelfDraft`` methods: an external request's rounds
        can then be drafted here from the session's ``history`` (``drafters.in_verifier``)."""
        from .drafters.in_verifier import InVerifier

        for name, d in drafters.items():
            if name in self.self_drafters:
                raise InvalidArgument("verifier_drafters", f"{name!r} is already a self drafter of this verifier")
            self.self_drafters[name] = InVerifier(d, self.history)
            self.context_drafters.append(name)

    def _sync_history(self, session_id: str, keep_len: int, append: Sequence[int], need: bool = False) -> None:
        """The session now holds its first ``keep_len`` known tokens + ``append`` (a keep_len
        of 0 starts it: those are its prompt). A session whose first keep_len tokens are not
        known here (none should be) is dropped: a hosted drafter then drafts nothing for it.
        Kept while context drafters are hosted, the prefix cache is on (it keys the blocks by
        their tokens) or the request's logits processors read it (``need``: penalties,
        grammars); nothing reads it otherwise."""
        if not self.context_drafters and self.prefix is None and not need and session_id not in self.history:
            return
        h = self.history.get(session_id)
        if keep_len == 0:
            self.history[session_id] = [len(append), list(append)]
            if len(self.history) > 2 * self.engine.n_slots:  # sessions evicted from the pool without a release
                for sid in [k for k in self.history if k not in self.pool.slots and k != session_id]:
                    del self.history[sid]
        elif h is not None and len(h[1]) >= keep_len:
            del h[1][keep_len:]
            h[1].extend(append)
        else:
            self.history.pop(session_id, None)

    def set_amateur_exit(self, exit_layer: int) -> None:
        """Serve ``acceptance="contrastive"`` with this exit (default: the layer-skip self
        drafter's, ``contrastive_exit``): the amateur is the first ``exit_layer`` layers
        + final norm + head (the layer-skip drafter's exit), computed from the verify
        forward's hidden state after layer ``exit_layer - 1``: one head matmul on the
        scored rows, no extra pass."""
        if not 0 < exit_layer < self.engine.n_layers:
            raise InvalidArgument("amateur_exit", f"must be in (0, {self.engine.n_layers}), got {exit_layer}")
        self.amateur_exit = int(exit_layer)

    def contrastive_exit(self) -> Optional[int]:
        """The amateur's exit layer: ``set_amateur_exit``'s, else the exit of the layer-skip
        self drafter (``self_drafters["layerskip"]``), else None (no contrastive decoding)."""
        if self.amateur_exit is not None:
            return self.amateur_exit
        return getattr(self.self_drafters.get("layerskip"), "exit_layer", None)

    def enable_features(self, layers: Sequence[int]) -> None:
        """Keep the hidden states of ``layers`` for every committed token of every session
        (what a block drafter conditions on); verification computes them anyway."""
        layers = sorted(set(int(x) for x in layers) | set(self.feature_layers))
        if layers == self.feature_layers and self.features is not None:
            return
        e = self.engine
        if any(not 0 <= i < e.n_layers for i in layers):
            raise InvalidArgument("feature_layers", f"layers must be in [0, {e.n_layers})")
        old, old_layers = self.features, self.feature_layers
        self.feature_layers = layers
        self.features = torch.zeros(e.n_slots, e.max_seq_len, len(layers) * e.hidden, dtype=torch.bfloat16,
                                    device=e.device)
        self._stamp += 1  # every position's features are new ones
        self.feature_stamps = [[self._stamp] * e.max_seq_len for _ in range(e.n_slots)]
        H = e.hidden
        for j, layer in enumerate(old_layers if old is not None else ()):  # sessions keep what they had
            k = layers.index(layer)
            self.features[:, :, k * H:(k + 1) * H] = old[:, :, j * H:(j + 1) * H]
        if self.prefix is not None:  # cached blocks carry these features from now on (an empty cache; the
            # live sessions' earlier positions lack some of them: they are not cached)
            self.prefix.rebuild(self.features.shape[-1], frozen=list(self.pool.slots))

    def _feature_rows(self, slot: int, start: int, layers: Sequence[int]) -> FeatureRows:
        """The kept features of the slot's positions [start, length) as wire-ready bf16 bytes."""
        end, H = self.engine.length(slot), self.engine.hidden
        rows = self.features[slot, start:end]
        if list(layers) != self.feature_layers:
            idx = [self.feature_layers.index(i) for i in layers]
            rows = rows.view(end - start, len(self.feature_layers), H)[:, idx].reshape(end - start, len(idx) * H)
        data = to_host(rows.contiguous(), "features").view(torch.int16).numpy().tobytes()
        return FeatureRows(start, end - start, len(layers) * H, tuple(int(i) for i in layers), FEATURE_DTYPE, data)

    def session_features(self, slot: int, layers: Sequence[int], start: int = 0,
                         end: Optional[int] = None) -> torch.Tensor:
        """[end - start, len(layers) * H] float32 features of the slot's committed tokens
        at positions [start, end) (``end`` default and at most: the slot's length;
        always a copy: callers may keep it)."""
        n, H = self.engine.length(slot), self.engine.hidden
        n = n if end is None else min(end, n)
        rows = self.features[slot, start:n]
        if list(layers) == self.feature_layers:
            return rows.to(torch.float32, copy=True)
        cols = [j for i in layers for j in range(self.feature_layers.index(i) * H, (self.feature_layers.index(i) + 1) * H)]
        return rows[:, cols].float()

    def _store_features(self, slot: int, start: int, hidden: dict, rows: Sequence[int]) -> None:
        if self.features is None or not rows:
            return
        idx = to_device(torch.tensor(list(rows), dtype=torch.long), self.features.device)
        feats = torch.cat([hidden[i][idx] for i in self.feature_layers], -1)
        self.features[slot, start: start + len(rows)] = feats.to(self.features.dtype)
        self._stamp += 1
        self.feature_stamps[slot][start: start + len(rows)] = [self._stamp] * len(rows)

    def _append(self, slot: int, tokens: Sequence[int], session_id: str = "") -> None:
        """Commit a chain of tokens to the slot (keeping features when enabled)."""
        tokens = list(tokens)
        start = self.engine.length(slot)
        out = self.engine.score(slot, tokens, list(range(-1, len(tokens) - 1)), rows=[len(tokens) - 1],
                                hidden_layers=self.feature_layers)
        self.engine.commit(slot, range(len(tokens)))
        self._store_features(slot, start, out.hidden, range(len(tokens)))
        self._cache_commit(session_id, slot)

    # -------------------------------------------------------------- prefix cache
    def _reuse(self, session_id: str, slot: int, tokens: Sequence[int], salt: str = "") -> int:
        """A new session (its slot just reset) starting with ``tokens``: its longest cached
        prefix under ``salt`` (all but the last token at most) copied into its slot; returns
        its length. The session stores its blocks under ``salt`` (its tenant) from now on."""
        if self.prefix is not None and len(tokens) < 2:
            self.prefix.salted(session_id, salt)  # nothing to reuse; it still stores under its salt
        if self.prefix is None or len(tokens) < 2:
            return 0
        n = self.prefix.reuse(session_id, slot, tokens, self.features, salt)
        if n:
            self.engine.lengths[slot] = n
            if self.features is not None:
                self._stamp += 1
                self.feature_stamps[slot][:n] = [self._stamp] * n
        return n

    def _cache_commit(self, session_id: str, slot: int) -> None:
        """The slot's committed tokens into the prefix cache (full blocks it lacks)."""
        h = self.history.get(session_id) if self.prefix is not None else None
        if h is not None:
            self.prefix.committed(session_id, slot, h[1], self.engine.length(slot), self.features)

    def prefill_need(self, req: VerifyRequest) -> int:
        """Tokens ``req`` would compute before its scored rows (its appended tokens but the
        last, less a new session's cached prefix): what a chunked prefill splits. Reads only."""
        n = len(req.append_tokens) - 1
        if req.keep_len == 0 and self.prefix is not None and n > 0:
            n -= self.prefix.peek(req.append_tokens, req.cache_salt)
        return max(0, n)

    def abandon(self, session_id: str) -> None:
        """A prefill run in chunks stops here (its caller went away): the session may be
        evicted again."""
        self.pool.pinned.discard(session_id)

    # -------------------------------------------------------------- validation
    def _validate(self, req: VerifyRequest) -> None:
        if not req.session_id:
            raise InvalidArgument("session_id", "must be non-empty")
        if req.keep_len < 0:
            raise InvalidArgument("keep_len", f"must be >= 0, got {req.keep_len}")
        if not req.append_tokens:
            raise InvalidArgument("append_tokens", "must hold at least the pending token")
        if len(req.append_tokens) > self.max_append:
            raise InvalidArgument("append_tokens", f"{len(req.append_tokens)} tokens exceed the limit {self.max_append}")
        for t in req.append_tokens:
            if not isinstance(t, int) or t < 0 or t >= self.vocab_size:
                raise InvalidArgument("append_tokens", f"token id {t!r} outside [0, {self.vocab_size})")
        req.tree.validate(self.vocab_size, self.max_tree_nodes)
        if req.sampling.acceptance == "contrastive" and self.contrastive_exit() is None:
            raise InvalidArgument("sampling.cd_amateur", f"{req.sampling.cd_amateur!r}: this verifier has no "
                                  "layer-skip exit to serve as the contrastive amateur")
        if req.sampling.acceptance == "divergence":
            if "specialist" not in self.self_drafters:
                raise InvalidArgument("sampling.acceptance", "divergence needs a specialist (a domain-tuned model "
                                      "with the target's tokenizer) in the verifier, and this verifier has none "
                                      "(`specmesh train-specialist`, docs/acceptance.md)")
            own = req.self_draft is not None and req.self_draft.method == "specialist"
            if not own and (len(req.tree) or (req.self_draft is not None and req.self_draft.budget > 0)):
                raise InvalidArgument("sampling.acceptance", "divergence verifies the specialist's own drafts: "
                                      "draft in the verifier with the 'specialist' self drafter (strategy self, "
                                      "drafter specialist), not with an external draft tree")
        sp = req.sampling
        for t, _ in sp.logit_bias:
            if t >= self.vocab_size:
                raise InvalidArgument("sampling.logit_bias", f"token id {t} outside [0, {self.vocab_size})")
        if sp.processed and req.prompt_len < 0:
            raise InvalidArgument("prompt_len", "penalties and grammars need the session's prompt length")
        if sp.constrained:
            if self.grammar_vocab is None:
                raise InvalidArgument("sampling.grammar_kind", "this verifier serves no grammars (it has no "
                                      "tokenizer vocabulary for them)")
            from .grammar import GrammarError, check

            try:
                check(sp.grammar_kind, sp.grammar)
            except GrammarError as e:
                raise InvalidArgument("sampling.grammar", str(e)) from None
        if req.self_draft is not None:
            if req.self_draft.method not in self.self_drafters:
                raise InvalidArgument("self_draft.method", f"unknown {req.self_draft.method!r}; "
                                      f"available: {sorted(self.self_drafters)}")
            if not 0 <= req.self_draft.budget <= self.max_tree_nodes:
                raise InvalidArgument("self_draft.budget", f"must be in [0, {self.max_tree_nodes}]")
        if req.feature_layers:
            fl = list(req.feature_layers)
            if len(set(fl)) != len(fl) or any(not isinstance(i, int) or not 0 <= i < self.engine.n_layers
                                              for i in fl):
                raise InvalidArgument("feature_layers", f"must be distinct layer indices in "
                                      f"[0, {self.engine.n_layers}), got {fl}")
        total = req.keep_len + len(req.append_tokens) + max(len(req.tree), req.self_draft.budget if req.self_draft else 0)
        if total > self.engine.max_seq_len:
            raise ResourceExhausted(f"session would reach {total} tokens > max_seq_len {self.engine.max_seq_len}")

    def _slot_for(self, req: VerifyRequest) -> int:
        slot = self.pool.get(req.session_id)
        if slot is None:
            if req.keep_len != 0:
                raise SessionLost(f"session {req.session_id!r} is not on this verifier; re-prefill with keep_len=0")
            slot = self.pool.allocate(req.session_id)
            self.engine.reset(slot)
        elif self.engine.length(slot) < req.keep_len:
            raise SessionLost(f"session {req.session_id!r} holds {self.engine.length(slot)} tokens < keep_len {req.keep_len}")
        return slot

    def slot_of(self, session_id: str) -> Optional[int]:
        return self.pool.slots.get(session_id)

    # -------------------------------------------------------------- verify
    def verify(self, req: VerifyRequest) -> VerifyResult:
        res = self.verify_batch([req])[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def verify_batch(self, reqs: Sequence[VerifyRequest], limits: Optional[Sequence[Optional[int]]] = None) -> list:
        """Verify several sessions' requests with one forward; returns a VerifyResult
        or the exception for each request (a bad request does not fail the others).
        ``limits[i]`` (a chunked prefill, ``verify_service.batcher``): compute at most that
        many of request i's tokens before its scored rows in this forward; where it has
        more, the forward commits that many and its answer is a ``Partial`` whose ``rest``
        continues it (a divergence request is never cut: its specialist syncs itself)."""
        out: list = [None] * len(reqs)
        with self.lock:
            ready = []
            seen: set[str] = set()
            for i, r in enumerate(reqs):
                try:
                    if r.session_id in seen:
                        raise InvalidArgument("session_id", "one request per session per batch")
                    self._validate(r)
                    slot = self._slot_for(r)
                    if r.sampling.processed and r.keep_len > 0 and len(self.history.get(r.session_id, [0, []])[1]) \
                            < r.keep_len:
                        raise SessionLost(f"session {r.session_id!r}: its tokens are not known here (penalties and "
                                          "grammars count them); re-prefill with keep_len=0")
                    if r.sampling.constrained:
                        self._sync_matcher(r)
                    if r.sampling.acceptance == "divergence" or (
                            r.self_draft is not None and r.self_draft.method == "specialist"):
                        # the specialist keeps the session's tokens itself (SessionLost: re-prefill)
                        self.self_drafters["specialist"].sync(r.session_id, r.keep_len, r.append_tokens)
                    seen.add(r.session_id)
                    self.pool.busy.add(r.session_id)
                    self.pool.pinned.discard(r.session_id)
                    ready.append((i, r, slot))
                except Exception as e:  # noqa: BLE001 - returned per request
                    out[i] = e
            try:
                wanted = {i for _, r, _ in ready for i in r.feature_layers}
                if not wanted <= set(self.feature_layers) or (wanted and self.features is None):
                    self.enable_features(wanted)  # first request for these layers: keep them from now on
                items, meta, fused = [], [], []  # fused: per item, stop node -> its mask block's rows
                parts = []  # chunked prefills' steps: (i, r, slot, tokens, cached)
                procs = []  # per item: (grammar masks of its rows or None, forced tokens drafted)
                for i, r, slot in ready:
                    t0 = time.perf_counter()
                    append, cached = self._begin(r, slot)
                    limit = limits[i] if limits is not None else None
                    if limit is not None and len(append) - 1 > limit and r.sampling.acceptance != "divergence" \
                            and not (r.self_draft is not None and r.self_draft.method == "specialist") \
                            and not r.sampling.processed:
                        parts.append((i, r, slot, append[:max(1, limit)], cached))
                        continue
                    tree, draft_ms = r.tree, 0.0
                    sd = self.self_drafters.get(r.self_draft.method) if r.self_draft is not None else None
                    # a fused drafter's first round: nothing to draft from yet; the prefill forward
                    # itself carries the block after the last prompt token (``_mask_blocks``)
                    first = r.keep_len if r.first_keep_len is None else r.first_keep_len
                    fused_first = getattr(sd, "fused", False) and first == 0
                    if r.self_draft is not None and r.self_draft.budget > 0 and not fused_first:
                        if len(append) > 1 and not getattr(sd, "context_only", False):  # reads no KV
                            self._append(slot, append[:-1], r.session_id)
                            append = append[-1:]
                        ctx = DraftContext(r.session_id, append, 0, r.sampling, round_seed=r.round_seed)
                        tree = self.self_drafters[r.self_draft.method].propose(ctx, r.self_draft.budget)
                        draft_ms = (time.perf_counter() - t0) * 1e3
                    masks, forced = None, 0
                    if r.sampling.constrained:  # the draft as the grammar takes it, its rows' masks
                        room = self.engine.max_seq_len - r.keep_len - len(r.append_tokens) - 1
                        extend = max(0, min(self.max_tree_nodes, room) - len(tree)) if r.jump_forward else 0
                        try:
                            tree, masks, forced = self._constrain(r, tree, extend)
                        except InvalidArgument as e:  # this request's grammar alone: the others go on
                            out[i] = e
                            continue
                    a = len(append)
                    toks = append + tree.tokens
                    pars = trees.after_chain(a, tree.parents)
                    rows = [a - 1] + [a + j for j in range(len(tree))]  # consecutive: read as a slice below
                    blocks = self._mask_blocks(r, slot, toks, pars, a, tree)
                    items.append((slot, toks, pars))
                    meta.append((i, r, slot, a, tree, rows, draft_ms, cached))
                    fused.append(blocks)
                    procs.append((masks, forced))
                if items or parts:
                    t1 = time.perf_counter()
                    cd = any(m[1].sampling.acceptance == "contrastive" for m in meta)
                    exit_h = self.contrastive_exit() - 1 if cd else None  # the amateur reads layer E-1's output
                    last = self.engine.n_layers - 1  # fused drafting keeps its mask rows' last hidden states
                    hl = {*self.feature_layers} | ({exit_h} if cd else set()) | ({last} if any(fused) else set())
                    chains = [(p[2], p[3], list(range(-1, len(p[3]) - 1))) for p in parts]
                    scored = self.engine.score_batch(items + chains, rows=[m[5] for m in meta] +
                                                     [[len(p[3]) - 1] for p in parts], hidden_layers=sorted(hl))
                    scored, pscored = scored[:len(items)], scored[len(items):]
                    self.forwards += 1
                    amateurs = [self.engine.head_logits(so.hidden[exit_h][m[5][0]: m[5][-1] + 1])
                                if m[1].sampling.acceptance == "contrastive" else None
                                for m, so in zip(meta, scored)] if cd else None
                    fwd_ms = (time.perf_counter() - t1) * 1e3
                    n_rows = sum(len(it[1]) for it in items + chains)  # the forward's scored rows, all requests
                    for (i, r, slot, toks, cached), so in zip(parts, pscored):
                        out[i] = self._partial(r, slot, toks, cached, so, fwd_ms, n_rows)
                    if meta:
                        decided, ents = self._decide(meta, scored, amateurs, procs)
                    for k, ((i, r, slot, a, tree, rows, draft_ms, cached), so, blocks, (_, forced)) in enumerate(
                            zip(meta, scored, fused, procs)):
                        res = decided[k]
                        start = self.engine.length(slot)
                        kept = list(range(a)) + [a + j for j in res.path]
                        self.engine.commit(slot, kept)
                        h = self.history.get(r.session_id)
                        if h is not None:
                            h[1].extend(tree.tokens[j] for j in res.path)
                        self._store_features(slot, start, so.hidden, kept)
                        self._cache_commit(r.session_id, slot)
                        if blocks:  # the block after the stop node drafts the next round
                            blk = blocks.get(res.path[-1] if res.path else -1)
                            self.self_drafters[r.self_draft.method].absorb(
                                r.session_id, None if blk is None else so.hidden[last][blk[0]: blk[-1] + 1], self.engine.length(slot))
                        ent = float(ents.get(k, 0.0))
                        first = r.keep_len if r.first_keep_len is None else r.first_keep_len
                        out[i] = VerifyResult(
                            accepted=[tree.tokens[j] for j in res.path], next_token=res.next_token,
                            drafted=len(tree), tree_size=len(tree), accepted_nodes=res.path, entropy=ent,
                            draft_ms=draft_ms, verify_ms=fwd_ms, cache_len=self.engine.length(slot),
                            batch_size=len(items) + len(parts), batch_rows=n_rows, cached_tokens=cached,
                            features=self._feature_rows(slot, first, r.feature_layers)
                            if r.feature_layers else None, forced=forced,
                            logprobs=processors.token_logprobs(so.logits, tree, res.path, res.next_token,
                                                               r.sampling.logprobs)
                            if r.sampling.logprobs >= 0 else None)
            finally:
                for _, r, _ in ready:
                    self.pool.busy.discard(r.session_id)
        return out

    def _begin(self, r: VerifyRequest, slot: int) -> tuple[list[int], int]:
        """Sync the session to the request (truncate to keep_len, the tokens it holds); a
        new session (keep_len 0) starts from its longest cached prefix. Returns (the
        appended tokens still to compute, how many the cache had)."""
        self.engine.truncate(slot, r.keep_len)
        if self.prefix is not None:
            if r.keep_len == 0:
                self.prefix.ended(r.session_id)  # starts over
            else:
                self.prefix.truncated(r.session_id, r.keep_len)
        self._sync_history(r.session_id, r.keep_len, r.append_tokens, r.sampling.processed)
        append = list(r.append_tokens)
        cached = self._reuse(r.session_id, slot, append, r.cache_salt) if r.keep_len == 0 else 0
        return append[cached:], cached

    def _partial(self, r: VerifyRequest, slot: int, toks: list, cached: int, so, fwd_ms: float,
                 n_rows: int) -> Partial:
        """Commit a chunked prefill's step (``toks``, scored as ``so``) and say how the request goes on."""
        start = self.engine.length(slot)
        self.engine.commit(slot, range(len(toks)))
        self._store_features(slot, start, so.hidden, range(len(toks)))
        n = self.engine.length(slot)
        h = self.history.get(r.session_id)
        if h is not None:
            del h[1][n:]  # it was synced with the whole request: it holds what the KV holds
        self._cache_commit(r.session_id, slot)
        self.pool.pinned.add(r.session_id)  # not evicted before the rest of its prefill
        done = n - r.keep_len
        rest = replace(r, keep_len=n, append_tokens=list(r.append_tokens[done:]),
                       first_keep_len=r.keep_len if r.first_keep_len is None else r.first_keep_len)
        return Partial(rest, n, cached, fwd_ms, n_rows)

    def _decide(self, meta: list, scored: list, amateurs, procs: list) -> tuple[list, dict]:
        """The acceptance decisions of the forward's verify requests (on their rows' logits
        after the requests' logits processors), and the entropies asked for."""
        specialists = [self._specialist_rows(m[1], m[4]) for m in meta]
        # entropies asked for: computed here, read with the acceptance decisions
        want_ent = [k for k, m in enumerate(meta) if m[1].want_entropy]
        ent_t = torch.stack([acc.logit_entropy(scored[k].logits[0]) for k in want_ent]) if want_ent else None
        target = [self._processed(m[1], m[4], so.logits, pm[0]) for m, so, pm in zip(meta, scored, procs)]
        decided, ent_v = acc.accept_batch_reading(
            target, [m[4] for m in meta], [m[1].sampling for m in meta],
            [m[1].round_seed for m in meta], batched=self.batched_acceptance, amateurs=amateurs,
            specialists=specialists, also=ent_t,
            committed=[m[1].keep_len + len(m[1].append_tokens) for m in meta])
        return decided, dict(zip(want_ent, ent_v))

    def _sync_matcher(self, req: VerifyRequest) -> None:
        """The session's grammar matcher, synced with the committed output the request
        leaves (before any state changes: a committed output the grammar does not take is
        INVALID_ARGUMENT for this request alone)."""
        from .grammar import GrammarError, Matcher, guarded

        sp = req.sampling
        m = self.matchers.get(req.session_id)
        h = self.history.get(req.session_id)
        tokens = (h[1][:req.keep_len] if req.keep_len else []) + list(req.append_tokens)
        try:  # compiled here, with the vocabulary: what the router's check cannot see is refused here
            if m is None or m.key != (sp.grammar_kind, sp.grammar):
                self.matchers.pop(req.session_id, None)
                m = self.matchers[req.session_id] = Matcher(self._vocab(), sp.grammar_kind, sp.grammar)
            with guarded():
                ok = m.sync(tokens[req.prompt_len:])
        except GrammarError as e:
            self.matchers.pop(req.session_id, None)
            raise InvalidArgument("sampling.grammar", str(e)) from None
        if not ok:
            raise InvalidArgument("sampling.grammar", "the session's committed output does not match its grammar")

    def _constrain(self, req: VerifyRequest, tree, extend: int):
        from .grammar import GrammarError, guarded

        try:
            with guarded():
                return processors.constrain(self.matchers[req.session_id], tree, extend)
        except GrammarError as e:  # past the matcher's limits at this token (a 400 naming the grammar)
            raise InvalidArgument("sampling.grammar", str(e)) from None

    def _processed(self, req: VerifyRequest, tree, logits, masks):
        """The rows' logits after the request's logits processors (``specmesh.processors``)."""
        sp = req.sampling
        if not sp.processed:
            return logits
        ctx = self.history[req.session_id][1] if sp.penalized else ()
        return processors.process_rows(logits, sp, ctx, req.prompt_len, tree, masks)

    def _mask_blocks(self, req: VerifyRequest, slot: int, toks: list, pars: list, a: int, tree) -> dict:
        """A fused self drafter's (``uno``) mask blocks, appended to this forward's tokens:
        a chain of ``block`` mask nodes after each stop node it names (-1: the pending
        token). Returns stop node -> the blocks' node indices ({}: not a fused drafter)."""
        d = self.self_drafters.get(req.self_draft.method) if req.self_draft is not None else None
        if d is None or not getattr(d, "fused", False):
            return {}
        room = self.engine.max_seq_len - self.engine.length(slot) - a
        blocks = {}
        for stop in d.mask_blocks(tree, room):
            p, blk = (a - 1 if stop < 0 else a + stop), []
            for _ in range(d.block):  # consecutive node indices: the block's rows are read as a slice
                toks.append(self.engine.mask_id)
                pars.append(p)
                p = len(toks) - 1
                blk.append(p)
            blocks[stop] = blk
        return blocks

    def _specialist_rows(self, req: VerifyRequest, tree) -> Optional[torch.Tensor]:
        """Divergence requests: the specialist's logits at the positions of the chain it
        just drafted (they stay in this process: the JSD needs the full distribution)."""
        if req.sampling.acceptance != "divergence" or not len(tree):
            return None
        rows = self.self_drafters["specialist"].draft_logits(req.session_id)
        if rows is None or rows.shape[0] != len(tree):
            raise RuntimeError("the specialist's logits do not match its draft")
        return rows

    def prefill(self, session_id: str, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Warm a session's KV with ``tokens`` (no sampling), its prefix cache blocks
        under ``cache_salt``; returns its length."""
        with self.lock:
            for t in tokens:
                if not isinstance(t, int) or t < 0 or t >= self.vocab_size:
                    raise InvalidArgument("tokens", f"token id {t!r} outside [0, {self.vocab_size})")
            if not tokens:
                raise InvalidArgument("tokens", "must be non-empty")
            if len(tokens) > self.engine.max_seq_len:
                raise ResourceExhausted("prompt longer than max_seq_len")
            slot = self.pool.get(session_id)
            if slot is None:
                slot = self.pool.allocate(session_id)
            self.engine.reset(slot)
            self.pool.pinned.discard(session_id)
            if self.prefix is not None:
                self.prefix.ended(session_id)
            self._sync_history(session_id, 0, tokens)
            cached = self._reuse(session_id, slot, list(tokens), cache_salt)
            self._append(slot, list(tokens)[cached:], session_id)
            return self.engine.length(slot)

    def fork(self, source_id: str, session_id: str, n: int) -> int:
        """Start ``session_id`` as a copy of the first ``n`` committed tokens of
        ``source_id``'s KV (clamped to what it holds) without a forward — a side
        branch of a running session (SSR) costs no re-prefill and leaves the source
        untouched. Returns the tokens the new session holds."""
        with self.lock:
            if not session_id or session_id == source_id:
                raise InvalidArgument("session_id", "must be non-empty and differ from the forked session")
            if n < 0:
                raise InvalidArgument("fork_len", f"must be >= 0, got {n}")
            src = self.pool.get(source_id)
            if src is None:
                raise SessionLost(f"session {source_id!r} to fork is not on this verifier")
            n = min(n, self.engine.length(src))
            self.pool.busy.add(source_id)  # not evicted to make room for its own branch
            try:
                dst = self.pool.get(session_id)
                if dst is None:
                    dst = self.pool.allocate(session_id)
            finally:
                self.pool.busy.discard(source_id)
            e = self.engine
            e.k_cache[:, dst, :, :n] = e.k_cache[:, src, :, :n]
            e.v_cache[:, dst, :, :n] = e.v_cache[:, src, :, :n]
            if getattr(self, "features", None) is not None:
                self.features[dst, :n] = self.features[src, :n]
                self.feature_stamps[dst][:n] = self.feature_stamps[src][:n]
            e.lengths[dst] = n
            if self.prefix is not None:
                self.prefix.forked(source_id, session_id, n)
            h = self.history.get(source_id)
            if h is not None and len(h[1]) >= n:
                self.history[session_id] = [min(h[0], n), h[1][:n]]
            else:
                self.history.pop(session_id, None)
            return n

    def release(self, session_id: str) -> None:
        with self.lock:
            slot = self.pool.release(session_id)
            if self.prefix is not None:
                self.prefix.ended(session_id)
            for d in self.self_drafters.values():
                d.release(session_id)  # a hosted context drafter learns from the session's history first
            self.history.pop(session_id, None)
            self.matchers.pop(session_id, None)
            if slot is not None:
                self.engine.reset(slot)

    def info(self) -> dict:
        e = self.engine
        return {
            "model": str(getattr(e, "model_dir", "")), "dtype": e.dtype_name, "device": str(e.device),
            "vocab_size": e.vocab_size,
            "slots_total": e.n_slots, "slots_used": len(self.pool.slots), "max_seq_len": e.max_seq_len,
            "kv_bytes_per_slot": e.kv_bytes_per_slot(), "kv_bytes_total": e.kv_bytes_per_slot() * e.n_slots,
            "weight_bytes": e.weight_bytes(), "sessions": list(self.pool.slots), "evictions": self.pool.evictions,
            "self_drafters": sorted(set(self.self_drafters) - set(self.context_drafters)),
            "context_drafters": sorted(self.context_drafters), "forwards": self.forwards,
            # CUDA graphs captured while serving (after the warm-up); None without graphs
            "cuda_graph_captures": getattr(e, "calls", {}).get("serving_captures") if getattr(e, "capture", False)
            else None,
            "prefix_cache": self.prefix is not None, **(self.prefix.info() if self.prefix is not None else {}),
        }
