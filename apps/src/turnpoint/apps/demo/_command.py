"""``turnpoint demo``: its options on the command line, and the command that runs the job
with the process launcher or, with ``--ray``, the Ray launcher (:mod:`._ray`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.machinery
import importlib.util
import socket
import sys

from rich.console import Console

from turnpoint.apps.demo._report import (
    DemoError,
)
from turnpoint.apps.demo._supervisor import (
    CRASH_POINTS,
    DEFAULT_AGENTS,
    DEFAULT_GROUP_SIZE,
    DEFAULT_GROUPS_PER_STEP,
    DEFAULT_OUT,
    DEFAULT_SNAPSHOT_INTERVAL_S,
    DEFAULT_STEPS,
    FIRST_RESTART_PAUSE_S,
    LEVELS,
    MAX_RESTARTS,
    STALL_TIMEOUT_S,
    START_TIMEOUT_S,
    STORAGE_KINDS,
    TRAINER_MODULE,
    DemoOptions,
    DemoPaths,
    Launcher,
    ProcessLauncher,
    prepare_out_dir,
    run_demo,
)


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "demo",
        help="run the main job: a real training run through an injected crash, then an audit",
        description=(
            "Start the example participants (policy, tools, group-tools, agents) as separate "
            "servers, train through the loss of one agent (replaced in place) and then a crash "
            "of the trainer, restore from the latest snapshot and audit that every prompt group was trained exactly once "
            "with the rewards the verifiers returned. Exits 1 if the audit fails."
        ),
    )
    parser.add_argument(
        "--env",
        default="guess",
        choices=["guess", "blackjack", "workplace", "coding"],
        help="the environment to train on: the guessing game (per-sibling and group-scored "
        "tools), Blackjack on a seeded shoe, the workplace on per-episode SQLite tables, or "
        "coding in per-episode sandboxes (default: %(default)s)",
    )
    parser.add_argument(
        "--agent",
        default="gym",
        choices=["gym", "opaque"],
        help="the agents: the example agents written against the SDK (gym), or the example "
        "ReAct harness (Node, plain fetch) run by an opaque agent behind the egress relay, "
        "its model calls through the policy's OpenAI endpoint and its tool through the "
        "relay (opaque; docs/spec.md section 12) (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--agents", type=int, default=DEFAULT_AGENTS, help="agent servers (default: %(default)s)"
    )
    parser.add_argument(
        "--agent-workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes per agent server, sharing its port; each worker is an agent "
        "of its own, found through the server's Describe (default: %(default)s)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        help="sibling rollouts per prompt (default: %(default)s)",
    )
    parser.add_argument(
        "--groups-per-step",
        type=int,
        default=DEFAULT_GROUPS_PER_STEP,
        help="prompt groups per training step (default: %(default)s)",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=float,
        default=DEFAULT_SNAPSHOT_INTERVAL_S,
        metavar="SECONDS",
        help="period of the snapshot pump (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help=(
            "the trainer's status page, its REST API (docs/spec.md section 7.13) and the "
            "coordinator's Prometheus metrics (section 7.10) on 127.0.0.1:PORT; 0 (the "
            "default) picks a free port, kept across restarts"
        ),
    )
    parser.add_argument(
        "--turn-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help=(
            "simulated latency of every agent turn, as a real model call has; longer "
            "episodes mean more of them are cut mid-way by each snapshot (default: 0)"
        ),
    )
    parser.add_argument(
        "--token-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help=(
            "long generations: the policy's simulated time per token; without "
            "--cut-generations every snapshot waits for the generations in flight (default: 0)"
        ),
    )
    parser.add_argument(
        "--cut-generations",
        action="store_true",
        help=(
            "agents let the policy cut generations at a snapshot and continue them from "
            "their token prefix (docs/spec.md section 5.5; pair with --target-level token)"
        ),
    )
    parser.add_argument(
        "--crash",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kill one agent mid-run (the trainer replaces it in place), then the trainer "
        "(the job restarts)",
    )
    parser.add_argument(
        "--crash-at",
        metavar="POINT[:N][,POINT[:N]...]",
        help=(
            "crash at a named point of a snapshot instead of mid-run: the trainer kills "
            "itself at POINT of its N-th snapshot, counting only snapshots that cut rollouts "
            "in flight (N defaults to 1); a comma-separated sequence kills one trainer after "
            "another, the k-th at the k-th entry, each counting its own snapshots; POINT is "
            f"one of {', '.join(CRASH_POINTS)}"
        ),
    )
    parser.add_argument(
        "--target-level",
        default="turn",
        metavar="LEVEL",
        help=f"finest recovery level wanted: {', '.join(LEVELS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help="output directory (wiped at start; default: %(default)s)"
    )
    parser.add_argument(
        "--storage",
        choices=STORAGE_KINDS,
        default="local",
        help="where snapshots go: local (<out>/snapshots) or s3 (an S3 server started on "
        "loopback, moto's; docs/spec.md section 8.12) (default: %(default)s)",
    )
    parser.add_argument("--ray", action="store_true", help="run every participant as a Ray actor")
    parser.add_argument(
        "--ray-address", metavar="ADDRESS", help="join this Ray cluster (implies --ray)"
    )
    parser.add_argument(
        "--ray-nodes",
        type=int,
        metavar="N",
        help="start a Ray cluster of a head and N-1 more nodes on this machine and spread "
        "the participants over them (implies --ray)",
    )
    parser.add_argument(
        "--lose-node",
        action="store_true",
        help="with --ray-nodes: instead of the crash, remove the node hosting an agent "
        "mid-run; the job restores from the last published snapshot onto the other nodes",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the policy and the data (default: %(default)s)"
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="plain progress lines instead of the live display",
    )
    parser.add_argument(
        "--hold-tools-after-restart",
        metavar="FILE",
        help=(
            "for tests: after the job restart, the tools server holds every tool call until "
            "FILE exists, so the restored trainer's snapshots wait in prepare and the status "
            "page shows the blocker"
        ),
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=START_TIMEOUT_S,
        metavar="SECONDS",
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        metavar="N",
        help="unplanned recoveries allowed per hour, and heals per participant: a "
        "participant that dies or is paused is replaced in place, a trainer that dies or "
        "stalls restarts alone into the running participants, and only what cannot heal "
        "restores the whole job from the last published snapshot onto fresh processes "
        f"(default: {MAX_RESTARTS})",
    )
    parser.add_argument(
        # For tests that inject many faults: the backoff's first pause (it doubles with
        # each restart), so that five restarts do not sleep for fifteen seconds.
        "--restart-pause",
        type=float,
        default=FIRST_RESTART_PAUSE_S,
        metavar="SECONDS",
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--participant-command",
        action="append",
        default=[],
        metavar="INSTANCE=COMMAND",
        help="run INSTANCE (tools, group-tools, policy, agent-N) with COMMAND instead of "
        "'turnpoint serve': any program that takes its arguments (the two tokens come as "
        "--token-file and --data-token-file) and prints its serving line, e.g. tools='node ts/dist/examples/guess-resources.js' (repeatable)",
    )
    parser.add_argument(
        "--chaos",
        type=int,
        default=0,
        metavar="N",
        help="inject N unplanned faults at random times (SIGKILL or SIGSTOP of any process, "
        "trainer included); the run recovers from each and the audit checks nothing was "
        "lost or trained twice (needs --max-restarts N or more)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=STALL_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a trainer silent this long is stuck or paused (default: {STALL_TIMEOUT_S:g})",
    )
    parser.set_defaults(handler=demo_command)


def _trainer_installed() -> bool:
    # find_spec(TRAINER_MODULE) would import the trainer package, and with it torch:
    # seconds for every run. Looking the module up on the package's path imports nothing.
    package = TRAINER_MODULE.rpartition(".")[0]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        return False
    locations = list(spec.submodule_search_locations)
    return importlib.machinery.PathFinder.find_spec(TRAINER_MODULE, locations) is not None


def demo_command(args: argparse.Namespace) -> int:
    try:
        options = DemoOptions.from_args(args)
    except DemoError as error:
        print(f"turnpoint demo: {error}", file=sys.stderr)
        return 2
    problems = options.problems()
    if problems:
        for problem in problems:
            print(f"turnpoint demo: {problem}", file=sys.stderr)
        return 2
    if not _trainer_installed():
        print(
            f"turnpoint demo: the trainer module {TRAINER_MODULE} is not installed",
            file=sys.stderr,
        )
        return 1
    console = Console()
    with contextlib.ExitStack() as stack:
        if options.metrics_port is not None:
            try:
                options, reserved = _with_metrics_port(options, console)
            except OSError as error:
                print(
                    f"turnpoint demo: cannot hold the status port {options.metrics_port}: "
                    f"{error.strerror}",
                    file=sys.stderr,
                )
                return 1
            stack.callback(reserved.close)
        store = None
        if options.storage == "s3":
            from turnpoint.apps._object_store import loopback_s3

            # Started before Ray and the event loop, stopped after the run's last step.
            store = stack.enter_context(loopback_s3())
            console.print(
                f"snapshots: {store.url} (moto's S3 server on "
                f"{store.environment['AWS_ENDPOINT_URL_S3']})",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        try:
            paths, token = prepare_out_dir(options.out, store)
        except (DemoError, OSError) as error:
            print(f"turnpoint demo: {error}", file=sys.stderr)
            return 2
        return _run(options, paths, token, console)


def _run(options: DemoOptions, paths: DemoPaths, token: str, console: Console) -> int:
    ray_launcher = None
    if options.ray:
        from turnpoint.apps.demo._ray import RayLauncher

        # ray.init installs handlers and starts processes: do it before the event loop.
        try:
            ray_launcher = RayLauncher(
                paths,
                address=options.ray_address,
                nodes=options.ray_nodes,
                start_timeout_s=options.start_timeout_s,
                servers_on_head=options.lose_node,
            )
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as error:
            where = (
                f"join the Ray cluster at {options.ray_address}"
                if options.ray_address
                else "start Ray"
            )
            print(f"turnpoint demo: cannot {where}: {error}", file=sys.stderr)
            return 1
        launcher: Launcher = ray_launcher
    else:
        launcher = ProcessLauncher(
            paths,
            start_timeout_s=options.start_timeout_s,
            commands=options.participant_commands,
        )
    try:
        return asyncio.run(run_demo(options, paths, token, launcher, console))
    except DemoError as error:
        console.print(
            f"turnpoint demo: FAILED: {error}", markup=False, highlight=False, soft_wrap=True
        )
        console.print(f"logs: {paths.logs}", markup=False, highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("turnpoint demo: interrupted", markup=False, highlight=False, soft_wrap=True)
        return 130
    finally:
        if ray_launcher is not None:
            with contextlib.suppress(Exception):
                ray_launcher.shutdown()


def _with_metrics_port(options: DemoOptions, console: Console) -> tuple[DemoOptions, socket.socket]:
    """Fix the status port once (0: a free one), so every trainer restart serves the same
    address, and print the page's and the metrics' addresses (docs/spec.md 7.13).

    The port stays reserved for the whole run: a socket bound with ``SO_REUSEPORT`` that
    never listens (the caller closes it at the end). Each trainer binds it the same way
    (``status_reuse_port``), and no other process (a participant started meanwhile on a
    free port) can take it between two trainers: a port only probed and closed could be
    taken, and the next trainer died on it."""
    import dataclasses

    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind(("127.0.0.1", options.metrics_port or 0))
    except OSError:
        reserved.close()
        raise
    port = int(reserved.getsockname()[1])
    console.print(
        f"status page: http://127.0.0.1:{port}/ (snapshots, participants, restore points); "
        f"metrics: http://127.0.0.1:{port}/metrics",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return dataclasses.replace(options, metrics_port=port), reserved
