"""The house's import rules, read from the source (nothing is imported):

- no import circle among Strata's modules, counting imports inside functions and those for
  type checking only (``if TYPE_CHECKING:``: they never run, but a reader follows them);
- the shared library in ``strata/`` is built in floors (``FLOORS``, docs/ARCHITECTURE.md) and
  a module imports only from its own floor or those below (for type checking too);
- nothing in the library imports ``strata.worker`` or ``strata.coordinator`` (not even for
  types) except the two launchers, the CLI and the local cluster; the coordinator never
  imports the worker (it holds no TensorFlow) and the worker never imports the coordinator.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: source folder -> the package it installs as (pyproject.toml's package-dir)
FOLDERS = {"strata": "strata", "coordinator": "strata.coordinator", "worker": "strata.worker",
           "protos": "strata.protos"}

#: the library's floors, lowest first. A module not named is refused by the test: a new module
#: takes a floor when it is added.
FLOORS: list[tuple[str, set[str]]] = [
    ("ground: types, errors, units, the task contract, model descriptions, queues", {
        "strata", "strata.errors", "strata.units", "strata.jobspec", "strata.exitcodes",
        "strata.limits",
        "strata.cpukernels", "strata.types", "strata.taskconfig", "strata.layerbase",
        "strata.layers", "strata.modelspec", "strata.safeyaml", "strata.uploads", "strata.dataroots",
        "strata.tfconfig", "strata.auth", "strata.tls", "strata.queues"}),
    ("estimators and planner", {
        "strata.memory", "strata.oom", "strata.measured", "strata.stagememory", "strata.psplan",
        "strata.planner", "strata.planner.search"}),
    ("strategies", {
        "strata.strategies", "strata.strategies.base", "strata.strategies.mirrored",
        "strata.strategies.pipeline", "strata.strategies.hybrid",
        "strata.strategies.parameter_server"}),
    ("the job spec's parse, checked against the strategies' rules", {"strata.spec"}),
    ("the service edge: protobuf conversion, the client", {"strata.convert", "strata.client"}),
    ("launchers", {"strata.local", "strata.cli", "strata.clicommon", "strata.clijobs",
                   "strata.clicluster", "strata.clioffline", "strata.cliparser"}),
]
LAUNCHERS = {"strata.local", "strata.cli", "strata.clicommon", "strata.clijobs",
             "strata.clicluster", "strata.clioffline", "strata.cliparser"}


def _modules() -> dict[str, str]:
    out = {}
    for folder, package in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py") or "_pb2" in f:
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join([package] + parts)] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> list[tuple[str, bool]]:
    """(imported Strata module, only for type checking) for each import in ``path``."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found: list[tuple[str, bool]] = []
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]

    def names(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit_one(stmt, True)
                for stmt in child.orelse:
                    visit_one(stmt, typing_only)
            else:
                visit_one(child, typing_only)

    def visit_one(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in names(node):
                if name in MODULES and name != module:
                    found.append((name, typing_only))
        visit(node, typing_only)

    visit(tree, False)
    return found


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}


def _floor_of(module: str) -> int | None:
    for i, (_, members) in enumerate(FLOORS):
        if module in members:
            return i
    return None


def test_every_library_module_has_a_floor():
    library = {m for m in MODULES if not m.startswith(("strata.coordinator", "strata.worker",
                                                       "strata.protos"))}
    missing = sorted(m for m in library if _floor_of(m) is None)
    assert not missing, f"give these modules a floor in FLOORS: {missing}"
    named = set().union(*(members for _, members in FLOORS))
    assert not named - set(MODULES), f"FLOORS names modules that do not exist: {named - set(MODULES)}"


def test_no_import_circle():
    """Not even through imports for type checking: a reader (or a tool) sees those too."""
    graph = {m: {n for n, _ in IMPORTS[m]} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    detail = [[(a, b) for a in c for b in sorted(graph[a]) if b in c] for c in circles]
    assert not circles, f"import circles (module -> module within each): {detail}"


def test_library_imports_go_down_the_floors():
    wrong = []
    for m, imports in IMPORTS.items():
        mine = _floor_of(m)
        if mine is None:
            continue
        for n, typing_only in imports:
            theirs = _floor_of(n)
            if theirs is not None and theirs > mine:
                wrong.append(f"{m} (floor {mine}) imports {n} (floor {theirs})")
    assert not wrong, "\n".join(wrong)


def test_no_upward_import_out_of_the_library():
    wrong = []
    for m, imports in IMPORTS.items():
        for n, _ in imports:
            upward = n.startswith(("strata.worker", "strata.coordinator"))
            if _floor_of(m) is not None and upward and m not in LAUNCHERS:
                wrong.append(f"{m} imports {n}")
            if m.startswith("strata.coordinator") and n.startswith("strata.worker"):
                wrong.append(f"{m} imports {n} (the coordinator holds no TensorFlow)")
            if m.startswith("strata.worker") and n.startswith("strata.coordinator"):
                wrong.append(f"{m} imports {n}")
    assert not wrong, "\n".join(wrong)


def test_the_rules_see_a_circle_and_an_upward_import():
    """The reader itself: a function-level import counts, a TYPE_CHECKING one does not."""
    spec = dict(IMPORTS["strata.spec"])
    assert "strata.strategies" in spec and spec["strata.strategies"] is False
    types_only = [n for n, typing_only in IMPORTS["strata.types"] if typing_only]
    assert "strata.jobspec" in types_only
