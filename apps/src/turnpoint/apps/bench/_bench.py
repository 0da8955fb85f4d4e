"""One run of ``turnpoint bench``: the run itself, its report and the targets it is held to.

The figures (docs: README "Benchmarks"):

- **control path**: one snapshot of N participants (prepare, commit, publish, resume)
  with every snapshot root on tmpfs, against the open-stream floor and the HTTP+JSON
  anchor, phases reported (:mod:`._control_overhead`);
- **durable commit**: the same snapshot on the disk root, with the fsyncs per snapshot
  of the participants and of the coordinator;
- **throughput**: rollouts per second with snapshots every 2 s vs none, in blocks of
  one latency-bound trainer run (off, on, on, off), the ratio of means with its
  bootstrap interval over pairs of neighbouring blocks and the median of the pairs'
  ratios with its spread, the share of the rollout-seconds that snapshots held dispatch
  closed (in ``--quick`` from the crashed run alone, with no block run),
  admission-closed seconds per snapshot (median, p99) (:mod:`._workload`);
- **real state**: snapshots whose participants hold parked episodes with state (64 x
  32 x 16 KB; 1,000 x 1 KB on one), on the disk root, against the same files written
  by a plain program with one fsync per file and directory, fsyncs counted
  (:mod:`._real_state`);
- **scale**: the trainer's books (tracemalloc) and manifest bytes per episode in flight
  at 1k, 10k and 100k, and the slope of its snapshot time (:mod:`._scale`);
- **bookkeeping**: the SDK's cost per episode, the median of repeats with their spread
  (:mod:`._participant_bench`);
- **restart**: a cold start after a crash to the first redispatched rollout;
- **status page**: the control path with the trainer's status API polled every 100 ms
  over the same path unpolled, a ratio (:mod:`._status_polling`);
- **sandbox snapshots**: a sandbox's snapshot of a tree unchanged since the last one
  over its first, in seconds and bytes written, per size, and the restore over the
  first snapshot (:mod:`._sandbox_snapshots`);
- **busy sandboxes**: admission closed per snapshot of 16 sandboxes each running a
  command (cut), over the same 16 idle (:mod:`._sandbox_admission`);
- **egress relay**: a chat call through the relay over the same call direct, a ratio,
  and the restore of an episode by replay against its live run, per length
  (:mod:`._egress_relay`).
"""

from __future__ import annotations

import asyncio
import os
import platform
import secrets
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from turnpoint.apps.bench._arithmetic import bookkeeping_by_cpu, spread
from turnpoint.apps.bench._control_overhead import (
    DurableCommit,
    OverheadRow,
    measure_control_overhead,
    measure_durable_commit,
)
from turnpoint.apps.bench._egress_relay import RelayFigures, measure_egress_relay
from turnpoint.apps.bench._options import BenchOptions, RealStateCase
from turnpoint.apps.bench._participant_bench import bookkeeping_cpus, bookkeeping_us, pinned
from turnpoint.apps.bench._real_state import RealStateRow, measure_real_state
from turnpoint.apps.bench._sandbox_admission import (
    BUSY_SANDBOXES,
    SandboxAdmission,
    measure_sandbox_admission,
)
from turnpoint.apps.bench._sandbox_snapshots import SandboxSnapshotRow, measure_sandbox_snapshots
from turnpoint.apps.bench._scale import ScaleFigures, measure_scale
from turnpoint.apps.bench._status_polling import StatusPolling, measure_status_polling
from turnpoint.apps.bench._workload import RestoreResult, ThroughputResult, run_workload

# The whole run, every part of which is bounded on its own as well.
_RUN_TIMEOUT_S: Final = 3600.0
# A figure fails ``--check`` only past its must-have by this factor: noise on a shared
# machine does not fail CI, a regression does.
REGRESSION_MARGIN: Final = 1.5
# Snapshots of the real-state cases when --rounds is not given (one takes up to a second).
_REAL_STATE_ROUNDS: Final = 5

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Target:
    """One figure against its must-have and its aim.

    ``gated`` figures fail ``--check`` when :attr:`regressed`: the ratios taken within
    one run (the machine's speed cancels out) and exact counts. Absolute times (ms, us,
    s) depend on the machine and its load; they are reported against their targets but
    never fail a check. ``exact``: a figure made of counts (fsyncs over files), which no
    noise moves, so any step past the must-have is a regression.
    """

    name: str
    value: float | None
    must: float
    aim: float | None = None
    higher_is_better: bool = False
    gated: bool = False
    exact: bool = False

    def _within(self, bound: float | None, factor: float = 1.0) -> bool | None:
        if self.value is None or bound is None:
            return None
        if self.higher_is_better:
            return self.value >= bound / factor
        return self.value <= bound * factor

    @property
    def regressed(self) -> bool:
        """Past the must-have by :data:`REGRESSION_MARGIN` (a count must stay exact)."""
        if self.must == 0 and not self.higher_is_better:
            return self.value is not None and self.value > 0
        return self._within(self.must, 1.0 if self.exact else REGRESSION_MARGIN) is False

    def to_json(self) -> dict[str, Any]:
        return {
            "value": None if self.value is None else round(self.value, 3),
            "must": self.must,
            "aim": self.aim,
            "higher_is_better": self.higher_is_better,
            "gated": self.gated,
            "met_must": self._within(self.must),
            "met_aim": self._within(self.aim),
            "regressed": self.regressed,
        }


# Issue 30 item 1: the control path within these ratios of the open-stream floor, per
# participant count (its must-haves; 1,024 participants only in the full run).
FLOOR_RATIO_MUSTS: Final = {1: 1.3, 8: 1.15, 64: 1.15, 256: 1.15, 1024: 1.2}
# Sizes whose ratio --check gates. At 1 and 8 participants the floor is 2 to 3 ms and a
# shared 2-core machine moves their ratio by a third (1.50 to 2.53 at N=1 within one
# session), past the 1.5x margin of the gate: reported against the must-have, not
# gated, lest the check fail on noise.
FLOOR_RATIO_GATED_FROM: Final = 64


def control_path_targets(rows: Sequence[OverheadRow]) -> list[Target]:
    """The control path's targets: against the floor at every size of
    :data:`FLOOR_RATIO_MUSTS`, and against HTTP+JSON at 64. Ratios within one run,
    gated from :data:`FLOOR_RATIO_GATED_FROM` participants up (a size not measured has
    no value and never fails a check)."""
    measured = {row.participants: row for row in rows}
    at_64 = measured.get(64)
    targets = [
        Target(
            f"control_path_{n}_vs_floor",
            None if n not in measured else measured[n].ratio,
            must,
            gated=n >= FLOOR_RATIO_GATED_FROM,
        )
        for n, must in FLOOR_RATIO_MUSTS.items()
    ]
    targets.append(
        Target(
            "control_path_64_vs_http_json",
            None if at_64 is None else at_64.ratio_vs_http_json,
            1.0,
            0.6,
            gated=True,
        )
    )
    return targets


def real_state_targets(rows: Sequence[RealStateRow]) -> list[Target]:
    """The real-state snapshots' targets (issue 30 item 2), of the default cases; a case
    not measured has no value and never fails a check."""
    measured = {row.case: row for row in rows}
    big = measured.get(RealStateCase(64, 32, 16384))
    many = measured.get(RealStateCase(1, 1000, 1024))
    return [
        # A snapshot exporting 32 MB (64 participants x 32 parked episodes x 16 KB) over
        # the same files written by a plain program with one fsync per file and
        # directory. A ratio, but of two disk timings on a disk other engineers share:
        # reported, not gated.
        Target("real_state_64x32x16KB_vs_floor", None if big is None else big.ratio, 1.5),
        Target(
            "real_state_1000_episodes_us_beyond_floor",
            None if many is None else many.beyond_floor_us_per_episode,
            20.0,
        ),
        # Counted, not timed: the fsyncs that make a snapshot durable (the participants'
        # and the publication's, docs/spec.md sections 8.4 and 8.9) over the files and
        # directories it makes durable. One each is the floor; counts carry no noise,
        # so one fsync too many fails the check.
        Target(
            "real_state_fsyncs_per_file_and_directory",
            None if big is None else big.fsyncs_per_durable_item,
            1.0,
            gated=True,
            exact=True,
        ),
    ]


@dataclass(frozen=True, slots=True)
class BenchReport:
    """The figures of one run (see :meth:`to_json` for the published shape)."""

    control_overhead: tuple[OverheadRow, ...]
    throughput: ThroughputResult
    restore: RestoreResult
    workers: int
    warmup: int
    snapshot_root: str
    machine: dict[str, Any] = field(default_factory=dict)
    control_root: str = ""
    control_on_tmpfs: bool = False
    durable: DurableCommit | None = None
    bookkeeping_us: float | None = None
    bookkeeping_repeats_us: tuple[float, ...] = ()
    # The CPU each repeat ran on, pinned (None: not pinned), in the repeats' order.
    bookkeeping_cpus: tuple[int | None, ...] = ()
    status_polling: StatusPolling | None = None
    sandbox_snapshots: tuple[SandboxSnapshotRow, ...] = ()
    sandbox_admission: SandboxAdmission | None = None
    egress_relay: RelayFigures | None = None
    real_state: tuple[RealStateRow, ...] = ()
    scale: ScaleFigures | None = None
    # The same crash's trainer restarted alone, into the participants that survived it
    # (docs/spec.md section 7.11 item 3), beside :attr:`restore`'s cold start.
    trainer_restart: RestoreResult | None = None

    @property
    def trainer_restart_vs_cold_start(self) -> float | None:
        """The trainer restart's seconds over the cold start's, both of the same crash."""
        warm = None if self.trainer_restart is None else self.trainer_restart.seconds
        cold = self.restore.seconds
        return None if warm is None or not cold else warm / cold

    @property
    def throughput_ratio_on_vs_off(self) -> float | None:
        return self.throughput.ratio

    @property
    def restore_seconds(self) -> float | None:
        return self.restore.seconds

    def targets(self) -> list[Target]:
        """Every figure that has a target, measured or not (value None)."""
        sandbox = self.sandbox_snapshots[0] if self.sandbox_snapshots else None
        relay = self.egress_relay
        longest = max(relay.replay, key=lambda row: row.turns) if relay and relay.replay else None
        durable = self.durable
        admission = self.throughput.admission_closed_s
        interval = self.throughput.interval
        largest = None if self.scale is None else self.scale.largest
        return [
            *control_path_targets(self.control_overhead),
            Target(
                "durable_participant_fsyncs_exporting_nothing",
                None if durable is None else durable.participant_fsyncs,
                0,
                gated=True,
            ),
            *real_state_targets(self.real_state),
            # Issue 30 item 5, in process at 1k, 10k and 100k episodes in flight: the
            # trainer's books per episode (tracemalloc, at the largest size: a count,
            # gated), the manifest's bytes per episode, and the snapshot's cost per
            # episode at the largest size over the smallest (1 is linear, 100 quadratic;
            # timed: reported).
            Target(
                "scale_coordinator_bytes_per_episode",
                None if largest is None else largest.books_bytes / largest.episodes,
                2048.0,
                1024.0,
                gated=True,
            ),
            Target(
                "scale_manifest_bytes_per_episode",
                None if largest is None else largest.manifest_bytes / largest.episodes,
                1024.0,
                512.0,
            ),
            Target(
                "scale_snapshot_per_episode_growth",
                None if self.scale is None else self.scale.per_episode_growth,
                2.0,
                1.2,
            ),
            Target(
                "durable_publish_ms_at_64",
                durable.phases_ms["publish"]
                if durable is not None and durable.participants == 64
                else None,
                10.0,
            ),
            Target(
                "throughput_on_vs_off",
                self.throughput.ratio,
                0.95,
                0.98,
                higher_is_better=True,
                gated=True,
            ),
            # Issue 30 item 3: the cost of snapshots where it arises, a ratio from the
            # runs with snapshots on alone (in --quick, the crashed run): the share of the
            # rollout-seconds that dispatch was closed. Its must mirrors the on/off
            # ratio's (0.95 of the throughput kept), and it gates --quick.
            Target(
                "dispatch_closed_fraction",
                self.throughput.closed_fraction,
                0.05,
                0.02,
                gated=True,
            ),
            # The on/off ratio of means with its bootstrap 95% interval (18 pairs of
            # neighbouring blocks in the full bench): its lower end should clear 0.98,
            # its width 2 points. Reported, not gated: how wide it is on a shared
            # machine is what the figure is for, not a regression signal.
            Target(
                "throughput_on_vs_off_interval_low",
                None if interval is None else interval.low,
                0.95,
                0.98,
                higher_is_better=True,
            ),
            Target(
                "throughput_on_vs_off_interval_width",
                None if interval is None else interval.width,
                0.02,
            ),
            Target(
                "admission_closed_median_s",
                statistics.median(admission) if admission else None,
                0.030,
            ),
            Target("bookkeeping_us_per_episode", self.bookkeeping_us, 60.0, 30.0),
            Target("restart_s", self.restore_seconds, 5.0, 2.0),
            # Issue 24: no participant process starts, so under a second.
            Target(
                "trainer_restart_s",
                None if self.trainer_restart is None else self.trainer_restart.seconds,
                1.0,
                0.5,
            ),
            Target(
                "status_page_polled_vs_quiet",
                None if self.status_polling is None else self.status_polling.ratio,
                1.10,
                1.02,
                # Reported, not gated: a few seconds of rounds on a shared machine swing
                # by more than the 1.5x margin with the load of other processes.
            ),
            # docs/spec.md section 5.7.3: an unchanged tree writes no chunk, only its
            # handle record. Bytes are counted, not timed: gated.
            Target(
                "sandbox_unchanged_vs_full_bytes",
                None if sandbox is None else sandbox.bytes_ratio,
                0.01,
                0.001,
                gated=True,
            ),
            # Still reads and hashes the whole tree: reported, not gated.
            Target(
                "sandbox_unchanged_vs_full_time",
                None if sandbox is None else sandbox.time_ratio,
                0.5,
                0.2,
            ),
            # A restore verifies and writes what the full snapshot read, hashed and
            # compressed: it should cost no more. Timed: reported, not gated.
            Target(
                "sandbox_restore_vs_full_snapshot",
                None if sandbox is None else sandbox.restore_ratio,
                1.0,
                0.5,
            ),
            # Section 5.7.5 item 5: cutting 16 running commands at admission close adds
            # little to the 16 snapshots. Timed: reported, not gated.
            Target(
                "sandbox_busy_vs_idle_admission_closed",
                None if self.sandbox_admission is None else self.sandbox_admission.ratio,
                1.5,
                1.1,
            ),
            # docs/spec.md section 12.8: the relay is one more local HTTP hop and a
            # record per call. Reported, not gated: a call is a few ms, and a loaded
            # machine swings the median by more than the margin.
            Target(
                "relay_relayed_vs_direct",
                None if relay is None else relay.overhead.ratio,
                1.5,
                1.15,
            ),
            # Section 12.7: a restore answers the cut from the record without the model.
            Target(
                "relay_replay_vs_live_longest",
                None if longest is None else longest.ratio,
                0.5,
                0.1,
            ),
        ]

    def regressions(self) -> list[str]:
        """The gated figures past their must-have by :data:`REGRESSION_MARGIN`."""
        return [target.name for target in self.targets() if target.gated and target.regressed]

    def to_json(self) -> dict[str, Any]:
        ratio = self.throughput_ratio_on_vs_off
        closed = self.throughput.closed_fraction
        seconds = self.restore_seconds
        return {
            "control_overhead": [row.to_json() for row in self.control_overhead],
            "durable_commit": None if self.durable is None else self.durable.to_json(),
            "throughput_ratio_on_vs_off": None if ratio is None else round(ratio, 3),
            "dispatch_closed_fraction": None if closed is None else round(closed, 5),
            "bookkeeping_us_per_episode": None
            if self.bookkeeping_us is None
            else round(self.bookkeeping_us, 2),
            "restore_seconds": None if seconds is None else round(seconds, 3),
            "status_page_polled_vs_quiet": None
            if self.status_polling is None
            else round(self.status_polling.ratio, 3),
            "sandbox_snapshots": [row.to_json() for row in self.sandbox_snapshots],
            "sandbox_admission": None
            if self.sandbox_admission is None
            else self.sandbox_admission.to_json(),
            "egress_relay": None if self.egress_relay is None else self.egress_relay.to_json(),
            "real_state": [row.to_json() for row in self.real_state],
            "scale": None if self.scale is None else self.scale.to_json(),
            "targets": {target.name: target.to_json() for target in self.targets()},
            "details": {
                **_control_details(
                    self.control_overhead,
                    self.workers,
                    self.warmup,
                    self.control_root,
                    self.control_on_tmpfs,
                ),
                "bookkeeping_us": None
                if not self.bookkeeping_repeats_us
                else _bookkeeping_json(self.bookkeeping_repeats_us, self.bookkeeping_cpus),
                "throughput": self.throughput.to_json(),
                "restore": self.restore.to_json(),
                "trainer_restart": None
                if self.trainer_restart is None
                else self.trainer_restart.to_json(),
                "trainer_restart_vs_cold_start": None
                if self.trainer_restart_vs_cold_start is None
                else round(self.trainer_restart_vs_cold_start, 3),
                "status_polling": None
                if self.status_polling is None
                else self.status_polling.to_json(),
                "snapshot_root": self.snapshot_root,
                "machine": self.machine,
            },
        }


def _spread_json(values: Sequence[float]) -> dict[str, Any] | None:
    shown = spread(values)
    return None if shown is None else shown.to_json() | {"values": [round(v, 2) for v in values]}


def _bookkeeping_json(values: Sequence[float], cpus: Sequence[int | None]) -> dict[str, Any] | None:
    """The repeats' spread, the CPU each ran on, and the median of each CPU's repeats."""
    shown = _spread_json(values)
    if shown is None or len(cpus) != len(values):
        return shown
    return shown | {
        "cpus": list(cpus),
        "median_by_cpu": {
            str(cpu): round(value, 2) for cpu, value in bookkeeping_by_cpu(values, cpus).items()
        },
    }


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_1m": None if load is None else round(load[0], 2),
    }


def _on_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs mount (Linux /proc/mounts; False elsewhere)."""
    try:
        mounts = Path("/proc/mounts").read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    resolved = path.resolve()
    best, kind = "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1]
        if (resolved == Path(point) or Path(point) in resolved.parents) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind == "tmpfs"


@contextmanager
def _control_root(options: BenchOptions, disk_root: Path) -> Iterator[Path]:
    """A fresh directory for the control path: under ``options.tmpfs`` when it exists,
    removed afterwards; else the disk root itself."""
    tmpfs = options.tmpfs
    if tmpfs is None or not tmpfs.is_dir() or not os.access(tmpfs, os.W_OK):
        yield disk_root
        return
    with tempfile.TemporaryDirectory(
        prefix="turnpoint-bench-control-", dir=tmpfs, ignore_cleanup_errors=True
    ) as scratch:
        yield Path(scratch)


def _sizes_left(sizes: Sequence[int]) -> str:
    return ",".join(map(str, sizes))


async def _control_rows(
    options: BenchOptions, control_root: Path, on_tmpfs: bool, token: str, progress: Progress
) -> list[OverheadRow]:
    progress(
        f"control path: N={_sizes_left(options.sizes)}, snapshot roots under {control_root} "
        f"({'tmpfs' if on_tmpfs else 'NOT tmpfs: the figure includes the disk'})"
    )
    return await measure_control_overhead(
        control_root,
        options.sizes,
        workers=options.workers,
        rounds=options.rounds_for,
        warmup=options.warmup,
        token=token,
        progress=progress,
    )


async def _real_state_rows(
    options: BenchOptions, root: Path, token: str, progress: Progress
) -> list[RealStateRow]:
    rows = []
    for case in options.real_state:
        # Each case twice: its episodes parked all along, then each a new turn before
        # every snapshot (the row's ``turned``).
        parked, turned = [
            await measure_real_state(
                root,
                case,
                workers=options.workers,
                rounds=options.rounds if options.rounds is not None else _REAL_STATE_ROUNDS,
                warmup=options.warmup,
                token=token,
                progress=progress,
                turns=turns,
            )
            for turns in (False, True)
        ]
        rows.append(replace(parked, turned=turned))
    return rows


async def _run(options: BenchOptions, root: Path, progress: Progress) -> BenchReport:
    token = secrets.token_hex(24)
    machine_before = _machine()
    with _control_root(options, root) as control_root:
        on_tmpfs = _on_tmpfs(control_root)
        rows = await _control_rows(options, control_root, on_tmpfs, token, progress)
        status_n = options.durable_size
        status_polling = await measure_status_polling(
            control_root,
            status_n,
            workers=options.workers,
            rounds=options.rounds_for(status_n),
            warmup=options.warmup,
            token=token,
            progress=progress,
        )
    durable_n = options.durable_size
    durable = await measure_durable_commit(
        root,
        durable_n,
        workers=options.workers,
        rounds=options.rounds_for(durable_n),
        warmup=options.warmup,
        token=token,
        progress=progress,
    )
    real_state = await _real_state_rows(options, root, token, progress)
    scale = None
    if options.scale_episodes:
        progress(
            f"scale: the trainer's books, manifest and snapshot with "
            f"{_sizes_left(options.scale_episodes)} episodes in flight"
        )
        scale = await asyncio.to_thread(
            measure_scale, root / "scale", options.scale_episodes, progress
        )
    throughput, restore, trainer_restart = await run_workload(
        root, options.workload, token=token, progress=progress
    )
    progress(
        f"bookkeeping: {options.bookkeeping_repeats} repeat(s) of "
        f"{options.bookkeeping_episodes} episodes in process"
    )
    # The repeats take turns on the CPUs, each pinned: which core a process lands on
    # moved this figure by half on the 2-core machine (bookkeeping_cpus says why).
    cpus = bookkeeping_cpus()
    bookkeeping_repeats: list[float] = []
    bookkeeping_on: list[int | None] = []
    for repeat in range(options.bookkeeping_repeats):
        cpu = cpus[repeat % len(cpus)]
        with pinned(cpu):
            bookkeeping_repeats.append(
                await bookkeeping_us(options.bookkeeping_episodes, root / f"bookkeeping-{repeat}")
            )
        bookkeeping_on.append(cpu)
    progress(f"sandbox snapshots: {_sizes_left(options.sandbox_mb)} MB, full then unchanged")
    sandbox_snapshots = await measure_sandbox_snapshots(root / "sandboxes", options.sandbox_mb)
    progress(
        f"busy sandboxes: {options.sandbox_rounds} snapshot(s) of {BUSY_SANDBOXES} sandboxes "
        "each running a command, and as many idle"
    )
    sandbox_admission = await measure_sandbox_admission(
        root / "busy-sandboxes", options.sandbox_rounds
    )
    progress(
        f"egress relay: {options.relay_calls} calls each way, replays of "
        f"{_sizes_left(options.replay_turns)} turns"
    )
    egress_relay = await measure_egress_relay(
        root / "relay", options.relay_calls, options.replay_turns
    )
    machine = _machine()
    machine["load_average_1m_at_start"] = machine_before["load_average_1m"]
    return BenchReport(
        control_overhead=tuple(rows),
        throughput=throughput,
        restore=restore,
        trainer_restart=trainer_restart,
        workers=options.workers,
        warmup=options.warmup,
        snapshot_root=str(root),
        machine=machine,
        control_root=str(control_root),
        control_on_tmpfs=on_tmpfs,
        durable=durable,
        bookkeeping_us=statistics.median(bookkeeping_repeats),
        bookkeeping_repeats_us=tuple(bookkeeping_repeats),
        bookkeeping_cpus=tuple(bookkeeping_on),
        status_polling=status_polling,
        sandbox_snapshots=sandbox_snapshots,
        sandbox_admission=sandbox_admission,
        egress_relay=egress_relay,
        real_state=tuple(real_state),
        scale=scale,
    )


@dataclass(frozen=True, slots=True)
class ControlPathReport:
    """The control-path figure alone (``turnpoint bench --control-path-only``): its rows
    and targets in the shape the full report gives them."""

    rows: tuple[OverheadRow, ...]
    workers: int
    warmup: int
    control_root: str
    control_on_tmpfs: bool
    machine: dict[str, Any] = field(default_factory=dict)

    def targets(self) -> list[Target]:
        return control_path_targets(self.rows)

    def regressions(self) -> list[str]:
        return [target.name for target in self.targets() if target.gated and target.regressed]

    def to_json(self) -> dict[str, Any]:
        return {
            "control_overhead": [row.to_json() for row in self.rows],
            "targets": {target.name: target.to_json() for target in self.targets()},
            "details": {
                **_control_details(
                    self.rows, self.workers, self.warmup, self.control_root, self.control_on_tmpfs
                ),
                "machine": self.machine,
            },
        }


def _control_details(
    rows: Sequence[OverheadRow], workers: int, warmup: int, root: str, on_tmpfs: bool
) -> dict[str, Any]:
    """The control-path figure's details, in the full report and in its own."""
    return {
        "workers": workers,
        "warmup_rounds": warmup,
        "control_root": root,
        "control_root_on_tmpfs": on_tmpfs,
        "rounds": {str(row.participants): row.rounds for row in rows},
        "phases_ms": {
            str(row.participants): {k: round(v, 3) for k, v in row.phases_ms.items()}
            for row in rows
        },
    }


async def run_control_path(options: BenchOptions, progress: Progress) -> ControlPathReport:
    """The control-path figure alone, every worker process stopped on return."""
    async with asyncio.timeout(_RUN_TIMEOUT_S):
        machine_before = _machine()
        with tempfile.TemporaryDirectory(
            prefix="turnpoint-system-bench-", ignore_cleanup_errors=True
        ) as scratch:
            disk_root = options.root or Path(scratch)
            disk_root.mkdir(parents=True, exist_ok=True)
            with _control_root(options, disk_root) as control_root:
                on_tmpfs = _on_tmpfs(control_root)
                rows = await _control_rows(
                    options, control_root, on_tmpfs, secrets.token_hex(24), progress
                )
    machine = _machine()
    machine["load_average_1m_at_start"] = machine_before["load_average_1m"]
    return ControlPathReport(
        rows=tuple(rows),
        workers=options.workers,
        warmup=options.warmup,
        control_root=str(control_root),
        control_on_tmpfs=on_tmpfs,
        machine=machine,
    )


@dataclass(frozen=True, slots=True)
class RealStateReport:
    """The real-state figure alone (``turnpoint bench --real-state-only``): its rows and
    targets in the shape the full report gives them."""

    rows: tuple[RealStateRow, ...]
    workers: int
    warmup: int
    snapshot_root: str
    machine: dict[str, Any] = field(default_factory=dict)

    def targets(self) -> list[Target]:
        return real_state_targets(self.rows)

    def regressions(self) -> list[str]:
        return [target.name for target in self.targets() if target.gated and target.regressed]

    def to_json(self) -> dict[str, Any]:
        return {
            "real_state": [row.to_json() for row in self.rows],
            "targets": {target.name: target.to_json() for target in self.targets()},
            "details": {
                "workers": self.workers,
                "warmup_rounds": self.warmup,
                "snapshot_root": self.snapshot_root,
                "machine": self.machine,
            },
        }


async def run_real_state(options: BenchOptions, progress: Progress) -> RealStateReport:
    """The real-state figure alone, on ``options.root`` (else a temporary directory on
    disk), every worker process stopped on return."""
    async with asyncio.timeout(_RUN_TIMEOUT_S):
        machine_before = _machine()
        with tempfile.TemporaryDirectory(
            prefix="turnpoint-system-bench-", ignore_cleanup_errors=True
        ) as scratch:
            root = options.root or Path(scratch)
            root.mkdir(parents=True, exist_ok=True)
            rows = await _real_state_rows(options, root, secrets.token_hex(24), progress)
    machine = _machine()
    machine["load_average_1m_at_start"] = machine_before["load_average_1m"]
    return RealStateReport(
        rows=tuple(rows),
        workers=options.workers,
        warmup=options.warmup,
        snapshot_root=str(root),
        machine=machine,
    )


async def run_bench(options: BenchOptions, progress: Progress) -> BenchReport:
    """Run every measurement; worker processes never outlive the call."""
    async with asyncio.timeout(_RUN_TIMEOUT_S):
        if options.root is not None:
            options.root.mkdir(parents=True, exist_ok=True)
            return await _run(options, options.root, progress)
        with tempfile.TemporaryDirectory(
            prefix="turnpoint-system-bench-", ignore_cleanup_errors=True
        ) as scratch:
            return await _run(options, Path(scratch), progress)
