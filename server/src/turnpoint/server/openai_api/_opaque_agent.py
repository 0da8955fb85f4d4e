"""The opaque-agent participant: an :class:`~turnpoint.participant_sdk.Agent` whose turns
are a harness process's model and tool calls (docs/spec.md sections 12.8 and 12.9).

Each episode runs one harness process tree, a command line given by the environment,
with ``OPENAI_BASE_URL`` the relay's address and ``OPENAI_API_KEY`` the episode's relay
credential; its environment holds nothing else of the host's but ``PATH`` (no control
token, no policy key). When the relay has tools, ``TURNPOINT_TOOLS_URL`` is where the
harness calls them. Each call the relay completes (a model call or a tool call) is a turn
boundary: the boundary's state is the relay's record of the episode, sealed before the
harness sees the answer, so a recorded tool call is answered from the record after a
restore and never reaches its tool twice. A restored attempt opens the episode at the relay from that state and starts
a fresh harness, which the relay answers from the record until the cut; a harness that
diverges is stopped and the episode reruns from its prompt, the divergence reported in
the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Final

from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import Agent, EpisodeContext, RecoveryMode
from turnpoint.server.openai_api._relay import (
    Completed,
    Diverged,
    EgressRelay,
    RelayEpisode,
    check_relay_state,
)

# The boundary state's field holding the relay's record of the episode.
EGRESS_FIELD: Final = "egress"
# A harness that diverges again and again is not rerun for ever.
MAX_RERUNS: Final = 3
# What is kept of a harness's output (it is untrusted: memory stays bounded): the end of
# its standard output, where its result is, and of its standard error, for the reason.
_STDOUT_TAIL: Final = 1 << 20
_STDERR_TAIL: Final = 4096
_READ_BYTES: Final = 1 << 16


class HarnessFailedError(RuntimeError):
    """The harness exited with a failure, or printed no JSON object as its last line."""

    def __init__(self, returncode: int | None, why: str) -> None:
        super().__init__(f"the harness failed (exit {returncode}): {why}")
        self.returncode = returncode
        self.why = why


class OpaqueAgent(Agent):
    """Runs ``command`` once per episode against ``relay`` (the module docstring says how).

    The harness reads its task as JSON from ``TURNPOINT_TASK``, its stable execution
    identity (the rollout id) from ``TURNPOINT_EXECUTION`` and the model's name from
    ``OPENAI_MODEL``, and where its tools are from ``TURNPOINT_TOOLS_URL`` (when the relay
    has tools); it prints its result as a JSON object on its last line of output.
    ``env`` adds variables (never a secret of the host's: the harness is untrusted).

    ``replayable=False`` declares a harness that cannot be answered from the record (it
    reads a clock, a random source or the network around the relay, so a fresh process
    would not repeat its calls): the participant is then ``RESTART_ONLY`` (docs/spec.md
    section 12.8 item 7). Its episodes are restarts: never exported, never parked, and
    after a restore rerun from their prompts by the coordinator, counted as restarts.
    """

    environment = "opaque"

    def __init__(
        self,
        relay: EgressRelay,
        command: Sequence[str],
        *,
        model: str,
        env: Mapping[str, str] | None = None,
        replayable: bool = True,
    ) -> None:
        if not command:
            raise ValueError("the harness command line is empty")
        self.recovery_mode = RecoveryMode.EXPORTED if replayable else RecoveryMode.RESTART_ONLY
        self._relay = relay
        self._command = tuple(command)
        self._model = model
        self._env = dict(env or {})
        self._snapshots = 0
        self._open: str | None = None
        # The process id of every harness started, in order: the tests' witness.
        self.harness_pids: list[int] = []

    def validate_state(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        check_relay_state(state.get(EGRESS_FIELD))

    async def admission_closed(self) -> None:
        self._snapshots += 1
        self._open = f"admission-{self._snapshots}"
        self._relay.prepare(self._open)

    async def admission_opened(self) -> None:
        if self._open is not None:
            self._relay.resume(self._open)
            self._open = None

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        saved = ctx.restored
        state = saved.state.get(EGRESS_FIELD) if saved is not None else None
        turn = saved.turn_index if saved is not None else 0
        session = self._relay.open_episode(ctx.episode, state, sealed=True, turn=turn)
        reruns: list[dict[str, Any]] = []
        try:
            if saved is None:
                await ctx.boundary(0, {EGRESS_FIELD: session.export()})  # owns nothing yet
            while True:
                turn, outcome = await self._run_harness(ctx, task, session, turn)
                if isinstance(outcome, Diverged):
                    if len(reruns) >= MAX_RERUNS:
                        raise HarnessFailedError(None, f"diverged {len(reruns) + 1} times")
                    reruns.append({"position": outcome.position, "reason": outcome.reason})
                    session.rerun()
                    turn = session.turn  # a rerun's calls are keyed past every earlier one
                    continue
                return await self.episode_result(
                    ctx,
                    task,
                    session,
                    {
                        "transcript": outcome,
                        "turns": turn,
                        "reruns": reruns,
                        "replayed": session.replayed,
                        "forwarded": session.forwarded,
                        "tools_forwarded": session.tools_forwarded,
                    },
                )
        finally:
            self._relay.close_episode(ctx.episode)

    async def episode_result(
        self,
        ctx: EpisodeContext,
        task: Mapping[str, Any],
        session: RelayEpisode,
        result: Mapping[str, Any],
    ) -> Mapping[str, Any]:
        """The episode's result, from the harness's (``result``) and the relay's journal
        of the episode (``session.journal``: every completed call of the harness lineage
        that finished, answers included). An environment that trains on the completions
        or scores the episode overrides it; by default, ``result`` as it is."""
        return result

    async def _run_harness(
        self, ctx: EpisodeContext, task: Mapping[str, Any], session: RelayEpisode, turn: int
    ) -> tuple[int, Mapping[str, Any] | Diverged]:
        env = {
            "PATH": os.environ.get("PATH", ""),
            **self._env,
            "OPENAI_BASE_URL": self._relay.base_url,
            "OPENAI_API_KEY": session.api_key,
            "OPENAI_MODEL": self._model,
            "TURNPOINT_TASK": json.dumps(dict(task)),
            "TURNPOINT_EXECUTION": ctx.episode.rollout_id,
        }
        if self._relay.tools:
            env["TURNPOINT_TOOLS_URL"] = self._relay.tools_url
        process = await asyncio.create_subprocess_exec(
            *self._command,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: killed as a tree
        )
        self.harness_pids.append(process.pid)
        assert process.stdout is not None and process.stderr is not None
        exited = asyncio.ensure_future(
            _outputs(
                process, _tail(process.stdout, _STDOUT_TAIL), _tail(process.stderr, _STDERR_TAIL)
            )
        )
        try:
            while True:
                event = asyncio.ensure_future(ctx.model_call(session.next_event))
                await asyncio.wait((exited, event), return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    event.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await event
                    if session.diverged is not None:
                        # Told it diverged, the harness exited before its owner looked.
                        return turn, session.diverged
                    return turn, _result(process.returncode, *exited.result())
                happened = event.result()
                if isinstance(happened, Diverged):
                    return turn, happened
                assert isinstance(happened, Completed)
                turn += 1
                # Sealed before the harness sees the answer: a cut never holds less
                # than the harness knows.
                await ctx.boundary(turn, {EGRESS_FIELD: session.export()})
                happened.release()
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            exited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exited
            await process.wait()


async def _tail(stream: asyncio.StreamReader, limit: int) -> bytes:
    """The last ``limit`` bytes of ``stream``, read to its end."""
    kept = bytearray()
    while chunk := await stream.read(_READ_BYTES):
        kept += chunk
        del kept[:-limit]
    return bytes(kept)


async def _outputs(
    process: asyncio.subprocess.Process, stdout: Awaitable[bytes], stderr: Awaitable[bytes]
) -> tuple[bytes, bytes]:
    out, err = await asyncio.gather(stdout, stderr)
    await process.wait()
    return out, err


def _result(returncode: int | None, stdout: bytes, stderr: bytes) -> Mapping[str, Any]:
    if returncode != 0:
        tail = stderr.decode(errors="replace")
        raise HarnessFailedError(returncode, tail or "no output on stderr")
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise HarnessFailedError(returncode, "its last line of output is not a JSON object")
    return value
