"""A benchmark peer in a child process of its own, so a crash inside the peer's native
code (a segmentation fault kills the whole process) cannot take the benchmark down, and
the peer's memory is its own (its peak RSS is reported beside its tokens/s).

Parent side: ``PeerProcess`` starts ``python -m <the peer's worker module> <JSON
config>`` and speaks JSON lines over its stdin/stdout: the child's first line is its
``{"info": ...}`` (or ``{"error": ...}`` when it cannot load), then one answer a
request. Child side: ``serve_child`` runs that loop around the peer's own load and
answer functions; ``child_memory`` is the child's peak and current RSS.

The peers: ``llamacpp_worker`` (llama-cpp-python) and ``openvino_worker`` (OpenVINO
GenAI). Standard library only: a child imports nothing of torch or the engine.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from typing import Callable, Optional, Sequence


class PeerFailed(RuntimeError):
    """The peer cannot (or can no longer) run; the message says why."""


def describe_exit(rc: Optional[int]) -> str:
    if rc is None:
        return "did not answer"
    if rc < 0:
        try:
            return f"died of {signal.Signals(-rc).name} (signal {-rc})"
        except ValueError:
            return f"died of signal {-rc}"
    return f"exited with status {rc}"


class Died(Exception):
    """The child ended (``rc``: its exit status; the last line it wrote on stderr)."""

    def __init__(self, rc: int, stderr_tail: str):
        super().__init__(rc)
        self.rc, self.stderr_tail = rc, stderr_tail


class PeerProcess:
    """Parent side: one child process holding one peer model (``cfg``, passed as JSON on
    its command line). ``label`` names the peer in messages; ``module`` is the worker
    module run as the child (``argv`` replaces the whole command before the config: tests
    put a stand-in child there)."""

    label = "peer"
    module = ""

    def __init__(self, cfg: dict, timeout_s: float = 600.0, argv: Optional[Sequence[str]] = None):
        self.argv = list(argv) if argv else [sys.executable, "-m", self.module]
        self.cfg = dict(cfg)
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.info: dict = {}
        self.notes: list[str] = []
        self.last: dict = {}  # the last generation's answer beyond its tokens and seconds (the child's counters)

    # ------------------------------------------------------------ process
    def _start(self) -> None:
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve a shared small machine
        self._err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child cannot block on it
        self.proc = subprocess.Popen(self.argv + [json.dumps(self.cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, env=env)
        hello = self._read()
        if "error" in hello:
            self.close()
            raise PeerFailed(f"{self.label} could not load {self.cfg.get('gguf')}: {hello['error']}")
        self.info = hello.get("info", {})

    def _read(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            rc = self._exit_code() if ready else None  # EOF: the child is exiting (reap it for its status)
            if rc is None:
                self.proc.kill()
                self.proc.wait()
                raise PeerFailed(f"{self.label} worker gave no answer within {self.timeout_s:.0f} s")
            self._err.seek(0)
            err = self._err.read().strip().splitlines()
            raise Died(rc, err[-1][:300] if err else "")
        return json.loads(line)

    def _exit_code(self) -> Optional[int]:
        try:
            return self.proc.wait(timeout=10) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None

    # ------------------------------------------------------------ requests
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> tuple[list[int], float]:
        """(tokens without the stop token, seconds measured in the child); the rest of the
        child's answer (its counters, its peak RSS) in ``last``. Raises ``PeerFailed`` when
        the child dies (after any restart ``retry`` allows)."""
        ans = self._ask({"ids": [int(t) for t in prompt_ids], "max_new": int(max_new_tokens),
                         "stops": [int(t) for t in stop_ids]})
        self.last = {k: v for k, v in ans.items() if k not in ("tokens", "seconds")}
        return ans["tokens"], float(ans["seconds"])

    def retry(self, rc: Optional[int], why: str) -> bool:
        """Whether to start the child again after it ended with ``rc`` (``why`` says how);
        a peer with a fallback changes ``cfg`` here and notes it. Default: never."""
        return False

    def _ask(self, msg: dict) -> dict:
        req = json.dumps(msg)
        while True:
            try:
                if self.proc is None:
                    self._start()
                self.proc.stdin.write(req + "\n")
                self.proc.stdin.flush()
                ans = self._read()
            except (Died, BrokenPipeError) as e:
                rc = e.rc if isinstance(e, Died) else self._exit_code()
                tail = e.stderr_tail if isinstance(e, Died) else ""
                self.close()
                why = f"{self.label} worker {describe_exit(rc)}" + (f" ({tail})" if tail else "")
                if self.retry(rc, why):
                    continue
                raise PeerFailed(why) from None
            if "error" in ans:
                raise PeerFailed(f"{self.label}: {ans['error']}")
            return ans


# ---------------------------------------------------------------- child side
def child_memory() -> dict:
    """This process's peak and current resident set size, MiB (VmHWM, VmRSS)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    k, v = line.split(":", 1)
                    out[k] = round(int(v.split()[0]) / 1024, 1)
    except OSError:
        pass
    return {"peak_rss_mb": out.get("VmHWM"), "rss_mb": out.get("VmRSS")}


def serve_child(load: Callable[[], tuple[object, dict]], answer: Callable[[object, dict], dict]) -> int:
    """The child's loop: ``load()`` -> (the peer, its info), written as the first line (or
    the error, and exit 1); then each request line answered with ``answer(peer, request)``
    (an exception becomes an ``{"error": ...}`` answer). Ends when stdin closes."""
    try:
        peer, info = load()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps({"info": info}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            ans = answer(peer, json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), flush=True)
    return 0
