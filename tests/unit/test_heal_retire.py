"""A heal's retire on the live participants (docs/spec.md section 7.15 item 4): sent
again, with the same key, to the participants whose failure was transient, after each
pause; never again after a failure no retry can fix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.trainer.checkpointing import retire_for_heal
from turnpoint.trainer.control.failures import Failure, FailureKind
from turnpoint.trainer.control.outcomes import ControlReport

DROPPED = Failure(FailureKind.TRANSIENT, Reason.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, "dropped")
BROKEN = Failure(FailureKind.INVARIANT, Reason.PROTOCOL_VIOLATION, None, "malformed")
EPISODES = {"agent-0": [EpisodeId("r1", 0)], "tools": [EpisodeId("r1", 0), EpisodeId("r2", 0)]}


class _Links:
    """A retire whose participants fail as scripted, one script entry per call."""

    def __init__(self, *failing: Mapping[str, Failure]) -> None:
        self._failing = list(failing)
        self.calls: list[tuple[dict[str, Sequence[EpisodeId]], str]] = []

    async def retire(self, episodes: Mapping[str, Sequence[EpisodeId]], *, key: str) -> Any:
        self.calls.append((dict(episodes), key))
        failing = self._failing.pop(0) if self._failing else {}
        failures = {name: f for name, f in failing.items() if name in episodes}
        return ControlReport("retire", key, frozenset(episodes) - set(failures), failures)


async def _retire(links: _Links) -> tuple[ControlReport, list[float]]:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    report = await retire_for_heal(links.retire, EPISODES, key="restore-7-reruns", sleep=sleep)
    return report, slept


async def test_a_link_that_dropped_for_a_moment_is_retired_again_with_the_same_key() -> None:
    links = _Links({"agent-0": DROPPED}, {"agent-0": DROPPED})
    report, slept = await _retire(links)
    assert report.ok
    assert slept == [0.5, 1.0]
    assert links.calls == [
        (EPISODES, "restore-7-reruns"),
        ({"agent-0": EPISODES["agent-0"]}, "restore-7-reruns"),
        ({"agent-0": EPISODES["agent-0"]}, "restore-7-reruns"),
    ]


async def test_a_link_down_past_every_pause_fails_the_heal() -> None:
    links = _Links(*([{"tools": DROPPED}] * 5))
    report, slept = await _retire(links)
    assert report.failures == {"tools": DROPPED}
    assert slept == [0.5, 1.0, 2.0] and len(links.calls) == 4


async def test_a_failure_no_retry_can_fix_is_not_retried() -> None:
    links = _Links({"agent-0": DROPPED, "tools": BROKEN})
    report, slept = await _retire(links)
    assert set(report.failures) == {"agent-0", "tools"}
    assert slept == [] and len(links.calls) == 1
