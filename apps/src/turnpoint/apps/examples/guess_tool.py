"""The guessing task's tool as an HTTP service, the way a harness's tools are served:
behind the egress relay, which alone reaches it (docs/spec.md section 12.9).

``POST /observe`` takes ``{"action", "target"}`` and answers ``{"observation"}``
(``higher``, ``lower``, ``correct`` or ``invalid``, as
:func:`~turnpoint.apps.examples.react_harness.observe` says). Each call has an effect
on the world, kept in :attr:`GuessTool.ledger` (the guesses each rollout made), so a
call run twice would show there. The tool honours the relay's ``Idempotency-Key``: a key
it has answered is answered again from its record and the effect is not applied again
(section 6.12 item 2); :attr:`GuessTool.requests` counts what reached it at all.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from aiohttp import web

from turnpoint.apps.examples.react_harness import observe
from turnpoint.server.openai_api import IDEMPOTENCY_HEADER, ROLLOUT_HEADER


class GuessTool:
    """``async with GuessTool() as tool``: serves on ``tool.url`` (127.0.0.1, a free port)."""

    def __init__(self) -> None:
        self.requests = 0  # calls that reached the tool, answered from its record or not
        self.applied: Counter[str] = Counter()  # effects applied, by call key
        self.ledger: dict[str, list[str]] = {}  # the world: each rollout's guesses
        self._replies: dict[str, tuple[str, dict[str, Any]]] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def observe(self, request: web.Request) -> web.Response:
        self.requests += 1
        try:
            body = json.loads(await request.read())
            action, target = str(body["action"]), int(body["target"])
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "expected {action, target}"}, status=400)
        asked = json.dumps(body, sort_keys=True)
        key = request.headers.get(IDEMPOTENCY_HEADER, "")
        if key and key in self._replies:
            recorded, reply = self._replies[key]
            if recorded != asked:
                return web.json_response({"error": f"key {key} was another call"}, status=422)
            return web.json_response(reply)
        reply = {"observation": observe(action, target)}
        self.ledger.setdefault(request.headers.get(ROLLOUT_HEADER, ""), []).append(action)
        if key:
            self.applied[key] += 1
            self._replies[key] = (asked, reply)
        return web.json_response(reply)

    async def __aenter__(self) -> GuessTool:
        app = web.Application()
        app.router.add_post("/observe", self.observe)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/observe"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
