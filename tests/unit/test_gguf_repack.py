"""specmesh.models.gguf_repack: a GGUF's Q5_0 blocks re-packed as Q8_0 (what OpenVINO
GenAI's GGUF reader takes) keep their values to within half a Q8_0 step plus the f16
rounding of the scale; every other tensor's bytes and every metadata field are copied as
they are. Small random blocks and a small written file: no model needed."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from specmesh.models.gguf_repack import repack_blocks, repack_gguf, repacked_types  # noqa: E402


def _q5_0(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3.0, (rows, 1)).astype(np.float32)
    return quantize(w, Q.Q5_0)


def _step_bound(x: np.ndarray) -> np.ndarray:
    """Per 32-weight block: half a Q8_0 step (amax / 127 / 2) and the f16 scale's rounding (amax * 2^-11)."""
    amax = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    return np.broadcast_to(amax / 254 + amax * 2.0 ** -11 + 1e-7, (amax.shape[0], 32)).reshape(x.shape)


def test_q5_0_blocks_as_q8_0_keep_their_values():
    raw = _q5_0(6, 256)
    before = dequantize(raw, Q.Q5_0)
    out = repack_blocks(raw, "Q5_0", "Q8_0")
    assert out.dtype == np.uint8 and out.shape == (6, 256 // 32 * 34)  # 34 bytes a Q8_0 block of 32
    after = dequantize(out, Q.Q8_0)
    assert after.shape == before.shape
    assert np.all(np.abs(after - before) <= _step_bound(before))
    # and again: a Q8_0 block re-packed as Q8_0 is the same block
    assert np.array_equal(repack_blocks(out, "Q8_0", "Q8_0"), out)


def test_a_file_is_rewritten_with_its_metadata_and_other_tensors_as_they_were(tmp_path):
    src, dst = tmp_path / "in.gguf", tmp_path / "out" / "model.gguf"
    w = gguf.GGUFWriter(str(src), "qwen2")
    w.add_block_count(1)
    w.add_uint32("qwen2.context_length", 4096)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_token_list(["a", "b", "<|im_end|>"])
    w.add_token_types([1, 1, 3])
    w.add_chat_template("{{ messages }}")
    q5 = _q5_0(4, 64, seed=1)
    q8 = quantize(np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64), Q.Q8_0)
    norm = np.arange(64, dtype=np.float32)
    w.add_tensor("blk.0.attn_q.weight", q5, raw_dtype=Q.Q5_0)
    w.add_tensor("blk.0.attn_v.weight", q8, raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    assert repacked_types(src) == {"Q5_0": 1}
    assert repack_gguf(src, dst) == {"Q5_0": 1}
    assert repacked_types(dst) == {} and not list(dst.parent.glob("*.tmp*"))
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    fields = lambda r: {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}  # noqa: E731
    assert fields(a) == fields(b)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert list(ta) == list(tb)
    assert tb["blk.0.attn_q.weight"].tensor_type == Q.Q8_0
    assert list(tb["blk.0.attn_q.weight"].shape) == list(ta["blk.0.attn_q.weight"].shape)
    before = dequantize(ta["blk.0.attn_q.weight"].data, Q.Q5_0)
    after = dequantize(tb["blk.0.attn_q.weight"].data, Q.Q8_0)
    assert np.all(np.abs(after - before) <= _step_bound(before))
    for name in ("blk.0.attn_v.weight", "blk.0.attn_norm.weight"):
        assert tb[name].tensor_type == ta[name].tensor_type
        assert np.array_equal(np.asarray(tb[name].data), np.asarray(ta[name].data))
