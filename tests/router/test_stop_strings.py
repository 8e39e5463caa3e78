"""Stop strings in the router (``router.core.StopText``, ``tokens_through``): the
text ends just before the first stop string, text that may begin one is held back
while streaming, and the kept tokens run through the one that completed it."""

from __future__ import annotations

import random

from specmesh.router.core import StopText, tokens_through


def run(pieces, stops):
    st = StopText(stops)
    out = [st.push(p) for p in pieces]
    out.append(st.flush())
    return "".join(out), st


def test_cut_before_the_first_stop_string_across_pieces():
    text, st = run(["Hello wo", "rld. Bye", " now"], ["world", "Bye"])
    assert text == "Hello " and st.matched == "world" and st.end == len("Hello world")
    text, st = run(["ab", "c"], ["zz"])
    assert text == "abc" and st.matched is None


def test_earliest_match_wins_and_nothing_after_it_is_emitted():
    text, st = run(["xxABCD", "EF"], ["CD", "AB"])
    assert text == "xx" and st.matched == "AB"
    assert st.push("more") == "" and st.flush() == ""


def test_at_most_the_longest_stop_minus_one_characters_are_held_back():
    st = StopText(["STOP", "x"])
    assert st.push("abcST") == "ab"  # the last 3 characters could begin "STOP"
    assert st.push("O") == "c"
    assert st.push("Q") == "S"  # "TOQ" held, though it can no longer be a stop string
    assert st.flush() == "TOQ"


def test_streamed_text_equals_the_one_shot_cut_on_random_splits():
    rng = random.Random(0)
    for _ in range(300):
        full = "".join(rng.choice("ab\n ") for _ in range(rng.randrange(1, 40)))
        stops = ["".join(rng.choice("ab\n ") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        cuts = sorted(rng.sample(range(1, len(full) + 1), min(len(full), rng.randrange(0, 6))))
        pieces = [full[i:j] for i, j in zip([0] + cuts, cuts + [len(full)])]
        hits = [(i, s) for s in stops for i in [full.find(s)] if i >= 0]
        want = full[: min(hits)[0]] if hits else full
        text, st = run(pieces, stops)
        assert text == want, (full, stops, pieces)
        assert (st.matched is None) == (not hits)


def test_tokens_through_the_stop_string():
    vocab = {1: "He", 2: "llo", 3: " wor", 4: "ld", 5: "!"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    ids = [1, 2, 3, 4, 5]
    assert tokens_through(decode, ids, len("Hello wo")) == 3  # " wor" completes "wo"
    assert tokens_through(decode, ids, len("Hello world")) == 4
    assert tokens_through(decode, ids, 0) == 0
    assert tokens_through(decode, ids, len("Hello"), lo=2) == 2
