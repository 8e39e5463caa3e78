"""Divergence decoding on the real SmolLM2-135M-Instruct (fp32) with the committed code
specialist (checkpoints/smollm2-code-specialist: a LoRA adapter merged into the
target's weights at load): the runtime offers it as the ``specialist`` self drafter;
it is another model (its logits differ from the target's) with the target's
vocabulary; greedy tau = 0 is the target's greedy output token for token; tau = 0.3
accepts specialist drafts; every accepted length obeys the rule (re-checked from the
two models' logits of the round)."""

from __future__ import annotations

import pytest
import torch

from specmesh import acceptance as A
from specmesh.loop import generate_tokens
from specmesh.drafters.specialist import adapter_dir
from specmesh.types import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(adapter_dir() is None,
                                 reason="no code specialist adapter (checkpoints/smollm2-code-specialist; "
                                        "`specmesh train-specialist --domain code` trains it)")]

PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."
N = 32


@pytest.fixture(scope="module")
def spec(runtime):
    if runtime.specialist is None:
        pytest.skip("the runtime has no specialist")
    return runtime.specialist


def test_the_specialist_is_another_model_with_the_targets_vocabulary(runtime, spec):
    ids = runtime.encode(PROMPT)
    eng = spec.engine
    assert eng.vocab_size == runtime.engine.vocab_size and eng.dtype_name == runtime.engine.dtype_name
    eng.reset(0)
    ls = eng.prefill(0, ids).float()
    eng.reset(0)
    t = runtime.engine
    slot = t.n_slots - 1
    t.reset(slot)
    lt = t.prefill(slot, ids).float()
    t.reset(slot)
    js = float(A.jsd_bits(torch.softmax(ls.double(), -1)[None], torch.softmax(lt.double(), -1)[None])[0])
    assert 1e-6 < js < 0.5  # close (a fine-tune of it) but not the same distribution


def test_greedy_threshold_zero_is_the_targets_greedy_output(runtime, spec):
    ids = runtime.encode(PROMPT)
    ref, _ = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids)
    out, st = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids,
                              sampling=SamplingParams(acceptance="divergence", jsd_threshold=0.0),
                              self_draft="specialist", budget=4)
    assert out == ref and st.drafted_tokens > 0 and st.accepted_tokens == 0


def test_threshold_accepts_specialist_drafts_by_the_rule(runtime, spec):
    ids = runtime.encode(PROMPT)
    seen = []
    orig = runtime.verifier.verify_batch

    def recording(reqs):
        out = orig(reqs)
        for r, res in zip(reqs, out):
            if r.self_draft is not None and not isinstance(res, BaseException) and res.drafted:
                seen.append((list(spec.tokens(r.session_id)), spec.draft_logits(r.session_id).clone(), res))
        return out

    runtime.verifier.verify_batch = recording
    try:
        out, st = generate_tokens(None, runtime.verifier, ids, max_new_tokens=N, stop_ids=runtime.stop_ids,
                                  sampling=SamplingParams(acceptance="divergence", jsd_threshold=0.3),
                                  self_draft="specialist", budget=4)
    finally:
        del runtime.verifier.verify_batch
    assert st.accepted_tokens > 0 and seen
    t, slot = runtime.engine, runtime.engine.n_slots - 1
    for hist, srows, res in seen[:4]:  # re-check the first rounds from the target's own logits
        k = res.drafted
        ctx, chain = hist[:-k], hist[-k:]
        t.reset(slot)
        t.prefill(slot, ctx[:-1])
        toks = [ctx[-1]] + chain
        trows = t.score(slot, toks, list(range(-1, len(toks) - 1))).logits.float()
        t.reset(slot)
        js = A.divergence_jsd(trows, srows)
        over = (js > 0.3).tolist()
        n = over.index(True) if True in over else k
        assert len(res.accepted) == n and res.accepted == chain[:n]
        assert res.next_token == int(trows[n].argmax())
