"""What the sandbox layer raises: one root, :class:`SandboxError`, under the SDK's own.

Each error carries the :class:`turnpoint.errors.Reason` a hook that lets it escape
reports to the coordinator (docs/spec.md section 5.7), and its data as attributes:
callers branch on the class and its ``kind``, never on the text.

Pure: no grpc, no asyncio, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from turnpoint.errors import Reason

from .._failures import ParticipantError


class SandboxError(ParticipantError):
    """Root of the sandbox layer's errors. ``OSError`` from the disk is never wrapped."""

    def __init__(
        self, reason: Reason, message: str, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(reason, message, metadata)


class Refusal(enum.Enum):
    """Why a snapshot is refused, before (or instead of) writing anything of it."""

    MANIFEST_INVALID = "manifest_invalid"
    PATH_ESCAPE = "path_escape"  # absolute, "..", "." or empty components
    DUPLICATE_PATH = "duplicate_path"
    PARENT_MISSING = "parent_missing"  # an entry whose directory is not listed before it
    BENEATH_SYMLINK = "beneath_symlink"
    SYMLINK_ESCAPE = "symlink_escape"
    TOO_MANY_ENTRIES = "too_many_entries"
    TOO_MANY_BYTES = "too_many_bytes"
    CHUNK_MISSING = "chunk_missing"
    CHUNK_TRUNCATED = "chunk_truncated"
    CHUNK_CORRUPT = "chunk_corrupt"
    TARGET_EXISTS = "target_exists"


class SnapshotRefusedError(SandboxError):
    """A sandbox snapshot that is hostile, damaged or too large; nothing of it was written.

    ``path`` is the manifest entry (or chunk digest) it concerns, ``""`` for the whole.
    """

    def __init__(self, kind: Refusal, path: str, detail: str) -> None:
        self.kind = kind
        self.path = path
        self.detail = detail
        super().__init__(
            Reason.INVALID_CHECKPOINT_STATE,
            f"sandbox snapshot refused ({kind.value}) at {path!r}: {detail}",
            {"refusal": kind.value},
        )


class SandboxNotFoundError(SandboxError):
    """No sandbox of that id (never created, or destroyed)."""

    def __init__(self, sandbox: str) -> None:
        self.sandbox = sandbox
        super().__init__(Reason.NOT_FOUND, f"no sandbox {sandbox!r}", {"sandbox": sandbox})


class SandboxExistsError(SandboxError):
    """Create or clone under an id a live sandbox has."""

    def __init__(self, sandbox: str) -> None:
        self.sandbox = sandbox
        super().__init__(
            Reason.INVALID_ARGUMENT, f"sandbox {sandbox!r} exists", {"sandbox": sandbox}
        )


class SandboxFencedError(SandboxError):
    """A call through a generation that a restore has replaced: it can do nothing more."""

    def __init__(self, sandbox: str, generation: int, active: int | None) -> None:
        self.sandbox = sandbox
        self.generation = generation
        self.active = active
        now = "destroyed" if active is None else f"at generation {active}"
        super().__init__(
            Reason.FENCED,
            f"sandbox {sandbox!r} generation {generation} is fenced (the sandbox is {now})",
            {"sandbox": sandbox, "generation": str(generation)},
        )


class SnapshotNotFoundError(SandboxError):
    """A snapshot handle names a snapshot the provider does not hold."""

    def __init__(self, snapshot: str) -> None:
        self.snapshot = snapshot
        super().__init__(
            Reason.NOT_FOUND, f"no sandbox snapshot {snapshot!r}", {"snapshot": snapshot}
        )


class SnapshotExpiredError(SandboxError):
    """The snapshot's retention has lapsed: it may be gone and is never restored."""

    def __init__(self, snapshot: str, expired_at: float) -> None:
        self.snapshot = snapshot
        self.expired_at = expired_at
        super().__init__(
            Reason.NOT_FOUND,
            f"sandbox snapshot {snapshot!r} expired (retention ended at {expired_at})",
            # Said apart from a missing snapshot (the same reason) by this key.
            {"snapshot": snapshot, "expired_at": repr(expired_at)},
        )


class StaleHandleError(SandboxError):
    """A snapshot handle that is not the record the provider wrote for that snapshot id.

    A handle kept from another provider (or version), or edited: its tree digest,
    sandbox or generation disagree with the durable record, so it restores nothing.
    """

    def __init__(self, snapshot: str, field: str) -> None:
        self.snapshot = snapshot
        self.field = field
        super().__init__(
            Reason.STALE_CHECKPOINT,
            f"sandbox snapshot handle {snapshot!r} disagrees with its record on {field}",
            {"snapshot": snapshot, "field": field},
        )


class DuplicateRestoreError(SandboxError):
    """A restore under an attempt that already restored this sandbox (or an older one)."""

    def __init__(self, sandbox: str, attempt: int, restored_attempt: int) -> None:
        self.sandbox = sandbox
        self.attempt = attempt
        self.restored_attempt = restored_attempt
        super().__init__(
            Reason.STALE_ATTEMPT,
            f"sandbox {sandbox!r} was already restored under attempt {restored_attempt};"
            f" attempt {attempt} restores nothing",
            {"sandbox": sandbox, "attempt": str(attempt)},
        )


class UnsupportedOperationError(SandboxError):
    """The provider's capability level does not include the operation."""

    def __init__(self, operation: str, capability: str) -> None:
        self.operation = operation
        self.capability = capability
        super().__init__(
            Reason.INVALID_ARGUMENT,
            f"a sandbox provider at level {capability!r} cannot {operation}",
            {"operation": operation, "capability": capability},
        )


class IsolationUnavailableError(SandboxError):
    """The isolation mechanism a provider was asked to require does not work here."""

    def __init__(self, mechanism: str) -> None:
        self.mechanism = mechanism
        super().__init__(
            Reason.INVALID_ARGUMENT,
            f"sandbox isolation {mechanism!r} does not work on this machine",
            {"mechanism": mechanism},
        )


class ProviderStateError(SandboxError):
    """A provider's own state file is damaged: it opens nothing rather than guess."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(
            Reason.INVALID_CHECKPOINT_STATE, f"{path} is damaged: {detail}", {"path": path}
        )


class SandboxPathError(SandboxError):
    """A file path given to read or write that is not a plain path inside the sandbox."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(
            Reason.INVALID_ARGUMENT, f"sandbox path {path!r} refused: {detail}", {"path": path}
        )


class SnapshotElsewhereError(SandboxError):
    """A saved session's snapshot lives in a store this participant's provider does not
    reach: it was configured with another sandbox root than the one that took it."""

    def __init__(self, snapshot: str, store: str, configured: str) -> None:
        self.snapshot = snapshot
        self.store = store
        self.configured = configured
        super().__init__(
            Reason.INVALID_CHECKPOINT_STATE,
            f"sandbox snapshot {snapshot!r} lives in {store!r}, but this participant's "
            f"sandboxes are in {configured!r}: configure the root that took it",
            {"snapshot": snapshot, "store": store},
        )


class CommandCutError(SandboxError):
    """A command killed because a checkpoint closed admission (``InFlight.CUT``).

    What it did before the kill stays in the tree, and so in the snapshot.
    """

    def __init__(self, sandbox: str) -> None:
        self.sandbox = sandbox
        super().__init__(
            Reason.ADMISSION_CLOSED,
            f"the command in sandbox {sandbox!r} was cut by a checkpoint",
            {"sandbox": sandbox},
        )
