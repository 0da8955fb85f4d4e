"""Taking snapshots: PROTOCOL.md section 7, steps 1-8, and the periodic pump.

:class:`SnapshotDriver` takes one snapshot with the trainer's rollout side
(:class:`~turnpoint.trainer._interfaces.RolloutSide`) and the coordinator:

1. ANCHOR   the trainer anchor is written and durable (an asynchronous write still
            under way is finished first), in ``<root>/<checkpoint_id>/trainer/anchor``;
2. CLOSE    the trainer's dispatch closes and rollout deadlines are held;
3. DRAIN    every result already received is recorded and acknowledged;
   RETIRE   abandoned attempts are retired while the participants are still idle (a
            participant refuses a retire once a checkpoint is open);
4. PREPARE  every participant, under one deadline;
5. (ABORT)  not ready in time, or any failure before publication: the same id is resumed
            everywhere, stragglers that must go are retired, the previous snapshot stays;
6. COMMIT   every participant, with the scope the trainer continues (each agent
            instance's in-flight episodes, minus every restart any participant reported);
7. PUBLISH  the trainer's rollout state and the manifest are validated and published
            atomically (blocking work in threads), then retention and partial cleanup;
8. RESUME   resources, then models, then agents; REOPEN: dispatch reopens and the
            deadline hold is released.

The report (:class:`SnapshotReport`) has one duration per phase, measured as laps of one
clock, so the phases add up to the total exactly (up to float rounding).

Checkpoint ids
--------------
Ids are ``<prefix>-<sequence>`` with ``sequence = epoch * 10**9 + n``: every coordinator
start (a new epoch) continues above every id an earlier incarnation used, including ids
that were aborted and never published, which participants remember as finished and
would refuse (STALE_CHECKPOINT) if they came again.

"Retry the same checkpoint id first", precisely
-----------------------------------------------
A participant that resumed an id answers STALE_CHECKPOINT to any later call for it
(PROTOCOL.md section 4), so an id some participant has seen can never be prepared again.
After a transient failure the pump hands the failed id back to :meth:`SnapshotDriver.take`,
which then:

- retries the very same id if no participant ever saw it (the failure came before
  prepare: anchor, drain, retire);
- otherwise first finishes that id where it is still open (its resume is re-sent, with
  the same request ids, to every participant whose resume failed: "released with the same
  id by the next attempt") and takes the new cut under the next id.

Releases that fail after publication are re-sent the same way at the start of every
:meth:`~SnapshotDriver.take`, skipped snapshots included; until then dispatch to the
affected agent instances stays closed (their leases reopen them anyway).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Protocol

import grpc

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, checkpoint_sequence, make_checkpoint_id
from turnpoint.trainer._config import CoordinatorConfig
from turnpoint.trainer._control_client import Failure, FailureKind, classify
from turnpoint.trainer._coordinator import (
    CommitFailed,
    ControlReport,
    PreparedCheckpoint,
    PrepareFailed,
    Topology,
    UnackedResolver,
)
from turnpoint.trainer._errors import CoordinatorError
from turnpoint.trainer._interfaces import InFlightRollout, RolloutSide
from turnpoint.trainer._manifest import (
    AnchorRef,
    JSONValue,
    ManifestError,
    ParticipantEntry,
    PlacedEpisode,
    SnapshotLayout,
    SnapshotManifest,
    TrainerRolloutState,
)
from turnpoint.trainer._metrics import CoordinatorMetrics

if TYPE_CHECKING:
    import torch

__all__ = [
    "EPOCH_STRIDE",
    "AnchorSource",
    "FailureReason",
    "SnapshotDriver",
    "SnapshotFailuresError",
    "SnapshotInvariantError",
    "SnapshotOutcome",
    "SnapshotParticipants",
    "SnapshotPhase",
    "SnapshotPump",
    "SnapshotReport",
    "SnapshotRunError",
    "TorchAnchorSource",
    "WrittenAnchor",
    "failure_reason",
]

_LOG = logging.getLogger(__name__)

EPOCH_STRIDE: Final = 10**9
"""Checkpoint sequences of epoch ``e`` start above ``e * EPOCH_STRIDE``."""

# Ids participants saw, remembered so that a retry of one moves on to a new id.
_EXPOSED_REMEMBERED: Final = 64


# --------------------------------------------------------------------------- enums


class SnapshotPhase(enum.Enum):
    """The laps of one snapshot attempt; their durations add up to the total."""

    RELEASE = "release"  # re-sending resumes that failed earlier
    ANCHOR = "anchor"
    CLOSE = "close"
    DRAIN = "drain"
    RETIRE = "retire"
    PREPARE = "prepare"
    COMMIT = "commit"
    PUBLISH = "publish"
    RESUME = "resume"
    ABORT = "abort"  # resume (and cleanup) after a failure
    REOPEN = "reopen"


class SnapshotOutcome(enum.Enum):
    PUBLISHED = "published"
    SKIPPED = "skipped"
    FAILED = "failed"


class FailureReason(enum.Enum):
    """Why a snapshot attempt failed, shaped like Flink's ``CheckpointFailureReason``.

    Every reason but :attr:`INVARIANT` is transient: the pump tries again and only
    ``max_consecutive_failures`` of them in a row end the run.
    """

    # Participants answered but could not park everything in time (Flink: declined).
    NOT_READY = "not_ready"
    # A participant could not be reached, or its stream broke (Flink: task failure).
    PARTICIPANT_UNAVAILABLE = "participant_unavailable"
    # A participant, or the trainer's own acknowledgement drain, did not answer in time
    # (Flink: checkpoint expired).
    TIMEOUT = "timeout"
    # A write failed: a participant's disk (STORAGE_UNAVAILABLE), the trainer anchor or
    # the publication (Flink: IO exception).
    STORAGE = "storage"
    # A participant had already finished this checkpoint (its lease ran out) or saw it
    # with other arguments: start a new round under a new id (Flink: subsumed).
    SUPERSEDED = "superseded"
    # A malformed reply, a digest or topology mismatch, a refusal no retry can fix.
    INVARIANT = "invariant"

    @property
    def transient(self) -> bool:
        return self is not FailureReason.INVARIANT


_SUPERSEDING: Final = frozenset({Reason.STALE_CHECKPOINT, Reason.CHECKPOINT_CONFLICT})


def failure_reason(failures: Mapping[str, Failure]) -> FailureReason:
    """The snapshot-level reason for a set of participant failures (worst first)."""
    values = list(failures.values())
    if not values:
        raise ValueError("no failures to explain")
    broken = [f for f in values if not f.retryable]
    if broken:
        if all(f.reason in _SUPERSEDING for f in broken):
            return FailureReason.SUPERSEDED
        return FailureReason.INVARIANT
    if any(f.reason is Reason.STORAGE_UNAVAILABLE for f in values):
        return FailureReason.STORAGE
    transient = [f for f in values if f.kind is FailureKind.TRANSIENT]
    if any(f.code is not grpc.StatusCode.DEADLINE_EXCEEDED for f in transient):
        return FailureReason.PARTICIPANT_UNAVAILABLE
    if transient:
        return FailureReason.TIMEOUT
    return FailureReason.NOT_READY


# -------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class SnapshotReport:
    """What one :meth:`SnapshotDriver.take` did.

    ``phases`` holds the seconds of every phase the attempt went through, in order; they
    add up to ``total_s``. ``admission_closed_s`` is how long the trainer's dispatch was
    closed; ``participant_seconds`` the participants' closed time summed over all of them
    (participants times the seconds from prepare to the end of the resume).
    ``unreleased`` names participants whose resume failed (they stay closed to dispatch
    until the next attempt releases them, or their lease reopens them). ``retry_of`` is
    the failed id handed back by the pump when it could not be reused.
    """

    checkpoint_id: str
    outcome: SnapshotOutcome
    reason: FailureReason | None = None
    detail: str = ""
    phases: Mapping[SnapshotPhase, float] = field(default_factory=dict)
    total_s: float = 0.0
    admission_closed_s: float = 0.0
    participant_seconds: float = 0.0
    failures: Mapping[str, Failure] = field(default_factory=dict)
    unreleased: frozenset[str] = frozenset()
    exposed: bool = False
    retry_of: str | None = None
    continued: int = 0
    restarts: int = 0
    error: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def transient(self) -> bool:
        """A failure the pump retries (false for published and skipped attempts)."""
        return self.reason is not None and self.reason.transient

    @property
    def ok(self) -> bool:
        return self.outcome is not SnapshotOutcome.FAILED


class _Failed(Exception):
    """Internal: ends an attempt with a reason (never escapes the driver)."""

    def __init__(
        self,
        reason: FailureReason,
        detail: str,
        failures: Mapping[str, Failure] | None = None,
        error: BaseException | None = None,
    ) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.failures = dict(failures or {})
        self.error = error


class _Stopwatch:
    """Laps of one clock: each lap is charged to the phase that just ended."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.started = self.last = clock()
        self.phases: dict[SnapshotPhase, float] = {}

    def now(self) -> float:
        return self._clock()

    def lap(self, phase: SnapshotPhase) -> float:
        now = self._clock()
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - self.last)
        self.last = now
        return now

    @property
    def total(self) -> float:
        return self.last - self.started


# ------------------------------------------------------------------------- anchors


@dataclass(frozen=True, slots=True)
class WrittenAnchor:
    """A durable trainer anchor and the training step it holds."""

    ref: AnchorRef
    step: int


class AnchorSource(Protocol):
    """Writes the trainer anchor (model, optimizer, step, loader position)."""

    @property
    def step(self) -> int:
        """The training step an anchor written now would hold."""
        ...

    async def write(self, snapshot: Path) -> WrittenAnchor:
        """Write the anchor into ``<snapshot>/trainer/anchor`` and return it once durable.

        Blocking work must run in threads. Finish any asynchronous write of an earlier
        anchor first: nothing may reference an anchor that is not durable.
        """
        ...


class TorchAnchorSource:
    """:class:`AnchorSource` over torch distributed checkpoint
    (:class:`~turnpoint.trainer._anchor.AnchorWriter`).

    ``step`` and ``data_loader`` are read when an anchor is written. torch is imported
    only when this class is used.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: Callable[[], int],
        data_loader: Callable[[], JSONValue] = lambda: None,
    ) -> None:
        from turnpoint.trainer._anchor import AnchorWriter

        self._model = model
        self._optimizer = optimizer
        self._step = step
        self._data_loader = data_loader
        self.writer = AnchorWriter()

    @property
    def step(self) -> int:
        return self._step()

    async def write(self, snapshot: Path) -> WrittenAnchor:
        if self.writer.pending:
            # Finish the write already under way before anything can reference it.
            await self.writer.wait_async()
        step = self._step()
        await asyncio.to_thread(
            self.writer.start,
            snapshot,
            self._model,
            self._optimizer,
            step=step,
            data_loader=self._data_loader(),
        )
        return WrittenAnchor(await self.writer.wait_async(), step)


# --------------------------------------------------------------- coordinator view


class SnapshotParticipants(Protocol):
    """What the driver needs of :class:`~turnpoint.trainer._coordinator.Coordinator`."""

    @property
    def topology(self) -> Topology: ...

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        expected: Mapping[str, Iterable[EpisodeId]] | None = None,
        resolve: UnackedResolver | None = None,
    ) -> PreparedCheckpoint: ...

    def held(
        self, checkpoint: PreparedCheckpoint
    ) -> AbstractAsyncContextManager[PreparedCheckpoint]: ...

    async def commit(
        self, checkpoint_id: str, snapshot: str, scope: Mapping[str, Iterable[EpisodeId]]
    ) -> dict[str, ParticipantEntry]: ...

    async def resume(
        self, checkpoint_id: str, instances: Iterable[str] | None = None
    ) -> ControlReport: ...

    async def retire(
        self, episodes: Mapping[str, Iterable[EpisodeId]], *, key: str | None = None
    ) -> ControlReport: ...


# -------------------------------------------------------------------------- driver


@dataclass(eq=False)
class _Attempt:
    """Bookkeeping of one attempt, for the report."""

    checkpoint_id: str
    exposed: bool = False
    published: bool = False
    closed_at: float | None = None
    prepare_started: float | None = None
    released_at: float | None = None
    reopened_at: float | None = None
    continued: int = 0
    restarts: int = 0
    cut_version: int | None = None
    step: int | None = None


class _LockHold:
    """The driver's hold of the trainer's step lock: released once, whoever asks first."""

    def __init__(self, lock: asyncio.Lock | None) -> None:
        self._lock = lock
        self._held = False

    async def acquire(self) -> None:
        if self._lock is not None:
            await self._lock.acquire()
            self._held = True

    def release(self) -> None:
        if self._held and self._lock is not None:
            self._held = False
            self._lock.release()


def _reason_of_error(error: BaseException) -> FailureReason:
    """An exception the rollout side raised while draining or resolving."""
    if isinstance(error, TimeoutError):
        return FailureReason.TIMEOUT
    if isinstance(error, ConnectionError):
        return FailureReason.PARTICIPANT_UNAVAILABLE
    return failure_reason({"trainer": classify(error)})


class SnapshotDriver:
    """Takes snapshots (see the module docstring). One attempt at a time.

    ``epoch`` is the coordinator's epoch (ids continue above every earlier one, see
    "Checkpoint ids"). ``step_lock``, if given, is held from the anchor until the rollout
    state is captured: a training loop that holds it around each optimizer step makes
    the recorded queue exactly the one the anchor's step left. ``clock`` measures
    phases; ``wall_clock`` stamps manifests.
    """

    def __init__(
        self,
        *,
        coordinator: SnapshotParticipants,
        rollouts: RolloutSide,
        anchor: AnchorSource,
        layout: SnapshotLayout,
        config: CoordinatorConfig,
        epoch: int,
        id_prefix: str = "ck",
        metrics: CoordinatorMetrics | None = None,
        step_lock: asyncio.Lock | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"epoch must be an integer >= 1, got {epoch!r}")
        make_checkpoint_id(id_prefix, 0)  # validates the prefix now
        self._coordinator = coordinator
        self._rollouts = rollouts
        self._anchor = anchor
        self._layout = layout
        self._config = config
        self._epoch = epoch
        self._prefix = id_prefix
        self._metrics = metrics
        self._step_lock = step_lock
        self._clock = clock
        self._wall_clock = wall_clock
        self._sequence: int | None = None
        self._exposed: deque[str] = deque(maxlen=_EXPOSED_REMEMBERED)
        # checkpoint id -> participants whose resume of it has not succeeded yet.
        self._unreleased: dict[str, set[str]] = {}
        # Attempts a prepare said must be retired, not yet retired.
        self._stragglers: dict[str, set[EpisodeId]] = {}
        self._last_published: tuple[int, int] | None = None
        self._warned_admission = False
        self._busy = asyncio.Lock()

    # -- ids ---------------------------------------------------------------------------

    async def _ensure_sequence(self) -> int:
        if self._sequence is None:
            published = await asyncio.to_thread(self._layout.list_published)
            newest = checkpoint_sequence(published[0]) if published else 0
            self._sequence = max(self._epoch * EPOCH_STRIDE, newest) + 1
        return self._sequence

    async def next_checkpoint_id(self) -> str:
        """The id the next new attempt uses (it only advances once participants saw it)."""
        return make_checkpoint_id(self._prefix, await self._ensure_sequence())

    def _expose(self, checkpoint_id: str) -> None:
        self._exposed.append(checkpoint_id)
        self._sequence = max(self._sequence or 0, checkpoint_sequence(checkpoint_id) + 1)

    def seen_by_participants(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._exposed

    @property
    def unreleased(self) -> Mapping[str, frozenset[str]]:
        """Checkpoint ids whose resume still failed somewhere, and where."""
        return MappingProxyType({k: frozenset(v) for k, v in self._unreleased.items()})

    @property
    def last_published(self) -> tuple[int, int] | None:
        """``(rollout version, step)`` of the last snapshot this driver published."""
        return self._last_published

    # -- the snapshot ------------------------------------------------------------------

    async def take(self, checkpoint_id: str | None = None) -> SnapshotReport:
        """Take one snapshot; never raises for a failed attempt (the report says why).

        ``checkpoint_id`` is the id to retry (the pump passes the last failed one); if a
        participant has seen it, it is finished first and a new id is used.
        """
        async with self._busy:
            return await self._take(checkpoint_id)

    async def _take(self, requested: str | None) -> SnapshotReport:
        watch = _Stopwatch(self._clock)
        retry_of = None
        if requested is not None and self.seen_by_participants(requested):
            retry_of = requested
            requested = None
        checkpoint_id = requested or await self.next_checkpoint_id()
        attempt = _Attempt(checkpoint_id)
        await self.release_pending()
        watch.lap(SnapshotPhase.RELEASE)
        if self._last_published is not None and self._last_published == (
            self._rollouts.version,
            self._anchor.step,
        ):
            return self._report(watch, attempt, SnapshotOutcome.SKIPPED, retry_of=retry_of)
        try:
            await self._attempt(attempt, watch)
        except _Failed as failed:
            return self._report(
                watch,
                attempt,
                SnapshotOutcome.FAILED,
                reason=failed.reason,
                detail=failed.detail,
                failures=failed.failures,
                error=failed.error,
                retry_of=retry_of,
            )
        assert attempt.cut_version is not None and attempt.step is not None
        self._last_published = (attempt.cut_version, attempt.step)
        return self._report(watch, attempt, SnapshotOutcome.PUBLISHED, retry_of=retry_of)

    async def _attempt(self, attempt: _Attempt, watch: _Stopwatch) -> None:
        checkpoint_id = attempt.checkpoint_id
        step_lock = _LockHold(self._step_lock)
        await step_lock.acquire()
        try:
            written = await self._write_anchor(attempt, watch)
            rollouts = self._rollouts
            rollouts.close_dispatch()
            hold = rollouts.hold_deadlines(f"snapshot {checkpoint_id}")
            attempt.closed_at = watch.lap(SnapshotPhase.CLOSE)
            try:
                await self._cut(attempt, watch, written, step_lock)
            finally:
                unreleased = self._unreleased.get(checkpoint_id, set())
                for instance in self._agents():
                    if instance in unreleased:
                        # Released by the next attempt, or by its own lease.
                        rollouts.close_dispatch_to(instance)
                rollouts.reopen_dispatch()
                rollouts.release_deadlines(hold)
                attempt.reopened_at = watch.lap(SnapshotPhase.REOPEN)
        finally:
            step_lock.release()
            if not attempt.published:
                await self._discard(attempt)
                watch.lap(SnapshotPhase.ABORT)

    def _agents(self) -> tuple[str, ...]:
        try:
            return self._coordinator.topology.agents
        except RuntimeError:
            return ()

    def _participant_count(self) -> int:
        try:
            return len(self._coordinator.topology.instances)
        except RuntimeError:
            return 0

    async def _write_anchor(self, attempt: _Attempt, watch: _Stopwatch) -> WrittenAnchor:
        checkpoint_id = attempt.checkpoint_id
        try:
            snapshot = await asyncio.to_thread(self._layout.begin, checkpoint_id)
            written = await self._anchor.write(snapshot)
        except ManifestError as error:
            # begin() refused the id (published already, not newer): a bookkeeping bug.
            raise _Failed(FailureReason.INVARIANT, str(error), error=error) from error
        except (OSError, TurnpointError) as error:
            raise _Failed(FailureReason.STORAGE, f"trainer anchor: {error}", error=error) from error
        finally:
            watch.lap(SnapshotPhase.ANCHOR)
        attempt.step = written.step
        return written

    async def _cut(
        self,
        attempt: _Attempt,
        watch: _Stopwatch,
        written: WrittenAnchor,
        step_lock: _LockHold,
    ) -> None:
        rollouts = self._rollouts
        checkpoint_id = attempt.checkpoint_id
        try:
            await rollouts.drain_acknowledgements(self._config.control_timeout_s)
        except (TimeoutError, OSError, TurnpointError, grpc.RpcError) as error:
            raise _Failed(
                _reason_of_error(error), f"draining acknowledgements: {error}", error=error
            ) from error
        finally:
            watch.lap(SnapshotPhase.DRAIN)
        try:
            await self._flush_retires()
        finally:
            watch.lap(SnapshotPhase.RETIRE)

        in_flight = tuple(rollouts.in_flight())
        expected: dict[str, list[EpisodeId]] = {}
        for rollout in in_flight:
            expected.setdefault(rollout.instance, []).append(rollout.episode)
        self._expose(checkpoint_id)
        attempt.exposed = True
        attempt.prepare_started = watch.now()
        try:
            prepared = await self._coordinator.prepare(
                checkpoint_id, expected=expected, resolve=rollouts.resolve_unacknowledged
            )
        except PrepareFailed as error:
            watch.lap(SnapshotPhase.PREPARE)
            await self._abort(attempt, watch, error.retire)
            raise _Failed(
                failure_reason(error.failures), str(error), error.failures, error
            ) from error
        except BaseException:
            watch.lap(SnapshotPhase.PREPARE)
            await self._abort(attempt, watch, {})
            raise
        watch.lap(SnapshotPhase.PREPARE)
        # Everything is parked now: the trainer's books and the participants' state are
        # the same cut, read here together without yielding. The in-flight list read
        # before prepare was only a hint: a rollout whose result arrived while prepare
        # waited is in the queue now and must not also be continued or restarted.
        in_flight = tuple(rollouts.in_flight())
        state = rollouts.rollout_state()
        attempt.cut_version = rollouts.version
        step_lock.release()
        try:
            async with self._coordinator.held(prepared):
                await self._commit_and_publish(attempt, watch, prepared, in_flight, state, written)
        finally:
            attempt.released_at = watch.lap(
                SnapshotPhase.RESUME if attempt.published else SnapshotPhase.ABORT
            )
            self._note_release(checkpoint_id, prepared.release)

    async def _commit_and_publish(
        self,
        attempt: _Attempt,
        watch: _Stopwatch,
        prepared: PreparedCheckpoint,
        in_flight: Sequence[InFlightRollout],
        state: TrainerRolloutState,
        written: WrittenAnchor,
    ) -> None:
        checkpoint_id = attempt.checkpoint_id
        topology = self._coordinator.topology
        restarts = prepared.all_restarts
        agents = set(topology.agents)
        strangers = sorted({r.instance for r in in_flight} - agents)
        if strangers:
            raise _Failed(
                FailureReason.INVARIANT,
                f"rollouts run on instance(s) the topology has no agent for: {strangers}",
            )
        candidates = [r for r in in_flight if r.episode not in restarts]
        candidate_ids = frozenset(r.episode for r in candidates)
        scope: dict[str, frozenset[EpisodeId]] = {}
        for instance in topology.instances:
            if instance in agents:
                scope[instance] = frozenset(r.episode for r in candidates if r.instance == instance)
            else:
                # Resources and models export what they hold of the continued episodes.
                scope[instance] = candidate_ids
        try:
            entries = await self._coordinator.commit(checkpoint_id, checkpoint_id, scope)
        except CommitFailed as error:
            raise _Failed(
                failure_reason(error.failures), str(error), error.failures, error
            ) from error
        finally:
            watch.lap(SnapshotPhase.COMMIT)

        continued = [
            PlacedEpisode(r.episode, r.instance)
            for r in candidates
            if r.episode in entries[r.instance].exported
        ]
        kept = {placed.episode for placed in continued}
        restarted = [
            PlacedEpisode(r.episode, r.instance) for r in in_flight if r.episode not in kept
        ]
        attempt.continued, attempt.restarts = len(continued), len(restarted)
        try:
            manifest = SnapshotManifest(
                checkpoint_id=checkpoint_id,
                step=written.step,
                created_at=self._wall_clock(),
                anchor=written.ref,
                participants=tuple(entries.values()),
                continued=tuple(continued),
                restarts=tuple(restarted),
                rollout_state=state,
            )
            await asyncio.to_thread(
                self._layout.publish, self._layout.path(checkpoint_id), manifest
            )
            attempt.published = True
            try:
                await asyncio.to_thread(self._housekeeping)
            except (OSError, ManifestError) as error:
                # Published is published: old snapshots are removed by a later attempt.
                _LOG.warning("retention after %s failed: %s", checkpoint_id, error)
        except ManifestError as error:
            raise _Failed(FailureReason.INVARIANT, str(error), error=error) from error
        except OSError as error:
            raise _Failed(FailureReason.STORAGE, f"publishing: {error}", error=error) from error
        finally:
            watch.lap(SnapshotPhase.PUBLISH)

    def _housekeeping(self) -> None:
        removed = self._layout.retain(self._config.keep_snapshots)
        cleaned = self._layout.clean_partial()
        if removed or cleaned:
            _LOG.info("retention removed %s; partial cleanup removed %s", removed, cleaned)

    # -- failure paths -----------------------------------------------------------------

    async def _abort(
        self,
        attempt: _Attempt,
        watch: _Stopwatch,
        retire: Mapping[str, Sequence[EpisodeId]],
    ) -> None:
        """Resume the same id everywhere, then retire the stragglers that must go."""
        checkpoint_id = attempt.checkpoint_id
        report = await self._coordinator.resume(checkpoint_id)
        self._note_release(checkpoint_id, report)
        for instance, episodes in retire.items():
            self._stragglers.setdefault(instance, set()).update(episodes)
        if self._stragglers:
            try:
                await self._flush_retires()
            except _Failed as failed:
                _LOG.warning("retiring stragglers of %s failed: %s", checkpoint_id, failed.detail)
        attempt.released_at = watch.lap(SnapshotPhase.ABORT)

    def _note_release(self, checkpoint_id: str, report: ControlReport | None) -> None:
        if report is None:
            return
        still = self._unreleased.setdefault(checkpoint_id, set())
        still.difference_update(report.succeeded)
        still.update(report.failures)
        if not still:
            del self._unreleased[checkpoint_id]

    async def release_pending(self) -> ControlReport | None:
        """Re-send the resumes that failed earlier, same ids, to where they failed.

        Dispatch to an agent instance reopens once it is released. Returns the merged
        report (``None`` when nothing was pending).
        """
        if not self._unreleased:
            return None
        reports = []
        for checkpoint_id, instances in sorted(self._unreleased.items()):
            report = await self._coordinator.resume(checkpoint_id, sorted(instances))
            reports.append(report)
            self._note_release(checkpoint_id, report)
        still = set().union(*self._unreleased.values()) if self._unreleased else set()
        for instance in self._agents():
            if instance not in still and any(instance in r.succeeded for r in reports):
                self._rollouts.reopen_dispatch_to(instance)
        return ControlReport.merge("resume", "pending", reports)

    async def _flush_retires(self) -> None:
        """Retire abandoned attempts on idle participants (still closed ones wait)."""
        pending: dict[str, set[EpisodeId]] = {
            instance: set(episodes)
            for instance, episodes in self._rollouts.pending_retires().items()
        }
        for instance, episodes in self._stragglers.items():
            pending.setdefault(instance, set()).update(episodes)
        closed = set().union(*self._unreleased.values()) if self._unreleased else set()
        chosen = {i: tuple(sorted(e)) for i, e in pending.items() if e and i not in closed}
        if not chosen:
            return
        report = await self._coordinator.retire(chosen)
        for instance in sorted(report.succeeded):
            self._rollouts.retired(instance, chosen[instance])
            straggling = self._stragglers.get(instance)
            if straggling is not None:
                straggling.difference_update(chosen[instance])
                if not straggling:
                    del self._stragglers[instance]
        if report.failures:
            raise _Failed(
                failure_reason(report.failures),
                f"retiring abandoned attempts failed on {sorted(report.failures)}",
                report.failures,
            )

    async def _discard(self, attempt: _Attempt) -> None:
        # A participant whose resume failed may still be writing there; the partial
        # cleanup after the next publication removes it instead.
        if attempt.checkpoint_id in self._unreleased:
            return
        try:
            await asyncio.to_thread(self._layout.discard, attempt.checkpoint_id)
        except (OSError, ManifestError) as error:
            _LOG.warning("could not remove the partial %s: %s", attempt.checkpoint_id, error)

    # -- reporting ---------------------------------------------------------------------

    def _report(
        self,
        watch: _Stopwatch,
        attempt: _Attempt,
        outcome: SnapshotOutcome,
        *,
        reason: FailureReason | None = None,
        detail: str = "",
        failures: Mapping[str, Failure] | None = None,
        error: BaseException | None = None,
        retry_of: str | None = None,
    ) -> SnapshotReport:
        closed_s = 0.0
        if attempt.closed_at is not None and attempt.reopened_at is not None:
            closed_s = attempt.reopened_at - attempt.closed_at
        participant_seconds = 0.0
        if attempt.prepare_started is not None and attempt.released_at is not None:
            participant_seconds = self._participant_count() * (
                attempt.released_at - attempt.prepare_started
            )
        report = SnapshotReport(
            checkpoint_id=attempt.checkpoint_id,
            outcome=outcome,
            reason=reason,
            detail=detail,
            phases=MappingProxyType(dict(watch.phases)),
            total_s=watch.total,
            admission_closed_s=closed_s,
            participant_seconds=participant_seconds,
            failures=MappingProxyType(dict(failures or {})),
            unreleased=frozenset(self._unreleased.get(attempt.checkpoint_id, ())),
            exposed=attempt.exposed,
            retry_of=retry_of,
            continued=attempt.continued,
            restarts=attempt.restarts,
            error=error,
        )
        self._log(report)
        if self._metrics is not None:
            self._metrics.observe_snapshot(
                outcome=outcome.value,
                reason=reason.value if reason is not None else "",
                total_s=report.total_s,
                phases={phase.value: seconds for phase, seconds in report.phases.items()},
                admission_closed_s=closed_s,
                participant_seconds=participant_seconds,
            )
            if report.unreleased and outcome is SnapshotOutcome.PUBLISHED:
                self._metrics.release_failures.inc(len(report.unreleased))
        return report

    def _log(self, report: SnapshotReport) -> None:
        interval = self._config.snapshot_interval_s
        if report.admission_closed_s > interval and not self._warned_admission:
            self._warned_admission = True
            _LOG.warning(
                "snapshot %s kept rollout admission closed for %.1f s, longer than the "
                "snapshot interval of %g s: raise snapshot_interval_s or find the slow "
                "phase (%s); warned once per run",
                report.checkpoint_id,
                report.admission_closed_s,
                interval,
                ", ".join(f"{p.value} {s:.1f}s" for p, s in report.phases.items()),
            )
        if report.outcome is SnapshotOutcome.FAILED:
            _LOG.warning(
                "snapshot %s failed (%s): %s",
                report.checkpoint_id,
                report.reason.value if report.reason else "?",
                report.detail,
            )
        elif report.outcome is SnapshotOutcome.PUBLISHED:
            _LOG.info(
                "snapshot %s published in %.2f s (%d continued, %d restarts)",
                report.checkpoint_id,
                report.total_s,
                report.continued,
                report.restarts,
            )


# ---------------------------------------------------------------------------- pump


class SnapshotRunError(CoordinatorError):
    """The snapshot pump ends the run; ``reports`` are the attempts that led to it."""

    _reason = Reason.UNAVAILABLE

    def __init__(self, message: str, reports: Sequence[SnapshotReport]) -> None:
        super().__init__(self._reason, message, {"attempts": str(len(reports))})
        self.reports = tuple(reports)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.reports))


class SnapshotFailuresError(SnapshotRunError):
    """``max_consecutive_failures`` transient failures in a row."""


class SnapshotInvariantError(SnapshotRunError):
    """A failure no retry can fix (a malformed reply, a digest or topology mismatch)."""

    _reason = Reason.PROTOCOL_VIOLATION


class SnapshotPump:
    """Takes a snapshot every ``snapshot_interval_s``; ends the run when it must.

    After a transient failure the next tick hands the same checkpoint id back to the
    driver (see the module docstring for what that means once participants saw it).
    ``clock`` and ``sleep`` are injectable so that tests run hours of ticks instantly.
    """

    def __init__(
        self,
        driver: SnapshotDriver,
        config: CoordinatorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self._driver = driver
        self._config = config
        self._clock = clock
        self._sleep = sleep
        self._retry_id: str | None = None
        self._failures: list[SnapshotReport] = []

    @property
    def consecutive_failures(self) -> int:
        return len(self._failures)

    @property
    def retry_id(self) -> str | None:
        """The id the next tick retries, after a transient failure."""
        return self._retry_id

    async def tick(self) -> SnapshotReport:
        """One attempt. Raises :class:`SnapshotRunError` when the run must end."""
        report = await self._driver.take(self._retry_id)
        if report.outcome is SnapshotOutcome.PUBLISHED:
            self._failures.clear()
            self._retry_id = None
        elif report.outcome is SnapshotOutcome.FAILED:
            self._failures.append(report)
            self._retry_id = report.checkpoint_id
            if not report.transient:
                raise SnapshotInvariantError(
                    f"snapshot {report.checkpoint_id} broke an invariant, which a retry "
                    f"would only hide; stopping the run: {report.detail}",
                    self._failures,
                ) from report.error
            limit = self._config.max_consecutive_failures
            if len(self._failures) >= limit:
                reasons = ", ".join(
                    f"{r.checkpoint_id}: {r.reason.value if r.reason else '?'}"
                    for r in self._failures
                )
                raise SnapshotFailuresError(
                    f"{len(self._failures)} snapshot attempts failed in a row "
                    f"(max_consecutive_failures = {limit}; {reasons}); the last: "
                    f"{report.detail}. The previous published snapshot is intact: fix the "
                    "cause and restart from it, or raise max_consecutive_failures",
                    self._failures,
                ) from report.error
        return report

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Tick every ``snapshot_interval_s`` until ``stop`` is set; raises
        :class:`SnapshotRunError` to end the run."""
        interval = self._config.snapshot_interval_s
        next_at = self._clock() + interval
        while stop is None or not stop.is_set():
            delay = max(0.0, next_at - self._clock())
            if stop is None:
                await self._sleep(delay)
            else:
                sleeping = asyncio.ensure_future(self._sleep(delay))
                stopping = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait({sleeping, stopping}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleeping.cancel()
                    stopping.cancel()
                if stop.is_set():
                    return
            await self.tick()
            # A slow snapshot does not cause a burst of catch-up ticks.
            next_at = max(next_at + interval, self._clock())
