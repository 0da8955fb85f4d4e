"""Hosting a participant as a real gRPC server (docs/spec.md sections 3 and 10).

:class:`ParticipantServer` owns everything around the servicers: keepalive and message
limits from :mod:`turnpoint._keepalive`, bearer-token authentication, optional
(mutual) TLS, ``grpc.health.v1``, server reflection (so ``buf curl --list-services``
works), binding, and a graceful drain: health turns NOT_SERVING for every service
first, so load balancers and coordinators stop sending new work, then the server stops
with a grace period for calls in flight.

The servicers themselves come from the caller through a callback that adds them to the
``grpc.aio.Server`` and returns the full names of the services it added.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from turnpoint._keepalive import DEFAULT_MAX_MESSAGE_BYTES, server_options
from turnpoint._tls import server_credentials
from turnpoint.auth import token_sha256 as digest_of_token
from turnpoint.auth import validate_token, validate_token_sha256
from turnpoint.errors import Reason, TurnpointError
from turnpoint.server._auth import BearerTokenInterceptor
from turnpoint.server._metrics import (
    MetricsEndpoint,
    ParticipantMetrics,
    SelfStatusReader,
    serve_metrics,
)
from turnpoint.v1 import (
    checkpoint_control_service_pb2,
    policy_service_pb2,
    resources_service_pb2,
    rollout_service_pb2,
)

_log = logging.getLogger(__name__)

CONTROL_SERVICE: Final[str] = checkpoint_control_service_pb2.DESCRIPTOR.services_by_name[
    "CheckpointControlService"
].full_name
DATA_PLANE_SERVICES: Final[frozenset[str]] = frozenset(
    {
        rollout_service_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name,
        policy_service_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name,
        resources_service_pb2.DESCRIPTOR.services_by_name["ResourcesService"].full_name,
    }
)
HEALTH_SERVICE: Final[str] = health.SERVICE_NAME
# grpcio-reflection serves v1alpha only; v1 is listed so that it stays open the day it
# is added. buf curl asks for v1 first and falls back to v1alpha.
REFLECTION_SERVICES: Final[frozenset[str]] = frozenset(
    {reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"}
)
_OVERALL_HEALTH: Final = ""

# Requests carry lists (expected episodes, retire sets, receipts); a few thousand
# entries is a large participant, ten thousand leaves headroom and still bounds the
# work one request can cause.
DEFAULT_MAX_LIST_LENGTH: Final = 10_000

RegisterServicers = Callable[[grpc.aio.Server], Sequence[str]]
"""Adds servicers to the server and returns the full names of the services added."""

DrainHook = Callable[[], Awaitable[None]]
"""Runs after health turned NOT_SERVING and before the server stops."""

ServerState = Literal["new", "starting", "serving", "draining", "stopped"]


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """How a participant server listens, authenticates and bounds its inputs.

    ``port`` 0 lets the OS pick (read it back from :attr:`ParticipantServer.port`).
    ``token`` is the control credential and is never shown in the repr. Without one the
    server refuses to start unless ``allow_insecure_no_auth``. ``data_token`` (also never
    shown) is a second, data-plane credential: it opens the turnpoint data-plane services
    and nothing else, so whoever holds it (an agent's harness) cannot fence, restore or
    retire anything (docs/spec.md section 10.2); without it ``token`` serves both roles.
    ``token_sha256`` (SHA-256 of the control token, hex) replaces ``token``: the server
    checks the control credential without holding it, so nothing it runs (a harness)
    can read a credential that reaches a control plane (section 10.2 item 8); a server
    that calls out does so with ``data_token``. ``auth_data_plane`` False leaves the turnpoint
    data-plane services open and protects only the control service (and any service
    not known here). TLS needs ``tls_cert_file`` and ``tls_key_file``;
    ``tls_client_ca_file`` turns on mutual TLS: every client must present a certificate
    that CA signed; ``control_identities`` (mutual TLS only) then also binds the control
    role to certificates: a call beyond the data plane needs a client certificate whose
    subject alternative name or common name is one of them (docs/spec.md section 10.2
    item 6). ``metrics_port`` (None: off; 0 lets the OS pick) serves the
    server's Prometheus metrics over HTTP on 127.0.0.1 (:mod:`turnpoint.server._metrics`,
    docs/spec.md section 7.10); read the address back from
    :attr:`ParticipantServer.metrics_address`. ``shared_port`` (a worker of a group,
    :mod:`turnpoint.server._worker_group`) also listens on that port, which every worker
    of the group binds with ``SO_REUSEPORT``; ``port`` stays the worker's own
    (docs/spec.md section 3.9).
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = field(default=None, repr=False)
    token_sha256: str | None = field(default=None, repr=False)
    data_token: str | None = field(default=None, repr=False)
    allow_insecure_no_auth: bool = False
    auth_data_plane: bool = True
    tls_cert_file: str | Path | None = None
    tls_key_file: str | Path | None = None
    tls_client_ca_file: str | Path | None = None
    control_identities: tuple[str, ...] = ()
    grace_seconds: float = 10.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_list_length: int = DEFAULT_MAX_LIST_LENGTH
    metrics_port: int | None = None
    shared_port: int | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.token is not None:
            validate_token(self.token)
        if self.token_sha256 is not None:
            if self.token is not None:
                raise ValueError("give the control token or its SHA-256 digest, not both")
            object.__setattr__(self, "token_sha256", validate_token_sha256(self.token_sha256))
        if self.data_token is not None:
            validate_token(self.data_token)
            if not self.authenticates:
                raise ValueError("a data-plane token needs a control token beside it")
            if digest_of_token(self.data_token) == self.control_token_sha256:
                raise ValueError("the data-plane token must differ from the control token")
            if not self.auth_data_plane:
                raise ValueError("a data-plane token has no use when the data plane is open")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("mutual TLS (tls_client_ca_file) needs tls_cert_file and tls_key_file")
        if self.control_identities and (self.tls_client_ca_file is None or not self.authenticates):
            raise ValueError("control_identities needs mutual TLS (tls_client_ca_file) and a token")
        if any(not name for name in self.control_identities):
            raise ValueError("a control identity must not be empty")
        if not self.grace_seconds >= 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")
        if self.max_list_length <= 0:
            raise ValueError(f"max_list_length must be positive, got {self.max_list_length}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.shared_port is not None and not 0 < self.shared_port <= 65535:
            raise ValueError(f"shared_port must be in 1..65535, got {self.shared_port}")

    @property
    def authenticates(self) -> bool:
        """Whether a control credential is configured (the token or its digest)."""
        return self.token is not None or self.token_sha256 is not None

    @property
    def control_token_sha256(self) -> str | None:
        """The digest the control token is checked against (None: no authentication)."""
        return digest_of_token(self.token) if self.token is not None else self.token_sha256

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def mutual_tls(self) -> bool:
        return self.tls_client_ca_file is not None

    @property
    def bind_address(self) -> str:
        return _join_host_port(self.host, self.port)

    def open_services(self) -> frozenset[str]:
        """Services that answer without a token; every other service needs one."""
        opened = {HEALTH_SERVICE, *REFLECTION_SERVICES}
        if not self.auth_data_plane:
            opened |= DATA_PLANE_SERVICES
        return frozenset(opened)


def _join_host_port(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_list_length(name: str, items: Sized, limit: int) -> None:
    """Refuse a request list longer than ``limit`` (INVALID_ARGUMENT, before any state changes)."""
    length = len(items)
    if length > limit:
        raise TurnpointError(
            Reason.INVALID_ARGUMENT,
            f"{name} has {length} entries; at most {limit} are accepted",
            {"field": name, "length": str(length), "limit": str(limit)},
        )


class ParticipantServer:
    """One participant's gRPC server: start, serve, drain, stop.

    Typical use (what ``turnpoint serve`` does)::

        server = ParticipantServer(options, register)
        await server.start()
        server.install_signal_handlers()
        await server.wait_for_termination()   # returns after SIGTERM drained it

    ``on_drain`` runs once health says NOT_SERVING and before the server stops: the
    place to end long-lived streams (ControlSession, WatchBoundaries) so they do not
    hold the whole grace period.
    """

    def __init__(
        self,
        options: ServerOptions,
        register: RegisterServicers,
        *,
        on_drain: DrainHook | None = None,
    ) -> None:
        if not options.authenticates and not options.allow_insecure_no_auth:
            raise ValueError(
                "no bearer token configured: set $TURNPOINT_TOKEN or $TURNPOINT_TOKEN_FILE "
                "(or pass a token file), or explicitly allow insecure serving without auth"
            )
        self._options = options
        self._register = register
        self._on_drain = on_drain
        self._state: ServerState = "new"
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None
        self._services: tuple[str, ...] = ()
        self._port: int | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._terminated = asyncio.Event()
        self._signal_tasks: set[asyncio.Task[None]] = set()
        self._signals: list[signal.Signals] = []
        self._metrics: ParticipantMetrics | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None

    @property
    def options(self) -> ServerOptions:
        return self._options

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def services(self) -> tuple[str, ...]:
        """The services the registration callback added (health and reflection not included)."""
        return self._services

    @property
    def port(self) -> int:
        """The bound port; only known once :meth:`start` returned."""
        if self._port is None:
            raise RuntimeError("the server has not been started")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` as bound (a wildcard host is not an address to dial)."""
        return _join_host_port(self._options.host, self.port)

    @property
    def metrics(self) -> ParticipantMetrics | None:
        """The server's metrics when ``options.metrics_port`` is set."""
        return self._metrics

    @property
    def metrics_address(self) -> str | None:
        """``127.0.0.1:PORT`` of the metrics HTTP server, once started with metrics on."""
        endpoint = self._metrics_endpoint
        return endpoint.address if endpoint is not None else None

    async def __aenter__(self) -> ParticipantServer:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.drain_and_stop()

    async def start(self) -> int:
        """Register servicers, bind, start serving; returns the bound port."""
        if self._state != "new":
            raise RuntimeError(f"start() called on a server that is {self._state}")
        self._state = "starting"
        options = self._options
        credentials = None
        if options.tls:
            assert options.tls_cert_file is not None
            assert options.tls_key_file is not None
            credentials = await asyncio.to_thread(
                server_credentials,
                options.tls_cert_file,
                options.tls_key_file,
                options.tls_client_ca_file,
            )
        interceptors: list[grpc.aio.ServerInterceptor[Any, Any]] = []
        if options.authenticates:
            interceptors.append(
                BearerTokenInterceptor(
                    options.token,
                    token_sha256=options.token_sha256,
                    open_services=options.open_services(),
                    data_token=options.data_token,
                    data_services=DATA_PLANE_SERVICES,
                    control_identities=options.control_identities,
                )
            )
        if options.metrics_port is not None:
            # After auth: only authenticated calls are counted.
            self._metrics = ParticipantMetrics(CollectorRegistry())
            interceptors.append(self._metrics.interceptor())
        server = grpc.aio.server(
            interceptors=interceptors,
            options=server_options(
                max_message_bytes=options.max_message_bytes,
                reuse_port=options.shared_port is not None,
            ),
        )
        services = self._registered_services(server)
        health_servicer = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (*services, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )
        # Not serving until the port is open: a probe that connects in between must not
        # be told SERVING by the health servicer's default.
        for name in (_OVERALL_HEALTH, *services):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        port = self._bind(server, credentials)
        await server.start()
        for name in (_OVERALL_HEALTH, *services):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self._health, self._services, self._port = (
            server,
            health_servicer,
            services,
            port,
        )
        self._state = "serving"
        self._log_started()
        if self._metrics is not None and options.metrics_port is not None:
            self._metrics_endpoint = await asyncio.to_thread(self._serve_metrics, port)
            _log.info("metrics of %s on http://%s/metrics", self.address, self.metrics_address)
        return port

    def _serve_metrics(self, port: int) -> MetricsEndpoint:
        assert self._metrics is not None and self._options.metrics_port is not None
        closers: tuple[Callable[[], None], ...] = ()
        # The self-reader calls GetStatus, a control call: a server that holds only the
        # control token's digest cannot make it, and serves its metrics without it.
        if not self._options.tls and (
            self._options.token is not None or not self._options.authenticates
        ):
            host = self._options.host
            dial = host if _is_loopback(host) else "127.0.0.1"
            reader = SelfStatusReader(_join_host_port(dial, port), self._options.token)
            self._metrics.read_status_with(reader)
            closers = (reader.close,)
        return serve_metrics(self._metrics.registry, self._options.metrics_port, closers=closers)

    def _registered_services(self, server: grpc.aio.Server) -> tuple[str, ...]:
        services = tuple(self._register(server))
        reserved = {HEALTH_SERVICE, *REFLECTION_SERVICES, _OVERALL_HEALTH}
        for name in services:
            if not isinstance(name, str) or name in reserved:
                raise ValueError(f"the registration callback returned an invalid name {name!r}")
        if len(set(services)) != len(services):
            raise ValueError(f"the registration callback returned duplicates: {services!r}")
        return services

    def _bind(self, server: grpc.aio.Server, credentials: grpc.ServerCredentials | None) -> int:
        port = self._bind_one(server, credentials, self._options.bind_address)
        shared = self._options.shared_port
        if shared is not None:
            self._bind_one(server, credentials, _join_host_port(self._options.host, shared))
        return port

    @staticmethod
    def _bind_one(
        server: grpc.aio.Server, credentials: grpc.ServerCredentials | None, address: str
    ) -> int:
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError as err:
            raise OSError(f"cannot bind {address}: {err}") from err
        if port == 0:
            raise OSError(f"cannot bind {address}")
        return port

    def _log_started(self) -> None:
        options = self._options
        if not options.authenticates:
            _log.warning("serving WITHOUT authentication: anyone who can connect controls it")
        elif not options.tls and not _is_loopback(options.host):
            _log.warning("the bearer token travels in plaintext: %s is not loopback", options.host)
        _log.info(
            "serving %s on %s (tls=%s, mutual_tls=%s, auth=%s, data_token=%s)",
            ", ".join(self._services),
            self.address,
            options.tls,
            options.mutual_tls,
            options.authenticates,
            options.data_token is not None,
        )

    async def drain_and_stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING for every service, ``on_drain``, then stop with ``grace``.

        ``grace`` defaults to ``options.grace_seconds``: calls in flight get that long
        to finish, new calls are refused. Safe to call more than once and concurrently;
        every caller returns when the server has stopped. A caller cancelled while
        waiting does not interrupt the drain.
        """
        await asyncio.shield(self._start_drain(grace))

    def _start_drain(self, grace: float | None) -> asyncio.Task[None]:
        # Synchronous, so that a signal handler marks the drain as begun at once and a
        # second signal right behind it is recognised as the second.
        if self._drain_task is None:
            seconds = self._options.grace_seconds if grace is None else grace
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(seconds))
        return self._drain_task

    async def _drain(self, grace: float) -> None:
        server, health_servicer = self._server, self._health
        if server is None or health_servicer is None:
            self._state = "stopped"
            self._terminated.set()
            return
        self._state = "draining"
        try:
            # Permanent: a late set(SERVING) from a servicer cannot undo the drain.
            await health_servicer.enter_graceful_shutdown()
            _log.info("draining %s: health NOT_SERVING, grace %.1f s", self.address, grace)
            if self._on_drain is not None:
                await self._on_drain()
        finally:
            try:
                await server.stop(grace)
            finally:
                self._state = "stopped"
                if self._metrics_endpoint is not None:
                    await asyncio.to_thread(self._metrics_endpoint.close)
                    self._metrics_endpoint = None
                self._remove_signal_handlers()
                self._terminated.set()
                _log.info("stopped %s", self.address)

    async def wait_for_termination(self) -> None:
        """Return once the server has drained and stopped; re-raises an ``on_drain`` error."""
        await self._terminated.wait()
        if self._drain_task is not None:
            await self._drain_task

    def install_signal_handlers(
        self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
    ) -> None:
        """SIGTERM/SIGINT drain and stop the server; a second signal cuts the grace short.

        Call from the running event loop (Unix only). :meth:`wait_for_termination` then
        returns normally, so the process exits 0 after a drain.
        """
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals.append(sig)

    def _remove_signal_handlers(self) -> None:
        if not self._signals:
            return
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals.clear()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._drain_task is None:
            _log.info("%s: draining", sig.name)
            self._start_drain(None)
            return
        if self._server is None:
            return
        _log.warning("%s during the drain: cancelling calls in flight", sig.name)
        # A stop without grace while a graceful stop runs cancels what is left of the
        # grace period; the drain then completes at once.
        task = asyncio.get_running_loop().create_task(self._server.stop(None))
        self._signal_tasks.add(task)
        task.add_done_callback(self._signal_tasks.discard)
