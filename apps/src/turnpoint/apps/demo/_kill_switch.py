"""Test-only fault injection: the trainer SIGKILLs itself at a named point of a snapshot.

``turnpoint demo --crash-at POINT[:N]`` hands ``--kill-at POINT[:N]`` to the first demo
trainer (a sequence ``POINT[:N],...`` its k-th entry to the k-th), which attaches a :class:`KillSwitch` to its snapshot driver (nothing here runs
unless asked for). The points are the trainer's own
(:class:`~turnpoint.trainer.snapshots.attempt.SnapshotPoint`, here :data:`KillPoint`), and the
switch only watches, it wraps nothing:

- it subscribes to the driver's attempt transitions (:meth:`KillSwitch.attach`): each
  transition passes the points :func:`~turnpoint.trainer.snapshots.attempt.points_of` names, from
  ``anchor-written`` to ``resumed``;
- the :class:`~turnpoint.trainer.storage.manifest.SnapshotLayout` ``after_step`` hook
  (:meth:`KillSwitch.after_publish_step`) gives one point per
  :class:`~turnpoint.trainer.storage.manifest.PublishStep`, from ``verified`` to
  ``latest-moved``.

``prepare-sent`` and ``commit-sent`` land while the call is under way: once some
participant reports (``GetStatus``, read-only, polled on connections opened when the
attempt began) that it holds the checkpoint (prepare) or has written its part (commit),
and at the latest when the attempt leaves that state (``call_under_way`` in
:class:`Fired` says which it was).

Which snapshot. The kill must always leave something worth restoring, or a crash test
proves nothing: a snapshot that cut no rollout in flight has no saved turn to continue.
So ``POINT:N`` counts only snapshots that continued rollouts (the attempt's commit
continued some episode): the switch fires at POINT of the first attempt that finds N-1
such snapshots published, the newest published snapshot among them. From
``manifest-linked`` on the attempt being killed is itself published, and is what a
restore picks; there it must continue rollouts too, or it is let through (and,
published without any, disarms the switch until a snapshot with some is published
again). ``POINT`` alone is ``POINT:1``: the first attempt, with nothing published before
it. The switch counts only the attempts of its own process: a restored trainer's ``N``
counts from its start, and its ``newest_published`` names only what it published itself
(at ``POINT:1`` past the first incarnation a restore picks the snapshot this one
restored, which the event does not name: give later incarnations ``N`` of 2 or more).

A restored trainer (``restored``, a ``--crash-at`` sequence's later entries) must also
leave proof of its own restore before it dies, or the crash test of that restore proves
nothing: it fires only once :meth:`KillSwitch.continuation_seen` says a rollout the
restore resumed from a saved turn has finished (or that it resumed none).

Before the kill, ``on_fire`` gets a :class:`Fired` (the demo trainer appends it to its
event log as a ``kill`` event); then :func:`os.kill` sends SIGKILL to this process: no
``finally`` block, no flush, no atexit handler runs, as in a real crash. A ``kill`` that
returns or raises instead (tests raise) ends the attempt at once when the point is a
transition's, and at the attempt's next transition when it landed while a call was under
way.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import signal
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from turnpoint.errors import TurnpointError
from turnpoint.trainer.advanced import (
    ControlCallError,
    ParticipantControlClient,
    SnapshotDriver,
    SnapshotState,
)
from turnpoint.trainer.testing import PublishStep, SnapshotPoint, points_of
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

_PROBE_INTERVAL_S = 0.001
_PROBE_TIMEOUT_S = 2.0

KillPoint = SnapshotPoint
"""Where in a snapshot the trainer dies: the trainer's snapshot points, in the order one
attempt reaches them (spelled once, in :mod:`turnpoint.trainer.snapshots.attempt`)."""


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
                if answer is not None and (
                    (answer.active_checkpoint_id == checkpoint_id and answer.phase in phases)
                    # A commit that ended the checkpoint (docs/spec.md section 4.8 item
                    # 9) leaves the participant idle: it says what it wrote instead.
                    or (
                        types_pb2.PHASE_COMMITTED in phases
                        and answer.committed_checkpoint_id == checkpoint_id
                    )
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

# What a probe must see, per point that lands while its call is under way.
_SEEN_DURING: Final[Mapping[SnapshotPoint, frozenset[int]]] = {
    KillPoint.PREPARE_SENT: _HOLDING,
    KillPoint.COMMIT_SENT: _WROTE,
}
_WATCHED_STATES: Final = frozenset(
    state for point in _SEEN_DURING if (state := point.during) is not None
)


@dataclass(eq=False)
class _Attempt:
    checkpoint_id: str
    continues_rollouts: bool = False
    linked: bool = False  # its manifest is linked: published


class KillSwitch:
    """Fires at most once, at ``at`` (see the module docstring).

    ``kill`` ends the process (SIGKILL by default; tests substitute a recorder).
    ``restored``: the trainer restores at start, and the switch waits for
    :meth:`continuation_seen`.
    """

    def __init__(
        self,
        at: KillAt,
        *,
        probe: ParticipantProbe | None = None,
        on_fire: Callable[[Fired], None] = lambda fired: None,
        kill: Callable[[], None] = _sigkill,
        restored: bool = False,
    ) -> None:
        self.at = at
        # Read from the publishing thread too: one flag, set once, never cleared.
        self._continuation_seen = not restored
        self._probe = probe
        self._on_fire = on_fire
        self._kill = kill
        self._driver: SnapshotDriver | None = None
        self._attempt: _Attempt | None = None
        self._published_with_rollouts = 0
        self._newest_published: str | None = None
        self._newest_continues = True  # nothing published: nothing to restore wrongly
        self._connecting: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self._landed: set[SnapshotPoint] = set()
        # A kill that did not end the process while a call was under way: the attempt
        # ends at its next transition.
        self._pending: BaseException | None = None
        self.fired: Fired | None = None

    # -- the wiring --------------------------------------------------------------------

    def attach(self, driver: SnapshotDriver) -> None:
        """Watch every attempt ``driver`` takes from now on."""
        self._driver = driver
        driver.subscribe(self.on_transition)

    def after_publish_step(self, step: PublishStep) -> None:
        """The ``SnapshotLayout(after_step=...)`` hook; runs in the publishing thread."""
        self.reached(KillPoint.after(step))

    def continuation_seen(self) -> None:
        """The trainer's restore continued work: a rollout it resumed from a saved turn
        finished, or it resumed none. A restored trainer's switch fires only after this."""
        self._continuation_seen = True

    async def aclose(self) -> None:
        for task in (self._watching, self._connecting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._probe is not None:
            await self._probe.aclose()

    # -- the transitions ---------------------------------------------------------------

    def on_transition(
        self, attempt_id: str, old: SnapshotState, new: SnapshotState, now: float
    ) -> None:
        """A :meth:`~turnpoint.trainer.snapshots.driver.SnapshotDriver.subscribe` callback."""
        pending, self._pending = self._pending, None
        if pending is not None:
            raise pending
        if old is SnapshotState.RELEASE and new is SnapshotState.ANCHOR:
            self.begin(attempt_id)
        if old in _WATCHED_STATES:
            self._stop_watching()
        if new is SnapshotState.PUBLISH and self._attempt is not None and self._driver is not None:
            # Committed: whether this snapshot continues any rollout in flight.
            view = self._driver.attempt
            self._attempt.continues_rollouts = view is not None and view.continued > 0
        for point in points_of(old, new):
            if point not in self._landed:
                self.reached(point)
        for point in _SEEN_DURING:
            if point.during is new and self.armed_for(point) and self._probe is not None:
                self._watch(point, attempt_id)

    def begin(self, checkpoint_id: str) -> None:
        """A new attempt writes its anchor under ``checkpoint_id``."""
        # Counted only now: the snapshots before an attempt are what its kill leaves.
        previous = self._attempt
        if previous is not None and previous.linked:
            self._newest_published = previous.checkpoint_id
            self._newest_continues = previous.continues_rollouts
            self._published_with_rollouts += previous.continues_rollouts
        self._attempt = _Attempt(checkpoint_id)
        self._landed = set()
        armed = any(self.armed_for(point) for point in _SEEN_DURING)
        if armed and self._probe is not None and self._connecting is None:
            # A prepare or commit over open streams takes milliseconds: the probe must
            # not spend them connecting.
            self._connecting = asyncio.get_running_loop().create_task(
                self._probe.connect(), name="kill-switch-probe-connect"
            )

    # -- the decision ------------------------------------------------------------------

    def armed_for(self, point: KillPoint) -> bool:
        """Whether reaching ``point`` now would fire."""
        if self.fired is not None or point is not self.at.point or not self._continuation_seen:
            return False
        if self._published_with_rollouts < self.at.nth - 1 or not self._newest_continues:
            return False
        if point.restores_this_snapshot:
            return self._attempt is not None and self._attempt.continues_rollouts
        return True

    def reached(self, point: KillPoint, *, call_under_way: bool = False) -> None:
        attempt = self._attempt
        self._landed.add(point)
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

    # -- while a call is under way -----------------------------------------------------

    def _watch(self, point: KillPoint, checkpoint_id: str) -> None:
        self._stop_watching()
        self._watching = asyncio.get_running_loop().create_task(
            self._watch_call(point, checkpoint_id, _SEEN_DURING[point]),
            name=f"kill-switch-{point.value}",
        )

    def _stop_watching(self) -> None:
        watching, self._watching = self._watching, None
        if watching is not None:
            watching.cancel()

    async def _watch_call(
        self, point: KillPoint, checkpoint_id: str, phases: Collection[int]
    ) -> None:
        """Reach ``point`` once some participant is in one of ``phases`` for
        ``checkpoint_id``; the attempt's next transition stops this watch."""
        probe = self._probe
        assert probe is not None
        if self._connecting is not None:
            await asyncio.gather(self._connecting, return_exceptions=True)
        # Polled: the participants' state is only known by asking.
        while True:
            if await probe.any_in(checkpoint_id, phases):
                break
            await asyncio.sleep(_PROBE_INTERVAL_S)
        try:
            self.reached(point, call_under_way=True)
        except BaseException as error:  # noqa: BLE001
            # The kill returned control (a test's): it ends the attempt at its next
            # transition, as a SIGKILL would have ended it here.
            self._pending = error
