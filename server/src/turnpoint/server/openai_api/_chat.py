"""The OpenAI chat API's shapes, pure: a request body in, a checked request or an error out,
and the response bodies (docs/spec.md section 12).

No aiohttp, no asyncio, no clock: the endpoint passes ``created`` and the completion id,
so every shape here is a function of its arguments and a test reads it without a server.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from turnpoint.ids import EpisodeId, InvalidIdError

ROLES: Final = frozenset(("system", "developer", "user", "assistant", "tool"))
# The headers that name the episode a call belongs to (docs/spec.md section 12.3).
ROLLOUT_HEADER: Final = "X-Turnpoint-Rollout"
ATTEMPT_HEADER: Final = "X-Turnpoint-Attempt"
# The episode of a call without those headers, at an endpoint configured open.
OPEN_ROLLOUT: Final = "openai-open"
_MAX_ATTEMPT_DIGITS: Final = 20


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation, its content as plain text."""

    role: str
    content: str


class ChatTemplate(Protocol):
    """Messages to prompt tokens and completion tokens to text, for one model.

    ``prompt`` raises :class:`TemplateError` for text the model cannot read. ``text`` of
    a prefix of a completion must be a prefix of ``text`` of the whole completion: the
    streamed deltas are the differences between successive texts.
    """

    def prompt(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]: ...

    def text(self, token_ids: Sequence[int]) -> str: ...

    def is_end(self, token_id: int) -> bool:
        """True for the token that ends a completion (``finish_reason`` ``stop``)."""
        ...


class TemplateError(ValueError):
    """A message the template cannot encode; ``index`` is the message's position."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(why)
        self.index = index
        self.why = why


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An OpenAI-shaped error: the HTTP status and the body's ``error`` object."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A checked ``POST /v1/chat/completions`` body."""

    model: str
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    temperature: float
    seed: int
    stream: bool
    include_usage: bool


def parse_json(body: bytes) -> Mapping[str, Any]:
    """The body as a JSON object, or a 400."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise bad_request("the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return value


def parse_chat_request(
    body: Mapping[str, Any], *, models: Sequence[str], max_tokens_limit: int
) -> ChatRequest:
    """Check a chat completion body; raise :class:`ApiError` naming the field at fault.

    Fields this endpoint does not read are ignored, as OpenAI's own server ignores what it
    does not know; fields it reads but cannot honour (``n`` other than 1) are refused.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    messages = _messages(body.get("messages"))
    max_tokens = _max_tokens(body, max_tokens_limit)
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or not 0 <= temperature <= 2
    ):
        raise bad_request("'temperature' must be a number from 0 to 2", "temperature")
    seed = body.get("seed", 0)
    if seed is None:
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise bad_request("'seed' must be an integer from 0 to 2^63-1", "seed")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise bad_request("only 'n' = 1 is supported", "n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = options.get("include_usage") is True
    if model not in models:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this endpoint serves {', '.join(models)}",
            param="model",
            code="model_not_found",
        )
    return ChatRequest(model, messages, max_tokens, float(temperature), seed, stream, include_usage)


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' is required and must be a non-empty array", "messages")
    messages: list[ChatMessage] = []
    for index, item in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", where)
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(
                f"'{where}.role' must be one of {', '.join(sorted(ROLES))}", f"{where}.role"
            )
        messages.append(ChatMessage(str(role), _content(item.get("content"), role, where)))
    return tuple(messages)


def _content(value: object, role: object, where: str) -> str:
    """A string, or an array of text parts joined; null only for an assistant."""
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return ""
    if isinstance(value, list):
        texts: list[str] = []
        for part in value:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise bad_request(f"'{where}.content' parts must be text parts", f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{where}.content' must be a string or text parts", f"{where}.content")


def _max_tokens(body: Mapping[str, Any], limit: int) -> int:
    # max_completion_tokens is the current name; max_tokens the deprecated one.
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise bad_request(f"'{field}' must be an integer from 1 to {limit}", field)
        return value
    return limit


def episode_of(rollout: str | None, attempt: str | None, *, open_calls: bool) -> EpisodeId:
    """The episode a call names in its headers (docs/spec.md section 12.3)."""
    if rollout is None and attempt is None:
        if open_calls:
            return EpisodeId(OPEN_ROLLOUT, 0)
        raise bad_request(
            f"every call names its episode: set the {ROLLOUT_HEADER} and {ATTEMPT_HEADER} headers",
            ROLLOUT_HEADER,
            "missing_episode",
        )
    if rollout is None or attempt is None:
        missing = ROLLOUT_HEADER if rollout is None else ATTEMPT_HEADER
        raise bad_request(f"the {missing} header is missing", missing, "missing_episode")
    if not attempt.isascii() or not attempt.isdigit() or len(attempt) > _MAX_ATTEMPT_DIGITS:
        raise bad_request(
            f"the {ATTEMPT_HEADER} header must be a non-negative integer",
            ATTEMPT_HEADER,
            "invalid_episode",
        )
    try:
        return EpisodeId(rollout, int(attempt))
    except InvalidIdError as error:
        header = ROLLOUT_HEADER if error.field == "rollout_id" else ATTEMPT_HEADER
        raise bad_request(
            f"the {header} header is invalid: {error.why}", header, "invalid_episode"
        ) from None


# ---------------------------------------------------------------------- responses


@dataclass(frozen=True, slots=True)
class Completion:
    """What one generation produced, for the response body."""

    prompt_tokens: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weights_versions: tuple[int, ...]
    finish_reason: str


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    completion_id: str, created: int, model: str, text: str, completion: Completion
) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object; ``turnpoint`` carries the tokens."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": completion.finish_reason,
            }
        ],
        "usage": usage(completion.prompt_tokens, len(completion.token_ids)),
        "turnpoint": tokens_extension(completion),
    }


def tokens_extension(completion: Completion) -> dict[str, Any]:
    """The token ids, log-probabilities and weights versions behind the text: what a
    trainer trains on (docs/spec.md section 12.2)."""
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": list(completion.logprobs),
        "weights_versions": list(completion.weights_versions),
    }


def chunk_body(
    completion_id: str,
    created: int,
    model: str,
    delta: Mapping[str, Any],
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a stream."""
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish_reason}
        ],
    }


def usage_chunk_body(
    completion_id: str, created: int, model: str, completion: Completion
) -> dict[str, Any]:
    """The last chunk of a stream that asked ``stream_options.include_usage``."""
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(completion.prompt_tokens, len(completion.token_ids)),
        "turnpoint": tokens_extension(completion),
    }


def sse_event(body: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def text_delta(sent: str, text: str) -> str:
    """What of ``text`` is new since ``sent``; nothing while ``sent`` is not its prefix."""
    return text[len(sent) :] if text.startswith(sent) else ""


def models_body(models: Sequence[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "turnpoint"}
            for name in models
        ],
    }
