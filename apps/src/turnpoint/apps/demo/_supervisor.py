"""``turnpoint demo``: a real training run across separate server processes, through a crash.

What runs. Every participant is its own ``turnpoint serve`` process on 127.0.0.1 with an
OS-picked port (or, with ``--ray``, a Ray actor hosting its own gRPC server, see
:mod:`turnpoint.apps.demo._ray`): the policy model server ``policy``, the resources
servers ``tools`` (environment ``guess``, a per-sibling verifier) and ``group-tools``
(``guess-group``, group-scored), and agents ``agent-0`` .. ``agent-{N-1}`` that serve both
environments. They run on two bearer tokens, fresh each run, mode 0600 (docs/spec.md
section 10.2): the control token ``<out>/token``, the trainer's (and the supervisor's),
and the data-plane token ``<out>/data-token``, the one every participant's own calls out
use (an agent's to its policy and resources; the OpenAI endpoint's API key, so the
opaque agents' relay too). A participant gets, by file, the data-plane token and only
the control token's SHA-256 ``<out>/token.sha256`` (``--control-token-digest-file``,
``--data-token-file``), to check the coordinator's calls: no participant, nor a harness
it runs, holds or can read a credential that reaches a control plane (section 10.2
item 7). They share one snapshot root
``<out>/snapshots`` (with ``--storage s3``: ``s3://<bucket>/snapshots`` on moto's S3
server, which the supervisor runs on loopback in its own process; the children get its
endpoint and dummy credentials in boto3's environment variables, and every other file of
the run stays in ``<out>``); each verifier appends the rewards it returns to
``<out>/verifier-<instance>.jsonl``. The supervisor writes ``<out>/topology.json``::

    {"token_file": "<out>/token", "snapshot_root": "<out>/snapshots",
     "participants": [{"instance": "policy", "kind": "model", "address": "127.0.0.1:PORT",
                       "environment": null}, ...]}

(``environment`` is set for resources servers, null for the policy and the agents, which
serve every environment), then starts the trainer (:func:`trainer_command`)::

    python -m turnpoint.apps.demo._trainer --topology <out>/topology.json --out <out>
        --steps N --group-size N --groups-per-step N --snapshot-interval S
        --target-level LEVEL --seed N --start-on-stdin [--resume] [--kill-at POINT[:N]]
        [--launcher HOST:PORT]

The trainer process is spawned before the participants start (after a crash, before the
old ones are stopped), and imports torch and the facade meanwhile: most of a start is
imports, on both sides, and they overlap. A trainer whose crash is planned (it has a
``--crash-at`` entry) gets its successor spawned as soon as it is released: the
successor imports while it runs, and the restart after the kill costs the restore
alone. With ``--start-on-stdin`` it reads nothing (no topology, no event log, no port)
until the supervisor writes a line to its stdin, once ``topology.json`` is written; that
is when the trainer starts. A trainer whose participants never came up is killed unreleased and
its empty logs removed: no trainer ran.

With ``--turn-delay SECONDS`` every agent turn waits that long inside its model call,
parked at its boundary, as a real model's latency would make it: episodes then last long
enough that every snapshot cuts some of them mid-way (the end-to-end tests rely on it).

The trainer appends its events to ``<out>/events.jsonl`` (the contract is in
:mod:`turnpoint.apps.demo._report`); it numbers its incarnation itself (one more than
the ``start`` events already in the log). Its stdout and stderr go to
``<out>/logs/trainer.<incarnation>.{stdout,stderr}``.

Healing in place (docs/spec.md section 7.15). The supervisor owns every participant
process, and it is the trainer's launcher: it serves replacement requests on loopback
(:mod:`turnpoint.apps.demo._heal`; the trainer gets ``--launcher HOST:PORT``). When the
trainer's liveness watch finds a participant lost, it asks for a replacement: the
supervisor SIGKILLs what is left of it, starts it again with the same spec under the
same name, rewrites ``topology.json``, records ``replaced`` and answers the new address;
the trainer restores onto it (and onto the live participants) only what depended on it
and logs ``heal``. The policy's and the resources servers' addresses are wired into
every agent, so their replacements bind their predecessors' ports (the policy's OpenAI
endpoint too), and a replaced policy takes no generation before the trainer's weights
reach it (``--await-weights``); a port taken meanwhile fails the heal, and the job
restarts as below. A dead participant the trainer does not ask about within
:data:`HEAL_GRACE_S` restarts the job too. Not with ``--ray`` (the
cluster places its actors), ``--participant-command`` (such participants may not serve
RestoreRunning) or ``--hold-tools-after-restart`` (see below).

The crash. It lands in windows the first trainer finds and holds
(:mod:`turnpoint.apps.demo._fault_window`: it logs ``fault_window`` and stops until the
supervisor writes ``go`` on its stdin). At the first (a published snapshot of the first
trainer cut rollouts in flight, rollouts are in flight, 40% of the steps done or more)
the supervisor SIGKILLs one agent (``agent_lost``); at the second (the trainer replaced
it in place and trained a step since) it SIGKILLs the trainer and records ``crash`` in
``<out>/supervisor.jsonl``. The recovery
is a *trainer restart*: every participant keeps running, the trainer starts again with
``--resume`` and restores ``LATEST`` into them where they run (RestoreRunning,
docs/spec.md section 4.16; its epoch fences the dead one, whatever that left on them is
stopped, and a saved rollout it finished or retried since is continued or rerun above
what they saw, section 7.7 item 7), then finishes the run (``restart`` is recorded with
``participants_restarted`` 0). An unplanned recovery (a trainer that died, stalled or
crashed, every participant still running and none paused) is a trainer restart too; a
trainer restarted alone that fails before its first step restarts the job.

Where the participants cannot all be restored in place (``DemoOptions.restart_trainer_alone``
is false: Ray places its own actors, and ``--hold-tools-after-restart`` needs a freshly
started tools server), and after a
participant's loss that healing in place does not cover, the recovery is a *job
restart*: the planned crash kills the trainer and one agent at once, the survivors get
SIGTERM (a graceful drain) and a new set comes up under the same instance names on new
ports; ``topology.json`` is rewritten and the trainer starts again with ``--resume``,
restores ``LATEST`` onto the fresh participants and finishes the run (``restart`` is
recorded with ``participants_restarted``, every one of them).

A crash at a named point. ``--crash-at POINT[:N]`` replaces the timed crash with a
deterministic one: the first trainer gets ``--kill-at POINT[:N]`` and SIGKILLs itself at
that point of a snapshot (:mod:`turnpoint.apps.demo._kill_switch`, test-only fault
injection; it first appends a ``kill`` event naming the point and the checkpoint to
``events.jsonl``). The supervisor takes that trainer's SIGKILL exit as the injected
crash: it records ``crash`` with the point and restarts the trainer alone, or, where
it cannot, SIGKILLs one agent at that moment and restarts the job, exactly as above. A
trainer that dies of SIGKILL without its ``kill`` event fails the demo like any other
trainer failure. A comma-separated sequence ``POINT[:N],POINT[:N],...`` crashes one
incarnation after another: incarnation k gets the k-th entry as its ``--kill-at`` (each
trainer counts N among the snapshots it takes itself, from its own start), and the one
after the last entry runs to the end; one run then covers every point a test names.

A held prepare, for the status page's browser test. ``--hold-tools-after-restart FILE``
starts every participant set after the first with ``tools`` told to hold its tool calls
until FILE exists (``turnpoint serve --hold-calls-until``,
:class:`~turnpoint.apps.examples._participants.FileGate`): the restored trainer's
snapshots wait in prepare for ``tools`` and it cannot end the job until the test creates
FILE (docs/spec.md section 7.13.6).

At the end every participant gets SIGTERM and must exit 0; then the report
(:mod:`turnpoint.apps.demo._report`) prints the statistics and the exactly-once
audit, and :mod:`turnpoint.apps.demo._timeline` draws ``<out>/timeline.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, Protocol

from rich.console import Console
from rich.text import Text

from turnpoint._files import create_file, replace_file
from turnpoint.apps._object_store import ObjectStore, loopback_s3_available
from turnpoint.apps._parent import PARENT_PID_ENV
from turnpoint.apps.chaos._proxy import FaultProxy, ProxyMode
from turnpoint.apps.demo._fault_window import GO
from turnpoint.apps.demo._heal import LaunchService, ReplaceRefused
from turnpoint.apps.demo._progress import (
    EventTail,
    ProgressDisplay,
    ProgressState,
    open_display,
)
from turnpoint.apps.demo._report import (
    DemoError,
    EventLogError,
    build_report,
    load_run,
    render_report,
)
from turnpoint.auth import TOKEN_ENV, TOKEN_FILE_ENV, token_sha256
from turnpoint.trainer.advanced import RestartBudget
from turnpoint.trainer.testing import SnapshotPoint

LEVELS = ("token", "turn", "sibling", "prompt_group")
STORAGE_KINDS = ("local", "s3")
CRASH_POINTS = tuple(point.value for point in SnapshotPoint)
"""The trainer's snapshot points (``--crash-at`` names), in snapshot order."""
TRAINER_MODULE = "turnpoint.apps.demo._trainer"
DEFAULT_SERVE_COMMAND = (sys.executable, "-m", "turnpoint.apps._cli", "serve")
DEFAULT_TRAINER_COMMAND = (sys.executable, "-m", TRAINER_MODULE)
# Every child (trainer, participant) starts in a process group of its own, in the
# supervisor's session: such a group is never orphaned while the supervisor lives, so
# the kernel never wakes a child that --chaos paused (SIGSTOP) when another process
# exits (it sends SIGHUP and SIGCONT to an orphaned group that holds a stopped
# process, and the demo's own group is orphaned when its parent shell exits first).
# A signal to the supervisor's group no longer reaches them: each dies with the
# supervisor instead ($TURNPOINT_PARENT_PID, turnpoint.apps._parent).
CHILD_PROCESS_GROUP: Final = 0

# Calibrated so that the whole run, crash and restart included, takes one to two minutes
# on a 2-core machine: each start of the five participants takes about 15 s (torch
# imports), and the trainer does about three steps of 16 rollouts a second.
DEFAULT_STEPS = 100
DEFAULT_AGENTS = 2
DEFAULT_GROUP_SIZE = 4
DEFAULT_GROUPS_PER_STEP = 4
DEFAULT_SNAPSHOT_INTERVAL_S = 3.0
DEFAULT_OUT = "turnpoint-demo-out"

START_TIMEOUT_S = 120.0
"""Per participant; the first start imports torch, slow while five processes share 2 cores."""
STOP_TIMEOUT_S = 30.0
"""A SIGTERM'd participant drains within its 10 s grace; past this it is killed."""
STALL_TIMEOUT_S = 60.0
"""A trainer that logs nothing for this long is stuck or paused (progress is logged twice
a second); the job is restored onto fresh processes."""
MAX_RESTARTS = 3
"""Unplanned job restarts (a lost participant, a dead or stuck trainer) allowed per hour."""
FIRST_RESTART_PAUSE_S = 0.5
"""The pause before the first unplanned restart; it doubles with each restart in the hour,
so that a job that keeps crashing backs off instead of looping."""
POLL_INTERVAL_S = 0.25
HEAL_GRACE_S = 60.0
"""How long a dead agent waits for the trainer to ask for its replacement (it notices
within its 6 s liveness window) before the supervisor restarts the job instead."""

GUESS = "guess"
GUESS_GROUP = "guess-group"
CODING = "coding"
OPAQUE = "opaque"
# What --env offers: the guessing game, and the exported environments the play agent plays.
ENVIRONMENTS = (GUESS, "blackjack", "workplace", CODING)
OUT_MARKER = ".turnpoint-demo"
_SERVING = re.compile(r"^turnpoint: serving (?P<kind>\S+) (?P<instance>\S+) on (?P<address>\S+)$")
_OPENAI_SERVING = re.compile(r"^turnpoint: openai endpoint (?P<instance>\S+) on (?P<url>\S+)$")
_STDERR_TAIL_LINES = 15
_STDERR_TAIL_BYTES = 8192


# ---------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """The ``turnpoint demo`` flags; :meth:`problems` checks them before anything starts."""

    steps: int = DEFAULT_STEPS
    agents: int = DEFAULT_AGENTS
    # Worker processes per agent server, each its own participant (docs/spec.md 3.9).
    agent_workers: int = 1
    group_size: int = DEFAULT_GROUP_SIZE
    groups_per_step: int = DEFAULT_GROUPS_PER_STEP
    snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S
    turn_delay_s: float = 0.0
    # Long generations (docs/spec.md section 5.5): the policy's time per token, and
    # agents that let the policy cut generations at a snapshot.
    token_delay_s: float = 0.0
    cut_generations: bool = False
    crash: bool = True
    crash_at: str | None = None
    target_level: str = "turn"
    out: Path = Path(DEFAULT_OUT)
    ray: bool = False
    ray_address: str | None = None
    ray_nodes: int | None = None
    lose_node: bool = False
    seed: int = 0
    progress: bool = True
    start_timeout_s: float = START_TIMEOUT_S
    max_restarts: int = MAX_RESTARTS
    first_restart_pause_s: float = FIRST_RESTART_PAUSE_S
    stall_timeout_s: float = STALL_TIMEOUT_S
    chaos_faults: int = 0
    participant_commands: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    chaos_steps: tuple[int, int] = (2, 5)
    metrics_port: int | None = None
    # The environment trained on: the guessing game (tools and group-tools) or one of
    # the exported environments of turnpoint.apps.examples._environments (tools only).
    environment: str = GUESS
    # Where snapshots go: "local" (<out>/snapshots) or "s3" (an S3 server on loopback).
    storage: str = "local"
    # Testing: the restarted job's tools server holds every tool call until this file
    # exists, so the restored trainer's snapshots wait in prepare (the status page's
    # live blocker, tests/e2e/test_status_page.py).
    hold_tools_after_restart: Path | None = None
    # "gym": the example agents written against the SDK; "opaque": the example ReAct
    # harness behind the egress relay and the policy's OpenAI endpoint (spec section 12).
    agent: str = "gym"

    def kill_at(self, incarnation: int) -> str | None:
        """The ``--kill-at`` of trainer ``incarnation``: the ``incarnation``-th entry of
        ``--crash-at``, if it has that many."""
        plan = _crash_plan(self.crash_at)
        return plan[incarnation - 1] if 1 <= incarnation <= len(plan) else None

    def fault_windows(self, incarnation: int) -> int:
        """The ``--fault-windows`` of trainer ``incarnation``: where the timed crash
        lands (:mod:`turnpoint.apps.demo._fault_window`). The first trainer's only: one
        window for a crash or a lost node, two where a lost agent heals in place and the
        trainer's own crash follows."""
        if incarnation != 1 or not self.crash or self.crash_at is not None:
            return 0
        return 2 if self.heal_in_place and not self.lose_node else 1

    @property
    def heal_in_place(self) -> bool:
        """Whether a lost agent is replaced alone (docs/spec.md section 7.15) rather
        than the whole job restarted. On Ray only for ``--lose-node``: the lost node's
        agents are started again on live nodes (the servers stay on the head node, see
        :mod:`turnpoint.apps.demo._ray`); not for agents of several workers (the trainer loses and names one worker; the
        supervisor starts the group), and not when the restarted job's tools must hold
        their calls (that test needs a freshly started tools server). Participants of
        ``--participant-command`` (the TypeScript resources servers) serve RestoreRunning
        as the Python SDK's do."""
        return (
            (not self.ray or self.lose_node)
            and not self.hold_tools_after_restart
            and self.agent_workers == 1
        )

    @property
    def restart_trainer_alone(self) -> bool:
        """Whether a dead or stuck trainer is restarted alone, restoring into the
        participants that kept running (docs/spec.md sections 4.16 and 7.11 item 3),
        rather than with the whole job. Where a lost agent heals in place: every
        participant then serves RestoreRunning (the Python SDK's and the TypeScript
        SDK's), the supervisor owns their processes (on Ray, the cluster does), and the
        restarted trainer needs no freshly started tools server
        (``--hold-tools-after-restart``). Not on Ray: the actors end with the driver's
        job restart."""
        return self.heal_in_place and not self.ray

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoOptions:
        return cls(
            steps=args.steps,
            agents=args.agents,
            agent_workers=getattr(args, "agent_workers", 1),
            group_size=args.group_size,
            groups_per_step=args.groups_per_step,
            snapshot_interval_s=args.snapshot_interval,
            turn_delay_s=args.turn_delay,
            token_delay_s=args.token_delay,
            cut_generations=args.cut_generations,
            crash=args.crash,
            crash_at=args.crash_at,
            target_level=args.target_level,
            out=Path(args.out),
            # An address only makes sense for a Ray run: asking for one is asking for Ray.
            ray=args.ray or args.ray_address is not None or args.ray_nodes is not None,
            ray_address=args.ray_address,
            ray_nodes=args.ray_nodes,
            lose_node=args.lose_node,
            seed=args.seed,
            progress=args.progress,
            start_timeout_s=args.start_timeout,
            max_restarts=args.max_restarts,
            first_restart_pause_s=getattr(args, "restart_pause", FIRST_RESTART_PAUSE_S),
            stall_timeout_s=args.stall_timeout,
            chaos_faults=args.chaos,
            participant_commands=_participant_commands(args.participant_command),
            metrics_port=getattr(args, "metrics_port", None),
            environment=getattr(args, "env", GUESS),
            storage=getattr(args, "storage", "local"),
            hold_tools_after_restart=(
                Path(args.hold_tools_after_restart)
                if getattr(args, "hold_tools_after_restart", None)
                else None
            ),
            agent=getattr(args, "agent", "gym"),
        )

    def problems(self) -> list[str]:
        """Everything wrong with the flags, each saying what to change."""
        problems = []
        if self.steps < 1:
            problems.append(f"--steps must be at least 1, got {self.steps}")
        elif self.crash and self.steps < 2:
            problems.append(
                "--crash needs --steps 2 or more (the crash lands 40-60% into the run, "
                "after a published snapshot): raise --steps or pass --no-crash"
            )
        if self.agents < 1:
            problems.append(f"--agents must be at least 1, got {self.agents}")
        if self.agent == OPAQUE and (
            self.environment != GUESS or self.ray or self.cut_generations or self.agent_workers > 1
        ):
            problems.append(
                "--agent opaque plays the guessing game in local processes: drop --env, "
                "--ray, --cut-generations and --agent-workers"
            )
        if self.agent == OPAQUE and shutil.which("node") is None:
            problems.append(
                "--agent opaque runs its harness with Node 20, and node is not on PATH: "
                "install nodejs (./dev setup does)"
            )
        problems.extend(self._worker_problems())
        if self.group_size < 2:
            problems.append(
                f"--group-size must be at least 2, got {self.group_size}: rewards are "
                "relative to the prompt group, so a group of one teaches nothing"
            )
        if self.groups_per_step < 1:
            problems.append(f"--groups-per-step must be at least 1, got {self.groups_per_step}")
        if not self.snapshot_interval_s > 0:
            problems.append(
                f"--snapshot-interval must be a positive number of seconds, got "
                f"{self.snapshot_interval_s:g}"
            )
        if not self.turn_delay_s >= 0:
            problems.append(
                f"--turn-delay must be zero or a positive number of seconds, got "
                f"{self.turn_delay_s:g}"
            )
        if not self.token_delay_s >= 0:
            problems.append(
                f"--token-delay must be zero or a positive number of seconds, got "
                f"{self.token_delay_s:g}"
            )
        if not self.start_timeout_s > 0:
            problems.append(f"--start-timeout must be positive, got {self.start_timeout_s:g}")
        if self.max_restarts < 0:
            problems.append(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if not self.first_restart_pause_s >= 0:
            problems.append(
                f"--restart-pause must be 0 or more seconds, got {self.first_restart_pause_s:g}"
            )
        if self.chaos_faults < 0:
            problems.append(f"--chaos must be 0 or more faults, got {self.chaos_faults}")
        elif self.chaos_faults and self.ray:
            problems.append("--chaos signals local processes: drop --ray or --chaos")
        elif self.chaos_faults > self.max_restarts:
            problems.append(
                f"--chaos {self.chaos_faults} can lose up to {self.chaos_faults} job "
                f"incarnations: raise --max-restarts to at least {self.chaos_faults}"
            )
        if self.environment not in ENVIRONMENTS:
            problems.append(
                f"unknown --env {self.environment!r}: choose one of {', '.join(ENVIRONMENTS)}"
            )
        tools = ("tools", "group-tools") if self.environment == GUESS else ("tools",)
        known = {"policy", *tools, *(f"agent-{i}" for i in range(self.agents))}
        for instance in sorted(set(self.participant_commands) - known):
            problems.append(
                f"--participant-command names {instance!r}, which is not a participant of "
                f"this run: choose one of {', '.join(sorted(known))}"
            )
        problems.extend(self._ray_problems())
        problems.extend(self._hold_problems())
        if self.participant_commands and self.ray:
            problems.append("--participant-command starts local processes: drop --ray")
        if not self.stall_timeout_s > 0:
            problems.append(f"--stall-timeout must be positive, got {self.stall_timeout_s:g}")
        if self.target_level not in LEVELS:
            # Every level is possible with the demo's environments (each gets the finest
            # level at or below the target it supports), so only the name can be wrong.
            close = difflib.get_close_matches(self.target_level, LEVELS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(
                f"unknown --target-level {self.target_level!r}{hint}: choose one of "
                f"{', '.join(LEVELS)}"
            )
        if self.crash_at is not None:
            problems.extend(_crash_at_problems(self.crash_at, crash=self.crash))
        problems.extend(self._storage_problems())
        problems.extend(_out_dir_problems(self.out))
        return problems

    def _worker_problems(self) -> list[str]:
        if self.agent_workers < 1:
            return [f"--agent-workers must be at least 1, got {self.agent_workers}"]
        if self.agent_workers == 1:
            return []
        problems = []
        if self.ray:
            problems.append("--agent-workers starts local worker processes: drop --ray")
        if self.chaos_faults:
            # The trainer reaches the workers at their own addresses, past the proxies.
            problems.append("--chaos proxies whole endpoints, not workers: drop --agent-workers")
        if self.crash_at is not None:
            problems.append("--crash-at probes whole endpoints, not workers: drop --agent-workers")
        if self.participant_commands:
            problems.append("--participant-command and --agent-workers: drop one")
        return problems

    def _storage_problems(self) -> list[str]:
        if self.storage not in STORAGE_KINDS:
            return [f"unknown --storage {self.storage!r}: choose one of {', '.join(STORAGE_KINDS)}"]
        if self.storage == "local":
            return []
        problems = []
        if not loopback_s3_available():
            problems.append(
                "--storage s3 runs moto's S3 server on loopback: install it "
                "(pip install 'moto[server]'), or drop --storage s3"
            )
        if self.participant_commands:
            problems.append(
                "--participant-command programs write their snapshots to a directory: "
                "drop --storage s3 or --participant-command"
            )
        return problems

    def _hold_problems(self) -> list[str]:
        if self.hold_tools_after_restart is None:
            return []
        if self.environment != GUESS:
            return ["--hold-tools-after-restart holds the guessing game's tools: drop --env"]
        if not self.crash and not self.chaos_faults:
            return ["--hold-tools-after-restart needs a restart: drop --no-crash"]
        if "tools" in self.participant_commands:
            return [
                "--hold-tools-after-restart holds the example tools server: drop "
                "--participant-command tools=..."
            ]
        return []

    def _ray_problems(self) -> list[str]:
        problems = []
        if self.ray_nodes is not None and self.ray_nodes < 1:
            problems.append(f"--ray-nodes must be at least 1, got {self.ray_nodes}")
        if self.ray_nodes is not None and self.ray_address is not None:
            problems.append("--ray-nodes starts a cluster, --ray-address joins one: drop one")
        if self.lose_node and (self.ray_nodes is None or self.ray_nodes < 2):
            problems.append(
                "--lose-node removes a node of the cluster the demo starts: pass "
                "--ray-nodes 2 or more (the head is never removed)"
            )
        elif self.lose_node and (not self.crash or self.crash_at is not None):
            problems.append("--lose-node replaces the timed crash: drop --no-crash and --crash-at")
        return problems


def _participant_commands(values: Sequence[str]) -> dict[str, tuple[str, ...]]:
    commands: dict[str, tuple[str, ...]] = {}
    for value in values:
        instance, sep, command = value.partition("=")
        words = tuple(shlex.split(command))
        if not sep or not instance or not words:
            raise DemoError(f"--participant-command takes INSTANCE=COMMAND, got {value!r}")
        commands[instance] = words
    return commands


def _crash_plan(text: str | None) -> tuple[str, ...]:
    """``--crash-at``'s entries, one per trainer incarnation, in order."""
    return tuple(entry.strip() for entry in text.split(",")) if text is not None else ()


def _crash_at_problems(text: str, *, crash: bool) -> list[str]:
    if not crash:
        return ["--crash-at injects the crash, --no-crash turns it off: drop one of them"]
    plan = _crash_plan(text)
    problems = []
    for position, entry in enumerate(plan, start=1):
        # A sequence names the entry at fault; a single point reads as it always did.
        where = f" (entry {position} of {len(plan)})" if len(plan) > 1 else ""
        problem = _crash_entry_problem(entry)
        if problem is not None:
            problems.append(problem + where)
    return problems


def _crash_entry_problem(entry: str) -> str | None:
    if not entry:
        return "--crash-at has an empty entry: write POINT[:N] between the commas"
    name, sep, number = entry.partition(":")
    if name not in CRASH_POINTS:
        close = difflib.get_close_matches(name, CRASH_POINTS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"unknown --crash-at point {name!r}{hint}: choose one of {', '.join(CRASH_POINTS)}"
    if sep and (re.fullmatch(r"[0-9]+", number) is None or int(number) < 1):
        return (
            f"--crash-at {entry}: N in POINT:N counts snapshots and must be a whole number "
            f">= 1, got {number!r}"
        )
    return None


def _out_dir_problems(out: Path) -> list[str]:
    if not out.exists():
        return []
    if not out.is_dir():
        return [f"--out {out} is a file: choose a directory"]
    if (out / OUT_MARKER).exists() or not any(out.iterdir()):
        return []
    # The directory is wiped at start; never wipe one the demo did not make.
    return [
        f"--out {out} is not empty and was not made by turnpoint demo: choose another "
        "--out or remove it"
    ]


@dataclass(frozen=True)
class DemoPaths:
    """Where a run keeps its files; ``out`` is absolute (participants may run elsewhere).

    ``store``: the object store the snapshots go to instead of ``<out>/snapshots``
    (``--storage s3``); every other file of the run stays in ``out``.
    """

    out: Path
    store: ObjectStore | None = None

    @property
    def snapshot_root(self) -> str:
        """The snapshot root every participant and the trainer are given: a directory
        or a storage URL (docs/spec.md section 8.12)."""
        return self.store.url if self.store is not None else str(self.snapshots)

    @property
    def token_file(self) -> Path:
        """The control credential: the trainer's (docs/spec.md section 10.2)."""
        return self.out / "token"

    @property
    def token_digest_file(self) -> Path:
        """The control token's SHA-256 (hex): what a participant checks the coordinator's
        calls against, never holding the token itself (docs/spec.md section 10.2 item 8)."""
        return self.out / "token.sha256"

    @property
    def data_token_file(self) -> Path:
        """The data-plane credential: what an agent presents to its policy and resources,
        and the only one a participant's own calls out hold (docs/spec.md section 10.2)."""
        return self.out / "data-token"

    @property
    def snapshots(self) -> Path:
        return self.out / "snapshots"

    @property
    def topology(self) -> Path:
        return self.out / "topology.json"

    @property
    def events(self) -> Path:
        return self.out / "events.jsonl"

    @property
    def supervisor_log(self) -> Path:
        return self.out / "supervisor.jsonl"

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    @property
    def timeline(self) -> Path:
        return self.out / "timeline.png"

    def verifier_log(self, instance: str) -> Path:
        return self.out / f"verifier-{instance}.jsonl"

    def generation_log(self, instance: str) -> Path:
        return self.out / f"generations-{instance}.jsonl"


def prepare_out_dir(out: Path, store: ObjectStore | None = None) -> tuple[DemoPaths, str]:
    """Wipe and recreate ``out``; write a fresh control token and a fresh data-plane token
    (both 0600, never equal). Returns the paths and the control token.

    With ``store`` the snapshots go there and ``out`` gets no ``snapshots`` directory.

    Refuses a non-empty directory the demo did not make (:meth:`DemoOptions.problems`
    says so up front; this re-checks, as the directory may have changed since).
    """
    problems = _out_dir_problems(out)
    if problems:
        raise DemoError(problems[0])
    paths = DemoPaths(out.resolve(), store)
    if paths.out.exists():
        shutil.rmtree(paths.out)
    paths.out.mkdir(parents=True)
    (paths.out / OUT_MARKER).write_text("made by turnpoint demo; wiped by the next run\n")
    paths.logs.mkdir()
    if store is None:
        paths.snapshots.mkdir()
    token = secrets.token_urlsafe(32)
    data_token = secrets.token_urlsafe(32)
    # Owner-only, whole from its first instant, never replacing an existing file.
    create_file(paths.token_file, (token + "\n").encode("ascii"), temp_prefix=".token-", mode=0o600)
    create_file(
        paths.data_token_file,
        (data_token + "\n").encode("ascii"),
        temp_prefix=".data-token-",
        mode=0o600,
    )
    create_file(
        paths.token_digest_file,
        (token_sha256(token) + "\n").encode("ascii"),
        temp_prefix=".token-sha256-",
        mode=0o600,
    )
    return paths, token


# ---------------------------------------------------------------------- participants


@dataclass(frozen=True, kw_only=True)
class ParticipantSpec:
    """One participant to start: what ``turnpoint serve`` (or a Ray actor) is told."""

    instance: str
    kind: str
    example: str
    environment: str | None = None
    group_size: int | None = None
    verifier_log: Path | None = None
    generation_log: Path | None = None
    seed: int | None = None
    policy_address: str | None = None
    # The policy serves the OpenAI API too; an opaque agent is given its URL.
    openai: bool = False
    policy_openai: str | None = None
    resources: Mapping[str, str] = field(default_factory=dict)
    turn_delay_s: float | None = None
    token_delay_s: float | None = None
    cut_generations: bool = False
    # More than one: a group of worker processes sharing one port (docs/spec.md 3.9).
    workers: int = 1
    # Testing: a guess server holds every tool call until this file exists.
    hold_calls_until: Path | None = None
    # 0: the OS picks. A replacement healed in place takes its predecessor's ports, so
    # that the addresses wired into the agents stay right (docs/spec.md section 7.15).
    port: int = 0
    openai_port: int = 0
    # A model's replacement takes no generation before the trainer's weights reach it.
    await_weights: bool = False
    # The coding environment: its sandboxes and their snapshots, on this machine.
    sandbox_root: Path | None = None

    def serve_arguments(self, paths: DemoPaths) -> list[str]:
        """``turnpoint serve``'s arguments. The credentials go by file, never by value:
        the control token's digest, to check the coordinator's calls, and the data-plane
        token for the participant's own calls out (an agent's to its policy and
        resources, the OpenAI endpoint's API key), so no participant, nor anything it
        runs, holds or can read a credential that reaches a control plane (docs/spec.md
        section 10.2 items 6 and 8)."""
        arguments = [
            "--kind",
            self.kind,
            "--example",
            self.example,
            "--instance",
            self.instance,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--root",
            paths.snapshot_root,
            "--control-token-digest-file",
            str(paths.token_digest_file),
            "--data-token-file",
            str(paths.data_token_file),
        ]
        if self.group_size is not None:
            arguments += ["--group-size", str(self.group_size)]
        if self.verifier_log is not None:
            arguments += ["--verifier-log", str(self.verifier_log)]
        if self.generation_log is not None:
            arguments += ["--generation-log", str(self.generation_log)]
        if self.seed is not None:
            arguments += ["--seed", str(self.seed)]
        if self.await_weights:
            arguments.append("--await-weights")
        if self.policy_address is not None:
            arguments += ["--policy", self.policy_address]
        if self.openai:
            arguments += ["--openai-port", str(self.openai_port)]
        if self.policy_openai is not None:
            arguments += ["--policy-openai", self.policy_openai]
        for environment, address in sorted(self.resources.items()):
            arguments += ["--resources", f"{environment}={address}"]
        if self.turn_delay_s:
            arguments += ["--turn-delay", f"{self.turn_delay_s:g}"]
        if self.token_delay_s:
            arguments += ["--token-delay", f"{self.token_delay_s:g}"]
        if self.cut_generations:
            arguments.append("--cut-generations")
        if self.workers > 1:
            arguments += ["--workers", str(self.workers)]
        if self.hold_calls_until is not None:
            arguments += ["--hold-calls-until", str(self.hold_calls_until)]
        if self.sandbox_root is not None:
            arguments += ["--sandbox-root", str(self.sandbox_root)]
        return arguments


def server_specs(
    options: DemoOptions, paths: DemoPaths, generation: int = 1
) -> list[ParticipantSpec]:
    """The participants agents depend on: the policy and the resources servers (two for
    the guessing game, per sibling and group-scored; one for the other environments).
    ``generation`` counts job (re)starts: from the second on, ``tools`` holds its calls
    when ``--hold-tools-after-restart`` asks for it."""
    policy = ParticipantSpec(
        instance="policy",
        kind="model",
        example="tiny-policy",
        seed=options.seed,
        token_delay_s=options.token_delay_s,
        generation_log=paths.generation_log("policy"),
        openai=options.agent == OPAQUE,
    )
    if options.environment != GUESS:
        tools = ParticipantSpec(
            instance="tools",
            kind="resources",
            example=options.environment,
            environment=options.environment,
            verifier_log=paths.verifier_log("tools"),
            # In the run's directory even when the snapshots go to an object store.
            sandbox_root=paths.out / "sandboxes" / "tools"
            if options.environment == CODING
            else None,
        )
        return [policy, tools]
    return [
        policy,
        ParticipantSpec(
            instance="tools",
            kind="resources",
            example=GUESS,
            environment=GUESS,
            verifier_log=paths.verifier_log("tools"),
            hold_calls_until=options.hold_tools_after_restart if generation > 1 else None,
        ),
        ParticipantSpec(
            instance="group-tools",
            kind="resources",
            example=GUESS_GROUP,
            environment=GUESS_GROUP,
            group_size=options.group_size,
            verifier_log=paths.verifier_log("group-tools"),
        ),
    ]


def agent_specs(options: DemoOptions, servers: Mapping[str, Participant]) -> list[ParticipantSpec]:
    """The agents, wired to the started policy and resources servers."""
    resources = {
        p.spec.environment: p.address
        for p in servers.values()
        if p.spec.kind == "resources" and p.spec.environment is not None
    }
    opaque = options.agent == OPAQUE
    return [
        ParticipantSpec(
            instance=f"agent-{index}",
            kind="agent",
            example=OPAQUE if opaque else GUESS if options.environment == GUESS else "play",
            policy_address=servers["policy"].address,
            policy_openai=servers["policy"].openai_url if opaque else None,
            resources=resources,
            turn_delay_s=options.turn_delay_s,
            cut_generations=options.cut_generations,
            workers=options.agent_workers,
        )
        for index in range(options.agents)
    ]


class Participant(Protocol):
    """A started participant, whichever way it runs."""

    @property
    def spec(self) -> ParticipantSpec: ...

    @property
    def address(self) -> str: ...

    @property
    def openai_url(self) -> str | None:
        """The OpenAI endpoint it serves besides (a policy asked to), else None."""
        ...

    def exit_status(self) -> int | None:
        """None while it runs; its exit status once it ended (negative: killed by a signal)."""
        ...

    async def kill(self) -> None:
        """End it at once, as a crash would (SIGKILL, ``ray.kill``)."""
        ...

    async def stop(self, timeout_s: float) -> None:
        """Graceful drain; :class:`DemoError` unless it ends cleanly within ``timeout_s``."""
        ...

    async def stderr_tail(self) -> str: ...


class Launcher(Protocol):
    """Starts participants; ``generation`` counts job (re)starts, for log names."""

    description: str

    async def start(self, spec: ParticipantSpec, generation: int) -> Participant: ...


async def _tail_of(path: Path) -> str:
    def read() -> str:
        try:
            with path.open("rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - _STDERR_TAIL_BYTES))
                data = handle.read()
        except FileNotFoundError:
            return ""
        lines = data.decode("utf-8", "replace").strip().splitlines()
        return "\n".join(lines[-_STDERR_TAIL_LINES:])

    return await asyncio.to_thread(read)


def _quote_tail(tail: str) -> str:
    if not tail:
        return "(nothing)"
    return "\n" + "\n".join(f"    {line}" for line in tail.splitlines())


class ProcessParticipant:
    """A ``turnpoint serve`` child process that printed its serving line."""

    def __init__(
        self,
        spec: ParticipantSpec,
        process: asyncio.subprocess.Process,
        address: str,
        stderr_path: Path,
        openai_url: str | None = None,
    ) -> None:
        self._spec = spec
        self._process = process
        self._address = address
        self._openai_url = openai_url
        self._stderr_path = stderr_path
        # Keep reading stdout so that a chatty child never blocks on a full pipe.
        self._drain = asyncio.get_running_loop().create_task(self._drain_stdout())

    @property
    def spec(self) -> ParticipantSpec:
        return self._spec

    @property
    def address(self) -> str:
        return self._address

    @property
    def openai_url(self) -> str | None:
        return self._openai_url

    @property
    def pid(self) -> int:
        return self._process.pid

    def exit_status(self) -> int | None:
        return self._process.returncode

    async def _drain_stdout(self) -> None:
        stdout = self._process.stdout
        if stdout is None:
            return
        while await stdout.readline():
            pass

    async def kill(self) -> None:
        if self._process.returncode is None:
            self._process.kill()
        await self._process.wait()
        await self._drain

    async def stop(self, timeout_s: float) -> None:
        if self._process.returncode is None:
            self._process.send_signal(signal.SIGTERM)
        try:
            status = await asyncio.wait_for(self._process.wait(), timeout_s)
        except TimeoutError:
            await self.kill()
            raise DemoError(
                f"participant {self._spec.instance} did not exit within {timeout_s:g}s of "
                f"SIGTERM and was killed; its stderr says:{_quote_tail(await self.stderr_tail())}"
            ) from None
        await self._drain
        if status != 0:
            raise DemoError(
                f"participant {self._spec.instance} exited with status {status} after "
                f"SIGTERM; its stderr says:{_quote_tail(await self.stderr_tail())}"
            )

    async def stderr_tail(self) -> str:
        return await _tail_of(self._stderr_path)


class ProcessLauncher:
    """Starts each participant as ``turnpoint serve`` in its own process."""

    description = "processes"

    def __init__(
        self,
        paths: DemoPaths,
        *,
        start_timeout_s: float = START_TIMEOUT_S,
        serve_command: Sequence[str] = DEFAULT_SERVE_COMMAND,
        commands: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self._paths = paths
        self._start_timeout_s = start_timeout_s
        self._serve_command = tuple(serve_command)
        # Per instance, another program that takes `turnpoint serve`'s arguments and
        # prints its serving line: a participant written in another language.
        self._commands = {name: tuple(command) for name, command in (commands or {}).items()}
        self._env = _child_env(paths)

    async def start(self, spec: ParticipantSpec, generation: int) -> ProcessParticipant:
        stderr_path = self._paths.logs / f"{spec.instance}.{generation}.stderr"
        stderr = await asyncio.to_thread(stderr_path.open, "wb")
        try:
            process = await asyncio.create_subprocess_exec(
                *self._commands.get(spec.instance, self._serve_command),
                *spec.serve_arguments(self._paths),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=self._env,
                # Its own process group (see CHILD_PROCESS_GROUP).
                process_group=CHILD_PROCESS_GROUP,
            )
        finally:
            stderr.close()
        lines: dict[str, str] = {}
        try:
            address = await asyncio.wait_for(
                _serving_address(process, spec, lines), self._start_timeout_s
            )
            why = "" if address else f"it exited with status {await process.wait()}"
        except TimeoutError:
            address, why = None, "it never printed its serving line"
        except BaseException:
            await _kill(process)
            raise
        if address is None:
            await _kill(process)
            tail = await _tail_of(stderr_path)
            raise DemoError(
                f"participant {spec.instance} did not start within {self._start_timeout_s:g}s "
                f"({why}); its stderr says:{_quote_tail(tail)}"
            )
        return ProcessParticipant(spec, process, address, stderr_path, lines.get("openai"))


def _port_of(address: str | None) -> int:
    """The port of ``host:port`` or of a URL ``http://host:port/...``; 0 for None."""
    if address is None:
        return 0
    netloc = address.split("://", 1)[-1].split("/", 1)[0]
    return int(netloc.rpartition(":")[2])


def _child_env(paths: DemoPaths, token: str | None = None) -> dict[str, str]:
    """A child's environment: the trainer's holds the control ``token``; a participant's
    none (its credentials come by file, :meth:`ParticipantSpec.serve_arguments`), not
    even one the supervisor was started with."""
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    env.pop(TOKEN_FILE_ENV, None)
    if token is not None:
        env[TOKEN_ENV] = token
    env["PYTHONUNBUFFERED"] = "1"
    # Each child dies with the supervisor (see CHILD_PROCESS_GROUP).
    env[PARENT_PID_ENV] = str(os.getpid())
    if paths.store is not None:
        # The store's endpoint and credentials reach the children only this way.
        env.update(paths.store.environment)
    return env


async def _serving_address(
    process: asyncio.subprocess.Process,
    spec: ParticipantSpec,
    lines: dict[str, str] | None = None,
) -> str | None:
    """The address from the child's serving line; None if stdout ended without one.
    The OpenAI endpoint's line, printed before it, goes to ``lines["openai"]``."""
    assert process.stdout is not None
    while line := await process.stdout.readline():
        text = line.decode("utf-8", "replace").strip()
        endpoint = _OPENAI_SERVING.match(text)
        if endpoint and endpoint["instance"] == spec.instance and lines is not None:
            lines["openai"] = endpoint["url"]
        match = _SERVING.match(text)
        if match and match["instance"] == spec.instance:
            return match["address"]
    return None


async def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.kill()
    await process.wait()


async def start_participants(
    launcher: Launcher, options: DemoOptions, paths: DemoPaths, generation: int
) -> dict[str, Participant]:
    """Start the servers, then the agents wired to them; all or nothing."""
    started: dict[str, Participant] = {}

    async def start_all(specs: Sequence[ParticipantSpec]) -> None:
        results = await asyncio.gather(
            *(launcher.start(spec, generation) for spec in specs), return_exceptions=True
        )
        for result in results:
            if not isinstance(result, BaseException):
                started[result.spec.instance] = result
        for result in results:
            if isinstance(result, BaseException):
                raise result

    try:
        await start_all(server_specs(options, paths, generation))
        await start_all(agent_specs(options, started))
    except BaseException:
        await stop_participants(started.values(), check=False)
        raise
    return started


async def stop_participants(participants: Iterable[Participant], *, check: bool = True) -> None:
    """SIGTERM the agents first (clients of the others), then the policy and resources.

    With ``check``, raises one :class:`DemoError` naming every participant that did not
    exit cleanly; without it (cleanup after a failure) errors are swallowed.
    """
    group = list(participants)
    failures: list[str] = []
    for wave in (
        [p for p in group if p.spec.kind == "agent"],
        [p for p in group if p.spec.kind != "agent"],
    ):
        results = await asyncio.gather(
            *(p.stop(STOP_TIMEOUT_S) for p in wave), return_exceptions=True
        )
        for result in results:
            if isinstance(result, DemoError):
                failures.append(str(result))
            elif isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            elif isinstance(result, Exception):
                failures.append(repr(result))
    if failures and check:
        raise DemoError("\n".join(failures))


def write_topology(
    paths: DemoPaths,
    participants: Mapping[str, Participant],
    addresses: Mapping[str, str] | None = None,
) -> None:
    """``topology.json`` for the trainer, replaced atomically. Blocking.

    ``addresses`` overrides where the trainer reaches a participant (``--chaos`` puts a
    fault proxy in between)."""
    addresses = addresses or {}
    topology = {
        "token_file": str(paths.token_file),
        "snapshot_root": paths.snapshot_root,
        "participants": [
            {
                "instance": p.spec.instance,
                "kind": p.spec.kind,
                "address": addresses.get(p.spec.instance, p.address),
                "environment": p.spec.environment,
            }
            for p in participants.values()
        ],
    }
    replace_file(
        paths.topology,
        (json.dumps(topology, indent=2) + "\n").encode("utf-8"),
        temp_prefix=".topology-",
    )


# ---------------------------------------------------------------------- the trainer


def trainer_command(
    options: DemoOptions,
    paths: DemoPaths,
    *,
    resume: bool,
    incarnation: int,
    program: Sequence[str] = DEFAULT_TRAINER_COMMAND,
    kill_at: str | None = None,
    launcher: str | None = None,
    fault_windows: int = 0,
) -> list[str]:
    """The trainer's command line; ``program`` is what runs it (tests substitute a fake).

    ``kill_at`` is this incarnation's entry of ``--crash-at``, if any; ``fault_windows``
    its windows of the timed crash (:meth:`DemoOptions.fault_windows`). The supervisor
    numbers the incarnation: a trainer that died before it logged its start must not
    make the next one take its number (the supervisor would wait for steps of another).
    """
    command = [
        *program,
        "--topology",
        str(paths.topology),
        "--out",
        str(paths.out),
        "--steps",
        str(options.steps),
        "--group-size",
        str(options.group_size),
        "--groups-per-step",
        str(options.groups_per_step),
        "--snapshot-interval",
        f"{options.snapshot_interval_s:g}",
        "--target-level",
        options.target_level,
        "--seed",
        str(options.seed),
        # The trainer's own bound: heals of one participant per hour (section 7.15).
        "--max-restarts",
        str(options.max_restarts),
        "--incarnation",
        str(incarnation),
        # Spawned while the participants start; it waits for the supervisor's word.
        "--start-on-stdin",
    ]
    if options.environment != GUESS:
        command += ["--env", options.environment]
    if resume:
        command.append("--resume")
    if kill_at is not None:
        command += ["--kill-at", kill_at]
    if fault_windows:
        command += ["--fault-windows", str(fault_windows)]
    if launcher is not None:
        command += ["--launcher", launcher]
    if options.metrics_port is not None:
        command += ["--metrics-port", str(options.metrics_port)]
    return command


class _Trainer:
    """One trainer process (one incarnation); stdout and stderr go to files.

    Spawned waiting (``--start-on-stdin``): it imports, then starts on :meth:`release`,
    or is killed unreleased by :meth:`discard`. Given fault windows, its stdin stays
    open: it stops at each window until :meth:`go`."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        incarnation: int,
        logs: tuple[Path, Path],
        fault_windows: int = 0,
    ) -> None:
        self.process = process
        self.incarnation = incarnation
        self.logs = logs
        self.stderr = logs[1]
        self.windows_left = fault_windows
        self._exit = asyncio.get_running_loop().create_task(process.wait())

    @classmethod
    async def start(
        cls,
        options: DemoOptions,
        paths: DemoPaths,
        token: str,
        *,
        incarnation: int,
        resume: bool,
        program: Sequence[str],
        kill_at: str | None = None,
        launcher: str | None = None,
        fault_windows: int = 0,
    ) -> _Trainer:
        stdout_path = paths.logs / f"trainer.{incarnation}.stdout"
        stderr_path = paths.logs / f"trainer.{incarnation}.stderr"

        def open_logs() -> tuple[IO[bytes], IO[bytes]]:
            return stdout_path.open("wb"), stderr_path.open("wb")

        stdout, stderr = await asyncio.to_thread(open_logs)
        try:
            process = await asyncio.create_subprocess_exec(
                *trainer_command(
                    options,
                    paths,
                    resume=resume,
                    incarnation=incarnation,
                    program=program,
                    kill_at=kill_at,
                    launcher=launcher,
                    fault_windows=fault_windows,
                ),
                stdin=asyncio.subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                env=_child_env(paths, token),
                process_group=CHILD_PROCESS_GROUP,
            )
        finally:
            stdout.close()
            stderr.close()
        return cls(process, incarnation, (stdout_path, stderr_path), fault_windows)

    async def release(self) -> None:
        """Tell the waiting trainer that its topology is written: it starts now."""
        await self._say(b"start\n")

    async def go(self) -> None:
        """Close the fault window the trainer holds: the fault has landed."""
        self.windows_left -= 1
        await self._say(GO)

    async def _say(self, line: bytes) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        # A trainer that died while it waited (an import that failed) cannot hear it;
        # its exit status and stderr say why, and the supervisor acts on them.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stdin.write(line)
            await stdin.drain()
        if self.windows_left <= 0:
            stdin.close()

    async def discard(self) -> None:
        """Kill a trainer never released: it read nothing and wrote nothing of the run."""
        await self.kill()

        def remove_logs() -> None:
            for path in self.logs:
                path.unlink(missing_ok=True)

        await asyncio.to_thread(remove_logs)

    async def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None if still running after ``timeout_s``."""
        done, _ = await asyncio.wait({self._exit}, timeout=timeout_s)
        if not done:
            return None
        if self.process.stdin is not None:
            self.process.stdin.close()  # a window it never reached
        return self._exit.result()

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self._exit
        if self.process.stdin is not None:
            self.process.stdin.close()

    async def failure(self, status: int) -> DemoError:
        tail = await _tail_of(self.stderr)
        return DemoError(
            f"the trainer (incarnation {self.incarnation}) exited with status {status}; "
            f"its stderr ends with:{_quote_tail(tail)}\n(full log: {self.stderr})"
        )


# ---------------------------------------------------------------------- the run


class _Supervisor:
    def __init__(
        self,
        options: DemoOptions,
        paths: DemoPaths,
        token: str,
        launcher: Launcher,
        display: ProgressDisplay,
        trainer_program: Sequence[str],
    ) -> None:
        self.options = options
        self.trainer_program = tuple(trainer_program)
        self.paths = paths
        self.token = token
        self.launcher = launcher
        self.display = display
        self.state = ProgressState(
            total_steps=options.steps, crash_planned=options.crash, crash_point=options.crash_at
        )
        self.kill_event: dict[str, Any] | None = None
        self.tail = EventTail(paths.events)
        self.participants: dict[str, Participant] = {}
        self.killed: set[str] = set()
        self.trainer: _Trainer | None = None
        # The next incarnation's trainer, spawned by launch() and released by start_trainer().
        self.next_trainer: _Trainer | None = None
        self.generation = 0
        self.last_event_at = time.monotonic()
        # Unplanned restarts (the planned --crash is the demo's own and not counted).
        self.restarts = RestartBudget(
            options.max_restarts, 3600.0, first_pause_s=options.first_restart_pause_s
        )
        self.trainer_started_at = time.monotonic()
        self.trainer_restarted = asyncio.Event()
        self.faults_injected = 0
        self.proxies: dict[str, FaultProxy] = {}
        self.wire_faults = 0
        # Train steps the current trainer incarnation logged, and a wake-up for each.
        self.steps_since_start = 0
        self.trained = asyncio.Event()
        # --lose-node: the node removed, and the participants that were on it.
        self.node_lost: dict[str, Any] | None = None
        # Healing in place: where the trainer asks for replacements, when each dead
        # agent was first seen dead, and how many replacements each instance had.
        self.launch_service: LaunchService | None = None
        self.dead_since: dict[str, float] = {}
        self.replaced: dict[str, int] = {}
        # The default crash, healing in place: the agent SIGKILLed first (the trainer
        # replaces it), the trainer later.
        self.agent_lost: str | None = None
        # The instances whose heal the current trainer logged (its ``heal`` events).
        self.healed: set[str] = set()
        # One change of the participant table at a time: a replacement the trainer
        # asked for never races a job restart or another replacement.
        self.table_lock = asyncio.Lock()
        # Participants --chaos paused (SIGSTOP): a trainer restarted alone would wait on
        # them, so a recovery while any is paused restarts the job.
        self.paused: set[str] = set()
        # Whether the current trainer was started alone into running participants.
        self.trainer_alone = False

    async def record(self, event_type: str, **detail: object) -> None:
        line = json.dumps({"type": event_type, "t": time.time(), **detail}) + "\n"

        def append() -> None:
            with self.paths.supervisor_log.open("a", encoding="utf-8") as handle:
                handle.write(line)

        await asyncio.to_thread(append)

    def show(self) -> None:
        self.display.update(self.state, time.monotonic())

    async def spawn_trainer(self, *, resume: bool) -> None:
        """Spawn the next incarnation's trainer, waiting for :meth:`start_trainer`: it
        imports while the participants stop and start. Nothing to do when it was
        spawned ahead (:meth:`start_trainer`, a planned kill)."""
        if self.next_trainer is not None:
            return
        incarnation = self.trainer.incarnation + 1 if self.trainer else 1
        self.next_trainer = await _Trainer.start(
            self.options,
            self.paths,
            self.token,
            incarnation=incarnation,
            resume=resume,
            program=self.trainer_program,
            kill_at=self.options.kill_at(incarnation),
            fault_windows=self.options.fault_windows(incarnation),
            launcher=self.launch_service.address if self.launch_service is not None else None,
        )

    async def discard_next_trainer(self) -> None:
        trainer, self.next_trainer = self.next_trainer, None
        if trainer is not None:
            await trainer.discard()

    async def launch(self, *, resume: bool) -> None:
        """Start the participants and write the topology, the next trainer spawned
        first (if it was not yet) so that its imports overlap their start."""
        self.generation += 1
        self.state.phase = f"starting participants ({self.launcher.description})"
        self.show()
        if self.next_trainer is None:
            await self.spawn_trainer(resume=resume)
        try:
            await self._start_participants()
        except BaseException:
            await asyncio.shield(self.discard_next_trainer())
            raise

    async def _start_participants(self) -> None:
        self.participants = await start_participants(
            self.launcher, self.options, self.paths, self.generation
        )
        self.killed.clear()
        self.dead_since.clear()
        self.paused.clear()
        addresses: dict[str, str] = {}
        if self.options.chaos_faults:
            # The trainer reaches every participant through a fault proxy, so --chaos can
            # also lose and delay replies on the wire, not only kill processes.
            await self.close_proxies()
            for name, participant in self.participants.items():
                proxy = await FaultProxy(participant.address).start()
                self.proxies[name] = proxy
                addresses[name] = proxy.address
        await asyncio.to_thread(write_topology, self.paths, self.participants, addresses)

    async def close_proxies(self) -> None:
        proxies, self.proxies = self.proxies, {}
        for proxy in proxies.values():
            await proxy.close()

    async def start_trainer(self) -> None:
        """Release the trainer :meth:`launch` spawned, its topology written."""
        assert self.next_trainer is not None
        self.state.phase = "starting the trainer"
        self.show()
        self.trainer, self.next_trainer = self.next_trainer, None
        await self.trainer.release()
        self.last_event_at = self.trainer_started_at = time.monotonic()
        self.steps_since_start = 0
        self.trainer_restarted.set()
        if self.options.kill_at(self.trainer.incarnation) is not None:
            # Its crash is planned: the next trainer imports while this one runs, and
            # the restart after the kill costs the restore alone.
            await self.spawn_trainer(resume=True)

    async def run(self) -> None:
        if self.options.heal_in_place:
            self.launch_service = await LaunchService(self.token, self.replace).start()
        try:
            await self._run()
        finally:
            if self.launch_service is not None:
                await self.launch_service.close()

    async def _run(self) -> None:
        await self.launch(resume=False)
        await self.start_trainer()
        chaos = (
            [asyncio.create_task(self.inject_faults()), asyncio.create_task(self.wire_chaos())]
            if self.options.chaos_faults
            else []
        )
        try:
            await self.supervise()
            # A trainer spawned ahead for a kill that never came (the run ended first).
            await self.discard_next_trainer()
        finally:
            for task in chaos:
                task.cancel()
            for task in chaos:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.close_proxies()
        self.state.phase = "stopping participants"
        self.show()
        participants, self.participants = self.participants, {}
        for _name, pid in self.fault_victims_of(participants):
            # A participant paused by --chaos after the trainer's last call must wake
            # to drain; SIGCONT does nothing to a running one.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await stop_participants(list(participants.values()))

    async def supervise(self) -> None:
        while True:
            assert self.trainer is not None
            status = await self.trainer.wait(POLL_INTERVAL_S)
            await self.read_events()
            self.show()
            if status is not None:
                if status == 0:
                    return
                if self.killed_itself(status):
                    await self.crash_and_restart()
                    continue
                await self.recover(await self.trainer.failure(status))
                continue
            lost = await self.lost_participant()
            if lost is not None:
                await self.recover(lost)
                continue
            if time.monotonic() - self.last_event_at > self.options.stall_timeout_s:
                await self.recover(
                    DemoError(
                        f"the trainer (incarnation {self.trainer.incarnation}) logged nothing "
                        f"for {self.options.stall_timeout_s:g}s (stuck or paused); its stderr "
                        f"ends with:{_quote_tail(await _tail_of(self.trainer.stderr))}"
                    )
                )
                continue
            if self.agent_lost is not None:
                if self.healed_since():
                    await self.crash_and_restart()
            elif self.state.crash_due() and self.node_lost is None:
                # The trainer holds its first fault window until the fault has landed.
                if self.options.lose_node:
                    # The trainer heals the node's agents in place; if it cannot, its
                    # failure (or an agent still dead after HEAL_GRACE_S) restarts the job.
                    await self.lose_node()
                    await self.trainer.go()
                elif self.options.heal_in_place:
                    await self.lose_agent()
                    await self.trainer.go()
                else:
                    await self.crash_and_restart()

    async def inject_faults(self) -> None:
        """``--chaos N``: N unplanned faults at random times, each a SIGKILL or a SIGSTOP
        of any process of the job, trainer included, once the current incarnation is
        training. Recovery is the supervisor's ordinary path (:meth:`recover`); the
        exactly-once audit at the end says whether anything was lost or done twice."""
        rng = random.Random(self.options.seed * 7919 + 17)
        low, high = self.options.chaos_steps
        plan = [
            (target, signal_name)
            for target in ("trainer", "participant")
            for signal_name in ("SIGKILL", "SIGSTOP")
        ]
        rng.shuffle(plan)
        while self.faults_injected < self.options.chaos_faults:
            # Paced by training steps, not seconds: each incarnation trains a few steps
            # before its fault, however fast or slow the machine is.
            steps = rng.randint(low, high)
            while self.steps_since_start < steps:
                self.trained.clear()
                await self.trained.wait()
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            victims = self.fault_victims()
            if not victims:
                continue
            if plan:
                # The first faults cover every kind: each signal on the trainer and on a
                # participant, in a random order; then any process, any signal.
                target, signal_name = plan.pop()
                chosen = [v for v in victims if (v[0] == "trainer") == (target == "trainer")]
                name, pid = rng.choice(chosen or victims)
            else:
                name, pid = rng.choice(victims)
                signal_name = rng.choice(("SIGKILL", "SIGKILL", "SIGSTOP"))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, getattr(signal, signal_name))
            if name != "trainer" and signal_name == "SIGSTOP":
                self.paused.add(name)
            self.faults_injected += 1
            await self.record(
                "fault",
                n=self.faults_injected,
                victim=name,
                signal=signal_name,
                incarnation=self.trainer.incarnation if self.trainer else 0,
                step=self.state.step,
            )
            # Wait for the recovery this fault causes before the next one.
            self.trainer_restarted.clear()
            await self.trainer_restarted.wait()

    async def wire_chaos(self) -> None:
        """``--chaos``: between process faults, lose or delay the replies of one
        participant's link for a moment (through its proxy). No restart follows: a lost
        reply is retried with the same request id and replayed or joined (docs/spec.md
        section 6.8), a late one only slows the run."""
        rng = random.Random(self.options.seed * 104729 + 3)
        while True:
            await asyncio.sleep(rng.uniform(2.0, 5.0))
            if not self.proxies:
                continue
            name = rng.choice(sorted(self.proxies))
            proxy = self.proxies[name]
            mode = rng.choice((ProxyMode.DROP_REPLIES, ProxyMode.DELAY))
            hold_s = rng.uniform(0.3, 1.5)
            proxy.set_mode(mode, delay_s=rng.uniform(0.05, 0.5))
            self.wire_faults += 1
            await self.record(
                "wire_fault", n=self.wire_faults, victim=name, mode=mode.value, seconds=hold_s
            )
            try:
                await asyncio.sleep(hold_s)
            finally:
                proxy.set_mode(ProxyMode.PASS)

    def fault_victims(self) -> list[tuple[str, int]]:
        victims: list[tuple[str, int]] = []
        if self.trainer is not None and self.trainer.process.returncode is None:
            victims.append(("trainer", self.trainer.process.pid))
        return victims + self.fault_victims_of(self.participants)

    @staticmethod
    def fault_victims_of(participants: Mapping[str, Participant]) -> list[tuple[str, int]]:
        victims = []
        for name, participant in sorted(participants.items()):
            pid = getattr(participant, "pid", None)
            if isinstance(pid, int) and participant.exit_status() is None:
                victims.append((name, pid))
        return victims

    async def read_events(self) -> None:
        events = await asyncio.to_thread(self.tail.read_new)
        if events:
            self.last_event_at = time.monotonic()
        for event in events:
            if event.get("type") == "kill":
                self.kill_event = event
            current = self.trainer.incarnation if self.trainer is not None else None
            if event.get("type") == "train_step" and event.get("incarnation") == current:
                self.steps_since_start += 1
                self.trained.set()
            if event.get("type") == "heal" and event.get("incarnation") == current:
                # The trainer finished healing it: steps count from here.
                self.healed.add(str(event.get("lost")))
                self.steps_since_start = 0
            self.state.apply(event)

    def killed_itself(self, status: int) -> bool:
        """Whether the trainer's exit is its ``--crash-at`` kill: SIGKILL, after it
        logged its own ``kill`` event (read with the last events, before this is asked)."""
        assert self.trainer is not None
        return (
            self.options.kill_at(self.trainer.incarnation) is not None
            and status == -signal.SIGKILL
            and self.kill_event is not None
            and self.kill_event.get("incarnation") == self.trainer.incarnation
        )

    async def lost_participant(self) -> DemoError | None:
        """A participant that exited without being told to, as the reason to restore.

        Healing in place, a dead participant is the trainer's to replace (it asks
        :meth:`replace`); only one still dead after :data:`HEAL_GRACE_S` is."""
        now = time.monotonic()
        for participant in self.participants.values():
            status = participant.exit_status()
            instance = participant.spec.instance
            if status is not None and instance not in self.killed:
                if (
                    self.options.heal_in_place
                    and now - self.dead_since.setdefault(instance, now) < HEAL_GRACE_S
                ):
                    continue
                return DemoError(
                    f"participant {participant.spec.instance} exited unexpectedly with status "
                    f"{status}; its stderr says:{_quote_tail(await participant.stderr_tail())}"
                )
        return None

    async def recover(self, cause: DemoError) -> None:
        """A lost participant, or a trainer that died or stalled: restore the whole job
        from the last published snapshot onto fresh processes (docs/spec.md section
        7.11), within the restart budget; past it, the run ends with the cause."""
        assert self.trainer is not None
        alone = self.trainer_can_restart_alone()
        decision = self.restarts.decide(
            time.monotonic(), "trainer restart" if alone else "job restore"
        )
        if not decision.allowed:
            raise DemoError(f"{cause}\n{decision.reason}")
        if alone:
            await self.restart_trainer(
                cause=str(cause), pause_s=decision.pause_s, reason=decision.reason
            )
            return
        await self.record(
            "crash",
            incarnation=self.trainer.incarnation,
            step=self.state.step,
            killed=["trainer", *sorted(self.participants)],
            unplanned=True,
            # The whole message: its first line ends "its stderr ends with:" and the
            # tail that says why follows on the next lines.
            cause=str(cause),
        )
        await self.trainer.kill()
        await self.read_events()
        self.state.note_crash()
        self.show()
        await asyncio.to_thread(_drop_torn_line, self.paths.events)
        await self.spawn_trainer(resume=True)
        async with self.table_lock:
            participants, self.participants = self.participants, {}
            # SIGKILL, not a drain: a paused process never drains, and none of their
            # state is kept (the restore starts every participant fresh).
            for participant in participants.values():
                await participant.kill()
            await stop_participants(list(participants.values()), check=False)
            # A verifier killed mid-append leaves a torn last line; its reward was never
            # returned, so nothing the audit needs is lost by cutting it.
            for log in self.paths.out.glob("verifier-*.jsonl"):
                await asyncio.to_thread(_drop_torn_line, log)
            await asyncio.sleep(decision.pause_s)
            await self.launch(resume=True)
        await self.record(
            "restart",
            incarnation=self.trainer.incarnation + 1,
            reason=decision.reason,
            participants_restarted=len(self.participants),
        )
        self.state.note_restart()
        self.trainer_alone = False
        await self.start_trainer()

    def trainer_can_restart_alone(self) -> bool:
        """Whether an unplanned recovery restarts only the trainer: every participant
        still runs (none exited, none paused by --chaos), so the trainer's own fault (a
        SIGKILL, a pause, a crash) is the cause; and the last trainer started alone
        trained at least a step (one whose restore failed restarts the job instead); and a
        snapshot was published. Before the first one a new trainer starts over: it would
        send the rollouts' first attempts again to participants that saw them and retired
        them at its epoch (a chaos run trained such a rollout failed, its tools server
        refusing the attempt), so the job restarts onto fresh participants instead."""
        if not self.options.restart_trainer_alone or self.paused:
            return False
        if self.state.published == 0:
            return False
        if any(p.exit_status() is not None for p in self.participants.values()):
            return False
        return not (self.trainer_alone and self.steps_since_start == 0)

    async def restart_trainer(
        self, *, cause: str | None = None, pause_s: float = 0.0, reason: str | None = None
    ) -> None:
        """Kill the trainer and start the next one alone: it restores the last published
        snapshot into the participants where they run (RestoreRunning, docs/spec.md
        section 4.16), none of them restarted, and its epoch fences the dead one."""
        assert self.trainer is not None
        point: dict[str, Any] = {}
        if self.kill_event is not None and cause is None:
            point = {
                "point": self.kill_event.get("point"),
                "nth": self.kill_event.get("nth"),
                "checkpoint_id": self.kill_event.get("checkpoint_id"),
            }
        detail: dict[str, Any] = {"unplanned": True, "cause": cause} if cause is not None else {}
        await self.record(
            "crash",
            incarnation=self.trainer.incarnation,
            step=self.state.step,
            killed=["trainer"],
            **point,
            **detail,
        )
        await self.trainer.kill()
        await self.read_events()
        self.state.note_crash()
        self.state.phase = "crashed: restarting the trainer alone"
        self.show()
        # SIGKILL can tear the last event line; the next incarnation appends after it.
        await asyncio.to_thread(_drop_torn_line, self.paths.events)
        await self.spawn_trainer(resume=True)
        await asyncio.sleep(pause_s)
        await self.record(
            "restart",
            incarnation=self.trainer.incarnation + 1,
            participants_restarted=0,
            **({"reason": reason} if reason is not None else {}),
        )
        self.state.note_restart()
        self.trainer_alone = True
        await self.start_trainer()

    async def replace(self, instance: str) -> str:
        """The trainer's launcher (docs/spec.md section 7.15 item 9): end what is left of
        ``instance``, start it again under the same name with the same spec, and return
        where the trainer reaches it. A policy or resources server's address is wired
        into every agent: its replacement binds the same port (and the policy's OpenAI
        endpoint its same port), so the agents reach it where they did; a port taken
        meanwhile fails the heal, and the job restarts."""
        async with self.table_lock:
            return await self._replace(instance)

    async def _replace(self, instance: str) -> str:
        old = self.participants.get(instance)
        if old is None:
            raise ReplaceRefused(f"no participant {instance} runs in this job")
        spec = old.spec
        if spec.kind != "agent":
            spec = dataclasses.replace(
                spec,
                port=_port_of(old.address),
                openai_port=_port_of(old.openai_url),
                await_weights=spec.kind == "model",
            )
        self.killed.add(instance)
        # Killed and reaped before the replacement binds: the port is free again (the
        # servers bind with SO_REUSEADDR, so the old connections do not hold it).
        await old.kill()
        self.generation += 1
        try:
            new = await self.launcher.start(spec, self.generation)
        except DemoError as error:
            # A port taken meanwhile: the replacement could not bind it.
            raise ReplaceRefused(str(error)) from error
        if spec.port and _port_of(new.address) != spec.port:
            await new.kill()
            raise ReplaceRefused(
                f"{instance}'s replacement serves on {new.address}, not on its "
                f"predecessor's port {spec.port} that the agents call"
            )
        self.participants[instance] = new
        self.killed.discard(instance)
        self.dead_since.pop(instance, None)
        self.paused.discard(instance)
        self.replaced[instance] = self.replaced.get(instance, 0) + 1
        # A recovery, like a trainer restart: --chaos paces its next fault after it.
        self.steps_since_start = 0
        self.trainer_restarted.set()
        address = new.address
        proxy = self.proxies.get(instance)
        if proxy is not None and new.address != old.address:
            await proxy.close()
            self.proxies[instance] = proxy = await FaultProxy(new.address).start()
        if proxy is not None:
            # On the same port, the proxy stays: the trainer's weight sync and control
            # channels keep the address they had.
            address = proxy.address
        addresses = {name: p.address for name, p in self.proxies.items()}
        await asyncio.to_thread(write_topology, self.paths, self.participants, addresses)
        await self.record(
            "replaced",
            instance=instance,
            incarnation=self.trainer.incarnation if self.trainer else 0,
            step=self.state.step,
            n=self.replaced[instance],
        )
        return address

    async def lose_agent(self) -> None:
        """The default crash's first half, healing in place: SIGKILL one agent and let
        the trainer replace it (docs/spec.md section 7.15); the trainer dies later."""
        assert self.trainer is not None
        victim = self.crash_victim()
        self.agent_lost = victim.spec.instance
        await victim.kill()
        await self.record(
            "agent_lost",
            instance=victim.spec.instance,
            incarnation=self.trainer.incarnation,
            step=self.state.step,
        )

    def healed_since(self) -> bool:
        """Whether the trainer's half of the default crash is due: the lost agent was
        replaced, the trainer logged its heal (restored what depended on it), trained a
        step since and has steps left; it holds its second fault window for it."""
        state = self.state
        return (
            state.fault_window == 2
            and self.agent_lost in self.replaced
            and self.agent_lost in self.healed
            and self.steps_since_start > 0
            and state.crashed_at_step is None
            and not state.done
            and state.step < state.total_steps
        )

    def crash_victim(self) -> Participant:
        agents = sorted(
            (p for p in self.participants.values() if p.spec.kind == "agent"),
            key=lambda p: p.spec.instance,
        )
        return agents[self.options.seed % len(agents)]

    async def lose_node(self) -> None:
        """``--lose-node``: remove the Ray node hosting an agent, every process on it
        killed at once. Only agents run there (the servers on the head node): the
        trainer finds each lost and asks :meth:`replace` for it on a live node
        (docs/spec.md sections 7.12 and 7.15)."""
        remover = getattr(self.launcher, "remove_node_of", None)
        if remover is None:
            raise DemoError("--lose-node needs participants on Ray nodes (--ray-nodes)")
        victim = self.crash_victim()
        agents = [victim] + [
            p for p in self.participants.values() if p.spec.kind == "agent" and p is not victim
        ]
        lost = await remover(agents)
        self.node_lost = lost
        await self.record(
            "node_lost",
            incarnation=self.trainer.incarnation if self.trainer else 0,
            step=self.state.step,
            **lost,
        )

    async def crash_and_restart(self) -> None:
        """The planned crash: the trainer alone where it can restart alone (the agent
        lost first, if any, was healed in place); else the trainer and one agent at once,
        and the job restarts."""
        assert self.trainer is not None
        if self.options.restart_trainer_alone:
            await self.restart_trainer()
            return
        # Healing in place, the agent was lost (and replaced) before: the trainer alone.
        victim = None if self.agent_lost is not None else self.crash_victim()
        if victim is not None:
            self.killed.add(victim.spec.instance)
            await asyncio.gather(self.trainer.kill(), victim.kill())
        else:
            await self.trainer.kill()
        point: dict[str, Any] = {}
        if self.kill_event is not None:
            point = {
                "point": self.kill_event.get("point"),
                "nth": self.kill_event.get("nth"),
                "checkpoint_id": self.kill_event.get("checkpoint_id"),
            }
        await self.record(
            "crash",
            incarnation=self.trainer.incarnation,
            step=self.state.step,
            killed=["trainer"] + ([victim.spec.instance] if victim is not None else []),
            **point,
        )
        await self.read_events()
        self.state.note_crash()
        self.show()
        # SIGKILL can tear the last event line; the next incarnation appends after it.
        await asyncio.to_thread(_drop_torn_line, self.paths.events)
        survivors = [p for p in self.participants.values() if p is not victim]
        self.participants = {}
        # The next trainer imports while the survivors drain.
        await self.spawn_trainer(resume=True)
        await stop_participants(survivors)
        await self.launch(resume=True)
        await self.record(
            "restart",
            incarnation=self.trainer.incarnation + 1,
            participants_restarted=len(self.participants),
        )
        self.state.note_restart()
        self.trainer_alone = False
        await self.start_trainer()

    async def abort(self) -> None:
        """Cleanup after a failure: no checks, nothing left running."""
        if self.trainer is not None:
            await self.trainer.kill()
        await self.discard_next_trainer()
        participants, self.participants = self.participants, {}
        await stop_participants(list(participants.values()), check=False)


def _drop_torn_line(path: Path) -> None:
    """Cut a partial last line (one without its newline) off the file."""
    try:
        with path.open("rb+") as handle:
            data = handle.read()
            if not data or data.endswith(b"\n"):
                return
            handle.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        return


async def run_demo(
    options: DemoOptions,
    paths: DemoPaths,
    token: str,
    launcher: Launcher,
    console: Console,
    *,
    trainer_program: Sequence[str] = DEFAULT_TRAINER_COMMAND,
) -> int:
    """Run the demo in a prepared out directory; returns the exit status (0: audit passed).

    Raises :class:`DemoError` when the run cannot finish (a participant that does not
    start or dies, a trainer that fails or stalls); nothing it started is left running.
    """
    display = open_display(console, live=options.progress)
    supervisor = _Supervisor(options, paths, token, launcher, display, trainer_program)
    try:
        await supervisor.run()
    except BaseException as error:
        await asyncio.shield(supervisor.abort())
        display.close(supervisor.state)
        if isinstance(error, DemoError):
            await _draw_what_happened(paths, console)
        raise
    display.close(supervisor.state)
    try:
        logs = await asyncio.to_thread(load_run, paths.out)
    except EventLogError as error:
        # A log that breaks its contract cannot be audited: that is the audit's verdict.
        console.print(Text(f"audit: FAILED: {error}", style="bold red"), soft_wrap=True)
        return 1
    report = build_report(
        logs,
        group_size=options.group_size,
        expected_steps=options.steps,
        groups_per_step=options.groups_per_step,
    )
    warnings = []
    planned = len(_crash_plan(options.crash_at))
    if planned and report.recovery.crashes < planned:
        missed = (
            "the crash was not injected"
            if planned == 1
            else f"{planned - report.recovery.crashes} of the {planned} crashes were not injected"
        )
        warnings.append(
            f"{missed}: the trainer finished before a snapshot reached --crash-at "
            f"{options.crash_at}; raise --steps or lower --snapshot-interval"
        )
    elif options.crash and not (
        report.recovery.participants_replaced if options.lose_node else report.recovery.crashes
    ):
        warnings.append(
            f"the {'node loss' if options.lose_node else 'crash'} was not injected: no "
            "snapshot was published while rollouts were in flight before the last step; "
            "lower --snapshot-interval or raise --steps"
        )
    from turnpoint.apps.demo._timeline import render_timeline

    timeline = await asyncio.to_thread(
        render_timeline, logs.events, logs.supervisor, paths.timeline
    )
    render_report(report, console, timeline=timeline, warnings=warnings)
    return report.exit_status


async def _draw_what_happened(paths: DemoPaths, console: Console) -> None:
    """After a failed run, the timeline of what the logs hold, to help find out why."""
    from turnpoint.apps.demo._timeline import render_timeline

    try:
        logs = await asyncio.to_thread(load_run, paths.out)
    except EventLogError:
        return
    timeline = await asyncio.to_thread(
        render_timeline, logs.events, logs.supervisor, paths.timeline
    )
    console.print(Text(f"timeline (of the failed run): {timeline}"), soft_wrap=True)
