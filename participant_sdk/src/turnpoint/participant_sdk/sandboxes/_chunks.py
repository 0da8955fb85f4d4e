"""The chunk store: directory trees in, manifests and zstd chunks out, and back again.

docs/spec.md section 5.7.3. Layout under the store's root::

    chunks/<first 2 hex>/<sha256>.zst   one chunk, zstd-compressed; named by the sha256
                                        of its *uncompressed* bytes
    manifests/<tree digest>.json        a tree manifest (:mod:`._format`), written last

Content addressing makes snapshots incremental: a chunk already in the store is never
written again, so a snapshot of an unchanged tree writes its manifest only (and not even
that when the same tree was snapshotted before). A restore checks the whole manifest
first (:func:`._format.check_manifest`), then materializes it into a directory it
creates itself, verifying every chunk (size and digest, with decompression bounded by
the declared size) before writing its bytes. Every write is relative to a directory
descriptor the restore opened itself, with ``O_NOFOLLOW`` and ``O_EXCL``, so nothing is
ever written outside the target; a failure removes the partial target.

Blocking file I/O: call it from asyncio through ``asyncio.to_thread``. No grpc, no
asyncio, no clock.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import zstandard

from turnpoint._files import create_file

from ._errors import Refusal, SnapshotNotFoundError, SnapshotRefusedError
from ._format import (
    CHUNK_BYTES,
    PERMISSION_BITS,
    ChunkRef,
    Entry,
    EntryType,
    Limits,
    TreeManifest,
    check_manifest,
    decode_manifest,
    sorted_entries,
)

_TEMP_PREFIX: Final = ".chunk-"
# zstd's worst case for incompressible input is a few bytes per 128 KiB block; a stored
# chunk longer than this is refused before it is decompressed.
_MAX_STORED_CHUNK: Final = CHUNK_BYTES + (CHUNK_BYTES >> 6) + 1024
_COMPRESSION_LEVEL: Final = 3
_OPEN_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Capture:
    """What one snapshot of a tree wrote: its manifest and what it cost."""

    manifest: TreeManifest
    digest: str
    chunks_written: int
    chunks_reused: int
    bytes_written: int  # compressed chunk bytes plus the manifest, if it was new
    skipped: tuple[str, ...]  # sockets, fifos, devices: not part of a filesystem snapshot


class ChunkStore:
    """A content-addressed store of tree manifests and their chunks under ``root``."""

    def __init__(self, root: Path, limits: Limits | None = None) -> None:
        self.root = root
        self.limits = limits or Limits()
        self._chunks = root / "chunks"
        self._manifests = root / "manifests"
        self._chunks.mkdir(parents=True, exist_ok=True)
        self._manifests.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- capture

    def capture(self, tree: Path) -> Capture:
        """Snapshot the tree under ``tree`` (never following a symlink); manifest last.

        The tree should be quiet: a file that changes while it is read is stored as read.
        A tree past the limits, or one that a restore would refuse, is refused here.
        """
        entries: list[Entry] = []
        skipped: list[str] = []
        totals = _Totals(self.limits)
        compressor = zstandard.ZstdCompressor(level=_COMPRESSION_LEVEL)
        self._walk(tree, "", entries, skipped, totals, compressor)
        manifest = TreeManifest(sorted_entries(entries))
        # What a restore would refuse is refused now (an absolute symlink, say), not
        # stored as a snapshot that can never come back.
        check_manifest(manifest, self.limits)
        encoded = manifest.encode()
        digest = hashlib.sha256(encoded).hexdigest()
        path = self._manifests / f"{digest}.json"
        manifest_written = 0
        if not path.exists():
            try:
                create_file(path, encoded, temp_prefix=_TEMP_PREFIX)
                manifest_written = len(encoded)
            except FileExistsError:
                pass  # the same tree, stored by a concurrent capture
        return Capture(
            manifest,
            digest,
            totals.chunks_written,
            totals.chunks_reused,
            totals.bytes_written + manifest_written,
            tuple(sorted(skipped)),
        )

    def _walk(
        self,
        directory: Path,
        prefix: str,
        entries: list[Entry],
        skipped: list[str],
        totals: _Totals,
        compressor: zstandard.ZstdCompressor,
    ) -> None:
        with os.scandir(directory) as listing:
            children = sorted(listing, key=lambda child: child.name)
        for child in children:
            path = f"{prefix}{child.name}"
            info = child.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                totals.count_entry(path)
                entries.append(Entry(path, EntryType.DIR, mode=info.st_mode & PERMISSION_BITS))
                self._walk(Path(child.path), f"{path}/", entries, skipped, totals, compressor)
            elif stat.S_ISLNK(info.st_mode):
                totals.count_entry(path)
                entries.append(Entry(path, EntryType.SYMLINK, target=os.readlink(child.path)))
            elif stat.S_ISREG(info.st_mode):
                totals.count_entry(path)
                entries.append(self._capture_file(Path(child.path), path, info, totals, compressor))
            else:
                skipped.append(path)

    def _capture_file(
        self,
        source: Path,
        path: str,
        info: os.stat_result,
        totals: _Totals,
        compressor: zstandard.ZstdCompressor,
    ) -> Entry:
        chunks: list[ChunkRef] = []
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            while data := file.read(CHUNK_BYTES):
                totals.count_bytes(path, len(data))
                chunks.append(self._put_chunk(data, totals, compressor))
        size = sum(chunk.size for chunk in chunks)
        return Entry(
            path,
            EntryType.FILE,
            mode=info.st_mode & PERMISSION_BITS,
            size=size,
            chunks=tuple(chunks),
        )

    def _put_chunk(
        self, data: bytes, totals: _Totals, compressor: zstandard.ZstdCompressor
    ) -> ChunkRef:
        ref = ChunkRef(hashlib.sha256(data).hexdigest(), len(data))
        path = self._chunk_path(ref.sha256)
        if path.exists():
            totals.chunks_reused += 1
            return ref
        path.parent.mkdir(exist_ok=True)
        stored = compressor.compress(data)
        try:
            create_file(path, stored, temp_prefix=_TEMP_PREFIX)
        except FileExistsError:
            totals.chunks_reused += 1  # stored meanwhile by a concurrent capture
            return ref
        totals.chunks_written += 1
        totals.bytes_written += len(stored)
        return ref

    def _chunk_path(self, sha256: str) -> Path:
        return self._chunks / sha256[:2] / f"{sha256}.zst"

    # ---------------------------------------------------------------- reading

    def has_manifest(self, digest: str) -> bool:
        return (self._manifests / f"{digest}.json").is_file()

    def load(self, digest: str) -> TreeManifest:
        """The manifest stored under ``digest``, verified and checked."""
        path = self._manifests / f"{digest}.json"
        try:
            with path.open("rb") as file:
                data = file.read(self.limits.max_manifest_bytes + 1)
        except FileNotFoundError:
            raise SnapshotNotFoundError(digest) from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise SnapshotRefusedError(Refusal.MANIFEST_INVALID, "", "manifest digest mismatch")
        return decode_manifest(data, self.limits)

    def read_chunk(self, ref: ChunkRef) -> bytes:
        """The chunk's bytes, or a refusal: missing, truncated or corrupt."""
        try:
            with self._chunk_path(ref.sha256).open("rb") as file:
                stored = file.read(_MAX_STORED_CHUNK + 1)
        except FileNotFoundError:
            raise SnapshotRefusedError(
                Refusal.CHUNK_MISSING, ref.sha256, "not in the store"
            ) from None
        if len(stored) > _MAX_STORED_CHUNK:
            raise SnapshotRefusedError(Refusal.CHUNK_CORRUPT, ref.sha256, "stored chunk too long")
        data = bytearray()
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(stored)
            # One byte past the declared size: enough to see a chunk that is too long,
            # never enough for a decompression bomb.
            while len(data) <= ref.size and (piece := reader.read(ref.size + 1 - len(data))):
                data += piece
        except zstandard.ZstdError:
            raise SnapshotRefusedError(Refusal.CHUNK_CORRUPT, ref.sha256, "not zstd") from None
        if len(data) < ref.size:
            raise SnapshotRefusedError(
                Refusal.CHUNK_TRUNCATED, ref.sha256, f"{len(data)} of {ref.size} bytes"
            )
        if len(data) > ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise SnapshotRefusedError(Refusal.CHUNK_CORRUPT, ref.sha256, "digest mismatch")
        return bytes(data)

    def collect(self, keep: frozenset[str]) -> tuple[int, int]:
        """Remove every manifest not in ``keep`` and every chunk none of ``keep`` lists.

        Returns (manifests removed, bytes freed). The caller guarantees that no capture
        runs meanwhile: a capture's chunks are unreferenced until its manifest lands.
        """
        live: set[str] = set()
        for digest in keep:
            live |= self.load(digest).chunk_digests()
        removed = freed = 0
        for path in sorted(self._manifests.glob("*.json")):
            if path.stem not in keep:
                freed += path.stat().st_size
                path.unlink()
                removed += 1
        for path in sorted(self._chunks.glob("*/*.zst")):
            if path.name.removesuffix(".zst") not in live:
                freed += path.stat().st_size
                path.unlink()
        return removed, freed

    # ---------------------------------------------------------------- restore

    def restore(self, manifest: TreeManifest, target: Path) -> None:
        """Materialize ``manifest`` as a new directory ``target``; see the module docstring.

        ``target`` must not exist (:attr:`Refusal.TARGET_EXISTS`); its parent must.
        On any failure the partial ``target`` is removed and the error propagates.
        """
        check_manifest(manifest, self.limits)
        if list(manifest.entries) != list(sorted_entries(manifest.entries)):
            raise SnapshotRefusedError(Refusal.MANIFEST_INVALID, "", "entries out of order")
        try:
            os.mkdir(target, 0o700)
        except FileExistsError:
            raise SnapshotRefusedError(
                Refusal.TARGET_EXISTS, str(target), "a restore never writes over a tree"
            ) from None
        try:
            self._materialize(manifest, target)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise

    def _materialize(self, manifest: TreeManifest, target: Path) -> None:
        # Entries are in depth-first order (checked above), so the open directories
        # along the current path are a stack; a directory gets its mode when it is
        # popped, after all its content is written.
        stack: list[tuple[str, int, int]] = [("", os.open(target, _OPEN_DIR), 0o755)]
        try:
            for entry in manifest.entries:
                parent, _, name = entry.path.rpartition("/")
                while stack[-1][0] != parent:
                    _close_dir(stack.pop())
                parent_fd = stack[-1][1]
                if entry.type is EntryType.DIR:
                    os.mkdir(name, 0o700, dir_fd=parent_fd)
                    fd = os.open(name, _OPEN_DIR, dir_fd=parent_fd)
                    stack.append((entry.path, fd, entry.mode))
                elif entry.type is EntryType.SYMLINK:
                    os.symlink(entry.target, name, dir_fd=parent_fd)
                else:
                    self._write_file(entry, name, parent_fd)
        finally:
            while stack:
                _close_dir(stack.pop())

    def _write_file(self, entry: Entry, name: str, parent_fd: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=parent_fd)
        try:
            for ref in entry.chunks:
                view = memoryview(self.read_chunk(ref))
                while view:
                    view = view[os.write(fd, view) :]
            os.fchmod(fd, entry.mode)
        finally:
            os.close(fd)


def _close_dir(item: tuple[str, int, int]) -> None:
    _, fd, mode = item
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


class _Totals:
    """Counts of one capture, and its caps: a tree past them is refused, not stored."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.entries = 0
        self.bytes = 0
        self.chunks_written = 0
        self.chunks_reused = 0
        self.bytes_written = 0

    def count_entry(self, path: str) -> None:
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise SnapshotRefusedError(
                Refusal.TOO_MANY_ENTRIES, path, f"more than {self.limits.max_entries}"
            )

    def count_bytes(self, path: str, size: int) -> None:
        self.bytes += size
        if self.bytes > self.limits.max_bytes:
            raise SnapshotRefusedError(
                Refusal.TOO_MANY_BYTES, path, f"more than {self.limits.max_bytes} bytes"
            )
