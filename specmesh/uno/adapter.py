"""The mask-gated adapter (Uno / Ψ-Spec): the target drafts for itself.

A LoRA on each of the target's projections (per layer: the fused q/k/v, the
output, the fused gate/up and the down projection, as ``LlamaEngine`` holds them)
that is active **only on gated rows**: rows whose input is the learned MASK
vector (a placeholder for a token not known yet) and, in the diffusion mode, the
rows after the first mask of a block. Every other row is computed exactly as
without the adapter (the engine adds the low-rank term to the gated rows alone),
so verification rows keep the target's distribution bit for bit.

Row semantics, the same for normal and gated rows: the row at position t predicts
the token at t + 1. A block of M masks hung after a token at position P (the
*anchor*: the last token whose identity the forward knows) sits at positions
P+1..P+M and predicts the tokens at P+2..P+M+1; the token at P+1 is the one the
target's own row at P decides (the correction or bonus of a verify round, or the
target's first draft in a separate draft pass). Masks attend to the context up to
the anchor and to the earlier masks of their block (block-causal: a mask block is
a chain of tree nodes, so the engine's ancestor mask is the block mask).

The *readout* conditions each mask row on that decided token, which is known only
after the forward: ``h' = h + W2 silu(W1 [rms(h); emb(token at P+1)])`` on the
mask rows' last hidden states, then the target's final norm and LM head. It runs
when the next round is drafted, on M rows (one head matmul).

Weights: ``A[layer][proj]`` [in, r], ``B[layer][proj]`` [r, out], scale alpha / r;
the mask vector [H]; the readout [2H, R] and [R, H]. Saved as one safetensors file
plus ``config.json``. This module knows nothing about sessions, verification,
sampling or training data.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

PROJS = ("qkv", "o", "gate_up", "down")  # the engine's Linear objects of a layer


@dataclass
class AdapterConfig:
    rank: int = 32
    alpha: float = 32.0
    projs: list[str] = field(default_factory=lambda: list(PROJS))
    readout: int = 512  # inner width of the correction-conditioned readout (0: none)
    block: int = 4  # M: masks per block the adapter was trained for
    target: str = "smollm2-135m-instruct"
    n_layers: int = 30
    hidden: int = 576
    dims: dict = field(default_factory=dict)  # proj -> [in, out] of the target's matrices

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> "AdapterConfig":
        return cls(**json.loads(Path(path).read_text()))


def target_dims(config: dict) -> dict:
    """[in, out] of each projection of a Llama/Qwen2 config (as ``LlamaEngine`` fuses them)."""
    H = config["hidden_size"]
    nq = config["num_attention_heads"]
    nk = config.get("num_key_value_heads", nq)
    hd = config.get("head_dim") or H // nq
    ffn = config["intermediate_size"]
    return {"qkv": [H, (nq + 2 * nk) * hd], "o": [nq * hd, H], "gate_up": [H, 2 * ffn], "down": [ffn, H]}


class GatedAdapter:
    """The adapter's tensors (plain tensors; ``parameters()`` for training) and the two
    things the engine and drafter call: ``delta`` and ``readout``."""

    def __init__(self, cfg: AdapterConfig, tensors: Optional[dict] = None, device="cpu",
                 dtype: torch.dtype = torch.float32, init_mask: Optional[torch.Tensor] = None, seed: int = 0):
        """``tensors``: saved weights (``state_dict`` names); None: a fresh adapter whose
        low-rank terms are zero (B = 0, so it starts as the target itself), the mask vector
        ``init_mask`` (e.g. the mean token embedding) and a small random readout whose
        output layer is zero."""
        self.cfg = cfg
        self.scale = cfg.alpha / cfg.rank
        self.device = torch.device(device)
        self.dtype = dtype
        g = torch.Generator().manual_seed(seed)
        t = tensors or {}
        self.A: list[dict] = []
        self.B: list[dict] = []
        for li in range(cfg.n_layers):
            a, b = {}, {}
            for p in cfg.projs:
                din, dout = cfg.dims[p]
                ka, kb = f"layers.{li}.{p}.A", f"layers.{li}.{p}.B"
                a[p] = t[ka] if ka in t else torch.randn(din, cfg.rank, generator=g) / din ** 0.5
                b[p] = t[kb] if kb in t else torch.zeros(cfg.rank, dout)
            self.A.append(a)
            self.B.append(b)
        H = cfg.hidden
        self.mask = t["mask"] if "mask" in t else (init_mask.clone().float() if init_mask is not None
                                                   else torch.zeros(H))
        self.r_norm = t["readout.norm"] if "readout.norm" in t else torch.ones(H)
        if cfg.readout:
            self.r1 = t["readout.w1"] if "readout.w1" in t else torch.randn(2 * H, cfg.readout, generator=g) / (2 * H) ** 0.5
            self.r2 = t["readout.w2"] if "readout.w2" in t else torch.zeros(cfg.readout, H)
        else:
            self.r1 = self.r2 = None
        self.to(self.device, dtype)

    # ------------------------------------------------------------------ tensors
    def state_dict(self) -> dict:
        sd = {}
        for li in range(self.cfg.n_layers):
            for p in self.cfg.projs:
                sd[f"layers.{li}.{p}.A"] = self.A[li][p]
                sd[f"layers.{li}.{p}.B"] = self.B[li][p]
        sd["mask"] = self.mask
        sd["readout.norm"] = self.r_norm
        if self.r1 is not None:
            sd["readout.w1"], sd["readout.w2"] = self.r1, self.r2
        return sd

    def parameters(self) -> list[torch.Tensor]:
        return list(self.state_dict().values())

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "GatedAdapter":
        """Move (and cast the low-rank matrices and readout to ``dtype``; the mask vector
        and the readout norm stay float32: they enter the fp32 residual stream)."""
        device = torch.device(device) if device is not None else self.device
        dtype = dtype or self.dtype
        for d in self.A + self.B:
            for p in d:
                d[p] = d[p].to(device=device, dtype=dtype)
        self.mask = self.mask.to(device=device, dtype=torch.float32)
        self.r_norm = self.r_norm.to(device=device, dtype=torch.float32)
        if self.r1 is not None:
            self.r1, self.r2 = self.r1.to(device=device, dtype=dtype), self.r2.to(device=device, dtype=dtype)
        self.device, self.dtype = device, dtype
        return self

    def requires_grad_(self, on: bool = True) -> "GatedAdapter":
        for p in self.parameters():
            p.requires_grad_(on)
        return self

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # ------------------------------------------------------------------ what the forward calls
    def delta(self, layer: int, proj: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The low-rank term of ``proj`` in ``layer`` for gated rows x [n, in] -> [n, out]
        (in x's dtype), or None when the adapter has no such term."""
        a = self.A[layer].get(proj)
        if a is None:
            return None
        return ((x.to(a.dtype) @ a) @ self.B[layer][proj]).mul_(self.scale).to(x.dtype)

    def readout(self, h: torch.Tensor, token_emb: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
        """Mask rows' last hidden states h [n, H] (fp32 residual stream) conditioned on the
        embedding of the token the target decided at the block's first position
        (token_emb [n, H] or [H]) -> h' [n, H] float32, before the final norm and head."""
        if self.r1 is None:
            return h
        e = token_emb.expand_as(h).float()
        z = torch.cat([F.rms_norm(h.float(), (h.shape[-1],), self.r_norm, eps), e], -1)
        return h + (F.silu(z.to(self.r1.dtype) @ self.r1) @ self.r2).float()

    # ------------------------------------------------------------------ files
    def save(self, out_dir) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.cfg.save(out / "config.json")
        # the matrices in bf16 (what the bf16 engine runs; half the file), the vectors fp32
        save_file({k: v.detach().to(torch.bfloat16 if v.dim() == 2 else torch.float32).contiguous().cpu()
                   for k, v in self.state_dict().items()}, str(out / "adapter.safetensors"),
                  metadata={"format": "specmesh-uno"})

    def truncated(self, rank: int) -> "GatedAdapter":
        """The same adapter at a lower rank: each low-rank product A @ B replaced by its best
        rank-``rank`` approximation (truncated SVD; the scale alpha / r is kept, so the
        product is what is approximated). The MASK vector and the readout are unchanged."""
        if rank >= self.cfg.rank:
            return self
        cfg = AdapterConfig(**{**self.cfg.__dict__, "rank": rank, "alpha": self.scale * rank})
        t = {k: v.float() for k, v in self.state_dict().items() if not k.startswith("layers.")}
        for li in range(self.cfg.n_layers):
            for p in self.cfg.projs:
                w = self.A[li][p].float() @ self.B[li][p].float()  # [in, out]
                u, s, vh = torch.linalg.svd(w, full_matrices=False)
                r = s[:rank].sqrt()
                t[f"layers.{li}.{p}.A"] = u[:, :rank] * r
                t[f"layers.{li}.{p}.B"] = r[:, None] * vh[:rank]
        return GatedAdapter(cfg, t, device=self.device, dtype=self.dtype)

    @classmethod
    def load(cls, ckpt_dir, device="cpu", dtype: torch.dtype = torch.float32) -> "GatedAdapter":
        from safetensors.torch import load_file

        d = Path(ckpt_dir)
        cfg = AdapterConfig.load(d / "config.json")
        t = {k: v.float() for k, v in load_file(str(d / "adapter.safetensors")).items()}
        return cls(cfg, t, device=device, dtype=dtype)


def new_adapter(config: dict, rank: int = 32, alpha: Optional[float] = None, readout: int = 512, block: int = 4,
                embed: Optional[torch.Tensor] = None, projs=PROJS, target: str = "smollm2-135m-instruct",
                seed: int = 0) -> GatedAdapter:
    """A fresh adapter for a target config (mask vector: the mean token embedding)."""
    cfg = AdapterConfig(rank=rank, alpha=float(alpha if alpha is not None else rank), projs=list(projs),
                        readout=readout, block=block, target=target, n_layers=config["num_hidden_layers"],
                        hidden=config["hidden_size"], dims=target_dims(config))
    init = embed.float().mean(0) if embed is not None else None
    return GatedAdapter(cfg, None, init_mask=init, seed=seed)
