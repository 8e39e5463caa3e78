"""The int4 and bf16 engines' decoder layers in one C call: the same kernels, called from C.

Why it exists: a decode step of the int4 engine is about 60% weight matmuls; most of
the rest was the step's ~240 calls per token from Python into the kernels (per layer
two residual-add + RMSNorms, four matmuls, the key-list attention layer and the
SwiGLU product), each with its argument checks, a fresh output tensor and a ctypes
crossing of a few microseconds. ``Stack.run`` makes one call for a range of layers; a
small C driver calls the very functions the per-call path calls (their addresses
are taken from the loaded ``specmesh.int4_matmul`` or ``specmesh.bf16_matmul`` and
``specmesh.keylist_attention`` libraries), in the same order on the same inputs, into
one workspace. So every row's bits equal the per-call path's (tested), and no kernel
is compiled twice.

What the driver does per layer: ``x += d`` (the previous layer's MLP output, fp32 add)
and RMSNorm -> h; qkv = h W_qkv (+ bias, rounded to bf16 as torch's bf16 add is); the
key-list layer (RoPE, K/V cache writes, attention) -> a; o = a W_o (+ bias); ``x += o``
and RMSNorm -> h; gu = h W_gate_up; m = silu(g) * u; d = m W_down. After the range's
last layer ``x += d``. The caller (``engine._forward_invariant``) splits the range
where it keeps hidden states.

Knows nothing about models, sessions or plans beyond the pointers it is given: the
engine decides when it applies (every matrix on our int4 or bf16 kernel, one matmul
function for all of them, no adapter rows in the forward, bf16 activations with the
key-list kernel).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional, Sequence

import torch

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef int (*mm4_fn)(const uint16_t*, int64_t, int64_t, const void*, int64_t, int64_t, float*, uint16_t*);
typedef int (*mm16_fn)(const uint16_t*, int64_t, int64_t, const void*, int64_t, uint16_t*);
typedef int (*attn_fn)(const void*, const uint16_t*, uint16_t*, uint16_t*, uint16_t*);
typedef void (*rms_fn)(float*, const uint16_t*, const float*, uint16_t*, int64_t, int64_t, float);
typedef void (*silu_fn)(const uint16_t*, uint16_t*, int64_t, int64_t);

typedef struct {
    const void *qkv, *o, *gu, *down;           /* packed weights (int4_matmul.pack / bf16_matmul.pack) */
    const uint16_t *bqkv, *bo, *bgu, *bdown;   /* bf16 biases, or NULL */
    const float *ln1, *ln2;                    /* fp32 RMSNorm weights */
} layer_w;

typedef struct {
    void *mm, *attn, *rms, *silu;              /* the kernels' entry points */
    int64_t kind;                              /* mm: 0 int4_mm (takes group, xs), 1 bf16_mm */
    int64_t H, I, qkv_row, attn_w, group, n_layers, layer_bytes;
    const layer_w* layers;
    char *k0, *v0;                             /* layer 0 of the K / V cache */
    float eps;
} stack_def;

static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* y [N, W] bf16 += b [W] bf16: the sum in fp32, rounded to nearest even (NaN stays NaN) */
static void add_bias(uint16_t* y, const uint16_t* b, int64_t N, int64_t W) {
    if (!b) return;
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < W; j++) {
            float f = bf(y[n * W + j]) + bf(b[j]); uint32_t u; memcpy(&u, &f, 4);
            y[n * W + j] = (f != f) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
}

static inline int mm(const stack_def* S, const uint16_t* x, int64_t N, int64_t K, const void* w, int64_t n,
                     float* xs, uint16_t* y) {
    return S->kind == 0 ? ((mm4_fn)S->mm)(x, N, K, w, n, S->group, xs, y) : ((mm16_fn)S->mm)(x, N, K, w, n, y);
}

/* layers [l0, l1) on the fp32 residual stream x [N, H] (in place). ws: bf16 workspace of
   N * (3 H + qkv_row + attn_w + 3 I) elements; xs: fp32 scratch of N * max(H, attn_w, I) / group.
   0: done; 1: a matmul refused; 2: attention ran out of memory. */
int stack_run(const stack_def* S, const void* plan, int64_t l0, int64_t l1, int64_t N, float* x,
              uint16_t* ws, float* xs) {
    const attn_fn attn = (attn_fn)S->attn;
    const rms_fn rms = (rms_fn)S->rms; const silu_fn silu = (silu_fn)S->silu;
    const int64_t H = S->H, I = S->I, R = S->qkv_row, A = S->attn_w;
    uint16_t *h = ws, *qkv = h + N * H, *a = qkv + N * R, *o = a + N * A, *gu = o + N * H, *m = gu + N * 2 * I,
             *d = m + N * I;
    const uint16_t* pending = NULL;
    for (int64_t li = l0; li < l1; li++) {
        const layer_w* L = S->layers + li;
        rms(x, pending, L->ln1, h, N, H, S->eps);
        if (mm(S, h, N, H, L->qkv, R, xs, qkv)) return 1;
        add_bias(qkv, L->bqkv, N, R);
        if (attn(plan, qkv, (uint16_t*)(S->k0 + li * S->layer_bytes), (uint16_t*)(S->v0 + li * S->layer_bytes), a))
            return 2;
        if (mm(S, a, N, A, L->o, H, xs, o)) return 1;
        add_bias(o, L->bo, N, H);
        rms(x, o, L->ln2, h, N, H, S->eps);
        if (mm(S, h, N, H, L->gu, 2 * I, xs, gu)) return 1;
        add_bias(gu, L->bgu, N, 2 * I);
        silu(gu, m, N, I);
        if (mm(S, m, N, I, L->down, H, xs, d)) return 1;
        add_bias(d, L->bdown, N, H);
        pending = d;
    }
    if (pending)
        for (int64_t i = 0; i < N * H; i++) x[i] += bf(pending[i]);
    return 0;
}
"""

_lock = threading.Lock()
_state: dict = {}


class _LayerW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("qkv", "o", "gu", "down", "bqkv", "bo", "bgu", "bdown", "ln1", "ln2")]


class _Def(ctypes.Structure):
    _fields_ = [("mm", ctypes.c_void_p), ("attn", ctypes.c_void_p), ("rms", ctypes.c_void_p),
                ("silu", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in (
                    "kind", "H", "I", "qkv_row", "attn_w", "group", "n_layers", "layer_bytes")] + [
        ("layers", ctypes.POINTER(_LayerW)), ("k0", ctypes.c_void_p), ("v0", ctypes.c_void_p), ("eps", ctypes.c_float)]


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class Stack:
    """The decoder layers of one int4 or bf16 engine, bound to its weights and K/V cache
    (``build``); ``run`` executes a range of them."""

    def __init__(self, fn, d: _Def, layers, keep: list, width: int, xs_width: int, H: int):
        """(Made by ``build``.) ``xs_width``: the int4 matmul's fp32 scratch per row."""
        self._fn, self._def, self._layers, self._keep = fn, d, layers, keep
        self._width, self._xs_width, self._H = width, xs_width, H

    def run(self, plan, l0: int, l1: int, x: torch.Tensor) -> None:
        """Layers [l0, l1) on x [N, H] fp32 (contiguous, updated in place), attending by
        ``plan`` (``KeyListAttention.plan`` of this forward, on the bound cache)."""
        N = x.shape[0]
        d = self._def
        if (x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self._H or plan.shape[0] != N
                or plan.shape[2] != d.qkv_row or plan.cache[0] != d.k0 or plan.cache[1] != d.v0
                or not 0 <= l0 <= l1 <= d.n_layers):
            raise ValueError(f"layer stack: unsupported input (x {tuple(x.shape)} {x.dtype}, layers {l0}..{l1})")
        ws = torch.empty(N * self._width, dtype=torch.bfloat16)  # per call: forwards may run in threads
        xs = torch.empty(N * self._xs_width, dtype=torch.float32)
        rc = self._fn(ctypes.byref(d), ctypes.byref(plan.struct), l0, l1, N, x.data_ptr(), ws.data_ptr(),
                      xs.data_ptr())
        if rc == 2:
            raise MemoryError("keylist attention: out of memory for its score buffers")
        if rc:
            raise RuntimeError("layer stack: a matmul failed (no kernel for this CPU, or out of memory)")


def _library():
    from .keylist_attention import cached_load, compile_library

    def make():
        lib, _ = compile_library("layerstack", _SOURCE)
        fn = lib.stack_run
        P, I = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [P, P, I, I, I, P, P, P]
        fn.restype = ctypes.c_int
        return fn

    return cached_load(_state, _lock, make)


def _matmul(ms) -> Optional[tuple[int, int, int]]:
    """(kind, entry point, group) of the one matmul function every matrix ``ms`` runs on,
    or None (a matrix on torch's kernel, or two functions)."""
    fns = set()
    for m in ms:
        if m.mode == "int4" and m._k4 is not None:
            fns.add((0, _addr(m._k4._mm), m.group))
        elif m.mode == "bf16" and m._kb is not None:
            fns.add((1, _addr(m._kb.fn(m.in_features)), 0))
        else:
            return None
    return fns.pop() if len(fns) == 1 else None


def build(layers: Sequence, keylist, k_buf: torch.Tensor, v_buf: torch.Tensor, n_heads: int, head_dim: int,
          eps: float) -> Optional[Stack]:
    """A ``Stack`` over the engine's ``layers`` (each with ``ln1``, ``qkv``, ``o``, ``ln2``,
    ``gate_up``, ``down``: ``engine.Linear`` and fp32 norm weights) and its bf16 cache
    [layers, slots, nk, T, hd]; None where it does not apply (a matrix not on our int4 or
    bf16 kernel, matrices on different matmul functions or groups, shapes the kernels do
    not take, no compiler: then the engine keeps its per-call path)."""
    if keylist is None or not layers or k_buf.dtype != torch.bfloat16 or not k_buf.is_contiguous() \
            or not v_buf.is_contiguous():
        return None
    lins = [(L.qkv, L.o, L.gate_up, L.down) for L in layers]
    fn = _matmul([m for ls in lins for m in ls])
    if fn is None:
        return None
    kind, mm_addr, group = fn
    H = layers[0].ln1.shape[0]
    I = layers[0].down.in_features
    attn_w = n_heads * head_dim
    qkv_row = layers[0].qkv.out_features
    if H % 16 or I % 16 or any(ls[0].out_features != qkv_row or ls[1].in_features != attn_w or ls[1].out_features != H
                               or ls[2].out_features != 2 * I or ls[3].out_features != H for ls in lins):
        return None
    run = _library()
    if run is None:
        return None
    keep = []  # the tensors whose addresses the C side holds (biases as contiguous bf16)
    arr = (_LayerW * len(layers))()
    for i, (L, ls) in enumerate(zip(layers, lins)):
        bias = []
        for m in ls:
            b = None if m.b is None else m.b.to(torch.bfloat16).contiguous()
            keep.append(b)
            bias.append(_ptr(b))
        arr[i] = _LayerW(*(m.w.data_ptr() for m in ls), *bias, L.ln1.data_ptr(), L.ln2.data_ptr())
        keep += [L.ln1, L.ln2, *(m.w for m in ls)]
    d = _Def(mm_addr, _addr(keylist._layers[torch.bfloat16]), _addr(keylist._rms), _addr(keylist._silu),
             kind, H, I, qkv_row, attn_w, group, len(layers), k_buf[0].numel() * k_buf.element_size(), arr,
             k_buf.data_ptr(), v_buf.data_ptr(), float(eps))
    width = 3 * H + qkv_row + attn_w + 3 * I
    return Stack(run, d, arr, keep, width, max(H, attn_w, I) // group if group else 1, H)
