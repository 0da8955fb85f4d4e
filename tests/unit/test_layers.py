"""The house's layers, enforced by parsing every import in the tree.

    turnpoint (core: ids, errors, protocol, auth, conversions, v1)
      <- turnpoint.participant_sdk  <- turnpoint.server
      <- turnpoint.trainer
    turnpoint.apps (CLI, demo, bench, examples) on top; no library imports it.

Every import counts: module level, inside functions (lazy), under ``TYPE_CHECKING``,
and module names written as strings (``python -m turnpoint.x``, ``import_module``), so
that a layer cannot be crossed by hiding the import.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _distributions() -> dict[str, tuple[Path, set[str]]]:
    """Each distribution under the turnpoint namespace: its ``src/turnpoint`` folder and
    the sibling distributions it declares as dependencies. The packaging is the map."""
    found = {}
    for pyproject in sorted(REPO.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        depends = {
            re.split(r"[\[=<>!~ ]", requirement, maxsplit=1)[0]
            for requirement in project.get("dependencies", [])
        }
        found[project["name"]] = (
            pyproject.parent / "src" / "turnpoint",
            {name for name in depends if name.startswith("turnpoint-")},
        )
    return found


DISTRIBUTIONS = _distributions()


def _layer(distribution: str) -> str:
    return distribution.removeprefix("turnpoint-").replace("-", "_")


# Where each layer's source lives, its import name, and which layers it may import (itself
# always allowed): all read from the distributions' own pyproject.toml files.
LAYER_DIRS = {_layer(name): root for name, (root, _) in DISTRIBUTIONS.items()}
PACKAGE_OF = {layer: f"turnpoint.{layer}" for layer in LAYER_DIRS if layer != "core"}
DECLARED = {
    _layer(name): {"core"} | {_layer(d) for d in depends} if name != "turnpoint-core" else {"core"}
    for name, (_, depends) in DISTRIBUTIONS.items()
}
# The architecture the packaging must declare: a change here is a change of design.
ARCHITECTURE = {
    "core": {"core"},
    "participant_sdk": {"core"},
    "server": {"core", "participant_sdk"},
    "trainer": {"core"},
    "apps": {"core", "participant_sdk", "server", "trainer"},
}
ALLOWED = DECLARED
_MODULE_NAME = r"turnpoint(?:\.[A-Za-z_][A-Za-z0-9_]*)+"
# A string that is a module name, or a command line running one (prose in docstrings
# that merely mentions a package is not an import).
_MODULE_STRING = re.compile(rf"^({_MODULE_NAME})$|-m\s+({_MODULE_NAME})")


def layer_of(module: str) -> str | None:
    """The layer a ``turnpoint...`` module name belongs to; None outside the project."""
    if module != "turnpoint" and not module.startswith("turnpoint."):
        return None
    parts = module.split(".")
    if len(parts) > 1:
        for layer, package in PACKAGE_OF.items():
            if parts[1] == package.split(".")[1]:
                return layer
    return "core"


@dataclass(frozen=True)
class Edge:
    source: str  # repository-relative file
    line: int
    target: str  # imported module name
    how: str  # "import", "string"


def _module_name(path: Path, layer: str) -> str:
    relative = path.relative_to(LAYER_DIRS[layer]).with_suffix("")
    parts = [p for p in relative.parts if p != "__init__"]
    return ".".join(["turnpoint", *parts])


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    return ".".join(parts[:keep] + ([node.module] if node.module else []))


def source_files(layer: str) -> Iterator[Path]:
    root = LAYER_DIRS[layer]
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if layer == "core" and relative.parts[0] == "v1":
            continue  # generated code
        yield path


def edges(layer: str, sources: dict[Path, str] | None = None) -> Iterator[Edge]:
    """Every import edge of ``layer``; ``sources`` (path -> text) stands in for its files."""
    if sources is None:
        sources = {path: path.read_text(encoding="utf-8") for path in source_files(layer)}
    for path, text in sources.items():
        module = _module_name(path, layer)
        tree = ast.parse(text, filename=str(path))
        where = str(path.relative_to(REPO))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Edge(where, node.lineno, alias.name, "import")
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, path.name == "__init__.py", node)
                yield Edge(where, node.lineno, target, "import")
                for alias in node.names:  # `from turnpoint import server` imports a package
                    yield Edge(where, node.lineno, f"{target}.{alias.name}", "import-name")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                for match in _MODULE_STRING.finditer(node.value.strip()):
                    yield Edge(where, node.lineno, match.group(1) or match.group(2), "string")


def violations(layer: str, sources: dict[Path, str] | None = None) -> list[str]:
    found = []
    for edge in edges(layer, sources):
        target_layer = layer_of(edge.target)
        if target_layer is None or target_layer == layer:
            continue
        if edge.how == "import-name" and target_layer == "core":
            continue
        if edge.how == "string" and edge.target.split(".")[1:2] == ["v1"]:
            continue  # service names such as "turnpoint.v1.RolloutService"
        if target_layer not in ALLOWED[layer]:
            found.append(f"{edge.source}:{edge.line}: {layer} imports {edge.target} ({edge.how})")
    return found


@pytest.mark.parametrize("layer", sorted(LAYER_DIRS))
def test_no_import_crosses_a_layer(layer: str) -> None:
    assert violations(layer) == []


def test_the_checker_sees_lazy_type_checking_and_string_imports() -> None:
    """Guard the guard: each way of hiding an import is still an edge."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from turnpoint.server.advanced import ParticipantServer\n"
        "def f():\n    import turnpoint.apps.demo\n"
        "CMD = ('python', '-m', 'turnpoint.apps._cli', 'serve')\n"
        "from ..server import _hosted_participant\n"
    )
    probe = LAYER_DIRS["trainer"] / "trainer" / "_layers_probe.py"
    found = violations("trainer", {probe: source})
    assert any("turnpoint.server" in v and "(import)" in v for v in found)
    assert any("turnpoint.apps.demo" in v for v in found)
    assert any("turnpoint.apps._cli" in v and "(string)" in v for v in found)
    assert any(v.startswith("trainer/src/turnpoint/trainer/_layers_probe.py:7") for v in found)


def test_the_packaging_declares_the_architecture() -> None:
    assert DECLARED == ARCHITECTURE
    for layer, root in LAYER_DIRS.items():
        own = {p.name for p in root.iterdir() if p.name != "__pycache__"}
        if layer == "core":  # the namespace's own modules; every library is elsewhere
            assert not own & {*PACKAGE_OF.values()} and not (root / "__init__.py").exists()
        else:  # one package per distribution, under its import name
            assert own == {layer}, (layer, own)


def test_every_file_has_one_path() -> None:
    """No symlinks in the tree, and each library imports from its own distribution's src/
    folder: there is no second name under which the same file loads."""
    tracked = subprocess.run(
        ["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert [line for line in tracked if line.startswith("120000")] == []
    probe = "import json, turnpoint.ids" + "".join(f", {p}" for p in PACKAGE_OF.values())
    probe += "; print(json.dumps({m: sys.modules[m].__file__ for m in sys.modules"
    probe += " if m.count('.') <= 1 and m.startswith('turnpoint.')}))"
    files = json.loads(
        subprocess.run(
            [sys.executable, "-c", "import sys; " + probe],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    for layer, package in PACKAGE_OF.items():
        assert Path(files[package]).resolve() == LAYER_DIRS[layer] / layer / "__init__.py"
    assert Path(files["turnpoint.ids"]).resolve() == LAYER_DIRS["core"] / "ids.py"


# What importing a library's public face may load: a trainer that embeds the coordinator
# must not install or import a demo, a GPU stack or another library.
HEAVY = ("torch", "ray", "matplotlib", "rich", "aiohttp")
FORBIDDEN_AT_IMPORT = {
    "turnpoint": (*HEAVY, "grpc", "turnpoint.participant_sdk", "turnpoint.trainer"),
    "turnpoint.participant_sdk": (*HEAVY, "grpc", "turnpoint.trainer", "turnpoint.server"),
    "turnpoint.participant_sdk.sandboxes": (
        *HEAVY,
        "grpc",
        "turnpoint.trainer",
        "turnpoint.server",
    ),
    "turnpoint.server": (*HEAVY, "turnpoint.trainer", "turnpoint.apps"),
    # The Ray hosting module (the ``ray`` extra) loads ray when it is imported itself, and
    # nothing else heavy; ``import turnpoint.server`` above must not load it.
    "turnpoint.server.ray": (
        "torch",
        "matplotlib",
        "rich",
        "aiohttp",
        "turnpoint.trainer",
        "turnpoint.apps",
    ),
    # The OpenAI endpoint (the ``openai`` extra) loads aiohttp and nothing else heavy.
    "turnpoint.server.openai_api": (
        "torch",
        "ray",
        "matplotlib",
        "rich",
        "turnpoint.trainer",
        "turnpoint.apps",
    ),
    "turnpoint.trainer": (
        *HEAVY,
        "turnpoint.server",
        "turnpoint.participant_sdk",
        "turnpoint.apps",
        # grpcio itself imports the bare grpc_health / grpc_reflection packages when they
        # are installed (its "extension shims"); the servicers are what must stay out.
        "grpc_health.v1",
        "grpc_reflection.v1alpha",
    ),
}


@pytest.mark.parametrize("face", sorted(FORBIDDEN_AT_IMPORT))
def test_importing_a_library_face_loads_nothing_it_should_not(face: str) -> None:
    probe = f"import sys, {face}; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    banned = FORBIDDEN_AT_IMPORT[face]
    hits = sorted({b for m in loaded for b in banned if m == b or m.startswith(b + ".")})
    assert hits == [], f"import {face} loads {hits}"
