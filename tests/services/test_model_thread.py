"""Where a service's model work runs (``specmesh.threads``): every forward of the
verifier service (prefill, verify, release, layer-skip self drafts) and every call
into a hosted drafter runs on its one model thread, and the gRPC handler threads
open no OpenMP team of their own. Structural guards of the services' speed: a
model run from two threads throttles libgomp's spin (docs/performance.md)."""

from __future__ import annotations

import threading

import torch

from specmesh.drafters import PromptLookupDrafter
from specmesh.serving.server import _handler_thread
from specmesh.threads import ModelThread
from specmesh.drafter_service.host import DrafterHost
from specmesh.types import SamplingParams, TokenTree
from specmesh.v1 import router_pb2
from tests.support import TinyStack


def _recording(obj, names, seen):
    for name in names:
        real = getattr(obj, name)

        def wrapped(*a, _real=real, **kw):
            seen.add(threading.get_ident())
            return _real(*a, **kw)

        setattr(obj, name, wrapped)


def test_every_forward_of_the_verifier_service_runs_on_its_model_thread():
    stack = TinyStack()
    try:
        engine = stack.verifiers[0].engine
        seen: set[int] = set()
        _recording(engine, ["prefill", "score", "score_batch", "commit", "truncate", "reset"], seen)
        for strategy, drafter in (("autoregressive", ""), ("external", "prompt_lookup"), ("self", "layerskip")):
            req = router_pb2.GenerateRequest(prompt="abcabc hello hello abcabc", strategy=strategy, drafter=drafter,
                                             max_new_tokens=12)
            list(stack.stub.Generate(req, timeout=60))
        assert seen, "no forward ran"
        assert seen == {stack.batchers[0].thread.ident}, "a forward ran outside the verifier's model thread"
    finally:
        stack.close()


def test_drafter_host_runs_every_drafter_call_on_the_thread_it_is_given():
    mt = ModelThread("test-drafter-model")
    seen: set[int] = set()

    class Recording(PromptLookupDrafter):
        def __init__(self):
            seen.add(threading.get_ident())
            super().__init__()

        def propose(self, ctx, budget):
            seen.add(threading.get_ident())
            return super().propose(ctx, budget)

        def release(self, session_id):
            seen.add(threading.get_ident())
            return super().release(session_id)

    host = DrafterHost({"prompt_lookup": Recording}, vocab_size=100, run=mt.run)
    try:
        tree, held, _ = host.propose("s", "prompt_lookup", 0, [1, 2, 3, 1, 2], 2, SamplingParams(), 4)
        assert held == 5 and isinstance(tree, TokenTree)
        host.release("s")
        assert seen == {mt.ident}
    finally:
        mt.stop()


def test_handler_threads_run_torch_on_one_thread_and_leave_the_model_thread_its_team():
    mt = ModelThread("test-model", threads=2)
    got = {}

    def handler():
        _handler_thread()  # what the gRPC server's pool runs first on each of its threads
        got["handler"] = torch.get_num_threads()

    try:
        t = threading.Thread(target=handler)
        t.start()
        t.join()
        assert got["handler"] == 1
        assert mt.run(torch.get_num_threads) == 2  # a per-thread setting: the model thread keeps its team
    finally:
        mt.stop()
