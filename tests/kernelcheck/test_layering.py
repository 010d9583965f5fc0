"""The plugin's import graph: no circle, and each part imports only the parts below it.

Layers, bottom first (every import is read, at the top of a module or inside a function):

- common: ``visible_text``, ``option_values``: text helpers that import nothing of the plugin;
- ``check/``: is the kernel right (shapes, tolerance, references, memory);
- records: ``results/records.py``, ``results/measured.py``, ``results/fields.py`` and ``results/reading.py`` (how a
  row is read), the typed records the A/B engine writes and every
  reader of a report reads, so both sides speak through them;
- ``speed/``: timers, clocks, statistics, the A/B engine;
- ``results/``: the report, its files, saved runs, the gate, plots;
- wiring: ``plugin``, ``plugin_ab``, ``settings``, ``ab_settings``, ``ab_session``, ``option_rules`` and the package's
  ``__init__``; nothing below imports them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest_kernelcheck

PACKAGE = Path(pytest_kernelcheck.__file__).parent
NAME = "pytest_kernelcheck"
COMMON = {"visible_text", "option_values"}
RECORDS = {"results.records", "results.measured", "results.fields", "results.reading"}
WIRING = {"", "plugin", "plugin_ab", "ab_session", "ab_settings", "option_rules", "settings"}
LAYERS = ["common", "check", "records", "speed", "results", "wiring"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    if module in COMMON:
        return "common"
    if module in RECORDS:
        return "records"
    if module in WIRING:
        return "wiring"
    return module.split(".")[0]


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The plugin's modules that ``path`` imports, wherever the import stands in the file."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == NAME or node.module.startswith(NAME + ".")):
                target = node.module[len(NAME) + 1:]
            else:
                continue
            for alias in node.names:  # "from . import report" names a module; "from .report import x" a name
                child = f"{target}.{alias.name}" if target else alias.name
                found.add(child if child in modules else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(NAME + "."):
                    found.add(alias.name[len(NAME) + 1:])
    found.discard(own)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imported_modules(path, modules) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_import_graph_is_read_from_imports_at_the_top_and_inside_functions():
    graph = import_graph()
    assert "results.plots" in graph["results.report"]
    assert "results.storage" in graph["results.build"]
    assert "check.aliasing" in graph["check.tolerance"]  # imported inside assert_close's helper
    assert "results.report_files" in graph["results.storage"]


def test_the_plugin_has_no_import_circle():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_a_circle_through_three_modules():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_each_part_imports_only_the_parts_below_it():
    rank = {layer: position for position, layer in enumerate(LAYERS)}
    upward = sorted(
        f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
        for module, targets in import_graph().items()
        for target in targets
        if rank[layer_of(target)] > rank[layer_of(module)]
    )
    assert upward == []


def test_every_module_belongs_to_a_known_layer():
    assert {layer_of(module) for module in import_graph()} <= set(LAYERS)


def test_no_module_is_over_500_lines():
    long = {module_name(path): n for path in PACKAGE.rglob("*.py") if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}
