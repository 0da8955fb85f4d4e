"""The demo trainer as a real process, started on something it cannot use: one line
that says what, a documented exit status (README.md), never a traceback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.participants import TOKEN, host_example
from turnpoint.apps.examples._build import ExampleSpec

TRAINER = (sys.executable, "-m", "turnpoint.apps.demo._trainer")


def _run(tmp_path: Path, snapshot_root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "token").write_text("tok-123\n")
    topology = tmp_path / "topology.json"
    topology.write_text(
        json.dumps(
            {
                "token_file": str(tmp_path / "token"),
                "snapshot_root": str(snapshot_root),
                "participants": [],
            }
        )
    )
    (tmp_path / "out").mkdir()
    return subprocess.run(
        [*TRAINER, "--topology", str(topology), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )


@pytest.mark.parametrize("what", ["a file", "under a file"])
def test_an_unusable_snapshot_root_is_one_line_and_exit_2(tmp_path: Path, what: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    root = blocker if what == "a file" else blocker / "snapshots"
    result = _run(tmp_path, root)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"trainer: the snapshot root {root} is unusable" in result.stderr


async def test_published_snapshots_none_of_which_is_usable_are_one_line_and_exit_5(
    tmp_path: Path,
) -> None:
    """Starting over would silently lose the run (docs/spec.md section 7.7 item 2)."""
    root = tmp_path / "snapshots"
    torn = root / "ck-000000000001"
    torn.mkdir(parents=True)
    (torn / "MANIFEST.json").write_text("{not json")
    (tmp_path / "token").write_text(TOKEN)
    policy = await host_example(
        "model", "tiny-policy", ExampleSpec(instance="policy", root=root, token=TOKEN)
    )
    try:
        topology = tmp_path / "topology.json"
        topology.write_text(
            json.dumps(
                {
                    "token_file": str(tmp_path / "token"),
                    "snapshot_root": str(root),
                    "participants": [
                        {"instance": "policy", "kind": "model", "address": policy.address}
                    ],
                }
            )
        )
        (tmp_path / "out").mkdir()
        process = await asyncio.create_subprocess_exec(
            *TRAINER,
            "--topology",
            str(topology),
            "--out",
            str(tmp_path / "out"),
            "--resume",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr_bytes = await asyncio.wait_for(process.communicate(), 120)
    finally:
        await policy.stop(0)
    stderr = stderr_bytes.decode()
    assert process.returncode == 5, stderr
    assert "Traceback" not in stderr
    # The restore's warnings, then the one line that ends the run and says why.
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: cannot restore: no published snapshot is usable")
    assert "ck-000000000001" in last
