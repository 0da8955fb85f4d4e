"""Token-prefix recovery over real gRPC on 127.0.0.1:0 (docs/spec.md section 5.5).

The capability in Describe, the cut on the wire (``GenerateResponse.cut``,
``GenerateRequest.accept_cut``), the coordinator's token level, and the whole path with
the real coordinator: a snapshot cuts a streaming generation, the run goes on and the
turn finishes as if never cut; and after the job dies, a restore continues the cut
generation from its saved prefix. The policy streams one token per release, so the test
decides where the cut lands; every scenario ends with the exactly-once audit over tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import grpc
import pytest
import torch

from tests.support.participants import TOKEN
from tests.support.token_prefix import (
    PROMPT,
    CountingPolicy,
    CuttingAgent,
    OverGrpc,
    expected_completion,
)
from turnpoint.auth import auth_metadata
from turnpoint.convert import episode_to_proto
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import ParticipantRuntime, SnapshotStore
from turnpoint.protocol import Fence, RecoveryLevel
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    Rollout,
    RolloutOutcome,
    SnapshotOutcome,
    TorchAnchorSource,
    torch_anchor_loader,
)
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import (
    policy_service_pb2,
    policy_service_pb2_grpc,
    rollout_service_pb2,
    rollout_service_pb2_grpc,
    types_pb2,
)

ENVIRONMENT = "count"
FENCE = Fence("coord-wire", 1)
BOUND_S = 30.0
LENGTH = 6


class CountingAgent(CuttingAgent):
    environment: ClassVar[str] = ENVIRONMENT


class PlainPolicy(CountingPolicy):
    can_cut = False


@dataclass
class Job:
    policy: HostedParticipant
    agent: HostedParticipant
    model: CountingPolicy
    streamer: OverGrpc

    @property
    def participants(self) -> dict[str, str]:
        return {"policy": self.policy.address, "agent-0": self.agent.address}


@asynccontextmanager
async def job(
    root: Path, model: CountingPolicy, *, agent_rerun: bool = False
) -> AsyncIterator[Job]:
    """A policy and an agent, each its own server, writing under ``root``; the agent's
    own ``weights_change`` default is RERUN when ``agent_rerun``, else KEEP."""
    options = ServerOptions(port=0, token=TOKEN)
    async with AsyncExitStack() as stack:
        policy = await stack.enter_async_context(
            host_participant(
                ParticipantRuntime("policy", SnapshotStore(root), model=model), options
            )
        )
        streamer = OverGrpc(policy.address, TOKEN)
        stack.push_async_callback(streamer.aclose)
        agent = await stack.enter_async_context(
            host_participant(
                ParticipantRuntime(
                    "agent-0",
                    SnapshotStore(root),
                    agent=CountingAgent(streamer, rerun=agent_rerun),
                ),
                options,
            )
        )
        yield Job(policy, agent, model, streamer)


def checkpointing(
    root: Path,
    participants: dict[str, str],
    target: str,
    *,
    weights_change: Literal["keep", "rerun"] = "keep",
) -> Checkpointing:
    model = torch.nn.Linear(2, 2)
    return Checkpointing(
        CoordinatorConfig(
            snapshot_root=root,
            target_level=target,
            control_timeout_s=10.0,
            weights_change=weights_change,
        ),
        participants,
        token=TOKEN,
        anchor=TorchAnchorSource(model, None, step=lambda: 0),
        load_anchor=torch_anchor_loader(model, None),
        periodic=False,
    )


def rollout() -> Rollout:
    return Rollout(
        rollout_id="count-0",
        prompt_group_id="group-0",
        sibling_index=0,
        group_size=1,
        environment=ENVIRONMENT,
        instance="agent-0",
        task={"turns": 1, "max_new_tokens": LENGTH},
    )


async def admitted(model: CountingPolicy, count: int = 1) -> None:
    async with model.changed:
        await asyncio.wait_for(model.changed.wait_for(lambda: model.streaming == count), BOUND_S)


async def describe(address: str) -> pb.DescribeResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CheckpointControlServiceStub(channel)
        response: pb.DescribeResponse = await stub.Describe(
            pb.DescribeRequest(), metadata=auth_metadata(TOKEN), timeout=10
        )
        return response


@pytest.mark.parametrize("model_kind", [CountingPolicy, PlainPolicy])
async def test_describe_lists_the_token_level_only_where_a_participant_cuts(
    tmp_path: Path, model_kind: type[CountingPolicy]
) -> None:
    async with job(tmp_path, model_kind()) as running:
        policy = await describe(running.policy.address)
        agent = await describe(running.agent.address)
    rest = [
        types_pb2.RECOVERY_LEVEL_TURN,
        types_pb2.RECOVERY_LEVEL_SIBLING,
        types_pb2.RECOVERY_LEVEL_PROMPT_GROUP,
    ]
    cutting = [types_pb2.RECOVERY_LEVEL_TOKEN, *rest]
    assert list(agent.supported_levels) == cutting
    assert list(policy.supported_levels) == (cutting if model_kind.can_cut else rest)


async def test_on_the_wire_a_cuttable_generation_is_cut_at_once_while_closed(
    tmp_path: Path,
) -> None:
    model = CountingPolicy(free=True)
    async with (
        job(tmp_path, model) as running,
        grpc.aio.insecure_channel(running.policy.address) as channel,
    ):
        await running.policy.runtime.prepare(FENCE, "rq-1", "ckpt-000000000001", timeout_s=5)
        stub = policy_service_pb2_grpc.PolicyServiceStub(channel)
        request = policy_service_pb2.GenerateRequest(
            request_id="g-1",
            episode=episode_to_proto(EpisodeId("rollout-w", 0)),
            prompt_token_ids=list(PROMPT),
            max_new_tokens=4,
            accept_cut=True,
        )
        responses = [
            r async for r in stub.Generate(request, metadata=auth_metadata(TOKEN), timeout=10)
        ]
        assert len(responses) == 1
        (only,) = responses
        assert only.done and only.HasField("cut") and only.cut.prefix_length == 0
        assert list(only.token_ids) == []
        # Without accept_cut the same request waits at the gate until resume.
        request.accept_cut = False
        request.request_id = "g-2"
        call = stub.Generate(request, metadata=auth_metadata(TOKEN), timeout=10)
        first = asyncio.ensure_future(call.read())
        done, _ = await asyncio.wait([first], timeout=0.2)
        assert not done  # held (an absence observed in a bounded window)
        await running.policy.runtime.resume(FENCE, "rq-2", "ckpt-000000000001")
        head = await asyncio.wait_for(first, BOUND_S)
        assert not head.HasField("cut") and len(head.token_ids) == 1
        call.cancel()
    assert model.streamed[0][1] == len(PROMPT)


async def test_the_coordinator_lowers_the_token_level_when_the_policy_cannot_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="turnpoint.trainer")
    async with (
        job(tmp_path, PlainPolicy(free=True)) as running,
        checkpointing(tmp_path, running.participants, "token") as ckpt,
    ):
        decision = ckpt.coordinator.levels[ENVIRONMENT]
    assert decision.effective is RecoveryLevel.TURN
    assert decision.reasons == ("policy cannot cut generations",)
    assert any("lowered from token to turn" in r.getMessage() for r in caplog.records)


async def test_a_snapshot_cuts_a_streaming_generation_and_the_turn_finishes_uncut(
    tmp_path: Path,
) -> None:
    model = CountingPolicy()
    async with (
        job(tmp_path, model) as running,
        checkpointing(tmp_path, running.participants, "token") as ckpt,
    ):
        assert ckpt.coordinator.levels[ENVIRONMENT].effective is RecoveryLevel.TOKEN
        ckpt.dispatch(rollout())
        await admitted(model)
        model.release(2)
        await asyncio.wait_for(model.wait_streamed(2), BOUND_S)
        snapshot = asyncio.create_task(ckpt.snapshot_now())
        policy = running.policy.runtime
        await asyncio.wait_for(
            policy.wait_until(lambda core: core.active_checkpoint_id is not None), BOUND_S
        )
        model.release(1)  # the next token boundary: the cut lands here
        report = await asyncio.wait_for(snapshot, BOUND_S)
        assert report.outcome is SnapshotOutcome.PUBLISHED, report
        cut = [r for r in running.streamer.responses if r.HasField("cut")]
        assert [r.cut.prefix_length for r in cut] == [3]
        model.free = True
        model.release(1)
        assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
        (group,) = ckpt.take_ready_groups(1)
    (result,) = group
    assert result.outcome is RolloutOutcome.COMPLETED
    assert tuple(result.output["completions"][0]) == expected_completion(LENGTH, None)
    positions = [p for _, p, _ in model.streamed]
    assert sorted(positions) == [len(PROMPT) + i for i in range(LENGTH)]  # each once


async def test_a_restore_continues_the_cut_generation_from_its_saved_prefix(
    tmp_path: Path,
) -> None:
    first = CountingPolicy()
    async with (
        job(tmp_path, first) as running,
        checkpointing(tmp_path, running.participants, "token") as ckpt,
    ):
        ckpt.dispatch(rollout())
        await admitted(first)
        first.release(1)
        await asyncio.wait_for(first.wait_streamed(1), BOUND_S)
        snapshot = asyncio.create_task(ckpt.snapshot_now())
        await asyncio.wait_for(
            running.policy.runtime.wait_until(lambda core: core.active_checkpoint_id is not None),
            BOUND_S,
        )
        first.release(1)
        report = await asyncio.wait_for(snapshot, BOUND_S)
        assert report.outcome is SnapshotOutcome.PUBLISHED, report
        # After the snapshot the generation goes on, then the job dies.
        first.release(2)
        await asyncio.wait_for(first.wait_streamed(4), BOUND_S)
    fresh = CountingPolicy(free=True)
    async with (
        job(tmp_path, fresh) as running,
        checkpointing(tmp_path, running.participants, "token") as ckpt,
    ):
        assert ckpt.resumed.restored and ckpt.resumed.resumed_rollouts == 1
        assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
        (group,) = ckpt.take_ready_groups(1)
    (result,) = group
    assert tuple(result.output["completions"][0]) == expected_completion(LENGTH, None)
    # The two tokens saved with the snapshot were not generated again; the two the
    # snapshot never saw were (they belonged to a run the crash ended).
    assert [p for _, p, _ in fresh.streamed] == [len(PROMPT) + i for i in range(2, LENGTH)]
    assert [p for _, p, _ in first.streamed] == [len(PROMPT) + i for i in range(4)]


@pytest.mark.parametrize("weights_change", ["keep", "rerun"])
async def test_the_coordinator_config_decides_what_a_generation_spanning_a_weight_update_does(
    tmp_path: Path, weights_change: Literal["keep", "rerun"]
) -> None:
    """docs/spec.md section 5.5 item 7: the coordinator's ``weights_change`` travels on
    every Run (the real rollout client) and wins over an agent default that says the
    opposite. A snapshot cuts the generation after two tokens while a weight sync waits
    for it; the rest of the turn streams under the new weights."""
    model = CountingPolicy()
    async with (
        job(tmp_path, model, agent_rerun=weights_change == "keep") as running,
        checkpointing(
            tmp_path, running.participants, "token", weights_change=weights_change
        ) as ckpt,
    ):
        ckpt.dispatch(rollout())
        await admitted(model)
        model.release(1)
        await asyncio.wait_for(model.wait_streamed(1), BOUND_S)
        policy = running.policy.runtime
        # The weight sync waits for the streaming generation; the cut ends it.
        sync = asyncio.create_task(policy.update_weights(2, b""))
        snapshot = asyncio.create_task(ckpt.snapshot_now())
        await asyncio.wait_for(
            policy.wait_until(lambda core: core.active_checkpoint_id is not None), BOUND_S
        )
        model.release(1)
        report = await asyncio.wait_for(snapshot, BOUND_S)
        assert report.outcome is SnapshotOutcome.PUBLISHED, report
        assert await asyncio.wait_for(sync, BOUND_S) == 2
        model.free = True
        model.release(1)
        assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
        (group,) = ckpt.take_ready_groups(1)
    (result,) = group
    assert result.outcome is RolloutOutcome.COMPLETED
    assert tuple(result.output["completions"][0]) == expected_completion(LENGTH, None)
    versions = result.output["versions"][0]
    positions = [p for _, p, _ in model.streamed]
    if weights_change == "keep":
        assert versions == [1, 1] + [2] * (LENGTH - 2)
        assert sorted(positions) == [len(PROMPT) + i for i in range(LENGTH)]  # each once
    else:
        # The turn that spanned the update was generated again, wholly under version 2;
        # the first one was thrown away, never trained.
        assert versions == [2] * LENGTH
        assert sorted(positions) == sorted([len(PROMPT) + i for i in range(LENGTH)] * 2)


async def test_a_run_with_an_unknown_weights_change_is_invalid_argument(tmp_path: Path) -> None:
    async with (
        job(tmp_path, CountingPolicy(free=True)) as running,
        grpc.aio.insecure_channel(running.agent.address) as channel,
    ):
        stub = rollout_service_pb2_grpc.RolloutServiceStub(channel)
        request = rollout_service_pb2.RunRequest(
            request_id="run-bad",
            episode=episode_to_proto(EpisodeId("rollout-bad", 0)),
            weights_change=99,  # type: ignore[arg-type]
        )
        request.task.update({"turns": 1, "max_new_tokens": 2})
        call = stub.Run(request, metadata=auth_metadata(TOKEN), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "weights_change" in (caught.value.details() or "")
