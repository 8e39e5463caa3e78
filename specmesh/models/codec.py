"""Text <-> token ids with a model's tokenizer: ``TextCodec``.

``encode`` wraps a prompt as one user turn with the tokenizer's chat template
(or encodes it raw, or encodes chat messages), ``decode`` drops special tokens,
``stop_ids`` are the ids that end an assistant turn. The in-process ``Runtime``
and the router use this one codec, so both turn the same text into the same ids.

Knows the tokenizer and the model's config only: no weights, no torch, no
sessions, no gRPC.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..types import InvalidArgument
from .loading import load_config, load_tokenizer, resolve_model, stop_ids


class TextCodec:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids(tokenizer)

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
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, **kw)
        return list(enc["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token spells (a byte-level BPE token may be part of a UTF-8
        character, whose text alone would be U+FFFD): what logprobs report as ``bytes``."""
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
