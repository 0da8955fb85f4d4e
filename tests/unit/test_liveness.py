"""A lost participant is noticed, and job restarts are bounded (docs/spec.md section 7.11).

Pure cores on a fake clock: the liveness tracker, the watch driven by a scripted prober,
and the restart budget.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from turnpoint.errors import Reason
from turnpoint.trainer import CoordinatorError, ParticipantLostError
from turnpoint.trainer.advanced import LivenessTracker, RestartBudget, watch_liveness


def test_a_participant_is_lost_only_after_silence_and_a_failing_probe() -> None:
    tracker = LivenessTracker(["agent-0", "tools"], lost_after_s=10.0, now=0.0)
    assert tracker.lost(100.0) == ()  # silent but never probed and failed: not lost
    tracker.failed("agent-0")
    assert tracker.lost(9.9) == ()
    assert tracker.lost(10.0) == ("agent-0",)
    tracker.answered("agent-0", 10.5)  # it answers again: not lost any more
    assert tracker.lost(15.0) == ()
    assert tracker.silent_for("agent-0", 15.0) == pytest.approx(4.5)


def test_a_participant_answering_as_a_new_incarnation_is_lost_at_once() -> None:
    """A worker its group restarted answers at once, but its state is gone (docs/spec.md
    sections 2.3 item 2 and 3.9)."""
    tracker = LivenessTracker(["agent-0-w0", "agent-0-w1"], lost_after_s=10.0, now=0.0)
    tracker.answered("agent-0-w0", 1.0, "inc-a")
    tracker.answered("agent-0-w1", 1.0, "inc-b")
    tracker.answered("agent-0-w0", 2.0, "")  # unknown: no verdict
    assert tracker.lost(2.0) == ()
    tracker.answered("agent-0-w1", 3.0, "inc-c")
    assert tracker.lost(3.0) == ("agent-0-w1",) and tracker.restarted() == ("agent-0-w1",)
    error = ParticipantLostError(tracker.lost(3.0), 0.0, tracker.restarted())
    assert "agent-0-w1 restarted" in str(error) and "answered nothing" not in str(error)


@dataclass
class Round:
    responses: dict[str, Any]
    failures: dict[str, Any]


@dataclass
class ScriptedProber:
    """Answers for every participant except those listed as down, at that round."""

    instances: tuple[str, ...]
    down_from: dict[str, int] = field(default_factory=dict)
    rounds: int = 0

    async def status_round(self, timeout_s: float) -> Round:
        self.rounds += 1
        down = {n for n, r in self.down_from.items() if self.rounds >= r}
        return Round(
            {n: object() for n in self.instances if n not in down},
            {n: object() for n in down},
        )


async def test_the_watch_raises_when_a_participant_stays_silent() -> None:
    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    prober = ScriptedProber(("agent-0", "agent-1", "tools"), down_from={"agent-1": 3})
    with pytest.raises(ParticipantLostError) as caught:
        await watch_liveness(
            prober, interval_s=1.0, lost_after_s=5.0, clock=lambda: clock[0], sleep=sleep
        )
    error = caught.value
    assert error.lost == ("agent-1",)
    assert isinstance(error, CoordinatorError) and error.reason is Reason.UNAVAILABLE
    assert error.transient
    # Answered at t=0 and t=1, failing from t=2: lost once 5 s of silence have passed.
    assert clock[0] == pytest.approx(6.0)
    assert error.silent_s == pytest.approx(5.0)


async def test_the_watch_keeps_going_while_everyone_answers() -> None:
    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds
        await asyncio.sleep(0)  # a real sleep yields; so must this one

    prober = ScriptedProber(("agent-0",))
    watch = asyncio.create_task(
        watch_liveness(
            prober, interval_s=1.0, lost_after_s=3.0, clock=lambda: clock[0], sleep=sleep
        )
    )
    for _ in range(50):
        await asyncio.sleep(0)
    assert not watch.done() and prober.rounds > 10
    watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch


def test_the_restart_budget_allows_max_restarts_per_window_with_growing_pauses() -> None:
    budget = RestartBudget(2, window_s=100.0, first_pause_s=0.5, max_pause_s=30.0)
    first = budget.decide(0.0, "agent-0 lost")
    second = budget.decide(10.0, "trainer stalled")
    third = budget.decide(20.0, "tools lost")
    assert first.allowed and first.pause_s == 0.5
    assert second.allowed and second.pause_s == 1.0
    assert not third.allowed and "max_restarts=2" in third.reason
    # The window slides: the first restart leaves it at t=100.
    later = budget.decide(100.0, "agent-1 lost")
    assert later.allowed and budget.used == 2


def test_no_restart_budget_ends_at_the_first_loss() -> None:
    decision = RestartBudget(0, window_s=3600.0).decide(0.0, "agent-0 lost")
    assert not decision.allowed and decision.reason.startswith("agent-0 lost: 0 restart(s)")
