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
- A static-shape forward. Every row attends over the first S keys of its slot's KV
  cache, S the smallest key bucket (``key_buckets``, default 256 ... ``max_seq_len``) that
  holds every row's key length, with an additive mask built on the device from the
  row's key length and ancestry: keys before the row's first scored position, plus the
  row's own ancestors. A KV head's query heads are folded into its rows, so attention
  is a plain multi-head SDPA call with a mask (on CUDA the fused memory-efficient
  kernel takes it; ``enable_gqa`` with a mask would be the math kernel's). Chains carry
  a mask too: their rows' real lengths change from replay to replay inside one graph.
  Real tokens write their KV where the eager engine would; padding tokens and padding
  rows write into one extra scratch slot (the engine holds ``n_slots + 1`` KV slots;
  callers see ``n_slots``).
- The adapter's terms only where a row needs them. With a mask-gated adapter attached
  (``specmesh.uno``), a call with a gated row or a mask row runs a bucket captured with
  the adapter (MASK-vector input, low-rank terms on every row times a 0/1 gate); every
  other call, a plain step or verify, runs the bucket without them: the same kernels as
  with no adapter attached.
- Capture. On CUDA, one ``torch.cuda.CUDAGraph`` per (bucket, layers run, hidden layers
  kept, key bucket, adapter terms or not) is captured, after a warm-up on a side stream,
  all graphs in one memory pool (safe because each replay's outputs are copied out
  before the next replay); each call replays it and copies the requested rows out.
  ``warm_up`` captures ahead (``Runtime`` does it at start-up for every bucket its
  configuration uses, before a service reports SERVING; ``keep_hidden`` makes every
  bucket keep the union of the hidden layers callers read, so one graph serves them
  all); a capture after that (``serving``) is counted in ``calls["serving_captures"]``
  (the verifier's ``specmesh_cuda_graph_captures_total``). ``calls`` tells a replayed
  graph (``replayed``) from a bucket's static forward run without one (``uncaptured``: a
  failed capture, logged and counted in ``capture_errors``; ``uncaptured_buckets()``
  names them): the CUDA tests fail on any. With ``capture=False`` (the default off CUDA)
  the same static forward runs eagerly: that is how the CPU tests check padding,
  bucketing and masking against the eager engine.

- Batch invariance (``invariant=True``): every forward runs as the same one bucket (all
  slots x ``invariant_tokens`` over all ``max_seq_len`` keys), and a longer chain (a
  prompt) as consecutive chunks of that size, each seeing the earlier chunks' KV. A
  chain's row then meets the same kernels with the same shapes whether it is scored
  alone, as row j of a chain or of a prompt chunk, or beside other sessions, and sees
  the same keys at the same indices, so its logits, hidden states and KV do not depend
  on what else is scored: greedy speculation with a chain drafter equals plain decoding
  in bf16 too. Not for tree nodes: a node's KV is written at base + node index (tree
  layout), so it sees its ancestors at other key indices than the same tokens decoded
  as a chain, and attention's sums over those indices may round differently (the CPU
  engine attends a tree one root-to-leaf path at a time, or names each row's keys, to
  avoid that; this one does not). Nor for calls this mode sends to the eager engine
  (a long item that is not a chain, anything ``_plan`` refuses), nor for
  ``head_logits`` (layer-skip's and the contrastive amateur's head, run eagerly on the
  rows given). The assumption is that a GPU kernel's result for a row depends only on
  the shapes and that row's inputs (true of GEMMs without split-K over rows and of
  per-query attention); it is checked where it runs (``tests/deploy/test_cuda.py``), not
  guaranteed. The cost: every forward computes the whole bucket (on a GPU, where a step
  is bound by launches and memory, a 64-token forward costs about what a 1-token one
  does), and prefill takes one forward per chunk.

What it does not know or do: it has not been measured on a GPU yet (``specmesh
device-check`` does that); attention reads a key bucket's keys with a float mask (up to
twice a slot's real length, gathered per row: a varlen kernel that reads each row's
length from device memory, flash's ``seqused_k``, would read only the real ones and
need no mask for chains); with an adapter's terms, the low-rank terms run on every row
of that bucket, gated or not; logits are computed for every padded row; each new bucket
pays one capture. It knows nothing about sessions, sampling or drafting.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..trees import ancestor_mask
from .device import to_device
from .llama import LlamaEngine, ScoreOutput, rms_norm, rope

log = logging.getLogger("specmesh.engine.cudagraph")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # 32 / 64: trees, and uno rounds with their mask blocks
KEY_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)  # keys a forward attends over (and max_seq_len)


def _bucket(n: int, buckets: Sequence[int]) -> Optional[int]:
    return next((b for b in buckets if b >= n), None)


class _Step:
    """Static buffers (and, on CUDA, the graph) of one bucket. B rows, T tokens a row,
    N = B * T. ``inp`` is one int64 buffer; the named tensors are views of it."""

    def __init__(self, B: int, T: int, n_layers: int, hidden_layers: tuple, device: torch.device, S: int = 0,
                 adapted: bool = False):
        self.B, self.T, self.n_layers, self.hidden_layers = B, T, n_layers, hidden_layers
        self.S = S  # keys attended: every row's key length (base + T) fits
        self.adapted = adapted  # the attached adapter's terms (mask vector, gated low-rank terms) are in it
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
    device_tokens = True  # score_token takes its token on the device without a host read

    def __init__(self, config: dict, state_dict: dict, dtype: str = "fp32", n_slots: int = 4,
                 max_seq_len: int = 2048, device="cpu", capture: Optional[bool] = None,
                 batch_buckets: Sequence[int] = BATCH_BUCKETS, token_buckets: Sequence[int] = TOKEN_BUCKETS,
                 warmup_iters: int = 2, invariant: bool = False, invariant_tokens: int = 64,
                 key_buckets: Sequence[int] = KEY_BUCKETS, model_dir=None):
        """``capture``: record CUDA graphs (default: when the device is CUDA). Batch
        buckets beyond the first one that holds every slot are never needed and dropped.
        ``key_buckets``: how many keys a forward attends over, the smallest that holds
        every row's keys (``max_seq_len`` is always one). ``invariant``: the
        batch-invariant mode (module docstring): one bucket, every slot x
        ``invariant_tokens`` tokens over all ``max_seq_len`` keys, for every forward,
        longer chains (prefill) in chunks of that size."""
        super().__init__(config, state_dict, dtype=dtype, n_slots=n_slots + 1, max_seq_len=max_seq_len,
                         device=device, model_dir=model_dir)
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
        self.key_buckets = tuple(sorted(set(int(k) for k in key_buckets if 0 < int(k) < max_seq_len)
                                        | {max_seq_len}))
        self.invariant = bool(invariant)
        if self.invariant:  # one shape for every forward: a row meets the same kernels whatever else is scored
            if not 0 < invariant_tokens <= max_seq_len:
                raise ValueError(f"invariant_tokens must be in [1, max_seq_len], got {invariant_tokens}")
            self.batch_buckets, self.token_buckets = (max(self.batch_buckets),), (int(invariant_tokens),)
            self.key_buckets = (max_seq_len,)
        self.warmup_iters = warmup_iters
        self.cos, self.sin = self.cos.to(self.device), self.sin.to(self.device)  # [T, hd] tables on the device
        self._keys = torch.arange(max_seq_len, device=self.device)  # [S] key positions
        self._steps: dict[tuple, _Step] = {}
        self._pool = None
        # graphed: forwards through a bucket (replayed: of a captured graph; uncaptured: its static
        # forward run without one: off CUDA, or after a failed capture); eager: the eager engine;
        # captures (serving_captures: after ``serving`` was set, i.e. not in the warm-up)
        self.calls = {"graphed": 0, "replayed": 0, "uncaptured": 0, "eager": 0, "captures": 0, "capture_errors": 0,
                      "serving_captures": 0}
        self.serving = False  # set once the warm-up is done: later captures are counted as serving captures
        self.hidden_keep: tuple = ()  # hidden layers every bucket keeps (``keep_hidden``)

    # ------------------------------------------------------------------ planning
    def attach_adapter(self, adapter) -> None:
        """As ``LlamaEngine.attach_adapter``; the graphs with the adapter's terms are dropped
        (recaptured on first use), those without them kept."""
        super().attach_adapter(adapter)
        self._steps = {k: st for k, st in self._steps.items() if not st.adapted}

    def keep_hidden(self, layers: Sequence[int]) -> None:
        """Every bucket keeps the hidden states of these layers (those below its layer
        count), whether a call asks for them or not, so that calls asking for any subset
        share one graph (what the verifier and its drafters ask for: feature layers, the
        fused drafter's last layer, the contrastive exit). Changing the set drops no
        graph; new keys capture on first use."""
        self.hidden_keep = tuple(sorted(set(int(i) for i in layers if 0 <= int(i) < self.n_layers)))

    def _plan(self, items, rows, n_layers, extra, gated=None) -> Optional[tuple[int, int, int, bool, list]]:
        """(B, T, S, adapted, [(slot, tokens, parents, base, rows, gated)]) when the call fits
        a bucket and is valid (S: the key bucket; adapted: some row is gated or a mask row,
        so the adapter's terms run); None sends it to the eager engine."""
        if not items or not 1 <= n_layers <= self.n_layers:
            return None
        extra = extra or [0] * len(items)
        rows = rows or [None] * len(items)
        gated = gated or [None] * len(items)
        B = _bucket(len(items), self.batch_buckets)
        if B is None or len(extra) != len(items) or len(rows) != len(items) or len(gated) != len(items):
            return None
        top = self.vocab_size + (self.adapter is not None)  # mask_id with an adapter
        segs, seen, t_max, adapted = [], set(), 0, False
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
            adapted = adapted or bool(g) or (self.adapter is not None and self.mask_id in toks)
            segs.append((slot, toks, par, base, sel, g))
        T = _bucket(t_max, self.token_buckets)
        if T is None:
            return None
        S = _bucket(min(max(s[3] for s in segs) + T, self.max_seq_len), self.key_buckets)
        return B, T, S, adapted, segs

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
        B, T, S = st.B, st.T, st.S or self.max_seq_len
        N, ad = B * T, self.act_dtype
        nq, nk, hd = self.n_heads, self.n_kv, self.head_dim
        g = nq // nk  # query heads per KV head
        wslot, wpos = st.wslot.reshape(N), st.wpos.reshape(N)
        # additive mask over the bucket's S keys: keys before the row's first scored token, and its
        # ancestors; [B, 1, g * T, S]: a KV head's g query heads folded into its rows (a plain
        # multi-head call with a mask, which the fused memory-efficient kernel takes; enable_gqa
        # with a mask is the math kernel's)
        rel = self._keys[:S][None] - st.base[:, None]  # [B, S] key position relative to the row's base
        tree = st.anc.gather(2, rel.clamp(0, T - 1)[:, None].expand(B, T, S)) != 0  # [B, T, S]
        vis = (rel < 0)[:, None] | (tree & (rel < T)[:, None])  # [B, T, S]
        mask = torch.zeros(B, 1, g, T, S, dtype=ad, device=self.device).masked_fill_(
            ~vis[:, None, None], float("-inf")).view(B, 1, g * T, S)
        pos = st.pos.reshape(N)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [N, 1, hd]
        ids = st.ids.reshape(N)
        ad_ = self.adapter if st.adapted else None
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
            # [B, nk, g * T, hd]: query head h = kv * g + j is row j * T + t of KV head kv
            q = qk[:, :nq].reshape(B, T, nk, g, hd).permute(0, 2, 3, 1, 4).reshape(B, nk, g * T, hd)
            kc, vc = self.k_cache[li], self.v_cache[li]  # [n_slots + 1, nk, max_seq_len, hd]
            kc[wslot, :, wpos] = qk[:, nq:]  # [N, nk, hd] into each token's (slot, position)
            vc[wslot, :, wpos] = qkv[:, (nq + nk) * hd:].view(N, nk, hd)
            ks = kc[:, :, :S].index_select(0, st.slots)  # [B, nk, S, hd]: the bucket's keys of each row's slot
            vs = vc[:, :, :S].index_select(0, st.slots)
            o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)  # [B, nk, g * T, hd]
            o = o.view(B, nk, g, T, hd).permute(0, 3, 1, 2, 4).reshape(N, nq * hd)
            x = x + lin(L, "o", o)
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
    def _step(self, B: int, T: int, n_layers: int, hidden_layers: tuple, S: int = 0,
              adapted: bool = False) -> _Step:
        S = S or self.max_seq_len
        key = (B, T, n_layers, hidden_layers, S, adapted)
        st = self._steps.get(key)
        if st is None:
            st = _Step(B, T, n_layers, hidden_layers, self.device, S=S, adapted=adapted)
            st.inp.copy_(self._pack(B, T, []))  # idle inputs: every write goes to the scratch slot
            if self.capture:
                if self.serving:  # a capture in the serving path: the warm-up missed this bucket
                    self.calls["serving_captures"] += 1
                    log.warning("CUDA graph capture while serving: bucket %s was not warmed up", key)
                try:
                    self._capture(st)
                    self.calls["captures"] += 1
                except Exception as e:  # noqa: BLE001 - the bucket then runs its static forward uncaptured
                    st.graph = None
                    self.calls["capture_errors"] += 1
                    log.warning("CUDA graph capture of bucket %s failed (%s: %s); running it without a graph",
                                key, type(e).__name__, e)
            self._steps[key] = st
        return st

    def uncaptured_buckets(self) -> list[tuple]:
        """The keys (B, T, layers, hidden layers, keys, adapted) of the buckets that run
        without a graph where graphs are captured (a failed capture); [] without capture."""
        return [k for k, st in self._steps.items() if self.capture and st.graph is None]

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

    @torch.inference_mode()
    def warm_up(self, batch_sizes: Optional[Sequence[int]] = None, tokens: Optional[Sequence[int]] = None,
                hidden_layers: Optional[Sequence[int]] = None, n_layers: Optional[Sequence[int]] = None,
                keys: Optional[Sequence[int]] = None, adapted: Optional[Sequence[bool]] = None,
                partial_batch: Sequence[int] = (1,)) -> int:
        """Capture (or build) buckets ahead of the first requests: every batch bucket
        (``batch_sizes``, default all) x token bucket (``tokens``) x key bucket (``keys``)
        x with and without the adapter's terms (``adapted``, default: both when an adapter
        is attached), for the full layer count, and for each other layer count in
        ``n_layers`` (a layer-skip exit: one session at a time, ``partial_batch``).
        ``hidden_layers`` (default: ``hidden_keep``) become ``keep_hidden``'s set. Returns
        how many steps exist."""
        if hidden_layers is not None:
            self.keep_hidden(hidden_layers)
        if adapted is None:
            adapted = (False, True) if self.adapter is not None else (False,)
        Bs = sorted({_bucket(b, self.batch_buckets) for b in (batch_sizes or self.batch_buckets)} - {None})
        Ts = sorted({_bucket(t, self.token_buckets) for t in (tokens or self.token_buckets)} - {None})
        Ss = sorted({_bucket(k, self.key_buckets) for k in (keys or self.key_buckets)} - {None})
        layer_counts = sorted({self.n_layers} | {int(n) for n in (n_layers or ()) if 0 < int(n) <= self.n_layers})
        for nl in layer_counts:
            for B in (Bs if nl == self.n_layers else
                      sorted({_bucket(b, self.batch_buckets) for b in partial_batch} - {None})):
                for T in Ts:
                    for S in Ss:
                        if S < T:
                            continue
                        for a in adapted:
                            self._step(B, T, nl, self._hidden_for(nl, ()), S, bool(a))
        return len(self._steps)

    def _hidden_for(self, n_layers: int, asked: Sequence[int]) -> tuple:
        """The hidden layers a bucket of ``n_layers`` layers keeps for a call asking ``asked``."""
        return tuple(sorted({int(i) for i in asked if 0 <= int(i) < n_layers}
                            | {i for i in self.hidden_keep if i < n_layers}))

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

    def _run(self, st) -> None:
        """The bucket's forward into its static outputs: the captured graph's replay, or
        the forward itself where capture failed (counted apart: ``calls``)."""
        if st.graph is not None:
            st.graph.replay()
            self.calls["replayed"] += 1
        else:
            st.out = self._forward(st)
            self.calls["uncaptured"] += 1
        self.calls["graphed"] += 1

    @torch.inference_mode()
    def score_token(self, slot: int, token: torch.Tensor, n_layers: Optional[int] = None,
                    extra: int = 0) -> torch.Tensor:
        """``LlamaEngine.score_token`` without reading the token: the call is planned with a
        placeholder token, and the device tensor is copied into the bucket's input on the
        device before the replay (a greedy draft loop then reads nothing per token)."""
        nl = self.n_layers if n_layers is None else n_layers
        plan = self._plan([(slot, [0], [-1])], [[0]], nl, [extra])
        if plan is None or plan[3]:
            return super().score_token(slot, token, n_layers=n_layers, extra=extra)
        B, T, S, adapted, segs = plan
        st = self._step(B, T, nl, self._hidden_for(nl, ()), S, adapted)
        st.inp.copy_(self._pack(B, T, segs), non_blocking=True)
        st.ids.view(-1)[:1].copy_(token.reshape(-1)[:1])  # the token, device to device
        self._run(st)
        return st.out[0][0].clone()  # row (0, 0): the static output is overwritten by the next replay

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
        B, T, S, adapted, segs = plan
        want = set(int(i) for i in hidden_layers if 0 <= int(i) < nl)
        st = self._step(B, T, nl, self._hidden_for(nl, want), S, adapted)
        st.inp.copy_(self._pack(B, T, segs), non_blocking=True)  # one host-to-device copy, no wait for the queue
        self._run(st)
        logits, hidden = st.out
        hidden = {li: h for li, h in hidden.items() if li in want}
        # copy the requested rows out of the static outputs (the next replay overwrites them)
        flat = [b * T + i for b, seg in enumerate(segs) for i in seg[4]]
        picked = logits.index_select(0, to_device(torch.tensor(flat, dtype=torch.long), self.device))
        kept = {li: h.view(B, T, -1)[: len(segs)].clone() for li, h in hidden.items()}  # [b, T, H]
        out, o = [], 0
        for b, (slot, toks, par, base, sel, _) in enumerate(segs):
            out.append(ScoreOutput(picked[o: o + len(sel)], {li: h[b, : len(toks)] for li, h in kept.items()}))
            o += len(sel)
        return out
