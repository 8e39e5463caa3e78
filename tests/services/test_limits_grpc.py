"""The limits a new user meets, through the real services (issue 62): a router whose
prompt and output limits are not set takes them from the context (here the verifier's
128 KV positions); ``max_tokens`` larger than what the prompt leaves is INVALID_ARGUMENT
/ HTTP 400 naming it and saying how many fit, while a request that names none gets the
default cut to what fits (the output equals a request for exactly that many), through the
gRPC SDK and the OpenAI HTTP API; a prompt over the limit is INVALID_ARGUMENT / HTTP 400
naming the field, the limit and the setting that raises it, and leaves no session behind.
Tiny random model, real gRPC servers and HTTP front on loopback."""

from __future__ import annotations

import functools

import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[test]'")

from specmesh.cli.stack import LocalStack  # noqa: E402
from specmesh.client import Client  # noqa: E402
from specmesh.errors import InvalidArgumentError  # noqa: E402
from specmesh.serving.openai_http import start_http  # noqa: E402
from tests.support import TRACED_SETTINGS, TokenizerCodec, V, settings, tiny_layerskip_verifier  # noqa: E402

MODEL = "tiny-test-model"
SEQ = 128
PROMPT = ("abcabcabc the cat sat on the mat " * 4)[:110]  # leaves 17 of the 128 positions


@pytest.fixture(scope="module")
def stack():
    from specmesh.drafters import PromptLookupDrafter, SuffixDrafter

    kw = dict(TRACED_SETTINGS, model=MODEL, max_seq_len=SEQ, max_prompt_tokens=None, max_new_tokens=None,
              default_max_new_tokens=256)
    st = LocalStack([lambda: tiny_layerskip_verifier(max_seq_len=SEQ)], TokenizerCodec(), V,
                    settings=functools.partial(settings, kw),
                    drafters={"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter})
    http = start_http(st.rs, st.address, port=0)
    oa = openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0, timeout=60)
    sdk = Client(st.address, timeout=60)
    yield st, oa, sdk
    oa.close()
    sdk.close()
    http.stop()
    st.close()


def test_max_tokens_over_the_context_is_refused_and_the_default_cut_to_it(stack):
    st, oa, sdk = stack
    assert (st.router.limits.max_seq_len, st.router.limits.max_new_tokens) == (SEQ, None)
    n_prompt = len(TokenizerCodec().encode(PROMPT))
    room = SEQ - n_prompt - 1
    ref = sdk.generate(PROMPT, max_new_tokens=room, temperature=0, strategy="autoregressive")
    dflt = sdk.generate(PROMPT, temperature=0, strategy="autoregressive")  # the default 256: cut to what fits
    assert dflt.token_ids == ref.token_ids and len(dflt.token_ids) == room and dflt.stats.finish_reason == "length"
    with pytest.raises(InvalidArgumentError) as e:
        sdk.generate(PROMPT, max_new_tokens=4096, temperature=0)
    assert e.value.field == "max_new_tokens"
    for part in ("4096", f"at most {room} fit", f"context of {SEQ}", "--max-seq-len", "SPECMESH_MAX_SEQ_LEN"):
        assert part in str(e.value), part
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4096, temperature=0)
    assert e.value.param == "max_tokens" and f"at most {room} fit" in e.value.message
    r = oa.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                              extra_body={"strategy": "external", "drafter": "prompt_lookup"})
    assert r.choices[0].text == ref.text  # greedy: speculation gives the same tokens
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].finish_reason == "length"
    assert len(st.verifier_info().sessions) == 0 and st.drafter_info().sessions == 0  # the refusals left nothing


def test_a_prompt_over_the_limit_names_the_setting_that_raises_it(stack):
    st, oa, sdk = stack
    long = "x" * (SEQ + 20)
    with pytest.raises(InvalidArgumentError) as e:
        sdk.generate(long, max_new_tokens=4)
    assert e.value.field == "prompt"
    for part in (str(SEQ + 20), str(SEQ - 2), "--max-seq-len", "SPECMESH_MAX_SEQ_LEN"):
        assert part in str(e.value), part
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": long},
                                                          {"role": "user", "content": "hi"}], max_tokens=4096)
    assert e.value.param == "messages"
    assert "--max-seq-len" in e.value.message and "SPECMESH_MAX_SEQ_LEN" in e.value.message
    assert len(st.verifier_info().sessions) == 0 and st.drafter_info().sessions == 0  # nothing changed
