"""The ``auto`` strategy: pick a strategy for a request from its features and the
session's live stats, and say why.

``choose(features, stats)`` is a pure function. Rules, first match wins:

1. a conversation whose anticipation is ready          -> proactive (cache drafter)
2. reasoning on (a thinking section)                    -> ssr
2b. a grammar (a JSON schema, regex, choice, tool calls) -> external prompt_lookup, a chain
   drafter: every token the grammar forces (keys, separators, brackets, the rest of an
   enum value) is drafted free onto its chains (jump-forward), so a schema of fixed keys
   runs at τ 6 (issue 67: 4.8x plain decoding, where the block drafter's tree, which gets
   no forced tokens, ran at τ 1.18)
3. a multi-turn conversation or a long prompt           -> external suffix (per-request +
                                                           global suffix trees)
4. copy cues (a code block, a quoted passage, an edit /
   rewrite / quote instruction)                         -> external suffix (its drafts are
   bounded by the match length; in bench-strategies it beat prompt_lookup and
   adaptive_lookup on the copy-heavy workloads)
5. fresh text (open writing, chat: no copy cues), in order:
   a. the trained block drafter (``self`` / ``BLOCK_SELF``: its tree, ``block_tree``)
      when the verifier has it loaded (``Features.block_drafter``): measured
      1.50–1.65x plain decoding in bf16 on open_writing / chat_multiturn (its chain
      1.32–1.45x; docs/block-drafter.md), where n-gram drafters find little to copy;
   b. layer-skip if its calibration measured a speedup (untrained: it measured at
      most 0.96x here, so in practice never);
   c. the draft LM where the drafter service runs a real draft model
      (``Features.draft_model``: the target's paired draft model, e.g. Qwen2.5-Coder
      0.5B for 1.5B, or one it was given) and the drafter service is up: tried on the
      session's first such request, kept while it measures a speedup (issue 62: on
      the pair it ran at 28.6 tok/s, τ 5.08, where suffix decoding gave 22.1, τ 1.20);
   d. the draft LM if this session measured one above 1x;
   e. external suffix — a cheap drafter that drafts only where the text repeats
      (draft length bounded by the match length).

Then the session's stats overrule: when the chosen (strategy, drafter) has been
measured in this session at a speedup under ``off_below``, it is switched away —
the block drafter and the real draft model to the next fresh-text choice (itself
subject to the same rule), anything else to autoregressive — and re-tried every ``probe_every``-th
request of the session that would have chosen it (requests measured plus requests
switched away, ``Measured.skipped``), so a changing workload can win it back. A drafter
unavailable (no drafter service) degrades to self (block drafter, or a calibrated
layer-skip), then to autoregressive.

``SessionBook`` keeps per session (conversation id, else client) and per
(strategy, drafter) the EMA of the accepted length per round (tau - 1) and of the
measured speedup; ``measured_speedup`` computes the latter from a finished
generation's stats. The draft-length policy of the next request starts from the
session's acceptance EMA (``initial_alpha``); within a request
``adapt.TreeBudget`` adapts length and tree depth by the target's entropy.

This module knows nothing about gRPC, models or tokenizers: features are plain
values the router extracts.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Optional, Sequence

LONG_PROMPT_TOKENS = 384
# replies shorter than this leave a choice's measured speedup as it was: a few rounds of a
# short reply (a greeting) measured the draft LM at a slowdown and switched it off for the
# session's later, longer requests
MIN_MEASURED_TOKENS = 16
# The block drafter's self drafter for ``auto`` and for a ``self`` request naming none:
# its tree. Side by side in ``specmesh bench`` (bf16, 128 tokens, 4 prompts each of
# open_writing / chat_multiturn, 2 AMD EPYC AVX-512 cores) on the engine's default
# key-list attention, the tree gave 1.50-1.65x plain decoding and the chain 1.32-1.45x
# (two runs). With the SDPA-tile attention (no C compiler: a tree attended one path at a
# time) the chain was faster (1.35-1.51x vs 1.22-1.45x on that machine and on an Intel
# AMX one); there a request may name ``block``. Not measured on a GPU.
BLOCK_SELF = "block_tree"
EDIT_CUES = re.compile(r"\b(rewrite|re-write|refactor|rename|fix|edit|modify|add (type hints|a|an|the|docstrings?)|"
                       r"change|convert|translate|quot(e|es|ation|ations)|copy|repeat|extend|update)\b", re.I)


@dataclass(frozen=True)
class Features:
    """What the router knows about a request before it runs."""

    prompt_tokens: int = 0
    turns: int = 1  # chat messages (1 for a plain prompt)
    reasoning: bool = False
    anticipation_ready: bool = False  # the conversation has anticipated texts in its draft cache
    code_block: bool = False
    quoted: bool = False
    edit_cue: bool = False
    drafter_up: bool = True
    layerskip_speedup: Optional[float] = None  # from calibrate-layerskip, None = not calibrated
    block_drafter: bool = False  # the verifier has the trained block drafter (self drafters block, block_tree)
    in_verifier: frozenset = frozenset()  # external drafters the verifiers run themselves (no drafter service needed)
    draft_model: str = ""  # the real draft model the drafter service runs as draft_lm ("": none, the stand-in)
    grammar: str = ""  # what constrains the output ("" none; "json_schema", "tool calls", ...)


def text_features(text: str) -> dict:
    """Copy cues of a prompt text (a code fence, a quoted passage, edit verbs)."""
    return {"code_block": "```" in text or bool(re.search(r"^( {4}|\t)\S", text, re.M)),
            "quoted": len(re.findall(r"\"[^\"\n]{12,}\"|“[^”\n]{12,}”", text)) >= 1,
            "edit_cue": bool(EDIT_CUES.search(text))}


@dataclass
class Measured:
    """EMAs of one (strategy, drafter) in one session."""

    tau: float = 1.0
    speedup: float = 1.0
    alpha: float = 0.6
    n: int = 0  # finished requests measured
    skipped: int = 0  # requests auto switched away from it (so every probe_every-th request re-tries it)


@dataclass(frozen=True)
class Choice:
    strategy: str
    drafter: str  # external drafter or self-draft method; "" for autoregressive
    reason: str
    switched_from: tuple[str, ...] = ()  # labels the session's measurements switched away from


def label(strategy: str, drafter: str) -> str:
    return f"{strategy}:{drafter}" if drafter else strategy


def _by_features(f: Features, stats: dict[str, Measured]) -> Choice:
    if f.anticipation_ready:
        return Choice("proactive", "cache", "auto: anticipation ready for this conversation")
    if f.reasoning:
        return Choice("ssr", "cache", "auto: reasoning request (thinking section)")
    if f.grammar and (f.drafter_up or "prompt_lookup" in f.in_verifier):
        return Choice("external", "prompt_lookup", f"auto: {f.grammar} grammar -> prompt lookup (a chain drafter: "
                      "the grammar's forced tokens are drafted free, jump-forward)")
    if f.turns >= 3 or f.prompt_tokens >= LONG_PROMPT_TOKENS:
        why = f"{f.turns}-message conversation" if f.turns >= 3 else f"long prompt ({f.prompt_tokens} tokens)"
        return Choice("external", "suffix", f"auto: {why}, replies reuse it -> suffix decoding")
    cues = [n for n, v in (("code block", f.code_block), ("quoted text", f.quoted), ("edit instruction", f.edit_cue))
            if v]
    if cues:
        return Choice("external", "suffix", f"auto: prompt-reusing input ({', '.join(cues)}) -> suffix decoding")
    if f.block_drafter:
        return Choice("self", BLOCK_SELF, "auto: fresh text (no copy cues); the verifier has the trained block "
                      f"drafter -> self {BLOCK_SELF}")
    if f.layerskip_speedup is not None and f.layerskip_speedup > 1.0:
        return Choice("self", "layerskip", f"auto: fresh text; layer-skip calibrated at "
                      f"{f.layerskip_speedup:.2f}x -> self")
    lm = stats.get(label("external", "draft_lm"))
    if f.draft_model and f.drafter_up:
        why = (f"measured {lm.speedup:.2f}x here" if lm is not None and lm.n else
               "first try in this session; kept where it measures faster")
        return Choice("external", "draft_lm", f"auto: fresh text; the drafter service runs the draft model "
                      f"{f.draft_model} -> draft LM ({why})")
    if lm is not None and lm.n and lm.speedup > 1.0:
        return Choice("external", "draft_lm", f"auto: fresh text; draft LM measured {lm.speedup:.2f}x here")
    ls = "not calibrated" if f.layerskip_speedup is None else f"calibrated at {f.layerskip_speedup:.2f}x"
    return Choice("external", "suffix", f"auto: fresh text; layer-skip {ls}, no draft-LM gain measured -> "
                  "suffix decoding (drafts only where text repeats; off for the session if it measures a slowdown)")


def _verdict(m: Optional[Measured], off_below: float, probe_every: int) -> str:
    """What the session's measurement of a choice says: "" (nothing against it), "off"
    (measured under ``off_below``) or "probe" (the same, but this is every
    ``probe_every``-th request of the session for it: try it again)."""
    if m is None or not m.n or m.speedup >= off_below:
        return ""
    return "probe" if (m.n + m.skipped) % probe_every == 0 else "off"


def choose(f: Features, stats: Optional[dict[str, Measured]] = None, off_below: float = 0.97,
           probe_every: int = 4) -> Choice:
    """The strategy for a request (see the module docstring for the rules).
    ``Choice.switched_from`` names what the session's measurements switched away
    from (the caller counts them with ``SessionBook.skip``, so re-probes come round)."""
    stats = stats or {}
    c = _by_features(f, stats)
    # the fresh-text choices that step aside for the next one where the session measured them slower
    for chosen, without in ((("self", BLOCK_SELF), {"block_drafter": False}),
                            (("external", "draft_lm"), {"draft_model": ""})):
        if (c.strategy, c.drafter) != chosen or (chosen[1] == "draft_lm" and not f.draft_model):
            continue
        lab = label(c.strategy, c.drafter)
        m = stats.get(lab)
        v = _verdict(m, off_below, probe_every)
        if v == "probe":
            return Choice(c.strategy, c.drafter, c.reason + f"; re-probing (measured {m.speedup:.2f}x)",
                          c.switched_from)
        if v == "off":
            f = replace(f, **without)
            alt = _by_features(f, {k: x for k, x in stats.items() if k != lab})
            c = Choice(alt.strategy, alt.drafter, f"{c.reason}; but it measured {m.speedup:.2f}x in this session "
                       f"-> {alt.reason.removeprefix('auto: ')}", c.switched_from + (lab,))
    needs_drafter = c.strategy in ("external", "proactive", "ssr")
    if needs_drafter and not f.drafter_up and not (c.strategy == "external" and c.drafter in f.in_verifier):
        if c.strategy == "external" and f.block_drafter:
            return Choice("self", BLOCK_SELF, c.reason + f"; drafter service down -> self {BLOCK_SELF}",
                          c.switched_from)
        if c.strategy == "external" and f.layerskip_speedup and f.layerskip_speedup > 1.0:
            return Choice("self", "layerskip", c.reason + "; drafter service down -> self", c.switched_from)
        return Choice("autoregressive", "", c.reason + "; drafter service down -> autoregressive", c.switched_from)
    lab = label(c.strategy, c.drafter)
    m = stats.get(lab)
    v = _verdict(m, off_below, probe_every) if c.strategy in ("external", "self") else ""
    if v == "off":
        return Choice("autoregressive", "", f"{c.reason}; but {lab} measured {m.speedup:.2f}x in this session "
                      "-> speculation off", c.switched_from + (lab,))
    if v == "probe":
        return Choice(c.strategy, c.drafter, c.reason + f"; re-probing (measured {m.speedup:.2f}x)", c.switched_from)
    return c


def measured_speedup(new_tokens: int, total_s: float, ttft_s: float, ar_token_s: Optional[float],
                     verify_s: float = 0.0, rounds: int = 0, drafted: int = 0, beta: float = 0.06) -> Optional[float]:
    """Decode-phase speedup of a finished generation: t_AR / (seconds per new token
    after the first). t_AR is the router's measured autoregressive time per token;
    without one it is estimated from this request's verify forwards with the cost
    model (a forward of 1 + k tokens costs 1 + beta * k single-token forwards)."""
    if new_tokens < 2 or total_s <= ttft_s:
        return None
    per_token = (total_s - ttft_s) / (new_tokens - 1)
    if ar_token_s is None:
        if not rounds or verify_s <= 0:
            return None
        ar_token_s = verify_s / rounds / (1 + beta * drafted / rounds)
    return ar_token_s / per_token


class SessionBook:
    """session key -> label -> Measured (EMA weight ``ema``), LRU-bounded; plus the
    router-wide EMA of autoregressive seconds per token."""

    def __init__(self, ema: float = 0.5, max_sessions: int = 4096):
        self.ema, self.max_sessions = ema, max_sessions
        self._s: "OrderedDict[str, dict[str, Measured]]" = OrderedDict()
        self._lock = threading.Lock()
        self.ar_token_s: Optional[float] = None

    def get(self, key: str) -> dict[str, Measured]:
        with self._lock:
            d = self._s.get(key)
            if d is not None:
                self._s.move_to_end(key)
            return dict(d or {})

    def initial_alpha(self, key: str, lab: str, default: Optional[float] = 0.6) -> Optional[float]:
        m = self.get(key).get(lab)
        return m.alpha if m is not None and m.n else default

    def record(self, key: str, lab: str, tau: float, speedup: Optional[float], alpha: Optional[float] = None) -> None:
        w = self.ema
        with self._lock:
            d = self._s.setdefault(key, {})
            self._s.move_to_end(key)
            while len(self._s) > self.max_sessions:
                self._s.popitem(last=False)
            m = d.setdefault(lab, Measured())
            first = m.n == 0
            m.tau = tau if first else (1 - w) * m.tau + w * tau
            if speedup is not None:
                m.speedup = speedup if first else (1 - w) * m.speedup + w * speedup
            if alpha is not None:
                m.alpha = alpha if first else (1 - w) * m.alpha + w * alpha
            m.n += 1

    def skip(self, key: str, labels: Sequence[str]) -> None:
        """``choose`` switched this session away from ``labels`` (they measured too slow)."""
        with self._lock:
            d = self._s.get(key, {})
            for lab in labels:
                if lab in d:
                    d[lab].skipped += 1

    def record_ar(self, new_tokens: int, total_s: float, ttft_s: float) -> None:
        if new_tokens < 2 or total_s <= ttft_s:
            return
        t = (total_s - ttft_s) / (new_tokens - 1)
        with self._lock:
            self.ar_token_s = t if self.ar_token_s is None else (1 - self.ema) * self.ar_token_s + self.ema * t


def features_from(prompt_ids: Sequence[int], text: str, turns: int, reasoning: bool, anticipation_ready: bool,
                  drafter_up: bool, layerskip_speedup: Optional[float], block_drafter: bool = False,
                  in_verifier: frozenset = frozenset(), draft_model: str = "", grammar: str = "") -> Features:
    return Features(prompt_tokens=len(prompt_ids), turns=turns, reasoning=reasoning,
                    anticipation_ready=anticipation_ready, drafter_up=drafter_up,
                    layerskip_speedup=layerskip_speedup, block_drafter=block_drafter, in_verifier=in_verifier,
                    draft_model=draft_model, grammar=grammar, **text_features(text))


__all__ = ["BLOCK_SELF", "Choice", "Features", "Measured", "SessionBook", "choose", "features_from", "label", "measured_speedup",
           "text_features"]
