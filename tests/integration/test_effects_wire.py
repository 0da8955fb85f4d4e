"""Exactly-once tool calls on real servers (docs/spec.md section 6.12).

A dealer whose ``deal`` tool draws the next card of a seeded shoe: running it twice
changes the game, so every test counts its executions. The agent's side is the SDK's
tool client (``ctx.call`` through :class:`turnpoint.server.ResourcesClient`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.support.participants import TOKEN
from tests.support.scripted import bounded, ckpt, host_scripted, poll, restore_id, wire_to
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    Agent,
    EffectConflictError,
    EpisodeContext,
    RecoveryMode,
    ResourcesConnection,
    ResourcesServer,
    Verdict,
)
from turnpoint.participant_sdk._effects import CallPosition, effect_key
from turnpoint.server import ResourcesClient
from turnpoint.v1 import rollout_service_pb2 as ro_pb
from turnpoint.v1 import types_pb2

EP = EpisodeId("hand-1", 0)


class Dealer(ResourcesServer):
    """Deals from a shuffled shoe per session; ``executions`` counts every deal run."""

    recovery_mode: ClassVar[RecoveryMode] = RecoveryMode.EXPORTED
    environment: ClassVar[str] = "dealer"

    def __init__(self) -> None:
        self.sessions: dict[EpisodeId, dict[str, Any]] = {}
        self.executions: list[tuple[EpisodeId, str]] = []
        self.verifies = 0
        self.gate: asyncio.Event | None = None

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        shoe = list(range(1, 53))
        random.Random(int(task.get("seed", 0))).shuffle(shoe)
        self.sessions.setdefault(episode, {"shoe": shoe, "hand": []})

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        self.executions.append((episode, tool))
        if self.gate is not None:
            await self.gate.wait()
        session = self.sessions[episode]
        card = session["shoe"].pop(0)
        session["hand"].append(card)
        return {"card": card, "count": int(arguments.get("count", 1)), "held": len(session["hand"])}

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        self.verifies += 1
        return Verdict(float(sum(self.sessions[episode]["hand"]) <= 21))

    async def close(self, episode: EpisodeId) -> None:
        self.sessions.pop(episode, None)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        return {
            e: {"shoe": list(s["shoe"]), "hand": list(s["hand"])}
            for e, s in self.sessions.items()
            if e in episodes
        }

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        self.sessions[episode] = {"shoe": list(state["shoe"]), "hand": list(state["hand"])}

    async def retire_session(self, episode: EpisodeId) -> None:
        self.sessions.pop(episode, None)


class LosesFirstReply:
    """A connection whose first call's reply is lost after the server acted."""

    def __init__(self, inner: ResourcesConnection) -> None:
        self.inner = inner
        self.lost = 0
        self.keys: list[str] = []

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> bool:
        return await self.inner.seed(episode, task)

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any], *, request_id: str
    ) -> Mapping[str, Any]:
        self.keys.append(request_id)
        reply = await self.inner.call(episode, tool, arguments, request_id=request_id)
        if not self.lost:
            self.lost += 1
            raise TurnpointError(Reason.UNAVAILABLE, "the reply was lost")
        return reply

    async def verify(
        self, episode: EpisodeId, answer: Mapping[str, Any], *, request_id: str
    ) -> Verdict:
        self.keys.append(request_id)
        verdict = await self.inner.verify(episode, answer, request_id=request_id)
        if self.lost < 2:
            self.lost = 2
            raise TurnpointError(Reason.DEADLINE_EXCEEDED, "the verify's reply was lost")
        return verdict


class Player(Agent):
    """Draws ``task["cards"]`` cards, one per turn, then verifies."""

    def __init__(self, dealer: ResourcesConnection) -> None:
        self.dealer = dealer

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        await ctx.boundary(0, {"cards": []})
        await ctx.seed(self.dealer, task)
        cards: list[int] = []
        for turn in range(1, int(task["cards"]) + 1):
            dealt = await ctx.call(self.dealer, "deal", {"count": 1})
            assert type(dealt["card"]) is int  # ints stay ints across the wire
            cards.append(dealt["card"])
            await ctx.boundary(turn, {"cards": cards})
        verdict = await ctx.verify(self.dealer, {"cards": cards})
        return {"cards": cards, "reward": verdict.reward}


async def test_a_lost_reply_is_retried_with_its_key_and_the_tool_runs_once(tmp_path: Path) -> None:
    dealer = Dealer()
    async with host_scripted(tmp_path / "tools", instance="tools-0", resources=dealer) as tools:
        client = ResourcesClient(tools.address, token=TOKEN)
        lossy = LosesFirstReply(client)
        try:
            async with (
                host_scripted(tmp_path / "agent", agent=Player(lossy)) as agent,
                wire_to(agent, "unary") as wire,
            ):
                result = await wire.run(EP, {"cards": 3, "seed": 7}).done()
        finally:
            await client.aclose()
    assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED, result
    assert len(dealer.executions) == 3 and dealer.verifies == 1
    # The first deal and the verify were each sent twice, with the same key.
    first = effect_key("hand-1", CallPosition(0, 0))
    assert lossy.keys[:2] == [first, first]
    assert lossy.keys.count(effect_key("hand-1", CallPosition(3, 0))) == 2


async def test_a_retry_while_the_call_runs_waits_for_it_and_other_arguments_are_refused(
    tmp_path: Path,
) -> None:
    dealer = Dealer()
    dealer.gate = asyncio.Event()
    key = effect_key("hand-1", CallPosition(0, 0))
    async with host_scripted(tmp_path, instance="tools-0", resources=dealer) as tools:
        client = ResourcesClient(tools.address, token=TOKEN)
        try:
            await client.seed(EP, {"seed": 1})
            first = asyncio.create_task(client.call(EP, "deal", {"count": 1}, request_id=key))
            second = asyncio.create_task(client.call(EP, "deal", {"count": 1.0}, request_id=key))
            await poll(lambda: len(dealer.executions) == 1)
            with pytest.raises(EffectConflictError) as diverged:
                await client.call(EP, "deal", {"count": 2}, request_id=key)
            assert diverged.value.divergence == "arguments"
            assert diverged.value.metadata["request_id"] == key
            with pytest.raises(EffectConflictError) as other_tool:
                await client.call(EP, "split", {"count": 1}, request_id=key)
            assert other_tool.value.divergence == "tool"
            dealer.gate.set()
            replies = await bounded(asyncio.gather(first, second))
            again = await client.call(EP, "deal", {"count": 1}, request_id=key)
        finally:
            await client.aclose()
    assert replies[0] == replies[1] == again
    assert len(dealer.executions) == 1


async def test_a_continued_attempt_after_a_restore_gets_the_recorded_reply(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    key_before = effect_key("hand-1", CallPosition(0, 0))
    key_after = effect_key("hand-1", CallPosition(0, 1))
    first_dealer = Dealer()
    async with (
        host_scripted(root, instance="tools-0", resources=first_dealer) as tools,
        wire_to(tools, "unary") as wire,
    ):
        client = ResourcesClient(tools.address, token=TOKEN)
        try:
            await client.seed(EP, {"seed": 3})
            dealt = await client.call(EP, "deal", {}, request_id=key_before)
            prepared = await wire.prepare(ckpt(1), lease_s=60)
            assert prepared.phase == types_pb2.PHASE_PREPARED, prepared
            committed = await wire.commit(ckpt(1), "snap-1", [EP])
            await wire.resume(ckpt(1))
        finally:
            await client.aclose()
    dealer = Dealer()
    continued = EP.next_attempt()
    async with (
        host_scripted(root, instance="tools-0", resources=dealer) as tools,
        wire_to(tools, "unary") as wire,
    ):
        restored = await wire.restore(restore_id(1), "snap-1", committed, [EP])
        assert len(restored.installed) == 1
        await wire.resume(restore_id(1))
        client = ResourcesClient(tools.address, token=TOKEN)
        try:
            # The continued attempt re-sends the call the cut already holds: answered
            # from the record, the shoe untouched; its next call deals the next card.
            again = await client.call(continued, "deal", {}, request_id=key_before)
            assert dealer.executions == []
            fresh = await client.call(continued, "deal", {}, request_id=key_after)
            assert dealer.executions == [(continued, "deal")]
            with pytest.raises(EffectConflictError):
                await client.call(continued, "deal", {"count": 9}, request_id=key_before)
            verdict_key = effect_key("hand-1", CallPosition(1, 0))
            hand = {"cards": [dealt["card"], fresh["card"]]}
            verdict = await client.verify(continued, hand, request_id=verdict_key)
            assert await client.verify(continued, hand, request_id=verdict_key) == verdict
            # Sealed by the verify, the session still refuses its key with another answer.
            with pytest.raises(EffectConflictError) as sealed:
                await client.verify(continued, {"cards": [0]}, request_id=verdict_key)
            assert sealed.value.divergence == "arguments"
            assert dealer.verifies == 1
        finally:
            await client.aclose()
    assert again == dealt
    assert fresh["card"] != dealt["card"] and fresh["held"] == 2


def _guide_example() -> str:
    """The tool-client example of docs/participant.md, as the reader sees it."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "participant.md").read_text()
    section = guide.split("## Calling tools from the agent", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


async def test_the_guides_tool_client_example_deals_each_card_once(tmp_path: Path) -> None:
    namespace: dict[str, Any] = {"Agent": Agent}
    exec(compile(_guide_example(), "docs/participant.md", "exec"), namespace)
    dealer = Dealer()
    async with host_scripted(tmp_path / "tools", instance="tools-0", resources=dealer) as tools:
        player = namespace["DealerAgent"](tools.address, TOKEN)
        try:
            async with (
                host_scripted(tmp_path / "agent", agent=player) as agent,
                wire_to(agent, "unary") as wire,
            ):
                result = await wire.run(EP, {"cards": 2, "seed": 5}).done()
        finally:
            await player.dealer.aclose()
    assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED, result
    assert len(dealer.executions) == 2 and dealer.verifies == 1
