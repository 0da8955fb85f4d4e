"""Several worker processes behind one endpoint (docs/spec.md section 3.9).

A Gym server often runs N worker processes behind one port (uvicorn ``--workers``).
Here each worker is its own participant (its own instance name ``<group>-w<i>``,
incarnation, phase and snapshot directory), and listens twice: on the group's shared
port, bound with ``SO_REUSEPORT`` by every worker so the kernel spreads connections over
them, and on a port of its own where it alone answers. ``Describe`` on any worker lists
every worker with its own address and the group's name; the coordinator learns the
workers from it and addresses each directly from then on (the shared port spreads
*connections*, not calls, so one long-lived control connection would otherwise pin one
worker).

:class:`WorkerGroup` is the parent. It reserves the shared port and every worker's own
port before any worker starts (sockets bound with ``SO_REUSEPORT`` and never listening:
they receive no connection, but no server that binds alone can take the port while a
worker restarts), so the roster is complete from the first worker on. It starts each
worker as a child process with its :class:`~turnpoint.server._worker_slot.WorkerSlot` in
``$TURNPOINT_WORKER_SLOT``, waits for its ready line, and restarts a worker that dies on
the same own port, as a fresh incarnation. Stopping the parent drains every worker;
a parent that dies takes its workers with it (each asks the kernel for SIGKILL when its
parent goes, :func:`die_with_parent`).

The worker side is :func:`worker_slot_from_env`, :func:`die_with_parent`,
:func:`host_worker` and :func:`announce_ready`; ``turnpoint serve --workers N`` uses
both halves.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Final

from turnpoint.ids import validate_id
from turnpoint.participant_sdk import ParticipantRuntime
from turnpoint.server._grpc_server import ParticipantServer, ServerOptions
from turnpoint.server._hosted_participant import HostedParticipant, register_runtime
from turnpoint.server._worker_slot import (
    WORKER_SLOT_ENV,
    GroupMember,
    GroupRoster,
    WorkerSlot,
    worker_name,
)

_log = logging.getLogger(__name__)

READY_PREFIX: Final = "turnpoint-worker: ready "
"""A worker's stdout line once it serves: the prefix, then its instance name."""

_PR_SET_PDEATHSIG: Final = 1
# A worker that keeps dying is restarted after a pause that doubles up to this.
_RESTART_PAUSE_S: Final = 0.2
_MAX_RESTART_PAUSE_S: Final = 5.0
# Past this many seconds alive, a worker's next death counts as a first one again.
_HEALTHY_AFTER_S: Final = 30.0


# ---------------------------------------------------------------------- worker side


def worker_slot_from_env(environ: Mapping[str, str] | None = None) -> WorkerSlot | None:
    """This process's slot when a :class:`WorkerGroup` started it, else None."""
    text = (os.environ if environ is None else environ).get(WORKER_SLOT_ENV)
    return None if text is None else WorkerSlot.from_json(text)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so a parent
    killed outright leaves no orphan (a worker serving the shared port, a demo's
    participant). Elsewhere, or if the parent is already gone, a process whose parent is
    not ``parent_pid`` (a worker's ``slot.parent_pid``) exits at once."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died before the request above: then nobody would signal us.
    if os.getppid() != parent_pid:
        os._exit(1)


def host_worker(
    runtime: ParticipantRuntime, options: ServerOptions, slot: WorkerSlot
) -> HostedParticipant:
    """Wire ``runtime`` as worker ``slot``: its own port, the shared port, the roster in
    ``Describe``. ``options`` gives everything else (auth, TLS, limits); its host and
    ports are the slot's."""
    options = replace(options, host=slot.host, port=slot.own_port, shared_port=slot.shared_port)
    register = register_runtime(
        runtime, max_list_length=options.max_list_length, roster=slot.roster
    )
    return HostedParticipant(runtime, ParticipantServer(options, register))


def announce_ready(slot: WorkerSlot) -> None:
    """Tell the parent this worker serves (one stdout line)."""
    print(f"{READY_PREFIX}{slot.instance}", flush=True)


# ---------------------------------------------------------------------- parent side


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _reserve(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` that never listens: it holds
    the port for the group's workers (who bind it the same way) and receives nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


class _Worker:
    """One worker's current process and how often it was restarted."""

    def __init__(self, slot: WorkerSlot) -> None:
        self.slot = slot
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.started_at = 0.0
        self.drain: asyncio.Task[None] | None = None


class WorkerGroup:
    """The parent of ``count`` workers sharing one port; see the module docstring.

    ``command`` is the worker program; each worker runs it with its slot in
    ``$TURNPOINT_WORKER_SLOT`` (and ``env``, default this process's environment) and
    must print :data:`READY_PREFIX` and its instance name once it serves. ``host`` is
    where every port is bound and what the roster tells clients to dial, so it must be an
    address they can reach (not a wildcard). Use::

        group = WorkerGroup("agent-0", 2, command, host="127.0.0.1")
        await group.start()          # every worker serves, or nothing runs
        ...                          # a worker that dies is restarted on its own port
        await group.stop()           # SIGTERM every worker, wait for their drains
    """

    def __init__(
        self,
        group: str,
        count: int,
        command: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        validate_id(group, "group")
        if host in ("0.0.0.0", "::", "[::]", ""):
            raise ValueError(f"a worker group's host is dialled by clients: {host!r} is not")
        if count < 1:
            raise ValueError(f"a worker group needs at least one worker, got {count}")
        if not command:
            raise ValueError("a worker group needs a worker command")
        self.group = group
        self.count = count
        self._command = tuple(command)
        self._host = host
        self._port = port
        self._env = dict(os.environ if env is None else env)
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._reserved: list[socket.socket] = []
        self._workers: list[_Worker] = []
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._changed = asyncio.Condition()
        self._stopped = asyncio.Event()
        self._stop_task: asyncio.Task[bool] | None = None

    # -- what the group is ---------------------------------------------------------

    @property
    def shared_port(self) -> int:
        if not self._reserved:
            raise RuntimeError("the group has not been started")
        port: int = self._reserved[0].getsockname()[1]
        return port

    @property
    def shared_address(self) -> str:
        return _join(self._host, self.shared_port)

    @property
    def members(self) -> tuple[GroupMember, ...]:
        """Every worker's instance name and own address, in index order."""
        return tuple(w.slot.roster.members[w.slot.index] for w in self._workers)

    def pid(self, index: int) -> int | None:
        """The pid of worker ``index``'s current process (None while it is down)."""
        process = self._workers[index].process
        return None if process is None or process.returncode is not None else process.pid

    def restarts(self, index: int) -> int:
        return self._workers[index].restarts

    # -- start ---------------------------------------------------------------------

    async def start(self) -> None:
        """Reserve the ports, start every worker and wait until each serves.

        All or nothing: if one worker does not come up, every worker is stopped and the
        ports released, and the error says which and why."""
        if self._reserved:
            raise RuntimeError("start() called twice")
        try:
            self._reserved.append(_reserve(self._host, self._port))
            for _ in range(self.count):
                self._reserved.append(_reserve(self._host, 0))
            roster = GroupRoster(
                self.group,
                tuple(
                    GroupMember(
                        worker_name(self.group, index),
                        _join(self._host, sock.getsockname()[1]),
                    )
                    for index, sock in enumerate(self._reserved[1:])
                ),
            )
            self._workers = [
                _Worker(
                    WorkerSlot(
                        group=self.group,
                        index=index,
                        host=self._host,
                        shared_port=self.shared_port,
                        own_port=sock.getsockname()[1],
                        roster=roster,
                        parent_pid=os.getpid(),
                    )
                )
                for index, sock in enumerate(self._reserved[1:])
            ]
            await asyncio.gather(*(self._spawn(worker) for worker in self._workers))
        except BaseException:
            await self._terminate_all(grace=False)
            self._release()
            raise
        self._supervisors = [
            asyncio.get_running_loop().create_task(self._supervise(worker))
            for worker in self._workers
        ]
        _log.info(
            "worker group %s: %d workers on %s (%s)",
            self.group,
            self.count,
            self.shared_address,
            ", ".join(f"{m.instance} {m.address}" for m in self.members),
        )

    async def _spawn(self, worker: _Worker) -> None:
        env = dict(self._env)
        env[WORKER_SLOT_ENV] = worker.slot.to_json()
        env["PYTHONUNBUFFERED"] = "1"
        process = await asyncio.create_subprocess_exec(
            *self._command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        worker.process = process
        worker.started_at = asyncio.get_running_loop().time()
        try:
            ready = await asyncio.wait_for(self._ready(process, worker.slot), self._start_timeout_s)
        except TimeoutError:
            ready = False
        except BaseException:
            await _kill(process)
            raise
        if not ready:
            status = process.returncode
            await _kill(process)
            why = "it never said it serves" if status is None else f"it exited ({status})"
            raise OSError(f"worker {worker.slot.instance} of {self.group} did not start: {why}")
        # Keep reading stdout so that a chatty worker never blocks on a full pipe.
        worker.drain = asyncio.get_running_loop().create_task(_discard(process))

    @staticmethod
    async def _ready(process: asyncio.subprocess.Process, slot: WorkerSlot) -> bool:
        assert process.stdout is not None
        while line := await process.stdout.readline():
            if line.decode("utf-8", "replace").strip() == f"{READY_PREFIX}{slot.instance}":
                return True
        return False

    # -- restarts ------------------------------------------------------------------

    async def _supervise(self, worker: _Worker) -> None:
        """Restart ``worker`` whenever it dies, on the same own port, until the group stops."""
        pause = _RESTART_PAUSE_S
        loop = asyncio.get_running_loop()
        while True:
            process = worker.process
            assert process is not None
            status = await process.wait()
            if worker.drain is not None:
                await worker.drain
            if self._stopping.is_set():
                return
            lived = loop.time() - worker.started_at
            pause = _RESTART_PAUSE_S if lived > _HEALTHY_AFTER_S else pause
            _log.warning(
                "worker %s of %s exited (%s); restarting it on %s in %.1f s",
                worker.slot.instance,
                self.group,
                status,
                worker.slot.roster.members[worker.slot.index].address,
                pause,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MAX_RESTART_PAUSE_S)
            if self._stopping.is_set():
                return
            try:
                await self._spawn(worker)
            except OSError as error:
                _log.error("%s; trying again", error)
                continue
            worker.restarts += 1
            async with self._changed:
                self._changed.notify_all()

    async def wait_restarted(self, index: int, restarts: int, timeout_s: float) -> int:
        """Wait until worker ``index`` was restarted ``restarts`` times and serves again;
        returns its new pid. Raises ``TimeoutError``."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: self._workers[index].restarts >= restarts)
        pid = self.pid(index)
        assert pid is not None
        return pid

    async def restart_all(self, timeout_s: float) -> None:
        """Kill every worker and wait until each serves again on its own port, fresh:
        a job restart without new addresses (docs/spec.md sections 3.9 and 7.11)."""
        wanted = [w.restarts + 1 for w in self._workers]
        for worker in self._workers:
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
        async with asyncio.timeout(timeout_s):
            for index, restarts in enumerate(wanted):
                await self.wait_restarted(index, restarts, timeout_s)

    # -- stop ----------------------------------------------------------------------

    async def stop(self) -> bool:
        """SIGTERM every worker (each drains), wait, SIGKILL any still running after
        ``stop_timeout_s``; release the ports. True if every worker exited 0. Safe to call
        more than once and concurrently."""
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._stop())
        return await asyncio.shield(self._stop_task)

    async def _stop(self) -> bool:
        self._stopping.set()
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        try:
            return await self._terminate_all(grace=True)
        finally:
            self._release()
            self._stopped.set()

    async def _terminate_all(self, *, grace: bool) -> bool:
        processes = [w.process for w in self._workers if w.process is not None]
        for process in processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM if grace else signal.SIGKILL)
        clean = True
        for process in processes:
            try:
                status = await asyncio.wait_for(process.wait(), self._stop_timeout_s)
            except TimeoutError:
                await _kill(process)
                status = -signal.SIGKILL
            clean = clean and status == 0
        for worker in self._workers:
            if worker.drain is not None:
                await asyncio.gather(worker.drain, return_exceptions=True)
        return clean

    def _release(self) -> None:
        for sock in self._reserved:
            sock.close()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(
        self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
    ) -> None:
        """SIGTERM/SIGINT stop the group (every worker drains); call from the loop."""
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._stop())


async def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    await process.wait()


async def _discard(process: asyncio.subprocess.Process) -> None:
    if process.stdout is not None:
        while await process.stdout.readline():
            pass
