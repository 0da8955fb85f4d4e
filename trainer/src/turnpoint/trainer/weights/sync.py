"""The trainer's weight sync: a new policy version onto every policy server.

docs/spec.md section 6.11. :class:`WeightSync` sends ``UpdateWeights`` to every policy
model server of the topology at once, each with the one request id of (epoch, version,
server) (:func:`~._weight_sync_core.weights_request_id`), so that a retry after a lost
reply is answered from the server's record and never installs twice (section 5.4 item
4). Transient failures (a lost reply, a broken connection, a deadline, a transient
protocol reason) are retried with backoff within the bounds of
:class:`~._weight_sync_core.WeightSyncSettings`; they are told from refusals by
:func:`~._control_failures.classify`, from reasons and gRPC codes only. A server whose
push fails for good raises :class:`~._weight_sync_core.WeightSyncError` naming it and
its last status. Rollout deadlines are held while a push runs: a model that swaps
weights only once its own generations ended parks the rollouts that wait on it.

The decisions live in :mod:`._weight_sync_core`; this module only calls and sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import grpc

from turnpoint._keepalive import LOCAL_SUBCHANNEL_POOL, data_channel
from turnpoint.auth import auth_metadata
from turnpoint.errors import Reason, TurnpointError
from turnpoint.trainer.control.failures import FailureKind, classify
from turnpoint.trainer.rollouts.deadlines import Hold
from turnpoint.trainer.storage.manifest import JSONValue
from turnpoint.trainer.weights.core import (
    WeightSyncError,
    WeightSyncSettings,
    call_timeout_s,
    decide_retry,
    give_up_reason,
    installed_version_refused,
    restored_push_version,
    weights_extra,
    weights_request_id,
    weights_version_of,
)
from turnpoint.v1 import policy_service_pb2, policy_service_pb2_grpc

if TYPE_CHECKING:
    from turnpoint.trainer.restore.restorer import RestorePlan

_LOG = logging.getLogger(__name__)


class DeadlineHolder(Protocol):
    """What a push needs of the rollout side: holding the rollouts' budgets."""

    def hold_deadlines(self, name: str) -> Hold: ...

    def release_deadlines(self, hold: Hold) -> None: ...


class _Malformed(Exception):
    """A reply that breaks the contract (another server's header, another version)."""


@dataclass(frozen=True, slots=True)
class WeightSyncReport:
    """One finished push: the version every policy server now holds, and per server how
    many attempts it took."""

    version: int
    attempts: Mapping[str, int]

    @property
    def retried(self) -> int:
        """Attempts beyond the first, over all servers."""
        return sum(count - 1 for count in self.attempts.values())


class WeightSync:
    """Pushes policy weights to ``servers`` (instance -> data-plane address).

    ``epoch`` is the coordinator's (each start pushes under new request ids);
    ``rollouts``, if given, has its deadlines held during each push. ``clock`` and
    ``sleep`` are for tests. Pushes run one at a time, in the order they are called.
    """

    def __init__(
        self,
        servers: Mapping[str, str],
        *,
        token: str | None,
        epoch: int,
        settings: WeightSyncSettings | None = None,
        rollouts: DeadlineHolder | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"epoch must be an integer >= 1, got {epoch!r}")
        self._servers = dict(sorted(servers.items()))
        self._metadata = auth_metadata(token) if token is not None else ()
        self._epoch = epoch
        self._settings = settings or WeightSyncSettings()
        self._rollouts = rollouts
        self._credentials = credentials
        self._clock = clock
        self._sleep = sleep
        self._lock = asyncio.Lock()
        self._version: int | None = None
        self._installed: dict[str, int] = {}

    @property
    def servers(self) -> Mapping[str, str]:
        return MappingProxyType(self._servers)

    @property
    def version(self) -> int | None:
        """The version of the trainer's current weights: the newest one handed to
        :meth:`push` (or :meth:`adopt`), installed everywhere or still being pushed.
        ``None`` before any. This is what a snapshot records."""
        return self._version

    @property
    def installed(self) -> Mapping[str, int]:
        """Per server, the newest version it acknowledged."""
        return MappingProxyType(self._installed)

    def replace_server(self, instance: str, address: str) -> None:
        """Push to ``address`` for ``instance`` from now on: the replacement of a lost
        policy server (docs/spec.md section 7.15), which holds no version yet."""
        if instance not in self._servers:
            raise ValueError(f"unknown policy server {instance!r}")
        self._servers[instance] = address
        self._installed.pop(instance, None)

    def adopt(self, version: int) -> None:
        """Take ``version`` as the trainer's current weights without pushing them (a
        restored snapshot's); a later :meth:`push` must not go below it."""
        self._version = _check_version(version)

    def adopt_restore(self, plan: RestorePlan | None) -> int | None:
        """Adopt the weights version a restored snapshot recorded (see :meth:`adopt`);
        returns it, or ``None`` for a fresh start or a snapshot that recorded none."""
        if plan is None:
            return None
        version = weights_version_of(plan.extra, plan.checkpoint_id)
        if version is not None:
            self.adopt(version)
        return version

    def snapshot_extra(self) -> dict[str, JSONValue]:
        """What a snapshot records of the weights (the manifest's ``extra``, docs/spec.md
        section 8.6): the current :attr:`version`. Give it to
        :class:`~turnpoint.trainer.SnapshotDriver` as ``manifest_extra``."""
        return dict(weights_extra(self._version))

    def declare(self, version: int) -> None:
        """Name the version of the weights the trainer holds now, ahead of its push
        (so that a snapshot taken before the push records it). Never goes down."""
        version = _check_version(version)
        if self._version is not None and version < self._version:
            raise ValueError(
                f"weights version {version} is below the current version {self._version}"
            )
        self._version = version

    async def push(self, version: int, state: bytes) -> WeightSyncReport:
        """Install ``state`` as ``version`` on every policy server; return once all
        acknowledged it. Raises :class:`WeightSyncError` (after the others finished)
        if one server's push fails for good."""
        self.declare(version)
        return self._report(version, await self._push_all(version, state))

    async def push_restored(self, state: bytes) -> WeightSyncReport:
        """Push a restored trainer's weights ``state`` at its current :attr:`version`
        (the snapshot's, :meth:`adopt_restore`) to every policy server.

        A server that kept running through the trainer's restart may hold a newer
        version, pushed by the incarnation that died after the snapshot, and refuses the
        lower one (docs/spec.md section 5.4 item 4). The restored weights are then pushed
        once more, to every server, at one above the newest version refused at
        (:func:`restored_push_version`, section 6.11 item 6); that version becomes the
        trainer's, so later pushes go above it. Any other failure raises as
        :meth:`push` does.
        """
        restored = self._version
        if restored is None:
            raise ValueError("push_restored needs a version: adopt or declare one first")
        outcomes = await self._push_all(restored, state)
        refused = {
            name: outcome.installed_version
            for name, outcome in outcomes.items()
            if isinstance(outcome, WeightSyncError) and outcome.installed_version is not None
        }
        if not refused:
            return self._report(restored, outcomes)
        for name, outcome in outcomes.items():
            if isinstance(outcome, BaseException) and name not in refused:
                raise outcome
        version = restored_push_version(restored, refused.values())
        _LOG.info(
            "policy servers hold newer weights than the restored version %d (%s); "
            "pushing the restored weights at %d",
            restored,
            ", ".join(f"{name}: {held}" for name, held in sorted(refused.items())),
            version,
        )
        return await self.push(version, state)

    async def _push_all(self, version: int, state: bytes) -> dict[str, int | BaseException]:
        """Push ``version`` to every server at once: per server, the attempts its push
        took or the error it failed with."""
        async with self._lock:
            hold = (
                self._rollouts.hold_deadlines(f"weight sync {version}")
                if self._rollouts is not None
                else None
            )
            try:
                outcomes = await asyncio.gather(
                    *(
                        self._push_one(name, address, version, state)
                        for name, address in self._servers.items()
                    ),
                    return_exceptions=True,
                )
            finally:
                if hold is not None and self._rollouts is not None:
                    self._rollouts.release_deadlines(hold)
        return dict(zip(self._servers, outcomes, strict=True))

    def _report(
        self, version: int, outcomes: Mapping[str, int | BaseException]
    ) -> WeightSyncReport:
        attempts: dict[str, int] = {}
        for name, outcome in outcomes.items():
            if isinstance(outcome, BaseException):
                raise outcome
            attempts[name] = outcome
            self._installed[name] = version
        return WeightSyncReport(version, MappingProxyType(attempts))

    async def _push_one(self, instance: str, address: str, version: int, state: bytes) -> int:
        """Push to one server until it acknowledges; the number of attempts it took."""
        settings = self._settings
        request = policy_service_pb2.UpdateWeightsRequest(
            request_id=weights_request_id(self._epoch, version, instance),
            weights_version=version,
            state=state,
        )
        started = self._clock()
        attempts = 0
        while True:
            attempts += 1
            timeout = call_timeout_s(settings, started_at=started, now=self._clock())
            try:
                await self._call(instance, address, request, timeout)
                return attempts
            except (grpc.RpcError, _Malformed) as error:
                installed: int | None = None
                if isinstance(error, _Malformed):
                    reason: Reason | None = Reason.PROTOCOL_VIOLATION
                    code_name: str | None = None
                    transient = False
                    detail = str(error)
                else:
                    failure = classify(error)
                    reason = failure.reason
                    code_name = failure.code.name if failure.code is not None else None
                    transient = failure.kind is FailureKind.TRANSIENT
                    detail = failure.detail
                    if isinstance(failure.error, TurnpointError):
                        installed = installed_version_refused(reason, failure.error.metadata)
                decision = decide_retry(
                    settings,
                    attempts_made=attempts,
                    started_at=started,
                    now=self._clock(),
                    transient=transient,
                )
                status = _status_text(code_name, reason)
                if not decision.retry:
                    raise WeightSyncError(
                        give_up_reason(reason, code_name, transient),
                        instance=instance,
                        version=version,
                        attempts=attempts,
                        status=status,
                        detail=f"{detail} ({decision.reason})",
                        installed_version=installed,
                    ) from error
                _LOG.info(
                    "UpdateWeights %d on %s failed (%s: %s); %s",
                    version,
                    instance,
                    status,
                    detail,
                    decision.reason,
                )
                await self._sleep(decision.pause_s)

    async def _call(
        self,
        instance: str,
        address: str,
        request: policy_service_pb2.UpdateWeightsRequest,
        timeout_s: float,
    ) -> None:
        # A connection of its own per attempt: one the network just cut would otherwise
        # stay in reconnect backoff and fail the retry at once.
        channel = data_channel(
            address, credentials=self._credentials, extra_options=(LOCAL_SUBCHANNEL_POOL,)
        )
        try:
            stub = policy_service_pb2_grpc.PolicyServiceStub(channel)
            response = await stub.UpdateWeights(request, metadata=self._metadata, timeout=timeout_s)
        finally:
            await channel.close(None)
        if not response.HasField("header") or response.header.participant_id != instance:
            raise _Malformed(
                f"reply comes from {response.header.participant_id!r}, not {instance!r}"
            )
        if response.weights_version != request.weights_version:
            raise _Malformed(
                f"reply says version {response.weights_version} is installed, "
                f"not {request.weights_version}"
            )


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weights version must be an integer >= 0, got {version!r}")
    return version


def _status_text(code_name: str | None, reason: Reason | None) -> str:
    code = code_name or "no status"
    return f"{code} ({reason.name})" if reason is not None else code
