"""A draft LM's head restricted to the token ids a draft step reads (issue 66): the
kept ids' logits are the full head's bits, the others -inf, and the rows a view reads are
the weight's own, also once moved to a buffer of their own or to the front of the one they
share (the other rows freed); the ranges a draft model keeps follow its vocabulary's size."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import qmatmul as qm
from specmesh.runtime import draft_head_ranges
from specmesh.types import InvalidArgument

from specmesh.engine import LlamaEngine

from tests.support import kernel_or_skip, random_blocks, random_llama, small_target_engine


def test_a_rows_view_gives_those_rows_of_the_product():
    k = kernel_or_skip(qm, "the q block kernels")
    parts = [qm.Part(qm.TYPE_IDS["Q4_K"], 48, 256, random_blocks("Q4_K", 48, 256, seed=1)),
             qm.Part(qm.TYPE_IDS["Q8_0"], 32, 256, random_blocks("Q8_0", 32, 256, seed=2))]
    W = qm.QMatrix(parts, k)
    x = torch.randn(5, 256)
    full = W.mm(x, torch.float32)
    view = W.rows_view([(8, 24), (40, 48), (56, 80)])
    assert view.out_features == 48
    rows = torch.cat([torch.arange(8, 24), torch.arange(40, 48), torch.arange(56, 80)])
    assert torch.equal(view.mm(x, torch.float32), full[:, rows])
    for bad in ([(4, 16)], [(40, 56)], [(16, 24), (8, 16)]):  # not a multiple of 8; across segments; descending
        with pytest.raises(ValueError):
            W.rows_view(bad)
    own = view.compact()  # a buffer of its own
    assert own.data.data_ptr() != W.data.data_ptr() and own.nbytes() < W.nbytes()
    assert torch.equal(own.mm(x, torch.float32), full[:, rows])
    moved = W.rows_view([(8, 24), (40, 48), (56, 80)]).compact(reuse=True)  # moved to the front of W's buffer
    assert moved.data.data_ptr() == W.data.data_ptr() and moved.nbytes() == own.nbytes()
    assert torch.equal(moved.mm(x, torch.float32), full[:, rows])


def test_a_restricted_head_keeps_its_ids_bits_and_masks_the_rest():
    kernel_or_skip(qm, "the q block kernels")
    eng = LlamaEngine(*random_llama(3, 0.4, 64, 2, 64, 4, 2, 64), dtype="int4", n_slots=1, max_seq_len=64)
    assert eng.head.mode == "q"  # a vocabulary of 64: the head on Q8_0 blocks
    V = eng.vocab_size
    eng.reset(0)
    full = eng.prefill(0, [1, 2, 3, 4]).clone()
    keep = [(0, 16), (V - 8, V)]
    eng.restrict_head(keep)
    eng.reset(0)
    sub = eng.prefill(0, [1, 2, 3, 4])
    kept = torch.cat([torch.arange(0, 16), torch.arange(V - 8, V)])
    assert torch.equal(sub[..., kept], full[..., kept])
    mask = torch.ones(V, dtype=torch.bool)
    mask[kept] = False
    assert torch.isneginf(sub[..., mask]).all()
    eng.restrict_head([])  # the whole head again
    eng.reset(0)
    assert torch.equal(eng.prefill(0, [1, 2, 3, 4]), full)


def test_a_released_head_keeps_the_kept_rows_bits_and_frees_the_others():
    kernel_or_skip(qm, "the q block kernels")
    cfg, sd = random_llama(3, 0.4, 64, 2, 64, 4, 2, 64)
    sd["lm_head.weight"] = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 0.4  # untied
    eng = LlamaEngine(cfg, sd, dtype="int4", n_slots=1, max_seq_len=64)
    V, full_bytes = eng.vocab_size, eng.head.nbytes()
    keep = [(0, 16), (V - 8, V)]
    eng.restrict_head(keep)
    eng.reset(0)
    viewed = eng.prefill(0, [1, 2, 3, 4]).clone()
    eng.restrict_head(keep, release=True)
    assert eng.head.nbytes() == full_bytes * 24 // V  # 24 of the 64 rows left
    eng.reset(0)
    assert torch.equal(eng.prefill(0, [1, 2, 3, 4]), viewed)
    with pytest.raises(InvalidArgument, match="released"):
        eng.restrict_head([])


def test_only_a_blocks_head_can_be_restricted():
    eng = small_target_engine(n_slots=1)  # fp32
    with pytest.raises(InvalidArgument, match="restrict_head"):
        eng.restrict_head([(0, 8)])


def test_draft_head_ranges_follow_the_vocabulary():
    from specmesh.models.loading import resolve_model

    d = resolve_model("smollm2-135m-instruct", quiet=True)  # 49,152 ids, its added tokens first
    assert draft_head_ranges(d, 49152) == []  # under twice the default 65,536 rows: the whole head
    assert draft_head_ranges(d, 49152, rows=1024) == [(0, 1024)]
    assert draft_head_ranges(d, 49152, rows=0) == []
