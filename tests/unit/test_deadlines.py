"""DeadlineRegistry: rollout budgets count active time only (docs/spec.md section 6)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnpoint.ids import EpisodeId
from turnpoint.trainer.advanced import DeadlineRegistry, Hold

EP_A = EpisodeId("rollout-a", 0)
EP_B = EpisodeId("rollout-b", 0)


def test_budget_runs_and_expires() -> None:
    reg: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
    reg.start(EP_A, 10.0, now=100.0)
    assert reg.remaining(EP_A, 104.0) == pytest.approx(6.0)
    assert reg.next_expiry(104.0) == pytest.approx(6.0)
    assert reg.expired(109.9) == []
    assert reg.expired(110.0) == [EP_A]
    # A query, not a removal: still reported until finished.
    assert reg.expired(111.0) == [EP_A]
    assert reg.next_expiry(111.0) == 0.0
    assert reg.remaining(EP_A, 111.0) == 0.0
    assert reg.consumed(EP_A, 111.0) == pytest.approx(11.0)
    assert reg.finish(EP_A) is True
    assert reg.finish(EP_A) is False
    assert reg.expired(200.0) == []
    assert reg.next_expiry(200.0) is None


def test_expired_is_most_overdue_first() -> None:
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    reg.start("late", 5.0, now=0.0)
    reg.start("later", 8.0, now=0.0)
    reg.start("early", 1.0, now=0.0)
    assert reg.expired(10.0) == ["early", "late", "later"]


def test_hold_stops_every_clock() -> None:
    reg: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
    reg.start(EP_A, 10.0, now=0.0)
    reg.start(EP_B, 20.0, now=0.0)
    snapshot = reg.hold("snapshot", now=5.0)
    assert reg.held
    assert reg.next_expiry(5.0) is None
    # An hour of snapshot: nothing runs, nothing expires.
    assert reg.expired(3605.0) == []
    assert reg.remaining(EP_A, 3605.0) == pytest.approx(5.0)
    assert reg.release(snapshot, now=3605.0) is True
    assert reg.remaining(EP_A, 3607.0) == pytest.approx(3.0)
    assert reg.remaining(EP_B, 3607.0) == pytest.approx(13.0)
    assert reg.expired(3610.0) == [EP_A]
    assert reg.held_seconds(3610.0) == pytest.approx(3600.0)


def test_overlapping_holders_are_counted() -> None:
    """The parked-deadline case: a snapshot ending inside a weight-sync pause."""
    reg: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
    reg.start(EP_A, 10.0, now=0.0)
    weight_sync = reg.hold("weight-sync", now=2.0)
    snapshot = reg.hold("snapshot", now=3.0)
    assert reg.holders == ("weight-sync", "snapshot")
    reg.release(snapshot, now=50.0)
    # The weight sync still holds: the clock must not have restarted.
    assert reg.held
    assert reg.consumed(EP_A, 80.0) == pytest.approx(2.0)
    assert reg.expired(80.0) == []
    # Releasing the snapshot again must not release the weight sync's hold.
    assert reg.release(snapshot, now=81.0) is False
    assert reg.held
    assert reg.consumed(EP_A, 90.0) == pytest.approx(2.0)
    reg.release(weight_sync, now=100.0)
    assert reg.next_expiry(100.0) is not None  # clocks run again
    assert reg.consumed(EP_A, 104.0) == pytest.approx(6.0)
    assert reg.next_expiry(104.0) == pytest.approx(4.0)


def test_same_name_holds_are_distinct_holders() -> None:
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    reg.start("r", 10.0, now=0.0)
    first = reg.hold("snapshot", now=1.0)
    second = reg.hold("snapshot", now=1.0)
    reg.release(first, now=2.0)
    assert reg.held
    assert reg.consumed("r", 5.0) == pytest.approx(1.0)
    reg.release(second, now=5.0)
    assert reg.consumed("r", 6.0) == pytest.approx(2.0)


def test_release_of_foreign_handle_is_noop() -> None:
    mine: DeadlineRegistry[str] = DeadlineRegistry()
    other: DeadlineRegistry[str] = DeadlineRegistry()
    held = mine.hold("snapshot", now=0.0)
    foreign = other.hold("snapshot", now=0.0)
    assert mine.release(foreign, now=1.0) is False
    assert mine.held
    assert mine.release(held, now=1.0) is True


def test_budget_started_while_held_waits_for_release() -> None:
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    hold = reg.hold("snapshot", now=0.0)
    reg.start("r", 3.0, now=1.0)
    assert reg.consumed("r", 50.0) == 0.0
    reg.release(hold, now=50.0)
    assert reg.expired(52.9) == []
    assert reg.expired(53.0) == ["r"]


def test_pause_parks_one_episode_only() -> None:
    reg: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
    reg.start(EP_A, 10.0, now=0.0)
    reg.start(EP_B, 10.0, now=0.0)
    reg.pause(EP_A, now=4.0)
    reg.pause(EP_A, now=5.0)  # idempotent: the first pause counts
    assert reg.paused(EP_A)
    assert reg.expired(30.0) == [EP_B]
    assert reg.consumed(EP_A, 30.0) == pytest.approx(4.0)
    reg.unpause(EP_A, now=30.0)
    reg.unpause(EP_A, now=31.0)  # idempotent
    assert not reg.paused(EP_A)
    assert reg.remaining(EP_A, 32.0) == pytest.approx(4.0)
    assert reg.expired(36.0) == [EP_B, EP_A]


def test_pause_inside_hold() -> None:
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    reg.start("r", 10.0, now=0.0)
    hold = reg.hold("snapshot", now=1.0)
    reg.pause("r", now=2.0)
    reg.release(hold, now=9.0)
    assert reg.consumed("r", 20.0) == pytest.approx(1.0)
    reg.unpause("r", now=20.0)
    assert reg.next_expiry(20.0) == pytest.approx(9.0)


def test_infinite_budget_never_expires() -> None:
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    reg.start("r", math.inf, now=0.0)
    assert reg.expired(1e12) == []
    assert reg.next_expiry(1e12) is None
    assert reg.remaining("r", 1e12) == math.inf


def test_clock_going_backwards_never_refunds_budget() -> None:
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    reg.start("r", 10.0, now=0.0)
    assert reg.consumed("r", 5.0) == pytest.approx(5.0)
    assert reg.consumed("r", 3.0) == pytest.approx(5.0)


def test_restart_after_finish_ignores_stale_deadline() -> None:
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    reg.start("r", 1.0, now=0.0)
    reg.finish("r")
    reg.start("r", 10.0, now=0.5)
    assert reg.expired(5.0) == []
    assert reg.next_expiry(5.0) == pytest.approx(5.5)


def test_many_finished_budgets_do_not_accumulate() -> None:
    reg: DeadlineRegistry[int] = DeadlineRegistry()
    for key in range(10_000):
        reg.start(key, math.inf, now=float(key))
        reg.finish(key)
    assert len(reg) == 0
    assert len(reg._heap) <= 100


def test_invalid_calls() -> None:
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        reg.start("r", 0.0, now=0.0)
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        reg.start("r", math.nan, now=0.0)
    reg.start("r", 1.0, now=0.0)
    with pytest.raises(ValueError, match="already running"):
        reg.start("r", 1.0, now=0.0)
    with pytest.raises(KeyError, match="no budget"):
        reg.remaining("missing", 0.0)
    with pytest.raises(KeyError):
        reg.pause("missing", 0.0)
    with pytest.raises(ValueError, match="NaN"):
        reg.expired(math.nan)


# -- property: consumed budget == wall time minus held time --------------------------

_steps = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.integers(min_value=0, max_value=1000)),
        st.tuples(st.just("hold"), st.sampled_from(["snapshot", "weight-sync"])),
        st.tuples(st.just("release"), st.integers(min_value=0, max_value=7)),
        st.tuples(st.just("pause"), st.sampled_from(["a", "b"])),
        st.tuples(st.just("unpause"), st.sampled_from(["a", "b"])),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(steps=_steps, budget_a=st.integers(1, 5000), budget_b=st.integers(1, 5000))
def test_consumed_is_wall_time_minus_held_time(
    steps: list[tuple[str, int | str]], budget_a: int, budget_b: int
) -> None:
    # Times in milliseconds, converted exactly, so the model compares without rounding.
    reg: DeadlineRegistry[str] = DeadlineRegistry()
    budgets = {"a": budget_a / 1000, "b": budget_b / 1000}
    now_ms = 0
    for key, budget in budgets.items():
        reg.start(key, budget, now=0.0)
    expected_ms = {"a": 0, "b": 0}
    paused = {"a": False, "b": False}
    handles: list[Hold] = []
    live: set[int] = set()
    held_ms = 0

    for op, arg in steps:
        if op == "advance":
            assert isinstance(arg, int)
            now_ms += arg
            if live:
                held_ms += arg
            else:
                for key in expected_ms:
                    if not paused[key]:
                        expected_ms[key] += arg
        elif op == "hold":
            handles.append(reg.hold(str(arg), now_ms / 1000))
            live.add(len(handles) - 1)
        elif op == "release":
            assert isinstance(arg, int)
            if handles:
                index = arg % len(handles)
                released = reg.release(handles[index], now_ms / 1000)
                assert released == (index in live)
                live.discard(index)
        elif op == "pause":
            reg.pause(str(arg), now_ms / 1000)
            paused[str(arg)] = True
        else:
            reg.unpause(str(arg), now_ms / 1000)
            paused[str(arg)] = False

        now = now_ms / 1000
        assert reg.held == bool(live)
        assert reg.held_seconds(now) == pytest.approx(held_ms / 1000, abs=1e-6)
        for key in budgets:
            assert reg.consumed(key, now) == pytest.approx(expected_ms[key] / 1000, abs=1e-6)
        overdue = {key for key in budgets if expected_ms[key] >= budgets[key] * 1000 + 1e-3}
        not_yet = {key for key in budgets if expected_ms[key] <= budgets[key] * 1000 - 1e-3}
        reported = set(reg.expired(now))
        assert overdue <= reported
        assert not (not_yet & reported)
        if overdue | not_yet != set(budgets):
            continue  # a budget sits exactly on its deadline: either answer is right
        wait = reg.next_expiry(now)
        running = [k for k in budgets if not paused[k]]
        if overdue:
            assert wait == 0.0
        elif live or not running:
            assert wait is None
        else:
            assert wait is not None
            soonest = min(budgets[k] - expected_ms[k] / 1000 for k in running)
            assert wait == pytest.approx(soonest, abs=1e-6)
