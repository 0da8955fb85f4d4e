"""The demo trainer as a real process, started on something it cannot use: one line
that says what, exit 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TRAINER = (sys.executable, "-m", "turnpoint.apps.demo._trainer")


def _run(tmp_path: Path, snapshot_root: Path) -> subprocess.CompletedProcess[str]:
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
