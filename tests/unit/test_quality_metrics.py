"""The quality harness's metrics (``specmesh quality``) on crafted inputs, and the
``costs`` / ``quality`` subcommands register with the CLI."""

from __future__ import annotations

import pytest

from specmesh.cli.bench.quality import final_answer, parse_rule, prefix_agreement, rouge_l


def test_prefix_agreement():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert prefix_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert prefix_agreement([], [1, 2]) == 0.0


def test_rouge_l_is_lcs_f1():
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([4, 5], [1, 2, 3]) == 0.0
    # LCS([1, 9, 2, 3], [1, 2, 3, 7]) = 3: P = 3/4, R = 3/4
    assert rouge_l([1, 9, 2, 3], [1, 2, 3, 7]) == pytest.approx(0.75)


def test_final_answer_and_rule_specs():
    assert final_answer("3 for 45 cents, so 12 cost 4 x 45 = 180 cents.") == "180"
    assert final_answer("1,200 dollars") == "1200"
    assert final_answer("no digits") is None
    assert parse_rule("lenient:0.5") == ("lenient:0.5", {"acceptance": "lenient", "lenience": 0.5})
    assert parse_rule("topk:4")[1] == {"acceptance": "topk", "accept_top_k": 4}
    assert parse_rule("exact")[1] == {"acceptance": "exact"}


def test_subcommands_register():
    from specmesh.cli import build_parser

    p = build_parser()
    assert p.parse_args(["costs", "--budget", "4"]).budget == 4
    assert p.parse_args(["quality", "--rules", "exact,topk:2"]).rules == "exact,topk:2"
