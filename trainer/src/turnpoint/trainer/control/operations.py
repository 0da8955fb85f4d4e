"""The coordinator's control plumbing, and the operations every flow shares.

docs/spec.md sections 2.8, 4 and 7.3. :class:`ControlOperations` holds one
:class:`~turnpoint.trainer.control.client.ParticipantControlClient` per participant
instance and turns each protocol operation into one bounded fan-out:

- every request carries the coordinator's Fence (id and epoch) and a request id decided
  once per (operation, checkpoint, instance): a retry, by this coordinator or by the
  snapshot pump on its next tick, sends the very same id, so a participant that acted
  on a request whose reply was lost replays or joins instead of acting twice;
- every fan-out has a deadline (the operation's timeout plus the reply grace) and calls
  still running at it are cancelled (:func:`~turnpoint.trainer.control.fanout.fan_out`);
- every failure is classified (:func:`~turnpoint.trainer.control.client.classify`):
  retryable when it is not-ready or every failing instance failed with an infrastructure
  error, an invariant break otherwise (docs/spec.md section 7.5).

The operations here (renew, resume, retire, forget) report failures instead of raising
them. :class:`Renewer` keeps the leases of an open checkpoint or restore alive in the
background while anything is slow, on the schedule
:class:`~turnpoint.trainer.snapshots.core.RenewalSchedule` decides; a renew that
hangs is abandoned before the next one is due and never holds up the checkpoint.
:mod:`turnpoint.trainer.control.restore_operations` adds restore, :mod:`turnpoint.trainer.control.coordinator` discovery, prepare and commit.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from types import MappingProxyType, TracebackType
from typing import Any, Final, Self

import grpc

from turnpoint._convert import duration_from_seconds, episode_to_proto
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId, InvalidIdError, validate_id
from turnpoint.protocol import ParticipantKind
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.control.client import (
    ControlRequest,
    ParticipantControlClient,
    new_request_id,
)
from turnpoint.trainer.control.failures import Failure, MalformedReplyError
from turnpoint.trainer.control.fanout import FanoutResult, fan_out
from turnpoint.trainer.control.fanout import retry_same_request as _retry_same_request
from turnpoint.trainer.control.identity import CoordinatorIdentity
from turnpoint.trainer.control.outcomes import ControlReport
from turnpoint.trainer.control.topology import Topology
from turnpoint.trainer.metrics import CoordinatorMetrics
from turnpoint.trainer.snapshots.core import RenewalSchedule
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

_LOG = logging.getLogger(__name__)

JOINING_ATTEMPTS: Final = 2
"""A commit, retire or restore that ran out of time keeps working on the participant; one
retry with the same request joins that work (docs/spec.md section 4.3) instead of giving
up."""
JOINING_RETRY_PAUSE_S: Final = 0.25
"""The pause before that retry (docs/spec.md section 7.3 item 3): a failure that broke the
connection would otherwise be retried at once on the connection still being torn down."""
# Resume order (docs/spec.md section 7.4 step 8): what rollouts depend on reopens first.
# Checkpoints whose released participants are remembered (a resume of an older one
# is sent to everyone named, which is harmless: resuming is idempotent).
_RELEASED_REMEMBERED: Final = 8
_RESUME_ORDER: Final = (
    (ParticipantKind.RESOURCES,),
    (ParticipantKind.MODEL,),
    (ParticipantKind.AGENT, ParticipantKind.ENVIRONMENT),
)


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


def content_key(operation: str, items: Mapping[str, Sequence[object]]) -> str:
    """A stable key for a retire or forget: the same content gets the same request ids."""
    digest = hashlib.sha256()
    for instance in sorted(items):
        digest.update(f"{instance}:{','.join(sorted(map(str, items[instance])))};".encode())
    return f"{operation}-{digest.hexdigest()[:24]}"


def episodes_of(
    messages: Iterable[types_pb2.EpisodeId], instance: str, operation: str
) -> tuple[EpisodeId, ...]:
    try:
        return tuple(EpisodeId(m.rollout_id, m.attempt) for m in messages)
    except InvalidIdError as error:
        raise MalformedReplyError(
            instance, operation, f"reply names a bad episode: {error}"
        ) from None


class Renewer:
    """Keeps the leases of one checkpoint (or restore) alive in the background."""

    def __init__(
        self, operations: ControlOperations, checkpoint_id: str, instances: Iterable[str]
    ) -> None:
        self._operations = operations
        self._checkpoint_id = checkpoint_id
        self._instances = tuple(sorted(instances))
        self._kick = asyncio.Event()
        self._schedule: RenewalSchedule | None = None
        self._task: asyncio.Task[None] | None = None
        self.failures: dict[str, Failure] = {}

    def start(self, *, renew_now: bool = False) -> None:
        config = self._operations.config
        self._schedule = RenewalSchedule(
            interval_s=config.renew_interval_s,
            control_timeout_s=config.control_timeout_s,
            now=asyncio.get_running_loop().time(),
            renew_now=renew_now,
        )
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"renew-{self._checkpoint_id}")

    def renew_now(self) -> None:
        if self._schedule is not None:
            self._schedule.renew_now()
        self._kick.set()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        schedule = self._schedule
        assert schedule is not None
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), schedule.wait_s(loop.time()))
            self._kick.clear()
            if not schedule.due(loop.time()):
                continue
            # Who ended the checkpoint in its commit holds no lease any more.
            released = self._operations.released(self._checkpoint_id)
            result = await self._operations.renew_round(
                self._checkpoint_id,
                tuple(n for n in self._instances if n not in released),
                schedule.window_s,
            )
            schedule.renewed(loop.time())
            for name in result.responses:
                self.failures.pop(name, None)
            self.failures.update(result.failures)


class ControlOperations:
    """Fenced, deduplicated, bounded fan-outs to every participant of a training run.

    ``endpoints`` maps each participant instance name to its control address. ``token``
    is the bearer token sent with every call; ``channel_credentials`` enables TLS (and
    mutual TLS when they carry a client certificate). ``coordinator_id`` and ``epoch``
    come from :func:`~turnpoint.trainer.control.identity.bump_epoch` (the caller persists
    them). Close with :meth:`close` (or use ``async with``).
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
        self._token = token
        self._channel_credentials = channel_credentials
        self._clients: dict[str, ParticipantControlClient] = {
            name: self._new_client(name, address) for name, address in sorted(endpoints.items())
        }
        self._request_ids = _RequestIds()
        self._topology: Topology | None = None
        # Per recent checkpoint: the participants that ended it already (a commit that
        # released, a resume that succeeded); a resume of it skips them.
        self._released: dict[str, set[str]] = {}

    # -- basics ------------------------------------------------------------------------

    def _new_client(self, name: str, address: str) -> ParticipantControlClient:
        return ParticipantControlClient(
            address,
            token=self._token,
            participant_name=name,
            channel_credentials=self._channel_credentials,
            reply_grace_s=self.config.reply_grace_s,
        )

    async def _replace_with_workers(self, group: str, workers: Mapping[str, str]) -> None:
        """Address the workers of ``group`` instead of the group's shared endpoint
        (docs/spec.md section 3.9); the caller checked that no worker name is taken."""
        await self._clients.pop(group).close()
        for name, address in workers.items():
            self._clients[name] = self._new_client(name, address)
        self._clients = dict(sorted(self._clients.items()))

    @property
    def instances(self) -> tuple[str, ...]:
        return tuple(self._clients)

    @property
    def endpoints(self) -> Mapping[str, str]:
        """Each participant's control address, worker groups replaced by their workers
        once :meth:`discover` found them: where the trainer sends each one's rollouts."""
        return MappingProxyType({name: c.address for name, c in self._clients.items()})

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
        pause_s: float = JOINING_RETRY_PAUSE_S,
    ) -> FanoutResult[Any]:
        """One operation, the same requests re-sent up to ``attempts`` times to the
        participants whose failure was transient, ``pause_s`` apart."""
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

    # -- renew -------------------------------------------------------------------------

    async def renew_round(
        self, checkpoint_id: str, instances: Sequence[str], window_s: float
    ) -> FanoutResult[Any]:
        """One renew of ``instances``, abandoned after ``window_s``."""
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
            deadline_s=window_s,
            per_call_timeout_s=window_s,
            concurrency=self.config.fanout_concurrency,
        )
        self._record("renew", result)
        return result

    async def renew(
        self, checkpoint_id: str, instances: Iterable[str] | None = None
    ) -> ControlReport:
        """Extend the lease of ``checkpoint_id`` on every (or the given) participant."""
        chosen = self._checked(instances)
        # Abandoned before the next renewal is due, so a hung renew delays nothing.
        window_s = min(self.config.control_timeout_s, self.config.renew_interval_s)
        result = await self.renew_round(checkpoint_id, chosen, window_s)
        return ControlReport(
            "renew",
            checkpoint_id,
            frozenset(result.responses),
            result.failures,
            result.durations_s,
        )

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
        done = self._released.get(checkpoint_id, set()) & set(chosen)
        reports = [ControlReport("resume", checkpoint_id, frozenset(done), {})]
        for group in self._resume_groups(tuple(n for n in chosen if n not in done)):
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
        merged = ControlReport.merge("resume", checkpoint_id, reports)
        self.note_released(checkpoint_id, merged.succeeded)
        return merged

    def note_released(self, checkpoint_id: str, instances: Iterable[str]) -> None:
        """``instances`` ended ``checkpoint_id``: later resumes of it skip them."""
        names = set(instances)
        if not names:
            return
        self._released.setdefault(checkpoint_id, set()).update(names)
        while len(self._released) > _RELEASED_REMEMBERED:
            del self._released[next(iter(self._released))]

    def released(self, checkpoint_id: str) -> frozenset[str]:
        """The participants known to have ended ``checkpoint_id``."""
        return frozenset(self._released.get(checkpoint_id, ()))

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
        key = key or content_key("retire", chosen)
        requests = {
            name: pb.RetireRequest(
                fence=self.fence,
                request_id=self.request_id("retire", key, name),
                episodes=[episode_to_proto(e) for e in items],
            )
            for name, items in chosen.items()
        }
        result = await self._fan_out_once("retire", requests, attempts=JOINING_ATTEMPTS)
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
        key = content_key("forget", chosen)
        requests = {
            name: pb.ForgetRequest(
                fence=self.fence,
                request_id=self.request_id("forget", key, name),
                rollout_ids=list(ids),
            )
            for name, ids in chosen.items()
        }
        result = await self._fan_out_once("forget", requests, attempts=JOINING_ATTEMPTS)
        return ControlReport(
            "forget", key, frozenset(result.responses), result.failures, result.durations_s
        )

    # -- liveness ----------------------------------------------------------------------

    async def status_round(self, timeout_s: float) -> FanoutResult[pb.GetStatusResponse]:
        """Ask every participant for its status once, each call bounded by ``timeout_s``:
        the liveness watch's probe (docs/spec.md section 7.11). Not recorded as an
        operation in the metrics: it runs all the time and says nothing of snapshots."""
        clients = {name: self._clients[name] for name in self.instances}

        def request(_name: str) -> pb.GetStatusRequest:
            return pb.GetStatusRequest()

        return await fan_out(
            clients,
            request,
            deadline_s=timeout_s,
            per_call_timeout_s=timeout_s,
            concurrency=self.config.fanout_concurrency,
        )
