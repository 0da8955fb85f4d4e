"""Prometheus metrics of one participant server, served over HTTP (docs/spec.md section 7.10).

Section 7.10 lists what a coordinator exports; a participant server exports its own side
of the same story, on its own :class:`~prometheus_client.CollectorRegistry` (never the
process-global one: several participants often share a process in tests and on Ray):

- ``turnpoint_participant_control_calls_total{operation, outcome}``: control calls
  answered, through either door (unary or ``ControlSession``); ``outcome`` is ``ok`` or
  the protocol reason in lower case (``stale_checkpoint``, ``unavailable``...).
- ``turnpoint_participant_control_refusals_total{operation, reason}``: the calls that
  were refused with a protocol reason (every outcome but ``ok``).
- ``turnpoint_participant_phase{phase}``: 1 for the phase the participant is in.
- ``turnpoint_participant_admission_open``: 1 while admission is open.
- ``turnpoint_participant_lease_expiries_total``: checkpoints finished on the
  participant's own because their lease ran out (section 4.2).
- ``turnpoint_participant_refused_rollouts``: rollouts marked refused by retires.
- ``turnpoint_participant_status_up``: 0 when the status read at scrape time failed.

Calls are counted at the wire edge by a server interceptor. The status gauges are read
at scrape time with a ``GetStatus`` call to the server itself over loopback (read-only,
never fenced, section 4.13), so they are exactly what a coordinator would see; that call
is marked and left out of the call counts. Under TLS the self-read is skipped and
``status_up`` stays 0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from turnpoint.auth import auth_metadata
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

logger = logging.getLogger(__name__)

_CONTROL_PREFIX: Final = "/turnpoint.v1.CheckpointControlService/"
_UNARY_OPERATIONS: Final = {
    "Describe": "describe",
    "Prepare": "prepare",
    "Renew": "renew",
    "Commit": "commit",
    "Resume": "resume",
    "Restore": "restore",
    "RestoreRunning": "restore_running",
    "Retire": "retire",
    "Forget": "forget",
    "GetStatus": "get_status",
}
# Marks the scrape's own GetStatus so that it is not counted as a control call.
SCRAPE_METADATA_KEY: Final = "x-turnpoint-metrics-scrape"
_SCRAPE_TIMEOUT_S: Final = 2.0
_OK: Final = "ok"


@dataclass(frozen=True)
class StatusReading:
    phase: str
    admission_open: bool
    lease_expiries: int
    refused_rollouts: int


StatusReader = Callable[[], StatusReading | None]


class ParticipantMetrics:
    """A participant server's metrics on ``registry`` (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, *, namespace: str = "turnpoint") -> None:
        self.registry = registry
        self.control_calls = Counter(
            "participant_control_calls",
            "Control calls this participant answered, by operation and outcome",
            ["operation", "outcome"],
            namespace=namespace,
            registry=registry,
        )
        self.refusals = Counter(
            "participant_control_refusals",
            "Control calls this participant refused, by operation and protocol reason",
            ["operation", "reason"],
            namespace=namespace,
            registry=registry,
        )
        self._status = _StatusCollector(namespace)
        registry.register(self._status)

    def read_status_with(self, reader: StatusReader) -> None:
        self._status.reader = reader

    def answered(self, operation: str, outcome: str) -> None:
        self.control_calls.labels(operation, outcome).inc()
        if outcome != _OK:
            self.refusals.labels(operation, outcome).inc()

    def interceptor(self) -> grpc.aio.ServerInterceptor[Any, Any]:
        return _CountingInterceptor(self)


class _StatusCollector(Collector):
    def __init__(self, namespace: str) -> None:
        self._prefix = f"{namespace}_participant"
        self.reader: StatusReader | None = None

    def collect(self) -> Iterator[Any]:
        reading = self.reader() if self.reader is not None else None
        yield GaugeMetricFamily(
            f"{self._prefix}_status_up",
            "1 when the scrape read the participant's status",
            value=0 if reading is None else 1,
        )
        if reading is None:
            return
        phase = GaugeMetricFamily(
            f"{self._prefix}_phase", "1 for the phase the participant is in", labels=["phase"]
        )
        for name in _PHASES:
            phase.add_metric([name], 1 if name == reading.phase else 0)
        yield phase
        yield GaugeMetricFamily(
            f"{self._prefix}_admission_open",
            "1 while the participant admits new data-plane work",
            value=1 if reading.admission_open else 0,
        )
        yield CounterMetricFamily(
            f"{self._prefix}_lease_expiries",
            "Checkpoints this participant finished on its own because the lease ran out",
            value=reading.lease_expiries,
        )
        yield GaugeMetricFamily(
            f"{self._prefix}_refused_rollouts",
            "Rollouts marked refused by retires and not yet forgotten",
            value=reading.refused_rollouts,
        )


def _phase_name(value: int) -> str:
    return types_pb2.Phase.Name(value).removeprefix("PHASE_").lower()  # type: ignore[arg-type]


_PHASES: Final = tuple(
    _phase_name(v) for v in types_pb2.Phase.values() if v != types_pb2.PHASE_UNSPECIFIED
)


class SelfStatusReader:
    """Reads the participant's status with a GetStatus call to ``address`` (plaintext)."""

    def __init__(self, address: str, token: str | None) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.CheckpointControlServiceStub(self._channel)
        self._metadata = (*(auth_metadata(token) if token else ()), (SCRAPE_METADATA_KEY, "1"))

    def __call__(self) -> StatusReading | None:
        try:
            status = self._stub.GetStatus(
                pb.GetStatusRequest(), metadata=self._metadata, timeout=_SCRAPE_TIMEOUT_S
            )
        except grpc.RpcError as error:
            logger.warning("metrics: status read failed (%s)", error.code())
            return None
        return StatusReading(
            phase=_phase_name(status.phase),
            admission_open=status.admission_open,
            lease_expiries=status.lease_expiries,
            refused_rollouts=status.refused_rollouts,
        )

    def close(self) -> None:
        self._channel.close()


def _refusal_reason(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The protocol reason of the rich status the servicer aborted with."""
    for key, value in context.trailing_metadata() or ():
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            break
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return str(info.reason).lower()
    code = context.code()
    return code.name.lower() if isinstance(code, grpc.StatusCode) else "unknown"


def _scrape(details: grpc.HandlerCallDetails) -> bool:
    return any(key == SCRAPE_METADATA_KEY for key, _ in details.invocation_metadata or ())


class _CountingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts control calls by operation and outcome, through both doors."""

    def __init__(self, metrics: ParticipantMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if (
            handler is None
            or not method.startswith(_CONTROL_PREFIX)
            or _scrape(handler_call_details)
        ):
            return handler
        name = method.removeprefix(_CONTROL_PREFIX)
        operation = _UNARY_OPERATIONS.get(name)
        if operation is not None and handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(operation, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if name == "ControlSession" and handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._session(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _unary(self, operation: str, behaviour: Any) -> Any:
        metrics = self._metrics

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                response = await behaviour(request, context)
            except grpc.aio.AbortError:
                metrics.answered(operation, _refusal_reason(context))
                raise
            metrics.answered(operation, _OK)
            return response

        return unary

    def _session(self, behaviour: Any) -> Any:
        metrics = self._metrics

        async def session(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            # Answers that carry an error do not name their operation: remember it
            # from the request with the same request_id.
            operations: dict[str, str] = {}

            async def noted() -> AsyncIterator[Any]:
                async for raw in requests:
                    try:
                        message = pb.ControlSessionRequest.FromString(raw)
                    except DecodeError:
                        pass  # the servicer refuses it; nothing to note
                    else:
                        operation = message.WhichOneof("operation")
                        if operation is not None and operation != "cancel":
                            operations[message.request_id] = operation
                    yield raw

            async for answer in behaviour(noted(), context):
                result = answer.WhichOneof("result")
                operation = operations.pop(answer.request_id, result or "unknown")
                if result == "error":
                    reason = types_pb2.ErrorReason.Name(answer.error.reason)
                    outcome = reason.removeprefix("ERROR_REASON_").lower()
                else:
                    outcome = _OK
                metrics.answered(operation, outcome)
                yield answer

        return session


@dataclass
class MetricsEndpoint:
    """A running metrics HTTP server; ``address`` is ``127.0.0.1:PORT``."""

    port: int
    _server: Any
    _thread: threading.Thread
    _closers: tuple[Callable[[], None], ...] = ()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        for close in self._closers:
            close()


def serve_metrics(
    registry: CollectorRegistry, port: int = 0, *, closers: tuple[Callable[[], None], ...] = ()
) -> MetricsEndpoint:
    """Serve ``registry`` over HTTP on ``127.0.0.1:port`` (0 picks a free port)."""
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return MetricsEndpoint(int(server.server_port), server, thread, closers)
