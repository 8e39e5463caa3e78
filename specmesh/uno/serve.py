"""The ``uno`` / ``uno_tree`` self drafters: the target drafts for itself through its gated adapter.

Two layouts of a round, measured side by side (``specmesh uno-study``):

- **fused** (the default): a round is ONE target forward. The verify forward of
  round r scores the pending token and the draft as usual (normal rows: the
  target's distribution, untouched) and, after the pending token and after every
  draft node (every place acceptance may stop), a block of M mask rows (gated).
  When acceptance stops at node e, the block after e was computed with the
  context round r + 1 will have: it is kept (its last hidden states, ``absorb``),
  and round r + 1 drafts from it once the target's own token there (the new
  pending token) is known: the readout conditions every slot on it, one head
  matmul gives the slot logits. No drafting forward at all.
- **separate**: a draft pass with the adapter (the pending token + M masks, its KV
  scratch) before the usual verify pass: two forwards a round. The draft pass's
  own row for the pending token is the target's distribution, so the chain starts
  with the target's own choice there, then the M mask slots. This is the layout
  PEFT-BD measured as no faster than plain decoding (its drafter costs a target
  pass); kept to measure that.

Slot logits become a draft exactly as the block drafter's do
(``blockdraft.serve.draft_from_slots``: greedy argmax, a sampled chain with its q
attached, or a calibrated best-first tree), so every exact acceptance rule stays
lossless. A session with nothing kept (its first drafting round, a round whose
stop node had no block, a round the budget policy left undrafted) drafts with a
draft pass of its own in the fused layout too, so it is never without a draft.

The verifier drives the fused layout (``EngineVerifier`` calls ``mask_blocks`` while it
builds a forward and ``absorb`` after acceptance). Knows nothing about acceptance
rules, sampling parameters beyond drafting, or gRPC.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from ..blockdraft.serve import draft_from_slots
from ..blockdraft.tree import Calibration
from ..drafters.base import DrafterBase
from ..engine.device import host_int, to_host
from ..seeding import draft_generator
from ..types import DraftContext, TokenTree
from .adapter import GatedAdapter

LAYOUTS = ("fused", "separate")
SERVE_BLOCK = 4  # masks per block served by default


class UnoDrafter(DrafterBase):
    """Self drafter over the verifier's engine with a gated adapter attached."""

    def __init__(self, verifier, adapter: GatedAdapter, tree: bool = False, layout: str = "fused",
                 block: Optional[int] = None, tree_width: int = 4, top_k: int = 8,
                 calibration: Optional[Calibration] = None, max_sessions: int = 256,
                 max_blocks: Optional[int] = None):
        """``block``: masks per block (default: ``SERVE_BLOCK``, at most what the adapter was
        trained for; the blocks are block-causal, so fewer is the same function of the
        first rows). ``tree_width``: candidates per slot the tree may branch into.
        ``max_blocks``: mask blocks a fused round carries at most (None: after every stop
        node; fewer trades the next round's draft pass, where acceptance stopped without
        one, for scored rows: worth it where rows cost, as on a CPU)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.verifier = verifier
        self.engine = verifier.engine
        if self.engine.adapter is not adapter:
            self.engine.attach_adapter(adapter)
        self.adapter = adapter
        self.tree = tree
        self.layout = layout
        self.fused = layout == "fused"
        self.name = ("uno_tree" if tree else "uno") + ("" if self.fused else "_separate")
        self.block = int(block or min(SERVE_BLOCK, adapter.cfg.block))
        self.tree_width = tree_width
        self.top_k = top_k
        self.calibration = calibration or Calibration()
        self.max_sessions = max_sessions
        self.max_blocks = max_blocks
        self._kept: "OrderedDict[str, tuple[int, torch.Tensor]]" = OrderedDict()  # sid -> (KV length, h [M, H])
        self.rounds = {"drafted": 0, "kept": 0, "missed": 0, "separate": 0}  # drafted: from a kept block

    @classmethod
    def from_checkpoint(cls, verifier, ckpt_dir, **kw) -> "UnoDrafter":
        import json

        ad = GatedAdapter.load(ckpt_dir, device=verifier.engine.device, dtype=verifier.engine.act_dtype)
        cal = None
        p = Path(ckpt_dir) / "calibration.json"
        if p.exists():
            from ..blockdraft.tree import load_scorer

            cal = load_scorer(json.loads(p.read_text()))
        return cls(verifier, ad, calibration=cal, **kw)

    def twin(self, tree: bool = False, layout: Optional[str] = None) -> "UnoDrafter":
        """Another shape or layout over the same adapter and verifier."""
        return UnoDrafter(self.verifier, self.adapter, tree=tree, layout=layout or self.layout, block=self.block,
                          tree_width=self.tree_width, top_k=self.top_k, calibration=self.calibration,
                          max_sessions=self.max_sessions, max_blocks=self.max_blocks)

    # ------------------------------------------------------------ the fused layout (the verifier calls these)
    def mask_blocks(self, tree: TokenTree, room: int) -> list[int]:
        """The nodes to hang a block of ``self.block`` masks after (-1: the pending token),
        given the draft of this round and ``room`` scratch positions left in the slot:
        every place acceptance may stop, shallowest first (the likeliest stops: a node is
        only reached through its parent), at most ``max_blocks`` and while they fit. A
        round that stops where no block hangs drafts the next one with a draft pass."""
        depth = tree.depths() if len(tree) else []
        stops = [-1] + sorted(range(len(tree)), key=lambda i: (depth[i], i))
        fit = max(0, room - len(tree)) // self.block
        return stops[:min(fit, self.max_blocks if self.max_blocks is not None else fit)]

    def absorb(self, session_id: str, hidden: Optional[torch.Tensor], kv_len: int) -> None:
        """After acceptance: the last hidden states [M, H] of the block after the stop node
        (None: it had none), valid for the next round while the session holds ``kv_len``
        tokens in the verifier."""
        if hidden is None:
            self._kept.pop(session_id, None)
            self.rounds["missed"] += 1
            return
        self._kept[session_id] = (kv_len, hidden)
        self._kept.move_to_end(session_id)
        self.rounds["kept"] += 1
        while len(self._kept) > self.max_sessions:
            self._kept.popitem(last=False)

    # ------------------------------------------------------------ drafting
    def slot_logits(self, hidden: torch.Tensor, decided: int) -> torch.Tensor:
        """Mask rows' last hidden states [M, H] + the token decided at the block's first
        position -> slot logits [M, V] (readout, final norm, head)."""
        eng = self.engine
        e = eng.embed[decided].float()
        return eng.head_logits(self.adapter.readout(hidden.float(), e, eng.eps))

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        slot = self.verifier.slot_of(ctx.session_id)
        if slot is None or budget <= 0 or not ctx.tokens:
            return TokenTree()
        if self.fused:
            kept = self._kept.get(ctx.session_id)
            if kept is not None and kept[0] == self.engine.length(slot):
                self.rounds["drafted"] += 1
                return draft_from_slots(self.slot_logits(kept[1], ctx.tokens[-1]), ctx, budget, None, self.tree,
                                        self.tree_width, self.calibration, self.top_k)
            self.rounds["separate"] += 1  # nothing kept (first round, a round without drafting): a draft pass
        return self._separate(slot, ctx, budget)

    def _separate(self, slot: int, ctx: DraftContext, budget: int) -> TokenTree:
        """A draft pass: [pending, MASK x M] (scratch KV, overwritten by the verify), the
        target's own choice at the pending token first, then the M slots after it."""
        eng = self.engine
        M = self.block
        if eng.length(slot) + 1 + M > eng.max_seq_len:
            return TokenTree()
        with self.verifier.lock:
            out = eng.score(slot, [ctx.tokens[-1]] + [eng.mask_id] * M, list(range(-1, M)), rows=[0],
                            hidden_layers=[eng.n_layers - 1])
        if not self.fused:
            self.rounds["drafted"] += 1
        first = out.logits[0]
        s = ctx.sampling
        gen = None if s.greedy else draft_generator(ctx)
        if s.greedy or self.tree:
            t0, q0 = host_int(first.argmax(), "draft"), None
        else:  # the first token from the target's own distribution at the pending token (q = its top-k)
            vals, idx = torch.topk(to_host(first.float(), "draft") / s.temperature, min(self.top_k, first.shape[-1]))
            q = torch.softmax(vals.double(), -1)
            j = int(torch.multinomial(q, 1, generator=gen)[0])
            t0, q0 = int(idx[j]), (idx.tolist(), (q / q.sum()).tolist())
        rest = self.slot_logits(out.hidden[eng.n_layers - 1][1:], t0)
        if budget == 1:
            return TokenTree.chain([t0], q_ids=[q0[0]], q_probs=[q0[1]]) if q0 else TokenTree.chain([t0])
        tail = draft_from_slots(rest, ctx, budget - 1, None, self.tree, self.tree_width, self.calibration,
                                self.top_k, gen=gen)
        return _prepend(t0, q0, tail)

    def release(self, session_id: str) -> None:
        self._kept.pop(session_id, None)


def _prepend(t0: int, q0, tail: TokenTree) -> TokenTree:
    """``t0`` (with its q, or one-hot) as the root, ``tail`` hung under it."""
    toks = [t0] + tail.tokens
    par = [-1] + [p + 1 if p >= 0 else 0 for p in tail.parents]
    if q0 is None and not tail.q_ids:
        return TokenTree(toks, par)
    qi = [q0[0] if q0 else None] + (tail.q_ids or [None] * len(tail))
    qp = [q0[1] if q0 else None] + (tail.q_probs or [None] * len(tail))
    return TokenTree(toks, par, q_ids=qi, q_probs=qp)
