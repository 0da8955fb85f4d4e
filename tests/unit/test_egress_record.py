"""The egress relay's record (turnpoint.egress, docs/spec.md section 12.6).

Rule cases first, then a hypothesis state machine that interleaves calls (accept, start,
progress, complete, fail), harness replacements (fence) and snapshots (prepare, commit,
resume) and checks after every step, from the transitions the record answered alone:
every accepted call entered once, has at most one final disposition and never changes
it, no call started while a snapshot was open, a refusal changed nothing, and each cut
holds every accepted call once. At the end the episode closes and every accepted call
has exactly one final disposition.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from turnpoint.egress import (
    FINAL,
    CallState,
    Cut,
    CutEntry,
    Disposition,
    EgressRecord,
    Refusal,
    RefusalReason,
    Transition,
)


def moved(outcome: object) -> tuple[Transition, ...]:
    assert not isinstance(outcome, Refusal), outcome
    assert isinstance(outcome, tuple)
    return outcome


def refused(outcome: object) -> RefusalReason:
    assert isinstance(outcome, Refusal), outcome
    return outcome.reason


def test_a_call_held_through_a_snapshot_is_never_started_at_its_cut_and_starts_after() -> None:
    record = EgressRecord()
    moved(record.prepare("snap-1"))
    moved(record.accept("c1", 0))
    assert refused(record.start("c1")) is RefusalReason.SNAPSHOT_OPEN
    cut = record.commit("snap-1")
    assert isinstance(cut, Cut)
    assert dict(cut.calls) == {"c1": CutEntry(Disposition.NEVER_STARTED)}
    moved(record.resume("snap-1"))
    assert moved(record.start("c1")) == (Transition("c1", CallState.HELD, CallState.RUNNING),)


def test_a_running_call_is_an_active_prefix_at_the_cut_and_completes_after() -> None:
    record = EgressRecord()
    moved(record.accept("c1", 0))
    moved(record.start("c1"))
    moved(record.progress("c1", 3))
    moved(record.prepare("snap-1"))
    moved(record.progress("c1", 2))
    cut = record.commit("snap-1")
    assert isinstance(cut, Cut)
    assert cut.calls["c1"] == CutEntry(Disposition.ACTIVE_PREFIX, 5)
    assert refused(record.commit("snap-1")) is RefusalReason.COMMITTED
    moved(record.complete("c1"))
    assert refused(record.complete("c1")) is RefusalReason.SETTLED
    assert record.state("c1") is CallState.COMPLETED


def test_a_replaced_harness_is_fenced_its_calls_excluded_and_its_late_answers_refused() -> None:
    record = EgressRecord()
    moved(record.accept("old-1", 0))
    moved(record.start("old-1"))
    moved(record.accept("old-2", 0))
    transitions = moved(record.accept("new-1", 1))  # the replacement's first call
    assert {(t.call_id, t.after) for t in transitions} == {
        ("old-1", CallState.EXCLUDED),
        ("old-2", CallState.EXCLUDED),
        ("new-1", CallState.HELD),
    }
    assert refused(record.complete("old-1")) is RefusalReason.SETTLED
    assert refused(record.accept("old-3", 0)) is RefusalReason.FENCED_GENERATION
    assert refused(record.accept("new-1", 1)) is RefusalReason.DUPLICATE_CALL
    assert record.state("old-3") is None


def test_closing_settles_every_call_and_refuses_new_ones() -> None:
    record = EgressRecord()
    moved(record.accept("held", 0))
    moved(record.accept("running", 0))
    moved(record.start("running"))
    moved(record.accept("done", 0))
    moved(record.start("done"))
    moved(record.complete("done"))
    assert set(moved(record.close())) == {
        Transition("held", CallState.HELD, CallState.NEVER_STARTED),
        Transition("running", CallState.RUNNING, CallState.TERMINAL_FAILURE),
    }
    assert refused(record.accept("late", 0)) is RefusalReason.CLOSED
    assert {s.disposition for s in record.states().values()} <= FINAL


CALL_IDS = st.sampled_from([f"c{i}" for i in range(6)])


class RecordMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.record = EgressRecord()
        self.entered: dict[str, int] = {}  # call id -> transitions that entered it
        self.final: dict[str, Disposition] = {}
        self.snapshots = 0
        self.open: str | None = None
        self.before: dict[str, CallState] = {}

    def apply(self, outcome: object) -> None:
        if isinstance(outcome, Refusal):
            assert dict(self.record.states()) == self.before, "a refusal changed the record"
            return
        assert isinstance(outcome, tuple)
        for transition in outcome:
            if transition.before is None:
                self.entered[transition.call_id] = self.entered.get(transition.call_id, 0) + 1
            if transition.after is CallState.RUNNING:
                assert self.open is None, "a call started while a snapshot was open"
            final = transition.after.disposition
            if final is not None:
                assert transition.call_id not in self.final, "a call settled twice"
                self.final[transition.call_id] = final

    def step(self, outcome: object) -> None:
        self.apply(outcome)
        self.before = dict(self.record.states())

    # ------------------------------------------------------------------ calls

    @rule(call_id=CALL_IDS, generation=st.integers(0, 3))
    def accept(self, call_id: str, generation: int) -> None:
        self.step(self.record.accept(call_id, generation))

    @rule(call_id=CALL_IDS)
    def start(self, call_id: str) -> None:
        self.step(self.record.start(call_id))

    @rule(call_id=CALL_IDS, units=st.integers(0, 5))
    def progress(self, call_id: str, units: int) -> None:
        self.step(self.record.progress(call_id, units))

    @rule(call_id=CALL_IDS)
    def complete(self, call_id: str) -> None:
        self.step(self.record.complete(call_id))

    @rule(call_id=CALL_IDS)
    def fail(self, call_id: str) -> None:
        self.step(self.record.fail(call_id))

    @rule(generation=st.integers(0, 3))
    def fence(self, generation: int) -> None:
        self.step(self.record.fence(generation))

    # ------------------------------------------------------------------ snapshots

    @precondition(lambda self: self.open is None)
    @rule()
    def prepare(self) -> None:
        self.snapshots += 1
        self.open = f"snap-{self.snapshots}"
        self.step(self.record.prepare(self.open))

    @precondition(lambda self: self.open is not None)
    @rule()
    def commit(self) -> None:
        assert self.open is not None
        cut = self.record.commit(self.open)
        if isinstance(cut, Refusal):
            assert cut.reason is RefusalReason.COMMITTED
            return
        assert set(cut.calls) == set(self.entered), "a cut must hold every accepted call once"
        for call_id, entry in cut.calls.items():
            final = self.final.get(call_id)
            if final is not None:
                assert entry.disposition is final
            else:
                assert entry.disposition in (Disposition.NEVER_STARTED, Disposition.ACTIVE_PREFIX)

    @precondition(lambda self: self.open is not None)
    @rule()
    def resume(self) -> None:
        assert self.open is not None
        outcome = self.record.resume(self.open)
        self.open = None
        self.step(outcome)

    @rule(snapshot=st.sampled_from(["snap-x", "snap-1"]))
    def stray_snapshot_call(self, snapshot: str) -> None:
        """A commit or resume of a snapshot that is not open changes nothing."""
        if snapshot != self.open:
            assert isinstance(self.record.commit(snapshot), Refusal)
            self.step(self.record.resume(snapshot))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def each_call_entered_once_and_its_state_agrees_with_its_transitions(self) -> None:
        assert set(self.entered.values()) <= {1}
        states = self.record.states()
        assert set(states) == set(self.entered)
        for call_id, state in states.items():
            assert state.disposition == self.final.get(call_id)

    def teardown(self) -> None:
        self.before = dict(self.record.states())
        self.apply(self.record.close())
        assert set(self.final) == set(self.entered)
        assert all(d in FINAL for d in self.final.values())


RecordMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_every_accepted_call_ends_with_exactly_one_disposition = RecordMachine.TestCase
