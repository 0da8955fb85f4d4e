"""Connection settings for both ends of every turnpoint connection, in one place.

Keepalive settings come from this one module (docs/spec.md section 3.5): a client that pings more
often than its server tolerates gets a GOAWAY ("too_many_pings") and drops every call on
the connection, so the two sides must be configured from the same numbers.

Control calls get their own connection. gRPC shares one connection (subchannel) among
channels to the same target whose arguments are equal, so a control channel opened
next to a data channel would otherwise ride the very connection whose flow-control
window a burst of rollout traffic has filled, and a Renew could miss its lease behind
megabytes of tokens. :func:`control_channel` sets a channel argument that no data
channel carries, which makes its subchannel key, and so its TCP connection, distinct.

Each control channel also keeps its subchannels to itself (a local subchannel pool).
gRPC's global pool would hand a new control channel the subchannel of any other
channel to the same address, in whatever state it is: a coordinator started after a
job restart, talking to a participant replaced on the same port (a worker group's, a
Ray actor's), would inherit the backoff of a connection that failed while the port was
dead and be refused for up to ``MAX_RECONNECT_BACKOFF_MS`` although the new server
listens (seen as a discovery that failed "connection refused" against a listening
server in the fault-sequence test).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

import grpc

ChannelOptions = tuple[tuple[str, int | str], ...]
ChannelRole = Literal["control", "data"]

# Every 20 s an idle connection proves it is alive: a coordinator keeps ControlSession
# streams open for hours with nothing on them between checkpoints, and a half-open TCP
# connection (a preempted node, a dropped NAT entry) must surface well within a lease.
KEEPALIVE_TIME_MS: Final = 20_000
KEEPALIVE_TIMEOUT_MS: Final = 10_000
# The server must accept pings at least as often as clients send them; half the client
# interval leaves room for timer jitter on a busy 2-core machine.
_MIN_RECV_PING_INTERVAL_MS: Final = KEEPALIVE_TIME_MS // 2

# gRPC's own default (4 MiB) is too small for a Restore that carries a few thousand
# episode references plus their metadata, and unbounded is not a bound (docs/spec.md section 10).
DEFAULT_MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024

# gRPC backs off up to 120 s between reconnects by default; a restarted participant must
# be reachable again within a lease, not two minutes later.
_INITIAL_RECONNECT_BACKOFF_MS: Final = 200
MAX_RECONNECT_BACKOFF_MS: Final = 5_000

# Not a gRPC-core argument: core keeps unknown arguments and compares them when it looks
# up a shared subchannel, which is exactly what separates control from data connections.
CHANNEL_ROLE_ARG: Final = "turnpoint.channel_role"
# gRPC core: this channel's subchannels are its own, never shared with another channel.
LOCAL_SUBCHANNEL_POOL: Final = ("grpc.use_local_subchannel_pool", 1)


def _check_size(max_message_bytes: int) -> int:
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
    return max_message_bytes


def server_options(
    *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, reuse_port: bool = False
) -> ChannelOptions:
    """Options for ``grpc.aio.server(options=...)``.

    ``reuse_port`` is for the workers of one group sharing a port (docs/spec.md section
    3.9); every other server binds its port alone."""
    size = _check_size(max_message_bytes)
    return (
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _MIN_RECV_PING_INTERVAL_MS),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", size),
        ("grpc.max_send_message_length", size),
        # With SO_REUSEPORT (gRPC's default on Linux) a second server on a fixed port binds
        # silently and steals half the connections; a taken port must fail loudly instead.
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    )


def channel_options(
    *, role: ChannelRole = "data", max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> ChannelOptions:
    """Options for a client channel; ``role`` keeps control and data connections apart."""
    size = _check_size(max_message_bytes)
    return (
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # Without this, a client stops pinging after two pings on a connection with no
        # data, which defeats keepalive on an idle ControlSession.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", size),
        ("grpc.max_send_message_length", size),
        ("grpc.initial_reconnect_backoff_ms", _INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.min_reconnect_backoff_ms", _INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        (CHANNEL_ROLE_ARG, role),
    )


def _open(
    target: str,
    role: ChannelRole,
    credentials: grpc.ChannelCredentials | None,
    max_message_bytes: int,
    extra_options: Sequence[tuple[str, int | str]],
) -> grpc.aio.Channel:
    options = channel_options(role=role, max_message_bytes=max_message_bytes) + tuple(extra_options)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def control_channel(
    target: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, int | str]] = (),
) -> grpc.aio.Channel:
    """A channel for ``CheckpointControlService`` on a connection no data channel shares.

    ``credentials`` None means plaintext; pass :func:`turnpoint._tls.client_credentials`
    for TLS. The bearer token is not part of the channel: send
    :func:`turnpoint.server.auth_metadata` with each call.
    """
    return _open(
        target,
        "control",
        credentials,
        max_message_bytes,
        (LOCAL_SUBCHANNEL_POOL, *extra_options),
    )


def data_channel(
    target: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, int | str]] = (),
) -> grpc.aio.Channel:
    """A channel for the data-plane services (rollouts, policy, resources)."""
    return _open(target, "data", credentials, max_message_bytes, extra_options)
