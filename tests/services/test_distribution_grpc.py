"""Sampled speculation through the real gRPC services follows the target distribution.

A router, a drafter service and a verifier service on loopback (real gRPC
servers, the tiny 6-token model of ``tests/support.py`` that
``tests/unit/test_distribution.py`` uses); one strategy per kind
of drafting — an external drafter that samples (draft LM, sparse q on the wire),
the trained block drafter on the drafter service (the target's hidden features
sent through the router with every round, sparse q back: its tree), in-verifier
self drafters (the mask-gated adapter's fused rounds, tree; layer-skip, whose rounds
after the first the verifier drafts on the Decode stream), the conversation cache
(proactive) and ``auto`` — each run for thousands of seeds and compared with the
exact joint distribution of plain sampling by a chi-square test. Deterministic
seeds. Every drafter's own rules (the block chain, layer-skip, ...) are tested the
same way in the loop (``tests/unit/test_distribution.py``); this file tests the
paths through the services, one case per path (kept to six for CI's time).
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import grpc
import pytest

from specmesh.blockdraft.serve import BlockFeatureDrafter
from specmesh.drafters import CacheDrafter, PromptLookupDrafter, SuffixDrafter
from specmesh.drafters.model_drafters import DraftLMDrafter, LayerSkipDrafter
from specmesh.engine import LlamaEngine
from specmesh.wire import convert
from specmesh.serving.settings import load_settings
from specmesh.strategies.proactive import cache_id
from specmesh.types import SamplingParams
from specmesh.uno.serve import UnoDrafter
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, router_pb2
from specmesh.verifier import EngineVerifier, Partial
from tests.support import SMALL_DRAFT as DRAFT
from tests.support import SMALL_N_NEW as N_NEW
from tests.support import SMALL_PROMPT as PROMPT
from tests.support import SMALL_TARGET as TARGET
from tests.support import SMALL_V as V
from tests.support import LocalStack, chi2, exact_joint, small_block_model, small_uno_adapter

pytestmark = pytest.mark.slow  # thousands of requests through three servers
N = 2000
ALPHA = 1e-3


class DigitCodec:
    """Prompt text of digits <-> token ids (the tiny model has 6 tokens); no stop ids."""

    vocab_size = V
    stop_ids: list[int] = []

    def encode(self, prompt=None, messages=None, chat=True):
        text = prompt if messages is None else "".join(m["content"] for m in messages)
        return [int(c) % V for c in text if c.isdigit()]

    def decode(self, ids):
        return "".join(str(i) for i in ids)


class CountingVerifier(EngineVerifier):
    """Counts the draft nodes it verifies and accepts (every round, the prefill's included)."""

    drafted = accepted = 0
    settle = None  # called with each verified session id before the answer goes back (draft-ahead cases)

    def verify_batch(self, reqs, limits=None):
        out = super().verify_batch(reqs, limits)
        if self.settle is not None:
            for r in reqs:
                self.settle(r.session_id)
        for r in out:
            if not isinstance(r, (BaseException, Partial)):
                self.drafted += r.drafted
                self.accepted += len(r.accepted)
        return out


class Services(LocalStack):
    """The stack over a CountingVerifier (with layer-skip) on the 6-token target, a drafter
    service with prompt lookup, suffix, cache and the draft LM, and DigitCodec."""

    def __init__(self, **extra):
        base = dict(max_seq_len=64, n_slots=8, max_new_tokens=16, default_max_new_tokens=4, max_prompt_tokens=32,
                    max_message_bytes=8192, max_tree_nodes=8, batch_window_ms=0.5, workers=8, drain_s=0.0,
                    verifier_retry_s=5.0, draft_budget=2, **extra)

        def counting_verifier():
            v = CountingVerifier(LlamaEngine(*TARGET, n_slots=8, max_seq_len=64))
            v.self_drafters["layerskip"] = LayerSkipDrafter(v, exit_layer=1, top_k=V)
            v.self_drafters["uno"] = UnoDrafter(v, small_uno_adapter(), top_k=V)  # fused: one forward a round
            v.self_drafters["uno_tree"] = v.self_drafters["uno"].twin(tree=True)
            return v

        block = {}

        def block_drafter(tree: bool):  # the trained tiny block drafter on the drafter service, fed features
            def build():
                if "chain" not in block:
                    block["chain"] = BlockFeatureDrafter(small_block_model(), amp=False, top_k=V)
                return block["chain"].twin(True) if tree else block["chain"]
            return build

        factories = {"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter, "cache": CacheDrafter,
                     "draft_lm": lambda: DraftLMDrafter(LlamaEngine(*DRAFT, n_slots=8, max_seq_len=64), top_k=V),
                     "block": block_drafter(False), "block_tree": block_drafter(True)}
        super().__init__([counting_verifier], DigitCodec(), V, settings=partial(load_settings, **base),
                         drafters=factories)

    def seed_cache(self, conversation: str, texts: list[list[int]]) -> None:
        with grpc.insecure_channel(self.dserver.address) as ch:
            drafter_pb2_grpc.DrafterStub(ch).Seed(drafter_pb2.SeedRequest(
                cache_id=cache_id(conversation), texts=[drafter_pb2.TokenList(tokens=t) for t in texts]), timeout=10)

    def generate(self, sampling: SamplingParams, **kw) -> tuple[list[int], router_pb2.GenerateFinal]:
        req = router_pb2.GenerateRequest(prompt="".join(map(str, PROMPT)), raw_prompt=True, max_new_tokens=N_NEW,
                                         sampling=convert.sampling_to_proto(sampling), **kw)
        final = None
        for msg in self.stub.Generate(req, timeout=30):
            if msg.HasField("final"):
                final = msg.final
        return list(final.token_ids), final


@pytest.fixture(scope="module")
def services():
    s = Services()
    yield s
    s.close()


CASES = [  # (strategy, drafter, sampling)
    ("external", "draft_lm", SamplingParams(temperature=1.0)),
    ("proactive", "", SamplingParams(temperature=1.3, top_p=0.8)),
    ("auto", "", SamplingParams(temperature=1.0)),
    ("external", "block_tree", SamplingParams(temperature=0.7, top_k=3)),  # hidden features over the wire, sparse q back
    ("self", "uno_tree", SamplingParams(temperature=1.3, top_p=0.8)),  # drafts from the last forward's masks
    ("self", "layerskip", SamplingParams(temperature=1.0)),  # a draft pass in the verifier: rounds on Decode streams
    ("external", "suffix", SamplingParams(temperature=1.0, top_k=4)),  # run in the verifier: rounds on Decode streams
]


@pytest.mark.parametrize("strategy,drafter,sampling", CASES, ids=[f"{c[0]}-{c[1] or 'default'}" for c in CASES])
def test_sampled_output_through_the_services_matches_the_exact_distribution(services, strategy, drafter, sampling):
    kw = dict(strategy=strategy, drafter=drafter)
    if strategy == "proactive":  # anticipated continuations, sampled by the target with other seeds
        texts = []
        for s in range(6):
            out, _ = services.generate(SamplingParams(temperature=1.0, seed=90_000 + s), strategy="autoregressive")
            texts.append(PROMPT[-3:] + out)
        services.seed_cache("conv-1", texts)
        kw["conversation_id"] = "conv-1"
    counts: Counter = Counter()
    v = services.verifier
    drafted0, accepted0 = v.drafted, v.accepted
    for seed in range(N):
        sp = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=seed)
        out, final = services.generate(sp, **kw)
        assert len(out) == N_NEW
        counts[tuple(out)] += 1
        assert not final.stats.lossy
        if drafter in ("suffix", "prompt_lookup"):  # the verifier drafts it (router setting context_drafters)
            assert "drafted in the verifier" in final.stats.strategy_reason
    drafted, accepted = v.drafted - drafted0, v.accepted - accepted0
    assert drafted > N // 2 and 0 < accepted < drafted, (strategy, drafted, accepted)
    p = chi2(counts, exact_joint(PROMPT, [None] * N_NEW, sampling))
    assert p > ALPHA, f"{strategy}:{drafter}: chi-square p = {p:.2e}"


def test_verifier_service_refuses_unlabelled_sampled_siblings(services):
    """Siblings carrying q must say how they were drawn: INVALID_ARGUMENT naming
    tree.siblings, and the session is not created; labelled, the same tree verifies."""
    from specmesh.types import SIBLINGS_WOR, TokenTree, VerifyRequest
    from specmesh.v1 import verifier_pb2_grpc

    q = ([1, 2, 3], [0.5, 0.3, 0.2])
    tree = TokenTree([1, 2], [-1, -1], [q[0], q[0]], [q[1], q[1]])
    req = VerifyRequest("sib-1", 0, list(PROMPT), tree, SamplingParams(temperature=1.0, seed=1), 7)
    with grpc.insecure_channel(services.vserver.address) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(convert.verify_request_to_proto(req), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree.siblings" in e.value.details()
        assert services.verifier.slot_of("sib-1") is None  # no state changed
        tree.siblings = SIBLINGS_WOR
        res = stub.Verify(convert.verify_request_to_proto(req), timeout=10)
        assert res.cache_len >= len(PROMPT)
        services.verifier.release("sib-1")


# ---------------------------------------------------------------- draft-ahead through the services

@pytest.fixture(scope="module")
def ahead_services():
    """The same stack with the router drafting ahead (ProposeAhead before every Verify) and
    the drafter service fanning out over every outcome (width = the vocabulary); each Verify
    answers only once the drafter's ahead work for its session is done, so the next round
    comes from the ahead cache wherever an outcome matched (forced, not timed)."""
    s = Services(draft_ahead="on", draft_ahead_width=V, draft_ahead_outcomes=64)

    def settle(sid):
        ahead = s.host._ahead.get("draft_lm")
        if ahead is not None:
            assert ahead.settle(sid, 60)

    s.verifier.settle = settle
    yield s
    s.close()


def test_sampled_output_with_draft_ahead_through_the_services_matches_the_exact_distribution(ahead_services):
    sampling = SamplingParams(temperature=1.0)
    counts: Counter = Counter()
    v = ahead_services.verifier
    drafted0, accepted0 = v.drafted, v.accepted
    for seed in range(N):
        sp = SamplingParams(temperature=sampling.temperature, seed=seed)
        out, final = ahead_services.generate(sp, strategy="external", drafter="draft_lm")
        assert len(out) == N_NEW
        counts[tuple(out)] += 1
    drafted, accepted = v.drafted - drafted0, v.accepted - accepted0
    assert drafted > N // 2 and 0 < accepted < drafted, (drafted, accepted)
    ahead = ahead_services.host._ahead["draft_lm"]
    assert ahead.hits > N // 10, (ahead.hits, ahead.misses)  # the drafted-ahead rounds were used
    p = chi2(counts, exact_joint(PROMPT, [None] * N_NEW, sampling))
    assert p > ALPHA, f"external:draft_lm with draft-ahead: chi-square p = {p:.2e}"
