"""An S3-compatible object store as storage, through boto3.

docs/spec.md section 8.12. boto3 rather than s3fs: the calls here are few and blocking
by nature (they run in threads already), boto3's client is thread-safe, its retry mode
``standard`` retries 5xx and throttling with backoff, and its errors carry the store's
error code, which is what we branch on (never the message). s3fs would add an asyncio
loop of its own behind a sync facade and a second layer of caching (a stale listing
cache is the last thing a commit protocol wants).

``create`` is a conditional put (``If-None-Match: *``): the store answers 412 when the
key exists, so the manifest's arrival is the commit and a second publisher loses.
Every put carries its SHA-256 (``ChecksumSHA256``), so a body damaged on the way is
refused by the store rather than stored.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from typing import TYPE_CHECKING, Any, Final

from turnpoint.storage._objects import (
    ObjectExistsError,
    ObjectInfo,
    ObjectMissingError,
    StorageAccessError,
    StorageError,
    TransientStorageError,
    check_key,
)

if TYPE_CHECKING:
    from botocore.client import BaseClient

# The store's own error codes; botocore reports them as ``Error.Code``.
_MISSING: Final = frozenset({"NoSuchKey", "404", "NotFound"})
_EXISTS: Final = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})
_ACCESS: Final = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "ExpiredToken",
        "InvalidToken",
        "403",
        "NoSuchBucket",
    }
)
_THROTTLED: Final = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded"}
)


class S3Storage:
    """Objects under ``s3://bucket/prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        client: BaseClient | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if client is None:
            client = _make_client(endpoint_url)
        self.client: Any = client

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def check(self) -> None:
        self._call(None, self.client.head_bucket, Bucket=self.bucket)

    def put(self, key: str, data: bytes) -> None:
        self._put(key, data)

    def create(self, key: str, data: bytes) -> None:
        self._put(key, data, IfNoneMatch="*")

    def _put(self, key: str, data: bytes, **conditions: str) -> None:
        checksum = base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")
        self._call(
            key,
            self.client.put_object,
            Bucket=self.bucket,
            Key=self._name(key),
            Body=data,
            ChecksumSHA256=checksum,
            **conditions,
        )

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        extra = {} if limit is None else {"Range": f"bytes=0-{limit}"}
        reply = self._call(
            key, self.client.get_object, Bucket=self.bucket, Key=self._name(key), **extra
        )
        body = reply["Body"]
        try:
            data: bytes = self._call(key, body.read)
        finally:
            body.close()
        return data

    def size(self, key: str) -> int | None:
        try:
            reply = self._call(
                key, self.client.head_object, Bucket=self.bucket, Key=self._name(key)
            )
        except ObjectMissingError:
            return None
        return int(reply["ContentLength"])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=base + prefix)
        found: list[ObjectInfo] = []
        for page in self._call(None, list, pages):
            for item in page.get("Contents", ()):
                found.append(ObjectInfo(item["Key"][len(base) :], int(item["Size"])))
        found.sort(key=lambda info: info.key)
        return found

    def delete(self, key: str) -> bool:
        if self.size(key) is None:
            return False
        self._call(key, self.client.delete_object, Bucket=self.bucket, Key=self._name(key))
        return True

    def _call(self, key: str | None, function: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one boto3 call, turning its failures into typed storage errors."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return function(*args, **kwargs)
        except ClientError as error:
            raise self._classify(key, error) from None
        except NoCredentialsError:
            raise StorageAccessError(self.url, "no credentials found in the environment") from None
        except BotoCoreError as error:
            # Connection refused or dropped, read timeouts, a checksum the store rejected
            # on the way: all for now, not for good.
            raise TransientStorageError(self.url, f"{type(error).__name__}: {error}") from None

    def _classify(self, key: str | None, error: Any) -> StorageError:
        details = error.response.get("Error", {})
        code = str(details.get("Code", ""))
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        if key is not None and code in _MISSING:
            return ObjectMissingError(self.url, key)
        if key is not None and code in _EXISTS:
            return ObjectExistsError(self.url, key)
        if code in _ACCESS or status in (401, 403) or (key is None and status == 404):
            return StorageAccessError(self.url, f"the store refused access ({code or status})")
        if code in _THROTTLED or status >= 500 or status == 429:
            return TransientStorageError(self.url, f"the store failed ({code or status})")
        return StorageError(self.url, f"the store answered {code or status}")


def _make_client(endpoint_url: str | None) -> BaseClient:
    try:
        import boto3
        import botocore.session
        from botocore.config import Config
    except ImportError:
        raise StorageError(
            "s3://", "s3:// storage needs boto3: install turnpoint-core[s3]"
        ) from None
    config = Config(
        # boto3's standard retries (3 tries with backoff, AWS_MAX_ATTEMPTS to change);
        # what still fails is a TransientStorageError and the snapshot is retried whole
        # (docs/spec.md section 7.5).
        retries={"mode": "standard"},
        # Ask for a checksum only where the call carries one (ChecksumSHA256 on puts).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # A fresh session per storage, so each reads the environment's credentials as they
    # are now; one shared loader, so the service model is parsed once per process.
    core = botocore.session.Session()
    core.register_component("data_loader", _loader())
    session = boto3.session.Session(botocore_session=core)
    return session.client("s3", endpoint_url=endpoint_url, config=config)


@functools.cache
def _loader() -> Any:
    from botocore.loaders import create_loader

    return create_loader()
