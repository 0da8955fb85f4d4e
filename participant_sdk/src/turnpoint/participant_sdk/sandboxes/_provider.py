"""The sandbox provider contract: what a resources server asks of wherever its sandboxes run.

docs/spec.md section 5.7. A provider hosts sandboxes (a filesystem tree and the
processes started in it) and says, through its :class:`Capability`, how far it can
bring one back after a crash. A sandbox is reached through a :class:`Sandbox` naming
one *generation*: a restore makes a new physical sandbox under a new generation and
fences the old one, whose every later call raises
:class:`._errors.SandboxFencedError`. A snapshot is a durable
:class:`SnapshotHandle`, plain data a participant saves with its session.

Pure: dataclasses, enums and the abstract interface; no I/O, no clock.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from turnpoint.ids import validate_id

HANDLE_VERSION: Final = 1


class Capability(enum.Enum):
    """How far a provider can bring a sandbox back, strongest first.

    - ``SNAPSHOT``: durable snapshots that survive the provider's process, restored into
      a new generation; clone as well.
    - ``CLONE``: a live copy of a running sandbox; nothing outlives the provider.
    - ``RECONNECT_ONLY``: a sandbox that outlived a crash can be reattached, never rolled
      back: the participant declares restart-only for work past its cut.
    - ``UNSUPPORTED``: nothing survives; the sandbox is made again from its base.
    """

    SNAPSHOT = "snapshot"
    CLONE = "clone"
    RECONNECT_ONLY = "reconnect_only"
    UNSUPPORTED = "unsupported"


class ProcessRecovery(enum.Enum):
    """What a snapshot holds of the sandbox's processes.

    ``RESTART_ONLY``: a filesystem snapshot only; the commands started with
    :meth:`SandboxProvider.start` are recorded and started again in the restored
    generation (a server comes back; its memory does not).
    """

    RESTART_ONLY = "restart_only"


class Isolation(enum.Enum):
    """What confines a sandbox's processes (see :class:`IsolationReport`)."""

    BWRAP = "bwrap"
    UNSHARE = "unshare"
    NONE = "none"


@dataclass(frozen=True)
class IsolationReport:
    """What holds for the processes of a provider's sandboxes, said plainly."""

    mechanism: Isolation
    network_isolated: bool
    filesystem_confined: bool  # only the sandbox's own tree is writable (and visible)
    pid_namespace: bool
    limits_enforced: tuple[str, ...]  # resource caps the kernel applies to them
    notes: tuple[str, ...] = ()
    # What a snapshot holds of them, and why not more (a process snapshot was tried).
    processes: ProcessRecovery = ProcessRecovery.RESTART_ONLY
    processes_why: str = ""


@dataclass(frozen=True)
class ResourceLimits:
    """Caps on one sandbox's processes and on what a call returns."""

    cpu_seconds: int = 60
    file_bytes: int = 256 << 20
    processes: int = 256
    address_space_bytes: int = 4 << 30
    output_bytes: int = 1 << 20  # per stream, per exec; the rest is dropped and flagged


@dataclass(frozen=True)
class Sandbox:
    """One generation of one sandbox: what every call on it goes through."""

    sandbox_id: str
    generation: int


@dataclass(frozen=True)
class ExecResult:
    """A command's outcome. ``exit_code`` is None when it was killed at its time bound."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_truncated: bool


@dataclass(frozen=True)
class Mount:
    """One path the sandbox's processes see, and what backs it."""

    path: str
    access: str  # "rw" or "ro"
    source: str  # "sandbox" (its own tree, in the snapshot) or "host" (not in it)


@dataclass(frozen=True)
class SnapshotHandle:
    """The durable record of one sandbox snapshot (docs/spec.md section 5.7.2)."""

    snapshot_id: str
    provider: str
    provider_version: str
    sandbox_id: str
    generation: int
    base_digest: str  # the tree the sandbox was created from
    tree_digest: str  # the tree this snapshot holds
    mounts: tuple[Mount, ...]
    processes: ProcessRecovery
    restart_commands: tuple[tuple[str, ...], ...]
    expires_at: float  # retention: on the provider's clock, seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "handle_version": HANDLE_VERSION,
            "snapshot_id": self.snapshot_id,
            "provider": self.provider,
            "provider_version": self.provider_version,
            "sandbox_id": self.sandbox_id,
            "generation": self.generation,
            "base_digest": self.base_digest,
            "tree_digest": self.tree_digest,
            "mounts": [[m.path, m.access, m.source] for m in self.mounts],
            "processes": self.processes.value,
            "restart_commands": [list(command) for command in self.restart_commands],
            "expires_at": self.expires_at,
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> SnapshotHandle:
        """Strict: a field missing, unknown or of the wrong type is ``ValueError``."""
        if set(document) != set(_HANDLE_FIELDS) or document["handle_version"] != HANDLE_VERSION:
            raise ValueError("not a version-1 sandbox snapshot handle")
        for name, kind in _HANDLE_FIELDS.items():
            value = document[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"handle field {name} is not {kind}")
        mounts = tuple(Mount(*_strings(m, 3)) for m in document["mounts"])
        commands = tuple(tuple(_strings(c, None)) for c in document["restart_commands"])
        return cls(
            snapshot_id=validate_id(document["snapshot_id"], "snapshot_id"),
            provider=document["provider"],
            provider_version=document["provider_version"],
            sandbox_id=validate_id(document["sandbox_id"], "sandbox_id"),
            generation=document["generation"],
            base_digest=document["base_digest"],
            tree_digest=document["tree_digest"],
            mounts=mounts,
            processes=ProcessRecovery(document["processes"]),
            restart_commands=commands,
            expires_at=float(document["expires_at"]),
        )


_HANDLE_FIELDS: Final[Mapping[str, type | tuple[type, ...]]] = {
    "handle_version": int,
    "snapshot_id": str,
    "provider": str,
    "provider_version": str,
    "sandbox_id": str,
    "generation": int,
    "base_digest": str,
    "tree_digest": str,
    "mounts": list,
    "processes": str,
    "restart_commands": list,
    "expires_at": (int, float),
}


def _strings(value: object, length: int | None) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError("expected a list of strings")
    if length is not None and len(value) != length:
        raise ValueError(f"expected {length} strings")
    return value


@dataclass(frozen=True)
class Pruned:
    """What :meth:`SandboxProvider.prune` removed."""

    snapshots: tuple[str, ...]  # the expired snapshot ids
    manifests: int
    bytes_freed: int


@dataclass(frozen=True)
class Restored:
    """One sandbox a restore brought back: its new generation and what it restarted."""

    sandbox: Sandbox
    snapshot_id: str
    processes: ProcessRecovery
    restarted: tuple[tuple[str, ...], ...]


class SandboxProvider(abc.ABC):
    """The contract (docs/spec.md section 5.7.1). Every method may raise
    :class:`._errors.SandboxError`; a call through a replaced generation raises
    :class:`._errors.SandboxFencedError` and does nothing."""

    name: str
    version: str
    # Where its snapshots live, said so a handle's reader can tell whether this provider
    # reaches them (the local provider: its root directory).
    location: str

    @property
    @abc.abstractmethod
    def capability(self) -> Capability: ...

    @property
    @abc.abstractmethod
    def isolation(self) -> IsolationReport: ...

    @abc.abstractmethod
    async def create(self, sandbox_id: str) -> Sandbox:
        """A new, empty sandbox (generation 1, or past a destroyed one of that id)."""

    @abc.abstractmethod
    async def exec(
        self, sandbox: Sandbox, argv: Sequence[str], *, timeout_seconds: float, stdin: bytes = b""
    ) -> ExecResult:
        """Run a command to completion in the sandbox, killed at ``timeout_seconds``."""

    @abc.abstractmethod
    async def start(self, sandbox: Sandbox, argv: Sequence[str]) -> None:
        """Start a long-running command (a server); recorded for restart-only recovery."""

    @abc.abstractmethod
    async def read_file(self, sandbox: Sandbox, path: str) -> bytes: ...

    @abc.abstractmethod
    async def write_file(self, sandbox: Sandbox, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or replace a file (and its missing directories) inside the sandbox."""

    @abc.abstractmethod
    async def snapshot(self, sandbox: Sandbox, *, retention_seconds: float) -> SnapshotHandle:
        """A durable snapshot of the sandbox's tree, kept for ``retention_seconds``."""

    @abc.abstractmethod
    async def restore(
        self, handles: Sequence[SnapshotHandle], *, attempt: int
    ) -> tuple[Restored, ...]:
        """Bring every handle's sandbox back as a new generation, all or none.

        Nothing is activated unless every snapshot is materialized; then each old
        generation is fenced. ``attempt`` must exceed the attempt of the sandbox's
        previous restore (:class:`._errors.DuplicateRestoreError`).
        """

    @abc.abstractmethod
    async def clone(self, sandbox: Sandbox, new_sandbox_id: str) -> Sandbox:
        """A new sandbox, as :meth:`create` makes it, holding a copy of ``sandbox``'s tree."""

    @abc.abstractmethod
    async def destroy(self, sandbox_id: str) -> None:
        """End the sandbox: its processes killed, its tree removed, every handle fenced."""

    async def prune(self) -> Pruned:
        """Remove the snapshots whose retention has lapsed, and the bytes only they held.

        Safe to call at any time, beside captures and restores in progress. A provider
        whose store lets snapshots lapse by itself removes nothing here.
        """
        return Pruned((), 0, 0)

    async def close(self) -> None:
        """Let go of this process's hold on the sandboxes (their state stays durable)."""
        return None
