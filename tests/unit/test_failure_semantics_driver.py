"""Failure semantics of the snapshot driver, against a small scripted coordinator and
rollout side on a fake clock (the snapshot layout is real, in a temporary directory).

- refusal marks are forgotten once nothing of the rollout can arrive (docs/spec.md
  section 7.6 item 6);
- an ended attempt is retired on its agent and on every resources server (7.6 item 2);
- the deadline hold outlives a snapshot whose resume failed somewhere until that
  participant is known resumed (7.4 step 8);
- a participant that finished a far-future id moves the next id past it (7.2 item 4).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId, checkpoint_sequence, make_checkpoint_id
from turnpoint.protocol import ParticipantKind, RecoveryMode, VerifyMode
from turnpoint.trainer.anchors.source import WrittenAnchor
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.control.failures import Failure, FailureKind
from turnpoint.trainer.control.outcomes import (
    ControlReport,
    PreparedCheckpoint,
    PrepareFailed,
)
from turnpoint.trainer.control.topology import ParticipantInfo, Topology
from turnpoint.trainer.rollouts.deadlines import DeadlineRegistry, Hold
from turnpoint.trainer.rollouts.side import InFlightRollout, UnackedDecision
from turnpoint.trainer.snapshots.driver import EPOCH_STRIDE, SnapshotDriver
from turnpoint.trainer.snapshots.preparing import UnackedResolver
from turnpoint.trainer.snapshots.report import FailureReason, SnapshotOutcome
from turnpoint.trainer.storage.layout import SnapshotLayout, tree_digest
from turnpoint.trainer.storage.manifest import (
    AnchorRef,
    ParticipantEntry,
    RolloutBooks,
    TrainerRolloutState,
)

AGENT, TOOLS, GROUP_TOOLS, MODEL = "agent-0", "tools", "group-tools", "model-0"
DOWN = Failure(FailureKind.TRANSIENT, None, grpc.StatusCode.UNAVAILABLE, "down")
STALE = Failure(FailureKind.INVARIANT, Reason.STALE_CHECKPOINT, grpc.StatusCode.ABORTED, "stale")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def info(instance: str, kind: ParticipantKind) -> ParticipantInfo:
    return ParticipantInfo(
        instance=instance,
        kind=kind,
        incarnation="inc-1",
        protocol_version="turnpoint.v1",
        recovery_mode=RecoveryMode.EXPORTED,
        verify_mode=VerifyMode.REPLAY,
        group_scored=False,
        group_size=0,
        supported_levels=frozenset(),
        environment="guess",
    )


TOPOLOGY = Topology(
    {
        AGENT: info(AGENT, ParticipantKind.AGENT),
        TOOLS: info(TOOLS, ParticipantKind.RESOURCES),
        GROUP_TOOLS: info(GROUP_TOOLS, ParticipantKind.RESOURCES),
        MODEL: info(MODEL, ParticipantKind.MODEL),
    }
)


def descriptor(episode: EpisodeId) -> InFlightRollout:
    return InFlightRollout(
        episode=episode,
        instance=AGENT,
        prompt_group_id=f"g-{episode.rollout_id}",
        sibling_index=0,
        group_size=1,
        environment="guess",
        boundaries_seen=1,
        task={"prompt": episode.rollout_id},
    )


class Books:
    """A RolloutSide: what is live, queued and owed a retire, set by the test."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.version = 1
        self.deadlines: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
        self.live: list[InFlightRollout] = []
        self.queued: list[EpisodeId] = []
        self.retires: dict[str, set[EpisodeId]] = {}
        self.closed_to: set[str] = set()

    def close_dispatch(self) -> None:
        pass

    def reopen_dispatch(self) -> None:
        pass

    def close_dispatch_to(self, instance: str) -> None:
        self.closed_to.add(instance)

    def reopen_dispatch_to(self, instance: str) -> None:
        self.closed_to.discard(instance)

    def hold_deadlines(self, name: str) -> Hold:
        return self.deadlines.hold(name, self.clock())

    def release_deadlines(self, hold: Hold) -> None:
        self.deadlines.release(hold, self.clock())

    async def drain_acknowledgements(self, timeout_s: float) -> None:
        return None

    def in_flight(self) -> Sequence[InFlightRollout]:
        return tuple(self.live)

    def rollout_state(self) -> TrainerRolloutState:
        queue = tuple(
            {"rollout_id": e.rollout_id, "attempt": e.attempt, "prompt_group_id": "g"}
            for e in self.queued
        )
        in_flight = tuple(
            {
                "rollout_id": r.episode.rollout_id,
                "attempt": r.episode.attempt,
                "instance": r.instance,
                "prompt_group_id": r.prompt_group_id,
                "sibling_index": 0,
                "group_size": 1,
                "environment": r.environment,
                "boundaries_seen": r.boundaries_seen,
                "task": dict(r.task),
                "accepted": True,
            }
            for r in self.live
        )
        attempts = {e.rollout_id: e.attempt for e in self.queued} | {
            r.episode.rollout_id: r.episode.attempt for r in self.live
        }
        return TrainerRolloutState(queue=queue, attempts=attempts, in_flight=in_flight)

    def rollout_books(self) -> RolloutBooks:
        state = self.rollout_state()
        return RolloutBooks(state.queue, state.data_loader, state.attempts, state.in_flight)

    async def resolve_unacknowledged(
        self, instance: str, episode: EpisodeId, receipt_id: str
    ) -> UnackedDecision:
        return "acknowledge"

    def pending_retires(self) -> Mapping[str, Sequence[EpisodeId]]:
        return {k: tuple(sorted(v)) for k, v in self.retires.items() if v}

    def retired(self, instance: str, episodes: Sequence[EpisodeId]) -> None:
        self.retires.get(instance, set()).difference_update(episodes)

    def pending_session_retires(self) -> Sequence[EpisodeId]:
        return ()

    def sessions_retired(self, episodes: Sequence[EpisodeId]) -> None:
        pass


class Anchor:
    step = 1

    async def write(self, snapshot: Path) -> WrittenAnchor:
        directory = snapshot / "trainer" / "anchor"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "state.bin").write_bytes(f"step {self.step}".encode())
        return WrittenAnchor(AnchorRef(sha256=tree_digest(directory)), self.step)


@dataclass
class Participants:
    """A SnapshotParticipants: every participant answers, except as scripted; each
    participant keeps its refusal marks as a real one would."""

    topology: Topology = TOPOLOGY
    resume_failures: list[Mapping[str, Failure]] = field(default_factory=list)
    retire_failures: list[Mapping[str, Failure]] = field(default_factory=list)
    prepare_failures: list[tuple[Mapping[str, Failure], int | None]] = field(default_factory=list)
    marks: dict[str, set[str]] = field(default_factory=dict)
    retires: list[dict[str, tuple[EpisodeId, ...]]] = field(default_factory=list)
    forgets: list[dict[str, tuple[str, ...]]] = field(default_factory=list)
    prepares: list[str] = field(default_factory=list)

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        resolve: UnackedResolver | None = None,
        snapshot: str | None = None,
    ) -> PreparedCheckpoint:
        self.prepares.append(checkpoint_id)
        if self.prepare_failures:
            failures, finished_through = self.prepare_failures.pop(0)
            raise PrepareFailed(checkpoint_id, failures, finished_through=finished_through)
        return PreparedCheckpoint(checkpoint_id, {}, {}, {})

    @asynccontextmanager
    async def held(self, checkpoint: PreparedCheckpoint) -> AsyncIterator[PreparedCheckpoint]:
        try:
            yield checkpoint
        finally:
            checkpoint.release = await self.resume(checkpoint.checkpoint_id)

    async def commit(
        self, checkpoint_id: str, snapshot: str, scope: Mapping[str, Iterable[EpisodeId]]
    ) -> dict[str, ParticipantEntry]:
        return {
            name: ParticipantEntry(instance=name, kind=p.kind, artifacts=(), manifest=None)
            for name, p in self.topology.participants.items()
        }

    async def resume(
        self, checkpoint_id: str, instances: Iterable[str] | None = None
    ) -> ControlReport:
        chosen = set(instances) if instances is not None else set(self.topology.instances)
        scripted = self.resume_failures.pop(0) if self.resume_failures else {}
        failures = {k: v for k, v in scripted.items() if k in chosen}
        return ControlReport("resume", checkpoint_id, frozenset(chosen - set(failures)), failures)

    async def retire(
        self, episodes: Mapping[str, Iterable[EpisodeId]], *, key: str | None = None
    ) -> ControlReport:
        chosen = {k: tuple(v) for k, v in episodes.items()}
        self.retires.append(chosen)
        scripted = self.retire_failures.pop(0) if self.retire_failures else {}
        failures = {k: v for k, v in scripted.items() if k in chosen}
        for name, items in chosen.items():
            if name not in failures:
                self.marks.setdefault(name, set()).update(e.rollout_id for e in items)
        return ControlReport("retire", key or "k", frozenset(set(chosen) - set(failures)), failures)

    async def forget(self, rollout_ids: Mapping[str, Iterable[str]]) -> ControlReport:
        chosen = {k: tuple(v) for k, v in rollout_ids.items()}
        self.forgets.append(chosen)
        for name, ids in chosen.items():
            self.marks.get(name, set()).difference_update(ids)
        return ControlReport("forget", "k", frozenset(chosen), {})


@dataclass
class World:
    clock: Clock
    books: Books
    participants: Participants
    layout: SnapshotLayout
    config: CoordinatorConfig
    driver: SnapshotDriver

    async def publish(self) -> str:
        """Take a snapshot that must publish (something changed since the last one)."""
        self.books.version += 1
        report = await self.driver.take()
        assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
        return report.checkpoint_id


def make_world(tmp_path: Path, **config: Any) -> World:
    clock = Clock()
    settings = CoordinatorConfig(snapshot_root=tmp_path, keep_snapshots=2, **config)
    books = Books(clock)
    participants = Participants()
    layout = SnapshotLayout(tmp_path)
    driver = SnapshotDriver(
        coordinator=participants,
        rollouts=books,
        anchor=Anchor(),
        layout=layout,
        config=settings,
        epoch=3,
        clock=clock,
    )
    return World(clock, books, participants, layout, settings, driver)


def marked(world: World) -> dict[str, set[str]]:
    return {name: ids for name, ids in world.participants.marks.items() if ids}


# ------------------------------------------------------------------- forget (item 1)


async def test_marks_are_forgotten_once_no_retained_snapshot_can_continue_the_rollout(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path)
    gone, rerun = EpisodeId("gone", 0), EpisodeId("again", 0)
    # Both were in flight at the first snapshot: it could continue them.
    world.books.live = [descriptor(gone), descriptor(rerun)]
    await world.publish()
    # Then both were abandoned: "gone" for good, "again" reruns as attempt 1.
    world.books.live = [descriptor(EpisodeId("again", 1))]
    world.books.retires = {AGENT: {gone, rerun}}

    await world.publish()  # retires them; the first snapshot still names both
    assert marked(world) == {name: {"gone", "again"} for name in (AGENT, TOOLS, GROUP_TOOLS)}
    await world.publish()  # the first snapshot left retention only after this one's cut
    assert world.participants.forgets == []

    await world.publish()  # nothing retained names "gone" any more

    assert world.participants.forgets == [{name: ("gone",) for name in (AGENT, GROUP_TOOLS, TOOLS)}]
    # "again" is still live in the books: its mark stays.
    assert marked(world) == {name: {"again"} for name in (AGENT, TOOLS, GROUP_TOOLS)}
    assert world.driver.refusal_marks == {
        name: frozenset({"again"}) for name in (AGENT, TOOLS, GROUP_TOOLS)
    }

    # Once its rerun is finished and trained on, the next snapshots forget it too.
    world.books.live = []
    for _ in range(3):
        await world.publish()
    assert marked(world) == {}
    assert world.driver.refusal_marks == {}


async def test_a_queued_result_keeps_its_mark_until_it_is_consumed(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    given_up = EpisodeId("slow", 0)
    world.books.queued = [given_up]  # recorded as given up, not yet trained on
    world.books.retires = {AGENT: {given_up}}
    for _ in range(4):
        await world.publish()
    assert marked(world)[AGENT] == {"slow"}

    world.books.queued = []
    for _ in range(3):
        await world.publish()
    assert marked(world) == {}


async def test_nothing_is_forgotten_on_a_participant_still_closed(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.books.retires = {AGENT: {EpisodeId("gone", 0)}}
    # The agent's release fails from the first snapshot on: Forget, like Retire, waits.
    world.participants.resume_failures = [{AGENT: DOWN}] * 10
    for _ in range(3):
        await world.publish()

    assert AGENT not in {name for forget in world.participants.forgets for name in forget}
    assert marked(world) == {AGENT: {"gone"}}

    world.participants.resume_failures = []
    await world.publish()  # released at last, then forgotten there too

    assert marked(world) == {}


# ------------------------------------------------- retires reach resources (item 2)


async def test_an_ended_attempt_is_retired_on_its_agent_and_every_resources_server(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path)
    ended = EpisodeId("r0", 0)
    world.books.retires = {AGENT: {ended}}
    # The first retire fails on one resources server: nothing is settled yet.
    world.participants.retire_failures = [{TOOLS: DOWN}]

    failed = await world.driver.take()

    assert failed.outcome is SnapshotOutcome.FAILED
    assert world.participants.retires == [{AGENT: (ended,), TOOLS: (ended,), GROUP_TOOLS: (ended,)}]
    assert world.books.pending_retires() == {AGENT: (ended,)}

    await world.publish()

    assert world.participants.retires[-1] == {
        AGENT: (ended,),
        TOOLS: (ended,),
        GROUP_TOOLS: (ended,),
    }
    assert world.books.pending_retires() == {}
    # The model holds no episode state: it is never asked.
    assert all(MODEL not in retire for retire in world.participants.retires)


# ------------------------------------------------ the hold outlives a failed resume (4)


async def test_the_deadline_hold_stays_until_a_failed_resume_is_released(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.participants.resume_failures = [{AGENT: DOWN}]

    report = await world.driver.take()

    assert report.outcome is SnapshotOutcome.PUBLISHED
    assert report.unreleased == {AGENT}
    # The agent may still hold its episodes parked: their budgets must not run.
    assert world.books.deadlines.held
    assert world.driver.holding == {report.checkpoint_id}

    # The next attempt's release succeeds first thing: the hold goes with it.
    assert await world.driver.release_pending() is not None
    assert not world.books.deadlines.held
    assert world.driver.holding == frozenset()


async def test_the_deadline_hold_ends_when_the_lease_has_surely_run_out(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.participants.resume_failures = [{AGENT: DOWN}] * 10

    await world.driver.take()
    await world.driver.release_pending()  # fails again
    assert world.books.deadlines.held

    world.clock.now += world.config.lease_s  # its lease reopened it by now
    await world.driver.release_pending()

    assert not world.books.deadlines.held
    # Dispatch to it stays closed until a resume gets through.
    assert world.books.closed_to == {AGENT}


# ------------------------------------------- a far-future finished id moves the ids (5)


async def test_the_next_id_continues_above_what_a_participant_finished(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    far = 3 * EPOCH_STRIDE + 500_000
    world.participants.prepare_failures = [({AGENT: STALE}, far)]

    failed = await world.driver.take()

    assert failed.outcome is SnapshotOutcome.FAILED
    assert failed.reason is FailureReason.SUPERSEDED and failed.transient
    assert await world.driver.next_checkpoint_id() == make_checkpoint_id("ck", far + 1)

    retried = await world.driver.take(failed.checkpoint_id)

    assert retried.outcome is SnapshotOutcome.PUBLISHED
    assert checkpoint_sequence(retried.checkpoint_id) == far + 1
