"""One run of ``turnpoint bench``: the run itself and its report."""

from __future__ import annotations

import asyncio
import os
import platform
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from turnpoint.apps.bench._control_overhead import OverheadRow, measure_control_overhead
from turnpoint.apps.bench._options import BenchOptions
from turnpoint.apps.bench._workload import RestoreResult, ThroughputResult, run_workload

__all__ = ["BenchReport", "run_bench"]

# The whole run, every part of which is bounded on its own as well.
_RUN_TIMEOUT_S: Final = 3600.0

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class BenchReport:
    """The figures of one run (see :meth:`to_json` for the published shape)."""

    control_overhead: tuple[OverheadRow, ...]
    throughput: ThroughputResult
    restore: RestoreResult
    workers: int
    warmup: int
    snapshot_root: str
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput_ratio_on_vs_off(self) -> float | None:
        return self.throughput.ratio

    @property
    def restore_seconds(self) -> float | None:
        return self.restore.seconds

    def to_json(self) -> dict[str, Any]:
        ratio = self.throughput_ratio_on_vs_off
        seconds = self.restore_seconds
        return {
            "control_overhead": [row.to_json() for row in self.control_overhead],
            "throughput_ratio_on_vs_off": None if ratio is None else round(ratio, 3),
            "restore_seconds": None if seconds is None else round(seconds, 3),
            "details": {
                "workers": self.workers,
                "warmup_rounds": self.warmup,
                "rounds": {str(row.participants): row.rounds for row in self.control_overhead},
                "phases_ms": {
                    str(row.participants): {k: round(v, 3) for k, v in row.phases_ms.items()}
                    for row in self.control_overhead
                },
                "throughput": self.throughput.to_json(),
                "restore": self.restore.to_json(),
                "snapshot_root": self.snapshot_root,
                "machine": self.machine,
            },
        }


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_1m": None if load is None else round(load[0], 2),
    }


async def _run(options: BenchOptions, root: Path, progress: Progress) -> BenchReport:
    token = secrets.token_hex(24)
    machine_before = _machine()
    rows = await measure_control_overhead(
        root,
        options.sizes,
        workers=options.workers,
        rounds=options.rounds_for,
        warmup=options.warmup,
        token=token,
        progress=progress,
    )
    throughput, restore = await run_workload(root, options.workload, token=token, progress=progress)
    machine = _machine()
    machine["load_average_1m_at_start"] = machine_before["load_average_1m"]
    return BenchReport(
        control_overhead=tuple(rows),
        throughput=throughput,
        restore=restore,
        workers=options.workers,
        warmup=options.warmup,
        snapshot_root=str(root),
        machine=machine,
    )


async def run_bench(options: BenchOptions, progress: Progress) -> BenchReport:
    """Run every measurement; worker processes never outlive the call."""
    async with asyncio.timeout(_RUN_TIMEOUT_S):
        if options.root is not None:
            options.root.mkdir(parents=True, exist_ok=True)
            return await _run(options, options.root, progress)
        with tempfile.TemporaryDirectory(
            prefix="turnpoint-system-bench-", ignore_cleanup_errors=True
        ) as scratch:
            return await _run(options, Path(scratch), progress)
