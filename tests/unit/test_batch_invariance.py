"""Batch-invariant engine: a row's logits and hidden states are bitwise the same
whether it is scored alone, as row j of a chain, as a node of a tree, or beside other
sessions in ``score_batch``; the KV a prompt leaves does not depend on how it was
split; so greedy speculation returns exactly the tokens of plain decoding in bf16, int8
and int4 (and fp32), like the loop promises. The ragged forward (``batch_invariant=False``,
the engine before) fails these in bf16 and int8 on the development machine;
``test_ragged_forward_is_not_invariant`` shows its rows differing (and skips where the
ragged forward happens to agree). Whether those differences also flip a greedy token is
up to the CPU's kernels, so no test here claims it: the test that ran the loop on the
ragged forward asserted nothing (it passed where generations differed and skipped
where they did not) and was removed (issue 50)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support import tiny_engine
from specmesh.drafters.prompt_lookup import PromptLookupDrafter
from specmesh.loop import AdaptiveBudget, generate_tokens
from specmesh.types import TokenTree
from specmesh.verifier import EngineVerifier

DTYPES = ["fp32", "bf16", "int8", "int4"]
V = 96  # tiny vocabulary
# the invariant forward's two attentions: rows naming their keys (the C kernel, where it
# builds) and torch's SDPA on fixed tiles, a tree one path at a time
ATTENTIONS = ["keylist", "sdpa"]


def _engine(dtype, invariant=True, max_seq_len=400, attention=None):
    from specmesh.engine import keylist_attention
    from specmesh.engine import LlamaEngine

    eng, model = tiny_engine(dtype, n_slots=3, max_seq_len=max_seq_len)
    if invariant is not None:
        eng.set_batch_invariant(invariant)
    if attention == "keylist" and keylist_attention.load() is None:
        pytest.skip(f"the key-list kernel does not build here: {keylist_attention.load_error()}")
    if attention is not None:
        eng.set_attention(attention)
        assert eng.attention == attention
    assert isinstance(eng, LlamaEngine)
    return eng


def _chain(n):
    return list(range(-1, n - 1))


def _alone(eng, slot, prompt, tokens, layers=(0, 2)):
    """Logits and hidden states of ``tokens`` after ``prompt``, one token per forward."""
    eng.reset(slot)
    eng.prefill(slot, prompt)
    logits, hidden = [], {i: [] for i in layers}
    for t in tokens:
        out = eng.score(slot, [t], [-1], hidden_layers=layers)
        logits.append(out.logits[0])
        for i in layers:
            hidden[i].append(out.hidden[i][0])
        eng.commit(slot, [0])
    return torch.stack(logits), {i: torch.stack(h) for i, h in hidden.items()}


def _cases(seed, n=6):
    """(rng, prompt, tokens): short prompts and long ones (keys past several blocks)."""
    rnd = random.Random(seed)
    for k in range(n):
        prompt = [rnd.randrange(V) for _ in range(rnd.randint(1, 70) if k % 2 == 0 else rnd.randint(150, 300))]
        toks = [rnd.randrange(V) for _ in range(rnd.randint(2, 10))]
        yield rnd, prompt, toks


def _mismatches(eng, seed=0, n=6):
    """How many of n cases give a row other logits in a chain, a tree or a batch than alone."""
    bad = {"chain": 0, "tree": 0, "batch": 0, "hidden": 0}
    for rnd, prompt, toks in _cases(seed, n):
        ref, ref_h = _alone(eng, 0, prompt, toks)
        # row j of a chain (the prompt's last token leads it: prefill split differently)
        eng.reset(1)
        if len(prompt) > 1:
            eng.prefill(1, prompt[:-1])
        out = eng.score(1, [prompt[-1]] + toks, _chain(len(toks) + 1), hidden_layers=(0, 2))
        bad["chain"] += not torch.equal(out.logits[1:], ref)
        bad["hidden"] += not all(torch.equal(out.hidden[i][1:], ref_h[i]) for i in (0, 2))
        # nodes of a tree: every path node has a sibling decoy before it
        eng.truncate(1, len(prompt) - 1)
        eng.prefill(1, prompt[-1:])
        tt, tp, path, prev = [], [], [], -1
        for t in toks:
            tt.append(rnd.randrange(V))
            tp.append(prev)
            tt.append(t)
            tp.append(prev)
            prev = len(tt) - 1
            path.append(prev)
        tree = eng.score(1, tt, tp, hidden_layers=(0, 2))
        bad["tree"] += not torch.equal(tree.logits[path], ref)
        bad["hidden"] += not all(torch.equal(tree.hidden[i][path], ref_h[i]) for i in (0, 2))
        # committing the path leaves the KV of plain decoding: the next token agrees too
        eng.commit(1, path)
        nxt = eng.score(1, [7], [-1]).logits[0]
        eng.truncate(0, len(prompt) + len(toks))
        bad["tree"] += not torch.equal(nxt, eng.score(0, [7], [-1]).logits[0])
        # in score_batch beside other sessions of other lengths, a chain and a tree
        eng.truncate(1, len(prompt))
        eng.reset(2)
        eng.prefill(2, [rnd.randrange(V) for _ in range(rnd.randint(1, 50))])
        eng.truncate(0, len(prompt))
        m = min(3, len(toks))
        res = eng.score_batch([(2, [3, 4, 5, 6], [-1, 0, 0, 2]), (1, toks, _chain(len(toks))),
                               (0, toks[:m], _chain(m))], rows=[None, None, [m - 1, 0]])
        bad["batch"] += not torch.equal(res[1].logits, ref)
        bad["batch"] += not torch.equal(res[2].logits, ref[[m - 1, 0]])
    return bad


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_logits_bitwise_invariant(dtype, attention):
    eng = _engine(dtype, attention=attention)
    assert _mismatches(eng) == {"chain": 0, "tree": 0, "batch": 0, "hidden": 0}


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_independent_of_prefill_split(dtype, attention):
    eng = _engine(dtype, attention=attention)
    prompt = [random.Random(3).randrange(V) for _ in range(57)]
    eng.prefill(0, prompt)
    eng.prefill(1, prompt[:20])
    for t in prompt[20:40]:
        eng.prefill(1, [t])
    eng.prefill(1, prompt[40:])
    n = len(prompt)
    assert torch.equal(eng.k_cache[:, 0, :, :n], eng.k_cache[:, 1, :, :n])
    assert torch.equal(eng.v_cache[:, 0, :, :n], eng.v_cache[:, 1, :, :n])


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_token_of_a_sequence(dtype, attention):
    """Position 0 (no key before it) alone, and as the first row of a chain or of a batch."""
    eng = _engine(dtype, attention=attention)
    alone = eng.prefill(0, [9])
    chain = eng.score(1, [9, 4, 4, 2], _chain(4)).logits
    eng.prefill(2, [1, 2, 3])
    batch = eng.score_batch([(2, [8, 9], [-1, 0]), (1, [9, 5], [-1, -1])])[1].logits
    assert torch.equal(chain[0], alone) and torch.equal(batch[0], alone) and torch.equal(batch[1], eng.score(
        1, [5], [-1]).logits[0])


def test_each_query_meets_the_key_length_it_gets_alone():
    """SDPA's bits for a query depend on the padded key length (an AVX2 CPU: 256 vs 320
    keys), so the invariant forward pads each query to the key block of its own last key:
    a chain or tree that crosses a block boundary is attended in one call per block, and
    every call's key length is what each of its rows gets when scored alone."""
    eng = _engine("bf16")
    B = eng.key_block
    for base, par in [(B - 3, _chain(9)), (2 * B - 1, _chain(3)), (B - 2, [-1, 0, 0, 1, 2, 3, 4]),
                      (5, _chain(2 * B + 3))]:
        plan = eng._attn_plan([(0, 0, len(par), base, par)], len(par))
        calls = plan[0][5]
        seen = []
        for c in calls:
            rows = c.out_rows.tolist()
            seen += rows
            depth = {r: 0 for r in rows}
            for r in rows:  # a node's depth: its ancestors' count
                p, d = par[r], 0
                while p >= 0:
                    p, d = par[p], d + 1
                depth[r] = d
            assert {-(-(base + depth[r] + 1) // B) * B for r in rows} == {c.Lp}, (base, par, rows, c.Lp)
        assert sorted(seen) == list(range(len(par)))
    # crossing: a chain from key B - 3 over 9 tokens is two calls (keys B and 2B)
    assert [c.Lp for c in eng._attn_plan([(0, 0, 9, B - 3, _chain(9))], 9)[0][5]] == [B, 2 * B]


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_ragged_forward_is_not_invariant(dtype):
    """The engine before (one matmul over all rows, one SDPA per sequence) differs: what
    the tests above catch."""
    bad = _mismatches(_engine(dtype, invariant=False), n=6)
    if not any(bad.values()):  # other CPUs, other kernels: then the check above proves less here
        pytest.skip("the ragged forward happens to be batch-invariant on this machine")
    # which kinds break depends on the CPU's kernels (on 2 AMD EPYC AVX-512 cores the int8
    # ragged chain happened to agree and only the batch rows differed)
    assert bad["chain"] + bad["tree"] + bad["batch"] > 0, bad


def test_default_is_invariant_for_bf16_int8_and_int4_on_cpu():
    assert _engine("bf16", invariant=None).batch_invariant
    assert _engine("int8", invariant=None).batch_invariant
    assert _engine("int4", invariant=None).batch_invariant
    assert not _engine("fp32", invariant=None).batch_invariant


# ---------------------------------------------------------------- through the loop

class NoisyOracle:
    """Drafts the true greedy continuation with some tokens corrupted: long chains that
    are mostly accepted (so many rows of a 9-row verify become committed tokens), or
    trees with a decoy branch at each of the first levels."""

    name = "oracle"

    def __init__(self, truth, prompt_len, tree=False, noise=0.15, seed=0):
        self.truth, self.p, self.tree, self.noise = truth, prompt_len, tree, noise
        self.rng = random.Random(seed)

    def propose(self, ctx, budget):
        done = len(ctx.tokens) - self.p
        cont = [t if self.rng.random() > self.noise else (t + 1) % V for t in self.truth[done: done + budget]]
        if not self.tree or len(cont) < 3:
            return TokenTree.chain(cont)
        toks, pars, prev = [], [], -1
        for i, t in enumerate(cont):
            if i < 3:  # a decoy sibling first, so the path's nodes are not at chain positions
                toks.append((t + 5) % V)
                pars.append(prev)
            toks.append(t)
            pars.append(prev)
            prev = len(toks) - 1
        return TokenTree(toks, pars)

    def release(self, sid):
        pass

    def finish(self, sid, tokens, prompt_len):
        pass


def _prompts():
    rnd = random.Random(11)
    motif = [rnd.randrange(V) for _ in range(7)]
    out = [motif * 4 + [rnd.randrange(V) for _ in range(3)]]  # repetitive: prompt lookup drafts long chains
    out += [[rnd.randrange(V) for _ in range(rnd.randint(4, 40))] for _ in range(5)]
    return out


def _identity_failures(dtype, invariant, max_new=48, attention=None):
    eng = _engine(dtype, invariant=invariant, attention=attention)
    ver = EngineVerifier(eng, max_tree_nodes=32)
    fails = []
    for k, prompt in enumerate(_prompts()):
        plain, _ = generate_tokens(None, ver, prompt, max_new_tokens=max_new)
        drafters = {"prompt_lookup": PromptLookupDrafter(),
                    "oracle_chain": NoisyOracle(plain, len(prompt), seed=k),
                    "oracle_tree": NoisyOracle(plain, len(prompt), tree=True, seed=k)}
        for name, d in drafters.items():
            out, _ = generate_tokens(d, ver, prompt, max_new_tokens=max_new, budget=AdaptiveBudget(8))
            if out != plain:
                fails.append((k, name))
        for budget in (4, 8):  # fixed long drafts
            out, _ = generate_tokens(NoisyOracle(plain, len(prompt), noise=0.05, seed=k), ver, prompt,
                                     max_new_tokens=max_new, budget=budget)
            if out != plain:
                fails.append((k, f"fixed{budget}"))
    return fails


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4", "fp32"])
def test_greedy_speculation_equals_plain_decoding(dtype, attention):
    assert _identity_failures(dtype, invariant=True, attention=attention) == []
