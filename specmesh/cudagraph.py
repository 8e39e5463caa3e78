"""CUDA-graph forwards for the serving engine: ``GraphedEngine``.

On a GPU the eager ``LlamaEngine`` forward costs about the same whatever the number of
scored tokens (kernel launches and Python, not arithmetic: ~11 ms on an H200 for 1 or
32 tokens). A CUDA graph replays a whole forward's kernels with one launch, but wants
static shapes and static memory. ``GraphedEngine`` is a ``LlamaEngine`` (same
``score`` / ``score_batch`` / slot API, so ``EngineVerifier`` and the drafters use it
unchanged) that gives the forward both:

- Buckets. A call with b sessions of at most t scored tokens each runs as the smallest
  bucket (B, T) with B >= b and T >= t (default B in 1/2/4/8/16/32, T in 1/2/4/8/16),
  padded. Larger calls (prompt prefill, big batches), two items on one slot, and
  anything invalid go to the eager ``LlamaEngine.score_batch`` (which also raises the
  errors). Both paths compute the same function; their logits differ by rounding only
  (summation order over the padded keys; tested at 1e-4 in fp32).
- Static inputs. One int64 buffer per bucket holds token ids, positions, KV write
  targets, the row -> slot map, each row's key length (committed + extra) and the
  tree's ancestry; one host-to-device copy fills it per call.
- A static-shape forward. Every row attends over its slot's whole KV cache
  (``max_seq_len`` keys) with an additive mask built on the device from the row's key
  length and ancestry: keys before the row's first scored position, plus the row's
  own ancestors. Real tokens write their KV where the eager engine would; padding
  tokens and padding rows write into one extra scratch slot (the engine holds
  ``n_slots + 1`` KV slots; callers see ``n_slots``).
- Capture. On CUDA, one ``torch.cuda.CUDAGraph`` per (bucket, layers run, hidden layers
  kept) is captured on first use, after a warm-up on a side stream, all graphs in one
  memory pool (safe because each replay's outputs are copied out before the next
  replay); each call replays it and copies the requested rows out (a capture
  that fails is logged and counted in ``calls``; that bucket then runs uncaptured). With
  ``capture=False`` (the default off CUDA) the same static forward runs eagerly: that is
  how the CPU tests check padding, bucketing and masking against the eager engine.

- Batch invariance (``invariant=True``): every forward runs as the same one bucket (all
  slots x ``invariant_tokens``), and a longer chain (a prompt) as consecutive chunks of
  that size, each seeing the earlier chunks' KV. A row then meets the same kernels with
  the same shapes whether it is scored alone, as row j of a chain or of a prompt chunk,
  as a tree node or beside other sessions, and it sees the same keys (the mask is built
  from its position and ancestry), so its logits, hidden states and KV do not depend on
  what else is scored: greedy speculation equals plain decoding in bf16 too. The
  assumption is that a GPU kernel's result for a row depends only on the shapes and that
  row's inputs (true of GEMMs without split-K over rows and of per-query attention); it
  is checked where it runs (``tests/deploy/test_cuda.py``), not guaranteed. The cost: every
  forward computes the whole bucket (on a GPU, where a step is bound by launches and
  memory, a 64-token forward costs about what a 1-token one does), and prefill takes one
  forward per chunk.

What it does not know or do: it has not been measured on a GPU yet (``specmesh
device-check`` does that); attention reads all ``max_seq_len`` keys of a slot
(fine at 2048, a paged or split-K decode kernel would scale better); logits are
computed for every padded row; each new bucket pays one capture (``warm_up`` captures
them ahead). It knows nothing about sessions, sampling or drafting.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .engine import LlamaEngine, ScoreOutput, rms_norm, rope
from .trees import ancestor_mask

log = logging.getLogger("specmesh.cudagraph")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # 32 / 64: trees, and uno rounds with their mask blocks


def _bucket(n: int, buckets: Sequence[int]) -> Optional[int]:
    return next((b for b in buckets if b >= n), None)


class _Step:
    """Static buffers (and, on CUDA, the graph) of one bucket. B rows, T tokens a row,
    N = B * T. ``inp`` is one int64 buffer; the named tensors are views of it."""

    def __init__(self, B: int, T: int, n_layers: int, hidden_layers: tuple, device: torch.device):
        self.B, self.T, self.n_layers, self.hidden_layers = B, T, n_layers, hidden_layers
        shapes = self.shapes(B, T)
        self.inp = torch.zeros(sum(s.numel() for s in shapes.values()), dtype=torch.long, device=device)
        o = 0
        for name, shape in shapes.items():
            setattr(self, name, self.inp[o: o + shape.numel()].view(shape))
            o += shape.numel()
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out: Optional[tuple[torch.Tensor, dict]] = None  # logits [N, V] f32, {layer: [N, H] f32}

    @staticmethod
    def shapes(B: int, T: int) -> dict:
        return {"ids": torch.Size((B, T)),    # token ids
                "pos": torch.Size((B, T)),    # RoPE positions: key length + depth
                "wslot": torch.Size((B, T)),  # KV slot each token writes (scratch slot for padding)
                "wpos": torch.Size((B, T)),   # KV position each token writes
                "slots": torch.Size((B,)),    # slot whose KV each row reads (scratch slot for padding rows)
                "base": torch.Size((B,)),     # key length before the row's first scored token
                "gate": torch.Size((B, T)),   # 1: the attached adapter applies to the token's row
                "anc": torch.Size((B, T, T))}  # anc[b, i, j] = 1: token j is token i or its ancestor


class GraphedEngine(LlamaEngine):
    def __init__(self, config: dict, state_dict: dict, dtype: str = "fp32", n_slots: int = 4,
                 max_seq_len: int = 2048, device="cpu", capture: Optional[bool] = None,
                 batch_buckets: Sequence[int] = BATCH_BUCKETS, token_buckets: Sequence[int] = TOKEN_BUCKETS,
                 warmup_iters: int = 2, invariant: bool = False, invariant_tokens: int = 64):
        """``capture``: record CUDA graphs (default: when the device is CUDA). Batch
        buckets beyond the first one that holds every slot are never needed and dropped.
        ``invariant``: the batch-invariant mode (module docstring): one bucket, every slot
        x ``invariant_tokens`` tokens, for every forward, longer chains (prefill) in
        chunks of that size."""
        super().__init__(config, state_dict, dtype=dtype, n_slots=n_slots + 1, max_seq_len=max_seq_len,
                         device=device)
        self.n_slots = n_slots  # the last KV slot is the padding's scratch
        self.scratch = n_slots
        self.lengths = [0] * n_slots
        self.capture = self.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and self.device.type != "cuda":
            raise ValueError("capture=True needs a CUDA device")
        bb = sorted(set(int(b) for b in batch_buckets))
        top = _bucket(n_slots, bb) or bb[-1]
        self.batch_buckets = tuple(b for b in bb if b <= top)
        self.token_buckets = tuple(sorted(set(int(t) for t in token_buckets if 0 < int(t) <= max_seq_len)))
        self.invariant = bool(invariant)
        if self.invariant:  # one shape for every forward: a row meets the same kernels whatever else is scored
            if not 0 < invariant_tokens <= max_seq_len:
                raise ValueError(f"invariant_tokens must be in [1, max_seq_len], got {invariant_tokens}")
            self.batch_buckets, self.token_buckets = (max(self.batch_buckets),), (int(invariant_tokens),)
        self.warmup_iters = warmup_iters
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)  # [T, hd] tables on the device
        self._keys = torch.arange(max_seq_len, device=self.device)  # [S] key positions
        self._steps: dict[tuple, _Step] = {}
        self._pool = None
        self.calls = {"graphed": 0, "eager": 0, "captures": 0}

    # ------------------------------------------------------------------ planning
    def attach_adapter(self, adapter) -> None:
        """As ``LlamaEngine.attach_adapter``; the captured graphs are dropped (recaptured
        with or without the adapter's terms on first use)."""
        super().attach_adapter(adapter)
        self._steps.clear()

    def _plan(self, items, rows, n_layers, extra, gated=None) -> Optional[tuple[int, int, list]]:
        """(B, T, [(slot, tokens, parents, base, rows, gated)]) when the call fits a bucket
        and is valid; None sends it to the eager engine."""
        if not items or not 1 <= n_layers <= self.n_layers:
            return None
        extra = extra or [0] * len(items)
        rows = rows or [None] * len(items)
        gated = gated or [None] * len(items)
        B = _bucket(len(items), self.batch_buckets)
        if B is None or len(extra) != len(items) or len(rows) != len(items) or len(gated) != len(items):
            return None
        top = self.vocab_size + (self.adapter is not None)  # mask_id with an adapter
        segs, seen, t_max = [], set(), 0
        for (slot, toks, par), ex, r, g in zip(items, extra, rows, gated):
            toks, par = list(toks), list(par)
            n = len(toks)
            if not isinstance(slot, int) or not 0 <= slot < self.n_slots or slot in seen:
                return None
            if n == 0 or len(par) != n or any(p < -1 or p >= i for i, p in enumerate(par)):
                return None
            if any(t < 0 or t >= top for t in toks):
                return None
            g = [i for i, t in enumerate(toks) if t == self.mask_id] if g is None else [int(i) for i in g]
            if any(not 0 <= i < n for i in g) or (g and self.adapter is None):
                return None
            base = self.lengths[slot] + ex
            if ex < 0 or base + n > self.max_seq_len:
                return None
            sel = list(range(n)) if r is None else [int(i) for i in r]
            if any(not 0 <= i < n for i in sel):
                return None
            seen.add(slot)
            t_max = max(t_max, n)
            segs.append((slot, toks, par, base, sel, g))
        T = _bucket(t_max, self.token_buckets)
        return None if T is None else (B, T, segs)

    def _pack(self, B: int, T: int, segs: list) -> torch.Tensor:
        """Host tensor of a step's ``inp`` for these segments (padding: scratch slot)."""
        ids = torch.zeros(B, T, dtype=torch.long)
        pos = torch.zeros(B, T, dtype=torch.long)
        wslot = torch.full((B, T), self.scratch, dtype=torch.long)
        wpos = torch.arange(T).expand(B, T).clone()
        slots = torch.full((B,), self.scratch, dtype=torch.long)
        base = torch.zeros(B, dtype=torch.long)
        gate = torch.zeros(B, T, dtype=torch.long)
        anc = torch.eye(T, dtype=torch.long).expand(B, T, T).clone()  # padding tokens see themselves
        for b, (slot, toks, par, bs, _, g) in enumerate(segs):
            n = len(toks)
            depth: list[int] = []
            for p in par:
                depth.append(0 if p < 0 else depth[p] + 1)
            ids[b, :n] = torch.tensor(toks)
            pos[b, :n] = bs + torch.tensor(depth)
            wslot[b, :n] = slot
            wpos[b, :n] += bs
            slots[b], base[b] = slot, bs
            anc[b, :n, :n] = ancestor_mask(par)
            gate[b, g] = 1
        return torch.cat([t.reshape(-1) for t in (ids, pos, wslot, wpos, slots, base, gate, anc)])

    # ------------------------------------------------------------------ the static forward
    def _forward(self, st: _Step) -> tuple[torch.Tensor, dict]:
        """The bucket's forward on its static inputs; shapes depend on (B, T) only."""
        B, T, S = st.B, st.T, self.max_seq_len
        N, ad = B * T, self.act_dtype
        nq, nk, hd = self.n_heads, self.n_kv, self.head_dim
        wslot, wpos = st.wslot.reshape(N), st.wpos.reshape(N)
        # additive mask [B, 1, T, S]: keys before the row's first scored token, and its ancestors
        rel = self._keys[None] - st.base[:, None]  # [B, S] key position relative to the row's base
        tree = st.anc.gather(2, rel.clamp(0, T - 1)[:, None].expand(B, T, S)) != 0  # [B, T, S]
        vis = (rel < 0)[:, None] | (tree & (rel < T)[:, None])  # [B, T, S]
        mask = torch.zeros(B, 1, T, S, dtype=ad, device=self.device).masked_fill_(~vis[:, None], float("-inf"))
        pos = st.pos.reshape(N)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [N, 1, hd]
        ids = st.ids.reshape(N)
        ad_ = self.adapter
        if ad_ is None:
            x = self.embed[ids].float()  # [N, H] fp32 residual stream
            gate = None
        else:  # mask rows read the adapter's MASK vector; gated rows get its low-rank terms (0/1 gate)
            x = torch.where((ids == self.mask_id)[:, None], ad_.mask[None],
                            self.embed[ids.clamp_max(self.vocab_size - 1)].float())
            gate = st.gate.reshape(N, 1).to(ad)

        def lin(layer, proj, h):
            y = getattr(layer, proj)(h)
            if gate is not None:
                d = ad_.delta(li, proj, h)
                if d is not None:
                    y = y + gate * d.to(y.dtype)
            return y

        hidden: dict[int, torch.Tensor] = {}
        for li in range(st.n_layers):
            L = self.layers[li]
            h = rms_norm(x, L.ln1, self.eps, ad)
            qkv = lin(L, "qkv", h)  # [N, (nq + 2nk) * hd]
            qk = rope(qkv[:, : (nq + nk) * hd].view(N, nq + nk, hd), cos, sin)  # [N, nq + nk, hd]
            q = qk[:, :nq].reshape(B, T, nq, hd).transpose(1, 2)  # [B, nq, T, hd]
            kc, vc = self.k_cache[li], self.v_cache[li]  # [n_slots + 1, nk, S, hd]
            kc[wslot, :, wpos] = qk[:, nq:]  # [N, nk, hd] into each token's (slot, position)
            vc[wslot, :, wpos] = qkv[:, (nq + nk) * hd:].view(N, nk, hd)
            ks, vs = kc.index_select(0, st.slots), vc.index_select(0, st.slots)  # [B, nk, S, hd]
            o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=True)  # [B, nq, T, hd]
            x = x + lin(L, "o", o.transpose(1, 2).reshape(N, nq * hd))
            g_, u_ = lin(L, "gate_up", rms_norm(x, L.ln2, self.eps, ad)).chunk(2, -1)
            x = x + lin(L, "down", F.silu(g_) * u_)
            if li in st.hidden_layers:
                hidden[li] = x
        hn = rms_norm(x, self.norm, self.eps)  # [N, H] fp32
        logits = self.head(hn.to(ad) if ad != torch.float32 else hn).float()  # [N, V]
        if ad != torch.float32:
            logits = self._refine_top(logits, hn)
        return logits, hidden

    # ------------------------------------------------------------------ capture / replay
    def _step(self, B: int, T: int, n_layers: int, hidden_layers: tuple) -> _Step:
        key = (B, T, n_layers, hidden_layers)
        st = self._steps.get(key)
        if st is None:
            st = _Step(B, T, n_layers, hidden_layers, self.device)
            st.inp.copy_(self._pack(B, T, []))  # idle inputs: every write goes to the scratch slot
            if self.capture:
                try:
                    self._capture(st)
                except Exception as e:  # noqa: BLE001 - the bucket then runs its static forward uncaptured
                    st.graph = None
                    self.calls["capture_errors"] = self.calls.get("capture_errors", 0) + 1
                    log.warning("CUDA graph capture of bucket %s failed (%s: %s); running it without a graph",
                                key, type(e).__name__, e)
            self._steps[key] = st
        return st

    def _capture(self, st: _Step) -> None:
        """Warm up on a side stream (allocator, cuBLAS handles), then record one graph."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup_iters):
                    self._forward(st)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                st.out = self._forward(st)
            st.graph = g
        self.calls["captures"] += 1

    @torch.inference_mode()
    def warm_up(self, batch_sizes: Sequence[int] = (1,), tokens: Optional[Sequence[int]] = None,
                hidden_layers: Sequence[int] = ()) -> int:
        """Capture (or build) the buckets for these batch sizes x token counts ahead of
        the first requests; returns how many steps exist."""
        hl = tuple(sorted(set(int(i) for i in hidden_layers)))
        for b in batch_sizes:
            for t in tokens or self.token_buckets:
                B, T = _bucket(b, self.batch_buckets), _bucket(t, self.token_buckets)
                if B is not None and T is not None:
                    self._step(B, T, self.n_layers, hl)
        return len(self._steps)

    def _invariant_split(self, items, rows, hidden_layers, n_layers, extra, gated) -> list[ScoreOutput]:
        """Invariant mode, a call with items longer than the bucket: the short items in one
        bucket forward, each long chain in chunks of the bucket's size (each chunk sees the
        earlier ones' scratch KV through ``extra``: every token sees the keys it would in
        one forward and writes its KV where it would). A long item that is not a chain
        goes to the eager engine (not invariant; counted in ``calls['eager']``)."""
        T = self.token_buckets[0]
        n = len(items)
        rows, extra, gated = rows or [None] * n, extra or [0] * n, gated or [None] * n
        out: list = [None] * n
        short = [i for i, (_, t, _) in enumerate(items) if len(t) <= T]
        if short:
            res = self.score_batch([items[i] for i in short], rows=[rows[i] for i in short],
                                   hidden_layers=hidden_layers, n_layers=n_layers, extra=[extra[i] for i in short],
                                   gated=[gated[i] for i in short])
            for i, r in zip(short, res):
                out[i] = r
        for i in (i for i in range(n) if out[i] is None):
            slot, toks, par = items[i]
            toks, par = list(toks), list(par)
            if par != list(range(-1, len(toks) - 1)):
                self.calls["eager"] += 1
                out[i] = LlamaEngine.score_batch(self, [items[i]], rows=[rows[i]], hidden_layers=hidden_layers,
                                                 n_layers=n_layers, extra=[extra[i]], gated=[gated[i]])[0]
                continue
            want = list(range(len(toks))) if rows[i] is None else [int(j) for j in rows[i]]
            g = set(j for j, t in enumerate(toks) if t == self.mask_id) if gated[i] is None else set(gated[i])
            logits, hid, got = [], {}, []
            for a in range(0, len(toks), T):
                b = min(a + T, len(toks))
                sel = [j for j in want if a <= j < b]
                r = self.score_batch([(slot, toks[a:b], list(range(-1, b - a - 1)))],
                                     rows=[[j - a for j in sel] or [b - a - 1]], hidden_layers=hidden_layers,
                                     n_layers=n_layers, extra=[extra[i] + a], gated=[[j - a for j in g if a <= j < b]])[0]
                if sel:
                    logits.append(r.logits)
                    got += sel
                for li, h in r.hidden.items():
                    hid.setdefault(li, []).append(h)
            lg = torch.cat(logits) if logits else torch.empty(0, self.vocab_size, device=self.device)
            if got != want:  # the rows in the order asked for
                lg = lg[torch.tensor([got.index(j) for j in want], dtype=torch.long, device=self.device)]
            out[i] = ScoreOutput(lg, {li: torch.cat(hs) for li, hs in hid.items()})
        return out

    @torch.inference_mode()
    def score_batch(self, items: Sequence[tuple[int, Sequence[int], Sequence[int]]],
                    rows: Optional[Sequence[Optional[Sequence[int]]]] = None, hidden_layers: Sequence[int] = (),
                    n_layers: Optional[int] = None, extra: Optional[Sequence[int]] = None,
                    gated: Optional[Sequence[Optional[Sequence[int]]]] = None) -> list[ScoreOutput]:
        """``LlamaEngine.score_batch`` through a bucket's static forward (replayed graph
        on CUDA); calls that fit no bucket run eagerly."""
        nl = self.n_layers if n_layers is None else n_layers
        if self.invariant and any(len(t) > self.token_buckets[0] for _, t, _ in items):
            return self._invariant_split(items, rows, hidden_layers, n_layers, extra, gated)
        plan = self._plan(items, rows, nl, extra, gated)
        if plan is None:
            self.calls["eager"] += 1
            return super().score_batch(items, rows=rows, hidden_layers=hidden_layers, n_layers=n_layers, extra=extra,
                                       gated=gated)
        B, T, segs = plan
        hl = tuple(sorted(set(int(i) for i in hidden_layers if 0 <= int(i) < nl)))
        st = self._step(B, T, nl, hl)
        st.inp.copy_(self._pack(B, T, segs))  # one host-to-device copy
        if st.graph is not None:
            st.graph.replay()
        else:
            st.out = self._forward(st)
        logits, hidden = st.out
        self.calls["graphed"] += 1
        # copy the requested rows out of the static outputs (the next replay overwrites them)
        flat = [b * T + i for b, seg in enumerate(segs) for i in seg[4]]
        picked = logits.index_select(0, torch.tensor(flat, dtype=torch.long, device=self.device))
        kept = {li: h.view(B, T, -1)[: len(segs)].clone() for li, h in hidden.items()}  # [b, T, H]
        out, o = [], 0
        for b, (slot, toks, par, base, sel, _) in enumerate(segs):
            out.append(ScoreOutput(picked[o: o + len(sel)], {li: h[b, : len(toks)] for li, h in kept.items()}))
            o += len(sel)
        return out
