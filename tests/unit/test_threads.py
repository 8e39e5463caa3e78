"""OpenMP thread policy per command (``specmesh.own_machine_threads``, ``cli.OWN_MACHINE``).

Each case runs the command line in a fresh interpreter: libgomp reads its settings
once, when torch loads it, so the choice must be made before torch is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specmesh import OWN_MACHINE_SPINCOUNT

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


@pytest.mark.parametrize("cmd", ["bench", "demo", "uno-study"])
def test_a_process_that_owns_the_machine_spins_briefly(cmd):
    spin, policy, torch_loaded = _run([cmd])
    assert (spin, policy) == (OWN_MACHINE_SPINCOUNT, "PASSIVE")
    assert torch_loaded  # the setting was made, then torch loaded with it


@pytest.mark.parametrize("cmd", ["serve", "bench-sweep", "device-check", "generate"])
def test_commands_with_processes_beside_them_keep_sleeping_threads(cmd):
    assert _run([cmd])[:2] == (None, "PASSIVE")


def test_the_users_choice_wins():
    assert _run(["bench"], OMP_WAIT_POLICY="ACTIVE")[:2] == (None, "ACTIVE")
    assert _run(["bench"], GOMP_SPINCOUNT="5")[:2] == ("5", "PASSIVE")


def test_too_late_once_torch_is_loaded():
    code = ("import torch, os, specmesh\n"
            "print(specmesh.own_machine_threads(), os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    assert out == ["False", "None"]
