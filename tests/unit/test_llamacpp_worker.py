"""The llama.cpp peer's child process (specmesh.cli.bench.llamacpp_worker), with a stand-in
child so no llama.cpp is needed: a child that dies of a signal is restarted once with
llama.cpp's extra weight buffers off (the workaround for the AMX crash), a child that
keeps dying, fails to load or hangs raises PeerFailed with the reason, and answers
come back as (tokens, seconds). Nothing here depends on timing beyond a generous
timeout."""

from __future__ import annotations

import sys

import pytest

from specmesh.cli.bench.llamacpp_worker import LlamaCppWorker, PeerFailed

CHILD = r'''
import json, os, signal, sys
cfg = json.loads(sys.argv[-1])
mode = os.environ["FAKE_MODE"]
if mode == "load_error":
    print(json.dumps({"error": "bad gguf"}), flush=True); sys.exit(1)
print(json.dumps({"info": {"extra_bufts": cfg["extra_bufts"]}}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if mode == "always_crash" or (mode == "crash_with_extra" and cfg["extra_bufts"]):
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "hang":
        import time; time.sleep(60)
    out = [t for t in req["ids"][::-1] if t not in req["stops"]][: req["max_new"]]
    print(json.dumps({"tokens": out, "seconds": 0.5}), flush=True)
'''


def _worker(tmp_path, monkeypatch, mode, timeout_s=60.0):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    monkeypatch.setenv("FAKE_MODE", mode)
    return LlamaCppWorker("model.gguf", 1, 64, timeout_s=timeout_s, argv=[sys.executable, str(script)])


def test_answers_come_back(tmp_path, monkeypatch):
    w = _worker(tmp_path, monkeypatch, "ok")
    assert w.generate([5, 2, 7, 9], 2, [2]) == ([9, 7], 0.5)
    assert w.generate([1, 3], 8, []) == ([3, 1], 0.5)
    assert w.info == {"extra_bufts": True} and not w.notes
    w.close()


def test_a_signal_restarts_once_without_extra_buffers(tmp_path, monkeypatch):
    w = _worker(tmp_path, monkeypatch, "crash_with_extra")
    assert w.generate([4, 6], 8, []) == ([6, 4], 0.5)
    assert w.info == {"extra_bufts": False}
    assert len(w.notes) == 1 and "SIGSEGV" in w.notes[0] and "use_extra_bufts=False" in w.notes[0]
    w.close()


def test_a_child_that_keeps_crashing_fails_with_the_reason(tmp_path, monkeypatch):
    w = _worker(tmp_path, monkeypatch, "always_crash")
    with pytest.raises(PeerFailed, match="SIGSEGV"):
        w.generate([4, 6], 8, [])


def test_load_errors_and_hangs_fail_with_the_reason(tmp_path, monkeypatch):
    with pytest.raises(PeerFailed, match="bad gguf"):
        _worker(tmp_path, monkeypatch, "load_error").generate([1], 1, [])
    w = _worker(tmp_path, monkeypatch, "hang", timeout_s=2.0)
    with pytest.raises(PeerFailed, match="no answer"):
        w.generate([1], 1, [])
    w.close()
