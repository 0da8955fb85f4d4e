"""The demo's launcher: the trainer asks the supervisor for a replacement participant.

The supervisor owns every participant process (it starts them, chaos kills them, it
stops them at the end), so the trainer's :class:`~turnpoint.trainer.advanced.Launcher`
(docs/spec.md section 7.15 item 9) is a client of the supervisor's process table, not a
second process table: :class:`SupervisorLauncher` sends ``{"token", "replace":
instance}`` as one JSON line to the supervisor's :class:`LaunchService` on loopback and
reads back one line, ``{"address": "host:port"}`` once the replacement serves, or
``{"error": "why"}``. The trainer gets the service's address as ``--launcher``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Final

from turnpoint.trainer import LaunchError

_MAX_LINE: Final = 64 * 1024

PARTICIPANT_LOST_STATUS: Final = 4
"""The trainer's exit status when a participant was lost and not healed in place: the
supervisor then restarts the whole job (docs/spec.md section 7.11 item 4)."""


class ReplaceRefused(Exception):
    """The supervisor cannot replace this participant in place (why in the message)."""


Replace = Callable[[str], Awaitable[str]]


class LaunchService:
    """Serves the trainer's replacement requests on ``127.0.0.1:0``, one at a time."""

    def __init__(self, token: str, replace: Replace) -> None:
        self._token = token
        self._replace = replace
        self._lock = asyncio.Lock()
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        assert self._server is not None, "start() the service first"
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def start(self) -> LaunchService:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=_MAX_LINE)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            answer = await self._answer(await reader.readline())
            writer.write(json.dumps(answer).encode("utf-8") + b"\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # the trainer went away (it was killed): nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, line: bytes) -> dict[str, str]:
        try:
            request = json.loads(line)
        except json.JSONDecodeError:
            return {"error": "the request is not one JSON line"}
        if not isinstance(request, dict) or not isinstance(request.get("replace"), str):
            return {"error": 'the request names no instance ("replace")'}
        token = request.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token, self._token):
            return {"error": "unauthenticated"}
        async with self._lock:
            try:
                return {"address": await self._replace(request["replace"])}
            except ReplaceRefused as error:
                return {"error": str(error)}


class SupervisorLauncher:
    """The trainer's :class:`~turnpoint.trainer.advanced.Launcher` in the demo."""

    def __init__(self, address: str, token: str, *, timeout_s: float) -> None:
        host, _, port = address.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self._token = token
        self._timeout_s = timeout_s

    async def replace(self, instance: str) -> str:
        try:
            answer = await asyncio.wait_for(self._ask(instance), self._timeout_s)
        except TimeoutError:
            raise LaunchError(instance, f"no answer within {self._timeout_s:g}s") from None
        except (OSError, ValueError) as error:
            raise LaunchError(instance, f"the supervisor cannot be asked: {error}") from error
        address = answer.get("address")
        if isinstance(address, str) and address:
            return address
        raise LaunchError(instance, str(answer.get("error", "no address in the answer")))

    async def _ask(self, instance: str) -> dict[str, object]:
        reader, writer = await asyncio.open_connection(self._host, self._port, limit=_MAX_LINE)
        try:
            request = {"token": self._token, "replace": instance}
            writer.write(json.dumps(request).encode("utf-8") + b"\n")
            await writer.drain()
            answer = json.loads(await reader.readline())
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        if not isinstance(answer, dict):
            raise ValueError("the answer is not a JSON object")
        return answer
