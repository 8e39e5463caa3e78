"""The router's side of draft-ahead (``router.adapters.RemoteDrafter``), against a stub of
the Drafter service's two calls (a unit test of one piece: the real services are in
tests/services/test_draft_ahead_grpc.py).

When the verify ended in the outcome the ProposeAhead answer carries ("all accepted", the
guessed bonus token) and that answer is in, the round is used with no Propose; when the
answer is still pending, or the outcome is another, the Propose goes out at once without
waiting for the answer (the service cancels the ahead round it no longer needs)."""

from __future__ import annotations

from concurrent.futures import Future

from specmesh.router.adapters import Calls, RemoteDrafter
from specmesh.router.replicas import Peer, PeerHealth
from specmesh.wire import convert
from specmesh.types import DraftContext, SamplingParams, TokenTree
from specmesh.v1 import drafter_pb2

BASE = [5, 6, 7, 8]
ROUND = TokenTree.chain([9, 10])  # round r's draft
AHEAD = [11, 12, 13]  # the first ahead round's draft (after BASE + ROUND + [bonus 20])


class Stub:
    def __init__(self, answered: bool):
        self.answered, self.proposes, self.ahead_reqs = answered, [], []
        self.pending: list[Future] = []
        stub = self

        class _PA:
            @staticmethod
            def future(req, timeout=None, metadata=None):
                stub.ahead_reqs.append(req)
                f = Future()
                resp = drafter_pb2.ProposeAheadResponse(held_len=len(BASE), first_assumed=[9, 10, 20],
                                                        first_tree=convert.tree_to_proto(TokenTree.chain(AHEAD)))
                if stub.answered:
                    f.set_result(resp)
                else:
                    stub.pending.append((f, resp))
                return f

        class _P:
            @staticmethod
            def __call__(req, timeout=None, metadata=None):
                stub.proposes.append(req)
                return drafter_pb2.ProposeResponse(tree=convert.tree_to_proto(TokenTree.chain([1, 2])),
                                                   held_len=req.sync.keep_len + len(req.sync.append_tokens))

        self.ProposeAhead, self.Propose = _PA(), _P()


def drafter(answered: bool) -> tuple[RemoteDrafter, Stub]:
    stub = Stub(answered)
    d = RemoteDrafter(Peer("stub", None, stub, PeerHealth()), "draft_lm", Calls())
    d._held["s"] = list(BASE)
    assert d.propose_ahead(DraftContext("s", list(BASE), 2, SamplingParams()), ROUND, 3)
    assert stub.ahead_reqs[-1].return_first
    return d, stub


def ctx(tokens):
    return DraftContext("s", tokens, 2, SamplingParams())


def test_the_carried_round_is_used_without_a_propose():
    d, stub = drafter(answered=True)
    tree, info = d.propose_info(ctx(BASE + [9, 10, 20]), 2)
    assert tree.tokens == AHEAD[:2] and info.result == "hit" and info.reason == "first"
    assert stub.proposes == []
    # the next round syncs from what the service holds (the ahead call's tokens)
    assert d.propose_ahead(ctx(BASE + [9, 10, 20]), tree, 2)
    assert stub.ahead_reqs[-1].sync.keep_len == len(BASE) and list(stub.ahead_reqs[-1].sync.append_tokens) == [9, 10, 20]


def test_another_bonus_token_or_outcome_asks_the_service():
    for tokens in (BASE + [9, 10, 21], BASE + [9, 30]):
        d, stub = drafter(answered=True)
        tree, _ = d.propose_info(ctx(tokens), 2)
        assert tree.tokens == [1, 2] and len(stub.proposes) == 1
        assert stub.proposes[0].sync.keep_len == len(BASE)


def test_a_pending_answer_is_not_waited_for():
    """The answer waits for the first ahead round; a Propose must not wait for it (that round
    may be the wrong one, or still drafting the right one: the service handles both)."""
    for tokens in (BASE + [9, 10, 20], BASE + [9, 30]):
        d, stub = drafter(answered=False)
        tree, _ = d.propose_info(ctx(tokens), 2)  # would block forever if it waited
        assert tree.tokens == [1, 2] and len(stub.proposes) == 1
        assert stub.proposes[0].sync.keep_len == len(BASE)  # the ahead call's sync taken as held
        f, resp = stub.pending[0]
        f.set_result(resp)  # answered later: nothing breaks
