"""The participant's snapshot store on a shared mount or an object store.

docs/spec.md sections 8.4 and 8.12: the same records file and manifest as on a local
root, as objects ``<snapshot>/<instance>/records-<sha256>.jsonl`` and
``<snapshot>/<instance>/MANIFEST.json``. A write puts the records object (its name is
its digest, so a retry or a concurrent writer of the same records puts the same bytes
under the same key), then creates the manifest with the storage's commit write, which
never replaces: the manifest's arrival is the participant's commit, and a writer that
finds it taken settles against what is published, as on disk.

What differs from a local root: there is no lock and no rename. A write that fails or
is cancelled before its manifest leaves its records object behind (deleting it could
remove the object a concurrent writer of the same records just published); nothing
names it, and it goes with its snapshot's prefix (docs/spec.md section 8.13).

Blocking calls; :class:`~turnpoint.participant_sdk.SnapshotStore` delegates here when
its root is a storage URL.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Final

from turnpoint.protocol import ArtifactRef
from turnpoint.storage import ObjectExistsError, ObjectMissingError, Storage

from ._store_format import (
    MANIFEST_NAME,
    Corruption,
    CorruptSnapshotError,
    Manifest,
    SnapshotEntry,
    entry_of,
    parse_manifest,
)

if TYPE_CHECKING:
    from ._store import FaultHook, FaultPoint, WriteTicket

# parse_manifest checks artifact paths against a directory; objects have none, so a
# directory that cannot exist stands in (the check is lexical there).
_NOWHERE: Final = Path("/nonexistent-turnpoint-objects")


class ObjectRecords:
    """Records and manifests of participants as objects of one :class:`Storage`."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def manifest_key(self, snapshot: str, instance: str) -> str:
        return f"{snapshot}/{instance}/{MANIFEST_NAME}"

    def exists(self, snapshot: str, instance: str) -> bool:
        return self.storage.size(self.manifest_key(snapshot, instance)) is not None

    def write(
        self,
        snapshot: str,
        instance: str,
        data: bytes,
        ref: ArtifactRef,
        manifest: Manifest,
        ticket: WriteTicket,
        faults: FaultHook | None,
        points: type[FaultPoint],
        cancelled: Exception,
        max_manifest_bytes: int,
    ) -> SnapshotEntry:
        manifest_key = self.manifest_key(snapshot, instance)
        records_key = f"{snapshot}/{ref.path}"
        where = Path(snapshot, ref.path)
        if self.storage.size(manifest_key) is not None:
            return self._settle(snapshot, instance, manifest, ticket, cancelled, max_manifest_bytes)
        if not ticket._still_writing():
            raise cancelled
        if faults is not None:
            faults.hit(points.RECORDS_WRITE, where)
        if not ticket._still_writing():
            raise cancelled
        self.storage.put(records_key, data)
        if faults is not None:
            faults.hit(points.PUBLISH, where)
        if not ticket._begin_publish():
            raise cancelled
        if faults is not None:
            faults.hit(points.MANIFEST_WRITE, Path(snapshot, instance, MANIFEST_NAME))
        manifest_bytes = manifest.to_bytes()
        try:
            self.storage.create(manifest_key, manifest_bytes)
        except ObjectExistsError:
            return self._settle(snapshot, instance, manifest, ticket, None, max_manifest_bytes)
        return entry_of(manifest, manifest_bytes)

    def _settle(
        self,
        snapshot: str,
        instance: str,
        ours: Manifest,
        ticket: WriteTicket,
        cancelled: Exception | None,
        max_manifest_bytes: int,
    ) -> SnapshotEntry:
        from ._store import SnapshotConflictError

        published, published_bytes = self.load_manifest(snapshot, instance, max_manifest_bytes)
        if published != ours:
            raise SnapshotConflictError(
                snapshot, instance, published.checkpoint_id, ours.checkpoint_id
            )
        for ref in published.artifacts:
            if self.storage.size(f"{snapshot}/{ref.path}") != ref.size_bytes:
                raise CorruptSnapshotError(
                    snapshot, instance, Corruption.SIZE_MISMATCH, f"{ref.path} is damaged"
                )
        if cancelled is not None and not ticket._begin_publish():
            raise cancelled
        return entry_of(published, published_bytes)

    def load_manifest(self, snapshot: str, instance: str, limit: int) -> tuple[Manifest, bytes]:
        data = self.get(snapshot, instance, self.manifest_key(snapshot, instance), limit)
        if len(data) > limit:
            raise CorruptSnapshotError(
                snapshot, instance, Corruption.MANIFEST_INVALID, "manifest is too large"
            )
        directory = _NOWHERE / snapshot / instance
        return parse_manifest(snapshot, instance, directory, data), data

    def get(self, snapshot: str, instance: str, key: str, limit: int) -> bytes:
        try:
            return self.storage.get(key, limit=limit)
        except ObjectMissingError:
            raise CorruptSnapshotError(
                snapshot, instance, Corruption.MISSING, f"{key.rpartition('/')[2]} does not exist"
            ) from None

    def delete_snapshot(self, snapshot: str) -> bool:
        objects = self.storage.list(f"{snapshot}/")
        for info in objects:
            self.storage.delete(info.key)
        return bool(objects)
