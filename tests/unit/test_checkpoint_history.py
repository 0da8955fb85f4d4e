"""The checkpoint history core (docs/spec.md section 7.13) driven with a fake clock."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import MappingProxyType

import pytest

from turnpoint.ids import EpisodeId
from turnpoint.protocol import ArtifactRef, ParticipantKind
from turnpoint.trainer.config import ConfigError, CoordinatorConfig
from turnpoint.trainer.restore.choice import (
    Candidate,
    RestoreChoice,
    RestoreChoiceError,
    metrics_of,
    rank_candidates,
)
from turnpoint.trainer.snapshots.attempt import SnapshotState
from turnpoint.trainer.snapshots.report import FailureReason, SnapshotOutcome, SnapshotReport
from turnpoint.trainer.status.history import CheckpointHistory
from turnpoint.trainer.storage.manifest import ParticipantEntry

S = SnapshotState
PUBLISHED_PATH = (
    S.NEW, S.RELEASE, S.ANCHOR, S.CLOSE, S.DRAIN, S.RETIRE, S.PREPARE, S.COMMIT, S.PUBLISH,
    S.RESUME, S.REOPEN, S.PUBLISHED,
)  # fmt: skip
OFFSET = 1_700_000_000.0


def walk(
    history: CheckpointHistory, attempt: str, states: tuple[SnapshotState, ...], start: float
) -> float:
    now = start
    for old, new in itertools.pairwise(states):
        now += 1.0
        history.on_transition(attempt, old, new, now)
    return now


def entry(name: str, size: int, records: int, episodes: int) -> ParticipantEntry:
    return ParticipantEntry(
        instance=name,
        kind=ParticipantKind.RESOURCES,
        artifacts=(ArtifactRef(f"{name}/records.jsonl", "0" * 64, size, records),),
        manifest=ArtifactRef(f"{name}/MANIFEST.json", "1" * 64, 10, 0),
        exported=tuple(EpisodeId(f"r{i}", 1) for i in range(episodes)),
    )


def test_a_published_attempt_has_its_phases_participants_and_sizes() -> None:
    history = CheckpointHistory(wall_offset_s=OFFSET, epoch=3)
    history.on_transition("ck-1", S.NEW, S.RELEASE, 100.0)
    now = 100.0
    for old, new in itertools.pairwise(PUBLISHED_PATH[1:]):
        now += 1.0
        if new is S.COMMIT:
            history.on_calls("prepare", "ck-1", {"tools": 0.5, "agent-0": 0.9}, {}, now)
        if new is S.PUBLISH:
            history.on_calls("commit", "ck-1", {"tools": 0.2}, {}, now)
            history.on_committed("ck-1", [entry("tools", 100, 3, 2)])
        history.on_transition("ck-1", old, new, now)
    history.on_report(SnapshotReport("ck-1", SnapshotOutcome.PUBLISHED, continued=2))
    row = history.get("ck-1")
    assert row is not None and row.status == "published"
    shown = history.row_json(row, now=now, participants=True)
    assert shown["duration_s"] == 10.0
    assert shown["phases_s"] == {s.value: 1.0 for s in PUBLISHED_PATH[1:-1]}
    assert shown["triggered_at"] == OFFSET + 100.0
    assert shown["bytes_written"] == 110 and shown["records_written"] == 3
    assert shown["episodes_exported"] == 2 and shown["continued"] == 2
    parts = shown["participants"]
    assert isinstance(parts, dict)
    assert parts["tools"] == {
        "prepare_s": 0.5,
        "commit_s": 0.2,
        "resume_s": None,
        "acknowledged_at": OFFSET + 107.0,
        "failure": None,
        "caused_failure": False,
        "committed": True,
        "bytes_written": 110,
        "records_written": 3,
        "episodes_exported": 2,
    }
    overview = history.overview()
    assert overview["counts"] == {
        "triggered": 1, "published": 1, "skipped": 0, "failed": 0, "interrupted": 0,
        "in_progress": 0, "restored": 0,
    }  # fmt: skip
    assert overview["latest"] == {
        "published": "ck-1", "failed": None, "skipped": None, "restored": None,
    }  # fmt: skip


def test_a_failed_attempt_names_its_reason_and_the_participant_that_caused_it() -> None:
    history = CheckpointHistory(wall_offset_s=0.0)
    now = walk(
        history, "ck-2", (S.NEW, S.RELEASE, S.ANCHOR, S.CLOSE, S.DRAIN, S.RETIRE, S.PREPARE), 0.0
    )
    history.on_calls(
        "prepare", "ck-2", {"tools": 0.1, "agent-0": 5.0}, {"agent-0": "not_ready: 1 blocker"}, now
    )
    walk(history, "ck-2", (S.PREPARE, S.ABORT, S.REOPEN, S.ABORT, S.FAILED), now)
    report = SnapshotReport(
        "ck-2",
        SnapshotOutcome.FAILED,
        reason=FailureReason.NOT_READY,
        detail="prepare failed",
        failures=MappingProxyType({"agent-0": object()}),  # type: ignore[dict-item]
    )
    history.on_report(report)
    row = history.get("ck-2")
    assert row is not None
    shown = history.row_json(row, now=100.0, participants=True)
    assert shown["status"] == "failed" and shown["reason"] == "not_ready"
    assert shown["caused_by"] == ["agent-0"]
    parts = shown["participants"]
    assert isinstance(parts, dict)
    assert parts["agent-0"]["failure"] == "prepare: not_ready: 1 blocker"  # type: ignore[index]
    assert parts["agent-0"]["caused_failure"] is True  # type: ignore[index]
    assert parts["tools"]["failure"] is None  # type: ignore[index]
    assert history.overview()["latest"]["failed"] == "ck-2"  # type: ignore[index]


def test_the_open_attempt_is_live_and_admission_follows_the_cut() -> None:
    history = CheckpointHistory(wall_offset_s=0.0)
    assert history.admission_open
    now = walk(
        history, "ck-3", (S.NEW, S.RELEASE, S.ANCHOR, S.CLOSE, S.DRAIN, S.RETIRE, S.PREPARE), 0.0
    )
    assert not history.admission_open and history.admission_since == 4.0
    row = history.open_attempt
    assert row is not None and row.status == "in_progress"
    shown = history.row_json(row, now=now + 2.5, participants=False)
    assert shown["phases_s"]["prepare"] == 2.5  # type: ignore[index]
    assert history.overview()["counts"]["in_progress"] == 1  # type: ignore[index]
    history.on_transition("ck-3", S.PREPARE, S.COMMIT, now + 3)
    assert history.admission_open and history.admission_since == now + 3


def test_history_keeps_the_newest_rows_but_counts_everything() -> None:
    history = CheckpointHistory(wall_offset_s=0.0, keep=3)
    now = 0.0
    for index in range(5):
        now = walk(history, f"ck-{index}", (S.NEW, S.RELEASE, S.SKIPPED), now)
    assert [r.checkpoint_id for r in history.rows()] == ["ck-4", "ck-3", "ck-2"]
    assert history.rows(status="published") == []
    assert history.overview()["counts"]["skipped"] == 5  # type: ignore[index]


def test_summary_is_min_avg_max_over_published_rows() -> None:
    history = CheckpointHistory(wall_offset_s=0.0)
    walk(history, "a", PUBLISHED_PATH, 0.0)
    history.on_transition("b", S.NEW, S.RELEASE, 50.0)
    history.on_transition("b", S.RELEASE, S.ANCHOR, 53.0)
    walk(history, "b", PUBLISHED_PATH[2:], 53.0)
    summary = history.summary()
    assert summary["published"] == 2
    duration = summary["measures"]["duration_s"]  # type: ignore[index]
    assert duration == {"min": 10.0, "avg": 11.0, "max": 12.0}


def test_restores_and_losses_are_events() -> None:
    history = CheckpointHistory(wall_offset_s=10.0, epoch=2)
    history.on_restore(now=1.0, checkpoint_id="ck-7", restore_s=0.5, resumed_rollouts=3)
    history.on_lost(["tools"], 2.0, "answered nothing")
    history.on_replaced(
        "agent-1",
        3.0,
        checkpoint_id="ck-8",
        resumed_rollouts=2,
        rerun_rollouts=1,
        untouched_rollouts=5,
    )
    # A heal is no restore of the job: the latest restore is still the open's.
    assert history.overview()["latest"]["restored"] == "ck-7"  # type: ignore[index]
    assert history.overview()["counts"]["restored"] == 1  # type: ignore[index]
    events = history.events_json()
    assert [e["kind"] for e in events] == [  # type: ignore[index]
        "restore",
        "participants_lost",
        "participant_replaced",
    ]
    replaced = events[-1]  # type: ignore[index]
    assert replaced["participants"] == ["agent-1"]  # type: ignore[index]
    assert (replaced["checkpoint_id"], replaced["resumed_rollouts"]) == ("ck-8", 2)  # type: ignore[index]
    assert replaced["rerun_rollouts"] == 1  # type: ignore[index]


# -- restore choice --------------------------------------------------------------------

CANDIDATES = (
    Candidate("c-3", 30, 3.0, {"mean_reward": 0.5}),
    Candidate("c-2", 20, 2.0, {}),
    Candidate("c-1", 10, 1.0, {"mean_reward": 0.9, "loss": 0.1}),
    Candidate("c-0", 0, 0.0, {"mean_reward": 0.9}),
)


def ids(found: list[Candidate]) -> list[str]:
    return [c.checkpoint_id for c in found]


def test_latest_keeps_the_newest_first_order() -> None:
    assert ids(rank_candidates(RestoreChoice.parse("latest"), CANDIDATES)) == [
        "c-3",
        "c-2",
        "c-1",
        "c-0",
    ]


def test_a_named_snapshot_is_the_only_candidate() -> None:
    assert ids(rank_candidates(RestoreChoice.parse("snapshot:c-2"), CANDIDATES)) == ["c-2"]
    assert rank_candidates(RestoreChoice.parse("snapshot:gone"), CANDIDATES) == []


def test_best_by_a_metric_orders_by_it_and_leaves_out_snapshots_without_it() -> None:
    assert ids(rank_candidates(RestoreChoice.parse("best:mean_reward"), CANDIDATES)) == [
        "c-1",
        "c-0",
        "c-3",
    ]
    assert ids(rank_candidates(RestoreChoice.parse("best:-mean_reward"), CANDIDATES)) == [
        "c-3",
        "c-1",
        "c-0",
    ]


@pytest.mark.parametrize(
    "text", ["", "newest", "snapshot:../x", "best:", "best:a b", "best:" + "m" * 65]
)
def test_a_bad_choice_is_refused_with_a_message(text: str) -> None:
    with pytest.raises(RestoreChoiceError, match="restore choice"):
        RestoreChoice.parse(text)


def test_choices_round_trip_and_metrics_ignore_non_numbers() -> None:
    for text in ("latest", "snapshot:c-1", "best:reward", "best:-loss"):
        assert str(RestoreChoice.parse(text)) == text
    assert metrics_of({"metrics": {"a": 1, "b": True, "c": "x", "d": 2.5}}) == {"a": 1.0, "d": 2.5}
    assert metrics_of({"metrics": [1]}) == {}


def test_an_earlier_process_shows_its_rows_and_an_attempt_it_never_finished() -> None:
    before = CheckpointHistory(wall_offset_s=OFFSET, epoch=1)
    records = []
    walk(before, "ck-a", PUBLISHED_PATH, 0.0)
    records += [before.started_record("ck-a"), before.finished_record("ck-a", now=20.0)]
    before.on_transition("ck-b", S.NEW, S.RELEASE, 30.0)
    records.append(before.started_record("ck-b"))  # the process dies in ck-b
    assert before.finished_record("ck-b", now=31.0) is None
    before.on_restore(now=0.5, checkpoint_id=None)
    records.append(before.event_record(before.events[0]))

    after = CheckpointHistory(wall_offset_s=OFFSET, epoch=2)
    torn = '{"history_version": 1, "kind": "chec'
    taken = after.load_past([*records, torn, {"history_version": 99, "kind": "event"}, 7])
    assert taken == len(records)
    after.on_restore(now=1.0, checkpoint_id="ck-a")
    walk(after, "ck-c", (S.NEW, S.RELEASE, S.SKIPPED), 2.0)
    shown = after.rows_json(now=10.0)
    assert [(r["checkpoint_id"], r["status"], r["epoch"]) for r in shown] == [
        ("ck-c", "skipped", 2),
        ("ck-b", "interrupted", 1),
        ("ck-a", "published", 1),
    ]
    assert "participants" not in shown[2]
    past = after.get_json("ck-a", now=10.0)
    assert past is not None and past["triggered_at"] == OFFSET + 1.0
    overview = after.overview()
    assert overview["counts"]["interrupted"] == 1  # type: ignore[index]
    assert overview["counts"]["triggered"] == 3  # type: ignore[index]
    assert overview["latest"] == {
        "published": "ck-a", "failed": None, "skipped": "ck-c", "restored": "ck-a",
    }  # fmt: skip
    kinds = [(e["kind"], e["epoch"]) for e in after.events_json()]  # type: ignore[index]
    assert kinds == [("fresh_start", 1), ("trainer_ended", 1), ("restore", 2)]
    assert after.summary()["published"] == 1


def test_a_bad_restore_choice_is_a_configuration_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="restore_from: restore choice 'newest'"):
        CoordinatorConfig(snapshot_root=tmp_path, restore_from="newest")
    chosen = CoordinatorConfig(snapshot_root=tmp_path, restore_from="best:-loss")
    assert RestoreChoice.parse(chosen.restore_from).lowest


def test_a_trainer_that_closed_is_not_reported_as_a_crash_and_one_that_did_not_is() -> None:
    first = CheckpointHistory(wall_offset_s=0.0, epoch=1)
    first.on_restore(now=1.0, checkpoint_id=None)
    records = [first.event_record(first.events[-1]), first.closed_record(now=2.0)]
    second = CheckpointHistory(wall_offset_s=0.0, epoch=2)
    second.on_restore(now=3.0, checkpoint_id="ck-1")
    records.append(second.event_record(second.events[-1]))  # then it crashes
    third = CheckpointHistory(wall_offset_s=0.0, epoch=3)
    third.load_past(records)
    shown = [(e["kind"], e["epoch"]) for e in third.events_json()]  # type: ignore[index]
    assert shown == [
        ("fresh_start", 1),
        ("trainer_closed", 1),
        ("restore", 2),
        ("trainer_ended", 2),
    ]


def test_a_restored_snapshot_whose_report_the_crash_took_is_shown_published() -> None:
    """docs/spec.md section 7.13.5: the history file is written behind the snapshot path,
    so a kill right after a publication can leave only the attempt's ``started`` record.
    The next trainer restores that very snapshot: it was published, not interrupted."""
    before = CheckpointHistory(wall_offset_s=OFFSET, epoch=1)
    walk(before, "ck-a", PUBLISHED_PATH, 0.0)
    walk(before, "ck-b", PUBLISHED_PATH, 20.0)
    walk(before, "ck-c", (S.NEW, S.RELEASE, S.ANCHOR), 40.0)
    records = [
        before.started_record("ck-a"),
        before.finished_record("ck-a", now=20.0),
        before.started_record("ck-b"),  # its report's record was lost with the process
        before.started_record("ck-c"),
    ]

    after = CheckpointHistory(wall_offset_s=OFFSET, epoch=2)
    after.load_past(records)
    manifest = (entry("agent", 100, 3, 2), entry("tools", 50, 1, 1))
    after.on_restore(now=1.0, checkpoint_id="ck-b", entries=manifest)

    shown = {r["checkpoint_id"]: r for r in after.rows_json(now=2.0)}
    assert shown["ck-b"]["status"] == "published"
    assert "restored" in str(shown["ck-b"]["detail"])
    # Its drill-down: every participant of the manifest restored, what each committed.
    detail = after.get_json("ck-b", now=2.0)
    assert detail is not None
    participants = detail["participants"]
    assert isinstance(participants, dict) and sorted(participants) == ["agent", "tools"]
    assert participants["agent"]["bytes_written"] == 110  # type: ignore[index]
    assert participants["agent"]["committed"] is True  # type: ignore[index]
    assert participants["tools"]["prepare_s"] is None  # type: ignore[index]
    assert (detail["bytes_written"], detail["records_written"]) == (170, 4)
    assert detail["episodes_exported"] == 3
    assert shown["ck-c"]["status"] == "interrupted"  # never published: it stays so
    assert shown["ck-a"]["status"] == "published"
    overview = after.overview()
    assert overview["latest"]["published"] == "ck-b"  # type: ignore[index]
    assert overview["counts"]["interrupted"] == 1  # type: ignore[index]
