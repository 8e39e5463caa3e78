"""The trained block drafter on the drafter service, through real gRPC services on
loopback, on the real SmolLM2-135M-Instruct in fp32: greedy ``external:block_tree``
(and ``external:block``) equals ``self:block_tree`` (``self:block``) and plain greedy
decoding, with the same drafts — the drafter service read, over the wire, the
hidden features the verifier keeps for itself. One ``RuntimeStack`` (the drafter
service loads the bundled checkpoint with the target's embeddings and head from
the same model alias)."""

from __future__ import annotations

import pytest

from tests.support import RuntimeStack

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning to cook.",
]
N = 40


@pytest.fixture(scope="module")
def stack(runtime):
    if runtime.block_drafter is None:
        pytest.skip("no trained block drafter checkpoint for the target")
    st = RuntimeStack(runtime=runtime)
    yield st
    st.close()


def test_external_block_drafters_equal_self_and_plain_greedy(stack):
    from specmesh import Client

    info = stack.drafter_info()
    assert {f.drafter for f in info.feature_drafters} == {"block", "block_tree"}
    assert list(info.feature_drafters[0].layers) == list(stack.rt.block_drafter.model.cfg.feature_layers)
    with Client(stack.address, timeout=300) as c:
        for prompt in PROMPTS[:2]:  # two prompts keep CI short; tests/services/test_block_features_grpc.py has more
            ref = stack.ref(prompt, N)
            for name, budget in (("block_tree", 8), ("block", 6)):
                own = c.generate(prompt, strategy="self", drafter=name, max_new_tokens=N, draft_budget=budget)
                ext = c.generate(prompt, strategy="external", drafter=name, max_new_tokens=N, draft_budget=budget)
                assert own.token_ids == ref, (prompt, name, "self")
                assert ext.token_ids == ref, (prompt, name, "external")
                assert ext.stats.fallbacks == 0 and ext.stats.accepted_tokens > 0
                assert (ext.stats.drafted_tokens, ext.stats.accepted_tokens) == \
                    (own.stats.drafted_tokens, own.stats.accepted_tokens), (prompt, name)
