"""The bench's arithmetic: pure functions of measured numbers, no clock, no I/O.

- :func:`ratio_interval`: the bootstrap interval of the on/off throughput ratio (runs
  of each side resampled with replacement, the ratio of the resampled means), drawn
  from a seeded generator so that one set of runs always gives one interval;
- :func:`closed_fraction`: the rollout-seconds that dispatch was closed by snapshots as
  a fraction of the rollout-seconds of the same run (the cost of snapshots where it
  arises, from one run with snapshots on);
- :func:`fit_line`: least squares of y on x (the slope of snapshot time or memory
  against episodes) and the curvature left once the line is taken out;
- :func:`beyond_floor_us`: microseconds per item beyond a floor measured beside it;
- :func:`spread`: median, lowest and highest of repeats.
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
    on: Sequence[float],
    off: Sequence[float],
    *,
    seed: int = 0,
    resamples: int = _RESAMPLES,
    confidence: float = _CONFIDENCE,
) -> Interval | None:
    """mean(on) / mean(off) with its percentile bootstrap interval; None without runs
    on both sides or with a side whose mean is not positive."""
    if not on or not off or resamples < 1 or not 0 < confidence < 1:
        return None
    if statistics.fmean(off) <= 0 or statistics.fmean(on) < 0:
        return None
    draw = _SplitMix64(seed)
    ratios = []
    for _ in range(resamples):
        on_mean = sum(on[draw.below(len(on))] for _ in on) / len(on)
        off_mean = sum(off[draw.below(len(off))] for _ in off) / len(off)
        if off_mean > 0:
            ratios.append(on_mean / off_mean)
    ratios.sort()
    tail = (1 - confidence) / 2
    return Interval(
        ratio=statistics.fmean(on) / statistics.fmean(off),
        low=_quantile(ratios, tail),
        high=_quantile(ratios, 1 - tail),
        confidence=confidence,
        resamples=resamples,
    )


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
