"""``turnpoint demo --crash-at``: the supervisor's side, against stand-ins in a second.

A fake ``serve`` binds a port and prints the serving line; a fake trainer follows the
trainer's contract just far enough: with ``--kill-at`` it logs the ``kill`` event the
real kill switch logs and SIGKILLs itself (or, with ``FAKE_KILL=silent``, dies of SIGKILL
without it, as an OOM kill would). The real kill points run in ``tests/e2e``.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from turnpoint.apps.demo._report import DemoError
from turnpoint.apps.demo._supervisor import DemoOptions, ProcessLauncher, prepare_out_dir, run_demo

TIMEOUT_S = 60.0

_FAKE_SERVE = """
import signal, socket, sys
args = sys.argv[1:]
kind, instance = args[args.index("--kind") + 1], args[args.index("--instance") + 1]
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
print(f"turnpoint: serving {kind} {instance} on 127.0.0.1:{listener.getsockname()[1]}", flush=True)
signal.sigwait([signal.SIGTERM])
"""

_FAKE_TRAINER = r"""
import json, os, signal, sys, time
argv = sys.argv[1:]
if "--start-on-stdin" in argv and not sys.stdin.readline():
    sys.exit(2)
out = argv[argv.index("--out") + 1]
log = os.path.join(out, "events.jsonl")
incarnation = (open(log).read().count('"type": "start"') if os.path.exists(log) else 0) + 1
with open(os.path.join(out, "argv.jsonl"), "a") as seen:
    seen.write(json.dumps(argv) + "\n")

def emit(kind, **fields):
    with open(log, "a") as events:
        events.write(json.dumps({"t": time.time(), "type": kind,
                                 "incarnation": incarnation, **fields}) + "\n")

emit("start", restored_from="ck-1" if "--resume" in argv else None, step=0)
if "--kill-at" in argv:
    point, _, nth = argv[argv.index("--kill-at") + 1].partition(":")
    if os.environ.get("FAKE_KILL") != "silent":
        emit("kill", point=point, nth=int(nth or 1), checkpoint_id="ck-2",
             newest_published="ck-1", call_under_way=False)
    os.kill(os.getpid(), signal.SIGKILL)
emit("done", step=0)
"""


def _script(tmp_path: Path, name: str, text: str) -> list[str]:
    path = tmp_path / name
    path.write_text(text)
    return [sys.executable, str(path)]


def _jsonl(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _run(tmp_path: Path, crash_at: str, *, max_restarts: int = 3) -> tuple[Path, int]:
    options = DemoOptions(
        max_restarts=max_restarts,
        steps=4,
        agents=2,
        group_size=2,
        groups_per_step=2,
        crash_at=crash_at,
        out=tmp_path / "out",
        progress=False,
        start_timeout_s=TIMEOUT_S,
    )
    assert options.problems() == []
    paths, token = prepare_out_dir(options.out)
    launcher = ProcessLauncher(
        paths,
        start_timeout_s=TIMEOUT_S,
        serve_command=_script(tmp_path, "fake_serve.py", _FAKE_SERVE),
    )
    status = await run_demo(
        options,
        paths,
        token,
        launcher,
        Console(file=io.StringIO(), width=200),
        trainer_program=_script(tmp_path, "fake_trainer.py", _FAKE_TRAINER),
    )
    return paths.out, status


async def test_the_trainers_own_kill_is_the_crash_and_the_trainer_restarts_alone(
    tmp_path: Path,
) -> None:
    out, _ = await _run(tmp_path, "commit-sent:2")

    supervisor = _jsonl(out / "supervisor.jsonl")
    assert [event["type"] for event in supervisor] == ["crash", "restart"]
    crash = supervisor[0]
    # Every participant serves RestoreRunning: the next trainer restores into them where
    # they run (docs/spec.md section 7.11 item 3), none of them restarted.
    assert crash["killed"] == ["trainer"]
    assert supervisor[1]["participants_restarted"] == 0
    assert (crash["point"], crash["nth"], crash["checkpoint_id"]) == ("commit-sent", 2, "ck-2")
    # --kill-at goes to the first trainer only; the second restores.
    first, second = _jsonl(out / "argv.jsonl")
    assert first[first.index("--kill-at") + 1] == "commit-sent:2" and "--resume" not in first
    assert "--kill-at" not in second and "--resume" in second


async def test_a_sequence_kills_each_trainer_at_its_entry_and_the_last_one_finishes(
    tmp_path: Path,
) -> None:
    """``--crash-at`` with several entries: incarnation k gets the k-th as its
    ``--kill-at``, each SIGKILL with its own ``kill`` event is a planned crash restarting
    the trainer alone, and the trainer after the last entry runs to the end."""
    out, _ = await _run(tmp_path, "commit-sent:2,prepared, latest-moved:3")

    supervisor = _jsonl(out / "supervisor.jsonl")
    assert [event["type"] for event in supervisor] == ["crash", "restart"] * 3
    crashes = [event for event in supervisor if event["type"] == "crash"]
    assert [(c["incarnation"], c["point"], c["nth"]) for c in crashes] == [
        (1, "commit-sent", 2),
        (2, "prepared", 1),
        (3, "latest-moved", 3),
    ]
    assert all(c["killed"] == ["trainer"] and "unplanned" not in c for c in crashes)
    restarts = [event for event in supervisor if event["type"] == "restart"]
    assert [r["incarnation"] for r in restarts] == [2, 3, 4]
    assert all(r["participants_restarted"] == 0 for r in restarts)
    argvs = _jsonl(out / "argv.jsonl")
    kill_at = [argv[argv.index("--kill-at") + 1] if "--kill-at" in argv else None for argv in argvs]
    assert kill_at == ["commit-sent:2", "prepared", "latest-moved:3", None]
    assert ["--resume" in argv for argv in argvs] == [False, True, True, True]


async def test_a_sigkill_without_the_kill_event_fails_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILL that the kill switch did not announce is not taken for the planned
    crash: it is an unplanned failure (restored within the budget; with none, fatal)."""
    monkeypatch.setenv("FAKE_KILL", "silent")

    with pytest.raises(DemoError) as caught:
        await _run(tmp_path, "prepared", max_restarts=0)

    assert str(caught.value).startswith("the trainer (incarnation 1) exited with status -9")
    assert "(max_restarts=0); the run ends" in str(caught.value)
    assert not (tmp_path / "out" / "supervisor.jsonl").exists()


@pytest.mark.parametrize(
    ("crash_at", "crash", "problem", "entry"),
    [
        (
            "prepared:0",
            True,
            "--crash-at prepared:0: N in POINT:N counts snapshots and must be",
            "",
        ),
        (
            "prepared:x",
            True,
            "--crash-at prepared:x: N in POINT:N counts snapshots and must be",
            "",
        ),
        ("prepared", False, "--crash-at injects the crash, --no-crash turns it off", ""),
        # A sequence: the problem names the entry at fault.
        (
            "prepared,,committed",
            True,
            "--crash-at has an empty entry: write POINT[:N] between the commas",
            " (entry 2 of 3)",
        ),
        (
            "prepared:2,comitted:2",
            True,
            "unknown --crash-at point 'comitted' (did you mean committed?): choose one of "
            "anchor-written, ",
            " (entry 2 of 2)",
        ),
        (
            "prepared:2,committed:0",
            True,
            "--crash-at committed:0: N in POINT:N counts snapshots and must be",
            " (entry 2 of 2)",
        ),
    ],
)
def test_bad_crash_at_flags_say_what_to_change(
    crash_at: str, crash: bool, problem: str, entry: str, tmp_path: Path
) -> None:
    options = DemoOptions(crash_at=crash_at, crash=crash, out=tmp_path / "out")
    [found] = options.problems()
    assert found.startswith(problem), found
    assert found.endswith(entry) if entry else "(entry " not in found, found
