"""CheckpointControlService over a :class:`ParticipantRuntime`: one core, two doors.

Every control operation has one handler (``_handle_*``) that converts the request,
calls the runtime and converts the answer. The unary methods call it and turn a
:class:`TurnpointError` into a ``google.rpc.Status`` with one ``ErrorInfo``;
``ControlSession`` calls the very same handler for each message on the stream and sends
the error as a ``ControlError`` instead. So every behaviour is the same through either
door, and the tests run each behaviour through both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from turnpoint._status import abort, error_to_control_error
from turnpoint.convert import (
    add_episodes,
    artifact_from_proto,
    artifact_to_proto,
    artifacts_from_proto,
    bad_argument,
    check_list_length,
    enum_to_proto,
    episode_to_proto,
    episodes_from_proto,
    fence_from_proto,
    id_from_proto,
    readiness_to_proto,
    seconds_from_duration,
    timestamp_from_seconds,
)
from turnpoint.errors import TurnpointError
from turnpoint.ids import InvalidIdError, sorted_episodes
from turnpoint.participant_sdk import ParticipantRuntime
from turnpoint.participant_sdk.advanced import BoundaryEvent, ReadinessUpdate, hook_failure
from turnpoint.server._convert import header_to_proto
from turnpoint.server._worker_slot import GroupRoster
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

logger = logging.getLogger(__name__)

# How long an operation on the session may take when the request gives no timeout.
DEFAULT_SESSION_OP_TIMEOUT_S = 60.0
# Control requests a session runs at once; more wait their turn (bounded memory).
MAX_SESSION_INFLIGHT = 256

Handler = Callable[[Any, float | None], Awaitable[Any]]


def _timeout(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining)


def _phase(value: Any) -> Any:
    return enum_to_proto(types_pb2.Phase, value)


class ControlServicer(pb_grpc.CheckpointControlServiceServicer):
    """Thin adapter: request -> runtime call -> response, errors mapped in one place."""

    def __init__(
        self,
        runtime: ParticipantRuntime,
        *,
        max_list_length: int = 10_000,
        roster: GroupRoster | None = None,
    ) -> None:
        self._runtime = runtime
        # A worker of a group lists every worker in Describe (docs/spec.md section 3.9).
        self._roster = roster
        self._max_list = max_list_length
        self._handlers: dict[str, Handler] = {
            "describe": self._handle_describe,
            "prepare": self._handle_prepare,
            "renew": self._handle_renew,
            "commit": self._handle_commit,
            "resume": self._handle_resume,
            "restore": self._handle_restore,
            "restore_running": self._handle_restore_running,
            "retire": self._handle_retire,
            "forget": self._handle_forget,
            "get_status": self._handle_get_status,
        }
        self._sessions: set[asyncio.Task[Any]] = set()
        self._last_header = runtime.header()
        self._header_proto = header_to_proto(self._last_header)
        # Session operations a caller cancelled (or that a closing session cut short).
        self.cancelled_by_caller = 0

    def _header(self) -> types_pb2.ResponseHeader:
        # Built once per epoch, not per answer: a response copies it in.
        header = self._runtime.header()
        if header != self._last_header:
            self._last_header = header
            self._header_proto = header_to_proto(header)
        return self._header_proto

    # ------------------------------------------------------------------ handlers

    async def _handle_describe(
        self, request: pb.DescribeRequest, timeout_s: float | None
    ) -> pb.DescribeResponse:
        fence = fence_from_proto(request.fence, request.HasField("fence"))
        d = await self._runtime.describe(fence if request.HasField("fence") else None)
        response = pb.DescribeResponse(
            header=self._header(),
            kind=enum_to_proto(types_pb2.ParticipantKind, d.kind),
            instance_name=d.instance_name,
            protocol_version=d.protocol_version,
            recovery_mode=enum_to_proto(types_pb2.RecoveryMode, d.recovery_mode),
            verify_mode=enum_to_proto(types_pb2.VerifyMode, d.verify_mode),
            group_scored=d.group_scored,
            group_size=d.group_size,
            supported_levels=[
                enum_to_proto(types_pb2.RecoveryLevel, lv) for lv in d.supported_levels
            ],
            environment=d.environment,
            phase=_phase(d.phase),
            capabilities=[pb.CAPABILITY_RESTORE_RUNNING] if d.restore_running else [],
        )
        if self._roster is not None:
            response.worker_group = self._roster.group
            response.workers.extend(
                pb.WorkerAddress(instance_name=m.instance, address=m.address)
                for m in self._roster.members
            )
        return response

    async def _handle_prepare(
        self, request: pb.PrepareRequest, timeout_s: float | None
    ) -> pb.PrepareResponse:
        checkpoint_id = id_from_proto(request.checkpoint_id, "checkpoint_id")
        # A hint this participant ignores (docs/spec.md section 4.6): held to the list
        # limit like every list, its entries not parsed.
        check_list_length("expected_episodes", request.expected_episodes, self._max_list)
        result = await self._runtime.prepare(
            fence_from_proto(request.fence, request.HasField("fence")),
            _request_id(request.request_id),
            checkpoint_id,
            lease_s=seconds_from_duration(request.lease, "lease"),
            max_blockers=request.max_blockers,
            timeout_s=timeout_s,
            empty_commit_snapshot=(
                id_from_proto(request.empty_commit_snapshot, "empty_commit_snapshot")
                if request.empty_commit_snapshot
                else None
            ),
        )
        response = pb.PrepareResponse(
            header=self._header(),
            phase=_phase(result.phase),
            readiness=readiness_to_proto(result.readiness),
            checkpoint_id=result.checkpoint_id,
            committed_empty=result.committed_empty,
        )
        if result.lease_expires_at is not None:
            response.lease_expires_at.CopyFrom(timestamp_from_seconds(result.lease_expires_at))
        return response

    async def _handle_renew(
        self, request: pb.RenewRequest, timeout_s: float | None
    ) -> pb.RenewResponse:
        result = await self._runtime.renew(
            fence_from_proto(request.fence, request.HasField("fence")),
            _request_id(request.request_id),
            id_from_proto(request.checkpoint_id, "checkpoint_id"),
            lease_s=seconds_from_duration(request.lease, "lease"),
            timeout_s=timeout_s,
        )
        response = pb.RenewResponse(header=self._header(), phase=_phase(result.phase))
        if result.lease_expires_at is not None:
            response.lease_expires_at.CopyFrom(timestamp_from_seconds(result.lease_expires_at))
        return response

    async def _handle_commit(
        self, request: pb.CommitRequest, timeout_s: float | None
    ) -> pb.CommitResponse:
        result = await self._runtime.commit(
            fence_from_proto(request.fence, request.HasField("fence")),
            _request_id(request.request_id),
            id_from_proto(request.checkpoint_id, "checkpoint_id"),
            id_from_proto(request.snapshot, "snapshot"),
            episodes_from_proto(request.scope, "scope", self._max_list),
            timeout_s=timeout_s,
            accept_saved_nothing=request.accept_saved_nothing,
            release=request.release,
        )
        response = pb.CommitResponse(
            header=self._header(),
            checkpoint_id=result.checkpoint_id,
            artifacts=[artifact_to_proto(a) for a in result.artifacts],
            saved_nothing=result.manifest is None,
            released=result.released,
        )
        add_episodes(response.exported, sorted_episodes(result.exported))
        if result.manifest is not None:
            response.manifest.CopyFrom(artifact_to_proto(result.manifest))
        return response

    async def _handle_resume(
        self, request: pb.ResumeRequest, timeout_s: float | None
    ) -> pb.ResumeResponse:
        result = await self._runtime.resume(
            fence_from_proto(request.fence, request.HasField("fence")),
            _request_id(request.request_id),
            id_from_proto(request.checkpoint_id, "checkpoint_id"),
            timeout_s=timeout_s,
        )
        return pb.ResumeResponse(
            header=self._header(), phase=_phase(result.phase), ended_active=result.ended_active
        )

    def _restore_arguments(
        self, request: pb.RestoreRequest | pb.RestoreRunningRequest
    ) -> tuple[Any, ...]:
        """What Restore and RestoreRunning both carry, checked, in the runtime's order."""
        check_list_length("entry.artifacts", request.entry.artifacts, self._max_list)
        # docs/spec.md section 4.10: no manifest means this participant saved nothing.
        if not request.entry.HasField("manifest") and request.entry.artifacts:
            raise bad_argument("entry.manifest is required when entry.artifacts are named")
        return (
            fence_from_proto(request.fence, request.HasField("fence")),
            _request_id(request.request_id),
            id_from_proto(request.restore_id, "restore_id"),
            id_from_proto(request.snapshot, "snapshot"),
            artifact_from_proto(request.entry.manifest)
            if request.entry.HasField("manifest")
            else None,
            artifacts_from_proto(request.entry.artifacts),
            episodes_from_proto(request.scope, "scope", self._max_list),
        )

    async def _handle_restore(
        self, request: pb.RestoreRequest, timeout_s: float | None
    ) -> pb.RestoreResponse:
        result = await self._runtime.restore(
            *self._restore_arguments(request),
            lease_s=seconds_from_duration(request.lease, "lease"),
            timeout_s=timeout_s,
        )
        return pb.RestoreResponse(
            header=self._header(),
            restore_id=result.restore_id,
            installed=[episode_to_proto(e) for e in result.installed],
            phase=_phase(result.phase),
        )

    async def _handle_restore_running(
        self, request: pb.RestoreRunningRequest, timeout_s: float | None
    ) -> pb.RestoreRunningResponse:
        result = await self._runtime.restore_running(
            *self._restore_arguments(request),
            retire_unscoped=request.retire_unscoped,
            lease_s=seconds_from_duration(request.lease, "lease"),
            timeout_s=timeout_s,
        )
        return pb.RestoreRunningResponse(
            header=self._header(),
            restore_id=result.restore_id,
            installed=[episode_to_proto(e) for e in result.installed],
            phase=_phase(result.phase),
            retired=[episode_to_proto(e) for e in result.retired],
        )

    async def _handle_retire(
        self, request: pb.RetireRequest, timeout_s: float | None
    ) -> pb.RetireResponse:
        result = await self._runtime.retire(
            fence_from_proto(request.fence, request.HasField("fence")),
            _request_id(request.request_id),
            episodes_from_proto(request.episodes, "episodes", self._max_list),
            timeout_s=timeout_s,
        )
        return pb.RetireResponse(
            header=self._header(), stopped=[episode_to_proto(e) for e in result.stopped]
        )

    async def _handle_forget(
        self, request: pb.ForgetRequest, timeout_s: float | None
    ) -> pb.ForgetResponse:
        check_list_length("rollout_ids", request.rollout_ids, self._max_list)
        rollout_ids = [id_from_proto(r, "rollout_ids") for r in request.rollout_ids]
        result = await self._runtime.forget(
            fence_from_proto(request.fence, request.HasField("fence")),
            _request_id(request.request_id),
            rollout_ids,
            timeout_s=timeout_s,
        )
        return pb.ForgetResponse(header=self._header(), forgotten=result.forgotten)

    async def _handle_get_status(
        self, request: pb.GetStatusRequest, timeout_s: float | None
    ) -> pb.GetStatusResponse:
        status = await self._runtime.status(request.max_blockers)
        response = pb.GetStatusResponse(
            header=self._header(),
            phase=_phase(status.phase),
            active_checkpoint_id=status.active_checkpoint_id or "",
            readiness=readiness_to_proto(status.readiness),
            admission_open=status.admission_open,
            lease_expiries=status.lease_expiries,
            refused_rollouts=status.refused_rollouts,
            committed_checkpoint_id=status.committed_checkpoint_id or "",
        )
        if status.lease_expires_at is not None:
            response.lease_expires_at.CopyFrom(timestamp_from_seconds(status.lease_expires_at))
        return response

    # ------------------------------------------------------------------ the unary door

    async def _unary(
        self, operation: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        try:
            return await self._handlers[operation](request, _timeout(context))
        except TurnpointError as error:
            await abort(context, error)
        except InvalidIdError as error:
            await abort(context, bad_argument(error))
        except Exception as error:  # noqa: BLE001 - a hook's failure is data (see below)
            await abort(context, _hook_failed(operation, error))

    async def Describe(self, request: Any, context: Any) -> Any:
        return await self._unary("describe", request, context)

    async def Prepare(self, request: Any, context: Any) -> Any:
        return await self._unary("prepare", request, context)

    async def Renew(self, request: Any, context: Any) -> Any:
        return await self._unary("renew", request, context)

    async def Commit(self, request: Any, context: Any) -> Any:
        return await self._unary("commit", request, context)

    async def Resume(self, request: Any, context: Any) -> Any:
        return await self._unary("resume", request, context)

    async def Restore(self, request: Any, context: Any) -> Any:
        return await self._unary("restore", request, context)

    async def RestoreRunning(self, request: Any, context: Any) -> Any:
        return await self._unary("restore_running", request, context)

    async def Retire(self, request: Any, context: Any) -> Any:
        return await self._unary("retire", request, context)

    async def Forget(self, request: Any, context: Any) -> Any:
        return await self._unary("forget", request, context)

    async def GetStatus(self, request: Any, context: Any) -> Any:
        return await self._unary("get_status", request, context)

    # ------------------------------------------------------------------ the stream door

    async def ControlSession(
        self,
        request_iterator: AsyncIterator[pb.ControlSessionRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ControlSessionResponse]:
        """Serve each request on its own task; answers go out in completion order.

        A session that breaks cancels its running operations' waits only: the work
        itself (a write, an install) belongs to the runtime and keeps going, and the
        lease decides what happens to an open checkpoint.
        """
        answers: asyncio.Queue[pb.ControlSessionResponse | None] = asyncio.Queue()
        slots = asyncio.Semaphore(MAX_SESSION_INFLIGHT)
        running: set[asyncio.Task[None]] = set()
        by_request: dict[str, asyncio.Task[None]] = {}

        async def serve_one(message: pb.ControlSessionRequest) -> None:
            try:
                answers.put_nowait(await self._session_answer(message))
            except asyncio.CancelledError:
                # The caller abandoned it (a cancel message): no answer, as for a
                # cancelled unary call. A session that ends cancels too.
                self.cancelled_by_caller += 1
                raise
            finally:
                slots.release()
                if by_request.get(message.request_id) is asyncio.current_task():
                    del by_request[message.request_id]

        async def read() -> None:
            try:
                async for message in request_iterator:
                    if message.WhichOneof("operation") == "cancel":
                        abandoned = by_request.get(message.request_id)
                        if abandoned is not None:
                            abandoned.cancel()
                        continue
                    await slots.acquire()
                    task = asyncio.create_task(serve_one(message))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    by_request[message.request_id] = task
            finally:
                if running:
                    await asyncio.wait(set(running))
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
            await reader
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def _session_answer(self, message: pb.ControlSessionRequest) -> pb.ControlSessionResponse:
        operation = message.WhichOneof("operation")
        response = pb.ControlSessionResponse(request_id=message.request_id)
        try:
            if operation is None:
                raise bad_argument("a ControlSessionRequest must carry an operation")
            timeout_s = seconds_from_duration(
                message.timeout, "timeout", default=DEFAULT_SESSION_OP_TIMEOUT_S
            )
            inner = getattr(message, operation)
            if hasattr(inner, "request_id") and inner.request_id != message.request_id:
                raise bad_argument("request_id of the session message and its operation differ")
            answer = await self._handlers[operation](inner, timeout_s)
            getattr(response, operation).CopyFrom(answer)
        except TurnpointError as error:
            response.error.CopyFrom(error_to_control_error(error))
        except InvalidIdError as error:
            response.error.CopyFrom(error_to_control_error(bad_argument(error)))
        except Exception as error:  # noqa: BLE001 - a hook's failure is data (see below)
            response.error.CopyFrom(
                error_to_control_error(_hook_failed(operation or "unknown", error))
            )
        return response

    # ------------------------------------------------------------------ watch

    async def WatchBoundaries(
        self, request: pb.WatchBoundariesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchBoundariesResponse]:
        try:
            fence = fence_from_proto(request.fence, request.HasField("fence"))
            events = self._runtime.watch(
                request.max_blockers, fence if request.HasField("fence") else None
            )
        except TurnpointError as error:
            await abort(context, error)
        try:
            async for event in events:
                response = pb.WatchBoundariesResponse(
                    header=self._header(), phase=_phase(event.phase)
                )
                if isinstance(event, ReadinessUpdate):
                    response.readiness.CopyFrom(readiness_to_proto(event.readiness))
                elif isinstance(event, BoundaryEvent):
                    response.boundary.CopyFrom(
                        pb.BoundaryEvent(
                            episode=episode_to_proto(event.episode),
                            state=enum_to_proto(types_pb2.EpisodeState, event.state),
                            boundary_index=event.boundary_index,
                            turn_index=event.turn_index,
                            at=timestamp_from_seconds(event.at),
                        )
                    )
                yield response
        finally:
            await events.aclose()


def _hook_failed(operation: str, error: Exception) -> TurnpointError:
    """A failure below the protocol (a participant's hook raised), as a typed error.

    Neither door answers it UNKNOWN: the coordinator gets a reason it can act on
    (:mod:`turnpoint.participant_sdk._failures` has the table) and the exception's text
    stays here, in the log, never on the wire (docs/spec.md section 9.1).
    """
    mapped = hook_failure(error, operation)
    if mapped is not error:
        logger.warning(
            "%s failed in a participant hook (%s); the coordinator sees %s",
            operation,
            type(error).__name__,
            mapped.reason.name,
            exc_info=error,
        )
    return mapped


def _request_id(value: str) -> str:
    if not value:
        raise bad_argument("request_id is required on every mutating request")
    if len(value) > 256:
        raise bad_argument("request_id is longer than 256 characters")
    return value
