"""The sandbox check: a resources server whose sessions are sandboxes (docs/spec.md 5.7).

Such a server exports each session as ``{"sandbox": {"store", "handle"}, "data"}``
(section 5.7.5 item 2): that exported state is how the kit knows it is one, so the check
needs the snapshot root it shares with the target (``--snapshot-root``) to read it, and
it restores into the running target (``RestoreRunning``, section 4.16), since every case
but one must fail and a participant takes one ordinary restore only.

The kit seeds one pair of sessions per case and commits them all in one checkpoint;
each handle must name its rollout's sandbox. Then, each case restoring its own pair:

- ``restored``: the checkpoint itself: both sessions installed as attempt N+1, the old
  attempt refused, and the sandbox, exported again, at a later generation;
- ``missing`` / ``stale`` / ``duplicate`` / ``expired``: a copy of the checkpoint whose
  second session of the pair (in file order, so that the first is restored before it
  fails) names a snapshot the store lacks, a tree digest its record does not hold, the
  first session's handle (one sandbox restored twice under one attempt), or a record
  the kit aged past its retention. Each is refused with its typed error (section
  5.7.1 item 6), and nothing of the pair is installed: the participant stays idle and
  neither session answers as attempt N+1 (a partial restore activates nothing).

Ageing a record means writing one into the provider's store, which the kit can do only
for the local reference provider's layout (``snapshots/<id>.json`` under the store);
for another provider the expired case says it was not tried.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

from ._kit import HOLD_LEASE_S, CheckFailed, CheckSkipped, Kit, episode, require, require_idle, show
from ._snapshot_copies import Records, altered_copy, read_records
from ._wire import Refused

# Section 5.7.2 item 1: every field of a version-1 handle, and no other.
_HANDLE_FIELDS: Final = frozenset(
    {
        "handle_version",
        "snapshot_id",
        "provider",
        "provider_version",
        "sandbox_id",
        "generation",
        "base_digest",
        "tree_digest",
        "mounts",
        "processes",
        "restart_commands",
        "expires_at",
    }
)
# The local reference provider (section 5.7.4): the one whose store the kit can age.
_LOCAL_PROVIDER: Final = "turnpoint.local"
_CASES: Final = ("restored", "missing", "stale", "duplicate", "expired")


@dataclass(frozen=True)
class _Refusal:
    """What a failing case must be refused with (section 5.7.1 item 6)."""

    reason: str
    keys: tuple[str, ...]
    field: tuple[str, str] | None = None  # a metadata key and the value it must hold


_REFUSALS: Final[Mapping[str, _Refusal]] = {
    "missing": _Refusal("NOT_FOUND", ("snapshot",)),
    "stale": _Refusal("STALE_CHECKPOINT", ("snapshot", "field"), ("field", "tree_digest")),
    "duplicate": _Refusal("STALE_ATTEMPT", ("sandbox", "attempt")),
    # expired_at too, unless the server's prune collected the aged record first (below).
    "expired": _Refusal("NOT_FOUND", ("snapshot",)),
}


def _handle(record: Mapping[str, Any]) -> dict[str, Any] | None:
    payload = record.get("payload")
    sandbox = payload.get("sandbox") if isinstance(payload, dict) else None
    handle = sandbox.get("handle") if isinstance(sandbox, dict) else None
    return handle if isinstance(handle, dict) else None


def _check_handle(record: Mapping[str, Any], handle: Mapping[str, Any]) -> None:
    who = show(types_pb2.EpisodeId(**record["episode"]))
    require(
        set(handle) == _HANDLE_FIELDS and handle["handle_version"] == 1,
        f"{who}: its handle's fields are {sorted(handle)}, expected exactly the version-1 "
        f"fields {sorted(_HANDLE_FIELDS)} (section 5.7.2 item 1)",
    )
    require(
        handle["sandbox_id"] == record["episode"]["rollout_id"],
        f"{who}: its handle names sandbox {handle['sandbox_id']!r}, not its rollout's "
        "(section 5.7.5 item 1: one sandbox per rollout)",
    )
    require(
        handle["processes"] == "restart_only",
        f"{who}: its handle's processes is {handle['processes']!r}; version 1 knows only "
        "'restart_only' (section 5.7.2 item 2)",
    )


def _age(handle: Mapping[str, Any], store: object) -> str | None:
    """A copy of ``handle``'s record in the local store, its retention lapsed; its id,
    or None when the store is not one the kit can write such a record into."""
    if handle["provider"] != _LOCAL_PROVIDER or not isinstance(store, str):
        return None
    records = Path(store) / "snapshots"
    source = records / f"{handle['snapshot_id']}.json"
    if not source.is_file():
        return None
    aged_id = f"{handle['snapshot_id']}.expired"
    aged = {**json.loads(source.read_bytes()), "snapshot_id": aged_id, "expires_at": 0.0}
    (records / f"{aged_id}.json").write_text(json.dumps(aged, indent=2, sort_keys=True))
    return aged_id


def _alter(case: str, first: Mapping[str, Any], second: dict[str, Any], aged: str) -> None:
    """Change the second record of ``case``'s pair as the case says (``first`` stays)."""
    sandbox = second["payload"]["sandbox"]
    handle = sandbox["handle"]
    if case == "missing":
        handle["snapshot_id"] = f"{handle['snapshot_id']}.missing"
    elif case == "stale":
        handle["tree_digest"] = hashlib.sha256(b"not this tree").hexdigest()
    elif case == "duplicate":
        sandbox["handle"] = json.loads(json.dumps(_handle(first)))
    else:
        handle["snapshot_id"] = aged


async def _not_installed(kit: Kit, e: types_pb2.EpisodeId, case: str) -> None:
    try:
        await kit.verify(e)
    except Refused:
        return
    raise CheckFailed(
        f"{case}: the refused restore left {show(e)} answering: a partial restore of several "
        "sandboxes must activate nothing (section 5.7.1 item 5)"
    )


async def check_sandboxes(kit: Kit) -> str:
    """Section 5.7: sandbox sessions restore into a new generation with the old attempt
    refused; a missing, stale, duplicate or expired handle is refused with its typed
    error, and a restore of several sandboxes that fails activates none of them."""
    if not kit.hosts_resources:
        raise CheckSkipped("not a resources server")
    task = kit.need_task()
    if kit.description.recovery_mode != types_pb2.RECOVERY_MODE_EXPORTED:
        raise CheckSkipped(
            "the target does not export sessions: a sandbox handle travels only in an "
            "exported session state (section 5.7.5 item 2)"
        )
    if kit.snapshot_root is None:
        raise CheckSkipped(
            "no --snapshot-root: the kit reads the exported sandbox handles there and "
            "writes altered copies of them"
        )
    if pb.CAPABILITY_RESTORE_RUNNING not in (await kit.describe()).capabilities:
        raise CheckSkipped(
            "the target lists no CAPABILITY_RESTORE_RUNNING: the kit restores each case "
            "into the running target (section 4.16)"
        )
    pairs = {
        case: (episode(kit.rollout(f"sbx-{case}-a")), episode(kit.rollout(f"sbx-{case}-b")))
        for case in _CASES
    }
    sessions = [e for pair in pairs.values() for e in pair]
    for e in sessions:
        await kit.seed(e, task=task)
        for tool, arguments in kit.workload.calls:
            await kit.call(e, tool, arguments)
    checkpoint = kit.checkpoint_id()
    await kit.prepare(checkpoint, lease_s=HOLD_LEASE_S)
    committed = await kit.commit(checkpoint, checkpoint, sessions)
    await kit.resume(checkpoint)
    kit.notes.append(f"a committed snapshot directory {checkpoint}/{kit.instance}/ under its root")
    entry = pb.ManifestEntry(manifest=committed.manifest, artifacts=list(committed.artifacts))
    records = read_records(kit.snapshot_root, checkpoint, kit.instance, entry)
    handles = [_handle(record) for record in records]
    if all(handle is None for handle in handles):
        raise CheckSkipped(
            "its exported session states hold no sandbox handle (section 5.7.5 item 2): "
            "not a server on a sandbox provider"
        )
    require(
        len(records) == len(sessions),
        f"the commit of {len(sessions)} sandbox sessions wrote {len(records)} record(s)",
    )
    for record, handle in zip(records, handles, strict=True):
        require(handle is not None, f"{record['episode']}: an exported state with no handle")
        assert handle is not None
        _check_handle(record, handle)
    by_rollout = {record["episode"]["rollout_id"]: index for index, record in enumerate(records)}

    untried: list[str] = []
    altered_pairs: dict[str, tuple[int, int]] = {}
    aged = ""
    aged_record: Path | None = None
    for case in _REFUSALS:
        first, second = sorted(by_rollout[e.rollout_id] for e in pairs[case])
        if case == "expired":
            handle = handles[second]
            assert handle is not None
            made = _age(handle, records[second]["payload"]["sandbox"].get("store"))
            if made is None:
                untried.append(
                    f"expired (provider {handle['provider']!r}: the kit can age a record "
                    f"only in the store of {_LOCAL_PROVIDER})"
                )
                continue
            aged = made
            aged_record = Path(records[second]["payload"]["sandbox"]["store"]) / "snapshots"
            aged_record /= f"{aged}.json"
            kit.notes.append(f"a snapshot record {aged} past its retention in the sandbox store")
        altered_pairs[case] = (first, second)

    def alter_all(records: Records) -> None:
        for case, (first, second) in altered_pairs.items():
            _alter(case, records[first], records[second], aged)

    tried = list(altered_pairs)
    copy = kit.checkpoint_id()
    altered = altered_copy(kit.snapshot_root, checkpoint, copy, kit.instance, entry, alter_all)
    kit.notes.append(f"an altered copy of the snapshot, {copy}/{kit.instance}/")
    for case in tried:
        refusal = _REFUSALS[case]
        pair = pairs[case]
        what = f"{case}: RestoreRunning of two sandbox sessions, the second's handle {case}"
        error = await kit.refused(
            kit.restore_running(kit.checkpoint_id(), copy, altered, pair),
            refusal.reason,
            what,
            keys=refusal.keys,
        )
        if refusal.field is not None:
            key, value = refusal.field
            got = error.metadata.get(key)
            require(got == value, f"{what}: metadata {key} {got!r}, expected {value!r}")
        if case == "expired" and "expired_at" not in error.metadata:
            # The server prunes lapsed records in the background after a checkpoint
            # (section 5.7.4): if that collected the aged record before the restore read
            # it, a plain NOT_FOUND is the right answer; else it must say when it lapsed.
            require(
                aged_record is not None and not aged_record.exists(),
                f"{what}: NOT_FOUND lacks metadata expired_at",
            )
        require_idle(await kit.status(), f"{case}: after the refused restore")
        for e in pair:
            await _not_installed(kit, episode(e.rollout_id, e.attempt + 1), case)

    restored_generation = await _restore_and_fence(kit, checkpoint, entry, pairs["restored"])
    old_generation = handles[by_rollout[pairs["restored"][0].rollout_id]]
    assert old_generation is not None
    require(
        restored_generation > old_generation["generation"],
        f"restored: the sandbox exported again is at generation {restored_generation}, not "
        f"past the snapshotted {old_generation['generation']} (section 5.7.1 item 2)",
    )
    detail = (
        f"{len(sessions)} sandbox handles exported; restored into generation "
        f"{restored_generation} (was {old_generation['generation']}) with the old attempt "
        f"refused; {', '.join(tried)} each refused with its typed error, installing nothing"
    )
    if untried:
        detail += f"; not tried: {'; '.join(untried)}"
    return detail


async def _restore_and_fence(
    kit: Kit,
    checkpoint: str,
    entry: pb.ManifestEntry,
    pair: tuple[types_pb2.EpisodeId, types_pb2.EpisodeId],
) -> int:
    """Restore ``pair`` from the checkpoint itself; the generation it is exported at next."""
    restore_id = kit.checkpoint_id()
    restored = await kit.restore_running(restore_id, checkpoint, entry, pair)
    nexts = [episode(e.rollout_id, e.attempt + 1) for e in pair]
    for e in nexts:
        kit.holds_session(e)
    require(
        {show(e) for e in restored.installed} == {show(e) for e in nexts},
        f"restored: installed {sorted(show(e) for e in restored.installed)}, expected "
        f"{sorted(show(e) for e in nexts)}",
    )
    await kit.resume(restore_id)
    await kit.refused(
        kit.verify(pair[0]),
        "STALE_ATTEMPT",
        f"restored: a call of the old attempt {show(pair[0])} after the restore",
    )
    for tool, arguments in kit.workload.calls[:1]:
        await kit.call(nexts[0], tool, arguments)
    again = kit.checkpoint_id()
    await kit.prepare(again, lease_s=HOLD_LEASE_S)
    committed = await kit.commit(again, again, nexts[:1])
    await kit.resume(again)
    assert kit.snapshot_root is not None
    refs = pb.ManifestEntry(manifest=committed.manifest, artifacts=list(committed.artifacts))
    (record,) = read_records(kit.snapshot_root, again, kit.instance, refs)
    handle = _handle(record)
    require(handle is not None, "restored: the restored session exported no sandbox handle")
    assert handle is not None
    generation = handle["generation"]
    require(isinstance(generation, int), f"restored: generation {generation!r}")
    return int(generation)
