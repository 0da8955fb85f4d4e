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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from turnpoint.apps.examples._participants import VerifierLog
from turnpoint.errors import Reason
from turnpoint.participant_sdk import ParticipantError, Verdict, VerifyMode
from turnpoint.participant_sdk.sandboxes import (
    CommandCutError,
    ExecResult,
    InFlight,
    LocalSandboxProvider,
    SandboxProvider,
    SandboxResourcesServer,
    SandboxSession,
)

CODING: Final = "coding"
SOLUTION: Final = "solution.py"
CHECK: Final = "check.py"
COMMAND_SECONDS: Final = 20.0
_MAX_ARGS: Final = 64
_MAX_FILE_BYTES: Final = 64 << 10
_REPLY_CHARS: Final = 4000


@dataclass(frozen=True)
class CodingTask:
    """A program with a bug, a visible check and the hidden test that scores it."""

    name: str
    source: str
    check: str
    hidden_test: str
    fixed: str  # a correct solution: what a perfect agent writes


TASKS: Final = (
    CodingTask(
        "add",
        "def add(a, b):\n    return a - b\n",
        "from solution import add\nassert add(1, 1) == 2, add(1, 1)\nprint('ok')\n",
        "from solution import add\nassert add(2, 3) == 5\nassert add(-4, 4) == 0\n",
        "def add(a, b):\n    return a + b\n",
    ),
    CodingTask(
        "maximum",
        "def maximum(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n"
        "            best = x\n    return best\n",
        "from solution import maximum\nassert maximum([1, 3, 2]) == 3\nprint('ok')\n",
        "from solution import maximum\nassert maximum([-3, -1, -2]) == -1\n"
        "assert maximum([5]) == 5\n",
        "def maximum(xs):\n    return max(xs)\n",
    ),
    CodingTask(
        "reverse_words",
        "def reverse_words(text):\n    return text[::-1]\n",
        "from solution import reverse_words\nassert reverse_words('a') == 'a'\nprint('ok')\n",
        "from solution import reverse_words\nassert reverse_words('ab cd') == 'cd ab'\n"
        "assert reverse_words('one two three') == 'three two one'\n",
        "def reverse_words(text):\n    return ' '.join(reversed(text.split(' ')))\n",
    ),
)
_BY_NAME: Final = {task.name: task for task in TASKS}


def task_of(task: Mapping[str, Any]) -> CodingTask:
    """The task an episode's ``{"seed": n}`` (or ``{"task": name}``) names."""
    if "task" in task:
        return _BY_NAME[str(task["task"])]
    seed = task["seed"]
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return TASKS[seed % len(TASKS)]


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

    @classmethod
    def on_disk(
        cls, sandbox_root: Path, name: str = CODING, log: VerifierLog | None = None
    ) -> CodingTools:
        """Sandboxes and their snapshots under ``sandbox_root`` (the local provider)."""
        return cls(lambda: LocalSandboxProvider.open(sandbox_root), name, log)

    def check_data(self, data: Mapping[str, Any]) -> None:
        if set(data) != {"task"} or data["task"] not in _BY_NAME:
            raise ValueError("a coding session's data names one known task")

    async def set_up(self, session: SandboxSession, task: Mapping[str, Any]) -> None:
        with _bad_input("task"):
            chosen = task_of(task)
        provider = await self.provider()
        await provider.write_file(session.sandbox, SOLUTION, chosen.source.encode())
        await provider.write_file(session.sandbox, CHECK, chosen.check.encode())
        session.data["task"] = chosen.name

    async def tool(
        self, session: SandboxSession, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        try:
            if tool == "write_file":
                return await self._write_file(session, arguments)
            if tool == "run":
                with _bad_input("argv"):
                    argv = arguments["argv"]
                    if (
                        not isinstance(argv, list)
                        or not 0 < len(argv) <= _MAX_ARGS
                        or not all(isinstance(a, str) for a in argv)
                    ):
                        raise ValueError(f"argv must be 1 to {_MAX_ARGS} strings")
                return _ran(await self.run(session, argv, timeout_seconds=COMMAND_SECONDS))
            if tool == "run_tests":
                result = await self.run(
                    session, ["python3", "-B", CHECK], timeout_seconds=COMMAND_SECONDS
                )
                return {"passed": result.exit_code == 0, **_ran(result)}
        except CommandCutError:
            # InFlight.CUT: the checkpoint killed it; what it did is in the tree.
            return {"cut": True}
        raise ParticipantError(
            Reason.INVALID_ARGUMENT,
            f"the coding environment has no tool {tool!r} (write_file, run, run_tests)",
            {"tool": tool},
        )

    async def _write_file(
        self, session: SandboxSession, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        with _bad_input("write_file"):
            path, content = arguments["path"], arguments["content"]
            if not isinstance(path, str) or not isinstance(content, str):
                raise ValueError("path and content must be strings")
            data = content.encode("utf-8")
            if len(data) > _MAX_FILE_BYTES:
                raise ValueError(f"a file holds at most {_MAX_FILE_BYTES} bytes")
        provider = await self.provider()
        await provider.write_file(session.sandbox, path, data)
        return {"written": path, "bytes": len(data)}

    async def score(self, session: SandboxSession, answer: Mapping[str, Any]) -> Verdict:
        chosen = _BY_NAME[session.data["task"]]
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
        )
        return verdict
