"""The coordinator's client for one participant's ``CheckpointControlService``.

docs/spec.md section 3: the control path rides on one long-lived ``ControlSession``
bidirectional stream per participant, which costs about half of the same fan-out made
of unary calls. :class:`ParticipantControlClient` keeps that stream open, correlates
replies by ``request_id`` (they may arrive in any order) and gives each call its own
timeout. It falls back to the unary RPCs for good when a participant does not serve
``ControlSession`` (tools, other languages, older builds).

What the client does *not* do is retry: a broken session fails every call still waiting
on it with a transient :class:`SessionBrokenError`, the next call opens a new session,
and the caller decides whether to send the same request (same ``request_id``) again.
The participant then replays its recorded answer or joins the work still running, so a
reply lost with the stream is never mistaken for a new operation.

:func:`classify` is the one place that turns any failure of a control call into a
:class:`Failure` (transient, not ready, or a broken invariant), from the error's reason
and gRPC code, never from its text (docs/spec.md sections 7 and 9).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Final, Self, TypeAlias, cast, overload

import grpc
from google.protobuf import duration_pb2

from turnpoint._keepalive import control_channel
from turnpoint._status import control_error_to_error, error_from_rpc
from turnpoint.auth import auth_metadata
from turnpoint.errors import TurnpointError
from turnpoint.trainer.control.failures import (
    CallTimeoutError,
    MalformedReplyError,
    SessionBrokenError,
    TransportError,
)
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

if TYPE_CHECKING:
    from turnpoint.v1.checkpoint_control_service_pb2_grpc import (
        CheckpointControlServiceAsyncStub,
    )


_LOG = logging.getLogger(__name__)

ControlRequest: TypeAlias = (
    pb.DescribeRequest
    | pb.PrepareRequest
    | pb.RenewRequest
    | pb.CommitRequest
    | pb.ResumeRequest
    | pb.RestoreRequest
    | pb.RestoreRunningRequest
    | pb.RetireRequest
    | pb.ForgetRequest
    | pb.GetStatusRequest
)
ControlResponse: TypeAlias = (
    pb.DescribeResponse
    | pb.PrepareResponse
    | pb.RenewResponse
    | pb.CommitResponse
    | pb.ResumeResponse
    | pb.RestoreResponse
    | pb.RestoreRunningResponse
    | pb.RetireResponse
    | pb.ForgetResponse
    | pb.GetStatusResponse
)

# docs/spec.md section 7: a call is abandoned min(timeout, 5 s) after its timeout.
_MAX_REPLY_GRACE_S: Final = 5.0


def new_request_id() -> str:
    """A fresh idempotency key; decide it once per operation and reuse it on retries."""
    return uuid.uuid4().hex


def request_id_source() -> Callable[[], str]:
    """Fresh idempotency keys for one client: a random prefix and a counter (a uuid4 per
    request cost 2% of the coordinator's CPU); unique across incarnations by the prefix."""
    prefix = uuid.uuid4().hex[:16]
    numbers = itertools.count()
    return lambda: f"{prefix}-{next(numbers)}"


@dataclass(frozen=True, slots=True)
class _Operation:
    # The oneof field name, the same on ControlSessionRequest and ControlSessionResponse.
    field: str
    # The unary method on the stub, also the operation's name in errors.
    method: str
    response_type: type[ControlResponse]
    # Mutating requests carry a request_id the caller chose; the read-only ones do not.
    mutating: bool


_OPERATIONS: Mapping[type[ControlRequest], _Operation] = MappingProxyType(
    {
        pb.DescribeRequest: _Operation("describe", "Describe", pb.DescribeResponse, False),
        pb.PrepareRequest: _Operation("prepare", "Prepare", pb.PrepareResponse, True),
        pb.RenewRequest: _Operation("renew", "Renew", pb.RenewResponse, True),
        pb.CommitRequest: _Operation("commit", "Commit", pb.CommitResponse, True),
        pb.ResumeRequest: _Operation("resume", "Resume", pb.ResumeResponse, True),
        pb.RestoreRequest: _Operation("restore", "Restore", pb.RestoreResponse, True),
        pb.RestoreRunningRequest: _Operation(
            "restore_running", "RestoreRunning", pb.RestoreRunningResponse, True
        ),
        pb.RetireRequest: _Operation("retire", "Retire", pb.RetireResponse, True),
        pb.ForgetRequest: _Operation("forget", "Forget", pb.ForgetResponse, True),
        pb.GetStatusRequest: _Operation("get_status", "GetStatus", pb.GetStatusResponse, False),
    }
)


def _operation_of(request: ControlRequest) -> _Operation:
    try:
        return _OPERATIONS[type(request)]
    except KeyError:
        raise TypeError(f"not a control request: {type(request).__name__}") from None


class _SessionUnsupported(Exception):
    """The session ended before it answered anything; send the request unary instead.

    ``permanent``: the participant said UNIMPLEMENTED, so it never serves sessions.
    Otherwise the session ended INTERNAL before any answer, which is how grpc.aio can
    report an UNIMPLEMENTED that raced the session's first write; one unary try settles
    it without giving sessions up (re-sending is safe: requests carry their ids).
    """

    def __init__(self, detail: str, *, permanent: bool) -> None:
        super().__init__(detail)
        self.permanent = permanent


# ------------------------------------------------------------------------- session


class _Session:
    """One open ControlSession stream: a writer task, a reader task, pending futures.

    Writes go through one task so that a caller cancelled mid-write never cancels the
    stream itself (grpc.aio cancels the whole RPC when a write is cancelled).
    """

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall[pb.ControlSessionRequest, pb.ControlSessionResponse],
        participant: str,
    ) -> None:
        self._call = call
        self._participant = participant
        self._pending: dict[str, asyncio.Future[pb.ControlSessionResponse]] = {}
        # A None future: a message nobody awaits a reply to (a cancel).
        self._outbox: asyncio.Queue[
            tuple[pb.ControlSessionRequest, asyncio.Future[pb.ControlSessionResponse] | None]
        ] = asyncio.Queue()
        # Once the participant answered anything it serves sessions: an UNIMPLEMENTED
        # after that is a broken stream, not a reason to give up on sessions.
        self.answered = False
        self.broken = False
        # When the last message went out (loop clock): the coordinator reads it to tell
        # a fan-out still sending from participants that are slow to answer.
        self.last_written_at: float | None = None
        self._reader = asyncio.create_task(self._read_loop(), name=f"control-read-{participant}")
        self._writer = asyncio.create_task(self._write_loop(), name=f"control-write-{participant}")

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(
        self, envelope: pb.ControlSessionRequest
    ) -> asyncio.Future[pb.ControlSessionResponse]:
        if envelope.request_id in self._pending:
            raise ValueError(
                f"request_id {envelope.request_id!r} is already in flight to {self._participant}"
            )
        future: asyncio.Future[pb.ControlSessionResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[envelope.request_id] = future
        self._outbox.put_nowait((envelope, future))
        return future

    def forget(self, request_id: str, future: asyncio.Future[pb.ControlSessionResponse]) -> None:
        """Stop waiting for one reply; a late reply for it is then dropped.

        A call abandoned before its reply (its deadline and grace passed, or its caller
        was cancelled) is cancelled on the participant too, with a cancel message on the
        session, as gRPC would cancel an abandoned unary call (docs/spec.md section 3.2).
        """
        # Still pending means no reply came (the reader pops a future as it answers it).
        abandoned = self._pending.get(request_id) is future
        if abandoned:
            del self._pending[request_id]
        future.cancel()
        if abandoned and not self.broken:
            cancel = pb.ControlSessionRequest(
                request_id=request_id, cancel=pb.ControlSessionCancel()
            )
            self._outbox.put_nowait((cancel, None))

    async def _read_loop(self) -> None:
        try:
            while True:
                message = await self._call.read()
                if not isinstance(message, pb.ControlSessionResponse):
                    # End of stream: the participant closed the session.
                    code = await self._call.code()
                    details = await self._call.details()
                    self._break(code, details or "participant ended the control session")
                    return
                self.answered = True
                future = self._pending.pop(message.request_id, None)
                if future is None:
                    _LOG.debug(
                        "dropping a reply nobody waits for (%s on %s)",
                        message.request_id,
                        self._participant,
                    )
                elif not future.done():
                    future.set_result(message)
        except grpc.aio.AioRpcError as error:
            self._break_on(error)
        finally:
            self._break(None, "control session closed")

    async def _write_loop(self) -> None:
        while True:
            envelope, future = await self._outbox.get()
            if future is not None and future.done():
                # Its caller gave up before it was sent: nobody would read the reply.
                continue
            try:
                await self._call.write(envelope)
                self.last_written_at = asyncio.get_running_loop().time()
            except grpc.aio.AioRpcError as error:
                self._break_on(error)
                return
            except asyncio.InvalidStateError:
                # The stream already ended; its status says why.
                self._break(await self._call.code(), await self._call.details())
                return

    def _break_on(self, error: grpc.aio.AioRpcError) -> None:
        self._break(
            error.code(), error.details() or "control session failed", error_from_rpc(error)
        )

    def _break(
        self,
        code: grpc.StatusCode | None,
        detail: str,
        carried: TurnpointError | None = None,
    ) -> None:
        """Fail every pending call and end the stream; the first cause wins."""
        if self.broken:
            return
        self.broken = True
        unsupported = not self.answered and code in (
            grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.INTERNAL,
        )
        pending = list(self._pending.values())
        self._pending.clear()
        for future in pending:
            if future.done():
                continue
            error: Exception
            if unsupported:
                error = _SessionUnsupported(detail, permanent=code is grpc.StatusCode.UNIMPLEMENTED)
            elif carried is not None:
                # The participant refused the session itself (a bad token, say): that
                # is its verdict on every call, not a broken connection.
                error = TurnpointError(carried.reason, carried.message, carried.metadata)
            else:
                error = SessionBrokenError(self._participant, "ControlSession", detail, code)
            future.set_exception(error)
        self._call.cancel()
        current = asyncio.current_task()
        for task in (self._reader, self._writer):
            if task is not current:
                task.cancel()

    def give_up(self, detail: str) -> None:
        """Fail every pending call now (the participant is lost) and end the stream."""
        self._break(grpc.StatusCode.UNAVAILABLE, detail)

    async def close(self) -> None:
        self._break(None, "client closed")
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


# -------------------------------------------------------------------------- client


def is_group_answer(called: str, response: pb.DescribeResponse) -> bool:
    """Whether ``response`` is a worker answering for its group ``called``: several
    worker processes share the endpoint, and any of them may answer there (docs/spec.md
    section 3.9). The coordinator then replaces the group by its workers."""
    return (
        response.worker_group == called
        and len(response.workers) > 0
        and response.instance_name != called
    )


def _check_timeout(timeout_s: float) -> None:
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")


def check_prepare_reply(
    participant: str, request: pb.PrepareRequest, response: pb.PrepareResponse
) -> None:
    """A prepare answers PREPARED or PREPARING; COMMITTED only with ``committed_empty``,
    and that only when the request offered a snapshot (docs/spec.md section 4.6 item 8)."""
    committed = response.committed_empty
    if committed and not request.empty_commit_snapshot:
        raise MalformedReplyError(
            participant, "Prepare", "committed in a prepare that offered no snapshot"
        )
    allowed = (
        (types_pb2.PHASE_COMMITTED,)
        if committed
        else (types_pb2.PHASE_PREPARED, types_pb2.PHASE_PREPARING)
    )
    if response.phase not in allowed:
        raise MalformedReplyError(
            participant,
            "Prepare",
            f"prepare answered phase {types_pb2.Phase.Name(response.phase)}"
            + (" with committed_empty" if committed else ""),
        )


class ParticipantControlClient:
    """Control calls to one participant, over one ``ControlSession`` stream.

    ``call`` sends a typed request and returns the typed response, raising the
    :class:`~turnpoint.errors.TurnpointError` the participant answered with, or a
    :class:`ControlCallError` when it gave no verdict. Use :func:`classify` on either.
    The client never retries by itself.

    Every reply is checked against the request: it must be the operation's response
    type, carry a header naming ``participant_name``, and name the checkpoint (or
    restore) it was asked for; otherwise :class:`MalformedReplyError`.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str,
        participant_name: str,
        channel_credentials: grpc.ChannelCredentials | None = None,
        reply_grace_s: float | None = None,
    ) -> None:
        if reply_grace_s is not None and reply_grace_s < 0:
            raise ValueError(f"reply_grace_s must be >= 0, got {reply_grace_s}")
        self._address = address
        self._participant_name = participant_name
        # Validated now: a token that cannot travel in metadata is a configuration error.
        self._metadata = auth_metadata(token)
        self._credentials = channel_credentials
        self._reply_grace_s = reply_grace_s
        # Created on first use, inside the event loop that will run it.
        self._channel: grpc.aio.Channel | None = None
        self._stub: CheckpointControlServiceAsyncStub | None = None
        self._session: _Session | None = None
        # None: not known yet; False: the participant answered UNIMPLEMENTED.
        self._session_supported: bool | None = None
        self._watches: set[BoundaryWatch] = set()
        self._closed = False
        # Set once the participant is declared lost: every call fails at once with it.
        self._given_up: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._participant_name!r}, {self._address!r})"

    @property
    def participant_name(self) -> str:
        return self._participant_name

    @property
    def address(self) -> str:
        return self._address

    @property
    def uses_session(self) -> bool:
        """False once the participant refused ``ControlSession`` and calls went unary."""
        return self._session_supported is not False

    @property
    def last_written_at(self) -> float | None:
        """When the current session last sent a message (event loop clock), if ever."""
        session = self._session
        return None if session is None else session.last_written_at

    @property
    def pending_calls(self) -> int:
        """Calls waiting for a reply on the current session."""
        session = self._session
        return 0 if session is None or session.broken else session.pending

    def give_up(self, detail: str) -> None:
        """Fail every call to this participant at once, the pending ones and all later
        ones (``UNAVAILABLE``, transient): it was declared lost (docs/spec.md section
        7.11 item 1), and nothing may wait on a paused process, not even the snapshot
        under way (section 7.15 item 7). Its replacement is addressed by a new client.
        A unary call already sent (a participant without sessions) still runs to its
        own timeout."""
        self._given_up = detail
        if self._session is not None:
            self._session.give_up(detail)

    def _stub_for_call(self) -> CheckpointControlServiceAsyncStub:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._stub is None:
            self._channel = control_channel(self._address, credentials=self._credentials)
            self._stub = pb_grpc.CheckpointControlServiceStub(self._channel)
        return self._stub

    def _session_for_call(self) -> _Session:
        stub = self._stub_for_call()
        if self._session is None or self._session.broken:
            call = stub.ControlSession(None, metadata=self._metadata)
            self._session = _Session(call, self._participant_name)
        return self._session

    def _reply_grace(self, timeout_s: float) -> float:
        if self._reply_grace_s is not None:
            return self._reply_grace_s
        return min(timeout_s, _MAX_REPLY_GRACE_S)

    @overload
    async def call(self, request: pb.DescribeRequest, timeout_s: float) -> pb.DescribeResponse: ...
    @overload
    async def call(self, request: pb.PrepareRequest, timeout_s: float) -> pb.PrepareResponse: ...
    @overload
    async def call(self, request: pb.RenewRequest, timeout_s: float) -> pb.RenewResponse: ...
    @overload
    async def call(self, request: pb.CommitRequest, timeout_s: float) -> pb.CommitResponse: ...
    @overload
    async def call(self, request: pb.ResumeRequest, timeout_s: float) -> pb.ResumeResponse: ...
    @overload
    async def call(self, request: pb.RestoreRequest, timeout_s: float) -> pb.RestoreResponse: ...
    @overload
    async def call(
        self, request: pb.RestoreRunningRequest, timeout_s: float
    ) -> pb.RestoreRunningResponse: ...
    @overload
    async def call(self, request: pb.RetireRequest, timeout_s: float) -> pb.RetireResponse: ...
    @overload
    async def call(self, request: pb.ForgetRequest, timeout_s: float) -> pb.ForgetResponse: ...
    @overload
    async def call(
        self, request: pb.GetStatusRequest, timeout_s: float
    ) -> pb.GetStatusResponse: ...
    @overload
    async def call(self, request: ControlRequest, timeout_s: float) -> ControlResponse: ...

    async def call(self, request: ControlRequest, timeout_s: float) -> ControlResponse:
        """Send one control request and wait for its reply, at most ``timeout_s``.

        On the session the participant is told ``timeout_s`` and answers before it; the
        client waits a reply grace longer before it gives up. Mutating requests must
        carry the ``request_id`` the caller chose; a retry sends the same one.
        """
        _check_timeout(timeout_s)
        operation = _operation_of(request)
        if self._given_up is not None:
            raise SessionBrokenError(
                self._participant_name,
                operation.method,
                self._given_up,
                grpc.StatusCode.UNAVAILABLE,
            )
        request_id = self._request_id_of(operation, request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self._session_supported is not False:
            try:
                response = await self._call_on_session(operation, request_id, request, timeout_s)
            except _SessionUnsupported as unsupported:
                if unsupported.permanent:
                    self._fall_back_to_unary()
            else:
                self._session_supported = True
                self._check_reply(operation, request, response)
                return response
        # The request never reached the participant's core: send it once, unary, in
        # whatever time the call has left.
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise CallTimeoutError(
                self._participant_name,
                operation.method,
                f"no reply within {timeout_s:g}s",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        response = await self._call_unary(operation, request, remaining)
        self._check_reply(operation, request, response)
        return response

    def _fall_back_to_unary(self) -> None:
        # Only a session that never answered and ended UNIMPLEMENTED gets here.
        if self._session_supported is not False:
            _LOG.info("%s does not serve ControlSession; using unary calls", self._participant_name)
        self._session_supported = False

    def _request_id_of(self, operation: _Operation, request: ControlRequest) -> str:
        if not operation.mutating:
            return new_request_id()
        request_id = getattr(request, "request_id", "")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(
                f"{operation.method} needs a request_id chosen by the caller, reused on retries"
            )
        return request_id

    async def _call_on_session(
        self,
        operation: _Operation,
        request_id: str,
        request: ControlRequest,
        timeout_s: float,
    ) -> ControlResponse:
        timeout = duration_pb2.Duration()
        timeout.FromNanoseconds(round(timeout_s * 1e9))
        envelope = pb.ControlSessionRequest(request_id=request_id, timeout=timeout)
        getattr(envelope, operation.field).CopyFrom(request)
        session = self._session_for_call()
        future = session.submit(envelope)
        try:
            async with asyncio.timeout(timeout_s + self._reply_grace(timeout_s)):
                reply = await future
        except TimeoutError:
            raise CallTimeoutError(
                self._participant_name,
                operation.method,
                f"no reply on the control session within {timeout_s:g}s and its grace",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None
        finally:
            session.forget(request_id, future)
        return self._unwrap(operation, reply)

    def _unwrap(self, operation: _Operation, reply: pb.ControlSessionResponse) -> ControlResponse:
        which = reply.WhichOneof("result")
        if which == "error":
            carried = control_error_to_error(reply.error)
            if carried is None:
                raise MalformedReplyError(
                    self._participant_name,
                    operation.method,
                    f"error without a known reason (code {reply.error.code})",
                )
            raise carried
        if which != operation.field:
            raise MalformedReplyError(
                self._participant_name,
                operation.method,
                f"answered with {which or 'nothing'} instead of {operation.field}",
            )
        return cast(ControlResponse, getattr(reply, which))

    async def _call_unary(
        self, operation: _Operation, request: ControlRequest, timeout_s: float
    ) -> ControlResponse:
        method = getattr(self._stub_for_call(), operation.method)
        call: grpc.aio.UnaryUnaryCall[ControlRequest, ControlResponse] = method(
            request, timeout=timeout_s, metadata=self._metadata
        )
        try:
            response = await call
        except grpc.aio.AioRpcError as error:
            raise self._from_rpc_error(operation.method, error) from error
        finally:
            # Propagates a caller's cancellation to the participant (docs/spec.md
            # section 6: cancel control calls the coordinator stopped waiting for).
            if not call.done():
                call.cancel()
        if not isinstance(response, operation.response_type):
            raise MalformedReplyError(
                self._participant_name,
                operation.method,
                f"answered with {type(response).__name__}",
            )
        return response

    def _from_rpc_error(self, method: str, error: grpc.aio.AioRpcError) -> Exception:
        carried = error_from_rpc(error)
        if carried is not None:
            return carried
        code = error.code()
        details = error.details() or code.name
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return CallTimeoutError(self._participant_name, method, details, code)
        return TransportError(self._participant_name, method, details, code)

    def _check_header(self, method: str, header: types_pb2.ResponseHeader, present: bool) -> None:
        if not present:
            raise MalformedReplyError(self._participant_name, method, "reply has no header")
        if header.participant_id != self._participant_name:
            raise MalformedReplyError(
                self._participant_name,
                method,
                f"reply comes from participant {header.participant_id!r}",
            )

    def _check_reply(
        self, operation: _Operation, request: ControlRequest, response: ControlResponse
    ) -> None:
        method = operation.method
        if isinstance(response, pb.DescribeResponse) and is_group_answer(
            self._participant_name, response
        ):
            # A worker of the group answered for it: the header names that worker,
            # which the coordinator checks against the roster (docs/spec.md 3.9).
            if not response.HasField("header"):
                raise MalformedReplyError(self._participant_name, method, "reply has no header")
            return
        self._check_header(method, response.header, response.HasField("header"))
        asked: str | None = None
        answered = ""
        if isinstance(response, pb.PrepareResponse):
            assert isinstance(request, pb.PrepareRequest)
            asked, answered = request.checkpoint_id, response.checkpoint_id
            check_prepare_reply(self._participant_name, request, response)
        elif isinstance(response, pb.CommitResponse):
            assert isinstance(request, pb.CommitRequest)
            asked, answered = request.checkpoint_id, response.checkpoint_id
        elif isinstance(response, pb.RestoreResponse):
            assert isinstance(request, pb.RestoreRequest)
            asked, answered = request.restore_id, response.restore_id
        elif isinstance(response, pb.RestoreRunningResponse):
            assert isinstance(request, pb.RestoreRunningRequest)
            asked, answered = request.restore_id, response.restore_id
        elif isinstance(response, pb.DescribeResponse):
            asked, answered = self._participant_name, response.instance_name
        if asked is not None and answered != asked:
            raise MalformedReplyError(
                self._participant_name, method, f"reply names {answered!r}, asked for {asked!r}"
            )

    def watch_boundaries(
        self, request: pb.WatchBoundariesRequest, *, timeout_s: float
    ) -> BoundaryWatch:
        """Subscribe to readiness and boundary changes (a server stream) for ``timeout_s``.

        Iterate the result with ``async for``; leave it with ``async with`` or
        ``aclose()`` so that the stream is cancelled at once. ``close()`` of the client
        cancels every watch still open, which ends its iteration. When ``timeout_s``
        runs out the iteration raises :class:`CallTimeoutError`.
        """
        _check_timeout(timeout_s)
        call = self._stub_for_call().WatchBoundaries(
            request, timeout=timeout_s, metadata=self._metadata
        )
        watch = BoundaryWatch(self, call)
        self._watches.add(watch)
        return watch

    def _watch_ended(self, watch: BoundaryWatch) -> None:
        self._watches.discard(watch)

    async def close(self) -> None:
        """Fail pending calls, cancel open streams and close the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            await watch.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._channel is not None:
            await self._channel.close(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


class BoundaryWatch:
    """An open ``WatchBoundaries`` stream: an async iterator and an async context manager."""

    def __init__(
        self,
        client: ParticipantControlClient,
        call: grpc.aio.UnaryStreamCall[pb.WatchBoundariesRequest, pb.WatchBoundariesResponse],
    ) -> None:
        self._client = client
        self._call = call

    def __aiter__(self) -> AsyncIterator[pb.WatchBoundariesResponse]:
        return self

    async def __anext__(self) -> pb.WatchBoundariesResponse:
        client = self._client
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as error:
            await self.aclose()
            raise client._from_rpc_error("WatchBoundaries", error) from error
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._call.cancelled() and (task is None or not task.cancelling()):
                # Closed by aclose() or the client's close(), not by our own caller.
                raise StopAsyncIteration from None
            raise
        if not isinstance(message, pb.WatchBoundariesResponse):
            await self.aclose()
            raise StopAsyncIteration
        client._check_header("WatchBoundaries", message.header, message.HasField("header"))
        return message

    async def aclose(self) -> None:
        """Cancel the stream (a no-op once it ended)."""
        if not self._call.done():
            self._call.cancel()
        self._client._watch_ended(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
