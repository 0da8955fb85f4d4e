"""The effects check: a resources server answers a keyed call once (docs/spec.md 6.12).

The kit names the workload's first recorded call (``calls``) with a key of the SDK's form (``fx:<rollout>:<turn>:<index>``)
and sends it again as a retry would; then, if it has a restore target left (a freshly
started process of the target on the same snapshot root, ``--restore-target``), it
snapshots the session, restores it there for the next attempt and re-sends the call as a
continued attempt would. Each time the reply must be the recorded one; the same key with other
arguments must be refused with ``INVALID_ARGUMENT`` and ``divergence`` = ``arguments``.

The kit sees replies only: a server that runs the tool again and happens to answer the
same is caught by the refusal it owes the diverging call, not by the reply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import resources_service_pb2, types_pb2

from ._kit import HOLD_LEASE_S, CheckFailed, CheckSkipped, Kit, episode, require, struct
from ._rules import error_problems, phase_name
from ._wire import Refused, Target

# The argument the kit adds to make the same key name another call.
_DIVERGING_ARGUMENT = "turnpoint_conformance_divergence"


def _key(rollout_id: str) -> str:
    return f"fx:{rollout_id}:0:0"


async def _call(
    kit: Kit,
    target: Target,
    e: types_pb2.EpisodeId,
    key: str,
    arguments: Mapping[str, Any],
) -> dict[str, Any]:
    tool = kit.workload.calls[0][0]
    response = await target.call(
        target.resources.Call,
        resources_service_pb2.CallRequest(
            request_id=key, episode=e, tool=tool, arguments=struct(arguments)
        ),
        name="Call",
        timeout_s=kit.episode_bound_s,
    )
    return json_format.MessageToDict(response.output)


async def _diverging_is_refused(
    kit: Kit, target: Target, e: types_pb2.EpisodeId, key: str, where: str
) -> None:
    other = {**kit.workload.calls[0][1], _DIVERGING_ARGUMENT: 1}
    try:
        await _call(kit, target, e, key, other)
    except Refused as refusal:
        problems = error_problems(refusal.error, "INVALID_ARGUMENT", ("request_id", "divergence"))
        divergence = refusal.error.metadata.get("divergence")
        if not problems and divergence != "arguments":
            problems.append(f"divergence {divergence!r}, expected 'arguments'")
        require(not problems, f"{where}, the key {key} with other arguments: {'; '.join(problems)}")
        return
    raise CheckFailed(
        f"{where}, the key {key} re-sent with other arguments was answered (the tool ran "
        "again?), expected INVALID_ARGUMENT naming the divergence"
    )


async def check_effects(kit: Kit) -> str:
    """Section 6.12: a keyed Call retried with its key, and re-sent by the next attempt
    after a restore, returns the recorded reply; the key with other arguments is
    refused."""
    if not kit.hosts_resources:
        raise CheckSkipped("not a resources server")
    kit.need_task()
    if not kit.workload.calls:
        raise CheckSkipped(
            'no workload calls ({"calls": [{"tool": ..., "arguments": {...}}]}): the kit '
            "cannot invent a tool call this environment understands"
        )
    arguments = kit.workload.calls[0][1]
    rollout = kit.rollout("effects")
    first = episode(rollout, 0)
    key = _key(rollout)
    await kit.seed(first)
    recorded = await _call(kit, kit.target, first, key, arguments)
    retried = await _call(kit, kit.target, first, key, arguments)
    require(
        retried == recorded,
        f"the retry of {key} answered {retried}, not the recorded reply {recorded}",
    )
    await _diverging_is_refused(kit, kit.target, first, key, "on a retry")
    fresh = kit.take_restore_target("effects")
    if fresh is None:
        missing = kit.restore_target_missing()
        kit.notes.append(f"effects: the re-send after a restore was not tried ({missing})")
        return (
            "a retried key got its recorded reply, other arguments were refused; not tried: "
            f"after a restore ({missing})"
        )
    checkpoint = kit.checkpoint_id()
    prepared = await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    require(
        prepared.phase == types_pb2.PHASE_PREPARED,
        f"Prepare with a recorded call: {phase_name(prepared.phase)}, expected PREPARED",
    )
    committed = await kit.commit(checkpoint, checkpoint, [first])
    await kit.resume(checkpoint)
    entry = pb.ManifestEntry(manifest=committed.manifest, artifacts=list(committed.artifacts))
    await fresh.discover()
    restore_id = fresh.checkpoint_id()
    restored = await fresh.restore(restore_id, checkpoint, entry, [first])
    require(
        len(restored.installed) == 1,
        f"the fresh target installed {len(restored.installed)} of the snapshot's 1 session",
    )
    await fresh.resume(restore_id)
    continued = episode(rollout, 1)
    try:
        again = await _call(kit, fresh.target, continued, key, arguments)
        require(
            again == recorded,
            f"after the restore, {key} re-sent by attempt 1 answered {again}, not the "
            f"recorded reply {recorded}",
        )
        await _diverging_is_refused(kit, fresh.target, continued, key, "after the restore")
    finally:
        with contextlib.suppress(Refused):
            await fresh.close_session(continued)
        await fresh.settle()
    return (
        "a retried key and one re-sent by the next attempt after a restore got the "
        "recorded reply; other arguments were refused"
    )
