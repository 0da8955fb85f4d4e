"""The processes of ``turnpoint bench-heal``: the participant guide's counter fleet.

A fleet is one counter resources server (``tools``, environment ``counter``) and agents
that count with it (:class:`~turnpoint.apps.examples.guide_agent.CounterAgent`, a turn
every ``turn_delay_s``). 64 participants cannot be 64 processes on a 2-core machine, so
a process hosts a share of them, each on ``127.0.0.1:0``, and prints one line per
participant as ``turnpoint serve`` does (``turnpoint: serving <kind> <instance> on
<host:port>``): the one SIGKILLed agent lives alone in its own process, which
:class:`~turnpoint.trainer.LocalProcessLauncher` starts and replaces by that line.

A process runs until SIGTERM/SIGINT or until its parent is gone (a launcher gives it no
stdin to watch), so a bench that dies leaves no fleet behind. :class:`FleetProcess` is
the driver's handle on a process hosting many.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from turnpoint.auth import TOKEN_ENV

_MODULE: Final = "turnpoint.apps.bench._heal_fleet"
HOST: Final = "127.0.0.1"
TOOLS: Final = "tools"
ENVIRONMENT: Final = "counter"
_PARENT_POLL_S: Final = 0.5
_STOP_TIMEOUT_S: Final = 10.0
_SERVING: Final = re.compile(
    r"^turnpoint: serving (?P<kind>\S+) (?P<instance>\S+) on (?P<address>\S+)$"
)


def fleet_job(
    root: Path,
    agents: Sequence[str],
    *,
    turn_delay_s: float,
    tools_address: str | None = None,
) -> dict[str, Any]:
    """A process's share: the ``tools`` server too when ``tools_address`` is None."""
    return {
        "root": str(root),
        "agents": list(agents),
        "turn_delay_s": turn_delay_s,
        "tools_address": tools_address,
    }


def fleet_argv(job: Mapping[str, Any]) -> list[str]:
    """The command of a fleet process (the token goes in ``$TURNPOINT_TOKEN``)."""
    return [sys.executable, "-m", _MODULE, json.dumps(dict(job))]


def fleet_env(token: str) -> dict[str, str]:
    """The environment of a fleet process: this one's, the token, and this import path
    (so that a worktree run starts its own code, not an installed copy)."""
    env = {"GRPC_VERBOSITY": "ERROR", **os.environ, TOKEN_ENV: token}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


# ----------------------------------------------------------------- fleet process


async def _serve(job: Mapping[str, Any], token: str) -> None:
    # Imported here: the driver imports this module for its handle only.
    from turnpoint.apps.examples.guide_agent import CounterAgent
    from turnpoint.apps.examples.guide_resources import CounterTools
    from turnpoint.participant_sdk import ParticipantRuntime, RuntimeConfig, SnapshotStore
    from turnpoint.server import HostedParticipant, ServerOptions, host_participant

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    root = Path(job["root"])
    config = RuntimeConfig(default_lease_s=60.0, restore_running=True)
    hosted: list[HostedParticipant] = []

    async def host(runtime: ParticipantRuntime, kind: str) -> HostedParticipant:
        served = host_participant(runtime, ServerOptions(host=HOST, port=0, token=token))
        await served.start()
        hosted.append(served)
        print(f"turnpoint: serving {kind} {runtime.instance_name} on {served.address}", flush=True)
        return served

    try:
        tools_address = job.get("tools_address")
        if tools_address is None:
            tools = ParticipantRuntime(
                TOOLS, SnapshotStore(root), resources=CounterTools(), config=config
            )
            tools_address = (await host(tools, "resources")).address
        for name in job["agents"]:
            agent = CounterAgent(tools_address, token, turn_delay_s=float(job["turn_delay_s"]))
            runtime = ParticipantRuntime(name, SnapshotStore(root), agent=agent, config=config)
            served = host_participant(runtime, ServerOptions(host=HOST, port=0, token=token))
            served.on_close.append(agent.aclose)
            await served.start()
            hosted.append(served)
            print(f"turnpoint: serving agent {name} on {served.address}", flush=True)
        parent = os.getppid()
        while not stop.is_set() and os.getppid() == parent:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _PARENT_POLL_S)
    finally:
        for served in reversed(hosted):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(served.stop(0), _STOP_TIMEOUT_S)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(f"usage: python -m {_MODULE} JOB_JSON", file=sys.stderr)
        return 2
    from turnpoint.auth import load_token

    token = load_token()
    if token is None:
        print(f"bench-heal fleet: no token in ${TOKEN_ENV}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(_serve(json.loads(args[0]), token))
    return 0


# ----------------------------------------------------------------- driver's handle


class HealBenchError(RuntimeError):
    """The heal-in-place figure could not be measured (a snapshot failed, a fleet
    process did not serve, a wait ran out)."""


class FleetError(HealBenchError):
    """A fleet process failed to serve in time."""


class FleetProcess:
    """A process hosting ``instances``: :meth:`start` returns their addresses once each
    serves; :meth:`kill` SIGKILLs it, as a crash would."""

    def __init__(self, job: Mapping[str, Any], instances: Sequence[str], token: str) -> None:
        self._argv = fleet_argv(job)
        self._instances = tuple(instances)
        self._token = token
        self._process: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float) -> dict[str, str]:
        process = self._process = await asyncio.create_subprocess_exec(
            *self._argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=fleet_env(self._token),
        )
        stdout = process.stdout
        assert stdout is not None
        addresses: dict[str, str] = {}
        try:
            async with asyncio.timeout(timeout_s):
                while len(addresses) < len(self._instances):
                    line = await stdout.readline()
                    if not line:
                        code = await process.wait()
                        raise FleetError(f"a fleet process exited with {code} before serving")
                    found = _SERVING.match(line.decode("utf-8", "replace").strip())
                    if found and found["instance"] in self._instances:
                        addresses[found["instance"]] = found["address"]
        except TimeoutError:
            await self.kill()
            raise FleetError(f"a fleet process did not serve within {timeout_s:g} s") from None
        except BaseException:
            await self.kill()
            raise
        self._drain = asyncio.create_task(_drain(stdout))
        return addresses

    async def kill(self) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        if process is not None:
            await process.wait()
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
            self._drain = None


async def _drain(stdout: asyncio.StreamReader) -> None:
    while await stdout.readline():
        pass


if __name__ == "__main__":
    sys.exit(main())
