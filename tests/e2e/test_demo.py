"""The main job end to end: ``turnpoint demo`` as a user runs it, crashes and all.

Every test runs the real command in a subprocess (``python -m turnpoint.apps._cli demo``):
real ``turnpoint serve`` participants (or Ray actors), the real trainer with torch, a
real crash (SIGKILL of the trainer and one agent), a job restart and a restore. Each
asserts what a user relies on: exit status 0, ``audit: passed`` (every prompt group
trained exactly once, with the rewards the verifiers returned) and a timeline PNG.

The kill points go further, from the logs: the restore picks the newest *published*
snapshot (the one being taken only once its manifest is linked, never a half-written
one), and the rollouts it cut continue as attempt N+1 from their saved turns. One run
covers them all: ``--crash-at`` lists every point as ``POINT:2``, trainer k dies at the
k-th and trainer k+1 restores. ``:2`` counts the snapshots of that trainer that cut
rollouts in flight (see :mod:`turnpoint.apps.demo._kill_switch`), so there is always an
earlier one to fall back to and always saved turns to continue; and a restored trainer
dies only once a rollout its restore continued has finished, so every restore shows it.

Runs are short on purpose (eight steps, a fifth of a second between snapshots, two
agents): most of each run is the participants' and the trainer's start-up, twice.
"""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.demo import DEMO, SHORT
from turnpoint.apps.demo._kill_switch import KillPoint
from turnpoint.apps.demo._supervisor import CRASH_POINTS
from turnpoint.ids import checkpoint_sequence
from turnpoint.trainer.snapshots.driver import EPOCH_STRIDE
from turnpoint.trainer.status.history import HISTORY_FILE, CheckpointHistory
from turnpoint.trainer.status.log import read_history

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 240.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Run:
    out: Path
    stdout: str
    events: list[dict[str, Any]]
    supervisor: list[dict[str, Any]]

    def of(self, kind: str, incarnation: int | None = None) -> list[dict[str, Any]]:
        return [
            event
            for event in self.events
            if event["type"] == kind and incarnation in (None, event["incarnation"])
        ]

    def only(self, kind: str, incarnation: int | None = None) -> dict[str, Any]:
        found = self.of(kind, incarnation)
        assert len(found) == 1, f"expected one {kind} event, got {found}"
        return found[0]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _demo(
    out: Path, *flags: str, timeout_s: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DEMO, *flags, "--out", str(out)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _trainer_logs(out: Path) -> str:
    logs = sorted((out / "logs").glob("trainer.*.stderr")) if (out / "logs").is_dir() else []
    return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in logs)


def run_demo(out: Path, *flags: str, timeout_s: float = RUN_TIMEOUT_S) -> Run:
    """Run the demo; assert exit 0, the audit line and the timeline PNG."""
    result = _demo(out, *SHORT, *flags, timeout_s=timeout_s)
    context = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\n{_trainer_logs(out)}"
    assert result.returncode == 0, context
    assert "audit: passed" in result.stdout.splitlines(), context
    # The token audit ran: every trained token streamed once by the policy, none twice
    # (docs/spec.md section 5.5 item 8).
    tokens = [line for line in result.stdout.splitlines() if line.startswith("tokens: ")]
    assert len(tokens) == 1 and " trained (each exactly once)" in tokens[0], context
    assert (out / "timeline.png").read_bytes()[: len(PNG_SIGNATURE)] == PNG_SIGNATURE
    return Run(out, result.stdout, _jsonl(out / "events.jsonl"), _jsonl(out / "supervisor.jsonl"))


def published(run: Run, incarnation: int) -> list[str]:
    return [
        event["checkpoint_id"]
        for event in run.of("snapshot", incarnation)
        if event["outcome"] == "published"
    ]


def assert_restored_the_newest_published(run: Run) -> None:
    """After the timed crash: the crash lands once a snapshot of the first trainer was
    published; the next one may have linked its manifest before the kill landed, and is
    then the newest published one."""
    restored = run.only("restore", 2)["checkpoint_id"]
    last = published(run, 1)[-1]
    assert checkpoint_sequence(restored) >= checkpoint_sequence(last)
    assert checkpoint_sequence(restored) < 2 * EPOCH_STRIDE, "not a snapshot of the first trainer"


def assert_restored_and_continued(
    run: Run, checkpoint_id: str, incarnation: int = 2
) -> dict[str, Any]:
    """``incarnation`` (the one after the crash) restored ``checkpoint_id`` and continued
    its cut rollouts as N+1."""
    restore = run.only("restore", incarnation)
    assert restore["checkpoint_id"] == checkpoint_id
    assert run.only("start", incarnation)["restored_from"] == checkpoint_id
    assert restore["resumed_from_turn"] > 0, restore
    continued = [event for event in run.of("rollout", incarnation) if event["resumed"]]
    assert continued, f"no restored rollout finished in incarnation {incarnation}"
    # Attempt N was cut by the crash; only N+1 may finish (and be trained on) after it.
    assert all(event["attempt"] >= 1 for event in continued), continued
    return restore


# ---------------------------------------------------------------------- the timed crash


def test_the_short_demo_crashes_restores_and_passes_the_audit(tmp_path: Path) -> None:
    run = run_demo(tmp_path / "out")

    # Better than before healing in place (docs/spec.md section 7.15): the agent is lost
    # first and replaced alone; the trainer's SIGKILL later restarts the trainer alone,
    # which restores into the participants where they run (section 4.16).
    crash = next(event for event in run.supervisor if event["type"] == "crash")
    assert crash["incarnation"] == 1 and crash["killed"] == ["trainer"]
    restart = next(event for event in run.supervisor if event["type"] == "restart")
    assert restart["participants_restarted"] == 0
    assert [event["type"] for event in run.supervisor] == [
        "agent_lost",
        "replaced",
        "crash",
        "restart",
    ]
    assert_the_lost_agent_was_healed_in_place(run)
    assert_restored_the_newest_published(run)
    assert run.only("done", 2)["step"] == 8
    # docs/spec.md section 6.12: every trained turn's tool call applied once, through
    # the crash; those re-sent after the restore answered from the session's record.
    tools = [line for line in run.stdout.splitlines() if line.startswith("tool calls: ")]
    assert len(tools) == 1 and ", each once; " in tools[0], run.stdout
    assert int(tools[0].split()[2]) > 0, tools[0]
    assert_the_status_history_shows_the_crash_and_every_snapshot(run)
    assert_the_run_had_two_tokens(run)


def assert_the_run_had_two_tokens(run: Run) -> None:
    """docs/spec.md section 10.2 item 6: a control token (the trainer's) and a distinct
    data-plane token, both owner-only; the agents trained through the crash calling their
    peers with the data-plane one (tests/integration/test_demo_supervisor.py reads a live
    agent's argv and environment: no control token there)."""
    control, data = run.out / "token", run.out / "data-token"
    assert stat.S_IMODE(control.stat().st_mode) == stat.S_IMODE(data.stat().st_mode) == 0o600
    assert data.read_text().strip() not in ("", control.read_text().strip())


def assert_the_lost_agent_was_healed_in_place(run: Run) -> None:
    """The agent fault cost no job restart: the first trainer asked the supervisor for a
    replacement under the same name, restored what depended on it (at most what ran
    then) and trained on; the report counts it apart from the job restarts."""
    lost, replaced = run.supervisor[0], run.supervisor[1]
    assert replaced["instance"] == lost["instance"] and replaced["incarnation"] == 1
    heal = run.only("heal")
    assert (heal["incarnation"], heal["lost"]) == (1, lost["instance"])
    assert heal["continued"] + heal["rerun"] <= heal["running"], heal
    assert run.of("train_step", 1)[-1]["t"] > heal["t"], "the first trainer trained on"
    assert "participants replaced  │ 1" in run.stdout
    assert "crashes / job restarts │ 1 / 0" in run.stdout
    assert "trainer restarts       │ 1 (participants restarted: 0)" in run.stdout
    # Each participant process started once, the lost agent's replacement aside: the
    # trainer's restart restarted none.
    started = sorted(
        path.name.removesuffix(".stderr")
        for path in (run.out / "logs").glob("*.stderr")
        if not path.name.startswith("trainer.")
    )
    assert started == sorted(
        {name.rsplit(".", 1)[0] + ".1" for name in started} | {f"{lost['instance']}.2"}
    ), started


def assert_the_status_history_shows_the_crash_and_every_snapshot(run: Run) -> None:
    """docs/spec.md section 7.13.5: the page's address was printed at start, and the
    history both trainers kept (what the page shows) holds every snapshot of both and
    the second trainer's restore of what the first published."""
    assert "status page: http://127.0.0.1:" in run.stdout
    history = CheckpointHistory(wall_offset_s=0.0, epoch=3)
    history.load_past(read_history(run.out / "snapshots" / HISTORY_FILE))
    rows = {row["checkpoint_id"]: row for row in history.rows_json(now=0.0)}
    for incarnation in (1, 2):
        for checkpoint_id in published(run, incarnation):
            assert rows[checkpoint_id]["status"] == "published", rows.get(checkpoint_id)
            assert rows[checkpoint_id]["epoch"] == incarnation
    events = [(e["kind"], e["epoch"]) for e in history.events_json()]  # type: ignore[index]
    # The first trainer's heal of the lost agent, its crash, the second's restore and
    # its clean close.
    assert events == [
        ("fresh_start", 1),
        ("participant_replaced", 1),
        ("trainer_ended", 1),
        ("restore", 2),
        ("trainer_closed", 2),
    ]
    restore = next(e for e in history.events_json() if e["kind"] == "restore")  # type: ignore[index]
    assert restore["checkpoint_id"] == run.only("restore", 2)["checkpoint_id"]  # type: ignore[index]


@pytest.mark.parametrize("environment", ["blackjack", "workplace"])
def test_each_environment_trains_through_its_crash_and_passes_the_audit(
    tmp_path: Path, environment: str
) -> None:
    """Issue 28: the play agent on Blackjack and on the workplace, one resources server of
    exported sessions each, through a crash and the restore. The short run with one
    agent; the crash is the deterministic one, right after the first
    snapshot that cut rollouts in flight was published, so their sessions continue."""
    flags = ("--env", environment, "--agents", "1")
    run = run_demo(tmp_path / "out", *flags, "--crash-at", "published:1")

    assert [event["type"] for event in run.supervisor] == ["crash", "restart"]
    assert_restored_and_continued(run, run.only("kill")["checkpoint_id"])
    assert {event["environment"] for event in run.of("rollout")} == {environment}
    assert run.only("done", 2)["step"] == 8
    # docs/spec.md section 6.12: the audit of effects covers these servers too; every
    # trained rollout's tool calls were applied once, with the reply training took.
    tools = [line for line in run.stdout.splitlines() if line.startswith("tool calls: ")]
    assert len(tools) == 1 and ", each once; " in tools[0], run.stdout
    assert int(tools[0].split()[2]) > 0 and "not audited" not in tools[0], tools[0]


def test_coding_in_sandboxes_trains_through_its_crash_and_every_restored_tree_is_its_cut(
    tmp_path: Path,
) -> None:
    """Issue 25: the coding environment, each episode a sandbox exported as its snapshot
    handle, through the crash right after the first snapshot that cut rollouts in
    flight. The audit checks every restored sandbox's tree against its digest at the cut,
    and (the tool-call audit) that no turn's command was applied twice. Four steps: the
    crash and restore are in the first two."""
    flags = ("--env", "coding", "--agents", "1", "--steps", "4")
    run = run_demo(tmp_path / "out", *flags, "--crash-at", "published:1")

    assert [event["type"] for event in run.supervisor] == ["crash", "restart"]
    assert_restored_and_continued(run, run.only("kill")["checkpoint_id"])
    lines = run.stdout.splitlines()
    [sandboxes] = [line for line in lines if line.startswith("sandboxes: ")]
    assert int(sandboxes.split()[1]) >= 1, sandboxes
    # Processes are restart-only, and the report says why (CRIU was tried).
    assert "; processes restart_only (criu " in sandboxes, sandboxes
    assert any(line.startswith("tool calls: ") for line in lines)
    assert run.only("done", 2)["step"] == 4


def test_long_generations_cut_at_each_snapshot_pass_the_token_audit(tmp_path: Path) -> None:
    """docs/spec.md section 5.5: the policy cuts generations at every snapshot, the agents
    continue them, and the token audit finds each cut prefix trained once, never
    streamed again."""
    run = run_demo(
        tmp_path / "out", "--token-delay", "0.02", "--cut-generations", "--target-level", "token"
    )

    line = next(line for line in run.stdout.splitlines() if line.startswith("tokens: "))
    generated, trained = (int(word) for word in line.split()[1:5:2])
    assert 0 < trained <= generated, line
    streamed = _jsonl(run.out / "generations-policy.jsonl")
    assert sum(len(entry["tokens"]) for entry in streamed) == generated


def test_an_agent_of_two_workers_crashes_restores_and_passes_the_audit(tmp_path: Path) -> None:
    """docs/spec.md section 3.9: the agent server is two worker processes behind one
    port; the trainer, given the server's shared address, finds the workers and runs
    rollouts on each as an agent of its own, through the crash of the whole server. One
    server of two workers: as many agents as the short run's two servers, fewer
    processes to start on a loaded machine."""
    run = run_demo(tmp_path / "out", "--agents", "1", "--agent-workers", "2")

    assert [event["type"] for event in run.supervisor] == ["crash", "restart"]
    assert_restored_the_newest_published(run)
    # The restore addressed the workers by their stable names, each its own participant.
    restored_on = set(run.only("restore", 2)["by_instance"])
    workers = {"agent-0-w0", "agent-0-w1"}
    # SHORT's turn delay leaves rollouts in flight at every snapshot, the restored too.
    assert restored_on and restored_on <= workers, restored_on


@pytest.mark.timeout(420)
def test_the_demo_on_a_local_ray_cluster(tmp_path: Path) -> None:
    run = run_demo(tmp_path / "out", "--ray", timeout_s=400.0)

    assert "starting participants (Ray actors)" in run.stdout
    assert [event["type"] for event in run.supervisor] == ["crash", "restart"]
    assert_restored_the_newest_published(run)
    # The actors served the data-plane token beside the control one: the agents called
    # their peers with it all through the run (docs/spec.md section 10.2 item 6).
    assert_the_run_had_two_tokens(run)


# ---------------------------------------------------------------------- kill points


def test_the_supervisor_knows_every_kill_point_of_the_trainer() -> None:
    assert tuple(point.value for point in KillPoint) == CRASH_POINTS
    assert len(CRASH_POINTS) >= 10


# Every point in one run: trainer k dies at the k-th point of its own second snapshot that
# cut rollouts, and trainer k+1 restores and is the next to die. Each of the 15 kills costs
# a trainer restart (the participants keep running, the next trainer imported meanwhile)
# and a step or two of the run (20 for all of them on a loaded 2-core machine); the last
# trainer trains what is left, so that a faster machine still has steps for every kill.
KILL_POINT_STEPS = 60


@pytest.mark.timeout(660)
def test_a_kill_at_each_point_restores_the_last_published_snapshot(tmp_path: Path) -> None:
    points = list(KillPoint)
    plan = ",".join(f"{point.value}:2" for point in points)
    run = run_demo(
        tmp_path / "out", "--steps", str(KILL_POINT_STEPS), "--crash-at", plan, timeout_s=600.0
    )

    assert [event["type"] for event in run.supervisor] == ["crash", "restart"] * len(points)
    for incarnation, point in enumerate(points, start=1):
        crash, restart = run.supervisor[2 * incarnation - 2 : 2 * incarnation]
        assert_killed_at(run, point, incarnation, crash, restart)
    assert run.only("done", len(points) + 1)["step"] == KILL_POINT_STEPS


def assert_killed_at(
    run: Run, point: KillPoint, incarnation: int, crash: dict[str, Any], restart: dict[str, Any]
) -> None:
    """Trainer ``incarnation`` died at ``point`` of its second snapshot that cut rollouts,
    and the next one restored the newest published snapshot and continued its rollouts."""
    kill = run.only("kill", incarnation)
    assert kill["point"] == point.value and kill["nth"] == 2, kill
    killed = kill["checkpoint_id"]
    assert crash["incarnation"] == incarnation, crash
    assert (crash["point"], crash["checkpoint_id"]) == (point.value, killed)
    # Better than before (docs/spec.md section 7.11 item 3): the trainer alone restarted,
    # restoring into the participants where they ran, whatever the killed attempt left
    # open on them (section 7.7 item 6).
    assert crash["killed"] == ["trainer"] and restart["participants_restarted"] == 0
    assert restart["incarnation"] == incarnation + 1, restart
    before = published(run, incarnation)
    # The trainer died inside the killed attempt: it never reported it.
    assert before and killed not in before, (point, before)
    if point.restores_this_snapshot:
        # Its manifest was linked: published, complete and the newest.
        expected = killed
    else:
        # Half-written at most: the restore falls back to the last published one, which
        # cut rollouts in flight.
        expected = before[-1]
        last = next(e for e in run.of("snapshot", incarnation) if e["checkpoint_id"] == expected)
        assert last["continued"] > 0, last
        # The partial is cleaned up after the next publication (the next trainer
        # published one before its own kill, or ran to the end).
        assert published(run, incarnation + 1)
        assert not (run.out / "snapshots" / killed).exists(), point
    assert kill["newest_published"] == expected, (point, kill)
    assert_restored_and_continued(run, expected, incarnation + 1)


def test_the_demo_on_an_object_store_crashes_half_way_through_a_publication(
    tmp_path: Path,
) -> None:
    """docs/spec.md sections 8.12-8.13: ``--storage s3`` runs every snapshot on an S3
    server on loopback. The trainer dies with every object of its second cutting
    snapshot in the store and no manifest: the restore, on fresh participants that have
    only the URL and the environment, falls back to the last published snapshot and
    continues its cut rollouts; nothing of the snapshots is on local disk."""
    point = KillPoint.MANIFEST_STAGED
    run = run_demo(tmp_path / "out", "--storage", "s3", "--crash-at", f"{point.value}:2")

    kill = run.only("kill")
    before = published(run, 1)
    assert kill["checkpoint_id"] not in before and kill["newest_published"] == before[-1]
    assert_restored_and_continued(run, before[-1])
    assert published(run, 2), "the second trainer published nothing on the store"
    # The trainer is told the URL; the endpoint and credentials went through the
    # environment, never into a file.
    topology = json.loads((run.out / "topology.json").read_text())
    assert set(topology) == {"token_file", "snapshot_root", "participants"}
    assert topology["snapshot_root"].startswith("s3://")
    assert not (run.out / "snapshots").exists()


# ---------------------------------------------------------------------- bad configurations


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(
            ("--target-level", "turns"),
            "turnpoint demo: unknown --target-level 'turns' (did you mean turn?): choose one "
            "of token, turn, sibling, prompt_group",
            id="unknown-target-level",
        ),
        pytest.param(
            ("--steps", "0"), "turnpoint demo: --steps must be at least 1, got 0", id="no-steps"
        ),
        pytest.param(
            ("--crash-at", "comitted"),
            "turnpoint demo: unknown --crash-at point 'comitted' (did you mean committed?): "
            f"choose one of {', '.join(CRASH_POINTS)}",
            id="unknown-crash-point",
        ),
    ],
)
def test_a_bad_flag_fails_at_once_saying_what_to_change(
    flags: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    result = _demo(tmp_path / "out", *flags, timeout_s=60.0)

    assert result.returncode == 2
    assert result.stderr.splitlines() == [message]
    assert not (tmp_path / "out").exists()


def test_a_participant_that_never_comes_up_fails_the_demo_and_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    result = _demo(out, *SHORT, "--start-timeout", "0.01", timeout_s=120.0)

    assert result.returncode == 1, result.stdout + result.stderr
    assert "turnpoint demo: FAILED: participant policy did not start within 0.01s" in result.stdout
    assert "its stderr says" in result.stdout
    assert f"logs: {out.resolve() / 'logs'}" in result.stdout
    # The trainer never started, and no participant outlived the demo.
    assert not list((out / "logs").glob("trainer.*"))
    assert _processes_mentioning(str(out.resolve())) == []


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in command:
            found.append(command)
    return found


@pytest.mark.timeout(660)
def test_chaos_kill_and_pause_any_process_and_the_audit_still_passes(tmp_path: Path) -> None:
    """Five unplanned faults (SIGKILL and SIGSTOP of the trainer and of participants, the
    first four covering each combination): a lost participant of any kind is replaced in
    place (docs/spec.md section 7.15), a trainer fault restarts the trainer alone into the
    running participants (section 7.11 item 3): no job restart at all; and at the end
    every prompt group was trained exactly once with the verifiers' rewards."""
    faults = 5
    run = run_demo(
        tmp_path / "out",
        "--no-crash",
        "--chaos",
        str(faults),
        "--max-restarts",
        str(faults),
        # The paused trainer is found by its silence. A live one logs twice a second, and
        # it is released only once its imports are done (or nearly): a few times the
        # longest start-up silence seen on a loaded 2-core machine (3 s).
        "--stall-timeout",
        "10",
        # The restarts' backoff doubles from this: 1.55 s of pauses in all, not 15.5.
        "--restart-pause",
        "0.05",
        # Long enough that training goes on after the last fault: --seed 0's faults come
        # 4, 4, 3, 4 and 5 steps into their incarnations, each after up to a second more
        # (the fifth at about step 27 of 60 when this ran 60 steps).
        "--steps",
        "45",
        timeout_s=600.0,
    )
    injected = [e for e in run.supervisor if e["type"] == "fault"]
    assert len(injected) == faults
    kinds = {(e["victim"] == "trainer", e["signal"]) for e in injected}
    assert kinds == {(True, "SIGKILL"), (True, "SIGSTOP"), (False, "SIGKILL"), (False, "SIGSTOP")}
    crashes = [e for e in run.supervisor if e["type"] == "crash"]
    replaced = [e for e in run.supervisor if e["type"] == "replaced"]
    assert all(e["unplanned"] for e in crashes)
    # Better than before healing in place: no fault costs a job restart (before, every
    # fault did). Each fault is followed by its recovery before the next one.
    for fault, after in zip(injected, [*injected[1:], None], strict=True):
        until = after["t"] if after is not None else math.inf
        recovered = [
            e
            for e in run.supervisor
            if fault["t"] < e["t"] < until and e["type"] in ("crash", "restart", "replaced")
        ]
        if fault["victim"] != "trainer":
            assert [e["type"] for e in recovered] == ["replaced"], (fault, recovered)
            assert recovered[0]["instance"] == fault["victim"]
        else:
            # A trainer fault restarts the trainer alone, restored into the participants
            # where they run (docs/spec.md section 7.11 item 3), once a snapshot was
            # published; before that the job starts over on fresh participants.
            assert [e["type"] for e in recovered] == ["crash", "restart"], (fault, recovered)
            published_before = any(
                e["type"] == "snapshot" and e.get("outcome") == "published" and e["t"] < fault["t"]
                for e in run.events
            )
            expected = 0 if published_before else len(recovered[0]["killed"]) - 1
            assert recovered[-1]["participants_restarted"] == expected, (fault, recovered)
    assert len(crashes) + len(replaced) == faults
    # Every restart restored a published snapshot (or started over when none existed).
    restarts = [e for e in run.supervisor if e["type"] == "restart"]
    assert [e["incarnation"] for e in restarts] == list(range(2, len(restarts) + 2))
    assert run.only("done", len(restarts) + 1)["step"] == 45


TS_RESOURCES = (
    Path(__file__).resolve().parents[2] / "ts" / "dist" / "examples" / "guess-resources.js"
)


@pytest.mark.timeout(300)
def test_the_demo_with_typescript_resources_servers_trains_through_its_crash(
    tmp_path: Path,
) -> None:
    """Mixed languages: both resources servers (per-sibling and group-scored) are the
    TypeScript SDK's example, the rest Python; the crash and the restore go through the
    TypeScript participants' snapshots, and the audit passes (``./dev test`` builds
    ts/dist first)."""
    assert TS_RESOURCES.is_file(), (
        "build the TypeScript side first: cd ts && npm ci && npm run build"
    )
    command = f"node {TS_RESOURCES}"
    run = run_demo(
        tmp_path / "out",
        "--participant-command",
        f"tools={command}",
        "--participant-command",
        f"group-tools={command}",
    )
    assert_restored_the_newest_published(run)
    # The TypeScript servers serve RestoreRunning: the trainer's restart restored into
    # them where they ran, no participant restarted (docs/spec.md section 4.16).
    restart = next(event for event in run.supervisor if event["type"] == "restart")
    assert restart["participants_restarted"] == 0, run.supervisor
    # The newest snapshot names the TypeScript servers as participants; every file they
    # wrote there is one the coordinator verified before publishing it.
    snapshots = tmp_path / "out" / "snapshots"
    latest = (snapshots / "LATEST").read_text().strip()
    manifest = json.loads((snapshots / latest / "MANIFEST.json").read_text())
    entries = {entry["instance"]: entry for entry in manifest["participants"]}
    assert {"tools", "group-tools"} <= set(entries)
    for instance in ("tools", "group-tools"):
        for artifact in entries[instance]["artifacts"]:
            assert (snapshots / latest / artifact["path"]).is_file()


def test_opaque_agents_train_through_the_crash_and_every_call_is_accounted_for(
    tmp_path: Path,
) -> None:
    """Issue 26: the agents run the example ReAct harness (Node, plain fetch) behind the
    egress relay, its model calls through the policy's OpenAI endpoint and its tool
    through the relay (docs/spec.md section 12). The short run with one agent and the
    deterministic crash; the restored rollouts' harnesses are answered from the relay's
    record until the cut. The audit covers the relay: every call of every trained
    rollout has one final disposition, each trained turn is one completed model call and
    one completed tool call, each tool effect applied once."""
    flags = ("--agent", "opaque", "--agents", "1", "--steps", "4", "--crash-at", "published:2")
    run = run_demo(tmp_path / "out", *flags)

    assert [event["type"] for event in run.supervisor] == ["crash", "restart"]
    assert_restored_and_continued(run, run.only("kill")["checkpoint_id"])
    assert run.only("done", 2)["step"] == 4
    tools = [line for line in run.stdout.splitlines() if line.startswith("tool calls: ")]
    assert len(tools) == 1 and ", each once; " in tools[0], run.stdout
    egress = [line for line in run.stdout.splitlines() if line.startswith("egress: ")]
    assert len(egress) == 1 and "each with one final disposition" in egress[0], run.stdout
    # The restored harnesses followed their records: none diverged and reran. (How many
    # calls each replayed depends on where the cut fell, possibly at its first boundary,
    # before any call: tests/integration/test_opaque_agent.py cuts after every turn.)
    resumed = [event for event in run.of("rollout", 2) if event["resumed"]]
    assert resumed and all(event["egress"]["reruns"] == [] for event in resumed), resumed
