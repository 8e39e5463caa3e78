"""Engine: logits equal Hugging Face's forward; tree scoring + commit == prefill of the
path; rollback; batched == unbatched; layer exit; dtypes — in the ragged and the
batch-invariant forward (bitwise invariance itself: test_batch_invariance.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support import tiny_engine, tiny_hf
from specmesh.types import InvalidArgument, ResourceExhausted


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_match_hf(kind, invariant):
    eng, model = tiny_engine(kind=kind)
    eng.set_batch_invariant(invariant)
    ids = [3, 17, 5, 88, 41, 9, 60, 2]
    out = eng.score(0, ids, list(range(-1, len(ids) - 1))).logits
    torch.testing.assert_close(out, _hf_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_incremental_decode_matches_full_forward():
    eng, model = tiny_engine()
    ids = [5, 6, 7, 8, 9, 10, 11]
    eng.prefill(0, ids[:3])
    rows = [eng.prefill(0, [t]) for t in ids[3:]]
    ref = _hf_logits(model, ids)
    for k, r in enumerate(rows):
        torch.testing.assert_close(r, ref[3 + k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("invariant", [False, True])
def test_tree_score_then_commit_equals_prefill_of_path(invariant):
    eng, _ = tiny_engine()
    eng.set_batch_invariant(invariant)
    prompt = [4, 8, 15, 16, 23]
    # tree: two branches under the root; path = nodes 1 -> 3 -> 4
    tokens = [30, 31, 32, 33, 34, 35]
    parents = [-1, -1, 0, 1, 3, 3]
    eng.prefill(0, prompt)
    tree_out = eng.score(0, tokens, parents).logits
    eng.commit(0, [1, 3, 4])
    after_commit = eng.prefill(0, [50])
    # reference: a fresh slot that prefilled the accepted path as a chain
    eng.prefill(1, prompt)
    chain_out = eng.score(1, [31, 33, 34], [-1, 0, 1]).logits
    eng.commit(1, [0, 1, 2])
    ref_after = eng.prefill(1, [50])
    torch.testing.assert_close(tree_out[[1, 3, 4]], chain_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after_commit, ref_after, atol=1e-5, rtol=1e-5)
    n = eng.length(0)
    assert n == eng.length(1) == len(prompt) + 4
    torch.testing.assert_close(eng.k_cache[:, 0, :, :n], eng.k_cache[:, 1, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eng.v_cache[:, 0, :, :n], eng.v_cache[:, 1, :, :n], atol=1e-5, rtol=1e-5)


def test_rollback_restores_next_logits():
    eng, model = tiny_engine()
    eng.prefill(0, [1, 2, 3, 4])
    eng.prefill(0, [70, 71, 72])
    eng.rollback(0, 3)
    assert eng.length(0) == 4
    torch.testing.assert_close(eng.prefill(0, [5]), _hf_logits(model, [1, 2, 3, 4, 5])[-1], atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidArgument):
        eng.rollback(0, 99)


@pytest.mark.parametrize("invariant", [False, True])
def test_batched_equals_unbatched(invariant):
    eng, _ = tiny_engine(n_slots=3)
    eng.set_batch_invariant(invariant)
    eng.prefill(0, [1, 2, 3])
    eng.prefill(1, [9, 8, 7, 6, 5, 4, 3])
    items = [(0, [10, 11, 12], [-1, 0, 0]), (1, [20], [-1]), (2, [40, 41, 42, 43], [-1, 0, 1, 2])]
    batched = eng.score_batch(items)
    for (slot, toks, pars), b in zip(items, batched):
        single = eng.score(slot, toks, pars)
        torch.testing.assert_close(b.logits, single.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("invariant", [False, True])
def test_hidden_states_and_layer_exit(invariant):
    eng, model = tiny_engine()
    eng.set_batch_invariant(invariant)
    ids = [7, 3, 9, 1]
    out = eng.score(0, ids, [-1, 0, 1, 2], hidden_layers=[0, 2])
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden[0], hs[1][0], atol=1e-4, rtol=1e-4)
    early = eng.score(1, ids, [-1, 0, 1, 2], n_layers=1).logits
    assert early.shape == out.logits.shape and not torch.allclose(early, out.logits)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_low_precision_close_to_fp32(dtype, invariant):
    ref, _ = tiny_engine("fp32")
    low, _ = tiny_engine(dtype)
    low.set_batch_invariant(invariant)
    ids = list(range(10, 30))
    a = ref.score(0, ids, list(range(-1, 19))).logits
    b = low.score(0, ids, list(range(-1, 19))).logits
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    assert agree >= 0.8
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98


@pytest.mark.parametrize("group", [32, 64])
def test_int4_reproduces_a_4bit_grid_model(group):
    """int4 on weights that already lie on a 4-bit grid of its group size (as the GGUF's
    Q4_1 weights of the default model do): logits as close to fp32 as bf16's. (On the
    tiny model's Gaussian weights int4 loses ~8% per matmul: that cost is the
    quantisation's, measured on the real model in docs/int4.md.)"""
    from specmesh.engine import LlamaEngine, quantize_int4

    model, cfg = tiny_hf()
    sd = {}
    for k, v in model.state_dict().items():
        if v.dim() == 2:
            q, scale, lo = quantize_int4(v, group)
            v = (q.float().unflatten(1, (-1, group)) * scale[..., None] + lo[..., None]).flatten(1)
        sd[k] = v
    ref = LlamaEngine(cfg, sd, dtype="fp32", n_slots=1, max_seq_len=64)
    low = LlamaEngine(cfg, sd, dtype="int4", n_slots=1, max_seq_len=64, int4_group=group, int4_format="group")
    assert all(lin.mode == "int4" for L in low.layers for lin in (L.qkv, L.o, L.gate_up, L.down))
    assert low.head.mode == "int4" and low._screen and low.weight_bytes() < ref.weight_bytes() / 3  # tied: screen
    ids = list(range(10, 30))
    a = ref.score(0, ids, list(range(-1, 19))).logits
    b = low.score(0, ids, list(range(-1, 19))).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99


@pytest.mark.parametrize("head", ["auto", "screen", "screen8"])
def test_int4_screen_head_gives_its_top_logits_from_the_embedding_table(head):
    """The int4 engine's default head on a tied model: int4 ranks, each row's top
    ``SCREEN_TOP`` logits are the fp32 products with the bf16 embedding rows (an untied
    head: with its int8 copy's rows); "int8" keeps the int8 head. The screen runs on bf16
    inputs ("screen") or int8 ones ("screen8": our W4A8 matmul, the default where it
    exists; where it does not, asking for it is refused and the default is "screen")."""
    from specmesh.engine import SCREEN_TOP, LlamaEngine, int4_matmul, rms_norm

    model, cfg = tiny_hf()
    sd = model.state_dict()
    q8 = int4_matmul.load_q8()
    if head == "screen8" and q8 is None:
        with pytest.raises(InvalidArgument, match="screen8"):
            LlamaEngine(cfg, sd, dtype="int4", n_slots=1, max_seq_len=64, int4_format="group", int4_head=head)
        return
    scr = LlamaEngine(cfg, sd, dtype="int4", n_slots=1, max_seq_len=64, int4_format="group", int4_head=head)
    w4a8 = head == "screen8" or (head == "auto" and q8 is not None)
    assert scr._screen and (scr.head._k4 is not None and scr.head._k4.isa == "avx2q8") == w4a8
    i8 = LlamaEngine(cfg, sd, dtype="int4", n_slots=1, max_seq_len=64, int4_format="group", int4_head="int8")
    assert scr.head.mode == "int4" and i8.head.mode == "int8" and scr.head.nbytes() < i8.head.nbytes()
    ids = list(range(10, 30))
    out = scr.score(0, ids, list(range(-1, 19)), hidden_layers=(cfg["num_hidden_layers"] - 1,))
    hn = rms_norm(out.hidden[cfg["num_hidden_layers"] - 1].float(), scr.norm, scr.eps)
    exact = hn @ scr.embed.float().T  # [n, V]
    top = out.logits.topk(min(SCREEN_TOP, cfg["vocab_size"]) // 2, -1).indices
    assert torch.allclose(out.logits.gather(-1, top), exact.gather(-1, top), atol=1e-4)
    assert (out.logits.argmax(-1) == exact.argmax(-1)).all()
    # an untied head: the int4 screen ranks, an int8 copy of the head gives the top values
    untied = dict(cfg, tie_word_embeddings=False)
    sd2 = dict(sd, **{"lm_head.weight": sd["lm_head.weight"] + 0.1 * torch.randn_like(sd["lm_head.weight"])})
    u = LlamaEngine(untied, sd2, dtype="int4", n_slots=1, max_seq_len=64, int4_format="group", int4_head=head)
    assert u.head.mode == "int4" and u._screen_rows.mode == "int8"
    out = u.score(0, ids, list(range(-1, 19)), hidden_layers=(cfg["num_hidden_layers"] - 1,))
    hn = rms_norm(out.hidden[cfg["num_hidden_layers"] - 1].float(), u.norm, u.eps)
    exact = hn @ (u._screen_rows.w.float() * u._screen_rows.scale.float()[:, None]).T
    top = out.logits.topk(min(SCREEN_TOP, cfg["vocab_size"]) // 2, -1).indices
    assert torch.allclose(out.logits.gather(-1, top), exact.gather(-1, top), atol=1e-3)
    with pytest.raises(InvalidArgument, match="int4_head"):
        LlamaEngine(cfg, sd, dtype="int4", n_slots=1, max_seq_len=64, int4_format="group", int4_head="int2")
    assert not LlamaEngine(cfg, sd, dtype="bf16", n_slots=1, max_seq_len=64, int4_head=head)._screen  # int4 only


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_engine_from_a_lazy_state_dict_is_the_same(tmp_path, dtype):
    """``from_pretrained`` reads tensor by tensor (``LazyStateDict``, no mapping): the
    engine it builds has the weights and logits of one built from the whole dict."""
    import json

    from safetensors.torch import save_file

    from specmesh.engine import LlamaEngine
    from specmesh.models.loading import LazyStateDict

    model, cfg = tiny_hf()
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # tied head: its own copy on disk
    half = len(sd) // 2  # two shards: the mapping finds each tensor in its own file
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:half]}, str(tmp_path / "model-1.safetensors"))
    save_file({k: sd[k] for k in keys[half:]}, str(tmp_path / "model-2.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lazy = LazyStateDict(tmp_path)
    assert sorted(lazy) == keys and len(lazy) == len(sd)
    assert all(torch.equal(lazy[k], sd[k]) for k in keys)
    a = LlamaEngine(cfg, sd, dtype=dtype, n_slots=1, max_seq_len=64)
    b = LlamaEngine.from_pretrained(str(tmp_path), dtype=dtype, n_slots=1, max_seq_len=64, quiet=True)
    ids = list(range(10, 30))
    assert torch.equal(a.score(0, ids, list(range(-1, 19))).logits, b.score(0, ids, list(range(-1, 19))).logits)
    assert a.weight_bytes() == b.weight_bytes()


def test_int4_falls_back_to_int8_where_the_pack_cannot_take_a_weight():
    from specmesh.engine import Linear

    w = torch.randn(40, 64)  # 40 output rows: not a multiple of 16
    lin = Linear(w, None, "int4", keep_rows=True)
    assert lin.mode == "int8"
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x.bfloat16()).float(), x @ w.T, atol=0.2, rtol=0.05)
    full = Linear(torch.randn(48, 64), None, "int4", keep_rows=True)
    assert full.mode == "int4"
    deq = full.rows_fp32(torch.arange(48))
    torch.testing.assert_close(full(x.bfloat16()).float(), x.bfloat16().float() @ deq.T, atol=0.1, rtol=0.02)


def test_bad_input_changes_nothing():
    eng, _ = tiny_engine(max_seq_len=16)
    eng.prefill(0, [1, 2, 3])
    with pytest.raises(InvalidArgument, match="tokens"):
        eng.score(0, [500], [-1])
    with pytest.raises(InvalidArgument, match="parents"):
        eng.score(0, [1, 2], [-1, 5])
    with pytest.raises(ResourceExhausted):
        eng.score(0, list(range(20)), list(range(-1, 19)))
    assert eng.length(0) == 3
    with pytest.raises(InvalidArgument):
        from specmesh.engine import LlamaEngine
        LlamaEngine(eng.config, {}, dtype="fp16")


def test_invariant_forward_matches_ragged_and_is_switchable():
    """The two forwards compute the same function (fp32: to rounding); switching keeps
    the sessions; the tiles are validated; ``from_pretrained`` takes the device."""
    import inspect

    from specmesh.engine import LlamaEngine

    eng, _ = tiny_engine(max_seq_len=100)
    assert not eng.batch_invariant and eng.k_cache.shape[3] == 100
    eng.prefill(0, [1, 2, 3, 4, 5])
    ragged = eng.score(0, [6, 7, 8], [-1, 0, 0]).logits
    eng.set_batch_invariant(True)
    assert eng.k_cache.shape[3] == 100 and eng._k_buf.shape[3] % eng.key_block == 0
    assert eng.length(0) == 5
    torch.testing.assert_close(eng.score(0, [6, 7, 8], [-1, 0, 0]).logits, ragged, atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidArgument):
        LlamaEngine(eng.config, {}, dtype="bf16", row_tiles=(4, 2))
    params = inspect.signature(LlamaEngine.from_pretrained).parameters
    assert params["device"].default == "cpu"


@pytest.mark.slow
def test_smollm2_logits_match_hf(runtime):
    from transformers import AutoModelForCausalLM

    from specmesh.models.loading import source_gguf

    gguf = source_gguf(runtime.model_dir)  # transformers reads the GGUF itself (dequantised to fp32)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = runtime.encode("Explain speculative decoding in one sentence.")
    runtime.verifier.release("hfcheck")
    slot = runtime.verifier.pool.allocate("hfcheck")
    try:
        runtime.engine.reset(slot)
        out = runtime.engine.score(slot, ids, list(range(-1, len(ids) - 1))).logits
    finally:
        runtime.verifier.release("hfcheck")
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=1e-3)
    assert (out.argmax(-1) == ref.argmax(-1)).all()


def test_loads_return_freed_memory_and_restore_malloc(monkeypatch):
    """Loading sets glibc's mmap threshold low (freed load buffers go back to the system),
    once for nested or concurrent loads; the outermost exit sets the serving thresholds and
    trims, also when the load fails."""
    from specmesh.models import loading

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append(("mallopt", param, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(loading, "_glibc", lambda: FakeLibc())
    with loading.freed_memory_returned(during=4096, after=1 << 20):
        with loading.freed_memory_returned(during=4096, after=1 << 20):
            assert calls == [("mallopt", loading._M_MMAP_THRESHOLD, 4096)]
        assert len(calls) == 1  # the inner exit restores nothing
    assert calls[1:] == [("mallopt", loading._M_MMAP_THRESHOLD, 1 << 20),
                         ("mallopt", loading._M_TRIM_THRESHOLD, 2 << 20), ("trim", 0)]
    calls.clear()
    with pytest.raises(RuntimeError):
        with loading.freed_memory_returned():
            raise RuntimeError("load failed")
    assert [c[0] for c in calls] == ["mallopt", "mallopt", "mallopt", "trim"] and loading._loads == 0
    monkeypatch.setattr(loading, "_glibc", lambda: None)  # not glibc: nothing to do
    with loading.freed_memory_returned():
        pass
    assert loading._loads == 0
