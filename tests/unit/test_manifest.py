"""Snapshot manifest (strict, canonical) and its crash-safe publication."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.fsyncs import record_fsyncs
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.protocol import ArtifactRef, ParticipantKind
from turnpoint.trainer.advanced import ManifestError, SnapshotLayout, SnapshotManifest
from turnpoint.trainer.storage.layout import PublishStep, tree_digest
from turnpoint.trainer.storage.manifest import (
    ANCHOR_DIR,
    LATEST_NAME,
    MANIFEST_NAME,
    AnchorRef,
    ParticipantEntry,
    PlacedEpisode,
    TrainerRolloutState,
)

DIGEST = "ab" * 32
EP1 = EpisodeId("r1", 0)
EP2 = EpisodeId("r2", 3)
EP3 = EpisodeId("r3", 1)


def ckpt(sequence: int) -> str:
    return make_checkpoint_id("run", sequence)


def _write(path: Path, data: bytes) -> ArtifactRef:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return ArtifactRef(
        path="/".join(path.parts[-2:]),
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        record_count=data.count(b"\n"),
    )


def make_manifest(
    checkpoint_id: str = "run-000000000001",
    *,
    anchor_digest: str = DIGEST,
    agent_artifacts: tuple[ArtifactRef, ...] | None = None,
    agent_manifest: ArtifactRef | None = None,
    participants_reversed: bool = False,
) -> SnapshotManifest:
    agent = ParticipantEntry(
        instance="agent-0",
        kind=ParticipantKind.AGENT,
        incarnation="inc-1",
        artifacts=agent_artifacts
        if agent_artifacts is not None
        else (ArtifactRef("agent-0/records-1.jsonl", DIGEST, 10, 2),),
        manifest=agent_manifest or ArtifactRef("agent-0/MANIFEST.json", DIGEST, 5, 0),
        exported=(EP2, EP1),
    )
    model = ParticipantEntry(instance="policy-0", kind=ParticipantKind.MODEL)
    participants = (model, agent) if participants_reversed else (agent, model)
    return SnapshotManifest(
        checkpoint_id=checkpoint_id,
        step=12,
        created_at=1700000000.5,
        anchor=AnchorRef(sha256=anchor_digest),
        participants=participants,
        continued=(PlacedEpisode(EP1, "agent-0"), PlacedEpisode(EP2, "agent-0")),
        restarts=(PlacedEpisode(EP3, "agent-0"),),
        rollout_state=TrainerRolloutState(
            queue=({"rollout_id": "r0", "reward": 1.0, "tokens": [1, 2, 3]},),
            data_loader={"epoch": 1, "index": 40},
            attempts={"r1": 0, "r2": 3, "r3": 1, "r0": 0},
        ),
        extra={"note": "unit test"},
    )


# -- the manifest --------------------------------------------------------------------


def test_the_bytes_are_the_stdlibs_indented_json_of_the_dict() -> None:
    # docs/spec.md 8.6's canonical form, written without a dict per episode: the same
    # bytes as json.dumps of to_dict, with its lists of episodes full, one long, empty.
    full = make_manifest()
    one = dataclasses.replace(full, continued=full.continued[:1], restarts=())
    model_only = dataclasses.replace(
        full, participants=full.participants[1:], continued=(), restarts=()
    )
    for manifest in (full, one, model_only):
        expected = json.dumps(manifest.to_dict(), indent=2, sort_keys=True, ensure_ascii=True)
        assert manifest.to_json() == (expected + "\n").encode("ascii")


def test_round_trip_and_canonical_bytes() -> None:
    manifest = make_manifest()
    data = manifest.to_json()
    assert SnapshotManifest.from_json(data) == manifest
    assert SnapshotManifest.from_json(data).to_json() == data
    # The same content given in another order serialises to the same bytes.
    assert make_manifest(participants_reversed=True).to_json() == data
    assert json.loads(data)["schema_version"] == 1


def test_queries() -> None:
    manifest = make_manifest()
    assert manifest.sequence == 1
    assert manifest.instances == {"agent-0", "policy-0"}
    assert manifest.participant("agent-0").exported == (EP1, EP2)
    assert manifest.continued_by_instance() == {"agent-0": (EP1, EP2), "policy-0": ()}
    with pytest.raises(KeyError):
        manifest.participant("nobody")


def test_validate_topology() -> None:
    manifest = make_manifest()
    manifest.validate_topology(["policy-0", "agent-0"])
    with pytest.raises(ManifestError) as caught:
        manifest.validate_topology(["agent-0", "agent-1"])
    assert "saved but not live: policy-0" in str(caught.value)
    assert "live but not saved: agent-1" in str(caught.value)
    assert caught.value.reason is Reason.INVALID_CHECKPOINT_STATE
    assert caught.value.checkpoint_id == "run-000000000001"


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Mutation:
    def mutate(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _delete(path: str) -> Mutation:
    def mutate(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[last]

    return mutate


def _append(path: str, value: object) -> Mutation:
    def mutate(raw: dict[str, Any]) -> None:
        node: Any = raw
        for part in path.split("."):
            node = node[int(part)] if part.isdigit() else node[part]
        node.append(value)

    return mutate


def _both(first: Mutation, second: Mutation) -> Mutation:
    def mutate(raw: dict[str, Any]) -> None:
        first(raw)
        second(raw)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_set("surprise", 1), r"manifest: unknown field\(s\): surprise"),
        (_set("anchor.extra_field", 1), r"anchor: unknown field\(s\): extra_field"),
        (_set("participants.0.artifacts.0.mtime", 1), r"unknown field\(s\): mtime"),
        (_delete("step"), r"manifest\.step: missing field"),
        (_set("schema_version", 2), "unsupported schema version 2"),
        (_set("schema_version", True), "unsupported schema version True"),
        (_set("schema_version", "1"), "unsupported schema version '1'"),
        (_set("anchor.sha256", "ab" * 31), "must be 64 lowercase hex characters"),
        (_set("anchor.sha256", "AB" * 32), "must be 64 lowercase hex characters"),
        (_set("participants.0.artifacts.0.sha256", "zz" * 32), "64 lowercase hex"),
        (_set("checkpoint_id", "../evil-1"), "checkpoint_id"),
        (_set("checkpoint_id", "no-sequence"), "must end in '-<sequence>'"),
        (_set("participants.0.instance", "bad/name"), "participants"),
        (_set("continued.0.rollout_id", ""), "must not be empty"),
        (_set("continued.0.attempt", -1), "must be >= 0"),
        (_set("step", True), "step: must be an integer >= 0"),
        (_set("participants.0.artifacts.0.size_bytes", -5), "must be an integer >= 0"),
        (_set("participants.0.kind", "ROBOT"), "unknown kind 'ROBOT'"),
        (_set("participants.0.artifacts.0.path", "agent-0/../x"), "every component"),
        (_set("participants.0.artifacts.0.path", "/abs/x"), "every component"),
        (_set("participants.0.artifacts.0.path", "policy-0/x"), "must lie under 'agent-0/'"),
        (
            _append("continued", {"rollout_id": "r1", "attempt": 0, "instance": "agent-0"}),
            "duplicate episode",
        ),
        (
            _append("restarts", {"rollout_id": "r1", "attempt": 0, "instance": "agent-0"}),
            "duplicate episode",
        ),
        (
            _append("participants.0.exported", {"rollout_id": "r1", "attempt": 0}),
            "duplicate episode r1#0",
        ),
        (
            _both(
                _append("participants.1.exported", {"rollout_id": "r1", "attempt": 0}),
                _set(
                    "participants.1.manifest",
                    {"path": "policy-0/M", "sha256": DIGEST, "size_bytes": 1, "record_count": 0},
                ),
            ),
            "exported by both",
        ),
        (_set("continued.0.instance", "policy-0"), "was not exported by 'policy-0'"),
        (_set("continued.0.instance", "agent-9"), "unknown instance 'agent-9'"),
        (_set("rollout_state.attempts.r1", 5), "disagrees with the attempt ledger"),
        (_delete("rollout_state.attempts.r3"), "disagrees with the attempt ledger"),
        (_set("participants.0.manifest", None), "manifest: is required"),
        (_set("rollout_state.queue", [1]), r"queue\[0\]: must be a JSON object"),
        (_set("created_at", "yesterday"), "created_at: must be a number"),
        (_set("extra", []), "extra: must be an object"),
    ],
)
def test_strict_parsing(mutate: Mutation, expected: str) -> None:
    raw = json.loads(make_manifest().to_json())
    mutate(raw)
    with pytest.raises(ManifestError, match=expected):
        SnapshotManifest.from_json(json.dumps(raw))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"schema_version": 1, "schema_version": 1}', "appears twice"),
        ('{"created_at": NaN}', "NaN is not a JSON number"),
        ("{", "not valid JSON"),
        ("[]", "must be an object"),
    ],
)
def test_malformed_json(text: str, expected: str) -> None:
    with pytest.raises(ManifestError, match=expected):
        SnapshotManifest.from_json(text)


def test_not_utf8() -> None:
    with pytest.raises(ManifestError, match="not UTF-8"):
        SnapshotManifest.from_json(b"\xff\xfe")


def test_rollout_state_copies_plain_json_and_names_what_is_not() -> None:
    # The copy is made by the C encoder when it can; what that would accept silently (a
    # tuple, a key that is not a string) or reject (NaN) is still copied or named alike.
    loader = {"at": [1, 2.5, None, True, "x"], "deep": {"a": [{"b": -0.0}]}}
    state = TrainerRolloutState(data_loader=loader, queue=({"n": (1, 2)},))
    assert state.data_loader == loader and state.data_loader is not loader
    assert state.queue == ({"n": [1, 2]},)
    loader["deep"]["a"][0]["b"] = 7  # type: ignore[index]
    assert state.data_loader["deep"]["a"][0]["b"] == -0.0  # type: ignore[index,call-overload]
    with pytest.raises(ManifestError, match=r"data_loader.*keys must be strings"):
        TrainerRolloutState(data_loader={"a": {1: "one"}})
    with pytest.raises(ManifestError, match=r"queue\[1\].x.*finite number"):
        TrainerRolloutState(queue=({"x": 1}, {"x": float("nan")}))
    with pytest.raises(ManifestError, match=r"queue\[0\].*must be a JSON object"):
        TrainerRolloutState(queue=([1],))  # type: ignore[arg-type]


def test_construction_validates_too() -> None:
    with pytest.raises(ManifestError, match="must be finite"):
        SnapshotManifest(
            checkpoint_id=ckpt(1),
            step=0,
            created_at=float("nan"),
            anchor=AnchorRef(sha256=DIGEST),
            participants=(),
        )
    with pytest.raises(ManifestError, match="finite number"):
        TrainerRolloutState(data_loader={"x": float("inf")})
    with pytest.raises(ManifestError, match="reserved"):
        SnapshotManifest(
            checkpoint_id=ckpt(1),
            step=0,
            created_at=0.0,
            anchor=AnchorRef(sha256=DIGEST),
            participants=(ParticipantEntry("trainer", ParticipantKind.AGENT),),
        )


def test_manifest_is_isolated_from_caller_data() -> None:
    queue_item: dict[str, Any] = {"rollout_id": "r0", "tokens": [1]}
    state = TrainerRolloutState(queue=(queue_item,), attempts={"r0": 0})
    queue_item["tokens"].append(2)
    assert state.queue[0] == {"rollout_id": "r0", "tokens": [1]}


def test_manifest_error_pickles() -> None:
    error = ManifestError("boom", checkpoint_id=ckpt(3), field="anchor")
    copy_ = pickle.loads(pickle.dumps(error))
    assert (copy_.message, copy_.checkpoint_id, copy_.field) == ("boom", ckpt(3), "anchor")
    assert copy_.metadata == {"checkpoint_id": ckpt(3), "field": "anchor"}


# -- tree digest ---------------------------------------------------------------------


def test_tree_digest_covers_bytes_and_names(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"one")
    (tmp_path / "sub" / "b.bin").write_bytes(b"two")
    first = tree_digest(tmp_path)
    assert tree_digest(tmp_path) == first
    (tmp_path / "sub" / "b.bin").write_bytes(b"twO")
    changed = tree_digest(tmp_path)
    assert changed != first
    (tmp_path / "sub" / "b.bin").rename(tmp_path / "sub" / "c.bin")
    assert tree_digest(tmp_path) not in {first, changed}
    os.symlink(tmp_path / "a.bin", tmp_path / "link")
    with pytest.raises(ManifestError, match="not a regular file"):
        tree_digest(tmp_path)
    with pytest.raises(ManifestError, match="no such directory"):
        tree_digest(tmp_path / "absent")


# -- the layout ----------------------------------------------------------------------


def prepare_snapshot(layout: SnapshotLayout, sequence: int) -> SnapshotManifest:
    """What a coordinator does before publish: begin, anchor, participant files."""
    checkpoint_id = ckpt(sequence)
    snapshot = layout.begin(checkpoint_id)
    anchor = snapshot / ANCHOR_DIR
    anchor.mkdir(parents=True)
    (anchor / "weights.bin").write_bytes(b"w" * 100 + bytes([sequence % 256]))
    records = _write(snapshot / "agent-0" / "records-1.jsonl", b'{"a": 1}\n{"b": 2}\n')
    own = _write(snapshot / "agent-0" / "MANIFEST.json", b"{}")
    return make_manifest(
        checkpoint_id,
        anchor_digest=tree_digest(anchor),
        agent_artifacts=(records,),
        agent_manifest=own,
    )


def publish(layout: SnapshotLayout, sequence: int) -> SnapshotManifest:
    manifest = prepare_snapshot(layout, sequence)
    layout.publish(layout.path(manifest.checkpoint_id), manifest, verify_artifacts=True)
    return manifest


def test_publish_then_load(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    assert layout.latest() is None
    assert layout.list_published() == []
    manifest = publish(layout, 1)
    assert layout.latest() == ckpt(1)
    assert layout.list_published() == [ckpt(1)]
    assert layout.load(ckpt(1)) == manifest
    assert (tmp_path / ckpt(1) / MANIFEST_NAME).read_bytes() == manifest.to_json()
    assert (tmp_path / LATEST_NAME).read_text() == ckpt(1) + "\n"
    assert layout.in_progress is None
    # No temporary file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_NAME, ckpt(1)]


def test_publish_syncs_what_no_writer_made_durable_once_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spec 8.9: participants' files are durable from their commit answers and the
    anchor from its source (8.8); publication syncs the rest of the trainer's tree, the
    manifest, the snapshot directory, LATEST and the root, each once."""
    layout = SnapshotLayout(tmp_path)
    manifest = prepare_snapshot(layout, 1)
    snapshot = layout.path(manifest.checkpoint_id)
    (snapshot / "trainer" / "notes.txt").write_bytes(b"the trainer's own extra file")
    synced = record_fsyncs(monkeypatch)
    layout.publish(snapshot, manifest)
    assert not [path for path in synced if "/anchor" in path or "/agent-0" in path]
    trainer = [path for path in synced if path.startswith(str(snapshot / "trainer"))]
    assert sorted(trainer) == [str(snapshot / "trainer"), str(snapshot / "trainer" / "notes.txt")]
    rest = [Path(path) for path in synced if path not in trainer]
    # The manifest and LATEST are synced under their temporary names, before the link
    # and the rename that give them their final ones.
    assert [path.name.split("-")[0] for path in rest[:1]] == [".MANIFEST"]
    assert rest[1:] == [snapshot, rest[2], tmp_path] and rest[2].name.startswith(".LATEST-")


def test_list_published_newest_first_by_sequence(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    for sequence in (1, 2, 10):
        publish(layout, sequence)
    (tmp_path / "notes").mkdir()
    (tmp_path / "run-000000000099").mkdir()  # unpublished: no manifest
    assert layout.list_published() == [ckpt(10), ckpt(2), ckpt(1)]
    assert layout.latest() == ckpt(10)


def test_begin_refuses_old_or_published_ids(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    publish(layout, 5)
    with pytest.raises(ManifestError, match="already published"):
        layout.begin(ckpt(5))
    with pytest.raises(ManifestError, match="sequences must increase"):
        layout.begin(ckpt(4))
    with pytest.raises(ManifestError, match="must end in '-<sequence>'"):
        layout.begin("nosequence")
    with pytest.raises(ManifestError, match="checkpoint_id"):
        layout.begin("../run-7")


def test_begin_wipes_an_aborted_attempt_at_the_same_id(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    snapshot = layout.begin(ckpt(1))
    (snapshot / "agent-0").mkdir()
    (snapshot / "agent-0" / "stale.jsonl").write_text("old cut")
    assert layout.begin(ckpt(1)) == snapshot
    assert not (snapshot / "agent-0").exists()
    assert (snapshot / "trainer").is_dir()


@pytest.mark.parametrize(
    ("spoil", "expected"),
    [
        (lambda snap: (snap / "agent-0" / "records-1.jsonl").unlink(), "is missing"),
        (lambda snap: (snap / "agent-0" / "records-1.jsonl").write_text("x"), "has 1 bytes"),
        (lambda snap: (snap / ANCHOR_DIR / "weights.bin").write_text("z"), "anchor digest"),
        (lambda snap: (snap / ANCHOR_DIR / "extra.bin").write_text("z"), "anchor digest"),
    ],
)
def test_publish_refuses_bytes_that_are_not_there(
    tmp_path: Path, spoil: Callable[[Path], object], expected: str
) -> None:
    layout = SnapshotLayout(tmp_path)
    publish(layout, 1)
    manifest = prepare_snapshot(layout, 2)
    spoil(layout.path(ckpt(2)))
    with pytest.raises(ManifestError, match=expected):
        layout.publish(layout.path(ckpt(2)), manifest)
    assert not layout.is_published(ckpt(2))
    assert layout.latest() == ckpt(1)


def test_publish_checks_digests_when_asked(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    manifest = prepare_snapshot(layout, 1)
    records = layout.path(ckpt(1)) / "agent-0" / "records-1.jsonl"
    records.write_bytes(records.read_bytes().replace(b"a", b"c"))  # same size
    with pytest.raises(ManifestError, match="does not match its sha256"):
        layout.publish(layout.path(ckpt(1)), manifest, verify_artifacts=True)


def test_publish_refuses_wrong_directory_and_twice(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    manifest = prepare_snapshot(layout, 1)
    with pytest.raises(ManifestError, match="cannot be published in"):
        layout.publish(tmp_path / "elsewhere", manifest)
    layout.publish(layout.path(ckpt(1)), manifest)
    with pytest.raises(ManifestError, match="already published"):
        layout.publish(layout.path(ckpt(1)), manifest)


def test_load_rejects_tampering(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    publish(layout, 1)
    with pytest.raises(ManifestError, match="not published"):
        layout.load(ckpt(2))
    # Anchor bytes changed after publication.
    (layout.anchor_dir(ckpt(1)) / "weights.bin").write_bytes(b"corrupt")
    with pytest.raises(ManifestError, match="does not match its digest"):
        layout.load(ckpt(1))
    # A manifest copied under another id.
    other = tmp_path / ckpt(7)
    other.mkdir()
    (other / MANIFEST_NAME).write_bytes((tmp_path / ckpt(1) / MANIFEST_NAME).read_bytes())
    with pytest.raises(ManifestError, match="describes 'run-000000000001'"):
        layout.load(ckpt(7))


def test_latest_reports_a_dangling_pointer(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    (tmp_path / LATEST_NAME).write_text(ckpt(3) + "\n")
    with pytest.raises(ManifestError, match="not a published snapshot"):
        layout.latest()
    (tmp_path / LATEST_NAME).write_text("garbage!\n")
    with pytest.raises(ManifestError, match="does not hold a checkpoint id"):
        layout.latest()
    # Publishing repairs it.
    publish(layout, 1)
    assert layout.latest() == ckpt(1)


def test_retain_keeps_newest_and_latest(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    for sequence in range(1, 6):
        publish(layout, sequence)
    # LATEST pointing at an older snapshot (a crash before it moved, or an operator).
    (tmp_path / LATEST_NAME).write_text(ckpt(2) + "\n")
    deleted = layout.retain(2)
    assert deleted == [ckpt(3), ckpt(1)]
    assert layout.list_published() == [ckpt(5), ckpt(4), ckpt(2)]
    assert not (tmp_path / ckpt(1)).exists()
    assert layout.retain(2) == []
    with pytest.raises(ValueError, match="keep must be"):
        layout.retain(0)


def test_clean_partial_spares_the_snapshot_being_written(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    publish(layout, 1)
    leftover_old = tmp_path / "run-000000000000"
    leftover_old.mkdir()
    leftover_new = tmp_path / "run-000000000005"  # a crashed coordinator's attempt
    leftover_new.mkdir()
    (tmp_path / ".LATEST-deadbeef.tmp").write_text("x")
    (tmp_path / ".MANIFEST-run-000000000005-deadbeef.tmp").write_text("x")
    (tmp_path / "operator-notes").mkdir()
    (tmp_path / "README").write_text("not ours")
    layout.begin(ckpt(6))
    removed = layout.clean_partial()
    assert sorted(removed) == sorted(
        [
            ".LATEST-deadbeef.tmp",
            ".MANIFEST-run-000000000005-deadbeef.tmp",
            "run-000000000000",
            "run-000000000005",
        ]
    )
    assert (tmp_path / ckpt(6)).is_dir()
    assert (tmp_path / "operator-notes").is_dir()
    assert (tmp_path / "README").exists()
    assert layout.list_published() == [ckpt(1)]
    # A fresh layout (after a restart) knows of nothing in progress.
    assert SnapshotLayout(tmp_path).clean_partial() == [ckpt(6)]


def test_discard(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    publish(layout, 1)
    layout.begin(ckpt(2))
    assert layout.discard(ckpt(2)) is True
    assert layout.in_progress is None
    assert layout.discard(ckpt(2)) is False
    with pytest.raises(ManifestError, match="is published"):
        layout.discard(ckpt(1))


class _Crash(Exception):
    """Stands for the process dying: nothing after it runs, no cleanup."""


@pytest.mark.parametrize("crash_after", list(PublishStep))
def test_crash_at_any_step_leaves_latest_complete_or_previous(
    tmp_path: Path, crash_after: PublishStep
) -> None:
    publish(SnapshotLayout(tmp_path), 1)

    def fail(step: PublishStep) -> None:
        if step is crash_after:
            raise _Crash(step.value)

    crashing = SnapshotLayout(tmp_path, after_step=fail)
    manifest = prepare_snapshot(crashing, 2)
    with pytest.raises(_Crash):
        crashing.publish(crashing.path(ckpt(2)), manifest)

    # The restarted coordinator sees a complete snapshot through LATEST: the new one
    # once its manifest is linked, the previous one before.
    restarted = SnapshotLayout(tmp_path)
    latest = restarted.latest()
    newly_published = list(PublishStep).index(crash_after) >= list(PublishStep).index(
        PublishStep.MANIFEST_LINKED
    )
    assert restarted.is_published(ckpt(2)) == newly_published
    expected_latest = ckpt(2) if crash_after is PublishStep.LATEST_MOVED else ckpt(1)
    assert latest == expected_latest
    assert restarted.load(latest) is not None
    for checkpoint_id in restarted.list_published():
        restarted.load(checkpoint_id)

    restarted.clean_partial()
    names = {path.name for path in tmp_path.iterdir()}
    assert not any(name.endswith(".tmp") for name in names)
    if newly_published:
        assert restarted.list_published() == [ckpt(2), ckpt(1)]
    else:
        assert ckpt(2) not in names  # the partial is gone
    # Work goes on: the next snapshot publishes and LATEST moves forward.
    publish(restarted, 3)
    assert restarted.latest() == ckpt(3)


def test_crash_during_retention_leaves_no_half_snapshot(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path)
    for sequence in (1, 2, 3):
        publish(layout, sequence)
    # What retain() leaves if it dies right after unpublishing ckpt(1).
    (tmp_path / ckpt(1) / MANIFEST_NAME).unlink()
    assert layout.list_published() == [ckpt(3), ckpt(2)]
    assert layout.clean_partial() == [ckpt(1)]


def test_layout_blocks_no_unrelated_names(tmp_path: Path) -> None:
    layout = SnapshotLayout(tmp_path / "does-not-exist-yet")
    assert layout.list_published() == []
    assert layout.clean_partial() == []
    assert layout.latest() is None
    publish(layout, 1)
    assert layout.latest() == ckpt(1)


def test_manifest_dict_copy_is_independent() -> None:
    manifest = make_manifest()
    raw = manifest.to_dict()
    mutated = copy.deepcopy(raw)
    assert isinstance(mutated["extra"], dict)
    mutated["extra"]["note"] = "changed"
    assert manifest.extra["note"] == "unit test"


# -- unfinished rollouts in the trainer's rollout state -------------------------------


def _in_flight(rollout_id: str, attempt: int, **extra: object) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "attempt": attempt, "task": {"prompt": "p"}, **extra}


def _state_with_in_flight(*items: dict[str, Any]) -> TrainerRolloutState:
    # The ledger of make_manifest() (its continued and restarted episodes) plus r9.
    attempts = {"r0": 0, "r1": 0, "r2": 3, "r3": 1, "r9": 4}
    return TrainerRolloutState(attempts=attempts, in_flight=items)


def test_in_flight_round_trips_sorted_by_rollout() -> None:
    state = _state_with_in_flight(_in_flight("r9", 4, accepted=False), _in_flight("r1", 0))
    assert [item["rollout_id"] for item in state.in_flight] == ["r1", "r9"]
    manifest = dataclasses.replace(make_manifest(), rollout_state=state)
    assert SnapshotManifest.from_json(manifest.to_json()) == manifest
    assert json.loads(manifest.to_json())["rollout_state"]["in_flight"] == [
        _in_flight("r1", 0),
        _in_flight("r9", 4, accepted=False),
    ]
    # The same unfinished rollouts in another order give the same bytes.
    reordered = _state_with_in_flight(_in_flight("r1", 0), _in_flight("r9", 4, accepted=False))
    assert reordered == state
    assert dataclasses.replace(manifest, rollout_state=reordered).to_json() == manifest.to_json()


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_delete("rollout_state.in_flight"), r"rollout_state\.in_flight: missing field"),
        (_set("rollout_state.in_flight", {}), r"in_flight: must be a list"),
        (_set("rollout_state.in_flight", [1]), r"in_flight\[0\]: must be a JSON object"),
        (_set("rollout_state.in_flight", [{"attempt": 0}]), "must name its rollout_id"),
        (_set("rollout_state.in_flight", [{"rollout_id": "r1"}]), "must name its rollout_id"),
        (_set("rollout_state.in_flight", [_in_flight("../r1", 0)]), "rollout_id"),
        (_set("rollout_state.in_flight", [_in_flight("r1", -1)]), "must be >= 0"),
        (
            _set("rollout_state.in_flight", [_in_flight("r1", 2)]),
            r"r1#2 disagrees with the attempt ledger \('r1' -> 0\)",
        ),
        (
            _set("rollout_state.in_flight", [_in_flight("r7", 0)]),
            r"disagrees with the attempt ledger \('r7' -> None\)",
        ),
        (
            _set("rollout_state.in_flight", [_in_flight("r1", 0), _in_flight("r1", 0)]),
            "duplicate rollout 'r1'",
        ),
        (
            _set("rollout_state.in_flight", [_in_flight("r1", 0, score=float("nan"))]),
            "finite number",
        ),
        (_set("rollout_state.surprise", []), r"rollout_state: unknown field\(s\): surprise"),
    ],
)
def test_in_flight_parses_strictly(mutate: Mutation, expected: str) -> None:
    raw = json.loads(make_manifest().to_json())
    mutate(raw)
    with pytest.raises(ManifestError, match=expected):
        SnapshotManifest.from_dict(raw)


def test_in_flight_is_validated_on_construction_and_copied() -> None:
    with pytest.raises(ManifestError, match="disagrees with the attempt ledger"):
        TrainerRolloutState(attempts={"r1": 0}, in_flight=(_in_flight("r1", 1),))
    with pytest.raises(ManifestError, match="must be a list"):
        TrainerRolloutState(in_flight="r1")  # type: ignore[arg-type]
    item = _in_flight("r1", 0)
    state = TrainerRolloutState(attempts={"r1": 0}, in_flight=(item,))
    item["task"]["prompt"] = "changed"
    assert state.in_flight[0]["task"] == {"prompt": "p"}
