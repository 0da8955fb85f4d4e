"""The two baselines the control path is measured against, server and client halves.

- **Lower bound**: a no-op bidirectional gRPC stream that echoes raw bytes. One phase is
  one message written to each of N already-open streams and one reply read back from
  each, all concurrently: the cheapest exchange grpc.aio offers, with no protobuf, no
  auth and no protocol work on either side.
- **Anchor**: the same phases as no-op JSON POSTs over HTTP/1.1 keep-alive (aiohttp
  client and servers): the transport of the HTTP+JSON control plane turnpoint replaces.

The servers run in the bench's worker processes next to the real participants; the
clients run in the driver, in the same loop as the coordinator, so the three paths see
the same process layout.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Final

import aiohttp
import grpc
from aiohttp import web

from turnpoint._keepalive import channel_options, server_options

ECHO_SERVICE: Final = "turnpoint.bench.Echo"
ECHO_METHOD: Final = f"/{ECHO_SERVICE}/Session"
HTTP_PATH: Final = "/control"


class BaselineError(RuntimeError):
    """A baseline server answered something else than the echo it owes."""


# ------------------------------------------------------------------------ servers


async def _echo(request_iterator: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
    async for message in request_iterator:
        yield message


async def start_echo_server(host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:
    """A started gRPC server whose one stream method echoes every message; and its port."""
    server = grpc.aio.server(options=server_options())
    # No (de)serializers: messages stay bytes, so no protobuf work is measured.
    handler = grpc.method_handlers_generic_handler(
        ECHO_SERVICE, {"Session": grpc.stream_stream_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, port


async def _control(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"request_id": body.get("request_id", ""), "ok": True})


async def start_http_server(host: str = "127.0.0.1") -> tuple[web.AppRunner, int]:
    """A started aiohttp server answering ``POST /control`` with a small JSON; and its port."""
    app = web.Application()
    app.router.add_post(HTTP_PATH, _control)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    # Binding the socket here tells us the port without reaching into aiohttp's internals.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port: int = sock.getsockname()[1]
    site = web.SockSite(runner, sock)
    await site.start()
    return runner, port


# ------------------------------------------------------------------------ clients


def _payload(phase: str, request_id: str) -> dict[str, str]:
    # About the size of a control request: an operation, a checkpoint and a request id.
    return {"op": phase, "checkpoint_id": "bench-000000000001", "request_id": request_id}


class BidiEchoFanout:
    """One open echo stream per server; :meth:`phase` is one round trip on all of them."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = tuple(addresses)
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[grpc.aio.StreamStreamCall[bytes, bytes]] = []

    async def open(self, timeout_s: float = 60.0) -> None:
        """Connect every channel and open its stream with one round trip."""
        for address in self._addresses:
            channel = grpc.aio.insecure_channel(address, options=channel_options(role="control"))
            self._channels.append(channel)
        async with asyncio.timeout(timeout_s):
            # Connected first: a stream started on a connection that fails to come up
            # ends at once, and a failed connect is retried only by a waiting channel.
            await asyncio.gather(*(channel.channel_ready() for channel in self._channels))
            # No (de)serializers: bytes in, bytes out.
            self._calls = [
                channel.stream_stream(ECHO_METHOD, None, None)(None) for channel in self._channels
            ]
            await self.phase("open", "open")

    async def phase(self, phase: str, request_id: str) -> None:
        message = json.dumps(_payload(phase, request_id)).encode()
        await asyncio.gather(*(self._round_trip(call, message) for call in self._calls))

    @staticmethod
    async def _round_trip(call: grpc.aio.StreamStreamCall[bytes, bytes], message: bytes) -> None:
        if call.done():
            raise BaselineError(f"echo stream ended: {await call.code()} {await call.details()}")
        await call.write(message)
        reply = await call.read()
        if reply != message:
            raise BaselineError(f"echo stream answered {reply!r}")

    async def aclose(self) -> None:
        for call in self._calls:
            call.cancel()
        self._calls.clear()
        for channel in self._channels:
            await channel.close(None)
        self._channels.clear()


class HttpJsonFanout:
    """One keep-alive aiohttp session; :meth:`phase` is one JSON POST to every server."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._urls = tuple(f"http://{address}{HTTP_PATH}" for address in addresses)
        self._session: aiohttp.ClientSession | None = None

    async def open(self, timeout_s: float = 60.0) -> None:
        """Open the session and one kept-alive connection to every server."""
        # limit=0: as many connections as servers, all kept alive between phases. No
        # cookies: a control plane has none, and the jar costs time on every response.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        await self.phase("open", "open")

    async def phase(self, phase: str, request_id: str) -> None:
        session = self._session
        if session is None:
            raise RuntimeError("open() first")
        body = _payload(phase, request_id)
        await asyncio.gather(*(self._post(session, url, body) for url in self._urls))

    @staticmethod
    async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, str]) -> None:
        async with session.post(url, json=body) as response:
            response.raise_for_status()
            reply = await response.json()
        if reply.get("request_id") != body["request_id"]:
            raise BaselineError(f"HTTP server answered {reply!r}")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
