"""What one snapshot attempt reports, and why an attempt failed.

docs/spec.md section 7.5: a failure's reason is decided from participants' failure
kinds, reasons and gRPC codes only (:func:`failure_reason`), worst first; every reason
but :attr:`FailureReason.INVARIANT` is transient. The report's phases are the attempt's
states (:mod:`turnpoint.trainer.snapshots.attempt`): they add up to its total.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import grpc

from turnpoint.errors import Reason
from turnpoint.trainer.control.failures import Failure, FailureKind
from turnpoint.trainer.snapshots.attempt import SnapshotPhase, SnapshotState


class SnapshotOutcome(enum.Enum):
    """How an attempt ended: the name of its final :class:`SnapshotState`."""

    PUBLISHED = "published"
    SKIPPED = "skipped"
    FAILED = "failed"

    @property
    def state(self) -> SnapshotState:
        return SnapshotState(self.value)


class FailureReason(enum.Enum):
    """Why a snapshot attempt failed, shaped like Flink's ``CheckpointFailureReason``.

    Every reason but :attr:`INVARIANT` is transient: the pump tries again and only
    ``max_consecutive_failures`` of them in a row end the run.
    """

    # Participants answered but could not park everything in time (Flink: declined).
    NOT_READY = "not_ready"
    # A participant could not be reached, or its stream broke (Flink: task failure).
    PARTICIPANT_UNAVAILABLE = "participant_unavailable"
    # A participant, or the trainer's own acknowledgement drain, did not answer in time
    # (Flink: checkpoint expired).
    TIMEOUT = "timeout"
    # A write failed: a participant's disk (STORAGE_UNAVAILABLE), the trainer anchor or
    # the publication (Flink: IO exception).
    STORAGE = "storage"
    # A participant had already finished this checkpoint (its lease ran out) or saw it
    # with other arguments: start a new round under a new id (Flink: subsumed).
    SUPERSEDED = "superseded"
    # A participant's own hook (an export, a tool, a verifier) raised an unexpected
    # exception (HOOK_FAILED, docs/spec.md section 5.1 item 5): someone else's code failed
    # once, so this snapshot fails and the pump tries again (Flink: task failure).
    PARTICIPANT_HOOK = "participant_hook"
    # A malformed reply, a digest or topology mismatch, a refusal no retry can fix.
    INVARIANT = "invariant"

    @property
    def transient(self) -> bool:
        return self is not FailureReason.INVARIANT


_SUPERSEDING: Final = frozenset({Reason.STALE_CHECKPOINT, Reason.CHECKPOINT_CONFLICT})


def failure_reason(failures: Mapping[str, Failure]) -> FailureReason:
    """The snapshot-level reason for a set of participant failures (worst first)."""
    values = list(failures.values())
    if not values:
        raise ValueError("no failures to explain")
    broken = [f for f in values if not f.retryable]
    if broken:
        if all(f.reason in _SUPERSEDING for f in broken):
            return FailureReason.SUPERSEDED
        return FailureReason.INVARIANT
    if any(f.reason is Reason.STORAGE_UNAVAILABLE for f in values):
        return FailureReason.STORAGE
    if any(f.reason is Reason.HOOK_FAILED for f in values):
        return FailureReason.PARTICIPANT_HOOK
    transient = [f for f in values if f.kind is FailureKind.TRANSIENT]
    if any(f.code is not grpc.StatusCode.DEADLINE_EXCEEDED for f in transient):
        return FailureReason.PARTICIPANT_UNAVAILABLE
    if transient:
        return FailureReason.TIMEOUT
    return FailureReason.NOT_READY


# -------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class SnapshotReport:
    """What one :meth:`SnapshotDriver.take` did.

    ``phases`` holds the seconds of every phase the attempt went through, in order; they
    add up to ``total_s``. ``admission_closed_s`` is how long the trainer's dispatch was
    closed; ``participant_seconds`` the participants' closed time summed over all of them
    (participants times the seconds from prepare to the end of the resume).
    ``unreleased`` names participants whose resume failed (they stay closed to dispatch
    until the next attempt releases them, or their lease reopens them). ``retry_of`` is
    the failed id handed back by the pump when it could not be reused.
    """

    checkpoint_id: str
    outcome: SnapshotOutcome
    reason: FailureReason | None = None
    detail: str = ""
    phases: Mapping[SnapshotPhase, float] = field(default_factory=dict)
    total_s: float = 0.0
    admission_closed_s: float = 0.0
    participant_seconds: float = 0.0
    failures: Mapping[str, Failure] = field(default_factory=dict)
    unreleased: frozenset[str] = frozenset()
    exposed: bool = False
    retry_of: str | None = None
    continued: int = 0
    restarts: int = 0
    error: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def transient(self) -> bool:
        """A failure the pump retries (false for published and skipped attempts)."""
        return self.reason is not None and self.reason.transient

    @property
    def ok(self) -> bool:
        return self.outcome is not SnapshotOutcome.FAILED
