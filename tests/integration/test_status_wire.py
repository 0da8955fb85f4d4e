"""A protocol error survives a round trip through a real grpc.aio server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from turnpoint._status import error_from_rpc, error_to_grpc_status
from turnpoint.errors import Reason, TurnpointError
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc


class _Refusing(pb_grpc.CheckpointControlServiceServicer):
    def __init__(self, error: TurnpointError) -> None:
        self.error = error

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        await context.abort_with_status(error_to_grpc_status(self.error))
        raise AssertionError("abort returns only by raising")


@pytest.fixture
async def channel_for() -> AsyncIterator[object]:
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []

    async def start(error: TurnpointError) -> grpc.aio.Channel:
        server = grpc.aio.server()
        pb_grpc.add_CheckpointControlServiceServicer_to_server(_Refusing(error), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return channel

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)


@pytest.mark.parametrize("reason", list(Reason))
async def test_status_with_error_info_round_trips(channel_for: object, reason: Reason) -> None:
    sent = TurnpointError(reason, f"refused: {reason.name}", {"checkpoint_id": "ck-1", "n": "7"})
    channel = await channel_for(sent)  # type: ignore[operator]
    stub = pb_grpc.CheckpointControlServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetStatus(pb.GetStatusRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode[sent.code_name]
    received = error_from_rpc(info.value)
    assert received is not None
    assert received.reason is reason
    assert received.message == sent.message
    assert received.metadata == sent.metadata


async def test_a_failure_without_error_info_is_not_a_protocol_error() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        stub = pb_grpc.CheckpointControlServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetStatus(pb.GetStatusRequest(), timeout=2)
        assert error_from_rpc(info.value) is None
    finally:
        await channel.close()
