"""The router's periodic throughput line (``observability.throughput``), on a fake
clock (no waiting, no timing): rates over the interval, running and finished
requests, quiet when idle, 0 = off; and that a router's observer feeds it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from specmesh.observability.throughput import ThroughputLog


def test_line_reports_the_intervals_rates_and_is_quiet_when_idle():
    clock = [100.0]
    t = ThroughputLog(10.0, clock=lambda: clock[0])
    assert t.line(105.0) is None  # no traffic: nothing to log
    t.started(300)
    t.started(100)
    t.generated(50)
    t.ended()
    t.generated(30)
    line = t.line(115.0)  # 10 s since the previous line
    assert line == ("throughput: prompt 40.0 tok/s, generation 8.0 tok/s, running 1 reqs, finished 1 reqs "
                    "(last 10.0 s)")
    # a request still running keeps the line coming, with its tokens of this interval only
    t.generated(20)
    assert t.line(120.0) == ("throughput: prompt 0.0 tok/s, generation 4.0 tok/s, running 1 reqs, "
                             "finished 0 reqs (last 5.0 s)")
    t.ended()
    assert "finished 1 reqs" in t.line(130.0)
    assert t.line(140.0) is None  # idle again


def test_zero_interval_is_off_and_negative_refused():
    t = ThroughputLog(0).start()
    assert t._thread is None
    t.stop()
    with pytest.raises(ValueError, match="log_stats_interval_s"):
        ThroughputLog(-1)


def test_the_router_observer_feeds_it():
    from specmesh.observability.requests import RouterObserver
    from specmesh.wire.convert import RouterStats
    from specmesh.types import SamplingParams

    t = ThroughputLog(10.0, clock=lambda: 0.0)
    obs = RouterObserver("m", throughput=t)
    plan = SimpleNamespace(ids=[1, 2, 3, 4], strategy="auto", reason="", drafter="", self_draft=None,
                           max_new_tokens=8, budget=4, sampling=SamplingParams())
    stats = RouterStats()
    req = obs.request(plan, "sid", stats)
    stats.new_tokens = 5
    req.finish(stats)
    req.end(None)
    assert t.line(2.0) == ("throughput: prompt 2.0 tok/s, generation 2.5 tok/s, running 0 reqs, finished 1 reqs "
                           "(last 2.0 s)")


def test_settings_and_flag():
    from specmesh.cli import build_parser
    from specmesh.cli.serve import settings_from_args
    from specmesh.serving.settings import ServeSettings

    assert ServeSettings.model_fields["log_stats_interval_s"].default == 10.0
    args = build_parser().parse_args(["serve", "router", "--log-stats-interval-s", "0"])
    assert settings_from_args(args).log_stats_interval_s == 0.0


def test_the_thread_logs_through_the_logger(caplog):
    """The thread calls ``line`` and logs it; driven here by calling ``_run``'s body
    through a stop event that is already set after one interval."""
    t = ThroughputLog(10.0, clock=lambda: 0.0)
    t.started(10)
    calls = []
    t._stop = SimpleNamespace(wait=lambda s: calls.append(s) or len(calls) > 1)
    with caplog.at_level(logging.INFO, logger="specmesh.router"):
        t._run()
    assert calls == [10.0, 10.0] and any("throughput: prompt" in r.message for r in caplog.records)
