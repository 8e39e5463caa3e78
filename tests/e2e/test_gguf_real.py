"""The real SmolLM2 GGUF as a user names it: a path to the ``.gguf`` file (as llama.cpp
takes it) gives the same model as the alias, and its cache holds no weights."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_a_gguf_path_is_the_same_model_as_its_alias(tmp_path, monkeypatch):
    from specmesh.engine import LlamaEngine
    from specmesh.models.loading import ALIASES, _package_dir, resolve_model, source_gguf

    gguf = _package_dir(ALIASES["smollm2-135m-instruct"])
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path))
    d = resolve_model(str(gguf), quiet=True)
    assert source_gguf(d) == gguf.resolve()
    assert sum(f.stat().st_size for f in d.iterdir()) < 20e6  # config and tokenizer only: the weights stay in the GGUF
    assert resolve_model(str(gguf), quiet=True) == d  # prepared once
    ids = list(range(200, 230))
    a = LlamaEngine.from_pretrained(str(gguf), dtype="int4", n_slots=1, max_seq_len=64, quiet=True)
    monkeypatch.delenv("SPECMESH_CACHE")
    b = LlamaEngine.from_pretrained("smollm2-135m-instruct", dtype="int4", n_slots=1, max_seq_len=64, quiet=True)
    assert torch.equal(a.prefill(0, ids), b.prefill(0, ids))
