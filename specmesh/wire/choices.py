"""The seeds of a request's choices: what the SDK's ``generate_n`` and the OpenAI front's
``n`` share, so both draw the same outputs for the same request.

Knows nothing about gRPC, models or sampling beyond the seed.
"""

from __future__ import annotations

MAX_N = 8  # generate_n's (and the OpenAI API's n) largest n
MASK64 = (1 << 64) - 1


def child_seed(seed: int, i: int) -> int:
    """The seed of generation i of ``generate_n`` (and of choice i of an OpenAI request
    with ``n``): the request's own for i = 0 (so n = 1 draws what a single request
    draws), else a splitmix64 mix of (seed, i): independent draws, reproducible."""
    if i == 0:
        return seed & MASK64
    x = (seed ^ (i * 0xD1B54A32D192ED03)) & MASK64
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) & MASK64
