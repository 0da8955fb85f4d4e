"""The data plane: rollout, resources and policy RPCs, delegated to the hosted kinds.

A mixin of :class:`~._runtime.ParticipantRuntime`. Each call goes to the host of the
kind it names (docs/spec.md sections 5 and 6); a participant that does not host that
kind answers ``NOT_FOUND``. Admission control and parking live in the hosts.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.protocol import CompletionReceipt, Fence

from ._agent import AgentHost, BoundaryReport, RunResult
from ._model import GenerateChunk, GenerateRequest, ModelHost
from ._resources import ResourcesHost, Verdict
from ._results import AcknowledgeResult
from ._shared import Shared
from ._token_prefix import WeightsChange


class DataPlane:
    """RolloutService, ResourcesService and PolicyService calls of one participant."""

    _shared: Shared
    _incarnation: str
    agent: AgentHost | None
    resources: ResourcesHost | None
    model: ModelHost | None

    async def _check_data_fence(self, fence: Fence | None) -> None:
        if fence is None:
            return  # not fenced (a tool): no need to take the lock
        async with self._shared.changing() as core:
            core.check_data_fence(fence)

    def _check_incarnation(self, episode: EpisodeId, named: str) -> None:
        if named and named != self._incarnation:
            raise TurnpointError(
                Reason.STALE_ATTEMPT,
                f"{episode} was accepted by incarnation {named}, not by this one "
                f"({self._incarnation}): that execution is gone",
                {
                    "episode": str(episode),
                    "incarnation": self._incarnation,
                    "request_incarnation": named,
                },
            )

    def _agent(self) -> AgentHost:
        if self.agent is None:
            raise TurnpointError(Reason.NOT_FOUND, "this participant hosts no agent")
        return self.agent

    def _resources(self) -> ResourcesHost:
        if self.resources is None:
            raise TurnpointError(Reason.NOT_FOUND, "this participant hosts no resources")
        return self.resources

    def _model(self) -> ModelHost:
        if self.model is None:
            raise TurnpointError(Reason.NOT_FOUND, "this participant hosts no policy model")
        return self.model

    def run_episode(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        *,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
        weights_change: WeightsChange | None = None,
    ) -> AsyncGenerator[BoundaryReport | RunResult, None]:
        """RolloutService.Run; see :meth:`AgentHost.run_episode` (close it when done)."""
        return self._agent().run_episode(
            episode,
            task,
            boundaries_seen=boundaries_seen,
            budget_s=budget_s,
            weights_change=weights_change,
        )

    async def accept_run(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        *,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
        fence: Fence | None = None,
        weights_change: WeightsChange | None = None,
        wait_for_admission: bool = False,
        participant_incarnation: str = "",
    ) -> AsyncGenerator[BoundaryReport | RunResult, None]:
        """Accept a Run now (errors raise here), then follow it; see :meth:`AgentHost.accept_run`.

        ``participant_incarnation`` (a re-attach: the incarnation that accepted the
        attempt) other than this process's is ``STALE_ATTEMPT`` before anything starts:
        the execution it names died with that process (docs/spec.md section 6.5 item 5).
        """
        if fence is not None:
            await self._check_data_fence(fence)
        if participant_incarnation:
            self._check_incarnation(episode, participant_incarnation)
        return await self._agent().accept_run(
            episode,
            task,
            boundaries_seen=boundaries_seen,
            budget_s=budget_s,
            weights_change=weights_change,
            wait_for_admission=wait_for_admission,
        )

    async def acknowledge(
        self, receipts: Iterable[CompletionReceipt], *, fence: Fence | None = None
    ) -> AcknowledgeResult:
        """RolloutService.Acknowledge: drop retained results."""
        if fence is not None:
            await self._check_data_fence(fence)
        acknowledged, unknown = await self._agent().acknowledge(receipts)
        return AcknowledgeResult(acknowledged, unknown)

    async def seed_session(self, episode: EpisodeId, task: Mapping[str, Any]) -> bool:
        """ResourcesService.SeedSession; True when the session already existed."""
        return await self._resources().seed(episode, task)

    async def call_tool(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any], request_id: str = ""
    ) -> Mapping[str, Any]:
        """ResourcesService.Call; a ``request_id`` runs the tool once per session
        (docs/spec.md section 6.12)."""
        return await self._resources().call(episode, tool, arguments, request_id)

    async def verify(
        self, episode: EpisodeId, answer: Mapping[str, Any], request_id: str = ""
    ) -> Verdict:
        """ResourcesService.Verify, deduplicated by ``request_id`` like a call."""
        return await self._resources().verify(episode, answer, request_id)

    async def close_session(self, episode: EpisodeId) -> bool:
        return await self._resources().close(episode)

    def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        """PolicyService.Generate, under admission control (close it when done)."""
        return self._model().generate(episode, request)

    async def update_weights(self, weights_version: int, state: bytes, request_id: str = "") -> int:
        """PolicyService.UpdateWeights: the trainer's weight sync, idempotent by request
        id and by version (docs/spec.md section 5.4 item 4)."""
        return await self._model().update_weights(weights_version, state, request_id)
