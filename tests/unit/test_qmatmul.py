"""The GGUF block kernels (specmesh/engine/qmatmul.py, csrc/qmm.c) against plain references.

Blocks are random but valid (random code bytes, small fp16 scales), so every code value
occurs, including Q8_0's -128. For each type and several row counts (across the kernel's
64-row passes and the AMX path's 16-row tiles): the tiles give back gguf-py's dequantised
values exactly; a matmul equals the float64 product of those values with the activations
as the kernel rounds them; every path (scalar, AVX2, AVX-VNNI, AVX-512 VNNI, AMX) gives
the scalar path's bits; and a row's bits do not depend on the other rows of the call (the
batch-invariant engine and greedy identity rest on that).

The paths run natively where the CPU has them (``native_paths``: a test per path, marked
by its CPU flag and skipped with the reason elsewhere), and on every x86-64 machine
through the SIMDe build (``qmatmul.load_simde``: SIMDe's portable AVX-512 / VNNI
intrinsics and a plain-C stand-in of the AMX tile instructions, compiled for AVX2), so
no path's bits depend on the CPU the suite runs on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specmesh.engine import qmatmul as qm

from tests.support import kernel_or_skip, random_blocks

K_OF = {"Q4_0": 96, "Q4_1": 128, "Q5_0": 160, "Q8_0": 64, "Q4_K": 512, "Q6_K": 768}
ROWS = (1, 2, 3, 8, 16, 65)


def dequant(name: str, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw.numpy().reshape(n, -1), GGMLQuantizationType[name]).astype(np.float32))


@pytest.fixture(scope="module")
def kernel():
    return kernel_or_skip(qm, "the q block kernels")


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


# each path and the CPU flags it needs (Linux's names)
PATH_FLAGS = {"avx2": {"avx2", "fma", "f16c"}, "avxvnni": {"avx2", "avx_vnni"},
              "avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
              "amx": {"avx512_vnni", "amx_tile", "amx_int8"}}


def native_or_skip(kernel, path):
    if path not in kernel.paths():
        missing = PATH_FLAGS[path] - cpu_flags()
        if path == "avxvnni" and {"avx512_vnni", "avx512vl"} <= cpu_flags():
            missing = set()  # AVX-512 VNNI with VL has the 256-bit form too
        pytest.skip(f"this CPU has no {path} ({', '.join(sorted(missing)) or 'the OS refused the tile state'} "
                    "missing); the SIMDe build checks the path here instead")


@pytest.fixture(scope="module")
def simde():
    k = qm.load_simde()
    if k is None:
        pytest.skip(f"no SIMDe build here: {qm.load_simde_error()}")
    return k


def all_paths_bitwise(kernel, name, paths, rows=ROWS + (17, 33, 300)):
    """Every path in ``paths`` at every row count (AMX: also with every type on the tiles
    from 1 and 2 rows; 300 rows: two passes of the tiles' 256) gives the scalar path's bits
    for a type's random blocks."""
    n, k = 40, K_OF[name]  # 5 tiles: the 16-output paths' last pair has one tile
    raw = random_blocks(name, n, k, seed=4)
    W = qm.QMatrix([qm.Part(qm.TYPE_IDS[name], n, k, raw)], kernel)
    x = torch.randn(max(rows), k, generator=torch.Generator().manual_seed(5)) * 3
    prev = kernel.use_path()
    try:
        kernel.use_path("generic")
        ref = W.mm(x, torch.float32)
        for p in paths:
            kernel.use_path(p)
            for force in ((None, 1, 2) if p == "amx" else (None,)):
                kernel.force_amx_rows(force)
                for m in rows:
                    assert torch.equal(W.mm(x[:m], torch.float32), ref[:m]), (kernel.build, p, force, m)
    finally:
        kernel.force_amx_rows(None)
        kernel.use_path(prev)


@pytest.mark.parametrize("path", list(PATH_FLAGS))
@pytest.mark.parametrize("name", list(K_OF))
def test_each_native_path_gives_the_scalar_bits(kernel, name, path):
    native_or_skip(kernel, path)
    all_paths_bitwise(kernel, name, [path])


@pytest.mark.parametrize("name", list(K_OF))
def test_each_path_through_simde_gives_the_scalar_bits(simde, name):
    assert simde.paths() == list(qm.PATHS)  # every path compiled whatever this CPU has
    all_paths_bitwise(simde, name, list(qm.PATHS[1:]), rows=(1, 2, 3, 8, 16, 17, 33, 300))


def test_simde_and_native_builds_agree(kernel, simde):
    n, k = 16, 512
    raw = random_blocks("Q4_K", n, k, seed=6)
    x = torch.randn(9, k)
    a = qm.QMatrix([qm.Part(qm.TYPE_IDS["Q4_K"], n, k, raw)], kernel).mm(x, torch.float32)
    b = qm.QMatrix([qm.Part(qm.TYPE_IDS["Q4_K"], n, k, raw)], simde).mm(x, torch.float32)
    assert torch.equal(a, b)


def test_the_best_path_is_chosen_and_named(kernel):
    best = kernel.paths()[-1]
    assert kernel.isa == best and kernel.describe().startswith(best)
    with pytest.raises(RuntimeError, match="no nonesuch path"):
        kernel.use_path("nonesuch")


def paths(kernel):
    return kernel.paths()


@pytest.mark.parametrize("name", list(K_OF))
def test_tiles_hold_the_gguf_values(kernel, name):
    n, k = 24, K_OF[name]
    raw = random_blocks(name, n, k)
    W = qm.QMatrix([qm.Part(qm.TYPE_IDS[name], n, k, raw)], kernel)
    assert torch.equal(W.rows(torch.arange(n)), dequant(name, raw, n, k))
    idx = torch.tensor([[5, 0], [23, 7]])
    assert torch.equal(W.rows(idx), dequant(name, raw, n, k)[idx])
    assert torch.equal(W.rows(idx, torch.bfloat16), dequant(name, raw, n, k)[idx].to(torch.bfloat16))


@pytest.mark.parametrize("name", list(K_OF))
def test_matmul_equals_the_exact_product_on_every_path_and_row_count(kernel, name):
    n, k = 40, K_OF[name]
    raw = random_blocks(name, n, k, seed=1)
    W = qm.QMatrix([qm.Part(qm.TYPE_IDS[name], n, k, raw)], kernel)
    w = dequant(name, raw, n, k).double()
    form = "256" if name.endswith("_K") else "32"
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(2)) * 3
    ref = qm.round_rows(x, form, kernel).double() @ w.T
    prev = kernel.use_path()
    try:
        outs = {}
        for p in paths(kernel):
            kernel.use_path(p)
            for m in ROWS:
                y = W.mm(x[:m], torch.float32)
                err = (y.double() - ref[:m]).abs().max() / ref[:m].abs().max()
                assert err < 1e-5, (p, m, float(err))
                outs[(p, m)] = y
        for (p, m), y in outs.items():  # one row's bits: the same alone, in any batch, on any path
            assert torch.equal(y, outs[("generic", max(ROWS))][:m]), (p, m)
    finally:
        kernel.use_path(prev)


def test_bf16_rows_in_and_out(kernel):
    n, k = 16, 256
    raw = random_blocks("Q4_K", n, k, seed=3)
    W = qm.QMatrix([qm.Part(qm.TYPE_IDS["Q4_K"], n, k, raw)], kernel)
    x = torch.randn(5, k).to(torch.bfloat16)
    y32 = W.mm(x.float(), torch.float32)
    assert torch.equal(W.mm(x, torch.float32), y32)  # bf16 rows are read exactly
    assert torch.equal(W.mm(x), y32.to(torch.bfloat16))  # rounded to nearest even at the end


def test_segments_of_different_types_are_their_concatenation(kernel):
    k = 512
    parts = [qm.Part(qm.TYPE_IDS[t], n, k, random_blocks(t, n, k, seed=i))
             for i, (t, n) in enumerate([("Q4_K", 24), ("Q6_K", 8), ("Q8_0", 16)])]
    W = qm.QMatrix(parts, kernel)
    assert W.type_names == ["Q4_K", "Q6_K", "Q8_0"] and W.out_features == 48
    x = torch.randn(7, k)
    whole = W.mm(x, torch.float32)
    alone = torch.cat([qm.QMatrix([p], kernel).mm(x, torch.float32) for p in parts], 1)
    assert torch.equal(whole, alone)
    rows = torch.tensor([0, 30, 47, 24])
    assert torch.equal(W.rows(rows), torch.cat([qm.QMatrix([p], kernel).rows(torch.arange(p.n)) for p in parts])[rows])


def test_activations_round_like_llama_cpp(kernel):
    """d = max|x| / 127 per block, codes round(x / d) to nearest even, within +-127."""
    x = torch.randn(3, 512) * torch.tensor([0.01, 1.0, 100.0])[:, None]
    x[0, :32] = 0.0  # an all-zero block
    for form, qk in (("32", 32), ("256", 256)):
        got = qm.round_rows(x, form, kernel)
        b = x.reshape(3, -1, qk)
        d = b.abs().amax(-1, keepdim=True) / 127
        q = torch.where(d > 0, torch.round(b * torch.where(d > 0, 1 / d, 0)), 0)
        assert torch.equal(got, (q * d).reshape(3, -1)), form


def test_shapes_the_kernels_cannot_take_are_refused(kernel):
    with pytest.raises(ValueError, match="rows a multiple of 8"):
        qm.QMatrix([qm.Part(qm.TYPE_IDS["Q4_K"], 12, 256, random_blocks("Q4_K", 12, 256))], kernel)
    with pytest.raises(ValueError, match="expected"):
        qm.QMatrix([qm.Part(qm.TYPE_IDS["Q4_0"], 8, 64, torch.zeros(10, dtype=torch.uint8))], kernel)
    with pytest.raises(ValueError, match="unknown quantization type"):
        qm.type_id("Q3_K")
    assert not qm.supported("Q4_K", 16, 200) and qm.supported("Q4_0", 16, 224)
    W = qm.QMatrix([qm.Part(qm.TYPE_IDS["Q4_0"], 8, 64, random_blocks("Q4_0", 8, 64))], kernel)
    with pytest.raises(ValueError, match="unsupported input"):
        W.mm(torch.zeros(2, 32))
    with pytest.raises(IndexError):
        W.rows(torch.tensor([8]))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_mapped_part_repacks_in_steps_to_the_same_tiles(kernel, tmp_path, monkeypatch, name):
    """A part read from a mapped file is repacked a few rows at a time, each step's pages
    released (``qmatmul._repack_part``): the tiles are those of one repack of the whole."""
    n, k = 200, 512
    raw = random_blocks(name, n, k, seed=3).numpy()
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 100 + raw.tobytes())  # not at a page boundary
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=100, shape=(raw.size,)).reshape(n, -1)
    whole = qm.QMatrix([qm.Part(qm.TYPE_IDS[name], n, k, raw)], kernel)
    monkeypatch.setattr(qm, "REPACK_CHUNK", 3 * raw.size // n * 8)  # 24 rows a step: 9 steps, the last short
    steps = qm.QMatrix([qm.Part(qm.TYPE_IDS[name], n, k, mapped)], kernel)
    assert torch.equal(whole.data, steps.data)
    assert np.array_equal(np.asarray(mapped).reshape(-1), raw.reshape(-1))  # the pages read back as they were
