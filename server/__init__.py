"""Hosting participants as real gRPC servers: health, reflection, auth, graceful drain.

:class:`ParticipantServer` hosts caller-provided servicers under bearer-token auth and
optional mutual TLS; :func:`auth_metadata` is the client half of the auth.
"""

from turnpoint.server._auth import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    BearerTokenInterceptor,
    auth_metadata,
    bearer_call_credentials,
    load_token,
    validate_token,
)
from turnpoint.server._hosting import (
    CONTROL_SERVICE,
    DATA_PLANE_SERVICES,
    DEFAULT_MAX_LIST_LENGTH,
    HEALTH_SERVICE,
    REFLECTION_SERVICES,
    DrainHook,
    ParticipantServer,
    RegisterServicers,
    ServerOptions,
    ServerState,
    check_list_length,
)

__all__ = [
    "CONTROL_SERVICE",
    "DATA_PLANE_SERVICES",
    "DEFAULT_MAX_LIST_LENGTH",
    "HEALTH_SERVICE",
    "REFLECTION_SERVICES",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "BearerTokenInterceptor",
    "DrainHook",
    "ParticipantServer",
    "RegisterServicers",
    "ServerOptions",
    "ServerState",
    "auth_metadata",
    "bearer_call_credentials",
    "check_list_length",
    "load_token",
    "validate_token",
]
