"""Library faces whose names load on first use.

A face (a package's ``__init__``) lists its names and the module that owns each; a
name's module is imported when the name is first read. Importing the face then imports
nothing, so a pure module inside the package imports alone (no grpc, no asyncio) and an
optional dependency (torch) loads only for the names that need it. Type checkers read
the face's ``TYPE_CHECKING`` imports instead, so a misspelled name is still an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_names(
    namespace: dict[str, Any], owners: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of a face.

    ``namespace`` is the face's ``globals()``; ``owners`` maps each public name to the
    module that defines it. A loaded name is kept in ``namespace``, so it is looked up
    once.
    """
    module = namespace["__name__"]

    def getattr_(name: str) -> Any:
        owner = owners.get(name)
        if owner is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(import_module(owner), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *owners})

    return getattr_, dir_
