"""`specmesh serve` keeps serving when a service dies: ``serving.supervisor``.

- The supervisor alone, on small Python child processes: a crash after the
  service came up is restarted (counted, logged, back up), a service that never
  comes up stops everything, a restart loop that never comes up gives up.
- Slow: the real ``specmesh serve`` (three processes, the real model): the
  drafter is SIGKILLed in the middle of an ``external:prompt_lookup`` stream; the
  stream finishes with the tokens of an uninterrupted run, the supervisor
  restarts the drafter on its port, counts the restart on its /metrics, and the
  next requests are served as before.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specmesh.serving.supervisor import RestartPolicy, Supervisor, SupervisorMetrics
from tests.support import free_port, samples, scrape, total, wait_for

ROOT = Path(__file__).resolve().parents[2]

UP = "import sys, time; print('x listening on 1', flush=True); time.sleep(600)"
UP_THEN_EXIT = "import sys; print('x listening on 1', flush=True); sys.exit(3)"
DIE = "import sys; print('boom', flush=True); sys.exit(2)"


class Lines(io.StringIO):
    def text(self) -> str:
        return self.getvalue()


def run_until(sup: Supervisor, pred, timeout: float = 60.0):
    reasons = []

    def step():
        r = sup.poll()
        if r:
            reasons.append(r)
        return bool(reasons) or pred()

    assert wait_for(step, timeout)
    return reasons[0] if reasons else None


def test_a_crashed_service_is_restarted_counted_and_back():
    out, m = Lines(), SupervisorMetrics(["a", "b"])
    sup = Supervisor({"a": [sys.executable, "-c", UP], "b": [sys.executable, "-c", UP]}, dict(os.environ),
                     RestartPolicy(backoff_s=0.05), m, out=out)
    sup.start()
    try:
        assert run_until(sup, sup.all_ready) is None
        old_b = sup.pid("b")
        os.kill(sup.pid("a"), signal.SIGKILL)
        assert run_until(sup, lambda: sup.children["a"].restarts == 1 and sup.all_ready()) is None
        assert sup.pid("b") == old_b  # the others kept running
        assert m.restarts.labels("a")._value.get() == 1 and m.restarts.labels("b")._value.get() == 0
        assert m.up.labels("a")._value.get() == 1
        log = out.text()
        assert "a exited with code -9; restarting it in" in log
        assert "restarting a (restart 1)" in log and "a is back" in log
    finally:
        sup.stop(["a", "b"], 5)
    assert sup.pid("a") is None and sup.pid("b") is None


def test_a_service_that_never_came_up_stops_everything():
    sup = Supervisor({"a": [sys.executable, "-c", UP], "bad": [sys.executable, "-c", DIE]}, dict(os.environ),
                     RestartPolicy(backoff_s=0.05), out=Lines())
    sup.start()
    try:
        reason = run_until(sup, lambda: False)
        assert reason and reason.startswith("bad exited with code 2 before it was listening")
        assert sup.children["bad"].restarts == 0
    finally:
        sup.stop(["a", "bad"], 5)


def test_restarts_that_never_come_up_give_up():
    marker = ROOT / ".pytest_cache" / f"supervisor-{os.getpid()}"
    marker.parent.mkdir(exist_ok=True)
    marker.unlink(missing_ok=True)
    # first run comes up then dies; every later run dies before listening
    code = (f"import pathlib, sys; m = pathlib.Path({str(marker)!r})\n"
            "if m.exists(): sys.exit(5)\n"
            "m.touch(); print('x listening on 1', flush=True); sys.exit(3)")
    out = Lines()
    sup = Supervisor({"a": [sys.executable, "-c", code]}, dict(os.environ),
                     RestartPolicy(backoff_s=0.01, max_backoff_s=0.02, max_failed_starts=3), out=out)
    sup.start()
    try:
        reason = run_until(sup, lambda: False)
        assert reason and "3 restarts in a row never came up" in reason
        assert sup.children["a"].restarts == 3
    finally:
        sup.stop(["a"], 5)
        marker.unlink(missing_ok=True)


def test_backoff_doubles_and_caps():
    p = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0)
    assert [p.delay(n) for n in (1, 2, 3, 5, 6, 9)] == [1.0, 2.0, 4.0, 16.0, 30.0, 30.0]


# ---------------------------------------------------------------- the real `specmesh serve`

@pytest.mark.slow
def test_serve_restarts_a_killed_drafter_and_the_stream_keeps_its_tokens():
    from specmesh import Client

    ports = {k: free_port() for k in ("router", "drafter", "verifier", "sup")}
    cmd = [sys.executable, "-m", "specmesh.cli", "serve", "--router-port", str(ports["router"]),
           "--drafter-port", str(ports["drafter"]), "--verifier-port", str(ports["verifier"]),
           "--router-metrics-port", "0", "--drafter-metrics-port", "0", "--verifier-metrics-port", "0",
           "--supervisor-metrics-port", str(ports["sup"]), "--restart-backoff-s", "0.2", "--http-port", "0"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        assert wait_for(lambda: any(line.startswith("try: specmesh generate") for line in log), 300), "".join(log)
        assert any(re.match(r"openai +http://127\.0\.0\.1:\d+/v1", line) for line in log), "".join(log)

        def drafter_pid() -> int:
            pids = [int(m.group(1)) for line in log for m in [re.search(r"started drafter \(pid (\d+)\)", line)] if m]
            return pids[-1]

        prompt = ("Repeat this list exactly, twice: alpha beta gamma delta epsilon zeta eta theta iota kappa "
                  "lambda mu nu xi omicron pi rho sigma tau upsilon.")
        kw = dict(strategy="external", drafter="prompt_lookup", max_new_tokens=96)
        with Client(f"127.0.0.1:{ports['router']}", timeout=300) as c:
            ref = c.generate(prompt, **kw).token_ids
            first = drafter_pid()
            s = c.stream(prompt, **kw)
            it = iter(s)
            next(it)
            os.kill(first, signal.SIGKILL)
            list(it)
            assert s.token_ids == ref  # the stream finished, with the same tokens
            assert wait_for(lambda: "drafter is back" in "".join(log), 120), "".join(log)
            assert drafter_pid() != first
            smp = samples(scrape(ports["sup"]))
            assert total(smp, "specmesh_service_restarts_total", service="drafter") == 1
            assert total(smp, "specmesh_service_restarts_total", service="verifier") == 0
            assert total(smp, "specmesh_service_up", service="drafter") == 1
            # served as before, through the restarted drafter once the router probes it again
            again = c.generate(prompt, **kw)
            assert again.token_ids == ref
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, "".join(log)
