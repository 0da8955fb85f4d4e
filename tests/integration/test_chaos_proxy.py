"""The chaos proxy loses and delays real replies, and the protocol survives what it does.

A real participant on 127.0.0.1 behind :class:`FaultProxy`: with replies dropped, a
Prepare reaches the participant and acts, the caller sees the connection break, and the
retry with the same request id gets the recorded answer (docs/spec.md section 6.8).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.support.participants import METADATA
from tests.support.scripted import FENCE, ScriptedAgent, ckpt, host_scripted
from turnpoint.apps.chaos._proxy import FaultProxy, ProxyMode
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1.types_pb2 import PHASE_PREPARED


@pytest.fixture
async def proxied(tmp_path: Path) -> AsyncIterator[tuple[FaultProxy, ScriptedAgent]]:
    agent = ScriptedAgent()
    async with host_scripted(tmp_path, agent=agent) as hosted, FaultProxy(hosted.address) as proxy:
        yield proxy, agent


def _prepare(request_id: str) -> pb.PrepareRequest:
    return pb.PrepareRequest(fence=FENCE, request_id=request_id, checkpoint_id=ckpt(1))


# Each call on its own connection: channels to one target otherwise share a subchannel,
# which stays in reconnect backoff after the proxy cut it.
_OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


async def _call(address: str, request: pb.PrepareRequest) -> pb.PrepareResponse:
    async with grpc.aio.insecure_channel(address, options=_OWN_CONNECTION) as channel:
        stub = pb_grpc.CheckpointControlServiceStub(channel)
        return await stub.Prepare(request, metadata=METADATA, timeout=5)


async def test_a_dropped_reply_breaks_the_call_and_the_retry_replays_it(
    proxied: tuple[FaultProxy, ScriptedAgent],
) -> None:
    proxy, _ = proxied
    async with grpc.aio.insecure_channel(proxy.address, options=_OWN_CONNECTION) as channel:
        stub = pb_grpc.CheckpointControlServiceStub(channel)
        await stub.GetStatus(pb.GetStatusRequest(), metadata=METADATA, timeout=5)  # up
        proxy.set_mode(ProxyMode.DROP_REPLIES)
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await stub.Prepare(_prepare("p-1"), metadata=METADATA, timeout=5)
    assert lost.value.code() is grpc.StatusCode.UNAVAILABLE
    assert proxy.stats.cut >= 1

    proxy.set_mode(ProxyMode.PASS)
    # The retry with the same request id: replayed if the participant had acted, acted
    # on now if the cut came first; either way one prepare, one answer.
    answer = await _call(proxy.address, _prepare("p-1"))
    assert answer.readiness.ready and answer.phase == PHASE_PREPARED
    again = await _call(proxy.address, _prepare("p-1"))
    assert (again.phase, again.checkpoint_id, again.readiness) == (
        answer.phase,
        answer.checkpoint_id,
        answer.readiness,
    )


async def test_replies_dropped_now_lose_the_reply_to_a_request_already_sent(
    proxied: tuple[FaultProxy, ScriptedAgent],
) -> None:
    """A fault switched on while the participant handles a request (held in its admission
    hook) loses that request's reply, though no byte of it goes up after the switch: the
    prepare acted, the caller sees the connection break, its retry replays."""
    proxy, agent = proxied
    agent.close_gate = asyncio.Event()
    async with grpc.aio.insecure_channel(proxy.address, options=_OWN_CONNECTION) as channel:
        stub = pb_grpc.CheckpointControlServiceStub(channel)
        await stub.GetStatus(pb.GetStatusRequest(), metadata=METADATA, timeout=5)  # up
        preparing = asyncio.ensure_future(
            stub.Prepare(_prepare("p-3"), metadata=METADATA, timeout=5)
        )
        await asyncio.wait_for(agent.close_gate_reached.wait(), 5)
        proxy.drop_replies_now()
        agent.close_gate.set()
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await preparing
    assert lost.value.code() is grpc.StatusCode.UNAVAILABLE
    assert proxy.stats.cut == 1

    proxy.set_mode(ProxyMode.PASS)
    answer = await _call(proxy.address, _prepare("p-3"))
    assert answer.readiness.ready and answer.phase == PHASE_PREPARED


async def test_a_delay_slows_replies_and_loses_none(
    proxied: tuple[FaultProxy, ScriptedAgent],
) -> None:
    proxy, _ = proxied
    await _call(proxy.address, _prepare("warm"))  # connection set up, answers recorded
    proxy.set_mode(ProxyMode.DELAY, delay_s=0.3)
    started = time.monotonic()
    answer = await _call(proxy.address, _prepare("warm"))
    assert answer.readiness.ready
    assert proxy.stats.delayed_chunks >= 1
    assert time.monotonic() - started >= 0.3


async def test_a_blackhole_refuses_new_connections_until_it_lifts(
    proxied: tuple[FaultProxy, ScriptedAgent],
) -> None:
    proxy, _ = proxied
    proxy.set_mode(ProxyMode.BLACKHOLE)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _call(proxy.address, _prepare("p-2"))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    proxy.set_mode(ProxyMode.PASS)
    assert (await asyncio.wait_for(_call(proxy.address, _prepare("p-2")), 10)).readiness.ready
