"""What the participant runtime answers: one frozen dataclass per control reply.

The runtime (:mod:`._runtime`) returns these and the server's wire adapters convert
them to ``turnpoint.v1`` messages, so neither side needs the other's types. Times are
seconds since the epoch (for a protobuf Timestamp); the operations are those of
docs/spec.md section 4.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnpoint.ids import EpisodeId
from turnpoint.protocol import (
    ArtifactRef,
    CompletionReceipt,
    EpisodeState,
    ParticipantKind,
    Phase,
    ReadinessReport,
    RecoveryLevel,
    RecoveryMode,
    VerifyMode,
)


@dataclass(frozen=True, slots=True)
class Header:
    """What every response carries: who answered and the epoch it holds."""

    participant_id: str
    incarnation: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Description:
    kind: ParticipantKind
    instance_name: str
    incarnation: str
    protocol_version: str
    recovery_mode: RecoveryMode
    verify_mode: VerifyMode
    group_scored: bool
    group_size: int
    supported_levels: tuple[RecoveryLevel, ...]
    environment: str
    phase: Phase
    # Serves RestoreRunning (CAPABILITY_RESTORE_RUNNING, docs/spec.md section 4.16).
    restore_running: bool = False


@dataclass(frozen=True, slots=True)
class PrepareResult:
    """PREPARED with a ready report, or PREPARING with blockers (an answer, not an error).

    Times (``lease_expires_at``) are seconds since the epoch, for a protobuf Timestamp.
    ``committed_empty``: the prepare also committed, saved-nothing with an empty scope
    (docs/spec.md section 4.6 item 8); ``phase`` is then COMMITTED.
    """

    checkpoint_id: str
    phase: Phase
    readiness: ReadinessReport
    lease_expires_at: float | None
    committed_empty: bool = False


@dataclass(frozen=True, slots=True)
class RenewResult:
    checkpoint_id: str
    phase: Phase
    lease_expires_at: float | None


@dataclass(frozen=True, slots=True)
class CommitResult:
    """``manifest`` is None, and so are ``artifacts`` and ``exported`` empty, exactly when
    the commit exported nothing and wrote no file (docs/spec.md section 4.8)."""

    checkpoint_id: str
    manifest: ArtifactRef | None
    artifacts: tuple[ArtifactRef, ...]
    exported: tuple[EpisodeId, ...]
    # The commit also ended the checkpoint (the request asked for release): no Resume
    # is needed (docs/spec.md section 4.8 item 9).
    released: bool = False

    @property
    def saved_nothing(self) -> bool:
        return self.manifest is None


@dataclass(frozen=True, slots=True)
class ResumeResult:
    checkpoint_id: str
    phase: Phase
    ended_active: bool


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """``retired``: what a restore into a running participant stopped and freed before it
    installed (docs/spec.md section 4.16); always empty for a fresh restore."""

    restore_id: str
    installed: tuple[EpisodeId, ...]
    phase: Phase
    retired: tuple[EpisodeId, ...] = ()


@dataclass(frozen=True, slots=True)
class RetireResult:
    stopped: tuple[EpisodeId, ...]


@dataclass(frozen=True, slots=True)
class ForgetResult:
    forgotten: int


@dataclass(frozen=True, slots=True)
class AcknowledgeResult:
    acknowledged: int
    unknown: tuple[CompletionReceipt, ...]


@dataclass(frozen=True, slots=True)
class StatusResult:
    phase: Phase
    active_checkpoint_id: str | None
    lease_expires_at: float | None
    readiness: ReadinessReport
    admission_open: bool
    lease_expiries: int
    refused_rollouts: int
    committed_checkpoint_id: str | None = None


@dataclass(frozen=True, slots=True)
class ReadinessUpdate:
    """WatchBoundaries: readiness after a change (always sent first)."""

    phase: Phase
    readiness: ReadinessReport


@dataclass(frozen=True, slots=True)
class BoundaryEvent:
    """WatchBoundaries: one episode sealed a boundary or changed state.

    An entry leaving the table (acknowledged, retired, closed) is reported once more
    with state IDLE. ``slot`` says which kind's work it is (``run``, ``session``,
    ``generate/<n>``). ``at`` is seconds since the epoch.
    """

    episode: EpisodeId
    state: EpisodeState
    boundary_index: int
    turn_index: int
    at: float
    phase: Phase
    slot: str = "run"


WatchEvent = ReadinessUpdate | BoundaryEvent
