"""The router's text <-> token ids codec: ``specmesh.models.codec.TextCodec``
(the tokenizer and config only; the router loads no weights and no engine)."""

from __future__ import annotations

from specmesh.models.codec import TextCodec

__all__ = ["TextCodec"]
