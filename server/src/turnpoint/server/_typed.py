"""Register a servicer so that it parses its own request bytes.

The generated ``add_XServicer_to_server`` functions hand grpc the message's
``FromString`` as the request deserializer. When a request's bytes do not parse, grpc
fails the call inside its own machinery and the caller gets ``UNKNOWN`` (unary) or
``INTERNAL`` with no ``ErrorInfo``: the one kind of bad input the protocol's typed
errors could not describe (docs/spec.md sections 9.1 and 10.5).

:func:`add_servicer` registers the same servicer methods with raw-bytes handlers and
parses each request inside the handler: bytes that do not parse (truncated, wrong wire
types, nesting past protobuf's recursion limit, invalid UTF-8 in a string field) end
the call ``INVALID_ARGUMENT`` with one ``ErrorInfo`` naming the method and the message
type, and change no state. The caller's bytes are never quoted back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from turnpoint._status import abort
from turnpoint.errors import Reason, TurnpointError

_Context = grpc.aio.ServicerContext[Any, Any]


def malformed_request(method: str, type_name: str) -> TurnpointError:
    return TurnpointError(
        Reason.INVALID_ARGUMENT,
        f"{method}: the request is not a valid {type_name} message",
        {"method": method, "message_type": type_name},
    )


def _parser(method: str, request_type: Any) -> Callable[[bytes], Any]:
    type_name = request_type.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Any:
        try:
            return request_type.FromString(raw)
        except (pb_message.DecodeError, RecursionError, ValueError):
            raise malformed_request(method, type_name) from None

    return parse


def _unary_request(behaviour: Any, parse: Callable[[bytes], Any], streaming: bool) -> Any:
    if streaming:

        async def stream(raw: bytes, context: _Context) -> AsyncIterator[Any]:
            try:
                request = parse(raw)
            except TurnpointError as error:
                await abort(context, error)
            async for item in behaviour(request, context):
                yield item

        return stream

    async def unary(raw: bytes, context: _Context) -> Any:
        try:
            request = parse(raw)
        except TurnpointError as error:
            await abort(context, error)
        return await behaviour(request, context)

    return unary


def _streaming_request(behaviour: Any, parse: Callable[[bytes], Any]) -> Any:
    async def bidi(requests: AsyncIterator[bytes], context: _Context) -> AsyncIterator[Any]:
        malformed: list[TurnpointError] = []

        async def parsed() -> AsyncIterator[Any]:
            async for raw in requests:
                try:
                    yield parse(raw)
                except TurnpointError as error:
                    # End the request stream here; the call then ends with this error
                    # once the servicer has answered what it already read.
                    malformed.append(error)
                    return

        async for item in behaviour(parsed(), context):
            yield item
        if malformed:
            await abort(context, malformed[0])

    return bidi


def _handler(service: ServiceDescriptor, method: MethodDescriptor, servicer: Any) -> Any:
    name = f"/{service.full_name}/{method.name}"
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    behaviour = getattr(servicer, method.name)
    parse = _parser(name, request_type)
    serialize = response_type.SerializeToString
    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(
            _streaming_request(behaviour, parse), response_serializer=serialize
        )
    if method.client_streaming:
        raise NotImplementedError(f"{name}: client-streaming methods are not used")
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _unary_request(behaviour, parse, streaming=True), response_serializer=serialize
        )
    return grpc.unary_unary_rpc_method_handler(
        _unary_request(behaviour, parse, streaming=False), response_serializer=serialize
    )


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: Any) -> None:
    """Serve every method of ``service`` from ``servicer``, parsing requests ourselves."""
    handlers = {method.name: _handler(service, method, servicer) for method in service.methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    # Registered handlers skip the generic lookup on every call (grpcio >= 1.62);
    # grpc-stubs does not know the method yet.
    server.add_registered_method_handlers(service.full_name, handlers)  # type: ignore[attr-defined]
