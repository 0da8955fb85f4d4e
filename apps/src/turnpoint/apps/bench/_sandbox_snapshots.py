"""The sandbox snapshot figure: a tree's first snapshot against one of the same tree.

docs/spec.md section 5.7.3: chunks are content-addressed, so a snapshot of a tree that
did not change since the last one writes no chunk. For each size, one sandbox on the
local provider is filled with incompressible files (the worst case for zstd: the full
snapshot writes every byte), snapshotted twice, then restored; the figures are the
seconds and bytes written (chunks, manifest and handle record, counted on disk) of each
snapshot, the restore's seconds, and the ratios unchanged / full and restore / full
taken in the same run.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from turnpoint.participant_sdk.sandboxes import LocalSandboxProvider

_FILE_BYTES: Final = 256 << 10
_RETENTION_S: Final = 3600.0
MiB: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class SandboxSnapshotRow:
    megabytes: int
    full_s: float
    full_bytes_written: int
    unchanged_s: float
    unchanged_bytes_written: int
    restore_s: float

    @property
    def time_ratio(self) -> float:
        return self.unchanged_s / self.full_s

    @property
    def bytes_ratio(self) -> float:
        return self.unchanged_bytes_written / self.full_bytes_written

    @property
    def restore_ratio(self) -> float:
        return self.restore_s / self.full_s

    def to_json(self) -> dict[str, Any]:
        return {
            "megabytes": self.megabytes,
            "full_s": round(self.full_s, 4),
            "full_bytes_written": self.full_bytes_written,
            "unchanged_s": round(self.unchanged_s, 4),
            "unchanged_bytes_written": self.unchanged_bytes_written,
            "restore_s": round(self.restore_s, 4),
            "unchanged_vs_full_time": round(self.time_ratio, 4),
            "unchanged_vs_full_bytes": round(self.bytes_ratio, 6),
            "restore_vs_full": round(self.restore_ratio, 4),
        }


def _bytes_on_disk(root: Path) -> int:
    return sum(
        (Path(current) / name).stat().st_size
        for current, _, names in os.walk(root)
        for name in names
    )


def _stored(root: Path) -> int:
    return _bytes_on_disk(root / "store") + _bytes_on_disk(root / "snapshots")


async def measure_sandbox_snapshots(
    root: Path, sizes_mb: tuple[int, ...]
) -> tuple[SandboxSnapshotRow, ...]:
    """One row per size, each on its own provider under ``root``."""
    rows = []
    for megabytes in sizes_mb:
        provider_root = root / f"sandbox-{megabytes}mb"
        provider = await LocalSandboxProvider.open(provider_root)
        try:
            box = await provider.create("bench")
            for index in range(megabytes * MiB // _FILE_BYTES):
                await provider.write_file(
                    box, f"d{index % 8}/f{index:05}.bin", os.urandom(_FILE_BYTES)
                )
            before = await asyncio.to_thread(_stored, provider_root)
            started = time.perf_counter()
            handle = await provider.snapshot(box, retention_seconds=_RETENTION_S)
            full_s = time.perf_counter() - started
            after_full = await asyncio.to_thread(_stored, provider_root)
            started = time.perf_counter()
            await provider.snapshot(box, retention_seconds=_RETENTION_S)
            unchanged_s = time.perf_counter() - started
            after_unchanged = await asyncio.to_thread(_stored, provider_root)
            started = time.perf_counter()
            await provider.restore([handle], attempt=1)
            restore_s = time.perf_counter() - started
        finally:
            await provider.close()
        rows.append(
            SandboxSnapshotRow(
                megabytes,
                full_s,
                after_full - before,
                unchanged_s,
                after_unchanged - after_full,
                restore_s,
            )
        )
    return tuple(rows)
