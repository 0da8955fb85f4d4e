"""The trainer's rollout client: dispatch, budgets, results and acknowledgements.

PROTOCOL.md sections 5-7. :class:`RolloutClient` runs rollouts on agent participants
with ``RolloutService.Run`` and keeps the books the snapshot driver cuts
(:class:`~turnpoint.trainer._interfaces.RolloutSide`):

- **Dispatch.** :meth:`RolloutClient.dispatch` queues a rollout; a dispatcher starts at
  most ``max_concurrency`` of them at a time. A Run is only sent while the dispatch gate
  is open (:meth:`~RolloutClient.close_dispatch`). An attempt becomes *dispatched*
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
  malformed message...) is re-invoked with the same request id, the same ``EpisodeId``
  and the boundaries seen so far: the participant attaches to the running execution or
  returns the kept result. After ``reattach_attempts`` consecutive broken calls without
  progress the attempt is abandoned: queued for ``Retire``
  (:meth:`~RolloutClient.pending_retires`) and the rollout rerun from its prompt as the
  next attempt (the attempt ledger is bumped), at most ``max_attempts`` per rollout.
- **Results.** Each boundary report advances the episode's ``boundaries_seen``. The
  final result is recorded in the results queue and its receipt acknowledged at once,
  one ``Acknowledge`` per sibling, never batched per prompt group.
- **Budgets.** A rollout's budget counts active time in a
  :class:`~turnpoint.trainer._deadlines.DeadlineRegistry`: it starts at acceptance and
  does not run while any holder holds (:meth:`~RolloutClient.hold_deadlines`). When it
  is spent the Run call is cancelled (gRPC carries the cancellation to the participant,
  which finishes the execution as cancelled and owes no acknowledgement) and the
  rollout is recorded as given up. A timer task sleeps until the registry's next expiry
  and wakes whenever holds or budgets change.

The client never waits without a bound on anything it depends on: verdicts, acks and
resolutions have timeouts, and a Run stream is bounded by its budget and by the
channel keepalive (``turnpoint._keepalive``), which fails a silent connection within
about half a minute. A Run has no gRPC deadline of its own because parked time must not
count against it.

Every rollout the training loop dispatched is, at any moment, in exactly one of: the
unconsumed results queue, the live attempts (waiting, sent or owned), the descriptors a
restore installed and nobody resumed yet, or consumed by the training loop. The first
three are what :meth:`~RolloutClient.rollout_state` snapshots, so a restore loses
nothing and runs nothing twice.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self

import grpc

from turnpoint._convert import (
    duration_from_seconds,
    episode_from_proto,
    episode_to_proto,
    seconds_from_duration,
    struct_from_mapping,
    struct_to_dict,
)
from turnpoint._keepalive import data_channel
from turnpoint._status import error_from_rpc
from turnpoint.auth import ACCEPTED_METADATA, auth_metadata
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, InvalidIdError, validate_attempt, validate_id
from turnpoint.trainer._deadlines import DeadlineRegistry, Hold
from turnpoint.trainer._errors import CoordinatorError
from turnpoint.trainer._interfaces import InFlightRollout, UnackedDecision
from turnpoint.trainer._manifest import JSONValue, ManifestError, TrainerRolloutState
from turnpoint.v1 import rollout_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

if TYPE_CHECKING:
    from turnpoint.trainer._interfaces import RolloutSide
    from turnpoint.v1.rollout_service_pb2_grpc import RolloutServiceAsyncStub

__all__ = [
    "ACCEPTED_METADATA_KEY",
    "AcknowledgementError",
    "AgentEndpoint",
    "Rollout",
    "RolloutClient",
    "RolloutClientSettings",
    "RolloutOutcome",
    "RolloutResult",
    "RolloutStats",
    "SavedRollout",
]

_LOG = logging.getLogger(__name__)

# Initial metadata an agent participant sends right after it accepted a Run; until it
# arrives the attempt is not the participant's (PROTOCOL.md section 7, bookkeeping).
# One source of truth: the servicer's own constant.
((ACCEPTED_METADATA_KEY, _ACCEPTED_VALUE),) = ACCEPTED_METADATA

# The timer re-checks at least this often even when nothing can expire, so that a lost
# wake-up can only delay a give-up, never prevent it.
_MAX_TIMER_SLEEP_S: Final = 60.0
# Receipts acknowledged recently, kept so that a prepare reporting one of them again
# (its ack reply was lost) is answered by acknowledging again.
_ACKED_MEMORY: Final = 4096
_CLOSE_TIMEOUT_S: Final = 5.0


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutClientSettings:
    """Bounds of the rollout client; every wait it makes is bounded by one of these."""

    # Runs in progress at once (waiting at the gate, sent, or followed).
    max_concurrency: int = 64
    # How long a sent Run may go without the participant's verdict (accepted/refused).
    accept_timeout_s: float = 30.0
    # One Acknowledge call; tried ack_attempts times with the same request id.
    ack_timeout_s: float = 10.0
    ack_attempts: int = 3
    # Consecutive broken calls of one attempt, without progress, before it is abandoned.
    reattach_attempts: int = 3
    # Attempts of one rollout this client starts (reruns included) before it gives up.
    max_attempts: int = 3
    # Pause before the n-th re-attach: retry_backoff_s * 2**(n-1), at most the max.
    retry_backoff_s: float = 0.2
    max_retry_backoff_s: float = 2.0
    # Pause before resending a Run the participant refused while our own gate stayed
    # open (it closed on its own: another holder, a failed resume); never zero, so a
    # closed participant cannot make the client spin.
    admission_backoff_s: float = 0.5
    # How long resolve_unacknowledged waits for a live attempt to deliver its result.
    resolve_timeout_s: float = 5.0
    # The trainer gives up budget + grace after acceptance, so that the participant's
    # own budget (same length, also active time) normally ends the run first with a
    # proper BUDGET_EXHAUSTED result; the trainer's is the backstop.
    budget_grace_s: float = 5.0
    # Budget of rollouts that do not name one; None: no budget.
    default_budget_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "ack_attempts", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.reattach_attempts, bool) or self.reattach_attempts < 0:
            raise ValueError(f"reattach_attempts must be >= 0, got {self.reattach_attempts!r}")
        for name in ("accept_timeout_s", "ack_timeout_s", "admission_backoff_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in (
            "retry_backoff_s",
            "max_retry_backoff_s",
            "resolve_timeout_s",
            "budget_grace_s",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        _check_budget(self.default_budget_s, "default_budget_s")


def _check_budget(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be None or a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class AgentEndpoint:
    """Where an agent instance serves ``RolloutService``; the token never shows in a repr."""

    address: str
    token: str | None = field(default=None, repr=False)
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)


# --------------------------------------------------------------------------- values


def _plain_json(value: object, what: str) -> dict[str, Any]:
    """A deep copy of ``value`` as a plain JSON object (tuples become lists)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__}")
    try:
        copy = json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what} is not plain JSON: {error}") from None
    assert isinstance(copy, dict)
    return copy


@dataclass(frozen=True, slots=True)
class Rollout:
    """One rollout to run: a sibling of a prompt group, on one agent instance."""

    rollout_id: str
    prompt_group_id: str
    sibling_index: int
    group_size: int
    environment: str
    task: Mapping[str, Any]
    instance: str
    budget_s: float | None = None

    def __post_init__(self) -> None:
        validate_id(self.rollout_id, "rollout_id")
        validate_id(self.prompt_group_id, "prompt_group_id")
        validate_id(self.instance, "instance")
        if not isinstance(self.environment, str) or not self.environment:
            raise ValueError(f"environment must be a non-empty string, got {self.environment!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ValueError(f"group_size must be an integer, got {self.group_size!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if (
            isinstance(self.sibling_index, bool)
            or not isinstance(self.sibling_index, int)
            or not 0 <= self.sibling_index < self.group_size
        ):
            raise ValueError(
                f"sibling_index must be in [0, {self.group_size}), got {self.sibling_index!r}"
            )
        object.__setattr__(self, "task", _plain_json(self.task, "task"))
        object.__setattr__(self, "budget_s", _check_budget(self.budget_s, "budget_s"))


class RolloutOutcome(enum.Enum):
    """How a rollout ended, as the training loop sees it."""

    COMPLETED = "completed"
    # The agent failed; the participant reported the error.
    FAILED = "failed"
    # The participant's own active-time budget ran out.
    BUDGET_EXHAUSTED = "budget_exhausted"
    # The trainer's active-time budget ran out; its Run was cancelled.
    GIVEN_UP = "given_up"
    # No attempt could finish (broken streams, refusals, a protocol error).
    ABANDONED = "abandoned"


_RESULT_FIELDS: Final = frozenset(
    {
        "rollout_id",
        "attempt",
        "instance",
        "prompt_group_id",
        "sibling_index",
        "group_size",
        "environment",
        "outcome",
        "output",
        "task",
        "turns",
        "boundaries",
        "active_time_s",
        "error_message",
        "receipt_id",
    }
)


class _Reader:
    """Strict reading of one JSON object of the rollout state: every field, nothing else."""

    def __init__(self, raw: object, where: str, fields: frozenset[str]) -> None:
        if not isinstance(raw, Mapping):
            raise ManifestError(f"{where}: must be an object", field=where)
        unknown = sorted(set(raw) - fields)
        missing = sorted(fields - set(raw))
        if unknown or missing:
            raise ManifestError(
                f"{where}: unknown field(s) {unknown}, missing field(s) {missing}", field=where
            )
        self._raw = raw
        self._where = where

    def fail(self, name: str, why: str) -> ManifestError:
        return ManifestError(f"{self._where}.{name}: {why}", field=f"{self._where}.{name}")

    def id(self, name: str) -> str:
        try:
            return validate_id(self._raw[name], name)
        except InvalidIdError as error:
            raise self.fail(name, error.why) from None

    def attempt(self, name: str) -> int:
        try:
            return validate_attempt(self._raw[name], name)
        except InvalidIdError as error:
            raise self.fail(name, error.why) from None

    def count(self, name: str) -> int:
        value = self._raw[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(name, f"must be an integer >= 0, got {value!r}")
        return value

    def text(self, name: str) -> str:
        value = self._raw[name]
        if not isinstance(value, str):
            raise self.fail(name, f"must be a string, got {value!r}")
        return value

    def number(self, name: str) -> float:
        value = self._raw[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise self.fail(name, f"must be a number >= 0, got {value!r}")
        return float(value)

    def optional_budget(self, name: str) -> float | None:
        value = self._raw[name]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.fail(name, f"must be null or a number > 0, got {value!r}")
        return float(value)

    def flag(self, name: str) -> bool:
        value = self._raw[name]
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {value!r}")
        return value

    def obj(self, name: str) -> dict[str, Any]:
        try:
            return _plain_json(self._raw[name], name)
        except ValueError as error:
            raise self.fail(name, str(error)) from None


@dataclass(frozen=True, slots=True)
class RolloutResult:
    """One finished rollout in the results queue (what the training loop consumes).

    ``output`` is the agent's result (answer, reward, tokens) as its server defines it;
    ``receipt_id`` is empty when nothing had to be acknowledged (given up, abandoned).
    """

    episode: EpisodeId
    instance: str
    prompt_group_id: str
    sibling_index: int
    group_size: int
    environment: str
    outcome: RolloutOutcome
    output: Mapping[str, Any]
    task: Mapping[str, Any]
    turns: int
    boundaries: int
    active_time_s: float
    error_message: str = ""
    receipt_id: str = ""

    @property
    def rollout_id(self) -> str:
        return self.episode.rollout_id

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "rollout_id": self.episode.rollout_id,
            "attempt": self.episode.attempt,
            "instance": self.instance,
            "prompt_group_id": self.prompt_group_id,
            "sibling_index": self.sibling_index,
            "group_size": self.group_size,
            "environment": self.environment,
            "outcome": self.outcome.value,
            "output": _plain_json(self.output, "output"),
            "task": _plain_json(self.task, "task"),
            "turns": self.turns,
            "boundaries": self.boundaries,
            "active_time_s": self.active_time_s,
            "error_message": self.error_message,
            "receipt_id": self.receipt_id,
        }

    @classmethod
    def from_json(cls, raw: object, where: str = "queue item") -> Self:
        """Parse one queue entry strictly (unknown or missing fields are errors)."""
        read = _Reader(raw, where, _RESULT_FIELDS)
        outcome_text = read.text("outcome")
        try:
            outcome = RolloutOutcome(outcome_text)
        except ValueError:
            raise read.fail("outcome", f"unknown outcome {outcome_text!r}") from None
        return cls(
            episode=EpisodeId(read.id("rollout_id"), read.attempt("attempt")),
            instance=read.id("instance"),
            prompt_group_id=read.id("prompt_group_id"),
            sibling_index=read.count("sibling_index"),
            group_size=read.count("group_size"),
            environment=read.text("environment"),
            outcome=outcome,
            output=read.obj("output"),
            task=read.obj("task"),
            turns=read.count("turns"),
            boundaries=read.count("boundaries"),
            active_time_s=read.number("active_time_s"),
            error_message=read.text("error_message"),
            receipt_id=read.text("receipt_id"),
        )


_SAVED_FIELDS: Final = frozenset(
    {
        "rollout_id",
        "attempt",
        "instance",
        "prompt_group_id",
        "sibling_index",
        "group_size",
        "environment",
        "boundaries_seen",
        "task",
        "budget_s",
        "accepted",
    }
)


@dataclass(frozen=True, slots=True)
class SavedRollout:
    """An unfinished rollout as a snapshot records it (``TrainerRolloutState.in_flight``).

    ``rollout`` carries attempt N and the task, so a restore can continue it as N+1
    (:meth:`RolloutClient.redispatch`) or rerun it from its prompt
    (:meth:`RolloutClient.rerun_from_prompt`). ``accepted`` says whether a participant
    owned attempt N at the cut; one that was still waiting at the gate was owned by
    nobody, so nothing of it can have been exported and it can only be rerun.
    """

    rollout: InFlightRollout
    budget_s: float | None
    accepted: bool

    def to_json(self) -> dict[str, JSONValue]:
        rollout = self.rollout
        return {
            "rollout_id": rollout.episode.rollout_id,
            "attempt": rollout.episode.attempt,
            "instance": rollout.instance,
            "prompt_group_id": rollout.prompt_group_id,
            "sibling_index": rollout.sibling_index,
            "group_size": rollout.group_size,
            "environment": rollout.environment,
            "boundaries_seen": rollout.boundaries_seen,
            "task": _plain_json(rollout.task, "task"),
            "budget_s": self.budget_s,
            "accepted": self.accepted,
        }

    @classmethod
    def from_json(cls, raw: object, where: str = "in_flight item") -> Self:
        """Parse one in-flight descriptor strictly (unknown or missing fields are errors)."""
        read = _Reader(raw, where, _SAVED_FIELDS)
        rollout = InFlightRollout(
            episode=EpisodeId(read.id("rollout_id"), read.attempt("attempt")),
            instance=read.id("instance"),
            prompt_group_id=read.id("prompt_group_id"),
            sibling_index=read.count("sibling_index"),
            group_size=read.count("group_size"),
            environment=read.text("environment"),
            boundaries_seen=read.count("boundaries_seen"),
            task=read.obj("task"),
        )
        if not 0 <= rollout.sibling_index < rollout.group_size:
            raise read.fail("sibling_index", f"must be in [0, {rollout.group_size})")
        return cls(rollout, read.optional_budget("budget_s"), read.flag("accepted"))


@dataclass(slots=True)
class RolloutStats:
    """Counters of what the client did (a copy is returned by :meth:`RolloutClient.stats`)."""

    dispatched: int = 0
    accepted: int = 0
    admission_refusals: int = 0
    reattaches: int = 0
    abandoned: int = 0
    reruns: int = 0
    given_up: int = 0
    results: int = 0
    acknowledged: int = 0
    ack_failures: int = 0


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


# --------------------------------------------------------------------------- internals


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


class _Phase(enum.Enum):
    PENDING = "pending"  # waiting for a slot or the gate: owned by nobody
    CALLING = "calling"  # Run sent, no verdict yet: owned by nobody as far as we know
    OWNED = "owned"  # accepted (or installed by a restore): part of the cut
    ENDED = "ended"


class _Verdict(enum.Enum):
    ENDED = "ended"  # the attempt ended (result recorded, abandoned or given up)
    REFUSED = "refused"  # ADMISSION_CLOSED
    BROKEN = "broken"  # transport failure, stream end without result, malformed message
    STALE = "stale"  # STALE_ATTEMPT: the attempt was retired
    FATAL = "fatal"  # a protocol error that a retry would only repeat


@dataclass(frozen=True, slots=True)
class _CallEnd:
    verdict: _Verdict
    detail: str = ""
    sent_generation: tuple[int, int] = (0, 0)


class _MalformedError(Exception):
    """A Run message that breaks the contract; the call is treated as broken."""


@dataclass(eq=False, slots=True)
class _Attempt:
    spec: Rollout
    episode: EpisodeId
    instance: str
    budget_s: float | None
    boundaries_seen: int = 0
    phase: _Phase = _Phase.PENDING
    # Installed by a restore: owned before its Run is sent, so it may pass a closed gate.
    restored: bool = False
    # Some Run of this attempt was accepted, so the participant held it at some point.
    accepted_once: bool = False
    # Attempts of this rollout started by this client, this one included.
    spent: int = 1
    # Consecutive broken calls without progress.
    broken: int = 0
    # Set by resolve_unacknowledged: a backing-off re-attach should go now.
    hurry: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    task: asyncio.Task[None] | None = None
    call: grpc.aio.UnaryStreamCall[pb.RunRequest, pb.RunResponse] | None = None

    def describe(self) -> InFlightRollout:
        spec = self.spec
        return InFlightRollout(
            episode=self.episode,
            instance=self.instance,
            prompt_group_id=spec.prompt_group_id,
            sibling_index=spec.sibling_index,
            group_size=spec.group_size,
            environment=spec.environment,
            boundaries_seen=self.boundaries_seen,
            task=spec.task,
        )


@dataclass(frozen=True, slots=True)
class _Receipt:
    instance: str
    episode: EpisodeId
    receipt_id: str

    def to_proto(self) -> types_pb2.CompletionReceipt:
        return types_pb2.CompletionReceipt(
            episode=episode_to_proto(self.episode), receipt_id=self.receipt_id
        )


_RESULT_OUTCOMES: Final = {
    pb.RUN_OUTCOME_COMPLETED: RolloutOutcome.COMPLETED,
    pb.RUN_OUTCOME_FAILED: RolloutOutcome.FAILED,
    pb.RUN_OUTCOME_BUDGET_EXHAUSTED: RolloutOutcome.BUDGET_EXHAUSTED,
}
# Failures of a Run below the protocol that a retry would only repeat.
_FATAL_CODES: Final = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
# Acknowledge refusals that mean "nothing retained here": the receipt is settled.
_ACK_SETTLED_REASONS: Final = frozenset({Reason.NOT_FOUND, Reason.STALE_ATTEMPT})


# --------------------------------------------------------------------------- the client


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
    ) -> None:
        for name in agents:
            validate_id(name, "agent instance")
        self._endpoints = dict(agents)
        self._settings = settings or RolloutClientSettings()
        self._clock = clock
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, RolloutServiceAsyncStub] = {}
        self._metadata = {
            name: (auth_metadata(endpoint.token) if endpoint.token else ())
            for name, endpoint in self._endpoints.items()
        }

        self._deadlines: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
        self._changes = _Changes()
        self._timer_wake = asyncio.Event()
        self._version = 0
        self._gate_open = True
        # Bumped at every reopen: tells a refused Run whether the gate closed and
        # reopened since it was sent (resend now) or not (the participant closed alone).
        self._gate_generation = 0
        # Instances the driver closed on their own (a release that failed), and their
        # reopen counts, which play the global generation's part for their Runs.
        self._closed_instances: set[str] = set()
        self._instance_generations: dict[str, int] = dict.fromkeys(self._endpoints, 0)

        self._live: dict[str, _Attempt] = {}
        self._pending: collections.deque[_Attempt] = collections.deque()
        self._pending_restored: collections.deque[_Attempt] = collections.deque()
        self._active = 0
        self._ledger: dict[str, int] = {}
        self._queue: dict[str, RolloutResult] = {}
        self._saved: dict[str, SavedRollout] = {}
        self._loader: JSONValue = None

        self._unacked: dict[str, _Receipt] = {}
        self._acked: collections.OrderedDict[str, _Receipt] = collections.OrderedDict()
        self._ack_tasks: dict[str, asyncio.Task[bool]] = {}
        self._retires: dict[str, set[EpisodeId]] = {}
        self._stats = RolloutStats()

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
        self._gate_open = False
        tasks: list[asyncio.Task[None]] = list(self._service_tasks)
        tasks += [attempt.task for attempt in self._live.values() if attempt.task is not None]
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
        self._check_new(rollout.rollout_id, rollout.instance)
        budget = (
            rollout.budget_s if rollout.budget_s is not None else self._settings.default_budget_s
        )
        attempt = _Attempt(rollout, EpisodeId(rollout.rollout_id, 0), rollout.instance, budget)
        self._stats.dispatched += 1
        self._add_live(attempt)
        return attempt.episode

    def close_dispatch(self) -> None:
        """Send no new Run; Runs not yet accepted wait at the gate and are not in the cut.

        Re-attaches of attempts a participant already owns are not held back: the
        participant attaches them whatever its admission.
        """
        self._gate_open = False
        self._changes.notify()

    def reopen_dispatch(self) -> None:
        if self._closed:
            return
        self._gate_open = True
        self._gate_generation += 1
        self._changes.notify()

    def close_dispatch_to(self, instance: str) -> None:
        """Send no new Run to ``instance`` whatever the global gate says (its release
        failed, so it would only refuse them). Idempotent."""
        self._known_instance(instance)
        self._closed_instances.add(instance)
        self._changes.notify()

    def reopen_dispatch_to(self, instance: str) -> None:
        """Undo :meth:`close_dispatch_to` once the instance was released. Idempotent."""
        self._known_instance(instance)
        if instance in self._closed_instances:
            self._closed_instances.discard(instance)
            self._instance_generations[instance] += 1
            self._changes.notify()

    @property
    def dispatch_open(self) -> bool:
        return self._gate_open

    def _known_instance(self, instance: str) -> None:
        if instance not in self._endpoints:
            raise ValueError(f"unknown agent instance {instance!r}")

    def _open_to(self, instance: str) -> bool:
        return self._gate_open and instance not in self._closed_instances

    def _generation(self, instance: str) -> tuple[int, int]:
        return (self._gate_generation, self._instance_generations[instance])

    @property
    def version(self) -> int:
        """Bumped on every change the cut would see; equal versions mean nothing changed."""
        return self._version

    def in_flight(self) -> Sequence[InFlightRollout]:
        """Accepted, unfinished attempts (those a participant owns), by episode."""
        owned = [attempt for attempt in self._live.values() if attempt.phase is _Phase.OWNED]
        return tuple(attempt.describe() for attempt in sorted(owned, key=_by_episode))

    def waiting(self) -> tuple[EpisodeId, ...]:
        """Attempts not owned by any participant yet: queued, at the gate, or sent."""
        return tuple(
            sorted(
                attempt.episode
                for attempt in self._live.values()
                if attempt.phase in (_Phase.PENDING, _Phase.CALLING)
            )
        )

    def attempts(self) -> Mapping[str, int]:
        """The attempt ledger: rollout id -> the attempt the trainer owns."""
        return dict(self._ledger)

    def stats(self) -> RolloutStats:
        return dataclasses.replace(self._stats)

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float | None) -> None:
        """Return once ``predicate()`` holds; it is re-checked after every change of the
        client's state. Raises ``TimeoutError`` after ``timeout_s``."""
        await self._changes.wait_for(predicate, timeout_s)

    # ------------------------------------------------------------------ deadlines

    def hold_deadlines(self, name: str) -> Hold:
        """Suspend every rollout budget until the hold is released (holders counted)."""
        hold = self._deadlines.hold(name, self._clock())
        self._timer_wake.set()
        return hold

    def release_deadlines(self, hold: Hold) -> None:
        """Release one hold; budgets run again only when no other holder holds."""
        self._deadlines.release(hold, self._clock())
        self._timer_wake.set()

    @property
    def deadlines_held(self) -> bool:
        return self._deadlines.held

    def remaining_budget(self, episode: EpisodeId) -> float | None:
        """Active seconds left for an owned attempt; None when it has no running budget."""
        if episode not in self._deadlines:
            return None
        return self._deadlines.remaining(episode, self._clock())

    def expire_due(self) -> list[EpisodeId]:
        """Give up every attempt whose active budget is spent now; returns them.

        The timer task calls this; a test driving a fake clock may call it directly.
        """
        given_up: list[EpisodeId] = []
        for episode in self._deadlines.expired(self._clock()):
            attempt = self._live.get(episode.rollout_id)
            if attempt is None or attempt.episode != episode or attempt.phase is not _Phase.OWNED:
                self._deadlines.finish(episode)
                continue
            self._give_up(attempt)
            given_up.append(episode)
        return given_up

    # ------------------------------------------------------------------ results

    def results(self) -> tuple[RolloutResult, ...]:
        """The unconsumed results, in queue order (a copy; nothing is consumed)."""
        return tuple(self._queue.values())

    async def next_result(self, timeout_s: float | None = None) -> RolloutResult:
        """Take the oldest unconsumed result, waiting for one up to ``timeout_s``."""
        await self._changes.wait_for(lambda: bool(self._queue), timeout_s)
        return self._consume([next(iter(self._queue))])[0]

    def ready_groups(self) -> int:
        """How many prompt groups have every sibling's result in the queue."""
        return len(self._ready_group_ids())

    def take_ready_groups(self, max_groups: int | None = None) -> list[tuple[RolloutResult, ...]]:
        """Take up to ``max_groups`` complete prompt groups, oldest first, siblings in order."""
        taken: list[tuple[RolloutResult, ...]] = []
        for group_id in self._ready_group_ids():
            if max_groups is not None and len(taken) >= max_groups:
                break
            rollout_ids = [
                result.rollout_id
                for result in sorted(self._queue.values(), key=lambda r: r.sibling_index)
                if result.prompt_group_id == group_id
            ]
            taken.append(tuple(self._consume(rollout_ids)))
        return taken

    def _ready_group_ids(self) -> list[str]:
        siblings: dict[str, set[int]] = {}
        sizes: dict[str, int] = {}
        for result in self._queue.values():
            siblings.setdefault(result.prompt_group_id, set()).add(result.sibling_index)
            sizes[result.prompt_group_id] = result.group_size
        return [group for group, seen in siblings.items() if len(seen) >= sizes[group]]

    def _consume(self, rollout_ids: Sequence[str]) -> list[RolloutResult]:
        taken = [self._queue.pop(rollout_id) for rollout_id in rollout_ids]
        for rollout_id in rollout_ids:
            # Trained on: nothing of it can be rerun, so it leaves the ledger too.
            self._ledger.pop(rollout_id, None)
        self._bump()
        return taken

    @property
    def data_loader(self) -> JSONValue:
        return self._loader

    def set_data_loader(self, position: JSONValue) -> None:
        """Record the data loader's position (any JSON value) for the next snapshot."""
        self._loader = TrainerRolloutState(data_loader=position).data_loader
        self._bump()

    # ------------------------------------------------------------------ acknowledgements

    async def drain_acknowledgements(self, timeout_s: float) -> None:
        """Return once every Run already sent has its verdict and every result already
        received is recorded and acknowledged.

        Raises ``TimeoutError`` after ``timeout_s`` and :class:`AcknowledgementError`
        when a receipt could not be acknowledged (each receipt is re-sent once per
        drain, so a participant that came back is given its acknowledgement).
        """
        async with asyncio.timeout(timeout_s):
            await self._changes.wait_for(self._no_verdict_pending, None)
            resent: set[str] = set()
            while True:
                for receipt_id, receipt in list(self._unacked.items()):
                    if receipt_id not in self._ack_tasks and receipt_id not in resent:
                        resent.add(receipt_id)
                        self._spawn_ack(receipt)
                if not self._ack_tasks:
                    break
                await asyncio.wait(list(self._ack_tasks.values()))
            if self._unacked:
                raise AcknowledgementError(
                    self._unacked, "the participant refused or could not be reached"
                )

    def _no_verdict_pending(self) -> bool:
        return all(attempt.phase is not _Phase.CALLING for attempt in self._live.values())

    async def resolve_unacknowledged(
        self, instance: str, episode: EpisodeId, receipt_id: str
    ) -> UnackedDecision:
        """A prepare reported a completion nobody acknowledged (PROTOCOL.md section 6,
        case 3): acknowledge it if its result is recorded (or the live attempt delivers it
        within ``resolve_timeout_s``), else say it must be retired.

        A ``"retire"`` decision also queues the attempt in :meth:`pending_retires`, and a
        live attempt that did not deliver is abandoned (its rollout rerun). An
        acknowledgement that fails raises (:class:`AcknowledgementError` or
        ``TimeoutError``): the checkpoint round fails and is retried.
        """
        receipt = self._known_receipt(receipt_id)
        attempt = self._live.get(episode.rollout_id)
        if receipt is None and attempt is not None and attempt.episode == episode:
            if attempt.phase is _Phase.OWNED:
                attempt.hurry = True
                self._changes.notify()
                with contextlib.suppress(TimeoutError):
                    await self._changes.wait_for(
                        lambda: (
                            self._known_receipt(receipt_id) is not None
                            or attempt.phase is _Phase.ENDED
                        ),
                        self._settings.resolve_timeout_s,
                    )
                receipt = self._known_receipt(receipt_id)
            if receipt is None and attempt.phase is not _Phase.ENDED:
                self._abandon(attempt, "its completion was reported but never delivered")
        if receipt is None:
            self._queue_retire(instance, episode)
            return "retire"
        if not await self._acknowledge_now(receipt):
            raise AcknowledgementError([receipt_id], f"{instance} did not take the receipt")
        return "acknowledge"

    def _known_receipt(self, receipt_id: str) -> _Receipt | None:
        return self._unacked.get(receipt_id) or self._acked.get(receipt_id)

    async def _acknowledge_now(self, receipt: _Receipt) -> bool:
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

    def _spawn_ack(self, receipt: _Receipt) -> asyncio.Task[bool]:
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

    async def _acknowledge(self, receipt: _Receipt) -> bool:
        """Acknowledge one receipt, retrying with the same request id; whether it settled."""
        settings = self._settings
        request = pb.AcknowledgeRequest(request_id=uuid.uuid4().hex, receipts=[receipt.to_proto()])
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
                self._stats.ack_failures += 1
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
                await asyncio.sleep(self._backoff(attempt))
        self._unacked.pop(receipt.receipt_id, None)
        self._acked[receipt.receipt_id] = receipt
        while len(self._acked) > _ACKED_MEMORY:
            self._acked.popitem(last=False)
        self._stats.acknowledged += 1
        self._changes.notify()
        return True

    # ------------------------------------------------------------------ retires

    def pending_retires(self) -> Mapping[str, Sequence[EpisodeId]]:
        """Abandoned attempts per instance, to retire while participants are idle."""
        return {
            instance: tuple(sorted(episodes))
            for instance, episodes in sorted(self._retires.items())
            if episodes
        }

    def retired(self, instance: str, episodes: Sequence[EpisodeId]) -> None:
        """The driver retired these attempts: drop them from :meth:`pending_retires`."""
        queued = self._retires.get(instance)
        if queued is None:
            return
        queued.difference_update(episodes)
        if not queued:
            del self._retires[instance]

    def _queue_retire(self, instance: str, episode: EpisodeId) -> None:
        self._retires.setdefault(instance, set()).add(episode)

    # ------------------------------------------------------------------ snapshot & restore

    def rollout_state(self) -> TrainerRolloutState:
        """Queue of finished rollouts not yet trained on, loader position, attempt ledger,
        and every unfinished rollout with its task (owned or not)."""
        in_flight = [
            SavedRollout(
                attempt.describe(), attempt.budget_s, attempt.phase is _Phase.OWNED
            ).to_json()
            for attempt in self._live.values()
        ]
        in_flight += [saved.to_json() for saved in self._saved.values()]
        return TrainerRolloutState(
            queue=tuple(result.to_json() for result in self._queue.values()),
            data_loader=self._loader,
            attempts=dict(self._ledger),
            in_flight=tuple(in_flight),
        )

    def install(self, state: TrainerRolloutState) -> tuple[SavedRollout, ...]:
        """Reinstall a snapshot's queue, ledger and loader position into a fresh client.

        Returns the unfinished rollouts it recorded; the restore then continues each one
        (:meth:`redispatch`) or reruns it (:meth:`rerun_from_prompt`). Until then they
        stay part of :meth:`rollout_state`, so a snapshot taken meanwhile loses none.
        """
        if self._live or self._queue or self._ledger or self._saved:
            raise RuntimeError("install() needs a client that has not run anything yet")
        queue = [
            RolloutResult.from_json(raw, f"rollout_state.queue[{index}]")
            for index, raw in enumerate(state.queue)
        ]
        saved = [
            SavedRollout.from_json(raw, f"rollout_state.in_flight[{index}]")
            for index, raw in enumerate(state.in_flight)
        ]
        for result in queue:
            if state.attempts.get(result.rollout_id) != result.episode.attempt:
                raise ManifestError(
                    f"queued result {result.episode} disagrees with the attempt ledger",
                    field="rollout_state.queue",
                )
        queued_ids = {result.rollout_id for result in queue}
        for item in saved:
            if item.rollout.episode.rollout_id in queued_ids:
                raise ManifestError(
                    f"rollout {item.rollout.episode.rollout_id!r} is both finished and in flight",
                    field="rollout_state.in_flight",
                )
        self._queue = {result.rollout_id: result for result in queue}
        self._saved = {item.rollout.episode.rollout_id: item for item in saved}
        self._ledger = dict(state.attempts)
        self._loader = state.data_loader
        self._bump()
        return tuple(saved)

    def redispatch(self, rollout: InFlightRollout, instance: str | None = None) -> EpisodeId:
        """Continue a saved attempt N as N+1 on ``instance`` (default: the one that saved it).

        ``rollout`` is the descriptor the snapshot recorded (attempt N). The participant
        installed N+1 at restore, so the attempt is owned from now on (in the cut, its
        budget running) and its Run passes even a closed gate, as the participant admits
        a restored replacement. If the participant refuses it nevertheless (it does not
        hold it), it falls back to an ordinary dispatch that waits for the gate.
        """
        target = rollout.instance if instance is None else instance
        rollout_id = rollout.episode.rollout_id
        self._check_restorable(rollout, target)
        saved = self._saved.pop(rollout_id, None)
        budget = saved.budget_s if saved is not None else self._settings.default_budget_s
        attempt = _Attempt(
            self._spec_of(rollout, target, budget),
            rollout.episode.next_attempt(),
            target,
            budget,
            boundaries_seen=rollout.boundaries_seen,
            phase=_Phase.OWNED,
            restored=True,
        )
        self._add_live(attempt)
        self._start_budget(attempt)
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
        target = rollout.instance if instance is None else instance
        rollout_id = rollout.episode.rollout_id
        self._check_restorable(rollout, target)
        lowest = max(self._ledger.get(rollout_id, -1), rollout.episode.attempt) + 1
        number = lowest if attempt is None else validate_attempt(attempt)
        if number < lowest:
            raise ValueError(f"attempt {number} of {rollout_id!r} is not newer than {lowest - 1}")
        saved = self._saved.pop(rollout_id, None)
        budget = saved.budget_s if saved is not None else self._settings.default_budget_s
        new = _Attempt(
            self._spec_of(rollout, target, budget), EpisodeId(rollout_id, number), target, budget
        )
        self._add_live(new)
        return new.episode

    def _check_new(self, rollout_id: str, instance: str) -> None:
        if instance not in self._endpoints:
            raise ValueError(f"unknown agent instance {instance!r}")
        if rollout_id in self._ledger or rollout_id in self._saved:
            raise ValueError(f"rollout {rollout_id!r} is already known to this client")

    def _check_restorable(self, rollout: InFlightRollout, instance: str) -> None:
        rollout_id = rollout.episode.rollout_id
        if instance not in self._endpoints:
            raise ValueError(f"unknown agent instance {instance!r}")
        if rollout_id in self._live:
            raise ValueError(f"rollout {rollout_id!r} is already running")
        if rollout_id in self._queue:
            # PROTOCOL.md section 7: never run again what the queue already holds.
            raise ValueError(f"rollout {rollout_id!r} already has a result in the queue")
        owned = self._ledger.get(rollout_id)
        if owned is not None and owned != rollout.episode.attempt:
            raise ValueError(
                f"descriptor {rollout.episode} is stale: the ledger holds attempt {owned}"
            )

    @staticmethod
    def _spec_of(rollout: InFlightRollout, instance: str, budget: float | None) -> Rollout:
        return Rollout(
            rollout_id=rollout.episode.rollout_id,
            prompt_group_id=rollout.prompt_group_id,
            sibling_index=rollout.sibling_index,
            group_size=rollout.group_size,
            environment=rollout.environment,
            task=rollout.task,
            instance=instance,
            budget_s=budget,
        )

    # ------------------------------------------------------------------ bookkeeping

    def _bump(self) -> None:
        self._version += 1
        self._changes.notify()

    def _add_live(self, attempt: _Attempt) -> None:
        rollout_id = attempt.episode.rollout_id
        self._live[rollout_id] = attempt
        self._ledger[rollout_id] = attempt.episode.attempt
        if attempt.restored:
            self._pending_restored.append(attempt)
        else:
            self._pending.append(attempt)
        self._bump()

    def _start_budget(self, attempt: _Attempt) -> None:
        if attempt.budget_s is None or attempt.episode in self._deadlines:
            return
        self._deadlines.start(
            attempt.episode, attempt.budget_s + self._settings.budget_grace_s, self._clock()
        )
        self._timer_wake.set()

    def _accept(self, attempt: _Attempt) -> None:
        attempt.accepted_once = True
        if attempt.phase is _Phase.OWNED:
            return
        attempt.phase = _Phase.OWNED
        self._stats.accepted += 1
        self._start_budget(attempt)
        self._bump()

    def _unown(self, attempt: _Attempt) -> None:
        """The participant does not hold the attempt (it refused its Run)."""
        if attempt.phase is _Phase.OWNED:
            self._deadlines.finish(attempt.episode)
            self._bump()
        attempt.phase = _Phase.PENDING
        attempt.restored = False
        self._changes.notify()

    def _end(self, attempt: _Attempt) -> None:
        """Take the attempt out of the live set; stop its call and task unless it is the
        task running this (which finishes its call itself)."""
        attempt.phase = _Phase.ENDED
        rollout_id = attempt.episode.rollout_id
        if self._live.get(rollout_id) is attempt:
            del self._live[rollout_id]
        self._deadlines.finish(attempt.episode)
        if attempt.task is not None and attempt.task is not asyncio.current_task():
            if attempt.call is not None and not attempt.call.done():
                attempt.call.cancel()
            attempt.task.cancel()
        self._bump()

    def _record(
        self,
        attempt: _Attempt,
        outcome: RolloutOutcome,
        *,
        output: Mapping[str, Any] | None = None,
        turns: int | None = None,
        active_time_s: float = 0.0,
        error_message: str = "",
        receipt_id: str = "",
    ) -> None:
        spec = attempt.spec
        result = RolloutResult(
            episode=attempt.episode,
            instance=attempt.instance,
            prompt_group_id=spec.prompt_group_id,
            sibling_index=spec.sibling_index,
            group_size=spec.group_size,
            environment=spec.environment,
            outcome=outcome,
            output=dict(output or {}),
            task=spec.task,
            turns=attempt.boundaries_seen if turns is None else turns,
            boundaries=attempt.boundaries_seen,
            active_time_s=active_time_s,
            error_message=error_message,
            receipt_id=receipt_id,
        )
        self._queue[attempt.episode.rollout_id] = result
        self._stats.results += 1
        self._bump()

    def _abandon(self, attempt: _Attempt, why: str, *, retire: bool = True) -> None:
        """Drop the attempt (retire it unless the participant already did) and rerun the
        rollout from its prompt as the next attempt, while attempts remain."""
        if attempt.phase is _Phase.ENDED:
            return
        self._end(attempt)
        self._stats.abandoned += 1
        if retire:
            self._queue_retire(attempt.instance, attempt.episode)
        _LOG.warning("abandoned %s on %s: %s", attempt.episode, attempt.instance, why)
        if attempt.spent >= self._settings.max_attempts:
            self._record(
                attempt,
                RolloutOutcome.ABANDONED,
                error_message=f"{attempt.spent} attempt(s) failed; last: {why}",
            )
            return
        self._stats.reruns += 1
        self._add_live(
            _Attempt(
                attempt.spec,
                attempt.episode.next_attempt(),
                attempt.spec.instance,
                attempt.budget_s,
                spent=attempt.spent + 1,
            )
        )

    def _fail(self, attempt: _Attempt, why: str) -> None:
        """A protocol error a rerun would only repeat: record the rollout as abandoned."""
        self._end(attempt)
        self._stats.abandoned += 1
        if attempt.accepted_once:
            self._queue_retire(attempt.instance, attempt.episode)
        _LOG.error("rollout %s on %s failed: %s", attempt.episode, attempt.instance, why)
        self._record(attempt, RolloutOutcome.ABANDONED, error_message=why)

    def _give_up(self, attempt: _Attempt) -> None:
        spent = self._deadlines.consumed(attempt.episode, self._clock())
        # Cancelling the call is what tells the participant (PROTOCOL.md section 6,
        # parked deadline, way 2): it finishes the execution as cancelled, owes no ack.
        self._end(attempt)
        if attempt.boundaries_seen > 0:
            # A cancelled execution keeps its sealed boundary committable; nobody will
            # continue it, so its state is freed by a retire.
            self._queue_retire(attempt.instance, attempt.episode)
        self._stats.given_up += 1
        _LOG.warning(
            "gave up %s on %s after %.1f s of active time", attempt.episode, attempt.instance, spent
        )
        self._record(
            attempt,
            RolloutOutcome.GIVEN_UP,
            active_time_s=spent,
            error_message=f"active-time budget of {attempt.budget_s} s spent",
        )

    # ------------------------------------------------------------------ service loops

    async def _dispatch_loop(self) -> None:
        while True:
            await self._changes.wait_for(self._can_start, None)
            attempt = self._take_startable()
            if (
                attempt is None
                or attempt.phase is _Phase.ENDED
                or self._live.get(attempt.episode.rollout_id) is not attempt
            ):
                continue
            self._active += 1
            attempt.task = asyncio.create_task(
                self._follow(attempt), name=f"turnpoint-rollout-{attempt.episode}"
            )

    def _can_start(self) -> bool:
        if self._closed or self._active >= self._settings.max_concurrency:
            return False
        if self._pending_restored:
            return True
        if not self._pending or not self._gate_open:
            return False
        if not self._closed_instances:
            return True
        # Stale entries (ended attempts) count as startable so that they get dropped.
        return any(
            self._open_to(attempt.instance) or attempt.phase is _Phase.ENDED
            for attempt in self._pending
        )

    def _take_startable(self) -> _Attempt | None:
        if self._pending_restored:
            return self._pending_restored.popleft()
        if not self._closed_instances:
            return self._pending.popleft() if self._pending else None
        # Runs for an instance closed on its own stay queued instead of taking slots
        # that Runs for the other instances could use.
        for index, attempt in enumerate(self._pending):
            if self._open_to(attempt.instance) or attempt.phase is _Phase.ENDED:
                del self._pending[index]
                return attempt
        return None

    async def _timer_loop(self) -> None:
        while True:
            self._timer_wake.clear()
            self.expire_due()
            wait = self._deadlines.next_expiry(self._clock())
            timeout = _MAX_TIMER_SLEEP_S if wait is None else min(wait, _MAX_TIMER_SLEEP_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._timer_wake.wait()

    # ------------------------------------------------------------------ one attempt

    async def _follow(self, attempt: _Attempt) -> None:
        try:
            await self._drive(attempt)
        except Exception as error:  # noqa: BLE001 - a bug here must not leave the attempt live forever
            _LOG.exception("rollout %s: unexpected failure", attempt.episode)
            if attempt.phase is not _Phase.ENDED:
                self._fail(attempt, f"client error: {type(error).__name__}: {error}")
        finally:
            attempt.task = None
            self._active -= 1
            self._changes.notify()

    async def _drive(self, attempt: _Attempt) -> None:
        settings = self._settings
        while attempt.phase is not _Phase.ENDED:
            end = await self._call_once(attempt)
            if end.verdict is _Verdict.ENDED:
                return
            if end.verdict is _Verdict.REFUSED:
                self._stats.admission_refusals += 1
                held_before = attempt.accepted_once
                self._unown(attempt)
                if held_before:
                    # Attach never consults admission: a refusal means the participant
                    # lost the execution (it restarted), so the attempt is gone.
                    self._abandon(attempt, "the participant no longer holds the attempt")
                    return
                await self._after_refusal(attempt, end.sent_generation)
                continue
            if end.verdict is _Verdict.STALE:
                self._abandon(attempt, end.detail, retire=False)
                return
            if end.verdict is _Verdict.FATAL:
                self._fail(attempt, end.detail)
                return
            # Broken: re-attach with the same episode and request id.
            if attempt.phase is _Phase.CALLING:
                attempt.phase = _Phase.PENDING
                self._changes.notify()
            attempt.broken += 1
            if attempt.broken > settings.reattach_attempts:
                self._abandon(attempt, f"{attempt.broken} broken call(s): {end.detail}")
                return
            self._stats.reattaches += 1
            self._changes.notify()
            _LOG.info("re-attaching %s on %s: %s", attempt.episode, attempt.instance, end.detail)
            with contextlib.suppress(TimeoutError):
                await self._changes.wait_for(lambda: attempt.hurry, self._backoff(attempt.broken))
            attempt.hurry = False

    async def _after_refusal(self, attempt: _Attempt, sent: tuple[int, int]) -> None:
        """Wait before resending a refused Run: for the gate when it closed since the Run
        was sent (the next send waits for it to reopen), else a pause, cut short by a
        reopen, because the participant closed while our gate stayed open."""
        instance = attempt.instance
        if not self._open_to(instance) or self._generation(instance) != sent:
            return
        with contextlib.suppress(TimeoutError):
            await self._changes.wait_for(
                lambda: self._generation(instance) != sent or attempt.hurry,
                self._settings.admission_backoff_s,
            )
        attempt.hurry = False

    def _backoff(self, failures: int) -> float:
        settings = self._settings
        growth: float = 2.0 ** max(failures - 1, 0)
        return min(settings.retry_backoff_s * growth, settings.max_retry_backoff_s)

    def _may_send(self, attempt: _Attempt) -> bool:
        if attempt.phase is _Phase.ENDED or self._closed:
            return True  # let the caller notice and stop
        return self._open_to(attempt.instance) or attempt.phase is _Phase.OWNED

    async def _call_once(self, attempt: _Attempt) -> _CallEnd:
        await self._changes.wait_for(lambda: self._may_send(attempt), None)
        if attempt.phase is _Phase.ENDED or self._closed:
            return _CallEnd(_Verdict.ENDED)
        # No await from the gate check to the call: a Run is sent only through an open
        # gate (or for an attempt a participant already owns).
        if attempt.phase is _Phase.PENDING:
            attempt.phase = _Phase.CALLING
            self._changes.notify()
        generation = self._generation(attempt.instance)
        call = self._stubs[attempt.instance].Run(
            self._run_request(attempt), metadata=self._metadata[attempt.instance]
        )
        attempt.call = call
        try:
            return await self._read_call(attempt, call)
        except grpc.aio.AioRpcError as error:
            return self._classify(error, generation)
        except (_MalformedError, TurnpointError) as error:
            return _CallEnd(_Verdict.BROKEN, f"malformed reply: {error}")
        finally:
            attempt.call = None
            if not call.done():
                call.cancel()

    def _run_request(self, attempt: _Attempt) -> pb.RunRequest:
        spec = attempt.spec
        request = pb.RunRequest(
            request_id=attempt.request_id,
            episode=episode_to_proto(attempt.episode),
            task=struct_from_mapping(spec.task),
            prompt_group_id=spec.prompt_group_id,
            sibling_index=spec.sibling_index,
            group_size=spec.group_size,
            boundaries_seen=attempt.boundaries_seen,
        )
        if attempt.budget_s is not None and math.isfinite(attempt.budget_s):
            request.budget.CopyFrom(duration_from_seconds(attempt.budget_s))
        return request

    async def _read_call(
        self, attempt: _Attempt, call: grpc.aio.UnaryStreamCall[pb.RunRequest, pb.RunResponse]
    ) -> _CallEnd:
        try:
            async with asyncio.timeout(self._settings.accept_timeout_s):
                metadata = await call.initial_metadata()
        except TimeoutError:
            return _CallEnd(_Verdict.BROKEN, "no verdict within the accept timeout")
        if metadata.get(ACCEPTED_METADATA_KEY) == _ACCEPTED_VALUE:
            self._accept(attempt)
        # A refusal ends the call here, before anything else is read (it raises).
        async for message in call:
            # A participant that sends no acceptance header has accepted once it talks.
            self._accept(attempt)
            event = message.WhichOneof("event")
            if event == "boundary":
                self._on_boundary(attempt, message.boundary)
            elif event == "result":
                self._on_result(attempt, message.result)
                # Let the call end on its own status rather than cancel a finished run.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._settings.accept_timeout_s):
                        await call.code()
                return _CallEnd(_Verdict.ENDED)
            else:
                raise _MalformedError("a Run message with neither boundary nor result")
        return _CallEnd(_Verdict.BROKEN, "the stream ended without a result")

    def _classify(self, error: grpc.aio.AioRpcError, generation: tuple[int, int]) -> _CallEnd:
        protocol = error_from_rpc(error)
        if protocol is not None:
            detail = f"{protocol.reason.name}: {protocol.message}"
            if protocol.reason is Reason.ADMISSION_CLOSED:
                return _CallEnd(_Verdict.REFUSED, detail, generation)
            if protocol.reason is Reason.STALE_ATTEMPT:
                return _CallEnd(_Verdict.STALE, detail, generation)
            if protocol.transient:
                return _CallEnd(_Verdict.BROKEN, detail, generation)
            return _CallEnd(_Verdict.FATAL, detail, generation)
        detail = f"{error.code().name}: {error.details()}"
        if error.code() in _FATAL_CODES:
            return _CallEnd(_Verdict.FATAL, detail, generation)
        return _CallEnd(_Verdict.BROKEN, detail, generation)

    def _check_episode(self, attempt: _Attempt, message: types_pb2.EpisodeId, what: str) -> None:
        episode = episode_from_proto(message, what)
        if episode != attempt.episode:
            raise _MalformedError(f"{what} names {episode}, not {attempt.episode}")

    def _on_boundary(self, attempt: _Attempt, report: pb.BoundaryReport) -> None:
        self._check_episode(attempt, report.episode, "boundary.episode")
        attempt.broken = 0
        if report.boundary_index > attempt.boundaries_seen:
            attempt.boundaries_seen = report.boundary_index
            self._bump()

    def _on_result(self, attempt: _Attempt, result: pb.RunResult) -> None:
        self._check_episode(attempt, result.episode, "result.episode")
        if result.outcome == pb.RUN_OUTCOME_CANCELLED:
            # We did not cancel (we are still reading): the participant stopped it.
            self._abandon(attempt, "the participant cancelled the execution")
            return
        outcome = _RESULT_OUTCOMES.get(result.outcome)
        if outcome is None:
            raise _MalformedError(f"result outcome {result.outcome} is not a final outcome")
        if not result.HasField("receipt") or not result.receipt.receipt_id:
            raise _MalformedError(f"a {outcome.value} result without a receipt")
        self._check_episode(attempt, result.receipt.episode, "result.receipt.episode")
        receipt = _Receipt(attempt.instance, attempt.episode, result.receipt.receipt_id)
        active = seconds_from_duration(result.active_time, "active_time", default=0.0) or 0.0
        self._end(attempt)
        self._record(
            attempt,
            outcome,
            output=struct_to_dict(result.result),
            turns=result.turns,
            active_time_s=active,
            error_message=result.error_message,
            receipt_id=receipt.receipt_id,
        )
        # Acknowledged at once, this sibling alone (PROTOCOL.md section 6).
        self._unacked[receipt.receipt_id] = receipt
        self._spawn_ack(receipt)


def _by_episode(attempt: _Attempt) -> EpisodeId:
    return attempt.episode


if TYPE_CHECKING:

    def _conforms(client: RolloutClient) -> RolloutSide:
        return client
