"""The trainer's pure rollout ledger: ownership, the gate, results, receipts, budgets, cuts.

No grpc, no asyncio, no clock: time is a float the test moves, so budgets of minutes
expire in microseconds. The wire-level behaviour of the same rules is covered by
tests/integration/test_rollout_client.py; here each rule of docs/spec.md sections 6.10
and 7.6 is checked on the books alone, and the last part is a hypothesis state machine
that drives random sequences (dispatch, refusals at the gate, accepts, boundaries,
results, acknowledgements, give-ups, cuts and restores) with the invariants asserted
after every step.
"""

from __future__ import annotations

import ast
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.support.fakes import counted_ids
from tests.support.sources import source_of
from turnpoint.ids import EpisodeId
from turnpoint.trainer import Rollout, RolloutClientSettings, RolloutOutcome
from turnpoint.trainer.advanced import Hold, ManifestError
from turnpoint.trainer.rollouts.attempts import (
    Attempt,
    AttemptPhase,
    FinalResult,
    GateGeneration,
    Receipt,
    Resolve,
)
from turnpoint.trainer.rollouts.ledger import RolloutLedger
from turnpoint.trainer.rollouts.values import SavedRollout
from turnpoint.trainer.storage.manifest import TrainerRolloutState

AGENTS = ("agent-0", "agent-1")
SETTINGS = RolloutClientSettings(
    max_attempts=3,
    reattach_attempts=2,
    retry_backoff_s=0.2,
    max_retry_backoff_s=2.0,
    admission_backoff_s=0.5,
    budget_grace_s=5.0,
    default_budget_s=None,
)


def rollout(
    rollout_id: str,
    *,
    instance: str = "agent-0",
    group: str | None = None,
    sibling: int = 0,
    size: int = 1,
    budget_s: float | None = None,
) -> Rollout:
    return Rollout(
        rollout_id=rollout_id,
        prompt_group_id=group or f"g-{rollout_id}",
        sibling_index=sibling,
        group_size=size,
        environment="guess",
        task={"prompt": f"prompt of {rollout_id}"},
        instance=instance,
        budget_s=budget_s,
    )


def final(episode: EpisodeId, outcome: RolloutOutcome = RolloutOutcome.COMPLETED) -> FinalResult:
    return FinalResult(
        outcome=outcome,
        receipt_id=f"{episode.rollout_id}.{episode.attempt}.receipt",
        output={"answer": 7},
        turns=2,
        active_time_s=1.5,
    )


def ledger(**overrides: Any) -> RolloutLedger:
    fields = {
        "max_attempts": SETTINGS.max_attempts,
        "reattach_attempts": SETTINGS.reattach_attempts,
        "retry_backoff_s": SETTINGS.retry_backoff_s,
        "max_retry_backoff_s": SETTINGS.max_retry_backoff_s,
        "admission_backoff_s": SETTINGS.admission_backoff_s,
        "budget_grace_s": SETTINGS.budget_grace_s,
        "default_budget_s": SETTINGS.default_budget_s,
    }
    return RolloutLedger(
        AGENTS, RolloutClientSettings(**(fields | overrides)), request_ids=counted_ids()
    )


def started(books: RolloutLedger, item: Rollout, now: float = 0.0) -> Attempt:
    """Dispatch, start, send and accept ``item``: an attempt its participant owns."""
    books.dispatch(item)
    attempt = books.take_startable()
    assert attempt is not None and attempt.episode.rollout_id == item.rollout_id
    books.begin_call(attempt)
    assert books.accept(attempt, now)
    return attempt


def awaiting_verdicts(books: RolloutLedger) -> bool:
    # A call, not an attribute: mypy would otherwise narrow it across mutations.
    return books.awaiting_verdicts


def in_flight_ids(books: RolloutLedger) -> list[EpisodeId]:
    return [item.episode for item in books.in_flight()]


def saved_of(state: TrainerRolloutState) -> list[SavedRollout]:
    return [SavedRollout.from_json(raw) for raw in state.in_flight]


# --------------------------------------------------------------------------- purity


def test_the_ledger_modules_import_neither_grpc_nor_asyncio_nor_read_a_clock() -> None:
    for name in ("rollouts.ledger", "rollouts.attempts", "rollouts.values"):
        tree = ast.parse(source_of(f"turnpoint.trainer.{name}"))
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & {"grpc", "asyncio", "time"}, (name, imported)


# --------------------------------------------------------------------------- dispatch


def test_an_attempt_is_dispatched_only_once_its_participant_accepted() -> None:
    books = ledger()
    attempt = books.dispatch(rollout("r0"))
    assert books.waiting() == (EpisodeId("r0", 0),) and books.in_flight() == ()
    assert books.take_startable() is attempt
    books.begin_call(attempt)
    assert attempt.phase is AttemptPhase.CALLING and awaiting_verdicts(books)
    assert books.in_flight() == ()
    assert books.accept(attempt, now=0.0)
    assert in_flight_ids(books) == [EpisodeId("r0", 0)] and books.waiting() == ()
    assert not awaiting_verdicts(books)
    assert not books.accept(attempt, now=1.0), "a second accept changes nothing"
    assert books.stats().accepted == 1


def test_the_cut_holds_waiting_attempts_as_not_accepted() -> None:
    books = ledger()
    started(books, rollout("r0"))
    books.dispatch(rollout("r1"))
    saved = {item.rollout.episode.rollout_id: item for item in saved_of(books.rollout_state())}
    assert saved["r0"].accepted and not saved["r1"].accepted
    assert books.rollout_state().attempts == {"r0": 0, "r1": 0}


def test_a_known_rollout_or_an_unknown_instance_is_refused_at_dispatch() -> None:
    books = ledger()
    books.dispatch(rollout("r0"))
    with pytest.raises(ValueError, match="already known"):
        books.dispatch(rollout("r0"))
    with pytest.raises(ValueError, match="unknown agent instance"):
        books.dispatch(rollout("r1", instance="agent-9"))


def test_a_closed_gate_holds_new_runs_but_not_owned_attempts() -> None:
    books = ledger()
    owned = started(books, rollout("r0"))
    waiting = books.dispatch(rollout("r1"))
    books.close_gate()
    assert not books.has_startable()
    assert not books.may_send(waiting)
    with pytest.raises(RuntimeError):
        books.begin_call(waiting)
    assert books.may_send(owned), "a re-attach passes the closed gate"
    books.begin_call(owned)
    books.reopen_gate()
    assert books.take_startable() is waiting


def test_an_instance_closed_on_its_own_does_not_hold_up_the_others() -> None:
    books = ledger()
    first = books.dispatch(rollout("r0", instance="agent-0"))
    second = books.dispatch(rollout("r1", instance="agent-1"))
    books.close_instance("agent-0")
    assert books.take_startable() is second
    assert not books.has_startable()
    books.reopen_instance("agent-0")
    assert books.take_startable() is first
    with pytest.raises(ValueError):
        books.close_instance("agent-9")


def test_gate_changes_and_acknowledgements_do_not_change_the_cut_version() -> None:
    books = ledger()
    attempt = started(books, rollout("r0"))
    receipt = books.result(attempt, final(attempt.episode))
    version = books.version
    books.close_gate()
    books.reopen_gate()
    books.close_instance("agent-1")
    books.acknowledged(receipt)
    assert books.version == version
    books.set_data_loader({"epoch": 1})
    assert books.version > version


# --------------------------------------------------------------------------- refusal


def test_a_refusal_after_the_gate_moved_is_resent_through_the_gate_at_once() -> None:
    books = ledger()
    attempt = books.dispatch(rollout("r0"))
    books.take_startable()
    sent = books.begin_call(attempt)
    books.close_gate()
    step = books.refused(attempt, sent)
    assert step.again and step.pause_s is None
    assert attempt.phase is AttemptPhase.PENDING and books.stats().admission_refusals == 1
    assert not books.may_send(attempt)
    books.reopen_gate()
    assert books.may_send(attempt) and books.generation("agent-0") != sent


def test_a_participant_closed_on_its_own_gets_a_pause_cut_short_by_a_reopen() -> None:
    books = ledger()
    attempt = books.dispatch(rollout("r0"))
    books.take_startable()
    sent = books.begin_call(attempt)
    step = books.refused(attempt, sent)
    assert step.again and step.pause_s == SETTINGS.admission_backoff_s
    assert step.until_moved == sent


def test_a_refused_attempt_that_was_accepted_before_is_abandoned_and_rerun() -> None:
    books = ledger()
    attempt = started(books, rollout("r0", budget_s=30.0))
    books.broken(attempt, "connection lost")
    sent = books.begin_call(attempt)
    step = books.refused(attempt, sent)
    assert not step.again and attempt.phase is AttemptPhase.ENDED
    assert books.remaining_budget(attempt.episode, now=1.0) is None
    assert books.waiting() == (EpisodeId("r0", 1),) and books.attempts() == {"r0": 1}
    assert books.pending_retires() == {"agent-0": (EpisodeId("r0", 0),)}


def test_a_refused_restored_attempt_falls_back_to_the_gate() -> None:
    books = ledger()
    (item,) = books.install(_state_with_owned("r0"))
    attempt = books.redispatch(item.rollout, now=0.0)
    books.close_gate()
    assert books.take_startable() is attempt, "a restored attempt passes the closed gate"
    sent = books.begin_call(attempt)
    step = books.refused(attempt, sent)
    assert step.again and not attempt.restored and attempt.phase is AttemptPhase.PENDING
    assert books.in_flight() == () and not books.may_send(attempt)


# --------------------------------------------------------------------------- re-attach


def test_broken_calls_back_off_and_a_boundary_starts_the_count_over() -> None:
    books = ledger()
    attempt = started(books, rollout("r0"))
    assert books.broken(attempt, "x").pause_s == pytest.approx(0.2)
    books.begin_call(attempt)
    assert books.broken(attempt, "x").pause_s == pytest.approx(0.4)
    books.begin_call(attempt)
    books.boundary(attempt, 1)
    assert attempt.broken == 0 and attempt.boundaries_seen == 1
    assert books.broken(attempt, "x").pause_s == pytest.approx(0.2)
    assert books.stats().reattaches == 3


def test_past_the_reattach_bound_the_attempt_is_retired_and_the_rollout_rerun() -> None:
    books = ledger()
    attempt = started(books, rollout("r0"))
    for _ in range(SETTINGS.reattach_attempts):
        assert books.broken(attempt, "lost").again
        books.begin_call(attempt)
    step = books.broken(attempt, "lost")
    assert not step.again and "3 broken call(s)" in step.reason
    assert books.pending_retires() == {"agent-0": (EpisodeId("r0", 0),)}
    assert books.attempts() == {"r0": 1} and books.stats().reruns == 1


def test_the_accepting_incarnation_is_kept_and_a_refusal_by_another_loses_the_attempt() -> None:
    books = ledger()
    books.dispatch(rollout("r0"))
    attempt = books.take_startable()
    assert attempt is not None and attempt.incarnation == ""
    books.begin_call(attempt)
    assert books.accept(attempt, 0.0, "inc-1") and attempt.incarnation == "inc-1"
    assert not books.accept(attempt, 1.0), "a re-attach that says no incarnation keeps it"
    assert attempt.incarnation == "inc-1"

    # Another incarnation refused the re-attach: lost there, still in flight (a heal of
    # its participant takes it), each pause a broken call, counted lost once.
    step = books.lost(attempt, "STALE_ATTEMPT: accepted by inc-1")
    assert step.again and step.pause_s == pytest.approx(0.2)
    assert attempt.lost and books.stats().lost == 1
    assert in_flight_ids(books) == [EpisodeId("r0", 0)]
    assert books.lost(attempt, "again").again
    assert books.stats().lost == 1
    # Past the re-attach bound it goes the way of an unreachable participant's attempt.
    step = books.lost(attempt, "again")
    assert not step.again and "3 broken call(s)" in step.reason
    assert books.pending_retires() == {"agent-0": (EpisodeId("r0", 0),)}
    (rerun,) = books.live()
    assert rerun.episode == EpisodeId("r0", 1) and not rerun.lost and rerun.incarnation == ""
    assert not books.lost(attempt, "late").again, "an ended attempt stays ended"
    assert books.stats().lost == 1


def test_a_rollout_is_recorded_abandoned_once_its_attempts_are_spent() -> None:
    books = ledger()
    books.dispatch(rollout("r0"))
    for number in range(SETTINGS.max_attempts):
        attempt = books.take_startable()
        assert attempt is not None and attempt.episode == EpisodeId("r0", number)
        books.begin_call(attempt)
        books.abandon(attempt, "scripted")
    (result,) = books.results()
    assert result.outcome is RolloutOutcome.ABANDONED and result.receipt_id == ""
    assert "3 attempt(s) failed" in result.error_message
    assert books.live() == () and books.attempts() == {"r0": 2}


def test_a_stale_attempt_is_not_queued_for_retire_and_a_fatal_one_is_not_rerun() -> None:
    books = ledger()
    stale = started(books, rollout("r0"))
    books.abandon(stale, "STALE_ATTEMPT", retire=False)
    assert books.pending_retires() == {} and books.attempts() == {"r0": 1}
    books = ledger()
    fatal = started(books, rollout("r1"))
    books.fail(fatal, "UNAUTHENTICATED")
    assert books.pending_retires() == {"agent-0": (EpisodeId("r1", 0),)}
    assert [r.outcome for r in books.results()] == [RolloutOutcome.ABANDONED]


# --------------------------------------------------------------------------- results


def test_a_result_is_queued_and_its_receipt_owed_until_acknowledged() -> None:
    books = ledger()
    attempt = started(books, rollout("r0"))
    books.boundary(attempt, 1)
    receipt = books.result(attempt, final(attempt.episode))
    assert attempt.phase is AttemptPhase.ENDED and books.live() == ()
    assert books.owed() == {receipt.receipt_id: receipt}
    (result,) = books.results()
    assert result.receipt_id == receipt.receipt_id and result.boundaries == 1
    books.ack_failed(receipt)
    assert books.owed() == {receipt.receipt_id: receipt} and books.stats().ack_failures == 1
    assert books.pending_session_retires() == ()
    books.acknowledged(receipt)
    assert books.owed() == {} and books.known_receipt(receipt.receipt_id) == receipt
    # Its sealed session is retired on the resources servers only (spec 7.6 item 2).
    assert books.pending_session_retires() == (attempt.episode,)
    assert books.pending_retires() == {}
    books.sessions_retired([attempt.episode])
    assert books.pending_session_retires() == ()


def test_a_cancelled_result_we_did_not_cause_reruns_the_rollout() -> None:
    books = ledger()
    attempt = started(books, rollout("r0"))
    rerun = books.participant_cancelled(attempt)
    assert rerun is not None and rerun.episode == EpisodeId("r0", 1)
    assert books.owed() == {} and books.results() == ()


def test_ready_groups_are_taken_whole_with_siblings_in_order() -> None:
    books = ledger()
    for sibling in (1, 0):
        item = rollout(f"r{sibling}", group="g", sibling=sibling, size=2)
        attempt = started(books, item)
        books.result(attempt, final(attempt.episode))
    assert books.ready_group_ids() == ["g"]
    (group,) = books.take_ready_groups()
    assert [r.sibling_index for r in group] == [0, 1]
    assert books.attempts() == {}, "trained on: it leaves the attempt ledger"
    with pytest.raises(LookupError):
        books.take_oldest()


def test_a_heal_reruns_the_finished_siblings_of_a_group_whose_verifier_it_lost() -> None:
    """docs/spec.md section 7.15 item 2: the finished sibling's result leaves the queue,
    its attempt is queued for Retire, and it reruns from its prompt above it."""
    books = ledger()
    done = started(books, rollout("r0", group="g", sibling=0, size=2))
    receipt = books.result(done, final(done.episode))
    assert receipt is not None
    books.acknowledged(receipt)
    live = started(books, rollout("r1", group="g", sibling=1, size=2))
    assert books.finished_groups() == frozenset({"g"})

    (rerun,) = books.rerun_finished("g")

    assert rerun.episode == EpisodeId("r0", 1) and rerun.phase is AttemptPhase.PENDING
    assert books.finished_groups() == frozenset() and books.ready_group_ids() == []
    assert books.pending_retires() == {"agent-0": (done.episode,)}
    assert {a.episode for a in books.live()} == {rerun.episode, live.episode}
    assert books.rerun_finished("g") == ()


# --------------------------------------------------------------------------- budgets


def test_a_spent_budget_gives_up_and_owes_nothing() -> None:
    books = ledger()
    attempt = started(books, rollout("r0", budget_s=10.0), now=100.0)
    books.boundary(attempt, 1)
    assert books.remaining_budget(attempt.episode, now=100.0) == pytest.approx(15.0)
    assert books.next_expiry(100.0) == pytest.approx(15.0)
    assert books.expire_due(114.0) == []
    assert books.expire_due(115.0) == [attempt]
    (result,) = books.results()
    assert result.outcome is RolloutOutcome.GIVEN_UP and result.receipt_id == ""
    assert result.active_time_s == pytest.approx(15.0)
    assert books.owed() == {} and books.stats().given_up == 1
    # It had sealed a boundary, which stays committable: retire it.
    assert books.pending_retires() == {"agent-0": (EpisodeId("r0", 0),)}


def test_budgets_start_at_acceptance_and_stop_while_any_holder_holds() -> None:
    books = ledger(budget_grace_s=0.0)
    waiting = books.dispatch(rollout("r0", budget_s=10.0))
    assert books.remaining_budget(waiting.episode, now=0.0) is None
    books.take_startable()
    books.begin_call(waiting)
    books.accept(waiting, now=50.0)
    first = books.hold("snapshot", now=52.0)
    second = books.hold("weight sync", now=53.0)
    books.release(first, now=500.0)
    assert books.deadlines_held and books.expire_due(1000.0) == []
    books.release(second, now=1000.0)
    books.release(second, now=1000.0)  # twice: a no-op
    assert books.remaining_budget(waiting.episode, now=1000.0) == pytest.approx(8.0)
    assert books.expire_due(1008.0) == [waiting]


def test_a_refusal_stops_the_budget_of_an_unowned_attempt() -> None:
    books = ledger(budget_grace_s=0.0)
    (item,) = books.install(_state_with_owned("r0", budget_s=1.0))
    attempt = books.redispatch(item.rollout, now=0.0)
    books.take_startable()
    books.refused(attempt, books.begin_call(attempt))
    assert books.expire_due(100.0) == [] and books.live() == (attempt,)


# --------------------------------------------------------------------------- resolve


def test_resolve_acknowledges_a_recorded_result() -> None:
    books = ledger()
    attempt = started(books, rollout("r0"))
    receipt = books.result(attempt, final(attempt.episode))
    books.acknowledged(receipt)
    decision = books.resolve_unacknowledged("agent-0", attempt.episode, receipt.receipt_id)
    assert decision.action is Resolve.ACKNOWLEDGE and decision.receipt == receipt


def test_resolve_waits_for_an_owned_attempt_then_retires_what_never_came() -> None:
    books = ledger()
    attempt = started(books, rollout("r0"))
    decision = books.resolve_unacknowledged("agent-0", attempt.episode, "rc-1")
    assert decision.action is Resolve.WAIT and decision.attempt is attempt and attempt.hurry
    again = books.resolve_unacknowledged("agent-0", attempt.episode, "rc-1", waited_on=attempt)
    assert again.action is Resolve.RETIRE and again.attempt is attempt
    assert attempt.phase is AttemptPhase.ENDED and books.attempts() == {"r0": 1}
    assert books.pending_retires() == {"agent-0": (EpisodeId("r0", 0),)}


def test_resolve_after_the_wait_acknowledges_a_result_that_arrived() -> None:
    books = ledger()
    attempt = started(books, rollout("r0"))
    receipt_id = final(attempt.episode).receipt_id
    assert books.resolve_unacknowledged("agent-0", attempt.episode, receipt_id).action is (
        Resolve.WAIT
    )
    books.result(attempt, final(attempt.episode))
    decision = books.resolve_unacknowledged(
        "agent-0", attempt.episode, receipt_id, waited_on=attempt
    )
    assert decision.action is Resolve.ACKNOWLEDGE


def test_resolve_retires_an_attempt_nobody_owns_without_waiting() -> None:
    books = ledger()
    attempt = books.dispatch(rollout("r0"))
    decision = books.resolve_unacknowledged("agent-0", attempt.episode, "rc-1")
    assert decision.action is Resolve.RETIRE and decision.attempt is attempt
    gone = books.resolve_unacknowledged("agent-1", EpisodeId("r9", 0), "rc-2")
    assert gone.action is Resolve.RETIRE and gone.attempt is None
    assert books.pending_retires()["agent-1"] == (EpisodeId("r9", 0),)
    books.retired("agent-1", [EpisodeId("r9", 0)])
    assert "agent-1" not in books.pending_retires()


# --------------------------------------------------------------------------- restore


def _state_with_owned(rollout_id: str, budget_s: float | None = None) -> TrainerRolloutState:
    books = ledger()
    attempt = started(books, rollout(rollout_id, budget_s=budget_s))
    books.boundary(attempt, 2)
    return books.rollout_state()


def test_a_restore_continues_an_owned_attempt_as_n_plus_1_owned_at_once() -> None:
    books = ledger()
    (item,) = books.install(_state_with_owned("r0", budget_s=20.0))
    assert item.accepted and books.saved() == (item,)
    assert [s.rollout.episode for s in saved_of(books.rollout_state())] == [EpisodeId("r0", 0)]
    attempt = books.redispatch(item.rollout, now=5.0)
    assert attempt.episode == EpisodeId("r0", 1) and attempt.boundaries_seen == 2
    assert in_flight_ids(books) == [EpisodeId("r0", 1)] and books.saved() == ()
    assert books.remaining_budget(attempt.episode, now=5.0) == pytest.approx(25.0)
    assert books.attempts() == {"r0": 1}


def test_a_rerun_skips_used_attempts_and_refuses_stale_descriptors() -> None:
    books = ledger()
    (item,) = books.install(_state_with_owned("r0"))
    with pytest.raises(ValueError, match="not newer"):
        books.rerun_from_prompt(item.rollout, attempt=0)
    attempt = books.rerun_from_prompt(item.rollout, attempt=3)
    assert attempt.episode == EpisodeId("r0", 3) and attempt.phase is AttemptPhase.PENDING
    with pytest.raises(ValueError, match="already running"):
        books.redispatch(item.rollout, now=0.0)


def test_install_needs_a_fresh_ledger_and_a_consistent_state() -> None:
    books = ledger()
    books.dispatch(rollout("r0"))
    with pytest.raises(RuntimeError):
        books.install(TrainerRolloutState())
    done = ledger()
    attempt = started(done, rollout("r0"))
    done.result(attempt, final(attempt.episode))
    state = done.rollout_state()
    broken = TrainerRolloutState(queue=state.queue, attempts={"r0": 4})
    with pytest.raises(ManifestError, match="disagrees"):
        ledger().install(broken)


# --------------------------------------------------------------------------- the machine

ROLLOUTS = tuple(f"r{index}" for index in range(5))
PICK = st.integers(0, 7)  # an index into whatever candidates a rule has
# Rules that end or reset much of the state (a crash and restore, a resolve that
# abandons, a fatal or stale call) act on one draw in four, so that a sequence of 30
# steps also gets to accept, seal boundaries, deliver results and give up.
RARELY = st.sampled_from([False, False, False, True])


def pick(candidates: list[Attempt], index: int) -> Attempt:
    return sorted(candidates, key=lambda attempt: attempt.episode)[index % len(candidates)]


class LedgerMachine(RuleBasedStateMachine):
    """Random operations on one ledger, as the driver and the wire would make them.

    The model keeps only what the wire knows: which attempts a follower took from the
    queue, which have a Run open (sent, or accepted during this call), the receipts
    received, the attempts given up, what was dispatched and consumed. Each rule picks
    among the attempts it applies to, and is only chosen when there is one.
    """

    @initialize(count=st.integers(1, 3))
    def setup(self, count: int) -> None:
        self.books = ledger(default_budget_s=5.0)
        self.now = 0.0
        self.followed: set[Attempt] = set()
        # Open Run calls: the generation they were sent under, and whether accepted.
        self.calls: dict[Attempt, tuple[GateGeneration, bool]] = {}
        self.received: dict[str, Receipt] = {}
        self.given_up: set[EpisodeId] = set()
        self.holds: list[Hold] = []
        self.dispatched: set[str] = set()
        self.consumed: set[str] = set()
        self.highest: dict[str, int] = {}
        self.cut = (self.books, self.books.version, self.books.rollout_state().to_dict())
        for index, rollout_id in enumerate(ROLLOUTS[:count]):
            self._dispatch(rollout_id, AGENTS[index % 2])

    # -- candidates ------------------------------------------------------------------

    def _unsent(self) -> list[Attempt]:
        return [a for a in self.books.live() if a in self.followed and a not in self.calls]

    def _calls(self, accepted: bool | None = None) -> list[Attempt]:
        return [a for a, (_, ok) in self.calls.items() if accepted is None or ok == accepted]

    def _forget_if_ended(self, attempt: Attempt) -> None:
        if attempt.phase is AttemptPhase.ENDED:
            self.calls.pop(attempt, None)
            self.followed.discard(attempt)

    # -- the training loop -----------------------------------------------------------

    @precondition(lambda self: len(self.dispatched) < len(ROLLOUTS))
    @rule(index=PICK, instance=st.sampled_from(AGENTS))
    def dispatch(self, index: int, instance: str) -> None:
        fresh = [rollout_id for rollout_id in ROLLOUTS if rollout_id not in self.dispatched]
        self._dispatch(fresh[index % len(fresh)], instance)

    def _dispatch(self, rollout_id: str, instance: str) -> None:
        attempt = self.books.dispatch(rollout(rollout_id, instance=instance))
        assert attempt.episode == EpisodeId(rollout_id, 0)
        assert attempt.phase is AttemptPhase.PENDING
        self.dispatched.add(rollout_id)
        # A rollout id the ledger knows (live, queued, saved) is refused.
        with pytest.raises(ValueError, match="already known"):
            self.books.dispatch(rollout(rollout_id, instance=instance))

    @precondition(lambda self: self.books.has_results)
    @rule(whole_groups=st.booleans())
    def consume(self, whole_groups: bool) -> None:
        if whole_groups:
            taken = [r for group in self.books.take_ready_groups(1) for r in group]
        else:
            taken = [self.books.take_oldest()]
        for result in taken:
            self.consumed.add(result.rollout_id)
            self.highest.pop(result.rollout_id, None)

    # -- the driver ------------------------------------------------------------------

    @precondition(lambda self: self.books.has_startable())
    @rule(send_now=st.sampled_from([True, True, False]))
    def start(self, send_now: bool) -> None:
        """The dispatcher hands an attempt to a follower, whose first act is its Run
        (unless the gate closed before the follower ran: then it waits to ``send``)."""
        attempt = self.books.take_startable()
        if attempt is None:
            return
        assert attempt.phase in (AttemptPhase.PENDING, AttemptPhase.OWNED)
        assert attempt not in self.followed
        self.followed.add(attempt)
        if send_now:
            self._send(attempt)

    @precondition(lambda self: self._unsent())
    @rule(index=PICK)
    def send(self, index: int) -> None:
        self._send(pick(self._unsent(), index))

    def _send(self, attempt: Attempt) -> None:
        if not self.books.may_send(attempt):
            with pytest.raises(RuntimeError):
                self.books.begin_call(attempt)
            assert attempt.phase is AttemptPhase.PENDING, "held at the gate, unchanged"
            return
        was_open = self.books.open_to(attempt.instance)
        sent = self.books.begin_call(attempt)
        assert was_open or attempt.phase is AttemptPhase.OWNED, "a Run passed a closed gate"
        self.calls[attempt] = (sent, False)

    @precondition(lambda self: self._calls(accepted=False))
    @rule(index=PICK, accepted=st.sampled_from([True, True, False]))
    def verdict(self, index: int, accepted: bool) -> None:
        """The participant accepts the Run, or refuses it with ADMISSION_CLOSED."""
        attempt = pick(self._calls(accepted=False), index)
        if accepted:
            self.books.accept(attempt, self.now)
            assert attempt.phase is AttemptPhase.OWNED and attempt.accepted_once
            self.calls[attempt] = (self.calls[attempt][0], True)
            return
        held_before = attempt.accepted_once
        sent, _ = self.calls.pop(attempt)
        step = self.books.refused(attempt, sent)
        assert attempt.phase is not AttemptPhase.OWNED, "a refusal unwinds ownership"
        assert step.again != held_before
        if step.pause_s is not None:
            assert step.until_moved == sent and self.books.generation(attempt.instance) == sent
        self._forget_if_ended(attempt)

    @precondition(lambda self: self._calls(accepted=True))
    @rule(
        index=PICK,
        what=st.sampled_from(["result", "boundary", "result", "repeat", "cancelled"]),
        outcome=st.sampled_from(
            [RolloutOutcome.COMPLETED, RolloutOutcome.FAILED, RolloutOutcome.BUDGET_EXHAUSTED]
        ),
    )
    def report(self, index: int, what: str, outcome: RolloutOutcome) -> None:
        """What an accepted Run streams: a boundary (or one already seen, as a re-attach
        replays), the result, or a cancellation we did not cause."""
        attempt = pick(self._calls(accepted=True), index)
        before = attempt.boundaries_seen
        if what == "boundary":
            self.books.boundary(attempt, before + 1)
            assert attempt.boundaries_seen == before + 1 and attempt.broken == 0
        elif what == "repeat":
            self.books.boundary(attempt, before)
            assert attempt.boundaries_seen == before
        elif what == "result":
            self._deliver(attempt, outcome)
        else:
            rerun = self.books.participant_cancelled(attempt)
            assert rerun is None or rerun.episode == attempt.episode.next_attempt()
            self._forget_if_ended(attempt)

    def _deliver(self, attempt: Attempt, outcome: RolloutOutcome) -> None:
        receipt = self.books.result(attempt, final(attempt.episode, outcome))
        assert receipt.receipt_id not in self.received
        self.received[receipt.receipt_id] = receipt
        self._forget_if_ended(attempt)

    @precondition(lambda self: self.calls)
    @rule(index=PICK, how=st.sampled_from(["broken", "broken", "stale", "fatal"]), act=RARELY)
    def call_fails(self, index: int, how: str, act: bool) -> None:
        if not act and how != "broken":
            return
        attempt = pick(self._calls(), index)
        self.calls.pop(attempt)
        if how == "broken":
            step = self.books.broken(attempt, "scripted: connection lost")
            assert step.again == (attempt.phase is not AttemptPhase.ENDED)
            if step.again:
                assert step.pause_s is not None
                assert step.pause_s <= SETTINGS.max_retry_backoff_s
                self.books.clear_hurry(attempt)
        elif how == "stale":
            self.books.abandon(attempt, "STALE_ATTEMPT", retire=False)
        else:
            self.books.fail(attempt, "UNAUTHENTICATED")
            assert attempt.phase is AttemptPhase.ENDED
        self._forget_if_ended(attempt)

    # -- acknowledgements ------------------------------------------------------------

    @precondition(lambda self: self.books.owed())
    @rule(index=PICK, ok=st.sampled_from([True, True, False]))
    def acknowledge(self, index: int, ok: bool) -> None:
        owed = sorted(self.books.owed().values(), key=lambda receipt: receipt.receipt_id)
        receipt = owed[index % len(owed)]
        if ok:
            self.books.acknowledged(receipt)
            assert receipt.receipt_id not in self.books.owed()
        else:
            self.books.ack_failed(receipt)
            assert receipt.receipt_id in self.books.owed()

    @precondition(
        lambda self: self.received or any(a.phase is AttemptPhase.OWNED for a in self.books.live())
    )
    @rule(index=PICK, recorded=st.booleans(), delivers=st.booleans(), act=RARELY)
    def resolve(self, index: int, recorded: bool, delivers: bool, act: bool) -> None:
        """A prepare reports a completion nobody acknowledged: one whose result is
        recorded, or one of a live attempt (which may deliver while we wait, or not)."""
        if recorded and self.received:
            received = sorted(self.received.values(), key=lambda receipt: receipt.receipt_id)
            receipt = received[index % len(received)]
            decision = self.books.resolve_unacknowledged(
                receipt.instance, receipt.episode, receipt.receipt_id
            )
            assert decision.action is Resolve.ACKNOWLEDGE and decision.receipt == receipt
            return
        if not act or not self.books.live():
            return
        attempt = pick(list(self.books.live()), index)
        receipt_id = final(attempt.episode).receipt_id
        decision = self.books.resolve_unacknowledged(attempt.instance, attempt.episode, receipt_id)
        if decision.action is Resolve.WAIT:
            assert attempt.phase is AttemptPhase.OWNED and attempt.hurry
            if delivers and self.calls.get(attempt, (None, False))[1]:
                self._deliver(attempt, RolloutOutcome.COMPLETED)
            decision = self.books.resolve_unacknowledged(
                attempt.instance, attempt.episode, receipt_id, waited_on=attempt
            )
        if decision.action is Resolve.RETIRE:
            assert attempt.phase is AttemptPhase.ENDED and decision.attempt is attempt
            assert attempt.episode in self.books.pending_retires()[attempt.instance]
        else:
            assert decision.action is Resolve.ACKNOWLEDGE
            assert decision.receipt is not None and decision.receipt.episode == attempt.episode
        self._forget_if_ended(attempt)

    # -- budgets ---------------------------------------------------------------------

    @rule(
        seconds=st.floats(0.0, 20.0),
        hold=st.sampled_from([None, False, True]),
        gate=st.sampled_from([None, None, "close", "reopen"]),
    )
    def tick(self, seconds: float, hold: bool | None, gate: str | None) -> None:
        """Time passes, maybe after a holder took or released a hold, or the gate closed
        or reopened outside a snapshot (a weight sync); spent budgets are given up."""
        if hold is True:
            self.holds.append(self.books.hold("weight sync", self.now))
        elif hold is False and self.holds:
            self.books.release(self.holds.pop(0), self.now)
        assert self.books.deadlines_held == bool(self.holds)
        if gate == "close":
            self.books.close_gate()
        elif gate == "reopen":
            self.books.reopen_gate()
        self.now += seconds
        for attempt in self.books.expire_due(self.now):
            assert attempt.phase is AttemptPhase.ENDED
            self.given_up.add(attempt.episode)
            self._forget_if_ended(attempt)
        assert self.books.expire_due(self.now) == [], "a give-up is decided once"

    # -- retires ---------------------------------------------------------------------

    @precondition(lambda self: self.books.pending_retires())
    @rule(count=st.integers(0, 3))
    def retire(self, count: int) -> None:
        for instance, queued in self.books.pending_retires().items():
            done = list(queued[:count])
            self.books.retired(instance, done)
            left = set(self.books.pending_retires().get(instance, ()))
            assert left == set(queued) - set(done)

    # -- snapshot and restore --------------------------------------------------------

    @rule(
        release_fails=st.sampled_from([None, None, None, *AGENTS]),
        crash=RARELY,
        continue_now=st.booleans(),
    )
    def snapshot(self, release_fails: str | None, crash: bool, continue_now: bool) -> None:
        """A snapshot round as the driver runs it: release instances a previous round
        left closed, close the gate and hold budgets, drain the acknowledgements, cut,
        then reopen (an instance whose release failed stays closed on its own). On a
        rare draw the trainer then crashes and restores from that cut."""
        for instance in AGENTS:
            self.books.reopen_instance(instance)
        self.books.close_gate()
        for receipt in self.books.owed().values():
            self.books.acknowledged(receipt)
        hold = self.books.hold("snapshot", self.now)
        state = self.books.rollout_state()
        owned = {item.episode for item in self.books.in_flight()}
        descriptors = saved_of(state)
        # Descriptors a restore installed and nobody continued yet are in the cut but
        # owned by nobody live; every other accepted descriptor is an owned attempt.
        installed = {item.rollout.episode for item in self.books.saved()}
        assert {s.rollout.episode for s in descriptors if s.accepted} - installed == owned
        for item in descriptors:
            assert item.rollout.episode.attempt == state.attempts[item.rollout.episode.rollout_id]
        if release_fails is not None:
            self.books.close_instance(release_fails)
        self.books.reopen_gate()
        self.books.release(hold, self.now)
        if crash:
            self._restore(state, continue_now)

    def _restore(self, state: TrainerRolloutState, continue_now: bool) -> None:
        """Restart the trainer from ``state``: accepted attempts continue as N+1, the
        others rerun from their prompt (now, or in a later ``continue_saved``)."""
        fresh = ledger(default_budget_s=5.0)
        assert len(fresh.install(state)) == len(state.in_flight)
        assert fresh.attempts() == state.attempts and fresh.results() == self.books.results()
        self.books = fresh
        self.calls.clear()
        self.followed.clear()
        self.received.clear()
        self.holds.clear()
        if continue_now:
            self.continue_saved()

    @precondition(lambda self: self.books.saved())
    @rule()
    def continue_saved(self) -> None:
        for item in self.books.saved():
            if item.accepted:
                attempt = self.books.redispatch(item.rollout, now=self.now)
                assert attempt.phase is AttemptPhase.OWNED and attempt.restored
                assert attempt.episode == item.rollout.episode.next_attempt()
            else:
                attempt = self.books.rerun_from_prompt(item.rollout)
                assert attempt.phase is AttemptPhase.PENDING
                assert attempt.episode.attempt > item.rollout.episode.attempt

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def dispatched_only_once_accepted(self) -> None:
        owned = [a for a in self.books.live() if a.phase is AttemptPhase.OWNED]
        for attempt in owned:
            assert attempt.accepted_once or attempt.restored, attempt
        assert in_flight_ids(self.books) == [a.episode for a in owned]
        others = {a.episode for a in self.books.live()} - {a.episode for a in owned}
        assert set(self.books.waiting()) == others
        for attempt in self.books.live():
            assert attempt.phase is not AttemptPhase.ENDED
            if attempt.phase is AttemptPhase.CALLING:
                assert attempt in self.calls, "only a sent Run awaits a verdict"
        assert self.books.awaiting_verdicts == any(
            a.phase is AttemptPhase.CALLING for a in self.books.live()
        )

    @invariant()
    def every_received_result_is_acknowledged_or_owed_exactly_once(self) -> None:
        owed = self.books.owed()
        acked = self.books.acknowledged_receipts()
        assert not set(owed) & set(acked)
        assert set(self.received) == set(owed) | set(acked)
        for receipt_id, receipt in owed.items():
            assert self.received[receipt_id] == receipt

    @invariant()
    def a_given_up_attempt_owes_nothing(self) -> None:
        owed_episodes = {receipt.episode for receipt in self.books.owed().values()}
        assert not owed_episodes & self.given_up
        for result in self.books.results():
            if result.episode in self.given_up:
                assert result.outcome is RolloutOutcome.GIVEN_UP and result.receipt_id == ""

    @invariant()
    def the_cut_and_the_ledger_agree(self) -> None:
        state = self.books.rollout_state()
        attempts = self.books.attempts()
        assert dict(state.attempts) == attempts
        descriptors = {s.rollout.episode: s for s in saved_of(state)}
        live = {a.episode: a for a in self.books.live()}
        saved = {s.rollout.episode for s in self.books.saved()}
        assert set(descriptors) == set(live) | saved and not set(live) & saved
        for episode, descriptor in descriptors.items():
            assert attempts[episode.rollout_id] == episode.attempt
            attempt = live.get(episode)
            if attempt is not None:
                assert descriptor.accepted == (attempt.phase is AttemptPhase.OWNED)
                assert descriptor.rollout.boundaries_seen == attempt.boundaries_seen
        queued = {result.rollout_id for result in self.books.results()}
        for result in self.books.results():
            assert attempts[result.rollout_id] == result.episode.attempt
        assert not queued & {episode.rollout_id for episode in descriptors}

    @invariant()
    def every_rollout_is_in_exactly_one_place(self) -> None:
        """docs/spec.md section 7.6 item 3: queue, live, saved, or consumed."""
        queued = [r.rollout_id for r in self.books.results()]
        live = [a.episode.rollout_id for a in self.books.live()]
        saved = [s.rollout.episode.rollout_id for s in self.books.saved()]
        places = queued + live + saved + sorted(self.consumed)
        assert sorted(places) == sorted(self.dispatched)

    @invariant()
    def attempts_only_increase(self) -> None:
        for rollout_id, attempt in self.books.attempts().items():
            assert attempt >= self.highest.get(rollout_id, 0)
            self.highest[rollout_id] = attempt

    @invariant()
    def the_version_moves_whenever_the_cut_does(self) -> None:
        books, version, before = self.cut
        now = self.books.rollout_state().to_dict()
        if books is self.books and now != before:
            assert self.books.version != version, "the cut changed, its version did not"
        self.cut = (self.books, self.books.version, now)

    @invariant()
    def budgets_run_only_for_owned_attempts(self) -> None:
        for attempt in self.books.live():
            remaining = self.books.remaining_budget(attempt.episode, self.now)
            assert (remaining is not None) == (attempt.phase is AttemptPhase.OWNED)
        for episode in self.given_up:
            assert self.books.remaining_budget(episode, self.now) is None

    @invariant()
    def no_live_attempt_is_queued_for_retire(self) -> None:
        queued = {e for episodes in self.books.pending_retires().values() for e in episodes}
        assert not queued & {a.episode for a in self.books.live()}


LedgerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLedgerMachine = LedgerMachine.TestCase
