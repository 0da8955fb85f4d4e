"""The torch DCP anchor written and read on the snapshot store itself, through DCP's own
fsspec writer and reader (docs/spec.md section 8.13.1).

DCP's ``FsspecWriter`` and ``FsspecReader`` take any fsspec filesystem. Rather than s3fs
(a second S3 client beside boto3, whose aiobotocore pins botocore below the boto3 the
project uses, and whose listing cache a commit protocol must not consult),
:class:`StoreFileSystem` is an fsspec filesystem over the project's own
:class:`~turnpoint.storage.Storage`: one store client, its typed errors and its retries,
for the participants, the publication and the anchor alike.

Paths are ``turnpoint-store://<checkpoint_id>/trainer/anchor/<file>``; each file is one
object, its key escaped as a staged file's would be (:func:`object_key`), so an anchor
written here is the same objects, under the same keys, as one staged and put at
publication. A file is buffered in memory and put whole when its stream closes (one
``PutObject``, never a multipart upload); DCP's rename of its metadata file is a get, a
put and a delete, and the manifest, not the rename, is the commit.

Every rank writes its own shards with its own storage client, so a trainer on many
machines needs nothing shared but the store.
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path
from typing import Any, Final, cast

import fsspec
from fsspec.spec import AbstractFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from turnpoint.storage import Storage
from turnpoint.trainer.storage.manifest import ANCHOR_DIR, check_id
from turnpoint.trainer.storage.objects import file_path, object_key

PROTOCOL: Final = "turnpoint-store"


class StoreFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """fsspec over one :class:`Storage`; every path is ``<key prefix>/<file name>``.

    Records the files it wrote (``written``), so that the anchor's digest is taken over
    exactly those objects and never over a listing, which may lag.
    """

    protocol = (PROTOCOL,)
    # One instance per writer or reader: fsspec's instance cache would key on the
    # storage's URL and hand one writer's record of its files to another.
    cachable = False

    def __init__(self, *, storage: Storage, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.storage = storage
        self._lock = threading.Lock()
        self.written: set[str] = set()

    def key(self, path: str | os.PathLike[str]) -> str:
        return object_key(self._strip_protocol(os.fspath(path)))

    def _open(self, path: str, mode: str = "rb", **_: Any) -> io.BytesIO:
        if mode == "rb":
            return io.BytesIO(self.storage.get(self.key(path)))
        if mode == "wb":
            return _PutOnClose(self, self._strip_protocol(path))
        raise ValueError(f"{PROTOCOL}: mode {mode!r} is not supported (rb, wb)")

    def _put(self, path: str, data: bytes) -> None:
        self.storage.put(self.key(path), data)
        with self._lock:
            self.written.add(path)

    def exists(self, path: str, **_: Any) -> bool:
        return self.storage.size(self.key(path)) is not None

    def info(self, path: str, **_: Any) -> dict[str, Any]:
        name = self._strip_protocol(path)
        size = self.storage.size(self.key(name))
        if size is None:
            raise FileNotFoundError(name)
        return {"name": name, "size": size, "type": "file"}

    def ls(self, path: str, detail: bool = True, **_: Any) -> list[Any]:
        prefix = self.key(path) + "/"
        entries = [
            {"name": file_path(info.key), "size": info.size_bytes, "type": "file"}
            for info in self.storage.list(prefix)
        ]
        return entries if detail else [entry["name"] for entry in entries]

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """An object store has no directories; a key's prefix is enough."""

    def mkdir(self, path: str, create_parents: bool = True, **_: Any) -> None:
        """As :meth:`makedirs`."""

    def rm_file(self, path: str) -> None:
        name = self._strip_protocol(path)
        self.storage.delete(self.key(name))
        with self._lock:
            self.written.discard(name)

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        for name in [path] if isinstance(path, str) else path:
            self.rm_file(name)

    def mv(self, path1: str, path2: str, **_: Any) -> None:
        source, target = self._strip_protocol(path1), self._strip_protocol(path2)
        self._put(target, self.storage.get(self.key(source)))
        self.rm_file(source)


class _PutOnClose(io.BytesIO):
    """A file being written: its bytes are put as one object when it is closed."""

    def __init__(self, filesystem: StoreFileSystem, path: str) -> None:
        super().__init__()
        self._filesystem = filesystem
        self._path = path

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._filesystem._put(self._path, data)


fsspec.register_implementation(PROTOCOL, StoreFileSystem, clobber=True)


def anchor_prefix(snapshot: Path | str) -> str:
    """The key prefix of the anchor of the snapshot whose (staging) directory is
    ``snapshot``: ``<checkpoint_id>/trainer/anchor``."""
    return f"{check_id(Path(snapshot).name, 'checkpoint_id')}/{ANCHOR_DIR}"


def store_writer(storage: Storage, prefix: str) -> FsspecWriter:
    """DCP's fsspec writer onto ``storage`` under ``prefix``. DCP's own per-file syncs
    are off: a put is durable when it returns (docs/spec.md section 8.12)."""
    return FsspecWriter(f"{PROTOCOL}://{prefix}", sync_files=False, storage=storage)


def store_reader(storage: Storage, prefix: str) -> FsspecReader:
    """DCP's fsspec reader of the anchor under ``prefix`` on ``storage``."""
    return FsspecReader(f"{PROTOCOL}://{prefix}", storage=storage)


def written_files(writer: FsspecWriter, prefix: str) -> list[str]:
    """The files (relative to ``prefix``) that ``writer`` put, sorted."""
    # FsspecWriter keeps DCP's fsspec adapter in ``fs`` and the fsspec filesystem in its
    # ``fs``; the declared type is DCP's local one.
    filesystem: StoreFileSystem = cast(Any, writer.fs).fs
    return sorted(name[len(prefix) + 1 :] for name in filesystem.written)
