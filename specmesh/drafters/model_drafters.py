"""Drafters that run a language model: a small draft LM with its own KV cache,
and layer-skip self-drafting with the first E layers of the target.

Both draft a chain autoregressively. Under greedy sampling they send one-hot
drafts (argmax). Under sampling they draw each token from their own top-k
renormalised distribution (temperature applied) and send exactly that sparse q,
so rejection sampling at the verifier stays lossless.

``DraftLMDrafter`` keeps, per session, the tokens its KV holds (the committed ones
and the drafted ones it fed) and syncs to the context by longest common prefix
(rollback costs nothing). ``LayerSkipDrafter``
reads and writes the *target's* KV of the session's slot inside the verifier:
the first E layers' KV of committed tokens is the same for the draft, and its
scratch writes past the committed length are overwritten by the next verify.
Neither knows about acceptance rules or gRPC.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..engine import LlamaEngine
from ..engine.device import host_int, host_list, to_device, to_host
from ..seeding import draft_generator
from ..seqs import common_prefix_len
from ..types import DraftContext, SamplingParams, TokenTree
from .base import DrafterBase


def draw(logits: torch.Tensor, sampling: SamplingParams, top_k: int, gen: Optional[torch.Generator]):
    """One draft token from [V] logits -> (token, q_ids, q_probs). Greedy: argmax, no q."""
    if sampling.greedy:
        return host_int(logits.argmax(), "draft"), None, None
    z = logits.float() / sampling.temperature
    vals, ids = torch.topk(z, min(top_k, z.shape[-1]))
    k = vals.shape[-1]
    # one host read (the draw uses the round's CPU generator, seeding.draft_generator); ids exact in float64
    both = to_host(torch.cat([vals.double(), ids.double()]), "draft")
    q = torch.softmax(both[:k], -1)
    j = int(torch.multinomial(q, 1, generator=gen)[0])
    qp = (q / q.sum()).tolist()
    ids_l = [int(x) for x in both[k:].tolist()]
    return ids_l[j], ids_l, qp


def _assemble(tokens, qids, qps) -> TokenTree:
    if all(q is None for q in qids):
        return TokenTree.chain(tokens)
    return TokenTree.chain(tokens, q_ids=qids, q_probs=qps)


class DraftLMDrafter(DrafterBase):
    """A small LM sharing the target's tokenizer drafts ``budget`` tokens AR."""

    name = "draft_lm"

    def __init__(self, engine: LlamaEngine, top_k: int = 8, name: str = "draft_lm"):
        self.engine = engine
        self.top_k = top_k
        self.name = name
        self.sessions: dict[str, tuple[int, list[int]]] = {}  # id -> (slot, tokens in KV)
        self.free = list(range(engine.n_slots))[::-1]
        self.lru: list[str] = []

    def _slot(self, sid: str) -> tuple[int, list[int]]:
        if sid in self.sessions:
            self.lru.remove(sid)
            self.lru.append(sid)
            return self.sessions[sid]
        if not self.free:
            self.release(self.lru[0])
        slot = self.free.pop()
        self.engine.reset(slot)
        self.sessions[sid] = (slot, [])
        self.lru.append(sid)
        return self.sessions[sid]

    preemptible = True  # ``propose(..., stop=)``: draft-ahead cancels a round it no longer needs

    def propose(self, ctx: DraftContext, budget: int, stop=None) -> TokenTree:
        """``budget`` tokens after ``ctx.tokens`` (synced to its KV by common prefix). The
        KV keeps the drafted tokens it fed (all but the last), so the next round, which
        shares them up to the first rejection, feeds only what differs; a draft-ahead
        round of the "all accepted" outcome continues where this one stopped. ``stop()``
        true between two tokens: return the tokens drafted so far (a cancelled ahead round)."""
        budget = min(budget, self.engine.max_seq_len - len(ctx.tokens) - 1)
        if budget <= 0 or not ctx.tokens:
            return TokenTree()
        slot, have = self._slot(ctx.session_id)
        if len(ctx.tokens) >= self.engine.max_seq_len:
            return TokenTree()
        # sync: keep the common prefix, append the rest (all of ctx.tokens)
        common = common_prefix_len(have, ctx.tokens[:-1])  # at least the last token is fed
        self.engine.truncate(slot, common)
        logits = self.engine.prefill(slot, ctx.tokens[common:])
        gen = None if ctx.sampling.greedy else draft_generator(ctx)
        toks, qids, qps = [], [], []
        for i in range(budget):
            t, qi, qp = draw(logits, ctx.sampling, self.top_k, gen)
            toks.append(t)
            qids.append(qi)
            qps.append(qp)
            if i + 1 < budget:
                if stop is not None and stop():
                    break
                logits = self.engine.prefill(slot, [t])
        self.sessions[ctx.session_id] = (slot, list(ctx.tokens) + toks[:-1])
        return _assemble(toks, qids, qps)

    def guess(self, ctx: DraftContext, n: int) -> list[int]:
        """Its ``n`` most likely next tokens after ``ctx.tokens`` (no draw; draft-ahead's
        guesses of the bonus token and of a rejection's correction, ``specmesh.ahead``)."""
        if n <= 0 or not ctx.tokens or len(ctx.tokens) >= self.engine.max_seq_len:
            return []
        slot, have = self._slot(ctx.session_id)
        common = common_prefix_len(have, ctx.tokens[:-1])
        self.engine.truncate(slot, common)
        logits = self.engine.prefill(slot, ctx.tokens[common:])
        self.sessions[ctx.session_id] = (slot, list(ctx.tokens))
        return torch.topk(logits.float().reshape(-1), min(n, logits.shape[-1])).indices.tolist()

    def release(self, session_id: str) -> None:
        if session_id in self.sessions:
            slot, _ = self.sessions.pop(session_id)
            self.lru.remove(session_id)
            self.engine.reset(slot)
            self.free.append(slot)

    def measure_speed(self, prompt_tokens: int = 64, draft_tokens: int = 8, passes: int = 2) -> tuple[float, float]:
        """Its speed on this machine: (milliseconds per prompt token prefilled, per token
        drafted), the faster of ``passes`` passes (the first also warms it up) of a
        ``prompt_tokens`` prefill and ``draft_tokens`` one-token steps on a scratch
        session, released after. What the router's drafter deadline follows."""
        import time

        n = max(1, min(prompt_tokens, self.engine.max_seq_len - draft_tokens - 2))
        toks = [(7 + 31 * i) % self.engine.vocab_size for i in range(n)]
        best_p = best_d = float("inf")
        sid = "\0speed"  # no caller's session id (those are checked printable)
        for _ in range(max(1, passes)):
            slot, _ = self._slot(sid)
            try:
                self.engine.reset(slot)
                t0 = time.perf_counter()
                logits = self.engine.prefill(slot, toks)
                t1 = time.perf_counter()
                for _ in range(draft_tokens):
                    logits = self.engine.prefill(slot, [host_int(logits.argmax(), "draft")])
                t2 = time.perf_counter()
            finally:
                self.release(sid)
            best_p = min(best_p, (t1 - t0) * 1e3 / n)
            best_d = min(best_d, (t2 - t1) * 1e3 / max(1, draft_tokens))
        return best_p, best_d


class LayerSkipDrafter(DrafterBase):
    """Self-speculative drafting: the first ``exit_layer`` layers of the target plus
    its final norm and head, run on the verifier's own KV slot for the session."""

    name = "layerskip"

    def __init__(self, verifier, exit_layer: int, top_k: int = 8):
        self.verifier = verifier
        self.engine: LlamaEngine = verifier.engine
        if not 0 < exit_layer < self.engine.n_layers:
            raise ValueError(f"exit_layer must be in (0, {self.engine.n_layers}), got {exit_layer}")
        self.exit_layer = exit_layer
        self.top_k = top_k

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        slot = self.verifier.slot_of(ctx.session_id)
        if slot is None or budget <= 0 or not ctx.tokens:
            return TokenTree()
        eng = self.engine
        budget = min(budget, eng.max_seq_len - eng.length(slot) - 2)
        if budget <= 0:
            return TokenTree()
        if ctx.sampling.greedy and getattr(eng, "device_tokens", False):  # argmax fed on the device: one read
            tok = to_device(torch.tensor([ctx.tokens[-1]]), eng.device)
            picked = []
            with self.verifier.lock:
                for i in range(budget):
                    tok = eng.score_token(slot, tok, n_layers=self.exit_layer, extra=i).argmax(-1, keepdim=True)
                    picked.append(tok)
            return TokenTree.chain(host_list(torch.cat(picked), "draft"))
        gen = draft_generator(ctx)
        toks, qids, qps = [], [], []
        cur = ctx.tokens[-1]
        with self.verifier.lock:
            for i in range(budget):
                out = eng.score(slot, [cur], [-1], rows=[0], n_layers=self.exit_layer, extra=i)
                cur, qi, qp = draw(out.logits[0], ctx.sampling, self.top_k, gen)
                toks.append(cur)
                qids.append(qi)
                qps.append(qp)
        return _assemble(toks, qids, qps)
