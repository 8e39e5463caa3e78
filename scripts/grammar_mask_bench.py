"""Grammar masks' cost per token on this machine: llguidance against xgrammar.

SmolLM2's 49k vocabulary, a JSON schema of six keys (a string with a pattern, an enum,
an array, a nested object) and a 51-token compact instance. Two figures per engine,
alternating the engines round by round and keeping each one's best:
- warm: the mask of every position of the instance, computed and advanced, with the
  grammar compiled once (a long output under one schema);
- cold: a new grammar each request (the schema changed: requests bring their own),
  compile + every mask.
xgrammar is not a dependency (it pulls in triton): ``pip install xgrammar==0.2.8``
first, or this prints llguidance's figures only. Run under the CPU lock:
``flock -s /tmp/specmesh-cpu.lock .venv/bin/python scripts/grammar_mask_bench.py``.
"""

from __future__ import annotations

import copy
import json
import time

from specmesh.models.loading import load_tokenizer, resolve_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "role": {"enum": ["admin", "editor", "viewer"]}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "role", "tags", "address"], "additionalProperties": False}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@math.com", "role": "admin",
            "tags": ["math", "poetry", "engines"], "address": {"city": "London", "zip": "W1"}}


def main(rounds: int = 12) -> None:
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    V = len(tok)
    ids = tok.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)

    def fresh(i):
        s = copy.deepcopy(SCHEMA)
        s["properties"]["role"]["enum"] = ["admin", "editor", f"viewer{i}"]
        return json.dumps(s)

    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    lbm = lt.allocate_token_bitmask(1, V)

    def llg(schema):
        m = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}))
        return lambda: [(lt.fill_next_token_bitmask(m, lbm, 0), m.consume_token(t)) for t in ids] and m.reset()

    engines = {"llguidance": llg}
    try:
        import xgrammar as xgr

        comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V), cache_enabled=False)
        xbm = xgr.allocate_token_bitmask(1, V)

        def xg(schema):
            m = xgr.GrammarMatcher(comp.compile_json_schema(schema, any_whitespace=False, separators=(",", ":")))
            return lambda: [(m.fill_next_token_bitmask(xbm), m.accept_token(t)) for t in ids] and m.reset()

        engines["xgrammar"] = xg
    except ImportError:
        print("xgrammar is not installed: llguidance only")
    warm_runs = {k: f(fresh(-1)) for k, f in engines.items()}
    best = {k: [1e9, 1e9] for k in engines}
    for r in range(rounds):
        for k, f in engines.items():
            t0 = time.perf_counter()
            warm_runs[k]()
            best[k][0] = min(best[k][0], (time.perf_counter() - t0) / len(ids))
            t0 = time.perf_counter()
            f(fresh(r))()
            best[k][1] = min(best[k][1], time.perf_counter() - t0)
    for k, (warm, cold) in best.items():
        print(f"{k}: warm {warm * 1e3:.3f} ms/token; cold (compile + {len(ids)} masks) {cold * 1e3:.1f} ms/request")


if __name__ == "__main__":
    main()
