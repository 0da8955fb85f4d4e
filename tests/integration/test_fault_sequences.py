"""Randomized fault sequences across both sides (the failure-semantics issue, item 6).

A hypothesis ``RuleBasedStateMachine`` drives the real trainer side (:class:`Coordinator`,
:class:`RolloutClient`, :class:`SnapshotDriver`, :class:`Restorer`) against real
participants over gRPC: a scripted agent and an exported resources server, each a real
SDK runtime on ``127.0.0.1:0`` behind a byte-level proxy. The agent seeds a session on
the resources server at its first model call and verifies it last, both as parked calls
(docs/spec.md section 5.2 item 8), so the resources server has sessions to export,
restore and retire. Every example starts its own fleet on a fresh snapshot root.

Rules: rollouts are dispatched, take turns (a model reply each), finish (sometimes losing
the Run's result or the acknowledgement's reply), are given up when a budget runs out,
and are consumed by a training loop that takes one optimizer step each time. Snapshots
are taken with up to two faults injected:

- a lost reply (the participant acted, the trainer's session broke) of prepare, commit,
  resume, retire, renew or forget;
- a dropped request (it never reached the participant) of prepare, commit or resume;
- a failed records write (:class:`StoreFaults`);
- a lease that runs out while the coordinator is silent, before its commit or resume;

and, optionally, a data-plane event racing the agent's prepare: a turn, a finish (its
result lost or not), a dispatch, or a verify that the resources server answers after the
agent closed ("verify across the cut"). A participant whose resume never arrived stays
closed until the trainer releases it or a rule lets time pass so that its lease runs out.

Two rules end an incarnation of the job, as section 7.11 says a lost participant or a
dead trainer does: a participant crashes (at rest, then the trainer's next snapshot fails;
or in the middle of a commit), or the coordinator dies (at rest, at the first prepare,
commit or resume, or after a step of publication). Then every participant is stopped,
fresh ones start, a new coordinator (the next epoch) restores the newest published
snapshot (its restore or resume lost, dropped, or its lease running out), and the rollout
side continues from the restored books.

Checked after every step (:meth:`FaultSequences.the_invariants`) and at each snapshot:

- the coordinator never sent a commit unless every participant had answered that
  checkpoint's prepare ready (checked on the wire, by the proxies);
- every participant is idle with admission open, or the trainer knows it left it closed
  (its release pending, rollout budgets held);
- every published snapshot verifies (``inspect_root``); it records exactly the rollouts
  dispatched and not consumed at its cut, each once (queued or in flight, never both), the
  step and the data loader's position; and its cut is one across participants (an episode
  continued at its last boundary has its session saved);
- the trainer's books: every dispatched rollout is queued, live or consumed, exactly once;
  a consumed rollout was consumed once, with a complete result and reward;
- attempt numbers only grow (the trainer's ledger; the Runs the agent received);
- the participants hold exactly the trainer's owned attempts and those a retire still
  owes; each rollout runs one execution per incarnation; after a restore each unfinished
  rollout continues as attempt N+1 (from its saved turn) or reruns (from its prompt),
  never both, and each participant holds exactly what its restore scope installed;
- each snapshot costs what its faults say: recoverable faults still publish, faults that
  spend every try of an operation fail the attempt transiently, never as an invariant.

Time on the participants is a fake clock (a lease runs out only when a rule moves it), and
so is the driver's; the trainer's budgets run on a third. The snapshot root lives on
``/dev/shm`` when there is one, so the many fsyncs of a snapshot cost nothing. The event
loop runs in a background thread for the whole test; every wait is bounded, and event
driven or a bounded poll.

``TURNPOINT_FAULT_SEQUENCES=N`` runs N sequences (default 200); ``CI=true`` derandomizes;
``TURNPOINT_FAULT_SEQUENCES_HOST`` moves the servers off 127.0.0.1 (for runs in parallel).
``--hypothesis-show-statistics`` lists which faults fired and what the snapshots did.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import shutil
import tempfile
import threading
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from tests.support.fakes import FakeAnchor, FakeClock, boundary_of, state_of
from tests.support.participants import METADATA, TOKEN
from tests.support.scripted import FAST, ScriptedAgent, ScriptedTools, poll, rid
from turnpoint._keepalive import LOCAL_SUBCHANNEL_POOL, control_channel, data_channel
from turnpoint.apps._inspect import inspect_root
from turnpoint.convert import episode_to_proto, struct_from_mapping
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import EpisodeContext, ParticipantRuntime, SnapshotStore
from turnpoint.participant_sdk.testing import FaultPoint, StoreFaults
from turnpoint.protocol import EpisodeState, Phase
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.trainer import (
    CoordinatorConfig,
    Rollout,
    RolloutClientSettings,
    RolloutOutcome,
    SnapshotOutcome,
    SnapshotReport,
)
from turnpoint.trainer.advanced import (
    AgentEndpoint,
    AnchorRef,
    Coordinator,
    RestorePlan,
    Restorer,
    RolloutClient,
    SnapshotDriver,
    SnapshotLayout,
    apply_plan,
    tree_digest,
)
from turnpoint.trainer.testing import PublishStep
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import resources_service_pb2 as rs_pb
from turnpoint.v1 import resources_service_pb2_grpc as rs_grpc
from turnpoint.v1 import rollout_service_pb2 as ro_pb
from turnpoint.v1 import types_pb2

T = TypeVar("T")

AGENT = "agent-0"
TOOLS = "tools-0"
MEMBERS = (AGENT, TOOLS)
ENVIRONMENT = "scripted"
TURNS = 3
TASK = {"turns": TURNS, "model": True}
# The agent's history of a complete rollout: turn 0, then one model reply per turn.
HISTORY = [0, *["guess"] * (TURNS - 1)]
# What the resources server's session expects, and the agent answers: a reward of 1.
TARGET = 3
MAX_LIVE = 4
# An incarnation of the job lives at least this many steps before one of its processes
# may die: restarts stay frequent enough to matter, and sequences build state in between.
SETTLING_STEPS = 4
# Budgets far beyond anything the participants' fake clocks reach; each rollout's differs,
# so that the give-up rule can run out exactly one of them.
BUDGET_S = 1000.0
# A safety bound on waits for things that must happen; never a synchronisation device.
BOUND_S = 20.0
# The agent's calls to a resources server wait while it is closed (spec 5.3 item 2),
# which may last several steps: until the trainer releases it or its lease runs out.
CLOSED_BOUND_S = 4 * BOUND_S
# Every server of the test listens here. Two long runs at once each take their own
# loopback address (127.0.0.2, ...): a port one run freed and the other reused then
# never carries one run's calls into the other.
HOST = os.environ.get("TURNPOINT_FAULT_SEQUENCES_HOST", "127.0.0.1")
PICK = st.integers(min_value=0, max_value=MAX_LIVE - 1)
MEMBER = st.sampled_from(MEMBERS)


def when(enabled: Callable[[Any], bool]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A rule that does nothing (a hypothesis event says so) unless ``enabled(machine)``.

    Not hypothesis's ``precondition``: what enables a rule here is what the real servers
    did (a turn that raced a snapshot, a result that came in), which differs between
    runs of the same choices. Preconditions that differ make hypothesis fail the run as a
    flaky strategy; a rule that is always drawn and skips itself keeps the draws the same.
    """

    def decorate(body: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(body)
        def guarded(self: Any, **arguments: Any) -> None:
            if enabled(self):
                body(self, **arguments)
            else:
                event(f"{body.__name__}: not enabled, skipped")

        return guarded

    return decorate


_CONTROL = "/turnpoint.v1.CheckpointControlService/ControlSession"
_RUN = "/turnpoint.v1.RolloutService/Run"
_ACK = "/turnpoint.v1.RolloutService/Acknowledge"
_SHM = Path("/dev/shm")


class SessionAgent(ScriptedAgent):
    """The scripted agent with a session on the resources server, used as docs/spec.md
    section 5.2 item 8 advises: boundary 1 is sealed at once, then each turn's model call
    first seeds the session (idempotent) and the episode's last call verifies it (which
    ends the session). Both are parked calls, so a checkpoint never waits on them."""

    environment = ENVIRONMENT

    def __init__(self, tools_address: str) -> None:
        super().__init__()
        # Its own subchannels, for the reason the proxy's upstream has them.
        self._channel = data_channel(tools_address, extra_options=[LOCAL_SUBCHANNEL_POOL])
        self._tools = rs_grpc.ResourcesServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(None)

    async def _call_model(self, episode: EpisodeId) -> str:
        await self._tools.SeedSession(
            rs_pb.SeedSessionRequest(
                request_id=rid("seed"),
                episode=episode_to_proto(episode),
                task=struct_from_mapping({"target": TARGET}),
            ),
            metadata=METADATA,
            timeout=CLOSED_BOUND_S,
        )
        return await super()._call_model(episode)

    async def _verify(self, episode: EpisodeId) -> float:
        response = await self._tools.Verify(
            rs_pb.VerifyRequest(
                request_id=rid("verify"),
                episode=episode_to_proto(episode),
                answer=struct_from_mapping({"guess": TARGET}),
            ),
            metadata=METADATA,
            timeout=CLOSED_BOUND_S,
        )
        return response.reward

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        result = await super().run(ctx, task)
        reward = await ctx.model_call(lambda: self._verify(ctx.episode))
        return {**result, "reward": reward}


class EnvTools(ScriptedTools):
    environment = ENVIRONMENT


class LoopThread:
    """One asyncio loop in a background thread; the machine submits coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(2 * CLOSED_BOUND_S)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(BOUND_S)
        self.loop.close()


# ------------------------------------------------------------------------ faults


@dataclass(frozen=True)
class Lose:
    """Lose the reply of the next ``count`` ``op`` calls to ``member`` (it acted)."""

    member: str
    op: str
    count: int = 1


@dataclass(frozen=True)
class FailWrite:
    """The next ``count`` records writes of ``member`` fail as a full disk would."""

    member: str
    count: int = 1


@dataclass(frozen=True)
class Drop:
    """The next ``count`` ``op`` requests never reach ``member``: the trainer's session
    breaks before the participant saw them (a partition, a call that timed out)."""

    member: str
    op: str
    count: int = 1


@dataclass(frozen=True)
class LeaseExpiry:
    """``member``'s lease runs out while the coordinator is silent, right before the
    first ``before`` call reaches it."""

    member: str
    before: str


Fault = Lose | Drop | FailWrite | LeaseExpiry
RestoreFault = Lose | Drop | LeaseExpiry

SNAPSHOT_FAULTS = st.one_of(
    st.builds(
        Lose,
        member=MEMBER,
        op=st.sampled_from(["prepare", "commit", "resume", "retire", "renew", "forget"]),
        count=st.integers(1, 2),
    ),
    st.builds(
        Drop,
        member=MEMBER,
        op=st.sampled_from(["prepare", "commit", "resume"]),
        count=st.integers(1, 2),
    ),
    st.builds(FailWrite, member=MEMBER, count=st.integers(1, 2)),
    st.builds(LeaseExpiry, member=MEMBER, before=st.sampled_from(["commit", "resume"])),
)
# A data-plane event racing the snapshot: it happens as the agent's prepare is on its way.
# "verify across the cut": the episode's last call, its verify, completes on the resources
# server (still open) after the agent has closed, so the agent holds its reply.
VERIFY_ACROSS_THE_CUT = "verify across the cut"
RACES = st.sampled_from(
    [None, "turn", "finish", "finish, result lost", "dispatch", VERIFY_ACROSS_THE_CUT]
)
RESTORE_FAULTS = st.one_of(
    st.none(),
    st.builds(
        Lose, member=MEMBER, op=st.sampled_from(["restore", "resume"]), count=st.integers(1, 2)
    ),
    st.builds(
        Drop, member=MEMBER, op=st.sampled_from(["restore", "resume"]), count=st.integers(1, 2)
    ),
    st.builds(LeaseExpiry, member=MEMBER, before=st.just("resume")),
)
# Where a coordinator dies: at rest, at the first request of an operation, or after a
# step of publication.
CRASH_POINTS = st.sampled_from(
    [
        "idle",
        "prepare",
        "commit",
        "resume",
        PublishStep.VERIFIED,
        PublishStep.MANIFEST_LINKED,
        PublishStep.LATEST_STAGED,
    ]
)


class SwitchableFaults:
    """A store fault hook whose armed :class:`StoreFaults` can be replaced (disarmed)."""

    def __init__(self) -> None:
        self.armed = StoreFaults()

    def hit(self, point: FaultPoint, path: Path) -> None:
        self.armed.hit(point, path)

    def disarm(self) -> None:
        self.armed = StoreFaults()


LEASE_EXPIRY = "lease expiry"


@dataclass(frozen=True)
class Hook:
    """What happens right before the first request of an operation reaches a participant:
    a ``"lease expiry"`` (a fault), a ``"race"`` (a data-plane event), a ``"crash"``."""

    what: str
    act: Callable[[], Awaitable[None]]


class CoordinatorCrash(Exception):
    """Raised inside the trainer where the test kills its coordinator."""


# ------------------------------------------------------------------------ the wire


class Tap:
    """What the proxies of one incarnation share: whether the trainer was cut off (its
    coordinator died), and what they saw on the wire."""

    def __init__(self) -> None:
        self.severed = False
        self.wakers: set[asyncio.Queue[Any]] = set()
        # member -> checkpoint ids it answered PHASE_PREPARED (replies lost included).
        self.ready: defaultdict[str, set[str]] = defaultdict(set)
        # rollout id -> attempts of the Runs the agent received, in order.
        self.runs: defaultdict[str, list[int]] = defaultdict(list)
        self.violations: list[str] = []
        # The test's own hooks that raised (a bug of the test, not of the protocol).
        self.errors: list[str] = []

    def sever(self) -> None:
        self.severed = True
        for queue in self.wakers:
            queue.put_nowait(_SEVERED)


_SEVERED = object()


@dataclass(frozen=True)
class _Headers:
    metadata: Any


@dataclass(frozen=True)
class _Broken:
    why: str


class Proxy(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Forwards every call to one participant, as bytes; faults are armed by the machine.

    ``lose[op]`` replies of a control operation (``"prepare"``, ``"commit"``, ...), of a
    Run's result (``"result"``) or of an acknowledgement (``"ack"``) are lost after the
    participant acted: the trainer's call breaks with UNAVAILABLE instead. ``drop[op]``
    requests never reach the participant (the call breaks the same way). ``before[op]``
    runs once, before the first request of ``op`` is forwarded (a lease running out, a
    race, a crash). ``sever_on`` cuts the trainer off from every participant at the first
    request of that operation, as a coordinator that died there. Requests and replies are
    recorded on the :class:`Tap`.
    """

    def __init__(self, member: str, upstream: str, tap: Tap, members: tuple[str, ...]) -> None:
        self.member = member
        self.tap = tap
        self._members = members
        # Its own subchannels and short reconnect backoff: through the global pool a new
        # example's proxy inherits the backoff of an earlier example's channel to the same
        # (reused) port, and its calls are refused for up to two minutes.
        self._upstream = control_channel(upstream)
        # No SO_REUSEPORT (grpc's default): a port-0 bind could then share a port with a
        # proxy of an earlier example still closing, and connections to it be refused.
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((self,))
        self.address = f"{HOST}:{self._server.add_insecure_port(f'{HOST}:0')}"
        self.lose: Counter[str] = Counter()
        self.lost: list[str] = []
        self.drop: Counter[str] = Counter()
        self.dropped: list[str] = []
        self.before: dict[str, Hook] = {}
        self.hooked: list[tuple[str, str]] = []
        self.sever_on: str | None = None

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(0)
        await self._upstream.close(None)

    def disarm(self) -> None:
        self.lose.clear()
        self.drop.clear()
        self.before.clear()
        self.sever_on = None

    def forget(self) -> None:
        """Forget what fired (after it was read)."""
        self.lost.clear()
        self.dropped.clear()
        self.hooked.clear()

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method

        async def forward(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for reply in self._forward(method, requests, context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(forward)

    async def _on_request(self, method: str, request: bytes, ops: dict[str, str]) -> str | None:
        """Look at one request before it goes upstream; a reason not to forward it, and
        to break the call, or None."""
        op: str | None = None
        if method == _CONTROL:
            envelope = pb.ControlSessionRequest.FromString(request)
            op = envelope.WhichOneof("operation")
            if op is not None:
                ops[envelope.request_id] = op
            if op == "commit":
                checkpoint_id = envelope.commit.checkpoint_id
                unready = [m for m in self._members if checkpoint_id not in self.tap.ready[m]]
                if unready:
                    self.tap.violations.append(
                        f"commit of {checkpoint_id} sent to {self.member} although "
                        f"{unready} never answered its prepare ready"
                    )
        elif method == _RUN:
            run = ro_pb.RunRequest.FromString(request)
            self.tap.runs[run.episode.rollout_id].append(run.episode.attempt)
        if op is not None and op == self.sever_on:
            self.tap.sever()
        if self.tap.severed:
            return "the trainer is gone"
        if op is None:
            return None
        if self.drop[op] > 0:
            self.drop[op] -= 1
            self.dropped.append(op)
            return "request lost by the proxy"
        hook = self.before.pop(op, None)
        if hook is not None:
            self.hooked.append((hook.what, op))
            try:
                await hook.act()
            except Exception as error:  # a test bug: the invariant reports it
                self.tap.errors.append(f"{hook.what} before {op} on {self.member}: {error!r}")
        return None

    def _on_reply(self, method: str, reply: bytes, ops: dict[str, str]) -> bool:
        """Look at one reply; True: lose it."""
        kind: str | None = None
        if method == _CONTROL:
            response = pb.ControlSessionResponse.FromString(reply)
            kind = ops.get(response.request_id) or response.WhichOneof("result")
            prepare = response.prepare
            # Ready: PREPARED, or COMMITTED by a prepare that committed saved-nothing
            # (spec 4.6 item 8).
            if (
                response.WhichOneof("result") == "prepare"
                and prepare.readiness.ready
                and (
                    prepare.phase == types_pb2.PHASE_PREPARED
                    or (prepare.committed_empty and prepare.phase == types_pb2.PHASE_COMMITTED)
                )
            ):
                self.tap.ready[self.member].add(prepare.checkpoint_id)
        elif method == _RUN:
            kind = ro_pb.RunResponse.FromString(reply).WhichOneof("event")
        elif method == _ACK:
            kind = "ack"
        if kind is None or self.lose[kind] <= 0:
            return False
        self.lose[kind] -= 1
        self.lost.append(kind)
        return True

    async def _forward(
        self, method: str, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        if self.tap.severed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the trainer is gone")
            return
        metadata = tuple(
            (m.key, m.value) for m in context.invocation_metadata() if m.key == "authorization"
        )
        call = self._upstream.stream_stream(
            method, request_serializer=None, response_deserializer=None
        )(None, metadata=metadata)
        replies: asyncio.Queue[Any] = asyncio.Queue()
        ops: dict[str, str] = {}
        self.tap.wakers.add(replies)

        async def send() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                async for request in requests:
                    broken = await self._on_request(method, request, ops)
                    if broken is not None:
                        replies.put_nowait(_Broken(broken))
                        return
                    await call.write(request)
                await call.done_writing()

        async def receive() -> None:
            try:
                replies.put_nowait(_Headers(await call.initial_metadata()))
                async for reply in call:
                    replies.put_nowait(reply)
                replies.put_nowait(None)
            except grpc.aio.AioRpcError as error:
                replies.put_nowait(error)

        sender = asyncio.create_task(send())
        receiver = asyncio.create_task(receive())
        try:
            while (reply := await replies.get()) is not None:
                if isinstance(reply, _Headers):
                    if reply.metadata:
                        await context.send_initial_metadata(tuple(reply.metadata))
                    continue
                if reply is _SEVERED or self.tap.severed:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the trainer is gone")
                    return
                if isinstance(reply, _Broken):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, reply.why)
                    return
                if isinstance(reply, grpc.aio.AioRpcError):
                    await context.abort(
                        reply.code(), reply.details() or "", reply.trailing_metadata() or ()
                    )
                    return
                if self._on_reply(method, reply, ops):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "reply lost by the proxy")
                    return
                yield reply
        finally:
            self.tap.wakers.discard(replies)
            sender.cancel()
            receiver.cancel()
            call.cancel()


# ------------------------------------------------------------------------ the fleet


@dataclass
class Member:
    """One participant process: its runtime served on a port, its clock, its faults."""

    name: str
    hosted: HostedParticipant
    proxy: Proxy
    clock: FakeClock
    faults: SwitchableFaults
    stopping: asyncio.Task[None] | None = None

    @property
    def runtime(self) -> ParticipantRuntime:
        return self.hosted.runtime

    async def crash(self) -> None:
        """The process dies: its server and runtime stop, whatever cancels the caller
        (a crash from inside a proxied call may be cancelled with that call)."""
        if self.stopping is None:
            self.stopping = asyncio.ensure_future(self.hosted.stop(0))
        await asyncio.shield(self.stopping)


@dataclass
class Fleet:
    """One incarnation of the participants, each behind its proxy."""

    agent: SessionAgent
    tools: EnvTools
    members: dict[str, Member]
    tap: Tap

    @classmethod
    async def start(cls, root: Path) -> Fleet:
        tap, tools = Tap(), EnvTools()
        members: dict[str, Member] = {}
        # The resources server first: the agent talks to it directly, not through the
        # proxy, since a trainer that dies does not cut its participants apart.
        for name in (TOOLS, AGENT):
            clock, faults = FakeClock(), SwitchableFaults()
            if name == TOOLS:
                kinds: dict[str, Any] = {"resources": tools}
            else:
                agent = SessionAgent(members[TOOLS].hosted.address)
                kinds = {"agent": agent}
            runtime = ParticipantRuntime(
                name, SnapshotStore(root, faults=faults), config=FAST, clock=clock, **kinds
            )
            hosted = await host_participant(
                runtime, ServerOptions(host=HOST, port=0, token=TOKEN)
            ).start()
            proxy = Proxy(name, hosted.address, tap, MEMBERS)
            await proxy.start()
            members[name] = Member(name, hosted, proxy, clock, faults)
        return cls(agent, tools, members, tap)

    def __getitem__(self, name: str) -> Member:
        return self.members[name]

    def disarm(self) -> None:
        for member in self.members.values():
            member.proxy.disarm()
            member.faults.disarm()

    async def stop(self) -> None:
        self.tap.sever()
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self.agent.close)
            for member in self.members.values():
                stack.push_async_callback(member.crash)
            for member in self.members.values():
                stack.push_async_callback(member.proxy.stop)


# ------------------------------------------------------------------------ the trainer


def config_for(root: Path) -> CoordinatorConfig:
    return CoordinatorConfig(
        snapshot_root=root, control_timeout_s=5.0, resume_retry_pause_s=0, keep_snapshots=2
    )


def read_anchor(snapshot: Path, anchor: AnchorRef) -> int:
    """The trainer's anchor loader for :class:`FakeAnchor`'s one file."""
    directory = snapshot / anchor.path
    assert tree_digest(directory) == anchor.sha256
    return int((directory / "state.bin").read_text().removeprefix("step "))


@dataclass
class Trainer:
    """One incarnation of the trainer: coordinator, rollout client, snapshot driver."""

    coordinator: Coordinator
    client: RolloutClient
    driver: SnapshotDriver
    layout: SnapshotLayout
    anchor: FakeAnchor
    clock: FakeClock  # the rollout budgets'
    driver_clock: FakeClock
    config: CoordinatorConfig
    crash_after: PublishStep | None = None

    @classmethod
    async def start(cls, fleet: Fleet, root: Path, epoch: int) -> Trainer:
        config = config_for(root)
        control = {name: member.proxy.address for name, member in fleet.members.items()}
        coordinator = Coordinator(
            control, token=TOKEN, coordinator_id="coord-faults", epoch=epoch, config=config
        )
        await coordinator.discover()
        clock = FakeClock()
        client = RolloutClient(
            {AGENT: AgentEndpoint(fleet[AGENT].proxy.address, TOKEN)},
            settings=RolloutClientSettings(
                retry_backoff_s=0.0, admission_backoff_s=0.01, budget_grace_s=0.0
            ),
            clock=clock,
            fence=coordinator.fence,
        )
        await client.start()
        trainer: Trainer
        anchor = FakeAnchor()

        def after_step(step: PublishStep) -> None:
            # Runs in the publishing thread: the coordinator dies here.
            if step is trainer.crash_after:
                fleet.tap.severed = True
                raise CoordinatorCrash(step.value)

        layout = SnapshotLayout(root, after_step=after_step)
        # The driver's clock tells when a participant whose resume failed has surely
        # reopened by its lease: it moves with the participants' clocks.
        driver_clock = FakeClock()
        driver = SnapshotDriver(
            coordinator=coordinator,
            rollouts=client,
            anchor=anchor,
            layout=layout,
            config=config,
            epoch=epoch,
            clock=driver_clock,
        )
        trainer = cls(coordinator, client, driver, layout, anchor, clock, driver_clock, config)
        return trainer

    def restorer(self) -> Restorer:
        return Restorer(self.coordinator, self.layout, self.config, load_anchor=read_anchor)

    async def close(self) -> None:
        try:
            await self.client.aclose()
        finally:
            await self.coordinator.close()


# ------------------------------------------------------------------------ the model


@dataclass
class Books:
    """What the training loop knows: the rollouts it dispatched and consumed, the data
    loader's position, the training step and the highest attempt of each rollout."""

    next_rollout: int = 0
    dispatched: set[str] = field(default_factory=set)
    consumed: set[str] = field(default_factory=set)
    given_up: set[str] = field(default_factory=set)
    step: int = 1
    attempts: dict[str, int] = field(default_factory=dict)

    def copy(self) -> Books:
        return Books(
            self.next_rollout,
            set(self.dispatched),
            set(self.consumed),
            set(self.given_up),
            self.step,
            dict(self.attempts),
        )


@dataclass
class Fired:
    """The faults that fired during one operation, per participant."""

    lost: dict[str, Counter[str]]
    dropped: dict[str, Counter[str]]
    hooked: dict[str, list[tuple[str, str]]]
    failed_writes: dict[str, int]

    def besides(self, op: str) -> bool:
        """Whether anything fired other than the faults of operation ``op``."""
        faults = (self.lost, self.dropped)
        other = any(n for each in faults for c in each.values() for o, n in c.items() if o != op)
        hooked = any(
            what == LEASE_EXPIRY and on != op
            for hooks in self.hooked.values()
            for what, on in hooks
        )
        return other or hooked or any(self.failed_writes.values())


def held_by(runtime: ParticipantRuntime) -> dict[EpisodeId, EpisodeState]:
    return {entry.key.episode: entry.state for entry in runtime.core.entries()}


def entries_of(runtime: ParticipantRuntime) -> dict[str, str]:
    """Each entry's state and boundary, for messages."""
    return {
        f"{entry.key.episode}/{entry.key.slot}": f"{entry.state.name}@{entry.boundary_index}"
        for entry in runtime.core.entries()
    }


def ids_of(items: Any) -> list[str]:
    return [str(item["rollout_id"]) for item in items]


def saved_episode(item: Mapping[str, Any]) -> EpisodeId:
    """The attempt an unfinished rollout of a snapshot's rollout state was at."""
    rollout_id, attempt = item["rollout_id"], item["attempt"]
    assert isinstance(rollout_id, str) and isinstance(attempt, int), item
    return EpisodeId(rollout_id, attempt)


class FaultSequences(RuleBasedStateMachine):
    """Each rule runs its body on the loop thread (:meth:`run`): the rollout client, the
    participants and the agent are asyncio objects and are only touched from there."""

    loop: LoopThread  # set by the test

    def __init__(self) -> None:
        super().__init__()
        base = _SHM if _SHM.is_dir() else None
        self.tmp = Path(tempfile.mkdtemp(prefix="turnpoint-faults-", dir=base))
        self.root = self.tmp / "snapshots"
        self.epoch = 1
        self.books = Books()
        # checkpoint id -> the books at its cut (what a restore of it must give back).
        self.cuts: dict[str, Books] = {}
        self.retry_of: str | None = None
        self.violations: list[str] = []
        # Since the last restore: rollout id -> the attempt it continues as / reruns as.
        self.continued: dict[str, EpisodeId] = {}
        self.reran: dict[str, EpisodeId] = {}
        # What the data plane holds, as the last check saw it (for preconditions, which
        # run on hypothesis's thread and must not touch the loop's objects).
        self.live = self.owned = self.queued = 0
        self.closed: list[str] = []  # participants whose admission is closed
        self.steps = 0  # since the incarnation started
        self.notes: list[str] = []
        try:
            self.fleet, self.trainer = self.run(self._start_incarnation())
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(coroutine)

    def step(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run one rule's body on the loop; what it noted becomes hypothesis events
        (``--hypothesis-show-statistics`` shows which faults fired and what they cost)."""
        try:
            self.run(coroutine)
        finally:
            notes, self.notes = self.notes, []
            for note in notes:
                event(note)

    @property
    def client(self) -> RolloutClient:
        return self.trainer.client

    async def _start_incarnation(self) -> tuple[Fleet, Trainer]:
        fleet = await Fleet.start(self.root)
        trainer = await Trainer.start(fleet, self.root, self.epoch)
        trainer.client.set_data_loader({"next": 0})
        return fleet, trainer

    async def _stop_incarnation(self) -> None:
        # Nothing of the dead incarnation reaches anyone any more, then it goes.
        self.fleet.tap.sever()
        try:
            await self.trainer.close()
        finally:
            await self.fleet.stop()

    def _agent_unreleased(self) -> bool:
        return any(AGENT in members for members in self.trainer.driver.unreleased.values())

    async def _settle(self) -> None:
        """Wait until the data plane is quiet: every Run has its verdict, every owned
        attempt waits for its model at the boundary the trainer saw last, every result
        is acknowledged."""
        client = self.client
        agent, tools = self.fleet[AGENT].runtime, self.fleet[TOOLS].runtime
        # A participant left closed (its resume never arrived) holds its work parked and
        # its requests waiting until it is released or its lease runs out.
        agent_closed = not agent.core.admission_open
        tools_closed = not tools.core.admission_open
        gate_closed = agent_closed or self._agent_unreleased()
        seeded = {EpisodeState.IDLE, EpisodeState.RESTORED}
        parked = {EpisodeState.AWAITING_MODEL, EpisodeState.PARKED, EpisodeState.RESTORED}

        def quiet() -> bool:
            if client.waiting() and not gate_closed:
                return False
            core = agent.core
            for rollout in client.in_flight():
                episode = rollout.episode
                state, boundary = state_of(core, episode), boundary_of(core, episode)
                if agent_closed:
                    if state not in parked or boundary != rollout.boundaries_seen:
                        return False
                elif tools_closed:
                    # Its seed or its verify waits for the resources server.
                    if state is not EpisodeState.AWAITING_MODEL:
                        return False
                    if boundary != rollout.boundaries_seen:
                        return False
                # At its last boundary an episode is verifying: about to finish.
                elif not (
                    state is EpisodeState.AWAITING_MODEL
                    and boundary == rollout.boundaries_seen < TURNS
                ):
                    return False
                # Its session exists from its first model call until its verify.
                session = state_of(tools.core, episode, "session")
                if not tools_closed and boundary < TURNS and session not in seeded:
                    return False
            # A completion whose acknowledgement failed every try is owed: the drain
            # below re-sends it (spec 6.4 item 2), so it does not keep the plane busy.
            # Nor does one given up as it completed: its attempt waits for the next
            # snapshot's retire (spec 7.4 step 3).
            owed = client.unacknowledged() | {
                episode for episodes in client.pending_retires().values() for episode in episodes
            }
            return all(
                e.state is not EpisodeState.COMPLETED_UNACKED or e.key.episode in owed
                for e in core.entries()
            )

        try:
            await poll(quiet, BOUND_S)
        except TimeoutError:
            raise AssertionError(
                f"never quiet: in flight {client.in_flight()}, waiting {client.waiting()}, "
                f"owed {sorted(client.unacknowledged())}, to retire "
                f"{dict(client.pending_retires())}; the agent ({agent.core.phase.name}) "
                f"holds {entries_of(agent)}, the tools ({tools.core.phase.name}) "
                f"{entries_of(tools)}; unreleased {dict(self.trainer.driver.unreleased)}"
            ) from None
        await client.drain_acknowledgements(BOUND_S)

    # ------------------------------------------------------------------ data plane

    @initialize(count=st.integers(0, MAX_LIVE))
    def some_rollouts_run(self, count: int) -> None:
        async def body() -> None:
            for _ in range(count):
                self._new_rollout()
            await self._settle()

        self.step(body())

    @rule()
    @when(lambda self: self.live < MAX_LIVE)
    def dispatch(self) -> None:
        self.step(self._dispatch())

    async def _dispatch(self) -> None:
        self._new_rollout()
        await self._settle()

    def _new_rollout(self) -> None:
        number = self.books.next_rollout
        rollout_id = f"r{number}"
        self.client.dispatch(
            Rollout(
                rollout_id=rollout_id,
                prompt_group_id=f"g{number}",
                sibling_index=0,
                group_size=1,
                environment=ENVIRONMENT,
                task=TASK,
                instance=AGENT,
                budget_s=BUDGET_S + number,
            )
        )
        self.books.next_rollout += 1
        self.books.dispatched.add(rollout_id)
        self.client.set_data_loader({"next": self.books.next_rollout})

    async def _reply(self, episode: EpisodeId, replies: int) -> None:
        """Answer the model calls of ``episode``: one reply, one turn (the last ends it)."""
        client = self.client
        before = next(r.boundaries_seen for r in client.in_flight() if r.episode == episode)
        for _ in range(replies):
            self.fleet.agent.reply(episode, "guess")

        def moved() -> bool:
            return all(
                r.episode != episode or r.boundaries_seen >= before + replies
                for r in client.in_flight()
            )

        await client.wait_for(moved, BOUND_S)
        await self._settle()

    @rule(index=PICK)
    @when(lambda self: self.owned > 0 and not self.closed)
    def take_a_turn(self, index: int) -> None:
        async def body() -> None:
            owned = self.client.in_flight()
            if owned:
                await self._reply(owned[index % len(owned)].episode, 1)

        self.step(body())

    @rule(index=PICK, lose=st.sampled_from([None, "result", "ack"]))
    @when(lambda self: self.owned > 0 and not self.closed)
    def finish(self, index: int, lose: str | None) -> None:
        """Run a rollout to its end, sometimes losing its result or its acknowledgement
        on the way: it is recorded once all the same."""
        self.step(self._finish(index, lose))

    async def _finish(self, index: int, lose: str | None) -> None:
        owned = self.client.in_flight()
        if not owned:
            return
        rollout = owned[index % len(owned)]
        proxy = self.fleet[AGENT].proxy
        if lose is not None:
            proxy.lose[lose] = 1
        try:
            await self._reply(rollout.episode, TURNS - rollout.boundaries_seen)
        finally:
            lost, proxy.lost = proxy.lost, []
            proxy.disarm()
        results = [r for r in self.client.results() if r.rollout_id == rollout.episode.rollout_id]
        assert [r.episode for r in results] == [rollout.episode], results
        assert results[0].outcome is RolloutOutcome.COMPLETED, results
        assert lost == ([] if lose is None else [lose]), lost

    @rule()
    @when(lambda self: self.owned > 0)
    def a_budget_runs_out(self) -> None:
        """The trainer's clock passes the smallest remaining budget: that rollout is
        given up (its Run cancelled, its attempt queued for retire)."""
        self.step(self._give_up())

    async def _give_up(self) -> None:
        client = self.client
        owned = client.in_flight()
        if not owned:
            return
        remaining = {r.episode: client.remaining_budget(r.episode) for r in owned}
        assert None not in remaining.values(), remaining  # every rollout has a budget
        least = min(b for b in remaining.values() if b is not None)
        self.trainer.clock.advance(least + 0.001)
        expired = client.expire_due()
        if client.deadlines_held:
            # A participant whose resume failed may still hold episodes parked: budgets
            # stay held until it is known resumed (spec 7.4 step 8).
            assert expired == [], expired
            held = {e: client.remaining_budget(e) for e in remaining}
            assert held == pytest.approx(remaining), (held, remaining)  # (float clock sums)
            self.notes.append("budget held")
            return
        assert set(expired) == {e for e, b in remaining.items() if b == least}, expired
        self.books.given_up.update(e.rollout_id for e in expired)
        await self._settle()

    @rule()
    @when(lambda self: bool(self.closed))
    def leases_run_out(self) -> None:
        """Time passes with the coordinator silent: every participant still closed
        reopens itself when its lease runs out (spec 4.2 item 3)."""
        self.step(self._leases_run_out())

    async def _leases_run_out(self) -> None:
        lease_s = self.trainer.config.lease_s
        self.trainer.driver_clock.advance(lease_s + 1)
        for name in self.closed:
            member = self.fleet[name]
            member.clock.advance(lease_s + 1)
            assert await member.runtime.check_lease() is not None, name
            assert member.runtime.core.admission_open, name
        await self._settle()

    @rule(count=st.integers(1, 3))
    @when(lambda self: self.queued > 0)
    def train_on_results(self, count: int) -> None:
        """The training loop consumes results and takes one optimizer step."""
        self.step(self._train(count))

    async def _train(self, count: int) -> None:
        books, taken = self.books, 0
        while taken < count and self.client.results():
            result = await self.client.next_result(0)
            rollout_id = result.rollout_id
            assert rollout_id in books.dispatched, result
            assert rollout_id not in books.consumed, f"{rollout_id} consumed twice"
            if rollout_id in books.given_up:
                assert result.outcome is RolloutOutcome.GIVEN_UP, result
            else:
                assert result.outcome is RolloutOutcome.COMPLETED, result
                assert result.output["history"] == HISTORY, result
                assert result.output["reward"] == 1.0, result
                assert result.turns == TURNS, result
                expected = self.continued.get(rollout_id) or self.reran.get(rollout_id)
                assert expected is None or result.episode == expected, (result, expected)
            books.consumed.add(rollout_id)
            taken += 1
        if taken:
            self.trainer.anchor.step += 1
            books.step = self.trainer.anchor.step

    # ------------------------------------------------------------------ snapshots

    def _arm(self, faults: list[Fault]) -> None:
        lease_s = self.trainer.config.lease_s
        for fault in faults:
            member = self.fleet[fault.member]
            if isinstance(fault, Lose):
                member.proxy.lose[fault.op] += fault.count
            elif isinstance(fault, Drop):
                member.proxy.drop[fault.op] += fault.count
            elif isinstance(fault, FailWrite):
                member.faults.armed.fail_writes(fault.count)
            else:
                member.proxy.before[fault.before] = Hook(LEASE_EXPIRY, _expiry(member, lease_s))

    async def _take(self) -> SnapshotReport:
        report = await self.trainer.driver.take(self.retry_of)
        self.retry_of = report.checkpoint_id if report.outcome is SnapshotOutcome.FAILED else None
        return report

    @rule(faults=st.lists(SNAPSHOT_FAULTS, max_size=2), race=RACES, index=PICK)
    def snapshot(self, faults: list[Fault], race: str | None, index: int) -> None:
        """Take a snapshot with faults injected; it costs what they say. ``race`` is a
        data-plane event that happens just as the agent's prepare is on its way."""
        self.step(self._snapshot(faults, race, index))

    def _race(self, race: str, index: int) -> None:
        """Arm ``race``: it happens as the agent's prepare is on its way to the agent."""
        fleet = self.fleet
        target: list[EpisodeId] = []
        acted = asyncio.Event()

        async def act() -> None:
            try:
                await race_at_the_agent()
            finally:
                acted.set()

        async def race_at_the_agent() -> None:
            self.notes.append(f"race: {race}")
            owned = self.client.in_flight()
            if race == "dispatch":
                self._new_rollout()
                return
            if not owned:
                return
            rollout = owned[index % len(owned)]
            replies = 1 if race == "turn" else TURNS - rollout.boundaries_seen
            if race == "finish, result lost":
                fleet[AGENT].proxy.lose["result"] += 1
            if race == VERIFY_ACROSS_THE_CUT and not self.closed:
                # The verify is held at the resources server until the agent has closed.
                target.append(rollout.episode)
                fleet.tools.hold("verify")
                fleet.tools.entered["verify"].clear()
            for _ in range(replies):
                fleet.agent.reply(rollout.episode, "guess")
            if target:
                await poll(fleet.tools.entered["verify"].is_set, BOUND_S)
                self.notes.append("race: the verify is held")

        async def verify_across_the_cut() -> None:
            # The resources server, still open, answers the verify only once the agent
            # has closed: the session is sealed there, and the agent holds the reply.
            agent, tools = fleet[AGENT].runtime.core, fleet[TOOLS].runtime
            with contextlib.suppress(TimeoutError):  # (a fault kept the agent's prepare)
                async with asyncio.timeout(BOUND_S):
                    await acted.wait()
                await poll(lambda: not agent.admission_open, BOUND_S)
            if not target:
                return
            if (gate := fleet.tools.gates.pop("verify", None)) is not None:
                gate.set()
            # The verify done, its session is sealed (kept, no request in flight) and
            # belongs to the resources server's cut (spec 5.3 item 3).
            with contextlib.suppress(TimeoutError):
                await poll(
                    lambda: state_of(tools.core, target[0], "session") in (None, EpisodeState.IDLE),
                    BOUND_S,
                )

        fleet[AGENT].proxy.before["prepare"] = Hook("race", act)
        if race == VERIFY_ACROSS_THE_CUT:
            fleet[TOOLS].proxy.before["prepare"] = Hook("race", verify_across_the_cut)

    async def _snapshot(self, faults: list[Fault], race: str | None, index: int) -> None:
        fleet, layout = self.fleet, self.trainer.layout
        published = layout.list_published()
        writes = {name: m.faults.armed for name, m in fleet.members.items()}
        self._arm(faults)
        if race is not None:
            self._race(race, index)
        # A restore left a participant closed: the attempt's first resumes release it,
        # and it fails before it prepares if they do not get through (spec 7.7 item 9).
        restore_held = any(k.startswith("restore-") for k in self.trainer.driver.unreleased)
        try:
            report = await self._take()
        finally:
            if (gate := fleet.tools.gates.pop("verify", None)) is not None:
                gate.set()  # the race's verify never waits past its snapshot
            fired = self._fired(faults, writes)
            lose_result = fleet[AGENT].proxy.lose["result"]
            fleet.disarm()
            # A result lost in the race is lost whenever the Run delivers it.
            fleet[AGENT].proxy.lose["result"] = lose_result
        # The cut includes what the race did (the books are read after prepare).
        cut = self.books.copy()
        self._note(report)
        lost, dropped, failed_writes = fired.lost, fired.dropped, fired.failed_writes
        assert report.reason is None or report.transient, report
        # What spends every try of one operation on one participant (spec 7.3, 7.4):
        # commit and retire are tried twice (a lost reply and a failed write of the same
        # try count once); a prepare whose session breaks is sent again on a new session
        # up to twice. A lease that ran out before the commit makes the participant
        # refuse it as finished (superseded). A lost renew reply breaks the session the
        # commit may be on at that moment: it may cost one commit try.
        commit = {
            n: dropped[n]["commit"] + max(lost[n]["commit"], failed_writes[n]) for n in MEMBERS
        }
        must_fail = any(
            commit[n] >= 2
            or lost[n]["retire"] >= 2
            or lost[n]["prepare"] + dropped[n]["prepare"] >= 3
            for n in MEMBERS
        ) or any((LEASE_EXPIRY, "commit") in hooks for hooks in fired.hooked.values())
        may_fail = must_fail or any(commit[n] + lost[n]["renew"] >= 2 for n in MEMBERS)
        may_fail = may_fail or (
            restore_held and any(lost[n]["resume"] + dropped[n]["resume"] >= 2 for n in MEMBERS)
        )
        detail = (report, faults, fired)
        if must_fail:
            assert report.outcome is SnapshotOutcome.FAILED, detail
        elif report.outcome is SnapshotOutcome.SKIPPED:
            # Even a skipped attempt first re-sends the resumes that failed earlier.
            assert not fired.besides("resume"), detail
        elif not may_fail:
            assert report.outcome is SnapshotOutcome.PUBLISHED, detail
        if report.outcome is SnapshotOutcome.PUBLISHED:
            # A resume whose every try failed leaves that participant unreleased until
            # the next attempt (spec 7.4 step 8); one failed try is retried. (What was
            # lost may also have been the release of an earlier id.)
            twice = {n for n in MEMBERS if lost[n]["resume"] + dropped[n]["resume"] >= 2}
            assert report.unreleased <= twice, detail
            self._published(report.checkpoint_id, cut)
        else:
            assert layout.list_published() == published, detail
        await self._settle()
        fleet[AGENT].proxy.lose["result"] = 0
        fleet[AGENT].proxy.forget()

    def _fired(self, faults: list[Fault], writes: dict[str, StoreFaults]) -> Fired:
        """What of ``faults`` actually fired, per participant; noted as events."""
        armed_writes: Counter[str] = Counter()
        for fault in faults:
            if isinstance(fault, FailWrite):
                armed_writes[fault.member] += fault.count
        fired = Fired(
            lost={n: Counter(m.proxy.lost) for n, m in self.fleet.members.items()},
            dropped={n: Counter(m.proxy.dropped) for n, m in self.fleet.members.items()},
            hooked={n: list(m.proxy.hooked) for n, m in self.fleet.members.items()},
            failed_writes={
                n: min(writes[n].hits(FaultPoint.RECORDS_WRITE), armed_writes[n]) for n in MEMBERS
            },
        )
        for member in self.fleet.members.values():
            member.proxy.forget()
        for name in MEMBERS:
            fired.lost[name].pop("result", None)
            self.notes += [f"fired: lose {op} x{n}" for op, n in fired.lost[name].items()]
            self.notes += [f"fired: drop {op} x{n}" for op, n in fired.dropped[name].items()]
            hooks = [(what, op) for what, op in fired.hooked[name] if what != "race"]
            self.notes += [f"fired: {what} before {op}" for what, op in hooks]
            if fired.failed_writes[name]:
                self.notes.append(f"fired: failed write x{fired.failed_writes[name]}")
        return fired

    def _note(self, report: SnapshotReport) -> None:
        reason = f" ({report.reason.value})" if report.reason is not None else ""
        self.notes.append(f"snapshot {report.outcome.value}{reason}")

    def _published(self, checkpoint_id: str, cut: Books) -> None:
        """A snapshot was published at ``cut``: it records exactly those books."""
        layout = self.trainer.layout
        assert layout.list_published()[0] == checkpoint_id
        manifest = layout.load(checkpoint_id)
        state = manifest.rollout_state
        queued, in_flight = ids_of(state.queue), ids_of(state.in_flight)
        assert len(set(queued)) == len(queued) and len(set(in_flight)) == len(in_flight)
        assert not set(queued) & set(in_flight), (queued, in_flight)
        unfinished = cut.dispatched - cut.consumed
        assert set(queued) | set(in_flight) == unfinished, (queued, in_flight, cut)
        assert state.data_loader == {"next": cut.next_rollout}, state.data_loader
        assert manifest.step == cut.step, (manifest.step, cut)
        saved = {saved_episode(item) for item in state.in_flight}
        for placed in (*manifest.continued, *manifest.restarts):
            assert placed.episode in saved, (placed, saved)
        self.cuts[checkpoint_id] = cut
        # The cut is one across participants: an episode it continues at its last
        # boundary still owes its verify, so the resources server must have saved its
        # session; else a restore of this snapshot fails a rollout that had finished.
        last = {saved_episode(item) for item in state.in_flight if item["boundaries_seen"] == TURNS}
        exported = {e.instance: set(e.exported) for e in manifest.participants}
        owing = {p.episode for p in manifest.continued} & last
        assert owing <= exported[TOOLS], (
            f"{checkpoint_id} continues {sorted(map(str, owing))} at the last boundary, "
            f"verify still owed, but {TOOLS} saved no session for "
            f"{sorted(map(str, owing - exported[TOOLS]))}: restored, it fails (NOT_FOUND)"
        )

    # ------------------------------------------------------------------ incarnations

    @rule(member=MEMBER, during=st.booleans(), restore_fault=RESTORE_FAULTS)
    @when(lambda self: self.steps >= SETTLING_STEPS)
    def a_participant_crashes(
        self, member: str, during: bool, restore_fault: RestoreFault | None
    ) -> None:
        """A participant dies, at rest or in the middle of a commit; the trainer's next
        snapshot fails and keeps the previous one; the job restarts (spec 7.11)."""
        self.step(self._participant_crashes(member, during, restore_fault))

    async def _participant_crashes(
        self, member: str, during: bool, restore_fault: RestoreFault | None
    ) -> None:
        crashed = self.fleet[member]
        published = self.trainer.layout.list_published()
        if during:
            crashed.proxy.before["commit"] = Hook("crash", crashed.crash)
        else:
            await crashed.crash()
        report = await self._take()
        self._note(report)
        if during and ("crash", "commit") not in crashed.proxy.hooked:
            # It held nothing and committed in its prepare (spec 4.6 item 8): there was
            # no commit to die in, and the snapshot stands. It dies now, at rest.
            crashed.proxy.before.pop("commit", None)
            self.notes.append(f"{member} committed in its prepare; crashed after the snapshot")
            if report.outcome is SnapshotOutcome.PUBLISHED:
                self._published(report.checkpoint_id, self.books.copy())
                published = self.trainer.layout.list_published()
            await crashed.crash()
            report = await self._take()
            self._note(report)
        assert report.outcome is not SnapshotOutcome.PUBLISHED, report
        assert report.reason is None or report.transient, report
        assert self.trainer.layout.list_published() == published
        await self._restart(restore_fault)

    @rule(at=CRASH_POINTS, restore_fault=RESTORE_FAULTS)
    @when(lambda self: self.steps >= SETTLING_STEPS)
    def the_coordinator_crashes(
        self, at: str | PublishStep, restore_fault: RestoreFault | None
    ) -> None:
        """The trainer dies (at rest, or at a point of a snapshot); the job restarts."""
        self.step(self._coordinator_crashes(at, restore_fault))

    async def _coordinator_crashes(
        self, at: str | PublishStep, restore_fault: RestoreFault | None
    ) -> None:
        if at != "idle":
            cut = self.books.copy()
            if isinstance(at, PublishStep):
                self.trainer.crash_after = at
            else:
                for member in self.fleet.members.values():
                    member.proxy.sever_on = at
            with contextlib.suppress(CoordinatorCrash):
                await self._take()
            attempt = self.trainer.driver.attempt
            if attempt is not None and self.trainer.layout.is_published(attempt.checkpoint_id):
                self._published(attempt.checkpoint_id, cut)
        await self._restart(restore_fault)

    async def _restart(self, restore_fault: RestoreFault | None) -> None:
        """docs/spec.md section 7.11: every participant and the trainer start afresh, the
        coordinator one epoch on, and the newest published snapshot is restored."""
        self.violations += self.fleet.tap.violations
        await self._stop_incarnation()
        self.epoch += 1
        self.retry_of = None
        self.steps = 0
        self.fleet, self.trainer = await self._start_incarnation()
        faults: list[Fault] = [] if restore_fault is None else [restore_fault]
        writes = {name: m.faults.armed for name, m in self.fleet.members.items()}
        self._arm(faults)
        try:
            plan = await self.trainer.restorer().restore()
        finally:
            fired = self._fired(faults, writes)
            self.fleet.disarm()
        # A restore is tried twice (spec 7.3 item 3); when every try failed somewhere, its
        # outcome is uncertain everywhere and every continuation reruns (spec 7.7 item 7).
        failed = any(fired.lost[n]["restore"] + fired.dropped[n]["restore"] >= 2 for n in MEMBERS)
        self._restored(plan, restore_failed=failed)
        if plan is not None:
            self.notes.append(
                f"restore: {len(plan.redispatch)} continued, {len(plan.rerun)} rerun"
                + (", restore failed" if plan.restore_failed else "")
            )
        await self._settle()

    def _restored(self, plan: RestorePlan | None, *, restore_failed: bool) -> None:
        published = self.trainer.layout.list_published()
        client = self.client
        self.continued, self.reran = {}, {}
        if not published:
            assert plan is None
            self.books = Books()
            client.set_data_loader({"next": 0})
            return
        assert plan is not None and plan.checkpoint_id == published[0], (plan, published)
        assert plan.restore_failed == restore_failed, plan
        cut = self.cuts[plan.checkpoint_id]
        saved = {e.rollout_id: e.attempt for e in map(saved_episode, plan.trainer_state.in_flight)}
        continued = {a.rollout.episode.rollout_id: a.episode for a in plan.redispatch}
        reran = {r.rollout.episode.rollout_id: r.episode for r in plan.rerun}
        # Each unfinished rollout continues as N+1 or reruns from its prompt, never both.
        assert not set(continued) & set(reran), (continued, reran)
        assert set(continued) | set(reran) == set(saved), (continued, reran, saved)
        for rollout_id, episode in continued.items():
            assert episode.attempt == saved[rollout_id] + 1, (episode, saved)
        for rollout_id, episode in reran.items():
            assert episode.attempt >= saved[rollout_id] + 1, (episode, saved)
        # Each participant holds the N+1 of what its scope restored, and nothing else; the
        # agent's scope is exactly the continued rollouts.
        scope = plan.restore_scope
        assert {e.next_attempt() for e in scope.get(AGENT, ())} == set(continued.values())
        for name in MEMBERS:
            held = held_by(self.fleet[name].runtime)
            restored = {e.next_attempt(): EpisodeState.RESTORED for e in scope.get(name, ())}
            if plan.restore_failed:
                restored = {}
            assert held == restored, (name, held, restored)
        apply_plan(plan, client)
        self.trainer.driver.adopt_restore(plan)
        self.trainer.anchor.step = plan.step
        assert plan.step == cut.step, (plan.step, cut)
        assert client.data_loader == {"next": cut.next_rollout}, client.data_loader
        self.books = cut.copy()
        self.continued, self.reran = continued, reran
        for rollout_id, episode in (continued | reran).items():
            self.books.attempts[rollout_id] = episode.attempt

    # ------------------------------------------------------------------ invariants

    @invariant()
    def the_invariants(self) -> None:
        self.steps += 1
        self.run(self._check())

    async def _check(self) -> None:
        fleet, client, books = self.fleet, self.client, self.books
        # The coordinator never sent a commit before every participant was ready.
        violations = self.violations + fleet.tap.violations
        assert not violations, violations
        assert not fleet.tap.errors, fleet.tap.errors
        # No snapshot is in progress: every participant is idle with admission open,
        # unless the trainer knows it left it closed (a resume that never arrived): then
        # it re-sends that resume before it prepares again, keeps its dispatch there
        # closed, and holds rollout budgets meanwhile (spec 7.4 step 8, 6.7 item 1).
        unreleased = set().union(*self.trainer.driver.unreleased.values())
        self.closed = []
        for member in fleet.members.values():
            core = member.runtime.core
            assert core.admission_open == (core.phase is Phase.IDLE), (member.name, core.phase)
            if not core.admission_open:
                self.closed.append(member.name)
                assert member.name in unreleased and client.deadlines_held, (
                    f"{member.name} is left closed ({core.phase.name}, "
                    f"{core.active_checkpoint_id}) and the trainer does not know it: "
                    f"pending releases {dict(self.trainer.driver.unreleased)}, budgets "
                    f"{'held' if client.deadlines_held else 'running'}"
                )
        assert client.dispatch_open
        # The books: every dispatched rollout is queued, live or consumed, exactly once.
        queued = [r.rollout_id for r in client.results()]
        live = [r.episode.rollout_id for r in client.in_flight()]
        live += [e.rollout_id for e in client.waiting()]
        self.live, self.owned, self.queued = len(live), len(client.in_flight()), len(queued)
        assert len(set(queued)) == len(queued) and len(set(live)) == len(live), (queued, live)
        assert not set(queued) & set(live), (queued, live)
        assert not (set(queued) | set(live)) & books.consumed, (queued, live, books)
        assert set(queued) | set(live) | books.consumed == books.dispatched, (queued, live, books)
        # Attempt numbers only grow: in the trainer's ledger, and on the wire.
        for rollout_id, attempt in client.attempts().items():
            assert attempt >= books.attempts.get(rollout_id, 0), (rollout_id, attempt, books)
            books.attempts[rollout_id] = attempt
        for rollout_id, attempts in fleet.tap.runs.items():
            assert attempts == sorted(attempts), (rollout_id, attempts)
        # The agent holds exactly the owned attempts and those a retire still owes; each
        # rollout ran one execution in this incarnation, and a restored one either
        # continued (from its saved turn) or reran (from its prompt), never both.
        owned = {r.episode for r in client.in_flight()}
        retiring = set(client.pending_retires().get(AGENT, ())) | client.unacknowledged()
        # A verified session stays sealed on the resources server until its retire.
        sealed = set(client.pending_session_retires())
        for name in MEMBERS:
            states = held_by(fleet[name].runtime)
            held = set(states)
            allowed = owned | retiring | (sealed if name == TOOLS else set())
            assert held <= allowed, (name, owned, states, retiring, sealed, client.results())
        # Every owned episode has its session from its first model call to its verify
        # (a closed resources server makes new sessions wait for it).
        seeded = {r.episode for r in client.in_flight() if r.boundaries_seen < TURNS}
        tools = set(held_by(fleet[TOOLS].runtime))
        assert TOOLS in self.closed or seeded <= tools, (seeded, tools)
        started = Counter(episode.rollout_id for episode, _ in fleet.agent.started)
        assert all(n == 1 for n in started.values()), fleet.agent.started
        for episode, restored in fleet.agent.started:
            rollout_id = episode.rollout_id
            if rollout_id in self.continued:
                assert episode == self.continued[rollout_id] and restored is not None, episode
            elif rollout_id in self.reran:
                assert episode == self.reran[rollout_id] and restored is None, episode
            else:
                assert restored is None, episode
        # Every published snapshot verifies, and is one whose cut the machine knows.
        if self.root.is_dir():
            report = await asyncio.to_thread(inspect_root, self.root)
            assert report.ok, report.render()
            for snapshot in report.snapshots:
                assert snapshot.checkpoint_id in self.cuts, snapshot

    def teardown(self) -> None:
        try:
            self.run(self._stop_incarnation())
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _expiry(member: Member, lease_s: float) -> Callable[[], Awaitable[None]]:
    """A lease running out on ``member`` while the coordinator is silent."""

    async def expire() -> None:
        member.clock.advance(lease_s + 1)
        await member.runtime.check_lease()

    return expire


def _examples() -> int:
    return int(os.environ.get("TURNPOINT_FAULT_SEQUENCES", "200"))


@pytest.mark.timeout(max(300, _examples() * 3))
def test_fault_sequences() -> None:
    # Hypothesis first parses this file's source. On CPython 3.11 an ast.parse that a
    # garbage collection interrupts with another (a finalizer logging a traceback) fails
    # with "AST constructor recursion depth mismatch" (python/cpython#106905's family):
    # collect what earlier tests left before it parses.
    gc.collect()
    loop = LoopThread()
    FaultSequences.loop = loop
    try:
        run_state_machine_as_test(
            FaultSequences,
            settings=settings(
                max_examples=_examples(),
                stateful_step_count=16,
                deadline=None,
                derandomize=os.environ.get("CI") == "true",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        loop.close()
