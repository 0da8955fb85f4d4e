"""The demo's supervisor: participants as processes, the crash, the job restart, the flags.

Two kinds of children. The real ``turnpoint serve`` participants are started once, to
prove the wiring (instance names, token, snapshot root, verifier logs) and the clean
SIGTERM shutdown. The crash-and-restart flow runs against stand-ins: a fake ``serve``
that binds a port and prints the serving line, and a fake trainer that follows the
trainer's contract (command line, topology, events) and waits to be killed once the
crash is due. The whole flow then takes a second instead of two real runs.
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console

from turnpoint.apps._cli import main
from turnpoint.apps._parent import PARENT_PID_ENV
from turnpoint.apps.demo._command import _with_metrics_port
from turnpoint.apps.demo._heal import ReplaceRefused
from turnpoint.apps.demo._report import DemoError
from turnpoint.apps.demo._supervisor import (
    DemoOptions,
    DemoPaths,
    Participant,
    ParticipantSpec,
    ProcessLauncher,
    ProcessParticipant,
    _Supervisor,
    prepare_out_dir,
    run_demo,
    server_specs,
    start_participants,
    stop_participants,
    trainer_command,
    write_topology,
)
from turnpoint.auth import auth_metadata, token_sha256
from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.status.history import CheckpointHistory
from turnpoint.trainer.status.server import StatusServer, StatusSources
from turnpoint.trainer.storage.layout import SnapshotLayout
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc

TIMEOUT_S = 60.0

# Binds a real port, prints the serving line `turnpoint serve` prints, exits 0 on SIGTERM.
_FAKE_SERVE = """
import signal, socket, sys
args = sys.argv[1:]
kind = args[args.index("--kind") + 1]
instance = args[args.index("--instance") + 1]
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
print(f"turnpoint: serving {kind} {instance} on 127.0.0.1:{listener.getsockname()[1]}", flush=True)
signal.sigwait([signal.SIGTERM])
sys.exit(0)
"""

# Follows the trainer's contract with made-up rollouts. The first incarnation trains
# two steps and holds its first fault window until the supervisor's word on stdin;
# given --launcher, it then watches the agents' ports as the liveness watch would, asks
# the supervisor to replace the one that went away, trains one more step and holds its
# second window; then it leaves a torn line and waits to be killed. A resumed one
# restores the step its "snapshot" recorded and finishes. FAKE_TRAINER=fail fails.
_FAKE_TRAINER = r"""
import argparse, json, os, signal, socket, sys, time
parser = argparse.ArgumentParser()
for flag in ("--topology", "--out", "--target-level"):
    parser.add_argument(flag, required=True)
for flag in ("--steps", "--group-size", "--groups-per-step", "--seed", "--incarnation",
             "--max-restarts"):
    parser.add_argument(flag, type=int, required=True)
parser.add_argument("--snapshot-interval", type=float, required=True)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--launcher")
parser.add_argument("--start-on-stdin", action="store_true")
parser.add_argument("--fault-windows", type=int, default=0)
args = parser.parse_args()
if args.start_on_stdin and not sys.stdin.readline():
    sys.exit(2)
if os.environ.get("FAKE_TRAINER") == "fail":
    print("boom: the fake trainer failed", file=sys.stderr)
    sys.exit(3)
out = args.out
log = os.path.join(out, "events.jsonl")
topology = json.load(open(args.topology))
token = open(topology["token_file"]).read().strip()
assert os.environ["TURNPOINT_TOKEN"] == token
with open(os.path.join(out, "seen-topology.jsonl"), "a") as seen:
    seen.write(json.dumps({"incarnation": args.incarnation, "resume": args.resume,
                           "argv": sys.argv[1:], "topology": topology}) + "\n")
events = open(os.path.join(out, "events.jsonl"), "a")
verifier = open(os.path.join(out, "verifier-fake.jsonl"), "a")
latest = os.path.join(topology["snapshot_root"], "FAKE_LATEST")

def emit(kind, **fields):
    events.write(json.dumps({"t": time.time(), "type": kind,
                             "incarnation": args.incarnation, **fields}) + "\n")
    events.flush()

def train(step, attempt):
    groups = [args.groups_per_step * (step - 1) + i for i in range(args.groups_per_step)]
    samples = []
    for group in groups:
        for sibling in range(args.group_size):
            rid, reward = f"g{group}-s{sibling}", (sibling + group) / 100
            verifier.write(json.dumps({"verifier": "fake", "rollout_id": rid,
                                       "attempt": attempt, "reward": reward}) + "\n")
            verifier.flush()
            emit("rollout", rollout_id=rid, attempt=attempt, group=group, sibling=sibling,
                 environment="guess", reward=reward, resumed=False, turns=2)
            samples.append({"rollout_id": rid, "attempt": attempt, "reward": reward})
    emit("train_step", step=step, groups=groups, rollouts=samples,
         mean_reward=sum(s["reward"] for s in samples) / len(samples))
    emit("progress", step=step, in_flight=3, published=0, admission_closed=False, queue=0)

def address(text):
    host, _, port = text.rpartition(":")
    return host, int(port)

def heal(step):
    lost = None
    while lost is None:  # a liveness watch: until an agent's port refuses
        for p in topology["participants"]:
            if p["kind"] != "agent":
                continue
            try:
                socket.create_connection(address(p["address"]), timeout=1).close()
            except OSError:
                lost = p["instance"]
                break
        else:
            time.sleep(0.02)
    with socket.create_connection(address(args.launcher)) as link:
        link.sendall(json.dumps({"token": token, "replace": lost}).encode() + b"\n")
        answer = json.loads(link.makefile().readline())
    assert answer["address"], answer
    emit("heal", lost=lost, participant_kind="AGENT", checkpoint_id="ckpt-1", continued=1,
         rerun=1, running=3, step=step)

restored = 0
if args.resume:
    step = restored = int(open(latest).read())
    emit("start", restored_from=f"ckpt-{step}", step=step)
    emit("restore", checkpoint_id=f"ckpt-{step}", resumed_from_turn=2, rerun_from_prompt=1,
         groups_retried_whole=0, seconds=0.1)
else:
    emit("start", restored_from=None, step=0)
    step = 0
while step < args.steps:
    step += 1
    # The step the crash cut runs again as the next attempt; later steps are new.
    train(step, 1 if args.resume and step == restored + 1 else 0)
    if step == 1 and not args.resume:
        open(latest, "w").write("1")
        emit("snapshot", checkpoint_id="ckpt-1", outcome="published", reason=None,
             t_start=time.time() - 0.2, t_end=time.time(), admission_closed_s=0.2,
             phases={"prepare": 0.1, "commit": 0.1}, continued=2, restarts=0)
    if not args.resume and step >= 2:
        assert args.fault_windows == (2 if args.launcher else 1), args.fault_windows
        emit("fault_window", n=1, step=step)
        assert sys.stdin.readline() == "go\n"
        if args.launcher:
            step += 1
            heal(step)
            train(step, 0)
            emit("fault_window", n=2, step=step)
        events.write('{"t": 1, "type": "progr')  # torn by the coming SIGKILL
        events.flush()
        signal.pause()
emit("done", step=step)
"""


def _fake_serve(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_serve.py"
    script.write_text(_FAKE_SERVE)
    return [sys.executable, str(script)]


def _fake_trainer(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_trainer.py"
    script.write_text(_FAKE_TRAINER)
    return [sys.executable, str(script)]


def _options(out: Path, **overrides: Any) -> DemoOptions:
    defaults: dict[str, Any] = {
        "steps": 4,
        "agents": 2,
        "group_size": 2,
        "groups_per_step": 2,
        "out": out,
        "progress": False,
        "start_timeout_s": TIMEOUT_S,
    }
    return DemoOptions(**{**defaults, **overrides})


class _RecordingLauncher(ProcessLauncher):
    """Keeps every participant it started, to check that none is left running."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started: list[Participant] = []

    async def start(self, spec: ParticipantSpec, generation: int) -> Any:
        participant = await super().start(spec, generation)
        self.started.append(participant)
        return participant


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------- real participants


async def test_real_participants_serve_with_the_run_token_and_stop_cleanly(tmp_path: Path) -> None:
    options = _options(tmp_path / "out", agents=1)
    paths, token = prepare_out_dir(options.out)
    launcher = ProcessLauncher(paths, start_timeout_s=TIMEOUT_S)

    participants = await start_participants(launcher, options, paths, generation=1)
    try:
        assert sorted(participants) == ["agent-0", "group-tools", "policy", "tools"]
        write_topology(paths, participants)
        topology = json.loads(paths.topology.read_text())
        assert topology["token_file"] == str(paths.token_file)
        assert topology["snapshot_root"] == str(paths.snapshots)
        assert {p["instance"]: (p["kind"], p["environment"]) for p in topology["participants"]} == {
            "policy": ("model", None),
            "tools": ("resources", "guess"),
            "group-tools": ("resources", "guess-group"),
            "agent-0": ("agent", None),
        }
        for entry in topology["participants"]:
            async with grpc.aio.insecure_channel(entry["address"]) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                described = await pb_grpc.CheckpointControlServiceStub(channel).Describe(
                    pb.DescribeRequest(), metadata=auth_metadata(token), timeout=TIMEOUT_S
                )
                assert described.instance_name == entry["instance"]
        # docs/spec.md section 10.2 item 6: the agent (code that calls out) holds the
        # control token in neither its argv nor its environment; it is given both
        # tokens by file, the data-plane one for its own calls.
        agent = participants["agent-0"]
        assert isinstance(agent, ProcessParticipant)
        proc = Path(f"/proc/{agent.pid}")
        argv = await asyncio.to_thread((proc / "cmdline").read_bytes)
        environ = b"\0" + await asyncio.to_thread((proc / "environ").read_bytes)
        assert token.encode() not in argv and token.encode() not in environ
        assert b"\0TURNPOINT_TOKEN=" not in environ and b"\0TURNPOINT_TOKEN_FILE=" not in environ
        assert f"\0--data-token-file\0{paths.data_token_file}\0".encode() in argv
        # Section 10.2 item 8: every participant has only the control token's digest.
        for participant in participants.values():
            assert isinstance(participant, ProcessParticipant)
            argv = await asyncio.to_thread(Path(f"/proc/{participant.pid}/cmdline").read_bytes)
            assert b"\0--token-file\0" not in argv
            assert f"\0--control-token-digest-file\0{paths.token_digest_file}\0".encode() in argv
    finally:
        await stop_participants(participants.values())

    assert all(p.exit_status() == 0 for p in participants.values())
    for credential in (paths.token_file, paths.data_token_file, paths.token_digest_file):
        assert stat.S_IMODE(credential.stat().st_mode) == 0o600
    assert paths.token_digest_file.read_text().strip() == token_sha256(token)
    assert sorted(p.name for p in paths.logs.iterdir()) == [
        "agent-0.1.stderr",
        "group-tools.1.stderr",
        "policy.1.stderr",
        "tools.1.stderr",
    ]


async def test_a_participant_that_exits_before_serving_fails_fast_with_its_stderr(
    tmp_path: Path,
) -> None:
    paths, _ = prepare_out_dir(tmp_path / "out")
    launcher = ProcessLauncher(paths, start_timeout_s=TIMEOUT_S)
    bogus = ParticipantSpec(instance="tools", kind="resources", example="bogus")

    with pytest.raises(DemoError) as caught:
        await launcher.start(bogus, generation=1)

    assert str(caught.value) == (
        f"participant tools did not start within {TIMEOUT_S:g}s (it exited with status 2); "
        "its stderr says:\n"
        "    turnpoint serve: no example 'bogus' for kind 'resources'; choose one of: "
        "guess, guess-group, counter, blackjack, workplace, coding"
    )


async def test_a_participant_that_never_serves_is_killed_at_the_timeout(tmp_path: Path) -> None:
    paths, _ = prepare_out_dir(tmp_path / "out")
    silent = [sys.executable, "-c", "import signal; signal.pause()"]
    launcher = ProcessLauncher(paths, start_timeout_s=0.5, serve_command=silent)

    with pytest.raises(DemoError) as caught:
        await launcher.start(ParticipantSpec(instance="policy", kind="model", example="x"), 1)

    assert str(caught.value).startswith(
        "participant policy did not start within 0.5s (it never printed its serving line); "
        "its stderr says:"
    )


async def test_when_one_participant_fails_the_others_are_stopped(tmp_path: Path) -> None:
    options = _options(tmp_path / "out")
    paths, _ = prepare_out_dir(options.out)
    fake = _fake_serve(tmp_path)
    # Every server starts except group-tools, whose command exits at once.
    failing = [
        sys.executable,
        "-c",
        "import sys; sys.exit(7) if 'group-tools' in sys.argv else exec(open(sys.argv[1]).read())",
        fake[1],
    ]
    launcher = _RecordingLauncher(paths, start_timeout_s=TIMEOUT_S, serve_command=failing)

    with pytest.raises(DemoError, match=r"participant group-tools did not start .*status 7"):
        await start_participants(launcher, options, paths, generation=1)

    assert sorted(p.spec.instance for p in launcher.started) == ["policy", "tools"]
    assert all(p.exit_status() == 0 for p in launcher.started)


# ---------------------------------------------------------------------- the run, with stand-ins


async def test_the_crash_restarts_the_job_and_the_resumed_trainer_finishes(tmp_path: Path) -> None:
    options = _options(tmp_path / "out", steps=4, seed=1)
    paths, token = prepare_out_dir(options.out)
    launcher = _RecordingLauncher(
        paths, start_timeout_s=TIMEOUT_S, serve_command=_fake_serve(tmp_path)
    )
    output = io.StringIO()

    status = await run_demo(
        options,
        paths,
        token,
        launcher,
        Console(file=output, width=200),
        trainer_program=_fake_trainer(tmp_path),
    )

    text = output.getvalue()
    assert status == 0, text
    assert text.rstrip().splitlines()[-2:] == [f"timeline: {paths.timeline}", "audit: passed"]
    assert paths.timeline.read_bytes().startswith(b"\x89PNG")

    supervisor = _read_jsonl(paths.supervisor_log)
    assert [e["type"] for e in supervisor] == ["agent_lost", "replaced", "crash", "restart"]
    # --seed 1 picks the second agent: lost first and replaced in place at the trainer's
    # request, then the trainer alone is killed (docs/spec.md section 7.15).
    assert supervisor[0]["instance"] == supervisor[1]["instance"] == "agent-1"
    assert supervisor[2]["killed"] == ["trainer"]
    assert supervisor[2]["incarnation"] == 1 and supervisor[3]["incarnation"] == 2
    assert "participants replaced  │ 1" in text
    assert "agent-1: 2 of 3 restored" in text

    # The replacement, then the trainer alone restarted into the running participants
    # (docs/spec.md section 7.11 item 3): every participant once, agent-1 once more; the
    # lost one was SIGKILLed, every other stopped cleanly at the end.
    instances = ["agent-0", "agent-1", "group-tools", "policy", "tools"]
    assert sorted(p.spec.instance for p in launcher.started) == sorted([*instances, "agent-1"])
    lost = next(p for p in launcher.started if p.spec.instance == "agent-1")
    assert lost.exit_status() == -9
    assert all(p.exit_status() == 0 for p in launcher.started if p is not lost)

    seen = _read_jsonl(paths.out / "seen-topology.jsonl")
    assert [(s["incarnation"], s["resume"]) for s in seen] == [(1, False), (2, True)]
    first, second = (
        {p["instance"]: p["address"] for p in s["topology"]["participants"]} for s in seen
    )
    assert sorted(first) == sorted(second) == instances
    # Only the replaced agent moved; the next trainer found the others where they ran.
    assert {name for name in instances if first[name] != second[name]} == {"agent-1"}
    launch_service = seen[1]["argv"][seen[1]["argv"].index("--launcher") + 1]
    assert seen[1]["argv"] == trainer_command(
        options, paths, resume=True, incarnation=2, program=(), launcher=launch_service
    )

    # The torn line the killed trainer left was cut before the next trainer appended.
    events = _read_jsonl(paths.events)
    assert [e["type"] for e in events if e["type"] in ("start", "done")] == [
        "start",
        "start",
        "done",
    ]


async def test_participants_that_never_come_up_leave_no_trainer_behind(tmp_path: Path) -> None:
    """The trainer is spawned while the participants start (its imports overlap theirs)
    and waits for the supervisor's start line: when they fail, it is killed unreleased,
    having read nothing of the run, and its empty logs go with it."""
    options = _options(tmp_path / "out")
    paths, token = prepare_out_dir(options.out)
    failing = [
        sys.executable,
        "-c",
        "import sys; sys.exit(7) if 'group-tools' in sys.argv else exec(open(sys.argv[1]).read())",
        _fake_serve(tmp_path)[1],
    ]
    launcher = _RecordingLauncher(paths, start_timeout_s=TIMEOUT_S, serve_command=failing)

    with pytest.raises(DemoError, match=r"participant group-tools did not start .*status 7"):
        await run_demo(
            options,
            paths,
            token,
            launcher,
            Console(file=io.StringIO()),
            trainer_program=_fake_trainer(tmp_path),
        )

    assert not (paths.out / "seen-topology.jsonl").exists()
    assert not list(paths.logs.glob("trainer.*"))
    assert _processes_mentioning(str(paths.out)) == []
    assert all(p.exit_status() is not None for p in launcher.started)


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


async def test_a_failing_trainer_fails_the_demo_with_its_stderr_and_stops_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_TRAINER", "fail")
    options = _options(tmp_path / "out", max_restarts=0)
    paths, token = prepare_out_dir(options.out)
    launcher = _RecordingLauncher(
        paths, start_timeout_s=TIMEOUT_S, serve_command=_fake_serve(tmp_path)
    )

    with pytest.raises(DemoError) as caught:
        await run_demo(
            options,
            paths,
            token,
            launcher,
            Console(file=io.StringIO()),
            trainer_program=_fake_trainer(tmp_path),
        )

    assert str(caught.value) == (
        "the trainer (incarnation 1) exited with status 3; its stderr ends with:\n"
        "    boom: the fake trainer failed\n"
        f"(full log: {paths.logs / 'trainer.1.stderr'})\n"
        "job restore: 0 restart(s) in the last 3600s already, the most allowed "
        "(max_restarts=0); the run ends"
    )
    assert len(launcher.started) == 5
    assert all(p.exit_status() is not None for p in launcher.started)


async def test_a_trainer_that_keeps_failing_is_restored_max_restarts_times_then_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unplanned failures are recovered within a bounded budget. A trainer that fails
    before any snapshot was published is not restarted alone (a new trainer would start
    over and send the first attempts again to participants that retired them at its
    epoch): each failure restores the job onto fresh processes."""
    monkeypatch.setenv("FAKE_TRAINER", "fail")
    options = _options(tmp_path / "out", max_restarts=2, first_restart_pause_s=0.01)
    paths, token = prepare_out_dir(options.out)
    launcher = _RecordingLauncher(
        paths, start_timeout_s=TIMEOUT_S, serve_command=_fake_serve(tmp_path)
    )

    with pytest.raises(DemoError, match=r"max_restarts=2\); the run ends") as caught:
        await run_demo(
            options,
            paths,
            token,
            launcher,
            Console(file=io.StringIO()),
            trainer_program=_fake_trainer(tmp_path),
        )

    assert "the trainer (incarnation 3) exited with status 3" in str(caught.value)
    assert len(launcher.started) == 15  # the first five, then five fresh ones twice
    assert all(p.exit_status() is not None for p in launcher.started)
    events = _read_jsonl(paths.supervisor_log)
    crashes = [e for e in events if e["type"] == "crash"]
    assert [e["incarnation"] for e in crashes] == [1, 2]
    assert all(e["unplanned"] and "exited with status 3" in e["cause"] for e in crashes)
    # The supervisor's log keeps why: the trainer's stderr tail follows the status line.
    assert all(
        "its stderr ends with:\n    boom: the fake trainer failed" in e["cause"] for e in crashes
    )
    restarts = [e for e in events if e["type"] == "restart"]
    assert [e["incarnation"] for e in restarts] == [2, 3]
    assert [e["participants_restarted"] for e in restarts] == [5, 5]
    # The backoff doubles from the first pause (--restart-pause).
    assert [e["reason"].rpartition(" after ")[2] for e in restarts] == ["0.01s", "0.02s"]


# ---------------------------------------------------------------------- flags and the out dir


def _demo(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["demo", *argv])
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--target-level", "turns"],
            "turnpoint demo: unknown --target-level 'turns' (did you mean turn?): choose one "
            "of token, turn, sibling, prompt_group",
        ),
        (["--steps", "0"], "turnpoint demo: --steps must be at least 1, got 0"),
        (
            ["--steps", "1"],
            "turnpoint demo: --crash needs --steps 2 or more (the crash lands 40-60% into the "
            "run, after a published snapshot): raise --steps or pass --no-crash",
        ),
        (
            ["--group-size", "1"],
            "turnpoint demo: --group-size must be at least 2, got 1: rewards are relative to "
            "the prompt group, so a group of one teaches nothing",
        ),
        (["--agents", "0"], "turnpoint demo: --agents must be at least 1, got 0"),
        (
            ["--restart-pause", "-1"],
            "turnpoint demo: --restart-pause must be 0 or more seconds, got -1",
        ),
        (
            ["--snapshot-interval", "0"],
            "turnpoint demo: --snapshot-interval must be a positive number of seconds, got 0",
        ),
        (
            ["--hold-tools-after-restart", "release", "--env", "blackjack"],
            "turnpoint demo: --hold-tools-after-restart holds the guessing game's tools: "
            "drop --env",
        ),
        (
            ["--hold-tools-after-restart", "release", "--no-crash"],
            "turnpoint demo: --hold-tools-after-restart needs a restart: drop --no-crash",
        ),
    ],
)
def test_bad_flags_say_what_to_change(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = _demo([*argv, "--out", str(tmp_path / "out")], capsys)

    assert status == 2
    assert err.splitlines() == [message]
    assert not (tmp_path / "out").exists()


def test_one_step_without_a_crash_is_valid(tmp_path: Path) -> None:
    assert _options(tmp_path, steps=1, crash=False).problems() == []


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    problems = _options(tmp_path / "out", steps=0, agents=0, target_level="x").problems()
    assert len(problems) == 3


def test_storage_flags_that_cannot_work_are_refused(tmp_path: Path) -> None:
    assert _options(tmp_path, storage="s3").problems() == []
    assert _options(tmp_path, storage="nfs").problems() == [
        "unknown --storage 'nfs': choose one of local, s3"
    ]
    typescript = {"tools": ("node", "guess-resources.js")}
    (problem,) = _options(tmp_path, storage="s3", participant_commands=typescript).problems()
    assert "drop --storage s3 or --participant-command" in problem


def test_opaque_agents_play_the_guessing_game_in_local_processes_only(tmp_path: Path) -> None:
    assert _options(tmp_path, agent="opaque").problems() == []
    for other in ({"environment": "blackjack"}, {"ray": True}, {"agent_workers": 2}):
        (problem,) = _options(tmp_path, agent="opaque", **other).problems()
        assert problem.startswith("--agent opaque plays the guessing game"), problem


def test_a_foreign_out_dir_is_never_wiped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")

    status, err = _demo(["--out", str(foreign)], capsys)

    assert status == 2
    assert err.strip() == (
        f"turnpoint demo: --out {foreign} is not empty and was not made by turnpoint demo: "
        "choose another --out or remove it"
    )
    assert (foreign / "thesis.tex").read_text() == "precious"


def test_a_previous_demo_out_dir_is_wiped(tmp_path: Path) -> None:
    first, _ = prepare_out_dir(tmp_path / "out")
    (first.out / "events.jsonl").write_text("old\n")
    first_data_token = first.data_token_file.read_text().strip()

    second, token = prepare_out_dir(tmp_path / "out")

    assert not (second.out / "events.jsonl").exists()
    assert second.token_file.read_text().strip() == token
    # Two credentials, fresh each run (docs/spec.md section 10.2 item 6).
    data_token = second.data_token_file.read_text().strip()
    assert data_token not in ("", token, first_data_token)
    assert second.snapshots.is_dir() and second.logs.is_dir()


def test_the_trainer_command_carries_every_setting(tmp_path: Path) -> None:
    options = _options(
        tmp_path,
        steps=7,
        group_size=3,
        groups_per_step=5,
        seed=9,
        snapshot_interval_s=2.5,
        target_level="sibling",
    )
    paths = DemoPaths(tmp_path)

    command = trainer_command(options, paths, resume=True, incarnation=3)

    assert command == [
        sys.executable, "-m", "turnpoint.apps.demo._trainer",
        "--topology", str(tmp_path / "topology.json"),
        "--out", str(tmp_path),
        "--steps", "7", "--group-size", "3", "--groups-per-step", "5",
        "--snapshot-interval", "2.5", "--target-level", "sibling", "--seed", "9",
        "--max-restarts", "3", "--incarnation", "3", "--start-on-stdin", "--resume",
    ]  # fmt: skip


# Like _FAKE_SERVE, on the port it is given (0 picks one); a taken port exits 1.
_FAKE_SERVE_ON_PORT = _FAKE_SERVE.replace(
    'listener.bind(("127.0.0.1", 0))',
    'listener.bind(("127.0.0.1", int(args[args.index("--port") + 1])))',
)


class _Squatting:
    """A launcher that lets another process take the port a replacement is to bind,
    between the predecessor's kill and the replacement's start."""

    def __init__(self, launcher: ProcessLauncher) -> None:
        self.launcher = launcher
        self.squatters: list[socket.socket] = []

    async def start(self, spec: ParticipantSpec, generation: int) -> ProcessParticipant:
        squatter = socket.socket()
        squatter.bind(("127.0.0.1", spec.port))
        squatter.listen()
        self.squatters.append(squatter)
        return await self.launcher.start(spec, generation)


@pytest.mark.parametrize("squatted", [False, True], ids=["port-free", "port-taken"])
async def test_a_resources_server_is_replaced_on_its_port_or_the_heal_is_refused(
    tmp_path: Path, squatted: bool
) -> None:
    """docs/spec.md section 7.15 item 9: the agents call a resources server at the
    address they were started with, so its replacement binds its predecessor's port; a
    port another process took meanwhile refuses the replacement (the trainer's heal
    fails with a typed LaunchError, and the job restarts)."""
    options = _options(tmp_path / "out")
    paths, token = prepare_out_dir(options.out)
    script = tmp_path / "fake_serve_on_port.py"
    script.write_text(_FAKE_SERVE_ON_PORT)
    processes = ProcessLauncher(
        paths, start_timeout_s=TIMEOUT_S, serve_command=[sys.executable, str(script)]
    )
    launcher = _Squatting(processes) if squatted else processes
    supervisor = _Supervisor(options, paths, token, launcher, _NoDisplay(), [sys.executable])
    spec = ParticipantSpec(instance="tools", kind="resources", example="guess", environment="guess")
    old = await processes.start(spec, 1)
    supervisor.participants["tools"] = old
    try:
        if squatted:
            with pytest.raises(ReplaceRefused, match="tools did not start"):
                await supervisor.replace("tools")
            return
        address = await supervisor.replace("tools")
        new = supervisor.participants["tools"]
        assert address == new.address == old.address and new is not old
        assert "replaced" in paths.supervisor_log.read_text()
        await new.kill()
    finally:
        await old.kill()
        if isinstance(launcher, _Squatting):
            for squatter in launcher.squatters:
                squatter.close()


class _NoDisplay:
    def update(self, state: object, now: float) -> None:
        pass

    def close(self, state: object) -> None:
        pass


def test_only_the_restarted_tools_server_holds_its_calls(tmp_path: Path) -> None:
    """``--hold-tools-after-restart FILE`` (tests/e2e/test_status_page.py): the first job
    runs free; from the restart on, ``tools`` is told to hold its calls until FILE exists."""
    release = tmp_path / "release"
    options = _options(tmp_path, hold_tools_after_restart=release)
    paths = DemoPaths(tmp_path)

    def holding(generation: int) -> dict[str, list[str]]:
        return {
            spec.instance: spec.serve_arguments(paths)[-2:]
            for spec in server_specs(options, paths, generation)
            if spec.hold_calls_until is not None
        }

    assert holding(1) == {}
    assert holding(2) == holding(3) == {"tools": ["--hold-calls-until", str(release)]}


def test_a_hold_on_a_server_that_cannot_hold_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status = main(
        ["serve", "--kind", "resources", "--example", "counter", "--insecure-no-auth",
         "--root", str(tmp_path), "--hold-calls-until", str(tmp_path / "release")]
    )  # fmt: skip

    assert status == 2
    assert capsys.readouterr().err.splitlines() == [
        "turnpoint serve: only the guess and guess-group resources servers hold their calls"
    ]


def test_ray_address_implies_ray() -> None:
    parser_args = ["demo", "--ray-address", "10.0.0.1:6379"]
    from turnpoint.apps._cli import build_parser

    options = DemoOptions.from_args(build_parser().parse_args(parser_args))
    assert options.ray and options.ray_address == "10.0.0.1:6379"
    assert os.fspath(options.out) == "turnpoint-demo-out"


async def test_the_status_port_stays_held_for_the_run_between_two_trainers(
    tmp_path: Path,
) -> None:
    """The demo reserves the status port for the whole run (a socket bound with
    SO_REUSEPORT that never listens): a process binding on its own cannot take it, and
    each trainer in turn serves the page on it. A port only probed and closed was once
    taken by a participant started meanwhile, and the next trainer died on it."""
    options = _options(tmp_path / "out", metrics_port=0)
    held, reserved = _with_metrics_port(options, Console(file=io.StringIO()))
    try:
        port = held.metrics_port
        assert port is not None and port > 0
        with socket.socket() as intruder, pytest.raises(OSError) as taken:
            intruder.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        sources = StatusSources(
            history=CheckpointHistory(wall_offset_s=0.0),
            layout=SnapshotLayout(tmp_path / "snapshots"),
            config=CoordinatorConfig(snapshot_root=tmp_path / "snapshots"),
        )
        for _trainer in range(2):
            server = StatusServer(sources, port=port, reuse_port=True)
            await server.start()
            try:
                assert server.port == port
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /api/checkpoints HTTP/1.0\r\n\r\n")
                assert (await reader.readline()).startswith(b"HTTP/1.0 200")
                writer.close()
            finally:
                await server.close()
    finally:
        reserved.close()


_SUPERVISOR_OF_ONE = r"""
import asyncio, os, sys
from pathlib import Path
from turnpoint.apps.demo._supervisor import ParticipantSpec, ProcessLauncher, prepare_out_dir

async def main():
    paths, _token = prepare_out_dir(Path(sys.argv[1]))
    launcher = ProcessLauncher(paths, start_timeout_s=60.0)
    spec = ParticipantSpec(instance="tools", kind="resources", example="guess",
                           environment="guess", verifier_log=paths.verifier_log("tools"))
    participant = await launcher.start(spec, 1)
    print(participant.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_participant_runs_in_a_group_of_its_own_and_dies_with_its_supervisor(
    tmp_path: Path,
) -> None:
    """The supervisor starts each child in a process group of its own, so that no exit
    elsewhere makes the kernel wake one that --chaos paused (an orphaned group holding a
    stopped process gets SIGHUP and SIGCONT); a real ``turnpoint serve`` then still dies
    with its supervisor, killed outright (PR_SET_PDEATHSIG via $TURNPOINT_PARENT_PID)."""
    script = tmp_path / "supervisor_of_one.py"
    script.write_text(_SUPERVISOR_OF_ONE)
    supervisor = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "out")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert supervisor.stdout is not None
        pid = int(supervisor.stdout.readline())
        assert os.getpgid(pid) == pid != os.getpgid(supervisor.pid)
        # The supervisor named itself to its child.
        assert (
            f"{PARENT_PID_ENV}={supervisor.pid}\0".encode()
            in Path(f"/proc/{pid}/environ").read_bytes()
        )
    finally:
        supervisor.kill()
        supervisor.wait()
    deadline = time.monotonic() + TIMEOUT_S
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
        assert time.monotonic() < deadline, f"participant {pid} outlived its supervisor"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "gone"
