"""How a benchmark or study writes its result: ``<stem>.json``, ``<stem>.md`` and
``<stem>.png`` in one folder (``specmesh costs``, ``specmesh quality``, ``specmesh
uno-study``). Knows nothing about what was measured: the caller renders the markdown and
draws the plot.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_result(out_dir, stem: str, result: dict, md: str, plot) -> None:
    """``<stem>.json`` (``result``), ``<stem>.md`` (``md``) and ``<stem>.png``
    (``plot(result, path)``) in ``out_dir``; prints the table and what was written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(md)
    plot(result, out / f"{stem}.png")
    print(md)
    print(f"wrote {out}/{stem}.json, {stem}.md, {stem}.png")
