"""The asyncio runtime around the pure core: what the gRPC adapters call, one method per RPC.

Every control method takes the request's ``fence`` and ``request_id`` and
``timeout_s`` (the time left on the caller's gRPC deadline, None for none) and answers
before that deadline, keeping a reply margin. Work that needs longer (a slow write, an
install, stopping a retired episode) keeps running in a background task and the call
raises ``TurnpointError(DEADLINE_EXCEEDED)``; a retry of the same operation joins the
running work instead of starting it again.

State changes happen in one place: under :class:`~._shared.Shared`'s lock, by calling
the pure :class:`~._core.ParticipantCore`. Waiters (a prepare waiting for episodes to
park, parked episodes, held model replies, watchers) wait on the same condition.

The clock is injectable (``clock``, monotonic seconds): it drives leases and episode
budgets, so a test can expire a lease by moving a fake clock and calling
:meth:`ParticipantRuntime.check_lease`. Call deadlines use the event loop's clock
because they bound real waits.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, InvalidIdError
from turnpoint.protocol import (
    PROTOCOL_VERSION,
    CompletionReceipt,
    EpisodeState,
    Fence,
    ParticipantKind,
    Phase,
    ReadinessReport,
    RecoveryLevel,
    RecoveryMode,
    VerifyMode,
)

from ._agent import Agent, AgentHost, BoundaryReport, RunResult
from ._core import (
    CoreEvent,
    ParticipantCore,
    StartKind,
    WorkKey,
    checked_id,
    supersedes,
)
from ._model import GenerateChunk, GenerateRequest, ModelHost, PolicyModel
from ._resources import ResourcesHost, ResourcesServer, Verdict
from ._shared import Deadline, KindHost, RuntimeConfig, Shared, invalid_record, logger
from ._store import (
    ArtifactRef,
    CorruptSnapshotError,
    Record,
    SnapshotConflictError,
    SnapshotEntry,
    SnapshotStore,
    StoreError,
    UnserialisableRecordError,
    WriteCancelled,
    WriteState,
    WriteTicket,
)

__all__ = [
    "AcknowledgeResult",
    "BoundaryEvent",
    "CommitResult",
    "Description",
    "ForgetResult",
    "Header",
    "ParticipantRuntime",
    "PrepareResult",
    "ReadinessUpdate",
    "RenewResult",
    "RestoreResult",
    "ResumeResult",
    "RetireResult",
    "StatusResult",
    "WatchEvent",
]

T = TypeVar("T")


# ---------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Header:
    """What every response carries: who answered and the epoch it holds."""

    participant_id: str
    incarnation: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Description:
    kind: ParticipantKind
    instance_name: str
    incarnation: str
    protocol_version: str
    recovery_mode: RecoveryMode
    verify_mode: VerifyMode
    group_scored: bool
    group_size: int
    supported_levels: tuple[RecoveryLevel, ...]
    environment: str
    phase: Phase


@dataclass(frozen=True, slots=True)
class PrepareResult:
    """PREPARED with a ready report, or PREPARING with blockers (an answer, not an error).

    Times (``lease_expires_at``) are seconds since the epoch, for a protobuf Timestamp.
    """

    checkpoint_id: str
    phase: Phase
    readiness: ReadinessReport
    lease_expires_at: float | None


@dataclass(frozen=True, slots=True)
class RenewResult:
    checkpoint_id: str
    phase: Phase
    lease_expires_at: float | None


@dataclass(frozen=True, slots=True)
class CommitResult:
    checkpoint_id: str
    manifest: ArtifactRef
    artifacts: tuple[ArtifactRef, ...]
    exported: tuple[EpisodeId, ...]


@dataclass(frozen=True, slots=True)
class ResumeResult:
    checkpoint_id: str
    phase: Phase
    ended_active: bool


@dataclass(frozen=True, slots=True)
class RestoreResult:
    restore_id: str
    installed: tuple[EpisodeId, ...]
    phase: Phase


@dataclass(frozen=True, slots=True)
class RetireResult:
    stopped: tuple[EpisodeId, ...]


@dataclass(frozen=True, slots=True)
class ForgetResult:
    forgotten: int


@dataclass(frozen=True, slots=True)
class AcknowledgeResult:
    acknowledged: int
    unknown: tuple[CompletionReceipt, ...]


@dataclass(frozen=True, slots=True)
class StatusResult:
    phase: Phase
    active_checkpoint_id: str | None
    lease_expires_at: float | None
    readiness: ReadinessReport
    admission_open: bool
    lease_expiries: int
    refused_rollouts: int


@dataclass(frozen=True, slots=True)
class ReadinessUpdate:
    """WatchBoundaries: readiness after a change (always sent first)."""

    phase: Phase
    readiness: ReadinessReport


@dataclass(frozen=True, slots=True)
class BoundaryEvent:
    """WatchBoundaries: one episode sealed a boundary or changed state.

    An entry leaving the table (acknowledged, retired, closed) is reported once more
    with state IDLE. ``slot`` says which kind's work it is (``run``, ``session``,
    ``generate/<n>``). ``at`` is seconds since the epoch.
    """

    episode: EpisodeId
    state: EpisodeState
    boundary_index: int
    turn_index: int
    at: float
    phase: Phase
    slot: str = "run"


WatchEvent = ReadinessUpdate | BoundaryEvent


# ---------------------------------------------------------------------- background jobs


class _Stage(enum.Enum):
    EXPORTING = "exporting"
    WRITING = "writing"
    DONE = "done"


@dataclass(eq=False)
class _CommitJob:
    checkpoint_id: str
    fingerprint: tuple[str, frozenset[EpisodeId]]
    snapshot: str
    export_keys: tuple[WorkKey, ...]
    discard_keys: tuple[WorkKey, ...]
    stage: _Stage = _Stage.EXPORTING
    records: tuple[Record, ...] | None = None
    discarded: bool = False
    task: asyncio.Task[CommitResult] | None = None
    ticket: WriteTicket | None = None
    write: asyncio.Future[SnapshotEntry] | None = None


@dataclass(eq=False)
class _RestoreJob:
    restore_id: str
    task: asyncio.Task[RestoreResult]
    background: set[asyncio.Task[Any]] = field(default_factory=set)


def _retrieve(task: asyncio.Future[Any]) -> None:
    # A background job whose caller stopped waiting still has its outcome read here,
    # so asyncio never logs "exception was never retrieved" for an answered failure.
    if not task.cancelled():
        task.exception()


def _storage_error(error: BaseException, what: str) -> TurnpointError:
    """Map the store's failures to protocol reasons (never by message text)."""
    if isinstance(error, TurnpointError):
        return error
    if isinstance(error, WriteCancelled):
        return TurnpointError(
            Reason.STALE_CHECKPOINT,
            f"{what} was stopped by a resume before it published",
            {"checkpoint_id": error.checkpoint_id},
        )
    if isinstance(error, SnapshotConflictError):
        return TurnpointError(
            Reason.CHECKPOINT_CONFLICT,
            str(error),
            {"snapshot": error.snapshot, "published_checkpoint_id": error.published_checkpoint_id},
        )
    if isinstance(error, UnserialisableRecordError):
        return TurnpointError(
            Reason.INVALID_CHECKPOINT_STATE,
            str(error),
            {"episode": str(error.episode), "key": error.key, "location": error.location},
        )
    if isinstance(error, CorruptSnapshotError):
        return TurnpointError(
            Reason.INVALID_CHECKPOINT_STATE,
            str(error),
            {"snapshot": error.snapshot, "corruption": error.kind.value},
        )
    if isinstance(error, InvalidIdError):
        return TurnpointError(Reason.INVALID_ARGUMENT, str(error), {"field": error.field})
    if isinstance(error, OSError):
        # The participant's own disk (full, failing): transient, the same id is retried.
        return TurnpointError(
            Reason.STORAGE_UNAVAILABLE,
            f"{what} failed on storage: {error.strerror or error}",
            {"errno": str(error.errno)},
        )
    raise error


class ParticipantRuntime:
    """One participant: the control plane, the hosted kinds and their data plane.

    Pass the user's objects: ``agent`` (an :class:`Agent`), ``resources`` (a
    :class:`ResourcesServer`), ``model`` (a :class:`PolicyModel`). Agent plus resources is
    an ENVIRONMENT participant. Use it as an async context manager (or call
    :meth:`start` / :meth:`aclose`) to run the background lease task.
    """

    def __init__(
        self,
        instance_name: str,
        store: SnapshotStore,
        *,
        agent: Agent | None = None,
        resources: ResourcesServer | None = None,
        model: PolicyModel | None = None,
        environment: str = "",
        config: RuntimeConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        incarnation: str | None = None,
    ) -> None:
        self._instance = checked_id(instance_name, "instance_name")
        self._store = store
        self._config = config or RuntimeConfig()
        self._incarnation = incarnation or secrets.token_hex(8)
        core = ParticipantCore(
            default_lease_s=self._config.default_lease_s,
            max_finished_ids=self._config.max_finished_ids,
            max_answered_requests=self._config.max_answered_requests,
            record_events=True,
        )
        self._shared = Shared(core, self._config, clock, wall_clock)
        self.agent = AgentHost(self._shared, agent) if agent is not None else None
        self.resources = ResourcesHost(self._shared, resources) if resources is not None else None
        self.model = ModelHost(self._shared, model) if model is not None else None
        hosts: list[KindHost] = [h for h in (self.agent, self.resources, self.model) if h]
        if not hosts:
            raise ValueError("a participant hosts at least one of agent, resources, model")
        if self.model is not None and len(hosts) > 1:
            raise ValueError("a policy model server hosts nothing else")
        self._hosts: dict[str, KindHost] = {host.slot: host for host in hosts}
        self._environment = environment or next(
            (
                str(h.describe().get("environment", ""))
                for h in hosts
                if h.describe().get("environment")
            ),
            "",
        )
        self._commit_jobs: dict[str, _CommitJob] = {}
        self._restore_job: _RestoreJob | None = None
        self._stops: dict[WorkKey, asyncio.Task[None]] = {}
        self._background: set[asyncio.Future[Any]] = set()
        self._lease_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the background lease task (expiry turns into resume)."""
        if self._lease_task is None:
            self._lease_task = asyncio.create_task(self._lease_loop(), name="turnpoint-lease")

    async def aclose(self) -> None:
        """Stop the lease task and all hosted work; wait for background writes to settle."""
        if self._lease_task is not None:
            self._lease_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._lease_task
            self._lease_task = None
        for host in self._hosts.values():
            await host.aclose()
        pending = [job.write for job in self._commit_jobs.values() if job.write is not None]
        for job in self._commit_jobs.values():
            if job.task is not None and job.stage is _Stage.EXPORTING:
                job.task.cancel()
        pending.extend(self._background)
        if pending:
            await asyncio.wait(pending)

    async def __aenter__(self) -> ParticipantRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ plain reads

    @property
    def instance_name(self) -> str:
        return self._instance

    @property
    def kind(self) -> ParticipantKind:
        kinds = {host.kind for host in self._hosts.values()}
        if kinds == {ParticipantKind.AGENT, ParticipantKind.RESOURCES}:
            return ParticipantKind.ENVIRONMENT
        return kinds.pop()

    @property
    def recovery_mode(self) -> RecoveryMode:
        modes = {host.recovery_mode for host in self._hosts.values()}
        # The weakest mode hosted decides what the participant as a whole can promise.
        for mode in (RecoveryMode.RESTART_ONLY, RecoveryMode.EXPORTED, RecoveryMode.STATELESS):
            if mode in modes:
                return mode
        return RecoveryMode.RESTART_ONLY

    @property
    def phase(self) -> Phase:
        return self._shared.core.phase

    @property
    def core(self) -> ParticipantCore:
        """The pure core, for inspection (tests, metrics). Never change it directly."""
        return self._shared.core

    async def wait_until(
        self, predicate: Callable[[ParticipantCore], bool], timeout_s: float | None = None
    ) -> bool:
        """Wait until ``predicate(core)`` holds (re-checked at every state change).

        For tests and tools; returns False if ``timeout_s`` passed first.
        """
        shared = self._shared
        async with shared.cond:
            return await shared.wait_until(lambda: predicate(shared.core), timeout_s)

    def header(self) -> Header:
        return Header(self._instance, self._incarnation, self._shared.core.epoch)

    async def describe(self, fence: Fence | None = None) -> Description:
        async with self._shared.changing() as core:
            core.observe_fence(fence)
            phase = core.phase
        extra: dict[str, object] = {}
        for host in self._hosts.values():
            extra.update(host.describe())
        mode = self.recovery_mode
        levels = (
            (RecoveryLevel.SIBLING, RecoveryLevel.PROMPT_GROUP)
            if mode is RecoveryMode.RESTART_ONLY
            else (RecoveryLevel.TURN, RecoveryLevel.SIBLING, RecoveryLevel.PROMPT_GROUP)
        )
        verify_mode = extra.get("verify_mode", VerifyMode.WAIT)
        group_size = extra.get("group_size", 0)
        return Description(
            kind=self.kind,
            instance_name=self._instance,
            incarnation=self._incarnation,
            protocol_version=PROTOCOL_VERSION,
            recovery_mode=mode,
            verify_mode=verify_mode if isinstance(verify_mode, VerifyMode) else VerifyMode.WAIT,
            group_scored=bool(extra.get("group_scored", False)),
            group_size=group_size if isinstance(group_size, int) else 0,
            supported_levels=levels,
            environment=self._environment,
            phase=phase,
        )

    async def status(self, max_blockers: int = 0) -> StatusResult:
        """GetStatus: read-only."""
        cap = self._cap(max_blockers)
        async with self._shared.cond:
            core = self._shared.core
            return StatusResult(
                phase=core.phase,
                active_checkpoint_id=core.active_checkpoint_id,
                lease_expires_at=self._shared.to_wall(core.lease_expires_at),
                readiness=core.readiness(cap),
                admission_open=core.admission_open,
                lease_expiries=core.lease_expiries,
                refused_rollouts=core.refused_rollouts,
            )

    async def watch(
        self, max_blockers: int = 0, fence: Fence | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """WatchBoundaries: a readiness report first, then boundary events and new reports.

        Boundary events are pushed as they happen; a new readiness report follows each
        batch of changes that moved readiness (ready, counts, restarts) or the phase.
        """
        cap = self._cap(max_blockers)
        shared = self._shared
        watcher = shared.add_watcher()
        try:
            async with shared.changing() as core:
                core.observe_fence(fence)
                report = core.readiness(cap)
                phase = core.phase
            last = _signature(phase, report)
            yield ReadinessUpdate(phase, report)
            while True:
                await watcher.wake.wait()
                watcher.wake.clear()
                events = list(watcher.events)
                watcher.events.clear()
                core = shared.core
                for event in events:
                    yield self._boundary_event(event, core.phase)
                report = core.readiness(cap)
                signature = _signature(core.phase, report)
                if signature != last or watcher.lagged:
                    watcher.lagged = False
                    last = signature
                    yield ReadinessUpdate(core.phase, report)
        finally:
            shared.remove_watcher(watcher)

    def _boundary_event(self, event: CoreEvent, phase: Phase) -> BoundaryEvent:
        at = self._shared.to_wall(event.at)
        assert at is not None
        return BoundaryEvent(
            event.episode,
            event.state,
            event.boundary_index,
            event.turn_index,
            at,
            phase,
            event.slot,
        )

    def _cap(self, max_blockers: int) -> int:
        if max_blockers < 0:
            raise TurnpointError(
                Reason.INVALID_ARGUMENT, "max_blockers must be >= 0", {"field": "max_blockers"}
            )
        cap = max_blockers or self._config.default_max_blockers
        return min(cap, self._config.max_blockers_limit)

    def _lease_wall(self) -> float | None:
        return self._shared.to_wall(self._shared.core.lease_expires_at)

    # ------------------------------------------------------------------ fencing wrapper

    async def _control(
        self,
        operation: str,
        fence: Fence,
        request_id: str,
        result_type: type[T],
        work: Callable[[], Awaitable[T]],
    ) -> T:
        """Fence the request, run it, and record its answer under ``request_id``."""
        async with self._shared.changing() as core:
            recorded = core.check_fence(fence, request_id)
        if recorded is not None:
            answer = recorded.answer
            if recorded.operation == operation and isinstance(answer, result_type):
                return answer
            if recorded.operation == operation and isinstance(answer, TurnpointError):
                raise TurnpointError(answer.reason, answer.message, answer.metadata)
            raise TurnpointError(
                Reason.FENCED,
                f"request {request_id!r} answered another operation; epoch {fence.epoch} is fenced",
                {"epoch": str(core.epoch), "request_epoch": str(fence.epoch)},
            )
        try:
            result = await work()
        except TurnpointError as error:
            if error.reason is not Reason.DEADLINE_EXCEEDED:
                core.record_answer(request_id, operation, error)
            raise
        core.record_answer(request_id, operation, result)
        return result

    # ------------------------------------------------------------------ prepare / renew

    async def prepare(
        self,
        fence: Fence,
        request_id: str,
        checkpoint_id: str,
        *,
        lease_s: float | None = None,
        max_blockers: int = 0,
        expected_episodes: Sequence[EpisodeId] = (),
        timeout_s: float | None = None,
    ) -> PrepareResult:
        """Close admission, let running work park, wait until ready or just before the deadline.

        Not ready in time is an answer (phase PREPARING, blockers listed), not an error;
        admission stays closed until resume. A repeat of a ready prepare replays it.
        ``expected_episodes`` is a hint only (the coordinator's view of what runs here).
        """
        deadline = Deadline(timeout_s, self._config)
        cap = self._cap(max_blockers)
        del expected_episodes  # a hint; readiness is computed from what actually runs here
        return await self._control(
            "prepare",
            fence,
            request_id,
            PrepareResult,
            lambda: self._prepare(checkpoint_id, lease_s, cap, deadline),
        )

    async def _prepare(
        self, checkpoint_id: str, lease_s: float | None, cap: int, deadline: Deadline
    ) -> PrepareResult:
        async with self._shared.changing() as core:
            start = core.begin_prepare(checkpoint_id, lease_s, self._shared.now(), epoch=core.epoch)
            if isinstance(start.replay, PrepareResult):
                return replace(start.replay, lease_expires_at=self._lease_wall())
            if start.superseded is not None:
                # A publication of the superseded checkpoint cannot be stopped; it may
                # finish in the background (its snapshot is simply never used).
                for publishing in self._abandon_commit(start.superseded):
                    self._background.add(publishing)
                    publishing.add_done_callback(self._background.discard)
            if start.opened:
                await self._close_admission(checkpoint_id)
            await self._shared.wait_until(
                lambda: core.ready or core.active_checkpoint_id != checkpoint_id,
                deadline.remaining(),
            )
            if core.active_checkpoint_id != checkpoint_id:
                raise TurnpointError(
                    Reason.STALE_CHECKPOINT,
                    f"checkpoint {checkpoint_id!r} was resumed while its prepare waited",
                    {"checkpoint_id": checkpoint_id},
                )
            result = PrepareResult(
                checkpoint_id, core.phase, core.readiness(cap), self._lease_wall()
            )
            if core.ready:
                core.record_prepare_answer(checkpoint_id, result)
            return result

    async def _close_admission(self, checkpoint_id: str) -> None:
        """Run the kinds' close hooks (lock held); any failure reopens admission."""
        closed: list[KindHost] = []
        try:
            for host in self._hosts.values():
                await host.admission_closed()
                closed.append(host)
        except BaseException:
            self._shared.core.abort_prepare(checkpoint_id)
            for host in closed:
                await self._opened_hook(host)
            raise

    async def _opened_hook(self, host: KindHost) -> None:
        try:
            await host.admission_opened()
        except Exception:  # noqa: BLE001 - admission is open whatever a user hook says; log it
            logger.exception("admission_opened hook of %s failed", host.kind.name)

    async def renew(
        self,
        fence: Fence,
        request_id: str,
        checkpoint_id: str,
        *,
        lease_s: float | None = None,
        timeout_s: float | None = None,
    ) -> RenewResult:
        del timeout_s  # answered at once

        async def work() -> RenewResult:
            async with self._shared.changing() as core:
                core.renew(checkpoint_id, lease_s, self._shared.now())
                return RenewResult(checkpoint_id, core.phase, self._lease_wall())

        return await self._control("renew", fence, request_id, RenewResult, work)

    # ------------------------------------------------------------------ commit

    async def commit(
        self,
        fence: Fence,
        request_id: str,
        checkpoint_id: str,
        snapshot: str,
        scope: Iterable[EpisodeId],
        *,
        timeout_s: float | None = None,
    ) -> CommitResult:
        """Export the frozen state once, write it under ``<root>/<snapshot>/<instance>/``.

        Only from PREPARED; readiness is re-checked and a scope naming a restart is
        refused. The same arguments (scope in any order) join the running write or
        replay its answer; a failed write is redone with the same records.
        """
        deadline = Deadline(timeout_s, self._config)
        scope_set = frozenset(scope)
        return await self._control(
            "commit",
            fence,
            request_id,
            CommitResult,
            lambda: self._commit(checkpoint_id, snapshot, scope_set, deadline),
        )

    async def _commit(
        self, checkpoint_id: str, snapshot: str, scope: frozenset[EpisodeId], deadline: Deadline
    ) -> CommitResult:
        checked_id(snapshot, "snapshot")
        fingerprint = (snapshot, scope)
        async with self._shared.changing() as core:
            start = core.begin_commit(checkpoint_id, fingerprint, scope, self._shared.now())
            if start.kind is StartKind.REPLAY:
                assert isinstance(start.answer, CommitResult)
                return start.answer
            if start.kind is StartKind.NEW:
                self._commit_jobs[checkpoint_id] = _CommitJob(
                    checkpoint_id, fingerprint, snapshot, start.export, start.discard
                )
            job = self._commit_jobs[checkpoint_id]
            if job.task is None or (
                job.task.done() and (job.task.cancelled() or job.task.exception() is not None)
            ):
                job.task = asyncio.create_task(self._drive_commit(job))
                job.task.add_done_callback(_retrieve)
            task = job.task
        return await self._await_job(task, deadline, f"commit of {checkpoint_id!r}")

    async def _await_job(self, task: asyncio.Future[T], deadline: Deadline, what: str) -> T:
        try:
            async with asyncio.timeout(deadline.remaining()):
                return await asyncio.shield(task)
        except TimeoutError:
            raise deadline.exceeded(what) from None

    async def _drive_commit(self, job: _CommitJob) -> CommitResult:
        """Export once, drop restored state the scope leaves out, write; retried as a whole."""
        what = f"commit of {job.checkpoint_id!r}"
        if job.records is None:
            job.stage = _Stage.EXPORTING
            job.records = await self._export(job.export_keys)
        if not job.discarded:
            for key in job.discard_keys:
                await self._stop_and_drop(key)
            job.discarded = True
        job.stage = _Stage.WRITING
        ticket = job.ticket = WriteTicket()
        write = asyncio.ensure_future(
            asyncio.to_thread(
                self._store.write,
                job.snapshot,
                self._instance,
                job.checkpoint_id,
                job.records,
                ticket=ticket,
            )
        )
        job.write = write
        write.add_done_callback(_retrieve)
        try:
            entry = await asyncio.shield(write)
        except (OSError, StoreError, InvalidIdError) as error:
            raise _storage_error(error, what) from error
        result = CommitResult(job.checkpoint_id, entry.manifest, entry.artifacts, entry.episodes)
        async with self._shared.changing() as core:
            core.finish_commit(job.checkpoint_id, job.fingerprint, result)
        job.stage = _Stage.DONE
        return result

    async def _export(self, keys: Sequence[WorkKey]) -> tuple[Record, ...]:
        records: list[Record] = []
        wanted = {key.episode for key in keys}
        for slot, host in self._hosts.items():
            mine = [key for key in keys if _slot_of(key) == slot]
            if not mine:
                continue
            exported = await host.export(mine)
            stray = sorted({r.episode for r in exported} - wanted)
            if stray:
                raise TurnpointError(
                    Reason.INVALID_CHECKPOINT_STATE,
                    f"{host.kind.name} exported episodes outside the commit: {stray[0]}",
                    {"episode": str(stray[0])},
                )
            records.extend(exported)
        return tuple(records)

    def _abandon_commit(self, checkpoint_id: str) -> list[asyncio.Future[SnapshotEntry]]:
        """Stop a commit nothing will use (lock held); return publications under way.

        An export is cancelled and not waited for; an unpublished write is cancelled
        through its ticket; a publication already under way cannot be stopped, so the
        caller waits for it.
        """
        job = self._commit_jobs.get(checkpoint_id)
        if job is None:
            return []
        if job.task is not None and not job.task.done() and job.stage is _Stage.EXPORTING:
            job.task.cancel()
        if job.ticket is not None and job.write is not None and not job.write.done():
            state = job.ticket.cancel()
            if state is WriteState.PUBLISHING:
                return [job.write]
            # Cancelled: the writer notices at its next step and removes its own file.
            self._background.add(job.write)
            job.write.add_done_callback(self._background.discard)
        self._commit_jobs.pop(checkpoint_id, None)
        return []

    # ------------------------------------------------------------------ resume and lease

    async def resume(
        self,
        fence: Fence,
        request_id: str,
        checkpoint_id: str,
        *,
        timeout_s: float | None = None,
    ) -> ResumeResult:
        """End the checkpoint (also abort): reopen admission, release parked work and replies.

        Stops an unpublished write, waits only for a publication under way (so none
        appears after the resume), clears the lease and remembers the id. Idempotent,
        also for ids never seen. Past its deadline it changes nothing and can be retried.
        """
        deadline = Deadline(timeout_s, self._config)
        return await self._control(
            "resume",
            fence,
            request_id,
            ResumeResult,
            lambda: self._resume(checkpoint_id, deadline),
        )

    async def _resume(
        self, checkpoint_id: str, deadline: Deadline, *, expired: bool = False
    ) -> ResumeResult:
        checked_id(checkpoint_id, "checkpoint_id")
        shared = self._shared
        while True:
            async with shared.changing() as core:
                active = core.active_checkpoint_id
                ends_active = active is not None and (
                    checkpoint_id == active or supersedes(checkpoint_id, active)
                )
                if expired and core.lease_expired(shared.now()) != checkpoint_id:
                    # Renewed (or resumed) since the expiry was seen: nothing to do.
                    return ResumeResult(checkpoint_id, core.phase, False)
                waits: list[asyncio.Future[Any]] = []
                restore = self._restore_job
                if ends_active and restore is not None and not restore.task.done():
                    # Admission reopens only once an install that outlived its call finished.
                    waits.append(restore.task)
                else:
                    for ended in {checkpoint_id, active} if ends_active else {checkpoint_id}:
                        if ended is not None:
                            waits.extend(self._abandon_commit(ended))
                if not waits:
                    outcome = core.resume(checkpoint_id, shared.now(), expired=expired)
                    if outcome.ended is not None:
                        if self._restore_job is not None:
                            self._restore_job = None
                        for host in self._hosts.values():
                            await self._opened_hook(host)
                    return ResumeResult(checkpoint_id, core.phase, outcome.ended is not None)
            try:
                async with asyncio.timeout(deadline.remaining()):
                    await asyncio.wait(waits)
            except TimeoutError:
                raise deadline.exceeded(f"resume of {checkpoint_id!r}") from None

    async def check_lease(self) -> str | None:
        """Resume the active checkpoint if its lease ran out; return its id, else None.

        The background lease task calls this; tests with a fake clock call it directly.
        """
        async with self._shared.cond:
            expired = self._shared.core.lease_expired(self._shared.now())
        if expired is None:
            return None
        result = await self._resume(expired, Deadline.never(), expired=True)
        return expired if result.ended_active else None

    async def _lease_loop(self) -> None:
        shared = self._shared
        while True:
            async with shared.cond:
                expires = shared.core.lease_expires_at
                delay = None if expires is None else expires - shared.now()
                if delay is None or delay > 0:
                    # Any state change (a renew, a resume) wakes this to look again.
                    await shared.wait_change(delay)
                    continue
            try:
                await self.check_lease()
            except TurnpointError:
                logger.exception("lease expiry could not resume the participant")

    # ------------------------------------------------------------------ restore

    async def restore(
        self,
        fence: Fence,
        request_id: str,
        restore_id: str,
        snapshot: str,
        manifest: ArtifactRef,
        artifacts: Sequence[ArtifactRef],
        scope: Iterable[EpisodeId],
        *,
        lease_s: float | None = None,
        timeout_s: float | None = None,
    ) -> RestoreResult:
        """Install saved episodes (attempt N) as attempt N+1 into an idle, fresh participant.

        Verifies every digest, validates every record before installing any, and stays
        closed (RESTORED) until resume. All or nothing: a failure leaves the participant
        idle, open and fresh. An install that outlives the call keeps running; a retry
        joins it.
        """
        deadline = Deadline(timeout_s, self._config)
        scope_set = frozenset(scope)
        artifact_refs = tuple(artifacts)
        return await self._control(
            "restore",
            fence,
            request_id,
            RestoreResult,
            lambda: self._restore(
                restore_id, snapshot, manifest, artifact_refs, scope_set, lease_s, deadline
            ),
        )

    async def _restore(
        self,
        restore_id: str,
        snapshot: str,
        manifest: ArtifactRef,
        artifacts: tuple[ArtifactRef, ...],
        scope: frozenset[EpisodeId],
        lease_s: float | None,
        deadline: Deadline,
    ) -> RestoreResult:
        checked_id(snapshot, "snapshot")
        fingerprint = (snapshot, manifest, artifacts, scope)
        async with self._shared.changing() as core:
            start = core.begin_restore(restore_id, fingerprint, lease_s, self._shared.now())
            if start.kind is StartKind.REPLAY:
                assert isinstance(start.answer, RestoreResult)
                return start.answer
            if start.kind is StartKind.NEW or self._restore_job is None:
                task = asyncio.create_task(
                    self._drive_restore(restore_id, snapshot, manifest, artifacts, scope)
                )
                task.add_done_callback(_retrieve)
                self._restore_job = _RestoreJob(restore_id, task)
            task = self._restore_job.task
        return await self._await_job(task, deadline, f"restore {restore_id!r}")

    async def _drive_restore(
        self,
        restore_id: str,
        snapshot: str,
        manifest: ArtifactRef,
        artifacts: tuple[ArtifactRef, ...],
        scope: frozenset[EpisodeId],
    ) -> RestoreResult:
        installed: list[EpisodeId] = []
        try:
            try:
                loaded = await asyncio.to_thread(
                    self._store.read,
                    snapshot,
                    self._instance,
                    manifest,
                    scope.__contains__,
                    artifacts=artifacts or None,
                )
            except (OSError, CorruptSnapshotError, InvalidIdError) as error:
                raise _storage_error(error, f"restore {restore_id!r}") from error
            plan = self._validate_records(loaded.records)
            for record, host in plan:
                key = await host.install(record, record.episode.next_attempt())
                installed.append(key.episode)
            result = RestoreResult(restore_id, tuple(sorted(set(installed))), Phase.RESTORED)
            async with self._shared.changing() as core:
                core.finish_restore(restore_id, result)
            return result
        except BaseException:
            async with self._shared.changing() as core:
                undone = core.fail_restore(restore_id, self._shared.now())
                if self._restore_job is not None and self._restore_job.restore_id == restore_id:
                    self._restore_job = None
            for key in undone:
                owner = self._hosts.get(_slot_of(key))
                if owner is not None:
                    try:
                        await owner.stop(key)
                    except Exception:  # noqa: BLE001 - best effort: the restore already failed
                        logger.exception("could not free %s after a failed restore", key.episode)
            raise

    def _validate_records(self, records: Sequence[Record]) -> list[tuple[Record, KindHost]]:
        """Check every record before any is installed (all or nothing)."""
        plan: list[tuple[Record, KindHost]] = []
        seen: set[tuple[EpisodeId, str]] = set()
        by_key = {host.record_key: host for host in self._hosts.values() if host.record_key}
        for record in records:
            host = by_key.get(record.key)
            if host is None:
                raise invalid_record(record, "no hosted kind restores this record key")
            if (record.episode, record.key) in seen:
                raise invalid_record(record, "the episode has two records of this key")
            seen.add((record.episode, record.key))
            host.validate(record)
            plan.append((record, host))
        return plan

    # ------------------------------------------------------------------ retire / forget

    async def retire(
        self,
        fence: Fence,
        request_id: str,
        episodes: Iterable[EpisodeId],
        *,
        timeout_s: float | None = None,
    ) -> RetireResult:
        """Refuse the rollouts first, then stop these attempts and every earlier one.

        Replies only once they stopped and their state is freed. Only when IDLE or
        RESTORED (after an install that outlived its restore finished). Idempotent; a
        retry after a cut-short or failed retire finishes the job.
        """
        deadline = Deadline(timeout_s, self._config)
        targets = tuple(episodes)
        return await self._control(
            "retire", fence, request_id, RetireResult, lambda: self._retire(targets, deadline)
        )

    async def _retire(self, episodes: tuple[EpisodeId, ...], deadline: Deadline) -> RetireResult:
        shared = self._shared
        while True:
            async with shared.changing() as core:
                restore = self._restore_job
                if restore is None or restore.task.done():
                    keys = core.begin_retire(episodes, shared.now())
                    tasks = [self._stop_task(key) for key in keys]
                    break
            try:
                async with asyncio.timeout(deadline.remaining()):
                    await asyncio.wait([restore.task])
            except TimeoutError:
                raise deadline.exceeded("retire (waiting for a restore install)") from None
        if tasks:
            try:
                async with asyncio.timeout(deadline.remaining()):
                    await asyncio.wait(tasks)
            except TimeoutError:
                raise deadline.exceeded("retire") from None
        failed = [t for t in tasks if t.cancelled() or t.exception() is not None]
        if failed:
            error = None if failed[0].cancelled() else failed[0].exception()
            raise TurnpointError(
                Reason.RETIRE_INCOMPLETE,
                f"{len(failed)} of {len(tasks)} retired attempts could not be stopped: {error!r}",
                {"failed": str(len(failed))},
            )
        return RetireResult(tuple(sorted({key.episode for key in keys})))

    def _stop_task(self, key: WorkKey) -> asyncio.Task[None]:
        """The task stopping ``key`` (joined if one runs; restarted if one failed)."""
        task = self._stops.get(key)
        if task is None or task.done():
            task = asyncio.create_task(self._stop_and_drop(key))
            task.add_done_callback(_retrieve)
            self._stops[key] = task
        return task

    async def _stop_and_drop(self, key: WorkKey) -> None:
        host = self._hosts.get(_slot_of(key))
        try:
            if host is not None:
                await host.stop(key)
            async with self._shared.changing() as core:
                core.finish_retire(key, self._shared.now())
                core.remove(key, self._shared.now())
        finally:
            if self._stops.get(key) is asyncio.current_task():
                del self._stops[key]

    async def forget(
        self,
        fence: Fence,
        request_id: str,
        rollout_ids: Iterable[str],
        *,
        timeout_s: float | None = None,
    ) -> ForgetResult:
        """Drop refusal marks; refused while a checkpoint is open or a retire is unfinished."""
        del timeout_s
        targets = tuple(rollout_ids)

        async def work() -> ForgetResult:
            async with self._shared.changing() as core:
                return ForgetResult(core.forget(targets))

        return await self._control("forget", fence, request_id, ForgetResult, work)

    # ------------------------------------------------------------------ data plane

    def _agent(self) -> AgentHost:
        if self.agent is None:
            raise TurnpointError(Reason.NOT_FOUND, "this participant hosts no agent")
        return self.agent

    def _resources(self) -> ResourcesHost:
        if self.resources is None:
            raise TurnpointError(Reason.NOT_FOUND, "this participant hosts no resources")
        return self.resources

    def _model(self) -> ModelHost:
        if self.model is None:
            raise TurnpointError(Reason.NOT_FOUND, "this participant hosts no policy model")
        return self.model

    def run_episode(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        *,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
    ) -> AsyncGenerator[BoundaryReport | RunResult, None]:
        """RolloutService.Run; see :meth:`AgentHost.run_episode` (close it when done)."""
        return self._agent().run_episode(
            episode, task, boundaries_seen=boundaries_seen, budget_s=budget_s
        )

    async def accept_run(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        *,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
    ) -> AsyncGenerator[BoundaryReport | RunResult, None]:
        """Accept a Run now (errors raise here), then follow it; see :meth:`AgentHost.accept_run`."""
        return await self._agent().accept_run(
            episode, task, boundaries_seen=boundaries_seen, budget_s=budget_s
        )

    async def acknowledge(self, receipts: Iterable[CompletionReceipt]) -> AcknowledgeResult:
        """RolloutService.Acknowledge: drop retained results."""
        acknowledged, unknown = await self._agent().acknowledge(receipts)
        return AcknowledgeResult(acknowledged, unknown)

    async def seed_session(self, episode: EpisodeId, task: Mapping[str, Any]) -> bool:
        """ResourcesService.SeedSession; True when the session already existed."""
        return await self._resources().seed(episode, task)

    async def call_tool(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        return await self._resources().call(episode, tool, arguments)

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        return await self._resources().verify(episode, answer)

    async def close_session(self, episode: EpisodeId) -> bool:
        return await self._resources().close(episode)

    def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        """PolicyService.Generate, under admission control (close it when done)."""
        return self._model().generate(episode, request)

    async def update_weights(self, weights_version: int, state: bytes) -> int:
        """PolicyService.UpdateWeights: the trainer's weight sync."""
        return await self._model().update_weights(weights_version, state)


def _slot_of(key: WorkKey) -> str:
    return key.slot.partition("/")[0]


def _signature(phase: Phase, report: ReadinessReport) -> tuple[object, ...]:
    return (
        phase,
        report.ready,
        report.blocker_count,
        tuple(sorted((s.value, c) for s, c in report.counts.items())),
        report.restarts,
    )
