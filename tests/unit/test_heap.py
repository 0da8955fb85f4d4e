"""The start-up heap a process of ours freezes (turnpoint.apps._heap)."""

from __future__ import annotations

import gc

import pytest

from turnpoint.apps._heap import frozen_heap


def test_a_frozen_heap_is_handed_back_to_the_collector_on_exit() -> None:
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_frozen_heap_thaws_when_the_while_fails() -> None:
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("the figure failed")
    assert gc.get_freeze_count() == 0
