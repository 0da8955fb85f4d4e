"""The runtime's background work: commit and restore jobs, and how their failures map.

A commit or restore may outlive the call that started it (docs/spec.md section 4.3: a
retry joins the running work). A job records how far it got, so that a retry resumes
it instead of starting over, and the tasks it runs. Store failures become protocol
reasons here, by type, never by message text (docs/spec.md section 9.4).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId, InvalidIdError

from ._core import WorkKey
from ._results import CommitResult, RestoreResult
from ._store import SnapshotConflictError, WriteCancelled, WriteTicket
from ._store_format import (
    CorruptSnapshotError,
    PlainRecord,
    Record,
    SnapshotEntry,
    UnserialisableRecordError,
)


class Stage(enum.Enum):
    """How far a commit job got: its export is done once, its write may be retried."""

    EXPORTING = "exporting"
    WRITING = "writing"
    DONE = "done"


@dataclass(eq=False)
class CommitJob:
    """One checkpoint's commit: the records exported once, and the write under way."""

    checkpoint_id: str
    fingerprint: tuple[str, frozenset[EpisodeId]]
    snapshot: str
    export_keys: tuple[WorkKey, ...]
    discard_keys: tuple[WorkKey, ...]
    stage: Stage = Stage.EXPORTING
    records: tuple[Record | PlainRecord, ...] | None = None
    discarded: bool = False
    task: asyncio.Task[CommitResult] | None = None
    ticket: WriteTicket | None = None
    write: asyncio.Future[SnapshotEntry] | None = None
    # The coordinator asked for a resume in the commit; released: admission reopened.
    release: bool = False
    released: bool = False


@dataclass(eq=False)
class RestoreJob:
    """The install of one restore, which may outlive its call."""

    restore_id: str
    task: asyncio.Task[RestoreResult]
    background: set[asyncio.Task[Any]] = field(default_factory=set)


def retrieve(task: asyncio.Future[Any]) -> None:
    # A background job whose caller stopped waiting still has its outcome read here,
    # so asyncio never logs "exception was never retrieved" for an answered failure.
    if not task.cancelled():
        task.exception()


def storage_error(error: BaseException, what: str) -> TurnpointError:
    """Map the store's failures to protocol reasons (never by message text)."""
    if isinstance(error, WriteCancelled):
        return TurnpointError(
            Reason.STALE_CHECKPOINT,
            f"{what} was stopped by a resume before it published",
            {"checkpoint_id": error.checkpoint_id},
        )
    if isinstance(error, SnapshotConflictError):
        return TurnpointError(
            Reason.CHECKPOINT_CONFLICT,
            str(error),
            {"snapshot": error.snapshot, "published_checkpoint_id": error.published_checkpoint_id},
        )
    if isinstance(error, UnserialisableRecordError):
        return TurnpointError(
            Reason.INVALID_CHECKPOINT_STATE,
            str(error),
            {"episode": str(error.episode), "key": error.key, "location": error.location},
        )
    if isinstance(error, CorruptSnapshotError):
        return TurnpointError(
            Reason.INVALID_CHECKPOINT_STATE,
            str(error),
            {"snapshot": error.snapshot, "corruption": error.kind.value},
        )
    if isinstance(error, TurnpointError):
        return error
    if isinstance(error, InvalidIdError):
        return TurnpointError(Reason.INVALID_ARGUMENT, str(error), {"field": error.field})
    if isinstance(error, OSError):
        # The participant's own disk (full, failing): transient, the same id is retried.
        return TurnpointError(
            Reason.STORAGE_UNAVAILABLE,
            f"{what} failed on storage: {error.strerror or error}",
            {"errno": str(error.errno)},
        )
    raise error


def slot_of(key: WorkKey) -> str:
    """The hosted kind a work key belongs to (``generate/3`` belongs to ``generate``)."""
    return key.slot.partition("/")[0]
