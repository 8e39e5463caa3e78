"""``specmesh quality``: what each acceptance rule buys in speed and costs in quality.

For every rule and parameter (``--rules``, e.g. ``exact,lenient:0.5,topk:4``), on the
last ``--prompts`` prompts of each workload (the held-out end of each file), in ONE
process with the systems alternating per prompt:

- speed: tokens/s, τ, and the speedup over plain decoding measured on the same prompt
  in the same run;
- quality against the target: agreement with the target's own greedy output (prefix
  agreement = leading tokens equal / target length, and ROUGE-L F1 over tokens), the
  mean log-likelihood per token of the produced text under the target (temperature 1,
  teacher-forced: how likely the target finds what the rule let through), and, on the
  reasoning workload, whether the final answer (the last number in the text) equals the
  target's;
- divergence decoding (``--divergence`` thresholds): the verifier's domain specialist
  drafts (``specialist`` self drafter) and ``acceptance="divergence"`` accepts while
  JSD(p_specialist, p_target) <= tau; beside it the same specialist drafts under the
  exact rule (``specialist:exact``: its speed without the relaxation). ``--split
  code`` reports every system twice: on the code workloads and on the others;
- contrastive decoding: vanilla CD (one target forward per token, amateur = the
  layer-skip exit from the same forward) and speculative CD with the same drafter,
  side by side: the speedup of speculative over vanilla CD and whether their outputs
  are identical (greedy: they must be).

Writes quality.json, quality.md (table) and quality.png (speedup vs quality, one
point per rule/parameter) into ``--out``. Greedy by default: under greedy decoding
``typical`` is the exact rule (it relaxes sampling only); pass ``--temperature`` to
measure the sampled rules. Wall-clock numbers on a shared machine are noisy: the
quality columns are deterministic, the speed columns are not.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from ...seqs import common_prefix_len
from ...results import write_result
from typing import Optional, Sequence

DEFAULT_RULES = "exact,typical,lenient:0.5,lenient:0.2,lenient:0.05,topk:2,topk:4,topk:8"
PARAM = {"lenient": ("lenience", float), "topk": ("accept_top_k", int), "typical": ("typical_epsilon", float),
         "contrastive": ("cd_beta", float), "divergence": ("jsd_threshold", float)}


def register(subparsers) -> None:
    p = subparsers.add_parser("quality", help="speed vs quality of each acceptance rule against the target, and "
                                              "speculative vs vanilla contrastive decoding, in one run",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--device", default="auto")
    p.add_argument("--drafter", default="block", help="drafter of every speculative system (self drafters: "
                                                      "layerskip, block, block_tree; external: prompt_lookup, ...)")
    p.add_argument("--rules", default=DEFAULT_RULES, help="comma list of rule[:parameter]")
    p.add_argument("--cd", default="0.5", help="contrastive betas to run (vanilla and speculative); '' = none")
    p.add_argument("--cd-alpha", type=float, default=0.1)
    p.add_argument("--divergence", default="", help="divergence thresholds (bits) to run with the specialist "
                                                    "drafting, plus the specialist under the exact rule; '' = none")
    p.add_argument("--split", default="", help="a workload prefix (e.g. code): summarise its workloads and the "
                                               "others separately")
    p.add_argument("--workloads", default="", help="comma list (default: all)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload, from the end of each file")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=6, help="draft budget per round (fixed)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="quality-out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(module="specmesh.cli.bench.quality", func="main")


def parse_rule(spec: str):
    """"lenient:0.5" -> ("lenient:0.5", {"acceptance": "lenient", "lenience": 0.5})."""
    name, _, val = spec.partition(":")
    kw = {"acceptance": name}
    if val:
        field, typ = PARAM[name]
        kw[field] = typ(val)
    return spec, kw


# ---------------------------------------------------------------- quality metrics

def prefix_agreement(out: Sequence[int], ref: Sequence[int]) -> float:
    return common_prefix_len(list(out), list(ref)) / len(ref) if ref else 1.0


def rouge_l(out: Sequence[int], ref: Sequence[int]) -> float:
    """ROUGE-L F1 over token ids (longest common subsequence)."""
    if not out or not ref:
        return float(out == ref)
    prev = [0] * (len(ref) + 1)
    for a in out:
        cur = [0]
        for j, b in enumerate(ref):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(out), lcs / len(ref)
    return 2 * p * r / (p + r)


def mean_loglik(engine, prompt: Sequence[int], out: Sequence[int], slot: int) -> float:
    """Mean log p_target(out[i] | prompt, out[:i]) at temperature 1 (one teacher-forced forward)."""
    import torch

    if not out:
        return 0.0
    engine.reset(slot)
    engine.prefill(slot, list(prompt)[:-1])
    toks = [prompt[-1]] + list(out[:-1])
    logits = engine.score(slot, toks, list(range(-1, len(toks) - 1))).logits
    engine.reset(slot)
    lp = torch.log_softmax(logits.double(), -1)
    return float(lp[torch.arange(len(out)), torch.tensor(list(out))].mean())


_NUM = re.compile(r"-?\d+(?:[.,]\d+)?")


def final_answer(text: str) -> Optional[str]:
    nums = _NUM.findall(text.replace(",", ""))
    return nums[-1] if nums else None


# ---------------------------------------------------------------- the run

def main(args) -> int:
    from tqdm import tqdm

    from ...loop import generate_tokens
    from ...runtime import Runtime
    from ...types import SamplingParams
    from ... import workloads as wl

    rt = Runtime(args.model, dtype=args.dtype, n_slots=4, max_seq_len=2048, quiet=True, device=args.device)
    self_draft = args.drafter if args.drafter in rt.verifier.self_drafters else None
    drafter = None if self_draft else rt.drafter(args.drafter)
    names = [x for x in args.workloads.split(",") if x] or None
    loaded = wl.load(names)
    prompts = [p for recs in loaded.values() for p in recs[-args.prompts:]]
    rules = [parse_rule(s) for s in args.rules.split(",") if s]
    cds = [float(b) for b in args.cd.split(",") if b.strip()]
    base = dict(temperature=args.temperature, seed=args.seed)
    systems = [("plain", None, SamplingParams(**base))]
    systems += [(f"spec:{spec}", True, SamplingParams(**base, **kw)) for spec, kw in rules]
    for b in cds:
        cd = SamplingParams(**base, acceptance="contrastive", cd_beta=b, cd_alpha=args.cd_alpha)
        systems += [(f"cd_vanilla:{b}", None, cd), (f"cd_spec:{b}", True, cd)]
    divs = [float(t) for t in args.divergence.split(",") if t.strip()]
    if divs:  # the specialist drafts in the verifier (self_draft): its own systems
        if "specialist" not in rt.verifier.self_drafters:
            raise SystemExit("--divergence needs the specialist: `specmesh train-specialist --domain code`")
        systems += [("specialist:exact", "specialist", SamplingParams(**base))]
        systems += [(f"divergence:{t:g}", "specialist", SamplingParams(**base, acceptance="divergence",
                                                                        jsd_threshold=t)) for t in divs]
    rec: dict = {name: [] for name, _, _ in systems}
    slot = rt.engine.n_slots - 1  # the log-likelihood forward's scratch slot (sessions are released between runs)
    with tqdm(total=len(prompts) * len(systems), desc="specmesh quality", disable=args.no_progress) as bar:
        for p in prompts:
            ids = rt.encode(p.prompt, p.messages)
            n = p.budget(args.max_new_tokens)
            outs = {}
            for name, spec, sp in systems:
                bar.set_postfix_str(f"{p.id} {name}")
                t0 = time.perf_counter()
                own = spec == "specialist"
                out, st = generate_tokens(drafter if spec and not own else None, rt.verifier, ids, sampling=sp,
                                          max_new_tokens=n, stop_ids=rt.stop_ids, budget=args.budget if spec else 0,
                                          self_draft="specialist" if own else self_draft if spec else None)
                dt = time.perf_counter() - t0
                outs[name] = out
                rec[name].append({"prompt": p.id, "workload": p.workload, "tokens": len(out), "s": dt,
                                  "tau": st.tau, "out": out})
                bar.update(1)
            ref = outs["plain"] if args.temperature == 0 else generate_tokens(
                None, rt.verifier, ids, max_new_tokens=n, stop_ids=rt.stop_ids)[0]
            ref_ans = final_answer(rt.decode(ref)) if p.workload == "reasoning" else None
            for name, _, _ in systems:
                r = rec[name][-1]
                out = r.pop("out")
                r.update(prefix=prefix_agreement(out, ref), rouge_l=rouge_l(out, ref),
                         loglik=mean_loglik(rt.engine, ids, out, slot),
                         plain_s=rec["plain"][-1]["s"], plain_tokens=rec["plain"][-1]["tokens"])
                if name.startswith("cd_spec:"):
                    van = outs["cd_vanilla:" + name.split(":", 1)[1]]
                    r["identical_to_vanilla_cd"] = out == van
                    r["vanilla_s"] = rec["cd_vanilla:" + name.split(":", 1)[1]][-1]["s"]
                    r["vanilla_tokens"] = len(van)
                if ref_ans is not None:
                    r["answer_match"] = final_answer(rt.decode(out)) == ref_ans
    rows = summarise(rec)
    if args.split:
        rows = summarise_split(rec, args.split)
    meta = {"model": args.model, "dtype": args.dtype, "device": str(rt.device), "drafter": args.drafter,
            "budget": args.budget, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "prompts": [p.id for p in prompts], "cd_alpha": args.cd_alpha, "split": args.split}
    result = {"meta": meta, "rows": rows, "records": rec}
    write_result(args.out, "quality", result, report(result), plot)
    return 0


def summarise(rec: dict) -> list[dict]:
    rows = []
    for name, rs in rec.items():
        toks, secs = sum(r["tokens"] for r in rs), sum(r["s"] for r in rs)
        ptoks, psecs = sum(r["plain_tokens"] for r in rs), sum(r["plain_s"] for r in rs)
        row = {"system": name, "tokens_per_s": toks / secs if secs else 0.0,
               "speedup": (toks / secs) / (ptoks / psecs) if secs and psecs and ptoks else 0.0,
               "tau": sum(r["tau"] for r in rs) / len(rs),
               "prefix": sum(r["prefix"] for r in rs) / len(rs), "rouge_l": sum(r["rouge_l"] for r in rs) / len(rs),
               "loglik": sum(r["loglik"] * r["tokens"] for r in rs) / max(toks, 1)}
        am = [r["answer_match"] for r in rs if "answer_match" in r]
        row["answer_match"] = sum(am) / len(am) if am else None
        if name.startswith("cd_spec:"):
            vt, vs = sum(r["vanilla_tokens"] for r in rs), sum(r["vanilla_s"] for r in rs)
            row["speedup_vs_vanilla_cd"] = (toks / secs) / (vt / vs) if secs and vs else 0.0
            row["identical_to_vanilla_cd"] = f"{sum(r['identical_to_vanilla_cd'] for r in rs)}/{len(rs)}"
        rows.append(row)
    return rows


def summarise_split(rec: dict, prefix: str) -> list[dict]:
    """``summarise`` of the workloads starting with ``prefix`` and of the others, each
    row named ``system @prefix`` / ``system @other``."""
    rows = []
    for grp, keep in ((prefix, lambda w: w.startswith(prefix)), ("other", lambda w: not w.startswith(prefix))):
        part = {name: [r for r in rs if keep(r["workload"])] for name, rs in rec.items()}
        if not any(part.values()):
            continue
        for row in summarise(part):
            row["system"] = f"{row['system']} @{grp}"
            rows.append(row)
    return rows


def report(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Acceptance rules: speed vs quality ({m['model']} {m['dtype']} on {m['device']})", "",
             f"Drafter `{m['drafter']}`, budget {m['budget']} (fixed), temperature {m['temperature']}, "
             f"{len(m['prompts'])} prompts x up to {m['max_new_tokens']} tokens; speedup = tokens/s over plain "
             "decoding measured on the same prompts in the same run. Quality is against the target's greedy "
             "output (prefix agreement, ROUGE-L), the target's mean log-likelihood per produced token, and the "
             "reasoning workload's final answer (last number) equal to the target's.", "",
             "| system | tokens/s | speedup | τ | prefix agr. | ROUGE-L | loglik/token | answer = target's | "
             "vs vanilla CD |", "|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        vs = (f"{x['speedup_vs_vanilla_cd']:.2f}x, identical {x['identical_to_vanilla_cd']}"
              if "speedup_vs_vanilla_cd" in x else "")
        am = "-" if x["answer_match"] is None else f"{x['answer_match']:.2f}"
        lines.append(f"| {x['system']} | {x['tokens_per_s']:.1f} | {x['speedup']:.2f}x | {x['tau']:.2f} | "
                     f"{x['prefix']:.3f} | {x['rouge_l']:.3f} | {x['loglik']:.3f} | {am} | {vs} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for x in r["rows"]:
        for a, key, lab in ((ax[0], "rouge_l", "ROUGE-L vs target greedy"),
                            (ax[1], "loglik", "target log-likelihood per token")):
            a.scatter(x["speedup"], x[key], s=30)
            a.annotate(x["system"], (x["speedup"], x[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
            a.set(xlabel="speedup over plain decoding (same run)", ylabel=lab)
    for a in ax:
        a.axvline(1.0, color="grey", lw=0.5)
    m = r["meta"]
    fig.suptitle(f"speed vs quality per rule: {m['model']} {m['dtype']}, drafter {m['drafter']}, "
                 f"T={m['temperature']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
