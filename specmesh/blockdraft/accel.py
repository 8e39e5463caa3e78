"""The block drafter's whole recipe on one accelerator, in a wall-clock budget.

On 2 CPU cores the drafter sees ~0.3M tokens of templated data and a few thousand
small steps; its first slot on open text then barely beats a bigram guess. This
module runs the same recipe at accelerator scale, phase by phase, each with its
own share of the budget:

1. **instructions** synthesised by the target itself (Magpie-style: the chat
   template up to the user turn, sampled at temperature 1, optionally started
   with a seed word), filtered and de-duplicated: far more varied than templates;
2. **responses**: the target's greedy answers to them, batched through Hugging
   Face ``generate`` (left padding), stop token stripped as ``distill-data`` does;
3. **features** of every sequence (the residual stream after the chosen decoder
   layers, as the engine returns them), kept on the device in bf16;
4. **training**: many sequences per step through ``BlockDrafter.forward_batch``,
   one drafter per loss on the same batches (so their held-out τ compare);
5. **evaluation** with ``train.evaluate_by_kind`` on held-out records (the
   project's held-out prompts and any extra sets) — the same metric as the CPU path.

It also runs on CPU at toy scale (the tests do). Outputs: checkpoints
(``save_block_drafter``), ``metrics.json``, ``records.jsonl.xz`` (the synthesised
data, reusable by ``train-drafter --data``) and a log. ``run(args)`` is ``specmesh
accel-drafter`` (its flags: ``specmesh.cli.blockdraft``). Knows nothing about
serving or gRPC.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..models.loading import stop_ids
from ..types import InvalidArgument
from .losses import LOSSES, loss_kwargs
from .model import BlockDrafter, BlockDrafterConfig, load_block_drafter, save_block_drafter
from .train import Example, evaluate_by_kind, expand_block, keep_ids_from, kept_targets, new_model, usable

SEED_WORDS = ["", "", "", "", "Write", "How", "What", "Explain", "Can you", "Tell me", "Give me", "I",
              "Please", "Why", "Summarize", "Create", "Describe", "List", "Help me", "Compose", "Plan",
              "Imagine", "Suggest", "Compare", "Draft", "My", "Is it", "Could you", "In Python,", "Which"]


class Budget:
    """Wall-clock deadlines of the phases, as fractions of the total."""

    def __init__(self, seconds: float):
        self.t0 = time.time()
        self.total = seconds

    def until(self, frac: float) -> float:
        return self.t0 + frac * self.total

    def elapsed(self) -> float:
        return time.time() - self.t0


def log(msg: str, fh=None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, file=sys.stderr, flush=True)
    if fh is not None:
        fh.write(line + "\n")
        fh.flush()


# ------------------------------------------------------------------ target
def load_target(model_dir: Path, gguf: Optional[Path], device: str):
    """(HF causal LM in fp32 on ``device``, tokenizer). ``model_dir`` holds config and
    tokenizer files (and the weights when ``gguf`` is None)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..models.loading import hf_model

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if gguf is None:
        model = hf_model(model_dir, torch.float32)
    else:
        from ..models.gguf_state import gguf_llama_state_dict

        cfg = AutoConfig.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        sd = gguf_llama_state_dict(gguf, cfg.num_attention_heads, cfg.num_key_value_heads)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"GGUF weights do not fit: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    return model.to(device).eval(), tok


def _pad_left(seqs: list[list[int]], pad: int, device: str):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s)
        att[i, L - len(s):] = 1
    return ids.to(device), att.to(device)


def _cut(ids: list[int], stops: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i], True
    return ids, False


@torch.inference_mode()
def synthesize_instructions(model, tok, n: int, batch: int, deadline: float, device: str,
                            max_new_tokens: int = 80, seed: int = 0, fh=None) -> list[str]:
    """Up to ``n`` distinct user instructions sampled from the target's own user-turn
    distribution (chat template up to the user content, then sampling)."""
    marker = "\x00MARK\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix = text[: text.index(marker)]
    stops = set(stop_ids(tok))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seen: set[str] = set()
    out: list[str] = []
    rounds = 0
    while len(out) < n and time.time() < deadline:
        word = rng.choice(SEED_WORDS)
        start = tok.encode(prefix + word, add_special_tokens=False)
        ids = torch.tensor([start] * batch, device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_p=0.95, max_new_tokens=max_new_tokens, eos_token_id=sorted(stops),
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        for row in gen[:, ids.shape[1]:].tolist():
            body, ended = _cut(row, stops)
            if not ended:
                continue
            s = (word + tok.decode(body, skip_special_tokens=True)).strip()
            key = " ".join(s.lower().split())
            if 15 <= len(s) <= 500 and key not in seen:
                seen.add(key)
                out.append(s)
        rounds += 1
        if rounds % 5 == 0:
            log(f"instructions: {len(out)} distinct after {rounds} batches", fh)
    return out[:n]


@torch.inference_mode()
def greedy_responses(model, tok, prompts: list[list[int]], batch: int, max_new_tokens: int,
                     deadline: float, device: str, fh=None) -> list[Optional[list[int]]]:
    """The target's greedy response ids (stop token stripped) per prompt, shortest
    prompts first; None for prompts not reached before ``deadline``."""
    stops = set(stop_ids(tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    res: list[Optional[list[int]]] = [None] * len(prompts)
    done = 0
    for b in range(0, len(order), batch):
        if time.time() > deadline:
            break
        idx = order[b: b + batch]
        ids, att = _pad_left([prompts[i] for i in idx], pad, device)
        gen = model.generate(ids, attention_mask=att, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=sorted(stops), pad_token_id=pad)
        for i, row in zip(idx, gen[:, ids.shape[1]:].tolist()):
            res[i] = _cut(row, stops)[0]
        done += len(idx)
        log(f"responses: {done}/{len(prompts)}", fh)
    return res


# ------------------------------------------------------------------ features
@torch.inference_mode()
def features_of(model, records: list[dict], layers: list[int], device: str, batch: int = 32,
                deadline: float = float("inf")) -> list[Optional[torch.Tensor]]:
    """Per record: [T, len(layers) * H] bf16 hidden states of prompt + response: the
    residual stream after decoder layer ``l`` (what the engine returns), read by forward
    hooks (HF's ``hidden_states`` tuple ends with the final norm applied instead).
    Shortest sequences first; None for those not reached before ``deadline``."""
    seqs = [r["prompt_ids"] + r["response_ids"] for r in records]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[Optional[torch.Tensor]] = [None] * len(seqs)
    got: dict[int, torch.Tensor] = {}

    def hook(li):
        def fn(_mod, _inp, res):
            got[li] = res[0] if isinstance(res, tuple) else res
        return fn

    handles = [model.model.layers[li].register_forward_hook(hook(li)) for li in layers]
    try:
        for b in range(0, len(order), batch):
            if time.time() > deadline:
                break
            idx = order[b: b + batch]
            L = max(len(seqs[i]) for i in idx)
            ids = torch.zeros((len(idx), L), dtype=torch.long)
            att = torch.zeros((len(idx), L), dtype=torch.long)
            for j, i in enumerate(idx):  # right padding: causal attention keeps real positions exact
                ids[j, : len(seqs[i])] = torch.tensor(seqs[i])
                att[j, : len(seqs[i])] = 1
            got.clear()
            model.model(input_ids=ids.to(device), attention_mask=att.to(device))
            f = torch.cat([got[li] for li in layers], -1).to(torch.bfloat16)
            for j, i in enumerate(idx):
                out[i] = f[j, : len(seqs[i])].clone()
    finally:
        for h in handles:
            h.remove()
    return out


class Packed:
    """Training sequences packed on the device: tokens, features, offsets."""

    def __init__(self, records: list[dict], feats: list[torch.Tensor], device: str):
        self.lens = torch.tensor([f.shape[0] for f in feats], device=device)
        self.plens = torch.tensor([len(r["prompt_ids"]) for r in records], device=device)
        self.starts = torch.cumsum(self.lens, 0) - self.lens
        self.tokens = torch.tensor([t for r in records for t in r["prompt_ids"] + r["response_ids"]], device=device)
        self.feats = torch.cat(feats, 0)
        # anchors are response positions p with p + 1 < T: weight sequences by how many they have
        self.weights = (self.lens - 1 - self.plens).clamp_min(0).float()

    def __len__(self) -> int:
        return int(self.lens.shape[0])

    def batch(self, model: BlockDrafter, S: int, A: int, gen: torch.Generator):
        """A batch of S sequences with A anchors each: (anchor tokens [S, A], features
        [S, L, F], mask, kept-vocabulary targets [S*A, B-1])."""
        cfg = model.cfg
        B, dev = cfg.block, self.tokens.device
        seq = torch.multinomial(self.weights, S, replacement=True, generator=gen)
        lens, plens, starts = self.lens[seq], self.plens[seq], self.starts[seq]
        L = int(lens.max())
        pos = torch.arange(L, device=dev)
        flat = (starts[:, None] + pos[None]).clamp_max(self.tokens.shape[0] - 1)
        inside = pos[None] < lens[:, None]
        toks = torch.where(inside, self.tokens[flat], 0)
        feats = self.feats[flat] * inside[..., None]
        span = (lens - 1 - plens).clamp_min(1)
        u = torch.rand((S, A), device=dev, generator=gen)
        anchors = plens[:, None] + (u * span[:, None]).long().clamp_max(span[:, None] - 1)  # [S, A]
        mask = BlockDrafter.block_mask_batch(anchors, B, L, window=cfg.context_window)
        idx = anchors[..., None] + torch.arange(1, B, device=dev)  # [S, A, B-1]
        valid = idx < lens[:, None, None]
        tgt = kept_targets(model, torch.gather(toks, 1, idx.clamp_max(L - 1).view(S, -1)).view(S, A, B - 1), valid)
        return torch.gather(toks, 1, anchors), feats, mask, tgt.view(S * A, B - 1)


def train_batched(models: dict[str, BlockDrafter], data: Packed, steps: int, deadline: float, S: int, A: int,
                  lr: float, gamma: float, seed: int, fh=None, log_every: int = 100) -> tuple[int, dict[str, list[float]]]:
    """One drafter per loss, trained on the same batches until ``steps`` or ``deadline``;
    returns (steps done, loss every 10th step per drafter)."""
    gen = torch.Generator(device=data.tokens.device)
    gen.manual_seed(seed)
    dev_type = data.tokens.device.type
    opts = {}
    for name, m in models.items():
        params = [p for p in m.parameters() if p.requires_grad]
        opts[name] = (params, torch.optim.AdamW(params, lr=lr, weight_decay=0.01))
        m.train()
    warm = max(1, steps // 50)
    curves: dict[str, list[float]] = {k: [] for k in models}
    t0 = time.time()
    done = 0
    for step in range(steps):
        now = time.time()
        if now > deadline:
            log(f"train: deadline reached at step {step}/{steps}", fh)
            break
        # linear warm-up, then linear decay over whichever runs out first: steps or time
        frac = max(step / steps, (now - t0) / max(1e-9, deadline - t0))
        lr_now = lr * min(1.0, (step + 1) / warm) * max(0.05, 1.0 - frac)
        any_model = next(iter(models.values()))
        anchors, feats, mask, tgt = data.batch(any_model, S, A, gen)
        for name, m in models.items():
            params, opt = opts[name]
            for g in opt.param_groups:
                g["lr"] = lr_now
            with torch.autocast(dev_type, dtype=torch.bfloat16):
                logits = m.forward_batch(anchors, feats, mask)
            logits = logits.float().view(-1, *logits.shape[2:])
            loss_name = name.split("@")[0]
            val = LOSSES[loss_name](logits, tgt, **loss_kwargs(loss_name, gamma=gamma))
            opt.zero_grad(set_to_none=True)
            val.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if step % 10 == 0:
                curves[name].append(float(val.detach()))
        done = step + 1
        if step % log_every == 0:
            msg = " ".join(f"{k}={curves[k][-1]:.3f}" for k in models)
            log(f"train step {step}/{steps} ({time.time() - t0:.0f}s): {msg}", fh)
    for m in models.values():
        m.eval()
    return done, curves


# ------------------------------------------------------------------ main
def _read_records(path: Path, split: str) -> list[dict]:
    """A distill-data directory (records of ``split``) or one JSONL(.xz) file (all of it)."""
    if path.is_dir():
        from .data import load_records

        return load_records(path, split)
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _examples(records: list[dict], feats: list[torch.Tensor], device: str) -> list[Example]:
    return [Example(torch.tensor(r["prompt_ids"] + r["response_ids"], device=device), len(r["prompt_ids"]), f,
                    r.get("kind", "")) for r, f in zip(records, feats)]


def _phases(text: str) -> tuple[float, float, float, float]:
    try:
        fr = [float(x) for x in text.split(",")]
    except ValueError:
        fr = []
    if len(fr) != 4 or not all(0 < x <= 1 for x in fr) or fr != sorted(fr):
        raise InvalidArgument("--phases", f"needs 4 increasing fractions in (0, 1], got {text!r}")
    return fr[0], fr[1], fr[2], fr[3]


def run(a: argparse.Namespace) -> int:
    p_inst, p_resp, p_feat, p_train = _phases(a.phases)
    if a.init and not (Path(a.init) / "config.json").exists():
        raise InvalidArgument("--init", f"{a.init} holds no drafter checkpoint (config.json)")
    if a.expand_block and not a.init:
        raise InvalidArgument("--expand-block", "needs --init CHECKPOINT")
    bad = [x for x in a.losses.split(",") if x not in LOSSES]
    if bad:
        raise InvalidArgument("--losses", f"unknown {bad}; choose from {sorted(LOSSES)}")
    for flag, paths in (("--extra-train", a.extra_train), ("--heldout", a.heldout),
                        ("--heldout-prompts", a.heldout_prompts), ("--gguf", [a.gguf] if a.gguf else [])):
        for path in paths:
            if not Path(path).exists():
                raise InvalidArgument(flag, f"{path} does not exist")
    budget = Budget(a.seconds)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "a") as fh:
        return _run(a, budget, out, fh, (p_inst, p_resp, p_feat, p_train))


def _run(a: argparse.Namespace, budget: Budget, out: Path, fh, phases: tuple[float, float, float, float]) -> int:
    p_inst, p_resp, p_feat, p_train = phases
    dev = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # features and responses as close to CPU fp32 as we can
    if a.model_dir:
        model_dir = Path(a.model_dir)
    else:
        from ..models.loading import resolve_model

        model_dir = resolve_model(a.model)
    model, tok = load_target(model_dir, Path(a.gguf) if a.gguf else None, dev)
    log(f"target loaded on {dev} in {budget.elapsed():.0f}s", fh)
    metrics: dict = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else dev, "args": vars(a)}
    train_recs, heldout = _records(a, model, tok, dev, budget, (p_inst, p_resp), out, fh, metrics)   # 1-2: data
    init_cfg = BlockDrafterConfig.load(Path(a.init) / "config.json") if a.init else None
    layers = init_cfg.feature_layers if init_cfg else [int(x) for x in a.feature_layers.split(",")]
    train_recs, data, held = _features(model, train_recs, heldout, layers, dev, budget.until(p_feat), fh)   # 3
    log(f"features of {len(train_recs)} + {len(heldout)} sequences at {budget.elapsed():.0f}s", fh)
    models = _new_models(a, model, train_recs, layers, dev)   # 4: training
    del model
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    t_train = time.time()
    steps_done, curves = train_batched(models, data, a.steps, budget.until(p_train), a.seqs, a.anchors, a.lr, a.gamma,
                                       a.seed, fh=fh)
    metrics["train"] = {"seconds": time.time() - t_train, "steps": steps_done,
                        "seqs_per_step": a.seqs, "anchors_per_seq": a.anchors}
    metrics["heldout"] = {}   # 5: evaluation + checkpoints
    for name, m in models.items():
        ev = evaluate_by_kind(m, held, amp=True)
        metrics["heldout"][name] = ev
        log(f"held-out τ ({name}): " + ", ".join(f"{k} {v['tau_measured']:.2f}" for k, v in ev.items()), fh)
        save_block_drafter(m.cpu(), out / f"drafter-{name}")
        (out / f"drafter-{name}" / "loss_curve.json").write_text(json.dumps(curves[name]))
    metrics["seconds"] = budget.elapsed()
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log(f"done in {budget.elapsed():.0f}s", fh)
    return 0


def _records(a: argparse.Namespace, model, tok, dev: str, budget: Budget, phases: tuple[float, float], out: Path, fh,
             metrics: dict) -> tuple[list[dict], list[dict]]:
    """Phases 1-2: synthesise instructions, decode the target's greedy responses
    (and the held-out prompts'), add ``--extra-train`` / ``--heldout`` records.
    Writes ``records.jsonl.xz`` and ``metrics["data"]``."""
    p_inst, p_resp = phases

    def encode(messages):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])

    inst = synthesize_instructions(model, tok, a.instructions, a.gen_batch, budget.until(p_inst), dev,
                                   seed=a.seed, fh=fh)
    log(f"{len(inst)} instructions at {budget.elapsed():.0f}s", fh)
    held_prompts = []
    for wl in a.heldout_prompts:
        for line in Path(wl).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                msgs = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
                held_prompts.append({"id": row["id"], "kind": Path(wl).stem, "prompt_ids": encode(msgs)})
    prompts = [h["prompt_ids"] for h in held_prompts] + [encode([{"role": "user", "content": s}]) for s in inst]
    resp = greedy_responses(model, tok, prompts, a.gen_batch, a.max_new_tokens, budget.until(p_resp), dev, fh=fh)
    # held-out records: no length cap
    heldout = [dict(h, response_ids=r, split="heldout") for h, r in zip(held_prompts, resp)
               if r is not None and usable({"prompt_ids": h["prompt_ids"], "response_ids": r}, sys.maxsize)]
    synth = [{"id": f"magpie-{i}", "kind": "magpie", "split": "train", "instruction": s, "prompt_ids": p,
              "response_ids": r} for i, (s, p, r) in enumerate(zip(inst, prompts[len(held_prompts):],
                                                                    resp[len(held_prompts):]))
             if r is not None and usable({"prompt_ids": p, "response_ids": r}, a.max_len)]
    with lzma.open(out / "records.jsonl.xz", "wt") as f:
        for r in synth:
            f.write(json.dumps(r) + "\n")
    train_recs = list(synth)
    for path in a.extra_train:
        train_recs += [r for r in _read_records(Path(path), "train") if usable(r, a.max_len)]
    for h in a.heldout:
        heldout += [r for r in _read_records(Path(h), "heldout") if r.get("split", "heldout") != "train"
                    and usable(r, sys.maxsize)]
    n_tok = sum(len(r["response_ids"]) for r in synth)
    metrics["data"] = {"instructions": len(inst), "synthesised_records": len(synth), "synthesised_response_tokens": n_tok,
                       "train_records": len(train_recs),
                       "train_response_tokens": sum(len(r["response_ids"]) for r in train_recs),
                       "heldout_records": len(heldout), "seconds": budget.elapsed()}
    log(f"data: {json.dumps(metrics['data'])}", fh)
    return train_recs, heldout


def _features(model, train_recs: list[dict], heldout: list[dict], layers: list[int], dev: str, deadline: float, fh):
    """Phase 3: the target's features of every sequence (the training ones until
    ``deadline``; those not reached are dropped). Returns the kept training
    records, their packed data and the held-out examples."""
    hfeats = features_of(model, heldout, layers, dev)
    feats = features_of(model, train_recs, layers, dev, deadline=deadline)
    if any(f is None for f in feats):
        log(f"features: {sum(f is None for f in feats)} of {len(feats)} training sequences not reached "
            f"before the phase's deadline; training without them", fh)
        train_recs, feats = [r for r, f in zip(train_recs, feats) if f is not None], [f for f in feats if f is not None]
    if not train_recs:
        raise InvalidArgument("--seconds", "the budget ended before any training sequence had its features")
    return train_recs, Packed(train_recs, feats, dev), _examples(heldout, hfeats, dev)


def _new_models(a: argparse.Namespace, model, train_recs: list[dict], layers: list[int], dev: str) -> dict:
    """Phase 4's models, one per loss: new ones on the target's weights, or
    ``--init`` continued (block-expanded with ``--expand-block``)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    keep = keep_ids_from(train_recs, a.n_keep, model.config.vocab_size)
    cfg = BlockDrafterConfig(block=a.block, n_layers=a.layers, hidden=model.config.hidden_size,
                             n_heads=model.config.num_attention_heads, ffn=model.config.intermediate_size,
                             feature_layers=layers, vocab_size=model.config.vocab_size, n_keep=a.n_keep,
                             fuse_last=True)
    models = {}
    for name in a.losses.split(","):
        torch.manual_seed(a.seed)
        if a.init:  # continue a checkpoint (its vocabulary slice and layers), optionally at a larger block
            m = load_block_drafter(Path(a.init), sd)
            models[name] = (expand_block(m, a.expand_block, sd, a.expand_init) if a.expand_block else m).to(dev)
        else:
            models[name] = new_model(cfg, sd, keep).to(dev)
    return models
