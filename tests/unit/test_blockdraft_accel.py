"""The accelerator recipe's pieces, on CPU and tiny models: the batched drafter
forward equals the per-sequence one, packed batches hold the right targets,
padded batched greedy generation equals one-prompt generation, HF hidden-state
features equal the engine's, batched training learns, and the exact GGUF loader
reproduces the converted cache (real model, slow)."""

from __future__ import annotations

import random

import pytest
import torch

from specmesh.blockdraft import accel
from specmesh.blockdraft.data import target_features
from specmesh.blockdraft.losses import IGNORE
from specmesh.blockdraft.model import BlockDrafter, BlockDrafterConfig
from specmesh.blockdraft.train import new_model
from tests.support import tiny_engine


def _drafter(model, block=4, fuse_last=True, seed=0):
    torch.manual_seed(seed)
    cfg = BlockDrafterConfig(block=block, n_layers=2, hidden=64, n_heads=4, ffn=96, feature_layers=[0, 2],
                             context_window=6, vocab_size=96, n_keep=80, fuse_last=fuse_last)
    return new_model(cfg, model.state_dict(), torch.arange(3, 83))


def test_block_mask_batch_equals_per_sequence_masks():
    anchors = torch.tensor([[2, 5, 9], [4, 4, 11]])
    got = BlockDrafter.block_mask_batch(anchors, 3, n_ctx=12, window=6)
    for s in range(2):
        want = BlockDrafter.block_mask(anchors[s].tolist(), 3, 12, ctx_start=0, window=6)
        assert torch.equal(got[s], want)


@pytest.mark.parametrize("fuse_last", [False, True])
def test_forward_batch_equals_per_sequence_forward(fuse_last):
    _, model = tiny_engine()
    d = _drafter(model, fuse_last=fuse_last).eval()
    anchors = torch.tensor([[3, 7], [1, 9]])
    feats = torch.randn(2, 12, 128)
    toks = torch.tensor([[11, 12], [40, 41]])
    mask = BlockDrafter.block_mask_batch(anchors, 4, 12, window=6)
    with torch.no_grad():
        batched = d.forward_batch(toks, feats, mask)
        for s in range(2):
            one = d(toks[s], feats[s], BlockDrafter.block_mask(anchors[s].tolist(), 4, 12, window=6))
            torch.testing.assert_close(batched[s], one, rtol=1e-5, atol=1e-5)
    assert batched.shape == (2, 2, 3, 80)


def test_packed_batches_hold_the_right_targets():
    _, model = tiny_engine()
    d = _drafter(model, block=4)
    rng = random.Random(0)
    recs = [{"prompt_ids": [rng.randrange(96) for _ in range(rng.randrange(1, 5))],
             "response_ids": [rng.randrange(96) for _ in range(rng.randrange(2, 9))]} for _ in range(6)]
    feats = [torch.randn(len(r["prompt_ids"]) + len(r["response_ids"]), 128).to(torch.bfloat16) for r in recs]
    data = accel.Packed(recs, feats, "cpu")
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        anchor_tok, f, mask, tgt = data.batch(d, 8, 5, gen)
        assert mask.shape == (8, 20, f.shape[1] + 20) and tgt.shape == (40, 3)
        for s in range(8):
            vis = mask[s, ::4, : f.shape[1]]
            # identify the sequence by its features, then check anchors and targets against it
            i = next(i for i in range(6) if f[s, : feats[i].shape[0]].equal(feats[i])
                     and not f[s, feats[i].shape[0]:].any())
            toks = recs[i]["prompt_ids"] + recs[i]["response_ids"]
            for j in range(5):
                a = int(vis[j].sum())  # a block sees exactly the positions before its anchor (window 6)
                a = a if a < 6 else int(vis[j].nonzero().max()) + 1
                assert len(recs[i]["prompt_ids"]) <= a <= len(toks) - 2
                assert int(anchor_tok[s, j]) == toks[a]
                for k in range(3):
                    t = tgt[s * 5 + j, k]
                    if a + 1 + k >= len(toks) or not 3 <= toks[a + 1 + k] < 83:
                        assert t == IGNORE
                    else:
                        assert t == toks[a + 1 + k] - 3


def test_batched_training_learns_a_copy_task():
    _, model = tiny_engine()
    d = _drafter(model, block=3)
    recs, feats = [], []
    for i in range(16):
        pat = [random.Random(i).randrange(10, 80) for _ in range(4)]
        recs.append({"prompt_ids": pat, "response_ids": pat * 5})
        feats.append(torch.randn(24, 128).to(torch.bfloat16))
    data = accel.Packed(recs, feats, "cpu")
    steps, curves = accel.train_batched({"ce": d}, data, steps=80, deadline=float("inf"), S=8, A=8, lr=3e-3,
                                        gamma=4.0, seed=0)
    assert steps == 80 and curves["ce"][-1] < 0.5 * curves["ce"][0]


def test_served_drafter_context_cache_matches_a_fresh_pass():
    from specmesh.blockdraft.serve import BlockSelfDrafter
    from specmesh.types import DraftContext
    from specmesh.verifier import EngineVerifier

    eng, model = tiny_engine(n_slots=2)
    ver = EngineVerifier(eng)
    cached = BlockSelfDrafter(ver, _drafter(model), amp=False)
    fresh = BlockSelfDrafter(ver, cached.model, amp=False)
    seq = [random.Random(3).randrange(96) for _ in range(20)]

    def check(sid, n):
        fresh._ctx.clear()
        ctx = DraftContext(sid, seq[: n + 1], 2)
        torch.testing.assert_close(cached.slot_logits(ctx), fresh.slot_logits(ctx), rtol=1e-5, atol=1e-5)

    ver.prefill("a", seq[:5])
    check("a", 5)
    ver._append(ver.slot_of("a"), seq[5:9])  # grows: only the new positions are computed
    check("a", 9)
    eng.truncate(ver.slot_of("a"), 6)  # shrinks, then grows with other tokens: the stale rows are not reused
    ver._append(ver.slot_of("a"), [7, 8, 9, 10])
    seq[6:10] = [7, 8, 9, 10]
    check("a", 10)  # context window 6: the window slides as well
    ver.release("a")
    ver.prefill("b", seq[:4])  # a new session in the same slot
    check("b", 4)


@pytest.mark.parametrize("args,flag", [(["--phases", "0.5,0.2,0.7,0.9"], "--phases"),
                                       (["--phases", "a,b"], "--phases"),
                                       (["--expand-block", "12"], "--expand-block"),
                                       (["--init", "no/such/dir"], "--init"),
                                       (["--extra-train", "no/such.jsonl"], "--extra-train"),
                                       (["--losses", "ce,nope"], "--losses")])
def test_accel_bad_arguments_are_named_and_change_nothing(tmp_path, capsys, args, flag):
    from specmesh.cli import main

    out = tmp_path / "out"
    assert main(["accel-drafter", "--out", str(out), *args]) == 2
    assert flag in capsys.readouterr().err and not out.exists()


class _Tok:
    """The few tokenizer attributes the generation helpers read (ids only)."""
    eos_token_id = 2
    pad_token_id = 0
    unk_token_id = None

    def convert_tokens_to_ids(self, t):
        return None


def test_padded_batched_greedy_equals_one_prompt_generation():
    _, model = tiny_engine()
    prompts = [[5, 9, 13], [7, 1, 30, 31, 44, 8], [60]]
    got = accel.greedy_responses(model, _Tok(), prompts, batch=3, max_new_tokens=10, deadline=float("inf"),
                                 device="cpu")
    for p, g in zip(prompts, got):
        ids = torch.tensor([p])
        one = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                             eos_token_id=[2], pad_token_id=0)[0, len(p):].tolist()
        assert g == accel._cut(one, {2})[0]


def test_hf_hidden_state_features_equal_the_engines():
    eng, model = tiny_engine(n_slots=1)
    recs = [{"prompt_ids": [5, 9, 13], "response_ids": [7, 8, 9, 10]}, {"prompt_ids": [3], "response_ids": [4, 5]}]
    got = accel.features_of(model, recs, [0, 2], "cpu")
    for r, g in zip(recs, got):
        want = target_features(eng, r["prompt_ids"] + r["response_ids"], [0, 2])
        torch.testing.assert_close(g.float(), want.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
    assert accel.features_of(model, recs, [0, 2], "cpu", deadline=0.0) == [None, None]  # budget spent: none


@pytest.mark.slow
def test_gguf_loader_reproduces_the_models_weights():
    """The bare-machine loader (gguf-py's numpy dequantisation) gives the values the engine's
    GGUF weights give (its block kernels' dequantisation), tensor for tensor."""
    from specmesh.models.gguf_state import gguf_llama_state_dict
    from specmesh.models.loading import ALIASES, _package_dir, resolve_model, weights

    ref = weights(resolve_model("smollm2-135m-instruct", quiet=True))
    got = gguf_llama_state_dict(_package_dir(ALIASES["smollm2-135m-instruct"]), 9, 3)
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k].float()), k


@pytest.mark.slow
def test_accel_recipe_end_to_end_on_cpu(tmp_path):
    """The whole accel-drafter run at toy scale on the real target: synthesised
    instructions, greedy answers, features, a few steps continuing the bundled
    checkpoint at a larger block, held-out τ and the saved outputs."""
    import json
    import lzma

    from specmesh.cli import main

    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"id": "w", "prompt": "Write two sentences about rain."}) + "\n")
    rc = main(["accel-drafter", "--out", str(tmp_path / "out"), "--device", "cpu", "--seconds", "60",
               "--instructions", "2", "--gen-batch", "2", "--max-new-tokens", "8", "--steps", "2", "--seqs", "2",
               "--anchors", "2", "--heldout-prompts", str(held), "--init", "checkpoints/smollm2-block-drafter",
               "--expand-block", "10", "--losses", "dpace", "--phases", "0.5,0.9,0.95,0.99"])
    assert rc == 0
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["data"]["heldout_records"] == 1 and m["train"]["steps"] >= 1
    assert "held" in m["heldout"]["dpace"]
    recs = [json.loads(x) for x in lzma.open(tmp_path / "out" / "records.jsonl.xz", "rt")]
    assert all(r["instruction"] and r["response_ids"] for r in recs)
    cfg = json.loads((tmp_path / "out" / "drafter-dpace" / "config.json").read_text())
    assert cfg["block"] == 10
