"""The int4 weight-only matmul kernel (``specmesh.engine.int4_matmul``): the int4 engine's
weights ``(q - 8) * scale + zero`` applied to bf16 rows, close to the exact product and
to torch's int4 kernel; a row's bits depend on that row alone (not on how many rows
share the call, where it sits, or the thread count); the screen head's top logits are
the exact table products. Every matmul the CPU has: AVX-512 BF16, AMX tiles, AVX2 and AVX2
with int8 inputs (the AVX2 ones also compute exactly the order their source documents)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specmesh.engine import int4_matmul as im
from specmesh.engine import quantize_int4
from tests.support import kernel_or_skip


@pytest.fixture(scope="module", params=["avx512", "amx", "avx2", "avx2q8"])
def kern(request):
    return _variant(request.param)


def _variant(isa):
    """That matmul of the same library (SPECMESH_INT4_KERNEL=...), where the CPU has it."""
    k = kernel_or_skip(im, "int4 kernel")
    try:
        return im.variant(k.lib, k.path, isa)
    except RuntimeError as e:
        pytest.skip(str(e))


def _weight(N, K, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    q, scale, lo = quantize_int4(w, group)
    zero = lo + 8 * scale
    s, z = scale.bfloat16().float(), zero.bfloat16().float()  # what both kernels take
    deq = ((q.float() - 8).reshape(N, K // group, group) * s[..., None] + z[..., None]).reshape(N, K)
    return q, scale, zero, deq


@pytest.mark.parametrize("group", [32, 64])
def test_matches_the_dequantised_product_and_torchs_kernel(kern, group):
    N, K = 96, 192
    q, scale, zero, deq = _weight(N, K, group)
    P = kern.pack(q, scale, zero, group)
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = kern.mm(x, P, N, group)
    ref = x.double() @ deq.double().T
    tol = ref.abs() * 2 ** -7 + 1e-3  # bf16 rounding of a close sum
    if kern.isa == "avx2q8":  # and each input of the scale term off by at most half its block's step
        step = x.double().reshape(11, K // 32, 32).abs().amax(-1, keepdim=True) / 127
        ws = (q.double() - 8) * scale.bfloat16().double().repeat_interleave(group, 1)
        tol = tol + (0.51 * step.expand(-1, -1, 32).reshape(11, K)) @ ws.abs().T
    assert y.dtype == torch.bfloat16 and y.shape == (11, N)
    assert ((y.double() - ref).abs() <= tol).all()
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()
    w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    yt = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4, group, sz)
    assert (y.float() - yt.float()).abs().max().item() <= 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize("N", [64, 80, 112])  # 4, 5, 7 blocks of 16: few rows take 4 or 2 blocks a pass, and tails
def test_a_rows_bits_depend_on_that_row_alone(kern, N):
    K, group = 128, 32
    q, scale, zero, _ = _weight(N, K, group, seed=2)
    P = kern.pack(q, scale, zero, group)
    x = torch.randn(45, K, generator=torch.Generator().manual_seed(3)).bfloat16()
    full = kern.mm(x, P, N, group)
    for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 19, 33):
        part = kern.mm(x[45 - m:].contiguous(), P, N, group)  # the last m rows, at other places
        assert torch.equal(part, full[45 - m:]), m
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kern.mm(x, P, N, group)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, full)


def _cancelling_case(N, K, group, M, seed):
    """Weights +a / -a on each input pair and inputs whose pairs are equal where large,
    so each sum is a small residue of large partial sums: every rounding step of the
    order shows in the bf16 output (with random data almost none does: integer weights
    keep most partial sums exact)."""
    g = torch.Generator().manual_seed(seed)
    amp = torch.randint(1, 8, (N, 1), generator=g)
    q = torch.empty(N, K, dtype=torch.uint8)
    q[:, 0::2], q[:, 1::2] = (8 + amp).to(torch.uint8), (8 - amp).to(torch.uint8)
    scale, zero = torch.full((N, K // group), 2.0 ** -6), torch.zeros(N, K // group)
    xe = (torch.randn(M, K // 2, generator=g)
          * torch.exp2(torch.randint(-12, 13, (M, K // 2), generator=g).float())).bfloat16().float()
    nudge = 1 + torch.randint(-1, 2, (M, K // 2), generator=g).float() * 2 ** -7
    xo = torch.where(xe.abs() < 2 ** -4, xe * nudge, xe)
    return torch.stack([xe, xo], -1).reshape(M, K).bfloat16(), q, scale, zero


@pytest.mark.parametrize("group", [32, 64, 128])
def test_amx_few_rows_path_gives_the_tiles_bits(group):
    """One AMX call of few rows runs the tiles' arithmetic (two FMA chains per pair
    parity, then dst + (even + odd)) with AVX-512 FMAs: the same bits as the tiles.
    (Checked to fail with one chain for both parities, or with the chunk sums added
    unpaired.)"""
    k = kernel_or_skip(im, "int4 kernel")
    try:
        a = im.amx_variant(k.lib, k.path)
    except RuntimeError as e:
        pytest.skip(str(e))
    N, K = 64, 256
    before = a.amx_few_rows()
    assert before >= 2  # the default takes one and two rows
    try:
        for m in (1, 2, 3, 17, 40):  # past 16 rows the tiles take every pass of a block's unpacked groups
            x, q, scale, zero = _cancelling_case(N, K, group, m, seed=group + m)
            P = a.pack(q, scale, zero, group)
            a.amx_few_rows(0)
            tiles = a.mm(x, P, N, group)
            a.amx_few_rows(m)
            fmas = a.mm(x, P, N, group)
            assert torch.equal(fmas.view(torch.int16), tiles.view(torch.int16)), m
            assert tiles.float().abs().max() > 0  # the residues are not all zero
    finally:
        a.amx_few_rows(before)
    assert a.amx_few_rows() == before


def _avx2_order(x, q, scale, zero, group):
    """The AVX2 matmul's arithmetic as its source states it, one fp32 rounding a step
    (float64 holds every product and sum of two fp32 values exactly): per group
    t = sum x_i q_i in input order, then acc = fma(t, s, acc), acc = fma(z - 8 s, sum_g x, acc)."""
    M, K = x.shape
    xf, qd = x.double(), q.double()
    s, z = scale.bfloat16().double(), zero.bfloat16().double()
    f32 = lambda t: t.float().double()  # noqa: E731 - round to fp32
    acc = torch.zeros(M, q.shape[0], dtype=torch.float64)
    for g in range(K // group):
        t = torch.zeros_like(acc)
        xsum = torch.zeros(M, dtype=torch.float64)
        for i in range(g * group, (g + 1) * group):
            t = f32(t + xf[:, i:i + 1] * qd[:, i][None])
            xsum = f32(xsum + xf[:, i])
        acc = f32(acc + t * s[:, g][None])
        acc = f32(acc + f32(z[:, g] - 8 * s[:, g])[None] * xsum[:, None])
    return acc.float().bfloat16()


@pytest.mark.parametrize("group", [32, 64])
def test_the_avx2_matmul_computes_its_documented_order(group):
    """Bit for bit, on sums that are small residues of large partial sums (so every
    rounding step shows in the bf16 output)."""
    a = _variant("avx2")
    N, K = 48, 128
    for m in (1, 3, 5):
        x, q, scale, zero = _cancelling_case(N, K, group, m, seed=7 * group + m)
        y = a.mm(x, a.pack(q, scale, zero, group), N, group)
        assert torch.equal(y.view(torch.int16), _avx2_order(x, q, scale, zero, group).view(torch.int16)), m
        assert y.float().abs().max() > 0


def _q8_order(x, q, scale, zero, group):
    """The AVX2 int8-input matmul's arithmetic as its source states it: per row and block
    of 32 inputs d = max|x| / 127, x_q = round(x * (127 / max|x|)) (nearest even; fp32
    steps), T = sum (q - 8) x_q (exact); per group t = fma(T, d, t) over its blocks, then
    acc = fma(t, s, acc), acc = fma(z, sum_g x, acc) (the fp32 input sum in input order)."""
    M, K = x.shape
    xf = x.float().reshape(M, K // 32, 32)
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))  # fp32 division
    xq = torch.round(xf * inv[..., None]).reshape(M, K).double()
    d = (amax / 127).double()
    T = xq @ (q.double() - 8).T  # exact integers [M, N], per block below
    s, z = scale.bfloat16().double(), zero.bfloat16().double()
    f32 = lambda t: t.float().double()  # noqa: E731 - round to fp32
    acc = torch.zeros(M, q.shape[0], dtype=torch.float64)
    for g in range(K // group):
        t = torch.zeros_like(acc)
        for a in range(g * group // 32, (g + 1) * group // 32):
            Ta = xq[:, 32 * a:32 * (a + 1)] @ (q[:, 32 * a:32 * (a + 1)].double() - 8).T
            t = f32(t + Ta * d[:, a:a + 1])
        xsum = torch.zeros(M, dtype=torch.float64)
        for i in range(g * group, (g + 1) * group):
            xsum = f32(xsum + x[:, i].double())
        acc = f32(acc + t * s[:, g][None])
        acc = f32(acc + z[:, g][None] * xsum[:, None])
    assert T.abs().max() < 2 ** 31
    return acc.float().bfloat16()


@pytest.mark.parametrize("vnni", [1, 0], ids=["vnni", "ymm"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_int8_input_avx2_matmul_computes_its_documented_order(group, vnni):
    """Bit for bit, on random weights and inputs whose blocks range over 2^-12..2^12, and
    on mirrored blocks whose sums are residues (the cancelling case's equal pairs cancel
    exactly in int8, so it shows nothing here). Checked to fail with x_q truncated, with
    the zero term added before the scale term (group 32), and with t summed unrounded
    (group 128). Both of its loops: AVX-512 VNNI (the default where the build has it; checked
    to fail with the even and odd inputs' weights swapped) and AVX2."""
    a = _variant("avx2q8")
    if vnni and not a.q8_vnni():
        pytest.skip("the int4 kernel was built without AVX-512 VNNI")
    old = a.q8_vnni(vnni)
    try:
        _check_q8_order(a, group)
    finally:
        a.q8_vnni(old)


def _check_q8_order(a, group):
    N, K = 48, 256
    g = torch.Generator().manual_seed(group)
    for m in (1, 3, 9):
        q, scale, zero, _ = _weight(N, K, group, seed=m)
        x = (torch.randn(m, K, generator=g)
             * torch.exp2(torch.randint(-12, 13, (m, K // 32, 1), generator=g).float()).expand(-1, -1, 32)
             .reshape(m, K)).bfloat16()
        x[0, :32] = 0  # an all-zero block
        y = a.mm(x, a.pack(q, scale, zero, group), N, group)
        assert torch.equal(y.view(torch.int16), _q8_order(x, q, scale, zero, group).view(torch.int16)), m
        # mirrored: each odd block of 32 is -(1 + 2^-6) x the even one before it, with the same
        # weights, scales and zeros, so the sums are residues where every rounding step shows
        xm, qm = x.clone().reshape(m, K // 64, 2, 32), q.clone().reshape(N, K // 64, 2, 32)
        xm[:, :, 1], qm[:, :, 1] = (-xm[:, :, 0].float() * (1 + 2 ** -6)).bfloat16(), qm[:, :, 0]
        sm, zm = scale.clone(), zero.clone()
        if group == 32:
            sm[:, 1::2], zm[:, 1::2] = sm[:, 0::2], zm[:, 0::2]
        xm, qm = xm.reshape(m, K), qm.reshape(N, K)
        y = a.mm(xm, a.pack(qm, sm, zm, group), N, group)
        assert torch.equal(y.view(torch.int16), _q8_order(xm, qm, sm, zm, group).view(torch.int16)), m
        assert y.float().abs().max() > 0


@pytest.mark.parametrize("group", [32, 64, 128])
def test_group_input_sums_run_in_input_order(kern, group):
    """Every matmul's group term z_g sum_g x takes the group's fp32 input sum in input
    order, for every group. Weights q = 8 make the products vanish, and output n keeps
    only group n mod G (scale 2^-6, zero 1 there; 0 elsewhere), so y[m, n] = bf16(sum of
    row m's group n mod G); inputs with large cancelling values make each sum depend on
    its order. (Checked to fail with the sums taken in reverse order.)"""
    N, K, M = 48, 32 * 40, 3
    G = K // group
    g = torch.Generator().manual_seed(group)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-4, 3, (M, K), generator=g).float())
    for m in range(M):  # per group +2^20 and -2^20 somewhere: the terms between them lose their low bits
        for j in range(G):
            i = torch.randperm(group, generator=g)[:2] + j * group
            x[m, i[0]], x[m, i[1]] = 2.0 ** 20, -2.0 ** 20
    x = x.bfloat16()
    mine = (torch.arange(G)[None] == (torch.arange(N) % G)[:, None]).float()  # [N, G]
    q = torch.full((N, K), 8, dtype=torch.uint8)
    y = kern.mm(x, kern.pack(q, mine * 2.0 ** -6, mine, group), N, group)
    xs = torch.zeros(M, G)  # fp32, one input at a time
    for i in range(group):
        xs = xs + x[:, i::group].float()
    want = xs[:, torch.arange(N) % G].bfloat16()
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    back = torch.zeros(M, G)
    for i in reversed(range(group)):
        back = back + x[:, i::group].float()
    assert (back.bfloat16() != xs.bfloat16()).float().mean() > 0.5  # the case tells the orders apart


def test_bad_input_is_refused(kern):
    q, scale, zero, _ = _weight(32, 64, 32)
    with pytest.raises(ValueError, match="unsupported"):
        kern.pack(q[:24], scale[:24], zero[:24], 32)  # outputs not a multiple of 16
    P = kern.pack(q, scale, zero, 32)
    with pytest.raises(ValueError, match="unsupported"):
        kern.mm(torch.randn(2, 64), P, 32, 32)  # fp32 rows
    with pytest.raises(ValueError, match="unsupported"):
        kern.mm(torch.randn(2, 96).bfloat16(), P, 32, 32)  # another input width


def test_screen_recomputes_each_rows_top_k_from_the_table(kern):
    g = torch.Generator().manual_seed(5)
    n, V, H, k = 3, 512, 64, 16
    table = torch.randn(V, H, generator=g).bfloat16()
    hn = torch.randn(n, H, generator=g)
    logits = (hn @ table.float().T + 0.3 * torch.randn(n, V, generator=g)).bfloat16()  # a noisy screen
    out = kern.screen(logits, hn, table, k)
    exact = hn.double() @ table.double().T
    for r in range(n):
        top = logits[r].float().sort(descending=True, stable=True).indices[:k]  # ties: the lower index
        assert (out[r, top].double() - exact[r, top]).abs().max().item() < 1e-4
        rest = torch.ones(V, dtype=torch.bool)
        rest[top] = False
        assert torch.equal(out[r, rest], logits[r, rest].float())  # the others: the screen's own
    assert torch.equal(kern.screen(logits[1:2].contiguous(), hn[1:2].contiguous(), table, k)[0], out[1])
    with pytest.raises(ValueError, match="unsupported"):
        kern.screen(logits, hn, table, 257)
    # an int8 table with a bf16 scale per row (an untied head's int8 copy)
    t8 = torch.randint(-127, 128, (V, H), generator=g, dtype=torch.int8)
    sc = (torch.rand(V, generator=g) * 0.01 + 0.001).bfloat16()
    out8 = kern.screen(logits, hn, t8, k, sc)
    exact8 = hn.double() @ (t8.double() * sc.double()[:, None]).T
    top = logits[0].float().sort(descending=True, stable=True).indices[:k]
    assert (out8[0, top].double() - exact8[0, top]).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="unsupported"):
        kern.screen(logits, hn, t8, k)  # an int8 table needs its scales


def test_screen_sums_each_top_logit_in_input_order(kern):
    """Each recomputed logit is one fp32 FMA chain over the hidden dimension in input order
    (the bits the int4 engine's greedy choices rest on; the kernel runs eight chains side
    by side), for the bf16 table and for the int8 one before its scale; 11 candidates a row
    (one group of eight and a partial one), ties in the screen included."""
    g = torch.Generator().manual_seed(3)
    V, H, n, k = 300, 64, 2, 11
    table = torch.randn(V, H, generator=g).bfloat16()
    t8 = torch.randint(-127, 128, (V, H), generator=g, dtype=torch.int8)
    sc = (torch.rand(V, generator=g) * 0.01 + 0.001).bfloat16()
    hn = torch.randn(n, H, generator=g)
    logits = (hn @ table.float().T).bfloat16()
    logits[:, 40:60] = logits[:, :1]  # equal screen values: the lower indices are kept

    def chain(h, w):  # fp32 FMAs: the product exact in float64, one rounding to fp32 a step
        a = np.float32(0)
        for d in range(len(h)):
            a = np.float32(np.float64(a) + np.float64(h[d]) * np.float64(w[d]))
        return a

    out, out8 = kern.screen(logits, hn, table, k), kern.screen(logits, hn, t8, k, sc)
    for r in range(n):
        for v in logits[r].float().sort(descending=True, stable=True).indices[:k].tolist():
            h = hn[r].numpy()
            assert out[r, v].item() == chain(h, table[v].float().numpy()), (r, v)
            assert out8[r, v].item() == np.float32(chain(h, t8[v].float().numpy()) * np.float32(sc[v].item())), (r, v)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(im, "_state", {})
    monkeypatch.setenv("SPECMESH_INT4_KERNEL", "torch")
    assert im.load() is None and "SPECMESH_INT4_KERNEL" in im.load_error()


def test_the_environment_names_the_kernel(monkeypatch):
    monkeypatch.setattr(im, "_state", {})
    monkeypatch.setenv("SPECMESH_INT4_KERNEL", "int2")
    assert im.load() is None and "int2" in im.load_error()
    monkeypatch.setattr(im, "_state", {})
    monkeypatch.setenv("SPECMESH_INT4_KERNEL", "amx")
    k = im.load()
    assert (k is not None and k.amx) or "AMX" in im.load_error() or "AVX-512" in im.load_error()
    monkeypatch.setattr(im, "_state", {})
    monkeypatch.setenv("SPECMESH_INT4_KERNEL", "avx512")
    k = im.load()
    assert (k is not None and k.isa == "avx512") or "AVX-512" in im.load_error()
    monkeypatch.setattr(im, "_state", {})
    monkeypatch.setenv("SPECMESH_INT4_KERNEL", "avx2")
    k = im.load()
    assert (k is not None and k.isa == "avx2") or "AVX2" in im.load_error()
    monkeypatch.setattr(im, "_state", {})
    monkeypatch.setenv("SPECMESH_INT4_KERNEL", "avx2q8")  # opt-in only: never the default's pick
    k = im.load()
    assert (k is not None and k.isa == "avx2q8") or "AVX2" in im.load_error()
    monkeypatch.delenv("SPECMESH_INT4_KERNEL")
    monkeypatch.setattr(im, "_state", {})
    k = im.load()
    assert k is None or k.isa != "avx2q8"
