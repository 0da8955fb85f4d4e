"""An agent's gRPC client of one resources server (``ctx.call`` / ``ctx.verify``).

The wire half of :class:`~turnpoint.participant_sdk.ResourcesConnection`: the bearer
token on every call, the episode (rollout id and attempt, docs/spec.md section 6.9) in
every request, Structs converted both ways as the hooks see them (integral numbers
come back as ints, section 3.7), a deadline on every call, and a failure turned into
the typed error it carries (a call without one, below the protocol, by its code).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc

from turnpoint._keepalive import data_channel
from turnpoint._status import error_from_rpc
from turnpoint.auth import auth_metadata
from turnpoint.convert import episode_to_proto, struct_from_mapping, struct_to_dict
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import EffectConflictError, Verdict
from turnpoint.v1 import resources_service_pb2, resources_service_pb2_grpc

if TYPE_CHECKING:
    from turnpoint.v1.resources_service_pb2_grpc import ResourcesServiceAsyncStub

# A call's deadline: long enough for a verify that waits on its prompt group's siblings.
DEFAULT_CALL_TIMEOUT_S = 300.0
_BELOW_THE_PROTOCOL = {
    grpc.StatusCode.UNAVAILABLE: Reason.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND: Reason.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_ARGUMENT,
}


class ResourcesClient:
    """A connection to one resources server over gRPC; ``await aclose()`` when done.

    ``token`` is the bearer token (docs/spec.md section 10.1): the data-plane one where
    the servers have credential roles (section 10.2), so that the agent holding it can
    call tools and nothing else. ``credentials`` the channel's TLS, if any. Hand it to ``ctx.seed``, ``ctx.call`` and ``ctx.verify``.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._channel = data_channel(address, credentials=credentials)
        self._stub: ResourcesServiceAsyncStub = resources_service_pb2_grpc.ResourcesServiceStub(
            self._channel
        )
        self._metadata = auth_metadata(token) if token else ()
        self._timeout_s = timeout_s

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> bool:
        request = resources_service_pb2.SeedSessionRequest(
            request_id=f"seed-{episode.rollout_id}-{episode.attempt}",
            episode=episode_to_proto(episode),
            prompt_group_id=str(task.get("prompt_group_id", "")),
            sibling_index=int(task.get("sibling_index", 0)),
            group_size=int(task.get("group_size", 0)),
            task=struct_from_mapping(task),
        )
        try:
            response = await self._stub.SeedSession(
                request, metadata=self._metadata, timeout=self._timeout_s
            )
        except grpc.RpcError as error:
            raise _typed(error) from None
        return bool(response.existed)

    async def call(
        self,
        episode: EpisodeId,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        request_id: str,
    ) -> Mapping[str, Any]:
        request = resources_service_pb2.CallRequest(
            request_id=request_id,
            episode=episode_to_proto(episode),
            tool=tool,
            arguments=struct_from_mapping(arguments),
        )
        try:
            response = await self._stub.Call(
                request, metadata=self._metadata, timeout=self._timeout_s
            )
        except grpc.RpcError as error:
            raise _typed(error) from None
        return struct_to_dict(response.output, "output")

    async def verify(
        self, episode: EpisodeId, answer: Mapping[str, Any], *, request_id: str
    ) -> Verdict:
        request = resources_service_pb2.VerifyRequest(
            request_id=request_id,
            episode=episode_to_proto(episode),
            answer=struct_from_mapping(answer),
        )
        try:
            response = await self._stub.Verify(
                request, metadata=self._metadata, timeout=self._timeout_s
            )
        except grpc.RpcError as error:
            raise _typed(error) from None
        return Verdict(float(response.reward), struct_to_dict(response.details, "details"))

    async def close_session(self, episode: EpisodeId) -> bool:
        """End the episode's session (never refused; False if there was none)."""
        request = resources_service_pb2.CloseSessionRequest(
            request_id=f"close-{episode.rollout_id}-{episode.attempt}",
            episode=episode_to_proto(episode),
        )
        try:
            response = await self._stub.CloseSession(
                request, metadata=self._metadata, timeout=self._timeout_s
            )
        except grpc.RpcError as error:
            raise _typed(error) from None
        return bool(response.closed)

    async def aclose(self) -> None:
        await self._channel.close(None)


def _typed(error: grpc.RpcError) -> TurnpointError:
    """The typed error a failed call carries; one without, by its gRPC code."""
    typed = error_from_rpc(error)
    if typed is not None:
        divergence = typed.metadata.get("divergence")
        request_id = typed.metadata.get("request_id")
        if typed.reason is Reason.INVALID_ARGUMENT and divergence and request_id:
            return EffectConflictError(request_id, divergence, typed.message)
        return typed
    code = error.code() if isinstance(error, grpc.aio.AioRpcError | grpc.Call) else None
    # Any other code without a reason is not one a retry would mend.
    reason = (
        _BELOW_THE_PROTOCOL.get(code, Reason.PROTOCOL_VIOLATION) if code else Reason.UNAVAILABLE
    )
    return TurnpointError(reason, f"resources call failed: {code}", {"code": str(code)})
