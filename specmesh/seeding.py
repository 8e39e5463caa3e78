"""The one seed mixer: every random draw of a generation comes from here.

Sampled speculation is lossless only if each round's randomness is fresh given
everything before it, and the drafter's draws are independent of the verifier's
acceptance uniforms. Both hold when every draw is keyed by

    (request seed, committed length, stream)

- the committed length grows by at least one token every round, so within one
  generation no key repeats: a round never reuses an earlier round's uniforms,
  whatever earlier rounds drafted or rejected;
- the stream (``DRAFT``, ``ACCEPT``, or a side-branch tag) separates the drafter's
  draws from the verifier's, so a draft says nothing about the uniforms that will
  judge it;
- the key is a pure function of what the router holds (seed, committed tokens),
  so a re-prefilled or different replica, or a drafter in another process, draws
  the same numbers: sampled output is reproducible for a given seed.

The target's own token at a position is drawn with ``position_uniform(seed,
committed length)``, the uniform plain decoding draws there. Sampled verification
of a draft that carries no distribution (one-hot: lookups, suffix, caches, a
prediction, trees of fixed candidates, a model's argmax) emits that token and
accepts the draft node equal to it, so a seeded output is plain sampling's
whatever the drafter, the draft sizes, the strategy, the load or the cache.

``mix`` is a splitmix64-style finaliser over the keys (full 64-bit avalanche).
This module knows nothing about models, tensors' contents or gRPC.
"""

from __future__ import annotations

from typing import Optional

import torch

MASK64 = 0xFFFFFFFFFFFFFFFF

# streams (arbitrary distinct constants)
ACCEPT = 0x41434345  # the verifier's acceptance uniforms
DRAFT = 0x44524146  # a drafter's own draws
SIDE = 0x53494445  # side generations whose output only drafts (SSR side branches)


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix(*keys: int) -> int:
    """A 63-bit seed from any number of integer keys (order matters)."""
    x = 0
    for k in keys:
        x = _splitmix(x ^ (int(k) & MASK64))
    return x & 0x7FFFFFFFFFFFFFFF


def round_seed(seed: int, committed_len: int) -> int:
    """The seed of the round that starts with ``committed_len`` committed tokens
    (prompt + generated, the pending token included). The loop sends it with the
    verify request; a drafter derives the same value from its context."""
    return mix(seed, committed_len)


def position_uniform(seed: int, committed_len: int) -> float:
    """The uniform that draws the target's token after ``committed_len`` committed tokens:
    the first of that round seed's acceptance stream, which is what plain decoding's round
    there draws. Sampled verification emits the token this picks at every position,
    whatever was drafted (``acceptance.match_tree``), so a seeded output does not depend on
    how the positions were split into rounds."""
    return first_uniform(round_seed(seed, committed_len))


def first_uniform(round_seed_: int) -> float:
    """The first uniform of a round seed's acceptance stream (``acceptance.uniforms``' first)."""
    g = generator(round_seed_, ACCEPT)
    return float(torch.rand(1, generator=g, dtype=torch.float64)[0])


def generator(round_seed_: int, stream: int, device: Optional[torch.device | str] = None) -> torch.Generator:
    """A torch generator for one stream of one round."""
    g = torch.Generator(device=device) if device is not None else torch.Generator()
    return g.manual_seed(mix(round_seed_, stream))


def draft_generator(ctx, device: Optional[torch.device | str] = None) -> torch.Generator:
    """The generator a drafter samples its draft from for the round of ``ctx`` (a
    ``types.DraftContext``): fresh every round, independent of the acceptance uniforms."""
    rs = ctx.round_seed if ctx.round_seed is not None else round_seed(ctx.sampling.seed, len(ctx.tokens))
    return generator(rs, DRAFT, device)
