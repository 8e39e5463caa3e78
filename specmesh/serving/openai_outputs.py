"""The OpenAI API's structured-output, logprobs and ``n`` fields, translated both ways.

- ``grammar_of(body)``: the one grammar a request asks for, from ``response_format``
  (``json_object``; ``json_schema`` with its ``schema``: enforced whether ``strict`` is
  true or not, as vLLM does) or vLLM's extras (``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``, and their newer form ``structured_outputs``
  with ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``): (the field it came
  from, the SDK keyword arguments), or None. Two of them: a 400 naming the second.
- ``chat_logprobs`` / ``completion_logprobs``: the SDK's ``TokenLogprob`` list in the
  chat API's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and the
  completions API's ``{tokens, token_logprobs, top_logprobs, text_offset}`` shapes.
- ``child_seed(seed, i)``: the seed of choice i of a request with ``n`` > 1 (choice 0
  keeps the request's seed, so ``n: 1`` and choice 0 of ``n: 4`` draw the same output).

This module knows nothing about the router or HTTP; it reshapes fields and results.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..wire.choices import child_seed  # noqa: F401 - choice i's seed (the SDK's generate_n draws the same)

from ..wire.choices import MAX_N  # noqa: E402
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # the completions API's logprobs


class FieldError(ValueError):
    def __init__(self, param: str, why: str):
        super().__init__(f"{param}: {why}")
        self.param, self.why = param, why


def _json_text(param: str, v: Any) -> str:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise FieldError(param, f"not valid JSON: {e}") from None
    if not isinstance(v, dict):
        raise FieldError(param, "a JSON schema is a JSON object")
    return json.dumps(v)


def _from_response_format(rf: Any) -> Optional[dict]:
    if rf is None:
        return None
    if not isinstance(rf, dict) or "type" not in rf:
        raise FieldError("response_format", "must be an object with a type (text, json_object or json_schema)")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise FieldError("response_format", "json_schema needs {\"name\": ..., \"schema\": {...}}")
        return {"json_schema": _json_text("response_format", js["schema"])}
    raise FieldError("response_format", f"unknown type {kind!r}; one of text, json_object, json_schema")


def _from_structured(param: str, so: Any) -> dict:
    if not isinstance(so, dict):
        raise FieldError(param, "must be an object with one of json, regex, choice, grammar, json_object")
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = set(given) - {"json", "regex", "choice", "grammar", "json_object"}
    if unknown:
        raise FieldError(param, f"unknown field(s) {sorted(unknown)}")
    if len(given) != 1:
        raise FieldError(param, f"give exactly one of json, regex, choice, grammar, json_object; got {sorted(given)}")
    (k, v), = given.items()
    return _one(param, {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                        "grammar": "guided_grammar", "json_object": "json_object"}[k], v)


def _one(param: str, kind: str, v: Any) -> dict:
    if kind == "guided_json":
        return {"json_schema": _json_text(param, v)}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "guided_choice":
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
            raise FieldError(param, "a non-empty list of non-empty strings")
        return {"choice": list(v)}
    if not isinstance(v, str) or not v:
        raise FieldError(param, "a non-empty string")
    return {"regex": v} if kind == "guided_regex" else {"grammar": v}


def grammar_of(fields: dict) -> Optional[tuple[str, dict]]:
    """(the field that asked, SDK keyword arguments) of the request's structured output, or None."""
    found: list[tuple[str, dict]] = []
    rf = _from_response_format(fields.get("response_format"))
    if rf is not None:
        found.append(("response_format", rf))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if fields.get(name) is not None:
            found.append((name, _one(name, name, fields[name])))
    if fields.get("structured_outputs") is not None:
        found.append(("structured_outputs", _from_structured("structured_outputs", fields["structured_outputs"])))
    if len(found) > 1:
        raise FieldError(found[1][0], f"give one structured output; {found[0][0]} already asks for one")
    return found[0] if found else None


# ---------------------------------------------------------------- logprobs

def _entry(token: str, token_bytes: bytes, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token_bytes)}


def chat_logprobs(lps: list, top: int) -> dict:
    """The chat API's ``logprobs`` of a choice (or a chunk) from SDK ``TokenLogprob`` s."""
    return {"content": [dict(_entry(x.token, x.token_bytes, x.logprob),
                             top_logprobs=[_entry(t, b, lp) for _, t, b, lp in x.top[:top]]) for x in lps],
            "refusal": None}


def completion_logprobs(lps: list, top: int, offset: int = 0) -> dict:
    """The completions API's ``logprobs``; ``offset``: text characters before these tokens."""
    tokens, offsets = [], []
    for x in lps:
        tokens.append(x.token)
        offsets.append(offset)
        offset += len(x.token)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{t: lp for _, t, _, lp in x.top[:top]} for x in lps] if top else None,
            "text_offset": offsets}


__all__ = ["FieldError", "MAX_N", "MAX_TOP_LOGPROBS", "chat_logprobs", "child_seed", "completion_logprobs",
           "grammar_of"]
