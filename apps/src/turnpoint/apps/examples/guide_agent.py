"""The participant guide's agent server: counts to a target with the counter tool.

Each turn is one tool call, then a sealed boundary (docs/spec.md section 5.2). Boundary 0
is sealed on acceptance; the seed, every tool call and the verify go through the SDK's
tool client (``ctx.seed``, ``ctx.call``, ``ctx.verify`` over a
:class:`~turnpoint.server.ResourcesClient`): each counts as parked while it waits on a
server a checkpoint holds closed (section 5.2 item 8), is retried on a lost reply, and
is keyed, so the counter runs each call once, across retries and restores (section 6.12).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from turnpoint.participant_sdk import Agent, EpisodeContext
from turnpoint.server import ResourcesClient


class CounterAgent(Agent):
    def __init__(self, tools_address: str, token: str, *, turn_delay_s: float = 0.0) -> None:
        self._tools = ResourcesClient(tools_address, token=token)
        self._turn_delay_s = turn_delay_s  # a slow model, so snapshots cut episodes mid-way

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        saved = ctx.restored
        total = int(saved.state["total"]) if saved else 0
        turn = saved.turn_index if saved else 0
        if saved is None:
            await ctx.boundary(0, {"total": 0})  # accepted; owns nothing yet
        await ctx.seed(self._tools, task)  # idempotent: a restored attempt seeds again
        while total < int(task["target"]):
            if self._turn_delay_s:
                await ctx.model_call(lambda: asyncio.sleep(self._turn_delay_s))
            reply = await ctx.call(self._tools, "add", {"turn": turn, "add": 1})
            total = int(reply["total"])
            turn += 1
            await ctx.boundary(turn, {"total": total})  # parks here during a checkpoint
        verdict = await ctx.verify(self._tools, {"total": total})
        return {"total": total, "turns": turn, "reward": verdict.reward}

    async def aclose(self) -> None:
        await self._tools.aclose()
