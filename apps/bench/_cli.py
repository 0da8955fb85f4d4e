"""The ``turnpoint bench`` command: figures on stdout (a table, or one JSON object),
progress on stderr.

Registering the command imports nothing heavy: the measurements (and torch, which the
trainer side loads) are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.table import Table

from turnpoint.apps.bench._options import (
    FULL_SIZES,
    QUICK_SIZES,
    BenchOptions,
    WorkloadOptions,
)

if TYPE_CHECKING:
    from turnpoint.apps.bench._bench import BenchReport

__all__ = ["add_bench_parser", "bench_command", "render_table"]

_FULL_STEPS = 30
_FULL_REPEATS = 2
_FILE_WIDTH = 160
_QUICK_STEPS = 15


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes takes numbers like 1,8,64, got {text!r}"
        ) from None
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError("--sizes takes participant counts >= 1")
    return sizes


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value:g}")
    return value


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure the control overhead, the snapshot cost on throughput and a restore",
        description=(
            "Measure (1) one snapshot's control path through the real coordinator and "
            "participants against no-op bidi gRPC streams (the lower bound) and no-op "
            f"HTTP+JSON calls, for {', '.join(map(str, FULL_SIZES))} participants spread "
            "over worker processes; (2) rollouts per second of the demo trainer with "
            "snapshots on vs off; (3) the time from a cold start after a crash to the first "
            "redispatched rollout of the restore. Progress goes to stderr, figures to stdout."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"sizes {','.join(map(str, QUICK_SIZES))}, {_QUICK_STEPS}-step demo runs, "
        "one each way",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--sizes", type=_sizes, help="participant counts, e.g. 1,8,64 (overrides --quick)"
    )
    parser.add_argument(
        "--workers", type=_positive_int, default=2, help="worker processes hosting the servers"
    )
    parser.add_argument(
        "--rounds",
        type=_positive_int,
        help="measured rounds per size (default 15, 7 above 64 participants)",
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="unmeasured rounds per size first (default 3)"
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        help=f"training steps of each demo run (default {_FULL_STEPS}, quick {_QUICK_STEPS})",
    )
    parser.add_argument(
        "--groups-per-step", type=_positive_int, default=4, help="prompt groups per step"
    )
    parser.add_argument("--group-size", type=_positive_int, default=4, help="siblings per group")
    parser.add_argument(
        "--snapshot-interval",
        type=_seconds,
        default=2.0,
        help="seconds between snapshots in the run with snapshots on (default 2)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        help=f"demo runs each way, snapshots off and on (default {_FULL_REPEATS}, quick 1)",
    )
    parser.add_argument(
        "--agents", type=_positive_int, default=2, help="agent servers in the demo workload"
    )
    parser.add_argument(
        "--root",
        type=Path,
        help="directory for the snapshots (default: a temporary directory, removed after)",
    )
    parser.set_defaults(handler=bench_command)


def _options(args: argparse.Namespace) -> BenchOptions:
    quick = bool(args.quick)
    workload = WorkloadOptions(
        agents=args.agents,
        steps=args.steps or (_QUICK_STEPS if quick else _FULL_STEPS),
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        snapshot_interval_s=args.snapshot_interval,
        repeats=args.repeats or (1 if quick else _FULL_REPEATS),
    )
    return BenchOptions(
        sizes=args.sizes or (QUICK_SIZES if quick else FULL_SIZES),
        workers=args.workers,
        rounds=args.rounds,
        warmup=args.warmup,
        workload=workload,
        root=args.root,
    )


def _progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def bench_command(args: argparse.Namespace) -> int:
    try:
        options = _options(args)
    except ValueError as error:
        print(f"turnpoint bench: {error}", file=sys.stderr)
        return 2
    import asyncio

    from turnpoint.apps.bench._baselines import BaselineError
    from turnpoint.apps.bench._bench import run_bench
    from turnpoint.apps.bench._workers import WorkerError
    from turnpoint.apps.bench._workload import WorkloadError
    from turnpoint.errors import TurnpointError
    from turnpoint.trainer._coordinator import CoordinatorError

    failures = (
        BaselineError,
        CoordinatorError,
        TurnpointError,
        WorkerError,
        WorkloadError,
        TimeoutError,
        OSError,
    )

    async def cancellable() -> BenchReport:
        # SIGTERM cancels the run like Ctrl-C does, so that every worker and trainer
        # process is stopped on the way out instead of being orphaned.
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await run_bench(options, _progress)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        report = asyncio.run(cancellable())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("turnpoint bench: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    except failures as error:
        # A timeout carries no text; the progress lines above say which step it ended.
        detail = str(error) or "a bounded wait ran out"
        print(f"turnpoint bench: {type(error).__name__}: {detail}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        render_table(report, sys.stdout)
    return 0


def _ms(value: float) -> str:
    return f"{value:.1f}"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render_table(report: BenchReport, out: TextIO) -> None:
    """The figures as rich tables (plain text when ``out`` is not a terminal)."""
    from turnpoint.apps.bench._control_overhead import PHASES

    # A file or a pipe gets room for every column instead of rich's default 80.
    width = None if out.isatty() else _FILE_WIDTH
    console = Console(file=out, highlight=False, width=width)
    overhead = Table(
        title=f"Control path of one snapshot, median ms ({report.workers} worker process(es), "
        "the same server layout for every path)",
        title_justify="left",
    )
    columns = ("participants", "turnpoint", "bidi floor", "ratio", "HTTP+JSON", "vs HTTP")
    for column in (*columns, *PHASES, "rounds"):
        overhead.add_column(column, justify="right")
    for row in report.control_overhead:
        overhead.add_row(
            str(row.participants),
            _ms(row.overhead_ms),
            _ms(row.lower_bound_ms),
            f"{row.ratio:.2f}x",
            _ms(row.http_json_ms),
            f"{row.ratio_vs_http_json:.2f}x",
            *(_ms(row.phases_ms.get(phase, 0.0)) for phase in PHASES),
            str(row.rounds),
        )
    console.print(overhead)

    throughput = report.throughput
    workload = Table(
        title=f"Demo trainer, {throughput.steps} steps per run, {len(throughput.on)} run(s) "
        "each way",
        title_justify="left",
    )
    workload.add_column("figure")
    workload.add_column("value", justify="right")
    workload.add_row("rollouts/s, no snapshots", f"{throughput.per_second_off:.1f}")
    workload.add_row(
        f"rollouts/s, a snapshot every {throughput.snapshot_interval_s:g} s",
        f"{throughput.per_second_on:.1f}",
    )
    ratio = throughput.ratio
    workload.add_row("throughput on / off", "n/a" if ratio is None else f"{ratio:.3f}")
    details = throughput.to_json()
    workload.add_row(
        "snapshots published / failed",
        f"{details['snapshots_published']} / {details['snapshots_failed']}",
    )
    workload.add_row("snapshot median s (all phases)", _s(details["snapshot_median_s"]))
    workload.add_row("admission closed median s", _s(details["admission_closed_median_s"]))
    restore = report.restore
    workload.add_row("restore s (cold start to first redispatched rollout)", _s(restore.seconds))
    if restore.seconds is None:
        workload.add_row("  not measured", restore.note)
    else:
        workload.add_row("  start participant processes s", _s(restore.start_participants_s))
        workload.add_row(
            "  restore: discover, verify, anchor, install, resume s", _s(restore.restore_s)
        )
        workload.add_row(
            "  then first progress of a redispatched rollout s", _s(restore.first_progress_s)
        )
        workload.add_row("  episodes resumed / rerun", f"{restore.resumed} / {restore.rerun}")
    for checkpoint_id, problem in restore.rejected_snapshots:
        workload.add_row(f"  {checkpoint_id} could not have been restored", problem)
    console.print(workload)
