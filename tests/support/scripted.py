"""Scriptable participants served over real gRPC, for the wire and state-machine tests.

The example participants run real episodes; these run exactly as far as a test lets
them. :class:`ScriptedAgent` seals a boundary each time the test releases a step (or
answers its model call), :class:`ScriptedTools` holds any request at a named gate, and
:func:`host_scripted` serves them through :func:`host_participant` with token auth on
``127.0.0.1:0``. :class:`Wire` is the client side: control requests through one door
(unary or ControlSession), the data plane through its own stubs, and waits on the
participant's own condition instead of sleeps.

For the trainer's side there is no SDK underneath: :class:`ScriptedControl` is a
``CheckpointControlService`` participant written out by hand, whose every operation a
test can replace, and :func:`serve_control` serves it (unary calls and ControlSession,
or unary only) on ``127.0.0.1:0``. The control client's tests and the coordinator's
each subclass it with the answers they need.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter, defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
from google.protobuf import duration_pb2

from tests.support.fakes import state_of
from tests.support.participants import METADATA, TOKEN, ControlDoor
from turnpoint._status import error_from_rpc, error_to_control_error, error_to_grpc_status
from turnpoint.convert import (
    artifact_to_proto,
    duration_from_seconds,
    episode_to_proto,
    struct_from_mapping,
    struct_to_dict,
)
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import (
    Agent,
    EpisodeContext,
    ParticipantRuntime,
    ResourcesServer,
    RuntimeConfig,
    SavedTurn,
    SnapshotStore,
    Verdict,
    VerifyMode,
)
from turnpoint.participant_sdk._core import ParticipantCore
from turnpoint.participant_sdk.testing import StoreFaults
from turnpoint.protocol import ArtifactRef, RecoveryMode
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.server.advanced import BearerTokenInterceptor
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
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
    runtime_class: type[ParticipantRuntime] = ParticipantRuntime,
) -> AsyncIterator[HostedParticipant]:
    """Serve a runtime of the given kinds on ``127.0.0.1:0``; stopped (no grace) on exit.

    ``runtime_class`` serves a mutant (``tests/support/mutants.py``) instead.
    """
    store = SnapshotStore(root, faults=faults)
    extra: dict[str, Any] = {} if clock is None else {"clock": clock}
    runtime = runtime_class(
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

    async def done(self, seconds: float = BOUND_S) -> ro_pb.RunResult:
        """The Run's result, awaited with a hang guard of ``seconds`` (larger for a Run
        that starts processes, whose start-up a loaded machine slows many times)."""
        await bounded(asyncio.shield(self.task), seconds)
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

    async def restore_running(
        self,
        restore: str,
        snapshot: str,
        committed: pb.CommitResponse,
        scope: Sequence[EpisodeId],
        *,
        retire_unscoped: bool = False,
        request_id: str | None = None,
        fence: types_pb2.Fence | None = None,
    ) -> pb.RestoreRunningResponse:
        request = pb.RestoreRunningRequest(
            fence=fence or self.fence,
            request_id=request_id or rid("restore-running"),
            restore_id=restore,
            snapshot=snapshot,
            entry=pb.ManifestEntry(manifest=committed.manifest, artifacts=committed.artifacts),
            scope=[episode_to_proto(e) for e in scope],
            retire_unscoped=retire_unscoped,
        )
        response: pb.RestoreRunningResponse = await self.door.call(request)
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


# ------------------------------------------------ scripted control servicers (no SDK)

ControlHandler = Callable[[Any, float], Awaitable[Any]]
SESSION_METHOD = "/turnpoint.v1.CheckpointControlService/ControlSession"


class BreakSession(Exception):
    """Raised by a handler: the participant drops the session (a unary call: UNAVAILABLE)."""


class Observed:
    """State a test waits on: every change notifies, ``until`` waits for a predicate."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(BOUND_S), self._changed:
            await self._changed.wait_for(predicate)


async def hang(request: Any, timeout_s: float) -> Any:
    """A handler that never answers."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


class ScriptedControl(Observed):
    """The half every scripted ``CheckpointControlService`` participant shares.

    It records what it was asked (``received``), which calls were cancelled and which
    are in flight, the methods and sessions its server saw; ``script[op]`` replaces one
    operation's handler, a ``(request, timeout_s)`` coroutine that answers, raises a
    :class:`TurnpointError` (the refusal), :class:`BreakSession` or hangs. A request id
    in ``break_after`` is acted on, then its reply is lost with the session.
    Subclasses say how an unscripted operation is answered (:meth:`unscripted`) and
    what ``WatchBoundaries`` streams (:meth:`watch_boundaries`).
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.address = ""
        self.script: dict[str, ControlHandler] = {}
        self.received: list[tuple[str, str, Any]] = []
        self.cancelled: list[tuple[str, str]] = []
        self.in_flight: Counter[str] = Counter()
        self.methods: list[str] = []
        self.sessions_opened = 0
        self.break_after: set[str] = set()

    def header(self) -> types_pb2.ResponseHeader:
        return types_pb2.ResponseHeader(participant_id=self.name, incarnation="inc-1", epoch=1)

    def calls(self, op: str) -> list[Any]:
        return [request for name, _, request in self.received if name == op]

    def request_ids(self, op: str | None = None) -> list[str]:
        return [rid for name, rid, _ in self.received if op is None or name == op]

    async def handle(self, op: str, request_id: str, request: Any, timeout_s: float) -> Any:
        self.received.append((op, request_id, request))
        await self.notify()
        self.in_flight[op] += 1
        try:
            return await self.answer(op, request_id, request, timeout_s)
        except asyncio.CancelledError:
            self.cancelled.append((op, request_id))
            raise
        finally:
            self.in_flight[op] -= 1
            await self.notify()

    async def answer(self, op: str, request_id: str, request: Any, timeout_s: float) -> Any:
        handler = self.script.get(op)
        if handler is not None:
            return await handler(request, timeout_s)
        return await self.unscripted(op, request, timeout_s)

    async def unscripted(self, op: str, request: Any, timeout_s: float) -> Any:
        raise NotImplementedError

    def watch_boundaries(self) -> AsyncGenerator[pb.WatchBoundariesResponse, None]:
        raise NotImplementedError


def _seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


class ScriptedControlServicer(pb_grpc.CheckpointControlServiceServicer):
    """Serves a :class:`ScriptedControl` through the unary calls and ``ControlSession``.

    The session dispatches the oneof to the same handlers as the unary calls and answers
    each request as soon as it is done; a ``cancel`` message cancels the call it names.
    """

    def __init__(self, participant: ScriptedControl) -> None:
        self.p = participant

    async def _unary(
        self, op: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        remaining = context.time_remaining()
        timeout_s = remaining if remaining is not None else 30.0
        try:
            return await self.p.handle(op, getattr(request, "request_id", ""), request, timeout_s)
        except TurnpointError as error:
            await context.abort_with_status(error_to_grpc_status(error))  # type: ignore[attr-defined]
        except BreakSession:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted outage")
        raise AssertionError("abort returns only by raising")

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DescribeResponse:
        return cast(pb.DescribeResponse, await self._unary("describe", request, context))

    async def Prepare(
        self, request: pb.PrepareRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PrepareResponse:
        return cast(pb.PrepareResponse, await self._unary("prepare", request, context))

    async def Renew(
        self, request: pb.RenewRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RenewResponse:
        return cast(pb.RenewResponse, await self._unary("renew", request, context))

    async def Commit(
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CommitResponse:
        return cast(pb.CommitResponse, await self._unary("commit", request, context))

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ResumeResponse:
        return cast(pb.ResumeResponse, await self._unary("resume", request, context))

    async def Restore(
        self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RestoreResponse:
        return cast(pb.RestoreResponse, await self._unary("restore", request, context))

    async def Retire(
        self, request: pb.RetireRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RetireResponse:
        return cast(pb.RetireResponse, await self._unary("retire", request, context))

    async def Forget(
        self, request: pb.ForgetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ForgetResponse:
        return cast(pb.ForgetResponse, await self._unary("forget", request, context))

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetStatusResponse:
        return cast(pb.GetStatusResponse, await self._unary("get_status", request, context))

    async def WatchBoundaries(
        self, request: pb.WatchBoundariesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchBoundariesResponse]:
        # Closing this stream closes the participant's, wherever either was suspended.
        async with contextlib.aclosing(self.p.watch_boundaries()) as stream:
            async for response in stream:
                yield response

    async def ControlSession(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[pb.ControlSessionRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        self.p.sessions_opened += 1
        write_lock = asyncio.Lock()
        broken = asyncio.Event()
        serving: set[asyncio.Task[None]] = set()
        by_request: dict[str, asyncio.Task[None]] = {}

        async def serve(envelope: pb.ControlSessionRequest) -> None:
            op = envelope.WhichOneof("operation")
            assert op is not None
            reply = pb.ControlSessionResponse(request_id=envelope.request_id)
            try:
                answer = await self.p.handle(
                    op, envelope.request_id, getattr(envelope, op), _seconds(envelope.timeout)
                )
                getattr(reply, op).CopyFrom(answer)
            except TurnpointError as error:
                reply.error.CopyFrom(error_to_control_error(error))
            except BreakSession:
                broken.set()
                return
            if envelope.request_id in self.p.break_after:
                # Acted and recorded, but the reply is lost with the stream.
                self.p.break_after.discard(envelope.request_id)
                broken.set()
                return
            async with write_lock:
                await context.write(reply)

        async def read_requests() -> None:
            while True:
                envelope = await context.read()
                if not isinstance(envelope, pb.ControlSessionRequest):
                    return
                if envelope.WhichOneof("operation") == "cancel":
                    # The caller abandoned that call: cancel it, answer nothing.
                    abandoned = by_request.get(envelope.request_id)
                    if abandoned is not None:
                        abandoned.cancel()
                    continue
                task = asyncio.create_task(serve(envelope))
                serving.add(task)
                task.add_done_callback(serving.discard)
                by_request[envelope.request_id] = task

        reader = asyncio.create_task(read_requests())
        breaker = asyncio.create_task(broken.wait())
        try:
            done, _ = await asyncio.wait({reader, breaker}, return_when=asyncio.FIRST_COMPLETED)
            if breaker in done:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted session break")
            await asyncio.gather(*serving)
        finally:
            tasks = (reader, breaker, *serving)
            for task in tasks:
                task.cancel()
            # Retrieve what they ended with (a write after the abort raises): a task
            # whose exception is never retrieved is logged, traceback and all, from
            # whichever thread collects it, which can be inside another ast.parse.
            await asyncio.gather(*tasks, return_exceptions=True)


class MethodLog(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Records every method called; without ``sessions`` it hides ControlSession, which
    then answers UNIMPLEMENTED as from a server without the method (so that a client
    falls back to the unary calls, whose cancellation reaches the participant)."""

    def __init__(self, methods: list[str], *, sessions: bool) -> None:
        self.methods = methods
        self.sessions = sessions

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        self.methods.append(handler_call_details.method)
        if handler_call_details.method == SESSION_METHOD and not self.sessions:
            return None
        return await continuation(handler_call_details)


async def serve_control(
    participant: ScriptedControl, token: str, *, session: bool = True
) -> grpc.aio.Server:
    """Serve ``participant`` on ``127.0.0.1:0`` with token auth; sets its address."""
    server = grpc.aio.server(
        interceptors=[
            MethodLog(participant.methods, sessions=session),
            BearerTokenInterceptor(token, open_services=()),
        ]
    )
    pb_grpc.add_CheckpointControlServiceServicer_to_server(
        ScriptedControlServicer(participant), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    participant.address = f"127.0.0.1:{port}"
    return server
