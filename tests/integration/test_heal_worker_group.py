"""A SIGKILLed worker of a group is healed in place at its own address (docs/spec.md
sections 3.9 item 5 and 7.15 item 9).

Real participants on 127.0.0.1: the policy and both resources servers in this process,
the agents a real :class:`WorkerGroup` of two ``turnpoint serve`` workers (agents-w0,
agents-w1), given to the coordinator by the group's name and shared address. One
group-scored sibling is parked at its verify on each worker (alone, it waits for its
sibling forever, so both are in flight whatever the timing) and a snapshot saves them.
agents-w1 is SIGKILLed: the group's parent restarts it on its own port, the liveness
watch finds it lost, and :class:`StableAddressLauncher` starts nothing but waits until
that address answers as a new incarnation. Only its sibling is restored there (as
attempt 1, by RestoreRunning: the Python SDK serves it) while agents-w0's keeps running
as attempt 0. A re-attach naming the dead worker's incarnation is refused by the new
one. Then each group's second sibling is dispatched and both groups finish.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import grpc
import pytest

from tests.support.healing import healing_facade
from tests.support.participants import METADATA, TOKEN, guess_agent_command, start_topology
from tests.support.scripted import poll
from turnpoint._status import error_from_rpc
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.auth import TOKEN_ENV
from turnpoint.convert import episode_to_proto
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.server import WorkerGroup
from turnpoint.trainer import (
    LaunchError,
    RolloutClientSettings,
    RolloutOutcome,
    SnapshotOutcome,
    StableAddressLauncher,
)
from turnpoint.v1 import rollout_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2_grpc as pb_grpc

GROUP_SIZE = 2
BOUND_S = 60.0


async def _reattach(address: str, episode: EpisodeId, incarnation: str) -> TurnpointError | None:
    """A raw re-attaching Run of ``episode`` naming ``incarnation``: its refusal."""
    request = pb.RunRequest(
        request_id="reattach",
        episode=episode_to_proto(episode),
        boundaries_seen=1,
        participant_incarnation=incarnation,
    )
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).Run(request, metadata=METADATA, timeout=BOUND_S)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            return error_from_rpc(error)
    return None


async def test_a_killed_worker_is_healed_in_place_at_its_own_address(tmp_path: Path) -> None:
    root = tmp_path / "p"
    async with start_topology(root, agents=0, group_size=GROUP_SIZE) as topology:
        env = dict(os.environ)
        env[TOKEN_ENV] = TOKEN
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        # The slot in the environment gives each worker its name, host and ports.
        command = guess_agent_command(
            "agents",
            root,
            group_size=GROUP_SIZE,
            policy=topology.policy.address,
            tools=topology.tools.address,
            group_tools=topology.group_tools.address,
            own_port=False,
        )
        group = WorkerGroup("agents", 2, command, env=env, start_timeout_s=BOUND_S)
        await asyncio.wait_for(group.start(), BOUND_S)
        try:
            launcher = StableAddressLauncher(
                {"agents": group.shared_address}, token=TOKEN, timeout_s=BOUND_S
            )
            assert await launcher.learn() == {m.instance: m.address for m in group.members}
            first = launcher.incarnation("agents-w1")
            assert first is not None
            participants = {n: h.address for n, h in topology.participants.items()}
            participants["agents"] = group.shared_address
            ckpt = healing_facade(
                root,
                participants,
                launcher,
                # The dead worker's Run is re-attached, not given up, until the heal
                # takes it over: the heal, not the rollout client, decides its fate.
                rollout_settings=RolloutClientSettings(reattach_attempts=1000),
            )
            async with ckpt:
                # Groups 1 and 3 are group-scored: sibling 0 of each alone parks at its
                # verify. Group 1's lands on agents-w1, group 3's on agents-w0.
                stays = guess_rollouts(3, GROUP_SIZE, 0, ("agents-w0",))
                lost = guess_rollouts(1, GROUP_SIZE, 0, ("agents-w1",))
                ckpt.dispatch(stays[0])
                ckpt.dispatch(lost[0])
                rollouts = ckpt.rollouts
                await rollouts.wait_for(
                    lambda: sum(r.boundaries_seen >= 1 for r in rollouts.in_flight()) == 2,
                    BOUND_S,
                )
                report = await ckpt.snapshot_now()
                assert report.outcome is SnapshotOutcome.PUBLISHED, report
                before = ckpt.coordinator.topology.participants["agents-w1"]
                assert before.incarnation == first

                pid = group.pid(1)
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                await poll(lambda: len(ckpt.heals) == 1, BOUND_S)
                (plan,) = ckpt.heals
                assert plan.lost.instance == "agents-w1"
                assert [s.episode.rollout_id for s in plan.continued] == [lost[0].rollout_id]
                assert plan.untouched == (stays[0].rollout_id,)
                saved = EpisodeId(lost[0].rollout_id, 0)
                assert plan.replacement_scope == (saved,)
                # Nothing was started by the launcher: the group restarted the worker,
                # at the same address, and the coordinator addresses it there again.
                assert group.restarts(1) == 1 and group.restarts(0) == 0
                assert launcher.replaced == {"agents-w1": 1}
                after = ckpt.coordinator.topology.participants["agents-w1"]
                assert after.incarnation not in ("", first)
                assert launcher.incarnation("agents-w1") == after.incarnation
                assert ckpt.coordinator.endpoints["agents-w1"] == group.members[1].address
                # The replacement serves RestoreRunning: its saved sibling went there so.
                assert after.restore_running
                # A re-attach of the lost attempt that names the dead worker's incarnation,
                # as the rollout client's do, is refused there and starts nothing
                # (docs/spec.md section 6.5 item 5), before or after the heal.
                refusal = await _reattach(group.members[1].address, saved, first)
                assert refusal is not None and refusal.reason is Reason.STALE_ATTEMPT
                assert refusal.metadata["request_incarnation"] == first
                assert refusal.metadata["incarnation"] == after.incarnation

                ckpt.dispatch(stays[1])
                ckpt.dispatch(lost[1])
                assert await ckpt.wait_groups(2, timeout_s=BOUND_S)
                groups = ckpt.take_ready_groups(2)
            attempts = {r.episode.rollout_id: r.episode.attempt for g in groups for r in g}
            assert attempts == {
                stays[0].rollout_id: 0,  # kept running on agents-w0 through the heal
                stays[1].rollout_id: 0,
                lost[0].rollout_id: 1,  # continued from the snapshot on the new agents-w1
                lost[1].rollout_id: 0,
            }
            assert {r.outcome for g in groups for r in g} == {RolloutOutcome.COMPLETED}
        finally:
            assert await asyncio.wait_for(group.stop(), BOUND_S), "a worker did not exit 0"


async def test_a_worker_nobody_restarts_fails_the_launch_in_bounded_time(
    tmp_path: Path,
) -> None:
    root = tmp_path / "p"
    async with start_topology(root, agents=1, group_size=GROUP_SIZE) as topology:
        agent = topology.agents[0]
        launcher = StableAddressLauncher(
            {"agent-0": agent.address}, token=TOKEN, timeout_s=0.5, poll_interval_s=0.05
        )
        await launcher.learn()
        # Still its first incarnation: nothing restarted it, so no replacement comes.
        with pytest.raises(LaunchError, match="did not answer as a new incarnation"):
            await launcher.replace("agent-0")
        with pytest.raises(LaunchError, match="never learned"):
            await launcher.replace("tools")
        refused = StableAddressLauncher({"agent-0": agent.address}, token="not-the-token")
        with pytest.raises(LaunchError, match="refused Describe"):
            await refused.learn()
