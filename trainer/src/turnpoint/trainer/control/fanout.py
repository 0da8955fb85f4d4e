"""One control operation sent to many participants at once, under one deadline.

docs/spec.md section 7: the coordinator prepares (and commits, resumes...) every
participant concurrently under one deadline, and never waits past it: a participant
whose event loop is stuck, or whose reply is lost, would otherwise hold the whole
snapshot. Calls still running at the deadline are cancelled (which cancels the RPC, so
the participant sees it) and count as DEADLINE_EXCEEDED failures of that participant.
Giving up is safe because every participant's lease reopens it on its own.

The caller decides each participant's request, and so its ``request_id``, once: a
retry (:func:`retry_same_request`) re-sends the very same message, so that the
participant replays or joins instead of starting the operation again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar, overload

import grpc

from turnpoint.errors import Reason
from turnpoint.trainer.control.client import ControlRequest, ControlResponse
from turnpoint.trainer.control.failures import Failure, FailureKind, classify
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.v1 import checkpoint_control_service_pb2 as pb

R = TypeVar("R")


class ControlCaller(Protocol):
    """What a fan-out needs of a participant client (``ParticipantControlClient``)."""

    async def call(self, request: ControlRequest, timeout_s: float) -> ControlResponse: ...


@dataclass(frozen=True, slots=True)
class FanoutResult(Generic[R]):
    """Each participant's response or failure.

    ``durations_s`` holds, for every call that was sent, the seconds from sending it to
    its reply, failure or cancellation; a call that never got a concurrency slot before
    the deadline has a failure but no duration.
    """

    responses: Mapping[str, R]
    failures: Mapping[str, Failure]
    durations_s: Mapping[str, float]

    @property
    def ok(self) -> bool:
        return not self.failures


class FanoutError(CoordinatorError):
    """One operation failed on one or more participants.

    Its reason summarises theirs (:func:`summary_reason`): NOT_READY when every failure
    is a not-ready prepare, the failures' shared transient reason (or UNAVAILABLE) when
    every one may pass on a retry, else the first invariant failure's reason (or
    PROTOCOL_VIOLATION).
    """

    def __init__(self, operation: str, failures: Mapping[str, Failure]) -> None:
        self.operation = operation
        self.failures: dict[str, Failure] = dict(failures)
        listed = "; ".join(
            f"{name}: {_describe(failure)}" for name, failure in sorted(self.failures.items())
        )
        super().__init__(
            summary_reason(self.failures.values()),
            f"{operation} failed on {len(self.failures)} participant(s): {listed}",
            {"operation": operation, "participants": ",".join(sorted(self.failures))},
        )

    @property
    def transient(self) -> bool:
        """True only when every failure may go away if the operation is tried again.

        docs/spec.md section 7.5: retryable when not ready, or when every failing participant failed
        with an infrastructure error; anything else is an invariant break.
        """
        return bool(self.failures) and all(f.retryable for f in self.failures.values())

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.operation, self.failures))


def summary_reason(failures: Iterable[Failure]) -> Reason:
    """One reason for several participants' failures (see :class:`FanoutError`)."""
    items = list(failures)
    if items and all(f.kind is FailureKind.NOT_READY for f in items):
        return Reason.NOT_READY
    invariant = [f for f in items if not f.retryable]
    if invariant:
        return next((f.reason for f in invariant if f.reason is not None), None) or (
            Reason.PROTOCOL_VIOLATION
        )
    reasons = {f.reason for f in items if f.kind is not FailureKind.NOT_READY}
    if len(reasons) == 1 and (only := reasons.pop()) is not None:
        return only
    if items and all(f.code is grpc.StatusCode.DEADLINE_EXCEEDED for f in items):
        return Reason.DEADLINE_EXCEEDED
    return Reason.UNAVAILABLE


def _describe(failure: Failure) -> str:
    why = failure.reason.name if failure.reason is not None else None
    code = failure.code.name if failure.code is not None else None
    labels = ", ".join(label for label in (failure.kind.value, why, code) if label)
    return f"[{labels}] {failure.detail}"


def raise_if_failed(result: FanoutResult[Any], operation: str) -> None:
    """Raise :class:`FanoutError` naming every participant that failed, if any did."""
    if result.failures:
        raise FanoutError(operation, result.failures)


def _deadline_failure(deadline_s: float, started: bool) -> Failure:
    detail = (
        f"no reply within the fan-out deadline of {deadline_s:g}s; call cancelled"
        if started
        else f"not sent before the fan-out deadline of {deadline_s:g}s (concurrency limit)"
    )
    return Failure(FailureKind.TRANSIENT, None, grpc.StatusCode.DEADLINE_EXCEEDED, detail)


async def _fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], ControlRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[ControlResponse]:
    if deadline_s <= 0 or per_call_timeout_s <= 0:
        raise ValueError(
            f"deadline_s and per_call_timeout_s must be > 0, got {deadline_s}, {per_call_timeout_s}"
        )
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    # Decided before anything is sent, so that a request is the same on every retry.
    requests = {name: make_request(name) for name in clients}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    slots = asyncio.Semaphore(concurrency)
    responses: dict[str, ControlResponse] = {}
    failures: dict[str, Failure] = {}
    sent_at: dict[str, float] = {}
    durations: dict[str, float] = {}

    async def one(name: str) -> None:
        async with slots:
            start = loop.time()
            sent_at[name] = start
            try:
                # The participant is told the tighter of its own timeout and what the
                # fan-out has left, so that it answers (not ready, say) before we give up.
                timeout_s = min(per_call_timeout_s, deadline - start)
                if timeout_s <= 0:
                    raise TimeoutError("fan-out deadline passed before the call was sent")
                responses[name] = await clients[name].call(requests[name], timeout_s)
            # Every way one participant's call can fail becomes that participant's
            # Failure; classify() turns anything unexpected into an invariant break.
            except Exception as error:  # noqa: BLE001
                failures[name] = classify(error)
            finally:
                durations[name] = loop.time() - start

    if len(clients) == 1:
        # A fan-out of one needs no task of its own (nor a wait for it): its call runs in
        # the caller's task, under the same deadline, whose expiry cancels it the same way.
        (only,) = clients
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await one(only)
    else:
        tasks = [asyncio.create_task(one(name), name=f"fan-out-{name}") for name in clients]
        try:
            if tasks:
                await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
        finally:
            # Cancelling cancels each abandoned RPC, so the participant sees it; waiting
            # for the tasks leaves no call running after fan_out returns.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    for name in clients:
        if name not in responses and name not in failures:
            failures[name] = _deadline_failure(deadline_s, started=name in sent_at)
    return FanoutResult(
        responses=MappingProxyType(responses),
        failures=MappingProxyType(failures),
        durations_s=MappingProxyType(durations),
    )


@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.DescribeRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.DescribeResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.PrepareRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.PrepareResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.RenewRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.RenewResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.CommitRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.CommitResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.ResumeRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.ResumeResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.RestoreRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.RestoreResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.RetireRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.RetireResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.ForgetRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.ForgetResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], pb.GetStatusRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[pb.GetStatusResponse]: ...
@overload
async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], ControlRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[ControlResponse]: ...


async def fan_out(
    clients: Mapping[str, ControlCaller],
    make_request: Callable[[str], ControlRequest],
    *,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
) -> FanoutResult[Any]:
    """Send ``make_request(name)`` to every client concurrently; never past ``deadline_s``.

    At most ``concurrency`` calls are in flight at once; each is given
    ``min(per_call_timeout_s, time left)``. Nothing raises for a participant's failure:
    the result holds a :class:`Failure` for it (see :func:`raise_if_failed`).
    """
    return await _fan_out(
        clients,
        make_request,
        deadline_s=deadline_s,
        per_call_timeout_s=per_call_timeout_s,
        concurrency=concurrency,
    )


@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.DescribeRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.DescribeResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.PrepareRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.PrepareResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.RenewRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.RenewResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.CommitRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.CommitResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.ResumeRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.ResumeResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.RestoreRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.RestoreResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.RetireRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.RetireResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.ForgetRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.ForgetResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, pb.GetStatusRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[pb.GetStatusResponse]: ...
@overload
async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, ControlRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[ControlResponse]: ...


async def retry_same_request(
    clients: Mapping[str, ControlCaller],
    requests: Mapping[str, ControlRequest],
    *,
    attempts: int,
    deadline_s: float,
    per_call_timeout_s: float,
    concurrency: int,
    pause_s: float = 0.0,
) -> FanoutResult[Any]:
    """Fan the same requests out up to ``attempts`` times, re-sending only to the
    participants whose last failure was transient.

    ``requests`` holds each participant's request, ``request_id`` included, decided once
    by the caller: every attempt sends that very message, so a participant that acted
    on a request whose reply was lost replays its answer instead of acting twice. Each
    attempt has its own ``deadline_s``. Retrying stops early once any participant
    failed in a way a retry cannot fix (its failure is then final for everyone).
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    missing = set(clients) - set(requests)
    if missing:
        raise ValueError(f"no request for participant(s) {sorted(missing)}")
    responses: dict[str, ControlResponse] = {}
    failures: dict[str, Failure] = {}
    durations: dict[str, float] = {}
    targets: dict[str, ControlCaller] = dict(clients)
    for attempt in range(attempts):
        if attempt and pause_s > 0:
            await asyncio.sleep(pause_s)
        result = await _fan_out(
            targets,
            requests.__getitem__,
            deadline_s=deadline_s,
            per_call_timeout_s=per_call_timeout_s,
            concurrency=concurrency,
        )
        responses.update(result.responses)
        durations.update(result.durations_s)
        for name in result.responses:
            failures.pop(name, None)
        failures.update(result.failures)
        if not result.failures or not all(f.retryable for f in result.failures.values()):
            break
        targets = {name: clients[name] for name in result.failures}
    return FanoutResult(
        responses=MappingProxyType(responses),
        failures=MappingProxyType(failures),
        durations_s=MappingProxyType(durations),
    )
