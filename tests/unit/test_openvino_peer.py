"""The OpenVINO GenAI peer of ``specmesh bench`` without OpenVINO: its system names and
group parse, it is skipped with the reason where its package is missing, its child
process is spoken to like llama.cpp's (a stand-in child here: tokens, seconds, τ
counters and the child's peak RSS come back into the run's output), a peer's outputs
are compared with our plain decoding's, and the report carries its side-by-side table
and verdicts. The real peer runs in tests/e2e/test_openvino_peer.py."""

from __future__ import annotations

import sys

import pytest

from specmesh.cli.bench import peers, report
from specmesh.cli.bench.harness import BenchConfig, Bench, RECORD_FIELDS
from specmesh.cli.bench.openvino_worker import OpenVinoWorker
from specmesh.cli.bench.peer_process import PeerFailed
from specmesh.cli.bench.systems import OPENVINO_SYSTEMS, RunOutput, System, expand
from specmesh.types import InvalidArgument

CHILD = r'''
import json, sys
cfg = json.loads(sys.argv[-1])
print(json.dumps({"info": {"mode": cfg["mode"], "threads": cfg["threads"]}}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["ids"] == [0]:
        print(json.dumps({"error": "RuntimeError: no"}), flush=True); continue
    out = [t for t in req["ids"] if t not in req["stops"]][: req["max_new"]]
    print(json.dumps({"tokens": out, "seconds": 0.25, "decode_tokens": len(out), "decode_forwards": 2,
                      "peak_rss_mb": 123.0, "rss_mb": 100.0}), flush=True)
'''


def test_names_and_group():
    assert OPENVINO_SYSTEMS == ("openvino_ar", "openvino_draft_lm", "openvino_pld")
    assert expand(["openvino"]) == list(OPENVINO_SYSTEMS)
    assert expand(["ours_ar", "openvino_ar", "openvino_pld"]) == ["ours_ar", "openvino_ar", "openvino_pld"]
    assert set(OPENVINO_SYSTEMS) <= set(expand(["all"]))
    with pytest.raises(InvalidArgument, match="unknown system"):
        expand(["openvino_magic"])
    with pytest.raises(ValueError, match="mode"):
        OpenVinoWorker("m.gguf", 2, "beam")


def test_skipped_with_the_reason_where_openvino_is_missing(monkeypatch, tmp_path):
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "openvino_genai" else real(name, *a))
    why = peers.peer_unavailable("openvino_ar", "smollm2-135m-instruct", tmp_path)
    assert "OpenVINO GenAI is not installed" in why and "bench-openvino" in why


def test_no_paired_draft_model_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(peers, "gguf_path", lambda *a: tmp_path / "t.gguf")
    assert peers.peer_unavailable("openvino_ar", "some-model", tmp_path) is None
    assert "no paired draft model" in peers.peer_unavailable("openvino_draft_lm", "some-model", tmp_path)


def test_a_child_answers_into_the_run_output(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    w = OpenVinoWorker("model.gguf", 2, "pld", assistant_tokens=10, max_ngram_size=3,
                       argv=[sys.executable, str(script)], timeout_s=60.0)
    s = peers._child_system("openvino_pld", "openvino", w, [2], {"threads": 2}, 10)
    try:
        assert (s.family, s.reference, s.speculative, s.budget) == ("openvino", "openvino_ar", True, 10)
        out = s.run([5, 2, 7, 9], 8)
        assert (out.tokens, out.seconds, out.decode_tokens, out.decode_forwards, out.peak_rss_mb) == \
            ([5, 7, 9], 0.25, 3, 2, 123.0)
        assert s.info["mode"] == "pld" and s.info["threads"] == 2
        with pytest.raises(PeerFailed, match="OpenVINO GenAI: RuntimeError: no"):
            s.run([0], 4)
    finally:
        s.close()
    assert w.proc is None


def _system(name: str, family: str, reference: str) -> System:
    return System(name, family, reference, run=lambda ids, n: RunOutput([], 0.0), dtype="gguf")


def test_peer_outputs_are_compared_with_our_plain_decoding(tmp_path):
    b = Bench(BenchConfig(out=str(tmp_path)))
    b.systems = [_system("ours_ar", "ours", "ours_ar"), _system("openvino_ar", "openvino", "openvino_ar"),
                 _system("openvino_draft_lm", "openvino", "openvino_ar")]
    o = lambda toks, peak=None: RunOutput(toks, 1.0, len(toks), len(toks), peak_rss_mb=peak)  # noqa: E731
    runs = {("ours_ar", "w"): [("p1", o([1, 2, 3, 4]), 900.0), ("p2", o([5, 6]), 900.0)],
            ("openvino_ar", "w"): [("p1", o([1, 2, 3, 4]), 3000.0), ("p2", o([5, 7]), 3100.0)],
            ("openvino_draft_lm", "w"): [("p1", o([1, 2, 9, 9]), 3500.0), ("p2", o([5, 7]), 3600.0)]}
    recs = {r["system"]: r for r in b.aggregate(["w"], runs)}
    assert all(set(RECORD_FIELDS) <= set(r) for r in recs.values())
    assert recs["ours_ar"]["identical_to_ours_ar"] is None  # our own systems: against their own AR only
    assert (recs["openvino_ar"]["identical_to_ours_ar"], recs["openvino_ar"]["agreement_with_ours_ar"]) == (1, 0.8333)
    assert recs["openvino_draft_lm"]["identical_prompts"] == 1 and recs["openvino_draft_lm"]["identical_to_ar"] is False
    assert recs["openvino_draft_lm"]["identical_to_ours_ar"] == 0
    assert recs["openvino_draft_lm"]["peak_rss_mb"] == 3600.0


def _rec(system, workload, tps, speedup, ref, tau=1.0, same=None):
    return {"system": system, "workload": workload, "prompts": 2, "new_tokens": 100, "seconds": 100 / tps,
            "tokens_per_s": tps, "speedup_vs_own_ar": speedup, "tau": tau, "acceptance_hist": None,
            "identical_to_ar": True, "identical_prompts": 2, "token_agreement": 1.0, "reference": ref,
            "draft_s": None, "verify_s": None, "peak_rss_mb": 3800.0, "dtype": "gguf", "budget": None,
            "identical_to_ours_ar": same, "agreement_with_ours_ar": None if same is None else 0.5}


def test_the_report_carries_openvino_beside_ours():
    recs = [_rec("ours_ar", "code_write", 30, 1.0, "ours_ar"), _rec("ours_draft_lm", "code_write", 27, 0.9, "ours_ar"),
            _rec("openvino_ar", "code_write", 24, 1.0, "openvino_ar", same=0),
            _rec("openvino_draft_lm", "code_write", 32, 1.33, "openvino_ar", tau=4.5, same=1),
            _rec("openvino_pld", "code_write", 20, 0.83, "openvino_ar", same=0)]
    meta = {"config": {"dtype": "int4"}, "peers": {"openvino_draft_lm": {
        "openvino_genai": "2026.4.1", "threads": 2, "load_s": 50.0, "num_assistant_tokens": 5}}}
    text = "\n".join(f"{a} {b}" for a, b in report.verdicts(recs, meta))
    assert "PASS ours_ar vs openvino_ar tokens/s: code_write 1.25x" in text
    assert "FAIL code_write: draft LM speedup over own plain decoding, ours_draft_lm 0.90x vs openvino_draft_lm 1.33x" \
        in text
    md = report.render({"meta": meta, "records": recs})
    assert "## Side by side with OpenVINO GenAI" in md
    assert "| code_write | openvino_draft_lm | 32.0 | 1.07x | 1.33x | 4.50 | 1/2 | 50.0% | 3800 |" in md
    assert "num_assistant_tokens 5" in md
    # no OpenVINO system in the run: no section, no verdict
    plain = [r for r in recs if not r["system"].startswith("openvino")]
    assert "Side by side with OpenVINO" not in report.render({"meta": {}, "records": plain})
    assert not any("openvino" in t for _, t in report.verdicts(plain, {}))
