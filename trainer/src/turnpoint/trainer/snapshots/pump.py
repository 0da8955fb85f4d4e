"""The snapshot pump: a snapshot every ``snapshot_interval_s``, and when to end the run.

docs/spec.md section 7.5. A published snapshot resets the failure count; a skipped one
leaves it; a transient failure counts, and ``max_consecutive_failures`` of them in a row
end the run; an invariant failure ends it at once. A participant healed in place
(:meth:`SnapshotPump.fleet_healed`) also resets the count: the failures before it were
its loss, which the heal repaired. After a transient failure the next
tick hands the same checkpoint id back to the driver (see :mod:`turnpoint.trainer.snapshots.driver`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from turnpoint.errors import Reason
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.snapshots.report import SnapshotOutcome, SnapshotReport

if TYPE_CHECKING:
    from turnpoint.trainer.snapshots.driver import SnapshotDriver


class SnapshotRunError(CoordinatorError):
    """The snapshot pump ends the run; ``reports`` are the attempts that led to it."""

    _reason = Reason.UNAVAILABLE

    def __init__(self, message: str, reports: Sequence[SnapshotReport]) -> None:
        super().__init__(self._reason, message, {"attempts": str(len(reports))})
        self.reports = tuple(reports)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.reports))


class SnapshotFailuresError(SnapshotRunError):
    """``max_consecutive_failures`` transient failures in a row."""


class SnapshotInvariantError(SnapshotRunError):
    """A failure no retry can fix (a malformed reply, a digest or topology mismatch)."""

    _reason = Reason.PROTOCOL_VIOLATION


class SnapshotPump:
    """Takes a snapshot every ``snapshot_interval_s``; ends the run when it must.

    After a transient failure the next tick hands the same checkpoint id back to the
    driver (see the module docstring for what that means once participants saw it).
    ``clock`` and ``sleep`` are injectable so that tests run hours of ticks instantly.
    """

    def __init__(
        self,
        driver: SnapshotDriver,
        config: CoordinatorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self._driver = driver
        self._config = config
        self._clock = clock
        self._sleep = sleep
        self._retry_id: str | None = None
        self._failures: list[SnapshotReport] = []

    @property
    def consecutive_failures(self) -> int:
        return len(self._failures)

    def fleet_healed(self) -> None:
        """A lost participant was replaced in place (docs/spec.md section 7.15): the
        attempts that failed on its loss are explained and repaired, so the count of
        failures in a row starts again. The next tick still retries the same id."""
        self._failures.clear()

    @property
    def retry_id(self) -> str | None:
        """The id the next tick retries, after a transient failure."""
        return self._retry_id

    async def tick(self) -> SnapshotReport:
        """One attempt. Raises :class:`SnapshotRunError` when the run must end."""
        report = await self._driver.take(self._retry_id)
        if report.outcome is SnapshotOutcome.PUBLISHED:
            self._failures.clear()
            self._retry_id = None
        elif report.outcome is SnapshotOutcome.FAILED:
            self._failures.append(report)
            self._retry_id = report.checkpoint_id
            if not report.transient:
                raise SnapshotInvariantError(
                    f"snapshot {report.checkpoint_id} broke an invariant, which a retry "
                    f"would only hide; stopping the run: {report.detail}",
                    self._failures,
                ) from report.error
            limit = self._config.max_consecutive_failures
            if len(self._failures) >= limit:
                reasons = ", ".join(
                    f"{r.checkpoint_id}: {r.reason.value if r.reason else '?'}"
                    for r in self._failures
                )
                raise SnapshotFailuresError(
                    f"{len(self._failures)} snapshot attempts failed in a row "
                    f"(max_consecutive_failures = {limit}; {reasons}); the last: "
                    f"{report.detail}. The previous published snapshot is intact: fix the "
                    "cause and restart from it, or raise max_consecutive_failures",
                    self._failures,
                ) from report.error
        return report

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Tick every ``snapshot_interval_s`` until ``stop`` is set; raises
        :class:`SnapshotRunError` to end the run."""
        interval = self._config.snapshot_interval_s
        next_at = self._clock() + interval
        while stop is None or not stop.is_set():
            delay = max(0.0, next_at - self._clock())
            if stop is None:
                await self._sleep(delay)
            else:
                sleeping = asyncio.ensure_future(self._sleep(delay))
                stopping = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait({sleeping, stopping}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleeping.cancel()
                    stopping.cancel()
                if stop.is_set():
                    return
            await self.tick()
            # A slow snapshot does not cause a burst of catch-up ticks.
            next_at = max(next_at + interval, self._clock())
