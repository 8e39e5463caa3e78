"""Exact GGUF -> Hugging Face Llama state dict, with the `gguf` package and numpy only.

Used where transformers' own GGUF loader is not at hand or differs by version (a
bare accelerator machine): every tensor is dequantised by ``gguf.quants`` and
renamed to the Hugging Face Llama names; q/k projections are un-permuted (llama.cpp
stores them interleaved for its rope). The result equals what
``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` builds, tensor for tensor
(tests/unit/test_blockdraft_accel.py checks this against the converted cache).

Knows Llama-architecture GGUF files only; no tokenizer, no config beyond the
shapes it needs.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's rope permutation of a q/k projection [out, in]."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_llama_state_dict(path: Path, n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """{hf_name: float32 tensor} for a Llama GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    sd: dict[str, torch.Tensor] = {}
    for t in GGUFReader(str(path)).tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        w = w.reshape(shape)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
            if m is None or m.group(2) not in _NAMES:
                continue  # e.g. rope frequency tables: recomputed from the config
            kind = m.group(2)
            if kind == "attn_q":
                w = _unpermute(w, n_heads)
            elif kind == "attn_k":
                w = _unpermute(w, n_kv_heads)
            name = f"model.layers.{m.group(1)}.{_NAMES[kind]}.weight"
        sd[name] = torch.from_numpy(np.ascontiguousarray(w))
    return sd
