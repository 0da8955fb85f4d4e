"""Checks of the control plane: Describe, fencing, WatchBoundaries, the session and the
error encoding (the checkpoint life cycle is in :mod:`._lifecycle_checks`).

Each check is ``async def check(kit) -> str``: it returns what it verified, raises
:class:`CheckFailed` naming the first broken rule, or :class:`CheckSkipped` saying why
it cannot run here. None leaves a checkpoint open: :meth:`Kit.settle` runs after each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import grpc

from turnpoint.protocol import PROTOCOL_VERSION
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import resources_service_pb2, rollout_service_pb2, types_pb2

from ._kit import (
    HOLD_LEASE_S,
    CheckFailed,
    CheckSkipped,
    Kit,
    duration,
    episode,
    require,
    require_idle,
    show,
)
from ._rules import ID_PATTERN, error_problems, phase_name, readiness_problems
from ._wire import Refused, SessionClient, control_error, wire_error

_KINDS = {
    types_pb2.PARTICIPANT_KIND_AGENT,
    types_pb2.PARTICIPANT_KIND_RESOURCES,
    types_pb2.PARTICIPANT_KIND_MODEL,
    types_pb2.PARTICIPANT_KIND_ENVIRONMENT,
}
_LEVELS_RESTART_ONLY = [types_pb2.RECOVERY_LEVEL_SIBLING, types_pb2.RECOVERY_LEVEL_PROMPT_GROUP]
_LEVELS_ALL = [types_pb2.RECOVERY_LEVEL_TURN, *_LEVELS_RESTART_ONLY]
# ---------------------------------------------------------------------- describe


async def check_describe(kit: Kit) -> str:
    """Section 4.5, 2.3, 2.4, 11.1: what the participant says it is, and is."""
    d = kit.description
    require(d.HasField("header"), "Describe: no ResponseHeader")
    require(
        d.header.participant_id == d.instance_name,
        f"header.participant_id {d.header.participant_id!r} is not the instance name "
        f"{d.instance_name!r}",
    )
    require(bool(d.header.incarnation), "header.incarnation is empty")
    require(
        bool(ID_PATTERN.fullmatch(d.instance_name)),
        f"instance_name {d.instance_name!r} is not a valid id (section 2.4)",
    )
    require(d.instance_name != "trainer", "instance_name 'trainer' is reserved (section 2.3)")
    require(d.kind in _KINDS, f"kind {d.kind} is unset or unknown")
    require(
        d.protocol_version == PROTOCOL_VERSION,
        f"protocol_version {d.protocol_version!r}, expected {PROTOCOL_VERSION!r}",
    )
    require(d.phase != types_pb2.PHASE_UNSPECIFIED, "phase is unset")
    restart_only = d.recovery_mode in (
        types_pb2.RECOVERY_MODE_RESTART_ONLY,
        types_pb2.RECOVERY_MODE_UNSPECIFIED,
    )
    expected_levels = _LEVELS_RESTART_ONLY if restart_only else _LEVELS_ALL
    levels = list(d.supported_levels)
    if not restart_only and levels[:1] == [types_pb2.RECOVERY_LEVEL_TOKEN]:
        levels = levels[1:]  # the cutting capability, finest first (section 5.5 item 1)
    require(
        levels == expected_levels,
        f"supported_levels {list(d.supported_levels)} for recovery mode "
        f"{types_pb2.RecoveryMode.Name(d.recovery_mode)}, expected {expected_levels}",
    )
    if d.kind == types_pb2.PARTICIPANT_KIND_MODEL:
        require(
            d.recovery_mode == types_pb2.RECOVERY_MODE_STATELESS,
            "a policy model must describe itself RECOVERY_MODE_STATELESS (section 5.4)",
        )
    if d.group_scored:
        require(
            d.verify_mode == types_pb2.VERIFY_MODE_REPLAY and d.group_size >= 1,
            "a group-scored participant must declare VERIFY_MODE_REPLAY and group_size >= 1 "
            "(section 5.3 item 5)",
        )
    status = await kit.status()
    require(
        status.header.participant_id == d.instance_name
        and status.header.incarnation == d.header.incarnation,
        "GetStatus answered with another participant id or incarnation than Describe",
    )
    require(
        status.phase == d.phase,
        f"Describe said phase {phase_name(d.phase)}, GetStatus {phase_name(status.phase)}",
    )
    served = await _probe_data_plane(kit)
    mode = types_pb2.RecoveryMode.Name(d.recovery_mode).removeprefix("RECOVERY_MODE_")
    return (
        f"{types_pb2.ParticipantKind.Name(d.kind).removeprefix('PARTICIPANT_KIND_')} "
        f"{d.instance_name}, {mode}, levels match, header consistent; {served}"
    )


async def _probe_data_plane(kit: Kit) -> str:
    """The hosted kind's data-plane service answers (never UNIMPLEMENTED, section 3.1).

    Each probe names no episode or an invalid one, so it is refused (or answers
    nothing) before any work is admitted and the participant stays fresh.
    """
    bad = episode("", 0)

    async def rollout() -> None:
        await kit.target.call(
            kit.target.rollout.Acknowledge,
            rollout_service_pb2.AcknowledgeRequest(request_id=kit.rid("probe")),
            name="Acknowledge",
        )

    async def resources() -> None:
        await kit.target.call(
            kit.target.resources.CloseSession,
            resources_service_pb2.CloseSessionRequest(request_id=kit.rid("probe"), episode=bad),
            name="CloseSession",
        )

    async def policy() -> None:
        await kit.generate(bad)

    probes: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    if kit.hosts_agent:
        probes.append(("RolloutService", rollout))
    if kit.hosts_resources:
        probes.append(("ResourcesService", resources))
    if kit.hosts_model:
        probes.append(("PolicyService", policy))
    for service, probe in probes:
        try:
            await probe()
        except Refused as refusal:
            require(
                refusal.error.code is not grpc.StatusCode.UNIMPLEMENTED,
                f"{service} is UNIMPLEMENTED although the kind hosts it",
            )
    return "data plane served: " + ", ".join(s for s, _ in probes)


# ---------------------------------------------------------------------- fencing


async def check_fencing_epoch(kit: Kit) -> str:
    """Section 2.2 items 1, 2, 3, 5, 6: adopt higher epochs, refuse stale ones."""
    # Earlier checks may have made the target adopt the kit's epoch: go one above it.
    kit.epoch += 1
    base = kit.epoch
    adopted = await kit.resume(kit.checkpoint_id(), rid=kit.rid("fence-adopt"))
    require(
        adopted.header.epoch == base,
        f"a request at epoch {base} (above the held one) was not adopted: "
        f"header.epoch {adopted.header.epoch}",
    )
    same_again = await kit.resume(kit.checkpoint_id())
    require(same_again.header.epoch == base, "the same fence was not accepted again (item 2)")
    intruder = kit.fence(coordinator_id=f"{kit.coordinator_id}-other")
    error = await kit.refused(
        kit.retire([episode(kit.rollout("fenced"), 0)], fence=intruder),
        "FENCED",
        "Retire from another coordinator at the same epoch",
        keys=("epoch", "request_epoch"),
    )
    require(
        error.metadata.get("epoch") == str(base)
        and error.metadata.get("request_epoch") == str(base),
        f"FENCED metadata {dict(error.metadata)}, expected epoch={base} request_epoch={base}",
    )
    stale = kit.checkpoint_id()
    error = await kit.refused(
        kit.prepare(stale, fence=kit.fence(epoch=base - 1), lease_s=kit.lease_s),
        "FENCED",
        f"Prepare at epoch {base - 1} below the held {base}",
        keys=("epoch", "request_epoch"),
    )
    require(
        error.metadata.get("epoch") == str(base)
        and error.metadata.get("request_epoch") == str(base - 1),
        f"FENCED metadata {dict(error.metadata)}, expected epoch={base} request_epoch={base - 1}",
    )
    require_idle(await kit.status(), "after a fenced Prepare")
    await kit.refused(
        kit.resume(kit.checkpoint_id(), unfenced=True),
        "FENCED",
        "Resume without a fence once a coordinator was heard from (item 6)",
    )
    # Read-only calls adopt a higher epoch and are never refused for a lower one.
    higher = await kit.describe(kit.fence(epoch=base + 1))
    require(
        higher.header.epoch == base + 1,
        f"Describe with epoch {base + 1} was not adopted (item 5): header.epoch "
        f"{higher.header.epoch}",
    )
    lower = await kit.describe(kit.fence(epoch=base))
    require(lower.header.epoch == base + 1, "Describe with a lower epoch changed the held epoch")
    await kit.refused(
        kit.resume(kit.checkpoint_id(), fence=kit.fence(epoch=base)),
        "FENCED",
        f"Resume at epoch {base} after Describe adopted {base + 1}",
        keys=("epoch", "request_epoch"),
    )
    kit.epoch = base + 1
    await kit.resume(kit.checkpoint_id())
    return (
        f"adopted epoch {base} and {base + 1}; refused a lower epoch, another coordinator "
        "at the same epoch and a request without a fence, each FENCED with epoch metadata"
    )


async def check_fencing_replay(kit: Kit) -> str:
    """Section 2.2 items 3 and 4, 4.3: a superseded coordinator's retry gets the recorded
    answer (or error) again without acting; its id for another operation is FENCED."""
    old = kit.fence()
    checkpoint = kit.checkpoint_id()
    prepare_rid, resume_rid, renew_rid = (kit.rid(x) for x in ("p", "r", "n"))
    prepared = await kit.prepare(checkpoint, rid=prepare_rid, lease_s=HOLD_LEASE_S)
    require(
        prepared.phase == types_pb2.PHASE_PREPARED,
        f"Prepare on an idle participant answered {phase_name(prepared.phase)}",
    )
    resumed = await kit.resume(checkpoint, rid=resume_rid)
    require(resumed.ended_active, "Resume of the active checkpoint said ended_active=false")
    await kit.refused(
        kit.renew(checkpoint, rid=renew_rid), "STALE_CHECKPOINT", "Renew after Resume"
    )
    kit.epoch += 1
    newer = await kit.describe(kit.fence())
    require(newer.header.epoch == kit.epoch, "Describe with a higher epoch was not adopted")

    try:
        again = await kit.resume(checkpoint, rid=resume_rid, fence=old)
    except Refused as refusal:
        raise CheckFailed(
            f"the superseded coordinator's retry of an answered Resume was refused "
            f"({refusal.error.summary()}) instead of replayed"
        ) from None
    require(
        again.ended_active and again.phase == resumed.phase,
        f"the replayed Resume differs from the recorded answer: ended_active="
        f"{again.ended_active}, phase {phase_name(again.phase)}",
    )
    try:
        replayed = await kit.prepare(checkpoint, rid=prepare_rid, fence=old)
    except Refused as refusal:
        raise CheckFailed(
            f"the superseded coordinator's retry of an answered Prepare was refused "
            f"({refusal.error.summary()}) instead of replayed"
        ) from None
    require(
        replayed.phase == prepared.phase
        and replayed.checkpoint_id == checkpoint
        and replayed.readiness.ready == prepared.readiness.ready,
        "the replayed Prepare differs from the recorded answer",
    )
    require_idle(await kit.status(), "after a replayed Prepare (it must not act again)")
    await kit.refused(
        kit.renew(checkpoint, rid=renew_rid, fence=old),
        "STALE_CHECKPOINT",
        "the superseded coordinator's retry of a Renew answered STALE_CHECKPOINT",
    )
    await kit.refused(
        kit.forget([kit.rollout("replay")], rid=resume_rid, fence=old),
        "FENCED",
        "the superseded coordinator's Resume request id sent as a Forget",
        keys=("epoch", "request_epoch"),
    )
    return (
        "a superseded coordinator's retries of Prepare, Resume and a refused Renew got the "
        "recorded answers without acting; its request id for another operation was FENCED"
    )


# ---------------------------------------------------------------------- watch


async def check_watch_boundaries(kit: Kit) -> str:
    """Section 4.14, 2.2 item 5: a readiness report first, then phase changes and
    boundary events as they happen; a lower fence is never refused."""
    call = kit.target.control.WatchBoundaries(
        pb.WatchBoundariesRequest(fence=kit.fence(epoch=max(kit.epoch - 1, 0))),
        metadata=kit.target.metadata,
    )
    messages: asyncio.Queue[pb.WatchBoundariesResponse | Refused] = asyncio.Queue()

    async def read() -> None:
        try:
            async for message in call:
                messages.put_nowait(message)
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.CANCELLED:
                messages.put_nowait(Refused(wire_error("WatchBoundaries", error)))

    reader = asyncio.create_task(read())
    seen: list[pb.WatchBoundariesResponse] = []

    async def until(
        predicate: Callable[[pb.WatchBoundariesResponse], bool], what: str
    ) -> pb.WatchBoundariesResponse:
        deadline = time.monotonic() + kit.episode_bound_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                item = await asyncio.wait_for(messages.get(), max(remaining, 0.001))
            except TimeoutError:
                raise CheckFailed(
                    f"WatchBoundaries: no {what} within {kit.episode_bound_s:.0f} s"
                ) from None
            if isinstance(item, Refused):
                raise CheckFailed(
                    f"WatchBoundaries ended {item.error.summary()} while waiting for {what}"
                )
            require(item.HasField("header"), "a WatchBoundaries message without a header")
            require(
                item.phase != types_pb2.PHASE_UNSPECIFIED, "a WatchBoundaries message without phase"
            )
            if item.HasField("readiness"):
                problems = readiness_problems(item.readiness, item.phase)
                require(not problems, f"WatchBoundaries readiness: {'; '.join(problems)}")
            seen.append(item)
            if predicate(item):
                return item

    try:
        first = await until(lambda m: True, "first message")
        require(
            first.HasField("readiness"),
            "the first WatchBoundaries message is not a readiness report",
        )
        checkpoint = kit.checkpoint_id()
        await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
        await until(
            lambda m: m.HasField("readiness") and m.phase == types_pb2.PHASE_PREPARED,
            "readiness report in phase PREPARED after a prepare",
        )
        await kit.resume(checkpoint)
        await until(
            lambda m: m.HasField("readiness") and m.phase == types_pb2.PHASE_IDLE,
            "readiness report in phase IDLE after the resume",
        )
        events = ""
        if kit.hosts_agent and kit.workload.task is not None:
            e = episode(kit.rollout("watched"), 0)
            stream = kit.run(e)
            result = await stream.finished()
            kit.owe(result)
            sealed = await until(
                lambda m: (
                    m.HasField("boundary")
                    and m.boundary.episode == e
                    and m.boundary.boundary_index >= 1
                ),
                f"boundary event of {show(e)}",
            )
            require(sealed.boundary.HasField("at"), "a boundary event without 'at'")
            await kit.acknowledge([result.receipt])
            await until(
                lambda m: (
                    m.HasField("boundary")
                    and m.boundary.episode == e
                    and m.boundary.state == types_pb2.EPISODE_STATE_IDLE
                ),
                f"final IDLE event of {show(e)} after its acknowledgement (item 2)",
            )
            indices = [
                m.boundary.boundary_index
                for m in seen
                if m.HasField("boundary") and m.boundary.episode == e
            ]
            require(indices == sorted(indices), f"boundary_index went backwards: {indices}")
            events = f"; boundary events of {show(e)} up to its final IDLE"
        elif kit.hosts_resources and kit.workload.task is not None:
            e = episode(kit.rollout("watched"), 0)
            await kit.seed(e)
            await until(
                lambda m: m.HasField("boundary") and m.boundary.episode == e,
                f"event of the session {show(e)}",
            )
            await kit.close_session(e)
            await until(
                lambda m: (
                    m.HasField("boundary")
                    and m.boundary.episode == e
                    and m.boundary.state == types_pb2.EPISODE_STATE_IDLE
                ),
                f"final IDLE event of the closed session {show(e)}",
            )
            indices = [m.boundary.boundary_index for m in seen if m.HasField("boundary")]
            require(all(i == 0 for i in indices), "a resources entry reported a boundary_index")
            events = f"; events of the session {show(e)} up to its final IDLE"
    finally:
        call.cancel()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    return (
        f"opened with a lower epoch; readiness first; PREPARED and IDLE reported as they "
        f"happened{events} ({len(seen)} messages)"
    )


# ---------------------------------------------------------------------- session


async def check_control_session(kit: Kit) -> str:
    """Section 3.2, 3.3, 9.2: one stream carries every operation, answers match by
    request id, errors come as ControlError like the unary status."""
    session = SessionClient(kit.target)
    await session.open()
    try:
        describe_id, status_id = kit.rid("sd"), kit.rid("ss")
        futures = [
            session.send(
                pb.ControlSessionRequest(
                    request_id=describe_id, timeout=duration(10), describe=pb.DescribeRequest()
                )
            ),
            session.send(
                pb.ControlSessionRequest(
                    request_id=status_id, timeout=duration(10), get_status=pb.GetStatusRequest()
                )
            ),
        ]
        try:
            answers = await asyncio.wait_for(asyncio.gather(*futures), kit.target.call_timeout_s)
        except Refused as refusal:
            if refusal.error.code is grpc.StatusCode.UNIMPLEMENTED:
                raise CheckSkipped(
                    "ControlSession is UNIMPLEMENTED (a coordinator falls back to unary "
                    "calls, section 3.2 item 7)"
                ) from None
            raise CheckFailed(f"the session ended: {refusal.error.summary()}") from None
        except TimeoutError:
            raise CheckFailed(
                "two requests on the session were not both answered in time"
            ) from None
        by_id = {a.request_id: a for a in answers}
        require(set(by_id) == {describe_id, status_id}, "answers do not carry the request ids")
        described = by_id[describe_id]
        require(
            described.WhichOneof("result") == "describe", "Describe answered with another field"
        )
        require(
            described.describe.instance_name == kit.instance
            and described.describe.kind == kit.description.kind,
            "Describe on the session differs from the unary Describe",
        )
        require(by_id[status_id].WhichOneof("result") == "get_status", "GetStatus answered wrongly")

        empty = await session.ask(
            pb.ControlSessionRequest(request_id=kit.rid("se"), timeout=duration(10))
        )
        _session_error(empty, "INVALID_ARGUMENT", "a request without an operation")
        rid = kit.rid("sm")
        mismatched = await session.ask(
            pb.ControlSessionRequest(
                request_id=rid,
                timeout=duration(10),
                resume=pb.ResumeRequest(
                    fence=kit.fence(), request_id=f"{rid}-inner", checkpoint_id=kit.checkpoint_id()
                ),
            )
        )
        _session_error(mismatched, "INVALID_ARGUMENT", "envelope and inner request ids differ")
        unknown = kit.checkpoint_id(kit.other_prefix())
        rid = kit.rid("sr")
        renew = await session.ask(
            pb.ControlSessionRequest(
                request_id=rid,
                timeout=duration(10),
                renew=pb.RenewRequest(fence=kit.fence(), request_id=rid, checkpoint_id=unknown),
            )
        )
        _session_error(renew, "INVALID_PHASE", "Renew of an id never opened")
        await kit.refused(
            kit.renew(unknown), "INVALID_PHASE", "the same Renew as a unary call (section 3.3)"
        )
        rid = kit.rid("sq")
        resumed = await session.ask(
            pb.ControlSessionRequest(
                request_id=rid,
                timeout=duration(10),
                resume=pb.ResumeRequest(fence=kit.fence(), request_id=rid, checkpoint_id=unknown),
            )
        )
        require(
            resumed.WhichOneof("result") == "resume" and not resumed.resume.ended_active,
            "Resume on the session was not answered as a resume",
        )
        ended = await session.end()
        require(
            ended is None,
            f"the session ended {ended.summary() if ended else ''} after a half-close",
        )
    finally:
        await session.close()
    return (
        "answered concurrent requests by request id, the same as unary; no operation and "
        "mismatched ids INVALID_ARGUMENT; errors as ControlError with code and reason"
    )


def _session_error(answer: pb.ControlSessionResponse, reason: str, what: str) -> None:
    require(answer.WhichOneof("result") == "error", f"{what}: answered OK on the session")
    problems = error_problems(control_error("ControlSession", answer.error), reason)
    require(not problems, f"{what} on the session: {'; '.join(problems)}")


# ---------------------------------------------------------------------- errors


async def check_errors(kit: Kit) -> str:
    """Section 9.1, 9.3, 9.5, 2.4, 2.8, 1.5, 10.5: every refusal carries exactly one
    ErrorInfo of domain turnpoint, the code of its reason and the metadata keys."""
    before = await kit.status()
    cases = 0

    async def expect(
        call: Awaitable[object], reason: str, what: str, keys: tuple[str, ...] = ()
    ) -> None:
        nonlocal cases
        cases += 1
        await kit.refused(call, reason, what, keys=keys)

    await expect(
        kit.prepare("../escape"), "INVALID_ARGUMENT", "Prepare of an invalid id", ("field",)
    )
    await expect(
        kit.prepare("a" * 129), "INVALID_ARGUMENT", "Prepare of a 129-character id", ("field",)
    )
    await expect(
        kit.prepare(kit.checkpoint_id(), rid=""), "INVALID_ARGUMENT", "Prepare without request_id"
    )
    await expect(
        kit.prepare(kit.checkpoint_id(), rid="r" * 257),
        "INVALID_ARGUMENT",
        "Prepare with a 257-character request_id",
    )
    await expect(
        kit.prepare(kit.checkpoint_id(), lease_s=-1.0),
        "INVALID_ARGUMENT",
        "Prepare with a negative lease",
    )
    await expect(
        kit.retire([episode(kit.rollout("neg"), -1)]),
        "INVALID_ARGUMENT",
        "Retire of a negative attempt",
    )
    await expect(
        kit.retire([episode("bad/id", 0)]), "INVALID_ARGUMENT", "Retire of an invalid rollout id"
    )
    never = kit.checkpoint_id()
    await expect(
        kit.renew(never), "INVALID_PHASE", "Renew of an id never opened", ("checkpoint_id", "phase")
    )
    await expect(kit.commit(never, never), "INVALID_PHASE", "Commit while idle")
    await expect(
        kit.commit(never, "../x"), "INVALID_ARGUMENT", "Commit into an invalid snapshot name"
    )
    await kit.resume(never)
    await expect(kit.renew(never), "STALE_CHECKPOINT", "Renew of a finished id", ("checkpoint_id",))
    after = await kit.status()
    require_idle(after, "after the refused calls")
    require(
        after.refused_rollouts == before.refused_rollouts,
        "a refused call changed the refusal marks",
    )
    return f"{cases} refusals, each with one ErrorInfo, the code of its reason and its metadata"
