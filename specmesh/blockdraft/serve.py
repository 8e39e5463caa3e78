"""The trained block drafter as a proposer: in the verifier, or fed features over the wire.

Both classes implement the one proposer contract and share one drafting step
(``BlockProposer.draft_from``): one drafter pass for the block after the pending
token (``incremental.FoldedDrafter``: the context's keys/values are cached per
session and extended by the newly committed positions only; the cache is rebuilt
when the stored features of the last reused row changed), then a chain (greedy:
argmax per slot; sampling: a draw from each slot's top-k renormalised
distribution with that q attached, so rejection sampling stays exact) or, in
tree mode, a best-first tree under a node budget. They differ only in where the
target's hidden states of the committed tokens come from:

- ``BlockSelfDrafter`` (the ``self`` strategy) reads the ones the verifier keeps
  for the session (verification computes them anyway;
  ``EngineVerifier.enable_features``);
- ``BlockFeatureDrafter`` (``external`` ``block`` / ``block_tree``, hosted by the
  drafter service) keeps its own copy per session, synced by delta from
  ``FeatureRows`` the caller forwards (``check_features`` / ``sync_features``:
  bf16 rows of positions [lo, hi), the last context window at least).

Given the same features both produce the same draft. Knows nothing about gRPC
or training.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from ..drafters.base import DrafterBase
from ..engine import bf16_matmul
from ..engine.device import host_list, to_host
from ..loop import TreeSchedule
from ..seeding import draft_generator
from ..types import DraftContext, FeatureRows, InvalidArgument, SessionLost, TokenTree
from .incremental import ContextCache, FoldedDrafter
from .model import BlockDrafter, load_block_drafter
from .tree import Calibration, Scorer, best_first_tree, load_scorer


def load_checkpoint(ckpt_dir, target_state: dict) -> tuple[BlockDrafter, Optional[Scorer]]:
    """A block drafter checkpoint (config, weights, optional calibration.json: prefix-blind,
    or with its path-conditioned scorer, which trees then use) over the target's
    embeddings, final norm and head (``target_state``: at least those tensors)."""
    ckpt_dir = Path(ckpt_dir)
    model = load_block_drafter(ckpt_dir, target_state)
    cal = None
    if (ckpt_dir / "calibration.json").exists():
        cal = load_scorer(json.loads((ckpt_dir / "calibration.json").read_text()))
    return model, cal


SCHEDULE_FILE = "tree_schedule.json"


def load_schedule(ckpt_dir) -> Optional[TreeSchedule]:
    """The checkpoint's entropy-switched tree budgets (``specmesh tree-study
    --write-calibration``), or None when it has none."""
    path = Path(ckpt_dir) / SCHEDULE_FILE if ckpt_dir is not None else None
    return TreeSchedule.from_dict(json.loads(path.read_text())) if path is not None and path.exists() else None


TARGET_KEYS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")  # what the block drafter uses of the target


def target_head_state(model: str) -> dict:
    """The target's embeddings, final norm and (untied) LM head, read alone from the
    safetensors or GGUF of a model alias or directory (fp32) — what a block drafter
    outside the verifier needs of the target (no engine is built)."""
    from ..models.loading import resolve_model, weights

    w = weights(resolve_model(model, quiet=True))
    out = {k.removeprefix("model."): w[k] for k in w if k.removeprefix("model.") in TARGET_KEYS}
    missing = [k for k in TARGET_KEYS[:2] if k not in out]
    if missing:
        raise InvalidArgument("model", f"{model!r} has no {', '.join(missing)}")
    return out


def draft_from_slots(logits: torch.Tensor, ctx: DraftContext, budget: int, keep: Optional[torch.Tensor] = None,
                     tree: bool = False, tree_width: int = 6, calibration: Optional[Scorer] = None,
                     top_k: int = 8, gen: Optional[torch.Generator] = None) -> TokenTree:
    """A draft from per-slot logits [K, N] of a block drafter (slot k: the k-th token after
    the pending one; column n is token ``keep[n]``, or n without ``keep``). Tree: the
    best-first tree of ``budget`` nodes over each slot's ``tree_width`` likeliest tokens
    (``calibration`` scores them; deterministic, one-hot). Chain: greedy, the argmax per
    slot; sampling, one draw per slot from its temperature-scaled top-``top_k``
    renormalised distribution, that q attached (fresh randomness every round:
    ``seeding.draft_generator``, or ``gen`` when the caller drew from it already)."""
    s = ctx.sampling
    # one host read per draft: the slots' candidates (ids mapped through ``keep`` on the device)
    if tree:
        top = torch.topk(torch.softmax(logits.float(), -1), min(tree_width, logits.shape[-1]), -1)
        ids = keep[top.indices] if keep is not None else top.indices
        w = ids.shape[-1]
        both = host_list(torch.cat([ids.double(), top.values.double()], -1), "draft")  # ids exact in float64
        cands = [list(zip((int(x) for x in r[:w]), r[w:])) for r in both]
        return best_first_tree(cands, budget, calibration or Calibration())
    k_max = min(budget, logits.shape[0])
    if s.greedy:
        am = logits[:k_max].argmax(-1)
        return TokenTree.chain(host_list(keep[am] if keep is not None else am, "draft"))
    gen = gen if gen is not None else draft_generator(ctx)  # fresh every round (keyed by the committed length)
    vals, idx = torch.topk(logits[:k_max].float() / s.temperature, min(top_k, logits.shape[-1]), -1)
    ids = keep[idx] if keep is not None else idx
    w = ids.shape[-1]
    both = to_host(torch.cat([vals.double(), ids.double()], -1), "draft")  # [k_max, 2w]
    toks, qids, qps = [], [], []
    for k in range(k_max):
        q = torch.softmax(both[k, :w], -1)
        j = int(torch.multinomial(q, 1, generator=gen)[0])
        row = [int(x) for x in both[k, w:].tolist()]
        toks.append(row[j])
        qids.append(row)
        qps.append((q / q.sum()).tolist())
    return TokenTree.chain(toks, q_ids=qids, q_probs=qps)


class BlockProposer(DrafterBase):
    """What both variants share: the model (bf16 with ``amp``), its folded serving
    weights, the calibration and the step from slot logits to a draft."""

    name = "block"

    def __init__(self, model: BlockDrafter, tree: bool = False, tree_width: int = 6,
                 calibration: Optional[Scorer] = None, top_k: int = 8, amp: bool = True,
                 folded: Optional[FoldedDrafter] = None):
        """``tree_width``: candidates per slot the best-first tree may branch into (6: on 12
        held-out chat prompts, tree budget 8, bf16, tau 2.50 vs 2.44 with 3; the extra
        candidates cost nothing measurable). ``amp``: run the drafter in bf16 (weights cast
        once: it was trained under bf16 autocast, and autocast would re-cast the weights on
        every pass); a draft only changes speed, never the output. ``folded``: another
        instance's serving weights of the same model, shared instead of folded again."""
        self.amp = amp
        self.model = (model.to(torch.bfloat16) if amp else model).eval()
        self.tree = tree
        self.name = "block_tree" if tree else "block"
        self.tree_width = tree_width
        self.calibration = calibration or Calibration()
        self.top_k = top_k
        self.folded = folded or FoldedDrafter(self.model)

    def slot_logits(self, ctx: DraftContext) -> Optional[torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        logits = self.slot_logits(ctx) if budget > 0 else None
        if logits is None:
            return TokenTree()
        return self.draft_from(logits, ctx, budget)

    def draft_from(self, logits: torch.Tensor, ctx: DraftContext, budget: int) -> TokenTree:
        return draft_from_slots(logits, ctx, budget, self.model.keep_ids, self.tree, self.tree_width,
                                self.calibration, self.top_k)


class BlockSelfDrafter(BlockProposer):
    """In the verifier (``self``): reads the verifier's kept features of the session's slot."""

    def __init__(self, verifier, model: BlockDrafter, tree: bool = False, tree_width: int = 6,
                 calibration: Optional[Scorer] = None, top_k: int = 8, amp: bool = True,
                 folded: Optional[FoldedDrafter] = None):
        """See ``BlockProposer``; ``verifier`` keeps the hidden states it reads. On an
        int4 engine the drafter's matrices are int4 too (``FoldedDrafter(weights="int4")``:
        a draft 4.3 -> ~2 ms where the target's step is ~6 ms); on a CPU bf16 engine they
        run on the bf16 kernel (``weights="bf16"``) where it builds."""
        name = getattr(verifier.engine, "dtype_name", "")
        if folded is None and amp and name == "int4":
            folded = FoldedDrafter(model.to(torch.bfloat16).eval(), weights="int4")
        elif folded is None and amp and name == "bf16" and getattr(verifier.engine, "device", None) is not None \
                and verifier.engine.device.type == "cpu" and bf16_matmul.load() is not None:
            folded = FoldedDrafter(model.to(torch.bfloat16).eval(), weights="bf16")  # the bf16 kernel: ~1 row's cost
        super().__init__(model, tree, tree_width, calibration, top_k, amp, folded)
        self.verifier = verifier
        self._ctx: dict[int, ContextCache] = {}  # slot -> the drafter's state of its context
        verifier.enable_features(model.cfg.feature_layers)

    @classmethod
    def from_checkpoint(cls, verifier, ckpt_dir, tree: bool = False, **kw) -> "BlockSelfDrafter":
        model, cal = load_checkpoint(ckpt_dir, target_head_state(str(verifier.engine.model_dir)))
        return cls(verifier, model, tree=tree, calibration=cal, **kw)

    @torch.inference_mode()
    def slot_logits(self, ctx: DraftContext) -> Optional[torch.Tensor]:
        """[B-1, N] drafter logits for the block after ctx.tokens[-1], or None."""
        slot = self.verifier.slot_of(ctx.session_id)
        if slot is None or not ctx.tokens:
            return None
        layers = self.model.cfg.feature_layers
        cache = self._ctx.get(slot)
        if cache is None:
            cache = self._ctx[slot] = self.folded.new_cache()
        stamps = getattr(self.verifier, "feature_stamps", None)
        return self.folded.draft(cache, ctx.tokens[-1], self.verifier.engine.length(slot),
                                 lambda a, b: self.verifier.session_features(slot, layers, start=a, end=b),
                                 stamp=None if stamps is None else stamps[slot].__getitem__)


class _Features:
    """One session's features: positions [lo, hi) in rows [0, hi - lo) of ``buf``."""

    def __init__(self, dim: int, device):
        self.buf = torch.empty(0, dim, dtype=torch.bfloat16, device=device)
        self.lo = self.hi = 0
        self.cache: Optional[ContextCache] = None

    def reset(self, start: int) -> None:
        self.lo = self.hi = start

    def append(self, rows: torch.Tensor, keep_last: int) -> None:
        """Append after ``hi``; keep at most ``keep_last`` rows once more than twice that is held."""
        n, have = rows.shape[0], self.hi - self.lo
        if have + n > self.buf.shape[0]:
            grown = torch.empty(max(2 * self.buf.shape[0], have + n, 64), self.buf.shape[1], dtype=self.buf.dtype,
                                device=self.buf.device)
            grown[:have] = self.buf[:have]
            self.buf = grown
        self.buf[have:have + n] = rows
        self.hi += n
        if self.hi - self.lo > 2 * keep_last:
            drop = self.hi - self.lo - keep_last
            self.buf[:keep_last] = self.buf[drop:drop + keep_last].clone()
            self.lo += drop


class BlockFeatureDrafter(BlockProposer):
    """On the drafter service (``external`` ``block`` / ``block_tree``): per session, the
    target's features of the committed positions as the caller forwards them (bf16 rows,
    ``FeatureRows``), synced by delta like the tokens, and the drafter's context cache.

    The caller checks a delta with ``check_features`` (raises, changes nothing) before it
    changes any state, then applies it with ``sync_features``. At most ``max_sessions``
    sessions are held (least recently used dropped: its next delta is refused with
    ``SessionLost`` and the caller resends). ``device``: where the features, the cache
    and the drafter's weights live."""

    def __init__(self, model: BlockDrafter, tree: bool = False, max_sessions: int = 128, device=None, **kw):
        if device is not None:
            model = model.to(device)
        super().__init__(model, tree=tree, **kw)
        cfg = self.model.cfg
        self.feature_layers = tuple(int(i) for i in cfg.feature_layers)
        self.feature_dim = len(cfg.feature_layers) * cfg.hidden
        self.context_window = cfg.context_window
        self.max_sessions = max_sessions
        self._sessions: "OrderedDict[str, _Features]" = OrderedDict()

    @classmethod
    def from_checkpoint(cls, ckpt_dir, target_state: dict, tree: bool = False, **kw) -> "BlockFeatureDrafter":
        model, cal = load_checkpoint(ckpt_dir, target_state)
        return cls(model, tree=tree, calibration=cal, **kw)

    def twin(self, tree: bool) -> "BlockFeatureDrafter":
        """The other shape (chain / tree) of the same model, sharing its folded weights."""
        return BlockFeatureDrafter(self.model, tree=tree, max_sessions=self.max_sessions, amp=self.amp,
                                   calibration=self.calibration, top_k=self.top_k, tree_width=self.tree_width,
                                   folded=self.folded)

    # ------------------------------------------------------------ feature sync
    def feature_len(self, session_id: str) -> tuple[int, int]:
        """(lo, hi): the positions whose features the session holds ((0, 0) if none)."""
        f = self._sessions.get(session_id)
        return (f.lo, f.hi) if f is not None else (0, 0)

    def _plan(self, session_id: str, feats: Optional[FeatureRows], keep_len: int) -> tuple[bool, int, int]:
        """(reset, lo, hi) after the delta: rows that connect to the held ones (lo <= start
        <= hi) replace them from ``start``; any others (or a full resend, keep_len = 0)
        replace everything, and must then cover the window themselves. A delta for a
        session it dropped raises SessionLost (the caller resends from keep_len = 0)."""
        f = self._sessions.get(session_id)
        if feats is None:
            return False, *(self.feature_len(session_id))
        if f is None and keep_len > 0 and feats.start > 0:
            raise SessionLost(f"session {session_id!r}: no features held (evicted?); resend with keep_len=0")
        if keep_len == 0 or f is None or not f.lo <= feats.start <= f.hi:
            return True, feats.start, feats.end
        return False, f.lo, feats.end

    def check_features(self, session_id: str, feats: Optional[FeatureRows], keep_len: int, n_tokens: int) -> None:
        """Validate a delta for a session that will hold ``n_tokens`` tokens: InvalidArgument
        naming the field (``features.dtype`` / ``.layers`` / ``.dim`` / ``.data`` /
        ``.rows``) or SessionLost; changes nothing."""
        if feats is not None:
            feats.check(self.feature_layers, self.feature_dim)
        _, lo, hi = self._plan(session_id, feats, keep_len)
        need = n_tokens - 1  # every committed position before the pending token
        if hi != need or lo > max(0, need - self.context_window):
            raise InvalidArgument("features.rows", f"the drafter would hold features of positions [{lo}, {hi}); "
                                  f"drafting after {n_tokens} tokens needs [{max(0, need - self.context_window)}, "
                                  f"{need}) (missing rows)" if hi <= need else
                                  f"the drafter would hold features of positions [{lo}, {hi}), past the "
                                  f"{need} positions before the pending token")

    def sync_features(self, session_id: str, feats: Optional[FeatureRows], keep_len: int) -> None:
        """Apply a delta ``check_features`` accepted."""
        reset, lo, _ = self._plan(session_id, feats, keep_len)
        f = self._sessions.get(session_id)
        if f is None:
            f = self._sessions[session_id] = _Features(self.feature_dim, self.folded.device)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        if feats is None:
            return
        if reset:
            f.reset(feats.start)
        else:
            f.hi = feats.start
        if feats.rows:
            rows = torch.frombuffer(bytearray(feats.data), dtype=torch.bfloat16).view(feats.rows, feats.dim)
            f.append(rows.to(f.buf.device), self.context_window + self.model.cfg.block)

    # ------------------------------------------------------------ drafting
    @torch.inference_mode()
    def slot_logits(self, ctx: DraftContext) -> Optional[torch.Tensor]:
        f = self._sessions.get(ctx.session_id)
        length = len(ctx.tokens) - 1
        if f is None or length < 0 or f.hi != length:
            return None
        if f.cache is None:
            f.cache = self.folded.new_cache()
        return self.folded.draft(f.cache, ctx.tokens[-1], length, lambda a, b: f.buf[a - f.lo:b - f.lo])

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
