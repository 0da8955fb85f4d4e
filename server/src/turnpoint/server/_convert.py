"""SDK dataclasses <-> turnpoint.v1 messages, for the servicers.

The protocol vocabulary (enums, fence, readiness, receipts, artifacts) converts in the
core, :mod:`turnpoint._convert`, which the trainer shares; it is re-exported here for
the servicers. What stays is what only a participant server sends: the response header
built from the runtime's :class:`~turnpoint.participant_sdk.Header`.
"""

from __future__ import annotations

from turnpoint._convert import (
    artifact_from_proto,
    artifact_to_proto,
    artifacts_from_proto,
    enum_from_proto,
    enum_to_proto,
    fence_from_proto,
    readiness_to_proto,
    receipt_from_proto,
    receipt_to_proto,
)
from turnpoint.participant_sdk import GenerateChunk, Header
from turnpoint.v1 import policy_service_pb2, types_pb2

__all__ = [
    "artifact_from_proto",
    "artifact_to_proto",
    "artifacts_from_proto",
    "enum_from_proto",
    "enum_to_proto",
    "fence_from_proto",
    "generate_chunk_from_proto",
    "header_to_proto",
    "readiness_to_proto",
    "receipt_from_proto",
    "receipt_to_proto",
]


def header_to_proto(header: Header) -> types_pb2.ResponseHeader:
    return types_pb2.ResponseHeader(
        participant_id=header.participant_id,
        incarnation=header.incarnation,
        epoch=header.epoch,
    )


def generate_chunk_from_proto(response: policy_service_pb2.GenerateResponse) -> GenerateChunk:
    """A streamed ``GenerateResponse`` as the SDK's chunk, for an agent calling a policy
    over the wire (its ``cut`` marker included, docs/spec.md section 5.5)."""
    return GenerateChunk(
        tuple(response.token_ids),
        tuple(response.logprobs),
        response.done,
        response.weights_version,
        cut=response.HasField("cut"),
        prefix_length=response.cut.prefix_length,
    )
