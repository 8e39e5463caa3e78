"""GGUF files as models (specmesh/models/gguf.py, gguf_file.py) and the int4 engine on
their blocks as shipped (specmesh/engine/blocks.py).

A tiny Llama GGUF is written here with the ``gguf`` package's writer: one layer of
K-quants (Q4_K, Q6_K), one of the 32-blocks (Q4_0, Q4_1, Q5_0, Q8_0), a Q8_0 embedding
table and a Q6_K head; q and k permuted the way llama.cpp's converter stores them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from specmesh.engine import qmatmul as qm
from specmesh.models import gguf as G
from specmesh.models.quantize import Q4_K, quantize

from tests.support import random_blocks

CFG = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=256,
           tie_word_embeddings=False, rope_theta=10000.0)
TYPES = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
          "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
         {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
          "ffn_up": "Q4_1", "ffn_down": "Q5_0"}]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's RoPE interleave of a q/k projection's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(name: str, w: np.ndarray, seed: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gq

    n, k = w.shape
    if name == "Q4_K":
        return quantize(torch.from_numpy(w), Q4_K).numpy()
    if name in ("Q6_K", "Q5_K"):  # no quantizer at hand: valid random blocks
        b = random_blocks("Q6_K" if name == "Q6_K" else "Q4_K", n, k, seed).numpy().reshape(n, -1)
        if name == "Q5_K":  # 176-byte blocks: random codes, the Q4_K header's small d / dmin
            rng = np.random.default_rng(seed)
            b5 = rng.integers(0, 256, size=(n, k // 256, 176), dtype=np.uint8)
            b5[..., :4] = b.reshape(n, k // 256, 144)[..., :4]
            return b5.reshape(n, -1)
        return b
    return gq(w, GGMLQuantizationType[name])


def write_gguf(path, types=TYPES, seed: int = 0) -> dict:
    """A tiny Llama GGUF at ``path``; returns the HF-order fp32 weights it was made from."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    H, I, V = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"]
    nh, nk, hd = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(nh)
    w.add_head_count_kv(nk)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    hf = {}

    def add(gname, hname, arr, qtype, perm=None):
        hf[hname] = arr
        data = arr if perm is None else _permute(arr, perm)
        if qtype == "F32":
            w.add_tensor(gname, data.astype(np.float32))
        else:
            raw = _blocks(qtype, data.astype(np.float32), seed=len(hf))
            w.add_tensor(gname, raw, raw_dtype=GGMLQuantizationType[qtype])

    add("token_embd.weight", "model.embed_tokens.weight", rng.normal(0, 0.5, (V, H)).astype(np.float32), "Q8_0")
    for i, ty in enumerate(types):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        shapes = {"attn_q": (nh * hd, H), "attn_k": (nk * hd, H), "attn_v": (nk * hd, H), "attn_output": (H, nh * hd),
                  "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}
        for g, shape in shapes.items():
            perm = nh if g == "attn_q" else nk if g == "attn_k" else None
            add(p + g + ".weight", q + G._NAMES[g] + ".weight", rng.normal(0, 0.05, shape).astype(np.float32),
                ty[g], perm)
        add(p + "attn_norm.weight", q + "input_layernorm.weight", np.ones(H, np.float32), "F32")
        add(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", np.ones(H, np.float32), "F32")
    add("output_norm.weight", "model.norm.weight", np.ones(H, np.float32), "F32")
    add("output.weight", "lm_head.weight", rng.normal(0, 0.05, (V, H)).astype(np.float32), "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    p = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(p)
    return p


def test_header_reader_agrees_with_the_gguf_package(tiny_gguf):
    from gguf import GGUFReader

    from specmesh.models.gguf_file import read_header

    meta, tensors = read_header(tiny_gguf)
    r = GGUFReader(str(tiny_gguf))
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    ref = {t.name: t for t in r.tensors}
    assert [t.name for t in tensors] == [t.name for t in r.tensors]
    for t in tensors:
        assert t.offset == int(ref[t.name].data_offset) and t.nbytes == int(ref[t.name].n_bytes)
        assert t.type == int(ref[t.name].tensor_type) and t.dims == tuple(int(x) for x in ref[t.name].shape)


def test_weights_by_hf_name_give_the_files_values(tiny_gguf):
    from specmesh.models.gguf_state import gguf_llama_state_dict

    w = G.GGUFWeights(tiny_gguf, CFG)
    ref = gguf_llama_state_dict(tiny_gguf, CFG["num_attention_heads"], CFG["num_key_value_heads"])
    assert set(w) == set(ref)
    for k in ref:
        assert torch.equal(w[k], ref[k]), k
    assert w.type_name("model.layers.0.mlp.down_proj.weight") == "Q6_K"
    assert w.qtype("model.layers.1.self_attn.v_proj.weight") == qm.TYPE_IDS["Q5_0"]
    # the quantized form: the file's bytes, q/k rows back in Hugging Face order
    p = w.part("model.layers.0.self_attn.k_proj.weight")
    assert (p.type, p.n, p.k) == (qm.TYPE_IDS["Q4_K"], 128, 256)
    assert torch.equal(qm.QMatrix([p]).rows(torch.arange(128)), ref["model.layers.0.self_attn.k_proj.weight"])


def test_int4_engine_runs_the_files_blocks(tiny_gguf):
    from specmesh.engine import LlamaEngine

    w = G.GGUFWeights(tiny_gguf, CFG)
    eng = LlamaEngine(CFG, w, dtype="int4", n_slots=1, max_seq_len=64)
    assert eng.int4_blocks and eng.head.qm.type_names == ["Q6_K"] and eng.embed.qm.type_names == ["Q8_0"]
    assert eng.layers[0].qkv.qm.type_names == ["Q4_K", "Q4_K", "Q6_K"]
    assert eng.layers[1].gate_up.qm.type_names == ["Q4_0", "Q4_1"] and eng.layers[1].down.qm.type_names == ["Q5_0"]
    # the bytes held are the file's, not a copy at another precision
    sizes = sum(np.asarray(w.part(k).raw).nbytes for k in w if w.type_name(k) != "F32")
    assert eng.weight_bytes() <= 1.05 * sizes
    ref = LlamaEngine(CFG, {k: w[k] for k in w}, dtype="fp32", n_slots=1, max_seq_len=64)
    ids = list(range(3, 40))
    a = ref.score(0, ids, list(range(-1, len(ids) - 1))).logits
    b = eng.score(0, ids, list(range(-1, len(ids) - 1))).logits
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99


def test_a_type_the_kernels_lack_is_requantized_with_a_warning(tmp_path):
    from specmesh.engine import LlamaEngine

    types = [dict(TYPES[0], ffn_up="Q5_K"), TYPES[1]]
    p = tmp_path / "q5k.gguf"
    write_gguf(p, types)
    w = G.GGUFWeights(p, CFG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = LlamaEngine(CFG, w, dtype="int4", n_slots=1, max_seq_len=64)
    msgs = [str(c.message) for c in caught]
    assert any("model.layers.0.mlp.up_proj.weight (Q5_K)" in m and "Q8_0" in m for m in msgs), msgs
    assert eng.layers[0].gate_up.qm.type_names == ["Q4_K", "Q8_0"]


def test_truncated_or_foreign_files_are_clear_errors_and_leave_no_cache(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(G.GGUFError, match="truncated"):
        G.GGUFWeights(cut, CFG)
    with pytest.raises(G.GGUFError, match="truncated"):
        G.prepare(cut, tmp_path / "out")
    assert not any(tmp_path.glob("out*"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(G.GGUFError, match="not a GGUF"):
        G.GGUFWeights(junk, CFG)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:40])
    with pytest.raises(G.GGUFError, match="truncated"):
        G.GGUFWeights(head, CFG)


def test_quantizers_write_blocks_gguf_reads_back():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specmesh.models.quantize import Q4_1, Q8_0

    w = torch.randn(16, 512) * 0.1
    for t, bound in ((Q8_0, 0.01), (Q4_1, 0.1), (Q4_K, 0.09)):
        raw = quantize(w, t)
        back = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType(t)))
        assert torch.equal(qm.QMatrix([qm.Part(t, 16, 512, raw.reshape(-1))]).rows(torch.arange(16)), back)
        rel = ((back - w).pow(2).mean() / w.pow(2).mean()).sqrt()
        assert rel < bound, (t, float(rel))


def test_a_safetensors_model_is_quantized_once_into_a_packed_cache(tmp_path, monkeypatch):
    """A Hugging Face directory in int4: Q4_K where the input size is a multiple of 256
    (Q4_1 where only 32 divides it), Q8_0 head and table; the blocks kept in the cache
    and read from there the next time (no second quantization)."""
    from safetensors.torch import save_file

    from specmesh.engine import LlamaEngine
    from specmesh.models import quantize as Q

    from tests.support import random_llama

    cfg, sd = random_llama(3, 0.05, 128, layers=2, hidden=256, heads=4, kv=2, inter=96)
    d = tmp_path / "model"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(__import__("json").dumps(cfg))
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path / "cache"))
    eng = LlamaEngine.from_pretrained(str(d), dtype="int4", n_slots=1, max_seq_len=32, quiet=True)
    L = eng.layers[0]
    assert L.qkv.qm.type_names == ["Q4_K"] * 3 and L.gate_up.qm.type_names == ["Q4_K"] * 2
    assert L.down.qm.type_names == ["Q4_1"] and eng.head.qm.type_names == ["Q8_0"]
    packed = list((tmp_path / "cache" / "packed").glob("*.safetensors"))
    assert len(packed) == 1
    calls = []
    real = Q.quantize
    monkeypatch.setattr(Q, "quantize", lambda *a: calls.append(a) or real(*a))
    again = LlamaEngine.from_pretrained(str(d), dtype="int4", n_slots=1, max_seq_len=32, quiet=True)
    assert not calls  # every block read from the cache
    assert torch.equal(again.layers[1].down.qm.data, eng.layers[1].down.qm.data)
    assert torch.equal(again.prefill(0, [1, 2, 3]), eng.prefill(0, [1, 2, 3]))


def test_the_engine_on_k_quant_blocks_is_batch_invariant(tiny_gguf):
    """A chain scored in one forward gives each row the bits of the same tokens decoded one
    at a time, beside another session or alone (the layer stack on Q4_K / Q6_K / the 32-blocks)."""
    from specmesh.engine import LlamaEngine

    eng = LlamaEngine(CFG, G.GGUFWeights(tiny_gguf, CFG), dtype="int4", n_slots=3, max_seq_len=64)
    assert eng._layer_stack() is not None
    ctx, chain = list(range(5, 25)), [30, 31, 32, 33, 34, 35, 36, 37]
    eng.prefill(0, ctx)
    one = eng.score(0, chain, list(range(-1, len(chain) - 1))).logits
    eng.prefill(1, ctx)
    steps = [eng.prefill(1, [t]) for t in chain]
    eng.prefill(2, [9, 8, 7])
    both = eng.score_batch([(2, [1, 2], [-1, 0]), (0, chain, list(range(-1, len(chain) - 1)))])[1].logits
    for i in range(len(chain)):
        assert torch.equal(one[i], steps[i]) and torch.equal(both[i], steps[i]), i
