"""Where the demo's timed fault lands: a window the first trainer opens and holds.

The timed crash (the demo's default; ``--crash-at`` is a kill the trainer fires itself)
is the supervisor's: it kills an agent, removes a Ray node or kills the trainer. It
must land where it proves something: a snapshot that cut rollouts mid-episode
published, rollouts in flight, 40% of the steps done and steps left to train after it.
Found from outside, by reading the event log every quarter of a second, such a moment
can pass unseen: a short run trains its last four steps in under half a second, and a
loaded machine delays the supervisor's reads, so the run ended with no fault at all.

So the trainer, given ``--fault-windows N``, finds each window itself (before each
training step, and as each snapshot is reported: a pipeline that drains between waves
of rollouts can have none in flight before every step of a short run), logs
``fault_window`` (its number ``n``) and stops: its event loop blocks
on a line from stdin, so it neither trains, snapshots nor dispatches until the
supervisor has injected the fault and writes ``go`` (or kills it, which is the fault).
A fault then always lands inside its window, however fast the trainer or slow the
supervisor. The windows:

1. the planned fault: this trainer published a snapshot that cut rollouts in flight,
   rollouts are in flight now, :data:`FAULT_WINDOW_START` of the steps are done and one
   is left at least;
2. where the first fault was an agent healed in place and the trainer's own crash
   follows (the default crash, docs/spec.md section 7.15): a heal was logged and a step
   trained since, the newest published snapshot cut rollouts in flight (what the
   restore will continue), and a step is left at least.

This module decides (pure: the trainer hands it what it knows); the trainer logs and
waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

FAULT_WINDOW_START: Final = 0.4
"""The share of the training steps done before the first window opens."""

FAULT_WINDOW: Final = "fault_window"
"""The event type the trainer logs as it opens a window (field ``n``)."""

GO: Final = b"go\n"
"""What the supervisor writes to the trainer's stdin to close a window."""


@dataclass(slots=True)
class FaultWindows:
    """The windows one trainer opens: ``planned`` of them (0: none), in order."""

    planned: int
    total_steps: int
    opened: int = 0

    @property
    def pending(self) -> bool:
        """Whether a window is still to open (else :meth:`due` is None, whatever it is told)."""
        return self.opened < self.planned

    def due(
        self,
        *,
        step: int,
        in_flight: int,
        newest_published_cut: int,
        healed_at_step: int | None,
    ) -> int | None:
        """The window to open now (and count as opened), or None. ``step`` is the
        number of steps trained, ``newest_published_cut`` the rollouts in flight that
        this trainer's newest published snapshot cut, ``healed_at_step`` the step at
        which its first heal in place was logged."""
        if not self.pending or step >= self.total_steps:
            return None
        if self.opened == 0:
            opens = (
                step >= first_window_step(self.total_steps)
                and newest_published_cut > 0
                and in_flight > 0
            )
        else:
            # The trainer's crash: its restore must continue work cut mid-episode.
            opens = (
                healed_at_step is not None and step > healed_at_step and newest_published_cut > 0
            )
        if not opens:
            return None
        self.opened += 1
        return self.opened


def first_window_step(total_steps: int) -> int:
    """The first step count at which window 1 may open."""
    return math.ceil(FAULT_WINDOW_START * total_steps)
