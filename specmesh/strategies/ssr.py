"""Reasoning requests and SSR (self-speculation for reasoning).

Reasoning mode: the prompt opens a thinking section (``ThinkFormat.open_ids``,
e.g. "<think>\\n" after the chat template's assistant header; a system prompt asks
the model to think there and answer after "</think>"). Full-CoT decoding is then
defined as:

1. thinking: decode until the model writes an end-of-thinking sequence
   (``end_seqs``), or until ``thinking_budget`` tokens, or a stop token;
2. unless the model closed the section itself, force ``close_ids``
   ("\\n</think>\\n\\n"; a stop token inside the thinking is dropped, as budget
   forcing does) — these tokens are part of the output;
3. answer: decode until a stop token or ``max_new_tokens`` in all.

``reasoning_generate`` runs exactly that with any drafters, so its output is the
target's (greedy: token-identical to the same procedure decoded plainly). SSR adds
side branches: when the thinking crosses each of ``fractions`` x budget, the
partial chain (cut after its last line break) plus ``close_ids`` is decoded for
``side_tokens`` tokens on a separate verifier session (``side_answer``; it may fork
the main session's KV prefix instead of re-prefilling it; the main session's KV is
untouched) and
``close_ids + answer`` seeds a draft cache (``seed``). Side branches start their
answer with ``answer_cue`` ("\\nThe answer is", the format the reasoning system
prompt asks for): forced to close its thinking mid-way, a small model otherwise
tends to keep writing steps instead of answering. The cue only shapes drafts. The answer phase continues
the same KV session (no re-prefill) and drafts with ``answer_drafter`` — the cache
drafter, whose suffix match spans those early answers and the chain itself.

Stats: ``thinking_tokens``, ``answer_tokens``, ``answer_s`` (from the end of the
thinking to the end), ``side_branches``, ``side_tokens``; rounds, forwards and
times of both phases are summed (side branches' forwards are not in them).

Knows nothing about tokenizers (token sequences come in ``ThinkFormat``), gRPC or
where the drafters and the verifier run.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Iterator, Optional, Sequence

from .. import seeding
from ..loop import AdaptiveBudget, BudgetPolicy, LoopOptions, generate_tokens, speculative_generate
from ..types import GenerationStats, InvalidArgument, SamplingParams, SessionLost
from .adapt import KeepSession, ResumePrefix

SYSTEM_PROMPT = ("You are a helpful assistant. Think step by step inside <think> and </think>, then after "
                 "</think> give the final answer in one sentence starting with \"The answer is\".")
OPEN_TEXT, CLOSE_TEXT, END_TEXTS = "<think>\n", "\n</think>\n\n", ("</think>",)
ANSWER_CUE = "\nThe answer is"  # the answer format the system prompt asks for; side branches start with it
DEFAULT_FRACTIONS = (0.5, 0.75)


@dataclass(frozen=True)
class ThinkFormat:
    open_ids: tuple[int, ...]  # appended to the prompt: opens the thinking section
    close_ids: tuple[int, ...]  # forced end of thinking
    end_seqs: tuple[tuple[int, ...], ...]  # sequences the model may write to end it
    system_prompt: str = SYSTEM_PROMPT
    line_ids: tuple[int, ...] = ()  # line-break tokens: side branches cut the partial thinking after one
    answer_cue: tuple[int, ...] = ()  # side branches answer after close_ids + answer_cue

    @classmethod
    def from_encode(cls, encode: Callable[[str], Sequence[int]], system_prompt: str = SYSTEM_PROMPT,
                    answer_cue: str = ANSWER_CUE) -> "ThinkFormat":
        """Build from a text -> ids function (the tokenizer without special tokens)."""
        ends = {tuple(encode(t)) for t in END_TEXTS} | {tuple(encode(" " + t)) for t in END_TEXTS}
        lines = {t for s in ("\n", "\n\n", ".\n") for t in encode(s)[-1:]}
        return cls(tuple(encode(OPEN_TEXT)), tuple(encode(CLOSE_TEXT)), tuple(sorted(e for e in ends if e)),
                   system_prompt, tuple(sorted(lines)), tuple(encode(answer_cue)) if answer_cue else ())


def reasoning_messages(messages: Sequence[dict], system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """Chat messages with the reasoning instruction in the system turn."""
    msgs = [dict(m) for m in messages]
    if msgs and msgs[0].get("role") == "system":
        msgs[0]["content"] = system_prompt + "\n\n" + msgs[0]["content"]
        return msgs
    return [{"role": "system", "content": system_prompt}] + msgs


def thinking_end(tokens: Sequence[int], end_seqs: Sequence[Sequence[int]], start: int = 0) -> Optional[int]:
    """Index just after the first end-of-thinking sequence that ends at or after
    ``start`` + its length - 1 (None when there is none)."""
    best = None
    for seq in end_seqs:
        n = len(seq)
        for i in range(max(0, start - n + 1), len(tokens) - n + 1):
            if tuple(tokens[i:i + n]) == tuple(seq):
                best = i + n if best is None else min(best, i + n)
                break
    return best


def partial_thought(thinking: list[int], line_ids: Sequence[int], lookback: int = 48) -> list[int]:
    """The thinking so far, cut after its last line break within ``lookback``
    tokens (a forced end of thinking in mid-sentence makes the model finish the
    sentence instead of answering)."""
    lines = set(line_ids)
    for i in range(len(thinking) - 1, max(-1, len(thinking) - 1 - lookback), -1):
        if thinking[i] in lines:
            return thinking[: i + 1]
    return list(thinking)


class _SideRunner:
    """Runs side branches (one at a time; a newer partial thought replaces one
    still waiting) and seeds their answers; inline when not ``asynchronous``."""

    def __init__(self, side_answer, seed, fmt: ThinkFormat, stats: GenerationStats, asynchronous: bool,
                 main_session: str):
        self.side_answer, self.seed, self.stats, self.asynchronous = side_answer, seed, stats, asynchronous
        self.main_session = main_session
        self.head = list(fmt.close_ids) + list(fmt.answer_cue)
        self.cv = threading.Condition()
        self.pending: Optional[list[int]] = None
        self.busy = self.closed = False
        self.thread: Optional[threading.Thread] = None

    def _run_one(self, context: list[int]) -> None:
        self.stats.side_branches += 1  # counted when started (its forwards may outlive the request)
        try:
            ans = self.side_answer(context + self.head, len(context), self.main_session)
        except Exception:  # noqa: BLE001 - a failed side branch only costs its drafts
            return
        self.stats.side_tokens += len(ans)
        if ans and self.seed is not None:
            try:
                self.seed([self.head + ans])
            except Exception:  # noqa: BLE001
                pass

    def submit(self, context: list[int]) -> None:
        if not self.asynchronous:
            self._run_one(context)
            return
        with self.cv:
            self.pending = context
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="specmesh-ssr-side", daemon=True)
                self.thread.start()
            self.cv.notify()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while self.pending is None and not self.closed:
                    self.cv.wait()
                if self.pending is None:
                    return
                ctx, self.pending, self.busy = self.pending, None, True
            self._run_one(ctx)
            with self.cv:
                self.busy = False
                self.cv.notify_all()

    def finish(self, wait: bool) -> None:
        """Drop a branch not yet started; wait for the one in flight, or let it
        finish (and seed) in the background."""
        with self.cv:
            self.pending, self.closed = None, True
            self.cv.notify_all()
        if self.thread is not None and wait:
            self.thread.join()


def merge_stats(dst: GenerationStats, src: GenerationStats) -> None:
    """Add one phase's round counters and times to ``dst``."""
    for f in ("rounds", "target_forwards", "drafted_tokens", "accepted_tokens", "draft_s", "verify_s", "prefill_s",
              "fallbacks", "cache_drafted_tokens", "cache_accepted_tokens", "warm_prefix_tokens"):
        setattr(dst, f, getattr(dst, f) + getattr(src, f))
    for f in ("accept_hist", "position_drafted", "position_accepted"):
        a, b = getattr(dst, f), getattr(src, f)
        a.extend([0] * (len(b) - len(a)))
        for i, v in enumerate(b):
            a[i] += v
    dst.cache_hit = dst.cache_hit or src.cache_hit
    dst.lossy = dst.lossy or src.lossy


def local_side_answer(verifier, stop_ids: Sequence[int], side_tokens: int, drafter=None,
                      sampling: SamplingParams = SamplingParams()) -> Callable[[list[int], int, str], list[int]]:
    """A side-branch function over an in-process verifier: decode ``side_tokens``
    tokens after ``context`` on a fresh session, forked from the main session's KV
    for the ``shared`` leading tokens when the verifier can fork (else prefilled)."""
    def run(context: list[int], shared: int, main_session: str) -> list[int]:
        sid = "ssr-side-" + uuid.uuid4().hex
        v = verifier
        if hasattr(verifier, "fork"):
            try:
                v = ResumePrefix(verifier, verifier.fork(main_session, sid, shared))
            except SessionLost:
                pass
        # the branch's text only drafts; its draws must not reuse the main session's
        # uniforms (same seed, same committed lengths): a stream of its own
        side_sampling = replace(sampling, seed=seeding.mix(sampling.seed, seeding.SIDE, len(context)))
        out, _ = generate_tokens(drafter, v, context, sampling=side_sampling, max_new_tokens=side_tokens,
                                 stop_ids=stop_ids, session_id=sid, budget=AdaptiveBudget(6))
        return out

    return run


def reasoning_generate(verifier, prompt_ids: Sequence[int], fmt: ThinkFormat, *,
                       sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 256,
                       thinking_budget: Optional[int] = None, stop_ids: Sequence[int] = (),
                       session_id: Optional[str] = None, drafter=None, answer_drafter=None,
                       budget: Callable[[], BudgetPolicy] = lambda: AdaptiveBudget(8),
                       stats: Optional[GenerationStats] = None, self_draft: Optional[str] = None,
                       on_drafter_error: Optional[Callable] = None, max_new_limit: Optional[int] = None,
                       side_answer: Optional[Callable[[list[int], int, str], list[int]]] = None,
                       seed: Optional[Callable[[list[list[int]]], None]] = None,
                       fractions: Sequence[float] = DEFAULT_FRACTIONS, side_async: bool = True,
                       side_wait: bool = False,
                       round_scope: Optional[Callable[[int], ContextManager[dict]]] = None) -> Iterator[list[int]]:
    """Yield new tokens of a reasoning request (module docstring). ``drafter`` drafts
    the thinking, ``answer_drafter`` (default: ``drafter``) the answer; with
    ``side_answer`` and ``seed`` this is SSR. ``budget()`` makes each phase's policy.
    ``side_async``: side branches run in a background thread while the thinking
    goes on (the verifier batches both sessions' forwards); the end of the thinking
    drops one not yet started and (``side_wait``) waits for the one in flight —
    by default it lets it finish and seed while the answer is decoded. The answer
    phase's time (``answer_s``) starts when the thinking ends, waits included."""
    if not fmt.close_ids:
        raise InvalidArgument("reasoning", "the thinking format has no closing sequence")
    if thinking_budget is not None and thinking_budget <= 0:
        raise InvalidArgument("thinking_budget", f"must be a positive integer, got {thinking_budget}")
    opts = LoopOptions(sampling=sampling, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                       session_id=session_id or uuid.uuid4().hex, self_draft=self_draft,
                       on_drafter_error=on_drafter_error, max_new_limit=max_new_limit, round_scope=round_scope)
    run = _Reasoning(verifier, list(prompt_ids), fmt, opts, budget, stats if stats is not None else GenerationStats())
    think_n = min(thinking_budget or max(1, max_new_tokens // 2), max_new_tokens)
    side = _SideRunner(side_answer, seed, fmt, run.stats, side_async, opts.session_id) if side_answer else None
    points = sorted({max(1, int(round(f * think_n))) for f in fractions if 0 < f < 1}) if side else []
    try:
        yield from run.think(drafter, think_n, side, points, side_wait)
        yield from run.close_thinking()
        if run.stats.finish_reason:
            return
        yield from run.answer(answer_drafter if answer_drafter is not None else drafter)
    finally:
        run.finish()


class _Reasoning:
    """The state of one reasoning request across its phases: thinking (until the
    model ends it or the budget), the forced close, the answer (same session, KV
    kept). ``reasoning_generate`` drives it."""

    def __init__(self, verifier, prompt_ids: list[int], fmt: ThinkFormat, opts: LoopOptions,
                 budget: Callable[[], BudgetPolicy], stats: GenerationStats):
        self.verifier, self.prompt_ids, self.fmt, self.opts, self.budget = verifier, prompt_ids, fmt, opts, budget
        self.stats, self.keep = stats, KeepSession(verifier)
        self.t0 = time.perf_counter()
        self.t_end: Optional[float] = None  # the end of the thinking: the answer phase's clock starts there
        self.thinking: list[int] = []
        self.out: list[int] = []
        self.end_at: Optional[int] = None  # index just after the model's own end of thinking
        self.answer_from: Optional[int] = None
        self.think_stats = GenerationStats()
        self.released = False  # the answer loop released the session

    def think(self, drafter, think_n: int, side: Optional[_SideRunner], points: list[int],
              side_wait: bool) -> Iterator[list[int]]:
        """Phase 1: decode the thinking; submit side branches as it crosses ``points``."""
        fmt, st = self.fmt, self.stats
        maxlen = max((len(x) for x in fmt.end_seqs), default=1)
        loop = speculative_generate(drafter, self.keep, self.prompt_ids,
                                    replace(self.opts, max_new_tokens=think_n, budget=self.budget()),
                                    stats=self.think_stats)
        try:
            for chunk in loop:
                prev = len(self.thinking)
                self.thinking += chunk
                if not st.ttft_s:
                    st.ttft_s = time.perf_counter() - self.t0
                yield chunk
                self.end_at = thinking_end(self.thinking, fmt.end_seqs, max(0, prev - maxlen + 1))
                if self.end_at is not None:
                    break
                crossed = [p for p in points if len(self.thinking) >= p]
                if crossed:
                    points = points[len(crossed):]
                    side.submit(self.prompt_ids + partial_thought(self.thinking, fmt.line_ids))
        finally:
            self.t_end = time.perf_counter()
            loop.close()
            if side is not None:
                side.finish(side_wait)
        merge_stats(st, self.think_stats)
        self.out = list(self.thinking)

    def close_thinking(self) -> Iterator[list[int]]:
        """Phase 2: force the closing sequence unless the model ended the thinking;
        sets ``stats.finish_reason`` when the request ends here."""
        st, limit = self.stats, self.opts.max_new_tokens
        if self.end_at is not None:
            st.thinking_tokens = self.answer_from = self.end_at
            finish = self.think_stats.finish_reason
            if finish == "stop" or len(self.out) >= limit:  # the answer ended inside the last round
                st.finish_reason = finish or "length"
            return
        st.thinking_tokens = len(self.thinking)
        if len(self.thinking) >= limit:
            st.finish_reason = "length"
            return
        close = list(self.fmt.close_ids)[: limit - len(self.thinking)]
        self.out += close
        yield close
        self.answer_from = len(self.out)
        if len(self.out) >= limit:
            st.finish_reason = "length"

    def answer(self, drafter) -> Iterator[list[int]]:
        """Phase 3: the answer, continuing the session (its KV holds the thinking)."""
        s2 = GenerationStats()
        resumed = ResumePrefix(self.verifier, len(self.prompt_ids) + len(self.thinking) - 1)
        scope = self.opts.round_scope
        if scope is not None:  # round indexes continue across the two phases
            offset = self.think_stats.target_forwards
            scope = lambda i: self.opts.round_scope(i + offset)  # noqa: E731
        self.released = True  # the answer loop releases the session
        loop = speculative_generate(drafter, resumed, self.prompt_ids + self.out, replace(
            self.opts, max_new_tokens=self.opts.max_new_tokens - len(self.out), budget=self.budget(),
            round_scope=scope, draft_first=True), stats=s2)  # the KV holds the thinking: draft the answer at once
        try:
            for chunk in loop:
                self.out += chunk
                yield chunk
        finally:
            loop.close()
        merge_stats(self.stats, s2)
        self.stats.finish_reason = s2.finish_reason

    def finish(self) -> None:
        st = self.stats
        st.prompt_tokens = len(self.prompt_ids)
        st.new_tokens = max(len(self.out), len(self.thinking))
        if self.answer_from is not None:
            st.answer_tokens = max(0, len(self.out) - self.answer_from)
        if self.t_end is not None:
            st.answer_s = time.perf_counter() - self.t_end
        st.total_s = time.perf_counter() - self.t0
        st.lossy = self.opts.sampling.lossy
        st.acceptance = self.opts.sampling.acceptance
        if not self.released:
            self.keep.release_now(self.opts.session_id)
