"""Fakes the tests share: protocol time, participant probes, the trainer's collaborators.

- :class:`FakeClock`: protocol time that only the test (or another fake) moves.
- :func:`state_of`, :func:`boundary_of` and :func:`expect`: a look into a participant's
  core and the protocol error a call must end with, for tests of the runtime in process
  and over the wire alike.
- :class:`FakeAnchor` and :class:`FakeRollouts`: just enough of an anchor source and a
  rollout side for the snapshot driver. Given a clock and an event list they also take
  time on that clock and record, in order, what the driver asked of them.
- :class:`FakeCoordinator` and :func:`make_world`: the snapshot driver's world, a real
  driver and a real layout on a temporary directory around these fakes, for the
  driver's own tests and the demo's kill switch.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk._core import ParticipantCore, WorkKey
from turnpoint.protocol import (
    ArtifactRef,
    EpisodeState,
    ParticipantKind,
    RecoveryLevel,
    RecoveryMode,
    VerifyMode,
)
from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.advanced import (
    CommitFailed,
    ControlReport,
    CoordinatorMetrics,
    DeadlineRegistry,
    Hold,
    InFlightRollout,
    ParticipantInfo,
    PreparedCheckpoint,
    PrepareFailed,
    SnapshotDriver,
    SnapshotLayout,
    SnapshotPump,
    Topology,
)
from turnpoint.trainer.anchors.source import WrittenAnchor
from turnpoint.trainer.control.failures import Failure, FailureKind
from turnpoint.trainer.rollouts.side import UnackedDecision
from turnpoint.trainer.snapshots.preparing import UnackedResolver
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import (
    AnchorRef,
    ParticipantEntry,
    RolloutBooks,
    TrainerRolloutState,
)

# ------------------------------------------------------------------------ time


class FakeClock:
    """Protocol time the test moves by hand (leases, budgets, phase durations)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ------------------------------------------------------------ participant probes


def state_of(core: ParticipantCore, episode: EpisodeId, slot: str = "run") -> EpisodeState | None:
    view = core.entry(WorkKey(episode, slot))
    return None if view is None else view.state


def boundary_of(core: ParticipantCore, episode: EpisodeId) -> int:
    view = core.entry(WorkKey(episode, "run"))
    return -1 if view is None else view.boundary_index


async def expect(reason: Reason, awaitable: Awaitable[object]) -> TurnpointError:
    """The protocol error ``awaitable`` raised, which must carry ``reason``."""
    try:
        await awaitable
    except TurnpointError as error:
        assert error.reason is reason, error
        return error
    raise AssertionError(f"expected {reason.name}")


# ---------------------------------------------------------------- trainer side


def saved(r: InFlightRollout, *, accepted: bool = True) -> dict[str, Any]:
    """``r`` as the trainer's rollout state records an unfinished rollout."""
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


class FakeRollouts:
    """A RolloutSide that records what the snapshot driver asked, in order.

    The test sets what the driver reads: ``rollouts`` in flight, the ``queue`` and
    ``data_loader`` of the cut, the ``retires`` owed, ``version`` (bumped when anything
    changed, so that an attempt is taken rather than skipped). An unacknowledged
    completion is resolved with ``decision`` (recorded in ``resolved``, then
    ``on_resolve`` runs); draining the acknowledgements takes ``drain_s`` on the clock
    and raises ``drain_error`` if set.
    """

    def __init__(
        self,
        clock: FakeClock | None = None,
        events: list[str] | None = None,
        *,
        data_loader: Any = None,
    ) -> None:
        self.clock = clock if clock is not None else FakeClock()
        self.events = events if events is not None else []
        self.version = 1
        self.open = True
        self.closed_to: set[str] = set()
        self.deadlines: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
        self.rollouts: list[InFlightRollout] = []
        self.queue: list[dict[str, Any]] = []
        self.data_loader = data_loader
        self.retires: dict[str, set[EpisodeId]] = {}
        self.session_retires: set[EpisodeId] = set()
        self.retired_calls: list[tuple[str, tuple[EpisodeId, ...]]] = []
        self.decision: UnackedDecision = "acknowledge"
        self.resolved: list[tuple[str, EpisodeId, str]] = []
        self.on_resolve: Callable[[], None] | None = None
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
        return self.rollout_books().state()

    def rollout_books(self) -> RolloutBooks:
        return RolloutBooks(
            queue=tuple(self.queue),
            data_loader=self.data_loader,
            attempts={r.episode.rollout_id: r.episode.attempt for r in self.rollouts}
            | {item["rollout_id"]: item["attempt"] for item in self.queue},
            in_flight=tuple(saved(r) for r in self.rollouts),
        )

    async def resolve_unacknowledged(
        self, instance: str, episode: EpisodeId, receipt_id: str
    ) -> UnackedDecision:
        self.resolved.append((instance, episode, receipt_id))
        if self.on_resolve is not None:
            self.on_resolve()
        return self.decision

    def pending_retires(self) -> Mapping[str, Sequence[EpisodeId]]:
        return {k: tuple(sorted(v)) for k, v in self.retires.items() if v}

    def retired(self, instance: str, episodes: Sequence[EpisodeId]) -> None:
        self.events.append(f"retired:{instance}")
        self.retired_calls.append((instance, tuple(episodes)))
        self.retires.get(instance, set()).difference_update(episodes)

    def pending_session_retires(self) -> Sequence[EpisodeId]:
        return tuple(sorted(self.session_retires))

    def sessions_retired(self, episodes: Sequence[EpisodeId]) -> None:
        self.session_retires.difference_update(episodes)


class FakeAnchor:
    """An anchor source that writes one small file for ``step``.

    Given a clock, a write takes ``write_s`` on it; ``error``, if set, is raised instead
    of writing (after the time is taken, as a disk that fills up mid-write).
    """

    def __init__(
        self, clock: FakeClock | None = None, events: list[str] | None = None, *, step: int = 1
    ) -> None:
        self.clock = clock
        self.events = events if events is not None else []
        self.step = step
        self.error: BaseException | None = None
        self.write_s = 2.0

    async def write(self, snapshot: Path) -> WrittenAnchor:
        self.events.append("anchor")
        if self.clock is not None:
            self.clock.advance(self.write_s)
        if self.error is not None:
            raise self.error
        directory = snapshot / "trainer" / "anchor"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "state.bin").write_bytes(f"step {self.step}".encode())
        return WrittenAnchor(AnchorRef(sha256=tree_digest(directory)), self.step)


# ------------------------------------------------------- the snapshot driver's world

AGENT, RESOURCES, MODEL = "agent-0", "res-0", "model-0"

# What a scripted control operation may end with (FakeCoordinator's scripts).
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
    """An unfinished rollout on the world's agent."""
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

    clock: FakeClock
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
    forgets: list[dict[str, tuple[str, ...]]] = field(default_factory=list)
    prepares: list[str] = field(default_factory=list)
    scopes: list[dict[str, frozenset[EpisodeId]]] = field(default_factory=list)
    during_prepare: Callable[[], None] | None = None

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        resolve: UnackedResolver | None = None,
        snapshot: str | None = None,
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

    async def forget(self, rollout_ids: Mapping[str, Iterable[str]]) -> ControlReport:
        chosen = {k: tuple(v) for k, v in rollout_ids.items()}
        self.events.append("forget")
        self.forgets.append(chosen)
        return ControlReport("forget", "k", frozenset(chosen), {})


@dataclass
class World:
    clock: FakeClock
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
    """A real driver (epoch 3) on one fake clock, with one event list for every fake."""
    clock = FakeClock()
    events: list[str] = []
    settings = CoordinatorConfig(
        snapshot_root=tmp_path, snapshot_interval_s=60.0, keep_snapshots=2, **config
    )
    layout = layout or SnapshotLayout(tmp_path)
    rollouts = FakeRollouts(clock, events, data_loader={"index": 7})
    anchor = FakeAnchor(clock, events, step=10)
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


def counted_ids(prefix: str = "run") -> Callable[[], str]:
    """A deterministic request-id source for a rollout ledger: ``run-0``, ``run-1``, ..."""
    numbers = itertools.count()
    return lambda: f"{prefix}-{next(numbers)}"
