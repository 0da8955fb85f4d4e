"""The data-plane servicers: RolloutService, PolicyService, ResourcesService.

Thin adapters over :class:`ParticipantRuntime`, like the control servicer: convert,
call, convert back, and map :class:`TurnpointError` to a rich status in one place.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc

from turnpoint._status import abort
from turnpoint.auth import accepted_metadata
from turnpoint.convert import (
    bad_argument,
    check_list_length,
    duration_from_seconds,
    enum_from_proto,
    enum_to_proto,
    episode_from_proto,
    episode_to_proto,
    fence_from_proto,
    receipt_from_proto,
    receipt_to_proto,
    seconds_from_duration,
    struct_from_mapping,
    struct_to_dict,
    timestamp_from_seconds,
)
from turnpoint.errors import TurnpointError
from turnpoint.ids import InvalidIdError
from turnpoint.participant_sdk import GenerateRequest, ParticipantRuntime, WeightsChange
from turnpoint.participant_sdk.advanced import BoundaryReport, RunResult, hook_failure
from turnpoint.server._convert import header_to_proto
from turnpoint.v1 import (
    policy_service_pb2,
    policy_service_pb2_grpc,
    resources_service_pb2,
    resources_service_pb2_grpc,
    rollout_service_pb2,
    rollout_service_pb2_grpc,
    types_pb2,
)

Context = grpc.aio.ServicerContext[Any, Any]
_log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def _errors(context: Context, operation: str) -> AsyncIterator[None]:
    try:
        yield
    except TurnpointError as error:
        await abort(context, error)
    except InvalidIdError as error:
        await abort(context, bad_argument(error))
    except Exception as error:  # noqa: BLE001 - a hook's failure is data, never UNKNOWN
        mapped = hook_failure(error, operation)
        _log.warning(
            "%s failed in a participant hook (%s); the caller sees %s",
            operation,
            type(error).__name__,
            mapped.reason.name,
            exc_info=error,
        )
        await abort(context, mapped)


class RolloutServicer(rollout_service_pb2_grpc.RolloutServiceServicer):
    def __init__(self, runtime: ParticipantRuntime, *, max_list_length: int = 10_000) -> None:
        self._runtime = runtime
        self._max_list = max_list_length

    def _event(self, event: BoundaryReport | RunResult) -> rollout_service_pb2.RunResponse:
        header = header_to_proto(self._runtime.header())
        if isinstance(event, BoundaryReport):
            return rollout_service_pb2.RunResponse(
                header=header,
                boundary=rollout_service_pb2.BoundaryReport(
                    episode=episode_to_proto(event.episode),
                    boundary_index=event.boundary_index,
                    turn_index=event.turn_index,
                    sealed_at=timestamp_from_seconds(event.sealed_at),
                ),
            )
        result = rollout_service_pb2.RunResult(
            episode=episode_to_proto(event.episode),
            outcome=enum_to_proto(rollout_service_pb2.RunOutcome, event.outcome),
            result=struct_from_mapping(event.result),
            turns=event.turns,
            active_time=duration_from_seconds(event.active_time_s),
            error_message=event.error_message,
        )
        if event.receipt is not None:
            result.receipt.CopyFrom(receipt_to_proto(event.receipt))
        return rollout_service_pb2.RunResponse(header=header, result=result)

    async def Run(
        self, request: rollout_service_pb2.RunRequest, context: Context
    ) -> AsyncIterator[rollout_service_pb2.RunResponse]:
        async with _errors(context, "Run"):
            episode = episode_from_proto(request.episode)
            task = struct_to_dict(request.task, "task")
            budget_s = seconds_from_duration(request.budget, "budget")
            fence = fence_from_proto(request.fence, True) if request.HasField("fence") else None
            # UNSPECIFIED (an older coordinator, a tool): the agent's own setting.
            weights_change = enum_from_proto(
                types_pb2.WeightsChange, WeightsChange, request.weights_change, "weights_change"
            )
            stream = await self._runtime.accept_run(
                episode,
                task,
                boundaries_seen=request.boundaries_seen,
                budget_s=budget_s,
                fence=fence,
                weights_change=weights_change,
                wait_for_admission=request.wait_for_admission,
                participant_incarnation=request.participant_incarnation,
            )
            # Closing the stream when the call ends (also by cancellation, which gRPC
            # delivers as CancelledError here) is what cancels the execution.
            async with contextlib.aclosing(stream):
                # Sent the moment the participant owns the attempt, before the first
                # boundary: the trainer counts it dispatched from then on, and names this
                # incarnation when it re-attaches (docs/spec.md sections 6.1 and 6.5).
                await context.send_initial_metadata(
                    accepted_metadata(self._runtime.header().incarnation)
                )
                async for event in stream:
                    yield self._event(event)

    async def Acknowledge(
        self, request: rollout_service_pb2.AcknowledgeRequest, context: Context
    ) -> rollout_service_pb2.AcknowledgeResponse:
        async with _errors(context, "Acknowledge"):
            check_list_length("receipts", request.receipts, self._max_list)
            receipts = [receipt_from_proto(r) for r in request.receipts]
            fence = fence_from_proto(request.fence, True) if request.HasField("fence") else None
            result = await self._runtime.acknowledge(receipts, fence=fence)
            return rollout_service_pb2.AcknowledgeResponse(
                header=header_to_proto(self._runtime.header()),
                acknowledged=result.acknowledged,
                unknown=[receipt_to_proto(r) for r in result.unknown],
            )
        raise AssertionError("unreachable")


# A bound on one generation's length: one request must not be able to stream for long
# enough to make every snapshot wait on it (docs/spec.md section 10.5).
DEFAULT_MAX_NEW_TOKENS = 8192
# docs/spec.md section 2.4: a request id is at most 256 characters.
_MAX_REQUEST_ID = 256


def _request_id(value: str) -> str:
    """A data-plane request id, bounded (docs/spec.md section 2.8)."""
    if len(value) > _MAX_REQUEST_ID:
        raise bad_argument(
            f"request_id is longer than {_MAX_REQUEST_ID} characters",
            field="request_id",
            limit=str(_MAX_REQUEST_ID),
        )
    return value


class PolicyServicer(policy_service_pb2_grpc.PolicyServiceServicer):
    def __init__(
        self,
        runtime: ParticipantRuntime,
        *,
        max_prompt_tokens: int = 65_536,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    ) -> None:
        self._runtime = runtime
        self._max_prompt = max_prompt_tokens
        self._max_new_tokens = max_new_tokens

    def _check_generate(self, request: policy_service_pb2.GenerateRequest) -> None:
        check_list_length("prompt_token_ids", request.prompt_token_ids, self._max_prompt)
        if not 0 < request.max_new_tokens <= self._max_new_tokens:
            raise bad_argument(
                f"max_new_tokens must be in 1..{self._max_new_tokens}",
                field="max_new_tokens",
                limit=str(self._max_new_tokens),
            )
        if not math.isfinite(request.temperature) or request.temperature < 0:
            raise bad_argument("temperature must be a finite number >= 0", field="temperature")
        if any(token < 0 for token in request.prompt_token_ids):
            raise bad_argument("prompt_token_ids must be >= 0", field="prompt_token_ids")

    async def Generate(
        self, request: policy_service_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[policy_service_pb2.GenerateResponse]:
        async with _errors(context, "Generate"):
            episode = episode_from_proto(request.episode)
            self._check_generate(request)
            stream = self._runtime.generate(
                episode,
                GenerateRequest(
                    prompt_token_ids=tuple(request.prompt_token_ids),
                    max_new_tokens=request.max_new_tokens,
                    temperature=request.temperature,
                    seed=request.seed,
                    accept_cut=request.accept_cut,
                ),
            )
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    response = policy_service_pb2.GenerateResponse(
                        header=header_to_proto(self._runtime.header()),
                        token_ids=list(chunk.token_ids),
                        logprobs=list(chunk.logprobs),
                        done=chunk.done,
                        weights_version=chunk.weights_version,
                    )
                    if chunk.cut:
                        response.cut.prefix_length = chunk.prefix_length
                    yield response

    async def UpdateWeights(
        self, request: policy_service_pb2.UpdateWeightsRequest, context: Context
    ) -> policy_service_pb2.UpdateWeightsResponse:
        async with _errors(context, "UpdateWeights"):
            if len(request.request_id) > _MAX_REQUEST_ID:
                raise bad_argument(
                    f"request_id is longer than {_MAX_REQUEST_ID} characters",
                    field="request_id",
                    limit=str(_MAX_REQUEST_ID),
                )
            version = await self._runtime.update_weights(
                request.weights_version, request.state, request.request_id
            )
            return policy_service_pb2.UpdateWeightsResponse(
                header=header_to_proto(self._runtime.header()), weights_version=version
            )
        raise AssertionError("unreachable")


class ResourcesServicer(resources_service_pb2_grpc.ResourcesServiceServicer):
    def __init__(self, runtime: ParticipantRuntime) -> None:
        self._runtime = runtime

    def _header(self) -> Any:
        return header_to_proto(self._runtime.header())

    async def SeedSession(
        self, request: resources_service_pb2.SeedSessionRequest, context: Context
    ) -> resources_service_pb2.SeedSessionResponse:
        async with _errors(context, "SeedSession"):
            task = struct_to_dict(request.task, "task")
            task.setdefault("prompt_group_id", request.prompt_group_id)
            task.setdefault("sibling_index", request.sibling_index)
            task.setdefault("group_size", request.group_size)
            existed = await self._runtime.seed_session(episode_from_proto(request.episode), task)
            return resources_service_pb2.SeedSessionResponse(header=self._header(), existed=existed)
        raise AssertionError("unreachable")

    async def Call(
        self, request: resources_service_pb2.CallRequest, context: Context
    ) -> resources_service_pb2.CallResponse:
        async with _errors(context, "Call"):
            if not request.tool:
                raise bad_argument("tool is required")
            output = await self._runtime.call_tool(
                episode_from_proto(request.episode),
                request.tool,
                struct_to_dict(request.arguments, "arguments"),
                _request_id(request.request_id),
            )
            return resources_service_pb2.CallResponse(
                header=self._header(), output=struct_from_mapping(output)
            )
        raise AssertionError("unreachable")

    async def Verify(
        self, request: resources_service_pb2.VerifyRequest, context: Context
    ) -> resources_service_pb2.VerifyResponse:
        async with _errors(context, "Verify"):
            verdict = await self._runtime.verify(
                episode_from_proto(request.episode),
                struct_to_dict(request.answer, "answer"),
                _request_id(request.request_id),
            )
            return resources_service_pb2.VerifyResponse(
                header=self._header(),
                reward=verdict.reward,
                details=struct_from_mapping(verdict.details),
            )
        raise AssertionError("unreachable")

    async def CloseSession(
        self, request: resources_service_pb2.CloseSessionRequest, context: Context
    ) -> resources_service_pb2.CloseSessionResponse:
        async with _errors(context, "CloseSession"):
            closed = await self._runtime.close_session(episode_from_proto(request.episode))
            return resources_service_pb2.CloseSessionResponse(header=self._header(), closed=closed)
        raise AssertionError("unreachable")
