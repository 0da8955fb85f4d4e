"""The trainer's pure cores import alone: no grpc, no asyncio, no clock, no randomness.

Each is a module a test drives with a fake clock and plain values (docs/spec.md section
7.4 for the snapshot decisions, 7.6 for the rollout ledger). Importing one must not run
the trainer's face or any wire code, so each import is checked in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.support.sources import source_of

PURE_CORES = (
    "turnpoint.trainer.rollouts.ledger",
    "turnpoint.trainer.rollouts.attempts",
    "turnpoint.trainer.rollouts.values",
    "turnpoint.trainer.rollouts.refusal_marks",
    "turnpoint.trainer.rollouts.deadlines",
    "turnpoint.trainer.snapshots.attempt",
    "turnpoint.trainer.snapshots.core",
    "turnpoint.trainer.snapshots.levels",
    "turnpoint.trainer.restore.restarts",
    "turnpoint.trainer.restore.choice",
    "turnpoint.trainer.restore.heal",
    "turnpoint.trainer.restore.stale",
    "turnpoint.apps.bench._heal_figures",
    "turnpoint.trainer.status.history",
    "turnpoint.trainer.storage.manifest",
    "turnpoint.trainer.weights.core",
    "turnpoint.storage._objects",
    "turnpoint.egress",
    "turnpoint.apps.bench._arithmetic",
)
# What a pure core may not load, even indirectly.
WIRE_AND_LOOP = ("grpc", "asyncio", "google.protobuf", "turnpoint.v1")
# Modules whose use means reading a clock or drawing randomness.
CLOCKS = {"time", "datetime", "uuid", "random", "secrets"}


@pytest.mark.parametrize("module", PURE_CORES)
def test_a_pure_core_imports_without_the_wire_or_the_loop(module: str) -> None:
    probe = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    hits = sorted({b for m in loaded for b in WIRE_AND_LOOP if m == b or m.startswith(b + ".")})
    assert hits == [], f"import {module} loads {hits}"


@pytest.mark.parametrize("module", PURE_CORES)
def test_a_pure_core_reads_no_clock_and_draws_no_randomness(module: str) -> None:
    tree = ast.parse(source_of(module))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.split(".")[0])
    assert imported & CLOCKS == set(), module


def test_the_checks_see_a_module_that_loads_the_wire() -> None:
    """Guard the guard: the driver around the ledger does load grpc and asyncio."""
    probe = "import sys, turnpoint.trainer.rollouts.client; print(' '.join(sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert "grpc" in loaded and "asyncio" in loaded
