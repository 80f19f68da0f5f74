"""The house's size rules, read from the source: no module over ``MAX_MODULE_LINES`` lines, and no
function over ``MAX_FUNCTION_LINES`` lines (counted with its nested functions) unless the line
above it (above its decorators) gives the reason, as ``# Long: why``."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("strata", "coordinator", "worker", "protos", "bench")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def _sources() -> list[str]:
    out = []
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            out += [os.path.join(dirpath, f) for f in files
                    if f.endswith(".py") and "_pb2" not in f]
    return sorted(out)


SOURCES = _sources()


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def test_the_rules_see_the_house():
    assert len(SOURCES) > 100 and any(p.endswith("core.py") for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_no_module_over_the_limit(path):
    with open(path) as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_MODULE_LINES, f"{_rel(path)} has {lines} lines: split it by concern"


def _long_without_reason(path: str) -> list[str]:
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text, path)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        above = lines[first - 2].strip() if first >= 2 else ""
        if not above.startswith("# Long: ") or len(above) < len("# Long: ") + 10:
            found.append(f"{node.name} (line {node.lineno}, {length} lines)")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_no_long_function_without_its_reason(path):
    long = _long_without_reason(path)
    assert not long, (f"{_rel(path)}: {', '.join(long)}: over {MAX_FUNCTION_LINES} lines; "
                      "split it, or say why not in a '# Long: ' line above it")


def test_a_long_function_needs_a_reason(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    bare = tmp_path / "bare.py"
    bare.write_text(f"def f():\n{body}\n")
    assert _long_without_reason(str(bare)) == [f"f (line 1, {MAX_FUNCTION_LINES + 1} lines)"]
    said = tmp_path / "said.py"
    said.write_text(f"# Long: one graph whose parts share every tensor\n@decorated\ndef f():\n{body}\n")
    assert _long_without_reason(str(said)) == []
