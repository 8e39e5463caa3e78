"""Text <-> token ids for the router, from the model's tokenizer only.

``TextCodec`` reuses ``Runtime.encode`` / ``Runtime.decode`` (chat template,
special tokens) without loading the model's weights, and the same stop ids.
It knows nothing about sessions, drafting or gRPC.
"""

from __future__ import annotations

from specmesh.models.loading import load_config, load_tokenizer, resolve_model, stop_ids
from specmesh.runtime import Runtime


class TextCodec:
    encode = Runtime.encode  # (prompt=None, messages=None, chat=True) -> ids; uses only self.tokenizer
    decode = Runtime.decode

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids(tokenizer)

    @classmethod
    def from_model(cls, model: str) -> "TextCodec":
        d = resolve_model(model, quiet=True)
        return cls(load_tokenizer(d), int(load_config(d)["vocab_size"]))
