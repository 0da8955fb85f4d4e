"""The participant runtime in process: real store on tmp_path, test kinds, no network.

One test per participant behaviour of docs/spec.md sections 4, 5 and 6 (the reference
checklist's "Participant control plane" and "Agents, resources, models"), named for the
behaviour. Protocol time (leases, budgets) runs on a
fake clock where it matters; waits use the runtime's own condition (``wait_until``),
never sleeps. Call deadlines that must pass are short real timeouts on calls that
cannot finish (a negative outcome, not a timing assertion).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.fakes import FakeClock, boundary_of, expect, state_of
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, make_checkpoint_id, validate_id
from turnpoint.participant_sdk import (
    Agent,
    ConfigurationError,
    EpisodeContext,
    GenerateChunk,
    GenerateRequest,
    GenerationRequest,
    ParticipantRuntime,
    PolicyModel,
    RecoveryMode,
    ResourcesServer,
    RuntimeConfig,
    SavedTurn,
    SnapshotStore,
    Verdict,
    VerifyMode,
)
from turnpoint.participant_sdk import _tool_client as tool_client
from turnpoint.participant_sdk.advanced import (
    BoundaryEvent,
    BoundaryReport,
    CommitResult,
    PrepareResult,
    ReadinessUpdate,
    RunOutcome,
    RunResult,
    WatchEvent,
)
from turnpoint.participant_sdk.testing import FaultPoint, StoreFaults
from turnpoint.protocol import (
    ArtifactRef,
    EpisodeState,
    Fence,
    ParticipantKind,
    Phase,
    RecoveryLevel,
)

T = TypeVar("T")

FENCE = Fence("coord", 1)
EP_A = EpisodeId("rollout-a", 0)
EP_B = EpisodeId("rollout-b", 0)
EP_C = EpisodeId("rollout-c", 0)
INSTANCE = "agent-0"
FAST = RuntimeConfig(model_retry_backoff_s=0.01)

_requests = itertools.count()


def rid() -> str:
    return f"req-{next(_requests)}"


def ckpt(n: int) -> str:
    return make_checkpoint_id("ckpt", n)


def restore_id(n: int) -> str:
    return make_checkpoint_id("restore", n)


async def first(iterator: AsyncGenerator[T, None]) -> T:
    async with aclosing(iterator):
        return await anext(iterator)


async def bounded(awaitable: Awaitable[T], seconds: float = 5.0) -> T:
    """Await with a safety bound: a hang fails the test instead of the whole run."""
    async with asyncio.timeout(seconds):
        return await awaitable


def make_runtime(
    store: SnapshotStore,
    *,
    instance: str = INSTANCE,
    agent: Agent | None = None,
    resources: ResourcesServer | None = None,
    model: PolicyModel | None = None,
    clock: Callable[[], float] | None = None,
    config: RuntimeConfig = FAST,
) -> ParticipantRuntime:
    if clock is None:
        return ParticipantRuntime(
            instance, store, agent=agent, resources=resources, model=model, config=config
        )
    return ParticipantRuntime(
        instance, store, agent=agent, resources=resources, model=model, config=config, clock=clock
    )


@asynccontextmanager
async def hosted(runtime: ParticipantRuntime) -> AsyncIterator[ParticipantRuntime]:
    """The runtime without its lease task (tests drive leases by hand); stopped at the end."""
    try:
        yield runtime
    finally:
        await runtime.aclose()


class Follower:
    """Consumes one Run stream in the background, as a gRPC handler would."""

    def __init__(self, stream: AsyncGenerator[BoundaryReport | RunResult, None]) -> None:
        self.reports: list[BoundaryReport] = []
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        self.task = asyncio.create_task(self._pump(stream))

    async def _pump(self, stream: AsyncGenerator[BoundaryReport | RunResult, None]) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    if isinstance(event, RunResult):
                        self.result = event
                    else:
                        self.reports.append(event)
        except TurnpointError as error:
            self.error = error

    async def done(self) -> RunResult:
        await bounded(self.task)
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    async def cancel(self) -> None:
        self.task.cancel()
        await asyncio.wait([self.task])


class StepAgent(Agent):
    """Each turn waits for the test to release one step, then seals a boundary.

    ``task["turns"]`` turns; the state is the list of turns done so far.
    """

    def __init__(self) -> None:
        self.steps: defaultdict[EpisodeId, asyncio.Semaphore] = defaultdict(
            lambda: asyncio.Semaphore(0)
        )
        self.started: list[tuple[EpisodeId, SavedTurn | None]] = []
        self.exports = 0
        self.export_gate: asyncio.Event | None = None
        self.export_cancelled = False
        self.export_leaves_out: set[EpisodeId] = set()
        self.invalid_states: set[int] = set()
        self.close_fails = False
        self.cancel_gate: asyncio.Event | None = None
        self.cancelling = asyncio.Event()
        self.restart_before_boundary: set[EpisodeId] = set()

    def release(self, episode: EpisodeId, steps: int = 1) -> None:
        for _ in range(steps):
            self.steps[episode].release()

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        self.started.append((ctx.episode, ctx.restored))
        restored = ctx.restored
        history = list(restored.state["history"]) if restored else []
        turn = restored.turn_index + 1 if restored else 0
        try:
            while turn < task["turns"]:
                await self.steps[ctx.episode].acquire()
                if ctx.episode in self.restart_before_boundary:
                    await ctx.mark_restart()
                history.append(turn)
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
        self.exports += 1
        if self.export_gate is not None:
            try:
                await self.export_gate.wait()
            except asyncio.CancelledError:
                self.export_cancelled = True
                raise
        return {
            episode: saved.state
            for episode, saved in states.items()
            if episode not in self.export_leaves_out
        }

    def validate_state(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        if len(state["history"]) in self.invalid_states:
            raise ValueError(f"history of length {len(state['history'])} is not allowed")

    async def admission_closed(self) -> None:
        if self.close_fails:
            raise RuntimeError("the admission gate is broken")


class ModelAgent(Agent):
    """Seals boundary 0, makes one model call, seals boundary 1 with the reply."""

    def __init__(self) -> None:
        self.replies: asyncio.Queue[str | TurnpointError] = asyncio.Queue()
        self.calls = 0
        self.returned = 0

    async def call_model(self) -> str:
        self.calls += 1
        reply = await self.replies.get()
        self.returned += 1
        if isinstance(reply, TurnpointError):
            raise reply
        return reply

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        if ctx.restored is None:
            await ctx.boundary(0, {"replies": []})
        reply = await ctx.model_call(self.call_model)
        await ctx.boundary(1, {"replies": [reply]})
        return {"reply": reply}


class Tools(ResourcesServer):
    """A resources server whose requests the test can hold and whose hooks it records."""

    recovery_mode = RecoveryMode.EXPORTED

    def __init__(self) -> None:
        self.sessions: dict[EpisodeId, dict[str, Any]] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.stop_gate: asyncio.Event | None = None
        self.log: list[tuple[str, EpisodeId]] = []
        self.retire_failures = 0
        self.verifies = 0
        self.invalid: set[str] = set()
        self.install_gate: asyncio.Event | None = None

    def hold(self, name: str) -> asyncio.Event:
        self.gates[name] = asyncio.Event()
        return self.gates[name]

    async def _maybe_wait(self, name: str) -> None:
        self.entered[name].set()
        gate = self.gates.get(name)
        if gate is None:
            return
        try:
            await gate.wait()
        except asyncio.CancelledError:
            if self.stop_gate is not None:
                await self.stop_gate.wait()
            raise

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        await self._maybe_wait("seed")
        self.sessions[episode] = {"target": task.get("target", 3), "calls": 0}
        self.log.append(("seed", episode))

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        await self._maybe_wait(tool)
        session = self.sessions[episode]
        session["calls"] += 1
        return {"calls": session["calls"]}

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        await self._maybe_wait("verify")
        self.verifies += 1
        return Verdict(1.0 if answer.get("guess") == self.sessions[episode]["target"] else 0.0)

    async def close(self, episode: EpisodeId) -> None:
        self.log.append(("close", episode))
        self.sessions.pop(episode, None)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        return {episode: dict(self.sessions[episode]) for episode in episodes}

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        self.log.append(("validate", episode))
        if episode.rollout_id in self.invalid:
            raise ValueError("this session cannot be restored")

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        self.log.append(("restore", episode))
        if self.install_gate is not None:
            await self.install_gate.wait()
        self.sessions[episode] = dict(state)

    async def retire_session(self, episode: EpisodeId) -> None:
        if self.retire_failures:
            self.retire_failures -= 1
            raise RuntimeError("could not free the session")
        self.log.append(("retire", episode))
        self.sessions.pop(episode, None)


class RestartTools(Tools):
    recovery_mode = RecoveryMode.RESTART_ONLY


class StatelessTools(ResourcesServer):
    recovery_mode = RecoveryMode.STATELESS

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        return None

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        return {}

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        return Verdict(0.0)

    async def close(self, episode: EpisodeId) -> None:
        return None


class GroupTools(Tools):
    group_scored = True
    group_size = 2
    verify_mode = VerifyMode.REPLAY


class Streamer(PolicyModel):
    """A policy whose token stream the test feeds one chunk at a time."""

    def __init__(self) -> None:
        self.feeds: defaultdict[EpisodeId, asyncio.Queue[int | None]] = defaultdict(asyncio.Queue)
        self.started: list[EpisodeId] = []
        self.cancelled: list[EpisodeId] = []

    async def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        self.started.append(episode)
        try:
            while True:
                token = await self.feeds[episode].get()
                if token is None:
                    yield GenerateChunk((), (), True, 1)
                    return
                yield GenerateChunk((token,), (-0.5,), False, 1)
        except asyncio.CancelledError:
            self.cancelled.append(episode)
            raise


class Collector:
    """Consumes a generation stream in the background."""

    def __init__(self, stream: AsyncGenerator[GenerateChunk, None]) -> None:
        self.chunks: list[GenerateChunk] = []
        self.error: BaseException | None = None
        self.task = asyncio.create_task(self._pump(stream))

    async def _pump(self, stream: AsyncGenerator[GenerateChunk, None]) -> None:
        try:
            async with aclosing(stream):
                async for chunk in stream:
                    self.chunks.append(chunk)
        except TurnpointError as error:
            self.error = error


# ====================================================================== control plane


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "snapshots")


async def start_episode(
    runtime: ParticipantRuntime, episode: EpisodeId, turns: int = 3, **kwargs: Any
) -> Follower:
    follower = Follower(runtime.run_episode(episode, {"turns": turns}, **kwargs))
    await bounded(runtime.wait_until(lambda core: state_of(core, episode) is not None))
    return follower


async def park_all(
    runtime: ParticipantRuntime, agent: StepAgent, checkpoint: str, *episodes: EpisodeId
) -> PrepareResult:
    """Prepare ``checkpoint`` and let each running episode seal one turn and park."""
    prepare = asyncio.create_task(runtime.prepare(FENCE, rid(), checkpoint, lease_s=60))
    await bounded(runtime.wait_until(lambda core: core.active_checkpoint_id == checkpoint))
    for episode in episodes:
        agent.release(episode)
    return await bounded(prepare)


async def test_prepare_returns_only_after_every_running_episode_parked_and_a_repeat_replays(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        a = await start_episode(runtime, EP_A)
        await start_episode(runtime, EP_B)
        prepare = asyncio.create_task(runtime.prepare(FENCE, rid(), ckpt(1), lease_s=60))
        await bounded(runtime.wait_until(lambda core: core.phase is Phase.PREPARING))
        agent.release(EP_A)
        await bounded(runtime.wait_until(lambda core: state_of(core, EP_A) is EpisodeState.PARKED))
        assert not prepare.done()  # B still runs between boundaries
        agent.release(EP_B)
        result = await bounded(prepare)
        assert result.phase is Phase.PREPARED and result.readiness.ready
        assert result.readiness.counts == {EpisodeState.PARKED: 2}
        again = await runtime.prepare(FENCE, rid(), ckpt(1))
        assert replace(again, lease_expires_at=None) == replace(result, lease_expires_at=None)
        # Parked inside the boundary call: nothing ran past it.
        assert [r.boundary_index for r in a.reports] == [1]


async def test_prepare_that_misses_its_deadline_reports_blockers_and_keeps_admission_closed(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        result = await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=0.05)
        assert result.phase is Phase.PREPARING and not result.readiness.ready
        assert result.readiness.blocker_count == 1
        blocker = result.readiness.blockers[0]
        assert (blocker.episode, blocker.state) == (EP_A, EpisodeState.RUNNING)
        assert not runtime.core.admission_open
        await expect(Reason.ADMISSION_CLOSED, first(runtime.run_episode(EP_B, {"turns": 1})))
        # Retiring the straggler is refused until resume.
        await expect(Reason.INVALID_PHASE, runtime.retire(FENCE, rid(), [EP_A]))
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert (await runtime.retire(FENCE, rid(), [EP_A])).stopped == (EP_A,)


async def test_resume_interrupts_a_waiting_prepare_the_id_is_stale_and_a_second_resume_is_idempotent(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        prepare = asyncio.create_task(runtime.prepare(FENCE, rid(), ckpt(1)))
        await bounded(runtime.wait_until(lambda core: core.phase is Phase.PREPARING))
        resumed = await runtime.resume(FENCE, rid(), ckpt(1))
        assert resumed.ended_active and resumed.phase is Phase.IDLE
        await expect(Reason.STALE_CHECKPOINT, bounded(prepare))
        again = await runtime.resume(FENCE, rid(), ckpt(1))
        assert not again.ended_active and again.phase is Phase.IDLE
        await expect(Reason.STALE_CHECKPOINT, runtime.prepare(FENCE, rid(), ckpt(1)))
        assert not (await runtime.resume(FENCE, rid(), ckpt(7))).ended_active  # never seen


async def test_prepare_whose_admission_close_fails_reopens_admission(store: SnapshotStore) -> None:
    agent = StepAgent()
    agent.close_fails = True
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        with pytest.raises(RuntimeError):
            await runtime.prepare(FENCE, rid(), ckpt(1))
        assert runtime.core.admission_open and runtime.phase is Phase.IDLE
        await start_episode(runtime, EP_A)


async def commit_one_turn(
    store: SnapshotStore,
    episodes: Sequence[EpisodeId] = (EP_A,),
    snapshot: str = "snap-1",
    agent: StepAgent | None = None,
) -> tuple[CommitResult, StepAgent]:
    """Run episodes one turn, snapshot them, resume, stop the runtime."""
    agent = agent or StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        for episode in episodes:
            await start_episode(runtime, episode)
        await park_all(runtime, agent, ckpt(1), *episodes)
        result = await runtime.commit(FENCE, rid(), ckpt(1), snapshot, episodes)
        await runtime.resume(FENCE, rid(), ckpt(1))
    return result, agent


async def test_commit_then_restore_round_trips_and_maps_attempt_n_to_n_plus_1(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        await park_all(runtime, agent, ckpt(1), EP_A)
        result = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        assert result.exported == (EP_A,)
        assert result.artifacts[0].record_count == 1
        assert runtime.phase is Phase.COMMITTED
        # A retried commit gives the same answer.
        assert await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A]) == result
        await runtime.resume(FENCE, rid(), ckpt(1))
        # A different checkpoint into the same directory is refused.
        await runtime.prepare(FENCE, rid(), ckpt(2))
        await expect(
            Reason.CHECKPOINT_CONFLICT, runtime.commit(FENCE, rid(), ckpt(2), "snap-1", [EP_A])
        )

    agent2 = StepAgent()
    async with hosted(make_runtime(store, agent=agent2)) as fresh:
        restored = await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A]
        )
        nxt = EP_A.next_attempt()
        assert restored.installed == (nxt,) and restored.phase is Phase.RESTORED
        assert not fresh.core.admission_open
        await fresh.resume(FENCE, rid(), restore_id(1))
        follower = Follower(fresh.run_episode(nxt, {"turns": 3}))
        agent2.release(nxt, 2)
        done = await follower.done()
        assert done.result == {"history": [0, 1, 2]}
        assert agent2.started == [(nxt, SavedTurn(1, 0, {"history": [0]}))]
        assert [r.boundary_index for r in follower.reports] == [2, 3]


def tamper(store: SnapshotStore, ref: ArtifactRef) -> None:
    path = store.root / "snap-1" / ref.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


async def test_restore_rejects_corrupt_records_without_installing_anything(
    store: SnapshotStore,
) -> None:
    result, _ = await commit_one_turn(store, [EP_A, EP_B])
    tamper(store, result.artifacts[0])
    async with hosted(make_runtime(store, agent=StepAgent())) as fresh:
        await expect(
            Reason.INVALID_CHECKPOINT_STATE,
            fresh.restore(
                FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A]
            ),
        )
        assert list(fresh.core.entries()) == []
        assert fresh.core.admission_open and fresh.core.fresh


async def test_an_invalid_record_fails_the_restore_before_anything_is_installed(
    store: SnapshotStore,
) -> None:
    tools = Tools()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        await runtime.seed_session(EP_A, {})
        await runtime.seed_session(EP_B, {})
        await runtime.prepare(FENCE, rid(), ckpt(1))
        result = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A, EP_B])
    fresh_tools = Tools()
    fresh_tools.invalid = {"rollout-b"}
    async with hosted(make_runtime(store, instance="tools-0", resources=fresh_tools)) as fresh:
        await expect(
            Reason.INVALID_CHECKPOINT_STATE,
            fresh.restore(
                FENCE,
                rid(),
                restore_id(1),
                "snap-1",
                result.manifest,
                result.artifacts,
                [EP_A, EP_B],
            ),
        )
        # Every record was validated; none was installed.
        assert [op for op, _ in fresh_tools.log] == ["validate", "validate"]
        assert fresh.core.admission_open and fresh.phase is Phase.IDLE and fresh.core.fresh


async def test_commit_requires_a_prepared_participant(store: SnapshotStore) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await expect(Reason.INVALID_PHASE, runtime.commit(FENCE, rid(), ckpt(1), "snap-1", []))
        await start_episode(runtime, EP_A)
        await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=0.02)
        await expect(Reason.INVALID_PHASE, runtime.commit(FENCE, rid(), ckpt(1), "snap-1", []))


async def test_a_retired_attempt_stays_refused_until_its_rollout_is_forgotten(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        follower = await start_episode(runtime, EP_A)
        assert (await runtime.retire(FENCE, rid(), [EP_A])).stopped == (EP_A,)
        await expect(Reason.STALE_ATTEMPT, follower.done())
        assert state_of(runtime.core, EP_A) is None
        # A request arriving after the retire finished is refused, until forget.
        await expect(Reason.STALE_ATTEMPT, first(runtime.run_episode(EP_A, {"turns": 1})))
        assert (await runtime.status()).refused_rollouts == 1
        assert (await runtime.forget(FENCE, rid(), ["rollout-a"])).forgotten == 1
        await start_episode(runtime, EP_A)


async def test_retire_also_stops_every_earlier_attempt_of_the_rollout(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    a1 = EP_A.next_attempt()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        old = await start_episode(runtime, EP_A)
        await start_episode(runtime, a1)  # the rollout rerun as attempt 1
        retired = await runtime.retire(FENCE, rid(), [a1])
        assert retired.stopped == (EP_A, a1)
        assert list(runtime.core.entries()) == []
        await expect(Reason.STALE_ATTEMPT, old.done())
        # Idempotent: a second retire finds nothing left to stop.
        assert (await runtime.retire(FENCE, rid(), [a1])).stopped == ()


async def test_forget_is_refused_while_a_checkpoint_is_open(store: SnapshotStore) -> None:
    async with hosted(make_runtime(store, agent=StepAgent())) as runtime:
        await runtime.retire(FENCE, rid(), [EP_A])
        await runtime.prepare(FENCE, rid(), ckpt(1))
        await expect(Reason.INVALID_PHASE, runtime.forget(FENCE, rid(), ["rollout-a"]))


async def test_retire_replies_only_after_the_participant_stopped_the_attempt(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    agent.cancel_gate = asyncio.Event()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        retire = asyncio.create_task(runtime.retire(FENCE, rid(), [EP_A]))
        await bounded(agent.cancelling.wait())
        assert not retire.done()
        assert state_of(runtime.core, EP_A) is EpisodeState.RETIRING
        agent.cancel_gate.set()
        assert (await bounded(retire)).stopped == (EP_A,)
        assert state_of(runtime.core, EP_A) is None


async def test_a_failed_retire_keeps_its_attempts_refused_and_a_retry_stops_them(
    store: SnapshotStore,
) -> None:
    tools = Tools()
    tools.retire_failures = 1
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        await runtime.seed_session(EP_A, {})
        await expect(Reason.RETIRE_INCOMPLETE, runtime.retire(FENCE, rid(), [EP_A]))
        await expect(Reason.STALE_ATTEMPT, runtime.call_tool(EP_A, "check", {}))
        await expect(Reason.RETIRE_INCOMPLETE, runtime.forget(FENCE, rid(), ["rollout-a"]))
        assert (await runtime.retire(FENCE, rid(), [EP_A])).stopped == (EP_A,)
        assert ("retire", EP_A) in tools.log and EP_A not in tools.sessions
        assert (await runtime.forget(FENCE, rid(), ["rollout-a"])).forgotten == 1


async def test_lease_expiry_resumes_a_quiet_controller_and_renew_keeps_a_slow_one_in_charge(
    store: SnapshotStore,
) -> None:
    clock = FakeClock()
    async with hosted(make_runtime(store, agent=StepAgent(), clock=clock)) as runtime:
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1), lease_s=30)
        assert prepared.phase is Phase.PREPARED
        for _ in range(3 * 360):  # three hours of renewals every 10 s
            clock.advance(10)
            assert await runtime.check_lease() is None
            await runtime.renew(FENCE, rid(), ckpt(1), lease_s=30)
        assert runtime.phase is Phase.PREPARED
        clock.advance(29)
        assert await runtime.check_lease() is None
        clock.advance(1)
        assert await runtime.check_lease() == ckpt(1)
        status = await runtime.status()
        assert status.lease_expiries == 1 and status.admission_open
        assert status.lease_expires_at is None
        await expect(Reason.STALE_CHECKPOINT, runtime.renew(FENCE, rid(), ckpt(1)))


async def test_the_background_lease_task_resumes_an_expired_checkpoint(
    store: SnapshotStore,
) -> None:
    async with make_runtime(store, agent=StepAgent()) as runtime:
        await runtime.prepare(FENCE, rid(), ckpt(1), lease_s=0.05)
        assert await runtime.wait_until(lambda core: core.lease_expiries == 1, timeout_s=5)
        assert runtime.core.admission_open


async def test_restore_installs_only_the_continued_episodes_and_restored_state_can_be_retired(
    store: SnapshotStore,
) -> None:
    result, _ = await commit_one_turn(store, [EP_A, EP_B])
    async with hosted(make_runtime(store, agent=StepAgent())) as fresh:
        restored = await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A]
        )
        assert restored.installed == (EP_A.next_attempt(),)
        assert state_of(fresh.core, EP_B.next_attempt()) is None
        await fresh.resume(FENCE, rid(), restore_id(1))
        retired = await fresh.retire(FENCE, rid(), [EP_A.next_attempt()])
        assert retired.stopped == (EP_A.next_attempt(),)
        assert list(fresh.core.entries()) == []


async def test_commit_io_past_its_deadline_fails_and_a_retry_awaits_the_same_write(
    tmp_path: Path,
) -> None:
    faults = StoreFaults()
    release = threading.Event()
    reached = faults.slow_write(release)
    store = SnapshotStore(tmp_path, faults=faults)
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        await park_all(runtime, agent, ckpt(1), EP_A)
        await expect(
            Reason.DEADLINE_EXCEEDED,
            runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A], timeout_s=0.1),
        )
        assert reached.is_set()
        retry = asyncio.create_task(runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A]))
        await asyncio.sleep(0)
        assert not retry.done()
        release.set()
        result = await bounded(retry)
        assert result.exported == (EP_A,)
        assert agent.exports == 1
        assert faults.hits(FaultPoint.RECORDS_WRITE) == 1  # one write, joined, not two


async def test_a_commit_retried_after_its_write_failed_stores_the_same_records(
    tmp_path: Path,
) -> None:
    faults = StoreFaults()
    faults.fail_writes(1)
    store = SnapshotStore(tmp_path, faults=faults)
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        await park_all(runtime, agent, ckpt(1), EP_A)
        error = await expect(
            Reason.STORAGE_UNAVAILABLE, runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        )
        assert error.transient
        result = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        assert agent.exports == 1  # the same records, never a new cut
        loaded = store.read("snap-1", INSTANCE, result.manifest)
        assert [r.payload["state"] for r in loaded.records] == [{"history": [0]}]


async def test_resume_stops_a_write_that_outlived_its_commit_before_it_publishes(
    tmp_path: Path,
) -> None:
    faults = StoreFaults()
    release = threading.Event()
    reached = faults.slow_write(release)
    store = SnapshotStore(tmp_path, faults=faults)
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        await park_all(runtime, agent, ckpt(1), EP_A)
        await expect(
            Reason.DEADLINE_EXCEEDED,
            runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A], timeout_s=0.1),
        )
        assert reached.is_set()
        resumed = await bounded(runtime.resume(FENCE, rid(), ckpt(1)))
        assert resumed.ended_active and runtime.core.admission_open
        release.set()
    # The cancelled writer left nothing behind, and nothing was published after the resume.
    directory = store.instance_dir("snap-1", INSTANCE)
    assert not store.exists("snap-1", INSTANCE)
    assert list(directory.iterdir()) == []


async def test_resume_waits_for_a_publication_under_way_and_past_its_deadline_changes_nothing(
    tmp_path: Path,
) -> None:
    faults = StoreFaults()
    release = threading.Event()
    reached = faults.block_at(FaultPoint.MANIFEST_WRITE, release)
    store = SnapshotStore(tmp_path, faults=faults)
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        await park_all(runtime, agent, ckpt(1), EP_A)
        await expect(
            Reason.DEADLINE_EXCEEDED,
            runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A], timeout_s=0.1),
        )
        assert reached.is_set()
        # The publication cannot be stopped: a resume past its deadline changes nothing...
        await expect(Reason.DEADLINE_EXCEEDED, runtime.resume(FENCE, rid(), ckpt(1), timeout_s=0.1))
        assert runtime.phase is Phase.PREPARED and not runtime.core.admission_open
        # ...and a retry waits for it, so no publication appears after the resume.
        resume = asyncio.create_task(runtime.resume(FENCE, rid(), ckpt(1)))
        release.set()
        resumed = await bounded(resume)
        assert store.exists("snap-1", INSTANCE)
        assert resumed.ended_active and runtime.core.admission_open


async def test_the_prepare_report_caps_listed_blockers_but_counts_all(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        for episode in (EP_A, EP_B, EP_C):
            await start_episode(runtime, episode)
        result = await runtime.prepare(FENCE, rid(), ckpt(1), max_blockers=2, timeout_s=0.02)
        assert result.readiness.blocker_count == 3
        assert len(result.readiness.blockers) == 2
        status = await runtime.status(max_blockers=1)
        assert status.readiness.blocker_count == 3 and len(status.readiness.blockers) == 1


async def test_an_episode_woken_by_resume_stays_parked_if_a_new_checkpoint_closes_first(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        follower = await start_episode(runtime, EP_A)
        await park_all(runtime, agent, ckpt(1), EP_A)
        agent.release(EP_A)  # it would run on at once if it got the chance
        # Resume and the next prepare back to back, before the parked episode runs.
        await runtime.resume(FENCE, rid(), ckpt(1))
        prepared = await runtime.prepare(FENCE, rid(), ckpt(2), timeout_s=1)
        assert prepared.phase is Phase.PREPARED
        assert state_of(runtime.core, EP_A) is EpisodeState.PARKED
        assert [r.boundary_index for r in follower.reports] == [1]
        await runtime.resume(FENCE, rid(), ckpt(2))
        await bounded(runtime.wait_until(lambda core: boundary_of(core, EP_A) == 2))


async def test_an_unserialisable_payload_fails_the_commit_naming_the_episode(
    store: SnapshotStore,
) -> None:
    class Unsaveable(StepAgent):
        async def export_states(
            self, states: Mapping[EpisodeId, SavedTurn]
        ) -> Mapping[EpisodeId, Mapping[str, Any]]:
            return {episode: {"when": object()} for episode in states}

    agent = Unsaveable()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        await park_all(runtime, agent, ckpt(1), EP_A)
        error = await expect(
            Reason.INVALID_CHECKPOINT_STATE,
            runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A]),
        )
        assert error.metadata["episode"] == str(EP_A)


async def test_stored_records_keep_their_key_order(store: SnapshotStore) -> None:
    class Ordered(StepAgent):
        async def export_states(
            self, states: Mapping[EpisodeId, SavedTurn]
        ) -> Mapping[EpisodeId, Mapping[str, Any]]:
            return {episode: {"z": 1, "a": 2, "m": 3} for episode in states}

    result, _ = await commit_one_turn(store, [EP_A], agent=Ordered())
    loaded = store.read("snap-1", INSTANCE, result.manifest)
    assert list(loaded.records[0].payload) == ["task", "boundary_index", "turn_index", "state"]
    assert list(loaded.records[0].payload["state"]) == ["z", "a", "m"]


async def restore_tools(
    store: SnapshotStore, tools: Tools, episodes: Sequence[EpisodeId]
) -> tuple[ParticipantRuntime, CommitResult]:
    async with hosted(make_runtime(store, instance="tools-0", resources=Tools())) as runtime:
        for episode in episodes:
            await runtime.seed_session(episode, {"target": 5})
        await runtime.prepare(FENCE, rid(), ckpt(1))
        result = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", episodes)
    fresh = make_runtime(store, instance="tools-0", resources=tools)
    return fresh, result


async def test_a_commit_deletes_restored_state_its_scope_leaves_out_and_can_be_retried(
    store: SnapshotStore,
) -> None:
    tools = Tools()
    fresh, result = await restore_tools(store, tools, [EP_A, EP_B])
    a1, b1 = EP_A.next_attempt(), EP_B.next_attempt()
    async with hosted(fresh):
        await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A, EP_B]
        )
        await fresh.resume(FENCE, rid(), restore_id(1))
        await fresh.prepare(FENCE, rid(), ckpt(2))
        tools.retire_failures = 1
        with pytest.raises(RuntimeError):
            await fresh.commit(FENCE, rid(), ckpt(2), "snap-2", [a1])
        committed = await fresh.commit(FENCE, rid(), ckpt(2), "snap-2", [a1])
        assert committed.exported == (a1,)
        assert ("retire", b1) in tools.log and b1 not in tools.sessions
        assert state_of(fresh.core, b1, "session") is None


async def test_a_retire_after_a_restore_that_ran_out_of_time_waits_for_its_install(
    store: SnapshotStore,
) -> None:
    tools = Tools()
    tools.install_gate = asyncio.Event()
    fresh, result = await restore_tools(store, tools, [EP_A])
    a1 = EP_A.next_attempt()
    async with hosted(fresh):
        await expect(
            Reason.DEADLINE_EXCEEDED,
            fresh.restore(
                FENCE,
                rid(),
                restore_id(1),
                "snap-1",
                result.manifest,
                result.artifacts,
                [EP_A],
                timeout_s=0.1,
            ),
        )
        # Admission reopens only once the install that outlived its call finished.
        await expect(
            Reason.DEADLINE_EXCEEDED, fresh.resume(FENCE, rid(), restore_id(1), timeout_s=0.1)
        )
        assert not fresh.core.admission_open
        retire = asyncio.create_task(fresh.retire(FENCE, rid(), [a1]))
        await asyncio.sleep(0)
        assert not retire.done()
        tools.install_gate.set()
        assert (await bounded(retire)).stopped == (a1,)
        assert ("retire", a1) in tools.log
        # A retry of the restore joins (here: replays) the install that finished.
        replay = await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A]
        )
        assert replay.installed == (a1,)
        assert (await fresh.resume(FENCE, rid(), restore_id(1))).ended_active
        assert fresh.core.admission_open


async def test_a_restart_never_blocks_parks_or_is_exported_and_a_retiring_one_blocks(
    store: SnapshotStore,
) -> None:
    tools = RestartTools()
    tools.stop_gate = asyncio.Event()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        await runtime.seed_session(EP_A, {})
        tools.hold("slow")
        call = asyncio.create_task(runtime.call_tool(EP_A, "slow", {}))
        await bounded(tools.entered["slow"].wait())
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)
        assert prepared.readiness.ready and prepared.readiness.restarts == (EP_A,)
        # It keeps running through the checkpoint.
        assert (await bounded(runtime.call_tool(EP_A, "fast", {})))["calls"] == 1
        await expect(
            Reason.RESTART_IN_SCOPE, runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        )
        committed = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [])
        assert committed.exported == ()
        await runtime.resume(FENCE, rid(), ckpt(1))
        # One being retired still blocks until it stopped.
        retire = asyncio.create_task(runtime.retire(FENCE, rid(), [EP_A]))
        await bounded(runtime.wait_until(lambda core: not core.ready))
        report = await runtime.prepare(FENCE, rid(), ckpt(2), timeout_s=0.05)
        assert report.readiness.blockers[0].state is EpisodeState.RETIRING
        await runtime.resume(FENCE, rid(), ckpt(2))
        tools.stop_gate.set()
        await bounded(retire)
        await expect(Reason.STALE_ATTEMPT, bounded(call))


class RestartOnlyAgent(StepAgent):
    """A StepAgent that cannot continue a saved turn (a harness that cannot be replayed)."""

    recovery_mode = RecoveryMode.RESTART_ONLY


async def test_a_restart_only_agent_never_parks_blocks_or_exports_and_a_cancel_starts_over(
    store: SnapshotStore,
) -> None:
    agent = RestartOnlyAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        described = await runtime.describe()
        assert described.recovery_mode is RecoveryMode.RESTART_ONLY
        assert described.supported_levels == (RecoveryLevel.SIBLING, RecoveryLevel.PROMPT_GROUP)
        follower = await start_episode(runtime, EP_A)
        assert state_of(runtime.core, EP_A) is EpisodeState.RESTART
        # Mid-turn, yet prepare does not wait for it: it is reported as a restart.
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)
        assert prepared.readiness.ready and prepared.readiness.restarts == (EP_A,)
        # Its boundaries do not park it while the checkpoint is open.
        agent.release(EP_A, 2)
        await bounded(runtime.wait_until(lambda core: boundary_of(core, EP_A) == 2))
        assert state_of(runtime.core, EP_A) is EpisodeState.RESTART
        await expect(
            Reason.RESTART_IN_SCOPE, runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        )
        committed = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [])
        assert committed.exported == () and agent.exports == 0
        await runtime.resume(FENCE, rid(), ckpt(1))
        # Cancelled after a boundary, nothing stays claimable: a new Run starts over.
        await follower.cancel()
        await bounded(runtime.wait_until(lambda core: state_of(core, EP_A) is None))
        again = Follower(runtime.run_episode(EP_A, {"turns": 1}))
        agent.release(EP_A)
        assert (await again.done()).result == {"history": [0]}
        assert agent.started == [(EP_A, None), (EP_A, None)]


def test_an_agent_is_exported_or_restart_only(store: SnapshotStore) -> None:
    class Stateless(StepAgent):
        recovery_mode = RecoveryMode.STATELESS

    with pytest.raises(ConfigurationError, match="EXPORTED or RESTART_ONLY"):
        make_runtime(store, agent=Stateless())


async def test_an_episode_becomes_a_restart_only_while_no_checkpoint_is_open(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    agent.restart_before_boundary = {EP_A}
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        prepared = await park_all(runtime, agent, ckpt(1), EP_A)
        assert prepared.readiness.restarts == ()
        await runtime.resume(FENCE, rid(), ckpt(1))
        status = await runtime.status()
        assert status.readiness.restarts == (EP_A,)


async def test_an_export_that_outlives_its_commit_is_awaited_by_a_retry_not_repeated(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    agent.export_gate = asyncio.Event()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        for episode in (EP_A, EP_B):
            await start_episode(runtime, episode)
        await park_all(runtime, agent, ckpt(1), EP_A, EP_B)
        await expect(
            Reason.DEADLINE_EXCEEDED,
            runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A, EP_B], timeout_s=0.1),
        )
        # The same scope in another order is the same commit: it awaits the same export.
        retry = asyncio.create_task(runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_B, EP_A]))
        agent.export_gate.set()
        assert (await bounded(retry)).exported == (EP_A, EP_B)
        assert agent.exports == 1


async def test_resume_does_not_wait_for_an_export_nothing_will_use(store: SnapshotStore) -> None:
    agent = StepAgent()
    agent.export_gate = asyncio.Event()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        await start_episode(runtime, EP_A)
        await park_all(runtime, agent, ckpt(1), EP_A)
        await expect(
            Reason.DEADLINE_EXCEEDED,
            runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A], timeout_s=0.1),
        )
        resumed = await bounded(runtime.resume(FENCE, rid(), ckpt(1)))
        assert resumed.ended_active
        await bounded(runtime.wait_until(lambda core: agent.export_cancelled))
        assert not store.exists("snap-1", INSTANCE)


async def test_a_lower_epoch_is_fenced_but_a_retry_of_an_answered_request_gets_its_answer(
    store: SnapshotStore,
) -> None:
    async with hosted(make_runtime(store, agent=StepAgent())) as runtime:
        answer = await runtime.resume(FENCE, "req-old", ckpt(1))
        await runtime.prepare(Fence("coord", 2), rid(), ckpt(2))
        assert runtime.header().epoch == 2
        assert await runtime.resume(FENCE, "req-old", ckpt(1)) == answer
        await expect(Reason.FENCED, runtime.resume(FENCE, "req-new", ckpt(2)))
        assert runtime.phase is Phase.PREPARED


async def test_describe_status_and_header(store: SnapshotStore) -> None:
    runtime = make_runtime(store, agent=StepAgent())
    async with hosted(runtime):
        description = await runtime.describe(Fence("coord", 3))
        assert description.kind is ParticipantKind.AGENT
        assert description.recovery_mode is RecoveryMode.EXPORTED
        assert description.supported_levels[0] is RecoveryLevel.TURN
        assert description.protocol_version == "turnpoint.v1"
        header = runtime.header()
        assert (header.participant_id, header.epoch) == (INSTANCE, 3)
        assert header.incarnation == description.incarnation
        await runtime.prepare(Fence("coord", 3), rid(), ckpt(1), lease_s=30)
        status = await runtime.status()
        assert status.phase is Phase.PREPARED and status.active_checkpoint_id == ckpt(1)
        assert status.lease_expires_at is not None and not status.admission_open
    tools_runtime = make_runtime(store, instance="tools-0", resources=RestartTools())
    described = await tools_runtime.describe()
    assert described.recovery_mode is RecoveryMode.RESTART_ONLY
    assert RecoveryLevel.TURN not in described.supported_levels


async def test_watch_pushes_boundary_events_and_readiness_as_they_change(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        events: list[WatchEvent] = []
        async with aclosing(runtime.watch(max_blockers=5)) as stream:
            events.append(await anext(stream))
            assert isinstance(events[0], ReadinessUpdate) and events[0].readiness.ready
            await start_episode(runtime, EP_A)
            prepare = asyncio.create_task(runtime.prepare(FENCE, rid(), ckpt(1)))
            await bounded(runtime.wait_until(lambda core: core.phase is Phase.PREPARING))
            agent.release(EP_A)
            async with asyncio.timeout(5):
                async for event in stream:
                    events.append(event)
                    if isinstance(event, ReadinessUpdate) and event.phase is Phase.PREPARED:
                        break
            await bounded(prepare)
        boundaries = [e for e in events if isinstance(e, BoundaryEvent)]
        assert (EP_A, EpisodeState.RUNNING) in [(e.episode, e.state) for e in boundaries]
        assert any(e.state is EpisodeState.PARKED and e.boundary_index == 1 for e in boundaries)
        readiness = [e for e in events if isinstance(e, ReadinessUpdate)]
        assert any(not e.readiness.ready for e in readiness)
        assert readiness[-1].readiness.ready


# ====================================================================== agents


async def test_a_restored_attempt_invoked_while_closed_parks_before_doing_work(
    store: SnapshotStore,
) -> None:
    result, _ = await commit_one_turn(store, [EP_A])
    agent = StepAgent()
    nxt = EP_A.next_attempt()
    async with hosted(make_runtime(store, agent=agent)) as fresh:
        await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A]
        )
        # A new episode is refused while closed; the restored replacement may start.
        await expect(Reason.ADMISSION_CLOSED, first(fresh.run_episode(EP_B, {"turns": 1})))
        follower = Follower(fresh.run_episode(nxt, {"turns": 3}))
        await bounded(fresh.wait_until(lambda core: state_of(core, nxt) is EpisodeState.PARKED))
        assert agent.started == []
        await fresh.resume(FENCE, rid(), restore_id(1))
        agent.release(nxt, 2)
        assert (await follower.done()).result == {"history": [0, 1, 2]}


async def test_awaiting_a_model_call_counts_as_parked_and_a_reply_is_held_until_resume(
    store: SnapshotStore,
) -> None:
    agent = ModelAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        follower = Follower(runtime.run_episode(EP_A, {}))
        await bounded(
            runtime.wait_until(lambda core: state_of(core, EP_A) is EpisodeState.AWAITING_MODEL)
        )
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)
        assert prepared.phase is Phase.PREPARED
        assert prepared.readiness.counts == {EpisodeState.AWAITING_MODEL: 1}
        agent.replies.put_nowait("seven")
        # The reply arrived, but the episode stays at its boundary until resume.
        assert not await runtime.wait_until(lambda core: boundary_of(core, EP_A) == 2, 0.05)
        assert agent.returned == 1
        assert state_of(runtime.core, EP_A) is EpisodeState.AWAITING_MODEL
        committed = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        assert committed.exported == (EP_A,)
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert (await follower.done()).result == {"reply": "seven"}


async def test_after_a_restore_the_model_call_is_issued_again(store: SnapshotStore) -> None:
    agent = ModelAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        Follower(runtime.run_episode(EP_A, {}))
        await bounded(
            runtime.wait_until(lambda core: state_of(core, EP_A) is EpisodeState.AWAITING_MODEL)
        )
        await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)
        result = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
    again = ModelAgent()
    nxt = EP_A.next_attempt()
    async with hosted(make_runtime(store, agent=again)) as fresh:
        await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A]
        )
        await fresh.resume(FENCE, rid(), restore_id(1))
        follower = Follower(fresh.run_episode(nxt, {}))
        again.replies.put_nowait("eight")
        assert (await follower.done()).result == {"reply": "eight"}
        assert again.calls == 1


async def test_a_refused_model_call_parks_and_is_retried_after_resume(
    store: SnapshotStore,
) -> None:
    agent = ModelAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        follower = Follower(runtime.run_episode(EP_A, {}))
        await bounded(
            runtime.wait_until(lambda core: state_of(core, EP_A) is EpisodeState.AWAITING_MODEL)
        )
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)
        assert prepared.readiness.ready
        agent.replies.put_nowait(TurnpointError(Reason.ADMISSION_CLOSED, "model is checkpointing"))
        agent.replies.put_nowait("nine")
        assert not await runtime.wait_until(lambda core: agent.calls == 2, 0.05)
        assert state_of(runtime.core, EP_A) is EpisodeState.AWAITING_MODEL
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert (await follower.done()).result == {"reply": "nine"}
        assert agent.calls == 2


async def test_run_reinvoked_while_running_attaches_and_never_starts_a_second_execution(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        first_caller = await start_episode(runtime, EP_A)
        agent.release(EP_A, 2)
        await bounded(runtime.wait_until(lambda core: boundary_of(core, EP_A) == 2))
        # The caller saw boundary 1 before its stream broke; it re-attaches.
        second = Follower(runtime.run_episode(EP_A, {"turns": 3}, boundaries_seen=1))
        agent.release(EP_A)
        done = await second.done()
        assert [r.boundary_index for r in second.reports] == [2, 3]
        assert done == await first_caller.done()
        assert len(agent.started) == 1
        # A different task for the same attempt is not the same call.
        await expect(Reason.INVALID_ARGUMENT, first(runtime.run_episode(EP_A, {"turns": 9})))


async def test_a_completed_result_is_kept_until_acknowledged_and_blocks_prepare_with_its_receipt(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        follower = await start_episode(runtime, EP_A, turns=1)
        agent.release(EP_A)
        done = await follower.done()
        assert done.receipt is not None
        validate_id(done.receipt.receipt_id, "receipt_id")  # it travels on the wire
        # Re-invoked for a completed episode: the kept result, no new execution.
        again = Follower(runtime.run_episode(EP_A, {"turns": 1}))
        assert await again.done() == done and len(agent.started) == 1
        report = (await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=0.05)).readiness
        assert not report.ready
        assert report.blockers[0].state is EpisodeState.COMPLETED_UNACKED
        assert report.blockers[0].receipt == done.receipt
        acked = await runtime.acknowledge([done.receipt, replace(done.receipt, receipt_id="x")])
        assert acked.acknowledged == 1 and len(acked.unknown) == 1
        assert (await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)).readiness.ready


async def test_a_cancelled_run_finishes_cancelled_owes_nothing_and_its_boundary_stays_committable(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        follower = await start_episode(runtime, EP_A)
        other = await start_episode(runtime, EP_B)
        agent.release(EP_A)
        await bounded(runtime.wait_until(lambda core: boundary_of(core, EP_A) == 1))
        await follower.cancel()  # the trainer gave up: gRPC cancelled the call
        await other.cancel()  # this one never sealed a boundary
        await bounded(
            runtime.wait_until(
                lambda core: (
                    state_of(core, EP_A) is EpisodeState.PARKED and state_of(core, EP_B) is None
                )
            )
        )
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)
        assert prepared.readiness.ready  # no unacknowledged completion left behind
        committed = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        assert committed.exported == (EP_A,)


async def test_parked_time_does_not_count_against_the_episode_budget(store: SnapshotStore) -> None:
    clock = FakeClock()
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent, clock=clock)) as runtime:
        follower = await start_episode(runtime, EP_A, turns=2, budget_s=10)
        clock.advance(3)
        await park_all(runtime, agent, ckpt(1), EP_A)
        clock.advance(3600)  # an hour parked by a checkpoint
        await runtime.resume(FENCE, rid(), ckpt(1))
        agent.release(EP_A)
        done = await follower.done()
        assert done.outcome is RunOutcome.COMPLETED
        assert done.active_time_s == pytest.approx(3.0)


async def test_an_episode_whose_budget_runs_out_ends_budget_exhausted_with_a_receipt(
    store: SnapshotStore,
) -> None:
    async with hosted(make_runtime(store, agent=StepAgent())) as runtime:
        follower = await start_episode(runtime, EP_A, budget_s=0.05)
        done = await follower.done()
        assert done.outcome is RunOutcome.BUDGET_EXHAUSTED and done.receipt is not None


async def test_an_agent_that_leaves_an_episode_out_of_its_export_fails_the_commit(
    store: SnapshotStore,
) -> None:
    agent = StepAgent()
    agent.export_leaves_out = {EP_B}
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        for episode in (EP_A, EP_B):
            await start_episode(runtime, episode)
        await park_all(runtime, agent, ckpt(1), EP_A, EP_B)
        error = await expect(
            Reason.INVALID_CHECKPOINT_STATE,
            runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A, EP_B]),
        )
        assert error.metadata["episode"] == str(EP_B)


async def test_restored_state_must_match_the_replacement_task(store: SnapshotStore) -> None:
    result, _ = await commit_one_turn(store, [EP_A])
    async with hosted(make_runtime(store, agent=StepAgent())) as fresh:
        await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A]
        )
        await fresh.resume(FENCE, rid(), restore_id(1))
        await expect(
            Reason.INVALID_ARGUMENT, first(fresh.run_episode(EP_A.next_attempt(), {"turns": 5}))
        )
        # Attempt N is dead once N+1 is held here.
        await expect(Reason.STALE_ATTEMPT, first(fresh.run_episode(EP_A, {"turns": 3})))


async def test_restored_episodes_not_yet_claimed_survive_the_next_checkpoint(
    store: SnapshotStore,
) -> None:
    result, _ = await commit_one_turn(store, [EP_A])
    nxt = EP_A.next_attempt()
    async with hosted(make_runtime(store, agent=StepAgent())) as fresh:
        await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", result.manifest, result.artifacts, [EP_A]
        )
        await fresh.resume(FENCE, rid(), restore_id(1))
        prepared = await fresh.prepare(FENCE, rid(), ckpt(2), timeout_s=1)
        assert prepared.readiness.counts == {EpisodeState.RESTORED: 1}
        second = await fresh.commit(FENCE, rid(), ckpt(2), "snap-2", [nxt])
        assert second.exported == (nxt,)
    agent = StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as third:
        await third.restore(
            FENCE, rid(), restore_id(2), "snap-2", second.manifest, second.artifacts, [nxt]
        )
        await third.resume(FENCE, rid(), restore_id(2))
        follower = Follower(third.run_episode(nxt.next_attempt(), {"turns": 3}))
        agent.release(nxt.next_attempt(), 2)
        assert (await follower.done()).result == {"history": [0, 1, 2]}


# ====================================================================== resources


async def test_an_in_flight_request_blocks_prepare_and_verify_seals_the_session(
    store: SnapshotStore,
) -> None:
    tools = Tools()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        await runtime.seed_session(EP_A, {"target": 4})
        gate = tools.hold("slow")
        call = asyncio.create_task(runtime.call_tool(EP_A, "slow", {}))
        await bounded(tools.entered["slow"].wait())
        report = await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=0.05)
        assert report.readiness.blockers[0].state is EpisodeState.REQUEST_IN_FLIGHT
        gate.set()
        assert (await bounded(call))["calls"] == 1
        assert (await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)).readiness.ready
        await runtime.resume(FENCE, rid(), ckpt(1))
        verdict = await runtime.verify(EP_A, {"guess": 4})
        assert verdict.reward == 1.0
        # Sealed (spec 5.3 item 3): kept and exported with the next cut, a repeated
        # verify answers the same verdict without asking the server, calls are refused.
        assert state_of(runtime.core, EP_A, "session") is EpisodeState.IDLE
        assert EP_A in tools.sessions
        verifies = tools.verifies
        assert await runtime.verify(EP_A, {"guess": 0}) == verdict
        assert tools.verifies == verifies
        await expect(Reason.NOT_FOUND, runtime.call_tool(EP_A, "slow", {}))
        assert (await runtime.prepare(FENCE, rid(), ckpt(2), timeout_s=1)).readiness.ready
        committed = await runtime.commit(FENCE, rid(), ckpt(2), "snap-2", [EP_A])
        assert committed.exported == (EP_A,)
        await runtime.resume(FENCE, rid(), ckpt(2))
        # The coordinator's retire of the completed attempt frees it.
        assert (await runtime.retire(FENCE, rid(), [EP_A])).stopped == (EP_A,)
        assert state_of(runtime.core, EP_A, "session") is None and EP_A not in tools.sessions


async def test_a_seed_arriving_during_a_checkpoint_waits_for_resume(store: SnapshotStore) -> None:
    tools = Tools()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        await runtime.prepare(FENCE, rid(), ckpt(1))
        seed = asyncio.create_task(runtime.seed_session(EP_A, {}))
        assert not await runtime.wait_until(lambda core: EP_A in tools.sessions, 0.05)
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert await bounded(seed) is False
        assert EP_A in tools.sessions


async def test_a_seed_in_flight_when_admission_closes_holds_prepare_and_is_exported(
    store: SnapshotStore,
) -> None:
    tools = Tools()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        gate = tools.hold("seed")
        seed = asyncio.create_task(runtime.seed_session(EP_A, {}))
        await bounded(tools.entered["seed"].wait())
        prepare = asyncio.create_task(runtime.prepare(FENCE, rid(), ckpt(1)))
        await bounded(runtime.wait_until(lambda core: core.phase is Phase.PREPARING))
        gate.set()
        assert (await bounded(prepare)).readiness.ready
        await bounded(seed)
        committed = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        assert committed.exported == (EP_A,)


async def test_a_close_during_a_checkpoint_waits_and_then_ends_the_session(
    store: SnapshotStore,
) -> None:
    tools = Tools()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        await runtime.seed_session(EP_A, {})
        await runtime.prepare(FENCE, rid(), ckpt(1))
        close = asyncio.create_task(runtime.close_session(EP_A))
        assert not await runtime.wait_until(lambda core: ("close", EP_A) in tools.log, 0.05)
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert await bounded(close) is True
        assert state_of(runtime.core, EP_A, "session") is None
        assert await runtime.close_session(EP_A) is False  # closing twice is fine


async def test_a_retire_waits_for_the_sessions_request_in_flight(store: SnapshotStore) -> None:
    tools = Tools()
    tools.stop_gate = asyncio.Event()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        await runtime.seed_session(EP_A, {})
        tools.hold("slow")
        call = asyncio.create_task(runtime.call_tool(EP_A, "slow", {}))
        await bounded(tools.entered["slow"].wait())
        retire = asyncio.create_task(runtime.retire(FENCE, rid(), [EP_A]))
        assert not await runtime.wait_until(lambda core: retire.done(), 0.05)
        tools.stop_gate.set()
        assert (await bounded(retire)).stopped == (EP_A,)
        await expect(Reason.STALE_ATTEMPT, bounded(call))
        await expect(Reason.STALE_ATTEMPT, runtime.seed_session(EP_A, {}))


async def test_a_stateless_server_restores_without_hooks(store: SnapshotStore) -> None:
    async with hosted(
        make_runtime(store, instance="tools-0", resources=StatelessTools())
    ) as runtime:
        await runtime.seed_session(EP_A, {})
        await runtime.prepare(FENCE, rid(), ckpt(1))
        committed = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        assert committed.exported == () and committed.artifacts[0].record_count == 0
    async with hosted(make_runtime(store, instance="tools-0", resources=StatelessTools())) as fresh:
        restored = await fresh.restore(
            FENCE, rid(), restore_id(1), "snap-1", committed.manifest, committed.artifacts, [EP_A]
        )
        assert restored.installed == ()


def test_an_exported_server_without_its_hooks_fails_at_startup(store: SnapshotStore) -> None:
    class Careless(StatelessTools):
        recovery_mode = RecoveryMode.EXPORTED

    with pytest.raises(ConfigurationError, match="export_sessions"):
        make_runtime(store, resources=Careless())


def test_a_group_scored_server_must_declare_replay_verifies(store: SnapshotStore) -> None:
    class Waiting(Tools):
        group_scored = True
        group_size = 4

    with pytest.raises(ConfigurationError, match="REPLAY"):
        make_runtime(store, resources=Waiting())


async def test_a_request_cancelled_while_waiting_for_resume_is_no_longer_counted(
    store: SnapshotStore,
) -> None:
    tools = Tools()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        await runtime.seed_session(EP_A, {})
        await runtime.prepare(FENCE, rid(), ckpt(1))
        call = asyncio.create_task(runtime.call_tool(EP_A, "check", {}))
        assert not await runtime.wait_until(lambda core: not core.ready, 0.05)
        call.cancel()
        await asyncio.wait([call])
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert runtime.core.ready
        assert state_of(runtime.core, EP_A, "session") is EpisodeState.IDLE
        assert tools.sessions[EP_A]["calls"] == 0


async def test_a_replay_verify_in_flight_does_not_block_prepare(store: SnapshotStore) -> None:
    tools = GroupTools()
    async with hosted(make_runtime(store, instance="tools-0", resources=tools)) as runtime:
        description = await runtime.describe()
        assert description.group_scored and description.verify_mode is VerifyMode.REPLAY
        await runtime.seed_session(EP_A, {})
        gate = tools.hold("verify")
        verify = asyncio.create_task(runtime.verify(EP_A, {"guess": 1}))
        await bounded(tools.entered["verify"].wait())
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1), timeout_s=1)
        assert prepared.readiness.ready
        # It finishes during the checkpoint, but its session stays in the frozen cut.
        gate.set()
        assert not await runtime.wait_until(lambda core: verify.done(), 0.05)
        committed = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [EP_A])
        assert committed.exported == (EP_A,)
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert (await bounded(verify)).reward == 0.0
        # Sealed until the coordinator retires the completed attempt (spec 5.3 item 3).
        assert state_of(runtime.core, EP_A, "session") is EpisodeState.IDLE
        await runtime.retire(FENCE, rid(), [EP_A])
        assert state_of(runtime.core, EP_A, "session") is None


# ====================================================== unreachable servers (spec 7.15)


class UnreachableAgent(Agent):
    """Seals boundary 0, generates through a policy that is unreachable ``failures``
    times, then calls a tool on a resources server unreachable as often."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.generations = 0
        self.tools = UnreachableTools(failures)

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        await ctx.boundary(0, {})
        generation = await ctx.generate((1, 2), 2, self._stream)
        reply = await ctx.call(self.tools, "check", {"guess": 3})
        return {"tokens": list(generation.token_ids), **reply}

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[GenerateChunk]:
        self.generations += 1
        if self.generations <= self.failures:
            raise TurnpointError(Reason.UNAVAILABLE, "the policy server is down")
        yield GenerateChunk((3, 4), (-0.1, -0.2), True, 1)


class UnreachableTools:
    """A resources connection whose server is unreachable for the first ``failures``
    calls (the lost server not yet replaced), then answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[str] = []

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> bool:
        raise AssertionError("not seeded in these tests")

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any], *, request_id: str
    ) -> Mapping[str, Any]:
        self.calls.append(request_id)
        if len(self.calls) <= self.failures:
            raise TurnpointError(Reason.UNAVAILABLE, "the resources server is down")
        return {"reply": "higher"}

    async def verify(
        self, episode: EpisodeId, answer: Mapping[str, Any], *, request_id: str
    ) -> Verdict:
        raise AssertionError("not verified in these tests")


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tool_client, "TOOL_RETRY_FIRST_DELAY_S", 0.001)
    monkeypatch.setattr(tool_client, "TOOL_RETRY_MAX_DELAY_S", 0.001)


@pytest.mark.usefixtures("quick_backoff")
async def test_an_episode_waits_for_its_unreachable_policy_and_tools_instead_of_failing(
    store: SnapshotStore,
) -> None:
    """A lost policy or resources server is replaced where it was (docs/spec.md section
    7.15): its calls are asked again past the three retries of a transient fault, with
    the same key, and the episode completes instead of failing (a failed episode would
    be trained with no verdict)."""
    agent = UnreachableAgent(failures=tool_client.TOOL_RETRIES + 2)
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        done = await Follower(runtime.run_episode(EP_A, {})).done()
    assert done.outcome is RunOutcome.COMPLETED, done.error_message
    assert done.result == {"tokens": [3, 4], "reply": "higher"}
    assert agent.generations == tool_client.TOOL_RETRIES + 3
    assert len(set(agent.tools.calls)) == 1  # one key, sent again


@pytest.mark.usefixtures("quick_backoff")
async def test_a_server_unreachable_for_longer_than_the_wait_fails_the_episode(
    store: SnapshotStore,
) -> None:
    agent = UnreachableAgent(failures=1_000_000)
    config = replace(FAST, unreachable_wait_s=0.01)
    async with hosted(make_runtime(store, agent=agent, config=config)) as runtime:
        done = await Follower(runtime.run_episode(EP_A, {})).done()
    assert done.outcome is RunOutcome.FAILED
    assert "the policy server is down" in done.error_message


async def test_a_model_awaiting_weights_refuses_generations_until_its_first_update(
    store: SnapshotStore,
) -> None:
    """A policy server started to replace a lost one serves the trainer's current
    weights, never its initial ones (docs/spec.md section 7.15 item 1)."""
    model = WeightedStreamer()
    config = replace(FAST, await_weights=True)
    async with hosted(make_runtime(store, instance="policy-0", model=model, config=config)) as (
        runtime
    ):
        refused = Collector(runtime.generate(EP_A, GenerateRequest((1,), 1)))
        await bounded(refused.task)
        assert isinstance(refused.error, TurnpointError)
        assert refused.error.reason is Reason.UNAVAILABLE
        assert model.started == []
        assert runtime.model is not None
        assert await runtime.model.update_weights(7, b"weights", "push-7") == 7
        model.feeds[EP_A].put_nowait(None)
        served = Collector(runtime.generate(EP_A, GenerateRequest((1,), 1)))
        await bounded(served.task)
        assert served.error is None and model.started == [EP_A]


class WeightedStreamer(Streamer):
    async def update_weights(self, weights_version: int, state: bytes) -> int:
        return weights_version


# ====================================================================== models


async def test_a_started_stream_drains_before_prepare_is_ready_and_new_calls_are_held(
    store: SnapshotStore,
) -> None:
    model = Streamer()
    request = GenerateRequest((1, 2), 4)
    async with hosted(make_runtime(store, instance="policy-0", model=model)) as runtime:
        streaming = Collector(runtime.generate(EP_A, request))
        model.feeds[EP_A].put_nowait(5)
        await bounded(runtime.wait_until(lambda core: not core.ready))
        prepare = asyncio.create_task(runtime.prepare(FENCE, rid(), ckpt(1)))
        await bounded(runtime.wait_until(lambda core: core.phase is Phase.PREPARING))
        # A new generation is held at the gate: not started, not counted.
        held = Collector(runtime.generate(EP_B, request))
        model.feeds[EP_B].put_nowait(None)
        model.feeds[EP_A].put_nowait(None)  # the started stream drains
        prepared = await bounded(prepare)
        assert prepared.readiness.ready
        await bounded(streaming.task)
        assert [c.token_ids for c in streaming.chunks] == [(5,), ()]
        assert model.started == [EP_A] and not held.task.done()
        await runtime.resume(FENCE, rid(), ckpt(1))
        await bounded(held.task)
        assert model.started == [EP_A, EP_B] and held.chunks[-1].done


async def test_retire_stops_a_running_generation_before_it_replies(store: SnapshotStore) -> None:
    model = Streamer()
    async with hosted(make_runtime(store, instance="policy-0", model=model)) as runtime:
        streaming = Collector(runtime.generate(EP_A, GenerateRequest((1,), 4)))
        await bounded(runtime.wait_until(lambda core: not core.ready))
        retired = await runtime.retire(FENCE, rid(), [EP_A])
        assert retired.stopped == (EP_A,)
        assert model.cancelled == [EP_A]
        await bounded(streaming.task)
        assert isinstance(streaming.error, TurnpointError)
        assert streaming.error.reason is Reason.STALE_ATTEMPT


async def test_model_restore_refuses_a_server_that_already_served(store: SnapshotStore) -> None:
    model = Streamer()
    async with hosted(make_runtime(store, instance="policy-0", model=model)) as runtime:
        model.feeds[EP_A].put_nowait(None)
        collector = Collector(runtime.generate(EP_A, GenerateRequest((1,), 1)))
        await bounded(collector.task)
        await runtime.prepare(FENCE, rid(), ckpt(1))
        committed = await runtime.commit(FENCE, rid(), ckpt(1), "snap-1", [])
        await runtime.resume(FENCE, rid(), ckpt(1))
        error = await expect(
            Reason.INVALID_PHASE,
            runtime.restore(
                FENCE, rid(), restore_id(1), "snap-1", committed.manifest, committed.artifacts, []
            ),
        )
        assert error.metadata["fresh"] == "false"
