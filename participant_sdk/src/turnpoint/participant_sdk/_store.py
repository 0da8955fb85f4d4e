"""The participant's snapshot store: records files and manifests on disk.

docs/spec.md sections 8.1-8.5.

Layout under the configured root, every component a validated id::

    <root>/<snapshot>/<instance>/records-<sha256>.jsonl   one record per line (JSON Lines)
    <root>/<snapshot>/<instance>/MANIFEST.json            created last, never replaced

A write serialises every record first (a bad payload fails before a byte is written),
writes a hidden temporary file, fsyncs it and links it to its digest name; only then is
the manifest created, itself from a fsynced temporary file linked into place so that it
appears whole or not at all, and the directory is fsynced once for both links. One fsync
per file and per directory the participant owns: the records file, the manifest and the
instance directory. The instance directory's own entry in the shared snapshot directory
is the coordinator's publication to make durable (one fsync of that directory for every
participant, not one per participant). ``os.link`` fails instead of replacing,
which is what makes "a directory with a manifest never changes" hold even against a
writer that does not play by the rules. Cooperating writers (threads or processes)
also serialise the short publish step with ``flock`` on the instance directory, so a
loser can never delete a records file that the winner's manifest names.

A read verifies the manifest, then the size, digest and record count of the whole
records file before it returns any record.

The bytes themselves (encoding, strict decoding) are :mod:`._store_format`; the durable
write steps are the core's :mod:`turnpoint._files`. Everything here is blocking file
I/O and plain threading: the asyncio runtime calls it through ``asyncio.to_thread``.
It imports neither grpc nor asyncio.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Final, NoReturn, Protocol

from turnpoint._files import create_file, fsync_dir, write_temp
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId, validate_id
from turnpoint.protocol import ArtifactRef
from turnpoint.storage import open_storage

from ._store_format import (
    MANIFEST_NAME,
    RECORDS_NAME,
    Corruption,
    CorruptSnapshotError,
    LoadedSnapshot,
    Manifest,
    PlainRecord,
    Record,
    RecordsFile,
    SnapshotEntry,
    StoreError,
    decode_records,
    encode_records,
    entry_of,
    parse_manifest,
    plain_record,
    record_lines,
)
from ._store_objects import ObjectRecords

# A manifest lists one file and the exported episodes (~60 bytes each); this bounds
# what a tampered manifest can make a reader allocate.
_MAX_MANIFEST_BYTES: Final = 64 * 1024 * 1024
# Owner read-write, everyone read: the coordinator verifies these files in place.
_FILE_MODE: Final = 0o644


# --------------------------------------------------------------------------- errors


class SnapshotConflictError(StoreError):
    """The directory already holds a published snapshot other than the one being written."""

    _reason = Reason.CHECKPOINT_CONFLICT

    def __init__(
        self, snapshot: str, instance: str, published_checkpoint_id: str, checkpoint_id: str
    ) -> None:
        self.snapshot = snapshot
        self.instance = instance
        self.published_checkpoint_id = published_checkpoint_id
        self.checkpoint_id = checkpoint_id
        same = published_checkpoint_id == checkpoint_id
        super().__init__(
            f"snapshot {snapshot!r} of instance {instance!r} is already published for "
            f"checkpoint {published_checkpoint_id!r}"
            + (" with other content" if same else f", not {checkpoint_id!r}"),
            {"snapshot": snapshot, "published_checkpoint_id": published_checkpoint_id},
        )


class WriteCancelled(StoreError):
    """The write's ticket was cancelled before publication; nothing of it is left on disk."""

    _reason = Reason.STALE_CHECKPOINT

    def __init__(self, snapshot: str, instance: str, checkpoint_id: str) -> None:
        self.snapshot = snapshot
        self.instance = instance
        self.checkpoint_id = checkpoint_id
        super().__init__(
            f"write of checkpoint {checkpoint_id!r} into snapshot {snapshot!r} "
            f"of instance {instance!r} was cancelled before publication",
            {"checkpoint_id": checkpoint_id},
        )


# --------------------------------------------------------------------------- tickets


class WriteState(enum.Enum):
    """WRITING -> PUBLISHING -> PUBLISHED | FAILED, or WRITING -> CANCELLED (or FAILED)."""

    WRITING = "writing"
    PUBLISHING = "publishing"
    PUBLISHED = "published"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def settled(self) -> bool:
        return self in _SETTLED


_SETTLED: Final = frozenset({WriteState.PUBLISHED, WriteState.FAILED, WriteState.CANCELLED})


class WriteTicket:
    """The handshake between one commit write and a ``Resume`` that wants to stop it.

    Create one per write and pass it to :meth:`SnapshotStore.write`. :meth:`cancel`
    returns the state it found the write in afterwards: ``CANCELLED`` (the write will
    not publish and leaves nothing behind), ``PUBLISHING`` (publication is under way and
    cannot be stopped: :meth:`wait` for it), or a settled ``PUBLISHED``/``FAILED``.
    Thread-safe; all transitions happen under one condition.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._state = WriteState.WRITING
        self._claimed = False

    @property
    def state(self) -> WriteState:
        with self._changed:
            return self._state

    def cancel(self) -> WriteState:
        with self._changed:
            if self._state is WriteState.WRITING:
                self._set_state(WriteState.CANCELLED)
            return self._state

    def wait(self, timeout: float | None = None) -> WriteState:
        """Block until the write has settled or ``timeout`` passed; return the state."""
        with self._changed:
            self._changed.wait_for(lambda: self._state.settled, timeout)
            return self._state

    # The writer's side of the handshake; only SnapshotStore calls these.

    def _claim(self) -> bool:
        with self._changed:
            if self._claimed:
                raise ValueError("a WriteTicket serves exactly one write")
            self._claimed = True
            return self._state is WriteState.WRITING

    def _still_writing(self) -> bool:
        with self._changed:
            return self._state is WriteState.WRITING

    def _begin_publish(self) -> bool:
        with self._changed:
            if self._state is not WriteState.WRITING:
                return False
            self._set_state(WriteState.PUBLISHING)
            return True

    def _settle(self, published: bool) -> None:
        with self._changed:
            if self._state is WriteState.CANCELLED:
                return
            self._set_state(WriteState.PUBLISHED if published else WriteState.FAILED)

    def _set_state(self, state: WriteState) -> None:
        self._state = state
        self._changed.notify_all()

    def __repr__(self) -> str:
        return f"WriteTicket(state={self.state.value})"


# --------------------------------------------------------------------------- faults


class FaultPoint(enum.Enum):
    """Named places in the write path where a :class:`FaultHook` can strike."""

    # Before each chunk of the temporary records file is written.
    RECORDS_WRITE = "records_write"
    # Records durable under their digest name; the ticket is still WRITING.
    PUBLISH = "publish"
    # The ticket is PUBLISHING; the manifest is about to be written.
    MANIFEST_WRITE = "manifest_write"


class FaultHook(Protocol):
    """Called at each :class:`FaultPoint` a write passes; may block or raise ``OSError``.

    Production stores have none; :class:`turnpoint.participant_sdk.testing.StoreFaults`
    is the deterministic, named implementation tests and ``--faults`` use.
    """

    def hit(self, point: FaultPoint, path: Path) -> None: ...


# --------------------------------------------------------------------------- the store


class SnapshotStore:
    """Writes and reads participant snapshots under one configured root.

    ``root`` is a directory, or a storage URL (``file:///path?mount=shared``,
    ``s3://bucket/prefix``; docs/spec.md section 8.12) whose objects
    :mod:`._store_objects` writes and reads instead of files.
    """

    def __init__(self, root: str | os.PathLike[str], *, faults: FaultHook | None = None) -> None:
        self._objects: ObjectRecords | None = None
        if isinstance(root, str) and "://" in root:
            self._objects = ObjectRecords(open_storage(root))
            root = f"/nonexistent-turnpoint-objects/{secrets.token_hex(4)}"
        self._root = Path(root)
        self._faults = faults

    @property
    def url(self) -> str:
        """Where the records go: the storage URL, or the root directory as a file URL."""
        if self._objects is not None:
            return self._objects.storage.url
        return self._root.absolute().as_uri()

    def check(self) -> None:
        """Reach the storage once (a clear error for refused credentials); blocking."""
        if self._objects is not None:
            self._objects.storage.check()

    @property
    def root(self) -> Path:
        return self._root

    def _hit(self, point: FaultPoint, path: Path) -> None:
        if self._faults is not None:
            self._faults.hit(point, path)

    def instance_dir(self, snapshot: str, instance: str) -> Path:
        """``<root>/<snapshot>/<instance>``; raises ``InvalidIdError`` on a bad id."""
        return self._root / validate_id(snapshot, "snapshot") / validate_id(instance, "instance")

    def exists(self, snapshot: str, instance: str) -> bool:
        """Whether a manifest is published for this instance (its content is not checked)."""
        if self._objects is not None:
            return self._objects.exists(
                validate_id(snapshot, "snapshot"), validate_id(instance, "instance")
            )
        directory = self._checked_dir(snapshot, instance)
        return (directory / MANIFEST_NAME).exists()

    # ---------------------------------------------------------------- writing

    def write(
        self,
        snapshot: str,
        instance: str,
        checkpoint_id: str,
        records: Iterable[Record | PlainRecord],
        *,
        ticket: WriteTicket | None = None,
    ) -> SnapshotEntry:
        """Write ``records`` and publish them for ``checkpoint_id``; return what was published.

        The same records for the same checkpoint give the same bytes and digest, so a
        retry after a failure or a lost reply returns the published entry. A published
        directory for another checkpoint, or other content, is a
        :class:`SnapshotConflictError`. ``OSError`` from the disk propagates with nothing
        of this write left behind.
        """
        if ticket is None:
            ticket = WriteTicket()
        # Claimed before anything can fail, so that every claimed ticket settles.
        if not ticket._claim():
            raise WriteCancelled(snapshot, instance, checkpoint_id)
        published = False
        try:
            validate_id(snapshot, "snapshot")
            validate_id(instance, "instance")
            validate_id(checkpoint_id, "checkpoint_id")
            entry = self._write(snapshot, instance, checkpoint_id, records, ticket)
            published = True
            return entry
        finally:
            ticket._settle(published)

    def _write(
        self,
        snapshot: str,
        instance: str,
        checkpoint_id: str,
        records: Iterable[Record | PlainRecord],
        ticket: WriteTicket,
    ) -> SnapshotEntry:
        # Every record checked before a byte is written (docs/spec.md section 8.2).
        plain = [plain_record(record) for record in records]
        if self._objects is not None:
            data, ref, episodes = encode_records(instance, plain)
            return self._objects.write(
                snapshot,
                instance,
                data,
                ref,
                Manifest(checkpoint_id, instance, (ref,), episodes),
                ticket,
                self._faults,
                FaultPoint,
                WriteCancelled(snapshot, instance, checkpoint_id),
                _MAX_MANIFEST_BYTES,
            )
        directory = self._make_dir(snapshot, instance)

        # Fast path for a retry: a published directory never changes, so no lock needed.
        if (directory / MANIFEST_NAME).exists():
            return self._settle_against_published(
                snapshot, instance, directory, _manifest(checkpoint_id, instance, plain), ticket
            )
        if not ticket._still_writing():
            raise WriteCancelled(snapshot, instance, checkpoint_id)

        def before_chunk(path: Path) -> None:
            self._hit(FaultPoint.RECORDS_WRITE, path)
            if not ticket._still_writing():
                raise WriteCancelled(snapshot, instance, checkpoint_id)

        # The lines go to the file as they are encoded, the digest that names it taken
        # on the way: the file is never whole in memory. A leading dot can never collide
        # with a valid id or a published file name.
        described = RecordsFile()
        lines = (described.add(episode, line) for episode, line in record_lines(plain))
        temp = write_temp(directory, ".records-", lines, mode=_FILE_MODE, before_chunk=before_chunk)
        temp_left = True
        try:
            ref = described.ref(instance)
            manifest = Manifest(checkpoint_id, instance, (ref,), described.episodes())
            with _locked_dir(directory) as dir_fd:
                if (directory / MANIFEST_NAME).exists():
                    return self._settle_against_published(
                        snapshot, instance, directory, manifest, ticket
                    )
                entry = self._publish(
                    snapshot, directory, dir_fd, temp, ref, manifest, manifest.to_bytes(), ticket
                )
                temp_left = False  # published: the temporary name went with the link
                return entry
        finally:
            if temp_left:
                temp.unlink(missing_ok=True)

    def _publish(
        self,
        snapshot: str,
        directory: Path,
        dir_fd: int,
        temp: Path,
        ref: ArtifactRef,
        manifest: Manifest,
        manifest_bytes: bytes,
        ticket: WriteTicket,
    ) -> SnapshotEntry:
        """The publish step; runs under the directory lock with no manifest present."""
        instance = manifest.instance
        # Under the lock and without a manifest, a digest-named file can only be the
        # remains of a writer that died mid-publish: nothing names it, so it goes.
        for name in os.listdir(directory):
            if RECORDS_NAME.fullmatch(name):
                (directory / name).unlink()
        final = directory / _file_name(ref.path)
        os.link(temp, final)
        keep_records = False

        def linked() -> None:
            # From the instant the manifest exists it names the records file: keep it,
            # whatever fails after.
            nonlocal keep_records
            keep_records = True

        try:
            temp.unlink()
            # No fsync of the directory here: the manifest's own link below ends with
            # one, which makes both entries durable (one fsync per directory, docs/spec.md
            # section 8.4). Nothing reads the directory before this write returns, and a
            # reader verifies the records file the manifest names anyway (section 8.5).
            self._hit(FaultPoint.PUBLISH, final)
            if not ticket._begin_publish():
                raise WriteCancelled(snapshot, instance, manifest.checkpoint_id)
            try:
                create_file(
                    directory / MANIFEST_NAME,
                    manifest_bytes,
                    temp_prefix=".manifest-",
                    mode=_FILE_MODE,
                    before_chunk=lambda path: self._hit(FaultPoint.MANIFEST_WRITE, path),
                    linked=linked,
                    directory_fd=dir_fd,
                )
            except FileExistsError:
                # Only a writer that ignores the lock gets here; its manifest stands.
                published = self._load_manifest(snapshot, instance, directory)[0]
                keep_records = ref in published.artifacts
                return self._settle_against_published(
                    snapshot, instance, directory, manifest, ticket
                )
        finally:
            if not keep_records:
                final.unlink(missing_ok=True)
                with suppress(OSError):
                    os.fsync(dir_fd)
        return entry_of(manifest, manifest_bytes)

    def _settle_against_published(
        self,
        snapshot: str,
        instance: str,
        directory: Path,
        ours: Manifest,
        ticket: WriteTicket,
    ) -> SnapshotEntry:
        published, published_bytes = self._load_manifest(snapshot, instance, directory)
        if published != ours:
            raise SnapshotConflictError(
                snapshot, instance, published.checkpoint_id, ours.checkpoint_id
            )
        for ref in published.artifacts:
            try:
                size = os.stat(directory / _file_name(ref.path)).st_size
            except FileNotFoundError:
                size = -1
            if size != ref.size_bytes:
                raise CorruptSnapshotError(
                    snapshot, instance, Corruption.SIZE_MISMATCH, f"{ref.path} is damaged"
                )
        if not ticket._begin_publish():
            raise WriteCancelled(snapshot, instance, ours.checkpoint_id)
        # The earlier writer may have failed between linking and fsyncing the directory.
        fsync_dir(directory)
        return entry_of(published, published_bytes)

    def _make_dir(self, snapshot: str, instance: str) -> Path:
        directory = self._checked_dir(snapshot, instance)
        # No fsync of the parents: the entries made here (the instance directory in the
        # shared snapshot directory, that one in the root) are the publication's to make
        # durable, which syncs the snapshot directory and the root once each for every
        # participant (docs/spec.md sections 8.4 and 8.9). Nothing uses this directory
        # before its snapshot is published.
        directory.mkdir(parents=True, exist_ok=True)
        # Re-check now that the components exist: one could be a symlink planted meanwhile.
        return self._checked_dir(snapshot, instance)

    # ---------------------------------------------------------------- reading

    def read_entry(self, snapshot: str, instance: str) -> SnapshotEntry:
        """Parse and check the published manifest (not the records file it names)."""
        directory = self._checked_dir(snapshot, instance)
        manifest, manifest_bytes = self._load_manifest(snapshot, instance, directory)
        return entry_of(manifest, manifest_bytes)

    def read(
        self,
        snapshot: str,
        instance: str,
        expected: ArtifactRef | SnapshotEntry | None,
        select: Callable[[EpisodeId], bool] | None = None,
        *,
        checkpoint_id: str | None = None,
        artifacts: Sequence[ArtifactRef] | None = None,
    ) -> LoadedSnapshot:
        """Verify a published instance directory whole, then return the selected records.

        ``expected`` is what the caller was told: the manifest's own reference (as in a
        restore request's manifest entry), a full :class:`SnapshotEntry`, or ``None`` to
        trust the manifest on disk. ``checkpoint_id`` and ``artifacts`` are further
        expectations. Every mismatch, and any damage, raises
        :class:`CorruptSnapshotError` before any record is returned; ``select`` (a
        predicate over episodes) filters only after the whole file has been verified.
        """
        directory = self._checked_dir(snapshot, instance)
        manifest, manifest_bytes = self._load_manifest(snapshot, instance, directory)
        entry = entry_of(manifest, manifest_bytes)

        def unexpected(what: str) -> NoReturn:
            raise CorruptSnapshotError(snapshot, instance, Corruption.UNEXPECTED_CONTENT, what)

        if isinstance(expected, SnapshotEntry):
            if expected != entry:
                unexpected(f"published entry {entry} differs from the expected {expected}")
        elif isinstance(expected, ArtifactRef):
            if expected != entry.manifest:
                unexpected(f"manifest {entry.manifest} differs from the expected {expected}")
        elif expected is not None:
            raise TypeError(f"expected must be an ArtifactRef or SnapshotEntry, not {expected!r}")
        if checkpoint_id is not None and checkpoint_id != manifest.checkpoint_id:
            unexpected(f"holds checkpoint {manifest.checkpoint_id!r}, not {checkpoint_id!r}")
        if artifacts is not None and tuple(artifacts) != manifest.artifacts:
            unexpected(f"artifacts {manifest.artifacts} differ from the expected {artifacts}")

        loaded: list[Record] = []
        for ref in manifest.artifacts:
            data = self._read_verified(snapshot, instance, directory, ref)
            loaded.extend(decode_records(snapshot, instance, ref, data))
        found = tuple(sorted({record.episode for record in loaded}))
        if found != manifest.episodes:
            raise CorruptSnapshotError(
                snapshot,
                instance,
                Corruption.EPISODES_MISMATCH,
                f"records hold episodes {[str(e) for e in found]}, "
                f"the manifest lists {[str(e) for e in manifest.episodes]}",
            )
        if select is None:
            return LoadedSnapshot(entry, tuple(loaded))
        chosen = {episode: bool(select(episode)) for episode in found}
        return LoadedSnapshot(entry, tuple(r for r in loaded if chosen[r.episode]))

    def _load_manifest(
        self, snapshot: str, instance: str, directory: Path
    ) -> tuple[Manifest, bytes]:
        if self._objects is not None:
            return self._objects.load_manifest(snapshot, instance, _MAX_MANIFEST_BYTES)
        data = _read_file(snapshot, instance, directory / MANIFEST_NAME, _MAX_MANIFEST_BYTES)
        if len(data) > _MAX_MANIFEST_BYTES:
            raise CorruptSnapshotError(
                snapshot, instance, Corruption.MANIFEST_INVALID, "manifest is too large"
            )
        return parse_manifest(snapshot, instance, directory, data), data

    def _read_verified(
        self, snapshot: str, instance: str, directory: Path, ref: ArtifactRef
    ) -> bytes:
        path = directory / _file_name(ref.path)
        # One byte more than promised, so a file that grew is caught without reading it all.
        if self._objects is not None:
            key = f"{snapshot}/{instance}/{_file_name(ref.path)}"
            data = self._objects.get(snapshot, instance, key, ref.size_bytes)
        else:
            data = _read_file(snapshot, instance, path, ref.size_bytes)
        if len(data) != ref.size_bytes:
            raise CorruptSnapshotError(
                snapshot,
                instance,
                Corruption.SIZE_MISMATCH,
                f"{ref.path} has {'more than ' if len(data) > ref.size_bytes else ''}"
                f"{len(data)} bytes, the manifest says {ref.size_bytes}",
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != ref.sha256:
            raise CorruptSnapshotError(
                snapshot,
                instance,
                Corruption.DIGEST_MISMATCH,
                f"{ref.path} has sha256 {digest}, the manifest says {ref.sha256}",
            )
        return data

    # ---------------------------------------------------------------- cleanup

    def delete_snapshot_dir(self, snapshot: str) -> bool:
        """Remove ``<root>/<snapshot>`` and everything in it; False if it was not there.

        For retention of old snapshots; the caller makes sure nothing writes into it.
        """
        validate_id(snapshot, "snapshot")
        if self._objects is not None:
            return self._objects.delete_snapshot(snapshot)
        path = self._root / snapshot
        self._check_inside_root(path, snapshot, "*")
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            return False
        fsync_dir(self._root)
        return True

    # ---------------------------------------------------------------- paths

    def _checked_dir(self, snapshot: str, instance: str) -> Path:
        directory = self.instance_dir(snapshot, instance)
        self._check_inside_root(directory, snapshot, instance)
        return directory

    def _check_inside_root(self, path: Path, snapshot: str, instance: str) -> None:
        if self._objects is not None:
            return  # keys are ids only: nothing can be planted outside the prefix
        # Valid ids cannot name a path outside the root (no separators, no "..") but a
        # symlink planted under the root still could: no component below the root may
        # be one. An lstat per component, not a resolve of the whole path from "/":
        # every record write checks twice.
        current = self._root
        for part in path.relative_to(self._root).parts:
            current = current / part
            try:
                mode = os.lstat(current).st_mode
            except FileNotFoundError:
                return
            if stat.S_ISLNK(mode):
                raise CorruptSnapshotError(
                    snapshot, instance, Corruption.PATH_ESCAPE, f"{current} is a symlink"
                )


# --------------------------------------------------------------------------- file helpers


def _manifest(checkpoint_id: str, instance: str, records: list[PlainRecord]) -> Manifest:
    """The manifest ``records`` would be published with (encoded in memory)."""
    _, ref, episodes = encode_records(instance, records)
    return Manifest(checkpoint_id, instance, (ref,), episodes)


def _file_name(path: str) -> str:
    return path.rpartition("/")[2]


def _read_file(snapshot: str, instance: str, path: Path, limit: int) -> bytes:
    """Read at most ``limit + 1`` bytes of a regular file that is not a symlink."""
    try:
        # O_NONBLOCK: opening a planted FIFO must fail the check below, not hang.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptSnapshotError(
            snapshot, instance, Corruption.MISSING, f"{path.name} does not exist"
        ) from None
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise CorruptSnapshotError(
            snapshot, instance, Corruption.PATH_ESCAPE, f"{path.name} is a symlink"
        ) from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise CorruptSnapshotError(
                snapshot, instance, Corruption.RECORD_INVALID, f"{path.name} is not a regular file"
            )
        return file.read(limit + 1)


@contextmanager
def _locked_dir(path: Path) -> Iterator[int]:
    """Hold an exclusive ``flock`` on a directory; yields its fd (also used to fsync it).

    ``flock`` locks belong to the open file description, so two threads of one process
    exclude each other just as two processes do.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)
