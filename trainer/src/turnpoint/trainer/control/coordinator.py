"""The trainer-side coordinator: every control operation, fanned out to every participant.

docs/spec.md section 7. One class, in three parts:

- the plumbing every operation shares: one client per participant, fenced request ids
  (:mod:`turnpoint.trainer.control.operations`), bounded fan-outs, failure
  classification, and renew, resume, retire and forget, which report failures instead
  of raising them;
- restore and its cleanup (section 7.7): a restore that fails on any participant has an
  uncertain outcome on all of them, so the replacement attempts are retired everywhere
  and every participant is resumed;
- discovery (:meth:`Coordinator.discover`), prepare and commit.

Prepare runs under ONE deadline (``prepare_timeout_s``) for all participants; each
participant's rounds, waits and give-ups are decided by the pure core
(:mod:`turnpoint.trainer.snapshots.core`) and driven by
:mod:`turnpoint.trainer.snapshots.preparing`. The core
also decides the verdict (commit only if every participant is ready; an abort resumes
every participant, the ready ones included) and the commit scopes (restarts are in no
scope). While anything is slow (a prepare, a commit, the trainer's own publication) the
coordinator renews every participant's lease in the background, once right after
prepare and then every ``renew_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any, Protocol, Self

import grpc

from turnpoint.convert import (
    add_episodes,
    duration_from_seconds,
    episode_to_proto,
    readiness_from_proto,
)
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import (
    EpisodeId,
    InvalidIdError,
    checkpoint_sequence,
    make_checkpoint_id,
    validate_id,
)
from turnpoint.protocol import ArtifactRef, ParticipantKind, ReadinessReport, RecoveryLevel
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.control.client import (
    ControlRequest,
    ParticipantControlClient,
)
from turnpoint.trainer.control.failures import Failure, FailureKind, MalformedReplyError, classify
from turnpoint.trainer.control.fanout import (
    ControlCaller,
    FanoutResult,
    fan_out,
    retry_same_request,
)
from turnpoint.trainer.control.fanout import retry_same_request as _retry_same_request
from turnpoint.trainer.control.identity import CoordinatorIdentity
from turnpoint.trainer.control.operations import (
    _RELEASED_REMEMBERED,
    _RESUME_ORDER,
    JOINING_ATTEMPTS,
    JOINING_RETRY_PAUSE_S,
    Renewer,
    _RequestIds,
    content_key,
    episodes_of,
)
from turnpoint.trainer.control.outcomes import (
    CommitFailed,
    ControlReport,
    OperationFailed,
    PreparedCheckpoint,
    PrepareFailed,
    RestoredCheckpoint,
    RestoreFailed,
)
from turnpoint.trainer.control.topology import ParticipantInfo, Topology, group_workers
from turnpoint.trainer.metrics import CoordinatorMetrics
from turnpoint.trainer.restore.stale import stale_refusals
from turnpoint.trainer.snapshots.core import (
    FinishedProbe,
    Outcome,
    ParticipantPrepare,
    commit_scope_problem,
    decide_prepare,
    exported_problem,
    installed_problem,
    watch_after_s,
    watch_wait_s,
)
from turnpoint.trainer.snapshots.levels import LevelDecision, decide_levels
from turnpoint.trainer.snapshots.preparing import (
    PreparingParticipant,
    Readiness,
    Unacked,
    UnackedResolver,
    is_ready,
    watch_readiness,
)
from turnpoint.trainer.storage.manifest import ManifestError, ParticipantEntry, SnapshotManifest
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

_LOG = logging.getLogger(__name__)

# Prepare answers the coordinator keeps the reported restarts of, for commit's check.
_RESTARTS_REMEMBERED = 8
# docs/spec.md section 4.8 item 7: participants that export nothing may skip every
# write. Tests that inject disk faults into empty commits turn it off, as an older
# coordinator would not send it.
ACCEPT_SAVED_NOTHING = True
# docs/spec.md section 4.8 item 9: participants end the checkpoint in their commit, as
# soon as the export is taken. Tests of the resume after publication turn it off, as an
# older coordinator would not ask.
RELEASE_IN_COMMIT = True
# Describe at start-up: transient failures (a participant still binding, a blip) are
# asked again this many times, this far apart, before discovery fails.
DISCOVER_ATTEMPTS = 5
DISCOVER_RETRY_PAUSE_S = 0.5

_OUTCOMES = {
    FailureKind.NOT_READY: Outcome.NOT_READY,
    FailureKind.TRANSIENT: Outcome.TRANSIENT,
    FailureKind.INVARIANT: Outcome.INVARIANT,
}


class ControlWatcher(Protocol):
    """What watches a checkpoint's control rounds (:meth:`Coordinator.watch`): the job's
    checkpoint history (docs/spec.md section 7.13). Called on the loop; quick."""

    def on_calls(
        self,
        operation: str,
        checkpoint_id: str,
        durations_s: Mapping[str, float],
        failures: Mapping[str, str],
        now: float,
    ) -> None: ...

    def on_committed(self, checkpoint_id: str, entries: Iterable[ParticipantEntry]) -> None: ...


@dataclass(frozen=True, slots=True)
class PrepareProgress:
    """The prepare under way: who answered ready, and the latest readiness each of the
    others reported (its prepare answers and its ``WatchBoundaries`` stream)."""

    checkpoint_id: str
    started: float  # monotonic
    ready: frozenset[str]
    waiting: Mapping[str, ReadinessReport | None]


@dataclass(frozen=True, slots=True)
class ParticipantStatus:
    """A participant's latest answer to the liveness watch's ``GetStatus`` (section 7.11):
    its phase, the id it has open, its lease and its admission, when it answered."""

    phase: str
    active_checkpoint_id: str
    lease_expires_at: float | None  # wall-clock seconds; None when idle
    admission_open: bool
    lease_expiries: int
    answered_at: float  # monotonic


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
        # Sent a resume (answered or not): their leases need no renewing.
        self._resuming: dict[str, set[str]] = {}
        # Sent a releasing commit: the commit ends the checkpoint there once its export is
        # taken, and a renew that crosses it finds the checkpoint finished, which is no
        # lease running out.
        self._committing: dict[str, set[str]] = {}
        # The restarts each recent prepare reported, per instance: commit refuses a
        # scope that names one.
        self._restarts: dict[str, Mapping[str, frozenset[EpisodeId]]] = {}
        # Per recent checkpoint: the snapshot its prepare offered, and the instances that
        # committed saved-nothing in the prepare (docs/spec.md 4.6 item 8); commit sends
        # them nothing.
        # (Values: instance -> the incarnation that answered.)
        self._committed_empty: dict[str, tuple[str, Mapping[str, str]]] = {}
        # Each environment's recovery level, decided at discovery (docs/spec.md 7.1).
        self._levels: Mapping[str, LevelDecision] = MappingProxyType({})
        self._warned_levels: dict[str, LevelDecision] = {}
        self._watchers: list[ControlWatcher] = []
        self._statuses: dict[str, ParticipantStatus] = {}
        # The prepare under way (its id, start and each participant's readiness).
        self._preparing: tuple[str, float, Mapping[str, Readiness]] | None = None

    def watch(self, watcher: ControlWatcher) -> None:
        """Tell ``watcher`` each round of a checkpoint's prepare, commit and resume."""
        self._watchers.append(watcher)

    def _tell(self, call: Callable[[ControlWatcher], None]) -> None:
        for watcher in self._watchers:
            try:
                call(watcher)
            # A watcher's bug must not fail the checkpoint it watches.
            except Exception:  # noqa: BLE001
                _LOG.exception("a control watcher failed")

    def prepare_progress(self) -> PrepareProgress | None:
        """The prepare under way, if any (read by the status API, off the hot path)."""
        if self._preparing is None:
            return None
        checkpoint_id, started, readiness = self._preparing
        ready = frozenset(
            name
            for name, state in readiness.items()
            if state.report is not None and state.report.ready
        )
        waiting = {
            name: None if state.report is None else readiness_from_proto(state.report)
            for name, state in readiness.items()
            if name not in ready
        }
        return PrepareProgress(checkpoint_id, started, ready, MappingProxyType(waiting))

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

    def give_up_on(self, instances: Iterable[str]) -> None:
        """``instances`` were declared lost (docs/spec.md section 7.11 item 1): every call
        to them, pending or later, fails at once (``UNAVAILABLE``), so an operation under
        way that includes them (a snapshot's prepare, its abort, a retire) fails fast
        instead of waiting on a paused process; the snapshot fails and is taken again
        after the heal. :meth:`replace_participant` addresses each one's replacement."""
        for name in self._checked(instances):
            self._clients[name].give_up(f"{name} was declared lost; it is being replaced")

    async def replace_participant(self, instance: str, address: str) -> ParticipantInfo:
        """Address the replacement of lost ``instance``, started under the same name at
        ``address`` (docs/spec.md section 7.15), and describe it.

        It must describe itself as the same instance, kind and environment (the
        topology a snapshot restores into, section 7.7 item 3); its incarnation is new.
        Raises :class:`OperationFailed` when it cannot be described or differs.
        """
        topology = self.topology
        if instance not in topology.participants:
            raise ValueError(f"unknown participant instance {instance!r}")
        await self._clients.pop(instance).close()
        self._clients[instance] = self._new_client(instance, address)
        self._clients = dict(sorted(self._clients.items()))
        result = await self._describe([instance])
        failures = dict(result.failures)
        info: ParticipantInfo | None = None
        response = result.responses.get(instance)
        if response is not None:
            before = topology.participants[instance]
            try:
                if response.instance_name != instance:
                    raise MalformedReplyError(
                        instance, "Describe", f"reply names {response.instance_name!r}"
                    )
                info = ParticipantInfo.from_proto(instance, response)
                if (info.kind, info.environment) != (before.kind, before.environment):
                    raise MalformedReplyError(
                        instance,
                        "Describe",
                        f"the replacement serves {info.kind.value} {info.environment!r}, "
                        f"not {before.kind.value} {before.environment!r}",
                    )
            except MalformedReplyError as error:
                failures[instance] = classify(error)
        self._record("describe", result)
        if failures or info is None:
            raise OperationFailed("describe", instance, failures)
        self._topology = Topology({**topology.participants, instance: info})
        self._statuses.pop(instance, None)
        return info

    @property
    def instances(self) -> tuple[str, ...]:
        return tuple(self._clients)

    @property
    def endpoints(self) -> Mapping[str, str]:
        """Each participant's control address, worker groups replaced by their workers
        once :meth:`discover` found them: where the trainer sends each one's rollouts."""
        return MappingProxyType({name: c.address for name, c in self._clients.items()})

    @property
    def discovered(self) -> Topology | None:
        """The topology once :meth:`discover` has run, else None."""
        return self._topology

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

    def _record(
        self,
        operation: str,
        result: FanoutResult[Any],
        checkpoint_id: str = "",
        *,
        ended: frozenset[str] = frozenset(),
    ) -> None:
        """Metrics, logs and watchers of one fan-out. ``ended``: participants this
        coordinator itself told to end the checkpoint, for whom finding it finished is
        expected."""
        if checkpoint_id and self._watchers:
            failures = {
                name: f"{failure.kind.value}: {failure.detail}"
                for name, failure in result.failures.items()
            }
            now = time.monotonic()
            self._tell(
                lambda w: w.on_calls(operation, checkpoint_id, result.durations_s, failures, now)
            )
        metrics = self.metrics
        for name, failure in result.failures.items():
            if failure.reason is not None and metrics is not None:
                metrics.refused(operation, failure.reason.name)
            if failure.reason is Reason.STALE_CHECKPOINT and operation in ("renew", "commit"):
                if name in ended:
                    _LOG.debug("%s: %s had already resumed", operation, name)
                    continue
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
        checkpoint_id: str = "",
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
        self._record(operation, result, checkpoint_id)
        return result

    def _checked(self, instances: Iterable[str] | None) -> tuple[str, ...]:
        if instances is None:
            return self.instances
        chosen = tuple(sorted(set(instances)))
        unknown = sorted(set(chosen) - set(self._clients))
        if unknown:
            raise ValueError(f"unknown participant instance(s): {', '.join(unknown)}")
        return chosen

    async def renew_round(
        self, checkpoint_id: str, instances: Sequence[str], window_s: float
    ) -> FanoutResult[Any]:
        """One renew of ``instances``, abandoned after ``window_s``."""
        requests = {
            name: pb.RenewRequest(
                fence=self._fence,
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
        told = self.ending(checkpoint_id) | self._committing.get(checkpoint_id, set())
        self._record("renew", result, ended=told)
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
            _remember(self._resuming, checkpoint_id, group)
            requests = {
                name: pb.ResumeRequest(
                    fence=self._fence,
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
                checkpoint_id=checkpoint_id,
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
        _remember(self._released, checkpoint_id, instances)

    def released(self, checkpoint_id: str) -> frozenset[str]:
        """The participants known to have ended ``checkpoint_id``."""
        return frozenset(self._released.get(checkpoint_id, ()))

    def ending(self, checkpoint_id: str) -> frozenset[str]:
        """The participants that ended ``checkpoint_id`` or were told to: no lease of
        theirs needs renewing."""
        return self.released(checkpoint_id) | self._resuming.get(checkpoint_id, set())

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
                fence=self._fence,
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
                fence=self._fence,
                request_id=self.request_id("forget", key, name),
                rollout_ids=list(ids),
            )
            for name, ids in chosen.items()
        }
        result = await self._fan_out_once("forget", requests, attempts=JOINING_ATTEMPTS)
        return ControlReport(
            "forget", key, frozenset(result.responses), result.failures, result.durations_s
        )

    async def status_round(self, timeout_s: float) -> FanoutResult[pb.GetStatusResponse]:
        """Ask every participant for its status once, each call bounded by ``timeout_s``:
        the liveness watch's probe (docs/spec.md section 7.11). Not recorded as an
        operation in the metrics: it runs all the time and says nothing of snapshots."""
        clients = {name: self._clients[name] for name in self.instances}

        def request(_name: str) -> pb.GetStatusRequest:
            return pb.GetStatusRequest()

        result: FanoutResult[pb.GetStatusResponse] = await fan_out(
            clients,
            request,
            deadline_s=timeout_s,
            per_call_timeout_s=timeout_s,
            concurrency=self.config.fanout_concurrency,
        )
        now = time.monotonic()
        for name, response in result.responses.items():
            if isinstance(response, pb.GetStatusResponse):
                self._statuses[name] = ParticipantStatus(
                    phase=types_pb2.Phase.Name(response.phase).removeprefix("PHASE_").lower(),
                    active_checkpoint_id=response.active_checkpoint_id,
                    lease_expires_at=response.lease_expires_at.ToNanoseconds() / 1e9
                    if response.HasField("lease_expires_at")
                    else None,
                    admission_open=response.admission_open,
                    lease_expiries=response.lease_expiries,
                    answered_at=now,
                )
        return result

    async def release_left_open(self) -> ControlReport:
        """Resume whatever an earlier incarnation left open on the participants: the
        checkpoint or restore it never resumed (it died inside a snapshot), as each
        lease would, without waiting for it (docs/spec.md section 7.7 item 6). Read
        from ``GetStatus``; a participant that does not answer is left to the restore,
        which then fails on it as it would have."""
        result = await self.status_round(self.config.control_timeout_s)
        left_open: dict[str, list[str]] = {}
        for name, response in sorted(result.responses.items()):
            if response.phase != types_pb2.PHASE_IDLE and response.active_checkpoint_id:
                left_open.setdefault(response.active_checkpoint_id, []).append(name)
        reports = []
        for checkpoint_id, names in sorted(left_open.items()):
            _LOG.info(
                "resuming %s, left open on %s by an earlier incarnation", checkpoint_id, names
            )
            reports.append(await self.resume(checkpoint_id, names))
        return ControlReport.merge("resume", "left-open", reports)

    def statuses(self) -> Mapping[str, ParticipantStatus]:
        """Each participant's latest status answer (the liveness watch's), if any."""
        return MappingProxyType(dict(self._statuses))

    # -- restore (docs/spec.md section 7.7) --------------------------------------------

    async def restore(
        self,
        restore_id: str,
        snapshot: str,
        manifest: SnapshotManifest,
        scope: Mapping[str, Iterable[EpisodeId]],
        *,
        instances: Iterable[str] | None = None,
        retire_unscoped: bool = True,
    ) -> dict[str, tuple[EpisodeId, ...]]:
        """Restore every participant from ``<root>/<snapshot>/`` as ``manifest`` describes.

        ``scope`` gives each instance the saved episodes (attempt N) to continue; each
        must install exactly their attempt N+1 and stay closed until :meth:`resume`.
        ``instances`` restores only those (a heal, docs/spec.md section 7.15), and
        ``retire_unscoped`` false keeps a running participant's other work (section
        4.16); every participant outside ``instances`` goes on untouched.
        Raises :class:`RestoreFailed` (nothing cleaned up; :meth:`restored` does that).
        """
        validate_id(restore_id, "restore_id")
        validate_id(snapshot, "snapshot")
        self.topology.check_manifest(manifest)
        chosen = self._checked(instances)
        unknown = sorted(set(scope) - set(chosen))
        if unknown:
            raise ValueError(f"restore scope names unknown instance(s): {', '.join(unknown)}")
        scopes = {name: tuple(sorted(set(scope.get(name, ())))) for name in chosen}
        requests = {
            name: self._restore_request(
                restore_id, snapshot, manifest, name, episodes, retire_unscoped=retire_unscoped
            )
            for name, episodes in scopes.items()
        }
        result = await self._fan_out_once("restore", requests, attempts=JOINING_ATTEMPTS)
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

    def _restore_request(
        self,
        restore_id: str,
        snapshot: str,
        manifest: SnapshotManifest,
        name: str,
        episodes: Sequence[EpisodeId],
        *,
        retire_unscoped: bool,
    ) -> pb.RestoreRequest | pb.RestoreRunningRequest:
        """RestoreRunning where the participant serves it, else the fresh-only Restore.

        At a start, a running restore retires everything unscoped: whatever the
        participant holds was started by an earlier incarnation, which this epoch fences
        (docs/spec.md section 4.16), so a trainer restart needs no participant restart.
        A heal keeps it (``retire_unscoped`` false): that work is this incarnation's and
        goes on. A participant without the capability still needs to be fresh (section
        4.10).
        """
        entry = _manifest_entry(manifest.participant(name))
        scope = [episode_to_proto(e) for e in episodes]
        lease = duration_from_seconds(self.config.lease_s)
        if self.topology.participants[name].restore_running:
            return pb.RestoreRunningRequest(
                fence=self._fence,
                request_id=self.request_id("restore_running", restore_id, name),
                restore_id=restore_id,
                snapshot=snapshot,
                entry=entry,
                scope=scope,
                lease=lease,
                retire_unscoped=retire_unscoped,
            )
        return pb.RestoreRequest(
            fence=self._fence,
            request_id=self.request_id("restore", restore_id, name),
            restore_id=restore_id,
            snapshot=snapshot,
            entry=entry,
            scope=scope,
            lease=lease,
        )

    async def _discard_restore(
        self, restore_id: str, replacements: Sequence[EpisodeId], instances: Sequence[str]
    ) -> dict[str, Failure]:
        """Retire the replacement attempts on ``instances``, then resume them."""
        failures: dict[str, Failure] = {}
        if replacements:
            retired = await self.retire(
                {name: replacements for name in instances}, key=f"{restore_id}-discard"
            )
            failures.update(retired.failures)
        resumed = await self.resume(restore_id, instances)
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
        *,
        instances: Iterable[str] | None = None,
        retire_unscoped: bool = True,
        another_round: bool = False,
    ) -> AsyncIterator[RestoredCheckpoint]:
        """Restore everywhere for the body, then always reopen every participant once.

        ``instances`` and ``retire_unscoped`` as :meth:`restore` takes them: a heal
        restores, cleans up and reopens only those participants.

        ``another_round``: the caller restores again, under the next restore id, if
        running participants refuse only saved attempts they have moved past (docs/spec.md
        section 4.16 item 3; the error's ``seen_since``). The replacements are then not
        retired, only every participant resumed: the next round's RestoreRunning, with
        ``retire_unscoped``, replaces them, and a retire would raise their marks to N+1
        and make every other continuation impossible.

        A restore that fails on ANY participant has an uncertain outcome on all of them:
        the replacement attempts (N+1) are retired everywhere, every participant is
        resumed, and :class:`RestoreFailed` tells the caller to start those rollouts over
        from their prompts. A body that fails could not take the restored attempts
        over: they are retired everywhere before the participants reopen, and the body's
        error propagates.
        """
        chosen = self._checked(instances)
        replacements = tuple(
            sorted({e.next_attempt() for episodes in scope.values() for e in episodes})
        )
        renewer = Renewer(self, restore_id, chosen)
        renewer.start()
        try:
            installed = await self.restore(
                restore_id,
                snapshot,
                manifest,
                scope,
                instances=chosen,
                retire_unscoped=retire_unscoped,
            )
        except RestoreFailed as error:
            await renewer.stop()
            seen_since = stale_refusals(
                (f.reason, f.error.metadata if isinstance(f.error, TurnpointError) else {})
                for f in error.failures.values()
            )
            # A fresh-only participant restored in this round is no longer fresh: no
            # second round can reach it, so this round is cleaned up as any failure is.
            keep = (
                another_round
                and retire_unscoped
                and seen_since is not None
                and all(self.topology.participants[n].restore_running for n in chosen)
            )
            cleanup = await self._discard_restore(restore_id, () if keep else replacements, chosen)
            raise RestoreFailed(
                restore_id,
                error.failures,
                replacements,
                cleanup,
                seen_since=seen_since,
                replacements_kept=keep,
            ) from error
        except BaseException:
            await renewer.stop()
            await self._discard_restore(restore_id, replacements, chosen)
            raise
        restored = RestoredCheckpoint(restore_id, MappingProxyType(installed))
        try:
            yield restored
        except BaseException:
            await renewer.stop()
            await self._discard_restore(restore_id, replacements, chosen)
            raise
        await renewer.stop()
        restored.release = await self.resume(restore_id, chosen)

    # -- discovery, prepare and commit -------------------------------------------------

    def _remember_restarts(
        self, checkpoint_id: str, restarts: Mapping[str, tuple[EpisodeId, ...]]
    ) -> None:
        self._restarts[checkpoint_id] = {name: frozenset(e) for name, e in restarts.items()}
        while len(self._restarts) > _RESTARTS_REMEMBERED:
            del self._restarts[next(iter(self._restarts))]

    def _remember_committed_empty(
        self, checkpoint_id: str, snapshot: str | None, instances: Mapping[str, str]
    ) -> None:
        self._committed_empty.pop(checkpoint_id, None)
        if snapshot is not None and instances:
            self._committed_empty[checkpoint_id] = (snapshot, instances)
            while len(self._committed_empty) > _RESTARTS_REMEMBERED:
                del self._committed_empty[next(iter(self._committed_empty))]

    async def discover(self) -> Topology:
        """``Describe`` every participant; the result is kept as :attr:`topology`.

        An endpoint where several workers answer, each its own participant, is replaced
        by its workers, and each of them is described at its own address (docs/spec.md
        section 3.9); :attr:`endpoints` then lists the workers. Raises
        :class:`OperationFailed` if any participant cannot be described or its answer
        breaks the contract (unknown kind, another protocol version).
        """
        result = await self._describe(self.instances)
        responses = dict(result.responses)
        failures = dict(result.failures)
        durations = dict(result.durations_s)
        groups: dict[str, dict[str, str]] = {}
        for name, response in result.responses.items():
            try:
                workers = group_workers(name, response)
            except MalformedReplyError as error:
                failures[name] = classify(error)
                workers = None
            if workers is not None:
                groups[name] = workers
            if workers is not None or name in failures:
                del responses[name]
        taken = set(self._clients)
        for group, workers in groups.items():
            if clash := sorted(taken & set(workers)):
                failures[group] = classify(
                    MalformedReplyError(
                        group, "Describe", f"workers {clash} are also given as participants"
                    )
                )
            taken |= set(workers)
        if groups and not failures:
            for group, workers in groups.items():
                _LOG.info("%s: %d workers, each its own participant", group, len(workers))
                await self._replace_with_workers(group, workers)
            described = await self._describe([w for ws in groups.values() for w in ws])
            responses |= described.responses
            failures |= described.failures
            durations |= described.durations_s
        participants: dict[str, ParticipantInfo] = {}
        for name, response in responses.items():
            try:
                if response.instance_name != name:  # a worker answering for another
                    raise MalformedReplyError(
                        name, "Describe", f"reply names {response.instance_name!r}"
                    )
                participants[name] = ParticipantInfo.from_proto(name, response)
            except MalformedReplyError as error:
                failures[name] = classify(error)
        self._record("describe", FanoutResult(responses, failures, durations))
        if failures:
            raise OperationFailed("describe", "topology", failures)
        self._topology = Topology(participants)
        self._decide_levels(self._topology)
        return self._topology

    async def _describe(self, instances: Sequence[str]) -> FanoutResult[pb.DescribeResponse]:
        # A participant that just started, or a connection that blipped, is not a reason
        # to fail the job's start: transient failures are asked again, a few times.
        return await retry_same_request(
            {name: self._clients[name] for name in instances},
            {name: pb.DescribeRequest(fence=self._fence) for name in instances},
            attempts=DISCOVER_ATTEMPTS,
            deadline_s=DISCOVER_ATTEMPTS * self._call_deadline(),
            per_call_timeout_s=self.config.control_timeout_s,
            concurrency=self.config.fanout_concurrency,
            pause_s=DISCOVER_RETRY_PAUSE_S,
        )

    def _decide_levels(self, topology: Topology) -> None:
        """docs/spec.md sections 7.1 item 3 and 7.8: each environment's recovery level,
        decided once from Describe, with one warning per lowered environment (a later
        discovery that decides the same warns no more)."""
        target = RecoveryLevel.parse(self.config.target_level)
        self._levels = MappingProxyType(
            decide_levels(target, topology.environments(), topology.shared_models())
        )
        for environment, decision in self._levels.items():
            if decision.lowered and self._warned_levels.get(environment) != decision:
                self._warned_levels[environment] = decision
                _LOG.warning(decision.warning())

    @property
    def levels(self) -> Mapping[str, LevelDecision]:
        """Each described environment's recovery level, as :meth:`discover` decided it;
        a restore plans with these (docs/spec.md section 7.7 item 4)."""
        return self._levels

    def _prepare_request(
        self,
        checkpoint_id: str,
        instance: str,
        snapshot: str | None,
    ) -> pb.PrepareRequest:
        return pb.PrepareRequest(
            fence=self._fence,
            request_id=self.request_id("prepare", checkpoint_id, instance),
            checkpoint_id=checkpoint_id,
            lease=duration_from_seconds(self.config.lease_s),
            max_blockers=self.config.max_blockers_listed,
            # Committing in the prepare answers saved-nothing: only with that accepted.
            empty_commit_snapshot=snapshot if snapshot and ACCEPT_SAVED_NOTHING else "",
        )

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        resolve: UnackedResolver | None = None,
        snapshot: str | None = None,
    ) -> PreparedCheckpoint:
        """Prepare every participant under one deadline (``prepare_timeout_s``).

        ``resolve`` decides unacknowledged completions; without it they are
        treated as "retire". ``snapshot``, the name the commit will use, lets a
        participant with nothing to export commit saved-nothing in its prepare
        (docs/spec.md section 4.6 item 8); :meth:`commit` under that name then skips it.
        Raises :class:`PrepareFailed` (with the core's verdict); it never resumes: use
        :meth:`prepared`, which always does.
        """
        renewer = Renewer(self, checkpoint_id, self.instances)
        renewer.start()
        try:
            return await self._prepare(checkpoint_id, resolve, snapshot)
        finally:
            await renewer.stop()

    async def _prepare(
        self,
        checkpoint_id: str,
        resolve: UnackedResolver | None,
        snapshot: str | None,
    ) -> PreparedCheckpoint:
        validate_id(checkpoint_id, "checkpoint_id")
        if snapshot is not None:
            validate_id(snapshot, "snapshot")
        loop = asyncio.get_running_loop()
        config = self.config
        deadline = loop.time() + config.prepare_timeout_s
        unacked = Unacked(resolve, self.metrics)
        readiness = {name: Readiness() for name in self._clients}

        started_at = loop.time()
        last_answer_at: float | None = None

        def on_answer(name: str, response: pb.PrepareResponse) -> None:
            nonlocal last_answer_at
            last_answer_at = loop.time()
            if not is_ready(response) and self.metrics is not None:
                self.metrics.prepare_not_ready.labels(self._kind_label(name)).inc()

        callers: dict[str, ControlCaller] = {
            name: PreparingParticipant(
                core=ParticipantPrepare(
                    name, deadline=deadline, round_timeout_s=config.control_timeout_s
                ),
                client=client,
                readiness=readiness[name],
                unacked=unacked,
                on_answer=on_answer,
            )
            for name, client in self._clients.items()
        }
        watch_request = pb.WatchBoundariesRequest(
            fence=self._fence, max_blockers=config.max_blockers_listed
        )
        watches: dict[str, asyncio.Task[None]] = {}
        opener: asyncio.TimerHandle | None = None

        def open_watches() -> None:
            # One timer for the whole prepare, not a waiting task per participant: most
            # are ready within milliseconds and never cost a task or a stream.
            nonlocal opener
            written = (client.last_written_at for client in self._clients.values())
            wait_s = watch_wait_s(
                loop.time(),
                started_at=started_at,
                last_activity_at=max(
                    (at for at in (last_answer_at, *written) if at is not None), default=None
                ),
                prepare_timeout_s=config.prepare_timeout_s,
                participants=len(callers),
            )
            if wait_s > 0:
                opener = loop.call_later(wait_s, open_watches)
                return
            for name in self._clients:
                if readiness[name].settled.is_set():
                    continue
                watches[name] = asyncio.create_task(
                    watch_readiness(
                        name,
                        self._clients[name],
                        watch_request,
                        watch_after_s=0.0,
                        timeout_s=config.prepare_timeout_s + config.reply_grace_s,
                        state=readiness[name],
                        unacked=unacked,
                    ),
                    name=f"watch-{name}",
                )

        opener = loop.call_later(
            watch_after_s(config.prepare_timeout_s, len(callers)), open_watches
        )
        self._preparing = (checkpoint_id, time.monotonic(), readiness)
        try:
            result = await fan_out(
                callers,
                lambda name: self._prepare_request(checkpoint_id, name, snapshot),
                deadline_s=config.prepare_timeout_s + config.reply_grace_s,
                per_call_timeout_s=config.prepare_timeout_s + config.reply_grace_s,
                # Every participant waits for its own work at once: a concurrency limit
                # would leave some unprepared until others are ready.
                concurrency=max(1, len(callers)),
            )
        finally:
            self._preparing = None
            if opener is not None:
                opener.cancel()  # the last one armed: it re-arms itself while answers arrive
            for watch in watches.values():
                watch.cancel()
            ended = await asyncio.gather(*watches.values(), return_exceptions=True)
            for name, outcome in zip(watches, ended, strict=True):
                if isinstance(outcome, Exception):
                    # Resolving a completion it reported failed; the prepare rounds ask
                    # again and fail the prepare if it keeps failing.
                    _LOG.warning("readiness watch of %s failed: %r", name, outcome)
        self._record("prepare", result, checkpoint_id)
        outcomes = {name: Outcome.READY for name in result.responses}
        outcomes.update({name: _OUTCOMES[f.kind] for name, f in result.failures.items()})
        verdict = decide_prepare(checkpoint_id, outcomes, unacked.ledger.retire)
        if not verdict.commit:
            _LOG.info("%s", verdict.reason)
            stale = sorted(
                name
                for name, failure in result.failures.items()
                if failure.reason is Reason.STALE_CHECKPOINT
            )
            finished_through = await self._finished_through(checkpoint_id, stale) if stale else None
            raise PrepareFailed(
                checkpoint_id, result.failures, verdict.retire, verdict, finished_through
            )
        responses: Mapping[str, pb.PrepareResponse] = result.responses
        restarts = {
            name: tuple(sorted(set(episodes_of(r.readiness.restarts, name, "Prepare"))))
            for name, r in responses.items()
        }
        self._remember_restarts(checkpoint_id, restarts)
        committed_empty = {
            name: r.header.incarnation for name, r in responses.items() if r.committed_empty
        }
        self._remember_committed_empty(checkpoint_id, snapshot, committed_empty)
        return PreparedCheckpoint(
            checkpoint_id=checkpoint_id,
            readiness=MappingProxyType({name: r.readiness for name, r in responses.items()}),
            restarts=MappingProxyType(restarts),
            durations_s=result.durations_s,
            committed_empty=frozenset(committed_empty),
        )

    async def _finished_through(self, checkpoint_id: str, instances: Sequence[str]) -> int | None:
        """docs/spec.md section 7.2 item 4: the highest sequence of ``checkpoint_id``'s
        prefix that ``instances`` (which refused it STALE_CHECKPOINT) have finished,
        found with Renew probes (:class:`FinishedProbe`); None if a probe failed."""
        try:
            refused = checkpoint_sequence(checkpoint_id)
        except InvalidIdError:
            return None
        prefix = checkpoint_id[: checkpoint_id.rindex("-")]
        highest = refused
        for name in instances:
            probe = FinishedProbe(refused)
            while (candidate := probe.next_candidate()) is not None:
                finished = await self._is_finished(name, make_checkpoint_id(prefix, candidate))
                if finished is None:
                    return None
                probe.observe(candidate, finished)
            highest = max(highest, probe.finished_through)
            _LOG.warning(
                "%s refused %s as finished: it finished %s ids up to sequence %d (%d probes)",
                name,
                checkpoint_id,
                prefix,
                probe.finished_through,
                probe.probes,
            )
        return highest

    async def _is_finished(self, instance: str, checkpoint_id: str) -> bool | None:
        """Whether ``instance`` has finished ``checkpoint_id``: a Renew, which changes
        nothing on an id that is not active, answers STALE_CHECKPOINT for a finished id
        and INVALID_PHASE for any other (docs/spec.md section 4.7). None: it said neither."""
        request = pb.RenewRequest(
            fence=self._fence,
            request_id=self.request_id("renew", checkpoint_id, instance),
            checkpoint_id=checkpoint_id,
            lease=duration_from_seconds(self.config.lease_s),
        )
        result = await fan_out(
            {instance: self._clients[instance]},
            lambda name: request,
            deadline_s=self._call_deadline(),
            per_call_timeout_s=self.config.control_timeout_s,
            concurrency=1,
        )
        failure = result.failures.get(instance)
        if failure is None:
            return False  # it is the active id there: not finished
        if failure.reason is Reason.STALE_CHECKPOINT:
            return True
        if failure.reason is Reason.INVALID_PHASE:
            return False
        return None

    @asynccontextmanager
    async def prepared(
        self,
        checkpoint_id: str,
        *,
        resolve: UnackedResolver | None = None,
        snapshot: str | None = None,
    ) -> AsyncIterator[PreparedCheckpoint]:
        """Prepare everywhere, keep the leases alive, and always resume the same id.

        ``snapshot`` is offered to the participants as :meth:`prepare` says.

        The resume on exit goes to every participant, the ready ones included, whether
        the prepare or the body failed or not. After a failure the original error is
        raised whatever the resume does (its report is attached: ``error.release`` for a
        :class:`PrepareFailed`, else the yielded object's ``release``). After a body
        that succeeded a resume that still fails is reported in ``release``, not raised:
        the snapshot is published and each participant's lease reopens it anyway.
        """
        try:
            checkpoint = await self.prepare(checkpoint_id, resolve=resolve, snapshot=snapshot)
        except BaseException as error:
            verdict = error.verdict if isinstance(error, PrepareFailed) else None
            # The verdict resumes everyone; without one (cancelled, say) so do we.
            report = await self.resume(checkpoint_id, verdict.resume if verdict else None)
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
        renewer = Renewer(self, checkpoint_id, self.instances)
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
        given = {name: frozenset(episodes) for name, episodes in scope.items()}
        problem = commit_scope_problem(given, self._clients, self._restarts.get(checkpoint_id, {}))
        if problem is not None:
            raise ValueError(problem)
        scopes = {name: given.get(name, frozenset()) for name in self._clients}
        # docs/spec.md 4.6 item 8: who committed saved-nothing in its prepare holds
        # nothing any scope could export; its entry is known without a call.
        offered, done = self._committed_empty.get(checkpoint_id, ("", {}))
        if done and offered != snapshot:
            raise ValueError(
                f"{checkpoint_id} was prepared for snapshot {offered!r}, not {snapshot!r}"
            )
        entries: dict[str, ParticipantEntry] = {
            name: ParticipantEntry(
                instance=name,
                kind=topology.kind(name),
                incarnation=incarnation,
            )
            for name, incarnation in sorted(done.items())
            if name in scopes
        }
        requests: dict[str, pb.CommitRequest] = {}
        for name, episodes in scopes.items():
            if name in entries:
                continue
            request = requests[name] = pb.CommitRequest(
                fence=self._fence,
                request_id=self.request_id("commit", checkpoint_id, name),
                checkpoint_id=checkpoint_id,
                snapshot=snapshot,
                accept_saved_nothing=ACCEPT_SAVED_NOTHING,
                release=RELEASE_IN_COMMIT,
            )
            # In the set's order: a scope's order does not matter (the proto says so),
            # and sorting a thousand episodes costs more than sending them.
            add_episodes(request.scope, episodes)
        _remember(self._committing, checkpoint_id, requests)
        result = await self._fan_out_once(
            "commit", requests, attempts=JOINING_ATTEMPTS, checkpoint_id=checkpoint_id
        )
        failures = dict(result.failures)
        # Released even if the snapshot fails now: their admission is open again.
        self.note_released(checkpoint_id, (n for n, r in result.responses.items() if r.released))
        for name, response in result.responses.items():
            try:
                entries[name] = _entry_from_commit(
                    name, topology.kind(name), response, scopes[name]
                )
            except MalformedReplyError as error:
                failures[name] = classify(error)
        if failures:
            raise CommitFailed(checkpoint_id, failures)
        self._tell(lambda w: w.on_committed(checkpoint_id, entries.values()))
        return entries


def _exported_in_scope(
    messages: Sequence[types_pb2.EpisodeId], scope: frozenset[EpisodeId], instance: str
) -> tuple[EpisodeId, ...]:
    """The episodes a commit reply exported, each the scope's own :class:`EpisodeId`:
    a reply may name only episodes of its scope, whose ids were checked when the scope
    was made, so that a snapshot of thousands of episodes builds and checks none of them
    again. An episode outside the scope is a malformed reply."""
    # An EpisodeId is the tuple of its fields: the reply's pair finds the scope's own.
    known: dict[tuple[str, int], EpisodeId] = {episode: episode for episode in scope}
    find = known.get
    exported: list[EpisodeId] = []
    for message in messages:
        episode = find((message.rollout_id, message.attempt))
        if episode is None:
            problem = exported_problem(episodes_of(messages, instance, "Commit"), scope)
            assert problem is not None  # an episode not in the scope is outside it
            raise MalformedReplyError(instance, "Commit", problem)
        exported.append(episode)
    return tuple(exported)


def _entry_from_commit(
    instance: str,
    kind: ParticipantKind,
    response: pb.CommitResponse,
    scope: frozenset[EpisodeId],
) -> ParticipantEntry:
    exported = _exported_in_scope(response.exported, scope, instance)
    if response.saved_nothing and (
        response.HasField("manifest") or response.artifacts or response.exported
    ):
        # docs/spec.md section 4.8 item 7: saved nothing means no file and no episode.
        raise MalformedReplyError(
            instance, "Commit", "saved_nothing with a manifest, artifacts or exported episodes"
        )
    try:
        artifacts = tuple(
            ArtifactRef(a.path, a.sha256, a.size_bytes, a.record_count) for a in response.artifacts
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
    instance: str,
    response: pb.RestoreResponse | pb.RestoreRunningResponse,
    scope: Sequence[EpisodeId],
) -> tuple[EpisodeId, ...]:
    installed = episodes_of(response.installed, instance, "Restore")
    problem = installed_problem(installed, scope)
    if problem is not None:
        raise MalformedReplyError(instance, "Restore", problem)
    if response.phase != types_pb2.PHASE_RESTORED:
        raise MalformedReplyError(
            instance, "Restore", f"restore answered phase {types_pb2.Phase.Name(response.phase)}"
        )
    return tuple(sorted(installed))


def _remember(by_checkpoint: dict[str, set[str]], checkpoint_id: str, names: Iterable[str]) -> None:
    """Add ``names`` under ``checkpoint_id``, keeping the last few checkpoints only."""
    added = set(names)
    if not added:
        return
    by_checkpoint.setdefault(checkpoint_id, set()).update(added)
    while len(by_checkpoint) > _RELEASED_REMEMBERED:
        del by_checkpoint[next(iter(by_checkpoint))]
