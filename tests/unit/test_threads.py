"""OpenMP thread policy per command (``specmesh.spin_threads``, ``cli.SPINNING``) and the
pieces of ``specmesh.threads``: the model thread, serial threads, CPU placement.

Each case runs the command line in a fresh interpreter: libgomp reads its settings
once, when torch loads it, so the choice must be made before torch is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specmesh import SPINCOUNT

PROBE = """
import os, sys
import specmesh.cli as cli
try:
    cli.main(sys.argv[1:] + ["--help"])
except SystemExit:
    pass
print("SPIN", os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


def _run(args, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("SPIN "))
    _, spin, policy, torch_loaded = line.split()
    return (None if spin == "None" else spin), policy, torch_loaded == "True"


@pytest.mark.parametrize("cmd", ["bench", "demo", "uno-study", "serve", "bench-services"])
def test_commands_that_run_their_models_on_one_thread_spin_briefly(cmd):
    spin, policy, torch_loaded = _run([cmd])
    assert (spin, policy) == (SPINCOUNT, "PASSIVE")
    # the setting is made before torch could load (spin_threads refuses once it has), and --help loads none
    assert not torch_loaded


@pytest.mark.parametrize("cmd", ["bench-sweep", "device-check", "generate"])
def test_commands_with_processes_beside_them_keep_sleeping_threads(cmd):
    assert _run([cmd])[:2] == (None, "PASSIVE")


def test_the_users_choice_wins():
    assert _run(["bench"], OMP_WAIT_POLICY="ACTIVE")[:2] == (None, "ACTIVE")
    assert _run(["bench"], GOMP_SPINCOUNT="5")[:2] == ("5", "PASSIVE")


def test_too_late_once_torch_is_loaded():
    code = ("import torch, os, specmesh\n"
            "print(specmesh.spin_threads(), os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    assert out == ["False", "None"]


# ---------------------------------------------------------------- specmesh.threads

def test_cpu_lists_parse_and_bad_ones_name_the_part():
    from specmesh.threads import parse_cpus

    assert parse_cpus("0-1,3") == [0, 1, 3] and parse_cpus(" 2 ") == [2] and parse_cpus("1,1,0") == [0, 1]
    for bad, part in (("a", "'a'"), ("3-1", "'3-1'"), ("-1", "'-1'"), ("", "no CPU")):
        with pytest.raises(ValueError, match=part):
            parse_cpus(bad)


def test_the_cpus_setting_per_service_or_for_all():
    from specmesh.serving.settings import load_settings

    s = load_settings(cpus="verifier=0-1,3,drafter=1")
    assert (s.cpus_for("verifier"), s.cpus_for("drafter"), s.cpus_for("router")) == ("0-1,3", "1", None)
    assert (s.model_threads("verifier"), s.model_threads("router")) == (3, None)
    s = load_settings(cpus="0")
    assert s.cpus_for("router") == "0" and s.model_threads("drafter") == 1
    assert load_settings().cpus_for("verifier") is None
    for bad in ("verifier=x", "0,verifier=1", "verifier=0,verifier=1", "Verifier!=0"):
        with pytest.raises(ValueError, match="cpus"):
            load_settings(cpus=bad)


def test_place_refuses_a_cpu_this_process_may_not_use_and_changes_nothing():
    from specmesh.threads import place

    mine = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="not available"):
        place(str(max(mine) + 64))
    assert sorted(os.sched_getaffinity(0)) == mine
    assert place(str(mine[0]), apply=False) == [mine[0]] and sorted(os.sched_getaffinity(0)) == mine
    assert place("") is None


def test_the_model_thread_runs_jobs_in_order_inline_when_nested_and_returns_errors():
    import threading

    from specmesh.threads import ModelThread

    mt = ModelThread("test-order")
    try:
        order = []
        futs = [mt.submit(order.append, i) for i in range(20)]
        for f in futs:
            f.result(30)
        assert order == list(range(20))
        assert mt.run(threading.get_ident) == mt.ident != threading.get_ident()
        assert mt.run(lambda: mt.run(threading.get_ident)) == mt.ident  # nested: inline, no deadlock
        with pytest.raises(ZeroDivisionError):
            mt.run(lambda: 1 / 0)
        assert mt.run(lambda: "still serving") == "still serving"
    finally:
        mt.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        mt.submit(print)


def test_services_a_benchmark_starts_choose_their_own_wait_policy(monkeypatch):
    import specmesh
    from specmesh.cli.bench.sweep import services_env

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what specmesh sets for itself by default
    monkeypatch.setattr(specmesh, "_OMP_CHOSEN_BY_USER", False)
    env = services_env()
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env and env["PYTHONUNBUFFERED"] == "1"
    assert services_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setattr(specmesh, "_OMP_CHOSEN_BY_USER", True)  # the user's choice is passed on
    assert services_env()["OMP_WAIT_POLICY"] == "PASSIVE"
