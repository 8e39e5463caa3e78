#!/usr/bin/env python3
"""Whole int4 forwards on this code's int4 kernel against another commit's, in one process.

Builds two ``Runtime``s of the same model: one on the int4 library compiled from the C
source at ``--rev`` (``csrc/int4_matmul.c`` with its includes, in ``specmesh/engine/csrc``
or, before the engine package, ``specmesh/csrc``; at revisions before the C left the Python
module, ``_SOURCE`` of ``specmesh/int4_matmul.py``, by ``at_rev.module_at``), one on this
checkout's; the rest of the engine is this checkout's. After a prompt of ``--ctx``
tokens it times a forward scoring a chain of N tokens on each, alternating, and checks
that both return the same logits bit for bit (a kernel change that keeps the
arithmetic must). Medians; the machine may be shared, so only the ratio means much.

    .venv/bin/python scripts/kernel_ab.py --rev d077749 --rows 1,2,8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.spin_threads()

import torch

from specmesh.engine import int4_matmul as im
from specmesh.engine.keylist_attention import CSRC, c_source
from specmesh.runtime import Runtime

from at_rev import module_at  # scripts/at_rev.py

ROOT = Path(__file__).resolve().parents[1]


# where the C sources were (csrc/ moved into the engine package: specmesh/csrc before)
CSRC_AT = (CSRC.relative_to(ROOT).as_posix(), "specmesh/csrc")


def source_at(rev: str) -> str:
    """The int4 library's C text at ``rev``, as the builder compiles it."""
    for csrc in CSRC_AT:
        r = subprocess.run(["git", "archive", rev, csrc], capture_output=True, cwd=ROOT)
        if r.returncode == 0:
            with tempfile.TemporaryDirectory() as d:
                tarfile.open(fileobj=BytesIO(r.stdout)).extractall(d, filter="data")
                return c_source("int4_matmul.c", root=Path(d) / csrc)
    # before the C moved to csrc/: the module's string (then specmesh/int4_matmul.py)
    return module_at(rev, "specmesh/int4_matmul.py")._SOURCE


def runtime_on(source: str, model: str) -> Runtime:
    """A Runtime whose int4 layers run on the library built from ``source``."""
    im._state.clear()
    saved, im._SOURCE = im._SOURCE, source
    try:
        return Runtime(model, dtype="int4", n_slots=1, max_seq_len=2048, quiet=True, block_drafter=False)
    finally:
        im._SOURCE = saved
        im._state.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", required=True, help="the commit whose int4 kernel is the baseline")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    rts = {a.rev: runtime_on(source_at(a.rev), a.model), "this": runtime_on(im._SOURCE, a.model)}
    prompt = [int(t) % 49152 for t in range(100, 100 + a.ctx)]
    for rt in rts.values():
        rt.engine.reset(0)
        rt.engine.prefill(0, prompt)
    with torch.inference_mode():
        for n in (int(r) for r in a.rows.split(",")):
            toks, parents = [42 + i for i in range(n)], [i - 1 for i in range(n)]
            ms = {k: [] for k in rts}
            out = {}
            for _ in range(a.reps):
                for k, rt in rts.items():
                    t0 = time.perf_counter()
                    for _ in range(3):
                        out[k] = rt.engine.score(0, toks, parents).logits
                    ms[k].append((time.perf_counter() - t0) / 3 * 1e3)
            base, new = (statistics.median(ms[k]) for k in rts)
            same = torch.equal(*out.values())
            print(f"{n} rows: {a.rev} {base:.2f} ms, this {new:.2f} ms, {base / new:.3f}x; identical logits {same}")


if __name__ == "__main__":
    main()
