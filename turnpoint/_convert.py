"""Conversions at the wire edge, shared by the servers and the coordinator.

Everything that comes off the wire passes through here before the pure cores see it,
so that a bad id or a negative duration becomes ``INVALID_ARGUMENT`` and changes no
state (PROTOCOL.md section 10: bad input gets a clear error and changes nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2
from google.protobuf.json_format import MessageToDict

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, InvalidIdError, validate_id
from turnpoint.v1 import types_pb2

__all__ = [
    "bad_argument",
    "check_list_length",
    "duration_from_seconds",
    "episode_from_proto",
    "episode_to_proto",
    "episodes_from_proto",
    "id_from_proto",
    "seconds_from_duration",
    "struct_from_mapping",
    "struct_to_dict",
    "timestamp_from_seconds",
]


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
    return [episode_from_proto(m, field) for m in items]


def episode_to_proto(episode: EpisodeId) -> types_pb2.EpisodeId:
    return types_pb2.EpisodeId(rollout_id=episode.rollout_id, attempt=episode.attempt)


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


def struct_from_mapping(value: Mapping[str, Any] | None) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    if value:
        message.update(dict(value))
    return message


def struct_to_dict(message: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct as plain JSON values, with integral numbers as ints.

    ``google.protobuf.Struct`` stores every number as a double, so a task's ``3`` comes
    back as ``3.0``. JSON does not tell the two apart either; giving integral values back
    as ints lets hooks keep strict integer checks (token ids, turn counts, seeds). Ints
    beyond 2**53 do not survive a double and must travel as strings.
    """
    result: dict[str, Any] = _integral(MessageToDict(message, preserving_proto_field_name=True))
    return result


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value
