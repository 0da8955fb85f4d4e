"""The participant guide's servers (docs/participant.md) against the real coordinator.

Both guide servers run as real gRPC servers on ``127.0.0.1:0``; the coordinator takes
snapshots while episodes are mid-way, a flaky session backend (``TransientError``) fails
one snapshot that the next attempt publishes (docs/spec.md section 5.1 item 5), and a
restore onto fresh guide servers continues every episode from its saved turn to the
right total, no turn lost or counted twice (section 7.7).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from turnpoint.apps.examples.guide_agent import CounterAgent
from turnpoint.apps.examples.guide_resources import CounterTools
from turnpoint.participant_sdk import ParticipantRuntime, RuntimeConfig, SnapshotStore
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.trainer import (
    CoordinatorConfig,
    FailureReason,
    Rollout,
    RolloutOutcome,
    SnapshotOutcome,
)
from turnpoint.trainer.advanced import (
    AgentEndpoint,
    AnchorRef,
    Coordinator,
    Restorer,
    RolloutClient,
    SnapshotDriver,
    SnapshotLayout,
    apply_plan,
)
from turnpoint.trainer.anchors.source import WrittenAnchor
from turnpoint.trainer.storage.layout import tree_digest

TOKEN = "guide-token-123"
BOUND_S = 20.0
TARGET = 30
TURN_DELAY_S = 0.05


class Anchor:
    """The trainer's own state: one file naming the step (a new step per snapshot)."""

    def __init__(self) -> None:
        self.step = 0

    async def write(self, snapshot: Path) -> WrittenAnchor:
        directory = snapshot / "trainer" / "anchor"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "state.bin").write_bytes(f"step {self.step}".encode())
        return WrittenAnchor(AnchorRef(sha256=tree_digest(directory)), self.step)


@dataclass
class Guide:
    tools: HostedParticipant
    agent: HostedParticipant
    counter: CounterTools

    @property
    def addresses(self) -> dict[str, str]:
        return {"counter-tools": self.tools.address, "agent-0": self.agent.address}


@contextlib.asynccontextmanager
async def guide_servers(root: Path) -> AsyncIterator[Guide]:
    """Fresh guide servers, each on its own port, writing under ``root``."""
    config = RuntimeConfig(default_lease_s=60.0)
    counter = CounterTools()
    tools_runtime = ParticipantRuntime(
        "counter-tools", SnapshotStore(root), resources=counter, config=config
    )
    tools = await host_participant(tools_runtime, ServerOptions(port=0, token=TOKEN)).start()
    try:
        agent = CounterAgent(tools.address, TOKEN, turn_delay_s=TURN_DELAY_S)
        agent_runtime = ParticipantRuntime(
            "agent-0", SnapshotStore(root), agent=agent, config=config
        )
        hosted = host_participant(agent_runtime, ServerOptions(port=0, token=TOKEN))
        hosted.on_close.append(agent.aclose)
        await hosted.start()
        try:
            yield Guide(tools, hosted, counter)
        finally:
            await hosted.stop(0)
    finally:
        await tools.stop(0)


async def eventually(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` until it holds; BOUND_S is a safety net, not a synchroniser."""
    deadline = asyncio.get_running_loop().time() + BOUND_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def counting(rollout_id: str) -> Rollout:
    return Rollout(
        rollout_id=rollout_id,
        prompt_group_id=f"g-{rollout_id}",
        sibling_index=0,
        group_size=1,
        environment="counter",
        task={"target": TARGET},
        instance="agent-0",
    )


async def test_guide_servers_snapshot_survive_a_flaky_backend_and_restore(
    tmp_path: Path,
) -> None:
    config = CoordinatorConfig(
        snapshot_root=tmp_path, control_timeout_s=5.0, resume_retry_pause_s=0.0
    )
    layout = SnapshotLayout(tmp_path)
    rollout_ids = ("count-a", "count-b")
    async with guide_servers(tmp_path) as guide:
        coordinator = Coordinator(
            guide.addresses, token=TOKEN, coordinator_id="coord-guide", epoch=1, config=config
        )
        await coordinator.discover()
        endpoints = {"agent-0": AgentEndpoint(guide.agent.address, TOKEN)}
        async with coordinator, RolloutClient(endpoints) as client:
            for rollout_id in rollout_ids:
                client.dispatch(counting(rollout_id))
            # Both episodes are a few turns in: every snapshot cuts them mid-way.
            await eventually(
                lambda: (
                    len(guide.counter.sessions) == 2
                    and all(len(s["totals"]) > 3 for s in guide.counter.sessions.values())
                )
            )
            anchor = Anchor()
            driver = SnapshotDriver(
                coordinator=coordinator,
                rollouts=client,
                anchor=anchor,
                layout=layout,
                config=config,
                epoch=1,
            )
            anchor.step += 1
            first = await driver.take()
            assert first.outcome is SnapshotOutcome.PUBLISHED, first.detail

            # The session backend is down: that snapshot fails (its commit retries
            # included), the run goes on, and the next attempt publishes.
            guide.counter.backend_up = False
            anchor.step += 1
            flaky = await driver.take()
            assert flaky.outcome is SnapshotOutcome.FAILED
            assert flaky.reason is FailureReason.PARTICIPANT_UNAVAILABLE, flaky.reason
            assert "counter-tools" in flaky.failures
            guide.counter.backend_up = True
            anchor.step += 1
            retried = await driver.take()
            assert retried.outcome is SnapshotOutcome.PUBLISHED, retried.detail
            saved_totals = {
                e.rollout_id: len(s["totals"]) - 1 for e, s in guide.counter.sessions.items()
            }
    # The trainer and both servers are gone: restore onto fresh ones.
    async with guide_servers(tmp_path) as fresh:
        coordinator = Coordinator(
            fresh.addresses, token=TOKEN, coordinator_id="coord-guide", epoch=2, config=config
        )
        endpoints = {"agent-0": AgentEndpoint(fresh.agent.address, TOKEN)}
        async with coordinator, RolloutClient(endpoints) as client:
            restorer = Restorer(coordinator, layout, config, load_anchor=lambda snapshot, ref: 1)
            plan = await restorer.restore()
            assert plan is not None
            assert plan.checkpoint_id == retried.checkpoint_id
            assert sorted(a.rollout.episode.rollout_id for a in plan.redispatch) == list(
                rollout_ids
            )
            # The fresh tools server holds the saved sessions as attempt 1, mid-way.
            restored = {e.rollout_id: s for e, s in fresh.counter.sessions.items()}
            assert set(restored) == set(rollout_ids)
            assert all(e.attempt == 1 for e in fresh.counter.sessions)
            assert all(len(s["totals"]) > 3 for s in restored.values())
            assert all(len(restored[r]["totals"]) - 1 <= saved_totals[r] for r in rollout_ids)
            apply_plan(plan, client)
            results = [await client.next_result(BOUND_S) for _ in rollout_ids]

    assert sorted(r.episode.rollout_id for r in results) == list(rollout_ids)
    for result in results:
        assert result.outcome is RolloutOutcome.COMPLETED
        assert result.episode.attempt == 1
        # Nothing lost, nothing twice: one add per turn, so the total is the target.
        assert result.output["total"] == TARGET
        assert result.output["turns"] == TARGET
        assert result.output["reward"] == 1.0
