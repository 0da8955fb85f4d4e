"""Host a participant runtime as a gRPC server: its control service and its kind's data plane."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from turnpoint.participant_sdk import (
    ParticipantRuntime,
)
from turnpoint.server._control import ControlServicer
from turnpoint.server._data import PolicyServicer, ResourcesServicer, RolloutServicer
from turnpoint.server._grpc_server import (
    CONTROL_SERVICE,
    DEFAULT_MAX_LIST_LENGTH,
    ParticipantServer,
    RegisterServicers,
    ServerOptions,
)
from turnpoint.server._typed import add_servicer
from turnpoint.server._worker_slot import GroupRoster
from turnpoint.v1 import (
    checkpoint_control_service_pb2,
    policy_service_pb2,
    resources_service_pb2,
    rollout_service_pb2,
)

logger = logging.getLogger(__name__)

ROLLOUT_SERVICE = "turnpoint.v1.RolloutService"
POLICY_SERVICE = "turnpoint.v1.PolicyService"
RESOURCES_SERVICE = "turnpoint.v1.ResourcesService"


def _service(module: Any, name: str) -> ServiceDescriptor:
    service: ServiceDescriptor = module.DESCRIPTOR.services_by_name[name]
    return service


def register_runtime(
    runtime: ParticipantRuntime,
    *,
    max_list_length: int = DEFAULT_MAX_LIST_LENGTH,
    roster: GroupRoster | None = None,
) -> RegisterServicers:
    """The servicers of ``runtime``: the control service and its kind's data plane.

    ``roster`` (a worker of a group) is listed in every ``Describe`` answer."""

    def register(server: grpc.aio.Server) -> Sequence[str]:
        # Each servicer parses its own request bytes (turnpoint.server._typed), so a malformed
        # message is INVALID_ARGUMENT with an ErrorInfo instead of grpc's UNKNOWN.
        services = [CONTROL_SERVICE]
        add_servicer(
            server,
            _service(checkpoint_control_service_pb2, "CheckpointControlService"),
            ControlServicer(runtime, max_list_length=max_list_length, roster=roster),
        )
        if runtime.agent is not None:
            add_servicer(
                server,
                _service(rollout_service_pb2, "RolloutService"),
                RolloutServicer(runtime, max_list_length=max_list_length),
            )
            services.append(ROLLOUT_SERVICE)
        if runtime.resources is not None:
            add_servicer(
                server,
                _service(resources_service_pb2, "ResourcesService"),
                ResourcesServicer(runtime),
            )
            services.append(RESOURCES_SERVICE)
        if runtime.model is not None:
            add_servicer(
                server, _service(policy_service_pb2, "PolicyService"), PolicyServicer(runtime)
            )
            services.append(POLICY_SERVICE)
        return services

    return register


@dataclass
class HostedParticipant:
    """A runtime served on a port; ``async with`` starts and drains both."""

    runtime: ParticipantRuntime
    server: ParticipantServer
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> HostedParticipant:
        await self.runtime.start()
        await self.server.start()
        return self

    async def stop(self, grace: float | None = None) -> None:
        await self.server.drain_and_stop(grace)
        await self.runtime.aclose()
        for close in self.on_close:
            await close()

    async def __aenter__(self) -> HostedParticipant:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(0)


def host_participant(runtime: ParticipantRuntime, options: ServerOptions) -> HostedParticipant:
    """Wire ``runtime`` to a :class:`ParticipantServer` (not started yet)."""
    server = ParticipantServer(
        options, register_runtime(runtime, max_list_length=options.max_list_length)
    )
    return HostedParticipant(runtime, server)
