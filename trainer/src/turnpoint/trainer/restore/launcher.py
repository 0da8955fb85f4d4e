"""Who starts a replacement for a lost participant (docs/spec.md section 7.15).

The job supplies a :class:`Launcher`; the coordinator asks it for a replacement under
the lost instance's name and heals in place. :class:`LocalProcessLauncher` runs each
participant as a local process, as the demo's supervisor does: a command per instance
that prints the reference server's serving line (``turnpoint: serving <kind> <instance>
on <host:port>``, what ``turnpoint serve`` prints) once it takes calls.
:class:`StableAddressLauncher` starts nothing: another supervisor (a worker group's
parent, kubelet for a pod behind a stable address) restarts the participant where it
was, and the launcher waits until that address answers as a new incarnation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

import grpc

from turnpoint.errors import Reason, TurnpointError
from turnpoint.trainer.control.client import ParticipantControlClient
from turnpoint.trainer.control.failures import ControlCallError
from turnpoint.trainer.control.topology import group_workers
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.v1 import checkpoint_control_service_pb2 as pb

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


class StableAddressLauncher:
    """Participants that their own supervisor restarts at the same address.

    A worker of ``turnpoint serve --workers`` that dies is restarted by the group's
    parent on its own reserved port (docs/spec.md section 3.9 item 5); a pod behind a
    stable address is restarted by kubelet. This launcher starts and ends nothing:
    :meth:`replace` waits, at most ``timeout_s``, until the instance's address answers
    ``Describe`` under its name as an incarnation other than the one last seen there,
    and returns that address. ``addresses`` maps each instance to its control address; a
    worker group may be given by its name and shared address, as to the coordinator:
    :meth:`learn` replaces it by its workers. Call :meth:`learn` before the job's
    :class:`~turnpoint.trainer.Checkpointing` opens, so that the incarnation it holds is
    the one the coordinator discovers, or an older one (a worker restarted in between is
    fresh, and its heal is never asked for).

    What it cannot do: end a participant that is paused or hung (no supervisor restarts
    it); :meth:`replace` then times out with :class:`LaunchError` and the job restarts.
    """

    def __init__(
        self,
        addresses: Mapping[str, str],
        *,
        token: str,
        channel_credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = 60.0,
        poll_interval_s: float = 0.25,
        call_timeout_s: float = 5.0,
    ) -> None:
        if timeout_s <= 0 or poll_interval_s <= 0 or call_timeout_s <= 0:
            raise ValueError("timeout_s, poll_interval_s and call_timeout_s must be > 0")
        self._given = dict(addresses)
        self._token = token
        self._credentials = channel_credentials
        self._timeout_s = timeout_s
        self._poll_interval_s = poll_interval_s
        self._call_timeout_s = call_timeout_s
        # instance -> (its address, the incarnation last seen there)
        self._seen: dict[str, tuple[str, str]] = {}
        self.replaced: dict[str, int] = {}

    @property
    def addresses(self) -> Mapping[str, str]:
        """Each learned instance's address (worker groups by their workers)."""
        return {name: address for name, (address, _) in sorted(self._seen.items())}

    def incarnation(self, instance: str) -> str | None:
        """The incarnation last seen at ``instance``'s address, None if never learned."""
        seen = self._seen.get(instance)
        return None if seen is None else seen[1]

    async def learn(self) -> Mapping[str, str]:
        """Describe every given address and remember who answered there (a worker group:
        each worker, at its own address); returns :attr:`addresses`. Raises
        :class:`LaunchError` for an address that does not answer as its instance."""
        for name, address in sorted(self._given.items()):
            response = await self._describe(name, address)
            if response is None:
                raise LaunchError(name, f"{address} does not answer Describe")
            try:
                workers = group_workers(name, response)
            except ControlCallError as error:
                raise LaunchError(name, str(error)) from error
            if workers is None:
                self._seen[name] = (address, response.header.incarnation)
                continue
            for worker, own in sorted(workers.items()):
                answer = await self._describe(worker, own)
                if answer is None:
                    raise LaunchError(worker, f"{own} does not answer Describe")
                self._seen[worker] = (own, answer.header.incarnation)
        return self.addresses

    async def replace(self, instance: str) -> str:
        seen = self._seen.get(instance)
        if seen is None:
            raise LaunchError(instance, "its address was never learned (call learn() first)")
        address, old = seen
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise LaunchError(
                    instance,
                    f"{address} did not answer as a new incarnation within "
                    f"{self._timeout_s:g}s (nothing restarted it there)",
                )
            response = await self._describe(instance, address, min(self._call_timeout_s, left))
            if response is not None and response.header.incarnation not in ("", old):
                self._seen[instance] = (address, response.header.incarnation)
                self.replaced[instance] = self.replaced.get(instance, 0) + 1
                return address
            await asyncio.sleep(min(self._poll_interval_s, max(0.0, deadline - loop.time())))

    async def _describe(
        self, instance: str, address: str, timeout_s: float | None = None
    ) -> pb.DescribeResponse | None:
        """``Describe`` on a connection of its own; None while nobody answers there as
        ``instance`` (down, restarting, or a malformed reply). A verdict (say, the token
        is refused) is :class:`LaunchError` at once: waiting would not change it."""
        client = ParticipantControlClient(
            address,
            token=self._token,
            participant_name=instance,
            channel_credentials=self._credentials,
        )
        try:
            return await client.call(pb.DescribeRequest(), timeout_s or self._call_timeout_s)
        except ControlCallError:
            return None
        except TurnpointError as error:
            raise LaunchError(instance, f"{address} refused Describe: {error}") from error
        finally:
            await client.close()


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
