"""The demo workload: rollout throughput with and without snapshots, and a cold restore.

The workload is the demo's own trainer process (``python -m
turnpoint.apps.demo._trainer``: policy-gradient training, a weight sync after every
step, a window of prompt groups in flight across the agents, the snapshot pump beside
the training loop) against the example Gym servers, which a topology worker hosts in one
process (as ``turnpoint serve`` would host each). The bench writes the
``topology.json`` the trainer reads and reads back the ``events.jsonl`` it writes.

- **Throughput**: one run of the trainer on one set of participants whose agent turns
  wait ``turn_delay_s`` in their model call (a real model's latency: the rate is then
  set by timers and dispatch, not by CPU the machine shares with other work), its
  training steps in blocks of ``block_steps`` (the trainer's ``--snapshot-blocks``),
  alternately without snapshots and with one every ``snapshot_interval_s`` (off, on,
  on, off: ABBA, so that a machine that speeds up or slows down favours neither side).
  Each block's rate is the rollouts of its steps over the seconds from the end of the
  block before it to the end of its last step: whole steps, so no part of a rollout is
  counted, and the trainer's pipeline is in the same phase at both ends. The trainer's
  pipeline holds two steps in flight (:data:`PIPELINE_STEPS`), so its steps form two
  interleaved chains that drift apart and back during a run; each boundary is the mean
  end of the last two steps, so that both chains are measured over whole periods of
  their own (with one step's end as the boundary, one chain's share of a block read
  up to half a period long or short). Blocks 0 and 1
  hold the start-up and the last :data:`DRAIN_STEPS` steps the drain; the other blocks
  pair up with their neighbour (2 and 3, 4 and 5, ...), seconds apart in the same
  processes. The figure is the ratio of the sides' mean rates with its bootstrap 95%
  interval, whole pairs resampled (what the machine did to both blocks of a pair
  cancels), beside the median of the pairs' ratios and their spread. Beside it, the
  cost of snapshots where it arises: the rollout-seconds that dispatch was closed
  (each snapshot's admission-closed seconds times the episodes it held) over the
  rollout-seconds of the on blocks. Admission-closed seconds per published snapshot
  are reported as a median and a 99th percentile. Why blocks of one run rather than
  whole runs: runs a minute apart on a shared 2-core machine differed by up to 70%
  (25 and 42 rollouts/s back to back), while the effect is about 1%.
- **Restore**: a third run's trainer is crashed (SIGKILL) as soon as a published
  snapshot holds episodes in flight and the restore planner accepts it (a snapshot it
  would refuse is reported, with the planner's reason, and the run goes on to the next
  one). Two restores of that snapshot follow, each timed to the first sign of life of a
  redispatched rollout (a new boundary, or its result), through a new coordinator (the
  next epoch), the :class:`~turnpoint.trainer.restore.restorer.Restorer` (discover,
  verify every digest, load the anchor, restore and resume every participant) and a
  fresh rollout client:

  - *trainer restart* (docs/spec.md sections 4.16, 7.11 item 3): the participants
    survived the trainer; the new trainer restores into them where they run
    (RestoreRunning). The clock starts with the new trainer (its process imports
    aside: the bench's own process has them).
  - *cold start*: then every participant is SIGKILLed too, and the clock starts when new
    participant processes are started on the same snapshot root.

  Both come from the same crash and the same snapshot, so their ratio is the
  participants' start-up and fresh restore against none.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from turnpoint._files import create_file, replace_file
from turnpoint.apps.bench._arithmetic import (
    Interval,
    Window,
    block_windows,
    integrate,
    integrate_between,
    ratio_interval,
    steady_window,
)
from turnpoint.apps.bench._options import WorkloadOptions
from turnpoint.apps.bench._workers import WorkerProcess, topology_job
from turnpoint.ids import EpisodeId
from turnpoint.protocol import RecoveryLevel
from turnpoint.trainer import CoordinatorConfig, RolloutClientSettings, torch_anchor_loader
from turnpoint.trainer.advanced import (
    COORDINATOR_FILE,
    AgentEndpoint,
    Coordinator,
    CoordinatorIdentity,
    ManifestError,
    Restorer,
    RolloutClient,
    SnapshotLayout,
    Topology,
    apply_plan,
    bump_epoch,
    plan_restore,
)

_TRAINER_MODULE: Final = "turnpoint.apps.demo._trainer"
_WORKER_START_TIMEOUT_S: Final = 120.0
_RESTORE_TIMEOUT_S: Final = 120.0
_FIRST_PROGRESS_TIMEOUT_S: Final = 120.0
_CLOSE_TIMEOUT_S: Final = 30.0
# How often the crash run looks for a snapshot with episodes in flight.
_WATCH_PERIOD_S: Final = 0.05
_STDERR_TAIL_CHARS: Final = 2000
# The demo trainer's default, and the coordinator's.
_TARGET_LEVEL: Final = "turn"
MIN_SNAPSHOTS: Final = 10
"""Snapshots a run with snapshots on should publish for its figure to mean something."""
START_UP_STEPS: Final = 2
"""Training steps a run's rate leaves out at its start: the trainer dispatches two steps'
worth of prompt groups at once (its pipeline's depth), so the first two steps end in a
burst after the connections and the first weight push, not at the steady rate."""
DRAIN_STEPS: Final = 2
"""Training steps a run's rate leaves out at its end: the last two steps train on what
the pipeline already held, nothing new is dispatched, and it empties."""
PIPELINE_STEPS: Final = 2
"""The demo trainer's pipeline depth in steps (two steps' worth of prompt groups in
flight, each step's groups dispatched when the step two before it ended): a block's rate
is measured between boundaries that are the mean end of this many steps
(:func:`~turnpoint.apps.bench._arithmetic.block_windows`)."""

Progress = Callable[[str], None]


class WorkloadError(RuntimeError):
    """The demo workload could not be run (a trainer failed, a run timed out)."""


@dataclass(frozen=True, slots=True)
class RunFigures:
    """What one trainer run's event log says."""

    rollouts: int
    seconds: float
    snapshots_published: int = 0
    snapshots_failed: int = 0
    snapshot_seconds: tuple[float, ...] = ()
    admission_closed_seconds: tuple[float, ...] = ()
    # Rollout-seconds stalled by snapshots (dispatch closed x episodes held in flight)
    # and the run's rollout-seconds (the integral of rollouts in flight).
    closed_rollout_seconds: float = 0.0
    rollout_seconds: float = 0.0
    crashed: bool = False
    # The steady state: the steps between the start-up and the drain (None: too few).
    steady: Window | None = None

    @property
    def counted(self) -> Window:
        """What the run's rate counts: its steady state, else the whole run."""
        return self.steady if self.steady is not None else Window(self.rollouts, self.seconds)

    @property
    def per_second(self) -> float:
        """Rollouts per second in the run's steady state (whole run if it has none)."""
        return self.counted.per_second

    @property
    def whole_per_second(self) -> float:
        return self.rollouts / self.seconds if self.seconds > 0 else 0.0

    @property
    def closed_fraction(self) -> float | None:
        if self.rollout_seconds <= 0:
            return None
        return self.closed_rollout_seconds / self.rollout_seconds


def _pooled_rate(runs: Sequence[RunFigures]) -> float:
    seconds = sum(run.counted.seconds for run in runs)
    return sum(run.counted.rollouts for run in runs) / seconds if seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ThroughputResult:
    """Runs of ``steps`` training steps each, snapshots off and on, in equal numbers,
    ``off[i]`` and ``on[i]`` side by side (a pair).

    A run's rate is that of its steady state (:attr:`RunFigures.per_second`); a side's
    pools its runs: all their counted rollouts over all their counted seconds.
    """

    steps: int
    snapshot_interval_s: float
    off: tuple[RunFigures, ...]
    on: tuple[RunFigures, ...]
    # The full bench's sides are blocks of this many steps of one run (``off[i]`` and
    # ``on[i]`` neighbours); None: whole runs (the quick bench's crashed run).
    block_steps: int | None = None

    @property
    def per_second_off(self) -> float:
        return _pooled_rate(self.off)

    @property
    def per_second_on(self) -> float:
        return _pooled_rate(self.on)

    @property
    def pooled_ratio(self) -> float | None:
        off = self.per_second_off
        return self.per_second_on / off if off > 0 else None

    @property
    def ratios(self) -> tuple[float, ...]:
        """Each repeat's on / off (runs paired in the order they were made)."""
        return tuple(
            on.per_second / off.per_second
            for off, on in zip(self.off, self.on, strict=False)
            if off.per_second > 0
        )

    @property
    def ratio(self) -> float | None:
        """The median of the repeats' on / off ratios."""
        ratios = self.ratios
        return statistics.median(ratios) if ratios else None

    @property
    def interval(self) -> Interval | None:
        """Mean rate on over mean rate off with its bootstrap 95% interval, the pairs of
        runs made side by side resampled whole."""
        return ratio_interval(
            [(on.per_second, off.per_second) for off, on in zip(self.off, self.on, strict=False)]
        )

    @property
    def closed_fraction(self) -> float | None:
        """Rollout-seconds that snapshots held closed over the rollout-seconds of the
        runs with snapshots on (pooled): the cost of snapshots where it arises."""
        run = sum(run.rollout_seconds for run in self.on)
        if run <= 0:
            return None
        return sum(run.closed_rollout_seconds for run in self.on) / run

    @property
    def admission_closed_s(self) -> tuple[float, ...]:
        return tuple(seconds for run in self.on for seconds in run.admission_closed_seconds)

    @property
    def min_snapshots_per_run(self) -> int:
        return min((run.snapshots_published for run in self.on), default=0)

    @property
    def snapshots_published(self) -> int:
        return sum(run.snapshots_published for run in self.on)

    @property
    def snapshots_failed(self) -> int:
        return sum(run.snapshots_failed for run in self.on)

    def to_json(self) -> dict[str, Any]:
        ratios = self.ratios
        admission = self.admission_closed_s
        interval = self.interval
        closed = self.closed_fraction
        return {
            "steps": self.steps,
            "dispatch_closed_fraction": None if closed is None else round(closed, 5),
            "dispatch_closed_fraction_runs": [
                None if run.closed_fraction is None else round(run.closed_fraction, 5)
                for run in self.on
            ],
            "closed_rollout_seconds": round(sum(r.closed_rollout_seconds for r in self.on), 3),
            "rollout_seconds": round(sum(r.rollout_seconds for r in self.on), 3),
            "closed_measured_on_crash_run": any(run.crashed for run in self.on),
            "ratio_on_vs_off_interval": None if interval is None else interval.to_json(),
            "ratio_on_vs_off_median": _round(self.ratio),
            "ratio_on_vs_off_runs": [round(r, 3) for r in ratios],
            "ratio_on_vs_off_spread": [round(min(ratios), 3), round(max(ratios), 3)]
            if ratios
            else None,
            "ratio_on_vs_off_pooled": _round(self.pooled_ratio),
            "admission_closed_median_s": _median(list(admission)),
            "admission_closed_p99_s": _percentile(admission, 0.99),
            "snapshots_per_run": [run.snapshots_published for run in self.on],
            "min_snapshots_per_run": self.min_snapshots_per_run,
            "enough_snapshots": self.snapshots_published >= MIN_SNAPSHOTS,
            "block_steps": self.block_steps,
            # A block's boundary is the mean end of this many steps (the pipeline's depth).
            "block_boundary_steps": None if self.block_steps is None else PIPELINE_STEPS,
            "runs_off": len(self.off),
            "runs_on": len(self.on),
            "rollouts_per_run": [run.rollouts for run in self.on],
            "rollouts_per_s_off": round(self.per_second_off, 3),
            "rollouts_per_s_on": round(self.per_second_on, 3),
            # Each run's steady state (the rates the ratios are of), and the whole run's.
            "steady_window": {"start_up_steps": START_UP_STEPS, "drain_steps": DRAIN_STEPS},
            "rates_off": [round(run.per_second, 3) for run in self.off],
            "rates_on": [round(run.per_second, 3) for run in self.on],
            "whole_run_rates_off": [round(run.whole_per_second, 3) for run in self.off],
            "whole_run_rates_on": [round(run.whole_per_second, 3) for run in self.on],
            "seconds_off": [round(run.seconds, 3) for run in self.off],
            "seconds_on": [round(run.seconds, 3) for run in self.on],
            "snapshot_interval_s": self.snapshot_interval_s,
            "snapshots_published": self.snapshots_published,
            "snapshots_failed": self.snapshots_failed,
            "snapshot_median_s": _median(
                [seconds for run in self.on for seconds in run.snapshot_seconds]
            ),
        }


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """``seconds`` is None when no restore could be measured; ``note`` says why.

    ``rejected_snapshots``: snapshots of the crash run, with episodes in flight, that the
    restore planner would have refused (id and reason); the run was crashed after the
    first one it accepts, so these are reported, never measured.
    """

    seconds: float | None
    note: str = ""
    checkpoint_id: str | None = None
    resumable_in_snapshot: int = 0
    start_participants_s: float | None = None
    restore_s: float | None = None
    first_progress_s: float | None = None
    resumed: int = 0
    rerun: int = 0
    rejected_snapshots: tuple[tuple[str, str], ...] = ()
    # Restore rounds: more than one when running participants had moved past saved
    # attempts (docs/spec.md section 7.7 item 7).
    rounds: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": _round(self.seconds),
            "rounds": self.rounds,
            "note": self.note,
            "checkpoint_id": self.checkpoint_id,
            "resumable_in_snapshot": self.resumable_in_snapshot,
            "start_participants_s": _round(self.start_participants_s),
            "restore_s": _round(self.restore_s),
            "first_progress_s": _round(self.first_progress_s),
            "resumed": self.resumed,
            "rerun": self.rerun,
            "rejected_snapshots": [
                {"checkpoint_id": checkpoint_id, "problem": problem}
                for checkpoint_id, problem in self.rejected_snapshots
            ],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _median(values: Sequence[float]) -> float | None:
    # Four decimals, as _percentile: a p99 rounded finer than its median could read
    # below it (0.0258 against 0.026 for one snapshot).
    return round(statistics.median(values), 4) if values else None


def _percentile(values: Sequence[float], fraction: float) -> float | None:
    """The nearest-rank percentile (the largest value below 100 samples for p99)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return round(ordered[rank - 1], 4)


# ----------------------------------------------------------------------- event log


def read_events(path: Path) -> list[dict[str, Any]]:
    """The trainer's events; a line cut short by a kill is skipped."""
    events = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            event = json.loads(line)
            if isinstance(event, dict):
                events.append(event)
    return events


def run_figures(events: Sequence[Mapping[str, Any]], *, crashed: bool = False) -> RunFigures:
    """Rollouts trained on and seconds from ``start`` to ``done`` of one finished run
    (``crashed``: to its last event, for a run that was killed)."""
    starts = [float(e["t"]) for e in events if e.get("type") == "start"]
    if crashed:
        ends = [max(float(e["t"]) for e in events if "t" in e)] if starts else []
    else:
        ends = [float(e["t"]) for e in events if e.get("type") == "done"]
    if not starts or not ends:
        raise WorkloadError("the trainer's event log has no start and done events")
    steps = [
        (float(e["t"]), len(e.get("rollouts", ()))) for e in events if e.get("type") == "train_step"
    ]
    rollouts = sum(trained for _, trained in steps)
    snapshots = [e for e in events if e.get("type") == "snapshot"]
    published = [e for e in snapshots if e.get("outcome") == "published"]
    in_flight = [
        (float(e["t"]), float(e.get("in_flight", 0)))
        for e in events
        if e.get("type") == "progress" and float(e["t"]) >= starts[0]
    ]
    if in_flight and in_flight[-1][0] < ends[-1]:
        # The last sample holds until the run's end (samples are 0.5 s apart).
        in_flight.append((ends[-1], in_flight[-1][1]))
    closed = [
        (float(e.get("admission_closed_s", 0.0)), int(e.get("continued", 0))) for e in snapshots
    ]
    return RunFigures(
        rollouts=rollouts,
        seconds=ends[-1] - starts[0],
        closed_rollout_seconds=sum(seconds * held for seconds, held in closed),
        rollout_seconds=integrate(in_flight),
        crashed=crashed,
        # A crashed run never drained: it was killed in its stride.
        steady=steady_window(steps, head=START_UP_STEPS, tail=0 if crashed else DRAIN_STEPS),
        snapshots_published=len(published),
        snapshots_failed=sum(e.get("outcome") == "failed" for e in snapshots),
        snapshot_seconds=tuple(float(e["t_end"]) - float(e["t_start"]) for e in published),
        admission_closed_seconds=tuple(float(e["admission_closed_s"]) for e in published),
    )


def block_pairs(
    events: Sequence[Mapping[str, Any]], *, block_steps: int, depth: int = PIPELINE_STEPS
) -> tuple[tuple[RunFigures, RunFigures], ...]:
    """The (off, on) pairs of blocks of a run made with ``--snapshot-blocks
    block_steps``: blocks 2 and 3, 4 and 5, ... (0 and 1 hold the start-up; blocks
    reaching into the drain, :data:`DRAIN_STEPS`, are left out). Each block is measured
    as a run of its own: its steps' rollouts over the seconds from the end of the block
    before it, each boundary the mean end of the pipeline's last ``depth`` steps
    (:data:`PIPELINE_STEPS`), and the snapshots that started while the trainer was in
    it (from the end of the block before it to the end of its last step) with the
    rollout-seconds they held closed over the block's own (the rollouts in flight
    integrated over that span)."""
    trained = [e for e in events if e.get("type") == "train_step"]
    sides: dict[int, bool] = {}
    for event in trained:
        block, on = int(event["block"]), bool(event["snapshots_on"])
        if sides.setdefault(block, on) != on:
            raise WorkloadError(f"block {block} has steps with snapshots on and off")
    ends = [(float(e["t"]), len(e.get("rollouts", ()))) for e in trained]
    windows = block_windows(ends, block_steps=block_steps, tail=DRAIN_STEPS, depth=depth)
    # Where the trainer switched its snapshots on and off: at the ends of the blocks.
    spans = block_windows(ends, block_steps=block_steps, tail=DRAIN_STEPS)
    in_flight = [
        (float(e["t"]), float(e.get("in_flight", 0))) for e in events if e.get("type") == "progress"
    ]
    snapshots = [e for e in events if e.get("type") == "snapshot"]

    def measured(block: int) -> RunFigures:
        window, span = windows[block], spans[block]
        inside = [s for s in snapshots if span.opened <= float(s["t_start"]) < span.closed]
        published = [s for s in inside if s.get("outcome") == "published"]
        return RunFigures(
            rollouts=window.rollouts,
            seconds=window.seconds,
            snapshots_published=len(published),
            snapshots_failed=sum(s.get("outcome") == "failed" for s in inside),
            snapshot_seconds=tuple(float(s["t_end"]) - float(s["t_start"]) for s in published),
            admission_closed_seconds=tuple(float(s["admission_closed_s"]) for s in published),
            closed_rollout_seconds=sum(
                float(s.get("admission_closed_s", 0.0)) * int(s.get("continued", 0)) for s in inside
            ),
            rollout_seconds=integrate_between(in_flight, span.opened, span.closed),
        )

    pairs = []
    first = 2
    while first + 1 in windows:
        second = first + 1
        if sides[first] == sides[second]:
            raise WorkloadError(f"blocks {first} and {second} are on the same side")
        off_block, on_block = (first, second) if sides[second] else (second, first)
        pairs.append((measured(off_block), measured(on_block)))
        first += 2
    return tuple(pairs)


# ------------------------------------------------------------------------- one run


@dataclass
class _Run:
    """One run's directory: token, topology, snapshots, the trainer's log and events."""

    out: Path
    token: str
    participants: list[dict[str, Any]] = field(default_factory=list)

    @property
    def snapshots(self) -> Path:
        return self.out / "snapshots"

    @property
    def events(self) -> Path:
        return self.out / "events.jsonl"

    @property
    def topology(self) -> Path:
        return self.out / "topology.json"

    @property
    def token_file(self) -> Path:
        return self.out / "token"

    def write_files(self) -> None:
        self.snapshots.mkdir(parents=True, exist_ok=True)
        if not self.token_file.exists():
            create_file(
                self.token_file,
                (self.token + "\n").encode("utf-8"),
                temp_prefix=".token-",
                mode=0o600,
            )
        topology = {
            "token_file": str(self.token_file),
            "snapshot_root": str(self.snapshots),
            "participants": self.participants,
        }
        replace_file(
            self.topology,
            (json.dumps(topology, indent=2) + "\n").encode("utf-8"),
            temp_prefix=".topology-",
        )


def _trainer_argv(
    run: _Run,
    options: WorkloadOptions,
    interval_s: float,
    steps: int,
    block_steps: int | None = None,
) -> list[str]:
    # Both blocks of a pair play the same prompts (every block plays the same ones): a
    # block of easy prompts beside one of hard prompts read as a 1.4 ratio once.
    blocks = (
        []
        if block_steps is None
        else [
            "--snapshot-blocks",
            str(block_steps),
            "--prompt-cycle",
            str(block_steps * options.groups_per_step),
        ]
    )
    return [
        sys.executable,
        "-m",
        _TRAINER_MODULE,
        "--topology",
        str(run.topology),
        "--out",
        str(run.out),
        "--steps",
        str(steps),
        "--group-size",
        str(options.group_size),
        "--groups-per-step",
        str(options.groups_per_step),
        "--snapshot-interval",
        repr(interval_s),
        "--seed",
        str(options.seed),
        *blocks,
    ]


class _Trainer:
    """The demo trainer as a child process; killed on exit whatever happened.

    ``start_on_stdin``: it imports (torch: seconds on a loaded machine) and then waits
    for :meth:`go` before it reads the topology, so that its start-up overlaps the
    participants' (as the demo's supervisor starts it)."""

    def __init__(self, run: _Run, argv: Sequence[str], *, start_on_stdin: bool = False) -> None:
        self._run = run
        self._argv = [*argv, "--start-on-stdin"] if start_on_stdin else list(argv)
        self._start_on_stdin = start_on_stdin
        self._process: asyncio.subprocess.Process | None = None
        self._logs: list[IO[bytes]] = []
        self._stderr = run.out / "trainer.stderr"

    async def __aenter__(self) -> _Trainer:
        stdout = (self._run.out / "trainer.stdout").open("ab")
        stderr = self._stderr.open("ab")
        self._logs = [stdout, stderr]
        self._process = await asyncio.create_subprocess_exec(
            *self._argv,
            stdin=asyncio.subprocess.PIPE if self._start_on_stdin else asyncio.subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env={"GRPC_VERBOSITY": "ERROR", **os.environ},
        )
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.kill()
        for handle in self._logs:
            handle.close()

    async def go(self) -> None:
        """Let a trainer started on stdin read the topology and run."""
        process = self._process
        assert process is not None and process.stdin is not None
        process.stdin.write(b"start\n")
        with contextlib.suppress(ConnectionError):
            # A trainer that already died says why in :meth:`wait`.
            await process.stdin.drain()

    @property
    def exited(self) -> bool:
        return self._process is not None and self._process.returncode is not None

    async def kill(self) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    async def wait(self, timeout_s: float) -> None:
        """Wait for a clean exit; raise :class:`WorkloadError` on any other end."""
        process = self._process
        assert process is not None
        try:
            code = await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            raise WorkloadError(f"the demo trainer did not finish in {timeout_s:g} s") from None
        if code != 0:
            raise WorkloadError(f"the demo trainer exited with code {code}: {self.stderr_tail()}")

    def stderr_tail(self) -> str:
        try:
            text = self._stderr.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return text[-_STDERR_TAIL_CHARS:].strip()


async def _start_participants(
    run: _Run, options: WorkloadOptions, turn_delay_s: float = 0.0
) -> WorkerProcess:
    worker = WorkerProcess(
        f"topology-{run.out.name}",
        topology_job(run.snapshots, options.agents, options.group_size, options.seed, turn_delay_s),
        run.token,
    )
    report = await worker.start(_WORKER_START_TIMEOUT_S)
    run.participants = list(report["participants"])
    await asyncio.to_thread(run.write_files)
    return worker


async def _finished_run(
    run: _Run,
    options: WorkloadOptions,
    interval_s: float,
    progress: Progress,
    *,
    steps: int | None = None,
    block_steps: int | None = None,
    turn_delay_s: float = 0.0,
) -> RunFigures:
    """A whole run of ``steps`` steps (``options.steps``) on fresh participants whose
    agent turns wait ``turn_delay_s``, its snapshots in blocks of ``block_steps`` steps
    if given (the trainer's ``--snapshot-blocks``)."""
    await asyncio.to_thread(run.snapshots.mkdir, parents=True, exist_ok=True)
    argv = _trainer_argv(run, options, interval_s, steps or options.steps, block_steps)
    async with _Trainer(run, argv, start_on_stdin=True) as trainer:
        worker = await _start_participants(run, options, turn_delay_s)
        try:
            await trainer.go()
            await trainer.wait(options.run_timeout_s)
        finally:
            await worker.stop()
    figures = run_figures(await asyncio.to_thread(read_events, run.events))
    counted = figures.counted
    progress(
        f"    {figures.rollouts} rollouts in {figures.seconds:.1f} s; steady state "
        f"{counted.rollouts} in {counted.seconds:.1f} s: {counted.per_second:.2f} rollouts/s "
        f"({figures.snapshots_published} snapshots, dispatch closed for "
        f"{_share(figures.closed_fraction)} of the rollout-seconds)"
    )
    return figures


def _block_run_steps(options: WorkloadOptions) -> int:
    """Blocks 0 and 1 (the start-up), ``repeats`` pairs measured, and the drain."""
    return options.block_steps * 2 * (options.repeats + 1) + DRAIN_STEPS


async def _block_run(
    run: _Run, options: WorkloadOptions, progress: Progress
) -> tuple[tuple[RunFigures, RunFigures], ...]:
    """One trainer run whose snapshots alternate in blocks (off, on, on, off, ...), its
    pairs of neighbouring blocks measured (:func:`block_pairs`)."""
    steps = _block_run_steps(options)
    progress(
        f"throughput: demo trainer, {steps} steps of {options.groups_per_step} groups x "
        f"{options.group_size}, {options.agents} agents, each turn {options.turn_delay_s:g} s "
        f"in its model call; blocks of {options.block_steps} steps alternately without "
        f"snapshots and with one every {options.snapshot_interval_s:g} s (off, on, on, off), "
        f"{options.repeats} pairs measured after a pair of start-up"
    )
    await _finished_run(
        run,
        options,
        # The trainer's own interval inside its on blocks; none outside them.
        options.snapshot_interval_s,
        progress,
        steps=steps,
        block_steps=options.block_steps,
        turn_delay_s=options.turn_delay_s,
    )
    events = await asyncio.to_thread(read_events, run.events)
    pairs = block_pairs(events, block_steps=options.block_steps)
    for index, (off, on) in enumerate(pairs):
        progress(
            f"    pair {index + 1}: off {off.per_second:.2f}, on {on.per_second:.2f} rollouts/s "
            f"({on.per_second / off.per_second:.3f}; {on.snapshots_published} snapshots, "
            f"dispatch closed for {_share(on.closed_fraction)} of the rollout-seconds)"
        )
    return pairs


# ------------------------------------------------------------------------ restore


@dataclass(frozen=True, slots=True)
class _Crash:
    """The snapshot a crashed run left as ``LATEST``, and the ones a restore could not
    have used (``rejected``: id and the planner's reason). ``figures``: what the run
    measured up to the crash."""

    checkpoint_id: str
    resumable: int
    problem: str | None = None
    rejected: tuple[tuple[str, str], ...] = ()
    figures: RunFigures | None = None


def _steps_trained(events: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for event in events if event.get("type") == "train_step")


def _logged(events: Sequence[Mapping[str, Any]], checkpoint_id: str) -> bool:
    return any(
        event.get("type") == "snapshot" and event.get("checkpoint_id") == checkpoint_id
        for event in events
    )


def _restore_problem(
    layout: SnapshotLayout, checkpoint_id: str, topology: Topology
) -> tuple[int, str | None]:
    """How many episodes a restore of ``checkpoint_id`` would redispatch, or why it
    would fail. Blocking: reads the manifest."""
    try:
        manifest = layout.load(checkpoint_id)
        if not manifest.continued:
            return 0, None
        plan = plan_restore(
            manifest, topology, RecoveryLevel.parse(_TARGET_LEVEL), restore_id="bench-check"
        )
    except ManifestError as error:
        return 0, str(error)
    return len(plan.redispatch), None


def _identity_of(run: _Run) -> CoordinatorIdentity:
    raw = json.loads((run.snapshots / COORDINATOR_FILE).read_text(encoding="utf-8"))
    return CoordinatorIdentity(raw["coordinator_id"], raw["epoch"])


async def _describe(run: _Run) -> Topology:
    """The crash run's topology, described under the trainer's own fence (the same
    epoch: a higher one would fence the trainer out)."""
    identity = await asyncio.to_thread(_identity_of, run)
    endpoints = {p["instance"]: p["address"] for p in run.participants}
    config = CoordinatorConfig(snapshot_root=run.snapshots, control_timeout_s=10.0)
    async with Coordinator(
        endpoints,
        token=run.token,
        coordinator_id=identity.coordinator_id,
        epoch=identity.epoch,
        config=config,
    ) as describer:
        return await describer.discover()


async def _crash_with_episodes_in_flight(
    run: _Run, options: WorkloadOptions, progress: Progress, *, min_steps: int = 0
) -> tuple[_Crash, WorkerProcess]:
    """Run the trainer until it publishes a snapshot that holds episodes in flight and
    that a restore can use, then kill the trainer. Returns the snapshot and the
    participants, which survived it (the caller ends them).

    With ``min_steps``, only a snapshot published once that many steps were trained
    ends the run: the run up to the crash is then a run with snapshots on, measured
    (its figures in :attr:`_Crash.figures`), so that the quick bench needs no run of
    its own for the cost of snapshots."""
    await asyncio.to_thread(run.snapshots.mkdir, parents=True, exist_ok=True)
    worker = await _start_participants(run, options)
    layout = SnapshotLayout(run.snapshots)
    topology: Topology | None = None
    checked: dict[str, tuple[int, str | None]] = {}
    rejected: list[tuple[str, str]] = []
    early: set[str] = set()
    try:
        # More steps than it needs: it is killed long before the end.
        argv = _trainer_argv(run, options, options.snapshot_interval_s, options.steps * 20)
        async with _Trainer(run, argv) as trainer:
            async with asyncio.timeout(options.run_timeout_s):
                while True:
                    if trainer.exited:
                        raise WorkloadError(
                            "the demo trainer ended before a usable snapshot held episodes "
                            f"in flight: {trainer.stderr_tail()}"
                        )
                    # A monitor, not a synchronisation: the trainer publishes on its own.
                    await asyncio.sleep(_WATCH_PERIOD_S)
                    latest = await asyncio.to_thread(layout.latest)
                    if latest is None or latest in checked or latest in early:
                        continue
                    if min_steps:
                        # Read once per new snapshot (and until its event is logged).
                        events = await asyncio.to_thread(read_events, run.events)
                        if _steps_trained(events) < min_steps:
                            early.add(latest)
                            continue
                        if not _logged(events, latest):
                            # Published, its report not written yet: the run's figures
                            # must hold the snapshot that ends it.
                            continue
                    if topology is None:
                        topology = await _describe(run)
                    found = await asyncio.to_thread(_restore_problem, layout, latest, topology)
                    checked[latest] = found
                    resumable, problem = found
                    if problem is not None:
                        rejected.append((latest, problem))
                        progress(
                            f"  {latest} could not be restored, waiting for the next: {problem}"
                        )
                    elif resumable:
                        break
                # The crash: no drain, no resume, no goodbye.
                await trainer.kill()
    except BaseException:
        await worker.stop()
        raise
    # A snapshot published between the check and the kill is what a restore gets.
    final = await asyncio.to_thread(layout.latest)
    assert final is not None and topology is not None
    if final not in checked:
        checked[final] = await asyncio.to_thread(_restore_problem, layout, final, topology)
    resumable, problem = checked[final]
    figures = None
    if min_steps:
        figures = run_figures(await asyncio.to_thread(read_events, run.events), crashed=True)
        progress(
            f"    {figures.rollouts} rollouts in {figures.seconds:.1f} s up to the crash "
            f"({figures.snapshots_published} snapshots, dispatch closed for "
            f"{_share(figures.closed_fraction)} of the rollout-seconds)"
        )
    progress(f"  crashed after {final} ({resumable} episodes in flight to resume)")
    return _Crash(final, resumable, problem, tuple(rejected), figures), worker


def _share(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.2%}"


def _progressed(client: RolloutClient, redispatched: Mapping[EpisodeId, int]) -> bool:
    if any(result.episode in redispatched for result in client.results()):
        return True
    return any(
        rollout.episode in redispatched and rollout.boundaries_seen > redispatched[rollout.episode]
        for rollout in client.in_flight()
    )


def _load_restore_modules() -> None:
    for module in (
        "torch",
        "turnpoint.apps.demo._trainer",
        "turnpoint.apps.examples._participants",
    ):
        importlib.import_module(module)


async def _timed_restore(
    run: _Run,
    options: WorkloadOptions,
    crash: _Crash,
    progress: Progress,
    *,
    fresh_participants: bool,
) -> RestoreResult:
    """Restore ``crash``'s snapshot and time it to the first redispatched rollout: onto
    new participant processes (``fresh_participants``, the cold start, clocked from
    their start) or into the ones that survived the trainer (clocked from the new
    trainer's first step, bumping the epoch)."""
    import torch

    from turnpoint.apps.demo._trainer import LEARNING_RATE
    from turnpoint.apps.examples._participants import new_policy

    # Off the clock, as a trainer process imports and builds its model before it
    # starts: the anchor loader's torch.distributed.checkpoint and the optimizer load
    # parts of torch on their first use, and whichever restore came first would pay.
    await asyncio.to_thread(importlib.import_module, "turnpoint.trainer.anchors.dcp")
    model = new_policy(options.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    measured = RestoreResult(
        None,
        checkpoint_id=crash.checkpoint_id,
        resumable_in_snapshot=crash.resumable,
        rejected_snapshots=crash.rejected,
    )
    started = time.perf_counter()
    worker = await _start_participants(run, options) if fresh_participants else None
    coordinator: Coordinator | None = None
    client: RolloutClient | None = None
    label = "the cold start" if fresh_participants else "the trainer's restart"
    try:
        serving = time.perf_counter()
        identity = await asyncio.to_thread(bump_epoch, run.snapshots)
        config = CoordinatorConfig(snapshot_root=run.snapshots, control_timeout_s=10.0)
        endpoints = {p["instance"]: p["address"] for p in run.participants}
        coordinator = Coordinator(
            endpoints,
            token=run.token,
            coordinator_id=identity.coordinator_id,
            epoch=identity.epoch,
            config=config,
        )
        restorer = Restorer(
            coordinator,
            SnapshotLayout(run.snapshots),
            config,
            load_anchor=torch_anchor_loader(model, optimizer),
        )
        async with asyncio.timeout(_RESTORE_TIMEOUT_S):
            plan = await restorer.restore()
        restored = time.perf_counter()
        measured = dataclasses.replace(
            measured,
            start_participants_s=serving - started if fresh_participants else None,
            restore_s=restored - serving,
        )
        if plan is None:
            return dataclasses.replace(measured, note="the restore found no published snapshot")
        measured = dataclasses.replace(measured, rounds=plan.stale_rounds + 1)
        if not plan.redispatch:
            note = (
                f"snapshot {plan.checkpoint_id} continued no episode at this recovery level "
                f"({plan.rerun_count} rerun from their prompts): nothing was redispatched"
            )
            return dataclasses.replace(measured, note=note, rerun=plan.rerun_count)
        agents = sorted(p["instance"] for p in run.participants if p["kind"] == "agent")
        client = RolloutClient(
            {name: AgentEndpoint(endpoints[name], run.token) for name in agents},
            settings=RolloutClientSettings(max_concurrency=256),
            fence=coordinator.fence,
        )
        await client.start()
        apply_plan(plan, client)
        redispatched = {a.episode: a.rollout.boundaries_seen for a in plan.redispatch}
        watched = client
        await client.wait_for(lambda: _progressed(watched, redispatched), _FIRST_PROGRESS_TIMEOUT_S)
        first = time.perf_counter()
        result = dataclasses.replace(
            measured,
            seconds=first - started,
            first_progress_s=first - restored,
            resumed=plan.resumed,
            rerun=plan.rerun_count,
        )
        progress(
            f"  restored {plan.checkpoint_id}: {first - started:.2f} s from {label} to the "
            f"first redispatched rollout ({plan.resumed} resumed, {plan.rerun_count} rerun, "
            f"{plan.stale_rounds + 1} round(s))"
        )
        return result
    finally:
        if client is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                    await client.aclose()
        if coordinator is not None:
            await coordinator.close()
        if worker is not None:
            await worker.stop()


# ---------------------------------------------------------------------------- all


async def run_workload(
    root: Path, options: WorkloadOptions, *, token: str, progress: Progress
) -> tuple[ThroughputResult, RestoreResult, RestoreResult]:
    """Throughput with snapshots off and on, then a crash of the trainer, its restart
    into the participants that survived, and a cold restore onto new ones.

    With no repeats (``--quick``), no run is made each way: the crashed run trains
    ``options.steps`` steps with snapshots on before it may crash, and the cost of its
    snapshots (the share of its rollout-seconds that dispatch was closed) is the
    throughput figure; there is no on/off ratio."""
    work = root / "workload"
    pairs: tuple[tuple[RunFigures, RunFigures], ...] = ()
    if options.repeats:
        pairs = await _block_run(_Run(work / "blocks", token), options, progress)
    measured_before_crash = 0 if options.repeats else options.steps
    if measured_before_crash:
        progress(
            f"restore and the cost of snapshots: a run of {options.steps} steps of "
            f"{options.groups_per_step} groups x {options.group_size}, {options.agents} agents, "
            f"a snapshot every {options.snapshot_interval_s:g} s, its trainer crashed with "
            "episodes in flight and restarted into the surviving participants, then a cold start"
        )
    else:
        progress(
            "restore: a trainer crashed with episodes in flight, restarted into the surviving "
            "participants, then a cold start"
        )
    crashed = _Run(work / "crash", token)
    # The restores build the demo's policy in this process: torch and the demo's modules
    # load in a thread while the crashed run's processes start (its trainer loads torch
    # too before its first event), rather than after the crash.
    preload = asyncio.ensure_future(asyncio.to_thread(_load_restore_modules))
    try:
        crash, survivors = await _crash_with_episodes_in_flight(
            crashed, options, progress, min_steps=measured_before_crash
        )
    finally:
        await preload
    if crash.figures is not None:
        throughput = ThroughputResult(
            options.steps, options.snapshot_interval_s, off=(), on=(crash.figures,)
        )
    else:
        throughput = ThroughputResult(
            _block_run_steps(options),
            options.snapshot_interval_s,
            off=tuple(off for off, _ in pairs),
            on=tuple(on for _, on in pairs),
            block_steps=options.block_steps,
        )
    try:
        if crash.problem is not None:
            unusable = RestoreResult(
                None,
                note=f"the restore of {crash.checkpoint_id} would fail: {crash.problem}",
                checkpoint_id=crash.checkpoint_id,
                resumable_in_snapshot=crash.resumable,
                rejected_snapshots=crash.rejected,
            )
            return throughput, unusable, unusable
        trainer_restart = await _timed_restore(
            crashed, options, crash, progress, fresh_participants=False
        )
        # The cold start's crash: the participants die too.
        await survivors.wait_killed()
    finally:
        await survivors.stop()
    restore = await _timed_restore(crashed, options, crash, progress, fresh_participants=True)
    return throughput, restore, trainer_restart
