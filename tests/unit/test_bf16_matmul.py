"""The bf16 matmul kernel (``specmesh.engine.bf16_matmul``), its AVX-512 BF16, AMX and AVX2
paths (each where the CPU has it; AVX2 also bit for bit its documented order): close to
the exact product, a row's bits depend on that row alone (not on how
many rows share the call, where it sits, or the thread count), bad input refused, the
environment turns it off; the engine's bf16 ``Linear`` runs on it and keeps its rows
for the head's refinement."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import bf16_matmul as bm
from specmesh.engine import Linear
from specmesh.types import InvalidArgument
from tests.support import kernel_or_skip


def _path(k, isa):
    """That path of the loaded kernel's library, or a skip where the CPU lacks it."""
    try:
        return bm.variant(k.lib, k.path, isa)
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["avx512", "amx", "avx2"])
def kern(request):
    return _path(kernel_or_skip(bm, "bf16 kernel"), request.param)


def _w(N, K, seed=0):
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("K", [64, 96, 48])  # 48: not a multiple of 32, the AVX-512 path on AMX too
def test_matches_the_exact_product(kern, K):
    N = 80
    W = _w(N, K)
    for M in (11, 40):  # 40: passes of 16 rows over each block, the last one padded
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).bfloat16()
        y = kern.mm(x, kern.pack(W))
        ref = x.double() @ W.double().T
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2).all()


@pytest.mark.parametrize("N", [64, 80, 112])  # 4, 5, 7 blocks of 16: passes of 4 or 2 blocks, and tails
@pytest.mark.parametrize("K", [64, 48])
def test_a_rows_bits_depend_on_that_row_alone(kern, N, K):
    P = kern.pack(_w(N, K, seed=2))
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(3)).bfloat16()
    full = kern.mm(x, P)
    for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33):
        part = kern.mm(x[37 - m:].contiguous(), P)  # the last m rows, at other places
        assert torch.equal(part, full[37 - m:]), m
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kern.mm(x, P)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, full)


def test_the_avx2_path_computes_its_documented_order():
    """Bit for bit: per row and output one fp32 chain over the input pairs, the odd
    input's product added before the even one's, each step rounded once (float64 holds
    every bf16 product and fp32 sum of two exactly), then bf16. The odd inputs are
    +-2^20 with the sign flipping from pair to pair over equal weights, so their large
    products cancel exactly two pairs later and the result is the small even products
    summed at a large partial sum's rounding: each step's rounding shows in the output."""
    a = _path(kernel_or_skip(bm, "bf16 kernel"), "avx2")
    g = torch.Generator().manual_seed(4)
    N, K, M = 32, 96, 3
    W = _w(N, K, seed=5)
    W[:, 3::4] = W[:, 1::4]  # odd weights equal over each two pairs
    xo = torch.full((M, K // 2), 2.0 ** 20)
    xo[:, 1::2] = -(2.0 ** 20)
    x = torch.stack([torch.randn(M, K // 2, generator=g) * 0.125, xo], -1).reshape(M, K).bfloat16()
    y = a.mm(x, a.pack(W))
    xd, wd = x.double(), W.double()
    t = torch.zeros(M, N, dtype=torch.float64)
    for p in range(K // 2):
        for i in (2 * p + 1, 2 * p):
            t = (t + xd[:, i:i + 1] * wd[:, i][None]).float().double()
    assert torch.equal(y.view(torch.int16), t.float().bfloat16().view(torch.int16))
    assert y.float().abs().max() > 0
    t2 = torch.zeros(M, N, dtype=torch.float64)
    for i in range(K):  # the even product first: other bits
        t2 = (t2 + xd[:, i:i + 1] * wd[:, i][None]).float().double()
    assert not torch.equal(y, t2.float().bfloat16())


def test_bad_input_is_refused(kern):
    P = kern.pack(_w(32, 64))
    with pytest.raises(ValueError, match="unsupported"):
        kern.mm(torch.randn(2, 64), P)  # fp32 rows
    with pytest.raises(ValueError, match="unsupported"):
        kern.mm(torch.randn(2, 62).bfloat16(), P)  # the wrong inner size
    with pytest.raises(ValueError, match="unsupported"):
        bm.Bf16Matmul.pack(torch.randn(40, 64))  # outputs not a multiple of 16


def test_the_engine_linear_runs_on_it_and_keeps_rows_for_the_head():
    k = kernel_or_skip(bm, "bf16 kernel")
    w = torch.randn(48, 64)
    lin = Linear(w, None, "bf16", keep_rows=True)
    assert lin._kb is k and lin.w.shape == (3, 32, 16, 2)
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(lin(x), k.mm(x, lin.w))
    idx = torch.tensor([[0, 7], [47, 3]])
    assert torch.equal(lin.rows_fp32(idx), w.bfloat16().float()[idx])
    with pytest.raises(InvalidArgument, match="rows"):
        Linear(w, None, "bf16").rows_fp32(idx)
    odd = Linear(torch.randn(6, 64), None, "bf16")  # 6 outputs: torch's linear
    assert odd._kb is None and odd.w.shape == (6, 64)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(bm, "_state", {})
    monkeypatch.setenv("SPECMESH_BF16_KERNEL", "torch")
    assert bm.load() is None and "SPECMESH_BF16_KERNEL" in bm.load_error()
    monkeypatch.setattr(bm, "_state", {})
    monkeypatch.setenv("SPECMESH_BF16_KERNEL", "int2")
    assert bm.load() is None and "int2" in bm.load_error()
