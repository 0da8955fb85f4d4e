"""What a piece of code fsyncs, by path, in order."""

from __future__ import annotations

import os

import pytest


def record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, every ``os.fsync`` appends the path its descriptor names (as
    ``/proc/self/fd`` reads it back) to the returned list, then syncs."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return synced
