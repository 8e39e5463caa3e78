"""The one proposer contract every drafter implements.

A drafter turns a session's committed tokens into a draft ``TokenTree`` (chain or
tree) of at most ``budget`` nodes, with the sparse draft distribution q of each
node when the drafter samples (deterministic drafters leave q empty: one-hot).
Drafters keep per-session state keyed by ``session_id`` and must tolerate the
context shrinking (rollback) or growing by many tokens between calls.

This module knows nothing about the target model, acceptance rules or gRPC.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..types import DraftContext, TokenTree


@runtime_checkable
class Drafter(Protocol):
    name: str

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        """Return a draft of at most ``budget`` nodes (possibly empty)."""
        ...

    def release(self, session_id: str) -> None:
        """Forget the session's state (request finished, cancelled or expired)."""
        ...

    def finish(self, session_id: str, tokens: list[int], prompt_len: int) -> None:
        """The session ended with these committed tokens; drafters that learn from
        past outputs (suffix decoding's global tree) absorb them, then release."""
        ...


class DrafterBase:
    """Convenience base: no per-session state, finish() == release()."""

    name = "base"

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:  # pragma: no cover - abstract
        raise NotImplementedError

    def release(self, session_id: str) -> None:
        pass

    def finish(self, session_id: str, tokens: list[int], prompt_len: int) -> None:
        self.release(session_id)
