"""Taking snapshots: docs/spec.md section 7.4, the release, steps 1-8 and the skip.

:class:`SnapshotDriver` takes one snapshot with the trainer's rollout side
(:class:`~turnpoint.trainer.rollouts.side.RolloutSide`) and the coordinator. Each attempt is
one :class:`~turnpoint.trainer.snapshots.attempt.SnapshotAttempt` whose state says where it is; the driver
moves it in one place (:meth:`SnapshotDriver._set_state`), and watchers
(:meth:`SnapshotDriver.subscribe`: the metrics, the demo's display and kill switch) are
told of every transition:

1. ANCHOR   the trainer anchor is written and durable (an asynchronous write still
            under way is finished first), in ``<root>/<checkpoint_id>/trainer/anchor``;
2. CLOSE    the trainer's dispatch closes and rollout deadlines are held;
3. DRAIN    every result already received is recorded and acknowledged;
   RETIRE   attempts abandoned since the release are retired, on their agent and every
            resources server, while the participants are still idle (a participant
            refuses a retire once a checkpoint is open);
4. PREPARE  every participant, under one deadline; the books are read, and dispatch
            reopens: a new rollout is in no cut and waits at its agent for admission;
5. ABORT    not ready in time, or any failure before publication: the same id is resumed
            everywhere, stragglers that must go are retired, the previous snapshot stays;
6. COMMIT   every participant, with the scope the core decides
            (:func:`~turnpoint.trainer.snapshots.core.scope_commit`: each agent
            instance's in-flight episodes, minus every restart any participant
            reported); each commit ends its participant's checkpoint at the export
            (release), and who committed in its prepare is resumed meanwhile;
7. PUBLISH  the trainer's rollout state and the manifest are validated and published
            atomically (blocking work in threads), then retention and partial cleanup;
8. RESUME   whoever is not released yet: resources, then models, then agents; REOPEN:
            the gate moves and the deadline hold is released, or kept while some
            participant's resume failed (until its release retry succeeds or its lease
            has surely run out).

Before step 1 every attempt is in RELEASE: it re-sends resumes that failed earlier, ends
SKIPPED when nothing changed, and otherwise retires ended attempts and forgets the
refusal marks of rollouts nothing of which can arrive any more (docs/spec.md section 7.6
item 6), all while dispatch is still open. The report's phases are the time spent in
each state, so they add up to the total by construction; ``admission_closed_s`` runs
from CLOSE to the reopen after the books are read.

Checkpoint ids
--------------
Ids are ``<prefix>-<sequence>`` with ``sequence = epoch * 10**9 + n``: every coordinator
start (a new epoch) continues above every id an earlier incarnation used, including ids
that were aborted and never published, which participants remember as finished and
would refuse (STALE_CHECKPOINT) if they came again.

"Retry the same checkpoint id first", precisely
-----------------------------------------------
A participant that resumed an id answers STALE_CHECKPOINT to any later call for it
(docs/spec.md section 4.4), so an id some participant has seen can never be prepared
again. After a transient failure the pump hands the failed id back to
:meth:`SnapshotDriver.take`, which then:

- retries the very same id if no participant ever saw it (the failure came before
  prepare: anchor, drain, retire);
- otherwise first finishes that id where it is still open (its resume is re-sent, with
  the same request ids, to every participant whose resume failed: "released with the same
  id by the next attempt") and takes the new cut under the next id.

A participant that refused a fresh id as finished (someone resumed a far-future id there)
is probed by the coordinator for how far it finished (``PrepareFailed.finished_through``),
and the sequence moves past that, so the next attempt's id is fresh everywhere.

Releases that fail after publication are re-sent the same way at the start of every
:meth:`~SnapshotDriver.take`, skipped snapshots included; until then dispatch to the
affected agent instances stays closed (their leases reopen them anyway).

The pump, the anchor source and the report live in :mod:`turnpoint.trainer.snapshots.pump`,
:mod:`turnpoint.trainer.anchors.source` and :mod:`turnpoint.trainer.snapshots.report`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, suppress
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Protocol

import grpc

from turnpoint.errors import TurnpointError
from turnpoint.ids import EpisodeId, checkpoint_sequence, make_checkpoint_id
from turnpoint.protocol import ParticipantKind
from turnpoint.storage import StorageError
from turnpoint.trainer.anchors.source import AnchorSource, WrittenAnchor
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.control.failures import Failure, classify
from turnpoint.trainer.control.outcomes import (
    CommitFailed,
    ControlReport,
    PreparedCheckpoint,
    PrepareFailed,
)
from turnpoint.trainer.control.topology import Topology
from turnpoint.trainer.metrics import CoordinatorMetrics
from turnpoint.trainer.rollouts.deadlines import Hold
from turnpoint.trainer.rollouts.refusal_marks import RefusalMarks, RetainedNames, rollouts_named
from turnpoint.trainer.rollouts.side import InFlightRollout, RolloutSide
from turnpoint.trainer.snapshots.attempt import (
    SnapshotAttempt,
    SnapshotAttemptView,
    SnapshotState,
    Transition,
)
from turnpoint.trainer.snapshots.core import attribute_commit, scope_commit
from turnpoint.trainer.snapshots.preparing import UnackedResolver
from turnpoint.trainer.snapshots.report import (
    FailureReason,
    SnapshotOutcome,
    SnapshotReport,
    failure_reason,
)
from turnpoint.trainer.storage.layout import SnapshotLayout
from turnpoint.trainer.storage.manifest import (
    JSONValue,
    ManifestError,
    ParticipantEntry,
    SnapshotManifest,
    TrainerRolloutState,
)
from turnpoint.trainer.storage.objects import StoreLayout

if TYPE_CHECKING:
    from turnpoint.trainer.restore.restorer import RestorePlan


_LOG = logging.getLogger(__name__)

# A watcher of attempts: (checkpoint id, old state, new state, now), after each move.
TransitionCallback = Callable[[str, SnapshotState, SnapshotState, float], None]

EPOCH_STRIDE: Final = 10**9
"""Checkpoint sequences of epoch ``e`` start above ``e * EPOCH_STRIDE``."""

# The kept-hold timer fires this much after the lease, so that it never runs a hair before
# the expiry the driver's own clock computes (loop time and that clock may differ).
_HOLD_CHECK_MARGIN_S: Final = 0.5

# Ids participants saw, remembered so that a retry of one moves on to a new id.
_EXPOSED_REMEMBERED: Final = 64

_S = SnapshotState


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


# --------------------------------------------------------------- coordinator view


class SnapshotParticipants(Protocol):
    """What the driver needs of :class:`~turnpoint.trainer.control.coordinator.Coordinator`."""

    @property
    def topology(self) -> Topology: ...

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        resolve: UnackedResolver | None = None,
        snapshot: str | None = None,
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

    async def forget(self, rollout_ids: Mapping[str, Iterable[str]]) -> ControlReport: ...


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
    the recorded queue exactly the one the anchor's step left. ``clock`` times the
    attempts' transitions; ``wall_clock`` stamps manifests. ``metrics``, if given,
    watches every attempt's transitions (:meth:`subscribe`) and every report.
    ``manifest_extra``, if given, is read with the anchor (under ``step_lock``) and
    becomes the manifest's ``extra`` (docs/spec.md section 8.6): the facade keeps the
    weights version there.
    """

    def __init__(
        self,
        *,
        coordinator: SnapshotParticipants,
        rollouts: RolloutSide,
        anchor: AnchorSource,
        layout: SnapshotLayout | StoreLayout,
        config: CoordinatorConfig,
        epoch: int,
        id_prefix: str = "ck",
        metrics: CoordinatorMetrics | None = None,
        step_lock: asyncio.Lock | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        manifest_extra: Callable[[], Mapping[str, JSONValue]] | None = None,
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
        self._manifest_extra = manifest_extra
        self._sequence: int | None = None
        self._exposed: deque[str] = deque(maxlen=_EXPOSED_REMEMBERED)
        # checkpoint id -> participants whose resume of it has not succeeded yet.
        self._unreleased: dict[str, set[str]] = {}
        # The restore ids among them (adopt_restore): a prepare cannot supersede those.
        self._restores: set[str] = set()
        # Attempts a prepare said must be retired, not yet retired.
        self._stragglers: dict[str, set[EpisodeId]] = {}
        # Refusal marks this driver raised, and the rollouts the retained snapshots
        # name (docs/spec.md section 7.6 item 6).
        self._marks = RefusalMarks()
        self._named = RetainedNames()
        # Deadline holds kept past their snapshot while a participant's resume of it
        # has not succeeded: checkpoint id -> (hold, when its lease has surely run out).
        self._kept_holds: dict[str, tuple[Hold, float]] = {}
        self._last_published: tuple[int, int] | None = None
        self._warned_admission = False
        self._busy = asyncio.Lock()
        self._subscribers: list[TransitionCallback] = []
        # The subscribers when the current attempt began: they watch it to its end.
        self._watchers: tuple[TransitionCallback, ...] = ()
        self._attempt: SnapshotAttempt | None = None
        if metrics is not None:
            self.subscribe(metrics.on_transition)

    # -- watching ----------------------------------------------------------------------

    def subscribe(self, callback: TransitionCallback) -> Callable[[], None]:
        """Call ``callback(attempt id, old state, new state, now)`` on every transition of
        every attempt that starts from now on, in subscription order; returns a function
        that unsubscribes (from the next attempt on).

        Callbacks run on the event loop, inside the driver: they must be quick and must
        not block. One that raises an ``Exception`` is logged and ignored.
        """
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    @property
    def attempt(self) -> SnapshotAttemptView | None:
        """The attempt under way (or the last one), as watchers may read it."""
        return self._attempt.view() if self._attempt is not None else None

    def _set_state(self, attempt: SnapshotAttempt, state: SnapshotState) -> None:
        """The one place an attempt moves
        (:data:`~turnpoint.trainer.snapshots.attempt.TRANSITIONS`); its watchers are told
        once the move is made."""
        self._tell(attempt.set_state(state, self._clock()))

    def _tell(self, transition: Transition) -> None:
        for subscriber in self._watchers:
            try:
                subscriber(transition.checkpoint_id, transition.old, transition.new, transition.now)
            # A watcher's bug must not become the snapshot's failure; BaseExceptions
            # (a simulated kill, cancellation) are not caught and end the attempt here.
            except Exception:  # noqa: BLE001
                _LOG.exception(
                    "a watcher of snapshot %s failed on %s -> %s",
                    transition.checkpoint_id,
                    transition.old.value,
                    transition.new.value,
                )

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

    def _move_past(self, finished_sequence: int) -> None:
        """docs/spec.md section 7.2 item 4: a participant finished ids up to this sequence
        (a Resume of a far-future id): the next attempt starts above it."""
        if finished_sequence >= (self._sequence or 0):
            _LOG.warning(
                "a participant finished checkpoint ids up to sequence %d; the next "
                "attempt continues above it",
                finished_sequence,
            )
            self._sequence = finished_sequence + 1

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
        retry_of = None
        if requested is not None and self.seen_by_participants(requested):
            retry_of = requested
            requested = None
        if self._metrics is not None and (requested or retry_of):
            self._metrics.retried_snapshot(same_id=retry_of is None)
        checkpoint_id = requested or await self.next_checkpoint_id()
        attempt = self._attempt = SnapshotAttempt(checkpoint_id, self._clock())
        self._watchers = tuple(self._subscribers)
        self._set_state(attempt, _S.RELEASE)
        await self.release_pending()
        if self._last_published is not None and self._last_published == (
            self._rollouts.version,
            self._anchor.step,
        ):
            self._set_state(attempt, _S.SKIPPED)
            return self._report(attempt, SnapshotOutcome.SKIPPED, retry_of=retry_of)
        if held := {i for r in self._restores for i in self._unreleased.get(r, ())}:
            self._set_state(attempt, _S.FAILED)
            return self._report(
                attempt,
                SnapshotOutcome.FAILED,
                reason=FailureReason.PARTICIPANT_UNAVAILABLE,
                detail=f"{sorted(held)} not released from restore {sorted(self._restores)} yet",
                retry_of=retry_of,
            )
        try:
            # Retiring ended attempts needs idle participants but not a closed dispatch:
            # done here, before the anchor, it keeps its round trips out of the time
            # dispatch is closed (docs/spec.md section 7.4, the release).
            await self._flush_retires()
            await self._forget_settled()
            await self._run(attempt)
        except _Failed as failed:
            self._set_state(attempt, _S.FAILED)
            return self._report(
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
        self._set_state(attempt, _S.PUBLISHED)
        return self._report(attempt, SnapshotOutcome.PUBLISHED, retry_of=retry_of)

    async def _run(self, attempt: SnapshotAttempt) -> None:
        """Steps 1-8. However it ends, dispatch reopens if it was closed and an attempt
        that did not publish ends in ABORT, its partial snapshot discarded."""
        step_lock = _LockHold(self._step_lock)
        hold: Hold | None = None
        try:
            self._set_state(attempt, _S.ANCHOR)
            await step_lock.acquire()
            written = await self._write_anchor(attempt)
            # Read with the anchor, under the step lock: what the application keeps
            # beside it (the weights version) describes the same step.
            extra = dict(self._manifest_extra()) if self._manifest_extra is not None else {}
            self._set_state(attempt, _S.CLOSE)
            self._rollouts.close_dispatch()
            hold = self._rollouts.hold_deadlines(f"snapshot {attempt.checkpoint_id}")
            await self._cut(attempt, written, step_lock, extra)
        finally:
            step_lock.release()
            if hold is not None:
                self._reopen(attempt, hold)
            if not attempt.published:
                self._set_state(attempt, _S.ABORT)
                await self._discard(attempt)

    def _reopen(self, attempt: SnapshotAttempt, hold: Hold) -> None:
        """Step 8's end: reopen dispatch (not to instances still unreleased) and release
        the deadline hold."""
        rollouts = self._rollouts
        try:
            self._set_state(attempt, _S.REOPEN)
        finally:
            # Even when a watcher raised at the transition (a test's simulated kill):
            # dispatch must not stay closed in a process that lives on.
            unreleased = self._unreleased.get(attempt.checkpoint_id, set())
            for instance in self._agents():
                if instance in unreleased:
                    # Released by the next attempt, or by its own lease.
                    rollouts.close_dispatch_to(instance)
            rollouts.reopen_dispatch()
            if unreleased:
                self._keep_hold(attempt.checkpoint_id, hold)
            else:
                rollouts.release_deadlines(hold)

    def _keep_hold(self, checkpoint_id: str, hold: Hold) -> None:
        """docs/spec.md section 7.4 step 8: a participant whose resume failed may still
        hold episodes parked, so budgets stay held until it is known resumed: its
        release retry succeeds, or ``lease_s`` passed (its lease reopened it)."""
        expires_at = self._clock() + self._config.lease_s
        self._kept_holds[checkpoint_id] = (hold, expires_at)
        with suppress(RuntimeError):  # no running loop: the next release checks it
            asyncio.get_running_loop().call_later(
                self._config.lease_s + _HOLD_CHECK_MARGIN_S, self._release_kept_holds
            )

    def _release_kept_holds(self) -> None:
        now = self._clock()
        for checkpoint_id, (hold, expires_at) in list(self._kept_holds.items()):
            if checkpoint_id not in self._unreleased or now >= expires_at:
                del self._kept_holds[checkpoint_id]
                self._rollouts.release_deadlines(hold)

    @property
    def holding(self) -> frozenset[str]:
        """Checkpoints whose deadline hold is kept until every participant resumed."""
        return frozenset(self._kept_holds)

    def _agents(self) -> tuple[str, ...]:
        try:
            return self._coordinator.topology.agents
        except RuntimeError:
            return ()

    def _resources(self) -> tuple[str, ...]:
        try:
            return self._coordinator.topology.of_kind(ParticipantKind.RESOURCES)
        except RuntimeError:
            return ()

    def _closed_instances(self) -> set[str]:
        """Participants whose resume of some checkpoint has not succeeded yet."""
        return set().union(*self._unreleased.values()) if self._unreleased else set()

    def _participant_count(self) -> int:
        try:
            return len(self._coordinator.topology.instances)
        except RuntimeError:
            return 0

    async def _write_anchor(self, attempt: SnapshotAttempt) -> WrittenAnchor:
        checkpoint_id = attempt.checkpoint_id
        try:
            snapshot = await asyncio.to_thread(self._layout.begin, checkpoint_id)
            written = await self._anchor.write(snapshot)
        except ManifestError as error:
            # begin() refused the id (published already, not newer): a bookkeeping bug.
            raise _Failed(FailureReason.INVARIANT, str(error), error=error) from error
        except (OSError, TurnpointError) as error:
            raise _Failed(FailureReason.STORAGE, f"trainer anchor: {error}", error=error) from error
        attempt.anchor_written(written.step)
        return written

    async def _cut(
        self,
        attempt: SnapshotAttempt,
        written: WrittenAnchor,
        step_lock: _LockHold,
        extra: Mapping[str, JSONValue],
    ) -> None:
        rollouts = self._rollouts
        checkpoint_id = attempt.checkpoint_id
        self._set_state(attempt, _S.DRAIN)
        try:
            await rollouts.drain_acknowledgements(self._config.control_timeout_s)
        except (TimeoutError, OSError, TurnpointError, grpc.RpcError) as error:
            raise _Failed(
                _reason_of_error(error), f"draining acknowledgements: {error}", error=error
            ) from error
        self._set_state(attempt, _S.RETIRE)
        # Only what must go before a prepare (attempts abandoned since the release: one
        # may still run, or wait unacknowledged, on its agent). Sessions of attempts that
        # completed meanwhile wait for the next release: a sealed session outside the
        # scope is never exported, so keeping it a while changes no snapshot.
        await self._flush_retires(with_sessions=False)

        self._expose(checkpoint_id)
        try:
            self._set_state(attempt, _S.PREPARE)
            prepared = await self._coordinator.prepare(
                checkpoint_id,
                resolve=rollouts.resolve_unacknowledged,
                snapshot=checkpoint_id,
            )
            # Everything is parked now: the trainer's books and the participants' state
            # are the same cut, read here together without yielding. The in-flight list
            # read before prepare was only a hint: a rollout whose result arrived while
            # prepare waited is in the queue now and must not also be continued or
            # restarted.
            in_flight = tuple(rollouts.in_flight())
            books = rollouts.rollout_books()  # checked once dispatch is open again
            attempt.cut_read(rollouts.version)
        except PrepareFailed as error:
            if error.finished_through is not None:
                self._move_past(error.finished_through)
            # The core's verdict: resume everyone (the ready ones too), then retire.
            self._set_state(attempt, _S.ABORT)
            await self._abort(
                attempt, error.retire, error.verdict.resume if error.verdict else None
            )
            raise _Failed(
                failure_reason(error.failures), str(error), error.failures, error
            ) from error
        except BaseException:
            self._set_state(attempt, _S.ABORT)
            await self._abort(attempt, {})
            raise
        step_lock.release()
        # The books are read: a rollout dispatched from now on is in no cut. Its Run
        # waits at its agent until that agent ends the checkpoint (its commit releases
        # it, docs/spec.md section 4.8 item 9), so dispatch reopens here, not after the
        # resume; the deadline hold stays until step 8.
        rollouts.reopen_dispatch()
        attempt.times.dispatch_reopened(self._clock())
        try:
            async with self._coordinator.held(prepared):
                try:
                    self._set_state(attempt, _S.COMMIT)
                    try:
                        state = books.state()
                    except ManifestError as error:
                        raise _Failed(
                            FailureReason.INVARIANT, f"the trainer's books: {error}", error=error
                        ) from error
                    await self._commit_and_publish(
                        attempt, prepared, in_flight, state, written, extra
                    )
                except BaseException:
                    # The held checkpoint's exit resumes the same id everywhere: an abort.
                    self._set_state(attempt, _S.ABORT)
                    raise
                self._set_state(attempt, _S.RESUME)
        finally:
            self._note_release(checkpoint_id, prepared.release)

    async def _commit_and_publish(
        self,
        attempt: SnapshotAttempt,
        prepared: PreparedCheckpoint,
        in_flight: Sequence[InFlightRollout],
        state: TrainerRolloutState,
        written: WrittenAnchor,
        extra: Mapping[str, JSONValue],
    ) -> None:
        checkpoint_id = attempt.checkpoint_id
        topology = self._coordinator.topology
        scope = scope_commit(
            in_flight,
            prepared.all_restarts,
            instances=topology.instances,
            agents=topology.agents,
        )
        if not scope.ok:
            raise _Failed(FailureReason.INVARIANT, scope.reason)
        # The cut is fixed: every participant is prepared and the books are read. Who
        # committed in its prepare is resumed now, beside the others' commits, which end
        # the checkpoint themselves once their export is taken (docs/spec.md section 7.4
        # step 6).
        early = (
            asyncio.create_task(
                self._coordinator.resume(checkpoint_id, sorted(prepared.committed_empty))
            )
            if prepared.committed_empty
            else None
        )
        try:
            entries = await self._coordinator.commit(checkpoint_id, checkpoint_id, scope.scopes)
        except CommitFailed as error:
            raise _Failed(
                failure_reason(error.failures), str(error), error.failures, error
            ) from error
        finally:
            if early is not None:
                self._note_release(checkpoint_id, await early)
        attribution = attribute_commit(
            scope, in_flight, {name: entry.exported for name, entry in entries.items()}
        )
        attempt.commit_attributed(
            continued=len(attribution.continued), restarts=len(attribution.restarted)
        )
        self._set_state(attempt, _S.PUBLISH)
        try:
            manifest = SnapshotManifest(
                checkpoint_id=checkpoint_id,
                step=written.step,
                created_at=self._wall_clock(),
                anchor=written.ref,
                participants=tuple(entries.values()),
                continued=attribution.continued,
                restarts=attribution.restarted,
                rollout_state=state,
                extra=extra,
            )
            await asyncio.to_thread(
                self._layout.publish, self._layout.path(checkpoint_id), manifest
            )
            attempt.publication_durable()
            self._named.remember(checkpoint_id, state)
            try:
                await asyncio.to_thread(self._housekeeping)
            except (OSError, ManifestError, StorageError) as error:
                # Published is published: old snapshots are removed by a later attempt.
                _LOG.warning("retention after %s failed: %s", checkpoint_id, error)
        except ManifestError as error:
            raise _Failed(FailureReason.INVARIANT, str(error), error=error) from error
        except (OSError, StorageError) as error:
            # A store that failed a put (docs/spec.md section 8.12 item 6): nothing is
            # published, the snapshot fails and the next attempt retries.
            raise _Failed(FailureReason.STORAGE, f"publishing: {error}", error=error) from error

    def _housekeeping(self) -> None:
        removed = self._layout.retain(self._config.keep_snapshots)
        cleaned = self._layout.clean_partial()
        if removed or cleaned:
            _LOG.info("retention removed %s; partial cleanup removed %s", removed, cleaned)

    # -- failure paths -----------------------------------------------------------------

    async def _abort(
        self,
        attempt: SnapshotAttempt,
        retire: Mapping[str, Sequence[EpisodeId]],
        resume: Sequence[str] | None = None,
    ) -> None:
        """Resume the same id on ``resume`` (everywhere by default), then retire the
        stragglers that must go."""
        checkpoint_id = attempt.checkpoint_id
        report = await self._coordinator.resume(checkpoint_id, resume)
        self._note_release(checkpoint_id, report)
        for instance, episodes in retire.items():
            self._stragglers.setdefault(instance, set()).update(episodes)
        if self._stragglers:
            try:
                await self._flush_retires()
            except _Failed as failed:
                _LOG.warning("retiring stragglers of %s failed: %s", checkpoint_id, failed.detail)

    def _note_release(self, checkpoint_id: str, report: ControlReport | None) -> None:
        if report is None:
            return
        still = self._unreleased.setdefault(checkpoint_id, set())
        still.difference_update(report.succeeded)
        still.update(report.failures)
        if not still:
            del self._unreleased[checkpoint_id]
            self._restores.discard(checkpoint_id)
        self._release_kept_holds()

    def adopt_restore(self, plan: RestorePlan | None) -> None:
        """Take over a restore's release: docs/spec.md section 7.7 item 9.

        A participant whose resume of the restore id failed is still closed: dispatch to
        it stays closed and the rollouts' budgets stay held until the resume, re-sent
        (same ids) at the start of each attempt, succeeds or its lease surely ran out.
        Until then each attempt fails transiently before it prepares, since a prepare
        there would only be refused (``INVALID_PHASE``: a restore holds it).
        """
        if plan is None or not plan.unreleased:
            return
        restore_id = plan.restore_id
        self._restores.add(restore_id)
        self._unreleased.setdefault(restore_id, set()).update(plan.unreleased)
        for instance in self._agents():
            if instance in plan.unreleased:
                self._rollouts.close_dispatch_to(instance)
        self._keep_hold(restore_id, self._rollouts.hold_deadlines(f"restore {restore_id}"))
        _LOG.warning(
            "restore %s left %s closed: the next snapshot attempt releases them first",
            restore_id,
            sorted(plan.unreleased),
        )

    async def release_pending(self) -> ControlReport | None:
        """Re-send the resumes that failed earlier, same ids, to where they failed.

        Dispatch to an agent instance reopens once it is released. Returns the merged
        report (``None`` when nothing was pending).
        """
        self._release_kept_holds()
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

    async def _flush_retires(self, *, with_sessions: bool = True) -> None:
        """Retire ended attempts on idle participants (still closed ones wait).

        ``with_sessions`` false leaves completed attempts' sessions for a later flush: only
        abandoned attempts and stragglers are retired then.

        docs/spec.md section 7.6 item 2: each attempt is retired on the instance that ran
        it and on every resources server, since any of them may hold its state (a
        session only a verify would have ended). An attempt leaves the queue once every
        one of them retired it; a retry re-sends it everywhere (retiring is idempotent).
        """
        pending: dict[str, set[EpisodeId]] = {
            instance: set(episodes)
            for instance, episodes in self._rollouts.pending_retires().items()
        }
        for instance, episodes in self._stragglers.items():
            pending.setdefault(instance, set()).update(episodes)
        pending = {instance: episodes for instance, episodes in pending.items() if episodes}
        # Completed attempts: only the resources servers still keep their sessions.
        sessions = tuple(self._rollouts.pending_session_retires()) if with_sessions else ()
        if sessions and not self._resources():
            self._rollouts.sessions_retired(sessions)
            sessions = ()
        if not pending and not sessions:
            return
        every = set(sessions).union(*pending.values())
        targets = {instance: set(episodes) for instance, episodes in pending.items()}
        for instance in self._resources():
            targets.setdefault(instance, set()).update(every)
        closed = self._closed_instances()
        chosen = {i: tuple(sorted(e)) for i, e in targets.items() if i not in closed}
        if not chosen:
            return
        report = await self._coordinator.retire(chosen)
        self._note_marks(report.succeeded, chosen)
        # Done where the instance that ran it and every resources server retired it.
        everywhere = all(i in report.succeeded for i in self._resources())
        if everywhere and sessions:
            self._rollouts.sessions_retired(sessions)
        for instance in sorted(set(pending) & report.succeeded if everywhere else ()):
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

    def _note_marks(
        self, succeeded: Iterable[str], retired: Mapping[str, Sequence[EpisodeId]]
    ) -> None:
        attempt = self._attempt
        sequence = checkpoint_sequence(attempt.checkpoint_id) if attempt is not None else 0
        self._marks.retired(succeeded, retired, sequence)

    async def _forget_settled(self) -> None:
        """docs/spec.md section 7.6 item 6: drop the refusal marks of rollouts nothing of
        which can still arrive. Failures are logged; the next attempt tries again."""
        if not self._marks:
            return
        try:
            retained, oldest = await asyncio.to_thread(self._named.read, self._layout)
        except (OSError, ManifestError, StorageError) as error:
            _LOG.warning("not forgetting retired rollouts this time: %s", error)
            return
        if oldest is None:
            return
        named = set(retained) | rollouts_named(self._rollouts.rollout_books())
        for episodes in (*self._rollouts.pending_retires().values(), *self._stragglers.values()):
            named.update(episode.rollout_id for episode in episodes)
        # Every retained snapshot was cut after the retire, and none of them (nor the
        # trainer's books) names the rollout.
        chosen = self._marks.settled(oldest, named, self._closed_instances())
        if not chosen:
            return
        report = await self._coordinator.forget(chosen)
        self._marks.forgotten(report.succeeded, chosen)
        if report.failures:
            _LOG.warning(
                "forgetting retired rollouts failed on %s; tried again at the next attempt",
                sorted(report.failures),
            )

    @property
    def refusal_marks(self) -> Mapping[str, frozenset[str]]:
        """Rollouts this driver retired and has not forgotten yet, per instance."""
        return self._marks.view()

    async def _discard(self, attempt: SnapshotAttempt) -> None:
        # A participant whose resume failed may still be writing there; the partial
        # cleanup after the next publication removes it instead.
        if attempt.checkpoint_id in self._unreleased:
            return
        try:
            await asyncio.to_thread(self._layout.discard, attempt.checkpoint_id)
        except (OSError, ManifestError, StorageError) as error:
            _LOG.warning("could not remove the partial %s: %s", attempt.checkpoint_id, error)

    # -- reporting ---------------------------------------------------------------------

    def _report(
        self,
        attempt: SnapshotAttempt,
        outcome: SnapshotOutcome,
        *,
        reason: FailureReason | None = None,
        detail: str = "",
        failures: Mapping[str, Failure] | None = None,
        error: BaseException | None = None,
        retry_of: str | None = None,
    ) -> SnapshotReport:
        times = attempt.times
        participant_seconds = self._participant_count() * times.held_s
        report = SnapshotReport(
            checkpoint_id=attempt.checkpoint_id,
            outcome=outcome,
            reason=reason,
            detail=detail,
            phases=times.phases,
            total_s=times.total_s,
            admission_closed_s=times.admission_closed_s,
            participant_seconds=participant_seconds,
            failures=MappingProxyType(dict(failures or {})),
            unreleased=frozenset(self._unreleased.get(attempt.checkpoint_id, ())),
            exposed=attempt.exposed,
            retry_of=retry_of,
            continued=attempt.continued,
            restarts=attempt.restarts,
            error=_without_locals(error),
        )
        self._log(report)
        if self._metrics is not None:
            self._metrics.observe_snapshot(
                outcome=outcome.value,
                reason=reason.value if reason is not None else "",
                participant_seconds=participant_seconds,
                admission_closed_s=report.admission_closed_s,
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


def _without_locals(error: BaseException | None) -> BaseException | None:
    """``error`` as a report keeps it: its tracebacks (and those of its causes) still
    say where it was raised, but their finished frames drop their locals.

    Those frames are the driver's own (``self``): a report that keeps a failure with its
    frames whole is a reference cycle through the trainer, freed only by the cyclic
    collector, and a multi-rank anchor's process groups that live until interpreter
    teardown abort the process there (tests/e2e/test_multirank_anchor.py, exit -6).
    """
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]
    return error
