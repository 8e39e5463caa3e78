"""``specmesh demo``'s schedule and its check, on a fake runtime whose generations
report scripted times (no model, no timing): every system runs once per pass in the
bench's rotation, each keeps its fastest pass, a speedup its tau cannot explain gets
a warning line, and a bad ``--repeats`` is refused before anything loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specmesh.cli import demo
from specmesh.wire.convert import RouterStats as Stats

# system -> seconds of its passes, in order; tau from (accepted, rounds)
TIMES = {"plain": [4.0, 3.0], "busy": [1.0, 1.2], "good": [2.0, 1.5]}
TAU = {"plain": (0, 0), "busy": (0, 8), "good": (16, 8)}  # busy: tau 1.00, good: tau 3.00


class _Drafter:
    def __init__(self, name):
        self.name = name


class _Runtime:
    device, cuda_graphs, stop_ids, verify_costs, tree_schedule = "cpu", False, [], None, None
    draft_model, model_name, dtype = None, "fake", "fp32"

    def __init__(self, *a, **kw):
        self.verifier = SimpleNamespace(self_drafters={}, info=lambda: {
            "weight_bytes": 0, "kv_bytes_per_slot": 0, "slots_total": 2, "kv_bytes_total": 0, "max_seq_len": 64})

    def encode(self, prompt):
        return [1, 2, 3]

    def decode(self, ids):
        return ""

    def drafter(self, name):
        return _Drafter(name)


def test_fastest_pass_in_rotation_and_a_speedup_tau_cannot_explain(monkeypatch, capsys):
    calls = []
    passes = {k: iter(v * len(demo.PROMPTS)) for k, v in TIMES.items()}

    def fake_generate(drafter, verifier, ids, max_new_tokens, stop_ids, **kw):
        name = drafter.name if drafter is not None else "plain"
        if max_new_tokens == 4:  # the warm-up
            return [7] * 4, Stats()
        calls.append(name)
        acc, rounds = TAU[name]
        return [7] * 8, Stats(new_tokens=8, total_s=next(passes[name]), accepted_tokens=acc, rounds=rounds)

    monkeypatch.setattr(demo, "Runtime", _Runtime)
    monkeypatch.setattr(demo, "generate_tokens", fake_generate)
    args = SimpleNamespace(model="fake", dtype="fp32", device="cpu", cuda_graphs=False, max_new_tokens=8,
                           drafters="busy,good", budget=4, fixed_budget=True, show_text=False, repeats=2)
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    per_prompt = [calls[i:i + 6] for i in range(0, len(calls), 6)]
    assert len(per_prompt) == len(demo.PROMPTS)
    # each pass runs every system once, the order rotated between passes and prompts
    assert all(sorted(p[:3]) == sorted(p[3:]) == ["busy", "good", "plain"] for p in per_prompt)
    assert per_prompt[0][:3] != per_prompt[0][3:]
    # fastest passes: plain 3.0 s, busy 1.0 s (3.00x with tau 1.00: flagged), good 1.5 s (2.00x, tau 3.00: fine)
    assert "3.00x" in out and "2.00x" in out
    assert out.count("WARNING") == len(demo.PROMPTS) and "busy measured 3.00x plain with tau 1.00" in out
    assert "good measured" not in out and "fastest of 2 passes" in out
    # it ends with two lines: what tau and the speedup column mean, and the next command to try
    last = out.rstrip("\n").splitlines()[-2:]
    assert last == demo.closing_lines("fake", "fp32", 2)
    assert last[0].startswith("tau: tokens per forward") and "speedup: tok/s over plain decoding" in last[0]
    assert last[1].startswith("Next: ") and "`specmesh serve --model fake --dtype fp32`" in last[1]


def test_the_next_command_is_one_the_cli_takes():
    import re
    import shlex

    from specmesh.cli import build_parser

    for model, dtype in (("smollm2-135m-instruct", "auto"), ("qwen2.5-coder-1.5b-instruct", "int4")):
        cmds = re.findall(r"`(specmesh [^`]+)`", demo.closing_lines(model, dtype, 2)[1])
        assert [c.split()[1] for c in cmds] == ["serve", "generate"]
        for c in cmds:
            argv = shlex.split(c)[1:]
            build_parser(argv).parse_args(argv)  # parses: no typo in what a new user copies
        assert ("--model" in cmds[0]) == (model != "smollm2-135m-instruct")


def test_bad_repeats_is_refused_before_the_model_loads(monkeypatch):
    from specmesh.types import InvalidArgument

    monkeypatch.setattr(demo, "Runtime", lambda *a, **kw: pytest.fail("loaded a model"))
    with pytest.raises(InvalidArgument, match="repeats"):
        demo.main(SimpleNamespace(repeats=0))
