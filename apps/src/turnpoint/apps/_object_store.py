"""An S3-compatible object store on loopback for the applications (docs/spec.md 8.12).

``turnpoint demo --storage s3`` and ``turnpoint bench-storage`` run their snapshots on
moto's S3 server, started here in this process on 127.0.0.1 with a port the kernel
picks (moto is an in-process Python server: nothing to install beyond ``moto[server]``,
a real HTTP endpoint for boto3). A client process reaches it through the environment
alone (:attr:`ObjectStore.environment`: the endpoint and dummy credentials, boto3's own
variables), never through a manifest or a command line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ObjectStore:
    """Where snapshots go on an object store, and what a process needs to reach it."""

    url: str
    environment: Mapping[str, str] = field(default_factory=dict)


def loopback_s3_available() -> bool:
    """Whether moto's server (the ``moto[server]`` package) is installed."""
    return importlib.util.find_spec("moto") is not None


@contextlib.contextmanager
def loopback_s3(prefix: str = "snapshots") -> Iterator[ObjectStore]:
    """moto's S3 server on 127.0.0.1 with a fresh bucket; yields ``s3://bucket/prefix``
    and the environment a client needs. Stops the server on exit; blocking."""
    import boto3
    from moto.server import ThreadedMotoServer

    # One line per request otherwise, on the demo's console.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        environment = {
            "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "loopback",
            "AWS_SECRET_ACCESS_KEY": "loopback",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        bucket = f"turnpoint-{secrets.token_hex(4)}"
        boto3.client(
            "s3",
            endpoint_url=environment["AWS_ENDPOINT_URL_S3"],
            aws_access_key_id=environment["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=environment["AWS_SECRET_ACCESS_KEY"],
            region_name=environment["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket=bucket)
        yield ObjectStore(f"s3://{bucket}/{prefix}", environment)
    finally:
        server.stop()
