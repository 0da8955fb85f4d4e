"""The control path of one snapshot against its two transport baselines, and the same
snapshot made durable on disk.

**Control path.** For each number N of participants, rounds of three paths are timed,
with every snapshot root (the participants' stores and the trainer's layout) on tmpfs
(``/dev/shm`` by default), so that the figure is the protocol's and not the co-located
disk's:

- **turnpoint**: the real coordinator
  (:class:`~turnpoint.trainer.control.coordinator.Coordinator`, ControlSession streams) drives
  one snapshot of N real participants: prepare (with what the coordinator does around
  it: a WatchBoundaries stream per participant and the lease renewer), commit (nothing
  to export, so each participant answers ``saved_nothing`` and writes no file,
  docs/spec.md section 4.8), publish of the manifest
  (:class:`~turnpoint.trainer.storage.manifest.SnapshotLayout`, fsyncs included) and resume.
  Every round uses a fresh checkpoint id. The trainer anchor is the trainer's own
  write, not control traffic: an empty anchor directory is made before the clock
  starts. The coordinator runs with its default configuration (``fanout_concurrency``
  included), timeouts aside.
- **lower bound**: the same four phases as one echo round trip on each of N open bidi
  gRPC streams.
- **HTTP+JSON**: the same four phases as one JSON POST to each of N aiohttp servers
  over keep-alive connections.

The N servers of every path are spread over the same worker processes the same way
(server ``j`` lives in worker ``j mod W``). The workers freeze their start-up heaps once
serving, as ``turnpoint serve`` does, and this process freezes its own while a size is
timed (:mod:`turnpoint.apps._heap`), so that no full collection walks thousands of
connections in the middle of a round. Within a round the three paths run one after
the other, the one that goes first rotating from round to round, with a short pause
after each so that the background work one leaves behind (stream teardown, the kernel
flushing a commit's files) is not billed to the next. After ``warmup`` rounds, the
median of ``rounds`` rounds is reported, with each phase's median.

**Durable commit.** The turnpoint path alone, on the disk root, with every ``os.fsync``
counted: the participants' (in their worker processes) and the coordinator's (in this
process, split into the publication's and the rest: retention, partial cleanup).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, Final, Protocol, Self

from turnpoint.apps._heap import frozen_heap
from turnpoint.apps.bench._baselines import BidiEchoFanout, HttpJsonFanout
from turnpoint.apps.bench._workers import (
    HOST,
    FsyncCount,
    WorkerProcess,
    counting_fsyncs,
    fleet_job,
    parked_episodes,
)
from turnpoint.ids import EpisodeId, checkpoint_sequence, make_checkpoint_id
from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.advanced import (
    AnchorRef,
    Coordinator,
    SnapshotLayout,
    SnapshotManifest,
    SnapshotPhase,
    bump_epoch,
    tree_digest,
)

PHASES: Final = tuple(
    phase.value
    for phase in (
        SnapshotPhase.PREPARE,
        SnapshotPhase.COMMIT,
        SnapshotPhase.PUBLISH,
        SnapshotPhase.RESUME,
    )
)
"""The snapshot phases one round times (the trainer's own phase names)."""
_ROUND_TIMEOUT_S: Final = 120.0
_WORKER_START_TIMEOUT_S: Final = 120.0
_COORDINATOR_ID: Final = "bench"
_KEEP_SNAPSHOTS: Final = 2
SETTLE_S: Final = 0.05

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class OverheadRow:
    """Medians for one N, in milliseconds; ``phases_ms`` splits the turnpoint median's
    round into its phases (each the median of that phase, so they need not add up).

    The participants hold no work, so each commits saved-nothing in its prepare
    (docs/spec.md section 4.6 item 8) and the commit phase sends nothing;
    ``with_commit_ms`` is the same snapshot with that offer left out, every participant
    sent its Commit: four round trips, what a participant holding episodes costs
    (without its export and write)."""

    participants: int
    overhead_ms: float
    lower_bound_ms: float
    http_json_ms: float
    rounds: int
    phases_ms: Mapping[str, float] = field(default_factory=dict)
    with_commit_ms: float | None = None
    # Median CPU milliseconds of one round of each path ("turnpoint", "bidi", ...): the
    # coordinator's process and the workers', every thread; empty where Linux does not
    # say. A path cannot take less than its CPU spread over the ``cores``.
    cpu_ms: Mapping[str, float] = field(default_factory=dict)
    cores: int = 1
    # Median microseconds of one ``asyncio.to_thread`` round trip in the coordinator's
    # process (a thread woken and the loop woken back), measured before the rounds.
    thread_hop_us: float | None = None

    @property
    def ratio(self) -> float:
        return self.overhead_ms / self.lower_bound_ms

    @property
    def ratio_vs_http_json(self) -> float:
        return self.overhead_ms / self.http_json_ms

    @property
    def cpu_vs_floor_cpu(self) -> float | None:
        """The snapshot's CPU over the bidi floor's for the same N."""
        ours, floor = self.cpu_ms.get("turnpoint"), self.cpu_ms.get("bidi")
        return None if ours is None or not floor else ours / floor

    @property
    def least_ratio_cpu_allows(self) -> float | None:
        """The snapshot's CPU spread over every core, over the floor's time: no path
        that needs this CPU comes closer to the floor on this machine."""
        ours = self.cpu_ms.get("turnpoint")
        return None if ours is None else ours / self.cores / self.lower_bound_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "participants": self.participants,
            "overhead_ms": round(self.overhead_ms, 3),
            "lower_bound_ms": round(self.lower_bound_ms, 3),
            "ratio": round(self.ratio, 3),
            "http_json_ms": round(self.http_json_ms, 3),
            "ratio_vs_http_json": round(self.ratio_vs_http_json, 3),
            "with_commit_ms": None
            if self.with_commit_ms is None
            else round(self.with_commit_ms, 3),
            "cpu_ms": {path: round(ms, 3) for path, ms in self.cpu_ms.items()},
            "cores": self.cores,
            "cpu_vs_floor_cpu": None
            if (per_floor := self.cpu_vs_floor_cpu) is None
            else round(per_floor, 3),
            "least_ratio_cpu_allows": None
            if (least := self.least_ratio_cpu_allows) is None
            else round(least, 3),
            "thread_hop_us": None if self.thread_hop_us is None else round(self.thread_hop_us, 1),
        }


@dataclass(frozen=True, slots=True)
class DurableCommit:
    """One snapshot of ``participants`` participants on the disk root: median
    milliseconds (the whole control path and each phase) and fsyncs per snapshot.

    ``participant_fsyncs`` is every fsync of the participants' worker processes over
    all rounds (warmup included) divided by those rounds; ``publish_fsyncs`` the
    coordinator's inside the publication, ``other_coordinator_fsyncs`` the rest of its
    round (retention and partial cleanup).
    """

    participants: int
    rounds: int
    total_ms: float
    phases_ms: Mapping[str, float]
    participant_fsyncs: float
    publish_fsyncs: float
    other_coordinator_fsyncs: float
    root: str
    parked: int = 0
    state_bytes: int = 0
    # The last published snapshot's shape: every file with its size, every directory.
    tree: SnapshotTree | None = None
    # Median CPU seconds of one measured snapshot, prepare to resume: the participants'
    # worker processes and the coordinator's process. None where the kernel does not
    # report a process's CPU time.
    cpu_s: Mapping[str, float] | None = None

    @property
    def fsyncs(self) -> float:
        """Every fsync of one snapshot, participants' and coordinator's."""
        return self.durable_fsyncs + self.other_coordinator_fsyncs

    @property
    def durable_fsyncs(self) -> float:
        """The fsyncs that make one snapshot durable: the participants' commits and the
        publication; not retention's, which makes an older snapshot's deletion durable."""
        return self.participant_fsyncs + self.publish_fsyncs

    def to_json(self) -> dict[str, object]:
        return {
            "participants": self.participants,
            "parked_per_participant": self.parked,
            "state_bytes_per_episode": self.state_bytes,
            "rounds": self.rounds,
            "total_ms": round(self.total_ms, 3),
            "phases_ms": {k: round(v, 3) for k, v in self.phases_ms.items()},
            "fsyncs_per_snapshot": {
                "participants": round(self.participant_fsyncs, 2),
                "coordinator_publish": round(self.publish_fsyncs, 2),
                "coordinator_other": round(self.other_coordinator_fsyncs, 2),
            },
            "root": self.root,
            "snapshot": None if self.tree is None else self.tree.to_json(),
            "cpu_ms_per_snapshot": None
            if self.cpu_s is None
            else {k: round(v * 1000, 3) for k, v in self.cpu_s.items()},
        }


@dataclass(frozen=True, slots=True)
class SnapshotTree:
    """What one published snapshot holds on disk, relative to the snapshot root:
    ``files`` (path, bytes) and ``directories``, the snapshot's own directory first.
    Publishing it also writes ``LATEST`` and a new entry in the root, which
    :attr:`durable_items` counts: the files and directories one snapshot makes durable."""

    files: tuple[tuple[str, int], ...]
    directories: tuple[str, ...]

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)

    @property
    def durable_items(self) -> int:
        # + LATEST (a file) and the root (a directory whose entries changed).
        return len(self.files) + len(self.directories) + 2

    def to_json(self) -> dict[str, object]:
        return {
            "files": len(self.files),
            "directories": len(self.directories),
            "bytes": self.bytes,
            "files_and_directories_made_durable": self.durable_items,
        }


def snapshot_tree(root: Path, checkpoint_id: str) -> SnapshotTree:
    """The shape of ``<root>/<checkpoint_id>`` (blocking: walks the tree)."""
    top = root / checkpoint_id
    files: list[tuple[str, int]] = []
    directories = [checkpoint_id]
    for here, names, leaves in os.walk(top):
        names.sort()
        relative = Path(here).relative_to(root)
        directories.extend(str(relative / name) for name in names)
        files.extend(
            (str(relative / leaf), (Path(here) / leaf).stat().st_size) for leaf in sorted(leaves)
        )
    return SnapshotTree(tuple(files), tuple(directories))


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` has run, summed over its live threads, from Linux's
    per-thread ``schedstat`` (nanoseconds); None elsewhere or once it is gone. A CPU
    time, unlike a wall time, barely moves when other work shares the machine."""
    total_ns = 0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with open(f"{task.path}/schedstat", encoding="ascii") as stat:
                total_ns += int(stat.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total_ns / 1e9


# -------------------------------------------------------------------------- fleet


def participant_name(index: int) -> str:
    return f"p{index:04d}"


class Fleet:
    """``size`` servers of each path spread over ``workers`` worker processes.

    ``async with`` starts every worker and always stops (or kills) them on exit.
    """

    def __init__(
        self,
        root: Path,
        size: int,
        workers: int,
        token: str,
        *,
        baselines: bool = True,
        count_fsyncs: bool = False,
        parked: int = 0,
        state_bytes: int = 0,
    ) -> None:
        if size < 1 or workers < 1:
            raise ValueError("a fleet needs at least one server and one worker")
        self.root = root
        self.size = size
        self.token = token
        self._workers = [
            WorkerProcess(
                f"fleet-{w}",
                fleet_job(
                    root,
                    [participant_name(j) for j in range(w, size, workers)],
                    len(range(w, size, workers)) if baselines else 0,
                    count_fsyncs=count_fsyncs,
                    parked=parked,
                    state_bytes=state_bytes,
                ),
                token,
            )
            for w in range(min(workers, size))
        ]
        self.participants: dict[str, str] = {}
        self.echo: list[str] = []
        self.http: list[str] = []

    async def __aenter__(self) -> Self:
        try:
            reports = await asyncio.gather(
                *(worker.start(_WORKER_START_TIMEOUT_S) for worker in self._workers)
            )
        except BaseException:
            await self.aclose()
            raise
        count = len(self._workers)
        echo: dict[int, str] = {}
        http: dict[int, str] = {}
        for w, report in enumerate(reports):
            for name, port in report["participants"].items():
                self.participants[name] = f"{HOST}:{port}"
            for k, (echo_port, http_port) in enumerate(
                zip(report["echo"], report["http"], strict=True)
            ):
                echo[w + k * count] = f"{HOST}:{echo_port}"
                http[w + k * count] = f"{HOST}:{http_port}"
        self.echo = [echo[j] for j in sorted(echo)]
        self.http = [http[j] for j in sorted(http)]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(worker.stop() for worker in self._workers))

    @property
    def fsyncs(self) -> int:
        """The fsyncs its workers reported on exit (``count_fsyncs``; after close)."""
        return sum(int(worker.final_report.get("fsyncs", 0)) for worker in self._workers)

    def cpu_seconds(self) -> float | None:
        """CPU seconds its workers have run so far, every thread (blocking: reads /proc);
        None where the kernel does not say."""
        total = 0.0
        for worker in self._workers:
            seconds = None if worker.pid is None else process_cpu_seconds(worker.pid)
            if seconds is None:
                return None
            total += seconds
        return total

    async def take_turns(self) -> int:
        """Every parked episode of the fleet takes a turn (a new boundary, new state) and
        parks again; returns how many did."""
        turned = await asyncio.gather(
            *(worker.take_turn(_WORKER_START_TIMEOUT_S) for worker in self._workers)
        )
        return sum(turned)

    def endpoints(self, n: int) -> dict[str, str]:
        names = [participant_name(j) for j in range(n)]
        return {name: self.participants[name] for name in names}


# ------------------------------------------------------------------------ rounds


class _Fanout(Protocol):
    async def phase(self, phase: str, request_id: str) -> None: ...


async def _baseline_round(fanout: _Fanout, round_id: str) -> dict[str, float]:
    laps = [time.perf_counter()]
    for phase in PHASES:
        await fanout.phase(phase, f"{round_id}-{phase}")
        laps.append(time.perf_counter())
    return _laps(laps)


def _laps(laps: Sequence[float]) -> dict[str, float]:
    durations = {phase: laps[i + 1] - laps[i] for i, phase in enumerate(PHASES)}
    return durations | {"total": laps[-1] - laps[0]}


class _SnapshotRounds:
    """One snapshot's control path per call, through the real coordinator."""

    def __init__(
        self,
        coordinator: Coordinator,
        layout: SnapshotLayout,
        ids: Iterator[str],
        fsyncs: FsyncCount | None = None,
        *,
        commit_in_prepare: bool = True,
        scope: Mapping[str, Sequence[EpisodeId]] | None = None,
        participants_cpu: Callable[[], float | None] | None = None,
    ) -> None:
        self._coordinator = coordinator
        self._participants_cpu = participants_cpu
        # CPU seconds of the last round's snapshot (prepare to resume, not the begin or
        # the retention around it): the participants' (None unless known) and this
        # process's.
        self.last_cpu_s: tuple[float | None, float] = (None, 0.0)
        self._commit_in_prepare = commit_in_prepare
        self._scope = scope or {}
        self._layout = layout
        self._ids = ids
        self._anchor: AnchorRef | None = None
        self._fsyncs = fsyncs
        self.publish_fsyncs = 0
        self.other_fsyncs = 0
        self.rounds = 0

    def _publish(self, snapshot: Path, manifest: SnapshotManifest) -> None:
        before = self._count()
        self._layout.publish(snapshot, manifest)
        self.publish_fsyncs += self._count() - before

    def _count(self) -> int:
        return 0 if self._fsyncs is None else self._fsyncs.value

    def _begin(self, checkpoint_id: str) -> Path:
        snapshot = self._layout.begin(checkpoint_id)
        anchor_dir = self._layout.anchor_dir(checkpoint_id)
        anchor_dir.mkdir(parents=True, exist_ok=True)
        if self._anchor is None:
            self._anchor = AnchorRef(tree_digest(anchor_dir))
        return snapshot

    def _tidy(self) -> None:
        before = self._count()
        self._layout.retain(_KEEP_SNAPSHOTS)
        self._layout.clean_partial()
        self.other_fsyncs += self._count() - before

    async def round(self) -> dict[str, float]:
        checkpoint_id = next(self._ids)
        coordinator = self._coordinator
        snapshot = await asyncio.to_thread(self._begin, checkpoint_id)
        anchor = self._anchor
        assert anchor is not None
        participants_cpu = self._participants_cpu
        participants_before = (
            None if participants_cpu is None else await asyncio.to_thread(participants_cpu)
        )
        coordinator_before = time.process_time()
        laps = await timed_snapshot(
            coordinator,
            checkpoint_id,
            snapshot,
            anchor,
            self._publish,
            commit_in_prepare=self._commit_in_prepare,
            scope=self._scope,
        )
        coordinator_seconds = time.process_time() - coordinator_before
        participants_after = (
            None if participants_cpu is None else await asyncio.to_thread(participants_cpu)
        )
        self.last_cpu_s = (
            None
            if participants_before is None or participants_after is None
            else participants_after - participants_before,
            coordinator_seconds,
        )
        await asyncio.to_thread(self._tidy)
        self.rounds += 1
        return _laps(laps)


def _checkpoint_ids(layout: SnapshotLayout) -> Iterator[str]:
    # One sequence for the whole run, above anything a reused root holds: every
    # participant only ever sees newer ids.
    published = layout.list_published()
    first = checkpoint_sequence(published[0]) + 1 if published else 1
    return (make_checkpoint_id("bench", n) for n in itertools.count(first))


async def measure_size(
    fleet: Fleet,
    n: int,
    *,
    rounds: int,
    warmup: int,
    layout: SnapshotLayout,
    ids: Iterator[str],
    progress: Progress,
    settle_s: float = SETTLE_S,
) -> OverheadRow:
    """The medians for ``n`` participants (the first ``n`` servers of the fleet)."""
    coordinator = await _coordinator(fleet, n)
    bidi = BidiEchoFanout(fleet.echo[:n])
    http = HttpJsonFanout(fleet.http[:n])
    totals: dict[str, list[float]] = {"turnpoint": [], "commit": [], "bidi": [], "http": []}
    cpu: dict[str, list[float]] = {name: [] for name in totals}
    phases: dict[str, list[float]] = {phase: [] for phase in PHASES}
    try:
        async with asyncio.timeout(_ROUND_TIMEOUT_S):
            # Describe opens every ControlSession; the baselines open their connections.
            await coordinator.discover()
            await bidi.open()
            await http.open()
        hop_us = await thread_hop_us()
        snapshots = _SnapshotRounds(coordinator, layout, ids, participants_cpu=fleet.cpu_seconds)
        with_commit = _SnapshotRounds(
            coordinator,
            layout,
            ids,
            commit_in_prepare=False,
            participants_cpu=fleet.cpu_seconds,
        )
        snapshot_paths = {"turnpoint": snapshots, "commit": with_commit}
        # This process owns its collector: what the paths built to talk to the fleet is
        # frozen while they are timed, as a trainer would freeze its start-up heap.
        with frozen_heap():
            for index in range(warmup + rounds):
                round_id = f"n{n}-r{index}"
                paths: list[tuple[str, Callable[[], Awaitable[dict[str, float]]]]] = [
                    ("turnpoint", snapshots.round),
                    ("commit", with_commit.round),
                    ("bidi", functools.partial(_baseline_round, bidi, round_id)),
                    ("http", functools.partial(_baseline_round, http, round_id)),
                ]
                # Each path goes first in turn, so that none always follows the heaviest.
                shift = index % len(paths)
                for name, run in paths[shift:] + paths[:shift]:
                    async with asyncio.timeout(_ROUND_TIMEOUT_S):
                        laps, spent = await _with_cpu(run, fleet, snapshot_paths.get(name))
                    if index >= warmup:
                        totals[name].append(laps["total"])
                        if spent is not None:
                            cpu[name].append(spent)
                        if name == "turnpoint":
                            for phase in PHASES:
                                phases[phase].append(laps[phase])
                    # Background work a round leaves behind (stream teardown, deferred
                    # writes in the workers) must not be billed to the next path.
                    await asyncio.sleep(settle_s)
        progress(
            f"  N={n}: turnpoint {_ms(totals['turnpoint'])} ms "
            f"({_ms(totals['commit'])} ms with every Commit sent), bidi {_ms(totals['bidi'])} ms, "
            f"HTTP+JSON {_ms(totals['http'])} ms (median of {rounds})"
        )
    finally:
        await bidi.aclose()
        await http.aclose()
        await coordinator.close()
    return OverheadRow(
        participants=n,
        overhead_ms=statistics.median(totals["turnpoint"]) * 1000,
        lower_bound_ms=statistics.median(totals["bidi"]) * 1000,
        http_json_ms=statistics.median(totals["http"]) * 1000,
        rounds=rounds,
        phases_ms=MappingProxyType(
            {phase: statistics.median(values) * 1000 for phase, values in phases.items()}
        ),
        with_commit_ms=statistics.median(totals["commit"]) * 1000,
        cpu_ms=MappingProxyType(
            {name: statistics.median(values) * 1000 for name, values in cpu.items() if values}
        ),
        cores=len(os.sched_getaffinity(0)),
        thread_hop_us=hop_us,
    )


async def _with_cpu(
    run: Callable[[], Awaitable[dict[str, float]]],
    fleet: Fleet,
    snapshots: _SnapshotRounds | None,
) -> tuple[dict[str, float], float | None]:
    """``run()``'s laps and the CPU seconds it took, the coordinator's process and the
    workers'. A snapshot's are its rounds' own (prepare to resume, its retention left
    out); a baseline's are taken around it. None where Linux does not say."""
    if snapshots is not None:
        laps = await run()
        workers, coordinator = snapshots.last_cpu_s
        return laps, None if workers is None else workers + coordinator
    workers_before = await asyncio.to_thread(fleet.cpu_seconds)
    coordinator_before = time.process_time()
    laps = await run()
    coordinator_cpu = time.process_time() - coordinator_before
    workers_after = await asyncio.to_thread(fleet.cpu_seconds)
    if workers_before is None or workers_after is None:
        return laps, None
    return laps, coordinator_cpu + workers_after - workers_before


async def thread_hop_us(hops: int = 101) -> float:
    """Median microseconds of one ``asyncio.to_thread`` round trip of a call that does
    nothing: what moving blocking work off the loop costs here before any work (a
    publication makes one). Woken threads on an idle virtual CPU make it slow."""
    laps = []
    for _ in range(hops):
        start = time.perf_counter()
        await asyncio.to_thread(int)
        laps.append(time.perf_counter() - start)
    return statistics.median(laps) * 1e6


async def _coordinator(fleet: Fleet, n: int) -> Coordinator:
    identity = await asyncio.to_thread(bump_epoch, fleet.root, coordinator_id=_COORDINATOR_ID)
    config = CoordinatorConfig(snapshot_root=fleet.root, control_timeout_s=30.0)
    return Coordinator(
        fleet.endpoints(n),
        token=fleet.token,
        coordinator_id=identity.coordinator_id,
        epoch=identity.epoch,
        config=config,
    )


def _ms(values: Sequence[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f}"


async def measure_control_overhead(
    root: Path,
    sizes: Sequence[int],
    *,
    workers: int,
    rounds: Callable[[int], int],
    warmup: int,
    token: str,
    progress: Progress,
) -> list[OverheadRow]:
    """Start one fleet big enough for the largest size and measure every size on it."""
    fleet_root = root / "control"
    fleet_root.mkdir(parents=True, exist_ok=True)
    largest = max(sizes)
    progress(f"control overhead: starting {largest} servers of each kind in {workers} worker(s)")
    layout = SnapshotLayout(fleet_root)
    ids = await asyncio.to_thread(_checkpoint_ids, layout)
    rows = []
    async with Fleet(fleet_root, largest, workers, token) as fleet:
        for n in sizes:
            rows.append(
                await measure_size(
                    fleet,
                    n,
                    rounds=rounds(n),
                    warmup=warmup,
                    layout=layout,
                    ids=ids,
                    progress=progress,
                )
            )
    return rows


async def measure_durable_commit(
    root: Path,
    n: int,
    *,
    workers: int,
    rounds: int,
    warmup: int,
    token: str,
    progress: Progress,
    settle_s: float = SETTLE_S,
    parked: int = 0,
    state_bytes: int = 0,
    label: str = "durable",
    after_round: Callable[[Path, str], Awaitable[object]] | None = None,
    turns: bool = False,
) -> DurableCommit:
    """The turnpoint path alone for ``n`` participants on ``root`` (a disk), fsyncs
    counted. With ``parked``, every participant holds that many episodes parked with
    ``state_bytes`` of state each, and every snapshot exports them all; with ``turns``
    too, every episode takes a turn before each snapshot (untimed), so that no episode
    is as the last snapshot saw it. ``after_round``
    is awaited after each measured round, untimed, with the layout's root and the
    snapshot just published: a baseline measured there sees the disk as the round did."""
    fleet_root = root / label
    fleet_root.mkdir(parents=True, exist_ok=True)
    if not parked:
        progress(f"durable commit: {n} participants on {fleet_root}, fsyncs counted")
    layout = SnapshotLayout(fleet_root)
    ids = await asyncio.to_thread(_checkpoint_ids, layout)
    totals: list[float] = []
    phases: dict[str, list[float]] = {phase: [] for phase in PHASES}
    participants_cpu: list[float] = []
    coordinator_cpu: list[float] = []
    fleet = Fleet(
        fleet_root,
        n,
        workers,
        token,
        baselines=False,
        count_fsyncs=True,
        parked=parked,
        state_bytes=state_bytes,
    )
    with counting_fsyncs() as fsyncs:
        async with fleet:
            coordinator = await _coordinator(fleet, n)
            try:
                async with asyncio.timeout(_ROUND_TIMEOUT_S):
                    await coordinator.discover()
                scope = {name: parked_episodes(name, parked) for name in fleet.endpoints(n)}
                snapshots = _SnapshotRounds(
                    coordinator,
                    layout,
                    ids,
                    fsyncs,
                    scope=scope if parked else None,
                    participants_cpu=fleet.cpu_seconds,
                )
                for index in range(warmup + rounds):
                    if turns and parked:
                        turned = await fleet.take_turns()
                        if turned != n * parked:
                            raise RuntimeError(f"{turned} of {n * parked} episodes took a turn")
                    async with asyncio.timeout(_ROUND_TIMEOUT_S):
                        laps = await snapshots.round()
                    participants_seconds, coordinator_seconds = snapshots.last_cpu_s
                    coordinator_cpu.append(coordinator_seconds)
                    if participants_seconds is not None:
                        participants_cpu.append(participants_seconds)
                    if index >= warmup:
                        totals.append(laps["total"])
                        for phase in PHASES:
                            phases[phase].append(laps[phase])
                        if after_round is not None:
                            published = await asyncio.to_thread(layout.latest)
                            if published is not None:
                                await after_round(fleet_root, published)
                    await asyncio.sleep(settle_s)
            finally:
                await coordinator.close()
    done = max(snapshots.rounds, 1)
    latest = await asyncio.to_thread(layout.latest)
    tree = None if latest is None else await asyncio.to_thread(snapshot_tree, fleet_root, latest)
    result = DurableCommit(
        participants=n,
        rounds=rounds,
        total_ms=statistics.median(totals) * 1000,
        phases_ms=MappingProxyType(
            {phase: statistics.median(values) * 1000 for phase, values in phases.items()}
        ),
        participant_fsyncs=fleet.fsyncs / done,
        publish_fsyncs=snapshots.publish_fsyncs / done,
        other_coordinator_fsyncs=snapshots.other_fsyncs / done,
        root=str(fleet_root),
        parked=parked,
        state_bytes=state_bytes,
        tree=tree,
        cpu_s=None
        if len(participants_cpu) < warmup + rounds
        else MappingProxyType(
            {
                "participants": statistics.median(participants_cpu[warmup:]),
                "coordinator": statistics.median(coordinator_cpu[warmup:]),
            }
        ),
    )
    if parked:
        return result
    progress(
        f"  N={n} on disk: {_ms(totals)} ms (publish {result.phases_ms['publish']:.1f} ms); "
        f"fsyncs per snapshot: participants {result.participant_fsyncs:.1f}, coordinator "
        f"{result.publish_fsyncs:.1f} publishing + {result.other_coordinator_fsyncs:.1f} other"
    )
    return result


async def timed_snapshot(
    coordinator: Coordinator,
    checkpoint_id: str,
    snapshot: Path,
    anchor: AnchorRef,
    publish: Callable[[Path, SnapshotManifest], object],
    *,
    commit_in_prepare: bool = True,
    scope: Mapping[str, Sequence[EpisodeId]] | None = None,
) -> list[float]:
    """One snapshot's four phases through the real coordinator, timed: the
    ``perf_counter`` before prepare and after each of prepare, commit, publish
    (``publish`` runs in a thread) and resume. An abort still resumes: a fleet is never
    left closed for the next round. ``commit_in_prepare`` offers the snapshot in the
    prepare, as the trainer's driver does (docs/spec.md section 4.6 item 8); False
    sends every participant its Commit. ``scope``: the episodes each participant
    exports (none by default)."""
    laps = [time.perf_counter()]
    resumed = False
    try:
        await coordinator.prepare(
            checkpoint_id, snapshot=checkpoint_id if commit_in_prepare else None
        )
        laps.append(time.perf_counter())
        entries = await coordinator.commit(checkpoint_id, checkpoint_id, scope or {})
        laps.append(time.perf_counter())
        manifest = SnapshotManifest(
            checkpoint_id=checkpoint_id,
            step=0,
            created_at=time.time(),
            anchor=anchor,
            participants=tuple(entries.values()),
        )
        await asyncio.to_thread(publish, snapshot, manifest)
        laps.append(time.perf_counter())
        report = await coordinator.resume(checkpoint_id)
        resumed = True
        laps.append(time.perf_counter())
        report.raise_if_failed()
    finally:
        if not resumed:
            await coordinator.resume(checkpoint_id)
    return laps
