"""The int4 and bf16 engines' decoder layers in one C call: the same kernels, called from C.

Why it exists: a decode step of the int4 engine is about 60% weight matmuls; most of
the rest was the step's ~240 calls per token from Python into the kernels (per layer
two residual-add + RMSNorms, four matmuls, the key-list attention layer and the
SwiGLU product), each with its argument checks, a fresh output tensor and a ctypes
crossing of a few microseconds. ``Stack.run`` makes one call for a range of layers; a
small C driver calls the very functions the per-call path calls (their addresses
are taken from the loaded ``specmesh.engine.int4_matmul`` or ``specmesh.engine.bf16_matmul`` and
``specmesh.engine.keylist_attention`` libraries), in the same order on the same inputs, into
one workspace. So every row's bits equal the per-call path's (tested), and no kernel
is compiled twice.

What the driver does per layer: ``x += d`` (the previous layer's MLP output, fp32 add)
and RMSNorm -> h; qkv = h W_qkv (+ bias, rounded to bf16 as torch's bf16 add is); the
key-list layer (RoPE, K/V cache writes, attention) -> a; o = a W_o (+ bias); ``x += o``
and RMSNorm -> h; gu = h W_gate_up; m = silu(g) * u; d = m W_down. After the range's
last layer ``x += d``. The caller (``engine._forward_invariant``) splits the range
where it keeps hidden states. The driver's C source is ``csrc/layer_stack.c``.

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

from .keylist_attention import c_source

_SOURCE = c_source("layer_stack.c")

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

    def __init__(self, fn, d: _Def, layers, keep: list, width: int, xs_floats, H: int):
        """(Made by ``build``.) ``xs_floats(N)``: the matmuls' fp32 scratch for N rows."""
        self._fn, self._def, self._layers, self._keep = fn, d, layers, keep
        self._width, self._xs_floats, self._H = width, xs_floats, H

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
        xs = torch.empty(self._xs_floats(N), dtype=torch.float32)
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
        elif m.mode == "q":
            fns.add((2, m.qm.kernel.mm_addr, 0))
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
        # the matmul's weight argument: the packed tensor, or for GGUF blocks their matrix description
        arr[i] = _LayerW(*(m.qm.addr if kind == 2 else m.w.data_ptr() for m in ls), *bias, L.ln1.data_ptr(),
                         L.ln2.data_ptr())
        keep += [L.ln1, L.ln2, *(m.qm if kind == 2 else m.w for m in ls)]
    d = _Def(mm_addr, _addr(keylist._layers[torch.bfloat16]), _addr(keylist._rms), _addr(keylist._silu),
             kind, H, I, qkv_row, attn_w, group, len(layers), k_buf[0].numel() * k_buf.element_size(), arr,
             k_buf.data_ptr(), v_buf.data_ptr(), float(eps))
    width = 3 * H + qkv_row + attn_w + 3 * I
    kmax = max(H, attn_w, I)
    if kind == 2:  # the block kernels' int8 rows of the widest input, for the call's N rows
        lib = layers[0].qkv.qm.kernel.lib

        def xs_floats(n: int) -> int:
            return -(-int(lib.qmm_scratch_bytes(n, kmax)) // 4)
    else:
        per = kmax // group if group else 1

        def xs_floats(n: int) -> int:
            return n * per
    return Stack(run, d, arr, keep, width, xs_floats, H)
