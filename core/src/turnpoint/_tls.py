"""TLS credentials for participant servers and their clients, from PEM files.

Reading the files is blocking I/O: async callers run these in a thread
(``await asyncio.to_thread(server_credentials, ...)``); at process start, before the
event loop runs, calling them directly is fine.
"""

from __future__ import annotations

from pathlib import Path

import grpc


def read_pem(path: str | Path, what: str) -> bytes:
    """The bytes of a PEM file; ``what`` names it in the error (never its content)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {what} {str(path)!r}: {err.strerror}") from err
    if not data.strip():
        raise ValueError(f"{what} {str(path)!r} is empty")
    return data


def server_credentials(
    cert_file: str | Path,
    key_file: str | Path,
    client_ca_file: str | Path | None = None,
) -> grpc.ServerCredentials:
    """Server TLS; with ``client_ca_file`` every client must present a certificate it signed."""
    root = read_pem(client_ca_file, "client CA file") if client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(read_pem(key_file, "TLS key file"), read_pem(cert_file, "TLS certificate file"))],
        root_certificates=root,
        require_client_auth=root is not None,
    )


def client_credentials(
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> grpc.ChannelCredentials:
    """Client TLS: trust ``ca_file`` (system roots when None); a cert and key for mutual TLS."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca_file, "CA file") if ca_file is not None else None,
        private_key=read_pem(key_file, "TLS key file") if key_file is not None else None,
        certificate_chain=read_pem(cert_file, "TLS certificate file")
        if cert_file is not None
        else None,
    )
