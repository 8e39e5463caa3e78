"""The request limits a server enforces, from its settings and the served model's context.

``resolve(settings, context)`` turns the settings (``max_seq_len``, ``max_prompt_tokens``
and ``max_new_tokens`` may be None: "from the model") and the model's context length
(``model_context``: its config's ``max_position_embeddings``, which a GGUF's cache
directory carries from the GGUF's context length) into ``Limits``:

- ``max_seq_len``: the KV positions of a slot (verifier and draft LM), so the longest
  prompt + reply of a request. The setting, else the model's context capped at
  ``KV_DEFAULT_CAP`` (every slot's KV is allocated when the verifier starts:
  ``n_slots`` x ``max_seq_len`` positions); a setting above the model's context is refused.
- ``max_prompt_tokens``: the setting, else all the context leaves a reply of at least one
  token (``max_seq_len`` - 2); never more than that.
- ``max_new_tokens``: the operator's cap on a request's ``max_new_tokens`` (a request
  above it is refused); None (the default): no cap but the context. A request that names
  a ``max_new_tokens`` larger than what its prompt leaves of the context is refused
  (``new_tokens``), as OpenAI's API and vLLM's server refuse it (a 400 saying how many
  tokens the context holds and how many were asked for); a request that names none gets
  the server's default, cut to what the prompt leaves (the reply then ends with finish
  reason ``length``).

A refusal is an ``InvalidArgument`` naming the request's field, the limit and the
setting that raises it, as its flag and its environment variable (``hint``). Nothing here
depends on the dtype: the limits are token counts.

This module knows nothing about gRPC, engines or tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..types import InvalidArgument

# the default KV positions per slot where the model allows more: the KV of every slot is
# allocated at start (Qwen2.5-Coder-1.5B: 28 KiB a position in bf16, so 8 slots x 8192
# positions = 1.75 GiB); --max-seq-len raises it up to the model's context
KV_DEFAULT_CAP = 8192
FALLBACK_SEQ_LEN = 2048  # a model whose config states no context (the tests' tiny random ones)
# the flag of each setting where it is not --<field with dashes> (the env variable is always SPECMESH_<FIELD>)
FLAGS = {"max_new_tokens": "--max-new-tokens-limit"}


def flag_of(field: str) -> str:
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def setting(field: str) -> str:
    """How a setting is set: ``--max-seq-len N or SPECMESH_MAX_SEQ_LEN=N``."""
    return f"{flag_of(field)} N or SPECMESH_{field.upper()}=N"


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    max_prompt_tokens: int
    max_new_tokens: Optional[int]  # the operator's cap on a request's max_new_tokens; None: the context's only
    default_max_new_tokens: int
    context: Optional[int] = None  # the model's context (None: unknown)
    explicit: frozenset = frozenset()  # the settings among max_seq_len, max_prompt_tokens, max_new_tokens given

    def _seq_hint(self) -> str:
        if self.context is not None and self.max_seq_len >= self.context:
            return f"the model's whole context of {self.context} tokens"
        src = "max_seq_len" if "max_seq_len" in self.explicit else (
            f"max_seq_len, {KV_DEFAULT_CAP} by default" + (f" of the model's {self.context}" if self.context else ""))
        up = f", up to the model's context of {self.context}" if self.context else ""
        return f"the KV of a slot ({src}): raise it with {setting('max_seq_len')}{up}"

    def check_prompt(self, n: int, field: str = "prompt") -> None:
        """Refuse a prompt of ``n`` tokens over ``max_prompt_tokens``."""
        if n <= self.max_prompt_tokens:
            return
        if "max_prompt_tokens" in self.explicit and self.max_prompt_tokens < self.max_seq_len - 2:
            why = (f"max_prompt_tokens: raise it with {setting('max_prompt_tokens')}, up to "
                   f"{self.max_seq_len - 2} (the context less a reply)")
        else:
            why = f"the context less room for a reply; the context is {self._seq_hint()}"
        raise InvalidArgument(field, f"{n} tokens exceed the limit of {self.max_prompt_tokens} prompt tokens ({why})")

    def check_chars(self, chars: int, field: str = "prompt") -> None:
        """A cheap guard before tokenizing: far more characters than the prompt limit allows."""
        if chars > 32 * self.max_prompt_tokens:
            raise InvalidArgument(field, f"{chars} characters is far over the limit of {self.max_prompt_tokens} "
                                  f"prompt tokens (about 32 characters a token at most)")

    def check_requested(self, n: int, field: str = "max_new_tokens") -> None:
        """Refuse a requested ``max_new_tokens`` over the operator's cap (before the prompt is known)."""
        if self.max_new_tokens is not None and n > self.max_new_tokens:
            raise InvalidArgument(field, f"{n} exceeds the limit {self.max_new_tokens} (max_new_tokens: raise it "
                                  f"with {setting('max_new_tokens')}, or leave it unset: a request is then "
                                  f"limited by the context it leaves)")

    def new_tokens(self, n: int, prompt_tokens: int, field: str = "max_new_tokens", requested: bool = True) -> int:
        """The tokens a request of ``prompt_tokens`` may generate for ``n``. The KV holds
        prompt + reply plus one position of slack; a prompt that leaves no room is refused.
        ``requested`` (the request named ``n``): more than the prompt leaves is refused,
        naming ``field``, the context and the setting that raises it; else (the server's
        default) ``n`` is cut to what the prompt leaves."""
        self.check_requested(n, field)
        room = self.max_seq_len - prompt_tokens - 1
        if room < 1:
            raise InvalidArgument("prompt", f"{prompt_tokens} tokens leave no room for a reply in the context of "
                                  f"{self.max_seq_len} tokens ({self._seq_hint()})")
        if n > room and requested:
            raise InvalidArgument(field, f"{n} new tokens after a prompt of {prompt_tokens} exceed the context of "
                                  f"{self.max_seq_len} tokens: at most {room} fit (ask for fewer, or leave it unset "
                                  f"for the rest of the context up to the default; the context is {self._seq_hint()})")
        return min(n, room)


def resolve(settings, context: Optional[int] = None) -> Limits:
    """``Limits`` of ``settings`` (a ``ServeSettings``) for a model of ``context`` tokens
    (None: unknown). Raises ``InvalidArgument("max_seq_len")`` for a setting above the
    model's context."""
    explicit = frozenset(f for f in ("max_seq_len", "max_prompt_tokens", "max_new_tokens")
                         if getattr(settings, f) is not None)
    seq = settings.max_seq_len
    if seq is None:
        seq = min(context, KV_DEFAULT_CAP) if context else FALLBACK_SEQ_LEN
    elif context and seq > context:
        raise InvalidArgument("max_seq_len", f"{seq} exceeds the model's context of {context} tokens (set "
                              f"{setting('max_seq_len')} to at most {context}, or leave it unset)")
    top = max(1, seq - 2)
    prompt = top if settings.max_prompt_tokens is None else min(settings.max_prompt_tokens, top)
    cap = settings.max_new_tokens
    default = settings.default_max_new_tokens if cap is None else min(settings.default_max_new_tokens, cap)
    return Limits(seq, prompt, cap, default, context, explicit)


def model_context(model: str) -> Optional[int]:
    """The context length of ``model`` (an alias, a GGUF or a Hugging Face directory) from
    its config, or None where it states none or cannot be read."""
    from ..models.loading import ModelNotFound, load_config, resolve_model

    try:
        n = load_config(resolve_model(model, quiet=True)).get("max_position_embeddings")
    except (ModelNotFound, OSError, ValueError):
        return None
    return int(n) if n else None
