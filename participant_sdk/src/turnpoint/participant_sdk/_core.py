"""The participant's control core: the protocol as plain state, decided in one place.

No asyncio, no grpc, no wall clock: every method that depends on time takes ``now``
(seconds on any monotonic scale the caller picks), so a test drives hours of leases in
microseconds. The asyncio runtime (:mod:`turnpoint.participant_sdk._runtime`) holds one lock around this object
and turns its decisions into waits, tasks and file writes.

What it keeps:

- the phase machine IDLE -> PREPARING -> PREPARED -> COMMITTED, IDLE -> RESTORED, back
  to IDLE by resume or lease expiry. Admission is *derived* from the phase
  (:attr:`ParticipantCore.admission_open` is ``phase is IDLE``), so the two can never
  disagree; a prepare whose admission close fails is unwound by :meth:`abort_prepare`.
  While a checkpoint is being prepared the phase follows readiness: PREPARED exactly
  when nothing blocks, PREPARING otherwise.
- the lease of the active checkpoint (expiry is resume, counted);
- recorded answers of the active checkpoint, keyed by (checkpoint id, operation) with
  the argument fingerprint, so a retry replays and other arguments are a conflict;
- finished checkpoint ids (late calls are STALE_CHECKPOINT), see
  :class:`FinishedCheckpoints` for the bound;
- epoch fencing with a bounded log of answered request ids (:class:`AnswerLog`);
- the work table: one entry per execution, session or generation, with readiness
  counts maintained incrementally so that "are we ready?" is O(1) and the capped
  blocker list is built only when a reply needs it;
- refusal marks of retired attempts, and the freshness a restore requires.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, InvalidIdError, validate_id
from turnpoint.protocol import (
    BLOCKING_STATES,
    Blocker,
    CompletionReceipt,
    EpisodeState,
    Fence,
    Phase,
    ReadinessReport,
)


def checked_id(value: object, field: str) -> str:
    """Validate a protocol id, reporting a bad one as INVALID_ARGUMENT (nothing changes)."""
    try:
        return validate_id(value, field)
    except InvalidIdError as error:
        raise TurnpointError(Reason.INVALID_ARGUMENT, str(error), {"field": field}) from None


def _sequence_key(checkpoint_id: str) -> tuple[str, int] | None:
    """``("ckpt", 7)`` for ``"ckpt-000000000007"``; None for an id without a sequence."""
    prefix, sep, digits = checkpoint_id.rpartition("-")
    if not sep or not prefix or not digits.isdigit() or len(digits) > 18:
        return None
    return prefix, int(digits)


def supersedes(newer: str, older: str) -> bool:
    """Whether ``newer`` carries the same prefix as ``older`` and a higher sequence."""
    new_key, old_key = _sequence_key(newer), _sequence_key(older)
    return (
        new_key is not None
        and old_key is not None
        and new_key[0] == old_key[0]
        and new_key[1] > old_key[1]
    )


class FinishedCheckpoints:
    """Checkpoint (and restore) ids that are over: a late call for one is STALE_CHECKPOINT.

    The bound, and why it is safe: ids carry a strictly increasing sequence per prefix
    (``<prefix>-<sequence>``), and a higher id supersedes every lower one. So besides a
    bounded LRU of exact ids (``max_ids``) this keeps the highest finished sequence of
    each prefix and treats every id at or below it as finished. Evicting an id from the
    LRU therefore never makes it look fresh again. Only ids without a sequence rely on
    the LRU alone; the coordinator never makes those. Prefixes are themselves bounded
    (``max_prefixes``, least recently finished evicted): a run uses one or two.
    """

    def __init__(self, max_ids: int = 1024, max_prefixes: int = 256) -> None:
        if max_ids < 1 or max_prefixes < 1:
            raise ValueError("bounds must be >= 1")
        self._max_ids = max_ids
        self._max_prefixes = max_prefixes
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._highest: OrderedDict[str, int] = OrderedDict()

    def add(self, checkpoint_id: str) -> None:
        self._recent[checkpoint_id] = None
        self._recent.move_to_end(checkpoint_id)
        while len(self._recent) > self._max_ids:
            self._recent.popitem(last=False)
        key = _sequence_key(checkpoint_id)
        if key is not None:
            prefix, sequence = key
            self._highest[prefix] = max(sequence, self._highest.get(prefix, -1))
            self._highest.move_to_end(prefix)
            while len(self._highest) > self._max_prefixes:
                self._highest.popitem(last=False)

    def __contains__(self, checkpoint_id: object) -> bool:
        if not isinstance(checkpoint_id, str):
            return False
        if checkpoint_id in self._recent:
            return True
        key = _sequence_key(checkpoint_id)
        return key is not None and key[1] <= self._highest.get(key[0], -1)

    def __len__(self) -> int:
        return len(self._recent)


@dataclass(frozen=True, slots=True)
class RecordedAnswer:
    """What a request id was answered with: a result, or the TurnpointError raised."""

    operation: str
    answer: object


class AnswerLog:
    """Bounded LRU of answered request ids, for fenced retries after a lost reply.

    The bound (``max_requests``) only has to cover the requests a coordinator can retry
    after it was superseded: its in-flight fan-out, a few per participant.
    """

    def __init__(self, max_requests: int = 4096) -> None:
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        self._max = max_requests
        self._answers: OrderedDict[str, RecordedAnswer] = OrderedDict()

    def record(self, request_id: str, operation: str, answer: object) -> None:
        if not request_id:
            return
        self._answers[request_id] = RecordedAnswer(operation, answer)
        self._answers.move_to_end(request_id)
        while len(self._answers) > self._max:
            self._answers.popitem(last=False)

    def get(self, request_id: str) -> RecordedAnswer | None:
        return self._answers.get(request_id) if request_id else None

    def __len__(self) -> int:
        return len(self._answers)


class ActiveClock:
    """An episode's active time: runs while it works, stops while a checkpoint parks it."""

    __slots__ = ("_since", "_spent")

    def __init__(self, now: float) -> None:
        self._spent = 0.0
        self._since: float | None = now

    @property
    def paused(self) -> bool:
        return self._since is None

    def pause(self, now: float) -> None:
        if self._since is not None:
            self._spent += max(0.0, now - self._since)
            self._since = None

    def resume(self, now: float) -> None:
        if self._since is None:
            self._since = now

    def active(self, now: float) -> float:
        running = 0.0 if self._since is None else max(0.0, now - self._since)
        return self._spent + running


@dataclass(frozen=True, slots=True, order=True, init=False)
class WorkKey:
    """One piece of work in the table: an episode and what of it (``run``, ``session``...)."""

    episode: EpisodeId
    slot: str
    # Every table operation hashes its key: hashing the episode each time costs more than
    # the rest of the lookup. Not compared, not pickled (string hashes differ per process).
    _hash: int = field(init=False, repr=False, compare=False)

    def __init__(self, episode: EpisodeId, slot: str) -> None:
        # The frozen dataclass's own __init__ would set each field through
        # object.__setattr__ and call __post_init__; one key is made per episode.
        set_episode, set_slot, set_hash = _WORK_KEY_SLOTS
        set_episode(self, episode)
        set_slot(self, slot)
        set_hash(self, hash((episode, slot)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[WorkKey], tuple[EpisodeId, str]]:
        return WorkKey, (self.episode, self.slot)


_WORK_KEY_SLOTS: Final = tuple(vars(WorkKey)[name].__set__ for name in ("episode", "slot", "_hash"))


def _work_order(key: WorkKey) -> tuple[EpisodeId, str]:
    """The dataclass order of a :class:`WorkKey` as a tuple that compares in C: a commit
    sorts every exported key, and the generated ``__lt__`` goes through two Python calls
    per comparison."""
    return key.episode, key.slot


# Enum members as module constants for the per-episode paths: reading one off its class
# goes through the enum's metaclass, several times slower than a global.
_IDLE: Final = Phase.IDLE
_PREPARING: Final = Phase.PREPARING
_PREPARED: Final = Phase.PREPARED
_RUNNING: Final = EpisodeState.RUNNING
_RESTART: Final = EpisodeState.RESTART
_RETIRING: Final = EpisodeState.RETIRING
_RESTORED: Final = EpisodeState.RESTORED
_GONE: Final = EpisodeState.IDLE

# A tuple: membership compares by identity, where the frozenset would call the enum's
# Python-level __hash__ (this is asked on every change of the work table).
_BLOCKING_STATES = tuple(BLOCKING_STATES)


@dataclass(slots=True)
class _Entry:
    key: WorkKey
    state: EpisodeState
    receipt: CompletionReceipt | None = None
    detail: str = ""
    # An in-flight request that is safe to run again (a REPLAY verify) never blocks.
    replayable: bool = False
    boundary_index: int = 0
    turn_index: int = 0

    @property
    def blocks(self) -> bool:
        return self.state in _BLOCKING_STATES and not self.replayable


@dataclass(frozen=True, slots=True)
class EntryView:
    """A read-only copy of one table entry."""

    key: WorkKey
    state: EpisodeState
    receipt: CompletionReceipt | None
    detail: str
    replayable: bool
    boundary_index: int
    turn_index: int
    blocks: bool


@dataclass(frozen=True, slots=True)
class CoreEvent:
    """One entry changed state or sealed a boundary (what WatchBoundaries streams)."""

    episode: EpisodeId
    slot: str
    state: EpisodeState
    boundary_index: int
    turn_index: int
    at: float


class StartKind(enum.Enum):
    NEW = "new"  # start the work
    JOIN = "join"  # the same work is already running (or failed and is to be redone)
    REPLAY = "replay"  # the work finished: return the recorded answer


@dataclass(frozen=True, slots=True)
class PrepareStart:
    """What a prepare call has to do next.

    ``opened``: this call closed admission (run the kinds' close hooks; on failure call
    :meth:`ParticipantCore.abort_prepare`). ``superseded``: the lower checkpoint this one
    replaced (its background work must be stopped). ``replay``: the recorded ready answer.
    """

    opened: bool
    superseded: str | None
    replay: object | None


@dataclass(frozen=True, slots=True)
class CommitStart:
    kind: StartKind
    answer: object | None = None
    export: tuple[WorkKey, ...] = ()
    discard: tuple[WorkKey, ...] = ()


@dataclass(frozen=True, slots=True)
class RestoreStart:
    kind: StartKind
    answer: object | None = None


@dataclass(frozen=True, slots=True)
class RunningRestore:
    """What a restore into a running participant replaces (docs/spec.md section 4.16).

    ``scope``: the saved attempts N it continues as N+1; every attempt of their rollouts
    up to N is retired first. ``retire_unscoped``: every other entry held goes too.
    """

    scope: frozenset[EpisodeId]
    retire_unscoped: bool = False

    @property
    def rollouts(self) -> frozenset[str]:
        return frozenset(episode.rollout_id for episode in self.scope)


_OTHER_RESTORE = {"restore": "restore_running", "restore_running": "restore"}

MAX_STALE_LISTED = 64
"""Saved attempts listed in one ``stale_episodes`` refusal: trailers stay small; the
coordinator's next round learns the rest (docs/spec.md section 4.16 item 3)."""


@dataclass(frozen=True, slots=True)
class ResumeOutcome:
    """``ended``: the active checkpoint (or restore) this resume ended, if any."""

    ended: str | None


def _error(reason: Reason, message: str, **metadata: object) -> TurnpointError:
    return TurnpointError(reason, message, {k: str(v) for k, v in metadata.items()})


class ParticipantCore:
    """The whole control state of one participant; see the module docstring."""

    def __init__(
        self,
        *,
        default_lease_s: float = 60.0,
        max_finished_ids: int = 1024,
        max_answered_requests: int = 4096,
        record_events: bool = False,
    ) -> None:
        if default_lease_s <= 0:
            raise ValueError("default_lease_s must be > 0")
        self._default_lease_s = default_lease_s
        self._phase = Phase.IDLE
        self._active: str | None = None
        self._active_epoch = 0
        self._lease_s = default_lease_s
        self._lease_expires_at: float | None = None
        self._lease_expiries = 0
        # (checkpoint id, operation) -> (argument fingerprint, answer or None while running).
        # Only the active checkpoint's: once it is finished every call for it is stale.
        self._answers: dict[tuple[str, str], tuple[Hashable, object | None]] = {}
        self._finished = FinishedCheckpoints(max_finished_ids)
        self._fence: Fence | None = None
        self._requests = AnswerLog(max_answered_requests)

        self._entries: dict[WorkKey, _Entry] = {}
        self._by_rollout: dict[str, set[WorkKey]] = {}
        # Ordered sets: the first N blockers are the N oldest, read in O(N).
        self._blockers: dict[WorkKey, None] = {}
        self._restart_keys: dict[WorkKey, None] = {}
        self._counts: Counter[EpisodeState] = Counter()
        self._pending_restarts: set[WorkKey] = set()
        self._marks: dict[str, int] = {}
        self._fresh = True
        self._restoring = False
        self._restore_installed: list[WorkKey] = []
        self._record_events = record_events
        self._events: list[CoreEvent] = []
        self._version = 0

    # ------------------------------------------------------------------ read side

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def admission_open(self) -> bool:
        return self._phase is _IDLE

    @property
    def active_checkpoint_id(self) -> str | None:
        return self._active

    @property
    def lease_expires_at(self) -> float | None:
        return self._lease_expires_at

    @property
    def lease_expiries(self) -> int:
        return self._lease_expiries

    @property
    def fence(self) -> Fence | None:
        return self._fence

    @property
    def epoch(self) -> int:
        return self._fence.epoch if self._fence is not None else 0

    @property
    def fresh(self) -> bool:
        """No data-plane work was ever admitted and no restore installed anything."""
        return self._fresh

    @property
    def restoring(self) -> bool:
        return self._restoring

    @property
    def ready(self) -> bool:
        return not self._blockers

    @property
    def blocker_count(self) -> int:
        return len(self._blockers)

    @property
    def version(self) -> int:
        """Bumped on every change a readiness report or status could show."""
        return self._version

    @property
    def record_events(self) -> bool:
        """Whether changes are recorded as :class:`CoreEvent` (for :meth:`drain_events`).

        Off when nobody watches, so that an unwatched change builds no event; turning it
        off drops the events not drained yet.
        """
        return self._record_events

    @record_events.setter
    def record_events(self, value: bool) -> None:
        self._record_events = value
        if not value:
            self._events = []

    @property
    def refused_rollouts(self) -> int:
        return len(self._marks)

    def refusal_mark(self, rollout_id: str) -> int | None:
        return self._marks.get(rollout_id)

    def is_finished(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._finished

    def entry(self, key: WorkKey) -> EntryView | None:
        entry = self._entries.get(key)
        return None if entry is None else _view(entry)

    def state_of(self, key: WorkKey) -> EpisodeState | None:
        """The state of one entry, None if it is not in the table (no view is built)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def episodes_in(self, state: EpisodeState, slot: str) -> list[EpisodeId]:
        """The episodes whose ``slot`` entry is in ``state``, in one pass of the table
        (none when the state's count says so): a checkpoint pauses every parked one."""
        if not self._counts[state]:
            return []
        return [
            key.episode
            for key, entry in self._entries.items()
            if entry.state is state and key.slot == slot
        ]

    def entries(self) -> Iterator[EntryView]:
        return (_view(entry) for entry in self._entries.values())

    def keys_of(self, rollout_id: str) -> tuple[WorkKey, ...]:
        return tuple(sorted(self._by_rollout.get(rollout_id, ())))

    def is_restart(self, key: WorkKey) -> bool:
        return key in self._restart_keys

    def readiness(self, max_blockers: int) -> ReadinessReport:
        """The report for a reply: O(max_blockers + restarts), never a scan of the table."""
        blockers = tuple(
            self._blocker(self._entries[key])
            for key in itertools.islice(self._blockers, max(0, max_blockers))
        )
        return ReadinessReport(
            ready=not self._blockers,
            blocker_count=len(self._blockers),
            blockers=blockers,
            counts=MappingProxyType({s: c for s, c in self._counts.items() if c}),
            restarts=tuple(sorted({key.episode for key in self._restart_keys})),
        )

    def recount(self) -> tuple[int, dict[EpisodeState, int]]:
        """Blocker count and counts by state from a full scan (what tests compare against)."""
        counts: Counter[EpisodeState] = Counter(e.state for e in self._entries.values())
        return sum(1 for e in self._entries.values() if e.blocks), dict(counts)

    def drain_events(self) -> list[CoreEvent]:
        events, self._events = self._events, []
        return events

    @staticmethod
    def _blocker(entry: _Entry) -> Blocker:
        return Blocker(entry.key.episode, entry.state, entry.receipt, entry.detail)

    # ------------------------------------------------------------------ fencing

    def check_fence(self, fence: Fence, request_id: str) -> RecordedAnswer | None:
        """Adopt a higher epoch; refuse a lower one unless ``request_id`` was answered.

        Returns the recorded answer for a fenced retry (the caller returns or raises it
        instead of acting), None when the request may proceed.
        """
        current = self._fence
        if current is None or fence.epoch > current.epoch:
            self._fence = fence
            self._version += 1
            return None
        if fence.epoch == current.epoch and fence.coordinator_id == current.coordinator_id:
            return None
        recorded = self._requests.get(request_id)
        if recorded is not None:
            return recorded
        raise _error(
            Reason.FENCED,
            f"coordinator {fence.coordinator_id!r} epoch {fence.epoch} is fenced by "
            f"{current.coordinator_id!r} epoch {current.epoch}",
            epoch=current.epoch,
            request_epoch=fence.epoch,
        )

    def check_data_fence(self, fence: Fence | None) -> None:
        """docs/spec.md section 6.9: a data-plane call from a coordinator the control plane
        fenced out is refused; a higher epoch is adopted, as any read adopts it. A call
        without a fence (a tool) is not fenced."""
        if fence is None:
            return
        current = self._fence
        if current is None or fence.epoch > current.epoch:
            self._fence = fence
            self._version += 1
            return
        if fence.epoch == current.epoch and fence.coordinator_id == current.coordinator_id:
            return
        raise _error(
            Reason.FENCED,
            f"a data-plane call from coordinator {fence.coordinator_id!r} epoch "
            f"{fence.epoch} is fenced by {current.coordinator_id!r} epoch {current.epoch}",
            epoch=current.epoch,
            request_epoch=fence.epoch,
        )

    def observe_fence(self, fence: Fence | None) -> None:
        """Read-only calls remember a higher epoch but are never refused."""
        if fence is not None and (self._fence is None or fence.epoch > self._fence.epoch):
            self._fence = fence
            self._version += 1

    def record_answer(self, request_id: str, operation: str, answer: object) -> None:
        self._requests.record(request_id, operation, answer)

    # ------------------------------------------------------------------ lease

    def _lease_length(self, lease_s: float | None) -> float:
        if lease_s is None or lease_s == 0:
            return self._lease_s if self._active is not None else self._default_lease_s
        if lease_s < 0 or lease_s != lease_s:
            raise _error(
                Reason.INVALID_ARGUMENT, f"lease must be > 0, got {lease_s}", field="lease"
            )
        return lease_s

    def _renew_at(self, now: float, lease_s: float | None = None) -> None:
        self._lease_s = self._lease_length(lease_s)
        target = now + self._lease_s
        current = self._lease_expires_at
        self._lease_expires_at = target if current is None else max(current, target)
        self._version += 1

    def renew(self, checkpoint_id: str, lease_s: float | None, now: float) -> float:
        """Extend the lease of the active checkpoint to at least ``now + lease``."""
        self._require_active(checkpoint_id)
        self._renew_at(now, lease_s)
        assert self._lease_expires_at is not None
        return self._lease_expires_at

    def lease_expired(self, now: float) -> str | None:
        """The active id whose lease ran out (the caller resumes it), or None."""
        if self._active is None or self._lease_expires_at is None:
            return None
        return self._active if now >= self._lease_expires_at else None

    # ------------------------------------------------------------------ phases

    def _require_active(self, checkpoint_id: str) -> None:
        checked_id(checkpoint_id, "checkpoint_id")
        if checkpoint_id == self._active:
            return
        if checkpoint_id in self._finished:
            raise _error(
                Reason.STALE_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} is finished",
                checkpoint_id=checkpoint_id,
            )
        raise _error(
            Reason.INVALID_PHASE,
            f"checkpoint {checkpoint_id!r} is not active (phase {self._phase.name}, "
            f"active {self._active!r})",
            checkpoint_id=checkpoint_id,
            phase=self._phase.name,
        )

    def _set_phase(self, phase: Phase) -> None:
        if phase is not self._phase:
            self._phase = phase
            self._version += 1

    def _refresh_readiness_phase(self) -> None:
        if self._phase in (Phase.PREPARING, Phase.PREPARED):
            self._set_phase(Phase.PREPARED if not self._blockers else Phase.PREPARING)

    def _finish_active(self, now: float, *, reopen: bool) -> str:
        ended = self._active
        assert ended is not None
        self._finished.add(ended)
        self._answers = {k: v for k, v in self._answers.items() if k[0] != ended}
        self._active = None
        self._lease_expires_at = None
        if reopen:
            self._set_phase(Phase.IDLE)
            self._apply_pending_restarts(now)
        self._version += 1
        return ended

    def begin_prepare(
        self, checkpoint_id: str, lease_s: float | None, now: float, *, epoch: int = 0
    ) -> PrepareStart:
        """Open ``checkpoint_id`` (closing admission) or repeat the request for it."""
        checked_id(checkpoint_id, "checkpoint_id")
        lease = self._lease_length(lease_s)
        if checkpoint_id == self._active:
            if self._phase is Phase.RESTORED:
                raise _error(
                    Reason.INVALID_PHASE,
                    f"{checkpoint_id!r} is a restore, not a checkpoint",
                    phase=self._phase.name,
                )
            self._renew_at(now, lease)
            recorded = self._answers.get((checkpoint_id, "prepare"))
            return PrepareStart(False, None, None if recorded is None else recorded[1])
        if checkpoint_id in self._finished:
            raise _error(
                Reason.STALE_CHECKPOINT,
                f"checkpoint {checkpoint_id!r} is finished",
                checkpoint_id=checkpoint_id,
            )
        superseded: str | None = None
        if self._active is not None:
            if self._phase is Phase.RESTORED:
                raise _error(
                    Reason.INVALID_PHASE,
                    f"restore {self._active!r} holds the participant until it is resumed",
                    phase=self._phase.name,
                    active=self._active,
                )
            if supersedes(self._active, checkpoint_id):
                raise _error(
                    Reason.STALE_CHECKPOINT,
                    f"checkpoint {checkpoint_id!r} is superseded by {self._active!r}",
                    checkpoint_id=checkpoint_id,
                )
            if not (supersedes(checkpoint_id, self._active) or epoch > self._active_epoch):
                raise _error(
                    Reason.INVALID_PHASE,
                    f"checkpoint {self._active!r} is active",
                    phase=self._phase.name,
                    active=self._active,
                )
            # A higher id (or a newer coordinator) replaces the open checkpoint without
            # ever reopening admission in between.
            superseded = self._finish_active(now, reopen=False)
        self._active = checkpoint_id
        self._active_epoch = epoch
        self._lease_expires_at = None
        self._renew_at(now, lease)
        self._set_phase(Phase.PREPARING)
        self._refresh_readiness_phase()
        return PrepareStart(superseded is None, superseded, None)

    def abort_prepare(self, checkpoint_id: str) -> None:
        """Closing admission failed: reopen it, as if the prepare never happened."""
        if self._active != checkpoint_id or self._phase not in (Phase.PREPARING, Phase.PREPARED):
            return
        self._answers = {k: v for k, v in self._answers.items() if k[0] != checkpoint_id}
        self._active = None
        self._lease_expires_at = None
        self._set_phase(Phase.IDLE)
        self._version += 1

    def record_prepare_answer(self, checkpoint_id: str, answer: object) -> None:
        """Record a *ready* answer: a repeat of the prepare replays it."""
        if self._active == checkpoint_id and self._phase is Phase.PREPARED:
            self._answers[(checkpoint_id, "prepare")] = ((), answer)

    def begin_commit(
        self,
        checkpoint_id: str,
        fingerprint: Hashable,
        scope: Iterable[EpisodeId],
        now: float,
    ) -> CommitStart:
        """Decide a commit: replay, join the running one, or start exporting ``scope``."""
        self._require_active(checkpoint_id)
        if self._phase is Phase.RESTORED:
            raise _error(Reason.INVALID_PHASE, "cannot commit a restore", phase=self._phase.name)
        self._renew_at(now)
        recorded = self._answers.get((checkpoint_id, "commit"))
        if recorded is not None:
            if recorded[0] != fingerprint:
                raise _error(
                    Reason.CHECKPOINT_CONFLICT,
                    f"checkpoint {checkpoint_id!r} was committed with other arguments",
                    checkpoint_id=checkpoint_id,
                )
            if recorded[1] is not None:
                return CommitStart(StartKind.REPLAY, recorded[1])
            return CommitStart(StartKind.JOIN)
        if self._phase is not Phase.PREPARED:
            raise _error(
                Reason.INVALID_PHASE,
                f"commit needs a prepared participant; phase is {self._phase.name} "
                f"with {len(self._blockers)} blockers",
                phase=self._phase.name,
                blocker_count=len(self._blockers),
            )
        scoped = frozenset(scope)
        restarts = sorted(scoped & {key.episode for key in self._restart_keys})
        if restarts:
            raise _error(
                Reason.RESTART_IN_SCOPE,
                f"scope names {len(restarts)} restart episodes, e.g. {restarts[0]}",
                episode=restarts[0],
            )
        # Exportable: not blocking, neither a restart nor retiring, its attempt not
        # refused (the marks asked only if there are any): every entry of the table.
        marks = self._marks
        export = tuple(
            sorted(
                (
                    key
                    for key, entry in self._entries.items()
                    if key.episode in scoped
                    and not entry.blocks
                    and entry.state is not _RESTART
                    and entry.state is not _RETIRING
                    and not (marks and self._refused(key.episode))
                ),
                key=_work_order,
            )
        )
        discard = (
            tuple(
                sorted(
                    (
                        key
                        for key, entry in self._entries.items()
                        if entry.state is _RESTORED and key.episode not in scoped
                    ),
                    key=_work_order,
                )
            )
            if self._counts[_RESTORED]
            else ()
        )
        self._answers[(checkpoint_id, "commit")] = (fingerprint, None)
        return CommitStart(StartKind.NEW, None, export, discard)

    def finish_commit(self, checkpoint_id: str, fingerprint: Hashable, answer: object) -> None:
        recorded = self._answers.get((checkpoint_id, "commit"))
        if self._active != checkpoint_id or recorded is None or recorded[0] != fingerprint:
            return
        self._answers[(checkpoint_id, "commit")] = (fingerprint, answer)
        self._set_phase(Phase.COMMITTED)

    def resume(self, checkpoint_id: str, now: float, *, expired: bool = False) -> ResumeOutcome:
        """End ``checkpoint_id`` (or a lower active one it supersedes); remember it finished.

        Idempotent, also for ids never seen: the id is remembered so that a late prepare
        for it (one whose request arrives after this abort) is stale.
        """
        checked_id(checkpoint_id, "checkpoint_id")
        ended: str | None = None
        active = self._active
        if active is not None and (checkpoint_id == active or supersedes(checkpoint_id, active)):
            if self._restoring:
                raise _error(
                    Reason.INVALID_PHASE,
                    f"restore {active!r} is still installing",
                    phase=self._phase.name,
                )
            ended = self._finish_active(now, reopen=True)
            if expired:
                self._lease_expiries += 1
        self._finished.add(checkpoint_id)
        return ResumeOutcome(ended)

    def begin_restore(
        self,
        restore_id: str,
        fingerprint: Hashable,
        lease_s: float | None,
        now: float,
        *,
        running: RunningRestore | None = None,
    ) -> RestoreStart:
        """Close admission for a restore (or replay/join a repeat of it).

        Without ``running``: a restore into an idle, fresh participant (docs/spec.md
        section 4.10). With it: a restore into a participant that may hold work
        (section 4.16); freshness is not required, but a scoped attempt this participant
        already retired, or one it holds a newer attempt of, is refused.
        """
        checked_id(restore_id, "restore_id")
        lease = self._lease_length(lease_s)
        operation = "restore" if running is None else "restore_running"
        if restore_id == self._active and self._phase is Phase.RESTORED:
            recorded = self._answers.get((restore_id, operation))
            if recorded is None and self._answers.get((restore_id, _OTHER_RESTORE[operation])):
                raise _error(
                    Reason.CHECKPOINT_CONFLICT,
                    f"restore {restore_id!r} was requested by another operation",
                    checkpoint_id=restore_id,
                )
            if recorded is not None and recorded[0] != fingerprint:
                raise _error(
                    Reason.CHECKPOINT_CONFLICT,
                    f"restore {restore_id!r} was requested with other arguments",
                    checkpoint_id=restore_id,
                )
            self._renew_at(now, lease)
            if recorded is not None and recorded[1] is not None:
                return RestoreStart(StartKind.REPLAY, recorded[1])
            return RestoreStart(StartKind.JOIN)
        if restore_id in self._finished:
            raise _error(
                Reason.STALE_CHECKPOINT,
                f"restore {restore_id!r} is finished",
                checkpoint_id=restore_id,
            )
        if self._phase is not Phase.IDLE:
            raise _error(
                Reason.INVALID_PHASE,
                f"restore needs an idle participant; phase is {self._phase.name}",
                phase=self._phase.name,
            )
        if running is None and not self._fresh:
            raise _error(
                Reason.INVALID_PHASE,
                "restore needs a fresh participant; this one already served work",
                phase=self._phase.name,
                fresh="false",
            )
        if running is not None and not running.retire_unscoped:
            # A heal: an attempt retired here, or one a newer attempt held here has
            # replaced, is never continued.
            for episode in sorted(running.scope):
                self.check_attempt(episode)
        elif running is not None:
            self._refuse_reused_installs(running.scope)
        self._active = restore_id
        self._active_epoch = self.epoch
        self._lease_expires_at = None
        self._renew_at(now, lease)
        self._set_phase(Phase.RESTORED)
        self._restoring = True
        self._restore_installed = []
        self._answers[(restore_id, operation)] = (fingerprint, None)
        return RestoreStart(StartKind.NEW)

    def retire_for_restore(
        self, restore_id: str, running: RunningRestore, now: float
    ) -> tuple[WorkKey, ...]:
        """Flag RETIRING what a running restore replaces, before it installs anything.

        Every attempt of a scoped rollout up to the saved one is refused from now on (the
        refusal mark rises as a Retire's does); with ``retire_unscoped`` every other entry
        goes too, without a mark, and the marks of every unscoped rollout are forgotten:
        its coordinator is fenced (docs/spec.md section 6.9), what it ran of them after
        the snapshot is not in the new one's lineage, and the new one may reuse those
        attempt numbers (it dispatches them again from attempt 0). Returns the keys to stop.
        """
        if self._active != restore_id or not self._restoring:
            raise RuntimeError("retire_for_restore outside its restore")
        if running.retire_unscoped:
            for rollout_id in [r for r in self._marks if r not in running.rollouts]:
                del self._marks[rollout_id]
                self._version += 1
        for episode in running.scope:
            mark = self._marks.get(episode.rollout_id, -1)
            self._marks[episode.rollout_id] = max(mark, episode.attempt)
            self._version += 1
        keys: list[WorkKey] = []
        for key in sorted(self._entries):
            rollout_id = key.episode.rollout_id
            if rollout_id in running.rollouts:
                # A newer attempt of a scoped rollout is held only when the fenced
                # incarnation left it (begin_restore refused it otherwise).
                goes = key.episode.attempt <= self._marks[rollout_id] or running.retire_unscoped
            else:
                goes = running.retire_unscoped
            if goes:
                self._pending_restarts.discard(key)
                self.set_state(key, EpisodeState.RETIRING, now)
                keys.append(key)
        return tuple(keys)

    def install_restored(
        self, key: WorkKey, boundary_index: int, turn_index: int, now: float
    ) -> None:
        if not self._restoring:
            raise RuntimeError("install_restored outside a restore")
        if key in self._entries:
            raise _error(Reason.INVALID_CHECKPOINT_STATE, f"{key.episode} is installed twice")
        self._add(key, EpisodeState.RESTORED, now)
        entry = self._entries[key]
        entry.boundary_index, entry.turn_index = boundary_index, turn_index
        self._restore_installed.append(key)

    def finish_restore(self, restore_id: str, answer: object) -> None:
        if self._active != restore_id or not self._restoring:
            return
        self._restoring = False
        self._fresh = False
        self._restore_installed = []
        operation = "restore" if (restore_id, "restore") in self._answers else "restore_running"
        fingerprint = self._answers[(restore_id, operation)][0]
        self._answers[(restore_id, operation)] = (fingerprint, answer)
        self._version += 1

    def fail_restore(self, restore_id: str, now: float) -> tuple[WorkKey, ...]:
        """Undo a restore: drop what it installed, reopen, stay fresh. Returns the keys."""
        if self._active != restore_id or not self._restoring:
            return ()
        installed = tuple(self._restore_installed)
        for key in installed:
            if key in self._entries:
                self._remove(key, now)
        self._restoring = False
        self._restore_installed = []
        self._answers = {k: v for k, v in self._answers.items() if k[0] != restore_id}
        self._active = None
        self._lease_expires_at = None
        self._set_phase(Phase.IDLE)
        return installed

    # ------------------------------------------------------------------ the work table

    def _refuse_reused_installs(self, scope: Iterable[EpisodeId]) -> None:
        """A new incarnation's restore (``retire_unscoped``): refuse every saved attempt N
        whose N+1 this participant has retired (docs/spec.md section 4.16 item 3).

        N itself may be retired here (the fenced incarnation finished it, or retried it,
        after the snapshot): the restore continues the snapshot's state of N, never what
        this participant held, and N+1 is above the mark. A retired N+1 is not: the
        installed attempt would be refused itself, and late calls of the retired one
        would reach it. The refusal lists every such attempt with its rollout's mark
        (``stale_episodes``, section 9.5), so that the coordinator reruns them all above
        their marks in one more round. A newer attempt merely held goes with the other
        unscoped work, as item 4 says.
        """
        stale = [e for e in sorted(scope) if self._refused(e.next_attempt())]
        if not stale:
            return
        first = stale[0]
        listed = ",".join(
            f"{e.rollout_id}#{e.attempt}:{self._marks[e.rollout_id]}"
            for e in stale[:MAX_STALE_LISTED]
        )
        raise _error(
            Reason.STALE_ATTEMPT,
            f"{len(stale)} saved attempt(s) would continue as an attempt retired here, "
            f"first {first} (retired through {self._marks[first.rollout_id]})",
            episode=first,
            retired_through=self._marks[first.rollout_id],
            stale_episodes=listed,
        )

    def _refused(self, episode: EpisodeId) -> bool:
        mark = self._marks.get(episode.rollout_id)
        return mark is not None and episode.attempt <= mark

    def check_attempt(self, episode: EpisodeId) -> None:
        """Refuse a retired attempt, or one older than an attempt this participant holds."""
        if self._marks and self._refused(episode):
            raise _error(
                Reason.STALE_ATTEMPT,
                f"{episode} was retired",
                episode=episode,
                retired_through=self._marks[episode.rollout_id],
            )
        held = self._by_rollout.get(episode.rollout_id)
        newer = [k for k in held if k.episode > episode] if held else None
        if newer:
            raise _error(
                Reason.STALE_ATTEMPT,
                f"{episode} is superseded by {min(newer).episode}",
                episode=episode,
            )

    def admit(self, key: WorkKey, state: EpisodeState, now: float, *, detail: str = "") -> None:
        """Add new data-plane work; refused while a checkpoint holds admission."""
        self.check_attempt(key.episode)
        if key in self._entries:
            raise RuntimeError(f"{key} is already in the table")
        if self._phase is not _IDLE:
            raise _error(
                Reason.ADMISSION_CLOSED,
                f"admission is closed by {self._active!r} ({self._phase.name})",
                phase=self._phase.name,
                checkpoint_id=self._active or "",
            )
        self._fresh = False
        self._add(key, state, now, detail=detail)

    def _add(self, key: WorkKey, state: EpisodeState, now: float, *, detail: str = "") -> None:
        entry = _Entry(key, state, detail=detail)
        self._entries[key] = entry
        rollout_keys = self._by_rollout.get(key.episode.rollout_id)
        if rollout_keys is None:
            self._by_rollout[key.episode.rollout_id] = {key}
        else:
            rollout_keys.add(key)
        self._counts[state] += 1
        if entry.blocks:
            self._blockers[key] = None
        if state is _RESTART:
            self._restart_keys[key] = None
        self._changed(entry, now)

    def set_state(
        self,
        key: WorkKey,
        state: EpisodeState,
        now: float,
        *,
        receipt: CompletionReceipt | None = None,
        detail: str | None = None,
        replayable: bool | None = None,
    ) -> EpisodeState:
        """Move an entry to ``state``; returns the state it actually has afterwards.

        A restart stays a restart (it never blocks or parks) until it is retired, and
        nothing leaves RETIRING except removal.
        """
        entry = self._entries[key]
        if entry.state is _RETIRING and state is not _RETIRING:
            return entry.state
        if entry.state is _RESTART and state is not _RETIRING:
            state = _RESTART
        was_blocking = entry.blocks
        if state is not entry.state:
            self._counts[entry.state] -= 1
            self._counts[state] += 1
            if entry.state is _RESTART:
                self._restart_keys.pop(key, None)
            if state is _RESTART:
                self._restart_keys[key] = None
            entry.state = state
        if receipt is not None:
            entry.receipt = receipt
        if detail is not None:
            entry.detail = detail
        if replayable is not None:
            entry.replayable = replayable
        if entry.blocks and not was_blocking:
            self._blockers[key] = None
        elif was_blocking and not entry.blocks:
            self._blockers.pop(key, None)
        self._changed(entry, now)
        return entry.state

    def seal_boundary(self, key: WorkKey, boundary_index: int, turn_index: int, now: float) -> bool:
        """Record a sealed boundary; returns :meth:`runs_on` (whether it carries on)."""
        entry = self._entries[key]
        entry.boundary_index, entry.turn_index = boundary_index, turn_index
        if self._phase is _IDLE and entry.state is _RUNNING and not self._record_events:
            # What _changed and _runs_on come to for almost every boundary.
            self._version += 1
            return True
        self._changed(entry, now)
        return self._runs_on(entry, now)

    def runs_on(self, key: WorkKey, now: float) -> bool:
        """At a boundary: whether the work carries on rather than park there.

        It does while admission is open, and a restart always does (it is in no cut);
        it is then RUNNING (a restart stays a restart). False: a checkpoint holds
        admission, and the caller parks it.
        """
        entry = self._entries.get(key)
        if entry is None:
            return self.admission_open
        return self._runs_on(entry, now)

    def _runs_on(self, entry: _Entry, now: float) -> bool:
        state = entry.state
        if self._phase is _IDLE or state is _RESTART:
            if state is not _RUNNING:
                self.set_state(entry.key, _RUNNING, now)
            return True
        return False

    def remove(self, key: WorkKey, now: float) -> None:
        if key in self._entries:
            self._remove(key, now)

    def _remove(self, key: WorkKey, now: float) -> None:
        entry = self._entries.pop(key)
        keys = self._by_rollout[key.episode.rollout_id]
        keys.discard(key)
        if not keys:
            del self._by_rollout[key.episode.rollout_id]
        self._counts[entry.state] -= 1
        # Each hashes the key in Python (WorkKey.__hash__): ask only a table that holds any.
        if self._blockers:
            self._blockers.pop(key, None)
        if self._restart_keys:
            self._restart_keys.pop(key, None)
        if self._pending_restarts:
            self._pending_restarts.discard(key)
        entry.state = _GONE
        entry.replayable = False
        self._changed(entry, now, removed=True)

    def claim_restored(self, key: WorkKey, state: EpisodeState, now: float) -> None:
        """A Run or request names restored (or cancelled-at-boundary) state: it is claimed."""
        self.check_attempt(key.episode)
        self.set_state(key, state, now)

    def mark_restart(self, key: WorkKey, now: float) -> bool:
        """Make an entry a restart; deferred to resume while a checkpoint is open.

        Deferred because the coordinator builds its commit scope from the restarts the
        prepare reported: one appearing mid-checkpoint would make that scope wrong.
        Returns whether it took effect now.
        """
        if key not in self._entries:
            return False
        if not self.admission_open:
            self._pending_restarts.add(key)
            return False
        self.set_state(key, EpisodeState.RESTART, now)
        return True

    def _apply_pending_restarts(self, now: float) -> None:
        pending, self._pending_restarts = self._pending_restarts, set()
        for key in sorted(pending):
            if key in self._entries:
                self.set_state(key, EpisodeState.RESTART, now)

    def acknowledge(self, receipt: CompletionReceipt) -> WorkKey | None:
        """The entry holding ``receipt`` (the caller frees it and removes it), or None."""
        for key in self._by_rollout.get(receipt.episode.rollout_id, ()):
            entry = self._entries[key]
            if (key.episode is receipt.episode or key.episode == receipt.episode) and (
                entry.receipt is receipt or entry.receipt == receipt
            ):
                return key
        return None

    def begin_retire(self, episodes: Iterable[EpisodeId], now: float) -> tuple[WorkKey, ...]:
        """Mark the rollouts refused first, then flag every attempt up to the mark RETIRING.

        Returns every key that still has to be stopped and freed, including those of an
        earlier retire that did not finish (a retry finishes the job).
        """
        episodes = tuple(episodes)
        if self._phase not in (Phase.IDLE, Phase.RESTORED):
            raise _error(
                Reason.INVALID_PHASE,
                f"retire needs an idle or restored participant; phase is {self._phase.name}",
                phase=self._phase.name,
            )
        if self._restoring:
            raise _error(Reason.INVALID_PHASE, "a restore is still installing", phase="RESTORED")
        for episode in episodes:
            mark = self._marks.get(episode.rollout_id, -1)
            # Marks only rise: retiring attempt 1 after attempt 3 leaves 3 refused.
            self._marks[episode.rollout_id] = max(mark, episode.attempt)
            self._version += 1
        keys: list[WorkKey] = []
        for rollout_id in sorted({episode.rollout_id for episode in episodes}):
            mark = self._marks[rollout_id]
            for key in sorted(self._by_rollout.get(rollout_id, ())):
                if key.episode.attempt <= mark:
                    self._pending_restarts.discard(key)
                    self.set_state(key, EpisodeState.RETIRING, now)
                    keys.append(key)
        return tuple(keys)

    def finish_retire(self, key: WorkKey, now: float) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.state is EpisodeState.RETIRING:
            self._remove(key, now)

    def forget(self, rollout_ids: Iterable[str]) -> int:
        """Drop refusal marks; refused while a checkpoint is open or a retire is unfinished."""
        rollout_ids = tuple(rollout_ids)
        for rollout_id in rollout_ids:
            checked_id(rollout_id, "rollout_id")
        if self._phase not in (Phase.IDLE, Phase.RESTORED):
            raise _error(
                Reason.INVALID_PHASE,
                f"forget needs an idle or restored participant; phase is {self._phase.name}",
                phase=self._phase.name,
            )
        for rollout_id in rollout_ids:
            retiring = [
                key
                for key in self._by_rollout.get(rollout_id, ())
                if self._entries[key].state is EpisodeState.RETIRING
            ]
            if retiring:
                raise _error(
                    Reason.RETIRE_INCOMPLETE,
                    f"retire of {min(retiring).episode} has not freed its state yet",
                    rollout_id=rollout_id,
                )
        dropped = sum(
            1 for rollout_id in set(rollout_ids) if self._marks.pop(rollout_id, None) is not None
        )
        if dropped:
            self._version += 1
        return dropped

    def _changed(self, entry: _Entry, now: float, *, removed: bool = False) -> None:
        self._version += 1
        if self._phase is _PREPARING or self._phase is _PREPARED:
            self._refresh_readiness_phase()
        if self._record_events:
            self._events.append(
                CoreEvent(
                    entry.key.episode,
                    entry.key.slot,
                    entry.state,
                    entry.boundary_index,
                    entry.turn_index,
                    now,
                )
            )


def _view(entry: _Entry) -> EntryView:
    return EntryView(
        entry.key,
        entry.state,
        entry.receipt,
        entry.detail,
        entry.replayable,
        entry.boundary_index,
        entry.turn_index,
        entry.blocks,
    )


class CoreView:
    """The reads of a :class:`ParticipantCore` and none of its changes.

    What the runtime hands out for looking without the lock (its ``phase``, a status
    gauge, a test's assertion): every value is read from the core at the moment it is
    asked for, and nothing here can change the core, so every change still happens
    under the one lock (``Shared.changing``).
    """

    __slots__ = ("_core",)

    def __init__(self, core: ParticipantCore) -> None:
        self._core = core

    @property
    def phase(self) -> Phase:
        return self._core.phase

    @property
    def admission_open(self) -> bool:
        return self._core.admission_open

    @property
    def active_checkpoint_id(self) -> str | None:
        return self._core.active_checkpoint_id

    @property
    def lease_expires_at(self) -> float | None:
        return self._core.lease_expires_at

    @property
    def lease_expiries(self) -> int:
        return self._core.lease_expiries

    @property
    def fence(self) -> Fence | None:
        return self._core.fence

    @property
    def epoch(self) -> int:
        return self._core.epoch

    @property
    def fresh(self) -> bool:
        return self._core.fresh

    @property
    def restoring(self) -> bool:
        return self._core.restoring

    @property
    def ready(self) -> bool:
        return self._core.ready

    @property
    def blocker_count(self) -> int:
        return self._core.blocker_count

    @property
    def version(self) -> int:
        return self._core.version

    @property
    def record_events(self) -> bool:
        return self._core.record_events

    @property
    def refused_rollouts(self) -> int:
        return self._core.refused_rollouts

    def refusal_mark(self, rollout_id: str) -> int | None:
        return self._core.refusal_mark(rollout_id)

    def is_finished(self, checkpoint_id: str) -> bool:
        return self._core.is_finished(checkpoint_id)

    def entry(self, key: WorkKey) -> EntryView | None:
        return self._core.entry(key)

    def state_of(self, key: WorkKey) -> EpisodeState | None:
        return self._core.state_of(key)

    def episodes_in(self, state: EpisodeState, slot: str) -> list[EpisodeId]:
        return self._core.episodes_in(state, slot)

    def entries(self) -> Iterator[EntryView]:
        return self._core.entries()

    def keys_of(self, rollout_id: str) -> tuple[WorkKey, ...]:
        return self._core.keys_of(rollout_id)

    def is_restart(self, key: WorkKey) -> bool:
        return self._core.is_restart(key)

    def readiness(self, max_blockers: int) -> ReadinessReport:
        return self._core.readiness(max_blockers)

    def recount(self) -> tuple[int, dict[EpisodeState, int]]:
        return self._core.recount()

    def lease_expired(self, now: float) -> str | None:
        return self._core.lease_expired(now)
