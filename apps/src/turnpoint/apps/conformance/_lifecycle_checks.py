"""Checks of the checkpoint life cycle: leases, resume, commit, restore, retire and
forget.

Each check is ``async def check(kit) -> str``, as in :mod:`._control_checks`.
"""

from __future__ import annotations

import time

from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

from ._kit import HOLD_LEASE_S, CheckSkipped, Kit, episode, require, require_idle, show
from ._rules import ID_PATTERN, SHA256_HEX, error_problems, phase_name

# Leases run on a monotonic clock and travel as wall-clock instants (section 4.2 item 4):
# each reply maps the same expiry through a fresh reading of both clocks, so an unchanged
# expiry may come back a few microseconds apart.
WALL_JITTER_S = 0.05


# ---------------------------------------------------------------------- leases


async def check_lease(kit: Kit) -> str:
    """Section 4.2, 4.4, 4.13: a lease never shortens, and its expiry resumes the
    participant as Resume would, counts the event and finishes the id."""
    lease = kit.lease_s
    before = await kit.status()
    checkpoint = kit.checkpoint_id()
    sent = time.monotonic()
    prepared = await kit.prepare(checkpoint, lease_s=lease)
    require(
        prepared.phase == types_pb2.PHASE_PREPARED,
        f"Prepare on an idle participant answered {phase_name(prepared.phase)}",
    )
    require(prepared.HasField("lease_expires_at"), "Prepare answered without lease_expires_at")
    first = prepared.lease_expires_at.ToNanoseconds()
    renewed = await kit.renew(checkpoint, lease_s=lease / 4)
    moved = (renewed.lease_expires_at.ToNanoseconds() - first) / 1e9
    require(
        moved >= -WALL_JITTER_S,
        f"Renew with a shorter lease moved the expiry {-moved:.3f} s earlier (a lease never "
        "shortens)",
    )
    open_status = await kit.status()
    require(
        open_status.active_checkpoint_id == checkpoint and open_status.HasField("lease_expires_at"),
        "GetStatus does not show the open checkpoint and its lease",
    )
    # Generous: the expiry runs on the target's own timer, on a machine that may be busy.
    bound = lease + max(3.0, 2 * lease)
    status, expired = await kit.poll(kit.status, lambda s: s.phase == types_pb2.PHASE_IDLE, bound)
    waited = time.monotonic() - sent
    require(
        expired,
        f"a {lease:g} s lease, never renewed, had not expired after {waited:.1f} s "
        f"(phase {phase_name(status.phase)})",
    )
    require(
        waited >= lease * 0.9,
        f"a {lease:g} s lease expired after {waited:.2f} s, before its length",
    )
    require_idle(status, "after the lease expired")
    require(
        status.lease_expiries == before.lease_expiries + 1,
        f"lease_expiries went from {before.lease_expiries} to {status.lease_expiries}, "
        "expected one more",
    )
    await kit.refused(
        kit.renew(checkpoint),
        "STALE_CHECKPOINT",
        "Renew of the expired checkpoint",
        keys=("checkpoint_id",),
    )
    await kit.refused(
        kit.prepare(checkpoint),
        "STALE_CHECKPOINT",
        "Prepare of the expired checkpoint",
        keys=("checkpoint_id",),
    )
    late = await kit.resume(checkpoint)
    require(not late.ended_active, "Resume after the expiry said ended_active=true")
    return (
        f"a {lease:g} s lease never shortened, expired after {waited:.1f} s into IDLE, "
        "counted once, and left the id finished"
    )


# ---------------------------------------------------------------------- life cycle


async def check_resume(kit: Kit) -> str:
    """Section 4.9, 4.4, 4.6 step 3: resume is abort, ids finish for good, a higher id
    supersedes an open one and a lower one is stale."""
    never_seen = kit.checkpoint_id()
    answer = await kit.resume(never_seen)
    require(
        not answer.ended_active and answer.phase == types_pb2.PHASE_IDLE,
        "Resume of an id never seen must answer IDLE, ended_active=false",
    )
    await kit.refused(
        kit.prepare(never_seen),
        "STALE_CHECKPOINT",
        "Prepare of an id resumed before it was seen (section 4.9 item 2)",
        keys=("checkpoint_id",),
    )
    first = kit.checkpoint_id()
    await kit.prepare(first, lease_s=HOLD_LEASE_S)
    status = await kit.status()
    require(
        status.active_checkpoint_id == first and not status.admission_open,
        "GetStatus does not show the prepared checkpoint with admission closed",
    )
    other = kit.checkpoint_id(kit.other_prefix())
    error = await kit.refused(
        kit.prepare(other),
        "INVALID_PHASE",
        "Prepare of an unrelated id while another is active",
        keys=("active",),
    )
    require(
        error.metadata.get("active") == first, "INVALID_PHASE metadata active is not the active id"
    )
    skipped = kit.checkpoint_id()
    superseding = kit.checkpoint_id()
    replaced = await kit.prepare(superseding, lease_s=HOLD_LEASE_S)
    require(
        replaced.phase == types_pb2.PHASE_PREPARED and replaced.checkpoint_id == superseding,
        "a superseding Prepare did not replace the open checkpoint",
    )
    await kit.refused(kit.renew(first), "STALE_CHECKPOINT", "Renew of the superseded checkpoint")
    await kit.refused(
        kit.prepare(skipped),
        "STALE_CHECKPOINT",
        "Prepare of an id the active one supersedes",
    )
    ender = kit.checkpoint_id()
    ended = await kit.resume(ender)
    require(
        ended.ended_active and ended.phase == types_pb2.PHASE_IDLE,
        "Resume of an id superseding the active one did not end it",
    )
    again = await kit.resume(ender)
    require(not again.ended_active, "a repeated Resume said ended_active=true")
    await kit.refused(
        kit.prepare(superseding), "STALE_CHECKPOINT", "Prepare of a checkpoint ended by a resume"
    )
    require_idle(await kit.status(), "after the resumes")
    return (
        "resume of unknown ids finishes them; a superseding prepare replaces the open "
        "checkpoint; lower, superseded and resumed ids are STALE_CHECKPOINT; unrelated ids "
        "INVALID_PHASE"
    )


def _artifact_problems(kit: Kit, ref: types_pb2.ArtifactRef, what: str) -> list[str]:
    problems = []
    parts = ref.path.split("/")
    if (
        len(parts) != 2
        or parts[0] != kit.instance
        or not all(ID_PATTERN.fullmatch(p) for p in parts)
    ):
        problems.append(f"{what} path {ref.path!r} is not '<instance>/<valid id>'")
    if not SHA256_HEX.fullmatch(ref.sha256):
        problems.append(f"{what} sha256 {ref.sha256!r} is not 64 lowercase hex characters")
    return problems


async def check_commit(kit: Kit) -> str:
    """Section 4.8, 8.3, 4.3: commit writes a manifest and one records file, replays
    its answer, refuses another identity and stale ids."""
    checkpoint = kit.checkpoint_id()
    prepared = await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    require(
        prepared.phase == types_pb2.PHASE_PREPARED, "Prepare on an idle participant was not ready"
    )
    stranger = episode(kit.rollout("not-here"), 0)
    rid = kit.rid("commit")
    committed = await kit.commit(checkpoint, checkpoint, [stranger], rid=rid)
    require(committed.checkpoint_id == checkpoint, "CommitResponse names another checkpoint")
    problems = _artifact_problems(kit, committed.manifest, "manifest")
    require(
        committed.manifest.path == f"{kit.instance}/MANIFEST.json",
        f"manifest path {committed.manifest.path!r}, expected '{kit.instance}/MANIFEST.json'",
    )
    require(len(committed.artifacts) == 1, f"{len(committed.artifacts)} artifacts, expected one")
    records = committed.artifacts[0]
    problems += _artifact_problems(kit, records, "records file")
    require(
        records.path == f"{kit.instance}/records-{records.sha256}.jsonl",
        f"records path {records.path!r} does not carry its digest",
    )
    require(not problems, "; ".join(problems))
    require(
        not committed.exported,
        f"exported {[show(e) for e in committed.exported]}: an episode the participant never held",
    )
    status = await kit.status()
    require(
        status.phase == types_pb2.PHASE_COMMITTED, f"phase {phase_name(status.phase)} after Commit"
    )
    replay = await kit.commit(checkpoint, checkpoint, [stranger], rid=rid)
    retry = await kit.commit(checkpoint, checkpoint, [stranger])
    for again, how in (
        (replay, "a retried Commit"),
        (retry, "the same Commit under a new request id"),
    ):
        require(
            again.manifest == committed.manifest
            and list(again.artifacts) == list(committed.artifacts),
            f"{how} answered another manifest or artifacts",
        )
    await kit.refused(
        kit.commit(checkpoint, kit.checkpoint_id(kit.other_prefix()), [stranger]),
        "CHECKPOINT_CONFLICT",
        "Commit of the same checkpoint into another snapshot",
    )
    renewed = await kit.renew(checkpoint, lease_s=HOLD_LEASE_S)
    require(renewed.phase == types_pb2.PHASE_COMMITTED, "Renew in COMMITTED changed the phase")
    ended = await kit.resume(checkpoint)
    require(ended.ended_active, "Resume of the committed checkpoint said ended_active=false")
    await kit.refused(
        kit.commit(checkpoint, checkpoint, [stranger]),
        "STALE_CHECKPOINT",
        "Commit after Resume",
        keys=("checkpoint_id",),
    )
    kit.notes.append(f"a committed snapshot directory {checkpoint}/{kit.instance}/ under its root")
    return (
        f"wrote {committed.manifest.path} and {records.record_count} record(s); replayed the "
        "answer; CHECKPOINT_CONFLICT for another snapshot; STALE_CHECKPOINT after resume"
    )


async def check_restore(kit: Kit) -> str:
    """Section 4.10: restore into a fresh participant verifies the snapshot, installs all
    or nothing, holds RESTORED until resume, replays, conflicts and goes stale."""
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    committed = await kit.commit(checkpoint, checkpoint)
    await kit.resume(checkpoint)
    entry = pb.ManifestEntry(manifest=committed.manifest, artifacts=list(committed.artifacts))
    kit.notes.append(f"a committed snapshot directory {checkpoint}/{kit.instance}/ under its root")
    # An entry without a manifest is a participant that saved nothing (section 4.10);
    # naming record files without their manifest is malformed.
    await kit.refused(
        kit.restore(
            kit.checkpoint_id(),
            checkpoint,
            pb.ManifestEntry(artifacts=list(committed.artifacts)),
        ),
        "INVALID_ARGUMENT",
        "Restore naming artifacts without entry.manifest",
    )
    forged = pb.ManifestEntry()
    forged.CopyFrom(entry)
    forged.manifest.sha256 = "0" * 64
    refusal = await kit.refused(
        kit.restore(kit.checkpoint_id(), checkpoint, forged),
        ("INVALID_CHECKPOINT_STATE", "INVALID_PHASE"),
        "Restore naming a manifest digest the snapshot does not have",
    )
    if refusal.reason == "INVALID_PHASE":
        require(
            refusal.metadata.get("fresh") == "false",
            "Restore into an idle participant refused INVALID_PHASE without fresh=false",
        )
        raise CheckSkipped(
            "the target is not fresh (it already admitted data-plane work): restart it "
            "and run the kit again to check a restore"
        )
    problems = error_problems(refusal, "INVALID_CHECKPOINT_STATE", ("snapshot", "corruption"))
    require(not problems, f"Restore of a forged digest: {'; '.join(problems)}")
    require_idle(await kit.status(), "after a refused Restore (all or nothing)")
    restore_id = kit.checkpoint_id()
    rid = kit.rid("restore")
    restored = await kit.restore(restore_id, checkpoint, entry, rid=rid)
    require(
        restored.restore_id == restore_id
        and restored.phase == types_pb2.PHASE_RESTORED
        and not restored.installed,
        "Restore of an empty scope must answer PHASE_RESTORED with nothing installed",
    )
    status = await kit.status()
    require(
        status.phase == types_pb2.PHASE_RESTORED
        and status.active_checkpoint_id == restore_id
        and not status.admission_open,
        "GetStatus does not show the restore holding admission closed",
    )
    again = await kit.restore(restore_id, checkpoint, entry, rid=rid)
    require(
        again.restore_id == restore_id
        and again.phase == restored.phase
        and list(again.installed) == list(restored.installed),
        "a retried Restore answered differently",
    )
    await kit.refused(
        kit.restore(restore_id, checkpoint, entry, [episode(kit.rollout("other"), 0)]),
        "CHECKPOINT_CONFLICT",
        "the same restore id with another scope",
    )
    await kit.refused(kit.prepare(kit.checkpoint_id()), "INVALID_PHASE", "Prepare while RESTORED")
    ended = await kit.resume(restore_id)
    require(ended.ended_active, "Resume of the restore id said ended_active=false")
    require_idle(await kit.status(), "after resuming the restore")
    await kit.refused(
        kit.restore(restore_id, checkpoint, entry),
        "STALE_CHECKPOINT",
        "Restore of a resumed restore id",
    )
    return (
        "refused a missing manifest and a forged digest with nothing changed; restored "
        "RESTORED and closed until resume; replayed; CHECKPOINT_CONFLICT; then stale"
    )


async def check_restore_running(kit: Kit) -> str:
    """Section 4.16: a participant that lists CAPABILITY_RESTORE_RUNNING restores while
    it holds work: no freshness needed, RESTORED until resume, replayed, conflicting,
    stale once resumed, and a retired scope attempt refused before anything changes (with
    ``retire_unscoped``, one whose N+1 was retired, listed in ``stale_episodes``)."""
    described = await kit.describe()
    if pb.CAPABILITY_RESTORE_RUNNING not in described.capabilities:
        raise CheckSkipped(
            "the target lists no CAPABILITY_RESTORE_RUNNING in Describe: it is restored "
            "only when fresh (section 4.10), which the restore check covers"
        )
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    committed = await kit.commit(checkpoint, checkpoint)
    await kit.resume(checkpoint)
    entry = pb.ManifestEntry(manifest=committed.manifest, artifacts=list(committed.artifacts))
    kit.notes.append(f"a committed snapshot directory {checkpoint}/{kit.instance}/ under its root")
    retired = episode(kit.rollout("restore-running"), 0)
    await kit.retire([retired])
    await kit.refused(
        kit.restore_running(kit.checkpoint_id(), checkpoint, entry, [retired]),
        "STALE_ATTEMPT",
        "RestoreRunning continuing an attempt retired here",
        keys=("episode",),
    )
    require_idle(await kit.status(), "after a refused RestoreRunning (nothing changed)")
    # A new incarnation's restore (retire_unscoped) continues a saved attempt N retired
    # here, but never as an N+1 retired here too: that is refused, listing it with its mark.
    await kit.retire([episode(retired.rollout_id, 1)])
    await kit.refused(
        kit.restore_running(
            kit.checkpoint_id(), checkpoint, entry, [retired], retire_unscoped=True
        ),
        "STALE_ATTEMPT",
        "RestoreRunning with retire_unscoped continuing as an attempt retired here",
        keys=("episode", "stale_episodes"),
    )
    require_idle(await kit.status(), "after a refused RestoreRunning (nothing changed)")
    restore_id = kit.checkpoint_id()
    rid = kit.rid("restore-running")
    restored = await kit.restore_running(restore_id, checkpoint, entry, rid=rid)
    require(
        restored.restore_id == restore_id
        and restored.phase == types_pb2.PHASE_RESTORED
        and not restored.installed,
        "RestoreRunning of an empty scope must answer PHASE_RESTORED with nothing installed",
    )
    status = await kit.status()
    require(
        status.phase == types_pb2.PHASE_RESTORED
        and status.active_checkpoint_id == restore_id
        and not status.admission_open,
        "GetStatus does not show the running restore holding admission closed",
    )
    again = await kit.restore_running(restore_id, checkpoint, entry, rid=rid)
    require(
        again.restore_id == restore_id
        and again.phase == restored.phase
        and list(again.installed) == list(restored.installed)
        and list(again.retired) == list(restored.retired),
        "a retried RestoreRunning answered differently",
    )
    await kit.refused(
        kit.restore_running(restore_id, checkpoint, entry, [episode(kit.rollout("other"), 0)]),
        "CHECKPOINT_CONFLICT",
        "the same restore id with another scope",
    )
    ended = await kit.resume(restore_id)
    require(ended.ended_active, "Resume of the running restore's id said ended_active=false")
    require_idle(await kit.status(), "after resuming the running restore")
    await kit.refused(
        kit.restore_running(restore_id, checkpoint, entry),
        "STALE_CHECKPOINT",
        "RestoreRunning of a resumed restore id",
    )
    await kit.forget([retired.rollout_id])
    d = kit.description
    if (
        kit.hosts_resources
        and d.recovery_mode == types_pb2.RECOVERY_MODE_EXPORTED
        and not d.group_scored
        and kit.workload.task
    ):
        in_scope = await _restore_running_a_live_session(kit)
    else:
        in_scope = (
            "a scope holding a live episode is checked on a resources target that exports "
            "its sessions (not group-scored) with a workload task"
        )
    return (
        "listed the capability; refused a retired scope attempt STALE_ATTEMPT with nothing "
        "changed (with retire_unscoped, one whose N+1 was retired, listed); restored "
        "without freshness, RESTORED until resume; replayed; "
        f"CHECKPOINT_CONFLICT; then stale; {in_scope}"
    )


def _same(e: types_pb2.EpisodeId, other: types_pb2.EpisodeId) -> bool:
    return (e.rollout_id, e.attempt) == (other.rollout_id, other.attempt)


async def _restore_running_a_live_session(kit: Kit) -> str:
    """A session seeded, called and committed, then restored where it lives: the saved
    attempt N retired, N+1 installed beside it and served, N refused."""
    saved = episode(kit.rollout("running"), 0)
    await kit.seed(saved)
    for tool, arguments in kit.workload.calls:
        await kit.call(saved, tool, arguments)
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    committed = await kit.commit(checkpoint, checkpoint, [saved])
    await kit.resume(checkpoint)
    entry = pb.ManifestEntry(manifest=committed.manifest, artifacts=list(committed.artifacts))
    restore_id = kit.checkpoint_id()
    restored = await kit.restore_running(restore_id, checkpoint, entry, [saved])
    continued = episode(saved.rollout_id, saved.attempt + 1)
    require(
        len(restored.installed) == 1 and _same(restored.installed[0], continued),
        f"RestoreRunning of {show(saved)} installed "
        f"{[show(e) for e in restored.installed]}, expected {show(continued)}",
    )
    require(
        any(_same(e, saved) for e in restored.retired),
        f"RestoreRunning of {show(saved)} did not list it retired: "
        f"{[show(e) for e in restored.retired]}",
    )
    await kit.resume(restore_id)
    await kit.refused(kit.verify(saved), "STALE_ATTEMPT", f"Verify of {show(saved)} after N+1")
    await kit.verify(continued)
    await kit.retire([continued])
    await kit.forget([saved.rollout_id])
    return (
        f"a live session restored in place: {show(saved)} retired, {show(continued)} "
        "installed and served, the old attempt refused STALE_ATTEMPT"
    )


# ---------------------------------------------------------------------- retire / forget


async def _stale_attempt_call(kit: Kit, e: types_pb2.EpisodeId) -> str:
    """One data-plane call naming ``e``; refused STALE_ATTEMPT before any work starts."""
    if kit.hosts_agent:
        stream = kit.run(e, task=kit.workload.task or {})
        error = await stream.refusal(f"Run of retired {show(e)}")
        problems = error_problems(error, "STALE_ATTEMPT", ("episode", "retired_through"))
        require(not problems, f"Run of retired {show(e)}: {'; '.join(problems)}")
        return "Run"
    if kit.hosts_resources:
        await kit.refused(
            kit.seed(e),
            "STALE_ATTEMPT",
            f"SeedSession of retired {show(e)}",
            keys=("episode", "retired_through"),
        )
        return "SeedSession"
    await kit.refused(
        kit.generate(e),
        "STALE_ATTEMPT",
        f"Generate of retired {show(e)}",
        keys=("episode", "retired_through"),
    )
    return "Generate"


async def check_retire(kit: Kit) -> str:
    """Section 4.11, 2.5, 6.9: retire marks the rollout, refuses its attempts at or below
    the mark on the data plane, runs only while idle, and stops a running episode."""
    before = await kit.status()
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    rollout = kit.rollout("retired")
    await kit.refused(
        kit.retire([episode(rollout, 1)]), "INVALID_PHASE", "Retire while a checkpoint is open"
    )
    await kit.resume(checkpoint)
    answer = await kit.retire([episode(rollout, 1)])
    require(not answer.stopped, f"Retire of an attempt never seen stopped {list(answer.stopped)}")
    status = await kit.status()
    require(
        status.refused_rollouts == before.refused_rollouts + 1,
        f"refused_rollouts {before.refused_rollouts} -> {status.refused_rollouts} after a retire",
    )
    method = ""
    for attempt in (1, 0):
        method = await _stale_attempt_call(kit, episode(rollout, attempt))
    running = ""
    if kit.hosts_agent and kit.workload.task is not None:
        e = episode(kit.rollout("stopped"), 0)
        stream = kit.run(e)
        await stream.boundary(1)
        stopped = await kit.retire([e])
        require(
            [show(s) for s in stopped.stopped] == [show(e)],
            f"Retire of a running episode answered stopped={[show(s) for s in stopped.stopped]}",
        )
        await stream.ended()
        if stream.result is not None:
            kit.owe(stream.result)
            running = "; the episode finished before the retire reached it"
        else:
            require(
                stream.error is not None and stream.error.reason == "STALE_ATTEMPT",
                f"the Run of a retired episode ended "
                f"{stream.error.summary() if stream.error else 'without an error'}, "
                "expected STALE_ATTEMPT (section 4.11 item 5)",
            )
            running = "; a running episode was stopped and its Run ended STALE_ATTEMPT"
    await kit.forget([rollout])
    return (
        f"INVALID_PHASE while a checkpoint is open; marked the rollout; {method} of attempts "
        f"at or below the mark refused STALE_ATTEMPT{running}"
    )


async def check_forget(kit: Kit) -> str:
    """Section 4.12: forget drops refusal marks, counts only its own drops, runs only
    while idle."""
    rollout = kit.rollout("forgotten")
    await kit.retire([episode(rollout, 0)])
    marked = await kit.status()
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    await kit.refused(kit.forget([rollout]), "INVALID_PHASE", "Forget while a checkpoint is open")
    await kit.resume(checkpoint)
    first = await kit.forget([rollout, kit.rollout("never-marked")])
    require(
        first.forgotten == 1, f"Forget of one marked rollout answered forgotten={first.forgotten}"
    )
    status = await kit.status()
    require(
        status.refused_rollouts == marked.refused_rollouts - 1,
        f"refused_rollouts {marked.refused_rollouts} -> {status.refused_rollouts} after forget",
    )
    second = await kit.forget([rollout])
    require(second.forgotten == 0, f"a second Forget answered forgotten={second.forgotten}")
    return "INVALID_PHASE while open; dropped one mark (forgotten=1), then 0 for a repeat"
