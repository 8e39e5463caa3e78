"""``specmesh bench-strategies``' report (``bench.strategies.render``) on made-up
numbers: the proactive section reports the real next turn and the covered one,
real first, each as a mean ratio to plain decoding, and the covered verdict says
what "covered" means (issue 50: only the covered 2.85x was ever reported)."""

from __future__ import annotations

from specmesh.cli.bench.strategies import proactive_ratio, render


def _follow(plain_tps: float, pro_tps: float) -> dict:
    return {"plain_tps": plain_tps, "plain_ttft": 0.4, "pro_tps": pro_tps, "pro_ttft": 0.2, "cache_hit": True,
            "cache_accepted": 10, "new_tokens": 32, "warm": 50, "tau": 2.0, "identical": True}


def test_proactive_real_next_turn_is_reported_first():
    pro = [{"id": "c1", "anticipation_s": 3.0, "anticipation_tokens": 200, "covered_turn": "And then?",
            "real": _follow(10.0, 11.0), "covered": _follow(10.0, 30.0)},
           {"id": "c2", "anticipation_s": 3.0, "anticipation_tokens": 200, "covered_turn": "Why?",
            "real": _follow(10.0, 9.0), "covered": _follow(10.0, 28.0)}]
    assert proactive_ratio(pro, "real") == 1.0 and proactive_ratio(pro, "covered") == 2.9
    matrix = {"chat_multiturn": {"autoregressive": {"tokens": 64, "seconds": 4.0, "identical": 1, "n": 1}}}
    meta = {"model": "m", "dtype": "fp32", "max_new": 64, "think_new": 128, "budget": 8, "prompts": 1}
    text = render(matrix, pro, meta)
    assert "mean: real 1.00x, covered 2.90x" in text
    real = text.index("proactive on real next turns")
    covered = text.index("proactive on covered follow-ups")
    assert real < covered and "1.00x plain tokens/s" in text[real:covered]
    assert "[PASS] proactive on covered follow-ups (the model's own predicted next turn" in text
    c1 = text[text.index("  c1 "):]
    assert c1.index("c1 real") < c1.index("c1 covered")
