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

This module holds the fenced control operations (docs/spec.md sections 4.6-4.12).
The reads (Describe, GetStatus, WatchBoundaries) are in :mod:`._reads`, the data plane
in :mod:`._dataplane`, the commit and restore jobs in :mod:`._jobs`, and the reply types
in :mod:`._results`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, InvalidIdError
from turnpoint.protocol import ArtifactRef, EpisodeState, Fence, Phase

from ._agent import Agent, AgentHost
from ._core import ParticipantCore, RunningRestore, StartKind, WorkKey, checked_id, supersedes
from ._dataplane import DataPlane
from ._jobs import CommitJob, RestoreJob, Stage, retrieve, slot_of, storage_error
from ._model import ModelHost, PolicyModel
from ._reads import ControlReads
from ._resources import ResourcesHost, ResourcesServer
from ._results import (
    CommitResult,
    ForgetResult,
    PrepareResult,
    RenewResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
)
from ._shared import Deadline, KindHost, RuntimeConfig, Shared, invalid_record, logger
from ._store import SnapshotStore, WriteState, WriteTicket
from ._store_format import (
    CorruptSnapshotError,
    PlainRecord,
    Record,
    SnapshotEntry,
    StoreError,
    plain_record,
)

T = TypeVar("T")


class ParticipantRuntime(ControlReads, DataPlane):
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
        self._commit_jobs: dict[str, CommitJob] = {}
        # Commits that ended their checkpoint (release): a repeat joins or replays them.
        self._released: dict[str, CommitJob] = {}
        self._restore_job: RestoreJob | None = None
        self._stops: dict[WorkKey, asyncio.Task[None]] = {}
        self._background: set[asyncio.Future[Any]] = set()
        # Armed for the active lease's expiry while started (a timer, not a task that
        # wakes on every lease change: each prepare and resume moves the lease).
        self._lease_timer: asyncio.TimerHandle | None = None
        self._watching_lease = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start watching the lease in the background (expiry turns into resume)."""
        if not self._watching_lease:
            self._watching_lease = True
            self._shared.on_lease_moved = self._arm_lease
            self._arm_lease(self._shared.view.lease_expires_at)

    async def aclose(self) -> None:
        """Stop the lease timer and all hosted work; wait for background work to settle."""
        if self._watching_lease:
            self._watching_lease = False
            self._shared.on_lease_moved = None
            self._arm_lease(None)
        for host in self._hosts.values():
            await host.aclose()
        pending = [job.write for job in self._commit_jobs.values() if job.write is not None]
        for job in self._commit_jobs.values():
            if job.task is not None and job.stage is Stage.EXPORTING:
                job.task.cancel()
        pending.extend(self._background)
        if pending:
            await asyncio.wait(pending)

    async def __aenter__(self) -> ParticipantRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

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
        timeout_s: float | None = None,
        empty_commit_snapshot: str | None = None,
    ) -> PrepareResult:
        """Close admission, let running work park, wait until ready or just before the deadline.

        Not ready in time is an answer (phase PREPARING, blockers listed), not an error;
        admission stays closed until resume. A repeat of a ready prepare replays it.
        With ``empty_commit_snapshot``, a participant ready with nothing to export but
        restarts commits saved-nothing under that snapshot in the same call (docs/spec.md
        section 4.6 item 8).
        """
        deadline = Deadline(timeout_s, self._config)
        cap = self._cap(max_blockers)
        if empty_commit_snapshot is not None:
            checked_id(empty_commit_snapshot, "empty_commit_snapshot")
        return await self._control(
            "prepare",
            fence,
            request_id,
            PrepareResult,
            lambda: self._prepare(checkpoint_id, lease_s, cap, deadline, empty_commit_snapshot),
        )

    async def _prepare(
        self,
        checkpoint_id: str,
        lease_s: float | None,
        cap: int,
        deadline: Deadline,
        empty_commit_snapshot: str | None,
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
                self._forget_released()
                await self._close_admission(core, checkpoint_id)
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
            readiness = core.readiness(cap)
            committed = (
                empty_commit_snapshot is not None
                and core.ready
                and all(state is EpisodeState.RESTART for state in readiness.counts)
                and self._commit_empty(core, checkpoint_id, empty_commit_snapshot)
            )
            result = PrepareResult(
                checkpoint_id, core.phase, readiness, self._lease_wall(), committed
            )
            if core.ready:
                core.record_prepare_answer(checkpoint_id, result)
            return result

    def _commit_empty(self, core: ParticipantCore, checkpoint_id: str, snapshot: str) -> bool:
        """Commit ``checkpoint_id`` saved-nothing with an empty scope, now (lock held).

        Only for a participant that holds nothing a commit could export or discard
        (restarts at most): every scope the coordinator could send would export nothing,
        so the answer a Commit would give is known. A commit already recorded for this id
        counts only if it is this one (a replayed prepare)."""
        fingerprint = (snapshot, frozenset[EpisodeId]())
        start = core.begin_commit(checkpoint_id, fingerprint, (), self._shared.now())
        if start.kind is StartKind.REPLAY:
            return isinstance(start.answer, CommitResult) and start.answer.manifest is None
        if start.kind is not StartKind.NEW or start.export or start.discard:
            return False  # a Commit of this id is running; it gives its own answer
        core.finish_commit(checkpoint_id, fingerprint, CommitResult(checkpoint_id, None, (), ()))
        self._shared.committed_checkpoint_id = checkpoint_id
        return True

    async def _close_admission(self, core: ParticipantCore, checkpoint_id: str) -> None:
        """Run the kinds' close hooks (lock held); any failure reopens admission."""
        closed: list[KindHost] = []
        try:
            for host in self._hosts.values():
                await host.admission_closed()
                closed.append(host)
        except BaseException:
            core.abort_prepare(checkpoint_id)
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
        accept_saved_nothing: bool = False,
        release: bool = False,
    ) -> CommitResult:
        """Export the frozen state once, write it under ``<root>/<snapshot>/<instance>/``.

        Only from PREPARED; readiness is re-checked and a scope naming a restart is
        refused. The same arguments (scope in any order) join the running write or
        replay its answer; a failed write is redone with the same records. With
        ``accept_saved_nothing`` an export of nothing writes no file and answers a
        result without manifest (docs/spec.md section 4.8 item 7). With ``release`` the
        checkpoint ends as soon as the export is taken: admission reopens before the
        write, which goes on with records that share nothing with the live state, and
        the answer says ``released`` (item 9).
        """
        deadline = Deadline(timeout_s, self._config)
        scope_set = frozenset(scope)
        return await self._control(
            "commit",
            fence,
            request_id,
            CommitResult,
            lambda: self._commit(
                checkpoint_id, snapshot, scope_set, deadline, accept_saved_nothing, release
            ),
        )

    async def _commit(
        self,
        checkpoint_id: str,
        snapshot: str,
        scope: frozenset[EpisodeId],
        deadline: Deadline,
        accept_saved_nothing: bool,
        release: bool = False,
    ) -> CommitResult:
        checked_id(snapshot, "snapshot")
        fingerprint = (snapshot, scope)
        async with self._shared.changing() as core:
            released = self._released.get(checkpoint_id)
            if released is not None:
                # The commit ended its checkpoint: only the same commit can come again.
                if released.fingerprint != fingerprint:
                    raise TurnpointError(
                        Reason.CHECKPOINT_CONFLICT,
                        f"checkpoint {checkpoint_id!r} was committed with other arguments",
                        {"checkpoint_id": checkpoint_id},
                    )
                job = released
            else:
                start = core.begin_commit(checkpoint_id, fingerprint, scope, self._shared.now())
                if start.kind is StartKind.REPLAY:
                    assert isinstance(start.answer, CommitResult)
                    return start.answer
                if start.kind is StartKind.NEW:
                    self._commit_jobs[checkpoint_id] = CommitJob(
                        checkpoint_id, fingerprint, snapshot, start.export, start.discard
                    )
                job = self._commit_jobs[checkpoint_id]
            job.release = job.release or release
            if job.task is None or (
                job.task.done() and (job.task.cancelled() or job.task.exception() is not None)
            ):
                job.task = asyncio.create_task(self._drive_commit(job, accept_saved_nothing))
                job.task.add_done_callback(retrieve)
            task = job.task
        return await self._await_job(task, deadline, f"commit of {checkpoint_id!r}")

    async def _await_job(self, task: asyncio.Future[T], deadline: Deadline, what: str) -> T:
        try:
            async with asyncio.timeout(deadline.remaining()) as scope:
                return await asyncio.shield(task)
        except TimeoutError:
            if not scope.expired():
                raise  # the job's own TimeoutError (a hook's), not this call's deadline
            raise deadline.exceeded(what) from None

    async def _drive_commit(self, job: CommitJob, accept_saved_nothing: bool) -> CommitResult:
        """Export once, drop restored state the scope leaves out, write; retried as a whole."""
        what = f"commit of {job.checkpoint_id!r}"
        if job.records is None:
            job.stage = Stage.EXPORTING
            exported = await self._export(job.export_keys)
            if job.release:
                # Written after admission reopened, the records must not share the state
                # the work then changes: each is copied here as the writer would walk it
                # (checked once, encoded without a second walk), before the release.
                try:
                    job.records = tuple(map(plain_record, exported))
                except StoreError as error:
                    raise storage_error(error, what) from error
            else:
                job.records = exported
        if not job.discarded:
            for key in job.discard_keys:
                await self._stop_and_drop(key)
            job.discarded = True
        if job.release and not job.released:
            await self._release(job)
        if not job.records and accept_saved_nothing:
            # docs/spec.md section 4.8 item 7: nothing exported, nothing written (not a
            # byte, not an fsync); the answer says so and the snapshot manifest records
            # the participant without files.
            return await self._finish_commit(
                job, CommitResult(job.checkpoint_id, None, (), (), job.released)
            )
        job.stage = Stage.WRITING
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
        write.add_done_callback(retrieve)
        try:
            entry = await asyncio.shield(write)
        except (OSError, StoreError, InvalidIdError) as error:
            raise storage_error(error, what) from error
        return await self._finish_commit(
            job,
            CommitResult(
                job.checkpoint_id, entry.manifest, entry.artifacts, entry.episodes, job.released
            ),
        )

    async def _finish_commit(self, job: CommitJob, result: CommitResult) -> CommitResult:
        """Record ``result`` as the commit's answer; GetStatus names it as written."""
        async with self._shared.changing() as core:
            core.finish_commit(job.checkpoint_id, job.fingerprint, result)
            self._shared.committed_checkpoint_id = job.checkpoint_id
        job.stage = Stage.DONE
        return result

    async def _release(self, job: CommitJob) -> None:
        """docs/spec.md section 4.8 item 9: end the checkpoint as a Resume of it would,
        keeping this commit's write (a Resume would stop it)."""
        async with self._shared.changing() as core:
            if core.active_checkpoint_id != job.checkpoint_id:
                return  # ended meanwhile (its lease ran out): nothing left to release
            core.resume(job.checkpoint_id, self._shared.now())
            job.released = True
            self._released[job.checkpoint_id] = job
            for host in self._hosts.values():
                await self._opened_hook(host)

    def _forget_released(self) -> None:
        """Drop released commits that are done (lock held): a new checkpoint opened, so
        no coordinator asks for them again."""
        for checkpoint_id, job in list(self._released.items()):
            if job.task is not None and job.task.done():
                del self._released[checkpoint_id]
                if self._commit_jobs.get(checkpoint_id) is job:
                    del self._commit_jobs[checkpoint_id]

    async def _export(self, keys: Sequence[WorkKey]) -> tuple[Record | PlainRecord, ...]:
        records: list[Record | PlainRecord] = []
        wanted = {key.episode for key in keys}
        for slot, host in self._hosts.items():
            mine = [key for key in keys if slot_of(key) == slot]
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
        self._released.pop(checkpoint_id, None)
        job = self._commit_jobs.get(checkpoint_id)
        if job is None:
            return []
        if job.task is not None and not job.task.done() and job.stage is Stage.EXPORTING:
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
        async with self._shared.locked() as core:
            expired = core.lease_expired(self._shared.now())
        if expired is None:
            return None
        result = await self._resume(expired, Deadline.never(), expired=True)
        return expired if result.ended_active else None

    def _arm_lease(self, expires: float | None) -> None:
        """Arm the lease timer for ``expires`` (protocol clock; None disarms it).

        The wait runs on the event loop's clock for the time the protocol clock says is
        left; when it ends, :meth:`check_lease` decides (it resumes only an expired lease,
        and re-arms for whatever lease there is then).
        """
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        if expires is None or not self._watching_lease:
            return
        delay = max(0.0, expires - self._shared.now())
        self._lease_timer = asyncio.get_running_loop().call_later(delay, self._lease_due)

    def _lease_due(self) -> None:
        self._lease_timer = None
        task = asyncio.create_task(self._expire_lease(), name="turnpoint-lease")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _expire_lease(self) -> None:
        try:
            await self.check_lease()
        except TurnpointError:
            logger.exception("lease expiry could not resume the participant")
        if self._lease_timer is None:
            # Not expired after all (renewed just now, or the clocks disagree): wait
            # for the lease as it stands.
            self._arm_lease(self._shared.view.lease_expires_at)

    # ------------------------------------------------------------------ restore

    async def restore(
        self,
        fence: Fence,
        request_id: str,
        restore_id: str,
        snapshot: str,
        manifest: ArtifactRef | None,
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

    async def restore_running(
        self,
        fence: Fence,
        request_id: str,
        restore_id: str,
        snapshot: str,
        manifest: ArtifactRef | None,
        artifacts: Sequence[ArtifactRef],
        scope: Iterable[EpisodeId],
        *,
        retire_unscoped: bool = False,
        lease_s: float | None = None,
        timeout_s: float | None = None,
    ) -> RestoreResult:
        """Restore into a participant that may hold work (docs/spec.md section 4.16).

        The restore above, without the freshness it requires: once every record is read
        and validated, every attempt of the scoped rollouts up to the saved one is
        retired (refused from then on), with ``retire_unscoped`` every other entry too,
        and only then are the saved episodes installed as N+1. Work it does not name
        keeps its state; the participant stays closed (RESTORED) until resume.
        """
        if not self._config.restore_running:
            raise TurnpointError(
                Reason.INVALID_ARGUMENT,
                "this participant does not serve RestoreRunning (no capability listed)",
                {"field": "restore_running"},
            )
        deadline = Deadline(timeout_s, self._config)
        running = RunningRestore(frozenset(scope), retire_unscoped)
        artifact_refs = tuple(artifacts)
        return await self._control(
            "restore_running",
            fence,
            request_id,
            RestoreResult,
            lambda: self._restore(
                restore_id,
                snapshot,
                manifest,
                artifact_refs,
                running.scope,
                lease_s,
                deadline,
                running=running,
            ),
        )

    async def _restore(
        self,
        restore_id: str,
        snapshot: str,
        manifest: ArtifactRef | None,
        artifacts: tuple[ArtifactRef, ...],
        scope: frozenset[EpisodeId],
        lease_s: float | None,
        deadline: Deadline,
        *,
        running: RunningRestore | None = None,
    ) -> RestoreResult:
        checked_id(snapshot, "snapshot")
        fingerprint = (snapshot, manifest, artifacts, scope, running)
        async with self._shared.changing() as core:
            start = core.begin_restore(
                restore_id, fingerprint, lease_s, self._shared.now(), running=running
            )
            if start.kind is StartKind.REPLAY:
                assert isinstance(start.answer, RestoreResult)
                return start.answer
            if start.kind is StartKind.NEW or self._restore_job is None:
                task = asyncio.create_task(
                    self._drive_restore(restore_id, snapshot, manifest, artifacts, scope, running)
                )
                task.add_done_callback(retrieve)
                self._restore_job = RestoreJob(restore_id, task)
            task = self._restore_job.task
        return await self._await_job(task, deadline, f"restore {restore_id!r}")

    async def _drive_restore(
        self,
        restore_id: str,
        snapshot: str,
        manifest: ArtifactRef | None,
        artifacts: tuple[ArtifactRef, ...],
        scope: frozenset[EpisodeId],
        running: RunningRestore | None = None,
    ) -> RestoreResult:
        installed: list[EpisodeId] = []
        retired: tuple[EpisodeId, ...] = ()
        try:
            records: tuple[Record, ...] = ()
            if manifest is None:
                # docs/spec.md section 4.10: this participant saved nothing in the
                # snapshot, so there is nothing to read and nothing it could continue.
                if scope or artifacts:
                    raise TurnpointError(
                        Reason.INVALID_CHECKPOINT_STATE,
                        f"restore {restore_id!r} names no manifest but a non-empty "
                        "scope or artifacts: nothing was saved here to continue",
                        {"snapshot": snapshot},
                    )
            else:
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
                    raise storage_error(error, f"restore {restore_id!r}") from error
                records = loaded.records
            plan = self._validate_records(records)
            if running is not None:
                retired = await self._retire_for_restore(restore_id, running)
            for record, host in plan:
                key = await host.install(record, record.episode.next_attempt())
                installed.append(key.episode)
            result = RestoreResult(
                restore_id, tuple(sorted(set(installed))), Phase.RESTORED, retired
            )
            async with self._shared.changing() as core:
                core.finish_restore(restore_id, result)
            return result
        except BaseException:
            async with self._shared.changing() as core:
                undone = core.fail_restore(restore_id, self._shared.now())
                if self._restore_job is not None and self._restore_job.restore_id == restore_id:
                    self._restore_job = None
            for key in undone:
                owner = self._hosts.get(slot_of(key))
                if owner is not None:
                    try:
                        await owner.stop(key)
                    except Exception:  # noqa: BLE001 - best effort: the restore already failed
                        logger.exception("could not free %s after a failed restore", key.episode)
            raise

    async def _retire_for_restore(
        self, restore_id: str, running: RunningRestore
    ) -> tuple[EpisodeId, ...]:
        """Stop and free what a running restore replaces; raise if any could not stop.

        What was retired stays retired if the restore then fails: the coordinator reruns
        those rollouts above the retired attempt (docs/spec.md section 4.16 item 5).
        """
        async with self._shared.changing() as core:
            keys = core.retire_for_restore(restore_id, running, self._shared.now())
            tasks = [self._stop_task(key) for key in keys]
        if tasks:
            await asyncio.wait(tasks)
        failed = [t for t in tasks if t.cancelled() or t.exception() is not None]
        if failed:
            error = None if failed[0].cancelled() else failed[0].exception()
            raise TurnpointError(
                Reason.RETIRE_INCOMPLETE,
                f"{len(failed)} of {len(tasks)} replaced attempts could not be stopped: {error!r}",
                {"failed": str(len(failed))},
            )
        return tuple(sorted({key.episode for key in keys}))

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
            task.add_done_callback(retrieve)
            self._stops[key] = task
        return task

    async def _stop_and_drop(self, key: WorkKey) -> None:
        host = self._hosts.get(slot_of(key))
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
