"""The package's import graph has no cycle: every `pipeline` import anywhere in a module (top
level, under TYPE_CHECKING, inside a function) is an edge, so a cycle cannot hide behind a late
import. The only late imports are of optional tools' modules (Ray), named here."""

from __future__ import annotations

import ast
from pathlib import Path

import pipeline

ROOT = Path(pipeline.__file__).parent
# imported inside functions on purpose: pipeline.cluster imports Ray, which only cluster builds need
# and the request models (pydantic) from the environment table and the worker protocol, which
# scripts/setup.sh reads with a bare interpreter before any venv exists
LATE_IMPORTS = {
    ("pipeline.cli", "pipeline.cluster"),
    ("pipeline.environments", "pipeline.workers.requests"),
    ("pipeline.workers.protocol", "pipeline.workers.requests"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _edges() -> dict[str, set[str]]:
    """module -> the pipeline modules it imports (`from pipeline.x import y` counts y when y is a
    module of its own)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != name and target.startswith("pipeline"):
                    graph[name].add(target)
    return graph


def _late_imports() -> set[tuple[str, str]]:
    """(module, imported) for every pipeline import inside a function body."""
    found = set()
    for path in ROOT.rglob("*.py"):
        name = _module_name(path)
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline"):
                        found.add((name, node.module))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    graph = _edges()
    graph["pipeline.cli"] -= {b for a, b in LATE_IMPORTS if a == "pipeline.cli"}
    assert len(graph) > 30 and graph["pipeline.project"]  # the walk found the package
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_sees_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_late_imports_but_the_optional_tools() -> None:
    assert _late_imports() <= LATE_IMPORTS, sorted(_late_imports() - LATE_IMPORTS)


def test_the_environment_table_reads_with_a_bare_interpreter() -> None:
    """scripts/setup.sh and lock.sh run `python3 -m pipeline.environments locked` before any venv
    exists: without site-packages (`-S`) it must still print the table."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-S", "-m", "pipeline.environments", "locked"],
        cwd=ROOT.parent, capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "vllm" in res.stdout.split()
