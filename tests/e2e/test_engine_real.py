"""The real SmolLM2-135M-Instruct outside the shared runtime of test_identity_real.py
(its own file so the test processes share the long real-model checks evenly): the
demo command end to end, and the batch-invariant engine's row bits on the machine
the tests run on."""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.slow


def test_demo_command_runs_every_default_drafter_identically(capsys):
    """`make demo` = `specmesh demo`: every default drafter on the built-in prompts gives
    plain decoding's tokens (fp32), and the table is printed."""
    from specmesh.cli import build_parser, main

    assert main(["demo", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    drafters = build_parser().parse_args(["demo"]).drafters.split(",")
    assert "block_tree" in drafters
    assert "DIFFERENT" not in out
    for name in drafters:  # one result line per built-in prompt (a timing WARNING line may name it too)
        assert len(re.findall(rf": {name} [0-9.]+ tok/s", out)) == 3, name
    assert out.count(", identical") == 3 * len(drafters)
    assert "peak RSS" in out
    last = out.rstrip("\n").splitlines()[-2:]  # what tau and speedup mean, and what to try next
    assert last[0].startswith("tau: ") and last[1].startswith("Next: ") and "specmesh serve" in last[1]


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_rows_bitwise_invariant_on_this_machine(dtype):
    """The batch-invariant engine on the real model's shapes, on the machine the tests run
    on: a row of a chain has the same bits as the same token scored alone (at every layer
    and in its logits), for chains that cross a key block (61 + 9 keys: 64; 250 + 9:
    256). Kernel classes differ between CPUs (an AVX2-only CPU broke the old attention
    tiles, and gave a query other bits with 320 padded keys than with 256, unseen on
    the tiny models): this is the check that would say so."""
    from specmesh.engine import LlamaEngine

    e = LlamaEngine.from_pretrained("smollm2-135m-instruct", dtype=dtype, n_slots=2, max_seq_len=512, quiet=True)
    layers = list(range(e.n_layers))
    chain = [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008]
    for n_prompt in (61, 250):
        prompt = [300 + (i * 37) % 4000 for i in range(n_prompt)]
        for slot in (0, 1):
            e.reset(slot)
            e.prefill(slot, prompt)
        whole = e.score(0, chain, list(range(-1, len(chain) - 1)), hidden_layers=layers)
        for j, t in enumerate(chain):
            r = e.score(1, [t], [-1], hidden_layers=layers)
            e.commit(1, [0])
            assert torch.equal(r.logits[0], whole.logits[j]), (dtype, n_prompt, j)
            assert all(torch.equal(r.hidden[li][0], whole.hidden[li][j]) for li in layers), (dtype, n_prompt, j)
