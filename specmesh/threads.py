"""Where a process's model work runs: one model thread, the CPUs it may use, and
how its OpenMP threads wait.

Why (measured on 2 AMD EPYC cores, torch's bundled libgomp): libgomp lets the
threads of a team spin between parallel regions (``GOMP_SPINCOUNT``) only while
the process's OpenMP threads are no more than its CPUs; past that it throttles the
spin to a few rounds, so every parallel op wakes a sleeping thread (a 1x576 by
576x1536 bf16 matmul: 55 us spinning, 110 us woken). Each thread that ever opens a
parallel region keeps a team of its own until it exits, so a model loaded on one
thread and run on another (the main thread loads, a batcher or a gRPC handler
forwards) is two teams on two cores: throttled for good. bf16 plain decoding on
SmolLM2, same process and settings: load and decode on one worker thread 101-122
tok/s, load on the main thread and decode on a worker 52 tok/s; with sleeping
threads (``OMP_WAIT_POLICY=PASSIVE``) 56-64 tok/s either way.

So a process that runs a model runs all of it (load, warm-up, every forward) on one
``ModelThread``; every other thread that may touch torch is made serial
(``serial_thread``: its own OpenMP team size 1, so it never opens a region and
never starts a team); and the process spins briefly (``specmesh.spin_threads``).
A spin is bounded (a fraction of a millisecond after the last region), so the
co-located services' Python work still gets the cores between forwards;
``--cpus`` (``place``) pins each service to cores of its own where it should not
share them.

This module knows nothing about models, gRPC or the services that use it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)


def parse_cpus(text: str) -> list[int]:
    """A Linux CPU list (``"0-1,3"``) as sorted CPU ids; ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU id or range (e.g. 0-1,3)") from None
        if a < 0 or b < a:
            raise ValueError(f"{part!r} is not a CPU range (ids >= 0, low-high)")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"no CPU in {text!r}")
    return sorted(cpus)


def place(cpus: Optional[str], apply: bool = True) -> Optional[list[int]]:
    """Pin this process to ``cpus`` (a CPU list; None or "" leaves it as it is) and
    return those CPUs (``apply`` False: only check them). ValueError for a CPU this
    process may not use (outside its affinity mask, or offline)."""
    if not cpus:
        return None
    want = parse_cpus(cpus)
    allowed = sorted(os.sched_getaffinity(0))
    missing = [c for c in want if c not in allowed]
    if missing:
        raise ValueError(f"CPUs {missing} are not available to this process (it may use {allowed})")
    if apply:
        os.sched_setaffinity(0, want)
    return want


def _libgomp() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime torch loaded, or None: torch's bundled libgomp answers to the
    soname ``libgomp.so.1``, so dlopen with RTLD_NOLOAD returns the copy already in the
    process and never loads another."""
    import torch  # noqa: F401 - torch's runtime is in the process first

    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def serial_thread() -> bool:
    """Make the calling thread run torch ops on itself alone: its OpenMP team size
    (a per-thread setting) becomes 1, so it never opens a parallel region and never
    keeps a team of OpenMP threads beside the model thread's. For threads that are
    not meant to run models (gRPC handlers, HTTP workers); use as a thread pool's
    ``initializer``. Other threads keep their setting. Returns whether it took effect
    (False where torch's OpenMP runtime is not found)."""
    import torch

    torch.get_num_threads()  # torch's per-thread lazy init first, so it cannot undo what follows
    lib = _libgomp()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


class ModelThread:
    """One long-lived thread that runs every piece of a process's model work, in the
    order submitted. ``threads`` (None: torch's default) sets torch's thread count on
    it before anything else runs there. ``run`` from the model thread itself calls
    inline (no deadlock on nested use)."""

    def __init__(self, name: str = "specmesh-model", threads: Optional[int] = None):
        self.name = name
        self.threads = threads
        self._jobs: deque[tuple[Future, Callable, tuple, dict]] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self.jobs_run = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> Optional[int]:
        return self._thread.ident

    def is_current(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def submit(self, fn: Callable, *args: Any, **kw: Any) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError(f"model thread {self.name} stopped")
            self._jobs.append((fut, fn, args, kw))
            self._cv.notify()
        return fut

    def run(self, fn: Callable, *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` on the model thread; its result, or its exception raised here."""
        if self.is_current():
            return fn(*args, **kw)
        return self.submit(fn, *args, **kw).result()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish the jobs already submitted, then end the thread."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if not self.is_current():
            self._thread.join(timeout)

    def _loop(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        while True:
            with self._cv:
                while not self._jobs and not self._stopped:
                    self._cv.wait()
                if not self._jobs:
                    return
                fut, fn, args, kw = self._jobs.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                res = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)
            else:
                fut.set_result(res)
            self.jobs_run += 1


_process_thread: Optional[ModelThread] = None
_process_lock = threading.Lock()


def model_thread(threads: Optional[int] = None) -> ModelThread:
    """The process's model thread (started on first use; ``threads`` applies only then)."""
    global _process_thread
    with _process_lock:
        if _process_thread is None:
            _process_thread = ModelThread(threads=threads)
        return _process_thread
