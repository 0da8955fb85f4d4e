"""What the runtime and the kind hosts share: the one lock, the core, clocks and deadlines.

Every state change of a participant happens inside :meth:`Shared.changing`: it holds
the one lock, hands out the pure core, and on the way out passes the core's events to
watchers (if any watch) and wakes the waiters, which then re-check their own predicate
under the lock. The core is reachable only there; :meth:`Shared.locked` holds the lock to
read several values at one instant and :attr:`Shared.view` reads without it, both
through a :class:`~._core.CoreView`, which cannot change the core. Waiters for admission to open (parked episodes, held model replies)
are woken only when it is open; every other waiter (a waiting prepare, a run's
followers, a budget) on every change.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Protocol

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.protocol import ParticipantKind, RecoveryMode

from ._core import CoreEvent, CoreView, ParticipantCore, WorkKey
from ._store_format import PlainRecord, Record

logger = logging.getLogger("turnpoint.participant_sdk")


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """Tunables of one participant runtime.

    ``reply_margin_s`` / ``reply_margin_fraction``: a call is answered this long before
    its deadline (the smaller of the two), so the reply itself still fits.
    ``default_call_timeout_s`` applies to calls that arrive without a deadline.
    ``model_retry_backoff_s``: how long an agent waits before re-issuing a model call the
    model server refused with ADMISSION_CLOSED while this participant's own admission is
    open (the two checkpoints are not in step). ``run_admission_wait_s``: how long a
    Run that lets a new attempt wait for admission (``wait_for_admission``) waits before
    it is refused with ADMISSION_CLOSED after all. ``restore_running``: serve
    RestoreRunning and list its capability in Describe (docs/spec.md section 4.16); off,
    a coordinator restores this participant only when it is fresh (section 4.10).
    ``unreachable_wait_s``: how long an agent keeps re-issuing a model or tool call whose
    server is unreachable (``UNAVAILABLE``) before the episode fails: long enough for a
    lost server to be found and replaced where it was (section 7.15).
    ``await_weights``: a model refuses every generation (``UNAVAILABLE``) until its
    first weights update is installed; a policy server started to replace a lost one
    serves the trainer's current weights, never its initial ones (section 7.15 item 1).
    """

    default_lease_s: float = 60.0
    default_call_timeout_s: float = 60.0
    reply_margin_s: float = 0.5
    reply_margin_fraction: float = 0.1
    default_max_blockers: int = 32
    max_blockers_limit: int = 1024
    max_finished_ids: int = 1024
    max_answered_requests: int = 4096
    model_retry_backoff_s: float = 0.5
    watch_queue_size: int = 1024
    run_admission_wait_s: float = 5.0
    restore_running: bool = True
    unreachable_wait_s: float = 60.0
    await_weights: bool = False

    def __post_init__(self) -> None:
        for name in (
            "default_lease_s",
            "default_call_timeout_s",
            "model_retry_backoff_s",
            "run_admission_wait_s",
            "unreachable_wait_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.reply_margin_s < 0 or not 0 <= self.reply_margin_fraction < 1:
            raise ValueError("reply margins must be >= 0 (fraction < 1)")
        if self.default_max_blockers < 0 or self.max_blockers_limit < 1:
            raise ValueError("blocker caps must be positive")
        if self.watch_queue_size < 1:
            raise ValueError("watch_queue_size must be >= 1")


class Deadline:
    """When a call must be answered: its gRPC deadline minus a reply margin.

    Measured on the event loop's clock because it bounds real waits; protocol time
    (leases, budgets) runs on the injectable clock instead.
    """

    def __init__(self, timeout_s: float | None, config: RuntimeConfig) -> None:
        total = config.default_call_timeout_s if timeout_s is None else max(0.0, timeout_s)
        margin = min(config.reply_margin_s, total * config.reply_margin_fraction)
        self._loop = asyncio.get_running_loop()
        self._at = self._loop.time() + total - margin

    @classmethod
    def never(cls) -> Deadline:
        deadline = cls.__new__(cls)
        deadline._loop = asyncio.get_running_loop()
        deadline._at = float("inf")
        return deadline

    def remaining(self) -> float | None:
        """Seconds left (>= 0), or None for a deadline that never comes."""
        if self._at == float("inf"):
            return None
        return max(0.0, self._at - self._loop.time())

    def exceeded(self, what: str) -> TurnpointError:
        return TurnpointError(
            Reason.DEADLINE_EXCEEDED,
            f"{what} did not finish before the call's deadline; it continues and a retry joins it",
        )


class _Watcher:
    def __init__(self, size: int) -> None:
        self.events: deque[CoreEvent] = deque(maxlen=size)
        self.lagged = False
        self.wake = asyncio.Event()

    def push(self, events: Sequence[CoreEvent]) -> None:
        if len(self.events) + len(events) > (self.events.maxlen or 0):
            # The oldest boundary events fall out; the readiness report that follows
            # still tells the watcher where everything stands.
            self.lagged = True
        self.events.extend(events)
        self.wake.set()


class _Lock(asyncio.Lock):
    """The participant's one lock, which a hot path may also take without a coroutine."""

    _locked: bool  # asyncio.Lock's own state (typeshed declares only its waiters)

    def take(self) -> bool:
        """Take the lock now if :meth:`acquire` would take it without waiting: it is
        free and nobody waits for it (a waiter already woken goes first). ``acquire``'s
        own test; a coroutine run by hand to ask it costs more than the change it guards.
        """
        if self._locked or self._waiters:
            return False
        # What acquire() does on its fast path; a released take() is a release().
        self._locked = True
        return True

    def release(self) -> None:
        if self._locked and not self._waiters:
            self._locked = False  # nobody to wake: what release() comes to, inline
        else:
            super().release()


class _Changing:
    """What :meth:`Shared.changing` returns: the lock held around a change, published on exit."""

    __slots__ = ("_shared",)

    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    async def __aenter__(self) -> ParticipantCore:
        shared = self._shared
        if not shared._lock.take():
            await shared.cond.acquire()
        return shared._core

    async def __aexit__(self, *exc: object) -> None:
        try:
            # Forced: some changes live outside the core (a result set on an execution).
            self._shared.publish(force=True)
        finally:
            self._shared.cond.release()


class _Locked:
    """What :meth:`Shared.locked` returns: the lock held around a look, nothing published."""

    __slots__ = ("_shared",)

    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    async def __aenter__(self) -> CoreView:
        await self._shared.cond.acquire()
        return self._shared.view

    async def __aexit__(self, *exc: object) -> None:
        self._shared.cond.release()


class Shared:
    """The one lock, the core and the clocks of one participant."""

    def __init__(
        self,
        core: ParticipantCore,
        config: RuntimeConfig,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        # Only changing() hands it out, with the lock held: the one writer.
        self._core = core
        self.view = CoreView(core)
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        # The last checkpoint whose commit finished here (GetStatus): a commit that
        # released its checkpoint leaves no phase that shows it was written.
        self.committed_checkpoint_id: str | None = None
        lock = self._lock = _Lock()
        self.cond = asyncio.Condition(lock)
        # Parked episodes and held replies wait for one thing, admission opening; they
        # wait on this second condition over the same lock, woken only by a change that
        # leaves admission open. On the general condition, every episode that parks
        # during a prepare would wake every episode parked before it.
        self._admission_opened = asyncio.Condition(lock)
        self._admission_waiters = 0
        # Tasks inside a wait on the general condition: most changes (every boundary)
        # find none, and then skip the notification.
        self._change_waiters = 0
        self._watchers: set[_Watcher] = set()
        self._published_version = -1
        # Called (lock held) with the new expiry when the lease moved: the runtime arms
        # its lease timer there, on no other state change (a control call makes several).
        self.on_lease_moved: Callable[[float | None], None] | None = None
        self._published_lease: float | None = None
        self._changing = _Changing(self)
        self._locked = _Locked(self)
        # The core's events only reach watchers: it records them only while one watches.
        core.record_events = False

    def now(self) -> float:
        return self.clock()

    def to_wall(self, at: float | None) -> float | None:
        """Map a time on the protocol clock to seconds since the epoch, for the wire."""
        if at is None:
            return None
        return self.wall_clock() + (at - self.clock())

    def changing(self) -> _Changing:
        """Hold the lock to change state; watchers and waiters learn of it on the way out.

        ``async with shared.changing() as core:``. One reusable object rather than a
        generator-based context manager: an episode enters this several times per turn.
        """
        return self._changing

    def change_now(self) -> ParticipantCore | None:
        """The core with the lock taken, if taking it needs no wait; else None.

        The synchronous door to :meth:`changing` for a change made many times per
        episode (a boundary): the caller then calls :meth:`changed` when done (in a
        ``finally``), and may await inside as in ``changing``. It takes the lock when
        ``acquire`` would without suspending (:meth:`_Lock.take`).
        """
        lock = self._lock
        if lock._locked or lock._waiters:  # _Lock.take, inline: a boundary comes here
            return None
        lock._locked = True
        return self._core

    def changed(self) -> None:
        """End a change begun by :meth:`change_now`: publish it and release the lock."""
        try:
            core = self._core
            if (
                self._watchers
                or self._change_waiters
                or self._admission_waiters
                or core.lease_expires_at != self._published_lease
            ):
                self.publish(force=True)
            else:
                # Nobody to tell (every boundary of a lone run): what publish comes to.
                self._published_version = core.version
        finally:
            lock = self._lock
            if lock._locked and not lock._waiters:
                lock._locked = False  # _Lock.release, inline: a boundary comes here
            else:
                lock.release()

    def locked(self) -> _Locked:
        """Hold the lock to read the core at one instant, publishing nothing.

        ``async with shared.locked() as core:`` gives the read-only view; the waits
        below may be called inside. Changes are made in :meth:`changing` only.
        """
        return self._locked

    def publish(self, *, force: bool = False) -> None:
        """Hand the core's events to watchers and wake waiters; the lock must be held.

        Unforced, it does nothing unless the core changed since the last publication, so
        that waiters re-checking their predicate never wake each other in a loop.
        """
        lease = self._core.lease_expires_at
        if lease != self._published_lease:
            self._published_lease = lease
            if self.on_lease_moved is not None:
                self.on_lease_moved(lease)
        version = self._core.version
        if not force and version == self._published_version:
            return
        self._published_version = version
        if self._watchers:
            events = self._core.drain_events()
            for watcher in self._watchers:
                watcher.push(events)
        if self._change_waiters:
            self.cond.notify_all()
        if self._admission_waiters and self._core.admission_open:
            self._admission_opened.notify_all()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait (lock held) until ``predicate`` holds.

        Changes made under the lock just before are published first: a waiter inside a
        ``changing`` block (an episode parking) must not hide its change from the others.
        """
        if predicate():
            return
        self.publish()
        self._change_waiters += 1
        try:
            await self.cond.wait_for(predicate)
        finally:
            self._change_waiters -= 1

    async def wait_admission_open(self) -> None:
        """Wait (lock held) until admission is open: ``wait_for(lambda: core.admission_open)``.

        Woken only by changes that leave admission open (see ``_admission_opened``).
        """
        if self._core.admission_open:
            return
        self.publish()
        self._admission_waiters += 1
        try:
            while not self._core.admission_open:
                await self._admission_opened.wait()
        finally:
            self._admission_waiters -= 1

    async def wait_change(self, limit_s: float | None = None) -> None:
        """Wait (lock held) for the next state change, or ``limit_s``."""
        self.publish()
        self._change_waiters += 1
        try:
            with suppress(TimeoutError):
                async with asyncio.timeout(limit_s):
                    await self.cond.wait()
        finally:
            self._change_waiters -= 1

    async def wait_until(self, predicate: Callable[[], bool], limit_s: float | None) -> bool:
        """Wait (lock held) until ``predicate`` holds or ``limit_s`` passed; return it."""
        if predicate():
            return True
        if limit_s is not None and limit_s <= 0:
            return False
        self.publish()
        self._change_waiters += 1
        try:
            async with asyncio.timeout(limit_s):
                await self.cond.wait_for(predicate)
        except TimeoutError:
            return predicate()
        finally:
            self._change_waiters -= 1
        return True

    def add_watcher(self) -> _Watcher:
        """A new watcher: it receives the events of the changes made from now on."""
        watcher = _Watcher(self.config.watch_queue_size)
        self._watchers.add(watcher)
        self._core.record_events = True
        return watcher

    def remove_watcher(self, watcher: _Watcher) -> None:
        self._watchers.discard(watcher)
        if not self._watchers:
            self._core.record_events = False


def invalid_record(record: Record, why: str) -> TurnpointError:
    return TurnpointError(
        Reason.INVALID_CHECKPOINT_STATE,
        f"record {record.key!r} of {record.episode} is invalid: {why}",
        {"episode": str(record.episode), "key": record.key},
    )


class KindHost(Protocol):
    """What the runtime needs from each kind it hosts (agent, resources, model).

    ``slot`` names the kind's entries in the work table (``WorkKey.slot``, or its part
    before a ``/``); ``record_key`` the records it exports (None: it exports nothing).
    """

    @property
    def slot(self) -> str: ...

    @property
    def record_key(self) -> str | None: ...

    @property
    def kind(self) -> ParticipantKind: ...

    @property
    def recovery_mode(self) -> RecoveryMode: ...

    async def admission_closed(self) -> None:
        """Admission just closed (lock held); a failure makes the prepare fail and reopen."""

    async def admission_opened(self) -> None:
        """Admission just reopened (lock held). Also called after a restore ends."""

    async def export(self, keys: Sequence[WorkKey]) -> Sequence[Record | PlainRecord]:
        """Records of the frozen state of ``keys`` (every key at least one record); a
        :class:`PlainRecord` is one checked and copied already."""

    def validate(self, record: Record) -> None:
        """Raise (TurnpointError INVALID_CHECKPOINT_STATE) if ``record`` cannot be installed."""

    async def install(self, record: Record, episode: EpisodeId) -> WorkKey:
        """Install a validated record as ``episode`` (attempt N+1) and add its entry."""

    async def stop(self, key: WorkKey) -> None:
        """Stop the work of ``key`` and free its state; the runtime then drops the entry."""

    async def aclose(self) -> None:
        """Stop everything (process shutdown)."""

    def describe(self) -> Mapping[str, object]:
        """Kind-specific Describe fields (verify mode, group scoring)."""
