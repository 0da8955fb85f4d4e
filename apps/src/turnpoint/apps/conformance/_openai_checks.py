"""Checks of the HTTP faces of opaque agents (docs/spec.md section 12): the OpenAI
endpoint in front of a policy participant (sections 12.2 to 12.5) and the egress relay
in front of a harness (section 12.8).

Both are HTTP, so the kit speaks plain HTTP/1.1 to them (the standard library's client,
in a thread: no dependency, nothing blocking on the loop). What a check cannot see over
the wire it says: the relay's record of dispositions is not on the wire (the reference
property-tests it, section 12.6); only what a harness sees of it is checked.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ._kit import CheckFailed, CheckSkipped, Kit, require

# A declared body far over any sane cap: a server must refuse it from its length alone.
_HUGE_BODY_BYTES: Final = 1 << 30
_ERROR_FIELDS: Final = ("message", "type", "param", "code")


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self, where: str) -> Any:
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckFailed(f"{where}: the answer is not JSON: {self.body[:120]!r}") from None


def _exchange(
    url: str,
    method: str,
    body: bytes | None,
    headers: Mapping[str, str],
    timeout_s: float,
    declared_length: int | None,
) -> Answer:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        if declared_length is None:
            connection.request(method, path, body=body, headers=dict(headers))
        else:
            # Only the headers: the length alone must be refused, never waited on.
            connection.putrequest(method, path)
            for name, value in {**headers, "Content-Length": str(declared_length)}.items():
                connection.putheader(name, value)
            connection.endheaders()
        response = connection.getresponse()
        return Answer(response.status, response.getheader("Content-Type", ""), response.read())
    finally:
        connection.close()


async def _call(
    kit: Kit,
    url: str,
    *,
    method: str = "POST",
    body: bytes | None = None,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    declared_length: int | None = None,
    what: str,
) -> Answer:
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    try:
        return await asyncio.to_thread(
            _exchange, url, method, body, sent, kit.episode_bound_s, declared_length
        )
    except (OSError, http.client.HTTPException) as error:
        raise CheckFailed(f"{what}: no answer ({type(error).__name__}: {error})") from None


async def _refused(
    kit: Kit,
    url: str,
    status: int,
    what: str,
    *,
    code: str | None = None,
    param: str | None = None,
    **call: Any,
) -> None:
    """The call is refused with ``status`` and an OpenAI-shaped error (section 12.5)."""
    answer = await _call(kit, url, what=what, **call)
    require(
        answer.status == status,
        f"{what}: HTTP {answer.status}, expected {status}: {answer.body[:160]!r}",
    )
    error = answer.json(what).get("error") if answer.body.startswith(b"{") else None
    require(
        isinstance(error, dict) and all(field in error for field in _ERROR_FIELDS),
        f"{what}: the body is not {{'error': {{message, type, param, code}}}}: "
        f"{answer.body[:160]!r}",
    )
    assert isinstance(error, dict)
    require(isinstance(error["message"], str) and bool(error["message"]), f"{what}: no message")
    if code is not None:
        require(error["code"] == code, f"{what}: code {error['code']!r}, expected {code!r}")
    if param is not None:
        require(error["param"] == param, f"{what}: param {error['param']!r}, expected {param!r}")


def _chat_body(kit: Kit, model: str, **extra: Any) -> bytes:
    chat = kit.workload.chat
    assert chat is not None
    body = {"model": model, "messages": list(chat), "max_tokens": kit.workload.chat_max_tokens}
    return json.dumps({**body, **extra}).encode()


def _check_completion(completion: Any, model: str) -> str:
    """The shape of a whole ``chat.completion`` (section 12.2 item 4); its text."""
    require(isinstance(completion, dict), "the completion is not a JSON object")
    require(completion.get("object") == "chat.completion", "object is not 'chat.completion'")
    require(str(completion.get("id", "")).startswith("chatcmpl-"), "id is not chatcmpl-...")
    require(completion.get("model") == model, f"model is {completion.get('model')!r}")
    choices = completion.get("choices")
    require(isinstance(choices, list) and len(choices) == 1, "not exactly one choice")
    choice = choices[0]
    message = choice.get("message") or {}
    require(message.get("role") == "assistant", "the message's role is not assistant")
    require(isinstance(message.get("content"), str), "the message has no text content")
    require(choice.get("finish_reason") in ("stop", "length"), "finish_reason not stop/length")
    usage = completion.get("usage") or {}
    counts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")]
    prompt, completed, total = (c if isinstance(c, int) else -1 for c in counts)
    require(
        min(prompt, completed) >= 0 and prompt + completed == total,
        f"usage is not prompt + completion = total tokens: {usage}",
    )
    return str(message["content"])


def _check_stream(answer: Answer) -> str:
    """The shape of a streamed completion (section 12.2 item 5); its text."""
    require(
        answer.content_type.startswith("text/event-stream"),
        f"a stream's content type is {answer.content_type!r}, not text/event-stream",
    )
    events = [
        line.removeprefix("data: ")
        for line in answer.body.decode(errors="replace").split("\n")
        if line.startswith("data: ")
    ]
    require(bool(events) and events[-1] == "[DONE]", "the stream does not end with [DONE]")
    chunks = [json.loads(event) for event in events[:-1]]
    require(bool(chunks), "the stream has no chunk")
    require(
        all(chunk.get("object") == "chat.completion.chunk" for chunk in chunks),
        "a chunk is not a chat.completion.chunk",
    )
    choices = [chunk["choices"][0] for chunk in chunks if chunk.get("choices")]
    require(
        bool(choices) and choices[0].get("delta", {}).get("role") == "assistant",
        "the first chunk's delta does not name the assistant's role",
    )
    require(
        any(choice.get("finish_reason") in ("stop", "length") for choice in choices),
        "no chunk carries the finish_reason",
    )
    return "".join(str(choice.get("delta", {}).get("content") or "") for choice in choices)


async def check_openai_endpoint(kit: Kit) -> str:
    """Sections 12.2 to 12.5: the endpoint's models, completions (whole and streamed)
    and its errors: OpenAI-shaped, 4xx, never a traceback."""
    face = kit.openai_endpoint
    if face is None:
        raise CheckSkipped("no --openai-endpoint URL given: the endpoint not tried")
    models = await _call(kit, f"{face.base_url}/models", method="GET", key=face.key, what="models")
    require(models.status == 200, f"GET /models: HTTP {models.status}")
    listed = models.json("GET /models")
    names = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
    require(
        listed.get("object") == "list" and bool(names) and all(isinstance(n, str) for n in names),
        f"GET /models is not a list of models: {listed}",
    )
    model = str(names[0])
    chat_url = f"{face.base_url}/chat/completions"
    rollout = kit.rollout("openai")
    episode = {"X-Turnpoint-Rollout": rollout, "X-Turnpoint-Attempt": "0"}
    tried = ["models"]
    common: dict[str, Any] = {"key": face.key, "headers": episode}
    await _refused(
        kit, chat_url, 400, "a body not JSON", code="invalid_json", body=b"{nope", **common
    )
    await _refused(kit, chat_url, 400, "a JSON array", code="invalid_json", body=b"[]", **common)
    await _refused(
        kit, chat_url, 400, "no model", param="model", body=b'{"messages": []}', **common
    )
    await _refused(
        kit,
        chat_url,
        413,
        "a body declared 1 GiB long",
        code="request_too_large",
        declared_length=_HUGE_BODY_BYTES,
        **common,
    )
    tried += ["invalid_json", "a missing field", "413"]
    if face.key is not None:
        for wrong, what in ((None, "no API key"), ("sk-conformance-wrong", "a wrong API key")):
            await _refused(
                kit,
                chat_url,
                401,
                what,
                code="invalid_api_key",
                key=wrong,
                headers=episode,
                body=b"{}",
            )
        tried.append("401")
    if kit.workload.chat is None:
        return (
            f"{', '.join(tried)} as the spec says; completions not tried (no 'chat' "
            "messages in the workload)"
        )
    await _refused(
        kit,
        chat_url,
        404,
        "an unknown model",
        code="model_not_found",
        param="model",
        body=_chat_body(kit, model + "-unknown-to-conformance"),
        **common,
    )
    await _refused(
        kit,
        chat_url,
        400,
        "max_tokens 0",
        param="max_tokens",
        body=_chat_body(kit, model, max_tokens=0),
        **common,
    )
    headless = await _call(
        kit, chat_url, key=face.key, body=_chat_body(kit, model), what="no episode headers"
    )
    if headless.status == 200:
        open_note = "taken without episode headers (an open endpoint)"
    else:
        require(
            headless.status == 400
            and (headless.json("no episode headers").get("error") or {}).get("code")
            == "missing_episode",
            f"no episode headers: HTTP {headless.status}, expected 400 missing_episode "
            f"(or 200 from an open endpoint): {headless.body[:160]!r}",
        )
        open_note = "no episode headers refused (400 missing_episode)"
    whole = await _call(
        kit, chat_url, body=_chat_body(kit, model, seed=1), what="a completion", **common
    )
    require(whole.status == 200, f"a completion: HTTP {whole.status}: {whole.body[:160]!r}")
    _check_completion(whole.json("a completion"), model)
    streamed = await _call(
        kit,
        chat_url,
        body=_chat_body(kit, model, seed=1, stream=True, stream_options={"include_usage": True}),
        what="a streamed completion",
        **common,
    )
    require(streamed.status == 200, f"a streamed completion: HTTP {streamed.status}")
    _check_stream(streamed)
    return (
        f"models, a whole and a streamed completion well shaped; {', '.join(tried[1:])}, "
        f"404 model_not_found and a bad max_tokens refused OpenAI-shaped; {open_note}"
    )


async def check_egress_relay(kit: Kit) -> str:
    """Section 12.8 items 1 and 2, as a harness sees them: only the episode's live
    credential opens the relay (a replaced harness's is fenced), calls are answered and
    refusals are OpenAI-shaped. The record's dispositions are not on the wire."""
    face = kit.relay
    if face is None or face.key is None:
        raise CheckSkipped("no --relay URL and harness credential given: the relay not tried")
    models = await _call(kit, f"{face.base_url}/models", method="GET", key=face.key, what="models")
    require(models.status == 200, f"GET /models with the harness's credential: {models.status}")
    chat_url = f"{face.base_url}/chat/completions"
    wrong_keys = [("sk-conformance-wrong", "a wrong key")]
    if kit.target.token is not None:
        wrong_keys.append((kit.target.token, "the control token"))
    for wrong, what in wrong_keys:
        await _refused(
            kit,
            chat_url,
            401,
            f"{what} at the relay",
            code="invalid_api_key",
            key=wrong,
            body=b"{}",
        )
    await _refused(
        kit, chat_url, 400, "a body not JSON", code="invalid_json", key=face.key, body=b"{nope"
    )
    await _refused(
        kit,
        chat_url,
        413,
        "a body declared 1 GiB long",
        code="request_too_large",
        key=face.key,
        declared_length=_HUGE_BODY_BYTES,
    )
    fenced = "no replaced harness's credential given (--relay-fenced-key-file): fencing not tried"
    if face.fenced_key is not None:
        await _refused(
            kit,
            chat_url,
            409,
            "a replaced harness's call",
            code="fenced_generation",
            key=face.fenced_key,
            body=b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
        )
        fenced = "a replaced harness's call refused (409 fenced_generation)"
    answered = "no 'chat' messages in the workload: no call answered through it"
    if kit.workload.chat is not None:
        model = str(models.json("GET /models")["data"][0]["id"])
        whole = await _call(
            kit, chat_url, key=face.key, body=_chat_body(kit, model, seed=1), what="a call"
        )
        require(whole.status == 200, f"a call through the relay: HTTP {whole.status}")
        _check_completion(whole.json("a call through the relay"), model)
        streamed = await _call(
            kit,
            chat_url,
            key=face.key,
            body=_chat_body(kit, model, seed=1, stream=True),
            what="the same call streamed",
        )
        require(streamed.status == 200, f"the same call streamed: HTTP {streamed.status}")
        _check_stream(streamed)
        answered = "a call answered whole and streamed, well shaped"
    held = ", ".join(what for _, what in wrong_keys)
    return (
        f"{held} refused (401 invalid_api_key); invalid_json and 413 refused OpenAI-shaped; "
        f"{fenced}; {answered}; the record's dispositions are not on the wire (not tried)"
    )
