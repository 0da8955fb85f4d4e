"""``turnpoint bench-participant`` runs end to end with tiny sizes and prints figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from turnpoint.apps._cli import main

_NUMBER = r"[0-9][0-9,]*(?:\.[0-9]+)?"


def test_bench_participant_prints_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench-participant", "--episodes", "20", "--parked", "10", "--rounds", "1"]
    assert main([*argv, "--records", "50", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"per episode .*: {_NUMBER} us", out), out
    for door in ("unary", "session"):
        line = re.search(rf"^\s*{door}\s+(.*)$", out, re.MULTILINE)
        assert line is not None, out
        for operation in ("prepare", "commit", "resume"):
            assert re.search(rf"{operation} {_NUMBER} ms", line.group(1)), line.group(1)
    assert re.search(rf"store: {_NUMBER} records/s", out), out


def test_bench_participant_refuses_a_size_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-participant", "--parked", "0"]) == 2
    assert "parked must be >= 1" in capsys.readouterr().out
