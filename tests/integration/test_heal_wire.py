"""Healing one lost participant over real gRPC on 127.0.0.1:0 (docs/spec.md section 7.15).

Two agents on the Python SDK, a snapshot with an episode on each. One agent is lost and
a fresh one is started under its name: the coordinator addresses and describes the
replacement, :func:`plan_heal` decides, and the heal's restore (the replacement only)
installs the lost agent's episode as N+1 there while the other agent is never called:
its episode, past the snapshot, finishes as if nothing happened. A heal into a running
participant (RestoreRunning, ``retire_unscoped`` false) replaces only the scoped episode
and leaves the participant's other work running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from tests.support.fakes import FakeAnchor, FakeRollouts, boundary_of, state_of
from tests.support.participants import TOKEN
from tests.support.scripted import FENCE, ScriptedAgent, Wire, bounded, host_scripted, wire_to
from turnpoint.ids import EpisodeId
from turnpoint.protocol import EpisodeState
from turnpoint.trainer import CoordinatorConfig, SnapshotOutcome
from turnpoint.trainer.control.coordinator import Coordinator
from turnpoint.trainer.restore.heal import Member, plan_heal, restore_id_for
from turnpoint.trainer.rollouts.side import InFlightRollout
from turnpoint.trainer.snapshots.driver import SnapshotDriver
from turnpoint.trainer.snapshots.report import SnapshotReport
from turnpoint.trainer.storage.layout import SnapshotLayout
from turnpoint.trainer.storage.manifest import SnapshotManifest
from turnpoint.v1 import rollout_service_pb2 as ro_pb

EP_A = EpisodeId("rollout-a", 0)  # on agent-0, which stays
EP_B = EpisodeId("rollout-b", 0)  # on agent-1, which is lost
EP_C = EpisodeId("rollout-c", 0)  # on agent-0, started after the snapshot
TASK: dict[str, Any] = {"turns": 3}


@asynccontextmanager
async def coordinator_for(root: Path, addresses: dict[str, str]) -> AsyncIterator[Coordinator]:
    config = CoordinatorConfig(snapshot_root=root, control_timeout_s=5.0, resume_retry_pause_s=0)
    # The wire helpers fence their data-plane calls as this coordinator.
    async with Coordinator(
        addresses,
        token=TOKEN,
        coordinator_id=FENCE.coordinator_id,
        epoch=FENCE.epoch,
        config=config,
    ) as coordinator:
        await coordinator.discover()
        yield coordinator


def live(episode: EpisodeId, agent: str, environment: str, boundaries: int) -> InFlightRollout:
    return InFlightRollout(
        episode=episode,
        instance=agent,
        prompt_group_id=f"group-{episode.rollout_id}",
        sibling_index=0,
        group_size=1,
        environment=environment,
        boundaries_seen=boundaries,
    )


async def snapshot(
    coordinator: Coordinator,
    rollouts: FakeRollouts,
    running: dict[EpisodeId, tuple[ScriptedAgent, Wire]],
) -> tuple[SnapshotReport, SnapshotManifest]:
    """Take one snapshot while each running episode seals its first turn."""
    layout = SnapshotLayout(coordinator.config.snapshot_root)
    driver = SnapshotDriver(
        coordinator=coordinator,
        rollouts=rollouts,
        anchor=FakeAnchor(),
        layout=layout,
        config=coordinator.config,
        epoch=coordinator.identity.epoch,
    )
    take = asyncio.create_task(driver.take())
    for episode, (agent, wire) in running.items():
        await wire.until(lambda core: core.active_checkpoint_id is not None)
        agent.release(episode)
    report = await bounded(take)
    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    return report, SnapshotManifest.from_json(layout.manifest_bytes(report.checkpoint_id))


def members(coordinator: Coordinator) -> list[Member]:
    return [
        Member(name, info.kind, info.environment)
        for name, info in coordinator.topology.participants.items()
    ]


async def test_a_lost_agent_is_replaced_and_only_its_episodes_are_restored(
    tmp_path: Path,
) -> None:
    stays, lost, replacement = ScriptedAgent(), ScriptedAgent(), ScriptedAgent()
    async with AsyncExitStack() as stack:
        hosted_0 = await stack.enter_async_context(
            host_scripted(tmp_path, instance="agent-0", agent=stays)
        )
        lost_stack = await stack.enter_async_context(AsyncExitStack())
        hosted_1 = await lost_stack.enter_async_context(
            host_scripted(tmp_path, instance="agent-1", agent=lost)
        )
        wire_0 = await stack.enter_async_context(wire_to(hosted_0, "unary"))
        wire_1 = await lost_stack.enter_async_context(wire_to(hosted_1, "unary"))
        coordinator = await stack.enter_async_context(
            coordinator_for(tmp_path, {"agent-0": hosted_0.address, "agent-1": hosted_1.address})
        )
        environment = coordinator.topology.participants["agent-0"].environment
        run_a = await wire_0.start(EP_A, TASK)
        await wire_1.start(EP_B, TASK)
        rollouts = FakeRollouts()
        rollouts.rollouts = [
            live(EP_A, "agent-0", environment, 0),
            live(EP_B, "agent-1", environment, 0),
        ]
        report, manifest = await snapshot(
            coordinator, rollouts, {EP_A: (stays, wire_0), EP_B: (lost, wire_1)}
        )
        stays.release(EP_A)  # agent-0 moves on past the snapshot
        await wire_0.until(lambda core: boundary_of(core, EP_A) == 2)
        first_incarnation = coordinator.topology.participants["agent-1"].incarnation

        await lost_stack.aclose()  # agent-1 is gone, with its episode
        hosted_1b = await stack.enter_async_context(
            host_scripted(tmp_path, instance="agent-1", agent=replacement)
        )
        info = await coordinator.replace_participant("agent-1", hosted_1b.address)
        assert info.incarnation != first_incarnation

        plan = plan_heal(
            manifest,
            [live(EP_A, "agent-0", environment, 2), live(EP_B, "agent-1", environment, 1)],
            "agent-1",
            members(coordinator),
            coordinator.levels,
            target=coordinator.config.target_level,
            restore_id=restore_id_for(coordinator.identity.epoch, 1),
        )
        assert plan.untouched == (EP_A.rollout_id,) and plan.rerun == ()
        assert [step.episode for step in plan.continued] == [EP_B.next_attempt()]
        assert (plan.replacement_scope, dict(plan.running_scope)) == ((EP_B,), {})
        scope = {"agent-1": plan.replacement_scope, **plan.running_scope}
        async with coordinator.restored(
            plan.restore_id,
            report.checkpoint_id,
            manifest,
            scope,
            instances=scope,
            retire_unscoped=False,
        ) as healed:
            assert healed.installed == {"agent-1": (EP_B.next_attempt(),)}
            # agent-0 is not part of the heal: it never closed, its episode runs on.
            assert (await wire_0.status()).admission_open
            assert state_of(wire_0.core, EP_A) is not None
        assert healed.release is not None and not healed.release.failures

        # The replacement continues from the saved turn; agent-0's episode finishes.
        wire_1b = await stack.enter_async_context(wire_to(hosted_1b, "unary"))
        next_b = EP_B.next_attempt()
        call = wire_1b.run(next_b, TASK)
        replacement.release(next_b, 2)
        assert (await call.done()).outcome == ro_pb.RUN_OUTCOME_COMPLETED
        assert call.boundaries == [2, 3]
        assert [turn.state for _, turn in replacement.started if turn] == [{"history": [0]}]
        stays.release(EP_A)
        assert (await run_a.done()).outcome == ro_pb.RUN_OUTCOME_COMPLETED
        assert run_a.boundaries == [1, 2, 3]


async def test_a_heal_into_a_running_participant_keeps_its_other_work(tmp_path: Path) -> None:
    agent = ScriptedAgent()
    async with (
        host_scripted(tmp_path, instance="agent-0", agent=agent) as hosted,
        wire_to(hosted, "unary") as wire,
        coordinator_for(tmp_path, {"agent-0": hosted.address}) as coordinator,
    ):
        environment = coordinator.topology.participants["agent-0"].environment
        run_a = await wire.start(EP_A, TASK)
        rollouts = FakeRollouts()
        rollouts.rollouts = [live(EP_A, "agent-0", environment, 0)]
        report, manifest = await snapshot(coordinator, rollouts, {EP_A: (agent, wire)})
        run_c = await wire.start(EP_C, TASK)  # this incarnation's, after the snapshot
        async with coordinator.restored(
            restore_id_for(coordinator.identity.epoch, 1),
            report.checkpoint_id,
            manifest,
            {"agent-0": (EP_A,)},
            instances=("agent-0",),
            retire_unscoped=False,
        ) as healed:
            assert healed.installed == {"agent-0": (EP_A.next_attempt(),)}
            assert state_of(wire.core, EP_C) is EpisodeState.RUNNING
        refused = await run_a.refused()
        assert refused.reason.name == "STALE_ATTEMPT"
        agent.release(EP_C, 3)
        assert (await run_c.done()).outcome == ro_pb.RUN_OUTCOME_COMPLETED
