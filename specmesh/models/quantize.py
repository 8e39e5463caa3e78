"""Full-precision weights into GGUF blocks, as llama.cpp's quantizer writes them: the
bytes of Q8_0, Q4_1 and Q4_K blocks (``quantize(w, type)``), so a Hugging Face directory
of bf16/fp32 safetensors runs on the same block kernels as a GGUF (``engine.qmatmul``).

- Q8_0 (32 inputs): d = max|w| / 127 (fp16), q = round(w / d).
- Q4_1 (32 inputs): d = (max - min) / 15, m = min (fp16 both), q = round((w - m) / d).
- Q4_K (256 inputs, 8 sub-blocks of 32): per sub-block a scale and a min searched the
  way llama.cpp's ``make_qkx2_quants`` does (20 candidate scales around (max - min) / 15,
  each refit by least squares on its codes, the lowest weighted squared error kept; the
  weights ``rms + |w|``), then the 8 scales and 8 mins on 6-bit grids under fp16
  super-scales d and dmin, and the codes again for the rounded scales.

``PackedCache`` keeps a model's quantized tensors (raw block bytes with their type) in one
safetensors file under the cache, keyed by the model files' names, sizes and times, so a
directory is quantized once. Knows nothing about engines or kernels: tensors and bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
BLOCK = {Q4_1: 32, Q8_0: 32, Q4_K: 256}


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..] -> its fp16 bits as 2 bytes each [.., 2] (little-endian)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _half(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp16 and back (what the block stores)."""
    return x.to(torch.float16).float()


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    b = w.float().reshape(N, K // 32, 32)
    d = b.abs().amax(-1) / 127.0
    idn = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * idn[..., None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([_half_bytes(d), q.view(torch.uint8)], -1).reshape(N, -1)


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    b = w.float().reshape(N, K // 32, 32)
    lo, hi = b.amin(-1), b.amax(-1)
    d = (hi - lo) / 15.0
    idn = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((b - lo[..., None]) * idn[..., None]).clamp_(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_half_bytes(d), _half_bytes(lo), qs], -1).reshape(N, -1)


def _qkx2(x: torch.Tensor, wts: torch.Tensor, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1,
          nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and (non-negative) min of each row of x [R, n] for codes 0..nmax (llama.cpp's
    make_qkx2_quants, vectorised): w ~ scale * q - min."""
    lo = x.amin(-1).clamp(max=0.0)
    hi = x.amax(-1)
    span = (hi - lo).clamp_min(1e-30)
    flat = hi <= lo
    sw = wts.sum(-1)

    def fit(scale_inv):
        q = torch.round(scale_inv[:, None] * (x - lo[:, None])).clamp_(0, nmax)
        return q

    def err(q, scale, mn):
        diff = scale[:, None] * q + mn[:, None] - x
        return (wts * diff * diff).sum(-1)

    q = fit(nmax / span)
    scale, mn = span / nmax, lo
    best = err(q, scale, mn)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / span
        q = fit(iscale)
        sl, sl2, sxl = (wts * q).sum(-1), (wts * q * q).sum(-1), (wts * q * x).sum(-1)
        sx = (wts * x).sum(-1)
        det = sw * sl2 - sl * sl
        ok = det > 0
        this_scale = torch.where(ok, (sw * sxl - sx * sl) / det.clamp_min(1e-30), scale)
        this_min = torch.where(ok, (sl2 * sx - sl * sxl) / det.clamp_min(1e-30), mn)
        pos = this_min > 0  # the min must be <= 0 (stored as -min >= 0)
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(pos & (sl2 > 0), sxl / sl2.clamp_min(1e-30), this_scale)
        e = err(q, this_scale, this_min)
        better = ok & (e < best)
        best = torch.where(better, e, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -mn


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    x = w.float().reshape(N * K // 32, 32)
    rms = (x * x).mean(-1, keepdim=True).sqrt()
    scale, mins = _qkx2(x, rms + x.abs())
    scale, mins = scale.reshape(-1, 8), mins.reshape(-1, 8)  # per super-block of 256
    d = _half(scale.amax(-1) / 63.0)
    dmin = _half(mins.amax(-1) / 63.0)
    sc = torch.where(d[:, None] > 0, torch.round(scale / d[:, None].clamp_min(1e-30)), torch.zeros_like(scale))
    mq = torch.where(dmin[:, None] > 0, torch.round(mins / dmin[:, None].clamp_min(1e-30)), torch.zeros_like(mins))
    sc, mq = sc.clamp_(0, 63).to(torch.uint8), mq.clamp_(0, 63).to(torch.uint8)
    # the codes again, for the scales as stored
    ds = (d[:, None] * sc.float()).repeat_interleave(32, 1)
    dm = (dmin[:, None] * mq.float()).repeat_interleave(32, 1)
    xb = x.reshape(-1, 256)
    q = torch.where(ds > 0, torch.round((xb + dm) / ds.clamp_min(1e-30)), torch.zeros_like(xb)).clamp_(0, 15)
    q = q.to(torch.uint8).reshape(-1, 4, 2, 32)  # 64-value chunks: first 32 low nibbles, next 32 high
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    # the 12 scale bytes (llama.cpp's get_scale_min_k4 read backwards)
    s = torch.zeros(sc.shape[0], 12, dtype=torch.uint8)
    s[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = mq[:, 0:4] | ((mq[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 15) | ((mq[:, 4:8] & 15) << 4)
    blocks = torch.cat([_half_bytes(d), _half_bytes(dmin), s, qs], -1)
    return blocks.reshape(N, -1)


QUANTIZERS = {Q8_0: quantize_q8_0, Q4_1: quantize_q4_1, Q4_K: quantize_q4_k}


def default_type(in_features: int, head: bool = False) -> Optional[int]:
    """The block type a full-precision matrix gets in the 4-bit engine: Q4_K where the
    input size is a multiple of 256, else Q4_1 (32), Q8_0 for the head and embeddings
    (llama.cpp keeps them at 6-8 bits); None where not even 32 divides it."""
    if in_features % 32:
        return None
    if head:
        return Q8_0
    return Q4_K if in_features % 256 == 0 else Q4_1


def quantize(w: torch.Tensor, qtype: int) -> torch.Tensor:
    """w [N, K] -> the raw GGUF blocks of type ``qtype`` (uint8 [N, K / QK * block bytes])."""
    if qtype not in QUANTIZERS:
        raise ValueError(f"no quantizer for GGML type {qtype}")
    if w.dim() != 2 or w.shape[1] % BLOCK[qtype]:
        raise ValueError(f"quantize: a [{', '.join(map(str, w.shape))}] weight is not rows of {BLOCK[qtype]}-blocks")
    return QUANTIZERS[qtype](w)


class PackedCache:
    """A model directory's quantized tensors, kept in ``<cache>/packed/<key>.safetensors``
    (key: the directory's safetensors files' names, sizes and mtimes, and the format)."""

    FORMAT = 1

    def __init__(self, model_dir: Path, root: Path):
        files = sorted(Path(model_dir).glob("*.safetensors"))
        ident = json.dumps([[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files] +
                           [str(Path(model_dir).resolve()), self.FORMAT])
        self.path = Path(root) / "packed" / (hashlib.sha256(ident.encode()).hexdigest()[:16] + ".safetensors")
        self._have: dict = {}
        if self.path.exists():
            from safetensors import safe_open

            with safe_open(str(self.path), framework="pt") as fh:
                meta = fh.metadata() or {}
                for k in fh.keys():
                    self._have[k] = (int(meta[k]), fh.get_tensor(k))
        self._new: dict = {}

    def get(self, name: str) -> Optional[tuple[int, torch.Tensor]]:
        return self._have.get(name)

    def put(self, name: str, qtype: int, raw: torch.Tensor) -> None:
        self._new[name] = (qtype, raw)

    def save(self) -> None:
        """Writes the tensors added since loading (with the ones read), through a temporary
        file renamed into place."""
        if not self._new:
            return
        from safetensors.torch import save_file

        allt = {**self._have, **self._new}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        save_file({k: v[1].contiguous() for k, v in allt.items()}, str(tmp),
                  metadata={k: str(v[0]) for k, v in allt.items()})
        tmp.replace(self.path)
        self._have, self._new = allt, {}
