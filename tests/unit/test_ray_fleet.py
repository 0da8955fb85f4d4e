"""The pure parts of running on Ray: how a fleet cuts its groups into actors, how the
bench spreads its participants, and the demo's flags for a cluster and a lost node.
(The cluster itself is exercised in tests/e2e/test_ray_cluster.py.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("ray")

from turnpoint.apps.bench._cli import add_bench_parser
from turnpoint.apps.bench._ray_scale import NoopParticipant, participant_names
from turnpoint.apps.demo._supervisor import DemoOptions
from turnpoint.server.ray import ParticipantFleet, ParticipantGroup, Placement

BUILD = NoopParticipant("/nonexistent")


def test_replicas_are_numbered_and_cut_into_actors_of_per_actor() -> None:
    group = ParticipantGroup.replicas("agent", 5, kind="agent", build=BUILD, per_actor=2)
    assert group.instances == ("agent-0", "agent-1", "agent-2", "agent-3", "agent-4")
    assert group.actor_instances() == [("agent-0", "agent-1"), ("agent-2", "agent-3"), ("agent-4",)]


@pytest.mark.parametrize(
    "options",
    [
        {"instances": ()},
        {"instances": ("a", "a")},
        {"instances": ("a",), "per_actor": 0},
        {"instances": ("a",), "max_restarts": -1},
    ],
)
def test_a_group_that_cannot_be_launched_is_refused(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ParticipantGroup(kind="agent", build=BUILD, **options)  # type: ignore[arg-type]


def test_an_instance_in_two_groups_is_refused() -> None:
    one = ParticipantGroup(kind="agent", instances=("x",), build=BUILD)
    other = ParticipantGroup(kind="resources", instances=("x",), build=BUILD)
    with pytest.raises(ValueError, match="two groups"):
        ParticipantFleet([one, other], options=None)  # type: ignore[arg-type]


def test_a_placement_reserves_nothing_negative() -> None:
    with pytest.raises(ValueError):
        Placement(resources={"gpu": -1})


def test_the_first_n_bench_participants_spread_over_every_actor() -> None:
    actors = participant_names(256, 6)
    assert sorted(name for names in actors for name in names) == [f"p{i:04d}" for i in range(256)]
    assert {len(names) for names in actors} == {42, 43}
    first_eight = {f"p{i:04d}" for i in range(8)}
    holding = [index for index, names in enumerate(actors) if first_eight & set(names)]
    assert holding == list(range(6))
    assert participant_names(2, 6) == [("p0000",), ("p0001",)]


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        ({"lose_node": True}, "--lose-node removes a node"),
        ({"lose_node": True, "ray_nodes": 1}, "--lose-node removes a node"),
        ({"lose_node": True, "ray_nodes": 3, "crash": False}, "--lose-node replaces"),
        ({"ray_nodes": 0}, "--ray-nodes must be at least 1"),
        ({"ray_nodes": 3, "ray_address": "127.0.0.1:6379"}, "drop one"),
    ],
)
def test_cluster_flags_that_cannot_work_are_refused(
    flags: dict[str, object], problem: str, tmp_path: Path
) -> None:
    options = DemoOptions(ray=True, out=tmp_path / "out", **flags)  # type: ignore[arg-type]
    assert any(problem in text for text in options.problems()), options.problems()


def test_a_lost_node_on_three_nodes_is_a_valid_demo(tmp_path: Path) -> None:
    options = DemoOptions(ray=True, ray_nodes=3, lose_node=True, out=tmp_path / "out")
    assert options.problems() == []
    # The node's agents heal in place (docs/spec.md 7.15); the trainer never restarts alone
    # on Ray, and a plain Ray run still restarts the job for a lost agent.
    assert options.heal_in_place and not options.restart_trainer_alone
    assert not DemoOptions(ray=True, ray_nodes=3, out=tmp_path / "out").heal_in_place


def test_the_bench_takes_the_ray_scale_option() -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--ray-scale", "--ray-scale-plot", "x.png"])
    assert args.ray_scale and args.ray_scale_plot == "x.png"
