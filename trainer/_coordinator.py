"""The trainer-side coordinator: every control operation, fanned out to every participant.

PROTOCOL.md section 7. :class:`Coordinator` holds one
:class:`~turnpoint.trainer._control_client.ParticipantControlClient` per participant
instance and turns each protocol operation into one bounded fan-out:

- every request carries the coordinator's :class:`Fence` (id and epoch) and a request id
  decided once per (operation, checkpoint, instance): a retry, by this coordinator or
  by the snapshot pump on its next tick, sends the very same id, so a participant that
  acted on a request whose reply was lost replays or joins instead of acting twice;
- every fan-out has a deadline (the operation's timeout plus the reply grace) and calls
  still running at it are cancelled (:func:`~turnpoint.trainer._fanout.fan_out`);
- every failure is classified (:func:`~turnpoint.trainer._control_client.classify`):
  retryable when it is not-ready or every failing instance failed with an infrastructure
  error, an invariant break otherwise (REFERENCE.md).

Prepare, and the request id of a repeated prepare
-------------------------------------------------
``prepare`` runs under ONE deadline (``prepare_timeout_s``) for all participants. Each
participant gets rounds of at most ``control_timeout_s``; a round answered not-ready with
time left is sent again with the *same* request id. That is safe because a participant
records only a *ready* prepare answer for replay (PROTOCOL.md section 4: "a retry of a
ready prepare replays the recorded answer"); the participant SDK treats a repeated
prepare of the active checkpoint as "renew and keep waiting"
(``ParticipantCore.begin_prepare``), and its per-request answer log is consulted only for
fenced requests. A participant that did replay a recorded not-ready answer would just be
reported not ready at the deadline, never wrongly ready. Reusing the id keeps the
"one id per (operation, checkpoint, instance)" rule without exception.

Between rounds the coordinator does not poll: it watches the participant's
``WatchBoundaries`` stream and sends the next round when readiness changes (participants
without the stream get the next round at once, with a short backoff only if they answer
instantly). The same stream delivers the blockers of a prepare as they appear, so an
unacknowledged completion (PROTOCOL.md section 6, case 3) is resolved while the prepare
waits, not only after a not-ready answer: the rollout side acknowledges it, or says it
must be retired, which can only happen once the participant is idle again, so that
prepare gives up at once instead of waiting out the deadline.

While anything is slow (a prepare, a commit, the trainer's own publication) the
coordinator renews every participant's lease in the background, once right after prepare
and then every ``renew_interval_s``; a renew that hangs is abandoned before the next one
is due and never holds up the checkpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, Final, Self

import grpc

from turnpoint._convert import duration_from_seconds, episode_to_proto
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, InvalidIdError, validate_id
from turnpoint.protocol import (
    PROTOCOL_VERSION,
    ParticipantKind,
    RecoveryLevel,
    RecoveryMode,
    VerifyMode,
)
from turnpoint.trainer._config import CoordinatorConfig
from turnpoint.trainer._control_client import (
    ControlCallError,
    ControlRequest,
    ControlResponse,
    Failure,
    FailureKind,
    MalformedReplyError,
    NotReadyError,
    ParticipantControlClient,
    SessionBrokenError,
    TransportError,
    classify,
    new_request_id,
)
from turnpoint.trainer._errors import CoordinatorError
from turnpoint.trainer._fanout import ControlCaller, FanoutError, FanoutResult, fan_out
from turnpoint.trainer._fanout import retry_same_request as _retry_same_request
from turnpoint.trainer._interfaces import UnackedDecision
from turnpoint.trainer._manifest import (
    ArtifactRef,
    ManifestError,
    ParticipantEntry,
    SnapshotManifest,
)
from turnpoint.trainer._metrics import CoordinatorMetrics
from turnpoint.trainer._recovery import EnvironmentMember
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

__all__ = [
    "COORDINATOR_FILE",
    "PROTOCOL_VERSION",
    "CommitFailed",
    "ControlReport",
    "Coordinator",
    "CoordinatorError",
    "CoordinatorIdentity",
    "OperationFailed",
    "ParticipantInfo",
    "PrepareFailed",
    "PreparedCheckpoint",
    "RestoreFailed",
    "RestoredCheckpoint",
    "Topology",
    "UnackedResolver",
    "bump_epoch",
]

_LOG = logging.getLogger(__name__)

COORDINATOR_FILE: Final = "coordinator.json"

# A commit or restore that ran out of time keeps working on the participant; one retry
# with the same request joins that work (PROTOCOL.md section 4) instead of giving up.
_JOINING_ATTEMPTS: Final = 2
# A participant that answers a prepare round not-ready at once, and serves no readiness
# stream to wait on, gets the next round after this backoff (doubling, capped).
_NOT_READY_BACKOFF_S: Final = 0.05
_NOT_READY_BACKOFF_MAX_S: Final = 1.0
# A prepare round is not started with less time left than this (or this fraction of
# the round timeout, whichever is less): the last not-ready answer stands instead.
_MIN_ROUND_S: Final = 1.0
_MIN_ROUND_FRACTION: Final = 0.2
# A participant still preparing after this long (or a tenth of the prepare deadline)
# gets its readiness stream watched.
_WATCH_AFTER_S: Final = 0.25
# Broken sessions a prepare round re-sends on before it gives up on that participant.
_SESSION_RETRIES: Final = 2
# Resume order (PROTOCOL.md section 7, step 8): what rollouts depend on reopens first.
_RESUME_ORDER: Final = (
    (ParticipantKind.RESOURCES,),
    (ParticipantKind.MODEL,),
    (ParticipantKind.AGENT, ParticipantKind.ENVIRONMENT),
)
_AGENT_KINDS: Final = frozenset({ParticipantKind.AGENT, ParticipantKind.ENVIRONMENT})

UnackedResolver = Callable[[str, EpisodeId, str], Awaitable[UnackedDecision]]
"""``(instance, episode, receipt_id) -> "acknowledge" | "retire"``: the rollout side's
:meth:`~turnpoint.trainer._interfaces.RolloutSide.resolve_unacknowledged`."""

# ----------------------------------------------------------------------- identity


@dataclass(frozen=True, slots=True)
class CoordinatorIdentity:
    """Who this coordinator is: ``(coordinator_id, epoch)``, sent as the Fence."""

    coordinator_id: str
    epoch: int

    def __post_init__(self) -> None:
        validate_id(self.coordinator_id, "coordinator_id")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise ValueError(f"epoch must be an integer >= 1, got {self.epoch!r}")


def _read_identity(path: Path) -> CoordinatorIdentity | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) != {"coordinator_id", "epoch"}:
            raise ValueError("expected exactly the keys coordinator_id and epoch")
        return CoordinatorIdentity(raw["coordinator_id"], raw["epoch"])
    except (ValueError, InvalidIdError) as error:
        raise ValueError(f"{path} is not a coordinator identity file: {error}") from None


def bump_epoch(
    snapshot_root: str | Path, *, coordinator_id: str | None = None
) -> CoordinatorIdentity:
    """Increase and persist the coordinator epoch in ``<snapshot_root>/coordinator.json``.

    Call once at every start, before the first control call (PROTOCOL.md section 2). The
    id is ``coordinator_id`` when given, else the stored one, else a new random id; the
    epoch is one more than the stored one (1 the first time). The file is replaced
    atomically and durably (temporary file, fsync, rename, fsync of the directory), so a
    crash leaves the old epoch or the new one, never a torn file. Blocking: from async
    code run it with ``asyncio.to_thread``.
    """
    root = Path(snapshot_root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / COORDINATOR_FILE
    stored = _read_identity(path)
    chosen = coordinator_id or (
        stored.coordinator_id if stored else f"coord-{secrets.token_hex(6)}"
    )
    identity = CoordinatorIdentity(chosen, (stored.epoch if stored else 0) + 1)
    data = json.dumps({"coordinator_id": identity.coordinator_id, "epoch": identity.epoch})
    staged = root / f".coordinator-{secrets.token_hex(8)}.tmp"
    try:
        with staged.open("x", encoding="utf-8") as handle:
            handle.write(data + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staged, path)
    except OSError:
        staged.unlink(missing_ok=True)
        raise
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return identity


# ----------------------------------------------------------------------- topology


def _enum_from_proto(proto_enum: Any, number: int, sdk_enum: type[Any], prefix: str) -> Any:
    """The SDK member named like the proto value without its prefix; None if unset/unknown."""
    try:
        name: str = proto_enum.Name(number)
    except ValueError:
        return None
    if not name.startswith(prefix) or name.endswith("_UNSPECIFIED"):
        return None
    try:
        return sdk_enum[name.removeprefix(prefix)]
    except KeyError:
        return None


@dataclass(frozen=True, slots=True)
class ParticipantInfo:
    """What one participant said about itself in ``Describe``."""

    instance: str
    kind: ParticipantKind
    incarnation: str
    protocol_version: str
    recovery_mode: RecoveryMode
    verify_mode: VerifyMode | None
    group_scored: bool
    group_size: int
    supported_levels: frozenset[RecoveryLevel]
    environment: str
    data_plane_address: str = ""

    @classmethod
    def from_proto(cls, instance: str, response: pb.DescribeResponse) -> Self:
        """Convert a ``DescribeResponse``; raise :class:`MalformedReplyError` if it breaks
        the contract (unknown kind, another protocol version)."""

        def bad(detail: str) -> MalformedReplyError:
            return MalformedReplyError(instance, "Describe", detail)

        kind = _enum_from_proto(
            types_pb2.ParticipantKind, response.kind, ParticipantKind, "PARTICIPANT_KIND_"
        )
        if kind is None:
            raise bad(f"unknown participant kind {response.kind}")
        if response.protocol_version != PROTOCOL_VERSION:
            raise bad(
                f"speaks {response.protocol_version!r}, this coordinator speaks {PROTOCOL_VERSION!r}"
            )
        # Unaudited servers are RESTART_ONLY (PROTOCOL.md section 4): unset means that.
        mode = _enum_from_proto(
            types_pb2.RecoveryMode, response.recovery_mode, RecoveryMode, "RECOVERY_MODE_"
        )
        levels = frozenset(
            RecoveryLevel[name]
            for value in response.supported_levels
            if (name := types_pb2.RecoveryLevel.Name(value).removeprefix("RECOVERY_LEVEL_"))
            in RecoveryLevel.__members__
        )
        return cls(
            instance=instance,
            kind=kind,
            incarnation=response.header.incarnation,
            protocol_version=response.protocol_version,
            recovery_mode=mode if mode is not None else RecoveryMode.RESTART_ONLY,
            verify_mode=_enum_from_proto(
                types_pb2.VerifyMode, response.verify_mode, VerifyMode, "VERIFY_MODE_"
            ),
            group_scored=response.group_scored,
            group_size=response.group_size,
            supported_levels=levels,
            environment=response.environment,
            data_plane_address=response.data_plane_address,
        )

    @property
    def runs_episodes(self) -> bool:
        """Whether rollouts are dispatched to it (an agent or a combined environment)."""
        return self.kind in _AGENT_KINDS

    def member(self) -> EnvironmentMember:
        return EnvironmentMember(
            instance=self.instance,
            kind=self.kind.value.lower(),
            recovery_mode=self.recovery_mode.value.lower(),
            supported_levels=self.supported_levels,
            group_scored=self.group_scored,
            group_size=self.group_size,
        )


@dataclass(frozen=True, slots=True)
class Topology:
    """The live participants, by instance name, as discovery found them."""

    participants: Mapping[str, ParticipantInfo]

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "participants", MappingProxyType(dict(sorted(self.participants.items())))
        )

    @property
    def instances(self) -> frozenset[str]:
        return frozenset(self.participants)

    def kind(self, instance: str) -> ParticipantKind:
        return self.participants[instance].kind

    def of_kind(self, *kinds: ParticipantKind) -> tuple[str, ...]:
        return tuple(sorted(name for name, info in self.participants.items() if info.kind in kinds))

    @property
    def agents(self) -> tuple[str, ...]:
        """Instances rollouts are dispatched to (agents and combined environments)."""
        return self.of_kind(*_AGENT_KINDS)

    def environments(self) -> dict[str, tuple[EnvironmentMember, ...]]:
        """Each named environment's participants, for :func:`decide_levels`."""
        grouped: dict[str, list[EnvironmentMember]] = {}
        for info in self.participants.values():
            if info.environment:
                grouped.setdefault(info.environment, []).append(info.member())
        return {name: tuple(members) for name, members in sorted(grouped.items())}

    def check_manifest(self, manifest: SnapshotManifest) -> None:
        """Raise :class:`ManifestError` unless the snapshot was taken with these participants."""
        manifest.validate_topology(self.instances)
        for entry in manifest.participants:
            live = self.participants[entry.instance].kind
            if entry.kind is not live:
                raise ManifestError(
                    f"snapshot {manifest.checkpoint_id!r}: {entry.instance!r} was saved as "
                    f"{entry.kind.value} but is live as {live.value}",
                    checkpoint_id=manifest.checkpoint_id,
                    field="participants",
                )


# ------------------------------------------------------------------------- errors


class OperationFailed(FanoutError):
    """One coordinated operation failed on one or more participants.

    ``key`` is the checkpoint or restore id (or the content key of a retire). The
    ``transient`` property (from :class:`FanoutError`) says whether trying again may
    succeed: REFERENCE.md's rule, not-ready or infrastructure failures only.
    """

    def __init__(self, operation: str, key: str, failures: Mapping[str, Failure]) -> None:
        super().__init__(operation, failures)
        self.key = key
        self.args = (f"{key}: {self.args[0]}",)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.operation, self.key, self.failures))

    @property
    def reasons(self) -> frozenset[Reason]:
        return frozenset(f.reason for f in self.failures.values() if f.reason is not None)


class PrepareFailed(OperationFailed):
    """Not every participant was prepared in time (or one refused).

    ``retire``: attempts the rollout side said must go (unacknowledged completions it no
    longer wants); they can only be retired once the participant is idle again.
    ``release``: the resume that aborted the checkpoint, once :meth:`Coordinator.prepared`
    sent it.
    """

    def __init__(
        self,
        checkpoint_id: str,
        failures: Mapping[str, Failure],
        retire: Mapping[str, tuple[EpisodeId, ...]] | None = None,
    ) -> None:
        super().__init__("prepare", checkpoint_id, failures)
        self.checkpoint_id = checkpoint_id
        self.retire: dict[str, tuple[EpisodeId, ...]] = dict(retire or {})
        self.release: ControlReport | None = None

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.checkpoint_id, self.failures, self.retire))

    @property
    def not_ready(self) -> frozenset[str]:
        return frozenset(
            name for name, failure in self.failures.items() if failure.kind is FailureKind.NOT_READY
        )


class CommitFailed(OperationFailed):
    def __init__(self, checkpoint_id: str, failures: Mapping[str, Failure]) -> None:
        super().__init__("commit", checkpoint_id, failures)
        self.checkpoint_id = checkpoint_id

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.checkpoint_id, self.failures))


class RestoreFailed(OperationFailed):
    """A restore failed on at least one participant: its outcome is uncertain everywhere.

    By the time :meth:`Coordinator.restored` raises it, the replacement attempts
    (``replacements``, attempt N+1 of every scoped episode) were retired on every
    participant and every participant was resumed: the caller starts those rollouts over
    from their prompts, with an attempt above the retired one. ``cleanup`` holds what
    failed while cleaning up (each participant's lease reopens it anyway).
    """

    def __init__(
        self,
        restore_id: str,
        failures: Mapping[str, Failure],
        replacements: Iterable[EpisodeId] = (),
        cleanup: Mapping[str, Failure] | None = None,
    ) -> None:
        super().__init__("restore", restore_id, failures)
        self.restore_id = restore_id
        self.replacements: tuple[EpisodeId, ...] = tuple(sorted(set(replacements)))
        self.cleanup: dict[str, Failure] = dict(cleanup or {})

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.restore_id, self.failures, self.replacements, self.cleanup))


# ------------------------------------------------------------------------ reports


@dataclass(frozen=True, slots=True)
class ControlReport:
    """The outcome of an operation that reports failures instead of raising them
    (resume, retire, forget): who succeeded, who failed and why."""

    operation: str
    key: str
    succeeded: frozenset[str]
    failures: Mapping[str, Failure]
    durations_s: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_if_failed(self) -> None:
        if self.failures:
            raise OperationFailed(self.operation, self.key, self.failures)

    @staticmethod
    def merge(operation: str, key: str, reports: Iterable[ControlReport]) -> ControlReport:
        succeeded: set[str] = set()
        failures: dict[str, Failure] = {}
        durations: dict[str, float] = {}
        for report in reports:
            succeeded |= report.succeeded
            failures.update(report.failures)
            durations.update(report.durations_s)
        return ControlReport(
            operation,
            key,
            frozenset(succeeded - set(failures)),
            MappingProxyType(failures),
            MappingProxyType(durations),
        )


@dataclass(eq=False)
class PreparedCheckpoint:
    """A checkpoint every participant is prepared for, as :meth:`Coordinator.prepared`
    yields it. ``release`` is set once the context exits (the resume's outcome)."""

    checkpoint_id: str
    readiness: Mapping[str, types_pb2.ReadinessReport]
    restarts: Mapping[str, tuple[EpisodeId, ...]]
    durations_s: Mapping[str, float]
    release: ControlReport | None = None
    renew_failures: dict[str, Failure] = field(default_factory=dict)

    @property
    def all_restarts(self) -> frozenset[EpisodeId]:
        return frozenset(episode for episodes in self.restarts.values() for episode in episodes)


@dataclass(eq=False)
class RestoredCheckpoint:
    """A restore every participant installed, as :meth:`Coordinator.restored` yields it."""

    restore_id: str
    installed: Mapping[str, tuple[EpisodeId, ...]]
    release: ControlReport | None = None


# ---------------------------------------------------------------------- helpers


class _RequestIds:
    """Request ids decided once per (operation, key, instance), kept for recent keys.

    A key is a checkpoint or restore id, or a digest of what a retire/forget names. The
    bound only has to cover the keys a retry can still name: the open checkpoint and
    the few before it whose release the pump may still retry.
    """

    def __init__(self, max_keys: int = 64) -> None:
        self._max_keys = max_keys
        self._ids: OrderedDict[str, dict[tuple[str, str], str]] = OrderedDict()

    def get(self, operation: str, key: str, instance: str) -> str:
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = {}
            while len(self._ids) > self._max_keys:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        request_id = ids.get((operation, instance))
        if request_id is None:
            request_id = ids[(operation, instance)] = new_request_id()
        return request_id


def _content_key(operation: str, items: Mapping[str, Sequence[object]]) -> str:
    """A stable key for a retire or forget: the same content gets the same request ids."""
    digest = hashlib.sha256()
    for instance in sorted(items):
        digest.update(f"{instance}:{','.join(sorted(map(str, items[instance])))};".encode())
    return f"{operation}-{digest.hexdigest()[:24]}"


def _episodes(
    messages: Iterable[types_pb2.EpisodeId], instance: str, operation: str
) -> tuple[EpisodeId, ...]:
    try:
        return tuple(EpisodeId(m.rollout_id, m.attempt) for m in messages)
    except InvalidIdError as error:
        raise MalformedReplyError(
            instance, operation, f"reply names a bad episode: {error}"
        ) from None


def _ready(response: pb.PrepareResponse) -> bool:
    return response.phase == types_pb2.PHASE_PREPARED


# ---------------------------------------------------------------- prepare machinery


class _Unacked:
    """Resolves the unacknowledged completions prepares report, each receipt once."""

    def __init__(self, resolve: UnackedResolver | None, metrics: CoordinatorMetrics | None) -> None:
        self._resolve = resolve
        self._metrics = metrics
        self._decisions: dict[str, asyncio.Future[UnackedDecision]] = {}
        self.retire: dict[str, set[EpisodeId]] = {}
        # Per instance, set once it holds a completion that must be retired: its prepare
        # cannot become ready before a resume, so waiting for it is pointless.
        self.hopeless: dict[str, asyncio.Event] = {}

    def hopeless_event(self, instance: str) -> asyncio.Event:
        return self.hopeless.setdefault(instance, asyncio.Event())

    async def handle(self, instance: str, readiness: types_pb2.ReadinessReport) -> None:
        for blocker in readiness.blockers:
            if blocker.state != types_pb2.EPISODE_STATE_COMPLETED_UNACKED:
                continue
            receipt = blocker.receipt
            if not receipt.receipt_id:
                raise MalformedReplyError(
                    instance, "Prepare", "an unacknowledged completion carries no receipt"
                )
            (episode,) = _episodes([receipt.episode], instance, "Prepare")
            decision = await self._decide(instance, episode, receipt.receipt_id)
            if decision == "retire":
                self.retire.setdefault(instance, set()).add(episode)
                self.hopeless_event(instance).set()

    async def _decide(self, instance: str, episode: EpisodeId, receipt_id: str) -> UnackedDecision:
        key = f"{instance}/{receipt_id}"
        pending = self._decisions.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        pending = asyncio.get_running_loop().create_future()
        self._decisions[key] = pending
        try:
            decision = await self._ask(instance, episode, receipt_id)
        except BaseException:
            # A later report of the same receipt asks again.
            del self._decisions[key]
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
class _Readiness:
    """The latest readiness a participant streamed, and a wake-up for its prepare."""

    changed: asyncio.Event = field(default_factory=asyncio.Event)
    available: bool = False
    # Set once this participant's prepare is over (ready or failed): no stream needed.
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class _PreparingParticipant:
    """One participant's side of a prepare, as a fan-out caller: rounds until ready.

    ``fan_out`` gives every participant the same deadline and cancels this call at it.
    """

    def __init__(
        self,
        *,
        instance: str,
        client: ControlCaller,
        deadline: float,
        round_timeout_s: float,
        readiness: _Readiness,
        unacked: _Unacked,
        on_answer: Callable[[str, pb.PrepareResponse], None],
    ) -> None:
        self._instance = instance
        self._client = client
        self._deadline = deadline
        self._round_timeout_s = round_timeout_s
        self._readiness = readiness
        self._unacked = unacked
        self._on_answer = on_answer

    async def call(self, request: ControlRequest, timeout_s: float) -> ControlResponse:
        try:
            return await self._call(request)
        finally:
            self._readiness.settled.set()

    async def _call(self, request: ControlRequest) -> ControlResponse:
        assert isinstance(request, pb.PrepareRequest)
        loop = asyncio.get_running_loop()
        hopeless = self._unacked.hopeless_event(self._instance)
        # A round shorter than this would only be answered "not ready" again: the
        # participant keeps a reply margin of its own before the round's deadline.
        min_round_s = min(_MIN_ROUND_S, _MIN_ROUND_FRACTION * self._round_timeout_s)
        backoff = _NOT_READY_BACKOFF_S
        broken = 0
        last: pb.PrepareResponse | None = None
        while True:
            left = self._deadline - loop.time()
            if hopeless.is_set() or left <= 0 or (last is not None and left < min_round_s):
                raise NotReadyError(
                    self._instance, request.checkpoint_id, last.readiness if last else None
                )
            self._readiness.changed.clear()
            started = loop.time()
            try:
                response = await self._round(request, min(self._round_timeout_s, left), hopeless)
            except SessionBrokenError:
                # The participant may be waiting on the old stream; the same request on a
                # new one joins that wait.
                broken += 1
                if broken <= _SESSION_RETRIES:
                    continue
                if last is None:
                    raise
                raise NotReadyError(self._instance, request.checkpoint_id, last.readiness) from None
            except (ControlCallError, TurnpointError) as error:
                if last is None or not classify(error).retryable:
                    raise
                # It did answer, not ready, before: that is the verdict to report.
                raise NotReadyError(
                    self._instance, request.checkpoint_id, last.readiness
                ) from error
            if response is None:
                continue  # hopeless: the top of the loop reports it
            assert isinstance(response, pb.PrepareResponse)
            last = response
            self._on_answer(self._instance, response)
            if _ready(response):
                return response
            await self._unacked.handle(self._instance, response.readiness)
            if hopeless.is_set():
                continue
            await self._wait_for_change(started, backoff, hopeless)
            backoff = min(backoff * 2, _NOT_READY_BACKOFF_MAX_S)

    async def _round(
        self, request: pb.PrepareRequest, timeout_s: float, hopeless: asyncio.Event
    ) -> ControlResponse | None:
        """One prepare call, abandoned (and cancelled) as soon as waiting is pointless."""
        calling = asyncio.ensure_future(self._client.call(request, timeout_s))
        giving_up = asyncio.ensure_future(hopeless.wait())
        try:
            await asyncio.wait({calling, giving_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            giving_up.cancel()
            if not calling.done():
                calling.cancel()
                await asyncio.gather(calling, return_exceptions=True)
        if calling.cancelled():
            return None
        return calling.result()

    async def _wait_for_change(
        self, started: float, backoff: float, hopeless: asyncio.Event
    ) -> None:
        loop = asyncio.get_running_loop()
        left = self._deadline - loop.time()
        if left <= 0:
            return
        waits = [asyncio.ensure_future(hopeless.wait())]
        if self._readiness.available:
            waits.append(asyncio.ensure_future(self._readiness.changed.wait()))
            timeout: float | None = left
        elif loop.time() - started < backoff:
            # It answered at once: do not spin on a participant that cannot wait itself.
            timeout = min(backoff, left)
        else:
            timeout = 0
        try:
            if timeout != 0:
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()


# ------------------------------------------------------------------------ renewals


class _Renewer:
    """Keeps the leases of one checkpoint (or restore) alive in the background."""

    def __init__(
        self, coordinator: Coordinator, checkpoint_id: str, instances: Iterable[str]
    ) -> None:
        self._coordinator = coordinator
        self._checkpoint_id = checkpoint_id
        self._instances = tuple(sorted(instances))
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failures: dict[str, Failure] = {}

    def start(self, *, renew_now: bool = False) -> None:
        if renew_now:
            self._kick.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"renew-{self._checkpoint_id}")

    def renew_now(self) -> None:
        self._kick.set()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        interval = self._coordinator.config.renew_interval_s
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), interval)
            self._kick.clear()
            result = await self._coordinator._renew_round(self._checkpoint_id, self._instances)
            for name in result.responses:
                self.failures.pop(name, None)
            self.failures.update(result.failures)


# --------------------------------------------------------------------- coordinator


class Coordinator:
    """Drives control operations on every participant of a training run.

    ``endpoints`` maps each participant instance name to its control address. ``token``
    is the bearer token sent with every call; ``channel_credentials`` enables TLS (and
    mutual TLS when they carry a client certificate). ``coordinator_id`` and ``epoch``
    come from :func:`bump_epoch` (the caller persists them).

    Call :meth:`discover` first: commit, restore and the resume order need each
    participant's kind. Close with :meth:`close` (or use ``async with``).
    """

    def __init__(
        self,
        endpoints: Mapping[str, str],
        *,
        token: str,
        coordinator_id: str,
        epoch: int,
        config: CoordinatorConfig,
        channel_credentials: grpc.ChannelCredentials | None = None,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a coordinator needs at least one participant endpoint")
        for name in endpoints:
            validate_id(name, "instance name")
        self.identity = CoordinatorIdentity(coordinator_id, epoch)
        self.config = config
        self.metrics = metrics
        self._fence = types_pb2.Fence(coordinator_id=coordinator_id, epoch=epoch)
        self._clients: dict[str, ParticipantControlClient] = {
            name: ParticipantControlClient(
                address,
                token=token,
                participant_name=name,
                channel_credentials=channel_credentials,
                reply_grace_s=config.reply_grace_s,
            )
            for name, address in sorted(endpoints.items())
        }
        self._request_ids = _RequestIds()
        self._topology: Topology | None = None
        self._restarts: dict[str, Mapping[str, frozenset[EpisodeId]]] = {}

    # -- basics ------------------------------------------------------------------------

    @property
    def instances(self) -> tuple[str, ...]:
        return tuple(self._clients)

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("call discover() before any operation that needs the topology")
        return self._topology

    @property
    def fence(self) -> types_pb2.Fence:
        return types_pb2.Fence(coordinator_id=self._fence.coordinator_id, epoch=self._fence.epoch)

    def request_id(self, operation: str, key: str, instance: str) -> str:
        """The request id of ``operation`` for ``key`` on ``instance`` (stable on retries)."""
        return self._request_ids.get(operation, key, instance)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    def _call_deadline(self) -> float:
        return self.config.control_timeout_s + self.config.reply_grace_s

    def _kind_label(self, instance: str) -> str:
        topology = self._topology
        if topology is None or instance not in topology.participants:
            return "unknown"
        return topology.kind(instance).value.lower()

    def _record(self, operation: str, result: FanoutResult[Any]) -> None:
        metrics = self.metrics
        for name, failure in result.failures.items():
            if failure.reason is not None and metrics is not None:
                metrics.refused(operation, failure.reason.name)
            if failure.reason is Reason.STALE_CHECKPOINT and operation in ("renew", "commit"):
                # The participant finished the checkpoint on its own: its lease ran out.
                if metrics is not None:
                    metrics.lease_expiries.inc()
                _LOG.warning(
                    "%s: %s found the checkpoint finished (lease expired?)", operation, name
                )
        if metrics is None:
            return
        for name, seconds in result.durations_s.items():
            failed = result.failures.get(name)
            outcome = "ok" if failed is None else failed.kind.value
            metrics.observe_call(operation, self._kind_label(name), outcome, seconds)

    async def _fan_out_once(
        self,
        operation: str,
        requests: Mapping[str, ControlRequest],
        *,
        attempts: int = 1,
        pause_s: float = 0.0,
    ) -> FanoutResult[Any]:
        clients = {name: self._clients[name] for name in requests}
        result: FanoutResult[Any] = await _retry_same_request(
            clients,
            requests,
            attempts=attempts,
            deadline_s=self._call_deadline(),
            per_call_timeout_s=self.config.control_timeout_s,
            concurrency=self.config.fanout_concurrency,
            pause_s=pause_s,
        )
        self._record(operation, result)
        return result

    def _checked(self, instances: Iterable[str] | None) -> tuple[str, ...]:
        if instances is None:
            return self.instances
        chosen = tuple(sorted(set(instances)))
        unknown = sorted(set(chosen) - set(self._clients))
        if unknown:
            raise ValueError(f"unknown participant instance(s): {', '.join(unknown)}")
        return chosen

    # -- describe ----------------------------------------------------------------------

    async def discover(self) -> Topology:
        """``Describe`` every participant; the result is kept as :attr:`topology`.

        Raises :class:`OperationFailed` if any participant cannot be described or its
        answer breaks the contract (unknown kind, another protocol version).
        """
        result = await fan_out(
            self._clients,
            lambda name: pb.DescribeRequest(fence=self.fence),
            deadline_s=self._call_deadline(),
            per_call_timeout_s=self.config.control_timeout_s,
            concurrency=self.config.fanout_concurrency,
        )
        failures = dict(result.failures)
        participants: dict[str, ParticipantInfo] = {}
        for name, response in result.responses.items():
            try:
                participants[name] = ParticipantInfo.from_proto(name, response)
            except MalformedReplyError as error:
                failures[name] = classify(error)
        self._record("describe", FanoutResult(result.responses, failures, result.durations_s))
        if failures:
            raise OperationFailed("describe", "topology", failures)
        self._topology = Topology(participants)
        return self._topology

    # -- prepare -----------------------------------------------------------------------

    def _prepare_request(
        self, checkpoint_id: str, instance: str, expected: Mapping[str, Iterable[EpisodeId]]
    ) -> pb.PrepareRequest:
        return pb.PrepareRequest(
            fence=self.fence,
            request_id=self.request_id("prepare", checkpoint_id, instance),
            checkpoint_id=checkpoint_id,
            lease=duration_from_seconds(self.config.lease_s),
            max_blockers=self.config.max_blockers_listed,
            expected_episodes=[episode_to_proto(e) for e in sorted(expected.get(instance, ()))],
        )

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        expected: Mapping[str, Iterable[EpisodeId]] | None = None,
        resolve: UnackedResolver | None = None,
    ) -> PreparedCheckpoint:
        """Prepare every participant under one deadline (``prepare_timeout_s``).

        ``expected`` is the scope hint per instance (the episodes the trainer believes
        each runs). ``resolve`` decides unacknowledged completions; without it they are
        treated as "retire". Raises :class:`PrepareFailed`; it never resumes: use
        :meth:`prepared`, which always does.
        """
        renewer = _Renewer(self, checkpoint_id, self.instances)
        renewer.start()
        try:
            return await self._prepare(checkpoint_id, expected or {}, resolve)
        finally:
            await renewer.stop()

    async def _prepare(
        self,
        checkpoint_id: str,
        expected: Mapping[str, Iterable[EpisodeId]],
        resolve: UnackedResolver | None,
    ) -> PreparedCheckpoint:
        validate_id(checkpoint_id, "checkpoint_id")
        loop = asyncio.get_running_loop()
        config = self.config
        deadline = loop.time() + config.prepare_timeout_s
        unacked = _Unacked(resolve, self.metrics)
        readiness = {name: _Readiness() for name in self._clients}
        not_ready_counted: set[str] = set()

        def on_answer(name: str, response: pb.PrepareResponse) -> None:
            if not _ready(response) and self.metrics is not None:
                self.metrics.prepare_not_ready.labels(self._kind_label(name)).inc()
                not_ready_counted.add(name)

        callers: dict[str, ControlCaller] = {
            name: _PreparingParticipant(
                instance=name,
                client=client,
                deadline=deadline,
                round_timeout_s=config.control_timeout_s,
                readiness=readiness[name],
                unacked=unacked,
                on_answer=on_answer,
            )
            for name, client in self._clients.items()
        }
        watches = [
            asyncio.create_task(
                self._watch_readiness(name, readiness[name], unacked), name=f"watch-{name}"
            )
            for name in self._clients
        ]
        try:
            result = await fan_out(
                callers,
                lambda name: self._prepare_request(checkpoint_id, name, expected),
                deadline_s=config.prepare_timeout_s + config.reply_grace_s,
                per_call_timeout_s=config.prepare_timeout_s + config.reply_grace_s,
                # Every participant waits for its own work at once: a concurrency limit
                # would leave some unprepared until others are ready.
                concurrency=max(1, len(callers)),
            )
        finally:
            for watch in watches:
                watch.cancel()
            ended = await asyncio.gather(*watches, return_exceptions=True)
            for name, outcome in zip(self._clients, ended, strict=True):
                if isinstance(outcome, Exception):
                    # Resolving a completion it reported failed; the prepare rounds ask
                    # again and fail the prepare if it keeps failing.
                    _LOG.warning("readiness watch of %s failed: %r", name, outcome)
        self._record("prepare", result)
        retire = {name: tuple(sorted(episodes)) for name, episodes in unacked.retire.items()}
        if result.failures:
            raise PrepareFailed(checkpoint_id, result.failures, retire)
        responses: Mapping[str, pb.PrepareResponse] = result.responses
        restarts = {
            name: tuple(sorted(set(_episodes(r.readiness.restarts, name, "Prepare"))))
            for name, r in responses.items()
        }
        self._restarts[checkpoint_id] = {name: frozenset(e) for name, e in restarts.items()}
        while len(self._restarts) > 8:
            del self._restarts[next(iter(self._restarts))]
        return PreparedCheckpoint(
            checkpoint_id=checkpoint_id,
            readiness=MappingProxyType({name: r.readiness for name, r in responses.items()}),
            restarts=MappingProxyType(restarts),
            durations_s=result.durations_s,
        )

    def _watch_after_s(self) -> float:
        return min(_WATCH_AFTER_S, self.config.prepare_timeout_s / 10)

    async def _watch_readiness(self, instance: str, state: _Readiness, unacked: _Unacked) -> None:
        """Follow one participant's readiness stream during a prepare; best effort.

        Opened only for a participant still preparing after a short while: most are
        ready within milliseconds and never cost a stream.
        """
        with suppress(TimeoutError):
            await asyncio.wait_for(state.settled.wait(), self._watch_after_s())
        if state.settled.is_set():
            return
        request = pb.WatchBoundariesRequest(
            fence=self.fence, max_blockers=self.config.max_blockers_listed
        )
        timeout_s = self.config.prepare_timeout_s + self.config.reply_grace_s
        try:
            async with self._clients[instance].watch_boundaries(
                request, timeout_s=timeout_s
            ) as watch:
                async for message in watch:
                    state.available = True
                    if message.WhichOneof("event") != "readiness":
                        continue
                    state.changed.set()
                    if message.phase in (types_pb2.PHASE_PREPARING, types_pb2.PHASE_PREPARED):
                        await unacked.handle(instance, message.readiness)
        except (ControlCallError, TurnpointError, grpc.RpcError) as error:
            # Without the stream the prepare rounds still converge; they only react later.
            _LOG.debug("readiness watch of %s ended: %s", instance, error)
        finally:
            state.available = False
            # A prepare waiting on this stream must not wait for a change it cannot see.
            state.changed.set()

    @asynccontextmanager
    async def prepared(
        self,
        checkpoint_id: str,
        *,
        expected: Mapping[str, Iterable[EpisodeId]] | None = None,
        resolve: UnackedResolver | None = None,
    ) -> AsyncIterator[PreparedCheckpoint]:
        """Prepare everywhere, keep the leases alive, and always resume the same id.

        The resume on exit goes to every participant, the ready ones included, whether
        the prepare or the body failed or not. After a failure the original error is
        raised whatever the resume does (its report is attached: ``error.release`` for a
        :class:`PrepareFailed`, else the yielded object's ``release``). After a body
        that succeeded a resume that still fails is reported in ``release``, not raised:
        the snapshot is published and each participant's lease reopens it anyway.
        """
        try:
            checkpoint = await self.prepare(checkpoint_id, expected=expected, resolve=resolve)
        except BaseException as error:
            report = await self.resume(checkpoint_id)
            if isinstance(error, PrepareFailed):
                error.release = report
            if not report.ok:
                _LOG.warning(
                    "aborting %s: %s",
                    checkpoint_id,
                    OperationFailed("resume", checkpoint_id, report.failures),
                )
            raise
        async with self.held(checkpoint):
            yield checkpoint

    @asynccontextmanager
    async def held(self, checkpoint: PreparedCheckpoint) -> AsyncIterator[PreparedCheckpoint]:
        """Hold a prepared checkpoint for the body: renew every lease in the background
        (once at once, then every ``renew_interval_s``) and resume the same id everywhere
        on exit, whatever happens. The resume's report lands in ``checkpoint.release``;
        a body error propagates unchanged, a failed resume after a body that succeeded is
        logged, not raised.
        """
        checkpoint_id = checkpoint.checkpoint_id
        renewer = _Renewer(self, checkpoint_id, self.instances)
        # Once right after prepare: a participant prepared early has waited for the
        # others, and commit may be slow.
        renewer.start(renew_now=True)
        try:
            yield checkpoint
        finally:
            await renewer.stop()
            checkpoint.renew_failures.update(renewer.failures)
            checkpoint.release = await self.resume(checkpoint_id)
        if not checkpoint.release.ok:
            _LOG.warning(
                "releasing %s failed; the pump retries it and each lease reopens its participant: %s",
                checkpoint_id,
                OperationFailed("resume", checkpoint_id, checkpoint.release.failures),
            )

    # -- renew -------------------------------------------------------------------------

    async def _renew_round(self, checkpoint_id: str, instances: Sequence[str]) -> FanoutResult[Any]:
        # Abandoned before the next renewal is due, so a hung renew delays nothing.
        window = min(self.config.control_timeout_s, self.config.renew_interval_s)
        requests = {
            name: pb.RenewRequest(
                fence=self.fence,
                request_id=self.request_id("renew", checkpoint_id, name),
                checkpoint_id=checkpoint_id,
                lease=duration_from_seconds(self.config.lease_s),
            )
            for name in instances
        }
        result = await fan_out(
            {name: self._clients[name] for name in instances},
            requests.__getitem__,
            deadline_s=window,
            per_call_timeout_s=window,
            concurrency=self.config.fanout_concurrency,
        )
        self._record("renew", result)
        return result

    async def renew(
        self, checkpoint_id: str, instances: Iterable[str] | None = None
    ) -> ControlReport:
        """Extend the lease of ``checkpoint_id`` on every (or the given) participant."""
        chosen = self._checked(instances)
        result = await self._renew_round(checkpoint_id, chosen)
        return ControlReport(
            "renew",
            checkpoint_id,
            frozenset(result.responses),
            result.failures,
            result.durations_s,
        )

    # -- commit ------------------------------------------------------------------------

    async def commit(
        self,
        checkpoint_id: str,
        snapshot: str,
        scope: Mapping[str, Iterable[EpisodeId]],
    ) -> dict[str, ParticipantEntry]:
        """Commit every participant into ``<root>/<snapshot>/<instance>/``.

        ``scope`` gives each instance the episodes the trainer continues (an instance
        left out gets an empty scope); it must not name an episode the instance reported
        as a restart in this checkpoint's prepare. Each reply is validated: the exported
        episodes lie within the scope and every artifact reference is well formed and
        lies under the instance's directory. Returns the manifest entry per instance;
        raises :class:`CommitFailed`.
        """
        validate_id(snapshot, "snapshot")
        topology = self.topology
        scopes = {name: frozenset(scope.get(name, ())) for name in self._clients}
        unknown = sorted(set(scope) - set(self._clients))
        if unknown:
            raise ValueError(f"commit scope names unknown instance(s): {', '.join(unknown)}")
        reported = self._restarts.get(checkpoint_id, {})
        for name, episodes in scopes.items():
            clash = sorted(episodes & reported.get(name, frozenset()))
            if clash:
                raise ValueError(
                    f"commit scope of {name} names {len(clash)} episode(s) it reported as "
                    f"restarts, e.g. {clash[0]}: leave restarts out of the scope"
                )
        requests = {
            name: pb.CommitRequest(
                fence=self.fence,
                request_id=self.request_id("commit", checkpoint_id, name),
                checkpoint_id=checkpoint_id,
                snapshot=snapshot,
                scope=[episode_to_proto(e) for e in sorted(episodes)],
            )
            for name, episodes in scopes.items()
        }
        result = await self._fan_out_once("commit", requests, attempts=_JOINING_ATTEMPTS)
        failures = dict(result.failures)
        entries: dict[str, ParticipantEntry] = {}
        for name, response in result.responses.items():
            try:
                entries[name] = self._entry_from_commit(
                    name, topology.kind(name), response, scopes[name]
                )
            except MalformedReplyError as error:
                failures[name] = classify(error)
        if failures:
            raise CommitFailed(checkpoint_id, failures)
        return entries

    @staticmethod
    def _entry_from_commit(
        instance: str,
        kind: ParticipantKind,
        response: pb.CommitResponse,
        scope: frozenset[EpisodeId],
    ) -> ParticipantEntry:
        exported = _episodes(response.exported, instance, "Commit")
        outside = sorted(set(exported) - scope)
        if outside:
            raise MalformedReplyError(
                instance,
                "Commit",
                f"exported {len(outside)} episode(s) outside the scope, e.g. {outside[0]}",
            )
        try:
            artifacts = tuple(
                ArtifactRef(a.path, a.sha256, a.size_bytes, a.record_count)
                for a in response.artifacts
            )
            manifest = (
                ArtifactRef(
                    response.manifest.path,
                    response.manifest.sha256,
                    response.manifest.size_bytes,
                    response.manifest.record_count,
                )
                if response.HasField("manifest")
                else None
            )
            return ParticipantEntry(
                instance=instance,
                kind=kind,
                artifacts=artifacts,
                manifest=manifest,
                exported=exported,
                incarnation=response.header.incarnation,
            )
        except ManifestError as error:
            raise MalformedReplyError(instance, "Commit", error.message) from None

    # -- resume ------------------------------------------------------------------------

    def _resume_groups(self, instances: Sequence[str]) -> list[tuple[str, ...]]:
        topology = self._topology
        if topology is None:
            return [tuple(instances)]
        groups: list[tuple[str, ...]] = []
        placed: set[str] = set()
        for kinds in _RESUME_ORDER:
            group = tuple(
                n for n in instances if n in topology.participants and topology.kind(n) in kinds
            )
            placed.update(group)
            groups.append(group)
        # Not described (yet): reopened last, with the agents.
        groups[-1] = groups[-1] + tuple(n for n in instances if n not in placed)
        return [group for group in groups if group]

    async def resume(
        self, checkpoint_id: str, instances: Iterable[str] | None = None
    ) -> ControlReport:
        """Resume (also: abort) ``checkpoint_id``: resources, then models, then agents.

        Each kind is retried ``resume_attempts`` times on transient failures, with the
        same request ids. Never raises for a participant's failure: the report says who
        is still closed (each participant's lease reopens it anyway).
        """
        chosen = self._checked(instances)
        reports = []
        for group in self._resume_groups(chosen):
            requests = {
                name: pb.ResumeRequest(
                    fence=self.fence,
                    request_id=self.request_id("resume", checkpoint_id, name),
                    checkpoint_id=checkpoint_id,
                )
                for name in group
            }
            result = await self._fan_out_once(
                "resume",
                requests,
                attempts=self.config.resume_attempts,
                pause_s=self.config.resume_retry_pause_s,
            )
            reports.append(
                ControlReport(
                    "resume",
                    checkpoint_id,
                    frozenset(result.responses),
                    result.failures,
                    result.durations_s,
                )
            )
        return ControlReport.merge("resume", checkpoint_id, reports)

    # -- retire / forget ---------------------------------------------------------------

    async def retire(
        self, episodes: Mapping[str, Iterable[EpisodeId]], *, key: str | None = None
    ) -> ControlReport:
        """Retire attempts per instance; only while the participants are idle or restored.

        Each reply comes only after the attempts stopped and their state is freed.
        ``key`` (a restore id, say) names the request ids; by default they derive from
        the content, so retrying the same retire re-sends the same ids.
        """
        chosen = {name: tuple(sorted(set(e))) for name, e in episodes.items()}
        chosen = {name: e for name, e in chosen.items() if e}
        self._checked(chosen)
        if not chosen:
            return ControlReport("retire", key or "nothing", frozenset(), {})
        key = key or _content_key("retire", chosen)
        requests = {
            name: pb.RetireRequest(
                fence=self.fence,
                request_id=self.request_id("retire", key, name),
                episodes=[episode_to_proto(e) for e in items],
            )
            for name, items in chosen.items()
        }
        result = await self._fan_out_once("retire", requests, attempts=_JOINING_ATTEMPTS)
        return ControlReport(
            "retire", key, frozenset(result.responses), result.failures, result.durations_s
        )

    async def forget(self, rollout_ids: Mapping[str, Iterable[str]]) -> ControlReport:
        """Drop the refusal marks of retired rollouts, per instance, once nothing of them
        can arrive any more."""
        chosen = {name: tuple(sorted(set(ids))) for name, ids in rollout_ids.items()}
        chosen = {name: ids for name, ids in chosen.items() if ids}
        self._checked(chosen)
        if not chosen:
            return ControlReport("forget", "nothing", frozenset(), {})
        key = _content_key("forget", chosen)
        requests = {
            name: pb.ForgetRequest(
                fence=self.fence,
                request_id=self.request_id("forget", key, name),
                rollout_ids=list(ids),
            )
            for name, ids in chosen.items()
        }
        result = await self._fan_out_once("forget", requests, attempts=_JOINING_ATTEMPTS)
        return ControlReport(
            "forget", key, frozenset(result.responses), result.failures, result.durations_s
        )

    # -- restore -----------------------------------------------------------------------

    async def restore(
        self,
        restore_id: str,
        snapshot: str,
        manifest: SnapshotManifest,
        scope: Mapping[str, Iterable[EpisodeId]],
    ) -> dict[str, tuple[EpisodeId, ...]]:
        """Restore every participant from ``<root>/<snapshot>/`` as ``manifest`` describes.

        ``scope`` gives each instance the saved episodes (attempt N) to continue; each
        must install exactly their attempt N+1 and stay closed until :meth:`resume`.
        Raises :class:`RestoreFailed` (nothing cleaned up; :meth:`restored` does that).
        """
        validate_id(restore_id, "restore_id")
        validate_id(snapshot, "snapshot")
        self.topology.check_manifest(manifest)
        unknown = sorted(set(scope) - set(self._clients))
        if unknown:
            raise ValueError(f"restore scope names unknown instance(s): {', '.join(unknown)}")
        scopes = {name: tuple(sorted(set(scope.get(name, ())))) for name in self._clients}
        requests = {
            name: pb.RestoreRequest(
                fence=self.fence,
                request_id=self.request_id("restore", restore_id, name),
                restore_id=restore_id,
                snapshot=snapshot,
                entry=_manifest_entry(manifest.participant(name)),
                scope=[episode_to_proto(e) for e in episodes],
                lease=duration_from_seconds(self.config.lease_s),
            )
            for name, episodes in scopes.items()
        }
        result = await self._fan_out_once("restore", requests, attempts=_JOINING_ATTEMPTS)
        failures = dict(result.failures)
        installed: dict[str, tuple[EpisodeId, ...]] = {}
        for name, response in result.responses.items():
            try:
                installed[name] = _check_installed(name, response, scopes[name])
            except MalformedReplyError as error:
                failures[name] = classify(error)
        if failures:
            replacements = {e.next_attempt() for episodes in scopes.values() for e in episodes}
            raise RestoreFailed(restore_id, failures, replacements)
        return installed

    async def _discard_restore(
        self, restore_id: str, replacements: Sequence[EpisodeId]
    ) -> dict[str, Failure]:
        """Retire the replacement attempts everywhere, then resume everywhere."""
        failures: dict[str, Failure] = {}
        if replacements:
            retired = await self.retire(
                {name: replacements for name in self._clients}, key=f"{restore_id}-discard"
            )
            failures.update(retired.failures)
        resumed = await self.resume(restore_id)
        for name, failure in resumed.failures.items():
            failures.setdefault(name, failure)
        if failures:
            _LOG.warning(
                "cleaning up restore %s left %d participant(s) to their leases: %s",
                restore_id,
                len(failures),
                OperationFailed("cleanup", restore_id, failures),
            )
        return failures

    @asynccontextmanager
    async def restored(
        self,
        restore_id: str,
        snapshot: str,
        manifest: SnapshotManifest,
        scope: Mapping[str, Iterable[EpisodeId]],
    ) -> AsyncIterator[RestoredCheckpoint]:
        """Restore everywhere for the body, then always reopen every participant once.

        A restore that fails on ANY participant has an uncertain outcome on all of them:
        the replacement attempts (N+1) are retired everywhere, every participant is
        resumed, and :class:`RestoreFailed` tells the caller to start those rollouts over
        from their prompts. A body that fails could not take the restored attempts
        over: they are retired everywhere before the participants reopen, and the body's
        error propagates.
        """
        replacements = tuple(
            sorted({e.next_attempt() for episodes in scope.values() for e in episodes})
        )
        renewer = _Renewer(self, restore_id, self.instances)
        renewer.start()
        try:
            installed = await self.restore(restore_id, snapshot, manifest, scope)
        except RestoreFailed as error:
            await renewer.stop()
            cleanup = await self._discard_restore(restore_id, replacements)
            raise RestoreFailed(restore_id, error.failures, replacements, cleanup) from error
        except BaseException:
            await renewer.stop()
            await self._discard_restore(restore_id, replacements)
            raise
        restored = RestoredCheckpoint(restore_id, MappingProxyType(installed))
        try:
            yield restored
        except BaseException:
            await renewer.stop()
            await self._discard_restore(restore_id, replacements)
            raise
        await renewer.stop()
        restored.release = await self.resume(restore_id)


def _manifest_entry(entry: ParticipantEntry) -> pb.ManifestEntry:
    def ref(artifact: ArtifactRef) -> types_pb2.ArtifactRef:
        return types_pb2.ArtifactRef(
            path=artifact.path,
            sha256=artifact.sha256,
            size_bytes=artifact.size_bytes,
            record_count=artifact.record_count,
        )

    message = pb.ManifestEntry(artifacts=[ref(a) for a in entry.artifacts])
    if entry.manifest is not None:
        message.manifest.CopyFrom(ref(entry.manifest))
    return message


def _check_installed(
    instance: str, response: pb.RestoreResponse, scope: Sequence[EpisodeId]
) -> tuple[EpisodeId, ...]:
    installed = _episodes(response.installed, instance, "Restore")
    wanted = {episode.next_attempt() for episode in scope}
    if set(installed) != wanted or len(installed) != len(wanted):
        missing = sorted(wanted - set(installed))
        extra = sorted(set(installed) - wanted)
        raise MalformedReplyError(
            instance,
            "Restore",
            f"installed does not match the scope (missing {[str(e) for e in missing[:3]]}, "
            f"unexpected {[str(e) for e in extra[:3]]})",
        )
    if response.phase != types_pb2.PHASE_RESTORED:
        raise MalformedReplyError(
            instance, "Restore", f"restore answered phase {types_pb2.Phase.Name(response.phase)}"
        )
    return tuple(sorted(installed))
