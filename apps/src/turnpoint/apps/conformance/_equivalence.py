"""The equivalence check: a restored environment behaves exactly like one never
interrupted (docs/spec.md section 5.6).

With a workload of recorded calls and a second, fresh target (the same instance name
over the same snapshot root), the kit:

1. runs the episode uninterrupted on the target: every reply and the verifier's reward
   (verified twice: the same verdict) are the reference;
2. seeds one episode per turn boundary k = 0..n and sends each the first k calls (each
   reply must match the reference: the environment is deterministic for one task);
3. commits one checkpoint with all of them in scope: one record per session;
4. with ``snapshot_root``, restores a copy of the snapshot whose session states are
   truncated into the fresh target: it must be refused and install nothing;
5. restores the snapshot into the fresh target as attempt N+1: every session installed;
6. lets attempt N go on: each cut episode's next call is sent again to the target, as a
   late call of the old attempt; a call naming attempt N on the fresh target is refused;
7. replays the remaining calls on each attempt N+1 and verifies: every reply and the
   reward must equal the reference. The first diverging call is named.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format, struct_pb2

from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

from ._kit import HOLD_LEASE_S, CheckFailed, CheckSkipped, Kit, episode, require, show
from ._snapshot_copies import Records, altered_copy
from ._wire import Refused


def _exact(message: struct_pb2.Struct) -> bytes:
    """A reply's exact bytes: map keys sorted, numbers bit for bit (NaN included)."""
    return message.SerializeToString(deterministic=True)


def _shown(message: struct_pb2.Struct) -> str:
    try:
        text = json.dumps(json_format.MessageToDict(message), sort_keys=True)
    except ValueError:  # NaN or an infinity: no JSON form
        text = str(message).replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def _call_name(number: int, tool: str, arguments: Mapping[str, Any]) -> str:
    shown = json.dumps(dict(arguments), sort_keys=True)
    return f"call #{number} {tool}({shown[1:-1]})"


class _Reference:
    """What the uninterrupted episode answered."""

    def __init__(self, replies: list[struct_pb2.Struct], reward: float) -> None:
        self.replies = replies
        self.reward = reward


async def _straight(kit: Kit, task: Mapping[str, Any]) -> _Reference:
    e = episode(kit.rollout("eq-straight"), 0)
    await kit.seed(e, task=task)
    replies = [(await kit.call(e, tool, args)).output for tool, args in kit.workload.calls]
    first = await kit.verify(e)
    again = await kit.verify(e)
    require(
        first.reward == again.reward,
        f"Verify of the uninterrupted episode answered {first.reward!r}, then {again.reward!r} "
        "(a verify must be safe to run again, section 5.3 item 3)",
    )
    await kit.close_session(e)
    return _Reference(list(replies), float(first.reward))


def _compare(
    reference: _Reference,
    number: int,
    reply: struct_pb2.Struct,
    where: str,
    tool: str,
    arguments: Mapping[str, Any],
) -> None:
    expected = reference.replies[number - 1]
    if _exact(reply) != _exact(expected):
        raise CheckFailed(
            f"{where}: first diverging {_call_name(number, tool, arguments)} answered "
            f"{_shown(reply)}, uninterrupted {_shown(expected)}"
        )


def _truncate(records: Records) -> None:
    """Every session state cut short: its last key dropped."""
    for record in records:
        payload = record["payload"]
        if isinstance(payload, dict) and payload:
            del payload[sorted(payload)[-1]]


async def check_equivalence(kit: Kit) -> str:
    """Section 5.6: a session restored at any turn boundary, as attempt N+1 into a fresh
    server, answers every remaining call and the verify exactly as an uninterrupted one."""
    if not kit.hosts_resources:
        raise CheckSkipped("the target serves no resources: nothing to replay calls on")
    task = kit.need_task()
    calls: Sequence[tuple[str, Mapping[str, Any]]] = kit.workload.calls
    if kit.description.recovery_mode != types_pb2.RECOVERY_MODE_EXPORTED:
        raise CheckSkipped("the target does not export sessions: nothing is restored")
    fresh = kit.take_restore_target("equivalence")
    if fresh is None:
        untried = "the restore into a fresh target and the replay were not tried"
        if not calls:
            untried += "; the workload has no calls (--equivalence FILE) to replay"
        raise CheckSkipped(
            f"needs a fresh restore target, {kit.restore_target_missing()}: {untried}"
        )
    await fresh.discover()
    require(
        fresh.instance == kit.instance,
        f"the restore target is instance {fresh.instance!r}, not {kit.instance!r}: a restore "
        "reads the snapshot of its own instance name (section 8.5)",
    )
    reference = await _straight(kit, task)
    n = len(calls)
    cut: list[types_pb2.EpisodeId] = []
    for k in range(n + 1):
        e = episode(kit.rollout(f"eq-cut{k}"), 0)
        await kit.seed(e, task=task)
        for number, (tool, args) in enumerate(calls[:k], start=1):
            reply = (await kit.call(e, tool, args)).output
            _compare(
                reference,
                number,
                reply,
                f"{show(e)} before its cut (not deterministic?)",
                tool,
                args,
            )
        cut.append(e)
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    try:
        committed = await kit.commit(checkpoint, checkpoint, cut)
    except Refused as refusal:
        raise CheckFailed(
            f"the commit with {len(cut)} sessions in scope was refused "
            f"{refusal.error.summary()} {refusal.error.message[:120]!r}: an exported server "
            "must export every session it holds (section 5.3 item 1)"
        ) from None
    await kit.resume(checkpoint)
    records = sum(ref.record_count for ref in committed.artifacts)
    exported = {show(e) for e in committed.exported}
    require(
        records == len(cut) and exported == {show(e) for e in cut},
        f"the commit with {len(cut)} sessions in scope wrote {records} record(s) and exported "
        f"{sorted(exported)}: expected one record per session (section 5.3 item 1)",
    )
    kit.notes.append(f"a committed snapshot directory {checkpoint}/{kit.instance}/ under its root")
    entry = pb.ManifestEntry(manifest=committed.manifest, artifacts=list(committed.artifacts))
    done = [
        f"{n} call(s) replayed from each of {len(cut)} turn boundaries"
        if n
        else "no calls in the workload: only the seeded session was restored and verified"
    ]
    if kit.snapshot_root is not None:
        copy = kit.checkpoint_id()
        bad = altered_copy(kit.snapshot_root, checkpoint, copy, kit.instance, entry, _truncate)
        kit.notes.append(f"a truncated copy of the snapshot, {copy}/{kit.instance}/")
        await fresh.refused(
            fresh.restore(fresh.checkpoint_id(), copy, bad, cut),
            "INVALID_CHECKPOINT_STATE",
            "Restore of session states with their last key cut off",
        )
        status = await fresh.status()
        require(
            status.phase == types_pb2.PHASE_IDLE,
            "the refused restore of truncated states left the fresh target "
            f"in phase {status.phase}",
        )
        done.append("truncated states refused, nothing installed")
    else:
        done.append("(no --snapshot-root: truncated states were not tried)")
    restore_id = fresh.checkpoint_id()
    try:
        restored = await fresh.restore(restore_id, checkpoint, entry, cut)
    except Refused as refusal:
        raise CheckFailed(
            f"the restore of {len(cut)} saved sessions into the fresh target was refused "
            f"{refusal.error.summary()} {refusal.error.message[:120]!r}"
        ) from None
    wanted = {show(episode(e.rollout_id, e.attempt + 1)) for e in cut}
    installed = {show(e) for e in restored.installed}
    require(
        installed == wanted,
        f"the restore installed {sorted(installed)}, expected every session of the scope as "
        f"attempt N+1: {sorted(wanted)}",
    )
    await fresh.resume(restore_id)
    nexts = [episode(e.rollout_id, e.attempt + 1) for e in cut]
    for e in nexts:
        fresh.holds_session(e)
    # Attempt N goes on after the restore (a zombie the coordinator has not retired yet):
    # its late calls must not reach attempt N+1.
    for k, e in enumerate(cut[:n]):
        await kit.call(e, *calls[k])
    if n:
        late = cut[0]
        try:
            await fresh.call(late, *calls[0])
        except Refused:
            pass
        else:
            raise CheckFailed(
                f"the fresh target answered a call naming {show(late)} after restoring "
                f"{show(nexts[0])}: attempt N must not reach attempt N+1 (section 5.6)"
            )
    for k, e in enumerate(nexts):
        where = f"{show(e)} restored at boundary {k}"
        for number, (tool, args) in enumerate(calls[k:], start=k + 1):
            reply = (await fresh.call(e, tool, args)).output
            _compare(reference, number, reply, where, tool, args)
        first = await fresh.verify(e)
        again = await fresh.verify(e)
        for verdict in (first, again):
            require(
                verdict.reward == reference.reward,
                f"{where}: Verify answered {verdict.reward!r}, uninterrupted {reference.reward!r}",
            )
    return "; ".join(done) + f"; every reply and the reward {reference.reward!r} matched"


async def check_exported_sessions(kit: Kit) -> str:
    """Section 5.3 items 1 and 3: with a workload, an exported session that was seeded and
    called is in the commit (one record per session in scope), and a repeated Verify
    answers the same verdict."""
    if not kit.hosts_resources:
        raise CheckSkipped("the target serves no resources")
    task = kit.need_task()
    exported_mode = kit.description.recovery_mode == types_pb2.RECOVERY_MODE_EXPORTED
    d = kit.description
    # A group-scored verify waits for every sibling: seed a whole group then.
    size = max(2, d.group_size) if d.group_scored else 2
    group = kit.rollout("group") if d.group_scored else ""
    sessions = [episode(kit.rollout("sessions"), 0) for _ in range(size)]
    for index, e in enumerate(sessions):
        await kit.seed(e, task=task, group=group, sibling=index, size=size if group else 1)
        for tool, args in kit.workload.calls:
            await kit.call(e, tool, args)
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    try:
        committed = await kit.commit(checkpoint, checkpoint, sessions)
    except Refused as refusal:
        raise CheckFailed(
            f"the commit with {len(sessions)} seeded sessions in scope was refused "
            f"{refusal.error.summary()} {refusal.error.message[:120]!r}"
        ) from None
    await kit.resume(checkpoint)
    kit.notes.append(f"a committed snapshot directory {checkpoint}/{kit.instance}/ under its root")
    records = sum(ref.record_count for ref in committed.artifacts)
    expected = len(sessions) if exported_mode else 0
    require(
        records == expected,
        f"the commit with {len(sessions)} sessions in scope wrote {records} record(s), "
        f"expected {expected} ({'one per session' if exported_mode else 'not exported'})",
    )
    firsts = await asyncio.gather(*(kit.verify(e) for e in sessions))
    agains = await asyncio.gather(*(kit.verify(e) for e in sessions))
    for e, first, again in zip(sessions, firsts, agains, strict=True):
        require(
            first.reward == again.reward,
            f"Verify of {show(e)} answered {first.reward!r}, then {again.reward!r}",
        )
    first = firsts[0]
    untried = [] if kit.workload.calls else ["no calls in the workload: none sent"]
    if not (kit.restore_targets or kit.used_restore_targets) and exported_mode:
        untried.append("no --restore-target: the state was not restored (equivalence check)")
    note = f" ({'; '.join(untried)})" if untried else ""
    return (
        f"seeded {len(sessions)} sessions and sent {len(kit.workload.calls)} call(s) each; "
        f"the commit wrote {records} record(s); a repeated Verify answered {first.reward!r} "
        f"again{note}"
    )
