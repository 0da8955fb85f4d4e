"""A re-attaching Run names the incarnation that accepted it; another one refuses it and
starts nothing (docs/spec.md sections 6.5 item 5 and 6.10 item 3).

Real participants on 127.0.0.1: an agent accepts attempt 0, then its server stops (the
process died) and a fresh runtime is served at the same port (its supervisor restarted
it there). The re-attach reaches the newcomer, which refuses it ``STALE_ATTEMPT``
without ever calling the agent's run hook; over the raw wire, and through the trainer's
rollout client, which then waits for the heal instead of sending it again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.participants import METADATA, TOKEN
from tests.support.scripted import poll
from turnpoint._status import error_from_rpc
from turnpoint.auth import ACCEPTED_METADATA_KEY, INCARNATION_METADATA_KEY
from turnpoint.convert import episode_to_proto
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import Agent, EpisodeContext, ParticipantRuntime, SnapshotStore
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.trainer import Rollout, RolloutClientSettings
from turnpoint.trainer.advanced import AgentEndpoint, RolloutClient
from turnpoint.v1 import rollout_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2_grpc as pb_grpc

BOUND_S = 10.0
EPISODE = EpisodeId("r0", 0)


class CountingAgent(Agent):
    """Records every execution its run hook starts; each waits until told to finish."""

    environment = "guess"

    def __init__(self) -> None:
        self.started: list[EpisodeId] = []
        self.finish = asyncio.Event()

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        self.started.append(ctx.episode)
        await self.finish.wait()
        return {"reward": 1.0}


def _host(root: Path, agent: CountingAgent, port: int = 0) -> HostedParticipant:
    runtime = ParticipantRuntime("agent-0", SnapshotStore(root), agent=agent)
    return host_participant(runtime, ServerOptions(token=TOKEN, port=port))


def _run(episode: EpisodeId, incarnation: str = "", boundaries_seen: int = 0) -> pb.RunRequest:
    return pb.RunRequest(
        request_id="run-r0",
        episode=episode_to_proto(episode),
        prompt_group_id="g0",
        group_size=1,
        boundaries_seen=boundaries_seen,
        participant_incarnation=incarnation,
    )


async def test_a_reattach_naming_another_incarnation_is_refused_and_starts_nothing(
    tmp_path: Path,
) -> None:
    first_agent, second_agent = CountingAgent(), CountingAgent()
    first = _host(tmp_path / "first", first_agent)
    await first.start()
    port = first.port
    async with grpc.aio.insecure_channel(first.address) as channel:
        call = pb_grpc.RolloutServiceStub(channel).Run(_run(EPISODE), metadata=METADATA)
        accepted = dict(await call.initial_metadata())
        assert accepted[ACCEPTED_METADATA_KEY] == "1"
        incarnation = accepted[INCARNATION_METADATA_KEY]
        assert incarnation == first.runtime.header().incarnation
        await poll(lambda: first_agent.started == [EPISODE], BOUND_S)
        await first.stop(0)  # the process died with attempt 0 running

    # Its supervisor starts it again at the same address: a new incarnation.
    async with _host(tmp_path / "second", second_agent, port) as second:
        assert second.runtime.header().incarnation != incarnation
        async with grpc.aio.insecure_channel(second.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Run(_run(EPISODE, incarnation, 1), metadata=METADATA):
                    pass
            error = error_from_rpc(refused.value)
            assert error is not None and error.reason is Reason.STALE_ATTEMPT
            assert error.metadata["request_incarnation"] == incarnation
            assert error.metadata["incarnation"] == second.runtime.header().incarnation
            assert error.metadata["episode"] == str(EPISODE)
            # Nothing started there: no run hook, no entry in the work table.
            assert second_agent.started == []
            assert list(second.runtime.core.entries()) == []

            # A first Run (no incarnation) is taken as before; a re-attach naming this
            # incarnation attaches to that execution instead of starting another.
            own = second.runtime.header().incarnation
            call = stub.Run(_run(EPISODE), metadata=METADATA)
            assert dict(await call.initial_metadata())[INCARNATION_METADATA_KEY] == own
            again = stub.Run(_run(EPISODE, own), metadata=METADATA)
            assert dict(await again.initial_metadata())[ACCEPTED_METADATA_KEY] == "1"
            second_agent.finish.set()
            results = [message async for message in again]
            assert results[-1].result.outcome == pb.RUN_OUTCOME_COMPLETED
            assert second_agent.started == [EPISODE]
            call.cancel()


async def test_the_rollout_client_waits_for_the_heal_of_a_restarted_agent(
    tmp_path: Path,
) -> None:
    first_agent, second_agent = CountingAgent(), CountingAgent()
    first = _host(tmp_path / "first", first_agent)
    await first.start()
    port = first.port
    client = RolloutClient(
        {"agent-0": AgentEndpoint(first.address, token=TOKEN)},
        # The heal, not the re-attach bound, decides the attempt's fate.
        settings=RolloutClientSettings(
            reattach_attempts=1000, retry_backoff_s=0.001, max_retry_backoff_s=0.01
        ),
    )
    await client.start()
    try:
        episode = client.dispatch(
            Rollout(
                rollout_id="r0",
                prompt_group_id="g0",
                sibling_index=0,
                group_size=1,
                environment="guess",
                task={"prompt": "p"},
                instance="agent-0",
            )
        )
        await client.wait_for(lambda: [r.episode for r in client.in_flight()] == [episode], BOUND_S)
        await poll(lambda: first_agent.started == [episode], BOUND_S)
        await first.stop(0)
        async with _host(tmp_path / "second", second_agent, port) as second:
            await client.wait_for(lambda: client.stats().lost == 1, BOUND_S)
            assert second_agent.started == []
            assert list(second.runtime.core.entries()) == []
            # Lost there, yet in flight: the heal of agent-0 continues or reruns it.
            assert [r.episode for r in client.in_flight()] == [episode]
            client.end_for_heal([episode])
            assert client.in_flight() == ()
            assert second_agent.started == []
    finally:
        await client.aclose()
