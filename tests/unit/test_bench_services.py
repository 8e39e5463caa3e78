"""``specmesh bench-services``' pieces that need no model: system names, the paths a
system runs, and the report (one column per header, verdicts against the targets)."""

from __future__ import annotations

import pytest

from specmesh.cli.bench.services import paths_of, render, systems_of, targets_for, verdicts
from specmesh.types import InvalidArgument


def test_systems_are_named_once_for_every_path():
    ar, tree, suffix, over = systems_of("ar,block_tree,suffix,prompt_lookup_overlap")
    assert (ar["ours"], ar["strategy"], ar["drafter"]) == ("ours_ar", "autoregressive", "")
    assert (tree["strategy"], tree["drafter"]) == ("self", "block_tree")
    assert (suffix["strategy"], suffix["drafter"]) == ("external", "suffix")
    assert (over["drafter"], over["draft_ahead"]) == ("prompt_lookup", "on")
    auto, serial = systems_of("draft_lm_auto,draft_lm_serial")
    assert (auto["ours"], auto["drafter"], auto["draft_ahead"]) == ("ours_draft_lm_auto", "draft_lm", "auto")
    assert serial["draft_ahead"] == "off"
    from specmesh.cli.bench.systems import overlap_mode

    assert [overlap_mode(f"ours_draft_lm{s}") for s in ("_auto", "_overlap", "_serial")] == ["auto", "on", "off"]
    with pytest.raises(InvalidArgument, match="systems"):
        systems_of("nope")
    with pytest.raises(InvalidArgument, match="empty"):
        systems_of(" , ")


def test_no_http_path_for_a_drafter_that_learns_across_requests_or_a_forced_ahead_mode():
    paths = ["in_process", "serve", "http"]
    ar, suffix, over = systems_of("ar,suffix,prompt_lookup_overlap")
    assert paths_of(ar, paths) == paths
    assert paths_of(suffix, paths) == paths_of(over, paths) == ["in_process", "serve"]


def test_the_report_has_a_column_per_header_and_a_verdict_per_path():
    paths = ["in_process", "serve", "http"]
    rec = {"system": "ar", "served_as": "autoregressive", "workload": "w", "prompts": 2, "identical": 2,
           "in_process_tokens_per_s": 100.0, "serve_tokens_per_s": 95.0, "http_tokens_per_s": 80.0,
           "serve_vs_in_process": 0.95, "http_vs_in_process": 0.8, "hop_us_per_round": 900.0}
    result = {"meta": {"model": "m", "dtype": "bf16", "max_new_tokens": 8, "workloads": ["w"], "prompts": 2,
                       "repeats": 1, "cpus": "", "serve_args": [], "paths": paths, "targets": targets_for("bf16")},
              "records": [rec]}
    table = [ln for ln in render(result).splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in table}) == 1 and len(table) == 3
    assert verdicts(result) == ["ar through serve: 0.95x-0.95x of in process (target >= 0.90x): ok",
                                "ar through http: 0.80x-0.80x of in process (target >= 0.85x): BELOW TARGET"]
