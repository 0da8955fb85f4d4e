"""The Run-stream reader: what one ``RolloutService.Run`` call says, as plain events.

docs/spec.md sections 6.1-6.3 and 6.10. The wire side of the rollout client, with no
bookkeeping: :func:`read_run` turns one call into :class:`Accepted`,
:class:`BoundarySeen` and :class:`ResultReceived` events (the driver hands each to the
ledger), :func:`classify` turns a failed call into a :class:`CallEnd` verdict, and
:func:`run_request` / :func:`receipt_to_proto` build what goes out.

A message that breaks the contract (an episode other than the one asked for, a final
outcome without a receipt, a message with neither boundary nor result) raises
:class:`MalformedRunError`; a stream that ends without a result, or a participant that
gives no verdict in time, raises :class:`RunBrokenError`. The driver treats both as a
broken call and re-attaches (section 6.10 item 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeAlias

import grpc

from turnpoint._status import error_from_rpc
from turnpoint.auth import ACCEPTED_METADATA, INCARNATION_METADATA_KEY
from turnpoint.convert import (
    duration_from_seconds,
    episode_from_proto,
    episode_to_proto,
    seconds_from_duration,
    struct_from_mapping,
    struct_to_dict,
    weights_change_to_proto,
)
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.rollouts.attempts import Attempt, FinalResult, GateGeneration, Receipt
from turnpoint.trainer.rollouts.values import RolloutOutcome
from turnpoint.v1 import rollout_service_pb2 as pb
from turnpoint.v1 import types_pb2

if TYPE_CHECKING:
    RunCall: TypeAlias = grpc.aio.UnaryStreamCall[pb.RunRequest, pb.RunResponse]


# Initial metadata an agent participant sends right after it accepted a Run; until it
# arrives the attempt is not the participant's (docs/spec.md section 6.1 item 2).
# One source of truth: the servicer's own constant.
((ACCEPTED_METADATA_KEY, _ACCEPTED_VALUE),) = ACCEPTED_METADATA

# ErrorInfo metadata of a STALE_ATTEMPT refusal of a re-attach that named another
# incarnation than the participant's (section 6.5 item 5).
REQUEST_INCARNATION_KEY: Final = "request_incarnation"

_RESULT_OUTCOMES: Final = {
    pb.RUN_OUTCOME_COMPLETED: RolloutOutcome.COMPLETED,
    pb.RUN_OUTCOME_FAILED: RolloutOutcome.FAILED,
    pb.RUN_OUTCOME_BUDGET_EXHAUSTED: RolloutOutcome.BUDGET_EXHAUSTED,
}
# Failures of a Run below the protocol that a retry would only repeat (6.10 item 4).
_FATAL_CODES: Final = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class MalformedRunError(CoordinatorError):
    """A Run message that breaks the contract; the call is treated as broken."""

    def __init__(self, message: str) -> None:
        super().__init__(Reason.PROTOCOL_VIOLATION, message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message,))


class RunBrokenError(CoordinatorError):
    """The call gave no verdict in time, or ended without a result."""

    def __init__(self, message: str) -> None:
        super().__init__(Reason.UNAVAILABLE, message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message,))


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Accepted:
    """The participant sent ``turnpoint-accepted: 1``: it owns the attempt.
    ``incarnation`` is the one that accepted (``turnpoint-incarnation``, else the first
    message's header; "" when it said neither), for the re-attach to name."""

    incarnation: str = ""


@dataclass(frozen=True, slots=True)
class BoundarySeen:
    boundary_index: int


@dataclass(frozen=True, slots=True)
class ResultReceived:
    """The final message. ``final`` is None for a ``RUN_OUTCOME_CANCELLED`` result: the
    participant stopped the execution and owes nothing (section 6.3 item 2)."""

    final: FinalResult | None


RunEvent = Accepted | BoundarySeen | ResultReceived


async def read_run(
    call: RunCall, episode: EpisodeId, accept_timeout_s: float
) -> AsyncIterator[RunEvent]:
    """The events of one Run call of ``episode``, in order; :class:`Accepted` comes
    before anything else the participant says.

    A refusal raises (``grpc.aio.AioRpcError``) before anything else is read. After the
    result it lets the call end on its own status (bounded by ``accept_timeout_s``)
    rather than cancel a finished run, so the caller should read to the end.
    """
    try:
        async with asyncio.timeout(accept_timeout_s):
            metadata = await call.initial_metadata()
    except TimeoutError:
        raise RunBrokenError("no verdict within the accept timeout") from None
    accepted = metadata.get(ACCEPTED_METADATA_KEY) == _ACCEPTED_VALUE
    if accepted:
        incarnation = metadata.get(INCARNATION_METADATA_KEY)
        yield Accepted(incarnation if isinstance(incarnation, str) else "")
    async for message in call:
        if not accepted:
            # A participant that sends no acceptance header has accepted once it talks
            # (section 6.1 item 2), even if what it says is malformed.
            accepted = True
            yield Accepted(message.header.incarnation)
        event = message.WhichOneof("event")
        if event == "boundary":
            yield BoundarySeen(_read_boundary(episode, message.boundary))
        elif event == "result":
            yield ResultReceived(_read_result(episode, message.result))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(accept_timeout_s):
                    await call.code()
            return
        else:
            raise MalformedRunError("a Run message with neither boundary nor result")
    raise RunBrokenError("the stream ended without a result")


def _check_episode(episode: EpisodeId, message: types_pb2.EpisodeId, what: str) -> None:
    named = episode_from_proto(message, what)
    if named != episode:
        raise MalformedRunError(f"{what} names {named}, not {episode}")


def _read_boundary(episode: EpisodeId, report: pb.BoundaryReport) -> int:
    _check_episode(episode, report.episode, "boundary.episode")
    return report.boundary_index


def _read_result(episode: EpisodeId, result: pb.RunResult) -> FinalResult | None:
    _check_episode(episode, result.episode, "result.episode")
    if result.outcome == pb.RUN_OUTCOME_CANCELLED:
        return None
    outcome = _RESULT_OUTCOMES.get(result.outcome)
    if outcome is None:
        raise MalformedRunError(f"result outcome {result.outcome} is not a final outcome")
    if not result.HasField("receipt") or not result.receipt.receipt_id:
        raise MalformedRunError(f"a {outcome.value} result without a receipt")
    _check_episode(episode, result.receipt.episode, "result.receipt.episode")
    active = seconds_from_duration(result.active_time, "active_time", default=0.0) or 0.0
    return FinalResult(
        outcome=outcome,
        receipt_id=result.receipt.receipt_id,
        output=struct_to_dict(result.result),
        turns=result.turns,
        active_time_s=active,
        error_message=result.error_message,
    )


# --------------------------------------------------------------------------- verdicts


class Verdict(enum.Enum):
    ENDED = "ended"  # the attempt ended (result recorded, abandoned or given up)
    REFUSED = "refused"  # ADMISSION_CLOSED
    BROKEN = "broken"  # transport failure, stream end without result, malformed message
    STALE = "stale"  # STALE_ATTEMPT: the attempt was retired
    # STALE_ATTEMPT naming another incarnation: the execution died with its process
    LOST = "lost"
    FATAL = "fatal"  # a protocol error that a retry would only repeat


@dataclass(frozen=True, slots=True)
class CallEnd:
    verdict: Verdict
    detail: str = ""
    sent_generation: GateGeneration = (0, 0)


def classify(error: grpc.aio.AioRpcError, generation: GateGeneration) -> CallEnd:
    """The verdict on a failed Run call (docs/spec.md section 6.10 items 2-4)."""
    protocol = error_from_rpc(error)
    if protocol is not None:
        detail = f"{protocol.reason.name}: {protocol.message}"
        if protocol.reason is Reason.ADMISSION_CLOSED:
            return CallEnd(Verdict.REFUSED, detail, generation)
        if protocol.reason is Reason.STALE_ATTEMPT:
            if protocol.metadata.get(REQUEST_INCARNATION_KEY):
                return CallEnd(Verdict.LOST, detail, generation)
            return CallEnd(Verdict.STALE, detail, generation)
        if protocol.transient:
            return CallEnd(Verdict.BROKEN, detail, generation)
        return CallEnd(Verdict.FATAL, detail, generation)
    detail = f"{error.code().name}: {error.details()}"
    if error.code() in _FATAL_CODES:
        return CallEnd(Verdict.FATAL, detail, generation)
    return CallEnd(Verdict.BROKEN, detail, generation)


# --------------------------------------------------------------------------- requests


def run_request(
    attempt: Attempt,
    fence: types_pb2.Fence | None = None,
    weights_change: str | None = None,
) -> pb.RunRequest:
    """The Run of ``attempt``: the same request id, episode and ``boundaries_seen`` on
    every re-attach, which also names the incarnation that accepted it (section 6.5),
    the coordinator's fence (section 6.9) and what the
    agent does with a generation that spans a weight update (section 5.5 item 7)."""
    spec = attempt.spec
    request = pb.RunRequest(
        request_id=attempt.request_id,
        episode=episode_to_proto(attempt.episode),
        task=struct_from_mapping(spec.task),
        prompt_group_id=spec.prompt_group_id,
        sibling_index=spec.sibling_index,
        group_size=spec.group_size,
        boundaries_seen=attempt.boundaries_seen,
        weights_change=weights_change_to_proto(weights_change),
        # Dispatch reopens once a cut's books are read, before the agents release the
        # checkpoint: a new attempt waits there rather than bounce (section 5.2 item 1).
        wait_for_admission=True,
        # Set once a participant accepted the attempt: only that execution may answer a
        # re-attach; a process restarted at the same address refuses (section 6.5 item 5).
        participant_incarnation=attempt.incarnation,
    )
    if attempt.budget_s is not None and math.isfinite(attempt.budget_s):
        request.budget.CopyFrom(duration_from_seconds(attempt.budget_s))
    if fence is not None:
        request.fence.CopyFrom(fence)
    return request


def receipt_to_proto(receipt: Receipt) -> types_pb2.CompletionReceipt:
    return types_pb2.CompletionReceipt(
        episode=episode_to_proto(receipt.episode), receipt_id=receipt.receipt_id
    )
