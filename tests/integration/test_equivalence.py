"""The conformance kit's equivalence check (docs/spec.md section 5.6) against real servers.

The three environments and the guessing game pass: a session restored at any turn
boundary into a fresh server answers every remaining call and the verify exactly as an
uninterrupted one. Servers whose restore is not exact fail, each named by its first
diverging call; a server whose export or restore does nothing fails too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.env_mutants import (
    BlobsAsTextWorkplace,
    HollowExport,
    ReseededBlackjack,
    RestoresNothing,
    attempt_blind_pair,
)
from tests.support.participants import TOKEN
from turnpoint.apps.conformance._kit import Workload
from turnpoint.apps.conformance._report import ConformanceReport, Outcome, render_table
from turnpoint.apps.conformance._runner import ConformanceOptions, run_conformance
from turnpoint.apps.examples._environments import BlackjackTools, WorkplaceTools
from turnpoint.apps.examples._participants import GuessTools
from turnpoint.apps.examples._task import make_prompt
from turnpoint.apps.examples._workplace import seed_database
from turnpoint.apps.examples.guide_resources import CounterTools
from turnpoint.participant_sdk import ParticipantRuntime, ResourcesServer, SnapshotStore
from turnpoint.server import ServerOptions, host_participant

# A safety bound on the command as a subprocess; never a synchronisation device.
BOUND_S = 120.0


def _blob_owner(seed: int) -> str:
    row = (
        seed_database(seed)
        .execute("SELECT name FROM customers WHERE avatar IS NOT NULL ORDER BY rowid")
        .fetchone()
    )
    return str(row[0])


WORKLOADS: dict[str, dict[str, Any]] = {
    "counter": {
        "task": {"target": 5},
        "calls": [
            {"tool": "add", "arguments": {"add": a, "turn": t}} for t, a in enumerate((2, 3, 0))
        ],
        "answer": {"total": 5},
    },
    "blackjack": {
        "task": {"seed": 8},
        "calls": [
            {"tool": "look", "arguments": {}},
            {"tool": "hit", "arguments": {}},
            {"tool": "hit", "arguments": {}},
            {"tool": "stand", "arguments": {}},
        ],
    },
    "workplace": {
        "task": {"seed": 4},
        "calls": [
            {"tool": "send_email", "arguments": {"recipient": "ada", "subject": "hello"}},
            {"tool": "find_customer", "arguments": {"name": _blob_owner(4)}},
            {"tool": "set_balance", "arguments": {"name": "bo", "balance": -0.5}},
            {"tool": "list_day", "arguments": {"day": 1}},
            {"tool": "find_customer", "arguments": {"name": "cy"}},
        ],
    },
    "guess": {
        "task": {"task": make_prompt(0, 0).to_dict()},
        "calls": [
            {"tool": "check", "arguments": {"guess": g, "turn": t}} for t, g in enumerate((0, 9, 5))
        ],
    },
}


@contextlib.asynccontextmanager
async def _pair(
    root: Path, make: Callable[[], tuple[ResourcesServer, ...]]
) -> AsyncIterator[tuple[str, ...]]:
    """The target and its fresh restore targets: one instance name, one snapshot root."""
    servers = make()
    hosted = [
        host_participant(
            ParticipantRuntime("tools", SnapshotStore(root), resources=server),
            ServerOptions(port=0, token=TOKEN),
        )
        for server in servers
    ]
    for each in hosted:
        await each.start()
    try:
        yield tuple(each.address for each in hosted)
    finally:
        for each in hosted:
            await each.stop(0)


async def _equivalence(
    root: Path, workload: str, make: Callable[[], tuple[ResourcesServer, ...]]
) -> ConformanceReport:
    async with _pair(root, make) as (target, fresh):
        options = ConformanceOptions(
            target,
            TOKEN,
            workload=Workload.from_mapping(WORKLOADS[workload]),
            only=("equivalence",),
            restore_targets=(fresh,),
            snapshot_root=root,
        )
        return await run_conformance(options)


def _two(cls: Callable[[], ResourcesServer]) -> Callable[[], tuple[ResourcesServer, ...]]:
    return lambda: (cls(), cls())


@pytest.mark.parametrize(
    ("workload", "cls"),
    [
        ("counter", CounterTools),
        ("blackjack", BlackjackTools),
        ("workplace", WorkplaceTools),
        ("guess", GuessTools),
    ],
)
async def test_the_environments_restore_exactly(tmp_path: Path, workload: str, cls: Any) -> None:
    report = await _equivalence(tmp_path, workload, _two(cls))
    result = report.result("equivalence")
    assert result.outcome is Outcome.PASS, render_table(report)
    assert "truncated states refused" in result.detail


@pytest.mark.parametrize(
    ("workload", "make", "diverging"),
    [
        # Re-seeded: the first hit after the cut deals the shoe's fifth card again.
        ("blackjack", _two(ReseededBlackjack), "restored at boundary 2: first diverging call #3"),
        # The blob comes back as text: the first read of it after the cut differs.
        (
            "workplace",
            _two(BlobsAsTextWorkplace),
            "restored at boundary 0: first diverging call #2",
        ),
        # Attempt N's late hit dealt from the shared shoe under attempt N+1 (its late
        # call at boundary 0 was a look, which changes nothing).
        ("blackjack", attempt_blind_pair, "restored at boundary 1: first diverging call #2"),
    ],
    ids=["rng-reseeded", "codec-loses-blob-type", "restore-ignores-attempt"],
)
async def test_inexact_restores_fail_at_their_first_diverging_call(
    tmp_path: Path, workload: str, make: Any, diverging: str
) -> None:
    report = await _equivalence(tmp_path, workload, make)
    result = report.result("equivalence")
    assert result.outcome is Outcome.FAIL, render_table(report)
    assert diverging in result.detail, result.detail


@pytest.mark.parametrize(
    ("cls", "refused"),
    [
        (
            HollowExport,
            "sessions in scope was refused Commit: DATA_LOSS (INVALID_CHECKPOINT_STATE)",
        ),
        (RestoresNothing, "installed nothing"),
    ],
    ids=["export-returns-nothing", "restore-installs-nothing"],
)
async def test_a_hollow_export_or_restore_fails(tmp_path: Path, cls: Any, refused: str) -> None:
    report = await _equivalence(tmp_path, "counter", _two(cls))
    result = report.result("equivalence")
    assert result.outcome is Outcome.FAIL, render_table(report)
    assert refused in result.detail, result.detail


async def test_without_calls_or_a_restore_target_it_says_what_it_did_not_try(
    tmp_path: Path,
) -> None:
    async with _pair(tmp_path, _two(CounterTools)) as (target, _):
        options = ConformanceOptions(
            target,
            TOKEN,
            workload=Workload.from_mapping({"task": WORKLOADS["counter"]["task"]}),
            only=("equivalence",),
        )
        report = await run_conformance(options)
    result = report.result("equivalence")
    assert result.outcome is Outcome.SKIP
    assert "--equivalence FILE" in result.detail and "--restore-target" in result.detail


async def test_the_kit_fails_the_hollow_exported_server_with_a_plain_workload(
    tmp_path: Path,
) -> None:
    # Issue 28 item 5: a task and an answer, no calls. The kit seeds, commits with the
    # sessions in scope and expects one record each; the empty export cannot give them.
    plain = {"task": WORKLOADS["counter"]["task"], "answer": {"total": 0}}
    async with _pair(tmp_path, _two(HollowExport)) as (target, fresh):
        options = ConformanceOptions(
            target,
            TOKEN,
            workload=Workload.from_mapping(plain),
            only=("exported-sessions", "equivalence"),
            restore_targets=(fresh,),
        )
        report = await run_conformance(options)
    assert report.failed() == ["exported-sessions", "equivalence"], render_table(report)
    assert "was refused" in report.result("exported-sessions").detail


async def test_an_honest_exported_server_passes_with_a_plain_workload(tmp_path: Path) -> None:
    plain = {"task": WORKLOADS["counter"]["task"], "answer": {"total": 0}}
    async with _pair(tmp_path, _two(CounterTools)) as (target, fresh):
        options = ConformanceOptions(
            target,
            TOKEN,
            workload=Workload.from_mapping(plain),
            only=("exported-sessions", "equivalence"),
            restore_targets=(fresh,),
        )
        report = await run_conformance(options)
    assert report.failed() == [], render_table(report)
    assert "no calls in the workload" in report.result("exported-sessions").detail


async def _command(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnpoint.apps._cli",
        "conformance",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_each_check_that_restores_takes_a_restore_target_of_its_own(
    tmp_path: Path,
) -> None:
    """A participant takes one restore (section 4.10): of the fresh processes given with
    --restore-target, the equivalence check takes the first and the effects check the
    next; given one only, the effects check says where it went instead of failing."""

    def guess_tools(count: int) -> Callable[[], tuple[ResourcesServer, ...]]:
        return lambda: tuple(GuessTools("tools") for _ in range(count))

    async def both(root: Path, target: str, *fresh: str) -> ConformanceReport:
        options = ConformanceOptions(
            target,
            TOKEN,
            workload=Workload.from_mapping(WORKLOADS["guess"]),
            only=("effects", "equivalence"),
            restore_targets=fresh,
        )
        return await run_conformance(options)

    async with _pair(tmp_path / "two", guess_tools(3)) as (target, *fresh):
        report = await both(tmp_path / "two", target, *fresh)
    assert report.result("equivalence").outcome is Outcome.PASS, render_table(report)
    assert report.result("effects").outcome is Outcome.PASS, render_table(report)
    assert "re-sent by the next attempt after a restore" in report.result("effects").detail

    async with _pair(tmp_path / "one", guess_tools(2)) as (target, fresh_one):
        report = await both(tmp_path / "one", target, fresh_one)
    assert report.result("equivalence").outcome is Outcome.PASS, render_table(report)
    effects = report.result("effects")
    assert effects.outcome is Outcome.PASS, render_table(report)
    assert "went to another check that restores" in effects.detail, effects.detail


async def test_the_command_runs_the_equivalence_check(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN, encoding="ascii")
    workload = tmp_path / "blackjack.json"
    workload.write_text(json.dumps(WORKLOADS["blackjack"]), encoding="utf-8")
    no_calls = tmp_path / "no-calls.json"
    no_calls.write_text(json.dumps({"task": {"seed": 1}}), encoding="utf-8")
    root = tmp_path / "snapshots"
    async with _pair(root, _two(BlackjackTools)) as (target, fresh):
        common = ("--target", target, "--token-file", str(token_file), "--only", "equivalence")
        code, out, err = await _command(
            *common,
            "--equivalence",
            str(workload),
            "--restore-target",
            fresh,
            "--snapshot-root",
            str(root),
            "--json",
        )
        assert code == 0, out + err
        (result,) = json.loads(out)["checks"]
        assert (result["name"], result["result"]) == ("equivalence", "pass")
        code, _, err = await _command(*common, "--equivalence", str(no_calls))
        assert code == 2 and "non-empty 'calls'" in err
