"""``turnpoint bench --ray-scale``: one snapshot of 8, 64 and 256 participants spread
over three Ray nodes, time per phase, and a plot of how it grows.

The cluster is a head and two more nodes on this machine
(:class:`~turnpoint.server.ray.LocalCluster`, every address on loopback), each node
offering :data:`SLOTS_PER_NODE` of the custom resource :data:`NODE_RESOURCE`. The
participants are lightweight (:class:`NoopParticipant`: a resources server with nothing
to hold, its own snapshot store under the shared root): 256 processes would not fit two
cores, so :data:`ACTORS_PER_NODE` actors per node host their share each, every
participant with its own gRPC server and port on its node's address
(:class:`~turnpoint.server.ray.ParticipantFleet`). Participant ``pNNNN`` lives in actor
``NNNN mod A``, so the first N of them spread over every actor and every node.

For each size N the real coordinator, given the fleet's first N endpoints as a plain
address list, takes ``warmup`` + ``rounds`` snapshots (prepare, commit, publish of the
manifest, resume; the trainer's anchor is an empty directory made before the clock
starts) and the median of each phase is reported. :func:`render_plot` draws the phases
against N.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from turnpoint.apps.bench._workers import NoopResources
from turnpoint.ids import make_checkpoint_id
from turnpoint.participant_sdk import ParticipantRuntime, SnapshotStore

SIZES: Final = (8, 64, 256)
NODES: Final = 3
ACTORS_PER_NODE: Final = 2
NODE_RESOURCE: Final = "turnpoint_participant"
SLOTS_PER_NODE: Final = 4
PHASES: Final = ("prepare", "commit", "publish", "resume")
_ROUNDS: Final = 7
_WARMUP: Final = 2
_ROUND_TIMEOUT_S: Final = 120.0
_COORDINATOR_ID: Final = "bench-ray"
_KEEP_SNAPSHOTS: Final = 2
DEFAULT_PLOT: Final = "bench-ray-scale.png"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class NoopParticipant:
    """Builds a lightweight participant inside its actor (pickled to the actor's node)."""

    root: str

    def __call__(self, instance: str) -> ParticipantRuntime:
        return ParticipantRuntime(
            instance, SnapshotStore(Path(self.root)), resources=NoopResources()
        )


def participant_names(total: int, actors: int) -> list[tuple[str, ...]]:
    """The instances of each actor: ``pNNNN`` in actor ``NNNN mod actors``."""
    return [
        tuple(f"p{index:04d}" for index in range(actor, total, actors))
        for actor in range(min(actors, total))
    ]


@dataclass(frozen=True)
class ScaleRow:
    """Medians for one size, in milliseconds, and the nodes its participants ran on."""

    participants: int
    nodes: int
    rounds: int
    total_ms: float
    phases_ms: Mapping[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "participants": self.participants,
            "nodes": self.nodes,
            "rounds": self.rounds,
            "total_ms": round(self.total_ms, 2),
            "phases_ms": {phase: round(ms, 2) for phase, ms in self.phases_ms.items()},
        }


async def _snapshot_round(coordinator: Any, layout: Any, checkpoint_id: str) -> dict[str, float]:
    from turnpoint.apps.bench._control_overhead import timed_snapshot
    from turnpoint.trainer.advanced import AnchorRef, tree_digest

    def begin() -> tuple[Path, Any]:
        snapshot = layout.begin(checkpoint_id)
        anchor_dir = layout.anchor_dir(checkpoint_id)
        anchor_dir.mkdir(parents=True, exist_ok=True)
        return snapshot, AnchorRef(tree_digest(anchor_dir))

    snapshot, anchor = await asyncio.to_thread(begin)
    laps = await timed_snapshot(coordinator, checkpoint_id, snapshot, anchor, layout.publish)

    def tidy() -> None:
        layout.retain(_KEEP_SNAPSHOTS)
        layout.clean_partial()

    await asyncio.to_thread(tidy)
    return {phase: laps[i + 1] - laps[i] for i, phase in enumerate(PHASES)}


async def measure_size(
    endpoints: Mapping[str, str],
    nodes: int,
    *,
    root: Path,
    token: str,
    ids: Iterator[str],
    rounds: int,
    warmup: int,
) -> ScaleRow:
    """One size: a coordinator over ``endpoints`` (plain addresses) and its rounds."""
    from turnpoint.trainer import CoordinatorConfig
    from turnpoint.trainer.advanced import Coordinator, SnapshotLayout, bump_epoch

    identity = await asyncio.to_thread(bump_epoch, root, coordinator_id=_COORDINATOR_ID)
    coordinator = Coordinator(
        endpoints,
        token=token,
        coordinator_id=identity.coordinator_id,
        epoch=identity.epoch,
        config=CoordinatorConfig(snapshot_root=root, control_timeout_s=60.0),
    )
    layout = SnapshotLayout(root)
    phases: dict[str, list[float]] = {phase: [] for phase in PHASES}
    totals: list[float] = []
    try:
        async with asyncio.timeout(_ROUND_TIMEOUT_S):
            await coordinator.discover()
        for index in range(warmup + rounds):
            async with asyncio.timeout(_ROUND_TIMEOUT_S):
                laps = await _snapshot_round(coordinator, layout, next(ids))
            if index >= warmup:
                for phase in PHASES:
                    phases[phase].append(laps[phase])
                totals.append(sum(laps.values()))
    finally:
        await coordinator.close()
    return ScaleRow(
        participants=len(endpoints),
        nodes=nodes,
        rounds=rounds,
        total_ms=statistics.median(totals) * 1000,
        phases_ms={phase: statistics.median(values) * 1000 for phase, values in phases.items()},
    )


async def measure_ray_scale(
    root: Path,
    sizes: Sequence[int],
    *,
    rounds: int,
    warmup: int,
    progress: Progress,
    nodes: int = NODES,
) -> list[ScaleRow]:
    """Start the fleet for the largest size on the connected cluster; measure each size."""
    from turnpoint.server import ServerOptions
    from turnpoint.server.ray import (
        FleetOptions,
        ParticipantFleet,
        ParticipantGroup,
        Placement,
    )

    token = secrets.token_urlsafe(32)
    largest = max(sizes)
    actors = participant_names(largest, nodes * ACTORS_PER_NODE)
    build = NoopParticipant(str(root))
    placement = Placement(resources={NODE_RESOURCE: 1})
    groups = [
        ParticipantGroup(
            kind="resources",
            instances=instances,
            build=build,
            placement=placement,
            per_actor=len(instances),
        )
        for instances in actors
    ]
    options = FleetOptions(server=ServerOptions(token=token, grace_seconds=0.0))
    progress(f"ray scale: starting {largest} participants in {len(actors)} actors")
    started = time.perf_counter()
    rows = []
    ids = (make_checkpoint_id("bench", n) for n in itertools.count(1))
    async with ParticipantFleet(groups, options) as fleet:
        where = {endpoint.instance: endpoint for endpoint in fleet.describe()}
        spread = len({endpoint.node_id for endpoint in where.values()})
        progress(f"ray scale: serving on {spread} nodes after {time.perf_counter() - started:.1f}s")
        for n in sizes:
            names = [f"p{index:04d}" for index in range(n)]
            endpoints = {name: where[name].address for name in names}
            used = len({where[name].node_id for name in names})
            row = await measure_size(
                endpoints, used, root=root, token=token, ids=ids, rounds=rounds, warmup=warmup
            )
            progress(
                f"ray scale: N={n} on {used} nodes: {row.total_ms:.1f} ms ("
                + ", ".join(f"{p} {row.phases_ms[p]:.1f}" for p in PHASES)
                + f"; median of {rounds})"
            )
            rows.append(row)
    return rows


def render_plot(rows: Sequence[ScaleRow], path: Path) -> Path:
    """Time per phase (and in total) against the number of participants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axes, per) = plt.subplots(1, 2, figsize=(11, 4.5))
    sizes = [row.participants for row in rows]
    for phase in PHASES:
        axes.plot(sizes, [row.phases_ms[phase] for row in rows], marker="o", label=phase)
        per.plot(
            sizes,
            [row.phases_ms[phase] / row.participants for row in rows],
            marker="o",
            label=phase,
        )
    axes.plot(sizes, [row.total_ms for row in rows], marker="s", color="black", label="total")
    per.plot(
        sizes,
        [row.total_ms / row.participants for row in rows],
        marker="s",
        color="black",
        label="total",
    )
    for ax in (axes, per):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel(f"participants (in Ray actors over {NODES} nodes)")
        ax.grid(True, alpha=0.3)
    axes.set_ylabel("median ms per snapshot")
    axes.set_title("One snapshot on Ray: time per phase")
    axes.legend()
    per.set_ylabel("ms per participant")
    per.set_title("The same, per participant")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def render_rows(rows: Sequence[ScaleRow]) -> str:
    header = ["participants", "nodes", *PHASES, "total", "rounds"]
    lines = ["  ".join(f"{h:>12}" for h in header)]
    for row in rows:
        cells = [
            str(row.participants),
            str(row.nodes),
            *(f"{row.phases_ms[p]:.1f}" for p in PHASES),
            f"{row.total_ms:.1f}",
            str(row.rounds),
        ]
        lines.append("  ".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def ray_scale_command(args: argparse.Namespace) -> int:
    """``turnpoint bench --ray-scale``: start the cluster, measure, print, plot."""
    from turnpoint.server.ray import FleetError, LocalCluster

    sizes = tuple(args.sizes or SIZES)
    rounds = args.rounds or _ROUNDS
    warmup = args.warmup if args.warmup is not None else _WARMUP
    plot = Path(args.ray_scale_plot)
    actors = NODES * ACTORS_PER_NODE
    if math.ceil(max(sizes) / actors) > 1000:
        print("turnpoint bench: --sizes too large for one cluster", file=sys.stderr)
        return 2
    made_root = args.root is None
    root = Path(tempfile.mkdtemp(prefix="turnpoint-ray-scale-")) if made_root else args.root
    root.mkdir(parents=True, exist_ok=True)
    _progress(f"ray scale: starting a cluster of {NODES} nodes on this machine")
    cluster = LocalCluster(NODES, resources={NODE_RESOURCE: SLOTS_PER_NODE})
    try:
        cluster.connect()
        rows = asyncio.run(
            measure_ray_scale(root, sizes, rounds=rounds, warmup=warmup, progress=_progress)
        )
    except (FleetError, TimeoutError, OSError) as error:
        print(f"turnpoint bench: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        cluster.shutdown()
        if made_root:
            shutil.rmtree(root, ignore_errors=True)
    render_plot(rows, plot)
    if args.json:
        print(json.dumps({"ray_scale": [row.to_json() for row in rows], "plot": str(plot)}))
    else:
        print(
            f"One snapshot on Ray, {NODES} nodes, median ms of {rounds} rounds per size "
            f"({actors} actors hosting the participants)"
        )
        print(render_rows(rows))
        print(f"plot: {plot}")
    return 0
