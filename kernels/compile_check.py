"""Compile every Triton kernel variant for a CUDA target without a GPU.

``python -m specmesh.kernels.compile_check [--arch 90]`` lowers each kernel (all draft-q modes,
production block sizes) through Triton's NVIDIA backend to a cubin with the bundled
ptxas, catching errors the CPU interpreter cannot see (types in control flow,
unsupported ops, register spills are reported). Exit 0: all compiled; 1: a kernel
failed; 77: this machine cannot check (no triton / no ptxas / interpreter mode).
It does not run anything; correctness is tested under the interpreter or on CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys

PTR = {  # argument name -> pointer type; every other runtime argument is an i32
    "probs": "*fp32", "p": "*fp32", "q": "*fp32", "qd": "*fp32", "qp": "*fp32", "x": "*bf16",
    "tokens": "*i32", "parents": "*i32", "qi": "*i32", "am": "*i32",
    "lens": "*i64", "sizes": "*i64", "prefix": "*i64", "ua": "*fp64", "us": "*fp64", "u": "*fp64",
    "out": "*i64", "acc_out": "*i64", "next_out": "*i64", "plen_out": "*i64", "path": "*i64", "pos": "*i64",
    "mask": "*u8",
}


def variants(tk):
    for mode in (0, 1, 2):
        yield tk._chain_kernel, dict(Q_MODE=mode, BLOCK_K=8, BLOCK_V=2048), 8
        yield tk._tree_kernel, dict(Q_MODE=mode, BLOCK_T=64, BLOCK_V=2048), 8
    for mode in (1, 3):
        yield tk._residual_kernel, dict(Q_MODE=mode, BLOCK_V=2048), 8
    yield tk._argmax_kernel, dict(BLOCK_V=2048), 8
    yield tk._greedy_chain_kernel, dict(BLOCK_K=8), 4
    yield tk._greedy_tree_kernel, {}, 4
    yield tk._mask_kernel, dict(BLOCK_T=64), 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        print("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
        return 77
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from . import triton_kernels as tk
    except ImportError as e:
        print(f"compile_check: cannot import triton ({e})")
        return 77
    failed = 0
    for kern, consts, warps in variants(tk):
        sig = {a: "constexpr" if a in consts else PTR.get(a, "i32") for a in kern.arg_names}
        name = f"{kern.fn.__name__} {consts}"
        try:
            k = triton.compile(ASTSource(kern, sig, consts), target=GPUTarget("cuda", args.arch, 32),
                               options={"num_warps": warps})
        except FileNotFoundError as e:  # no ptxas
            print(f"compile_check: {e}")
            return 77
        except Exception as e:  # noqa: BLE001 - report every failing variant
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}")
            continue
        print(f"ok   {name} ({len(k.asm['cubin'])} byte cubin)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
