"""Default drafters through real gRPC servers on loopback with a tiny random model and
a tiny (untrained) block drafter (seconds): ListStrategies names every strategy's
default drafter, ``self`` without a drafter gets the block drafter's tree when the
verifier has it (layer-skip otherwise) and ``auto`` picks it on fresh text.
``tests/router/test_defaults.py`` tests the router's resolution against fake replicas."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.support import TRACED_SETTINGS, LocalStack, TokenizerCodec, settings, tiny_engine


def block_stack(block: bool = True) -> LocalStack:
    """Verifier (tiny random model + layer-skip + a tiny block drafter as block / block_tree),
    drafter service and router on loopback; ``block=False`` leaves the block drafter out."""
    from specmesh.blockdraft.model import BlockDrafterConfig
    from specmesh.blockdraft.serve import BlockSelfDrafter
    from specmesh.blockdraft.train import new_model
    from specmesh.drafters.model_drafters import LayerSkipDrafter
    from specmesh.verifier import EngineVerifier

    eng, model = tiny_engine(n_slots=8, max_seq_len=256)
    v = EngineVerifier(eng)
    v.self_drafters["layerskip"] = LayerSkipDrafter(v, exit_layer=1)
    if block:
        torch.manual_seed(0)
        cfg = BlockDrafterConfig(block=4, n_layers=1, hidden=64, n_heads=4, ffn=96, feature_layers=[0, 2],
                                 context_window=32, vocab_size=96, n_keep=96)
        d = BlockSelfDrafter(v, new_model(cfg, model.state_dict(), torch.arange(96)))
        v.self_drafters["block"] = d
        v.self_drafters["block_tree"] = BlockSelfDrafter(v, d.model, tree=True, folded=d.folded)
    return LocalStack([v], TokenizerCodec(), 96, settings=partial(settings, TRACED_SETTINGS))


@pytest.fixture(scope="module")
def stacks():
    with_block, without = block_stack(True), block_stack(False)
    yield with_block, without
    with_block.close()
    without.close()


PROMPT = "abcabcabcabc hello hello hello abcabc"
FRESH = "Write a poem about autumn."


def test_list_strategies_names_each_default_drafter(stacks):
    from specmesh import Client

    with_block, without = stacks
    for stack, self_default in ((with_block, "block_tree"), (without, "layerskip")):
        with Client(stack.address, timeout=30) as c:
            info = {s.name: s for s in c.list_strategies().strategies}
        assert info["self"].default_drafter == self_default
        assert info["external"].default_drafter == stack.router.s.default_drafter
        assert info["proactive"].default_drafter == info["ssr"].default_drafter == "cache"
        assert info["autoregressive"].default_drafter == info["auto"].default_drafter == ""
        assert self_default in info["self"].drafters
        assert ("block_tree" in info["self"].drafters) == (self_default == "block_tree")


def test_self_and_auto_default_to_the_block_tree_through_grpc(stacks):
    from specmesh import Client

    with_block, without = stacks
    with Client(with_block.address, timeout=60) as c:
        plain = c.generate(PROMPT, strategy="autoregressive", max_new_tokens=16, raw_prompt=True)
        r = c.generate(PROMPT, strategy="self", max_new_tokens=16, raw_prompt=True, draft_budget=4)
        assert r.stats.drafter == "block_tree" and r.token_ids == plain.token_ids
        assert "default self drafter block_tree" in r.stats.strategy_reason
        a = c.generate(FRESH, strategy="auto", max_new_tokens=8, raw_prompt=True)
        assert (a.stats.strategy, a.stats.drafter) == ("self", "block_tree"), a.stats.strategy_reason
    with Client(without.address, timeout=60) as c:
        r = c.generate(PROMPT, strategy="self", max_new_tokens=16, raw_prompt=True)
        assert r.stats.drafter == "layerskip" and r.token_ids == plain.token_ids
        a = c.generate(FRESH, strategy="auto", max_new_tokens=8, raw_prompt=True)
        assert (a.stats.strategy, a.stats.drafter) == ("external", "suffix"), a.stats.strategy_reason
        from specmesh.errors import InvalidArgumentError

        with pytest.raises(InvalidArgumentError, match="block"):
            c.generate(PROMPT, strategy="self", drafter="block_tree", max_new_tokens=4, raw_prompt=True)
