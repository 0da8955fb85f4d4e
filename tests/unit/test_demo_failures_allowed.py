"""The demo's pump tolerates a blip of one link (apps/demo/_trainer.py)."""

from __future__ import annotations

import pytest

from turnpoint.apps.demo._trainer import failures_allowed

# The longest hold of a --chaos wire fault (apps/demo/_supervisor.py, wire_chaos).
LONGEST_WIRE_FAULT_S = 1.5


@pytest.mark.parametrize("interval_s", [0.1, 0.2, 0.5, 1.0, 3.0])
def test_failures_in_a_row_span_the_liveness_window(interval_s: float) -> None:
    allowed = failures_allowed(interval_s, 6.0)
    assert allowed >= 3
    # The run ends only after failures lasting at least the liveness window, far longer
    # than any wire fault the chaos run injects.
    assert allowed * interval_s >= 6.0 > LONGEST_WIRE_FAULT_S


def test_the_default_interval_keeps_three() -> None:
    assert failures_allowed(3.0, 6.0) == 3
    assert failures_allowed(0.2, 6.0) == 30
