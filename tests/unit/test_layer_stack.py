"""The int4 and bf16 engines' layers in one C call (``specmesh.engine.layer_stack``): the same
bits as the per-call path (``fused_stack`` off) for prompts, decode steps, trees,
several slots, kept hidden states, layer-skip exits and biased (Qwen2) projections;
the K/V cache written alike; it stands aside where it does not apply; bad input is
refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specmesh.engine import bf16_matmul, int4_matmul, layer_stack
from specmesh.engine import Linear
from tests.support import kernel_or_skip, tiny_engine

KERNELS = {"int4": (int4_matmul, "int4 kernel"), "bf16": (bf16_matmul, "bf16 kernel")}


def _engine(dtype: str, kind: str = "llama"):
    kernel_or_skip(*KERNELS[dtype])
    eng, _ = tiny_engine(dtype, kind=kind)
    if eng.attention != "keylist":
        pytest.skip("the key-list kernel does not run here")
    return eng


def _run(eng, fused: bool):
    eng.fused_stack = fused
    for s in range(eng.n_slots):
        eng.reset(s)
    outs = [eng.prefill(0, list(range(3, 40)))]
    for t in (5, 77, 11):
        outs.append(eng.prefill(0, [t]))
    tree = eng.score(0, [9, 10, 11, 12, 13, 14], [-1, 0, 0, 1, 3, 2], hidden_layers=(0, 1, 2))
    outs += [tree.logits, *(tree.hidden[k] for k in sorted(tree.hidden))]
    eng.commit(0, [0, 1, 3])
    skip = eng.score(0, [9, 10], [-1, 0], n_layers=2, hidden_layers=(0,))
    outs += [skip.logits, skip.hidden[0]]
    eng.prefill(1, [4, 8, 15, 16, 23, 42])
    both = eng.score_batch([(0, [1, 2, 3], [-1, 0, 0]), (1, [7], [-1])])
    outs += [o.logits for o in both]
    L = eng.lengths[0]
    return outs, eng.k_cache[:, 0, :, :L].clone(), eng.v_cache[:, 0, :, :L].clone()


@pytest.mark.parametrize("dtype", ["int4", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_one_call_gives_the_per_call_bits(dtype, kind):
    eng = _engine(dtype, kind)
    assert eng._layer_stack() is not None
    if kind == "qwen":
        assert eng.layers[0].qkv.b is not None  # the driver's bias path is exercised
    a, ka, va = _run(eng, True)
    b, kb, vb = _run(eng, False)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("dtype", ["int4", "bf16"])
def test_stands_aside_where_it_does_not_apply(dtype):
    eng = _engine(dtype)
    eng.fused_stack = False
    assert eng._layer_stack() is None
    eng.fused_stack = True
    kl = eng._keylist
    layers = list(eng.layers)
    w = torch.randn(eng.hidden, eng.n_heads * eng.head_dim)
    layers[1] = dataclasses.replace(layers[1], o=Linear(w, None, "int8"))  # one matrix on torch's kernel
    assert layer_stack.build(layers, kl, eng._k_buf, eng._v_buf, eng.n_heads, eng.head_dim, eng.eps) is None
    assert layer_stack.build(eng.layers, None, eng._k_buf, eng._v_buf, eng.n_heads, eng.head_dim, eng.eps) is None
    fp, _ = tiny_engine("fp32")
    assert fp._layer_stack() is None


def test_refuses_bad_input():
    eng = _engine("int4")
    stack = eng._layer_stack()
    posi = torch.tensor([0, 1])
    plan = eng._keylist_plan([(0, 0, 2, 0, [-1, 0])], 2, posi)
    x = torch.zeros(2, eng.hidden)
    with pytest.raises(ValueError, match="layer stack"):
        stack.run(plan, 0, 1, x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="layer stack"):
        stack.run(plan, 0, eng.n_layers + 1, x)
    with pytest.raises(ValueError, match="layer stack"):
        stack.run(plan, 0, 1, torch.zeros(3, eng.hidden))
    before = x.clone()
    stack.run(plan, 0, 0, x)  # an empty range changes nothing
    assert torch.equal(x, before)
