"""Measure specmesh's imports: the layers, the arrows between packages, and any that
run upwards or close a cycle (docs/development.md, "Layout").

    .venv/bin/python scripts/imports.py            # layers and package arrows; exit 1 on a bad one
    .venv/bin/python scripts/imports.py --dot > imports.dot && dot -Tpng imports.dot -o imports.png
    .venv/bin/python scripts/imports.py --from specmesh.client   # what one module can reach

It reads every module with ``ast`` (module level and inside functions, relative imports
resolved, ``if TYPE_CHECKING:`` skipped) through the same code and the same ``LAYERS``
table as ``tests/unit/test_layers.py``, so what it prints is what the test checks.
Nothing is imported or run; only the standard library (and pytest, which that test
file imports) is needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layers_test():
    spec = importlib.util.spec_from_file_location("_specmesh_test_layers", ROOT / "tests" / "unit" / "test_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _unit(tl, module: str) -> str:
    """The package (or top-level module) a module belongs to: the longest LAYERS entry."""
    if module == "specmesh":
        return module
    best = max((p for _, prefixes in tl.LAYERS for p in prefixes if tl._under(module, [p])), key=len, default=module)
    return best


def arrows(tl) -> tuple[Counter, list[str]]:
    """(importer package, imported package) -> number of import statements; and every
    upward import, one line each."""
    names = [n for n, _ in tl.LAYERS]
    count, upward = Counter(), []
    for m, imps in tl.IMPORTS.items():
        for name, lazy, line in imps:
            t = tl._resolve(name)
            if not t or t == m:
                continue
            a, b = _unit(tl, m), _unit(tl, t)
            if a != b:
                count[(a, b)] += 1
            if tl._layer(t) > tl._layer(m):
                upward.append(f"{m} ({names[tl._layer(m)]}) -> {t} ({names[tl._layer(t)]}), "
                              f"{tl.MODULES[m].relative_to(ROOT)}:{line}{' (lazy)' if lazy else ''}")
    return count, upward


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dot", action="store_true", help="print the package graph as Graphviz dot, ranked by layer")
    ap.add_argument("--from", dest="start", default=None, help="list every module this one can reach (lazily too)")
    args = ap.parse_args(argv)
    tl = _layers_test()
    count, upward = arrows(tl)
    if args.start:
        graph, seen, todo = tl._graph(lazy=True), set(), [args.start]
        while todo:
            v = todo.pop()
            if v not in seen and v in graph:
                seen.add(v)
                todo += graph[v]
        print("\n".join(sorted(seen)))
        return 0
    if args.dot:
        print("digraph specmesh {\n  rankdir=BT; node [shape=box, fontsize=10];")
        for i, (name, prefixes) in enumerate(tl.LAYERS):
            print(f'  subgraph cluster_{i} {{ label="{i + 1}. {name}"; rank=same; '
                  + " ".join(f'"{p}";' for p in prefixes) + " }")
        for (a, b), n in sorted(count.items()):
            print(f'  "{a}" -> "{b}" [label={n}{", color=red" if tl._layer(b) > tl._layer(a) else ""}];')
        print("}")
        return 1 if upward else 0
    for i, (name, prefixes) in enumerate(tl.LAYERS):
        print(f"{i + 1:2d}. {name}: {', '.join(p.removeprefix('specmesh.') for p in prefixes)}")
    print("\narrows between packages (imports):")
    for (a, b), n in sorted(count.items(), key=lambda kv: (-tl._layer(kv[0][0]), kv[0])):
        mark = "  UPWARD" if tl._layer(b) > tl._layer(a) else ""
        print(f"  {a} -> {b} ({n}){mark}")
    cycles = tl._cycles(tl._graph(lazy=True))
    print(f"\n{len(tl.MODULES)} modules, {sum(count.values())} imports between packages, {len(upward)} upward, "
          f"{len(cycles)} import cycles")
    for line in upward:
        print("  upward:", line)
    for c in cycles:
        print("  cycle:", " -> ".join(c))
    return 1 if upward or cycles else 0


if __name__ == "__main__":
    sys.exit(main())
