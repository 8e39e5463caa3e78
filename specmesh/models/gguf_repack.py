"""A GGUF file rewritten with some of its block types re-packed as another: every
tensor of a type in ``REPACK`` is dequantised (``gguf.quants.dequantize``) and quantised
again (``gguf.quants.quantize``) in the new type; every other tensor's bytes and every
metadata field (the tokenizer's arrays, the chat template, the architecture's numbers)
are copied as they are.

Why: a reader that lacks a block type can then load the file. OpenVINO GenAI 2026.4's
GGUF reader has no Q5_0 (``gguf_tensor_to_f16 failed``), which Qwen2.5-Coder-0.5B's
Q4_K_M GGUF uses for most of its matrices; re-packed as Q8_0 (32 weights, one f16
scale: 8 bits where Q5_0 had 5) the values move by at most half a Q8_0 step (1/254 of
the block's largest magnitude) plus the f16 rounding of the scale.

Knows the file format and the ``gguf`` package only; nothing about models or readers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np

# source type name -> target type name (GGML names, as gguf.GGMLQuantizationType spells them)
REPACK = {"Q5_0": "Q8_0", "Q5_1": "Q8_0"}


def repack_blocks(raw: np.ndarray, src: str, dst: str) -> np.ndarray:
    """The blocks of ``raw`` (uint8 rows of ``src`` blocks) as uint8 rows of ``dst`` blocks."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    return quantize(dequantize(np.asarray(raw, dtype=np.uint8), Q[src]), Q[dst])


def repacked_types(path: Path, repack: Mapping[str, str] = REPACK) -> dict[str, int]:
    """{type name: tensor count} of the types in ``path`` that ``repack`` would change."""
    from gguf import GGMLQuantizationType as Q

    from .gguf_file import read_header

    out: dict[str, int] = {}
    for t in read_header(path)[1]:
        name = Q(t.type).name
        if name in repack:
            out[name] = out.get(name, 0) + 1
    return out


def repack_gguf(src: Path, dst: Path, repack: Mapping[str, str] = REPACK) -> dict[str, int]:
    """Write ``src`` as ``dst`` with the tensors of each type in ``repack`` re-packed as its
    value (the file written whole under a temporary name, then renamed). Returns {type
    name: tensors re-packed}."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch, endianess=reader.endianess)
    for field in reader.fields.values():  # the writer writes the architecture and the GGUF.* header itself
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    done: dict[str, int] = {}
    for t in reader.tensors:
        to = repack.get(t.tensor_type.name)
        if to is None:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
            continue
        block, size = GGML_QUANT_SIZES[Q[to]]
        n = int(np.prod([int(d) for d in t.shape]))
        writer.add_tensor_info(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), np.float32,
                               n // block * size, Q[to])
        done[t.tensor_type.name] = done.get(t.tensor_type.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        to = repack.get(t.tensor_type.name)
        data = t.data if to is None else repack_blocks(t.data, t.tensor_type.name, to)
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(tmp, dst)
    return done
