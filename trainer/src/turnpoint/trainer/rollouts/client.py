"""The trainer's rollout client: the asyncio driver around the rollout ledger.

docs/spec.md sections 6 and 7.6. :class:`RolloutClient` runs rollouts on agent
participants with ``RolloutService.Run`` and keeps the books the snapshot driver cuts
(:class:`~turnpoint.trainer.rollouts.side.RolloutSide`). The books themselves, and every
decision on them, are the pure :class:`~turnpoint.trainer.rollouts.ledger.RolloutLedger`; the
wire reading is :mod:`turnpoint.trainer.rollouts.run_stream`. This module only adapts them:
one task per followed attempt, a dispatcher, a budget timer and the Acknowledge calls.

- **Dispatch.** :meth:`RolloutClient.dispatch` queues a rollout; the dispatcher starts
  at most ``max_concurrency`` of them at a time. A Run is only sent while the dispatch
  gate is open (:meth:`~RolloutClient.close_dispatch`). An attempt becomes *dispatched*
  (owned by its participant, part of the cut, :meth:`~RolloutClient.in_flight`) only
  when the participant accepted its Run: the participant sends the initial metadata
  ``turnpoint-accepted: 1`` right after accepting, and the client awaits it before it
  reads anything else. A Run still waiting at the gate, or sent and not yet answered,
  is not part of the cut; :meth:`~RolloutClient.drain_acknowledgements` waits for the
  answered-or-refused verdict of every Run already sent, so after it the cut is exact.
- **Refusal.** A Run refused with ``ADMISSION_CLOSED`` is unwound (nothing else of the
  call is read) and sent again once the gate has reopened, or after a short pause when
  the participant closed on its own while our gate stayed open. It spends neither a
  retry nor budget: budgets start at acceptance.
- **Re-attach.** A stream that breaks (``UNAVAILABLE``, an end without a result, a
  malformed message...) is re-invoked with the same request id, the same ``EpisodeId``,
  the boundaries seen so far and the participant incarnation that accepted it (sent
  with ``turnpoint-accepted`` as ``turnpoint-incarnation``): the participant attaches to
  the running execution or returns the kept result. A process restarted at the same
  address refuses it ``STALE_ATTEMPT`` and starts nothing, and the attempt is lost
  there: abandoned at once, as below, never re-attached again. After ``reattach_attempts`` consecutive broken calls without
  progress the attempt is abandoned: queued for ``Retire``
  (:meth:`~RolloutClient.pending_retires`) and the rollout rerun from its prompt as the
  next attempt (the attempt ledger is bumped), at most ``max_attempts`` per rollout.
- **Results.** Each boundary report advances the episode's ``boundaries_seen``. The
  final result is recorded in the results queue and its receipt acknowledged at once,
  one ``Acknowledge`` per sibling, never batched per prompt group.
- **Budgets.** A rollout's budget counts active time: it starts at acceptance and does
  not run while any holder holds (:meth:`~RolloutClient.hold_deadlines`). When it is
  spent the Run call is cancelled (gRPC carries the cancellation to the participant,
  which finishes the execution as cancelled and owes no acknowledgement) and the
  rollout is recorded as given up. A timer task sleeps until the next expiry and wakes
  whenever holds or budgets change.

The client never waits without a bound on anything it depends on: verdicts, acks and
resolutions have timeouts, and a Run stream is bounded by its budget and by the
channel keepalive (``turnpoint._keepalive``), which fails a silent connection within
about half a minute. A Run has no gRPC deadline of its own because parked time must not
count against it.

Every rollout the training loop dispatched is, at any moment, in exactly one of: the
unconsumed results queue, the live attempts (waiting, sent or owned), the descriptors a
restore installed and nobody resumed yet, or consumed by the training loop. The first
three are what :meth:`~RolloutClient.rollout_state` snapshots, so a restore loses
nothing and runs nothing twice (docs/spec.md section 7.6 item 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

import grpc

from turnpoint._keepalive import data_channel
from turnpoint._status import error_from_rpc
from turnpoint.auth import auth_metadata
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, validate_id
from turnpoint.trainer.control.client import request_id_source
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.rollouts.attempts import (
    Attempt,
    AttemptPhase,
    NextCall,
    Receipt,
    Resolve,
    RolloutStats,
)
from turnpoint.trainer.rollouts.deadlines import Hold
from turnpoint.trainer.rollouts.ledger import RolloutLedger
from turnpoint.trainer.rollouts.run_stream import (
    Accepted,
    BoundarySeen,
    CallEnd,
    MalformedRunError,
    RunBrokenError,
    Verdict,
    classify,
    read_run,
    receipt_to_proto,
    run_request,
)
from turnpoint.trainer.rollouts.side import InFlightRollout, UnackedDecision
from turnpoint.trainer.rollouts.values import (
    Rollout,
    RolloutClientSettings,
    RolloutResult,
    SavedRollout,
    backoff_s,
)
from turnpoint.trainer.storage.manifest import JSONValue, RolloutBooks, TrainerRolloutState
from turnpoint.v1 import rollout_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

if TYPE_CHECKING:
    from turnpoint.trainer.rollouts.run_stream import RunCall
    from turnpoint.trainer.rollouts.side import RolloutSide
    from turnpoint.v1.rollout_service_pb2_grpc import RolloutServiceAsyncStub

# The values and the ledger's counters are importable from here as they always were.

_LOG = logging.getLogger(__name__)

# The timer re-checks at least this often even when nothing can expire, so that a lost
# wake-up can only delay a give-up, never prevent it.
_MAX_TIMER_SLEEP_S: Final = 60.0
_CLOSE_TIMEOUT_S: Final = 5.0
# Acknowledge refusals that mean "nothing retained here": the receipt is settled.
_ACK_SETTLED_REASONS: Final = frozenset({Reason.NOT_FOUND, Reason.STALE_ATTEMPT})


@dataclass(frozen=True, slots=True)
class AgentEndpoint:
    """Where an agent instance serves ``RolloutService``; the token never shows in a repr."""

    address: str
    token: str | None = field(default=None, repr=False)
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)


class AcknowledgementError(CoordinatorError):
    """Receipts that could not be acknowledged (the participant refused or was unreachable)."""

    def __init__(self, receipt_ids: Iterable[str], detail: str) -> None:
        self.receipt_ids = tuple(sorted(receipt_ids))
        self.detail = detail
        super().__init__(
            Reason.UNAVAILABLE, f"{len(self.receipt_ids)} receipt(s) not acknowledged: {detail}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.receipt_ids, self.detail))


class _Changes:
    """Wake-ups for everything that waits on the client's state; never missed.

    A waiter re-checks its predicate after each notification, and nothing can happen
    between its check and its wait because both run without yielding to the loop.
    """

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float | None) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                if self._event is None:
                    self._event = asyncio.Event()
                await self._event.wait()


@dataclass(eq=False, slots=True)
class _Follower:
    """The task following one attempt, and its Run call while one is open."""

    task: asyncio.Task[None] | None = None
    call: RunCall | None = None


class RolloutClient:
    """Runs rollouts on agent participants and keeps the books a snapshot cuts.

    Use it as an async context manager (or :meth:`start` / :meth:`aclose`). ``clock`` is
    a monotonic clock in seconds; tests inject a fake one and call :meth:`expire_due`.
    """

    def __init__(
        self,
        agents: Mapping[str, AgentEndpoint],
        *,
        settings: RolloutClientSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        group_scored: Iterable[str] = (),
        fence: types_pb2.Fence | None = None,
    ) -> None:
        for name in agents:
            validate_id(name, "agent instance")
        self._endpoints = dict(agents)
        # Sent with every Run and Acknowledge, so that a coordinator fenced out by a newer
        # one cannot start or settle rollouts (docs/spec.md section 6.9).
        self._fence = fence
        self._settings = settings or RolloutClientSettings()
        self._clock = clock
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, RolloutServiceAsyncStub] = {}
        self._metadata = {
            name: (auth_metadata(endpoint.token) if endpoint.token else ())
            for name, endpoint in self._endpoints.items()
        }
        self._changes = _Changes()
        self._ledger = RolloutLedger(
            self._endpoints,
            self._settings,
            request_ids=request_id_source(),
            on_change=self._changes.notify,
            group_scored=group_scored,
        )
        self._timer_wake = asyncio.Event()
        self._followers: dict[Attempt, _Follower] = {}
        self._ack_tasks: dict[str, asyncio.Task[bool]] = {}
        self._service_tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open one data channel per agent instance and start the dispatcher and timer."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("the rollout client is closed")
        self._started = True
        for name, endpoint in self._endpoints.items():
            channel = data_channel(endpoint.address, credentials=endpoint.credentials)
            self._channels[name] = channel
            self._stubs[name] = pb_grpc.RolloutServiceStub(channel)
        self._service_tasks = [
            asyncio.create_task(self._dispatch_loop(), name="turnpoint-rollout-dispatcher"),
            asyncio.create_task(self._timer_loop(), name="turnpoint-rollout-timer"),
        ]

    async def aclose(self) -> None:
        """Cancel every Run in progress (participants finish them as cancelled), give
        acknowledgements in flight a bounded chance to land, close the channels."""
        if self._closed:
            return
        self._closed = True
        self._ledger.close_gate()
        tasks: list[asyncio.Task[None]] = list(self._service_tasks)
        tasks += [f.task for f in self._followers.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT_S)
        acks = list(self._ack_tasks.values())
        if acks:
            _, late = await asyncio.wait(acks, timeout=self._settings.ack_timeout_s)
            for ack in late:
                ack.cancel()
        for channel in self._channels.values():
            await channel.close(None)
        self._changes.notify()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, rollout: Rollout) -> EpisodeId:
        """Queue ``rollout`` as attempt 0; it runs when a slot is free and the gate open."""
        if self._closed:
            raise RuntimeError("the rollout client is closed")
        return self._ledger.dispatch(rollout).episode

    def close_dispatch(self) -> None:
        """Send no new Run; Runs not yet accepted wait at the gate and are not in the cut.

        Re-attaches of attempts a participant already owns are not held back: the
        participant attaches them whatever its admission.
        """
        self._ledger.close_gate()

    def reopen_dispatch(self) -> None:
        if not self._closed:
            self._ledger.reopen_gate()

    def close_dispatch_to(self, instance: str) -> None:
        """Send no new Run to ``instance`` whatever the global gate says (its release
        failed, so it would only refuse them). Idempotent."""
        self._ledger.close_instance(instance)

    def reopen_dispatch_to(self, instance: str) -> None:
        """Undo :meth:`close_dispatch_to` once the instance was released. Idempotent."""
        self._ledger.reopen_instance(instance)

    def set_group_scored(self, environments: Iterable[str]) -> None:
        """Name the group-scored environments (``Coordinator.levels`` says which): a
        sibling of theirs given up or abandoned reruns its whole prompt group
        (docs/spec.md section 6.10 item 8)."""
        self._ledger.set_group_scored(environments)

    @property
    def dispatch_open(self) -> bool:
        return self._ledger.gate_open

    @property
    def version(self) -> int:
        """Bumped on every change the cut would see; equal versions mean nothing changed."""
        return self._ledger.version

    def in_flight(self) -> Sequence[InFlightRollout]:
        """Accepted, unfinished attempts (those a participant owns), by episode."""
        return self._ledger.in_flight()

    def waiting(self) -> tuple[EpisodeId, ...]:
        """Attempts not owned by any participant yet: queued, at the gate, or sent."""
        return self._ledger.waiting()

    def attempts(self) -> Mapping[str, int]:
        """The attempt ledger: rollout id -> the attempt the trainer owns."""
        return self._ledger.attempts()

    def stats(self) -> RolloutStats:
        return self._ledger.stats()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float | None) -> None:
        """Return once ``predicate()`` holds; it is re-checked after every change of the
        client's state. Raises ``TimeoutError`` after ``timeout_s``."""
        await self._changes.wait_for(predicate, timeout_s)

    # ------------------------------------------------------------------ deadlines

    def hold_deadlines(self, name: str) -> Hold:
        """Suspend every rollout budget until the hold is released (holders counted)."""
        hold = self._ledger.hold(name, self._clock())
        self._timer_wake.set()
        return hold

    def release_deadlines(self, hold: Hold) -> None:
        """Release one hold; budgets run again only when no other holder holds."""
        self._ledger.release(hold, self._clock())
        self._timer_wake.set()

    @property
    def deadlines_held(self) -> bool:
        return self._ledger.deadlines_held

    def remaining_budget(self, episode: EpisodeId) -> float | None:
        """Active seconds left for an owned attempt; None when it has no running budget."""
        return self._ledger.remaining_budget(episode, self._clock())

    def expire_due(self) -> list[EpisodeId]:
        """Give up every attempt whose active budget is spent now; returns them.

        The timer task calls this; a test driving a fake clock may call it directly.
        """
        given_up = self._ledger.expire_due(self._clock())
        for attempt in given_up:
            self._stop_following(attempt)
        self._stop_ended()
        return [attempt.episode for attempt in given_up]

    # ------------------------------------------------------------------ results

    def results(self) -> tuple[RolloutResult, ...]:
        """The unconsumed results, in queue order (a copy; nothing is consumed)."""
        return self._ledger.results()

    async def next_result(self, timeout_s: float | None = None) -> RolloutResult:
        """Take the oldest unconsumed result, waiting for one up to ``timeout_s``."""
        await self._changes.wait_for(lambda: self._ledger.has_results, timeout_s)
        return self._ledger.take_oldest()

    def ready_groups(self) -> int:
        """How many prompt groups have every sibling's result in the queue."""
        return len(self._ledger.ready_group_ids())

    def take_ready_groups(self, max_groups: int | None = None) -> list[tuple[RolloutResult, ...]]:
        """Take up to ``max_groups`` complete prompt groups, oldest first, siblings in order."""
        return self._ledger.take_ready_groups(max_groups)

    @property
    def data_loader(self) -> JSONValue:
        return self._ledger.data_loader

    def set_data_loader(self, position: JSONValue) -> None:
        """Record the data loader's position (any JSON value) for the next snapshot."""
        self._ledger.set_data_loader(position)

    # ------------------------------------------------------------------ acknowledgements

    async def drain_acknowledgements(self, timeout_s: float) -> None:
        """Return once every Run already sent has its verdict and every result already
        received is recorded and acknowledged.

        Raises ``TimeoutError`` after ``timeout_s`` and :class:`AcknowledgementError`
        when a receipt could not be acknowledged (each receipt is re-sent once per
        drain, so a participant that came back is given its acknowledgement).
        """
        ledger = self._ledger
        async with asyncio.timeout(timeout_s):
            await self._changes.wait_for(lambda: not ledger.awaiting_verdicts, None)
            resent: set[str] = set()
            while True:
                for receipt_id, receipt in ledger.owed().items():
                    if receipt_id not in self._ack_tasks and receipt_id not in resent:
                        resent.add(receipt_id)
                        self._spawn_ack(receipt)
                if not self._ack_tasks:
                    break
                await asyncio.wait(list(self._ack_tasks.values()))
            if owed := ledger.owed():
                raise AcknowledgementError(owed, "the participant refused or could not be reached")

    async def resolve_unacknowledged(
        self, instance: str, episode: EpisodeId, receipt_id: str
    ) -> UnackedDecision:
        """A prepare reported a completion nobody acknowledged (docs/spec.md section 6.7
        item 3): acknowledge it if its result is recorded (or the live attempt delivers
        it within ``resolve_timeout_s``), else say it must be retired.

        A ``"retire"`` decision also queues the attempt in :meth:`pending_retires`, and a
        live attempt that did not deliver is abandoned (its rollout rerun). An
        acknowledgement that fails raises (:class:`AcknowledgementError` or
        ``TimeoutError``): the checkpoint round fails and is retried.
        """
        ledger = self._ledger
        decision = ledger.resolve_unacknowledged(instance, episode, receipt_id)
        if decision.action is Resolve.WAIT:
            waited = decision.attempt
            assert waited is not None
            with contextlib.suppress(TimeoutError):
                await self._changes.wait_for(
                    lambda: (
                        ledger.known_receipt(receipt_id) is not None
                        or waited.phase is AttemptPhase.ENDED
                    ),
                    self._settings.resolve_timeout_s,
                )
            decision = ledger.resolve_unacknowledged(
                instance, episode, receipt_id, waited_on=waited
            )
        if decision.action is Resolve.RETIRE:
            if decision.attempt is not None:
                self._stop_following(decision.attempt)
            self._stop_ended()
            return "retire"
        assert decision.receipt is not None
        if not await self._acknowledge_now(decision.receipt):
            raise AcknowledgementError([receipt_id], f"{instance} did not take the receipt")
        return "acknowledge"

    async def _acknowledge_now(self, receipt: Receipt) -> bool:
        # Join an acknowledgement still on its way; a finished one is sent again, since
        # the participant says it still holds the result.
        task = self._ack_tasks.get(receipt.receipt_id)
        if task is None or task.done():
            task = self._spawn_ack(receipt)
        async with asyncio.timeout(self._settings.resolve_timeout_s + self._ack_budget_s()):
            return await asyncio.shield(task)

    def _ack_budget_s(self) -> float:
        settings = self._settings
        return settings.ack_attempts * (settings.ack_timeout_s + settings.max_retry_backoff_s)

    def _spawn_ack(self, receipt: Receipt) -> asyncio.Task[bool]:
        task = asyncio.create_task(
            self._acknowledge(receipt), name=f"turnpoint-ack-{receipt.episode}"
        )
        self._ack_tasks[receipt.receipt_id] = task

        def forget(_: asyncio.Task[bool]) -> None:
            if self._ack_tasks.get(receipt.receipt_id) is task:
                del self._ack_tasks[receipt.receipt_id]
            self._changes.notify()

        task.add_done_callback(forget)
        return task

    async def _acknowledge(self, receipt: Receipt) -> bool:
        """Acknowledge one receipt, retrying with the same request id; whether it settled
        (docs/spec.md section 6.4 item 2)."""
        settings = self._settings
        request = pb.AcknowledgeRequest(
            request_id=uuid.uuid4().hex, receipts=[receipt_to_proto(receipt)]
        )
        if self._fence is not None:
            request.fence.CopyFrom(self._fence)
        stub = self._stubs[receipt.instance]
        for attempt in range(1, settings.ack_attempts + 1):
            try:
                await stub.Acknowledge(
                    request,
                    metadata=self._metadata[receipt.instance],
                    timeout=settings.ack_timeout_s,
                )
                break
            except grpc.aio.AioRpcError as error:
                protocol = error_from_rpc(error)
                if protocol is not None and protocol.reason in _ACK_SETTLED_REASONS:
                    break  # nothing retained there any more: settled
                self._ledger.ack_failed(receipt)
                if protocol is not None and not protocol.transient:
                    _LOG.error(
                        "acknowledging %s on %s refused: %s",
                        receipt.episode,
                        receipt.instance,
                        protocol.reason.name,
                    )
                    return False
                _LOG.warning(
                    "acknowledging %s on %s failed (%s), attempt %d of %d",
                    receipt.episode,
                    receipt.instance,
                    error.code().name,
                    attempt,
                    settings.ack_attempts,
                )
                if attempt == settings.ack_attempts:
                    return False
                await asyncio.sleep(backoff_s(settings, attempt))
        self._ledger.acknowledged(receipt)
        return True

    def unacknowledged(self) -> frozenset[EpisodeId]:
        """Completed attempts whose acknowledgement is still owed (the next drain re-sends
        it): their participant rightly still holds them."""
        return frozenset(receipt.episode for receipt in self._ledger.owed().values())

    # ------------------------------------------------------------------ retires

    def pending_retires(self) -> Mapping[str, Sequence[EpisodeId]]:
        """Abandoned attempts per instance, to retire while participants are idle."""
        return self._ledger.pending_retires()

    def retired(self, instance: str, episodes: Sequence[EpisodeId]) -> None:
        """The driver retired these attempts: drop them from :meth:`pending_retires`."""
        self._ledger.retired(instance, episodes)

    def pending_session_retires(self) -> Sequence[EpisodeId]:
        """Acknowledged attempts whose verified sessions the resources servers keep."""
        return self._ledger.pending_session_retires()

    def sessions_retired(self, episodes: Sequence[EpisodeId]) -> None:
        """Every resources server retired these sessions."""
        self._ledger.sessions_retired(episodes)

    # ------------------------------------------------------------------ snapshot & restore

    def rollout_state(self) -> TrainerRolloutState:
        """Queue of finished rollouts not yet trained on, loader position, attempt ledger,
        and every unfinished rollout with its task (owned or not)."""
        return self._ledger.rollout_state()

    def rollout_books(self) -> RolloutBooks:
        """:meth:`rollout_state`'s parts as they are now, copied, checked by their
        ``state()``: what a cut reads while dispatch is closed."""
        return self._ledger.rollout_books()

    def install(self, state: TrainerRolloutState) -> tuple[SavedRollout, ...]:
        """Reinstall a snapshot's queue, ledger and loader position into a fresh client.

        Returns the unfinished rollouts it recorded; the restore then continues each one
        (:meth:`redispatch`) or reruns it (:meth:`rerun_from_prompt`). Until then they
        stay part of :meth:`rollout_state`, so a snapshot taken meanwhile loses none.
        """
        return self._ledger.install(state)

    def redispatch(
        self, rollout: InFlightRollout, instance: str | None = None, *, incarnation: str = ""
    ) -> EpisodeId:
        """Continue a saved attempt N as N+1 on ``instance`` (default: the one that saved it).

        ``rollout`` is the descriptor the snapshot recorded (attempt N). The participant
        installed N+1 at restore, so the attempt is owned from now on (in the cut, its
        budget running) and its Run passes even a closed gate, as the participant admits
        a restored replacement. If the participant refuses it nevertheless (it does not
        hold it), it falls back to an ordinary dispatch that waits for the gate.
        ``incarnation``: the participant incarnation the restore installed N+1 into, which
        its Runs name (docs/spec.md section 6.5 item 5); "" names none.
        """
        attempt = self._ledger.redispatch(
            rollout, instance, now=self._clock(), incarnation=incarnation
        )
        self._timer_wake.set()
        return attempt.episode

    def rerun_from_prompt(
        self,
        rollout: InFlightRollout,
        *,
        instance: str | None = None,
        attempt: int | None = None,
    ) -> EpisodeId:
        """Start a saved rollout over from its prompt, as a new attempt behind the gate.

        The attempt defaults to one past both the ledger and the descriptor; pass a
        higher one to skip attempts that were used elsewhere (a retired N+1).
        """
        return self._ledger.rerun_from_prompt(rollout, instance=instance, attempt=attempt).episode

    def finished_groups(self) -> frozenset[str]:
        """Prompt groups with a finished sibling whose result waits for the rest."""
        return self._ledger.finished_groups()

    def rerun_finished(self, group: str) -> None:
        """Rerun ``group``'s finished siblings from their prompts (a heal lost their
        verifier's group state, docs/spec.md section 7.15 item 2)."""
        self._ledger.rerun_finished(group)
        self._changes.notify()

    def end_for_heal(self, episodes: Iterable[EpisodeId]) -> None:
        """End the live attempts a heal replaces and stop their Runs (docs/spec.md
        section 7.15); the heal then continues or reruns each (see the ledger's
        ``end_for_heal``)."""
        for attempt in self._ledger.end_for_heal(episodes):
            self._stop_following(attempt)

    async def replace_agent(self, instance: str, endpoint: AgentEndpoint) -> None:
        """Send ``instance``'s Runs to ``endpoint`` from now on: the replacement of a
        lost agent, under the same name (docs/spec.md section 7.15)."""
        if instance not in self._endpoints:
            raise ValueError(f"unknown agent instance {instance!r}")
        self._endpoints[instance] = endpoint
        self._metadata[instance] = auth_metadata(endpoint.token) if endpoint.token else ()
        if not self._started:
            return
        old = self._channels.get(instance)
        channel = data_channel(endpoint.address, credentials=endpoint.credentials)
        self._channels[instance] = channel
        self._stubs[instance] = pb_grpc.RolloutServiceStub(channel)
        if old is not None:
            await old.close(None)

    # ------------------------------------------------------------------ service loops

    async def _dispatch_loop(self) -> None:
        while True:
            await self._changes.wait_for(self._can_start, None)
            attempt = self._ledger.take_startable()
            if attempt is None:
                continue
            follower = _Follower()
            self._followers[attempt] = follower
            follower.task = asyncio.create_task(
                self._follow(attempt, follower), name=f"turnpoint-rollout-{attempt.episode}"
            )

    def _can_start(self) -> bool:
        if self._closed or len(self._followers) >= self._settings.max_concurrency:
            return False
        return self._ledger.has_startable()

    async def _timer_loop(self) -> None:
        while True:
            self._timer_wake.clear()
            self.expire_due()
            wait = self._ledger.next_expiry(self._clock())
            timeout = _MAX_TIMER_SLEEP_S if wait is None else min(wait, _MAX_TIMER_SLEEP_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._timer_wake.wait()

    def _stop_following(self, attempt: Attempt) -> None:
        """The ledger ended ``attempt`` from outside its task (given up, abandoned while a
        prepare resolved it): cancel its Run, which tells the participant, and its task."""
        follower = self._followers.get(attempt)
        if follower is None or follower.task is None or follower.task is asyncio.current_task():
            return
        if follower.call is not None and not follower.call.done():
            follower.call.cancel()
        follower.task.cancel()

    def _stop_ended(self) -> None:
        """Stop following every attempt the ledger ended from elsewhere: the siblings a
        group-scored group's retry ended (docs/spec.md section 6.10 item 8)."""
        for attempt in list(self._followers):
            if attempt.phase is AttemptPhase.ENDED:
                self._stop_following(attempt)

    # ------------------------------------------------------------------ one attempt

    async def _follow(self, attempt: Attempt, follower: _Follower) -> None:
        try:
            await self._drive(attempt, follower)
        except Exception as error:  # noqa: BLE001 - a bug here must not leave the attempt live forever
            _LOG.exception("rollout %s: unexpected failure", attempt.episode)
            self._ledger.fail(attempt, f"client error: {type(error).__name__}: {error}")
        finally:
            follower.task = None
            self._followers.pop(attempt, None)
            # Its end may have ended its group-scored siblings (a whole-group retry).
            self._stop_ended()
            self._changes.notify()

    async def _drive(self, attempt: Attempt, follower: _Follower) -> None:
        ledger = self._ledger
        while attempt.phase is not AttemptPhase.ENDED:
            end = await self._call_once(attempt, follower)
            if end.verdict is Verdict.ENDED:
                return
            if end.verdict is Verdict.STALE:
                # The agent retired it, or it is another incarnation than the one that
                # accepted it (the execution died with its process), but a resources
                # server may still hold its session: retired everywhere too if the agent
                # ever accepted it.
                ledger.abandon(attempt, end.detail, retire=attempt.accepted_once)
                return
            if end.verdict is Verdict.FATAL:
                ledger.fail(attempt, end.detail)
                return
            if end.verdict is Verdict.REFUSED:
                step = ledger.refused(attempt, end.sent_generation)
            elif end.verdict is Verdict.LOST:
                step = ledger.lost(attempt, end.detail)
                if step.again:
                    _LOG.info(
                        "%s is lost on %s, waiting for its heal: %s",
                        attempt.episode,
                        attempt.instance,
                        step.reason,
                    )
            else:
                step = ledger.broken(attempt, end.detail)
                if step.again:
                    _LOG.info(
                        "re-attaching %s on %s: %s", attempt.episode, attempt.instance, step.reason
                    )
            if not step.again:
                return
            await self._pause(attempt, step)

    async def _pause(self, attempt: Attempt, step: NextCall) -> None:
        """Wait before sending again, as the ledger decided; cut short when a prepare
        hurries the attempt or, after a refusal, when the gate moved."""
        if step.pause_s is None:
            return
        ledger, sent = self._ledger, step.until_moved

        def over() -> bool:
            moved = sent is not None and ledger.generation(attempt.instance) != sent
            return moved or attempt.hurry

        with contextlib.suppress(TimeoutError):
            await self._changes.wait_for(over, step.pause_s)
        ledger.clear_hurry(attempt)

    async def _call_once(self, attempt: Attempt, follower: _Follower) -> CallEnd:
        ledger = self._ledger
        await self._changes.wait_for(lambda: self._closed or ledger.may_send(attempt), None)
        if attempt.phase is AttemptPhase.ENDED or self._closed:
            return CallEnd(Verdict.ENDED)
        if attempt.lost:
            # Never sent again: only the heal or the abandonment past the bound ends it.
            return CallEnd(Verdict.LOST, f"{attempt.instance} restarted since it accepted")
        # No await from the gate check to the call: a Run is sent only through an open
        # gate (or for an attempt a participant already owns).
        generation = ledger.begin_call(attempt)
        call = self._stubs[attempt.instance].Run(
            run_request(attempt, self._fence, self._settings.weights_change),
            metadata=self._metadata[attempt.instance],
        )
        follower.call = call
        try:
            await self._read(attempt, call)
            return CallEnd(Verdict.ENDED)
        except grpc.aio.AioRpcError as error:
            return classify(error, generation)
        except RunBrokenError as error:
            return CallEnd(Verdict.BROKEN, str(error))
        except (MalformedRunError, TurnpointError) as error:
            return CallEnd(Verdict.BROKEN, f"malformed reply: {error}")
        finally:
            follower.call = None
            if not call.done():
                call.cancel()

    async def _read(self, attempt: Attempt, call: RunCall) -> None:
        """Hand what the call says to the ledger, up to the result (docs/spec.md
        sections 6.1-6.3); acknowledge the result at once, this sibling alone (6.4)."""
        ledger = self._ledger
        async for event in read_run(call, attempt.episode, self._settings.accept_timeout_s):
            if isinstance(event, Accepted):
                if ledger.accept(attempt, self._clock(), event.incarnation):
                    self._timer_wake.set()
            elif isinstance(event, BoundarySeen):
                ledger.boundary(attempt, event.boundary_index)
            elif event.final is None:
                # We did not cancel (we are still reading): the participant stopped it.
                ledger.participant_cancelled(attempt)
            else:
                self._spawn_ack(ledger.result(attempt, event.final))


if TYPE_CHECKING:

    def _conforms(client: RolloutClient) -> RolloutSide:
        return client
