"""SDK dataclasses <-> turnpoint.v1 messages that only a participant's wire speaks.

The protocol vocabulary (enums, fence, readiness, receipts, artifacts) converts in the
core, :mod:`turnpoint.convert`, which the trainer shares. What is here: the response
header a servicer builds from the runtime's
:class:`~turnpoint.participant_sdk.advanced.Header`, and the chunk an agent reads from a
policy it calls over the wire.
"""

from __future__ import annotations

from turnpoint.participant_sdk import GenerateChunk
from turnpoint.participant_sdk.advanced import Header
from turnpoint.v1 import policy_service_pb2, types_pb2


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
