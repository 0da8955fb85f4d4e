"""A loopback TCP proxy that loses or delays replies on command.

The faults this protocol exists for happen on the network: a reply lost after the
server acted, a reply that arrives late. The proxy sits between a client and one server
(both on 127.0.0.1) and forwards bytes both ways; a test or the chaos run switches it,
at any moment, between:

- ``PASS``: forward everything;
- ``DELAY``: hold every server-to-client chunk for ``delay_s`` before forwarding it;
- ``DROP_REPLIES``: on a connection that is already up (its HTTP/2 handshake done),
  forward the next request bytes, then cut the connection at the first byte the server
  sends after them: the server got the request, its answer is lost, and the client sees
  the connection break. A connection still being set up is left alone until it is up;
- ``BLACKHOLE``: accept nothing new and cut every open connection.

It works on TCP bytes, below HTTP/2, so it needs to understand nothing of gRPC: cutting
a connection is exactly what a lost reply looks like to a gRPC client.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from dataclasses import dataclass, field

_CHUNK = 64 * 1024


class ProxyMode(enum.Enum):
    PASS = "pass"
    DELAY = "delay"
    DROP_REPLIES = "drop_replies"
    BLACKHOLE = "blackhole"


@dataclass
class ProxyStats:
    connections: int = 0
    cut: int = 0
    delayed_chunks: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass(eq=False)  # identity: links live in a set
class _Link:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # The server has spoken (the handshake is done), and request bytes went up in
    # DROP_REPLIES mode since: the next reply bytes are the ones to lose.
    server_spoke: bool = False
    armed: bool = False

    def cut(self) -> None:
        for writer in (self.client, self.server):
            writer.transport.abort()


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` (``host:port``), with switchable faults."""

    def __init__(self, target: str, *, host: str = "127.0.0.1") -> None:
        target_host, _, target_port = target.rpartition(":")
        self._target = (target_host or "127.0.0.1", int(target_port))
        self._host = host
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self.mode = ProxyMode.PASS
        self.delay_s = 0.0
        self.stats = ProxyStats()

    @property
    def address(self) -> str:
        assert self._server is not None, "start() the proxy first"
        port = self._server.sockets[0].getsockname()[1]
        return f"{self._host}:{port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, self._host, 0)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.cut()
        tasks = [task for link in self._links for task in link.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def set_mode(self, mode: ProxyMode, *, delay_s: float = 0.0) -> None:
        """Switch faults; BLACKHOLE and DROP_REPLIES take effect on open connections too."""
        self.mode = mode
        self.delay_s = delay_s
        if mode is ProxyMode.BLACKHOLE:
            for link in list(self._links):
                self._cut(link)

    def drop_replies_now(self) -> None:
        """``DROP_REPLIES``, the replies to requests already sent included: every open
        connection whose server has spoken loses the next bytes its server sends. For a
        fault that must begin at a known request, from the server's handler of it (its
        reply, written once the handler returns, is the first thing lost)."""
        self.set_mode(ProxyMode.DROP_REPLIES)
        for link in self._links:
            if link.server_spoke:
                link.armed = True

    def _cut(self, link: _Link) -> None:
        if link in self._links:
            self._links.discard(link)
            self.stats.cut += 1
            link.cut()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode is ProxyMode.BLACKHOLE:
            writer.transport.abort()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self.stats.connections += 1
        link = _Link(writer, server_writer)
        self._links.add(link)
        up = asyncio.create_task(self._pump(reader, server_writer, link, upstream=True))
        down = asyncio.create_task(self._pump(server_reader, writer, link, upstream=False))
        link.tasks = [up, down]
        await asyncio.gather(up, down, return_exceptions=True)
        self._links.discard(link)
        for end in (writer, server_writer):
            with contextlib.suppress(Exception):
                end.close()

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        link: _Link,
        *,
        upstream: bool,
    ) -> None:
        try:
            while chunk := await source.read(_CHUNK):
                if upstream and self.mode is ProxyMode.DROP_REPLIES and link.server_spoke:
                    link.armed = True
                if not upstream:
                    if self.mode is ProxyMode.DROP_REPLIES and link.armed:
                        self._cut(link)
                        return
                    link.server_spoke = True
                    if self.mode is ProxyMode.DELAY and self.delay_s > 0:
                        self.stats.delayed_chunks += 1
                        await asyncio.sleep(self.delay_s)
                    self.stats.bytes_down += len(chunk)
                else:
                    self.stats.bytes_up += len(chunk)
                sink.write(chunk)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One direction ended: end the other too, as a real connection would.
            self._cut(link)
