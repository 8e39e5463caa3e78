"""The folded serving pass of the block drafter (``incremental.FoldedDrafter``) equals
the training forward on the same context, while its per-position cache grows, slides
with the context window, rolls back and is rebuilt when the past was rewritten."""

from __future__ import annotations

import pytest
import torch

from specmesh.blockdraft.incremental import FoldedDrafter
from specmesh.blockdraft.model import BlockDrafter, BlockDrafterConfig
from specmesh.blockdraft.train import new_model
from tests.support import tiny_engine


def _model(fuse_last: bool, fuse_norm: bool, window: int = 6, block: int = 4):
    _, target = tiny_engine()
    torch.manual_seed(1)
    cfg = BlockDrafterConfig(block=block, n_layers=2, hidden=64, n_heads=4, ffn=96, feature_layers=[0, 2],
                             context_window=window, vocab_size=96, n_keep=80, fuse_last=fuse_last,
                             fuse_norm=fuse_norm)
    m = new_model(cfg, target.state_dict(), torch.arange(3, 83)).eval()
    with torch.no_grad():  # trained-looking norms, so folding them is actually exercised
        for mod in m.modules():
            if isinstance(mod, torch.nn.RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
        m.final_norm.uniform_(0.5, 1.5)
    return m


def _reference(m: BlockDrafter, feats: torch.Tensor, anchor: int, length: int) -> torch.Tensor:
    cfg = m.cfg
    c0 = max(0, length - cfg.context_window)
    mask = BlockDrafter.block_mask([length], cfg.block, length - c0, ctx_start=c0, window=cfg.context_window)
    with torch.no_grad():
        return m(torch.tensor([anchor]), feats[c0:length], mask)[0]


def _folded(m: BlockDrafter, attention: str, **kw) -> FoldedDrafter:
    """The folded pass with its CPU attention: the key-list kernel (skipped where it does
    not build) or torch's SDPA."""
    fd = FoldedDrafter(m, **kw)
    if attention == "sdpa":
        fd._keylist = None
    elif fd._keylist is None:
        pytest.skip("no key-list kernel on this machine")
    return fd


@pytest.mark.parametrize("attention", ["keylist", "sdpa"])
@pytest.mark.parametrize("fuse_last,fuse_norm", [(False, False), (True, False), (True, True)])
def test_folded_pass_equals_the_training_forward_as_the_context_moves(fuse_last, fuse_norm, attention):
    m = _model(fuse_last, fuse_norm)
    fd = _folded(m, attention)
    cache = fd.new_cache()
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(40, 128, generator=g).to(torch.bfloat16).float()  # the verifier keeps bf16 features
    reads = []

    def read(a, b):
        reads.append((a, b))
        return feats[a:b].clone()

    def check(length, anchor=17):
        reads.clear()
        got = fd.draft(cache, anchor, length, read)
        torch.testing.assert_close(got, _reference(m, feats, anchor, length), rtol=1e-4, atol=1e-4)
        assert got.shape == (m.cfg.block - 1, 80)

    check(0)  # no context yet: the block sees only itself
    check(1)
    check(3)
    assert (1, 3) in reads and all(b - a <= 2 for a, b in reads)  # only the new positions were read whole
    check(3, anchor=40)  # nothing new: the cached keys/values alone
    check(5)
    check(12)  # the window (6) slides past the old rows
    for length in range(13, 40, 3):
        check(length)
    check(30)  # rollback: rows past the new length are dropped
    feats[27] += 1.0  # the past was rewritten (another continuation after the rollback) ...
    feats[28:] = torch.randn(12, 128, generator=g).to(torch.bfloat16).float()
    check(31)  # ... so the cache is rebuilt, not reused
    assert reads[-1] == (25, 31)


@pytest.mark.parametrize("attention", ["keylist", "sdpa"])
def test_cache_survives_many_rounds_in_a_small_buffer(attention):
    m = _model(True, False, window=5, block=3)
    fd = _folded(m, attention)
    cache = fd.new_cache()
    feats = torch.randn(400, 128).to(torch.bfloat16).float()
    for length in range(1, 400, 2):  # the buffer (2 x window + block rows) compacts many times
        got = fd.draft(cache, 5, length, lambda a, b: feats[a:b].clone())
        torch.testing.assert_close(got, _reference(m, feats, 5, length), rtol=1e-4, atol=1e-4)
    assert cache.n == 5 and cache.end == 399


@pytest.mark.parametrize("weights,least", [("int4", 0.95), ("bf16", 0.99)])
def test_engine_weights_draft_close_to_the_float_pass(weights, least):
    """``weights="int4"`` (an int4 target's drafter: group-wise int4 matrices, int8 where
    a shape does not take int4) and ``weights="bf16"`` (a CPU bf16 target's: the
    engine's bf16 ``Linear``, its kernel where it builds): the same pass on the engine's
    ``Linear`` matrices is close to the float one."""
    m = _model(True, False).to(torch.bfloat16)
    ref, lin = FoldedDrafter(m), FoldedDrafter(m, weights=weights)
    assert {type(lin.head).__name__, type(lin.layers[0]["qkv"]).__name__} == {"Linear"}
    feats = torch.randn(20, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    a = ref.draft(ref.new_cache(), 17, 12, lambda x, y: feats[x:y])
    b = lin.draft(lin.new_cache(), 17, 12, lambda x, y: feats[x:y])
    assert a.shape == b.shape and torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > least
    with pytest.raises(ValueError, match="weights"):
        FoldedDrafter(m, weights="int2")


def test_a_bf16_engine_gets_the_bf16_kernel_drafter():
    """``BlockSelfDrafter`` on a CPU bf16 engine folds the drafter onto the bf16 kernel
    where it runs."""
    from specmesh.engine import bf16_matmul
    from specmesh.blockdraft.serve import BlockSelfDrafter
    from specmesh.verifier import EngineVerifier
    from tests.support import tiny_engine

    eng, _ = tiny_engine("bf16")
    d = BlockSelfDrafter(EngineVerifier(eng), _model(True, False))
    assert d.folded.weights == ("bf16" if bf16_matmul.load() is not None else "float")
