"""Every library face: each name it lists loads, from the module that owns it.

The trainer's faces load names on first use (turnpoint._faces), from a table of owners;
type checkers read their TYPE_CHECKING imports instead. Both must say the same, or a
name would type-check and fail at run time (or the other way round).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest

from tests.support.sources import source_of

FACES = (
    "turnpoint.trainer",
    "turnpoint.trainer.advanced",
    "turnpoint.trainer.testing",
    "turnpoint.participant_sdk",
    "turnpoint.participant_sdk.advanced",
    "turnpoint.participant_sdk.testing",
    "turnpoint.participant_sdk.sandboxes",
    "turnpoint.server",
    "turnpoint.server.advanced",
    "turnpoint.server.openai_api",
)
LAZY = ("turnpoint.trainer", "turnpoint.trainer.advanced", "turnpoint.trainer.testing")


@pytest.mark.parametrize("face", FACES)
def test_every_listed_name_loads_and_is_defined_where_it_is_owned(face: str) -> None:
    module = importlib.import_module(face)
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        value = getattr(module, name)
        owner = getattr(value, "__module__", None)
        if face.endswith(".advanced") and owner is not None and owner.startswith("turnpoint."):
            assert owner != face, f"{face} defines {name}: a face only names what others own"


@pytest.mark.parametrize("face", LAZY)
def test_a_lazy_face_types_exactly_what_it_loads(face: str) -> None:
    tree = ast.parse(source_of(face))
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module != "typing":
            for alias in node.names:
                if alias.asname == alias.name:  # the explicit re-export form
                    typed[alias.name] = node.module
    module = importlib.import_module(face)
    assert typed == dict(module._OWNERS)


def test_a_lazy_face_refuses_a_name_it_does_not_list() -> None:
    import turnpoint.trainer

    with pytest.raises(AttributeError, match="no attribute 'Coordinator'"):
        turnpoint.trainer.Coordinator  # noqa: B018 - on the advanced face, not this one


def test_importing_a_lazy_face_imports_none_of_its_names() -> None:
    probe = "import sys, turnpoint.trainer; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert [m for m in loaded if m.startswith("turnpoint.trainer.")] == []
