"""Grammars for structured outputs, on llguidance (PyPI ``llguidance``).

A request's grammar is a (kind, text) pair (``SamplingParams.grammar_kind`` /
``grammar``): "json_schema" (a JSON schema; OpenAI's ``response_format`` json_schema,
vLLM's ``guided_json``), "json_object" (any JSON object), "regex", "choice" (a JSON list
of strings: the output is one of them) or "lark" (a Lark grammar; GBNF is taken too, as
vLLM's ``guided_grammar``). ``to_llguidance`` turns one into llguidance's grammar text
(cached); ``check`` says what is wrong with one (the router refuses it naming the field)
without a tokenizer.

``Vocab`` is the target's token vocabulary as llguidance sees it: from a Hugging Face
fast tokenizer (``Vocab.from_hf``) or from each token's bytes (``Vocab.from_bytes``, the
tests' tiny vocabularies), with the ids that end the output (a grammar that is complete
allows only these).

``Matcher`` follows one session's output: ``sync(output)`` rolls back to the common
prefix with what it consumed and consumes the rest (the verifier calls it with the
session's committed output before every round), ``allowed()`` is the bool mask [V] of
the tokens the grammar allows next, ``advance(t)`` / ``back(n)`` walk a draft and return,
``forced()`` is the one token the grammar allows next, if there is exactly one (a free
draft: jump-forward). JSON is compact (no whitespace between tokens): every key,
separator and bracket that the schema fixes is then a forced token.

Mask cost on this project's 2-core CPU (AMD EPYC; ``scripts/grammar_mask_bench.py``, best of 12 alternating rounds,
SmolLM2's 49k vocabulary, a 51-token JSON object with six keys): llguidance 2.7 ms a
request for compiling the schema and every mask (0.03 ms a token warm), xgrammar 11.8 ms
(0.006 ms a token warm); against a forward of ~10-20 ms a token either is small. llguidance was picked: it compiles a new grammar at once
(requests bring their own schemas), takes Lark, GBNF, regex, JSON schema and choice
natively, rolls back, and needs nothing but itself (xgrammar pulls in triton).

This module knows nothing about models, sessions, gRPC or HTTP.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from functools import lru_cache
from typing import Optional, Sequence

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
JSON_DEFAULTS = {"whitespace_flexible": False}  # compact JSON: keys and separators become forced tokens
MAX_GRAMMAR_CHARS = 256 * 1024  # a request's grammar text (a JSON schema, a regex, a Lark grammar) at most
# llguidance's parser limits, named so that a grammar is judged the same everywhere (these are its
# defaults): a grammar past them is refused naming the field, at compile time or at the token where
# matching hits them (an Earley row of more than 2,000 items: 2,100 alternatives of one rule)
LIMITS = dict(max_items_in_row=2000, max_grammar_size=500_000, max_lexer_states=250_000)


class GrammarError(ValueError):
    """The grammar is malformed or too large to match (the message says where)."""


def _limits():
    return _ll().LLParserLimits(**LIMITS, verbose_errors=False)


def _failed(what: str, e: BaseException) -> "GrammarError":
    """llguidance failed inside (its Rust code panicked: pyo3's PanicException, a BaseException):
    the grammar, not the server, is what it could not handle."""
    return GrammarError(f"the grammar could not be {what} ({type(e).__name__}: {str(e)[:200]})")


def _first_line(msg: str) -> str:
    return (msg or "").strip().splitlines()[0][:300] if (msg or "").strip() else "unknown error"


def _ll():
    import llguidance

    return llguidance


@lru_cache(maxsize=256)
def to_llguidance(kind: str, text: str) -> str:
    """llguidance's grammar text for a request's (kind, text); GrammarError when it cannot be built."""
    ll = _ll()
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema is a JSON object")
            return ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return ll.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
        if kind == "regex":
            return ll.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            options = json.loads(text)
            if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
                raise GrammarError("choice is a non-empty list of non-empty strings")
            return ll.grammar_from("choice", json.dumps(options))
        if kind == "lark":
            return ll.grammar_from("grammar", text)  # Lark, or GBNF (llama.cpp's, vLLM's guided_grammar)
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None
    raise GrammarError(f"unknown grammar kind {kind!r}; one of {list(KINDS)}")


def check(kind: str, text: str) -> None:
    """Raise GrammarError naming what is wrong with the grammar (no tokenizer needed): too
    long (``MAX_GRAMMAR_CHARS``), malformed, or past llguidance's limits (``LIMITS``)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    try:
        g = to_llguidance(kind, text)
        ok, msg = _validate(g)
    except GrammarError:
        raise
    except BaseException as e:  # noqa: BLE001 - a panic inside llguidance (not KeyboardInterrupt: see _fatal)
        if _fatal(e):
            raise
        raise _failed("compiled", e) from None
    if not ok:
        raise GrammarError(_first_line(msg))


def _fatal(e: BaseException) -> bool:
    return isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit))


@contextmanager
def guarded(what: str = "matched"):
    """Whatever fails inside llguidance while matching (a panic of its Rust code is pyo3's
    PanicException, a BaseException) raised as the request's ``GrammarError``."""
    try:
        yield
    except GrammarError:
        raise
    except BaseException as e:  # noqa: BLE001 - see _fatal
        if _fatal(e):
            raise
        raise _failed(what, e) from None


@lru_cache(maxsize=256)
def _validate(g: str) -> tuple[bool, str]:
    err = _ll().LLMatcher.validate_grammar(g, limits=_limits())
    return (not err, err or "")


class _BytesTokenizer:
    """What llguidance's ``TokenizerWrapper`` reads: each token's bytes, the eos id, and
    a tokenize function (greedy longest match over the vocabulary)."""

    def __init__(self, tokens: Sequence[bytes], eos: int, special: Sequence[int] = ()):
        self.tokens = list(tokens)
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = list(special)  # a grammar names these as tokens (<[id]>), never as text
        self._by = {}
        for i, b in enumerate(self.tokens):
            if b and b not in self._by:
                self._by[b] = i
        self._longest = max((len(b) for b in self.tokens), default=1)

    def __call__(self, data) -> list[int]:
        data = data.encode() if isinstance(data, str) else bytes(data)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                t = self._by.get(data[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                i += 1  # a byte no token spells: skipped (a tiny test vocabulary)
        return out


class Vocab:
    """The target's vocabulary as llguidance's tokenizer (built once: ~0.4 s for a 49k
    vocabulary) and the ids that end the output."""

    def __init__(self, lltok, vocab_size: int, stop_ids: Sequence[int]):
        self.lltok, self.vocab_size, self.stop_ids = lltok, vocab_size, tuple(stop_ids)

    @classmethod
    def from_hf(cls, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> "Vocab":
        import llguidance.hf

        return cls(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_ids)[0]
                                                if stop_ids else None), vocab_size, stop_ids)

    @classmethod
    def from_bytes(cls, tokens: Sequence[bytes], stop_ids: Sequence[int], special: Sequence[int] = ()) -> "Vocab":
        ll = _ll()
        tok = _BytesTokenizer(tokens, list(stop_ids)[0], special)
        return cls(ll.LLTokenizer(ll.TokenizerWrapper(tok), n_vocab=len(tokens)), len(tokens), stop_ids)


class Matcher:
    """One session's grammar state over its output tokens (see the module docstring)."""

    def __init__(self, vocab: Vocab, kind: str, text: str):
        ll = _ll()
        self.vocab = vocab
        self.key = (kind, text)
        try:
            self.m = ll.LLMatcher(vocab.lltok, to_llguidance(kind, text), log_level=0, limits=_limits())
        except GrammarError:
            raise
        except BaseException as e:  # noqa: BLE001 - a panic inside llguidance
            if _fatal(e):
                raise
            raise _failed("compiled", e) from None
        if self.m.is_error():
            raise GrammarError(_first_line(self.m.get_error()))
        self.consumed: list[int] = []
        self._stops = torch.tensor(list(vocab.stop_ids), dtype=torch.long)
        self.lock = threading.Lock()

    def sync(self, output: Sequence[int]) -> bool:
        """Match the committed output: roll back to the common prefix, consume the rest.
        False when a committed token is not allowed (the matcher is then where it stopped)."""
        n = 0
        lim = min(len(output), len(self.consumed))
        while n < lim and output[n] == self.consumed[n]:
            n += 1
        self.back(len(self.consumed) - n)
        for t in output[n:]:
            if not self.advance(int(t)):
                return self.ends(int(t))
        return True

    def advance(self, token: int) -> bool:
        """Consume ``token`` if the grammar allows it (True), else leave the state as it
        is (False). A stop id is allowed where the grammar may end (and ends it)."""
        m = self.m
        if m.is_stopped():
            return False
        if token in self.vocab.stop_ids:
            if not m.is_accepting():
                return False
            token = self.vocab.stop_ids[0]  # llguidance knows one end token
        elif m.validate_tokens([token]) != 1:
            if m.is_error():
                raise GrammarError(f"too complex to match at output token {len(self.consumed)} "
                                   f"({_first_line(m.get_error())})")
            return False
        if not m.consume_token(token) or m.is_error():  # allowed, yet the matcher failed: past its limits
            err = _first_line(m.get_error()) if m.is_error() else "the token was refused after it was allowed"
            m.reset()
            for t in self.consumed:
                m.consume_token(t)
            raise GrammarError(f"too complex to match at output token {len(self.consumed)} ({err})")
        self.consumed.append(token)
        return True

    def ends(self, token: int) -> bool:
        """``token`` is a stop id and the output may end here."""
        return token in self.vocab.stop_ids and bool(self.m.is_accepting())

    def back(self, n: int) -> None:
        if n > 0:
            self.m.rollback(n)
            del self.consumed[-n:]

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (the stop ids once it may end, or
        where the vocabulary has no token the grammar takes: never none)."""
        V = self.vocab.vocab_size
        if self.m.is_stopped():
            out = torch.zeros(V, dtype=torch.bool)
        else:
            words = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.int32)
            if self.m.is_error():  # the mask computation hit a limit
                raise GrammarError(f"too complex to match at output token {len(self.consumed)} "
                                   f"({_first_line(self.m.get_error())})")
            out = ((words.to(torch.int64)[:, None] >> torch.arange(32)) & 1).reshape(-1)[:V].bool()
        out[self._stops] = bool(self.m.is_accepting())
        if not out.any():  # the vocabulary cannot continue the grammar: the output ends (never a row of -inf)
            out[self._stops] = True
        return out

    def forced(self, allowed: Optional[torch.Tensor] = None) -> Optional[int]:
        """The one token the grammar allows next (a free draft), else None."""
        a = self.allowed() if allowed is None else allowed
        idx = a.nonzero()
        return int(idx[0, 0]) if idx.shape[0] == 1 else None


