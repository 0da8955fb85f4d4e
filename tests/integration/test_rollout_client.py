"""The trainer's rollout client against real grpc.aio agent servers.

Each agent here is a scripted ``RolloutServiceServicer`` on ``127.0.0.1:0`` that keeps
executions by episode the way a participant does: a Run for a new episode is accepted
(initial metadata ``turnpoint-accepted: 1``) or refused with ADMISSION_CLOSED; a Run for
an episode it holds attaches and streams the boundaries after ``boundaries_seen``; the
test seals boundaries, completes executions, breaks streams and holds verdicts or
acknowledgements at will. Budgets run on a fake clock that only the test moves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.fakes import FakeClock
from turnpoint._status import error_to_grpc_status
from turnpoint.auth import accepted_metadata
from turnpoint.convert import episode_from_proto, episode_to_proto, struct_from_mapping
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import Agent, EpisodeContext, ParticipantRuntime, SnapshotStore
from turnpoint.protocol import EpisodeState, Fence
from turnpoint.server import ServerOptions, host_participant
from turnpoint.trainer import Rollout, RolloutClientSettings, RolloutOutcome, RolloutResult
from turnpoint.trainer.advanced import AgentEndpoint, InFlightRollout, ManifestError, RolloutClient
from turnpoint.trainer.rollouts.values import SavedRollout
from turnpoint.trainer.storage.manifest import TrainerRolloutState
from turnpoint.v1 import rollout_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

# A safety net for waits on events that must happen; never a synchronisation device.
BOUND_S = 10.0


class Signal:
    """Wake-ups for test waits: ``notify`` is synchronous, so a handler being cancelled
    can still report it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(BOUND_S):
            while not predicate():
                await self._event.wait()


@dataclass
class Execution:
    episode: EpisodeId
    turns: list[int] = field(default_factory=list)
    result: pb.RunResult | None = None
    # Bumped to break every stream attached to the execution.
    breaks: int = 0


def receipt_id_of(episode: EpisodeId) -> str:
    return f"{episode.rollout_id}.{episode.attempt}.receipt"


class ScriptedAgent(pb_grpc.RolloutServiceServicer):
    def __init__(self, name: str) -> None:
        self.name = name
        self.signal = Signal()
        self.executions: dict[EpisodeId, Execution] = {}
        self.admission_open = True
        self.runs: list[pb.RunRequest] = []
        self.cancelled: list[EpisodeId] = []
        self.acks: list[pb.AcknowledgeRequest] = []
        self.acked: set[str] = set()
        # When set, a Run waits on it before the verdict; Acknowledge likewise.
        self.verdict_gate: asyncio.Event | None = None
        self.ack_gate: asyncio.Event | None = None
        # The next this-many Runs are accepted, then break at once.
        self.break_after_accept = 0
        # Episodes refused with STALE_ATTEMPT.
        self.stale: set[EpisodeId] = set()
        # Changed by restart(): a re-attach naming another one is refused.
        self.incarnation = "inc-1"

    def header(self) -> types_pb2.ResponseHeader:
        return types_pb2.ResponseHeader(
            participant_id=self.name, incarnation=self.incarnation, epoch=1
        )

    def runs_of(self, episode: EpisodeId) -> list[pb.RunRequest]:
        return [run for run in self.runs if episode_from_proto(run.episode) == episode]

    # -- the test's levers ------------------------------------------------------------

    def seal(self, episode: EpisodeId) -> None:
        execution = self.executions[episode]
        execution.turns.append(len(execution.turns))
        self.signal.notify()

    def complete(self, episode: EpisodeId, output: dict[str, Any] | None = None) -> str:
        execution = self.executions[episode]
        receipt_id = receipt_id_of(episode)
        execution.result = pb.RunResult(
            episode=episode_to_proto(episode),
            outcome=pb.RUN_OUTCOME_COMPLETED,
            receipt=types_pb2.CompletionReceipt(
                episode=episode_to_proto(episode), receipt_id=receipt_id
            ),
            result=struct_from_mapping(output or {}),
            turns=len(execution.turns),
        )
        self.signal.notify()
        return receipt_id

    def break_streams(self, episode: EpisodeId) -> None:
        self.executions[episode].breaks += 1
        self.signal.notify()

    def restart(self) -> None:
        """The process died and came back at the same address: every stream breaks,
        every execution is gone, and the incarnation is new."""
        for execution in self.executions.values():
            execution.breaks += 1
        self.executions = {}
        self.incarnation = "inc-2"
        self.signal.notify()

    # -- the service ------------------------------------------------------------------

    async def Run(
        self, request: pb.RunRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.RunResponse]:
        episode = episode_from_proto(request.episode)
        self.runs.append(request)
        self.signal.notify()
        gate = self.verdict_gate
        if gate is not None:
            await gate.wait()
        if episode in self.stale:
            await self._abort(context, Reason.STALE_ATTEMPT, f"{episode} was retired")
        named = request.participant_incarnation
        if named and named != self.incarnation:
            await self._abort(
                context,
                Reason.STALE_ATTEMPT,
                f"{episode} was accepted by another incarnation",
                {"request_incarnation": named, "incarnation": self.incarnation},
            )
        execution = self.executions.get(episode)
        if execution is None:
            if not self.admission_open:
                await self._abort(context, Reason.ADMISSION_CLOSED, "a checkpoint holds admission")
            execution = self.executions[episode] = Execution(episode)
        # Read before accepting: a test breaks streams as soon as the client sees the
        # acceptance, which may be before this handler runs again after sending it.
        breaks = execution.breaks
        await context.send_initial_metadata(accepted_metadata(self.incarnation))
        self.signal.notify()
        if self.break_after_accept:
            self.break_after_accept -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: connection lost")
        sent = request.boundaries_seen

        def news(sent: int) -> Callable[[], bool]:
            return lambda: (
                len(execution.turns) > sent
                or execution.result is not None
                or execution.breaks != breaks
            )

        try:
            while True:
                await self.signal.until(news(sent))
                if execution.breaks != breaks:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: stream broken")
                # The turns sealed so far: the test may seal the next one while a
                # yield below waits for its send, and that one goes in the next round.
                sealed = len(execution.turns)
                for index in range(sent, sealed):
                    yield pb.RunResponse(
                        header=self.header(),
                        boundary=pb.BoundaryReport(
                            episode=request.episode,
                            boundary_index=index + 1,
                            turn_index=execution.turns[index],
                        ),
                    )
                sent = sealed
                # The result once every sealed turn went before it.
                if execution.result is not None and sent == len(execution.turns):
                    yield pb.RunResponse(header=self.header(), result=execution.result)
                    return
        except asyncio.CancelledError:
            self.cancelled.append(episode)
            self.signal.notify()
            raise

    async def Acknowledge(
        self, request: pb.AcknowledgeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AcknowledgeResponse:
        self.acks.append(request)
        self.signal.notify()
        gate = self.ack_gate
        if gate is not None:
            await gate.wait()
        taken = 0
        for receipt in request.receipts:
            if receipt.receipt_id not in self.acked:
                self.acked.add(receipt.receipt_id)
                taken += 1
        self.signal.notify()
        return pb.AcknowledgeResponse(header=self.header(), acknowledged=taken)

    async def _abort(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        reason: Reason,
        message: str,
        metadata: dict[str, str] | None = None,
    ) -> None:
        status = error_to_grpc_status(TurnpointError(reason, message, metadata))
        await context.abort_with_status(status)  # type: ignore[attr-defined]


class World:
    def __init__(self) -> None:
        self.agents: dict[str, ScriptedAgent] = {}
        self.addresses: dict[str, str] = {}
        self.servers: list[grpc.aio.Server] = []
        self.clients: list[RolloutClient] = []
        self.clock = FakeClock()

    async def add_agent(self, name: str) -> ScriptedAgent:
        agent = ScriptedAgent(name)
        server = grpc.aio.server()
        pb_grpc.add_RolloutServiceServicer_to_server(agent, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        self.agents[name] = agent
        self.addresses[name] = f"127.0.0.1:{port}"
        return agent

    async def client(self, **settings: Any) -> RolloutClient:
        defaults: dict[str, Any] = {
            "retry_backoff_s": 0.0,
            "admission_backoff_s": 0.01,
            "budget_grace_s": 0.0,
        }
        client = RolloutClient(
            {name: AgentEndpoint(address) for name, address in self.addresses.items()},
            settings=RolloutClientSettings(**(defaults | settings)),
            clock=self.clock,
        )
        await client.start()
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()
        for server in self.servers:
            await server.stop(None)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    world = World()
    await world.add_agent("agent-0")
    try:
        yield world
    finally:
        await world.close()


def rollout(
    rollout_id: str,
    *,
    group: str = "g0",
    sibling: int = 0,
    size: int = 1,
    instance: str = "agent-0",
    budget_s: float | None = None,
) -> Rollout:
    return Rollout(
        rollout_id=rollout_id,
        prompt_group_id=group,
        sibling_index=sibling,
        group_size=size,
        environment="guess",
        task={"prompt": f"prompt of {rollout_id}", "target": 7},
        instance=instance,
        budget_s=budget_s,
    )


def owned(client: RolloutClient) -> list[EpisodeId]:
    return [item.episode for item in client.in_flight()]


def boundaries_of(client: RolloutClient, episode: EpisodeId) -> int:
    for item in client.in_flight():
        if item.episode == episode:
            return item.boundaries_seen
    raise AssertionError(f"{episode} is not in flight")


def acked_receipts(agent: ScriptedAgent) -> list[list[str]]:
    return [[receipt.receipt_id for receipt in ack.receipts] for ack in agent.acks]


# --------------------------------------------------------------------------- results


async def test_boundaries_are_recorded_and_each_sibling_acknowledged_at_once(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    first = client.dispatch(rollout("r0", sibling=0, size=2))
    second = client.dispatch(rollout("r1", sibling=1, size=2))
    await client.wait_for(lambda: owned(client) == [first, second], BOUND_S)

    version = client.version
    agent.seal(first)
    await client.wait_for(lambda: boundaries_of(client, first) == 1, BOUND_S)
    assert client.version > version
    agent.seal(first)
    await client.wait_for(lambda: boundaries_of(client, first) == 2, BOUND_S)

    first_receipt = agent.complete(first, {"answer": "seven", "reward": 1.0})
    await agent.signal.until(lambda: first_receipt in agent.acked)
    # Acknowledged while its sibling still runs: per sibling, never per group.
    assert acked_receipts(agent) == [[first_receipt]]
    assert owned(client) == [second]
    (result,) = client.results()
    assert result.episode == first
    assert result.outcome is RolloutOutcome.COMPLETED
    assert result.output == {"answer": "seven", "reward": 1.0}
    assert (result.boundaries, result.turns, result.receipt_id) == (2, 2, first_receipt)
    assert client.ready_groups() == 0
    assert client.take_ready_groups() == []

    second_receipt = agent.complete(second, {"reward": 0.0})
    await agent.signal.until(lambda: second_receipt in agent.acked)
    assert acked_receipts(agent) == [[first_receipt], [second_receipt]]
    assert len({ack.request_id for ack in agent.acks}) == 2
    await client.drain_acknowledgements(BOUND_S)

    assert client.ready_groups() == 1
    (group,) = client.take_ready_groups()
    assert [item.episode for item in group] == [first, second]
    # Trained on: gone from the queue and from the ledger.
    assert client.results() == ()
    assert client.attempts() == {}
    assert agent.cancelled == []


async def test_next_result_takes_the_oldest_and_waits_for_one(world: World) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    episode = client.dispatch(rollout("r0"))
    waiter = asyncio.create_task(client.next_result(BOUND_S))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    agent.complete(episode, {"reward": 1.0})
    result = await waiter
    assert result.episode == episode
    assert client.results() == ()
    with pytest.raises(TimeoutError):
        await client.next_result(0.01)


# --------------------------------------------------------------------------- the gate


async def test_admission_closed_is_resent_after_reopen_without_spending_a_retry_or_budget(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    # No re-attach and a single attempt: any retry spent would abandon the rollout.
    client = await world.client(reattach_attempts=0, max_attempts=1)
    verdict = agent.verdict_gate = asyncio.Event()
    episode = client.dispatch(rollout("r0", budget_s=5.0))
    await agent.signal.until(lambda: len(agent.runs) == 1)
    # Sent but not answered: not the participant's yet, so not part of the cut.
    assert client.in_flight() == ()
    assert client.waiting() == (episode,)

    # The trainer closes its gate, then the checkpoint closes the participant's
    # admission before the Run's verdict: the race docs/spec.md section 5 describes.
    client.close_dispatch()
    agent.admission_open = False
    agent.verdict_gate = None
    verdict.set()
    await client.wait_for(lambda: client.stats().admission_refusals == 1, BOUND_S)
    assert client.in_flight() == ()
    assert client.waiting() == (episode,)
    assert agent.executions == {}

    # The refused Run has no budget running: no amount of time gives it up.
    world.clock.advance(3600.0)
    assert client.expire_due() == []

    agent.admission_open = True
    client.reopen_dispatch()
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    assert [episode_from_proto(run.episode) for run in agent.runs] == [episode, episode]
    assert client.remaining_budget(episode) == pytest.approx(5.0)
    agent.complete(episode)
    await client.wait_for(lambda: len(client.results()) == 1, BOUND_S)
    (result,) = client.results()
    assert (result.episode, result.outcome) == (episode, RolloutOutcome.COMPLETED)
    stats = client.stats()
    assert (stats.reattaches, stats.abandoned, stats.reruns) == (0, 0, 0)
    assert client.pending_retires() == {}


async def test_a_participant_closed_on_its_own_is_retried_while_the_gate_stays_open(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    client = await world.client(reattach_attempts=0, max_attempts=1)
    agent.admission_open = False
    episode = client.dispatch(rollout("r0"))
    await client.wait_for(lambda: client.stats().admission_refusals >= 2, BOUND_S)
    assert client.in_flight() == ()
    agent.admission_open = True
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    assert client.attempts() == {"r0": 0}


async def test_a_run_waiting_at_the_closed_gate_is_not_in_the_cut(world: World) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    verdict = agent.verdict_gate = asyncio.Event()
    sent = client.dispatch(rollout("r0"))
    await agent.signal.until(lambda: len(agent.runs) == 1)

    client.close_dispatch()
    waiting = client.dispatch(rollout("r1"))
    assert client.waiting() == (sent, waiting)

    async def drain_then_cut() -> list[EpisodeId]:
        await client.drain_acknowledgements(BOUND_S)
        return owned(client)

    drained = asyncio.create_task(drain_then_cut())
    agent.verdict_gate = None
    verdict.set()
    # The drain returns only once the Run already sent has its verdict, so the cut it
    # precedes holds it; the Run behind the closed gate was never sent.
    assert await drained == [sent]
    assert client.waiting() == (waiting,)
    assert [episode_from_proto(run.episode) for run in agent.runs] == [sent]
    state = client.rollout_state()
    assert {item["rollout_id"]: item["accepted"] for item in state.in_flight} == {
        "r0": True,
        "r1": False,
    }

    client.reopen_dispatch()
    await client.wait_for(lambda: owned(client) == [sent, waiting], BOUND_S)


async def test_an_instance_closed_on_its_own_does_not_hold_up_the_others(world: World) -> None:
    await world.add_agent("agent-1")
    client = await world.client(max_concurrency=1)
    client.close_dispatch_to("agent-1")
    blocked = client.dispatch(rollout("r0", instance="agent-1"))
    free = client.dispatch(rollout("r1", instance="agent-0"))
    await client.wait_for(lambda: owned(client) == [free], BOUND_S)
    assert client.waiting() == (blocked,)
    assert world.agents["agent-1"].runs == []

    world.agents["agent-0"].complete(free)
    client.reopen_dispatch_to("agent-1")
    await client.wait_for(lambda: owned(client) == [blocked], BOUND_S)


# --------------------------------------------------------------------------- broken streams


async def test_a_broken_stream_reattaches_with_the_same_episode_and_boundaries_seen(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    episode = client.dispatch(rollout("r0"))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    agent.seal(episode)
    agent.seal(episode)
    await client.wait_for(lambda: boundaries_of(client, episode) == 2, BOUND_S)

    agent.break_streams(episode)
    await agent.signal.until(lambda: len(agent.runs) == 2)
    first, again = agent.runs
    assert episode_from_proto(again.episode) == episode
    assert again.boundaries_seen == 2
    assert again.request_id == first.request_id
    assert again.task == first.task
    # Still the participant's the whole time, and only one execution exists there.
    assert owned(client) == [episode]
    assert list(agent.executions) == [episode]

    agent.seal(episode)
    await client.wait_for(lambda: boundaries_of(client, episode) == 3, BOUND_S)
    receipt = agent.complete(episode, {"reward": 1.0})
    await agent.signal.until(lambda: receipt in agent.acked)
    (result,) = client.results()
    assert (result.episode, result.boundaries) == (episode, 3)
    assert client.stats().reattaches == 1
    assert client.pending_retires() == {}


async def test_after_the_reattach_bound_the_attempt_is_retired_and_the_rollout_rerun(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    client = await world.client(reattach_attempts=2)
    agent.break_after_accept = 3
    episode = client.dispatch(rollout("r0"))
    rerun = episode.next_attempt()
    await client.wait_for(lambda: owned(client) == [rerun], BOUND_S)

    assert len(agent.runs_of(episode)) == 3
    assert client.pending_retires() == {"agent-0": (episode,)}
    assert client.attempts() == {"r0": 1}
    (fresh,) = agent.runs_of(rerun)
    assert fresh.boundaries_seen == 0
    agent.complete(rerun)
    await client.wait_for(lambda: len(client.results()) == 1, BOUND_S)
    assert client.results()[0].episode == rerun

    client.retired("agent-0", [episode])
    assert client.pending_retires() == {}


async def test_a_stale_attempt_is_dropped_without_a_retire_and_rerun(world: World) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    episode = client.dispatch(rollout("r0"))
    agent.stale.add(episode)
    await client.wait_for(lambda: owned(client) == [episode.next_attempt()], BOUND_S)
    assert client.pending_retires() == {}
    assert client.attempts() == {"r0": 1}


async def test_a_reattach_refused_by_a_new_incarnation_is_never_sent_again_and_reruns(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    client = await world.client(reattach_attempts=2)
    episode = client.dispatch(rollout("r0"))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    agent.seal(episode)
    await client.wait_for(lambda: boundaries_of(client, episode) == 1, BOUND_S)

    agent.restart()
    rerun = episode.next_attempt()
    await client.wait_for(lambda: owned(client) == [rerun], BOUND_S)
    # The first Run named no incarnation; the re-attach named the one that accepted,
    # was refused, and was never sent again: the bound abandoned it without a call.
    first, reattach = agent.runs_of(episode)
    assert (first.participant_incarnation, reattach.participant_incarnation) == ("", "inc-1")
    assert reattach.request_id == first.request_id and reattach.boundaries_seen == 1
    assert episode not in agent.executions, "the new incarnation started nothing"
    assert client.stats().lost == 1
    assert client.pending_retires() == {"agent-0": (episode,)}
    # The rerun is a first Run: it names no incarnation, and the new one takes it.
    (fresh,) = agent.runs_of(rerun)
    assert fresh.participant_incarnation == "" and fresh.boundaries_seen == 0
    agent.complete(rerun)
    await client.wait_for(lambda: len(client.results()) == 1, BOUND_S)


async def test_a_lost_attempt_waits_for_its_heal_without_another_run(world: World) -> None:
    agent = world.agents["agent-0"]
    # The heal, not the client, decides its fate: the bound is out of reach.
    client = await world.client(
        reattach_attempts=1000, retry_backoff_s=0.001, max_retry_backoff_s=0.005
    )
    episode = client.dispatch(rollout("r0"))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    agent.restart()
    await client.wait_for(lambda: client.stats().lost == 1, BOUND_S)
    # Several pauses counted as broken calls later, still only the refused re-attach.
    await client.wait_for(lambda: client.stats().reattaches >= 5, BOUND_S)
    assert len(agent.runs_of(episode)) == 2
    assert owned(client) == [episode], "in flight: the heal of its participant takes it"
    client.end_for_heal([episode])
    assert client.in_flight() == ()
    assert client.pending_retires() == {}
    assert len(agent.runs_of(episode)) == 2


async def test_the_rollout_is_abandoned_once_its_attempts_are_spent(world: World) -> None:
    agent = world.agents["agent-0"]
    client = await world.client(reattach_attempts=0, max_attempts=2)
    agent.break_after_accept = 2
    client.dispatch(rollout("r0"))
    await client.wait_for(lambda: len(client.results()) == 1, BOUND_S)
    (result,) = client.results()
    assert result.outcome is RolloutOutcome.ABANDONED
    assert result.episode == EpisodeId("r0", 1)
    assert client.in_flight() == ()
    assert client.pending_retires() == {"agent-0": (EpisodeId("r0", 0), EpisodeId("r0", 1))}


# --------------------------------------------------------------------------- budgets


async def test_a_spent_budget_cancels_the_run_and_the_participant_sees_it(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    episode = client.dispatch(rollout("r0", budget_s=10.0))
    quiet = client.dispatch(rollout("r1", budget_s=30.0))
    await client.wait_for(lambda: owned(client) == [episode, quiet], BOUND_S)
    agent.seal(episode)
    await client.wait_for(lambda: boundaries_of(client, episode) == 1, BOUND_S)

    world.clock.advance(9.5)
    assert client.expire_due() == []
    world.clock.advance(1.0)
    assert client.expire_due() == [episode]
    await agent.signal.until(lambda: episode in agent.cancelled)

    (result,) = client.results()
    assert (result.episode, result.outcome) == (episode, RolloutOutcome.GIVEN_UP)
    assert result.active_time_s == pytest.approx(10.5)
    assert owned(client) == [quiet]
    # Cancelled: no acknowledgement owed; its sealed boundary is freed by a retire.
    assert agent.acks == []
    assert client.pending_retires() == {"agent-0": (episode,)}
    assert quiet not in agent.cancelled


async def test_budgets_stop_while_any_holder_holds(world: World) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    episode = client.dispatch(rollout("r0", budget_s=10.0))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    world.clock.advance(4.0)

    snapshot = client.hold_deadlines("snapshot")
    weight_sync = client.hold_deadlines("weight-sync")
    world.clock.advance(100.0)
    assert client.expire_due() == []
    # The snapshot ends while the weight sync still holds: clocks stay stopped.
    client.release_deadlines(snapshot)
    client.release_deadlines(snapshot)  # a second release of the same hold is a no-op
    world.clock.advance(100.0)
    assert client.expire_due() == []
    assert client.deadlines_held
    assert client.remaining_budget(episode) == pytest.approx(6.0)

    client.release_deadlines(weight_sync)
    world.clock.advance(5.0)
    assert client.expire_due() == []
    assert client.remaining_budget(episode) == pytest.approx(1.0)

    # The timer wakes when holds change: with the budget spent under a hold, the
    # release alone gives the rollout up (nobody calls expire_due here).
    hold = client.hold_deadlines("another snapshot")
    world.clock.advance(2.0)
    assert client.remaining_budget(episode) == pytest.approx(1.0)
    client.release_deadlines(hold)
    world.clock.advance(2.0)
    client.release_deadlines(client.hold_deadlines("tick"))
    await agent.signal.until(lambda: episode in agent.cancelled)
    assert client.results()[0].outcome is RolloutOutcome.GIVEN_UP


# --------------------------------------------------------------------------- acknowledgements


async def test_drain_waits_for_acknowledgements_in_flight(world: World) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    release = agent.ack_gate = asyncio.Event()
    episode = client.dispatch(rollout("r0"))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    receipt = agent.complete(episode)
    await agent.signal.until(lambda: len(agent.acks) == 1)

    with pytest.raises(TimeoutError):
        await client.drain_acknowledgements(0.05)
    assert receipt not in agent.acked

    async def drain_then_look() -> set[str]:
        await client.drain_acknowledgements(BOUND_S)
        return set(agent.acked)

    drained = asyncio.create_task(drain_then_look())
    release.set()
    assert await drained == {receipt}
    assert client.stats().acknowledged == 1


async def test_resolve_acknowledges_a_recorded_result_again(world: World) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    episode = client.dispatch(rollout("r0"))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    receipt = agent.complete(episode)
    await agent.signal.until(lambda: receipt in agent.acked)
    await client.wait_for(lambda: client.stats().acknowledged == 1, BOUND_S)
    # The prepare still reports it (say the ack reply was lost): acknowledge again.
    assert await client.resolve_unacknowledged("agent-0", episode, receipt) == "acknowledge"
    assert acked_receipts(agent) == [[receipt], [receipt]]
    assert client.pending_retires() == {}


async def test_resolve_retires_what_the_trainer_gave_up(world: World) -> None:
    client = await world.client()
    episode = client.dispatch(rollout("r0", budget_s=1.0))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    world.clock.advance(2.0)
    assert client.expire_due() == [episode]
    # The cancellation was lost and the run completed anyway (section 6, case 3).
    decision = await client.resolve_unacknowledged("agent-0", episode, "late-receipt")
    assert decision == "retire"
    assert client.pending_retires() == {"agent-0": (episode,)}
    assert [result.outcome for result in client.results()] == [RolloutOutcome.GIVEN_UP]


async def test_resolve_hurries_a_backing_off_reattach_to_fetch_the_result(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    # A re-attach would wait a minute; resolve must not.
    client = await world.client(retry_backoff_s=60.0, max_retry_backoff_s=60.0)
    episode = client.dispatch(rollout("r0"))
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
    agent.break_streams(episode)
    await client.wait_for(lambda: client.stats().reattaches == 1, BOUND_S)
    receipt = agent.complete(episode, {"reward": 1.0})

    assert await client.resolve_unacknowledged("agent-0", episode, receipt) == "acknowledge"
    assert receipt in agent.acked
    (result,) = client.results()
    assert (result.episode, result.output) == (episode, {"reward": 1.0})


# --------------------------------------------------------------------------- snapshot & restore


async def test_rollout_state_installs_into_a_fresh_client_and_restores(world: World) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    done = client.dispatch(rollout("r0", sibling=0, size=2, budget_s=50.0))
    running = client.dispatch(rollout("r1", sibling=1, size=2, budget_s=50.0))
    await client.wait_for(lambda: owned(client) == [done, running], BOUND_S)
    agent.seal(running)
    agent.complete(done, {"reward": 1.0})
    await client.wait_for(
        lambda: len(client.results()) == 1 and boundaries_of(client, running) == 1, BOUND_S
    )
    client.close_dispatch()
    client.dispatch(rollout("r2", group="g1", budget_s=50.0))
    client.set_data_loader({"epoch": 0, "index": 3})
    version = client.version

    state = client.rollout_state()
    assert client.rollout_state() == state
    assert client.version == version  # reading the cut changes nothing
    assert TrainerRolloutState.from_dict(json.loads(json.dumps(state.to_dict())), "rs") == state
    assert state.attempts == {"r0": 0, "r1": 0, "r2": 0}
    assert state.data_loader == {"epoch": 0, "index": 3}
    assert [item["rollout_id"] for item in state.queue] == ["r0"]
    by_id = {item["rollout_id"]: item for item in state.in_flight}
    assert (by_id["r1"]["accepted"], by_id["r1"]["boundaries_seen"]) == (True, 1)
    assert (by_id["r2"]["accepted"], by_id["r2"]["boundaries_seen"]) == (False, 0)
    assert by_id["r1"]["task"] == {"prompt": "prompt of r1", "target": 7}

    restored = await world.client()
    saved = {item.rollout.episode.rollout_id: item for item in restored.install(state)}
    assert set(saved) == {"r1", "r2"}
    assert [result.episode for result in restored.results()] == [done]
    assert restored.data_loader == {"epoch": 0, "index": 3}
    assert restored.rollout_state() == state  # nothing lost before anything resumed

    # A restored N+1 belongs to the participant that installed it, even before its Run,
    # and passes the closed gate; a rerun from the prompt waits for the gate.
    restored.close_dispatch()
    continued = restored.redispatch(saved["r1"].rollout)
    again = restored.rerun_from_prompt(saved["r2"].rollout)
    assert (continued, again) == (EpisodeId("r1", 1), EpisodeId("r2", 1))
    assert owned(restored) == [continued]
    assert boundaries_of(restored, continued) == 1
    assert restored.remaining_budget(continued) == pytest.approx(50.0)
    await agent.signal.until(lambda: len(agent.runs_of(continued)) == 1)
    assert agent.runs_of(continued)[0].boundaries_seen == 1
    assert agent.runs_of(again) == []
    assert restored.waiting() == (again,)
    assert restored.attempts() == {"r0": 0, "r1": 1, "r2": 1}

    # Never run again what the queue holds, nor a rollout twice.
    with pytest.raises(ValueError, match="already has a result"):
        restored.redispatch(InFlightRollout(done, "agent-0", "g0", 0, 2, "guess", 0))
    with pytest.raises(ValueError, match="already running"):
        restored.redispatch(saved["r1"].rollout)
    with pytest.raises(RuntimeError, match="has not run anything"):
        restored.install(state)

    restored.reopen_dispatch()
    await restored.wait_for(lambda: owned(restored) == [continued, again], BOUND_S)
    agent.complete(continued)
    await restored.wait_for(lambda: restored.ready_groups() == 1, BOUND_S)
    (group,) = restored.take_ready_groups()
    assert [result.episode for result in group] == [done, continued]


async def test_a_restored_attempt_the_participant_does_not_hold_waits_for_the_gate(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    client = await world.client()
    client.install(
        TrainerRolloutState(
            attempts={"r0": 2},
            in_flight=(
                SavedRollout(
                    InFlightRollout(EpisodeId("r0", 2), "agent-0", "g0", 0, 1, "guess", 3),
                    budget_s=None,
                    accepted=True,
                ).to_json(),
            ),
        )
    )
    agent.admission_open = False
    client.close_dispatch()
    (saved,) = client.rollout_state().in_flight
    episode = client.redispatch(SavedRollout.from_json(saved).rollout)
    assert owned(client) == [episode]
    await client.wait_for(lambda: client.stats().admission_refusals == 1, BOUND_S)
    # Refused: it was not installed there after all, so it is nobody's until accepted.
    assert client.in_flight() == ()
    assert client.waiting() == (episode,)
    agent.admission_open = True
    client.reopen_dispatch()
    await client.wait_for(lambda: owned(client) == [episode], BOUND_S)


async def test_a_restored_attempt_names_the_incarnation_it_was_installed_into(
    world: World,
) -> None:
    agent = world.agents["agent-0"]
    client = await world.client(
        reattach_attempts=1000, retry_backoff_s=0.001, max_retry_backoff_s=0.005
    )
    client.install(
        TrainerRolloutState(
            attempts={"r0": 2},
            in_flight=(
                SavedRollout(
                    InFlightRollout(EpisodeId("r0", 2), "agent-0", "g0", 0, 1, "guess", 3),
                    budget_s=None,
                    accepted=True,
                ).to_json(),
            ),
        )
    )
    # Installed into inc-1, which died before the Run came: inc-2 must not start it.
    agent.restart()
    (saved,) = client.rollout_state().in_flight
    episode = client.redispatch(SavedRollout.from_json(saved).rollout, incarnation="inc-1")
    await client.wait_for(lambda: client.stats().lost == 1, BOUND_S)
    (run,) = agent.runs_of(episode)
    assert run.participant_incarnation == "inc-1" and run.boundaries_seen == 3
    assert episode not in agent.executions
    assert owned(client) == [episode], "in flight until its heal"


def test_results_and_saved_rollouts_parse_strictly() -> None:
    result = RolloutResult(
        episode=EpisodeId("r0", 1),
        instance="agent-0",
        prompt_group_id="g0",
        sibling_index=0,
        group_size=2,
        environment="guess",
        outcome=RolloutOutcome.COMPLETED,
        output={"reward": 1.0},
        task={"prompt": "p"},
        turns=2,
        boundaries=2,
        active_time_s=1.5,
        receipt_id="x",
    )
    raw = result.to_json()
    assert RolloutResult.from_json(json.loads(json.dumps(raw))) == result
    with pytest.raises(ManifestError, match=r"unknown field\(s\) \['extra'\]"):
        RolloutResult.from_json(raw | {"extra": 1})
    with pytest.raises(ManifestError, match=r"missing field\(s\) \['turns'\]"):
        RolloutResult.from_json({key: value for key, value in raw.items() if key != "turns"})
    with pytest.raises(ManifestError, match="unknown outcome"):
        RolloutResult.from_json(raw | {"outcome": "maybe"})

    saved = SavedRollout(
        InFlightRollout(EpisodeId("r1", 0), "agent-0", "g0", 1, 2, "guess", 1, {"p": 1}),
        budget_s=30.0,
        accepted=True,
    )
    raw = saved.to_json()
    assert SavedRollout.from_json(json.loads(json.dumps(raw))) == saved
    with pytest.raises(ManifestError, match="unknown field"):
        SavedRollout.from_json(raw | {"priority": 1})
    with pytest.raises(ManifestError, match="sibling_index"):
        SavedRollout.from_json(raw | {"sibling_index": 2})
    with pytest.raises(ManifestError, match="budget_s"):
        SavedRollout.from_json(raw | {"budget_s": 0})


def test_rollouts_are_validated() -> None:
    with pytest.raises(ValueError, match="sibling_index"):
        rollout("r0", sibling=2, size=2)
    with pytest.raises(ValueError, match="not plain JSON"):
        Rollout("r0", "g0", 0, 1, "guess", {"x": float("nan")}, "agent-0")
    with pytest.raises(ValueError, match="rollout_id"):
        rollout("../r0")


# --------------------------------------------------------------------------- a real agent

TOKEN = "rollout-test-token"
FENCE = Fence("coordinator", 1)


class StepAgent(Agent):
    """An SDK agent whose turns the test takes one step at a time."""

    environment = "guess"

    def __init__(self) -> None:
        self.steps: dict[str, asyncio.Queue[str]] = {}

    def queue(self, rollout_id: str) -> asyncio.Queue[str]:
        return self.steps.setdefault(rollout_id, asyncio.Queue())

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        turn = 0
        queue = self.queue(ctx.episode.rollout_id)
        while await queue.get() == "turn":
            await ctx.boundary(turn, {"turn": turn, "prompt": task["prompt"]})
            turn += 1
        return {"turns": turn, "reward": 1.0}


@pytest.fixture
async def real_agent(tmp_path: Path) -> AsyncIterator[tuple[ParticipantRuntime, StepAgent, str]]:
    agent = StepAgent()
    runtime = ParticipantRuntime("agent-0", SnapshotStore(tmp_path), agent=agent)
    hosted = host_participant(runtime, ServerOptions(token=TOKEN))
    async with hosted:
        yield runtime, agent, hosted.address


async def real_client(address: str, clock: FakeClock | None = None) -> RolloutClient:
    client = RolloutClient(
        {"agent-0": AgentEndpoint(address, token=TOKEN)},
        settings=RolloutClientSettings(
            retry_backoff_s=0.0, admission_backoff_s=0.01, budget_grace_s=0.0
        ),
        **({} if clock is None else {"clock": clock}),
    )
    await client.start()
    return client


def participant_states(runtime: ParticipantRuntime) -> dict[EpisodeId, EpisodeState]:
    return {entry.key.episode: entry.state for entry in runtime.core.entries()}


async def test_a_real_agent_through_results_acks_and_a_checkpoint(
    real_agent: tuple[ParticipantRuntime, StepAgent, str],
) -> None:
    runtime, agent, address = real_agent
    client = await real_client(address)
    try:
        first = client.dispatch(rollout("r0", sibling=0, size=2))
        second = client.dispatch(rollout("r1", sibling=1, size=2))
        await client.wait_for(lambda: owned(client) == [first, second], BOUND_S)
        agent.queue("r0").put_nowait("turn")
        agent.queue("r0").put_nowait("turn")
        await client.wait_for(lambda: boundaries_of(client, first) == 2, BOUND_S)
        agent.queue("r0").put_nowait("finish")
        await client.wait_for(lambda: len(client.results()) == 1, BOUND_S)
        await client.drain_acknowledgements(BOUND_S)
        # Acknowledged: the participant dropped the result; nothing blocks a prepare.
        assert first not in participant_states(runtime)
        assert client.results()[0].output == {"turns": 2, "reward": 1.0}

        # Snapshot steps 2-4 (docs/spec.md section 7.4) against the real participant.
        client.close_dispatch()
        hold = client.hold_deadlines("snapshot")
        late = client.dispatch(rollout("r2", group="g1"))
        await client.drain_acknowledgements(BOUND_S)
        agent.queue("r1").put_nowait("turn")
        prepared = await runtime.prepare(FENCE, "prepare-1", "run-000000000001", timeout_s=5.0)
        assert prepared.readiness.ready
        await client.wait_for(lambda: boundaries_of(client, second) == 1, BOUND_S)
        assert owned(client) == [second]
        assert set(participant_states(runtime)) == {second}
        assert client.waiting() == (late,)

        await runtime.resume(FENCE, "resume-1", "run-000000000001", timeout_s=5.0)
        client.reopen_dispatch()
        client.release_deadlines(hold)
        await client.wait_for(lambda: owned(client) == [second, late], BOUND_S)
        agent.queue("r1").put_nowait("finish")
        agent.queue("r2").put_nowait("finish")
        await client.wait_for(lambda: len(client.results()) == 3, BOUND_S)
        await client.drain_acknowledgements(BOUND_S)
        assert participant_states(runtime) == {}
        groups = client.take_ready_groups()
        assert [[result.episode for result in group] for group in groups] == [
            [first, second],
            [late],
        ]
    finally:
        await client.aclose()


async def test_a_real_agent_refusing_during_a_checkpoint_gets_the_run_after_resume(
    real_agent: tuple[ParticipantRuntime, StepAgent, str],
) -> None:
    runtime, agent, address = real_agent
    client = await real_client(address)
    try:
        await runtime.prepare(FENCE, "prepare-1", "run-000000000001", timeout_s=5.0)
        episode = client.dispatch(rollout("r0"))
        await client.wait_for(lambda: client.stats().admission_refusals >= 1, BOUND_S)
        assert client.in_flight() == ()
        await runtime.resume(FENCE, "resume-1", "run-000000000001", timeout_s=5.0)
        await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
        agent.queue("r0").put_nowait("finish")
        await client.wait_for(lambda: len(client.results()) == 1, BOUND_S)
        assert client.attempts() == {"r0": 0}
        assert client.stats().reruns == 0
    finally:
        await client.aclose()


async def test_a_real_agent_finishes_a_given_up_run_as_cancelled(
    real_agent: tuple[ParticipantRuntime, StepAgent, str],
) -> None:
    runtime, _, address = real_agent
    clock = FakeClock()
    client = await real_client(address, clock)
    try:
        episode = client.dispatch(rollout("r0", budget_s=10.0))
        await client.wait_for(lambda: owned(client) == [episode], BOUND_S)
        assert episode in participant_states(runtime)
        clock.advance(11.0)
        assert client.expire_due() == [episode]
        # The cancellation reached the participant: the execution is gone, nothing owed.
        assert await runtime.wait_until(lambda core: not any(core.entries()), BOUND_S)
        assert client.results()[0].outcome is RolloutOutcome.GIVEN_UP
        # Still retired: a resources server may hold its session (spec section 7.6 item 2).
        assert client.pending_retires() == {"agent-0": (episode,)}
    finally:
        await client.aclose()
