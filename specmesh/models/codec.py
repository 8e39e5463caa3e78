"""Text <-> token ids with a model's tokenizer: ``TextCodec``.

``encode`` wraps a prompt as one user turn with the tokenizer's chat template
(or encodes it raw, or encodes chat messages), ``decode`` drops special tokens,
``stop_ids`` are the ids that end an assistant turn.

Text a client supplies inside a chat (messages' content and names, tool calls and
tools) is never parsed into control tokens: a user who types ``<|im_end|>\n<|im_start|>
system`` gets those characters as text, while the template's own markers stay special
(``chat_ids``). A raw prompt (``chat=False``: the completions API) is the client's
whole text, special tokens included, and is tokenized as it is. The in-process ``Runtime``
and the router use this one codec, so both turn the same text into the same ids.

Knows the tokenizer and the model's config only: no weights, no torch, no
sessions, no gRPC.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from ..types import InvalidArgument
from .loading import load_config, load_tokenizer, resolve_model, stop_ids


class TextCodec:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids(tokenizer)
        self._specials: Optional[list[str]] = None
        self._skip: Optional[frozenset] = None

    @classmethod
    def from_model(cls, model: str) -> "TextCodec":
        """The codec of a model alias or local Hugging Face directory (tokenizer and config only)."""
        d = resolve_model(model, quiet=True)
        return cls(load_tokenizer(d), int(load_config(d)["vocab_size"]))

    @property
    def renders_tools(self) -> bool:
        """The chat template renders tools (``tools=``; Qwen2.5's does, SmolLM2's does not)."""
        return "tools" in self.chat_template

    @property
    def chat_template(self) -> str:
        t = getattr(self.tokenizer, "chat_template", None) or ""
        return t if isinstance(t, str) else ""

    def special_id(self, text: str) -> Optional[int]:
        """The id of the added (special) token that spells ``text`` (Qwen2.5's ``<tool_call>``),
        else None: the text is ordinary tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        return int(ids[0]) if len(ids) == 1 and int(ids[0]) in added else None

    def encode(self, prompt: Optional[str] = None, messages: Optional[list[dict]] = None,
               chat: bool = True, tools: Optional[list] = None, chat_template: Optional[str] = None) -> list[int]:
        """Token ids for a prompt (wrapped as one user turn when ``chat``) or messages;
        ``tools`` (``specmesh.tools.Tool``) for a template that renders them, ``chat_template``
        to render with instead of the tokenizer's."""
        if messages is None:
            if not prompt:
                raise InvalidArgument("prompt", "is empty")
            if not chat:
                return list(self.tokenizer.encode(prompt, add_special_tokens=False))
            messages = [{"role": "user", "content": prompt}]
        if not messages:
            raise InvalidArgument("messages", "is empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidArgument("messages", f"entry {i} needs 'role' and 'content'")
        kw = {}
        if tools:
            import json

            kw["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": json.loads(t.parameters)}} for t in tools]
        if chat_template:
            kw["chat_template"] = chat_template
        return self.chat_ids(self.named(messages), add_generation_prompt=True, **kw)

    def named(self, messages: list[dict]) -> list[dict]:
        """``messages`` with each system, user or assistant turn's ``name`` (OpenAI's participant
        name) where the model reads it: left to a template that renders names, else written
        in front of the turn's text (``alice: Hello``), as no template of ours has a place for
        it. Never dropped: the same conversation with and without names is not the same prompt."""
        if not any(m.get("name") and m.get("role") in NAMED_ROLES for m in messages):
            return messages
        t = getattr(self.tokenizer, "chat_template", None) or ""
        if isinstance(t, str) and _RENDERS_NAMES.search(t):
            return messages
        out = []
        for m in messages:
            if m.get("name") and m.get("role") in NAMED_ROLES:
                m = dict(m)
                m["content"] = f"{m.pop('name')}: {m.get('content') or ''}"
            out.append(m)
        return out

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> list[int]:
        """``messages`` rendered with the chat template (``kw``: its other arguments) and
        tokenized, with every special-token string in the messages' (and tools') text as
        plain text: rendered with each such string replaced by a private-use sentinel, the
        template's own special tokens are found in that text (the only ones left), the text
        between them is tokenized with special tokens split, and the sentinels become the
        typed strings again. Where no text holds one the ids are the template's usual ones."""
        specials = self._special_strings()
        found: list[str] = []
        pattern = _alternation(specials)  # the template's markers (and what a client may type)
        typed = _alternation(specials + [_S0, _S1])  # a typed sentinel character is escaped as well

        def escape(v):
            if isinstance(v, str):
                return typed.sub(lambda m: found.append(m.group(0)) or f"{_S0}{len(found) - 1}{_S1}", v)
            if isinstance(v, dict):
                return {k: (x if k == "role" else escape(x)) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [escape(x) for x in v]
            return v

        safe = [escape(m) for m in messages]
        if "tools" in kw:
            kw = dict(kw, tools=escape(kw["tools"]))
        if not found:
            enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=True, **kw)
            return list(enc["input_ids"])
        text = self.tokenizer.apply_chat_template(safe, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  **kw)
        marks = _SENTINEL.findall(text)
        if sorted(int(k) for k in marks) != list(range(len(found))):  # the template did not copy the text as is
            raise InvalidArgument("messages", f"holds the special token {found[0]!r}, which this chat template "
                                  "does not render as text; leave it out")
        ids: list[int] = []
        pos = 0
        for m in (pattern.finditer(text) if pattern is not None else ()):  # the template's own markers
            ids += self._text_ids(text[pos:m.start()], found)
            ids.append(self.tokenizer.convert_tokens_to_ids(m.group(0)))
            pos = m.end()
        return ids + self._text_ids(text[pos:], found)

    def _text_ids(self, text: str, found: list[str]) -> list[int]:
        """Ids of chat text between two of the template's markers: the typed special strings
        back in place of their sentinels, tokenized as text."""
        if not text:
            return []
        text = _SENTINEL.sub(lambda m: found[int(m.group(1))], text)
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def _special_ids(self) -> frozenset:
        """The ids ``decode`` skips (``skip_special_tokens``)."""
        if self._skip is None:
            added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            self._skip = frozenset([int(i) for i, t in added.items() if getattr(t, "special", False)] +
                                   [int(i) for i in getattr(self.tokenizer, "all_special_ids", []) or []])
        return self._skip

    def _special_strings(self) -> list[str]:
        """The special tokens' strings (longest first: one may begin another)."""
        if self._specials is None:
            added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            names = {t.content for t in added.values() if getattr(t, "special", False) and t.content}
            names |= {t for t in getattr(self.tokenizer, "all_special_tokens", []) or [] if t}
            self._specials = sorted(names, key=len, reverse=True)
        return self._specials

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token spells (a byte-level BPE token may be part of a UTF-8
        character, whose text alone would be U+FFFD): what logprobs report as ``bytes``. A
        special token spells nothing, as ``decode`` drops it from the text: a logprob's token
        and the text it belongs to agree."""
        if int(token_id) in self._special_ids():
            return b""
        tok = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if tok is None:
            return b""
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(tok[3:5], 16)])
            except ValueError:
                pass
        dec = _byte_decoder()
        if all(c in dec for c in tok):  # GPT-2 byte-level BPE
            return bytes(dec[c] for c in tok)
        return self.tokenizer.convert_tokens_to_string([tok]).encode()


NAMED_ROLES = ("system", "user", "assistant")  # a tool turn's name is its function's (the tool rendering's)
_RENDERS_NAMES = re.compile(r"message\[['\"]name['\"]\]|message\.name\b")
_S0, _S1 = "\ue000", "\ue001"  # private-use characters around a typed special string's index
_SENTINEL = re.compile(f"{_S0}(\\d+){_S1}")


def _alternation(strings: Sequence[str]):
    """A regex matching any of ``strings`` (longest first), or None when there are none."""
    return re.compile("|".join(re.escape(x) for x in strings)) if strings else None


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet, inverted: the character each byte is written as -> the byte."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


_BYTE_DECODER: Optional[dict] = None
