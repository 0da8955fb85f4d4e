"""Failure semantics of the coordinator against real servers on ``127.0.0.1:0``.

- a rollout given up mid-episode has its resources session freed by the next snapshot's
  retire, and the refusal marks that retire raised are forgotten once nothing of the
  rollout can arrive (docs/spec.md section 7.6 items 2 and 6);
- recovery levels are decided, and lowered ones warned about, once at start-up
  (section 7.1 item 3);
- a participant poisoned by a Resume of a far-future id costs one snapshot attempt, not
  the run (section 7.2 item 4);
- commit, retire, forget and restore retries pause before re-sending (section 7.3).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.participants import TOKEN, start_topology
from tests.support.participants import Topology as RealTopology
from turnpoint.apps.examples._task import make_prompt
from turnpoint.ids import EpisodeId, checkpoint_sequence, make_checkpoint_id
from turnpoint.protocol import ParticipantKind, Phase, RecoveryLevel
from turnpoint.server.advanced import BearerTokenInterceptor
from turnpoint.trainer.anchors.source import WrittenAnchor
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.control.coordinator import Coordinator
from turnpoint.trainer.control.operations import JOINING_ATTEMPTS, JOINING_RETRY_PAUSE_S
from turnpoint.trainer.restore.restorer import Restorer, plan_restore
from turnpoint.trainer.rollouts.client import AgentEndpoint, RolloutClient
from turnpoint.trainer.rollouts.values import Rollout, RolloutClientSettings, RolloutOutcome
from turnpoint.trainer.snapshots.driver import SnapshotDriver
from turnpoint.trainer.snapshots.report import FailureReason, SnapshotOutcome
from turnpoint.trainer.storage.layout import SnapshotLayout, tree_digest
from turnpoint.trainer.storage.manifest import (
    AnchorRef,
    ParticipantEntry,
    SnapshotManifest,
    TrainerRolloutState,
)
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

# A safety net for waits on events that must happen; never a synchronisation device.
BOUND_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Anchor:
    def __init__(self) -> None:
        self.step = 1

    async def write(self, snapshot: Path) -> WrittenAnchor:
        directory = snapshot / "trainer" / "anchor"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "state.bin").write_bytes(f"step {self.step}".encode())
        return WrittenAnchor(AnchorRef(sha256=tree_digest(directory)), self.step)


def config_for(root: Path, **overrides: Any) -> CoordinatorConfig:
    settings: dict[str, Any] = {
        "snapshot_root": root,
        "control_timeout_s": 5.0,
        "resume_retry_pause_s": 0.0,
    }
    return CoordinatorConfig(**(settings | overrides))


async def real_coordinator(topology: RealTopology, config: CoordinatorConfig) -> Coordinator:
    coordinator = Coordinator(
        {name: hosted.address for name, hosted in topology.participants.items()},
        token=TOKEN,
        coordinator_id="coord-failures",
        epoch=1,
        config=config,
    )
    await coordinator.discover()
    return coordinator


def group_sibling(
    rollout_id: str, *, budget_s: float | None, sibling: int = 0, size: int = 2
) -> Rollout:
    """One sibling of a group-scored group: without all its siblings it never finishes
    (its verify waits for them), so it is in flight whatever the timing."""
    task = make_prompt(12 + sibling, seed=0)
    return Rollout(
        rollout_id=rollout_id,
        prompt_group_id="gp",
        sibling_index=sibling,
        group_size=size,
        environment="guess-group",
        task={
            "task": task.to_dict(),
            "environment": "guess-group",
            "prompt_group_id": "gp",
            "sibling_index": sibling,
            "group_size": size,
        },
        instance="agent-0",
        budget_s=budget_s,
    )


def refused(topology: RealTopology) -> dict[str, int]:
    return {
        name: hosted.runtime.core.refused_rollouts
        for name, hosted in topology.participants.items()
        if hosted.runtime.core.refused_rollouts
    }


# ---------------------------------------------- sessions freed, marks forgotten (1, 2)


async def test_a_given_up_rollout_frees_its_session_and_its_marks_are_forgotten(
    tmp_path: Path,
) -> None:
    config = config_for(tmp_path, keep_snapshots=2)
    layout = SnapshotLayout(tmp_path)
    clock = FakeClock()
    anchor = Anchor()
    async with start_topology(tmp_path, agents=1, group_size=2) as topology:
        group_tools = topology.group_tools.runtime
        coordinator = await real_coordinator(topology, config)
        agent = AgentEndpoint(topology.agents[0].address, TOKEN)
        settings = RolloutClientSettings(budget_grace_s=0.0)
        async with (
            coordinator,
            RolloutClient({"agent-0": agent}, settings=settings, clock=clock) as client,
        ):
            episode = client.dispatch(group_sibling("pair-0", budget_s=10.0))
            # Its session is seeded on the group-scored tools server.
            assert await group_tools.wait_until(
                lambda core: any(e.key.episode == episode for e in core.entries()), BOUND_S
            )
            clock.now += 11.0
            assert client.expire_due() == [episode]
            assert client.results()[0].outcome is RolloutOutcome.GIVEN_UP
            driver = SnapshotDriver(
                coordinator=coordinator,
                rollouts=client,
                anchor=anchor,
                layout=layout,
                config=config,
                epoch=1,
            )

            first = await driver.take()

            assert first.outcome is SnapshotOutcome.PUBLISHED, first.detail
            # The retire reached the resources servers too: the session is gone.
            assert not any(group_tools.core.entries())
            assert client.pending_retires() == {}
            marked = {"agent-0": 1, "tools": 1, "group-tools": 1}
            assert refused(topology) == marked

            # The training loop consumes the result. The first snapshot still names the
            # rollout (in its queue): its marks stay until that snapshot left retention
            # (keep_snapshots = 2), so the fourth snapshot's retire step forgets them.
            await client.next_result(0)
            for expected in (marked, marked, {}):
                anchor.step += 1
                report = await driver.take()
                assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
                assert refused(topology) == expected

    assert driver.refusal_marks == {}


# --------------------------------------------------- far-future Resume poisoning (5)


async def test_a_far_future_resume_costs_one_attempt_not_the_run(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    layout = SnapshotLayout(tmp_path)
    async with start_topology(tmp_path, agents=1, group_size=2) as topology:
        coordinator = await real_coordinator(topology, config)
        async with coordinator, RolloutClient({}) as client:
            driver = SnapshotDriver(
                coordinator=coordinator,
                rollouts=client,
                anchor=Anchor(),
                layout=layout,
                config=config,
                epoch=1,
            )
            far = 900_000_000_000
            # A Resume of an id far in the future: every lower id is finished there.
            poisoned = await coordinator.resume(make_checkpoint_id("ck", far), ["tools"])
            assert poisoned.ok

            failed = await driver.take()

            assert failed.outcome is SnapshotOutcome.FAILED
            assert failed.reason is FailureReason.SUPERSEDED and failed.transient
            assert set(failed.failures) == {"tools"}

            retried = await driver.take(failed.checkpoint_id)

            assert retried.outcome is SnapshotOutcome.PUBLISHED, retried.detail
            assert checkpoint_sequence(retried.checkpoint_id) == far + 1
            assert layout.latest() == retried.checkpoint_id
            phases = {h.runtime.phase for h in topology.participants.values()}
            assert phases == {Phase.IDLE}


# ------------------------------------------------------ levels decided at start-up (3)


class Describes(pb_grpc.CheckpointControlServiceServicer):
    """A participant that only describes itself (every other call is unimplemented)."""

    def __init__(self, name: str, kind: int, environment: str, mode: int) -> None:
        self.name = name
        self.kind = kind
        self.environment = environment
        self.mode = mode

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DescribeResponse:
        restart_only = self.mode == types_pb2.RECOVERY_MODE_RESTART_ONLY
        return pb.DescribeResponse(
            header=types_pb2.ResponseHeader(participant_id=self.name, incarnation="inc-1"),
            kind=self.kind,
            instance_name=self.name,
            protocol_version="turnpoint.v1",
            recovery_mode=self.mode,
            verify_mode=types_pb2.VERIFY_MODE_WAIT,
            supported_levels=(
                [types_pb2.RECOVERY_LEVEL_SIBLING, types_pb2.RECOVERY_LEVEL_PROMPT_GROUP]
                if restart_only
                else [types_pb2.RECOVERY_LEVEL_TURN]
            ),
            environment=self.environment,
            phase=types_pb2.PHASE_IDLE,
        )


@pytest.fixture
async def described() -> AsyncIterator[dict[str, str]]:
    agent, resources = types_pb2.PARTICIPANT_KIND_AGENT, types_pb2.PARTICIPANT_KIND_RESOURCES
    exported, restart_only = types_pb2.RECOVERY_MODE_EXPORTED, types_pb2.RECOVERY_MODE_RESTART_ONLY
    participants = [
        Describes("agent-0", agent, "math", exported),
        Describes("math-tools", resources, "math", restart_only),
        Describes("chess-tools", resources, "chess", exported),
    ]
    servers: list[grpc.aio.Server] = []
    addresses: dict[str, str] = {}
    try:
        for participant in participants:
            server = grpc.aio.server(interceptors=[BearerTokenInterceptor(TOKEN, open_services=())])
            pb_grpc.add_CheckpointControlServiceServicer_to_server(participant, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
            addresses[participant.name] = f"127.0.0.1:{port}"
        yield addresses
    finally:
        for server in servers:
            await server.stop(None)


def level_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "recovery level lowered" in r.getMessage()]


async def test_lowered_levels_are_decided_and_warned_about_once_at_start_up(
    tmp_path: Path, described: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="turnpoint.trainer")
    config = config_for(tmp_path, target_level="turn")
    coordinator = Coordinator(
        described, token=TOKEN, coordinator_id="coord-levels", epoch=1, config=config
    )
    async with coordinator:
        await coordinator.discover()

        (warning,) = level_warnings(caplog)
        assert "'math'" in warning and "math-tools is restart-only" in warning
        assert coordinator.levels["math"].effective is RecoveryLevel.SIBLING
        assert coordinator.levels["chess"].effective is RecoveryLevel.TURN

        # The restore discovers again and plans: no second warning.
        restorer = Restorer(coordinator, SnapshotLayout(tmp_path), config, load_anchor=no_anchor)
        assert await restorer.restore() is None
        assert len(level_warnings(caplog)) == 1

    # The restore plans with the levels discovery decided, not a decision of its own.
    decided = dict(coordinator.levels)
    plan = plan_restore(
        saved_manifest(),
        coordinator.topology,
        RecoveryLevel.TURN,
        restore_id="restore-1",
        levels=decided,
    )
    assert plan.levels["math"] == decided["math"]
    assert plan.levels["math"].effective is RecoveryLevel.SIBLING
    # An environment only the snapshot names gets the target.
    assert plan.levels["gone"].effective is RecoveryLevel.TURN


def no_anchor(snapshot: Path, anchor: AnchorRef) -> int:
    raise AssertionError("nothing is published")


def saved_manifest() -> SnapshotManifest:
    def unfinished(rollout_id: str, environment: str) -> dict[str, Any]:
        return {
            "rollout_id": rollout_id,
            "attempt": 0,
            "instance": "agent-0",
            "prompt_group_id": f"g-{rollout_id}",
            "sibling_index": 0,
            "group_size": 1,
            "environment": environment,
            "boundaries_seen": 0,
            "task": {},
            "accepted": False,
        }

    return SnapshotManifest(
        checkpoint_id="ck-000000000007",
        step=5,
        created_at=1.0,
        anchor=AnchorRef(sha256="0" * 64),
        participants=(ParticipantEntry(instance="agent-0", kind=ParticipantKind.AGENT),),
        rollout_state=TrainerRolloutState(
            attempts={"r1": 0, "r2": 0},
            in_flight=(unfinished("r1", "math"), unfinished("r2", "gone")),
        ),
    )


# ------------------------------------------------- a pause before the joining retry (6)


class RetiresOnce(Describes):
    """Drops the first Retire like a connection going away, answers the second."""

    def __init__(self) -> None:
        super().__init__(
            "agent-0",
            types_pb2.PARTICIPANT_KIND_AGENT,
            "math",
            types_pb2.RECOVERY_MODE_EXPORTED,
        )
        self.calls: list[float] = []

    async def Retire(
        self, request: pb.RetireRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RetireResponse:
        self.calls.append(asyncio.get_running_loop().time())
        if len(self.calls) == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: connection lost")
        return pb.RetireResponse(
            header=types_pb2.ResponseHeader(participant_id=self.name, incarnation="inc-1"),
            stopped=list(request.episodes),
        )


async def test_a_joining_retry_pauses_before_it_is_sent_again(tmp_path: Path) -> None:
    participant = RetiresOnce()
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor(TOKEN, open_services=())])
    pb_grpc.add_CheckpointControlServiceServicer_to_server(participant, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    coordinator = Coordinator(
        {"agent-0": f"127.0.0.1:{port}"},
        token=TOKEN,
        coordinator_id="coord-pause",
        epoch=1,
        config=config_for(tmp_path),
    )
    try:
        async with coordinator:
            report = await coordinator.retire({"agent-0": [EpisodeId("r0", 0)]})
    finally:
        await server.stop(None)

    assert report.ok, report.failures
    first, second = participant.calls
    # Not at once on the connection that just broke: the same request after a pause.
    assert second - first >= JOINING_RETRY_PAUSE_S


# ---------------------------------------------- live whole-group retry of a group (8)


async def test_a_group_scored_sibling_given_up_live_reruns_its_whole_group(
    tmp_path: Path,
) -> None:
    config = config_for(tmp_path)
    clock = FakeClock()
    async with start_topology(tmp_path, agents=1, group_size=3) as topology:
        agent_runtime = topology.agents[0].runtime
        coordinator = await real_coordinator(topology, config)
        agent = AgentEndpoint(topology.agents[0].address, TOKEN)
        settings = RolloutClientSettings(budget_grace_s=0.0)
        async with (
            coordinator,
            RolloutClient({"agent-0": agent}, settings=settings, clock=clock) as client,
        ):
            # The trainer learns which environments score groups from discovery.
            client.set_group_scored(
                name for name, level in coordinator.levels.items() if level.group_scored
            )
            slow = client.dispatch(group_sibling("s0", budget_s=10.0, size=3))
            waiting = client.dispatch(group_sibling("s1", budget_s=None, sibling=1, size=3))
            await client.wait_for(lambda: len(client.in_flight()) == 2, BOUND_S)

            clock.now += 11.0
            assert client.expire_due() == [slow]

            # Both siblings rerun as new attempts; the old ones are stopped and queued
            # for Retire, and nothing of the group reached the results queue.
            assert set(client.waiting()) | {r.episode for r in client.in_flight()} == {
                EpisodeId("s0", 1),
                EpisodeId("s1", 1),
            }
            assert client.results() == ()
            assert set(client.pending_retires()["agent-0"]) == {slow, waiting}
            assert client.stats().groups_retried_whole == 1
            # The old sibling's Run was cancelled: the agent holds no running execution
            # of it any more.
            assert await agent_runtime.wait_until(
                lambda core: all(
                    e.key.episode != waiting or e.state.name != "RUNNING" for e in core.entries()
                ),
                BOUND_S,
            )

            client.dispatch(group_sibling("s2", budget_s=None, sibling=2, size=3))
            await client.wait_for(lambda: len(client.results()) == 3, BOUND_S)
            results = {r.rollout_id: r for r in client.results()}

    assert {r.episode for r in results.values()} == {
        EpisodeId("s0", 1),
        EpisodeId("s1", 1),
        EpisodeId("s2", 0),
    }
    assert {r.outcome for r in results.values()} == {RolloutOutcome.COMPLETED}


# ------------------------------------------------- a hook's failure is data (item 2)


async def test_a_participant_hook_that_raises_fails_one_snapshot_and_the_next_publishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/spec.md section 5.1 item 5: a resources server's export raises an exception
    nobody expected. The snapshot fails, transient, naming the participant and the
    exception type (none of its text); the pump's next attempt publishes; the run goes
    on."""
    from turnpoint.apps.examples._participants import GuessTools

    config = config_for(tmp_path)
    layout = SnapshotLayout(tmp_path)
    original = GuessTools.export_sessions
    raised: list[str] = []

    async def flaky_export(self: GuessTools, episodes: Any) -> Any:
        # Fails through every try of one commit (the coordinator retries a commit once
        # within the attempt), then works.
        if len(raised) < JOINING_ATTEMPTS:
            raised.append(self.name)
            raise KeyError("/home/someone/.secret-config")
        return await original(self, episodes)

    monkeypatch.setattr(GuessTools, "export_sessions", flaky_export)
    async with start_topology(tmp_path, agents=1, group_size=2) as topology:
        group_tools = topology.group_tools.runtime
        coordinator = await real_coordinator(topology, config)
        agent = AgentEndpoint(topology.agents[0].address, TOKEN)
        async with coordinator, RolloutClient({"agent-0": agent}) as client:
            episode = client.dispatch(group_sibling("pair-0", budget_s=None))
            assert await group_tools.wait_until(
                lambda core: any(e.key.episode == episode for e in core.entries()), BOUND_S
            )
            driver = SnapshotDriver(
                coordinator=coordinator,
                rollouts=client,
                anchor=Anchor(),
                layout=layout,
                config=config,
                epoch=1,
            )

            failed = await driver.take()

            assert failed.outcome is SnapshotOutcome.FAILED
            assert failed.reason is FailureReason.PARTICIPANT_HOOK and failed.transient
            assert set(failed.failures) == {"group-tools"}
            failure = failed.failures["group-tools"]
            assert failure.reason is not None and failure.reason.name == "HOOK_FAILED"
            assert "KeyError" in failure.detail and ".secret-config" not in failure.detail

            retried = await driver.take()

            assert retried.outcome is SnapshotOutcome.PUBLISHED, retried.detail
            assert raised == ["group-tools"] * JOINING_ATTEMPTS
            assert {h.runtime.phase for h in topology.participants.values()} == {Phase.IDLE}
