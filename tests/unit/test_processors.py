"""Per-row logits processors (``specmesh.processors``) and grammars (``specmesh.grammar``)
through the one draft-verify loop, on the tiny 6-token target of the distribution tests.

- ``process_rows`` equals the hand formula (OpenAI's presence/frequency penalties,
  vLLM's repetition penalty, logit_bias) row by row, and row i + 1 of a draft equals the
  row scored alone after the draft path (what plain decoding forms there);
- greedy speculation equals greedy plain decoding under penalties, logit_bias and a
  grammar, for every kind of drafter (lookup, draft LM, self drafter, tree);
- sampled speculation draws exactly from the processed distribution: chi-square against
  the exact joint, enumerated with the processors applied at every prefix (slow);
- logprobs of every strategy equal plain decoding's (bitwise: the engine is
  batch-invariant);
- grammars: a rejected draft token ends the draft, every output is in the language,
  jump-forward drafts the forced tokens for free and changes nothing else.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import replace

import pytest
import torch

from specmesh import acceptance as acc
from specmesh import processors
from specmesh.drafters import PromptLookupDrafter
from specmesh.drafters.model_drafters import DraftLMDrafter, LayerSkipDrafter
from specmesh.engine import LlamaEngine
from specmesh.grammar import Matcher, Vocab
from specmesh.loop import generate_tokens, speculative_generate
from specmesh.types import SamplingParams, TokenTree
from specmesh.verifier import EngineVerifier
from tests.support import SMALL_DRAFT as DRAFT
from tests.support import SMALL_PROMPT as PROMPT
from tests.support import SMALL_V as V
from tests.support import chi2
from tests.support import small_target_engine as target_engine

PEN = SamplingParams(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias=((2, 1.5),))
LETTERS = [b"a", b"b", b"c", b"d", b"e", b"f"]
STOP = 5  # "f" ends the output in the grammar tests
REGEX = "(ab|cd)+e(a|c)"
ALPHA = 1e-3


def vocab() -> Vocab:
    return Vocab.from_bytes(LETTERS, [STOP])


def verifier(grammar: bool = False) -> EngineVerifier:
    v = EngineVerifier(target_engine(4))
    if grammar:
        v.set_grammar_vocab(vocab())
    return v


def drafters(ver):
    """name -> (drafter, self_draft): a lookup drafter, a draft LM (q far from p), a self drafter."""
    ver.self_drafters["layerskip"] = LayerSkipDrafter(ver, exit_layer=1, top_k=V)
    return {"plain": (None, None), "prompt_lookup": (PromptLookupDrafter(), None),
            "draft_lm": (DraftLMDrafter(LlamaEngine(*DRAFT, n_slots=2, max_seq_len=64), top_k=V), None),
            "layerskip": (None, "layerskip")}


def run(ver, drafter, self_draft, sampling, n, budget=3, jump_forward=True, stop_ids=(), logprobs=None):
    out = []
    for chunk in speculative_generate(drafter, ver, PROMPT, sampling=sampling, max_new_tokens=n, budget=budget,
                                      self_draft=self_draft, draft_first=True, stop_ids=stop_ids,
                                      jump_forward=jump_forward, on_logprobs=logprobs):
        out += chunk
    return out


# ---------------------------------------------------------------- the pure function

def test_process_rows_is_the_hand_formula_at_every_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    context, plen = [0, 1, 2, 3, 3, 4], 3  # output so far: 3, 3, 4 (the pending token is 4)
    tree = TokenTree([3, 0, 5], [-1, 0, 0])  # node 1 and 2 are siblings after node 0
    out = processors.process_rows(logits, PEN, context, plen, tree)
    prefixes = [[], [3], [3, 0], [3, 5]]
    for r, pre in enumerate(prefixes):
        want = logits[r].clone()
        want[2] += 1.5
        output = context[plen:] + pre
        for t in range(V):
            if t in context or t in pre:
                want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
            c = output.count(t)
            want[t] -= 0.5 * c + 0.8 * (c > 0)
        assert torch.allclose(out[r], want), r
        # the same row scored alone after its prefix (plain decoding's row): bitwise
        alone = processors.process_rows(logits[r:r + 1], PEN, context + pre, plen, TokenTree())
        assert torch.equal(alone[0], out[r])


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = acc.target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))[0]
    assert p[3] == 0 and p[2] > 0 and abs(float(p.sum()) - 1) < 1e-6  # 0.05 < 0.2 * 0.5 <= 0.15


def test_bad_processor_values_are_refused_naming_the_field():
    from specmesh.types import InvalidArgument

    for kw, name in [(dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
                     (dict(logit_bias=((1, 200.0),)), "logit_bias"), (dict(min_p=1.5), "min_p"),
                     (dict(logprobs=21), "logprobs"), (dict(grammar_kind="yaml"), "grammar_kind"),
                     (dict(presence_penalty=1, acceptance="contrastive"), "acceptance")]:
        with pytest.raises(InvalidArgument) as e:
            SamplingParams(**kw)
        assert e.value.field == name
    ver = verifier()
    with pytest.raises(InvalidArgument) as e:
        generate_tokens(None, ver, PROMPT, sampling=SamplingParams(logit_bias=((V, 1.0),)), max_new_tokens=2)
    assert e.value.field == "sampling.logit_bias"
    with pytest.raises(InvalidArgument) as e:  # no vocabulary for grammars
        generate_tokens(None, ver, PROMPT, sampling=SamplingParams(grammar_kind="regex", grammar="a+"),
                        max_new_tokens=2)
    assert e.value.field == "sampling.grammar_kind"
    ver = verifier(grammar=True)
    with pytest.raises(InvalidArgument) as e:
        generate_tokens(None, ver, PROMPT, sampling=SamplingParams(grammar_kind="json_schema", grammar='{"type": 3}'),
                        max_new_tokens=2)
    assert e.value.field == "sampling.grammar"


# ---------------------------------------------------------------- greedy: speculation == plain decoding

@pytest.mark.parametrize("sampling", [PEN, replace(PEN, logit_bias=((4, -100.0), (1, 3.0))),
                                      SamplingParams(frequency_penalty=2.0)], ids=["pen", "bias", "freq"])
def test_greedy_speculation_equals_plain_decoding_under_penalties(sampling):
    ver = verifier()
    ref = run(ver, None, None, sampling, 24)
    # plain decoding itself is the processed argmax at every position (an independent reference)
    eng, seq = target_engine(1), list(PROMPT)
    for _ in range(24):
        eng.reset(0)
        row = processors.process_rows(eng.prefill(0, seq)[None], sampling, seq, len(PROMPT), TokenTree())
        seq.append(int(row[0].argmax()))
    assert ref == seq[len(PROMPT):]
    assert ref != run(verifier(), None, None, SamplingParams(), 24)  # the processors do change the output
    for name, (d, sd) in drafters(ver).items():
        assert run(ver, d, sd, sampling, 24) == ref, name


def test_logprobs_of_every_strategy_equal_plain_decodings():
    ver = verifier()
    ver.engine.set_batch_invariant(True)  # the served dtypes' default: a row is the same in any draft
    sp = replace(PEN, logprobs=3)
    got = {}
    for name, (d, sd) in drafters(ver).items():
        lps: list = []
        toks = run(ver, d, sd, sp, 16, logprobs=lps.extend)
        assert [x.token_id for x in lps] == toks
        got[name] = lps
    for name, lps in got.items():
        assert [(x.token_id, x.logprob, x.top) for x in lps] == \
            [(x.token_id, x.logprob, x.top) for x in got["plain"]], name
    first = got["plain"][0]
    eng = target_engine(1)
    want = torch.log_softmax(eng.prefill(0, PROMPT).float(), -1)  # raw: before processors and temperature
    assert first.logprob == pytest.approx(float(want[first.token_id]), abs=1e-5)
    assert len(first.top) == 3 and first.top[0][1] >= first.top[1][1] >= first.top[2][1]


# ---------------------------------------------------------------- grammars

def in_language(out: list[int]) -> bool:
    text = "".join(LETTERS[t].decode() for t in out if t != STOP)
    return re.fullmatch(REGEX, text) is not None


def test_matcher_syncs_rolls_back_and_masks():
    m = Matcher(vocab(), "regex", REGEX)
    assert m.allowed().nonzero()[:, 0].tolist() == [0, 2]  # a or c
    assert m.sync([0, 1, 2]) and m.forced() == 3  # "abc" -> "d" is the only next token
    assert not m.advance(0) and m.consumed == [0, 1, 2]  # refused: the state is unchanged
    assert m.sync([2, 3, 4]) and m.consumed == [2, 3, 4] and m.allowed().nonzero()[:, 0].tolist() == [0, 2]
    assert m.sync([2, 3, 4, 0]) and m.allowed().nonzero()[:, 0].tolist() == [STOP] and m.ends(STOP)


def test_constrain_ends_a_rejected_draft_and_jumps_forward():
    m = Matcher(vocab(), "regex", "abcd(a|e)")
    tree, masks, forced = processors.constrain(m, TokenTree.chain([0, 1, 3]), extend=0)  # "abd": d rejected
    assert tree.tokens == [0, 1] and masks.shape == (3, V) and forced == 0
    tree, masks, forced = processors.constrain(m, TokenTree.chain([0, 2]), extend=8)  # "a" then forced "bcd"
    assert tree.tokens == [0, 1, 2, 3] and forced == 3 and m.consumed == []
    tree, _, forced = processors.constrain(m, TokenTree(), extend=8)  # plain round: the forced run is the draft
    assert tree.tokens == [0, 1, 2, 3] and forced == 4
    m2 = Matcher(vocab(), "regex", "a(b|c)d")
    q = TokenTree.chain([0, 3], [[0, 1], [3, 2]], [[0.5, 0.5], [0.6, 0.4]])  # a node with q stays, as a leaf
    tree, _, _ = processors.constrain(m2, q, extend=0)
    assert tree.tokens == [0, 3] and tree.q_ids[1] == [3, 2]
    tree, _, forced = processors.constrain(m, q, extend=4)  # ... but not at a forced row: "b" replaces it
    assert tree.tokens == [0, 1, 2, 3] and forced == 3 and not tree.q_ids[1]
    tree, _, _ = processors.constrain(m, TokenTree([0, 2, 1], [-1, -1, 0]), extend=0)  # a tree: c pruned
    assert tree.tokens == [0, 1] and tree.parents == [-1, 0]


@pytest.mark.parametrize("jump_forward", [False, True])
def test_greedy_constrained_speculation_equals_plain_and_stays_in_the_language(jump_forward):
    ver = verifier(grammar=True)
    sp = replace(PEN, grammar_kind="regex", grammar=REGEX)
    ref = run(ver, None, None, sp, 20, jump_forward=False, stop_ids=[STOP])
    assert in_language(ref), ref
    for name, (d, sd) in drafters(ver).items():
        assert run(ver, d, sd, sp, 20, jump_forward=jump_forward, stop_ids=[STOP]) == ref, name


def test_jump_forward_drafts_forced_tokens_for_free():
    ver = verifier(grammar=True)
    sp = SamplingParams(grammar_kind="regex", grammar="abcdabcd(a|e)")
    from specmesh.types import GenerationStats

    st_off, st_on = GenerationStats(), GenerationStats()
    off, _ = generate_tokens(None, ver, PROMPT, sampling=sp, max_new_tokens=12, stop_ids=[STOP],
                             jump_forward=False, stats=st_off)
    on, _ = generate_tokens(None, ver, PROMPT, sampling=sp, max_new_tokens=12, stop_ids=[STOP], stats=st_on)
    assert on == off and off[:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert st_off.target_forwards == 10 and st_on.target_forwards <= 3  # the prefill round drafts the forced run


# ---------------------------------------------------------------- sampled: the processed distribution exactly

def exact_processed_joint(sampling: SamplingParams, n: int, grammar: bool = False) -> dict:
    eng = target_engine(1)
    out = {}
    for combo in itertools.product(range(V), repeat=n):
        prob, seq = 1.0, list(PROMPT)
        for x in combo:
            eng.reset(0)
            masks = None
            if grammar:
                m = Matcher(vocab(), sampling.grammar_kind, sampling.grammar)
                m.sync(seq[len(PROMPT):])
                masks = m.allowed()[None]
            row = processors.process_rows(eng.prefill(0, seq)[None], sampling, seq, len(PROMPT), TokenTree(), masks)
            prob *= float(acc.target_probs(row, sampling)[0, x])
            seq.append(x)
            if prob == 0:
                break
        if prob > 0:
            out[combo] = prob
    return out


N_SAMPLES = 2000
SAMPLED = {"pen_t1": replace(PEN, temperature=1.0, min_p=0.05),
           "grammar_t1": replace(PEN, temperature=1.0, grammar_kind="regex", grammar="(a|b|c)(b|d)(a|b|c|d|e)"),
           # a forced row in the middle: drafted tokens there are replaced by the forced one (jump-forward)
           "forced_t1": SamplingParams(temperature=1.0, grammar_kind="regex", grammar="(a|b|d)c(a|b|d|e)")}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pen_t1", "grammar_t1", "forced_t1"])
@pytest.mark.parametrize("name", ["prompt_lookup", "draft_lm", "layerskip"])
def test_sampled_speculation_draws_the_processed_distribution(case, name):
    sampling = SAMPLED[case]
    grammar = sampling.constrained
    ver = verifier(grammar)
    d, sd = drafters(ver)[name]
    c: Counter = Counter()
    for seed in range(N_SAMPLES):
        c[tuple(run(ver, d, sd, replace(sampling, seed=seed), 3, budget=2))] += 1
    p = chi2(c, exact_processed_joint(sampling, 3, grammar))
    assert p > ALPHA, f"{name}/{case}: chi-square p = {p:.2e}"


# ---------------------------------------------------------------- grammars past the matcher's limits

WIDE = "start: " + " | ".join('"a" "b"+ "c"' for _ in range(2100))  # an Earley row of 6,300 items after "a"


def test_a_grammar_past_the_matchers_limits_is_refused_naming_it_and_the_others_go_on():
    from specmesh.grammar import MAX_GRAMMAR_CHARS, GrammarError, check
    from specmesh.types import InvalidArgument, VerifyRequest

    check("lark", WIDE)  # no tokenizer: the router's check cannot see it
    m = Matcher(vocab(), "lark", WIDE)
    with pytest.raises(GrammarError, match="too complex to match"):
        m.advance(0)  # allowed, and the matcher then hits its row limit: said, not a silent refusal
    with pytest.raises(GrammarError, match="characters"):
        check("regex", "a" * (MAX_GRAMMAR_CHARS + 1))
    ver = verifier(grammar=True)
    wide = SamplingParams(temperature=0.0, grammar_kind="lark", grammar=WIDE)
    ok = SamplingParams(temperature=0.0, grammar_kind="regex", grammar=REGEX)
    reqs = [VerifyRequest("wide", 0, list(PROMPT), TokenTree.chain([0, 1]), wide, 0, prompt_len=len(PROMPT)),
            VerifyRequest("ok", 0, list(PROMPT), TokenTree.chain([0, 1]), ok, 0, prompt_len=len(PROMPT))]
    out = ver.verify_batch(reqs)
    assert isinstance(out[0], InvalidArgument) and out[0].field == "sampling.grammar", out[0]
    assert "too complex" in str(out[0])
    assert not isinstance(out[1], BaseException), out[1]  # the batch's other request is served
    assert (out[1].accepted + [out[1].next_token])[0] in (0, 2)  # in its language: "a" or "c" first


def test_a_failure_inside_the_matcher_is_the_grammars_refusal():
    """A panic inside llguidance (pyo3's PanicException derives from BaseException) is the
    request's GrammarError, not a crash of the verifier's batch."""
    from specmesh.grammar import GrammarError, guarded

    class PanicException(BaseException):
        pass

    with pytest.raises(GrammarError, match="PanicException"):
        with guarded():
            raise PanicException("index out of bounds")
    with pytest.raises(KeyboardInterrupt):
        with guarded():
            raise KeyboardInterrupt
