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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.table import Table

from turnpoint.apps.bench._arithmetic import bookkeeping_by_cpu
from turnpoint.apps.bench._heal_bench import add_heal_arguments
from turnpoint.apps.bench._long_generations import add_long_generation_arguments
from turnpoint.apps.bench._options import (
    DURABLE_SIZE,
    FULL_SIZES,
    QUICK_RELAY_CALLS,
    QUICK_SANDBOX_MB,
    QUICK_SANDBOX_ROUNDS,
    QUICK_SIZES,
    REAL_STATE,
    RELAY_CALLS,
    REPLAY_TURNS,
    SANDBOX_MB,
    SANDBOX_ROUNDS,
    SCALE_EPISODES,
    TMPFS,
    BenchOptions,
    RealStateCase,
    WorkloadOptions,
    positive_ints,
)

if TYPE_CHECKING:
    from turnpoint.apps.bench._bench import (
        BenchReport,
        ControlPathReport,
        RealStateReport,
        Target,
    )
    from turnpoint.apps.bench._control_overhead import OverheadRow
    from turnpoint.apps.bench._real_state import RealStateRow


# The full bench's throughput run (see _workload): agent turns of 2 s in their model
# call, so that 64 rollouts in flight need about a tenth of a core and the rate (about
# 10 rollouts/s) is set by timers and dispatch; blocks of 2 steps (one wave of the
# trainer's two-deep pipeline, about 6.3 s: three or four snapshots 2 s apart in an on
# block), each boundary the mean end of the pipeline's two steps; 30 pairs measured
# after a pair of start-up (about 6.7 minutes). What varies a block's rate is the
# seconds a wave takes beyond its turns (the training steps' CPU, a shared machine's
# jitter), about 0.1 s a wave whatever the turns last: 2 s turns halve its share of a
# wave against 1 s turns. Measured on the shared 2-core machine at load 1 to 2, the same
# day: turns of 1 s in blocks of 4 steps (18 pairs, 4.2 minutes) gave a width of 4.2
# points with one step's end as a block's boundary and 3.7 with the mean of two; three
# runs of 2 s turns in blocks of 2 steps (30 pairs, 6.7 minutes) 1.5, 0.8 and 5.6
# points with one step's end and 1.2, 1.3 and 5.3 with the mean of two. The 5.3: one
# pair of 1.42 where the others lay within 0.97 to 1.12, its on block (block 50)
# stepping every 4.2 s instead of 6.3; block 50 was the fastest of another run too
# (1.09; there its first step's rollouts all ended within two turns, where most take
# three). The prompts of a block are the same in every run (seeded): a pair's blocks
# differ in their work as well as in their snapshots, and the same pair can stand out
# run after run. Earlier, at load 8 to 13
# and with every on block's first snapshot 1 s in (since moved block to block: the
# snapshots had locked onto the turns' phase), 2 s turns in 2-step blocks gave 11.6
# points; whole CPU-bound runs, 70.
_FULL_TURN_DELAY_S = 2.0
_FULL_BLOCK_STEPS = 2
_FULL_REPEATS = 30
# The full bench's crashed run (for the restart figures) is killed long before this.
_FULL_STEPS = 90
_FILE_WIDTH = 160
# --quick makes no run each way: the crashed run trains this many steps with snapshots
# on first (about eight snapshots 2 s apart), and the share of its rollout-seconds that
# dispatch was closed is the throughput figure (a ratio within one run).
_QUICK_STEPS = 40
_QUICK_REPEATS = 0
_QUICK_TURN_DELAY_S = 0.0
_QUICK_BOOKKEEPING = 2000
_FULL_BOOKKEEPING = 5000
_QUICK_BOOKKEEPING_REPEATS = 3
_FULL_BOOKKEEPING_REPEATS = 5


_sizes = positive_ints("--sizes", "1,8,64", "participant counts")
_megabytes = positive_ints("--sandbox-mb", "10,100", "megabytes")
_turns = positive_ints("--replay-turns", "5,20,50", "turns")
_scale_counts = positive_ints("--scale-episodes", "1000,10000", "episode counts")


def _real_state(text: str) -> tuple[RealStateCase, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(RealStateCase.parse(part.strip()) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _episode_counts(text: str) -> tuple[int, ...]:
    return () if text.strip().lower() == "none" else _scale_counts(text)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _at_least(1)
_count = _at_least(0)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value:g}")
    return value


def _delay(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value:g}")
    return value


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure the control overhead, the snapshot cost on throughput and a restore",
        description=(
            "Measure (1) the control path: one snapshot (prepare, commit, publish, resume) "
            "through the real coordinator and participants, every snapshot root on tmpfs "
            f"({TMPFS} unless --tmpfs says otherwise), against no-op bidi gRPC streams (the "
            "floor) and no-op HTTP+JSON calls (the anchor), same workers, same run, phases "
            f"reported, for {', '.join(map(str, FULL_SIZES))} participants spread over "
            f"worker processes; (2) the durable commit: the same snapshot of {DURABLE_SIZE} "
            "participants on the disk root (--root), with the fsyncs per snapshot of the "
            "participants and of the coordinator; (3) throughput: rollouts per second of the "
            "demo trainer with a snapshot every 2 s vs none, runs long enough for ten "
            "snapshots, sides interleaved, five runs a side, the median ratio with its "
            "spread and the ratio of means with its bootstrap 95% interval, the share of "
            "the rollout-seconds that snapshots held dispatch closed, and admission-closed "
            "seconds per snapshot (median, p99); (4) "
            "bookkeeping: the SDK's microseconds per episode (begin, 5 boundaries, finish, "
            "acknowledge); (5) restart: from a cold start after a crash (participant start-up "
            "included) to the first redispatched rollout, and before it, the same crash's "
            "trainer restarted alone into the participants that survived it; (6, not with "
            "--quick) long "
            "generations: admission-closed seconds per snapshot with and without "
            "token-prefix cutting at several generation lengths, and their plot; (7) the "
            "status page: the control path with the trainer's status API polled every "
            "100 ms over the same path unpolled, a ratio; (8) sandbox snapshots: seconds and "
            "bytes written by a sandbox's first snapshot and by one of the unchanged tree, "
            f"at {' and '.join(map(str, SANDBOX_MB))} MB, and the restore over the first "
            "snapshot, a ratio; then admission-closed seconds per snapshot of 16 sandboxes "
            "each running a command (cut at the checkpoint) over the same 16 idle; (9) the "
            "egress "
            "relay: a chat call through it over the same call direct, a ratio, and the "
            "restore by replay of episodes of "
            f"{', '.join(map(str, REPLAY_TURNS))} turns against their live runs. Progress "
            "goes to stderr, figures to stdout; --json prints all of them with the targets "
            "they are held to."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"sizes {','.join(map(str, QUICK_SIZES))}, no demo run each way: the "
        f"crashed run trains {_QUICK_STEPS} steps with snapshots on and its share of "
        "rollout-seconds with dispatch closed is the throughput figure, "
        f"{_QUICK_BOOKKEEPING} bookkeeping episodes, a "
        f"{','.join(map(str, QUICK_SANDBOX_MB))} MB sandbox, {QUICK_SANDBOX_ROUNDS} busy "
        f"sandbox rounds, {QUICK_RELAY_CALLS} relay calls each way",
    )
    parser.add_argument(
        "--relay-calls",
        type=_positive_int,
        help=f"chat calls each way of the relay overhead (default {RELAY_CALLS}, quick "
        f"{QUICK_RELAY_CALLS})",
    )
    parser.add_argument(
        "--replay-turns",
        type=_turns,
        default=REPLAY_TURNS,
        help=f"episode lengths restored by replay (default {','.join(map(str, REPLAY_TURNS))})",
    )
    parser.add_argument(
        "--sandbox-mb",
        type=_megabytes,
        default=None,
        help=f"sizes in MB of the sandboxes snapshotted (default "
        f"{','.join(map(str, SANDBOX_MB))}, quick {','.join(map(str, QUICK_SANDBOX_MB))})",
    )
    parser.add_argument(
        "--sandbox-rounds",
        type=_positive_int,
        help="snapshots of the 16 busy sandboxes, and of them idle (default "
        f"{SANDBOX_ROUNDS}, quick {QUICK_SANDBOX_ROUNDS})",
    )
    parser.add_argument(
        "--real-state",
        type=_real_state,
        help="snapshots carrying real state against the disk's floor, each case with its "
        "episodes parked all along and again with every episode a new turn before each "
        "snapshot, as PARTICIPANTSxEPISODESxBYTES[,...] (default "
        f"{','.join(case.label for case in REAL_STATE)}; quick: none; 'none' for none)",
    )
    parser.add_argument(
        "--scale-episodes",
        type=_episode_counts,
        help="episodes in flight whose trainer books (tracemalloc), manifest bytes and "
        "snapshot time are measured, in process (default "
        f"{','.join(map(str, SCALE_EPISODES))}; quick: none; 'none' for none)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a ratio (or an fsync count) is past its must-have target by "
        "1.5x (for CI: noise passes, a regression fails; absolute times never fail it)",
    )
    parser.add_argument(
        "--tmpfs",
        type=Path,
        default=TMPFS,
        help=f"tmpfs directory for the control path's snapshot roots (default {TMPFS}; "
        "if it does not exist they go under --root and the report says so)",
    )
    parser.add_argument(
        "--bookkeeping-episodes",
        type=_positive_int,
        help=f"episodes of the bookkeeping figure (default {_FULL_BOOKKEEPING}, quick "
        f"{_QUICK_BOOKKEEPING})",
    )
    parser.add_argument(
        "--bookkeeping-repeats",
        type=_positive_int,
        help=f"repeats of the bookkeeping figure, for its spread (default "
        f"{_FULL_BOOKKEEPING_REPEATS}, quick {_QUICK_BOOKKEEPING_REPEATS})",
    )
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
        help="training steps the crashed demo run trains with snapshots on before it may "
        f"crash, with --repeats 0 (quick: {_QUICK_STEPS}); its bound otherwise",
    )
    parser.add_argument(
        "--groups-per-step",
        type=_positive_int,
        default=WorkloadOptions().groups_per_step,
        help="prompt groups per step (default: %(default)s)",
    )
    parser.add_argument("--group-size", type=_positive_int, default=4, help="siblings per group")
    parser.add_argument(
        "--snapshot-interval",
        type=_seconds,
        default=2.0,
        help="seconds between snapshots in the run with snapshots on (default 2)",
    )
    parser.add_argument(
        "--turn-delay",
        type=_delay,
        help="seconds each agent turn of the demo runs waits in its model call, a real "
        f"model's latency (default {_FULL_TURN_DELAY_S:g}; quick {_QUICK_TURN_DELAY_S:g}: "
        "CPU-bound, as the demo)",
    )
    parser.add_argument(
        "--repeats",
        type=_count,
        help=f"pairs of blocks measured in the throughput run, one block without snapshots "
        f"and one with (default {_FULL_REPEATS}; quick {_QUICK_REPEATS}: no such run, the "
        "crashed run measures the cost of snapshots alone)",
    )
    parser.add_argument(
        "--block-steps",
        type=_positive_int,
        default=_FULL_BLOCK_STEPS,
        help="training steps per block of the throughput run (default: %(default)s)",
    )
    parser.add_argument(
        "--agents",
        type=_positive_int,
        default=WorkloadOptions().agents,
        help="agent servers in the demo workload (default: %(default)s)",
    )
    parser.add_argument(
        "--root",
        type=Path,
        help="directory on disk for the durable commit and the demo runs (default: a "
        "temporary directory, removed after)",
    )
    parser.add_argument(
        "--control-path-only",
        action="store_true",
        help="instead: the control-path figure alone (--sizes, --workers, --rounds, "
        "--warmup, --tmpfs apply; --json and --check too, on its targets)",
    )
    parser.add_argument(
        "--real-state-only",
        action="store_true",
        help="instead: the real-state figure alone (--real-state, default "
        f"{','.join(case.label for case in REAL_STATE)} even with --quick; --root, "
        "--workers, --rounds, --warmup, --json and --check apply)",
    )
    parser.add_argument(
        "--ray-scale",
        action="store_true",
        help="instead: one snapshot of 8, 64, 256 participants (or --sizes) spread over "
        "three Ray nodes on this machine, time per phase, and a plot (--ray-scale-plot)",
    )
    parser.add_argument(
        "--ray-scale-plot",
        default="bench-ray-scale.png",
        metavar="PNG",
        help="where --ray-scale writes its plot (default: %(default)s)",
    )
    add_long_generation_arguments(parser)
    add_heal_arguments(parser)
    parser.set_defaults(handler=bench_command)


def _options(args: argparse.Namespace) -> BenchOptions:
    quick = bool(args.quick)
    workload = WorkloadOptions(
        agents=args.agents,
        steps=args.steps or (_QUICK_STEPS if quick else _FULL_STEPS),
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        snapshot_interval_s=args.snapshot_interval,
        turn_delay_s=args.turn_delay
        if args.turn_delay is not None
        else (_QUICK_TURN_DELAY_S if quick else _FULL_TURN_DELAY_S),
        repeats=args.repeats
        if args.repeats is not None
        else (_QUICK_REPEATS if quick else _FULL_REPEATS),
        block_steps=args.block_steps,
    )
    return BenchOptions(
        sizes=args.sizes or (QUICK_SIZES if quick else FULL_SIZES),
        workers=args.workers,
        rounds=args.rounds,
        warmup=args.warmup,
        workload=workload,
        root=args.root,
        tmpfs=args.tmpfs,
        bookkeeping_episodes=args.bookkeeping_episodes
        or (_QUICK_BOOKKEEPING if quick else _FULL_BOOKKEEPING),
        bookkeeping_repeats=args.bookkeeping_repeats
        or (_QUICK_BOOKKEEPING_REPEATS if quick else _FULL_BOOKKEEPING_REPEATS),
        sandbox_mb=args.sandbox_mb or (QUICK_SANDBOX_MB if quick else SANDBOX_MB),
        sandbox_rounds=args.sandbox_rounds or (QUICK_SANDBOX_ROUNDS if quick else SANDBOX_ROUNDS),
        relay_calls=args.relay_calls or (QUICK_RELAY_CALLS if quick else RELAY_CALLS),
        replay_turns=args.replay_turns,
        real_state=args.real_state
        if args.real_state is not None
        else (() if quick and not args.real_state_only else REAL_STATE),
        scale_episodes=args.scale_episodes
        if args.scale_episodes is not None
        else (() if quick else SCALE_EPISODES),
    )


def _progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def bench_command(args: argparse.Namespace) -> int:
    if args.long_generations:
        from turnpoint.apps.bench._long_generations import long_generations_command

        return long_generations_command(args)
    if args.ray_scale:
        from turnpoint.apps.bench._ray_scale import ray_scale_command

        return ray_scale_command(args)
    try:
        options = _options(args)
    except ValueError as error:
        print(f"turnpoint bench: {error}", file=sys.stderr)
        return 2
    import asyncio

    from turnpoint.apps.bench._baselines import BaselineError
    from turnpoint.apps.bench._bench import (
        ControlPathReport,
        RealStateReport,
        run_bench,
        run_control_path,
        run_real_state,
    )
    from turnpoint.apps.bench._workers import WorkerError
    from turnpoint.apps.bench._workload import WorkloadError
    from turnpoint.errors import TurnpointError
    from turnpoint.trainer.errors import CoordinatorError

    failures = (
        BaselineError,
        CoordinatorError,
        TurnpointError,
        WorkerError,
        WorkloadError,
        TimeoutError,
        OSError,
    )

    async def cancellable() -> BenchReport | ControlPathReport | RealStateReport:
        # SIGTERM cancels the run like Ctrl-C does, so that every worker and trainer
        # process is stopped on the way out instead of being orphaned.
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            if args.control_path_only:
                return await run_control_path(options, _progress)
            if args.real_state_only:
                return await run_real_state(options, _progress)
            return await run_bench(options, _progress)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        measured = asyncio.run(cancellable())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("turnpoint bench: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    except failures as error:
        # A timeout carries no text; the progress lines above say which step it ended.
        detail = str(error) or "a bounded wait ran out"
        print(f"turnpoint bench: {type(error).__name__}: {detail}", file=sys.stderr)
        return 1
    if isinstance(measured, ControlPathReport):
        return _control_path_output(measured, json_output=args.json, check=args.check)
    if isinstance(measured, RealStateReport):
        return _real_state_output(measured, json_output=args.json, check=args.check)
    report = measured
    # The full run also measures long generations with and without token-prefix cutting
    # (docs/spec.md section 5.5); --quick leaves it to --long-generations.
    long_generations: dict[str, Any] | None = None
    long_text = ""
    if not args.quick:
        from turnpoint.apps.bench._long_generations import (
            long_generations_failed,
            long_generations_section,
        )

        try:
            long_generations, long_text = long_generations_section(args)
        except (TimeoutError, OSError) as error:
            print(f"turnpoint bench: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    # The full run also measures healing in place against a job restart (issue 24);
    # --quick leaves it to ``turnpoint bench-heal``.
    heal: dict[str, Any] | None = None
    heal_text = ""
    if not args.quick:
        from turnpoint.apps.bench._heal_bench import heal_in_place_section
        from turnpoint.apps.bench._heal_fleet import HealBenchError

        try:
            heal, heal_text = heal_in_place_section(args, _progress)
        except (HealBenchError, TimeoutError, OSError, ValueError) as error:
            print(f"turnpoint bench: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    if args.json:
        figures = report.to_json()
        if long_generations is not None:
            figures["long_generations"] = long_generations
        # None under --quick: every figure is in the JSON, measured or not.
        figures["heal_in_place"] = heal
        print(json.dumps(figures, indent=2))
    else:
        render_table(report, sys.stdout)
        if long_text:
            print(long_text)
        if heal_text:
            print(heal_text)
    regressions = report.regressions()
    if long_generations is not None and long_generations_failed(long_generations):
        regressions.append("long generations: with cutting, admission-closed grows with length")
    if heal is not None and heal["regressed"]:
        regressions.append("heal in place: turns recomputed heal / restart")
    if args.check and regressions:
        print(
            "turnpoint bench: past the must-have by 1.5x: " + ", ".join(regressions),
            file=sys.stderr,
        )
        return 1
    return 0


def _control_path_output(report: ControlPathReport, *, json_output: bool, check: bool) -> int:
    return _one_figure_output(
        report,
        lambda: _overhead_table(
            report.rows, report.workers, report.control_root, report.control_on_tmpfs
        ),
        json_output=json_output,
        check=check,
    )


def _real_state_output(report: RealStateReport, *, json_output: bool, check: bool) -> int:
    return _one_figure_output(
        report, lambda: _real_state_table(report.rows), json_output=json_output, check=check
    )


def _one_figure_output(
    report: ControlPathReport | RealStateReport,
    table: Callable[[], Table],
    *,
    json_output: bool,
    check: bool,
) -> int:
    """What a ``--*-only`` run prints: its JSON, or its table and targets; 1 when
    ``check`` and a figure is past its must-have by 1.5x."""
    if json_output:
        print(json.dumps(report.to_json(), indent=2))
    else:
        console = Console(file=sys.stdout, highlight=False, width=_width(sys.stdout))
        console.print(table())
        console.print(_targets_table(report.targets()))
    regressions = report.regressions()
    if check and regressions:
        print(
            "turnpoint bench: past the must-have by 1.5x: " + ", ".join(regressions),
            file=sys.stderr,
        )
        return 1
    return 0


def _ms(value: float) -> str:
    return f"{value:.1f}"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _width(out: TextIO) -> int | None:
    # A file or a pipe gets room for every column instead of rich's default 80.
    return None if out.isatty() else _FILE_WIDTH


def _overhead_table(
    rows: Sequence[OverheadRow], workers: int, control_root: str, on_tmpfs: bool
) -> Table:
    from turnpoint.apps.bench._control_overhead import PHASES

    where = "tmpfs" if on_tmpfs else "NOT tmpfs"
    overhead = Table(
        title=f"Control path of one snapshot, median ms ({workers} worker process(es), "
        f"the same server layout for every path; snapshot roots under {control_root}, "
        f"{where})",
        title_justify="left",
    )
    columns = (
        "participants",
        "turnpoint",
        "bidi floor",
        "ratio",
        "HTTP+JSON",
        "vs HTTP",
        "every Commit sent",
    )
    for column in (
        *columns,
        *PHASES,
        "CPU vs floor's",
        "least ratio its CPU allows on these cores",
        "thread hop us",
        "rounds",
    ):
        overhead.add_column(column, justify="right")
    for row in rows:
        overhead.add_row(
            str(row.participants),
            _ms(row.overhead_ms),
            _ms(row.lower_bound_ms),
            f"{row.ratio:.2f}x",
            _ms(row.http_json_ms),
            f"{row.ratio_vs_http_json:.2f}x",
            "n/a" if row.with_commit_ms is None else _ms(row.with_commit_ms),
            *(_ms(row.phases_ms.get(phase, 0.0)) for phase in PHASES),
            "n/a" if (per_floor := row.cpu_vs_floor_cpu) is None else f"{per_floor:.2f}x",
            "n/a" if (least := row.least_ratio_cpu_allows) is None else f"{least:.2f}x",
            "n/a" if row.thread_hop_us is None else f"{row.thread_hop_us:.0f}",
            str(row.rounds),
        )
    return overhead


def _targets_table(measured: Sequence[Target]) -> Table:
    targets = Table(title="Targets (must-have, aim)", title_justify="left")
    for column in ("figure", "value", "must", "aim", "met"):
        targets.add_column(column, justify="left" if column == "figure" else "right")
    for target in measured:
        shown = target.to_json()
        met = {True: "yes", False: "no", None: "n/a"}[shown["met_must"]]
        if shown["regressed"] and target.gated:
            met = "REGRESSED"
        targets.add_row(
            target.name,
            "n/a" if target.value is None else f"{target.value:.3f}",
            f"{'>=' if target.higher_is_better else '<='} {target.must:g}",
            "" if target.aim is None else f"{target.aim:g}",
            met,
        )
    return targets


def _real_state_table(rows: Sequence[RealStateRow]) -> Table:
    real = Table(
        title="Snapshots carrying real state on disk vs the physical floor (the same "
        "files and bytes, one fsync per file and directory), medians",
        title_justify="left",
    )
    for column in (
        "participants x episodes x bytes",
        "MB",
        "snapshot ms",
        "floor ms",
        "ratio",
        "us/episode beyond",
        "CPU us/episode (participants + coordinator)",
        "CPU vs floor's",
        "least ratio its CPU allows on these cores",
        "fsyncs",
        "files+dirs",
    ):
        real.add_column(column, justify="right")
    shown = [(row.case.label, row) for row in rows]
    for row in rows:
        if row.turned is not None:
            shown.append((f"{row.case.label}, each a new turn", row.turned))
    for label, case in shown:
        tree = case.commit.tree
        real.add_row(
            label,
            "n/a" if tree is None else f"{tree.bytes / (1 << 20):.1f}",
            f"{case.snapshot_s * 1000:.1f}",
            f"{case.floor_median_s * 1000:.1f}",
            f"{case.ratio:.2f}x",
            f"{case.beyond_floor_us_per_episode:.1f}",
            "n/a"
            if (cpu := case.cpu_us_per_episode) is None
            else f"{cpu['participants']:.1f} + {cpu['coordinator']:.1f}",
            "n/a" if (per_floor := case.cpu_vs_floor_cpu) is None else f"{per_floor:.1f}x",
            "n/a" if (least := case.least_ratio_cpu_allows) is None else f"{least:.2f}x",
            f"{case.commit.durable_fsyncs:.1f}",
            "n/a" if tree is None else str(tree.durable_items),
        )
    return real


def render_table(report: BenchReport, out: TextIO) -> None:
    """The figures as rich tables (plain text when ``out`` is not a terminal)."""
    from turnpoint.apps.bench._control_overhead import PHASES

    console = Console(file=out, highlight=False, width=_width(out))
    console.print(
        _overhead_table(
            report.control_overhead, report.workers, report.control_root, report.control_on_tmpfs
        )
    )

    durable = report.durable
    if durable is not None:
        commit = Table(
            title=f"Durable commit on disk ({durable.root}), {durable.participants} "
            f"participants, median of {durable.rounds}",
            title_justify="left",
        )
        commit.add_column("figure")
        commit.add_column("value", justify="right")
        commit.add_row("snapshot ms (all phases)", _ms(durable.total_ms))
        for phase in PHASES:
            commit.add_row(f"  {phase} ms", _ms(durable.phases_ms.get(phase, 0.0)))
        commit.add_row("fsyncs per snapshot, participants", f"{durable.participant_fsyncs:.1f}")
        commit.add_row(
            "fsyncs per snapshot, coordinator publishing", f"{durable.publish_fsyncs:.1f}"
        )
        commit.add_row(
            "fsyncs per snapshot, coordinator retention and cleanup",
            f"{durable.other_coordinator_fsyncs:.1f}",
        )
        console.print(commit)

    if report.real_state:
        console.print(_real_state_table(report.real_state))

    scale = report.scale
    if scale is not None and scale.rows:
        grown = Table(
            title="The trainer's books, manifest and snapshot as episodes in flight grow",
            title_justify="left",
        )
        for column in (
            "episodes",
            "books B/episode",
            "cut peak B/episode",
            "manifest B/episode",
            "snapshot ms",
            "us/episode",
        ):
            grown.add_column(column, justify="right")
        for size in scale.rows:
            shown = size.to_json()
            grown.add_row(
                str(size.episodes),
                f"{shown['coordinator_bytes_per_episode']:.0f}",
                f"{shown['cut_peak_bytes_per_episode']:.0f}",
                f"{shown['manifest_bytes_per_episode']:.0f}",
                f"{size.snapshot_median_s * 1000:.1f}",
                f"{shown['snapshot_us_per_episode']:.1f}",
            )
        console.print(grown)
        summary = scale.to_json()
        console.print(
            f"Snapshot time slope {summary['snapshot_s_slope_us_per_episode']} us per episode "
            f"(least squares), per-episode cost largest / smallest "
            f"{summary['snapshot_per_episode_growth']}; books "
            f"{summary['memory_slope_bytes_per_episode']} B per episode"
        )

    throughput = report.throughput
    if throughput.block_steps is not None:
        title = (
            f"Demo trainer, one run of {throughput.steps} steps: {len(throughput.off)} pair(s) "
            f"of blocks of {throughput.block_steps} steps, one without snapshots and one with"
        )
    else:
        title = (
            f"Demo trainer, {throughput.steps} steps per run, {len(throughput.off)} run(s) "
            f"without snapshots and {len(throughput.on)} with"
            + (" (the crashed run)" if any(run.crashed for run in throughput.on) else "")
        )
    workload = Table(title=title, title_justify="left")
    workload.add_column("figure")
    workload.add_column("value", justify="right")
    workload.add_row(
        "rollouts/s, no snapshots",
        f"{throughput.per_second_off:.1f}" if throughput.off else "n/a (no run without)",
    )
    workload.add_row(
        f"rollouts/s, a snapshot every {throughput.snapshot_interval_s:g} s",
        f"{throughput.per_second_on:.1f}",
    )
    ratio = throughput.ratio
    details = throughput.to_json()
    spread = details["ratio_on_vs_off_spread"]
    workload.add_row(
        "throughput on / off (median of the pairs' ratios)",
        "n/a" if ratio is None else f"{ratio:.3f}",
    )
    if spread is not None:
        workload.add_row("  spread (lowest, highest)", f"{spread[0]:.3f}, {spread[1]:.3f}")
    interval = throughput.interval
    if interval is not None:
        workload.add_row(
            f"  ratio of means, bootstrap {interval.confidence:.0%} interval over pairs",
            f"{interval.ratio:.3f} [{interval.low:.3f}, {interval.high:.3f}]",
        )
    closed = throughput.closed_fraction
    workload.add_row(
        "rollout-seconds with dispatch closed by snapshots"
        + (" (the crashed run)" if details["closed_measured_on_crash_run"] else ""),
        "n/a" if closed is None else f"{closed:.2%}",
    )
    workload.add_row(
        "snapshots per "
        + ("block" if throughput.block_steps is not None else "run")
        + " with snapshots on",
        " ".join(str(n) for n in details["snapshots_per_run"]),
    )
    workload.add_row(
        "snapshots published / failed",
        f"{details['snapshots_published']} / {details['snapshots_failed']}",
    )
    workload.add_row("snapshot median s (all phases)", _s(details["snapshot_median_s"]))
    workload.add_row("admission closed median s", _s(details["admission_closed_median_s"]))
    workload.add_row("admission closed p99 s", _s(details["admission_closed_p99_s"]))
    bookkeeping = report.bookkeeping_us
    workload.add_row(
        "SDK bookkeeping us per episode",
        "n/a" if bookkeeping is None else f"{bookkeeping:.1f}",
    )
    repeats = report.bookkeeping_repeats_us
    if len(repeats) > 1:
        workload.add_row(
            f"  spread over {len(repeats)} repeats (lowest, highest)",
            f"{min(repeats):.1f}, {max(repeats):.1f}",
        )
    by_cpu = (
        bookkeeping_by_cpu(repeats, report.bookkeeping_cpus)
        if len(report.bookkeeping_cpus) == len(repeats)
        else {}
    )
    if len(by_cpu) > 1:
        workload.add_row(
            "  median of the repeats pinned to each CPU",
            ", ".join(f"CPU {cpu}: {value:.1f}" for cpu, value in by_cpu.items()),
        )
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
    warm = report.trainer_restart
    if warm is not None:
        workload.add_row(
            "trainer restart s (new trainer to first redispatched rollout, participants kept)",
            _s(warm.seconds),
        )
        if warm.seconds is None:
            workload.add_row("  not measured", warm.note)
        else:
            workload.add_row(
                "  restore into the running participants s (rounds)",
                f"{_s(warm.restore_s)} ({warm.rounds})",
            )
            workload.add_row(
                "  then first progress of a redispatched rollout s", _s(warm.first_progress_s)
            )
            workload.add_row("  episodes resumed / rerun", f"{warm.resumed} / {warm.rerun}")
            ratio = report.trainer_restart_vs_cold_start
            workload.add_row(
                "  vs the cold start of the same crash", "n/a" if ratio is None else f"{ratio:.3f}"
            )
    polling = report.status_polling
    if polling is not None:
        workload.add_row(
            f"status API polled every 100 ms / quiet, N={polling.participants}",
            f"{polling.ratio:.3f} ({polling.polled_ms:.1f} / {polling.quiet_ms:.1f} ms)",
        )
    console.print(workload)

    if report.sandbox_snapshots:
        sandboxes = Table(
            title="Sandbox snapshots (local provider, incompressible files): first vs "
            "unchanged since",
            title_justify="left",
        )
        for column in (
            "MB",
            "full s",
            "full MB written",
            "unchanged s",
            "unchanged bytes",
            "time ratio",
            "restore s",
            "restore / full",
        ):
            sandboxes.add_column(column, justify="right")
        for sandbox in report.sandbox_snapshots:
            sandboxes.add_row(
                str(sandbox.megabytes),
                f"{sandbox.full_s:.3f}",
                f"{sandbox.full_bytes_written / (1 << 20):.1f}",
                f"{sandbox.unchanged_s:.3f}",
                str(sandbox.unchanged_bytes_written),
                f"{sandbox.time_ratio:.3f}",
                f"{sandbox.restore_s:.3f}",
                f"{sandbox.restore_ratio:.3f}",
            )
        console.print(sandboxes)

    busy = report.sandbox_admission
    if busy is not None:
        console.print(
            f"Busy sandboxes: admission closed {busy.busy_median_s:.3f} s per snapshot of "
            f"{busy.sandboxes} sandboxes each running a command (cut) vs "
            f"{busy.idle_median_s:.3f} s idle, ratio {busy.ratio:.3f} (medians of "
            f"{len(busy.busy_s)} each)"
        )

    relay = report.egress_relay
    if relay is not None:
        hop = relay.overhead
        console.print(
            f"Egress relay: a chat call {hop.relayed_ms:.2f} ms relayed vs "
            f"{hop.direct_ms:.2f} ms direct (median of {hop.calls} each way), "
            f"ratio {hop.ratio:.3f}"
        )
        replays = Table(
            title="Restore by replay (answered from the record) vs the live run",
            title_justify="left",
        )
        for column in ("turns", "live s", "replay s", "ratio", "state bytes"):
            replays.add_column(column, justify="right")
        for replay in relay.replay:
            replays.add_row(
                str(replay.turns),
                f"{replay.live_s:.3f}",
                f"{replay.replay_s:.4f}",
                f"{replay.ratio:.3f}",
                str(replay.state_bytes),
            )
        console.print(replays)

    console.print(_targets_table(report.targets()))
