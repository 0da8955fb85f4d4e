"""A participant process drains on SIGTERM/SIGINT: health NOT_SERVING first, then exit 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnpoint.server.advanced import CONTROL_SERVICE

TIMEOUT = 30.0
TOKEN = "sigterm-test-token"

# The child hosts a control service (every method UNIMPLEMENTED: only hosting is under
# test) with a grace period far longer than TIMEOUT, so a test that finishes proves the
# grace was cut short by what the test did, not waited out.
_CHILD = """
import asyncio, sys
from turnpoint.auth import load_token
from turnpoint.server import ServerOptions
from turnpoint.server.advanced import CONTROL_SERVICE, ParticipantServer
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc

def register(server):
    servicer = pb_grpc.CheckpointControlServiceServicer()
    pb_grpc.add_CheckpointControlServiceServicer_to_server(servicer, server)
    return [CONTROL_SERVICE]

async def main():
    server = ParticipantServer(ServerOptions(token=load_token(), grace_seconds=600), register)
    port = await server.start()
    server.install_signal_handlers()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()
    print("STOPPED", flush=True)
    return 0

sys.exit(asyncio.run(main()))
"""


@asynccontextmanager
async def _participant() -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    env = {**os.environ, "TURNPOINT_TOKEN": TOKEN}
    env.pop("TURNPOINT_TOKEN_FILE", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout=TIMEOUT)
        if not line.startswith(b"PORT "):
            assert process.stderr is not None
            stderr = await asyncio.wait_for(process.stderr.read(), timeout=TIMEOUT)
            pytest.fail(f"the participant did not start: {line!r} {stderr.decode()}")
        yield process, int(line.split()[1])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _exit_status(process: asyncio.subprocess.Process) -> tuple[int, str, str]:
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=TIMEOUT)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_turns_health_not_serving_then_the_process_exits_0(
    sig: signal.Signals,
) -> None:
    async with _participant() as (process, port):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            health = health_pb2_grpc.HealthStub(channel)
            overall = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
            control = health.Watch(
                health_pb2.HealthCheckRequest(service=CONTROL_SERVICE), timeout=TIMEOUT
            )
            assert (await overall.read()).status == health_pb2.HealthCheckResponse.SERVING
            assert (await control.read()).status == health_pb2.HealthCheckResponse.SERVING

            process.send_signal(sig)

            assert (await overall.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await control.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Watchers that let go are the last calls in flight: the drain ends with them.
            overall.cancel()
            control.cancel()
        finally:
            await channel.close(None)
        returncode, stdout, stderr = await _exit_status(process)
    assert returncode == 0, stderr
    assert "STOPPED" in stdout.split()
    assert TOKEN not in stdout + stderr


async def test_a_second_signal_cuts_the_grace_period_short() -> None:
    async with _participant() as (process, port):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT
            )
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            process.send_signal(signal.SIGTERM)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            # The watch stays open, holding the 600 s grace; the second signal ends it.
            process.send_signal(signal.SIGTERM)
            returncode, stdout, stderr = await _exit_status(process)
        finally:
            await channel.close(None)
    assert returncode == 0, stderr
    assert "STOPPED" in stdout.split()
