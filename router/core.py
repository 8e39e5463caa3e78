"""The router's logic: validate a generation request, pick its strategy, run the
draft–verify loop over the remote drafter and verifier, stream text deltas.

``Router.start(spec, ...)`` validates every field before anything changes
(INVALID_ARGUMENT naming the field) and returns a ``Generation``: an iterator of
``Delta`` events and one ``Final`` event. The generation runs
``specmesh.loop.speculative_generate`` with a ``RemoteVerifier`` (session
pinned to a replica; the loop re-prefills from the committed tokens it holds
when a replica loses the session or dies) and, for the ``external`` strategy, a
``RemoteDrafter`` (a dead drafter degrades the rounds to plain decoding, so
greedy output never changes). ``Generation.cancel()`` (client cancelled, or
deadline passed) stops it between rounds, cancels its Decode stream at once (the
verifier stops decoding ahead; ``adapters.CancelFlag``) and releases the session on the
verifier and the drafter. Stop strings (``GenerateSpec.stop``) end a generation
just before the first one in its text (``StopText``, the OpenAI/vLLM rule;
finish reason ``stop``; the kept token ids run through the one that completed it).
A request with ``GenerateSpec.resume`` continues an interrupted stream of itself
(a lost router): the loop prefills prompt + the delivered tokens and counts
``max_new_tokens`` from the original start (``LoopOptions.resumed``); the text
and stop-string state are replayed from those tokens (``resume_state``), the new
stream sends only text the caller lacks, and the final message carries the
whole output and ``resumed_tokens``.

Strategies: ``autoregressive``, ``external`` (a drafter of the registry's
``EXTERNAL``: prompt_lookup | suffix | adaptive_lookup | draft_lm | block |
block_tree, the last two fed the target's hidden features), ``self`` (inside the verifier: the trained
block drafter's tree ``block_tree`` by default where the verifiers have it (``auto.BLOCK_SELF``), else
``layerskip``),
``proactive`` (the conversation's anticipation cache and warm KV), ``ssr``
(reasoning requests) and ``auto`` (chosen from features and measured speedups);
their choice and adapters live in ``router/strategies.py``, the algorithms in
``specmesh/strategies/``. Every real request preempts idle anticipation work.

``Router.observer`` (``specmesh.observability.requests``) watches each request:
its ``specmesh.generate`` span, one ``specmesh.round`` span per round (through
the loop's ``round_scope``) and, once instrumented, the router metrics.

It knows nothing about protos or servers; tokenization goes through ``codec``
(``encode(prompt, messages, chat)``, ``decode(ids)``, ``stop_ids``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Sequence, Union

from specmesh.ahead import check_mode
from specmesh.observability.requests import RouterObserver
from specmesh.observability.throughput import ThroughputLog
from specmesh.wire.convert import MAX_SESSION_ID, RouterStats, check_salt
from specmesh.serving import limits
from specmesh.serving.settings import ServeSettings
from specmesh.strategies.ssr import reasoning_messages
from specmesh.types import InvalidArgument, ResourceExhausted, SamplingParams

from .adapters import CancelFlag, Calls, GenerationCancelled, drafter_failure
from .readiness import Readiness
from .replicas import Peer, ReplicaSet
from .strategies import (EXTERNAL_DRAFTERS, FEATURE_DRAFTERS, SELF_DRAFTERS, STRATEGIES,  # noqa: F401
                         Collaborators, Strategies, scoped_conversation, tenant_key)

log = logging.getLogger("specmesh.router")

ROLES = ("system", "user", "assistant", "tool")
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings per request, characters per stop string
NAME = re.compile(r"[^\s<|\\/>]{1,64}")  # a message's participant name (OpenAI's pattern, and its length)


@dataclass
class GenerateSpec:
    """A generation request in domain terms (what GenerateRequest carries)."""

    prompt: str = ""
    messages: Optional[list[dict]] = None
    strategy: str = ""
    drafter: str = ""
    max_new_tokens: Optional[int] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft_budget: Optional[int] = None
    raw_prompt: bool = False
    conversation_id: str = ""
    reasoning: bool = False
    thinking_budget: Optional[int] = None
    stop: tuple[str, ...] = ()  # stop strings on the output text
    resume: Optional["Resume"] = None  # continue an interrupted stream of this request
    draft_ahead: str = ""  # "" (the router's setting) | "on" | "off" | "auto" (specmesh.ahead)
    prediction: str = ""  # predicted output (OpenAI's predicted outputs): drafted by a lookup drafter
    tools: list = field(default_factory=list)  # specmesh.tools.Tool the model may call
    tool_choice: str = ""  # "" | auto | none | required | function:NAME
    parallel_tool_calls: bool = True
    cache_salt: str = ""  # the prefix cache's tenant (vLLM's cache_salt; "" = the shared cache)


@dataclass
class Resume:
    """What the caller already received of an interrupted stream (GenerateRequest.resume)."""

    token_ids: list[int]
    text_chars: int = 0  # code points of output text it has
    session_id: str = ""  # the interrupted stream's (logs only)


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: Optional[list] = None  # sampling.logprobs set: a ``TokenLogprob`` per token id, with its text


@dataclass
class TokenText:
    """A ``TokenLogprob`` with the text and bytes of its token and of its top tokens."""

    token_id: int
    logprob: float
    top: list  # (token id, logprob)
    token: str = ""
    token_bytes: bytes = b""
    top_tokens: tuple = ()
    top_token_bytes: tuple = ()


@dataclass
class Final:
    text: str
    token_ids: list[int]
    stats: RouterStats
    session_id: str
    tool_calls: list = field(default_factory=list)  # specmesh.tools.ToolCall parsed from the text


@dataclass
class Plan:
    ids: list[int]
    strategy: str
    reason: str
    drafter: Optional[str]  # external drafter name
    self_draft: Optional[str]  # in-verifier drafter name
    max_new_tokens: int
    budget: int
    sampling: SamplingParams
    conversation_id: str = ""
    reasoning: bool = False
    thinking_budget: Optional[int] = None
    messages: Optional[list[dict]] = None  # the conversation (for anticipation after the turn)
    client: str = ""
    stop: tuple[str, ...] = ()
    resume: tuple[int, ...] = ()  # output tokens delivered before (a resumed request)
    resume_chars: int = 0  # ... and the characters of their text the caller has
    draft_ahead: str = ""  # the request's draft-ahead mode ("": the router's setting)
    budget_pinned: bool = False  # the request set draft_budget: every round drafts ``budget``
    prediction: tuple[int, ...] = ()  # predicted output tokens (drafted through a lookup drafter)
    parse_tools: bool = False  # the output's tool calls are parsed (tools given, tool_choice not none)
    tool_names: tuple = ()  # the request's tools: only their calls are calls
    parallel_tools: bool = True  # parallel_tool_calls: False returns one call at most
    cache_salt: str = ""  # the tenant's key in the verifiers' prefix cache (``strategies.tenant_key``)


class TextStream:
    """Incremental detokenization: text of new tokens is decode(window + new) minus
    decode(window), emitted only when it does not end in an incomplete character
    (U+FFFD), so the concatenated deltas equal the final text."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopText:
    """Stop strings on streamed text, as vLLM and the OpenAI API apply them: the
    output ends just before the first stop string (which is not part of it), and
    text that could be the start of one is held back until it cannot be.
    ``push(piece)`` returns the text that is safe to emit; after a match
    ``matched`` is the stop string and ``end`` the text offset just after it."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.hold = max(len(x) for x in self.stops) - 1
        self.text, self.emitted = "", 0
        self.matched: Optional[str] = None
        self.end = 0

    def push(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        start = max(0, len(self.text) - self.hold)  # a new match ends in ``piece``, so it starts here or later
        self.text += piece
        hits = [(i, x) for x in self.stops for i in [self.text.find(x, start)] if i >= 0]
        if hits:
            i, self.matched = min(hits)
            self.end = i + len(self.matched)
            cut = max(i, self.emitted)
            out, self.emitted = self.text[self.emitted:cut], cut
            return out
        safe = max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted:safe], safe
        return out

    def flush(self) -> str:
        """The held-back text once no more comes (nothing after a match)."""
        if self.matched is not None:
            return ""
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


def resume_state(text: "TextStream", stop: Optional[StopText], ids: Sequence[int]) -> str:
    """Replay a resumed request's delivered tokens through its text and stop-string
    state; return the text the router counts as sent for them (held-back characters
    excluded). Raises INVALID_ARGUMENT when a stop string already matched."""
    sent = text.push(list(ids)) if ids else ""
    if stop is not None:
        sent = stop.push(sent)
        if stop.matched is not None:
            raise InvalidArgument("resume.token_ids", f"the stop string {stop.matched!r} already matched in their "
                                  "text: that generation ended")
    return sent


def owed_text(sent: str, text_chars: int) -> tuple[str, int]:
    """(text the caller lacks of ``sent``, characters of later text it already has):
    the caller has ``text_chars`` characters of the output."""
    return (sent[text_chars:], 0) if text_chars <= len(sent) else ("", text_chars - len(sent))


def tokens_through(decode: Callable[[list[int]], str], ids: list[int], chars: int, lo: int = 0) -> int:
    """The fewest leading tokens of ``ids`` (at least ``lo``) whose text reaches
    ``chars`` characters: the tokens a generation cut at a stop string keeps."""
    hi = len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid]).rstrip("\ufffd")) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


class Generation:
    """Iterator of Delta events then one Final; ``cancel()`` may come from any thread."""

    def __init__(self, events: Iterator, cancelled: threading.Event):
        self._events, self.cancelled = events, cancelled
        self._lock = threading.Lock()
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            if self._done:
                raise StopIteration
            try:
                return next(self._events)
            except BaseException:
                self._done = True
                raise

    def cancel(self) -> None:
        """Stop between rounds and release the session (returns at once)."""
        if self._done:
            return
        self.cancelled.set()
        threading.Thread(target=self._close, name="specmesh-cancel", daemon=True).start()

    def _close(self) -> None:
        with self._lock:  # waits for a running round to end
            self._done = True
            self._events.close()


class Router:
    def __init__(self, settings: ServeSettings, codec, replicas: ReplicaSet, drafter: Optional[Peer],
                 vocab_size: int, token: Optional[str] = None, context: Optional[int] = None):
        """``context``: the served model's context length (None: unknown), which the
        limits not set default from (``serving.limits``); ``self.s`` holds the resolved ones."""
        self.limits = limits.resolve(settings, context)
        settings = settings.model_copy(update={"max_seq_len": self.limits.max_seq_len,
                                               "max_prompt_tokens": self.limits.max_prompt_tokens,
                                               "default_max_new_tokens": self.limits.default_max_new_tokens})
        self.s, self.codec, self.replicas, self.drafter = settings, codec, replicas, drafter
        self.vocab_size, self.token = vocab_size, token
        # the periodic throughput log line (log_stats_interval_s; 0 = off), fed by the observer
        self.throughput = ThroughputLog(getattr(settings, "log_stats_interval_s", 0.0)).start()
        self.observer = RouterObserver(settings.model, throughput=self.throughput)  # spans; metrics once instrumented
        # strategy choice and plumbing (router/strategies.py), over explicit collaborators
        self.runner = Strategies(Collaborators(settings, codec, replicas, drafter, vocab_size, token))
        # ready means ready: a verifier serving and its Info read (router/readiness.py); checked by every request
        self.readiness = Readiness(replicas, self.runner.info_read).start()
        self._clients: dict[str, int] = {}
        self._lock = threading.Lock()
        self._tool_format = None

    # ------------------------------------------------------------ validation
    def _strategy(self, spec: GenerateSpec, ids: list[int], reasoning: bool) -> tuple[str, str, Optional[str],
                                                                                      Optional[str]]:
        r = self.runner.resolve(spec, ids, reasoning)
        return r.strategy, r.reason, r.drafter, r.self_draft

    def _prompt_ids(self, spec: GenerateSpec, reasoning: bool = False) -> list[int]:
        if spec.prompt and spec.messages:
            raise InvalidArgument("prompt", "give prompt or messages, not both")
        if not spec.prompt and not spec.messages:
            raise InvalidArgument("prompt", "is empty (give prompt or messages)")
        for i, m in enumerate(spec.messages or []):
            if m.get("role") not in ROLES:
                raise InvalidArgument("messages", f"entry {i} has role {m.get('role')!r}; use one of {list(ROLES)}")
            if m.get("name") and not NAME.fullmatch(m["name"]):
                raise InvalidArgument("messages", f"entry {i}: name must be 1-64 characters without whitespace or "
                                      f"any of <|\\/> (OpenAI's rule), got {m['name'][:80]!r}")
        chars = len(spec.prompt) + sum(len(m.get("content") or "") for m in spec.messages or [])
        self.limits.check_chars(chars)  # cheap guard before tokenizing
        named = getattr(self.codec, "named", None)
        if spec.messages and named is not None:  # participant names where the model reads them (before the
            spec = replace(spec, messages=named(spec.messages))  # tool rendering, which keeps only the text)
        if reasoning and not spec.raw_prompt:  # system instruction + an opened thinking section
            msgs = reasoning_messages(spec.messages or [{"role": "user", "content": spec.prompt}])
            ids = list(self.codec.encode(None, msgs)) + list(self.runner.think_format().open_ids)
        elif spec.tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in spec.messages or []):
            from specmesh import tools as tl

            msgs = spec.messages or [{"role": "user", "content": spec.prompt}]
            if getattr(self.codec, "renders_tools", False):  # the chat template renders them itself
                ids = self.codec.encode(None, tl.template_messages(msgs), tools=spec.tools,
                                        chat_template=tl.tools_template(self.codec.chat_template))
            else:
                ids = self.codec.encode(None, tl.fallback_messages(msgs, spec.tools))
        else:
            ids = self.codec.encode(spec.prompt or None, spec.messages, chat=not spec.raw_prompt)
            if reasoning:
                ids = list(ids) + list(self.runner.think_format().open_ids)
        if not ids:
            raise InvalidArgument("prompt", "encodes to no tokens")
        self.limits.check_prompt(len(ids))
        return ids

    def tool_format(self):
        """How the served tokenizer spells the call tags (``specmesh.tools.ToolFormat``)."""
        from specmesh import tools as tl

        if self._tool_format is None:
            special = getattr(self.codec, "special_id", None)
            ids = (special(tl.OPEN), special(tl.CLOSE)) if special is not None else (None, None)
            self._tool_format = tl.ToolFormat(*ids) if None not in ids else tl.TEXT_TAGS
        return self._tool_format

    def _tools(self, spec: GenerateSpec) -> GenerateSpec:
        """Validate the tools; their grammar becomes the request's (``specmesh.tools.grammar``:
        only calls for ``required`` or a named function; under ``auto`` free text, and a call
        held to the tools' names and schemas once the model opens one)."""
        import json

        from specmesh import tools as tl
        from specmesh.grammar import GrammarError, check

        if not spec.tools and not spec.tool_choice:
            return spec
        tl.check_tools(spec.tools, spec.tool_choice)
        if spec.raw_prompt:
            raise InvalidArgument("tools", "tools are rendered into a chat; not with raw_prompt")
        if spec.tool_choice == "none" or not spec.tools:
            return spec
        if spec.reasoning or spec.strategy == "ssr":
            raise InvalidArgument("tools", "a reasoning request takes no tools (its thinking phase is not "
                                  "constrained); send tool_choice none or no reasoning")
        tools = []
        for t in spec.tools:  # each schema compiles (leniently unless strict); a strict one that does not
            # is refused, a non-strict one's arguments are left free (OpenAI accepts such a request)
            try:
                check("json_schema", json.dumps(tl.arguments_schema(t, False)))
            except GrammarError as e:
                if t.strict:
                    raise InvalidArgument("tools", f"tool {t.name!r}: its parameters cannot be enforced: {e}") \
                        from None
                log.info("tool %r: its parameters cannot be enforced (%s); its arguments are any JSON object",
                         t.name, e)
                t = replace(t, enforced=False)
            tools.append(t)
        spec = replace(spec, tools=tools)
        sp, answer = spec.sampling, None
        if sp.constrained:
            if spec.tool_choice not in ("", "auto"):
                raise InvalidArgument("tool_choice", f"{spec.tool_choice!r} is enforced by a grammar; the request "
                                      "has a structured output of its own")
            if sp.grammar_kind not in ("json_schema", "json_object"):
                raise InvalidArgument("tool_choice", f"tools under tool_choice auto with a {sp.grammar_kind} "
                                      "structured output: the reply would be either; send a JSON response_format, "
                                      "or tool_choice none")
            answer = json.loads(sp.grammar) if sp.grammar_kind == "json_schema" else {"type": "object"}
        g = tl.grammar(spec.tools, spec.tool_choice, spec.parallel_tool_calls, self.tool_format(), answer)
        return replace(spec, sampling=replace(sp, grammar_kind="lark", grammar=g))

    def plan(self, spec: GenerateSpec) -> Plan:
        """Validate every field (INVALID_ARGUMENT naming it); nothing changes."""
        self.runner.check(spec)
        check_salt(spec.cache_salt)
        # a tenant's conversation is its own: from here on the router knows it by its scoped id
        spec = replace(spec, conversation_id=scoped_conversation(spec.conversation_id, spec.cache_salt))
        spec = self._tools(spec)
        if spec.draft_ahead:
            check_mode(spec.draft_ahead)
        if spec.resume is not None and (spec.resume.token_ids or spec.resume.text_chars) and (
                spec.reasoning or spec.strategy == "ssr"):
            raise InvalidArgument("resume", "a reasoning request cannot be resumed (its thinking phase is not "
                                  "replayed); send it anew")
        n = self.s.default_max_new_tokens if spec.max_new_tokens is None else spec.max_new_tokens
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument("max_new_tokens", f"must be a positive integer, got {n!r}")
        self.limits.check_requested(n)
        budget = self.s.draft_budget if spec.draft_budget is None else spec.draft_budget
        if not 1 <= budget <= self.s.max_tree_nodes:
            raise InvalidArgument("draft_budget", f"must be in [1, {self.s.max_tree_nodes}], got {budget}")
        if spec.thinking_budget is not None and spec.thinking_budget > n:
            raise InvalidArgument("thinking_budget", f"{spec.thinking_budget} exceeds max_new_tokens {n}")
        if len(spec.stop) > MAX_STOPS:
            raise InvalidArgument("stop", f"{len(spec.stop)} stop strings; at most {MAX_STOPS}")
        for i, x in enumerate(spec.stop):
            if not x or len(x) > MAX_STOP_CHARS:
                raise InvalidArgument("stop", f"stop string {i} must have 1..{MAX_STOP_CHARS} characters, "
                                      f"got {len(x)}")
        reasoning = spec.reasoning or spec.strategy == "ssr"
        self._check_processors(spec, reasoning)
        ids = self._prompt_ids(spec, reasoning)
        # more than the prompt leaves of the context: refused where the request named it (as OpenAI
        # and vLLM refuse it), the default cut to it (finish reason "length" there): serving/limits.py
        n = self.limits.new_tokens(n, len(ids), requested=spec.max_new_tokens is not None)
        strategy, reason, drafter, self_draft = self._strategy(spec, ids, reasoning)
        messages = spec.messages or ([{"role": "user", "content": spec.prompt}] if not spec.raw_prompt else None)
        resume = self._resume(spec, n)
        prediction: tuple[int, ...] = ()
        if spec.prediction:
            self.limits.check_chars(len(spec.prediction), "prediction")
            prediction = tuple(self.codec.encode(spec.prediction, None, chat=False))
            self.limits.check_prompt(len(prediction), "prediction")
        return Plan(ids, strategy, reason, drafter, self_draft, n, budget, spec.sampling, spec.conversation_id,
                    reasoning or strategy == "ssr", spec.thinking_budget, messages, stop=tuple(spec.stop),
                    resume=tuple(resume.token_ids) if resume else (), resume_chars=resume.text_chars if resume else 0,
                    draft_ahead=spec.draft_ahead, budget_pinned=spec.draft_budget is not None, prediction=prediction,
                    parse_tools=bool(spec.tools) and spec.tool_choice != "none",
                    tool_names=tuple(t.name for t in spec.tools or ()), parallel_tools=spec.parallel_tool_calls,
                    cache_salt=tenant_key(spec.cache_salt))

    def _check_processors(self, spec: GenerateSpec, reasoning: bool) -> None:
        """Logits processors, logprobs and grammars: the values the sampling cannot judge alone."""
        sp = spec.sampling
        for t, _ in sp.logit_bias:
            if t >= self.vocab_size:
                raise InvalidArgument("sampling.logit_bias", f"token id {t} outside [0, {self.vocab_size})")
        if sp.constrained:
            from specmesh.grammar import GrammarError, check

            try:
                check(sp.grammar_kind, sp.grammar)
            except GrammarError as e:
                raise InvalidArgument("sampling.grammar", str(e)) from None
        if reasoning and (sp.processed or sp.logprobs >= 0):
            raise InvalidArgument("reasoning", "a reasoning request takes no penalties, logit_bias, grammar or "
                                  "logprobs (its thinking phase is not constrained)")

    def _resume(self, spec: GenerateSpec, n: int) -> Optional[Resume]:
        """Validate ``spec.resume`` against the request it continues (INVALID_ARGUMENT naming the field)."""
        r = spec.resume
        if r is None or (not r.token_ids and not r.text_chars):
            return None
        if len(r.token_ids) > n:
            raise InvalidArgument("resume.token_ids", f"{len(r.token_ids)} tokens exceed max_new_tokens {n}")
        stops = set(self.codec.stop_ids)
        for t in r.token_ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument("resume.token_ids", f"token id {t} outside [0, {self.vocab_size})")
            if t in stops:
                raise InvalidArgument("resume.token_ids", f"token id {t} is a stop token: that generation ended")
        if len(r.session_id.encode()) > 128:
            raise InvalidArgument("resume.session_id", "longer than 128 bytes")
        full = self.codec.decode(list(r.token_ids))
        if not 0 <= r.text_chars <= len(full):
            raise InvalidArgument("resume.text_chars", f"must be in [0, {len(full)}] (the characters of "
                                  f"resume.token_ids' text), got {r.text_chars}")
        resume_state(TextStream(self.codec.decode), StopText(spec.stop) if spec.stop else None, r.token_ids)
        return r

    # ------------------------------------------------------------ generation
    def start(self, spec: GenerateSpec, client: str = "", deadline: Optional[float] = None) -> Generation:
        self.readiness.require()  # UNAVAILABLE with the reason while no verifier serves
        plan = self.plan(spec)
        plan.client = client
        cancelled = CancelFlag()  # setting it also cancels the generation's Decode stream at once
        return Generation(self._events(plan, client, deadline, cancelled), cancelled)

    def _acquire(self, client: str) -> None:
        with self._lock:
            n = self._clients.get(client, 0)
            if n >= self.s.max_sessions_per_client:
                raise ResourceExhausted(f"client {client!r} has {n} active generations "
                                        f"(max_sessions_per_client {self.s.max_sessions_per_client})")
            self._clients[client] = n + 1

    def _release(self, client: str) -> None:
        with self._lock:
            self._clients[client] -= 1
            if not self._clients[client]:
                del self._clients[client]

    def _token_text(self, t: int) -> tuple[str, bytes]:
        tb = getattr(self.codec, "token_bytes", None)
        b = tb(t) if tb is not None else self.codec.decode([t]).encode()
        return b.decode("utf-8", errors="replace"), b

    def _token_texts(self, lps: list) -> list:
        out = []
        for x in lps:
            tok, tb = self._token_text(x.token_id)
            tops = [self._token_text(t) for t, _ in x.top]
            out.append(TokenText(x.token_id, x.logprob, list(x.top), tok, tb, tuple(a for a, _ in tops),
                                 tuple(b for _, b in tops)))
        return out

    def _drafter_error(self, e: Exception):
        what, down = drafter_failure(e)
        log.warning("drafter failed (%s); falling back to plain decoding", what)
        return None if down else False  # an unexpected error disables the drafter for this request

    def _events(self, plan: Plan, client: str, deadline: Optional[float],
                cancelled: threading.Event) -> Iterator[Union[Delta, Final]]:
        self._acquire(client)
        obs, err, run = None, None, None
        try:
            sid = uuid.uuid4().hex
            calls = Calls(self.token, self.s.verifier_timeout_s, deadline, cancelled)
            run = self.runner.prepare(plan, sid, calls)  # adapters of the strategy; enters the idle-work gate
            sid, verifier, drafter = run.sid, run.verifier, run.drafter
            stats = RouterStats(strategy=plan.strategy, strategy_reason=plan.reason,
                                drafter=plan.drafter or plan.self_draft or ("prediction" if plan.prediction else ""))
            text = TextStream(self.codec.decode)
            stop = StopText(plan.stop) if plan.stop else None
            out_ids: list[int] = list(plan.resume)
            sent = resume_state(text, stop, plan.resume)  # a resumed request: what the caller was sent
            pieces: list[str] = [sent] if sent else []
            owed, skip = owed_text(sent, plan.resume_chars)
            if plan.resume:
                stats.resumed_tokens = len(plan.resume)
                log.info("session %s resumes a stream after %d tokens (%d characters delivered)", sid,
                         len(plan.resume), plan.resume_chars)
            obs = self.observer.request(plan, sid, stats, verifier, drafter)
            if owed:
                yield Delta([], owed)
            lps: list = []
            rounds = run.rounds(stats, self._drafter_error, round_scope=obs.round_scope,
                                on_logprobs=lps.extend if plan.sampling.logprobs >= 0 else None)
            try:
                for chunk in rounds:
                    first = len(out_ids)
                    out_ids += chunk
                    piece = text.push(chunk)
                    if stop is not None:
                        piece = stop.push(piece)
                        if stop.matched is not None:  # keep the tokens through the stop string; the loop ends
                            out_ids = out_ids[:tokens_through(self.codec.decode, out_ids, stop.end, first)]
                            chunk = out_ids[first:]
                    pieces.append(piece)
                    piece, skip = piece[skip:], max(0, skip - len(piece))  # text the caller already has
                    got, lps[:] = lps[: len(chunk)], []
                    yield Delta(chunk, piece, self._token_texts(got) if plan.sampling.logprobs >= 0 else None)
                    if cancelled.is_set():
                        return
                    if stop is not None and stop.matched is not None:
                        break
            except GenerationCancelled:
                return  # the caller has gone: nothing more is sent
            finally:
                rounds.close()  # the loop's own finally releases verifier and drafter sessions
            stopped = stop is not None and stop.matched is not None  # in a round: out_ids already cut
            tail = "" if stopped else text.flush()
            if stop is not None and not stopped:
                tail = stop.push(tail) + stop.flush()
                if stop.matched is not None:  # the last characters completed a stop string
                    out_ids = out_ids[:tokens_through(self.codec.decode, out_ids, stop.end)]
            if tail:
                pieces.append(tail)
                if tail[skip:]:
                    yield Delta([], tail[skip:])
            if stop is not None and stop.matched is not None:
                stats.finish_reason, stats.new_tokens = "stop", len(out_ids)
            stats.network_s = run.network_s()
            stats.fallbacks += drafter.skipped if drafter else 0  # rounds undrafted while the drafter was down
            stats.verifier, stats.reprefills = verifier.address, verifier.reprefills
            run.finish(stats, "".join(pieces), cancelled.is_set())
            obs.finish(stats)
            final, calls = "".join(pieces), []
            if plan.parse_tools:
                from specmesh.tools import parse

                final, calls = parse(final, plan.tool_names, plan.parallel_tools)
                if calls and stats.finish_reason != "length":  # a reply cut short says so, calls or not
                    stats.finish_reason = "tool_calls"
            yield Final(final, out_ids, stats, sid, calls)
        except BaseException as e:
            err = e
            raise
        finally:
            if obs is not None:
                obs.end(err)
            if run is not None:
                run.close()
            self._release(client)

    # ------------------------------------------------------------ listing
    def strategies(self) -> list[dict]:
        """Each strategy: description, drafters, availability and ``default_drafter``
        (what a request naming no drafter gets; "" = none, or chosen per request).
        ``self`` lists the self drafters the verifiers have (all known names while
        no verifier has answered Info); ``external`` the drafters that need features
        only where the drafter service hosts them (all while it has not answered), and
        with the drafter service down the context-only ones the verifiers run."""
        up = self.drafter is not None and self.drafter.health.available()
        have = self.runner.self_drafters()
        own = [d for d in SELF_DRAFTERS if d in have] if have else list(SELF_DRAFTERS)
        feats = self.runner.feature_drafters() if self.drafter is not None else None
        ext = [d for d in EXTERNAL_DRAFTERS if d not in FEATURE_DRAFTERS or feats is None or d in feats]
        # external without a drafter service: the context-only drafters the verifiers run (context_drafters)
        hosted = self.runner.hosted_drafters()
        if not up and hosted:
            ext = [d for d in ext if d in hosted]
        avail = {"autoregressive": True, "external": up or bool(hosted), "self": True, "proactive": up, "ssr": up,
                 "auto": True}
        drafters = {"external": ext, "self": own, "proactive": ["cache"],
                    "ssr": ["cache"], "auto": list(dict.fromkeys(ext + ["cache"] + own)),
                    "autoregressive": []}
        defaults = self.runner.default_drafters()
        return [{"name": k, "description": v, "drafters": drafters[k], "available": avail[k],
                 "default_drafter": defaults[k]} for k, v in STRATEGIES.items()]

    def anticipate(self, conversation_id: str, messages: list[dict], max_tokens: int = 0, next_turns: int = 0,
                   wait: bool = False, timeout: Optional[float] = None, cache_salt: str = "") -> dict:
        """Queue the idle conversation's anticipation (proactive strategy), for the tenant
        ``cache_salt`` (its generations with that salt find it)."""
        if len(conversation_id.encode()) > MAX_SESSION_ID:
            raise InvalidArgument("conversation_id", f"longer than {MAX_SESSION_ID} bytes")
        check_salt(cache_salt)
        d = self.runner.anticipate(scoped_conversation(conversation_id, cache_salt), messages, max_tokens, next_turns,
                                   wait, timeout, tenant_key(cache_salt))
        return dict(d, conversation_id=conversation_id)

    def anticipation(self, conversation_id: str, cache_salt: str = "") -> Optional[dict]:
        d = self.runner.anticipation(scoped_conversation(conversation_id, cache_salt))
        return None if d is None else dict(d, conversation_id=conversation_id)

    def close(self) -> None:
        self.readiness.stop()
        self.throughput.stop()
        self.runner.close()
        self.replicas.close()
        if self.drafter is not None:
            self.drafter.channel.close()


def monotonic_deadline(time_remaining: Optional[float]) -> Optional[float]:
    return None if time_remaining is None else time.monotonic() + time_remaining
