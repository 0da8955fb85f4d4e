"""Bearer-token authentication for participant servers (docs/spec.md section 10).

The server side is one ``grpc.aio.ServerInterceptor``: every method of a protected
service needs ``authorization: Bearer <token>`` in its metadata, compared in constant
time; a refused call ends UNAUTHENTICATED with a ``google.rpc.Status`` carrying one
``ErrorInfo`` (reason UNAUTHENTICATED), like every other protocol error. Services are
protected unless named open (deny by default), so a servicer added later is never
exposed by accident. The token appears in no log line, error, or repr.

Credentials have roles (section 10.2): the control token opens every protected service;
a data-plane token, when one is configured, opens only the services named data-plane.
A data-plane token on any other service (the control service above all) is refused
PERMISSION_DENIED: whoever holds it (an agent's harness) can neither fence, restore nor
retire anything. Without a data-plane token the one token serves both roles. Under
mutual TLS, ``control_identities`` also binds the control role to the connection: a call
to any service but the data plane's then needs a client certificate naming one of them
(a subject alternative name or the common name), else PERMISSION_DENIED, so a control
token that leaked to a harness's machine is of no use from its certificate.

The client side (:func:`turnpoint.auth.auth_metadata`) lives in the core, so that a
coordinator authenticates without importing the server package.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Final

import grpc

from turnpoint._status import error_to_grpc_status
from turnpoint.auth import (
    AUTHORIZATION_KEY,
    BEARER_SCHEME,
    validate_token,
    validate_token_sha256,
)
from turnpoint.errors import Reason, TurnpointError

_log = logging.getLogger(__name__)

_AUTHORIZATION: Final = AUTHORIZATION_KEY
_SCHEME: Final = BEARER_SCHEME

if TYPE_CHECKING:
    _Handler = grpc.RpcMethodHandler[Any, Any]
    _InterceptorBase = grpc.aio.ServerInterceptor[Any, Any]
else:
    _InterceptorBase = grpc.aio.ServerInterceptor


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerTokenInterceptor(_InterceptorBase):
    """Refuses calls to every service not in ``open_services`` without the right token.

    ``token`` is the control credential: it opens every protected service. Given
    ``token_sha256`` instead (its SHA-256, hex), the interceptor checks the control token
    without holding it (docs/spec.md section 10.2 item 8). ``data_token`` (optional,
    distinct from the control token) opens only ``data_services``; presented anywhere
    else it is refused PERMISSION_DENIED.
    """

    def __init__(
        self,
        token: str | None = None,
        *,
        token_sha256: str | None = None,
        open_services: Collection[str],
        data_token: str | None = None,
        data_services: Collection[str] = (),
        control_identities: Collection[str] = (),
    ) -> None:
        if (token is None) == (token_sha256 is None):
            raise ValueError("give the control token or its SHA-256 digest, not both")
        # Comparing fixed-length digests keeps compare_digest from returning early on a
        # length mismatch, so timing reveals neither the token's bytes nor its length.
        self._expected_digest = (
            _digest(validate_token(token).encode("ascii"))
            if token is not None
            else bytes.fromhex(validate_token_sha256(token_sha256 or ""))
        )
        self._data_digest: bytes | None = None
        if data_token is not None:
            self._data_digest = _digest(validate_token(data_token).encode("ascii"))
            if hmac.compare_digest(self._data_digest, self._expected_digest):
                raise ValueError("the data-plane token must differ from the control token")
        self._open_services = frozenset(open_services)
        self._data_services = frozenset(data_services)
        self._control_identities = frozenset(control_identities)
        self._refusal_log = RateLimitedLog()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(open_services={sorted(self._open_services)!r}, "
            f"data_services={sorted(self._data_services)!r}, "
            f"data_token={self._data_digest is not None}, "
            f"control_identities={sorted(self._control_identities)!r})"
        )

    def is_protected(self, method: str) -> bool:
        """Whether ``/package.Service/Method`` needs the token."""
        return _service(method) not in self._open_services

    def _refusal(
        self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None
    ) -> tuple[Reason, str] | None:
        """Why the call's metadata does not authorize it; None when it does."""
        presented_digest = self._presented_digest(metadata)
        if isinstance(presented_digest, str):
            return Reason.UNAUTHENTICATED, presented_digest
        # Both comparisons always run: timing does not tell which credential matched.
        is_control = hmac.compare_digest(presented_digest, self._expected_digest)
        is_data = self._data_digest is not None and hmac.compare_digest(
            presented_digest, self._data_digest
        )
        if is_control:
            return None
        if not is_data:
            return Reason.UNAUTHENTICATED, "bearer token not accepted"
        if _service(method) in self._data_services:
            return None
        return Reason.PERMISSION_DENIED, "a data-plane credential cannot call this service"

    def _presented_digest(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | str:
        """The digest of the presented token, or why there is no token to check."""
        values = [value for key, value in (metadata or ()) if key == _AUTHORIZATION]
        if not values:
            return "missing bearer token"
        if len(values) > 1:
            return "more than one authorization header"
        value = values[0]
        if isinstance(value, bytes):
            return "malformed authorization header"
        scheme, _, presented = value.partition(" ")
        if scheme.lower() != _SCHEME or not presented:
            return "authorization is not a bearer token"
        return _digest(presented.encode("utf-8", "surrogateescape"))

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        method = handler_call_details.method
        if not self.is_protected(method):
            return await continuation(handler_call_details)
        refusal = self._refusal(method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        # An unknown method (no handler) stays UNIMPLEMENTED: its shape is unknown, and
        # reflection already tells anyone which methods exist.
        checked = self._control_identities and _service(method) not in self._data_services
        if handler is None or (refusal is None and not checked):
            return handler
        if refusal is None:
            return _identity_checked_handler(
                handler, method, self._control_identities, self._refusal_log
            )
        reason, cause = refusal
        return _rejecting_handler(handler, method, reason, cause, self._refusal_log)


def _service(method: str) -> str:
    """``package.Service`` of ``/package.Service/Method``."""
    return method.split("/")[1] if method.startswith("/") else method


class RateLimitedLog:
    """At most one line per key per ``interval_s``; counts what it held back.

    A client hammering a server with a bad token must not fill its log: the first
    refusal of each (method, cause) is logged, then one line per interval that says how
    many were not.
    """

    def __init__(self, interval_s: float = 10.0, max_keys: int = 1024) -> None:
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._last: dict[Hashable, tuple[float, int]] = {}

    def admit(self, key: Hashable, now: float) -> int | None:
        """None to stay quiet; else the number of lines held back since the last one."""
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._last) >= self._max_keys:
            self._last.clear()  # bounded memory under a flood of distinct keys
        self._last[key] = (now, 0)
        return 0 if last is None else last[1]


def peer_identities(context: grpc.aio.ServicerContext[Any, Any]) -> frozenset[str]:
    """The names the client's verified certificate carries: its subject alternative
    names and its common name (empty without mutual TLS)."""
    auth = context.auth_context()
    names = [*auth.get("x509_subject_alternative_name", ()), *auth.get("x509_common_name", ())]
    return frozenset(n.decode("utf-8", "replace") for n in names)


def _identity_checked_handler(
    handler: _Handler, method: str, identities: frozenset[str], refusal_log: RateLimitedLog
) -> _Handler:
    """``handler``, behind a check of the client certificate's names against the control
    identities (section 10.2 item 6). The request is parsed only once the check passed:
    this handler takes raw bytes and deserializes them itself."""
    cause = "the client certificate names no control identity"
    error = TurnpointError(
        Reason.PERMISSION_DENIED, f"{method}: {cause}", {"method": method, "cause": cause}
    )
    status = error_to_grpc_status(error)
    parse = handler.request_deserializer or (lambda raw: raw)

    async def check(context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if peer_identities(context) & identities:
            return
        suppressed = refusal_log.admit((method, cause), time.monotonic())
        if suppressed is not None:
            more = f" ({suppressed} more like it not logged)" if suppressed else ""
            _log.warning("refused %s from %s: %s%s", method, context.peer(), cause, more)
        await context.abort_with_status(status)  # type: ignore[attr-defined]

    async def parsed(requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for raw in requests:
            yield parse(raw)

    serialize = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        stream_stream: Any = handler.stream_stream  # async under grpc.aio (the stubs say sync)
        assert stream_stream is not None

        async def bidi(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
            await check(context)
            async for reply in stream_stream(parsed(requests), context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(bidi, None, serialize)
    if handler.request_streaming:
        stream_unary: Any = handler.stream_unary  # async under grpc.aio (the stubs say sync)
        assert stream_unary is not None

        async def client_stream(requests: AsyncIterator[bytes], context: Any) -> Any:
            await check(context)
            return await stream_unary(parsed(requests), context)

        return grpc.stream_unary_rpc_method_handler(client_stream, None, serialize)
    if handler.response_streaming:
        unary_stream: Any = handler.unary_stream  # async under grpc.aio (the stubs say sync)
        assert unary_stream is not None

        async def server_stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
            await check(context)
            async for reply in unary_stream(parse(raw), context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(server_stream, None, serialize)
    unary_unary: Any = handler.unary_unary  # async under grpc.aio (the stubs say sync)
    assert unary_unary is not None

    async def unary(raw: bytes, context: Any) -> Any:
        await check(context)
        return await unary_unary(parse(raw), context)

    return grpc.unary_unary_rpc_method_handler(unary, None, serialize)


def _rejecting_handler(
    handler: _Handler, method: str, reason: Reason, refusal: str, refusal_log: RateLimitedLog
) -> _Handler:
    """A handler of the refused method's streaming shape that only aborts.

    No request deserializer: a refused caller's bytes are never parsed.
    """
    error = TurnpointError(reason, f"{method}: {refusal}", {"method": method, "cause": refusal})
    status = error_to_grpc_status(error)

    async def reject(_request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        suppressed = refusal_log.admit((method, refusal), time.monotonic())
        if suppressed is not None:
            more = f" ({suppressed} more like it not logged)" if suppressed else ""
            _log.warning("refused %s from %s: %s%s", method, context.peer(), refusal, more)
        # grpc-stubs lacks abort_with_status on the aio context; grpcio has it since 1.38.
        await context.abort_with_status(status)  # type: ignore[attr-defined]

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(reject)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(reject)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(reject)
    return grpc.unary_unary_rpc_method_handler(reject)
