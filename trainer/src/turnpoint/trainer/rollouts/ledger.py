"""The trainer's rollout ledger: who owns which attempt, what the cut holds, what is owed.

docs/spec.md sections 6.10, 7.6 and 8.7, as plain state decided in one place. No grpc,
no asyncio, no clock: every method that depends on time takes ``now`` (monotonic
seconds, on any scale the caller picks), so a test drives hours of budgets in
microseconds. The asyncio driver (:class:`~turnpoint.trainer.rollouts.client.RolloutClient`)
feeds it what the wire said and turns its answers into calls, waits and cancellations.

What it keeps:

- **Attempts.** One live :class:`~turnpoint.trainer.rollouts.attempts.Attempt` per unfinished
  rollout, in a phase ``PENDING`` (queued, or at the gate: owned by nobody) ->
  ``CALLING`` (its Run sent, no verdict yet) -> ``OWNED`` (the participant accepted it,
  or a restore installed it: part of the cut, its budget running) -> ``ENDED``. A
  refusal unwinds it back to ``PENDING``; only :meth:`~RolloutLedger.accept` (or a
  restore) makes an attempt owned, so it is dispatched only once accepted (section 7.6
  item 1).
- **The attempt ledger**: rollout id -> the attempt the trainer owns. It only grows for a
  rollout (reruns, restores as N+1) until the training loop consumes the result.
- **The dispatch gate**, global and per instance, with reopen generations that tell a
  refusal whether the gate moved since its Run was sent (section 6.10 items 1 and 2).
- **The results queue**, the saved descriptors a restore installed, the data-loader
  position: with the live attempts, what :meth:`~RolloutLedger.rollout_state` cuts.
- **Receipts** owed (recorded, not yet acknowledged) and recently acknowledged; every
  received result's receipt is in exactly one of the two (section 6.4).
- **The retire queue** of attempts that ended without a completed result (section 7.6
  item 2), and the **whole-group retry** of group-scored environments (section 6.10 item
  8): a sibling given up or abandoned live reruns its whole prompt group.
- **Budgets** of owned attempts, in active time (a
  :class:`~turnpoint.trainer.rollouts.deadlines.DeadlineRegistry`), and the give-up decision
  when one is spent (section 6.7).
- counters (:class:`RolloutStats`) and the cut's ``version``.

Decisions come back as data with a reason: :class:`NextCall` after a Run ended without
a result, :class:`Resolution` for a completion a prepare reported.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from turnpoint.ids import EpisodeId, validate_attempt, validate_id
from turnpoint.trainer.rollouts.attempts import (
    Attempt,
    AttemptPhase,
    FinalResult,
    GateGeneration,
    NextCall,
    Receipt,
    Resolution,
    Resolve,
    RolloutStats,
)
from turnpoint.trainer.rollouts.deadlines import DeadlineRegistry, Hold
from turnpoint.trainer.rollouts.side import InFlightRollout
from turnpoint.trainer.rollouts.values import (
    Rollout,
    RolloutClientSettings,
    RolloutOutcome,
    RolloutResult,
    SavedRollout,
    backoff_s,
    plain_json_copies,
    read_rollout_state,
)
from turnpoint.trainer.storage.manifest import JSONValue, RolloutBooks, TrainerRolloutState

_LOG = logging.getLogger(__name__)

# Receipts acknowledged recently, kept so that a prepare reporting one of them again
# (its ack reply was lost) is answered by acknowledging again.
ACKED_MEMORY: Final = 4096


def _nothing() -> None:
    return None


class RolloutLedger:
    """The rollout books of one trainer; see the module docstring.

    ``instances`` are the agent instances Runs may go to. ``on_change`` is called after
    every change of state (the driver wakes its waiters with it); it must not call back
    into the ledger.
    """

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

    def rollout_state(self) -> TrainerRolloutState:
        """The cut (docs/spec.md section 8.7): queue of finished rollouts not yet trained
        on, loader position, attempt ledger, and every unfinished rollout with its task
        (owned or not, ``accepted`` saying which)."""
        return self.rollout_books().state()

    def rollout_books(self) -> RolloutBooks:
        """:meth:`rollout_state`'s parts, copied and not yet checked."""
        in_flight = [attempt.saved_json() for attempt in self._live.values()]
        for descriptor, task in zip(
            in_flight,
            plain_json_copies([descriptor["task"] for descriptor in in_flight], "task"),
            strict=True,
        ):
            descriptor["task"] = task
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
        self,
        rollout: InFlightRollout,
        instance: str | None = None,
        *,
        now: float,
        incarnation: str = "",
    ) -> Attempt:
        """Continue a saved attempt N as N+1 on ``instance`` (default: the one that saved it).

        The participant installed N+1 at restore, so the attempt is owned from ``now`` on
        (in the cut, its budget running) and its Run passes even a closed gate, as the
        participant admits a restored replacement. If the participant refuses it
        nevertheless (it does not hold it), it falls back to an ordinary dispatch that
        waits for the gate. ``incarnation`` is the participant incarnation the restore
        installed N+1 into: its first Run names it, so that a process restarted since
        refuses instead of starting N+1 from its prompt (docs/spec.md section 6.5 item 5).
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
            incarnation=incarnation,
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

    def end_for_heal(self, episodes: Iterable[EpisodeId]) -> tuple[Attempt, ...]:
        """End the live attempts a heal replaces (docs/spec.md section 7.15): no result,
        no rerun and no queued retire, since the heal itself retires them where they run
        and then continues each one (:meth:`redispatch`) or reruns it
        (:meth:`rerun_from_prompt`). Returns them, for their Runs to be stopped. An
        episode that is not the live attempt of its rollout is refused (``ValueError``)
        before anything changes: the plan is stale."""
        chosen: list[Attempt] = []
        for episode in episodes:
            attempt = self._live.get(episode.rollout_id)
            if attempt is None or attempt.episode != episode:
                raise ValueError(f"{episode} is not a live attempt: the heal plan is stale")
            chosen.append(attempt)
        for attempt in chosen:
            self._end(attempt)
        return tuple(chosen)

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

    @property
    def settings(self) -> RolloutClientSettings:
        return self._settings

    @property
    def group_scored(self) -> frozenset[str]:
        """Environments whose prompt groups are scored together (retried whole)."""
        return self._group_scored

    def set_group_scored(self, environments: Iterable[str]) -> None:
        """Name the group-scored environments (Describe's ``group_scored``, docs/spec.md
        section 2.7): a sibling of theirs that fails live reruns its whole group."""
        self._group_scored = frozenset(environments)

    @property
    def instances(self) -> frozenset[str]:
        return self._instances

    @property
    def version(self) -> int:
        """Bumped on every change the cut would see; equal versions mean nothing changed."""
        return self._version

    def stats(self) -> RolloutStats:
        return dataclasses.replace(self._stats)

    def attempts(self) -> Mapping[str, int]:
        """The attempt ledger: rollout id -> the attempt the trainer owns."""
        return dict(self._attempts)

    def live(self) -> tuple[Attempt, ...]:
        """The unfinished attempts (waiting, sent or owned), by episode."""
        return tuple(sorted(self._live.values(), key=_by_episode))

    def in_flight(self) -> tuple[InFlightRollout, ...]:
        """Accepted, unfinished attempts (those a participant owns), by episode."""
        return tuple(
            attempt.describe() for attempt in self.live() if attempt.phase is AttemptPhase.OWNED
        )

    def waiting(self) -> tuple[EpisodeId, ...]:
        """Attempts not owned by any participant yet: queued, at the gate, or sent."""
        return tuple(
            attempt.episode
            for attempt in self.live()
            if attempt.phase in (AttemptPhase.PENDING, AttemptPhase.CALLING)
        )

    @property
    def awaiting_verdicts(self) -> bool:
        """Whether some Run was sent and its participant has not said accepted or refused."""
        return any(attempt.phase is AttemptPhase.CALLING for attempt in self._live.values())

    def owed(self) -> Mapping[str, Receipt]:
        """Receipts of recorded results not acknowledged yet, by receipt id."""
        return dict(self._owed)

    def acknowledged_receipts(self) -> Mapping[str, Receipt]:
        """Receipts acknowledged recently (the last :data:`ACKED_MEMORY`), oldest first."""
        return dict(self._acked)

    def known_receipt(self, receipt_id: str) -> Receipt | None:
        return self._owed.get(receipt_id) or self._acked.get(receipt_id)

    # ------------------------------------------------------------------ the gate

    @property
    def gate_open(self) -> bool:
        return self._gate_open

    def close_gate(self) -> None:
        """Send no new Run; Runs not yet accepted wait at the gate and are not in the cut.

        Re-attaches of attempts a participant already owns are not held back: the
        participant attaches them whatever its admission.
        """
        self._gate_open = False
        self._changed()

    def reopen_gate(self) -> None:
        self._gate_open = True
        self._gate_generation += 1
        self._changed()

    def close_instance(self, instance: str) -> None:
        """Send no new Run to ``instance`` whatever the global gate says. Idempotent."""
        self._known_instance(instance)
        self._closed_instances.add(instance)
        self._changed()

    def reopen_instance(self, instance: str) -> None:
        """Undo :meth:`close_instance`. Idempotent."""
        self._known_instance(instance)
        if instance in self._closed_instances:
            self._closed_instances.discard(instance)
            self._instance_generations[instance] += 1
            self._changed()

    def open_to(self, instance: str) -> bool:
        return self._gate_open and instance not in self._closed_instances

    def generation(self, instance: str) -> GateGeneration:
        return (self._gate_generation, self._instance_generations[instance])

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, rollout: Rollout) -> Attempt:
        """Queue ``rollout`` as attempt 0; it is sent when a slot is free and the gate open."""
        self._check_new(rollout.rollout_id, rollout.instance)
        budget = (
            rollout.budget_s if rollout.budget_s is not None else self._settings.default_budget_s
        )
        attempt = Attempt(
            rollout,
            EpisodeId(rollout.rollout_id, 0),
            rollout.instance,
            budget,
            request_id=self._request_ids(),
        )
        self._stats.dispatched += 1
        self._add_live(attempt)
        return attempt

    def has_startable(self) -> bool:
        """Whether :meth:`take_startable` has something to hand out (or stale entries to
        drop): restored attempts pass a closed gate, the others need it open."""
        if self._pending_restored:
            return True
        if not self._pending or not self._gate_open:
            return False
        if not self._closed_instances:
            return True
        return any(
            self.open_to(attempt.instance) or attempt.phase is AttemptPhase.ENDED
            for attempt in self._pending
        )

    def take_startable(self) -> Attempt | None:
        """The next attempt to follow, restored ones first; None when the entry taken had
        ended meanwhile (dropped) or nothing may start."""
        taken = self._next_startable()
        if taken is None or taken.phase is AttemptPhase.ENDED:
            return None
        if self._live.get(taken.episode.rollout_id) is not taken:
            return None
        return taken

    def _next_startable(self) -> Attempt | None:
        if self._pending_restored:
            return self._pending_restored.popleft()
        if not self._closed_instances:
            return self._pending.popleft() if self._pending else None
        # Runs for an instance closed on its own stay queued instead of taking slots
        # that Runs for the other instances could use.
        for index, attempt in enumerate(self._pending):
            if self.open_to(attempt.instance) or attempt.phase is AttemptPhase.ENDED:
                del self._pending[index]
                return attempt
        return None

    def may_send(self, attempt: Attempt) -> bool:
        """Whether a Run of ``attempt`` may go now: through an open gate, or for an
        attempt a participant owns. True for an ended attempt, so a waiter notices."""
        return (
            attempt.phase is AttemptPhase.ENDED
            or attempt.phase is AttemptPhase.OWNED
            or self.open_to(attempt.instance)
        )

    def begin_call(self, attempt: Attempt) -> GateGeneration:
        """A Run of ``attempt`` is being sent; returns the gate generation it went under."""
        if attempt.phase is AttemptPhase.ENDED or not self.may_send(attempt):
            raise RuntimeError(f"{attempt.episode} may not be sent now")
        if attempt.phase is AttemptPhase.PENDING:
            attempt.phase = AttemptPhase.CALLING
            self._changed()
        return self.generation(attempt.instance)

    # ------------------------------------------------------------------ what a Run says

    def accept(self, attempt: Attempt, now: float, incarnation: str = "") -> bool:
        """The participant accepted the Run (its header, or its first message): the
        attempt is owned from now on and its budget starts. ``incarnation`` is the
        participant incarnation that accepted ("" when it did not say), which every
        later re-attach names. Returns whether it became owned just now."""
        if attempt.phase is AttemptPhase.ENDED:
            return False
        if attempt.phase is AttemptPhase.PENDING:
            raise RuntimeError(f"{attempt.episode} was accepted but never sent")
        attempt.accepted_once = True
        if incarnation:
            attempt.incarnation = incarnation
        if attempt.phase is AttemptPhase.OWNED:
            return False
        attempt.phase = AttemptPhase.OWNED
        self._stats.accepted += 1
        self._start_budget(attempt, now)
        self._bump()
        return True

    def boundary(self, attempt: Attempt, boundary_index: int) -> None:
        """A boundary report: progress, so the broken-call count starts over."""
        self._require_owned(attempt, "a boundary")
        attempt.broken = 0
        if boundary_index > attempt.boundaries_seen:
            attempt.boundaries_seen = boundary_index
            self._bump()

    def result(self, attempt: Attempt, final: FinalResult) -> Receipt:
        """A final result: recorded in the queue; its receipt is owed until acknowledged
        (at once, this sibling alone: section 6.4 item 2)."""
        self._require_owned(attempt, "a result")
        receipt = Receipt(attempt.instance, attempt.episode, final.receipt_id)
        self._end(attempt)
        if final.outcome is not RolloutOutcome.COMPLETED:
            # Failed or out of its own budget: no verify ended its sessions, so the
            # resources servers free them at the retire (section 7.6 item 2).
            self._queue_retire(attempt.instance, attempt.episode)
        self._record(
            attempt,
            final.outcome,
            output=final.output,
            turns=final.turns,
            active_time_s=final.active_time_s,
            error_message=final.error_message,
            receipt_id=final.receipt_id,
        )
        self._owed[receipt.receipt_id] = receipt
        self._changed()
        return receipt

    def participant_cancelled(self, attempt: Attempt) -> Attempt | None:
        """A cancelled result we did not cause (we were still reading): the participant
        stopped the execution, so the attempt is lost (section 6.3 item 4)."""
        return self.abandon(attempt, "the participant cancelled the execution")

    def refused(self, attempt: Attempt, sent: GateGeneration) -> NextCall:
        """The Run was refused with ``ADMISSION_CLOSED`` (section 6.10 item 2): unwound,
        sent again without spending a retry or budget."""
        if attempt.phase is AttemptPhase.ENDED:
            return NextCall(False, "the attempt ended")
        self._stats.admission_refusals += 1
        held_before = attempt.accepted_once
        self._unown(attempt)
        if held_before:
            # Attach never consults admission: a refusal means the participant lost the
            # execution (it restarted), so the attempt is gone.
            why = "the participant no longer holds the attempt"
            self.abandon(attempt, why)
            return NextCall(False, why)
        instance = attempt.instance
        if not self.open_to(instance) or self.generation(instance) != sent:
            return NextCall(True, "the gate moved since the Run was sent: resend through it")
        return NextCall(
            True,
            "the participant closed on its own while our gate stayed open",
            pause_s=self._settings.admission_backoff_s,
            until_moved=sent,
        )

    def broken(self, attempt: Attempt, detail: str) -> NextCall:
        """The call broke (section 6.10 item 3): re-attach with the same episode and
        ``boundaries_seen`` after a backoff, or abandon past the re-attach bound."""
        if attempt.phase is AttemptPhase.ENDED:
            return NextCall(False, "the attempt ended")
        if attempt.phase is AttemptPhase.CALLING:
            attempt.phase = AttemptPhase.PENDING
            self._changed()
        attempt.broken += 1
        if attempt.broken > self._settings.reattach_attempts:
            why = f"{attempt.broken} broken call(s): {detail}"
            self.abandon(attempt, why)
            return NextCall(False, why)
        self._stats.reattaches += 1
        self._changed()
        return NextCall(True, detail, pause_s=backoff_s(self._settings, attempt.broken))

    def lost(self, attempt: Attempt, detail: str) -> NextCall:
        """Another incarnation refused the re-attach (section 6.5 item 5): the execution
        is gone with the process that accepted it, and no Run of the attempt is sent
        again. Otherwise it goes the way of an unreachable participant: it stays owned
        (in flight, so a heal of that participant continues or reruns it), counts as a
        broken call at each pause, and past the re-attach bound is abandoned."""
        if not attempt.lost and attempt.phase is not AttemptPhase.ENDED:
            attempt.lost = True
            self._stats.lost += 1
        return self.broken(attempt, detail)

    def clear_hurry(self, attempt: Attempt) -> None:
        """The driver's pause of ``attempt`` ended; a later pause is not hurried."""
        attempt.hurry = False

    # ------------------------------------------------------------------ endings

    def abandon(self, attempt: Attempt, why: str, *, retire: bool = True) -> Attempt | None:
        """Drop the attempt (queue its Retire: the agent and every resources server may
        hold its state) and rerun the rollout from its prompt as the next attempt while
        attempts remain (section 6.10 item 4). Returns the rerun, if any."""
        if attempt.phase is AttemptPhase.ENDED:
            return None
        self._end(attempt)
        self._stats.abandoned += 1
        if retire:
            self._queue_retire(attempt.instance, attempt.episode)
        _LOG.warning("abandoned %s on %s: %s", attempt.episode, attempt.instance, why)
        if attempt.spec.environment in self._group_scored:
            return self._retry_group(attempt, RolloutOutcome.ABANDONED, why, rerun=True)
        if attempt.spent >= self._settings.max_attempts:
            self._record(
                attempt,
                RolloutOutcome.ABANDONED,
                error_message=f"{attempt.spent} attempt(s) failed; last: {why}",
            )
            return None
        self._stats.reruns += 1
        rerun = Attempt(
            attempt.spec,
            attempt.episode.next_attempt(),
            attempt.spec.instance,
            attempt.budget_s,
            spent=attempt.spent + 1,
            request_id=self._request_ids(),
        )
        self._add_live(rerun)
        return rerun

    def fail(self, attempt: Attempt, why: str) -> None:
        """A protocol error a rerun would only repeat: record the rollout as abandoned."""
        if attempt.phase is AttemptPhase.ENDED:
            return
        self._end(attempt)
        self._stats.abandoned += 1
        if attempt.accepted_once:
            self._queue_retire(attempt.instance, attempt.episode)
        _LOG.error("rollout %s on %s failed: %s", attempt.episode, attempt.instance, why)
        if attempt.spec.environment in self._group_scored:
            # No rerun would fare better, and its siblings' verify would wait for it
            # forever: the whole group ends.
            self._retry_group(attempt, RolloutOutcome.ABANDONED, why, rerun=False)
            return
        self._record(attempt, RolloutOutcome.ABANDONED, error_message=why)

    def expire_due(self, now: float) -> list[Attempt]:
        """Give up every owned attempt whose active budget is spent at ``now``; returns
        them, so the driver cancels their Runs (section 6.7 item 2)."""
        given_up: list[Attempt] = []
        for episode in self._deadlines.expired(now):
            attempt = self._live.get(episode.rollout_id)
            if (
                attempt is None
                or attempt.episode != episode
                or attempt.phase is not AttemptPhase.OWNED
            ):
                self._deadlines.finish(episode)
                continue
            self._give_up(attempt, now)
            given_up.append(attempt)
        return given_up

    def _give_up(self, attempt: Attempt, now: float) -> None:
        spent = self._deadlines.consumed(attempt.episode, now)
        # Cancelling the call is what tells the participant (section 6.7 item 2): it
        # finishes the execution as cancelled and owes no acknowledgement.
        self._end(attempt)
        # A cancelled execution keeps its sealed boundary committable, and its resources
        # sessions outlive it: nobody will continue either, so a retire frees them
        # (section 7.6 item 2), boundary or not.
        self._queue_retire(attempt.instance, attempt.episode)
        self._stats.given_up += 1
        _LOG.warning(
            "gave up %s on %s after %.1f s of active time", attempt.episode, attempt.instance, spent
        )
        if attempt.spec.environment in self._group_scored:
            self._retry_group(
                attempt,
                RolloutOutcome.GIVEN_UP,
                f"active-time budget of {attempt.budget_s} s spent",
                rerun=True,
                active_time_s=spent,
            )
            return
        self._record(
            attempt,
            RolloutOutcome.GIVEN_UP,
            active_time_s=spent,
            error_message=f"active-time budget of {attempt.budget_s} s spent",
        )

    def _take_finished(self, group: str) -> list[tuple[Rollout, int, float | None]]:
        """Take ``group``'s finished siblings out of the queue, their attempts queued for
        Retire: each one's spec, last attempt and budget, to rerun from its prompt."""
        again: list[tuple[Rollout, int, float | None]] = []
        for result in [r for r in self._queue.values() if r.prompt_group_id == group]:
            del self._queue[result.rollout_id]
            self._queue_retire(result.instance, result.episode)
            budget = self._settings.default_budget_s
            spec = Rollout(
                rollout_id=result.rollout_id,
                prompt_group_id=result.prompt_group_id,
                sibling_index=result.sibling_index,
                group_size=result.group_size,
                environment=result.environment,
                task=result.task,
                instance=result.instance,
                budget_s=budget,
            )
            again.append((spec, result.episode.attempt, budget))
        return again

    def finished_groups(self) -> frozenset[str]:
        """Prompt groups with a finished sibling whose result waits for the rest."""
        return frozenset(result.prompt_group_id for result in self._queue.values())

    def rerun_finished(self, group: str) -> tuple[Attempt, ...]:
        """Rerun ``group``'s finished siblings from their prompts, behind the gate: a heal
        lost the verifier's group state, which holds their answers (docs/spec.md section
        7.15 item 2). Their results leave the queue; their attempts are queued for Retire."""
        reruns = []
        for spec, last, budget in self._take_finished(group):
            number = max(self._attempts.get(spec.rollout_id, -1), last) + 1
            attempt = Attempt(
                spec,
                EpisodeId(spec.rollout_id, number),
                spec.instance,
                budget,
                request_id=self._request_ids(),
            )
            self._add_live(attempt)
            reruns.append(attempt)
        self._stats.reruns += len(reruns)
        return tuple(reruns)

    def _retry_group(
        self, failed: Attempt, outcome: RolloutOutcome, why: str, *, rerun: bool, **details: Any
    ) -> Attempt | None:
        """A sibling of a group-scored environment ended live without a result (section
        6.10 item 8; ``failed`` has ended, its retire queued): its siblings' verify waits
        for all of them, so the group is retried whole. Every other live sibling ends and
        every finished one leaves the queue, all their attempts queued for Retire, and
        every sibling reruns from its prompt above every attempt it used. The group spends
        one attempt per retry; with none left (or ``rerun`` false), every sibling still
        live is recorded abandoned and ``failed`` as ``outcome``. Returns the rerun of
        ``failed``, if any. The driver stops the Runs of the siblings it ended.
        """
        group = failed.spec.prompt_group_id
        siblings = [
            attempt
            for attempt in self._live.values()
            if attempt.spec.prompt_group_id == group and attempt is not failed
        ]
        spent = max([failed.spent, *(attempt.spent for attempt in siblings)])
        for attempt in siblings:
            self._end(attempt)
            if attempt.accepted_once:
                self._queue_retire(attempt.instance, attempt.episode)
        if not rerun or spent >= self._settings.max_attempts:
            self._record(failed, outcome, error_message=why, **details)
            for attempt in siblings:
                self._stats.abandoned += 1
                self._record(
                    attempt,
                    RolloutOutcome.ABANDONED,
                    error_message=f"group-scored sibling {failed.episode} ended: {why}",
                )
            return None
        again: list[tuple[Rollout, int, float | None]] = [
            (failed.spec, failed.episode.attempt, failed.budget_s),
            *((a.spec, a.episode.attempt, a.budget_s) for a in siblings),
            *self._take_finished(group),
        ]
        self._stats.groups_retried_whole += 1
        self._stats.reruns += len(again)
        _LOG.warning(
            "retrying group-scored prompt group %s whole (%d sibling(s)): %s failed: %s",
            group,
            len(again),
            failed.episode,
            why,
        )
        reruns: dict[str, Attempt] = {}
        for spec, last, budget in sorted(again, key=lambda item: item[0].sibling_index):
            rollout_id = spec.rollout_id
            number = max(self._attempts.get(rollout_id, -1), last) + 1
            reruns[rollout_id] = Attempt(
                spec,
                EpisodeId(rollout_id, number),
                spec.instance,
                budget,
                spent=spent + 1,
                request_id=self._request_ids(),
            )
            self._add_live(reruns[rollout_id])
        return reruns[failed.episode.rollout_id]

    # ------------------------------------------------------------------ budgets

    def hold(self, name: str, now: float) -> Hold:
        """Suspend every budget until the hold is released (holders counted)."""
        hold = self._deadlines.hold(name, now)
        self._changed()
        return hold

    def release(self, hold: Hold, now: float) -> None:
        """Release one hold; budgets run again only when no other holder holds."""
        self._deadlines.release(hold, now)
        self._changed()

    @property
    def deadlines_held(self) -> bool:
        return self._deadlines.held

    def remaining_budget(self, episode: EpisodeId, now: float) -> float | None:
        """Active seconds left for an owned attempt; None when it has no running budget."""
        if episode not in self._deadlines:
            return None
        return self._deadlines.remaining(episode, now)

    def next_expiry(self, now: float) -> float | None:
        """Seconds until the next budget is spent if nothing changes; None: none can be."""
        return self._deadlines.next_expiry(now)

    # ------------------------------------------------------------------ acknowledgements

    def acknowledged(self, receipt: Receipt) -> None:
        """The participant took (or no longer retains) the receipt: it is settled."""
        self._owed.pop(receipt.receipt_id, None)
        self._acked[receipt.receipt_id] = receipt
        self._session_retires.add(receipt.episode)
        while len(self._acked) > ACKED_MEMORY:
            self._acked.popitem(last=False)
        self._stats.acknowledged += 1
        self._changed()

    def ack_failed(self, receipt: Receipt) -> None:
        """One Acknowledge try failed; the receipt stays owed."""
        self._stats.ack_failures += 1

    def resolve_unacknowledged(
        self,
        instance: str,
        episode: EpisodeId,
        receipt_id: str,
        *,
        waited_on: Attempt | None = None,
    ) -> Resolution:
        """Decide on a completion a prepare reported unacknowledged (section 6.7 item 3).

        Acknowledge it when its result is recorded. Otherwise, if the owned live attempt
        of that episode may still deliver it, WAIT (the attempt is hurried); the driver
        asks again with ``waited_on`` once it delivered, ended or the wait timed out.
        Else RETIRE: the episode is queued for Retire and a live attempt that did not
        deliver is abandoned (its rollout rerun).
        """
        receipt = self.known_receipt(receipt_id)
        if receipt is not None:
            return Resolution(Resolve.ACKNOWLEDGE, "its result is recorded", receipt=receipt)
        if waited_on is not None:
            attempt = waited_on if waited_on.phase is not AttemptPhase.ENDED else None
        else:
            attempt = self._live.get(episode.rollout_id)
            if attempt is not None and attempt.episode != episode:
                attempt = None
            if attempt is not None and attempt.phase is AttemptPhase.OWNED:
                attempt.hurry = True
                self._changed()
                return Resolution(Resolve.WAIT, "the live attempt may deliver it", attempt=attempt)
        if attempt is not None:
            self.abandon(attempt, "its completion was reported but never delivered")
        self._queue_retire(instance, episode)
        return Resolution(Resolve.RETIRE, "no recorded result wants it", attempt=attempt)

    # ------------------------------------------------------------------ results

    def results(self) -> tuple[RolloutResult, ...]:
        """The unconsumed results, in queue order (a copy; nothing is consumed)."""
        return tuple(self._queue.values())

    @property
    def has_results(self) -> bool:
        return bool(self._queue)

    def take_oldest(self) -> RolloutResult:
        """Consume the oldest result; raises ``LookupError`` when the queue is empty."""
        if not self._queue:
            raise LookupError("the results queue is empty")
        return self.consume([next(iter(self._queue))])[0]

    def ready_group_ids(self) -> list[str]:
        """Prompt groups with every sibling's result in the queue, oldest first."""
        siblings: dict[str, set[int]] = {}
        sizes: dict[str, int] = {}
        for result in self._queue.values():
            siblings.setdefault(result.prompt_group_id, set()).add(result.sibling_index)
            sizes[result.prompt_group_id] = result.group_size
        return [group for group, seen in siblings.items() if len(seen) >= sizes[group]]

    def take_ready_groups(self, max_groups: int | None = None) -> list[tuple[RolloutResult, ...]]:
        """Consume up to ``max_groups`` complete prompt groups, oldest first, siblings in
        order."""
        taken: list[tuple[RolloutResult, ...]] = []
        for group_id in self.ready_group_ids():
            if max_groups is not None and len(taken) >= max_groups:
                break
            rollout_ids = [
                result.rollout_id
                for result in sorted(self._queue.values(), key=lambda r: r.sibling_index)
                if result.prompt_group_id == group_id
            ]
            taken.append(tuple(self.consume(rollout_ids)))
        return taken

    def consume(self, rollout_ids: Sequence[str]) -> list[RolloutResult]:
        """The training loop takes these results: they leave the queue and, trained on,
        nothing of them can be rerun, so they leave the attempt ledger too."""
        taken = [self._queue.pop(rollout_id) for rollout_id in rollout_ids]
        for rollout_id in rollout_ids:
            self._attempts.pop(rollout_id, None)
        self._bump()
        return taken

    @property
    def data_loader(self) -> JSONValue:
        return self._loader

    def set_data_loader(self, position: JSONValue) -> None:
        """Record the data loader's position (any JSON value) for the next snapshot."""
        self._loader = TrainerRolloutState(data_loader=position).data_loader
        self._bump()

    # ------------------------------------------------------------------ retires

    def pending_retires(self) -> Mapping[str, Sequence[EpisodeId]]:
        """Abandoned attempts per instance, to retire while participants are idle."""
        return {
            instance: tuple(sorted(episodes))
            for instance, episodes in sorted(self._retires.items())
            if episodes
        }

    def retired(self, instance: str, episodes: Sequence[EpisodeId]) -> None:
        """These attempts were retired: drop them from :meth:`pending_retires`."""
        queued = self._retires.get(instance)
        if queued is None:
            return
        queued.difference_update(episodes)
        if not queued:
            del self._retires[instance]

    def pending_session_retires(self) -> tuple[EpisodeId, ...]:
        """Acknowledged attempts whose verified sessions the resources servers keep
        (docs/spec.md section 7.6 item 2): retired on those servers only."""
        return tuple(sorted(self._session_retires))

    def sessions_retired(self, episodes: Sequence[EpisodeId]) -> None:
        """Every resources server retired these sessions."""
        self._session_retires.difference_update(episodes)

    def _queue_retire(self, instance: str, episode: EpisodeId) -> None:
        self._retires.setdefault(instance, set()).add(episode)


def _by_episode(attempt: Attempt) -> EpisodeId:
    return attempt.episode
