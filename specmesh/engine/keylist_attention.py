"""Attention by key list on the CPU: each query row attends to the key positions it
names, in the order it names them, computed one row at a time by a small C kernel.

Why it exists: the batch-invariant forward (``specmesh.engine``) needs a row's
attention output to depend on nothing but its own query and its own key sequence.
torch's CPU SDPA computes a block of query rows together, and its bits for a row
depend on the block's row count and on the padded key length, so the engine's tile
path pads every call to a fixed tile of 4 tokens and attends a draft tree one
root-to-leaf path at a time (the path's keys rewritten in chain order before each
call). Here a row names its keys instead: the first ``ctx`` positions of its slot,
then a list (a tree node's ancestors, itself last, where the tree wrote them). The
same key sequence gives the same bits whether the row is decoded alone, is row j of
a chain, or is a tree node; no padding rows, no per-path rewrites.

The arithmetic, per (row, query head): scores ``s_j = (q * scale) . k_j`` in fp32
(16 partial sums over the head dimension, reduced in a fixed order), ``m = max s``,
``p_j = exp(s_j - m)`` (a degree-6 polynomial for 2^f, so no libm and the same bits
on every call), ``out = sum_j p_j v_j / sum_j p_j``, rounded to the cache dtype
(bf16 or fp32). Rows (times KV heads) are split over OpenMP threads; a row's work
never is, so the thread count does not change its bits. Query heads that share a KV
head share its key loads.

The engine calls it a layer at a time (``plan`` once per forward, then ``layer``):
from the layer's qkv projection the kernel applies the rotate-half RoPE to q and k
(fp32 products, rounded to the cache dtype for k), writes each row's k and v to the
cache position the plan names, then attends, so a layer's attention costs one call
instead of a dozen torch ops. ``add_rms_norm`` is the residual add and row-wise RMSNorm (fp32
rows in, bf16 out, sum of squares in 16 lanes reduced in a fixed order) and
``silu_mul`` SwiGLU's product, for the bf16 and int4/int8 engines. ``__call__`` is attention alone (q already rotated, keys already
in the cache).

On CPUs with AVX2 and without AVX-512 the score and value loops of 64- and 128-wide
heads run on 8-lane intrinsics with the same arithmetic (the same bits as the generic
vector code, tested): GCC moves 16-lane vectors through memory there, and a layer of
one row against 300 keys cost 187 us instead of 34 (2-core AMD EPYC, Zen 3). On CPUs
with AVX-512 they run with the head width a constant, the sums in registers and 16
keys' lane sums reduced together (same bits again, tested): 1.4-1.5x the generic loops
for one row, 1.7-2.0x for a chain of 8-16 rows (2 Xeon cores with AMX, 300-1000 keys,
the two builds side by side in one process).

The kernel's C source is ``csrc/keylist_attention.c``; ``c_source`` reads the C of every
kernel here, ``compile_library`` builds it. The kernel is built once per machine and
compiler (``cc -O3 -march=native -fopenmp``) into ``~/.cache/specmesh/kernels``
(``SPECMESH_KERNEL_CACHE``) and loaded with ctypes. Its OpenMP runtime is the one torch already loaded (same soname), so
``torch.set_num_threads`` and the process's spin policy apply. Where no compiler is
found or the build fails, ``load()`` returns None with the reason in
``load_error()``, and the engine keeps its SDPA tiles.

Knows nothing about models, sessions or trees beyond the row descriptions it is given.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

HEAD_DIM_MULTIPLE = 16  # the kernel's lanes along the head dimension (at most 256)
CSRC = Path(__file__).with_name("csrc")  # the kernels' C sources (package data, beside this module)


def c_source(name: str, root: Optional[Path] = None) -> str:
    """The text of ``csrc/<name>`` (or ``root/<name>``) as the kernel builder compiles it:
    each line ``#include "<file>"`` naming a file of that folder is replaced by the file's
    text (its last newline dropped), so the builder compiles (and its cache key hashes) one
    self-contained text, with no include path. csrc/README.md says what each file is."""
    root = CSRC if root is None else root
    text = (root / name).read_text(encoding="utf-8")

    def inline(m: re.Match) -> str:
        path = root / m.group(1)
        return path.read_text(encoding="utf-8").removesuffix("\n") if path.is_file() else m.group(0)

    return re.sub(r'^#include "([\w.]+)"$', inline, text, flags=re.M)


_SOURCE = c_source("keylist_attention.c")

_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
_lock = threading.Lock()
_state: dict = {}


def _cpu_id() -> str:
    """What ``-march=native`` builds for: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor() or platform.machine()


def _build(cc: str, target: Path, source: str, flags: Sequence[str] = ()) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / (target.stem + ".c")
        src.write_text(source)
        lib = Path(tmp) / target.name
        r = subprocess.run([cc, *_FLAGS, *flags, "-o", str(lib), str(src)], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        os.replace(lib, target)  # atomic: a concurrent builder's copy is as good as ours


def compile_library(name: str, source: str, flags: Sequence[str] = ()) -> tuple[ctypes.CDLL, Path]:
    """C ``source`` built once per machine and compiler (``cc -O3 -march=native -fopenmp``,
    then ``flags``) into the kernel cache as ``<name>-<hash>.so`` and loaded (torch first,
    so the library shares its OpenMP runtime). Raises where there is no compiler or the
    build fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc / gcc / $CC) on PATH")
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([source, " ".join([*_FLAGS, *flags]), ver, _cpu_id()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("SPECMESH_KERNEL_CACHE") or Path.home() / ".cache" / "specmesh" / "kernels")
    target = root / f"{name}-{key}.so"
    if not target.exists():
        _build(cc, target, source, flags)
    import torch as _t  # noqa: F401 - torch (and its OpenMP runtime) loads first: the kernel shares it

    return ctypes.CDLL(str(target)), target


class _Plan(ctypes.Structure):
    """``layer_plan`` of the C source."""

    _fields_ = [(n, ctypes.c_int64) for n in ("N", "nq", "nk", "hd", "T", "qkv_row")] + \
        [(n, ctypes.c_void_p) for n in ("cos", "sin", "rope_pos", "wslot", "wpos", "slot", "ctx", "off", "cnt",
                                        "anc")] + [("scale", ctypes.c_float)]


@dataclass
class LayerPlan:
    """One forward's rows for ``KeyListAttention.layer``, built once and used by every
    layer (it keeps the tensors its pointers name alive)."""

    rows: "RowKeys"
    tensors: tuple
    struct: _Plan
    dtype: torch.dtype
    shape: tuple  # (N, nq * hd, qkv row width)
    cache: tuple  # (K buffer address, V buffer address, bytes per layer, layers)


class KeyListAttention:
    """The loaded kernel (``load()``)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        P, I = ctypes.c_void_p, ctypes.c_int64
        self._fns, self._layers = {}, {}
        for dt, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            fn = getattr(lib, f"keylist_attend_{suffix}")
            fn.argtypes = [P, I, I, P, P, I, I, P, P, P, P, P, P, I, I, I, ctypes.c_float]
            fn.restype = ctypes.c_int
            self._fns[dt] = fn
            fn = getattr(lib, f"keylist_layer_{suffix}")
            fn.argtypes = [ctypes.POINTER(_Plan), P, P, P, P]
            fn.restype = ctypes.c_int
            self._layers[dt] = fn
        self._rms = lib.add_rmsnorm_bf16
        self._rms.argtypes = [P, P, P, P, I, I, ctypes.c_float]
        self._rms.restype = None
        lib.keylist_fast8.restype = ctypes.c_int
        self.fast8 = bool(lib.keylist_fast8())  # the AVX2 score and value loops were built (same bits)
        lib.keylist_fast16.restype = ctypes.c_int
        self.fast16 = bool(lib.keylist_fast16())  # the AVX-512 ones (same bits)
        self._silu = lib.silu_mul_bf16
        self._silu.argtypes = [P, P, I, I]
        self._silu.restype = None

    def add_rms_norm(self, x: torch.Tensor, d: Optional[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
        """The residual add and RMSNorm: x += d in place (x fp32 [N, H] contiguous, d bf16
        [N, H] or None), then RMSNorm of x with fp32 weights w [H], as bf16 [N, H] (H a
        multiple of 16). Each row's bits depend on that row alone; x's equal torch's
        ``x + d``."""
        N, H = x.shape
        if (x.dtype != torch.float32 or w.dtype != torch.float32 or not x.is_contiguous() or w.shape != (H,)
                or H % 16 or (d is not None and (d.dtype != torch.bfloat16 or d.shape != x.shape
                                                 or not d.is_contiguous()))):
            raise ValueError(f"keylist add_rms_norm: unsupported input {tuple(x.shape)} {x.dtype}")
        y = torch.empty(N, H, dtype=torch.bfloat16)
        self._rms(x.data_ptr(), None if d is None else d.data_ptr(), w.data_ptr(), y.data_ptr(), N, H, float(eps))
        return y

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """SwiGLU's product of bf16 rows gu [N, 2I] = [gate | up] (contiguous, I a multiple
        of 16): silu(gate) * up computed in fp32, rounded once to bf16 [N, I]."""
        N, I2 = gu.shape
        if gu.dtype != torch.bfloat16 or not gu.is_contiguous() or I2 % 32:
            raise ValueError(f"keylist silu_mul: unsupported input {tuple(gu.shape)} {gu.dtype}")
        m = torch.empty(N, I2 // 2, dtype=torch.bfloat16)
        self._silu(gu.data_ptr(), m.data_ptr(), N, I2 // 2)
        return m

    def plan(self, rows: "RowKeys", rope_pos: torch.Tensor, wslot: torch.Tensor, wpos: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, n_heads: int,
             scale: float) -> LayerPlan:
        """A forward's rows for ``layer``: per row its RoPE position, where its K/V go
        (``wslot`` < 0: nowhere; ``wpos``) and the keys it attends to (``rows``); ``cos`` /
        ``sin`` [positions, hd]: the rotate-half tables (sin signed); ``k_buf`` / ``v_buf``:
        the whole cache [layers, slots, nk, T, hd], contiguous, all in one dtype."""
        N = rows.n
        n_layers, n_slots, n_kv, T, hd = k_buf.shape
        i32 = [t.to(torch.int32).contiguous() for t in (rope_pos, wslot, wpos)]
        ok = (cos.dtype == sin.dtype == k_buf.dtype == v_buf.dtype and cos.dtype in self._layers
              and cos.is_contiguous() and sin.is_contiguous() and k_buf.is_contiguous() and v_buf.is_contiguous()
              and v_buf.shape == k_buf.shape and sin.shape == cos.shape and cos.shape[1] == hd
              and hd % HEAD_DIM_MULTIPLE == 0 and hd <= 256 and n_heads % n_kv == 0
              and all(t.shape == (N,) for t in i32))
        if ok and N:
            ok = (0 <= int(i32[0].min()) and int(i32[0].max()) < cos.shape[0]
                  and int(i32[1].max()) < n_slots and (int(i32[2].min()) >= 0 and int(i32[2].max()) < T)
                  and 0 <= int(rows.slot.min()) and int(rows.slot.max()) < n_slots
                  and int((rows.ctx + rows.cnt).max()) <= T)
        if not ok:
            raise ValueError(f"keylist attention: unsupported plan (N {N}, tables {tuple(cos.shape)} {cos.dtype}, "
                             f"cache {tuple(k_buf.shape)} {k_buf.dtype})")
        st = _Plan(N, n_heads, n_kv, hd, T, (n_heads + 2 * n_kv) * hd, cos.data_ptr(), sin.data_ptr(),
                   *(t.data_ptr() for t in i32), rows.slot.data_ptr(), rows.ctx.data_ptr(), rows.off.data_ptr(),
                   rows.cnt.data_ptr(), rows.anc.data_ptr(), float(scale))
        layer_bytes = k_buf[0].numel() * k_buf.element_size()
        return LayerPlan(rows, (cos, sin, k_buf, v_buf, *i32), st, cos.dtype, (N, n_heads * hd, st.qkv_row),
                         (k_buf.data_ptr(), v_buf.data_ptr(), layer_bytes, n_layers))

    def layer(self, plan: LayerPlan, li: int, qkv: torch.Tensor) -> torch.Tensor:
        """Layer ``li``'s attention from its qkv projection [N, (nq + 2 nk) * hd] (contiguous):
        RoPE on q and k, k and v written to that layer's cache where each row's go, then
        each row's attention over the keys it names: [N, nq * hd]."""
        N, width, row = plan.shape
        k0, v0, step, n_layers = plan.cache
        if qkv.dtype != plan.dtype or not qkv.is_contiguous() or qkv.shape != (N, row) or not 0 <= li < n_layers:
            raise ValueError(f"keylist attention: unsupported layer input (layer {li}, qkv {tuple(qkv.shape)} "
                             f"{qkv.dtype})")
        out = torch.empty(N, width, dtype=plan.dtype)
        if self._layers[plan.dtype](ctypes.byref(plan.struct), qkv.data_ptr(), k0 + li * step, v0 + li * step,
                                    out.data_ptr()):
            raise MemoryError("keylist attention: out of memory for its score buffers")
        return out

    def __call__(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, rows: "RowKeys",
                 scale: float) -> torch.Tensor:
        """Attention alone (no RoPE, no cache writes): q [N, nq, hd] (rows and heads may be
        strided, the head dimension contiguous) against one layer's cache [slots, nk, T, hd]
        (contiguous); returns [N, nq, hd] in q's dtype. A row with no keys gets zeros."""
        N, nq, hd = q.shape
        S, nk, T, hd2 = k_layer.shape
        fn = self._fns.get(q.dtype)
        if (fn is None or hd2 != hd or q.stride(2) != 1 or k_layer.dtype != q.dtype or v_layer.dtype != q.dtype
                or not (k_layer.is_contiguous() and v_layer.is_contiguous()) or nq % nk or rows.n != N
                or hd % HEAD_DIM_MULTIPLE or hd > 256 or q.device.type != "cpu"):
            raise ValueError("keylist attention: unsupported layout "
                             f"(q {tuple(q.shape)} {q.dtype} strides {q.stride()}, cache {tuple(k_layer.shape)})")
        out = torch.empty(N, nq, hd, dtype=q.dtype)
        failed = fn(q.data_ptr(), q.stride(0), q.stride(1), k_layer.data_ptr(), v_layer.data_ptr(), nk, T,
                    rows.slot.data_ptr(), rows.ctx.data_ptr(), rows.off.data_ptr(), rows.cnt.data_ptr(),
                    rows.anc.data_ptr(), out.data_ptr(), N, nq, hd, float(scale))
        if failed:
            raise MemoryError("keylist attention: out of memory for its score buffers")
        return out


@dataclass
class RowKeys:
    """Per query row: its slot, the first ``ctx`` positions of the slot's keys, then
    ``cnt`` more positions ``anc[off : off + cnt]`` (int32 tensors, CPU)."""

    slot: torch.Tensor
    ctx: torch.Tensor
    off: torch.Tensor
    cnt: torch.Tensor
    anc: torch.Tensor
    n: int

    @classmethod
    def build(cls, rows: Sequence[tuple[int, int, Sequence[int]]]) -> "RowKeys":
        """rows: (slot, ctx, extra positions) per query row."""
        slot, ctx, off, cnt, anc = [], [], [], [], []
        for s, c, extra in rows:
            slot.append(s)
            ctx.append(c)
            off.append(len(anc))
            cnt.append(len(extra))
            anc.extend(extra)
        i32 = lambda x: torch.tensor(x or [0], dtype=torch.int32)  # noqa: E731 - never an empty buffer
        return cls(i32(slot), i32(ctx), i32(off), i32(cnt), i32(anc), len(rows))


def kernel_choice(var: str, choices: tuple) -> str:
    """The loaders' environment switch ``var`` (default "specmesh", lower-cased): one of
    ``choices``; RuntimeError naming it where it is unknown or "torch" (the caller then
    keeps its torch path)."""
    choice = os.environ.get(var, "specmesh").lower()
    if choice not in choices:
        raise RuntimeError(f"{var}={choice!r}: one of {', '.join(choices)}")
    if choice == "torch":
        raise RuntimeError(f"{var}=torch")
    return choice


def require(lib: ctypes.CDLL, probes: Sequence[str], message: str) -> None:
    """Call the library's ``int (void)`` functions ``probes`` in order (whether a path was
    built for this CPU; AMX's also asks for the tile state); RuntimeError(message) at the
    first that returns 0: the kernel loaders' check of one variant."""
    for name in probes:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        if not fn():
            raise RuntimeError(message)


def pick_variant(choice: str, variant: Callable[[str], object], fastest_first: Sequence[str]) -> object:
    """The loaders' choice of a kernel variant: ``variant(choice)``, or for "specmesh" the
    first of ``fastest_first`` that ``variant`` does not refuse (RuntimeError naming every
    refusal where all are)."""
    if choice != "specmesh":
        return variant(choice)
    errors = []
    for isa in fastest_first:
        try:
            return variant(isa)
        except RuntimeError as e:
            errors.append(str(e))
    raise RuntimeError("; ".join(errors))


def cached_load(state: dict, lock: threading.Lock, make: Callable[[], object]) -> Optional[object]:
    """``make()`` once per process under ``lock``, kept in ``state`` (``"kernel"``; None and
    the reason in ``"error"`` where it raised): the loaders' shared memo."""
    with lock:
        if "kernel" not in state:
            kernel, err = None, ""
            try:
                kernel = make()
            except Exception as e:  # noqa: BLE001 - any failure: the caller keeps its torch path
                err = f"{type(e).__name__}: {e}"
            state["kernel"], state["error"] = kernel, err
        return state["kernel"]


def generic_build() -> KeyListAttention:
    """The kernel built without its AVX2 loops (``KEYLIST_GENERIC``): the generic vector
    code everywhere, for tests that compare the two."""
    return KeyListAttention(*compile_library("keylist-generic", "#define KEYLIST_GENERIC 1\n" + _SOURCE))


def avx2_build() -> KeyListAttention:
    """The kernel built as for a CPU with AVX2 and no AVX-512 (``-mno-avx512f``), so the
    8-lane loops are tested on AVX-512 CPUs too (they run on any AVX2 CPU). Raises where
    the compiler refuses."""
    return KeyListAttention(*compile_library("keylist-avx2", _SOURCE, ("-mno-avx512f",)))


def load() -> Optional[KeyListAttention]:
    """The kernel, built on first use (None where it cannot be: ``load_error()`` says why;
    the engine then keeps SDPA tiles). ``SPECMESH_CPU_ATTENTION=sdpa`` turns it off."""

    def make() -> KeyListAttention:
        if os.environ.get("SPECMESH_CPU_ATTENTION", "keylist").lower() == "sdpa":
            raise RuntimeError("SPECMESH_CPU_ATTENTION=sdpa")
        return KeyListAttention(*compile_library("keylist", _SOURCE))

    return cached_load(_state, _lock, make)


def load_error() -> str:
    """Why ``load()`` returned None ("" when it did not, or before it ran)."""
    return _state.get("error", "")
