"""The coordinator's pure core: the prepare round, commit scoping and the attempt state.

Everything runs on plain floats for time, so deadlines and leases take microseconds.
The last part is a hypothesis state machine that drives whole snapshot attempts through
the core (participants answering ready, not ready, failing transiently or breaking an
invariant, sessions breaking, unacknowledged completions, restarts, leases falling due,
deadlines passing) and checks the invariants after every step.
"""

from __future__ import annotations

import ast

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.sources import source_of
from turnpoint.ids import EpisodeId
from turnpoint.trainer.advanced import InFlightRollout
from turnpoint.trainer.snapshots.attempt import (
    PHASES,
    TRANSITIONS,
    InvalidFact,
    InvalidTransition,
    PhaseTimes,
    SnapshotAttempt,
    SnapshotPoint,
    SnapshotState,
    Transition,
    points_of,
)
from turnpoint.trainer.snapshots.core import (
    MIN_ROUND_S,
    NOT_READY_BACKOFF_MAX_S,
    NOT_READY_BACKOFF_S,
    SESSION_RETRIES,
    Answer,
    CommitScope,
    Outcome,
    ParticipantPrepare,
    PrepareVerdict,
    RenewalSchedule,
    Step,
    UnackedLedger,
    attribute_commit,
    commit_scope_problem,
    decide_prepare,
    exported_problem,
    installed_problem,
    scope_commit,
    watch_after_s,
    watch_wait_s,
)
from turnpoint.trainer.storage.layout import PublishStep
from turnpoint.trainer.storage.manifest import PlacedEpisode

S = SnapshotState

AGENTS = ("agent-0", "agent-1")
OTHERS = ("model-0", "res-0")
INSTANCES = (*AGENTS, *OTHERS)
EPISODES = tuple(EpisodeId(f"r{i}", i % 2) for i in range(6))


def rollout(episode: EpisodeId, instance: str) -> InFlightRollout:
    return InFlightRollout(
        episode=episode,
        instance=instance,
        prompt_group_id="g",
        sibling_index=0,
        group_size=1,
        environment="math",
        boundaries_seen=0,
    )


IN_FLIGHT = tuple(rollout(e, AGENTS[i % 2]) for i, e in enumerate(EPISODES))


# ------------------------------------------------------------------------- purity


@pytest.mark.parametrize("module", ["snapshots.core", "snapshots.attempt"])
def test_the_core_imports_no_io_and_reads_no_clock(module: str) -> None:
    tree = ast.parse(source_of(f"turnpoint.trainer.{module}"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    banned = {"asyncio", "grpc", "time", "turnpoint.v1", "turnpoint.trainer.control.client"}
    assert not {name for name in imported if name.split(".")[0] in banned or name in banned}


# ---------------------------------------------------------- one participant's rounds


def core(deadline: float = 100.0, round_timeout_s: float = 10.0) -> ParticipantPrepare:
    return ParticipantPrepare("agent-0", deadline=deadline, round_timeout_s=round_timeout_s)


def test_a_round_gets_the_round_timeout_or_what_is_left() -> None:
    prepare = core(deadline=15.0)
    first = prepare.next_round(0.0)
    assert (first.step, first.timeout_s) == (Step.SEND, 10.0)
    assert prepare.answered(Answer.NOT_READY, 1.0).step is Step.WAIT
    second = prepare.next_round(12.0)
    assert (second.step, second.timeout_s) == (Step.SEND, 3.0)
    assert "agent-0" in second.reason


def test_no_round_starts_without_time_for_one() -> None:
    prepare = core(deadline=10.0)
    prepare.next_round(0.0)
    prepare.answered(Answer.NOT_READY, 1.0)
    decision = prepare.next_round(10.0 - MIN_ROUND_S / 2)
    assert decision.step is Step.NOT_READY and "last not-ready answer stands" in decision.reason
    assert prepare.settled is Step.NOT_READY
    with pytest.raises(RuntimeError):
        prepare.next_round(10.0)


def test_the_first_round_goes_out_while_any_time_is_left_and_none_after() -> None:
    assert core(deadline=10.0).next_round(9.99).step is Step.SEND
    assert core(deadline=10.0).next_round(10.0).step is Step.NOT_READY


def test_a_broken_session_is_resent_twice_then_reported() -> None:
    prepare = core()
    prepare.next_round(0.0)
    for _ in range(SESSION_RETRIES):
        assert prepare.answered(Answer.SESSION_BROKEN, 1.0).step is Step.SEND
    assert prepare.answered(Answer.SESSION_BROKEN, 1.0).step is Step.FAIL

    answered = core()
    answered.next_round(0.0)
    answered.answered(Answer.NOT_READY, 0.5)
    answered.next_round(1.0)
    for _ in range(SESSION_RETRIES):
        answered.answered(Answer.SESSION_BROKEN, 1.0)
    assert answered.answered(Answer.SESSION_BROKEN, 1.0).step is Step.NOT_READY


@pytest.mark.parametrize(
    ("answer", "before", "after"),
    [
        (Answer.TRANSIENT, Step.FAIL, Step.NOT_READY),
        (Answer.INVARIANT, Step.FAIL, Step.FAIL),
        (Answer.READY, Step.READY, Step.READY),
    ],
)
def test_what_a_failure_means_depends_on_an_earlier_not_ready_answer(
    answer: Answer, before: Step, after: Step
) -> None:
    first = core()
    first.next_round(0.0)
    assert first.answered(answer, 1.0).step is before

    second = core()
    second.next_round(0.0)
    second.answered(Answer.NOT_READY, 1.0)
    second.next_round(2.0)
    assert second.answered(answer, 3.0).step is after


def test_after_not_ready_it_waits_on_the_stream_or_backs_off() -> None:
    prepare = core(deadline=100.0)
    prepare.next_round(0.0)
    prepare.answered(Answer.NOT_READY, 0.001)
    streamed = prepare.wait(0.001, sent_at=0.0, stream_available=True)
    assert streamed.until_change and streamed.timeout_s == pytest.approx(100.0 - 0.001)

    backoffs = []
    for _ in range(8):
        prepare.next_round(1.0)
        prepare.answered(Answer.NOT_READY, 1.0)
        backoffs.append(prepare.wait(1.0, sent_at=1.0, stream_available=False).timeout_s)
    assert backoffs[0] == NOT_READY_BACKOFF_S * 2  # the first wait above doubled it too
    assert backoffs == sorted(backoffs) and backoffs[-1] == NOT_READY_BACKOFF_MAX_S

    slow = core()
    slow.next_round(0.0)
    slow.answered(Answer.NOT_READY, 5.0)
    assert slow.wait(5.0, sent_at=0.0, stream_available=False).timeout_s == 0


def test_a_hopeless_participant_is_not_waited_for() -> None:
    prepare = core()
    prepare.next_round(0.0)
    prepare.answered(Answer.NOT_READY, 1.0)
    prepare.mark_hopeless("r1 must be retired")
    decision = prepare.wait(1.0, sent_at=0.0, stream_available=True)
    assert decision.step is Step.NOT_READY and "r1 must be retired" in decision.reason


def test_the_readiness_stream_opens_after_a_short_while() -> None:
    assert watch_after_s(60.0) == 0.25
    assert watch_after_s(1.0) == pytest.approx(0.1)


def test_the_readiness_streams_of_a_large_fleet_wait_a_millisecond_per_participant() -> None:
    assert watch_after_s(60.0, participants=256) == pytest.approx(0.256)
    assert watch_after_s(60.0, participants=1024) == pytest.approx(1.024)
    # Never past a tenth of the prepare deadline.
    assert watch_after_s(5.0, participants=1024) == pytest.approx(0.5)

    def wait(now: float, last: float | None) -> float:
        return watch_wait_s(
            now, started_at=10.0, last_activity_at=last, prepare_timeout_s=60.0, participants=1024
        )

    # Answers 0.3 s apart keep a thousand participants' streams shut...
    assert wait(10.6, 10.3) == pytest.approx(0.724)
    # ...a second of quiet opens them, and 8 x 1.024 s after the start at the latest.
    assert wait(11.5, 10.4) == 0.0
    assert wait(18.192, 18.19) == 0.0


def test_the_readiness_streams_wait_until_the_fan_out_pauses() -> None:
    def wait(now: float, last: float | None) -> float:
        return watch_wait_s(now, started_at=10.0, last_activity_at=last, prepare_timeout_s=60.0)

    # Nothing sent or read yet: 0.25 s after the start, whatever the clock says when asked.
    assert wait(10.0, None) == pytest.approx(0.25)
    assert wait(10.25, None) == 0.0
    # Requests going out or answers coming in (the last 10 ms ago): 0.25 s of quiet first.
    assert wait(10.3, 10.29) == pytest.approx(0.24)
    # Quiet for 0.25 s: now.
    assert wait(10.6, 10.35) == 0.0
    # Activity early on does not move the opening past the first 0.25 s.
    assert wait(10.0, 9.9) == pytest.approx(0.25)
    # A fan-out that never pauses: 8 x 0.25 s after the start at the latest.
    assert wait(11.9, 11.899) == pytest.approx(0.1)
    assert wait(12.0, 11.999) == 0.0


# ----------------------------------------------------------- unacknowledged results


def test_each_receipt_is_decided_once_and_a_retire_makes_it_hopeless() -> None:
    ledger = UnackedLedger()
    first = ledger.record("agent-0", EPISODES[0], "rc-1", "retire")
    again = ledger.record("agent-0", EPISODES[0], "rc-1", "acknowledge")
    assert again is first and first.hopeless
    ack = ledger.record("agent-1", EPISODES[1], "rc-2", "acknowledge")
    assert not ack.hopeless and ledger.decided("agent-1", "rc-2") is ack
    assert ledger.retire == {"agent-0": (EPISODES[0],)}
    assert ledger.hopeless == {"agent-0"}
    with pytest.raises(ValueError, match="answered 'maybe'"):
        ledger.record("agent-1", EPISODES[2], "rc-3", "maybe")


def test_without_a_rollout_side_the_reason_says_nobody_can_acknowledge() -> None:
    verdict = UnackedLedger(can_acknowledge=False).record("a", EPISODES[0], "rc", "retire")
    assert "nobody can acknowledge it" in verdict.reason


# ------------------------------------------------------------------- the verdict


def test_commit_only_when_every_participant_is_ready() -> None:
    verdict = decide_prepare("ck-1", dict.fromkeys(INSTANCES, Outcome.READY))
    assert verdict.commit and verdict.resume == () and verdict.retryable
    assert "commit" in verdict.reason


def test_an_abort_resumes_everyone_and_retries_only_without_an_invariant_break() -> None:
    outcomes = dict.fromkeys(INSTANCES, Outcome.READY) | {"agent-1": Outcome.NOT_READY}
    verdict = decide_prepare("ck-1", outcomes, {"agent-1": [EPISODES[1]], "res-0": []})
    assert not verdict.commit and verdict.retryable
    assert verdict.resume == tuple(sorted(INSTANCES))
    assert verdict.ready == {"agent-0", "model-0", "res-0"}
    assert verdict.retire == {"agent-1": (EPISODES[1],)}
    assert "the 3 ready included" in verdict.reason and "retire 1 straggler" in verdict.reason

    broken = decide_prepare("ck-1", outcomes | {"res-0": Outcome.INVARIANT})
    assert not broken.retryable and "do not retry" in broken.reason
    with pytest.raises(ValueError):
        decide_prepare("ck-1", {})


def test_leases_are_renewed_at_once_when_asked_then_every_interval() -> None:
    schedule = RenewalSchedule(interval_s=10.0, control_timeout_s=60.0, now=0.0)
    assert schedule.window_s == 10.0
    assert not schedule.due(9.9) and schedule.wait_s(4.0) == 6.0
    schedule.renew_now()
    assert schedule.due(4.0) and schedule.wait_s(4.0) == 0
    schedule.renewed(4.5)
    assert not schedule.due(14.4) and schedule.due(14.5)
    assert RenewalSchedule(interval_s=10.0, control_timeout_s=3.0, now=0.0).window_s == 3.0


# ---------------------------------------------------------------- commit scoping


def test_each_agent_commits_its_own_candidates_and_the_others_all_of_them() -> None:
    restarts = {EPISODES[0]}
    scope = scope_commit(IN_FLIGHT, restarts, instances=INSTANCES, agents=AGENTS)
    assert scope.ok
    assert scope.scopes["agent-0"] == {EPISODES[2], EPISODES[4]}
    assert scope.scopes["agent-1"] == {EPISODES[1], EPISODES[3], EPISODES[5]}
    assert scope.scopes["res-0"] == scope.scopes["model-0"] == set(EPISODES[1:])
    assert [r.episode for r in scope.restarts] == [EPISODES[0]]


def test_a_rollout_on_an_instance_without_an_agent_breaks_an_invariant() -> None:
    scope = scope_commit([rollout(EPISODES[0], "ghost")], (), instances=INSTANCES, agents=AGENTS)
    assert not scope.ok and "ghost" in scope.reason and scope.scopes == {}


def test_a_scope_naming_a_restart_or_a_stranger_is_refused() -> None:
    restarts = {"agent-0": frozenset({EPISODES[0]})}
    assert commit_scope_problem({"agent-0": [EPISODES[2]]}, INSTANCES, restarts) is None
    clash = commit_scope_problem({"agent-0": [EPISODES[0]]}, INSTANCES, restarts)
    assert clash is not None and "leave restarts out" in clash
    stranger = commit_scope_problem({"ghost": []}, INSTANCES, restarts)
    assert stranger is not None and "unknown instance(s): ghost" in stranger


def test_a_reply_must_export_within_its_scope_and_restore_exactly_the_next_attempts() -> None:
    assert exported_problem([EPISODES[0]], {EPISODES[0]}) is None
    outside = exported_problem([EPISODES[1]], {EPISODES[0]})
    assert outside is not None and "outside the scope" in outside
    wanted = [e.next_attempt() for e in EPISODES[:2]]
    assert installed_problem(wanted, EPISODES[:2]) is None
    wrong = installed_problem(wanted[:1], EPISODES[:2])
    assert wrong is not None and "missing" in wrong


def test_continued_episodes_are_what_their_agent_exported_the_rest_restart() -> None:
    scope = scope_commit(IN_FLIGHT, {EPISODES[0]}, instances=INSTANCES, agents=AGENTS)
    # agent-1 exported one of its candidates; a resources server exporting more counts
    # for nothing: only the agent that runs an episode decides whether it continues.
    exported = {"agent-0": set(), "agent-1": {EPISODES[1]}, "res-0": set(EPISODES)}
    attribution = attribute_commit(scope, IN_FLIGHT, exported)
    assert attribution.continued == (PlacedEpisode(EPISODES[1], "agent-1"),)
    assert {p.episode for p in attribution.restarted} == set(EPISODES) - {EPISODES[1]}


# ------------------------------------------------------------ the attempt's state


def walk(attempt: SnapshotAttempt, *states: SnapshotState, start: float = 0.0) -> None:
    for offset, state in enumerate(states):
        attempt.set_state(state, start + offset)


PUBLISHED_PATH = (
    S.RELEASE,
    S.ANCHOR,
    S.CLOSE,
    S.DRAIN,
    S.RETIRE,
    S.PREPARE,
    S.COMMIT,
    S.PUBLISH,
    S.RESUME,
    S.REOPEN,
    S.PUBLISHED,
)


def test_every_transition_is_returned_and_kept_with_its_time() -> None:
    attempt = SnapshotAttempt("ck-1", 0.0)
    first = attempt.set_state(S.RELEASE, 10.0)
    assert first == Transition("ck-1", S.NEW, S.RELEASE, 10.0)
    walk(attempt, *PUBLISHED_PATH[1:], start=11.0)
    assert attempt.history[0] is first
    assert [t.new for t in attempt.history] == list(PUBLISHED_PATH)
    assert list(attempt.times.phases) == list(PUBLISHED_PATH[:-1])
    assert all(seconds == 1.0 for seconds in attempt.times.phases.values())
    assert attempt.times.total_s == sum(attempt.times.phases.values()) == 10.0
    assert attempt.times.admission_closed_s == 7.0  # from the end of close to reopen's
    assert attempt.times.held_s == 4.0  # from the start of prepare to reopen's


def test_facts_are_learned_only_in_their_state() -> None:
    attempt = SnapshotAttempt("ck-1", 0.0)
    walk(attempt, S.RELEASE, S.ANCHOR)
    attempt.anchor_written(7)
    with pytest.raises(InvalidFact, match="cut read recorded in state anchor"):
        attempt.cut_read(3)
    walk(attempt, S.CLOSE, S.DRAIN, S.RETIRE, start=2.0)
    assert not attempt.exposed
    walk(attempt, S.PREPARE, start=5.0)
    assert attempt.exposed  # prepare may reach a participant: the id is exposed
    attempt.cut_read(3)
    with pytest.raises(InvalidFact, match="published recorded in state prepare"):
        attempt.publication_durable()
    walk(attempt, S.COMMIT, start=6.0)
    attempt.commit_attributed(continued=2, restarts=1)
    walk(attempt, S.PUBLISH, start=7.0)
    attempt.publication_durable()
    assert (attempt.step, attempt.cut_version, attempt.published) == (7, 3, True)
    view = attempt.view()
    assert (view.exposed, view.published, view.continued, view.restarts) == (True, True, 2, 1)


def test_only_allowed_transitions_happen() -> None:
    attempt = SnapshotAttempt("ck-1", 0.0)
    walk(attempt, S.RELEASE, S.ANCHOR)
    with pytest.raises(InvalidTransition, match="anchor -> commit is not a transition"):
        attempt.set_state(S.COMMIT, 3.0)
    assert attempt.state is S.ANCHOR
    walk(attempt, S.ABORT, S.FAILED, start=3.0)
    with pytest.raises(InvalidTransition, match="nothing \\(final\\)"):
        attempt.set_state(S.RELEASE, 9.0)


def test_every_point_is_passed_by_one_transition_or_one_publish_step() -> None:
    by_transition = [
        p for old in SnapshotState for new in TRANSITIONS[old] for p in points_of(old, new)
    ]
    by_step = [SnapshotPoint.after(step) for step in PublishStep]
    assert set(by_transition) | set(by_step) == set(SnapshotPoint)
    assert not set(by_transition) & set(by_step)
    during = {p for p in SnapshotPoint if p.during is not None}
    assert during == {SnapshotPoint.PREPARE_SENT, SnapshotPoint.COMMIT_SENT}
    assert [p.value for p in SnapshotPoint][:2] == ["anchor-written", "dispatch-closed"]


def test_the_phases_are_the_states_an_attempt_spends_time_in() -> None:
    assert S.NEW not in PHASES and not any(state.final for state in PHASES)
    assert [p.value for p in PHASES] == [
        "release", "anchor", "close", "drain", "retire", "prepare",
        "commit", "publish", "resume", "abort", "reopen",
    ]  # fmt: skip


def test_phase_times_start_when_the_attempt_leaves_new() -> None:
    times = PhaseTimes(0.0)
    times.record(S.NEW, S.RELEASE, 5.0)
    times.record(S.RELEASE, S.SKIPPED, 6.5)
    assert dict(times.phases) == {S.RELEASE: 1.5} and times.total_s == 1.5


# ---------------------------------------------------------- the state machine


ROUND_TIMEOUT_S = 10.0
PREPARE_TIMEOUT_S = 30.0
RENEW_INTERVAL_S = 4.0


class SnapshotCoreMachine(RuleBasedStateMachine):
    """Whole attempts through the core: prepare rounds, the verdict, commit scoping.

    Mirrors what the asyncio drivers do with each decision; the participants' answers,
    unacknowledged completions, restarts and the passing of time are random.
    """

    @initialize()
    def setup(self) -> None:
        self.now = 0.0
        self.count = 0
        self.attempt: SnapshotAttempt | None = None
        self.cores: dict[str, ParticipantPrepare] = {}
        self.in_round: dict[str, tuple[float, float]] = {}  # sent_at, timeout_s
        self.failed_with: dict[str, Answer] = {}
        self.ledger = UnackedLedger()
        self.restarts: dict[str, set[EpisodeId]] = {}
        self.schedule: RenewalSchedule | None = None
        self.renewals: list[float] = []
        self.deadline = 0.0
        self.verdicts: list[
            tuple[dict[str, Outcome], PrepareVerdict, dict[str, tuple[EpisodeId, ...]]]
        ] = []
        self.scopes: list[tuple[CommitScope, frozenset[EpisodeId]]] = []
        self.retried: list[bool] = []

    # -- helpers ------------------------------------------------------------------------

    def _move(self, *states: SnapshotState) -> None:
        assert self.attempt is not None
        for state in states:
            self.attempt.set_state(state, self.now)

    def _preparing(self) -> bool:
        return self.attempt is not None and self.attempt.state is S.PREPARE

    def _send(self, name: str, decision_step: Step, timeout_s: float) -> None:
        if decision_step is Step.SEND:
            # No round after the deadline, none longer than what is left, and after a
            # not-ready answer none too short to be answered anything but not ready.
            prepare = self.cores[name]
            assert self.now < self.deadline
            assert 0 < timeout_s <= min(ROUND_TIMEOUT_S, self.deadline - self.now) + 1e-9
            if prepare.answered_not_ready:
                assert self.deadline - self.now >= prepare.min_round_s
            self.in_round[name] = (self.now, timeout_s)
        else:
            self.in_round.pop(name, None)

    # -- rules --------------------------------------------------------------------------

    @precondition(lambda self: self.attempt is None)
    @rule()
    def start_attempt(self) -> None:
        self.count += 1
        self.attempt = SnapshotAttempt(f"ck-{self.count}", self.now)
        self._move(S.RELEASE, S.ANCHOR, S.CLOSE, S.DRAIN, S.RETIRE, S.PREPARE)
        self.deadline = self.now + PREPARE_TIMEOUT_S
        self.cores = {
            name: ParticipantPrepare(name, deadline=self.deadline, round_timeout_s=ROUND_TIMEOUT_S)
            for name in INSTANCES
        }
        self.in_round = {}
        self.failed_with = {}
        self.ledger = UnackedLedger()
        self.restarts = {}
        self.schedule = RenewalSchedule(
            interval_s=RENEW_INTERVAL_S, control_timeout_s=ROUND_TIMEOUT_S, now=self.now
        )
        for name, prepare in self.cores.items():
            decision = prepare.next_round(self.now)
            self._send(name, decision.step, decision.timeout_s)

    @precondition(lambda self: self._preparing())
    @rule(
        which=st.sampled_from(INSTANCES),
        answer=st.sampled_from(Answer),
        took=st.floats(0.0, 12.0),
        stream=st.booleans(),
    )
    def answer(self, which: str, answer: Answer, took: float, stream: bool) -> None:
        if which not in self.in_round:
            return
        sent_at, timeout_s = self.in_round.pop(which)
        self.now = max(self.now, sent_at + min(took, timeout_s))
        prepare = self.cores[which]
        decision = prepare.answered(answer, self.now)
        if decision.step is Step.FAIL:
            self.failed_with[which] = answer
        if decision.step is not Step.WAIT:
            self._send(which, decision.step, decision.timeout_s)
            return
        wait = prepare.wait(self.now, sent_at=sent_at, stream_available=stream)
        if wait.step is Step.NOT_READY:
            return
        assert wait.timeout_s >= 0 and wait.timeout_s <= max(0.0, self.deadline - self.now) + 1e-9
        self.now += wait.timeout_s if not wait.until_change else min(wait.timeout_s, took)
        decision = prepare.next_round(self.now)
        self._send(which, decision.step, decision.timeout_s)

    @precondition(lambda self: self._preparing())
    @rule(took=st.floats(0.0, 1.0))
    def the_rest_answer_ready(self, took: float) -> None:
        """Healthy participants: whoever has a round under way answers ready."""
        for name in sorted(self.in_round):
            self.answer(name, Answer.READY, took, False)

    @precondition(lambda self: self._preparing())
    @rule(
        which=st.sampled_from(INSTANCES),
        episode=st.sampled_from(EPISODES),
        retire=st.booleans(),
    )
    def unacknowledged(self, which: str, episode: EpisodeId, retire: bool) -> None:
        prepare = self.cores[which]
        if prepare.settled is not None:
            return
        verdict = self.ledger.record(
            which, episode, f"rc-{episode}", "retire" if retire else "acknowledge"
        )
        if verdict.hopeless:
            prepare.mark_hopeless(verdict.reason)
            if which in self.in_round:
                # The driver abandons the round under way; the core says what follows.
                self.in_round.pop(which)
                decision = prepare.next_round(self.now)
                assert decision.step is Step.NOT_READY
                self._send(which, decision.step, decision.timeout_s)

    @precondition(lambda self: self._preparing())
    @rule(which=st.sampled_from(INSTANCES), episode=st.sampled_from(EPISODES))
    def restart_appears(self, which: str, episode: EpisodeId) -> None:
        self.restarts.setdefault(which, set()).add(episode)

    @precondition(lambda self: self.schedule is not None)
    @rule(dt=st.floats(0.0, 15.0), now=st.booleans())
    def time_passes(self, dt: float, now: bool) -> None:
        assert self.schedule is not None
        if now:
            self.schedule.renew_now()
        self.now += dt
        if self.schedule.due(self.now):
            assert self.schedule.wait_s(self.now) == 0
            self.renewals.append(self.now)
            self.schedule.renewed(self.now)
        # Never overdue after a step: the next renewal is at most an interval away.
        assert not self.schedule.due(self.now)
        assert 0 < self.schedule.wait_s(self.now) <= RENEW_INTERVAL_S + 1e-9

    @precondition(lambda self: self._preparing())
    @rule(exported=st.sets(st.sampled_from(EPISODES)))
    def prepare_ends(self, exported: set[EpisodeId]) -> None:
        """At the deadline, or once every participant's prepare is over."""
        assert self.attempt is not None
        pending = [name for name, prepare in self.cores.items() if prepare.settled is None]
        if pending:
            # The fan-out's deadline cancels whoever is still preparing: transient.
            self.now = max(self.now, self.deadline)
        outcomes: dict[str, Outcome] = {}
        for name, prepare in self.cores.items():
            if prepare.settled is Step.READY:
                outcomes[name] = Outcome.READY
            elif prepare.settled is Step.NOT_READY:
                outcomes[name] = Outcome.NOT_READY
            elif prepare.settled is Step.FAIL and self.failed_with[name] is Answer.INVARIANT:
                outcomes[name] = Outcome.INVARIANT
            else:
                outcomes[name] = Outcome.TRANSIENT
        verdict = decide_prepare(self.attempt.checkpoint_id, outcomes, self.ledger.retire)
        self.verdicts.append((outcomes, verdict, dict(self.ledger.retire)))
        self.schedule = None
        if not verdict.commit:
            self.retried.append(verdict.retryable)
            self._move(S.ABORT, S.REOPEN, S.ABORT, S.FAILED)
            self.attempt = None
            return
        reported = frozenset(e for episodes in self.restarts.values() for e in episodes)
        scope = scope_commit(IN_FLIGHT, reported, instances=INSTANCES, agents=AGENTS)
        self.scopes.append((scope, reported))
        self._move(S.COMMIT)
        replies = {name: set(exported) & scope.scopes[name] for name in INSTANCES}
        assert all(exported_problem(replies[n], scope.scopes[n]) is None for n in INSTANCES)
        attribution = attribute_commit(scope, IN_FLIGHT, replies)
        continued = {p.episode for p in attribution.continued}
        restarted = {p.episode for p in attribution.restarted}
        assert not continued & restarted and not continued & reported
        assert continued | restarted == {r.episode for r in IN_FLIGHT}
        self._move(S.PUBLISH, S.RESUME, S.REOPEN, S.PUBLISHED)
        self.attempt = None

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def the_attempt_moves_only_along_allowed_transitions(self) -> None:
        if self.attempt is None:
            return
        previous = S.NEW
        for old, new in ((t.old, t.new) for t in self.attempt.history):
            assert old is previous and new in TRANSITIONS[old]
            previous = new
        times = self.attempt.times
        assert sum(times.phases.values()) == pytest.approx(times.total_s)

    @invariant()
    def never_commit_unless_all_ready(self) -> None:
        for outcomes, verdict, _ in self.verdicts:
            assert verdict.commit == all(o is Outcome.READY for o in outcomes.values())

    @invariant()
    def an_abort_resumes_every_participant_the_ready_ones_included(self) -> None:
        for _, verdict, _ in self.verdicts:
            if not verdict.commit:
                assert verdict.resume == tuple(sorted(INSTANCES))
                assert verdict.ready <= set(verdict.resume)

    @invariant()
    def only_an_invariant_failure_makes_an_abort_final(self) -> None:
        for outcomes, verdict, _ in self.verdicts:
            broken = any(o is Outcome.INVARIANT for o in outcomes.values())
            assert verdict.retryable is not broken

    @invariant()
    def a_restart_is_never_in_a_commit_scope(self) -> None:
        for scope, reported in self.scopes:
            assert scope.ok
            for name, episodes in scope.scopes.items():
                assert not episodes & reported
                if name in AGENTS:
                    assert episodes <= {r.episode for r in IN_FLIGHT if r.instance == name}

    @invariant()
    def a_hopeless_participant_is_never_ready(self) -> None:
        for name in self.ledger.hopeless:
            if self.attempt is not None and self.cores:
                assert self.cores[name].settled is not Step.READY

    @invariant()
    def an_abort_retires_exactly_what_the_rollout_side_said_must_go(self) -> None:
        for outcomes, verdict, retire in self.verdicts:
            assert dict(verdict.retire) == retire
            for name in retire:
                # A participant holding a completion to retire was never waited on.
                assert outcomes[name] is not Outcome.READY


SnapshotCoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSnapshotCoreMachine = SnapshotCoreMachine.TestCase


def test_the_machine_publishes_when_everyone_is_ready() -> None:
    """The committing path of the machine, spelled out once (hypothesis finds the rest)."""
    machine = SnapshotCoreMachine()
    machine.setup()
    machine.start_attempt()
    machine.restart_appears("res-0", EPISODES[1])
    for name in INSTANCES:
        machine.answer(name, Answer.READY, 0.1, False)
    machine.prepare_ends({EPISODES[1], EPISODES[2]})
    assert machine.attempt is None and machine.verdicts[-1][1].commit
    scope, reported = machine.scopes[-1]
    assert reported == {EPISODES[1]} and EPISODES[1] not in scope.scopes["agent-1"]
    machine.teardown()
