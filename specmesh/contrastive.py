"""Vanilla contrastive decoding (no speculation): the reference speculative CD must equal.

Contrastive decoding (Li et al. 2023; O'Brien & Lewis 2023) decodes from
``p_cd ∝ exp((1 + β) log p_e − β log p_a)`` restricted to the expert's plausibility set
``{p_e ≥ α · max p_e}`` (``acceptance.contrastive_logits``). Here the expert is the
engine's full model and the amateur its layer-skip exit (the first E layers + final
norm + head), read from the same forward's hidden state after layer E − 1.

``contrastive_generate`` runs it token by token on one engine slot with its own
code path (a chain prefill, then one-token forwards; no verifier, no draft, no
acceptance rule): greedy takes argmax p_cd, sampling draws from
``target_probs(scores, sampling)`` with the first sample uniform of each round's
acceptance stream (``acceptance.uniforms``), so a given seed draws what plain
decoding through the verifier (``acceptance="contrastive"``, no drafter) draws.
Speculative CD (``SamplingParams(acceptance="contrastive")`` with any drafter) is
tested against it: identical greedy output, and a chi-square test of sampled output
against the exact p_cd joint (``next_distribution``).

This module knows nothing about sessions, drafters, gRPC or tokenizers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import acceptance as acc
from .engine import LlamaEngine
from .seeding import round_seed
from .types import SamplingParams


def _scores(engine: LlamaEngine, slot: int, tokens: Sequence[int], exit_layer: int,
            sampling: SamplingParams) -> torch.Tensor:
    """Append ``tokens`` (a chain) to the slot; return the [1, V] contrastive scores after the last."""
    tokens = list(tokens)
    last = len(tokens) - 1
    out = engine.score(slot, tokens, list(range(-1, last)), rows=[last], hidden_layers=[exit_layer - 1])
    engine.commit(slot, range(len(tokens)))
    amateur = engine.head_logits(out.hidden[exit_layer - 1][[last]])
    return acc.contrastive_logits(out.logits, amateur, sampling.cd_alpha, sampling.cd_beta)


def next_distribution(engine: LlamaEngine, exit_layer: int, context: Sequence[int], sampling: SamplingParams,
                      slot: int = 0) -> torch.Tensor:
    """[V] float64 p_cd after ``context`` (one prefill of the whole context on ``slot``,
    which is reset), temperature / top-k / top-p applied; one-hot argmax when greedy."""
    engine.reset(slot)
    s = _scores(engine, slot, context, exit_layer, sampling)
    engine.reset(slot)
    return acc.target_probs(s, sampling)[0].double()


def contrastive_generate(engine: LlamaEngine, exit_layer: int, prompt_ids: Sequence[int], max_new_tokens: int,
                         sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
                         slot: int = 0) -> list[int]:
    """Vanilla contrastive decoding of up to ``max_new_tokens`` tokens after ``prompt_ids``
    (a stop id ends it and is not returned). Uses and resets ``slot``."""
    if not 0 < exit_layer < engine.n_layers:
        raise ValueError(f"exit_layer must be in (0, {engine.n_layers}), got {exit_layer}")
    tokens, out = list(prompt_ids), []
    engine.reset(slot)
    try:
        s = _scores(engine, slot, tokens, exit_layer, sampling)
        while len(out) < max_new_tokens:
            if sampling.greedy:
                t = int(acc.argmax_rows(s)[0])
            else:
                _, u = acc.uniforms(round_seed(sampling.seed, len(tokens)), 0, 0)
                t = acc.sample(acc.target_probs(s, sampling)[0].double(), float(u[0]))
            if t in stop_ids:
                break
            out.append(t)
            tokens.append(t)
            if len(out) < max_new_tokens:
                s = _scores(engine, slot, [t], exit_layer, sampling)
    finally:
        engine.reset(slot)
    return out
