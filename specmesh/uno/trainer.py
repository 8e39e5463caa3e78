"""Training the mask-gated adapter by self-distillation on the target's own outputs.

A training sequence is a prompt and the target's greedy response (the block
drafter's records: ``specmesh distill-data`` shards or the bundled Magpie records).
For A random *anchors* p in the response (the last token a forward would know),
a block of M masks sits at positions p+1..p+M; mask i predicts the token at
p+1+i given the context up to p, the earlier masks of its block and, through the
readout, the token at p+1 (``adapter`` module docstring). The target itself is
frozen; only the adapter learns.

One step is two passes of a differentiable Llama forward written here (the same
function as ``LlamaEngine``'s, over a padded batch of sequences):

1. ``FrozenTarget.context`` (no gradient): the sequences through the target, keeping
   every layer's keys and values and the last hidden state (whose logits are the
   target's own distribution at every position: the soft targets);
2. ``FrozenTarget.masks`` (gradient to the adapter only): the A x M mask rows of
   each sequence, gated, attending to the cached context keys/values up to their
   anchor and block-causally to each other.

Losses: ``soft`` x the cross-entropy against the target's own distribution at
each slot (what sampled verification needs) + (1 - ``soft``) x a hard term (one of
``blockdraft.losses.LOSSES``) against the target's greedy tokens. ``evaluate`` gives
the held-out greedy chain metrics the block drafter reports (per-slot conditional
accuracy, accepted-length histogram, τ). Knows nothing about serving or gRPC.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..blockdraft.losses import IGNORE, LOSS_KWARGS, LOSSES
from ..engine.llama import rope_tables
from .adapter import GatedAdapter


class FrozenTarget:
    """The target's weights as plain frozen tensors (fused like the engine's) and a
    padded-batch forward with autograd. ``dtype``: of the matmuls (float32 on CPUs
    without native bf16); the residual stream is float32."""

    def __init__(self, config: dict, state_dict: dict, dtype: torch.dtype = torch.float32, device="cpu",
                 max_len: int = 1024):
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        self.device, self.dtype = torch.device(device), dtype
        self.H = config["hidden_size"]
        self.nq = config["num_attention_heads"]
        self.nk = config.get("num_key_value_heads", self.nq)
        self.hd = config.get("head_dim") or self.H // self.nq
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.n_layers = config["num_hidden_layers"]
        g = lambda k: sd[k].to(self.device)  # noqa: E731
        w = lambda k: g(k).to(dtype)  # noqa: E731
        self.embed = g("embed_tokens.weight").float()
        self.layers = []
        for i in range(self.n_layers):
            p = f"layers.{i}."
            bq = sd.get(p + "self_attn.q_proj.bias")
            self.layers.append({
                "ln1": g(p + "input_layernorm.weight").float(),
                "qkv": torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                                  w(p + "self_attn.v_proj.weight")]),
                "bqkv": None if bq is None else torch.cat([g(p + "self_attn.q_proj.bias"), g(p + "self_attn.k_proj.bias"),
                                                           g(p + "self_attn.v_proj.bias")]).to(dtype),
                "o": w(p + "self_attn.o_proj.weight"),
                "ln2": g(p + "post_attention_layernorm.weight").float(),
                "gate_up": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                "down": w(p + "mlp.down_proj.weight"),
            })
        self.norm = g("norm.weight").float()
        self.head = sd.get("lm_head.weight", sd["embed_tokens.weight"]).to(self.device).to(dtype)
        cos, sin = rope_tables(config, self.hd, max_len)
        self.cos = cos.float().to(self.device)
        self.sin = sin.float().to(self.device)

    # ------------------------------------------------------------------ pieces
    def _norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.eps).to(self.dtype)

    def _rope(self, x, pos):
        """x [S, n, heads, hd], pos [S, n] -> rotated (rotate-half, as the engine)."""
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]
        S, n, h, d = x.shape
        sw = x.view(S, n, h, 2, d // 2).flip(3).view(S, n, h, d)
        return x * cos + sw * sin

    def _proj(self, L, name, x, li, adapter):
        y = x @ L[name].T
        if name == "qkv" and L["bqkv"] is not None:
            y = y + L["bqkv"]
        if adapter is not None:
            d = adapter.delta(li, name, x.reshape(-1, x.shape[-1]))
            if d is not None:
                y = y + d.view(*y.shape[:-1], -1).to(y.dtype)
        return y

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] residual -> [..., V] float32 logits (final norm + head)."""
        return (self._norm(h.float(), self.norm) @ self.head.T).float()

    # ------------------------------------------------------------------ passes
    @torch.no_grad()
    def context(self, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """ids [S, T] (padding at the end is harmless: causal) -> (per layer (k, v) each
        [S, nk, T, hd] after RoPE, last hidden [S, T, H] float32)."""
        S, T = ids.shape
        pos = torch.arange(T, device=self.device)[None].expand(S, T)
        x = self.embed[ids]
        kv = []
        nq, nk, hd = self.nq, self.nk, self.hd
        for li, L in enumerate(self.layers):
            qkv = self._proj(L, "qkv", self._norm(x, L["ln1"]), li, None)
            qk = self._rope(qkv[..., : (nq + nk) * hd].view(S, T, nq + nk, hd).float(), pos)
            q, k = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2)
            v = qkv[..., (nq + nk) * hd:].view(S, T, nk, hd).transpose(1, 2).float()
            kv.append((k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self._proj(L, "o", a.transpose(1, 2).reshape(S, T, nq * hd).to(self.dtype), li, None).float()
            g_, u_ = self._proj(L, "gate_up", self._norm(x, L["ln2"]), li, None).chunk(2, -1)
            x = x + self._proj(L, "down", F.silu(g_) * u_, li, None).float()
        return kv, x

    def masks(self, adapter: GatedAdapter, kv, anchors: torch.Tensor, M: int,
              inputs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gated rows of every sequence: anchors [S, A] (positions; -1 = none), a block
        of M gated rows after each -> last hidden [S, A, M, H] float32 (gradient to the
        adapter only). ``inputs`` [S, A, M]: each row's input token, -1 = MASK (default:
        all masks; the diffusion form fills some of a block's later positions)."""
        S, A = anchors.shape
        T = kv[0][0].shape[2]
        R = A * M
        i = torch.arange(1, M + 1, device=self.device)
        pos = (anchors.clamp_min(0)[:, :, None] + i).reshape(S, R)  # mask i of a block at anchor + i
        # visibility [S, R, T + R]: context keys <= anchor, the block's masks up to itself
        ctx_vis = torch.arange(T, device=self.device)[None, None] <= anchors.repeat_interleave(M, 1)[:, :, None]
        blk = torch.arange(R, device=self.device)
        same = (blk[:, None] // M == blk[None] // M) & (blk[None] <= blk[:, None])
        vis = torch.cat([ctx_vis, same[None].expand(S, R, R)], -1)
        mask = torch.zeros(S, 1, R, T + R, device=self.device).masked_fill_(~vis[:, None], float("-inf"))
        x = adapter.mask.float()[None, None].expand(S, R, -1)
        if inputs is not None:
            inp = inputs.reshape(S, R)
            x = torch.where((inp >= 0)[..., None], self.embed[inp.clamp_min(0)], x)
        nq, nk, hd = self.nq, self.nk, self.hd
        for li, L in enumerate(self.layers):
            qkv = self._proj(L, "qkv", self._norm(x, L["ln1"]), li, adapter)
            qk = self._rope(qkv[..., : (nq + nk) * hd].view(S, R, nq + nk, hd).float(), pos)
            q, k = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2)
            v = qkv[..., (nq + nk) * hd:].view(S, R, nk, hd).transpose(1, 2).float()
            kc, vc = kv[li]
            a = F.scaled_dot_product_attention(q, torch.cat([kc, k], 2), torch.cat([vc, v], 2), attn_mask=mask,
                                               enable_gqa=True)
            x = x + self._proj(L, "o", a.transpose(1, 2).reshape(S, R, nq * hd).to(self.dtype), li, adapter).float()
            g_, u_ = self._proj(L, "gate_up", self._norm(x, L["ln2"]), li, adapter).chunk(2, -1)
            x = x + self._proj(L, "down", F.silu(g_) * u_, li, adapter).float()
        return x.view(S, A, M, -1)


# ---------------------------------------------------------------- data
@dataclass
class Sequence_:
    ids: list[int]  # prompt + response
    start: int  # first response position
    kind: str = ""


def sequences(records: Sequence[dict], max_len: int = 320) -> list[Sequence_]:
    """Records with a response of at least 4 tokens, cut to ``max_len`` tokens."""
    out = []
    for r in records:
        ids = (list(r["prompt_ids"]) + list(r["response_ids"]))[:max_len]
        start = len(r["prompt_ids"])
        if len(ids) - start >= 4:
            out.append(Sequence_(ids, start, r.get("kind", "")))
    return out


def _anchors(seq: Sequence_, n: int, rng: random.Random) -> list[int]:
    """Up to n distinct anchors p with the decided token p+1 inside the response."""
    lo, hi = seq.start - 1, len(seq.ids) - 2
    if hi < lo:
        return []
    cand = list(range(lo, hi + 1))
    return sorted(rng.sample(cand, min(n, len(cand))))


@dataclass
class Batch:
    ids: torch.Tensor  # [S, T] sequences
    anchors: torch.Tensor  # [S, A] anchor positions (-1: none)
    nxt: torch.Tensor  # [S, A] the decided token at anchor + 1
    tgt: torch.Tensor  # [S, A, M] token at anchor + 2 + i for row i (IGNORE: past the end, or known)
    rows: torch.Tensor  # [S, A, M] context position whose target logits predict it (soft targets)
    inputs: Optional[torch.Tensor] = None  # [S, A, M] row inputs (-1 MASK); None: all masks
    diffusion: Optional[torch.Tensor] = None  # [S, A] bool: the block is in the diffusion form

    def to(self, device) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in
                       (self.ids, self.anchors, self.nxt, self.tgt, self.rows, self.inputs, self.diffusion)))


def make_batch(seqs: Sequence[Sequence_], anchors_per_seq: int, M: int, rng: random.Random, device="cpu",
               diffusion: float = 0.0) -> Batch:
    """Training blocks: after each anchor p, M gated rows at p+1..p+M, row i predicting the
    token at p+2+i. Serving form (all masks): the readout knows the token at p+1. With
    probability ``diffusion`` a block takes the diffusion form instead: rows 1..M-1 hold
    the true token with probability r ~ U(0, 1) each (row 0 stays a mask), no readout, and
    only rows whose next token is still unknown (masked, or past the block) are scored."""
    S, T = len(seqs), max(len(s.ids) for s in seqs)
    A = anchors_per_seq
    ids = torch.zeros(S, T, dtype=torch.long)
    anchors = torch.full((S, A), -1, dtype=torch.long)
    nxt = torch.zeros(S, A, dtype=torch.long)
    tgt = torch.full((S, A, M), IGNORE, dtype=torch.long)
    rows = torch.zeros(S, A, M, dtype=torch.long)
    inputs = torch.full((S, A, M), -1, dtype=torch.long)
    diff = torch.zeros(S, A, dtype=torch.bool)
    for s, seq in enumerate(seqs):
        n = len(seq.ids)
        ids[s, :n] = torch.tensor(seq.ids)
        for a, p in enumerate(_anchors(seq, A, rng)):
            anchors[s, a] = p
            nxt[s, a] = seq.ids[p + 1]
            known = [False] * M
            if diffusion and rng.random() < diffusion:
                diff[s, a] = True
                r = rng.random()
                for i in range(1, M):
                    if p + 1 + i < n and rng.random() < r:
                        known[i] = True
                        inputs[s, a, i] = seq.ids[p + 1 + i]
            for i in range(M):
                t = p + 2 + i
                if t < n and not (i + 1 < M and known[i + 1]):
                    tgt[s, a, i] = seq.ids[t]
                    rows[s, a, i] = t - 1
    return Batch(ids, anchors, nxt, tgt, rows, inputs if bool(diff.any()) else None,
                 diff if bool(diff.any()) else None).to(device)


def step_logits(target: FrozenTarget, adapter: GatedAdapter, batch, M: int, soft: bool = True):
    """(mask logits [S*A, M, V], targets [S*A, M], soft target probs [S*A, M, V] or None)."""
    ids, anchors, nxt, tgt, rows = batch.ids, batch.anchors, batch.nxt, batch.tgt, batch.rows
    kv, hid = target.context(ids)
    h = target.masks(adapter, kv, anchors, M, batch.inputs)  # [S, A, M, H]
    S, A = anchors.shape
    e = target.embed[nxt][:, :, None].expand(-1, -1, M, -1)
    hr = adapter.readout(h.reshape(-1, h.shape[-1]), e.reshape(-1, e.shape[-1]), target.eps)
    if batch.diffusion is not None:  # diffusion-form blocks: the plain head (the first token is not known)
        d = batch.diffusion[:, :, None].expand(-1, -1, M).reshape(-1, 1)
        hr = torch.where(d, h.reshape(-1, h.shape[-1]), hr)
    logits = target.logits(hr).view(S * A, M, -1)
    p = None
    if soft:
        with torch.no_grad():
            ctx = hid.gather(1, rows.view(S, A * M)[..., None].expand(-1, -1, hid.shape[-1]))
            p = torch.softmax(target.logits(ctx), -1).view(S * A, M, -1)
    t = tgt.view(S * A, M).clone()
    t[anchors.view(-1) < 0] = IGNORE
    return logits, t, p


def soft_ce(logits: torch.Tensor, p: torch.Tensor, targets: torch.Tensor, gamma: float = 4.0) -> torch.Tensor:
    """Cross-entropy against the target's distribution, per slot weighted exp(-(k-1)/gamma)."""
    valid = (targets != IGNORE).float()
    per = -(p * torch.log_softmax(logits, -1)).sum(-1)  # [N, M]
    w = torch.exp(-torch.arange(logits.shape[1], device=logits.device, dtype=torch.float32) / gamma)[None] * valid
    return (per * w).sum() / w.sum().clamp_min(1e-8)


def train(target: FrozenTarget, adapter: GatedAdapter, seqs: list[Sequence_], steps: int, M: int,
          seqs_per_step: int = 4, anchors_per_seq: int = 16, lr: float = 1e-3, loss: str = "ce",
          soft: float = 0.5, gamma: float = 4.0, seconds: Optional[float] = None, seed: int = 0,
          log_every: int = 10, quiet: bool = False, on_log=None, diffusion: float = 0.0) -> list[dict]:
    """AdamW on the adapter (cosine schedule, 5% warm-up) for ``steps`` steps or until
    ``seconds`` pass; returns the log rows (step, loss, seconds)."""
    rng = random.Random(seed)
    params = adapter.requires_grad_(True).parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps)))))
    hard = LOSSES[loss]
    kw = {k: gamma for k in LOSS_KWARGS.get(loss, ())}
    log, t0, run = [], time.perf_counter(), 0.0
    order = list(range(len(seqs)))
    rng.shuffle(order)
    cur = 0
    from tqdm import tqdm

    bar = tqdm(total=steps, desc="train-uno", disable=quiet, file=sys.stderr)
    for step in range(steps):
        if cur + seqs_per_step > len(order):
            rng.shuffle(order)
            cur = 0
        batch_seqs = [seqs[j] for j in order[cur: cur + seqs_per_step]]
        cur += seqs_per_step
        batch = make_batch(batch_seqs, anchors_per_seq, M, rng, target.device, diffusion=diffusion)
        logits, t, p = step_logits(target, adapter, batch, M, soft=soft > 0)
        total = soft * soft_ce(logits, p, t, gamma) if soft > 0 else 0.0
        if soft < 1:
            total = total + (1 - soft) * hard(logits, t, **kw)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        lv = float(total.detach())
        run = lv if step == 0 else 0.9 * run + 0.1 * lv
        bar.update(1)
        bar.set_postfix(loss=f"{run:.3f}")
        if (step + 1) % log_every == 0 or step + 1 == steps:
            row = {"step": step + 1, "loss": round(run, 4), "seconds": round(time.perf_counter() - t0, 1)}
            log.append(row)
            if on_log is not None:
                on_log(row)
        if seconds is not None and time.perf_counter() - t0 > seconds:
            break
    bar.close()
    adapter.requires_grad_(False)
    return log


@torch.no_grad()
def evaluate(target: FrozenTarget, adapter: GatedAdapter, seqs: list[Sequence_], M: int, anchors_per_seq: int = 32,
             seed: int = 1, batch: int = 4) -> dict:
    """Held-out greedy chains: for each anchor, how many leading slots' argmax equal the
    target's greedy tokens -> per-slot conditional accuracy, histogram (0..M; M is the
    ceiling bin), τ = 1 + mean accepted (a fused round's tokens: the accepted drafts and
    the target's own token)."""
    rng = random.Random(seed)
    hist = [0] * (M + 1)
    reached, correct = [0] * M, [0] * M
    for b in range(0, len(seqs), batch):
        bt = make_batch(seqs[b: b + batch], anchors_per_seq, M, rng, target.device)
        logits, t, _ = step_logits(target, adapter, bt, M, soft=False)
        pred = logits.argmax(-1)
        for a in range(t.shape[0]):
            if t[a, 0] == IGNORE:
                continue
            n = 0
            while n < M and t[a, n] != IGNORE and pred[a, n] == t[a, n]:
                n += 1
            hist[n] += 1
            for k in range(min(n + 1, M)):
                if t[a, k] == IGNORE:
                    break
                reached[k] += 1
                correct[k] += int(k < n)
    rounds = sum(hist)
    return {"slot_accuracy": [c / r if r else 0.0 for c, r in zip(correct, reached)], "accept_hist": hist,
            "ceiling_fraction": hist[-1] / rounds if rounds else 0.0,
            "tau_measured": 1 + sum(i * h for i, h in enumerate(hist)) / rounds if rounds else 0.0,
            "rounds": rounds}
