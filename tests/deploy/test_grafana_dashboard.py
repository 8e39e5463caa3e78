"""The Grafana dashboard (``k8s/otel/grafana/specmesh-dashboard.json``), checked offline.

- It decodes with Grafana's own dashboard model (``grafana-foundation-sdk``, generated
  from Grafana 11.6's schemas, with the panel and Prometheus query plugins registered)
  and encodes back to a superset of itself: every key it has is one the schema knows,
  with a value the model kept (a misspelt or misplaced key is dropped, so it fails).
- Every panel has what Grafana needs to draw it (id, type, title, a grid position
  inside 24 columns, a Prometheus datasource, queries with distinct refIds).
- Every metric its PromQL names is one our registries export (router, verifier,
  drafter; with the ``_total`` / ``_bucket`` / ``_sum`` / ``_count`` sample names),
  and every label it groups or filters by is a label of those metrics.
- The panels the issue asked for are there: tokens/s, τ, acceptance by position,
  TTFT and inter-token latency percentiles, the per-strategy share, verify batch size.
"""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import Counter, Gauge, Histogram

from tests.support import ROOT

DASHBOARD = ROOT / "k8s" / "otel" / "grafana" / "specmesh-dashboard.json"
PANEL_TYPES = {"timeseries", "bargauge", "piechart", "stat", "gauge", "table", "barchart", "heatmap", "text"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "or", "and", "unless", "offset",
                "bool", "le"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _targets(d: dict):
    for p in d["panels"]:
        for t in p.get("targets", []):
            yield p, t


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, for every metric the three services' registries define."""
    from specmesh.observability.metrics import DrafterMetrics, RouterMetrics, VerifierMetrics

    out: dict[str, set[str]] = {}
    for m in (RouterMetrics(), VerifierMetrics(), DrafterMetrics()):
        for metric in vars(m).values():
            if not isinstance(metric, (Counter, Gauge, Histogram)):
                continue
            (fam,) = metric.describe()
            labels = set(metric._labelnames)  # prometheus_client keeps them here; describe() drops them
            if isinstance(metric, Counter):
                names = [fam.name + "_total"]
            elif isinstance(metric, Histogram):
                names = [fam.name + s for s in ("_bucket", "_sum", "_count")]
                out[fam.name + "_bucket"] = labels | {"le"}
                names = names[1:]
            else:
                names = [fam.name]
            for n in names:
                out[n] = labels
    return out


def test_decodes_with_grafanas_dashboard_model():
    sdk = pytest.importorskip("grafana_foundation_sdk", reason="pip install -e '.[test]'")
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import prometheus
    from grafana_foundation_sdk.models.dashboard import Dashboard

    assert sdk
    plugins.register_default_plugins()
    d = _dashboard()
    model = Dashboard.from_json(d)
    back = json.loads(JSONEncoder(sort_keys=True).encode(model))
    lost = []

    def walk(a, b, path):
        if isinstance(a, dict):
            if not isinstance(b, dict):
                lost.append(path)
                return
            for k, v in a.items():
                if k not in b:
                    lost.append(f"{path}.{k}")
                else:
                    walk(v, b[k], f"{path}.{k}")
        elif isinstance(a, list):
            if not isinstance(b, list) or len(a) != len(b):
                lost.append(path)
                return
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif a != b:
            lost.append(f"{path}: {a!r} became {b!r}")

    walk(d, back, "dashboard")
    assert not lost, f"keys or values Grafana's dashboard model does not keep: {lost}"
    # the queries decoded as Prometheus queries, the panels' options as their plugin's
    for p in model.panels:
        assert all(isinstance(t, prometheus.Dataquery) for t in p.targets), p.title
        assert p.options is not None and not isinstance(p.options, dict), p.title
    assert model.schema_version >= 39


def test_every_panel_has_what_grafana_needs():
    d = _dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 39
    assert {v["name"] for v in d["templating"]["list"]} >= {"datasource"}
    ids = [p["id"] for p in d["panels"]]
    assert len(set(ids)) == len(ids)
    for p in d["panels"]:
        assert p["type"] in PANEL_TYPES and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")) and 0 < g["w"] and g["x"] + g["w"] <= 24
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs)
        assert all(t["expr"].strip() for t in p["targets"])
    # panels do not overlap
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not (cells & mine), p["title"]
        cells |= mine


def test_every_metric_and_label_in_the_queries_is_exported():
    names = exported()
    assert "specmesh_time_to_first_token_seconds_bucket" in names and "specmesh_verify_batch_size_sum" in names
    used = set()
    for p, t in _targets(_dashboard()):
        expr = t["expr"]
        metrics = set(re.findall(r"\b(specmesh_[a-z0-9_]+)", expr))
        assert metrics, (p["title"], expr)
        missing = metrics - set(names)
        assert not missing, f"{p['title']}: {sorted(missing)} are not exported by our metrics registries"
        used |= metrics
        labels = set().union(*(names[m] for m in metrics))
        grouped = {x.strip() for g in re.findall(r"\bby \(([^)]*)\)", expr) for x in g.split(",") if x.strip()}
        matched = set(re.findall(r"[{,]\s*([a-z_]+)\s*(?:=~|!~|!=|=)", expr))
        assert grouped | matched <= labels | {"le"}, (p["title"], (grouped | matched) - labels)
        legend = set(re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", "")))
        assert legend <= grouped, (p["title"], legend - grouped)
    # the strategy variable's values come from an exported metric with that label
    (var,) = [v for v in _dashboard()["templating"]["list"] if v["name"] == "strategy"]
    m = re.match(r"label_values\((\w+), (\w+)\)", var["query"]["query"])
    assert m and m.group(1) in names and m.group(2) in names[m.group(1)]
    assert len(used) >= 10


@pytest.mark.parametrize("needle,metric", [
    ("tokens/s", "specmesh_generated_tokens_total"),
    ("τ", "specmesh_rounds_total"),
    ("by draft position", "specmesh_accepted_tokens_by_position_total"),
    ("time to first token", "specmesh_time_to_first_token_seconds_bucket"),
    ("inter-token latency", "specmesh_inter_token_latency_seconds_bucket"),
    ("by strategy", "specmesh_requests_total"),
    ("verify batch size", "specmesh_verify_batch_size_bucket"),
])
def test_the_panels_asked_for(needle, metric):
    panels = [p for p in _dashboard()["panels"] if needle in p["title"].lower()]
    assert panels, needle
    assert any(metric in t["expr"] for p in panels for t in p["targets"]), (needle, metric)
    if metric.endswith("_bucket"):
        assert any("histogram_quantile" in t["expr"] for p in panels for t in p["targets"])
