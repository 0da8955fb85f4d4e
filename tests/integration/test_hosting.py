"""ParticipantServer against real clients on 127.0.0.1:0: auth, health, reflection, TLS, drain."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from turnpoint._keepalive import (
    CHANNEL_ROLE_ARG,
    KEEPALIVE_TIME_MS,
    channel_options,
    control_channel,
    data_channel,
    server_options,
)
from turnpoint._status import error_from_rpc
from turnpoint._tls import client_credentials
from turnpoint.auth import auth_metadata, bearer_call_credentials, load_token
from turnpoint.errors import Reason, TurnpointError
from turnpoint.server import ServerOptions
from turnpoint.server._grpc_server import check_list_length
from turnpoint.server.advanced import (
    CONTROL_SERVICE,
    HEALTH_SERVICE,
    BearerTokenInterceptor,
    DrainHook,
    ParticipantServer,
)
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import rollout_service_pb2 as rollout_pb
from turnpoint.v1 import rollout_service_pb2_grpc as rollout_grpc
from turnpoint.v1 import types_pb2

TOKEN = "tok-3f9a-Secret-Value"
ROLLOUT_SERVICE = "turnpoint.v1.RolloutService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
RPC_TIMEOUT = 10.0
# A channel with its own connection: without it gRPC reuses an existing connection to
# the same target, and a check of "is the port still open" would ride the old one.
FRESH_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


class _EchoControl(pb_grpc.CheckpointControlServiceServicer):
    """GetStatus answers with the caller's peer address (to tell connections apart).

    The other methods stay the generated UNIMPLEMENTED ones.
    """

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetStatusResponse:
        return pb.GetStatusResponse(active_checkpoint_id=context.peer(), admission_open=True)

    async def WatchBoundaries(
        self, request: pb.WatchBoundariesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchBoundariesResponse]:
        yield pb.WatchBoundariesResponse(phase=types_pb2.PHASE_IDLE)

    async def ControlSession(
        self,
        request_iterator: AsyncIterator[pb.ControlSessionRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ControlSessionResponse]:
        async for request in request_iterator:
            yield pb.ControlSessionResponse(request_id=request.request_id)


def _register(server: grpc.aio.Server) -> Sequence[str]:
    pb_grpc.add_CheckpointControlServiceServicer_to_server(_EchoControl(), server)  # type: ignore[abstract]
    # The base servicer answers UNIMPLEMENTED: enough to tell "refused" from "let through".
    rollout_grpc.add_RolloutServiceServicer_to_server(
        rollout_grpc.RolloutServiceServicer(),  # type: ignore[abstract]
        server,
    )
    return [CONTROL_SERVICE, ROLLOUT_SERVICE]


def _options(**overrides: Any) -> ServerOptions:
    fields: dict[str, Any] = {"token": TOKEN, "grace_seconds": 0.0}
    fields.update(overrides)
    return ServerOptions(**fields)


@asynccontextmanager
async def _serving(
    options: ServerOptions | None = None, on_drain: DrainHook | None = None
) -> AsyncIterator[ParticipantServer]:
    server = ParticipantServer(options or _options(), _register, on_drain=on_drain)
    await server.start()
    try:
        yield server
    finally:
        await server.drain_and_stop(grace=0)


@asynccontextmanager
async def _channel(
    target: str,
    credentials: grpc.ChannelCredentials | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> AsyncIterator[grpc.aio.Channel]:
    if credentials is None:
        channel = grpc.aio.insecure_channel(target, options=options)
    else:
        channel = grpc.aio.secure_channel(target, credentials, options=options)
    try:
        yield channel
    finally:
        await channel.close(None)


@asynccontextmanager
async def _control(
    options: ServerOptions | None = None,
) -> AsyncIterator[pb_grpc.CheckpointControlServiceAsyncStub]:
    async with _serving(options) as server, _channel(server.address) as channel:
        yield pb_grpc.CheckpointControlServiceStub(channel)


def _assert_unauthenticated(error: grpc.aio.AioRpcError) -> TurnpointError:
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    protocol_error = error_from_rpc(error)
    assert protocol_error is not None, "the refusal must carry a google.rpc.Status + ErrorInfo"
    assert protocol_error.reason is Reason.UNAUTHENTICATED
    return protocol_error


# --- bearer token ------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param((), id="no-metadata"),
        pytest.param((("authorization", "Bearer not-the-token"),), id="wrong-token"),
        pytest.param((("authorization", f"Bearer {TOKEN}x"),), id="token-plus-one"),
        pytest.param((("authorization", f"Bearer {TOKEN[:-1]}"),), id="token-prefix"),
        pytest.param((("authorization", f"Basic {TOKEN}"),), id="wrong-scheme"),
        pytest.param((("authorization", "Bearer "),), id="empty-token"),
        pytest.param((("authorization", TOKEN),), id="no-scheme"),
        pytest.param((("x-token", f"Bearer {TOKEN}"),), id="wrong-header"),
    ],
)
async def test_unary_control_call_without_the_right_token_is_unauthenticated(
    metadata: tuple[tuple[str, str], ...],
) -> None:
    async with _control() as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=RPC_TIMEOUT)
    error = _assert_unauthenticated(info.value)
    assert error.metadata["method"] == "/turnpoint.v1.CheckpointControlService/GetStatus"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_unary_control_call_with_the_right_token_is_served(scheme: str) -> None:
    async with _control() as stub:
        response = await stub.GetStatus(
            pb.GetStatusRequest(),
            metadata=(("authorization", f"{scheme} {TOKEN}"),),
            timeout=RPC_TIMEOUT,
        )
    assert response.admission_open


async def test_auth_metadata_is_what_the_server_accepts() -> None:
    async with _control() as stub:
        response = await stub.GetStatus(
            pb.GetStatusRequest(), metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT
        )
    assert response.admission_open


@pytest.mark.parametrize("metadata", [(), auth_metadata("wrong")], ids=["none", "wrong"])
async def test_bidi_control_session_without_the_token_is_unauthenticated(
    metadata: tuple[tuple[str, str], ...],
) -> None:
    async with _control() as stub:
        call = stub.ControlSession(None, metadata=metadata, timeout=RPC_TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.write(pb.ControlSessionRequest(request_id="r-1"))
            await call.read()
    _assert_unauthenticated(info.value)


async def test_bidi_control_session_with_the_token_echoes() -> None:
    async with _control() as stub:
        call = stub.ControlSession(None, metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT)
        for request_id in ("r-1", "r-2"):
            await call.write(pb.ControlSessionRequest(request_id=request_id))
            response = await call.read()
            assert isinstance(response, pb.ControlSessionResponse)
            assert response.request_id == request_id
        await call.done_writing()


async def test_server_stream_control_call_is_refused_then_served() -> None:
    async with _control() as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.WatchBoundaries(pb.WatchBoundariesRequest(), timeout=RPC_TIMEOUT):
                pass
        _assert_unauthenticated(info.value)
        responses = [
            response
            async for response in stub.WatchBoundaries(
                pb.WatchBoundariesRequest(), metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT
            )
        ]
    assert [response.phase for response in responses] == [types_pb2.PHASE_IDLE]


@pytest.mark.parametrize(
    ("auth_data_plane", "expected"),
    [(True, grpc.StatusCode.UNAUTHENTICATED), (False, grpc.StatusCode.UNIMPLEMENTED)],
)
async def test_data_plane_needs_the_token_unless_configured_open(
    auth_data_plane: bool, expected: grpc.StatusCode
) -> None:
    async with (
        _serving(_options(auth_data_plane=auth_data_plane)) as server,
        _channel(server.address) as channel,
    ):
        stub = rollout_grpc.RolloutServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as without_token:
            await stub.Acknowledge(rollout_pb.AcknowledgeRequest(), timeout=RPC_TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError) as with_token:
            await stub.Acknowledge(
                rollout_pb.AcknowledgeRequest(), metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT
            )
        # The control service stays protected either way.
        control = pb_grpc.CheckpointControlServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as control_error:
            await control.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT)
    assert without_token.value.code() == expected
    assert with_token.value.code() == grpc.StatusCode.UNIMPLEMENTED
    _assert_unauthenticated(control_error.value)


async def test_the_token_appears_in_no_log_error_or_repr(caplog: pytest.LogCaptureFixture) -> None:
    wrong = "wrong-Token-0f1e2d"
    caplog.set_level(logging.DEBUG)
    options = _options()
    async with _control(options) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetStatus(
                pb.GetStatusRequest(), metadata=auth_metadata(wrong), timeout=RPC_TIMEOUT
            )
    error = _assert_unauthenticated(info.value)
    assert "refused" in caplog.text, "a refusal is logged (without the token)"
    exposed = [
        caplog.text,
        str(info.value.details()),
        error.message,
        repr(error.metadata),
        repr(options),
        repr(BearerTokenInterceptor(TOKEN, open_services=())),
    ]
    for text in exposed:
        assert TOKEN not in text
        assert wrong not in text


async def test_without_a_token_the_server_refuses_to_start_unless_insecure_is_allowed() -> None:
    with pytest.raises(ValueError, match="no bearer token"):
        ParticipantServer(ServerOptions(), _register)
    async with _control(_options(token=None, allow_insecure_no_auth=True)) as stub:
        response = await stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT)
    assert response.admission_open


def test_load_token_prefers_the_file_then_the_variable_then_the_file_variable(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n", encoding="ascii")
    env_file = tmp_path / "env-token"
    env_file.write_text("from-env-file\n", encoding="ascii")
    env = {"TURNPOINT_TOKEN": "from-env", "TURNPOINT_TOKEN_FILE": str(env_file)}
    assert load_token(token_file, environ=env) == "from-file"
    assert load_token(environ=env) == "from-env"
    assert load_token(environ={"TURNPOINT_TOKEN_FILE": str(env_file)}) == "from-env-file"
    assert load_token(environ={}) is None


@pytest.mark.parametrize("bad", ["has space", "two\nlines", "ünicode", ""])
def test_an_unusable_token_is_refused_without_being_quoted(tmp_path: Path, bad: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(bad.encode())
    with pytest.raises(ValueError) as info:
        load_token(token_file, environ={})
    if bad:
        assert bad not in str(info.value)
    with pytest.raises(ValueError):
        ServerOptions(token=bad)


# --- health and reflection ------------------------------------------------------------


async def test_health_check_is_open_and_serving_for_every_service() -> None:
    async with _serving() as server, _channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        statuses = {
            service: (
                await stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT
                )
            ).status
            for service in ("", CONTROL_SERVICE, ROLLOUT_SERVICE)
        }
    assert statuses == {"": SERVING, CONTROL_SERVICE: SERVING, ROLLOUT_SERVICE: SERVING}


async def _list_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    names: set[str] = set()
    async for response in stub.ServerReflectionInfo(requests, timeout=RPC_TIMEOUT):
        names.update(service.name for service in response.list_services_response.service)
    return names


async def test_reflection_lists_the_services_without_a_token() -> None:
    async with _serving() as server, _channel(server.address) as channel:
        names = await _list_services(channel)
    assert {CONTROL_SERVICE, ROLLOUT_SERVICE, HEALTH_SERVICE} <= names


async def test_buf_curl_lists_the_services() -> None:
    buf = Path(sys.executable).parent / "buf"
    async with _serving() as server:
        process = await asyncio.create_subprocess_exec(
            str(buf),
            "curl",
            "--list-services",
            "--protocol",
            "grpc",
            "--http2-prior-knowledge",
            f"http://{server.address}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()
    assert CONTROL_SERVICE in stdout.decode().split()


# --- input bounds ---------------------------------------------------------------------


async def test_a_request_over_the_message_size_limit_is_refused() -> None:
    async with _control(_options(max_message_bytes=1024)) as stub:
        small = await stub.GetStatus(
            pb.GetStatusRequest(), metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT
        )
        call = stub.ControlSession(None, metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.write(pb.ControlSessionRequest(request_id="r" * 2048))
            await call.read()
    assert small.admission_open
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_check_list_length_refuses_long_lists_with_invalid_argument() -> None:
    check_list_length("expected_episodes", [1, 2, 3], 3)
    with pytest.raises(TurnpointError) as info:
        check_list_length("expected_episodes", [1, 2, 3, 4], 3)
    assert info.value.reason is Reason.INVALID_ARGUMENT
    assert info.value.metadata == {"field": "expected_episodes", "length": "4", "limit": "3"}


@pytest.mark.parametrize(
    "fields",
    [
        {"port": 70000},
        {"tls_cert_file": "cert.pem"},
        {"tls_key_file": "key.pem"},
        {"tls_client_ca_file": "ca.pem"},
        {"grace_seconds": -1.0},
        {"max_message_bytes": 0},
        {"max_list_length": 0},
    ],
)
def test_inconsistent_server_options_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ServerOptions(token=TOKEN, **fields)


# --- keepalive and connections --------------------------------------------------------


def test_both_ends_agree_on_keepalive() -> None:
    server = dict(server_options())
    client = dict(channel_options())
    assert client["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    # A client pinging more often than the server accepts would get GOAWAY too_many_pings.
    min_interval = server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert isinstance(min_interval, int)
    assert min_interval <= KEEPALIVE_TIME_MS
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert client["grpc.max_receive_message_length"] == server["grpc.max_receive_message_length"]
    assert dict(channel_options(role="control"))[CHANNEL_ROLE_ARG] != client[CHANNEL_ROLE_ARG]


async def test_control_channels_never_share_a_connection_with_data_channels() -> None:
    async with _serving() as server:
        channels = [
            data_channel(server.address),
            data_channel(server.address),
            control_channel(server.address),
        ]
        try:
            peers = [
                (
                    await pb_grpc.CheckpointControlServiceStub(channel).GetStatus(
                        pb.GetStatusRequest(), metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT
                    )
                ).active_checkpoint_id
                for channel in channels
            ]
        finally:
            for channel in channels:
                await channel.close(None)
    first_data, second_data, control = peers
    # Two data channels share one connection: the test can tell connections apart.
    assert first_data == second_data
    assert control != first_data


# --- TLS ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    # Signed by the same CA, naming "harness": an agent's harness, never the coordinator.
    harness_cert: Path
    harness_key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _issue(
    common_name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    extensions: Callable[[x509.CertificateBuilder], x509.CertificateBuilder],
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    return extensions(builder).sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Pki]:
    """A throwaway CA, a server cert for 127.0.0.1/localhost and a client cert."""
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue(
        "turnpoint test CA",
        ca_key,
        None,
        extensions=lambda b: b.add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        ).add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        ),
    )
    issuer = (ca_cert.subject, ca_key)

    def leaf(
        usage: x509.ObjectIdentifier, names: list[x509.GeneralName]
    ) -> Callable[[x509.CertificateBuilder], x509.CertificateBuilder]:
        return lambda b: (
            b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
        )

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _issue(
        "localhost",
        server_key,
        issuer,
        extensions=leaf(
            ExtendedKeyUsageOID.SERVER_AUTH,
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        ),
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _issue(
        "coordinator",
        client_key,
        issuer,
        extensions=leaf(ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("coordinator")]),
    )
    harness_key = ec.generate_private_key(ec.SECP256R1())
    harness_cert = _issue(
        "harness",
        harness_key,
        issuer,
        extensions=leaf(ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("harness")]),
    )
    paths = _Pki(
        ca=root / "ca.pem",
        server_cert=root / "server.pem",
        server_key=root / "server.key",
        client_cert=root / "client.pem",
        client_key=root / "client.key",
        harness_cert=root / "harness.pem",
        harness_key=root / "harness.key",
    )
    paths.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    paths.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    paths.harness_cert.write_bytes(harness_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(paths.server_key, server_key)
    _write_key(paths.client_key, client_key)
    _write_key(paths.harness_key, harness_key)
    yield paths


def _tls_options(pki: _Pki, *, mutual: bool) -> ServerOptions:
    return _options(
        tls_cert_file=pki.server_cert,
        tls_key_file=pki.server_key,
        tls_client_ca_file=pki.ca if mutual else None,
    )


async def _get_status(
    address: str, credentials: grpc.ChannelCredentials | None, **call: Any
) -> pb.GetStatusResponse:
    async with _channel(address, credentials, FRESH_CONNECTION) as channel:
        stub = pb_grpc.CheckpointControlServiceStub(channel)
        response: pb.GetStatusResponse = await stub.GetStatus(
            pb.GetStatusRequest(), timeout=RPC_TIMEOUT, **call
        )
        return response


async def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_plaintext(pki: _Pki) -> None:
    async with _serving(_tls_options(pki, mutual=False)) as server:
        response = await _get_status(
            server.address, client_credentials(pki.ca), metadata=auth_metadata(TOKEN)
        )
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await _get_status(server.address, None, metadata=auth_metadata(TOKEN))
    assert response.admission_open
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_tls_still_requires_the_token_and_takes_it_as_call_credentials(pki: _Pki) -> None:
    async with _serving(_tls_options(pki, mutual=False)) as server:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _get_status(server.address, client_credentials(pki.ca))
        with_credentials = grpc.composite_channel_credentials(
            client_credentials(pki.ca), bearer_call_credentials(TOKEN)
        )
        response = await _get_status(server.address, with_credentials)
    _assert_unauthenticated(info.value)
    assert response.admission_open


async def test_mutual_tls_refuses_a_client_without_a_certificate(pki: _Pki) -> None:
    async with _serving(_tls_options(pki, mutual=True)) as server:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _get_status(
                server.address, client_credentials(pki.ca), metadata=auth_metadata(TOKEN)
            )
        response = await _get_status(
            server.address,
            client_credentials(pki.ca, pki.client_cert, pki.client_key),
            metadata=auth_metadata(TOKEN),
        )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert response.admission_open


async def test_control_identities_bind_the_control_role_to_a_certificate(pki: _Pki) -> None:
    """docs/spec.md section 10.2 item 6: the control token presented from a certificate
    that names no control identity (a harness's machine) opens no control method, of any
    streaming shape; the data plane stays open to it; the coordinator's is served."""
    options = replace(_tls_options(pki, mutual=True), control_identities=("coordinator",))
    coordinator = client_credentials(pki.ca, pki.client_cert, pki.client_key)
    harness = client_credentials(pki.ca, pki.harness_cert, pki.harness_key)
    token = auth_metadata(TOKEN)
    async with _serving(options) as server:
        served = await _get_status(server.address, coordinator, metadata=token)
        assert served.admission_open
        async with _channel(server.address, harness, FRESH_CONNECTION) as channel:
            control = pb_grpc.CheckpointControlServiceStub(channel)
            refusals = []
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await control.GetStatus(pb.GetStatusRequest(), metadata=token, timeout=RPC_TIMEOUT)
            refusals.append(unary.value)
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                async for _ in control.WatchBoundaries(
                    pb.WatchBoundariesRequest(), metadata=token, timeout=RPC_TIMEOUT
                ):
                    pass
            refusals.append(streamed.value)
            session = control.ControlSession(None, metadata=token, timeout=RPC_TIMEOUT)
            with pytest.raises(grpc.aio.AioRpcError) as bidi:
                await session.write(pb.ControlSessionRequest(request_id="r-1"))
                await session.read()
            refusals.append(bidi.value)
            rollout = rollout_grpc.RolloutServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as data_plane:
                await rollout.Acknowledge(
                    rollout_pb.AcknowledgeRequest(), metadata=token, timeout=RPC_TIMEOUT
                )
        async with _channel(server.address, coordinator, FRESH_CONNECTION) as channel:
            session = pb_grpc.CheckpointControlServiceStub(channel).ControlSession(
                None, metadata=token, timeout=RPC_TIMEOUT
            )
            await session.write(pb.ControlSessionRequest(request_id="r-2"))
            echoed = await session.read()
            await session.done_writing()
    for refusal in refusals:
        assert refusal.code() == grpc.StatusCode.PERMISSION_DENIED, refusal
        error = error_from_rpc(refusal)
        assert error is not None and error.reason is Reason.PERMISSION_DENIED
        assert error.metadata["cause"] == "the client certificate names no control identity"
    # Let through to the base servicer (UNIMPLEMENTED): the data plane is not the control.
    assert data_plane.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert isinstance(echoed, pb.ControlSessionResponse) and echoed.request_id == "r-2"


@pytest.mark.parametrize(
    "fields",
    [
        {"control_identities": ("coordinator",)},
        {"control_identities": ("",), "tls_client_ca_file": "ca.pem"},
    ],
    ids=["without-mutual-tls", "empty-name"],
)
def test_control_identities_are_refused_where_they_cannot_hold(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _options(tls_cert_file="cert.pem", tls_key_file="key.pem", **fields)


# --- drain ----------------------------------------------------------------------------


def _state_of(server: ParticipantServer) -> str:
    # A call, not an attribute: mypy would keep the first comparison's narrowing.
    return server.state


async def test_drain_turns_health_not_serving_before_the_port_closes() -> None:
    in_drain = asyncio.Event()
    release = asyncio.Event()

    async def on_drain() -> None:
        in_drain.set()
        await release.wait()

    server = ParticipantServer(_options(grace_seconds=30.0), _register, on_drain=on_drain)
    await server.start()
    address = server.address
    drain: asyncio.Task[None] | None = None
    try:
        async with _channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            overall = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT)
            control = health.Watch(
                health_pb2.HealthCheckRequest(service=CONTROL_SERVICE), timeout=RPC_TIMEOUT
            )
            assert (await overall.read()).status == SERVING
            assert (await control.read()).status == SERVING

            drain = asyncio.create_task(server.drain_and_stop())
            assert (await overall.read()).status == NOT_SERVING
            assert (await control.read()).status == NOT_SERVING
            await asyncio.wait_for(in_drain.wait(), timeout=RPC_TIMEOUT)
            assert _state_of(server) == "draining"
            assert not drain.done()

            # The port is still open, on a new connection, and says NOT_SERVING.
            async with _channel(address, None, FRESH_CONNECTION) as fresh:
                check = await health_pb2_grpc.HealthStub(fresh).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT
                )
            assert check.status == NOT_SERVING
            overall.cancel()
            control.cancel()
        release.set()
        await asyncio.wait_for(drain, timeout=RPC_TIMEOUT)
        assert _state_of(server) == "stopped"
        await asyncio.wait_for(server.wait_for_termination(), timeout=RPC_TIMEOUT)

        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await _get_status(address, None, metadata=auth_metadata(TOKEN))
        assert closed.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        release.set()
        await server.drain_and_stop(grace=0)


async def test_drain_and_stop_is_idempotent_and_concurrent_callers_all_return() -> None:
    server = ParticipantServer(_options(), _register)
    await server.start()
    await asyncio.gather(server.drain_and_stop(), server.drain_and_stop())
    await server.drain_and_stop()
    await server.wait_for_termination()
    assert server.state == "stopped"
    with pytest.raises(RuntimeError):
        await server.start()


async def test_an_on_drain_failure_still_stops_the_server_and_surfaces() -> None:
    async def failing() -> None:
        raise TurnpointError(Reason.STORAGE_UNAVAILABLE, "disk gone")

    server = ParticipantServer(_options(), _register, on_drain=failing)
    await server.start()
    with pytest.raises(TurnpointError):
        await server.drain_and_stop()
    assert server.state == "stopped"
    with pytest.raises(TurnpointError):
        await server.wait_for_termination()


def test_refusals_are_logged_at_most_once_per_cause_and_interval() -> None:
    from turnpoint.server._auth import RateLimitedLog

    log = RateLimitedLog(interval_s=10.0, max_keys=2)
    key = ("/turnpoint.v1.CheckpointControlService/Prepare", "missing bearer token")
    assert log.admit(key, 0.0) == 0  # the first is logged
    assert [log.admit(key, t) for t in (1.0, 2.0, 9.9)] == [None, None, None]
    assert log.admit(key, 10.5) == 3  # then one line saying how many were held back
    assert log.admit(("other", "cause"), 10.6) == 0  # another cause is logged on its own
    assert log.admit(("third", "cause"), 10.7) == 0  # memory stays bounded


async def test_a_new_control_channel_does_not_inherit_the_backoff_of_a_dead_one() -> None:
    # A port with nothing on it: a control channel to it fails and backs off.
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    address = f"127.0.0.1:{port}"
    stale = control_channel(address)
    stub = pb_grpc.CheckpointControlServiceStub(stale)
    try:
        for _ in range(4):  # each failure grows its reconnect backoff
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT)
        # A participant comes back on that port (a replaced worker, a restarted actor),
        # and a fresh coordinator opens its control channel while the stale one lives.
        async with _serving(_options(port=port)) as server:
            fresh = control_channel(server.address)
            try:
                status = await pb_grpc.CheckpointControlServiceStub(fresh).GetStatus(
                    pb.GetStatusRequest(), metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT
                )
            finally:
                await fresh.close(None)
    finally:
        await stale.close(None)
    assert status.admission_open  # answered at once: nothing of the dead port's backoff
