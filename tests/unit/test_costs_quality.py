"""What ``specmesh costs`` and ``specmesh quality`` compute, end to end on a tiny
random Llama (a Hugging Face directory with the real tokenizer's files and its
vocabulary size, so the prompts encode): the files they write, and the relations
between their numbers that hold whatever the machine's speed (break-even τ from
the measured times, predicted speedup = τ / τ*, the S <= τ/2 check only where a
round costs a target pass; the exact rule's and plain decoding's agreement with
the target's greedy output, the log-likelihood against an independent forward).
No assertion depends on how fast anything ran."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from tests.support import TINY


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.models.loading import resolve_model

    src = resolve_model("smollm2-135m-instruct", quiet=True)
    d = tmp_path_factory.mktemp("tiny-costs")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY, vocab_size=49152, max_position_embeddings=2048),
                                         attention_bias=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.eval().save_pretrained(d)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, d / f.name)
    return str(d)


def _args(cmd: str, argv: list[str]) -> argparse.Namespace:
    from specmesh.cli import build_parser

    return build_parser().parse_args([cmd] + argv)


def test_costs_measures_the_cost_model(tiny_dir, tmp_path):
    from specmesh.cli.bench import costs

    out = tmp_path / "costs"
    args = _args("costs", ["--model", tiny_dir, "--dtype", "fp32", "--device", "cpu", "--drafters",
                           "prompt_lookup,suffix,layerskip", "--budget", "3", "--max-tokens", "5", "--batch", "1,2",
                           "--context", "24", "--reps", "1", "--gen-prompts", "2", "--max-new-tokens", "8",
                           "--out", str(out), "--no-progress"])
    assert costs.main(args) == 0
    r = json.loads((out / "costs.json").read_text())
    tv = {int(n): s for n, s in r["verify_s"].items()}
    assert sorted(tv) == [1, 2, 3, 4, 5] and all(s > 0 for s in tv.values())
    assert sorted(int(b) for b in r["batch_s"]) == [1, 2]
    assert all(set(row) == {"1", "4"} for row in r["batch_s"].values())  # 1 and k + 1 tokens each
    rows = {d["drafter"]: d for d in r["drafters"]}
    assert set(rows) == {"prompt_lookup", "suffix", "layerskip"}
    k, t1 = 3, tv[1]
    for name, d in rows.items():
        td = d["draft_round_ms"] / 1e3
        assert d["cost_in_target_passes"] == pytest.approx(td / t1)
        assert d["break_even_tau"] == pytest.approx((td + tv[k + 1]) / t1)  # tau* = (T_d(k) + T_v(k+1)) / T_v(1)
        assert d["draft_token_ms"] == pytest.approx(d["draft_round_ms"] / k)  # token-level drafters: k steps
        assert 1.0 <= d["tau"] <= k + 1 and d["measured_speedup"] > 0
        assert d["predicted_speedup"] == pytest.approx(d["tau"] / d["break_even_tau"])
        assert d["bound_tau_over_2_applies"] == (d["cost_in_target_passes"] >= 1.0)
        if d["bound_tau_over_2_applies"]:
            assert d["within_tau_over_2"] == (d["measured_speedup"] <= d["tau"] / 2)
        else:
            assert d["within_tau_over_2"] is None
    md = (out / "costs.md").read_text()
    assert "break-even" in md and all(f"| {name} |" in md for name in rows)
    assert (out / "costs.png").stat().st_size > 0
    assert r["meta"]["budget"] == k and r["meta"]["prompts"] == 2


def test_quality_scores_each_rule_against_the_target(tiny_dir, tmp_path):
    from specmesh.cli.bench import quality
    from specmesh.runtime import Runtime

    out = tmp_path / "quality"
    args = _args("quality", ["--model", tiny_dir, "--dtype", "fp32", "--device", "cpu", "--drafter", "prompt_lookup",
                             "--rules", "exact,lenient:0.05,topk:8", "--cd", "0.5", "--workloads", "code_edit",
                             "--prompts", "1", "--max-new-tokens", "12", "--budget", "4", "--out", str(out),
                             "--no-progress"])
    assert quality.main(args) == 0
    r = json.loads((out / "quality.json").read_text())
    rows = {x["system"]: x for x in r["rows"]}
    assert set(rows) == {"plain", "spec:exact", "spec:lenient:0.05", "spec:topk:8", "cd_vanilla:0.5", "cd_spec:0.5"}
    # plain decoding is the reference and the exact rule is lossless: both agree with it fully
    for name in ("plain", "spec:exact"):
        assert rows[name]["prefix"] == 1.0 and rows[name]["rouge_l"] == 1.0, name
    assert rows["plain"]["speedup"] == pytest.approx(1.0) and rows["plain"]["tau"] == 1.0
    for x in rows.values():
        assert 0.0 <= x["prefix"] <= 1.0 and 0.0 <= x["rouge_l"] <= 1.0 and x["loglik"] <= 0.0
    # speculative contrastive decoding is lossless w.r.t. vanilla CD (greedy: identical)
    assert rows["cd_spec:0.5"]["identical_to_vanilla_cd"] == "1/1"
    # the log-likelihood column is the target's own, teacher-forced: recompute plain's independently
    (rec,) = r["records"]["plain"]
    assert rec["tokens"] > 0
    rt = Runtime(tiny_dir, dtype="fp32", n_slots=2, max_seq_len=2048, quiet=True, device="cpu")
    from specmesh import workloads as wl
    from specmesh.loop import generate_tokens

    p = wl.load(["code_edit"])["code_edit"][-1]
    ids = rt.encode(p.prompt, p.messages)
    ref, _ = generate_tokens(None, rt.verifier, ids, max_new_tokens=p.budget(12), stop_ids=rt.stop_ids)
    assert len(ref) == rec["tokens"]
    assert rec["loglik"] == pytest.approx(quality.mean_loglik(rt.engine, ids, ref, 1), abs=1e-6)
    md = (out / "quality.md").read_text()
    assert all(f"| {name} |" in md for name in rows)
