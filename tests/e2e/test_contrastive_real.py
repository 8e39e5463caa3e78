"""Speculative contrastive decoding on the real SmolLM2-135M-Instruct (fp32): greedy
output equals vanilla greedy contrastive decoding (``specmesh.contrastive``, amateur =
the runtime's layer-skip exit) for lookup, layer-skip and block drafters, 3 prompts x
48 new tokens; and it is not the model's plain greedy output on every prompt (CD is
another target)."""

from __future__ import annotations

import pytest

from specmesh.contrastive import contrastive_generate
from specmesh.loop import generate_tokens
from specmesh.types import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["Rename the function `mean` to `average`:\n\ndef mean(xs):\n    return sum(xs) / len(xs)\n",
           "Write a haiku about the sea.", "List three uses of a paper clip."]
N = 32
SP = SamplingParams(acceptance="contrastive", cd_alpha=0.1, cd_beta=0.5)


@pytest.fixture(scope="module")
def cd_refs(runtime):
    refs = []
    for p in PROMPTS:
        ids = runtime.encode(p)
        ref = contrastive_generate(runtime.engine, runtime.layerskip_exit, ids, N, SP, stop_ids=runtime.stop_ids,
                                   slot=runtime.engine.n_slots - 1)
        plain, _ = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids)
        refs.append((ids, ref, plain))
    return refs


@pytest.mark.parametrize("drafter,self_draft", [("prompt_lookup", None), (None, "layerskip"), (None, "block")])
def test_speculative_cd_equals_vanilla_cd_on_smollm2(runtime, cd_refs, drafter, self_draft):
    if self_draft == "block" and "block" not in runtime.verifier.self_drafters:
        pytest.skip("no block drafter checkpoint")
    d = runtime.drafter(drafter) if drafter else None
    accepted = 0
    for ids, ref, _ in cd_refs:
        out, st = generate_tokens(d, runtime.verifier, ids, sampling=SP, max_new_tokens=N, stop_ids=runtime.stop_ids,
                                  budget=6, self_draft=self_draft)
        assert out == ref, f"{drafter or self_draft}: speculative CD diverged from vanilla CD"
        assert st.lossy and st.acceptance == "contrastive"
        accepted += st.accepted_tokens
    assert accepted > 0
    assert any(ref != plain for _, ref, plain in cd_refs)
