"""The OpenAI-compatible HTTP endpoint in front of a policy participant (docs/spec.md
section 12): an aiohttp application that only checks, converts and calls.

Every generation goes through the participant's own admission, ``ParticipantRuntime.
generate``: a call arriving while a snapshot's prepare holds admission closed waits at the
gate until resume, and a call already streaming is either streamed to its end (the
prepare waits for it) or, when the model cuts and ``cut_at_checkpoints`` is on, cut at a
token boundary and continued from prompt plus prefix once admission reopens, inside the
same HTTP response (section 5.5 item 6). Nothing here generates by another path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import GenerateChunk, GenerateRequest, ParticipantRuntime
from turnpoint.server.openai_api._chat import (
    ATTEMPT_HEADER,
    ROLLOUT_HEADER,
    ApiError,
    ChatRequest,
    ChatTemplate,
    Completion,
    TemplateError,
    bad_request,
    chunk_body,
    completion_body,
    episode_of,
    models_body,
    parse_chat_request,
    parse_json,
    sse_event,
    text_delta,
    usage_chunk_body,
)

_LOG = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES: Final = 1 << 20
DEFAULT_MAX_TOKENS: Final = 512
# A harness flooding calls gets 429s past this, so the endpoint's memory stays bounded.
DEFAULT_MAX_CONCURRENT_CALLS: Final = 64
# The token field names of the SDK's INVALID_ARGUMENT metadata, as the API calls them.
_PARAM_OF_FIELD: Final = {
    "max_new_tokens": "max_completion_tokens",
    "prompt_token_ids": "messages",
}
_STATUS_OF_REASON: Final = {
    Reason.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Reason.NOT_FOUND: (404, "invalid_request_error"),
    Reason.STALE_ATTEMPT: (409, "invalid_request_error"),
    Reason.UNAUTHENTICATED: (401, "invalid_request_error"),
}


@dataclass(frozen=True, slots=True)
class EndpointOptions:
    """How a :class:`ChatEndpoint` serves.

    ``model`` is the one model name it answers to. ``api_key``, when set, is required as
    ``Authorization: Bearer``. ``open_calls`` lets a call without the episode headers
    through, as the episode ``openai-open`` attempt 0. ``max_tokens`` bounds (and is
    the default of) a completion's length; ``max_body_bytes`` a request body;
    ``max_concurrent_calls`` the chat calls under way at once (held ones included).
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    open_calls: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS
    cut_at_checkpoints: bool = True

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EndpointOptions.model must name the model")
        if self.max_body_bytes < 1024 or self.max_tokens < 1 or self.max_concurrent_calls < 1:
            raise ValueError(
                "max_body_bytes must be >= 1024, max_tokens and max_concurrent_calls >= 1"
            )


def _api_error_of(error: TurnpointError) -> ApiError:
    status, kind = _STATUS_OF_REASON.get(error.reason, (503, "server_error"))
    field = error.metadata.get("field")
    param = _PARAM_OF_FIELD.get(field, field) if field is not None else None
    return ApiError(status, error.message, kind, param, error.reason.name.lower())


def _json(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure answers an OpenAI-shaped error, never a traceback."""
    try:
        return await handler(request)
    except ApiError as error:
        return _json(error)
    except TurnpointError as error:
        return _json(_api_error_of(error))
    except web.HTTPException as error:
        if error.status < 400:
            raise
        if error.status == 413:
            return _json(ApiError(413, "the request body is too large", code="request_too_large"))
        return _json(ApiError(error.status, error.reason or "request refused"))
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a bug answers 500 with a message (logged here)
        _LOG.exception("OpenAI endpoint: %s %s failed", request.method, request.path)
        return _json(ApiError(500, "internal error (see the server's log)", "server_error"))


class ChatEndpoint:
    """``POST /v1/chat/completions`` and ``GET /v1/models`` for one policy participant.

    ``async with ChatEndpoint(runtime, template, options) as endpoint`` serves on
    ``endpoint.base_url`` (``http://host:port/v1``, the ``base_url`` of an OpenAI client).
    """

    def __init__(
        self, runtime: ParticipantRuntime, template: ChatTemplate, options: EndpointOptions
    ) -> None:
        self._runtime = runtime
        self._template = template
        self._options = options
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(4)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        # Calls that passed every check and went to the participant's admission.
        self.calls_admitted = 0
        # Chat calls under way (reading, held at the gate or generating).
        self.calls_active = 0

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the endpoint is not started")
        return f"http://{self._options.host}:{self.port}/v1"

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[openai_errors], client_max_size=self._options.max_body_bytes
        )
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def start(self) -> str:
        self._runner, self.port = await serve_app(
            self.app(), self._options.host, self._options.port
        )
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ChatEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ handlers

    def _authenticate(self, request: web.Request) -> None:
        key = self._options.api_key
        if key is None:
            return
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            raise ApiError(401, "invalid API key", code="invalid_api_key")

    async def models(self, request: web.Request) -> web.StreamResponse:
        self._authenticate(request)
        return web.json_response(models_body([self._options.model]))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._authenticate(request)
        if self.calls_active >= self._options.max_concurrent_calls:
            raise ApiError(
                429,
                f"more than {self._options.max_concurrent_calls} calls under way; retry later",
                "rate_limit_error",
                code="too_many_calls",
            )
        self.calls_active += 1
        try:
            return await self._chat(request)
        finally:
            self.calls_active -= 1

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        cap = self._options.max_body_bytes
        if request.content_length is not None and request.content_length > cap:
            raise ApiError(
                413, f"the request body is larger than {cap} bytes", code="request_too_large"
            )
        body = parse_json(await request.read())
        chat = parse_chat_request(
            body, models=[self._options.model], max_tokens_limit=self._options.max_tokens
        )
        episode = episode_of(
            request.headers.get(ROLLOUT_HEADER),
            request.headers.get(ATTEMPT_HEADER),
            open_calls=self._options.open_calls,
        )
        try:
            prompt = self._template.prompt(chat.messages)
        except TemplateError as error:
            raise bad_request(error.why, f"messages[{error.index}].content") from None
        self.calls_admitted += 1
        completion_id = f"chatcmpl-{self._id_prefix}-{next(self._ids)}"
        created = int(time.time())
        chunks = self._generate(episode, prompt, chat)
        async with contextlib.aclosing(chunks):
            if chat.stream:
                return await self._stream(request, chunks, chat, completion_id, created, prompt)
            tokens = _Tokens(len(prompt))
            async for chunk in chunks:
                tokens.add(chunk)
            completion = tokens.completion(self._template, chat.max_tokens)
            text = self._template.text(completion.token_ids)
            return web.json_response(
                completion_body(completion_id, created, chat.model, text, completion)
            )

    async def _stream(
        self,
        request: web.Request,
        chunks: AsyncGenerator[GenerateChunk, None],
        chat: ChatRequest,
        completion_id: str,
        created: int,
        prompt: tuple[int, ...],
    ) -> web.StreamResponse:
        # The first chunk before the response starts: a refusal (a stale attempt, a
        # prompt past the model's context) is then still an HTTP error status.
        tokens = _Tokens(len(prompt))
        first = await anext(chunks, None)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        model = chat.model
        sent = ""

        async def send(delta: dict[str, Any], finish: str | None = None) -> None:
            await response.write(
                sse_event(chunk_body(completion_id, created, model, delta, finish))
            )

        try:
            await send({"role": "assistant", "content": ""})
            pending = first
            while pending is not None:
                tokens.add(pending)
                delta = text_delta(sent, self._template.text(tokens.token_ids))
                if delta:
                    sent += delta
                    await send({"content": delta})
                pending = await anext(chunks, None)
            completion = tokens.completion(self._template, chat.max_tokens)
            await send({}, completion.finish_reason)
            if chat.include_usage:
                await response.write(
                    sse_event(usage_chunk_body(completion_id, created, model, completion))
                )
            await response.write(sse_event("[DONE]"))
        except TurnpointError as error:
            # The stream is under way: the error travels as an event, as OpenAI's does.
            await response.write(sse_event(_api_error_of(error).body()))
        except ConnectionResetError:
            pass  # the client went away: closing ``chunks`` ends the generation
        except Exception:  # noqa: BLE001 - the model's own failure, logged, told as an event
            _LOG.exception("OpenAI endpoint: a streaming generation failed")
            failure = ApiError(500, "internal error (see the server's log)", "server_error")
            await response.write(sse_event(failure.body()))
        return response

    async def _generate(
        self, episode: EpisodeId, prompt: tuple[int, ...], chat: ChatRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        """The tokens of one completion through the participant's admission, continued
        across checkpoint cuts (docs/spec.md section 12.4)."""
        produced: list[int] = []
        accept_cut = self._options.cut_at_checkpoints
        while True:
            leg = GenerateRequest(
                prompt_token_ids=(*prompt, *produced),
                max_new_tokens=chat.max_tokens - len(produced),
                temperature=chat.temperature,
                seed=chat.seed,
                accept_cut=accept_cut,
            )
            received = 0
            cut: GenerateChunk | None = None
            stream = self._runtime.generate(episode, leg)
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    if chunk.cut:
                        cut = chunk
                        break
                    received += len(chunk.token_ids)
                    produced.extend(chunk.token_ids)
                    yield chunk
            if cut is None:
                return
            if cut.prefix_length != received:
                raise TurnpointError(
                    Reason.PROTOCOL_VIOLATION,
                    f"a cut of {cut.prefix_length} tokens ended a stream of {received}",
                )
            # Held here, not at the gate: a cuttable request at closed admission is
            # answered at once with an empty cut (section 5.5 item 3).
            await self._runtime.wait_until(lambda core: core.admission_open)


class _Tokens:
    """The tokens of one completion as they stream."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.weights_versions: list[int] = []

    def add(self, chunk: GenerateChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.weights_versions.extend([chunk.weights_version] * len(chunk.token_ids))

    def completion(self, template: ChatTemplate, max_tokens: int) -> Completion:
        ended = bool(self.token_ids) and template.is_end(self.token_ids[-1])
        finish = "stop" if ended or len(self.token_ids) < max_tokens else "length"
        return Completion(
            self.prompt_tokens,
            tuple(self.token_ids),
            tuple(self.logprobs),
            tuple(self.weights_versions),
            finish,
        )


async def serve_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0: any free port); returns its runner and port.

    A client that goes away cancels its handler (``handler_cancellation``): a call held
    at a gate or streaming then leaves the participant's admission instead of running
    for nobody.
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
