"""A GGUF file as a model: its Hugging Face config and tokenizer written once, its
tensors read from the file when asked, by Hugging Face name.

``prepare(gguf, out_dir)`` writes ``config.json`` (recording the GGUF's path) and the
tokenizer files into ``out_dir`` (transformers reads both from the GGUF's metadata; no
weight is dequantised, so this takes seconds and a few MB, where the fp32 safetensors
cache it replaces took 7.1 GB for Qwen2.5-Coder-1.5B). ``GGUFWeights(path, config)``
maps Hugging Face names (``model.layers.0.self_attn.q_proj.weight`` ...) to the file's
tensors: ``part(name)`` gives a quantized tensor's raw rows for the engine's block
kernels (``specmesh.engine.qmatmul``) — the user's weights bit for bit —, ``w[name]``
its values in fp32 (dequantised by the block kernels where they take the type, else by
the ``gguf`` package). llama.cpp stores a Llama model's q and k projections with their
rows interleaved for its RoPE; both paths give them back in Hugging Face order (a
permutation of whole rows, so quantized blocks move unchanged).

The file is memory-mapped (numpy, by the ``gguf`` package's reader): a tensor's pages
are read when it is converted and dropped with the mapping, so loading never holds
the file and its repacked copy at once beyond one tensor.

Knows GGUF files of the Llama and Qwen2 architectures; nothing about engines,
sessions or serving.
"""

from __future__ import annotations

import json
import os
import struct
import re
import shutil
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import numpy as np
import torch

ARCHS = ("llama", "qwen2")
CACHE_FORMAT = 2  # config.json "_specmesh_cache": a GGUF's config and tokenizer, no weights
_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


class GGUFError(ValueError):
    """A GGUF file that cannot be used: truncated, corrupt, another architecture, a tensor
    missing (the message names the file and what is wrong)."""


def _header(path: Path):
    from .gguf_file import GGUFFormatError, read_header

    try:
        return read_header(path)
    except GGUFFormatError as e:
        raise GGUFError(str(e)) from e
    except (OSError, struct.error, UnicodeError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def hf_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face name of a GGUF tensor, or None for one the engine does not read
    (rope frequency tables and the like)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None or m.group(2) not in _NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's RoPE interleave of a q/k projection with
    ``n_head`` heads: HF row i is GGUF row ``perm[i]``."""
    idx = np.arange(n_rows)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


class GGUFWeights(Mapping):
    """Hugging Face name -> fp32 tensor of a GGUF file (read when asked); ``part(name)``
    and ``qtype(name)`` for the quantized form. Iterate once; each lookup reads again."""

    def __init__(self, path: Path, config: Optional[dict] = None):
        self.path = Path(path)
        meta, tensors = _header(self.path)
        arch = meta.get("general.architecture")
        if arch not in ARCHS:
            raise GGUFError(f"{self.path}: architecture {arch!r}; the engine runs {', '.join(ARCHS)}")
        self.arch = arch
        cfg = config or {}
        # a draft made of some of the file's layers (``runtime.make_draft_model``): its layer i is layers[i]
        layers = cfg.get("_gguf_layers")
        where = {int(src): i for i, src in enumerate(layers)} if layers else None
        self._t = {}
        for t in tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
            if where is not None and m is not None:
                if int(m.group(1)) not in where:
                    continue
                name = f"model.layers.{where[int(m.group(1))]}.{m.group(2)}"
            self._t[name] = t
        if "model.embed_tokens.weight" not in self._t:
            raise GGUFError(f"{self.path}: no token_embd.weight tensor")
        self.n_head = int(cfg.get("num_attention_heads") or meta.get(f"{arch}.attention.head_count"))
        self.n_kv = int(cfg.get("num_key_value_heads") or meta.get(f"{arch}.attention.head_count_kv") or self.n_head)

    def __getitem__(self, key: str) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from .gguf_file import tensor_bytes

        t = self._t[key]
        gt = GGMLQuantizationType(t.type)
        if gt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            w = np.array(dequantize(np.asarray(tensor_bytes(self.path, t)), gt), dtype=np.float32)
            return self._unpermute(key, torch.from_numpy(w).reshape(self.shape(key)))
        part = self.part(key)
        from ..engine import qmatmul

        k = qmatmul.load()
        if k is not None and qmatmul.supported(part.type, part.n, part.k):
            return qmatmul.QMatrix([part], k).rows(torch.arange(part.n))
        w = dequantize(np.asarray(part.raw).reshape(part.n, -1), gt)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(part.n, part.k)

    def __iter__(self):
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def qtype(self, key: str) -> int:
        """The GGML type id of tensor ``key`` (0 F32, 1 F16, 2 Q4_0, 12 Q4_K ...)."""
        return int(self._t[key].type)

    def type_name(self, key: str) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self._t[key].type).name

    def shape(self, key: str) -> tuple[int, ...]:
        return self._t[key].shape

    def _perm(self, key: str) -> Optional[np.ndarray]:
        if self.arch != "llama":
            return None
        n = self.shape(key)[0]
        if key.endswith("self_attn.q_proj.weight"):
            return unpermute_rows(n, self.n_head)
        if key.endswith("self_attn.k_proj.weight"):
            return unpermute_rows(n, self.n_kv)
        return None

    def _unpermute(self, key: str, w: torch.Tensor) -> torch.Tensor:
        perm = self._perm(key)
        return w if perm is None else w[torch.from_numpy(perm)].contiguous()

    def part(self, key: str):
        """Tensor ``key`` as ``qmatmul.Part``: its GGML type, [n, k] and raw bytes (rows in
        Hugging Face order: a read-only view of the mapped file, a copy where llama.cpp's
        q/k interleave is undone)."""
        from ..engine.qmatmul import Part

        from .gguf_file import tensor_bytes

        t = self._t[key]
        shape = self.shape(key)
        n, k = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        rows = tensor_bytes(self.path, t).reshape(n, -1)
        perm = self._perm(key)
        # the mapped file's bytes themselves (read by the repack), or rows in Hugging Face order (a copy)
        return Part(int(t.type), n, k, rows if perm is None else np.ascontiguousarray(rows[perm]))


def read_config(path: Path) -> dict:
    """The Hugging Face config of a GGUF (transformers reads it from the metadata)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    cfg.pop("quantization_config", None)
    return cfg


def check_file(path: Path) -> None:
    """GGUFError where the file is not a complete GGUF of a known architecture (every
    tensor's bytes inside the file: ``gguf_file.read_header`` checks)."""
    meta, _ = _header(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r}; the engine runs {', '.join(ARCHS)}")


def prepare(gguf: Path, out_dir: Path, quiet: bool = False) -> Path:
    """Write ``out_dir`` for a GGUF: config.json (with ``_source_gguf``) and the tokenizer.
    Through a temporary directory renamed at the end: a crash or a bad file leaves nothing."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    gguf = Path(gguf).resolve()
    check_file(gguf)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        steps = tqdm(total=2, desc=f"reading {gguf.name}'s config and tokenizer (one time)", disable=quiet,
                     file=sys.stderr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(tmp)
        steps.update(1)
        cfg = read_config(gguf)
        cfg["dtype"] = "float32"
        cfg["_source_gguf"] = str(gguf)
        cfg["_gguf_size"] = gguf.stat().st_size
        cfg["_specmesh_cache"] = CACHE_FORMAT
        w = GGUFWeights(gguf, cfg)
        cfg["tie_word_embeddings"] = "lm_head.weight" not in w
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        steps.update(1)
        steps.close()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
