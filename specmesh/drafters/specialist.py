"""The specialist drafter of Divergence Decoding, inside the verifier process.

A *specialist* (a second model with the target's tokenizer, tuned on one domain:
``specmesh.specialist``) drafts a chain; the target verifies it with
``acceptance="divergence"``, which needs the specialist's FULL distribution at every
drafted position (JSD against the target's, ``acceptance.divergence_chain``). A
drafter elsewhere could only send a sparse q (the draft LM sends its top-k), so the
specialist runs where the verifier runs, like the layer-skip and block self
drafters: ``EngineVerifier.self_drafters["specialist"]``, asked for with a
``self_draft`` of method ``specialist``. It keeps its own engine and KV; its logits of
the last draft stay in memory for the verifier (``draft_logits``) and never travel.

The verifier gives a self drafter only the pending token, so the specialist keeps
each session's committed tokens itself: ``sync(session_id, keep_len, append_tokens)``
on every request of a divergence session (the verifier calls it; the drafted chain
is kept tentatively and ``keep_len`` cuts it to what was accepted). KV slots are
LRU (an evicted session re-prefills from its tokens); the tokens go on release.

The engine is built on first use (``engine_factory``), so a verifier that offers the
specialist pays its memory and load time only when a request asks for it.
Knows nothing about acceptance rules or gRPC.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from ..acceptance import target_probs
from ..engine import LlamaEngine
from ..seeding import draft_generator
from ..seqs import common_prefix_len
from ..types import DraftContext, SessionLost, TokenTree
from .base import DrafterBase


class SpecialistDrafter(DrafterBase):
    name = "specialist"

    def __init__(self, engine_factory: Callable[[], LlamaEngine], domain: str = "", vocab_size: Optional[int] = None):
        self._factory = engine_factory
        self._engine: Optional[LlamaEngine] = None
        self._build = threading.Lock()
        self.domain = domain
        self.vocab_size = vocab_size
        self.history: dict[str, list[int]] = {}  # session -> committed tokens (+ the last draft, tentatively)
        self.kv: dict[str, tuple[int, list[int]]] = {}  # session -> (slot, tokens in the slot's KV), LRU order
        self.free: list[int] = []
        self.last: dict[str, torch.Tensor] = {}  # session -> [k, V] logits of its last draft

    @property
    def engine(self) -> LlamaEngine:
        with self._build:
            if self._engine is None:
                eng = self._factory()
                if self.vocab_size is not None and eng.vocab_size != self.vocab_size:
                    raise ValueError(f"the specialist's vocabulary ({eng.vocab_size}) is not the target's "
                                     f"({self.vocab_size})")
                self.free = list(range(eng.n_slots))[::-1]
                self._engine = eng
            return self._engine

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    # ------------------------------------------------------------------ tokens
    def sync(self, session_id: str, keep_len: int, append_tokens) -> None:
        """The session now holds its first ``keep_len`` known tokens + ``append_tokens``.
        SessionLost when this drafter knows fewer than ``keep_len`` of them."""
        have = self.history.get(session_id, [])
        if len(have) < keep_len:
            raise SessionLost(f"the specialist holds {len(have)} tokens of session {session_id!r} < "
                              f"keep_len {keep_len}; re-prefill")
        self.history[session_id] = have[:keep_len] + list(append_tokens)
        self.last.pop(session_id, None)

    def tokens(self, session_id: str) -> list[int]:
        return list(self.history.get(session_id, []))

    # ------------------------------------------------------------------ KV
    def _slot(self, sid: str) -> tuple[int, list[int]]:
        eng = self.engine
        if sid in self.kv:
            ent = self.kv.pop(sid)
            self.kv[sid] = ent  # most recently used last
            return ent
        if not self.free:
            old = next(iter(self.kv))
            slot, _ = self.kv.pop(old)
            self.free.append(slot)
        slot = self.free.pop()
        eng.reset(slot)
        self.kv[sid] = (slot, [])
        return self.kv[sid]

    # ------------------------------------------------------------------ drafting
    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        """Draft ``budget`` tokens after the session's synced tokens (``ctx.tokens`` when
        nothing was synced: a direct caller passing all committed tokens). Greedy: the
        specialist's argmax; sampled: a draw of its distribution after the request's
        temperature / top-k / top-p (the round's draft generator). Keeps the [k, V]
        logits for ``draft_logits``."""
        sid = ctx.session_id
        toks = self.history.get(sid) or list(ctx.tokens)
        eng = self.engine
        budget = min(budget, eng.max_seq_len - len(toks) - 1)
        self.last.pop(sid, None)
        if budget <= 0 or not toks:
            return TokenTree()
        slot, have = self._slot(sid)
        common = common_prefix_len(have, toks[:-1])  # keep the KV both share; at least the last token is fed
        eng.truncate(slot, common)
        logits = eng.prefill(slot, toks[common:])
        gen = None if ctx.sampling.greedy else draft_generator(ctx)
        drafted, rows = [], []
        for i in range(budget):
            rows.append(logits.float())
            if ctx.sampling.greedy:
                t = int(logits.argmax())
            else:
                p = target_probs(logits.float().unsqueeze(0), ctx.sampling)[0].cpu().double()
                t = int(torch.multinomial(p, 1, generator=gen)[0])
            drafted.append(t)
            if i + 1 < budget:
                logits = eng.prefill(slot, [t])
        self.kv[sid] = (slot, toks + drafted[:-1])  # the KV holds all but the last draft
        self.history[sid] = toks + drafted  # tentative: the next sync's keep_len cuts it to what was accepted
        self.last[sid] = torch.stack(rows)
        return TokenTree.chain(drafted)

    def draft_logits(self, session_id: str) -> Optional[torch.Tensor]:
        """[k, V] specialist logits at the positions of the session's last draft (row i:
        the distribution draft i was taken from); None when it has none."""
        return self.last.get(session_id)

    def release(self, session_id: str) -> None:
        self.history.pop(session_id, None)
        self.last.pop(session_id, None)
        ent = self.kv.pop(session_id, None)
        if ent is not None:
            self.free.append(ent[0])
