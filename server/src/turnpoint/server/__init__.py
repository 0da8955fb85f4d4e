"""Hosting participants as real gRPC servers: health, reflection, auth, graceful drain.

Serving one participant: :func:`host_participant` wires a
:class:`~turnpoint.participant_sdk.ParticipantRuntime` (the control service and its
kind's data plane) to a server built from :class:`ServerOptions` (port, bearer token,
optional mutual TLS, limits, metrics) and returns the :class:`HostedParticipant`;
``async with`` it starts and drains both.

Several worker processes behind one endpoint (docs/spec.md section 3.9): the parent runs
a :class:`WorkerGroup`; each worker reads its :class:`WorkerSlot` with
:func:`worker_slot_from_env`, calls :func:`die_with_parent`, serves with
:func:`host_worker` and tells the parent with :func:`announce_ready`.

An agent that calls a policy over the wire reads each streamed reply with
:func:`generate_chunk_from_proto`; its tool calls go to a :class:`ResourcesClient`
through ``ctx.call`` / ``ctx.verify`` (keyed: each runs once, docs/spec.md section 6.12).

Elsewhere: assembling your own hosting (the server without the runtime wiring, the
servicers, the auth interceptor, metrics) is :mod:`turnpoint.server.advanced`; the
client half of the auth (tokens, call metadata) is :mod:`turnpoint.auth`; hosting on Ray
is :mod:`turnpoint.server.ray`; an OpenAI-compatible HTTP endpoint in front of a policy
participant is :mod:`turnpoint.server.openai_api`. The example Gym servers live with the applications, in
``turnpoint.apps.examples``.
"""

from turnpoint.server._convert import generate_chunk_from_proto
from turnpoint.server._grpc_server import ServerOptions
from turnpoint.server._hosted_participant import HostedParticipant, host_participant
from turnpoint.server._resources_client import ResourcesClient
from turnpoint.server._worker_group import (
    WorkerGroup,
    announce_ready,
    die_with_parent,
    host_worker,
    worker_slot_from_env,
)
from turnpoint.server._worker_slot import WorkerSlot

__all__ = [
    "HostedParticipant",
    "ResourcesClient",
    "ServerOptions",
    "WorkerGroup",
    "WorkerSlot",
    "announce_ready",
    "die_with_parent",
    "generate_chunk_from_proto",
    "host_participant",
    "host_worker",
    "worker_slot_from_env",
]
