"""The coding environment (``coding``): each episode a tiny program to fix, in a sandbox.

Built on :class:`turnpoint.participant_sdk.sandboxes.SandboxResourcesServer`: the
session is the sandbox's tree, snapshotted at every cut and restored into a new
generation. Each episode gets ``solution.py`` (with a bug) and ``check.py`` (one visible
check); the hidden test never enters the tree: the verifier pipes it into ``python3``
inside the sandbox. Tools:

- ``write_file`` ``{"path", "content"}``: create or replace a file in the sandbox;
- ``run`` ``{"argv": [...]}``: run a command there, bounded in time and output;
- ``run_tests`` ``{}``: run the visible check.

Commands run with ``-B`` where they are Python, so a run or a verify leaves no bytecode
in the tree: the tree changes only by what the agent does.

At a cut the resources server may be one call ahead of the agent, so a continued attempt
sends the last call again: the agent's calls are keyed (``ctx.call``) and the SDK answers
a key the session's reply record holds without running the command again (docs/spec.md
section 6.12), as for the other exported environments (:mod:`._environments`).

For the demo's audit the server logs (to its verifier log) every tool execution
(:class:`._participants.ToolExecutions`; the turn is the call's ``turn`` argument), the
executions each session had applied when it was scored, and for every restored session
the tree digest its snapshot recorded at the cut beside the digest of the tree the
restore made.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Final

from turnpoint.apps.examples._coding_tasks import BY_NAME, CHECK, SOLUTION, task_of
from turnpoint.apps.examples._environments import call_turn
from turnpoint.apps.examples._participants import ToolExecutions, VerifierLog
from turnpoint.apps.examples._plays import reply_text
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import ParticipantError, Verdict, VerifyMode
from turnpoint.participant_sdk.sandboxes import (
    CommandCutError,
    ExecResult,
    InFlight,
    Isolation,
    LocalSandboxProvider,
    SandboxProvider,
    SandboxResourcesServer,
    SandboxSession,
    SavedSession,
)

CODING: Final = "coding"
COMMAND_SECONDS: Final = 20.0
_MAX_ARGS: Final = 64
_MAX_FILE_BYTES: Final = 64 << 10
_REPLY_CHARS: Final = 4000
_DATA_FIELDS: Final = frozenset({"task", "executions"})
TOOLS: Final = ("write_file", "run", "run_tests")


@contextlib.contextmanager
def _bad_input(what: str) -> Iterator[None]:
    """The caller's data did not fit the environment: INVALID_ARGUMENT, not a crash."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as error:
        raise ParticipantError(
            Reason.INVALID_ARGUMENT,
            f"{what} does not fit the coding environment: {error}",
            {"field": what},
        ) from None


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")[-_REPLY_CHARS:]


def _ran(result: ExecResult) -> dict[str, Any]:
    return {
        "exit_code": result.exit_code,
        "stdout": _text(result.stdout),
        "stderr": _text(result.stderr),
        "timed_out": result.timed_out,
    }


class CodingTools(SandboxResourcesServer):
    """Fix ``solution.py`` so that the hidden test passes (the module docstring)."""

    verify_mode: ClassVar[VerifyMode] = VerifyMode.WAIT
    environment: ClassVar[str] = CODING

    def __init__(
        self,
        open_provider: Callable[[], Awaitable[SandboxProvider]],
        name: str = CODING,
        log: VerifierLog | None = None,
        *,
        in_flight: InFlight = InFlight.WAIT,
    ) -> None:
        super().__init__(open_provider, in_flight=in_flight)
        self.name, self.log = name, log or VerifierLog(None)
        self.executions = ToolExecutions(name, self.log)
        # The log is written in threads, one line at a time (execution ids count up).
        self._logging = asyncio.Lock()

    @classmethod
    def on_disk(
        cls,
        sandbox_root: Path,
        name: str = CODING,
        log: VerifierLog | None = None,
        *,
        isolation: Isolation | None = None,
        in_flight: InFlight = InFlight.WAIT,
    ) -> CodingTools:
        """Sandboxes and their snapshots under ``sandbox_root`` (the local provider), its
        commands under ``isolation`` (None: the strongest this machine has)."""

        def open_provider() -> Awaitable[SandboxProvider]:
            return LocalSandboxProvider.open(sandbox_root, isolation=isolation)

        return cls(open_provider, name, log, in_flight=in_flight)

    def check_data(self, data: Mapping[str, Any]) -> None:
        if set(data) != _DATA_FIELDS or data["task"] not in BY_NAME:
            raise ValueError(f"a coding session's data holds exactly {sorted(_DATA_FIELDS)}")
        executions = data["executions"]
        if not isinstance(executions, list) or not all(isinstance(e, str) for e in executions):
            raise ValueError("a coding session's executions are a list of execution ids")

    async def set_up(self, session: SandboxSession, task: Mapping[str, Any]) -> None:
        with _bad_input("task"):
            chosen = task_of(task)
        provider = await self.provider()
        await provider.write_file(session.sandbox, SOLUTION, chosen.source.encode())
        await provider.write_file(session.sandbox, CHECK, chosen.check.encode())
        session.data.update(task=chosen.name, executions=[])

    async def tool(
        self, session: SandboxSession, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        # One call at a time per session: each changes its tree and extends its executions.
        async with session.lock:
            return await self._tool(session, tool, arguments)

    async def _tool(
        self, session: SandboxSession, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        data = session.data
        with _bad_input("arguments"):
            if tool not in TOOLS:
                raise ValueError(f"no tool {tool!r}; tools: {', '.join(TOOLS)}")
            argv = _argv(arguments) if tool == "run" else []
            written = _written(arguments) if tool == "write_file" else ("", b"")
            turn = call_turn(arguments, len(data["executions"]))
        # Not idempotent (a command appends, a write replaces): the SDK's reply record
        # answers a re-sent key, so this runs once per key.
        reply = await self._apply(session, tool, argv, written)
        async with self._logging:
            execution = await asyncio.to_thread(
                self.executions.applied, session.episode, turn, reply_text(reply), tool=tool
            )
        data["executions"] = [*data["executions"], execution]
        return reply

    async def _apply(
        self, session: SandboxSession, tool: str, argv: list[str], written: tuple[str, bytes]
    ) -> Mapping[str, Any]:
        try:
            if tool == "write_file":
                path, content = written
                await (await self.provider()).write_file(session.sandbox, path, content)
                return {"written": path, "bytes": len(content)}
            if tool == "run":
                return _ran(await self.run(session, argv, timeout_seconds=COMMAND_SECONDS))
            result = await self.run(
                session, ["python3", "-B", CHECK], timeout_seconds=COMMAND_SECONDS
            )
            return {"passed": result.exit_code == 0, **_ran(result)}
        except CommandCutError:
            # InFlight.CUT: the checkpoint killed it; what it did is in the tree.
            return {"cut": True}

    async def score(self, session: SandboxSession, answer: Mapping[str, Any]) -> Verdict:
        chosen = BY_NAME[session.data["task"]]
        result = await self.run(
            session,
            ["python3", "-B", "-"],
            timeout_seconds=COMMAND_SECONDS,
            stdin=chosen.hidden_test.encode(),
        )
        verdict = Verdict(
            1.0 if result.exit_code == 0 else 0.0,
            {"task": chosen.name, "exit_code": result.exit_code},
        )
        await asyncio.to_thread(
            self.log.write,
            verifier=self.name,
            rollout_id=session.episode.rollout_id,
            attempt=session.episode.attempt,
            reward=verdict.reward,
            executions=list(session.data["executions"]),
        )
        return verdict

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        await super().restore_session(saved, episode, state)
        # The demo's sandbox audit: the tree the restore made, measured, against the
        # digest its snapshot recorded at the cut.
        restored = await self.checkpoint(self.session(episode))
        # And what it did with the processes: restart-only, and why (CRIU tried).
        isolation = (await self.provider()).isolation
        await asyncio.to_thread(
            self.log.write,
            sandbox=restored.sandbox_id,
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            generation=restored.generation,
            cut_digest=SavedSession.from_json(state).handle.tree_digest,
            restored_digest=restored.tree_digest,
            processes=f"{isolation.processes.value} ({isolation.processes_why})",
        )


def _argv(arguments: Mapping[str, Any]) -> list[str]:
    argv = arguments["argv"]
    if (
        not isinstance(argv, list)
        or not 0 < len(argv) <= _MAX_ARGS
        or not all(isinstance(a, str) for a in argv)
    ):
        raise ValueError(f"argv must be 1 to {_MAX_ARGS} strings")
    return argv


def _written(arguments: Mapping[str, Any]) -> tuple[str, bytes]:
    path, content = arguments["path"], arguments["content"]
    if not isinstance(path, str) or not isinstance(content, str):
        raise ValueError("path and content must be strings")
    data = content.encode("utf-8")
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"a file holds at most {_MAX_FILE_BYTES} bytes")
    return path, data
