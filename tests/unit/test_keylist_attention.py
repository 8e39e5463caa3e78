"""The key-list attention kernel (``specmesh.keylist_attention``): close to exact softmax
attention, and a row's bits depend only on its own query and key sequence — not on the
other rows of the call, on how its keys are named (a contiguous prefix or a list), on
the thread count, or on the slot its keys live in."""

from __future__ import annotations

import pytest
import torch

from specmesh import keylist_attention as ka

NQ, NK, HD, T, S = 9, 3, 64, 256, 3


@pytest.fixture(scope="module")
def kern():
    k = ka.load()
    if k is None:
        pytest.skip(f"the key-list kernel does not build here: {ka.load_error()}")
    return k


def _cache(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(S, NK, T, HD, generator=g).to(dtype), torch.randn(S, NK, T, HD, generator=g).to(dtype))


def _query(n, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, NQ + 2 * NK, HD, generator=g).to(dtype)[:, :NQ]  # strided rows, as the engine's


def _exact(q, kc, vc, slot, keys):
    ks, vs = kc[slot][:, keys].double(), vc[slot][:, keys].double()  # [nk, L, hd]
    qq = q.double().view(NK, NQ // NK, HD)
    w = (qq @ ks.transpose(1, 2) * HD ** -0.5).softmax(-1)
    return (w @ vs).reshape(NQ, HD)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_softmax_attention(kern, dtype):
    kc, vc = _cache(dtype)
    q = _query(6, dtype)
    rows = [(0, 1, ()), (1, 37, ()), (2, 200, ()), (1, 10, (50, 12, 99)), (0, 0, (5, 6)), (2, T, ())]
    out = kern(q, kc, vc, ka.RowKeys.build(rows), HD ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for i, (slot, c, extra) in enumerate(rows):
        ref = _exact(q[i], kc, vc, slot, list(range(c)) + list(extra))
        assert (out[i].double() - ref).abs().max().item() < tol, i


def test_a_rows_bits_depend_on_its_keys_alone(kern):
    kc, vc = _cache(torch.bfloat16)
    q = _query(9, torch.bfloat16)
    chain = ka.RowKeys.build([(1, 100 + i + 1, ()) for i in range(9)])
    full = kern(q, kc, vc, chain, HD ** -0.5)
    for i in range(9):
        alone = kern(q[i:i + 1], kc, vc, ka.RowKeys.build([(1, 100 + i + 1, ())]), HD ** -0.5)
        as_list = kern(q[i:i + 1], kc, vc, ka.RowKeys.build([(1, 100, [100 + j for j in range(i + 1)])]), HD ** -0.5)
        assert torch.equal(alone[0], full[i]) and torch.equal(as_list[0], full[i])
    # the same keys copied to another slot and named there: the same bits
    kc[2, :, :110], vc[2, :, :110] = kc[1, :, :110], vc[1, :, :110]
    other = kern(q[4:5], kc, vc, ka.RowKeys.build([(2, 105, ())]), HD ** -0.5)
    assert torch.equal(other[0], full[4])
    # beside rows of other slots, in any order, with rows that name no keys (zeros)
    mixed = ka.RowKeys.build([(0, 0, ()), (0, 50, (7,)), (1, 105, ()), (2, 3, ())])
    res = kern(q[[0, 1, 4, 2]], kc, vc, mixed, HD ** -0.5)
    assert torch.equal(res[2], full[4]) and not res[0].any()


def test_thread_count_does_not_change_bits(kern):
    kc, vc = _cache(torch.bfloat16)
    q = _query(9, torch.bfloat16)
    rows = ka.RowKeys.build([(i % S, 30 + 20 * i, ()) for i in range(9)])
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(kern(q, kc, vc, rows, HD ** -0.5))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_layouts_it_cannot_take_are_refused(kern):
    kc, vc = _cache(torch.bfloat16)
    q = _query(2, torch.bfloat16)
    rows = ka.RowKeys.build([(0, 4, ()), (0, 5, ())])
    with pytest.raises(ValueError, match="unsupported"):
        kern(q.float(), kc, vc, rows, 1.0)  # dtypes differ
    with pytest.raises(ValueError, match="unsupported"):
        kern(q, kc.transpose(2, 3), vc, rows, 1.0)  # not contiguous
    with pytest.raises(ValueError, match="unsupported"):
        kern(q[:1], kc, vc, rows, 1.0)  # rows describe another count


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(ka, "_state", {})
    monkeypatch.setenv("SPECMESH_CPU_ATTENTION", "sdpa")
    assert ka.load() is None and "SPECMESH_CPU_ATTENTION" in ka.load_error()
