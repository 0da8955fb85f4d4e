"""The snapshot driver and pump against a fake rollout side and a fake coordinator.

The world (``make_world``) and its fakes live in ``tests.support.fakes``. Time is a
fake clock that the fakes advance, so phase durations are exact and an hour of pump
ticks takes no time. The snapshot layout is real (a temporary directory): what is
published, what ``LATEST`` names and what is cleaned up are checked on disk.

The last section tests the pure restore plan.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from tests.support.fakes import (
    AGENT,
    DISK_FULL,
    DOWN,
    FENCED,
    LATE,
    MODEL,
    NOT_READY,
    RESOURCES,
    STALE,
    info,
    make_world,
    rollout,
    saved,
)
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, checkpoint_sequence
from turnpoint.protocol import ArtifactRef, ParticipantKind, RecoveryLevel, RecoveryMode
from turnpoint.trainer import (
    FailureReason,
    SnapshotFailuresError,
    SnapshotInvariantError,
    SnapshotOutcome,
)
from turnpoint.trainer.advanced import (
    CoordinatorMetrics,
    InFlightRollout,
    SnapshotLayout,
    SnapshotManifest,
    SnapshotPhase,
    SnapshotState,
    Topology,
    plan_restore,
)
from turnpoint.trainer.anchors.source import WrittenAnchor
from turnpoint.trainer.control.failures import Failure, FailureKind, NotReadyError
from turnpoint.trainer.restore.restorer import RerunReason, RestorePlan, RestorePlanError
from turnpoint.trainer.snapshots.driver import EPOCH_STRIDE
from turnpoint.trainer.snapshots.report import failure_reason
from turnpoint.trainer.storage.layout import PublishStep
from turnpoint.trainer.storage.manifest import (
    AnchorRef,
    ParticipantEntry,
    PlacedEpisode,
    TrainerRolloutState,
)

EP1, EP2, EP3 = EpisodeId("r1", 0), EpisodeId("r2", 0), EpisodeId("r3", 2)


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
        # Retired while dispatch is still open (docs/spec.md section 7.4, the release).
        "retire",
        f"retired:{AGENT}",
        "anchor",
        "close",
        "hold",
        "drain",
        f"prepare:{ck}",
        # The books are read: new Runs wait at the agents until they release.
        "reopen",
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
    # Dispatch reopened once the books were read after the prepare.
    assert report.admission_closed_s == pytest.approx(0.5 + 3.0)
    # Three participants held from prepare to the end of the resume.
    assert report.participant_seconds == pytest.approx(3 * (3.0 + 1.0 + 0.25))


async def test_watchers_are_told_after_each_move_a_broken_one_is_logged_a_kill_propagates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Killed(BaseException):
        pass

    def broken(*args: object) -> None:
        raise ValueError("display broke")

    def kill(checkpoint_id: str, old: SnapshotState, new: SnapshotState, now: float) -> None:
        if new is SnapshotState.ANCHOR:
            raise Killed

    world = make_world(tmp_path)
    seen: list[SnapshotState] = []
    world.driver.subscribe(broken)
    world.driver.subscribe(kill)
    stop_seeing = world.driver.subscribe(lambda *args: seen.append(args[2]))
    with caplog.at_level(logging.ERROR), pytest.raises(Killed):
        await world.driver.take()
    assert "a watcher of snapshot" in caplog.text and "failed on new -> release" in caplog.text
    # The watchers after the killer were not told of the move it died on (the driver's
    # cleanup moves on to abort, which they see).
    assert seen[0] is SnapshotState.RELEASE and SnapshotState.ANCHOR not in seen
    stop_seeing()  # from the next attempt on


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


async def test_a_participant_a_restore_left_closed_is_released_before_any_prepare(
    tmp_path: Path,
) -> None:
    # Spec 7.7 item 9: the restore's resume never reached the agent; it is still in
    # PHASE_RESTORED, where a prepare would be refused and end the run as an invariant.
    world = make_world(tmp_path)
    restore_id = "restore-000000000002"
    plan = SimpleNamespace(restore_id=restore_id, unreleased=frozenset({AGENT}))
    world.driver.adopt_restore(cast(RestorePlan, plan))
    assert AGENT in world.rollouts.closed_to and world.rollouts.deadlines.held
    world.coordinator.resume_script = [{AGENT: DOWN}]

    failed = await world.driver.take()

    assert failed.outcome is SnapshotOutcome.FAILED and failed.transient
    assert failed.reason is FailureReason.PARTICIPANT_UNAVAILABLE
    assert world.coordinator.resumes == [(restore_id, (AGENT,))]
    assert world.coordinator.prepares == []
    assert world.driver.unreleased == {restore_id: frozenset({AGENT})}

    published = await world.driver.take()

    assert published.outcome is SnapshotOutcome.PUBLISHED
    assert world.coordinator.resumes[1] == (restore_id, (AGENT,))
    assert world.driver.unreleased == {}
    assert AGENT not in world.rollouts.closed_to and not world.rollouts.deadlines.held


async def test_completed_attempts_are_retired_on_the_resources_servers_only(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path)
    world.rollouts.session_retires.add(EP3)
    report = await world.driver.take()
    assert report.outcome is SnapshotOutcome.PUBLISHED
    # Spec 5.3 item 3 and 7.6 item 2: the sealed session is freed where it lives.
    assert world.coordinator.retires[-1] == {RESOURCES: (EP3,)}
    assert world.rollouts.pending_session_retires() == ()


async def test_only_abandoned_attempts_are_retired_while_dispatch_is_closed(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path)
    anchor_write = world.anchor.write

    async def ended_during_the_anchor(snapshot: Path) -> WrittenAnchor:
        # One attempt completes and one is abandoned after the release retired the rest.
        world.rollouts.session_retires.add(EP3)
        world.rollouts.retires = {AGENT: {EP2}}
        return await anchor_write(snapshot)

    world.anchor.write = ended_during_the_anchor  # type: ignore[method-assign]
    report = await world.driver.take()

    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    closed = world.events[world.events.index("close") : world.events.index("reopen")]
    # The abandoned attempt may still run on its agent: retired before the prepare...
    assert closed.count("retire") == 1
    assert world.coordinator.retires == [{AGENT: (EP2,), RESOURCES: (EP2,)}]
    # ...while the completed attempt's session waits for the next release.
    assert world.rollouts.pending_session_retires() == (EP3,)
    world.anchor.write = anchor_write  # type: ignore[method-assign]
    world.rollouts.version += 1
    world.events.clear()
    assert (await world.driver.take()).outcome is SnapshotOutcome.PUBLISHED
    assert world.events.index("retire") < world.events.index("anchor")
    assert world.coordinator.retires[-1] == {RESOURCES: (EP3,)}
    assert world.rollouts.pending_session_retires() == ()


async def test_books_that_break_the_rollout_state_fail_the_attempt_after_the_reopen(
    tmp_path: Path,
) -> None:
    # The books are only copied while dispatch is closed; they are checked after it
    # reopened, and a check that fails is a broken invariant: the id is resumed
    # everywhere and nothing is published.
    world = make_world(tmp_path)
    world.rollouts.rollouts = [rollout(EP1)]
    world.rollouts.queue = [{"rollout_id": "r9", "attempt": 0, "score": float("nan")}]

    report = await world.driver.take()

    assert report.outcome is SnapshotOutcome.FAILED
    assert report.reason is FailureReason.INVARIANT and "books" in report.detail
    ck = report.checkpoint_id
    assert world.events.index("reopen") < world.events.index(f"resume:{ck}")
    assert f"commit:{ck}" not in world.events
    assert world.layout.latest() is None
    assert world.rollouts.open and not world.rollouts.deadlines.held


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
    # On its agent and on every resources server, which may hold its session.
    assert world.coordinator.retires[-1] == {AGENT: (EP3,), RESOURCES: (EP3,)}
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
    caplog.set_level(logging.WARNING, logger="turnpoint.trainer.snapshots.driver")

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
    from turnpoint.trainer.control.failures import classify

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


def test_plan_reruns_what_a_running_participant_saw_past_above_it_and_continues_the_rest() -> None:
    # docs/spec.md section 7.7 item 7: r1's N+1 was seen (retired through 4) where it
    # ran; round one installed r1 and r2 as attempt 1 elsewhere before the refusal.
    a, b = rollout(EP1), rollout(EP2, group="g2")
    manifest = plan_manifest(continued=[a, b], resources_export=[EP1, EP2])

    plan = plan_restore(
        manifest,
        group_topology(),
        RecoveryLevel.TURN,
        restore_id="restore-2",
        seen_since={"r1": 4},
        retired=[EpisodeId("r1", 1), EpisodeId("r2", 1)],
    )

    assert [r.episode for r in plan.redispatch] == [EpisodeId("r2", 1)]
    assert [(r.episode, r.reason) for r in plan.rerun] == [
        (EpisodeId("r1", 5), RerunReason.SEEN_SINCE)
    ]
    assert plan.restore_scope == {AGENT: (EP2,), RESOURCES: (EP2,)}
    # A group-scored group with such a sibling reruns whole, every sibling above it.
    c = rollout(EpisodeId("r3", 0), sibling=1)
    grouped = plan_manifest(continued=[a, c], resources_export=[EP1])
    whole = plan_restore(
        grouped,
        group_topology(group_scored=True),
        RecoveryLevel.TURN,
        restore_id="restore-2",
        seen_since={"r1": 1},
    )
    assert whole.redispatch == () and whole.groups_retried_whole == 1
    assert {(r.episode, r.reason) for r in whole.rerun} == {
        (EpisodeId("r1", 2), RerunReason.GROUP),
        (EpisodeId("r3", 1), RerunReason.GROUP),
    }


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
