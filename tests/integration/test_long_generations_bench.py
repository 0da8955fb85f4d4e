"""``turnpoint bench --long-generations`` runs end to end on a tiny setting, and its
verdict is computed from the figures. Figures are printed, never asserted: the checks
here are about what the run did (snapshots published, generations cut and continued,
no token twice or lost), not how fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from turnpoint.apps.bench._long_generations import (
    LongGenerationRow,
    add_long_generation_arguments,
    measure_long_generations,
    must_have,
    render_plot,
    render_rows,
)


def _row(tokens: int, cut: bool, *seconds: float) -> LongGenerationRow:
    return LongGenerationRow(
        tokens=tokens,
        cut=cut,
        admission_closed_s=seconds,
        published=len(seconds),
        generations=1,
        continued=1 if cut else 0,
        mismatches=0,
    )


def test_the_verdict_holds_when_cutting_stays_flat_and_fails_when_it_grows() -> None:
    flat = [_row(50, True, 0.02, 0.03), _row(800, True, 0.04, 0.05), _row(800, False, 3.0)]
    verdict = must_have(flat, token_delay_s=0.005)
    assert verdict["held"] is True
    assert verdict["bound_s"] == pytest.approx(0.025 + 0.05 + 0.005)
    growing = [_row(50, True, 0.02), _row(800, True, 0.5)]
    assert must_have(growing, token_delay_s=0.005)["held"] is False


def test_the_options_parse_lengths_and_refuse_nonsense() -> None:
    parser = argparse.ArgumentParser()
    add_long_generation_arguments(parser)
    args = parser.parse_args(["--long-generations", "--generation-lengths", "10,40"])
    assert args.long_generations and args.generation_lengths == (10, 40)
    with pytest.raises(SystemExit):
        parser.parse_args(["--generation-lengths", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--token-delay", "-1"])


async def test_a_tiny_run_cuts_continues_and_loses_no_token(tmp_path: Path) -> None:
    rows = await measure_long_generations(
        tmp_path, (12,), token_delay_s=0.002, snapshots=2, rollouts=2
    )
    assert [(row.tokens, row.cut) for row in rows] == [(12, False), (12, True)]
    for row in rows:
        assert row.published >= 1, render_rows(rows)
        assert row.mismatches == 0, render_rows(rows)
    waiting = rows[0]
    assert waiting.continued == 0  # without cutting nothing is ever continued
    render_plot(rows, tmp_path / "plot.png", 0.002)
    assert (tmp_path / "plot.png").stat().st_size > 0
