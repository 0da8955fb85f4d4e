"""The egress relay: the only route from a harness to its model and its tools
(docs/spec.md sections 12.6 to 12.9), an aiohttp application in the endpoint's style that
only checks, records and forwards.

A harness talks to the relay as its ``OPENAI_BASE_URL`` with a per-episode credential as
its API key (:meth:`EgressRelay.open_episode` issues it, :meth:`EgressRelay.close_episode`
revokes it); it never holds the control token nor the policy endpoint's key. Each call
is tagged with the credential's rollout id and attempt, accepted into the episode's
:class:`~turnpoint.egress.EgressRecord` under the credential's harness generation,
held while a snapshot is open, forwarded whole to the policy endpoint, and its answer
kept in the episode's journal before the harness sees it. A tool call
(``POST /tools/<name>`` with a JSON object) goes the same way to the tool's URL, keyed
for the tool by :func:`~turnpoint.participant_sdk.advanced.effect_key`, and the tool's
answer (status and JSON body) is journaled like a completion. After a restore the journal
answers the fresh harness's calls, model and tool alike, in order until the cut (the
replay rule is :func:`~turnpoint.egress.replay_decision`): a recorded tool call never
reaches its tool again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from aiohttp import web

from turnpoint.egress import (
    CallState,
    Disposition,
    EgressRecord,
    Refusal,
    RefusalReason,
    ReplayAction,
    replay_decision,
    request_digest,
    tool_digest,
)
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import RuntimeConfig
from turnpoint.participant_sdk.advanced import CallPosition, effect_key, retried
from turnpoint.server.openai_api._chat import (
    ATTEMPT_HEADER,
    ROLLOUT_HEADER,
    ApiError,
    chunk_body,
    models_body,
    parse_json,
    sse_event,
)
from turnpoint.server.openai_api._endpoint import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_CALLS,
    openai_errors,
    serve_app,
)

_LOG = logging.getLogger(__name__)

# The version of an episode's exported relay state (docs/spec.md section 12.8).
STATE_VERSION: Final = 1
DEFAULT_UPSTREAM_TIMEOUT_S: Final = 120.0
# The header a forwarded tool call carries its key in (docs/spec.md section 12.9).
IDEMPOTENCY_HEADER: Final = "Idempotency-Key"
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# What one read of an upstream answer takes at most.
_READ_PIECE_BYTES: Final = 1 << 16
# How long a call to a server that cannot be reached is asked again for, by default: as
# long as an SDK agent's model and tool calls are.
DEFAULT_UNREACHABLE_WAIT_S: Final = RuntimeConfig().unreachable_wait_s


class RelayError(ValueError):
    """A relay state that cannot be installed (damaged, or of another version)."""


@dataclass(frozen=True, slots=True)
class RelayOptions:
    """How an :class:`EgressRelay` serves and where it forwards.

    ``upstream`` is the policy endpoint's base URL (``http://host:port/v1``) and
    ``upstream_api_key`` its key: the relay's, never handed to a harness. ``model`` is
    the model name the relay lists at ``GET /v1/models``. ``tools`` names each HTTP tool
    a harness may call through the relay and the URL its calls are posted to.
    ``max_answer_bytes`` caps what the relay reads of an answer (a tool's, the policy
    endpoint's): a larger one is read no further, recorded nowhere and passed on as a
    502 (docs/spec.md section 12.9 item 2), so no upstream makes the relay hold more.
    ``unreachable_wait_s``: how long a call to an upstream that cannot be reached
    (refused, or gone mid-call) is sent again, backing off, before it fails: a lost
    policy or tool server is replaced where it was (docs/spec.md section 7.15).
    """

    upstream: str
    model: str
    upstream_api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS
    upstream_timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S
    tools: Mapping[str, str] = field(default_factory=dict)
    max_answer_bytes: int = DEFAULT_MAX_BODY_BYTES
    unreachable_wait_s: float = DEFAULT_UNREACHABLE_WAIT_S

    def __post_init__(self) -> None:
        if not self.upstream or not self.model:
            raise ValueError("RelayOptions needs the upstream base URL and the model name")
        for name, url in self.tools.items():
            if not _TOOL_NAME.fullmatch(name) or not url.startswith(("http://", "https://")):
                raise ValueError(f"tool {name!r}: a name of [A-Za-z0-9_-] and an HTTP URL")
        if self.max_body_bytes < 1024 or self.max_concurrent_calls < 1:
            raise ValueError("max_body_bytes must be >= 1024, max_concurrent_calls >= 1")
        if self.max_answer_bytes < 1024:
            raise ValueError("max_answer_bytes must be >= 1024")
        if self.unreachable_wait_s < 0:
            raise ValueError("unreachable_wait_s must be >= 0")


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """A completed call, in its harness's order: what replay answers it with.

    A model call's ``response`` is its completion; a tool call's (``tool`` its name) is
    ``{"status", "body"}``, the tool's HTTP status and JSON answer.
    """

    call_id: str
    request_digest: str
    response: Mapping[str, Any]
    tool: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Completed:
    """A model call the relay completed; its answer reaches the harness on release."""

    entry: JournalEntry
    _released: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def release(self) -> None:
        self._released.set()


@dataclass(frozen=True, slots=True)
class Diverged:
    """The harness asked other than the record at ``position``: stopped, to rerun."""

    position: int
    reason: str


class _Credential:
    __slots__ = ("episode", "generation", "secret")

    def __init__(self, episode: RelayEpisode, generation: int) -> None:
        self.secret = "tp-egress-" + secrets.token_urlsafe(24)
        self.episode = episode
        self.generation = generation


def _credential_key(secret: str) -> str:
    # Credentials are looked up by a digest of the secret: the lookup compares digests,
    # never the secret itself, so its time says nothing of how much of a guess was right.
    return hashlib.sha256(secret.encode()).hexdigest()


class RelayEpisode:
    """One episode at the relay: its record, its journal, its harness generations.

    With ``sealed`` on, a completed call's answer is held until the episode's owner
    takes the :class:`Completed` event from :meth:`next_event` and releases it (the
    opaque agent seals its turn boundary first); off, it is answered at once.

    ``turn`` is the episode's last boundary (the restored one after a restore); each
    completed call is one more. A tool call's key is its position after that boundary.
    """

    def __init__(
        self,
        relay: EgressRelay,
        episode: EpisodeId,
        record: EgressRecord,
        journal: list[JournalEntry],
        *,
        sealed: bool,
        turn: int = 0,
    ) -> None:
        self._relay = relay
        self.episode = episode
        self.record = record
        # The completed calls of the harness lineage now running, in its order.
        self.journal = journal
        # What replay answers: the journal as the restore installed it.
        self._replay = [entry.request_digest for entry in journal]
        self._replay_answers = list(journal)
        self._position = 0  # calls the current harness made (answered or forwarded)
        self._ids = itertools.count(len(record.states()))
        self.turn = turn
        self._tool_calls_since_turn = 0
        self._sealed = sealed
        self._events: asyncio.Queue[Completed | Diverged] = asyncio.Queue()
        self._unreleased: set[Completed] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.credential = self._issue(record.generation)
        self.replayed = 0  # calls answered from the record
        self.forwarded = 0  # model calls forwarded to the policy endpoint
        self.tools_forwarded = 0  # tool calls forwarded to their tools
        self.diverged: Diverged | None = None

    @property
    def api_key(self) -> str:
        """The current harness's credential (its ``OPENAI_API_KEY``)."""
        return self.credential.secret

    def _issue(self, generation: int) -> _Credential:
        credential = _Credential(self, generation)
        self._relay._credentials[_credential_key(credential.secret)] = credential
        return credential

    def _wake_all(self) -> None:
        """The episode closed: nothing waits on it any more (held calls, unreleased
        answers); every later event of its calls is refused by the closed record."""
        self._resumed.set()
        for completed in self._unreleased:
            completed.release()
        self._unreleased.clear()

    async def next_event(self) -> Completed | Diverged:
        """The next completed call (to release) or the divergence that stopped replay."""
        return await self._events.get()

    def rerun(self) -> str:
        """Start over from the prompt: a new harness generation, an empty journal, no
        replay; the old generation's unsettled calls are excluded. Returns the new key.

        The turn moves on by one: a tool call the rerun makes before its first completed
        call gets a key no earlier harness used (one in flight at the restored cut had
        the restored turn's), so a tool never takes it for a call it answered already.
        """
        generation = self.record.generation + 1
        self.record.fence(generation)
        self.turn += 1
        self._tool_calls_since_turn = 0
        self.journal = []
        self._replay, self._replay_answers = [], []
        self._position = 0
        self.diverged = None
        self._events = asyncio.Queue()  # nothing of the stopped harness is still to take
        self.credential = self._issue(generation)
        return self.credential.secret

    def export(self) -> dict[str, Any]:
        """The episode's relay state as plain JSON: what a snapshot saves of it."""
        calls: dict[str, str] = {}
        for call_id, state in self.record.states().items():
            final = state.disposition
            # An unsettled call at a boundary: held ones never started, running ones
            # stream a prefix this state does not hold (section 12.6, the cut).
            if final is None:
                held = state is CallState.HELD
                final = Disposition.NEVER_STARTED if held else Disposition.ACTIVE_PREFIX
            calls[call_id] = final.value
        return {
            "version": STATE_VERSION,
            "generation": self.record.generation,
            "calls": calls,
            "journal": [_exported(entry) for entry in self.journal],
        }

    # ------------------------------------------------------------------ snapshots

    def prepare(self, snapshot: str) -> None:
        if not isinstance(self.record.prepare(snapshot), Refusal):
            self._resumed.clear()

    def resume(self, snapshot: str) -> None:
        if not isinstance(self.record.resume(snapshot), Refusal):
            self._resumed.set()

    # ------------------------------------------------------------------ one call

    async def call(self, credential: _Credential, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """One chat call of ``credential``'s harness: replayed, diverged or forwarded."""

        async def forward(_key: str) -> Mapping[str, Any]:
            self.forwarded += 1
            return await self._relay._forward(self.episode, body)

        return await self._relayed(credential, request_digest(body), None, forward)

    async def call_tool(
        self, credential: _Credential, tool: str, body: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """One tool call: replayed, diverged or forwarded under its key; ``{"status",
        "body"}``, the tool's answer."""

        async def forward(key: str) -> Mapping[str, Any]:
            self.tools_forwarded += 1
            return await self._relay._forward_tool(self.episode, tool, body, key)

        return await self._relayed(credential, tool_digest(tool, body), tool, forward)

    async def _relayed(
        self,
        credential: _Credential,
        digest: str,
        tool: str | None,
        forward: Callable[[str], Awaitable[Mapping[str, Any]]],
    ) -> Mapping[str, Any]:
        if credential.generation < self.record.generation:
            raise _fenced(credential.generation, self.record.generation)
        if self.diverged is not None:
            raise _diverged(self.diverged)
        decision = replay_decision(self._replay, self._position, digest)
        if decision.action is ReplayAction.ANSWER:
            self._position += 1
            self.replayed += 1
            return self._replay_answers[decision.position].response
        if decision.action is ReplayAction.DIVERGED:
            self.diverged = Diverged(decision.position, decision.reason)
            self._events.put_nowait(self.diverged)
            raise _diverged(self.diverged)
        kind = "c" if tool is None else "t"
        call_id = f"g{credential.generation}-{kind}{next(self._ids)}"
        accepted = self.record.accept(call_id, credential.generation)
        if isinstance(accepted, Refusal):
            raise _refused(accepted)
        self._position += 1
        # The same key for the same call on every attempt that continues from this
        # boundary: a tool call in flight at a cut is sent again after the restore (its
        # answer is not in the cut), and the tool answers it from its own record.
        key = effect_key(
            self.episode.rollout_id, CallPosition(self.turn, self._tool_calls_since_turn)
        )
        if tool is not None:
            self._tool_calls_since_turn += 1
        try:
            while isinstance(started := self.record.start(call_id), Refusal):
                if started.reason is not RefusalReason.SNAPSHOT_OPEN:
                    raise _refused(started)
                await self._resumed.wait()  # held: no call starts while a snapshot is open
            response = await forward(key)
        except BaseException:
            self.record.fail(call_id)  # refused if it was excluded meanwhile: no change
            raise
        completed = self.record.complete(call_id)
        if isinstance(completed, Refusal):
            raise _refused(completed)  # fenced while it ran: its answer is not recorded
        entry = JournalEntry(call_id, digest, response, tool)
        self.journal.append(entry)
        self.turn += 1
        self._tool_calls_since_turn = 0
        if self._sealed:
            event = Completed(entry)
            self._unreleased.add(event)
            self._events.put_nowait(event)
            try:
                await event._released.wait()
            finally:
                self._unreleased.discard(event)
            if self.record.closed:
                raise _refused(Refusal(RefusalReason.CLOSED, call_id))
        return response


def _exported(entry: JournalEntry) -> dict[str, Any]:
    exported = {
        "call_id": entry.call_id,
        "request_digest": entry.request_digest,
        "response": dict(entry.response),
    }
    if entry.tool is not None:
        exported["tool"] = entry.tool
    return exported


def _fenced(generation: int, current: int) -> ApiError:
    return ApiError(
        409,
        f"this harness (generation {generation}) was replaced by generation {current}",
        code="fenced_generation",
    )


def _diverged(diverged: Diverged) -> ApiError:
    return ApiError(409, diverged.reason, code="replay_diverged")


def _refused(refusal: Refusal) -> ApiError:
    excluded = refusal.reason is RefusalReason.SETTLED and refusal.detail == "excluded"
    if refusal.reason is RefusalReason.FENCED_GENERATION or excluded:
        return ApiError(
            409, refusal.detail or "this harness was replaced", code="fenced_generation"
        )
    # Only the episode's end settles a held call as never started.
    never_started = refusal.reason is RefusalReason.SETTLED and refusal.detail == "never_started"
    if refusal.reason is RefusalReason.CLOSED or never_started:
        return ApiError(409, "the episode has ended", code="episode_closed")
    return ApiError(409, f"the call was refused: {refusal.reason.value}", code=refusal.reason.value)


class EgressRelay:
    """The relay's HTTP front and its episodes.

    ``async with EgressRelay(options) as relay`` serves on ``relay.base_url``; a harness
    gets that as ``OPENAI_BASE_URL`` and ``relay.open_episode(...).api_key`` as its
    ``OPENAI_API_KEY``.
    """

    def __init__(self, options: RelayOptions) -> None:
        self._options = options
        self._episodes: dict[EpisodeId, RelayEpisode] = {}
        self._credentials: dict[str, _Credential] = {}
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._open_snapshot: str | None = None
        self.port: int | None = None
        self.calls_active = 0

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the relay is not started")
        return f"http://{self._options.host}:{self.port}/v1"

    @property
    def tools_url(self) -> str:
        """Where a harness calls its tools: ``POST <tools_url>/<name>``."""
        if self.port is None:
            raise RuntimeError("the relay is not started")
        return f"http://{self._options.host}:{self.port}/tools"

    @property
    def tools(self) -> tuple[str, ...]:
        return tuple(self._options.tools)

    # ------------------------------------------------------------------ episodes

    def open_episode(
        self,
        episode: EpisodeId,
        state: Mapping[str, Any] | None = None,
        *,
        sealed: bool = False,
        turn: int = 0,
    ) -> RelayEpisode:
        """Open ``episode`` (fresh, or installing an exported ``state`` to replay, saved at
        boundary ``turn``) and issue its harness's credential. Raises :class:`RelayError`
        for a damaged state."""
        if episode in self._episodes:
            raise RelayError(f"the relay holds {episode} already")
        journal: list[JournalEntry] = []
        record = EgressRecord()
        if state is not None:
            record, journal = _installed(state)
        opened = RelayEpisode(self, episode, record, journal, sealed=sealed, turn=turn)
        if self._open_snapshot is not None:
            opened.prepare(self._open_snapshot)
        self._episodes[episode] = opened
        return opened

    def close_episode(self, episode: EpisodeId) -> None:
        """The episode ended: its record closes and every credential it issued is revoked."""
        closed = self._episodes.pop(episode, None)
        if closed is None:
            return
        closed.record.close()
        closed._wake_all()
        for key, credential in list(self._credentials.items()):
            if credential.episode is closed:
                del self._credentials[key]

    def prepare(self, snapshot: str) -> None:
        """A snapshot opens: no episode's call is forwarded until :meth:`resume`."""
        self._open_snapshot = snapshot
        for episode in self._episodes.values():
            episode.prepare(snapshot)

    def resume(self, snapshot: str) -> None:
        if self._open_snapshot == snapshot:
            self._open_snapshot = None
        for episode in self._episodes.values():
            episode.resume(snapshot)

    # ------------------------------------------------------------------ serving

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[openai_errors], client_max_size=self._options.max_body_bytes
        )
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tools/{tool}", self.tool_call)
        return app

    async def start(self) -> str:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._options.upstream_timeout_s)
        )
        try:
            self._runner, self.port = await serve_app(
                self.app(), self._options.host, self._options.port
            )
        except BaseException:
            await self._session.close()
            raise
        return self.base_url

    async def close(self) -> None:
        for episode in list(self._episodes):
            self.close_episode(episode)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EgressRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _authenticate(self, request: web.Request) -> _Credential:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            credential = self._credentials.get(_credential_key(given))
            if credential is not None:
                return credential
        raise ApiError(401, "invalid API key", code="invalid_api_key")

    async def models(self, request: web.Request) -> web.StreamResponse:
        self._authenticate(request)
        return web.json_response(models_body([self._options.model]))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        credential = self._authenticate(request)
        self._admit(request)
        self.calls_active += 1
        try:
            body = parse_json(await request.read())
            stream = body.get("stream") is True
            response = await credential.episode.call(credential, body)
            if stream:
                return await _streamed(request, response)
            return web.json_response(response)
        finally:
            self.calls_active -= 1

    async def tool_call(self, request: web.Request) -> web.StreamResponse:
        credential = self._authenticate(request)
        tool = request.match_info["tool"]
        if tool not in self._options.tools:
            raise ApiError(404, f"the relay has no tool {tool!r}", code="tool_not_found")
        self._admit(request)
        self.calls_active += 1
        try:
            body = parse_json(await request.read())
            answer = await credential.episode.call_tool(credential, tool, body)
            return web.json_response(answer["body"], status=int(answer["status"]))
        finally:
            self.calls_active -= 1

    def _admit(self, request: web.Request) -> None:
        """The caps every call is under: calls under way, and the body's size."""
        if self.calls_active >= self._options.max_concurrent_calls:
            raise ApiError(
                429,
                f"more than {self._options.max_concurrent_calls} calls under way; retry later",
                "rate_limit_error",
                code="too_many_calls",
            )
        cap = self._options.max_body_bytes
        if request.content_length is not None and request.content_length > cap:
            raise ApiError(
                413, f"the request body is larger than {cap} bytes", code="request_too_large"
            )

    async def _forward(self, episode: EpisodeId, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """The call, whole, to the policy endpoint under the episode's headers."""
        assert self._session is not None, "the relay is not started"
        whole = {key: value for key, value in body.items() if key != "stream_options"}
        whole["stream"] = False
        headers = {ROLLOUT_HEADER: episode.rollout_id, ATTEMPT_HEADER: str(episode.attempt)}
        if self._options.upstream_api_key is not None:
            headers["Authorization"] = f"Bearer {self._options.upstream_api_key}"
        status, payload = await self._post(
            self._options.upstream + "/chat/completions", whole, headers, "the policy endpoint"
        )
        try:
            decoded = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            decoded = None
        if status != 200 or not isinstance(decoded, dict):
            raise _upstream_error(status, decoded)
        return decoded

    async def _post(
        self, url: str, body: Mapping[str, Any], headers: Mapping[str, str], what: str
    ) -> tuple[int, bytes]:
        """POST ``body`` to ``url``: the status and the body. A redirect is the answer,
        never followed: the relay reaches only the URLs it was configured with. An
        upstream that cannot be reached (refused, or gone before its whole answer) is
        asked again, backing off, for up to ``unreachable_wait_s``: a replaced server
        comes back where it was. Asking again is safe: a tool's call carries its key, and
        a model call's lost answer was never passed on (it is generated afresh, as an SDK
        agent's is). A slow upstream (its timeout) is not asked again."""
        session = self._session
        assert session is not None, "the relay is not started"

        async def attempt() -> tuple[int, bytes]:
            try:
                async with session.post(
                    url, json=dict(body), headers=dict(headers), allow_redirects=False
                ) as answer:
                    return answer.status, await _read_capped(
                        answer, self._options.max_answer_bytes, what
                    )
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
                if session.closed:
                    raise _unreachable(what, error) from None
                # Asked again by retried() while the wait lasts.
                raise TurnpointError(
                    Reason.UNAVAILABLE, f"{what} is unreachable: {error}"
                ) from None
            except (aiohttp.ClientError, TimeoutError) as error:
                raise _unreachable(what, error) from None

        try:
            return await retried(
                attempt,
                unreachable_wait_s=self._options.unreachable_wait_s,
                retries=0,
                reasons=_UNREACHABLE,
                what=what,
            )
        except TurnpointError as error:
            raise ApiError(502, error.message, "server_error", code="upstream") from None

    async def _forward_tool(
        self, episode: EpisodeId, tool: str, body: Mapping[str, Any], key: str
    ) -> Mapping[str, Any]:
        """The tool call to its tool under the episode's headers and its key. Whatever
        status the tool answers with is its answer; one that is not JSON is a 502."""
        assert self._session is not None, "the relay is not started"
        headers = {
            ROLLOUT_HEADER: episode.rollout_id,
            ATTEMPT_HEADER: str(episode.attempt),
            IDEMPOTENCY_HEADER: key,
        }
        status, payload = await self._post(
            self._options.tools[tool], dict(body), headers, f"the tool {tool!r}"
        )
        try:
            decoded = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ApiError(
                502, f"the tool {tool!r} answered no JSON", "server_error", code="upstream"
            ) from None
        return {"status": status, "body": decoded}


_UNREACHABLE: Final = frozenset({Reason.UNAVAILABLE})


def _unreachable(what: str, error: BaseException) -> ApiError:
    return ApiError(502, f"{what} is unreachable: {error}", "server_error", code="upstream")


async def _read_capped(answer: aiohttp.ClientResponse, cap: int, what: str) -> bytes:
    """The answer's body, read piece by piece and never past ``cap`` bytes: a larger one
    (declared or streamed) is refused as soon as it shows, and leaving the response
    unread closes its connection."""
    if answer.content_length is not None and answer.content_length > cap:
        raise _too_large(what, cap)
    kept = bytearray()
    async for piece in answer.content.iter_chunked(_READ_PIECE_BYTES):
        kept += piece
        if len(kept) > cap:
            raise _too_large(what, cap)
    return bytes(kept)


def _too_large(what: str, cap: int) -> ApiError:
    return ApiError(
        502,
        f"{what} answered more than {cap} bytes: the answer was dropped unread",
        "server_error",
        code="upstream_too_large",
    )


def _upstream_error(status: int, decoded: object) -> ApiError:
    """The policy endpoint's refusal, passed on as it said it (its status and error)."""
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if status >= 400 and isinstance(error, dict):
        return ApiError(
            status,
            str(error.get("message", "the policy endpoint refused the call")),
            str(error.get("type", "invalid_request_error")),
            error.get("param") if isinstance(error.get("param"), str) else None,
            error.get("code") if isinstance(error.get("code"), str) else None,
        )
    return ApiError(
        502, "the policy endpoint answered no completion", "server_error", code="upstream"
    )


async def _streamed(request: web.Request, completion: Mapping[str, Any]) -> web.StreamResponse:
    """A recorded whole completion as a stream: the role, its text, the finish, [DONE]."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    ident, created, model = (
        completion.get("id", ""),
        completion.get("created", 0),
        completion.get("model", ""),
    )
    choice = (completion.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    with contextlib.suppress(ConnectionResetError):
        for delta, finish in (
            ({"role": "assistant", "content": ""}, None),
            ({"content": text}, None),
            ({}, choice.get("finish_reason") or "stop"),
        ):
            if delta.get("content") == "" and "role" not in delta:
                continue
            await response.write(sse_event(chunk_body(ident, created, model, delta, finish)))
        await response.write(sse_event("[DONE]"))
    return response


def check_relay_state(state: object) -> None:
    """Raise :class:`RelayError` unless ``state`` is an installable exported relay state."""
    if not isinstance(state, Mapping):
        raise RelayError("the relay state is missing or not an object")
    _installed(state)


def _installed(state: Mapping[str, Any]) -> tuple[EgressRecord, list[JournalEntry]]:
    """The record and journal an exported state holds, under a new harness generation."""
    try:
        if state["version"] != STATE_VERSION:
            raise RelayError(f"relay state version {state['version']!r} is not {STATE_VERSION}")
        generation = int(state["generation"])
        calls = {str(call): Disposition(value) for call, value in state["calls"].items()}
        journal = [
            JournalEntry(
                str(item["call_id"]),
                str(item["request_digest"]),
                dict(item["response"]),
                None if item.get("tool") is None else str(item["tool"]),
            )
            for item in state["journal"]
        ]
    except RelayError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise RelayError(f"a damaged relay state: {error!r}") from None
    for entry in journal:
        if calls.get(entry.call_id) is not Disposition.COMPLETED:
            raise RelayError(f"the journal's call {entry.call_id} is not a completed call")
    return EgressRecord.restored(calls, generation + 1), journal
