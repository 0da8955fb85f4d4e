"""Credentials by role over real gRPC on 127.0.0.1:0 (docs/spec.md section 10.2).

A policy, a tools server and an agent, served from the examples, each with a control
token and a data-plane token; the agent reaches its policy and tools with the data-plane
one. Whoever holds only the data-plane token (an agent's harness) can run episodes, call
tools and generate, and cannot fence, prepare, restore, resume or retire anything: the
fence-pinning attack of section 10.2 ends PERMISSION_DENIED and the participant's fence
stays the coordinator's. One token configured still serves both roles.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.scripted import bounded, rid
from turnpoint._status import error_from_rpc
from turnpoint.apps.examples._build import ExampleSpec, build_example
from turnpoint.apps.examples._task import make_prompt
from turnpoint.auth import auth_metadata, token_sha256
from turnpoint.convert import duration_from_seconds, episode_to_proto, struct_from_mapping
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import policy_service_pb2 as po_pb
from turnpoint.v1 import policy_service_pb2_grpc as po_grpc
from turnpoint.v1 import resources_service_pb2 as rs_pb
from turnpoint.v1 import resources_service_pb2_grpc as rs_grpc
from turnpoint.v1 import rollout_service_pb2 as ro_pb
from turnpoint.v1 import rollout_service_pb2_grpc as ro_grpc
from turnpoint.v1 import types_pb2

CONTROL_TOKEN = "control-Token-7d1c"
DATA_TOKEN = "data-Token-52ab9e"
CONTROL = auth_metadata(CONTROL_TOKEN)
DATA = auth_metadata(DATA_TOKEN)
RPC_TIMEOUT = 10.0
COORDINATOR = types_pb2.Fence(coordinator_id="coord", epoch=1)
# The attack of section 10.2: a fence no real coordinator can ever pass.
PINNED = types_pb2.Fence(coordinator_id="harness", epoch=2**64 - 1)
EPISODE = EpisodeId("rollout-roles", 0)


@dataclass
class Roles:
    policy: HostedParticipant
    tools: HostedParticipant
    agent: HostedParticipant
    channel: grpc.aio.Channel

    def __iter__(self) -> Iterator[HostedParticipant]:
        return iter((self.policy, self.tools, self.agent))

    def control(self) -> pb_grpc.CheckpointControlServiceAsyncStub:
        return pb_grpc.CheckpointControlServiceStub(self.channel)


@asynccontextmanager
async def serve_roles(
    root: Path, *, data_token: str | None, digest_only: bool = False
) -> AsyncIterator[Roles]:
    """The three participants, each served with ``CONTROL_TOKEN`` (or, ``digest_only``,
    only its SHA-256) and ``data_token``; the agent calls its peers with the data-plane
    token when there is one."""
    options = (
        ServerOptions(port=0, token_sha256=token_sha256(CONTROL_TOKEN), data_token=data_token)
        if digest_only
        else ServerOptions(port=0, token=CONTROL_TOKEN, data_token=data_token)
    )
    peer_token = data_token or CONTROL_TOKEN
    async with AsyncExitStack() as stack:

        async def host(kind: str, example: str, spec: ExampleSpec) -> HostedParticipant:
            runtime, closers = build_example(kind, example, spec)
            hosted = host_participant(runtime, options)
            hosted.on_close.extend(closers)
            await hosted.start()
            stack.push_async_callback(hosted.stop, 0)
            return hosted

        policy = await host("model", "tiny-policy", ExampleSpec("policy", root))
        tools = await host("resources", "guess", ExampleSpec("tools", root))
        agent_spec = ExampleSpec(
            "agent-0",
            root,
            token=peer_token,
            policy_address=policy.address,
            resources={"guess": tools.address},
        )
        agent = await host("agent", "guess", agent_spec)
        channel = grpc.aio.insecure_channel(agent.address)
        stack.push_async_callback(channel.close, None)
        yield Roles(policy, tools, agent, channel)


async def run_episode(channel: grpc.aio.Channel, metadata: Any) -> ro_pb.RunResult:
    """One guess episode, start to end; the agent generates and calls tools on the way."""
    task = {"task": make_prompt(3, seed=0).to_dict(), "environment": "guess"}
    request = ro_pb.RunRequest(
        request_id=rid("run"),
        episode=episode_to_proto(EPISODE),
        task=struct_from_mapping(task),
    )
    result: ro_pb.RunResult | None = None
    call = ro_grpc.RolloutServiceStub(channel).Run(request, metadata=metadata, timeout=60)
    async for response in call:
        if response.WhichOneof("event") == "result":
            result = response.result
    assert result is not None, "the Run ended without a result"
    return result


async def refusal(call: Awaitable[object]) -> TurnpointError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    error = error_from_rpc(info.value)
    assert error is not None, "a refusal carries a google.rpc.Status + ErrorInfo"
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.reason is Reason.PERMISSION_DENIED
    return error


def control_calls(stub: pb_grpc.CheckpointControlServiceAsyncStub) -> dict[str, Callable[[], Any]]:
    """Every mutating control call, fenced at the pinned epoch, with the data-plane token."""
    lease = duration_from_seconds(60)
    return {
        "Prepare": lambda: stub.Prepare(
            pb.PrepareRequest(fence=PINNED, request_id=rid(), checkpoint_id="ckpt-1", lease=lease),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        ),
        "Renew": lambda: stub.Renew(
            pb.RenewRequest(fence=PINNED, request_id=rid(), checkpoint_id="ckpt-1", lease=lease),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        ),
        "Commit": lambda: stub.Commit(
            pb.CommitRequest(fence=PINNED, request_id=rid(), checkpoint_id="ckpt-1"),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        ),
        "Resume": lambda: stub.Resume(
            pb.ResumeRequest(fence=PINNED, request_id=rid(), checkpoint_id="ckpt-1"),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        ),
        "Restore": lambda: stub.Restore(
            pb.RestoreRequest(fence=PINNED, request_id=rid(), restore_id="restore-1"),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        ),
        "RestoreRunning": lambda: stub.RestoreRunning(
            pb.RestoreRunningRequest(fence=PINNED, request_id=rid(), restore_id="restore-1"),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        ),
        "Retire": lambda: stub.Retire(
            pb.RetireRequest(fence=PINNED, request_id=rid(), episodes=[episode_to_proto(EPISODE)]),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        ),
        "Forget": lambda: stub.Forget(
            pb.ForgetRequest(fence=PINNED, request_id=rid(), rollout_ids=[EPISODE.rollout_id]),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        ),
        "Describe": lambda: stub.Describe(
            pb.DescribeRequest(fence=PINNED), metadata=DATA, timeout=RPC_TIMEOUT
        ),
        "GetStatus": lambda: stub.GetStatus(
            pb.GetStatusRequest(), metadata=DATA, timeout=RPC_TIMEOUT
        ),
    }


async def test_a_data_plane_token_runs_episodes_and_cannot_touch_the_control_plane(
    tmp_path: Path,
) -> None:
    async with serve_roles(tmp_path, data_token=DATA_TOKEN) as roles:
        # Run with the data-plane token; inside it the agent generates on the policy and
        # calls the tools with the data-plane token too.
        result = await bounded(run_episode(roles.channel, DATA))
        assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED, result.error_message
        assert result.turns > 0
        acknowledged = await ro_grpc.RolloutServiceStub(roles.channel).Acknowledge(
            ro_pb.AcknowledgeRequest(request_id=rid(), receipts=[result.receipt]),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        )
        assert acknowledged.acknowledged == 1
        stub = roles.control()
        epochs = {hosted.runtime.instance_name: hosted.runtime.core.epoch for hosted in roles}
        for name, call in control_calls(stub).items():
            error = await refusal(call())
            assert error.metadata["method"].endswith(f"/{name}"), error.metadata
            assert "cause" in error.metadata
        session = stub.ControlSession(None, metadata=DATA, timeout=RPC_TIMEOUT)
        await refusal(session.read())
        watch = stub.WatchBoundaries(pb.WatchBoundariesRequest(), metadata=DATA, timeout=10)
        await refusal(watch.read())
        assert {
            hosted.runtime.instance_name: hosted.runtime.core.epoch for hosted in roles
        } == epochs
        # The coordinator's own fence still passes: nothing was pinned.
        prepared = await stub.Prepare(
            pb.PrepareRequest(
                fence=COORDINATOR,
                request_id=rid(),
                checkpoint_id="ckpt-1",
                lease=duration_from_seconds(60),
            ),
            metadata=CONTROL,
            timeout=RPC_TIMEOUT,
        )
        assert prepared.phase == types_pb2.PHASE_PREPARED
        await stub.Resume(
            pb.ResumeRequest(fence=COORDINATOR, request_id=rid(), checkpoint_id="ckpt-1"),
            metadata=CONTROL,
            timeout=RPC_TIMEOUT,
        )


async def test_a_data_plane_token_calls_tools_and_generates_directly(tmp_path: Path) -> None:
    async with serve_roles(tmp_path, data_token=DATA_TOKEN) as roles, AsyncExitStack() as stack:
        tools_channel = grpc.aio.insecure_channel(roles.tools.address)
        stack.push_async_callback(tools_channel.close, None)
        policy_channel = grpc.aio.insecure_channel(roles.policy.address)
        stack.push_async_callback(policy_channel.close, None)
        tools = rs_grpc.ResourcesServiceStub(tools_channel)
        episode = episode_to_proto(EPISODE)
        task = {"task": make_prompt(3, seed=0).to_dict(), "group_size": 1}
        await tools.SeedSession(
            rs_pb.SeedSessionRequest(
                request_id=rid(), episode=episode, task=struct_from_mapping(task)
            ),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        )
        called = await tools.Call(
            rs_pb.CallRequest(
                request_id=rid(),
                episode=episode,
                tool="check",
                arguments=struct_from_mapping({"guess": 1}),
            ),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        )
        assert "reply" in called.output.fields
        generate = po_grpc.PolicyServiceStub(policy_channel).Generate(
            po_pb.GenerateRequest(
                request_id=rid(), episode=episode, prompt_token_ids=[1, 2], max_new_tokens=2
            ),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        )
        chunks = [chunk async for chunk in generate]
        assert sum(len(chunk.token_ids) for chunk in chunks) > 0
        # The tools' and the policy's control services refuse it as the agent's does.
        for channel in (tools_channel, policy_channel):
            await refusal(
                pb_grpc.CheckpointControlServiceStub(channel).Prepare(
                    pb.PrepareRequest(fence=PINNED, request_id=rid(), checkpoint_id="ckpt-1"),
                    metadata=DATA,
                    timeout=RPC_TIMEOUT,
                )
            )
        assert roles.tools.runtime.core.epoch < PINNED.epoch
        assert roles.policy.runtime.core.epoch < PINNED.epoch


async def test_one_token_serves_both_roles(tmp_path: Path) -> None:
    async with serve_roles(tmp_path, data_token=None) as roles:
        result = await bounded(run_episode(roles.channel, CONTROL))
        assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED, result.error_message
        described = await roles.control().Describe(
            pb.DescribeRequest(fence=COORDINATOR), metadata=CONTROL, timeout=RPC_TIMEOUT
        )
        assert described.instance_name == "agent-0"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await roles.control().Describe(
                pb.DescribeRequest(fence=PINNED), metadata=DATA, timeout=RPC_TIMEOUT
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_participant_holding_only_the_control_digest_serves_the_coordinator(
    tmp_path: Path,
) -> None:
    """docs/spec.md section 10.2 item 8: the participants never hold the control token;
    the coordinator's token passes, the data-plane token, a wrong token and the digest
    itself do not."""
    async with serve_roles(tmp_path, data_token=DATA_TOKEN, digest_only=True) as roles:
        result = await bounded(run_episode(roles.channel, DATA))
        assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED, result.error_message
        await ro_grpc.RolloutServiceStub(roles.channel).Acknowledge(
            ro_pb.AcknowledgeRequest(request_id=rid(), receipts=[result.receipt]),
            metadata=DATA,
            timeout=RPC_TIMEOUT,
        )
        stub = roles.control()
        prepared = await stub.Prepare(
            pb.PrepareRequest(
                fence=COORDINATOR,
                request_id=rid(),
                checkpoint_id="ckpt-1",
                lease=duration_from_seconds(60),
            ),
            metadata=CONTROL,
            timeout=RPC_TIMEOUT,
        )
        assert prepared.phase == types_pb2.PHASE_PREPARED
        await stub.Resume(
            pb.ResumeRequest(fence=COORDINATOR, request_id=rid(), checkpoint_id="ckpt-1"),
            metadata=CONTROL,
            timeout=RPC_TIMEOUT,
        )
        await refusal(
            stub.Describe(pb.DescribeRequest(fence=PINNED), metadata=DATA, timeout=RPC_TIMEOUT)
        )
        for wrong in ("not-the-token", token_sha256(CONTROL_TOKEN)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Describe(
                    pb.DescribeRequest(fence=PINNED),
                    metadata=auth_metadata(wrong),
                    timeout=RPC_TIMEOUT,
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert roles.agent.runtime.core.epoch == COORDINATOR.epoch


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"data_token": DATA_TOKEN}, "needs a control token"),
        ({"token": CONTROL_TOKEN, "data_token": CONTROL_TOKEN}, "must differ"),
        (
            {"token_sha256": token_sha256(CONTROL_TOKEN), "data_token": CONTROL_TOKEN},
            "must differ",
        ),
        ({"token": CONTROL_TOKEN, "token_sha256": token_sha256(CONTROL_TOKEN)}, "not both"),
        ({"token_sha256": "abc"}, "64 hex digits"),
        ({"token": CONTROL_TOKEN, "data_token": DATA_TOKEN, "auth_data_plane": False}, "no use"),
        ({"token": CONTROL_TOKEN, "data_token": "has space"}, "visible ASCII"),
    ],
)
def test_inconsistent_data_tokens_are_refused(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerOptions(**fields)


def test_the_data_token_is_not_in_the_repr() -> None:
    options = ServerOptions(token=CONTROL_TOKEN, data_token=DATA_TOKEN)
    assert DATA_TOKEN not in repr(options)
    assert CONTROL_TOKEN not in repr(options)
    digest = token_sha256(CONTROL_TOKEN)
    assert digest not in repr(ServerOptions(token_sha256=digest.upper()))
    assert ServerOptions(token_sha256=digest.upper()).token_sha256 == digest
