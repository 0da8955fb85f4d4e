"""The snapshot driver and pump against a fake rollout side and a fake coordinator.

Time is a fake clock that the fakes advance, so phase durations are exact and an hour
of pump ticks takes no time. The snapshot layout is real (a temporary directory): what
is published, what ``LATEST`` names and what is cleaned up are checked on disk.

The last section tests the pure restore plan.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, checkpoint_sequence
from turnpoint.protocol import ParticipantKind, RecoveryLevel, RecoveryMode, VerifyMode
from turnpoint.trainer._config import CoordinatorConfig
from turnpoint.trainer._control_client import Failure, FailureKind, NotReadyError
from turnpoint.trainer._coordinator import (
    CommitFailed,
    ControlReport,
    ParticipantInfo,
    PreparedCheckpoint,
    PrepareFailed,
    Topology,
    UnackedResolver,
)
from turnpoint.trainer._deadlines import DeadlineRegistry, Hold
from turnpoint.trainer._interfaces import InFlightRollout, UnackedDecision
from turnpoint.trainer._manifest import (
    AnchorRef,
    ArtifactRef,
    ParticipantEntry,
    PlacedEpisode,
    PublishStep,
    SnapshotLayout,
    SnapshotManifest,
    TrainerRolloutState,
    tree_digest,
)
from turnpoint.trainer._metrics import CoordinatorMetrics
from turnpoint.trainer._restore import RerunReason, RestorePlanError, plan_restore
from turnpoint.trainer._snapshots import (
    EPOCH_STRIDE,
    FailureReason,
    SnapshotDriver,
    SnapshotFailuresError,
    SnapshotInvariantError,
    SnapshotOutcome,
    SnapshotPhase,
    SnapshotPump,
    WrittenAnchor,
    failure_reason,
)

AGENT, RESOURCES, MODEL = "agent-0", "res-0", "model-0"
EP1, EP2, EP3 = EpisodeId("r1", 0), EpisodeId("r2", 0), EpisodeId("r3", 2)

NOT_READY = Failure(FailureKind.NOT_READY, None, None, "1 blocker")
LATE = Failure(FailureKind.TRANSIENT, None, grpc.StatusCode.DEADLINE_EXCEEDED, "late")
DOWN = Failure(FailureKind.TRANSIENT, None, grpc.StatusCode.UNAVAILABLE, "down")
DISK_FULL = Failure(
    FailureKind.TRANSIENT, Reason.STORAGE_UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, "disk full"
)
FENCED = Failure(
    FailureKind.INVARIANT, Reason.FENCED, grpc.StatusCode.FAILED_PRECONDITION, "fenced"
)
STALE = Failure(FailureKind.INVARIANT, Reason.STALE_CHECKPOINT, grpc.StatusCode.ABORTED, "stale")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def info(
    instance: str,
    kind: ParticipantKind,
    *,
    environment: str = "",
    mode: RecoveryMode = RecoveryMode.EXPORTED,
    levels: frozenset[RecoveryLevel] = frozenset(),
    group_scored: bool = False,
) -> ParticipantInfo:
    return ParticipantInfo(
        instance=instance,
        kind=kind,
        incarnation="inc-1",
        protocol_version="turnpoint.v1",
        recovery_mode=mode,
        verify_mode=VerifyMode.REPLAY,
        group_scored=group_scored,
        group_size=2 if group_scored else 0,
        supported_levels=levels,
        environment=environment,
    )


TOPOLOGY = Topology(
    {
        AGENT: info(AGENT, ParticipantKind.AGENT, environment="math"),
        RESOURCES: info(RESOURCES, ParticipantKind.RESOURCES, environment="math"),
        MODEL: info(MODEL, ParticipantKind.MODEL),
    }
)


def rollout(episode: EpisodeId, *, group: str = "g1", sibling: int = 0) -> InFlightRollout:
    return InFlightRollout(
        episode=episode,
        instance=AGENT,
        prompt_group_id=group,
        sibling_index=sibling,
        group_size=2,
        environment="math",
        boundaries_seen=1,
        task={"prompt": episode.rollout_id},
    )


class FakeRollouts:
    """A RolloutSide that records what the driver asked, in order."""

    def __init__(self, clock: Clock, events: list[str]) -> None:
        self.clock = clock
        self.events = events
        self.version = 1
        self.open = True
        self.closed_to: set[str] = set()
        self.deadlines: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
        self.rollouts: list[InFlightRollout] = []
        self.queue: list[dict[str, Any]] = []
        self.retires: dict[str, set[EpisodeId]] = {}
        self.retired_calls: list[tuple[str, tuple[EpisodeId, ...]]] = []
        self.drain_error: BaseException | None = None
        self.drain_s = 0.5

    def close_dispatch(self) -> None:
        self.events.append("close")
        self.open = False

    def reopen_dispatch(self) -> None:
        self.events.append("reopen")
        self.open = True

    def close_dispatch_to(self, instance: str) -> None:
        self.events.append(f"close_to:{instance}")
        self.closed_to.add(instance)

    def reopen_dispatch_to(self, instance: str) -> None:
        self.events.append(f"reopen_to:{instance}")
        self.closed_to.discard(instance)

    def hold_deadlines(self, name: str) -> Hold:
        self.events.append("hold")
        return self.deadlines.hold(name, self.clock())

    def release_deadlines(self, hold: Hold) -> None:
        self.events.append("release_hold")
        self.deadlines.release(hold, self.clock())

    async def drain_acknowledgements(self, timeout_s: float) -> None:
        self.events.append("drain")
        self.clock.advance(self.drain_s)
        if self.drain_error is not None:
            raise self.drain_error

    def in_flight(self) -> Sequence[InFlightRollout]:
        return tuple(self.rollouts)

    def rollout_state(self) -> TrainerRolloutState:
        return TrainerRolloutState(
            queue=tuple(self.queue),
            data_loader={"index": 7},
            attempts={r.episode.rollout_id: r.episode.attempt for r in self.rollouts}
            | {item["rollout_id"]: item["attempt"] for item in self.queue},
            in_flight=tuple(saved(r) for r in self.rollouts),
        )

    async def resolve_unacknowledged(
        self, instance: str, episode: EpisodeId, receipt_id: str
    ) -> UnackedDecision:
        return "acknowledge"

    def pending_retires(self) -> Mapping[str, Sequence[EpisodeId]]:
        return {k: tuple(sorted(v)) for k, v in self.retires.items() if v}

    def retired(self, instance: str, episodes: Sequence[EpisodeId]) -> None:
        self.events.append(f"retired:{instance}")
        self.retired_calls.append((instance, tuple(episodes)))
        self.retires.get(instance, set()).difference_update(episodes)


def saved(r: InFlightRollout, *, accepted: bool = True) -> dict[str, Any]:
    return {
        "rollout_id": r.episode.rollout_id,
        "attempt": r.episode.attempt,
        "instance": r.instance,
        "prompt_group_id": r.prompt_group_id,
        "sibling_index": r.sibling_index,
        "group_size": r.group_size,
        "environment": r.environment,
        "boundaries_seen": r.boundaries_seen,
        "task": dict(r.task),
        "budget_s": None,
        "accepted": accepted,
    }


class FakeAnchor:
    def __init__(self, clock: Clock, events: list[str]) -> None:
        self.clock = clock
        self.events = events
        self.step = 10
        self.error: BaseException | None = None

    async def write(self, snapshot: Path) -> WrittenAnchor:
        self.events.append("anchor")
        self.clock.advance(2.0)
        if self.error is not None:
            raise self.error
        directory = snapshot / "trainer" / "anchor"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "weights.bin").write_bytes(f"step {self.step}".encode())
        return WrittenAnchor(AnchorRef(sha256=tree_digest(directory)), self.step)


def write_artifact(root: Path, snapshot: str, instance: str, name: str, data: bytes) -> ArtifactRef:
    path = root / snapshot / instance / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return ArtifactRef(
        path=f"{instance}/{name}",
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        record_count=data.count(b"\n"),
    )


@dataclass
class FakeCoordinator:
    """A SnapshotParticipants whose operations follow a script, one entry per call."""

    clock: Clock
    events: list[str]
    root: Path
    topology: Topology = TOPOLOGY
    prepare_script: list[Mapping[str, Failure] | None] = field(default_factory=list)
    commit_script: list[Mapping[str, Failure] | None] = field(default_factory=list)
    resume_script: list[Mapping[str, Failure]] = field(default_factory=list)
    restarts: Mapping[str, tuple[EpisodeId, ...]] = field(default_factory=dict)
    retire_straggler: Mapping[str, tuple[EpisodeId, ...]] = field(default_factory=dict)
    prepare_s: float = 3.0
    resumes: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    retires: list[dict[str, tuple[EpisodeId, ...]]] = field(default_factory=list)
    prepares: list[str] = field(default_factory=list)
    scopes: list[dict[str, frozenset[EpisodeId]]] = field(default_factory=list)
    during_prepare: Callable[[], None] | None = None

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        expected: Mapping[str, Iterable[EpisodeId]] | None = None,
        resolve: UnackedResolver | None = None,
    ) -> PreparedCheckpoint:
        self.events.append(f"prepare:{checkpoint_id}")
        self.prepares.append(checkpoint_id)
        self.clock.advance(self.prepare_s)
        if self.during_prepare is not None:
            self.during_prepare()
        failures = self.prepare_script.pop(0) if self.prepare_script else None
        if failures:
            raise PrepareFailed(checkpoint_id, failures, self.retire_straggler)
        return PreparedCheckpoint(
            checkpoint_id=checkpoint_id,
            readiness={},
            restarts=dict(self.restarts),
            durations_s={},
        )

    @asynccontextmanager
    async def held(self, checkpoint: PreparedCheckpoint) -> AsyncIterator[PreparedCheckpoint]:
        try:
            yield checkpoint
        finally:
            checkpoint.release = await self.resume(checkpoint.checkpoint_id)

    async def commit(
        self, checkpoint_id: str, snapshot: str, scope: Mapping[str, Iterable[EpisodeId]]
    ) -> dict[str, ParticipantEntry]:
        self.events.append(f"commit:{checkpoint_id}")
        self.clock.advance(1.0)
        self.scopes.append({k: frozenset(v) for k, v in scope.items()})
        failures = self.commit_script.pop(0) if self.commit_script else None
        if failures:
            raise CommitFailed(checkpoint_id, failures)
        entries = {}
        for name, participant in self.topology.participants.items():
            exported = tuple(sorted(scope.get(name, ()))) if participant.runs_episodes else ()
            manifest = artifacts = None
            if exported:
                records = "".join(f"{e}\n" for e in exported).encode()
                artifacts = (write_artifact(self.root, snapshot, name, "records.jsonl", records),)
                manifest = write_artifact(self.root, snapshot, name, "MANIFEST.json", b"{}\n")
            entries[name] = ParticipantEntry(
                instance=name,
                kind=participant.kind,
                artifacts=artifacts or (),
                manifest=manifest,
                exported=exported,
            )
        return entries

    async def resume(
        self, checkpoint_id: str, instances: Iterable[str] | None = None
    ) -> ControlReport:
        chosen = (
            tuple(sorted(instances))
            if instances is not None
            else tuple(sorted(self.topology.instances))
        )
        self.events.append(f"resume:{checkpoint_id}")
        self.resumes.append((checkpoint_id, chosen))
        self.clock.advance(0.25)
        failures = self.resume_script.pop(0) if self.resume_script else {}
        failures = {k: v for k, v in failures.items() if k in chosen}
        return ControlReport(
            "resume", checkpoint_id, frozenset(set(chosen) - set(failures)), failures
        )

    async def retire(
        self, episodes: Mapping[str, Iterable[EpisodeId]], *, key: str | None = None
    ) -> ControlReport:
        chosen = {k: tuple(v) for k, v in episodes.items()}
        self.events.append("retire")
        self.retires.append(chosen)
        return ControlReport("retire", key or "k", frozenset(chosen), {})


@dataclass
class World:
    clock: Clock
    events: list[str]
    rollouts: FakeRollouts
    anchor: FakeAnchor
    coordinator: FakeCoordinator
    layout: SnapshotLayout
    config: CoordinatorConfig
    driver: SnapshotDriver

    def pump(self) -> SnapshotPump:
        async def sleep(seconds: float) -> None:
            self.clock.advance(seconds)

        return SnapshotPump(self.driver, self.config, clock=self.clock, sleep=sleep)


def make_world(
    tmp_path: Path,
    *,
    layout: SnapshotLayout | None = None,
    step_lock: asyncio.Lock | None = None,
    metrics: CoordinatorMetrics | None = None,
    **config: Any,
) -> World:
    clock = Clock()
    events: list[str] = []
    settings = CoordinatorConfig(
        snapshot_root=tmp_path, snapshot_interval_s=60.0, keep_snapshots=2, **config
    )
    layout = layout or SnapshotLayout(tmp_path)
    rollouts = FakeRollouts(clock, events)
    anchor = FakeAnchor(clock, events)
    coordinator = FakeCoordinator(clock, events, tmp_path)
    driver = SnapshotDriver(
        coordinator=coordinator,
        rollouts=rollouts,
        anchor=anchor,
        layout=layout,
        config=settings,
        epoch=3,
        step_lock=step_lock,
        metrics=metrics,
        clock=clock,
        wall_clock=lambda: 1_700_000_000.0,
    )
    return World(clock, events, rollouts, anchor, coordinator, layout, settings, driver)


def assert_phases_add_up(report: Any) -> None:
    assert sum(report.phases.values()) == pytest.approx(report.total_s)
    assert report.total_s > 0


# ------------------------------------------------------------------------ driver


async def test_a_snapshot_runs_the_steps_in_order_and_publishes(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.rollouts.rollouts = [rollout(EP1), rollout(EP2, sibling=1)]
    world.rollouts.retires = {AGENT: {EpisodeId("old", 1)}}

    report = await world.driver.take()

    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    ck = report.checkpoint_id
    assert checkpoint_sequence(ck) == 3 * EPOCH_STRIDE + 1
    assert world.events == [
        "anchor",
        "close",
        "hold",
        "drain",
        "retire",
        f"retired:{AGENT}",
        f"prepare:{ck}",
        f"commit:{ck}",
        f"resume:{ck}",
        "reopen",
        "release_hold",
    ]
    assert world.layout.latest() == ck
    manifest = world.layout.load(ck)
    assert [p.episode for p in manifest.continued] == [EP1, EP2]
    assert manifest.step == 10
    assert manifest.rollout_state.data_loader == {"index": 7}
    assert world.rollouts.open and not world.rollouts.deadlines.held
    # Phase times are laps of one clock: they add up to the total exactly.
    assert_phases_add_up(report)
    assert report.phases[SnapshotPhase.ANCHOR] == 2.0
    assert report.phases[SnapshotPhase.DRAIN] == 0.5
    assert report.phases[SnapshotPhase.PREPARE] == 3.0
    assert report.phases[SnapshotPhase.COMMIT] == 1.0
    assert report.phases[SnapshotPhase.RESUME] == 0.25
    assert report.admission_closed_s == pytest.approx(0.5 + 3.0 + 1.0 + 0.25)
    # Three participants held from prepare to the end of the resume.
    assert report.participant_seconds == pytest.approx(3 * (3.0 + 1.0 + 0.25))


async def test_a_result_that_arrives_during_prepare_is_queued_not_continued(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path)
    world.rollouts.rollouts = [rollout(EP1), rollout(EP2, sibling=1)]

    def finish_ep2() -> None:
        # EP2's result arrives (and is acknowledged) while prepare waits for parking.
        world.rollouts.rollouts = [rollout(EP1)]
        world.rollouts.queue = [{"rollout_id": EP2.rollout_id, "attempt": EP2.attempt}]

    world.coordinator.during_prepare = finish_ep2

    report = await world.driver.take()

    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    (scope,) = world.coordinator.scopes
    assert scope[AGENT] == {EP1}
    manifest = world.layout.load(report.checkpoint_id)
    # One cut: EP2 is in the queue only, never also continued or restarted.
    assert manifest.continued == (PlacedEpisode(EP1, AGENT),)
    assert manifest.restarts == ()
    assert [item["rollout_id"] for item in manifest.rollout_state.queue] == [EP2.rollout_id]


async def test_restarts_are_left_out_of_every_scope_and_recorded(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.rollouts.rollouts = [rollout(EP1), rollout(EP2, sibling=1)]
    # The resources server cannot capture r2's session: r2 cannot continue anywhere.
    world.coordinator.restarts = {RESOURCES: (EP2,)}

    report = await world.driver.take()

    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    (scope,) = world.coordinator.scopes
    assert scope == {AGENT: {EP1}, RESOURCES: {EP1}, MODEL: {EP1}}
    manifest = world.layout.load(report.checkpoint_id)
    assert manifest.continued == (PlacedEpisode(EP1, AGENT),)
    assert manifest.restarts == (PlacedEpisode(EP2, AGENT),)
    assert (report.continued, report.restarts) == (1, 1)


async def test_nothing_changed_is_skipped_not_taken(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    first = await world.driver.take()
    assert first.outcome is SnapshotOutcome.PUBLISHED

    second = await world.driver.take()

    assert second.outcome is SnapshotOutcome.SKIPPED
    assert world.coordinator.prepares == [first.checkpoint_id]
    assert world.layout.latest() == first.checkpoint_id

    world.anchor.step += 1
    third = await world.driver.take()
    assert third.outcome is SnapshotOutcome.PUBLISHED
    world.rollouts.version += 1
    fourth = await world.driver.take()
    assert fourth.outcome is SnapshotOutcome.PUBLISHED
    assert world.layout.list_published() == [fourth.checkpoint_id, third.checkpoint_id]


async def test_not_ready_resumes_the_same_id_and_keeps_the_previous_snapshot(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path)
    previous = await world.driver.take()
    world.rollouts.version += 1
    world.coordinator.prepare_script = [{AGENT: NOT_READY}]
    # The rollout side said this unacknowledged completion must go.
    world.coordinator.retire_straggler = {AGENT: (EP3,)}
    world.events.clear()

    report = await world.driver.take()

    assert report.outcome is SnapshotOutcome.FAILED
    assert report.reason is FailureReason.NOT_READY and report.transient
    ck = report.checkpoint_id
    assert world.coordinator.resumes[-1] == (ck, (AGENT, MODEL, RESOURCES))
    # Aborted first, then the straggler retired while everyone is idle again.
    assert world.events[world.events.index(f"resume:{ck}") + 1] == "retire"
    assert world.coordinator.retires[-1] == {AGENT: (EP3,)}
    assert world.layout.latest() == previous.checkpoint_id
    assert not (tmp_path / ck).exists()
    assert world.rollouts.open and not world.rollouts.deadlines.held
    assert_phases_add_up(report)
    assert SnapshotPhase.ABORT in report.phases


async def test_the_pump_retries_an_id_no_participant_saw(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.rollouts.drain_error = TimeoutError()
    pump = world.pump()

    failed = await pump.tick()

    assert failed.reason is FailureReason.TIMEOUT and not failed.exposed
    assert pump.retry_id == failed.checkpoint_id
    world.rollouts.drain_error = None
    retried = await pump.tick()
    assert retried.outcome is SnapshotOutcome.PUBLISHED
    assert retried.checkpoint_id == failed.checkpoint_id
    assert retried.retry_of is None
    assert pump.consecutive_failures == 0


async def test_the_pump_finishes_a_seen_id_first_then_moves_on(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.coordinator.prepare_script = [{AGENT: LATE}]
    # The abort's resume of the failed id does not reach the agent.
    world.coordinator.resume_script = [{AGENT: DOWN}]
    pump = world.pump()

    failed = await pump.tick()

    assert failed.reason is FailureReason.TIMEOUT and failed.exposed
    assert failed.unreleased == {AGENT}
    assert world.rollouts.closed_to == {AGENT}
    retried = await pump.tick()
    assert retried.outcome is SnapshotOutcome.PUBLISHED
    assert retried.retry_of == failed.checkpoint_id
    assert (
        checkpoint_sequence(retried.checkpoint_id) == checkpoint_sequence(failed.checkpoint_id) + 1
    )
    # The same id is released first, where it failed, before the new attempt starts.
    assert world.coordinator.resumes[1] == (failed.checkpoint_id, (AGENT,))
    assert world.events.index(f"resume:{failed.checkpoint_id}", 5) < world.events.index(
        f"prepare:{retried.checkpoint_id}"
    )
    assert world.rollouts.closed_to == set()
    assert world.driver.unreleased == {}


async def test_a_release_that_failed_after_publication_is_retried_even_when_skipping(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path)
    world.coordinator.resume_script = [{AGENT: DOWN}]

    published = await world.driver.take()

    assert published.outcome is SnapshotOutcome.PUBLISHED
    assert published.unreleased == {AGENT}
    assert world.rollouts.closed_to == {AGENT}
    assert world.rollouts.open
    assert world.layout.latest() == published.checkpoint_id

    skipped = await world.driver.take()

    assert skipped.outcome is SnapshotOutcome.SKIPPED
    assert world.coordinator.resumes[-1] == (published.checkpoint_id, (AGENT,))
    assert world.rollouts.closed_to == set()
    assert skipped.phases.keys() == {SnapshotPhase.RELEASE}


async def test_max_consecutive_failures_ends_the_run(tmp_path: Path) -> None:
    world = make_world(tmp_path, max_consecutive_failures=3)
    previous = await world.driver.take()
    world.rollouts.version += 1
    world.coordinator.prepare_script = [{AGENT: NOT_READY}, {AGENT: LATE}, {RESOURCES: DISK_FULL}]
    pump = world.pump()

    with pytest.raises(SnapshotFailuresError, match="3 snapshot attempts failed in a row") as info:
        await pump.run()

    assert [r.reason for r in info.value.reports] == [
        FailureReason.NOT_READY,
        FailureReason.TIMEOUT,
        FailureReason.STORAGE,
    ]
    assert world.layout.latest() == previous.checkpoint_id
    # Ticks came one interval apart on the pump's clock.
    assert world.clock.now >= 1000 + 3 * world.config.snapshot_interval_s


async def test_a_published_snapshot_resets_the_failure_count(tmp_path: Path) -> None:
    world = make_world(tmp_path, max_consecutive_failures=2)
    world.coordinator.prepare_script = [{AGENT: NOT_READY}, None, {AGENT: NOT_READY}]
    pump = world.pump()

    assert (await pump.tick()).outcome is SnapshotOutcome.FAILED
    assert (await pump.tick()).outcome is SnapshotOutcome.PUBLISHED
    world.rollouts.version += 1
    assert (await pump.tick()).outcome is SnapshotOutcome.FAILED
    assert pump.consecutive_failures == 1


async def test_an_invariant_break_ends_the_run_at_once(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.coordinator.commit_script = [{AGENT: FENCED}]
    pump = world.pump()

    with pytest.raises(SnapshotInvariantError, match="broke an invariant"):
        await pump.tick()

    assert world.layout.latest() is None
    # Even then everyone was resumed and the trainer reopened.
    assert world.coordinator.resumes[-1][1] == (AGENT, MODEL, RESOURCES)
    assert world.rollouts.open and not world.rollouts.deadlines.held


async def test_a_full_disk_while_publishing_is_transient(tmp_path: Path) -> None:
    armed = [False]

    def disk_full(step: PublishStep) -> None:
        if armed[0] and step is PublishStep.VERIFIED:
            raise OSError(28, "No space left on device")

    world = make_world(tmp_path, layout=SnapshotLayout(tmp_path, after_step=disk_full))
    previous = await world.driver.take()
    world.rollouts.version += 1
    armed[0] = True

    report = await world.driver.take()

    assert report.reason is FailureReason.STORAGE and report.transient
    assert world.layout.latest() == previous.checkpoint_id
    assert world.coordinator.resumes[-1][0] == report.checkpoint_id
    assert not (tmp_path / report.checkpoint_id).exists()


async def test_a_failed_anchor_write_fails_before_anything_closes(tmp_path: Path) -> None:
    world = make_world(tmp_path)
    world.anchor.error = OSError(28, "No space left on device")

    report = await world.driver.take()

    assert report.reason is FailureReason.STORAGE and not report.exposed
    assert world.events == ["anchor"]
    assert list(report.phases) == [SnapshotPhase.RELEASE, SnapshotPhase.ANCHOR, SnapshotPhase.ABORT]
    assert_phases_add_up(report)


async def test_admission_closed_longer_than_the_interval_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    world = make_world(tmp_path)
    world.coordinator.prepare_s = 90.0  # interval is 60 s
    caplog.set_level(logging.WARNING, logger="turnpoint.trainer._snapshots")

    first = await world.driver.take()
    world.rollouts.version += 1
    second = await world.driver.take()

    assert first.admission_closed_s > 60 and second.admission_closed_s > 60
    warnings = [
        r.getMessage() for r in caplog.records if "longer than the snapshot" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert f"{first.admission_closed_s:.1f} s" in warnings[0]


async def test_the_step_lock_is_held_until_the_cut_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = asyncio.Lock()
    world = make_world(tmp_path, step_lock=lock)
    seen: list[bool] = []
    commit = world.coordinator.commit

    async def commit_and_look(*args: Any) -> dict[str, ParticipantEntry]:
        seen.append(lock.locked())
        return await commit(*args)

    monkeypatch.setattr(world.coordinator, "commit", commit_and_look)
    original = world.anchor.write

    async def write_and_look(snapshot: Path) -> WrittenAnchor:
        seen.append(lock.locked())
        return await original(snapshot)

    monkeypatch.setattr(world.anchor, "write", write_and_look)

    report = await world.driver.take()

    assert report.outcome is SnapshotOutcome.PUBLISHED
    # Held while the anchor is written, released once the rollout state is read.
    assert seen == [True, False]
    assert not lock.locked()


async def test_pump_run_stops_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    world = make_world(tmp_path)
    stop = asyncio.Event()
    pump = world.pump()
    take = world.driver.take
    ticks: list[str] = []

    async def counting(checkpoint_id: str | None = None) -> Any:
        report = await take(checkpoint_id)
        ticks.append(report.outcome.value)
        world.rollouts.version += 1
        if len(ticks) == 3:
            stop.set()
        return report

    monkeypatch.setattr(world.driver, "take", counting)

    await pump.run(stop)

    assert ticks == ["published"] * 3
    assert len(world.layout.list_published()) == 2  # keep_snapshots


async def test_metrics_land_on_the_callers_registry(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    # A second set on its own registry: several coordinators in one process coexist.
    CoordinatorMetrics(CollectorRegistry())
    world = make_world(tmp_path, metrics=CoordinatorMetrics(registry))
    world.coordinator.prepare_script = [None, {AGENT: NOT_READY}]

    published = await world.driver.take()
    world.rollouts.version += 1
    await world.driver.take()

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("turnpoint_snapshots_total", outcome="published", reason="") == 1
    assert sample("turnpoint_snapshots_total", outcome="failed", reason="not_ready") == 1
    assert sample("turnpoint_snapshot_phase_seconds_sum", phase="prepare") == 6.0
    assert sample("turnpoint_snapshot_phase_seconds_count", phase="commit") == 1
    assert sample("turnpoint_admission_closed_seconds_total") == pytest.approx(
        published.admission_closed_s + 0.5 + 3.0 + 0.25
    )
    assert (
        REGISTRY.get_sample_value(
            "turnpoint_snapshots_total", {"outcome": "published", "reason": ""}
        )
        is None
    )


@pytest.mark.parametrize(
    ("failures", "reason"),
    [
        ({"a": NOT_READY}, FailureReason.NOT_READY),
        ({"a": NOT_READY, "b": LATE}, FailureReason.TIMEOUT),
        ({"a": LATE, "b": DOWN}, FailureReason.PARTICIPANT_UNAVAILABLE),
        ({"a": DOWN, "b": DISK_FULL}, FailureReason.STORAGE),
        ({"a": STALE, "b": LATE}, FailureReason.SUPERSEDED),
        ({"a": STALE, "b": FENCED}, FailureReason.INVARIANT),
    ],
)
def test_failure_reasons(failures: Mapping[str, Failure], reason: FailureReason) -> None:
    assert failure_reason(failures) is reason
    assert reason.transient is (reason is not FailureReason.INVARIANT)


def test_a_not_ready_error_is_classified_not_ready() -> None:
    from turnpoint.trainer._control_client import classify

    assert classify(NotReadyError("a", "ck-1")).kind is FailureKind.NOT_READY
    assert classify(TurnpointError(Reason.STORAGE_UNAVAILABLE, "x")).retryable


# ---------------------------------------------------------------------- restore plan


def group_topology(
    *,
    agent_levels: frozenset[RecoveryLevel] = frozenset(),
    mode: RecoveryMode = RecoveryMode.EXPORTED,
    group_scored: bool = False,
) -> Topology:
    return Topology(
        {
            AGENT: info(AGENT, ParticipantKind.AGENT, environment="math", levels=agent_levels),
            RESOURCES: info(
                RESOURCES,
                ParticipantKind.RESOURCES,
                environment="math",
                mode=mode,
                group_scored=group_scored,
            ),
        }
    )


def finished(rollout_id: str, group: str, sibling: int) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "attempt": 0,
        "instance": AGENT,
        "prompt_group_id": group,
        "sibling_index": sibling,
        "group_size": 2,
        "environment": "math",
        "task": {"prompt": rollout_id},
        "output": {"reward": 1.0},
    }


def plan_manifest(
    *,
    continued: Sequence[InFlightRollout] = (),
    restarts: Sequence[InFlightRollout] = (),
    waiting: Sequence[InFlightRollout] = (),
    queue: Sequence[dict[str, Any]] = (),
    resources_export: Sequence[EpisodeId] = (),
) -> SnapshotManifest:
    digest = "0" * 64
    exported = tuple(r.episode for r in continued)
    agent = ParticipantEntry(
        instance=AGENT,
        kind=ParticipantKind.AGENT,
        artifacts=(ArtifactRef(f"{AGENT}/records.jsonl", digest, 1, 1),) if exported else (),
        manifest=ArtifactRef(f"{AGENT}/MANIFEST.json", digest, 1, 0) if exported else None,
        exported=exported,
    )
    resources = ParticipantEntry(
        instance=RESOURCES,
        kind=ParticipantKind.RESOURCES,
        manifest=ArtifactRef(f"{RESOURCES}/MANIFEST.json", digest, 1, 0)
        if resources_export
        else None,
        exported=tuple(resources_export),
    )
    unfinished = [*continued, *restarts, *waiting]
    return SnapshotManifest(
        checkpoint_id="ck-000000000007",
        step=5,
        created_at=1.0,
        anchor=AnchorRef(sha256=digest),
        participants=(agent, resources),
        continued=tuple(PlacedEpisode(r.episode, r.instance) for r in continued),
        restarts=tuple(PlacedEpisode(r.episode, r.instance) for r in restarts),
        rollout_state=TrainerRolloutState(
            queue=tuple(queue),
            attempts={r.episode.rollout_id: r.episode.attempt for r in unfinished}
            | {item["rollout_id"]: item["attempt"] for item in queue},
            in_flight=tuple(
                [saved(r) for r in [*continued, *restarts]]
                + [saved(r, accepted=False) for r in waiting]
            ),
        ),
    )


def test_plan_continues_at_turn_level_and_reruns_restarts_and_waiting() -> None:
    a, b, c = rollout(EP1), rollout(EP2, sibling=1), rollout(EpisodeId("r4", 0), group="g2")
    manifest = plan_manifest(continued=[a], restarts=[b], waiting=[c], resources_export=[EP1, EP2])

    plan = plan_restore(manifest, group_topology(), RecoveryLevel.TURN, restore_id="restore-1")

    assert [(r.episode, r.instance) for r in plan.redispatch] == [(EpisodeId("r1", 1), AGENT)]
    assert {(r.episode, r.reason) for r in plan.rerun} == {
        (EpisodeId("r2", 1), RerunReason.RESTART),
        (EpisodeId("r4", 1), RerunReason.NOT_ACCEPTED),
    }
    # Only what continues is restored, on every instance that saved it.
    assert plan.restore_scope == {AGENT: (EP1,), RESOURCES: (EP1,)}
    assert (plan.resumed, plan.rerun_count, plan.groups_retried_whole) == (1, 2, 0)
    assert not plan.lowered


def test_plan_at_sibling_level_reruns_saved_siblings_and_keeps_finished_ones() -> None:
    a = rollout(EP1)
    manifest = plan_manifest(continued=[a], queue=[finished("done", "g1", 1)])

    plan = plan_restore(
        manifest,
        group_topology(mode=RecoveryMode.RESTART_ONLY),
        RecoveryLevel.TURN,
        restore_id="restore-1",
    )

    assert plan.levels["math"].effective is RecoveryLevel.SIBLING
    assert [d.environment for d in plan.lowered] == ["math"]
    assert plan.redispatch == ()
    assert [(r.episode, r.reason) for r in plan.rerun] == [(EpisodeId("r1", 1), RerunReason.LEVEL)]
    assert plan.saved_turns_discarded == 1
    assert [item["rollout_id"] for item in plan.trainer_state.queue] == ["done"]
    assert plan.restore_scope == {AGENT: (), RESOURCES: ()}


def test_plan_at_prompt_group_level_reruns_the_whole_group_once() -> None:
    a = rollout(EP1)
    manifest = plan_manifest(
        continued=[a], queue=[finished("done", "g1", 1), finished("other", "g9", 0)]
    )

    plan = plan_restore(
        manifest, group_topology(), RecoveryLevel.PROMPT_GROUP, restore_id="restore-1"
    )

    assert plan.groups_retried_whole == 1
    assert plan.sealed_siblings_discarded == 1
    assert plan.dropped_from_queue == ("done",)
    assert {(r.episode, r.reason, r.finished) for r in plan.rerun} == {
        (EpisodeId("r1", 1), RerunReason.GROUP, False),
        (EpisodeId("done", 1), RerunReason.GROUP, True),
    }
    # Nothing the kept queue holds runs again.
    assert [item["rollout_id"] for item in plan.trainer_state.queue] == ["other"]
    assert not {r.episode.rollout_id for r in plan.rerun} & {"other"}


def test_plan_group_scored_group_with_a_restart_reruns_whole() -> None:
    a, b = rollout(EP1), rollout(EP2, sibling=1)
    manifest = plan_manifest(continued=[a], restarts=[b])

    plan = plan_restore(
        manifest, group_topology(group_scored=True), RecoveryLevel.TURN, restore_id="restore-1"
    )

    assert plan.redispatch == ()
    assert {r.reason for r in plan.rerun} == {RerunReason.GROUP}
    assert plan.groups_retried_whole == 1

    both = plan_manifest(continued=[a, b])
    together = plan_restore(
        both, group_topology(group_scored=True), RecoveryLevel.TURN, restore_id="restore-1"
    )
    # At turn level siblings of a group-scored environment resume together.
    assert len(together.redispatch) == 2 and together.rerun == ()


def test_plan_after_a_failed_restore_reruns_above_the_retired_attempt() -> None:
    a = rollout(EP1)
    manifest = plan_manifest(continued=[a])

    plan = plan_restore(
        manifest,
        group_topology(),
        RecoveryLevel.TURN,
        restore_id="restore-1",
        restore_failed=True,
        retired=[EpisodeId("r1", 1)],
    )

    assert plan.redispatch == ()
    assert [(r.episode, r.reason) for r in plan.rerun] == [
        (EpisodeId("r1", 2), RerunReason.RESTORE_FAILED)
    ]


def test_plan_rejects_a_restored_episode_no_unfinished_rollout_claims() -> None:
    a = rollout(EP1)
    manifest = plan_manifest(continued=[a])
    state = manifest.rollout_state
    orphaned = SnapshotManifest(
        checkpoint_id=manifest.checkpoint_id,
        step=manifest.step,
        created_at=manifest.created_at,
        anchor=manifest.anchor,
        participants=manifest.participants,
        continued=manifest.continued,
        rollout_state=TrainerRolloutState(
            queue=state.queue, data_loader=state.data_loader, attempts=state.attempts
        ),
    )

    with pytest.raises(RestorePlanError, match="claimed by no unfinished rollout"):
        plan_restore(orphaned, group_topology(), RecoveryLevel.TURN, restore_id="restore-1")


def test_plan_rejects_a_rollout_both_finished_and_unfinished() -> None:
    a = rollout(EP1)
    manifest = plan_manifest(continued=[a])
    state = manifest.rollout_state
    both = json.loads(manifest.to_json())
    both["rollout_state"]["queue"] = [finished("r1", "g1", 0)]
    broken = SnapshotManifest.from_dict(both)
    assert broken.rollout_state.in_flight == state.in_flight

    with pytest.raises(RestorePlanError, match="both finished"):
        plan_restore(broken, group_topology(), RecoveryLevel.TURN, restore_id="restore-1")
