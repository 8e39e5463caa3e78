"""The real SmolLM2 through ``GraphedEngine``'s static-shape forward on the CPU (no
capture; slow): greedy speculation with every kind of drafter equals plain decoding.
``tests/deploy/test_device.py`` checks the same engine on tiny models."""

from __future__ import annotations

import pytest

from specmesh.engine.cudagraph import GraphedEngine


@pytest.mark.slow
def test_graphed_engine_real_model_greedy_identity():
    """The real model through GraphedEngine's static forward (CPU, no capture): greedy
    speculation with every kind of drafter equals plain decoding (fp32)."""
    from specmesh.cli.demo import PROMPTS
    from specmesh.loop import AdaptiveBudget, generate_tokens
    from specmesh.runtime import Runtime

    rt = Runtime("smollm2-135m-instruct", dtype="fp32", n_slots=2, max_seq_len=1024, quiet=True,
                 cuda_graphs="always")
    assert isinstance(rt.engine, GraphedEngine)
    for _, prompt in PROMPTS[:2]:
        ids = rt.encode(prompt)
        plain, _ = generate_tokens(None, rt.verifier, ids, max_new_tokens=32, stop_ids=rt.stop_ids)
        for name in ("prompt_lookup", "layerskip", "block_tree"):
            kw = {"budget": AdaptiveBudget(8)}
            if name in rt.verifier.self_drafters:
                d, kw["self_draft"] = None, name
            else:
                d = rt.drafter(name)
            out, _ = generate_tokens(d, rt.verifier, ids, max_new_tokens=32, stop_ids=rt.stop_ids, **kw)
            assert out == plain, name
    assert rt.engine.calls["graphed"] > rt.engine.calls["eager"]
