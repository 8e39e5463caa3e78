"""The request limits default from the served model's context (issue 62,
``specmesh.serving.limits``): the KV positions of a slot from the model's context
(capped by default), the prompt limit from those, no cap on ``max_new_tokens`` but
the context (a request naming more than its prompt leaves is refused, the default cut
to it); every refusal
names the field, the limit and the setting that raises it (flag and environment
variable), and each named setting is one ``specmesh serve`` parses. The context is
read from the model's config, which a GGUF's cache directory carries from the GGUF.
No services: the limits are pure, the settings parsed as ``serve`` parses them."""

from __future__ import annotations

import pytest

from specmesh.serving.limits import FALLBACK_SEQ_LEN, KV_DEFAULT_CAP, flag_of, model_context, resolve
from specmesh.serving.settings import load_settings
from specmesh.types import InvalidArgument


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for k in ("SPECMESH_MAX_SEQ_LEN", "SPECMESH_MAX_PROMPT_TOKENS", "SPECMESH_MAX_NEW_TOKENS",
              "SPECMESH_DEFAULT_MAX_NEW_TOKENS", "SPECMESH_CONFIG"):
        monkeypatch.delenv(k, raising=False)


def test_limits_default_from_the_models_context():
    s = load_settings()
    assert (s.max_seq_len, s.max_prompt_tokens, s.max_new_tokens) == (None, None, None)  # "from the model"
    qwen = resolve(s, 32768)  # Qwen2.5-Coder: 32K, capped for the KV allocated at start
    assert (qwen.max_seq_len, qwen.max_prompt_tokens, qwen.max_new_tokens) == (KV_DEFAULT_CAP, KV_DEFAULT_CAP - 2, None)
    small = resolve(s, 2048)  # a model with less context than the cap: all of it
    assert (small.max_seq_len, small.max_prompt_tokens) == (2048, 2046)
    assert resolve(s, None).max_seq_len == FALLBACK_SEQ_LEN  # a config that states none
    # the requests: a 2,120-token system prompt, then max_tokens 4096 as many clients send
    qwen.check_prompt(2120)
    assert qwen.new_tokens(4096, 2120) == 4096
    small_kv = resolve(load_settings(max_seq_len=4096), 32768)
    with pytest.raises(InvalidArgument) as e:  # asked for more than the prompt leaves: refused, saying how many fit
        small_kv.new_tokens(4096, 2120)
    assert e.value.field == "max_new_tokens"
    for part in ("4096", "2120", str(4096 - 2120 - 1), "context of 4096", "--max-seq-len", "SPECMESH_MAX_SEQ_LEN"):
        assert part in str(e.value), part
    assert small_kv.new_tokens(4096, 2120, requested=False) == 4096 - 2120 - 1  # the default: cut to fit
    assert qwen.new_tokens(256, 2120) == 256


def test_limits_do_not_depend_on_the_dtype():
    for ctx in (None, 2048, 32768):
        got = {resolve(load_settings(dtype=d), ctx) for d in ("fp32", "bf16", "int8", "int4")}
        assert len(got) == 1, ctx


def test_every_refusal_names_the_field_the_limit_and_the_setting():
    lim = resolve(load_settings(), 32768)
    with pytest.raises(InvalidArgument) as e:
        lim.check_prompt(9000)
    assert e.value.field == "prompt"
    for part in ("9000", str(KV_DEFAULT_CAP - 2), "--max-seq-len", "SPECMESH_MAX_SEQ_LEN", "32768"):
        assert part in str(e.value), part
    with pytest.raises(InvalidArgument) as e:
        lim.check_prompt(9000, "messages")
    assert e.value.field == "messages"

    lim = resolve(load_settings(max_prompt_tokens=1536, max_new_tokens=1024), 32768)
    with pytest.raises(InvalidArgument) as e:
        lim.check_prompt(2120)
    for part in ("2120", "1536", "--max-prompt-tokens", "SPECMESH_MAX_PROMPT_TOKENS"):
        assert part in str(e.value), part
    with pytest.raises(InvalidArgument) as e:
        lim.new_tokens(4096, 10)
    assert e.value.field == "max_new_tokens"
    for part in ("4096", "1024", "--max-new-tokens-limit", "SPECMESH_MAX_NEW_TOKENS"):
        assert part in str(e.value), part
    assert lim.default_max_new_tokens == 256 and lim.new_tokens(1024, 10) == 1024

    at_context = resolve(load_settings(), 8192)  # SmolLM2: the whole context; it cannot be raised
    with pytest.raises(InvalidArgument) as e:
        at_context.check_prompt(8191)
    assert "8192" in str(e.value) and "whole context" in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        resolve(load_settings(max_seq_len=65536), 32768)
    assert e.value.field == "max_seq_len" and "32768" in str(e.value) and "SPECMESH_MAX_SEQ_LEN" in str(e.value)
    with pytest.raises(InvalidArgument) as e:  # an explicit prompt limit above the context is held to it
        resolve(load_settings(max_prompt_tokens=5000, max_seq_len=4096), 32768).new_tokens(16, 4095)
    assert e.value.field == "prompt" and "4096" in str(e.value)


def test_the_settings_named_are_the_ones_serve_parses(monkeypatch):
    """The flag and the variable an error names set that limit."""
    from specmesh.cli import build_parser
    from specmesh.cli.serve import settings_from_args

    for field, value in (("max_seq_len", 4096), ("max_prompt_tokens", 1000), ("max_new_tokens", 512)):
        args = build_parser().parse_args(["serve", flag_of(field), str(value)])
        assert getattr(settings_from_args(args), field) == value, field
        monkeypatch.setenv(f"SPECMESH_{field.upper()}", str(value))
        assert getattr(load_settings(), field) == value, field


def test_the_context_is_read_from_the_models_config_and_the_gguf():
    """SmolLM2 is served from its GGUF: the context the limits use is the GGUF's."""
    gguf = pytest.importorskip("gguf")
    from specmesh.models.loading import alias_gguf

    n = model_context("smollm2-135m-instruct")
    r = gguf.GGUFReader(str(alias_gguf("smollm2-135m-instruct", quiet=True)))
    f = r.fields["llama.context_length"]
    assert n == int(f.parts[f.data[0]][0]) == 8192
    assert resolve(load_settings(), n).max_seq_len == 8192
    assert model_context("no-such-model") is None
