"""Resources servers: tools, sandboxes and verifiers, with one session per episode.

A Gym resources server subclasses :class:`ResourcesServer`. Data requests (seed, call,
verify) wait out an open checkpoint instead of being refused; a request in flight blocks
prepare (except a REPLAY verify); closing a session is never refused.

What a checkpoint can do with the sessions is the server's ``recovery_mode``:

- ``RESTART_ONLY`` (the default for unaudited servers): sessions cannot be captured.
  They are reported as restarts, never block, and keep running through a checkpoint.
- ``STATELESS``: nothing to save; a restored episode continues against a fresh server.
- ``EXPORTED``: ``export_sessions``, ``restore_session`` and ``retire_session`` must be
  implemented (checked at startup).

A group-scored environment (each sibling's verify waits for all ``group_size``
siblings) must declare ``verify_mode = VerifyMode.REPLAY`` (checked at startup): a WAIT
verify would make prepare wait on siblings that are themselves parked.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.protocol import EpisodeState, ParticipantKind, RecoveryMode, VerifyMode

from ._core import ParticipantCore, WorkKey
from ._effects import (
    EFFECTS_FIELD,
    EffectRecord,
    call_fingerprint,
    check_same_call,
    split_payload,
)
from ._failures import ParticipantError
from ._shared import Shared, invalid_record
from ._store_format import Record

T = TypeVar("T")

SLOT = "session"


class ConfigurationError(ParticipantError, ValueError):
    """A kind declares something it cannot honour; raised when the participant starts."""

    def __init__(self, message: str) -> None:
        super().__init__(Reason.INVALID_ARGUMENT, message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message,))


@dataclass(frozen=True, slots=True)
class Verdict:
    """A verify's score."""

    reward: float
    details: Mapping[str, Any] = field(default_factory=dict)


class ResourcesServer(abc.ABC):
    """What a Gym resources server implements (the module docstring says how).

    Example::

        class GuessTool(ResourcesServer):
            recovery_mode = RecoveryMode.EXPORTED

            def __init__(self) -> None:
                self.sessions: dict[EpisodeId, dict[str, Any]] = {}

            async def seed(self, episode, task):
                self.sessions[episode] = {"target": task["target"], "calls": 0}

            async def call(self, episode, tool, arguments):
                session = self.sessions[episode]
                session["calls"] += 1
                guess = arguments["guess"]
                return {"reply": "correct" if guess == session["target"] else "wrong"}

            async def verify(self, episode, answer):
                return Verdict(1.0 if answer["guess"] == self.sessions[episode]["target"] else 0.0)

            async def close(self, episode):
                self.sessions.pop(episode, None)

            async def export_sessions(self, episodes):
                return {episode: dict(self.sessions[episode]) for episode in episodes}

            async def restore_session(self, saved, episode, state):
                self.sessions[episode] = dict(state)

            async def retire_session(self, episode):
                self.sessions.pop(episode, None)
    """

    recovery_mode: ClassVar[RecoveryMode] = RecoveryMode.RESTART_ONLY
    verify_mode: ClassVar[VerifyMode] = VerifyMode.WAIT
    group_scored: ClassVar[bool] = False
    group_size: ClassVar[int] = 0
    environment: ClassVar[str] = ""

    @abc.abstractmethod
    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        """Create the episode's session."""

    @abc.abstractmethod
    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """Run one tool call in the episode's session."""

    @abc.abstractmethod
    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        """Score the episode's final answer.

        An EXPORTED session is not freed here: it stays, sealed, exported with every cut
        until retired (docs/spec.md section 5.3 item 3), and a restore may ask this
        verify again on the saved session. Free state in ``close`` / ``retire_session``.
        """

    @abc.abstractmethod
    async def close(self, episode: EpisodeId) -> None:
        """End the session and free its state."""

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        """EXPORTED: the state of each session asked for (all of them, plain JSON)."""
        raise NotImplementedError

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        """EXPORTED: install the state ``saved`` (attempt N) exported, as ``episode`` (N+1)."""
        raise NotImplementedError

    async def retire_session(self, episode: EpisodeId) -> None:
        """EXPORTED: drop a session's state for good (retired, or restored but not continued)."""
        raise NotImplementedError

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        """Raise ValueError if a saved session cannot be restored (checked before any install)."""
        return None

    def holds_session(self, episode: EpisodeId) -> bool | None:
        """EXPORTED: whether a session of ``episode`` is installed, or None (the default)
        to let the SDK ask :meth:`export_sessions` after a restore instead. Override it
        where an export is costly (docs/spec.md section 5.6 item 4)."""
        return None

    async def admission_closed(self) -> None:
        """A checkpoint closed admission (a failure makes the prepare fail and reopen)."""
        return None

    async def admission_opened(self) -> None:
        """Admission reopened; may come without a preceding close (after a restore)."""
        return None


_EXPORT_HOOKS = ("export_sessions", "restore_session", "retire_session")


def check_resources_server(server: ResourcesServer) -> None:
    """The startup checks: EXPORTED needs its hooks, group-scored needs REPLAY verifies."""
    if server.recovery_mode is RecoveryMode.EXPORTED:
        missing = [
            name
            for name in _EXPORT_HOOKS
            if getattr(type(server), name) is getattr(ResourcesServer, name)
        ]
        if missing:
            raise ConfigurationError(
                f"{type(server).__name__} declares recovery_mode EXPORTED but does not "
                f"implement {', '.join(missing)}; implement them or declare RESTART_ONLY"
            )
    if server.group_scored:
        if server.verify_mode is not VerifyMode.REPLAY:
            raise ConfigurationError(
                f"{type(server).__name__} is group-scored, so its verify waits on siblings "
                "that a checkpoint may park: declare verify_mode = VerifyMode.REPLAY"
            )
        if server.group_size < 1:
            raise ConfigurationError(
                f"{type(server).__name__} is group-scored: set group_size to the siblings per prompt"
            )


@dataclass(eq=False)
class _Session:
    episode: EpisodeId
    key: WorkKey
    # Request task -> whether it blocks prepare (a REPLAY verify does not).
    inflight: dict[asyncio.Task[Any], bool] = field(default_factory=dict)
    closing: bool = False
    # Set once a verify succeeded on an exported session: the session is sealed (kept,
    # exported with each cut, answering a repeated verify with this) until retired.
    verdict: Verdict | None = None
    # docs/spec.md section 6.12: each keyed call's reply, exported with the session.
    replies: EffectRecord = field(default_factory=EffectRecord)
    # Keyed calls running now: key -> (operation, tool, fingerprint, done).
    pending: dict[str, tuple[str, str, str, asyncio.Future[None]]] = field(default_factory=dict)


class ResourcesHost:
    """Hosts one :class:`ResourcesServer`: its sessions and their requests."""

    slot = SLOT
    kind = ParticipantKind.RESOURCES

    def __init__(self, shared: Shared, server: ResourcesServer) -> None:
        check_resources_server(server)
        self._shared = shared
        self._server = server
        self._sessions: dict[EpisodeId, _Session] = {}

    @property
    def recovery_mode(self) -> RecoveryMode:
        return self._server.recovery_mode

    @property
    def record_key(self) -> str | None:
        return SLOT if self.recovery_mode is RecoveryMode.EXPORTED else None

    def describe(self) -> Mapping[str, object]:
        return {
            "verify_mode": self._server.verify_mode,
            "group_scored": self._server.group_scored,
            "group_size": self._server.group_size,
            "environment": self._server.environment,
        }

    @property
    def _restart_only(self) -> bool:
        return self.recovery_mode is RecoveryMode.RESTART_ONLY

    # ------------------------------------------------------------------ data plane

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> bool:
        """Create the session (waiting out a checkpoint); True if it already existed."""
        shared = self._shared
        async with shared.changing() as core:
            while True:
                core.check_attempt(episode)
                existing = self._sessions.get(episode)
                if existing is not None:
                    return True
                if core.admission_open:
                    break
                await shared.wait_change()
            state = EpisodeState.RESTART if self._restart_only else EpisodeState.REQUEST_IN_FLIGHT
            session = _Session(episode, WorkKey(episode, SLOT))
            core.admit(session.key, state, shared.now())
            self._sessions[episode] = session
            request = self._start(core, session, self._server.seed(episode, task), blocking=True)
        try:
            await self._finish(session, request)
        except BaseException:
            async with shared.changing() as core:
                if self._sessions.get(episode) is session and not session.inflight:
                    del self._sessions[episode]
                    core.remove(session.key, shared.now())
            raise
        return False

    async def call(
        self,
        episode: EpisodeId,
        tool: str,
        arguments: Mapping[str, Any],
        request_id: str = "",
    ) -> Mapping[str, Any]:
        """Run one tool call; a ``request_id`` the session holds answers from its record."""
        if not request_id:
            return await self._request(
                episode, lambda: self._server.call(episode, tool, arguments), replayable=False
            )
        fingerprint = call_fingerprint("call", tool, arguments)
        return await self._request(
            episode,
            lambda: self._once(
                episode,
                request_id,
                ("call", tool, fingerprint),
                lambda: self._server.call(episode, tool, arguments),
                dict,
                dict,
            ),
            replayable=False,
        )

    async def _once(
        self,
        episode: EpisodeId,
        request_id: str,
        call: tuple[str, str, str],
        run: Callable[[], Awaitable[T]],
        encode: Callable[[T], Mapping[str, Any]],
        decode: Callable[[Mapping[str, Any]], T],
    ) -> T:
        """Run a keyed call at most once per session (docs/spec.md section 6.12).

        Runs as the request in flight: the session is registered and admitted. A key
        already recorded answers from the record; one running now is waited for (and
        run here if that run failed, since a failure records nothing).
        """
        operation, tool, fingerprint = call
        session = self._sessions[episode]
        while True:
            recorded = session.replies.lookup(request_id, operation, tool, fingerprint)
            if recorded is not None:
                return decode(recorded)
            running = session.pending.get(request_id)
            if running is None:
                break
            check_same_call(request_id, *running[:3], operation, tool, fingerprint)
            await asyncio.wait([running[3]])
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        session.pending[request_id] = (operation, tool, fingerprint, done)
        try:
            reply = await run()
            session.replies.record(request_id, operation, tool, fingerprint, encode(reply))
            return reply
        finally:
            del session.pending[request_id]
            done.set_result(None)

    async def verify(
        self, episode: EpisodeId, answer: Mapping[str, Any], request_id: str = ""
    ) -> Verdict:
        """Score the answer; a successful verify seals (exported mode) or ends the session.

        docs/spec.md section 5.3 item 3. An exported session is kept, sealed, until the
        coordinator retires its attempt: the agent's cut may still be before this verify
        (its reply held while the agent is closed), so the resources server's cut must
        hold a session that verify can replay on. A repeated verify of a sealed session
        answers the same verdict. A REPLAY verify that finishes while a checkpoint is
        open replies after resume: its session belongs to the frozen cut.
        """
        replayable = self._server.verify_mode is VerifyMode.REPLAY

        def scored() -> Awaitable[Verdict]:
            if not request_id:
                return self._server.verify(episode, answer)
            fingerprint = call_fingerprint("verify", "", answer)
            return self._once(
                episode,
                request_id,
                ("verify", "", fingerprint),
                lambda: self._server.verify(episode, answer),
                _verdict_to_json,
                _verdict_from_json,
            )

        if self.recovery_mode is not RecoveryMode.EXPORTED:
            verdict = await self._request(episode, scored, replayable=replayable)
            await self.close(episode)
            return verdict
        sealed = await self._sealed_verdict(episode, request_id, answer)
        if sealed is not None:
            return sealed
        verdict = await self._request(episode, scored, replayable=replayable)
        shared = self._shared
        async with shared.changing() as core:
            session = self._sessions.get(episode)
            if session is not None and not session.closing:
                session.verdict = verdict
            # The reply waits out an open checkpoint: the session belongs to its cut.
            while not core.admission_open:
                await shared.wait_change()
        return verdict

    async def _sealed_verdict(
        self, episode: EpisodeId, request_id: str, answer: Mapping[str, Any]
    ) -> Verdict | None:
        """The verdict of a sealed session; its own key re-sent with another answer is
        refused first (section 6.12 item 3), as on a session that is not sealed."""
        async with self._shared.changing() as core:
            core.check_attempt(episode)
            session = self._sessions.get(episode)
            if session is None or session.closing or session.verdict is None:
                return None
            if request_id:
                fingerprint = call_fingerprint("verify", "", answer)
                session.replies.lookup(request_id, "verify", "", fingerprint)
            return session.verdict

    async def close(self, episode: EpisodeId) -> bool:
        """End the session and stop its requests; never refused. False if there was none.

        During a checkpoint it waits for resume (the session belongs to the frozen cut),
        except a restart session, which a checkpoint does not capture.
        """
        shared = self._shared
        async with shared.changing() as core:
            while True:
                session = self._sessions.get(episode)
                if session is None:
                    return False
                if session.closing:
                    break
                if core.admission_open or core.is_restart(session.key):
                    session.closing = True
                    # Closing is work in flight: a prepare waits for it to end.
                    core.set_state(session.key, EpisodeState.REQUEST_IN_FLIGHT, shared.now())
                    break
                await shared.wait_change()
        await self._end(episode)
        return True

    async def _request(
        self, episode: EpisodeId, factory: Callable[[], Awaitable[T]], *, replayable: bool
    ) -> T:
        shared = self._shared
        async with shared.changing() as core:
            while True:
                core.check_attempt(episode)
                session = self._sessions.get(episode)
                if session is None or session.closing or session.verdict is not None:
                    # A sealed session takes no more calls (its verify answers from it).
                    raise TurnpointError(
                        Reason.NOT_FOUND, f"no session for {episode}", {"episode": str(episode)}
                    )
                entry = core.entry(session.key)
                # A restart session is not part of any cut: it keeps running.
                if core.admission_open or core.is_restart(session.key):
                    break
                await shared.wait_change()
            if entry is not None and entry.state is EpisodeState.RESTORED:
                core.claim_restored(session.key, EpisodeState.IDLE, shared.now())
            request = self._start(core, session, factory(), blocking=not replayable)
        return await self._finish(session, request)

    def _start(
        self,
        core: ParticipantCore,
        session: _Session,
        work: Awaitable[T],
        *,
        blocking: bool,
    ) -> asyncio.Task[T]:
        """Register a request in flight (lock held, right after the admission check)."""

        async def run() -> T:
            return await work

        request = asyncio.create_task(run())
        session.inflight[request] = blocking
        self._sync_state(core, session)
        return request

    async def _finish(self, session: _Session, request: asyncio.Task[T]) -> T:
        try:
            try:
                return await asyncio.shield(request)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    # The caller went away: its request stops and is no longer counted.
                    request.cancel()
                    await asyncio.wait([request])
                    raise
                # The request itself was stopped, by a retire or a close of its session.
                raise TurnpointError(
                    Reason.STALE_ATTEMPT,
                    f"the request of {session.episode} was stopped (retired or closed)",
                    {"episode": str(session.episode)},
                ) from None
        finally:
            async with self._shared.changing() as core:
                session.inflight.pop(request, None)
                self._sync_state(core, session)

    def _sync_state(self, core: ParticipantCore, session: _Session) -> None:
        if core.entry(session.key) is None:
            return
        if session.closing or any(session.inflight.values()):
            state, replayable = EpisodeState.REQUEST_IN_FLIGHT, False
        elif session.inflight:
            state, replayable = EpisodeState.REQUEST_IN_FLIGHT, True
        else:
            state, replayable = EpisodeState.IDLE, False
        if self._restart_only:
            state = EpisodeState.RESTART
        core.set_state(session.key, state, self._shared.now(), replayable=replayable)

    async def _end(self, episode: EpisodeId, *, retire: bool = False) -> None:
        """Stop the session's requests, free it on the server, drop its entry."""
        session = self._sessions.get(episode)
        if session is None:
            return
        session.closing = True
        requests = [request for request in session.inflight if not request.done()]
        for request in requests:
            request.cancel()
        if requests:
            await asyncio.wait(requests)
        if retire and self.recovery_mode is RecoveryMode.EXPORTED:
            await self._server.retire_session(episode)
        else:
            await self._server.close(episode)
        async with self._shared.changing() as core:
            if self._sessions.get(episode) is session:
                del self._sessions[episode]
            if not retire:
                core.remove(session.key, self._shared.now())

    # ------------------------------------------------------------------ kind hooks

    async def admission_closed(self) -> None:
        await self._server.admission_closed()

    async def admission_opened(self) -> None:
        await self._server.admission_opened()

    async def export(self, keys: Sequence[WorkKey]) -> list[Record]:
        if self.recovery_mode is not RecoveryMode.EXPORTED:
            return []  # stateless: nothing to save (restart-only sessions never get here)
        episodes = [key.episode for key in keys]
        states = await self._server.export_sessions(episodes)
        records: list[Record] = []
        for episode in episodes:
            if episode not in states:
                raise TurnpointError(
                    Reason.INVALID_CHECKPOINT_STATE,
                    f"the resources server's export left out the session of {episode}",
                    {"episode": str(episode)},
                )
            records.append(Record(episode, SLOT, self._with_replies(episode, states[episode])))
        return records

    def _with_replies(self, episode: EpisodeId, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """The session's payload: the server's state plus its reply record, if any."""
        if EFFECTS_FIELD in state:
            raise TurnpointError(
                Reason.INVALID_CHECKPOINT_STATE,
                f"the resources server's export of {episode} uses the reserved field "
                f"{EFFECTS_FIELD!r}",
                {"episode": str(episode), "field": EFFECTS_FIELD},
            )
        session = self._sessions.get(episode)
        if session is None or not len(session.replies):
            return state
        return {**state, EFFECTS_FIELD: session.replies.to_json()}

    def validate(self, record: Record) -> None:
        try:
            state, _ = split_payload(record.payload)
            self._server.validate_session(record.episode, state)
        except (ValueError, TypeError, KeyError) as error:
            raise invalid_record(record, str(error)) from error

    async def install(self, record: Record, episode: EpisodeId) -> WorkKey:
        state, replies = split_payload(record.payload)
        await self._server.restore_session(record.episode, episode, state)
        # docs/spec.md section 5.6 item 4: a restore hook that installs nothing would let
        # the episode continue against an empty session. The server says whether it holds
        # it, or its own export is the one view of its sessions the SDK has.
        held = self._server.holds_session(episode)
        if held is None:
            held = episode in await self._server.export_sessions([episode])
        if not held:
            await self._server.retire_session(episode)
            raise TurnpointError(
                Reason.INVALID_CHECKPOINT_STATE,
                f"{type(self._server).__name__}.restore_session installed nothing for "
                f"{episode}: its export_sessions does not hold the session afterwards",
                {"episode": str(episode)},
            )
        session = _Session(episode, WorkKey(episode, SLOT))
        if replies is not None:
            session.replies = replies
        async with self._shared.changing() as core:
            core.install_restored(session.key, 0, 0, self._shared.now())
            self._sessions[episode] = session
        return session.key

    async def stop(self, key: WorkKey) -> None:
        await self._end(key.episode, retire=True)

    async def aclose(self) -> None:
        requests = [r for s in self._sessions.values() for r in s.inflight if not r.done()]
        for request in requests:
            request.cancel()
        if requests:
            await asyncio.wait(requests)


def _verdict_to_json(verdict: Verdict) -> Mapping[str, Any]:
    return {"reward": verdict.reward, "details": dict(verdict.details)}


def _verdict_from_json(recorded: Mapping[str, Any]) -> Verdict:
    return Verdict(float(recorded["reward"]), dict(recorded["details"]))
