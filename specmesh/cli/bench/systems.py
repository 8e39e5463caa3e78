"""The systems a benchmark compares, behind one small contract, and their names.

A system turns prompt token ids into greedy output token ids and says how long
that took and how many target forwards it used. ``ours_*`` systems run the one
draft–verify loop (``specmesh.loop``) over an in-process ``Runtime``:

  ours_ar             plain decoding through the verifier (no drafter)
  ours_prompt_lookup  n-gram prompt lookup drafter
  ours_suffix         suffix-tree drafter (learns from earlier outputs)
  ours_draft_lm       small draft LM made of a few target layers
  ours_layerskip      self-speculation inside the verifier (first E layers)
  ours_block          the trained block drafter inside the verifier (chain)
  ours_block_tree     the same drafter, best-first calibrated tree
  ours_uno            the target drafting for itself (mask-gated adapter, one forward a round)
  ours_uno_tree       the same, its block as a calibrated tree
  ours_uno_separate   the same adapter in a draft pass of its own (two forwards a round)

A token-only drafter's system (prompt_lookup, suffix, draft_lm) drafts ahead as
``specmesh.ahead.AHEAD_DEFAULT`` says; ``ours_<drafter>_overlap`` always drafts the next
round on the drafter's own thread while the verifier verifies this one
(``ahead.AheadDrafter``, overlap "on"), ``ours_<drafter>_serial`` never does, and
``ours_<drafter>_auto`` leaves it to the overlap policy (``ahead.OverlapPolicy("auto")``,
learning across the system's generations): name them to compare them side by side
(e.g. ``ours_draft_lm_overlap,ours_draft_lm_serial``).

The ``uno`` systems are in no default group (``uno`` names them; ``specmesh uno-study``
measures them in detail).

A ``_fp32`` / ``_bf16`` / ``_int8`` / ``_int4`` suffix runs the same system on an engine of
that dtype (default: the run's ``--dtype``); its reference AR is ``ours_ar`` with
the same suffix. Peer systems (Hugging Face, llama.cpp, OpenVINO GenAI) live in ``peers``;
``hf_static_compile`` is known but in no group (name it).

This module knows nothing about workloads, timing policy or reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ...drafters import registry
from ...loop import AdaptiveBudget, generate_tokens
from ...types import GenerationStats, InvalidArgument

OURS_STRATEGIES = ("ar", "prompt_lookup", "suffix", "draft_lm", "layerskip", "block", "block_tree")
OURS_EXTRA = ("uno", "uno_tree", "uno_separate")  # valid names, in no default group
SELF_STRATEGIES = registry.SELF  # drafted inside the verifier
HF_SYSTEMS = ("hf_ar", "hf_pld", "hf_assisted")
HF_EXTRA_SYSTEMS = ("hf_static_compile",)  # known, but in no group: it compiles (minutes on a CPU)
LLAMACPP_SYSTEMS = ("llamacpp_ar", "llamacpp_pld", "llamacpp_draft_lm")  # the last: with a paired draft GGUF
OPENVINO_SYSTEMS = ("openvino_ar", "openvino_draft_lm", "openvino_pld")  # OpenVINO GenAI (peers.make_openvino)
CHILD_FAMILIES = ("llamacpp", "openvino")  # peers run in a child process of their own (peer_process)
DTYPES = ("fp32", "bf16", "int8", "int4")
OVERLAP_SUFFIXES = {"_overlap": "on", "_serial": "off", "_auto": "auto"}  # ours_<drafter><suffix>: draft-ahead
# forced on / off, or the policy's choice (``ahead.OverlapPolicy("auto")``, learning across the system's runs)
OVERLAP_STRATEGIES = tuple(s for s in OURS_STRATEGIES if s in registry.CONTEXT_ONLY)  # token-only drafters
DEFAULT_SYSTEMS = tuple(f"ours_{s}" for s in OURS_STRATEGIES) + HF_SYSTEMS + LLAMACPP_SYSTEMS + OPENVINO_SYSTEMS
GROUPS = {
    "all": DEFAULT_SYSTEMS,
    "ours": tuple(f"ours_{s}" for s in OURS_STRATEGIES),
    "hf": HF_SYSTEMS,
    "llamacpp": LLAMACPP_SYSTEMS,
    "openvino": OPENVINO_SYSTEMS,
    "uno": tuple(f"ours_{s}" for s in ("ar",) + OURS_EXTRA),
}


@dataclass
class RunOutput:
    """One generation. ``decode_tokens / decode_forwards`` is τ (tokens per target
    forward after the prefill); ``accept_hist`` is None where a system cannot tell."""

    tokens: list[int]
    seconds: float
    decode_tokens: Optional[int] = None
    decode_forwards: Optional[int] = None
    accept_hist: Optional[list[int]] = None
    draft_s: Optional[float] = None
    verify_s: Optional[float] = None
    peak_rss_mb: Optional[float] = None  # a peer in a child process: the child's peak RSS (else the bench's own)


@dataclass
class System:
    name: str
    family: str  # "ours" | "hf" | "llamacpp" | "openvino"
    reference: str  # the AR system of the same family (and dtype) used for speedup and identity
    run: Callable[[Sequence[int], int], RunOutput]
    dtype: str = "fp32"
    budget: Optional[int] = None  # draft tokens per round (ceiling bin of the acceptance histogram)
    speculative: bool = True
    info: dict = field(default_factory=dict)


def parse_ours(name: str, default_dtype: str) -> tuple[str, str, str]:
    """``ours_<strategy>[_<dtype>]`` -> (strategy, dtype, dtype suffix or "")."""
    rest = name[len("ours_"):]
    suffix = ""
    for dt in DTYPES:
        if rest.endswith("_" + dt):
            rest, suffix = rest[: -len(dt) - 1], "_" + dt
            break
    for mode in OVERLAP_SUFFIXES:
        if rest.endswith(mode) and rest[: -len(mode)] in OVERLAP_STRATEGIES:
            rest = rest[: -len(mode)]
            break
    if rest not in OURS_STRATEGIES + OURS_EXTRA:
        raise InvalidArgument("systems", f"unknown system {name!r}; ours_* strategies: "
                                         f"{list(OURS_STRATEGIES + OURS_EXTRA)}")
    return rest, (suffix[1:] if suffix else default_dtype), suffix


def expand(names: Sequence[str]) -> list[str]:
    """Expand group names (all, ours, hf, llamacpp, openvino), drop duplicates, validate."""
    out: list[str] = []
    for n in names:
        n = n.strip()
        if not n:
            continue
        for m in GROUPS.get(n, (n,)):
            if m not in out:
                out.append(m)
    for n in out:
        if n.startswith("ours_"):
            parse_ours(n, "fp32")
        elif n not in HF_SYSTEMS + HF_EXTRA_SYSTEMS + LLAMACPP_SYSTEMS + OPENVINO_SYSTEMS:
            raise InvalidArgument("systems", f"unknown system {n!r}; known: {list(DEFAULT_SYSTEMS)} "
                                             f"(+ _fp32/_bf16/_int8/_int4 on ours_*) or groups {list(GROUPS)}")
    if not out:
        raise InvalidArgument("systems", "is empty")
    return out


def overlap_mode(name: str) -> str:
    """The draft-ahead mode of an ``ours_*`` system: its ``_overlap`` / ``_serial`` / ``_auto`` suffix,
    else ``ahead.AHEAD_DEFAULT``."""
    from ...ahead import AHEAD_DEFAULT

    rest = name[len("ours_"):]
    for dt in DTYPES:
        if rest.endswith("_" + dt):
            rest = rest[: -len(dt) - 1]
    return next((m for s, m in OVERLAP_SUFFIXES.items() if rest.endswith(s)), AHEAD_DEFAULT)


def make_ours(name: str, runtime, budget: int, default_dtype: str, adaptive: bool = True,
              router_policy: bool = False) -> System:
    """An ``ours_*`` system over ``runtime`` (whose dtype must match the name's). With
    ``adaptive`` each generation gets a fresh ``AdaptiveBudget(budget)`` (draft length
    from measured acceptance and cost; speculation off where it does not pay) sharing
    the runtime's ``VerifyCosts`` (the verifier's cost per scored token carries over).
    ``router_policy``: the router's budget policy instead (``TreeBudget``: the draft size
    also capped by the target's entropy, and full length for drafters whose drafts cost
    nothing), so a served request and this one draft alike (``bench-services``)."""
    strategy, dtype, suffix = parse_ours(name, default_dtype)
    drafter = None
    self_draft = None
    if strategy in SELF_STRATEGIES:
        if strategy not in runtime.verifier.self_drafters:
            raise InvalidArgument("systems", f"{name}: no {strategy!r} drafter in this verifier (the block "
                                             "drafter and the uno adapter need a checkpoint for this model; see "
                                             "`specmesh train-drafter`, `specmesh train-uno`)")
        self_draft = strategy
    ahead = strategy in OVERLAP_STRATEGIES and overlap_mode(name) != "off"
    if strategy != "ar" and self_draft is None and not ahead:
        drafter = runtime.drafter(strategy)  # one instance for the whole run (suffix keeps its global tree)
    overlap = None
    if ahead:
        from ...ahead import AheadDrafter, OverlapPolicy
        from ...threads import ModelThread

        # every drafter call (ahead rounds and misses) on one thread of its own with its own torch
        # threads (half the process's), while this thread verifies (specmesh.threads: one team a thread)
        import torch

        mt = ModelThread(f"specmesh-drafter-{name}", threads=max(1, torch.get_num_threads() // 2))
        drafter = AheadDrafter(mt.run(runtime.drafter, strategy), run=mt.run)  # loaded there too (if first)
        overlap = OverlapPolicy(overlap_mode(name))  # one per system: "auto" learns across its generations

    kind, extra = AdaptiveBudget, {}
    if router_policy:
        from ...drafters import registry
        from ...strategies.adapt import TreeBudget

        kind, extra = TreeBudget, {"fixed_length": strategy in registry.FREE}

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> RunOutput:
        stats = GenerationStats()
        t0 = time.perf_counter()
        policy = (kind.for_drafter(strategy, budget, costs=runtime.verify_costs,
                                   schedule=getattr(runtime, "tree_schedule", None), **extra)
                  if adaptive or router_policy else budget)
        out, stats = generate_tokens(drafter, runtime.verifier, list(prompt_ids), max_new_tokens=max_new_tokens,
                                     stop_ids=runtime.stop_ids, budget=policy, self_draft=self_draft, stats=stats,
                                     draft_ahead=overlap)
        dt = time.perf_counter() - t0
        return RunOutput(out, dt, stats.accepted_tokens + stats.rounds, stats.rounds, list(stats.accept_hist),
                         stats.draft_s, stats.verify_s)

    return System(name, "ours", "ours_ar" + suffix, run, dtype=dtype,
                  budget=budget if strategy != "ar" else None, speculative=strategy != "ar",
                  info={"strategy": strategy, "engine_dtype": dtype,
                        "draft_ahead": overlap.mode if overlap is not None else "off"})
