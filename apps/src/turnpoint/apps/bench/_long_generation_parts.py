"""The participants of ``turnpoint bench --long-generations`` and one measured point
(``_long_generations.py`` says what is measured; this module loads grpc, the server
and, when measuring, torch, so the command line imports it only when the bench runs).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Final

from turnpoint._keepalive import data_channel
from turnpoint.auth import auth_metadata
from turnpoint.convert import episode_to_proto
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    Agent,
    EpisodeContext,
    GenerateChunk,
    GenerateRequest,
    GenerationRequest,
    ParticipantRuntime,
    PolicyModel,
    SnapshotStore,
)
from turnpoint.server import (
    HostedParticipant,
    ServerOptions,
    generate_chunk_from_proto,
    host_participant,
)
from turnpoint.v1 import policy_service_pb2, policy_service_pb2_grpc

ENVIRONMENT: Final = "long"
PROMPT: Final = (3, 1, 4, 1, 5)


def token_at(position: int) -> int:
    """The token the policy writes at absolute ``position``: any duplicate or gap shows."""
    return position % 97 + 1


class SlowPolicy(PolicyModel):
    """One token per ``token_delay_s``; the chunk with the last token is ``done``."""

    environment = ""

    def __init__(self, token_delay_s: float, *, cuts: bool) -> None:
        self.can_cut = cuts  # type: ignore[misc]  # per instance: one bench, two modes
        self._delay = token_delay_s
        self.streamed = 0

    async def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        start = len(request.prompt_token_ids)
        for index in range(request.max_new_tokens):
            await asyncio.sleep(self._delay)
            self.streamed += 1
            last = index == request.max_new_tokens - 1
            yield GenerateChunk((token_at(start + index),), (-1.0,), last, 1)


class LongAgent(Agent):
    """Generates ``task["tokens"]`` tokens a turn, turn after turn, through ``ctx.generate``."""

    environment = ENVIRONMENT

    def __init__(self, policy_address: str, token: str, *, cuts: bool) -> None:
        self.cuts_generations = cuts
        self._metadata = auth_metadata(token)
        self._channel = data_channel(policy_address)
        self._policy = policy_service_pb2_grpc.PolicyServiceStub(self._channel)
        self.generations = 0
        self.continued = 0
        self.mismatches = 0

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        saved = ctx.restored
        turn = saved.turn_index + 1 if saved else 0
        if saved is None:
            await ctx.boundary(0, {})
            turn = 1
        episode = ctx.episode

        def stream(request: GenerationRequest) -> AsyncIterator[GenerateChunk]:
            return self._stream(episode, request)

        tokens = int(task["tokens"])
        expected = tuple(token_at(len(PROMPT) + i) for i in range(tokens))
        while turn <= int(task["turns"]):
            generation = await ctx.generate(PROMPT, tokens, stream)
            self.generations += 1
            self.continued += generation.cuts > 0
            self.mismatches += generation.token_ids != expected
            await ctx.boundary(turn, {})
            turn += 1
        return {"turns": turn}

    async def _stream(
        self, episode: EpisodeId, request: GenerationRequest
    ) -> AsyncIterator[GenerateChunk]:
        call = self._policy.Generate(
            policy_service_pb2.GenerateRequest(
                request_id=secrets.token_hex(8),
                episode=episode_to_proto(episode),
                prompt_token_ids=request.prompt_token_ids,
                max_new_tokens=request.max_new_tokens,
                accept_cut=request.accept_cut,
            ),
            metadata=self._metadata,
            timeout=600,
        )
        async for chunk in call:
            yield generate_chunk_from_proto(chunk)

    async def aclose(self) -> None:
        await self._channel.close(None)


async def measure_one(
    root: Path,
    tokens: int,
    *,
    cut: bool,
    token_delay_s: float,
    snapshots: int,
    rollouts: int,
) -> dict[str, Any]:
    import torch

    from turnpoint.trainer import (
        Checkpointing,
        CoordinatorConfig,
        Rollout,
        SnapshotOutcome,
        TorchAnchorSource,
        torch_anchor_loader,
    )

    token = secrets.token_hex(16)
    options = ServerOptions(port=0, token=token)
    policy = SlowPolicy(token_delay_s, cuts=cut)
    hosts: list[HostedParticipant] = []
    agent: LongAgent | None = None
    try:
        policy_host = host_participant(
            ParticipantRuntime("policy", SnapshotStore(root / "snapshots"), model=policy), options
        )
        hosts.append(await policy_host.start())
        agent = LongAgent(policy_host.address, token, cuts=cut)
        agent_host = host_participant(
            ParticipantRuntime("agent-0", SnapshotStore(root / "snapshots"), agent=agent), options
        )
        hosts.append(await agent_host.start())
        model = torch.nn.Linear(2, 2)
        config = CoordinatorConfig.from_mapping(
            {
                "snapshot_root": str(root / "snapshots"),
                "target_level": "token" if cut else "turn",
                "keep_snapshots": 1,
            }
        )
        closed: list[float] = []
        published = 0
        async with Checkpointing(
            config,
            {"policy": policy_host.address, "agent-0": agent_host.address},
            token=token,
            anchor=TorchAnchorSource(model, None, step=lambda: 0),
            load_anchor=torch_anchor_loader(model, None),
            periodic=False,
            final_snapshot=False,  # the bench times the snapshots it takes, no other
        ) as ckpt:
            for index in range(rollouts):
                ckpt.dispatch(
                    Rollout(
                        rollout_id=f"long-{index}",
                        prompt_group_id=f"group-{index}",
                        sibling_index=0,
                        group_size=1,
                        environment=ENVIRONMENT,
                        instance="agent-0",
                        task={"tokens": tokens, "turns": 1_000_000},
                    )
                )
            generation_s = tokens * token_delay_s
            for number in range(snapshots):
                # Land each snapshot at another point of the generations in flight.
                await asyncio.sleep(generation_s * (1.0 + number / max(snapshots, 1)))
                report = await ckpt.snapshot_now()
                if report.outcome is SnapshotOutcome.PUBLISHED:
                    published += 1
                    closed.append(report.admission_closed_s)
        return {
            "tokens": tokens,
            "cut": cut,
            "admission_closed_s": tuple(closed),
            "published": published,
            "generations": agent.generations,
            "continued": agent.continued,
            "mismatches": agent.mismatches,
        }
    finally:
        for host in reversed(hosts):
            await host.stop(0)
        if agent is not None:
            await agent.aclose()
