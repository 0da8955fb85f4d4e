"""The opaque agent through its crash (docs/spec.md section 12.8): a real harness process
(the example ReAct script, the real ``openai`` package) behind the egress relay, the real
policy endpoint in front of the example policy, the agent participant served over gRPC.

The agent participant is snapshotted after a completed turn and killed (its runtime shut
down, its harness process tree killed, its relay gone); a fresh participant restores the
snapshot and runs the next attempt: its fresh harness is answered from the record until
the cut, then goes live, and the final transcript is the uninterrupted run's. The
harness's tool is an HTTP service behind the relay whose every call has an effect: each
reaches it exactly once across all the kills. The
policy holds the call after the cut until the test lets it go, so the cut is exactly
where the test says; waits are bounded polls on counters, never sleeps.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakes import FakeAnchor
from tests.support.participants import TOKEN
from tests.support.scripted import ckpt, host_scripted, poll, restore_id, wire_to
from turnpoint.apps.examples import react_harness
from turnpoint.apps.examples._participants import TinyPolicyServer, new_policy
from turnpoint.apps.examples.chat_template import MODEL_NAME, GuessChatTemplate
from turnpoint.apps.examples.guess_tool import GuessTool
from turnpoint.auth import CONTROL_TOKEN_SHA256_ENV, TOKEN_ENV, TOKEN_FILE_ENV, token_sha256
from turnpoint.convert import struct_to_dict
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    GenerateChunk,
    GenerateRequest,
    ParticipantRuntime,
    SnapshotStore,
)
from turnpoint.protocol import RecoveryMode
from turnpoint.server import ServerOptions, host_participant
from turnpoint.server.openai_api import (
    ChatEndpoint,
    EgressRelay,
    EndpointOptions,
    OpaqueAgent,
    RelayOptions,
)
from turnpoint.trainer import CoordinatorConfig, Rollout, RolloutOutcome, SnapshotOutcome
from turnpoint.trainer.advanced import (
    AgentEndpoint,
    Coordinator,
    Restorer,
    RolloutClient,
    SnapshotDriver,
    SnapshotLayout,
    apply_plan,
)
from turnpoint.trainer.restore.restorer import RerunReason
from turnpoint.v1 import types_pb2

API_KEY = "sk-policy-endpoint"
TASK = {"low": 2, "high": 9, "target": 8, "max_turns": 3, "seed": 3, "max_tokens": 3}
HARNESS = [sys.executable, react_harness.__file__]
# The hang guard of a Run that starts harness processes (one per attempt, two when a
# restored harness diverges and reruns): each start is a Python or Node process start-up,
# which a loaded two-core machine slows several times; 10 s was seen to expire.
HARNESS_BOUND_S = 60.0
# The same loop in Node 20 with plain fetch.
NODE_HARNESS = ["node", str(Path(react_harness.__file__).with_suffix(".mjs"))]


class GatedPolicy(TinyPolicyServer):
    """The example policy, counting generations; from ``hold_at`` on, each waits for
    ``gate``: the call after the cut stays in flight while the test snapshots."""

    def __init__(self) -> None:
        super().__init__(new_policy(0))
        self.started = 0
        self.hold_at: int | None = None
        self.gate = asyncio.Event()

    async def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        self.started += 1
        if self.hold_at is not None and self.started >= self.hold_at:
            await self.gate.wait()
        async for chunk in super().generate(episode, request):
            yield chunk


@asynccontextmanager
async def policy_endpoint(root: Path, policy: GatedPolicy) -> AsyncIterator[ChatEndpoint]:
    runtime = ParticipantRuntime("policy", SnapshotStore(root), model=policy)
    hosted = host_participant(runtime, ServerOptions(port=0, token=TOKEN))
    await hosted.start()
    options = EndpointOptions(model=MODEL_NAME, api_key=API_KEY, max_tokens=8)
    try:
        async with ChatEndpoint(runtime, GuessChatTemplate(), options) as endpoint:
            yield endpoint
    finally:
        await hosted.stop(0)


@asynccontextmanager
async def opaque_agent(
    endpoint: ChatEndpoint,
    env: Mapping[str, str] | None = None,
    tool: GuessTool | None = None,
    harness: Sequence[str] = HARNESS,
    *,
    replayable: bool = True,
) -> AsyncIterator[OpaqueAgent]:
    tools = {} if tool is None else {"observe": tool.url}
    options = RelayOptions(endpoint.base_url, MODEL_NAME, upstream_api_key=API_KEY, tools=tools)
    async with EgressRelay(options) as relay:
        yield OpaqueAgent(relay, harness, model=MODEL_NAME, env=env, replayable=replayable)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def run_through(
    root: Path,
    endpoint: ChatEndpoint,
    episode: EpisodeId,
    tool: GuessTool,
    harness: Sequence[str] = HARNESS,
) -> dict[str, Any]:
    async with (
        opaque_agent(endpoint, tool=tool, harness=harness) as agent,
        host_scripted(root, agent=agent) as hosted,
        wire_to(hosted, "unary") as wire,
    ):
        result = await wire.run(episode, TASK).done(HARNESS_BOUND_S)
    return struct_to_dict(result.result)


def assistant_turns(result: Mapping[str, Any]) -> int:
    return sum(1 for m in result["transcript"]["messages"] if m["role"] == "assistant")


async def test_killed_after_every_turn_in_turn_it_ends_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    policy = GatedPolicy()
    async with policy_endpoint(tmp_path / "policy", policy) as endpoint, GuessTool() as tool:
        whole = await run_through(tmp_path / "whole", endpoint, EpisodeId("whole-run", 0), tool)
        calls = assistant_turns(whole)
        assert calls >= 3, whole  # long enough to cut after more than one turn
        assert whole["replayed"] == 0 and whole["forwarded"] == whole["tools_forwarded"] == calls
        assert tool.requests == calls

        root = tmp_path / "agent"
        episode = EpisodeId("crash-run", 0)
        committed = None
        for cut in range(1, calls):
            # The call after the cut is held by the policy: the snapshot is at ``cut``.
            hold_at = policy.started + 2
            policy.hold_at = hold_at
            policy.gate = asyncio.Event()
            async with (
                opaque_agent(endpoint, tool=tool) as agent,
                host_scripted(root, agent=agent) as hosted,
                wire_to(hosted, "unary") as wire,
            ):
                if committed is not None:
                    await restore(wire, cut - 1, committed, episode)
                    episode = episode.next_attempt()
                run = wire.run(episode, TASK)
                await poll(lambda at=hold_at: policy.started >= at, HARNESS_BOUND_S)
                prepared = await wire.prepare(ckpt(cut), lease_s=60)
                assert prepared.phase == types_pb2.PHASE_PREPARED, prepared
                committed = await wire.commit(ckpt(cut), f"snap-{cut}", [episode])
                await wire.resume(ckpt(cut))
                old_harness = agent.harness_pids[-1]
                assert alive(old_harness)
            # The participant is gone: its harness process tree was killed with it.
            assert not alive(old_harness) and run.result is None
            policy.gate.set()  # the held call ends for nobody: its client went away

        policy.hold_at = None
        assert committed is not None
        async with (
            opaque_agent(endpoint, tool=tool) as agent,
            host_scripted(root, agent=agent) as hosted,
            wire_to(hosted, "unary") as wire,
        ):
            await restore(wire, calls - 1, committed, episode)
            result = await wire.run(episode.next_attempt(), TASK).done(HARNESS_BOUND_S)
        continued = struct_to_dict(result.result)

    assert continued["transcript"] == whole["transcript"]
    # Each step is two turns: its model call and its tool call.
    assert continued["turns"] == whole["turns"] == 2 * calls
    # The cut's calls answered from the record, the step after it forwarded once.
    assert continued["replayed"] == 2 * (calls - 1)
    assert continued["forwarded"] == continued["tools_forwarded"] == 1
    assert continued["reruns"] == []
    # Every tool call of both runs reached the tool once: no effect applied twice.
    assert tool.requests == 2 * calls
    assert set(tool.applied.values()) == {1} and len(tool.applied) == 2 * calls
    assert tool.ledger["crash-run"] == tool.ledger["whole-run"]


async def restore(wire: Any, n: int, committed: Any, episode: EpisodeId) -> None:
    restored = await wire.restore(restore_id(n), f"snap-{n}", committed, [episode])
    assert len(restored.installed) == 1
    await wire.resume(restore_id(n))


async def test_a_restored_harness_that_diverges_is_stopped_and_the_episode_reruns_from_its_prompt(
    tmp_path: Path,
) -> None:
    policy = GatedPolicy()
    root = tmp_path / "agent"
    episode = EpisodeId("drift-run", 0)
    async with policy_endpoint(tmp_path / "policy", policy) as endpoint:
        policy.hold_at = 2  # the first call completes, the second is in flight at the cut
        async with (
            opaque_agent(endpoint) as agent,
            host_scripted(root, agent=agent) as hosted,
            wire_to(hosted, "unary") as wire,
        ):
            wire.run(episode, TASK)
            await poll(lambda: policy.started >= 2, HARNESS_BOUND_S)
            assert (await wire.prepare(ckpt(1), lease_s=60)).phase == types_pb2.PHASE_PREPARED
            committed = await wire.commit(ckpt(1), "snap-1", [episode])
            await wire.resume(ckpt(1))
        policy.gate.set()
        policy.hold_at = None
        # Retuned between the crash and the restore, the harness asks otherwise.
        async with (
            opaque_agent(endpoint, {"HARNESS_TEMPERATURE": "0.5"}) as agent,
            host_scripted(root, agent=agent) as hosted,
            wire_to(hosted, "unary") as wire,
        ):
            await restore(wire, 1, committed, episode)
            result = await wire.run(episode.next_attempt(), TASK).done(HARNESS_BOUND_S)
        continued = struct_to_dict(result.result)

    assert [rerun["position"] for rerun in continued["reruns"]] == [0]
    assert "call 0" in continued["reruns"][0]["reason"]
    # Rerun from its prompt: nothing answered from the record, every call forwarded; the
    # turns count on from the cut's, one more for the rerun (its tool keys are new).
    assert continued["replayed"] == 0
    assert continued["forwarded"] == assistant_turns(continued) == continued["turns"] - 2
    assert len(agent.harness_pids) == 2 and not any(map(alive, agent.harness_pids))


async def test_the_node_harness_plays_the_same_loop_through_the_relay(tmp_path: Path) -> None:
    policy = GatedPolicy()
    async with policy_endpoint(tmp_path / "policy", policy) as endpoint, GuessTool() as tool:
        python = await run_through(tmp_path / "py", endpoint, EpisodeId("py-run", 0), tool)
        node = await run_through(
            tmp_path / "node", endpoint, EpisodeId("node-run", 0), tool, NODE_HARNESS
        )
    assert node["transcript"] == python["transcript"]
    calls = assistant_turns(node)
    assert node["forwarded"] == node["tools_forwarded"] == calls and node["turns"] == 2 * calls
    assert tool.ledger["node-run"] == tool.ledger["py-run"]


async def test_a_harness_declared_not_replayable_is_restart_only_and_a_restore_reruns_it(
    tmp_path: Path,
) -> None:
    """docs/spec.md section 12.8 item 7, with a real coordinator: the episode is in no
    cut, and the restore reruns it from its prompt, counted as a restart."""
    policy = GatedPolicy()
    root = tmp_path / "snapshots"
    config = CoordinatorConfig(snapshot_root=root, control_timeout_s=5.0, resume_retry_pause_s=0)
    layout = SnapshotLayout(root)
    rollout = Rollout("fresh-run", "fresh", 0, 1, OpaqueAgent.environment, TASK, "agent-0")

    @asynccontextmanager
    async def trainer(epoch: int) -> AsyncIterator[tuple[Coordinator, RolloutClient, OpaqueAgent]]:
        async with (
            opaque_agent(endpoint, replayable=False) as agent,
            host_scripted(tmp_path / f"agent-{epoch}", agent=agent) as hosted,
        ):
            coordinator = Coordinator(
                {"agent-0": hosted.address},
                token=TOKEN,
                coordinator_id="coord-opaque",
                epoch=epoch,
                config=config,
            )
            await coordinator.discover()
            agents = {"agent-0": AgentEndpoint(hosted.address, TOKEN)}
            async with coordinator, RolloutClient(agents) as client:
                yield coordinator, client, agent

    async with policy_endpoint(tmp_path / "policy", policy) as endpoint:
        policy.hold_at = 2  # the first call completes, the second is in flight at the cut
        async with trainer(1) as (coordinator, client, agent):
            assert agent.recovery_mode is RecoveryMode.RESTART_ONLY
            client.dispatch(rollout)
            await poll(lambda: policy.started >= 2, HARNESS_BOUND_S)
            driver = SnapshotDriver(
                coordinator=coordinator,
                rollouts=client,
                anchor=FakeAnchor(),
                layout=layout,
                config=config,
                epoch=coordinator.identity.epoch,
            )
            report = await driver.take()
        policy.gate.set()
        policy.hold_at = None
        assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
        manifest = layout.load(report.checkpoint_id)
        episode = EpisodeId("fresh-run", 0)
        assert [p.episode for p in manifest.restarts] == [episode]
        assert manifest.continued == () and manifest.participant("agent-0").exported == ()

        async with trainer(2) as (coordinator, client, agent):
            restorer = Restorer(coordinator, layout, config, load_anchor=lambda snapshot, ref: 1)
            plan = await restorer.restore()
            assert plan is not None and plan.redispatch == ()
            assert [(r.episode, r.reason) for r in plan.rerun] == [
                (episode.next_attempt(), RerunReason.RESTART)
            ]
            apply_plan(plan, client)
            await client.wait_for(lambda: len(client.results()) == 1, 30.0)
            (done,) = client.results()
    assert done.outcome is RolloutOutcome.COMPLETED and done.episode == episode.next_attempt()
    # From its prompt: one fresh harness, nothing answered from a record.
    assert len(agent.harness_pids) == 1
    assert done.output["replayed"] == 0 and done.output["reruns"] == []


async def test_the_harness_environment_holds_no_control_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/spec.md sections 10.2 item 8 and 12.8 item 5: whatever the participant's own
    environment holds, the harness gets neither the control token nor its digest."""
    for name, value in (
        (TOKEN_ENV, "control-token-of-the-host"),
        (TOKEN_FILE_ENV, str(tmp_path / "token")),
        (CONTROL_TOKEN_SHA256_ENV, token_sha256("control-token-of-the-host")),
    ):
        monkeypatch.setenv(name, value)
    print_env = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    async with (
        policy_endpoint(tmp_path / "policy", GatedPolicy()) as endpoint,
        opaque_agent(endpoint, harness=print_env) as agent,
        host_scripted(tmp_path / "agent", agent=agent) as hosted,
        wire_to(hosted, "unary") as wire,
    ):
        result = await wire.run(EpisodeId("env-run", 0), TASK).done(HARNESS_BOUND_S)
    seen = struct_to_dict(result.result)["transcript"]
    assert TOKEN_ENV not in seen and TOKEN_FILE_ENV not in seen
    assert CONTROL_TOKEN_SHA256_ENV not in seen
    values = "\n".join(map(str, seen.values()))
    assert "control-token-of-the-host" not in values
    assert token_sha256("control-token-of-the-host") not in values
    assert seen["OPENAI_API_KEY"].startswith("tp-egress-") and API_KEY not in values
