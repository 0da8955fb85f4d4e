"""The coordinator's control client and fan-out against real grpc.aio participants.

Every participant here is a scripted ``CheckpointControlService`` participant
(``tests.support.scripted.ScriptedControl``) on ``127.0.0.1:0``: its ``ControlSession``
dispatches the oneof to the same per-operation handlers as the unary calls; this file's
flavour answers statelessly and records answers by request_id (so that a retry replays
them), and can be told to hang, refuse or break its stream at a named request.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from tests.support.scripted import (
    BOUND_S,
    SESSION_METHOD,
    ControlHandler,
    Observed,
    ScriptedControl,
    hang,
    serve_control,
)
from turnpoint.errors import Reason, TurnpointError
from turnpoint.trainer.control.client import (
    ControlRequest,
    ControlResponse,
    ParticipantControlClient,
)
from turnpoint.trainer.control.failures import (
    CallTimeoutError,
    Failure,
    FailureKind,
    MalformedReplyError,
    NotReadyError,
    SessionBrokenError,
    TransportError,
    classify,
)
from turnpoint.trainer.control.fanout import (
    FanoutError,
    FanoutResult,
    fan_out,
    raise_if_failed,
    retry_same_request,
)
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

TOKEN = "test-token"
FENCE = types_pb2.Fence(coordinator_id="coordinator", epoch=1)


class Participant(ScriptedControl):
    """Stateless answers, recorded by request_id: a retry gets the same answer again."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.answers: dict[str, ControlResponse] = {}
        self.executions: Counter[str] = Counter()
        self.watch_ended = asyncio.Event()

    def default(self, op: str, request: Any) -> ControlResponse:
        header = self.header()
        if op == "describe":
            return pb.DescribeResponse(
                header=header,
                instance_name=self.name,
                protocol_version="turnpoint.v1",
                kind=types_pb2.PARTICIPANT_KIND_AGENT,
                phase=types_pb2.PHASE_IDLE,
            )
        if op == "prepare":
            return pb.PrepareResponse(
                header=header,
                phase=types_pb2.PHASE_PREPARED,
                readiness=types_pb2.ReadinessReport(ready=True),
                checkpoint_id=request.checkpoint_id,
            )
        if op == "renew":
            return pb.RenewResponse(header=header, phase=types_pb2.PHASE_PREPARED)
        if op == "commit":
            return pb.CommitResponse(header=header, checkpoint_id=request.checkpoint_id)
        if op == "resume":
            return pb.ResumeResponse(header=header, phase=types_pb2.PHASE_IDLE, ended_active=True)
        if op == "restore":
            return pb.RestoreResponse(
                header=header, restore_id=request.restore_id, phase=types_pb2.PHASE_RESTORED
            )
        if op == "retire":
            return pb.RetireResponse(header=header, stopped=request.episodes)
        if op == "forget":
            return pb.ForgetResponse(header=header, forgotten=len(request.rollout_ids))
        assert op == "get_status", op
        return pb.GetStatusResponse(header=header, phase=types_pb2.PHASE_IDLE, admission_open=True)

    async def unscripted(self, op: str, request: Any, timeout_s: float) -> ControlResponse:
        return self.default(op, request)

    async def answer(
        self, op: str, request_id: str, request: Any, timeout_s: float
    ) -> ControlResponse:
        if request_id and request_id in self.answers:
            return self.answers[request_id]
        response: ControlResponse = await super().answer(op, request_id, request, timeout_s)
        self.executions[request_id] += 1
        if request_id:
            self.answers[request_id] = response
        return response

    async def watch_boundaries(self) -> AsyncGenerator[pb.WatchBoundariesResponse, None]:
        try:
            yield pb.WatchBoundariesResponse(
                header=self.header(),
                readiness=types_pb2.ReadinessReport(ready=False, blocker_count=1),
                phase=types_pb2.PHASE_PREPARING,
            )
            yield pb.WatchBoundariesResponse(
                header=self.header(),
                boundary=pb.BoundaryEvent(
                    episode=types_pb2.EpisodeId(rollout_id="r-1", attempt=0),
                    state=types_pb2.EPISODE_STATE_PARKED,
                    boundary_index=3,
                ),
                phase=types_pb2.PHASE_PREPARING,
            )
            await asyncio.Event().wait()
        finally:
            # The stream never ends by itself: only the client's cancellation gets here,
            # wherever the generator was suspended at the time.
            self.watch_ended.set()


class Harness:
    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []
        self.clients: list[ParticipantControlClient] = []

    async def start(self, name: str, *, session: bool = True) -> Participant:
        participant = Participant(name)
        self.servers.append(await serve_control(participant, TOKEN, session=session))
        return participant

    def client(
        self,
        participant: Participant,
        *,
        name: str | None = None,
        token: str = TOKEN,
        reply_grace_s: float | None = None,
    ) -> ParticipantControlClient:
        client = ParticipantControlClient(
            participant.address,
            token=token,
            participant_name=name or participant.name,
            reply_grace_s=reply_grace_s,
        )
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        for server in self.servers:
            await server.stop(None)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    harness = Harness()
    try:
        yield harness
    finally:
        await harness.close()


def lease() -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=30)


def prepare(request_id: str, checkpoint_id: str = "ck-1") -> pb.PrepareRequest:
    return pb.PrepareRequest(
        fence=FENCE, request_id=request_id, checkpoint_id=checkpoint_id, lease=lease()
    )


def forget(request_id: str, *rollout_ids: str) -> pb.ForgetRequest:
    return pb.ForgetRequest(fence=FENCE, request_id=request_id, rollout_ids=rollout_ids)


async def warm_up(client: ParticipantControlClient) -> list[Failure]:
    """Connect and learn whether the participant serves sessions, retrying like a caller.

    grpc.aio can lose a stream's real status when the server ends the stream while a
    message is being written (the write reports INTERNAL instead of UNIMPLEMENTED): the
    first call to a participant without sessions then fails transiently, and the
    caller's retry falls back. Returns the transient failures seen on the way.
    """
    failures: list[Failure] = []
    for _ in range(3):
        try:
            await client.call(pb.GetStatusRequest(), 5)
        except SessionBrokenError as error:
            failures.append(classify(error))
        else:
            return failures
    raise AssertionError(f"no answer after {failures}")


TRANSPORTS = pytest.mark.parametrize("session", [True, False], ids=["session", "unary"])


# ------------------------------------------------------------------------ session


async def test_session_correlates_replies_that_arrive_out_of_order(harness: Harness) -> None:
    participant = await harness.start("agent-0")
    release = asyncio.Event()

    async def forget_slowly_if_asked(request: ControlRequest, timeout_s: float) -> ControlResponse:
        assert isinstance(request, pb.ForgetRequest)
        if "slow" in request.rollout_ids:
            await release.wait()
        return participant.default("forget", request)

    participant.script["forget"] = forget_slowly_if_asked
    client = harness.client(participant)

    described = await client.call(pb.DescribeRequest(fence=FENCE), 5)
    assert described.instance_name == "agent-0"
    slow = asyncio.create_task(client.call(forget("f-slow", "slow"), 5))
    await participant.until(lambda: "f-slow" in participant.request_ids())
    fast = await client.call(forget("f-fast", "a", "b"), 5)

    assert fast.forgotten == 2
    assert not slow.done()
    release.set()
    assert (await slow).forgotten == 1
    status = await client.call(pb.GetStatusRequest(), 5)
    assert status.admission_open
    assert client.uses_session
    assert participant.sessions_opened == 1
    assert participant.methods == [SESSION_METHOD]
    assert client.pending_calls == 0


@TRANSPORTS
async def test_a_refusal_raises_the_turnpoint_error_it_carries(
    harness: Harness, session: bool
) -> None:
    participant = await harness.start("agent-0", session=session)

    async def refuse(request: ControlRequest, timeout_s: float) -> ControlResponse:
        raise TurnpointError(Reason.STALE_CHECKPOINT, "ck-1 is finished", {"checkpoint_id": "ck-1"})

    participant.script["prepare"] = refuse
    client = harness.client(participant)
    await warm_up(client)

    with pytest.raises(TurnpointError) as info:
        await client.call(prepare("p-1"), 5)

    assert info.value.reason is Reason.STALE_CHECKPOINT
    assert info.value.metadata == {"checkpoint_id": "ck-1"}
    failure = classify(info.value)
    assert (failure.kind, failure.reason, failure.code) == (
        FailureKind.INVARIANT,
        Reason.STALE_CHECKPOINT,
        grpc.StatusCode.ABORTED,
    )
    assert client.uses_session is session


async def test_a_broken_session_fails_pending_calls_and_the_retry_replays(
    harness: Harness,
) -> None:
    participant = await harness.start("agent-0")
    participant.script["renew"] = hang
    participant.break_after.add("p-1")
    client = harness.client(participant)
    renewing = asyncio.create_task(
        client.call(pb.RenewRequest(fence=FENCE, request_id="r-1", checkpoint_id="ck-1"), 5)
    )
    await participant.until(lambda: "r-1" in participant.request_ids())

    with pytest.raises(SessionBrokenError) as broken:
        await client.call(prepare("p-1"), 5)
    with pytest.raises(SessionBrokenError):
        await renewing

    assert classify(broken.value).kind is FailureKind.TRANSIENT
    assert client.pending_calls == 0
    assert participant.executions["p-1"] == 1
    retried = await client.call(prepare("p-1"), 5)
    assert retried == participant.answers["p-1"]
    assert participant.executions["p-1"] == 1
    assert participant.request_ids().count("p-1") == 2
    assert participant.sessions_opened == 2


async def test_a_participant_without_sessions_is_called_unary_for_good(
    harness: Harness,
) -> None:
    participant = await harness.start("agent-0", session=False)
    client = harness.client(participant)

    failures = await warm_up(client)
    described = await client.call(pb.DescribeRequest(fence=FENCE), 5)
    prepared = await client.call(prepare("p-1"), 5)

    assert all(failure.kind is FailureKind.TRANSIENT for failure in failures)
    assert described.instance_name == "agent-0"
    assert prepared.phase == types_pb2.PHASE_PREPARED
    assert not client.uses_session
    service = "/turnpoint.v1.CheckpointControlService/"
    methods = participant.methods
    # Every call answered unary. A session attempt per warm-up try, and at most one per
    # call after it: a refusal that raced the session's first write ends INTERNAL, not
    # UNIMPLEMENTED (grpc.aio), and that call goes unary once while the next asks again.
    assert [m for m in methods if m != SESSION_METHOD] == [
        service + "GetStatus",
        service + "Describe",
        service + "Prepare",
    ]
    assert len(failures) + 1 <= methods.count(SESSION_METHOD) <= len(failures) + 3, methods
    # Once refused for good (UNIMPLEMENTED), never again.
    before = len(methods)
    await client.call(pb.GetStatusRequest(), 5)
    assert participant.methods[before:] == [service + "GetStatus"]


async def test_a_session_call_gives_up_after_its_timeout_and_grace(harness: Harness) -> None:
    participant = await harness.start("agent-0")
    participant.script["renew"] = hang
    client = harness.client(participant, reply_grace_s=0.0)

    with pytest.raises(CallTimeoutError) as info:
        await client.call(pb.RenewRequest(fence=FENCE, request_id="r-1", checkpoint_id="ck"), 0.05)

    assert classify(info.value).code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.pending_calls == 0
    assert (await client.call(pb.GetStatusRequest(), 5)).admission_open
    assert participant.sessions_opened == 1


async def test_a_cancelled_session_call_is_cancelled_at_the_participant(
    harness: Harness,
) -> None:
    """As gRPC cancels an abandoned unary call, the client cancels an abandoned session
    call with a cancel message; nothing stays pending and the session carries on."""
    participant = await harness.start("agent-0")
    release = asyncio.Event()

    async def renew_when_released(request: ControlRequest, timeout_s: float) -> ControlResponse:
        await release.wait()
        return participant.default("renew", request)

    participant.script["renew"] = renew_when_released
    client = harness.client(participant)
    renewing = asyncio.create_task(
        client.call(pb.RenewRequest(fence=FENCE, request_id="r-1", checkpoint_id="ck"), 30)
    )
    await participant.until(lambda: "r-1" in participant.request_ids())
    assert client.pending_calls == 1

    renewing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await renewing
    assert client.pending_calls == 0
    await participant.until(lambda: participant.cancelled == [("renew", "r-1")])
    release.set()
    assert participant.executions["r-1"] == 0
    assert (await client.call(pb.GetStatusRequest(), 5)).admission_open
    assert participant.sessions_opened == 1


async def test_a_session_call_that_runs_out_of_time_is_cancelled_at_the_participant(
    harness: Harness,
) -> None:
    participant = await harness.start("agent-0")
    participant.script["renew"] = hang
    client = harness.client(participant, reply_grace_s=0.0)

    with pytest.raises(CallTimeoutError):
        await client.call(pb.RenewRequest(fence=FENCE, request_id="r-2", checkpoint_id="ck"), 0.05)

    await participant.until(lambda: participant.cancelled == [("renew", "r-2")])
    assert participant.in_flight["renew"] == 0


async def test_a_cancelled_unary_call_is_cancelled_at_the_participant(harness: Harness) -> None:
    participant = await harness.start("agent-0", session=False)
    participant.script["prepare"] = hang
    client = harness.client(participant)
    await warm_up(client)

    preparing = asyncio.create_task(client.call(prepare("p-1"), 30))
    await participant.until(lambda: participant.in_flight["prepare"] == 1)
    preparing.cancel()

    await participant.until(lambda: participant.cancelled == [("prepare", "p-1")])
    assert preparing.cancelled()


@TRANSPORTS
async def test_a_reply_for_another_checkpoint_breaks_an_invariant(
    harness: Harness, session: bool
) -> None:
    participant = await harness.start("agent-0", session=session)

    async def answer_for_another(request: ControlRequest, timeout_s: float) -> ControlResponse:
        return pb.PrepareResponse(
            header=participant.header(), phase=types_pb2.PHASE_PREPARED, checkpoint_id="ck-9"
        )

    participant.script["prepare"] = answer_for_another
    client = harness.client(participant)
    await warm_up(client)

    with pytest.raises(MalformedReplyError) as info:
        await client.call(prepare("p-1", checkpoint_id="ck-1"), 5)
    assert classify(info.value).kind is FailureKind.INVARIANT


async def test_a_reply_from_another_participant_breaks_an_invariant(harness: Harness) -> None:
    participant = await harness.start("agent-0")
    client = harness.client(participant, name="agent-1")

    with pytest.raises(MalformedReplyError) as info:
        await client.call(pb.GetStatusRequest(), 5)
    assert classify(info.value).kind is FailureKind.INVARIANT


async def test_a_refused_token_is_not_transient(harness: Harness) -> None:
    participant = await harness.start("agent-0")
    client = harness.client(participant, token="not-the-token")

    with pytest.raises(TurnpointError) as info:
        await client.call(prepare("p-1"), 5)

    assert info.value.reason is Reason.UNAUTHENTICATED
    assert classify(info.value).kind is FailureKind.INVARIANT
    assert participant.received == []


async def test_a_mutating_request_needs_a_request_id(harness: Harness) -> None:
    participant = await harness.start("agent-0")
    client = harness.client(participant)

    with pytest.raises(ValueError, match="request_id"):
        await client.call(pb.PrepareRequest(fence=FENCE, checkpoint_id="ck-1"), 5)


async def test_close_fails_pending_calls_and_refuses_new_ones(harness: Harness) -> None:
    participant = await harness.start("agent-0")
    participant.script["renew"] = hang
    client = harness.client(participant)
    renewing = asyncio.create_task(
        client.call(pb.RenewRequest(fence=FENCE, request_id="r-1", checkpoint_id="ck"), 30)
    )
    await participant.until(lambda: "r-1" in participant.request_ids())

    await client.close()

    with pytest.raises(SessionBrokenError):
        await renewing
    with pytest.raises(RuntimeError, match="closed"):
        await client.call(pb.GetStatusRequest(), 5)


async def test_watch_boundaries_streams_until_the_watch_is_left(harness: Harness) -> None:
    participant = await harness.start("agent-0")
    client = harness.client(participant)

    async with client.watch_boundaries(
        pb.WatchBoundariesRequest(fence=FENCE), timeout_s=30
    ) as watch:
        first = await anext(watch)
        second = await anext(watch)

    assert first.WhichOneof("event") == "readiness"
    assert first.readiness.blocker_count == 1
    assert second.boundary.boundary_index == 3
    await asyncio.wait_for(participant.watch_ended.wait(), BOUND_S)


# ------------------------------------------------------------------------- fan-out


@TRANSPORTS
async def test_fan_out_gives_up_on_a_stuck_participant_at_the_deadline(
    harness: Harness, session: bool
) -> None:
    healthy = await harness.start("agent-0")
    stuck = await harness.start("agent-1", session=session)
    stuck.script["prepare"] = hang
    clients = {p.name: harness.client(p) for p in (healthy, stuck)}
    for client in clients.values():
        # Connections and sessions are up before the deadline starts to run.
        await warm_up(client)

    fanning = asyncio.create_task(
        fan_out(
            clients,
            lambda name: prepare(f"prepare-{name}"),
            deadline_s=1.0,
            per_call_timeout_s=30,
            concurrency=8,
        )
    )
    await stuck.until(lambda: stuck.in_flight["prepare"] == 1)
    # The stuck request holds up nothing else on its connection.
    assert (await clients["agent-1"].call(pb.GetStatusRequest(), 5)).admission_open
    result = await fanning

    assert result.responses["agent-0"].phase == types_pb2.PHASE_PREPARED
    failure = result.failures["agent-1"]
    assert (failure.kind, failure.code) == (
        FailureKind.TRANSIENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    assert set(result.durations_s) == {"agent-0", "agent-1"}
    assert clients["agent-1"].pending_calls == 0
    if session:
        # A session request cannot be cancelled on its own: the participant's own
        # timeout ends it; the client only stops waiting.
        assert stuck.sessions_opened == 1
    else:
        await stuck.until(lambda: stuck.cancelled == [("prepare", "prepare-agent-1")])
    with pytest.raises(FanoutError) as info:
        raise_if_failed(result, "prepare")
    assert info.value.transient
    assert set(info.value.failures) == {"agent-1"}


@TRANSPORTS
async def test_a_fan_out_of_one_gives_up_at_the_deadline_and_cancels_the_call(
    harness: Harness, session: bool
) -> None:
    # One participant's call runs in the caller's task: the deadline must still end it.
    stuck = await harness.start("agent-0", session=session)
    stuck.script["prepare"] = hang
    client = harness.client(stuck)
    await warm_up(client)

    result = await fan_out(
        {"agent-0": client},
        lambda name: prepare(f"prepare-{name}"),
        deadline_s=0.5,
        per_call_timeout_s=30,
        concurrency=1,
    )

    assert not result.responses
    failure = result.failures["agent-0"]
    assert (failure.kind, failure.code) == (
        FailureKind.TRANSIENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    assert set(result.durations_s) == {"agent-0"}
    assert client.pending_calls == 0
    if not session:
        await stuck.until(lambda: stuck.cancelled == [("prepare", "prepare-agent-0")])


async def test_fan_out_keeps_at_most_concurrency_calls_in_flight(harness: Harness) -> None:
    gauge = Observed()
    arrived: list[str] = []
    released: dict[str, asyncio.Event] = {}
    in_flight = 0
    peak = 0

    def gated(participant: Participant) -> ControlHandler:
        async def prepare_when_released(
            request: ControlRequest, timeout_s: float
        ) -> ControlResponse:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            arrived.append(participant.name)
            await gauge.notify()
            try:
                await released[participant.name].wait()
            finally:
                in_flight -= 1
            return participant.default("prepare", request)

        return prepare_when_released

    participants = [await harness.start(f"agent-{i}") for i in range(6)]
    for participant in participants:
        released[participant.name] = asyncio.Event()
        participant.script["prepare"] = gated(participant)
    clients = {p.name: harness.client(p) for p in participants}
    for client in clients.values():
        await client.call(pb.GetStatusRequest(), 5)

    fanning = asyncio.create_task(
        fan_out(
            clients,
            lambda name: prepare(f"prepare-{name}"),
            deadline_s=30,
            per_call_timeout_s=30,
            concurrency=2,
        )
    )

    # Release the calls one at a time, in the order they arrived, each only once the
    # next one could have started: an unbounded fan-out shows up as a higher peak.
    def arrived_at_least(count: int) -> Callable[[], bool]:
        return lambda: len(arrived) >= count

    for count in range(6):
        await gauge.until(arrived_at_least(min(count + 2, 6)))
        released[arrived[count]].set()
    result = await fanning

    assert result.ok
    assert set(result.responses) == set(clients)
    assert peak == 2


async def test_retry_same_request_resends_the_same_message_to_transient_failures(
    harness: Harness,
) -> None:
    flaky = await harness.start("agent-0")
    steady = await harness.start("agent-1")
    attempts: Counter[str] = Counter()

    async def commit_after_a_full_disk(
        request: ControlRequest, timeout_s: float
    ) -> ControlResponse:
        assert isinstance(request, pb.CommitRequest)
        attempts[request.request_id] += 1
        if attempts[request.request_id] == 1:
            raise TurnpointError(Reason.STORAGE_UNAVAILABLE, "disk full")
        return flaky.default("commit", request)

    flaky.script["commit"] = commit_after_a_full_disk
    clients = {p.name: harness.client(p) for p in (flaky, steady)}
    requests = {
        name: pb.CommitRequest(
            fence=FENCE, request_id=f"commit-{name}", checkpoint_id="ck-1", snapshot="snap-1"
        )
        for name in clients
    }

    result = await retry_same_request(
        clients, requests, attempts=3, deadline_s=5, per_call_timeout_s=5, concurrency=4
    )

    assert result.ok
    assert {name: r.checkpoint_id for name, r in result.responses.items()} == {
        "agent-0": "ck-1",
        "agent-1": "ck-1",
    }
    assert [request for _, _, request in flaky.received] == [requests["agent-0"]] * 2
    assert steady.request_ids() == ["commit-agent-1"]


async def test_retry_same_request_stops_at_a_broken_invariant(harness: Harness) -> None:
    fenced = await harness.start("agent-0")

    async def refuse(request: ControlRequest, timeout_s: float) -> ControlResponse:
        raise TurnpointError(Reason.FENCED, "epoch 1 < 2")

    fenced.script["resume"] = refuse
    clients = {"agent-0": harness.client(fenced)}
    requests = {
        "agent-0": pb.ResumeRequest(fence=FENCE, request_id="resume-1", checkpoint_id="ck-1")
    }

    result = await retry_same_request(
        clients, requests, attempts=3, deadline_s=5, per_call_timeout_s=5, concurrency=4
    )

    assert result.failures["agent-0"].reason is Reason.FENCED
    assert fenced.request_ids() == ["resume-1"]
    with pytest.raises(FanoutError) as info:
        raise_if_failed(result, "resume")
    assert not info.value.transient


# ------------------------------------------------------------------ classification


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "detail", None)


TRANSIENT = FailureKind.TRANSIENT
INVARIANT = FailureKind.INVARIANT
Code = grpc.StatusCode

CLASSIFICATION: list[tuple[BaseException, FailureKind, Reason | None, grpc.StatusCode | None]] = [
    (TurnpointError(Reason.ADMISSION_CLOSED, "x"), TRANSIENT, Reason.ADMISSION_CLOSED, Code.UNAVAILABLE),
    (TurnpointError(Reason.STORAGE_UNAVAILABLE, "x"), TRANSIENT, Reason.STORAGE_UNAVAILABLE, Code.UNAVAILABLE),
    (TurnpointError(Reason.DEADLINE_EXCEEDED, "x"), TRANSIENT, Reason.DEADLINE_EXCEEDED, Code.DEADLINE_EXCEEDED),
    (TurnpointError(Reason.STALE_CHECKPOINT, "x"), INVARIANT, Reason.STALE_CHECKPOINT, Code.ABORTED),
    (TurnpointError(Reason.CHECKPOINT_CONFLICT, "x"), INVARIANT, Reason.CHECKPOINT_CONFLICT, Code.ABORTED),
    (TurnpointError(Reason.FENCED, "x"), INVARIANT, Reason.FENCED, Code.FAILED_PRECONDITION),
    (TurnpointError(Reason.INVALID_PHASE, "x"), INVARIANT, Reason.INVALID_PHASE, Code.FAILED_PRECONDITION),
    (TurnpointError(Reason.INVALID_CHECKPOINT_STATE, "x"), INVARIANT, Reason.INVALID_CHECKPOINT_STATE, Code.DATA_LOSS),
    (TurnpointError(Reason.UNAUTHENTICATED, "x"), INVARIANT, Reason.UNAUTHENTICATED, Code.UNAUTHENTICATED),
    # The message never decides.
    (TurnpointError(Reason.FENCED, "UNAVAILABLE, retry"), INVARIANT, Reason.FENCED, Code.FAILED_PRECONDITION),
    (rpc_error(Code.UNAVAILABLE), TRANSIENT, None, Code.UNAVAILABLE),
    (rpc_error(Code.DEADLINE_EXCEEDED), TRANSIENT, None, Code.DEADLINE_EXCEEDED),
    (rpc_error(Code.INTERNAL), INVARIANT, None, Code.INTERNAL),
    (rpc_error(Code.UNIMPLEMENTED), INVARIANT, None, Code.UNIMPLEMENTED),
    (SessionBrokenError("a", "ControlSession", "reset", Code.CANCELLED), TRANSIENT, None, Code.CANCELLED),
    (SessionBrokenError("a", "ControlSession", "ended"), TRANSIENT, None, None),
    (CallTimeoutError("a", "Prepare", "late", Code.DEADLINE_EXCEEDED), TRANSIENT, None, Code.DEADLINE_EXCEEDED),
    (TransportError("a", "Prepare", "down", Code.UNAVAILABLE), TRANSIENT, None, Code.UNAVAILABLE),
    (TransportError("a", "Prepare", "no", Code.PERMISSION_DENIED), INVARIANT, None, Code.PERMISSION_DENIED),
    (MalformedReplyError("a", "Prepare", "no header"), INVARIANT, None, None),
    (NotReadyError("a", "ck-1"), FailureKind.NOT_READY, None, None),
    (TimeoutError(), TRANSIENT, None, Code.DEADLINE_EXCEEDED),
    (ValueError("bug"), INVARIANT, None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("error", "kind", "reason", "code"),
    CLASSIFICATION,
    ids=[f"{type(row[0]).__name__}-{i}" for i, row in enumerate(CLASSIFICATION)],
)
def test_classification(
    error: BaseException,
    kind: FailureKind,
    reason: Reason | None,
    code: grpc.StatusCode | None,
) -> None:
    failure = classify(error)
    assert (failure.kind, failure.reason, failure.code) == (kind, reason, code)
    assert failure.error is error
    assert failure.retryable is (kind is not FailureKind.INVARIANT)


def test_a_fanout_error_is_transient_only_when_every_failure_is_retryable() -> None:
    late = Failure(TRANSIENT, None, Code.DEADLINE_EXCEEDED, "late")
    not_ready = Failure(FailureKind.NOT_READY, None, None, "2 blockers")
    fenced = Failure(INVARIANT, Reason.FENCED, Code.FAILED_PRECONDITION, "fenced")

    assert FanoutError("prepare", {"a": late, "b": not_ready}).transient
    assert not FanoutError("prepare", {"a": late, "b": fenced}).transient
    raise_if_failed(FanoutResult(responses={}, failures={}, durations_s={}), "prepare")
    with pytest.raises(FanoutError, match="b: \\[invariant, FENCED, FAILED_PRECONDITION\\]"):
        raise_if_failed(
            FanoutResult(responses={}, failures={"b": fenced}, durations_s={}), "prepare"
        )


async def test_closing_the_client_ends_an_open_watch(harness: Harness) -> None:
    participant = await harness.start("agent-0")
    client = harness.client(participant)
    watch = client.watch_boundaries(pb.WatchBoundariesRequest(fence=FENCE), timeout_s=30)
    await anext(watch)
    await anext(watch)

    async def read_rest() -> list[pb.WatchBoundariesResponse]:
        return [message async for message in watch]

    reading = asyncio.create_task(read_rest())
    await client.close()

    assert await reading == []
    await asyncio.wait_for(participant.watch_ended.wait(), BOUND_S)
