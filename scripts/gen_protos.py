#!/usr/bin/env python3
"""Generate the Python gRPC stubs from protos/specmesh/v1/*.proto (``make protos``).

The stubs land in ``<out>/specmesh/v1/`` (default: the repository root), so they
import as ``specmesh.v1.router_pb2``. ``--check`` generates into a temporary
directory and exits 1 when the committed stubs differ (stale). Needs only
grpcio-tools; knows nothing else about the project.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def protos() -> list[Path]:
    return sorted((PROTO_DIR / "specmesh" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) into ``out``; return the generated files."""
    from grpc_tools import protoc
    import grpc_tools

    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"  # well-known types
    files = [str(p.relative_to(PROTO_DIR)) for p in protos()]
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
            f"--pyi_out={out}", *[str(PROTO_DIR / f) for f in files]]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return expected_files(out)


def expected_files(root: Path) -> list[Path]:
    return [root / "specmesh" / "v1" / (p.stem + s) for p in protos() for s in SUFFIXES]


def stale_files() -> list[str]:
    """Relative paths of committed stubs that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        bad = []
        for f, c in zip(fresh, expected_files(ROOT)):
            if not c.exists() or not filecmp.cmp(f, c, shallow=False):
                bad.append(str(c.relative_to(ROOT)))
        return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT, help="output root (default: repository root)")
    ap.add_argument("--check", action="store_true", help="fail when the committed stubs are stale")
    a = ap.parse_args(argv)
    if a.check:
        bad = stale_files()
        if bad:
            print("stale generated stubs (run `make protos`):", *bad, sep="\n  ", file=sys.stderr)
            return 1
        print("generated stubs are up to date")
        return 0
    for f in generate(a.out):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
