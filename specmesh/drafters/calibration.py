"""Reading the calibrated layer-skip exit layer (written by ``specmesh calibrate-layerskip``).

``specmesh.cli.bench.calibrate`` measures τ and tokens/s per candidate exit layer E of
``LayerSkipDrafter`` and writes the best E with all measurements to a small JSON file
(default ``$SPECMESH_CACHE/calibration/layerskip-<model>-<dtype>.json``). This module
only reads it: ``Runtime`` (the verifier) takes ``calibrated_exit`` when no exit layer
is configured, and the router's ``auto`` strategy takes ``speedup_of`` to know whether
``self`` pays.

Knows nothing about measuring, gRPC or models beyond the cache directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def calibration_path(model: str, dtype: str) -> Path:
    from ..models.loading import cache_root

    return cache_root() / "calibration" / f"layerskip-{Path(str(model)).name.lower()}-{dtype}.json"


def load_calibration(model: str, dtype: str, path: Optional[str] = None) -> Optional[dict]:
    """The calibration record, or None when there is none (or it is unreadable)."""
    p = Path(path) if path else calibration_path(model, dtype)
    try:
        rec = json.loads(p.read_text())
        return rec if isinstance(rec, dict) and isinstance(rec.get("exit_layer"), int) else None
    except (OSError, ValueError):
        return None


def calibrated_exit(model: str, dtype: str) -> Optional[int]:
    rec = load_calibration(model, dtype)
    return rec["exit_layer"] if rec else None


def speedup_of(rec: Optional[dict], exit_layer: Optional[int] = None) -> Optional[float]:
    """Measured speedup of ``exit_layer`` (default: the chosen one) in a record."""
    if not rec:
        return None
    e = rec["exit_layer"] if exit_layer is None else exit_layer
    for r in rec.get("results", []):
        if r.get("exit_layer") == e:
            return float(r["speedup"])
    return None
