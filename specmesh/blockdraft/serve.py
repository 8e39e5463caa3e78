"""The trained block drafter as an in-verifier (``self`` strategy) drafter.

``BlockSelfDrafter`` implements the one proposer contract. It reads the hidden
states the verifier keeps for the session's committed tokens (verification
computes them anyway; ``EngineVerifier.enable_features``), runs one drafter pass
for the block after the pending token and returns a chain (greedy: argmax per
slot; sampling: a draw from each slot's top-k renormalised distribution with
that q attached, so rejection sampling stays exact) or, in tree mode, a
best-first tree under a node budget. Knows nothing about gRPC or training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..drafters.base import DrafterBase
from ..types import DraftContext, TokenTree
from .model import BlockDrafter, load_block_drafter
from .tree import Calibration, best_first_tree


class BlockSelfDrafter(DrafterBase):
    name = "block"

    def __init__(self, verifier, model: BlockDrafter, tree: bool = False, tree_width: int = 3,
                 calibration: Optional[Calibration] = None, top_k: int = 8, amp: bool = True):
        """``amp``: run the drafter's pass under bf16 autocast, as it was trained (a draft
        only changes speed, never the output)."""
        self.verifier = verifier
        self.amp = amp
        self.model = model.eval()
        self.tree = tree
        self.tree_width = tree_width
        self.calibration = calibration or Calibration()
        self.top_k = top_k
        verifier.enable_features(model.cfg.feature_layers)

    @classmethod
    def from_checkpoint(cls, verifier, ckpt_dir, tree: bool = False, **kw) -> "BlockSelfDrafter":
        from ..models.loading import load_state_dict

        ckpt_dir = Path(ckpt_dir)
        model = load_block_drafter(ckpt_dir, load_state_dict(verifier.engine.model_dir))
        cal = None
        if (ckpt_dir / "calibration.json").exists():
            cal = Calibration.from_dict(json.loads((ckpt_dir / "calibration.json").read_text()))
        return cls(verifier, model, tree=tree, calibration=cal, **kw)

    @torch.inference_mode()
    def slot_logits(self, ctx: DraftContext) -> Optional[torch.Tensor]:
        """[B-1, N] drafter logits for the block after ctx.tokens[-1], or None."""
        slot = self.verifier.slot_of(ctx.session_id)
        if slot is None or not ctx.tokens:
            return None
        cfg = self.model.cfg
        L = self.verifier.engine.length(slot)
        feats = self.verifier.session_features(slot, cfg.feature_layers)
        c0 = max(0, L - cfg.context_window)
        feats = feats[c0:L]
        mask = BlockDrafter.block_mask([L], cfg.block, L - c0, ctx_start=c0, window=cfg.context_window)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.amp and feats.device.type == "cpu"):
            return self.model(torch.tensor([ctx.tokens[-1]]), feats, mask)[0].float()

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        logits = self.slot_logits(ctx)
        if logits is None or budget <= 0:
            return TokenTree()
        keep = self.model.keep_ids
        s = ctx.sampling
        if self.tree:
            probs = torch.softmax(logits, -1)
            top = torch.topk(probs, self.tree_width, -1)
            cands = [[(int(keep[i]), float(p)) for p, i in zip(top.values[k], top.indices[k])]
                     for k in range(logits.shape[0])]
            return best_first_tree(cands, budget, self.calibration)
        k_max = min(budget, logits.shape[0])
        if s.greedy:
            return TokenTree.chain([int(keep[i]) for i in logits[:k_max].argmax(-1)])
        gen = torch.Generator().manual_seed((s.seed * 7919 + len(ctx.tokens)) & 0x7FFFFFFF)
        toks, qids, qps = [], [], []
        for k in range(k_max):
            vals, idx = torch.topk(logits[k] / s.temperature, self.top_k)
            q = torch.softmax(vals.double(), -1)
            j = int(torch.multinomial(q, 1, generator=gen)[0])
            toks.append(int(keep[idx[j]]))
            qids.append([int(keep[i]) for i in idx])
            qps.append((q / q.sum()).tolist())
        return TokenTree.chain(toks, q_ids=qids, q_probs=qps)
