"""Scriptable participants served over real gRPC, for the wire and state-machine tests.

The example participants run real episodes; these run exactly as far as a test lets
them. :class:`ScriptedAgent` seals a boundary each time the test releases a step (or
answers its model call), :class:`ScriptedTools` holds any request at a named gate, and
:func:`host_scripted` serves them through :func:`host_participant` with token auth on
``127.0.0.1:0``. :class:`Wire` is the client side: control requests through one door
(unary or ControlSession), the data plane through its own stubs, and waits on the
participant's own condition instead of sleeps.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from tests.support.participants import METADATA, TOKEN, ControlDoor
from turnpoint._convert import (
    duration_from_seconds,
    episode_to_proto,
    struct_from_mapping,
    struct_to_dict,
)
from turnpoint._status import error_from_rpc
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import (
    Agent,
    ArtifactRef,
    EpisodeContext,
    EpisodeState,
    ParticipantRuntime,
    ResourcesServer,
    RuntimeConfig,
    SavedTurn,
    SnapshotStore,
    Verdict,
    VerifyMode,
)
from turnpoint.participant_sdk._core import ParticipantCore, WorkKey
from turnpoint.participant_sdk.testing import StoreFaults
from turnpoint.protocol import RecoveryMode
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.server._convert import artifact_to_proto
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import resources_service_pb2 as rs_pb
from turnpoint.v1 import resources_service_pb2_grpc as rs_grpc
from turnpoint.v1 import rollout_service_pb2 as ro_pb
from turnpoint.v1 import rollout_service_pb2_grpc as ro_grpc
from turnpoint.v1 import types_pb2

if TYPE_CHECKING:
    from turnpoint.v1.resources_service_pb2_grpc import ResourcesServiceAsyncStub

T = TypeVar("T")

FENCE = types_pb2.Fence(coordinator_id="coord", epoch=1)
# A safety bound on waits for things that must happen; never a synchronisation device.
BOUND_S = 10.0
FAST = RuntimeConfig(model_retry_backoff_s=0.01)

_request_ids = itertools.count(1)


def rid(prefix: str = "rq") -> str:
    return f"{prefix}-{next(_request_ids)}"


def ckpt(n: int) -> str:
    return make_checkpoint_id("ckpt", n)


def restore_id(n: int) -> str:
    return make_checkpoint_id("restore", n)


async def bounded(awaitable: Awaitable[T], seconds: float = BOUND_S) -> T:
    """Await with a safety bound: a hang fails the test instead of the whole run."""
    async with asyncio.timeout(seconds):
        return await awaitable


async def poll(predicate: Callable[[], bool], seconds: float = BOUND_S) -> None:
    """Poll a condition nothing notifies about (a file, a counter), bounded."""
    async with asyncio.timeout(seconds):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on: files, counters
            await asyncio.sleep(0.005)


class FakeClock:
    """Protocol time the test moves by hand (leases and budgets)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def state_of(core: ParticipantCore, episode: EpisodeId, slot: str = "run") -> EpisodeState | None:
    view = core.entry(WorkKey(episode, slot))
    return None if view is None else view.state


def boundary_of(core: ParticipantCore, episode: EpisodeId) -> int:
    view = core.entry(WorkKey(episode, "run"))
    return -1 if view is None else view.boundary_index


# ---------------------------------------------------------------------- scripted kinds


class ModelFailed(Exception):
    """A scripted model call that fails (the agent carries on after it)."""


class ScriptedAgent(Agent):
    """Each turn waits for the test, then seals a boundary; the state is the turns done.

    ``task["turns"]`` turns. With ``task["model"]`` the first boundary is sealed at once
    and every later turn waits on a model call answered through :meth:`reply` (a
    :class:`ModelFailed` reply fails the call; the turn then waits for a step instead).
    """

    def __init__(self) -> None:
        self.steps: defaultdict[EpisodeId, asyncio.Semaphore] = defaultdict(
            lambda: asyncio.Semaphore(0)
        )
        self.replies: defaultdict[EpisodeId, asyncio.Queue[str | Exception]] = defaultdict(
            asyncio.Queue
        )
        self.started: list[tuple[EpisodeId, SavedTurn | None]] = []
        self.model_calls = 0
        self.model_returned = 0
        self.exports: list[dict[EpisodeId, Mapping[str, Any]]] = []
        self.close_fails = False
        self.opened = 0
        self.cancel_gate: asyncio.Event | None = None
        self.cancelling = asyncio.Event()
        self.restart_before_boundary: set[EpisodeId] = set()
        # Raised by the next export (then cleared): a Gym server's export failing.
        self.export_error: Exception | None = None
        # Set: admission_closed waits for it (a slow hook); a cancellation is recorded.
        self.close_gate: asyncio.Event | None = None
        self.close_gate_reached = asyncio.Event()
        self.close_cancelled = asyncio.Event()

    def release(self, episode: EpisodeId, steps: int = 1) -> None:
        for _ in range(steps):
            self.steps[episode].release()

    def reply(self, episode: EpisodeId, reply: str | Exception) -> None:
        self.replies[episode].put_nowait(reply)

    async def _call_model(self, episode: EpisodeId) -> str:
        self.model_calls += 1
        reply = await self.replies[episode].get()
        self.model_returned += 1
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        episode = ctx.episode
        self.started.append((episode, ctx.restored))
        restored = ctx.restored
        history: list[Any] = list(restored.state["history"]) if restored else []
        turn = restored.turn_index + 1 if restored else 0
        try:
            while turn < task["turns"]:
                if task.get("model") and ctx.last_boundary is not None:
                    try:
                        history.append(await ctx.model_call(lambda: self._call_model(episode)))
                    except ModelFailed:
                        await self.steps[episode].acquire()
                        history.append("failed")
                elif not (task.get("model") and turn == 0):
                    await self.steps[episode].acquire()
                    history.append(turn)
                else:
                    history.append(turn)
                if episode in self.restart_before_boundary:
                    await ctx.mark_restart()
                await ctx.boundary(turn, {"history": history})
                turn += 1
        except asyncio.CancelledError:
            if self.cancel_gate is not None:
                self.cancelling.set()
                await self.cancel_gate.wait()
            raise
        return {"history": history}

    async def export_states(
        self, states: Mapping[EpisodeId, SavedTurn]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        if self.export_error is not None:
            error, self.export_error = self.export_error, None
            raise error
        exported = {episode: saved.state for episode, saved in states.items()}
        self.exports.append(dict(exported))
        return exported

    async def admission_closed(self) -> None:
        if self.close_fails:
            raise RuntimeError("the agent's admission gate is broken")
        if self.close_gate is not None:
            self.close_gate_reached.set()
            try:
                await self.close_gate.wait()
            except asyncio.CancelledError:
                self.close_cancelled.set()
                raise

    async def admission_opened(self) -> None:
        self.opened += 1


class ScriptedTools(ResourcesServer):
    """An exported resources server whose requests wait at gates the test opens."""

    recovery_mode = RecoveryMode.EXPORTED

    def __init__(self) -> None:
        self.sessions: dict[EpisodeId, dict[str, Any]] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.retire_gate: asyncio.Event | None = None
        self.retiring = asyncio.Event()
        self.close_fails = False
        self.log: list[tuple[str, EpisodeId]] = []

    def hold(self, name: str) -> asyncio.Event:
        self.gates[name] = asyncio.Event()
        return self.gates[name]

    async def _maybe_wait(self, name: str) -> None:
        self.entered[name].set()
        gate = self.gates.get(name)
        if gate is not None:
            await gate.wait()

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        await self._maybe_wait("seed")
        self.sessions[episode] = {"target": task.get("target", 3), "calls": 0}

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        await self._maybe_wait(tool)
        session = self.sessions[episode]
        session["calls"] += 1
        return {"calls": session["calls"]}

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        await self._maybe_wait("verify")
        hit = answer.get("guess") == self.sessions[episode]["target"]
        return Verdict(1.0 if hit else 0.0)

    async def close(self, episode: EpisodeId) -> None:
        self.log.append(("close", episode))
        self.sessions.pop(episode, None)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        return {episode: dict(self.sessions[episode]) for episode in episodes}

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        self.log.append(("restore", episode))
        self.sessions[episode] = dict(state)

    async def retire_session(self, episode: EpisodeId) -> None:
        self.retiring.set()
        if self.retire_gate is not None:
            await self.retire_gate.wait()
        self.log.append(("retire", episode))
        self.sessions.pop(episode, None)

    async def admission_closed(self) -> None:
        if self.close_fails:
            raise RuntimeError("the tools' admission gate is broken")


class RestartTools(ScriptedTools):
    """An unaudited server: its sessions cannot be captured."""

    recovery_mode = RecoveryMode.RESTART_ONLY


class GroupTools(ScriptedTools):
    """Group-scored: each verify may wait on siblings, so it is declared REPLAY."""

    group_scored = True
    group_size = 2
    verify_mode = VerifyMode.REPLAY


# ---------------------------------------------------------------------- hosting


@asynccontextmanager
async def host_scripted(
    root: Path,
    *,
    instance: str = "agent-0",
    agent: Agent | None = None,
    resources: ResourcesServer | None = None,
    faults: StoreFaults | None = None,
    clock: Callable[[], float] | None = None,
    config: RuntimeConfig = FAST,
    token: str | None = TOKEN,
) -> AsyncIterator[HostedParticipant]:
    """Serve a runtime of the given kinds on ``127.0.0.1:0``; stopped (no grace) on exit."""
    store = SnapshotStore(root, faults=faults)
    extra: dict[str, Any] = {} if clock is None else {"clock": clock}
    runtime = ParticipantRuntime(
        instance, store, agent=agent, resources=resources, config=config, **extra
    )
    hosted = host_participant(runtime, ServerOptions(port=0, token=token))
    await hosted.start()
    try:
        yield hosted
    finally:
        await hosted.stop(0)


class RunCall:
    """One ``RolloutService.Run`` call followed in the background, as the trainer would."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        episode: EpisodeId,
        task: Mapping[str, Any],
        *,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
    ) -> None:
        request = ro_pb.RunRequest(
            request_id=rid("run"),
            episode=episode_to_proto(episode),
            task=struct_from_mapping(task),
            boundaries_seen=boundaries_seen,
        )
        if budget_s is not None:
            request.budget.CopyFrom(duration_from_seconds(budget_s))
        self.episode = episode
        self.call = ro_grpc.RolloutServiceStub(channel).Run(request, metadata=METADATA, timeout=60)
        self.boundaries: list[int] = []
        self.result: ro_pb.RunResult | None = None
        self.error: BaseException | None = None
        self.accepted = False
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            metadata = await self.call.initial_metadata()
            self.accepted = ("turnpoint-accepted", "1") in list(metadata or ())
            async for response in self.call:
                if response.WhichOneof("event") == "boundary":
                    self.boundaries.append(response.boundary.boundary_index)
                else:
                    self.result = response.result
        except grpc.aio.AioRpcError as error:
            self.error = error_from_rpc(error) or error
        except asyncio.CancelledError:
            # grpc.aio ends the iteration of a call we cancelled with CancelledError.
            if not self.call.cancelled():
                raise

    async def done(self) -> ro_pb.RunResult:
        await bounded(asyncio.shield(self.task))
        if self.error is not None:
            raise self.error
        assert self.result is not None, "the Run ended without a result"
        return self.result

    async def refused(self) -> TurnpointError:
        """The protocol error this Run was refused with."""
        await bounded(asyncio.shield(self.task))
        assert isinstance(self.error, TurnpointError), self.error
        return self.error

    async def cancel(self) -> None:
        self.call.cancel()
        await bounded(asyncio.shield(self.task))


@dataclass
class Wire:
    """The client side of one hosted participant: a control door and data-plane stubs."""

    hosted: HostedParticipant
    door: ControlDoor
    channel: grpc.aio.Channel
    fence: types_pb2.Fence = field(default_factory=lambda: FENCE)

    @property
    def runtime(self) -> ParticipantRuntime:
        return self.hosted.runtime

    @property
    def core(self) -> ParticipantCore:
        return self.hosted.runtime.core

    @property
    def instance(self) -> str:
        return self.hosted.runtime.instance_name

    async def until(self, predicate: Callable[[ParticipantCore], bool]) -> None:
        """Wait (bounded) until the participant's state satisfies ``predicate``."""
        assert await self.runtime.wait_until(predicate, BOUND_S), "state never reached"

    # ------------------------------------------------------------------ control

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        lease_s: float | None = None,
        max_blockers: int = 0,
        timeout_s: float = 10.0,
        request_id: str | None = None,
    ) -> pb.PrepareResponse:
        request = pb.PrepareRequest(
            fence=self.fence,
            request_id=request_id or rid("prepare"),
            checkpoint_id=checkpoint_id,
            max_blockers=max_blockers,
        )
        if lease_s is not None:
            request.lease.CopyFrom(duration_from_seconds(lease_s))
        response: pb.PrepareResponse = await self.door.call(request, timeout_s)
        return response

    async def renew(self, checkpoint_id: str, *, lease_s: float | None = None) -> pb.RenewResponse:
        request = pb.RenewRequest(
            fence=self.fence, request_id=rid("renew"), checkpoint_id=checkpoint_id
        )
        if lease_s is not None:
            request.lease.CopyFrom(duration_from_seconds(lease_s))
        response: pb.RenewResponse = await self.door.call(request)
        return response

    async def commit(
        self,
        checkpoint_id: str,
        snapshot: str,
        scope: Sequence[EpisodeId],
        *,
        timeout_s: float = 10.0,
        request_id: str | None = None,
    ) -> pb.CommitResponse:
        request = pb.CommitRequest(
            fence=self.fence,
            request_id=request_id or rid("commit"),
            checkpoint_id=checkpoint_id,
            snapshot=snapshot,
            scope=[episode_to_proto(e) for e in scope],
        )
        response: pb.CommitResponse = await self.door.call(request, timeout_s)
        return response

    async def resume(
        self,
        checkpoint_id: str,
        *,
        request_id: str | None = None,
        fence: types_pb2.Fence | None = None,
        timeout_s: float = 10.0,
    ) -> pb.ResumeResponse:
        request = pb.ResumeRequest(
            fence=fence or self.fence,
            request_id=request_id or rid("resume"),
            checkpoint_id=checkpoint_id,
        )
        response: pb.ResumeResponse = await self.door.call(request, timeout_s)
        return response

    async def restore(
        self,
        restore: str,
        snapshot: str,
        committed: pb.CommitResponse,
        scope: Sequence[EpisodeId],
        *,
        manifest: ArtifactRef | None = None,
    ) -> pb.RestoreResponse:
        entry = pb.ManifestEntry(
            manifest=artifact_to_proto(manifest) if manifest else committed.manifest,
            artifacts=committed.artifacts,
        )
        request = pb.RestoreRequest(
            fence=self.fence,
            request_id=rid("restore"),
            restore_id=restore,
            snapshot=snapshot,
            entry=entry,
            scope=[episode_to_proto(e) for e in scope],
        )
        response: pb.RestoreResponse = await self.door.call(request)
        return response

    async def retire(
        self, episodes: Sequence[EpisodeId], *, timeout_s: float = 10.0
    ) -> pb.RetireResponse:
        request = pb.RetireRequest(
            fence=self.fence,
            request_id=rid("retire"),
            episodes=[episode_to_proto(e) for e in episodes],
        )
        response: pb.RetireResponse = await self.door.call(request, timeout_s)
        return response

    async def forget(self, rollout_ids: Sequence[str]) -> pb.ForgetResponse:
        request = pb.ForgetRequest(
            fence=self.fence, request_id=rid("forget"), rollout_ids=list(rollout_ids)
        )
        response: pb.ForgetResponse = await self.door.call(request)
        return response

    async def status(self, max_blockers: int = 0) -> pb.GetStatusResponse:
        response: pb.GetStatusResponse = await self.door.call(
            pb.GetStatusRequest(max_blockers=max_blockers)
        )
        return response

    # ------------------------------------------------------------------ data plane

    def run(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        *,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
    ) -> RunCall:
        return RunCall(
            self.channel, episode, task, boundaries_seen=boundaries_seen, budget_s=budget_s
        )

    async def start(self, episode: EpisodeId, task: Mapping[str, Any]) -> RunCall:
        """A Run the participant accepted (its entry is in the table)."""
        call = self.run(episode, task)
        await self.until(lambda core: state_of(core, episode) is not None)
        return call

    async def acknowledge(self, receipts: Sequence[types_pb2.CompletionReceipt]) -> int:
        response = await ro_grpc.RolloutServiceStub(self.channel).Acknowledge(
            ro_pb.AcknowledgeRequest(request_id=rid("ack"), receipts=list(receipts)),
            metadata=METADATA,
            timeout=10,
        )
        return response.acknowledged

    def resources(self) -> ResourcesServiceAsyncStub:
        return rs_grpc.ResourcesServiceStub(self.channel)

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any] | None = None) -> bool:
        response = await self.resources().SeedSession(
            rs_pb.SeedSessionRequest(
                request_id=rid("seed"),
                episode=episode_to_proto(episode),
                task=struct_from_mapping(task or {}),
            ),
            metadata=METADATA,
            timeout=10,
        )
        return response.existed

    async def call_tool(self, episode: EpisodeId, tool: str) -> dict[str, Any]:
        response = await self.resources().Call(
            rs_pb.CallRequest(request_id=rid("call"), episode=episode_to_proto(episode), tool=tool),
            metadata=METADATA,
            timeout=10,
        )
        return struct_to_dict(response.output)

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> float:
        response = await self.resources().Verify(
            rs_pb.VerifyRequest(
                request_id=rid("verify"),
                episode=episode_to_proto(episode),
                answer=struct_from_mapping(answer),
            ),
            metadata=METADATA,
            timeout=10,
        )
        return response.reward


@asynccontextmanager
async def wire_to(hosted: HostedParticipant, door: str) -> AsyncIterator[Wire]:
    """A :class:`Wire` to ``hosted`` whose control requests use ``door``."""
    control = ControlDoor(hosted.address, door)
    channel = grpc.aio.insecure_channel(hosted.address)
    try:
        yield Wire(hosted, control, channel)
    finally:
        await control.close()
        await channel.close(None)


async def expect(reason: Reason, awaitable: Awaitable[object]) -> TurnpointError:
    """The protocol error ``awaitable`` raised, which must carry ``reason``."""
    try:
        await awaitable
    except TurnpointError as error:
        assert error.reason is reason, error
        return error
    raise AssertionError(f"expected {reason.name}")


async def expect_deadline(awaitable: Awaitable[object]) -> None:
    """A call answered DEADLINE_EXCEEDED: the participant's own answer, or the deadline's."""
    try:
        await awaitable
    except TurnpointError as error:
        assert error.reason is Reason.DEADLINE_EXCEEDED, error
        return
    except grpc.aio.AioRpcError as error:
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED, error
        return
    raise AssertionError("expected DEADLINE_EXCEEDED")
