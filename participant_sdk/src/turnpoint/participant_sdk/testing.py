"""Deterministic fault injection for the participant SDK's tests and fault drills.

Nothing in the SDK imports this module: a :class:`~turnpoint.participant_sdk.SnapshotStore`
takes an optional :class:`FaultHook` that it calls at each :class:`FaultPoint` of a
write, and :class:`StoreFaults` is the named, deterministic one (torchft's
``fail_at(participant, phase)`` shape) that tests and ``turnpoint serve --faults`` hand
it.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from turnpoint.participant_sdk._store import FaultHook, FaultPoint

__all__ = ["FaultHook", "FaultPoint", "StoreFaults"]


@dataclass(frozen=True, slots=True)
class _Block:
    release: threading.Event
    reached: threading.Event


class StoreFaults:
    """Deterministic, named fault injection for the store's write path.

    Failures raise a real ``OSError`` (``ENOSPC`` by default) from inside the write, so
    callers see exactly what a full disk gives them. Blocks hold a write at a point
    until the test sets an event, so a test can keep a write "in progress" without
    sleeping. Thread-safe; each armed fault fires once per hit, in arming order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[FaultPoint, deque[int]] = {point: deque() for point in FaultPoint}
        self._blocks: dict[FaultPoint, deque[_Block]] = {point: deque() for point in FaultPoint}
        self._hits: dict[FaultPoint, int] = dict.fromkeys(FaultPoint, 0)

    def fail_at(self, point: FaultPoint, count: int = 1, error: int = errno.ENOSPC) -> None:
        """Make the next ``count`` passes through ``point`` raise ``OSError(error)``."""
        if count < 0:
            raise ValueError("count must be >= 0")
        with self._lock:
            self._failures[point].extend([error] * count)

    def fail_writes(self, count: int = 1, error: int = errno.ENOSPC) -> None:
        """Make the next ``count`` records writes fail as a full disk would."""
        self.fail_at(FaultPoint.RECORDS_WRITE, count, error)

    def block_at(self, point: FaultPoint, release: threading.Event) -> threading.Event:
        """Hold the next pass through ``point`` until ``release`` is set.

        Returns an event that is set once a write is being held there.
        """
        reached = threading.Event()
        with self._lock:
            self._blocks[point].append(_Block(release, reached))
        return reached

    def slow_write(self, release: threading.Event) -> threading.Event:
        """Hold the next records write until ``release`` is set (see :meth:`block_at`)."""
        return self.block_at(FaultPoint.RECORDS_WRITE, release)

    def hits(self, point: FaultPoint) -> int:
        """How many times a write has passed ``point``."""
        with self._lock:
            return self._hits[point]

    @classmethod
    def from_spec(cls, spec: str) -> StoreFaults:
        """Build failures from ``"point:count[:ERRNO],..."``, e.g. ``"records_write:2:ENOSPC"``.

        For servers started as subprocesses, which cannot be handed an object.
        """
        faults = cls()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            fields = item.split(":")
            if len(fields) not in (2, 3):
                raise ValueError(f"fault {item!r}: expected 'point:count[:ERRNO]'")
            try:
                point = FaultPoint(fields[0])
            except ValueError:
                names = ", ".join(p.value for p in FaultPoint)
                raise ValueError(f"fault {item!r}: unknown point (one of {names})") from None
            if not fields[1].isdigit():
                raise ValueError(f"fault {item!r}: count must be a non-negative integer")
            code = errno.ENOSPC
            if len(fields) == 3:
                found = getattr(errno, fields[2], None)
                if not fields[2].startswith("E") or not isinstance(found, int):
                    raise ValueError(f"fault {item!r}: unknown errno name {fields[2]!r}")
                code = found
            faults.fail_at(point, int(fields[1]), code)
        return faults

    def hit(self, point: FaultPoint, path: Path) -> None:
        """The store's :class:`~turnpoint.participant_sdk.FaultHook` call."""
        with self._lock:
            self._hits[point] += 1
            block = self._blocks[point].popleft() if self._blocks[point] else None
        if block is not None:
            block.reached.set()
            block.release.wait()
        with self._lock:
            code = self._failures[point].popleft() if self._failures[point] else None
        if code is not None:
            raise OSError(code, os.strerror(code), str(path))
