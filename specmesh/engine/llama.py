"""Llama-family forward written for serving: preallocated KV cache and slot API.

The engine holds the target's weights (fp32, bf16, or int8 / int4 weight-only with
bf16 activations: torch's CPU kernel ``_weight_int8pack_mm``; for int4
``specmesh.engine.int4_matmul`` where the CPU has AVX-512 BF16 or AVX2, else torch's
``_weight_int4pack_mm_for_cpu``; bf16 on ``specmesh.engine.bf16_matmul`` where it builds) and a KV
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
- ``score_batch``: several slots' trees as one forward (matmuls over the
  concatenated tokens, attention per sequence); equals separate calls.

Batch invariance (``batch_invariant=True``, the default for bf16, int8 and int4 on
CPU): a row's logits and hidden states are bitwise the same whatever else is
scored in the same call (alone or as row j of a chain, as a tree node, beside
other sessions), and the KV a chain leaves does not depend on how it was split
into calls — so greedy speculation returns exactly the tokens of plain decoding in
bf16, int8 and int4 too. What breaks it in the ragged forward (measured on CPU, torch
2.13): matmuls whose row count crosses a kernel boundary (bf16: 1 row in small
shapes, over 32 rows; fp32: 1, 2-3, 4+ rows); SDPA, whose result for a query
depends on the key length and on whether its query block has a single row; and
tree nodes, which see their ancestors at other key indices than the same tokens
in a chain. The invariant forward runs every matmul on row tiles whose size stays
inside one kernel class (``row_tiles`` = (min, max) rows; padding rows where a call
has fewer; our int4 and bf16 kernels are one class for any rows: ``(1, 0)``), and attention as SDPA over query tiles whose row count (a KV head's
query heads folded into the rows, ``attn_rows``) stays inside one kernel class,
against keys padded to a multiple of ``key_block`` aligned at key 0 (the padding
masked): a query's keys are padded to the block of its own last key, so a chain that
crosses a block boundary is attended in one call per block (SDPA's bits for a query
depend on the padded key length: on an AVX2 CPU a query seeing 200 keys got other
bits with 320 padded keys than with 256). A query always meets the same kernels and
its keys at the same indices. A tree is attended one root-to-leaf path at a time, the
path's keys written in chain order after the committed ones (the tree layout is restored for
``commit``). That is the ``attention="sdpa"`` forward. The default where its C kernel
builds, ``attention="keylist"`` (``specmesh.engine.keylist_attention``), needs none of it: each
row names its keys (a chain's token at depth e its slot's [0, base + e]; a tree node
[0, base), then its ancestors root first and itself, read where the tree layout wrote
them), the kernel computes a row from its own query and key sequence alone, and one
call attends every row of the forward: no query tiles, no key padding, no per-path
rewrites, so a tree costs what a chain of as many tokens costs. ``batch_invariant=False`` is the ragged forward (one matmul over all
rows, one SDPA per sequence), kept for comparison (``set_batch_invariant``). The
kernel classes are measured facts about these CPU kernels, not guarantees:
tests/unit/test_batch_invariance.py checks them where it runs. The invariant
forward is CPU-only.

Gated rows (``attach_adapter``): with a mask-gated adapter attached (``specmesh.uno``),
a scored tree may hold ``mask_id`` tokens (input: the adapter's MASK vector) and
``score_batch(..., gated=...)`` names the rows the adapter's low-rank terms apply
to (default: the mask rows). Every other row is computed as without the adapter:
the terms are added to the gated rows' projections alone, and a mask row is never
an ancestor of a normal one in a draft tree.

Works for Llama configs (GQA, RoPE with optional llama3 scaling left out, tied
embeddings) and Qwen2-style q/k/v bias. Every tensor it makes lives on
``device``. Knows nothing about sessions, tokenizers, sampling or gRPC.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .. import trees
from ..types import InvalidArgument, ResourceExhausted
from . import bf16_matmul, int4_matmul, qmatmul
from .device import host_int, lazy_zeros, to_device
from .rowops import topk_rows

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "int8": torch.bfloat16, "int4": torch.bfloat16}
DTYPE_NAMES = ("fp32", "bf16", "int8", "int4")  # what ``dtype=`` accepts (and the command lines offer)
# int4: weights in groups of INT4_GROUP along the input dimension (asymmetric: a bf16 scale
# and zero per group). 32 is the block of the GGUF Q4_0/Q4_1 weights the default model
# ships (its minimum and maximum per block give back that grid, up to the bf16 rounding of
# scale and zero); 64/128 halve/quarter the scale bytes (docs/int4.md has the measured cost).
INT4_GROUP = 32
INT4_HEADS = ("auto", "screen", "screen8", "int8", "int4")  # the LM head of an int4 engine (LlamaEngine's int4_head)
SCREEN_TOP = 64  # screen head: logits per row recomputed from the bf16 table (16 -> 64: KL to fp32 0.0099 -> 0.0056)

# Batch-invariant forward, per dtype (measured on CPU, see the module docstring):
# (min, max) rows per matmul call (max 0: any), (min, max) query rows per KV head of
# an attention tile (a KV head's query heads are folded into its rows), keys padded
# to a multiple of KEY_BLOCK. Matmuls: bf16 (oneDNN, AMX) gives a row the same bits
# for every M in [2, 32] (other ones for M = 1 in small shapes and for M > 32); int8
# (``_weight_int8pack_mm``) for every M; fp32 (MKL) differs between M = 1, 2-3 and
# 4+, so exactly 8 (the matmul classes are probed again on the machine that builds the
# engine: ``probe_tiles``). SDPA (flash, CPU): one fixed tile of 12 query rows (see
# ATTN_ROWS) over keys padded to 64 (bf16, int8, int4) or 512 (fp32, its key block),
# each query padded to the block of its own last key (one call per block).
# int4 (``_weight_int4pack_mm_for_cpu``, bf16 activations) gives a row the same bits for
# every M too (measured for 1..300 rows on the engine's shapes), and ``int4_matmul``'s
# kernel does by construction (a row's sums never depend on the others).
# Attention: one fixed tile of 12 query rows in every dtype. A range was measured to hold
# on one CPU (bf16 2-32 rows) but not on another (an AVX2-only CPU whose bf16 SDPA gave
# a query other bits in a tile of 3 rows than in one of 9, for some inputs and not for
# others): a fixed shape meets one kernel everywhere, and costs nothing measurable
# (attention is a small part of a step). The matmul classes are measured on the machine
# itself when an engine is built (``probe_tiles``).
ROW_TILES = {"fp32": (8, 8), "bf16": (2, 32), "int8": (1, 0), "int4": (1, 0)}
ATTN_ROWS = {"fp32": (12, 12), "bf16": (12, 12), "int8": (12, 12), "int4": (12, 12)}
KEY_BLOCK = {"fp32": 512, "bf16": 64, "int8": 64, "int4": 64}


def int4_supported(out_features: int, in_features: int, group: int = INT4_GROUP) -> bool:
    """Whether torch's CPU int4 pack takes a [out, in] weight in groups of ``group``."""
    return out_features % 16 == 0 and in_features % group == 0 and group in (32, 64, 128, 256)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit quantisation of w [N, K] along K: (q [N, K] uint8 in
    0..15, scale [N, K/group], minimum [N, K/group]) float32, w ~ q * scale + minimum."""
    N, K = w.shape
    wg = w.float().reshape(N, K // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(N, K)
    return q, scale, lo


_PROBED: dict = {}


def _class_of(fn, n_max: int) -> tuple[int, int]:
    """(lo, hi): the widest row counts [lo, hi] (lo 1 or 2) over which ``fn`` (rows ->
    rows) gives a row the same bits whatever the count, as far as ``n_max``: hi = 0 when
    every count up to ``n_max`` agrees and lo is 1 (one class: any count)."""
    ref = fn(2)

    def same(m: int) -> bool:
        y = fn(m)
        return torch.equal(y[0], ref[0]) and (m < 2 or torch.equal(y[1], ref[1]))

    hi = 2
    while hi < n_max and same(hi + 1):
        hi += 1
    lo = 1 if same(1) else 2
    return (lo, 0) if lo == 1 and hi == n_max else (lo, hi)


def probe_tiles(engine, row_default: tuple[int, int]) -> tuple[int, int]:
    """The matmul row tiles of the batch-invariant forward measured on this machine, for
    this engine's shapes and dtype (every Linear of layer 0 and the head; cached per
    process): the widest row counts (from 1 or 2 up, within ``row_default``) over which
    each of those kernels gives a row the same bits, at worst one fixed size (a fixed
    shape meets one kernel). ``ROW_TILES`` were measured on one CPU; another CPU's
    kernels may split differently, so the engine checks before it trusts them."""
    L = engine.layers[0]
    lins = [L.qkv, L.o, L.gate_up, L.down, engine.head]
    key = (engine.dtype_name, tuple((lin.w.shape, lin.mode) for lin in lins), torch.get_num_threads(),
           torch.__version__, str(engine.device), row_default)
    if key not in _PROBED:
        gen = torch.Generator().manual_seed(1234)
        n_max = row_default[1] or 64
        cls = []
        for lin in lins:
            x = torch.randn(n_max + 1, lin.in_features, generator=gen).to(engine.act_dtype).to(engine.device)
            cls.append(_class_of(lambda m, lin=lin, x=x: lin(x[:m]), n_max))
        lo = max([row_default[0]] + [c[0] for c in cls])
        his = [c[1] for c in cls if c[1]]
        _PROBED[key] = (lo, max(lo, min(his))) if his else (lo, row_default[1])
    return _PROBED[key]


class Linear:
    """y = x @ W.T (+ b). int8 mode: per-output-channel symmetric weight-only quantisation
    run by ``aten._weight_int8pack_mm`` with bf16 activations. int4 mode: group-wise
    asymmetric 4-bit weights (``quantize_int4``) run by ``specmesh.engine.int4_matmul`` (AVX-512
    BF16, AMX or AVX2) or ``aten._weight_int4pack_mm_for_cpu`` with bf16 activations, scales and
    zeros; a weight torch's pack cannot take (out
    features not a multiple of 16, in features not of the group) falls back to int8.
    ``keep_rows`` (int4): keep a plain nibble copy so ``rows_fp32`` can dequantise rows
    (the packed layout is the kernel's own). ``kernel`` (int4): this matmul of our int4
    library instead of the default one (``int4_matmul.load()``; the screen head's W4A8
    matmul: ``int4_matmul.load_q8()``)."""

    def __init__(self, w: torch.Tensor, b: Optional[torch.Tensor], mode: str, group: int = INT4_GROUP,
                 keep_rows: bool = False, kernel: Optional["int4_matmul.Int4Matmul"] = None):
        if mode == "int4" and (w.device.type != "cpu" or not int4_supported(*w.shape, group)):
            mode = "int8"
        self.mode = mode
        self.out_features, self.in_features = w.shape
        self.group = group
        self.q4 = None
        self._k4 = None  # the int4 kernel (specmesh.engine.int4_matmul) where it runs
        self._kb = None  # the bf16 kernel (specmesh.engine.bf16_matmul) where it runs
        self.plain = None  # bf16 on that kernel, keep_rows: the weight as [out, in] for rows_fp32
        if mode == "int8":
            w = w.float()
            scale = (w.abs().amax(1) / 127.0).clamp_min(1e-8)
            self.w = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale.to(torch.bfloat16)
        elif mode == "int4":
            q, scale, lo = quantize_int4(w, group)
            # both kernels compute (q - 8) * scale + zero: zero = minimum + 8 * scale
            self._k4 = kernel if kernel is not None else int4_matmul.load()
            if self._k4 is not None:  # ours: cost grows slowly with the rows (specmesh.engine.int4_matmul)
                self.w = self._k4.pack(q, scale, lo + 8 * scale, group)  # scales inside
            else:
                self.w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            if self._k4 is None or keep_rows:  # [K/group, N, 2]: torch's kernel's, and rows_fp32's
                self.scale = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            else:
                self.scale = torch.empty(0, dtype=torch.bfloat16)
            if keep_rows:
                self.q4 = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # [N, K/2]
        else:
            kb = bf16_matmul.load() if mode == "bf16" and w.device.type == "cpu" and bf16_matmul.supported(*w.shape) \
                else None
            if kb is not None:  # ours: the weights in its pair order, one call for any rows
                self._kb = kb
                self.w = kb.pack(w)
                self.plain = w.to(torch.bfloat16).contiguous() if keep_rows else None
            else:
                self.w = w.to(DTYPES[mode]).contiguous()
        self.b = None if b is None else b.to(DTYPES[mode])

    @classmethod
    def blocks(cls, qm: "qmatmul.QMatrix", b: Optional[torch.Tensor] = None) -> "Linear":
        """A weight of GGUF blocks (``qmatmul.QMatrix``: the file's own Q4_K, Q6_K ... as
        shipped, or a full-precision weight quantized into them) on the block kernels:
        bf16 rows in and out like the int4 mode, fp32 out through ``qm.mm`` directly."""
        lin = cls.__new__(cls)
        lin.mode, lin.qm = "q", qm
        lin.out_features, lin.in_features = qm.out_features, qm.in_features
        lin.group, lin.q4, lin._k4, lin._kb, lin.plain = 0, None, None, None, None
        lin.w = qm.data
        lin.scale = torch.empty(0, dtype=torch.bfloat16)
        lin.b = None if b is None else b.to(torch.bfloat16)
        return lin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "q":  # fp32 rows give fp32 outputs (the int8 rounding of the rows is the same)
            y = self.qm.mm(x, torch.float32 if x.dtype == torch.float32 else torch.bfloat16)
            return y if self.b is None else y + self.b.to(y.dtype)
        if self.mode == "int4":
            if self._k4 is not None:
                y = self._k4.mm(x if x.is_contiguous() else x.contiguous(), self.w, self.out_features, self.group)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w, self.group, self.scale)
            return y if self.b is None else y + self.b
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.w, self.scale)
            return y if self.b is None else y + self.b
        if self._kb is not None:
            y = self._kb.mm(x if x.is_contiguous() else x.contiguous(), self.w)
            return y if self.b is None else y + self.b
        return F.linear(x, self.w, self.b)

    def rows_fp32(self, idx: torch.Tensor) -> torch.Tensor:
        """Weight rows ``idx`` [...] as fp32 [..., in_features] (dequantised in int8/int4
        mode, as the kernel sees them)."""
        if self.mode == "q":
            return self.qm.rows(idx)
        if self.mode == "int8":
            return self.w[idx].float() * self.scale[idx].float()[..., None]
        if self.mode == "int4":
            if self.q4 is None:
                raise InvalidArgument("rows", "this int4 weight keeps no row copy (keep_rows=False)")
            p = self.q4[idx]  # [..., K/2]
            q = torch.stack([p & 15, p >> 4], -1).flatten(-2).float()  # [..., K]
            sz = self.scale[:, idx].float()  # [K/group, ..., 2]
            s, z = sz[..., 0].movedim(0, -1), sz[..., 1].movedim(0, -1)  # [..., K/group]
            q = q.unflatten(-1, (-1, self.group))
            return ((q - 8) * s[..., None] + z[..., None]).flatten(-2)
        if self._kb is not None:
            if self.plain is None:
                raise InvalidArgument("rows", "this bf16 weight keeps no row copy (keep_rows=False)")
            return self.plain[idx].float()
        return self.w[idx].float()

    def nbytes(self) -> int:
        if self.mode == "q":
            return self.qm.nbytes()
        n = self.w.numel() * self.w.element_size()
        if self.plain is not None:
            n += self.plain.numel() * self.plain.element_size()
        return n + (self.scale.numel() * 2 if self.mode in ("int8", "int4") else 0)


def rope_tables(config: dict, head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of a Llama config, fp64 [max_len, head_dim]: cos, and sin with its
    first half negated (``rope``'s ``sin_signed``: rotate-half's sign folded in)."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat((ang, ang), -1)
    half = head_dim // 2
    return emb.cos(), torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), -1)


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


@dataclass
class _Attn:
    """One SDPA call of the batch-invariant forward: ``t`` tiles of ``R`` tokens (rows of
    one root-to-leaf path of a segment, or of a chain) against its slot's keys [0, Lp)."""
    write: Optional[tuple[int, object]]  # (depth e, flat rows: slice or index) to write at base + e first
    q0: int  # the flat row of the call's first query
    q_rows: Optional[torch.Tensor]  # [t * R] flat query rows (the last repeated as padding); None: a slice
    out_rows: torch.Tensor  # [n] flat rows of the first n outputs
    n: int
    t: int
    R: int
    Lp: int
    mask: torch.Tensor  # [t, 1, R * g, Lp] additive: a token at depth e sees keys [0, base + e]


class LlamaEngine:
    def __init__(self, config: dict, state_dict: dict, dtype: str = "fp32", n_slots: int = 4,
                 max_seq_len: int = 2048, device: str = "cpu", batch_invariant: Optional[bool] = None,
                 row_tiles: Optional[tuple[int, int]] = None, attn_rows: Optional[tuple[int, int]] = None,
                 key_block: Optional[int] = None, int4_group: int = INT4_GROUP, int4_head: str = "auto",
                 attention: Optional[str] = None, int4_format: str = "auto", model_dir: Optional[Path] = None):
        """``batch_invariant``: the forward whose rows do not depend on what else is
        scored (module docstring); default: on for bf16, int8 and int4 on CPU (greedy
        identity needs it there), off for fp32 (greedy output was identical without
        it, and its exact 8-row matmul tiles cost) and on other devices (CPU-only).
        ``row_tiles`` / ``attn_rows`` / ``key_block`` override the per-dtype tiling
        (``ROW_TILES``, ``ATTN_ROWS``, ``KEY_BLOCK``). ``int4_group``: the int4 weights'
        group size along the input dimension (32, 64, 128; ``INT4_GROUP``). ``int4_head``:
        the LM head of an int4 engine: ``"screen"``: the head in int4 as a screen, each
        row's top ``SCREEN_TOP`` logits then recomputed exactly from the engine's bf16
        embedding table (a tied head: half the int8 head's bytes a step, and closer to
        fp32 than it: docs/int4.md) or from an int8 copy of an untied head (its rows are
        read only for those logits); ``"screen8"``: the same screen on int8 inputs (W4A8,
        ``int4_matmul.load_q8()``: a one-row head ~1.6x faster on AVX-512 VNNI; only the
        logits outside the top ``SCREEN_TOP`` change); ``"auto"`` (the default): ``screen8``
        where our kernel has it (x86 with AVX2), else ``screen``; ``"int8"`` (GGUF files keep the
        head at 8 bits or more; int8 costs it 1% relative weight error); ``"int4"`` (its
        top logits refined from its own int4 rows: 9% error). ``attention`` (the
        batch-invariant forward's): ``"keylist"`` (each row attends to the keys it names,
        ``specmesh.engine.keylist_attention``; the default where its kernel builds) or ``"sdpa"``
        (torch's SDPA on fixed query tiles, a tree one path at a time). ``int4_format``:
        ``"blocks"`` (GGUF blocks on ``qmatmul``: a GGUF's own tensors as shipped, a
        safetensors model quantized to Q4_K / Q4_1, the head and embeddings Q8_0 or the
        file's; ``specmesh.engine.blocks``), ``"group"`` (the earlier int4 grid: groups of
        ``int4_group`` with bf16 scale and zero, requantized from full precision, on
        ``int4_matmul``; ``int4_head`` chooses its head) or ``"auto"`` (blocks where their
        kernels build). ``model_dir``: where the weights came from (the packed cache of a
        quantized safetensors model is keyed by it)."""
        if dtype not in DTYPE_NAMES:
            raise InvalidArgument("dtype", f"must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
        if dtype == "int4" and torch.device(device).type != "cpu":
            raise InvalidArgument("dtype", "int4 runs torch's CPU int4 kernel: on the CPU only")
        if int4_group not in (32, 64, 128, 256):
            raise InvalidArgument("int4_group", f"must be 32, 64, 128 or 256, got {int4_group}")
        self.int4_group = int(int4_group)
        if int4_head not in INT4_HEADS:
            raise InvalidArgument("int4_head", f"must be one of {', '.join(INT4_HEADS)}, got {int4_head!r}")
        self.int4_head = int4_head
        if int4_format not in ("auto", "blocks", "group"):
            raise InvalidArgument("int4_format", f"must be 'auto', 'blocks' or 'group', got {int4_format!r}")
        from . import blocks as _blocks

        if int4_format == "blocks" and dtype == "int4" and not _blocks.available():
            raise InvalidArgument("int4_format", f"the block kernels are not available here: {qmatmul.load_error()}")
        self.int4_blocks = dtype == "int4" and (int4_format == "blocks" or (int4_format == "auto"
                                                                            and _blocks.available()))
        if self.int4_blocks and int4_head != "auto":
            raise InvalidArgument("int4_head", "chooses the head of int4_format='group'; the block format runs "
                                               "the model's own head")
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._head_rows = None  # a drafting engine's kept head rows (restrict_head): (QMatrix view, ids)
        self._head_released = False  # restrict_head(release=True) freed the head's other rows
        self._screen = False  # set by the weight load (int4_head "screen" / "auto")
        self._screen_rows = None  # an untied screen head's int8 rows
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
        if batch_invariant is None:
            batch_invariant = dtype != "fp32" and self.device.type == "cpu"
        if batch_invariant and self.device.type != "cpu":
            raise InvalidArgument("batch_invariant", "the batch-invariant forward runs on the CPU only")
        self.batch_invariant = bool(batch_invariant)
        # bf16 on our kernel: a row's bits are its own at any row count, like int4's (one call)
        tiles = ROW_TILES[dtype] if dtype != "bf16" or torch.device(device).type != "cpu" \
            or bf16_matmul.load() is None else (1, 0)
        self.row_tiles = tuple(int(v) for v in (row_tiles or tiles))
        self.attn_rows = tuple(int(v) for v in (attn_rows or ATTN_ROWS[dtype]))
        self.key_block = int(key_block or KEY_BLOCK[dtype])
        for name, (lo, hi) in (("row_tiles", self.row_tiles), ("attn_rows", self.attn_rows)):
            if lo < 1 or hi < 0 or (hi and hi < lo) or (name == "attn_rows" and not hi):
                raise InvalidArgument(name, f"(min, max) rows per call, 1 <= min <= max, got {(lo, hi)}")
        if self.key_block < 1:
            raise InvalidArgument("key_block", "must be positive")
        self._keylist = None  # the key-list kernel, when the invariant forward attends with it
        # int4 / bf16: the layer stack in one C call (``specmesh.engine.layer_stack``) where it applies;
        # False keeps the per-call path (same bits: tested)
        self.fused_stack = True
        self._stack = None  # ((cache address, kernel id), Stack or None), built on first use
        self.set_attention(attention)
        self._load(state_dict)
        # the matmul kernel classes, measured on this machine for these shapes unless given
        # (the block kernels give a row the same bits at any row count by construction, tested in
        # tests/unit/test_qmatmul.py: nothing to measure)
        blocks_only = self.int4_blocks and all(m.mode == "q" for L in self.layers for m in (L.qkv, L.o, L.gate_up,
                                                                                              L.down))
        self.tiles_probed = self.batch_invariant and row_tiles is None and not blocks_only
        if self.tiles_probed:
            self.row_tiles = probe_tiles(self, self.row_tiles)
        g = self.n_heads // self.n_kv  # query heads per KV head: tokens per attention tile
        lo = -(-self.attn_rows[0] // g)
        self.attn_tiles = (lo, max(lo, self.attn_rows[1] // g))
        cos, sin = rope_tables(config, self.head_dim, max_seq_len)
        self.cos = cos.to(self.act_dtype).to(self.device)  # [T, hd]
        self.sin = sin.to(self.act_dtype).to(self.device)
        # the invariant forward reads keys up to a multiple of key_block: the buffers hold
        # that many positions, k_cache / v_cache are their first max_seq_len (views)
        self._k_buf = self._v_buf = None
        self._alloc_cache()
        self.lengths = [0] * n_slots
        self.adapter = None  # a mask-gated adapter (attach_adapter)
        self._gi: Optional[torch.Tensor] = None  # flat gated rows of the forward in progress
        self._masked = False  # whether that forward holds mask tokens
        self.mask_id = self.vocab_size  # the token id of a mask row (valid only with an adapter)

    def attach_adapter(self, adapter) -> None:
        """Serve gated rows with ``adapter`` (``specmesh.uno.adapter.GatedAdapter``: ``mask``
        [H] float32, ``delta(layer, proj, x)``), moved to this engine's device; its low-rank
        terms run in the activation dtype (bf16 for bf16/int8/int4). None detaches."""
        if adapter is not None:
            adapter.to(self.device, self.act_dtype)
        self.adapter = adapter

    def _alloc_cache(self) -> None:
        """(Re)allocate the KV buffers, keeping their contents."""
        T = self.max_seq_len
        if self.batch_invariant:
            T = -(-T // self.key_block) * self.key_block
        if self._k_buf is not None and self._k_buf.shape[3] >= T:
            return
        slots = self.n_slots if self._k_buf is None else self._k_buf.shape[1]  # (a subclass may hide some)
        shape = (self.n_layers, slots, self.n_kv, T, self.head_dim)
        kb = lazy_zeros(shape, self.act_dtype, self.device)  # resident as the slots fill, not at start
        vb = lazy_zeros(shape, self.act_dtype, self.device)
        if self._k_buf is not None:
            kb[:, :, :, : self.max_seq_len] = self.k_cache
            vb[:, :, :, : self.max_seq_len] = self.v_cache
        self._k_buf, self._v_buf = kb, vb
        # per (layer, slot): the slot's K and V buffers [nk, T, hd] and the same with a leading
        # tile axis [1, nk, T, hd], made once here, not by indexing in every layer of every step
        self._kv_views = [[(kb[li, sl], vb[li, sl], kb[li, sl].unsqueeze(0), vb[li, sl].unsqueeze(0))
                           for sl in range(slots)] for li in range(self.n_layers)]
        self.k_cache = kb[:, :, :, : self.max_seq_len]  # [layers, slots, nk, max_seq_len, hd]
        self.v_cache = vb[:, :, :, : self.max_seq_len]

    def set_batch_invariant(self, on: bool) -> None:
        """Switch between the batch-invariant and the ragged forward (sessions are kept)."""
        if on and self.device.type != "cpu":
            raise InvalidArgument("batch_invariant", "the batch-invariant forward runs on the CPU only")
        self.batch_invariant = bool(on)
        self._alloc_cache()
        self.set_attention(self._attention_asked)

    def set_attention(self, attention: Optional[str]) -> None:
        """The batch-invariant forward's attention: ``"keylist"`` (``specmesh.engine.keylist_attention``:
        each row attends to the keys it names), ``"sdpa"`` (torch's SDPA on fixed query tiles,
        a tree one root-to-leaf path at a time) or None (keylist where its kernel builds and
        the head dimension suits it, else sdpa). ``self.attention`` says which runs. Both are
        batch-invariant; their bits differ from each other, so switch only between
        generations (a session's KV is the same either way)."""
        if attention not in (None, "keylist", "sdpa"):
            raise InvalidArgument("attention", f"must be 'keylist' or 'sdpa', got {attention!r}")
        self._attention_asked = attention
        kern = None
        if self.batch_invariant and attention != "sdpa":
            from . import keylist_attention

            fits = self.head_dim % keylist_attention.HEAD_DIM_MULTIPLE == 0 and self.head_dim <= 256
            kern = keylist_attention.load() if fits else None
            if kern is None and attention == "keylist":
                raise InvalidArgument("attention", "the key-list kernel is not available here: "
                                      + (keylist_attention.load_error() or f"head_dim {self.head_dim}"))
        self._keylist = kern
        self.attention = "keylist" if kern is not None else "sdpa"

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, name: str = "smollm2-135m-instruct", dtype: str = "fp32", n_slots: int = 4,
                        max_seq_len: int = 2048, quiet: bool = False, device: str = "cpu",
                        **kw) -> "LlamaEngine":
        """``kw``: further constructor options (``batch_invariant=``, tiling)."""
        from ..models.loading import freed_memory_returned, load_config, resolve_model, weights

        d = resolve_model(name, quiet=quiet)
        with freed_memory_returned():
            eng = cls(load_config(d), weights(d), dtype=dtype, n_slots=n_slots, max_seq_len=max_seq_len,
                      device=device, model_dir=d, **kw)
        return eng

    def _load(self, sd) -> None:
        """``sd``: a dict or a mapping that reads each tensor when asked
        (``LazyStateDict``); each is looked up once and converted before the next."""
        if self.int4_blocks:
            return self._load_blocks(sd)
        names = {k.removeprefix("model."): k for k in sd}
        mode = self.dtype_name
        lin = lambda w, b=None: Linear(w, b, mode, self.int4_group)  # noqa: E731
        g = lambda k: sd[names[k]].to(self.device)  # noqa: E731
        opt = lambda k: g(k) if k in names else None  # noqa: E731
        self.embed = g("embed_tokens.weight").to(self.act_dtype)  # [V, H]
        self.layers: list[Layer] = []
        for i in range(self.n_layers):
            p = f"layers.{i}."
            wqkv = torch.cat([g(p + "self_attn.q_proj.weight"), g(p + "self_attn.k_proj.weight"),
                              g(p + "self_attn.v_proj.weight")])
            bq = opt(p + "self_attn.q_proj.bias")
            bqkv = None if bq is None else torch.cat([bq, g(p + "self_attn.k_proj.bias"), g(p + "self_attn.v_proj.bias")])
            self.layers.append(Layer(
                ln1=g(p + "input_layernorm.weight").float().clone(),  # (a copy: see ``norm``)
                qkv=lin(wqkv, bqkv),
                o=lin(g(p + "self_attn.o_proj.weight"), opt(p + "self_attn.o_proj.bias")),
                ln2=g(p + "post_attention_layernorm.weight").float().clone(),
                gate_up=lin(torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")])),
                down=lin(g(p + "mlp.down_proj.weight")),
            ))
        # copies: a view of a loaded tensor would keep the whole safetensors file mapped
        # (513 MB of RSS for SmolLM2 in bf16/int8/int4, whose matrices are all new tensors)
        self.norm = g("norm.weight").float().clone()
        if "lm_head.weight" in names:
            head = g("lm_head.weight")
        else:  # tied: fp32 shares the embedding table; other dtypes convert a full-precision read of it
            head = self.embed if self.embed.dtype == torch.float32 else g("embed_tokens.weight")
        # screen: the int4 head ranks; the rows of the embedding table (the tied head's own
        # weights, in the engine's dtype)
        # (tied) or of an int8 copy of the head (untied) give the top logits their values
        tied = "lm_head.weight" not in names or bool(self.config.get("tie_word_embeddings"))
        choice = self.int4_head
        q8 = int4_matmul.load_q8() if mode == "int4" and choice in ("auto", "screen8") else None
        if mode == "int4" and choice == "screen8" and q8 is None:
            raise InvalidArgument("int4_head", "screen8 needs our int4 kernel's int8-input matmul (x86 with AVX2 "
                                               f"and FMA): {int4_matmul.load_error() or 'this CPU or build has none'}")
        if choice == "auto":
            choice = "screen8" if q8 is not None else "screen"
        self._screen = mode == "int4" and choice in ("screen", "screen8")
        self._screen_rows = None if tied or not self._screen else Linear(head, None, "int8")
        head_mode = "int8" if mode == "int4" and choice == "int8" else mode
        self.head = Linear(head, None, head_mode, self.int4_group, keep_rows=not self._screen,
                           kernel=q8 if choice == "screen8" else None)

    def _load_blocks(self, sd) -> None:
        """int4 as GGUF blocks (``specmesh.engine.blocks``): every matrix, the embedding table
        and the head on ``qmatmul``; a matrix no block type fits (an input size that is not a
        multiple of 32) runs int8."""
        from . import blocks

        src = blocks.BlockSource(sd, self.model_dir)
        g = lambda k: sd[src.names[k]].to(self.device)  # noqa: E731
        opt = lambda k: g(k) if src.has(k) else None  # noqa: E731

        def lin(keys, bias_keys=()):
            parts = src.parts(keys)
            bs = [opt(b) for b in bias_keys]
            b = None if not bs or bs[0] is None else torch.cat(bs)
            if parts is None:
                return Linear(torch.cat([g(k) for k in keys]), b, "int8")
            return Linear.blocks(qmatmul.QMatrix(parts), b)

        emb = src.parts(["embed_tokens.weight"], head=True)
        self.embed = blocks.BlockEmbedding(qmatmul.QMatrix(emb)) if emb is not None \
            else g("embed_tokens.weight").to(self.act_dtype)
        self.layers = []
        for i in range(self.n_layers):
            p = f"layers.{i}."
            qkv = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            self.layers.append(Layer(
                ln1=g(p + "input_layernorm.weight").float().clone(),
                qkv=lin(qkv, [p + f"self_attn.{x}_proj.bias" for x in "qkv"]),
                o=lin([p + "self_attn.o_proj.weight"], [p + "self_attn.o_proj.bias"]),
                ln2=g(p + "post_attention_layernorm.weight").float().clone(),
                gate_up=lin([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=lin([p + "mlp.down_proj.weight"]),
            ))
        self.norm = g("norm.weight").float().clone()
        head_key = "lm_head.weight" if src.has("lm_head.weight") else "embed_tokens.weight"
        tied = head_key == "embed_tokens.weight" or bool(self.config.get("tie_word_embeddings"))
        if tied and isinstance(self.embed, blocks.BlockEmbedding):
            self.head = Linear.blocks(self.embed.qm)  # the same bytes
        else:
            hp = src.parts([head_key], head=True)
            self.head = Linear.blocks(qmatmul.QMatrix(hp)) if hp is not None else Linear(g(head_key), None, "int8")
        src.finish()

    # ------------------------------------------------------------------ sizes
    def weight_bytes(self) -> int:
        shared = self.head.mode == "q" and getattr(self.embed, "qm", None) is self.head.qm
        n = self.embed.numel() * self.embed.element_size() + (0 if shared else self.head.nbytes())
        if self._screen_rows is not None:
            n += self._screen_rows.nbytes()
        for L in self.layers:
            n += L.qkv.nbytes() + L.o.nbytes() + L.gate_up.nbytes() + L.down.nbytes()
        return n

    def kv_bytes_per_slot(self) -> int:
        return 2 * self.n_layers * self.n_kv * self.max_seq_len * self.head_dim * self.k_cache.element_size()

    def restrict_head(self, ranges: Sequence[tuple[int, int]], release: bool = False) -> None:
        """A drafting engine: logits for the token ids in ``ranges`` only ([start, end)
        pairs, multiples of 8), the others -inf, so a step reads only those rows of the head.
        A draft model's head over a large vocabulary is a large share of what its step reads
        (Qwen2.5-Coder-0.5B: 145 of ~390 MB); its argmax and its top-k draws then range over
        the ids kept, and since the target verifies every draft, output is unchanged.
        ``release``: the kept rows move to a weight of their own and the others are freed
        (the 0.5B: 83 MB less resident), where the head is not the embedding table too;
        the whole head cannot come back then. GGUF blocks (``int4``) only; ``[]`` restores
        the full head."""
        if self.head.mode != "q":
            raise InvalidArgument("restrict_head", "needs the head on GGUF blocks (dtype int4)")
        if self._head_released:
            raise InvalidArgument("restrict_head", "the head's other rows were released (restrict_head(release=True))")
        self._head_rows = None
        if ranges:
            idx = torch.cat([torch.arange(a, b) for a, b in ranges])
            view = self.head.qm.rows_view(ranges)
            if release and getattr(self.embed, "qm", None) is not self.head.qm:
                view = view.compact(reuse=True)  # (the whole head's buffer, its other pages released)
                self.head = Linear.blocks(view, self.head.b)
                self._head_released = True
            self._head_rows = (view, idx)

    def _logits(self, hn: torch.Tensor, mm) -> torch.Tensor:
        """fp32 logits [n, V] of normed fp32 rows hn [n, H]: the head matmul (through
        ``mm(lin, x)``, e.g. the row tiles of ``_mm``; None: one call), then, below fp32,
        the top logits recomputed exactly (``_refine_top``; the screen head in one kernel
        call where the int4 kernel runs)."""
        ad = self.act_dtype
        if self.head.mode == "q":  # the head's blocks on fp32 rows, fp32 logits (row-invariant: one call)
            if self._head_rows is not None:  # a drafting engine's kept ids (restrict_head)
                view, idx = self._head_rows
                out = torch.full((hn.shape[0], self.vocab_size), float("-inf"))
                out[:, idx] = view.mm(hn.contiguous(), torch.float32)
                return out
            return self.head.qm.mm(hn.contiguous(), torch.float32)
        if ad == torch.float32:
            return (mm(self.head, hn) if mm else self.head(hn)).float()
        hx = hn.to(ad)
        raw = mm(self.head, hx) if mm else self.head(hx)
        k4 = self.head._k4
        if self._screen and k4 is not None:
            hc, k = hn if hn.is_contiguous() else hn.contiguous(), min(SCREEN_TOP, raw.shape[-1])
            rows = self._screen_rows
            if rows is None:
                return k4.screen(raw, hc, self.embed, k)
            return k4.screen(raw, hc, rows.w, k, rows.scale)
        return self._refine_top(raw.float(), hn)

    def _refine_top(self, logits: torch.Tensor, hn: torch.Tensor, k: int = 4) -> torch.Tensor:
        """Recompute the top-k logits of each row exactly (fp32 hidden x fp32 copy of the
        weight rows). A bf16 output is rounded to 1/8 at typical logit sizes, which
        turns near-ties into coin flips between a 1-token and a k-token forward;
        exact top logits keep greedy choices consistent across the two. The screen head
        (int4) recomputes its top ``SCREEN_TOP`` from the embedding table's rows."""
        if self._screen:
            idx = topk_rows(logits, min(SCREEN_TOP, logits.shape[-1]))[1]
            rows = self.embed[idx].float() if self._screen_rows is None else self._screen_rows.rows_fp32(idx)
        else:
            idx = topk_rows(logits, k)[1]  # [n, k]
            rows = self.head.rows_fp32(idx)
        exact = torch.einsum("nh,nkh->nk", hn, rows)
        return logits.scatter(-1, idx, exact)

    @torch.inference_mode()
    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[n, H] residual stream (a ``hidden`` output of ``score_batch``) -> [n, V] float32
        logits through the final norm and head as the forward applies them: the logits
        a forward exiting after that layer (``n_layers``, layer-skip) returns for those rows."""
        n = x.shape[0]
        if self.batch_invariant:
            m = self._padded_rows(n)
            if m > n:
                x = torch.cat([x, x[-1:].expand(m - n, -1)])
        hn = rms_norm(x.float(), self.norm, self.eps)
        logits = self._logits(hn, self._mm if self.batch_invariant else None)
        return logits[:n]

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
        if moves:  # (non-blocking copies of the indices: no wait for the device's queue)
            dst = to_device(torch.tensor([m[0] for m in moves]), self.device)
            src = to_device(torch.tensor([m[1] for m in moves]), self.device)
            self.k_cache[:, slot, :, dst] = self.k_cache[:, slot, :, src]
            self.v_cache[:, slot, :, dst] = self.v_cache[:, slot, :, src]
        self.lengths[slot] = L + len(path)

    def score_token(self, slot: int, token: torch.Tensor, n_layers: Optional[int] = None,
                    extra: int = 0) -> torch.Tensor:
        """``score(slot, [t], [-1], rows=[0], n_layers=n_layers, extra=extra).logits[0]`` for a
        token t given as a one-element tensor on the device (e.g. the previous step's
        argmax: a greedy draft loop). Here the token is read to the host first (one
        counted host read); ``GraphedEngine`` feeds it to its bucket on the device."""
        t = host_int(token.reshape(-1)[0], "token")
        return self.score(slot, [t], [-1], rows=[0], n_layers=n_layers, extra=extra).logits[0]

    def prefill(self, slot: int, tokens: Sequence[int]) -> torch.Tensor:
        """Append a chain of tokens to the slot; return the logits [V] after the last."""
        tokens = list(tokens)
        out = self.score(slot, tokens, list(range(-1, len(tokens) - 1)), rows=[len(tokens) - 1])
        self.commit(slot, range(len(tokens)))
        return out.logits[0]

    def score(self, slot: int, tokens: Sequence[int], parents: Sequence[int], rows: Optional[Sequence[int]] = None,
              hidden_layers: Sequence[int] = (), n_layers: Optional[int] = None, extra: int = 0,
              gated: Optional[Sequence[int]] = None) -> ScoreOutput:
        """Score one tree after the slot's committed tokens (see module docstring).
        rows: which nodes' logits to return (default all). n_layers: exit after the
        first n layers (layer-skip drafting). extra: number of scratch positions after
        the committed ones (an uncommitted chain written by earlier calls) that every
        node also attends to; nodes then start at storage offset ``extra``. gated: the
        nodes the attached adapter applies to (default: the ``mask_id`` nodes)."""
        return self.score_batch([(slot, tokens, parents)], rows=[rows], hidden_layers=hidden_layers,
                                n_layers=n_layers, extra=[extra], gated=[gated])[0]

    @torch.inference_mode()
    def score_batch(self, items: Sequence[tuple[int, Sequence[int], Sequence[int]]],
                    rows: Optional[Sequence[Optional[Sequence[int]]]] = None, hidden_layers: Sequence[int] = (),
                    n_layers: Optional[int] = None, extra: Optional[Sequence[int]] = None,
                    gated: Optional[Sequence[Optional[Sequence[int]]]] = None) -> list[ScoreOutput]:
        """Score several slots' trees in one forward (batch-invariant tiles, or ragged).
        ``gated``: per item, the nodes the attached adapter applies to (None: its mask
        nodes, token ``mask_id``)."""
        n_layers = self.n_layers if n_layers is None else n_layers
        rows = rows or [None] * len(items)
        extra = extra or [0] * len(items)
        gated = gated or [None] * len(items)
        gflat: list[int] = []
        segs = []  # (slot, start in flat, n, base = committed + extra, parents)
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
            top = self.vocab_size + (self.adapter is not None)  # mask_id = vocab_size with an adapter
            for x in t:
                if x < 0 or x >= top:
                    raise InvalidArgument("tokens", f"token id {x} outside [0, {self.vocab_size})")
            base = self.lengths[slot] + ex
            if base + n > self.max_seq_len:
                raise ResourceExhausted(f"sequence of {base + n} tokens exceeds max_seq_len={self.max_seq_len}")
            gi = gated[len(segs)]
            if gi is None:
                gi = [i for i, x in enumerate(t) if x == self.mask_id]
            elif any(not 0 <= int(i) < n for i in gi) or (gi and self.adapter is None):
                raise InvalidArgument("gated", "gated rows need an attached adapter and node indices in range")
            gflat += [len(toks) + int(i) for i in gi]
            segs.append((slot, len(toks), n, base, par))
            toks += t
            pos += [base + d for d in trees.depths(par)]
        sels = [list(range(s, s + n)) if r is None else [s + int(i) for i in r]
                for (slot, s, n, base, par), r in zip(segs, rows)]
        ids = torch.tensor(toks, dtype=torch.long, device=self.device)
        posi = torch.tensor(pos, dtype=torch.long, device=self.device)
        sel = torch.tensor([i for sl in sels for i in sl], dtype=torch.long, device=self.device)
        self._gi = torch.tensor(sorted(set(gflat)), dtype=torch.long, device=self.device) if gflat else None
        self._masked = self.adapter is not None and self.mask_id in toks
        forward = self._forward_invariant if self.batch_invariant else self._forward_ragged
        try:
            logits, hidden = forward(segs, ids, posi, sel, n_layers, hidden_layers)
        finally:
            self._gi = None
        results, o = [], 0
        for (slot, s, n, base, par), sl in zip(segs, sels):
            results.append(ScoreOutput(logits[o: o + len(sl)], {k: v[s: s + n] for k, v in hidden.items()}))
            o += len(sl)
        return results

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] ids -> [N, H] fp32 residual stream; ``mask_id`` rows get the adapter's MASK vector."""
        if not self._masked:
            return self.embed[ids].float()
        is_mask = ids == self.mask_id
        x = self.embed[ids.clamp_max(self.vocab_size - 1)].float()
        return torch.where(is_mask[:, None], self.adapter.mask[None], x)

    def _gate(self, y: torch.Tensor, li: int, proj: str, h: torch.Tensor) -> torch.Tensor:
        """y (= proj(h), a fresh tensor) plus the adapter's low-rank term on the gated rows
        (in the batch-invariant forward on row tiles like every matmul, so a gated row's
        bits do not depend on how many others are gated with it)."""
        gi = self._gi
        if gi is None:
            return y
        x = h.index_select(0, gi)
        if not self.batch_invariant:
            d = self.adapter.delta(li, proj, x)
        else:
            n = x.shape[0]
            m = self._padded_rows(n)
            if m > n:
                x = torch.cat([x, x[-1:].expand(m - n, -1)])
            t, _ = self._split(m, *self.row_tiles)
            parts, a = [], 0
            for k in range(t):
                r = m // t + (k < m % t)
                parts.append(self.adapter.delta(li, proj, x[a: a + r]))
                a += r
            d = None if parts[0] is None else torch.cat(parts)[:n]
        return y if d is None else y.index_add_(0, gi, d.to(y.dtype))

    def _forward_ragged(self, segs, ids, posi, sel, n_layers, hidden_layers):
        """One matmul over all rows, one SDPA per sequence (not batch-invariant)."""
        masks = []
        for slot, s, n, base, par in segs:
            if n == 1:
                mask = None
            else:
                if all(p == i - 1 for i, p in enumerate(par)):
                    mask = torch.ones(n, base + n, dtype=torch.bool, device=self.device).tril(base)
                else:
                    mask = torch.ones(n, base + n, dtype=torch.bool, device=self.device)
                    mask[:, base:] = trees.ancestor_mask(par, self.device)
                # additive form, built once for all layers (SDPA would convert a bool mask in each)
                mask = torch.zeros(mask.shape, dtype=self.act_dtype, device=self.device).masked_fill_(~mask, float("-inf"))
            masks.append(mask)
        cos = self.cos[posi][:, None]  # [N, 1, hd]
        sin = self.sin[posi][:, None]
        x = self._embed(ids)  # [N, H] residual stream, fp32 in every dtype mode
        ad = self.act_dtype
        hidden: dict[int, torch.Tensor] = {}
        nq, nk, hd = self.n_heads, self.n_kv, self.head_dim
        for li in range(n_layers):
            L = self.layers[li]
            h = rms_norm(x, L.ln1, self.eps, ad)
            qkv = self._gate(L.qkv(h), li, "qkv", h)  # [N, (nq + 2nk) * hd]
            qk = rope(qkv[:, : (nq + nk) * hd].view(-1, nq + nk, hd), cos, sin)  # [N, nq + nk, hd]
            q = qk[:, :nq].transpose(0, 1)  # [nq, N, hd]
            k = qk[:, nq:].transpose(0, 1)  # [nk, N, hd]
            v = qkv[:, (nq + nk) * hd:].view(-1, nk, hd).transpose(0, 1)
            outs = []
            for (slot, s, n, base, par), mask in zip(segs, masks):
                kc, vc = self.k_cache[li, slot], self.v_cache[li, slot]  # [nk, T, hd]
                kc[:, base: base + n] = k[:, s: s + n]
                vc[:, base: base + n] = v[:, s: s + n]
                qs = q[:, s: s + n].unsqueeze(0)
                ks, vs = kc[:, : base + n].unsqueeze(0), vc[:, : base + n].unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
                outs.append(o[0])  # [nq, n, hd]
            a = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
            a = a.transpose(0, 1).reshape(-1, nq * hd)
            x = x + self._gate(L.o(a), li, "o", a)
            h = rms_norm(x, L.ln2, self.eps, ad)
            g_, u_ = self._gate(L.gate_up(h), li, "gate_up", h).chunk(2, -1)
            m = F.silu(g_) * u_
            x = x + self._gate(L.down(m), li, "down", m)
            if li in hidden_layers:
                hidden[li] = x.float()
        # one head matmul for the chosen rows of every segment (reading the head's
        # weights once per forward, not once per session)
        hn = rms_norm(x[sel], self.norm, self.eps)
        logits = self._logits(hn, None)
        return logits, hidden

    # ------------------------------------------------------------------ batch-invariant forward
    @staticmethod
    def _split(n: int, lo: int, hi: int) -> tuple[int, int]:
        """(tiles, rows per tile) for n rows, each tile of lo..hi rows (hi 0: one tile)."""
        t = -(-n // hi) if hi else 1
        return t, max(lo, -(-n // t))

    def _mm(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        """lin(x) over balanced row tiles of ``row_tiles`` = (min, max) rows of x [N, in]
        (N already padded by ``_padded_rows``), one matrix at a time (so a prompt's
        tiles find the weights in cache)."""
        N = x.shape[0]
        t, _ = self._split(N, *self.row_tiles)
        if t == 1:
            return lin(x)
        out, a = [], 0
        for k in range(t):
            m = N // t + (k < N % t)
            out.append(lin(x[a: a + m]))
            a += m
        return torch.cat(out)

    def _padded_rows(self, n: int) -> int:
        """Rows a forward of n rows runs with so that every row tile is full: n rounded
        up to the tile for fixed tiles, at least the minimum for ranges."""
        lo, hi = self.row_tiles
        return -(-n // hi) * hi if lo == hi else max(n, lo)

    def _attn_plan(self, segs, n_rows: int) -> list[tuple[int, int, int, int, Optional[tuple],
                                                                       list[_Attn]]]:
        """Per segment: (slot, start, n, base, restore, attention calls). A chain is one
        call; a tree one call per root-to-leaf path (``_paths``), its keys in chain order
        at [base, base + len) first (only from where the previous path differs;
        ``restore`` = (e0, e1): put the tree layout back there afterwards, for
        ``commit``). Each call's queries are t tiles of R tokens (``attn_tiles``, from
        ``attn_rows``), its keys [0, Lp) with Lp its tokens' last key rounded up to
        ``key_block`` (a path's tokens are split into one call per key block); a token
        at depth e sees keys [0, base + e]. Padding query rows repeat the last row's
        mask; in a chain they are the rows after the call's (the chain's next ones or
        the forward's padding rows) where there are enough, else copies of its last
        row."""
        B, dev = self.key_block, self.device
        g = self.n_heads // self.n_kv
        plan = []
        for slot, s, n, base, par in segs:
            chain = all(p == i - 1 for i, p in enumerate(par))
            paths = [(list(range(n)), list(range(n)))] if chain else trees.root_to_leaf_paths(par)
            calls, cur = [], list(range(n))  # cur[e]: the node whose keys are at base + e
            for path, new in paths:
                e0 = next((e for e, x in enumerate(path) if cur[e] != x), len(path))
                write = None
                if e0 < len(path):
                    w = path[e0:]
                    rows = slice(s + w[0], s + w[-1] + 1) if w == list(range(w[0], w[0] + len(w))) else \
                        torch.tensor([s + i for i in w], dtype=torch.long, device=dev)
                    write = (e0, rows)
                    cur[e0: len(path)] = w
                depth = {node: e for e, node in enumerate(path)}
                # one call per key bucket: a query's keys are padded to the bucket of its
                # own last key (what it gets alone), never to the end of a longer chain —
                # SDPA's bits for a query depend on the key length (module docstring)
                def block_of(i, depth=depth, base=base):  # the key block of node i's last key
                    return -(-(base + depth[i] + 1) // B)

                for gi, (blk, grp) in enumerate(itertools.groupby(new, key=block_of)):
                    grp = list(grp)
                    Lp = blk * B
                    m = len(grp)
                    t, R = self._split(m, *self.attn_tiles)
                    vis = [base + depth[i] + 1 for i in grp]  # keys each token sees
                    vis += [vis[-1]] * (t * R - m)
                    vis = [v for v in vis for _ in range(g)]  # rows: (token, query head of the KV head)
                    mask = torch.zeros(t * R * g, Lp, dtype=self.act_dtype, device=dev)
                    mask.masked_fill_(torch.arange(Lp, device=dev)[None] >= torch.tensor(vis, device=dev)[:, None],
                                      float("-inf"))
                    q0 = s + grp[0]
                    if chain and q0 + t * R <= n_rows:
                        q_rows = None  # the slice [q0, q0 + t * R): the group, then the rows after it
                    else:
                        q_rows = torch.tensor([s + i for i in grp] + [s + grp[-1]] * (t * R - m), dtype=torch.long,
                                              device=dev)
                    calls.append(_Attn(write=write if gi == 0 else None, q0=q0, q_rows=q_rows,
                                       out_rows=torch.tensor([s + i for i in grp], dtype=torch.long, device=dev),
                                       n=m, t=t, R=R, Lp=Lp, mask=mask.view(t, 1, R * g, Lp)))
            moved = [e for e in range(n) if cur[e] != e]
            plan.append((slot, s, n, base, (moved[0], moved[-1] + 1) if moved else None, calls))
        return plan

    def _row_keys(self, segs, n_rows: int):
        """The key-list attention's rows (``keylist_attention.RowKeys``): a chain's token at
        depth e sees its slot's keys [0, base + e]; a tree node sees [0, base), then its
        ancestors root first and itself, where the tree layout writes them (node a at
        base + a) — the key sequence of the same tokens decoded as a chain. Padding rows
        name no keys."""
        from .keylist_attention import RowKeys

        out = []
        for slot, s, n, base, par in segs:
            if all(p == i - 1 for i, p in enumerate(par)):
                out += [(slot, base + i + 1, ()) for i in range(n)]
                continue
            anc: list[list[int]] = []
            for i, p in enumerate(par):
                anc.append((anc[p] if p >= 0 else []) + [base + i])
            out += [(slot, base, a) for a in anc]
        out += [(0, 0, ())] * (n_rows - len(out))
        return RowKeys.build(out)

    def _layer_stack(self):
        """The ``layer_stack.Stack`` bound to these weights and the current cache, or None
        (not int4 / bf16 on our kernels, ``fused_stack`` off, no key-list kernel)."""
        if not self.fused_stack or self.dtype_name not in ("int4", "bf16") or self._keylist is None:
            return None
        key = (self._k_buf.data_ptr(), id(self._keylist))
        if self._stack is None or self._stack[0] != key:
            from . import layer_stack

            self._stack = (key, layer_stack.build(self.layers, self._keylist, self._k_buf, self._v_buf,
                                                  self.n_heads, self.head_dim, self.eps))
        return self._stack[1]

    def _keylist_plan(self, segs, n_rows: int, posi: torch.Tensor):
        """The key-list kernel's plan for one forward (``KeyListAttention.plan``): per row
        its RoPE position, where its K/V go (segment row i at ``base + i`` of its slot;
        padding rows nowhere) and the keys it attends to (``_row_keys``)."""
        wslot, wpos = [-1] * n_rows, [0] * n_rows
        for slot, s, n, base, par in segs:
            wslot[s: s + n] = [slot] * n
            wpos[s: s + n] = range(base, base + n)
        return self._keylist.plan(self._row_keys(segs, n_rows), posi, torch.tensor(wslot), torch.tensor(wpos),
                                  self.cos, self.sin, self._k_buf, self._v_buf, self.n_heads, self.head_dim ** -0.5)

    def _forward_invariant(self, segs, ids, posi, sel, n_layers, hidden_layers):
        """Batch-invariant forward (module docstring)."""
        N0 = ids.shape[0]
        N = self._padded_rows(N0)
        if N > N0:  # padding rows (token 0 at position 0) fill the row tiles; no segment reads them
            ids = torch.cat([ids, ids.new_zeros(N - N0)])
            posi = torch.cat([posi, posi.new_zeros(N - N0)])
        nq, nk, hd = self.n_heads, self.n_kv, self.head_dim
        g = nq // nk
        keylist = self._keylist is not None
        if keylist:  # RoPE, the K/V writes (tree layout) and attention: one kernel call a layer
            kplan = self._keylist_plan(segs, N, posi)
            plan, whole = [], False
        else:
            plan = self._attn_plan(segs, N)
            whole = len(plan) == 1 and len(plan[0][5]) == 1 and plan[0][5][0].q_rows is None \
                and plan[0][5][0].t * plan[0][5][0].R == N  # one call covers every row in order
            cos = self.cos[posi][:, None]  # [N, 1, hd]
            sin = self.sin[posi][:, None]
        x = self._embed(ids)  # [N, H] residual stream, fp32 in every dtype mode
        ad, eps = self.act_dtype, self.eps
        hidden: dict[int, torch.Tensor] = {}
        # bf16 activations: the kernel's residual add + RMSNorm and SwiGLU product (row-wise);
        # the residual add of a layer's MLP waits for the next layer's first norm
        K = self._keylist if keylist and ad == torch.bfloat16 and self.hidden % 16 == 0 \
            and self.layers[0].down.in_features % 16 == 0 else None
        pending = None
        stack = self._layer_stack() if K is not None and self._gi is None else None
        if stack is not None:  # the same kernels, called from C (layer_stack), split where hidden states are kept
            l0 = 0
            for li in sorted({i for i in hidden_layers if i < n_layers - 1}) + [n_layers - 1]:
                stack.run(kplan, l0, li + 1, x)
                if li in hidden_layers:
                    hidden[li] = x[:N0].clone()
                l0 = li + 1
            n_layers = 0  # nothing left for the per-call loop
        for li in range(n_layers):
            L = self.layers[li]
            if K is not None:
                h, pending = K.add_rms_norm(x, pending, L.ln1, eps), None
            else:
                h = rms_norm(x, L.ln1, eps, ad)
            qkv = self._gate(self._mm(L.qkv, h), li, "qkv", h)  # [N, (nq + 2nk) * hd]
            if keylist:
                a = self._keylist.layer(kplan, li, qkv)  # [N, nq * hd]
            else:
                qk = rope(qkv[:, : (nq + nk) * hd].view(N, nq + nk, hd), cos, sin)  # [N, nq + nk, hd]
                q = qk[:, :nq]  # [N, nq, hd]
                k = qk[:, nq:].transpose(0, 1)  # [nk, N, hd]
                v = qkv[:, (nq + nk) * hd:].view(N, nk, hd).transpose(0, 1)
                views = self._kv_views[li]
                a = None if whole else torch.zeros(N, nq, hd, dtype=ad, device=self.device)
            for slot, s, n, base, restore, calls in plan:
                kc, vc, kc4, vc4 = views[slot]  # [nk, T, hd], [1, nk, T, hd]
                if s == 0 and n == N:  # the call's only rows (no slicing ops)
                    kc[:, base: base + n] = k
                    vc[:, base: base + n] = v
                else:
                    kc[:, base: base + n] = k[:, s: s + n]  # tree layout (a chain's is its chain order)
                    vc[:, base: base + n] = v[:, s: s + n]
                for c in calls:
                    if c.write is not None:  # this path's keys in chain order, from where they differ
                        e0, rows = c.write
                        kw = k[:, rows]
                        kc[:, base + e0: base + e0 + kw.shape[1]] = kw
                        vc[:, base + e0: base + e0 + kw.shape[1]] = v[:, rows]
                    qt = (q if whole else q[c.q0: c.q0 + c.t * c.R]) if c.q_rows is None else q[c.q_rows]
                    if c.R == 1:  # one token per tile: [t, 1, nk, g, hd] is already [t, nk, g, hd] in memory
                        qt = qt.view(c.t, nk, g, hd)
                    else:  # [t, nk, R * g, hd]: a KV head's query heads folded into its rows
                        qt = qt.view(c.t, c.R, nk, g, hd).transpose(1, 2).reshape(c.t, nk, c.R * g, hd)
                    if c.t == 1:
                        ks, vs = kc4[:, :, : c.Lp], vc4[:, :, : c.Lp]
                    else:
                        ks = kc4[:, :, : c.Lp].expand(c.t, -1, -1, -1)
                        vs = vc4[:, :, : c.Lp].expand(c.t, -1, -1, -1)
                    o = F.scaled_dot_product_attention(qt, ks, vs, attn_mask=c.mask)
                    if c.R > 1:
                        o = o.view(c.t, nk, c.R, g, hd).transpose(1, 2)  # [t, R, nk, g, hd]
                    if whole:
                        a = o
                    elif c.q_rows is None:
                        a[c.q0: c.q0 + c.n] = o.reshape(c.t * c.R, nq, hd)[: c.n]
                    else:
                        a[c.out_rows] = o.reshape(c.t * c.R, nq, hd)[: c.n]
                if restore is not None:  # the tree layout, for commit
                    e0, e1 = restore
                    kc[:, base + e0: base + e1] = k[:, s + e0: s + e1]
                    vc[:, base + e0: base + e1] = v[:, s + e0: s + e1]
            if not keylist:
                a = a.reshape(N, nq * hd)
            o = self._gate(self._mm(L.o, a), li, "o", a)
            if K is not None:
                h = K.add_rms_norm(x, o, L.ln2, eps)
                m = K.silu_mul(self._gate(self._mm(L.gate_up, h), li, "gate_up", h))
            else:
                x = x + o
                h = rms_norm(x, L.ln2, eps, ad)
                g_, u_ = self._gate(self._mm(L.gate_up, h), li, "gate_up", h).chunk(2, -1)
                m = F.silu(g_) * u_
            d = self._gate(self._mm(L.down, m), li, "down", m)
            if K is None:
                x = x + d
            elif li in hidden_layers or li == n_layers - 1:
                x.add_(d)  # x is updated in place from here on: the hidden states are copies
            else:
                pending = d
            if li in hidden_layers:
                hidden[li] = x[:N0] if K is None else x[:N0].clone()

        n_sel = sel.shape[0]
        m = self._padded_rows(n_sel)
        if m > n_sel:
            sel = torch.cat([sel, sel[-1:].expand(m - n_sel)])
        hn = rms_norm(x[sel], self.norm, eps)
        logits = self._logits(hn, self._mm)
        return logits[:n_sel], hidden
