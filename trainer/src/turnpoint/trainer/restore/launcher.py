"""Who starts a replacement for a lost participant (docs/spec.md section 7.15).

The job supplies a :class:`Launcher`; the coordinator asks it for a replacement under
the lost instance's name and heals in place. :class:`LocalProcessLauncher` runs each
participant as a local process, as the demo's supervisor does: a command per instance
that prints the reference server's serving line (``turnpoint: serving <kind> <instance>
on <host:port>``, what ``turnpoint serve`` prints) once it takes calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

from turnpoint.errors import Reason
from turnpoint.trainer.errors import CoordinatorError

_SERVING: Final = re.compile(
    r"^turnpoint: serving (?P<kind>\S+) (?P<instance>\S+) on (?P<address>\S+)$"
)


class Launcher(Protocol):
    """Starts a replacement for a lost participant."""

    async def replace(self, instance: str) -> str:
        """End what is left of ``instance`` (a paused process must never come back
        beside its replacement), start a fresh participant under the same name and
        return its control address once it serves. Raises :class:`LaunchError` when it
        cannot."""
        ...


class LaunchError(CoordinatorError):
    """A replacement could not be started (``instance``, why in the message)."""

    def __init__(self, instance: str, detail: str) -> None:
        super().__init__(
            Reason.UNAVAILABLE,
            f"starting a replacement for {instance} failed: {detail}",
            {"participant": instance},
        )
        self.instance = instance
        self.detail = detail

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.instance, self.detail))


class LocalProcessLauncher:
    """Each participant a local process: ``commands[instance]`` is its argv.

    :meth:`start` starts one (a job's first start); :meth:`replace` SIGKILLs the one it
    started, if it still runs, and starts the command again. ``env`` replaces the
    environment of the children (the token goes there, never on the command line);
    ``start_timeout_s`` bounds the wait for the serving line. :meth:`aclose` kills
    every child still running.
    """

    def __init__(
        self,
        commands: Mapping[str, Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        self._commands = {name: tuple(argv) for name, argv in commands.items()}
        self._env = dict(env) if env is not None else None
        self._start_timeout_s = start_timeout_s
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._drains: dict[str, asyncio.Task[None]] = {}
        self.started: dict[str, int] = {}

    def pid(self, instance: str) -> int | None:
        process = self._processes.get(instance)
        return None if process is None else process.pid

    async def start(self, instance: str) -> str:
        """Start ``instance`` and return its control address once it serves."""
        argv = self._commands.get(instance)
        if argv is None:
            raise LaunchError(instance, "no command is given for it")
        if instance in self._processes and self._processes[instance].returncode is None:
            raise LaunchError(instance, "it is already running")
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=self._env if self._env is not None else dict(os.environ),
        )
        self._processes[instance] = process
        try:
            address = await asyncio.wait_for(
                _serving_address(process, instance), self._start_timeout_s
            )
        except TimeoutError:
            await _kill(process)
            raise LaunchError(
                instance, f"no serving line within {self._start_timeout_s:g}s"
            ) from None
        except BaseException:
            await _kill(process)
            raise
        if address is None:
            raise LaunchError(instance, f"it exited with status {await process.wait()}")
        # Keep reading stdout so that a chatty child never blocks on a full pipe.
        self._drains[instance] = asyncio.create_task(_drain(process))
        self.started[instance] = self.started.get(instance, 0) + 1
        return address

    async def replace(self, instance: str) -> str:
        await self._end(instance)
        return await self.start(instance)

    async def kill(self, instance: str) -> None:
        """SIGKILL ``instance`` (a crash, for tests and chaos)."""
        await self._end(instance)

    async def _end(self, instance: str) -> None:
        process = self._processes.pop(instance, None)
        if process is not None:
            await _kill(process)
        drain = self._drains.pop(instance, None)
        if drain is not None:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain

    async def aclose(self) -> None:
        for instance in list(self._processes):
            await self._end(instance)


async def _serving_address(process: asyncio.subprocess.Process, instance: str) -> str | None:
    stdout = process.stdout
    if stdout is None:
        return None
    while line := await stdout.readline():
        match = _SERVING.match(line.decode("utf-8", "replace").strip())
        if match and match["instance"] == instance:
            return match["address"]
    return None


async def _drain(process: asyncio.subprocess.Process) -> None:
    stdout = process.stdout
    if stdout is not None:
        while await stdout.readline():
            pass


async def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.kill()
    await process.wait()
