"""The demo's timed fault lands in a window the first trainer finds and holds
(turnpoint.apps.demo._fault_window): the decision, pure."""

from __future__ import annotations

from turnpoint.apps.demo._fault_window import FaultWindows, first_window_step
from turnpoint.apps.demo._supervisor import DemoOptions


def _due(windows: FaultWindows, step: int, **known: int | None) -> int | None:
    facts: dict[str, int | None] = {
        "in_flight": 3,
        "newest_published_cut": 2,
        "healed_at_step": None,
    }
    facts.update(known)
    return windows.due(step=step, **facts)  # type: ignore[arg-type]


def test_window_1_opens_once_forty_percent_of_the_steps_are_done() -> None:
    windows = FaultWindows(planned=1, total_steps=8)
    assert first_window_step(8) == 4
    assert [_due(windows, step) for step in range(4)] == [None] * 4
    assert _due(windows, 4) == 1
    assert windows.opened == 1
    # Opened once: never again, whatever follows.
    assert [_due(windows, step) for step in range(4, 8)] == [None] * 4


def test_window_1_waits_for_a_published_snapshot_that_cut_rollouts_in_flight() -> None:
    """A snapshot between groups cuts nothing: a crash after it would show no recovery
    of work mid-episode; a restore takes the newest published snapshot, so it is the
    newest that must have cut some."""
    windows = FaultWindows(planned=1, total_steps=10)
    assert _due(windows, 5, newest_published_cut=0) is None
    assert _due(windows, 5, in_flight=0) is None
    assert _due(windows, 5, newest_published_cut=1) == 1


def test_no_window_once_the_steps_are_trained_or_none_planned() -> None:
    assert _due(FaultWindows(planned=1, total_steps=8), 8) is None
    assert _due(FaultWindows(planned=0, total_steps=8), 5) is None


def test_window_2_opens_once_a_step_was_trained_after_the_heal() -> None:
    """The default crash heals a lost agent in place, then kills the trainer: it must
    have trained on after the heal, with steps left for the restored trainer."""
    windows = FaultWindows(planned=2, total_steps=10)
    assert _due(windows, 4) == 1
    assert _due(windows, 4) is None  # not healed yet
    assert _due(windows, 5, healed_at_step=5) is None  # healed, nothing trained since
    # The newest snapshot cut nothing: a restore of it would continue nothing.
    assert _due(windows, 6, healed_at_step=5, newest_published_cut=0) is None
    assert _due(windows, 6, healed_at_step=5, in_flight=0) == 2
    assert windows.opened == 2
    assert _due(windows, 7, healed_at_step=5) is None


def test_window_2_needs_a_step_left() -> None:
    windows = FaultWindows(planned=2, total_steps=6)
    assert _due(windows, 3) == 1
    assert _due(windows, 6, healed_at_step=5) is None


def test_only_the_first_trainer_of_a_timed_crash_holds_windows() -> None:
    """Two where a lost agent heals in place and the trainer's crash follows; one where
    the fault is the crash itself (a job restart) or a lost node; none for a restored
    trainer, a --crash-at kill (the trainer fires it) or no crash."""
    assert [DemoOptions().fault_windows(n) for n in (1, 2)] == [2, 0]
    assert DemoOptions(ray=True).fault_windows(1) == 1
    assert DemoOptions(ray=True, ray_nodes=3, lose_node=True).fault_windows(1) == 1
    assert DemoOptions(crash_at="prepare-sent").fault_windows(1) == 0
    assert DemoOptions(crash=False).fault_windows(1) == 0
