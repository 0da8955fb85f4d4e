"""Random sequences of data-plane and control events against ONE participant over gRPC.

A hypothesis ``RuleBasedStateMachine`` drives a scripted agent participant (served on
``127.0.0.1:0`` with token auth) through both control doors: episodes start, seal
boundaries, finish, are acknowledged or cancelled; checkpoints are prepared, committed
(sometimes after a failed write), resumed or left to expire on a fake clock; attempts
are retired and forgotten; committed snapshots are restored into fresh participants.
After every step the invariants of the protocol are checked against the participant's
own state, its answers on the wire and the files on disk.

The event loop runs in a background thread for the whole test; each example gets a
fresh participant, and every wait is bounded and event-driven (the participant's own
condition), so an example takes milliseconds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.support.fakes import FakeClock, boundary_of, state_of
from tests.support.participants import TOKEN
from tests.support.scripted import (
    RunCall,
    ScriptedAgent,
    Wire,
    ckpt,
    host_scripted,
    restore_id,
    wire_to,
)
from turnpoint.convert import struct_to_dict
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import ParticipantRuntime, RuntimeConfig, SnapshotStore
from turnpoint.participant_sdk.testing import StoreFaults
from turnpoint.protocol import ArtifactRef, EpisodeState, Phase
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2 as ro_pb
from turnpoint.v1 import types_pb2

T = TypeVar("T")

INSTANCE = "agent-0"
TURNS = 3
TASK = {"turns": TURNS}
LEASE_S = 60.0
MAX_EPISODES = 6
DOORS = st.sampled_from(["unary", "session"])
PICK = st.integers(min_value=0, max_value=MAX_EPISODES - 1)
# A not-ready prepare is answered 20 ms after it arrives, and its answer then has almost
# two seconds to come back before the caller's deadline. The budget for the way back was
# 180 ms, and one CI run (all 1,289 tests in one process, a large heap) missed it once:
# DEADLINE_EXCEEDED, which hypothesis's replay could not reproduce. The participant's
# wait is what the machine checks; the slack only has to outlast any pause of the loop.
CONFIG = RuntimeConfig(model_retry_backoff_s=0.01, reply_margin_s=1.98, reply_margin_fraction=0.99)
NOT_READY_TIMEOUT_S = 2.0
BOUND_S = 20.0


class LoopThread:
    """One asyncio loop in a background thread; the machine submits coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(BOUND_S)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(BOUND_S)
        self.loop.close()


@dataclass
class Ep:
    """What the machine knows of one episode; ``expected`` is the state it must have."""

    episode: EpisodeId
    call: RunCall
    released: int = 0
    parked: bool = False
    restart: bool = False
    cancelled: bool = False
    completed: bool = False
    acked: bool = False
    retired: bool = False
    forgotten: bool = False

    @property
    def live(self) -> bool:
        return not (self.retired or self.acked)

    @property
    def runnable(self) -> bool:
        """Waiting for its next step (not parked, not over)."""
        return self.live and not (self.cancelled or self.completed or self.parked)

    def expected(self) -> EpisodeState | None:
        if not self.live:
            return None
        if self.cancelled:
            if self.released == 0:
                return None
            return EpisodeState.RESTART if self.restart else EpisodeState.PARKED
        if self.restart:
            return EpisodeState.RESTART
        if self.completed:
            return EpisodeState.COMPLETED_UNACKED
        return EpisodeState.PARKED if self.parked else EpisodeState.RUNNING


@dataclass
class Checkpoint:
    id: str
    snapshot: str
    prepared: pb.PrepareResponse | None = None
    scope: tuple[EpisodeId, ...] | None = None
    first_export: dict[EpisodeId, Any] | None = None
    answer: pb.CommitResponse | None = None


@dataclass
class Committed:
    snapshot: str
    answer: pb.CommitResponse
    first_export: dict[EpisodeId, Any]
    excluded: frozenset[EpisodeId]
    restored: bool = False


@dataclass
class World:
    root: Path
    hosted: HostedParticipant
    agent: ScriptedAgent
    clock: FakeClock
    faults: StoreFaults
    wires: dict[str, Wire] = field(default_factory=dict)
    stack: AsyncExitStack = field(default_factory=AsyncExitStack)


def ref_of(answer: pb.CommitResponse) -> ArtifactRef:
    m = answer.manifest
    return ArtifactRef(m.path, m.sha256, m.size_bytes, m.record_count)


def episodes_of(messages: Any) -> list[EpisodeId]:
    return [EpisodeId(m.rollout_id, m.attempt) for m in messages]


async def _open_world(root: Path) -> World:
    agent, clock, faults = ScriptedAgent(), FakeClock(), StoreFaults()
    runtime = ParticipantRuntime(
        INSTANCE,
        SnapshotStore(root, faults=faults),
        agent=agent,
        config=CONFIG,
        clock=clock,
    )
    # No lease task: the machine expires leases by moving the fake clock.
    hosted = host_participant(runtime, ServerOptions(port=0, token=TOKEN))
    await hosted.server.start()
    world = World(root, hosted, agent, clock, faults)
    world.stack.push_async_callback(hosted.stop, 0)
    for door in ("unary", "session"):
        world.wires[door] = await world.stack.enter_async_context(wire_to(hosted, door))
    return world


class ParticipantMachine(RuleBasedStateMachine):
    loop: LoopThread  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="turnpoint-sm-"))
        self.root = self.tmp / "snapshots"
        self.world = self.loop.run(_open_world(self.root))
        self.eps: list[Ep] = []
        self.sequence = 0
        self.active: Checkpoint | None = None
        self.finished: list[str] = []
        self.committed: list[Committed] = []
        self.never_published: set[str] = set()
        self.lease_expiries = 0

    # ------------------------------------------------------------------ helpers

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(coroutine)

    @property
    def runtime(self) -> ParticipantRuntime:
        return self.world.hosted.runtime

    @property
    def open(self) -> bool:
        return self.active is None

    def wire(self, door: str) -> Wire:
        return self.world.wires[door]

    def pick(self, index: int, predicate: Any) -> Ep | None:
        chosen = [ep for ep in self.eps if predicate(ep)]
        return chosen[index % len(chosen)] if chosen else None

    def blockers(self) -> int:
        blocking = {EpisodeState.RUNNING, EpisodeState.COMPLETED_UNACKED}
        return sum(1 for ep in self.eps if ep.expected() in blocking)

    def refused(self, coroutine: Coroutine[Any, Any, object]) -> Reason:
        async def attempt() -> Reason:
            try:
                await coroutine
            except TurnpointError as error:
                return error.reason
            raise AssertionError("the call was expected to be refused")

        return self.run(attempt())

    def settle(self) -> None:
        expected = {ep.episode: ep.expected() for ep in self.eps}

        def matches(core: Any) -> bool:
            return all(state_of(core, e) is s for e, s in expected.items())

        if not self.run(self.runtime.wait_until(matches, BOUND_S)):
            actual = {e: state_of(self.runtime.core, e) for e in expected}
            raise AssertionError(f"states {actual} never became {expected}")

    def end_active(self) -> None:
        """Bookkeeping once the active checkpoint ended (resume or lease expiry)."""
        assert self.active is not None
        if self.active.answer is None:
            self.never_published.add(self.active.snapshot)
        self.finished.append(self.active.id)
        self.active = None
        for ep in self.eps:
            if ep.parked:
                ep.parked = False
                ep.completed = ep.released == TURNS and not ep.cancelled
        self.settle()

    # ------------------------------------------------------------------ data plane

    @initialize(count=st.integers(min_value=0, max_value=3))
    def some_episodes_run(self, count: int) -> None:
        for _ in range(count):
            self.start()

    @precondition(lambda self: len(self.eps) < MAX_EPISODES)
    @rule()
    def start(self) -> None:
        episode = EpisodeId(f"rollout-{len(self.eps)}", 0)

        async def begin() -> RunCall:
            return self.wire("unary").run(episode, TASK)

        call = self.run(begin())
        if not self.open:
            assert self.run(call.refused()).reason is Reason.ADMISSION_CLOSED
            assert state_of(self.runtime.core, episode) is None
            return
        self.eps.append(Ep(episode, call))
        self.settle()

    @rule(index=PICK, restart=st.booleans())
    def boundary(self, index: int, restart: bool) -> None:
        ep = self.pick(index, lambda e: e.runnable and e.released < TURNS)
        if ep is not None:
            self._step(ep, restart)

    def _step(self, ep: Ep, restart: bool) -> None:
        if restart and self.open and not ep.restart:
            # The agent finds it cannot capture this episode before its next boundary.
            self.world.agent.restart_before_boundary.add(ep.episode)
            ep.restart = True
        ep.released += 1
        self.world.agent.release(ep.episode)
        target = ep.released
        self.run(
            self.runtime.wait_until(lambda core: boundary_of(core, ep.episode) == target, BOUND_S)
        )
        if not self.open and not ep.restart:
            ep.parked = True
        elif ep.released == TURNS:
            ep.completed = True
        self.settle()

    @precondition(lambda self: self.active is not None)
    @rule()
    def drain_for_the_checkpoint(self) -> None:
        """What a coordinator waits for: results acknowledged, running episodes parked."""
        for ep in self.eps:
            if ep.live and ep.completed and not ep.restart:
                self._acknowledge(ep)
            elif ep.runnable and ep.released < TURNS and not ep.restart:
                self._step(ep, restart=False)

    @precondition(lambda self: self.active is None)
    @rule(index=PICK)
    def finish(self, index: int) -> None:
        ep = self.pick(index, lambda e: e.runnable)
        if ep is None:
            return
        self.world.agent.release(ep.episode, TURNS - ep.released)
        ep.released = TURNS
        result = self.run(ep.call.done())
        assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED
        assert struct_to_dict(result.result)["history"] == list(range(TURNS))
        ep.completed = True
        self.settle()

    @rule(index=PICK)
    def acknowledge(self, index: int) -> None:
        ep = self.pick(index, lambda e: e.live and e.completed)
        if ep is not None:
            self._acknowledge(ep)

    def _acknowledge(self, ep: Ep) -> None:
        result = self.run(ep.call.done())
        assert self.run(self.wire("unary").acknowledge([result.receipt])) == 1
        ep.acked = True
        self.settle()

    @rule(index=PICK)
    def cancel(self, index: int) -> None:
        ep = self.pick(index, lambda e: e.live and not e.cancelled and not e.completed)
        if ep is None:
            return
        self.run(ep.call.cancel())
        ep.cancelled = True
        self.settle()

    @rule(index=PICK)
    def late_run_of_a_retired_attempt(self, index: int) -> None:
        ep = self.pick(index, lambda e: e.retired and not e.forgotten)
        if ep is None:
            return

        async def late() -> RunCall:
            return self.wire("unary").run(ep.episode, TASK)

        call = self.run(late())
        assert self.run(call.refused()).reason is Reason.STALE_ATTEMPT

    # ------------------------------------------------------------------ control

    @rule(door=DOORS, supersede=st.booleans())
    def prepare(self, door: str, supersede: bool) -> None:
        wire = self.wire(door)
        if self.active is None or supersede:
            if self.active is not None:
                # A higher id replaces the open checkpoint without reopening admission.
                if self.active.answer is None:
                    self.never_published.add(self.active.snapshot)
                self.finished.append(self.active.id)
            self.sequence += 1
            self.active = Checkpoint(ckpt(self.sequence), f"snap-{self.sequence}")
        checkpoint = self.active
        blockers = self.blockers()
        timeout_s = 5.0 if blockers == 0 else NOT_READY_TIMEOUT_S
        answer = self.run(wire.prepare(checkpoint.id, lease_s=LEASE_S, timeout_s=timeout_s))
        assert answer.checkpoint_id == checkpoint.id
        assert answer.readiness.blocker_count == blockers, (answer, self.eps)
        assert answer.readiness.ready == (blockers == 0)
        if blockers:
            assert answer.phase == types_pb2.PHASE_PREPARING
        elif checkpoint.prepared is not None:
            # A repeat of a ready prepare replays the recorded answer, as it was.
            assert answer.readiness == checkpoint.prepared.readiness
            assert answer.phase == checkpoint.prepared.phase
            return
        elif answer.phase == types_pb2.PHASE_PREPARED:
            checkpoint.prepared = answer
        # Restarts are never capped, and every one is reported.
        restarts = sorted(ep.episode for ep in self.eps if ep.live and ep.restart)
        assert episodes_of(answer.readiness.restarts) == restarts

    def _scope(self) -> tuple[EpisodeId, ...]:
        return tuple(ep.episode for ep in self.eps if not ep.retired and not ep.restart)

    @precondition(lambda self: self.active is not None)
    @rule(door=DOORS)
    def commit(self, door: str) -> None:
        checkpoint = self.active
        assert checkpoint is not None
        wire = self.wire(door)
        if checkpoint.scope is None:
            checkpoint.scope = self._scope()
        call = wire.commit(checkpoint.id, checkpoint.snapshot, checkpoint.scope)
        if self.blockers():
            assert self.refused(call) is Reason.INVALID_PHASE
            return
        if checkpoint.answer is not None:
            assert self.run(call) == checkpoint.answer
            return
        exports = len(self.world.agent.exports)
        answer = self.run(call)
        if checkpoint.first_export is None:
            fresh = self.world.agent.exports[exports:]
            checkpoint.first_export = dict(fresh[0]) if fresh else {}
        else:
            # A write that failed is redone with the same records, never a new cut.
            assert len(self.world.agent.exports) == exports
        expected = sorted(
            ep.episode
            for ep in self.eps
            if ep.episode in checkpoint.scope and ep.expected() is EpisodeState.PARKED
        )
        assert episodes_of(answer.exported) == expected
        assert sorted(checkpoint.first_export) == expected
        checkpoint.answer = answer
        excluded = frozenset(ep.episode for ep in self.eps if ep.retired or ep.restart)
        self.committed.append(
            Committed(checkpoint.snapshot, answer, checkpoint.first_export, excluded)
        )
        assert self.runtime.core.phase is Phase.COMMITTED

    @precondition(lambda self: self.active is not None and self.active.answer is None)
    @rule(door=DOORS)
    def commit_whose_write_fails(self, door: str) -> None:
        checkpoint = self.active
        assert checkpoint is not None
        if self.blockers():
            return
        if checkpoint.scope is None:
            checkpoint.scope = self._scope()
        exports = len(self.world.agent.exports)
        self.world.faults.fail_writes(1)
        call = self.wire(door).commit(checkpoint.id, checkpoint.snapshot, checkpoint.scope)
        assert self.refused(call) is Reason.STORAGE_UNAVAILABLE
        if checkpoint.first_export is None:
            fresh = self.world.agent.exports[exports:]
            checkpoint.first_export = dict(fresh[0]) if fresh else {}
        assert not SnapshotStore(self.root).exists(checkpoint.snapshot, INSTANCE)

    @rule(door=DOORS, fail_first=st.booleans())
    def a_whole_checkpoint(self, door: str, fail_first: bool) -> None:
        """The coordinator's happy path in one step: prepare, drain, (fail a write,) commit."""
        self.prepare(door, supersede=False)
        self.drain_for_the_checkpoint()
        assert self.active is not None
        if fail_first and self.active.answer is None:
            self.commit_whose_write_fails(door)
        self.commit(door)

    @rule(door=DOORS)
    def resume(self, door: str) -> None:
        wire = self.wire(door)
        if self.active is None:
            # Idempotent, also for ids it never saw or already ended.
            stale = self.finished[-1] if self.finished else make_checkpoint_id("never", 1)
            answer = self.run(wire.resume(stale))
            assert not answer.ended_active and self.runtime.core.admission_open
            return
        answer = self.run(wire.resume(self.active.id))
        assert answer.ended_active
        self.end_active()

    @precondition(lambda self: self.active is not None)
    @rule()
    def lease_expiry(self) -> None:
        assert self.active is not None
        self.world.clock.advance(LEASE_S + 1)
        assert self.run(self.runtime.check_lease()) == self.active.id
        self.lease_expiries += 1
        self.end_active()

    @rule(door=DOORS, index=PICK)
    def retire(self, door: str, index: int) -> None:
        ep = self.pick(index, lambda e: not e.retired)
        if ep is None:
            return
        call = self.wire(door).retire([ep.episode])
        if not self.open:
            assert self.refused(call) is Reason.INVALID_PHASE
            return
        had_entry = ep.expected() is not None
        stopped = episodes_of(self.run(call).stopped)
        assert stopped == ([ep.episode] if had_entry else [])
        ep.retired = True
        self.settle()

    @rule(door=DOORS, index=PICK)
    def forget(self, door: str, index: int) -> None:
        ep = self.pick(index, lambda e: e.retired and not e.forgotten)
        if ep is None:
            return
        call = self.wire(door).forget([ep.episode.rollout_id])
        if not self.open:
            assert self.refused(call) is Reason.INVALID_PHASE
            return
        assert self.run(call).forgotten == 1
        ep.forgotten = True

    @precondition(lambda self: bool(self.committed))
    @rule(door=DOORS, index=PICK)
    def restore_into_a_fresh_participant(self, door: str, index: int) -> None:
        snapshot = self.committed[index % len(self.committed)]
        self.run(self._restore(snapshot, door, run_on=True))

    async def _restore(self, snapshot: Committed, door: str, *, run_on: bool) -> None:
        agent = ScriptedAgent()
        saved = episodes_of(snapshot.answer.exported)
        async with (
            host_scripted(self.root, instance=INSTANCE, agent=agent) as hosted,
            wire_to(hosted, door) as fresh,
        ):
            rid_ = restore_id(len(self.committed) + 1)
            restored = await fresh.restore(rid_, snapshot.snapshot, snapshot.answer, saved)
            assert episodes_of(restored.installed) == [e.next_attempt() for e in saved]
            status = await fresh.status()
            assert status.phase == types_pb2.PHASE_RESTORED and not status.admission_open
            await fresh.resume(rid_)
            if run_on:
                for episode in saved:
                    turn = snapshot.first_export[episode]["history"][-1]
                    follow = fresh.run(episode.next_attempt(), TASK)
                    agent.release(episode.next_attempt(), TURNS - turn - 1)
                    result = await follow.done()
                    assert struct_to_dict(result.result)["history"] == list(range(TURNS))
        snapshot.restored = True

    # ------------------------------------------------------------------ invariants

    @invariant()
    def the_protocol_holds(self) -> None:
        core = self.runtime.core
        status = self.run(self.wire("unary").status(max_blockers=1))
        # Admission is open exactly when the phase is idle, in the core and on the wire.
        assert core.admission_open == (core.phase is Phase.IDLE)
        assert status.admission_open == (status.phase == types_pb2.PHASE_IDLE)
        assert status.admission_open == core.admission_open == self.open
        # The incremental blocker count equals a fresh recount.
        blockers, by_state = core.recount()
        assert core.blocker_count == blockers == status.readiness.blocker_count
        assert dict(core.readiness(0).counts) == {s: c for s, c in by_state.items() if c}
        assert core.lease_expiries == self.lease_expiries == status.lease_expiries
        for ep in self.eps:
            assert state_of(core, ep.episode) is ep.expected(), ep
        store = SnapshotStore(self.root)
        for snapshot in self.committed:
            # Every manifest verifies and is what its commit answered; the records are
            # the first export, however many writes it took.
            entry = store.read_entry(snapshot.snapshot, INSTANCE)
            assert entry.manifest == ref_of(snapshot.answer)
            loaded = store.read(snapshot.snapshot, INSTANCE, ref_of(snapshot.answer))
            assert {r.episode: r.payload["state"] for r in loaded.records} == dict(
                snapshot.first_export
            )
            # No commit includes a retired attempt or a restart.
            assert not set(episodes_of(snapshot.answer.exported)) & snapshot.excluded
        for name in self.never_published:
            if not any(c.snapshot == name for c in self.committed):
                assert not store.exists(name, INSTANCE), name

    def teardown(self) -> None:
        try:
            # Every committed snapshot restores (the ones no rule restored yet).
            for snapshot in self.committed:
                if not snapshot.restored:
                    self.run(self._restore(snapshot, "session", run_on=False))
        finally:
            self.run(self.world.stack.aclose())
            shutil.rmtree(self.tmp, ignore_errors=True)


# ~30 s alone on 2 cores; the bound leaves room for a machine shared with other suites.
@pytest.mark.timeout(300)
def test_participant_state_machine() -> None:
    loop = LoopThread()
    ParticipantMachine.loop = loop
    try:
        run_state_machine_as_test(
            ParticipantMachine,
            settings=settings(
                max_examples=int(os.environ.get("TURNPOINT_SM_EXAMPLES", "200")),
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        loop.close()
