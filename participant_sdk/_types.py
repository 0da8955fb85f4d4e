"""Plain data the participant SDK speaks: enums and frozen dataclasses mirroring turnpoint.v1.

Nothing here imports grpc or protobuf. The wire adapters in ``turnpoint.server`` convert
these to and from the generated messages at the edge; enum members carry the proto value
names minus their prefix (``Phase.PREPARED`` is ``PHASE_PREPARED``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from turnpoint.ids import EpisodeId

__all__ = [
    "BLOCKING_STATES",
    "Blocker",
    "CompletionReceipt",
    "EpisodeState",
    "Fence",
    "ParticipantKind",
    "Phase",
    "ReadinessReport",
    "RecoveryLevel",
    "RecoveryMode",
    "VerifyMode",
]


class Phase(enum.Enum):
    """IDLE -> PREPARING -> PREPARED -> COMMITTED, IDLE -> RESTORED, back to IDLE by resume."""

    IDLE = "IDLE"
    PREPARING = "PREPARING"
    PREPARED = "PREPARED"
    COMMITTED = "COMMITTED"
    RESTORED = "RESTORED"


class EpisodeState(enum.Enum):
    """Where one piece of work is, as far as checkpoint readiness goes."""

    RUNNING = "RUNNING"
    PARKED = "PARKED"
    AWAITING_MODEL = "AWAITING_MODEL"
    COMPLETED_UNACKED = "COMPLETED_UNACKED"
    RESTART = "RESTART"
    RETIRING = "RETIRING"
    RESTORED = "RESTORED"
    REQUEST_IN_FLIGHT = "REQUEST_IN_FLIGHT"
    IDLE = "IDLE"


# States that keep a prepare from being ready. AWAITING_MODEL is deliberately absent: a
# model call made right after a boundary counts as parked at that boundary.
BLOCKING_STATES = frozenset(
    {
        EpisodeState.RUNNING,
        EpisodeState.COMPLETED_UNACKED,
        EpisodeState.RETIRING,
        EpisodeState.REQUEST_IN_FLIGHT,
    }
)


class ParticipantKind(enum.Enum):
    AGENT = "AGENT"
    RESOURCES = "RESOURCES"
    MODEL = "MODEL"
    ENVIRONMENT = "ENVIRONMENT"


class RecoveryMode(enum.Enum):
    """What a participant can capture; unaudited servers are RESTART_ONLY."""

    STATELESS = "STATELESS"
    EXPORTED = "EXPORTED"
    RESTART_ONLY = "RESTART_ONLY"


class VerifyMode(enum.Enum):
    """WAIT: an in-flight verify blocks prepare. REPLAY: safe to run again, never blocks."""

    WAIT = "WAIT"
    REPLAY = "REPLAY"


class RecoveryLevel(enum.Enum):
    """How finely an unfinished rollout can be continued, finest first."""

    TURN = "TURN"
    SIBLING = "SIBLING"
    PROMPT_GROUP = "PROMPT_GROUP"


@dataclass(frozen=True, slots=True)
class Fence:
    """Who sends a control request: the coordinator's id and the epoch it persisted."""

    coordinator_id: str
    epoch: int

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"fence epoch must be an integer >= 0, got {self.epoch!r}")


@dataclass(frozen=True, slots=True)
class CompletionReceipt:
    """What the trainer acknowledges for one completed result of one attempt."""

    episode: EpisodeId
    receipt_id: str


@dataclass(frozen=True, slots=True)
class Blocker:
    """One episode that keeps a prepare from being ready, and why."""

    episode: EpisodeId
    state: EpisodeState
    receipt: CompletionReceipt | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ReadinessReport:
    """A participant's answer to "can you be cut now?".

    ``blockers`` is capped by the caller's limit; ``blocker_count`` never is.
    ``restarts`` (episodes this participant cannot capture) is never capped: the
    coordinator must leave every one of them out of the commit scope.
    """

    ready: bool
    blocker_count: int
    blockers: tuple[Blocker, ...]
    counts: Mapping[EpisodeState, int] = field(default_factory=lambda: MappingProxyType({}))
    restarts: tuple[EpisodeId, ...] = ()
