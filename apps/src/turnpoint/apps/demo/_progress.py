"""What the demo shows while it runs, folded from the tail of ``events.jsonl``.

:class:`EventTail` reads the complete lines the trainer appended since the last read;
:class:`ProgressState` folds them (and the supervisor's crash and restart) into what the
display shows and what the crash trigger asks. Where the snapshot under way is comes from
the attempt's own transitions: the trainer subscribes a :class:`SnapshotStateLog` to its
snapshot driver, which logs one ``snapshot_state`` event per transition. :func:`open_display` picks a rich ``Live``
table on a terminal, or one plain line every few seconds otherwise (and with
``--no-progress``), so a log file or CI output stays readable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from rich.console import Console
from rich.live import Live
from rich.table import Table

from turnpoint.apps.demo._fault_window import FAULT_WINDOW
from turnpoint.apps.demo._report import (
    Done,
    EventLogError,
    Progress,
    Restore,
    RolloutResult,
    Snapshot,
    Start,
    TrainStep,
    parse_event,
)
from turnpoint.trainer.advanced import SnapshotState

PLAIN_INTERVAL_S = 5.0

SNAPSHOT_STATE: Final = "snapshot_state"
"""The event type :class:`SnapshotStateLog` writes (the report ignores it)."""


class SnapshotStateLog:
    """A snapshot driver subscriber for the trainer: one ``snapshot_state`` event
    (``checkpoint_id``, ``state``, ``previous``) per transition of an attempt.

    ``write(type, **fields)`` appends the event (the demo trainer's event log).
    """

    def __init__(self, write: Callable[..., None]) -> None:
        self._write = write

    def __call__(self, attempt_id: str, old: SnapshotState, new: SnapshotState, now: float) -> None:
        self._write(SNAPSHOT_STATE, checkpoint_id=attempt_id, state=new.value, previous=old.value)


class EventTail:
    """Reads the objects appended to a JSON-lines file since the last read.

    Only complete lines are consumed: a line still being written (or torn by a killed
    writer) stays unread until its newline arrives, so the offset always sits on a line
    boundary. Blocking: call :meth:`read_new` through a thread from async code.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.skipped = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        complete = chunk.rfind(b"\n") + 1
        self.offset += complete
        objects = []
        for line in chunk[:complete].splitlines():
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                # The live view shows what it can; the report names the bad line.
                self.skipped += 1
                continue
            if isinstance(value, dict):
                objects.append(value)
        return objects


@dataclass
class ProgressState:
    """The run as the display and the crash trigger see it."""

    total_steps: int
    crash_planned: bool = True
    crash_point: str | None = None
    """``--crash-at``: the trainer kills itself there; the timed crash stays off."""
    incarnation: int = 0
    step: int = 0
    in_flight: int = 0
    queue: int = 0
    admission_closed: bool = False
    rollouts: int = 0
    published: int = 0
    failed: int = 0
    fault_window: int = 0
    """The fault window the current trainer opened last (``_fault_window.py``): it holds
    it until the supervisor's fault has landed."""
    crashed_at_step: int | None = None
    restarted: bool = False
    restored_from: str | None = None
    restored: bool = False
    done: bool = False
    last_reward: float | None = None
    phase: str = "starting participants"
    snapshot: str = "none yet"
    """The snapshot attempt under way and its state, or how the last one ended."""
    unreadable: int = 0
    _restored_incarnation: int | None = field(default=None, repr=False)
    _rollout_keys: set[tuple[str, int]] = field(default_factory=set, repr=False)

    def apply(self, raw: dict[str, Any]) -> None:
        """Fold one trainer event; a malformed one is counted, never raised."""
        if raw.get("type") == SNAPSHOT_STATE:
            self._apply_snapshot_state(raw)
            return
        if raw.get("type") == FAULT_WINDOW:
            window = raw.get("n")
            if isinstance(window, int) and not isinstance(window, bool):
                self.fault_window = window
            else:
                self.unreadable += 1
            return
        try:
            event = parse_event(raw)
        except EventLogError:
            self.unreadable += 1
            return
        if isinstance(event, Start):
            self.incarnation = event.incarnation
            self.step = event.step
            self.fault_window = 0
            self.in_flight = 0
            self.admission_closed = False
            # The trainer may log its restore before or after its start.
            restoring = (
                bool(event.restored_from) and self._restored_incarnation != event.incarnation
            )
            self.phase = "restoring" if restoring else "training"
            self.restored_from = event.restored_from
        elif isinstance(event, Progress):
            self.step = event.step
            self.in_flight = event.in_flight
            self.queue = event.queue
            self.admission_closed = event.admission_closed
            if self.phase in ("starting the trainer", "restoring"):
                self.phase = "training"
        elif isinstance(event, RolloutResult):
            # A restored trainer may log again what its snapshot's queue held.
            self._rollout_keys.add(event.key)
            self.rollouts = len(self._rollout_keys)
        elif isinstance(event, TrainStep):
            self.step = event.step
            self.last_reward = event.mean_reward
        elif isinstance(event, Snapshot):
            if event.outcome == "published":
                self.published += 1
            elif event.outcome == "failed":
                self.failed += 1
        elif isinstance(event, Restore):
            self.restored = True
            self.restored_from = event.checkpoint_id
            self._restored_incarnation = event.incarnation
            self.phase = "training"
        elif isinstance(event, Done):
            self.step = event.step
            self.done = True
            self.in_flight = 0
            self.phase = "done"

    def _apply_snapshot_state(self, raw: dict[str, Any]) -> None:
        checkpoint_id, state = raw.get("checkpoint_id"), raw.get("state")
        try:
            known = SnapshotState(state)
        except ValueError:
            known = None
        if not isinstance(checkpoint_id, str) or known is None:
            self.unreadable += 1
            return
        if known.final:
            self.snapshot = f"{checkpoint_id} {known.value}"
        elif known is not SnapshotState.NEW:
            self.snapshot = f"{checkpoint_id}: {known.value}"

    def note_crash(self) -> None:
        self.crashed_at_step = self.step
        self.in_flight = 0
        self.admission_closed = False
        self.phase = "crashed: restarting participants"

    def note_restart(self) -> None:
        self.restarted = True
        self.phase = "restarted: trainer resuming"

    def crash_due(self) -> bool:
        """Whether the injected crash should land now: the first trainer holds its
        first fault window (:mod:`turnpoint.apps.demo._fault_window`: a snapshot that cut
        rollouts in flight published, rollouts in flight, 40% of the steps done, steps
        left). Only once; never with ``crash_point``: the trainer kills itself there.
        """
        if not self.crash_planned or self.crash_point is not None:
            return False
        if self.crashed_at_step is not None or self.done:
            return False
        return self.incarnation == 1 and self.fault_window == 1

    @property
    def crash_status(self) -> str:
        if not self.crash_planned:
            return "off (--no-crash)"
        if self.crashed_at_step is None:
            if self.crash_point is not None:
                return f"armed (the trainer dies at {self.crash_point})"
            return "armed (after a published snapshot, 40% through or later)"
        status = f"crashed at step {self.crashed_at_step}"
        if self.restarted:
            status += ", restarted"
        if self.restored:
            status += f", restored from {self.restored_from}"
        return status

    def line(self) -> str:
        """One plain line for logs and non-terminals."""
        return (
            f"demo: {self.phase}; step {self.step}/{self.total_steps}, "
            f"{self.in_flight} in flight, {self.rollouts} rollouts recorded, "
            f"{self.published} snapshots published, "
            f"admission {'closed' if self.admission_closed else 'open'}; "
            f"crash: {self.crash_status}; snapshot: {self.snapshot}"
        )

    def table(self) -> Table:
        table = Table(title="turnpoint demo", show_header=False, title_justify="left")
        table.add_column("what", style="bold")
        table.add_column("value")
        table.add_row("phase", self.phase)
        incarnation = f" (trainer incarnation {self.incarnation})" if self.incarnation else ""
        table.add_row("training step", f"{self.step} / {self.total_steps}{incarnation}")
        table.add_row("rollouts in flight", str(self.in_flight))
        table.add_row("rollouts recorded", str(self.rollouts))
        table.add_row(
            "snapshots",
            f"{self.published} published" + (f", {self.failed} failed" if self.failed else ""),
        )
        table.add_row("snapshot now", self.snapshot)
        table.add_row(
            "admission closed now",
            "[yellow]yes[/yellow]" if self.admission_closed else "no",
        )
        if self.last_reward is not None:
            table.add_row("last mean reward", f"{self.last_reward:.3f}")
        table.add_row("crash", self.crash_status)
        return table


class ProgressDisplay(Protocol):
    def update(self, state: ProgressState, now: float) -> None: ...

    def close(self, state: ProgressState) -> None: ...


class LiveDisplay:
    """A rich ``Live`` table, redrawn on every update."""

    def __init__(self, console: Console) -> None:
        self._live = Live(console=console, auto_refresh=False, transient=False)
        self._live.start()

    def update(self, state: ProgressState, now: float) -> None:
        self._live.update(state.table(), refresh=True)

    def close(self, state: ProgressState) -> None:
        self._live.update(state.table(), refresh=True)
        self._live.stop()


class PlainDisplay:
    """One line every ``interval_s`` seconds (of the ``now`` the caller passes), and one
    whenever the phase changes, so that the crash and the restart are never skipped."""

    def __init__(self, console: Console, interval_s: float = PLAIN_INTERVAL_S) -> None:
        self._console = console
        self._interval_s = interval_s
        self._next: float | None = None
        self._phase: str | None = None

    def update(self, state: ProgressState, now: float) -> None:
        if self._next is not None and now < self._next and state.phase == self._phase:
            return
        self._next = now + self._interval_s
        self._phase = state.phase
        self._console.print(state.line(), markup=False, highlight=False, soft_wrap=True)

    def close(self, state: ProgressState) -> None:
        self._console.print(state.line(), markup=False, highlight=False, soft_wrap=True)


def open_display(console: Console, *, live: bool) -> ProgressDisplay:
    """A live table when asked for and stdout is a terminal; plain lines otherwise."""
    if live and console.is_terminal:
        return LiveDisplay(console)
    return PlainDisplay(console)
