"""The best path on a real pair is the default (issue 62), through real gRPC servers on
loopback with a tiny paired model: a tiny target, and as its draft LM a tiny model of
the same vocabulary close to it (a perturbed copy, as a paired draft model is), which
the drafter service loads at start and measures. ``Drafter/Info`` names the draft model
and its speed; ``auto`` tries the draft LM on fresh text (greedy output identical to
plain decoding), keeps it where the session measured it faster and moves to suffix
decoding where it measured slower (the measurements are put in the router's session
book: no test depends on timing); the draft LM's calls get a deadline from its speed."""

from __future__ import annotations

from functools import partial

import pytest

from specmesh.engine import LlamaEngine
from tests.support import (TRACED_SETTINGS, LocalStack, TokenizerCodec, V, settings, tiny_layerskip_verifier,
                           tiny_specialist_weights, tiny_weights)

FRESH = "Write a poem about autumn leaves."
DRAFT = "tiny-paired-draft"


@pytest.fixture(scope="module")
def pair():
    from specmesh.drafters import PromptLookupDrafter, SuffixDrafter
    from specmesh.drafters.model_drafters import DraftLMDrafter

    cfg, sd = tiny_specialist_weights(*tiny_weights(), noise=0.002)  # the target's draft model: close, same vocab
    drafters = {"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter,
                "draft_lm": lambda: DraftLMDrafter(LlamaEngine(cfg, sd, n_slots=8, max_seq_len=256))}
    kw = dict(TRACED_SETTINGS, draft_model=DRAFT, drafter_timeout_s=None)
    st = LocalStack([tiny_layerskip_verifier], TokenizerCodec(), V, settings=partial(settings, kw), drafters=drafters)
    yield st
    st.close()


def test_the_drafter_service_names_its_draft_model_and_its_speed(pair):
    info = pair.drafter_info()
    assert info.draft_model == DRAFT and info.draft_prefill_ms > 0 and info.draft_token_ms > 0
    facts = pair.router.runner.drafter_facts()
    assert facts.draft_model == DRAFT and facts.draft_speed.token_ms == pytest.approx(info.draft_token_ms)


def test_auto_tries_the_draft_lm_and_keeps_it_where_it_measures_faster(pair):
    from specmesh import Client

    book = pair.router.runner.book
    with Client(pair.address, timeout=60) as c:
        plain = c.generate(FRESH, strategy="autoregressive", max_new_tokens=24, raw_prompt=True)
        a = c.generate(FRESH, max_new_tokens=24, raw_prompt=True, conversation_id="new")  # the default: auto
        assert (a.stats.strategy, a.stats.drafter) == ("external", "draft_lm"), a.stats.strategy_reason
        assert DRAFT in a.stats.strategy_reason and a.token_ids == plain.token_ids  # lossless
        assert "external:draft_lm" in book.get("conv:new")  # measured for the session
        # the session measured it faster: kept
        book.record("conv:fast", "external:draft_lm", 4.0, 1.6)
        k = c.generate(FRESH, max_new_tokens=8, raw_prompt=True, conversation_id="fast")
        assert k.stats.drafter == "draft_lm" and "1.60x" in k.stats.strategy_reason
        # measured slower: suffix decoding instead, the same tokens
        book.record("conv:slow", "external:draft_lm", 1.1, 0.5)
        s = c.generate(FRESH, max_new_tokens=24, raw_prompt=True, conversation_id="slow")
        assert s.stats.drafter == "suffix" and "0.50x" in s.stats.strategy_reason
        assert s.token_ids == plain.token_ids
        # a copy-cue prompt keeps suffix decoding
        code = c.generate("Fix this code:\n```\nx = 1\n```", max_new_tokens=8, raw_prompt=True)
        assert code.stats.drafter == "suffix"
