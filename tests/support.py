"""Shared test helpers, imported as ``from tests.support import ...`` from every
folder (the repository root is on ``sys.path`` through pyproject's ``pythonpath``;
``tests`` is a namespace package, no ``__init__.py``). No test module imports another.

- tiny models: ``tiny_hf`` / ``tiny_engine`` (a random Hugging Face Llama or Qwen2 and
  our engine over it), ``tiny_weights`` (a random Llama state dict, vocabulary ``V``),
  ``GatedVerifier`` (a verifier that can pause inside a batch), ``tiny_block_model``
  (a random block drafter), ``BlockGatedVerifier`` / ``tiny_block_factories`` (it in
  the verifier and on the drafter service);
- codecs: ``FakeCodec`` (characters <-> ids), ``TokenizerCodec`` (plus the tokenizer
  the ssr thinking format reads);
- settings: ``settings(base=GRPC_SETTINGS, **overrides)`` with the bases
  ``GRPC_SETTINGS`` (the gRPC unit tests), ``TRACED_SETTINGS`` (observability, lossy,
  defaults) and ``REAL_SETTINGS`` (the real-model end-to-end stacks);
- gRPC helpers: ``wait_for``, ``healthy``, ``code_of``, ``free_port``;
- ``ServeProcess``: the real ``specmesh serve`` (its supervised processes) on free
  ports, its log collected, a child's pid, SIGKILL a child, wait until it is back;
- stacks: ``LocalStack`` (``specmesh.cli.stack``: router + drafter service +
  verifier service(s) in process on loopback) and its presets ``TinyStack`` (gated
  tiny verifiers), ``BlockStack`` (the same with the tiny block drafter on both sides), ``TracedStack`` / ``TinyTracedStack`` (metrics and spans) and
  ``RuntimeStack`` (the real SmolLM2 Runtime);
- observability checks: ``make_provider``, ``spans_of``, ``spans_done``,
  ``strategy_cases``, ``request_kwargs``, ``check_request_tree``, ``scrape``,
  ``samples``, ``total``, ``check_metrics_agree``;
- exact distributions: the 6-token models ``SMALL_TARGET`` / ``SMALL_DRAFT``,
  ``small_target_engine``, ``small_block_model`` (a block drafter trained on it),
  ``small_uno_adapter`` (a mask-gated adapter trained on it; ``train_tiny_uno``),
  ``exact_joint`` and ``chi2``.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional, Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specmesh/__init__.py

import pytest  # noqa: E402
import torch  # noqa: E402

from specmesh.engine import LlamaEngine  # noqa: E402
from specmesh.cli.stack import LocalStack  # noqa: E402,F401 - the stack builder, re-exported
from specmesh.types import SamplingParams  # noqa: E402
from specmesh.verifier import EngineVerifier  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- tiny Hugging Face model and engine

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
            tie_word_embeddings=True, rope_theta=10000.0)


def kernel_or_skip(module, what: str):
    """A CPU kernel module's ``load()``, or a skip naming why it cannot run here."""
    k = module.load()
    if k is None:
        pytest.skip(f"the {what} does not run here: {module.load_error()}")
    return k


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n rows of valid random GGUF blocks of type ``name`` (raw bytes)."""
    from specmesh.engine import qmatmul as qm

    tid = qm.TYPE_IDS[name]
    _, qk, rb, _ = qm.TYPES[tid]
    import numpy as np

    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // qk, rb), dtype=np.uint8)

    def halves(at: int, lo: float, hi: float):
        v = rng.uniform(lo, hi, size=(n, k // qk)).astype(np.float16)
        b[..., at: at + 2] = v.view(np.uint8).reshape(n, k // qk, 2)

    if name == "Q6_K":
        halves(208, 0.001, 0.01)
    else:
        halves(0, -0.05, 0.05)
        if name in ("Q4_1", "Q4_K"):
            halves(2, 0.0, 0.05)
    return torch.from_numpy(b.reshape(-1).copy())


def tiny_hf(kind: str = "llama", seed: int = 0):
    """A random-weight Hugging Face model (fp32, eval) and its config dict."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(**TINY, attention_bias=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**{k: v for k, v in TINY.items() if k != "head_dim"})
        model = Qwen2ForCausalLM(cfg)
    # random init is tiny-scaled; make logits non-degenerate
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif p.dim() == 1 and kind != "llama" and p.shape[0] != cfg.hidden_size:
                p.normal_(0, 0.2)  # qkv biases
    return model.eval(), cfg.to_dict()


def tiny_engine(dtype: str = "fp32", n_slots: int = 3, max_seq_len: int = 128, kind: str = "llama", seed: int = 0):
    model, cfg = tiny_hf(kind, seed)
    eng = LlamaEngine(cfg, model.state_dict(), dtype=dtype, n_slots=n_slots, max_seq_len=max_seq_len)
    return eng, model


# ---------------------------------------------------------------- tiny state dict for the gRPC tests

V = 96


def random_llama(seed: int, scale: float, vocab: int, layers: int = 2, hidden: int = 64, heads: int = 4,
                 kv: int = 2, inter: int = 96) -> tuple[dict, dict]:
    """(config, state dict) of a random-weight Llama: normal(0, ``scale``) matrices, unit norms."""
    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads
    r = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    sd = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (heads * hd, hidden), "self_attn.k_proj": (kv * hd, hidden),
                  "self_attn.v_proj": (kv * hd, hidden), "self_attn.o_proj": (hidden, heads * hd),
                  "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
        sd.update({f"{p}{k}.weight": r(*shape) for k, shape in shapes.items()})
        sd.update({f"{p}{k}.weight": torch.ones(hidden) for k in ("input_layernorm", "post_attention_layernorm")})
    cfg = {"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    return cfg, sd


def tiny_weights(seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4, kv: int = 2, inter: int = 96):
    """(config, state dict) of a random Llama with vocabulary ``V``."""
    return random_llama(seed, 0.3, V, layers, hidden, heads, kv, inter)


@functools.cache
def shared_tiny_weights():
    """``tiny_weights()`` built once: the tensors every GatedVerifier and reference share."""
    return tiny_weights()


class GatedVerifier(EngineVerifier):
    """EngineVerifier (shared tiny weights, layer-skip) that can pause inside its ``pause_at``-th verify_batch call."""

    def __init__(self, n_slots: int = 8, max_seq_len: int = 256):
        from specmesh.drafters.model_drafters import LayerSkipDrafter

        w = shared_tiny_weights()
        super().__init__(LlamaEngine(w[0], w[1], n_slots=n_slots, max_seq_len=max_seq_len))
        self.self_drafters["layerskip"] = LayerSkipDrafter(self, exit_layer=1)
        self.calls = 0
        self.pause_at = None
        self.reached, self.resume = threading.Event(), threading.Event()

    def arm(self, at: int) -> None:
        self.pause_at, self.calls = at, 0
        self.reached.clear()
        self.resume.clear()

    def verify_batch(self, reqs, limits=None):
        self.calls += 1
        if self.pause_at is not None and self.calls == self.pause_at:
            self.reached.set()
            self.resume.wait(20)
            self.pause_at = None
        return super().verify_batch(reqs, limits)


def tiny_layerskip_verifier(n_slots: int = 8, max_seq_len: int = 256) -> EngineVerifier:
    """An EngineVerifier over fresh ``tiny_weights()`` with a layer-skip self drafter."""
    from specmesh.drafters.model_drafters import LayerSkipDrafter

    cfg, sd = tiny_weights()
    v = EngineVerifier(LlamaEngine(cfg, sd, n_slots=n_slots, max_seq_len=max_seq_len))
    v.self_drafters["layerskip"] = LayerSkipDrafter(v, exit_layer=1)
    return v


def tiny_specialist_weights(cfg: dict, sd: dict, noise: float = 0.05, seed: int = 1) -> tuple[dict, dict]:
    """A tiny "specialist" of a tiny target: every matrix plus normal(0, ``noise``) (a
    perturbed copy, like a LoRA-tuned one: same vocabulary, close but not equal)."""
    g = torch.Generator().manual_seed(seed)
    return cfg, {k: v + torch.randn(v.shape, generator=g) * noise if v.dim() == 2 else v.clone()
                 for k, v in sd.items()}


def tiny_divergence_verifier(n_slots: int = 8, max_seq_len: int = 256, noise: float = 0.02) -> EngineVerifier:
    """``tiny_layerskip_verifier`` plus a ``specialist`` self drafter (``tiny_specialist_weights``)."""
    from specmesh.drafters.specialist import SpecialistDrafter

    v = tiny_layerskip_verifier(n_slots, max_seq_len)
    cfg, sd = tiny_specialist_weights(*tiny_weights(), noise=noise)
    v.self_drafters["specialist"] = SpecialistDrafter(
        lambda: LlamaEngine(cfg, sd, n_slots=n_slots, max_seq_len=max_seq_len), domain="tiny", vocab_size=V)
    return v


def tiny_block_model(target_sd: dict, vocab: int, seed: int = 0, hidden: int = 64, heads: int = 4,
                     feature_layers=(0, 1), block: int = 4, window: int = 16):
    """A random-weight block drafter over a tiny target's embeddings and head (fp32, eval)."""
    from specmesh.blockdraft.model import BlockDrafterConfig
    from specmesh.blockdraft.train import new_model

    torch.manual_seed(seed)
    cfg = BlockDrafterConfig(block=block, n_layers=1, hidden=hidden, n_heads=heads, ffn=96,
                             feature_layers=list(feature_layers), context_window=window, vocab_size=vocab,
                             n_keep=vocab)
    with torch.no_grad():
        model = new_model(cfg, target_sd, torch.arange(vocab))
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.eval()


class BlockGatedVerifier(GatedVerifier):
    """GatedVerifier with the tiny random block drafter as self drafters ``block`` and ``block_tree``
    (``tiny_block_model`` over the shared tiny weights, fp32)."""

    def __init__(self, n_slots: int = 8, max_seq_len: int = 256):
        from specmesh.blockdraft.serve import BlockSelfDrafter

        super().__init__(n_slots, max_seq_len)
        m = tiny_block_model(shared_tiny_weights()[1], V)
        chain = BlockSelfDrafter(self, m, amp=False)
        self.self_drafters["block"] = chain
        self.self_drafters["block_tree"] = BlockSelfDrafter(self, m, tree=True, amp=False, folded=chain.folded)


def tiny_block_factories(max_sessions: int = 128) -> dict:
    """Drafter-service factories ``block`` / ``block_tree``: ``BlockFeatureDrafter`` over the same
    tiny random block drafter as ``BlockGatedVerifier``'s (fp32), plus prompt lookup."""
    from specmesh.blockdraft.serve import BlockFeatureDrafter
    from specmesh.drafters import PromptLookupDrafter

    made: dict = {}

    def make(tree: bool):
        def build():
            if "chain" not in made:
                made["chain"] = BlockFeatureDrafter(tiny_block_model(shared_tiny_weights()[1], V), amp=False,
                                                    max_sessions=max_sessions)
            return made["chain"].twin(True) if tree else made["chain"]
        return build

    return {"prompt_lookup": PromptLookupDrafter, "block": make(False), "block_tree": make(True)}


# ---------------------------------------------------------------- codecs

class FakeCodec:
    """Characters <-> ids without a tokenizer: id = 2 + ord(c) % (V - 2); id 1 stops."""

    vocab_size = V
    stop_ids = [1]

    def encode(self, prompt=None, messages=None, chat=True):
        text = prompt if messages is None else "".join(m["content"] for m in messages)
        return [2 + ord(c) % (V - 2) for c in text]

    def decode(self, ids):
        return "".join(chr(33 + i % 90) for i in ids if i >= 2)


class _Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [2 + ord(c) % (V - 2) for c in text]


class CharCodec:
    """One token a character over ``V`` ids: id i in [2, V) is chr(30 + i) (space through
    '}': JSON, regexes and grammars can be spelled), id 0 a newline, id 1 stops; other
    characters are dropped. ``grammar_vocab()`` is the vocabulary as the grammar engine
    sees it."""

    vocab_size = V
    stop_ids = [1]

    def encode(self, prompt=None, messages=None, chat=True):
        text = prompt if messages is None else "".join(m["content"] or "" for m in messages)
        return [0 if c == "\n" else ord(c) - 30 for c in text if c == "\n" or 32 <= ord(c) < 30 + V]

    def decode(self, ids):
        return "".join("\n" if i == 0 else chr(30 + i) for i in ids if i != 1)

    def token_bytes(self, i):
        return self.decode([i]).encode()

    @property
    def tokenizer(self):
        """What the reasoning format reads its markers through (``encode(text)``)."""
        codec = self

        class _Chars:
            def encode(self, text, add_special_tokens=False):
                return codec.encode(text)

        return _Chars()

    def grammar_vocab(self):
        from specmesh.grammar import Vocab

        return Vocab.from_bytes([b"\n", b""] + [bytes([30 + i]) for i in range(2, V)], self.stop_ids)


def tiny_grammar_verifier(n_slots: int = 8, max_seq_len: int = 256) -> EngineVerifier:
    """``tiny_layerskip_verifier`` serving grammars over ``CharCodec``'s vocabulary."""
    v = tiny_layerskip_verifier(n_slots, max_seq_len)
    v.set_grammar_vocab(CharCodec().grammar_vocab())
    return v


class TokenizerCodec(FakeCodec):
    """FakeCodec with a ``tokenizer``: the ssr thinking format reads its markers through it."""

    tokenizer = _Tokenizer()


# ---------------------------------------------------------------- settings

GRPC_SETTINGS = dict(max_seq_len=256, n_slots=8, max_new_tokens=64, default_max_new_tokens=16, max_prompt_tokens=128,
                     max_message_bytes=8192, max_tree_nodes=16, batch_window_ms=1.0, workers=8, drain_s=0.0,
                     verifier_retry_s=5.0, drafter_backoff_s=0.2, drafter_backoff_max_s=0.5)
TRACED_SETTINGS = dict(max_seq_len=256, n_slots=8, max_new_tokens=64, default_max_new_tokens=16,
                       max_prompt_tokens=128, max_tree_nodes=16, batch_window_ms=1.0, workers=8, drain_s=0.0,
                       verifier_retry_s=2.0, drafter_backoff_s=0.2, drafter_backoff_max_s=0.5, drafter_timeout_s=1.0)
REAL_N = 32  # the real-model stacks' default_max_new_tokens
REAL_SETTINGS = dict(max_seq_len=1024, n_slots=10, max_new_tokens=256, default_max_new_tokens=REAL_N, workers=24,
                     drain_s=0.0, drafter_backoff_s=0.5, drafter_backoff_max_s=2.0, batch_window_ms=2.0)


def settings(base: Optional[dict] = None, **kw):
    """``load_settings`` of ``base`` (default ``GRPC_SETTINGS``) updated with ``kw``."""
    from specmesh.serving.settings import load_settings

    merged = dict(GRPC_SETTINGS if base is None else base)
    merged.update(kw)
    return load_settings(**merged)


# ---------------------------------------------------------------- gRPC helpers

def code_of(fn) -> tuple:
    """(status code, details) of the grpc.RpcError ``fn()`` raises."""
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def healthy(address: str, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return r.status == health_pb2.HealthCheckResponse.SERVING


def wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- stacks (specmesh.cli.stack.LocalStack)

class TinyStack(LocalStack):
    """``n_verifiers`` verifier services over GatedVerifiers, a drafter service
    (prompt lookup, suffix) and a router with FakeCodec; ``kw`` override
    ``GRPC_SETTINGS`` for all three. Closing releases any paused verifier."""

    def __init__(self, n_verifiers: int = 1, **kw):
        from specmesh.drafters import PromptLookupDrafter, SuffixDrafter

        super().__init__([GatedVerifier] * n_verifiers, FakeCodec(), V, settings=functools.partial(settings, **kw),
                         drafters={"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter})

    def close(self) -> None:
        self.stop_servers()
        for v in self.verifiers:
            v.resume.set()
        self.shutdown()


class BlockStack(LocalStack):
    """``TinyStack``'s shape with the tiny random block drafter in both places: self drafters
    of ``BlockGatedVerifier`` and ``block`` / ``block_tree`` on the drafter service
    (``tiny_block_factories``)."""

    def __init__(self, n_verifiers: int = 1, **kw):
        super().__init__([BlockGatedVerifier] * n_verifiers, FakeCodec(), V,
                         settings=functools.partial(settings, **kw), drafters=tiny_block_factories())

    def close(self) -> None:
        self.stop_servers()
        for v in self.verifiers:
            v.resume.set()
        self.shutdown()


class TracedStack(LocalStack):
    """A LocalStack with metrics on every service (``ports``) and the spans it makes
    exported to memory (``mem``) and to the JSON-lines file ``jsonl_path``; tracing is
    configured before the services are built and switched off on close."""

    def __init__(self, jsonl_path, verifiers, codec, vocab_size=None, **kw):
        from specmesh.observability import tracing

        self.jsonl_path = jsonl_path
        self.provider, self.mem = make_provider(jsonl_path)
        tracing.configure(self.provider)
        super().__init__(verifiers, codec, vocab_size, metrics=True, **kw)

    def close(self) -> None:
        from specmesh.observability import tracing

        super().close()
        tracing.configure(None)
        self.provider.shutdown()


class TinyTracedStack(TracedStack):
    """TracedStack on the tiny model: a layer-skip verifier, the drafters in ``drafters``
    (prompt lookup, suffix, cache, adaptive lookup), TokenizerCodec, ``TRACED_SETTINGS``
    and the router's model named ``tiny-test-model``."""

    def __init__(self, jsonl_path):
        from specmesh.drafters import CacheDrafter, PromptLookupDrafter, SuffixDrafter
        from specmesh.drafters.adaptive_lookup import AdaptiveLookupDrafter

        self.drafters = {"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter, "cache": CacheDrafter,
                         "adaptive_lookup": lambda: AdaptiveLookupDrafter(vocab_size=V)}
        super().__init__(jsonl_path, [tiny_layerskip_verifier], TokenizerCodec(), V,
                         settings=functools.partial(settings, TRACED_SETTINGS), drafters=self.drafters,
                         router_settings={"model": "tiny-test-model"})


class RuntimeStack(LocalStack):
    """The services over one real Runtime (``runtime``, else a new SmolLM2-135M one with
    ``n_slots``), the drafter service with every registered drafter; ``kw`` override
    ``REAL_SETTINGS`` for all three. ``ref`` is in-process plain greedy decoding."""

    def __init__(self, n_slots: int = 10, runtime=None, **kw):
        if runtime is None:
            from specmesh.runtime import Runtime

            runtime = Runtime("smollm2-135m-instruct", n_slots=n_slots, max_seq_len=1024, quiet=True)
        self.rt = runtime
        self.refs: dict = {}
        super().__init__([runtime.verifier], runtime, runtime.vocab_size,
                         settings=functools.partial(settings, REAL_SETTINGS, n_slots=n_slots, **kw))

    def verifier_info(self, i: int = 0, timeout: float = 10):
        return super().verifier_info(i, timeout)

    def ref(self, prompt=None, n: int = REAL_N, messages=None) -> list[int]:
        """In-process plain greedy decoding (no drafter) of the same request."""
        from specmesh.loop import generate_tokens

        key = (prompt, str(messages), n)
        if key not in self.refs:
            ids = self.rt.encode(prompt, messages)
            self.refs[key] = generate_tokens(None, self.rt.verifier, ids, max_new_tokens=n,
                                             stop_ids=self.rt.stop_ids)[0]
        return self.refs[key]


# ---------------------------------------------------------------- observability checks

def make_provider(jsonl_path=None):
    """A TracerProvider with an in-memory exporter (and the JSON-lines one), synchronous export."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from specmesh.observability.jsonl import JsonLinesSpanExporter

    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "specmesh-test"}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    if jsonl_path is not None:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(jsonl_path)))
    return provider, mem


def spans_of(mem) -> list[dict]:
    from specmesh.observability.jsonl import span_to_dict

    return [span_to_dict(s) for s in mem.get_finished_spans()]


def strategy_cases(router, drafters_available) -> list[tuple[str, str]]:
    """(strategy, drafter) for every strategy the router lists, each external drafter the drafter serves."""
    cases = []
    for info in router.strategies():
        name, drafters = info["name"], list(info["drafters"])
        if name == "external":
            cases += [(name, d) for d in drafters if d in drafters_available]
        else:
            cases.append((name, ""))  # the strategy's own default drafter
    return cases


def request_kwargs(strategy: str) -> dict:
    """What a strategy needs beyond the prompt (proactive: a conversation)."""
    return {"conversation_id": "obs-test-conversation"} if strategy == "proactive" else {}


def check_request_tree(spans: list[dict], result, n: int, model: str = "") -> dict:
    """Assert the request -> round -> RPC client -> RPC server shape and attributes; return the request span."""
    by_id = {s["span_id"]: s for s in spans}
    kids = defaultdict(list)
    for s in spans:
        kids[s["parent_id"]].append(s)
    stats = result.stats
    reqs = [s for s in spans if s["name"] == "specmesh.generate"
            and s["attributes"].get("gen_ai.response.id") == result.session_id]
    assert len(reqs) == 1, "one request span per generation"
    req = reqs[0]
    a = req["attributes"]
    parent = by_id.get(req["parent_id"])
    assert parent is not None and parent["name"] == "specmesh.v1.Router/Generate" and parent["kind"] == "SERVER"
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.max_tokens"] == n and a["gen_ai.request.temperature"] == 0.0
    if model:
        assert a["gen_ai.request.model"] == model
    assert a["gen_ai.usage.input_tokens"] == stats.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == stats.new_tokens == len(result.token_ids)
    assert a["gen_ai.response.finish_reasons"] == [stats.finish_reason]
    assert a["specmesh.strategy"] == stats.strategy and a["specmesh.rounds"] == stats.rounds
    assert a["specmesh.accept_hist"] == stats.accept_hist
    assert abs(a["specmesh.tau"] - stats.tau) < 1e-9
    rounds = sorted((c for c in kids[req["span_id"]] if c["name"] == "specmesh.round"),
                    key=lambda s: s["attributes"]["specmesh.round.index"])
    assert [r["attributes"]["specmesh.round.index"] for r in rounds] == list(range(len(rounds)))
    assert rounds[0]["attributes"]["specmesh.round.prefill"], "the first round prefills"
    assert sum(not r["attributes"]["specmesh.round.prefill"] for r in rounds) == stats.rounds
    drafted = accepted = proposes = streams = decoded_rounds = 0
    # drafted in the verifier: a self drafter, or an external request's context-only drafter it runs
    in_verifier = a["specmesh.drafter.site"] == "verifier"
    assert in_verifier == (stats.strategy == "self" or "drafted in the verifier" in stats.strategy_reason)
    for r in rounds:
        ra = r["attributes"]
        for key in ("drafted", "accepted", "tree_size", "draft_ms", "verify_ms", "network_ms", "wall_ms", "depth",
                    "phase", "ceiling", "batch_size"):
            assert f"specmesh.round.{key}" in ra, key
        assert ra["specmesh.strategy"] == stats.strategy
        if not ra["specmesh.round.prefill"]:
            drafted += ra["specmesh.round.drafted"]
            accepted += ra["specmesh.round.accepted"]
        clients = [c for c in kids[r["span_id"]] if c["kind"] == "CLIENT"]
        decoded = ra["specmesh.round.verify_source"] == "decode_stream"  # read from the Decode stream
        assert not decoded or ra["specmesh.round.drafted"] == 0 or in_verifier, \
            "only a round without a draft, or one the verifier drafted, is decoded"
        assert decoded or any(c["name"] == "specmesh.v1.Verifier/Verify" for c in clients), "each round verifies"
        streams += any(c["name"] == "specmesh.v1.Verifier/Decode" for c in clients)
        decoded_rounds += decoded
        for c in clients:
            assert c["trace_id"] == req["trace_id"] and c["attributes"]["rpc.system"] == "grpc"
            servers = [x for x in kids[c["span_id"]] if x["kind"] == "SERVER"]
            assert [x["name"] for x in servers] == [c["name"]], "the server span is the client span's child"
            proposes += c["name"] == "specmesh.v1.Drafter/Propose"
    assert drafted == stats.drafted_tokens and accepted == stats.accepted_tokens
    if stats.strategy == "external" and not in_verifier:
        assert proposes > 0, "external rounds call the drafter service"
    elif stats.strategy in ("autoregressive", "self", "external"):
        assert proposes == 0
    # rounds without a draft may come from a Decode stream opened in a round of the request
    # (plain decoding's do, from its second round)
    assert streams >= 1 if decoded_rounds else streams == 0, (streams, decoded_rounds)
    if stats.strategy == "autoregressive" and stats.rounds > 1:
        assert decoded_rounds >= 1
    return req


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of a scrape (parsing it is part of the test)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(smp: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in smp.items() if n == name and want <= set(ls))


def check_metrics_agree(before: dict, after: dict, results: list, verifier_before=None, verifier_after=None,
                        drafter_before=None, drafter_after=None) -> None:
    """Router counters moved by exactly the per-response stats of ``results``."""
    groups = defaultdict(list)
    for r in results:
        groups[(r.stats.strategy, r.stats.drafter)].append(r.stats)
    d = lambda name, **lab: total(after, name, **lab) - total(before, name, **lab)  # noqa: E731
    for (strategy, drafter), ss in groups.items():
        lab = dict(strategy=strategy, drafter=drafter)
        assert d("specmesh_rounds_total", **lab) == sum(s.rounds for s in ss)
        assert d("specmesh_draft_tokens_total", **lab) == sum(s.drafted_tokens for s in ss)
        assert d("specmesh_accepted_tokens_total", **lab) == sum(s.accepted_tokens for s in ss)
        assert d("specmesh_generated_tokens_total", **lab) == sum(s.new_tokens for s in ss)
        assert d("specmesh_accepted_length_per_round_count", **lab) == sum(s.rounds for s in ss)
        assert d("specmesh_accepted_length_per_round_sum", **lab) == sum(s.accepted_tokens for s in ss)
        hist = [0] * 40
        for s in ss:
            for a, c in enumerate(s.accept_hist):
                hist[a] += c
        cum = 0
        for a in range(0, 33):
            cum += hist[a]
            assert d("specmesh_accepted_length_per_round_bucket", le=f"{float(a)}", **lab) == cum, a
        npos = max((len(s.position_accepted) for s in ss), default=0)
        for k in range(npos):
            acc = sum(s.position_accepted[k] for s in ss if k < len(s.position_accepted))
            dr = sum(s.position_drafted[k] for s in ss if k < len(s.position_drafted))
            assert d("specmesh_accepted_tokens_by_position_total", position=str(k + 1), **lab) == acc
            assert d("specmesh_drafted_positions_total", position=str(k + 1), **lab) == dr
        for phase in ("draft", "verify", "prefill", "network"):
            want = sum(getattr(s, f"{phase}_s") for s in ss)
            got = d("specmesh_phase_seconds_total", phase=phase, **lab)
            assert got == pytest.approx(want, rel=1e-6, abs=1e-9), \
                (phase, lab, got, [getattr(s, f"{phase}_s") for s in ss])
        assert d("specmesh_tokens_per_second_count", **lab) == len(ss)
    if verifier_after is not None:  # one Verify call per target forward (ssr adds side branches off the loop)
        calls = sum(r.stats.target_forwards for r in results)
        dv = total(verifier_after, "specmesh_verify_batch_size_count") - \
            total(verifier_before, "specmesh_verify_batch_size_count")
        side = any(getattr(r.stats, "side_branches", 0) for r in results)
        assert dv >= calls if side else dv == calls
    if drafter_after is not None:
        ext = [r.stats for r in results if r.stats.strategy == "external"  # drafted by the drafter service
               and "drafted in the verifier" not in r.stats.strategy_reason]
        dp = total(drafter_after, "specmesh_drafter_proposed_tokens_total", strategy="external") - \
            total(drafter_before, "specmesh_drafter_proposed_tokens_total", strategy="external")
        assert dp == sum(s.drafted_tokens for s in ext)


def check_rule_spans(spans: list[dict], results: dict, lossy_rule: str) -> None:
    """Each request (``results``: acceptance rule -> its result) has one request span,
    and it and every one of its round spans (the prefill round too) carry the rule and
    the lossy flag, true only for ``lossy_rule``."""
    for acceptance, r in results.items():
        req = [s for s in spans if s["name"] == "specmesh.generate"
               and s["attributes"].get("gen_ai.response.id") == r.session_id]
        assert len(req) == 1
        a = req[0]["attributes"]
        assert a["specmesh.acceptance"] == acceptance and a["specmesh.lossy"] is (acceptance == lossy_rule)
        rounds = [s for s in spans if s["name"] == "specmesh.round" and s["parent_id"] == req[0]["span_id"]]
        assert len(rounds) == r.stats.rounds + 1  # + the prefill round
        for rnd in rounds:
            ra = rnd["attributes"]
            assert ra["specmesh.acceptance"] == acceptance, ra
            assert ra["specmesh.lossy"] is (acceptance == lossy_rule), ra


def spans_done(mem, results) -> bool:
    """Every result's request span and as many Router/Generate server spans as results are exported."""
    names = [(s.name, s.attributes.get("gen_ai.response.id")) for s in mem.get_finished_spans()]
    ids = {sid for n, sid in names if n == "specmesh.generate"}
    gens = sum(n == "specmesh.v1.Router/Generate" for n, _ in names)
    return all(r.session_id in ids for r in results) and gens >= len(results)


# ---------------------------------------------------------------- exact distributions on a 6-token model

SMALL_V = 6
SMALL_PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # repetitive: lookup drafters find matches
SMALL_N_NEW = 3


def small_weights(seed: int, scale: float, layers: int = 2, hidden: int = 32, heads: int = 4, kv: int = 2,
                  inter: int = 48) -> tuple[dict, dict]:
    return random_llama(seed, scale, SMALL_V, layers, hidden, heads, kv, inter)


SMALL_TARGET = small_weights(0, 0.4)
SMALL_DRAFT = small_weights(1, 0.6, layers=1)  # a different, sharper model: q far from p


# the int4 case: shapes every int4 matrix takes (hd 16 for the key-list kernel, inputs a
# multiple of the group of 32); the 6-row head falls back to int8
SMALL_TARGET_INT4 = small_weights(2, 0.4, hidden=64, inter=64)


def small_target_engine(n_slots: int = 4, dtype: str = "fp32") -> LlamaEngine:
    """``SMALL_TARGET`` in fp32; with ``dtype="int4"`` or ``"bf16"``, ``SMALL_TARGET_INT4``
    (shapes our int4 and bf16 kernels take) in that dtype."""
    if dtype in ("int4", "bf16"):
        return LlamaEngine(*SMALL_TARGET_INT4, dtype=dtype, n_slots=n_slots, max_seq_len=64)
    return LlamaEngine(*SMALL_TARGET, n_slots=n_slots, max_seq_len=64)


@functools.cache
def small_block_model(dtype: str = "fp32"):
    """A block drafter for ``small_target_engine(dtype=dtype)`` trained for a few seconds
    on the target's own samples (an untrained one always proposes the same token, which
    the target rarely picks)."""
    from specmesh.blockdraft.model import BlockDrafterConfig
    from specmesh.blockdraft.train import new_model, prepare, train
    from specmesh.loop import generate_tokens

    eng = small_target_engine(1, dtype)
    records = []
    for s in range(24):
        prompt = SMALL_PROMPT[s % 4:]
        out, _ = generate_tokens(None, EngineVerifier(small_target_engine(1, dtype)), prompt,
                                 sampling=SamplingParams(temperature=1.0, seed=500 + s), max_new_tokens=12)
        records.append({"prompt_ids": prompt, "response_ids": out})
    torch.manual_seed(5)
    wide = dtype in ("int4", "bf16")  # the drafter's matrices on the engine's kernels too (inputs a multiple of 32)
    cfg = BlockDrafterConfig(block=4, n_layers=1, hidden=64 if wide else 32, n_heads=4, ffn=64 if wide else 48,
                             feature_layers=[0, 1], context_window=16, vocab_size=SMALL_V, n_keep=SMALL_V)
    model = new_model(cfg, (SMALL_TARGET_INT4 if wide else SMALL_TARGET)[1], torch.arange(SMALL_V))
    train(model, prepare(eng, records, cfg.feature_layers, quiet=True), steps=80, lr=3e-3, batch=4,
          anchors_per_seq=8, quiet=True)
    return model.eval()


def train_tiny_uno(config: dict, state_dict: dict, records: list[dict], block: int = 3, steps: int = 60,
                   rank: int = 8, readout: int = 32, seed: int = 5):
    """A mask-gated adapter (specmesh.uno) trained for a few seconds on ``records``
    (``prompt_ids`` + ``response_ids``: the target's own outputs)."""
    from specmesh.uno.adapter import new_adapter
    from specmesh.uno.trainer import FrozenTarget, sequences, train

    tgt = FrozenTarget(config, state_dict, max_len=256)
    ad = new_adapter(config, rank=rank, readout=readout, block=block, embed=tgt.embed, seed=seed)
    train(tgt, ad, sequences(records), steps=steps, M=block, seqs_per_step=4, anchors_per_seq=8, lr=3e-3,
          quiet=True, seed=seed)
    return ad


@functools.cache
def small_uno_adapter():
    """A mask-gated adapter for ``SMALL_TARGET`` trained on the target's own samples."""
    from specmesh.loop import generate_tokens

    records = []
    for s in range(24):
        prompt = SMALL_PROMPT[s % 4:]
        out, _ = generate_tokens(None, EngineVerifier(small_target_engine(1)), prompt,
                                 sampling=SamplingParams(temperature=1.0, seed=700 + s), max_new_tokens=12)
        records.append({"prompt_ids": prompt, "response_ids": out})
    return train_tiny_uno(*SMALL_TARGET, records, block=3, steps=60, rank=4, readout=16)


def exact_joint(prompt: Sequence[int], slots: Sequence[Optional[int]], sampling: SamplingParams,
                dtype: str = "fp32") -> dict:
    """P(sampled tokens) of plain sampling on ``small_target_engine(dtype=dtype)``: ``slots``
    lists the new positions, None = sampled from the target, an int = a token the
    procedure forces there."""
    import itertools

    from specmesh import acceptance as acc

    eng = small_target_engine(1, dtype)
    cache: dict[tuple, torch.Tensor] = {}

    def dist(prefix: tuple) -> torch.Tensor:
        if prefix not in cache:
            eng.reset(0)
            cache[prefix] = acc.target_probs(eng.prefill(0, list(prompt) + list(prefix))[None], sampling)[0].double()
        return cache[prefix]

    out: dict[tuple, float] = {}
    free = [i for i, s in enumerate(slots) if s is None]
    for combo in itertools.product(range(SMALL_V), repeat=len(free)):
        seq, prob, it = [], 1.0, iter(combo)
        for s in slots:
            if s is None:
                x = next(it)
                prob *= float(dist(tuple(seq))[x])
                seq.append(x)
            else:
                seq.append(s)
        if prob > 0:
            out[tuple(combo)] = prob
    return out


def chi2(counts: Counter, probs: dict) -> float:
    """p-value of the observed counts against ``probs`` (bins with expected count < 5
    merged into one); an observed outcome of probability 0 fails outright."""
    from scipy import stats as sstats

    n = sum(counts.values())
    impossible = [k for k in counts if k not in probs]
    assert not impossible, f"sampled outcomes the target cannot produce: {impossible[:5]}"
    big = [k for k, p in probs.items() if p * n >= 5]
    small = [k for k in probs if k not in big]
    obs = [counts[k] for k in big]
    exp = [probs[k] * n for k in big]
    rest = sum(probs[k] for k in small) * n
    if small:
        obs.append(sum(counts[k] for k in small))
        exp.append(rest)
    total = sum(exp)
    exp = [e * n / total for e in exp]  # float rounding of the enumeration
    return float(sstats.chisquare(obs, exp).pvalue)


class ToyChain:
    """A toy target and a different draft over ``vocab`` tokens whose next-token
    distributions depend only on the previous token (row ``vocab`` = the start):
    the acceptance rules' exact laws are computed from ``P`` and ``Q`` by hand."""

    def __init__(self, seed: int, vocab: int = 5, scale: float = 1.5):
        g = torch.Generator().manual_seed(seed)
        self.V = vocab
        self.P = torch.softmax(torch.randn(vocab + 1, vocab, generator=g) * scale, -1)
        self.Q = torch.softmax(torch.randn(vocab + 1, vocab, generator=g) * scale, -1)

    def p_next(self, ctx):
        return self.P[ctx[-1] if ctx else self.V]

    def q_next(self, ctx):
        return self.Q[ctx[-1] if ctx else self.V]

    @staticmethod
    def draw(dist, gen) -> int:
        return int(torch.multinomial(dist, 1, generator=gen)[0])

    def pair_counts(self, round_fn, n: int, seed: int) -> torch.Tensor:
        """[V, V] counts of the first two generated tokens over ``n`` generations, each
        built from rounds ``round_fn(ctx, gen) -> new tokens``."""
        gen = torch.Generator().manual_seed(seed)
        counts = torch.zeros(self.V, self.V)
        for _ in range(n):
            out: list[int] = []
            while len(out) < 2:
                out += round_fn(out, gen)
            counts[out[0], out[1]] += 1
        return counts

    def expected_pairs(self, n: int) -> torch.Tensor:
        """What ``pair_counts`` should be under the target's own law: n P(x | start) P(y | x)."""
        return n * self.P[self.V][:, None] * self.P[: self.V]


# ---------------------------------------------------------------- the real `specmesh serve`

class ServeProcess:
    """``specmesh serve`` (router, drafter, verifier and the OpenAI front as supervised
    processes) on free ports, started with ``extra`` flags; waits (up to ``timeout``)
    until it printed its addresses. ``log`` collects its output; ``pid(service)`` is the
    service's current process, ``kill(service)`` SIGKILLs it, ``back(service, n)`` waits
    until the supervisor has brought it back ``n`` times; ``stop()`` sends SIGTERM and
    returns the exit code."""

    def __init__(self, *extra: str, timeout: float = 300.0):
        import re
        import subprocess
        import sys

        self.ports = {k: free_port() for k in ("router", "drafter", "verifier", "sup")}
        cmd = [sys.executable, "-m", "specmesh.cli", "serve", "--router-port", str(self.ports["router"]),
               "--drafter-port", str(self.ports["drafter"]), "--verifier-port", str(self.ports["verifier"]),
               "--router-metrics-port", "0", "--drafter-metrics-port", "0", "--verifier-metrics-port", "0",
               "--supervisor-metrics-port", str(self.ports["sup"]), "--restart-backoff-s", "0.2",
               "--http-port", "0", *extra]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        self.address = f"127.0.0.1:{self.ports['router']}"
        assert wait_for(lambda: any(x.startswith("try: specmesh generate") for x in self.log), timeout), self.text()
        urls = [m.group(1) for x in self.log for m in [re.match(r"openai +(http\S+/v1)", x)] if m]
        self.openai_url = urls[0] if urls else None

    def text(self) -> str:
        return "".join(self.log)

    def pid(self, service: str) -> int:
        import re

        pids = [int(m.group(1)) for x in list(self.log) for m in [re.search(rf"started {service} \(pid (\d+)\)", x)]
                if m]
        return pids[-1]

    def kill(self, service: str) -> int:
        import signal

        pid = self.pid(service)
        os.kill(pid, signal.SIGKILL)
        return pid

    def back(self, service: str, times: int = 1, timeout: float = 300.0) -> bool:
        return wait_for(lambda: self.text().count(f"{service} is back") >= times, timeout)

    def stop(self, timeout: float = 60.0) -> int:
        import signal
        import subprocess

        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout)
