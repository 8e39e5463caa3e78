"""The prefix cache's index (specmesh.prefix_cache): matching, sharing, references, LRU eviction."""

from __future__ import annotations

import random

import pytest

from specmesh.prefix_cache import PrefixCache, walk_all


def blocks_of(cache: PrefixCache) -> list[tuple]:
    out = []

    def prefix(b):
        parts = []
        while b is not None and b.parent is not None:
            parts.append(b.tokens)
            b = b.parent
        return tuple(t for p in reversed(parts) for t in p)

    walk_all(cache, lambda b: out.append(prefix(b)))
    return sorted(out)


def test_match_is_the_longest_chain_of_full_blocks_under_the_limit():
    c = PrefixCache(16, block_size=4)
    toks = list(range(100, 114))  # 3 full blocks + 2
    assert c.grow("a", toks, len(toks)) == [(0, 0), (1, 4), (2, 8)]  # (storage id, first position)
    assert c.peek(toks) == 12
    assert c.peek(toks, 11) == 8  # the limit cuts a block that does not fit whole
    assert c.peek(toks[:6] + [0] * 8) == 4  # diverges inside block 2
    assert c.peek([1] + toks[1:]) == 0  # a block is its tokens *and* its prefix
    chain = c.match(toks + [7, 7, 7], 13)
    assert [b.tokens for b in chain] == [tuple(toks[0:4]), tuple(toks[4:8]), tuple(toks[8:12])]
    assert (c.queries, c.hits) == (17, 12)


def test_sessions_share_blocks_with_references_and_store_each_once():
    c = PrefixCache(16, block_size=2)
    system = [1, 2, 3, 4]
    new_a = c.grow("a", system + [5, 6], 6)
    new_b = c.grow("b", system + [7, 8, 9], 7)  # shares the two system blocks, stores one of its own
    assert len(new_a) == 3 and len(new_b) == 1
    assert c.used == 4 and c.held == 4
    shared = c.sessions["a"][:2]
    assert shared == c.sessions["b"][:2] and [b.refs for b in shared] == [2, 2]
    c.truncate("a", 3)  # keeps block 0 only
    assert [b.refs for b in shared] == [2, 1]
    c.detach("b")
    assert [b.refs for b in shared] == [1, 0] and c.used == 4  # unreferenced blocks stay cached
    c.fork("a", "f", 2)
    assert c.sessions["f"] == c.sessions["a"][:1] and shared[0].refs == 2


def test_eviction_takes_the_least_recently_used_unheld_leaf_first():
    c = PrefixCache(4, block_size=1)
    c.grow("x", [1, 2], 2)  # 1 -> 2
    c.grow("y", [3, 4], 2)  # 3 -> 4
    c.detach("x")
    c.detach("y")
    c.match([1, 2, 0], 2)  # x's chain used since: y's is older
    assert c.grow("z", [5], 1)  # full: evicts y's leaf (4) first, never its head (3) before it
    assert blocks_of(c) == [(1,), (1, 2), (3,), (5,)]
    assert c.evictions == 1
    assert c.grow("w", [6], 1)  # then the head (3), now a leaf
    assert blocks_of(c) == [(1,), (1, 2), (5,), (6,)]


def test_held_blocks_are_never_evicted_and_a_full_cache_skips():
    c = PrefixCache(3, block_size=1)
    c.grow("a", [1, 2, 3], 3)
    assert c.grow("b", [4], 1) == [] and c.skipped == 1  # every block held: nothing stored
    assert c.sessions["b"] == []
    c.truncate("a", 1)  # lets go of 2 and 3
    new = c.grow("b", [4, 5], 2)
    assert len(new) == 2 and blocks_of(c) == [(1,), (4,), (4, 5)]
    assert c.sessions["a"][0].refs == 1


def test_a_chain_stops_at_the_first_block_it_cannot_store():
    c = PrefixCache(2, block_size=2)
    c.grow("a", [1, 1, 2, 2], 4)
    assert len(c.grow("b", [3, 3, 4, 4], 4)) == 0  # a holds both blocks
    c.detach("a")
    assert len(c.grow("b", [3, 3, 4, 4, 5, 5], 6)) == 2  # evicts a's blocks; the third does not fit
    assert c.holds("b") == 4 and c.skipped == 2


def test_clear_forgets_blocks_but_keeps_the_totals():
    c = PrefixCache(8, block_size=2)
    c.grow("a", [1, 2, 3, 4], 4)
    c.match([1, 2, 3, 4, 5])
    c.clear()
    assert c.used == 0 and c.sessions == {} and c.peek([1, 2, 3, 4, 5]) == 0
    assert (c.queries, c.hits, c.inserted) == (5, 4, 2)


def test_random_operations_keep_the_invariants():
    """References equal the sessions holding a block, stored blocks never exceed the ids,
    every session's chain is a path from the root, and a match always spells a prefix."""
    rng = random.Random(7)
    c = PrefixCache(24, block_size=2)
    live: dict[str, list[int]] = {}
    for step in range(3000):
        op = rng.random()
        sid = f"s{rng.randrange(6)}"
        if op < 0.45:
            base = live.get(sid) or [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
            toks = base + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            live[sid] = toks
            c.grow(sid, toks, len(toks))
        elif op < 0.6 and sid in live:
            n = rng.randrange(len(live[sid]) + 1)
            live[sid] = live[sid][:n]
            c.truncate(sid, n)
        elif op < 0.7:
            live.pop(sid, None)
            c.detach(sid)
        else:
            q = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            chain = c.match(q, len(q) - 1)
            spelled = [t for b in chain for t in b.tokens]
            assert spelled == q[:len(spelled)] and len(spelled) <= len(q) - 1
        refs: dict[int, int] = {}
        for s, chain in c.sessions.items():
            node = c.root
            for b in chain:
                assert b.parent is node and node.children[b.tokens] is b
                refs[id(b)] = refs.get(id(b), 0) + 1
                node = b
            assert [t for b in chain for t in b.tokens] == live.get(s, [])[:len(chain) * 2]
        seen = []
        walk_all(c, lambda b: seen.append(b))
        assert len(seen) == c.used <= c.n_blocks
        assert len({b.id for b in seen}) == len(seen)
        for b in seen:
            assert b.refs == refs.get(id(b), 0)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(4, block_size=0)
    with pytest.raises(ValueError, match="n_blocks"):
        PrefixCache(-1)


def test_a_salt_keeps_a_tenants_blocks_its_own():
    """Blocks stored under one salt (a tenant's prompt and answer) are not matched, shared
    or counted as hits under another, nor unsalted; under their own they are."""
    c = PrefixCache(32, block_size=4)
    text = list(range(50, 70))  # a prompt and its answer: 5 blocks
    c.attach("a", [], "tenant-1")
    assert len(c.grow("a", text, len(text))) == 5
    assert c.peek(text, salt="tenant-2") == 0 and c.peek(text) == 0
    assert c.peek(text, salt="tenant-1") == 20
    hits = c.hits
    assert c.match(text, 19, "tenant-2") == [] and c.hits == hits  # another tenant's guess: nothing, no hit
    c.attach("b", c.match(text, 19, "tenant-2"), "tenant-2")
    assert len(c.grow("b", text, len(text))) == 5  # stored again, under its own salt: nothing shared
    assert c.used == 10
    c.fork("a", "a2", 8)
    assert c.salts["a2"] == "tenant-1" and c.sessions["a2"] == c.sessions["a"][:2]
    for s in ("a", "a2", "b"):
        c.detach(s)
    assert set(c.roots) == {"", "tenant-1", "tenant-2"}  # their blocks stay cached
    for _ in range(10):  # unsalted blocks fill the cache: the tenants' are evicted and their roots go
        c.attach("x", [], "")
        c.grow("x", [c.used + 1000 + i for i in range(32)], 32)
        c.detach("x")
    assert set(c.roots) == {""}


def test_an_empty_salted_root_is_forgotten_when_its_session_ends():
    c = PrefixCache(8, block_size=4)
    for i in range(50):  # a salt per request that stores nothing (prompts under one block)
        c.attach(f"s{i}", [], f"salt-{i}")
        c.grow(f"s{i}", [1, 2, 3], 3)
        c.detach(f"s{i}")
    assert set(c.roots) == {""}
