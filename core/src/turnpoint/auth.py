"""Credentials both ends share: the bearer token's rules and the client's call metadata.

A control or data call authenticates with ``authorization: Bearer <token>`` in its
metadata (docs/spec.md section 10). This module is the client half and the token's
validation; the server half (the interceptor that checks it) lives in
``turnpoint.server``. Nothing here imports grpc at module load: the participant SDK and
the coordinator's pure parts may import it freely.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import grpc


TOKEN_ENV: Final = "TURNPOINT_TOKEN"
TOKEN_FILE_ENV: Final = "TURNPOINT_TOKEN_FILE"
# docs/spec.md section 10.2 item 8: a participant may check the control token against
# its SHA-256 (64 hex digits) instead of holding the token itself.
CONTROL_TOKEN_SHA256_ENV: Final = "TURNPOINT_CONTROL_TOKEN_SHA256"
_SHA256_HEX_CHARS: Final = 64

AUTHORIZATION_KEY: Final = "authorization"
BEARER_SCHEME: Final = "bearer"
_MAX_TOKEN_CHARS: Final = 4096

# Initial metadata an agent sends once it has accepted a Run (admission passed), so the
# trainer can count the attempt as dispatched before the first boundary arrives.
ACCEPTED_METADATA_KEY: Final = "turnpoint-accepted"
ACCEPTED_METADATA: Final = ((ACCEPTED_METADATA_KEY, "1"),)
# Sent with it: the incarnation that accepted, which the trainer names on every re-attach
# so that a process restarted at the same address refuses instead of starting the
# attempt again (docs/spec.md section 6.5 item 5).
INCARNATION_METADATA_KEY: Final = "turnpoint-incarnation"


def accepted_metadata(incarnation: str) -> tuple[tuple[str, str], ...]:
    """The initial metadata of an accepted Run: accepted, and by which incarnation."""
    return (*ACCEPTED_METADATA, (INCARNATION_METADATA_KEY, incarnation))


def validate_token(token: str) -> str:
    """The token if it can travel in gRPC metadata; the error never quotes it."""
    if not token:
        raise ValueError("the bearer token is empty")
    if len(token) > _MAX_TOKEN_CHARS:
        raise ValueError(f"the bearer token is longer than {_MAX_TOKEN_CHARS} characters")
    # Visible ASCII only: metadata values are ASCII, and a space or newline would make
    # "Bearer <token>" ambiguous to parse.
    if not all("!" <= char <= "~" for char in token):
        raise ValueError("the bearer token must be visible ASCII without spaces")
    return token


def load_token(
    token_file: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The server's token: ``token_file``, else ``$TURNPOINT_TOKEN``, else the file named
    by ``$TURNPOINT_TOKEN_FILE``; None when none is configured.

    A file's trailing newline is dropped. Reads a file: call it before the event loop
    starts or through ``asyncio.to_thread``.
    """
    env = os.environ if environ is None else environ
    if token_file is None:
        inline = env.get(TOKEN_ENV)
        if inline:
            return validate_token(inline)
        token_file = env.get(TOKEN_FILE_ENV) or None
        if token_file is None:
            return None
    try:
        text = Path(token_file).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the token file {str(token_file)!r}: {err}") from None
    return validate_token(text.strip())


def token_sha256(token: str) -> str:
    """The digest a participant checks the control ``token`` against: SHA-256 of its
    ASCII bytes, 64 lower-case hex digits (docs/spec.md section 10.2 item 8)."""
    return hashlib.sha256(validate_token(token).encode("ascii")).hexdigest()


def validate_token_sha256(digest: str) -> str:
    """``digest`` as 64 lower-case hex digits; the error never quotes it."""
    normalized = digest.strip().lower()
    if len(normalized) != _SHA256_HEX_CHARS or not all(c in "0123456789abcdef" for c in normalized):
        raise ValueError("a control token digest is 64 hex digits (SHA-256 of the token)")
    return normalized


def load_token_sha256(
    digest_file: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The control token's digest: ``digest_file``, else
    ``$TURNPOINT_CONTROL_TOKEN_SHA256``; None when neither is configured. Reads a file:
    call it before the event loop starts or through ``asyncio.to_thread``."""
    env = os.environ if environ is None else environ
    if digest_file is None:
        inline = env.get(CONTROL_TOKEN_SHA256_ENV)
        return validate_token_sha256(inline) if inline else None
    try:
        text = Path(digest_file).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the digest file {str(digest_file)!r}: {err}") from None
    return validate_token_sha256(text)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates one call: ``stub.X(req, metadata=auth_metadata(t))``."""
    return ((AUTHORIZATION_KEY, f"Bearer {validate_token(token)}"),)


def bearer_call_credentials(token: str) -> grpc.CallCredentials:
    """Per-call credentials for a TLS channel (``grpc.composite_channel_credentials``)."""
    import grpc

    return grpc.access_token_call_credentials(validate_token(token))
