"""PNG charts of a benchmark result (matplotlib, Agg backend, no display needed).

  speedup.png       speedup over the system's own AR, per workload and system
  tokens_per_s.png  tokens/s per workload and system
  acceptance.png    accepted-length histograms, one panel per speculative ours_*
                    system (rounds summed over prompts, per workload), with the
                    ceiling bin (whole draft budget accepted) marked
  forward_costs.png the engine probe: a forward's cost by scored rows, ours and
                    llama.cpp, in one-row forwards and in ms (``meta["vs_llamacpp"]``)

This module knows nothing about how the numbers were measured.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _grouped(ax, records: list[dict], key: str, systems: list[str], workloads: list[str]) -> None:
    idx = {(r["system"], r["workload"]): r.get(key) for r in records}
    width = 0.8 / max(len(systems), 1)
    for i, s in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(workloads))]
        ys = [idx.get((s, w)) or 0.0 for w in workloads]
        ax.bar(xs, ys, width, label=s)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=15)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)


def speedup(records: list[dict], path: Path) -> None:
    systems = list(dict.fromkeys(r["system"] for r in records if r["speedup_vs_own_ar"] is not None
                                 and r["system"] != r.get("reference")))
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if systems:
        _grouped(ax, records, "speedup_vs_own_ar", systems, workloads)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
    else:
        ax.text(0.5, 0.5, "no speculative system with its AR reference in this run", ha="center", transform=ax.transAxes)
    ax.set_ylabel("speedup vs own AR (x)")
    ax.set_title("Speedup over each system's own autoregressive decoding")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tokens_per_s(records: list[dict], path: Path) -> None:
    systems = list(dict.fromkeys(r["system"] for r in records))
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    _grouped(ax, records, "tokens_per_s", systems, workloads)
    ax.set_ylabel("tokens / s")
    ax.set_title("Decoding throughput (1 stream, greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance(records: list[dict], path: Path) -> None:
    recs = [r for r in records if r["system"].startswith("ours_") and r.get("acceptance_hist")]
    systems = list(dict.fromkeys(r["system"] for r in recs))
    n = max(len(systems), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    if not systems:
        axes[0][0].text(0.5, 0.5, "no speculative ours_* system in this run", ha="center",
                        transform=axes[0][0].transAxes)
    for ax, s in zip(axes[0], systems):
        rs = [r for r in recs if r["system"] == s]
        budget = rs[0].get("budget") or 0
        nbins = max(max(len(r["acceptance_hist"]) for r in rs), budget + 1)
        width = 0.8 / len(rs)
        for i, r in enumerate(rs):
            h = r["acceptance_hist"] + [0] * (nbins - len(r["acceptance_hist"]))
            tot = sum(h) or 1
            ax.bar([b + (i - (len(rs) - 1) / 2) * width for b in range(nbins)], [c / tot for c in h], width,
                   label=r["workload"])
        if budget:
            ax.axvspan(budget - 0.45, budget + 0.45, color="red", alpha=0.12)
            ax.text(budget, ax.get_ylim()[1] * 0.92, "ceiling", color="red", ha="center", fontsize=8)
        ax.set_title(s, fontsize=10)
        ax.set_xlabel("accepted draft tokens per round")
        ax.set_ylabel("fraction of rounds")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def forward_costs(probe: dict, path: Path) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for side, label in (("ours", "specmesh"), ("llamacpp", "llama.cpp")):
        f = (probe.get(side) or {}).get("forward_ms") or {}
        ms = [m for m in probe.get("rows", []) if f.get(str(m))]
        if ms and f.get("1"):
            a1.plot(ms, [f[str(m)] / f["1"] for m in ms], marker="o", label=label)
            a2.plot(ms, [f[str(m)] for m in ms], marker="o", label=label)
    a1.plot([1, max(probe.get("rows", [1]))], [1, 1], color="grey", linestyle=":", linewidth=1)
    a1.set_title("forward cost / one-row forward")
    a2.set_title("forward ms")
    for ax in (a1, a2):
        ax.set_xlabel("scored rows")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(records: list[dict], out_dir: Path, meta: dict = None) -> list[Path]:
    out_dir = Path(out_dir)
    paths = [out_dir / "speedup.png", out_dir / "tokens_per_s.png", out_dir / "acceptance.png"]
    speedup(records, paths[0])
    tokens_per_s(records, paths[1])
    acceptance(records, paths[2])
    if meta and meta.get("vs_llamacpp"):
        paths.append(out_dir / "forward_costs.png")
        forward_costs(meta["vs_llamacpp"], paths[-1])
    return paths
