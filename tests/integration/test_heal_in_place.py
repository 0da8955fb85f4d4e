"""A lost participant is replaced and healed in place (docs/spec.md section 7.15).

Real participants on 127.0.0.1:0: the policy, both resources servers and agent-0 in this
process, agent-1 a ``turnpoint serve`` child started by :class:`LocalProcessLauncher`.
One group-scored sibling is parked at its verify on each agent (alone, it waits for its
sibling forever, so both are in flight whatever the timing) and a snapshot saves them.
agent-1 is SIGKILLed: the liveness watch finds it lost, the launcher starts a new
agent-1, and only its sibling is restored there (as attempt 1) while agent-0's keeps
running as attempt 0. Then each group's second sibling is dispatched and both groups
finish: no job restart, nothing trained twice, nothing lost.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.healing import healing_facade
from tests.support.participants import TOKEN, guess_agent_command, start_topology
from tests.support.scripted import poll
from turnpoint.apps.examples._build import ExampleSpec, build_example
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.apps.examples._participants import new_policy
from turnpoint.auth import TOKEN_ENV
from turnpoint.ids import EpisodeId
from turnpoint.protocol import ParticipantKind
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.trainer import (
    HealRefusedError,
    LocalProcessLauncher,
    ParticipantLostError,
    RolloutOutcome,
    SnapshotOutcome,
)

GROUP_SIZE = 2
BOUND_S = 60.0


async def test_a_killed_agent_process_is_replaced_and_only_its_episode_is_restored(
    tmp_path: Path,
) -> None:
    root = tmp_path / "p"
    async with start_topology(root, agents=1, group_size=GROUP_SIZE) as topology:
        env = dict(os.environ)
        env[TOKEN_ENV] = TOKEN
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        launcher = LocalProcessLauncher(
            {
                "agent-1": guess_agent_command(
                    "agent-1",
                    root,
                    group_size=GROUP_SIZE,
                    policy=topology.policy.address,
                    tools=topology.tools.address,
                    group_tools=topology.group_tools.address,
                )
            },
            env=env,
        )
        try:
            participants = {n: h.address for n, h in topology.participants.items()}
            participants["agent-1"] = await launcher.start("agent-1")
            # No rollout_settings: with a launcher the default re-attaches the dead
            # agent's Run until the heal takes it over (HEAL_REATTACH_ATTEMPTS): the
            # heal, not the rollout client, decides its fate.
            ckpt = healing_facade(root, participants, launcher)
            async with ckpt:
                # Groups 1 and 3 are group-scored: sibling 0 of each alone parks at its
                # verify. Group 1's lands on agent-1, group 3's on agent-0.
                stays = guess_rollouts(3, GROUP_SIZE, 0, ("agent-0",))
                lost = guess_rollouts(1, GROUP_SIZE, 0, ("agent-1",))
                ckpt.dispatch(stays[0])
                ckpt.dispatch(lost[0])
                rollouts = ckpt.rollouts
                await rollouts.wait_for(
                    lambda: sum(r.boundaries_seen >= 1 for r in rollouts.in_flight()) == 2,
                    BOUND_S,
                )
                report = await ckpt.snapshot_now()
                assert report.outcome is SnapshotOutcome.PUBLISHED, report

                await launcher.kill("agent-1")
                await poll(lambda: len(ckpt.heals) == 1, BOUND_S)
                (plan,) = ckpt.heals
                assert plan.lost.instance == "agent-1"
                assert [s.episode.rollout_id for s in plan.continued] == [lost[0].rollout_id]
                assert plan.untouched == (stays[0].rollout_id,)
                saved = EpisodeId(lost[0].rollout_id, 0)
                # Its episode on the replacement, its session where it runs (the
                # group-scored resources server, which keeps agent-0's session).
                assert plan.replacement_scope == (saved,)
                assert dict(plan.running_scope) == {"group-tools": (saved,)}
                assert launcher.started == {"agent-1": 2}
                # The status page's history records the heal as an event.
                (replaced,) = [
                    e for e in ckpt.history.events_json() if e["kind"] == "participant_replaced"
                ]
                assert replaced["participants"] == ["agent-1"]
                assert (replaced["resumed_rollouts"], replaced["rerun_rollouts"]) == (1, 0)

                ckpt.dispatch(stays[1])
                ckpt.dispatch(lost[1])
                assert await ckpt.wait_groups(2, timeout_s=BOUND_S)
                groups = ckpt.take_ready_groups(2)
            attempts = {r.episode.rollout_id: r.episode.attempt for g in groups for r in g}
            assert attempts == {
                stays[0].rollout_id: 0,  # kept running through the heal
                stays[1].rollout_id: 0,
                lost[0].rollout_id: 1,  # continued from the snapshot on the replacement
                lost[1].rollout_id: 0,
            }
            assert {r.outcome for g in groups for r in g} == {RolloutOutcome.COMPLETED}
        finally:
            await launcher.aclose()


class _NeverCalled:
    """A launcher that must not be asked: the participant's heals are used up."""

    async def replace(self, instance: str) -> str:
        raise AssertionError(f"{instance} was replaced beyond its budget")


async def test_a_participant_replaced_too_often_ends_the_run_with_the_reason(
    tmp_path: Path,
) -> None:
    root = tmp_path / "p"
    async with start_topology(root, agents=2, group_size=GROUP_SIZE) as topology:
        ckpt = healing_facade(
            root,
            {n: h.address for n, h in topology.participants.items()},
            _NeverCalled(),
            lost_after_s=1.0,
            config={"max_restarts": 0},  # no heal allowed: the first loss ends the run
        )
        async with ckpt:
            await topology.agents[1].stop(0)
            with pytest.raises(HealRefusedError) as refused:
                await ckpt.wait_groups(1, timeout_s=BOUND_S)
        assert refused.value.instance == "agent-1"
        assert "max_restarts=0" in refused.value.detail
        assert isinstance(refused.value.__cause__, ParticipantLostError)
        assert ckpt.heals == []


class _PolicyOnItsPort:
    """Replaces the lost policy server in this process, on the port the agents call,
    refusing generations until the trainer's weights reach it (section 7.15 item 9)."""

    def __init__(self, root: Path, lost: HostedParticipant) -> None:
        self._root = root
        self._port = int(lost.address.rpartition(":")[2])
        self.replacement: HostedParticipant | None = None

    async def replace(self, instance: str) -> str:
        assert instance == "policy" and self.replacement is None
        spec = ExampleSpec(instance="policy", root=self._root, token=TOKEN, await_weights=True)
        runtime, closers = build_example("model", "tiny-policy", spec)
        hosted = host_participant(runtime, ServerOptions(port=self._port, token=TOKEN))
        hosted.on_close.extend(closers)
        self.replacement = await hosted.start()
        return self.replacement.address


async def test_a_lost_policy_is_replaced_on_its_port_with_the_current_weights(
    tmp_path: Path,
) -> None:
    """The policy holds no episode: its replacement restores nothing, gets the trainer's
    current weights (section 7.15 item 1) and the agents' generations go on there."""
    root = tmp_path / "p"
    async with start_topology(root, agents=1, group_size=GROUP_SIZE) as topology:
        launcher = _PolicyOnItsPort(root, topology.policy)
        trainer_policy = new_policy(0)
        ckpt = healing_facade(
            root,
            {n: h.address for n, h in topology.participants.items()},
            launcher,
            lost_after_s=1.0,
            weights=trainer_policy.state_bytes,
        )
        try:
            async with ckpt:
                trainer_policy.weights_version = 3
                await ckpt.push_weights(3)
                await topology.policy.stop(0)
                await poll(lambda: len(ckpt.heals) == 1, BOUND_S)
                (plan,) = ckpt.heals
                assert plan.lost.instance == "policy"
                assert plan.lost.kind is ParticipantKind.MODEL
                assert (plan.continued, plan.rerun) == ((), ())
                for rollout in guess_rollouts(0, GROUP_SIZE, 0, ("agent-0",)):
                    ckpt.dispatch(rollout)
                assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
                (group,) = ckpt.take_ready_groups(1)
            assert {r.outcome for r in group} == {RolloutOutcome.COMPLETED}
            versions = {v for r in group for v in r.output["weights_versions"]}
            assert versions == {3}
        finally:
            if launcher.replacement is not None:
                await launcher.replacement.stop(0)
