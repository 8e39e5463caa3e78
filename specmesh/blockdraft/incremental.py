"""The block drafter's serving pass: one block after the whole context, context cached.

``FoldedDrafter`` holds a ``BlockDrafter``'s weights rearranged for the one case a
serving round needs — a single block whose anchor directly follows the context window
— and computes the same function as ``BlockDrafter.forward_batch`` for it (up to
rounding; tested):

- RMSNorm weights that feed a single matrix are folded into it (feature norm into the
  feature projection, ln2 into gate/up, the final norm into the head slice);
- the feature projection and, with ``fuse_last``, the last-position fusion projection
  are one matrix (the fusion's RMSNorm divides by a per-row scalar, applied after);
- q and the shared k/v projection are one matrix, applied to the new context rows and
  the block's rows in one product (the context rows' q is computed and thrown away);
- no attention mask: the block sees its whole window and itself; on the CPU the
  attention is the key-list kernel's (``keylist_attention``: each block row names the
  cache rows it sees; 230 vs torch SDPA's 325 us a layer for 8 bf16 rows against 264
  keys, the row lists' construction included; a whole draft 2.2-2.5 -> 1.9-2.5 ms in
  int4 rounds, same drafts), SDPA elsewhere or where the kernel does not build.

A round thus reads ten weight matrices instead of fifteen. Right after the target's
forward has pushed the drafter out of the CPU caches, every matrix read costs a fixed
~0.2-0.3 ms on top of its bytes, so their number, not the FLOPs, sets the draft time.

``ContextCache`` holds the drafter's state of a contiguous range of context positions:
the features each row was computed from, the fusion vector and every layer's
keys/values. ``FoldedDrafter.draft`` extends it by the new positions only, drops rows
that fell out of the window or past a rollback, and rebuilds it when the features of
the last reused row changed (a rewritten past changes every later hidden state).

Every tensor lives on the device of the model's weights (the cache's buffers too, and
the target features ``read`` returns are moved there).

Knows nothing about sessions, verifiers, sampling or training.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..engine.device import host_equal
from .model import BlockDrafter


class ContextCache:
    """Drafter state of positions [start, start + n), held in rows [off, off + n) of
    preallocated buffers; the ``block`` rows after them are scratch for the block's own
    keys/values, so attention reads one slice without a copy. Keys and values are
    stored head-major ([layer, k/v, head, row, head_dim]: attention reads each head's
    rows contiguously, ~0.1 ms less per layer than a row-major view)."""

    def __init__(self, n_layers: int, capacity: int, block: int, n_features: int, n_heads: int,
                 head_dim: int, fuse: bool, dtype: torch.dtype, device=None):
        self.capacity = capacity
        self.feats = torch.empty(capacity, n_features, dtype=dtype, device=device)
        self.fused = torch.empty(capacity, n_heads * head_dim, dtype=dtype, device=device) if fuse else None
        self.kv = torch.empty(n_layers, 2, n_heads, capacity + block, head_dim, dtype=dtype, device=device)
        self.start = self.n = self.off = 0
        self.stamps: dict[int, object] = {}  # position -> the stamp of the features its row was computed from

    @property
    def end(self) -> int:
        return self.start + self.n

    def keep(self, lo: int, hi: int) -> None:
        """Keep positions [lo, hi) (within the cached range), drop the rest."""
        self.off += lo - self.start
        self.n, self.start = max(0, hi - lo), lo

    def reset(self, start: int) -> None:
        self.start, self.n, self.off = start, 0, 0

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more rows after the cached ones (moving those to the
        front of the buffers when the end is reached)."""
        if self.n + extra > self.capacity:
            raise ValueError(f"{self.n} cached + {extra} new context rows exceed the cache capacity {self.capacity}")
        if self.off + self.n + extra > self.capacity:
            src = slice(self.off, self.off + self.n)
            self.feats[: self.n] = self.feats[src].clone()
            if self.fused is not None:
                self.fused[: self.n] = self.fused[src].clone()
            self.kv[..., : self.n, :] = self.kv[..., src, :].clone()
            self.off = 0


class FoldedDrafter:
    def __init__(self, model: BlockDrafter, dtype: Optional[torch.dtype] = None, weights: str = "float"):
        """``dtype``: compute dtype (default: the model's). Weights are folded in float32,
        then cast. ``weights="int4"`` (bf16 compute, CPU): the ten matrices as the int4
        engine's group-wise weights (``engine.Linear``; its kernel's cost grows slowly
        with the rows, where bf16's small-row products are slow), for an int4 target: a
        draft changes speed only, never the output. ``weights="bf16"`` (CPU): the ten
        matrices as the bf16 engine's ``Linear`` (``specmesh.engine.bf16_matmul`` where it
        builds: the 8 rows of a draft cost about one), for a bf16 target."""
        if weights not in ("float", "int4", "bf16"):
            raise ValueError(f"weights must be 'float', 'int4' or 'bf16', got {weights!r}")
        if weights in ("int4", "bf16"):
            dtype = torch.bfloat16
        cfg = model.cfg
        self.cfg = cfg
        self.dtype = dtype = dtype or model.feat_proj.weight.dtype
        H = cfg.hidden
        self.nh, self.hd = cfg.n_heads, H // cfg.n_heads

        def f(t):
            return t.detach().float()

        with torch.no_grad():
            w_in = f(model.feat_proj.weight) * f(model.feat_norm.weight)[None]  # [H, F]
            mats = [w_in]
            if cfg.fuse_last:
                # last_proj(last_norm(c)) = (W_lp diag(w_ln) c) / rms(c), and c = w_in n(f)
                mats.append((f(model.last_proj.weight) * f(model.last_norm.weight)[None]) @ w_in)
            self.w_in = torch.cat(mats).to(dtype).contiguous()  # [H or 2H, F]
            self.fuse_out = (f(model.fuse_out.weight).to(dtype)
                             if cfg.fuse_last and cfg.fuse_norm else None)
            self.layers = [dict(
                ln_ctx=f(layer.ln_ctx.weight).to(dtype), ln1=f(layer.ln1.weight).to(dtype),
                qkv=torch.cat([f(layer.q.weight), f(layer.kv.weight)]).to(dtype).contiguous(),  # [3H, H]
                o=f(layer.o.weight).to(dtype).contiguous(),
                gate_up=(f(layer.gate_up.weight) * f(layer.ln2.weight)[None]).to(dtype).contiguous(),
                down=f(layer.down.weight).to(dtype).contiguous()) for layer in model.layers]
            self.head = (f(model.head) * f(model.final_norm)[None]).to(dtype).contiguous()  # [N, H]
            self.embed = model.embed  # [V, H], indexed one row per round
            base = f(model.mask_emb).expand(cfg.block, H).clone()
            base[0] = 0.0
            self.block_base = (base + f(model.pos_emb)).to(dtype)  # [B, H]: slot 0 still needs the anchor
        self.device = self.w_in.device
        self._keylist = None  # the CPU's key-list attention kernel (None: SDPA)
        if self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and self.hd % 16 == 0:
            from ..engine.keylist_attention import load as load_keylist

            self._keylist = load_keylist()
        self.weights = weights
        if weights in ("int4", "bf16"):
            from ..engine import Linear

            def q4(w):
                return Linear(w.float(), None, weights)

            self.w_in, self.head = q4(self.w_in), q4(self.head)
            for w in self.layers:
                for k in ("qkv", "o", "gate_up", "down"):
                    w[k] = q4(w[k])

    def _lin(self, x: torch.Tensor, w) -> torch.Tensor:
        """x @ w.T for a folded matrix (a tensor, or an int4 / bf16 ``Linear``)."""
        return x @ w.T if isinstance(w, torch.Tensor) else w(x.contiguous())

    def new_cache(self) -> ContextCache:
        c = self.cfg
        return ContextCache(c.n_layers, 2 * c.context_window + c.block, c.block, len(c.feature_layers) * c.hidden,
                            self.nh, self.hd, c.fuse_last, self.dtype, self.device)

    def _rms(self, x: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.eps)

    def _block_rows(self, off: int, T: int):
        """The key-list kernel's rows for one draft (None without the kernel): each of the
        block's rows sees the cache rows [off, off + T), the context window and the block."""
        if self._keylist is None:
            return None
        from ..engine.keylist_attention import RowKeys

        B, i32 = self.cfg.block, torch.int32
        return RowKeys(slot=torch.zeros(B, dtype=i32), ctx=torch.zeros(B, dtype=i32),
                       off=torch.arange(B, dtype=i32) * T, cnt=torch.full((B,), T, dtype=i32),
                       anc=torch.arange(off, off + T, dtype=i32).repeat(B), n=B)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, keys, off: int, T: int) -> torch.Tensor:
        """Attention of the block's queries q [B, nh, hd] over the cache rows [off, off + T)
        of one layer's kv [2, nh, rows, hd] (``keys``: ``_block_rows``, or None): [B, nh * hd]."""
        B = q.shape[0]
        if keys is not None:
            return self._keylist(q, kv[0][None], kv[1][None], keys, self.hd ** -0.5).reshape(B, -1)
        k, v = kv[:, :, off: off + T]
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v).transpose(0, 1).reshape(B, -1)

    @torch.inference_mode()
    def draft(self, cache: ContextCache, anchor: int, length: int,
              read: Callable[[int, int], torch.Tensor],
              stamp: Optional[Callable[[int], object]] = None) -> torch.Tensor:
        """Logits [B-1, N] (float32, over ``keep_ids``) of the block after ``anchor``, the
        token at position ``length``; ``read(a, b)`` returns the target features of
        context positions [a, b) as [b - a, F]. ``stamp(p)``, where the features' owner
        keeps one: a host value that changes whenever position p's features are written
        again (the reuse check then reads nothing from the device); without it the
        check compares the last reused row's features (one host read). Updates
        ``cache`` in place."""
        cfg, H = self.cfg, self.cfg.hidden
        c0 = max(0, length - cfg.context_window)
        m = min(cache.end, length)
        reuse = cache.start <= c0 < m
        if reuse and stamp is not None:  # the last reused row's features were not written since
            reuse = m - 1 in cache.stamps and cache.stamps[m - 1] == stamp(m - 1)
        elif reuse:  # the last reused row must still hold the features it was computed from
            last = read(m - 1, m)[0].to(device=self.device, dtype=self.dtype)
            reuse = host_equal(last, cache.feats[cache.off + m - 1 - cache.start], "drafter cache check")
        if reuse:
            cache.keep(c0, m)
            for p in [p for p in cache.stamps if not c0 <= p < m]:
                del cache.stamps[p]
        else:
            cache.reset(c0)
            cache.stamps.clear()
        new = length - cache.end
        cache.reserve(new)
        lo = cache.off + cache.n  # buffer row of the first new position
        ctx_new = None
        if new:
            if stamp is not None:
                cache.stamps.update((p, stamp(p)) for p in range(cache.end, length))
            feats = read(cache.end, length).to(device=self.device, dtype=self.dtype)
            cache.feats[lo: lo + new] = feats
            y = self._lin(self._rms(feats, None), self.w_in)
            ctx_new = y[:, :H]
            if cache.fused is not None:
                fused = y[:, H:] * torch.rsqrt(ctx_new.float().pow(2).mean(-1, keepdim=True) + cfg.eps).to(self.dtype)
                cache.fused[lo: lo + new] = fused if self.fuse_out is None else self._rms(fused, self.fuse_out)
            cache.n += new
        x = self.block_base.clone()
        x[0] += self.embed[anchor].to(self.dtype)
        if cache.fused is not None and cache.n:
            x += cache.fused[cache.off + cache.n - 1]
        T = cache.n + cfg.block
        keys = self._block_rows(cache.off, T)
        for i, w in enumerate(self.layers):
            rows = self._rms(x, w["ln1"])
            if ctx_new is not None:
                rows = torch.cat([self._rms(ctx_new, w["ln_ctx"]), rows])
            out = self._lin(rows, w["qkv"])  # [new + B, 3H]
            kv = cache.kv[i]  # [2, nh, rows, hd]
            kv[:, :, lo: lo + new + cfg.block] = out[:, H:].view(-1, 2, self.nh, self.hd).permute(1, 2, 0, 3)
            q = out[new:, :H].view(cfg.block, self.nh, self.hd)  # [B, nh, hd]
            x = x + self._lin(self._attend(q, kv, keys, cache.off, T), w["o"])
            g, u = self._lin(self._rms(x, None), w["gate_up"]).chunk(2, -1)
            x = x + self._lin(F.silu(g) * u, w["down"])
        return self._lin(self._rms(x[1:], None), self.head).float()
