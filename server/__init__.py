"""Hosting participants as real gRPC servers: health, reflection, auth, graceful drain.

:func:`host_participant` serves a :class:`~turnpoint.participant_sdk.ParticipantRuntime`
(the control service and its kind's data plane) on a :class:`ParticipantServer` under
bearer-token auth and optional mutual TLS; :func:`auth_metadata` is the client half of
the auth. :func:`build_example` makes the example Gym servers the demo and tests run.
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
from turnpoint.server._control import ControlServicer
from turnpoint.server._data import (
    ACCEPTED_METADATA,
    PolicyServicer,
    ResourcesServicer,
    RolloutServicer,
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
from turnpoint.server._serve import (
    EXAMPLES,
    ExampleSpec,
    HostedParticipant,
    build_example,
    host_participant,
    register_runtime,
)

__all__ = [
    "ACCEPTED_METADATA",
    "CONTROL_SERVICE",
    "DATA_PLANE_SERVICES",
    "DEFAULT_MAX_LIST_LENGTH",
    "EXAMPLES",
    "HEALTH_SERVICE",
    "REFLECTION_SERVICES",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "BearerTokenInterceptor",
    "ControlServicer",
    "DrainHook",
    "ExampleSpec",
    "HostedParticipant",
    "ParticipantServer",
    "PolicyServicer",
    "RegisterServicers",
    "ResourcesServicer",
    "RolloutServicer",
    "ServerOptions",
    "ServerState",
    "auth_metadata",
    "bearer_call_credentials",
    "build_example",
    "check_list_length",
    "host_participant",
    "load_token",
    "register_runtime",
    "validate_token",
]
