"""Test-only fault injection: the trainer SIGKILLs itself at a named point of a snapshot.

``turnpoint demo --crash-at POINT[:N]`` hands ``--kill-at POINT[:N]`` to the first demo
trainer, which wires a :class:`KillSwitch` around its snapshot driver (nothing here runs
unless asked for). The switch is pure wiring around three seams the driver already has:

- an :class:`~turnpoint.trainer._snapshots.AnchorSource` proxy (:meth:`KillSwitch.anchor`):
  ``anchor-written``;
- a :class:`~turnpoint.trainer._snapshots.SnapshotParticipants` proxy around the
  coordinator (:meth:`KillSwitch.participants`): ``dispatch-closed`` (the driver closed
  dispatch, drained acknowledgements and flushed retires, and is about to prepare),
  ``prepare-sent``, ``prepared``, ``commit-sent``, ``committed``, ``published`` (the body
  of :meth:`~turnpoint.trainer._coordinator.Coordinator.held` ended: the snapshot is
  published and housekept, nobody resumed yet) and ``resumed``;
- the :class:`~turnpoint.trainer._manifest.SnapshotLayout` ``after_step`` hook
  (:meth:`KillSwitch.after_publish_step`): one point per
  :class:`~turnpoint.trainer._manifest.PublishStep`, from ``verified`` to
  ``latest-moved``.

``prepare-sent`` and ``commit-sent`` land while the call is under way: once some
participant reports (``GetStatus``, read-only, polled on connections opened before the
call) that it holds the checkpoint (prepare) or has written its part (commit), and at the
latest when the call returns (``call_under_way`` in :class:`Fired` says which it was).

Which snapshot. The kill must always leave something worth restoring, or a crash test
proves nothing: a snapshot that cut no rollout in flight has no saved turn to continue.
So ``POINT:N`` counts only snapshots that continued rollouts (some agent exported an
episode): the switch fires at POINT of the first attempt that finds N-1 such snapshots
published, the newest published snapshot among them. From ``manifest-linked`` on the
attempt being killed is itself published, and is what a restore picks; there it must
continue rollouts too, or it is let through (and, published without any, disarms the
switch until a snapshot with some is published again). ``POINT`` alone is ``POINT:1``:
the first attempt, with nothing published before it.

Before the kill, ``on_fire`` gets a :class:`Fired` (the demo trainer appends it to its
event log as a ``kill`` event); then :func:`os.kill` sends SIGKILL to this process: no
``finally`` block, no flush, no atexit handler runs, as in a real crash.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import enum
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from turnpoint.errors import TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.protocol import ParticipantKind
from turnpoint.trainer._control_client import ControlCallError, ParticipantControlClient
from turnpoint.trainer._coordinator import (
    ControlReport,
    PreparedCheckpoint,
    Topology,
    UnackedResolver,
)
from turnpoint.trainer._manifest import ParticipantEntry, PublishStep
from turnpoint.trainer._snapshots import AnchorSource, SnapshotParticipants, WrittenAnchor
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

__all__ = [
    "Fired",
    "KillAt",
    "KillPoint",
    "KillSwitch",
    "ParticipantProbe",
    "StatusProbe",
    "append_event",
    "parse_kill_at",
]

T = TypeVar("T")

_PROBE_INTERVAL_S = 0.001
_PROBE_TIMEOUT_S = 2.0


class KillPoint(enum.Enum):
    """Where in a snapshot the trainer dies, in the order one attempt reaches them."""

    ANCHOR_WRITTEN = "anchor-written"
    DISPATCH_CLOSED = "dispatch-closed"
    PREPARE_SENT = "prepare-sent"
    PREPARED = "prepared"
    COMMIT_SENT = "commit-sent"
    COMMITTED = "committed"
    VERIFIED = "verified"
    TREE_SYNCED = "tree-synced"
    MANIFEST_STAGED = "manifest-staged"
    MANIFEST_LINKED = "manifest-linked"
    SNAPSHOT_SYNCED = "snapshot-synced"
    LATEST_STAGED = "latest-staged"
    LATEST_MOVED = "latest-moved"
    PUBLISHED = "published"
    RESUMED = "resumed"

    @classmethod
    def after(cls, step: PublishStep) -> KillPoint:
        return cls(step.value.replace("_", "-"))

    @property
    def restores_this_snapshot(self) -> bool:
        """A kill here leaves the snapshot being taken published: a restore picks it."""
        order = list(KillPoint)
        return order.index(self) >= order.index(KillPoint.MANIFEST_LINKED)


@dataclass(frozen=True, slots=True)
class KillAt:
    """``POINT[:N]``: die at ``point`` of the ``nth`` snapshot (see the module docstring)."""

    point: KillPoint
    nth: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.nth, bool) or not isinstance(self.nth, int) or self.nth < 1:
            raise ValueError(f"the snapshot number must be an integer >= 1, got {self.nth!r}")

    def __str__(self) -> str:
        return f"{self.point.value}:{self.nth}"

    @classmethod
    def parse(cls, text: str) -> KillAt:
        """``POINT`` or ``POINT:N``; the error names the valid points."""
        name, sep, number = text.strip().partition(":")
        try:
            point = KillPoint(name)
        except ValueError:
            names = [p.value for p in KillPoint]
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"unknown kill point {name!r}{hint}: choose one of {', '.join(names)}"
            ) from None
        if not sep:
            return cls(point)
        try:
            nth = int(number)
        except ValueError:
            nth = 0
        if nth < 1:
            raise ValueError(f"{text!r}: N in POINT:N must be an integer >= 1, got {number!r}")
        return cls(point, nth)


def parse_kill_at(text: str) -> KillAt:
    """:meth:`KillAt.parse` for ``argparse`` (its message reaches the user)."""
    try:
        return KillAt.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True, slots=True)
class Fired:
    """The kill that is about to happen.

    ``newest_published`` is the snapshot a restore should pick. ``call_under_way`` is
    true when a ``-sent`` point landed while the prepare or commit was still running
    (false when it landed as the call returned).
    """

    at: KillAt
    checkpoint_id: str | None
    newest_published: str | None
    call_under_way: bool = False

    def event(self) -> dict[str, Any]:
        return {
            "point": self.at.point.value,
            "nth": self.at.nth,
            "checkpoint_id": self.checkpoint_id,
            "newest_published": self.newest_published,
            "call_under_way": self.call_under_way,
        }


def append_event(path: Path, event: Mapping[str, Any]) -> None:
    """Append one JSON line with a single ``write`` on an ``O_APPEND`` descriptor.

    Safe from any thread next to a writer that appends whole lines: the publish steps
    fire in the worker thread that publishes.
    """
    line = (json.dumps(dict(event), sort_keys=True) + "\n").encode("utf-8")
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------- probing


class ParticipantProbe(Protocol):
    """Tells whether some participant holds a checkpoint in one of ``phases``."""

    async def connect(self) -> None:
        """Be ready to answer at once (open connections)."""
        ...

    async def any_in(self, checkpoint_id: str, phases: Collection[int]) -> bool: ...

    async def aclose(self) -> None: ...


class StatusProbe:
    """:class:`ParticipantProbe` over ``GetStatus`` (read-only), on its own connections."""

    def __init__(self, endpoints: Mapping[str, str], *, token: str) -> None:
        self._endpoints = dict(endpoints)
        self._token = token
        self._clients: dict[str, ParticipantControlClient] = {}

    def _client(self, instance: str) -> ParticipantControlClient:
        client = self._clients.get(instance)
        if client is None:
            client = self._clients[instance] = ParticipantControlClient(
                self._endpoints[instance], token=self._token, participant_name=instance
            )
        return client

    async def _status(self, instance: str) -> pb.GetStatusResponse | None:
        try:
            return await self._client(instance).call(
                pb.GetStatusRequest(max_blockers=0), _PROBE_TIMEOUT_S
            )
        except (ControlCallError, TurnpointError):
            return None  # no answer now: the call under way decides, not the probe

    async def connect(self) -> None:
        await asyncio.gather(*(self._status(name) for name in self._endpoints))

    async def any_in(self, checkpoint_id: str, phases: Collection[int]) -> bool:
        # The first yes decides: a prepare is over within milliseconds, and waiting for
        # the slowest participant's answer would miss it.
        asking = [asyncio.ensure_future(self._status(name)) for name in self._endpoints]
        try:
            for answered in asyncio.as_completed(asking):
                answer = await answered
                if (
                    answer is not None
                    and answer.active_checkpoint_id == checkpoint_id
                    and answer.phase in phases
                ):
                    return True
            return False
        finally:
            for task in asking:
                task.cancel()
            await asyncio.gather(*asking, return_exceptions=True)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


_HOLDING = frozenset({types_pb2.PHASE_PREPARING, types_pb2.PHASE_PREPARED})
_WROTE = frozenset({types_pb2.PHASE_COMMITTED})


# ---------------------------------------------------------------------- the switch


@dataclass(eq=False)
class _Attempt:
    checkpoint_id: str
    continues_rollouts: bool = False
    linked: bool = False  # its manifest is linked: published


class KillSwitch:
    """Fires at most once, at ``at`` (see the module docstring).

    ``kill`` ends the process (SIGKILL by default; tests substitute a recorder).
    """

    def __init__(
        self,
        at: KillAt,
        *,
        probe: ParticipantProbe | None = None,
        on_fire: Callable[[Fired], None] = lambda fired: None,
        kill: Callable[[], None] = _sigkill,
    ) -> None:
        self.at = at
        self._probe = probe
        self._on_fire = on_fire
        self._kill = kill
        self._attempt: _Attempt | None = None
        self._published_with_rollouts = 0
        self._newest_published: str | None = None
        self._newest_continues = True  # nothing published: nothing to restore wrongly
        self.fired: Fired | None = None

    # -- the wiring --------------------------------------------------------------------

    def anchor(self, inner: AnchorSource) -> AnchorSource:
        return _KillingAnchor(inner, self)

    def participants(self, inner: SnapshotParticipants) -> SnapshotParticipants:
        return _KillingParticipants(inner, self)

    def after_publish_step(self, step: PublishStep) -> None:
        """The ``SnapshotLayout(after_step=...)`` hook; runs in the publishing thread."""
        self.reached(KillPoint.after(step))

    async def aclose(self) -> None:
        if self._probe is not None:
            await self._probe.aclose()

    # -- the decision ------------------------------------------------------------------

    def begin(self, checkpoint_id: str) -> None:
        """A new attempt writes its anchor under ``checkpoint_id``."""
        # Counted only now: the snapshots before an attempt are what its kill leaves.
        previous = self._attempt
        if previous is not None and previous.linked:
            self._newest_published = previous.checkpoint_id
            self._newest_continues = previous.continues_rollouts
            self._published_with_rollouts += previous.continues_rollouts
        self._attempt = _Attempt(checkpoint_id)

    def committed(self, entries: Mapping[str, ParticipantEntry]) -> None:
        if self._attempt is not None:
            self._attempt.continues_rollouts = any(
                entry.exported for entry in entries.values() if entry.kind is ParticipantKind.AGENT
            )

    def armed_for(self, point: KillPoint) -> bool:
        """Whether reaching ``point`` now would fire."""
        if self.fired is not None or point is not self.at.point:
            return False
        if self._published_with_rollouts < self.at.nth - 1 or not self._newest_continues:
            return False
        if point.restores_this_snapshot:
            return self._attempt is not None and self._attempt.continues_rollouts
        return True

    def reached(self, point: KillPoint, *, call_under_way: bool = False) -> None:
        attempt = self._attempt
        if self.armed_for(point):
            self.fired = Fired(
                self.at,
                attempt.checkpoint_id if attempt is not None else None,
                attempt.checkpoint_id
                if attempt is not None and point.restores_this_snapshot
                else self._newest_published,
                call_under_way,
            )
            self._on_fire(self.fired)
            self._kill()
        if point is KillPoint.MANIFEST_LINKED and attempt is not None:
            attempt.linked = True

    async def get_ready(self, point: KillPoint) -> None:
        """Before a call :meth:`during` watches: a prepare or commit over open streams
        takes milliseconds, and the probe must not spend them connecting."""
        if self.armed_for(point) and self._probe is not None:
            await self._probe.connect()

    async def during(
        self,
        point: KillPoint,
        checkpoint_id: str,
        call: Awaitable[T],
        phases: Collection[int],
    ) -> T:
        """Run ``call``; reach ``point`` once some participant is in one of ``phases``
        for ``checkpoint_id``, or at the latest when the call has ended."""
        task = asyncio.ensure_future(call)
        try:
            if self.armed_for(point) and self._probe is not None:
                while not task.done():
                    if await self._probe.any_in(checkpoint_id, phases):
                        break
                    await asyncio.wait({task}, timeout=_PROBE_INTERVAL_S)
            else:
                await asyncio.wait({task})
            self.reached(point, call_under_way=not task.done())
            return await task
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


class _KillingAnchor:
    def __init__(self, inner: AnchorSource, switch: KillSwitch) -> None:
        self._inner = inner
        self._switch = switch

    @property
    def step(self) -> int:
        return self._inner.step

    async def write(self, snapshot: Path) -> WrittenAnchor:
        self._switch.begin(snapshot.name)
        written = await self._inner.write(snapshot)
        self._switch.reached(KillPoint.ANCHOR_WRITTEN)
        return written


class _KillingParticipants:
    def __init__(self, inner: SnapshotParticipants, switch: KillSwitch) -> None:
        self._inner = inner
        self._switch = switch

    @property
    def topology(self) -> Topology:
        return self._inner.topology

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        expected: Mapping[str, Iterable[EpisodeId]] | None = None,
        resolve: UnackedResolver | None = None,
    ) -> PreparedCheckpoint:
        switch = self._switch
        switch.reached(KillPoint.DISPATCH_CLOSED)
        await switch.get_ready(KillPoint.PREPARE_SENT)
        prepared = await switch.during(
            KillPoint.PREPARE_SENT,
            checkpoint_id,
            self._inner.prepare(checkpoint_id, expected=expected, resolve=resolve),
            _HOLDING,
        )
        switch.reached(KillPoint.PREPARED)
        return prepared

    def held(
        self, checkpoint: PreparedCheckpoint
    ) -> AbstractAsyncContextManager[PreparedCheckpoint]:
        return self._held(checkpoint)

    @asynccontextmanager
    async def _held(self, checkpoint: PreparedCheckpoint) -> AsyncIterator[PreparedCheckpoint]:
        async with self._inner.held(checkpoint) as held:
            yield held
            # Reached only when the body (commit and publish) did not raise.
            self._switch.reached(KillPoint.PUBLISHED)
        self._switch.reached(KillPoint.RESUMED)

    async def commit(
        self, checkpoint_id: str, snapshot: str, scope: Mapping[str, Iterable[EpisodeId]]
    ) -> dict[str, ParticipantEntry]:
        switch = self._switch
        await switch.get_ready(KillPoint.COMMIT_SENT)
        entries = await switch.during(
            KillPoint.COMMIT_SENT,
            checkpoint_id,
            self._inner.commit(checkpoint_id, snapshot, scope),
            _WROTE,
        )
        switch.committed(entries)
        switch.reached(KillPoint.COMMITTED)
        return entries

    async def resume(
        self, checkpoint_id: str, instances: Iterable[str] | None = None
    ) -> ControlReport:
        return await self._inner.resume(checkpoint_id, instances)

    async def retire(
        self, episodes: Mapping[str, Iterable[EpisodeId]], *, key: str | None = None
    ) -> ControlReport:
        return await self._inner.retire(episodes, key=key)
