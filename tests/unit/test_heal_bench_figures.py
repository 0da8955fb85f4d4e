"""The heal-in-place figure's arithmetic (apps/.../bench/_heal_figures.py): turns
recomputed per way and the ratios heal over restart."""

from __future__ import annotations

import pytest

from turnpoint.apps.bench._heal_figures import HealFigure, RecoveryFigures, turns_recomputed


def test_an_episode_cut_back_redoes_the_turns_above_where_it_resumes() -> None:
    reached = {"a": 7, "b": 5, "kept": 9}
    # a continues from its saved boundary 4, b reruns from its prompt, kept ran on.
    assert turns_recomputed(reached, {"a": 4, "b": 0}) == 3 + 5


def test_an_episode_that_reached_no_further_than_its_resume_point_redoes_nothing() -> None:
    assert turns_recomputed({"a": 3}, {"a": 3}) == 0
    assert turns_recomputed({"a": 2}, {"a": 3}) == 0
    # Cut back before this bench saw it seal anything.
    assert turns_recomputed({}, {"a": 0}) == 0


def test_nothing_cut_back_redoes_nothing() -> None:
    assert turns_recomputed({"a": 10, "b": 4}, {}) == 0


@pytest.mark.parametrize(
    ("reached", "resumed_from"), [({"a": -1}, {"a": 0}), ({"a": 1}, {"a": -2}), ({"a": True}, {})]
)
def test_negative_or_boolean_boundaries_are_refused(
    reached: dict[str, int], resumed_from: dict[str, int]
) -> None:
    with pytest.raises(ValueError, match="negative or non-integer"):
        turns_recomputed(reached, resumed_from)


def _side(way: str, cut: int, turns: int, seconds: float, detected: float = 0.0) -> RecoveryFigures:
    return RecoveryFigures(
        way,  # type: ignore[arg-type]
        episodes_in_flight=256,
        episodes_cut_back=cut,
        turns_recomputed=turns,
        time_to_whole_s=seconds,
        processes_started=1 if way == "heal" else 3,
        detected_s=detected,
    )


def test_the_ratios_are_heal_over_restart() -> None:
    figure = HealFigure(64, 256, _side("heal", 4, 8, 2.0), _side("restart", 256, 640, 8.0))
    assert figure.turns_ratio == pytest.approx(8 / 640)
    assert figure.time_ratio == pytest.approx(0.25)
    shown = figure.to_json()
    assert shown["turns_recomputed_heal_vs_restart"] == round(8 / 640, 4)
    assert shown["time_to_whole_heal_vs_restart"] == 0.25
    assert shown["heal"]["episodes_cut_back"] == 4
    assert shown["restart"]["turns_recomputed"] == 640
    assert "0.0125" in figure.lines()[-1]


def test_the_recovery_leaves_out_the_detection_both_ways_share() -> None:
    heal = _side("heal", 4, 8, 3.0, detected=2.0)
    restart = _side("restart", 256, 640, 6.0, detected=2.0)
    figure = HealFigure(64, 256, heal, restart)
    assert (heal.recovery_s, restart.recovery_s) == (1.0, 4.0)
    assert figure.recovery_ratio == pytest.approx(0.25)
    assert figure.time_ratio == pytest.approx(0.5)
    assert figure.to_json()["recovery_heal_vs_restart"] == 0.25
    assert figure.to_json()["heal"]["recovery_s"] == 1.0


def test_a_restart_that_redid_nothing_has_no_ratio() -> None:
    figure = HealFigure(2, 1, _side("heal", 0, 0, 1.0), _side("restart", 0, 0, 0.0))
    assert figure.turns_ratio is None and figure.time_ratio is None
    assert figure.to_json()["turns_recomputed_heal_vs_restart"] is None
    assert figure.lines()[-1].endswith(
        "turns recomputed n/a, time to whole n/a, from the loss found to whole n/a"
    )


def test_the_figures_refuse_what_cannot_be() -> None:
    with pytest.raises(ValueError, match="way"):
        _side("reboot", 1, 1, 1.0)
    with pytest.raises(ValueError, match="cut back"):
        _side("heal", 300, 1, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        _side("heal", 1, -1, 1.0)
    with pytest.raises(ValueError, match="not within"):
        _side("heal", 1, 1, 1.0, detected=1.5)
    with pytest.raises(ValueError, match="in that order"):
        HealFigure(2, 1, _side("restart", 1, 1, 1.0), _side("heal", 1, 1, 1.0))


def test_check_fails_when_the_heal_cuts_back_about_as_much_as_the_restart() -> None:
    restart = _side("restart", 256, 600, 8.0)
    assert not HealFigure(64, 256, _side("heal", 4, 90, 2.0), restart).regressed  # 0.15
    regressed = HealFigure(64, 256, _side("heal", 4, 91, 2.0), restart)
    assert regressed.regressed and regressed.to_json()["regressed"] is True
    # A restart that redid nothing leaves no ratio to hold: it fails, saying so.
    assert HealFigure(2, 1, _side("heal", 0, 0, 1.0), _side("restart", 0, 0, 1.0)).regressed
