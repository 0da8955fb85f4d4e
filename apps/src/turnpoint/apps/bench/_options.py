"""The options of ``turnpoint bench``: plain values, cheap to import (the command line
builds them before anything heavy is loaded)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

FULL_SIZES: Final = (1, 8, 64, 256, 1024)
QUICK_SIZES: Final = (1, 8, 64)
SANDBOX_MB: Final = (10, 100)
QUICK_SANDBOX_MB: Final = (10,)
SANDBOX_ROUNDS: Final = 5
QUICK_SANDBOX_ROUNDS: Final = 2
RELAY_CALLS: Final = 200
QUICK_RELAY_CALLS: Final = 40
REPLAY_TURNS: Final = (5, 20, 50)


def positive_ints(flag: str, example: str, what: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type for ``flag``: comma-separated integers, each at least 1."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes numbers like {example}, got {text!r}"
            ) from None
        if not values or any(n < 1 for n in values):
            raise argparse.ArgumentTypeError(f"{flag} takes {what} >= 1")
        return values

    return parse


@dataclass(frozen=True, slots=True)
class RealStateCase:
    """``participants`` each holding ``parked`` episodes of ``state_bytes`` each."""

    participants: int
    parked: int
    state_bytes: int

    def __post_init__(self) -> None:
        if self.participants < 1 or self.parked < 1 or self.state_bytes < 1:
            raise ValueError("a real-state case needs participants, episodes and bytes >= 1")

    @property
    def label(self) -> str:
        return f"{self.participants}x{self.parked}x{self.state_bytes}"

    @classmethod
    def parse(cls, text: str) -> RealStateCase:
        """``PARTICIPANTSxEPISODESxBYTES``, e.g. ``64x32x16384``."""
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(part.isdigit() for part in parts):
            raise ValueError(f"a real-state case is PARTICIPANTSxEPISODESxBYTES, got {text!r}")
        return cls(int(parts[0]), int(parts[1]), int(parts[2]))


REAL_STATE: Final = (RealStateCase(64, 32, 16384), RealStateCase(1, 1000, 1024))
"""Snapshots that carry real state (PARTICIPANTSxEPISODESxBYTES): 64 participants of 32
parked episodes of 16 KB (32 MB a snapshot), and 1,000 episodes of 1 KB on one."""
SCALE_EPISODES: Final = (1_000, 10_000, 100_000)
"""Episodes in flight whose books, manifest and snapshot time the full bench measures."""
TMPFS: Final = Path("/dev/shm")
"""Where the control path's snapshot roots go by default (Linux shared memory, tmpfs)."""
DURABLE_SIZE: Final = 64
"""Participants of the durable commit (or the largest size measured, if smaller)."""
# Rounds per size when --rounds is not given: fewer where one round takes seconds.
_ROUNDS_SMALL: Final = 15
_ROUNDS_LARGE: Final = 7
_ROUNDS_HUGE: Final = 5
_LARGE: Final = 64
_HUGE: Final = 256


def default_rounds(participants: int) -> int:
    if participants <= _LARGE:
        return _ROUNDS_SMALL
    return _ROUNDS_LARGE if participants <= _HUGE else _ROUNDS_HUGE


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """The demo trainer's runs: training steps of ``groups_per_step`` prompt groups of
    ``group_size`` siblings, on ``agents`` agent servers, with a snapshot every
    ``snapshot_interval_s`` when snapshots are on. The throughput run measures
    ``repeats`` pairs of blocks of ``block_steps`` steps, one block without snapshots and
    one with, its agent turns waiting ``turn_delay_s`` (0 repeats: no such run, the
    crashed run measures the cost of snapshots on its own after ``steps`` steps, as
    ``--quick`` does; otherwise ``steps`` only bounds the crashed run).
    ``run_timeout_s`` bounds each run."""

    # 8 agent servers and 8 groups of 4 in flight: the load the admission-closed target
    # is set for (32 rollouts in flight, four per agent).
    agents: int = 8
    steps: int = 20
    group_size: int = 4
    groups_per_step: int = 8
    snapshot_interval_s: float = 2.0
    # Each agent turn's model call waits this long (a real model's or tool's latency):
    # rollouts then last seconds, as in agentic RL, and the rate is set by timers and
    # dispatch rather than by CPU the machine shares (0: CPU-bound, as the demo).
    turn_delay_s: float = 0.0
    repeats: int = 1
    # The full bench's run alternates snapshots off and on in blocks of this many steps
    # (``repeats`` pairs of blocks measured); the quick bench makes no such run.
    block_steps: int = 4
    seed: int = 0
    run_timeout_s: float = 600.0


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What to measure and how hard. ``rounds`` None: :func:`default_rounds` per size.

    ``root`` holds every snapshot the run writes on disk (the durable commit and the
    demo workload); None: a fresh temporary directory, removed afterwards. ``tmpfs`` is
    where the control path's snapshot roots go (a fresh directory under it, removed
    afterwards); None, or a directory that does not exist: under ``root`` instead, and
    the report says so. ``bookkeeping_episodes`` in-process episodes time the SDK, ``bookkeeping_repeats`` times (the
    figure is the median of the repeats' medians, their spread reported).
    ``sandbox_mb``: the sizes of the sandboxes whose snapshots are timed;
    ``sandbox_rounds``: checkpoints each way (busy, idle) over the busy sandboxes.
    ``relay_calls``: chat calls each way of the egress relay's overhead figure;
    ``replay_turns``: the episode lengths whose restore by replay is timed.
    ``real_state``: the snapshots carrying real state measured against the disk's floor,
    as ``PARTICIPANTSxEPISODESxBYTES`` (none with ``--quick``). ``scale_episodes``: the
    numbers of episodes in flight whose trainer books, manifest bytes and snapshot time
    are measured (none with ``--quick``).
    """

    sizes: tuple[int, ...] = FULL_SIZES
    workers: int = 2
    rounds: int | None = None
    warmup: int = 3
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    root: Path | None = None
    tmpfs: Path | None = TMPFS
    bookkeeping_episodes: int = 3000
    bookkeeping_repeats: int = 5
    sandbox_mb: tuple[int, ...] = SANDBOX_MB
    sandbox_rounds: int = SANDBOX_ROUNDS
    relay_calls: int = RELAY_CALLS
    replay_turns: tuple[int, ...] = REPLAY_TURNS
    real_state: tuple[RealStateCase, ...] = REAL_STATE
    scale_episodes: tuple[int, ...] = SCALE_EPISODES

    @property
    def durable_size(self) -> int:
        fitting = [n for n in self.sizes if n <= DURABLE_SIZE]
        return max(fitting) if fitting else min(self.sizes)

    def __post_init__(self) -> None:
        if not self.sizes or any(n < 1 for n in self.sizes):
            raise ValueError("sizes must be participant counts >= 1")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.rounds is not None and self.rounds < 1:
            raise ValueError("rounds must be >= 1")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.bookkeeping_episodes < 1 or self.bookkeeping_repeats < 1:
            raise ValueError("bookkeeping_episodes and bookkeeping_repeats must be >= 1")
        if not self.sandbox_mb or any(n < 1 for n in self.sandbox_mb):
            raise ValueError("sandbox sizes must be megabytes >= 1")
        if self.sandbox_rounds < 1:
            raise ValueError("sandbox_rounds must be >= 1")
        if self.relay_calls < 1:
            raise ValueError("relay_calls must be >= 1")
        if not self.replay_turns or any(n < 1 for n in self.replay_turns):
            raise ValueError("replay episode lengths must be turns >= 1")
        if any(n < 1 for n in self.scale_episodes):
            raise ValueError("scale episodes must be >= 1")
        workload = self.workload
        for name in ("agents", "steps", "group_size", "groups_per_step", "block_steps"):
            if getattr(workload, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if workload.repeats < 0:
            raise ValueError("repeats must be >= 0")
        if not workload.snapshot_interval_s > 0 or not workload.run_timeout_s > 0:
            raise ValueError("the snapshot interval and the run timeout must be > 0")
        if not workload.turn_delay_s >= 0:
            raise ValueError("the turn delay must be >= 0 seconds")

    def rounds_for(self, participants: int) -> int:
        return self.rounds if self.rounds is not None else default_rounds(participants)
