"""Checks below the protocol's operations: the bearer token, health and reflection,
and hostile input."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from turnpoint.auth import auth_metadata
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import resources_service_pb2, rollout_service_pb2, types_pb2

from ._hostile import (
    SERVICES,
    Expect,
    Hostile,
    hostile_inputs,
    method_path,
    method_shape,
    unknown_fields,
)
from ._kit import CheckFailed, CheckSkipped, Kit, episode, require
from ._rules import error_problems
from ._wire import (
    CONTROL_SERVICE,
    POLICY_SERVICE,
    RESOURCES_SERVICE,
    ROLLOUT_SERVICE,
    Metadata,
    Refused,
    SessionClient,
    WireError,
    wire_error,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
# Codes gRPC itself answers before a handler runs (no ErrorInfo possible there).
TRANSPORT_CODES = frozenset(
    {
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)
# A hostile call that the target accepted as a harmless request (a watch that streams)
# is cut after this long; a refusal comes at once.
HOSTILE_CALL_S = 2.0
# A message past the size bound is never harmless: the target must refuse it. Sending
# 16 MiB and its refusal can take seconds on a loaded machine, so its deadline only
# bounds a target that never answers.
HUGE_CALL_S = 30.0
_DESCRIBE = f"/{CONTROL_SERVICE}/Describe"
# A target that refuses an unauthenticated stream at once does so within milliseconds;
# one that waits for the first request before refusing gets that request after this.
REFUSAL_WAIT_S = 1.0


def hosted_services(kit: Kit) -> set[str]:
    """The services the described kind must serve (section 3.1)."""
    services = {CONTROL_SERVICE}
    if kit.hosts_agent:
        services.add(ROLLOUT_SERVICE)
    if kit.hosts_resources:
        services.add(RESOURCES_SERVICE)
    if kit.hosts_model:
        services.add(POLICY_SERVICE)
    return services


# ---------------------------------------------------------------------- auth


async def _describe_with(kit: Kit, metadata: Metadata) -> pb.DescribeResponse:
    return await kit.target.call(
        kit.target.control.Describe, pb.DescribeRequest(), name="Describe", metadata=metadata
    )


async def check_auth(kit: Kit) -> str:
    """Section 10.1, 10.2: protected calls need exactly one bearer token; a refusal is
    UNAUTHENTICATED with one ErrorInfo in the method's own shape and never quotes the
    token; an unknown method stays UNIMPLEMENTED."""
    token = kit.target.token
    if token is None:
        try:
            await _describe_with(kit, ())
        except Refused as refusal:
            raise CheckFailed(
                f"no token given, and Describe without one was refused ({refusal.error.summary()})"
            ) from None
        raise CheckSkipped(
            "no token given (--token-file or $TURNPOINT_TOKEN) and the target serves "
            "without one: nothing to check"
        )
    missing = await kit.refused(
        _describe_with(kit, ()),
        "UNAUTHENTICATED",
        "Describe without a token",
        keys=("method", "cause"),
    )
    require(
        missing.metadata.get("method") == _DESCRIBE,
        f"UNAUTHENTICATED metadata method {missing.metadata.get('method')!r}, expected "
        f"{_DESCRIBE!r}",
    )
    wrong = f"conformance-wrong-{secrets.token_hex(8)}"
    refused = await kit.refused(
        _describe_with(kit, (("authorization", f"Bearer {wrong}"),)),
        "UNAUTHENTICATED",
        "Describe with a wrong token",
    )
    shown = [refused.message, *refused.metadata.values()]
    require(
        not any(wrong in text or token in text for text in shown),
        "the refusal quotes a token (section 10.1 item 5)",
    )
    for scheme in ("bearer", "BEARER"):
        try:
            await _describe_with(kit, (("authorization", f"{scheme} {token}"),))
        except Refused as refusal:
            raise CheckFailed(
                f"the scheme {scheme!r} was refused ({refusal.error.summary()}); it is "
                "case-insensitive"
            ) from None
    twice = (("authorization", f"Bearer {token}"), ("authorization", f"Bearer {token}"))
    await kit.refused(_describe_with(kit, twice), "UNAUTHENTICATED", "two authorization entries")
    watch = kit.target.control.WatchBoundaries(pb.WatchBoundariesRequest(), metadata=())

    async def first_watch_message() -> None:
        try:
            async for _ in watch:
                return
        except grpc.aio.AioRpcError as error:
            raise Refused(wire_error("WatchBoundaries", error)) from None

    try:
        await kit.refused(
            first_watch_message(), "UNAUTHENTICATED", "WatchBoundaries without a token"
        )
    finally:
        watch.cancel()
    session = SessionClient(kit.target, metadata=())
    await session.open()
    try:
        # Nothing is written until the target had its chance to refuse the stream itself:
        # a write racing that refusal ends the call INTERNAL on the client's side.
        if await session.ended_within(REFUSAL_WAIT_S):
            ended = session.final_error
            if ended is None:
                raise CheckFailed("ControlSession without a token ended OK")
            problems = error_problems(ended, "UNAUTHENTICATED")
            require(not problems, f"ControlSession without a token: {'; '.join(problems)}")
        else:
            ask = session.send(
                pb.ControlSessionRequest(
                    request_id=kit.rid("auth"), get_status=pb.GetStatusRequest()
                )
            )
            await kit.refused(ask, "UNAUTHENTICATED", "ControlSession without a token")
    finally:
        await session.close()
    try:
        await kit.target.raw(f"/{CONTROL_SERVICE}/NoSuchMethod", b"", shape="unary", metadata=())
    except Refused as refusal:
        require(
            refusal.error.code is grpc.StatusCode.UNIMPLEMENTED,
            f"an unknown method without a token answered {refusal.error.code.name}, "
            "expected UNIMPLEMENTED (section 10.1 item 4)",
        )
    else:
        raise CheckFailed("an unknown method answered OK")
    data = ""
    if kit.hosts_agent:
        try:
            await kit.target.call(
                kit.target.rollout.Acknowledge,
                rollout_service_pb2.AcknowledgeRequest(request_id=kit.rid("auth")),
                name="Acknowledge",
                metadata=(),
            )
            data = "; the data plane is left open (allowed, section 10.2)"
        except Refused as refusal:
            problems = error_problems(refusal.error, "UNAUTHENTICATED")
            require(not problems, f"Acknowledge without a token: {'; '.join(problems)}")
            data = "; the data plane is protected too"
    return (
        "refused a missing token, a wrong one and two entries with UNAUTHENTICATED (method, "
        "cause; token never quoted), in unary, stream and session shape; the scheme is "
        f"case-insensitive; an unknown method is UNIMPLEMENTED{data}"
    )


# A fence no coordinator can pass: what a data-plane holder would pin (section 10.2).
_PINNED_EPOCH = 2**64 - 1


async def check_credential_roles(kit: Kit) -> str:
    """Section 10.2: a data-plane credential opens the data plane and nothing else; on a
    control call it is PERMISSION_DENIED with one ErrorInfo, and the fence stays."""
    data_token = kit.target.data_token
    if data_token is None:
        raise CheckSkipped(
            "no data-plane token given (--data-token-file): the target's roles not tried"
        )
    data = auth_metadata(data_token)
    pinned = kit.fence(epoch=_PINNED_EPOCH, coordinator_id=f"{kit.coordinator_id}-harness")
    refusals: dict[str, Callable[[], Awaitable[object]]] = {
        "Prepare": lambda: kit.target.call(
            kit.target.control.Prepare,
            pb.PrepareRequest(
                fence=pinned, request_id=kit.rid("roles"), checkpoint_id=kit.checkpoint_id()
            ),
            name="Prepare",
            metadata=data,
        ),
        "Retire": lambda: kit.target.call(
            kit.target.control.Retire,
            pb.RetireRequest(fence=pinned, request_id=kit.rid("roles")),
            name="Retire",
            metadata=data,
        ),
        "Describe": lambda: kit.target.call(
            kit.target.control.Describe,
            pb.DescribeRequest(fence=pinned),
            name="Describe",
            metadata=data,
        ),
    }
    for name, call in refusals.items():
        await kit.refused(
            call(),
            "PERMISSION_DENIED",
            f"{name} with the data-plane token",
            keys=("method", "cause"),
        )
    described = await kit.target.call(
        kit.target.control.Describe, pb.DescribeRequest(fence=kit.fence()), name="Describe"
    )
    require(
        described.header.epoch < _PINNED_EPOCH,
        f"after the refused calls the target holds epoch {described.header.epoch}: a "
        "data-plane token pinned its fence",
    )
    try:
        if kit.hosts_agent:
            await kit.target.call(
                kit.target.rollout.Acknowledge,
                rollout_service_pb2.AcknowledgeRequest(request_id=kit.rid("roles")),
                name="Acknowledge",
                metadata=data,
            )
            served = "Acknowledge"
        elif kit.hosts_resources:
            await kit.target.call(
                kit.target.resources.CloseSession,
                resources_service_pb2.CloseSessionRequest(
                    request_id=kit.rid("roles"), episode=episode("roles-nobody")
                ),
                name="CloseSession",
                metadata=data,
            )
            served = "CloseSession"
        else:
            served = ""
    except Refused as refusal:
        raise CheckFailed(
            f"the data plane refused the data-plane token ({refusal.error.summary()})"
        ) from None
    opened = f"; {served} with it is served" if served else ""
    return (
        "Prepare, Retire and Describe with the data-plane token are PERMISSION_DENIED "
        f"(method, cause) and the fence stays the coordinator's{opened}"
    )


# ---------------------------------------------------------------------- health


async def check_health_reflection(kit: Kit) -> str:
    """Section 3.8, 10.2: health SERVING overall and for each turnpoint service,
    reflection lists them; both answer without a token."""
    expected = hosted_services(kit)
    notes: list[str] = []
    health = True
    try:
        overall = await kit.target.health_status("")
    except Refused as refusal:
        if refusal.error.code is not grpc.StatusCode.UNIMPLEMENTED:
            raise CheckFailed(f"health without a token: {refusal.error.summary()}") from None
        health = False
        notes.append("no health service (SHOULD, section 3.8)")
    else:
        require(overall == SERVING, f"overall health is {overall}, expected SERVING")
        for service in sorted(expected):
            status = await kit.target.health_status(service)
            require(status == SERVING, f"health of {service} is {status}, expected SERVING")
    reflection = True
    try:
        listed = set(await kit.target.list_services())
    except Refused as refusal:
        if refusal.error.code is not grpc.StatusCode.UNIMPLEMENTED:
            raise CheckFailed(f"reflection without a token: {refusal.error.summary()}") from None
        reflection = False
        notes.append("no reflection (SHOULD, section 3.8)")
    else:
        missing = sorted(expected - listed)
        require(not missing, f"reflection does not list {', '.join(missing)}")
    if not health and not reflection:
        raise CheckSkipped("the target serves neither health nor reflection (both SHOULD)")
    served = ", ".join(s.rsplit(".", 1)[-1] for s in sorted(expected))
    checked = "health SERVING and reflection listing" if health and reflection else "checked"
    return f"{checked} {served} without a token" + (f"; {'; '.join(notes)}" if notes else "")


# ---------------------------------------------------------------------- hostile input


def _judge(answer: list[bytes] | WireError, hostile: Hostile, hosted: bool) -> str | None:
    """What is wrong with the answer to one hostile input; None when it conforms."""
    if isinstance(answer, WireError):
        code = answer.code
        if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            return f"{code.name} ({answer.message[:60]!r})"
        if not hosted and code is grpc.StatusCode.UNIMPLEMENTED:
            return None
        if hostile.expect is Expect.HUGE and code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None
        if hostile.expect in (Expect.MALFORMED, Expect.HUGE):
            problems = error_problems(answer, "INVALID_ARGUMENT")
            return f"{code.name}: {'; '.join(problems)}" if problems else None
        if code in TRANSPORT_CODES:
            return None
        problems = error_problems(answer, answer.reason or "?")
        return f"{code.name}: {'; '.join(problems)}" if problems else None
    if hostile.expect is Expect.TYPED:
        return None
    return "answered OK"


async def check_hostile_input(kit: Kit) -> str:
    """Section 10.5, 9.1, 3.5, 11.2: malformed bytes, huge and deep messages and enum
    values no enum has, sent raw to every method, get a typed answer (never UNKNOWN or
    INTERNAL), change nothing, and leave the server healthy."""
    before = await kit.status()
    hosted = hosted_services(kit)
    rollout = kit.rollout("hostile")
    await kit.retire([episode(rollout, 0)])
    findings: list[str] = []
    sent = 0
    for service in SERVICES:
        for index, method in enumerate(service.methods):
            path = method_path(method)
            for hostile in hostile_inputs(method, rollout, huge=index == 0):
                sent += 1
                answer: list[bytes] | WireError
                try:
                    answer = await kit.target.raw(
                        path,
                        hostile.payload,
                        shape=method_shape(method),
                        timeout_s=HUGE_CALL_S if hostile.expect is Expect.HUGE else HOSTILE_CALL_S,
                    )
                except Refused as refusal:
                    answer = refusal.error
                problem = _judge(answer, hostile, service.full_name in hosted)
                if problem is not None:
                    findings.append(f"{service.name}.{method.name} <{hostile.label}>: {problem}")
    sent += await _extras(kit, findings)
    health = await kit.target.health_status("")
    require(health == SERVING, f"health is {health} after the hostile input, expected SERVING")
    described = await kit.describe()
    require(described.instance_name == kit.instance, "Describe answers differently afterwards")
    after = await kit.status()
    await kit.forget([rollout])
    if after.phase != before.phase or after.refused_rollouts != before.refused_rollouts + 1:
        findings.append(
            f"state changed: phase {after.phase} (was {before.phase}), refused_rollouts "
            f"{after.refused_rollouts} (expected {before.refused_rollouts + 1})"
        )
    if findings:
        shown = "; ".join(findings[:20])
        more = f"; and {len(findings) - 20} more" if len(findings) > 20 else ""
        raise CheckFailed(
            f"{len(findings)} of {sent} hostile inputs answered wrongly: {shown}{more}"
        )
    return (
        f"{sent} hostile inputs to every method of the four services: each refused with a "
        "typed error or harmlessly answered; nothing changed; still SERVING"
    )


async def _extras(kit: Kit, findings: list[str]) -> int:
    """Inputs that are well formed but hostile: lists past 10,000 entries, unknown
    fields on reads, an operation the session does not know."""
    too_many = [types_pb2.EpisodeId(rollout_id=f"r{i}", attempt=0) for i in range(10_001)]
    lists: list[tuple[str, bytes]] = [
        (
            "Prepare",
            pb.PrepareRequest(
                fence=kit.fence(),
                request_id=kit.rid("h"),
                checkpoint_id=kit.checkpoint_id(),
                expected_episodes=too_many,
            ).SerializeToString(),
        ),
        (
            "Retire",
            pb.RetireRequest(
                fence=kit.fence(), request_id=kit.rid("h"), episodes=too_many
            ).SerializeToString(),
        ),
        (
            "Forget",
            pb.ForgetRequest(
                fence=kit.fence(),
                request_id=kit.rid("h"),
                rollout_ids=[f"r{i}" for i in range(10_001)],
            ).SerializeToString(),
        ),
    ]
    for method, payload in lists:
        try:
            await kit.target.raw(f"/{CONTROL_SERVICE}/{method}", payload, shape="unary")
            findings.append(f"{method} <10,001 list entries>: answered OK")
        except Refused as refusal:
            problems = error_problems(refusal.error, "INVALID_ARGUMENT")
            if problems:
                findings.append(f"{method} <10,001 list entries>: {'; '.join(problems)}")
    for method, request in (
        ("Describe", pb.DescribeRequest()),
        ("GetStatus", pb.GetStatusRequest()),
    ):
        try:
            await kit.target.raw(
                f"/{CONTROL_SERVICE}/{method}",
                request.SerializeToString() + unknown_fields(),
                shape="unary",
            )
        except Refused as refusal:
            findings.append(
                f"{method} <unknown fields, an enum value no enum has>: refused "
                f"{refusal.error.summary()} instead of ignoring them"
            )
    future = pb.ControlSessionRequest(request_id=kit.rid("h")).SerializeToString()
    try:
        answers = await kit.target.raw(
            f"/{CONTROL_SERVICE}/ControlSession", future + unknown_fields(), shape="bidi"
        )
        try:
            parsed = [pb.ControlSessionResponse.FromString(raw) for raw in answers]
        except DecodeError:
            parsed = []
        if len(parsed) != 1 or parsed[0].WhichOneof("result") != "error":
            findings.append(
                "ControlSession <an operation it does not know>: not answered with an error"
            )
        elif parsed[0].error.reason != types_pb2.ERROR_REASON_INVALID_ARGUMENT:
            findings.append("ControlSession <an operation it does not know>: not INVALID_ARGUMENT")
    except Refused as refusal:
        findings.append(
            f"ControlSession <an operation it does not know>: the stream failed "
            f"{refusal.error.summary()}"
        )
    return len(lists) + 3
