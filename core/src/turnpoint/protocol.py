"""The protocol's vocabulary, defined once: what both sides of turnpoint.v1 speak.

Enums and frozen dataclasses mirroring ``turnpoint.v1`` (docs/spec.md sections 2-4):
participant kinds, recovery modes and levels, verify modes, phases, episode states, the
fence, readiness reports, completion receipts and artifact references. The participant
SDK, the servers and the coordinator all take these from here.

Nothing here imports grpc or protobuf; ``turnpoint.convert`` converts to and from the
generated messages at the edge. Enum members carry the proto value names minus their
prefix (``Phase.PREPARED`` is ``PHASE_PREPARED``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from turnpoint.ids import EpisodeId, InvalidIdError, validate_id

# What Describe answers and the coordinator requires; one string per wire package.
PROTOCOL_VERSION = "turnpoint.v1"

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class Phase(enum.Enum):
    """IDLE -> PREPARING -> PREPARED -> COMMITTED, IDLE -> RESTORED, back to IDLE by resume."""

    IDLE = "IDLE"
    PREPARING = "PREPARING"
    PREPARED = "PREPARED"
    COMMITTED = "COMMITTED"
    RESTORED = "RESTORED"


class EpisodeState(enum.Enum):
    """Where one piece of work is, as far as checkpoint readiness goes."""

    # Members are singletons compared by identity; hashing by identity keeps them C-level
    # dict keys (Enum's own __hash__ is Python), counted on every change of work state.
    __hash__ = object.__hash__

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


class RecoveryLevel(enum.StrEnum):
    """How finely an unfinished rollout can be continued, ordered finest first.

    The values are the lower-case names the coordinator's configuration uses
    (``target_level: turn``). Levels compare by fineness: ``TOKEN < TURN < SIBLING <
    PROMPT_GROUP``, so ``max`` of two levels is the coarser one. ``TOKEN`` continues a
    generation a checkpoint cut from its token prefix (docs/spec.md section 5.5).
    """

    TOKEN = "token"
    TURN = "turn"
    SIBLING = "sibling"
    PROMPT_GROUP = "prompt_group"

    @classmethod
    def parse(cls, text: str | RecoveryLevel) -> RecoveryLevel:
        if isinstance(text, RecoveryLevel):
            return text
        try:
            return cls(text.lower())
        except ValueError:
            valid = ", ".join(level.value for level in cls)
            raise ValueError(f"unknown recovery level {text!r}; choose one of {valid}") from None

    @property
    def label(self) -> str:
        return self.value

    @property
    def rank(self) -> int:
        return _LEVEL_RANK[self]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, RecoveryLevel):
            return NotImplemented
        return self.rank < other.rank

    def __le__(self, other: object) -> bool:
        if not isinstance(other, RecoveryLevel):
            return NotImplemented
        return self.rank <= other.rank

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, RecoveryLevel):
            return NotImplemented
        return self.rank > other.rank

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, RecoveryLevel):
            return NotImplemented
        return self.rank >= other.rank


_LEVEL_RANK = {level: rank for rank, level in enumerate(RecoveryLevel)}


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


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    """One durable file of a snapshot, as commit replies, restore requests and the
    snapshot manifest name it (docs/spec.md section 8).

    ``path`` is relative to ``<root>/<snapshot>``: ``"<instance>/<file name>"``, both
    components valid ids, so it can never be absolute or contain ``..``. Every field is
    checked on construction; a bad one raises :class:`~turnpoint.ids.InvalidIdError`
    naming the field.
    """

    path: str
    sha256: str
    size_bytes: int
    record_count: int

    def __post_init__(self) -> None:
        parts = self.path.split("/") if isinstance(self.path, str) else []
        if len(parts) != 2:
            raise InvalidIdError("artifact path", self.path, "must be '<instance>/<file name>'")
        validate_id(parts[0], "artifact path instance")
        validate_id(parts[1], "artifact path file name")
        if not isinstance(self.sha256, str) or not _SHA256_HEX.fullmatch(self.sha256):
            raise InvalidIdError("sha256", self.sha256, "must be 64 lowercase hex characters")
        for name in ("size_bytes", "record_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidIdError(name, value, "must be an integer >= 0")
