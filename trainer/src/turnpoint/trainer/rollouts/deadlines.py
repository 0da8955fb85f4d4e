"""Rollout time budgets that stop while a checkpoint (or anything else) holds the trainer.

docs/spec.md section 6.7: a snapshot parks every rollout, so a trainer
whose rollout deadline kept running would give up on rollouts that are only waiting for
it, and nobody would acknowledge their results. This registry makes that impossible on
the trainer side:

- A rollout's budget counts *active* time only. While any holder holds (a snapshot, a
  weight sync, anything that keeps admission closed) no budget runs.
- Holders are counted, not flagged: a snapshot that ends while a weight-sync pause is
  still on must not restart clocks the weight sync still holds. Each :meth:`hold`
  returns its own :class:`Hold` handle and releasing one twice is a no-op, so one
  holder's bookkeeping error can never release another holder's hold.
- A single episode can also be parked on its own (:meth:`DeadlineRegistry.pause`), for
  example a rollout held at a checkpoint boundary while the others run on.

The registry is pure: every call takes ``now`` (a monotonic clock reading, in seconds)
and it never reads a clock itself, so a test drives hours of budgets in microseconds.

Implementation note: rather than touching every rollout at each hold and release, the
registry keeps one *active clock*: wall time minus the time spent held. A rollout's
consumed budget is the active time elapsed since it last started running, plus what it
had consumed before. Holding and releasing are O(1) whatever the number of rollouts,
and deadlines live in a heap keyed on the active clock, which a hold never reorders.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True, eq=False)
class Hold:
    """One holder's claim that rollout clocks must not run.

    Compared by identity: two holds with the same name are still two holders.
    """

    name: str
    acquired_at: float
    _serial: int = field(repr=False)


@dataclass(slots=True)
class _Budget:
    budget_s: float
    # Budget consumed up to the active-clock instant ``running_since``, or in total
    # while the rollout is paused (``running_since is None``).
    consumed_s: float
    running_since: float | None
    # Serial of this budget's live heap entry (-1: none, paused). Serials are unique
    # across the registry, so entries left by a finished key, a pause or an earlier
    # run of the same key are recognised as stale and skipped.
    serial: int = -1


class DeadlineRegistry(Generic[K]):
    """Active-time budgets of rollouts, suspended while any holder holds.

    Keys are whatever identifies a rollout to the caller (an ``EpisodeId`` typically).
    All methods take ``now``; readings that go backwards are treated as ``now`` equal to
    the latest reading seen, because a budget must never be refunded.
    """

    def __init__(self) -> None:
        self._budgets: dict[K, _Budget] = {}
        # (active-clock deadline, serial, key); lazily invalidated, see _Budget.serial.
        self._heap: list[tuple[float, int, K]] = []
        self._entry_serials = itertools.count()
        self._hold_serials = itertools.count()
        self._holds: dict[int, Hold] = {}
        self._last_now = -math.inf
        # Held time accumulated by finished hold periods, and the start of the current
        # hold period (None while nothing holds).
        self._held_total_s = 0.0
        self._held_since: float | None = None

    # -- clock -------------------------------------------------------------------------

    def _observe(self, now: float) -> float:
        if math.isnan(now):
            raise ValueError("now must be a number, got NaN")
        if now > self._last_now:
            self._last_now = now
        return self._last_now

    def _active_clock(self, now: float) -> float:
        held = self._held_total_s
        if self._held_since is not None:
            held += now - self._held_since
        return now - held

    # -- holders -----------------------------------------------------------------------

    @property
    def held(self) -> bool:
        """Whether any holder currently holds (so no budget runs)."""
        return bool(self._holds)

    @property
    def holders(self) -> tuple[str, ...]:
        """Names of the current holders, oldest first (a name may appear twice)."""
        return tuple(hold.name for hold in self._holds.values())

    def held_seconds(self, now: float) -> float:
        """Total wall time during which at least one holder held, up to ``now``."""
        now = self._observe(now)
        return now - self._active_clock(now)

    def hold(self, name: str, now: float) -> Hold:
        """Stop every rollout clock until the returned handle is released."""
        now = self._observe(now)
        if not self._holds:
            self._held_since = now
        handle = Hold(name=name, acquired_at=now, _serial=next(self._hold_serials))
        self._holds[handle._serial] = handle
        return handle

    def release(self, handle: Hold, now: float) -> bool:
        """Drop one hold; clocks restart only when no other holder remains.

        Returns whether this call released anything: releasing a handle twice (or a
        handle of another registry) is a no-op, so that cleanup paths may release
        unconditionally.
        """
        now = self._observe(now)
        if self._holds.get(handle._serial) is not handle:
            return False
        del self._holds[handle._serial]
        if not self._holds and self._held_since is not None:
            self._held_total_s += now - self._held_since
            self._held_since = None
        return True

    # -- budgets -----------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._budgets

    def __len__(self) -> int:
        return len(self._budgets)

    def start(self, key: K, budget_s: float, now: float) -> None:
        """Start the budget of ``key``; ``math.inf`` means it never expires."""
        now = self._observe(now)
        if not budget_s > 0:  # also rejects NaN
            raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
        if key in self._budgets:
            raise ValueError(f"a budget for {key!r} is already running; finish() it first")
        budget = _Budget(budget_s=budget_s, consumed_s=0.0, running_since=None)
        self._budgets[key] = budget
        self._run(key, budget, self._active_clock(now))

    def finish(self, key: K) -> bool:
        """Forget ``key``; returns whether it was tracked. Idempotent."""
        # The heap entry goes stale and is dropped when it surfaces or at compaction.
        if self._budgets.pop(key, None) is None:
            return False
        self._maybe_compact()
        return True

    def pause(self, key: K, now: float) -> None:
        """Park one rollout: its budget stops until :meth:`unpause`. Idempotent."""
        now = self._observe(now)
        budget = self._get(key)
        if budget.running_since is None:
            return
        budget.consumed_s += self._active_clock(now) - budget.running_since
        budget.running_since = None
        if budget.consumed_s < budget.budget_s:
            budget.serial = -1
            self._maybe_compact()
        # else: the budget ran out before the park, so its (past) deadline entry stays
        # live and expired() keeps reporting it.

    def unpause(self, key: K, now: float) -> None:
        """Let a parked rollout's budget run again. Idempotent."""
        now = self._observe(now)
        budget = self._get(key)
        if budget.running_since is not None:
            return
        self._run(key, budget, self._active_clock(now))

    def paused(self, key: K) -> bool:
        return self._get(key).running_since is None

    def consumed(self, key: K, now: float) -> float:
        """Active seconds ``key`` has spent so far (may exceed its budget)."""
        now = self._observe(now)
        budget = self._get(key)
        if budget.running_since is None:
            return budget.consumed_s
        return budget.consumed_s + self._active_clock(now) - budget.running_since

    def remaining(self, key: K, now: float) -> float:
        """Active seconds left before ``key`` expires, never below zero."""
        budget = self._get(key)
        return max(0.0, budget.budget_s - self.consumed(key, now))

    def expired(self, now: float) -> list[K]:
        """Keys whose budget is spent, most overdue first.

        A query, not a removal: a key stays expired (and is reported again) until the
        caller has dealt with it and called :meth:`finish`.
        """
        now = self._observe(now)
        active_now = self._active_clock(now)
        due: list[tuple[float, int, K]] = []
        while self._heap and self._heap[0][0] <= active_now:
            entry = heapq.heappop(self._heap)
            if self._is_current(entry):
                due.append(entry)
        for entry in due:
            heapq.heappush(self._heap, entry)
        return [key for _, _, key in due]

    def next_expiry(self, now: float) -> float | None:
        """Seconds of wall time until the next budget expires if nothing changes.

        ``0.0`` when something has already expired; ``None`` when nothing can expire
        (no running budget, or clocks are held). Any call that changes the registry can
        change the answer, so an async pump sleeping on it must also wake on changes.
        """
        now = self._observe(now)
        self._drop_stale_top()
        if not self._heap:
            return None
        wait = self._heap[0][0] - self._active_clock(now)
        if wait <= 0.0:
            return 0.0
        if self._holds or math.isinf(wait):
            return None
        return wait

    # -- internals ---------------------------------------------------------------------

    def _get(self, key: K) -> _Budget:
        try:
            return self._budgets[key]
        except KeyError:
            raise KeyError(f"no budget is running for {key!r}") from None

    def _run(self, key: K, budget: _Budget, active_now: float) -> None:
        # A previous entry of an overdue parked budget is superseded by this one.
        budget.running_since = active_now
        budget.serial = next(self._entry_serials)
        deadline = active_now + (budget.budget_s - budget.consumed_s)
        heapq.heappush(self._heap, (deadline, budget.serial, key))

    def _is_current(self, entry: tuple[float, int, K]) -> bool:
        _, serial, key = entry
        budget = self._budgets.get(key)
        return budget is not None and budget.serial == serial

    def _maybe_compact(self) -> None:
        # Stale entries of long (or infinite) budgets would otherwise only leave the
        # heap when their deadline surfaces, which for a busy trainer is never.
        if len(self._heap) > 2 * len(self._budgets) + 64:
            self._heap = [entry for entry in self._heap if self._is_current(entry)]
            heapq.heapify(self._heap)

    def _drop_stale_top(self) -> None:
        while self._heap and not self._is_current(self._heap[0]):
            heapq.heappop(self._heap)
