"""The egress relay with the real ``openai`` client (docs/spec.md sections 12.6 to 12.8).

Upstream is a small recording stand-in for the policy endpoint on 127.0.0.1:0 (it
answers each call with the count of calls it has seen, and keeps their headers), so a
test sees exactly what the relay forwarded; the opaque agent's test runs the real one.
It serves a tool too (``/tool``: echoes its body, keeps what it saw, held while its gate
is shut).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.support.scripted import bounded, poll
from turnpoint.egress import CallState, Disposition
from turnpoint.ids import EpisodeId
from turnpoint.server.openai_api import (
    ATTEMPT_HEADER,
    IDEMPOTENCY_HEADER,
    ROLLOUT_HEADER,
    EgressRelay,
    RelayError,
    RelayOptions,
)
from turnpoint.server.openai_api._relay import Completed, Diverged

MODEL = "tiny"
UPSTREAM_KEY = "sk-policy-only"
EPISODE = EpisodeId("rollout-r", 2)
HUGE_BYTES = 256 << 20


@dataclass
class Upstream:
    """A stand-in policy endpoint: answers ``n`` for its n-th call; keeps what it saw."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    base_url: str = ""
    tool_seen: list[dict[str, Any]] = field(default_factory=list)
    tool_gate: asyncio.Event = field(default_factory=asyncio.Event)
    # /huge: a JSON answer of HUGE_BYTES, streamed; how much of it left, and when it ended.
    huge_calls: int = 0
    huge_sent: int = 0
    huge_done: asyncio.Event = field(default_factory=asyncio.Event)

    async def huge(self, request: web.Request) -> web.StreamResponse:
        """A tool whose answer is far past any cap, sent without a length, until the
        reader hangs up."""
        await request.read()
        self.huge_calls += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        piece = b"x" * (1 << 16)
        try:
            await response.write(b'{"padding": "')
            while self.huge_sent < HUGE_BYTES:
                await response.write(piece)
                self.huge_sent += len(piece)
            await response.write(b'"}')
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the relay hung up: that is the point
        finally:
            self.huge_done.set()
        return response

    async def tool(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tool_seen.append({"headers": dict(request.headers), "body": body})
        await self.tool_gate.wait()
        return web.json_response({"echo": body}, status=201)

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append({"headers": dict(request.headers), "body": body})
        if body["messages"][-1]["content"] == "refuse":
            return web.json_response(
                {
                    "error": {
                        "message": "no",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "refused",
                    }
                },
                status=400,
            )
        text = str(len(self.seen))
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.seen)}",
                "object": "chat.completion",
                "created": 1,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


@asynccontextmanager
async def upstream(fake: Upstream | None = None, port: int = 0) -> AsyncIterator[Upstream]:
    """``fake`` served on ``port`` (a fresh one by default) until the block ends."""
    fake = Upstream() if fake is None else fake
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.chat)
    app.router.add_post("/tool", fake.tool)
    app.router.add_post("/huge", fake.huge)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    fake.base_url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    fake.tool_gate.set()
    try:
        yield fake
    finally:
        await runner.cleanup()


@asynccontextmanager
async def relay_to(fake: Upstream, **options: Any) -> AsyncIterator[EgressRelay]:
    root = fake.base_url.removesuffix("/v1")
    tools = {"echo": root + "/tool", "huge": root + "/huge"}
    options = RelayOptions(
        fake.base_url,
        MODEL,
        upstream_api_key=UPSTREAM_KEY,
        max_body_bytes=4096,
        tools=tools,
        **options,
    )
    async with EgressRelay(options) as relay:
        yield relay


def client(relay: EgressRelay, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=relay.base_url, api_key=api_key, max_retries=0, timeout=10)


async def ask(harness: openai.AsyncOpenAI, content: str) -> str:
    reply = await harness.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}]
    )
    return reply.choices[0].message.content or ""


async def test_a_call_is_tagged_recorded_and_forwarded_under_the_relays_own_key() -> None:
    async with upstream() as fake, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE)
        harness = client(relay, session.api_key)
        try:
            assert await ask(harness, "range 2 5") == "1"
            models = await harness.models.list()
            assert [m.id for m in models.data] == [MODEL]
            with pytest.raises(openai.BadRequestError) as refused:
                await ask(harness, "refuse")
            assert refused.value.code == "refused"
        finally:
            await harness.close()
        headers = fake.seen[0]["headers"]
        assert headers[ROLLOUT_HEADER] == "rollout-r" and headers[ATTEMPT_HEADER] == "2"
        assert headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
        assert session.api_key not in json.dumps(fake.seen)
        assert sorted(session.record.states().values(), key=str) == [
            CallState.COMPLETED,
            CallState.TERMINAL_FAILURE,
        ]
        assert [
            entry.response["choices"][0]["message"]["content"] for entry in session.journal
        ] == ["1"]


async def test_only_a_live_credential_opens_the_relay() -> None:
    async with upstream() as fake, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE)
        key = session.api_key
        for wrong in ("sk-guess", UPSTREAM_KEY):
            stranger = client(relay, wrong)
            try:
                with pytest.raises(openai.AuthenticationError):
                    await ask(stranger, "range 2 5")
            finally:
                await stranger.close()
        relay.close_episode(EPISODE)  # revoked with its episode
        harness = client(relay, key)
        try:
            with pytest.raises(openai.AuthenticationError):
                await ask(harness, "range 2 5")
        finally:
            await harness.close()
        assert fake.seen == []


async def test_a_call_is_held_while_a_snapshot_is_open_and_goes_on_at_resume() -> None:
    async with upstream() as fake, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE)
        harness = client(relay, session.api_key)
        try:
            relay.prepare("snap-1")
            held = asyncio.create_task(ask(harness, "range 2 5"))
            await poll(lambda: session.record.states() != {})
            assert list(session.record.states().values()) == [CallState.HELD]
            assert session.export()["calls"] == {"g0-c0": "never_started"}
            assert fake.seen == [] and not held.done()
            relay.resume("snap-1")
            assert await bounded(held) == "1"
        finally:
            await harness.close()


async def test_a_replaced_harness_is_fenced_and_nothing_of_it_is_recorded() -> None:
    async with upstream() as fake, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE)
        old = client(relay, session.api_key)
        new = client(relay, session.rerun())
        try:
            with pytest.raises(openai.ConflictError) as fenced:
                await ask(old, "range 2 5")
            assert fenced.value.code == "fenced_generation"
            assert await ask(new, "range 2 5") == "1"
        finally:
            await old.close()
            await new.close()
        assert len(fake.seen) == 1 and list(session.record.states()) == ["g1-c0"]


async def test_a_restored_harness_is_answered_from_the_record_until_the_cut_then_live() -> None:
    async with upstream() as fake:
        async with relay_to(fake) as relay:
            session = relay.open_episode(EPISODE)
            harness = client(relay, session.api_key)
            try:
                first = [await ask(harness, f"turn {n}") for n in range(3)]
            finally:
                await harness.close()
            state = json.loads(json.dumps(session.export()))  # as a snapshot holds it
        assert first == ["1", "2", "3"]
        async with relay_to(fake) as relay:
            continued = EPISODE.next_attempt()
            session = relay.open_episode(continued, state)
            harness = client(relay, session.api_key)
            try:
                replayed = [await ask(harness, f"turn {n}") for n in range(3)]
                assert len(fake.seen) == 3  # nothing forwarded twice
                # Streamed, a recorded answer is the same text.
                again = relay.open_episode(EpisodeId("rollout-s", 0), state)
                streamer = client(relay, again.api_key)
                try:
                    chunks = await streamer.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "turn 0"}],
                        stream=True,
                    )
                    streamed = "".join([c.choices[0].delta.content or "" async for c in chunks])
                finally:
                    await streamer.close()
                assert await ask(harness, "turn 3") == "4"  # past the cut: live
            finally:
                await harness.close()
        assert replayed == first and streamed == "1"
        assert fake.seen[-1]["headers"][ATTEMPT_HEADER] == str(continued.attempt)
        assert session.record.generation == 1 and session.replayed == 3
        assert list(session.record.states().values()).count(CallState.COMPLETED) == 4


async def test_a_restored_harness_that_asks_otherwise_is_stopped_with_a_typed_outcome() -> None:
    async with upstream() as fake:
        async with relay_to(fake) as relay:
            session = relay.open_episode(EPISODE)
            harness = client(relay, session.api_key)
            try:
                await ask(harness, "turn 0")
                await ask(harness, "turn 1")
            finally:
                await harness.close()
            state = session.export()
        async with relay_to(fake) as relay:
            session = relay.open_episode(EPISODE.next_attempt(), state, sealed=True)
            harness = client(relay, session.api_key)
            try:
                with pytest.raises(openai.ConflictError) as diverged:
                    await ask(harness, "turn 0")  # answered from the record: not sealed again
                    await ask(harness, "turn 9")
                assert diverged.value.code == "replay_diverged"
                event = await bounded(session.next_event())
                assert event == Diverged(1, event.reason) and "call 1" in event.reason
                with pytest.raises(openai.ConflictError):
                    await ask(harness, "turn 1")  # stopped: nothing more of it is taken
                harness2 = client(relay, session.rerun())
                try:
                    live = asyncio.create_task(ask(harness2, "turn 9"))
                    completed = await bounded(session.next_event())
                    assert isinstance(completed, Completed) and not live.done()
                    completed.release()  # the owner sealed its boundary
                    assert await bounded(live) == "3"
                finally:
                    await harness2.close()
            finally:
                await harness.close()
        assert len(fake.seen) == 3


async def test_hostile_input_gets_a_clear_error_and_nothing_is_recorded() -> None:
    async with upstream() as fake, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE)
        url = relay.base_url + "/chat/completions"
        auth = {"Authorization": f"Bearer {session.api_key}"}
        async with aiohttp.ClientSession() as http:
            async with http.post(url, data=b"{not json", headers=auth) as bad:
                assert bad.status == 400
                assert (await bad.json())["error"]["code"] == "invalid_json"
            async with http.post(url, data=b"x" * 8192, headers=auth) as huge:
                assert huge.status == 413
        assert fake.seen == [] and session.record.states() == {}
        with pytest.raises(RelayError):
            relay.open_episode(EpisodeId("rollout-t", 0), {"version": 1, "generation": "x"})
        damaged = {
            **session.export(),
            "journal": [{"call_id": "c", "request_digest": "d", "response": {}}],
        }
        with pytest.raises(RelayError):
            relay.open_episode(EpisodeId("rollout-u", 0), damaged)
        assert Disposition.COMPLETED.value == "completed"


async def test_a_call_held_when_its_episode_ends_never_starts_and_is_told_so() -> None:
    async with upstream() as fake, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE)
        harness = client(relay, session.api_key)
        try:
            relay.prepare("snap-1")
            held = asyncio.create_task(ask(harness, "range 2 5"))
            await poll(lambda: session.record.states() != {})
            relay.close_episode(EPISODE)
            with pytest.raises(openai.ConflictError) as ended:
                await bounded(held)
            assert ended.value.code == "episode_closed"
        finally:
            await harness.close()
        assert fake.seen == []
        assert list(session.record.states().values()) == [CallState.NEVER_STARTED]


async def test_a_harness_flooding_calls_gets_429s_past_the_cap_and_none_is_recorded() -> None:
    async with upstream() as fake:
        options = RelayOptions(fake.base_url, MODEL, max_concurrent_calls=1)
        async with EgressRelay(options) as relay:
            session = relay.open_episode(EPISODE)
            harness = client(relay, session.api_key)
            try:
                relay.prepare("snap-1")  # the first call is held, under way
                held = asyncio.create_task(ask(harness, "range 2 5"))
                await poll(lambda: relay.calls_active == 1)
                with pytest.raises(openai.RateLimitError) as flooded:
                    await ask(harness, "range 2 6")
                assert flooded.value.code == "too_many_calls"
                relay.resume("snap-1")
                assert await bounded(held) == "1"
            finally:
                await harness.close()
            assert list(session.record.states().values()) == [CallState.COMPLETED]


async def use_tool(
    http: aiohttp.ClientSession, relay: EgressRelay, api_key: str, tool: str, body: Any
) -> tuple[int, Any]:
    async with http.post(
        f"{relay.tools_url}/{tool}", json=body, headers={"Authorization": f"Bearer {api_key}"}
    ) as answer:
        return answer.status, await answer.json()


async def test_a_tool_call_is_recorded_keyed_and_never_sent_to_its_tool_again() -> None:
    async with upstream() as fake, aiohttp.ClientSession() as http:
        async with relay_to(fake) as relay:
            session = relay.open_episode(EPISODE, turn=4)
            harness = client(relay, session.api_key)
            try:
                assert await ask(harness, "turn 0") == "1"
                assert await use_tool(http, relay, session.api_key, "echo", {"n": 1}) == (
                    201,
                    {"echo": {"n": 1}},
                )
                assert (await use_tool(http, relay, session.api_key, "nope", {}))[0] == 404
                assert (await use_tool(http, relay, "sk-guess", "echo", {}))[0] == 401
                fake.tool_gate.clear()  # the next tool call is in flight at the cut
                in_flight = asyncio.create_task(
                    use_tool(http, relay, session.api_key, "echo", {"n": 2})
                )
                await poll(lambda: len(fake.tool_seen) == 2)
                state = json.loads(json.dumps(session.export()))
            finally:
                await harness.close()
            in_flight.cancel()  # the harness is killed with its call in flight
            with contextlib.suppress(asyncio.CancelledError):
                await in_flight
            fake.tool_gate.set()
        first_key = fake.tool_seen[0]["headers"][IDEMPOTENCY_HEADER]
        cut_key = fake.tool_seen[1]["headers"][IDEMPOTENCY_HEADER]
        # A call's key is its place after the episode's last boundary (section 6.12).
        assert (first_key, cut_key) == ("fx:rollout-r:5:0", "fx:rollout-r:6:0")
        assert fake.tool_seen[0]["headers"][ROLLOUT_HEADER] == "rollout-r"
        assert [entry.tool for entry in session.journal] == [None, "echo"]
        assert state["calls"]["g0-t2"] == "active_prefix"

        async with relay_to(fake) as relay:
            session = relay.open_episode(EPISODE.next_attempt(), state, turn=6)
            harness = client(relay, session.api_key)
            try:
                assert await ask(harness, "turn 0") == "1"
                replayed = await use_tool(http, relay, session.api_key, "echo", {"n": 1})
                assert len(fake.tool_seen) == 2  # answered from the record, not the tool
                resent = await use_tool(http, relay, session.api_key, "echo", {"n": 2})
            finally:
                await harness.close()
        assert replayed == (201, {"echo": {"n": 1}}) and resent == (201, {"echo": {"n": 2}})
        # The call the cut did not hold goes to the tool again under the same key.
        assert fake.tool_seen[2]["headers"][IDEMPOTENCY_HEADER] == cut_key
        assert session.replayed == 2 and session.tools_forwarded == 1


async def test_a_rerun_keys_its_tool_calls_past_every_earlier_harness() -> None:
    async with upstream() as fake, aiohttp.ClientSession() as http, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE, turn=3)
        fake.tool_gate.clear()  # the replaced harness's tool call never settles
        lost = asyncio.create_task(use_tool(http, relay, session.api_key, "echo", {"n": 1}))
        await poll(lambda: len(fake.tool_seen) == 1)
        rerun_key = session.rerun()
        fake.tool_gate.set()
        assert await use_tool(http, relay, rerun_key, "echo", {"n": 2}) == (201, {"echo": {"n": 2}})
        assert (await bounded(lost))[0] == 409  # its answer came back to a fenced harness
    keys = [seen["headers"][IDEMPOTENCY_HEADER] for seen in fake.tool_seen]
    assert keys == ["fx:rollout-r:3:0", "fx:rollout-r:4:0"]
    assert session.record.states()["g0-t0"] is CallState.EXCLUDED


async def test_a_tool_answer_past_the_cap_is_dropped_unread_and_fails_the_call_once() -> None:
    """docs/spec.md section 12.9 item 2: the relay reads at most its cap (1 MiB by
    default) of an answer streamed without a length, hangs up, records no answer, and
    the call is a terminal failure; the harness gets an OpenAI-shaped 502."""
    async with upstream() as fake, aiohttp.ClientSession() as http, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE)
        status, error = await bounded(use_tool(http, relay, session.api_key, "huge", {"n": 1}))
        assert status == 502
        assert error["error"]["code"] == "upstream_too_large"
        assert error["error"]["type"] == "server_error"
        assert str(1 << 20) in error["error"]["message"]
        assert list(session.record.states().values()) == [CallState.TERMINAL_FAILURE]
        assert session.journal == [] and session.tools_forwarded == fake.huge_calls == 1
        assert session.export()["calls"] == {"g0-t0": "terminal_failure"}
        # The tool's writer ended because the relay hung up, far from the whole answer.
        await bounded(fake.huge_done.wait())
        assert fake.huge_sent < HUGE_BYTES // 4
        # The episode goes on: the next call is served.
        assert (await use_tool(http, relay, session.api_key, "echo", {"n": 2}))[0] == 201


def _port_of(fake: Upstream) -> int:
    return int(fake.base_url.removesuffix("/v1").rsplit(":", 1)[1])


async def test_a_lost_upstream_replaced_where_it_was_answers_the_calls_waiting_for_it() -> None:
    """docs/spec.md section 7.15: a policy or tool server lost mid-run comes back on its
    port; the relay asks a call that found nobody there again until it answers, as an
    SDK agent's call waits, instead of failing the harness's episode. The tool call is
    sent again under the same key."""
    fake = Upstream()
    async with upstream(fake):
        port = _port_of(fake)
    # Nobody listens on the port now: every call is refused until the server is back.
    async with aiohttp.ClientSession() as http, relay_to(fake) as relay:
        session = relay.open_episode(EPISODE)
        harness = client(relay, session.api_key)
        try:
            model = asyncio.create_task(ask(harness, "range 2 5"))
            tool = asyncio.create_task(use_tool(http, relay, session.api_key, "echo", {"n": 1}))
            await poll(lambda: len(session.record.states()) == 2)
            assert not model.done() and not tool.done()
            async with upstream(fake, port):
                assert await bounded(model) == "1"
                assert await bounded(tool) == (201, {"echo": {"n": 1}})
        finally:
            await harness.close()
    assert sorted(session.record.states().values(), key=str) == [CallState.COMPLETED] * 2
    assert len(fake.seen) == len(fake.tool_seen) == 1


async def test_an_upstream_that_stays_away_past_the_wait_fails_the_call_once() -> None:
    fake = Upstream()
    async with upstream(fake):
        pass
    async with aiohttp.ClientSession() as http, relay_to(fake, unreachable_wait_s=0.2) as relay:
        session = relay.open_episode(EPISODE)
        status, error = await bounded(use_tool(http, relay, session.api_key, "echo", {"n": 1}))
        assert status == 502 and error["error"]["code"] == "upstream"
        assert "unreachable" in error["error"]["message"]
        assert list(session.record.states().values()) == [CallState.TERMINAL_FAILURE]
