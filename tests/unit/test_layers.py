"""The package layout and its layers (docs/design.md, "Packages" and "Layering rules").

- One namespace: ``router/``, ``drafter_service/``, ``verifier_service/`` and
  ``kernels/`` are ``specmesh.router`` ... ``specmesh.kernels`` (pyproject
  ``package-dir``), whose package list names every package folder. Every module
  imports from outside the repository (the installed mapping alone), and from
  the repository root the bare names (``import router``) load nothing.
- Imports, read with ``ast`` (module level and inside functions, relative ones
  resolved): no cycle between modules, neither at module level nor counting
  the lazy imports; every module sits in a layer of ``LAYERS``, which names whole
  packages (and the top-level modules of ``specmesh``) only, never a module inside
  another package, and imports only from its own layer or lower ones, with no
  exception (``ALLOWED_UPWARD`` stays empty): every command and composition root is in
  ``specmesh.cli`` (and the platform entry points the manifests name, in
  ``specmesh.deploy``), at the top; inside ``specmesh.cli`` the benchmarks sit above
  the other commands; the SDK (``client``) imports nothing of ``serving``: what both
  speak on the wire is ``specmesh.wire``, below both; the core (types, seeding, trees,
  acceptance, the engine package with its CPU kernels and rowops, verifier, loop,
  drafters) reaches no gRPC, protos, serving, services or deployment code, even
  transitively; the engine package takes from the rest of specmesh only the leaves and
  the model loading; the (Triton) kernels import only torch, triton and themselves;
  nothing imports a folder by its bare name.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> its folder (pyproject.toml [tool.setuptools.package-dir]; the rest of specmesh sits in specmesh/)
FOLDERS = {"specmesh": ROOT / "specmesh", "specmesh.router": ROOT / "router",
           "specmesh.drafter_service": ROOT / "drafter_service", "specmesh.verifier_service": ROOT / "verifier_service",
           "specmesh.kernels": ROOT / "kernels"}
BARE = ("router", "drafter_service", "verifier_service", "kernels")

# The layers, lowest first (docs/design.md, "Layering rules"); a module belongs to the
# layer of its longest matching prefix and may import only from that layer or lower ones.
LAYERS = [
    ("leaves", ["specmesh.types", "specmesh.seeding", "specmesh.seqs", "specmesh.trees",
                "specmesh.errors", "specmesh.workloads", "specmesh.results", "specmesh.threads",
                "specmesh.kernels", "specmesh.v1", "specmesh.tools", "specmesh.tool_parse", "specmesh.prefix_cache"]),
    # the engine package: its forward, the CUDA-graph engine, the device choice, the CPU
    # kernels and rowops (specmesh/engine/__init__.py)
    ("numerics", ["specmesh.acceptance", "specmesh.engine", "specmesh.models", "specmesh.grammar",
                  "specmesh.processors"]),
    ("contracts", ["specmesh.verifier", "specmesh.prefix_reuse", "specmesh.drafters", "specmesh.loop",
                   "specmesh.contrastive", "specmesh.ahead"]),
    ("above the loop", ["specmesh.blockdraft", "specmesh.strategies", "specmesh.uno"]),
    ("in-process assembly", ["specmesh.runtime"]),
    # channels and proto <-> domain conversion: what the SDK and the servers both speak
    ("wire", ["specmesh.wire"]),
    ("observability", ["specmesh.observability"]),
    ("SDK", ["specmesh.client"]),
    # the servers' shared parts and the OpenAI front, which speaks the SDK to the routers
    ("gRPC layer", ["specmesh.serving"]),
    ("services", ["specmesh.router", "specmesh.drafter_service", "specmesh.verifier_service"]),
    # the entry points (composition roots): every command, the in-process stack and the
    # benchmarks in specmesh.cli; the platform entry points that the manifests name by
    # path (the Ray app, the DNS router) in specmesh.deploy. What a command needs from
    # another moves down (specmesh.workloads, specmesh.results) instead of importing across
    ("entry points", ["specmesh.cli", "specmesh.deploy"]),
]
ROOT_PACKAGE_LAYER = "SDK"  # ``specmesh`` itself: it re-exports the SDK (lazily)
# (importer, imported) pairs allowed to import upwards: none (an entry point lives in the
# entry points' packages, never inside a library package below them)
ALLOWED_UPWARD: set = set()
CORE = ("specmesh.types", "specmesh.seeding", "specmesh.seqs", "specmesh.trees", "specmesh.prefix_cache",
        "specmesh.acceptance", "specmesh.grammar", "specmesh.processors", "specmesh.tools", "specmesh.tool_parse",
        "specmesh.prefix_reuse",
        "specmesh.engine", "specmesh.verifier", "specmesh.loop", "specmesh.drafters", "specmesh.contrastive",
        "specmesh.ahead")
CORE_MUST_NOT_REACH = ("grpc", "google.protobuf", "specmesh.v1", "specmesh.wire", "specmesh.serving", "specmesh.client",
                       "specmesh.observability", "specmesh.router", "specmesh.drafter_service",
                       "specmesh.verifier_service", "specmesh.deploy")
OPTIONAL = ("ray", "triton")  # extras: a module needing one that is missing is skipped, not failed


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if not all((folder.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(len(parts))):
                continue  # not inside a package
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _resolve(name: str):
    """The module of ours that an imported name lives in (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[str, bool, int]]:
    """(imported name, lazy, line) of every import statement; ``from a import b`` names
    ``a.b`` when that is a module, else ``a``; ``if TYPE_CHECKING:`` blocks are skipped."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, lazy, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([child.module] if child.module else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    found.append((full if full in MODULES else base, lazy, child.lineno))
            else:
                visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}


def _graph(lazy: bool) -> dict[str, set[str]]:
    return {m: {t for t in (_resolve(n) for n, is_lazy, _ in imps if lazy or not is_lazy) if t and t != m}
            for m, imps in IMPORTS.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _layer(module: str):
    if module == "specmesh":
        return [n for n, _ in LAYERS].index(ROOT_PACKAGE_LAYER)
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _under(module, [p]) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


# ---------------------------------------------------------------- the namespace

def test_pyproject_names_every_package_folder():
    tomllib = pytest.importorskip("tomllib")
    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert st["package-dir"] == {pkg: folder.name for pkg, folder in FOLDERS.items() if pkg != "specmesh"}
    packages = sorted(m for m, p in MODULES.items() if p.name == "__init__.py")
    assert sorted(st["packages"]) == packages


def test_every_module_imports_from_outside_the_repository(tmp_path):
    """A fresh interpreter in another directory (no repository root on sys.path) finds
    every module through the installed mapping alone."""
    code = (
        "import importlib, importlib.util, json, sys\n"
        f"optional = {OPTIONAL!r}\n"
        "out = {'failed': {}, 'skipped': {}, 'files': {}}\n"
        f"for m in {sorted(MODULES)!r}:\n"
        "    try:\n"
        "        if m.endswith('.__main__'):  # found, not run (running it is `python -m`)\n"
        "            if importlib.util.find_spec(m) is None:\n"
        "                raise ImportError(m)\n"
        "            continue\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError as e:\n"
        "        key = 'skipped' if (e.name or '').split('.')[0] in optional else 'failed'\n"
        "        out[key][m] = repr(e)\n"
        "    except Exception as e:\n"
        "        out['failed'][m] = repr(e)\n"
        "out['files'] = {m: getattr(sys.modules.get(m), '__file__', None) for m in " + repr(sorted(FOLDERS)) + "}\n"
        "specs = [importlib.util.find_spec(n) for n in " + repr(BARE) + "]\n"
        "out['bare'] = [s.origin for s in specs if s is not None and (s.origin or '').startswith("
        + repr(str(ROOT)) + ")]\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["failed"] == {}
    assert out["files"] == {pkg: str(folder / "__init__.py") for pkg, folder in FOLDERS.items()}
    assert out["bare"] == []  # outside the repository the bare names are not ours (another package may own one)
    if out["skipped"]:
        print("skipped (optional dependency missing):", out["skipped"])


def test_bare_names_load_nothing_from_the_repository_root():
    """With the repository root on sys.path (``python -m`` from it, pytest's
    ``pythonpath``) ``import router`` finds the folder; it must stay an empty
    placeholder, so no module ever runs under two names."""
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        f"for n in {BARE!r}:\n"
        "    m = importlib.import_module(n)\n"
        "    sub = 'servicer' if n != 'kernels' else 'ops'\n"
        "    try:\n"
        "        importlib.import_module(f'{n}.{sub}')\n"
        "        loaded = True\n"
        "    except ImportError:\n"
        "        loaded = False\n"
        "    out[n] = [sorted(k for k in vars(m) if not k.startswith('__')), loaded]\n"
        "import specmesh.router.servicer, specmesh.kernels\n"
        "out['ours'] = sorted(k for k in sys.modules if k.split('.')[0] in " + repr(BARE) + ")\n"
        "out['real'] = callable(specmesh.kernels.chain_accept)\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for n in BARE:
        assert out[n] == [[], False], n  # no attributes, no submodules
    assert out["ours"] == sorted(BARE) and out["real"]


def test_nothing_imports_a_folder_by_its_bare_name():
    files = [p for d in ("specmesh", "tests", "scripts", *BARE) for p in (ROOT / d).rglob("*.py")]
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in BARE]
    assert bad == [], "import these as specmesh.<name>"


# ---------------------------------------------------------------- the imports

def test_no_import_cycle():
    assert _cycles(_graph(lazy=False)) == [], "module-level import cycle"
    assert _cycles(_graph(lazy=True)) == [], "import cycle through function-level (lazy) imports"


def test_layers_name_whole_packages_only():
    """A layer names packages and the top-level modules of ``specmesh``, never a module
    inside another package (that would put one package in two layers); and no import
    is excused from going downwards."""
    named = [p for _, prefixes in LAYERS for p in prefixes]
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    top_modules = {m for m in MODULES if m.rpartition(".")[0] == "specmesh" and m not in packages}
    assert [p for p in named if p not in packages and p not in top_modules] == []
    assert len(named) == len(set(named))
    assert ALLOWED_UPWARD == set()


def test_the_sdk_imports_nothing_of_the_servers():
    """``specmesh.client`` reaches no ``serving`` module, nor a service, even lazily or
    transitively: the wire helpers both use are ``specmesh.wire``; the OpenAI front's use
    of the SDK is the only arrow between the SDK and the servers."""
    graph = _graph(lazy=True)
    seen, todo = set(), ["specmesh.client"]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += graph[v]
    assert [v for v in sorted(seen) if _under(v, ["specmesh.serving", "specmesh.router", "specmesh.drafter_service",
                                                   "specmesh.verifier_service", "specmesh.cli",
                                                   "specmesh.deploy"])] == []
    into_sdk = sorted(m for m, targets in graph.items()
                      if "specmesh.client" in targets and _under(m, ["specmesh.serving"]))
    assert into_sdk == ["specmesh.serving.openai_http"]


def test_every_module_has_a_layer_and_imports_downwards():
    names = [n for n, _ in LAYERS]
    assert [m for m in MODULES if _layer(m) is None] == [], "give these a layer in LAYERS (and docs/design.md)"
    upward = []
    for m, imps in IMPORTS.items():
        for name, lazy, line in imps:
            t = _resolve(name)
            if t and t != m and _layer(t) > _layer(m) and (m, t) not in ALLOWED_UPWARD:
                upward.append(f"{m} ({names[_layer(m)]}) -> {t} ({names[_layer(t)]}), "
                              f"{MODULES[m].relative_to(ROOT)}:{line}{' (lazy)' if lazy else ''}")
    assert upward == []


def test_benchmarks_sit_above_the_other_commands():
    """Inside ``specmesh.cli``: a benchmark may run a trained drafter, a study's code or a
    served stack (``cli.stack``), and of the other commands it imports only that stack;
    the serving, training and study commands import nothing of ``cli.bench`` (what they
    share with it lives lower down: ``workloads``, ``results``); only the parser
    (``specmesh.cli``) and the demo, above them all, do."""
    graph = _graph(lazy=True)
    bench, top = "specmesh.cli.bench", ("specmesh.cli", "specmesh.cli.__main__", "specmesh.cli.demo")
    assert [m for m in MODULES if _under(m, [bench])], "no specmesh.cli.bench package"
    bad = [f"{m} -> {t}" for m, targets in graph.items() for t in sorted(targets)
           if _under(t, [bench]) and not _under(m, [bench]) and m not in top]
    bad += [f"{m} -> {t}" for m, targets in graph.items() if _under(m, [bench]) for t in sorted(targets)
            if _under(t, ["specmesh.cli"]) and not _under(t, [bench]) and t != "specmesh.cli.stack"]
    assert bad == []


def test_core_reaches_no_grpc_protos_serving_services_or_deployment():
    graph = _graph(lazy=True)
    bad = []
    for start in [m for m in MODULES if _under(m, CORE)]:
        seen, todo = set(), [start]
        while todo:  # everything it can ever import, lazily or not
            v = todo.pop()
            if v not in seen:
                seen.add(v)
                todo += graph[v]
        for v in sorted(seen):
            for name, lazy, line in IMPORTS[v]:
                target = _resolve(name) or name
                if _under(target, CORE_MUST_NOT_REACH):
                    bad.append(f"{start}: {v} imports {target} ({MODULES[v].relative_to(ROOT)}:{line})")
    assert bad == []


def test_engine_package_takes_only_leaves_and_model_loading():
    """``specmesh.engine`` (the forward, the CUDA-graph engine, the device choice, the CPU
    kernels) sits under acceptance and the verifier: of the rest of specmesh it imports
    only the leaves (types, trees ...) and ``specmesh.models``."""
    leaves = _layer("specmesh.types")
    bad = []
    for m, imps in IMPORTS.items():
        if _under(m, ["specmesh.engine"]):
            for name, lazy, line in imps:
                t = _resolve(name)
                if t and not _under(t, ["specmesh.engine", "specmesh.models"]) and _layer(t) != leaves:
                    bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {t}")
    assert [m for m in MODULES if _under(m, ["specmesh.engine"])], "no specmesh.engine package"
    assert bad == []


def test_kernels_import_only_torch_triton_and_themselves():
    outside = set(sys.stdlib_module_names) | {"__future__", "torch", "triton"}
    bad = []
    for m, imps in IMPORTS.items():
        if _under(m, ["specmesh.kernels"]):
            for name, _, line in imps:
                ours = _resolve(name)
                if not (_under(ours, ["specmesh.kernels"]) if ours else name.split(".")[0] in outside):
                    bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {name}")
    assert bad == []
