"""The conformance kit against real participants: it passes the examples and catches
exactly what it claims to.

Every example participant (agent, per-sibling and group-scored resources, policy model)
passes every check that applies to its kind. Each deliberately broken participant of
``tests/support/mutants.py`` (one defect each) is failed by the check named for the rule
it breaks, and by no other check. The command itself prints a table or JSON and exits
0, 1 on a failure, 2 on a usage error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.mutants import MUTANTS, IgnoresRecord, Mutant, honest_mid_turn_agent
from tests.support.participants import TOKEN, start_topology
from tests.support.scripted import FAST, host_scripted
from turnpoint.apps.conformance._kit import Workload
from turnpoint.apps.conformance._report import ConformanceReport, Outcome, render_table
from turnpoint.apps.conformance._runner import CHECKS, ConformanceOptions, run_conformance
from turnpoint.apps.examples._participants import GuessTools
from turnpoint.apps.examples._task import make_prompt
from turnpoint.participant_sdk import ParticipantRuntime, SnapshotStore
from turnpoint.server import ServerOptions, host_participant

# What the example environment understands: a Run task (agents) and a session task
# (resources), the same object the demo's trainer sends.
WORKLOAD = {
    "task": {"task": make_prompt(0, 0).to_dict(), "environment": "guess"},
    "calls": [{"tool": "check", "arguments": {"guess": 1, "turn": 0}}],
}
# The kit's short lease for the lease check: long enough to renew within, short enough
# to wait out quickly.
LEASE_S = 0.5
# A safety bound on the command as a subprocess; never a synchronisation device.
BOUND_S = 120.0

# The check named for each mutant's rule: the only check allowed to fail it.
CAUGHT_BY = {
    "forgets-answers": "fencing-replay",
    "ignores-stale-epoch": "fencing-epoch",
    "ready-mid-turn": "readiness",
    "unknown-on-garbage": "hostile-input",
    "lease-never-expires": "lease",
    "ignores-record": "effects",
}
AGENT_ONLY = {"run-stream", "acknowledge"}

# Checked only on a policy model that cuts (docs/spec.md section 5.5): the example does.
CUTTING_MODEL_ONLY = {"token-cut"}
# Needs recorded calls and a fresh restore target (tests/integration/test_equivalence.py).
EQUIVALENCE = {"equivalence"}
# Checked only on a resources server (docs/spec.md sections 5.3, 6.12).
RESOURCES_ONLY = {"exported-sessions", "effects"}
# Checked only when the kit is given the target's data-plane token (section 10.2).
DATA_TOKEN_ONLY = {"credential-roles"}
DATA_TOKEN = "conformance-data-Token-8c1d"
# Needs a server on a sandbox provider and --snapshot-root
# (tests/integration/test_conformance_sandboxes.py).
SANDBOXES = {"sandboxes"}
# Checked only when the kit is given an HTTP face (tests/integration/test_conformance_openai.py).
HTTP_FACES = {"openai-endpoint", "egress-relay"}


async def _check(
    address: str,
    *,
    only: tuple[str, ...] = (),
    restore_target: str | None = None,
    data_token: str | None = None,
) -> ConformanceReport:
    options = ConformanceOptions(
        address,
        TOKEN,
        workload=Workload.from_mapping(WORKLOAD),
        lease_s=LEASE_S,
        only=only,
        restore_targets=() if restore_target is None else (restore_target,),
        data_token=data_token,
    )
    return await run_conformance(options)


def _outcomes(report: ConformanceReport) -> dict[str, Outcome]:
    return {result.name: result.outcome for result in report.results}


def test_every_check_names_a_section_and_every_mutant_a_check() -> None:
    names = [check.name for check in CHECKS]
    assert len(names) == len(set(names))
    assert all(check.section for check in CHECKS)
    assert set(CAUGHT_BY) == {mutant.name for mutant in MUTANTS}
    assert set(CAUGHT_BY.values()) <= set(names)


@pytest.mark.parametrize("instance", ["agent-0", "tools", "group-tools", "policy"])
async def test_the_example_participants_pass_every_check(tmp_path: Path, instance: str) -> None:
    async with start_topology(tmp_path, group_size=2) as topology:
        report = await _check(topology.participants[instance].address)
    outcomes = _outcomes(report)
    assert report.failed() == [], render_table(report)
    assert len(outcomes) == len(CHECKS)
    skipped = {name for name, outcome in outcomes.items() if outcome is Outcome.SKIP}
    # An agent runs every check but the cutting model's; the others skip what belongs to
    # agents, and the resources servers the cutting model's check too.
    expected = (
        EQUIVALENCE
        | DATA_TOKEN_ONLY
        | SANDBOXES
        | HTTP_FACES
        | (
            CUTTING_MODEL_ONLY | RESOURCES_ONLY
            if instance.startswith("agent")
            else AGENT_ONLY | RESOURCES_ONLY
            if instance == "policy"
            else AGENT_ONLY | CUTTING_MODEL_ONLY
        )
    )
    assert skipped == expected, render_table(report)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
async def test_each_mutant_is_failed_by_its_rule_and_by_nothing_else(
    tmp_path: Path, mutant: Mutant
) -> None:
    async with mutant.serve(tmp_path) as address:
        report = await _check(address)
    assert report.failed() == [CAUGHT_BY[mutant.name]], render_table(report)
    assert report.exit_code() == 1


@pytest.mark.parametrize(
    "runtime_class", [ParticipantRuntime, IgnoresRecord], ids=["honest", "ignores-record"]
)
async def test_the_effects_check_restores_into_a_fresh_process_and_catches_no_dedup(
    tmp_path: Path, runtime_class: type[ParticipantRuntime]
) -> None:
    """docs/spec.md section 6.12: with a second, fresh process of the example resources
    server on the same snapshot root, the check re-sends the call after a restore."""

    def tools(root: Path) -> Any:
        return host_scripted(
            root, instance="tools", resources=GuessTools("tools"), runtime_class=runtime_class
        )

    async with tools(tmp_path) as target, tools(tmp_path) as fresh:
        report = await _check(target.address, only=("effects",), restore_target=fresh.address)
    result = report.result("effects")
    if runtime_class is ParticipantRuntime:
        assert result.outcome is Outcome.PASS, render_table(report)
        assert "re-sent by the next attempt after a restore" in result.detail
    else:
        assert result.outcome is Outcome.FAIL, render_table(report)
        assert "with other arguments was answered" in result.detail, result.detail


async def test_mid_turn_episodes_under_an_honest_runtime_pass_the_readiness_check(
    tmp_path: Path,
) -> None:
    # The control for ready-mid-turn: the same agent, whose episodes really are RUNNING
    # between boundaries, passes once its runtime waits for them to park.
    async with honest_mid_turn_agent(tmp_path) as address:
        report = await _check(address)
    assert report.failed() == [], render_table(report)
    assert report.result("readiness").outcome is Outcome.PASS


async def _command(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNPOINT_TOKEN")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnpoint.apps._cli",
        "conformance",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_the_command_prints_json_and_exits_by_the_verdict(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n", encoding="ascii")
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(WORKLOAD), encoding="utf-8")
    common = ("--token-file", str(token_file), "--workload", str(workload), "--lease", "0.5")
    mutant = next(m for m in MUTANTS if m.name == "lease-never-expires")
    async with start_topology(tmp_path / "examples") as topology:
        code, out, err = await _command("--target", topology.tools.address, *common, "--json")
        assert code == 0, err + out
        document = json.loads(out)
        assert document["instance"] == "tools"
        assert document["counts"]["fail"] == 0
        assert [c["name"] for c in document["checks"]] == [c.name for c in CHECKS]
        assert all(c["section"] for c in document["checks"])
        assert "pass" in err  # progress lines go to stderr
    async with mutant.serve(tmp_path / "mutant") as address:
        code, out, _ = await _command("--target", address, *common, "--only", "lease")
    assert code == 1
    assert "lease" in out and "FAIL" in out and "4.2" in out


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--target", "127.0.0.1:1", "--only", "no-such-check"),
        ("--target", "127.0.0.1:1", "--workload", "/nonexistent/workload.json"),
        ("--target", "not-an-address"),
    ],
    ids=["no-target", "unknown-check", "unreadable-workload", "bad-address"],
)
async def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    code, _, err = await _command(*args)
    assert code == 2, err


@pytest.mark.parametrize("serves", [True, False], ids=["capable", "without-capability"])
async def test_the_restore_running_check_runs_only_where_the_capability_is_listed(
    tmp_path: Path, serves: bool
) -> None:
    """docs/spec.md section 4.16: checked on a participant that lists the capability, and
    skipped, saying why, on one that does not."""
    config = dataclasses.replace(FAST, restore_running=serves)
    async with host_scripted(tmp_path, resources=GuessTools("tools"), config=config) as target:
        report = await _check(target.address, only=("restore-running",))
    result = report.result("restore-running")
    if serves:
        assert result.outcome is Outcome.PASS, render_table(report)
        assert "refused a retired scope attempt STALE_ATTEMPT" in result.detail
        assert "a live session restored in place" in result.detail, result.detail
        assert "with retire_unscoped, one whose N+1 was retired, listed" in result.detail
    else:
        assert result.outcome is Outcome.SKIP, render_table(report)
        assert "CAPABILITY_RESTORE_RUNNING" in result.detail


@pytest.mark.parametrize("roles", [True, False], ids=["two-tokens", "one-token"])
async def test_the_credential_roles_check_passes_a_target_with_roles_and_fails_one_without(
    tmp_path: Path, roles: bool
) -> None:
    """docs/spec.md section 10.2: given a data-plane token, the check passes a target
    that serves it on the data plane only, and fails one that does not know it."""
    runtime = ParticipantRuntime("tools", SnapshotStore(tmp_path), resources=GuessTools("tools"))
    options = ServerOptions(token=TOKEN, data_token=DATA_TOKEN if roles else None)
    hosted = await host_participant(runtime, options).start()
    try:
        report = await _check(hosted.address, only=("credential-roles",), data_token=DATA_TOKEN)
    finally:
        await hosted.stop(0)
    result = report.result("credential-roles")
    if roles:
        assert result.outcome is Outcome.PASS, render_table(report)
        assert "PERMISSION_DENIED" in result.detail and "CloseSession" in result.detail
        assert runtime.core.epoch < 2**64 - 1
    else:
        assert result.outcome is Outcome.FAIL, render_table(report)
        assert "UNAUTHENTICATED" in result.detail
