"""Router strategies end to end on the real SmolLM2-135M through real services on
loopback: every strategy's greedy output equals plain decoding (``self`` by
default with the trained block drafter's tree); ``auto`` picks the expected
strategy on crafted requests (the block tree on fresh text) and ListStrategies
names the defaults; a proactive turn reports its cache hit and
takes drafts from the anticipation cache (and its warm KV); SSR's output equals
plain full-CoT decoding; idle anticipation work is preempted by a real request.

One Runtime and one set of in-process servers for the module (``RuntimeStack`` of
tests/support.py, as in test_grpc_e2e.py); generations are short to keep the file
near two minutes.
"""

from __future__ import annotations

import time

import pytest

from tests.support import RuntimeStack

pytestmark = pytest.mark.slow

N = 24
CODE_PROMPT = ("Rename the variable x to total in this function and return the whole function:\n\n"
               "```python\ndef f(a):\n    x = 0\n    for v in a:\n        x += v\n    return x\n```")
FRESH_PROMPT = "Write two sentences about the sea."
REPEAT_PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris."}]
REASONING = "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Think step by step."


class Stack(RuntimeStack):
    def __init__(self):
        super().__init__(n_slots=8, anticipate_next_turns=1, anticipate_reply_tokens=40, anticipate_tokens=160)

    def self_default(self) -> str:
        return "block_tree" if "block_tree" in self.rt.verifier.self_drafters else "layerskip"

    def ref(self, n: int = N, prompt=None, messages=None) -> list[int]:
        """In-process plain greedy decoding of the same request."""
        return super().ref(prompt, n, messages)


@pytest.fixture(scope="module")
def stack():
    st = Stack()
    yield st
    st.close()


def test_every_strategy_matches_plain_decoding(stack):
    from specmesh import Client

    with Client(stack.address, timeout=180) as c:
        ref = stack.ref(prompt=CODE_PROMPT)
        for strategy, drafter in (("autoregressive", ""), ("external", "prompt_lookup"), ("external", "suffix"),
                                  ("external", "adaptive_lookup"), ("external", "draft_lm"), ("self", ""),
                                  ("self", "layerskip"), ("auto", "")):
            r = c.generate(CODE_PROMPT, strategy=strategy, drafter=drafter, max_new_tokens=N)
            assert r.token_ids == ref, (strategy, drafter)
            if (strategy, drafter) == ("self", ""):  # the default: the trained block drafter's tree, when loaded
                assert r.stats.drafter == stack.self_default(), r.stats.strategy_reason
        r = c.generate(REPEAT_PROMPT, strategy="auto", max_new_tokens=N)
        assert r.token_ids == stack.ref(prompt=REPEAT_PROMPT) and r.stats.tau > 1.5  # a copying answer pays
        # proactive without an anticipation: drafts from the request's own context, same output
        r = c.generate(CODE_PROMPT, strategy="proactive", conversation_id="none-yet", max_new_tokens=N)
        assert r.token_ids == ref and not r.stats.cache_hit and r.stats.strategy == "proactive"


def test_auto_picks_the_expected_strategy(stack):
    from specmesh import Client

    long_chat = CONVERSATION + [{"role": "user", "content": "And of Germany?"}]
    block = stack.self_default() == "block_tree"
    cases = [
        (dict(prompt=CODE_PROMPT), "external", "suffix"),
        (dict(messages=long_chat), "external", "suffix"),
        (dict(prompt=REASONING, reasoning=True), "ssr", "cache"),
        # fresh text: the trained block drafter's tree where the verifier has it, else suffix decoding
        (dict(prompt=FRESH_PROMPT), *(("self", "block_tree") if block else ("external", "suffix"))),
    ]
    if block:  # a conversation where the tree measured a slowdown: the next fresh-text choice
        stack.router.runner.book.record("conv:slow-tree", "self:block_tree", 1.0, 0.7)
        cases.append((dict(prompt=FRESH_PROMPT, conversation_id="slow-tree"), "external", "suffix"))
    # a conversation where suffix decoding measured a slowdown: speculation is switched off
    stack.router.runner.book.record("conv:slow-session", "external:suffix", 1.0, 0.6)
    cases.append((dict(prompt=CODE_PROMPT, conversation_id="slow-session"), "autoregressive", ""))
    with Client(stack.address, timeout=120) as c:
        for kw, strategy, drafter in cases:
            r = c.generate(strategy="auto", max_new_tokens=4, **kw)
            assert (r.stats.strategy, r.stats.drafter) == (strategy, drafter), (kw, r.stats.strategy_reason)
            assert r.stats.strategy_reason.startswith("auto:")
            if kw.get("conversation_id") == "slow-tree":
                assert "0.70x" in r.stats.strategy_reason
        assert "0.60x" in r.stats.strategy_reason and "off" in r.stats.strategy_reason
        info = {s.name: s for s in c.list_strategies().strategies}
    assert info["self"].default_drafter == stack.self_default()
    assert info["external"].default_drafter == stack.rs.default_drafter and info["auto"].default_drafter == ""


def test_proactive_turn_drafts_from_the_anticipation_cache(stack):
    from specmesh import Client

    conv = "conv-proactive"
    with Client(stack.address, timeout=240) as c:
        a = c.anticipate(conv, CONVERSATION, next_turns=1, wait=True, timeout=200)
        assert a.state == "ready" and a.texts >= 1 and a.warm, a
        follow = a.predicted_turns[0] if a.predicted_turns else "Please continue."
        messages = CONVERSATION + [{"role": "user", "content": follow}]
        r = c.generate(messages=messages, strategy="auto", conversation_id=conv, max_new_tokens=N)
        assert r.stats.strategy == "proactive", r.stats.strategy_reason
        assert r.token_ids == stack.ref(messages=messages)
        assert r.stats.cache_hit and r.stats.cache_accepted_tokens > 0  # drafts came from the cache
        assert r.stats.warm_prefix_tokens > 0  # the conversation's KV was warm
        assert r.stats.tau > 2.0


def test_ssr_answer_equals_full_cot_decoding(stack):
    from specmesh import Client

    with Client(stack.address, timeout=240) as c:
        kw = dict(prompt=REASONING, max_new_tokens=96, thinking_budget=64)
        plain = c.generate(strategy="autoregressive", reasoning=True, **kw)
        ssr = c.generate(strategy="ssr", **kw)
    assert ssr.token_ids == plain.token_ids
    assert "</think>" in plain.text and plain.stats.answer_tokens > 0
    assert ssr.stats.side_branches >= 1 and ssr.stats.answer_tokens == plain.stats.answer_tokens
    assert ssr.stats.thinking_tokens == plain.stats.thinking_tokens


def test_idle_work_is_preempted_by_a_real_request(stack):
    from specmesh import Client

    conv = "conv-preempt"
    ant = stack.router.runner.anticipator()
    with Client(stack.address, timeout=120) as c:
        c.anticipate(conv, CONVERSATION + [{"role": "user", "content": "Tell me about Paris."},
                                           {"role": "assistant", "content": "Paris is a big city."}],
                     next_turns=1, max_tokens=160)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and c.get_anticipation(conv).tokens == 0:
            time.sleep(0.05)
        assert c.get_anticipation(conv).tokens > 0
        s = c.stream(FRESH_PROMPT, strategy="autoregressive", max_new_tokens=24)
        it = iter(s)
        next(it)  # the real request is running: idle work has stopped at its round
        assert stack.router.runner.gate.busy
        t0 = c.get_anticipation(conv).tokens
        rest = list(it)
        assert rest is not None and s.result is not None
        st = c.get_anticipation(conv)
        assert st.preemptions >= 1 and st.state in ("preempted", "running", "ready")
        assert st.tokens - t0 <= 8  # at most the round in flight when the request came
    ant.cancel(conv)
