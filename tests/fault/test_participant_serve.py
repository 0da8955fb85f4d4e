"""``turnpoint serve`` as a real process: health turns NOT_SERVING on SIGTERM, exit 0."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnpoint.auth import auth_metadata
from turnpoint.server.advanced import CONTROL_SERVICE
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import resources_service_pb2 as rs_pb
from turnpoint.v1 import resources_service_pb2_grpc as rs_grpc
from turnpoint.v1 import types_pb2

# A safety bound on the child's start (it imports torch) and exit; never a sync device.
BOUND_S = 60.0
_SERVING = re.compile(rb"turnpoint: serving (\S+) (\S+) on (\S+):(\d+)")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_turnpoint_serve_goes_not_serving_on_sigterm_and_exits_0(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNPOINT_TOKEN")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnpoint.apps._cli",
        "serve",
        "--kind",
        "model",
        "--insecure-no-auth",
        "--root",
        str(tmp_path / "snapshots"),
        # Far longer than the bound: an exit proves the drain ended with the last call.
        "--grace",
        "600",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        line = await asyncio.wait_for(process.stdout.readline(), BOUND_S)
        match = _SERVING.search(line)
        if match is None:
            stderr = await asyncio.wait_for(process.stderr.read(), BOUND_S)
            raise AssertionError(f"no serving line: {line!r}\n{stderr.decode()}")
        kind, instance, host, port = (part.decode() for part in match.groups())
        assert kind == "model"
        channel = grpc.aio.insecure_channel(f"{host}:{port}")
        try:
            described = await pb_grpc.CheckpointControlServiceStub(channel).Describe(
                pb.DescribeRequest(), timeout=BOUND_S
            )
            assert described.instance_name == instance
            assert described.kind == types_pb2.PARTICIPANT_KIND_MODEL
            health = health_pb2_grpc.HealthStub(channel)
            overall = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=BOUND_S)
            control = health.Watch(
                health_pb2.HealthCheckRequest(service=CONTROL_SERVICE), timeout=BOUND_S
            )
            assert (await overall.read()).status == SERVING
            assert (await control.read()).status == SERVING

            process.send_signal(signal.SIGTERM)

            assert (await overall.read()).status == NOT_SERVING
            assert (await control.read()).status == NOT_SERVING
            # The watches are the last calls in flight: letting go of them ends the drain.
            overall.cancel()
            control.cancel()
        finally:
            await channel.close(None)
        _, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
        assert process.returncode == 0, stderr.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_turnpoint_serve_on_a_busy_port_says_so_without_a_traceback_and_exits_2(
    tmp_path: Path,
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "turnpoint.apps._cli",
            "serve",
            "--kind",
            "resources",
            "--insecure-no-auth",
            "--port",
            str(port),
            "--root",
            str(tmp_path / "snapshots"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
    assert process.returncode == 2
    text = stderr.decode()
    assert "Traceback" not in text
    # grpc's C core logs its own line first; ours says what happened and where.
    last = text.strip().splitlines()[-1]
    assert last.startswith("turnpoint serve: cannot bind") and str(port) in last


async def test_turnpoint_serve_on_a_store_without_its_bucket_says_so_at_start_and_exits_2(
    moto_endpoint: str,
) -> None:
    """docs/spec.md section 8.12 item 6: the store is reached once at start-up, so a
    wrong bucket (or refused credentials) is one clear line, not a failed commit later."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnpoint.apps._cli",
        "serve",
        "--kind",
        "resources",
        "--insecure-no-auth",
        "--root",
        "s3://no-such-bucket/job",
        stdout=asyncio.subprocess.PIPE,
        # Inherits the environment moto_endpoint set: boto3 finds the server there.
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
    assert process.returncode == 2
    text = stderr.decode()
    assert "Traceback" not in text and b"serving" not in stdout
    last = text.strip().splitlines()[-1]
    assert last.startswith("turnpoint serve: s3://no-such-bucket/job: the store refused access")


async def test_turnpoint_serve_with_a_data_token_file_refuses_it_on_the_control_plane(
    tmp_path: Path,
) -> None:
    """docs/spec.md section 10.2: ``--data-token-file`` opens the data plane only."""
    control_file, data_file = tmp_path / "control-token", tmp_path / "data-token"
    control_file.write_text("control-Token-1f2e\n", encoding="ascii")
    data_file.write_text("data-Token-3d4c\n", encoding="ascii")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNPOINT_TOKEN")}
    arguments = ["--kind", "resources", "--root", str(tmp_path / "snapshots")]
    tokens = ["--token-file", str(control_file), "--data-token-file", str(data_file)]
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "turnpoint.apps._cli", "serve", *arguments, *tokens),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        line = await asyncio.wait_for(process.stdout.readline(), BOUND_S)
        match = _SERVING.search(line)
        if match is None:
            stderr = await asyncio.wait_for(process.stderr.read(), BOUND_S)
            raise AssertionError(f"no serving line: {line!r}\n{stderr.decode()}")
        _kind, instance, host, port = (part.decode() for part in match.groups())
        async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
            control = pb_grpc.CheckpointControlServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await control.Describe(
                    pb.DescribeRequest(), metadata=auth_metadata("data-Token-3d4c"), timeout=10
                )
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            described = await control.Describe(
                pb.DescribeRequest(), metadata=auth_metadata("control-Token-1f2e"), timeout=10
            )
            assert described.instance_name == instance
            # Past the door: the data-plane token reaches the servicer, which has no such
            # session to close.
            closed = await rs_grpc.ResourcesServiceStub(channel).CloseSession(
                rs_pb.CloseSessionRequest(
                    request_id="close-1",
                    episode=types_pb2.EpisodeId(rollout_id="nobody", attempt=0),
                ),
                metadata=auth_metadata("data-Token-3d4c"),
                timeout=10,
            )
            assert not closed.closed
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
        assert process.returncode == 0, stderr.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
