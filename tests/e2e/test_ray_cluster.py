"""Participants as Ray actors on a cluster of three nodes, and a node lost mid-run.

Every cluster here is a head and two more nodes on this machine
(:class:`turnpoint.server.ray.LocalCluster`, every address on loopback), each node
offering the custom resource the participants reserve, so that they spread over nodes.

- The library: a :class:`ParticipantFleet` of lightweight participants spreads over the
  three nodes, each serving on its node's address as Ray reports it; the real
  coordinator, given the fleet's endpoints as plain addresses, takes a snapshot; an actor
  Ray restarts comes back as a fresh participant on a new address; a removed node's
  participants are seen lost and a job restart puts every replacement on the remaining
  nodes.
- The main job: ``turnpoint demo --ray-nodes 3 --storage s3 --lose-node`` removes the
  node hosting an agent mid-run (the servers run on the head node, never removed); only
  its agents are replaced, on the other nodes, and the trainer heals each in place from
  the last published snapshot in the object store, with no job restart (docs/spec.md
  sections 7.12, 7.15, 8.12), and the exactly-once audit passes. The nodes' participants write only to the store,
  which they reach through the environment Ray gives their actors.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from tests.support.demo import DEMO, SHORT
from turnpoint.apps.bench._ray_scale import NODE_RESOURCE, NoopParticipant, measure_size
from turnpoint.ids import make_checkpoint_id
from turnpoint.server import ServerOptions
from turnpoint.server.ray import (
    FleetError,
    FleetOptions,
    LocalCluster,
    ParticipantFleet,
    ParticipantGroup,
    Placement,
    alive_nodes,
)
from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.advanced import Coordinator, bump_epoch

pytestmark = pytest.mark.slow

TOKEN = "ray-cluster-test-token-0123456789abcdef"
BOUND_S = 60.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    made = LocalCluster(3, resources={NODE_RESOURCE: 4})
    try:
        made.connect()
        yield made
    finally:
        made.shutdown()


def _node_addresses() -> dict[str, str]:
    import ray

    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}


async def _incarnations(endpoints: dict[str, str], root: Path) -> dict[str, str]:
    identity = await asyncio.to_thread(bump_epoch, root, coordinator_id="ray-test")
    coordinator = Coordinator(
        endpoints,
        token=TOKEN,
        coordinator_id=identity.coordinator_id,
        epoch=identity.epoch,
        config=CoordinatorConfig(snapshot_root=root, control_timeout_s=30.0),
    )
    try:
        async with asyncio.timeout(BOUND_S):
            topology = await coordinator.discover()
    finally:
        await coordinator.close()
    return {name: info.incarnation for name, info in topology.participants.items()}


async def _until(predicate: Any, seconds: float = BOUND_S) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():  # noqa: ASYNC110 - Ray notifies the fleet's watch, not us
            await asyncio.sleep(0.05)


@pytest.mark.timeout(180)
async def test_a_fleet_spreads_serves_restarts_and_survives_a_lost_node(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    placement = Placement(resources={NODE_RESOURCE: 1})
    build = NoopParticipant(str(tmp_path))
    fleet = ParticipantFleet(
        [
            ParticipantGroup.replicas(
                "tools", 3, kind="resources", build=build, placement=placement
            ),
            ParticipantGroup.replicas(
                "verify", 3, kind="resources", build=build, placement=placement, max_restarts=1
            ),
        ],
        FleetOptions(server=ServerOptions(token=TOKEN, grace_seconds=0.0)),
    )
    async with fleet:
        # Spread: two actors on each of the three nodes, each on its node's address.
        described = fleet.describe()
        nodes = _node_addresses()
        assert len(described) == 6
        assert {e.node_id for e in described} == set(nodes)
        for endpoint in described:
            host, _, port = endpoint.address.rpartition(":")
            assert host == nodes[endpoint.node_id] == "127.0.0.1" and int(port) > 0

        # The coordinator takes plain addresses and snapshots every participant.
        endpoints = fleet.endpoints()
        ids = (make_checkpoint_id("raytest", n) for n in range(1, 100))
        row = await measure_size(
            endpoints, 3, root=tmp_path, token=TOKEN, ids=ids, rounds=1, warmup=0
        )
        assert row.participants == 6 and row.total_ms > 0
        before = await _incarnations(endpoints, tmp_path)

        # Ray restarts a crashed actor (max_restarts=1): a fresh participant, new address.
        restartable = next(a for a in fleet.actors if a.group.max_restarts)
        (crashed,) = restartable.instances
        restartable.crash()
        await _until(lambda: fleet.lost() == [crashed])
        assert await fleet.refresh() == [crashed]
        assert fleet.lost() == []
        after = await _incarnations(fleet.endpoints(), tmp_path)
        assert after[crashed] != before[crashed]
        assert {n: i for n, i in after.items() if n != crashed} == {
            n: i for n, i in before.items() if n != crashed
        }

        # Healing in place (docs/spec.md section 7.15): the fleet is the launcher. One
        # participant is replaced under its name; no other actor is touched.
        healed = "tools-1"
        address = await fleet.replace(healed)
        assert fleet.endpoints()[healed] == address and fleet.lost() == []
        after_heal = await _incarnations(fleet.endpoints(), tmp_path)
        assert after_heal[healed] != after[healed]
        assert {n: i for n, i in after_heal.items() if n != healed} == {
            n: i for n, i in after.items() if n != healed
        }
        with pytest.raises(FleetError):
            await fleet.replace("tools-9")
        after = after_heal

        # A node goes away with its participants; the job restart puts every replacement
        # on the remaining nodes, where the coordinator finds them all fresh.
        node = cluster.worker_node_ids()[0]
        on_node = sorted(e.instance for e in fleet.describe() if e.node_id == node)
        assert len(on_node) == 2
        await asyncio.to_thread(cluster.remove_node, node)
        await _until(lambda: sorted(fleet.lost()) == on_node)
        assert node not in alive_nodes()
        await fleet.restart()
        replaced = fleet.describe()
        assert len(replaced) == 6 and node not in {e.node_id for e in replaced}
        assert len({e.node_id for e in replaced}) == 2
        fresh = await _incarnations(fleet.endpoints(), tmp_path)
        assert set(fresh) == set(before)
        assert not set(fresh.values()) & set(after.values())


# ---------------------------------------------------------------------- the main job


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(300)
def test_the_demo_on_three_nodes_and_an_object_store_loses_one_and_passes_the_audit(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [*DEMO, *SHORT, "--ray-nodes", "3", "--storage", "s3", "--lose-node", "--out", str(out)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    context = f"stdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, context
    assert "audit: passed" in result.stdout.splitlines(), context

    # Only the lost node's participants were replaced, each healed in place by the
    # trainer: no crash, no job restart (docs/spec.md sections 7.12 and 7.15).
    supervisor = _jsonl(out / "supervisor.jsonl")
    lost, *replaced = supervisor
    assert lost["type"] == "node_lost" and lost["instances"], supervisor
    assert [e["type"] for e in replaced] == ["replaced"] * len(lost["instances"]), supervisor
    assert sorted(e["instance"] for e in replaced) == sorted(lost["instances"])
    # The servers stay on the head node, which is never removed: only agents were lost.
    assert all(name.startswith("agent-") for name in lost["instances"]), lost
    report = result.stdout
    assert f"participants replaced  │ {len(lost['instances'])}" in report, context
    assert "crashes / job restarts │ 0 / 0" in report, context

    # Generation 1 spread over the three nodes; each replacement is a generation of its
    # own, placed on a node that is alive.
    placements = _jsonl(out / "logs" / "ray-placement.jsonl")
    first = {p["instance"]: p["node_id"] for p in placements if p["generation"] == 1}
    later = [p for p in placements if p["generation"] > 1]
    assert len(set(first.values())) == 3
    assert sorted(p["instance"] for p in later) == sorted(lost["instances"])
    assert lost["node_id"] not in {p["node_id"] for p in later}
    assert {i for i, n in first.items() if n == lost["node_id"]} == set(lost["instances"])
    # Every snapshot went to the store; the run's directory holds none.
    assert json.loads((out / "topology.json").read_text())["snapshot_root"].startswith("s3://")
    assert not (out / "snapshots").exists()

    # One trainer incarnation throughout, which healed each lost agent from the last
    # published snapshot before it: no job restore.
    events = _jsonl(out / "events.jsonl")
    assert {e["incarnation"] for e in events if "incarnation" in e} == {1}
    assert [e for e in events if e["type"] == "restore"] == []
    heals = [e for e in events if e["type"] == "heal"]
    assert sorted(h["lost"] for h in heals) == sorted(lost["instances"]), heals
    assert all(h["participant_kind"] == "AGENT" for h in heals), heals
    published = {
        e["checkpoint_id"]
        for e in events
        if e["type"] == "snapshot" and e["outcome"] == "published"
    }
    assert all(h["checkpoint_id"] in published for h in heals), heals
    print(f"heals: {[(h['lost'], h['continued'], h['rerun'], h['running']) for h in heals]}")
