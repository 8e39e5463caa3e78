"""The added token ids read from a model's tokenizer files without building the tokenizer
(models.loading.added_token_ids: what a draft LM's kept head rows are chosen by) are the
tokenizer's own."""

import json

from specmesh.models.loading import added_token_ids, load_tokenizer, resolve_model


def test_the_same_ids_as_the_built_tokenizer():
    d = resolve_model("smollm2-135m-instruct", quiet=True)
    assert added_token_ids(d) == sorted(load_tokenizer(d).added_tokens_decoder)


def test_a_list_past_the_first_reads_and_the_config_decoder(tmp_path):
    tok = {"version": "1.0", "truncation": None, "padding": {"blob": "x" * 200_000},  # the list past 3 reads
           "added_tokens": [{"id": 7, "content": "<a>", "special": True}, {"id": 3, "content": "ü", "special": False}],
           "model": {"type": "BPE", "vocab": {}, "merges": []}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    assert added_token_ids(tmp_path) == [3, 7]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"11": {"content": "<b>"}}}))
    assert added_token_ids(tmp_path) == [3, 7, 11]


def test_no_list_no_ids(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {}}}), encoding="utf-8")
    assert added_token_ids(tmp_path) == []
