"""The guessing task played by a harness nobody here wrote: the demo's ``--agent opaque``
(docs/spec.md sections 12.8 and 12.9).

:class:`OpaqueGuessAgent` is an :class:`~turnpoint.server.openai_api.OpaqueAgent` whose
harness (the example ReAct script, in Node by default) reaches the policy through the
relay and the policy's OpenAI endpoint, and its one tool, ``observe``, through the relay
and a small HTTP bridge in this process. The bridge turns each tool call into the
resources server's keyed ``check`` call, under the key the relay gave it, so the
resources server's own record answers a call it ran already (section 6.12). When the
harness is done, the episode's result is built from the relay's journal: each turn's
completion tokens and weights version as the policy streamed them, the prompt the
endpoint's template made of the messages, the tool's reply and the attempt that got it,
and the verifier's reward; what the demo trains on and audits.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from turnpoint.apps.examples import react_harness
from turnpoint.apps.examples._participants import _episode_output, sampling_seed
from turnpoint.apps.examples._task import (
    MAX_NEW_TOKENS_PER_TURN,
    Reply,
    Task,
    Token,
    Turn,
    encode_context,
    episode_answer,
)
from turnpoint.apps.examples.chat_template import MODEL_NAME
from turnpoint.errors import TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import EpisodeContext
from turnpoint.server import ResourcesClient
from turnpoint.server.openai_api import (
    ATTEMPT_HEADER,
    IDEMPOTENCY_HEADER,
    ROLLOUT_HEADER,
    EgressRelay,
    OpaqueAgent,
    RelayEpisode,
    RelayOptions,
)

NODE_HARNESS: Final = ("node", str(Path(react_harness.__file__).with_suffix(".mjs")))
PYTHON_HARNESS: Final = (sys.executable, react_harness.__file__)


class _ToolBridge:
    """``POST /observe`` (``{"action", "step"}``) as the resources server's ``check``.

    Its socket is bound at construction, so its URL is known before the relay that
    forwards to it starts; it serves once :meth:`start` runs.
    """

    def __init__(self, resources: Mapping[str, ResourcesClient]) -> None:
        self._resources = resources
        self.environments: dict[str, str] = {}  # rollout id -> its resources server
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}/observe"
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/observe", self.observe)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, self._socket).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._socket.close()

    async def observe(self, request: web.Request) -> web.Response:
        rollout = request.headers.get(ROLLOUT_HEADER, "")
        environment = self.environments.get(rollout)
        try:
            attempt = int(request.headers.get(ATTEMPT_HEADER, ""))
            body = await request.json()
            action, step = str(body["action"]), int(body["step"])
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "expected {action, step}"}, status=400)
        if environment is None:
            return web.json_response({"error": f"no episode {rollout!r} here"}, status=404)
        guess = next((int(w) for w in action.split() if w.isdigit() and len(w) == 1), None)
        try:
            reply = await self._resources[environment].call(
                EpisodeId(rollout, attempt),
                "check",
                {"guess": guess, "turn": step},
                request_id=request.headers.get(IDEMPOTENCY_HEADER, ""),
            )
        except TurnpointError as error:
            return web.json_response({"error": str(error)}, status=503)
        return web.json_response({"observation": reply["reply"], "attempt": attempt})


class OpaqueGuessAgent(OpaqueAgent):
    """The guessing task's agent, its loop a harness process's (the module docstring)."""

    def __init__(
        self,
        policy_url: str,
        resources_addresses: Mapping[str, str],
        token: str | None,
        *,
        temperature: float = 1.0,
        harness: Sequence[str] = NODE_HARNESS,
    ) -> None:
        self._resources = {
            env: ResourcesClient(address, token=token)
            for env, address in resources_addresses.items()
        }
        self._bridge = _ToolBridge(self._resources)
        relay = EgressRelay(
            RelayOptions(
                policy_url, MODEL_NAME, upstream_api_key=token, tools={"observe": self._bridge.url}
            )
        )
        super().__init__(relay, harness, model=MODEL_NAME)
        self._started: asyncio.Task[None] | None = None
        self._temperature = temperature

    async def _start(self) -> None:
        await self._bridge.start()
        await self._relay.start()

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)
        prompt = Task.from_dict(task["task"])
        environment = str(task["environment"])
        self._bridge.environments[ctx.episode.rollout_id] = environment
        try:
            await ctx.seed(self._resources[environment], {"group_size": 1, **task})
            harness_task = {
                "low": prompt.low,
                "high": prompt.high,
                "target": prompt.target,
                "max_turns": prompt.max_turns,
                "max_tokens": MAX_NEW_TOKENS_PER_TURN,
                "temperature": self._temperature,
                "seed": sampling_seed(ctx.episode.rollout_id, 0) % (1 << 32),
                "demo": dict(task),
            }
            return await super().run(ctx, harness_task)
        finally:
            self._bridge.environments.pop(ctx.episode.rollout_id, None)

    async def episode_result(
        self,
        ctx: EpisodeContext,
        task: Mapping[str, Any],
        session: RelayEpisode,
        result: Mapping[str, Any],
    ) -> Mapping[str, Any]:
        demo_task = task["demo"]
        prompt = Task.from_dict(demo_task["task"])
        turns: list[Turn] = []
        seen: list[Turn] = []  # as the endpoint's template saw them: no EOS in a message
        prompts: list[list[int]] = []
        versions: list[int] = []
        answered: list[int] = []
        for entry in session.journal:
            if entry.tool is None:
                extension = entry.response["turnpoint"]
                completion = tuple(int(t) for t in extension["token_ids"])
                prompts.append(encode_context(prompt, seen))
                weights = extension.get("weights_versions") or [0]
                versions.append(int(weights[-1]))
                continue
            observed = entry.response["body"]
            reply = Reply(str(observed["observation"]))
            turns.append(Turn(completion, reply))
            seen.append(Turn(tuple(t for t in completion if t != Token.EOS), reply))
            answered.append(int(observed["attempt"]))
        guesses = list(episode_answer(turns))
        resources = self._resources[str(demo_task["environment"])]
        verdict = await ctx.verify(resources, {"guesses": guesses})
        turned = [turn.to_dict() for turn in turns]
        output = _episode_output(
            demo_task,
            turned,
            prompts[: len(turns)],
            versions[: len(turns)],
            answered,
            verdict.reward,
        )
        egress = {
            "calls": dict(session.export()["calls"]),
            "replayed": result["replayed"],
            "forwarded": result["forwarded"],
            "tools_forwarded": result["tools_forwarded"],
            "reruns": list(result["reruns"]),
        }
        return {**output, "guesses": guesses, "egress": egress}

    async def aclose(self) -> None:
        await self._relay.close()
        await self._bridge.close()
        for client in self._resources.values():
            await client.aclose()
