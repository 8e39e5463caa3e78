"""DFlash-style block drafter: proposes a whole block in one pass.

Input of a block: ``[anchor token, MASK x (B-1)]`` embedded with the target's
(frozen) embedding table, plus a learned MASK vector and block-position
embeddings. Conditioning: the target's hidden states of the context from a few
layers, concatenated and projected to the drafter width, injected as extra
keys/values in every drafter layer; with ``fuse_last`` the projected features of
the last visible context position (the one right before the anchor) are also
added, through their own projection, to every block token's input (EAGLE-style
fusion: the slot next to the anchor gets the target's state directly, not only
through attention). Attention inside a block is non-causal; a
block sees the context features strictly before its anchor and nothing later
(no other block, no future context). Output: the target's final norm + a
frequency-truncated slice of the target's LM head (``keep_ids``): a draft can
only name a token in ``keep_ids``; verification keeps the output exact.

Shapes: H = target hidden size, F = len(feature_layers) * H, N = len(keep_ids).
This module knows nothing about sessions, KV caches of the target, data or training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class BlockDrafterConfig:
    block: int = 8  # B: anchor + B-1 drafted positions
    n_layers: int = 1
    hidden: int = 576  # must equal the target's hidden size (shared embeddings / head)
    n_heads: int = 9
    ffn: int = 1536
    feature_layers: list[int] = field(default_factory=lambda: [2, 14, 27])
    context_window: int = 256  # most recent context positions attended
    eps: float = 1e-5
    target: str = "smollm2-135m-instruct"
    vocab_size: int = 49152
    n_keep: int = 8192
    fuse_last: bool = False  # add the last context position's projected features to the block inputs
    fuse_norm: bool = False  # RMS-normalise the fused vector to the embeddings' scale (else it can drown the anchor)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> "BlockDrafterConfig":
        return cls(**json.loads(Path(path).read_text()))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: BlockDrafterConfig):
        super().__init__()
        h, self.nh = cfg.hidden, cfg.n_heads
        self.hd = h // cfg.n_heads
        self.ln1 = nn.RMSNorm(h, eps=cfg.eps)
        self.ln_ctx = nn.RMSNorm(h, eps=cfg.eps)
        self.q = nn.Linear(h, h, bias=False)
        self.kv = nn.Linear(h, 2 * h, bias=False)  # block tokens and context features share it
        self.o = nn.Linear(h, h, bias=False)
        self.ln2 = nn.RMSNorm(h, eps=cfg.eps)
        self.gate_up = nn.Linear(h, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, h, bias=False)

    def context_kv(self, ctx: torch.Tensor) -> torch.Tensor:
        """Keys/values of the context positions [..., C, H] -> [..., C, 2H]: they depend on
        the context alone (serving caches them per position: ``incremental``)."""
        return self.kv(self.ln_ctx(ctx))

    def forward(self, x: torch.Tensor, ctx_kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [S, M, H] block tokens (all blocks of a sequence flattened), ctx_kv [S, C, 2H]
        (``context_kv`` of the projected context features), mask [S, M, C + M] bool
        (True = may attend); S sequences side by side."""
        S = x.shape[0]
        h = self.ln1(x)
        hk = self.kv(h)
        kv = torch.cat([ctx_kv.to(hk.dtype), hk], 1)  # [S, C + M, 2H]
        q = self.q(h).view(S, -1, self.nh, self.hd).transpose(1, 2)  # [S, nh, M, hd]
        k, v = kv.view(S, -1, 2, self.nh, self.hd).permute(2, 0, 3, 1, 4)  # [S, nh, C+M, hd] each
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.o(a.transpose(1, 2).reshape(S, -1, self.nh * self.hd))
        g, u = self.gate_up(self.ln2(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class BlockDrafter(nn.Module):
    def __init__(self, cfg: BlockDrafterConfig, embed: torch.Tensor, head: torch.Tensor,
                 final_norm: torch.Tensor, keep_ids: torch.Tensor):
        """embed [V, H] and head [V, H] are the target's (frozen, not saved);
        final_norm [H]; keep_ids [N] long: vocabulary ids the drafter may name."""
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("keep_ids", keep_ids.long(), persistent=True)
        self.register_buffer("head", head.detach().float()[keep_ids.long()].contiguous(), persistent=False)
        self.register_buffer("final_norm", final_norm.detach().float(), persistent=False)
        inv = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
        inv[keep_ids.long()] = torch.arange(len(keep_ids))
        self.register_buffer("vocab_to_keep", inv, persistent=False)
        self.mask_emb = nn.Parameter(torch.zeros(h))
        self.pos_emb = nn.Parameter(torch.zeros(cfg.block, h))
        self.feat_norm = nn.RMSNorm(len(cfg.feature_layers) * h, eps=cfg.eps)
        self.feat_proj = nn.Linear(len(cfg.feature_layers) * h, h, bias=False)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.n_layers))
        if cfg.fuse_last:
            self.last_norm = nn.RMSNorm(h, eps=cfg.eps)
            self.last_proj = nn.Linear(h, h, bias=False)
            if cfg.fuse_norm:
                self.fuse_out = nn.RMSNorm(h, eps=cfg.eps)
                with torch.no_grad():  # start at the embeddings' per-element scale
                    self.fuse_out.weight.fill_(float(embed.float().pow(2).mean().sqrt()))
        nn.init.normal_(self.pos_emb, std=0.02)
        nn.init.normal_(self.mask_emb, std=0.02)

    # ---------------------------------------------------------------- masks
    @staticmethod
    def block_mask(anchors: list[int], block: int, n_ctx: int, ctx_start: int = 0,
                   window: Optional[int] = None) -> torch.Tensor:
        """[len(anchors) * block, n_ctx + len(anchors) * block] bool. Block j (anchor at
        absolute position a_j) sees context positions p with p < a_j (and p >= a_j - window)
        — context index i is absolute position ctx_start + i — and its own block."""
        rel = torch.tensor(anchors, dtype=torch.long) - ctx_start  # anchors relative to the context start
        return BlockDrafter.block_mask_batch(rel[None], block, n_ctx, window)[0]

    @staticmethod
    def block_mask_batch(anchors: torch.Tensor, block: int, n_ctx: int,
                         window: Optional[int] = None) -> torch.Tensor:
        """``block_mask`` for S sequences at once, context starting at position 0:
        anchors [S, A] long -> [S, A * block, n_ctx + A * block] bool."""
        S, A = anchors.shape
        pos = torch.arange(n_ctx, device=anchors.device)
        vis = pos[None, None] < anchors[..., None]  # [S, A, C]
        if window is not None:
            vis &= pos[None, None] >= anchors[..., None] - window
        own = torch.eye(A, dtype=torch.bool, device=anchors.device).repeat_interleave(block, 0)
        own = own.repeat_interleave(block, 1)  # [A*B, A*B]: each block sees itself
        ctx = vis.repeat_interleave(block, 1)  # [S, A*B, C]
        return torch.cat([ctx, own[None].expand(S, -1, -1)], 2)

    # ---------------------------------------------------------------- forward
    def forward(self, anchor_tokens: torch.Tensor, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """anchor_tokens [A] long (vocab ids); features [C, F] target hidden states of
        the context; mask from ``block_mask``. Returns logits over keep_ids for the B-1
        drafted positions of each block: [A, B-1, N]."""
        return self.forward_batch(anchor_tokens[None], features[None], mask[None])[0]

    def context_state(self, features: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What the drafter derives from context features [..., C, F] alone: the projected
        context [..., C, H] and each layer's context keys/values [..., C, 2H]. Row c
        depends on position c only."""
        w = self.feat_proj.weight.dtype
        ctx = self.feat_proj(self.feat_norm(features.to(w))).to(w)
        return ctx, [layer.context_kv(ctx) for layer in self.layers]

    def forward_batch(self, anchor_tokens: torch.Tensor, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """S sequences side by side: anchor_tokens [S, A], features [S, C, F], mask
        [S, A*B, C + A*B] (``block_mask_batch``) -> logits [S, A, B-1, N]. (Serving one
        block after a cached context: ``incremental.FoldedDrafter``, the same function.)"""
        B = self.cfg.block
        S, A = anchor_tokens.shape
        x = self.mask_emb.expand(S, A, B, -1).clone()
        x[:, :, 0] = self.embed[anchor_tokens]
        x = x + self.pos_emb
        ctx, ctx_kv = self.context_state(features)
        C = ctx.shape[1]
        if self.cfg.fuse_last and C > 0:
            # the last context position each block may see, read off the mask (none: no fusion)
            vis = mask[:, ::B, :C]  # [S, A, C]
            last = C - 1 - vis.flip(-1).int().argmax(-1)  # [S, A]
            fused = self.last_proj(self.last_norm(torch.gather(ctx, 1, last[..., None].expand(-1, -1, ctx.shape[-1]))))
            if self.cfg.fuse_norm:
                fused = self.fuse_out(fused.float())
            fused = fused * vis.any(-1, keepdim=True)
            x = x + fused[:, :, None]
        x = x.reshape(S, A * B, -1)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, kv, mask)
        x = F.rms_norm(x.view(S, A, B, -1)[:, :, 1:], (x.shape[-1],), self.final_norm, self.cfg.eps)
        return x @ self.head.T

    def trainable_state(self) -> dict:
        """What a checkpoint stores: drafter weights and keep_ids (not the target's)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def load_block_drafter(ckpt_dir: Path, target_state: dict, dtype: torch.dtype = torch.float32) -> BlockDrafter:
    """Build a drafter from a checkpoint directory (config.json + drafter.safetensors)
    and the target's state dict (embeddings, final norm, head)."""
    from safetensors.torch import load_file

    ckpt_dir = Path(ckpt_dir)
    cfg = BlockDrafterConfig.load(ckpt_dir / "config.json")
    sd = load_file(str(ckpt_dir / "drafter.safetensors"))
    tsd = {k.removeprefix("model."): v for k, v in target_state.items()}
    embed = tsd["embed_tokens.weight"]
    head = tsd.get("lm_head.weight", embed)
    model = BlockDrafter(cfg, embed, head, tsd["norm.weight"], sd["keep_ids"])
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model.to(dtype).eval()


def save_block_drafter(model: BlockDrafter, ckpt_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in model.trainable_state().items()}
    save_file(sd, str(ckpt_dir / "drafter.safetensors"), metadata={"format": "specmesh-block-drafter"})
    model.cfg.save(ckpt_dir / "config.json")
    return ckpt_dir


def expected_tau(slot_acc: list[float]) -> float:
    """Expected tokens per round of a chain whose position k is accepted with
    conditional probability slot_acc[k] given all earlier ones were: 1 + sum of prefix products."""
    tau, run = 1.0, 1.0
    for a in slot_acc:
        run *= a
        tau += run
    return tau

