"""The kit's side of the wire: channels to the target, typed and raw calls, and what a
refused call carried.

The kit is a black-box client: it speaks only the generated ``turnpoint.v1`` messages,
gRPC health and reflection, and reads errors from the ``grpc-status-details-bin``
trailer (unary calls) or a ``ControlError`` (the session) without trusting either to be
well formed: a malformed error is itself something a check reports.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from turnpoint._keepalive import control_channel, data_channel
from turnpoint.auth import auth_metadata
from turnpoint.errors import DOMAIN
from turnpoint.v1 import (
    checkpoint_control_service_pb2,
    checkpoint_control_service_pb2_grpc,
    policy_service_pb2_grpc,
    resources_service_pb2_grpc,
    rollout_service_pb2_grpc,
    types_pb2,
)

from ._hostile import Shape

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Metadata = tuple[tuple[str, str], ...]

CONTROL_SERVICE = "turnpoint.v1.CheckpointControlService"
ROLLOUT_SERVICE = "turnpoint.v1.RolloutService"
RESOURCES_SERVICE = "turnpoint.v1.ResourcesService"
POLICY_SERVICE = "turnpoint.v1.PolicyService"
_DETAILS_KEY = "grpc-status-details-bin"
_REASON_PREFIX = "ERROR_REASON_"


@dataclass(frozen=True, slots=True)
class ErrorDetail:
    """One ``google.rpc.ErrorInfo`` (or what a ``ControlError`` holds instead)."""

    reason: str
    domain: str
    metadata: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class WireError:
    """How a call was refused: its gRPC code, message and every ErrorInfo it carried."""

    method: str
    code: grpc.StatusCode
    message: str
    infos: tuple[ErrorDetail, ...] = ()
    problem: str = ""  # why the status details could not be read, if they could not

    @property
    def reason(self) -> str | None:
        """The protocol reason, when exactly one ErrorInfo of domain turnpoint came."""
        if len(self.infos) == 1 and self.infos[0].domain == DOMAIN:
            return self.infos[0].reason
        return None

    @property
    def metadata(self) -> Mapping[str, str]:
        return self.infos[0].metadata if len(self.infos) == 1 else {}

    def summary(self) -> str:
        reason = self.reason or (self.problem or f"{len(self.infos)} ErrorInfo")
        return f"{self.method}: {self.code.name} ({reason})"


class Refused(Exception):
    """A call ended with a non-OK status; ``error`` says what it carried."""

    def __init__(self, error: WireError) -> None:
        super().__init__(error.summary())
        self.error = error


def _code_of(number: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    return grpc.StatusCode.UNKNOWN


def wire_error(method: str, error: grpc.aio.AioRpcError) -> WireError:
    """Read a failed call's status without trusting its details to be well formed."""
    code = error.code()
    message = error.details() or ""
    raw: bytes | None = None
    # grpc.aio hands (key, value) pairs; grpc-stubs types them as the sync API's objects.
    trailers: Any = error.trailing_metadata() or ()
    for key, value in trailers:
        if key == _DETAILS_KEY and isinstance(value, bytes):
            raw = value
    if raw is None:
        return WireError(method, code, message)
    try:
        status = status_pb2.Status.FromString(raw)
    except Exception:  # noqa: BLE001 - any parse failure of the peer's bytes is a finding
        return WireError(method, code, message, problem="unreadable status details")
    if status.code != code.value[0]:
        return WireError(method, code, message, problem=f"status details say code {status.code}")
    infos: list[ErrorDetail] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            infos.append(ErrorDetail(info.reason, info.domain, dict(info.metadata)))
    return WireError(method, code, message, tuple(infos))


def control_error(method: str, message: types_pb2.ControlError) -> WireError:
    """A ``ControlError`` from the session, in the shape of a unary refusal."""
    try:
        name = types_pb2.ErrorReason.Name(message.reason).removeprefix(_REASON_PREFIX)
    except ValueError:
        name = f"UNKNOWN_REASON_{message.reason}"
    infos: tuple[ErrorDetail, ...] = ()
    if message.reason != types_pb2.ERROR_REASON_UNSPECIFIED:
        infos = (ErrorDetail(name, DOMAIN, dict(message.metadata)),)
    return WireError(method, _code_of(message.code), message.message, infos)


class Target:
    """Channels and stubs to one participant, with the token on every call.

    Control calls ride their own connection (docs/spec.md section 3.5 item 2), data-plane
    calls another, exactly as a coordinator would open them.
    """

    def __init__(
        self,
        address: str,
        token: str | None,
        *,
        call_timeout_s: float,
        data_token: str | None = None,
    ) -> None:
        self.address = address
        self.token = token
        # The target's data-plane credential (docs/spec.md section 10.2), when it has one.
        self.data_token = data_token
        self.call_timeout_s = call_timeout_s
        self.metadata: Metadata = auth_metadata(token) if token else ()
        self._control = control_channel(address)
        self._data = data_channel(address)
        # Hostile input goes out unchecked: the target, not the kit's own client limits,
        # must be what refuses an oversized message.
        self._raw = grpc.aio.insecure_channel(
            address, options=(("grpc.max_send_message_length", -1),)
        )
        self.control = checkpoint_control_service_pb2_grpc.CheckpointControlServiceStub(
            self._control
        )
        self.rollout = rollout_service_pb2_grpc.RolloutServiceStub(self._data)
        self.resources = resources_service_pb2_grpc.ResourcesServiceStub(self._data)
        self.policy = policy_service_pb2_grpc.PolicyServiceStub(self._data)
        self.health = health_pb2_grpc.HealthStub(self._control)
        self.reflection = reflection_pb2_grpc.ServerReflectionStub(self._control)

    async def close(self) -> None:
        for channel in (self._control, self._data, self._raw):
            await channel.close(None)

    async def call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        *,
        name: str,
        timeout_s: float | None = None,
        metadata: Metadata | None = None,
    ) -> Resp:
        """A unary call with the token and a deadline; raise :class:`Refused` on failure."""
        try:
            return await method(
                request,
                timeout=self.call_timeout_s if timeout_s is None else timeout_s,
                metadata=self.metadata if metadata is None else metadata,
            )
        except grpc.aio.AioRpcError as error:
            raise Refused(wire_error(name, error)) from None

    async def raw(
        self,
        path: str,
        payload: bytes,
        *,
        shape: Shape,
        metadata: Metadata | None = None,
        timeout_s: float | None = None,
    ) -> list[bytes]:
        """Send bytes as they are to ``path`` (``shape``: unary, server_stream, bidi)."""
        channel = self._raw
        meta = self.metadata if metadata is None else metadata
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            if shape == "unary":
                unary = channel.unary_unary(path, None, None)
                return [await unary(payload, timeout=timeout, metadata=meta)]
            if shape == "server_stream":
                stream = channel.unary_stream(path, None, None)
                return [item async for item in stream(payload, timeout=timeout, metadata=meta)]
            answered = asyncio.Event()

            async def requests() -> AsyncIterator[bytes]:
                yield payload
                # Half-close only once the target answered or ended the stream: a write
                # racing a server that already ended the call ends it INTERNAL on the
                # client's side, whatever the server said.
                await answered.wait()

            bidi = channel.stream_stream(path, None, None)
            call = bidi(requests(), timeout=timeout, metadata=meta)
            answers: list[bytes] = []
            try:
                async for item in call:
                    answers.append(item)
                    answered.set()
            finally:
                answered.set()
            return answers
        except grpc.aio.AioRpcError as error:
            raise Refused(wire_error(path, error)) from None

    async def health_status(self, service: str, *, metadata: Metadata = ()) -> int:
        """``grpc.health.v1.Health/Check``: the status number; raise Refused on failure."""
        try:
            reply = await self.health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=self.call_timeout_s,
                metadata=metadata,
            )
        except grpc.aio.AioRpcError as error:
            raise Refused(wire_error("/grpc.health.v1.Health/Check", error)) from None
        return int(reply.status)

    async def list_services(self, *, metadata: Metadata = ()) -> list[str]:
        """Server reflection's service list; raise Refused on failure."""
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        try:
            call = self.reflection.ServerReflectionInfo(
                iter([request]), timeout=self.call_timeout_s, metadata=metadata
            )
            async for response in call:
                return [s.name for s in response.list_services_response.service]
        except grpc.aio.AioRpcError as error:
            raise Refused(
                wire_error("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", error)
            ) from None
        return []


class SessionClient:
    """One ``ControlSession`` stream: queue requests, match answers by request id.

    Requests go out through one async iterator, in the order they were sent, because a
    gRPC stream takes one write at a time.
    """

    def __init__(self, target: Target, metadata: Metadata | None = None) -> None:
        self.target = target
        self.metadata = target.metadata if metadata is None else metadata
        self._outbox: asyncio.Queue[checkpoint_control_service_pb2.ControlSessionRequest | None] = (
            asyncio.Queue()
        )
        self._pending: dict[
            str, asyncio.Future[checkpoint_control_service_pb2.ControlSessionResponse]
        ] = {}
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._ended: WireError | None = None

    async def _requests(
        self,
    ) -> AsyncIterator[checkpoint_control_service_pb2.ControlSessionRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def open(self) -> None:
        self._call = self.target.control.ControlSession(self._requests(), metadata=self.metadata)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for response in self._call:
                future = self._pending.pop(response.request_id, None)
                if future is not None and not future.done():
                    future.set_result(response)
        except grpc.aio.AioRpcError as error:
            self._ended = wire_error("ControlSession", error)
        finally:
            ended = self._ended or WireError(
                "ControlSession", grpc.StatusCode.OK, "the session ended without an answer"
            )
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(Refused(ended))
            self._pending.clear()

    def send(
        self, message: checkpoint_control_service_pb2.ControlSessionRequest
    ) -> asyncio.Future[checkpoint_control_service_pb2.ControlSessionResponse]:
        """Queue one request; the future resolves with its answer (or raises Refused)."""
        future: asyncio.Future[checkpoint_control_service_pb2.ControlSessionResponse] = (
            asyncio.get_running_loop().create_future()
        )
        if self._reader is None or self._reader.done():
            ended = self._ended or WireError("ControlSession", grpc.StatusCode.OK, "not open")
            future.set_exception(Refused(ended))
            return future
        self._pending[message.request_id] = future
        self._outbox.put_nowait(message)
        return future

    async def ask(
        self, message: checkpoint_control_service_pb2.ControlSessionRequest
    ) -> checkpoint_control_service_pb2.ControlSessionResponse:
        return await asyncio.wait_for(self.send(message), self.target.call_timeout_s)

    async def ended_within(self, timeout_s: float) -> bool:
        """Whether the target ends the stream by itself (a refused session) in time."""
        if self._reader is None:
            return False
        done, _ = await asyncio.wait({self._reader}, timeout=timeout_s)
        return bool(done)

    @property
    def final_error(self) -> WireError | None:
        return self._ended

    async def end(self) -> WireError | None:
        """Half-close and wait for the stream to finish; its final error, if any."""
        self._outbox.put_nowait(None)
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), self.target.call_timeout_s)
            except TimeoutError:
                return WireError("ControlSession", grpc.StatusCode.DEADLINE_EXCEEDED, "no end")
        return self._ended

    async def close(self) -> None:
        # End the request iterator first: cancelling the call while grpc still awaits
        # the next request leaves its consumer task pending.
        self._outbox.put_nowait(None)
        if self._reader is not None and not self._reader.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
