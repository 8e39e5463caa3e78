"""The int4 engine's weights as GGUF blocks (``LlamaEngine(dtype="int4")``, the default
int4 format where the block kernels build): which block type each matrix gets and
where its bytes come from.

From a GGUF (``models.gguf.GGUFWeights``) every matrix is the file's own tensor as
shipped: Q4_K_M's Q4_K and Q6_K, a Q4_1 or Q5_0 file's blocks, its Q8_0 or Q6_K head
and embedding table, bit for bit (``qmatmul`` repacks them into its tiles; no value
changes). A tensor whose type the kernels lack (Q5_K, Q3_K, IQ types ...) is
dequantised and requantised to Q8_0, with a warning naming it. From safetensors (a
Hugging Face directory) a matrix is quantized at load into the blocks llama.cpp's
quantizer writes (``models.quantize``: Q4_K where the input size is a multiple of 256,
else Q4_1; Q8_0 for the head and embeddings), kept in a packed cache so that happens
once per directory.

``BlockEmbedding`` is the embedding table kept as blocks: ``emb[ids]`` gives the rows'
values in fp32 (a tied head reads the same bytes). Knows nothing about the forward,
sessions or serving.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import qmatmul


class BlockEmbedding:
    """An embedding table [V, H] of GGUF blocks: ``self[ids]`` -> fp32 rows; ``float()`` the
    whole table in fp32 (for the few users that want it dense)."""

    def __init__(self, qm: "qmatmul.QMatrix"):
        self.qm = qm
        self.shape = torch.Size((qm.out_features, qm.in_features))
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def __getitem__(self, idx) -> torch.Tensor:
        if isinstance(idx, slice):
            idx = torch.arange(self.shape[0])[idx]
        return self.qm.rows(torch.as_tensor(idx))

    def float(self) -> torch.Tensor:
        return self.qm.rows(torch.arange(self.shape[0]))

    def to(self, dtype) -> torch.Tensor:
        return self.float().to(dtype)

    def numel(self) -> int:
        return self.qm.nbytes()

    def element_size(self) -> int:  # numel() * element_size() = the bytes held
        return 1

    def __len__(self) -> int:
        return self.shape[0]


def _default_type(k: int, head: bool) -> Optional[int]:
    from ..models.quantize import default_type

    return default_type(k, head)


class BlockSource:
    """The blocks of each matrix from a state mapping (``GGUFWeights`` or safetensors),
    with a packed cache for quantized safetensors (``models.quantize.PackedCache``)."""

    def __init__(self, sd, model_dir: Optional[Path] = None):
        self.sd = sd
        self.names = {k.removeprefix("model."): k for k in sd}
        self.gguf = hasattr(sd, "part") and hasattr(sd, "qtype")
        self.cache = None
        if not self.gguf and model_dir is not None:
            from ..models.loading import cache_root
            from ..models.quantize import PackedCache

            self.cache = PackedCache(model_dir, cache_root())
        self.requantized: list[str] = []  # GGUF tensors of a type the kernels lack (now Q8_0)

    def has(self, key: str) -> bool:
        return key in self.names

    def part(self, key: str, head: bool = False) -> Optional[qmatmul.Part]:
        """The blocks of matrix ``key`` (short name, e.g. ``layers.0.self_attn.q_proj.weight``);
        None where no block type fits its shape (the caller keeps another path)."""
        from ..models.quantize import Q8_0, quantize

        full = self.names[key]
        if self.gguf:
            n, k = self.sd.shape(full)
            t = self.sd.qtype(full)
            if t in qmatmul.TYPES and qmatmul.supported(t, n, k):
                return self.sd.part(full)
            if not qmatmul.supported(Q8_0, n, k):
                return None
            self.requantized.append(f"{full} ({self.sd.type_name(full)})")
            return qmatmul.Part(Q8_0, n, k, quantize(self.sd[full], Q8_0).reshape(-1))
        if self.cache is not None and (hit := self.cache.get(full)) is not None:
            t, raw = hit
            w_shape = raw.shape
            return qmatmul.Part(t, w_shape[0], self._in_features(full, t, raw), raw.reshape(-1))
        w = self.sd[full]
        n, k = w.shape
        t = _default_type(k, head)
        if t is None or not qmatmul.supported(t, n, k):
            return None
        raw = quantize(w, t)
        if self.cache is not None:
            self.cache.put(full, t, raw)
        return qmatmul.Part(t, n, k, raw.reshape(-1))

    @staticmethod
    def _in_features(name: str, t: int, raw: torch.Tensor) -> int:
        _, qk, rb, _ = qmatmul.TYPES[t]
        return raw.shape[1] // rb * qk

    def parts(self, keys: Sequence[str], head: bool = False) -> Optional[list[qmatmul.Part]]:
        out = []
        for k in keys:
            p = self.part(k, head)
            if p is None:
                return None
            out.append(p)
        return out

    def finish(self) -> None:
        if self.cache is not None:
            self.cache.save()
        if self.requantized:
            warnings.warn("the block kernels take Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K; these tensors were "
                          "requantized to Q8_0 (a second rounding, at 8 bits): " + ", ".join(self.requantized),
                          stacklevel=3)


def available() -> bool:
    """Whether the block kernels run here (``qmatmul.load()``)."""
    return qmatmul.load() is not None
