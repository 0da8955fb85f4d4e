"""The rollout ledger's state, its bookkeeping, and the cut and restore of it.

:class:`LedgerState` holds every piece of state the rollout ledger keeps (see
:mod:`turnpoint.trainer.rollouts.ledger` for what each is), the few primitives every decision
changes it through, and the snapshot side: :meth:`~LedgerState.rollout_state` (the cut,
docs/spec.md section 8.7) and :meth:`~LedgerState.install` /
:meth:`~LedgerState.redispatch` / :meth:`~LedgerState.rerun_from_prompt` (a restore,
section 7.7). :class:`~turnpoint.trainer.rollouts.ledger.RolloutLedger` adds the decisions.

Pure: no grpc, no asyncio, no clock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

from turnpoint.ids import EpisodeId, validate_attempt, validate_id
from turnpoint.trainer.rollouts.attempts import Attempt, AttemptPhase, Receipt, RolloutStats
from turnpoint.trainer.rollouts.deadlines import DeadlineRegistry
from turnpoint.trainer.rollouts.side import InFlightRollout
from turnpoint.trainer.rollouts.values import (
    Rollout,
    RolloutClientSettings,
    RolloutOutcome,
    RolloutResult,
    SavedRollout,
    read_rollout_state,
)
from turnpoint.trainer.storage.manifest import JSONValue, RolloutBooks, TrainerRolloutState


def _nothing() -> None:
    return None


class LedgerState:
    """State and primitives of the rollout ledger; the cut and the restore."""

    def __init__(
        self,
        instances: Iterable[str],
        settings: RolloutClientSettings | None = None,
        *,
        request_ids: Callable[[], str],
        on_change: Callable[[], None] = _nothing,
        group_scored: Iterable[str] = (),
    ) -> None:
        # Each attempt's Run request id; the driver draws them (the ledger reads no
        # randomness), unique across trainer incarnations.
        self._request_ids = request_ids
        self._instances = frozenset(validate_id(name, "agent instance") for name in instances)
        self._settings = settings or RolloutClientSettings()
        self._on_change = on_change
        self._group_scored = frozenset(group_scored)
        self._deadlines: DeadlineRegistry[EpisodeId] = DeadlineRegistry()
        self._version = 0

        self._gate_open = True
        # Bumped at every reopen: tells a refused Run whether the gate closed and
        # reopened since it was sent (resend now) or not (the participant closed alone).
        self._gate_generation = 0
        # Instances closed on their own (a release that failed), and their reopen counts,
        # which play the global generation's part for their Runs.
        self._closed_instances: set[str] = set()
        self._instance_generations: dict[str, int] = dict.fromkeys(self._instances, 0)

        self._live: dict[str, Attempt] = {}
        self._pending: collections.deque[Attempt] = collections.deque()
        self._pending_restored: collections.deque[Attempt] = collections.deque()
        self._attempts: dict[str, int] = {}
        self._queue: dict[str, RolloutResult] = {}
        self._saved: dict[str, SavedRollout] = {}
        self._loader: JSONValue = None

        self._owed: dict[str, Receipt] = {}
        self._acked: collections.OrderedDict[str, Receipt] = collections.OrderedDict()
        self._retires: dict[str, set[EpisodeId]] = {}
        # Completed attempts whose sessions the resources servers still keep sealed
        # (docs/spec.md section 5.3 item 3): retired there at the next flush.
        self._session_retires: set[EpisodeId] = set()
        self._stats = RolloutStats()

    # ------------------------------------------------------------------ the cut & restore

    def rollout_state(self) -> TrainerRolloutState:
        """The cut (docs/spec.md section 8.7): queue of finished rollouts not yet trained
        on, loader position, attempt ledger, and every unfinished rollout with its task
        (owned or not, ``accepted`` saying which)."""
        return self.rollout_books().state()

    def rollout_books(self) -> RolloutBooks:
        """:meth:`rollout_state`'s parts, copied and not yet checked."""
        in_flight = [
            SavedRollout(
                attempt.describe(), attempt.budget_s, attempt.phase is AttemptPhase.OWNED
            ).to_json()
            for attempt in self._live.values()
        ]
        in_flight += [saved.to_json() for saved in self._saved.values()]
        return RolloutBooks(
            queue=tuple(result.to_json() for result in self._queue.values()),
            data_loader=self._loader,
            attempts=dict(self._attempts),
            in_flight=tuple(in_flight),
        )

    def saved(self) -> tuple[SavedRollout, ...]:
        """Descriptors a restore installed that nobody continued or reran yet."""
        return tuple(self._saved.values())

    def install(self, state: TrainerRolloutState) -> tuple[SavedRollout, ...]:
        """Reinstall a snapshot's queue, ledger and loader position into a fresh ledger.

        Returns the unfinished rollouts it recorded; the restore then continues each one
        (:meth:`redispatch`) or reruns it (:meth:`rerun_from_prompt`). Until then they
        stay part of :meth:`rollout_state`, so a snapshot taken meanwhile loses none.
        """
        if self._live or self._queue or self._attempts or self._saved:
            raise RuntimeError("install() needs a client that has not run anything yet")
        queue, saved = read_rollout_state(state)
        self._queue = {result.rollout_id: result for result in queue}
        self._saved = {item.rollout.episode.rollout_id: item for item in saved}
        self._attempts = dict(state.attempts)
        self._loader = state.data_loader
        self._bump()
        return tuple(saved)

    def redispatch(
        self, rollout: InFlightRollout, instance: str | None = None, *, now: float
    ) -> Attempt:
        """Continue a saved attempt N as N+1 on ``instance`` (default: the one that saved it).

        The participant installed N+1 at restore, so the attempt is owned from ``now`` on
        (in the cut, its budget running) and its Run passes even a closed gate, as the
        participant admits a restored replacement. If the participant refuses it
        nevertheless (it does not hold it), it falls back to an ordinary dispatch that
        waits for the gate.
        """
        target = rollout.instance if instance is None else instance
        rollout_id = rollout.episode.rollout_id
        self._check_restorable(rollout, target)
        saved = self._saved.pop(rollout_id, None)
        budget = saved.budget_s if saved is not None else self._settings.default_budget_s
        attempt = Attempt(
            Rollout.from_descriptor(rollout, target, budget),
            rollout.episode.next_attempt(),
            target,
            budget,
            boundaries_seen=rollout.boundaries_seen,
            phase=AttemptPhase.OWNED,
            restored=True,
            request_id=self._request_ids(),
        )
        self._add_live(attempt)
        self._start_budget(attempt, now)
        return attempt

    def rerun_from_prompt(
        self,
        rollout: InFlightRollout,
        *,
        instance: str | None = None,
        attempt: int | None = None,
    ) -> Attempt:
        """Start a saved rollout over from its prompt, as a new attempt behind the gate.

        The attempt defaults to one past both the ledger and the descriptor; pass a
        higher one to skip attempts that were used elsewhere (a retired N+1).
        """
        target = rollout.instance if instance is None else instance
        rollout_id = rollout.episode.rollout_id
        self._check_restorable(rollout, target)
        lowest = max(self._attempts.get(rollout_id, -1), rollout.episode.attempt) + 1
        number = lowest if attempt is None else validate_attempt(attempt)
        if number < lowest:
            raise ValueError(f"attempt {number} of {rollout_id!r} is not newer than {lowest - 1}")
        saved = self._saved.pop(rollout_id, None)
        budget = saved.budget_s if saved is not None else self._settings.default_budget_s
        new = Attempt(
            Rollout.from_descriptor(rollout, target, budget),
            EpisodeId(rollout_id, number),
            target,
            budget,
            request_id=self._request_ids(),
        )
        self._add_live(new)
        return new

    def _known_instance(self, instance: str) -> None:
        if instance not in self._instances:
            raise ValueError(f"unknown agent instance {instance!r}")

    def _check_new(self, rollout_id: str, instance: str) -> None:
        self._known_instance(instance)
        if rollout_id in self._attempts or rollout_id in self._saved:
            raise ValueError(f"rollout {rollout_id!r} is already known to this client")

    def _check_restorable(self, rollout: InFlightRollout, instance: str) -> None:
        rollout_id = rollout.episode.rollout_id
        self._known_instance(instance)
        if rollout_id in self._live:
            raise ValueError(f"rollout {rollout_id!r} is already running")
        if rollout_id in self._queue:
            # docs/spec.md section 7.7: never run again what the queue already holds.
            raise ValueError(f"rollout {rollout_id!r} already has a result in the queue")
        owned = self._attempts.get(rollout_id)
        if owned is not None and owned != rollout.episode.attempt:
            raise ValueError(
                f"descriptor {rollout.episode} is stale: the ledger holds attempt {owned}"
            )

    # ------------------------------------------------------------------ bookkeeping

    def _changed(self) -> None:
        self._on_change()

    def _bump(self) -> None:
        self._version += 1
        self._on_change()

    def _require_owned(self, attempt: Attempt, what: str) -> None:
        if attempt.phase is not AttemptPhase.OWNED:
            raise RuntimeError(f"{what} for {attempt.episode}, which is {attempt.phase.value}")

    def _add_live(self, attempt: Attempt) -> None:
        rollout_id = attempt.episode.rollout_id
        self._live[rollout_id] = attempt
        self._attempts[rollout_id] = attempt.episode.attempt
        if attempt.restored:
            self._pending_restored.append(attempt)
        else:
            self._pending.append(attempt)
        self._bump()

    def _start_budget(self, attempt: Attempt, now: float) -> None:
        if attempt.budget_s is None or attempt.episode in self._deadlines:
            return
        self._deadlines.start(
            attempt.episode, attempt.budget_s + self._settings.budget_grace_s, now
        )

    def _unown(self, attempt: Attempt) -> None:
        """The participant does not hold the attempt (it refused its Run)."""
        if attempt.phase is AttemptPhase.OWNED:
            self._deadlines.finish(attempt.episode)
            self._bump()
        attempt.phase = AttemptPhase.PENDING
        attempt.restored = False
        self._changed()

    def _end(self, attempt: Attempt) -> None:
        attempt.phase = AttemptPhase.ENDED
        rollout_id = attempt.episode.rollout_id
        if self._live.get(rollout_id) is attempt:
            del self._live[rollout_id]
        self._deadlines.finish(attempt.episode)
        self._bump()

    def _record(self, attempt: Attempt, outcome: RolloutOutcome, **details: Any) -> None:
        self._queue[attempt.episode.rollout_id] = attempt.result(outcome, **details)
        self._stats.results += 1
        self._bump()
