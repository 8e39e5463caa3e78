"""The key-list attention kernel (``specmesh.engine.keylist_attention``): close to exact softmax
attention, and a row's bits depend only on its own query and key sequence — not on the
other rows of the call, on how its keys are named (a contiguous prefix or a list), on
the thread count, or on the slot its keys live in."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import keylist_attention as ka
from tests.support import kernel_or_skip

NQ, NK, HD, T, S = 9, 3, 64, 256, 3


@pytest.fixture(scope="module")
def kern():
    return kernel_or_skip(ka, "key-list kernel")


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


def _rope_tables(n_pos, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
    emb = torch.cat([torch.outer(torch.arange(n_pos).float(), inv)] * 2, -1)
    half = HD // 2
    return emb.cos().to(dtype), torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_is_rope_cache_writes_and_attention(kern, dtype):
    """``layer``: RoPE on q and k, k and v written where the plan says, then attention —
    against the same steps in torch (engine.rope, slice writes, exact softmax)."""
    from specmesh.engine import rope

    n_layers, N = 2, 4
    g = torch.Generator().manual_seed(3)
    kb = torch.randn(n_layers, S, NK, T, HD, generator=g).to(dtype)
    vb = torch.randn(n_layers, S, NK, T, HD, generator=g).to(dtype)
    k0, v0 = kb.clone(), vb.clone()
    cos, sin = _rope_tables(T, dtype)
    qkv = torch.randn(N, (NQ + 2 * NK) * HD, generator=g).to(dtype)
    # a chain of 2 after 40 committed keys in slot 1, a 1-row tree node in slot 2, a padding row
    pos = torch.tensor([40, 41, 7, 0])
    wslot, wpos = torch.tensor([1, 1, 2, -1]), torch.tensor([40, 41, 9, 0])
    rows = ka.RowKeys.build([(1, 41, ()), (1, 42, ()), (2, 7, (9,)), (0, 0, ())])
    plan = kern.plan(rows, pos, wslot, wpos, cos, sin, kb, vb, NQ, HD ** -0.5)
    out = kern.layer(plan, 1, qkv)
    assert torch.equal(kb[0], k0[0]) and torch.equal(vb[0], v0[0])  # other layers untouched
    qk = rope(qkv[:, : (NQ + NK) * HD].view(N, NQ + NK, HD).float(), cos[pos][:, None].float(),
              sin[pos][:, None].float())
    kref, vref = k0[1].clone(), v0[1].clone()
    for i in range(3):
        kref[wslot[i], :, wpos[i]] = qk[i, NQ:].to(dtype)
        vref[wslot[i], :, wpos[i]] = qkv[i, (NQ + NK) * HD:].view(NK, HD)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (kb[1].double() - kref.double()).abs().max().item() < tol and torch.equal(vb[1], vref)
    for i, keys in enumerate([list(range(41)), list(range(42)), list(range(7)) + [9]]):
        ref = _exact(qk[i, :NQ], kref, vref, int(wslot[i]), keys)
        assert (out[i].view(NQ, HD).double() - ref).abs().max().item() < 2 * tol, i
    assert not out[3].any()  # the padding row names no keys
    with pytest.raises(ValueError, match="unsupported"):
        kern.layer(plan, n_layers, qkv)  # no such layer
    with pytest.raises(ValueError, match="unsupported"):
        kern.plan(rows, pos, wslot, torch.tensor([40, 41, T, 0]), cos, sin, kb, vb, NQ, 1.0)  # past the cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nq,nk,hd", [(9, 3, 64), (8, 1, 128), (10, 2, 64), (4, 4, 32), (18, 3, 64), (6, 1, 128)])
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_the_vector_loops_give_the_generic_codes_bits(kern, build, dtype, nq, nk, hd):
    """Where the kernel was built with its AVX2 or its AVX-512 score and value loops, every
    output equals the generic build's bit for bit (heads of 64 and 128 take the fast loops,
    32 the generic ones; 1-6 query heads per KV head, so the value loop's groups of four
    heads split; key counts below, at and above multiples of 16, named by prefix and by list).
    ``avx2``: the build for AVX2 CPUs without AVX-512, made and run on AVX-512 CPUs too."""
    if build == "avx2":
        try:
            kern = ka.avx2_build()
        except RuntimeError as e:
            pytest.skip(f"no AVX2 build here: {e}")
    if not (kern.fast8 or kern.fast16):
        pytest.skip("the kernel's AVX2 / AVX-512 loops are not built on this CPU")
    gen = ka.generic_build()
    assert not (gen.fast8 or gen.fast16)
    g = torch.Generator().manual_seed(nq + hd)
    kc = torch.randn(2, nk, 300, hd, generator=g).to(dtype)
    vc = torch.randn(2, nk, 300, hd, generator=g).to(dtype)
    rows = ka.RowKeys.build([(0, 257, ()), (1, 3, (7, 9, 200)), (0, 0, (5,)), (1, 0, ()), (1, 299, ()),
                             (0, 16, ()), (1, 30, (31, 40)), (0, 15, (299,)), (1, 48, ())])
    q = torch.randn(rows.n, nq, hd, generator=g).to(dtype)
    a, b = kern(q, kc, vc, rows, hd ** -0.5), gen(q, kc, vc, rows, hd ** -0.5)
    assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_add_rms_norm_and_silu_mul_are_rowwise_and_close_to_torch(kern):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(4)
    H, I, N = 64, 96, 10
    x = torch.randn(N, H, generator=g)
    d = torch.randn(N, H, generator=g).bfloat16()
    w = torch.rand(H, generator=g) + 0.5
    xs = x.clone()
    y = kern.add_rms_norm(xs, d, w, 1e-5)
    assert torch.equal(xs, x + d)  # the residual stream exactly as torch adds it
    ref = F.rms_norm(x + d, (H,), w, 1e-5)
    assert (y.float() - ref).abs().max().item() < 2e-2
    assert torch.equal(kern.add_rms_norm(xs, None, w, 1e-5), y) and torch.equal(xs, x + d)  # nothing to add: x unchanged
    one = xs[3:4].clone()
    assert torch.equal(kern.add_rms_norm(one, None, w, 1e-5)[0], y[3])  # a row's bits: its own
    gu = (torch.randn(N, 2 * I, generator=g) * 4).bfloat16()
    m = kern.silu_mul(gu)
    mref = F.silu(gu[:, :I].float()) * gu[:, I:].float()
    assert (m.float() - mref).abs().max().item() <= 1e-2 * mref.abs().max().item()
    assert torch.equal(kern.silu_mul(gu[5:6].contiguous())[0], m[5])
    with pytest.raises(ValueError, match="unsupported"):
        kern.add_rms_norm(xs, d.float(), w, 1e-5)
    with pytest.raises(ValueError, match="unsupported"):
        kern.silu_mul(gu.float())


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(ka, "_state", {})
    monkeypatch.setenv("SPECMESH_CPU_ATTENTION", "sdpa")
    assert ka.load() is None and "SPECMESH_CPU_ATTENTION" in ka.load_error()
