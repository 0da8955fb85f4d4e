"""SDK dataclasses <-> turnpoint.v1 messages, for the servicers.

The participant SDK speaks plain dataclasses; this module is the only place that knows
both shapes. Enum members map by name (``Phase.PREPARED`` <-> ``PHASE_PREPARED``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, TypeVar

from turnpoint._convert import (
    bad_argument,
    episode_from_proto,
    episode_to_proto,
    id_from_proto,
    timestamp_from_seconds,
)
from turnpoint.ids import InvalidIdError
from turnpoint.participant_sdk import (
    ArtifactRef,
    Blocker,
    CompletionReceipt,
    Fence,
    ReadinessReport,
)
from turnpoint.participant_sdk._runtime import Header
from turnpoint.v1 import types_pb2

__all__ = [
    "artifact_from_proto",
    "artifact_to_proto",
    "artifacts_from_proto",
    "enum_from_proto",
    "enum_to_proto",
    "fence_from_proto",
    "header_to_proto",
    "readiness_to_proto",
    "receipt_from_proto",
    "receipt_to_proto",
    "timestamp_or_none",
]

E = TypeVar("E", bound=enum.Enum)


def _prefix(proto_enum: Any) -> str:
    # Every turnpoint.v1 enum's values are prefixed by the enum's name in UPPER_SNAKE.
    name: str = proto_enum.DESCRIPTOR.name
    snake = "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name))
    return snake.upper() + "_"


def enum_to_proto(proto_enum: Any, value: enum.Enum) -> Any:
    return proto_enum.Value(_prefix(proto_enum) + value.name)


def enum_from_proto(proto_enum: Any, sdk_enum: type[E], number: int, field: str) -> E | None:
    """The SDK member for a proto value; None for UNSPECIFIED, INVALID_ARGUMENT if unknown."""
    try:
        name = proto_enum.Name(number).removeprefix(_prefix(proto_enum))
    except ValueError:
        raise bad_argument(f"{field}: unknown enum value {number}") from None
    if name == "UNSPECIFIED":
        return None
    try:
        return sdk_enum[name]
    except KeyError:
        raise bad_argument(f"{field}: {name} is not supported here") from None


def fence_from_proto(message: types_pb2.Fence, present: bool) -> Fence:
    if not present:
        # Tools (buf curl) may omit the fence: they act as epoch 0, which any real
        # coordinator's epoch fences out.
        return Fence("", 0)
    return Fence(message.coordinator_id, message.epoch)


def header_to_proto(header: Header) -> types_pb2.ResponseHeader:
    return types_pb2.ResponseHeader(
        participant_id=header.participant_id,
        incarnation=header.incarnation,
        epoch=header.epoch,
    )


def receipt_to_proto(receipt: CompletionReceipt) -> types_pb2.CompletionReceipt:
    return types_pb2.CompletionReceipt(
        episode=episode_to_proto(receipt.episode), receipt_id=receipt.receipt_id
    )


def receipt_from_proto(message: types_pb2.CompletionReceipt) -> CompletionReceipt:
    return CompletionReceipt(
        episode_from_proto(message.episode, "receipt.episode"),
        id_from_proto(message.receipt_id, "receipt_id"),
    )


def _blocker_to_proto(blocker: Blocker) -> types_pb2.Blocker:
    message = types_pb2.Blocker(
        episode=episode_to_proto(blocker.episode),
        state=enum_to_proto(types_pb2.EpisodeState, blocker.state),
        detail=blocker.detail,
    )
    if blocker.receipt is not None:
        message.receipt.CopyFrom(receipt_to_proto(blocker.receipt))
    return message


def readiness_to_proto(report: ReadinessReport) -> types_pb2.ReadinessReport:
    return types_pb2.ReadinessReport(
        ready=report.ready,
        blocker_count=report.blocker_count,
        blockers=[_blocker_to_proto(b) for b in report.blockers],
        counts=[
            types_pb2.StateCount(state=enum_to_proto(types_pb2.EpisodeState, state), count=count)
            for state, count in sorted(report.counts.items(), key=lambda item: item[0].name)
        ],
        restarts=[episode_to_proto(e) for e in report.restarts],
    )


def artifact_to_proto(ref: ArtifactRef) -> types_pb2.ArtifactRef:
    return types_pb2.ArtifactRef(
        path=ref.path,
        sha256=ref.sha256,
        size_bytes=ref.size_bytes,
        record_count=ref.record_count,
    )


def artifact_from_proto(message: types_pb2.ArtifactRef) -> ArtifactRef:
    try:
        return ArtifactRef(message.path, message.sha256, message.size_bytes, message.record_count)
    except InvalidIdError as error:
        raise bad_argument(error) from None


def artifacts_from_proto(messages: Iterable[types_pb2.ArtifactRef]) -> list[ArtifactRef]:
    return [artifact_from_proto(m) for m in messages]


def timestamp_or_none(seconds: float | None) -> Any:
    return None if seconds is None else timestamp_from_seconds(seconds)
