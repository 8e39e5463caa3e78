"""Chunked prefill in the verifier's batcher (verifier_service.batcher): a long prompt runs
in steps between the running streams' rounds, streams first, within the token budget;
every answer equals the unchunked one."""

from __future__ import annotations

import random
import threading
from concurrent.futures import CancelledError

import pytest

from specmesh.engine import LlamaEngine
from specmesh.types import SamplingParams, TokenTree, VerifyRequest
from specmesh.verifier import EngineVerifier
from specmesh.verifier_service.batcher import MIN_CHUNK, VerifyBatcher
from support import V, shared_tiny_weights


class Recording(EngineVerifier):
    """Keeps each forward's (session ids, limits, prefill tokens each request computed)."""

    def __init__(self, **kw):
        cfg, sd = shared_tiny_weights()
        super().__init__(LlamaEngine(cfg, sd, dtype="bf16", n_slots=12, max_seq_len=256), **kw)
        self.log = []
        self.gate = threading.Event()
        self.gate.set()

    def verify_batch(self, reqs, limits=None):
        self.gate.wait(20)
        needs = [self.prefill_need(r) for r in reqs]
        out = super().verify_batch(reqs, limits)
        done = [o.cache_len - r.keep_len if hasattr(o, "rest") else n for r, o, n in zip(reqs, out, needs)]
        self.log.append(([r.session_id for r in reqs], list(limits) if limits else None, done))
        return out


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, V) for _ in range(n)]


def test_a_long_prompt_runs_in_chunks_and_equals_one_forward():
    v, ref = Recording(prefix_cache=False), Recording(prefix_cache=False)
    b = VerifyBatcher(v, window_ms=1, prefill_chunk=32)
    try:
        prompt = _prompt(1, 150)
        req = VerifyRequest("s", 0, prompt, TokenTree(), SamplingParams(), 0)
        got, want = b.verify(req, timeout=60), ref.verify(req)
        assert (got.next_token, got.cache_len) == (want.next_token, want.cache_len)
        assert [d for _, _, d in v.log] == [[32], [32], [32], [32], [21]]  # 149 tokens before the scored one
        assert b.prefill_steps == 4 and v.pool.pinned == set()
        # the session goes on as any other
        nxt = VerifyRequest("s", got.cache_len, [got.next_token], TokenTree(), SamplingParams(), 0)
        assert b.verify(nxt, timeout=60).next_token == ref.verify(nxt).next_token
    finally:
        b.stop()


def test_streams_are_served_in_every_forward_while_a_prompt_is_prefilled():
    """Four sessions decode while a long prompt arrives: every forward that runs one of
    the prompt's steps also runs every stream that was waiting, and no step computes
    more than the budget."""
    v = Recording()
    b = VerifyBatcher(v, window_ms=20, max_batch=4, prefill_chunk=24, stall_ratio=0)
    state = {}
    try:
        for k in range(4):
            r = b.verify(VerifyRequest(f"d{k}", 0, _prompt(10 + k, 8)), timeout=60)
            state[f"d{k}"] = (r.cache_len, r.next_token)
        v.log.clear()

        def decode(sid: str, steps: int) -> None:
            kv, tok = state[sid]
            for _ in range(steps):
                r = b.verify(VerifyRequest(sid, kv, [tok]), timeout=60)
                kv, tok = r.cache_len, r.next_token

        threads = [threading.Thread(target=decode, args=(f"d{k}", 12)) for k in range(4)]
        v.gate.clear()  # the streams' first requests and the prompt queue up together
        for t in threads:
            t.start()
        long = b.submit(VerifyRequest("p", 0, _prompt(3, 120)))
        v.gate.set()
        res = long.result(60)
        for t in threads:
            t.join(60)
        assert res.cache_len == 120
        steps = [(sids, d) for sids, lim, d in v.log if "p" in sids]
        assert len(steps) == 5  # 119 tokens in steps of at most 24
        for sids, done in steps:
            assert done[sids.index("p")] <= 24
        during = [sids for sids, _ in steps[:-1]]
        assert sum(len(s) - 1 for s in during) >= 3 * len(during)  # the streams ran beside every step
    finally:
        b.stop()


def test_the_budget_keeps_a_forward_within_the_stall_ratio():
    v = Recording()
    b = VerifyBatcher(v, prefill_chunk=256, stall_ratio=2.0)
    streams = [type("J", (), {"req": VerifyRequest(f"s{k}", 5, [1])})() for k in range(8)]
    try:
        assert b._budget([]) == 256  # nothing running: the chunk
        assert {b._budget(streams), b._budget(streams)} == {MIN_CHUNK, 2 * MIN_CHUNK}  # no cost line yet: two sizes
        for rows, t in [(8, 0.018), (24, 0.034), (8, 0.018), (40, 0.050)] * 3:  # t = 0.010 + 0.001 rows
            b.costs.observe(rows, t)
        assert b._budget(streams) == 18  # (2 - 1) * (10 ms + 8 rows * 1 ms) / 1 ms
        b.stall_ratio = 3.0
        assert b._budget(streams) == 36
        b.stall_ratio = 0
        assert b._budget(streams) == 256
    finally:
        b.stop()


def test_cached_prefix_counts_and_a_gone_caller_frees_the_pin():
    v = Recording()
    b = VerifyBatcher(v, window_ms=1, prefill_chunk=16)
    try:
        prompt = _prompt(4, 90)
        first = b.verify(VerifyRequest("a", 0, prompt), timeout=60)
        assert first.cached_tokens == 0
        again = b.verify(VerifyRequest("b", 0, prompt[:80] + [7] * 30), timeout=60)
        assert again.cached_tokens == 80 and again.cache_len == 110
        assert b.prefill_steps == 6  # 89 tokens: 5 steps and the last 9; then 29: one step and the last 13
        alive = {"on": True}
        v.gate.clear()
        fut = b.submit(VerifyRequest("c", 0, _prompt(5, 100)), alive=lambda: alive["on"])
        v.gate.set()
        while b.prefill_steps < 7:  # its first step ran
            threading.Event().wait(0.01)
        alive["on"] = False
        with pytest.raises(CancelledError):
            fut.result(60)
        assert "c" not in v.pool.pinned and "c" in v.pool.slots  # evictable again; the router releases it
    finally:
        b.stop()


@pytest.mark.parametrize("chunk", [0, 256])
def test_more_new_sessions_than_slots_wait_for_a_slot_instead_of_failing(chunk):
    """Four prompts in one forward's queue on two slots, unchunked or within one chunk
    budget: the two a slot cannot take wait in the queue (before: ResourceExhausted "all 2
    KV slots are in use") until a session goes idle, no running session is evicted for
    them, and every answer equals the one it gets alone."""
    cfg, sd = shared_tiny_weights()
    v = EngineVerifier(LlamaEngine(cfg, sd, dtype="bf16", n_slots=2, max_seq_len=256), prefix_cache=False)
    ref = Recording(prefix_cache=False)
    b = VerifyBatcher(v, window_ms=1, prefill_chunk=chunk, recent_s=0.05)
    try:
        reqs = [VerifyRequest(f"s{i}", 0, _prompt(10 + i, 60)) for i in range(4)]
        hold = threading.Event()
        b.thread.submit(lambda: hold.wait(20))  # the model thread busy: all four are queued before a forward
        futs = [b.submit(r) for r in reqs]  # one batch: two new sessions beyond the slots
        hold.set()
        for r, f in zip(reqs, futs):
            got, want = f.result(60), ref.verify(r)
            assert (got.next_token, got.cache_len) == (want.next_token, want.cache_len), r.session_id
        assert v.pool.evictions == 2 and len(v.pool.slots) == 2  # the first two, once idle, made room
    finally:
        b.stop()
