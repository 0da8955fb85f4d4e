"""The demo's pump tolerates a lost participant until its heal, and a blip of another
link before it (apps/demo/_trainer.py)."""

from __future__ import annotations

import pytest

from turnpoint.apps.demo._trainer import HEAL_WINDOW_S, failures_allowed

# The longest hold of a --chaos wire fault (apps/demo/_supervisor.py, wire_chaos).
LONGEST_WIRE_FAULT_S = 1.5


@pytest.mark.parametrize("interval_s", [0.1, 0.2, 0.5, 1.0, 3.0])
def test_failures_in_a_row_span_the_liveness_window_and_the_heal(interval_s: float) -> None:
    allowed = failures_allowed(interval_s, 6.0)
    assert allowed >= 3
    # The run ends only after failures lasting at least the liveness window and the heal
    # after it (which resets the count), with one failure to spare for a blip of another
    # link: far longer than any wire fault the chaos run injects.
    window_s = 6.0 + HEAL_WINDOW_S
    assert (allowed - 2) * interval_s >= window_s > LONGEST_WIRE_FAULT_S


def test_the_default_interval_allows_six() -> None:
    # A chaos run ended its trainer on three: two attempts failed on an agent killed
    # before the watch found it, one on a blip of another link just before.
    assert failures_allowed(3.0, 6.0) == 6
    assert failures_allowed(0.2, 6.0) == 62
