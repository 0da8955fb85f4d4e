"""The participant's pure control core: phases, leases, fencing, the work table.

Everything runs on a fake clock (plain floats), so hours of leases take microseconds.
The last part is a hypothesis state machine that drives random operation sequences and
checks the invariants after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk._core import (
    ActiveClock,
    AnswerLog,
    CommitStart,
    FinishedCheckpoints,
    ParticipantCore,
    RunningRestore,
    StartKind,
    WorkKey,
)
from turnpoint.protocol import (
    CompletionReceipt,
    EpisodeState,
    Fence,
    Phase,
)

FENCE = Fence("coord", 1)
EP_A = EpisodeId("rollout-a", 0)
EP_B = EpisodeId("rollout-b", 0)
EP_C = EpisodeId("rollout-c", 0)


def ckpt(n: int) -> str:
    return make_checkpoint_id("ckpt", n)


def run(ep: EpisodeId) -> WorkKey:
    return WorkKey(ep, "run")


def raises(reason: Reason, fn: Callable[[], object]) -> TurnpointError:
    with pytest.raises(TurnpointError) as info:
        fn()
    assert info.value.reason is reason, info.value
    return info.value


def phase(core: ParticipantCore) -> Phase:
    # A call, not an attribute: mypy would otherwise narrow core.phase across mutations.
    return core.phase


def is_open(core: ParticipantCore) -> bool:
    return core.admission_open


def is_ready(core: ParticipantCore) -> bool:
    return core.ready


def core_with(*states: tuple[EpisodeId, EpisodeState]) -> ParticipantCore:
    core = ParticipantCore(default_lease_s=30.0)
    for episode, state in states:
        core.admit(run(episode), state, now=0.0)
    return core


# ---------------------------------------------------------------------- phases and admission


def test_prepare_closes_admission_and_phase_follows_readiness() -> None:
    core = core_with((EP_A, EpisodeState.RUNNING))
    start = core.begin_prepare(ckpt(1), 10.0, now=0.0)
    assert start.opened and start.superseded is None
    assert phase(core) is Phase.PREPARING and not is_open(core)
    core.set_state(run(EP_A), EpisodeState.PARKED, now=1.0)
    assert phase(core) is Phase.PREPARED and not is_open(core)


def test_new_work_is_refused_while_a_checkpoint_holds_admission() -> None:
    core = core_with()
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    raises(Reason.ADMISSION_CLOSED, lambda: core.admit(run(EP_A), EpisodeState.RUNNING, 1.0))
    core.resume(ckpt(1), now=2.0)
    core.admit(run(EP_A), EpisodeState.RUNNING, 3.0)


def test_repeat_of_a_ready_prepare_replays_its_answer() -> None:
    core = core_with((EP_A, EpisodeState.PARKED))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    core.record_prepare_answer(ckpt(1), "the answer")
    again = core.begin_prepare(ckpt(1), 10.0, now=1.0)
    assert not again.opened and again.replay == "the answer"


def test_not_ready_prepare_is_not_recorded_so_a_repeat_waits_again() -> None:
    core = core_with((EP_A, EpisodeState.RUNNING))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    core.record_prepare_answer(ckpt(1), "not ready")
    assert core.begin_prepare(ckpt(1), 10.0, now=1.0).replay is None


def test_prepare_whose_admission_close_fails_reopens_admission() -> None:
    core = core_with()
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    core.abort_prepare(ckpt(1))
    assert phase(core) is Phase.IDLE and is_open(core)
    assert core.active_checkpoint_id is None and core.lease_expires_at is None
    # Not finished: the coordinator may retry the same id.
    assert core.begin_prepare(ckpt(1), 10.0, now=1.0).opened


def test_resume_makes_the_id_stale_and_is_idempotent_also_for_unknown_ids() -> None:
    core = core_with()
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    assert core.resume(ckpt(1), now=1.0).ended == ckpt(1)
    assert is_open(core) and core.lease_expires_at is None
    assert core.resume(ckpt(1), now=2.0).ended is None
    raises(Reason.STALE_CHECKPOINT, lambda: core.begin_prepare(ckpt(1), 10.0, 3.0))
    raises(Reason.STALE_CHECKPOINT, lambda: core.renew(ckpt(1), 10.0, 3.0))
    # An abort for an id never seen makes its late prepare stale.
    assert core.resume(ckpt(5), now=4.0).ended is None
    raises(Reason.STALE_CHECKPOINT, lambda: core.begin_prepare(ckpt(5), 10.0, 5.0))


def test_a_higher_id_supersedes_the_active_one_without_reopening_admission() -> None:
    core = core_with((EP_A, EpisodeState.PARKED))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    start = core.begin_prepare(ckpt(2), 10.0, now=1.0)
    assert start.superseded == ckpt(1) and not start.opened
    assert core.active_checkpoint_id == ckpt(2) and not is_open(core)
    raises(Reason.STALE_CHECKPOINT, lambda: core.begin_prepare(ckpt(1), 10.0, 2.0))
    # A resume naming a still higher id ends the active one as well.
    assert core.resume(ckpt(3), now=3.0).ended == ckpt(2)
    assert is_open(core)


def test_prepare_for_another_prefix_while_one_is_active_is_invalid_phase() -> None:
    core = core_with()
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    raises(Reason.INVALID_PHASE, lambda: core.begin_prepare("other-000000000009", 10.0, 1.0))
    # ...unless a newer coordinator (higher epoch) sends it.
    assert core.begin_prepare("other-000000000009", 10.0, 1.0, epoch=2).superseded == ckpt(1)


def test_finished_ids_are_bounded_but_lower_sequences_stay_stale() -> None:
    finished = FinishedCheckpoints(max_ids=2)
    for n in range(10):
        finished.add(ckpt(n))
    assert len(finished) == 2
    assert all(ckpt(n) in finished for n in range(10))
    assert ckpt(10) not in finished
    # Sequences are per prefix; ids without one rely on the LRU only.
    assert "other-000000000001" not in finished
    finished.add("no_sequence")
    assert "no_sequence" in finished
    finished.add("x1")
    finished.add("x2")
    assert "no_sequence" not in finished


def test_answer_log_is_bounded() -> None:
    log = AnswerLog(max_requests=2)
    for n in range(5):
        log.record(f"req-{n}", "resume", n)
    assert len(log) == 2
    assert log.get("req-0") is None
    recorded = log.get("req-4")
    assert recorded is not None and recorded.answer == 4


# ---------------------------------------------------------------------- leases


def test_lease_expiry_resumes_a_quiet_controller_and_renew_keeps_a_slow_one_in_charge() -> None:
    core = core_with((EP_A, EpisodeState.PARKED))
    core.begin_prepare(ckpt(1), 30.0, now=0.0)
    now = 0.0
    # Three hours of a slow but live controller renewing every 10 s.
    while now < 3 * 3600:
        now += 10.0
        assert core.lease_expired(now) is None
        core.renew(ckpt(1), 30.0, now)
    assert core.active_checkpoint_id == ckpt(1)
    # It goes quiet: nothing expires before the lease, then the id is resumed.
    assert core.lease_expired(now + 29.9) is None
    expired = core.lease_expired(now + 30.0)
    assert expired == ckpt(1)
    assert core.resume(expired, now + 30.0, expired=True).ended == ckpt(1)
    assert core.lease_expiries == 1 and is_open(core)
    raises(Reason.STALE_CHECKPOINT, lambda: core.renew(ckpt(1), 30.0, now + 31.0))


def test_phase_bound_calls_renew_the_lease_implicitly() -> None:
    core = core_with((EP_A, EpisodeState.PARKED))
    core.begin_prepare(ckpt(1), 30.0, now=0.0)
    core.begin_prepare(ckpt(1), None, now=20.0)  # a repeat renews
    assert core.lease_expires_at == 50.0
    core.begin_commit(ckpt(1), ("snap", frozenset()), [], now=40.0)
    assert core.lease_expires_at == 70.0
    # Renew never shortens a lease.
    core.renew(ckpt(1), 1.0, now=41.0)
    assert core.lease_expires_at == 70.0


def test_renew_of_an_unknown_checkpoint_is_invalid_phase_and_bad_leases_are_refused() -> None:
    core = core_with()
    raises(Reason.INVALID_PHASE, lambda: core.renew(ckpt(1), 10.0, 0.0))
    raises(Reason.INVALID_ARGUMENT, lambda: core.begin_prepare(ckpt(1), -1.0, 0.0))
    raises(Reason.INVALID_ARGUMENT, lambda: core.begin_prepare("../x", 10.0, 0.0))
    assert is_open(core)


# ---------------------------------------------------------------------- fencing


def test_lower_epoch_is_fenced_but_an_answered_request_id_gets_its_answer_again() -> None:
    core = core_with()
    assert core.check_fence(Fence("coord", 1), "r1") is None
    core.record_answer("r1", "resume", "answer-1")
    assert core.check_fence(Fence("coord", 2), "r2") is None
    assert core.epoch == 2
    recorded = core.check_fence(Fence("coord", 1), "r1")
    assert recorded is not None and recorded.answer == "answer-1"
    raises(Reason.FENCED, lambda: core.check_fence(Fence("coord", 1), "r-new"))
    # Same epoch, another coordinator: fenced too.
    raises(Reason.FENCED, lambda: core.check_fence(Fence("intruder", 2), "r3"))


def test_read_only_calls_adopt_a_higher_epoch_but_are_never_refused() -> None:
    core = core_with()
    core.check_fence(Fence("coord", 5), "r1")
    core.observe_fence(Fence("coord", 1))
    assert core.epoch == 5
    core.observe_fence(Fence("coord", 7))
    assert core.epoch == 7


# ---------------------------------------------------------------------- commit


def test_commit_requires_a_prepared_participant() -> None:
    core = core_with((EP_A, EpisodeState.RUNNING))
    raises(Reason.INVALID_PHASE, lambda: core.begin_commit(ckpt(1), "fp", [], 0.0))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    raises(Reason.INVALID_PHASE, lambda: core.begin_commit(ckpt(1), "fp", [], 1.0))


def test_commit_rechecks_readiness_that_regressed() -> None:
    core = core_with((EP_A, EpisodeState.PARKED))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    assert phase(core) is Phase.PREPARED
    core.set_state(run(EP_A), EpisodeState.RUNNING, now=1.0)
    assert phase(core) is Phase.PREPARING
    error = raises(Reason.INVALID_PHASE, lambda: core.begin_commit(ckpt(1), "fp", [EP_A], 2.0))
    assert error.metadata["blocker_count"] == "1"


def test_commit_refuses_a_scope_naming_a_restart() -> None:
    core = core_with((EP_A, EpisodeState.PARKED), (EP_B, EpisodeState.RESTART))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    assert core.readiness(10).restarts == (EP_B,)
    error = raises(
        Reason.RESTART_IN_SCOPE, lambda: core.begin_commit(ckpt(1), "fp", [EP_A, EP_B], 1.0)
    )
    assert error.metadata["episode"] == str(EP_B)


def test_commit_joins_replays_and_refuses_other_arguments() -> None:
    core = core_with((EP_A, EpisodeState.PARKED), (EP_B, EpisodeState.IDLE))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    start = core.begin_commit(ckpt(1), "fp", [EP_A], 1.0)
    assert start.kind is StartKind.NEW and start.export == (run(EP_A),)
    assert core.begin_commit(ckpt(1), "fp", [EP_A], 2.0).kind is StartKind.JOIN
    raises(Reason.CHECKPOINT_CONFLICT, lambda: core.begin_commit(ckpt(1), "other", [EP_A], 3.0))
    core.finish_commit(ckpt(1), "fp", "result")
    assert phase(core) is Phase.COMMITTED
    replay = core.begin_commit(ckpt(1), "fp", [EP_A], 4.0)
    assert replay.kind is StartKind.REPLAY and replay.answer == "result"


def test_commit_plan_leaves_out_restarts_and_discards_unscoped_restored_state() -> None:
    core = ParticipantCore()
    core.begin_restore("restore-000000000001", "fp", 10.0, now=0.0)
    core.install_restored(run(EP_A), 3, 2, now=0.0)
    core.install_restored(run(EP_B), 1, 1, now=0.0)
    core.finish_restore("restore-000000000001", "installed")
    core.resume("restore-000000000001", now=1.0)
    core.admit(run(EP_C), EpisodeState.RESTART, now=2.0)
    core.begin_prepare(ckpt(1), 10.0, now=3.0)
    start = core.begin_commit(ckpt(1), "fp", [EP_A], now=4.0)
    assert start.export == (run(EP_A),)
    assert start.discard == (run(EP_B),)


def test_episodes_in_a_state_are_those_of_its_slot_only() -> None:
    core = core_with(
        (EP_A, EpisodeState.AWAITING_MODEL),
        (EP_B, EpisodeState.RUNNING),
        (EP_C, EpisodeState.AWAITING_MODEL),
    )
    core.admit(WorkKey(EP_B, "session"), EpisodeState.AWAITING_MODEL, now=0.0)
    assert sorted(core.episodes_in(EpisodeState.AWAITING_MODEL, "run")) == [EP_A, EP_C]
    assert core.episodes_in(EpisodeState.AWAITING_MODEL, "session") == [EP_B]
    assert core.episodes_in(EpisodeState.RESTORED, "run") == []


# ---------------------------------------------------------------------- restore


def test_restore_only_into_an_idle_fresh_participant() -> None:
    core = core_with((EP_A, EpisodeState.IDLE))
    raises(Reason.INVALID_PHASE, lambda: core.begin_restore("restore-1", "fp", 10.0, 0.0))
    fresh = ParticipantCore()
    fresh.begin_prepare(ckpt(1), 10.0, now=0.0)
    raises(Reason.INVALID_PHASE, lambda: fresh.begin_restore("restore-1", "fp", 10.0, 0.0))


def test_a_running_restore_needs_no_freshness_and_retires_only_what_it_replaces() -> None:
    core = core_with((EP_A, EpisodeState.RUNNING), (EP_B, EpisodeState.RUNNING))
    running = RunningRestore(frozenset({EP_A}))
    assert core.begin_restore("restore-1", "fp", 10.0, 0.0, running=running).kind is StartKind.NEW
    assert phase(core) is Phase.RESTORED and not is_open(core)
    assert core.retire_for_restore("restore-1", running, now=1.0) == (run(EP_A),)
    assert core.state_of(run(EP_A)) is EpisodeState.RETIRING
    assert core.state_of(run(EP_B)) is EpisodeState.RUNNING  # live work keeps going
    assert core.refusal_mark("rollout-a") == 0 and core.refusal_mark("rollout-b") is None


def test_a_running_restore_with_retire_unscoped_frees_everything_without_marks() -> None:
    newer = EpisodeId("rollout-a", 4)
    core = core_with((newer, EpisodeState.RUNNING), (EP_B, EpisodeState.COMPLETED_UNACKED))
    running = RunningRestore(frozenset({EpisodeId("rollout-a", 2)}), retire_unscoped=True)
    core.begin_restore("restore-1", "fp", 10.0, 0.0, running=running)
    assert core.retire_for_restore("restore-1", running, now=1.0) == (run(newer), run(EP_B))
    # Only the scoped rollout is refused (up to its saved attempt); the fenced
    # incarnation's other rollouts may be run again under any attempt.
    assert core.refusal_mark("rollout-a") == 2 and core.refusal_mark("rollout-b") is None


def test_a_new_incarnations_restore_forgets_the_marks_of_unscoped_rollouts() -> None:
    """docs/spec.md section 4.16 item 4: rollout-b ran to its end after the snapshot and
    was retired (acknowledged) by the fenced incarnation; the new one, whose lineage never
    had it, dispatches it again from attempt 0, which a kept mark would refuse."""
    core = core_with()
    core.begin_retire([EpisodeId("rollout-b", 0)], now=0.0)
    core.finish_retire(run(EpisodeId("rollout-b", 0)), now=0.0)
    assert core.refusal_mark("rollout-b") == 0
    running = RunningRestore(frozenset({EpisodeId("rollout-a", 2)}), retire_unscoped=True)
    core.begin_restore("restore-1", "fp", 10.0, 0.0, running=running)
    core.retire_for_restore("restore-1", running, now=1.0)
    assert core.refusal_mark("rollout-b") is None and core.refusal_mark("rollout-a") == 2
    # A heal (retire_unscoped off) keeps every mark of the rollouts it does not name.
    heal = core_with()
    heal.begin_retire([EpisodeId("rollout-b", 0)], now=0.0)
    heal.finish_retire(run(EpisodeId("rollout-b", 0)), now=0.0)
    scoped = RunningRestore(frozenset({EpisodeId("rollout-a", 2)}), retire_unscoped=False)
    heal.begin_restore("restore-1", "fp", 10.0, 0.0, running=scoped)
    heal.retire_for_restore("restore-1", scoped, now=1.0)
    assert heal.refusal_mark("rollout-b") == 0


def test_a_new_incarnations_restore_continues_a_saved_attempt_retired_since_but_not_past_it() -> (
    None
):
    # The fenced incarnation finished rollout-a's saved attempt 2 and retired it (mark 2):
    # its N+1 was never seen, so the new incarnation continues the snapshot's state.
    core = core_with()
    core.begin_retire([EpisodeId("rollout-a", 2), EpisodeId("rollout-b", 4)], now=0.0)
    for key in (run(EpisodeId("rollout-a", 2)), run(EpisodeId("rollout-b", 4))):
        core.finish_retire(key, now=0.0)
    # rollout-b's saved attempt 3 would continue as 4, which was retired here; rollout-c
    # is past its saved attempt too. Both are listed in one refusal, with their marks.
    core.begin_retire([EpisodeId("rollout-c", 1)], now=0.0)
    core.finish_retire(run(EpisodeId("rollout-c", 1)), now=0.0)
    moved = RunningRestore(
        frozenset({EpisodeId("rollout-a", 2), EpisodeId("rollout-b", 3), EP_C}),
        retire_unscoped=True,
    )
    error = raises(
        Reason.STALE_ATTEMPT,
        lambda: core.begin_restore("restore-1", "fp", 10.0, 0.0, running=moved),
    )
    assert error.metadata["episode"] == "rollout-b#3"
    assert error.metadata["retired_through"] == "4"
    assert error.metadata["stale_episodes"] == "rollout-b#3:4,rollout-c#0:1"
    assert phase(core) is Phase.IDLE and is_open(core)
    # Without them the same saved attempt of rollout-a is accepted and installed as 3.
    fine = RunningRestore(frozenset({EpisodeId("rollout-a", 2)}), retire_unscoped=True)
    core.begin_restore("restore-2", "fp", 10.0, 0.0, running=fine)
    assert core.retire_for_restore("restore-2", fine, now=1.0) == ()
    core.install_restored(run(EpisodeId("rollout-a", 3)), 1, 1, now=1.0)
    assert core.refusal_mark("rollout-a") == 2
    # A heal (retire_unscoped off) never continues a retired attempt.
    core.finish_restore("restore-2", "answer")
    core.resume("restore-2", now=2.0)
    heal = RunningRestore(frozenset({EpisodeId("rollout-a", 2)}))
    raises(
        Reason.STALE_ATTEMPT,
        lambda: core.begin_restore("restore-3", "fp", 10.0, 3.0, running=heal),
    )


def test_a_running_restore_refuses_a_retired_or_superseded_scope_and_other_arguments() -> None:
    core = core_with((EpisodeId("rollout-a", 1), EpisodeState.RUNNING))
    stale = RunningRestore(frozenset({EP_A}))
    raises(
        Reason.STALE_ATTEMPT,
        lambda: core.begin_restore("restore-1", "fp", 10.0, 0.0, running=stale),
    )
    assert phase(core) is Phase.IDLE
    core.begin_retire([EpisodeId("rollout-b", 3)], now=0.0)
    retired = RunningRestore(frozenset({EpisodeId("rollout-b", 2)}), retire_unscoped=True)
    raises(
        Reason.STALE_ATTEMPT,
        lambda: core.begin_restore("restore-1", "fp", 10.0, 0.0, running=retired),
    )
    fine = RunningRestore(frozenset({EpisodeId("rollout-a", 1)}))
    core.begin_restore("restore-1", ("fp", fine), 10.0, 0.0, running=fine)
    again = core.begin_restore("restore-1", ("fp", fine), 10.0, 1.0, running=fine)
    assert again.kind is StartKind.JOIN
    other = RunningRestore(frozenset())
    raises(
        Reason.CHECKPOINT_CONFLICT,
        lambda: core.begin_restore("restore-1", ("fp", other), 10.0, 1.0, running=other),
    )
    # The same restore id asked by the fresh-only Restore is another operation.
    raises(Reason.CHECKPOINT_CONFLICT, lambda: core.begin_restore("restore-1", "fp", 10.0, 1.0))


def test_failed_restore_leaves_the_participant_idle_open_and_fresh() -> None:
    core = ParticipantCore()
    core.begin_restore("restore-1", "fp", 10.0, now=0.0)
    assert phase(core) is Phase.RESTORED and not is_open(core)
    core.install_restored(run(EP_A), 1, 1, now=0.0)
    assert core.fail_restore("restore-1", now=1.0) == (run(EP_A),)
    assert phase(core) is Phase.IDLE and is_open(core) and core.fresh
    assert core.entry(run(EP_A)) is None
    assert core.begin_restore("restore-1", "fp", 10.0, 2.0).kind is StartKind.NEW


def test_restore_stays_closed_until_resume_and_replays_its_answer() -> None:
    core = ParticipantCore()
    core.begin_restore("restore-1", "fp", 10.0, now=0.0)
    core.install_restored(run(EP_A.next_attempt()), 1, 1, now=0.0)
    # Resume waits for the install: the core refuses to end a restore mid-install.
    raises(Reason.INVALID_PHASE, lambda: core.resume("restore-1", 1.0))
    core.finish_restore("restore-1", "installed")
    assert core.begin_restore("restore-1", "fp", 10.0, 1.0).answer == "installed"
    raises(Reason.CHECKPOINT_CONFLICT, lambda: core.begin_restore("restore-1", "x", 10.0, 1.0))
    assert phase(core) is Phase.RESTORED and not core.fresh
    core.resume("restore-1", now=2.0)
    assert is_open(core)
    raises(Reason.STALE_CHECKPOINT, lambda: core.begin_restore("restore-1", "fp", 10.0, 3.0))


# ---------------------------------------------------------------------- restarts, retire, forget


def test_an_episode_becomes_a_restart_only_while_no_checkpoint_is_open() -> None:
    core = core_with((EP_A, EpisodeState.PARKED))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    assert core.mark_restart(run(EP_A), now=1.0) is False
    assert core.readiness(10).restarts == ()
    core.resume(ckpt(1), now=2.0)
    assert core.readiness(10).restarts == (EP_A,)


def test_a_restart_never_blocks_but_a_retiring_restart_does() -> None:
    core = core_with((EP_A, EpisodeState.RESTART))
    # Work on a restart never makes it a blocker.
    core.set_state(run(EP_A), EpisodeState.REQUEST_IN_FLIGHT, now=1.0)
    assert is_ready(core) and core.entry(run(EP_A)) is not None
    core.begin_retire([EP_A], now=2.0)
    assert not is_ready(core)
    report = core.readiness(10)
    assert report.blockers[0].state is EpisodeState.RETIRING
    core.finish_retire(run(EP_A), now=3.0)
    assert is_ready(core)


def test_retire_only_when_idle_or_restored() -> None:
    core = core_with((EP_A, EpisodeState.RUNNING))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    raises(Reason.INVALID_PHASE, lambda: core.begin_retire([EP_A], 1.0))
    core.resume(ckpt(1), now=2.0)
    assert core.begin_retire([EP_A], 3.0) == (run(EP_A),)


def test_retired_attempt_stays_refused_until_forget_and_marks_only_rise() -> None:
    ep3 = EpisodeId("rollout-a", 3)
    core = core_with((ep3, EpisodeState.RUNNING))
    keys = core.begin_retire([ep3], now=0.0)
    raises(Reason.RETIRE_INCOMPLETE, lambda: core.forget(["rollout-a"]))
    for key in keys:
        core.finish_retire(key, now=1.0)
    core.begin_retire([EpisodeId("rollout-a", 1)], now=2.0)
    assert core.refusal_mark("rollout-a") == 3
    for attempt in range(4):
        raises(Reason.STALE_ATTEMPT, partial(core.check_attempt, EpisodeId("rollout-a", attempt)))
    core.check_attempt(EpisodeId("rollout-a", 4))
    assert core.forget(["rollout-a", "never-marked"]) == 1
    core.check_attempt(ep3)


def test_forget_is_refused_while_a_checkpoint_is_open() -> None:
    core = core_with()
    core.begin_retire([EP_A], now=0.0)
    core.begin_prepare(ckpt(1), 10.0, now=1.0)
    raises(Reason.INVALID_PHASE, lambda: core.forget(["rollout-a"]))


def test_an_older_attempt_than_one_held_is_stale() -> None:
    core = core_with((EP_A.next_attempt(), EpisodeState.RUNNING))
    raises(Reason.STALE_ATTEMPT, lambda: core.check_attempt(EP_A))


def test_acknowledge_finds_the_entry_holding_the_receipt() -> None:
    core = core_with((EP_A, EpisodeState.RUNNING))
    receipt = CompletionReceipt(EP_A, "r-1")
    core.set_state(run(EP_A), EpisodeState.COMPLETED_UNACKED, now=1.0, receipt=receipt)
    assert core.readiness(5).blockers[0].receipt == receipt
    assert core.acknowledge(CompletionReceipt(EP_A, "other")) is None
    assert core.acknowledge(receipt) == run(EP_A)


# ---------------------------------------------------------------------- readiness report


def test_prepare_report_caps_listed_blockers_but_counts_all_and_never_caps_restarts() -> None:
    core = ParticipantCore()
    for n in range(50):
        core.admit(run(EpisodeId(f"r{n}", 0)), EpisodeState.RUNNING, now=0.0)
    for n in range(7):
        core.admit(run(EpisodeId(f"x{n}", 0)), EpisodeState.RESTART, now=0.0)
    report = core.readiness(3)
    assert not report.ready and report.blocker_count == 50
    assert [b.episode.rollout_id for b in report.blockers] == ["r0", "r1", "r2"]
    assert len(report.restarts) == 7
    assert report.counts == {EpisodeState.RUNNING: 50, EpisodeState.RESTART: 7}


def test_resume_does_not_unpark_an_episode_so_a_new_checkpoint_finds_it_parked() -> None:
    core = core_with((EP_A, EpisodeState.PARKED))
    core.begin_prepare(ckpt(1), 10.0, now=0.0)
    core.resume(ckpt(1), now=1.0)
    # The episode leaves its boundary only when it runs again; a prepare first finds it parked.
    view = core.entry(run(EP_A))
    assert view is not None and view.state is EpisodeState.PARKED
    core.begin_prepare(ckpt(2), 10.0, now=2.0)
    assert phase(core) is Phase.PREPARED


def test_parked_time_does_not_count_against_the_budget() -> None:
    clock = ActiveClock(now=100.0)
    clock.pause(now=104.0)
    assert clock.active(now=5000.0) == pytest.approx(4.0)
    clock.resume(now=5000.0)
    assert clock.active(now=5001.5) == pytest.approx(5.5)


# ---------------------------------------------------------------------- random sequences

EPISODES = [EpisodeId(f"r{n}", a) for n in range(3) for a in range(2)]
STATES = [
    EpisodeState.RUNNING,
    EpisodeState.PARKED,
    EpisodeState.AWAITING_MODEL,
    EpisodeState.IDLE,
    EpisodeState.REQUEST_IN_FLIGHT,
]


class CoreMachine(RuleBasedStateMachine):
    """Random operations on one core; the invariants hold after every step."""

    keys = Bundle("keys")

    @initialize()
    def setup(self) -> None:
        self.core = ParticipantCore(default_lease_s=30.0, max_finished_ids=3)
        self.now = 0.0
        self.seq = 0
        self.finished: set[str] = set()
        self.exported: list[tuple[WorkKey, ...]] = []

    def _try(self, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except TurnpointError:
            return None

    @rule(target=keys, episode=st.sampled_from(EPISODES), state=st.sampled_from(STATES))
    def admit(self, episode: EpisodeId, state: EpisodeState) -> WorkKey:
        key = run(episode)
        if self.core.entry(key) is None:
            self._try(lambda: self.core.admit(key, state, self.now))
        return key

    @rule(key=keys, state=st.sampled_from(STATES))
    def move(self, key: WorkKey, state: EpisodeState) -> None:
        if self.core.entry(key) is not None:
            self.core.set_state(key, state, self.now)

    @rule(key=keys)
    def complete(self, key: WorkKey) -> None:
        if self.core.entry(key) is not None:
            receipt = CompletionReceipt(key.episode, f"rc-{self.now}")
            self.core.set_state(key, EpisodeState.COMPLETED_UNACKED, self.now, receipt=receipt)

    @rule(key=keys)
    def acknowledge(self, key: WorkKey) -> None:
        view = self.core.entry(key)
        if view is not None and view.receipt is not None:
            found = self.core.acknowledge(view.receipt)
            if found is not None:
                self.core.remove(found, self.now)

    @rule(key=keys)
    def mark_restart(self, key: WorkKey) -> None:
        self.core.mark_restart(key, self.now)

    @rule(new=st.booleans())
    def prepare(self, new: bool) -> None:
        if new or self.core.active_checkpoint_id is None:
            self.seq += 1
        self._try(lambda: self.core.begin_prepare(ckpt(self.seq), 30.0, self.now))

    @rule(scope=st.sets(st.sampled_from(EPISODES)))
    def commit(self, scope: set[EpisodeId]) -> None:
        active = self.core.active_checkpoint_id
        if active is None:
            return
        views = list(self.core.entries())
        start = self._try(lambda: self.core.begin_commit(active, frozenset(scope), scope, self.now))
        if start is not None:
            assert isinstance(start, CommitStart)
            if start.kind is StartKind.NEW:
                # Exactly what section 4.8 items 5 and 6 name, in work order.
                refused = self.core.refusal_mark
                assert list(start.export) == sorted(
                    (
                        view.key
                        for view in views
                        if view.key.episode in scope
                        and not view.blocks
                        and view.state not in (EpisodeState.RESTART, EpisodeState.RETIRING)
                        and not (
                            (mark := refused(view.key.episode.rollout_id)) is not None
                            and view.key.episode.attempt <= mark
                        )
                    ),
                    key=lambda key: (key.episode, key.slot),
                )
                assert list(start.discard) == sorted(
                    (
                        view.key
                        for view in views
                        if view.state is EpisodeState.RESTORED and view.key.episode not in scope
                    ),
                    key=lambda key: (key.episode, key.slot),
                )
            restarts = set(self.core.readiness(0).restarts)
            for key in start.export:
                assert key.episode not in restarts
                assert key.episode in scope
                mark = self.core.refusal_mark(key.episode.rollout_id)
                assert mark is None or key.episode.attempt > mark
            self.core.finish_commit(active, frozenset(scope), "done")

    @rule(which=st.integers(0, 2))
    def resume(self, which: int) -> None:
        checkpoint_id = ckpt(max(0, self.seq - which))
        self.core.resume(checkpoint_id, self.now)
        self.finished.add(checkpoint_id)

    @rule(dt=st.floats(0.0, 60.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        expired = self.core.lease_expired(self.now)
        if expired is not None:
            self.core.resume(expired, self.now, expired=True)
            self.finished.add(expired)

    @rule()
    def renew(self) -> None:
        active = self.core.active_checkpoint_id
        if active is not None:
            self.core.renew(active, 30.0, self.now)

    @rule(episodes=st.sets(st.sampled_from(EPISODES), min_size=1), finish=st.booleans())
    def retire(self, episodes: set[EpisodeId], finish: bool) -> None:
        keys = self._try(lambda: self.core.begin_retire(episodes, self.now))
        if isinstance(keys, tuple) and finish:
            for key in keys:
                self.core.finish_retire(key, self.now)

    @rule(rollout=st.sampled_from(["r0", "r1", "r2"]))
    def forget(self, rollout: str) -> None:
        self._try(lambda: self.core.forget([rollout]))

    @rule(episode=st.sampled_from(EPISODES))
    def late_data_call(self, episode: EpisodeId) -> None:
        mark = self.core.refusal_mark(episode.rollout_id)
        if mark is not None and episode.attempt <= mark:
            with pytest.raises(TurnpointError) as info:
                self.core.check_attempt(episode)
            assert info.value.reason is Reason.STALE_ATTEMPT

    @invariant()
    def admission_open_iff_idle(self) -> None:
        assert self.core.admission_open == (self.core.phase is Phase.IDLE)
        assert (self.core.active_checkpoint_id is None) == (self.core.phase is Phase.IDLE)
        assert (self.core.lease_expires_at is None) == (self.core.active_checkpoint_id is None)

    @invariant()
    def counts_match_a_fresh_recount(self) -> None:
        blockers, counts = self.core.recount()
        report = self.core.readiness(2)
        assert report.blocker_count == blockers == self.core.blocker_count
        assert dict(report.counts) == {s: c for s, c in counts.items() if c}
        assert len(report.blockers) == min(2, blockers)
        assert report.ready == (blockers == 0)

    @invariant()
    def preparing_phases_follow_readiness(self) -> None:
        if self.core.phase is Phase.PREPARED:
            assert self.core.ready
        if self.core.phase is Phase.PREPARING:
            assert not self.core.ready

    @invariant()
    def finished_ids_are_stale(self) -> None:
        for checkpoint_id in self.finished:
            assert self.core.is_finished(checkpoint_id)
            if checkpoint_id != self.core.active_checkpoint_id:
                with pytest.raises(TurnpointError) as info:
                    self.core.renew(checkpoint_id, 30.0, self.now)
                assert info.value.reason is Reason.STALE_CHECKPOINT

    @invariant()
    def episodes_in_a_state_are_the_tables_own(self) -> None:
        for state in EpisodeState:
            found = sorted(self.core.episodes_in(state, "run"))
            assert found == sorted(
                view.key.episode
                for view in self.core.entries()
                if view.state is state and view.key.slot == "run"
            )

    @invariant()
    def restarts_never_block(self) -> None:
        for view in self.core.entries():
            if view.state is EpisodeState.RESTART:
                assert not view.blocks


CoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoreMachine = CoreMachine.TestCase
