"""Snapshots that carry real state, against the disk's own floor (issue 30 item 2).

A fleet of participants each holding parked episodes with incompressible state
(:class:`~turnpoint.apps.bench._workers.ParkedStateAgent`) is snapshotted through the
real coordinator on the disk root, every episode exported, fsyncs counted
(:func:`~turnpoint.apps.bench._control_overhead.measure_durable_commit`). The floor is
measured by a plain program right after each measured snapshot, so that both see the
same disk (a shared disk's fsyncs slow down and speed up by several times within a
minute): the snapshot's files, the same sizes, written afresh with one fsync per file
and one per directory (and the two the publication adds: a pointer file and the root),
one writer thread per directory as the participants write in parallel. The figures: the whole snapshot
(prepare to resume) over the floor, the microseconds per episode beyond it, and the
fsyncs that make the snapshot durable (the participants' and the publication's) over
the files and directories it makes durable; retention's, which delete an older
snapshot, are reported beside them and not counted.

Both sides' CPU is measured too (the floor's from this process's own usage, user and
system, while nothing else runs in it), which says why a ratio is what it is: on a
machine of ``cores`` cores, a snapshot that needs ``C`` CPU-seconds cannot take less than
``C / cores`` seconds, so ``C / cores`` over the floor's time is the least ratio its CPU
allows, however well its work overlaps the disk's waits.
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from turnpoint.apps.bench._arithmetic import beyond_floor_us
from turnpoint.apps.bench._control_overhead import (
    DurableCommit,
    SnapshotTree,
    measure_durable_commit,
    snapshot_tree,
)
from turnpoint.apps.bench._options import RealStateCase

Progress = Callable[[str], None]
_MAX_WRITERS: Final = 64
_FILE_MODE: Final = 0o644


@dataclass(frozen=True, slots=True)
class RealStateRow:
    """One case: the snapshot (median seconds, fsyncs) and the floor's seconds."""

    case: RealStateCase
    commit: DurableCommit
    floor_s: tuple[float, ...]
    # The floor's CPU-seconds (user and system) per run, and the cores the processes
    # could run on.
    floor_cpu_s: tuple[float, ...] = ()
    cores: int = 1
    # The same case with every episode taking a turn before each snapshot: no record is
    # as the last snapshot wrote it (the row above: episodes parked all along). None
    # when not measured.
    turned: RealStateRow | None = None

    @property
    def snapshot_s(self) -> float:
        return self.commit.total_ms / 1000

    @property
    def floor_median_s(self) -> float:
        return statistics.median(self.floor_s)

    @property
    def ratio(self) -> float:
        return self.snapshot_s / self.floor_median_s

    @property
    def episodes(self) -> int:
        return self.case.participants * self.case.parked

    @property
    def beyond_floor_us_per_episode(self) -> float:
        return beyond_floor_us(self.snapshot_s, self.floor_median_s, self.episodes)

    @property
    def cpu_us_per_episode(self) -> dict[str, float] | None:
        """CPU microseconds per exported episode of one snapshot (median round), the
        participants' and the coordinator's: what the wall-clock figures cost in CPU,
        which other work on a shared machine barely moves."""
        cpu = self.commit.cpu_s
        if cpu is None:
            return None
        return {side: seconds / self.episodes * 1e6 for side, seconds in cpu.items()}

    @property
    def snapshot_cpu_s(self) -> float | None:
        """CPU-seconds of one snapshot (median round), participants and coordinator."""
        cpu = self.commit.cpu_s
        return None if cpu is None else sum(cpu.values())

    @property
    def floor_cpu_median_s(self) -> float | None:
        return statistics.median(self.floor_cpu_s) if self.floor_cpu_s else None

    @property
    def cpu_vs_floor_cpu(self) -> float | None:
        """The snapshot's CPU over the floor's: what it burns to write the same bytes."""
        cpu, floor = self.snapshot_cpu_s, self.floor_cpu_median_s
        return None if cpu is None or not floor else cpu / floor

    @property
    def least_ratio_cpu_allows(self) -> float | None:
        """The snapshot's CPU spread over every core, over the floor's time: no snapshot
        that needs this CPU can come closer to the floor on this machine."""
        cpu = self.snapshot_cpu_s
        return None if cpu is None else cpu / self.cores / self.floor_median_s

    @property
    def fsyncs_per_durable_item(self) -> float | None:
        tree = self.commit.tree
        return None if tree is None else self.commit.durable_fsyncs / tree.durable_items

    def to_json(self) -> dict[str, Any]:
        per_item = self.fsyncs_per_durable_item
        return {
            "participants": self.case.participants,
            "episodes_per_participant": self.case.parked,
            "state_bytes_per_episode": self.case.state_bytes,
            "snapshot_s": round(self.snapshot_s, 4),
            "floor_s": round(self.floor_median_s, 4),
            "floor_runs_s": [round(s, 4) for s in self.floor_s],
            "snapshot_vs_floor": round(self.ratio, 3),
            "beyond_floor_us_per_episode": round(self.beyond_floor_us_per_episode, 2),
            "cpu_us_per_episode": None
            if (cpu := self.cpu_us_per_episode) is None
            else {side: round(us, 2) for side, us in cpu.items()},
            "snapshot_cpu_ms": _ms(self.snapshot_cpu_s),
            "floor_cpu_ms": _ms(self.floor_cpu_median_s),
            "cpu_vs_floor_cpu": _rounded(self.cpu_vs_floor_cpu),
            "cores": self.cores,
            "least_ratio_cpu_allows": _rounded(self.least_ratio_cpu_allows),
            "fsyncs_per_snapshot": round(self.commit.durable_fsyncs, 2),
            "retention_fsyncs_per_snapshot": round(self.commit.other_coordinator_fsyncs, 2),
            "fsyncs_per_file_and_directory": None if per_item is None else round(per_item, 3),
            "commit": self.commit.to_json(),
            "every_episode_a_new_turn": None if self.turned is None else self.turned.to_json(),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass(frozen=True, slots=True)
class FloorRun:
    """One run of the physical floor: its seconds and its CPU-seconds (user and system)."""

    seconds: float
    cpu_s: float


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _write_file(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    try:
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def physical_floor(tree: SnapshotTree, scratch: Path) -> FloorRun:
    """Seconds to write ``tree`` under ``scratch`` (a fresh directory) with one fsync per
    file and per directory, plus a pointer file and the fsync of ``scratch`` itself, and
    the CPU this process spent meanwhile (all of it the floor's when nothing else runs
    in the process). Blocking; the bytes are drawn before the clock starts."""
    largest = max((size for _, size in tree.files), default=0)
    data = memoryview(os.urandom(max(largest, 1)))
    by_directory: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, size in tree.files:
        by_directory[str(Path(name).parent)].append((name, size))
    parents = {str(Path(d).parent) for d in tree.directories}
    # The participants' directories are written in parallel, each by its own writer;
    # a directory holding others is done after them, deepest first, as the publication
    # does the snapshot's own directory last.
    leaves = [d for d in tree.directories if d not in parents]
    inner = sorted((d for d in tree.directories if d in parents), key=lambda d: -d.count("/"))

    def write_directory(directory: str) -> None:
        for name, size in by_directory.get(directory, ()):
            _write_file(scratch / name, data[:size])
        _fsync_dir(scratch / directory)

    cpu = _cpu_s()
    start = time.perf_counter()
    for directory in tree.directories:
        (scratch / directory).mkdir()
    with ThreadPoolExecutor(
        min(max(len(leaves), 1), _MAX_WRITERS), thread_name_prefix="bench-floor"
    ) as pool:
        list(pool.map(write_directory, leaves))
    for directory in inner:
        write_directory(directory)
    _write_file(scratch / "LATEST", memoryview(b"pointer\n"))
    _fsync_dir(scratch)
    return FloorRun(time.perf_counter() - start, _cpu_s() - cpu)


async def measure_real_state(
    root: Path,
    case: RealStateCase,
    *,
    workers: int,
    rounds: int,
    warmup: int,
    token: str,
    progress: Progress,
    turns: bool = False,
) -> RealStateRow:
    """One case's snapshots on ``root`` in a fleet of its own, each followed by its
    physical floor: with the episodes parked all along, or (``turns``) with each taking
    a turn before every snapshot."""
    how = ", every episode a new turn before each snapshot" if turns else ""
    progress(
        f"real state: {case.participants} participant(s) x {case.parked} parked episodes x "
        f"{case.state_bytes} B on {root}{how}, fsyncs counted, each snapshot then its "
        "physical floor"
    )
    floors: list[FloorRun] = []

    async def floor_after(fleet_root: Path, checkpoint_id: str) -> None:
        tree = await asyncio.to_thread(snapshot_tree, fleet_root, checkpoint_id)
        with tempfile.TemporaryDirectory(
            prefix="floor-", dir=root, ignore_cleanup_errors=True
        ) as scratch:
            floors.append(await asyncio.to_thread(physical_floor, tree, Path(scratch)))

    commit = await measure_durable_commit(
        root,
        case.participants,
        workers=min(workers, case.participants),
        rounds=rounds,
        warmup=warmup,
        token=token,
        progress=progress,
        parked=case.parked,
        state_bytes=case.state_bytes,
        label=f"real-state-{case.label}" + ("-turned" if turns else ""),
        after_round=floor_after,
        turns=turns,
    )
    tree = commit.tree
    if tree is None or not floors:
        raise RuntimeError(f"real state {case.label}: no snapshot was published")
    row = RealStateRow(
        case,
        commit,
        tuple(run.seconds for run in floors),
        tuple(run.cpu_s for run in floors),
        len(os.sched_getaffinity(0)),
    )
    progress(
        f"  {case.label}{' turned' if turns else ''}: snapshot {row.snapshot_s * 1000:.1f} ms, floor "
        f"{row.floor_median_s * 1000:.1f} ms ({tree.bytes / (1 << 20):.1f} MB in "
        f"{len(tree.files)} files, {len(tree.directories)} directories): "
        f"{row.ratio:.2f}x, {row.beyond_floor_us_per_episode:.1f} us per episode beyond it"
        + (
            ""
            if (cpu := row.cpu_us_per_episode) is None
            else f" (CPU per episode: participants {cpu['participants']:.1f} us, "
            f"coordinator {cpu['coordinator']:.1f} us)"
        )
        + (
            ""
            if (least := row.least_ratio_cpu_allows) is None
            or (per_floor := row.cpu_vs_floor_cpu) is None
            else f"; {per_floor:.1f}x the floor's CPU, so at least {least:.2f}x on "
            f"{row.cores} cores"
        )
        + "; "
        f"{commit.durable_fsyncs:.1f} fsyncs for {tree.durable_items} files and directories "
        f"(and {commit.other_coordinator_fsyncs:.1f} of retention)"
    )
    return row
