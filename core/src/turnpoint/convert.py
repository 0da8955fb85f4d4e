"""Conversions at the wire edge: the protocol's values to and from their messages.

Public for anyone who talks to a participant over the wire from Python (an agent calling
a resources server, a test client): episode ids, structured values
(:func:`struct_from_mapping`, and :func:`struct_to_dict`, which gives back as ``int``
the whole numbers protobuf's ``Struct`` carries as floats), durations, fences, receipts,
readiness, artifact references. The servers and the coordinator use the same functions.

Everything that comes off the wire passes through here before the pure cores see it,
so that a bad id or a negative duration becomes ``INVALID_ARGUMENT`` and changes no
state (docs/spec.md section 10.5: bad input gets a clear error and changes nothing).

The protocol vocabulary (:mod:`turnpoint.protocol`: enums, fence, readiness, receipts,
artifact references) converts here in both directions, so that the participant's
servers and the trainer's coordinator state it once and neither imports the other.
Enum members map by name (``Phase.PREPARED`` <-> ``PHASE_PREPARED``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.json_format import MessageToDict

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, InvalidIdError, episodes_of, validate_id
from turnpoint.protocol import (
    ArtifactRef,
    Blocker,
    CompletionReceipt,
    EpisodeState,
    Fence,
    ReadinessReport,
)
from turnpoint.v1 import types_pb2

E = TypeVar("E", bound=enum.Enum)


def bad_argument(error: InvalidIdError | str, **metadata: str) -> TurnpointError:
    if isinstance(error, InvalidIdError):
        return TurnpointError(
            Reason.INVALID_ARGUMENT, str(error), {"field": error.field, **metadata}
        )
    return TurnpointError(Reason.INVALID_ARGUMENT, error, metadata)


def id_from_proto(value: str, field: str) -> str:
    try:
        return validate_id(value, field)
    except InvalidIdError as error:
        raise bad_argument(error) from None


def episode_from_proto(message: types_pb2.EpisodeId, field: str = "episode") -> EpisodeId:
    try:
        return EpisodeId(message.rollout_id, message.attempt)
    except InvalidIdError as error:
        raise bad_argument(error, at=field) from None


def episodes_from_proto(
    messages: Iterable[types_pb2.EpisodeId], field: str, limit: int
) -> list[EpisodeId]:
    items = list(messages)
    check_list_length(field, items, limit)
    try:
        return episodes_of(items)
    except InvalidIdError as error:
        raise bad_argument(error, at=field) from None


def episode_to_proto(episode: EpisodeId) -> types_pb2.EpisodeId:
    return types_pb2.EpisodeId(rollout_id=episode.rollout_id, attempt=episode.attempt)


def add_episodes(
    field: RepeatedCompositeFieldContainer[types_pb2.EpisodeId], episodes: Iterable[EpisodeId]
) -> None:
    """Append ``episodes`` to a repeated EpisodeId field, each made in place: a commit
    names every exported episode, and building each message to copy it in costs half as
    much again."""
    add = field.add
    for episode in episodes:
        add(rollout_id=episode.rollout_id, attempt=episode.attempt)


def check_list_length(field: str, items: Sequence[object], limit: int) -> None:
    if len(items) > limit:
        raise bad_argument(f"{field} has {len(items)} entries; at most {limit} are accepted")


def seconds_from_duration(
    message: duration_pb2.Duration, field: str, *, default: float | None = None
) -> float | None:
    """Seconds in a Duration; ``default`` when it is unset (zero)."""
    seconds = message.seconds + message.nanos / 1e9
    if seconds < 0:
        raise bad_argument(f"{field} must not be negative")
    if seconds == 0:
        return default
    return seconds


def duration_from_seconds(seconds: float) -> duration_pb2.Duration:
    message = duration_pb2.Duration()
    message.FromNanoseconds(round(max(seconds, 0.0) * 1e9))
    return message


def timestamp_from_seconds(epoch_seconds: float) -> timestamp_pb2.Timestamp:
    message = timestamp_pb2.Timestamp()
    message.FromNanoseconds(round(epoch_seconds * 1e9))
    return message


# ----------------------------------------------------------------------- vocabulary


def _prefix(proto_enum: Any) -> str:
    # Every turnpoint.v1 enum's values are prefixed by the enum's name in UPPER_SNAKE.
    name: str = proto_enum.DESCRIPTOR.name
    snake = "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name))
    return snake.upper() + "_"


# (proto enum name, SDK member) -> wire number: every control answer converts a phase,
# and spelling the prefix out each time was a visible part of a participant's answer.
_TO_PROTO: dict[tuple[str, enum.Enum], int] = {}


def enum_to_proto(proto_enum: Any, value: enum.Enum) -> Any:
    key = (proto_enum.DESCRIPTOR.full_name, value)
    number = _TO_PROTO.get(key)
    if number is None:
        number = _TO_PROTO[key] = proto_enum.Value(_prefix(proto_enum) + value.name)
    return number


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


def weights_change_to_proto(value: str | None) -> types_pb2.WeightsChange.ValueType:
    """A configuration's ``weights_change`` (``keep``, ``rerun``; None: unset) as sent."""
    if value is None:
        return types_pb2.WEIGHTS_CHANGE_UNSPECIFIED
    try:
        return types_pb2.WeightsChange.Value(_prefix(types_pb2.WeightsChange) + value.upper())
    except ValueError:
        raise ValueError(f"weights_change must be 'keep' or 'rerun', got {value!r}") from None


def fence_to_proto(fence: Fence) -> types_pb2.Fence:
    return types_pb2.Fence(coordinator_id=fence.coordinator_id, epoch=fence.epoch)


def fence_from_proto(message: types_pb2.Fence, present: bool) -> Fence:
    if not present:
        # Tools (buf curl) may omit the fence: they act as epoch 0, which any real
        # coordinator's epoch fences out.
        return Fence("", 0)
    # A coordinator id follows the id rules (at most 128 characters): a participant
    # remembers it and quotes it in FENCED errors, so it must be bounded.
    return Fence(id_from_proto(message.coordinator_id, "fence.coordinator_id"), message.epoch)


def receipt_to_proto(receipt: CompletionReceipt) -> types_pb2.CompletionReceipt:
    return types_pb2.CompletionReceipt(
        episode=episode_to_proto(receipt.episode), receipt_id=receipt.receipt_id
    )


def receipt_from_proto(message: types_pb2.CompletionReceipt) -> CompletionReceipt:
    return CompletionReceipt(
        episode_from_proto(message.episode, "receipt.episode"),
        id_from_proto(message.receipt_id, "receipt_id"),
    )


def blocker_to_proto(blocker: Blocker) -> types_pb2.Blocker:
    message = types_pb2.Blocker(
        episode=episode_to_proto(blocker.episode),
        state=enum_to_proto(types_pb2.EpisodeState, blocker.state),
        detail=blocker.detail,
    )
    if blocker.receipt is not None:
        message.receipt.CopyFrom(receipt_to_proto(blocker.receipt))
    return message


def blocker_from_proto(message: types_pb2.Blocker) -> Blocker:
    state = _episode_state(message.state, "blocker.state")
    receipt = receipt_from_proto(message.receipt) if message.HasField("receipt") else None
    return Blocker(
        episode_from_proto(message.episode, "blocker.episode"), state, receipt, message.detail
    )


def readiness_to_proto(report: ReadinessReport) -> types_pb2.ReadinessReport:
    return types_pb2.ReadinessReport(
        ready=report.ready,
        blocker_count=report.blocker_count,
        blockers=[blocker_to_proto(b) for b in report.blockers],
        counts=[
            types_pb2.StateCount(state=enum_to_proto(types_pb2.EpisodeState, state), count=count)
            for state, count in sorted(report.counts.items(), key=lambda item: item[0].name)
        ],
        restarts=[episode_to_proto(e) for e in report.restarts],
    )


def readiness_from_proto(message: types_pb2.ReadinessReport) -> ReadinessReport:
    counts: dict[EpisodeState, int] = {}
    for item in message.counts:
        counts[_episode_state(item.state, "readiness.counts.state")] = item.count
    return ReadinessReport(
        ready=message.ready,
        blocker_count=message.blocker_count,
        blockers=tuple(blocker_from_proto(b) for b in message.blockers),
        counts=MappingProxyType(counts),
        restarts=tuple(episode_from_proto(e, "readiness.restarts") for e in message.restarts),
    )


def _episode_state(number: int, field: str) -> EpisodeState:
    state = enum_from_proto(types_pb2.EpisodeState, EpisodeState, number, field)
    if state is None:
        raise bad_argument(f"{field} is unset")
    return state


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


# ----------------------------------------------------------------------- structs


def struct_from_mapping(value: Mapping[str, Any] | None) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    if value:
        message.update(dict(value))
    return message


def struct_to_dict(message: struct_pb2.Struct, field: str = "struct") -> dict[str, Any]:
    """A Struct as plain JSON values, with integral numbers as ints.

    ``google.protobuf.Struct`` stores every number as a double, so a task's ``3`` comes
    back as ``3.0``. JSON does not tell the two apart either; giving integral values back
    as ints lets hooks keep strict integer checks (token ids, turn counts, seeds). Ints
    beyond 2**53 do not survive a double and must travel as strings.
    """
    try:
        converted = MessageToDict(message, preserving_proto_field_name=True)
    except (ValueError, RecursionError):
        # NaN and Infinity have no JSON form (json_format refuses them): bad input, said
        # as such instead of surfacing as a server failure (docs/spec.md section 3.7).
        raise bad_argument(
            f"{field} holds a number JSON cannot carry (NaN or Infinity)", field=field
        ) from None
    result: dict[str, Any] = _integral(converted)
    return result


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value
