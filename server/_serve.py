"""Host a participant runtime as a gRPC server, and the ``turnpoint serve`` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from turnpoint.ids import InvalidIdError, validate_id
from turnpoint.participant_sdk import (
    ParticipantRuntime,
    RuntimeConfig,
    SnapshotStore,
    StoreFaults,
)
from turnpoint.server._auth import load_token
from turnpoint.server._control import ControlServicer
from turnpoint.server._data import PolicyServicer, ResourcesServicer, RolloutServicer
from turnpoint.server._hosting import (
    CONTROL_SERVICE,
    DEFAULT_MAX_LIST_LENGTH,
    ParticipantServer,
    RegisterServicers,
    ServerOptions,
)
from turnpoint.v1 import (
    checkpoint_control_service_pb2_grpc,
    policy_service_pb2_grpc,
    resources_service_pb2_grpc,
    rollout_service_pb2_grpc,
)

__all__ = [
    "EXAMPLES",
    "ExampleSpec",
    "HostedParticipant",
    "build_example",
    "host_participant",
    "register_runtime",
]

logger = logging.getLogger(__name__)

ROLLOUT_SERVICE = "turnpoint.v1.RolloutService"
POLICY_SERVICE = "turnpoint.v1.PolicyService"
RESOURCES_SERVICE = "turnpoint.v1.ResourcesService"


def register_runtime(
    runtime: ParticipantRuntime, *, max_list_length: int = DEFAULT_MAX_LIST_LENGTH
) -> RegisterServicers:
    """The servicers of ``runtime``: the control service and its kind's data plane."""

    def register(server: grpc.aio.Server) -> Sequence[str]:
        services = [CONTROL_SERVICE]
        checkpoint_control_service_pb2_grpc.add_CheckpointControlServiceServicer_to_server(
            ControlServicer(runtime, max_list_length=max_list_length), server
        )
        if runtime.agent is not None:
            rollout_service_pb2_grpc.add_RolloutServiceServicer_to_server(
                RolloutServicer(runtime, max_list_length=max_list_length), server
            )
            services.append(ROLLOUT_SERVICE)
        if runtime.resources is not None:
            resources_service_pb2_grpc.add_ResourcesServiceServicer_to_server(
                ResourcesServicer(runtime), server
            )
            services.append(RESOURCES_SERVICE)
        if runtime.model is not None:
            policy_service_pb2_grpc.add_PolicyServiceServicer_to_server(
                PolicyServicer(runtime), server
            )
            services.append(POLICY_SERVICE)
        return services

    return register


@dataclass
class HostedParticipant:
    """A runtime served on a port; ``async with`` starts and drains both."""

    runtime: ParticipantRuntime
    server: ParticipantServer
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> HostedParticipant:
        await self.runtime.start()
        await self.server.start()
        return self

    async def stop(self, grace: float | None = None) -> None:
        await self.server.drain_and_stop(grace)
        await self.runtime.aclose()
        for close in self.on_close:
            await close()

    async def __aenter__(self) -> HostedParticipant:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(0)


def host_participant(runtime: ParticipantRuntime, options: ServerOptions) -> HostedParticipant:
    """Wire ``runtime`` to a :class:`ParticipantServer` (not started yet)."""
    server = ParticipantServer(
        options, register_runtime(runtime, max_list_length=options.max_list_length)
    )
    return HostedParticipant(runtime, server)


@dataclass(frozen=True)
class ExampleSpec:
    """What an example participant needs beyond its kind: peers and files."""

    instance: str
    root: Path
    token: str | None = None
    policy_address: str | None = None
    resources: dict[str, str] = field(default_factory=dict)
    group_size: int = 4
    verifier_log: Path | None = None
    seed: int = 0
    faults: str = ""
    lease_s: float = 60.0
    temperature: float = 1.0
    turn_delay_s: float = 0.0


EXAMPLES: dict[str, tuple[str, ...]] = {
    "model": ("tiny-policy",),
    "resources": ("guess", "guess-group"),
    "agent": ("guess",),
}


def build_example(
    kind: str, example: str, spec: ExampleSpec
) -> tuple[ParticipantRuntime, list[Callable[[], Awaitable[None]]]]:
    """One of the example participants as a runtime, plus what to close after it."""
    # Imported here: the examples pull in torch, which `turnpoint serve --help` should not.
    from turnpoint.server.examples._participants import (
        GroupGuessTools,
        GuessAgent,
        GuessTools,
        TinyPolicyServer,
        VerifierLog,
        new_policy,
    )

    store = SnapshotStore(
        spec.root, faults=StoreFaults.from_spec(spec.faults) if spec.faults else None
    )
    config = RuntimeConfig(default_lease_s=spec.lease_s)
    closers: list[Callable[[], Awaitable[None]]] = []
    if kind == "model" and example == "tiny-policy":
        model = TinyPolicyServer(new_policy(spec.seed))
        return ParticipantRuntime(spec.instance, store, model=model, config=config), closers
    if kind == "resources" and example in ("guess", "guess-group"):
        log = VerifierLog(spec.verifier_log)
        resources = (
            GuessTools(spec.instance, log)
            if example == "guess"
            else GroupGuessTools(spec.instance, log, group_size=spec.group_size)
        )
        runtime = ParticipantRuntime(spec.instance, store, resources=resources, config=config)
        return runtime, closers
    if kind == "agent" and example == "guess":
        if not spec.policy_address or not spec.resources:
            raise ValueError(
                "the guess agent needs --policy ADDRESS and --resources ENV=ADDRESS "
                "(one per environment it serves)"
            )
        agent = GuessAgent(
            spec.policy_address,
            spec.resources,
            spec.token,
            temperature=spec.temperature,
            turn_delay_s=spec.turn_delay_s,
        )
        closers.append(agent.aclose)
        return ParticipantRuntime(spec.instance, store, agent=agent, config=config), closers
    known = ", ".join(EXAMPLES.get(kind, ()))
    raise ValueError(f"no example {example!r} for kind {kind!r}; choose one of: {known}")


# ---------------------------------------------------------------------- the command


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run one participant (an example Gym server) as a gRPC server",
        description=(
            "Run one example participant. The bearer token comes from $TURNPOINT_TOKEN or "
            "--token-file; without one the server refuses to start unless "
            "--insecure-no-auth is given."
        ),
    )
    parser.add_argument("--kind", required=True, choices=sorted(EXAMPLES))
    parser.add_argument("--example", help="which example (default: the kind's first)")
    parser.add_argument("--instance", help="instance name (default: <kind>-<port>)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--root", default="snapshots", help="snapshot root directory")
    parser.add_argument("--token-file", help="file holding the bearer token")
    parser.add_argument("--insecure-no-auth", action="store_true")
    parser.add_argument("--tls-cert", help="server certificate (PEM)")
    parser.add_argument("--tls-key", help="server private key (PEM)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA")
    parser.add_argument("--policy", help="agent: address of the policy server")
    parser.add_argument(
        "--resources",
        action="append",
        default=[],
        metavar="ENV=ADDRESS",
        help="agent: the resources server of one environment (repeatable)",
    )
    parser.add_argument("--group-size", type=int, default=4, help="guess-group: siblings")
    parser.add_argument("--verifier-log", help="resources: append every reward to this file")
    parser.add_argument("--seed", type=int, default=0, help="model: initial weights seed")
    parser.add_argument("--lease", type=float, default=60.0, help="default lease seconds")
    parser.add_argument("--faults", default="", help="store faults, e.g. records_write:1:ENOSPC")
    parser.add_argument("--grace", type=float, default=10.0, help="drain grace seconds")
    parser.add_argument(
        "--turn-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="agent: simulated latency of every turn's model call (default: 0)",
    )
    parser.set_defaults(handler=_serve_command)


def _parse_resources(values: Sequence[str]) -> dict[str, str]:
    resources: dict[str, str] = {}
    for value in values:
        env, sep, address = value.partition("=")
        if not sep or not env or not address:
            raise ValueError(f"--resources takes ENV=ADDRESS, got {value!r}")
        resources[env] = address
    return resources


def _serve_command(args: argparse.Namespace) -> int:
    try:
        token = load_token(args.token_file)
        example = args.example or EXAMPLES[args.kind][0]
        if args.instance is not None:
            validate_id(args.instance, "instance")
        options = ServerOptions(
            host=args.host,
            port=args.port,
            token=token,
            allow_insecure_no_auth=args.insecure_no_auth,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            tls_client_ca_file=args.tls_client_ca,
            grace_seconds=args.grace,
        )
        if token is None and not args.insecure_no_auth:
            raise ValueError(
                "no token: set TURNPOINT_TOKEN or pass --token-file "
                "(or --insecure-no-auth for a local experiment)"
            )
        resources = _parse_resources(args.resources)
    except (ValueError, InvalidIdError, OSError) as error:
        print(f"turnpoint serve: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, example, options, token, resources))


async def _serve(
    args: argparse.Namespace,
    example: str,
    options: ServerOptions,
    token: str | None,
    resources: dict[str, str],
) -> int:
    instance = args.instance or f"{args.kind}-{secrets.token_hex(3)}"
    spec = ExampleSpec(
        instance=instance,
        root=Path(args.root),
        token=token,
        policy_address=args.policy,
        resources=resources,
        group_size=args.group_size,
        verifier_log=Path(args.verifier_log) if args.verifier_log else None,
        seed=args.seed,
        faults=args.faults,
        lease_s=args.lease,
        turn_delay_s=args.turn_delay,
    )
    try:
        runtime, closers = build_example(args.kind, example, spec)
    except (ValueError, OSError) as error:
        print(f"turnpoint serve: {error}", file=sys.stderr)
        return 2
    hosted = host_participant(runtime, options)
    hosted.on_close.extend(closers)
    await hosted.start()
    hosted.server.install_signal_handlers()
    print(
        f"turnpoint: serving {args.kind} {spec.instance} on {options.host}:{hosted.port}",
        flush=True,
    )
    try:
        await hosted.server.wait_for_termination()
    finally:
        await hosted.runtime.aclose()
        for close in closers:
            await close()
    return 0
