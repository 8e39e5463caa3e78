"""Domain specialists of the target (LoRA fine-tunes that share its tokenizer) and the
specialist drafter of Divergence Decoding, inside the verifier process.

Divergence decoding (``acceptance="divergence"``, docs/acceptance.md) needs a
*specialist*: a second model with the target's tokenizer, tuned on one domain, that
drafts while the target (the generalist) verifies. This module holds all of it:

- **loading** (what serving needs): the target's weights with a LoRA adapter merged in
  (W + (alpha / r) B A, ``merge_lora``: no peft needed at load time); ``adapter_dir``
  finds the adapter (``$SPECMESH_SPECIALIST``, else the committed one under
  ``checkpoints/``); ``load_specialist`` returns (config, state dict).
- **the drafter** (``SpecialistDrafter``): the specialist drafts a chain; the target
  verifies it with ``acceptance="divergence"``, which needs the specialist's FULL
  distribution at every drafted position (JSD against the target's,
  ``acceptance.divergence_chain``). A drafter elsewhere could only send a sparse q (the
  draft LM sends its top-k), so the specialist runs where the verifier runs, like the
  layer-skip and block self drafters: ``EngineVerifier.self_drafters["specialist"]``,
  asked for with a ``self_draft`` of method ``specialist``. It keeps its own engine and
  KV; its logits of the last draft stay in memory for the verifier (``draft_logits``)
  and never travel. The verifier gives a self drafter only the pending token, so the
  specialist keeps each session's committed tokens itself: ``sync(session_id,
  keep_len, append_tokens)`` on every request of a divergence session (the verifier
  calls it; the drafted chain is kept tentatively and ``keep_len`` cuts it to what was
  accepted). KV slots are LRU (an evicted session re-prefills from its tokens); the
  tokens go on release. The engine is built on first use (``engine_factory``), so a
  verifier that offers the specialist pays its memory and load time only when a
  request asks for it.
- **training** (``specmesh train-specialist``; peft is the ``train`` extra, imported
  only there): the domain corpus is built offline: ``code`` is the Python source of the
  installed packages (``site-packages/**/*.py``), split by a hash of each file's path
  into a training part and a held-out part (``HELD_OUT_PERCENT``); the off-domain text
  is the English package descriptions of the same packages (the ``METADATA`` long
  descriptions; never trained on). It trains a LoRA adapter (Hugging Face ``peft`` on
  transformers' ``LlamaForCausalLM``, CPU, a fixed step budget), reports held-out
  perplexity of base and specialist on the domain and off it, saves the adapter (small:
  committed under ``checkpoints/``) and the merged weights as a Hugging Face directory
  in the cache.

Knows nothing about acceptance rules or gRPC.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..acceptance import target_probs
from ..engine import LlamaEngine
from ..models.loading import (DEFAULT_MODEL, cache_root, hf_model, load_config, load_state_dict, load_tokenizer,
                              resolve_model)
from ..seeding import draft_generator
from ..seqs import common_prefix_len
from ..types import DraftContext, SessionLost, TokenTree
from .base import DrafterBase

DOMAINS = ("code",)
HELD_OUT_PERCENT = 5  # files whose path hash falls below this percentage are never trained on
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROOT = Path(__file__).resolve().parents[2]
# committed adapters: (target alias, domain) -> directory with adapter_config.json + adapter_model.safetensors
BUNDLED = {("smollm2-135m-instruct", "code"): ROOT / "checkpoints" / "smollm2-code-specialist"}


def specialist_name(model: str, domain: str) -> str:
    return f"{Path(model).name.lower()}-{domain}-specialist"


def merged_dir(model: str, domain: str) -> Path:
    """Where ``train-specialist`` writes the merged Hugging Face model directory."""
    return cache_root() / "models" / specialist_name(model, domain)


def adapter_dir(model: str = DEFAULT_MODEL, domain: str = "code") -> Optional[Path]:
    """The specialist's adapter: ``$SPECMESH_SPECIALIST`` (a directory; "" disables), else
    the committed one for (model, domain); None when there is none."""
    env = os.environ.get("SPECMESH_SPECIALIST")
    if env is not None:
        return Path(env) if env else None
    p = BUNDLED.get((Path(model).name.lower(), domain))
    return p if p is not None and (p / "adapter_model.safetensors").exists() else None


# ---------------------------------------------------------------------------- LoRA


def merge_lora(state_dict: dict, adapter: dict, config: dict) -> dict:
    """Base weights + a peft LoRA adapter merged: W <- W + (lora_alpha / r) B A for each
    adapted linear (peft's ``merge_and_unload`` for plain LoRA). ``adapter``: the
    adapter's tensors (keys ``base_model.model.<module>.lora_A.weight`` / ``lora_B``);
    ``config``: its adapter_config.json. Returns a new dict (the base is not modified)."""
    if config.get("use_dora") or config.get("use_rslora"):
        raise ValueError("only plain LoRA adapters merge here (no DoRA / rsLoRA)")
    scale = float(config["lora_alpha"]) / float(config["r"])
    out = dict(state_dict)
    done = 0
    for k, a in adapter.items():
        if ".lora_A." not in k:
            continue
        mod = k.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = adapter[k.replace(".lora_A.", ".lora_B.")]
        wk = mod + ".weight"
        if wk not in out:
            raise KeyError(f"adapter module {mod!r} has no base weight {wk!r}")
        w = out[wk]
        out[wk] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        done += 1
    if not done:
        raise ValueError("the adapter holds no LoRA weights")
    return out


def load_specialist(model: str = DEFAULT_MODEL, domain: str = "code",
                    adapter: Optional[Path] = None) -> tuple[dict, dict]:
    """(config, state dict) of the specialist: the target's weights with the adapter
    merged in. ``adapter`` default: ``adapter_dir(model, domain)``; FileNotFoundError
    with the command that trains one when there is none."""
    from safetensors.torch import load_file

    adapter = Path(adapter) if adapter is not None else adapter_dir(model, domain)
    if adapter is None or not (adapter / "adapter_model.safetensors").exists():
        raise FileNotFoundError(f"no {domain} specialist adapter for {model} (train one with "
                                f"`specmesh train-specialist --domain {domain}`, or set SPECMESH_SPECIALIST)")
    base = resolve_model(model, quiet=True)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    sd = merge_lora(load_state_dict(base), load_file(str(adapter / "adapter_model.safetensors")), cfg)
    return load_config(base), sd



# ---------------------------------------------------------------------------- the drafter


class SpecialistDrafter(DrafterBase):
    name = "specialist"

    def __init__(self, engine_factory: Callable[[], LlamaEngine], domain: str = "", vocab_size: Optional[int] = None):
        self._factory = engine_factory
        self._engine: Optional[LlamaEngine] = None
        self._build = threading.Lock()
        self.domain = domain
        self.vocab_size = vocab_size
        self.history: dict[str, list[int]] = {}  # session -> committed tokens (+ the last draft, tentatively)
        self.kv: dict[str, tuple[int, list[int]]] = {}  # session -> (slot, tokens in the slot's KV), LRU order
        self.free: list[int] = []
        self.last: dict[str, torch.Tensor] = {}  # session -> [k, V] logits of its last draft

    @property
    def engine(self) -> LlamaEngine:
        with self._build:
            if self._engine is None:
                eng = self._factory()
                if self.vocab_size is not None and eng.vocab_size != self.vocab_size:
                    raise ValueError(f"the specialist's vocabulary ({eng.vocab_size}) is not the target's "
                                     f"({self.vocab_size})")
                self.free = list(range(eng.n_slots))[::-1]
                self._engine = eng
            return self._engine

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    # ------------------------------------------------------------------ tokens
    def sync(self, session_id: str, keep_len: int, append_tokens) -> None:
        """The session now holds its first ``keep_len`` known tokens + ``append_tokens``.
        SessionLost when this drafter knows fewer than ``keep_len`` of them."""
        have = self.history.get(session_id, [])
        if len(have) < keep_len:
            raise SessionLost(f"the specialist holds {len(have)} tokens of session {session_id!r} < "
                              f"keep_len {keep_len}; re-prefill")
        self.history[session_id] = have[:keep_len] + list(append_tokens)
        self.last.pop(session_id, None)

    def tokens(self, session_id: str) -> list[int]:
        return list(self.history.get(session_id, []))

    # ------------------------------------------------------------------ KV
    def _slot(self, sid: str) -> tuple[int, list[int]]:
        eng = self.engine
        if sid in self.kv:
            ent = self.kv.pop(sid)
            self.kv[sid] = ent  # most recently used last
            return ent
        if not self.free:
            old = next(iter(self.kv))
            slot, _ = self.kv.pop(old)
            self.free.append(slot)
        slot = self.free.pop()
        eng.reset(slot)
        self.kv[sid] = (slot, [])
        return self.kv[sid]

    # ------------------------------------------------------------------ drafting
    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        """Draft ``budget`` tokens after the session's synced tokens (``ctx.tokens`` when
        nothing was synced: a direct caller passing all committed tokens). Greedy: the
        specialist's argmax; sampled: a draw of its distribution after the request's
        temperature / top-k / top-p (the round's draft generator). Keeps the [k, V]
        logits for ``draft_logits``."""
        sid = ctx.session_id
        toks = self.history.get(sid) or list(ctx.tokens)
        eng = self.engine
        budget = min(budget, eng.max_seq_len - len(toks) - 1)
        self.last.pop(sid, None)
        if budget <= 0 or not toks:
            return TokenTree()
        slot, have = self._slot(sid)
        common = common_prefix_len(have, toks[:-1])  # keep the KV both share; at least the last token is fed
        eng.truncate(slot, common)
        logits = eng.prefill(slot, toks[common:])
        gen = None if ctx.sampling.greedy else draft_generator(ctx)
        drafted, rows = [], []
        for i in range(budget):
            rows.append(logits.float())
            if ctx.sampling.greedy:
                t = int(logits.argmax())
            else:
                p = target_probs(logits.float().unsqueeze(0), ctx.sampling)[0].cpu().double()
                t = int(torch.multinomial(p, 1, generator=gen)[0])
            drafted.append(t)
            if i + 1 < budget:
                logits = eng.prefill(slot, [t])
        self.kv[sid] = (slot, toks + drafted[:-1])  # the KV holds all but the last draft
        self.history[sid] = toks + drafted  # tentative: the next sync's keep_len cuts it to what was accepted
        self.last[sid] = torch.stack(rows)
        return TokenTree.chain(drafted)

    def draft_logits(self, session_id: str) -> Optional[torch.Tensor]:
        """[k, V] specialist logits at the positions of the session's last draft (row i:
        the distribution draft i was taken from); None when it has none."""
        return self.last.get(session_id)

    def release(self, session_id: str) -> None:
        self.history.pop(session_id, None)
        self.last.pop(session_id, None)
        ent = self.kv.pop(session_id, None)
        if ent is not None:
            self.free.append(ent[0])


# ---------------------------------------------------------------------------- corpus


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _bucket(rel: str) -> int:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 100


def domain_files(domain: str, split: str, root: Optional[Path] = None) -> list[Path]:
    """The corpus files of ``domain`` ("code": *.py; "prose": the METADATA package
    descriptions, the off-domain text, never trained on: every split holds all of them)
    for ``split`` ("train" or "heldout"), sorted by path hash (a fixed, well-mixed
    order). Files of 1-200 KB only."""
    root = root or _site_packages()
    if domain == "code":
        files = root.rglob("*.py")
    elif domain == "prose":
        files = root.glob("*.dist-info/METADATA")
    else:
        raise ValueError(f"unknown domain {domain!r}; known: {DOMAINS + ('prose',)}")
    out = []
    for f in files:
        rel = str(f.relative_to(root))
        if "specmesh" in rel or "__pycache__" in rel:
            continue
        try:
            size = f.stat().st_size
        except OSError:
            continue
        if not 1_000 <= size <= 200_000:
            continue
        held = _bucket(rel) < HELD_OUT_PERCENT
        if domain == "prose" or (split == "heldout") == held:
            out.append((hashlib.sha1(rel.encode()).hexdigest(), f))
    return [f for _, f in sorted(out)]


def _text(f: Path, domain: str) -> str:
    t = f.read_text(encoding="utf-8", errors="replace")
    if domain == "prose":  # the long description follows the header's first blank line
        t = t.split("\n\n", 1)[1] if "\n\n" in t else ""
    return t


def token_chunks(tokenizer, files: Sequence[Path], domain: str, seq_len: int, n_chunks: int) -> torch.Tensor:
    """[n, seq_len] token ids: the files' text, each followed by eos, concatenated and cut
    into rows (fewer rows than ``n_chunks`` only when the files run out)."""
    need = n_chunks * seq_len
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for f in files:
        t = _text(f, domain)
        if len(t) < 200:
            continue
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if len(ids) >= need:
            break
    n = min(n_chunks, len(ids) // seq_len)
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


# ---------------------------------------------------------------------------- training


@torch.no_grad()
def perplexity(model, chunks: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token negative log-likelihood) of a causal LM over the rows."""
    model.eval()
    nll, n = 0.0, 0
    for i in range(0, len(chunks), batch):
        x = chunks[i: i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]
        nll -= float(lp.sum())
        n += lp.numel()
    return math.exp(nll / max(n, 1))


def train(model: str = DEFAULT_MODEL, domain: str = "code", steps: int = 150, seq_len: int = 256, batch: int = 4,
          lr: float = 1e-3, rank: int = 8, alpha: int = 16, seed: int = 0, threads: int = 2,
          eval_chunks: int = 24, out: Optional[Path] = None, save_merged: bool = True,
          max_minutes: float = 15.0, quiet: bool = False) -> dict:
    """LoRA-tune the target on ``domain`` for ``steps`` AdamW steps of ``batch`` x
    ``seq_len`` tokens (stops early, recording it, past ``max_minutes``), then measure
    held-out perplexity of base and specialist on the domain and off it (prose).
    Writes ``out`` (adapter_config.json, adapter_model.safetensors, metrics.json) and,
    with ``save_merged``, the merged model under ``merged_dir``. Returns the metrics."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - the train extra
        raise SystemExit("train-specialist needs peft: pip install -e '.[train]'") from e
    from safetensors.torch import save_file
    from tqdm import tqdm

    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; known: {DOMAINS}")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    base_dir = resolve_model(model, quiet=quiet)
    tok = load_tokenizer(base_dir)
    t0 = time.time()
    train_x = token_chunks(tok, domain_files(domain, "train"), domain, seq_len, steps * batch)
    ev = {"code": token_chunks(tok, domain_files(domain, "heldout"), domain, seq_len, eval_chunks),
          "prose": token_chunks(tok, domain_files("prose", "heldout"), "prose", seq_len, eval_chunks)}
    perm = torch.randperm(len(train_x))
    train_x = train_x[perm]
    lm = hf_model(base_dir, torch.float32)
    base_ppl = {k: perplexity(lm, v) for k, v in ev.items()}
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                     task_type="CAUSAL_LM")
    pm = get_peft_model(lm, cfg)
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    n_steps = min(steps, len(train_x) // batch)
    warm = max(1, n_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.05, 0.5 * (1 + math.cos(math.pi * s / n_steps))))
    pm.train()
    losses, t_train, done = [], time.time(), 0
    bar = tqdm(range(n_steps), desc=f"LoRA {domain} specialist", disable=quiet, file=sys.stderr)
    for s in bar:
        x = train_x[s * batch: (s + 1) * batch]
        loss = pm(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        done = s + 1
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        if (time.time() - t_train) / 60 > max_minutes:
            break
    bar.close()
    train_s = time.time() - t_train
    spec_ppl = {k: perplexity(pm, v) for k, v in ev.items()}
    out = Path(out) if out is not None else BUNDLED.get((Path(model).name.lower(), domain)) or \
        (cache_root() / "adapters" / specialist_name(model, domain))
    out.mkdir(parents=True, exist_ok=True)
    readme = out / "README.md"
    kept = readme.read_text() if readme.exists() else None
    pm.save_pretrained(str(out))  # adapter_config.json + adapter_model.safetensors (+ peft's model card)
    if kept is not None:
        readme.write_text(kept)  # the directory's own README, not peft's template
    metrics = {
        "model": Path(model).name.lower(), "domain": domain, "rank": rank, "lora_alpha": alpha,
        "targets": list(LORA_TARGETS), "steps": done, "steps_asked": steps, "batch": batch, "seq_len": seq_len,
        "lr": lr, "seed": seed, "threads": threads, "train_tokens": done * batch * seq_len,
        "train_seconds": round(train_s, 1), "total_seconds": round(time.time() - t0, 1),
        "loss_first10": sum(losses[:10]) / max(1, len(losses[:10])),
        "loss_last10": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "eval_tokens_per_set": {k: int(v.numel()) for k, v in ev.items()},
        "heldout_ppl": {"base": base_ppl, "specialist": spec_ppl},
        "corpus": f"code: *.py of site-packages (train: path-hash bucket >= {HELD_OUT_PERCENT}%, held out: "
                  f"< {HELD_OUT_PERCENT}%); prose (off-domain, never trained on): *.dist-info/METADATA descriptions",
        "command": f"specmesh train-specialist --domain {domain} --steps {steps} --batch {batch} "
                   f"--seq-len {seq_len} --lr {lr} --rank {rank} --alpha {alpha} --seed {seed} "
                   f"--max-minutes {max_minutes:g}",
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if save_merged:
        merged = pm.merge_and_unload()
        d = merged_dir(model, domain)
        d.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().contiguous() for k, v in merged.state_dict().items()}
        if load_config(base_dir).get("tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(dict(load_config(base_dir), _specialist_of=str(base_dir),
                                                       _domain=domain), indent=2))
        tok.save_pretrained(d)
        metrics["merged_dir"] = str(d)
    return metrics
