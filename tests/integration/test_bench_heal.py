"""``turnpoint bench-heal`` end to end at a small size: 4 participants, 8 episodes.

Real processes (the counter tools and two agents in one, the victim agent alone), a
real SIGKILL, the real facade healing through a launcher, then the same fleet restarted
whole. Nothing here looks at how fast anything was: the counts follow from the fleet
(the victim holds 2 of the 8 episodes; each sealed at least ``advance_turns`` turns
after the snapshot before the SIGKILL), the ratios are the ratios of the figures next
to them, and no process is left behind.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from tests.integration.test_bench import _children
from turnpoint.apps._cli import main

ADVANCE_TURNS = 2


def test_bench_heal_measures_both_ways_and_leaves_no_process(tmp_path: Path) -> None:
    out = io.StringIO()
    argv = [
        "bench-heal",
        *("--participants", "4", "--episodes", "8", "--processes", "1"),
        *("--turn-delay", "0.02", "--lost-after", "1.0", "--timeout", "60"),
        *("--advance-turns", str(ADVANCE_TURNS), "--root", str(tmp_path), "--json"),
    ]
    with contextlib.redirect_stdout(out):
        code = main(argv)
    assert code == 0, out.getvalue()
    figure = json.loads(out.getvalue())
    heal, restart = figure["heal"], figure["restart"]
    assert (figure["participants"], figure["episodes"]) == (4, 8)
    # agent-2 of agent-0..2 holds episodes 2 and 5; the restart cuts every one back.
    assert (heal["episodes_cut_back"], restart["episodes_cut_back"]) == (2, 8)
    assert (heal["processes_started"], restart["processes_started"]) == (1, 2)
    assert heal["checkpoint_id"] and restart["checkpoint_id"]
    assert heal["turns_recomputed"] >= 2 * ADVANCE_TURNS
    assert restart["turns_recomputed"] >= 8 * ADVANCE_TURNS
    assert figure["turns_recomputed_heal_vs_restart"] == pytest.approx(
        heal["turns_recomputed"] / restart["turns_recomputed"], abs=1e-4
    )
    assert figure["time_to_whole_heal_vs_restart"] == pytest.approx(
        heal["time_to_whole_s"] / restart["time_to_whole_s"], abs=2e-3
    )
    for side in (heal, restart):
        assert 0 < side["detected_s"] <= side["time_to_whole_s"]
    assert _children() == []


def test_bench_heal_refuses_a_fleet_without_an_episode_for_the_victim() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["bench-heal", "--participants", "8", "--episodes", "3"])
    assert code == 2
    assert "episodes must be >= the 7 agents" in err.getvalue()
