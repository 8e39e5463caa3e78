"""Shared fixtures: one real SmolLM2 runtime per test session for the slow end-to-end
tests. The helpers (tiny models, codecs, settings, stacks) live in ``tests/support.py``."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specmesh/__init__.py

import pytest  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def runtime():
    """The real SmolLM2-135M-Instruct target in fp32 (converted once into the cache)."""
    from specmesh.runtime import Runtime

    return Runtime("smollm2-135m-instruct", dtype="fp32", n_slots=4, max_seq_len=1024, quiet=True)
