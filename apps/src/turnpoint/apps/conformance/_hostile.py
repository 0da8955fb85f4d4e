"""Hostile request bytes, built by hand from the request descriptors.

Pure: protobuf descriptors in, bytes out. Each :class:`Hostile` input says what a
conforming participant must answer: ``malformed`` bytes no parser may accept
(docs/spec.md section 10.5: INVALID_ARGUMENT), ``huge`` messages past the 16 MiB bound
(section 3.5: refused), and ``typed`` inputs a parser may accept or refuse (deep
nesting, enum values no enum has) but never with UNKNOWN or INTERNAL.

UpdateWeights gets only bytes no parser can read: a lenient parser that took anything
else for an empty request would install empty weights.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor

from turnpoint.v1 import (
    checkpoint_control_service_pb2,
    policy_service_pb2,
    resources_service_pb2,
    rollout_service_pb2,
    types_pb2,
)

# How a method streams: one request and one answer, one request and a stream, or both.
Shape = Literal["unary", "server_stream", "bidi"]
SERVICES = tuple(
    module.DESCRIPTOR.services_by_name[name]
    for module, name in (
        (checkpoint_control_service_pb2, "CheckpointControlService"),
        (rollout_service_pb2, "RolloutService"),
        (policy_service_pb2, "PolicyService"),
        (resources_service_pb2, "ResourcesService"),
    )
)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Past protobuf's usual recursion limit (100) with room to spare.
_DEPTH = 200
_UNKNOWN_FIELD = 9999
# An enum value no enum of turnpoint.v1 (nor google.protobuf.NullValue) has.
_NO_SUCH_ENUM_VALUE = 1_000_000
_STRUCT = "google.protobuf.Struct"
_LENIENT_PARSE_UNSAFE = {"UpdateWeights"}


class Expect(enum.Enum):
    MALFORMED = "malformed"  # INVALID_ARGUMENT with an ErrorInfo
    HUGE = "huge"  # RESOURCE_EXHAUSTED, or INVALID_ARGUMENT with an ErrorInfo
    TYPED = "typed"  # anything but UNKNOWN / INTERNAL; errors carry an ErrorInfo


@dataclass(frozen=True, slots=True)
class Hostile:
    label: str
    payload: bytes
    expect: Expect


def method_path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def method_shape(method: MethodDescriptor) -> Shape:
    if method.client_streaming and method.server_streaming:
        return "bidi"
    return "server_stream" if method.server_streaming else "unary"


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def _delimited(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + varint(len(payload)) + payload


def _string_path(message: Descriptor, depth: int = 0) -> list[int] | None:
    """Field numbers leading from ``message`` to a string field, through messages."""
    for fd in message.fields:
        if fd.type == FieldDescriptor.TYPE_STRING:
            return [fd.number]
    if depth >= 3:
        return None
    for fd in message.fields:
        nested = fd.message_type
        if (
            fd.type == FieldDescriptor.TYPE_MESSAGE
            and nested is not None
            and nested.full_name != _STRUCT
        ):
            rest = _string_path(nested, depth + 1)
            if rest is not None:
                return [fd.number, *rest]
    return None


def _nested(path: list[int], leaf: bytes) -> bytes:
    payload = leaf
    for number in reversed(path):
        payload = _delimited(number, payload)
    return payload


def _struct_field(message: Descriptor) -> int | None:
    for fd in message.fields:
        nested = fd.message_type
        if (
            fd.type == FieldDescriptor.TYPE_MESSAGE
            and nested is not None
            and nested.full_name == _STRUCT
        ):
            return int(fd.number)
    return None


def _struct_with(value: bytes) -> bytes:
    """A Struct holding ``{"k": value}`` (map entries are key 1, value 2)."""
    entry = _delimited(1, b"k") + _delimited(2, value)
    return _delimited(1, entry)


def _deep_value(depth: int) -> bytes:
    value = _delimited(3, b"leaf")  # Value{string_value: "leaf"}
    for _ in range(depth):
        value = _delimited(6, _delimited(1, value))  # Value{list_value: {values: [value]}}
    return value


def _episode(rollout_id: str, attempt: int) -> bytes:
    return types_pb2.EpisodeId(rollout_id=rollout_id, attempt=attempt).SerializeToString()


def unknown_fields() -> bytes:
    """A varint holding an enum value no enum has and a blob, in a field number no
    message uses: a reader must ignore both (docs/spec.md section 11.2 items 3, 4)."""
    return (
        _tag(_UNKNOWN_FIELD, 0)
        + varint(_NO_SUCH_ENUM_VALUE)
        + _delimited(_UNKNOWN_FIELD + 1, b"future")
    )


def hostile_inputs(
    method: MethodDescriptor, retired_rollout: str, *, huge: bool
) -> Iterator[Hostile]:
    """The hostile inputs for one method. ``retired_rollout`` names a rollout whose
    attempt 0 the kit retired, so a request that parses is refused STALE_ATTEMPT (or
    earlier) and admits no work."""
    request = method.input_type
    assert request is not None  # every turnpoint.v1 method has a request message
    yield Hostile("overlong varint", b"\x08" + b"\xff" * 10 + b"\x01", Expect.MALFORMED)
    yield Hostile("truncated field", b"\x0a\x10ab", Expect.MALFORMED)
    yield Hostile("field number 0", b"\x00\x01", Expect.MALFORMED)
    path = _string_path(request)
    if path is not None:
        yield Hostile("invalid UTF-8 in a string", _nested(path, b"\xff\xfe"), Expect.MALFORMED)
    if huge:
        yield Hostile("a message past 16 MiB", b"\xff" * (MAX_MESSAGE_BYTES + 4096), Expect.HUGE)
    if method.name in _LENIENT_PARSE_UNSAFE:
        return
    depth = _tag(_UNKNOWN_FIELD, 3) * _DEPTH + _tag(_UNKNOWN_FIELD, 4) * _DEPTH
    yield Hostile(f"groups nested {_DEPTH} deep", depth, Expect.TYPED)
    struct_number = _struct_field(request)
    episode_field = request.fields_by_name.get("episode")
    if struct_number is not None and episode_field is not None:
        # An episode the kit retired: if the bytes parse, identity refuses the call.
        episode = _delimited(episode_field.number, _episode(retired_rollout, 0))
        deep = _delimited(struct_number, _struct_with(_deep_value(_DEPTH)))
        yield Hostile(f"a Struct nested {_DEPTH} deep", episode + deep, Expect.TYPED)
        no_such_null = _tag(1, 0) + varint(_NO_SUCH_ENUM_VALUE)  # Value{null_value: 1e6}
        odd = _delimited(struct_number, _struct_with(no_such_null))
        yield Hostile("an enum value no enum has", episode + odd + unknown_fields(), Expect.TYPED)
