"""The history file under the snapshot root (docs/spec.md section 7.13.5).

:class:`HistoryLog` appends the history's records, one JSON object per line, from a
background task that writes in a thread: the snapshot path only queues a record. Lines
are not fsynced: the file is for people, and a line lost with a crash shows the attempt
``interrupted``. :func:`read_history` reads the tail of the file for the next process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from turnpoint._json import StrictJSONError, loads_strict
from turnpoint.trainer.storage.manifest import JSONValue

_LOG = logging.getLogger(__name__)
READ_AT_MOST: Final = 8 << 20
"""Bytes of the file's tail a new process reads (the newest records)."""


def read_history(path: Path, at_most: int = READ_AT_MOST) -> list[object]:
    """The records of the file's last ``at_most`` bytes, oldest first; lines that do not
    parse (a torn last line, the cut first line of the tail) are skipped. Blocking."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - at_most))
            data = handle.read()
    except FileNotFoundError:
        return []
    records: list[object] = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        with contextlib.suppress(StrictJSONError):
            records.append(loads_strict(line))
    return records


class HistoryLog:
    """Appends records to ``path`` in the background until :meth:`aclose`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._warned = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._write_all(), name="history-log")

    def append(self, record: Mapping[str, JSONValue] | None) -> None:
        if record is not None and self._task is not None:
            self._queue.put_nowait(_line(record))

    async def aclose(self) -> None:
        """Write what is queued, then stop."""
        if self._task is None:
            return
        self._queue.put_nowait(None)
        await self._task
        self._task = None

    async def _write_all(self) -> None:
        while True:
            lines = [await self._queue.get()]
            while not self._queue.empty():
                lines.append(self._queue.get_nowait())
            done = None in lines
            text = "".join(line for line in lines if line is not None)
            if text:
                try:
                    await asyncio.to_thread(self._write, text)
                except OSError as error:
                    if not self._warned:
                        self._warned = True
                        _LOG.warning("cannot append to %s (warned once): %s", self.path, error)
            if done:
                return

    def _write(self, text: str) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(text)


def _line(record: Mapping[str, JSONValue]) -> str:
    return json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
