"""Workloads: JSONL files of prompts, one file per workload, read by the benchmarks
(``specmesh.cli.bench``), the training and study commands (``specmesh.cli.blockdraft``,
``specmesh.cli.uno_study``) and the scripts.

Each line is ``{"id", "prompt" | "messages", optional "max_new_tokens"}``. A
record's ``max_new_tokens`` caps that prompt below the run's budget (the smaller
of the two is used). The default directory is ``bench/workloads`` of the source
checkout (or of the current directory).

This module knows nothing about models or tokenizers: it only finds, reads and
validates the records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .types import InvalidArgument


@dataclass(frozen=True)
class Prompt:
    id: str
    workload: str
    prompt: Optional[str] = None
    messages: Optional[list] = None
    max_new_tokens: Optional[int] = None

    def budget(self, run_max: int) -> int:
        return min(run_max, self.max_new_tokens) if self.max_new_tokens else run_max


def default_dir() -> Path:
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        d = root / "bench" / "workloads"
        if d.is_dir():
            return d
    return Path.cwd() / "bench" / "workloads"


PREFERRED_ORDER = ("code_edit", "code_write", "summarize_quotes", "chat_multiturn", "reasoning", "open_writing")


def available(directory: Optional[Path] = None) -> list[str]:
    """Workload names in the directory: the project's five in their usual order, then the rest sorted."""
    d = Path(directory) if directory else default_dir()
    names = {p.stem for p in d.glob("*.jsonl")}
    return [n for n in PREFERRED_ORDER if n in names] + sorted(names - set(PREFERRED_ORDER))


def _parse(line: str, workload: str, lineno: int) -> Prompt:
    where = f"{workload}.jsonl line {lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidArgument("workloads", f"{where}: not JSON ({e})") from None
    if not isinstance(rec, dict) or not rec.get("id"):
        raise InvalidArgument("workloads", f"{where}: needs an 'id'")
    prompt, messages = rec.get("prompt"), rec.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidArgument("workloads", f"{where}: needs exactly one of 'prompt' or 'messages'")
    if messages is not None and (not isinstance(messages, list) or not messages or
                                 any(not isinstance(m, dict) or "role" not in m or "content" not in m
                                     for m in messages)):
        raise InvalidArgument("workloads", f"{where}: 'messages' must be a list of {{role, content}}")
    mnt = rec.get("max_new_tokens")
    if mnt is not None and (not isinstance(mnt, int) or mnt <= 0):
        raise InvalidArgument("workloads", f"{where}: 'max_new_tokens' must be a positive integer")
    return Prompt(str(rec["id"]), workload, prompt, messages, mnt)


def load(names: Optional[Sequence[str]] = None, per_workload: Optional[int] = None,
         directory: Optional[Path] = None) -> dict[str, list[Prompt]]:
    """workload name -> its prompts (first ``per_workload`` of each), in file order."""
    d = Path(directory) if directory else default_dir()
    known = available(d)
    if not known:
        raise InvalidArgument("workloads", f"no *.jsonl workloads in {d}")
    names = list(names) if names else known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidArgument("workloads", f"unknown workload(s) {unknown}; known: {known}")
    if per_workload is not None and per_workload <= 0:
        raise InvalidArgument("prompts", f"must be a positive integer, got {per_workload}")
    out: dict[str, list[Prompt]] = {}
    for name in names:
        lines = (d / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        recs = [_parse(ln, name, i + 1) for i, ln in enumerate(lines) if ln.strip()]
        out[name] = recs[:per_workload] if per_workload else recs
    return out
