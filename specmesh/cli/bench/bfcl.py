"""The Berkeley Function Calling Leaderboard's single-turn categories, from the PyPI package
``bfcl-eval`` (its ``data/`` and ``possible_answer/`` files), checked as BFCL checks them.

- ``load(category, n)``: ``n`` items of a category spread evenly over its file (the same
  items every run), each with its messages, its functions as OpenAI tools and its answer;
- ``tools_of(functions)``: BFCL's functions as OpenAI tools the way its OpenAI handler
  sends them (``convert_to_tool``: dots in names become underscores, BFCL's types become
  JSON schema ones, floats say so in their description);
- ``judge(item, calls, content)``: BFCL's verdict on a reply: its AST checker
  (``bfcl_eval.eval_checker.ast_eval.ast_checker``, imported with its table of model
  configurations replaced by one entry, "names with dots were sent with underscores",
  since that table imports every provider's SDK) for the call categories; for
  ``irrelevance`` no call, for ``relevance`` at least one, as its relevance runner decides.

Install with ``make setup-bfcl`` (``pip install --no-deps bfcl-eval==2026.3.23``: its
declared dependencies pin numpy and pull every provider's SDK; the checker needs none).
Knows nothing about servers or clients.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# our category name -> BFCL v4's file stem
CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
              "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance", "live_simple": "live_simple",
              "live_multiple": "live_multiple", "live_parallel": "live_parallel",
              "live_parallel_multiple": "live_parallel_multiple", "live_irrelevance": "live_irrelevance",
              "live_relevance": "live_relevance"}
STUB_MODEL = "specmesh"  # the model name the checker is given (its one configuration entry)


@dataclass
class Item:
    id: str
    category: str
    messages: list
    functions: list  # BFCL's own descriptions (the checker reads them)
    tools: list  # as sent: OpenAI tools
    answer: Optional[list]  # ground truth (None: a relevance category)


def data_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("bfcl-eval is not installed: make setup-bfcl (pip install --no-deps bfcl-eval==2026.3.23)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def load(category: str, n: int) -> list[Item]:
    """``n`` items of ``category`` spread evenly over its file (all when ``n`` <= 0 or more)."""
    stem = CATEGORIES[category]
    d = data_dir()
    rows = _lines(d / f"BFCL_v4_{stem}.json")
    answers = {}
    ans = d / "possible_answer" / f"BFCL_v4_{stem}.json"
    if ans.exists():
        answers = {a["id"]: a["ground_truth"] for a in _lines(ans)}
    if 0 < n < len(rows):
        rows = [rows[(k * len(rows)) // n] for k in range(n)]
    return [Item(r["id"], category, r["question"][0], r["function"], tools_of(r["function"]), answers.get(r["id"]))
            for r in rows]


def _type_map() -> dict:
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    return GORILLA_TO_OPENAPI


def _openai_types(properties: dict, mapping: dict) -> dict:
    """BFCL's ``_cast_to_openai_type``."""
    for key, value in properties.items():
        if "type" not in value:
            value["type"] = "string"
        else:
            t = value["type"]
            if t == "float":
                value["format"] = "float"
                value["description"] = value.get("description", "") + " This is a float type value."
            value["type"] = mapping.get(t, "string")
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _openai_types(value["properties"], mapping)
            elif "items" in value:
                value["items"]["type"] = mapping[value["items"]["type"]]
                inner = value["items"]
                if inner["type"] == "array" and "items" in inner:
                    inner["items"]["type"] = mapping[inner["items"]["type"]]
                elif inner["type"] == "object" and "properties" in inner:
                    inner["properties"] = _openai_types(inner["properties"], mapping)
    return properties


def tools_of(functions: list) -> list:
    """BFCL's ``convert_to_tool`` for OpenAI-style models."""
    mapping, out = _type_map(), []
    for f in copy.deepcopy(functions):
        f["name"] = re.sub(r"\.", "_", f["name"])
        f["parameters"]["type"] = "object"
        f["parameters"]["properties"] = _openai_types(f["parameters"].get("properties", {}), mapping)
        out.append({"type": "function", "function": f})
    return out


class _Configs(dict):
    """BFCL's MODEL_CONFIG_MAPPING for one model: function names with dots were sent with underscores."""

    def __missing__(self, key):
        return types.SimpleNamespace(underscore_to_dot=True)


def _checker():
    name = "bfcl_eval.constants.model_config"
    if name not in sys.modules:  # the real one imports every provider's SDK; the checker reads one field
        stub = types.ModuleType(name)
        stub.MODEL_CONFIG_MAPPING = _Configs()
        sys.modules[name] = stub
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker, Language.PYTHON


def judge(item: Item, calls: list, content: str) -> tuple[bool, str]:
    """(BFCL's verdict, its error) for a reply: ``calls`` as (name, arguments JSON text)."""
    if item.answer is None:  # relevance categories: whether the reply calls a function
        if "irrelevance" in item.category:
            return (not calls, "called a function" if calls else "")
        return (bool(calls), "" if calls else "no call")
    try:
        decoded = [{name: json.loads(args)} for name, args in calls]
    except ValueError as e:
        return False, f"arguments are not JSON: {e}"
    if not calls:
        return False, "no call: " + (content or "")[:120]
    if not all(isinstance(list(d.values())[0], dict) for d in decoded):
        return False, "arguments are not an object"
    check, lang = _checker()
    r = check(item.functions, decoded, item.answer, lang, item.category, STUB_MODEL)
    return bool(r["valid"]), "" if r["valid"] else "; ".join(map(str, r.get("error", [])))[:300]


__all__ = ["CATEGORIES", "Item", "data_dir", "judge", "load", "tools_of"]
