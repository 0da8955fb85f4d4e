"""Protocol errors on the wire: ``google.rpc.Status`` with exactly one ``ErrorInfo``.

One table (:data:`turnpoint.errors.REASON_CODES`) decides the gRPC code of every
reason; this module only translates between :class:`~turnpoint.errors.TurnpointError`,
the unary calls' rich status (grpcio-status) and the ``ControlError`` message that the
``ControlSession`` stream carries instead.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from turnpoint.errors import DOMAIN, REASON_CODES, Reason, TurnpointError
from turnpoint.v1 import types_pb2

_PREFIX = "ERROR_REASON_"


def reason_to_proto(reason: Reason) -> types_pb2.ErrorReason.ValueType:
    return types_pb2.ErrorReason.Value(_PREFIX + reason.name)


def reason_from_proto(value: int) -> Reason | None:
    """The reason a proto enum value stands for; None for UNSPECIFIED or unknown values."""
    try:
        name = types_pb2.ErrorReason.Name(value)  # type: ignore[arg-type]
    except ValueError:
        return None
    return Reason.__members__.get(name.removeprefix(_PREFIX))


def grpc_code(reason: Reason) -> grpc.StatusCode:
    return grpc.StatusCode[REASON_CODES[reason]]


def _code_number(code: grpc.StatusCode) -> int:
    number = code.value[0]
    assert isinstance(number, int)
    return number


def _error_info(err: TurnpointError) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(
        reason=err.reason.name, domain=DOMAIN, metadata=dict(err.metadata)
    )


def error_to_grpc_status(err: TurnpointError) -> grpc.Status:
    """The rich status a servicer aborts with: code from the table, one ErrorInfo."""
    detail = any_pb2.Any()
    detail.Pack(_error_info(err))
    status = status_pb2.Status(
        code=_code_number(grpc_code(err.reason)), message=err.message, details=[detail]
    )
    return rpc_status.to_status(status)


def _from_error_info(info: error_details_pb2.ErrorInfo, message: str) -> TurnpointError | None:
    if info.domain != DOMAIN:
        return None
    reason = Reason.__members__.get(info.reason)
    if reason is None:
        return None
    return TurnpointError(reason, message, dict(info.metadata))


def error_from_rpc(error: grpc.RpcError) -> TurnpointError | None:
    """The protocol error a failed call carries, or None when it carries none.

    A call that failed below the protocol (connection refused, deadline, a proxy)
    has no ErrorInfo: the caller then classifies it by its gRPC code alone.
    """
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:
        return None
    if status is None:
        return None
    infos = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            infos.append(info)
    if len(infos) != 1:
        return None
    return _from_error_info(infos[0], status.message)


def error_to_control_error(err: TurnpointError) -> types_pb2.ControlError:
    return types_pb2.ControlError(
        code=_code_number(grpc_code(err.reason)),
        reason=reason_to_proto(err.reason),
        message=err.message,
        metadata=dict(err.metadata),
    )


def control_error_to_error(message: types_pb2.ControlError) -> TurnpointError | None:
    reason = reason_from_proto(message.reason)
    if reason is None:
        return None
    return TurnpointError(reason, message.message, dict(message.metadata))


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: TurnpointError) -> NoReturn:
    """End the call with ``error`` as a rich status; never returns."""
    # grpc-stubs lacks abort_with_status on the aio context; grpcio has it since 1.38.
    await context.abort_with_status(error_to_grpc_status(error))  # type: ignore[attr-defined]
    raise AssertionError("abort_with_status always raises")
