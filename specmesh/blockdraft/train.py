"""Training and held-out evaluation of the block drafter.

``prepare`` turns distillation records into training examples (token ids +
target hidden-state features, computed once with a progress bar). ``train``
samples random anchors in the response part of each sequence and optimises the
selected loss (losses.LOSSES); ``--expand-block`` continues a block-B checkpoint
at B' > B with a linear curriculum that phases the new slots in. ``evaluate``
reports, on held-out sequences, per-slot conditional accuracy (slot k correct
given slots < k were), the accepted-length histogram of greedy chain
verification (its last bin is the ceiling bin) and the expected τ.

Knows nothing about serving or gRPC.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from .data import target_features
from .losses import IGNORE, LOSSES, loss_kwargs
from .model import BlockDrafter, BlockDrafterConfig, expected_tau


@dataclass
class Example:
    tokens: torch.Tensor  # [T] long: prompt + response
    prompt_len: int
    features: torch.Tensor  # [T, F] bfloat16
    kind: str = ""  # the prompt's kind (code, chat, summarise, reasoning): held-out τ is reported per kind


def usable(record: dict, max_len: int) -> bool:
    """Records that become examples: a response of 2+ tokens, prompt + response <= max_len."""
    return len(record["response_ids"]) >= 2 and len(record["prompt_ids"]) + len(record["response_ids"]) <= max_len


def keep_ids_from(records: list[dict], n_keep: int, vocab: int) -> torch.Tensor:
    """The n_keep most frequent token ids of the responses (then prompts) in ``records``."""
    c = Counter()
    for r in records:
        c.update(r["response_ids"])
    ids = [t for t, _ in c.most_common(n_keep)]
    if len(ids) < n_keep:
        p = Counter()
        for r in records:
            p.update(r["prompt_ids"])
        seen = set(ids)
        ids += [t for t, _ in p.most_common() if t not in seen][: n_keep - len(ids)]
    if len(ids) < n_keep:
        seen = set(ids)
        ids += [t for t in range(vocab) if t not in seen][: n_keep - len(ids)]
    return torch.tensor(sorted(ids), dtype=torch.long)


def prepare(engine, records: list[dict], layers: list[int], desc: str = "target features",
            quiet: bool = False) -> list[Example]:
    out = []
    for r in tqdm(records, desc=desc, disable=quiet, file=sys.stderr):
        if not usable(r, engine.max_seq_len):
            continue
        toks = r["prompt_ids"] + r["response_ids"]
        feats = target_features(engine, toks, layers)
        out.append(Example(torch.tensor(toks), len(r["prompt_ids"]), feats.to(torch.bfloat16), r.get("kind", "")))
    return out


def block_batch(model: BlockDrafter, ex: Example, anchors: list[int]):
    """Logits [A, B-1, N] and kept-vocabulary targets [A, B-1] for the anchors of one example."""
    cfg = model.cfg
    B, W = cfg.block, cfg.context_window
    c0 = max(0, min(anchors) - W)
    c1 = max(anchors)
    feats = ex.features[c0:c1].float()
    dev = ex.tokens.device
    mask = BlockDrafter.block_mask(anchors, B, c1 - c0, ctx_start=c0, window=W).to(dev)
    logits = model(ex.tokens[anchors], feats, mask)
    T = ex.tokens.shape[0]
    idx = torch.tensor(anchors, device=dev)[:, None] + torch.arange(1, B, device=dev)[None]  # [A, B-1]
    return logits, kept_targets(model, ex.tokens[idx.clamp_max(T - 1)], idx < T)


def kept_targets(model: BlockDrafter, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Vocabulary ids -> indices into the drafter's kept head; IGNORE where ``valid`` is
    False (past the sequence end) or the token is outside the kept slice."""
    tgt = model.vocab_to_keep[tokens]
    return torch.where(valid & (tgt >= 0), tgt, torch.full_like(tgt, IGNORE))


def _anchors(ex: Example, n: int, rng: random.Random) -> list[int]:
    lo, hi = ex.prompt_len, ex.tokens.shape[0] - 2
    if hi < lo:
        return []
    return sorted(rng.sample(range(lo, hi + 1), min(n, hi - lo + 1)))


def train(model: BlockDrafter, examples: list[Example], steps: int, loss: str = "ce", lr: float = 1e-3,
          batch: int = 4, anchors_per_seq: int = 16, gamma: float = 4.0, seed: int = 0,
          curriculum_from: Optional[int] = None, log=None, quiet: bool = False, amp: bool = False,
          max_minutes: Optional[float] = None, emphasis: float = 0.0) -> list[float]:
    """Optimise ``loss`` for ``steps`` steps; returns the loss curve. ``curriculum_from``:
    slots >= this index (0-based drafted slot) are phased in linearly over the first half;
    ``emphasis`` (DBloom: the new slots of an expanded block emphasised) adds that weight
    times the loss of those slots alone.
    ``amp``: bf16 autocast (fp32 master weights; AMX/AVX-512 CPUs run its matmuls ~4x
    faster). ``max_minutes``: stop early at this wall-clock budget (the schedule still
    assumes ``steps``)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    fn = LOSSES[loss]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)) * max(0.05, 1 - s / steps))
    model.train()
    curve = []
    bar = tqdm(range(steps), desc=f"train-drafter ({loss})", disable=quiet, file=sys.stderr)
    t_start = time.time()
    for step in bar:
        if max_minutes is not None and time.time() - t_start > 60 * max_minutes:
            bar.write(f"stopping at step {step}: --max-minutes {max_minutes} reached")
            break
        total = 0.0
        opt.zero_grad()
        for ex in rng.sample(examples, min(batch, len(examples))):
            anchors = _anchors(ex, anchors_per_seq, rng)
            if not anchors:
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                logits, tgt = block_batch(model, ex, anchors)
            if curriculum_from is not None:
                frac = min(1.0, step / max(1, steps // 2))
                drop = torch.rand(tgt.shape[0], generator=None) >= frac
                tgt[:, curriculum_from:][drop] = IGNORE
            val = fn(logits, tgt, **loss_kwargs(loss, gamma=gamma))
            if emphasis and curriculum_from is not None and bool((tgt[:, curriculum_from:] != IGNORE).any()):
                val = val + emphasis * fn(logits[:, curriculum_from:], tgt[:, curriculum_from:],
                                          **loss_kwargs(loss, gamma=gamma))
            val = val / batch
            val.backward()
            total += float(val.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        curve.append(total)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(curve[-20:]) / len(curve[-20:]):.3f}")
        if log is not None and step % 50 == 0:
            log(json.dumps({"step": step, "loss": total, "time": time.time()}))
    model.eval()
    return curve


@torch.no_grad()
def evaluate_by_kind(model: BlockDrafter, examples: list[Example], **kw) -> dict:
    """``evaluate`` separately for each prompt kind: {kind: {tau_measured, slot_accuracy, rounds}}.
    Templated kinds (summaries that quote their passage) can reach a high τ that open
    text does not; the overall figure alone hides that."""
    kinds = sorted({e.kind for e in examples})
    out = {}
    for k in kinds:
        ev = evaluate(model, [e for e in examples if e.kind == k], **kw)
        out[k or "?"] = {"tau_measured": ev["tau_measured"], "tau_expected": ev["tau_expected"],
                         "slot_accuracy": ev["slot_accuracy"], "rounds": ev["rounds"]}
    return out


def evaluate(model: BlockDrafter, examples: list[Example], anchors_per_seq: int = 32, seed: int = 1,
             amp: bool = False) -> dict:
    """Held-out greedy-chain metrics: per-slot conditional accuracy, accepted-length
    histogram (bins 0..B-1; the last is the ceiling bin), expected and measured τ."""
    rng = random.Random(seed)
    K = model.cfg.block - 1
    hist = [0] * (K + 1)
    reached = [0] * K
    correct = [0] * K
    for ex in examples:
        anchors = _anchors(ex, anchors_per_seq, rng)
        if not anchors:
            continue
        with torch.autocast(ex.tokens.device.type, dtype=torch.bfloat16, enabled=amp):
            logits, tgt = block_batch(model, ex, anchors)
        pred = logits.argmax(-1)
        for a in range(len(anchors)):
            n = 0
            while n < K and tgt[a, n] != IGNORE and pred[a, n] == tgt[a, n]:
                n += 1
            # rounds that run past the sequence end only count the slots that exist
            hist[n] += 1
            for k in range(min(n + 1, K)):
                if tgt[a, k] == IGNORE:
                    break
                reached[k] += 1
                correct[k] += int(k < n)
    slot_acc = [c / r if r else 0.0 for c, r in zip(correct, reached)]
    rounds = sum(hist)
    return {
        "slot_accuracy": slot_acc,
        "accept_hist": hist,
        "ceiling_fraction": hist[-1] / rounds if rounds else 0.0,
        "tau_expected": expected_tau(slot_acc),
        "tau_measured": 1 + sum(i * h for i, h in enumerate(hist)) / rounds if rounds else 0.0,
        "rounds": rounds,
    }


def new_model(cfg: BlockDrafterConfig, target_sd: dict, keep_ids: torch.Tensor) -> BlockDrafter:
    tsd = {k.removeprefix("model."): v for k, v in target_sd.items()}
    embed = tsd["embed_tokens.weight"]
    model = BlockDrafter(cfg, embed, tsd.get("lm_head.weight", embed), tsd["norm.weight"], keep_ids)
    return model


def expand_block(model: BlockDrafter, new_block: int, target_sd: dict, init: str = "extrapolate") -> BlockDrafter:
    """A block-B' copy of ``model`` (B' > B): same weights; the position embeddings of the
    new slots j = 1..B'-B are ``pos[B-1] + j (pos[B-1] - pos[B-2])`` (``init="extrapolate"``)
    or copies of the last trained slot's (``"copy"``). Copies make the new slots' inputs
    identical to the last slot's, so the block's (non-causal) layers give them identical
    outputs until the copies drift apart, which a fine-tune's small learning rate barely
    does (measured: docs/block-drafter.md, "DBloom")."""
    from dataclasses import replace

    if init not in ("extrapolate", "copy"):
        raise ValueError(f"expand_block: init must be 'extrapolate' or 'copy', not {init!r}")
    cfg = replace(model.cfg, block=new_block)
    bigger = new_model(cfg, target_sd, model.keep_ids)
    sd = model.state_dict()
    pos = sd.pop("pos_emb")
    j = torch.arange(1, new_block - pos.shape[0] + 1, dtype=pos.dtype)[:, None]
    step = pos[-1] - pos[-2] if init == "extrapolate" and pos.shape[0] >= 2 else torch.zeros_like(pos[-1])
    sd["pos_emb"] = torch.cat([pos, pos[-1] + j * step], 0)
    bigger.load_state_dict(sd, strict=True)
    return bigger
