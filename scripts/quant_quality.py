#!/usr/bin/env python3
"""What the low-precision engines cost in quality, against the fp32 engine, on the bench prompts.

For each engine (fp32 is the reference; bf16, int8, and int4 with group sizes 32 and 64
by default: SmolLM2's hidden size 576 is no multiple of 128, so int4:128 would run most
of its matrices in int8) on the prompts of the bench workloads:

``int4:G`` is the int4 engine with group size G and its default LM head (tied: the
int4 screen whose top 64 logits per row are recomputed from the bf16 embedding table, on
int8 inputs where our kernel has AVX2); ``int4:G:head8`` puts the head in int8,
``int4:G:head4`` in plain int4, ``int4:G:screen`` / ``int4:G:screen8`` the screen on bf16 /
int8 inputs.

- greedy agreement: plain greedy decoding of ``--max-new-tokens`` tokens; how many
  generations equal fp32's token for token, and the mean common prefix (share of fp32's
  tokens before the first difference);
- teacher-forced top-1 agreement: on fp32's greedy continuation, the share of positions
  where this engine's argmax is fp32's token (one forward over prompt + continuation);
- log-likelihood of the prompt text (human-written: quotes, code, questions, under the
  chat template): mean log-probability per token, perplexity, and the mean KL(fp32 || this)
  of the next-token distributions over the same positions.

Engines are built one at a time (one model in memory besides the reference's outputs).
Deterministic (greedy; no timing). Prints a Markdown table; ``--json`` writes the figures.

    .venv/bin/python scripts/quant_quality.py                      # every workload, 3 prompts, 128 tokens
    .venv/bin/python scripts/quant_quality.py --engines int4:32,int4:64 --prompts 1
"""

from __future__ import annotations

import argparse
import json
import math
import time

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.spin_threads()

import torch
import torch.nn.functional as F

from specmesh.workloads import load
from specmesh.engine import LlamaEngine
from specmesh.loop import generate_tokens
from specmesh.models.loading import load_tokenizer, resolve_model, stop_ids
from specmesh.seqs import common_prefix_len
from specmesh.verifier import EngineVerifier


def _engine(model: str, spec: str, max_seq_len: int) -> LlamaEngine:
    dtype, *opts = spec.split(":")
    kw = {"int4_group": int(opts[0])} if opts else {}
    heads = {"head4": "int4", "head8": "int8", "screen": "screen", "screen8": "screen8"}
    for o in opts[1:]:
        kw["int4_head"] = heads[o]
    return LlamaEngine.from_pretrained(model, dtype=dtype, n_slots=1, max_seq_len=max_seq_len, quiet=True, **kw)


@torch.inference_mode()
def _all_logits(eng: LlamaEngine, ids: list[int]) -> torch.Tensor:
    """log-softmax of every row's logits for ids (one forward)."""
    eng.reset(0)
    out = eng.score(0, ids, list(range(-1, len(ids) - 1)))
    eng.reset(0)
    return F.log_softmax(out.logits.float(), -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engines", default="bf16,int8,int4:32,int4:32:head8,int4:64,int4:32:head4",
                    help="dtype, int4:<group>, int4:<group>:head8 / :head4 / :screen / :screen8 (the LM head "
                         "in int8 / plain int4 / the int4 screen on bf16 / int8 inputs; default: the "
                         "screen, on int8 inputs where our kernel has AVX2); "
                         "fp32 is always the reference")
    ap.add_argument("--workloads", default="", help="comma list (default: all)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default="", help="write the figures here")
    a = ap.parse_args()
    d = resolve_model(a.model)
    tok = load_tokenizer(d)
    stops = stop_ids(tok)
    loads = load([w for w in a.workloads.split(",") if w] or None, a.prompts)
    prompts = []
    for w, ps in loads.items():
        for p in ps:
            msgs = p.messages or [{"role": "user", "content": p.prompt}]
            enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompts.append((w, p.id, list(enc["input_ids"]), p.budget(a.max_new_tokens)))
    max_len = max(len(ids) + n for _, _, ids, n in prompts) + 8
    max_len = -(-max_len // 64) * 64

    def run(spec: str) -> dict:
        t0 = time.time()
        eng = _engine(a.model, spec, max_len)
        ver = EngineVerifier(eng)
        outs = []
        for _, _, ids, n in prompts:
            out, _ = generate_tokens(None, ver, ids, max_new_tokens=n, stop_ids=stops)
            outs.append(out)
        res = {"outputs": outs, "weight_bytes": eng.weight_bytes(), "engine": eng, "build_s": time.time() - t0}
        return res

    ref = run("fp32")
    ref_eng = ref.pop("engine")
    ref_lp = [_all_logits(ref_eng, ids) for _, _, ids, _ in prompts]  # prompt text
    ref_cont = [_all_logits(ref_eng, ids + out) for (_, _, ids, _), out in zip(prompts, ref["outputs"])]
    del ref_eng
    rows = [("fp32", ref["weight_bytes"], len(prompts), 1.0, 1.0, *_ll(ref_lp, ref_lp, prompts))]
    figures = {"model": a.model, "prompts": [f"{w}/{pid}" for w, pid, _, _ in prompts],
               "max_new_tokens": a.max_new_tokens, "engines": {}}
    for spec in a.engines.split(","):
        r = run(spec)
        eng = r.pop("engine")
        same = sum(o == f for o, f in zip(r["outputs"], ref["outputs"]))
        pref = sum(common_prefix_len(o, f) for o, f in zip(r["outputs"], ref["outputs"])) / max(
            1, sum(len(f) for f in ref["outputs"]))
        hit = tot = 0
        for (_, _, ids, _), f, rc in zip(prompts, ref["outputs"], ref_cont):
            lp = _all_logits(eng, ids + f)
            p = len(ids) - 1  # row p predicts the first generated token
            hit += int((lp[p: p + len(f)].argmax(-1) == rc[p: p + len(f)].argmax(-1)).sum())
            tot += len(f)
        lps = [_all_logits(eng, ids) for _, _, ids, _ in prompts]
        rows.append((spec, r["weight_bytes"], same, pref, hit / max(1, tot), *_ll(lps, ref_lp, prompts)))
        del eng
    print(f"\n{a.model}: {len(prompts)} prompts ({', '.join(f'{w} x{len(v)}' for w, v in loads.items())}), "
          f"greedy, {a.max_new_tokens} new tokens; reference fp32\n")
    print("| engine | weights MB | greedy = fp32 | common prefix | teacher-forced top-1 = fp32 | "
          "prompt mean log-p | perplexity | KL(fp32 ‖ engine) nats |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec, wb, same, pref, tf, mlp, kl in rows:
        print(f"| {spec} | {wb / 2**20:.0f} | {same}/{len(prompts)} | {pref:.1%} | {tf:.1%} | {mlp:.4f} | "
              f"{math.exp(-mlp):.3f} | {kl:.4f} |")
        figures["engines"][spec] = {"weight_bytes": wb, "greedy_identical": same, "common_prefix": round(pref, 4),
                                    "teacher_forced_top1": round(tf, 4), "prompt_mean_logp": round(mlp, 5),
                                    "prompt_ppl": round(math.exp(-mlp), 4), "kl_vs_fp32": round(kl, 5)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=2)


def _ll(lps: list[torch.Tensor], ref: list[torch.Tensor], prompts) -> tuple[float, float]:
    """(mean log-prob of each prompt's next token, mean KL(ref || lp)) over all prompt positions."""
    s = kl = 0.0
    n = 0
    for lp, rl, (_, _, ids, _) in zip(lps, ref, prompts):
        nxt = torch.tensor(ids[1:])
        s += float(lp[:-1].gather(1, nxt[:, None]).sum())
        kl += float((rl[:-1].exp() * (rl[:-1] - lp[:-1])).sum())
        n += len(ids) - 1
    return s / n, kl / n


if __name__ == "__main__":
    main()
