"""Hostile and malformed input, over the wire, against the real example participants.

Hypothesis sends bytes to every method of every service of every kind (control, rollout,
policy, resources), with and without the token: random bytes, valid requests cut short
or with bytes flipped, messages nested past protobuf's recursion limit, and enum fields
holding values no enum has. Whatever arrives, the answer is a typed status, never
UNKNOWN or INTERNAL; every refusal carries one ErrorInfo; and every server is still
SERVING afterwards (docs/spec.md sections 9.1 and 10.5).

The servers run on one event loop in a background thread for the whole module, so that
hypothesis (which drives plain functions) can send hundreds of calls without starting a
fleet per example.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.participants import METADATA, start_topology
from turnpoint._status import error_from_rpc
from turnpoint.v1 import (
    checkpoint_control_service_pb2,
    policy_service_pb2,
    resources_service_pb2,
    rollout_service_pb2,
)

SERVICES = [
    module.DESCRIPTOR.services_by_name[name]
    for module, name in (
        (checkpoint_control_service_pb2, "CheckpointControlService"),
        (rollout_service_pb2, "RolloutService"),
        (policy_service_pb2, "PolicyService"),
        (resources_service_pb2, "ResourcesService"),
    )
]
METHODS: list[MethodDescriptor] = [m for service in SERVICES for m in service.methods]
CALL_TIMEOUT_S = 5.0
# A stream that parses as a valid watch never ends by itself; a short deadline ends it.
STREAM_TIMEOUT_S = 1.0
# Codes grpc itself may answer for a call that never reached our handler (no ErrorInfo
# possible) or that the client cut: never UNKNOWN or INTERNAL.
TRANSPORT_CODES = {
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.CANCELLED,
}


@dataclass
class Fleet:
    loop: asyncio.AbstractEventLoop
    addresses: dict[str, str]
    channels: dict[str, grpc.aio.Channel]

    def run(self, coroutine: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout=60)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("hostile")
    loop = asyncio.new_event_loop()
    ready: Future[dict[str, str]] = Future()
    stop = asyncio.Event()

    channels: dict[str, grpc.aio.Channel] = {}

    async def serve() -> None:
        async with start_topology(Path(root), agents=1, group_size=2) as topology:
            for name, hosted in topology.participants.items():
                channels[name] = grpc.aio.insecure_channel(hosted.address)
            ready.set_result({name: h.address for name, h in topology.participants.items()})
            await stop.wait()
            for channel in channels.values():
                await channel.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield Fleet(loop, ready.result(timeout=60), channels)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)


def _valid_request(method: MethodDescriptor) -> bytes:
    """A plausible request of the method's type, to mutate: ids and a fence filled in."""
    message = message_factory.GetMessageClass(method.input_type)()
    for field in message.DESCRIPTOR.fields:
        if field.name == "request_id":
            setattr(message, field.name, "rq-hostile")
        elif field.name in ("checkpoint_id", "restore_id"):
            setattr(message, field.name, "ck-000000000001")
        elif field.name == "fence":
            message.fence.coordinator_id = "coord"
            message.fence.epoch = 1
    return bytes(message.SerializeToString())


def _deep_struct(depth: int) -> bytes:
    """A ``ListValue`` nested ``depth`` times, encoded by hand (protobuf refuses to
    serialize past its own depth limit, which is the point)."""
    value = b"\x1a\x04leaf"  # Value{string_value: "leaf"}
    for _ in range(depth):
        listed = b"\x0a" + _varint(len(value)) + value  # ListValue{values: [value]}
        value = b"\x32" + _varint(len(listed)) + listed  # Value{list_value: listed}
    return value


def _hostile(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    valid = _valid_request(method)

    def flip(data: tuple[int, int]) -> bytes:
        position, byte = data
        if not valid:
            return bytes([byte])
        buffer = bytearray(valid)
        buffer[position % len(buffer)] = byte
        return bytes(buffer)

    return st.one_of(
        st.binary(max_size=96),
        st.integers(0, max(len(valid) - 1, 0)).map(lambda cut: valid[:cut]),
        st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)).map(flip),
        # Field 1 as a length-delimited blob holding a Struct nested past the limit.
        st.integers(120, 400).map(
            lambda depth: b"\x0a" + _varint(len(b := _deep_struct(depth))) + b
        ),
        # Every varint field number 1..15 set to an enum/int value no enum has.
        st.integers(1, 15).map(lambda number: bytes([number << 3]) + _varint(1_000_000)),
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


async def _call(
    channel: grpc.aio.Channel, path: str, method: MethodDescriptor, raw: bytes, token: bool
) -> Any:
    metadata = METADATA if token else ()
    if method.client_streaming:
        call = channel.stream_stream(path)(metadata=metadata, timeout=CALL_TIMEOUT_S)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # A server that refuses at once (no token) may end the call before the
            # write lands; the status is read below either way.
            await call.write(raw)
            await call.done_writing()
        return [item async for item in call]
    if method.server_streaming:
        stream = channel.unary_stream(path)(raw, metadata=metadata, timeout=STREAM_TIMEOUT_S)
        return [item async for item in stream]
    return await channel.unary_unary(path)(raw, metadata=metadata, timeout=CALL_TIMEOUT_S)


def _check_answer(fleet: Fleet, method: MethodDescriptor, raw: bytes, token: bool) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    for name, channel in fleet.channels.items():
        try:
            fleet.run(_call(channel, path, method, raw, token))
        except grpc.aio.AioRpcError as error:
            code = error.code()
            where = f"{name} {path} token={token} raw={raw[:40]!r}"
            assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (
                f"{where}: {code.name} {error.details()}"
            )
            if code not in TRANSPORT_CODES:
                assert error_from_rpc(error) is not None, f"{where}: {code.name} without ErrorInfo"


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.containing_service.name}.{m.name}")
@pytest.mark.parametrize("token", [True, False], ids=["token", "no-token"])
def test_hostile_bytes_get_a_typed_answer_never_unknown_or_internal(
    fleet: Fleet, method: MethodDescriptor, token: bool
) -> None:
    @settings(
        max_examples=8,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(raw=_hostile(method))
    def check(raw: bytes) -> None:
        _check_answer(fleet, method, raw, token)

    check()


def test_a_malformed_request_is_invalid_argument_with_the_method_named(fleet: Fleet) -> None:
    async def call() -> grpc.aio.AioRpcError:
        address = fleet.addresses["tools"]
        path = "/turnpoint.v1.CheckpointControlService/Prepare"
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                await channel.unary_unary(path)(b"\xff\xff\xff", metadata=METADATA, timeout=5)
            except grpc.aio.AioRpcError as error:
                return error
        raise AssertionError("a malformed Prepare was answered OK")

    error = fleet.run(call())
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    carried = error_from_rpc(error)
    assert carried is not None
    assert carried.metadata["method"] == "/turnpoint.v1.CheckpointControlService/Prepare"
    assert carried.metadata["message_type"] == "turnpoint.v1.PrepareRequest"


def test_every_server_is_still_serving_after_the_hostile_input(fleet: Fleet) -> None:
    async def status(address: str) -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            return int(reply.status)

    for name, address in fleet.addresses.items():
        assert fleet.run(status(address)) == health_pb2.HealthCheckResponse.SERVING, name


def _nan_struct() -> Any:
    from google.protobuf import struct_pb2

    value = struct_pb2.Struct()
    value["x"] = float("nan")
    return value


def _bad_requests() -> list[tuple[str, str, Any, grpc.StatusCode]]:
    from google.protobuf import struct_pb2

    from turnpoint.v1 import types_pb2

    episode = types_pb2.EpisodeId(rollout_id="r-hostile", attempt=0)
    task = struct_pb2.Struct()
    task.update({"task": {"bad": True}})
    bad = grpc.StatusCode.INVALID_ARGUMENT
    generate = "/turnpoint.v1.PolicyService/Generate"
    return [
        (
            "policy",
            generate,
            policy_service_pb2.GenerateRequest(
                episode=episode, prompt_token_ids=[1], max_new_tokens=20_000
            ),
            bad,
        ),
        (
            "policy",
            generate,
            policy_service_pb2.GenerateRequest(
                episode=episode, prompt_token_ids=[1], max_new_tokens=4, temperature=float("nan")
            ),
            bad,
        ),
        (
            "policy",
            generate,
            policy_service_pb2.GenerateRequest(
                episode=episode, prompt_token_ids=[1], max_new_tokens=4, temperature=-1.0
            ),
            bad,
        ),
        (
            "policy",
            generate,
            policy_service_pb2.GenerateRequest(
                episode=episode, prompt_token_ids=[10_000_000], max_new_tokens=4
            ),
            bad,
        ),
        # What no model can take, and what this one says it cannot: refused by the SDK
        # before the model's hook runs (a hook's own ValueError would be INTERNAL).
        (
            "policy",
            generate,
            policy_service_pb2.GenerateRequest(episode=episode, max_new_tokens=4),
            bad,
        ),
        (
            "policy",
            generate,
            policy_service_pb2.GenerateRequest(
                episode=episode, prompt_token_ids=[1] * 16_384, max_new_tokens=4
            ),
            bad,
        ),
        (
            "policy",
            generate,
            policy_service_pb2.GenerateRequest(
                episode=episode, prompt_token_ids=[1, 2, 64], max_new_tokens=4
            ),
            bad,
        ),
        (
            "policy",
            "/turnpoint.v1.PolicyService/UpdateWeights",
            policy_service_pb2.UpdateWeightsRequest(weights_version=9, state=b"garbage"),
            bad,
        ),
        (
            "tools",
            "/turnpoint.v1.ResourcesService/SeedSession",
            resources_service_pb2.SeedSessionRequest(episode=episode),
            bad,
        ),
        (
            "tools",
            "/turnpoint.v1.ResourcesService/SeedSession",
            resources_service_pb2.SeedSessionRequest(episode=episode, task=task),
            bad,
        ),
        (
            "tools",
            "/turnpoint.v1.ResourcesService/SeedSession",
            resources_service_pb2.SeedSessionRequest(episode=episode, task=_nan_struct()),
            bad,
        ),
        (
            "tools",
            "/turnpoint.v1.ResourcesService/Call",
            resources_service_pb2.CallRequest(episode=episode, tool="check"),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            "tools",
            "/turnpoint.v1.ResourcesService/Verify",
            resources_service_pb2.VerifyRequest(episode=episode, answer=_nan_struct()),
            bad,
        ),
        (
            "tools",
            "/turnpoint.v1.CheckpointControlService/Prepare",
            checkpoint_control_service_pb2.PrepareRequest(
                request_id="rq-long",
                checkpoint_id="ck-000000000009",
                fence=types_pb2.Fence(coordinator_id="c" * 20_000, epoch=7),
            ),
            bad,
        ),
    ]


@pytest.mark.parametrize(
    ("participant", "path", "request_message", "code"),
    _bad_requests(),
    ids=lambda value: value if isinstance(value, str) and not value.startswith("/") else "",
)
def test_bad_values_in_well_formed_requests_are_typed_and_quote_nothing_unbounded(
    fleet: Fleet, participant: str, path: str, request_message: Any, code: grpc.StatusCode
) -> None:
    method = next(
        m for m in METHODS if path.endswith(f"/{m.name}") and m.containing_service.full_name in path
    )

    async def call() -> grpc.aio.AioRpcError:
        try:
            await _call(
                fleet.channels[participant], path, method, request_message.SerializeToString(), True
            )
        except grpc.aio.AioRpcError as error:
            return error
        raise AssertionError(f"{path} accepted {request_message}")

    error = fleet.run(call())
    assert error.code() is code, error.details()
    carried = error_from_rpc(error)
    assert carried is not None
    assert len(error.details() or "") < 300  # no unbounded input echoed back
