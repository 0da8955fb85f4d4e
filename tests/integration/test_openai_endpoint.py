"""The OpenAI-compatible endpoint with the real ``openai`` client (docs/spec.md section 12).

The endpoint fronts a real policy participant on 127.0.0.1:0 serving the example
:class:`TinyPolicyServer` (greedy, so the expected tokens are the policy's own
``generate``), and a snapshot's control calls reach that participant over gRPC as the
coordinator's would. Waits are on the participant's state or bounded polls, never sleeps.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch

from tests.support.participants import TOKEN
from tests.support.scripted import Wire, bounded, ckpt, poll, wire_to
from tests.support.token_prefix import PROMPT, CountingPolicy, expected_completion
from turnpoint.apps.examples._participants import TinyPolicyServer, new_policy
from turnpoint.apps.examples._task import Task, encode_context
from turnpoint.apps.examples.chat_template import MODEL_NAME, GuessChatTemplate
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    GenerateChunk,
    GenerateRequest,
    ParticipantRuntime,
    PolicyModel,
    SnapshotStore,
)
from turnpoint.server import ServerOptions, host_participant
from turnpoint.server.openai_api import (
    ATTEMPT_HEADER,
    ROLLOUT_HEADER,
    ChatEndpoint,
    ChatMessage,
    EndpointOptions,
    TemplateError,
)
from turnpoint.v1 import types_pb2

API_KEY = "sk-test-endpoint"
EPISODE = {ROLLOUT_HEADER: "rollout-a", ATTEMPT_HEADER: "0"}
MESSAGES: list[Any] = [{"role": "user", "content": "range 2 5"}]
TASK = Task("prompt-1", seed=0, group_index=0, low=2, high=5, target=3)
PREPARED = types_pb2.PHASE_PREPARED


@dataclass
class Served:
    endpoint: ChatEndpoint
    wire: Wire
    model: PolicyModel
    client: openai.AsyncOpenAI

    @property
    def runtime(self) -> ParticipantRuntime:
        return self.wire.runtime


@asynccontextmanager
async def serve(
    root: Path,
    model: PolicyModel,
    template: Any = None,
    **options: Any,
) -> AsyncIterator[Served]:
    runtime = ParticipantRuntime("policy", SnapshotStore(root), model=model)
    hosted = host_participant(runtime, ServerOptions(port=0, token=TOKEN))
    await hosted.start()
    settings = {"model": MODEL_NAME, "api_key": API_KEY, **options}
    try:
        async with (
            wire_to(hosted, "unary") as wire,
            ChatEndpoint(
                runtime, template or GuessChatTemplate(), EndpointOptions(**settings)
            ) as endpoint,
        ):
            client = openai.AsyncOpenAI(
                base_url=endpoint.base_url,
                api_key=API_KEY,
                max_retries=0,
                timeout=30.0,
                default_headers=EPISODE,
            )
            try:
                yield Served(endpoint, wire, model, client)
            finally:
                await client.close()
    finally:
        await hosted.stop(0)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "snapshots"


def greedy(policy_seed: int, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    tokens, _ = new_policy(policy_seed).generate(
        prompt, max_new_tokens, 0.0, torch.Generator().manual_seed(0)
    )
    return tokens


# ------------------------------------------------------------------ the happy paths


async def test_a_completion_answers_the_policys_own_tokens_as_text(root: Path) -> None:
    template = GuessChatTemplate()
    prompt = encode_context(TASK, [])
    assert template.prompt([ChatMessage("user", "range 2 5")]) == tuple(prompt)
    expected = greedy(0, prompt, 6)
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        completion = await served.client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0
        )
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == template.text(expected)
    assert choice.finish_reason == ("stop" if template.is_end(expected[-1]) else "length")
    assert completion.model == MODEL_NAME and completion.object == "chat.completion"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        len(prompt),
        len(expected),
    )
    extension = (completion.model_extra or {})["turnpoint"]
    assert extension["token_ids"] == expected
    assert extension["weights_versions"] == [0] * len(expected)


async def test_a_stream_carries_the_same_text_in_deltas_then_done(root: Path) -> None:
    prompt = encode_context(TASK, [])
    expected = GuessChatTemplate().text(greedy(0, prompt, 6))
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        stream = await served.client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(prompt)


async def test_the_raw_stream_is_server_sent_events_ending_in_done(root: Path) -> None:
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        status, body = await post(
            served, {"model": MODEL_NAME, "messages": MESSAGES, "stream": True}
        )
    assert status == 200
    events = [line for line in body.decode().split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


async def test_the_models_list_names_the_served_model(root: Path) -> None:
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        models = [model async for model in served.client.models.list()]
    assert [(m.id, m.object) for m in models] == [(MODEL_NAME, "model")]


# ------------------------------------------------------------------ refusals


async def post(
    served: Served, body: Any, *, headers: dict[str, str] | None = None, raw: bytes | None = None
) -> tuple[int, bytes]:
    """POST a body as a client outside the openai package would: status and bytes."""
    sent = {"Authorization": f"Bearer {API_KEY}", **EPISODE, **(headers or {})}
    data = raw if raw is not None else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{served.endpoint.base_url}/chat/completions", data=data, headers=sent
        ) as response,
    ):
        return response.status, await response.read()


def error_of(answer: tuple[int, bytes], status: int = 400) -> dict[str, Any]:
    assert answer[0] == status, answer
    error = json.loads(answer[1])["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and "Traceback" not in error["message"]
    return dict(error)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL_NAME, "messages": []}, "messages"),
        (
            {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "1"}]},
            "messages[0].role",
        ),
        (
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}]},
            "messages[0].content",
        ),
        ({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 10**6}, "max_tokens"),
        ({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": "5"}, "max_tokens"),
        ({"model": MODEL_NAME, "messages": MESSAGES, "temperature": 7}, "temperature"),
        ({"model": MODEL_NAME, "messages": MESSAGES, "n": 3}, "n"),
    ],
)
async def test_a_bad_request_is_a_400_naming_its_field_through_the_client(
    root: Path, body: dict[str, Any], param: str
) -> None:
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        with pytest.raises(openai.BadRequestError) as caught:
            await served.client.chat.completions.create(**body)
        assert served.endpoint.calls_admitted == 0
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


async def test_malformed_json_is_a_400_and_a_huge_body_a_413(root: Path) -> None:
    async with serve(root, TinyPolicyServer(new_policy(0)), max_body_bytes=4096) as served:
        malformed = error_of(await post(served, None, raw=b'{"model": "x", "messages": ['))
        huge = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "1 " * 5000}]}
        too_large = error_of(await post(served, huge), 413)
        not_object = error_of(await post(served, None, raw=b"[1, 2]"))
        # What the openai client refuses to send itself.
        no_model = error_of(await post(served, {"messages": MESSAGES}))
        no_messages = error_of(await post(served, {"model": MODEL_NAME}))
        assert served.endpoint.calls_admitted == 0
    assert malformed["code"] == "invalid_json" and not_object["code"] == "invalid_json"
    assert too_large["code"] == "request_too_large"
    assert (no_model["param"], no_messages["param"]) == ("model", "messages")


async def test_an_unknown_model_is_a_404(root: Path) -> None:
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        with pytest.raises(openai.NotFoundError) as caught:
            await served.client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert isinstance(caught.value.body, dict)
    assert (caught.value.body["param"], caught.value.body["code"]) == ("model", "model_not_found")


async def test_a_call_without_its_episode_is_refused_unless_the_endpoint_is_open(
    root: Path,
) -> None:
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        bare = openai.AsyncOpenAI(base_url=served.endpoint.base_url, api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            await bare.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
        half = error_of(
            await post(
                served, {"model": MODEL_NAME, "messages": MESSAGES}, headers={ATTEMPT_HEADER: ""}
            )
        )
        bad_attempt = error_of(
            await post(
                served, {"model": MODEL_NAME, "messages": MESSAGES}, headers={ATTEMPT_HEADER: "-1"}
            )
        )
        bad_rollout = error_of(
            await post(
                served,
                {"model": MODEL_NAME, "messages": MESSAGES},
                headers={ROLLOUT_HEADER: "a/../b"},
            )
        )
        await bare.close()
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "missing_episode"
    assert half["param"] == ATTEMPT_HEADER or half["code"] == "invalid_episode"
    assert (bad_attempt["param"], bad_attempt["code"]) == (ATTEMPT_HEADER, "invalid_episode")
    assert (bad_rollout["param"], bad_rollout["code"]) == (ROLLOUT_HEADER, "invalid_episode")
    async with serve(root, TinyPolicyServer(new_policy(0)), open_calls=True) as served:
        bare = openai.AsyncOpenAI(base_url=served.endpoint.base_url, api_key=API_KEY, max_retries=0)
        completion = await bare.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2
        )
        await bare.close()
    assert completion.choices[0].finish_reason in ("stop", "length")


async def test_a_wrong_api_key_is_a_401(root: Path) -> None:
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        wrong = openai.AsyncOpenAI(
            base_url=served.endpoint.base_url,
            api_key="sk-wrong",
            max_retries=0,
            default_headers=EPISODE,
        )
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        await wrong.close()


async def test_a_retired_attempt_is_refused_as_stale(root: Path) -> None:
    """The participant's own identity rule (section 6.9) reaches the client as a 409."""
    async with serve(root, TinyPolicyServer(new_policy(0))) as served:
        await served.wire.retire([EpisodeId("rollout-a", 0)])
        with pytest.raises(openai.ConflictError) as caught:
            await served.client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=1
            )
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "stale_attempt"


# ------------------------------------------------------------------ admission


class WatchedPolicy(TinyPolicyServer):
    """Records, as each generation starts, whether its participant's admission was open."""

    runtime: ParticipantRuntime

    def __init__(self) -> None:
        super().__init__(new_policy(0))
        self.admission_at_start: list[bool] = []

    async def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        self.admission_at_start.append(self.runtime.core.admission_open)
        async for chunk in super().generate(episode, request):
            yield chunk


async def test_a_call_arriving_while_a_prepare_is_open_is_held_until_resume(root: Path) -> None:
    model = WatchedPolicy()
    async with serve(root, model) as served:
        model.runtime = served.runtime
        prepared = await served.wire.prepare(ckpt(1), lease_s=60)
        assert prepared.phase == PREPARED
        call = asyncio.create_task(
            served.client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0
            )
        )
        await poll(lambda: served.endpoint.calls_admitted == 1)
        await served.wire.commit(ckpt(1), "snap-1", [])
        assert not call.done() and model.admission_at_start == []
        await served.wire.resume(ckpt(1))
        completion = await bounded(call)
    assert model.admission_at_start == [True]
    assert completion.choices[0].message.content is not None


async def test_a_flood_past_the_cap_is_a_429_and_a_client_that_leaves_frees_its_place(
    root: Path,
) -> None:
    model = WatchedPolicy()
    async with serve(root, model, max_concurrent_calls=1) as served:
        model.runtime = served.runtime
        await served.wire.prepare(ckpt(1), lease_s=60)
        held = asyncio.create_task(
            served.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
        )
        await poll(lambda: served.endpoint.calls_admitted == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            await served.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
        held.cancel()  # the client goes away while its call waits at the gate
        await poll(lambda: served.endpoint.calls_active == 0)
        await served.wire.resume(ckpt(1))
        completion = await served.client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "too_many_calls"
    assert model.admission_at_start == [True]  # the abandoned call never generated
    assert completion.choices[0].finish_reason in ("stop", "length")


class WordTemplate:
    """``t<id>`` per token: the counting policy's tokens as text."""

    def prompt(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]:
        if messages[-1].content != "count":
            raise TemplateError(len(messages) - 1, "say 'count'")
        return PROMPT

    def text(self, token_ids: Sequence[int]) -> str:
        return " ".join(f"t{token}" for token in token_ids)

    def is_end(self, token_id: int) -> bool:
        return token_id == 0


async def test_a_stream_in_flight_is_cut_at_prepare_and_continued_after_resume(
    root: Path,
) -> None:
    """Token-prefix level: the prepare does not wait for the stream; the client sees one
    uninterrupted completion, every token streamed once (docs/spec.md section 12.4)."""
    model = CountingPolicy()
    async with serve(root, model, WordTemplate()) as served:
        # The response starts with the first token: let two through before asking.
        model.release(2)
        stream = await served.client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=6,
            stream=True,
        )
        await model.wait_streamed(2)
        prepare = asyncio.create_task(served.wire.prepare(ckpt(1), lease_s=60))
        await served.wire.until(lambda core: core.active_checkpoint_id == ckpt(1))
        model.release(1)  # the cut lands at the token boundary after this one
        prepared = await bounded(prepare)
        assert prepared.phase == PREPARED  # the stream was cut, not waited for
        await served.wire.commit(ckpt(1), "snap-1", [])
        await served.wire.resume(ckpt(1))
        model.release(3)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == WordTemplate().text(expected_completion(6, None))
    assert [position for _, position, _ in model.streamed] == list(range(3, 9))


async def test_a_stream_whose_episode_is_retired_ends_with_an_error_event(root: Path) -> None:
    model = CountingPolicy()
    async with serve(root, model, WordTemplate()) as served:
        model.release(2)
        stream = await served.client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=6,
            stream=True,
        )
        await model.wait_streamed(2)
        await served.wire.retire([EpisodeId("rollout-a", 0)])
        received: list[str] = []
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                received.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(received) == WordTemplate().text(expected_completion(2, None))
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "stale_attempt"
    assert len(model.streamed) == 2
