"""Host reads per verify round (``specmesh.engine.device.host_reads``): every device -> host
read on the serving path goes through one counting helper, so this CPU test counts
what a GPU round would wait for. A round here is one ``EngineVerifier.verify`` after
the prompt's, on ``GraphedEngine``'s static forward (the CUDA path, run without
capture) with the batched acceptance kernels (their torch reference: the code path a
GPU takes), for each drafter, greedy and sampled, the entropy asked for as the router
does. The counts are the real ones; the targets (greedy <= 2, sampled <= 3) hold for
external drafters, the block drafter, uno and greedy layer-skip; sampled layer-skip
reads each drafted token (pinned here, named in docs/design.md)."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.device import counting_host_reads
from specmesh.types import SamplingParams, SelfDraft, TokenTree, VerifyRequest
from tests.support import tiny_hf

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, seed=3)
PROMPT = [(7 * i + 3) % 90 + 2 for i in range(20)] * 2
BUDGET = 5


@pytest.fixture(scope="module")
def verifier():
    from specmesh.blockdraft.model import BlockDrafterConfig
    from specmesh.blockdraft.serve import BlockSelfDrafter
    from specmesh.blockdraft.train import new_model
    from specmesh.engine.cudagraph import GraphedEngine
    from specmesh.drafters.model_drafters import LayerSkipDrafter
    from specmesh.uno.adapter import new_adapter
    from specmesh.uno.serve import UnoDrafter
    from specmesh.verifier import EngineVerifier

    model, cfg = tiny_hf()
    v = EngineVerifier(GraphedEngine(cfg, model.state_dict(), n_slots=2, max_seq_len=256, capture=False))
    v.batched_acceptance = True  # the kernels' path, as on a GPU
    v.self_drafters["layerskip"] = LayerSkipDrafter(v, exit_layer=1)
    torch.manual_seed(0)
    bcfg = BlockDrafterConfig(block=4, n_layers=1, hidden=64, n_heads=4, ffn=96, feature_layers=[0, 2],
                              context_window=32, vocab_size=96, n_keep=96)
    d = BlockSelfDrafter(v, new_model(bcfg, model.state_dict(), torch.arange(96)), amp=False)
    v.self_drafters["block"] = d
    v.self_drafters["block_tree"] = BlockSelfDrafter(v, d.model, tree=True, folded=d.folded, amp=False)
    v.self_drafters["uno"] = UnoDrafter(v, new_adapter(cfg, rank=4, readout=8, block=3))
    return v


def _reads_per_round(v, method, sampling, rounds=4) -> list[int]:
    """Host reads of each verify round after the prompt's (self drafting inside the verifier,
    or an external prompt-lookup draft sent in the request)."""
    from specmesh.drafters.prompt_lookup import PromptLookupDrafter
    from specmesh.types import DraftContext

    sid = f"{method}-{sampling.greedy}"
    v.release(sid)
    toks, keep, out = list(PROMPT), 0, []
    pl = PromptLookupDrafter()
    for r in range(rounds + 1):
        tree, sd = TokenTree(), None
        if method == "prompt_lookup":
            tree = pl.propose(DraftContext(sid, toks, 0, sampling, round_seed=r), BUDGET)
        else:
            sd = SelfDraft(method, BUDGET)
        with counting_host_reads() as c:
            res = v.verify(VerifyRequest(sid, keep, toks[keep:], tree, sampling, round_seed=r, self_draft=sd,
                                         want_entropy=True))
        keep = len(toks)
        toks += res.accepted + [res.next_token]
        if r:
            out.append(sum(c.values()))
    return out


# (drafter, sampling) -> reads per round: what the round reads today
EXPECTED = {
    ("prompt_lookup", "greedy"): 1,  # the acceptance decisions (+ entropy) in one read
    ("prompt_lookup", "sampled"): 1,
    ("block", "greedy"): 2,  # the draft (its cache checked by stamps, no read) + acceptance
    ("block", "sampled"): 2,
    ("block_tree", "greedy"): 2,
    ("block_tree", "sampled"): 2,
    ("uno", "greedy"): 2,  # the draft (from the kept mask rows) + acceptance
    ("uno", "sampled"): 2,
}


@pytest.mark.parametrize("method,mode", sorted(EXPECTED))
def test_host_reads_per_round(verifier, method, mode):
    got = _reads_per_round(verifier, method, GREEDY if mode == "greedy" else SAMPLED)
    assert got == [EXPECTED[(method, mode)]] * len(got), got


def test_layerskip_greedy_feeds_its_tokens_on_the_device(verifier):
    """Greedy layer-skip: each step's argmax goes into the next step's bucket on the device
    (``GraphedEngine.score_token``): the draft is read once, then acceptance's one."""
    got = _reads_per_round(verifier, "layerskip", GREEDY)
    assert got == [2] * len(got), got


def test_layerskip_sampled_reads_each_drafted_token(verifier):
    """Sampled layer-skip draws each token on the host (the round's CPU generator): one read
    per drafted token, then acceptance's one."""
    got = _reads_per_round(verifier, "layerskip", SAMPLED)
    assert got == [BUDGET + 1] * len(got), got


def test_layerskip_greedy_draft_is_the_same_on_the_device_path():
    """The device-fed draft loop drafts what the host loop drafts (eager engine: host loop)."""
    from specmesh.engine.cudagraph import GraphedEngine
    from specmesh.drafters.model_drafters import LayerSkipDrafter
    from specmesh.engine import LlamaEngine
    from specmesh.types import DraftContext
    from specmesh.verifier import EngineVerifier

    model, cfg = tiny_hf()
    drafts = []
    for eng in (LlamaEngine(cfg, model.state_dict(), n_slots=1, max_seq_len=128),
                GraphedEngine(cfg, model.state_dict(), n_slots=1, max_seq_len=128, capture=False)):
        v = EngineVerifier(eng)
        d = LayerSkipDrafter(v, exit_layer=2)
        v.prefill("s", PROMPT[:-1])
        drafts.append(d.propose(DraftContext("s", PROMPT[-1:], 0, GREEDY), 6).tokens)
    assert drafts[0] == drafts[1] and len(drafts[0]) == 6
