"""Target self-distillation data: the target's own greedy responses to the prompt set.

``generate_shards`` decodes many prompts at once through ``EngineVerifier.verify_batch``
(one ragged forward per step for all active sessions), writes JSON-lines shards of
``{id, kind, split, prompt_ids, response_ids}`` and is resumable: prompts already
in a finished shard are skipped. ``load_records`` reads them back, by split.
``target_features`` runs the target over a full sequence and returns the hidden
states of the chosen layers (the drafter's conditioning).

Knows nothing about the drafter model or training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable, Optional

import torch
from tqdm import tqdm

from ..types import TokenTree, VerifyRequest
from .prompts import build_prompts, split


def _done_ids(out_dir: Path) -> set[str]:
    ids: set[str] = set()
    for f in sorted(out_dir.glob("shard-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                ids.add(json.loads(line)["id"])
    return ids


def generate_shards(runtime, out_dir: Path, max_new_tokens: int = 160, shard_size: int = 32,
                    limit: Optional[int] = None, quiet: bool = False, only_split: Optional[str] = None) -> Path:
    """Write the target's greedy responses for every prompt not done yet (``only_split``:
    just the prompts of that split, "train" or "heldout")."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts()[:limit] if limit else build_prompts()
    if only_split is not None:
        prompts = [p for p in prompts if split(p["id"]) == only_split]
    done = _done_ids(out_dir)
    todo = [p for p in prompts if p["id"] not in done]
    n_shards = len(list(out_dir.glob("shard-*.jsonl")))
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="distill-data (prompts)",
               disable=quiet, file=sys.stderr)
    ver = runtime.verifier
    width = runtime.engine.n_slots
    stops = set(runtime.stop_ids)
    records: list[dict] = []

    def flush() -> None:  # a finished shard is written atomically; its prompts count as done
        nonlocal n_shards, records
        if not records:
            return
        path = out_dir / f"shard-{n_shards:04d}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.rename(path)
        n_shards += 1
        records = []

    # one continuous queue: a finished session's slot is refilled at once, so every
    # forward stays full until the last prompts
    queue = list(todo)
    active: dict[str, dict] = {}
    while queue or active:
        while queue and len(active) < width:
            p = queue.pop(0)
            ids = runtime.encode(p["prompt"])
            active[p["id"]] = {"p": p, "prompt": ids, "out": [], "kv": 0}
        reqs = []
        for sid, st in active.items():
            toks = st["prompt"] + st["out"]
            reqs.append(VerifyRequest(sid, st["kv"], toks[st["kv"]:], TokenTree()))
        results = ver.verify_batch(reqs)
        for req, res in zip(reqs, results):
            if isinstance(res, Exception):
                raise res
            st = active[req.session_id]
            st["kv"] = len(st["prompt"]) + len(st["out"])
            if res.next_token in stops or len(st["out"]) + 1 >= max_new_tokens:
                if res.next_token not in stops:
                    st["out"].append(res.next_token)
                p = st["p"]
                records.append({"id": p["id"], "kind": p["kind"], "split": split(p["id"]),
                                "prompt_ids": st["prompt"], "response_ids": st["out"]})
                ver.release(req.session_id)
                del active[req.session_id]
                bar.update(1)
                if len(records) >= shard_size:
                    flush()
            else:
                st["out"].append(res.next_token)
    flush()
    bar.close()
    return out_dir


def load_records(data_dir: Path, which: str = "train") -> list[dict]:
    recs = []
    for f in sorted(Path(data_dir).glob("shard-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if which == "all" or r["split"] == which:
                    recs.append(r)
    return recs


@torch.inference_mode()
def target_features(engine, tokens: list[int], layers: Iterable[int], slot: int = 0) -> torch.Tensor:
    """Run the target over ``tokens`` in ``slot`` (reset before and after); return the
    hidden states of ``layers`` concatenated: [T, len(layers) * H] float32."""
    layers = list(layers)
    engine.reset(slot)
    try:
        out = engine.score(slot, tokens, list(range(-1, len(tokens) - 1)), rows=[len(tokens) - 1],
                           hidden_layers=layers)
    finally:
        engine.reset(slot)
    return torch.cat([out.hidden[i] for i in layers], -1)
