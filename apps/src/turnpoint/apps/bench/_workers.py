"""Worker processes of ``turnpoint bench``: many servers per process, ports over stdout.

256 participants cannot be 256 processes on a 2-core machine, so each worker hosts its
share of the servers in its own asyncio loop, on ``127.0.0.1:0``:

- ``fleet``: real participants (a :class:`ParticipantRuntime` of the RESOURCES kind
  with no sessions, its own :class:`SnapshotStore` under the shared root, served by
  :func:`~turnpoint.server.host_participant` with token auth), plus the same number of
  no-op bidi echo servers and no-op aiohttp JSON servers (the baselines);
- ``topology``: the example Gym servers of the demo workload (policy, per-sibling tools,
  group-scored tools and the agents), as ``turnpoint serve`` would host them; it
  reports them in the shape of the demo's ``topology.json`` participant entries.

The driver passes the job as one JSON argument and the bearer token in
``$TURNPOINT_TOKEN`` (never on the command line). A worker prints one JSON line with
its ports once every server is serving, then runs until its stdin closes (the driver
stops it, or died) or it gets SIGTERM/SIGINT. A fleet with parked episodes takes a turn
on every one of them when a ``turn`` line comes on its stdin (each seals a new boundary
with new state and parks again) and prints ``{"turned": N}`` once all are parked again
(:meth:`WorkerProcess.take_turn`). A job with ``count_fsyncs`` counts every
``os.fsync`` the worker makes (:func:`counting_fsyncs`) and prints a last JSON line,
``{"fsyncs": N}``, once its servers are stopped. :class:`WorkerProcess` is the driver's
handle: it bounds every wait and kills a worker that does not stop in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from turnpoint.apps._heap import freeze_start_up_heap
from turnpoint.apps.bench._baselines import start_echo_server, start_http_server
from turnpoint.apps.examples._build import ExampleSpec, build_example
from turnpoint.auth import TOKEN_ENV, load_token
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    Agent,
    EpisodeContext,
    ParticipantRuntime,
    ResourcesServer,
    SnapshotStore,
    Verdict,
)
from turnpoint.protocol import EpisodeState
from turnpoint.server import HostedParticipant, ServerOptions, host_participant

_LOG = logging.getLogger(__name__)

HOST: Final = "127.0.0.1"
_STOP_TIMEOUT_S: Final = 15.0
_MODULE: Final = "turnpoint.apps.bench._workers"
_PARK_TIMEOUT_S: Final = 120.0


class FsyncCount:
    """How many ``os.fsync`` calls this process made since :func:`counting_fsyncs` began."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def _add(self) -> None:
        with self._lock:  # fsyncs come from many writer threads at once
            self._value += 1

    @property
    def value(self) -> int:
        with self._lock:
            return self._value


@contextlib.contextmanager
def counting_fsyncs() -> Iterator[FsyncCount]:
    """Count every ``os.fsync`` of this process (files and directories alike) meanwhile.

    Every durable write of turnpoint (:mod:`turnpoint._files`, the participant store)
    calls ``os.fsync`` through the module attribute, so wrapping it sees them all.
    """
    count = FsyncCount()
    original = os.fsync

    def fsync(fd: Any) -> None:
        count._add()
        original(fd)

    os.fsync = fsync
    try:
        yield count
    finally:
        os.fsync = original


class NoopResources(ResourcesServer):
    """A resources server with nothing to hold: every checkpoint finds it ready at once
    and its commit writes an empty record set. Data calls are never made by the bench."""

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        return None

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        return {}

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        return Verdict(0.0)

    async def close(self, episode: EpisodeId) -> None:
        return None


class ParkedStateAgent(Agent):
    """An agent whose every episode seals a boundary with ``task["state_bytes"]``
    characters of incompressible state (hex of random bytes, made here so that the
    task itself stays small) and then waits on a model call: parked at its boundary,
    holding that state for every snapshot to export. The call returns only when the
    worker makes every episode take a turn (:meth:`take_turn`): each then seals its next
    boundary with new state and waits again."""

    def __init__(self) -> None:
        self._turn: asyncio.Future[None] | None = None
        self.sealed = 0  # boundaries sealed, all episodes together

    async def _wait_for_turn(self) -> None:
        if self._turn is None or self._turn.done():
            self._turn = asyncio.get_running_loop().create_future()
        await self._turn

    def take_turn(self) -> None:
        """Answer every episode's model call: each seals its next boundary."""
        if self._turn is not None and not self._turn.done():
            self._turn.set_result(None)

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        size = int(task["state_bytes"])
        for turn in itertools.count():
            await ctx.boundary(turn, {"state": os.urandom((size + 1) // 2).hex()[:size]})
            self.sealed += 1
            await ctx.model_call(self._wait_for_turn)
        return {}


def parked_episodes(instance: str, parked: int) -> list[EpisodeId]:
    """The episodes a fleet participant with ``parked`` episodes holds."""
    return [EpisodeId(f"{instance}-e{k:05d}", 0) for k in range(parked)]


def fleet_job(
    root: Path,
    participants: Sequence[str],
    baselines: int,
    *,
    count_fsyncs: bool = False,
    parked: int = 0,
    state_bytes: int = 0,
) -> dict[str, Any]:
    """The job of a fleet worker: these participant instances and ``baselines`` servers
    of each baseline kind; with ``count_fsyncs``, report the fsyncs made on exit. With
    ``parked``, each participant is an agent holding that many episodes parked at a
    boundary with ``state_bytes`` of state each (:class:`ParkedStateAgent`)."""
    return {
        "mode": "fleet",
        "root": str(root),
        "participants": list(participants),
        "baselines": baselines,
        "count_fsyncs": count_fsyncs,
        "parked": parked,
        "state_bytes": state_bytes,
    }


def topology_job(
    root: Path, agents: int, group_size: int, seed: int = 0, turn_delay_s: float = 0.0
) -> dict[str, Any]:
    """The job of a topology worker: the example Gym servers of the demo workload, each
    agent turn waiting ``turn_delay_s`` in its model call (a real model's latency)."""
    return {
        "mode": "topology",
        "root": str(root),
        "agents": agents,
        "group_size": group_size,
        "seed": seed,
        "turn_delay_s": turn_delay_s,
    }


# ----------------------------------------------------------------- worker process


Closer = Callable[[], Awaitable[None]]


TakeTurn = Callable[[], Awaitable[int]]


async def _host_fleet(
    job: Mapping[str, Any], token: str
) -> tuple[dict[str, Any], list[Closer], TakeTurn | None]:
    root = Path(job["root"])
    closers: list[Closer] = []
    participants: dict[str, int] = {}

    parked = int(job.get("parked", 0))
    state_bytes = int(job.get("state_bytes", 0))
    agents: dict[str, ParkedStateAgent] = {}

    async def participant(instance: str) -> HostedParticipant:
        if parked:
            agent = agents[instance] = ParkedStateAgent()
            runtime = ParticipantRuntime(instance, SnapshotStore(root), agent=agent)
        else:
            runtime = ParticipantRuntime(instance, SnapshotStore(root), resources=NoopResources())
        return await host_participant(
            runtime, ServerOptions(host=HOST, port=0, token=token)
        ).start()

    async def settle(runtime: ParticipantRuntime, sealed: int) -> None:
        """Until every episode sealed ``sealed`` boundaries in all and parked again."""
        agent = agents[runtime.instance_name]
        settled = await runtime.wait_until(
            lambda core: (
                agent.sealed >= sealed
                and core.ready
                and core.recount()[1].get(EpisodeState.AWAITING_MODEL) == parked
            ),
            _PARK_TIMEOUT_S,
        )
        if not settled:
            raise RuntimeError(f"{runtime.instance_name}: the episodes never parked")

    async def park(runtime: ParticipantRuntime) -> None:
        for episode in parked_episodes(runtime.instance_name, parked):
            stream = await runtime.accept_run(episode, {"state_bytes": state_bytes})
            closers.append(stream.aclose)
        await settle(runtime, parked)

    hosted = await asyncio.gather(*(participant(name) for name in job["participants"]))

    async def take_turn() -> int:
        targets = []
        for item in hosted:
            agent = agents[item.runtime.instance_name]
            targets.append(agent.sealed + parked)
            agent.take_turn()
        await asyncio.gather(
            *(settle(item.runtime, target) for item, target in zip(hosted, targets, strict=True))
        )
        return parked * len(hosted)

    if parked:
        await asyncio.gather(*(park(item.runtime) for item in hosted))
    for item in hosted:
        participants[item.runtime.instance_name] = item.port
        closers.append(functools.partial(item.stop, 0))
    echo_ports: list[int] = []
    http_ports: list[int] = []
    for _ in range(int(job["baselines"])):
        echo, echo_port = await start_echo_server(HOST)
        closers.append(functools.partial(echo.stop, 0))
        echo_ports.append(echo_port)
        runner, http_port = await start_http_server(HOST)
        closers.append(runner.cleanup)
        http_ports.append(http_port)
    report = {"participants": participants, "echo": echo_ports, "http": http_ports}
    return report, closers, take_turn if parked else None


async def _host_topology(
    job: Mapping[str, Any], token: str
) -> tuple[dict[str, Any], list[Closer], TakeTurn | None]:
    root = Path(job["root"])
    closers: list[Closer] = []
    participants: list[dict[str, Any]] = []

    async def host(kind: str, example: str, spec: ExampleSpec) -> HostedParticipant:
        runtime, extra = build_example(kind, example, spec)
        hosted = host_participant(runtime, ServerOptions(host=HOST, port=0, token=token))
        hosted.on_close.extend(extra)
        await hosted.start()
        closers.append(functools.partial(hosted.stop, 0))
        # The shape of the demo's topology.json entries (server/demo/_supervisor.py).
        participants.append(
            {
                "instance": spec.instance,
                "kind": kind,
                "address": hosted.address,
                "environment": example if kind == "resources" else None,
            }
        )
        return hosted

    def spec(instance: str, **extra: Any) -> ExampleSpec:
        return ExampleSpec(
            instance=instance,
            root=root,
            token=token,
            group_size=int(job["group_size"]),
            seed=int(job["seed"]),
            **extra,
        )

    policy = await host("model", "tiny-policy", spec("policy"))
    tools = await host("resources", "guess", spec("tools"))
    group_tools = await host("resources", "guess-group", spec("group-tools"))
    for index in range(int(job["agents"])):
        await host(
            "agent",
            "guess",
            spec(
                f"agent-{index}",
                policy_address=policy.address,
                resources={"guess": tools.address, "guess-group": group_tools.address},
                turn_delay_s=float(job.get("turn_delay_s", 0.0)),
            ),
        )
    return {"participants": participants}, closers, None


def _watch_stdin(
    loop: asyncio.AbstractEventLoop, stop: asyncio.Event, turns: asyncio.Queue[None]
) -> None:
    """Set ``stop`` when stdin closes: the driver stopped us, or it is gone. A ``turn``
    line asks for a turn of every parked episode (``turns``)."""

    def read() -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in sys.stdin.buffer:
                if line.strip() == b"turn":
                    loop.call_soon_threadsafe(turns.put_nowait, None)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stop.set)

    # A daemon thread: a blocked read must never hold up the interpreter's exit.
    threading.Thread(target=read, name="bench-stdin", daemon=True).start()


def _say(message: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _serve(job: Mapping[str, Any]) -> int:
    token = load_token()
    if token is None:
        print(f"bench worker: no token in ${TOKEN_ENV}", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    turns: asyncio.Queue[None] = asyncio.Queue()
    _watch_stdin(loop, stop, turns)
    if job["mode"] == "fleet":
        # Each participant would own a process and its thread pool in production; here
        # dozens share one loop, so give the loop a thread per participant, or their
        # commits' fsyncs would queue behind each other in the default pool of a few.
        threads = len(job["participants"]) + 4
        loop.set_default_executor(ThreadPoolExecutor(threads, thread_name_prefix="bench"))
    else:
        # The policy's forward passes are a few small matrices: one thread each, as the
        # demo trainer's, rather than a pool per process contending for two cores.
        import torch

        torch.set_num_threads(1)
    hosting = _host_fleet if job["mode"] == "fleet" else _host_topology
    closers: list[Closer] = []
    with counting_fsyncs() as fsyncs:
        try:
            report, closers, take_turn = await hosting(job, token)
            # A long-lived server's start-up heap: frozen, as `turnpoint serve` does.
            freeze_start_up_heap()
            report["pid"] = os.getpid()
            _say(report)

            async def answer_turns() -> None:
                while True:
                    await turns.get()
                    _say({"turned": 0 if take_turn is None else await take_turn()})

            answering = asyncio.create_task(answer_turns())
            try:
                await stop.wait()
            finally:
                answering.cancel()
        finally:
            for close in reversed(closers):
                # Best effort: a server that fails to stop must not keep the others up,
                # and the process exits right after anyway.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(close(), _STOP_TIMEOUT_S)
        if job.get("count_fsyncs"):
            with contextlib.suppress(OSError):
                _say({"fsyncs": fsyncs.value})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m turnpoint.apps.bench._workers JOB_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    job = json.loads(args[0])
    if job.get("mode") not in ("fleet", "topology"):
        print(f"bench worker: unknown mode {job.get('mode')!r}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(job))


# ----------------------------------------------------------------- driver's handle


class WorkerError(RuntimeError):
    """A worker failed to start or report its ports in time."""


class WorkerProcess:
    """A running worker: :meth:`start` returns its report; :meth:`stop` or :meth:`kill`
    always ends it (a worker that ignores the stop is killed after a bounded wait)."""

    def __init__(self, name: str, job: Mapping[str, Any], token: str) -> None:
        self.name = name
        self._job = dict(job)
        self._token = token
        self._process: asyncio.subprocess.Process | None = None
        self.report: dict[str, Any] = {}
        # The last JSON line it printed on its way out (``{"fsyncs": N}``), if any.
        self.final_report: dict[str, Any] = {}

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self, timeout_s: float) -> dict[str, Any]:
        # gRPC core logs every GOAWAY of a server that stops at INFO: noise on stderr.
        env = {"GRPC_VERBOSITY": "ERROR", **os.environ, TOKEN_ENV: self._token}
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            _MODULE,
            json.dumps(self._job),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        assert self._process.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                line = await self._process.stdout.readline()
        except TimeoutError:
            self.kill()
            raise WorkerError(
                f"worker {self.name} did not report its ports in {timeout_s:g} s"
            ) from None
        if not line:
            code = await self._process.wait()
            raise WorkerError(f"worker {self.name} exited with code {code} before reporting")
        self.report = json.loads(line)
        return self.report

    async def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Close its stdin (it drains its servers and exits); kill it if it lingers."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        try:
            async with asyncio.timeout(timeout_s):
                if process.stdout is not None:
                    self._read_final(await process.stdout.read())
                await process.wait()
        except TimeoutError:
            _LOG.warning("worker %s did not stop in %g s; killing it", self.name, timeout_s)
            self.kill()
            await process.wait()

    async def take_turn(self, timeout_s: float) -> int:
        """Every parked episode it hosts takes a turn (seals a new boundary with new
        state) and parks again; returns how many did."""
        process = self._process
        if process is None or process.stdin is None or process.stdout is None:
            raise WorkerError(f"worker {self.name} is not running")
        process.stdin.write(b"turn\n")
        await process.stdin.drain()
        try:
            async with asyncio.timeout(timeout_s):
                line = await process.stdout.readline()
        except TimeoutError:
            raise WorkerError(f"worker {self.name} took no turn in {timeout_s:g} s") from None
        if not line:
            raise WorkerError(f"worker {self.name} exited instead of taking a turn")
        return int(json.loads(line)["turned"])

    def _read_final(self, rest: bytes) -> None:
        for line in reversed(rest.decode("utf-8", errors="replace").splitlines()):
            with contextlib.suppress(json.JSONDecodeError):
                found = json.loads(line)
                if isinstance(found, dict):
                    self.final_report = found
                    return

    def kill(self) -> None:
        """SIGKILL, as a crash would (the servers get no chance to drain)."""
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    async def wait_killed(self) -> None:
        self.kill()
        if self._process is not None:
            await self._process.wait()


if __name__ == "__main__":
    sys.exit(main())
