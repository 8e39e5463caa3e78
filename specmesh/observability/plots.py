"""PNG pictures (matplotlib, Agg backend: no display needed).

- ``timeline_png(request, path)``: one request's rounds from a trace. Top: the
  request on a time axis, each round drawn from its start as draft / network /
  verify / other segments (lengths measured, order inside a round schematic).
  Bottom: the same split as stacked bars per round, with accepted/drafted
  written over each bar.
- ``acceptance_png(accs, path, threshold)``: the acceptance histogram of each
  group with the ceiling bin (a = the longest draft) marked, τ, the ceiling
  fraction and the preflight verdict.

This module only draws what it is given.
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"draft": "#4C72B0", "network": "#8C8C8C", "verify": "#DD8452", "other": "#D9D9D9"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_png(request, path) -> Path:
    from .traces import phases

    plt = _plt()
    rounds = request.rounds
    t0 = request.span.get("start_ns") or (rounds[0].span.get("start_ns") if rounds else 0)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 6.5), gridspec_kw={"height_ratios": [1, 2.2]})
    for r in rounds:
        x = ((r.span.get("start_ns") or t0) - t0) / 1e6
        for name, ms in phases(r).items():
            if ms > 0:
                ax1.broken_barh([(x, ms)], (0, 1), facecolors=COLORS[name])
                x += ms
    end = ((request.span.get("end_ns") or t0) - t0) / 1e6
    ax1.set_xlim(0, max(end, 1e-3))
    ax1.set_yticks([])
    ax1.set_xlabel("ms since the request started (router)")
    ax1.set_title(_title(request), fontsize=10)
    idx = [r.index for r in rounds]
    bottom = [0.0] * len(rounds)
    for name in COLORS:
        vals = [phases(r)[name] for r in rounds]
        ax2.bar(idx, vals, bottom=bottom, color=COLORS[name], label=name, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for r, top in zip(rounds, bottom):
        lab = "prefill" if r.a("prefill", False) else f"{int(r.a('accepted'))}/{int(r.a('drafted'))}"
        ax2.text(r.index, top, lab, ha="center", va="bottom", fontsize=7, rotation=90 if len(rounds) > 40 else 0)
    from matplotlib.ticker import MaxNLocator

    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("round (label: accepted/drafted)")
    ax2.set_ylabel("ms")
    ax2.legend(loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(request) -> str:
    a = request.attrs
    tau = a.get("specmesh.tau")
    parts = [request.label or "request", f"trace {request.trace_id[:12]}", f"{len(request.rounds)} rounds"]
    if a.get("gen_ai.usage.output_tokens") is not None:
        parts.append(f"{a['gen_ai.usage.output_tokens']} tokens")
    if tau is not None:
        parts.append(f"tau {float(tau):.2f}")
    return " | ".join(parts)


def acceptance_png(accs, path, threshold: float = 0.10) -> Path:
    plt = _plt()
    n = max(1, len(accs))
    fig, axes = plt.subplots(n, 1, figsize=(8, 3.2 * n), squeeze=False)
    for ax, acc in zip(axes[:, 0], accs):
        hist = list(acc.hist) + [0] * max(0, acc.block + 1 - len(acc.hist))
        colors = ["#4C72B0"] * len(hist)
        if 0 < acc.block < len(hist):
            colors[acc.block] = "#C44E52" if acc.binds(threshold) else "#8172B3"
        ax.bar(range(len(hist)), hist, color=colors)
        if 0 < acc.block < len(hist):
            ax.annotate("ceiling bin", (acc.block, hist[acc.block]), textcoords="offset points", xytext=(0, 4),
                        ha="center", fontsize=8)
        ax.set_xticks(range(len(hist)))
        ax.set_ylim(0, max(max(hist, default=0), 1) * 1.6)  # room for the verdict above the bars
        ax.set_xlabel("drafted tokens accepted in a round")
        ax.set_ylabel("rounds")
        of = "drafted rounds" if acc.drafted_rounds else "rounds"
        src = acc.source if len(acc.source) <= 40 else "..." + acc.source[-37:]
        d = acc.drafted_rounds if acc.drafted_rounds else acc.rounds
        ax.set_title(f"{acc.label}   ({src})\n{acc.rounds} rounds, tau {acc.tau:.2f}, ceiling bin a={acc.block}: "
                     f"{acc.ceiling_count} of {d} {of} ({acc.ceiling_fraction:.1%})", fontsize=9)
        ax.text(0.99, 0.96, _wrap(acc.verdict(threshold), 70), transform=ax.transAxes, ha="right", va="top", fontsize=8,
                bbox={"boxstyle": "round", "facecolor": "#FFF8E7" if acc.binds(threshold) else "#EEF3FA",
                      "edgecolor": "#999999"})
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wrap(text: str, width: int = 60) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))
