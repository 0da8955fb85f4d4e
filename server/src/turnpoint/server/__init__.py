"""Hosting participants as real gRPC servers: health, reflection, auth, graceful drain.

:func:`host_participant` serves a :class:`~turnpoint.participant_sdk.ParticipantRuntime`
(the control service and its kind's data plane) on a :class:`ParticipantServer` under
bearer-token auth and optional mutual TLS; :class:`WorkerGroup` runs several worker
processes behind one endpoint, each its own participant (:func:`host_worker` on the
worker's side); :func:`auth_metadata` (re-exported from
:mod:`turnpoint.auth`) is the client half of the auth. The example Gym servers live
with the applications, in ``turnpoint.apps.examples``.
"""

from turnpoint.auth import (
    ACCEPTED_METADATA,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    auth_metadata,
    bearer_call_credentials,
    load_token,
    validate_token,
)
from turnpoint.server._auth import BearerTokenInterceptor
from turnpoint.server._control import ControlServicer
from turnpoint.server._data import (
    PolicyServicer,
    ResourcesServicer,
    RolloutServicer,
)
from turnpoint.server._group import GroupMember, GroupRoster, WorkerSlot, worker_name
from turnpoint.server._host import (
    HostedParticipant,
    host_participant,
    register_runtime,
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
from turnpoint.server._metrics import MetricsEndpoint, ParticipantMetrics, serve_metrics
from turnpoint.server._workers import (
    READY_PREFIX,
    WORKER_SLOT_ENV,
    WorkerGroup,
    announce_ready,
    die_with_parent,
    host_worker,
    worker_slot_from_env,
)

__all__ = [
    "ACCEPTED_METADATA",
    "CONTROL_SERVICE",
    "DATA_PLANE_SERVICES",
    "DEFAULT_MAX_LIST_LENGTH",
    "HEALTH_SERVICE",
    "READY_PREFIX",
    "REFLECTION_SERVICES",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "WORKER_SLOT_ENV",
    "BearerTokenInterceptor",
    "ControlServicer",
    "DrainHook",
    "GroupMember",
    "GroupRoster",
    "HostedParticipant",
    "MetricsEndpoint",
    "ParticipantMetrics",
    "ParticipantServer",
    "PolicyServicer",
    "RegisterServicers",
    "ResourcesServicer",
    "RolloutServicer",
    "ServerOptions",
    "ServerState",
    "WorkerGroup",
    "WorkerSlot",
    "announce_ready",
    "auth_metadata",
    "bearer_call_credentials",
    "check_list_length",
    "die_with_parent",
    "host_participant",
    "host_worker",
    "load_token",
    "register_runtime",
    "serve_metrics",
    "validate_token",
    "worker_name",
    "worker_slot_from_env",
]
