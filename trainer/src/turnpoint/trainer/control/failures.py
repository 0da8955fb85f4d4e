"""How a control call failed, and what that means for the operation.

The coordinator's client raises :class:`ControlCallError` (and its kinds) when a call
got no verdict from the participant's protocol core, and :class:`NotReadyError` stands
for a not-ready prepare. :func:`classify` is the one place that turns any failure of a
control call into a :class:`Failure`: transient, not ready, or a broken invariant, from
reasons and gRPC codes only, never from message text (docs/spec.md sections 7.5 and 9).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

import grpc

from turnpoint._status import error_from_rpc, grpc_code
from turnpoint.errors import Reason, TurnpointError, is_transient
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.v1 import types_pb2

# --------------------------------------------------------------------------- errors


class ControlCallError(CoordinatorError):
    """A control call that ended without a verdict of the participant's protocol core.

    ``code`` is the gRPC status the transport reported, when there was one.
    """

    _reason = Reason.UNAVAILABLE

    def __init__(
        self,
        participant: str,
        operation: str,
        detail: str,
        code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(
            self._reason,
            f"{operation} on {participant}: {detail}",
            {"participant": participant, "operation": operation},
        )
        self.participant = participant
        self.operation = operation
        self.detail = detail
        self.code = code

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.participant, self.operation, self.detail, self.code))


class SessionBrokenError(ControlCallError):
    """The control session broke (error or end of stream) while the call waited.

    The participant may or may not have acted; retry the same request on a new session.
    """


class CallTimeoutError(ControlCallError):
    """No reply within the call's timeout (plus the reply grace on a session)."""

    _reason = Reason.DEADLINE_EXCEEDED


class TransportError(ControlCallError):
    """A unary call failed below the protocol: no ``ErrorInfo``, only a gRPC code."""


class MalformedReplyError(ControlCallError):
    """A reply that breaks the contract: wrong type, missing header, another
    participant's header, or another checkpoint id than the one asked for."""

    _reason = Reason.PROTOCOL_VIOLATION


class NotReadyError(CoordinatorError):
    """A participant answered prepare but could not park everything in time.

    Raised by the coordinator, not by the client: a not-ready prepare is an answer on
    the wire (docs/spec.md section 4). It exists so that :func:`classify` can tell this
    retryable outcome from both an infrastructure failure and a broken invariant.
    """

    def __init__(
        self,
        participant: str,
        checkpoint_id: str,
        readiness: types_pb2.ReadinessReport | None = None,
    ) -> None:
        blockers = readiness.blocker_count if readiness is not None else "?"
        super().__init__(
            Reason.NOT_READY,
            f"{participant} not ready for {checkpoint_id}: {blockers} blocker(s)",
            {"participant": participant, "checkpoint_id": checkpoint_id},
        )
        self.participant = participant
        self.checkpoint_id = checkpoint_id
        self.readiness = readiness

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.participant, self.checkpoint_id, self.readiness))


# ------------------------------------------------------------------- classification


class FailureKind(enum.Enum):
    """What a failed control call means for the operation (docs/spec.md section 7.5)."""

    # Infrastructure: unreachable, too slow, a broken stream, storage, admission.
    TRANSIENT = "transient"
    # The participant answered but could not park in time.
    NOT_READY = "not_ready"
    # Anything else: a retry would only hide it.
    INVARIANT = "invariant"


@dataclass(frozen=True, slots=True)
class Failure:
    """One participant's failed call, as the coordinator decides on it.

    ``error`` is the exception classified, kept for chaining and logs; it takes no part
    in comparisons.
    """

    kind: FailureKind
    reason: Reason | None
    code: grpc.StatusCode | None
    detail: str
    error: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def retryable(self) -> bool:
        """Whether the same operation may succeed if simply tried again."""
        return self.kind is not FailureKind.INVARIANT


# gRPC codes that mean "the call did not get through in time", whatever the participant
# is: the transport failed, not the protocol.
_TRANSIENT_CODES: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
)


def _kind_of_code(code: grpc.StatusCode | None) -> FailureKind:
    return FailureKind.TRANSIENT if code in _TRANSIENT_CODES else FailureKind.INVARIANT


def classify(error: BaseException) -> Failure:
    """Decide what a failed control call means, from reasons and codes only.

    Transient: UNAVAILABLE, DEADLINE_EXCEEDED, a broken session, a call that got no
    reply in time, and the transient protocol reasons (ADMISSION_CLOSED,
    STORAGE_UNAVAILABLE, DEADLINE_EXCEEDED). Not ready: :class:`NotReadyError`.
    Everything else, protocol refusals (STALE_CHECKPOINT, CHECKPOINT_CONFLICT, FENCED,
    INVALID_CHECKPOINT_STATE...) and malformed replies included, is an invariant break.
    """
    # The coordinator's own errors first: they are TurnpointErrors too, but what they
    # say is about the call, not a verdict the participant sent.
    if isinstance(error, NotReadyError):
        return Failure(FailureKind.NOT_READY, None, None, str(error), error)
    if isinstance(error, SessionBrokenError | CallTimeoutError):
        return Failure(FailureKind.TRANSIENT, None, error.code, str(error), error)
    if isinstance(error, MalformedReplyError):
        return Failure(FailureKind.INVARIANT, None, error.code, str(error), error)
    if isinstance(error, TransportError):
        return Failure(_kind_of_code(error.code), None, error.code, str(error), error)
    if isinstance(error, TurnpointError):
        kind = FailureKind.TRANSIENT if is_transient(error.reason) else FailureKind.INVARIANT
        return Failure(kind, error.reason, grpc_code(error.reason), str(error), error)
    if isinstance(error, grpc.RpcError):
        carried = error_from_rpc(error)
        if carried is not None:
            return classify(carried)
        code = _rpc_code(error)
        return Failure(_kind_of_code(code), None, code, _rpc_details(error), error)
    if isinstance(error, TimeoutError):
        return Failure(
            FailureKind.TRANSIENT, None, grpc.StatusCode.DEADLINE_EXCEEDED, str(error), error
        )
    return Failure(FailureKind.INVARIANT, None, None, f"{type(error).__name__}: {error}", error)


def _rpc_code(error: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(error, "code", None)
    if not callable(code):
        return None
    value = code()
    return value if isinstance(value, grpc.StatusCode) else None


def _rpc_details(error: grpc.RpcError) -> str:
    details = getattr(error, "details", None)
    text = details() if callable(details) else None
    return text if isinstance(text, str) else type(error).__name__
