"""Reading a module's source by its import name, wherever its distribution keeps it."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def source_of(module: str) -> str:
    """The text of ``module``'s file, found as the import system finds it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin).read_text(encoding="utf-8")
