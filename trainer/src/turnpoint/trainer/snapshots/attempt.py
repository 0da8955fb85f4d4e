"""One snapshot attempt as plain state: where it is, how it got there, how long it took.

docs/spec.md section 7.4 lists what an attempt does; this module names it once. It
imports neither asyncio nor grpc and reads no clock: every change takes ``now``.

- :class:`SnapshotState` is where an attempt is. Every state but :attr:`~SnapshotState.NEW`
  and the three terminal ones is also a *phase* (:data:`SnapshotPhase`): the seconds an
  attempt spends in a state are that phase's seconds, so the phases add up to the total
  by construction (docs/spec.md section 7.10).
- :data:`TRANSITIONS` is every move an attempt may make; :class:`SnapshotAttempt` refuses any
  other (:class:`InvalidTransition`: a bug in the driver, never a participant's fault).
- :meth:`SnapshotAttempt.set_state` is the one place an attempt's state changes (Ray Train's
  ``_set_state``). It returns the move as data, a :class:`Transition`; it calls
  nobody. The driver, the attempt's one writer, tells its watchers (the metrics, the
  demo's progress display and kill switch) once the move is made.
- The facts an attempt's report needs change only through it, each in the state where
  it is learned: the anchor's step, the cut's version, the commit's attribution,
  publication; entering prepare marks the id exposed.
- :class:`SnapshotPoint` names the instants an attempt passes, in order (the demo's
  ``--crash-at`` points): :func:`points_of` says which transition passes which point,
  :meth:`SnapshotPoint.after` maps the publication's own steps (they happen inside the
  ``publish`` state, in the thread that writes).

Allowed moves (``NEW`` first; ``PUBLISHED``, ``SKIPPED`` and ``FAILED`` are final)::

    NEW -> RELEASE -> ANCHOR -> CLOSE -> DRAIN -> RETIRE -> PREPARE -> COMMIT
        -> PUBLISH -> RESUME -> REOPEN -> PUBLISHED
    RELEASE -> SKIPPED                            nothing changed since the last one
    RELEASE -> FAILED                             a restore still holds a participant
    ANCHOR | CLOSE -> ABORT -> FAILED             failed before dispatch was held
    DRAIN | RETIRE -> REOPEN -> ABORT -> FAILED   failed before any participant saw the id
    PREPARE | COMMIT | PUBLISH -> ABORT -> REOPEN -> ABORT -> FAILED
                        resume the same id everywhere, reopen, discard the partial snapshot
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from turnpoint.errors import Reason
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.storage.layout import PublishStep

_LOG = logging.getLogger(__name__)


class SnapshotState(enum.Enum):
    """Where one snapshot attempt is (docs/spec.md section 7.4); values are phase names."""

    NEW = "new"
    RELEASE = "release"  # re-sending resumes that failed earlier
    ANCHOR = "anchor"
    CLOSE = "close"
    DRAIN = "drain"
    RETIRE = "retire"
    PREPARE = "prepare"
    COMMIT = "commit"
    PUBLISH = "publish"
    RESUME = "resume"
    ABORT = "abort"  # resume (and clean up) after a failure
    REOPEN = "reopen"
    PUBLISHED = "published"
    SKIPPED = "skipped"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in _FINAL

    @property
    def is_phase(self) -> bool:
        """Whether time spent here is reported as a phase (all but NEW and the final ones)."""
        return self is not SnapshotState.NEW and not self.final


SnapshotPhase = SnapshotState
"""The phases of a snapshot report are the attempt's states (:data:`PHASES`)."""

_FINAL: Final = frozenset({SnapshotState.PUBLISHED, SnapshotState.SKIPPED, SnapshotState.FAILED})

PHASES: Final = tuple(state for state in SnapshotState if state.is_phase)
"""The phases, in the order a published attempt goes through them (abort last but one)."""

_S = SnapshotState
TRANSITIONS: Final[Mapping[SnapshotState, frozenset[SnapshotState]]] = MappingProxyType(
    {
        _S.NEW: frozenset({_S.RELEASE}),
        _S.RELEASE: frozenset({_S.ANCHOR, _S.SKIPPED, _S.FAILED}),
        _S.ANCHOR: frozenset({_S.CLOSE, _S.ABORT}),
        _S.CLOSE: frozenset({_S.DRAIN, _S.ABORT}),
        _S.DRAIN: frozenset({_S.RETIRE, _S.REOPEN}),
        _S.RETIRE: frozenset({_S.PREPARE, _S.REOPEN}),
        _S.PREPARE: frozenset({_S.COMMIT, _S.ABORT}),
        _S.COMMIT: frozenset({_S.PUBLISH, _S.ABORT}),
        _S.PUBLISH: frozenset({_S.RESUME, _S.ABORT}),
        _S.RESUME: frozenset({_S.REOPEN}),
        _S.ABORT: frozenset({_S.REOPEN, _S.FAILED}),
        _S.REOPEN: frozenset({_S.PUBLISHED, _S.ABORT}),
        _S.PUBLISHED: frozenset(),
        _S.SKIPPED: frozenset(),
        _S.FAILED: frozenset(),
    }
)
"""Every state an attempt may move to from each state (see the module docstring)."""


class SnapshotPoint(enum.Enum):
    """The instants one attempt passes, in order; the values are the names users type
    (``turnpoint demo --crash-at POINT``).

    ``dispatch-closed``: dispatch is closed, acknowledgements drained and retires
    flushed, prepare about to be sent. ``prepare-sent`` / ``commit-sent``: the call is
    under way (at the latest, it has returned). ``published``: the snapshot is published
    and housekept, nobody resumed yet. The points from ``verified`` to ``latest-moved``
    are the publication's own steps (:class:`~turnpoint.trainer.storage.manifest.PublishStep`).
    """

    ANCHOR_WRITTEN = "anchor-written"
    DISPATCH_CLOSED = "dispatch-closed"
    PREPARE_SENT = "prepare-sent"
    PREPARED = "prepared"
    COMMIT_SENT = "commit-sent"
    COMMITTED = "committed"
    VERIFIED = "verified"
    TREE_SYNCED = "tree-synced"
    MANIFEST_STAGED = "manifest-staged"
    MANIFEST_LINKED = "manifest-linked"
    SNAPSHOT_SYNCED = "snapshot-synced"
    LATEST_STAGED = "latest-staged"
    LATEST_MOVED = "latest-moved"
    PUBLISHED = "published"
    RESUMED = "resumed"

    @classmethod
    def after(cls, step: PublishStep) -> SnapshotPoint:
        """The point right after one step of the publication."""
        return cls(step.value.replace("_", "-"))

    @property
    def restores_this_snapshot(self) -> bool:
        """From here on the attempt's manifest is linked: it is published, and a restore
        picks it."""
        order = list(SnapshotPoint)
        return order.index(self) >= order.index(SnapshotPoint.MANIFEST_LINKED)

    @property
    def during(self) -> SnapshotState | None:
        """The state whose call this point lands in while it is under way, if any."""
        return _DURING.get(self)


_DURING: Final = {
    SnapshotPoint.PREPARE_SENT: SnapshotState.PREPARE,
    SnapshotPoint.COMMIT_SENT: SnapshotState.COMMIT,
}

_P = SnapshotPoint
_POINTS: Final[Mapping[tuple[SnapshotState, SnapshotState], tuple[SnapshotPoint, ...]]] = {
    (_S.ANCHOR, _S.CLOSE): (_P.ANCHOR_WRITTEN,),
    (_S.RETIRE, _S.PREPARE): (_P.DISPATCH_CLOSED,),
    (_S.PREPARE, _S.COMMIT): (_P.PREPARE_SENT, _P.PREPARED),
    (_S.PREPARE, _S.ABORT): (_P.PREPARE_SENT,),
    (_S.COMMIT, _S.PUBLISH): (_P.COMMIT_SENT, _P.COMMITTED),
    (_S.COMMIT, _S.ABORT): (_P.COMMIT_SENT,),
    (_S.PUBLISH, _S.RESUME): (_P.PUBLISHED,),
    (_S.RESUME, _S.REOPEN): (_P.RESUMED,),
}


def points_of(old: SnapshotState, new: SnapshotState) -> tuple[SnapshotPoint, ...]:
    """The points a transition passes, in order (the publication's steps are not
    transitions: see :meth:`SnapshotPoint.after`). A ``-sent`` point is listed where the
    call ends; a watcher may have seen it land earlier, while the call was under way."""
    return _POINTS.get((old, new), ())


class InvalidTransition(CoordinatorError):
    """An attempt was told to move where :data:`TRANSITIONS` does not allow: a bug."""

    def __init__(self, attempt_id: str, old: SnapshotState, new: SnapshotState) -> None:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[old])) or "nothing (final)"
        super().__init__(
            Reason.PROTOCOL_VIOLATION,
            f"snapshot attempt {attempt_id}: {old.value} -> {new.value} is not a transition "
            f"(from {old.value}: {allowed})",
            {"attempt_id": attempt_id, "old": old.value, "new": new.value},
        )
        self.attempt_id = attempt_id
        self.old = old
        self.new = new


class InvalidFact(CoordinatorError):
    """A fact recorded in a state where it cannot be learned: a driver bug."""

    def __init__(self, attempt_id: str, state: SnapshotState, fact: str) -> None:
        super().__init__(
            Reason.PROTOCOL_VIOLATION,
            f"snapshot attempt {attempt_id}: {fact} recorded in state {state.value}",
            {"attempt_id": attempt_id, "state": state.value, "fact": fact},
        )


@dataclass(frozen=True, slots=True)
class Transition:
    """One move of one attempt, as :meth:`SnapshotAttempt.set_state` made it."""

    checkpoint_id: str
    old: SnapshotState
    new: SnapshotState
    now: float


"""``(attempt id, old state, new state, now)``; ``now`` is on the driver's clock."""


class PhaseTimes:
    """Seconds per phase of one attempt, from its transitions; they add up to the total.

    Fed one transition at a time (:meth:`record`), it also keeps the instants the report
    needs: when dispatch closed and reopened, when prepare started and when the
    participants were released (resumed, by a publication's release or an abort).
    """

    def __init__(self, now: float) -> None:
        self.started = self.last = now
        self._phases: dict[SnapshotState, float] = {}
        self.closed_at: float | None = None
        self.reopened_at: float | None = None
        self.prepare_started: float | None = None
        self.released_at: float | None = None

    def record(self, old: SnapshotState, new: SnapshotState, now: float) -> None:
        if old is SnapshotState.NEW:
            self.started = now  # the attempt's clock starts when it leaves NEW
        if old.is_phase:
            self._phases[old] = self._phases.get(old, 0.0) + (now - self.last)
        self.last = now
        if old is SnapshotState.CLOSE:
            self.closed_at = now
        elif old is SnapshotState.REOPEN and self.reopened_at is None:
            self.reopened_at = now
        if new is SnapshotState.PREPARE:
            self.prepare_started = now
        elif new is SnapshotState.REOPEN and self.prepare_started is not None:
            self.released_at = now

    def dispatch_reopened(self, now: float) -> None:
        """Dispatch reopened before the attempt reached REOPEN (once the books were read)."""
        if self.reopened_at is None:
            self.reopened_at = now

    @property
    def phases(self) -> Mapping[SnapshotState, float]:
        """Seconds per phase, in the order the attempt first entered each."""
        return MappingProxyType(dict(self._phases))

    @property
    def total_s(self) -> float:
        return self.last - self.started

    @property
    def admission_closed_s(self) -> float:
        """From the end of ``close`` until dispatch reopened: once the books were read
        after a prepare, else at the end of ``reopen`` (0 if dispatch never closed)."""
        if self.closed_at is None or self.reopened_at is None:
            return 0.0
        return self.reopened_at - self.closed_at

    @property
    def held_s(self) -> float:
        """From the start of prepare to the participants' release (0 if never prepared)."""
        if self.prepare_started is None or self.released_at is None:
            return 0.0
        return self.released_at - self.prepare_started


@dataclass(frozen=True, slots=True)
class SnapshotAttemptView:
    """What a watcher may read of the current attempt (:meth:`SnapshotAttempt.view`)."""

    checkpoint_id: str
    state: SnapshotState
    exposed: bool
    published: bool
    continued: int
    restarts: int


class SnapshotAttempt:
    """One snapshot attempt: its state, its phase times and the facts its report needs.

    Created in :attr:`SnapshotState.NEW` at ``now``; :meth:`set_state` is the only way it
    moves, and the methods below the only way its facts change, each allowed only in the
    state where the fact is learned (:class:`InvalidTransition` otherwise: a driver bug).
    """

    def __init__(self, checkpoint_id: str, now: float) -> None:
        self.checkpoint_id = checkpoint_id
        self._state = SnapshotState.NEW
        self.times = PhaseTimes(now)
        self.history: list[Transition] = []
        self._exposed = False  # some participant may have seen the id (prepare was sent)
        self._published = False
        self._continued = 0
        self._restarts = 0
        self._cut_version: int | None = None
        self._step: int | None = None

    @property
    def state(self) -> SnapshotState:
        return self._state

    def set_state(self, new: SnapshotState, now: float) -> Transition:
        """Move to ``new`` at ``now`` and return the move; raise
        :class:`InvalidTransition` if it is not allowed (nothing changes then)."""
        old = self._state
        if new not in TRANSITIONS[old]:
            raise InvalidTransition(self.checkpoint_id, old, new)
        self._state = new
        if new is SnapshotState.PREPARE:
            self._exposed = True
        self.times.record(old, new, now)
        transition = Transition(self.checkpoint_id, old, new, now)
        self.history.append(transition)
        return transition

    # -- facts, each learned in one state ----------------------------------------------

    def _require(self, state: SnapshotState, fact: str) -> None:
        if self._state is not state:
            raise InvalidFact(self.checkpoint_id, self._state, fact)

    def anchor_written(self, step: int) -> None:
        """The trainer anchor is durable and holds ``step`` (in ANCHOR)."""
        self._require(SnapshotState.ANCHOR, "anchor written")
        self._step = step

    def cut_read(self, version: int) -> None:
        """The trainer's books were read with every participant parked (in PREPARE)."""
        self._require(SnapshotState.PREPARE, "cut read")
        self._cut_version = version

    def commit_attributed(self, *, continued: int, restarts: int) -> None:
        """How many unfinished rollouts the cut continues and restarts (in COMMIT)."""
        self._require(SnapshotState.COMMIT, "commit attributed")
        self._continued, self._restarts = continued, restarts

    def publication_durable(self) -> None:
        """The manifest is published (in PUBLISH): whatever fails later, it stays."""
        self._require(SnapshotState.PUBLISH, "published")
        self._published = True

    @property
    def exposed(self) -> bool:
        return self._exposed

    @property
    def published(self) -> bool:
        return self._published

    @property
    def continued(self) -> int:
        return self._continued

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def cut_version(self) -> int | None:
        return self._cut_version

    @property
    def step(self) -> int | None:
        return self._step

    def view(self) -> SnapshotAttemptView:
        return SnapshotAttemptView(
            checkpoint_id=self.checkpoint_id,
            state=self._state,
            exposed=self._exposed,
            published=self._published,
            continued=self._continued,
            restarts=self._restarts,
        )
