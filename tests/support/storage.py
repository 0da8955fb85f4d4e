"""Storage for tests: a real S3 endpoint on loopback (moto's server) and the three kinds.

``moto_endpoint`` starts moto's threaded server on 127.0.0.1 with a port the kernel
picks, and points boto3 at it through the environment, as a user would
(``AWS_ENDPOINT_URL_S3``, dummy credentials). ``storage_kinds`` are the ids the suites
are parametrized over: ``local`` (a directory), ``shared`` (a second directory opened as
a shared mount) and ``s3`` (a fresh bucket on the moto server).

Faults of the store: ``fail_next_puts`` (5xx and throttling answers), ``slow_store``
(every request delayed or every PUT held, at boto3's ``before-send``) and
:class:`LaggingListing` (a LIST that misses the newest objects).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from turnpoint.storage import ObjectInfo, Storage, open_storage

STORAGE_KINDS = ("local", "shared", "s3")

_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # One retry: enough to show a retried put, short of boto3's longer backoffs.
    "AWS_MAX_ATTEMPTS": "2",
}


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on loopback; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    # One line per request otherwise, in every failing test's captured log.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str) -> str:
    """A new, empty bucket on ``endpoint``; returns its name."""
    import boto3

    name = f"tp-{secrets.token_hex(6)}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def _moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def moto_endpoint(_moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The session's moto server, with boto3's environment pointing at it."""
    for name, value in _ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", _moto_endpoint)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    return _moto_endpoint


def storage_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A fresh storage location of ``kind`` (an s3 kind asks for ``moto_endpoint``)."""
    if kind == "local":
        return str(tmp_path / "store")
    if kind == "shared":
        return (tmp_path / "mount").absolute().as_uri() + "?mount=shared"
    if kind == "s3":
        endpoint: str = request.getfixturevalue("moto_endpoint")
        return f"s3://{make_bucket(endpoint)}/job-{secrets.token_hex(3)}"
    raise ValueError(kind)


@pytest.fixture(params=STORAGE_KINDS)
def storage_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One location per kind: a suite using this runs once per kind."""
    kind: str = request.param
    return storage_url(kind, tmp_path, request)


@pytest.fixture
def storage(storage_location: str) -> Storage:
    opened = open_storage(storage_location)
    opened.check()
    return opened


class PutFaults:
    """Injected put failures on one S3 storage; see :func:`fail_next_puts`."""

    def __init__(self, storage: Storage, count: int, status: int) -> None:
        from botocore.awsrequest import AWSResponse

        self.failed = 0
        code = "SlowDown" if status == 503 else "InternalError"
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()

        class _Raw:
            def stream(self, **_: Any) -> Iterator[bytes]:
                yield body

            def read(self, *_: Any) -> bytes:
                return body

        def before_send(request: Any, **_: Any) -> AWSResponse | None:
            if request.method != "PUT" or self.failed >= count:
                return None
            self.failed += 1
            return AWSResponse(request.url, status, {}, _Raw())

        self._handler = before_send
        self._events = getattr(storage, "client").meta.events  # noqa: B009 - S3Storage only
        self._events.register("before-send.s3.PutObject", before_send)

    def stop(self) -> None:
        self._events.unregister("before-send.s3.PutObject", self._handler)


def fail_next_puts(storage: Storage, count: int, status: int = 503) -> PutFaults:
    """Make the next ``count`` HTTP puts of an S3 storage answer ``status``.

    The failure is injected where boto3 sends the request (its ``before-send`` event),
    so its retry logic and error parsing run as against a real failing store.
    """
    return PutFaults(storage, count, status)


class LaggingListing:
    """A storage whose listing lags: ``list`` misses the ``hidden`` objects written
    last (the eventual consistency of LIST some stores have), while every read of a
    named object (``get``, ``size``) sees it at once, as S3 guarantees. Wraps any
    :class:`Storage`; everything else is passed through."""

    def __init__(self, storage: Storage, hidden: int = 0) -> None:
        self.inner = storage
        self.hidden = hidden
        self._written: list[str] = []

    @property
    def url(self) -> str:
        return self.inner.url

    def check(self) -> None:
        self.inner.check()

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        self._wrote(key)

    def create(self, key: str, data: bytes) -> None:
        self.inner.create(key, data)
        self._wrote(key)

    def _wrote(self, key: str) -> None:
        if key in self._written:
            self._written.remove(key)
        self._written.append(key)

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        return self.inner.get(key, limit=limit)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        unseen = set(self._written[-self.hidden :]) if self.hidden else set()
        return [info for info in self.inner.list(prefix) if info.key not in unseen]

    def delete(self, key: str) -> bool:
        if key in self._written:
            self._written.remove(key)
        return self.inner.delete(key)


class SlowStore:
    """Every S3 request this process sends waits where boto3 sends it (its
    ``before-send`` event): ``delay_s`` each, and, while :meth:`hold` is on, every PUT
    until :meth:`release` (at most ``bound_s``). Records the threads that sent them."""

    def __init__(self, bound_s: float = 30.0) -> None:
        self.delay_s = 0.0
        self.bound_s = bound_s
        self.held = threading.Event()  # a held PUT is waiting
        self.senders: set[int] = set()
        self._open = threading.Event()
        self._open.set()

    def hold(self) -> None:
        self.held.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def before_send(self, request: Any, **_: Any) -> None:
        self.senders.add(threading.get_ident())
        if request.method == "PUT" and not self._open.is_set():
            self.held.set()
            self._open.wait(self.bound_s)
        if self.delay_s:
            time.sleep(self.delay_s)  # the injected slowness, not a synchronisation


@pytest.fixture
def slow_store(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowStore]:
    """Every S3 client made from now on in this process goes through one
    :class:`SlowStore` (the trainer's and the in-process participants' alike)."""
    from turnpoint.storage import _s3

    slow = SlowStore()
    make_client = _s3._make_client

    def make_slow_client(endpoint_url: str | None) -> Any:
        client = make_client(endpoint_url)
        client.meta.events.register("before-send.s3", slow.before_send)
        return client

    monkeypatch.setattr(_s3, "_make_client", make_slow_client)
    try:
        yield slow
    finally:
        slow.release()
