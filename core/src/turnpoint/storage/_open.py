"""``open_storage``: a storage URL (or a plain path) to a :class:`Storage`.

docs/spec.md section 8.12. Pure parsing plus a constructor call; nothing is reached
until the storage is used (call ``check()`` at startup to fail early).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from turnpoint.storage._objects import Storage


def is_url(value: str | os.PathLike[str]) -> bool:
    """Whether ``value`` is a storage URL rather than a plain path."""
    return isinstance(value, str) and "://" in value


def open_storage(location: str | os.PathLike[str], *, endpoint_url: str | None = None) -> Storage:
    """The storage at ``location``: a path, ``file:///path[?mount=shared]`` or ``s3://b/p``.

    For ``s3://`` the endpoint is ``endpoint_url`` or boto3's own configuration
    (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the config file); credentials are
    always boto3's (environment, config file, instance role), never part of the URL.
    """
    from turnpoint.storage._local import FileStorage

    if not is_url(location):
        return FileStorage(Path(location))
    parts = urlsplit(str(location))
    query = parse_qs(parts.query, strict_parsing=False)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{location}: a file URL names no host")
        mount = query.pop("mount", ["local"])
        if query or mount not in (["local"], ["shared"]):
            raise ValueError(f"{location}: the only option is mount=local|shared")
        return FileStorage(Path(unquote(parts.path)), shared=mount == ["shared"])
    if parts.scheme == "s3":
        if not parts.netloc or parts.username or parts.password or query:
            raise ValueError(
                f"{parts.scheme}://{parts.hostname}/...: an s3 URL is s3://bucket/prefix, "
                "without credentials or options (boto3 reads them from the environment)"
            )
        from turnpoint.storage._s3 import S3Storage

        return S3Storage(parts.netloc, unquote(parts.path), endpoint_url=endpoint_url)
    raise ValueError(f"{location}: storage URLs are file:// or s3://, not {parts.scheme}://")
