"""Where snapshots are kept: one small interface over a disk, a shared mount or S3.

docs/spec.md section 8.12. Every writer and reader of snapshots (the participants'
records, the trainer's publication, restore, ``turnpoint inspect``) names its storage by
URL and reaches it through :class:`Storage`:

- a plain path or ``file:///abs/path``: the local filesystem (temporary file, fsync,
  link or rename, fsync of the directory);
- ``file:///abs/path?mount=shared``: a filesystem shared between machines (NFS and
  kin), where a directory fsync may be refused and is not needed;
- ``s3://bucket/prefix``: an S3-compatible object store through boto3 (installed with
  the ``s3`` extra); the endpoint and credentials come from boto3's own environment
  (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...) and are never written anywhere.

Every method blocks: asyncio code calls them through ``asyncio.to_thread``.
"""

from turnpoint.storage._objects import (
    ObjectExistsError,
    ObjectInfo,
    ObjectMissingError,
    Storage,
    StorageAccessError,
    StorageError,
    TransientStorageError,
    check_key,
)
from turnpoint.storage._open import open_storage

__all__ = [
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectMissingError",
    "Storage",
    "StorageAccessError",
    "StorageError",
    "TransientStorageError",
    "check_key",
    "open_storage",
]
