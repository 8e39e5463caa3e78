"""Draft-ahead on the real SmolLM2-135M-Instruct (fp32): with overlap on, every
token-only drafter's greedy output equals plain decoding, in process (``AheadDrafter``
with the drafter on a thread of its own; whether a round hits depends on timing, so
only that rounds asked for one is checked)."""

from __future__ import annotations

import pytest

from specmesh.ahead import AheadDrafter, OverlapPolicy
from specmesh.loop import AdaptiveBudget, generate_tokens
from specmesh.threads import ModelThread

pytestmark = pytest.mark.slow

PROMPTS = [
    "Rename the function `mean` to `average` and return the full code:\n\ndef mean(xs):\n    total = 0\n"
    "    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "Write a haiku about the sea.",
]
N = 48


@pytest.mark.parametrize("name", ["prompt_lookup", "suffix", "adaptive_lookup", "draft_lm"])
def test_greedy_identity_with_draft_ahead(runtime, name):
    mt = ModelThread(f"test-ahead-{name}")
    drafter = AheadDrafter(mt.run(runtime.drafter, name), run=mt.run)
    try:
        for p in PROMPTS:
            ids = runtime.encode(p)
            ref, _ = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids)
            out, st = generate_tokens(drafter, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids,
                                      budget=AdaptiveBudget.for_drafter(name, 6), draft_ahead=OverlapPolicy("on"))
            assert out == ref, f"{name} with draft-ahead diverged from plain greedy"
            assert st.ahead_hits + st.ahead_misses > 0
    finally:
        mt.stop()
    assert drafter.held() == {"sessions": 0, "entries": 0}
