"""The README's promises run as written, and its documents' links lead somewhere.

The README's fenced ``bash`` and ``python`` blocks are of four kinds, told by the fence's
info string after the language:

- nothing: runs offline on the bundled model against ``specmesh serve`` (the ``server``
  block) and must exit 0 (a Python block as a script, a shell block under ``bash -e -o
  pipefail``);
- ``server``: the one block that starts the services; this test runs that command itself,
  adding free ports, and the other blocks talk to it (their addresses, the defaults
  ``127.0.0.1:50051`` / ``50052`` / ``50053`` and ``127.0.0.1:8000``, swapped for the
  free ports; ``SPECMESH_ADDRESS`` names the router for commands that take the default);
- ``needs: PROGRAM``: runs like the first kind where PROGRAM is on PATH, else is skipped
  saying so (grpcurl, jq);
- ``no-test: REASON``: never run here (a Kubernetes cluster, Ray, the whole suite);
  skipped with its reason.

The fast tests check the markers and that every relative link of the README and of
``docs/*.md`` names a file that exists and, with ``#anchor``, a heading of it (GitHub's
anchor rule). Knows nothing about what each snippet prints beyond its exit status and
that it printed something.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```\s*$", re.S | re.M)
DEFAULTS = {"router": "127.0.0.1:50051", "drafter": "127.0.0.1:50052", "verifier": "127.0.0.1:50053",
            "http": "127.0.0.1:8000"}


def _blocks() -> list[dict]:
    out = []
    for m in FENCE.finditer(README.read_text()):
        lang, info, body = m.group(1), m.group(2).strip(), m.group(3)
        if lang not in ("bash", "python"):
            continue
        line = README.read_text()[:m.start()].count("\n") + 1
        kind, arg = "run", ""
        if info == "server":
            kind = "server"
        elif info.startswith("needs:"):
            kind, arg = "needs", info.removeprefix("needs:").strip()
        elif info.startswith("no-test:"):
            kind, arg = "no-test", info.removeprefix("no-test:").strip()
        elif info:
            kind, arg = "unknown", info
        out.append({"lang": lang, "kind": kind, "arg": arg, "body": body, "line": line,
                    "id": f"README.md:{line}:{lang}"})
    return out


BLOCKS = _blocks()


def test_every_block_is_runnable_or_says_why_not():
    assert [b["id"] + " " + b["arg"] for b in BLOCKS if b["kind"] == "unknown"] == [], \
        "fence info must be empty, 'server', 'needs: PROGRAM' or 'no-test: REASON'"
    assert all(b["arg"] for b in BLOCKS if b["kind"] in ("needs", "no-test")), "a marker without its reason"
    servers = [b for b in BLOCKS if b["kind"] == "server"]
    assert len(servers) == 1 and _server_command(servers[0]) == ["specmesh", "serve"]
    runnable = [b for b in BLOCKS if b["kind"] in ("run", "needs")]
    assert {b["lang"] for b in runnable} == {"bash", "python"}  # the quickstarts: the CLI, the SDK, OpenAI
    for b in runnable:
        if b["lang"] == "python":
            compile(b["body"], b["id"], "exec")


def _server_command(block: dict) -> list[str]:
    lines = [ln.split("#")[0].strip() for ln in block["body"].splitlines()]
    lines = [ln for ln in lines if ln]
    assert len(lines) == 1, "the server block is one command"
    return lines[0].split()


# ---------------------------------------------------------------- links

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (``-``
    and ``_`` kept), spaces to ``-``."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h.replace("`", ""))
    return h.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # headings in code are not headings
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M):
        s = _slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _links(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    text_no_code = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    out = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text_no_code):
        target = m.group(1)
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            out.append((text_no_code[:m.start()].count("\n") + 1, target))
    return out


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_lead_to_files_and_headings(doc):
    bad = []
    for line, target in _links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{doc.name}:{line}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{doc.name}:{line}: {target} (no such heading)")
    assert bad == []


# ---------------------------------------------------------------- the snippets, on the real model

@pytest.fixture(scope="module")
def serve():
    """The README's ``specmesh serve`` on free ports; its addresses by service."""
    block = next(b for b in BLOCKS if b["kind"] == "server")
    ports = {k: free_port() for k in ("router", "drafter", "verifier", "http", "sup")}
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    cmd = [*_server_command(block), "--router-port", str(ports["router"]), "--drafter-port", str(ports["drafter"]),
           "--verifier-port", str(ports["verifier"]), "--http-port", str(ports["http"]),
           "--router-metrics-port", "0", "--drafter-metrics-port", "0", "--verifier-metrics-port", "0",
           "--supervisor-metrics-port", str(ports["sup"])]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        up = wait_for(lambda: any(ln.startswith("try: specmesh generate") for ln in log) or proc.poll() is not None,
                      600)
        assert up and proc.poll() is None, "specmesh serve did not come up:\n" + "".join(log[-60:])
        addr = {k: f"127.0.0.1:{ports[k]}" for k in ("router", "drafter", "verifier", "http")}
        yield {"addr": addr, "env": env, "log": log}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _localised(body: str, addr: dict) -> str:
    for k, default in DEFAULTS.items():
        body = body.replace(default, addr[k])
    return body


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b["kind"] not in ("server", "unknown")],
                         ids=lambda b: b["id"])
def test_readme_snippet_runs(block, serve):
    if block["kind"] == "no-test":
        pytest.skip(f"{block['id']}: {block['arg']}")
    if block["kind"] == "needs" and shutil.which(block["arg"], path=serve["env"]["PATH"]) is None:
        pytest.skip(f"{block['id']}: needs {block['arg']}, which is not on PATH")
    body = _localised(block["body"], serve["addr"])
    env = dict(serve["env"], SPECMESH_ADDRESS=serve["addr"]["router"])
    cmd = [sys.executable, "-c", body] if block["lang"] == "python" else ["bash", "-e", "-o", "pipefail", "-c", body]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{block['id']} exited {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n" \
                              f"--- stderr\n{r.stderr[-3000:]}\n--- server log\n{''.join(serve['log'][-30:])}"
    assert r.stdout.strip(), f"{block['id']} printed nothing on stdout\n{r.stderr[-2000:]}"
