"""The demo's timeline: one PNG that shows throughput, snapshots, the crash and learning.

- rollouts completed per second (from ``rollout`` events), as a filled step curve;
- a shaded span per attempted snapshot, ``t_start``..``t_end`` (admission closed), green
  when published and red when it failed;
- a vertical line at the crash (supervisor log) and one at each restore (trainer log);
- a dotted line at each participant lost and at each one replaced in place (supervisor
  log: ``agent_lost``, ``node_lost``, ``fault``; ``replaced``), with the span between
  them shaded;
- the mean reward of every train step on a second axis, with a moving average; steps a
  restore rolled back are drawn hollow, so the replaced history stays visible.

Times are seconds since the first event of the run. The figure is built on an Agg canvas
directly (no pyplot), so it needs no display and keeps no global state. Blocking: call it
through a thread from async code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turnpoint.apps.demo._report import (
    EventLog,
    Lineage,
    LineageError,
    SupervisorEvent,
    effective_lineage,
)

_THROUGHPUT = "#4c72b0"
_REPLACED = "#8172b2"
_PUBLISHED = "#55a868"
_FAILED = "#c44e52"
_CRASH = "#c44e52"
_RESTORE = "#8172b2"
_REWARD = "#dd8452"
_DOWN = "#555555"


def rollouts_per_second(times: Sequence[float], origin: float, end: float) -> list[int]:
    """Completions counted in one-second bins from ``origin``; the last bin holds ``end``."""
    bins = [0] * (max(0, math.floor(end - origin)) + 1)
    for t in times:
        index = math.floor(t - origin)
        if 0 <= index < len(bins):
            bins[index] += 1
    return bins


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (fewer at the start)."""
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averages.append(total / min(index + 1, window))
    return averages


def render_timeline(
    log: EventLog,
    supervisor: Sequence[SupervisorEvent],
    path: Path,
    *,
    title: str = "turnpoint demo",
) -> Path:
    """Draw the run into ``path`` (PNG) and return it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    times = log.times + [
        e.t
        for e in supervisor
        if e.type in ("crash", "restart", "agent_lost", "node_lost", "replaced")
    ]
    times += [s.t_start for s in log.snapshots] + [s.t_end for s in log.snapshots]
    origin = min(times, default=0.0)
    end = max(times, default=origin)

    figure = Figure(figsize=(11, 5.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    legend: list[Any] = []

    bins = rollouts_per_second([r.t for r in log.rollouts], origin, end)
    edges = list(range(len(bins) + 1))
    axes.stairs(bins, edges, fill=True, color=_THROUGHPUT, alpha=0.35, linewidth=0)
    axes.stairs(bins, edges, color=_THROUGHPUT, linewidth=1.0)
    legend.append(Patch(color=_THROUGHPUT, alpha=0.5, label="rollouts completed / s"))

    shown: set[str] = set()
    for snapshot in log.snapshots:
        if not snapshot.attempted:
            continue
        color = _PUBLISHED if snapshot.outcome == "published" else _FAILED
        axes.axvspan(
            snapshot.t_start - origin,
            max(snapshot.t_end, snapshot.t_start) - origin,
            color=color,
            alpha=0.3,
            linewidth=0,
        )
        if snapshot.outcome not in shown:
            shown.add(snapshot.outcome)
            legend.append(
                Patch(
                    color=color, alpha=0.35, label=f"snapshot {snapshot.outcome} (admission closed)"
                )
            )

    crashes = [e.t for e in supervisor if e.type == "crash"]
    for crash in crashes:
        axes.axvline(crash - origin, color=_CRASH, linewidth=2, linestyle="--")
        # Down time: from the crash to the next restore (or to the end of the log).
        recovered = min((r.t for r in log.restores if r.t >= crash), default=end)
        axes.axvspan(crash - origin, recovered - origin, color=_DOWN, alpha=0.12, linewidth=0)
    if crashes:
        legend.append(Line2D([], [], color=_CRASH, linewidth=2, linestyle="--", label="crash"))
        legend.append(Patch(color=_DOWN, alpha=0.25, label="job restart (until restored)"))
    losses = [e.t for e in supervisor if e.type in ("agent_lost", "node_lost", "fault")]
    replacements = [e.t for e in supervisor if e.type == "replaced"]
    for replaced in replacements:
        axes.axvline(replaced - origin, color=_REPLACED, linewidth=2, linestyle=":")
        # From the loss to its replacement: one participant missing, the rest running.
        lost = max((t for t in losses if t <= replaced), default=replaced)
        axes.axvspan(lost - origin, replaced - origin, color=_REPLACED, alpha=0.1, linewidth=0)
    if replacements:
        legend.append(
            Line2D(
                [], [], color=_REPLACED, linewidth=2, linestyle=":", label="participant replaced"
            )
        )
    for restore in log.restores:
        axes.axvline(restore.t - origin, color=_RESTORE, linewidth=2)
    if log.restores:
        legend.append(Line2D([], [], color=_RESTORE, linewidth=2, label="restore"))

    axes.set_xlim(0, max(1.0, end - origin))
    axes.set_ylim(0, max(bins, default=0) * 1.15 + 1)
    axes.set_xlabel("seconds since the run started")
    axes.set_ylabel("rollouts completed per second", color=_THROUGHPUT)
    axes.grid(axis="y", alpha=0.3)

    try:
        lineage = effective_lineage(log)
    except LineageError:
        # Draw what was logged even when the history is broken; the audit says why.
        lineage = Lineage(log.train_steps, ())
    rewards = axes.twinx()
    # Steps as dots, and a moving average that makes the trend readable over a noisy
    # hundred steps; one line per incarnation, as nothing trained while the job was down.
    window = max(1, len(lineage.steps) // 10)
    averages = moving_average([s.mean_reward for s in lineage.steps], window)
    for incarnation in sorted({s.incarnation for s in lineage.steps}):
        indexes = [i for i, s in enumerate(lineage.steps) if s.incarnation == incarnation]
        times = [lineage.steps[i].t - origin for i in indexes]
        rewards.plot(
            times,
            [lineage.steps[i].mean_reward for i in indexes],
            linestyle="none",
            marker="o",
            markersize=3,
            color=_REWARD,
            alpha=0.5,
        )
        rewards.plot(times, [averages[i] for i in indexes], color=_REWARD, linewidth=2)
    if lineage.steps:
        legend.append(
            Line2D(
                [],
                [],
                color=_REWARD,
                marker="o",
                markersize=3,
                linestyle="none",
                alpha=0.5,
                label="mean reward per step",
            )
        )
        legend.append(Line2D([], [], color=_REWARD, linewidth=2, label=f"{window}-step average"))
    if lineage.rolled_back:
        rewards.plot(
            [s.t - origin for s in lineage.rolled_back],
            [s.mean_reward for s in lineage.rolled_back],
            linestyle="none",
            marker="o",
            markersize=5,
            markerfacecolor="none",
            markeredgecolor=_REWARD,
        )
        legend.append(
            Line2D(
                [],
                [],
                linestyle="none",
                marker="o",
                markerfacecolor="none",
                markeredgecolor=_REWARD,
                label="step rolled back by the restore",
            )
        )
    rewards.set_ylabel("mean reward per step", color=_REWARD)
    all_rewards = [s.mean_reward for s in (*lineage.steps, *lineage.rolled_back)]
    if all_rewards:
        low, high = min(all_rewards), max(all_rewards)
        margin = max(0.05, (high - low) * 0.1)
        rewards.set_ylim(low - margin, high + margin)

    axes.set_title(title, loc="left")
    figure.legend(
        handles=legend, loc="outside lower center", ncols=4, fontsize="small", frameon=False
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
