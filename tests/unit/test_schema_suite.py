"""The JSON-schema suite the project keeps (``tests/data/json_schemas.json``, run in full by
``scripts/schema_suite.py``): it holds >= 50 schemas covering the features structured
outputs promise, each is a valid JSON schema that llguidance compiles, the script's
validator tells valid outputs from invalid ones, and a short constrained run of a subset
on the tiny model (one token a character) gives outputs that hold their schemas, identical
for plain decoding and two speculative strategies (greedy)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]'")

from specmesh.drafters import PromptLookupDrafter  # noqa: E402
from specmesh.grammar import Matcher, check  # noqa: E402
from specmesh.loop import generate_tokens  # noqa: E402
from specmesh.types import SamplingParams  # noqa: E402
from tests.support import CharCodec, tiny_grammar_verifier  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("schema_suite", ROOT / "scripts" / "schema_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SS = _script()
SUITE = SS.load_suite()
BY_NAME = {e["name"]: e for e in SUITE}


def test_the_suite_covers_the_features_structured_outputs_promise():
    assert len(SUITE) >= 50 and len(BY_NAME) == len(SUITE)
    features = {f for e in SUITE for f in e["features"]}
    for want in ("object", "array", "enum", "nested", "number bounds", "integer bounds", "pattern", "format",
                 "optional", "anyOf", "oneOf", "allOf", "$ref", "const", "prefixItems", "multipleOf"):
        assert any(want in f for f in features), want
    for e in SUITE:
        assert e["prompt"].strip() and e["name"]
        jsonschema.Draft202012Validator.check_schema(e["schema"])


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_schema_compiles_in_the_grammar_engine(name):
    text = json.dumps(BY_NAME[name]["schema"])
    check("json_schema", text)
    m = Matcher(CharCodec().grammar_vocab(), "json_schema", text)
    assert m.allowed().any()  # the first token has somewhere to go


def test_the_validator_tells_valid_outputs_from_invalid_ones():
    s = BY_NAME["log_line"]["schema"]
    good = '{"level":"info","timestamp":"2024-05-01T12:00:00Z","message":"up"}'
    assert SS.check_output(good, s) == (True, "")
    for bad in ('{"level":"info","timestamp":"2024-05-01T12:00:00Z","message":"up"',  # cut: not JSON
                '{"level":"loud","timestamp":"2024-05-01T12:00:00Z","message":"up"}',  # not in the enum
                '{"level":"info","timestamp":"yesterday","message":"up"}',  # not a date-time
                '{"level":"info","timestamp":"2024-05-01T12:00:00Z"}'):  # a required key missing
        ok, why = SS.check_output(bad, s)
        assert not ok and why, bad
    assert not SS.check_output('{"zip":"1234","street":"a","city":"b"}', BY_NAME["address"]["schema"])[0]  # pattern
    assert not SS.check_output('{"eggs":13}', BY_NAME["multiple_of"]["schema"])[0]
    assert not SS.check_output('{"ip":"300.1.1.1","port":80}', BY_NAME["host"]["schema"])[0]  # format ipv4
    t = BY_NAME["time_slot"]["schema"]  # RFC 3339 full-time: an offset is part of it
    assert SS.check_output('{"topic":"x","start":"20:00:00-23:00"}', t)[0]
    assert SS.check_output('{"topic":"x","start":"09:30:00.5Z"}', t)[0]
    for bad in ("20:00:00", "25:00:00Z", "20:00Z"):
        assert not SS.check_output('{"topic":"x","start":"%s"}' % bad, t)[0], bad


SUBSET = ["person", "order", "shape_any", "directions", "http_request", "tuple"]


def test_a_subset_runs_valid_and_identical_across_strategies():
    """Plain decoding, prompt lookup with jump-forward and the in-verifier layer-skip
    drafter: every output holds its schema and the three are the same tokens (greedy)."""
    codec, ver = CharCodec(), tiny_grammar_verifier(max_seq_len=512)
    for name in SUBSET:
        e = BY_NAME[name]
        sp = SamplingParams(grammar_kind="json_schema", grammar=json.dumps(e["schema"]))
        ids = codec.encode(e["prompt"])
        kw = dict(sampling=sp, max_new_tokens=200, stop_ids=codec.stop_ids)
        plain, st = generate_tokens(None, ver, ids, jump_forward=False, **kw)
        assert st.finish_reason == "stop", (name, codec.decode(plain))
        ok, why = SS.check_output(codec.decode(plain), e["schema"])
        assert ok, (name, why, codec.decode(plain))
        lookup, st = generate_tokens(PromptLookupDrafter(), ver, ids, **kw)
        assert lookup == plain, name
        assert st.forced_tokens > 0, name
        skip, _ = generate_tokens(None, ver, ids, self_draft="layerskip", **kw)
        assert skip == plain, name
