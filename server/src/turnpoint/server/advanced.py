"""For assembling your own hosting out of the pieces :func:`turnpoint.server.host_participant` uses.

- The server around any servicers: :class:`ParticipantServer` (keepalive, auth, TLS,
  health, reflection, graceful drain; its :data:`ServerState`), which takes a
  :data:`RegisterServicers` callback and runs :data:`DrainHook` s between NOT_SERVING
  and stop. :data:`CONTROL_SERVICE` and :data:`HEALTH_SERVICE` are the full service
  names it reports health for.
- The participant's services: :func:`register_runtime` (the callback for a runtime: the
  control service and its kind's data plane, a worker's :class:`GroupRoster` in every
  Describe, with its :class:`GroupMember` s) or the servicers one by one,
  :class:`ControlServicer`, :class:`RolloutServicer`, :class:`PolicyServicer`,
  :class:`ResourcesServicer`.
- :class:`BearerTokenInterceptor`: the server half of the bearer-token auth.
- Prometheus metrics on a registry of your own: :class:`ParticipantMetrics`,
  :func:`serve_metrics` and the :class:`MetricsEndpoint` it returns.
"""

from turnpoint.server._auth import BearerTokenInterceptor
from turnpoint.server._control import ControlServicer
from turnpoint.server._data import PolicyServicer, ResourcesServicer, RolloutServicer
from turnpoint.server._grpc_server import (
    CONTROL_SERVICE,
    HEALTH_SERVICE,
    DrainHook,
    ParticipantServer,
    RegisterServicers,
    ServerState,
)
from turnpoint.server._hosted_participant import register_runtime
from turnpoint.server._metrics import MetricsEndpoint, ParticipantMetrics, serve_metrics
from turnpoint.server._worker_slot import GroupMember, GroupRoster

__all__ = [
    "CONTROL_SERVICE",
    "HEALTH_SERVICE",
    "BearerTokenInterceptor",
    "ControlServicer",
    "DrainHook",
    "GroupMember",
    "GroupRoster",
    "MetricsEndpoint",
    "ParticipantMetrics",
    "ParticipantServer",
    "PolicyServicer",
    "RegisterServicers",
    "ResourcesServicer",
    "RolloutServicer",
    "ServerState",
    "register_runtime",
    "serve_metrics",
]
