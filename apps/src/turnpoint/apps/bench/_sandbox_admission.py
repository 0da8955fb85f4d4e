"""How long a checkpoint keeps admission closed over busy sandboxes.

docs/spec.md section 5.7.5: a resources server on sandboxes exports each session as a
snapshot of its tree, and under ``in_flight`` ``cut`` a command still running when
admission closes is killed. The coding environment is served over loopback gRPC with
:data:`BUSY_SANDBOXES` sessions; each round is one checkpoint (Prepare, Commit with
every session in scope, Resume) timed from the Prepare sent to the Resume answered,
the time no new call is admitted. Two kinds of round alternate so that both see the
same machine: *busy*, where every sandbox runs a command when Prepare is sent (each cut
and then snapshotted), and *idle*, the same sandboxes running nothing: the baseline.
The figures are the medians and their ratio busy / idle.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from turnpoint.apps.examples._coding import CodingTools
from turnpoint.auth import auth_metadata
from turnpoint.convert import episode_to_proto
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import ParticipantRuntime, SnapshotStore
from turnpoint.participant_sdk.sandboxes import InFlight, SandboxNotFoundError
from turnpoint.server import ResourcesClient, ServerOptions, host_participant
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

BUSY_SANDBOXES: Final = 16
_INSTANCE: Final = "bench-coding"
_TIMEOUT_S: Final = 60.0
# How often the wait for every command to have started looks again.
_POLL_S: Final = 0.01


@dataclass(frozen=True, slots=True)
class SandboxAdmission:
    sandboxes: int
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]

    @property
    def busy_median_s(self) -> float:
        return statistics.median(self.busy_s)

    @property
    def idle_median_s(self) -> float:
        return statistics.median(self.idle_s)

    @property
    def ratio(self) -> float:
        return self.busy_median_s / self.idle_median_s

    def to_json(self) -> dict[str, Any]:
        return {
            "sandboxes": self.sandboxes,
            "busy_admission_closed_s": [round(s, 4) for s in self.busy_s],
            "idle_admission_closed_s": [round(s, 4) for s in self.idle_s],
            "busy_admission_closed_median_s": round(self.busy_median_s, 4),
            "idle_admission_closed_median_s": round(self.idle_median_s, 4),
            "busy_vs_idle": round(self.ratio, 3),
        }


class _Checkpoints:
    """The coordinator's side: one checkpoint per round, every session in scope."""

    def __init__(self, channel: grpc.aio.Channel, token: str, scope: list[EpisodeId]) -> None:
        self._stub = pb_grpc.CheckpointControlServiceStub(channel)
        self._metadata = auth_metadata(token)
        self._fence = types_pb2.Fence(coordinator_id="bench", epoch=1)
        self._scope = [episode_to_proto(e) for e in scope]
        self._sequence = 0

    async def admission_closed_s(self) -> float:
        self._sequence += 1
        n = self._sequence
        checkpoint = make_checkpoint_id("bench-sandboxes", n)
        options: Mapping[str, Any] = {"metadata": self._metadata, "timeout": _TIMEOUT_S}
        started = time.perf_counter()
        prepared = await self._stub.Prepare(
            pb.PrepareRequest(fence=self._fence, request_id=f"p-{n}", checkpoint_id=checkpoint),
            **options,
        )
        if prepared.phase != types_pb2.PHASE_PREPARED:
            raise RuntimeError(f"the sandboxes' participant was not ready: {prepared}")
        committed = await self._stub.Commit(
            pb.CommitRequest(
                fence=self._fence,
                request_id=f"c-{n}",
                checkpoint_id=checkpoint,
                snapshot=checkpoint,
                scope=self._scope,
            ),
            **options,
        )
        await self._stub.Resume(
            pb.ResumeRequest(fence=self._fence, request_id=f"r-{n}", checkpoint_id=checkpoint),
            **options,
        )
        elapsed = time.perf_counter() - started
        if len(committed.exported) != len(self._scope):
            raise RuntimeError("the commit did not export every sandbox session")
        return elapsed


async def _until_started(tools: CodingTools, episodes: list[EpisodeId], marker: str) -> None:
    """Every episode's command has written its marker: it is running, not queued."""
    provider = await tools.provider()
    async with asyncio.timeout(_TIMEOUT_S):
        for episode in episodes:
            while True:
                try:
                    await provider.read_file(tools.session(episode).sandbox, marker)
                    break
                except (FileNotFoundError, SandboxNotFoundError):
                    await asyncio.sleep(_POLL_S)


async def measure_sandbox_admission(root: Path, rounds: int) -> SandboxAdmission:
    """``rounds`` busy and ``rounds`` idle checkpoints of :data:`BUSY_SANDBOXES` sandboxes."""
    token = secrets.token_urlsafe(24)
    tools = CodingTools.on_disk(root / "sandboxes", in_flight=InFlight.CUT)
    runtime = ParticipantRuntime(_INSTANCE, SnapshotStore(root / "snapshots"), resources=tools)
    hosted = host_participant(runtime, ServerOptions(port=0, token=token))
    await hosted.start()
    client = ResourcesClient(hosted.address, token=token, timeout_s=_TIMEOUT_S)
    busy: list[float] = []
    idle: list[float] = []
    try:
        episodes = [EpisodeId(f"busy-{index}", 0) for index in range(BUSY_SANDBOXES)]
        for episode in episodes:
            await client.seed(episode, {"task": "add"})
        async with grpc.aio.insecure_channel(hosted.address) as channel:
            checkpoints = _Checkpoints(channel, token, episodes)
            for round_index in range(rounds):
                idle.append(await checkpoints.admission_closed_s())
                marker = f"started-{round_index}"
                command = {"argv": ["sh", "-c", f": > {marker}; exec sleep 60"]}
                calls = [
                    asyncio.create_task(
                        client.call(e, "run", command, request_id=f"run-{round_index}-{i}")
                    )
                    for i, e in enumerate(episodes)
                ]
                try:
                    await _until_started(tools, episodes, marker)
                    busy.append(await checkpoints.admission_closed_s())
                    replies = await asyncio.gather(*calls)
                finally:
                    for call in calls:
                        call.cancel()
                if not all(reply.get("cut") is True for reply in replies):
                    raise RuntimeError("a busy sandbox's command was not cut at the checkpoint")
    finally:
        await client.aclose()
        await hosted.stop(0)
        await tools.aclose()
    return SandboxAdmission(BUSY_SANDBOXES, tuple(busy), tuple(idle))
