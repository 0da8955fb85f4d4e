"""The demo's report: the exactly-once audit, the statistics and the timeline, on synthetic logs.

``_Run`` writes the logs a correct demo run produces: a first trainer that publishes
snapshots and trains past the last one, a crash, and a second trainer that restores the
snapshot and finishes. Each test then breaks one thing the way a real bug would (a group
trained twice, a sibling lost, a reward the verifier never returned, ...) and checks that
the audit names it.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from turnpoint.apps.demo._fault_window import FAULT_WINDOW
from turnpoint.apps.demo._progress import EventTail, ProgressState
from turnpoint.apps.demo._report import (
    EventLogError,
    SupervisorEvent,
    TokenAudit,
    VerifierEntry,
    audit,
    build_report,
    effective_lineage,
    load_run,
    parse_events,
    parse_generation_entries,
    parse_sandbox_entries,
    parse_verifier_entries,
    percentile,
    render_report,
)
from turnpoint.apps.demo._timeline import render_timeline, rollouts_per_second

GROUP_SIZE = 4
GROUPS_PER_STEP = 2


class _Run:
    """A synthetic demo run: event dicts, verifier entries and supervisor events."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.events: list[dict[str, Any]] = []
        self.verifier: list[dict[str, Any]] = []
        self.supervisor: list[dict[str, Any]] = []
        self.incarnation = 0

    def tick(self, seconds: float = 0.1) -> float:
        self.t += seconds
        return self.t

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"t": self.tick(), "type": kind, "incarnation": self.incarnation, **fields}
        self.events.append(event)
        return event

    def start(self, step: int = 0, restored_from: str | None = None) -> None:
        self.incarnation += 1
        self.emit("start", restored_from=restored_from, step=step)

    def rollouts(
        self, group: int, *, attempt: int = 0, resumed: bool = False
    ) -> list[dict[str, Any]]:
        samples = []
        for sibling in range(GROUP_SIZE):
            rollout_id = f"g{group}-s{sibling}"
            # Rewards vary with the attempt, as a rerun after a restore would.
            reward = round(0.1 * sibling + 0.01 * group + 0.003 * attempt, 6)
            self.verifier.append(
                {
                    "verifier": "tools",
                    "rollout_id": rollout_id,
                    "attempt": attempt,
                    "reward": reward,
                }
            )
            self.emit(
                "rollout",
                rollout_id=rollout_id,
                attempt=attempt,
                group=group,
                sibling=sibling,
                environment="guess" if group % 2 == 0 else "guess-group",
                reward=reward,
                resumed=resumed,
                turns=3,
            )
            samples.append({"rollout_id": rollout_id, "attempt": attempt, "reward": reward})
        self.tick(0.3)
        return samples

    def train(self, step: int, *, attempt: int = 0) -> None:
        groups = [GROUPS_PER_STEP * (step - 1) + i for i in range(GROUPS_PER_STEP)]
        samples = [s for g in groups for s in self.rollouts(g, attempt=attempt)]
        self.emit(
            "progress", step=step - 1, in_flight=5, published=0, admission_closed=False, queue=2
        )
        self.emit(
            "train_step",
            step=step,
            groups=groups,
            rollouts=samples,
            mean_reward=sum(s["reward"] for s in samples) / len(samples),
        )

    def snapshot(
        self,
        checkpoint_id: str,
        outcome: str = "published",
        reason: str | None = None,
        *,
        continued: int = 3,
        restarts: int = 1,
    ) -> None:
        t_start = self.tick()
        t_end = self.tick(0.4)
        self.emit(
            "snapshot",
            checkpoint_id=checkpoint_id,
            outcome=outcome,
            reason=reason,
            t_start=t_start,
            t_end=t_end,
            admission_closed_s=round(t_end - t_start, 6),
            phases={"anchor": 0.1, "prepare": 0.2, "commit": 0.1},
            continued=continued,
            restarts=restarts,
        )

    def crash(self) -> None:
        self.supervisor.append({"type": "crash", "t": self.tick(0.5)})
        self.supervisor.append({"type": "restart", "t": self.tick(3.0)})

    def restore(self, checkpoint_id: str) -> None:
        self.emit(
            "restore",
            checkpoint_id=checkpoint_id,
            resumed_from_turn=5,
            rerun_from_prompt=3,
            groups_retried_whole=1,
            seconds=0.8,
        )

    def done(self, step: int) -> None:
        self.emit("done", step=step)

    def write(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        for name, lines in (
            ("events.jsonl", self.events),
            ("supervisor.jsonl", self.supervisor),
            ("verifier-tools.jsonl", self.verifier),
        ):
            (out / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
        return out


STEPS = 10
RESTORED_STEP = 4
CRASHED_AFTER = 6


def _good_run() -> _Run:
    """Ten steps; snapshot after step 4; crash after step 6; restore to step 4; finish."""
    run = _Run()
    run.start()
    for step in range(1, CRASHED_AFTER + 1):
        run.train(step)
        if step in (2, 4):
            run.snapshot(f"ckpt-{step:04d}")
    run.snapshot("ckpt-0005", outcome="failed", reason="PREPARE_TIMEOUT")
    run.rollouts(2 * CRASHED_AFTER)  # in flight at the crash, never trained
    run.crash()
    run.start(step=RESTORED_STEP, restored_from="ckpt-0004")
    run.restore("ckpt-0004")
    for step in range(RESTORED_STEP + 1, STEPS + 1):
        # Groups cut by the crash come back as the next attempt.
        run.train(step, attempt=1 if step <= CRASHED_AFTER + 1 else 0)
    run.done(STEPS)
    return run


def _audit(run: _Run, **kwargs: Any) -> Any:
    return audit(
        parse_events(run.events),
        parse_verifier_entries(run.verifier),
        group_size=GROUP_SIZE,
        **kwargs,
    )


def _train_step(run: _Run, step: int, incarnation: int) -> dict[str, Any]:
    return next(
        e
        for e in run.events
        if e["type"] == "train_step" and e["step"] == step and e["incarnation"] == incarnation
    )


# ---------------------------------------------------------------------- lineage


def test_the_restored_incarnation_replaces_the_steps_after_its_snapshot() -> None:
    lineage = effective_lineage(parse_events(_good_run().events))

    assert [s.step for s in lineage.steps] == list(range(1, STEPS + 1))
    assert [s.incarnation for s in lineage.steps] == [1] * RESTORED_STEP + [2] * (
        STEPS - RESTORED_STEP
    )
    assert [(s.incarnation, s.step) for s in lineage.rolled_back] == [(1, 5), (1, 6)]


def test_a_good_run_passes_the_audit() -> None:
    result = _audit(_good_run(), expected_steps=STEPS)

    assert result.passed, result.reason
    assert result.line == "audit: passed"
    assert (result.steps, result.groups, result.rollouts) == (
        STEPS,
        STEPS * GROUPS_PER_STEP,
        STEPS * GROUPS_PER_STEP * GROUP_SIZE,
    )
    assert result.rolled_back_steps == 2


def _restored_sandbox(restored_digest: str) -> dict[str, Any]:
    return {
        "sandbox": "g00001-s0",
        "rollout_id": "g00001-s0",
        "attempt": 1,
        "generation": 2,
        "cut_digest": "a" * 64,
        "restored_digest": restored_digest,
    }


def test_the_sandbox_audit_counts_restored_trees_equal_to_their_cut() -> None:
    run = _good_run()
    lines = [*run.verifier, _restored_sandbox("a" * 64)]
    # A verifier log with sandbox lines still parses its rewards the same.
    assert parse_verifier_entries(lines) == parse_verifier_entries(run.verifier)
    sandboxes = parse_sandbox_entries(lines)
    result = _audit(run, sandboxes=sandboxes)
    assert result.passed, result.reason
    assert result.sandboxes is not None and result.sandboxes.restored == 1
    assert result.sandboxes.line == (
        "sandboxes: 1 restored, each tree equal to its digest at the cut"
    )
    assert _audit(run).sandboxes is None


def test_the_sandbox_audit_says_what_the_restores_did_with_processes_once() -> None:
    said = "restart_only (criu is not installed)"
    lines = [{**_restored_sandbox("a" * 64), "processes": said}] * 2
    result = _audit(_good_run(), sandboxes=parse_sandbox_entries(lines))
    assert result.sandboxes is not None
    assert result.sandboxes.line == (
        f"sandboxes: 2 restored, each tree equal to its digest at the cut; processes {said}"
    )


def test_a_restored_tree_other_than_its_cut_fails_the_audit() -> None:
    sandboxes = parse_sandbox_entries([_restored_sandbox("b" * 64)])
    result = _audit(_good_run(), sandboxes=sandboxes)
    assert not result.passed
    assert result.reason == (
        "sandbox g00001-s0 of rollout g00001-s0 attempt 1 was restored as generation 2 "
        f"with tree {'b' * 12}, but its snapshot recorded {'a' * 12} at the cut"
    )


def test_a_run_without_a_crash_passes_too() -> None:
    run = _Run()
    run.start()
    for step in range(1, 4):
        run.train(step)
    run.done(3)

    assert _audit(run, expected_steps=3).passed


def test_a_restore_ahead_of_what_was_trained_fails() -> None:
    run = _Run()
    run.start()
    run.train(1)
    run.start(step=3, restored_from="ckpt-0003")

    result = _audit(run)

    assert not result.passed
    assert result.reason == (
        "incarnation 2 starts at step 3 (restored from ckpt-0003) but only 1 steps were "
        "trained before it"
    )


def test_a_step_logged_out_of_order_fails() -> None:
    run = _Run()
    run.start()
    run.train(1)
    run.train(3)

    result = _audit(run)

    assert not result.passed
    assert result.reason == "incarnation 1 logged train step 3 after step 1"


# ---------------------------------------------------------------------- exactly once


def test_a_group_trained_twice_fails() -> None:
    run = _good_run()
    # The restored trainer forgets the restored data-loader position and trains group 0 again.
    step = _train_step(run, 5, incarnation=2)
    step["groups"] = [0, *step["groups"][1:]]

    result = _audit(run)

    assert not result.passed
    assert result.reason == "prompt group 0 was trained twice (steps 1 and 5)"


def test_a_skipped_group_fails() -> None:
    run = _good_run()
    last = _train_step(run, STEPS, incarnation=2)
    last["groups"] = [last["groups"][0]]
    last["rollouts"] = last["rollouts"][:GROUP_SIZE]
    last["mean_reward"] = sum(r["reward"] for r in last["rollouts"]) / GROUP_SIZE
    # Skip a group in the middle: the last group is now the only one not trained.
    step = _train_step(run, 2, incarnation=1)
    step["groups"] = [2]
    step["rollouts"] = step["rollouts"][:GROUP_SIZE]
    step["mean_reward"] = sum(r["reward"] for r in step["rollouts"]) / GROUP_SIZE

    result = _audit(run)

    assert not result.passed
    assert result.reason == "prompt group 3 was never trained, though groups up to 18 were"


def test_a_lost_sibling_fails() -> None:
    run = _good_run()
    step = _train_step(run, 7, incarnation=2)
    step["rollouts"] = [r for r in step["rollouts"] if r["rollout_id"] != "g12-s2"]
    step["mean_reward"] = sum(r["reward"] for r in step["rollouts"]) / len(step["rollouts"])

    result = _audit(run)

    assert not result.passed
    assert result.reason == (
        "prompt group 12 was trained in step 7 with 3 of 4 siblings (lost siblings 2)"
    )


def test_a_rollout_counted_twice_in_one_step_fails() -> None:
    run = _good_run()
    step = _train_step(run, 3, incarnation=1)
    step["rollouts"] = [*step["rollouts"], step["rollouts"][0]]

    result = _audit(run)

    assert not result.passed
    assert result.reason == "rollout g4-s0 attempt 0 was counted twice (steps 3 and 3)"


def test_two_attempts_of_one_rollout_both_trained_fails() -> None:
    run = _good_run()
    # Step 8 sneaks in attempt 1 of a rollout step 2 already trained as attempt 0.
    run.verifier.append({"verifier": "tools", "rollout_id": "g2-s0", "attempt": 1, "reward": 0.5})
    stray = dict(
        next(e for e in run.events if e["type"] == "rollout" and e["rollout_id"] == "g2-s0"),
        attempt=1,
        reward=0.5,
        incarnation=2,
    )
    step = _train_step(run, 8, incarnation=2)
    run.events.insert(run.events.index(step), stray)
    step["rollouts"] = [*step["rollouts"], {"rollout_id": "g2-s0", "attempt": 1, "reward": 0.5}]

    result = _audit(run)

    assert not result.passed
    assert result.reason == (
        "rollout g2-s0 was trained twice: attempt 0 in step 2 and attempt 1 in step 8"
    )


def test_a_trained_rollout_the_trainer_never_recorded_fails() -> None:
    run = _good_run()
    run.events = [
        e for e in run.events if not (e["type"] == "rollout" and e["rollout_id"] == "g9-s1")
    ]

    result = _audit(run)

    assert not result.passed
    assert result.reason == (
        "rollout g9-s1 attempt 1 was trained in step 5 but the trainer never recorded it"
    )


def test_a_reward_the_verifier_never_returned_fails() -> None:
    run = _good_run()
    for entry in run.verifier:
        if (entry["rollout_id"], entry["attempt"]) == ("g15-s3", 0):
            entry["reward"] += 1e-6

    result = _audit(run)

    assert not result.passed
    assert result.reason is not None
    assert result.reason.startswith(
        "rollout g15-s3 attempt 0 was trained with reward 0.45 but the verifier returned "
    )


def test_rewards_within_the_float_tolerance_pass() -> None:
    run = _good_run()
    for entry in run.verifier:
        entry["reward"] += 1e-12

    assert _audit(run).passed


def test_a_rollout_without_any_verifier_entry_fails() -> None:
    run = _good_run()
    run.verifier = [v for v in run.verifier if v["rollout_id"] != "g0-s0"]

    result = _audit(run)

    assert not result.passed
    assert result.reason == (
        "rollout g0-s0 attempt 0 was trained in step 1 but no verifier returned a reward for it"
    )


def test_a_trained_reward_other_than_the_recorded_one_fails() -> None:
    run = _good_run()
    step = _train_step(run, 1, incarnation=1)
    step["rollouts"][1] = {**step["rollouts"][1], "reward": 0.9}
    step["mean_reward"] = sum(r["reward"] for r in step["rollouts"]) / len(step["rollouts"])

    result = _audit(run)

    assert not result.passed
    assert result.reason == (
        "rollout g0-s1 attempt 0 was recorded with reward 0.1 but trained with 0.9 in step 1"
    )


def test_an_attempt_recorded_again_after_a_rollback_is_matched_to_its_own_incarnation() -> None:
    run = _good_run()
    # The first trainer had recorded attempt 0 of group 14 (step 8's) before the crash:
    # the rolled-back recording has another reward, and must not be confused with the
    # second trainer's.
    crash_index = next(i for i, e in enumerate(run.events) if e["incarnation"] == 2)
    early = dict(
        next(e for e in run.events if e["type"] == "rollout" and e["rollout_id"] == "g14-s0"),
        incarnation=1,
        reward=0.77,
        t=run.events[crash_index - 1]["t"],
    )
    run.events.insert(crash_index, early)
    run.verifier.append({"verifier": "tools", "rollout_id": "g14-s0", "attempt": 0, "reward": 0.77})

    assert _audit(run).passed


def test_an_unfinished_run_fails() -> None:
    run = _good_run()
    run.events = [e for e in run.events if e["type"] != "done"]

    result = _audit(run)

    assert not result.passed
    assert result.reason == "the run did not finish: incarnation 2 logged no done event"


def test_a_short_step_fails_when_groups_per_step_is_given() -> None:
    run = _good_run()
    last = _train_step(run, STEPS, incarnation=2)
    last["groups"] = last["groups"][:1]
    last["rollouts"] = last["rollouts"][:GROUP_SIZE]
    last["mean_reward"] = sum(r["reward"] for r in last["rollouts"]) / GROUP_SIZE

    assert _audit(run).passed  # every group it lists is whole
    result = _audit(run, groups_per_step=GROUPS_PER_STEP)

    assert not result.passed
    assert result.reason == "step 10 trained 1 prompt groups, not the 2 per step asked for"


def test_fewer_steps_than_asked_fails() -> None:
    result = _audit(_good_run(), expected_steps=12)

    assert not result.passed
    assert result.reason == "the run trained 10 effective steps, not the 12 asked for"


def test_a_mean_reward_that_is_not_the_mean_of_the_step_fails() -> None:
    run = _good_run()
    _train_step(run, 9, incarnation=2)["mean_reward"] = 0.0

    result = _audit(run)

    assert not result.passed
    assert result.reason is not None
    assert result.reason.startswith("step 9 logs mean reward 0.0 but its rollouts average")


# ---------------------------------------------------------------------- parsing


def test_a_malformed_known_event_names_its_line_and_field() -> None:
    run = _good_run()
    run.events[3]["sibling"] = "1"

    with pytest.raises(EventLogError) as caught:
        parse_events(run.events)

    assert str(caught.value) == (
        "events.jsonl line 4 (rollout): 'sibling' must be an integer, got '1'"
    )


def test_group_ids_may_be_strings_that_end_in_the_index() -> None:
    run = _good_run()
    for event in run.events:
        if event["type"] == "rollout":
            event["group"] = f"g{event['group']:05d}"
        elif event["type"] == "train_step":
            event["groups"] = [f"g{g:05d}" for g in event["groups"]]

    assert _audit(run, expected_steps=STEPS).passed
    assert parse_events(run.events).rollouts[0].group == 0


def test_a_group_id_without_an_index_is_an_error() -> None:
    run = _good_run()
    _train_step(run, 1, incarnation=1)["groups"] = ["first", 1]

    with pytest.raises(EventLogError, match=r"groups\[0\] must be a prompt group index"):
        parse_events(run.events)


def test_unknown_event_types_are_ignored() -> None:
    run = _good_run()
    run.events.insert(2, {"t": 1.0, "type": "weights_sync", "incarnation": 1, "version": 3})

    assert _audit(run).passed


def test_load_run_reads_the_three_logs(tmp_path: Path) -> None:
    out = _good_run().write(tmp_path / "out")
    (out / "verifier-group-tools.jsonl").write_text("")

    logs = load_run(out)

    assert len(logs.events.train_steps) == STEPS + (CRASHED_AFTER - RESTORED_STEP)
    assert [e.type for e in logs.supervisor] == ["crash", "restart"]
    assert len(logs.verifier) == len(_good_run().verifier)


def test_a_line_that_is_not_json_is_an_error(tmp_path: Path) -> None:
    out = _good_run().write(tmp_path / "out")
    with (out / "events.jsonl").open("a") as handle:
        handle.write('{"t": 1, "type": "progr\n')

    with pytest.raises(EventLogError, match=r"events.jsonl line \d+ is not JSON"):
        load_run(out)


# ---------------------------------------------------------------------- statistics


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_the_report_counts_snapshots_restores_and_rewards() -> None:
    run = _good_run()
    logs = load_run_from(run)

    report = build_report(logs, group_size=GROUP_SIZE, expected_steps=STEPS)

    snaps = report.snapshots
    assert (snaps.attempted, snaps.published, snaps.failed, snaps.skipped) == (3, 2, 1, 0)
    assert snaps.failure_reasons == (("PREPARE_TIMEOUT", 1),)
    assert snaps.admission_closed_p50_s == pytest.approx(0.4)
    recovery = report.recovery
    assert (recovery.crashes, recovery.restarts, recovery.restored_from) == (1, 1, ("ckpt-0004",))
    assert (recovery.resumed_from_turn, recovery.rerun_from_prompt) == (5, 3)
    assert recovery.groups_retried_whole == 1
    assert report.rewards.window == 2
    assert report.rewards.first_mean is not None and report.rewards.last_mean is not None
    assert report.rewards.last_mean > report.rewards.first_mean
    assert (report.effective_steps, report.rolled_back_steps) == (STEPS, 2)
    assert report.exit_status == 0


def load_run_from(run: _Run) -> Any:
    from turnpoint.apps.demo._report import RunLogs, parse_supervisor_events

    return RunLogs(
        parse_events(run.events),
        tuple(parse_supervisor_events(run.supervisor)),
        tuple(parse_verifier_entries(run.verifier)),
    )


def _healed_run() -> _Run:
    """The good run with two agents lost and replaced in place before the crash."""
    run = _good_run()
    at = run.events[3]["t"]
    for lost, continued, rerun, running in (("agent-0", 2, 1, 8), ("agent-1", 0, 0, 4)):
        run.supervisor.append({"type": "agent_lost", "t": at, "instance": lost})
        run.supervisor.append({"type": "replaced", "t": at + 0.5, "instance": lost, "n": 1})
        run.events.insert(
            4,
            {
                "t": at + 0.6,
                "type": "heal",
                "incarnation": 1,
                "lost": lost,
                "participant_kind": "AGENT",
                "checkpoint_id": "ckpt-0002" if continued else None,
                "continued": continued,
                "rerun": rerun,
                "running": running,
                "step": 1,
            },
        )
    return run


def test_the_report_counts_replacements_apart_from_job_restarts() -> None:
    report = build_report(load_run_from(_healed_run()), group_size=GROUP_SIZE, expected_steps=STEPS)

    recovery = report.recovery
    # The heals cost no job restart: the one restart is the crash's.
    assert (recovery.participants_replaced, recovery.crashes, recovery.restarts) == (2, 1, 1)
    assert [(h.lost, h.restored, h.running) for h in recovery.heals] == [
        ("agent-1", 0, 4),
        ("agent-0", 3, 8),
    ]
    assert recovery.restored_per_running == pytest.approx(3 / 12)
    assert report.exit_status == 0


def test_a_trainer_restarted_alone_is_counted_apart_from_job_restarts() -> None:
    # The same run, its restart the trainer's alone (docs/spec.md section 7.11 item 3).
    run = _healed_run()
    restart = next(e for e in run.supervisor if e["type"] == "restart")
    restart["participants_restarted"] = 0
    recovery = build_report(
        load_run_from(run), group_size=GROUP_SIZE, expected_steps=STEPS
    ).recovery
    assert (recovery.crashes, recovery.restarts, recovery.trainer_restarts) == (1, 0, 1)
    text, status = _rendered(run)
    assert status == 0
    assert "crashes / job restarts │ 1 / 0" in text
    assert "trainer restarts       │ 1 (participants restarted: 0)" in text
    # A job restart names how many participants it started again.
    restart["participants_restarted"] = 5
    text, _ = _rendered(run)
    assert "crashes / job restarts │ 1 / 1" in text and "trainer restarts       │ 0" in text


def test_a_report_without_heals_has_no_restored_share() -> None:
    recovery = build_report(
        load_run_from(_good_run()), group_size=GROUP_SIZE, expected_steps=STEPS
    ).recovery

    assert (recovery.participants_replaced, recovery.heals) == (0, ())
    assert recovery.restored_per_running is None


def test_the_printed_report_shows_each_heal_against_what_was_running() -> None:
    text, status = _rendered(_healed_run())

    assert status == 0
    assert "participants replaced  │ 2" in text
    assert "crashes / job restarts │ 1 / 1" in text
    assert "agent-1: 0 of 4 restored, agent-0: 3 of 8 restored" in text


def test_a_heal_restoring_more_than_was_running_is_an_error() -> None:
    run = _good_run()
    run.emit(
        "heal",
        lost="tools",
        participant_kind="RESOURCES",
        checkpoint_id=None,
        continued=3,
        rerun=2,
        running=4,
        step=1,
    )

    with pytest.raises(EventLogError, match=r"\(heal\): continued and rerun"):
        parse_events(run.events)


def _rendered(run: _Run, timeline: Path | None = None) -> tuple[str, int]:
    report = build_report(load_run_from(run), group_size=GROUP_SIZE, expected_steps=STEPS)
    buffer = io.StringIO()
    render_report(report, Console(file=buffer, width=120), timeline=timeline)
    return buffer.getvalue(), report.exit_status


def test_the_printed_report_ends_with_the_audit_line() -> None:
    text, status = _rendered(_good_run(), timeline=Path("/out/timeline.png"))

    lines = text.rstrip().splitlines()
    assert status == 0
    assert lines[-2:] == ["timeline: /out/timeline.png", "audit: passed"]
    assert "2 published, 1 failed" in text
    assert "PREPARE_TIMEOUT x1" in text
    assert "5 resumed from a saved turn, 3 rerun from the prompt" in text


def test_a_failed_audit_is_the_last_line_and_exit_status_1() -> None:
    run = _good_run()
    run.verifier = [v for v in run.verifier if v["rollout_id"] != "g0-s0"]

    text, status = _rendered(run)

    assert status == 1
    assert text.rstrip().splitlines()[-1] == (
        "audit: FAILED: rollout g0-s0 attempt 0 was trained in step 1 but no verifier "
        "returned a reward for it"
    )


# ---------------------------------------------------------------------- timeline


def test_rollouts_per_second_bins_from_the_origin() -> None:
    assert rollouts_per_second([10.0, 10.5, 11.2, 13.9], 10.0, 14.0) == [2, 1, 0, 1, 0]
    assert rollouts_per_second([], 5.0, 5.0) == [0]


def test_moving_average_is_trailing() -> None:
    from turnpoint.apps.demo._timeline import moving_average

    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([], 3) == []


def test_the_timeline_is_a_png(tmp_path: Path) -> None:
    # With the crash and both heals: each replacement is marked.
    run = _healed_run()
    logs = load_run_from(run)

    path = render_timeline(logs.events, logs.supervisor, tmp_path / "timeline.png")

    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000


def test_the_timeline_draws_a_broken_history_instead_of_failing(tmp_path: Path) -> None:
    run = _Run()
    run.start()
    run.train(1)
    run.train(3)
    logs = load_run_from(run)

    path = render_timeline(logs.events, (), tmp_path / "broken.png")

    assert path.read_bytes().startswith(b"\x89PNG")


def test_the_timeline_of_an_empty_log_is_still_drawn(tmp_path: Path) -> None:
    path = render_timeline(parse_events([]), [SupervisorEvent("crash", 5.0)], tmp_path / "e.png")

    assert path.read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------------- live progress


def test_the_tail_reads_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read_new() == []
    path.write_text('{"a": 1}\n{"b": 2}\n{"c"')

    assert tail.read_new() == [{"a": 1}, {"b": 2}]
    with path.open("a") as handle:
        handle.write(": 3}\n")
    assert tail.read_new() == [{"c": 3}]
    assert tail.read_new() == []


def _with_a_fault_window(run: _Run, after_step: int = 4) -> list[dict[str, Any]]:
    """The run's events with the first trainer's window 1 logged after ``after_step``."""
    events = []
    for event in run.events:
        events.append(event)
        if event["type"] == "train_step" and (event["incarnation"], event["step"]) == (
            1,
            after_step,
        ):
            events.append({"t": event["t"], "type": FAULT_WINDOW, "incarnation": 1, "n": 1})
    return events


def test_the_crash_is_due_when_the_first_trainer_holds_its_first_fault_window() -> None:
    state = ProgressState(total_steps=10)
    due_at = None
    for event in _with_a_fault_window(_good_run()):
        state.apply(event)
        if state.crash_due():
            due_at = event
            break

    assert due_at is not None and due_at["type"] == FAULT_WINDOW
    assert state.step == 4


def test_the_crash_is_never_due_without_a_fault_window() -> None:
    """A published snapshot, rollouts in flight, half the steps done: the supervisor no
    longer judges that from the log it reads late; the trainer's window says it."""
    state = ProgressState(total_steps=10)
    for event in _good_run().events:
        state.apply(event)
        assert not state.crash_due()


def test_the_crash_is_due_once_and_never_in_a_later_incarnation() -> None:
    state = ProgressState(total_steps=10)
    run = _good_run()
    events = _with_a_fault_window(run)
    # A second window 1, logged by the restored trainer: not the planned crash's.
    restored_start = next(e for e in events if e["type"] == "start" and e["incarnation"] == 2)
    events.insert(
        events.index(restored_start) + 1,
        {"t": restored_start["t"], "type": FAULT_WINDOW, "incarnation": 2, "n": 1},
    )
    fired = 0
    for event in events:
        if event["incarnation"] == 2 and state.crashed_at_step is None:
            state.note_crash()
            state.note_restart()
        state.apply(event)
        if state.crash_due():
            fired += 1
            state.note_crash()
    assert fired == 1


def test_a_malformed_fault_window_is_counted_not_raised() -> None:
    state = ProgressState(total_steps=10)
    state.apply({"t": 1.0, "type": FAULT_WINDOW, "incarnation": 1, "n": "one"})
    assert state.unreadable == 1 and not state.crash_due()


def test_no_crash_is_due_with_no_crash() -> None:
    state = ProgressState(total_steps=10, crash_planned=False)
    for event in _with_a_fault_window(_good_run()):
        state.apply(event)
        assert not state.crash_due()
    assert state.crash_status == "off (--no-crash)"


def test_a_malformed_event_does_not_stop_the_live_view() -> None:
    state = ProgressState(total_steps=10)
    state.apply({"type": "progress", "t": 1.0, "incarnation": 1, "step": "x"})
    assert state.unreadable == 1
    assert "step 0/10" in state.line()


@pytest.mark.parametrize("restore_first", [False, True])
def test_the_phase_is_training_once_a_restored_trainer_runs(restore_first: bool) -> None:
    run = _Run()
    run.incarnation = 1
    restore = {"checkpoint_id": "ck-1", "resumed_from_turn": 1, "rerun_from_prompt": 0,
               "groups_retried_whole": 0, "seconds": 0.1}  # fmt: skip
    if restore_first:
        run.emit("restore", **restore)
        run.emit("start", restored_from="ck-1", step=1)
    else:
        run.emit("start", restored_from="ck-1", step=1)
        state = ProgressState(total_steps=3)
        state.apply(run.events[0])
        assert state.phase == "restoring"
        run.emit("restore", **restore)
    state = ProgressState(total_steps=3)
    for event in run.events:
        state.apply(event)

    assert state.phase == "training"
    assert state.restored_from == "ck-1"


def test_rollouts_logged_again_after_a_restore_are_counted_once() -> None:
    run = _good_run()
    again = [dict(e, incarnation=2) for e in run.events if e["type"] == "rollout"][:3]
    state = ProgressState(total_steps=STEPS)
    for event in [*run.events, *again]:
        state.apply(event)

    assert state.rollouts == len(
        {(e["rollout_id"], e["attempt"]) for e in run.events if e["type"] == "rollout"}
    )


def test_progress_state_reflects_the_run() -> None:
    state = ProgressState(total_steps=STEPS)
    for event in _good_run().events:
        state.apply(event)

    assert (state.step, state.done, state.published, state.failed) == (STEPS, True, 2, 1)
    assert state.incarnation == 2
    assert state.restored_from == "ckpt-0004"
    assert state.phase == "done"


def test_verifier_entries_are_typed() -> None:
    entries = parse_verifier_entries(
        [{"verifier": "tools", "rollout_id": "r", "attempt": 2, "reward": 1}]
    )
    assert entries == [VerifierEntry("tools", "r", 2, 1.0)]
    assert dataclasses.astuple(entries[0]) == ("tools", "r", 2, 1.0, None)


def test_the_plain_display_prints_on_an_interval_and_on_every_phase_change() -> None:
    from turnpoint.apps.demo._progress import PlainDisplay

    buffer = io.StringIO()
    display = PlainDisplay(Console(file=buffer, width=300), interval_s=5.0)
    state = ProgressState(total_steps=10)
    display.update(state, now=0.0)
    display.update(state, now=1.0)  # too soon, same phase: nothing
    state.note_crash()
    display.update(state, now=2.0)  # the phase changed: printed at once
    display.update(state, now=7.5)  # the interval passed

    lines = buffer.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("demo: starting participants; step 0/10")
    assert lines[1].startswith("demo: crashed: restarting participants;")


def test_the_live_table_shows_the_state() -> None:
    state = ProgressState(total_steps=STEPS)
    for event in _good_run().events:
        state.apply(event)
    buffer = io.StringIO()

    Console(file=buffer, width=120).print(state.table())

    text = buffer.getvalue()
    assert f"{STEPS} / {STEPS} (trainer incarnation 2)" in text
    assert "2 published, 1 failed" in text


# ---------------------------------------------------------------------- the token audit

EOS = 1


class _TokenRun(_Run):
    """A run whose train steps carry their turns and whose policy logs its generations.

    One token per call site keeps the figures countable: every rollout has one turn,
    prompt ``[2, group, sibling]`` and completion ``[3 + sibling, EOS]``, unless a test
    says otherwise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.generations: list[dict[str, Any]] = []

    def generate(
        self,
        rollout_id: str,
        attempt: int,
        prompt: list[int],
        tokens: list[int],
        *,
        finished: bool = True,
    ) -> dict[str, Any]:
        t_start = self.tick(0.01)
        entry = {
            "policy": "policy",
            "request_id": f"policy-{len(self.generations) + 1}",
            "rollout_id": rollout_id,
            "attempt": attempt,
            "prompt": prompt,
            "tokens": tokens,
            "finished": finished,
            "t_start": t_start,
            "t_end": self.tick(0.01),
        }
        self.generations.append(entry)
        return entry

    def trained_step(
        self,
        step: int,
        groups: list[int],
        *,
        attempt: int = 0,
        completions: dict[str, list[int]] | None = None,
        resumed: bool = False,
        generate: bool = True,
    ) -> None:
        """Generate (unless told not to), record and train ``groups`` as one step."""
        completions = completions or {}
        samples = []
        for group in groups:
            for sibling in range(GROUP_SIZE):
                rollout_id = f"g{group}-s{sibling}"
                prompt = [2, group, sibling]
                completion = completions.get(rollout_id, [3 + sibling, EOS])
                if generate and rollout_id not in completions:
                    self.generate(rollout_id, attempt, prompt, completion)
                reward = round(0.1 * sibling + 0.01 * group, 6)
                self.verifier.append(
                    {
                        "verifier": "tools",
                        "rollout_id": rollout_id,
                        "attempt": attempt,
                        "reward": reward,
                    }
                )
                self.emit(
                    "rollout",
                    rollout_id=rollout_id,
                    attempt=attempt,
                    group=group,
                    sibling=sibling,
                    environment="guess",
                    reward=reward,
                    resumed=resumed,
                    turns=1,
                )
                samples.append(
                    {
                        "rollout_id": rollout_id,
                        "attempt": attempt,
                        "reward": reward,
                        "turns": [{"prompt": prompt, "completion": completion}],
                    }
                )
        self.emit(
            "train_step",
            step=step,
            groups=groups,
            rollouts=samples,
            mean_reward=sum(s["reward"] for s in samples) / len(samples),
        )

    def write(self, out: Path) -> Path:
        super().write(out)
        (out / "generations-policy.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in self.generations)
        )
        return out


def _token_run(*, continue_after_restore: bool = True) -> _TokenRun:
    """Step 1 with a cut continued on resume; a snapshot that cuts g2-s0; a crash after
    it lost g2-s0's continuation; the restore continues the cut as attempt 1.

    Token figures: step 1 trains 8 rollouts x 2 tokens, one of them (g0-s0) streamed as
    a cut of 1 token and a continuation of 1. Before the snapshot, attempt 0 of groups
    2-3 streams 2 tokens a rollout except g2-s0 (14, superseded: attempt 1 streams them
    again); the snapshot cuts g2-s0 at 2 tokens (trained), whose continuation of 2 the
    crash loses (discarded by the restore). Attempt 1 streams 14 tokens again and
    continues g2-s0's cut prefix with 2 more: 34 trained of 50 streamed.
    """
    run = _TokenRun()
    run.start()
    # g0-s0: cut at a snapshot that was aborted, then continued on resume.
    run.generate("g0-s0", 0, [2, 0, 0], [3], finished=False)
    run.generate("g0-s0", 0, [2, 0, 0, 3], [EOS])
    run.trained_step(1, [0, 1], completions={"g0-s0": [3, EOS]})
    # Attempt 0 of groups 2 and 3, in flight at the snapshot.
    for group in (2, 3):
        for sibling in range(GROUP_SIZE):
            if (group, sibling) != (2, 0):
                run.generate(f"g{group}-s{sibling}", 0, [2, group, sibling], [3 + sibling, EOS])
    t_start = run.tick()
    run.generate("g2-s0", 0, [2, 2, 0], [3, 4], finished=False)  # cut by the snapshot
    t_end = run.tick(0.2)
    run.emit(
        "snapshot",
        checkpoint_id="ckpt-0001",
        outcome="published",
        reason=None,
        t_start=t_start,
        t_end=t_end,
        admission_closed_s=0.1,
        phases={},
        continued=1,
        restarts=0,
    )
    run.generate("g2-s0", 0, [2, 2, 0, 3, 4], [5, EOS])  # after the snapshot: lost
    run.crash()
    run.start(step=1, restored_from="ckpt-0001")
    run.restore("ckpt-0001")
    if continue_after_restore:
        run.generate("g2-s0", 1, [2, 2, 0, 3, 4], [6, EOS])
        g2s0 = [3, 4, 6, EOS]
    else:  # the bug: attempt 1 starts the turn again from its prompt
        run.generate("g2-s0", 1, [2, 2, 0], [3, 4, 6, EOS])
        g2s0 = [3, 4, 6, EOS]
    run.trained_step(2, [2, 3], attempt=1, completions={"g2-s0": g2s0}, resumed=True)
    run.done(2)
    return run


def _token_audit(run: _TokenRun) -> Any:
    return audit(
        parse_events(run.events),
        parse_verifier_entries(run.verifier),
        group_size=GROUP_SIZE,
        generations=parse_generation_entries(run.generations),
    )


def test_every_trained_token_was_streamed_once_and_the_rest_was_lost_to_the_restore() -> None:
    result = _token_audit(_token_run())

    assert result.passed, result.reason
    assert result.tokens == TokenAudit(
        generated=16 + 18 + 16,
        trained=16 + 18,
        cut_continued=1 + 2,
        cuts=2,
        discarded_by_restores=2,
        superseded=14,
        retried=0,
        not_trained=0,
    )
    assert result.tokens.line == (
        "tokens: 50 generated, 34 trained (each exactly once), 3 cut and continued (2 cuts), "
        "2 discarded by restores, 14 of superseded attempts, 0 of turns retried within "
        "their attempt, 0 of rollouts not trained"
    )


def test_a_cut_prefix_trained_twice_fails() -> None:
    run = _token_run()
    # g0-s0's trajectory holds its cut prefix twice: the second copy was never streamed.
    sample = _train_step(run, 1, 1)["rollouts"][0]
    sample["turns"] = [{"prompt": [2, 0, 0], "completion": [3, 3, EOS]}]

    result = _token_audit(run)

    assert not result.passed
    assert result.reason is not None
    assert result.reason.startswith(
        "token 1 of turn 0 of rollout g0-s0 attempt 0 (trained in step 1) was never streamed"
    ), result.reason


def test_the_same_turn_trained_twice_in_one_trajectory_fails() -> None:
    run = _token_run()
    sample = _train_step(run, 1, 1)["rollouts"][1]
    sample["turns"] = [*sample["turns"], *sample["turns"]]

    result = _token_audit(run)

    assert not result.passed
    assert result.reason is not None and "trained twice" in result.reason, result.reason


def test_a_cut_prefix_regenerated_on_resume_fails() -> None:
    run = _token_run()
    # After g0-s0's cut the agent starts the turn again instead of continuing it: the
    # trained tokens are all streamed once, but the cut prefix was streamed twice.
    index = next(i for i, g in enumerate(run.generations) if g["prompt"] == [2, 0, 0, 3])
    regenerated = dict(run.generations[index], prompt=[2, 0, 0], tokens=[3, EOS])
    run.generations[index] = regenerated

    result = _token_audit(run)

    assert not result.passed
    assert result.reason == (
        "generation policy-1 of rollout g0-s0 attempt 0 (1 tokens) was streamed but never "
        "trained: its cut prefix was generated again by generation policy-2, trained in "
        "turn 0 of rollout g0-s0 attempt 0 (trained in step 1)"
    )


def test_a_cut_prefix_regenerated_after_the_restore_fails() -> None:
    result = _token_audit(_token_run(continue_after_restore=False))

    assert not result.passed
    assert result.reason is not None
    assert "saved by snapshot ckpt-0001 but attempt 1, resumed from it, did not continue it" in (
        result.reason
    ), result.reason


def test_a_trained_token_the_policy_never_streamed_fails() -> None:
    run = _token_run()
    sample = _train_step(run, 1, 1)["rollouts"][2]
    sample["turns"] = [{"prompt": sample["turns"][0]["prompt"], "completion": [9, EOS]}]

    result = _token_audit(run)

    assert not result.passed
    assert result.reason == (
        "token 0 of turn 0 of rollout g0-s2 attempt 0 (trained in step 1) was never "
        "streamed by the policy: no generation of that rollout asked with the turn's "
        "prompt plus the 0 tokens before it streamed the tokens trained there"
    )


def test_without_generations_or_turns_the_token_audit_does_not_run() -> None:
    run = _token_run()
    assert (
        audit(
            parse_events(run.events), parse_verifier_entries(run.verifier), group_size=GROUP_SIZE
        ).tokens
        is None
    )
    assert _audit(_good_run()).tokens is None


def test_the_report_prints_the_tokens_line_before_the_audit(tmp_path: Path) -> None:
    run = _token_run()
    report = build_report(load_run(run.write(tmp_path / "out")), group_size=GROUP_SIZE)
    console = Console(file=io.StringIO(), width=200)

    render_report(report, console)

    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert lines[-1] == "audit: passed"
    assert lines[-2].startswith("tokens: 50 generated, 34 trained (each exactly once)")


def test_a_finished_turn_asked_again_within_its_attempt_counts_as_retried() -> None:
    run = _token_run()
    # g1-s2's turn was asked again after a lost reply, streaming the same tokens: one
    # copy is trained, the other is counted, not trained twice.
    first = next(g for g in run.generations if g["rollout_id"] == "g1-s2")
    run.generations.append(
        dict(first, request_id="policy-again", t_start=first["t_end"], t_end=first["t_end"] + 0.01)
    )

    result = _token_audit(run)

    assert result.passed, result.reason
    assert result.tokens is not None
    assert (result.tokens.retried, result.tokens.trained) == (2, 34)


def test_a_trained_cut_prefix_streamed_again_fails() -> None:
    run = _token_run()
    # After g0-s0's cut (trained, and continued), the turn is asked again from its
    # prompt and streams the prefix again (and more), which is then thrown away.
    cut = next(g for g in run.generations if g["rollout_id"] == "g0-s0" and not g["finished"])
    run.generations.append(
        dict(
            cut,
            request_id="policy-again",
            tokens=[3, 7, EOS],
            finished=True,
            t_start=cut["t_end"] + 0.001,
            t_end=cut["t_end"] + 0.002,
        )
    )

    result = _token_audit(run)

    assert not result.passed
    assert result.reason == (
        "generation policy-again of rollout g0-s0 attempt 0 streamed again the cut prefix of "
        "generation policy-1, which training took in turn 0 of rollout g0-s0 attempt 0 "
        "(trained in step 1)"
    )
