"""Greedy identity on the real SmolLM2-135M-Instruct (fp32): for every drafter, the
speculative tokens equal plain greedy decoding on 5 prompts x 64 new tokens (the
per-token model drafters, draft_lm and layerskip, on the first 3)."""

from __future__ import annotations

import pytest

from specmesh.loop import generate_tokens
from specmesh.types import SamplingParams

pytestmark = pytest.mark.slow

CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)
'''

PROMPTS = [
    "Rename the function `mean` to `average` and return the full code:\n\n" + CODE,
    "Write a haiku about the sea.",
    "Summarise, quoting the key phrase: \"The bridge was closed for repairs after the storm, and the city "
    "opened a ferry service until the work is finished.\"",
    "List three uses of a paper clip.",
    "Explain in two sentences why the sky is blue.",
]
N = 64


@pytest.fixture(scope="module")
def references(runtime):
    refs = []
    for p in PROMPTS:
        ids = runtime.encode(p)
        out, _ = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids)
        refs.append((ids, out))
    return refs


@pytest.mark.parametrize("name", ["prompt_lookup", "suffix", "draft_lm", "layerskip"])
def test_drafter_greedy_identity(runtime, references, name):
    drafter = runtime.drafter(name)
    total_acc = 0
    # the drafters that cost a model step per drafted token run on the first three prompts (CI time)
    for ids, ref in references if name in ("prompt_lookup", "suffix") else references[:3]:
        out, st = generate_tokens(drafter, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids,
                                  budget=6)
        assert out == ref, f"{name} diverged from plain greedy"
        total_acc += st.accepted_tokens
    if name in ("prompt_lookup", "suffix"):
        assert total_acc > 0  # the code-edit prompt copies the prompt


def test_self_draft_in_verifier_identity(runtime, references):
    for ids, ref in references[:2]:
        out, st = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids,
                                  budget=3, self_draft="layerskip")
        assert out == ref and st.drafted_tokens > 0


def test_sampled_speculation_runs_and_is_seeded(runtime):
    ids = runtime.encode(PROMPTS[1])
    s = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    d = runtime.drafter("draft_lm")
    a, _ = generate_tokens(d, runtime.verifier, ids, sampling=s, max_new_tokens=24, stop_ids=runtime.stop_ids)
    b, _ = generate_tokens(d, runtime.verifier, ids, sampling=s, max_new_tokens=24, stop_ids=runtime.stop_ids)
    assert a == b and a


@pytest.mark.parametrize("method", ["block", "block_tree"])
def test_trained_block_drafter_through_self_is_identical(runtime, references, method):
    """The committed block drafter (checkpoints/smollm2-block-drafter) in the verifier."""
    assert method in runtime.verifier.self_drafters, "the bundled block drafter checkpoint was not attached"
    drafted = 0
    for ids, ref in references[:3]:
        out, st = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids,
                                  budget=7 if method == "block" else 12, self_draft=method)
        assert out == ref
        drafted += st.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("method", ["uno", "uno_tree", "uno_separate"])
def test_mask_gated_adapter_through_self_is_identical(runtime, references, method):
    """The committed mask-gated adapter (checkpoints/smollm2-uno): the target drafting for
    itself, its next draft out of the last verify forward (fused) or a draft pass."""
    assert method in runtime.verifier.self_drafters, "the bundled uno adapter was not attached"
    d = runtime.verifier.self_drafters[method]
    drafted, kept0 = 0, d.rounds["kept"]
    for ids, ref in references[:2 if method != "uno_separate" else 1]:  # CI time: 5 generations in all
        out, st = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids,
                                  budget=8, self_draft=method)
        assert out == ref
        drafted += st.drafted_tokens
    assert drafted > 0
    if d.fused:
        assert d.rounds["kept"] > kept0  # the blocks of the verify forwards were used


def test_diffusion_mode_speculation_and_refinement_on_the_real_model(runtime, references):
    """Trajectory speculation (the best-first guess tree with the lookahead) returns plain
    unmasking's tokens; draft-and-refine returns plain greedy decoding's (the references)."""
    from specmesh.uno.diffusion import Unmasking

    dec = Unmasking(runtime.engine, block=5, slot=runtime.engine.n_slots - 1)
    for ids, ref in references[:2]:
        plain, ps = dec.generate(ids, 24, stop_ids=runtime.stop_ids)
        spec, ss = dec.generate(ids, 24, stop_ids=runtime.stop_ids, speculate="tree", depth=5, budget=12)
        assert spec == plain and ss.forwards < ps.forwards  # the guess tree and its lookahead
        out, _ = dec.refine(ids, 24, stop_ids=runtime.stop_ids)
        assert out == ref[:24]


def test_int4_speculation_equals_int4_plain_decoding():
    """int4 (batch-invariant, like bf16/int8): prompt lookup and the block drafter's chain
    and tree return exactly the int4 engine's own plain greedy tokens on the real model,
    whose int4 weights are the GGUF's own Q4_1 blocks (its Q8_0 table as the tied head)."""
    from specmesh.runtime import Runtime

    rt = Runtime("smollm2-135m-instruct", dtype="int4", n_slots=2, max_seq_len=1024, quiet=True)
    assert rt.engine.batch_invariant and rt.engine.int4_blocks
    assert rt.engine.layers[0].qkv.qm.type_names == ["Q4_1"] * 3 and rt.engine.head.qm.type_names == ["Q8_0"]
    for p in PROMPTS[:3]:
        ids = rt.encode(p)
        ref, _ = generate_tokens(None, rt.verifier, ids, max_new_tokens=N, stop_ids=rt.stop_ids)
        out, _ = generate_tokens(rt.drafter("prompt_lookup"), rt.verifier, ids, max_new_tokens=N,
                                 stop_ids=rt.stop_ids, budget=6)
        assert out == ref, "prompt_lookup diverged from int4 plain decoding"
        for method in ("block", "block_tree"):
            if method in rt.verifier.self_drafters:
                out, st = generate_tokens(None, rt.verifier, ids, max_new_tokens=N, stop_ids=rt.stop_ids,
                                          budget=6, self_draft=method)
                assert out == ref and st.drafted_tokens > 0, f"{method} diverged from int4 plain decoding"
