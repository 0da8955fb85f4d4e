"""A policy that cuts and an agent that records cuts, for the token-prefix tests.

:class:`CountingPolicy` streams one token per chunk and only as far as the test lets it
(``release``). Its tokens are a function of the absolute position in the sequence, so a
generation continued from prompt plus prefix streams exactly the tokens an uncut one
would: a test can compare the finished turn with :func:`expected_completion`. It logs
every token it ever streams, which is what the exactly-once audit counts.

:class:`CuttingAgent` seals boundary 0, then each turn generates through ``ctx.generate``
and seals the turn with every completion so far; its result holds the completions, their
log-probabilities and weights versions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any

import grpc

from turnpoint.auth import auth_metadata
from turnpoint.convert import episode_to_proto
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    Agent,
    EpisodeContext,
    GenerateChunk,
    GenerateRequest,
    Generation,
    GenerationRequest,
    PolicyModel,
    WeightsChange,
)
from turnpoint.server import generate_chunk_from_proto
from turnpoint.v1 import policy_service_pb2, policy_service_pb2_grpc

EOS = 0
PROMPT = (7, 8, 9)


def token_at(position: int) -> int:
    """The token at absolute ``position`` of the sequence (never EOS)."""
    return position % 50 + 1


def expected_completion(max_new_tokens: int, eos_after: int | None) -> tuple[int, ...]:
    """What an uncut generation after :data:`PROMPT` streams."""
    tokens: list[int] = []
    for index in range(max_new_tokens):
        if eos_after is not None and index == eos_after:
            tokens.append(EOS)
            break
        tokens.append(token_at(len(PROMPT) + index))
    return tuple(tokens)


class CountingPolicy(PolicyModel):
    """One token per chunk, each let through by the test; the chunk with the last is done.

    ``eos_after``: the completion index (counted from the end of :data:`PROMPT`) at which
    the model writes EOS and stops, or None. ``free``: let every token through.
    """

    can_cut = True

    def __init__(self, *, eos_after: int | None = None, free: bool = False) -> None:
        self.eos_after = eos_after
        self.free = free
        self.version = 1
        self.gate = asyncio.Semaphore(0)
        self.streamed: list[tuple[EpisodeId, int, int]] = []  # episode, position, version
        self.changed = asyncio.Condition()
        self.streaming = 0
        self.swapping = False

    def release(self, tokens: int = 1) -> None:
        for _ in range(tokens):
            self.gate.release()

    async def wait_streamed(self, count: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.streamed) >= count)

    async def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        async with self.changed:
            await self.changed.wait_for(lambda: not self.swapping)
            self.streaming += 1
            self.changed.notify_all()
        try:
            start = len(request.prompt_token_ids)
            for index in range(request.max_new_tokens):
                if not self.free:
                    await self.gate.acquire()
                position = start + index
                completion_index = position - len(PROMPT)
                ended = self.eos_after is not None and completion_index == self.eos_after
                token = EOS if ended else token_at(position)
                last = ended or index == request.max_new_tokens - 1
                async with self.changed:
                    self.streamed.append((episode, position, self.version))
                    self.changed.notify_all()
                yield GenerateChunk((token,), (-0.25,), last, self.version)
                if last:
                    return
        finally:
            async with self.changed:
                self.streaming -= 1
                self.changed.notify_all()

    async def update_weights(self, weights_version: int, state: bytes) -> int:
        # Like the example policy: never swap weights under a streaming generation.
        async with self.changed:
            self.swapping = True
            try:
                await self.changed.wait_for(lambda: self.streaming == 0)
                self.version = weights_version
            finally:
                self.swapping = False
                self.changed.notify_all()
        return self.version


Streamer = Callable[[EpisodeId, GenerationRequest], AsyncIterator[GenerateChunk]]


class CuttingAgent(Agent):
    """``task["turns"]`` turns of ``task["max_new_tokens"]`` tokens each after PROMPT."""

    cuts_generations = True

    def __init__(self, streamer: Streamer, *, rerun: bool = False) -> None:
        self._streamer = streamer
        self.weights_change = WeightsChange.RERUN if rerun else WeightsChange.KEEP
        self.generations: list[Generation] = []

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        saved = ctx.restored
        completions: list[list[int]] = (
            [list(c) for c in saved.state["completions"]] if saved else []
        )
        versions: list[list[int]] = [list(v) for v in saved.state["versions"]] if saved else []
        if saved is None:
            await ctx.boundary(0, {"completions": [], "versions": []})
        episode = ctx.episode

        def stream(request: GenerationRequest) -> AsyncIterator[GenerateChunk]:
            return self._streamer(episode, request)

        while len(completions) < task["turns"]:
            generation = await ctx.generate(PROMPT, task["max_new_tokens"], stream)
            self.generations.append(generation)
            completions.append(list(generation.token_ids))
            versions.append(list(generation.weights_versions))
            await ctx.boundary(len(completions), {"completions": completions, "versions": versions})
        return {"completions": completions, "versions": versions}


def in_process(policy_runtime: Any) -> Streamer:
    """A streamer that calls a policy :class:`ParticipantRuntime` in this process."""

    async def stream(
        episode: EpisodeId, request: GenerationRequest
    ) -> AsyncIterator[GenerateChunk]:
        chunks = policy_runtime.generate(
            episode,
            GenerateRequest(
                request.prompt_token_ids, request.max_new_tokens, accept_cut=request.accept_cut
            ),
        )
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    return stream


class OverGrpc:
    """A streamer that calls a policy server's ``Generate`` over gRPC (the wire form of
    the cut: ``GenerateResponse.cut``)."""

    def __init__(self, address: str, token: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = policy_service_pb2_grpc.PolicyServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self.responses: list[policy_service_pb2.GenerateResponse] = []

    async def __call__(
        self, episode: EpisodeId, request: GenerationRequest
    ) -> AsyncIterator[GenerateChunk]:
        call = self._stub.Generate(
            policy_service_pb2.GenerateRequest(
                request_id=f"gen-{episode.rollout_id}-{len(request.prompt_token_ids)}",
                episode=episode_to_proto(episode),
                prompt_token_ids=request.prompt_token_ids,
                max_new_tokens=request.max_new_tokens,
                accept_cut=request.accept_cut,
            ),
            metadata=self._metadata,
            timeout=60,
        )
        async for response in call:
            self.responses.append(response)
            yield generate_chunk_from_proto(response)

    async def aclose(self) -> None:
        await self._channel.close(None)
