"""Checks that drive the data plane: admission per kind, readiness with work in
progress, the Run stream and Acknowledge.

An agent is driven through its own ``Run`` (it calls its model and resources servers
itself); a resources server is driven directly with SeedSession, Verify and
CloseSession; a model with Generate. What a task looks like only the environment
knows, so these checks use the workload file and are skipped without one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Collection
from typing import Any, TypeVar

from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import policy_service_pb2, resources_service_pb2, rollout_service_pb2, types_pb2

from ._kit import HOLD_LEASE_S, CheckFailed, CheckSkipped, Kit, RunStream, episode, require, show
from ._rules import ID_PATTERN, error_problems, phase_name, readiness_problems, state_name

T = TypeVar("T")

# Nothing on the wire says "this request is waiting at the gate". A participant that
# wrongly answered a held request would do so within milliseconds of receiving it, so
# a request still unanswered after this window is taken as held; it is a bounded
# observation of an absence, never a synchronisation.
HELD_WINDOW_S = 0.3
# A prepare that cannot become ready (results await their acknowledgement) answers at
# its deadline's reply margin (section 3.4: a tenth of the deadline below 5 s). A short
# deadline keeps the check fast, but not so short that the margin is less than a loaded
# machine takes to carry the answer back: at 1 s (a 0.1 s margin) the kit saw
# DEADLINE_EXCEEDED from an honest participant 2 runs in 10 at load 7 on 2 cores.
UNREADY_PREPARE_S = 3.0

_FINAL_OUTCOMES = {
    rollout_service_pb2.RUN_OUTCOME_COMPLETED,
    rollout_service_pb2.RUN_OUTCOME_FAILED,
    rollout_service_pb2.RUN_OUTCOME_BUDGET_EXHAUSTED,
}
_PARKED_STATES = {types_pb2.EPISODE_STATE_PARKED, types_pb2.EPISODE_STATE_AWAITING_MODEL}


async def _held(task: asyncio.Future[T]) -> bool:
    """Whether ``task`` is still unanswered after the held window (it keeps running)."""
    done, _ = await asyncio.wait({task}, timeout=HELD_WINDOW_S)
    return not done


async def _bounded(kit: Kit, awaitable: Awaitable[T], what: str) -> T:
    try:
        return await asyncio.wait_for(awaitable, kit.episode_bound_s)
    except TimeoutError:
        raise CheckFailed(f"{what}: no answer within {kit.episode_bound_s:.0f} s") from None


async def _cancel(futures: Collection[asyncio.Future[Any]]) -> None:
    """Stop requests a failed check left waiting, and retrieve how they ended."""
    for future in futures:
        future.cancel()
    if futures:
        await asyncio.wait(futures)
        for future in futures:
            if not future.cancelled():
                future.exception()


def _count(report: types_pb2.ReadinessReport, states: Collection[int]) -> int:
    return sum(c.count for c in report.counts if c.state in states)


# ---------------------------------------------------------------------- admission


async def check_admission(kit: Kit) -> str:
    """Section 5.1 to 5.4, 6.1 item 1: while a checkpoint holds admission an agent
    refuses a new Run (ADMISSION_CLOSED), a resources server and a model hold new
    requests until resume; after it they are admitted."""
    checkpoint = kit.checkpoint_id()
    prepared = await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    require(
        prepared.phase == types_pb2.PHASE_PREPARED,
        f"Prepare on an idle participant answered {phase_name(prepared.phase)}",
    )
    done: list[str] = []
    seeding: asyncio.Future[resources_service_pb2.SeedSessionResponse] | None = None
    generating: asyncio.Future[list[policy_service_pb2.GenerateResponse]] | None = None
    session = episode(kit.rollout("held-seed"), 0)
    generation = episode(kit.rollout("held-generate"), 0)
    refused_run = episode(kit.rollout("closed-run"), 0)
    if kit.hosts_agent:
        stream = kit.run(refused_run, task=kit.workload.task or {})
        error = await stream.refusal("a new Run while admission was closed")
        problems = error_problems(error, "ADMISSION_CLOSED", ("checkpoint_id", "phase"))
        require(not problems, f"Run while admission was closed: {'; '.join(problems)}")
        require(
            error.metadata.get("checkpoint_id") == checkpoint,
            "ADMISSION_CLOSED metadata checkpoint_id does not name the active checkpoint",
        )
        done.append("Run refused ADMISSION_CLOSED")
    try:
        if kit.hosts_resources and kit.workload.task is not None:
            seeding = asyncio.ensure_future(kit.seed(session))
            require(
                await _held(seeding),
                "SeedSession was answered while admission was closed; it must wait for resume "
                "(section 5.3 item 2)",
            )
            done.append("SeedSession held")
        if kit.hosts_model:
            generating = asyncio.ensure_future(kit.generate(generation))
            require(
                await _held(generating),
                "Generate streamed while admission was closed; it must wait at the gate "
                "(section 5.4 item 1)",
            )
            done.append("Generate held")
        status = await kit.status()
        require(
            status.phase == types_pb2.PHASE_PREPARED and status.readiness.ready,
            "a request held at the gate made the participant not ready",
        )
        resumed = await kit.resume(checkpoint)
        require(resumed.ended_active, "Resume did not end the checkpoint")
        if seeding is not None:
            seeded = await _bounded(kit, seeding, "the held SeedSession after resume")
            require(
                not seeded.existed,
                "the held SeedSession answered existed=true for a new session",
            )
            await kit.close_session(session)
        if generating is not None:
            chunks = await _bounded(kit, generating, "the held Generate after resume")
            require(
                bool(chunks) and chunks[-1].done,
                "the held Generate did not stream to a final done chunk after resume",
            )
    finally:
        await _cancel([f for f in (seeding, generating) if f is not None])
    if kit.hosts_agent and kit.workload.task is not None:
        stream = kit.run(refused_run)
        require(await stream.accepted(), "the Run was not accepted after resume")
        result = await stream.finished()
        kit.owe(result)
        await kit.acknowledge([result.receipt])
        done.append("the same Run accepted after resume")
    elif kit.hosts_agent:
        done.append("(no workload task: the Run after resume was not tried)")
    if not done:
        done.append("(no workload task: only the prepare and resume were tried)")
    return "; ".join(done)


# ---------------------------------------------------------------------- readiness


async def _prepare_until_ready(
    kit: Kit, checkpoint: str, stream: RunStream | None
) -> tuple[pb.PrepareResponse, int]:
    """Rounds of the same prepare (section 4.3 item 1) until it answers ready."""
    rid = kit.rid("prepare")
    give_up = time.monotonic() + kit.episode_bound_s
    rounds = 0
    while True:
        rounds += 1
        answer = await kit.prepare(checkpoint, rid=rid, lease_s=HOLD_LEASE_S)
        problems = readiness_problems(answer.readiness, answer.phase)
        require(not problems, f"Prepare round {rounds}: {'; '.join(problems)}")
        require(
            answer.phase in (types_pb2.PHASE_PREPARED, types_pb2.PHASE_PREPARING),
            f"Prepare answered phase {phase_name(answer.phase)}",
        )
        if answer.phase == types_pb2.PHASE_PREPARED:
            return answer, rounds
        unacked = [
            b.receipt
            for b in answer.readiness.blockers
            if b.state == types_pb2.EPISODE_STATE_COMPLETED_UNACKED
        ]
        if unacked:
            # The episode finished before admission closed: resolve it as a coordinator
            # would (section 7.4 step 4) and go on preparing.
            await kit.acknowledge(unacked)
        elif stream is not None:
            require(
                any(b.episode == stream.episode for b in answer.readiness.blockers),
                f"not ready, but the blockers do not name {show(stream.episode)}",
            )
        require(
            time.monotonic() < give_up,
            f"Prepare still not ready after {kit.episode_bound_s:.0f} s and {rounds} rounds",
        )


async def _agent_readiness(kit: Kit) -> str:
    kit.need_task()
    # An episode mid-turn: it sealed its first boundary and works on the next turn.
    mid = episode(kit.rollout("mid-turn"), 0)
    stream = kit.run(mid)
    await stream.boundary(1)
    checkpoint = kit.checkpoint_id()
    _, rounds = await _prepare_until_ready(kit, checkpoint, stream)
    status = await kit.status()
    require(
        status.phase == types_pb2.PHASE_PREPARED and status.readiness.ready,
        f"Prepare answered ready, but GetStatus right after says phase "
        f"{phase_name(status.phase)} with {status.readiness.blocker_count} blocker(s): the "
        "prepare reported ready while the episode was mid-turn",
    )
    problems = readiness_problems(status.readiness, status.phase)
    require(not problems, f"GetStatus readiness: {'; '.join(problems)}")
    parked = ""
    if stream.result is None:
        require(
            _count(status.readiness, _PARKED_STATES) >= 1,
            f"ready with {show(mid)} still running, yet no entry is PARKED or AWAITING_MODEL",
        )
        parked = f"{show(mid)} parked after {rounds} prepare round(s)"
    else:
        parked = f"{show(mid)} finished before the prepare (resolved by acknowledging it)"
    await kit.resume(checkpoint)
    if stream.result is None:
        result = await stream.finished()
        kit.owe(result)
        indices = [b.boundary_index for b in stream.boundaries]
        require(
            indices == sorted(set(indices)),
            f"boundary indices not strictly increasing across the checkpoint: {indices}",
        )
        await kit.acknowledge([result.receipt])

    # Completed results nobody acknowledged block, listed with their receipts.
    finished = [episode(kit.rollout("unacked"), 0) for _ in range(2)]
    streams = [kit.run(e) for e in finished]
    results = [await s.finished() for s in streams]
    for result in results:
        kit.owe(result)
    receipts = {r.receipt.receipt_id for r in results}
    checkpoint = kit.checkpoint_id()
    rid = kit.rid("prepare")
    blocked = await kit.prepare(
        checkpoint, rid=rid, lease_s=HOLD_LEASE_S, max_blockers=1, timeout_s=UNREADY_PREPARE_S
    )
    require(
        blocked.phase == types_pb2.PHASE_PREPARING and not blocked.readiness.ready,
        f"Prepare answered {phase_name(blocked.phase)} (ready={blocked.readiness.ready}) with "
        "two completed results unacknowledged: each must block until acknowledged "
        "(section 6.3 item 3)",
    )
    problems = readiness_problems(blocked.readiness, blocked.phase, cap=1)
    require(not problems, f"not-ready report: {'; '.join(problems)}")
    require(
        blocked.readiness.blocker_count >= 2 and len(blocked.readiness.blockers) == 1,
        f"max_blockers=1 with two unacknowledged results: blocker_count="
        f"{blocked.readiness.blocker_count}, {len(blocked.readiness.blockers)} listed",
    )
    blocker = blocked.readiness.blockers[0]
    require(
        blocker.state == types_pb2.EPISODE_STATE_COMPLETED_UNACKED
        and blocker.receipt.receipt_id in receipts,
        "the blocker is not a COMPLETED_UNACKED entry carrying one of the results' receipts: "
        f"it is {show(blocker.episode)} {state_name(blocker.state)} receipt "
        f"{blocker.receipt.receipt_id or '(none)'!r}, of {blocked.readiness.blocker_count} "
        f"blocker(s); the results: "
        + ", ".join(f"{show(r.episode)} receipt {r.receipt.receipt_id!r}" for r in results),
    )
    status = await kit.status()
    require(
        status.phase == types_pb2.PHASE_PREPARING and not status.admission_open,
        f"GetStatus in phase {phase_name(status.phase)} during a not-ready prepare",
    )
    acked = await kit.acknowledge([r.receipt for r in results])
    require(acked.acknowledged == 2, f"Acknowledge of two receipts said {acked.acknowledged}")
    ready = await kit.prepare(checkpoint, rid=rid, lease_s=HOLD_LEASE_S)
    require(
        ready.phase == types_pb2.PHASE_PREPARED and ready.readiness.ready,
        "the same prepare was not ready once the results were acknowledged",
    )
    await kit.resume(checkpoint)
    return (
        f"{parked}; two unacknowledged results blocked (count 2, one listed under "
        "max_blockers=1, with its receipt) until acknowledged"
    )


async def _resources_readiness(kit: Kit) -> str:
    kit.need_task()
    session = episode(kit.rollout("session"), 0)
    await kit.seed(session)
    checkpoint = kit.checkpoint_id()
    answer = await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    problems = readiness_problems(answer.readiness, answer.phase)
    require(not problems, f"Prepare readiness: {'; '.join(problems)}")
    require(
        answer.phase == types_pb2.PHASE_PREPARED,
        f"an idle session kept the prepare {phase_name(answer.phase)}",
    )
    require(
        sum(c.count for c in answer.readiness.counts) >= 1,
        "the readiness counts do not include the seeded session",
    )
    await kit.resume(checkpoint)
    await kit.close_session(session)
    d = kit.description
    if not (d.verify_mode == types_pb2.VERIFY_MODE_REPLAY and d.group_scored and d.group_size >= 2):
        return (
            "an idle session is counted and does not block; (a WAIT verifier offers no way "
            "to hold a request mid-flight from outside)"
        )
    # A REPLAY verify waiting on its siblings is in flight and must never block.
    group = kit.rollout("group")
    siblings = [episode(f"{group}-s{i}", 0) for i in range(d.group_size)]
    for index, sibling in enumerate(siblings):
        await kit.seed(sibling, group=group, sibling=index, size=d.group_size)
    verifies = [asyncio.ensure_future(kit.verify(siblings[0]))]
    try:
        _, in_flight = await kit.poll(
            kit.status,
            lambda s: _count(s.readiness, {types_pb2.EPISODE_STATE_REQUEST_IN_FLIGHT}) >= 1,
            kit.episode_bound_s,
        )
        require(in_flight, "the first sibling's verify never showed as REQUEST_IN_FLIGHT")
        checkpoint = kit.checkpoint_id()
        answer = await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
        require(
            answer.phase == types_pb2.PHASE_PREPARED and answer.readiness.ready,
            "a REPLAY verify in flight kept the prepare from being ready (section 5.3 item 4)",
        )
        await kit.resume(checkpoint)
        verifies += [asyncio.ensure_future(kit.verify(s)) for s in siblings[1:]]
        await _bounded(kit, asyncio.gather(*verifies), "the group's verifies")
    finally:
        await _cancel(verifies)
    for sibling in siblings:
        await kit.close_session(sibling)
    return (
        "an idle session is counted and does not block; a REPLAY verify waiting on its "
        "group was in flight and the prepare was ready at once"
    )


async def check_readiness(kit: Kit) -> str:
    """Section 4.1, 4.6, 6.3 item 3: PREPARED exactly when nothing blocks; a mid-turn
    episode blocks until it parks at its next boundary; unacknowledged results block
    with their receipts; the report is consistent and capped."""
    if kit.hosts_agent:
        return await _agent_readiness(kit)
    if kit.hosts_resources:
        return await _resources_readiness(kit)
    checkpoint = kit.checkpoint_id()
    answer = await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    problems = readiness_problems(answer.readiness, answer.phase)
    require(not problems, f"Prepare readiness: {'; '.join(problems)}")
    require(answer.phase == types_pb2.PHASE_PREPARED, "an idle model was not ready")
    await kit.resume(checkpoint)
    return "an idle model is ready at once (a generation cannot be held mid-turn from outside)"


# ---------------------------------------------------------------------- Run stream


def _stream_problems(kit: Kit, stream: RunStream, first_index: int = 1) -> list[str]:
    e = show(stream.episode)
    problems = list(stream.extra)
    for header in stream.headers:
        if header.participant_id != kit.instance:
            problems.append(f"{e}: a RunResponse header names {header.participant_id!r}")
            break
    indices = [b.boundary_index for b in stream.boundaries]
    if indices and indices[0] < first_index:
        problems.append(f"{e}: boundary_index {indices[0]}, expected >= {first_index}")
    if indices != sorted(set(indices)):
        problems.append(f"{e}: boundary indices not strictly increasing: {indices}")
    if any(b.episode != stream.episode for b in stream.boundaries):
        problems.append(f"{e}: a BoundaryReport names another episode")
    if any(not b.HasField("sealed_at") for b in stream.boundaries):
        problems.append(f"{e}: a BoundaryReport without sealed_at")
    result = stream.result
    if result is None:
        return problems
    if result.episode != stream.episode:
        problems.append(f"{e}: the RunResult names {show(result.episode)}")
    if result.outcome in _FINAL_OUTCOMES:
        if not result.HasField("receipt") or not ID_PATTERN.fullmatch(result.receipt.receipt_id):
            problems.append(f"{e}: a final outcome without a valid receipt (section 6.3 item 2)")
        elif result.receipt.episode != stream.episode:
            problems.append(f"{e}: the receipt names {show(result.receipt.episode)}")
    elif result.outcome != rollout_service_pb2.RUN_OUTCOME_CANCELLED:
        problems.append(f"{e}: outcome {result.outcome} is not a known outcome")
    if indices and result.turns != indices[-1]:
        problems.append(f"{e}: turns={result.turns} but the last boundary was {indices[-1]}")
    return problems


async def check_run_stream(kit: Kit) -> str:
    """Section 6.1 to 6.3, 6.5, 6.6, 2.5 item 3: acceptance header, boundary reports,
    one final result with its receipt, re-invocation without a second execution, a
    re-attach naming another incarnation refused, argument checks, stale attempts and
    cancellation at a boundary."""
    if not kit.hosts_agent:
        raise CheckSkipped("the target hosts no agent (RolloutService is for agents)")
    kit.need_task()
    e = episode(kit.rollout("run"), 0)
    rid = kit.rid("run")
    stream = kit.run(e, rid=rid)
    require(
        await stream.accepted(), "no initial metadata turnpoint-accepted: 1 (section 6.1 item 2)"
    )
    result = await stream.finished()
    kit.owe(result)
    problems = _stream_problems(kit, stream)
    require(not problems, "; ".join(problems))
    incarnation = await stream.incarnation()
    own = stream.headers[0].incarnation if stream.headers else ""
    require(
        incarnation != "" and incarnation == own,
        f"initial metadata turnpoint-incarnation is {incarnation!r}, the response header "
        f"says {own!r} (section 6.1 item 2)",
    )
    await _reattach_elsewhere_is_refused(kit, incarnation)
    require(result.outcome in _FINAL_OUTCOMES, f"{show(e)} ended with outcome {result.outcome}")
    seen = 1 if stream.boundaries else 0
    again = kit.run(e, rid=rid, boundaries_seen=seen)
    repeated = await again.finished()
    require(
        repeated.receipt.receipt_id == result.receipt.receipt_id,
        "a re-invoked Run of a completed attempt returned another receipt: a second "
        "execution (section 6.5 item 2)",
    )
    expected = [b.boundary_index for b in stream.boundaries if b.boundary_index > seen]
    got = [b.boundary_index for b in again.boundaries]
    require(
        got == expected,
        f"re-invoked with boundaries_seen={seen}: boundaries {got}, expected {expected}",
    )
    other = kit.run(e, rid=kit.rid("run"), task={"conformance": "another task"})
    error = await other.refusal("a Run of the held attempt with another task")
    problems = error_problems(error, "INVALID_ARGUMENT", ("field",))
    require(not problems, f"Run with another task: {'; '.join(problems)}")
    require(error.metadata.get("field") == "task", "INVALID_ARGUMENT metadata field is not 'task'")
    higher = kit.run(episode(e.rollout_id, 1), rid=kit.rid("run"))
    higher_result = await higher.finished()
    kit.owe(higher_result)
    lower = kit.run(e, rid=kit.rid("run"))
    error = await lower.refusal(f"a Run of {show(e)} while attempt 1 is held (section 2.5 item 3)")
    problems = error_problems(error, "STALE_ATTEMPT", ("episode",))
    require(not problems, f"Run of a lower attempt: {'; '.join(problems)}")
    negative = kit.run(episode(kit.rollout("budget"), 0), budget_s=-1.0)
    error = await negative.refusal("a Run with a negative budget")
    problems = error_problems(error, "INVALID_ARGUMENT")
    require(not problems, f"Run with a negative budget: {'; '.join(problems)}")
    await kit.acknowledge([result.receipt, higher_result.receipt])

    cancelled = episode(kit.rollout("cancelled"), 0)
    first = kit.run(cancelled)
    await first.boundary(1)
    await first.cancel()
    seen = len(first.boundaries)
    resumed = kit.run(cancelled, boundaries_seen=seen)
    final = await resumed.finished()
    kit.owe(final)
    problems = _stream_problems(kit, resumed, first_index=seen + 1)
    require(not problems, "; ".join(problems))
    require(
        final.outcome in _FINAL_OUTCOMES, f"the continued {show(cancelled)} ended {final.outcome}"
    )
    await kit.acknowledge([final.receipt])
    return (
        f"accepted with the header and its incarnation; {len(stream.boundaries)} boundaries "
        "then one result with its receipt; re-invocation replayed it; a re-attach naming "
        "another incarnation STALE_ATTEMPT, starting nothing; another task INVALID_ARGUMENT; a lower "
        "attempt STALE_ATTEMPT; a negative budget refused; a Run cancelled after a boundary "
        "continued from it"
    )


async def _reattach_elsewhere_is_refused(kit: Kit, incarnation: str) -> None:
    """Section 6.5 item 5: a re-attach naming an incarnation other than the target's
    (the process that accepted it died) is STALE_ATTEMPT and leaves nothing behind: a
    first Run of the same attempt is then taken and runs to its result."""
    gone = episode(kit.rollout("gone"), 0)
    another = f"not-{incarnation}"
    reattach = kit.run(gone, boundaries_seen=1, participant_incarnation=another)
    error = await reattach.refusal(
        f"a re-attach of {show(gone)} naming another incarnation (section 6.5 item 5)"
    )
    problems = error_problems(error, "STALE_ATTEMPT", ("episode", "request_incarnation"))
    require(not problems, f"a re-attach naming another incarnation: {'; '.join(problems)}")
    require(
        error.metadata.get("request_incarnation") == another,
        f"STALE_ATTEMPT metadata request_incarnation is "
        f"{error.metadata.get('request_incarnation')!r}, not {another!r}",
    )
    fresh = kit.run(gone)
    require(
        await fresh.accepted(),
        f"a first Run of {show(gone)} after the refused re-attach was not accepted: the "
        "refusal must start, hold and retire nothing (section 6.5 item 5)",
    )
    final = await fresh.finished()
    kit.owe(final)
    await kit.acknowledge([final.receipt])


# ---------------------------------------------------------------------- acknowledge


async def check_acknowledge(kit: Kit) -> str:
    """Section 6.3 item 3, 6.4, 6.8: a result is kept until acknowledged; known receipts
    release it, unknown ones (repeats included) are listed and harmless."""
    if not kit.hosts_agent:
        raise CheckSkipped("the target hosts no agent (Acknowledge is for agents)")
    kit.need_task()
    e = episode(kit.rollout("ack"), 0)
    stream = kit.run(e)
    result = await stream.finished()
    kit.owe(result)
    kept = await kit.status()
    require(
        _count(kept.readiness, {types_pb2.EPISODE_STATE_COMPLETED_UNACKED}) >= 1,
        "the unacknowledged result is not kept as COMPLETED_UNACKED",
    )
    first = await kit.acknowledge([result.receipt])
    require(
        first.acknowledged == 1 and not first.unknown,
        f"Acknowledge of a fresh receipt: acknowledged={first.acknowledged}, "
        f"{len(first.unknown)} unknown",
    )
    second = await kit.acknowledge([result.receipt])
    require(
        second.acknowledged == 0
        and [r.receipt_id for r in second.unknown] == [result.receipt.receipt_id],
        "a repeated Acknowledge did not list the receipt as unknown (section 6.8)",
    )
    never = types_pb2.CompletionReceipt(episode=e, receipt_id=kit.rollout("never-issued"))
    third = await kit.acknowledge([never])
    require(
        third.acknowledged == 0 and [r.receipt_id for r in third.unknown] == [never.receipt_id],
        "a receipt never issued was not listed as unknown",
    )
    empty = await kit.acknowledge([])
    require(
        empty.acknowledged == 0 and not empty.unknown, "an empty Acknowledge acknowledged something"
    )
    released = await kit.status()
    require(
        _count(released.readiness, {types_pb2.EPISODE_STATE_COMPLETED_UNACKED})
        < _count(kept.readiness, {types_pb2.EPISODE_STATE_COMPLETED_UNACKED}),
        "the acknowledged result is still kept",
    )
    return "kept until acknowledged; released once; repeats and strangers listed as unknown"
