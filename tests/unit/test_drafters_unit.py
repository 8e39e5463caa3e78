"""Fast unit tests of the deterministic drafters (prompt lookup, suffix): no model."""

from __future__ import annotations

import random

import pytest

from specmesh.drafters import DRAFTERS, PromptLookupDrafter, SuffixDrafter, make_drafter
from specmesh.drafters.base import Drafter
from specmesh.drafters.prompt_lookup import NgramIndex
from specmesh.seqs import common_prefix_len
from specmesh.types import DraftContext, InvalidArgument, TokenTree

V = 1000


def ctx(tokens, sid="s", prompt_len=None):
    tokens = list(tokens)
    return DraftContext(sid, tokens, len(tokens) if prompt_len is None else prompt_len)


def check_tree(tree: TokenTree, budget: int) -> None:
    tree.validate(V)
    assert len(tree) <= budget
    assert tree.q_ids is None and tree.q_probs is None
    for node in [-1] + list(range(len(tree))):
        kids = [tree.tokens[c] for c in tree.children(node)]
        assert len(kids) == len(set(kids)), f"duplicate siblings under {node}: {kids}"


# ---------------------------------------------------------------- factory

def test_registry_and_factory():
    assert {"prompt_lookup", "suffix"} <= set(DRAFTERS)
    d = make_drafter("prompt_lookup", max_ngram=4)
    assert isinstance(d, PromptLookupDrafter) and d.max_ngram == 4 and d.name == "prompt_lookup"
    s = make_drafter("suffix", tree=False)
    assert isinstance(s, SuffixDrafter) and s.name == "suffix"
    assert isinstance(d, Drafter) and isinstance(s, Drafter)
    with pytest.raises(InvalidArgument) as e:
        make_drafter("nope")
    assert e.value.field == "drafter"


def test_bad_constructor_args():
    with pytest.raises(InvalidArgument):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(InvalidArgument):
        SuffixDrafter(max_depth=0)
    with pytest.raises(InvalidArgument):
        SuffixDrafter(min_prob=2.0)


# ---------------------------------------------------------------- prompt lookup

def test_pld_repeated_code_with_edit():
    code = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    # the model is rewriting the code with one token changed (13 -> 99)
    context = code + [5] + [10, 11, 12, 99, 14, 15]
    t = PromptLookupDrafter().propose(ctx(context), 4)
    assert t.tokens == [16, 17, 18, 19] and t.is_chain


def test_pld_longest_ngram_beats_recent_shorter():
    # 3-gram (1,2,3) occurred early, followed by 7; the unigram 3 occurred later, followed by 8
    context = [1, 2, 3, 7, 7, 3, 8, 9, 1, 2, 3]
    assert PromptLookupDrafter().propose(ctx(context), 2).tokens == [7, 7]
    # with max_ngram=1 only the unigram counts: the most recent 3 is followed by 8
    assert PromptLookupDrafter(max_ngram=1).propose(ctx(context), 2).tokens == [8, 9]


def test_pld_most_recent_occurrence():
    context = [1, 2, 3, 40, 41, 0, 1, 2, 3, 50, 51, 0, 1, 2, 3]
    assert PromptLookupDrafter().propose(ctx(context), 2).tokens == [50, 51]


def test_pld_no_match_and_edge_cases():
    d = PromptLookupDrafter()
    assert len(d.propose(ctx([1, 2, 3, 4, 5]), 5)) == 0
    assert len(d.propose(ctx([]), 5)) == 0
    assert len(d.propose(ctx([1, 2, 1]), 0)) == 0
    assert len(PromptLookupDrafter(min_ngram=2).propose(ctx([1, 2, 3, 1]), 4)) == 0


def test_pld_periodic_extension():
    context = [9, 5, 6, 5, 6, 5, 6]
    assert PromptLookupDrafter().propose(ctx(context), 5).tokens == [5, 6, 5, 6, 5]
    assert PromptLookupDrafter(extend_periodic=False).propose(ctx(context), 5).tokens == [5, 6]
    assert PromptLookupDrafter().propose(ctx([3, 3, 3]), 4).tokens == [3, 3, 3, 3]


# ---------------------------------------------------------------- incremental state

def _fresh_index(levels, tokens):
    idx = NgramIndex(levels)
    idx.extend(tokens)
    return idx


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_len([], [1]) == 0
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = [rng.randrange(3) for _ in range(rng.randrange(40))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix_len(a, b) == n


def test_index_truncate_equals_fresh():
    rng = random.Random(1)
    idx = NgramIndex((1, 2, 4, 8))
    tokens: list[int] = []
    for _ in range(300):
        if tokens and rng.random() < 0.4:
            tokens = tokens[: rng.randrange(len(tokens) + 1)]
        tokens = tokens + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        idx.sync(tokens)
        fresh = _fresh_index((1, 2, 4, 8), tokens)
        assert idx.tokens == fresh.tokens
        assert idx.heads == fresh.heads
        assert [list(p) for p in idx.prevs] == [list(p) for p in fresh.prevs]


@pytest.mark.parametrize("make", [
    lambda: PromptLookupDrafter(),
    lambda: PromptLookupDrafter(max_ngram=5, min_ngram=2, extend_periodic=False),
    lambda: SuffixDrafter(),
    lambda: SuffixDrafter(tree=False, max_spec_factor=None),
    lambda: SuffixDrafter(max_spec_factor=None, min_prob=0.0, max_depth=6),
])
def test_incremental_matches_fresh(make):
    """Append and rollback (shrinking context) give what a fresh drafter gives."""
    rng = random.Random(2)
    inc = make()
    tokens = [rng.randrange(6) for _ in range(30)]
    for step in range(150):
        r = rng.random()
        if r < 0.3:  # rollback, then maybe a different continuation
            tokens = tokens[: rng.randrange(1, len(tokens) + 1)]
        if r < 0.9:
            tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(0, 6))]
        budget = rng.randrange(1, 12)
        got = inc.propose(ctx(tokens, "sess"), budget)
        want = make().propose(ctx(tokens, "other"), budget)
        assert (got.tokens, got.parents) == (want.tokens, want.parents), step
        check_tree(got, budget)


def test_release_frees_state_and_sessions_are_bounded():
    for d in (PromptLookupDrafter(max_sessions=2), SuffixDrafter(max_sessions=2)):
        d.propose(ctx([1, 2, 1], "a"), 3)
        assert "a" in d._sessions
        d.release("a")
        assert "a" not in d._sessions
        d.release("never-seen")  # no error
        for sid in "bcd":
            d.propose(ctx([1, 2, 1], sid), 3)
        assert len(d._sessions) == 2 and "b" not in d._sessions


# ---------------------------------------------------------------- suffix drafter

def test_suffix_repeated_code_with_edit():
    code = list(range(100, 130))
    context = code + [7] + code[:10] + [999] + code[11:15]
    d = SuffixDrafter(max_spec_factor=None)
    t = d.propose(ctx(context), 6)
    assert t.tokens == code[15:21] and t.is_chain


def test_suffix_builds_tree_by_frequency():
    A, B, C, D = 1, 2, 3, 4
    context = [A, B, C, 50, A, B, C, 51, A, B, D, 52, A, B, C, 53, 60, A, B]
    d = SuffixDrafter(max_spec_factor=None, min_prob=0.0)
    t = d.propose(ctx(context), 6)
    check_tree(t, 6)
    root_kids = [t.tokens[i] for i in t.children(-1)]
    assert t.tokens[0] == C and root_kids == [C, D]
    # under C the three continuations 50, 51, 53 each have probability 0.75 * 1/3
    under_c = {t.tokens[i] for i in t.children(0)}
    assert under_c and under_c <= {50, 51, 53}
    # chain mode follows the most frequent child, ties -> the most recent occurrence
    chain = SuffixDrafter(max_spec_factor=None, tree=False, min_prob=0.0).propose(ctx(context), 3)
    assert chain.is_chain and chain.tokens[:2] == [C, 53]
    # min_prob prunes unlikely branches: D (0.25) survives 0.2, not 0.3
    assert D in SuffixDrafter(max_spec_factor=None, min_prob=0.2).propose(ctx(context), 6).tokens
    assert D not in SuffixDrafter(max_spec_factor=None, min_prob=0.3).propose(ctx(context), 6).tokens


def test_suffix_spec_factor_limits_size():
    context = [5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 1]  # match length 1 (token 1)
    assert len(SuffixDrafter().propose(ctx(context), 8)) == 1  # factor 1.0 * m=1
    assert len(SuffixDrafter(max_spec_factor=None).propose(ctx(context), 8)) == 8  # periodic copy
    assert len(SuffixDrafter(max_spec_factor=2.0, max_spec_offset=1.0).propose(ctx(context), 8)) == 3


def test_suffix_global_learns_from_finish():
    output = list(range(300, 340))
    prompt1 = list(range(10, 30))
    prompt2 = list(range(40, 60))
    d = SuffixDrafter(max_spec_factor=None)
    probe = prompt2 + output[:5]
    assert len(d.propose(ctx(probe, "b", len(prompt2)), 8)) == 0  # nothing learned yet
    d.release("b")
    d.propose(ctx(prompt1 + output[:3], "a", len(prompt1)), 4)
    d.finish("a", prompt1 + output, len(prompt1))
    assert "a" not in d._sessions
    assert d.global_outputs == 1 and d.global_tokens == len(output) + 1
    t = d.propose(ctx(probe, "b", len(prompt2)), 8)
    assert t.tokens == output[5:13]
    # the prompt part of a finished session is not learned
    d2 = SuffixDrafter()
    d2.finish("a", prompt1 + output, len(prompt1))
    assert len(d2.propose(ctx([0] + prompt1[:5], "c"), 4)) == 0


def test_suffix_prefers_longer_match_across_structures():
    # per-request: token 7 followed by 1 (match length 1); global: (5, 6, 7) followed by 2
    d = SuffixDrafter(max_spec_factor=None)
    d.add_output([5, 6, 7, 2, 2, 2])
    t = d.propose(ctx([7, 1, 9, 5, 6, 7]), 3)
    assert t.tokens == [2, 2, 2]
    # a longer per-request match wins over the global one
    t = d.propose(ctx([5, 6, 7, 3, 3, 3, 9, 5, 6, 7], "x"), 3)
    assert t.tokens == [3, 3, 3]


def test_suffix_no_match_across_outputs():
    d = SuffixDrafter(max_spec_factor=None)
    d.add_output([1, 2, 3])
    d.add_output([4, 5, 6])
    # "3 4" never occurred inside one output: only the unigram 4 matches
    t = d.propose(ctx([90, 3, 4]), 2)
    assert t.tokens == [5, 6]
    assert len(d.propose(ctx([90, 91, 3]), 3)) == 0  # 3 ends an output: nothing follows


def test_suffix_global_is_bounded_fifo():
    d = SuffixDrafter(max_spec_factor=None, max_global_outputs=2, max_global_tokens=10_000)
    outs = [[100 + 10 * i + k for k in range(8)] for i in range(3)]
    for o in outs:
        d.add_output(o)
    assert d.global_outputs == 2
    assert len(d.propose(ctx([1, outs[0][0], outs[0][1]]), 3)) == 0  # evicted
    assert d.propose(ctx([1, outs[2][0], outs[2][1]], "b"), 3).tokens == outs[2][2:5]
    small = SuffixDrafter(max_global_tokens=30)
    for i in range(50):
        small.add_output([i % 7 + 1 for _ in range(5)] + [200 + i])
    assert small.global_tokens <= 30
    rng = random.Random(3)
    for _ in range(50):
        check_tree(small.propose(ctx([rng.randrange(1, 9) for _ in range(20)], "r"), 8), 8)


def test_suffix_global_eviction_compacts_and_matches_fresh():
    rng = random.Random(4)
    outs = [[rng.randrange(1, 8) for _ in range(rng.randrange(200, 600))] for _ in range(40)]
    d = SuffixDrafter(max_spec_factor=None, min_prob=0.0, max_global_outputs=5)
    for o in outs:
        d.add_output(o)
    assert d._global.base > 0  # the evicted prefix was compacted away
    fresh = SuffixDrafter(max_spec_factor=None, min_prob=0.0, max_global_outputs=5)
    for o in outs[-5:]:
        fresh.add_output(o)
    for i in range(30):
        q = [rng.randrange(1, 8) for _ in range(12)] + [0]  # 0 never occurs: only global matches
        q = q[:-1] if i % 2 else q
        a, b = d.propose(ctx(q, "q"), 10), fresh.propose(ctx(q, "q"), 10)
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        d.release("q")
        fresh.release("q")


def test_suffix_random_trees_are_valid():
    rng = random.Random(5)
    for tree in (True, False):
        d = SuffixDrafter(tree=tree, max_spec_factor=None, min_prob=0.0, max_children=3, max_depth=5)
        for i in range(20):
            d.add_output([rng.randrange(5) for _ in range(rng.randrange(1, 50))])
        for i in range(100):
            toks = [rng.randrange(5) for _ in range(rng.randrange(1, 80))]
            budget = rng.randrange(1, 40)
            t = d.propose(ctx(toks, str(i)), budget)
            check_tree(t, budget)
            assert max(t.depths(), default=-1) < 5
            assert all(len(t.children(n)) <= (3 if tree else 1) for n in [-1] + list(range(len(t))))
            if not tree:
                assert t.is_chain
