"""The egress relay's figures (docs/spec.md sections 12.6 to 12.8).

- **relay overhead**: the same chat call to the example policy endpoint, directly and
  through the relay (credential checked, call tagged, recorded, answer journaled), in
  interleaved blocks; the median relayed call over the median direct one, a ratio taken
  in the same run.
- **restore by replay**: an episode of N turns (a ReAct-shaped loop: each turn's
  messages are the last turn's plus its answer and an observation) run live through the
  relay; its state exported through JSON as a snapshot holds it and installed in a fresh
  relay, where the same N calls are asked again and answered from the record. The
  figure is the seconds from the install until the restored harness is at the cut,
  against the live run's seconds.

The harness is an in-process HTTP client here: a harness process's own start-up (an
interpreter, its imports) is the same with or without turnpoint and is left out.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from turnpoint.apps.examples._participants import TinyPolicyServer, new_policy
from turnpoint.apps.examples.chat_template import MODEL_NAME, GuessChatTemplate
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import ParticipantRuntime, SnapshotStore
from turnpoint.server.openai_api import (
    ATTEMPT_HEADER,
    ROLLOUT_HEADER,
    ChatEndpoint,
    EgressRelay,
    EndpointOptions,
    RelayOptions,
)

_ENDPOINT_KEY: Final = "sk-bench-endpoint"
_BLOCK: Final = 10  # calls per block; direct and relayed blocks alternate
_MAX_TOKENS: Final = 3
_CONTEXT_TURNS: Final = 4  # the overhead's calls carry a few turns of context


@dataclass(frozen=True, slots=True)
class RelayOverhead:
    calls: int  # each way
    direct_ms: float  # median per call
    relayed_ms: float

    @property
    def ratio(self) -> float:
        return self.relayed_ms / self.direct_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "direct_ms": round(self.direct_ms, 3),
            "relayed_ms": round(self.relayed_ms, 3),
            "relayed_vs_direct": round(self.ratio, 3),
        }


@dataclass(frozen=True, slots=True)
class ReplayRow:
    turns: int
    live_s: float
    replay_s: float
    state_bytes: int  # the episode's exported relay state, as JSON

    @property
    def ratio(self) -> float:
        return self.replay_s / self.live_s

    def to_json(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "live_s": round(self.live_s, 4),
            "replay_s": round(self.replay_s, 4),
            "replay_vs_live": round(self.ratio, 4),
            "state_bytes": self.state_bytes,
        }


@dataclass(frozen=True, slots=True)
class RelayFigures:
    overhead: RelayOverhead
    replay: tuple[ReplayRow, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "overhead": self.overhead.to_json(),
            "replay": [row.to_json() for row in self.replay],
        }


def _messages(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": "range 2 9"}]
    for _ in range(turns):
        messages += [{"role": "assistant", "content": "5"}, {"role": "tool", "content": "higher"}]
    return messages


def _body(messages: list[dict[str, str]], seed: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": messages,
        "max_completion_tokens": _MAX_TOKENS,
        "temperature": 0,
        "seed": seed,
    }


async def _chat(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]
) -> str:
    async with http.post(url + "/chat/completions", json=body, headers=headers) as answer:
        answer.raise_for_status()
        reply = await answer.json()
    return str(reply["choices"][0]["message"]["content"] or "")


async def _episode(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], turns: int
) -> None:
    """A ReAct-shaped loop of ``turns`` calls, each with the whole conversation so far."""
    messages = _messages(0)
    for turn in range(turns):
        text = await _chat(http, url, headers, _body(messages, turn))
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": "lower"}]


@asynccontextmanager
async def _endpoint(root: Path) -> AsyncIterator[ChatEndpoint]:
    runtime = ParticipantRuntime(
        "policy", SnapshotStore(root), model=TinyPolicyServer(new_policy(0))
    )
    await runtime.start()
    options = EndpointOptions(model=MODEL_NAME, api_key=_ENDPOINT_KEY, max_tokens=8)
    try:
        async with ChatEndpoint(runtime, GuessChatTemplate(), options) as endpoint:
            yield endpoint
    finally:
        await runtime.aclose()


def _relay_options(endpoint: ChatEndpoint) -> RelayOptions:
    return RelayOptions(endpoint.base_url, MODEL_NAME, upstream_api_key=_ENDPOINT_KEY)


async def measure_egress_relay(
    root: Path, calls: int, replay_turns: tuple[int, ...]
) -> RelayFigures:
    """The overhead over ``calls`` calls each way, and one replay row per episode length."""
    async with _endpoint(root / "policy") as endpoint, aiohttp.ClientSession() as http:
        async with EgressRelay(_relay_options(endpoint)) as relay:
            overhead = await _overhead(http, endpoint, relay, calls)
        rows = []
        for index, turns in enumerate(replay_turns):
            rows.append(await _replay(http, endpoint, EpisodeId(f"bench-replay-{index}", 0), turns))
    return RelayFigures(overhead, tuple(rows))


async def _overhead(
    http: aiohttp.ClientSession, endpoint: ChatEndpoint, relay: EgressRelay, calls: int
) -> RelayOverhead:
    episode = EpisodeId("bench-overhead", 0)
    direct_headers = {
        "Authorization": f"Bearer {_ENDPOINT_KEY}",
        ROLLOUT_HEADER: episode.rollout_id,
        ATTEMPT_HEADER: str(episode.attempt),
    }
    session = relay.open_episode(episode)
    relayed_headers = {"Authorization": f"Bearer {session.api_key}"}
    messages = _messages(_CONTEXT_TURNS)
    direct: list[float] = []
    relayed: list[float] = []
    seed = 0
    # One warm-up call each way; then alternating blocks, so drift hits both alike.
    await _chat(http, endpoint.base_url, direct_headers, _body(messages, seed))
    await _chat(http, relay.base_url, relayed_headers, _body(messages, seed + 1))
    seed += 2
    while len(relayed) < calls:
        for url, headers, times in (
            (endpoint.base_url, direct_headers, direct),
            (relay.base_url, relayed_headers, relayed),
        ):
            for _ in range(min(_BLOCK, calls - len(times))):
                body = _body(messages, seed)  # a new call each time: never a replay
                seed += 1
                started = time.perf_counter()
                await _chat(http, url, headers, body)
                times.append(time.perf_counter() - started)
    relay.close_episode(episode)
    return RelayOverhead(calls, statistics.median(direct) * 1e3, statistics.median(relayed) * 1e3)


async def _replay(
    http: aiohttp.ClientSession, endpoint: ChatEndpoint, episode: EpisodeId, turns: int
) -> ReplayRow:
    async with EgressRelay(_relay_options(endpoint)) as relay:
        session = relay.open_episode(episode)
        started = time.perf_counter()
        await _episode(http, relay.base_url, {"Authorization": f"Bearer {session.api_key}"}, turns)
        live_s = time.perf_counter() - started
        saved = json.dumps(session.export())
    async with EgressRelay(_relay_options(endpoint)) as relay:
        started = time.perf_counter()
        restored = relay.open_episode(episode.next_attempt(), json.loads(saved))
        await _episode(http, relay.base_url, {"Authorization": f"Bearer {restored.api_key}"}, turns)
        replay_s = time.perf_counter() - started
        if restored.replayed != turns or restored.forwarded != 0:
            raise RuntimeError(
                f"the replay answered {restored.replayed} of {turns} calls from the record "
                f"and forwarded {restored.forwarded}"
            )
    return ReplayRow(turns, live_s, replay_s, len(saved.encode()))
