"""The demo trainer's kill switch, wired around a real snapshot driver with fakes.

The driver, its layout and the fakes are the snapshot driver's world of
``tests.support.fakes``, as in ``test_snapshot_driver``; the switch watches the driver
exactly as the demo trainer wires it. "Killing" raises :class:`Killed` (a
``BaseException``, so nothing on the way catches it), which ends the attempt where a
SIGKILL would.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakes import NOT_READY, World, make_world, rollout
from tests.support.scripted import poll
from turnpoint.apps.demo._kill_switch import (
    Fired,
    KillAt,
    KillPoint,
    KillSwitch,
    append_event,
    parse_kill_at,
)
from turnpoint.apps.demo._supervisor import CRASH_POINTS
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.trainer import SnapshotOutcome, SnapshotReport
from turnpoint.trainer.advanced import PreparedCheckpoint, SnapshotDriver, SnapshotLayout
from turnpoint.trainer.snapshots.driver import EPOCH_STRIDE
from turnpoint.trainer.storage.layout import PublishStep
from turnpoint.trainer.storage.manifest import ParticipantEntry
from turnpoint.v1 import types_pb2

EP1, EP2 = EpisodeId("r1", 0), EpisodeId("r2", 0)


class Killed(BaseException):
    pass


class Recorder:
    def __init__(self) -> None:
        self.fired: list[Fired] = []

    def on_fire(self, fired: Fired) -> None:
        self.fired.append(fired)

    def kill(self) -> None:
        raise Killed


class Tracing(KillSwitch):
    """Records every point reached, in order."""

    def __init__(self, at: KillAt) -> None:
        super().__init__(at)
        self.trace: list[KillPoint] = []

    def reached(self, point: KillPoint, *, call_under_way: bool = False) -> None:
        self.trace.append(point)
        super().reached(point, call_under_way=call_under_way)


def wired(tmp_path: Path, switch: KillSwitch) -> tuple[World, SnapshotDriver]:
    world = make_world(
        tmp_path, layout=SnapshotLayout(tmp_path, after_step=switch.after_publish_step)
    )
    switch.attach(world.driver)
    return world, world.driver


async def take(world: World, driver: SnapshotDriver, *, in_flight: bool) -> SnapshotReport:
    world.rollouts.rollouts = [rollout(EP1), rollout(EP2, sibling=1)] if in_flight else []
    world.rollouts.version += 1  # something changed: the attempt is taken, not skipped
    return await driver.take()


# ---------------------------------------------------------------------- names


def test_there_is_a_point_after_every_publish_step_in_publish_order() -> None:
    points = [KillPoint.after(step) for step in PublishStep]
    order = list(KillPoint)
    assert [order.index(p) for p in points] == sorted(order.index(p) for p in points)
    assert order[: order.index(points[0])][-1] is KillPoint.COMMITTED
    assert order[order.index(points[-1]) + 1 :] == [KillPoint.PUBLISHED, KillPoint.RESUMED]


def test_the_supervisor_spells_the_points_as_the_trainer_does() -> None:
    assert tuple(point.value for point in KillPoint) == CRASH_POINTS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prepared", KillAt(KillPoint.PREPARED, 1)),
        ("latest-moved:3", KillAt(KillPoint.LATEST_MOVED, 3)),
        (" anchor-written:1 ", KillAt(KillPoint.ANCHOR_WRITTEN, 1)),
    ],
)
def test_kill_at_parses(text: str, expected: KillAt) -> None:
    assert KillAt.parse(text) == expected
    assert KillAt.parse(str(expected)) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("comitted", "unknown kill point 'comitted' (did you mean committed?): choose one of "),
        ("prepared:0", "'prepared:0': N in POINT:N must be an integer >= 1, got '0'"),
        ("prepared:two", "'prepared:two': N in POINT:N must be an integer >= 1, got 'two'"),
    ],
)
def test_a_bad_kill_at_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        parse_kill_at(text)
    assert str(caught.value).startswith(message)


def test_an_event_is_appended_as_one_line(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text('{"type": "start"}\n')
    append_event(log, {"type": "kill", "point": "prepared"})
    assert log.read_text().splitlines() == [
        '{"type": "start"}',
        '{"point": "prepared", "type": "kill"}',
    ]


# ---------------------------------------------------------------------- wiring


async def test_one_published_snapshot_reaches_every_point_in_order(tmp_path: Path) -> None:
    switch = Tracing(KillAt(KillPoint.RESUMED, 99))
    world, driver = wired(tmp_path, switch)

    report = await take(world, driver, in_flight=True)

    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    assert switch.trace == list(KillPoint)
    assert switch.fired is None


async def test_a_failed_prepare_reaches_no_point_after_it(tmp_path: Path) -> None:
    switch = Tracing(KillAt(KillPoint.RESUMED, 99))
    world, driver = wired(tmp_path, switch)
    world.coordinator.prepare_script = [{"agent-0": NOT_READY}]

    report = await take(world, driver, in_flight=True)

    assert report.outcome is SnapshotOutcome.FAILED
    assert switch.trace == [
        KillPoint.ANCHOR_WRITTEN,
        KillPoint.DISPATCH_CLOSED,
        KillPoint.PREPARE_SENT,
    ]


@pytest.mark.parametrize("point", list(KillPoint), ids=lambda point: point.value)
async def test_the_first_snapshot_dies_at_the_point(point: KillPoint, tmp_path: Path) -> None:
    recorder = Recorder()
    switch = KillSwitch(KillAt(point), on_fire=recorder.on_fire, kill=recorder.kill)
    world, driver = wired(tmp_path, switch)

    with pytest.raises(Killed):
        await take(world, driver, in_flight=True)

    [fired] = recorder.fired
    assert fired.at.point is point
    assert fired.checkpoint_id == make_checkpoint_id("ck", 3 * EPOCH_STRIDE + 1)
    # Nothing was published before: a restore picks this snapshot or starts fresh.
    published = world.layout.list_published()
    if point.restores_this_snapshot:
        assert published == [fired.checkpoint_id] == [fired.newest_published]
    else:
        assert published == [] and fired.newest_published is None


async def test_the_nth_snapshot_counts_only_snapshots_that_continued_rollouts(
    tmp_path: Path,
) -> None:
    recorder = Recorder()
    switch = KillSwitch(KillAt(KillPoint.PREPARED, 2), on_fire=recorder.on_fire, kill=recorder.kill)
    world, driver = wired(tmp_path, switch)

    empty = await take(world, driver, in_flight=False)
    assert empty.outcome is SnapshotOutcome.PUBLISHED and not recorder.fired
    # Published without rollouts in flight: a restore would have nothing to continue.
    loaded = await take(world, driver, in_flight=True)
    assert loaded.outcome is SnapshotOutcome.PUBLISHED and not recorder.fired
    with pytest.raises(Killed):
        await take(world, driver, in_flight=False)

    [fired] = recorder.fired
    assert fired.newest_published == loaded.checkpoint_id
    assert fired.checkpoint_id not in (empty.checkpoint_id, loaded.checkpoint_id)


async def test_a_restored_trainer_dies_only_once_its_restore_continued_a_rollout(
    tmp_path: Path,
) -> None:
    """A ``--crash-at`` sequence's later trainers: until a rollout the restore resumed has
    finished, no snapshot counts as the kill's, however many reach the point."""
    recorder = Recorder()
    switch = KillSwitch(
        KillAt(KillPoint.PREPARED), on_fire=recorder.on_fire, kill=recorder.kill, restored=True
    )
    world, driver = wired(tmp_path, switch)

    passed = await take(world, driver, in_flight=True)
    assert passed.outcome is SnapshotOutcome.PUBLISHED and not recorder.fired
    switch.continuation_seen()
    with pytest.raises(Killed):
        await take(world, driver, in_flight=True)

    [fired] = recorder.fired
    assert fired.checkpoint_id != passed.checkpoint_id


async def test_after_the_manifest_is_linked_only_a_snapshot_with_rollouts_dies(
    tmp_path: Path,
) -> None:
    recorder = Recorder()
    switch = KillSwitch(
        KillAt(KillPoint.LATEST_MOVED), on_fire=recorder.on_fire, kill=recorder.kill
    )
    world, driver = wired(tmp_path, switch)

    # Let through: the restore would pick it, with nothing to continue...
    assert (await take(world, driver, in_flight=False)).outcome is SnapshotOutcome.PUBLISHED
    # ...and, as the newest published snapshot, it disarms the switch until one with
    # rollouts is published.
    loaded = await take(world, driver, in_flight=True)
    assert loaded.outcome is SnapshotOutcome.PUBLISHED and not recorder.fired
    with pytest.raises(Killed):
        await take(world, driver, in_flight=True)

    [fired] = recorder.fired
    assert fired.newest_published == fired.checkpoint_id == world.layout.list_published()[0]


class Probe:
    """Says yes on the ``yes_on``-th question."""

    def __init__(self, yes_on: int) -> None:
        self.asked: list[tuple[str, frozenset[int]]] = []
        self.yes_on = yes_on
        self.connected = 0

    async def connect(self) -> None:
        self.connected += 1

    async def any_in(self, checkpoint_id: str, phases: Collection[int]) -> bool:
        self.asked.append((checkpoint_id, frozenset(phases)))
        return len(self.asked) >= self.yes_on

    async def aclose(self) -> None:
        pass


async def test_prepare_sent_lands_while_the_prepare_is_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    probe = Probe(yes_on=2)
    switch = KillSwitch(
        KillAt(KillPoint.PREPARE_SENT), probe=probe, on_fire=recorder.on_fire, kill=recorder.kill
    )
    world, driver = wired(tmp_path, switch)
    prepare = world.coordinator.prepare

    async def under_way(checkpoint_id: str, **kwargs: Any) -> PreparedCheckpoint:
        # Parking takes a while: the prepare is under way until the probe asked twice.
        await poll(lambda: len(probe.asked) >= 2)
        return await prepare(checkpoint_id, **kwargs)

    monkeypatch.setattr(world.coordinator, "prepare", under_way)

    with pytest.raises(Killed):
        await take(world, driver, in_flight=True)

    ck = make_checkpoint_id("ck", 3 * EPOCH_STRIDE + 1)
    assert [(f.checkpoint_id, f.call_under_way) for f in recorder.fired] == [(ck, True)]
    holding = frozenset({types_pb2.PHASE_PREPARING, types_pb2.PHASE_PREPARED})
    assert probe.asked == [(ck, holding), (ck, holding)]
    # Nothing after the kill went on: the attempt ended when the prepare returned.
    assert world.coordinator.scopes == []
    await switch.aclose()


async def test_without_an_answer_the_point_lands_when_the_call_returns(tmp_path: Path) -> None:
    recorder = Recorder()
    switch = KillSwitch(
        KillAt(KillPoint.COMMIT_SENT),
        probe=Probe(yes_on=10**9),
        on_fire=recorder.on_fire,
        kill=recorder.kill,
    )
    world, driver = wired(tmp_path, switch)

    with pytest.raises(Killed):
        await take(world, driver, in_flight=True)
    assert [fired.call_under_way for fired in recorder.fired] == [False]
    assert len(world.coordinator.scopes) == 1  # the commit was sent, and returned
    await switch.aclose()


async def test_a_switch_that_is_not_armed_never_asks(tmp_path: Path) -> None:
    probe = Probe(yes_on=1)
    switch = KillSwitch(KillAt(KillPoint.PREPARE_SENT, 2), probe=probe)
    world, driver = wired(tmp_path, switch)

    assert (await take(world, driver, in_flight=True)).outcome is SnapshotOutcome.PUBLISHED
    assert probe.asked == [] and probe.connected == 0


async def test_an_armed_switch_connects_its_probe_before_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    probe = Probe(yes_on=1)
    switch = KillSwitch(
        KillAt(KillPoint.COMMIT_SENT), probe=probe, on_fire=recorder.on_fire, kill=recorder.kill
    )
    world, driver = wired(tmp_path, switch)
    commit = world.coordinator.commit

    async def under_way(*args: Any) -> dict[str, ParticipantEntry]:
        # Writing takes a while: the commit is under way until the probe was asked.
        await poll(lambda: bool(probe.asked))
        return await commit(*args)

    monkeypatch.setattr(world.coordinator, "commit", under_way)

    with pytest.raises(Killed):
        await take(world, driver, in_flight=True)

    assert probe.connected == 1
    assert probe.asked == [(recorder.fired[0].checkpoint_id, frozenset({4}))]
    assert recorder.fired[0].call_under_way
    await switch.aclose()
