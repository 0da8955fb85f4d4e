"""The local reference provider (docs/spec.md section 5.7.4).

Each sandbox a directory, its processes confined by :mod:`._isolation`, its snapshots in
a :class:`._chunks.ChunkStore`.

Layout under the provider's root (everything it owns; nothing outside is written)::

    store.lock                   shared by captures and restores, taken alone by a prune,
                                 across every process over the root
    state.lock                   held by each change of state.json, across every process
    state.json                   every live sandbox: active generation, its directory,
                                 base digest, last restore attempt, recorded commands;
                                 the last generation of every destroyed one
    store/                       the chunk store (chunks/, manifests/)
    snapshots/<snapshot id>.json a snapshot handle, written after its manifest
    sandboxes/<id>/g<N>-<hex>/   one generation's tree

``state.json`` is replaced atomically, so a restore of several sandboxes activates all
of them in one rename or none. Every change of state (create, clone, start, destroy,
restore) runs in a thread holding ``state.lock``: it reads the file afresh, checks, does
its file work and writes the file, so providers in several processes over one root
change it one at a time and never from a stale copy. Calls on a sandbox read the file
again when it has changed since this process last read it, and a generation another
process replaced is fenced here too: its processes killed, every call refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from turnpoint._files import create_file, replace_file
from turnpoint._json import StrictJSONError, loads_strict
from turnpoint.ids import validate_id

from ._chunks import ChunkStore
from ._errors import (
    DuplicateRestoreError,
    ProviderStateError,
    SandboxError,
    SandboxExistsError,
    SandboxFencedError,
    SandboxNotFoundError,
    SandboxPathError,
    SnapshotExpiredError,
    SnapshotNotFoundError,
    SnapshotRefusedError,
    StaleHandleError,
)
from ._format import Limits, TreeManifest, check_path
from ._isolation import mounts, namespace_init, probe, wrap
from ._provider import (
    Capability,
    ExecResult,
    Isolation,
    IsolationReport,
    ProcessRecovery,
    Pruned,
    ResourceLimits,
    Restored,
    Sandbox,
    SandboxProvider,
    SnapshotHandle,
)

PROVIDER_NAME: Final = "turnpoint.local"
PROVIDER_VERSION: Final = "1"
_STATE_VERSION: Final = 1
_TEMP_PREFIX: Final = ".state-"
# After a kill, how long the output readers may take to see end-of-file; only a
# process that left the sandbox's process group could hold the pipes longer.
_DRAIN_SECONDS: Final = 5.0
_READ_BYTES: Final = 1 << 16
_GENERATION_DIR: Final = re.compile(r"g[0-9]+-[0-9a-f]{8}")
_STORE_LOCK: Final = "store.lock"
_STATE_LOCK: Final = "state.lock"


@contextlib.contextmanager
def _flock(path: Path, *, exclusive: bool) -> Iterator[None]:
    """``path`` locked across processes (blocking: call in a thread)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _store_lock(root: Path, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
    """Held from a capture's first chunk to its handle record, and over a restore's
    reads, shared; by a prune alone. A capture's chunks are unreferenced until its record
    lands, so a prune of another process over the same root must not run meanwhile
    (section 5.7.4 item 5)."""
    return _flock(root / _STORE_LOCK, exclusive=exclusive)


@dataclass(frozen=True)
class _SandboxState:
    generation: int
    directory: str
    base_digest: str
    restored_attempt: int
    commands: tuple[tuple[str, ...], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "directory": self.directory,
            "base_digest": self.base_digest,
            "restored_attempt": self.restored_attempt,
            "commands": [list(c) for c in self.commands],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> _SandboxState:
        directory = str(raw["directory"])
        # The provider removes this directory when it fences the generation: a damaged
        # file must never name one outside its own tree.
        if not _GENERATION_DIR.fullmatch(directory):
            raise ValueError("directory")
        return cls(
            int(raw["generation"]),
            directory,
            str(raw["base_digest"]),
            int(raw["restored_attempt"]),
            tuple(tuple(str(a) for a in c) for c in raw["commands"]),
        )


@dataclass(frozen=True)
class _State:
    """What ``state.json`` holds: the live sandboxes, and the last generation of each
    destroyed one (so a sandbox made again under its id starts past it and an old handle
    stays fenced); ``stamp`` tells whether the file changed since it was read."""

    live: dict[str, _SandboxState]
    retired: dict[str, int]
    serial: int = 0  # one more with each write: a copy read earlier is never adopted later
    stamp: tuple[int, int, int] | None = None

    def last_generation(self, sandbox_id: str) -> int:
        state = self.live.get(sandbox_id)
        if state is not None:
            return state.generation
        return self.retired.get(sandbox_id, 0)

    def active(self, sandbox: Sandbox) -> _SandboxState:
        """The sandbox's state if ``sandbox`` is its active generation; else fenced."""
        state = self.live.get(sandbox.sandbox_id)
        if state is None:
            if sandbox.sandbox_id in self.retired:
                raise SandboxFencedError(sandbox.sandbox_id, sandbox.generation, None)
            raise SandboxNotFoundError(sandbox.sandbox_id)
        if state.generation != sandbox.generation:
            raise SandboxFencedError(sandbox.sandbox_id, sandbox.generation, state.generation)
        return state


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return (status.st_ino, status.st_mtime_ns, status.st_size)


class LocalSandboxProvider(SandboxProvider):
    """Sandboxes as directories on this machine; open one with :meth:`open`."""

    name = PROVIDER_NAME
    version = PROVIDER_VERSION

    def __init__(
        self,
        root: Path,
        isolation: IsolationReport,
        *,
        limits: ResourceLimits,
        snapshot_limits: Limits,
        clock: Callable[[], float],
    ) -> None:
        self._root = root
        self.location = str(root)
        self._isolation = isolation
        self._limits = limits
        self._store = ChunkStore(root / "store", snapshot_limits)
        self._clock = clock
        # This process's copy of state.json: what calls on a sandbox check against.
        self._state = self._read_state()
        self._lock = asyncio.Lock()
        self._processes: dict[Sandbox, set[asyncio.subprocess.Process]] = {}
        # Under bwrap, a pidfd of each command's sandbox init (see :meth:`_kill`).
        self._namespaces: dict[asyncio.subprocess.Process, int] = {}

    @classmethod
    async def open(
        cls,
        root: Path,
        *,
        isolation: Isolation | None = None,
        limits: ResourceLimits | None = None,
        snapshot_limits: Limits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> LocalSandboxProvider:
        """The provider over ``root`` (created if missing; its sandboxes and snapshots
        survive a restart of this process). ``isolation``: a mechanism that must work,
        or None for the strongest that does (:attr:`isolation` says which)."""

        def prepare() -> IsolationReport:
            for sub in ("snapshots", "sandboxes", "scratch"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            return probe(isolation, root / "scratch")

        report = await asyncio.to_thread(prepare)
        return cls(
            root,
            report,
            limits=limits or ResourceLimits(),
            snapshot_limits=snapshot_limits or Limits(),
            clock=clock,
        )

    @property
    def capability(self) -> Capability:
        return Capability.SNAPSHOT

    @property
    def isolation(self) -> IsolationReport:
        return self._isolation

    # ---------------------------------------------------------------- state

    def _read_state(self) -> _State:
        """``state.json`` as it is now (blocking)."""
        path = self._root / "state.json"
        try:
            stamp = _stamp(path)
            text = path.read_text("utf-8")
        except FileNotFoundError:
            return _State({}, {})
        try:
            document = loads_strict(text)
            if document["state_version"] != _STATE_VERSION:
                raise ValueError("state_version")
            live = {
                validate_id(k, "sandbox_id"): _SandboxState.from_json(v)
                for k, v in document["sandboxes"].items()
            }
            retired = {k: int(v) for k, v in document["retired"].items()}
            serial = int(document.get("serial", 0))
        except (StrictJSONError, KeyError, TypeError, ValueError, AttributeError) as error:
            raise ProviderStateError(str(path), type(error).__name__) from None
        return _State(live, retired, serial, stamp)

    def _write_state(self, state: _State) -> _State:
        """Replace ``state.json`` with ``state`` (blocking; under the state lock)."""
        document = {
            "state_version": _STATE_VERSION,
            "serial": state.serial,
            "sandboxes": {k: v.to_json() for k, v in sorted(state.live.items())},
            "retired": dict(sorted(state.retired.items())),
        }
        data = json.dumps(document, indent=2, sort_keys=True).encode("utf-8")
        path = self._root / "state.json"
        replace_file(path, data, temp_prefix=_TEMP_PREFIX)
        return replace(state, stamp=_stamp(path))

    def _change(self, change: Callable[[_State], _State]) -> tuple[_State, _State]:
        """Apply ``change`` to ``state.json`` as it is now, across processes (blocking):
        the state it found and the state it wrote.

        ``change`` may raise (nothing is written) or do file work; the state lock is held
        from the read to the write, so no other process's change falls in between.
        """
        with _flock(self._root / _STATE_LOCK, exclusive=True):
            current = self._read_state()
            updated = replace(change(current), serial=current.serial + 1)
            return current, self._write_state(updated)

    async def _commit(self, change: Callable[[_State], _State]) -> _State:
        """:meth:`_change` in a thread; this process then adopts what another process
        changed before it, and what it wrote (each fences the generations it replaced)."""
        try:
            current, updated = await asyncio.to_thread(self._change, change)
        except SandboxError:
            await self._adopt(await asyncio.to_thread(self._read_state))
            raise
        await self._adopt(current)
        await self._adopt(updated)
        return updated

    async def _adopt(self, state: _State) -> None:
        """Take ``state`` as this process's copy, unless it already holds a later one;
        fence every generation it replaced."""
        if state.serial < self._state.serial:
            return
        previous, self._state = self._state, state
        for sandbox_id, old in previous.live.items():
            new = state.live.get(sandbox_id)
            if new is None or new.generation != old.generation:
                await self._fence(Sandbox(sandbox_id, old.generation), old)

    async def _current(self, sandbox: Sandbox) -> tuple[_SandboxState, Path]:
        """The sandbox's state and tree if ``sandbox`` is its active generation, as
        ``state.json`` says now (another process may have replaced it); else fenced."""
        path = self._root / "state.json"
        if await asyncio.to_thread(_stamp, path) != self._state.stamp:
            await self._adopt(await asyncio.to_thread(self._read_state))
        state = self._state.active(sandbox)
        return state, self._tree(sandbox.sandbox_id, state)

    def _tree(self, sandbox_id: str, state: _SandboxState) -> Path:
        return self._root / "sandboxes" / sandbox_id / state.directory

    def _new_directory(self, sandbox_id: str, generation: int) -> tuple[str, Path]:
        name = f"g{generation}-{secrets.token_hex(4)}"
        return name, self._root / "sandboxes" / sandbox_id / name

    # ---------------------------------------------------------------- lifecycle

    async def create(self, sandbox_id: str) -> Sandbox:
        validate_id(sandbox_id, "sandbox_id")
        async with self._lock:
            return await self._install(sandbox_id, lambda: TreeManifest(()))

    async def clone(self, sandbox: Sandbox, new_sandbox_id: str) -> Sandbox:
        validate_id(new_sandbox_id, "sandbox_id")
        async with self._lock:
            _, tree = await self._current(sandbox)
            return await self._install(new_sandbox_id, lambda: self._store.capture(tree).manifest)

    async def _install(self, sandbox_id: str, source: Callable[[], TreeManifest]) -> Sandbox:
        """A new sandbox holding the tree ``source`` returns (called in a thread)."""

        def change(current: _State) -> _State:
            if sandbox_id in current.live:
                raise SandboxExistsError(sandbox_id)
            generation = current.last_generation(sandbox_id) + 1
            name, tree = self._new_directory(sandbox_id, generation)
            try:
                with _store_lock(self._root, exclusive=False):
                    manifest = source()
                    tree.parent.mkdir(exist_ok=True)
                    self._store.restore(manifest, tree)
                live = {
                    **current.live,
                    sandbox_id: _SandboxState(generation, name, manifest.digest, 0, ()),
                }
                retired = {k: v for k, v in current.retired.items() if k != sandbox_id}
                return _State(live, retired)
            except BaseException:
                shutil.rmtree(tree, ignore_errors=True)
                raise

        updated = await self._commit(change)
        sandbox = Sandbox(sandbox_id, updated.live[sandbox_id].generation)
        self._processes[sandbox] = set()
        return sandbox

    async def destroy(self, sandbox_id: str) -> None:
        def change(current: _State) -> _State:
            state = current.live.get(sandbox_id)
            if state is None:
                raise SandboxNotFoundError(sandbox_id)
            live = {k: v for k, v in current.live.items() if k != sandbox_id}
            return _State(live, {**current.retired, sandbox_id: state.generation})

        async with self._lock:
            await self._commit(change)

    async def _fence(self, old: Sandbox, state: _SandboxState) -> None:
        """Kill what runs in a generation that is no longer active, and remove its tree."""
        for process in self._processes.get(old, set()):
            self._kill(process)
            self._release(process)
        self._processes[old] = set()
        await asyncio.to_thread(shutil.rmtree, self._tree(old.sandbox_id, state), True)

    # ---------------------------------------------------------------- processes

    async def exec(
        self, sandbox: Sandbox, argv: Sequence[str], *, timeout_seconds: float, stdin: bytes = b""
    ) -> ExecResult:
        process = await self._spawn(sandbox, argv, piped=True)
        assert process.stdin is not None and process.stdout is not None
        assert process.stderr is not None
        cap = self._limits.output_bytes
        stdout = asyncio.create_task(_read_capped(process.stdout, cap))
        stderr = asyncio.create_task(_read_capped(process.stderr, cap))
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(stdin)
                await process.stdin.drain()
                process.stdin.close()
            timed_out = False
            try:
                await asyncio.wait_for(process.wait(), timeout_seconds)
            except TimeoutError:
                timed_out = True
                self._kill(process)
                await process.wait()
            done, _ = await asyncio.wait({stdout, stderr}, timeout=_DRAIN_SECONDS)
        finally:
            # Also on cancellation: the command dies with the call that ran it.
            self._kill(process)
            self._release(process)
            self._processes.get(sandbox, set()).discard(process)
            stdout.cancel()
            stderr.cancel()
        out, out_cut = stdout.result() if stdout in done else (b"", True)
        err, err_cut = stderr.result() if stderr in done else (b"", True)
        await self._current(sandbox)  # fenced while it ran: what it did went with the old tree
        return ExecResult(
            None if timed_out else process.returncode,
            out,
            err,
            timed_out,
            out_cut or err_cut,
        )

    async def start(self, sandbox: Sandbox, argv: Sequence[str]) -> None:
        await self._spawn(sandbox, argv, piped=False)

        def change(current: _State) -> _State:
            state = current.active(sandbox)  # a restore that fenced it killed the process
            command = replace(state, commands=(*state.commands, tuple(argv)))
            return replace(current, live={**current.live, sandbox.sandbox_id: command})

        async with self._lock:
            await self._commit(change)

    async def close(self) -> None:
        """Kill every process this provider started; the sandboxes' trees stay."""
        processes = [p for group in self._processes.values() for p in group]
        for process in processes:
            self._kill(process)
        for process in processes:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), _DRAIN_SECONDS)
            self._release(process)
        for group in self._processes.values():
            group.clear()

    async def _spawn(
        self, sandbox: Sandbox, argv: Sequence[str], *, piped: bool
    ) -> asyncio.subprocess.Process:
        if not argv:
            raise ValueError("an empty command")
        _, tree = await self._current(sandbox)
        # Started in a task of its own: cancelled mid-spawn, asyncio would kill bwrap
        # alone and then wait for the command's pipes, which the sandbox still holds.
        spawning = asyncio.ensure_future(self._start(tree, argv, piped=piped))
        try:
            process = await asyncio.shield(spawning)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # a spawn that failed left nothing
                await self._stop(await spawning)
            raise
        try:
            await self._current(sandbox)  # a restore may have fenced it while it started
        except BaseException:
            await self._stop(process)
            raise
        self._processes.setdefault(sandbox, set()).add(process)
        return process

    async def _start(
        self, tree: Path, argv: Sequence[str], *, piped: bool
    ) -> asyncio.subprocess.Process:
        pipe = asyncio.subprocess.PIPE
        quiet = asyncio.subprocess.DEVNULL
        # bwrap reports its sandbox's init on a pipe of its own (see _kill).
        info = os.pipe() if self._isolation.mechanism is Isolation.BWRAP else None
        try:
            process = await asyncio.create_subprocess_exec(
                *wrap(
                    self._isolation,
                    tree,
                    argv,
                    self._limits,
                    info_fd=None if info is None else info[1],
                ),
                cwd=tree,
                stdin=pipe if piped else quiet,
                stdout=pipe if piped else quiet,
                stderr=pipe if piped else quiet,
                start_new_session=True,
                env=_environment(),
                pass_fds=() if info is None else (info[1],),
            )
        except BaseException:
            if info is not None:
                os.close(info[0])
            raise
        finally:
            if info is not None:
                os.close(info[1])
        if info is not None:
            # Written within milliseconds of bwrap's start, closed when it exits.
            self._watch_namespace(process, await _read_to_end(info[0]))
        return process

    async def _stop(self, process: asyncio.subprocess.Process) -> None:
        self._kill(process)
        await process.wait()
        self._release(process)

    def _watch_namespace(self, process: asyncio.subprocess.Process, info: bytes) -> None:
        """Keep a pidfd of ``process``'s sandbox init from bwrap's report ``info``."""
        pid = namespace_init(info)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):  # the sandbox has ended already
            self._namespaces[process] = os.pidfd_open(pid)

    def _kill(self, process: asyncio.subprocess.Process) -> None:
        """SIGKILL a running command: the init of its sandbox's pid namespace first (the
        kernel then kills every process in the namespace), then the process group the
        provider started. Killing bwrap alone is not enough: the sandbox runs in a new
        session, out of that group, and a bwrap killed while it was still setting the
        sandbox up leaves the sandbox running (its die-with-parent not yet armed), with
        the command's pipes open, so that even waiting for the command hangs."""
        if process.returncode is not None:
            return  # it ended, and bwrap ends only after its sandbox
        namespace = self._namespaces.get(process)
        if namespace is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(namespace, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    def _release(self, process: asyncio.subprocess.Process) -> None:
        namespace = self._namespaces.pop(process, None)
        if namespace is not None:
            os.close(namespace)

    # ---------------------------------------------------------------- files

    async def read_file(self, sandbox: Sandbox, path: str) -> bytes:
        _, tree = await self._current(sandbox)
        return await asyncio.to_thread(_read_inside, tree, _checked(path))

    async def write_file(self, sandbox: Sandbox, path: str, data: bytes, mode: int = 0o644) -> None:
        _, tree = await self._current(sandbox)
        await asyncio.to_thread(_write_inside, tree, _checked(path), data, mode & 0o777)

    # ---------------------------------------------------------------- snapshots

    async def snapshot(self, sandbox: Sandbox, *, retention_seconds: float) -> SnapshotHandle:
        async with self._lock:
            state, tree = await self._current(sandbox)

            def write() -> SnapshotHandle:
                with _store_lock(self._root, exclusive=False):
                    capture = self._store.capture(tree)
                    handle = SnapshotHandle(
                        snapshot_id=f"{sandbox.sandbox_id}.g{sandbox.generation}."
                        f"{secrets.token_hex(6)}",
                        provider=self.name,
                        provider_version=self.version,
                        sandbox_id=sandbox.sandbox_id,
                        generation=sandbox.generation,
                        base_digest=state.base_digest,
                        tree_digest=capture.digest,
                        mounts=mounts(self._isolation),
                        processes=ProcessRecovery.RESTART_ONLY,
                        restart_commands=state.commands,
                        expires_at=self._clock() + retention_seconds,
                    )
                    data = json.dumps(handle.to_json(), indent=2, sort_keys=True).encode("utf-8")
                    path = self._root / "snapshots" / f"{handle.snapshot_id}.json"
                    create_file(path, data, temp_prefix=_TEMP_PREFIX)
                return handle

            return await asyncio.to_thread(write)

    async def prune(self) -> Pruned:
        """Remove the snapshots whose retention has lapsed, and what only they held.

        A record that cannot be read is kept (and keeps nothing else alive). Safe
        beside other processes over the same root: it waits for their captures and
        restores in progress (the store lock), and they for it.
        """
        async with self._lock:
            return await asyncio.to_thread(self._prune)

    def _prune(self) -> Pruned:
        with _store_lock(self._root, exclusive=True):
            return self._prune_locked()

    def _prune_locked(self) -> Pruned:
        now = self._clock()
        expired: list[str] = []
        keep: set[str] = set()
        for path in sorted((self._root / "snapshots").glob("*.json")):
            try:
                record = SnapshotHandle.from_json(loads_strict(path.read_text("utf-8")))
            except (StrictJSONError, ValueError, KeyError, TypeError):
                continue
            if now >= record.expires_at:
                path.unlink()
                expired.append(record.snapshot_id)
            else:
                keep.add(record.tree_digest)
        manifests, freed = self._store.collect(frozenset(keep))
        return Pruned(tuple(expired), manifests, freed)

    def _record(self, handle: SnapshotHandle) -> SnapshotHandle:
        """The durable record behind ``handle``, checked against it (blocking)."""
        try:
            validate_id(handle.snapshot_id, "snapshot_id")
            path = self._root / "snapshots" / f"{handle.snapshot_id}.json"
            text = path.read_text("utf-8")
        except (FileNotFoundError, ValueError):
            raise SnapshotNotFoundError(handle.snapshot_id) from None
        try:
            record = SnapshotHandle.from_json(loads_strict(text))
        except (StrictJSONError, ValueError):
            raise StaleHandleError(handle.snapshot_id, "record") from None
        for field in ("provider", "provider_version", "sandbox_id", "generation", "tree_digest"):
            if getattr(record, field) != getattr(handle, field):
                raise StaleHandleError(handle.snapshot_id, field)
        if self._clock() >= record.expires_at:
            raise SnapshotExpiredError(handle.snapshot_id, record.expires_at)
        if not self._store.has_manifest(record.tree_digest):
            raise SnapshotNotFoundError(handle.snapshot_id)
        return record

    async def restore(
        self, handles: Sequence[SnapshotHandle], *, attempt: int
    ) -> tuple[Restored, ...]:
        staged: list[tuple[SnapshotHandle, Sandbox]] = []
        made: list[Path] = []

        def change(current: _State) -> _State:
            seen: set[str] = set()
            for handle in handles:
                state = current.live.get(handle.sandbox_id)
                if state is None and handle.sandbox_id not in current.retired:
                    raise SandboxNotFoundError(handle.sandbox_id)
                # A destroyed sandbox comes back too (its episode may have ended after
                # the cut); its restore attempts were forgotten with it.
                restored_attempt = 0 if state is None else state.restored_attempt
                if handle.sandbox_id in seen or attempt <= restored_attempt:
                    raise DuplicateRestoreError(handle.sandbox_id, attempt, restored_attempt)
                seen.add(handle.sandbox_id)
            live = dict(current.live)
            trees = self._stage(current, handles)
            for record, name, tree in trees:
                made.append(tree)
                generation = current.last_generation(record.sandbox_id) + 1
                live[record.sandbox_id] = _SandboxState(
                    generation, name, record.base_digest, attempt, record.restart_commands
                )
                staged.append((record, Sandbox(record.sandbox_id, generation)))
            retired = {k: v for k, v in current.retired.items() if k not in seen}
            return _State(live, retired)

        async with self._lock:
            try:
                await self._commit(change)
            except BaseException:
                # state.json not written: what was staged activates nothing.
                await asyncio.to_thread(_remove_all, made)
                raise
            for _, new in staged:
                self._processes[new] = set()
        results = []
        for record, new in staged:
            for command in record.restart_commands:
                await self._spawn(new, command, piped=False)
            results.append(
                Restored(new, record.snapshot_id, record.processes, record.restart_commands)
            )
        return tuple(results)

    def _stage(
        self, current: _State, handles: Sequence[SnapshotHandle]
    ) -> list[tuple[SnapshotHandle, str, Path]]:
        """Every snapshot checked and materialized in a new directory, or none (blocking)."""
        with _store_lock(self._root, exclusive=False):
            records = [self._record(handle) for handle in handles]
            staged: list[tuple[SnapshotHandle, str, Path]] = []
            try:
                for record in records:
                    manifest = self._store.load(record.tree_digest)
                    generation = current.last_generation(record.sandbox_id) + 1
                    name, tree = self._new_directory(record.sandbox_id, generation)
                    self._store.restore(manifest, tree)
                    staged.append((record, name, tree))
            except BaseException:
                _remove_all([tree for _, _, tree in staged])
                raise
            return staged


def _remove_all(trees: list[Path]) -> None:
    for tree in trees:
        shutil.rmtree(tree, ignore_errors=True)


async def _read_to_end(fd: int) -> bytes:
    """Everything written to the pipe ``fd`` until its writer closes it; closes ``fd``."""
    return await asyncio.to_thread(_read_fd_to_end, fd)


def _read_fd_to_end(fd: int) -> bytes:
    try:
        chunks = []
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _environment() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes of ``stream``; the rest read and dropped, flagged."""
    kept = bytearray()
    truncated = False
    while piece := await stream.read(_READ_BYTES):
        room = cap - len(kept)
        if len(piece) > room:
            truncated = True
        kept += piece[: max(room, 0)]
    return bytes(kept), truncated


def _checked(path: str) -> list[str]:
    try:
        check_path(path, Limits())
    except SnapshotRefusedError as refused:  # the manifest's rule, said for a file call
        raise SandboxPathError(path, refused.detail) from None
    return path.split("/")


_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_parent(tree: Path, parts: list[str], *, create: bool) -> int:
    """A descriptor of the directory holding ``parts[-1]``, never through a symlink."""
    fd = os.open(tree, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SandboxPathError(
                        "/".join(parts), f"{part!r} is not a directory"
                    ) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_inside(tree: Path, parts: list[str]) -> bytes:
    parent = _open_parent(tree, parts, create=False)
    try:
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SandboxPathError("/".join(parts), "a symlink") from None
        raise
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as file:
        return file.read()


def _write_inside(tree: Path, parts: list[str], data: bytes, mode: int) -> None:
    parent = _open_parent(tree, parts, create=True)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(parts[-1], flags, mode, dir_fd=parent)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise SandboxPathError("/".join(parts), "a symlink") from None
            raise
    finally:
        os.close(parent)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        os.fchmod(file.fileno(), mode)
