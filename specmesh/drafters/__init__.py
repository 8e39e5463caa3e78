"""Drafters behind the one proposer contract (``base.Drafter``) and a factory.

``make_drafter(name, **kwargs)`` builds a drafter by name from ``DRAFTERS``. This
package knows nothing about gRPC; model-backed drafters import their heavy
dependencies lazily inside their own modules.
"""

from __future__ import annotations

from typing import Callable

from ..types import InvalidArgument
from .base import Drafter, DrafterBase
from .cache import CacheDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter


def _adaptive_lookup(**kwargs) -> Drafter:
    from .adaptive_lookup import AdaptiveLookupDrafter  # imports torch: only when used

    return AdaptiveLookupDrafter(**kwargs)


# name -> callable(**kwargs) returning a Drafter.
DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "prompt_lookup": PromptLookupDrafter,
    "suffix": SuffixDrafter,
    # lexical lookup + embedding retrieval + branched trees; needs embeddings=[V, D] or vocab_size=V
    "adaptive_lookup": _adaptive_lookup,
    # per-conversation draft caches (proactive / SSR texts), read by DraftContext.cache_id
    "cache": CacheDrafter,
    # "draft_lm": ...   (small draft language model; added by its module's owner)
    # "layerskip": ...  (self-speculative layer skip; added by its module's owner)
}


def make_drafter(name: str, **kwargs) -> Drafter:
    """Build the drafter registered under ``name``; unknown names are INVALID_ARGUMENT."""
    factory = DRAFTERS.get(name)
    if factory is None:
        raise InvalidArgument("drafter", f"unknown drafter {name!r}; known: {sorted(DRAFTERS)}")
    return factory(**kwargs)


__all__ = ["DRAFTERS", "CacheDrafter", "Drafter", "DrafterBase", "PromptLookupDrafter",
           "SuffixDrafter", "make_drafter"]
