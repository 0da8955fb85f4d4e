"""The asyncio side of a prepare: rounds, readiness streams and unacknowledged results.

docs/spec.md section 7.4 step 4. What to do next is decided by the pure core
(:class:`~turnpoint.trainer.snapshots.core.ParticipantPrepare` and
:class:`~turnpoint.trainer.snapshots.core.UnackedLedger`); this module only sends,
waits and asks the rollout side.

The request id of a repeated prepare
------------------------------------
Each participant gets rounds of at most ``control_timeout_s`` under the prepare's one
deadline; a round answered not-ready with time left is sent again with the *same*
request id. That is safe because a participant records only a *ready* prepare answer
for replay (docs/spec.md section 4.3); the participant SDK treats a repeated prepare of
the active checkpoint as "renew and keep waiting" (``ParticipantCore.begin_prepare``),
and its per-request answer log is consulted only for fenced requests. A participant
that did replay a recorded not-ready answer would just be reported not ready at the
deadline, never wrongly ready. Reusing the id keeps the "one id per (operation,
checkpoint, instance)" rule without exception.

Between rounds the coordinator does not poll: it watches the participant's
``WatchBoundaries`` stream (:func:`watch_readiness`) and sends the next round when
readiness changes (participants without the stream get the next round at once, with a
short backoff only if they answer instantly). The same stream delivers the blockers of a
prepare as they appear, so an unacknowledged completion (docs/spec.md section 6.7) is
resolved while the prepare waits, not only after a not-ready answer: the rollout side
acknowledges it, or says it must be retired, which can only happen once the participant
is idle again, so that prepare gives up at once instead of waiting out the deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import grpc

from turnpoint.errors import TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.trainer.control.client import (
    ControlRequest,
    ControlResponse,
    ParticipantControlClient,
)
from turnpoint.trainer.control.failures import (
    ControlCallError,
    FailureKind,
    MalformedReplyError,
    NotReadyError,
    SessionBrokenError,
    TransportError,
    classify,
)
from turnpoint.trainer.control.fanout import ControlCaller
from turnpoint.trainer.control.operations import episodes_of
from turnpoint.trainer.metrics import CoordinatorMetrics
from turnpoint.trainer.rollouts.side import UnackedDecision
from turnpoint.trainer.snapshots.core import (
    Answer,
    ParticipantPrepare,
    Step,
    UnackedLedger,
)
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

_LOG = logging.getLogger(__name__)

UnackedResolver = Callable[[str, EpisodeId, str], Awaitable[UnackedDecision]]
"""``(instance, episode, receipt_id) -> "acknowledge" | "retire"``: the rollout side's
:meth:`~turnpoint.trainer.rollouts.side.RolloutSide.resolve_unacknowledged`."""


def is_ready(response: pb.PrepareResponse) -> bool:
    """PREPARED, or COMMITTED by a prepare that committed saved-nothing (spec 4.6 item 8)."""
    return response.phase == types_pb2.PHASE_PREPARED or (
        response.committed_empty and response.phase == types_pb2.PHASE_COMMITTED
    )


class Unacked:
    """Asks the rollout side about the unacknowledged completions prepares report, each
    receipt once (concurrent reports of one receipt share the question); the
    :class:`~turnpoint.trainer.snapshots.core.UnackedLedger` keeps the decisions."""

    def __init__(self, resolve: UnackedResolver | None, metrics: CoordinatorMetrics | None) -> None:
        self._resolve = resolve
        self._metrics = metrics
        self.ledger = UnackedLedger(can_acknowledge=resolve is not None)
        self._asking: dict[tuple[str, str], asyncio.Future[UnackedDecision]] = {}
        # Per instance, done once it holds a completion that must be retired: it wakes
        # that participant's prepare, which then gives up. A future rather than an
        # event: a prepare round waits on it with a callback, not with a task of its own.
        self._hopeless: dict[str, asyncio.Future[None]] = {}
        self._cores: dict[str, ParticipantPrepare] = {}

    def follow(self, core: ParticipantPrepare) -> asyncio.Future[None]:
        """Tell ``core`` when its participant becomes hopeless; the future, done then,
        wakes its waits."""
        self._cores[core.instance] = core
        return self.hopeless(core.instance)

    def hopeless(self, instance: str) -> asyncio.Future[None]:
        found = self._hopeless.get(instance)
        if found is None:
            found = self._hopeless[instance] = asyncio.get_running_loop().create_future()
        return found

    async def handle(self, instance: str, readiness: types_pb2.ReadinessReport) -> None:
        for blocker in readiness.blockers:
            if blocker.state != types_pb2.EPISODE_STATE_COMPLETED_UNACKED:
                continue
            receipt = blocker.receipt
            if not receipt.receipt_id:
                raise MalformedReplyError(
                    instance, "Prepare", "an unacknowledged completion carries no receipt"
                )
            (episode,) = episodes_of([receipt.episode], instance, "Prepare")
            decision = await self._decide(instance, episode, receipt.receipt_id)
            verdict = self.ledger.record(instance, episode, receipt.receipt_id, decision)
            if verdict.hopeless:
                core = self._cores.get(instance)
                if core is not None:
                    core.mark_hopeless(verdict.reason)
                hopeless = self.hopeless(instance)
                if not hopeless.done():
                    hopeless.set_result(None)

    async def _decide(self, instance: str, episode: EpisodeId, receipt_id: str) -> UnackedDecision:
        known = self.ledger.decided(instance, receipt_id)
        if known is not None:
            return known.decision
        key = (instance, receipt_id)
        pending = self._asking.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        pending = asyncio.get_running_loop().create_future()
        self._asking[key] = pending
        try:
            decision = await self._ask(instance, episode, receipt_id)
        except BaseException:
            # A later report of the same receipt asks again.
            del self._asking[key]
            pending.cancel()
            raise
        pending.set_result(decision)
        if self._metrics is not None:
            self._metrics.unacknowledged_resolved.labels(decision).inc()
        return decision

    async def _ask(self, instance: str, episode: EpisodeId, receipt_id: str) -> UnackedDecision:
        if self._resolve is None:
            # Nobody can acknowledge it: the attempt must go.
            return "retire"
        try:
            decision = await self._resolve(instance, episode, receipt_id)
        except TimeoutError:
            raise
        except OSError as error:
            # ConnectionError and kin: the acknowledgement could not reach the
            # participant, an infrastructure failure like any other (transient).
            raise TransportError(
                instance, "Acknowledge", str(error), grpc.StatusCode.UNAVAILABLE
            ) from error
        if decision not in ("acknowledge", "retire"):
            raise ValueError(f"resolve_unacknowledged answered {decision!r}")
        return decision


@dataclass(eq=False)
class Readiness:
    """The latest readiness a participant streamed, and a wake-up for its prepare."""

    changed: asyncio.Event = field(default_factory=asyncio.Event)
    available: bool = False
    # Set once this participant's prepare is over (ready or failed): no stream needed.
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    # The latest readiness it reported (a prepare answer or its stream): what the
    # status API shows of an open snapshot (docs/spec.md section 7.13.3).
    report: types_pb2.ReadinessReport | None = None


def _answer(kind: FailureKind) -> Answer:
    return Answer.INVARIANT if kind is FailureKind.INVARIANT else Answer.TRANSIENT


class PreparingParticipant:
    """One participant's side of a prepare, as a fan-out caller: rounds until ready.

    ``fan_out`` gives every participant the same deadline and cancels this call at it.
    What to do after each round is the core's decision (``core``).
    """

    def __init__(
        self,
        *,
        core: ParticipantPrepare,
        client: ControlCaller,
        readiness: Readiness,
        unacked: Unacked,
        on_answer: Callable[[str, pb.PrepareResponse], None],
    ) -> None:
        self._core = core
        self._instance = core.instance
        self._client = client
        self._readiness = readiness
        self._unacked = unacked
        self._hopeless = unacked.follow(core)
        self._on_answer = on_answer

    async def call(self, request: ControlRequest, timeout_s: float) -> ControlResponse:
        try:
            return await self._call(request)
        finally:
            self._readiness.settled.set()

    def _not_ready(
        self, request: pb.PrepareRequest, last: pb.PrepareResponse | None
    ) -> NotReadyError:
        return NotReadyError(
            self._instance, request.checkpoint_id, last.readiness if last else None
        )

    async def _call(self, request: ControlRequest) -> ControlResponse:
        assert isinstance(request, pb.PrepareRequest)
        loop = asyncio.get_running_loop()
        core = self._core
        last: pb.PrepareResponse | None = None
        decision = core.next_round(loop.time())
        while True:
            if decision.step is Step.NOT_READY:
                raise self._not_ready(request, last)
            self._readiness.changed.clear()
            sent_at = loop.time()
            try:
                response = await self._round(request, decision.timeout_s)
            except SessionBrokenError:
                decision = core.answered(Answer.SESSION_BROKEN, loop.time())
                if decision.step is Step.FAIL:
                    raise
                continue  # another round on a new session, or not ready
            except (ControlCallError, TurnpointError) as error:
                decision = core.answered(_answer(classify(error).kind), loop.time())
                if decision.step is Step.FAIL:
                    raise
                raise self._not_ready(request, last) from error
            if response is None:
                # Abandoned: the participant became hopeless; the core says so.
                decision = core.next_round(loop.time())
                continue
            assert isinstance(response, pb.PrepareResponse)
            last = response
            self._readiness.report = response.readiness
            self._on_answer(self._instance, response)
            if is_ready(response):
                core.answered(Answer.READY, loop.time())
                return response
            core.answered(Answer.NOT_READY, loop.time())
            await self._unacked.handle(self._instance, response.readiness)
            wait = core.wait(
                loop.time(), sent_at=sent_at, stream_available=self._readiness.available
            )
            if wait.step is Step.NOT_READY:
                raise self._not_ready(request, last)
            if wait.timeout_s > 0:
                await self._wait(wait.timeout_s, until_change=wait.until_change)
            decision = core.next_round(loop.time())

    async def _round(self, request: pb.PrepareRequest, timeout_s: float) -> ControlResponse | None:
        """One prepare call, abandoned (and cancelled) as soon as waiting is pointless.

        The call runs in this task; becoming hopeless cancels the task the way
        ``asyncio.timeout`` does (``cancel``, then ``uncancel`` on the way out), so that
        a round costs no task of its own and no second task racing it: most rounds are
        answered in milliseconds. A cancellation from outside (the fan-out's deadline)
        still propagates.
        """
        hopeless = self._hopeless
        if hopeless.done():
            return None
        task = asyncio.current_task()
        assert task is not None
        running = True
        gave_up = False

        def give_up(_: asyncio.Future[None]) -> None:
            nonlocal gave_up
            # Scheduled by the future, so it may run after the round ended: then no-op.
            if running:
                gave_up = True
                task.cancel()

        hopeless.add_done_callback(give_up)
        try:
            return await self._client.call(request, timeout_s)
        except asyncio.CancelledError:
            if gave_up and task.uncancel() == 0:
                return None
            raise
        finally:
            running = False
            hopeless.remove_done_callback(give_up)

    async def _wait(self, timeout_s: float, *, until_change: bool) -> None:
        waits: list[asyncio.Future[Any]] = [self._hopeless]
        changed = None
        if until_change:
            changed = asyncio.ensure_future(self._readiness.changed.wait())
            waits.append(changed)
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if changed is not None:
                changed.cancel()


async def watch_readiness(
    instance: str,
    client: ParticipantControlClient,
    request: pb.WatchBoundariesRequest,
    *,
    watch_after_s: float,
    timeout_s: float,
    state: Readiness,
    unacked: Unacked,
) -> None:
    """Follow one participant's readiness stream during a prepare; best effort.

    Opened only for a participant still preparing after ``watch_after_s``: most are
    ready within milliseconds and never cost a stream.
    """
    if watch_after_s > 0:
        with suppress(TimeoutError):
            await asyncio.wait_for(state.settled.wait(), watch_after_s)
    if state.settled.is_set():
        return
    try:
        async with client.watch_boundaries(request, timeout_s=timeout_s) as watch:
            async for message in watch:
                state.available = True
                if message.WhichOneof("event") != "readiness":
                    continue
                state.changed.set()
                state.report = message.readiness
                if message.phase in (types_pb2.PHASE_PREPARING, types_pb2.PHASE_PREPARED):
                    await unacked.handle(instance, message.readiness)
    except (ControlCallError, TurnpointError, grpc.RpcError) as error:
        # Without the stream the prepare rounds still converge; they only react later.
        _LOG.debug("readiness watch of %s ended: %s", instance, error)
    finally:
        state.available = False
        # A prepare waiting on this stream must not wait for a change it cannot see.
        state.changed.set()
