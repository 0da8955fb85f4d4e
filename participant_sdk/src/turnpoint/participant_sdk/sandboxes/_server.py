"""A resources server whose sessions are sandboxes, with the protocol written once.

docs/spec.md section 5.7.5. A subclass of :class:`SandboxResourcesServer` fills each
episode's sandbox (:meth:`~SandboxResourcesServer.set_up`), answers its tool calls
(:meth:`~SandboxResourcesServer.tool`) and scores it
(:meth:`~SandboxResourcesServer.score`); this class is the :class:`ResourcesServer` the
SDK hosts, with exported sessions:

- an episode's sandbox is named by its rollout id, so every attempt of a rollout
  reaches the same sandbox, one generation per restore;
- ``export_sessions`` snapshots each session's sandbox: the exported state is the
  snapshot handle, the store it lives in and the subclass's small JSON ``data``;
- ``restore_session`` restores the handle into a new generation under the continued
  attempt (the old generation fenced); ``close`` and ``retire_session`` destroy the
  sandbox, unless a later attempt's restore has taken it over;
- a command in flight when a checkpoint closes admission is waited for (the host's rule
  for every request), or with :attr:`InFlight.CUT` killed, its call failing
  :class:`._errors.CommandCutError`;
- once a checkpoint has ended, snapshots whose retention lapsed are pruned in the
  background, at most once per ``prune_interval_seconds``.

Keyed tool calls are answered from the session's call record (section 6.12) by the host,
so a call re-sent after a restore never runs its command twice.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from turnpoint.ids import EpisodeId
from turnpoint.protocol import RecoveryMode

from .._resources import ResourcesServer, Verdict
from ._errors import (
    CommandCutError,
    SandboxError,
    SandboxExistsError,
    SandboxNotFoundError,
    SnapshotElsewhereError,
    UnsupportedOperationError,
)
from ._provider import Capability, ExecResult, Sandbox, SandboxProvider, SnapshotHandle

# Section 5.7.5 item 4: long enough for any checkpoint a trainer keeps published; an
# operator whose trainer keeps checkpoints longer configures more.
DEFAULT_RETENTION_SECONDS: Final = 7 * 24 * 3600.0
# Section 5.7.5 item 4: how often, at most, the end of a checkpoint prunes what lapsed.
DEFAULT_PRUNE_INTERVAL_SECONDS: Final = 3600.0
_SAVED_FIELDS: Final = frozenset({"sandbox", "data"})
_SANDBOX_FIELDS: Final = frozenset({"store", "handle"})


_logger = logging.getLogger(__name__)


class InFlight(enum.Enum):
    """What a checkpoint does with a sandbox command running when it closes admission."""

    WAIT = "wait"  # prepare waits for it to end
    CUT = "cut"  # it is killed; its call fails CommandCutError


@dataclass
class SandboxSession:
    """One episode's sandbox, and the subclass's own state of it (plain JSON, exported)."""

    episode: EpisodeId
    sandbox: Sandbox
    data: dict[str, Any] = field(default_factory=dict)
    # For a subclass whose calls must not interleave on one session (not exported).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, compare=False, repr=False)


@dataclass(frozen=True)
class SavedSession:
    """What a sandbox session exports: where its snapshot lives, its handle, its data."""

    store: str
    handle: SnapshotHandle
    data: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "sandbox": {"store": self.store, "handle": self.handle.to_json()},
            "data": dict(self.data),
        }

    @classmethod
    def from_json(cls, state: Mapping[str, Any]) -> SavedSession:
        """Strict: anything but the exported shape is ``ValueError``."""
        if not isinstance(state, Mapping) or set(state) != _SAVED_FIELDS:
            raise ValueError(f"a saved sandbox session holds exactly {sorted(_SAVED_FIELDS)}")
        sandbox, data = state["sandbox"], state["data"]
        if not isinstance(sandbox, Mapping) or set(sandbox) != _SANDBOX_FIELDS:
            raise ValueError(f"its sandbox holds exactly {sorted(_SANDBOX_FIELDS)}")
        if not isinstance(sandbox["store"], str) or not isinstance(data, Mapping):
            raise ValueError("its store is not a string or its data not an object")
        handle = SnapshotHandle.from_json(sandbox["handle"])
        return cls(sandbox["store"], handle, data)


class SandboxResourcesServer(ResourcesServer):
    """Subclass it (see the module docstring); the provider opens on first use.

    ``open_provider`` makes the provider (for example
    ``lambda: LocalSandboxProvider.open(root)``); it must reach snapshots durably
    (capability ``snapshot``), since the sessions are exported. ``prune_interval_seconds``
    None: nothing is pruned here (the operator calls the provider's ``prune``).
    """

    recovery_mode: ClassVar[RecoveryMode] = RecoveryMode.EXPORTED

    def __init__(
        self,
        open_provider: Callable[[], Awaitable[SandboxProvider]],
        *,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        in_flight: InFlight = InFlight.WAIT,
        prune_interval_seconds: float | None = DEFAULT_PRUNE_INTERVAL_SECONDS,
    ) -> None:
        self._open_provider = open_provider
        self._provider: SandboxProvider | None = None
        self._opening = asyncio.Lock()
        self._retention_seconds = retention_seconds
        self._in_flight = in_flight
        self._sessions: dict[EpisodeId, SandboxSession] = {}
        # Sandbox id -> the session whose generation is the active one: a session a
        # restore has replaced must not destroy the sandbox its successor runs in.
        self._owners: dict[str, EpisodeId] = {}
        self._commands: set[asyncio.Task[ExecResult]] = set()
        self._cutting = False
        self._prune_interval_seconds = prune_interval_seconds
        self._pruning: asyncio.Task[None] | None = None
        self._last_prune: float | None = None  # monotonic seconds
        self._prune_again = False

    # ------------------------------------------------------------ what a subclass writes

    @abc.abstractmethod
    async def set_up(self, session: SandboxSession, task: Mapping[str, Any]) -> None:
        """Fill the new, empty sandbox for ``task`` (and ``session.data``)."""

    @abc.abstractmethod
    async def tool(
        self, session: SandboxSession, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """Run one tool call in the session's sandbox."""

    @abc.abstractmethod
    async def score(self, session: SandboxSession, answer: Mapping[str, Any]) -> Verdict:
        """Score the episode, typically by running hidden checks in its sandbox."""

    def check_data(self, data: Mapping[str, Any]) -> None:
        """Raise ValueError if a saved session's ``data`` cannot be restored."""
        return None

    # ------------------------------------------------------------ what a subclass calls

    async def provider(self) -> SandboxProvider:
        """The provider, opened on first use (inside the serving event loop)."""
        async with self._opening:
            if self._provider is None:
                provider = await self._open_provider()
                if provider.capability is not Capability.SNAPSHOT:
                    await provider.close()
                    raise UnsupportedOperationError(
                        "hold exported sessions", provider.capability.value
                    )
                self._provider = provider
            return self._provider

    async def run(
        self,
        session: SandboxSession,
        argv: Sequence[str],
        *,
        timeout_seconds: float,
        stdin: bytes = b"",
    ) -> ExecResult:
        """Run a command in the session's sandbox, as the checkpoint's level says."""
        if self._cutting:
            raise CommandCutError(session.sandbox.sandbox_id)
        provider = await self.provider()
        command = asyncio.create_task(
            provider.exec(session.sandbox, argv, timeout_seconds=timeout_seconds, stdin=stdin)
        )
        self._commands.add(command)
        try:
            return await asyncio.shield(command)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if command.cancelled() and current is not None and not current.cancelling():
                raise CommandCutError(session.sandbox.sandbox_id) from None
            command.cancel()  # our caller went away: the command goes with it
            await asyncio.wait([command])
            raise
        finally:
            self._commands.discard(command)

    def session(self, episode: EpisodeId) -> SandboxSession:
        """The episode's session (``KeyError`` if this server holds none)."""
        return self._sessions[episode]

    async def checkpoint(self, session: SandboxSession) -> SnapshotHandle:
        """A snapshot of the session's sandbox now, kept as long as exported ones."""
        provider = await self.provider()
        return await provider.snapshot(session.sandbox, retention_seconds=self._retention_seconds)

    # ------------------------------------------------------------ ResourcesServer

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        provider = await self.provider()
        sandbox_id = episode.rollout_id
        try:
            sandbox = await provider.create(sandbox_id)
        except SandboxExistsError:
            owner = self._owners.get(sandbox_id)
            if owner is not None and owner.attempt >= episode.attempt:
                raise
            # Left by an earlier process, or by an attempt that is dead everywhere.
            await provider.destroy(sandbox_id)
            sandbox = await provider.create(sandbox_id)
        session = SandboxSession(episode, sandbox)
        self._sessions[episode] = session
        self._owners[sandbox_id] = episode
        try:
            await self.set_up(session, task)
        except BaseException:
            await self._drop(episode)
            raise

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        return await self.tool(self._sessions[episode], tool, arguments)

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        return await self.score(self._sessions[episode], answer)

    async def close(self, episode: EpisodeId) -> None:
        await self._drop(episode)

    async def retire_session(self, episode: EpisodeId) -> None:
        await self._drop(episode)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        provider = await self.provider()
        exported: dict[EpisodeId, Mapping[str, Any]] = {}
        for episode in episodes:
            session = self._sessions.get(episode)
            if session is None:
                continue  # the host names what is missing
            handle = await self.checkpoint(session)
            exported[episode] = SavedSession(provider.location, handle, session.data).to_json()
        return exported

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        self.check_data(SavedSession.from_json(state).data)

    def holds_session(self, episode: EpisodeId) -> bool:
        # Not an export: that would snapshot the tree the restore just made.
        return episode in self._sessions

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        restoring = SavedSession.from_json(state)
        provider = await self.provider()
        handle = restoring.handle
        if restoring.store != provider.location:
            raise SnapshotElsewhereError(handle.snapshot_id, restoring.store, provider.location)
        if handle.sandbox_id not in self._owners:
            # Left by an earlier process (which may have restored it under this very
            # attempt: a second crash restores the same cut again). No session here
            # holds it, so it is replaced, not a restore repeated.
            with contextlib.suppress(SandboxNotFoundError):
                await provider.destroy(handle.sandbox_id)
        (restored,) = await provider.restore([handle], attempt=episode.attempt)
        self._sessions[episode] = SandboxSession(episode, restored.sandbox, dict(restoring.data))
        self._owners[handle.sandbox_id] = episode

    async def admission_closed(self) -> None:
        if self._in_flight is InFlight.CUT:
            self._cutting = True
            for command in self._commands:
                command.cancel()

    async def admission_opened(self) -> None:
        self._cutting = False
        self._prune_lapsed()

    def _prune_lapsed(self) -> None:
        """Start a prune in the background when one is due (section 5.7.5 item 4): after
        a checkpoint, never while admission is closed, at most once per interval."""
        interval, provider = self._prune_interval_seconds, self._provider
        if interval is None or provider is None:
            return
        now = time.monotonic()
        if self._last_prune is not None and now - self._last_prune < interval:
            return
        self._last_prune = now
        if self._pruning is not None and not self._pruning.done():
            # It began before this checkpoint ended: one more once it is done.
            self._prune_again = True
            return
        self._pruning = asyncio.create_task(self._prune_until_current(provider))

    async def _prune_until_current(self, provider: SandboxProvider) -> None:
        while True:
            self._prune_again = False
            await _prune(provider)
            if not self._prune_again:
                return

    async def aclose(self) -> None:
        """Stop this process's sandbox processes; sandboxes and snapshots stay on disk."""
        if self._pruning is not None:
            await asyncio.wait([self._pruning])
        if self._provider is not None:
            await self._provider.close()

    async def _drop(self, episode: EpisodeId) -> None:
        session = self._sessions.pop(episode, None)
        if session is None:
            return
        sandbox_id = session.sandbox.sandbox_id
        if self._owners.get(sandbox_id) != episode:
            return  # a restore gave the sandbox to a later attempt: its generation is fenced
        del self._owners[sandbox_id]
        with contextlib.suppress(SandboxNotFoundError):
            await (await self.provider()).destroy(sandbox_id)


async def _prune(provider: SandboxProvider) -> None:
    try:
        pruned = await provider.prune()
    except (SandboxError, OSError):
        # Retried at the next checkpoint past the interval; a store that cannot be
        # pruned never fails a checkpoint.
        _logger.exception("pruning lapsed sandbox snapshots failed")
        return
    if pruned.snapshots:
        _logger.info(
            "pruned %d lapsed sandbox snapshot(s), %d bytes",
            len(pruned.snapshots),
            pruned.bytes_freed,
        )
