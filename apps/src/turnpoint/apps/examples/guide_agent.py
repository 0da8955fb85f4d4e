"""The participant guide's agent server: counts to a target with the counter tool.

Each turn is one tool call, then a sealed boundary (docs/spec.md section 5.2). Boundary 0
is sealed on acceptance and every later call goes through ``ctx.model_call``, so the
episode counts as parked while it waits on a server a checkpoint holds closed (section
5.2 item 8); each of those calls is safe to issue again after a restore.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any

import grpc

from turnpoint.auth import auth_metadata
from turnpoint.convert import episode_to_proto, struct_from_mapping, struct_to_dict
from turnpoint.participant_sdk import Agent, EpisodeContext
from turnpoint.v1 import resources_service_pb2 as rs
from turnpoint.v1 import resources_service_pb2_grpc as rs_grpc


class CounterAgent(Agent):
    def __init__(self, tools_address: str, token: str, *, turn_delay_s: float = 0.0) -> None:
        self._channel = grpc.aio.insecure_channel(tools_address)
        self._tools = rs_grpc.ResourcesServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self._turn_delay_s = turn_delay_s  # a slow model, so snapshots cut episodes mid-way

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        e, saved = ctx.episode, ctx.restored
        total = int(saved.state["total"]) if saved else 0
        turn = saved.turn_index if saved else 0
        if saved is None:
            await ctx.boundary(0, {"total": 0})  # accepted; owns nothing yet
        base = f"{e.rollout_id}-{e.attempt}"
        seed = rs.SeedSessionRequest(
            request_id=f"seed-{base}", episode=episode_to_proto(e), task=struct_from_mapping(task)
        )
        await ctx.model_call(lambda: self._tools.SeedSession(seed, **self._call()))
        while total < int(task["target"]):
            total = await ctx.model_call(functools.partial(self._add, e, turn, base))
            turn += 1
            await ctx.boundary(turn, {"total": total})  # parks here during a checkpoint
        verify = rs.VerifyRequest(
            request_id=f"verify-{base}",
            episode=episode_to_proto(e),
            answer=struct_from_mapping({"total": total}),
        )
        verdict = await ctx.model_call(lambda: self._tools.Verify(verify, **self._call()))
        return {"total": total, "turns": turn, "reward": verdict.reward}

    async def _add(self, episode: Any, turn: int, base: str) -> int:
        await asyncio.sleep(self._turn_delay_s)
        request = rs.CallRequest(
            request_id=f"add-{base}-{turn}",
            episode=episode_to_proto(episode),
            tool="add",
            arguments=struct_from_mapping({"turn": turn, "add": 1}),
        )
        reply = await self._tools.Call(request, **self._call())
        return int(struct_to_dict(reply.output)["total"])

    def _call(self) -> dict[str, Any]:
        return {"metadata": self._metadata, "timeout": 30}  # every RPC has a deadline

    async def aclose(self) -> None:
        await self._channel.close(None)
