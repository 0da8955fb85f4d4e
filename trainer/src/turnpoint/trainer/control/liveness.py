"""Noticing a participant that is gone, so the job restores instead of failing snapshots.

A Gym server dying is the most common failure a training run sees. Without a watch, the
trainer learns of it only when snapshots start failing, and ends the run after
``max_consecutive_failures`` of them. The liveness watch asks every participant for its
status every ``liveness_interval_s``; one that has answered nothing for
``participant_lost_after_s`` (its process died, was paused, its host went away) is
*lost*, and :class:`ParticipantLostError` tells the job to restore from the last
published snapshot onto fresh participants (docs/spec.md section 7.11), within its
:class:`~turnpoint.trainer.RestartBudget`.

:class:`LivenessTracker` is the pure decision (state and ``now`` in, lost participants
out); :func:`watch_liveness` is the asyncio driver that probes and raises.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from turnpoint.errors import Reason
from turnpoint.trainer.control.fanout import FanoutResult
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.v1 import checkpoint_control_service_pb2 as pb


class ParticipantLostError(CoordinatorError):
    """Participants answered nothing for ``participant_lost_after_s``, or answered as a
    new incarnation (``restarted``: a worker its group restarted, docs/spec.md section
    3.9): restore the job."""

    def __init__(self, lost: Iterable[str], silent_s: float, restarted: Iterable[str] = ()) -> None:
        self.lost = tuple(sorted(lost))
        self.silent_s = silent_s
        self.restarted = tuple(sorted(restarted))
        silent = [name for name in self.lost if name not in self.restarted]
        why = [f"{', '.join(silent)} answered nothing for {silent_s:g}s"] if silent else []
        if self.restarted:
            why.append(f"{', '.join(self.restarted)} restarted (a new incarnation)")
        super().__init__(
            Reason.UNAVAILABLE,
            f"participant(s) {'; '.join(why)}: lost; restore the job from the last "
            "published snapshot onto fresh participants",
            {"participants": ",".join(self.lost)},
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.lost, self.silent_s, self.restarted))


@dataclass
class _Seen:
    last_answer: float
    failures: int = 0
    incarnation: str = ""
    restarted: bool = False


class LivenessTracker:
    """Who answered when; who is lost. Pure: every call takes ``now``."""

    def __init__(self, participants: Iterable[str], lost_after_s: float, now: float) -> None:
        if lost_after_s <= 0:
            raise ValueError("lost_after_s must be > 0")
        self._lost_after_s = lost_after_s
        # Every participant starts as just seen: the watch starts after discovery.
        self._seen = {name: _Seen(now) for name in participants}

    def answered(self, participant: str, now: float, incarnation: str = "") -> None:
        """``incarnation`` (from the answer's header; empty if unknown): the first one
        seen is the participant's; another one means its process was replaced and its
        in-memory state is gone (docs/spec.md section 2.3 item 2), so it is lost."""
        seen = self._seen[participant]
        seen.last_answer = max(seen.last_answer, now)
        seen.failures = 0
        if incarnation:
            seen.restarted = seen.restarted or seen.incarnation not in ("", incarnation)
            seen.incarnation = seen.incarnation or incarnation

    def failed(self, participant: str) -> None:
        self._seen[participant].failures += 1

    def silent_for(self, participant: str, now: float) -> float:
        return max(0.0, now - self._seen[participant].last_answer)

    def lost(self, now: float) -> tuple[str, ...]:
        """Participants silent for at least ``lost_after_s`` and failing since, and
        participants that answered as a new incarnation."""
        return tuple(
            sorted(
                name
                for name, seen in self._seen.items()
                if seen.restarted
                or (seen.failures and now - seen.last_answer >= self._lost_after_s)
            )
        )

    def restarted(self) -> tuple[str, ...]:
        return tuple(sorted(name for name, seen in self._seen.items() if seen.restarted))


class StatusProber(Protocol):
    """What the watch needs of the coordinator: one status round to every participant
    (:meth:`~turnpoint.trainer.Coordinator.status_round`)."""

    @property
    def instances(self) -> tuple[str, ...]: ...

    async def status_round(self, timeout_s: float) -> FanoutResult[Any]: ...


async def watch_liveness(
    prober: StatusProber,
    *,
    interval_s: float,
    lost_after_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Probe until a participant is lost, then raise :class:`ParticipantLostError`.

    Runs for the life of the job (cancel it to stop). Each round's calls are bounded by
    the interval, so a paused participant costs one interval per round, never a hang.
    """
    tracker = LivenessTracker(prober.instances, lost_after_s, clock())
    while True:
        result = await prober.status_round(interval_s)
        now = clock()
        for name, response in result.responses.items():
            incarnation = (
                response.header.incarnation if isinstance(response, pb.GetStatusResponse) else ""
            )
            tracker.answered(name, now, incarnation)
        for name in result.failures:
            tracker.failed(name)
        lost = tracker.lost(now)
        if lost:
            silent_s = max(tracker.silent_for(n, now) for n in lost)
            raise ParticipantLostError(lost, silent_s, tracker.restarted())
        await sleep(interval_s)
