"""The CPU kernels' C sources (``specmesh/engine/csrc``): what the builder compiles is each
``.c`` file with its local includes inlined (``keylist_attention.c_source``), and every
file there ships with the package (pyproject's package data)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from specmesh.engine import bf16_matmul, int4_matmul, keylist_attention, layer_stack
from specmesh.engine.keylist_attention import CSRC, c_source

ROOT = Path(__file__).resolve().parents[2]


def test_local_includes_are_inlined_and_others_kept(tmp_path):
    (tmp_path / "a.c").write_text('#include <stdint.h>\nint x;\n\n#include "b.h"\nint y;\n')
    (tmp_path / "b.h").write_text("int b1;\nint b2;\n")
    assert c_source("a.c", root=tmp_path) == "#include <stdint.h>\nint x;\n\nint b1;\nint b2;\nint y;\n"


@pytest.mark.parametrize("mod", [bf16_matmul, int4_matmul, keylist_attention, layer_stack])
def test_each_kernel_compiles_its_csrc_file_self_contained(mod):
    name = Path(mod.__file__).stem + ".c"
    assert mod._SOURCE == c_source(name)
    assert not re.search(r'^#include "', mod._SOURCE, flags=re.M), "a local include was left for the compiler"
    raw = (CSRC / name).read_text()
    for inc in re.findall(r'^#include "([\w.]+)"$', raw, flags=re.M):  # each helper's text is in the source
        assert (CSRC / inc).read_text().removesuffix("\n") in mod._SOURCE


def test_every_csrc_file_is_package_data():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package = ".".join(CSRC.parent.relative_to(ROOT).parts)  # the package csrc/ sits in (specmesh.engine)
    patterns = conf["tool"]["setuptools"]["package-data"][package]
    rel = CSRC.relative_to(CSRC.parent)
    files = sorted(p.name for p in CSRC.iterdir() if p.is_file())
    assert any(f.endswith(".c") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f"{rel.as_posix()}/{f}", p) for p in patterns)]
    assert not missing, f"not shipped by pyproject's [tool.setuptools.package-data]: {missing}"
