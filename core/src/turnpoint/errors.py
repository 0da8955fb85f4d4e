"""Protocol errors: one root exception, one reason enum, one table to gRPC codes.

docs/spec.md section 9: every error on the wire carries a ``google.rpc.Status`` with
exactly one ``ErrorInfo`` whose reason comes from ``turnpoint.v1.ErrorReason``. Callers
branch on :class:`Reason`, never on message text.

This module is pure (no grpc import) so that the protocol cores can raise these errors;
``turnpoint._status`` converts them to and from the wire.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

DOMAIN = "turnpoint"


class Reason(enum.Enum):
    """Why a call failed; the names match ``turnpoint.v1.ErrorReason`` minus its prefix."""

    ADMISSION_CLOSED = "ADMISSION_CLOSED"
    STALE_CHECKPOINT = "STALE_CHECKPOINT"
    CHECKPOINT_CONFLICT = "CHECKPOINT_CONFLICT"
    INVALID_PHASE = "INVALID_PHASE"
    RESTART_IN_SCOPE = "RESTART_IN_SCOPE"
    RETIRE_INCOMPLETE = "RETIRE_INCOMPLETE"
    FENCED = "FENCED"
    STALE_ATTEMPT = "STALE_ATTEMPT"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    INVALID_CHECKPOINT_STATE = "INVALID_CHECKPOINT_STATE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    STORAGE_UNAVAILABLE = "STORAGE_UNAVAILABLE"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    NOT_READY = "NOT_READY"
    PROTOCOL_VIOLATION = "PROTOCOL_VIOLATION"
    HOOK_FAILED = "HOOK_FAILED"
    PERMISSION_DENIED = "PERMISSION_DENIED"


# The one table of docs/spec.md section 9: reason -> gRPC status code name. Names, not
# ``grpc.StatusCode`` members, so that this module stays importable without grpc.
REASON_CODES: Mapping[Reason, str] = MappingProxyType(
    {
        Reason.ADMISSION_CLOSED: "UNAVAILABLE",
        Reason.STALE_CHECKPOINT: "ABORTED",
        Reason.CHECKPOINT_CONFLICT: "ABORTED",
        Reason.INVALID_PHASE: "FAILED_PRECONDITION",
        Reason.RESTART_IN_SCOPE: "FAILED_PRECONDITION",
        Reason.RETIRE_INCOMPLETE: "FAILED_PRECONDITION",
        Reason.FENCED: "FAILED_PRECONDITION",
        Reason.STALE_ATTEMPT: "FAILED_PRECONDITION",
        Reason.INVALID_ARGUMENT: "INVALID_ARGUMENT",
        Reason.INVALID_CHECKPOINT_STATE: "DATA_LOSS",
        Reason.UNAUTHENTICATED: "UNAUTHENTICATED",
        Reason.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
        # A participant's own storage failing (disk full, I/O error) is transient: the
        # coordinator retries the same checkpoint id (docs/spec.md section 7.5).
        Reason.STORAGE_UNAVAILABLE: "UNAVAILABLE",
        Reason.NOT_FOUND: "NOT_FOUND",
        Reason.UNAVAILABLE: "UNAVAILABLE",
        Reason.NOT_READY: "UNAVAILABLE",
        Reason.PROTOCOL_VIOLATION: "INTERNAL",
        Reason.HOOK_FAILED: "INTERNAL",
        Reason.PERMISSION_DENIED: "PERMISSION_DENIED",
    }
)

# Reasons after which simply trying the same operation again may succeed.
_TRANSIENT = frozenset(
    {
        Reason.ADMISSION_CLOSED,
        Reason.DEADLINE_EXCEEDED,
        Reason.STORAGE_UNAVAILABLE,
        Reason.UNAVAILABLE,
        Reason.NOT_READY,
        # Someone else's code failed once: that snapshot fails and is retried; only
        # max_consecutive_failures in a row end the run (docs/spec.md section 7.5).
        Reason.HOOK_FAILED,
    }
)


def is_transient(reason: Reason) -> bool:
    """Whether the same call may succeed if it is simply tried again."""
    return reason in _TRANSIENT


class TurnpointError(Exception):
    """Root of every protocol error.

    ``reason`` is what callers branch on; ``metadata`` carries the dynamic values (the
    checkpoint id, the episode, the phase) that end up in ``ErrorInfo.metadata``. The
    message is for humans and is never parsed.
    """

    def __init__(
        self,
        reason: Reason,
        message: str,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})

    @property
    def code_name(self) -> str:
        return REASON_CODES[self.reason]

    @property
    def transient(self) -> bool:
        return is_transient(self.reason)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason.name}, {self.message!r}, {self.metadata!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # Errors cross process boundaries (Ray actors, worker pools): keep them picklable.
        return (type(self), (self.reason, self.message, self.metadata))
