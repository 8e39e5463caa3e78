"""Proto <-> domain conversions, one small function per message.

Domain types are the dataclasses of ``specmesh.types``; protos are the generated
``specmesh.v1`` messages. ``*_from_proto`` functions only reshape: they never
judge values, except that ``SamplingParams`` validates itself on construction
(its errors are re-raised with the proto field path, e.g. ``sampling.top_p``)
and a verify request may not carry both a tree and ``self_draft``.
The core (``EngineVerifier``, the drafters, the loop) validates the rest before
it changes any state.

``RouterStats`` is ``GenerationStats`` plus what only the serving layer knows
(network time, the verifier replica, re-prefills); the router hands it to the
loop and sends it in the final message.

This module knows nothing about channels, servers, models or tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..types import (FeatureRows, GenerationStats, InvalidArgument, SamplingParams, SelfDraft, TokenLogprob,
                     TokenTree, VerifyRequest, VerifyResult)
from ..v1 import common_pb2, drafter_pb2, verifier_pb2

U64 = (1 << 64) - 1


@dataclass
class RouterStats(GenerationStats):
    """GenerationStats plus serving-layer facts (see common.proto GenerationStats)."""

    drafter: str = ""
    network_s: float = 0.0
    verifier: str = ""
    reprefills: int = 0
    resumed_tokens: int = 0  # output tokens a resumed request carried (0: not resumed)


MAX_SESSION_ID = 128
MAX_SALT = 256  # bytes of a cache_salt (the prefix cache's tenant key)


def check_session_id(sid: str) -> str:
    """Session ids are non-empty and at most 128 bytes (INVALID_ARGUMENT otherwise)."""
    if not sid:
        raise InvalidArgument("session_id", "must be non-empty")
    if len(sid.encode()) > MAX_SESSION_ID:
        raise InvalidArgument("session_id", f"longer than {MAX_SESSION_ID} bytes")
    return sid


def check_salt(salt: str, name: str = "cache_salt") -> str:
    """A prefix-cache tenant key as sent (INVALID_ARGUMENT naming ``name`` when over ``MAX_SALT`` bytes)."""
    if len(salt.encode("utf-8", "surrogatepass")) > MAX_SALT:
        raise InvalidArgument(name, f"longer than {MAX_SALT} bytes")
    return salt


def unicode_path(v, path: str = "") -> Optional[str]:
    """Where in ``v`` (str, or dicts and lists of them) a string is not Unicode text (it holds
    a lone UTF-16 surrogate, which JSON's \\ud800 escapes can carry and no wire encoding can),
    as a path (``messages[1].content``); None when all of it is."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return path or "value"
        return None
    if isinstance(v, dict):
        for k, x in v.items():
            at = f"{path}.{k}" if path else str(k)
            bad = unicode_path(k, at) if isinstance(k, str) else None
            if bad or (bad := unicode_path(x, at)):
                return bad
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            if bad := unicode_path(x, f"{path}[{i}]"):
                return bad
    return None


# ---------------------------------------------------------------- sampling

def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p), seed=int(s.seed) & U64,
        acceptance=s.acceptance, typical_epsilon=float(s.typical_epsilon), typical_delta=float(s.typical_delta),
        lenience=float(s.lenience), accept_top_k=int(s.accept_top_k), cd_alpha=float(s.cd_alpha),
        cd_beta=float(s.cd_beta), cd_amateur=s.cd_amateur, jsd_threshold=float(s.jsd_threshold),
        presence_penalty=float(s.presence_penalty), frequency_penalty=float(s.frequency_penalty),
        repetition_penalty=float(s.repetition_penalty), logit_bias={int(t): float(b) for t, b in s.logit_bias},
        min_p=float(s.min_p), logprobs=int(s.logprobs) if s.logprobs >= 0 else None,
        grammar_kind=s.grammar_kind, grammar=s.grammar)


def sampling_from_proto(m: common_pb2.SamplingParams, prefix: str = "sampling") -> SamplingParams:
    d = SamplingParams()
    try:
        return SamplingParams(
            temperature=m.temperature, top_k=m.top_k, top_p=m.top_p if m.HasField("top_p") else d.top_p,
            seed=int(m.seed), acceptance=m.acceptance or d.acceptance,
            typical_epsilon=m.typical_epsilon if m.HasField("typical_epsilon") else d.typical_epsilon,
            typical_delta=m.typical_delta if m.HasField("typical_delta") else d.typical_delta,
            lenience=m.lenience if m.HasField("lenience") else d.lenience,
            accept_top_k=m.accept_top_k if m.HasField("accept_top_k") else d.accept_top_k,
            cd_alpha=m.cd_alpha if m.HasField("cd_alpha") else d.cd_alpha,
            cd_beta=m.cd_beta if m.HasField("cd_beta") else d.cd_beta, cd_amateur=m.cd_amateur or d.cd_amateur,
            jsd_threshold=m.jsd_threshold if m.HasField("jsd_threshold") else d.jsd_threshold,
            presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
            repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else d.repetition_penalty,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in m.logit_bias.items())), min_p=m.min_p,
            logprobs=m.logprobs if m.HasField("logprobs") else d.logprobs, grammar_kind=m.grammar_kind,
            grammar=m.grammar)
    except InvalidArgument as e:
        raise InvalidArgument(f"{prefix}.{e.field}", e.message) from None


# ---------------------------------------------------------------- trees and deltas

def tree_to_proto(t: TokenTree) -> common_pb2.TokenTree:
    m = common_pb2.TokenTree(tokens=t.tokens, parents=t.parents, siblings=t.siblings)
    if t.q_ids is not None:
        for ids, ps in zip(t.q_ids, t.q_probs or [None] * len(t.q_ids)):
            m.q.add(ids=ids or [], probs=ps or [])
    return m


def tree_from_proto(m: common_pb2.TokenTree) -> TokenTree:
    if len(m.q) == 0:
        return TokenTree(list(m.tokens), list(m.parents), siblings=m.siblings)
    return TokenTree(list(m.tokens), list(m.parents), [list(d.ids) for d in m.q], [list(d.probs) for d in m.q],
                     siblings=m.siblings)


def ahead_to_proto(a) -> "drafter_pb2.AheadResult":
    """An ``ahead.AheadInfo`` (how a Propose's draft was obtained) for the wire; its span
    as ms after the ProposeAhead that asked for it."""
    m = drafter_pb2.AheadResult(result=a.result, reason=a.reason, ahead_ms=a.ahead_s * 1e3, wasted_tokens=a.wasted,
                                outcomes=a.outcomes)
    if a.span is not None and a.asked is not None:
        m.start_ms, m.end_ms = (a.span[0] - a.asked) * 1e3, (a.span[1] - a.asked) * 1e3
    return m


def ahead_from_proto(m, asked: Optional[float] = None):
    """The ``ahead.AheadInfo`` of a ProposeResponse; ``asked``: when (perf_counter, this
    process) the ProposeAhead was sent, to place the ahead span on this clock."""
    from ..ahead import AheadInfo

    span = None
    if asked is not None and m.end_ms > 0:
        span = (asked + m.start_ms / 1e3, asked + m.end_ms / 1e3)
    return AheadInfo(m.result or "off", m.reason, m.ahead_ms / 1e3, m.wasted_tokens, m.outcomes, span, asked)


def sync_to_proto(keep_len: int, append: Sequence[int]) -> common_pb2.SessionSync:
    return common_pb2.SessionSync(keep_len=keep_len, append_tokens=append)


# ---------------------------------------------------------------- hidden features

def features_to_proto(f: FeatureRows) -> common_pb2.HiddenFeatures:
    return common_pb2.HiddenFeatures(start=f.start, rows=f.rows, dim=f.dim, layers=list(f.layers), dtype=f.dtype,
                                     data=f.data)


def features_from_proto(m: common_pb2.HiddenFeatures) -> FeatureRows:
    return FeatureRows(int(m.start), int(m.rows), int(m.dim), tuple(m.layers), m.dtype, bytes(m.data))


# ---------------------------------------------------------------- verify

def verify_request_to_proto(r: VerifyRequest) -> verifier_pb2.VerifyRequest:
    m = verifier_pb2.VerifyRequest(
        session_id=r.session_id, sync=sync_to_proto(r.keep_len, r.append_tokens), tree=tree_to_proto(r.tree),
        sampling=sampling_to_proto(r.sampling), round_seed=int(r.round_seed) & U64, want_entropy=r.want_entropy,
        feature_layers=list(r.feature_layers), jump_forward=r.jump_forward, cache_salt=r.cache_salt)
    if r.prompt_len >= 0:
        m.prompt_len = r.prompt_len
    if r.self_draft is not None:
        m.self_draft.method, m.self_draft.budget = r.self_draft.method, r.self_draft.budget
    return m


def verify_request_from_proto(m: verifier_pb2.VerifyRequest) -> VerifyRequest:
    sd = SelfDraft(m.self_draft.method, m.self_draft.budget) if m.HasField("self_draft") else None
    if sd is not None and len(m.tree.tokens):
        raise InvalidArgument("tree", "must be empty when self_draft is set")
    return VerifyRequest(m.session_id, m.sync.keep_len, list(m.sync.append_tokens), tree_from_proto(m.tree),
                         sampling_from_proto(m.sampling), m.round_seed, sd, m.want_entropy, tuple(m.feature_layers),
                         prompt_len=m.prompt_len if m.HasField("prompt_len") else -1, jump_forward=m.jump_forward,
                         cache_salt=check_salt(m.cache_salt))


def logprobs_to_proto(lps) -> list:
    return [common_pb2.TokenLogprob(token_id=x.token_id, logprob=x.logprob, top_ids=[t for t, _ in x.top],
                                    top_logprobs=[v for _, v in x.top]) for x in lps]


def logprobs_from_proto(ms) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, list(zip(m.top_ids, m.top_logprobs))) for m in ms]


def verify_result_to_proto(r: VerifyResult, server_ms: float = 0.0) -> verifier_pb2.VerifyResponse:
    m = verifier_pb2.VerifyResponse(
        accepted=r.accepted, next_token=r.next_token, drafted=r.drafted, tree_size=r.tree_size,
        accepted_nodes=r.accepted_nodes, entropy=r.entropy, draft_ms=r.draft_ms, verify_ms=r.verify_ms,
        cache_len=r.cache_len, batch_size=r.batch_size, server_ms=server_ms, batch_rows=r.batch_rows,
        cached_tokens=r.cached_tokens, forced=r.forced)
    if r.logprobs is not None:
        m.logprobs.extend(logprobs_to_proto(r.logprobs))
    if r.features is not None:
        m.features.CopyFrom(features_to_proto(r.features))
    return m


def verify_result_from_proto(m: verifier_pb2.VerifyResponse) -> VerifyResult:
    return VerifyResult(list(m.accepted), m.next_token, m.drafted, m.tree_size, list(m.accepted_nodes), m.entropy,
                        m.draft_ms, m.verify_ms, m.cache_len, m.batch_size,
                        features_from_proto(m.features) if m.HasField("features") else None,
                        batch_rows=m.batch_rows, forced=m.forced, cached_tokens=m.cached_tokens,
                        logprobs=logprobs_from_proto(m.logprobs) if len(m.logprobs) else None)


# ---------------------------------------------------------------- stats

_STAT_FIELDS = ("strategy", "strategy_reason", "drafter", "prompt_tokens", "new_tokens", "rounds", "target_forwards",
                "drafted_tokens", "accepted_tokens", "accept_hist", "position_drafted", "position_accepted",
                "draft_s", "verify_s", "prefill_s", "network_s", "total_s", "ttft_s", "finish_reason", "lossy",
                "fallbacks", "verifier", "reprefills", "cache_hit", "cache_drafted_tokens", "cache_accepted_tokens",
                "warm_prefix_tokens", "thinking_tokens", "answer_tokens", "answer_s", "side_branches", "side_tokens",
                "acceptance", "resumed_tokens", "ahead_hits", "ahead_misses", "ahead_wasted", "forced_tokens",
                "accepted_prediction_tokens", "rejected_prediction_tokens", "cached_tokens")


def stats_to_proto(s: GenerationStats) -> common_pb2.GenerationStats:
    m = common_pb2.GenerationStats(tau=s.tau, tokens_per_s=s.tokens_per_s,
                                   position_acceptance=s.position_acceptance)
    for f in _STAT_FIELDS:
        if hasattr(s, f):
            v = getattr(s, f)
            if isinstance(v, list):
                getattr(m, f).extend(v)
            else:
                setattr(m, f, v)
    return m


def stats_from_proto(m: common_pb2.GenerationStats) -> RouterStats:
    return RouterStats(**{f: list(v) if f in _LIST_FIELDS else v for f in _STAT_FIELDS for v in [getattr(m, f)]})


_LIST_FIELDS = frozenset(("accept_hist", "position_drafted", "position_accepted"))


# ---------------------------------------------------------------- chat

def messages_from_proto(ms) -> Optional[list[dict]]:
    out = []
    for m in ms:
        d = {"role": m.role, "content": m.content}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if len(m.tool_calls):
            d["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
        out.append(d)
    return out or None


def messages_to_proto(messages: Optional[Sequence[dict]]) -> list[common_pb2.ChatMessage]:
    """Chat turns: ``role`` and ``content`` (``None`` for an assistant turn that only
    calls tools), and optionally ``name``, ``tool_call_id``, ``tool_calls`` (dicts of
    id, name, arguments)."""
    out = []
    for i, m in enumerate(messages or []):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidArgument("messages", f"entry {i} needs 'role' and 'content'")
        calls = [common_pb2.ToolCall(id=str(c.get("id", "")), name=str(c["name"]), arguments=str(c["arguments"]))
                 for c in m.get("tool_calls") or []]
        out.append(common_pb2.ChatMessage(role=str(m["role"]), content=str(m["content"] or ""),
                                          name=str(m.get("name") or ""), tool_call_id=str(m.get("tool_call_id") or ""),
                                          tool_calls=calls))
    return out


def tools_to_proto(tools) -> list:
    return [common_pb2.Tool(name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)
            for t in tools]


def tools_from_proto(ms) -> list:
    from ..tools import Tool

    return [Tool(m.name, m.description, m.parameters or '{"type": "object"}',
                 m.strict if m.HasField("strict") else None) for m in ms]
