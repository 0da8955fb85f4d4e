"""The bench's arithmetic: pure functions of measured numbers, no clock, no I/O.

- :func:`ratio_interval`: the bootstrap interval of the on/off throughput ratio (pairs
  of neighbouring runs, one each side, resampled with replacement, the ratio of the
  resampled sides' means), drawn from a seeded generator so that one set of runs
  always gives one interval;
- :func:`steady_window`: a run's rollouts per second between the end of its start-up
  and the start of its drain, counted in whole training steps;
- :func:`block_windows`: the same for each block of a run's steps (the bench's on and
  off blocks), each boundary optionally the mean end of the pipeline's last steps, and
  :func:`integrate_between` the rollout-seconds inside one;
- :func:`closed_fraction`: the rollout-seconds that dispatch was closed by snapshots as
  a fraction of the rollout-seconds of the same run (the cost of snapshots where it
  arises, from one run with snapshots on);
- :func:`fit_line`: least squares of y on x (the slope of snapshot time or memory
  against episodes) and the curvature left once the line is taken out;
- :func:`beyond_floor_us`: microseconds per item beyond a floor measured beside it;
- :func:`spread`: median, lowest and highest of repeats, and :func:`bookkeeping_by_cpu`
  the median of the repeats pinned to each CPU.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

_MASK64: Final = (1 << 64) - 1
_RESAMPLES: Final = 2000
_CONFIDENCE: Final = 0.95


class _SplitMix64:
    """A small seeded generator (SplitMix64): the interval is reproducible, and this
    module draws no randomness from the process."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def below(self, bound: int) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        return z % bound


@dataclass(frozen=True, slots=True)
class Interval:
    """A ratio with its bootstrap interval (``low`` and ``high`` at ``confidence``)."""

    ratio: float
    low: float
    high: float
    confidence: float
    resamples: int

    @property
    def width(self) -> float:
        return self.high - self.low

    def to_json(self) -> dict[str, Any]:
        return {
            "ratio": round(self.ratio, 4),
            "low": round(self.low, 4),
            "high": round(self.high, 4),
            "width": round(self.width, 4),
            "confidence": self.confidence,
            "resamples": self.resamples,
        }


def _quantile(ordered: Sequence[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks of sorted values."""
    position = fraction * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    weight = position - below
    return ordered[below] * (1 - weight) + ordered[above] * weight


def ratio_interval(
    pairs: Sequence[tuple[float, float]],
    *,
    seed: int = 0,
    resamples: int = _RESAMPLES,
    confidence: float = _CONFIDENCE,
) -> Interval | None:
    """mean(on) / mean(off) over ``pairs`` of (on, off) rates, with its percentile
    bootstrap interval; None without a pair or when a side's mean is not positive.

    A resample draws whole pairs: the two runs of a pair ran side by side on the same
    machine, so what the machine did to both (a neighbour's load that came and went)
    stays inside the pair instead of widening the interval."""
    if not pairs or resamples < 1 or not 0 < confidence < 1:
        return None
    on_mean = statistics.fmean(on for on, _ in pairs)
    off_mean = statistics.fmean(off for _, off in pairs)
    if off_mean <= 0 or on_mean < 0:
        return None
    draw = _SplitMix64(seed)
    ratios = []
    for _ in range(resamples):
        drawn = [pairs[draw.below(len(pairs))] for _ in pairs]
        off_total = sum(off for _, off in drawn)
        if off_total > 0:
            ratios.append(sum(on for on, _ in drawn) / off_total)
    ratios.sort()
    tail = (1 - confidence) / 2
    return Interval(
        ratio=on_mean / off_mean,
        low=_quantile(ratios, tail),
        high=_quantile(ratios, 1 - tail),
        confidence=confidence,
        resamples=resamples,
    )


@dataclass(frozen=True, slots=True)
class Window:
    """``rollouts`` trained in the ``seconds`` from ``opened`` (a run's steady state, or
    one of its blocks)."""

    rollouts: int
    seconds: float
    opened: float = 0.0

    @property
    def closed(self) -> float:
        return self.opened + self.seconds

    @property
    def per_second(self) -> float:
        return self.rollouts / self.seconds if self.seconds > 0 else 0.0


def steady_window(steps: Sequence[tuple[float, int]], *, head: int, tail: int) -> Window | None:
    """The rollouts per second of a run's steady state, from its training steps.

    ``steps``: (time the step ended, rollouts it trained on), in order. The window opens
    when step ``head`` ends (the start-up before it: processes connecting, the first
    weights, a pipeline filling at once) and closes when the last step but ``tail``
    ends (the drain after it: no new rollout dispatched, the pipeline emptying); it
    counts the rollouts of the steps that ended inside it. Whole steps, so a window
    never counts part of a rollout. None when no step is left between head and tail.
    """
    if head < 1 or tail < 0:
        raise ValueError("head must be >= 1 and tail >= 0")
    last = len(steps) - 1 - tail
    if last <= head - 1:
        return None
    opened = steps[head - 1][0]
    closed = steps[last][0]
    return Window(
        rollouts=sum(rollouts for _, rollouts in steps[head : last + 1]),
        seconds=closed - opened,
        opened=opened,
    )


def block_windows(
    steps: Sequence[tuple[float, int]], *, block_steps: int, tail: int, depth: int = 1
) -> dict[int, Window]:
    """Block ``b`` of ``block_steps`` steps (steps ``b * block_steps + 1`` to ``(b + 1) *
    block_steps``, counted from 1) as a window from the end of the block before it to
    the end of its last step, with the rollouts of its steps. Block 0 has no block
    before it (it holds the run's start-up) and blocks reaching into the last ``tail``
    steps (the drain) are left out, as is a block the run did not finish.

    ``depth``: the trainer's pipeline holds that many steps' worth of rollouts in flight
    (the demo trainer's two), so its steps form ``depth`` interleaved chains, each step
    training what was dispatched when the step ``depth`` before it ended. A boundary is
    then the mean end of the ``depth`` steps up to it: each chain is measured over whole
    periods of its own, instead of one chain's and the others' offset from it (the
    chains drift apart and back during a run, by up to half a period). A block whose
    opening would need a step before the first is left out too."""
    if block_steps < 1 or tail < 0 or depth < 1:
        raise ValueError("block_steps and depth must be >= 1 and tail >= 0")
    usable = len(steps) - tail

    def boundary(last: int) -> float:
        ends = [end for end, _ in steps[last - depth + 1 : last + 1]]
        return sum(ends) / depth

    windows = {}
    block = max(1, -(-depth // block_steps))
    while (block + 1) * block_steps <= usable:
        first = block * block_steps
        last = first + block_steps - 1
        opened = boundary(first - 1)
        windows[block] = Window(
            rollouts=sum(rollouts for _, rollouts in steps[first : last + 1]),
            seconds=boundary(last) - opened,
            opened=opened,
        )
        block += 1
    return windows


def integrate_between(samples: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """:func:`integrate` of the samples over ``[start, end]`` only, the value at each
    end interpolated between the samples around it (held past the last one)."""
    if end <= start or not samples:
        return 0.0

    def at(t: float) -> float:
        for (t0, v0), (t1, v1) in itertools.pairwise(samples):
            if t0 <= t <= t1:
                return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
        return samples[0][1] if t < samples[0][0] else samples[-1][1]

    inside = [(t, v) for t, v in samples if start < t < end]
    return integrate([(start, at(start)), *inside, (end, at(end))])


def integrate(samples: Sequence[tuple[float, float]]) -> float:
    """The trapezoid integral of (time, value) samples taken in time order."""
    total = 0.0
    for (t0, v0), (t1, v1) in itertools.pairwise(samples):
        if t1 > t0:
            total += (t1 - t0) * (v0 + v1) / 2
    return total


def closed_fraction(
    closures: Iterable[tuple[float, int]], in_flight: Sequence[tuple[float, float]]
) -> float | None:
    """Rollout-seconds stalled by snapshots over the rollout-seconds of the run.

    ``closures``: per snapshot, the seconds dispatch was closed and the episodes it
    held in flight (each stalled for that long). ``in_flight``: (time, rollouts in
    flight) samples over the run; their integral is the run's rollout-seconds. None
    when the run has no rollout-seconds to measure against.
    """
    run = integrate(in_flight)
    if run <= 0:
        return None
    return sum(seconds * held for seconds, held in closures) / run


@dataclass(frozen=True, slots=True)
class Line:
    """``y = slope * x + intercept`` by least squares; ``curvature`` is the quadratic
    term a parabola through the same points adds (0 for three or fewer distinct x the
    line already explains, None when there are too few points to say)."""

    slope: float
    intercept: float
    curvature: float | None

    def at(self, x: float) -> float:
        return self.slope * x + self.intercept


def _solve(matrix: list[list[float]], right: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    size = len(right)
    rows = [[*row, value] for row, value in zip(matrix, right, strict=True)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(rows[r][column]))
        if abs(rows[pivot][column]) < 1e-300:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for r in range(size):
            if r != column:
                factor = rows[r][column] / rows[column][column]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[column], strict=True)]
    return [rows[i][size] / rows[i][i] for i in range(size)]


def _fit(xs: Sequence[float], ys: Sequence[float], degree: int) -> list[float] | None:
    """Least-squares polynomial coefficients, lowest power first (normal equations)."""
    powers = [sum(x**k for x in xs) for k in range(2 * degree + 1)]
    matrix = [[powers[i + j] for j in range(degree + 1)] for i in range(degree + 1)]
    right = [sum(y * x**i for x, y in zip(xs, ys, strict=True)) for i in range(degree + 1)]
    return _solve(matrix, right)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Line | None:
    """Least squares of ``ys`` on ``xs``; None with fewer than two distinct x."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        return None
    # Centre and scale x so that 100k episodes squared stays well conditioned.
    scale = max(abs(x) for x in xs) or 1.0
    unit = [x / scale for x in xs]
    line = _fit(unit, ys, 1)
    if line is None:
        return None
    curvature = None
    if len(set(xs)) >= 3:
        parabola = _fit(unit, ys, 2)
        curvature = None if parabola is None else parabola[2] / (scale * scale)
    return Line(slope=line[1] / scale, intercept=line[0], curvature=curvature)


def beyond_floor_us(measured_s: float, floor_s: float, items: int) -> float:
    """Microseconds per item that ``measured_s`` spends beyond ``floor_s``."""
    if items < 1:
        raise ValueError("items must be >= 1")
    return (measured_s - floor_s) / items * 1e6


@dataclass(frozen=True, slots=True)
class Spread:
    median: float
    low: float
    high: float
    repeats: int

    def to_json(self) -> dict[str, Any]:
        return {
            "median": round(self.median, 3),
            "low": round(self.low, 3),
            "high": round(self.high, 3),
            "repeats": self.repeats,
        }


def spread(values: Sequence[float]) -> Spread | None:
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


def bookkeeping_by_cpu(values: Sequence[float], cpus: Sequence[int | None]) -> dict[int, float]:
    """The median of the bookkeeping repeats pinned to each CPU (``cpus[i]`` is the CPU
    of ``values[i]``; None, not pinned, counts for none)."""
    if len(cpus) != len(values):
        raise ValueError(f"{len(values)} repeats but {len(cpus)} CPUs")
    on: dict[int, list[float]] = {}
    for cpu, value in zip(cpus, values, strict=True):
        if cpu is not None:
            on.setdefault(cpu, []).append(value)
    return {cpu: statistics.median(on[cpu]) for cpu in sorted(on)}
