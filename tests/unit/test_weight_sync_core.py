"""The weight sync's pure decisions: request ids, retries within bounds, the give-up.

docs/spec.md section 5.4 item 4. Time is an argument: a fake clock drives a whole
push's retries without waiting.
"""

from __future__ import annotations

import pickle

import pytest

from turnpoint.errors import Reason
from turnpoint.trainer import CoordinatorError, WeightSyncError, WeightSyncSettings
from turnpoint.trainer.weights.core import (
    GiveUp,
    backoff_s,
    call_timeout_s,
    decide_retry,
    give_up_reason,
    installed_version_refused,
    restored_push_version,
    weights_extra,
    weights_request_id,
    weights_version_of,
)


def test_the_request_id_is_one_per_epoch_version_and_server() -> None:
    ids = {
        weights_request_id(epoch, version, server)
        for epoch in (1, 2)
        for version in (0, 1, 10)
        for server in ("policy", "policy-2")
    }
    assert len(ids) == 12
    # A retry computes the very same id.
    assert weights_request_id(3, 7, "policy") == weights_request_id(3, 7, "policy")


def test_the_request_id_stays_within_the_wire_bound() -> None:
    assert len(weights_request_id(10**12, 10**12, "p" * 128)) <= 256


def _run(settings: WeightSyncSettings, *, transient: bool, call_s: float = 0.0) -> list[float]:
    """Fail every attempt (each taking ``call_s``) until the policy gives up; the pauses."""
    now = started = 1000.0
    pauses: list[float] = []
    attempts = 0
    while True:
        attempts += 1
        now += call_s
        decision = decide_retry(
            settings, attempts_made=attempts, started_at=started, now=now, transient=transient
        )
        if not decision.retry:
            assert decision.give_up is not None
            return pauses
        pauses.append(decision.pause_s)
        now += decision.pause_s


def test_transient_failures_back_off_doubling_up_to_the_cap_within_the_attempts() -> None:
    settings = WeightSyncSettings(
        max_attempts=6, total_s=1000.0, backoff_initial_s=0.25, backoff_max_s=1.0
    )
    assert _run(settings, transient=True) == [0.25, 0.5, 1.0, 1.0, 1.0]  # 6 attempts


def test_a_failure_that_is_not_transient_is_never_retried() -> None:
    settings = WeightSyncSettings()
    decision = decide_retry(settings, attempts_made=1, started_at=0.0, now=0.0, transient=False)
    assert decision.give_up is GiveUp.NOT_TRANSIENT and not decision.retry


def test_the_total_time_bounds_the_retries_whatever_the_attempts() -> None:
    settings = WeightSyncSettings(
        call_timeout_s=2.0,
        max_attempts=1000,
        total_s=10.0,
        backoff_initial_s=0.5,
        backoff_max_s=0.5,
    )
    pauses = _run(settings, transient=True, call_s=2.0)
    # Each round is 2 s of call and 0.5 s of pause: a fourth pause would end at 10 s.
    assert pauses == [0.5, 0.5, 0.5]
    last = decide_retry(settings, attempts_made=4, started_at=0.0, now=9.5, transient=True)
    assert last.give_up is GiveUp.TIME


def test_the_attempt_count_bounds_the_retries() -> None:
    settings = WeightSyncSettings(max_attempts=3)
    decision = decide_retry(settings, attempts_made=3, started_at=0.0, now=0.1, transient=True)
    assert decision.give_up is GiveUp.ATTEMPTS


def test_the_backoff_never_overflows() -> None:
    settings = WeightSyncSettings(backoff_initial_s=0.1, backoff_max_s=3.0)
    assert backoff_s(settings, 1) == 0.1
    assert backoff_s(settings, 5000) == 3.0


def test_a_call_never_outlives_the_push() -> None:
    settings = WeightSyncSettings(call_timeout_s=30.0, total_s=60.0)
    assert call_timeout_s(settings, started_at=0.0, now=0.0) == 30.0
    assert call_timeout_s(settings, started_at=0.0, now=50.0) == 10.0
    assert call_timeout_s(settings, started_at=0.0, now=70.0) == 0.1


@pytest.mark.parametrize(
    "bad",
    [
        {"call_timeout_s": 0.0},
        {"total_s": float("nan")},
        {"max_attempts": 0},
        {"max_attempts": True},
        {"backoff_initial_s": 2.0, "backoff_max_s": 1.0},
    ],
)
def test_settings_refuse_values_that_bound_nothing(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WeightSyncSettings(**bad)  # type: ignore[arg-type]


def test_the_give_up_names_the_server_and_the_last_status_and_is_a_coordinator_error() -> None:
    error = WeightSyncError(
        give_up_reason(None, "UNAVAILABLE", transient=True),
        instance="policy",
        version=7,
        attempts=10,
        status="UNAVAILABLE",
        detail="Stream removed",
    )
    assert isinstance(error, CoordinatorError)
    assert error.reason is Reason.UNAVAILABLE and error.transient
    assert error.metadata["participant"] == "policy"
    assert "policy" in str(error) and "UNAVAILABLE" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.instance, copy.version, copy.attempts, copy.status, copy.reason) == (
        "policy",
        7,
        10,
        "UNAVAILABLE",
        Reason.UNAVAILABLE,
    )


@pytest.mark.parametrize(
    ("reason", "code", "transient", "expected"),
    [
        (Reason.INVALID_ARGUMENT, "INVALID_ARGUMENT", False, Reason.INVALID_ARGUMENT),
        (None, "DEADLINE_EXCEEDED", True, Reason.DEADLINE_EXCEEDED),
        (None, "UNAVAILABLE", True, Reason.UNAVAILABLE),
        (None, "UNIMPLEMENTED", False, Reason.PROTOCOL_VIOLATION),
    ],
)
def test_the_give_up_reason_follows_the_last_failure(
    reason: Reason | None, code: str, transient: bool, expected: Reason
) -> None:
    assert give_up_reason(reason, code, transient) is expected


def test_the_snapshot_records_the_version_and_a_restore_reads_it_back() -> None:
    assert weights_extra(None) == {}
    assert weights_version_of(weights_extra(12), "ck-1") == 12
    assert weights_version_of({}, "ck-1") is None
    with pytest.raises(CoordinatorError) as bad:
        weights_version_of({"weights_version": "12"}, "ck-1")
    assert bad.value.reason is Reason.INVALID_CHECKPOINT_STATE


def test_a_refusal_for_going_below_names_the_installed_version_from_metadata_only() -> None:
    below = {"field": "weights_version", "installed_version": "12"}
    assert installed_version_refused(Reason.INVALID_ARGUMENT, below) == 12
    assert installed_version_refused(Reason.FENCED, below) is None
    assert installed_version_refused(None, below) is None
    assert installed_version_refused(Reason.INVALID_ARGUMENT, {"field": "state"}) is None
    for bad in ("", "-1", "1.5", "\u0661"):  # not a decimal integer >= 0
        damaged = {"field": "weights_version", "installed_version": bad}
        assert installed_version_refused(Reason.INVALID_ARGUMENT, damaged) is None


def test_restored_weights_go_above_every_newer_version_a_running_server_holds() -> None:
    assert restored_push_version(7, []) == 7  # fresh servers: the snapshot's version
    assert restored_push_version(7, [9, 12]) == 13
    assert restored_push_version(7, [7]) == 8  # cannot happen (equal is accepted), still up


def test_the_give_up_keeps_the_installed_version_it_was_refused_at() -> None:
    error = WeightSyncError(
        Reason.INVALID_ARGUMENT,
        instance="policy",
        version=7,
        attempts=1,
        status="INVALID_ARGUMENT (INVALID_ARGUMENT)",
        detail="below",
        installed_version=9,
    )
    assert error.metadata["installed_version"] == "9"
    assert pickle.loads(pickle.dumps(error)).installed_version == 9
