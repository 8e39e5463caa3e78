"""The verifier's prefix cache (specmesh.prefix_reuse, EngineVerifier): identical output with
the cache on and off for every kind of drafter that reads the context, chunked prefill
steps equal one forward, a budget too small is refused, eviction changes no output."""

from __future__ import annotations

import random

import pytest
import torch

from specmesh.engine import LlamaEngine
from specmesh.loop import generate_tokens
from specmesh.prefix_reuse import MiB, min_budget
from specmesh.types import InvalidArgument, SamplingParams, TokenTree, VerifyRequest
from specmesh.verifier import EngineVerifier, Partial
from support import V, shared_tiny_weights, tiny_block_model

INVARIANT = ["bf16", "int8", "int4"]  # row-invariant dtypes on the CPU (fp32 runs the ragged forward: not)


def verifier(dtype: str, cache: bool, budget: int = 8 * MiB, block: int = 4, drafters: tuple = ()) -> EngineVerifier:
    """A verifier over the shared tiny weights with the self drafters named in ``drafters``."""
    cfg, sd = shared_tiny_weights()
    v = EngineVerifier(LlamaEngine(cfg, sd, dtype=dtype, n_slots=4, max_seq_len=256), prefix_cache=cache,
                       prefix_cache_bytes=budget, prefix_block=block)
    if "layerskip" in drafters:
        from specmesh.drafters.model_drafters import LayerSkipDrafter

        v.self_drafters["layerskip"] = LayerSkipDrafter(v, exit_layer=1)
    if "block" in drafters or "block_tree" in drafters:
        from specmesh.blockdraft.serve import BlockSelfDrafter

        m = tiny_block_model(sd, V)
        chain = BlockSelfDrafter(v, m, amp=False)
        v.self_drafters["block"] = chain
        v.self_drafters["block_tree"] = BlockSelfDrafter(v, m, tree=True, amp=False, folded=chain.folded)
    if "uno" in drafters:
        from specmesh.uno.adapter import new_adapter
        from specmesh.uno.serve import UnoDrafter

        ad = new_adapter(cfg, rank=4, readout=16, block=3, seed=3)
        g = torch.Generator().manual_seed(4)
        for d in ad.B:
            for p in d:
                d[p] = torch.randn(d[p].shape, generator=g) * 0.05
        v.self_drafters["uno"] = UnoDrafter(v, ad)
    if "prompt_lookup" in drafters:
        from specmesh.drafters import make_drafter

        v.host_context_drafters({"prompt_lookup": make_drafter("prompt_lookup"), "suffix": make_drafter("suffix")})
    return v


def conversation(seed: int = 0, turns: int = 5, system: int = 37) -> list[list[int]]:
    """Prompts of a chat: a shared system prompt, then each turn's user tokens (the
    answers are appended by the caller)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, V) for _ in range(system)]] + [[rng.randrange(2, V) for _ in range(5 + t)]
                                                          for t in range(turns)]


def chat(v: EngineVerifier, parts: list[list[int]], n: int = 10, **kw) -> list[list[int]]:
    """Each turn's output; the next turn's prompt is the history + the answer + its user tokens."""
    hist, outs = list(parts[0]), []
    for user in parts[1:]:
        hist += user
        out, _ = generate_tokens(None, v, hist, max_new_tokens=n, **kw)
        outs.append(out)
        hist += out
    return outs


@pytest.mark.parametrize("dtype", INVARIANT)
@pytest.mark.parametrize("strategy", ["plain", "layerskip", "block", "block_tree", "uno", "prompt_lookup",
                                      "suffix"])
def test_greedy_output_is_the_same_with_the_cache_on_and_off(dtype, strategy):
    """Every drafter that reads the context (the KV, hidden features kept beside it, the
    session's tokens) drafts on a cached prefix as on a computed one; the output is the
    plain decoding's either way."""
    drafters = (strategy,) if strategy not in ("plain", "suffix") else ("prompt_lookup",) if strategy == "suffix" \
        else ()
    kw = {} if strategy == "plain" else {"self_draft": strategy, "budget": 4}
    on, off = verifier(dtype, True, drafters=drafters), verifier(dtype, False, drafters=drafters)
    parts = conversation(1)
    plain = chat(verifier(dtype, False), parts)
    assert chat(on, parts, **kw) == plain
    assert chat(off, parts, **kw) == plain
    info = on.info()
    assert info["prefix_cache_hits"] > 0 and info["prefix_cache_queries"] > info["prefix_cache_hits"]
    assert "prefix_cache_hits" not in off.info() and off.info()["prefix_cache"] is False


@pytest.mark.parametrize("strategy", ["plain", "layerskip"])
def test_seeded_sampled_output_is_the_same_with_the_cache_on_and_off(strategy):
    kw = {} if strategy == "plain" else {"self_draft": strategy, "budget": 3}
    s = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    d = ("layerskip",) if strategy == "layerskip" else ()
    parts = conversation(2)
    a = chat(verifier("bf16", True, drafters=d), parts, sampling=s, **kw)
    assert a == chat(verifier("bf16", False, drafters=d), parts, sampling=s, **kw)


def test_a_cached_prefix_gives_the_logits_kv_and_features_a_prefill_computes():
    """A new session whose prompt starts with a cached prefix holds, after its first
    verify, bit for bit the KV and hidden features of one computed from scratch."""
    on, off = verifier("bf16", True), verifier("bf16", False)
    for v in (on, off):
        v.enable_features([0, 1])
    rng = random.Random(3)
    system = [rng.randrange(V) for _ in range(29)]
    generate_tokens(None, on, system + [5, 6, 7], max_new_tokens=4)  # caches the system prompt's blocks
    prompt = system + [9, 9, 8]
    got = on.verify(VerifyRequest("s", 0, prompt, feature_layers=(0, 1)))
    want = off.verify(VerifyRequest("s", 0, prompt, feature_layers=(0, 1)))
    assert got.cached_tokens == 28 and want.cached_tokens == 0  # 7 blocks of 4: all but the last token at most
    assert (got.next_token, got.cache_len) == (want.next_token, want.cache_len)
    assert got.features.data == want.features.data and got.features.start == 0
    a, b = on.slot_of("s"), off.slot_of("s")
    n = len(prompt)
    assert torch.equal(on.engine.k_cache[:, a, :, :n], off.engine.k_cache[:, b, :, :n])
    assert torch.equal(on.engine.v_cache[:, a, :, :n], off.engine.v_cache[:, b, :, :n])


def test_chunked_prefill_steps_equal_one_forward():
    """``limits`` cut a prompt's prefill into steps (``Partial``) whose rest continues it:
    the same token, cache length, features and KV as one forward, and the steps' blocks
    are reusable by the next session."""
    on, ref = verifier("bf16", True), verifier("bf16", False)
    for v in (on, ref):
        v.enable_features([1])
    prompt = [random.Random(5).randrange(V) for _ in range(61)]
    req = VerifyRequest("s", 0, prompt, TokenTree(), SamplingParams(), 0, feature_layers=(1,))
    steps, res = [], req
    while True:
        out = on.verify_batch([res], limits=[16])[0]
        if not isinstance(out, Partial):
            break
        steps.append(out.cache_len)
        assert on.slot_of("s") in on.pool.slots.values() and "s" in on.pool.pinned  # never evicted mid-prefill
        res = out.rest
    assert steps == [16, 32, 48] and res.first_keep_len == 0 and res.keep_len == 48
    want = ref.verify(req)
    assert (out.next_token, out.cache_len) == (want.next_token, want.cache_len) == (want.next_token, 61)
    assert out.features.start == 0 and out.features.data == want.features.data
    assert "s" not in on.pool.pinned
    assert on.history["s"] == [61, prompt]
    again = on.verify(VerifyRequest("t", 0, prompt))
    assert again.cached_tokens == 60 and again.next_token == want.next_token


def test_limits_leave_short_requests_whole_and_never_cut_below_one_token():
    v = verifier("bf16", True)
    out = v.verify_batch([VerifyRequest("a", 0, [3, 4, 5]), VerifyRequest("b", 0, list(range(2, 30)))],
                         limits=[5, 0])
    assert not isinstance(out[0], Partial)
    assert isinstance(out[1], Partial) and out[1].cache_len == 1


@pytest.mark.parametrize("dtype", INVARIANT)
def test_eviction_under_a_small_budget_changes_no_output(dtype):
    """The budget holds one sequence: conversations evict each other's blocks all the
    time, and every output equals the one without a cache."""
    cfg, sd = shared_tiny_weights()
    eng = LlamaEngine(cfg, sd, dtype=dtype, n_slots=4, max_seq_len=256)
    small = EngineVerifier(eng, prefix_cache_bytes=min_budget(eng, 4), prefix_block=4)
    off = verifier(dtype, False)
    for seed in range(6):
        parts = conversation(10 + seed % 3, turns=4, system=60)  # three conversations, revisited
        assert chat(small, parts, n=8) == chat(off, parts, n=8)
    info = small.info()
    assert info["prefix_cache_evictions"] > 0 and info["prefix_cache_hits"] > 0
    assert info["prefix_cache_bytes"] <= info["prefix_cache_budget_bytes"]


def test_a_budget_too_small_for_one_sequence_is_refused():
    cfg, sd = shared_tiny_weights()
    eng = LlamaEngine(cfg, sd, dtype="bf16", n_slots=2, max_seq_len=256)
    need = min_budget(eng, 16)
    with pytest.raises(InvalidArgument, match="prefix_cache_mib.*256 tokens"):
        EngineVerifier(eng, prefix_cache_bytes=need - 1)
    v = EngineVerifier(eng, prefix_cache_bytes=need)
    with pytest.raises(InvalidArgument, match="prefix_cache_mib"):
        v.configure_prefix_cache(True, need // 2)
    assert v.prefix is not None and v.prefix.budget == need  # unchanged
    v.configure_prefix_cache(False)
    assert v.prefix is None and v.info()["prefix_cache"] is False


def test_sessions_hold_their_blocks_until_they_end():
    """A live session's blocks are referenced (not evictable); release, eviction from the
    pool and a restart let go of them; a fork shares its source's."""
    v = verifier("bf16", True)
    prompt = list(range(2, 40))
    v.prefill("a", prompt)
    assert v.info()["prefix_cache_blocks_held"] == 9  # 38 tokens committed: 9 full blocks of 4
    v.fork("a", "b", 20)
    assert v.prefix.index.holds("b") == 20
    v.release("a")
    assert v.info()["prefix_cache_blocks_held"] == 5
    v.release("b")
    assert v.info()["prefix_cache_blocks_held"] == 0 and v.info()["prefix_cache_blocks"] == 9
    for k in range(5):  # 4 slots: the fifth session evicts the first
        v.prefill(f"s{k}", prompt + [k])
    assert v.pool.evictions == 1 and "s0" not in v.prefix.index.sessions
