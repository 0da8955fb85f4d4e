"""The error table of docs/spec.md section 9 is total and matches the proto enum."""

from __future__ import annotations

import grpc
import pytest

from turnpoint._status import (
    control_error_to_error,
    error_to_control_error,
    grpc_code,
    reason_from_proto,
    reason_to_proto,
)
from turnpoint.errors import REASON_CODES, Reason, TurnpointError, is_transient
from turnpoint.v1 import types_pb2

PROTO_REASONS = [
    name.removeprefix("ERROR_REASON_")
    for name in types_pb2.ErrorReason.keys()
    if name != "ERROR_REASON_UNSPECIFIED"
]

# docs/spec.md section 9, verbatim as data.
SPEC_TABLE = {
    "ADMISSION_CLOSED": "UNAVAILABLE",
    "STALE_CHECKPOINT": "ABORTED",
    "CHECKPOINT_CONFLICT": "ABORTED",
    "INVALID_PHASE": "FAILED_PRECONDITION",
    "RESTART_IN_SCOPE": "FAILED_PRECONDITION",
    "RETIRE_INCOMPLETE": "FAILED_PRECONDITION",
    "FENCED": "FAILED_PRECONDITION",
    "STALE_ATTEMPT": "FAILED_PRECONDITION",
    "INVALID_ARGUMENT": "INVALID_ARGUMENT",
    "INVALID_CHECKPOINT_STATE": "DATA_LOSS",
    "UNAUTHENTICATED": "UNAUTHENTICATED",
    "DEADLINE_EXCEEDED": "DEADLINE_EXCEEDED",
}


def test_every_proto_reason_has_a_python_reason_and_back() -> None:
    assert sorted(PROTO_REASONS) == sorted(r.name for r in Reason)


def test_every_reason_has_a_grpc_code() -> None:
    assert set(REASON_CODES) == set(Reason)
    for reason in Reason:
        assert isinstance(grpc_code(reason), grpc.StatusCode)


@pytest.mark.parametrize(("reason", "code"), sorted(SPEC_TABLE.items()))
def test_codes_follow_the_specification(reason: str, code: str) -> None:
    assert REASON_CODES[Reason[reason]] == code


@pytest.mark.parametrize("reason", list(Reason))
def test_reason_round_trips_through_the_proto_enum(reason: Reason) -> None:
    assert reason_from_proto(reason_to_proto(reason)) is reason


def test_unspecified_and_unknown_enum_values_are_not_reasons() -> None:
    assert reason_from_proto(types_pb2.ERROR_REASON_UNSPECIFIED) is None
    assert reason_from_proto(9999) is None


def test_control_error_carries_reason_code_and_metadata() -> None:
    err = TurnpointError(Reason.STALE_CHECKPOINT, "late", {"checkpoint_id": "ck-000000000001"})
    message = error_to_control_error(err)
    assert message.code == grpc.StatusCode.ABORTED.value[0]
    back = control_error_to_error(message)
    assert back is not None
    assert back.reason is Reason.STALE_CHECKPOINT
    assert back.metadata == {"checkpoint_id": "ck-000000000001"}


def test_transient_reasons_are_the_retryable_ones() -> None:
    assert is_transient(Reason.ADMISSION_CLOSED)
    assert is_transient(Reason.STORAGE_UNAVAILABLE)
    assert not is_transient(Reason.FENCED)
    assert not is_transient(Reason.INVALID_CHECKPOINT_STATE)


def test_errors_pickle_with_their_data() -> None:
    import pickle

    err = TurnpointError(Reason.FENCED, "old epoch", {"epoch": "3"})
    back = pickle.loads(pickle.dumps(err))
    assert (back.reason, back.message, back.metadata) == (err.reason, err.message, err.metadata)


def _public_exceptions(package: str) -> list[type[BaseException]]:
    import importlib
    import inspect
    import pkgutil

    root = importlib.import_module(package)
    found: set[type[BaseException]] = set()
    for info in pkgutil.iter_modules(root.__path__, prefix=f"{package}."):
        if info.name.endswith("._anchor"):
            continue  # imports torch; its AnchorError is checked below
        module = importlib.import_module(info.name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            # Failures are Exceptions; a BaseException such as Preempted (a SystemExit
            # that ends the process with status 0 after a preemption snapshot) is a
            # signal to unwind, not a failure to catch.
            if (
                issubclass(value, Exception)
                and value.__module__.startswith(package)
                and not value.__name__.startswith("_")
            ):
                found.add(value)
    return sorted(found, key=lambda cls: cls.__qualname__)


def test_every_coordinator_error_is_one_coordinator_error_with_a_reason() -> None:
    """``except CoordinatorError`` catches every failure the coordinator library raises."""
    from turnpoint.trainer import AnchorError, CoordinatorError

    exceptions = [*_public_exceptions("turnpoint.trainer"), AnchorError]
    assert len(exceptions) >= 10
    strays = [cls.__qualname__ for cls in exceptions if not issubclass(cls, CoordinatorError)]
    assert strays == []
    assert issubclass(CoordinatorError, TurnpointError)


def test_the_coordinators_errors_carry_the_reason_a_caller_branches_on() -> None:
    from turnpoint.trainer import ConfigError
    from turnpoint.trainer.config import ConfigProblem
    from turnpoint.trainer.control.failures import (
        CallTimeoutError,
        MalformedReplyError,
        NotReadyError,
        SessionBrokenError,
        classify,
    )
    from turnpoint.trainer.control.fanout import FanoutError

    assert SessionBrokenError("p", "prepare", "gone").reason is Reason.UNAVAILABLE
    assert CallTimeoutError("p", "prepare", "slow").reason is Reason.DEADLINE_EXCEEDED
    assert MalformedReplyError("p", "commit", "bad").reason is Reason.PROTOCOL_VIOLATION
    assert NotReadyError("p", "ck-1").reason is Reason.NOT_READY
    assert ConfigError([ConfigProblem("lease_s", "bad")]).reason is Reason.INVALID_ARGUMENT
    not_ready = {"a": classify(NotReadyError("a", "ck-1"))}
    assert FanoutError("prepare", not_ready).reason is Reason.NOT_READY
    mixed = {**not_ready, "b": classify(MalformedReplyError("b", "prepare", "bad"))}
    assert FanoutError("prepare", mixed).reason is Reason.PROTOCOL_VIOLATION
    fenced = {"c": classify(TurnpointError(Reason.FENCED, "old epoch"))}
    assert FanoutError("commit", fenced).reason is Reason.FENCED
    assert not FanoutError("commit", fenced).transient


def test_a_participant_component_error_is_a_typed_error_not_a_verdict_misread() -> None:
    """The coordinator's own errors classify by what they are, not as wire refusals."""
    from turnpoint.trainer.control.failures import FailureKind, SessionBrokenError, classify

    failure = classify(SessionBrokenError("p", "prepare", "stream ended"))
    assert failure.kind is FailureKind.TRANSIENT and failure.reason is None


def test_every_participant_sdk_error_is_one_participant_error_with_a_reason() -> None:
    """``except ParticipantError`` catches every failure the SDK raises."""
    import copy
    import pickle

    from turnpoint.participant_sdk import (
        CorruptSnapshotError,
        ParticipantError,
        SnapshotConflictError,
    )
    from turnpoint.participant_sdk._store import WriteCancelled
    from turnpoint.participant_sdk._store_format import Corruption

    exceptions = _public_exceptions("turnpoint.participant_sdk")
    assert len(exceptions) >= 7
    strays = [cls.__qualname__ for cls in exceptions if not issubclass(cls, ParticipantError)]
    assert strays == []
    corrupt = CorruptSnapshotError("snap-1", "agent-0", Corruption.DIGEST_MISMATCH, "bad")
    assert corrupt.reason is Reason.INVALID_CHECKPOINT_STATE
    assert corrupt.metadata["corruption"] == "digest_mismatch"
    assert SnapshotConflictError("s", "i", "ck-1", "ck-2").reason is Reason.CHECKPOINT_CONFLICT
    assert WriteCancelled("s", "i", "ck-1").reason is Reason.STALE_CHECKPOINT
    for error in (corrupt, WriteCancelled("s", "i", "ck-1")):
        for twin in (copy.copy(error), pickle.loads(pickle.dumps(error))):
            assert type(twin) is type(error) and str(twin) == str(error)
            assert twin.reason is error.reason and twin.metadata == error.metadata
