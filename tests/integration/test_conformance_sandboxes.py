"""The conformance kit's sandbox check (docs/spec.md section 5.7) against real servers.

The coding environment, on the local provider under bubblewrap (as
tests/integration/test_sandbox_sessions.py requires it), passes: its sessions restore
into a new generation, and a missing, stale, duplicate or expired handle is refused
with its typed error while the other sandbox of the restore stays inactive. A coding
environment that starts a session over when its snapshot is gone fails the check; a
server whose sessions are no sandboxes is skipped, saying why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.env_mutants import StartsOverCoding
from tests.support.participants import TOKEN
from tests.support.scripted import host_scripted
from turnpoint.apps.conformance._kit import Workload
from turnpoint.apps.conformance._report import ConformanceReport, Outcome, render_table
from turnpoint.apps.conformance._runner import ConformanceOptions, run_conformance
from turnpoint.apps.examples._coding import CodingTools
from turnpoint.apps.examples._participants import GuessTools
from turnpoint.apps.examples._task import make_prompt
from turnpoint.participant_sdk import ResourcesServer
from turnpoint.participant_sdk.sandboxes import Isolation

CODING = {
    "task": {"task": "add"},
    "calls": [{"tool": "write_file", "arguments": {"path": "notes.txt", "content": "cut"}}],
}
GUESS = {
    "task": {"task": make_prompt(0, 0).to_dict(), "environment": "guess"},
    "calls": [{"tool": "check", "arguments": {"guess": 1, "turn": 0}}],
}


async def _sandboxes(root: Path, server: ResourcesServer, workload: dict[str, Any]) -> Any:
    async with host_scripted(root, instance="coding-0", resources=server) as served:
        options = ConformanceOptions(
            served.address,
            TOKEN,
            workload=Workload.from_mapping(workload),
            only=("sandboxes",),
            snapshot_root=root,
        )
        report: ConformanceReport = await run_conformance(options)
    return report


@pytest.mark.parametrize("cls", [CodingTools, StartsOverCoding], ids=["honest", "starts-over"])
async def test_the_coding_environment_passes_and_a_server_that_starts_over_fails(
    tmp_path: Path, cls: type[CodingTools]
) -> None:
    server = cls.on_disk(tmp_path / "sandboxes", isolation=Isolation.BWRAP)
    try:
        report = await _sandboxes(tmp_path / "snapshots", server, CODING)
    finally:
        await server.aclose()
    result = report.result("sandboxes")
    if cls is CodingTools:
        assert result.outcome is Outcome.PASS, render_table(report)
        assert "missing, stale, duplicate, expired each refused" in result.detail
        assert "not tried" not in result.detail
    else:
        assert result.outcome is Outcome.FAIL, render_table(report)
        assert result.detail.startswith("missing: "), result.detail
        assert "answered OK, expected NOT_FOUND" in result.detail


async def test_a_server_whose_sessions_are_no_sandboxes_is_skipped_saying_why(
    tmp_path: Path,
) -> None:
    report = await _sandboxes(tmp_path, GuessTools("tools"), GUESS)
    result = report.result("sandboxes")
    assert result.outcome is Outcome.SKIP, render_table(report)
    assert "no sandbox handle" in result.detail
