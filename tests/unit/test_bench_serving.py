"""``specmesh bench-serving``'s summaries, verdicts and report (pure parts; the run itself
starts servers: docs/performance.md)."""

from __future__ import annotations

from specmesh.cli.bench import serving as bs


def _turns(ttfts):
    return [{"turn": i + 1, "ttft": t, "e2e": t + 1.0} for i, t in enumerate(ttfts)]


def test_chat_summary_compares_late_turns_with_early_ones():
    s = bs.chat_summary(_turns([0.2, 0.3, 0.4, 0.4, 0.4, 0.3, 0.3, 0.4, 0.3, 0.2]))
    assert s["ttft_turns_1_2"] == 0.25 and abs(s["ttft_turns_6_10"] - 0.3) < 1e-9
    assert abs(s["late_over_early"] - 1.2) < 1e-9 and s["e2e_last"] == 1.2 and abs(s["e2e_sum"] - 13.2) < 1e-9
    assert "late_over_early" not in bs.chat_summary(_turns([0.2, 0.3, 0.4]))


def test_latency_summary_goodput_counts_requests_within_both_slos():
    res = [{"ttft": 1.0, "e2e": 3.0, "completion_tokens": 11, "gaps": [0.1, 0.2]},  # tpot 0.2: good
           {"ttft": 6.0, "e2e": 7.0, "completion_tokens": 11, "gaps": [0.1]},  # TTFT over the SLO
           {"ttft": 1.0, "e2e": 6.0, "completion_tokens": 11, "gaps": [0.5]},  # tpot 0.5
           {"error": "boom"}]
    s = bs.latency_summary(res, slo_ttft=5.0, slo_tpot=0.25, wall=10.0)
    assert (s["requests"], s["errors"], s["good"]) == (4, 1, 1)
    assert s["goodput"] == 0.1 and s["throughput"] == 0.3 and s["ttft_p50"] == 1.0
    assert s["itl_p50"] == 0.1 and s["itl_p99"] == 0.5  # nearest rank over every gap


def test_verdicts_and_report_name_every_target():
    result = {"meta": {"model": "m", "dtype": "bf16", "cpu": "c", "cpus": 2, "date": "d", "slo_ttft": 5.0,
                       "slo_tpot": 0.25},
              "chat": {"ours": {"turns": _turns([0.2] * 10), "summary": bs.chat_summary(_turns([0.2] * 10))},
                       "llamacpp": {"turns": _turns([0.5] * 10), "summary": bs.chat_summary(_turns([0.5] * 10))}},
              "shared": {"ours": {"summary": {"ttft_p50": 0.1, "ttft_p99": 0.2, "e2e_p50": 1.0}, "cached_median": 992},
                         "ours_nocache": {"summary": {"ttft_p50": 0.6, "ttft_p99": 0.9, "e2e_p50": 2.0}}},
              "interference": {"ours": {"itl_p50": 0.05, "itl_p99": 0.09, "ratio": 1.8, "long_ttft": [3.0, 2.5]}}}
    v = bs.verdicts(result)
    assert v[0].startswith("chat: our mean TTFT of turns 6-10 is 1.00x") and v[0].endswith("MET")
    assert "ours 12.00 s, llama-cpp-python 15.00 s: 1.25x" in v[1]
    assert "0.17 (target <= 0.33): MET" in v[2] and "1.80 with chunked prefill (target <= 2): MET" in v[3]
    result["verdicts"] = v
    md = bs.render(result)
    for part in ("## Multi-turn chat", "## Shared system prompt", "## Streams while long prompts arrive",
                 "| ours | 0.100 s | 0.200 s | 1.000 s | 992 |", "turns.png"):
        assert part in md
