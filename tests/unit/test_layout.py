"""The layout stays honest: no import cycles, dependencies point one way, files stay short, and
docs/architecture.md names only paths that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "batonlm"
MAX_LINES = 400

# package -> the batonlm packages it must never import (at any depth, lazily or not)
FORBIDDEN = {
    "kernels": {"ipc", "scheduler", "device", "model_runner", "server", "tokenizer_manager", "bench", "distributed"},
    "distributed": {"ipc", "scheduler", "device", "model_runner", "server", "tokenizer_manager", "bench"},
    "model_runner": {"scheduler", "device", "server", "tokenizer_manager", "bench"},
    "device": {"scheduler", "server", "tokenizer_manager", "bench"},
    "scheduler": {"server", "tokenizer_manager", "bench"},
    "ipc": {"scheduler", "device", "model_runner", "server", "tokenizer_manager", "bench"},
    "tokenizer_manager": {"scheduler", "device", "model_runner", "server", "bench"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    """batonlm modules imported by a file (an imported name that is a module counts as one)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            out.update(submodules)
            if node.module in modules and len(submodules) < len(node.names):  # names defined in it
                out.add(node.module)
    return {m for m in out if m.startswith("batonlm")}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_the_cycle_finder_finds_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {m: _imports(p, modules, top_level_only=True) for m, p in modules.items()}
    cycles = find_cycles(graph)
    assert not cycles, f"import cycles: {cycles}"


def test_dependencies_point_one_way():
    modules = _modules()
    bad = []
    for m, p in modules.items():
        parts = m.split(".")
        if len(parts) < 2 or parts[1] not in FORBIDDEN:
            continue
        for dep in _imports(p, modules, top_level_only=False):
            dep_pkg = dep.split(".")[1] if dep.count(".") else ""
            if dep_pkg in FORBIDDEN[parts[1]]:
                bad.append(f"{m} imports {dep}")
    assert not bad, "\n".join(bad)


def test_no_file_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concept: {long}"


def test_the_architecture_map_names_only_existing_paths():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:batonlm|tests|docs|configs|benchmarks|docker)/[A-Za-z0-9_./-]*)`", text))
    assert len(named) > 40, "the map should name the code's files"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    # And every module of the package appears in it, by its path or its folder.
    unmapped = []
    for p in PACKAGE.rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        if p.name == "__init__.py" or "/bench/" in rel or "/assets/" in rel or rel.endswith("__main__.py"):
            continue
        if rel not in text and not any(f"`{parent}/`" in text for parent in _parents(rel)):
            unmapped.append(rel)
    assert not unmapped, f"modules missing from docs/architecture.md: {unmapped}"


def _parents(rel: str) -> list[str]:
    parts = rel.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(1, len(parts))]
