"""The header of a GGUF file, read fast: its scalar metadata and its tensor table, and
each tensor's bytes as a view of the memory-mapped file.

Why not the ``gguf`` package's reader: it builds a numpy view for every field of the
metadata, 147,000 of them for SmolLM2's tokenizer alone (11 s on 2 cores; Qwen's
151,936-token vocabulary and merges are three times that), although loading weights
needs none of them. Here the header is parsed with ``struct`` from one read of its
bytes; array values (the tokenizer's) are skipped, their length kept. The format: magic
``GGUF``, version (2 or 3), tensor and field counts, the fields (key, type, value), the
tensor infos (name, dims innermost first, GGML type, offset), then the data from the
next multiple of ``general.alignment`` (default 32).

Knows the file format only; nothing about models, names or quantization.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as the file lists them: innermost first
    type: int  # GGML type id
    offset: int  # from the file's start
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major shape (outermost first): [out, in] for a matrix."""
        return tuple(reversed(self.dims))


class _Cursor:
    def __init__(self, f, size: int):
        self.f, self.size = f, size
        self.buf, self.base, self.pos = b"", 0, 0

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            if self.base + self.pos + n > self.size:
                raise GGUFFormatError("the header runs past the end of the file (truncated)")
            self.f.seek(self.base + self.pos)
            self.base += self.pos
            self.buf = self.f.read(max(n, 1 << 22))
            self.pos = 0

    def take(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if n > 1 << 30:
            raise GGUFFormatError(f"a string of {n} bytes in the header (corrupt)")
        self._need(n)
        s = self.buf[self.pos: self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_string(self) -> None:
        n = self.take("<Q")
        if n > 1 << 30:
            raise GGUFFormatError(f"a string of {n} bytes in the header (corrupt)")
        self._need(n)
        self.pos += n

    def tell(self) -> int:
        return self.base + self.pos


def _value(c: _Cursor, t: int, keep_arrays: bool) -> Any:
    if t in _SCALARS:
        return c.take(_SCALARS[t])
    if t == 8:
        return c.string()
    if t == 9:
        et, n = c.take("<I"), c.take("<Q")
        if et == 8:
            if not keep_arrays:
                for _ in range(n):
                    c.skip_string()
                return ("array", n)
            return [c.string() for _ in range(n)]
        if et not in _SCALARS:
            raise GGUFFormatError(f"an array of value type {et} (corrupt)")
        size = struct.calcsize(_SCALARS[et]) * n
        c._need(size)
        raw = c.buf[c.pos: c.pos + size]
        c.pos += size
        return np.frombuffer(raw, dtype=np.dtype(_SCALARS[et])).tolist() if keep_arrays else ("array", n)
    raise GGUFFormatError(f"a field of value type {t} (corrupt)")


def read_header(path: Path, keep_arrays: bool = False) -> tuple[dict, list[TensorInfo]]:
    """(metadata, tensors) of a GGUF file; arrays in the metadata as ("array", length)
    unless ``keep_arrays``. GGUFFormatError where it is not a GGUF or is truncated."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        c = _Cursor(f, size)
        if c.take("<4s") != b"GGUF":
            raise GGUFFormatError(f"{path}: not a GGUF file (no GGUF magic)")
        version = c.take("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version}; version 2 and 3 are read")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        meta: dict = {"GGUF.version": version}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = _value(c, c.take("<I"), keep_arrays)
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            nd = c.take("<I")
            dims = tuple(c.take("<Q") for _ in range(nd))
            infos.append((name, dims, c.take("<I"), c.take("<Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-c.tell() // align) * align
    tensors = []
    for name, dims, t, off in infos:
        try:
            block, bsize = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
        except (ValueError, KeyError) as e:
            raise GGUFFormatError(f"{path}: tensor {name} has GGML type {t}, which this gguf package does not know") \
                from e
        n = int(np.prod(dims)) if dims else 1
        nbytes = n // block * bsize
        if start + off + nbytes > size:
            raise GGUFFormatError(f"{path}: tensor {name} runs past the end of the file (truncated)")
        tensors.append(TensorInfo(name, dims, t, start + off, nbytes))
    return meta, tensors


def tensor_bytes(path: Path, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes (uint8 [nbytes]) as a read-only view of the mapped file."""
    return np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
