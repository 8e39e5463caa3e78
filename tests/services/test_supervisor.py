"""`specmesh serve` keeps serving when a service dies: ``serving.supervisor``.

- The supervisor alone, on small Python child processes: a crash after the
  service came up is restarted (counted, logged, back up), a service that never
  comes up stops everything, a restart loop that never comes up gives up.
- Slow: the real ``specmesh serve`` (its processes, the real model): the
  drafter is SIGKILLed in the middle of an ``external:prompt_lookup`` stream; the
  stream finishes with the tokens of an uninterrupted run, the supervisor
  restarts the drafter on its port, counts the restart on its /metrics, and the
  next requests are served as before. The router is SIGKILLed in the middle of
  SDK and OpenAI-client streams: each resumes on the restarted router with the
  uninterrupted text (issue 51); one that cannot come back is DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from specmesh.serving.supervisor import RestartPolicy, Supervisor, SupervisorMetrics
from tests.support import ServeProcess, samples, scrape, total, wait_for

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

    serve = ServeProcess()
    try:
        assert serve.openai_url and re.match(r"http://127\.0\.0\.1:\d+/v1", serve.openai_url), serve.text()
        prompt = ("Repeat this list exactly, twice: alpha beta gamma delta epsilon zeta eta theta iota kappa "
                  "lambda mu nu xi omicron pi rho sigma tau upsilon.")
        kw = dict(strategy="external", drafter="prompt_lookup", max_new_tokens=96)
        with Client(serve.address, timeout=300) as c:
            ref = c.generate(prompt, **kw).token_ids
            s = c.stream(prompt, **kw)
            it = iter(s)
            next(it)
            first = serve.kill("drafter")
            list(it)
            assert s.token_ids == ref  # the stream finished, with the same tokens
            assert serve.back("drafter", 1, 120), serve.text()
            assert serve.pid("drafter") != first
            smp = samples(scrape(serve.ports["sup"]))
            assert total(smp, "specmesh_service_restarts_total", service="drafter") == 1
            assert total(smp, "specmesh_service_restarts_total", service="verifier") == 0
            assert total(smp, "specmesh_service_up", service="drafter") == 1
            # served as before, through the restarted drafter once the router probes it again
            again = c.generate(prompt, **kw)
            assert again.token_ids == ref
    finally:
        code = serve.stop()
    assert code == 0, serve.text()


@pytest.mark.slow
def test_serve_a_killed_router_loses_no_stream():
    """Issue 51: SIGKILL the router process in the middle of (a) a greedy SDK stream,
    (b) a seeded sampled SDK stream, (c) an OpenAI-client stream through the OpenAI
    front process: each resumes on the restarted router and finishes with the text of
    the uninterrupted run, each character once. (d) With the supervisor stopped (the
    router cannot come back) the SDK raises DEADLINE_EXCEEDED at the deadline. Each
    kill waits for at least one delivered piece, never for a duration; the stall each
    resume cost is printed (``-s``: the recovery time of docs/serving.md)."""
    import time

    import openai

    from specmesh import Client
    from specmesh.errors import DeadlineExceededError

    serve = ServeProcess()
    kills = 0

    def interrupted(pieces_iter, what: str) -> list[str]:
        """The pieces of a stream whose router is SIGKILLed after the first one."""
        nonlocal kills
        pieces = [next(pieces_iter)]
        serve.kill("router")
        kills += 1
        t0 = time.monotonic()
        nxt = next(pieces_iter)
        print(f"\nrouter failover ({what}): {time.monotonic() - t0:.1f} s from the SIGKILL to the next piece")
        return pieces + [nxt] + list(pieces_iter)

    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    try:
        with Client(serve.address, timeout=600, resume_window_s=300) as c:
            for what, kw in (("greedy", dict(max_new_tokens=96)),
                             ("sampled", dict(strategy="external", drafter="prompt_lookup", max_new_tokens=96,
                                              temperature=0.8, top_p=0.95, seed=7))):
                ref = c.generate(prompt, **kw)
                s = c.stream(prompt, **kw)
                pieces = interrupted(iter(s), what)
                assert "".join(pieces) == ref.text and s.result.text == ref.text, what  # each character once
                assert s.token_ids == ref.token_ids and s.result.token_ids == ref.token_ids, what
                assert s.resumes == 1 and s.result.stats.resumed_tokens > 0, what
                assert s.result.stats.new_tokens == ref.stats.new_tokens, what
                assert serve.back("router", kills), serve.text()
        oa = openai.OpenAI(base_url=serve.openai_url, api_key="unused", max_retries=0, timeout=600)
        kw = dict(model="smollm2-135m-instruct", temperature=0, max_tokens=96,
                  messages=[{"role": "user", "content": prompt}])
        ref = oa.chat.completions.create(**kw)
        chunks = oa.chat.completions.create(stream=True, **kw)
        pieces = interrupted((ch.choices[0].delta.content for ch in chunks if ch.choices and
                              ch.choices[0].delta.content), "openai")
        assert "".join(pieces) == ref.choices[0].message.content
        oa.close()
        assert serve.back("router", kills), serve.text()
        # (d) the router cannot come back: one clear error at the deadline, not a hang
        os.kill(serve.proc.pid, signal.SIGSTOP)
        try:
            with Client(serve.address, timeout=120, resume_window_s=600) as c:  # the deadline comes first
                s = c.stream(prompt, max_new_tokens=96)
                it = iter(s)
                next(it)
                serve.kill("router")
                kills += 1
                with pytest.raises(DeadlineExceededError):
                    list(it)
        finally:
            os.kill(serve.proc.pid, signal.SIGCONT)
        assert serve.back("router", kills), serve.text()
        smp = samples(scrape(serve.ports["sup"]))
        assert total(smp, "specmesh_service_restarts_total", service="router") == kills
        assert total(smp, "specmesh_service_restarts_total", service="openai") == 0
    finally:
        code = serve.stop()
    assert code == 0, serve.text()
