"""docs/serving.md's SDK snippets ("## Call") run as pasted: each Python block is
compiled as a module (the asyncio one used to fail with ``'async with' outside
async function``) and run against a tiny stack on loopback, the address swapped
for the stack's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import TinyStack

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def _call_blocks() -> list[str]:
    text = DOC.read_text()
    call = text[text.index("\n## Call\n"):]
    call = call[: call.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", call, re.S)


@pytest.fixture(scope="module")
def stack():
    s = TinyStack()
    yield s
    s.close()


def test_the_call_sections_python_blocks_compile_as_modules():
    blocks = _call_blocks()
    assert len(blocks) >= 2 and any("asyncio.run" in b for b in blocks)
    for b in blocks:
        compile(b, "serving.md", "exec")  # a SyntaxError here is what a user pasting it would see


def test_the_snippets_run_against_a_router(stack, capsys):
    for b in _call_blocks():
        assert "127.0.0.1:50051" in b
        exec(compile(b.replace("127.0.0.1:50051", stack.address), "serving.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "auto" in out  # the first request names no strategy: the router's default, and the stats say so
