"""``turnpoint serve module:Class``: the guide's own environment, as a reader runs it.

The code of docs/participant.md "Your own environment" is written to ``my_env.py`` in a
temporary directory, and both of its participants are served from there by the real
command in subprocesses: the dealer (``my_env:Dealer``) and the player
(``--participant my_env:Player``), with the token, health and drain of every served
participant. An episode runs on the player against the dealer; a keyed deal re-sent
to the dealer gets the recorded card; SIGTERM drains both and they exit 0.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.participants import METADATA, TOKEN
from tests.support.scripted import RunCall
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk._effects import CallPosition, effect_key
from turnpoint.server import ResourcesClient
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import rollout_service_pb2 as ro_pb
from turnpoint.v1 import types_pb2

# A safety bound on a child's start and exit; never a synchronisation device.
BOUND_S = 60.0
_SERVING = re.compile(r"turnpoint: serving (\S+) (\S+) on (\S+)")
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "participant.md"


def _guide_module() -> str:
    section = GUIDE.read_text().split("## Your own environment", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


class Served:
    def __init__(self, process: asyncio.subprocess.Process, kind: str, address: str) -> None:
        self.process, self.kind, self.address = process, kind, address


@asynccontextmanager
async def _serve(directory: Path, *args: str, env: Mapping[str, str] = {}) -> AsyncIterator[Served]:
    """``turnpoint serve ARGS`` run from ``directory``; stopped with SIGTERM on exit."""
    process = await _start(directory, *args, env=env)
    try:
        assert process.stdout is not None and process.stderr is not None
        line = (await asyncio.wait_for(process.stdout.readline(), BOUND_S)).decode()
        match = _SERVING.search(line)
        if match is None:
            stderr = await asyncio.wait_for(process.stderr.read(), BOUND_S)
            raise AssertionError(f"no serving line: {line!r}\n{stderr.decode()}")
        yield Served(process, match.group(1), match.group(3))
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
        assert process.returncode == 0, stderr.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _start(
    directory: Path, *args: str, env: Mapping[str, str] = {}
) -> asyncio.subprocess.Process:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TURNPOINT_TOKEN")}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnpoint.apps._cli",
        "serve",
        *args,
        "--root",
        str(directory / "snapshots"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=directory,
        env={**environment, "TURNPOINT_TOKEN": TOKEN, **env},
    )


async def test_the_guides_own_environment_is_served_by_module_and_class(tmp_path: Path) -> None:
    (tmp_path / "my_env.py").write_text(_guide_module())
    async with _serve(tmp_path, "my_env:Dealer", "--instance", "dealer") as dealer:
        assert dealer.kind == "resources"
        channel = grpc.aio.insecure_channel(dealer.address)
        try:
            described = await pb_grpc.CheckpointControlServiceStub(channel).Describe(
                pb.DescribeRequest(), metadata=METADATA, timeout=BOUND_S
            )
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=BOUND_S
            )
        finally:
            await channel.close(None)
        assert described.kind == types_pb2.PARTICIPANT_KIND_RESOURCES
        assert described.instance_name == "dealer"
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        # The guide's tool is not idempotent; the runtime answers a re-sent key once.
        client = ResourcesClient(dealer.address, token=TOKEN)
        try:
            episode = EpisodeId("hand-direct", 0)
            await client.seed(episode, {"seed": 4})
            key = effect_key("hand-direct", CallPosition(0, 0))
            first = await client.call(episode, "deal", {}, request_id=key)
            again = await client.call(episode, "deal", {}, request_id=key)
            nxt = await client.call(
                episode, "deal", {}, request_id=effect_key("hand-direct", CallPosition(1, 0))
            )
        finally:
            await client.aclose()
        assert first == again and type(first["card"]) is int
        assert (await _verdict_total(dealer.address, episode)) == first["card"] + nxt["card"]

        async with _serve(
            tmp_path,
            "--participant",
            "my_env:Player",
            "--instance",
            "player-0",
            env={"DEALER_ADDRESS": dealer.address},
        ) as player:
            assert player.kind == "agent"
            channel = grpc.aio.insecure_channel(player.address)
            try:
                run = RunCall(channel, EpisodeId("hand-1", 0), {"seed": 7})
                result = await run.done()
            finally:
                await channel.close(None)
    assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED, result
    hand = [int(card) for card in result.result["hand"]]
    assert sum(hand) >= 17
    assert result.result["reward"] == (1.0 if sum(hand) <= 21 else 0.0)


async def _verdict_total(address: str, episode: EpisodeId) -> int:
    client = ResourcesClient(address, token=TOKEN)
    try:
        verdict = await client.verify(
            episode, {}, request_id=effect_key(episode.rollout_id, CallPosition(2, 0))
        )
    finally:
        await client.aclose()
    return int(verdict.details["total"])


async def test_a_name_that_is_no_participant_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "my_env.py").write_text(_guide_module())
    for reference, expected in (
        ("my_env:Croupier", "turnpoint serve: module 'my_env' has no 'Croupier'"),
        ("my_env:os", "turnpoint serve: my_env:os is <module 'os'"),
        ("no_such_module:Dealer", "turnpoint serve: cannot import 'no_such_module'"),
        ("my_env", "turnpoint serve: a participant is named module:attribute"),
    ):
        process = await _start(tmp_path, reference)
        _, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
        text = stderr.decode()
        assert process.returncode == 2, text
        assert "Traceback" not in text
        assert text.strip().splitlines()[-1].startswith(expected), text
