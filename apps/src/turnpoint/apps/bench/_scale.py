"""The trainer's books and manifest as episodes in flight grow (issue 30 item 5).

For 1k, 10k and 100k episodes in flight, in process and without a wire:

- **memory**: the coordinator's rollout books (:class:`RolloutLedger`, the pure core of
  the rollout client) holding that many accepted attempts, measured with
  ``tracemalloc`` as the growth of traced memory, and the peak the cut adds on top
  (the rollout state and the manifest being built);
- **manifest bytes**: the published snapshot manifest that continues every one of
  them (each exported by the one agent that holds them), serialised;
- **snapshot time**: the trainer's side of one snapshot, timed without tracemalloc:
  the cut (the books read), the manifest built and validated, published on the disk
  root with its fsyncs (:meth:`SnapshotLayout.publish`); median of a few rounds.

The slope of snapshot time (and of memory) against episodes is a least-squares line
(:func:`~turnpoint.apps.bench._arithmetic.fit_line`) with the curvature left over:
linear growth shows a flat per-episode cost and a curvature near zero.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from turnpoint.apps.bench._arithmetic import Line, fit_line
from turnpoint.ids import make_checkpoint_id
from turnpoint.protocol import ArtifactRef, ParticipantKind
from turnpoint.trainer import Rollout
from turnpoint.trainer.advanced import (
    AnchorRef,
    SnapshotLayout,
    SnapshotManifest,
    tree_digest,
)
from turnpoint.trainer.rollouts.ledger import RolloutLedger
from turnpoint.trainer.storage.manifest import ParticipantEntry, PlacedEpisode

_AGENT: Final = "agent-0"
_ROUNDS: Final = 3
_MANIFEST_FILE: Final = "MANIFEST.json"

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ScaleRow:
    episodes: int
    books_bytes: int
    cut_peak_bytes: int
    manifest_bytes: int
    snapshot_s: tuple[float, ...]

    @property
    def snapshot_median_s(self) -> float:
        return statistics.median(self.snapshot_s)

    def to_json(self) -> dict[str, Any]:
        n = self.episodes
        return {
            "episodes": n,
            "coordinator_bytes_per_episode": round(self.books_bytes / n, 1),
            "cut_peak_bytes_per_episode": round(self.cut_peak_bytes / n, 1),
            "manifest_bytes_per_episode": round(self.manifest_bytes / n, 1),
            "snapshot_s": round(self.snapshot_median_s, 4),
            "snapshot_us_per_episode": round(self.snapshot_median_s / n * 1e6, 3),
            "snapshot_runs_s": [round(s, 4) for s in self.snapshot_s],
        }


@dataclass(frozen=True, slots=True)
class ScaleFigures:
    rows: tuple[ScaleRow, ...]

    def _line(self, value: Callable[[ScaleRow], float]) -> Line | None:
        return fit_line([row.episodes for row in self.rows], [value(row) for row in self.rows])

    @property
    def snapshot_line(self) -> Line | None:
        return self._line(lambda row: row.snapshot_median_s)

    @property
    def memory_line(self) -> Line | None:
        return self._line(lambda row: float(row.books_bytes))

    @property
    def largest(self) -> ScaleRow | None:
        return max(self.rows, key=lambda row: row.episodes, default=None)

    @property
    def per_episode_growth(self) -> float | None:
        """Snapshot seconds per episode at the largest size over the smallest: about 1
        for linear growth, the size ratio itself (100 from 1k to 100k) for quadratic."""
        if len(self.rows) < 2:
            return None
        small = min(self.rows, key=lambda row: row.episodes)
        large = max(self.rows, key=lambda row: row.episodes)
        return (large.snapshot_median_s / large.episodes) / (
            small.snapshot_median_s / small.episodes
        )

    @property
    def curvature_share(self) -> float | None:
        """What the quadratic term adds at the largest size, as a share of the snapshot
        time there: near 0 for linear growth."""
        line, largest = self.snapshot_line, self.largest
        if line is None or line.curvature is None or largest is None:
            return None
        n = largest.episodes
        return line.curvature * n * n / largest.snapshot_median_s

    def to_json(self) -> dict[str, Any]:
        snapshot, memory = self.snapshot_line, self.memory_line
        return {
            "rows": [row.to_json() for row in self.rows],
            "snapshot_s_slope_us_per_episode": None
            if snapshot is None
            else round(snapshot.slope * 1e6, 4),
            "snapshot_s_intercept": None if snapshot is None else round(snapshot.intercept, 5),
            "snapshot_curvature_share_at_largest": None
            if self.curvature_share is None
            else round(self.curvature_share, 4),
            "snapshot_per_episode_growth": None
            if self.per_episode_growth is None
            else round(self.per_episode_growth, 3),
            "memory_slope_bytes_per_episode": None if memory is None else round(memory.slope, 1),
        }


def _rollout(index: int) -> Rollout:
    group = f"g{index:07d}"
    return Rollout(
        rollout_id=f"r{index:07d}",
        prompt_group_id=group,
        sibling_index=0,
        group_size=1,
        environment="guess",
        task={"prompt": group, "seed": index},
        instance=_AGENT,
    )


def _books(episodes: int) -> RolloutLedger:
    """A ledger holding ``episodes`` accepted attempts, each past one boundary."""
    counter = itertools.count()
    ledger = RolloutLedger([_AGENT], request_ids=lambda: f"run-{next(counter)}")
    for index in range(episodes):
        ledger.dispatch(_rollout(index))
        attempt = ledger.take_startable()
        assert attempt is not None
        ledger.begin_call(attempt)
        ledger.accept(attempt, 0.0)
        ledger.boundary(attempt, 1)
    return ledger


def _manifest(ledger: RolloutLedger, checkpoint_id: str, anchor: AnchorRef) -> SnapshotManifest:
    """The cut: the books read and the manifest that continues every owned episode."""
    state = ledger.rollout_state()
    owned = tuple(rollout.episode for rollout in ledger.in_flight())
    digest = hashlib.sha256(b"").hexdigest()
    entry = ParticipantEntry(
        _AGENT,
        ParticipantKind.AGENT,
        manifest=ArtifactRef(f"{_AGENT}/{_MANIFEST_FILE}", digest, 0, 0),
        exported=owned,
    )
    return SnapshotManifest(
        checkpoint_id=checkpoint_id,
        step=1,
        created_at=0.0,
        anchor=anchor,
        participants=(entry,),
        continued=tuple(PlacedEpisode(episode, _AGENT) for episode in owned),
        rollout_state=state,
    )


def _begin(layout: SnapshotLayout, checkpoint_id: str) -> tuple[Path, AnchorRef]:
    """The snapshot directory with what the participant and the anchor left there."""
    snapshot = layout.begin(checkpoint_id)
    anchor_dir = layout.anchor_dir(checkpoint_id)
    anchor_dir.mkdir(parents=True, exist_ok=True)
    (snapshot / _AGENT).mkdir(exist_ok=True)
    (snapshot / _AGENT / _MANIFEST_FILE).write_bytes(b"")
    return snapshot, AnchorRef(tree_digest(anchor_dir))


def _measure_memory(episodes: int) -> tuple[RolloutLedger, int, int, int]:
    """The books, the traced bytes they hold, the cut's peak beyond them, and the
    manifest's bytes."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ledger = _books(episodes)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.reset_peak()
        digest = hashlib.sha256(b"").hexdigest()
        manifest = _manifest(ledger, make_checkpoint_id("scale", 1), AnchorRef(digest))
        encoded = manifest.to_json()
        peak = tracemalloc.get_traced_memory()[1] - base - held
    finally:
        tracemalloc.stop()
    return ledger, held, peak, len(encoded)


def measure_scale_row(root: Path, episodes: int, rounds: int = _ROUNDS) -> ScaleRow:
    """One size (blocking: builds the books, writes the manifests and fsyncs)."""
    # The same books are then timed, with tracemalloc stopped.
    ledger, held, peak, manifest_bytes = _measure_memory(episodes)
    layout = SnapshotLayout(root / f"scale-{episodes}")
    times = []
    for number in range(1, rounds + 1):
        checkpoint_id = make_checkpoint_id("scale", number)
        snapshot, anchor = _begin(layout, checkpoint_id)
        start = time.perf_counter()
        layout.publish(snapshot, _manifest(ledger, checkpoint_id, anchor))
        times.append(time.perf_counter() - start)
    return ScaleRow(episodes, held, peak, manifest_bytes, tuple(times))


def measure_scale(root: Path, sizes: Sequence[int], progress: Progress) -> ScaleFigures:
    """Every size in turn (blocking: call it in a thread)."""
    rows = []
    for episodes in sizes:
        row = measure_scale_row(root, episodes)
        shown = row.to_json()
        progress(
            f"  {episodes} episodes in flight: books {shown['coordinator_bytes_per_episode']} "
            f"B/episode, manifest {shown['manifest_bytes_per_episode']} B/episode, "
            f"snapshot {shown['snapshot_s'] * 1000:.1f} ms"
        )
        rows.append(row)
    return ScaleFigures(tuple(rows))
