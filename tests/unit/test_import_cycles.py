"""No import cycle inside a library, hidden or not.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``: a
cycle hidden behind a late import is still two modules that cannot be understood (or
split) apart. Faces (a package's ``__init__`` and its ``advanced`` / ``testing`` tiers)
only name what other modules own, so they are not nodes of the graph.
"""

from __future__ import annotations

import ast

import pytest

from tests.unit.test_layers import LAYER_DIRS

FACES = {"__init__", "advanced", "testing"}


def _graph(layer: str) -> dict[str, set[str]]:
    root = LAYER_DIRS[layer]
    modules = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).with_suffix("")
        if relative.parts[0] == "v1" or relative.name in FACES:
            continue
        modules[".".join(("turnpoint", *relative.parts))] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("layer", sorted(LAYER_DIRS))
def test_no_import_cycle_within_a_library(layer: str) -> None:
    assert _cycle(_graph(layer)) is None


def test_the_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
