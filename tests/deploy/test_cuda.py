"""On a CUDA GPU (skipped without one; ``specmesh device-check`` runs them):

- ``GraphedEngine`` with captured CUDA graphs equals the eager engine on the same GPU
  (fp32, TF32 off): chains, trees, several sessions, padded buckets, graphs replayed
  with new inputs, and the KV the replays wrote;
- the block drafter's serving pass on the GPU equals its CPU pass;
- greedy speculative decoding equals plain decoding on the real model on the GPU
  (fp32, TF32 off, CUDA graphs) for prompt lookup, layer-skip, the block tree and the
  mask-gated adapter's fused rounds (``uno``, ``uno_tree``: their mask rows in the graphs);
- the gated rows in captured graphs equal the eager engine's;
- the batch-invariant graphs (``cuda_graphs="invariant"``): rows bitwise independent of the
  call on this GPU, and bf16 greedy speculation with chain drafters equal to bf16 plain
  decoding (trees are not invariant there: ``specmesh.engine.cudagraph``);
- every bucket these tests use ran as a captured graph (``_all_captured``: a failed capture
  is a test failure), and the Runtime's start-up warm-up left nothing to capture.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import tiny_hf

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def no_tf32():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _same(a, b, atol=1e-4):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.logits.device.type == "cuda" and y.logits.device.type == "cuda"
        torch.testing.assert_close(y.logits, x.logits, atol=atol, rtol=0)
        assert torch.equal(x.logits.argmax(-1), y.logits.argmax(-1))


def test_resolve_device_on_cuda():
    from specmesh.engine.device import describe, resolve_device

    d = resolve_device("auto")
    assert d.type == "cuda" and resolve_device("cuda:0") == torch.device("cuda", 0)
    assert "GiB" in describe(d)


def test_graphed_engine_captured_equals_eager():
    from specmesh.engine.cudagraph import GraphedEngine
    from specmesh.engine import LlamaEngine

    model, cfg = tiny_hf()
    sd = model.state_dict()
    eager = LlamaEngine(cfg, sd, n_slots=3, max_seq_len=128, device="cuda")
    graphed = GraphedEngine(cfg, sd, n_slots=3, max_seq_len=128, device="cuda")
    assert graphed.capture
    for e in (eager, graphed):
        e.prefill(0, list(range(5, 17)))
        e.prefill(1, list(range(30, 33)))
        e.prefill(2, [7])
    items = [(0, [40, 41, 42], [-1, 0, 1]), (2, [50, 51, 52, 53, 54, 55], [-1, 0, 0, 1, 1, 2]), (1, [60], [-1])]
    rows = [None, [0, 3, 5], [0]]
    _same(eager.score_batch(items, rows=rows), graphed.score_batch(items, rows=rows))
    for e in (eager, graphed):
        e.commit(0, [0, 1, 2])
        e.commit(2, [0, 1, 4])
        e.commit(1, [0])
    for r in range(5):  # the same graphs replayed on new inputs and lengths
        items = [(2, [61 + r, 62], [-1, -1]), (0, [63], [-1]), (1, [64, 65, 66, 67, 68 + r], [-1, 0, 1, 2, 3])]
        _same(eager.score_batch(items), graphed.score_batch(items))
        for e in (eager, graphed):
            e.commit(1, [0, 1])
            e.commit(0, [0])
    assert [graphed.length(s) for s in range(3)] == [eager.length(s) for s in range(3)]
    for n in (1, 2, 4, 8, 16):
        chain = [(0, [(7 * i + n) % 96 for i in range(n)], list(range(-1, n - 1)))]
        _same(eager.score_batch(chain, hidden_layers=[1]), graphed.score_batch(chain, hidden_layers=[1]))
    assert graphed.calls["captures"] >= 5 and graphed.calls["graphed"] > graphed.calls["eager"]
    _all_captured(graphed)


def _all_captured(eng):
    """Every bucket the test used ran as a captured graph (a failed capture falls back to
    the bucket's static forward, which computes the same numbers: only the counters tell)."""
    assert eng.calls["capture_errors"] == 0 and eng.uncaptured_buckets() == [], eng.uncaptured_buckets()
    assert eng.calls["uncaptured"] == 0 and eng.calls["replayed"] == eng.calls["graphed"] > 0, eng.calls


def test_graphed_engine_gated_rows_captured_equal_eager():
    from specmesh.engine.cudagraph import GraphedEngine
    from specmesh.engine import LlamaEngine
    from specmesh.uno.adapter import new_adapter

    model, cfg = tiny_hf()
    sd = model.state_dict()
    ad = new_adapter(cfg, rank=4, readout=8, block=3)
    g = torch.Generator().manual_seed(3)
    for d in ad.B:
        for p in d:
            d[p] = torch.randn(d[p].shape, generator=g) * 0.2
    eager = LlamaEngine(cfg, sd, n_slots=2, max_seq_len=128, device="cuda")
    graphed = GraphedEngine(cfg, sd, n_slots=2, max_seq_len=128, device="cuda")
    for e in (eager, graphed):
        e.attach_adapter(ad)
        e.prefill(0, list(range(5, 12)))
    m = eager.mask_id
    for r in range(3):  # replayed with new inputs
        toks, par = [20 + r, 21, 22] + [m] * 9, [-1, 0, 1, 0, 3, 4, 1, 6, 7, 2, 9, 10]
        _same([eager.score(0, toks, par)], [graphed.score(0, toks, par)])
    assert graphed.calls["captures"] >= 1 and graphed.calls["graphed"] >= 3
    _all_captured(graphed)


def test_block_drafter_pass_on_cuda_equals_cpu():
    from specmesh.blockdraft.incremental import FoldedDrafter
    from specmesh.blockdraft.model import BlockDrafter, BlockDrafterConfig

    torch.manual_seed(0)
    H = 64
    cfg = BlockDrafterConfig(block=4, n_layers=1, hidden=H, n_heads=4, ffn=96, feature_layers=[0, 1],
                             context_window=16, vocab_size=96, n_keep=32)
    model = BlockDrafter(cfg, torch.randn(96, H), torch.randn(96, H), torch.ones(H), torch.arange(32))
    feats = torch.randn(40, 2 * H)
    outs = []
    for dev in ("cpu", "cuda"):
        f = FoldedDrafter(model.to(dev).float())
        cache = f.new_cache()
        assert cache.kv.device.type == dev
        got = [f.draft(cache, 5, n, lambda a, b: feats[a:b]) for n in (10, 12, 30)]
        outs.append([g.cpu() for g in got])
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def gpu_runtime():
    from specmesh.runtime import Runtime

    return Runtime("smollm2-135m-instruct", dtype="fp32", n_slots=2, max_seq_len=1024, quiet=True, device="cuda")


@pytest.mark.slow  # the real model: the staged check's last call (device-check --phase model)
@pytest.mark.parametrize("drafter", ["prompt_lookup", "layerskip", "block_tree", "uno", "uno_tree"])
def test_greedy_speculation_identical_on_gpu(gpu_runtime, drafter):
    from specmesh.engine.cudagraph import GraphedEngine
    from specmesh.cli.demo import PROMPTS
    from specmesh.loop import AdaptiveBudget, generate_tokens

    rt = gpu_runtime
    assert isinstance(rt.engine, GraphedEngine) and rt.engine.k_cache.is_cuda
    if drafter != "prompt_lookup" and drafter not in rt.verifier.self_drafters:
        pytest.skip(f"no {drafter} drafter in this runtime")
    for _, prompt in PROMPTS[:2]:
        ids = rt.encode(prompt)
        plain, _ = generate_tokens(None, rt.verifier, ids, max_new_tokens=64, stop_ids=rt.stop_ids)
        kw = {"budget": AdaptiveBudget(8)}
        if drafter in rt.verifier.self_drafters:
            d, kw["self_draft"] = None, drafter
        else:
            d = rt.drafter(drafter)
        out, stats = generate_tokens(d, rt.verifier, ids, max_new_tokens=64, stop_ids=rt.stop_ids, **kw)
        assert out == plain, (drafter, prompt[:40])
    _all_captured(rt.engine)
    assert rt.warmup_s is not None and rt.engine.calls["serving_captures"] == 0  # the warm-up had them all


@pytest.fixture(scope="module")
def gpu_runtime_bf16_invariant():
    from specmesh.runtime import Runtime

    return Runtime("smollm2-135m-instruct", dtype="bf16", n_slots=2, max_seq_len=1024, quiet=True, device="cuda",
                   cuda_graphs="invariant")


def test_invariant_graphs_rows_do_not_depend_on_the_call():
    """The batch-invariant mode's premise on this GPU: with one bucket shape, a row's logits
    are bitwise the same alone, in a chain, in a prompt chunk and beside another session."""
    from specmesh.engine.cudagraph import GraphedEngine

    model, cfg = tiny_hf()
    sd = model.state_dict()
    a = GraphedEngine(cfg, sd, dtype="bf16", n_slots=2, max_seq_len=128, device="cuda", invariant=True,
                      invariant_tokens=16)
    b = GraphedEngine(cfg, sd, dtype="bf16", n_slots=2, max_seq_len=128, device="cuda", invariant=True,
                      invariant_tokens=16)
    prompt = [(7 * i + 3) % 96 for i in range(37)]
    a.prefill(0, prompt)
    for t in prompt:
        b.score(0, [t], [-1])
        b.commit(0, [0])
    assert torch.equal(a.k_cache[:, 0, :, :37], b.k_cache[:, 0, :, :37])
    chain = [40, 41, 42, 43, 44]
    whole = a.score(0, chain, list(range(-1, 4)))
    b.prefill(1, [9, 9, 9])
    for j, t in enumerate(chain):
        r = b.score_batch([(0, [t], [-1]), (1, [5], [-1])])[0]
        assert torch.equal(r.logits[0], whole.logits[j]), j
        b.commit(0, [0])
    assert a.calls["eager"] == 0 and a.calls["captures"] >= 1
    _all_captured(a)
    _all_captured(b)


# chains only: a tree node sees its ancestors at tree-layout key indices, not where the same
# tokens sit as a chain, so trees (block_tree, uno's mask blocks) are not invariant here
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["prompt_lookup", "block", "layerskip"])
def test_bf16_greedy_speculation_identical_with_invariant_graphs(gpu_runtime_bf16_invariant, drafter):
    from specmesh.cli.demo import PROMPTS
    from specmesh.loop import AdaptiveBudget, generate_tokens

    rt = gpu_runtime_bf16_invariant
    assert rt.engine.invariant
    if drafter != "prompt_lookup" and drafter not in rt.verifier.self_drafters:
        pytest.skip(f"no {drafter} drafter in this runtime")
    for _, prompt in PROMPTS:
        ids = rt.encode(prompt)
        plain, _ = generate_tokens(None, rt.verifier, ids, max_new_tokens=64, stop_ids=rt.stop_ids)
        kw = {"budget": AdaptiveBudget(8)}
        d = None
        if drafter in rt.verifier.self_drafters:
            kw["self_draft"] = drafter
        else:
            d = rt.drafter(drafter)
        out, _ = generate_tokens(d, rt.verifier, ids, max_new_tokens=64, stop_ids=rt.stop_ids, **kw)
        assert out == plain, (drafter, prompt[:40])
    _all_captured(rt.engine)


def test_acceptance_kernels_compiled_at_start_up():
    """``acceptance.warm_up_kernels`` (run by ``Runtime`` at start-up on CUDA) compiles every
    Triton specialisation the verifier's rounds use: after it, greedy and sampled rounds
    of chains and trees of 1..64 nodes, 1..4 sessions, compile nothing more (counted in
    Triton's per-device kernel caches)."""
    import importlib
    import random

    from specmesh import acceptance as A
    from specmesh.types import SamplingParams, TokenTree

    tk = importlib.import_module("specmesh.kernels.triton_kernels")
    kernels = [getattr(tk, n) for n in dir(tk) if n.startswith("_") and n.endswith("_kernel")]

    def compiled() -> int:
        return sum(len(c[0]) for k in kernels for c in getattr(k, "device_caches", {}).values())

    V = 49152
    A.warm_up_kernels("cuda", V)
    before = compiled()
    assert before > 0
    rng = random.Random(0)
    for _ in range(40):
        b = rng.randint(1, 4)
        trees = []
        for _ in range(b):
            n = rng.randint(1, 64)
            trees.append(TokenTree([rng.randrange(V) for _ in range(n)], [-1] + [rng.randrange(-1, i) for i in
                                                                                  range(1, n)]))
        sp = SamplingParams() if rng.random() < 0.5 else SamplingParams(temperature=0.9)
        logits = [torch.randn(len(t) + 1, V, device="cuda") for t in trees]
        A.accept_batch(logits, trees, [sp] * b, list(range(b)))
    assert compiled() == before


def test_graphed_attention_takes_the_memory_efficient_kernel(monkeypatch):
    """The static forward's attention calls (bf16 and fp32, chains and trees, several
    sessions) are ones torch's memory-efficient kernel accepts on this GPU (not the math
    fallback that a float mask with enable_gqa forced)."""
    import specmesh.engine.cudagraph as cg
    from specmesh.engine.cudagraph import GraphedEngine

    calls = []
    real = cg.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, 0.0, False, bool(kw.get("enable_gqa", False)))
        calls.append(torch.backends.cuda.can_use_efficient_attention(params, True))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    model, cfg = tiny_hf()
    monkeypatch.setattr(cg.F, "scaled_dot_product_attention", spy)
    for dtype in ("fp32", "bf16"):
        eng = GraphedEngine(cfg, model.state_dict(), dtype=dtype, n_slots=2, max_seq_len=512, device="cuda",
                            capture=False)
        eng.prefill(0, list(range(5, 40)))
        eng.score_batch([(0, [3, 4, 5, 6], [-1, 0, 0, 1]), (1, [7], [-1])])
        eng.score(0, [8, 9], [-1, 0])
    assert calls and all(calls), calls
