"""Deliberately broken participants, one defect each, for the conformance kit's own tests.

Each mutant is a real participant (the example resources server, or a small agent) with
exactly one behaviour changed by a thin wrapper around the real runtime or its
registration, served with token auth on ``127.0.0.1:0``:

- ``forgets-answers``: every control request id is made unique before the runtime sees
  it, so a superseded coordinator's retry finds no recorded answer and is FENCED
  instead of replayed (docs/spec.md section 2.2 item 3).
- ``ignores-stale-epoch``: a request from a stale fence that the participant never
  answered is taken as coming from the current coordinator (section 2.2).
- ``ready-mid-turn``: Prepare answers PREPARED, ready, as soon as it is asked, while an
  episode is still between boundaries (sections 4.1 item 3, 4.6).
- ``unknown-on-garbage``: the servicers are registered with grpc's generated helpers,
  so request bytes that do not parse end UNKNOWN instead of INVALID_ARGUMENT
  (section 10.5).
- ``lease-never-expires``: the participant's protocol clock never advances, so no
  lease ever runs out (section 4.2).
- ``ignores-record``: every ``Call`` and ``Verify`` reaches the runtime without its
  request id, so a retried or re-sent call runs the tool again and a key re-sent with
  other arguments is not refused (section 6.12).

:class:`MidTurnAgent` is not a defect: an agent whose turns do real work between
boundaries (RUNNING, which blocks a prepare until the next boundary). The
``ready-mid-turn`` mutant hosts it; hosted by an honest runtime it is the control that
shows the readiness check fails the lie, not the mid-turn episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from tests.support.participants import TOKEN
from turnpoint.apps.examples._participants import GuessTools
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    Agent,
    EpisodeContext,
    ParticipantRuntime,
    RuntimeConfig,
    SnapshotStore,
    Verdict,
)
from turnpoint.participant_sdk.advanced import PrepareResult
from turnpoint.protocol import EpisodeState, Fence, Phase
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.server.advanced import (
    CONTROL_SERVICE,
    ControlServicer,
    ParticipantServer,
    ResourcesServicer,
)
from turnpoint.v1 import (
    checkpoint_control_service_pb2_grpc,
    resources_service_pb2,
    resources_service_pb2_grpc,
)

__all__ = ["MUTANTS", "IgnoresRecord", "MidTurnAgent", "Mutant", "honest_mid_turn_agent"]

# The agent's work between two boundaries: long enough that a prepare arriving right
# after a boundary finds the episode RUNNING, short enough to keep the tests quick.
TURN_S = 0.2
TURNS = 3
# How long the impatient prepare of ``ready-mid-turn`` lets the runtime wait.
IMPATIENT_S = 0.05


class MidTurnAgent(Agent):
    """``TURNS`` turns, each ``TURN_S`` of work (RUNNING) and then a sealed boundary.

    It ignores the task's content: the kit's workload is the example environment's.
    """

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        saved = ctx.restored
        first = saved.turn_index + 1 if saved is not None else 0
        for turn in range(first, TURNS):
            await asyncio.sleep(TURN_S)  # the turn's work; the episode is mid-turn here
            await ctx.boundary(turn, {"turn": turn})
        return {"turns": TURNS}


# ---------------------------------------------------------------------- wrappers


class _FenceFilter(ParticipantRuntime):
    """Passes every mutating control call's fence and request id through :meth:`_admit`."""

    def _admit(self, fence: Fence, request_id: str) -> tuple[Fence, str]:
        return fence, request_id

    async def prepare(self, fence: Fence, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return await super().prepare(*self._admit(fence, request_id), *args, **kwargs)

    async def renew(self, fence: Fence, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return await super().renew(*self._admit(fence, request_id), *args, **kwargs)

    async def commit(self, fence: Fence, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return await super().commit(*self._admit(fence, request_id), *args, **kwargs)

    async def resume(self, fence: Fence, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return await super().resume(*self._admit(fence, request_id), *args, **kwargs)

    async def restore(self, fence: Fence, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return await super().restore(*self._admit(fence, request_id), *args, **kwargs)

    async def retire(self, fence: Fence, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return await super().retire(*self._admit(fence, request_id), *args, **kwargs)

    async def forget(self, fence: Fence, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return await super().forget(*self._admit(fence, request_id), *args, **kwargs)


class ForgetsAnswers(_FenceFilter):
    """Remembers no answer under the request id the coordinator sent."""

    def _admit(self, fence: Fence, request_id: str) -> tuple[Fence, str]:
        return fence, f"{request_id}~{secrets.token_hex(4)}"


class IgnoresStaleEpoch(_FenceFilter):
    """Takes a stale coordinator's new request for one from the current coordinator.

    Requests it already answered still reach the runtime as sent, so replay works: the
    one defect is the missing refusal.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: Fence | None = None
        self._seen: set[str] = set()

    def _newer(self, fence: Fence) -> None:
        if self._held is None or fence.epoch > self._held.epoch:
            self._held = fence

    def _admit(self, fence: Fence, request_id: str) -> tuple[Fence, str]:
        held = self._held
        stale = held is not None and (
            fence.epoch < held.epoch
            or (fence.epoch == held.epoch and fence.coordinator_id != held.coordinator_id)
        )
        if stale and request_id not in self._seen:
            assert held is not None
            fence = held
        elif not stale:
            self._newer(fence)
        self._seen.add(request_id)
        return fence, request_id

    async def describe(self, fence: Fence | None = None) -> Any:
        if fence is not None:
            self._newer(fence)
        return await super().describe(fence)


class IgnoresRecord(ParticipantRuntime):
    """Runs every tool call and verify as if it carried no key: no reply record."""

    async def call_tool(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any], request_id: str = ""
    ) -> Mapping[str, Any]:
        return await super().call_tool(episode, tool, arguments)

    async def verify(
        self, episode: EpisodeId, answer: Mapping[str, Any], request_id: str = ""
    ) -> Verdict:
        return await super().verify(episode, answer)


class ReadyMidTurn(ParticipantRuntime):
    """Prepare does not wait for running episodes to park: it answers ready at once."""

    async def prepare(
        self,
        fence: Fence,
        request_id: str,
        checkpoint_id: str,
        *,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> PrepareResult:
        result: PrepareResult = await super().prepare(
            fence, request_id, checkpoint_id, timeout_s=IMPATIENT_S, **kwargs
        )
        if result.phase is not Phase.PREPARING:
            return result
        counts = dict(result.readiness.counts)
        running = counts.pop(EpisodeState.RUNNING, 0)
        if running:
            counts[EpisodeState.PARKED] = counts.get(EpisodeState.PARKED, 0) + running
        report = replace(
            result.readiness,
            ready=True,
            blocker_count=0,
            blockers=(),
            counts=dict(sorted(counts.items(), key=lambda item: item[0].name)),
        )
        return replace(result, phase=Phase.PREPARED, readiness=report)


# ---------------------------------------------------------------------- building them


@dataclass(frozen=True)
class Mutant:
    """One broken participant: what is wrong and how to serve it."""

    name: str
    defect: str
    serve: Callable[[Path], contextlib.AbstractAsyncContextManager[str]]


def _tools(cls: type[ParticipantRuntime], root: Path, **extra: Any) -> ParticipantRuntime:
    return cls("tools", SnapshotStore(root), resources=GuessTools("tools"), **extra)


@contextlib.asynccontextmanager
async def _hosted(runtime: ParticipantRuntime) -> AsyncIterator[str]:
    hosted = host_participant(runtime, ServerOptions(port=0, token=TOKEN))
    await hosted.start()
    try:
        yield hosted.address
    finally:
        await hosted.stop(0)


def _agent(cls: type[ParticipantRuntime], root: Path) -> ParticipantRuntime:
    return cls("agent-0", SnapshotStore(root), agent=MidTurnAgent(), config=RuntimeConfig())


@contextlib.asynccontextmanager
async def honest_mid_turn_agent(root: Path) -> AsyncIterator[str]:
    """The control for ``ready-mid-turn``: the same agent under the real runtime."""
    async with _hosted(_agent(ParticipantRuntime, root)) as address:
        yield address


@contextlib.asynccontextmanager
async def _unknown_on_garbage(root: Path) -> AsyncIterator[str]:
    runtime = _tools(ParticipantRuntime, root)
    resources_service = resources_service_pb2.DESCRIPTOR.services_by_name["ResourcesService"]

    def register(server: grpc.aio.Server) -> Sequence[str]:
        # The generated helpers hand grpc the messages' own parsers: bytes that do not
        # parse fail inside grpc, which answers UNKNOWN.
        checkpoint_control_service_pb2_grpc.add_CheckpointControlServiceServicer_to_server(
            ControlServicer(runtime), server
        )
        resources_service_pb2_grpc.add_ResourcesServiceServicer_to_server(
            ResourcesServicer(runtime), server
        )
        return (CONTROL_SERVICE, resources_service.full_name)

    hosted = HostedParticipant(
        runtime, ParticipantServer(ServerOptions(port=0, token=TOKEN), register)
    )
    await hosted.start()
    try:
        yield hosted.address
    finally:
        await hosted.stop(0)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "forgets-answers",
        "forgets answers instead of replaying them",
        lambda root: _hosted(_tools(ForgetsAnswers, root)),
    ),
    Mutant(
        "ignores-stale-epoch",
        "ignores a stale epoch",
        lambda root: _hosted(_tools(IgnoresStaleEpoch, root)),
    ),
    Mutant(
        "ready-mid-turn",
        "reports ready with an episode mid-turn",
        lambda root: _hosted(_agent(ReadyMidTurn, root)),
    ),
    Mutant(
        "unknown-on-garbage",
        "answers garbage with UNKNOWN",
        _unknown_on_garbage,
    ),
    Mutant(
        "ignores-record",
        "runs a keyed tool call again instead of answering from the record",
        lambda root: _hosted(_tools(IgnoresRecord, root)),
    ),
    Mutant(
        "lease-never-expires",
        "whose lease never expires",
        # The protocol clock stands still: every lease is always just opened.
        lambda root: _hosted(_tools(ParticipantRuntime, root, clock=lambda: 0.0)),
    ),
)
