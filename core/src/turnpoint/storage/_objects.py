"""The storage interface and its errors; pure (no file, network or clock).

docs/spec.md section 8.12. A key is a relative POSIX path whose every component is a
valid id (section 2.4), so no key can leave the root or the prefix it lives under, and
temporary names (which start with a dot) never collide with an object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import InvalidIdError, validate_id


class StorageError(TurnpointError):
    """Root of the storage errors; each carries the storage URL (never a credential)."""

    _reason = Reason.INVALID_CHECKPOINT_STATE

    def __init__(self, url: str, message: str, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(self._reason, f"{url}: {message}", {"storage": url, **(metadata or {})})
        self.url = url

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.__dict__.copy(), self.args))


def _rebuild(
    cls: type[StorageError], state: dict[str, object], args: tuple[object, ...]
) -> StorageError:
    error = cls.__new__(cls)
    error.__dict__.update(state)
    error.args = args
    return error


class TransientStorageError(StorageError):
    """The store failed for now (5xx, throttling, a dropped connection): try again.

    ``STORAGE_UNAVAILABLE``: the snapshot that met it fails and the next is tried
    (docs/spec.md section 7.5); nothing is published that is not whole.
    """

    _reason = Reason.STORAGE_UNAVAILABLE


class StorageAccessError(StorageError):
    """The store refused the credentials or the bucket does not exist: fix the config."""

    _reason = Reason.UNAUTHENTICATED


class ObjectMissingError(StorageError):
    """No object under this key."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(url, f"no object {key!r}", {"key": key})
        self.key = key


class ObjectExistsError(StorageError):
    """The commit write found the key taken: a create never replaces."""

    _reason = Reason.CHECKPOINT_CONFLICT

    def __init__(self, url: str, key: str) -> None:
        super().__init__(url, f"object {key!r} exists already", {"key": key})
        self.key = key


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object as a listing reports it."""

    key: str
    size_bytes: int


def check_key(key: str) -> str:
    """``key`` if every ``/``-separated component is a valid id, else ``ValueError``."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"a storage key must be a non-empty string, not {key!r}")
    for part in key.split("/"):
        try:
            validate_id(part, "storage key")
        except InvalidIdError:
            raise ValueError(f"storage key {key!r}: {part!r} is not a valid component") from None
    return key


class Storage(Protocol):
    """Objects under keys; every call blocks and is safe from several threads.

    ``put`` and ``create`` make ``data`` durable before they return, whole or not at
    all: a reader sees the old object, the new one or none, never a part. ``create`` is
    the commit write: it fails with :class:`ObjectExistsError` instead of replacing.
    """

    @property
    def url(self) -> str:
        """The storage's URL as configured, without credentials."""
        ...

    def check(self) -> None:
        """Reach the storage once; :class:`StorageAccessError` if it refuses us."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any object there."""
        ...

    def create(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` unless the key is taken (the commit write)."""
        ...

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        """The object's bytes (at most ``limit + 1`` of them); :class:`ObjectMissingError`."""
        ...

    def size(self, key: str) -> int | None:
        """The object's size in bytes, or ``None`` when there is no such object."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""
        ...

    def delete(self, key: str) -> bool:
        """Remove the object; ``False`` if there was none."""
        ...
