"""A filesystem as storage: the machine's own disk or a mount shared between machines.

docs/spec.md section 8.12. The durable steps are :mod:`turnpoint._files`: ``put`` is a
temporary file, fsync, rename over the name and fsync of the directory; ``create`` links
the temporary file to the name instead, which fails rather than replaces. A directory a
write creates is made durable in its parent.

On a shared mount (``shared=True``) the same steps run, with one difference: a
directory fsync that the filesystem refuses (``EINVAL``, ``ENOTSUP``: some network
filesystems do) is skipped. NFS commits a link, a rename or an unlink on the server
before the call returns, so there is nothing for it to add there.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Final

from turnpoint._files import TEMP_SUFFIX, create_file, fsync_dir, replace_file
from turnpoint.storage._objects import (
    ObjectExistsError,
    ObjectInfo,
    ObjectMissingError,
    StorageError,
    check_key,
)

_TEMP_PREFIX: Final = ".object-"
_UNSUPPORTED: Final = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


class FileStorage:
    """Objects as files under ``root``; keys are paths relative to it."""

    def __init__(self, root: str | os.PathLike[str], *, shared: bool = False) -> None:
        self.root = Path(root)
        self.shared = shared

    @property
    def url(self) -> str:
        return self.root.absolute().as_uri() + ("?mount=shared" if self.shared else "")

    def __repr__(self) -> str:
        return f"FileStorage({self.url!r})"

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageError(self.url, f"cannot create the root: {error}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StorageError(self.url, "the root is not writable")

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        self._make_parents(path)
        try:
            replace_file(path, data, temp_prefix=_TEMP_PREFIX, mode=0o644)
        except OSError as error:
            # The rename happened; only the directory fsync was refused by the mount.
            if not (self._refused_fsync(error) and path.exists()):
                raise

    def create(self, key: str, data: bytes) -> None:
        path = self.path(key)
        self._make_parents(path)
        try:
            create_file(path, data, temp_prefix=_TEMP_PREFIX, mode=0o644)
        except FileExistsError:
            raise ObjectExistsError(self.url, key) from None
        except OSError as error:
            if not (self._refused_fsync(error) and path.exists()):
                raise

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectMissingError(self.url, key) from None
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            raise StorageError(self.url, f"{key} is a symlink") from None
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise StorageError(self.url, f"{key} is not a regular file")
            return file.read() if limit is None else file.read(limit + 1)

    def size(self, key: str) -> int | None:
        try:
            info = self.path(key).lstat()
        except FileNotFoundError:
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # Walk only the directory the prefix names down to its last "/".
        base, _, _ = prefix.rpartition("/")
        top = self.root / base if base else self.root
        found: list[ObjectInfo] = []
        for current, dirnames, filenames in os.walk(top):
            dirnames[:] = [name for name in dirnames if not name.startswith(".")]
            for name in filenames:
                if name.startswith(".") and name.endswith(TEMP_SUFFIX):
                    continue
                path = Path(current, name)
                key = path.relative_to(self.root).as_posix()
                info = path.lstat()
                if key.startswith(prefix) and stat.S_ISREG(info.st_mode):
                    found.append(ObjectInfo(key, info.st_size))
        found.sort(key=lambda item: item.key)
        return found

    def delete(self, key: str) -> bool:
        path = self.path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        self._fsync_dir(path.parent)
        # Empty directories go too, as an object store has none.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            self._fsync_dir(parent.parent)
            parent = parent.parent
        return True

    def _make_parents(self, path: Path) -> None:
        missing: list[Path] = []
        parent = path.parent
        while not parent.is_dir():
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            try:
                directory.mkdir()
            except FileExistsError:
                continue
            # A new directory entry is durable only once its parent is fsynced.
            self._fsync_dir(directory.parent)

    def _refused_fsync(self, error: OSError) -> bool:
        return self.shared and error.errno in _UNSUPPORTED

    def _fsync_dir(self, path: Path) -> None:
        try:
            fsync_dir(path)
        except OSError as error:
            if not self._refused_fsync(error):
                raise
