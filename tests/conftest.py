"""Shared fixtures: a tiny random Llama (and Qwen2-style) model for fast unit tests,
and one real SmolLM2 runtime per test session for the slow end-to-end tests."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specmesh/__init__.py

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
            tie_word_embeddings=True, rope_theta=10000.0)


def tiny_hf(kind: str = "llama", seed: int = 0):
    """A random-weight Hugging Face model (fp32, eval) and its config dict."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(**TINY, attention_bias=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**{k: v for k, v in TINY.items() if k != "head_dim"})
        model = Qwen2ForCausalLM(cfg)
    # random init is tiny-scaled; make logits non-degenerate
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif p.dim() == 1 and kind != "llama" and p.shape[0] != cfg.hidden_size:
                p.normal_(0, 0.2)  # qkv biases
    return model.eval(), cfg.to_dict()


def tiny_engine(dtype: str = "fp32", n_slots: int = 3, max_seq_len: int = 128, kind: str = "llama", seed: int = 0):
    from specmesh.engine import LlamaEngine

    model, cfg = tiny_hf(kind, seed)
    eng = LlamaEngine(cfg, model.state_dict(), dtype=dtype, n_slots=n_slots, max_seq_len=max_seq_len)
    return eng, model


@pytest.fixture(scope="session")
def runtime():
    """The real SmolLM2-135M-Instruct target in fp32 (converted once into the cache)."""
    from specmesh.runtime import Runtime

    return Runtime("smollm2-135m-instruct", dtype="fp32", n_slots=4, max_seq_len=1024, quiet=True)
