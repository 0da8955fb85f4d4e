"""The participant's snapshot store: records files and manifests on disk (PROTOCOL.md 8).

Layout under the configured root, every component a validated id::

    <root>/<snapshot>/<instance>/records-<sha256>.jsonl   one record per line (JSON Lines)
    <root>/<snapshot>/<instance>/MANIFEST.json            created last, never replaced

A write serialises every record first (a bad payload fails before a byte is written),
writes a hidden temporary file, fsyncs it, links it to its digest name and fsyncs the
directory; only then is the manifest created, itself from a temporary file linked into
place so that it appears whole or not at all. ``os.link`` fails instead of replacing,
which is what makes "a directory with a manifest never changes" hold even against a
writer that does not play by the rules. Cooperating writers (threads or processes)
also serialise the short publish step with ``flock`` on the instance directory, so a
loser can never delete a records file that the winner's manifest names.

A read verifies the manifest, then the size, digest and record count of the whole
records file before it returns any record.

Everything here is blocking file I/O and plain threading: the asyncio runtime calls it
through ``asyncio.to_thread``. It imports neither grpc nor asyncio.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NoReturn, Protocol

from turnpoint.ids import EpisodeId, validate_id
from turnpoint.protocol import ArtifactRef

__all__ = [
    "MANIFEST_NAME",
    "MAX_PAYLOAD_DEPTH",
    "SCHEMA_VERSION",
    "ArtifactRef",
    "CorruptSnapshotError",
    "Corruption",
    "FaultHook",
    "FaultPoint",
    "LoadedSnapshot",
    "Record",
    "SnapshotConflictError",
    "SnapshotEntry",
    "SnapshotStore",
    "StoreError",
    "UnserialisableRecordError",
    "WriteCancelled",
    "WriteState",
    "WriteTicket",
]

SCHEMA_VERSION: Final = 1
MANIFEST_NAME: Final = "MANIFEST.json"
# Deep enough for any real turn state, shallow enough that neither our encoder nor the
# stdlib decoder can hit the interpreter's recursion limit on a hostile file.
MAX_PAYLOAD_DEPTH: Final = 100
# A manifest lists one file and the exported episodes (~60 bytes each); this bounds
# what a tampered manifest can make a reader allocate.
_MAX_MANIFEST_BYTES: Final = 64 * 1024 * 1024
_CHUNK_BYTES: Final = 1024 * 1024
_RECORDS_NAME = re.compile(r"records-(?P<sha256>[0-9a-f]{64})\.jsonl")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_MANIFEST_FIELDS: Final = frozenset(
    {"schema_version", "checkpoint_id", "instance", "artifacts", "episodes"}
)
_ARTIFACT_FIELDS: Final = frozenset({"path", "sha256", "size_bytes", "record_count"})
_EPISODE_FIELDS: Final = frozenset({"rollout_id", "attempt"})
_RECORD_FIELDS: Final = frozenset({"episode", "key", "payload"})


# --------------------------------------------------------------------------- errors


class StoreError(Exception):
    """Root of the store's own errors. ``OSError`` from the disk is never wrapped."""


class Corruption(enum.Enum):
    """Why a snapshot directory cannot be used (all map to ``INVALID_CHECKPOINT_STATE``)."""

    MISSING = "missing"
    MANIFEST_INVALID = "manifest_invalid"
    PATH_ESCAPE = "path_escape"
    UNEXPECTED_CONTENT = "unexpected_content"
    SIZE_MISMATCH = "size_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    RECORD_COUNT_MISMATCH = "record_count_mismatch"
    RECORD_INVALID = "record_invalid"
    EPISODES_MISMATCH = "episodes_mismatch"


class CorruptSnapshotError(StoreError):
    """A snapshot directory is missing, damaged or not what the caller expected."""

    def __init__(self, snapshot: str, instance: str, kind: Corruption, detail: str) -> None:
        self.snapshot = snapshot
        self.instance = instance
        self.kind = kind
        self.detail = detail
        super().__init__(
            f"snapshot {snapshot!r} of instance {instance!r} is unusable ({kind.value}): {detail}"
        )


class SnapshotConflictError(StoreError):
    """The directory already holds a published snapshot other than the one being written."""

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
            + (" with other content" if same else f", not {checkpoint_id!r}")
        )


class WriteCancelled(StoreError):
    """The write's ticket was cancelled before publication; nothing of it is left on disk."""

    def __init__(self, snapshot: str, instance: str, checkpoint_id: str) -> None:
        self.snapshot = snapshot
        self.instance = instance
        self.checkpoint_id = checkpoint_id
        super().__init__(
            f"write of checkpoint {checkpoint_id!r} into snapshot {snapshot!r} "
            f"of instance {instance!r} was cancelled before publication"
        )


class UnserialisableRecordError(StoreError):
    """A record's payload is not plain JSON; raised before anything is written."""

    def __init__(self, episode: EpisodeId, key: str, location: str, why: str) -> None:
        self.episode = episode
        self.key = key
        self.location = location
        self.why = why
        super().__init__(f"record {key!r} of episode {episode} cannot be saved: {location}: {why}")


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, slots=True)
class Record:
    """One piece of exported state: ``key`` names what it holds (``"session"``, ``"turn-3"``).

    ``payload`` must be plain JSON (mappings with string keys, lists, tuples, strings,
    finite numbers, booleans, None); its key order is kept on disk and on read. A
    restored payload is a ``dict`` and tuples come back as lists. The payload is left
    out of the hash so that records with dict payloads stay hashable.
    """

    episode: EpisodeId
    key: str
    payload: Mapping[str, Any] = field(hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.episode, EpisodeId):
            raise TypeError(f"episode must be an EpisodeId, not {type(self.episode).__name__}")
        validate_id(self.key, "record key")


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    """A published instance directory: what a commit replies and a restore is given.

    ``manifest`` names ``MANIFEST.json`` itself (its ``record_count`` is 0: a manifest
    holds no records); ``artifacts`` are the files it lists; ``episodes`` are the
    exported episodes, sorted and unique.
    """

    checkpoint_id: str
    manifest: ArtifactRef
    artifacts: tuple[ArtifactRef, ...]
    episodes: tuple[EpisodeId, ...]


@dataclass(frozen=True, slots=True)
class LoadedSnapshot:
    """The verified entry and the selected records, in file order."""

    entry: SnapshotEntry
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class _Manifest:
    checkpoint_id: str
    instance: str
    artifacts: tuple[ArtifactRef, ...]
    episodes: tuple[EpisodeId, ...]

    def to_bytes(self) -> bytes:
        document = {
            "schema_version": SCHEMA_VERSION,
            "checkpoint_id": self.checkpoint_id,
            "instance": self.instance,
            "artifacts": [
                {
                    "path": ref.path,
                    "sha256": ref.sha256,
                    "size_bytes": ref.size_bytes,
                    "record_count": ref.record_count,
                }
                for ref in self.artifacts
            ],
            "episodes": [_episode_json(episode) for episode in self.episodes],
        }
        return (json.dumps(document, indent=2, ensure_ascii=True) + "\n").encode("ascii")


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
    """Writes and reads participant snapshots under one configured root directory."""

    def __init__(self, root: str | os.PathLike[str], *, faults: FaultHook | None = None) -> None:
        self._root = Path(root)
        self._faults = faults

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
        directory = self._checked_dir(snapshot, instance)
        return (directory / MANIFEST_NAME).exists()

    # ---------------------------------------------------------------- writing

    def write(
        self,
        snapshot: str,
        instance: str,
        checkpoint_id: str,
        records: Iterable[Record],
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
        records: Iterable[Record],
        ticket: WriteTicket,
    ) -> SnapshotEntry:
        data, ref, episodes = _encode_records(instance, records)
        manifest = _Manifest(checkpoint_id, instance, (ref,), episodes)
        manifest_bytes = manifest.to_bytes()
        directory = self._make_dir(snapshot, instance)

        # Fast path for a retry: a published directory never changes, so no lock needed.
        if (directory / MANIFEST_NAME).exists():
            return self._settle_against_published(snapshot, instance, directory, manifest, ticket)
        if not ticket._still_writing():
            raise WriteCancelled(snapshot, instance, checkpoint_id)

        temp = self._write_temp(
            directory, ".records-", data, FaultPoint.RECORDS_WRITE, ticket, checkpoint_id
        )
        try:
            with _locked_dir(directory) as dir_fd:
                if (directory / MANIFEST_NAME).exists():
                    return self._settle_against_published(
                        snapshot, instance, directory, manifest, ticket
                    )
                return self._publish(
                    snapshot, directory, dir_fd, temp, ref, manifest, manifest_bytes, ticket
                )
        finally:
            temp.unlink(missing_ok=True)

    def _publish(
        self,
        snapshot: str,
        directory: Path,
        dir_fd: int,
        temp: Path,
        ref: ArtifactRef,
        manifest: _Manifest,
        manifest_bytes: bytes,
        ticket: WriteTicket,
    ) -> SnapshotEntry:
        """The publish step; runs under the directory lock with no manifest present."""
        instance = manifest.instance
        # Under the lock and without a manifest, a digest-named file can only be the
        # remains of a writer that died mid-publish: nothing names it, so it goes.
        for name in os.listdir(directory):
            if _RECORDS_NAME.fullmatch(name):
                (directory / name).unlink()
        final = directory / _file_name(ref.path)
        os.link(temp, final)
        keep_records = False
        try:
            temp.unlink()
            os.fsync(dir_fd)
            self._hit(FaultPoint.PUBLISH, final)
            if not ticket._begin_publish():
                raise WriteCancelled(snapshot, instance, manifest.checkpoint_id)
            manifest_temp = self._write_temp(
                directory,
                ".manifest-",
                manifest_bytes,
                FaultPoint.MANIFEST_WRITE,
                None,
                manifest.checkpoint_id,
            )
            try:
                os.link(manifest_temp, directory / MANIFEST_NAME)
                keep_records = True
            except FileExistsError:
                # Only a writer that ignores the lock gets here; its manifest stands.
                published = self._load_manifest(snapshot, instance, directory)[0]
                keep_records = ref in published.artifacts
                return self._settle_against_published(
                    snapshot, instance, directory, manifest, ticket
                )
            finally:
                manifest_temp.unlink(missing_ok=True)
            os.fsync(dir_fd)
        finally:
            if not keep_records:
                final.unlink(missing_ok=True)
                with suppress(OSError):
                    os.fsync(dir_fd)
        return _entry(manifest, manifest_bytes)

    def _settle_against_published(
        self,
        snapshot: str,
        instance: str,
        directory: Path,
        ours: _Manifest,
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
        _fsync_dir(directory)
        return _entry(published, published_bytes)

    def _write_temp(
        self,
        directory: Path,
        prefix: str,
        data: bytes,
        point: FaultPoint,
        ticket: WriteTicket | None,
        checkpoint_id: str,
    ) -> Path:
        # A leading dot can never collide with a valid id or a published file name.
        path = directory / f"{prefix}{secrets.token_hex(8)}.tmp"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                view = memoryview(data)
                for offset in range(0, max(len(view), 1), _CHUNK_BYTES):
                    self._hit(point, path)
                    if ticket is not None and not ticket._still_writing():
                        raise WriteCancelled(directory.parent.name, directory.name, checkpoint_id)
                    _write_all(fd, view[offset : offset + _CHUNK_BYTES])
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path

    def _make_dir(self, snapshot: str, instance: str) -> Path:
        directory = self._checked_dir(snapshot, instance)
        self._root.mkdir(parents=True, exist_ok=True)
        for path in (directory.parent, directory):
            try:
                path.mkdir()
            except FileExistsError:
                continue
            # A new directory entry is only durable once its parent is fsynced.
            _fsync_dir(path.parent)
        # Re-check now that the components exist: one could be a symlink planted meanwhile.
        return self._checked_dir(snapshot, instance)

    # ---------------------------------------------------------------- reading

    def read_entry(self, snapshot: str, instance: str) -> SnapshotEntry:
        """Parse and check the published manifest (not the records file it names)."""
        directory = self._checked_dir(snapshot, instance)
        manifest, manifest_bytes = self._load_manifest(snapshot, instance, directory)
        return _entry(manifest, manifest_bytes)

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
        entry = _entry(manifest, manifest_bytes)

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
            loaded.extend(_decode_records(snapshot, instance, ref, data))
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
    ) -> tuple[_Manifest, bytes]:
        data = _read_file(snapshot, instance, directory / MANIFEST_NAME, _MAX_MANIFEST_BYTES)
        if len(data) > _MAX_MANIFEST_BYTES:
            raise CorruptSnapshotError(
                snapshot, instance, Corruption.MANIFEST_INVALID, "manifest is too large"
            )
        return _parse_manifest(snapshot, instance, directory, data), data

    def _read_verified(
        self, snapshot: str, instance: str, directory: Path, ref: ArtifactRef
    ) -> bytes:
        path = directory / _file_name(ref.path)
        # One byte more than promised, so a file that grew is caught without reading it all.
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
        path = self._root / snapshot
        self._check_inside_root(path, snapshot, "*")
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            return False
        _fsync_dir(self._root)
        return True

    # ---------------------------------------------------------------- paths

    def _checked_dir(self, snapshot: str, instance: str) -> Path:
        directory = self.instance_dir(snapshot, instance)
        self._check_inside_root(directory, snapshot, instance)
        return directory

    def _check_inside_root(self, path: Path, snapshot: str, instance: str) -> None:
        # Valid ids cannot name a path outside the root, but a symlink planted under the
        # root still could: the resolved path must be exactly where the ids say.
        expected = self._root.resolve().joinpath(*path.relative_to(self._root).parts)
        resolved = path.resolve()
        if resolved != expected:
            raise CorruptSnapshotError(
                snapshot, instance, Corruption.PATH_ESCAPE, f"{path} resolves to {resolved}"
            )


# --------------------------------------------------------------------------- encoding


class _BadValue(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        self.location: list[str] = []


def _plain(value: Any, depth: int) -> Any:
    """Copy ``value`` as plain JSON data, refusing anything that would not round-trip."""
    kind = type(value)
    # Exact types first: this runs for every value of every record.
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float or isinstance(value, float):
        if not math.isfinite(value):
            raise _BadValue(f"{value!r} is not a JSON number")
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        # bool is final, so this is an int subclass such as an IntEnum.
        return int(value)
    if depth >= MAX_PAYLOAD_DEPTH:
        raise _BadValue(f"nested deeper than {MAX_PAYLOAD_DEPTH} levels")
    if kind is dict or isinstance(value, Mapping):
        copy: dict[str, Any] = {}
        for key, item in value.items():
            # json.dumps would turn 1 into "1" silently, and {1: a, "1": b} into a
            # duplicate key: the restored payload would not be the saved one.
            if not isinstance(key, str):
                raise _BadValue(f"key {key!r} is not a string")
            try:
                copy[key] = _plain(item, depth + 1)
            except _BadValue as error:
                error.location.append(f"[{key!r}]")
                raise
        return copy
    if kind is list or isinstance(value, (list, tuple)):
        items: list[Any] = []
        for index, item in enumerate(value):
            try:
                items.append(_plain(item, depth + 1))
            except _BadValue as error:
                error.location.append(f"[{index}]")
                raise
        return items
    raise _BadValue(f"{kind.__name__} is not JSON-serialisable")


def _episode_json(episode: EpisodeId) -> dict[str, Any]:
    return {"rollout_id": episode.rollout_id, "attempt": episode.attempt}


def _encode_records(
    instance: str, records: Iterable[Record]
) -> tuple[bytes, ArtifactRef, tuple[EpisodeId, ...]]:
    """Serialise every record (so nothing is written if one fails) and describe the file."""
    lines: list[bytes] = []
    episodes: set[EpisodeId] = set()
    encoder = json.JSONEncoder(
        ensure_ascii=True, allow_nan=False, check_circular=False, separators=(",", ":")
    )
    for record in records:
        if not isinstance(record, Record):
            raise TypeError(f"records must be Record instances, not {type(record).__name__}")
        if not isinstance(record.payload, Mapping):
            raise UnserialisableRecordError(
                record.episode,
                record.key,
                "payload",
                f"must be a mapping, not {type(record.payload).__name__}",
            )
        try:
            payload = _plain(record.payload, 1)
        except _BadValue as error:
            where = "payload" + "".join(reversed(error.location))
            raise UnserialisableRecordError(record.episode, record.key, where, error.why) from None
        line = {"episode": _episode_json(record.episode), "key": record.key, "payload": payload}
        # ASCII-only output: the bytes cannot depend on a locale or hold a lone surrogate.
        lines.append(encoder.encode(line).encode("ascii") + b"\n")
        episodes.add(record.episode)
    data = b"".join(lines)
    sha256 = hashlib.sha256(data).hexdigest()
    ref = ArtifactRef(f"{instance}/records-{sha256}.jsonl", sha256, len(data), len(lines))
    return data, ref, tuple(sorted(episodes))


def _entry(manifest: _Manifest, manifest_bytes: bytes) -> SnapshotEntry:
    ref = ArtifactRef(
        f"{manifest.instance}/{MANIFEST_NAME}",
        hashlib.sha256(manifest_bytes).hexdigest(),
        len(manifest_bytes),
        0,
    )
    return SnapshotEntry(manifest.checkpoint_id, ref, manifest.artifacts, manifest.episodes)


# --------------------------------------------------------------------------- decoding


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        keys = [key for key, _ in pairs]
        duplicate = next(key for key in keys if keys.count(key) > 1)
        raise ValueError(f"duplicate key {duplicate!r}")
    return result


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


# One decoder for every line: json.loads with hooks would build a new one each call.
_STRICT_DECODER: Final = json.JSONDecoder(
    object_pairs_hook=_unique_pairs, parse_constant=_no_constants
)


def _strict_json(text: str) -> Any:
    """Parse JSON refusing duplicate keys and NaN/Infinity (ValueError on any problem)."""
    try:
        return _STRICT_DECODER.decode(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _object(value: Any, fields: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object")
    if value.keys() != fields:
        unknown = sorted(value.keys() - fields)
        missing = sorted(fields - value.keys())
        raise ValueError(f"{what}: unknown fields {unknown}, missing fields {missing}")
    return value


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0")
    return value


def _parse_episode(value: Any, seen: dict[tuple[str, int], EpisodeId] | None = None) -> EpisodeId:
    fields = _object(value, _EPISODE_FIELDS, "episode")
    rollout_id, attempt = fields["rollout_id"], fields["attempt"]
    if not isinstance(rollout_id, str):
        raise ValueError("episode rollout_id must be a string")
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        raise ValueError("episode attempt must be an integer")
    if seen is None:
        return EpisodeId(rollout_id, attempt)  # InvalidIdError is a ValueError
    # Records of one episode share one validated EpisodeId instead of re-validating.
    episode = seen.get((rollout_id, attempt))
    if episode is None:
        episode = seen[rollout_id, attempt] = EpisodeId(rollout_id, attempt)
    return episode


def _parse_manifest(snapshot: str, instance: str, directory: Path, data: bytes) -> _Manifest:
    def invalid(detail: str, kind: Corruption = Corruption.MANIFEST_INVALID) -> NoReturn:
        raise CorruptSnapshotError(snapshot, instance, kind, f"{MANIFEST_NAME}: {detail}")

    try:
        document = _object(_strict_json(data.decode("utf-8")), _MANIFEST_FIELDS, "manifest")
        version = document["schema_version"]
        if isinstance(version, bool) or version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {version!r} is not {SCHEMA_VERSION}")
        checkpoint_id = validate_id(document["checkpoint_id"], "checkpoint_id")
        if document["instance"] != instance:
            raise ValueError(f"names instance {document['instance']!r}")
        raw_artifacts = document["artifacts"]
        if not isinstance(raw_artifacts, list) or len(raw_artifacts) != 1:
            raise ValueError(f"schema {SCHEMA_VERSION} lists exactly one records file")
        raw_episodes = document["episodes"]
        if not isinstance(raw_episodes, list):
            raise ValueError("episodes must be a list")
        episodes = tuple(_parse_episode(item) for item in raw_episodes)
        if any(a >= b for a, b in itertools.pairwise(episodes)):
            raise ValueError("episodes must be sorted and unique")
        artifacts: list[ArtifactRef] = []
        for item in raw_artifacts:
            fields = _object(item, _ARTIFACT_FIELDS, "artifact")
            path, sha256 = fields["path"], fields["sha256"]
            if not isinstance(sha256, str) or not _SHA256_HEX.fullmatch(sha256):
                raise ValueError(f"sha256 {sha256!r} is not 64 lowercase hex characters")
            if not isinstance(path, str):
                raise ValueError("artifact path must be a string")
            target = (directory.parent / path).resolve()
            if target.parent != directory.resolve():
                invalid(
                    f"artifact path {path!r} leaves the instance directory", Corruption.PATH_ESCAPE
                )
            if path != f"{instance}/records-{sha256}.jsonl":
                raise ValueError(f"artifact path {path!r} does not match its digest")
            artifacts.append(
                ArtifactRef(
                    path,
                    sha256,
                    _count(fields["size_bytes"], "size_bytes"),
                    _count(fields["record_count"], "record_count"),
                )
            )
    except ValueError as error:
        invalid(str(error))
    return _Manifest(checkpoint_id, instance, tuple(artifacts), episodes)


def _decode_records(
    snapshot: str, instance: str, ref: ArtifactRef, data: bytes
) -> Iterator[Record]:
    """Yield the records of a verified file; the caller consumes all before using any."""

    def invalid(kind: Corruption, detail: str) -> NoReturn:
        raise CorruptSnapshotError(snapshot, instance, kind, f"{ref.path}: {detail}")

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        invalid(Corruption.RECORD_INVALID, str(error))
    # Every record ends with a newline, so the split leaves exactly one empty tail.
    lines = text.split("\n")
    if lines.pop() != "":
        invalid(Corruption.RECORD_INVALID, "ends mid-record")
    if len(lines) != ref.record_count:
        invalid(
            Corruption.RECORD_COUNT_MISMATCH,
            f"holds {len(lines)} records, the manifest says {ref.record_count}",
        )
    seen: dict[tuple[str, int], EpisodeId] = {}
    for number, line in enumerate(lines, start=1):
        try:
            fields = _object(_strict_json(line), _RECORD_FIELDS, "record")
            payload = fields["payload"]
            if not isinstance(payload, dict):
                raise ValueError("payload must be an object")
            record = Record(_parse_episode(fields["episode"], seen), fields["key"], payload)
        except (ValueError, TypeError) as error:
            invalid(Corruption.RECORD_INVALID, f"line {number}: {error}")
        yield record


# --------------------------------------------------------------------------- file helpers


def _file_name(path: str) -> str:
    return path.rpartition("/")[2]


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
