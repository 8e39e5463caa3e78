"""The one drafter registry: every drafter's name and traits.

Every list of drafter names in the project derives from ``SPECS`` (the router's
per-strategy lists, the loop's cost model, the runtime, the bench, the settings'
choices), so a new drafter is added in one place. How each is *built* stays with
its owner (``drafters.make_drafter`` for the context-only ones, ``Runtime`` and the
drafter service for model-backed ones): building needs models this module does not
know.

Traits:
- ``where``: ``external`` (runs anywhere: the drafter service or in process) or
  ``verifier`` (self-speculative: needs the target's own weights, KV or hidden
  states, so it runs inside the verifier process).
- ``cost``: ``free`` (lookups: next to nothing, and they bound their own length),
  ``token`` (one model step per drafted token) or ``round`` (one pass proposes the
  whole block: the block drafter).
- ``shape``: ``chain`` or ``tree``.
- ``selectable``: a user may name it in a request (``cache`` is the proactive and
  SSR strategies' own drafter, chosen by the strategy).
- ``fused``: the draft of a round comes out of the previous round's verify forward
  (``uno``: the verifier hangs mask blocks on it), so the loop drafts from the
  first round on: the prefill's forward already computes the first draft.
- ``needs_features``: it conditions on the target's hidden states. In the verifier
  (``where="verifier"``) it reads them there; as an ``external`` drafter the
  router asks the verifier for them with every verify (``feature_layers``), keeps
  them per session and forwards each committed token's row once to the drafter
  service (docs/design.md, "Protocol", "Hidden states (features)").

A name may be registered once per ``where``: ``block`` and ``block_tree`` exist in
the verifier (``self:block_tree``) and on the drafter service
(``external:block_tree``). ``spec(name, where)`` picks one; traits other than
``where`` and ``needs_features`` are the same for both (the loop's cost model reads
them by name).

Knows nothing about models, tensors or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    where: str  # "external" | "verifier"
    cost: str  # "free" | "token" | "round"
    shape: str  # "chain" | "tree"
    summary: str
    selectable: bool = True
    needs_features: bool = False
    fused: bool = False  # drafts from the previous verify forward (the loop drafts from the first round)


SPECS: tuple[DrafterSpec, ...] = (
    DrafterSpec("prompt_lookup", "external", "free", "chain", "n-gram prompt lookup (longest suffix match)"),
    DrafterSpec("suffix", "external", "free", "tree", "suffix decoding: per-request and global suffix trees"),
    DrafterSpec("adaptive_lookup", "external", "free", "tree",
                "lexical lookup, then embedding retrieval, branched hypotheses as a tree"),
    DrafterSpec("cache", "external", "free", "tree",
                "suffix drafting over a conversation's draft cache (proactive / SSR texts)", selectable=False),
    DrafterSpec("draft_lm", "external", "token", "chain", "a small LM with the target's tokenizer (a STAND-IN "
                "unless the target has a paired draft model or --draft-model names one: DRAFT_LM_NOTE)"),
    DrafterSpec("layerskip", "verifier", "token", "chain", "the target's first E layers and its head"),
    DrafterSpec("specialist", "verifier", "token", "chain",
                "a domain specialist (LoRA-tuned copy of the target) drafting for divergence decoding; its full "
                "distributions stay in the verifier for the JSD test"),
    DrafterSpec("block", "verifier", "round", "chain",
                "the trained block drafter on the target's hidden states: a chain in one pass", needs_features=True),
    DrafterSpec("block_tree", "verifier", "round", "tree",
                "the trained block drafter: a calibrated best-first tree in one pass", needs_features=True),
    DrafterSpec("uno", "verifier", "round", "chain",
                "the target drafting for itself through its mask-gated adapter: each verify forward also "
                "computes the next round's block (one forward a round)", fused=True),
    DrafterSpec("uno_tree", "verifier", "round", "tree",
                "the mask-gated adapter's block as a calibrated best-first tree (one forward a round)", fused=True),
    DrafterSpec("uno_separate", "verifier", "round", "chain",
                "the mask-gated adapter in a draft pass of its own before the verify pass (two forwards a "
                "round: the PEFT-BD layout, for comparison)"),
    DrafterSpec("block", "external", "round", "chain",
                "the trained block drafter on the drafter service, fed the target's hidden states over the wire: "
                "a chain in one pass", needs_features=True),
    DrafterSpec("block_tree", "external", "round", "tree",
                "the trained block drafter on the drafter service, fed the target's hidden states over the wire: "
                "a calibrated best-first tree in one pass", needs_features=True),
)


# Wherever draft_lm is listed (help texts, ListStrategies, docs) it carries this: the
# default target has no small model of its own, so its draft LM is an untrained cut of it.
DRAFT_LM_NOTE = ("draft_lm is a stand-in unless a real draft model is configured: for a target without a paired "
                 "draft model it is an untrained 4-layer cut of the target (layers 0,1,2,29) that accepts almost "
                 "nothing (a `make demo` run: 0 of 357 drafts accepted, slower than plain decoding); a real pair: "
                 "`make setup-qwen`, then --model qwen2.5-coder-1.5b-instruct (its 0.5B is the draft LM), or "
                 "`specmesh serve --draft-model DIR`")


def names(where: Optional[str] = None, cost: Optional[str] = None, shape: Optional[str] = None,
          selectable: Optional[bool] = None, needs_features: Optional[bool] = None,
          fused: Optional[bool] = None) -> tuple[str, ...]:
    """Registered drafter names with the given traits, in registration order (each name once)."""
    out = (s.name for s in SPECS
           if (where is None or s.where == where) and (cost is None or s.cost == cost)
           and (shape is None or s.shape == shape) and (selectable is None or s.selectable == selectable)
           and (needs_features is None or s.needs_features == needs_features)
           and (fused is None or s.fused == fused))
    return tuple(dict.fromkeys(out))


def spec(name: str, where: Optional[str] = None) -> Optional[DrafterSpec]:
    """The spec of ``name`` (``where``: "external" or "verifier"; None: the first registered)."""
    return next((s for s in SPECS if s.name == name and (where is None or s.where == where)), None)


def needs_features(name: str, where: str = "external") -> bool:
    """Whether the ``where`` variant of ``name`` conditions on the target's hidden states."""
    s = spec(name, where)
    return s is not None and s.needs_features


EXTERNAL = names(where="external", selectable=True)  # what `external` requests may name
SELF = names(where="verifier")  # in-verifier (``self`` strategy) drafters
FREE = names(cost="free")  # drafts cost next to nothing: full length, capped by entropy
PER_ROUND = names(cost="round")  # one pass per block: draft cost per round, not per token
PER_ROUND_TREES = names(cost="round", shape="tree")  # of those, the best-first trees
EXTERNAL_FEATURES = names(where="external", needs_features=True)  # external drafters fed hidden states by the router
CONTEXT_ONLY = names(where="external", needs_features=False)  # external drafters that read tokens alone
FUSED = names(fused=True)  # self drafters whose draft comes out of the previous verify forward
