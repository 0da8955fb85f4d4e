"""The ``turnpoint serve`` command: run one participant as a gRPC server.

Either an example Gym server (``--kind``, ``--example``) or your own participant,
``turnpoint serve module:attribute``, with the same auth, health, reflection, drain and
worker groups.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from turnpoint.apps._heap import freeze_start_up_heap
from turnpoint.apps._parent import die_with_parent_from_env
from turnpoint.apps.examples._build import (
    EXAMPLES,
    ExampleSpec,
    Participant,
    build_example,
    build_participant,
    kind_of,
    load_participant,
)
from turnpoint.auth import load_token, load_token_sha256
from turnpoint.ids import InvalidIdError, validate_id
from turnpoint.participant_sdk import SnapshotStore
from turnpoint.server import (
    ServerOptions,
    WorkerGroup,
    WorkerSlot,
    announce_ready,
    die_with_parent,
    host_participant,
    host_worker,
    worker_slot_from_env,
)
from turnpoint.storage import StorageError

if TYPE_CHECKING:
    from turnpoint.participant_sdk import ParticipantRuntime
    from turnpoint.server.openai_api import ChatEndpoint


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run one participant (yours, or an example Gym server) as a gRPC server",
        description=(
            "Run one participant: your own, named module:attribute (an Agent, "
            "ResourcesServer or PolicyModel instance, or a class or function that makes "
            "one without arguments; the current directory is searched first), or an "
            "example with --kind. The bearer token comes from $TURNPOINT_TOKEN or "
            "--token-file; without one the server refuses to start unless "
            "--insecure-no-auth is given. With --data-token-file that token is the control "
            "credential and the data-plane token opens only the data plane (docs/spec.md "
            "section 10.2)."
        ),
    )
    parser.add_argument(
        "participant",
        nargs="?",
        metavar="MODULE:ATTRIBUTE",
        help="your participant, for example my_env:Dealer",
    )
    parser.add_argument(
        "--participant",
        dest="participant_option",
        metavar="MODULE:ATTRIBUTE",
        help="the same as the positional argument",
    )
    parser.add_argument("--kind", choices=sorted(EXAMPLES), help="an example's kind")
    parser.add_argument("--example", help="which example (default: the kind's first)")
    parser.add_argument("--instance", help="instance name (default: <kind>-<port>)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="run N worker processes sharing the port, each its own participant "
        "<instance>-w<i> (docs/spec.md section 3.9; default: 1, one process)",
    )
    parser.add_argument(
        "--root",
        default="snapshots",
        help="snapshot root: a directory or a storage URL (file:///path[?mount=shared], "
        "s3://bucket/prefix; boto3's environment gives the endpoint and credentials)",
    )
    parser.add_argument(
        "--sandbox-root",
        help="coding: the directory of its sandboxes and their snapshots "
        "(default: ROOT/sandboxes/INSTANCE when --root is a directory)",
    )
    parser.add_argument(
        "--token-file",
        help="file holding the bearer token (the control credential when --data-token-file "
        "is given; else it serves both roles)",
    )
    parser.add_argument(
        "--data-token-file",
        help="file holding the data-plane token: it opens Rollout/Resources/Policy and "
        "never the control service; an agent uses it to call its policy and resources",
    )
    parser.add_argument(
        "--control-token-digest-file",
        help="file holding the SHA-256 (hex) of the control token, instead of the token: "
        "the participant checks the coordinator's calls without holding a credential that "
        "can reach a control plane ($TURNPOINT_CONTROL_TOKEN_SHA256 likewise; docs/spec.md "
        "section 10.2 item 8); it calls out with --data-token-file",
    )
    parser.add_argument("--insecure-no-auth", action="store_true")
    parser.add_argument("--tls-cert", help="server certificate (PEM)")
    parser.add_argument("--tls-key", help="server private key (PEM)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA")
    parser.add_argument(
        "--control-identity",
        action="append",
        default=[],
        metavar="NAME",
        help="with --tls-client-ca: only a client certificate naming NAME (a subject "
        "alternative name or the common name) may call the control service; repeatable",
    )
    parser.add_argument("--policy", help="agent: address of the policy server")
    parser.add_argument(
        "--policy-openai",
        metavar="URL",
        help="opaque agent: the policy's OpenAI endpoint (http://host:port/v1)",
    )
    parser.add_argument(
        "--openai-port",
        type=int,
        metavar="PORT",
        help="model: also serve the OpenAI API in front of it on PORT (0: a free one), its "
        "API key the data-plane token (docs/spec.md section 12)",
    )
    parser.add_argument(
        "--resources",
        action="append",
        default=[],
        metavar="ENV=ADDRESS",
        help="agent: the resources server of one environment (repeatable)",
    )
    parser.add_argument("--group-size", type=int, default=4, help="guess-group: siblings")
    parser.add_argument("--verifier-log", help="resources: append every reward to this file")
    parser.add_argument(
        "--generation-log", help="model: append every generation streamed to this file"
    )
    parser.add_argument("--seed", type=int, default=0, help="model: initial weights seed")
    parser.add_argument(
        "--await-weights",
        action="store_true",
        help="model: refuse generations (UNAVAILABLE) until the trainer's first weights "
        "are installed, as a replacement healed in place must (docs/spec.md section 7.15)",
    )
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
    parser.add_argument(
        "--token-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="model: simulated decode time of every token, for long generations (default: 0)",
    )
    parser.add_argument(
        "--cut-generations",
        action="store_true",
        help="agent: let the policy cut generations at a checkpoint and continue them from "
        "their token prefix (docs/spec.md section 5.5)",
    )
    parser.add_argument(
        "--hold-calls-until",
        metavar="FILE",
        help="resources (guess, guess-group), for tests: hold every tool call until FILE "
        "exists, so that a snapshot's prepare waits for it",
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
        slot = worker_slot_from_env()
        if slot is not None:
            # A worker of a group: its name, host and ports are the slot's.
            die_with_parent(slot.parent_pid)
            args.instance, args.host, args.port = slot.instance, slot.host, slot.own_port
        else:
            die_with_parent_from_env()
            if args.workers < 1:
                raise ValueError(f"--workers must be at least 1, got {args.workers}")
        own = _own_participant(args)
        digest = load_token_sha256(args.control_token_digest_file)
        if digest is not None and args.token_file:
            raise ValueError("give --token-file or --control-token-digest-file, not both")
        token = None if digest is not None else load_token(args.token_file)
        data_token = load_token(args.data_token_file) if args.data_token_file else None
        example = own or args.example or EXAMPLES[args.kind][0]
        if args.instance is not None:
            validate_id(args.instance, "instance")
        options = ServerOptions(
            host=args.host,
            port=args.port,
            token=token,
            token_sha256=digest,
            data_token=data_token,
            allow_insecure_no_auth=args.insecure_no_auth,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            tls_client_ca_file=args.tls_client_ca,
            control_identities=tuple(args.control_identity),
            grace_seconds=args.grace,
        )
        if not options.authenticates and not args.insecure_no_auth:
            raise ValueError(
                "no token: set TURNPOINT_TOKEN or pass --token-file "
                "(or --insecure-no-auth for a local experiment)"
            )
        resources = _parse_resources(args.resources)
    except (ValueError, InvalidIdError, OSError) as error:
        print(f"turnpoint serve: {error}", file=sys.stderr)
        return 2
    if slot is None and args.workers > 1:
        return asyncio.run(_serve_group(args, options))
    # An agent reaches its policy and resources with the data-plane credential when there
    # is one: the code that calls out never holds the control credential it need not have.
    peer_token = data_token or token
    return asyncio.run(_serve(args, example, options, peer_token, resources, slot, own is not None))


def _own_participant(args: argparse.Namespace) -> str | None:
    """The ``module:attribute`` of your own participant, if one is named."""
    reference: str | None = args.participant or args.participant_option
    if args.participant and args.participant_option:
        raise ValueError("name your participant once: positional or --participant")
    if reference is None:
        if args.kind is None:
            raise ValueError("name a participant (module:attribute) or an example (--kind)")
        return None
    if args.kind is not None or args.example is not None:
        raise ValueError("--kind and --example pick an example; drop them to serve your own")
    return reference


async def _serve_group(args: argparse.Namespace, options: ServerOptions) -> int:
    """The parent of ``--workers N``: it serves nothing itself; each worker runs this very
    command again, as one participant of the group (turnpoint.server._worker_group)."""
    kind = args.kind or "participant"
    group_name = args.instance or f"{kind}-{secrets.token_hex(3)}"
    group = WorkerGroup(
        group_name,
        args.workers,
        (sys.executable, "-m", "turnpoint.apps._cli", *args.argv),
        host=options.host,
        port=options.port,
        stop_timeout_s=args.grace + 10.0,
    )
    try:
        await group.start()
    except OSError as error:  # the port is taken, a worker could not start
        print(f"turnpoint serve: {error}", file=sys.stderr)
        return 2
    group.install_signal_handlers()
    for member in group.members:
        print(f"turnpoint: worker {member.instance} on {member.address}", flush=True)
    print(f"turnpoint: serving {kind} {group_name} on {group.shared_address}", flush=True)
    await group.wait_stopped()
    return 0 if await group.stop() else 1


async def _serve(
    args: argparse.Namespace,
    example: str,
    options: ServerOptions,
    peer_token: str | None,
    resources: dict[str, str],
    slot: WorkerSlot | None,
    own: bool = False,
) -> int:
    """Serve one participant: the example ``example`` names, or (``own``) yours, whose
    ``module:attribute`` ``example`` then is. ``peer_token`` is what an agent presents to
    its policy and resources."""
    participant: Participant | None = None
    if own:
        try:
            # Made inside the loop: a gRPC client it opens belongs to this loop.
            participant = load_participant(example)
        except ValueError as error:
            print(f"turnpoint serve: {error}", file=sys.stderr)
            return 2
        args.kind = kind_of(participant)
    instance = args.instance or f"{args.kind}-{secrets.token_hex(3)}"
    spec = ExampleSpec(
        instance=instance,
        root=args.root,
        token=peer_token,
        policy_address=args.policy,
        policy_openai=args.policy_openai,
        openai_port=args.openai_port,
        resources=resources,
        group_size=args.group_size,
        verifier_log=Path(args.verifier_log) if args.verifier_log else None,
        generation_log=Path(args.generation_log) if args.generation_log else None,
        seed=args.seed,
        await_weights=args.await_weights,
        faults=args.faults,
        lease_s=args.lease,
        turn_delay_s=args.turn_delay,
        token_delay_s=args.token_delay,
        cut_generations=args.cut_generations,
        hold_calls_until=Path(args.hold_calls_until) if args.hold_calls_until else None,
        sandbox_root=Path(args.sandbox_root) if args.sandbox_root else None,
    )
    try:
        # A store that refuses the credentials, or a bucket that is not there: a clear
        # error now, not a failed commit at the first snapshot (docs/spec.md 8.12 item 6).
        await asyncio.to_thread(SnapshotStore(args.root).check)
        if participant is not None:
            runtime, closers = build_participant(participant, spec)
        else:
            runtime, closers = build_example(args.kind, example, spec)
    except (ValueError, OSError, StorageError) as error:
        print(f"turnpoint serve: {error}", file=sys.stderr)
        return 2
    hosted = (
        host_participant(runtime, options) if slot is None else host_worker(runtime, options, slot)
    )
    hosted.on_close.extend(closers)
    try:
        await hosted.start()
    except OSError as error:  # the port is taken, the host is not ours, a TLS file is gone
        print(f"turnpoint serve: {error}", file=sys.stderr)
        await hosted.runtime.aclose()
        for close in closers:
            await close()
        return 2
    hosted.server.install_signal_handlers()
    if args.openai_port is not None and args.kind == "model":
        endpoint = await _openai_endpoint(
            hosted.runtime, options.host, args.openai_port, peer_token
        )
        closers.insert(0, endpoint.close)
        print(f"turnpoint: openai endpoint {spec.instance} on {endpoint.base_url}", flush=True)
    print(
        f"turnpoint: serving {args.kind} {spec.instance} on {options.host}:{hosted.port}",
        flush=True,
    )
    # Everything built so far lives as long as the process: out of the collector's
    # reach, so that no full collection walks it in the middle of a snapshot.
    freeze_start_up_heap()
    if slot is not None:
        announce_ready(slot)
    try:
        await hosted.server.wait_for_termination()
    finally:
        await hosted.runtime.aclose()
        for close in closers:
            await close()
    return 0


async def _openai_endpoint(
    runtime: ParticipantRuntime, host: str, port: int, api_key: str | None
) -> ChatEndpoint:
    """The example policy's OpenAI endpoint (its chat template the guessing task's)."""
    from turnpoint.apps.examples.chat_template import MODEL_NAME, GuessChatTemplate
    from turnpoint.server.openai_api import ChatEndpoint, EndpointOptions

    options = EndpointOptions(model=MODEL_NAME, host=host, port=port, api_key=api_key)
    endpoint = ChatEndpoint(runtime, GuessChatTemplate(), options)
    await endpoint.start()
    return endpoint
