"""Failure semantics on the pure books: every way a rollout ends without a verify is
retired (docs/spec.md section 7.6 item 2), a group-scored group is retried whole when one
sibling fails live (section 6.10 item 8), and the probe that finds how far a participant
has finished checkpoint ids (section 7.2 item 4).

No grpc, no asyncio, no clock: time is a float the test moves.
"""

from __future__ import annotations

import pytest

from tests.support.fakes import counted_ids
from turnpoint.ids import EpisodeId
from turnpoint.trainer.rollouts.attempts import Attempt, AttemptPhase, FinalResult
from turnpoint.trainer.rollouts.ledger import RolloutLedger
from turnpoint.trainer.rollouts.values import Rollout, RolloutClientSettings, RolloutOutcome
from turnpoint.trainer.snapshots.core import MAX_SEQUENCE, FinishedProbe

AGENT = "agent-0"


def books(*, group_scored: tuple[str, ...] = (), **settings: object) -> RolloutLedger:
    fields: dict[str, object] = {
        "max_attempts": 3,
        "reattach_attempts": 1,
        "budget_grace_s": 0.0,
    }
    return RolloutLedger(
        (AGENT,),
        RolloutClientSettings(**(fields | settings)),  # type: ignore[arg-type]
        request_ids=counted_ids(),
        group_scored=group_scored,
    )


def rollout(
    rollout_id: str,
    *,
    group: str | None = None,
    sibling: int = 0,
    size: int = 1,
    environment: str = "guess",
    budget_s: float | None = None,
) -> Rollout:
    return Rollout(
        rollout_id=rollout_id,
        prompt_group_id=group or f"g-{rollout_id}",
        sibling_index=sibling,
        group_size=size,
        environment=environment,
        task={"prompt": rollout_id},
        instance=AGENT,
        budget_s=budget_s,
    )


def owned(ledger: RolloutLedger, item: Rollout, now: float = 0.0) -> Attempt:
    """Dispatch, send and accept ``item``: an attempt its participant owns."""
    ledger.dispatch(item)
    attempt = ledger.take_startable()
    assert attempt is not None and attempt.episode.rollout_id == item.rollout_id
    ledger.begin_call(attempt)
    assert ledger.accept(attempt, now)
    return attempt


def final(episode: EpisodeId, outcome: RolloutOutcome) -> FinalResult:
    return FinalResult(
        outcome=outcome,
        receipt_id=f"{episode.rollout_id}.{episode.attempt}.receipt",
        output={},
        turns=1,
        active_time_s=1.0,
    )


def queued_retires(ledger: RolloutLedger) -> set[EpisodeId]:
    return {episode for episodes in ledger.pending_retires().values() for episode in episodes}


# ------------------------------------------------- every end without a verify is retired


def test_a_given_up_rollout_is_retired_even_before_its_first_boundary() -> None:
    # Its agent may have seeded a resources session before sealing anything.
    ledger = books()
    attempt = owned(ledger, rollout("r0", budget_s=1.0))
    assert attempt.boundaries_seen == 0

    assert ledger.expire_due(2.0) == [attempt]

    assert queued_retires(ledger) == {attempt.episode}
    assert ledger.results()[0].outcome is RolloutOutcome.GIVEN_UP


def test_an_execution_the_participant_cancelled_is_retired() -> None:
    ledger = books()
    attempt = owned(ledger, rollout("r0"))

    rerun = ledger.participant_cancelled(attempt)

    assert queued_retires(ledger) == {attempt.episode}
    assert rerun is not None and rerun.episode == EpisodeId("r0", 1)


def test_an_attempt_abandoned_after_broken_calls_is_retired() -> None:
    ledger = books(reattach_attempts=0)
    attempt = owned(ledger, rollout("r0"))

    step = ledger.broken(attempt, "stream broke")

    assert not step.again
    assert queued_retires(ledger) == {attempt.episode}


def test_a_rollout_that_failed_for_good_is_retired() -> None:
    ledger = books()
    attempt = owned(ledger, rollout("r0"))

    ledger.fail(attempt, "INVALID_ARGUMENT: the task is bad")

    assert queued_retires(ledger) == {attempt.episode}
    assert ledger.results()[0].outcome is RolloutOutcome.ABANDONED


def test_a_completion_the_trainer_no_longer_wants_is_retired() -> None:
    ledger = books()
    attempt = owned(ledger, rollout("r0", budget_s=1.0))
    ledger.expire_due(2.0)
    ledger.retired(AGENT, [attempt.episode])

    decision = ledger.resolve_unacknowledged(AGENT, attempt.episode, "late-receipt")

    assert decision.action.value == "retire"
    assert queued_retires(ledger) == {attempt.episode}


@pytest.mark.parametrize("outcome", [RolloutOutcome.FAILED, RolloutOutcome.BUDGET_EXHAUSTED])
def test_a_result_that_did_not_complete_is_retired_after_its_acknowledgement(
    outcome: RolloutOutcome,
) -> None:
    # The agent raised, or ran out of its own budget: no verify ended its sessions.
    ledger = books()
    attempt = owned(ledger, rollout("r0"))

    receipt = ledger.result(attempt, final(attempt.episode, outcome))

    assert receipt.receipt_id in ledger.owed()
    assert queued_retires(ledger) == {attempt.episode}


def test_a_completed_result_is_not_retired() -> None:
    # Its verify ended its sessions (docs/spec.md section 5.3 item 3).
    ledger = books()
    attempt = owned(ledger, rollout("r0"))

    ledger.result(attempt, final(attempt.episode, RolloutOutcome.COMPLETED))

    assert queued_retires(ledger) == set()


# -------------------------------------------------- group-scored groups are retried whole


def group(ledger: RolloutLedger, environment: str = "guess-group") -> list[Attempt]:
    return [
        owned(ledger, rollout(f"s{i}", group="gp", sibling=i, size=3, environment=environment))
        for i in range(3)
    ]


def test_a_sibling_abandoned_live_reruns_its_whole_group_scored_group() -> None:
    ledger = books(group_scored=("guess-group",))
    first, second, third = group(ledger)
    # One sibling already finished: its result leaves the queue and it reruns too.
    ledger.result(third, final(third.episode, RolloutOutcome.COMPLETED))

    rerun = ledger.participant_cancelled(first)

    live = {attempt.episode for attempt in ledger.live()}
    assert live == {EpisodeId("s0", 1), EpisodeId("s1", 1), EpisodeId("s2", 1)}
    assert rerun is not None and rerun.episode == EpisodeId("s0", 1)
    assert second.phase is AttemptPhase.ENDED
    assert ledger.results() == ()
    # Every old attempt is retired, the finished one included.
    assert queued_retires(ledger) == {first.episode, second.episode, third.episode}
    assert ledger.attempts() == {"s0": 1, "s1": 1, "s2": 1}
    assert ledger.stats().groups_retried_whole == 1
    # The reruns wait at the gate like any new attempt: nobody owns them yet.
    assert set(ledger.waiting()) == live


def test_a_sibling_given_up_reruns_its_whole_group_scored_group() -> None:
    # Only the first sibling has a budget.
    ledger = books(group_scored=("guess-group",))
    siblings = [
        owned(
            ledger,
            rollout(
                f"s{i}",
                group="gp",
                sibling=i,
                size=2,
                environment="guess-group",
                budget_s=1.0 if i == 0 else None,
            ),
        )
        for i in range(2)
    ]

    assert ledger.expire_due(2.0) == [siblings[0]]

    assert {attempt.episode for attempt in ledger.live()} == {
        EpisodeId("s0", 1),
        EpisodeId("s1", 1),
    }
    assert queued_retires(ledger) == {siblings[0].episode, siblings[1].episode}
    assert ledger.results() == ()


def test_a_group_out_of_attempts_ends_every_sibling_abandoned() -> None:
    ledger = books(group_scored=("guess-group",), max_attempts=1)
    first, second, third = group(ledger)

    assert ledger.participant_cancelled(first) is None

    assert ledger.live() == ()
    outcomes = {result.rollout_id: result.outcome for result in ledger.results()}
    assert outcomes == {
        "s0": RolloutOutcome.ABANDONED,
        "s1": RolloutOutcome.ABANDONED,
        "s2": RolloutOutcome.ABANDONED,
    }
    assert queued_retires(ledger) == {first.episode, second.episode, third.episode}


def test_a_protocol_failure_ends_the_whole_group_without_a_rerun() -> None:
    ledger = books(group_scored=("guess-group",))
    first, second, third = group(ledger)

    ledger.fail(second, "INVALID_ARGUMENT")

    assert ledger.live() == ()
    assert {result.outcome for result in ledger.results()} == {RolloutOutcome.ABANDONED}
    assert queued_retires(ledger) == {first.episode, second.episode, third.episode}


def test_a_sibling_of_a_per_sibling_environment_reruns_alone() -> None:
    ledger = books(group_scored=("guess-group",))
    first, second, _ = group(ledger, environment="guess")

    ledger.participant_cancelled(first)

    assert second.phase is AttemptPhase.OWNED
    assert {attempt.episode for attempt in ledger.live()} == {
        EpisodeId("s0", 1),
        EpisodeId("s1", 0),
        EpisodeId("s2", 0),
    }
    assert ledger.stats().groups_retried_whole == 0


# ------------------------------------------------------------------ the finished probe


def drive(probe: FinishedProbe, finished_through: int) -> int:
    """Answer the probe as a participant that finished every sequence up to this one."""
    while (candidate := probe.next_candidate()) is not None:
        probe.observe(candidate, candidate <= finished_through)
    return probe.finished_through


@pytest.mark.parametrize(
    "refused, finished_through",
    [(5, 5), (5, 6), (3_000_000_001, 900_000_000_000), (1, MAX_SEQUENCE - 1), (7, 1000)],
)
def test_the_probe_finds_the_highest_finished_sequence(refused: int, finished_through: int) -> None:
    probe = FinishedProbe(refused)

    assert drive(probe, finished_through) == finished_through
    assert not probe.exhausted
    assert probe.first_fresh == finished_through + 1
    # Galloping then bisecting: logarithmic in the distance.
    assert probe.probes <= 2 * (finished_through - refused + 1).bit_length() + 2


def test_the_probe_says_when_no_sequence_is_fresh() -> None:
    probe = FinishedProbe(10)

    assert drive(probe, MAX_SEQUENCE) == MAX_SEQUENCE
    assert probe.exhausted
