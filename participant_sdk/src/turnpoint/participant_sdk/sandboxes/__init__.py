"""Sandboxes: a resources server's state as real files and processes (docs/spec.md section 5.7).

A :class:`SandboxProvider` hosts sandboxes and reports its :class:`Capability` and its
:class:`IsolationReport`. Every call goes through a :class:`Sandbox` (one id, one
generation); :meth:`SandboxProvider.snapshot` returns a durable :class:`SnapshotHandle`,
and :meth:`SandboxProvider.restore` brings a set of handles back as new generations, all
or none (each a :class:`Restored`), fencing the old ones.

:class:`LocalSandboxProvider` is the reference: directories on this machine, processes
under bubblewrap where it works, snapshots as content-addressed zstd chunks in a
:class:`ChunkStore` (usable alone: a tree in, a :class:`TreeManifest` out, and back).

:class:`SandboxResourcesServer` is a resources server built on a provider: subclass it
(set up, tool, score) and each episode's :class:`SandboxSession` is snapshotted, restored
into a new generation and destroyed for you, as a :class:`SavedSession`; what a command
running at a checkpoint does is its :class:`InFlight`.

Errors, all :class:`SandboxError` (a :class:`turnpoint.participant_sdk.ParticipantError`):
:class:`SnapshotRefusedError` (with its :class:`Refusal`), :class:`SandboxFencedError`,
:class:`SandboxNotFoundError`, :class:`SandboxExistsError`, :class:`SnapshotNotFoundError`,
:class:`SnapshotExpiredError`, :class:`StaleHandleError`, :class:`DuplicateRestoreError`,
:class:`UnsupportedOperationError`, :class:`SandboxPathError`,
:class:`IsolationUnavailableError`, :class:`ProviderStateError`,
:class:`SnapshotElsewhereError`, :class:`CommandCutError`.
"""

from ._chunks import Capture, ChunkStore
from ._errors import (
    CommandCutError,
    DuplicateRestoreError,
    IsolationUnavailableError,
    ProviderStateError,
    Refusal,
    SandboxError,
    SandboxExistsError,
    SandboxFencedError,
    SandboxNotFoundError,
    SandboxPathError,
    SnapshotElsewhereError,
    SnapshotExpiredError,
    SnapshotNotFoundError,
    SnapshotRefusedError,
    StaleHandleError,
    UnsupportedOperationError,
)
from ._format import Limits, TreeManifest
from ._local import LocalSandboxProvider
from ._provider import (
    Capability,
    ExecResult,
    Isolation,
    IsolationReport,
    Mount,
    ProcessRecovery,
    Pruned,
    ResourceLimits,
    Restored,
    Sandbox,
    SandboxProvider,
    SnapshotHandle,
)
from ._server import InFlight, SandboxResourcesServer, SandboxSession, SavedSession

__all__ = [
    "Capability",
    "Capture",
    "ChunkStore",
    "CommandCutError",
    "DuplicateRestoreError",
    "ExecResult",
    "InFlight",
    "Isolation",
    "IsolationReport",
    "IsolationUnavailableError",
    "Limits",
    "LocalSandboxProvider",
    "Mount",
    "ProcessRecovery",
    "ProviderStateError",
    "Pruned",
    "Refusal",
    "ResourceLimits",
    "Restored",
    "Sandbox",
    "SandboxError",
    "SandboxExistsError",
    "SandboxFencedError",
    "SandboxNotFoundError",
    "SandboxPathError",
    "SandboxProvider",
    "SandboxResourcesServer",
    "SandboxSession",
    "SavedSession",
    "SnapshotElsewhereError",
    "SnapshotExpiredError",
    "SnapshotHandle",
    "SnapshotNotFoundError",
    "SnapshotRefusedError",
    "StaleHandleError",
    "TreeManifest",
    "UnsupportedOperationError",
]
