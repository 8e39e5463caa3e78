"""Llama-family forward written for serving: preallocated KV cache and slot API.

The engine holds the target's weights (fp32, bf16 or int8 weight-only) and a KV
cache of ``n_slots`` rows of ``max_seq_len`` positions. A slot holds one
sequence's committed tokens; callers (the verifier's session pool) decide which
sequence lives in which slot.

- ``prefill(slot, tokens)``: append a chain of tokens, return the last logits.
- ``score(slot, tokens, parents)``: run a flattened token tree (parents array,
  -1 = child of the last committed token) after the slot's committed tokens with
  an ancestor-only mask and positions = committed length + depth; its KV is
  written to scratch positions after the committed ones. Returns logits (only
  for the requested rows) and, on request, hidden states of chosen layers.
- ``commit(slot, path)``: keep the KV of the tree nodes on ``path`` (root to
  leaf) as committed tokens; ``rollback(slot, n)`` drops the last n.
- ``score_batch``: several slots' trees as one ragged forward (matmuls over the
  concatenated tokens, attention per sequence); equals separate calls.

Works for Llama configs (GQA, RoPE with optional llama3 scaling left out, tied
embeddings) and Qwen2-style q/k/v bias. Knows nothing about sessions,
tokenizers, sampling or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .rowops import topk_rows
from .types import InvalidArgument, ResourceExhausted

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "int8": torch.bfloat16}


class Linear:
    """y = x @ W.T (+ b). int8 mode: per-output-channel symmetric weight-only quantisation
    run by ``aten._weight_int8pack_mm`` with bf16 activations."""

    def __init__(self, w: torch.Tensor, b: Optional[torch.Tensor], mode: str):
        self.mode = mode
        self.out_features = w.shape[0]
        if mode == "int8":
            w = w.float()
            scale = (w.abs().amax(1) / 127.0).clamp_min(1e-8)
            self.w = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale.to(torch.bfloat16)
        else:
            self.w = w.to(DTYPES[mode]).contiguous()
        self.b = None if b is None else b.to(DTYPES[mode])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.w, self.scale)
            return y if self.b is None else y + self.b
        return F.linear(x, self.w, self.b)

    def rows_fp32(self, idx: torch.Tensor) -> torch.Tensor:
        """Weight rows ``idx`` [...] as fp32 [..., in_features] (dequantised in int8 mode)."""
        if self.mode == "int8":
            return self.w[idx].float() * self.scale[idx].float()[..., None]
        return self.w[idx].float()

    def nbytes(self) -> int:
        n = self.w.numel() * self.w.element_size()
        return n + (self.scale.numel() * 2 if self.mode == "int8" else 0)


@dataclass
class Layer:
    ln1: torch.Tensor
    qkv: Linear
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class ScoreOutput:
    logits: torch.Tensor  # [len(rows), V] float32
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, H] float32


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RMSNorm of the fp32 residual stream (one fused op), cast to the matmul dtype."""
    y = F.rms_norm(x, (x.shape[-1],), w, eps)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention: x*cos + rotate_half(x)*sin, where
    rotate_half(x) = [-x2, x1]; the sign is folded into ``sin_signed`` = [-sin, sin]
    so rotate_half is one flip of the two halves. x: [N, heads, hd]; cos/sin: [N, 1, hd]."""
    n, h, d = x.shape
    swapped = x.view(n, h, 2, d // 2).flip(2).view(n, h, d)
    return x * cos + swapped * sin_signed


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: mask[i, j] = node j is node i itself or one of its ancestors."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


def _depths(parents: Sequence[int]) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


class LlamaEngine:
    def __init__(self, config: dict, state_dict: dict, dtype: str = "fp32", n_slots: int = 4,
                 max_seq_len: int = 2048, device: str = "cpu"):
        if dtype not in ("fp32", "bf16", "int8"):
            raise InvalidArgument("dtype", f"must be fp32, bf16 or int8, got {dtype!r}")
        self.config = config
        self.dtype_name = dtype
        self.act_dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.n_layers = config["num_hidden_layers"]
        self.hidden = config["hidden_size"]
        self.n_heads = config["num_attention_heads"]
        self.n_kv = config.get("num_key_value_heads", self.n_heads)
        self.head_dim = config.get("head_dim") or self.hidden // self.n_heads
        self.vocab_size = config["vocab_size"]
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        self._load(state_dict)
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        ang = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv[None]
        emb = torch.cat((ang, ang), -1)
        half = self.head_dim // 2
        self.cos = emb.cos().to(self.act_dtype)  # [T, hd]
        self.sin = torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), -1).to(self.act_dtype)  # signed
        shape = (self.n_layers, n_slots, self.n_kv, max_seq_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.act_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.act_dtype, device=self.device)
        self.lengths = [0] * n_slots

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, name: str = "smollm2-135m-instruct", dtype: str = "fp32", n_slots: int = 4,
                        max_seq_len: int = 2048, quiet: bool = False) -> "LlamaEngine":
        from .models.loading import load_config, load_state_dict, resolve_model

        d = resolve_model(name, quiet=quiet)
        eng = cls(load_config(d), load_state_dict(d), dtype=dtype, n_slots=n_slots, max_seq_len=max_seq_len)
        eng.model_dir = Path(d)
        return eng

    def _load(self, sd: dict) -> None:
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        mode = self.dtype_name
        g = lambda k: sd[k].to(self.device)  # noqa: E731
        opt = lambda k: sd[k].to(self.device) if k in sd else None  # noqa: E731
        self.embed = g("embed_tokens.weight").to(self.act_dtype)  # [V, H]
        self.layers: list[Layer] = []
        for i in range(self.n_layers):
            p = f"layers.{i}."
            wqkv = torch.cat([g(p + "self_attn.q_proj.weight"), g(p + "self_attn.k_proj.weight"),
                              g(p + "self_attn.v_proj.weight")])
            bq = opt(p + "self_attn.q_proj.bias")
            bqkv = None if bq is None else torch.cat([bq, g(p + "self_attn.k_proj.bias"), g(p + "self_attn.v_proj.bias")])
            self.layers.append(Layer(
                ln1=g(p + "input_layernorm.weight").float(),
                qkv=Linear(wqkv, bqkv, mode),
                o=Linear(g(p + "self_attn.o_proj.weight"), opt(p + "self_attn.o_proj.bias"), mode),
                ln2=g(p + "post_attention_layernorm.weight").float(),
                gate_up=Linear(torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")]), None, mode),
                down=Linear(g(p + "mlp.down_proj.weight"), None, mode),
            ))
        self.norm = g("norm.weight").float()
        head = sd.get("lm_head.weight", sd["embed_tokens.weight"])
        self.head = Linear(head.to(self.device), None, mode)

    # ------------------------------------------------------------------ sizes
    def weight_bytes(self) -> int:
        n = self.embed.numel() * self.embed.element_size() + self.head.nbytes()
        for L in self.layers:
            n += L.qkv.nbytes() + L.o.nbytes() + L.gate_up.nbytes() + L.down.nbytes()
        return n

    def kv_bytes_per_slot(self) -> int:
        return 2 * self.n_layers * self.n_kv * self.max_seq_len * self.head_dim * self.k_cache.element_size()

    def _refine_top(self, logits: torch.Tensor, hn: torch.Tensor, k: int = 4) -> torch.Tensor:
        """Recompute the top-k logits of each row exactly (fp32 hidden x fp32 copy of the
        weight rows). A bf16 output is rounded to 1/8 at typical logit sizes, which
        turns near-ties into coin flips between a 1-token and a k-token forward;
        exact top logits keep greedy choices consistent across the two."""
        idx = topk_rows(logits, k)[1]  # [n, k]
        exact = torch.einsum("nh,nkh->nk", hn, self.head.rows_fp32(idx))
        return logits.scatter(-1, idx, exact)

    # ------------------------------------------------------------------ slot API
    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def rollback(self, slot: int, n: int) -> None:
        if n < 0 or n > self.lengths[slot]:
            raise InvalidArgument("n", f"cannot roll back {n} of {self.lengths[slot]} tokens")
        self.lengths[slot] -= n

    def truncate(self, slot: int, keep: int) -> None:
        self.rollback(slot, self.lengths[slot] - keep)

    def commit(self, slot: int, path: Sequence[int]) -> None:
        """Keep scratch nodes ``path`` (tree node indices of the last score, root to leaf)."""
        L = self.lengths[slot]
        path = list(path)
        if any(b <= a for a, b in zip(path, path[1:])) or (path and path[0] < 0):
            raise InvalidArgument("path", "must be increasing node indices")
        if L + len(path) > self.max_seq_len:
            raise ResourceExhausted("sequence longer than max_seq_len")
        moves = [(L + k, L + p) for k, p in enumerate(path) if p != k]
        if moves:
            dst = torch.tensor([m[0] for m in moves])
            src = torch.tensor([m[1] for m in moves])
            self.k_cache[:, slot, :, dst] = self.k_cache[:, slot, :, src]
            self.v_cache[:, slot, :, dst] = self.v_cache[:, slot, :, src]
        self.lengths[slot] = L + len(path)

    def prefill(self, slot: int, tokens: Sequence[int]) -> torch.Tensor:
        """Append a chain of tokens to the slot; return the logits [V] after the last."""
        tokens = list(tokens)
        out = self.score(slot, tokens, list(range(-1, len(tokens) - 1)), rows=[len(tokens) - 1])
        self.commit(slot, range(len(tokens)))
        return out.logits[0]

    def score(self, slot: int, tokens: Sequence[int], parents: Sequence[int], rows: Optional[Sequence[int]] = None,
              hidden_layers: Sequence[int] = (), n_layers: Optional[int] = None, extra: int = 0) -> ScoreOutput:
        """Score one tree after the slot's committed tokens (see module docstring).
        rows: which nodes' logits to return (default all). n_layers: exit after the
        first n layers (layer-skip drafting). extra: number of scratch positions after
        the committed ones (an uncommitted chain written by earlier calls) that every
        node also attends to; nodes then start at storage offset ``extra``."""
        return self.score_batch([(slot, tokens, parents)], rows=[rows], hidden_layers=hidden_layers,
                                n_layers=n_layers, extra=[extra])[0]

    @torch.inference_mode()
    def score_batch(self, items: Sequence[tuple[int, Sequence[int], Sequence[int]]],
                    rows: Optional[Sequence[Optional[Sequence[int]]]] = None, hidden_layers: Sequence[int] = (),
                    n_layers: Optional[int] = None, extra: Optional[Sequence[int]] = None) -> list[ScoreOutput]:
        """Score several slots' trees in one forward: ragged, no padding."""
        n_layers = self.n_layers if n_layers is None else n_layers
        rows = rows or [None] * len(items)
        extra = extra or [0] * len(items)
        segs = []  # (slot, start in flat, n, base = committed + extra, mask or None)
        toks: list[int] = []
        pos: list[int] = []
        for (slot, t, par), ex in zip(items, extra):
            t, par = list(t), list(par)
            n = len(t)
            if n == 0:
                raise InvalidArgument("tokens", "empty")
            if len(par) != n:
                raise InvalidArgument("parents", f"{len(par)} parents for {n} tokens")
            for i, p in enumerate(par):
                if p < -1 or p >= i:
                    raise InvalidArgument("parents", f"node {i} has parent {p}")
            for x in t:
                if x < 0 or x >= self.vocab_size:
                    raise InvalidArgument("tokens", f"token id {x} outside [0, {self.vocab_size})")
            base = self.lengths[slot] + ex
            if base + n > self.max_seq_len:
                raise ResourceExhausted(f"sequence of {base + n} tokens exceeds max_seq_len={self.max_seq_len}")
            chain = all(p == i - 1 for i, p in enumerate(par))
            if n == 1:
                mask = None
            else:
                if chain:
                    mask = torch.ones(n, base + n, dtype=torch.bool, device=self.device).tril(base)
                else:
                    mask = torch.ones(n, base + n, dtype=torch.bool)
                    mask[:, base:] = ancestor_mask(par)
                # additive form, built once for all layers (SDPA would convert a bool mask in each)
                mask = torch.zeros(mask.shape, dtype=self.act_dtype, device=self.device).masked_fill_(~mask, float("-inf"))
            segs.append((slot, len(toks), n, base, mask))
            toks += t
            pos += [base + d for d in _depths(par)]
        ids = torch.tensor(toks, dtype=torch.long, device=self.device)
        posi = torch.tensor(pos, dtype=torch.long, device=self.device)
        cos = self.cos[posi][:, None]  # [N, 1, hd]
        sin = self.sin[posi][:, None]
        x = self.embed[ids].float()  # [N, H] residual stream, fp32 in every dtype mode
        ad = self.act_dtype
        hidden: dict[int, torch.Tensor] = {}
        nq, nk, hd = self.n_heads, self.n_kv, self.head_dim
        for li in range(n_layers):
            L = self.layers[li]
            h = rms_norm(x, L.ln1, self.eps, ad)
            qkv = L.qkv(h)  # [N, (nq + 2nk) * hd]
            qk = rope(qkv[:, : (nq + nk) * hd].view(-1, nq + nk, hd), cos, sin)  # [N, nq + nk, hd]
            q = qk[:, :nq].transpose(0, 1)  # [nq, N, hd]
            k = qk[:, nq:].transpose(0, 1)  # [nk, N, hd]
            v = qkv[:, (nq + nk) * hd:].view(-1, nk, hd).transpose(0, 1)
            outs = []
            for slot, s, n, base, mask in segs:
                kc, vc = self.k_cache[li, slot], self.v_cache[li, slot]  # [nk, T, hd]
                kc[:, base: base + n] = k[:, s: s + n]
                vc[:, base: base + n] = v[:, s: s + n]
                qs = q[:, s: s + n].unsqueeze(0)
                ks, vs = kc[:, : base + n].unsqueeze(0), vc[:, : base + n].unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
                outs.append(o[0])  # [nq, n, hd]
            a = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
            x = x + L.o(a.transpose(0, 1).reshape(-1, nq * hd))
            h = rms_norm(x, L.ln2, self.eps, ad)
            gu = L.gate_up(h)
            g_, u_ = gu.chunk(2, -1)
            x = x + L.down(F.silu(g_) * u_)
            if li in hidden_layers:
                hidden[li] = x.float()
        # one head matmul for the chosen rows of every segment (reading the head's
        # weights once per forward, not once per session)
        sels = [list(range(s, s + n)) if r is None else [s + int(i) for i in r]
                for (slot, s, n, base, mask), r in zip(segs, rows)]
        hn = rms_norm(x[torch.tensor([i for sel in sels for i in sel], dtype=torch.long)], self.norm, self.eps)
        logits = self.head(hn.to(ad) if ad != torch.float32 else hn).float()
        if ad != torch.float32:
            logits = self._refine_top(logits, hn)
        results, o = [], 0
        for (slot, s, n, base, mask), sel in zip(segs, sels):
            results.append(ScoreOutput(logits[o: o + len(sel)], {k: v[s: s + n] for k, v in hidden.items()}))
            o += len(sel)
        return results
