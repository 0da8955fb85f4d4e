"""The bench's arithmetic (``turnpoint.apps.bench._arithmetic``): the bootstrap interval
of the on/off ratio, the cost of snapshots as a share of rollout-seconds, the slope of a
figure against episodes, the cost beyond a floor and the spread of repeats."""

from __future__ import annotations

import pytest

from turnpoint.apps.bench._arithmetic import (
    beyond_floor_us,
    closed_fraction,
    fit_line,
    integrate,
    ratio_interval,
    spread,
)


def test_the_interval_holds_the_ratio_of_means_and_is_reproducible() -> None:
    on = [95.0, 97.0, 99.0, 96.0, 98.0]
    off = [100.0, 101.0, 99.0, 100.0, 100.0]
    interval = ratio_interval(on, off, seed=7)
    assert interval is not None
    assert interval.ratio == pytest.approx(97.0 / 100.0)
    assert interval.low < interval.ratio < interval.high
    # The resampled means stay within the runs' own extremes.
    assert interval.low >= min(on) / max(off) and interval.high <= max(on) / min(off)
    assert interval.width == pytest.approx(interval.high - interval.low)
    # One seed, one interval; another seed draws other resamples.
    assert ratio_interval(on, off, seed=7) == interval
    assert ratio_interval(on, off, seed=8) != interval


def test_identical_runs_give_an_interval_of_no_width() -> None:
    interval = ratio_interval([50.0] * 5, [50.0] * 5)
    assert interval is not None
    assert (interval.low, interval.ratio, interval.high) == (1.0, 1.0, 1.0)
    assert interval.to_json()["width"] == 0.0


def test_noisier_runs_widen_the_interval() -> None:
    quiet = ratio_interval([99.0, 100.0, 101.0] * 2, [100.0] * 6)
    noisy = ratio_interval([80.0, 100.0, 120.0] * 2, [100.0] * 6)
    assert quiet is not None and noisy is not None
    assert noisy.width > 5 * quiet.width


@pytest.mark.parametrize(
    ("on", "off"), [([], [1.0]), ([1.0], []), ([1.0], [0.0, 0.0])], ids=["no-on", "no-off", "off-0"]
)
def test_no_interval_without_runs_on_both_sides(on: list[float], off: list[float]) -> None:
    assert ratio_interval(on, off) is None


def test_the_run_s_rollout_seconds_are_the_integral_of_rollouts_in_flight() -> None:
    # 4 in flight for 2 s, then a ramp from 4 to 0 over 2 s: 8 + 4 rollout-seconds.
    assert integrate([(0.0, 4.0), (2.0, 4.0), (4.0, 0.0)]) == pytest.approx(12.0)
    assert integrate([(1.0, 3.0)]) == 0.0


def test_the_cost_of_snapshots_is_their_closed_rollout_seconds_over_the_run_s() -> None:
    # 32 rollouts in flight for 10 s: 320 rollout-seconds; two snapshots closed dispatch
    # for 25 ms with 32 held and 50 ms with 16 held: 0.8 + 0.8 = 1.6 rollout-seconds.
    samples = [(float(t), 32.0) for t in range(11)]
    fraction = closed_fraction([(0.025, 32), (0.050, 16)], samples)
    assert fraction == pytest.approx(1.6 / 320)
    assert closed_fraction([], samples) == 0.0
    assert closed_fraction([(0.1, 4)], [(0.0, 0.0), (5.0, 0.0)]) is None


def test_a_straight_line_has_its_slope_and_no_curvature() -> None:
    episodes = [1_000, 10_000, 100_000]
    seconds = [0.002 + 3e-6 * n for n in episodes]
    line = fit_line(episodes, seconds)
    assert line is not None
    assert line.slope == pytest.approx(3e-6)
    assert line.intercept == pytest.approx(0.002)
    assert line.curvature == pytest.approx(0.0, abs=1e-15)
    assert line.at(50_000) == pytest.approx(0.152)


def test_a_quadratic_shows_its_curvature() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    line = fit_line(xs, [2 * x * x for x in xs])
    assert line is not None
    assert line.curvature == pytest.approx(2.0)
    # The least-squares line through 2, 8, 18, 32.
    assert line.slope == pytest.approx(10.0)
    assert line.intercept == pytest.approx(-10.0)


def test_two_points_give_a_line_but_no_curvature_and_one_gives_nothing() -> None:
    line = fit_line([1.0, 3.0], [1.0, 5.0])
    assert line is not None and line.slope == pytest.approx(2.0) and line.curvature is None
    assert fit_line([2.0, 2.0], [1.0, 3.0]) is None
    assert fit_line([1.0], [1.0]) is None


def test_the_cost_beyond_the_floor_is_per_item() -> None:
    # 1,000 episodes: 0.05 s against a floor of 0.03 s is 20 us each beyond it.
    assert beyond_floor_us(0.05, 0.03, 1_000) == pytest.approx(20.0)
    assert beyond_floor_us(0.02, 0.03, 1_000) == pytest.approx(-10.0)
    with pytest.raises(ValueError, match="items"):
        beyond_floor_us(1.0, 0.5, 0)


def test_the_spread_of_repeats() -> None:
    shown = spread([31.0, 28.0, 35.0, 30.0])
    assert shown is not None
    assert (shown.median, shown.low, shown.high, shown.repeats) == (30.5, 28.0, 35.0, 4)
    assert spread([]) is None
