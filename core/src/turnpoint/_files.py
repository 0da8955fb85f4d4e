"""Durable file writes: the one implementation of "whole or not at all" on disk.

Two ways to put bytes under a name so that a crash leaves the old state or the new one,
never a torn file (docs/spec.md sections 8.4, 8.9 and 8.11):

- :func:`replace_file`: a temporary file in the same directory, written and fsynced,
  renamed over the name (``os.replace``), then the directory fsynced. For pointers that
  move (``LATEST``, the coordinator identity).
- :func:`create_file`: the same temporary file, hard-linked to the name. A link fails
  with ``FileExistsError`` instead of replacing, so the name appears complete from its
  first instant and is never overwritten (manifests, token files).

Writers that need their own steps in between (the participant store publishes under a
lock, the trainer layout exposes crash points) build on :func:`write_temp` and
:func:`fsync_dir`. Temporary names are ``<prefix><16 hex>.tmp``: callers pick a prefix
that starts with a dot, so a temporary file never collides with a valid id.

Everything here is blocking file I/O; from asyncio code call it through
``asyncio.to_thread``. ``OSError`` from the disk is never wrapped: callers map it.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

TEMP_SUFFIX: Final = ".tmp"
CHUNK_BYTES: Final = 1 << 20
# Pieces are gathered into one writev of about this many bytes (and at most _BATCH_PIECES
# of them): few system calls, and little memory held between them.
_BATCH_BYTES: Final = 1 << 16
_BATCH_PIECES: Final = 512

# The default mode of a new file before the umask, as open() uses.
_DEFAULT_MODE: Final = 0o666


def temp_path(directory: Path, prefix: str) -> Path:
    """A fresh temporary name in ``directory``: ``<prefix><16 hex>.tmp``."""
    return directory / f"{prefix}{secrets.token_hex(8)}{TEMP_SUFFIX}"


def write_new(
    path: Path,
    data: bytes | Iterable[bytes],
    *,
    mode: int = _DEFAULT_MODE,
    before_chunk: Callable[[Path], None] | None = None,
) -> None:
    """Create ``path`` exclusively, write ``data`` and fsync it; on any failure remove it.

    ``data`` is the bytes, or an iterable of pieces written one after the other as it
    yields them (a large file is then never whole in memory, and no buffer of its size is
    allocated: fresh pages cost a fault each). ``before_chunk(path)`` runs before each
    chunk of at most :data:`CHUNK_BYTES` (once for empty data): the place for a fault hook
    or a cancellation check. Whatever it or the iterable raises propagates, with the file
    removed. ``FileExistsError`` when the name exists (nothing is removed then: the file
    is someone else's).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            if isinstance(data, bytes | bytearray | memoryview):
                view = memoryview(data)
                for offset in range(0, max(len(view), 1), CHUNK_BYTES):
                    if before_chunk is not None:
                        before_chunk(path)
                    _write_all(fd, view[offset : offset + CHUNK_BYTES])
            else:
                _write_pieces(fd, path, data, before_chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def write_temp(
    directory: Path,
    prefix: str,
    data: bytes | Iterable[bytes],
    *,
    mode: int = _DEFAULT_MODE,
    before_chunk: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``data`` durably to a new temporary file in ``directory``; return its path.

    See :func:`write_new`; nothing is left behind when it fails. The caller links or
    renames the file into place and removes the temporary name.
    """
    path = temp_path(directory, prefix)
    write_new(path, data, mode=mode, before_chunk=before_chunk)
    return path


def replace_file(
    path: Path,
    data: bytes,
    *,
    temp_prefix: str,
    mode: int = _DEFAULT_MODE,
    staged: Callable[[], None] | None = None,
) -> None:
    """Atomically and durably make ``path`` hold ``data``, replacing what was there.

    Temporary file in the same directory, fsync, ``os.replace``, fsync of the directory.
    A failure before the rename leaves ``path`` as it was and no temporary file.
    ``staged()`` runs once the temporary file is durable, before the rename; what it
    raises propagates and leaves the temporary file, as a crash there would (tests
    inject crashes that way; a cleanup that knows the prefix removes it).
    """
    directory = path.parent
    staged_path = write_temp(directory, temp_prefix, data, mode=mode)
    if staged is not None:
        staged()
    try:
        os.replace(staged_path, path)
    except BaseException:
        staged_path.unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def create_file(
    path: Path,
    data: bytes,
    *,
    temp_prefix: str,
    temp_dir: Path | None = None,
    mode: int = _DEFAULT_MODE,
    before_chunk: Callable[[Path], None] | None = None,
    staged: Callable[[], None] | None = None,
    linked: Callable[[], None] | None = None,
    sync_temp_dir: bool = True,
    directory_fd: int | None = None,
) -> None:
    """Create ``path`` holding ``data``, complete from its first instant; never replace.

    Temporary file (in ``temp_dir``, default the same directory), fsync, ``os.link`` to
    ``path``, removal of the temporary name, fsync of the directory (and of
    ``temp_dir``, unless ``sync_temp_dir`` is False: a caller that fsyncs it next
    anyway, or whose cleanup removes a resurrected temporary name, saves one fsync).
    ``FileExistsError`` when ``path`` already exists, with nothing of this write left
    behind; any other failure before the link leaves nothing either. ``before_chunk``
    is passed to :func:`write_new`. ``staged()`` runs before the link and ``linked()``
    right after it; what they raise propagates and leaves the temporary file, as a
    crash there would. ``directory_fd``: an open descriptor of ``path``'s directory (a
    writer holding it locked) to fsync instead of opening the directory again.
    """
    directory = path.parent
    staging_dir = directory if temp_dir is None else temp_dir
    staged_path = write_temp(staging_dir, temp_prefix, data, mode=mode, before_chunk=before_chunk)
    if staged is not None:
        staged()
    try:
        os.link(staged_path, path)
    except BaseException:
        staged_path.unlink(missing_ok=True)
        raise
    if linked is not None:
        linked()
    staged_path.unlink()
    if directory_fd is None:
        fsync_dir(directory)
    else:
        os.fsync(directory_fd)
    if staging_dir != directory and sync_temp_dir:
        fsync_dir(staging_dir)


def fsync_dir(path: Path) -> None:
    """fsync a directory: a new, renamed or removed entry is durable only after this."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file that was written and closed elsewhere."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path, *, durable: Path | None = None) -> None:
    """fsync every regular file and directory below ``directory`` (itself included).

    Symlinks are neither followed nor synced. ``durable``: a subtree below ``directory``
    that its writer already made durable; it is not synced again, though its entry in
    its parent is (the parent's fsync covers it).
    """
    skip = None if durable is None else os.path.normpath(durable)
    walked: list[tuple[str, list[str]]] = []
    for current, dirnames, filenames in os.walk(directory):
        if skip is not None:
            dirnames[:] = [
                d for d in dirnames if os.path.normpath(os.path.join(current, d)) != skip
            ]
        walked.append((current, filenames))
    # Reversed pre-order puts every directory after all its descendants, so a directory
    # is synced after the entries it lists.
    for current, filenames in reversed(walked):
        for name in filenames:
            path = Path(current, name)
            if stat.S_ISREG(path.lstat().st_mode):
                fsync_file(path)
        fsync_dir(Path(current))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _write_pieces(
    fd: int, path: Path, pieces: Iterable[bytes], before_chunk: Callable[[Path], None] | None
) -> None:
    """Write ``pieces`` in order, gathered into writevs; ``before_chunk`` runs before the
    first write (also of nothing) and again before each write that follows
    :data:`CHUNK_BYTES` or more written since it last ran."""
    batch: list[bytes] = []
    batched = 0
    unchecked: int | None = None  # bytes written since before_chunk ran; None: never
    for piece in pieces:
        batch.append(piece)
        batched += len(piece)
        if batched >= _BATCH_BYTES or len(batch) >= _BATCH_PIECES:
            unchecked = _write_batch(fd, path, batch, batched, unchecked, before_chunk)
            batch = []
            batched = 0
    if batch or unchecked is None:
        _write_batch(fd, path, batch, batched, unchecked, before_chunk)


def _write_batch(
    fd: int,
    path: Path,
    batch: list[bytes],
    size: int,
    unchecked: int | None,
    before_chunk: Callable[[Path], None] | None,
) -> int:
    """One writev of ``batch`` (``size`` bytes), preceded by ``before_chunk`` when due;
    returns the bytes written since it last ran."""
    if unchecked is None or unchecked >= CHUNK_BYTES:
        if before_chunk is not None:
            before_chunk(path)
        unchecked = 0
    if batch:
        written = os.writev(fd, batch)
        if written < size:  # a short write: the rest from one buffer
            _write_all(fd, memoryview(b"".join(batch))[written:])
    return unchecked + size
