"""rowops: exact argmax / top-k values against torch, incl. ties and -inf rows."""

import pytest
import torch

from specmesh.engine.rowops import argmax_rows, topk_rows


@pytest.mark.parametrize("V", [49152, 8192, 5000, 4096])
def test_argmax_and_topk_match_torch(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g)
    ties = x.to(torch.bfloat16).float()  # bf16-rounded logits: many exact ties
    ties[1, 17] = ties[1, V - 3] = ties[1].max() + 1  # a tied maximum in two chunks: the first wins
    flat = torch.zeros(2, V)
    neg = torch.full((2, V), -float("inf"))
    neg[1, V // 2] = 0.0
    for t in (x, ties, flat, neg, x[:1]):
        assert torch.equal(argmax_rows(t), t.argmax(-1))
        for k in (1, 4, 6):
            v, i = topk_rows(t, k)
            ref = t.topk(k, -1)
            assert torch.equal(v, ref.values)
            assert torch.equal(t.gather(1, i), v)  # the indices name entries of those values
            assert all(len(set(row)) == k for row in i.tolist())  # distinct entries


def test_other_shapes_go_to_torch():
    x = torch.randn(3, 100)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert torch.equal(topk_rows(x, 5)[1], x.topk(5, -1).indices)
