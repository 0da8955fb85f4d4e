"""The snapshot pump's failure count (docs/spec.md section 7.5), driven by a scripted
driver: failures in a row end the run; a publish or a heal in place starts the count
again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.snapshots.pump import SnapshotFailuresError, SnapshotPump
from turnpoint.trainer.snapshots.report import FailureReason, SnapshotOutcome, SnapshotReport


class _ScriptedDriver:
    """Answers each take with the next outcome; records the ids it was asked to retry."""

    def __init__(self, outcomes: Iterator[SnapshotOutcome]) -> None:
        self._outcomes = outcomes
        self.retried: list[str | None] = []
        self._taken = 0

    async def take(self, retry_id: str | None = None) -> SnapshotReport:
        self.retried.append(retry_id)
        self._taken += 1
        outcome = next(self._outcomes)
        failed = outcome is SnapshotOutcome.FAILED
        return SnapshotReport(
            checkpoint_id=retry_id or f"ck-{self._taken}",
            outcome=outcome,
            reason=FailureReason.PARTICIPANT_UNAVAILABLE if failed else None,
        )


def _pump(tmp_path: Path, *outcomes: SnapshotOutcome) -> tuple[SnapshotPump, _ScriptedDriver]:
    driver = _ScriptedDriver(iter(outcomes))
    config = CoordinatorConfig(snapshot_root=tmp_path, max_consecutive_failures=3)
    return SnapshotPump(cast(Any, driver), config), driver


FAILED, PUBLISHED = SnapshotOutcome.FAILED, SnapshotOutcome.PUBLISHED


async def test_failures_in_a_row_end_the_run(tmp_path: Path) -> None:
    pump, _ = _pump(tmp_path, FAILED, FAILED, FAILED)
    await pump.tick()
    await pump.tick()
    with pytest.raises(SnapshotFailuresError, match="3 snapshot attempts failed in a row"):
        await pump.tick()


async def test_a_heal_in_place_starts_the_count_again_and_the_same_id_is_retried(
    tmp_path: Path,
) -> None:
    """Under a fault every few seconds each loss fails a snapshot or two before its heal;
    failures spread over several heals must not end a run that heals each loss."""
    pump, driver = _pump(tmp_path, FAILED, FAILED, FAILED, FAILED, PUBLISHED)
    await pump.tick()
    await pump.tick()
    pump.fleet_healed()
    assert pump.consecutive_failures == 0
    assert pump.retry_id == "ck-1"
    await pump.tick()
    await pump.tick()
    assert pump.consecutive_failures == 2
    published = await pump.tick()
    assert published.outcome is PUBLISHED and pump.consecutive_failures == 0
    assert driver.retried == [None, "ck-1", "ck-1", "ck-1", "ck-1"]
