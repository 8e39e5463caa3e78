"""An in-process target bundle: tokenizer, engine, verifier and drafters by name.

``Runtime`` is what the demo, the benchmarks and the services start from: it
resolves the model, builds the serving engine and its ``EngineVerifier``, turns a
prompt or chat messages into token ids with the tokenizer's chat template, knows
the stop ids, and builds any registered drafter (``prompt_lookup``, ``suffix``,
``draft_lm`` with its own engine, ``layerskip`` bound to this verifier).

``device`` (``cpu`` by default here; the command-line entry points default to
``auto``) is resolved once by ``specmesh.engine.device.resolve_device``; the engine, the
draft LM's engine and the block drafter live on it. On CUDA the engines are
``GraphedEngine`` (CUDA-graph forwards, ``specmesh.engine.cudagraph``) unless
``cuda_graphs=False``.

It knows nothing about gRPC.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

from .drafters import DRAFTERS, make_drafter, registry
from .drafters.model_drafters import DraftLMDrafter, LayerSkipDrafter
from .drafters.specialist import SpecialistDrafter
from .drafters.specialist import adapter_dir as specialist_adapter
from .engine import LlamaEngine
from .engine.device import resolve_device
from .loop import VerifyCosts
from .models.codec import TextCodec
from .models.loading import (DEFAULT_MODEL, PAIRED_DRAFT_MODELS, added_token_ids, cache_root, freed_memory_returned,
                             load_config, load_state_dict, load_tokenizer, resolve_model, source_gguf)
from .types import InvalidArgument
from .verifier import EngineVerifier

DEFAULT_DRAFT_LAYERS = (0, 1, 2, 29)
# The trained block drafter committed with the project (see checkpoints/*/metrics.json
# for the command that reproduced it); SPECMESH_BLOCK_DRAFTER overrides, "" disables.
BUNDLED_BLOCK_DRAFTERS = {"smollm2-135m-instruct": Path(__file__).resolve().parents[1] / "checkpoints"
                          / "smollm2-block-drafter"}


# The mask-gated adapter (specmesh.uno) committed with the project; SPECMESH_UNO overrides, "" disables.
BUNDLED_UNO = {"smollm2-135m-instruct": Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-uno"}


def uno_path(model: str) -> Optional[Path]:
    env = os.environ.get("SPECMESH_UNO")
    if env is not None:
        return Path(env) if env else None
    p = BUNDLED_UNO.get(model.lower())
    return p if p is not None and (p / "adapter.safetensors").exists() else None


def block_drafter_path(model: str) -> Optional[Path]:
    env = os.environ.get("SPECMESH_BLOCK_DRAFTER")
    if env is not None:
        return Path(env) if env else None
    p = BUNDLED_BLOCK_DRAFTERS.get(model.lower())
    return p if p is not None and (p / "drafter.safetensors").exists() else None


def make_draft_model(target: str, layers: Sequence[int], out_dir: Path) -> Path:
    """Write a draft LM made of a subset of the target's layers (same embeddings,
    head and tokenizer) as a Hugging Face directory. Training it further is the
    block-drafter issue's job; untrained it is a cheap, weak drafter."""
    from safetensors.torch import save_file

    src = resolve_model(target)
    cfg = load_config(src)
    n = cfg["num_hidden_layers"]
    layers = list(layers)
    if not layers or any(not 0 <= i < n for i in layers):
        raise InvalidArgument("layers", f"must be indices in [0, {n})")
    out_dir = Path(out_dir)
    gguf = source_gguf(src)
    if gguf is not None:  # the target's own blocks, read from its GGUF: a config naming the layers, no copy
        out_dir.mkdir(parents=True, exist_ok=True)
        cfg = dict(cfg, num_hidden_layers=len(layers), _draft_of=str(src), _draft_layers=layers, _gguf_layers=layers)
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        load_tokenizer(src).save_pretrained(out_dir)
        return out_dir
    sd = load_state_dict(src)
    out: dict = {}
    for k, v in sd.items():
        if ".layers." in k:
            pre, rest = k.split(".layers.", 1)
            idx, tail = rest.split(".", 1)
            if int(idx) in layers:
                out[f"{pre}.layers.{layers.index(int(idx))}.{tail}"] = v.contiguous()
        else:
            out[k] = v.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(cfg, num_hidden_layers=len(layers), _draft_of=str(src), _draft_layers=layers)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    load_tokenizer(src).save_pretrained(out_dir)
    return out_dir


def default_draft_model(target: str = DEFAULT_MODEL) -> Path:
    """The draft LM of ``target``: its paired smaller model where it has one
    (``PAIRED_DRAFT_MODELS``: Qwen2.5-Coder 1.5B -> 0.5B), else a layer subset of it."""
    if target.lower() in PAIRED_DRAFT_MODELS:
        return resolve_model(PAIRED_DRAFT_MODELS[target.lower()])
    d = cache_root() / "models-gguf" / (Path(target).name.lower() + "-draft-" + "-".join(map(str, DEFAULT_DRAFT_LAYERS)))
    if not (d / "config.json").exists() or (source_gguf(d) is None and not any(d.glob("*.safetensors"))):
        make_draft_model(target, DEFAULT_DRAFT_LAYERS, d)
    return d


AUTO_DTYPE = ("auto: int4 (the GGUF's own blocks on the int8 kernels: the fastest lossless path measured on a "
              "CPU) where the model is a GGUF and the device a CPU that builds those kernels, else bf16")


def resolve_dtype(dtype: str, model_dir, device="cpu") -> str:
    """``dtype`` as the engine takes it: "auto" is int4 where the model's weights are a
    GGUF's blocks (an alias or a ``.gguf`` path: its cache directory names the file) and the
    device is a CPU where the block kernels build, else bf16 (``AUTO_DTYPE``); any other
    name is returned as it is."""
    if dtype != "auto":
        return dtype
    if resolve_device(device).type != "cpu" or source_gguf(Path(model_dir)) is None:
        return "bf16"
    from .engine import blocks

    return "int4" if blocks.available() else "bf16"


# A draft LM's head keeps the first DRAFT_HEAD_ROWS token ids (and the tokenizer's added
# tokens) where its vocabulary is at least twice that: the ids a BPE vocabulary learned
# first are its common ones (Qwen2.5's first 65,536 cover 98% of the tokens of this
# repository's Python and docs, the first 32,768 93%), and the 0.5B's 151,936-row head is
# 145 of the ~390 MB its step reads
DRAFT_HEAD_ROWS = 65536


def draft_head_ranges(model_dir, vocab_size: int, rows: int = DRAFT_HEAD_ROWS) -> list[tuple[int, int]]:
    """The head rows a draft LM of ``model_dir`` keeps (``LlamaEngine.restrict_head``): ids
    below ``rows`` and from the first added token on, in multiples of 8; [] (the whole
    head) where ``rows`` is 0 or the vocabulary is under twice it."""
    if rows <= 0 or vocab_size < 2 * rows:
        return []
    added = [i for i in added_token_ids(Path(model_dir)) if i >= rows]
    tail = (min(added) // 8 * 8) if added else vocab_size
    return [(0, rows // 8 * 8)] + ([(tail, vocab_size)] if tail < vocab_size else [])


def make_draft_engine(path: str, dtype: str, n_slots: int, max_seq_len: int, device="cpu", cuda_graphs=True,
                      head_rows: int = DRAFT_HEAD_ROWS) -> LlamaEngine:
    """A draft LM's engine (``make_engine``), its head kept to ``draft_head_ranges`` where it
    runs on GGUF blocks (the other rows freed)."""
    eng = make_engine(path, dtype, n_slots, max_seq_len, device, cuda_graphs, quiet=True)
    ranges = draft_head_ranges(path, eng.vocab_size, head_rows) if eng.head.mode == "q" else []
    if ranges:
        eng.restrict_head(ranges, release=True)
    return eng


def make_engine(path: str, dtype: str = "fp32", n_slots: int = 4, max_seq_len: int = 2048, device="cpu",
                cuda_graphs=True, quiet: bool = False) -> LlamaEngine:
    """A serving engine on ``device`` (resolved here): ``GraphedEngine`` on CUDA unless
    ``cuda_graphs`` is False (``"always"``: on any device; the CPU runs its static
    forward without capture, for tests; ``"invariant"``: on CUDA, its batch-invariant
    mode, one bucket shape for every forward, so bf16 greedy speculation equals plain
    decoding; on a CPU the eager engine, batch-invariant there by default in bf16),
    else the eager ``LlamaEngine``."""
    dev = resolve_device(device)
    dtype = resolve_dtype(dtype, path, dev)
    cls, kw = LlamaEngine, {}
    if cuda_graphs == "always" or (dev.type == "cuda" and cuda_graphs):
        from .engine.cudagraph import GraphedEngine

        cls, kw = GraphedEngine, ({"invariant": True} if cuda_graphs == "invariant" else {})
    return cls.from_pretrained(path, dtype=dtype, n_slots=n_slots, max_seq_len=max_seq_len, quiet=quiet, device=dev,
                               **kw)


class Runtime:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "fp32", n_slots: int = 4, max_seq_len: int = 2048,
                 draft_model: Optional[str] = None, layerskip_exit: Optional[int] = None, quiet: bool = False,
                 block_drafter: bool = True, device="cpu", cuda_graphs=True, specialist: Optional[str] = "code",
                 uno: bool = True):
        """``device``: auto | cpu | cuda | cuda:N. ``cuda_graphs``: on CUDA, the engines
        are ``GraphedEngine`` (False: the eager engine; "always": on the CPU too, see
        ``make_engine``). ``specialist``: the domain of the divergence-decoding specialist
        offered as the ``specialist`` self drafter when its adapter exists
        (``specmesh.drafters.specialist.adapter_dir``; built on first use; None: none). ``uno``: attach
        the mask-gated adapter's self drafters (``uno``, ``uno_tree``, ``uno_separate``) when
        one exists for the model (``uno_path``)."""
        self.device = resolve_device(device)
        self.cuda_graphs = (cuda_graphs if cuda_graphs == "always" else
                            self.device.type == "cuda" and (cuda_graphs if cuda_graphs == "invariant" else bool(cuda_graphs)))
        self.model_dir = resolve_model(model, quiet=quiet)
        self.model_name = model
        dtype = resolve_dtype(dtype, self.model_dir, self.device)
        self.tokenizer = load_tokenizer(self.model_dir)
        with freed_memory_returned():  # the engine, the block drafter and the adapter (models.loading)
            self.engine = make_engine(str(self.model_dir), dtype, n_slots, max_seq_len, self.device, self.cuda_graphs,
                                      quiet)
            self.verifier = EngineVerifier(self.engine)
            self.verify_costs = VerifyCosts()  # this verifier's cost per scored draft token, shared by its requests
            self.dtype = dtype
            self.max_seq_len = max_seq_len
            self.draft_model = draft_model
            if layerskip_exit is None:  # the exit chosen by `specmesh calibrate-layerskip`, else 24
                from .drafters.calibration import calibrated_exit

                layerskip_exit = calibrated_exit(model, dtype) or min(24, self.engine.n_layers - 1)
            self.layerskip_exit = layerskip_exit
            self.verifier.self_drafters["layerskip"] = LayerSkipDrafter(self.verifier, layerskip_exit)
            self._draft_lm: Optional[DraftLMDrafter] = None
            self.block_drafter = None
            self.tree_schedule = None  # the block drafter's entropy-switched tree budgets (loop.TreeSchedule)
            bd = block_drafter_path(model) if block_drafter else None
            if bd is not None:  # the `self` strategy's trained drafter ("block"), fed by kept hidden states
                from .blockdraft.serve import BlockSelfDrafter, load_schedule

                self.block_drafter = BlockSelfDrafter.from_checkpoint(self.verifier, bd)
                self.tree_schedule = load_schedule(bd)
                if self.device.type != "cpu":  # the same weights, folded again on the device
                    self.block_drafter = BlockSelfDrafter(self.verifier, self.block_drafter.model.to(self.device),
                                                          calibration=self.block_drafter.calibration)
                self.verifier.self_drafters["block"] = self.block_drafter
                self.verifier.self_drafters["block_tree"] = BlockSelfDrafter(
                    self.verifier, self.block_drafter.model, tree=True, calibration=self.block_drafter.calibration,
                    folded=self.block_drafter.folded)
            self.uno = None
            up = self.uno_path = uno_path(model) if uno else None
            if up is not None:  # the target drafting for itself: its mask-gated adapter
                from .uno.serve import UnoDrafter

                self.uno = UnoDrafter.from_checkpoint(self.verifier, up)
                self.verifier.self_drafters["uno"] = self.uno
                self.verifier.self_drafters["uno_tree"] = self.uno.twin(tree=True)
                self.verifier.self_drafters["uno_separate"] = self.uno.twin(layout="separate")
        self.codec = TextCodec(self.tokenizer, self.engine.vocab_size)
        self.stop_ids = self.codec.stop_ids
        # grammars (structured outputs): the tokenizer as the grammar engine sees it, built on first use (~0.4 s)
        tok, vs, stops = self.tokenizer, self.engine.vocab_size, list(self.stop_ids)

        def grammar_vocab():
            from .grammar import Vocab

            return Vocab.from_hf(tok, vs, stops)

        self.verifier.set_grammar_vocab(grammar_vocab)
        self.specialist = None
        if specialist is not None and specialist_adapter(model, specialist) is not None:
            self.specialist = SpecialistDrafter(lambda: self._specialist_engine(specialist), domain=specialist,
                                                vocab_size=self.engine.vocab_size)
            self.verifier.self_drafters["specialist"] = self.specialist
        self.warmup_s: Optional[float] = None
        if self.device.type == "cuda":  # graphs captured and kernels compiled before serving
            self.warm_up()

    def warm_up(self) -> int:
        """Before the first request (run at start-up on CUDA): compile the batched
        acceptance kernels for every shape class (``acceptance.warm_up_kernels``), and
        capture (``GraphedEngine.warm_up``) every bucket this configuration can use: all
        batch x token x key buckets with the hidden layers the verifier and its drafters
        read (kept features, the fused drafter's last layer, the contrastive exit), with
        and without the adapter's terms when one is attached, and the layer-skip exit's
        one-session buckets; then marks the engine as serving (a later capture is
        counted: ``specmesh_cuda_graph_captures_total``). Logs the seconds it took
        (``warmup_s``). Returns how many buckets exist; 0 for an engine without them."""
        import logging
        import time

        from .acceptance import warm_up_kernels

        eng = self.engine
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            warm_up_kernels(self.device, eng.vocab_size, self.verifier.max_tree_nodes)
        if not hasattr(eng, "warm_up"):
            self.warmup_s = time.perf_counter() - t0
            return 0
        v = self.verifier
        hidden = set(v.feature_layers) | {eng.n_layers - 1}
        ex = v.contrastive_exit()
        if ex is not None:
            hidden.add(ex - 1)
        partial = [self.layerskip_exit] if self.layerskip_exit is not None else []
        n = eng.warm_up(hidden_layers=sorted(hidden), n_layers=partial)
        eng.serving = True
        self.warmup_s = time.perf_counter() - t0
        logging.getLogger("specmesh.runtime").info(
            "CUDA graphs: %d buckets prepared in %.1f s (%d captured, %d failed)", n, self.warmup_s,
            eng.calls.get("captures", 0), eng.calls.get("capture_errors", 0))
        return n

    def _specialist_engine(self, domain: str) -> LlamaEngine:
        """The specialist (target + the domain's LoRA merged) as an engine like the target's."""
        from .drafters.specialist import load_specialist

        cfg, sd = load_specialist(self.model_name, domain)
        cls = type(self.engine)
        eng = cls(cfg, sd, dtype=self.dtype, n_slots=self.engine.n_slots, max_seq_len=self.max_seq_len,
                  device=self.device)
        eng.model_dir = specialist_adapter(self.model_name, domain)
        return eng

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    # ---------------------------------------------------------------- text
    def encode(self, prompt: Optional[str] = None, messages: Optional[list[dict]] = None,
               chat: bool = True) -> list[int]:
        """Token ids for a prompt (wrapped as one user turn when ``chat``) or messages (``TextCodec``)."""
        return self.codec.encode(prompt, messages, chat)

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Messages rendered and tokenized, typed special tokens as text (``TextCodec.chat_ids``)."""
        return self.codec.chat_ids(messages, add_generation_prompt)

    # ---------------------------------------------------------------- drafters
    def drafter(self, name: str, **kw):
        """A drafter for the loop; ``layerskip`` drafts in this process's verifier."""
        if name == "layerskip":
            return LayerSkipDrafter(self.verifier, kw.get("exit_layer", self.layerskip_exit))
        if name == "specialist":  # divergence decoding: drafts inside this verifier (self_draft="specialist")
            if self.specialist is None:
                raise InvalidArgument("drafter", "no specialist: train one with `specmesh train-specialist`")
            return self.specialist
        if name == "draft_lm":
            if self._draft_lm is None:
                path = self.draft_model or str(default_draft_model(self.model_name))
                eng = make_draft_engine(path, self.dtype, self.engine.n_slots, self.max_seq_len, self.device,
                                        self.cuda_graphs)
                self._draft_lm = DraftLMDrafter(eng)
            return self._draft_lm
        if name == "adaptive_lookup" and "embeddings" not in kw and "vocab_size" not in kw:
            return make_drafter(name, embeddings=self.engine.embed, **kw)  # the target's own embedding table
        if name not in DRAFTERS:
            raise InvalidArgument("drafter", f"unknown drafter {name!r}; known: {sorted(DRAFTER_NAMES)}")
        return make_drafter(name, **kw)


# what ``drafter(name)`` builds; the one-pass block drafters run as self drafts (``self_draft=``)
DRAFTER_NAMES = tuple(n for n in registry.names() if n not in registry.PER_ROUND)
