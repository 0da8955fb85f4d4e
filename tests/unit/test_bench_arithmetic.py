"""The bench's arithmetic (``turnpoint.apps.bench._arithmetic``): the bootstrap interval
of the on/off ratio over pairs of runs, a run's steady-state window, the cost of
snapshots as a share of rollout-seconds, the slope of a figure against episodes, the
cost beyond a floor and the spread of repeats."""

from __future__ import annotations

import pytest

from turnpoint.apps.bench._arithmetic import (
    Window,
    beyond_floor_us,
    block_windows,
    bookkeeping_by_cpu,
    closed_fraction,
    fit_line,
    integrate,
    integrate_between,
    ratio_interval,
    spread,
    steady_window,
)


def test_the_interval_holds_the_ratio_of_means_and_is_reproducible() -> None:
    on = [95.0, 97.0, 99.0, 96.0, 98.0]
    off = [100.0, 101.0, 99.0, 100.0, 100.0]
    pairs = list(zip(on, off, strict=True))
    interval = ratio_interval(pairs, seed=7)
    assert interval is not None
    assert interval.ratio == pytest.approx(97.0 / 100.0)
    assert interval.low < interval.ratio < interval.high
    # The resampled means stay within the pairs' own extremes.
    assert interval.low >= min(on) / max(off) and interval.high <= max(on) / min(off)
    assert interval.width == pytest.approx(interval.high - interval.low)
    # One seed, one interval; another seed draws other resamples.
    assert ratio_interval(pairs, seed=7) == interval
    assert ratio_interval(pairs, seed=8) != interval


def test_pairs_are_resampled_whole_so_load_shared_by_a_pair_cancels() -> None:
    # The machine ran at full speed, at half and at double (other load came and went),
    # and each pair's two runs saw the same: every pair's ratio is 0.99, and so is every
    # resample's, whatever pairs it draws.
    pairs = [(99.0, 100.0), (49.5, 50.0), (198.0, 200.0), (99.0, 100.0), (148.5, 150.0)]
    interval = ratio_interval(pairs)
    assert interval is not None
    assert interval.ratio == pytest.approx(0.99)
    assert interval.low == pytest.approx(0.99) and interval.high == pytest.approx(0.99)


def test_identical_runs_give_an_interval_of_no_width() -> None:
    interval = ratio_interval([(50.0, 50.0)] * 5)
    assert interval is not None
    assert (interval.low, interval.ratio, interval.high) == (1.0, 1.0, 1.0)
    assert interval.to_json()["width"] == 0.0


def test_noisier_runs_widen_the_interval() -> None:
    quiet = ratio_interval(list(zip([99.0, 100.0, 101.0] * 2, [100.0] * 6, strict=True)))
    noisy = ratio_interval(list(zip([80.0, 100.0, 120.0] * 2, [100.0] * 6, strict=True)))
    assert quiet is not None and noisy is not None
    assert noisy.width > 5 * quiet.width


@pytest.mark.parametrize(
    "pairs", [[], [(1.0, 0.0), (2.0, 0.0)], [(-1.0, 1.0)]], ids=["no-pair", "off-0", "on-negative"]
)
def test_no_interval_without_pairs_with_positive_means(pairs: list[tuple[float, float]]) -> None:
    assert ratio_interval(pairs) is None


def test_the_steady_window_counts_whole_steps_between_start_up_and_drain() -> None:
    # Eight steps of 32 rollouts: the first two end in a burst, the last two in the
    # drain; the steady state is steps 3 to 6, timed from the end of step 2 (t = 2.0) to
    # the end of step 6 (t = 6.0).
    ends = [1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0, 12.0]
    window = steady_window([(t, 32) for t in ends], head=2, tail=2)
    assert window == Window(rollouts=4 * 32, seconds=4.0, opened=2.0)
    assert window.per_second == pytest.approx(32.0)
    assert window.closed == 6.0
    # A run killed in its stride has no drain to leave out.
    assert steady_window([(t, 32) for t in ends], head=2, tail=0) == Window(6 * 32, 10.0, 2.0)
    # Steps of different sizes count what each trained.
    assert steady_window([(1.0, 8), (2.0, 4), (4.0, 12)], head=1, tail=0) == Window(16, 3.0, 1.0)


def test_no_steady_window_without_a_step_between_start_up_and_drain() -> None:
    steps = [(1.0, 32), (2.0, 32), (3.0, 32), (4.0, 32)]
    assert steady_window(steps, head=2, tail=2) is None
    assert steady_window([], head=2, tail=2) is None
    assert steady_window(steps, head=2, tail=1) == Window(32, 1.0, 2.0)
    with pytest.raises(ValueError, match="head"):
        steady_window(steps, head=0, tail=2)


def test_blocks_are_windows_of_whole_steps_from_the_end_of_the_block_before() -> None:
    # Eleven steps of 8 rollouts in blocks of 2: block 0 (steps 1-2) holds the start-up
    # and has no block before it; the last two steps are the drain, so blocks 1 to 3
    # (steps 3 to 8) are measured and block 4 (steps 9 and 10) reaches into the drain.
    ends = [1.0, 1.5, 3.0, 3.5, 5.5, 6.0, 7.0, 8.0, 9.5, 10.0, 12.0]
    windows = block_windows([(t, 8) for t in ends], block_steps=2, tail=2)
    assert windows == {
        1: Window(16, 2.0, opened=1.5),
        2: Window(16, 2.5, opened=3.5),
        3: Window(16, 2.0, opened=6.0),
    }
    # Without a drain, block 4 ends with step 10 and counts; step 11 begins block 5,
    # which the run did not finish.
    assert set(block_windows([(t, 8) for t in ends], block_steps=2, tail=0)) == {1, 2, 3, 4}
    assert block_windows([(1.0, 8)], block_steps=2, tail=0) == {}
    with pytest.raises(ValueError, match="block_steps"):
        block_windows([], block_steps=0, tail=0)


def test_block_boundaries_at_the_mean_end_of_the_pipeline_s_steps() -> None:
    # A pipeline two steps deep: two chains of steps, A ending every 3 s and B 0.2 s
    # after it, until one of B's periods takes 4 s (a slow step) and B goes on 1.2 s
    # behind A. In blocks of 2 steps, one of each chain, block 2 (steps 5 and 6) holds
    # A's 3 s and B's 4 s.
    chain_a = [1.0, 4.0, 7.0, 10.0, 13.0, 16.0]
    chain_b = [1.2, 4.2, 8.2, 11.2, 14.2, 17.2]
    ends = sorted(chain_a + chain_b)
    steps = [(t, 32) for t in ends]
    # From one step's end to another's, block 2 reads B's 4 s alone.
    single = block_windows(steps, block_steps=2, tail=0)
    assert [single[block].seconds for block in (1, 2, 3)] == pytest.approx([3.0, 4.0, 3.0])
    # Between the mean ends of two steps, it reads the mean of the chains' periods.
    paired = block_windows(steps, block_steps=2, tail=0, depth=2)
    assert set(paired) == {1, 2, 3, 4, 5}
    assert paired[2] == Window(64, pytest.approx(3.5), opened=pytest.approx(4.1))
    assert [paired[block].seconds for block in (1, 3, 4, 5)] == pytest.approx([3.0] * 4)
    # In blocks of one step, block 1's opening would need a step before the first.
    assert min(block_windows(steps, block_steps=1, tail=0, depth=2)) == 2
    with pytest.raises(ValueError, match="depth"):
        block_windows(steps, block_steps=2, tail=0, depth=0)


def test_rollout_seconds_between_two_times_interpolate_the_samples_at_the_ends() -> None:
    # 4 in flight from t=0 to 2, then down to 0 at t=4 (12 rollout-seconds in all).
    samples = [(0.0, 4.0), (2.0, 4.0), (4.0, 0.0)]
    assert integrate_between(samples, 0.0, 4.0) == pytest.approx(12.0)
    assert integrate_between(samples, 1.0, 3.0) == pytest.approx(4.0 + 3.0)
    # Past the last sample its value holds; an empty span holds nothing.
    assert integrate_between(samples, 4.0, 6.0) == 0.0
    assert integrate_between([(0.0, 2.0)], 1.0, 3.0) == pytest.approx(4.0)
    assert integrate_between(samples, 3.0, 3.0) == 0.0
    assert integrate_between([], 0.0, 1.0) == 0.0


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


def test_the_bookkeeping_repeats_are_summed_up_per_cpu_they_were_pinned_to() -> None:
    assert bookkeeping_by_cpu([5.0, 9.0, 7.0, 1.0, 3.0], [2, 0, 2, None, 2]) == {0: 9.0, 2: 5.0}
    assert bookkeeping_by_cpu([4.0, 6.0], [1, 1]) == {1: 5.0}
    assert bookkeeping_by_cpu([4.0], [None]) == {}
    with pytest.raises(ValueError, match="2 repeats but 1 CPUs"):
        bookkeeping_by_cpu([4.0, 6.0], [1])
