"""``turnpoint inspect``: real published snapshots, then one tampered byte at a time."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from turnpoint.apps._cli import main
from turnpoint.apps._inspect import inspect_command, inspect_root
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import Record, SnapshotStore
from turnpoint.protocol import ArtifactRef, ParticipantKind
from turnpoint.protocol import ArtifactRef as StoreArtifactRef
from turnpoint.trainer.advanced import SnapshotLayout, SnapshotManifest
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    AnchorRef,
    JSONValue,
    ParticipantEntry,
    PlacedEpisode,
    TrainerRolloutState,
)

CREATED_AT = 1_700_000_000.0


def ckpt(sequence: int) -> str:
    return make_checkpoint_id("run", sequence)


def _ref(ref: StoreArtifactRef) -> ArtifactRef:
    return ArtifactRef(ref.path, ref.sha256, ref.size_bytes, ref.record_count)


def publish(
    root: Path, sequence: int, extra: dict[str, JSONValue] | None = None
) -> SnapshotManifest:
    """A snapshot as the coordinator publishes it: participant stores, anchor, manifest."""
    layout = SnapshotLayout(root)
    checkpoint_id = ckpt(sequence)
    snapshot = layout.begin(checkpoint_id)
    anchor = layout.anchor_dir(checkpoint_id)
    anchor.mkdir(parents=True)
    (anchor / "model.pt").write_bytes(b"weights of step %d" % sequence)
    (anchor / "optimizer.pt").write_bytes(b"moments")

    continued = EpisodeId("r1", 0)
    restarted = EpisodeId("r2", 0)
    entry = SnapshotStore(root).write(
        checkpoint_id,
        "agent-0",
        checkpoint_id,
        [
            Record(continued, "turn-1", {"messages": ["hi", "there"], "step": sequence}),
            Record(continued, "turn-2", {"messages": ["again"]}),
        ],
    )
    agent = ParticipantEntry(
        instance="agent-0",
        kind=ParticipantKind.AGENT,
        incarnation="inc-1",
        artifacts=tuple(_ref(ref) for ref in entry.artifacts),
        manifest=_ref(entry.manifest),
        exported=entry.episodes,
    )
    manifest = SnapshotManifest(
        checkpoint_id=checkpoint_id,
        step=10 * sequence,
        created_at=CREATED_AT + sequence,
        anchor=AnchorRef(sha256=tree_digest(anchor)),
        participants=(agent, ParticipantEntry("policy-0", ParticipantKind.MODEL)),
        continued=(PlacedEpisode(continued, "agent-0"),),
        restarts=(PlacedEpisode(restarted, "agent-0"),),
        rollout_state=TrainerRolloutState(attempts={"r1": 0, "r2": 0}),
        extra=extra or {},
    )
    layout.publish(snapshot, manifest, verify_artifacts=True)
    return manifest


def flip_one_byte(path: Path) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def records_path(root: Path, manifest: SnapshotManifest) -> Path:
    (artifact,) = manifest.participant("agent-0").artifacts
    return root / manifest.checkpoint_id / artifact.path


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["inspect", *argv])
    return status, out.getvalue()


def test_lists_snapshots_newest_first_and_verifies_every_digest(tmp_path: Path) -> None:
    publish(tmp_path, 1)
    publish(tmp_path, 2)
    report = inspect_root(tmp_path)
    assert report.ok
    assert report.latest == ckpt(2)
    newest, older = report.snapshots
    assert (newest.checkpoint_id, newest.latest, older.checkpoint_id, older.latest) == (
        ckpt(2),
        True,
        ckpt(1),
        False,
    )
    assert (newest.step, newest.created_at) == (20, CREATED_AT + 2)
    assert newest.participants == ("agent-0", "policy-0")
    assert (newest.continued, newest.restarts) == (1, 1)
    # The anchor, the agent's manifest and its records file.
    assert newest.files_checked == 3

    status, text = run_cli(str(tmp_path))
    assert status == 0
    assert text.index(ckpt(2)) < text.index(ckpt(1))
    assert f"{ckpt(2)}  (LATEST)" in text
    assert "participants (2): agent-0, policy-0" in text
    assert "episodes: 1 continued, 1 restarted" in text
    assert "2023-11-14T22:13:22+00:00" in text
    assert text.count(": OK") == 2
    assert "MISMATCH" not in text


def test_a_flipped_byte_in_a_records_file_is_a_mismatch(tmp_path: Path) -> None:
    older = publish(tmp_path, 1)
    publish(tmp_path, 2)
    records = records_path(tmp_path, older)
    size = records.stat().st_size
    flip_one_byte(records)
    assert records.stat().st_size == size  # only the digest can tell

    report = inspect_root(tmp_path)
    assert not report.ok
    newest, damaged = report.snapshots
    assert newest.ok
    assert damaged.problem is not None
    assert damaged.problem.startswith(f"agent-0: agent-0/{records.name} has sha256 ")

    status, text = run_cli(str(tmp_path))
    assert status == 1
    assert f"MISMATCH: agent-0: agent-0/{records.name} has sha256" in text
    assert "1 of 2 snapshot(s) failed verification" in text


def test_a_participant_manifest_that_grew_is_a_mismatch(tmp_path: Path) -> None:
    manifest = publish(tmp_path, 1)
    participant_manifest = tmp_path / ckpt(1) / "agent-0" / MANIFEST_NAME
    os.chmod(participant_manifest, 0o644)
    with participant_manifest.open("ab") as handle:
        handle.write(b" ")
    (snapshot,) = inspect_root(tmp_path).snapshots
    expected = manifest.participant("agent-0").manifest
    assert expected is not None
    assert snapshot.problem == (
        f"agent-0: agent-0/{MANIFEST_NAME} has {expected.size_bytes + 1} bytes, "
        f"manifest says {expected.size_bytes}"
    )
    assert inspect_command(tmp_path, out=io.StringIO()) == 1


def test_a_changed_anchor_and_a_missing_file_are_mismatches(tmp_path: Path) -> None:
    older = publish(tmp_path, 1)
    publish(tmp_path, 2)
    flip_one_byte(tmp_path / ckpt(2) / "trainer" / "anchor" / "model.pt")
    records_path(tmp_path, older).unlink()
    newest, older_report = inspect_root(tmp_path).snapshots
    assert newest.problem is not None and newest.problem.startswith("trainer anchor")
    assert older_report.problem is not None and older_report.problem.endswith("is missing")


def test_json_output(tmp_path: Path) -> None:
    publish(tmp_path, 1)
    flip_one_byte(records_path(tmp_path, publish(tmp_path, 2)))
    status, text = run_cli(str(tmp_path), "--json")
    assert status == 1
    document = json.loads(text)
    assert document["ok"] is False
    assert [(item["checkpoint_id"], item["ok"]) for item in document["snapshots"]] == [
        (ckpt(2), False),
        (ckpt(1), True),
    ]


def test_a_broken_latest_pointer_fails_the_check(tmp_path: Path) -> None:
    publish(tmp_path, 1)
    (tmp_path / LATEST_NAME).write_text(f"{ckpt(7)}\n")
    report = inspect_root(tmp_path)
    assert report.latest is None
    assert report.latest_problem is not None and ckpt(7) in report.latest_problem
    assert [snapshot.ok for snapshot in report.snapshots] == [True]
    assert not report.ok
    status, text = run_cli(str(tmp_path))
    assert status == 1
    assert "LATEST: MISMATCH" in text


def test_an_empty_root_and_a_missing_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, text = run_cli(str(tmp_path))
    assert (status, text.strip().splitlines()[-1]) == (0, "no published snapshots")
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_restore_candidates_follow_the_choice_and_show_the_recorded_metrics(
    tmp_path: Path,
) -> None:
    publish(tmp_path, 1, {"metrics": {"mean_reward": 0.9}})
    publish(tmp_path, 2, {"metrics": {"mean_reward": 0.4}})
    publish(tmp_path, 3)
    status, text = run_cli(str(tmp_path))
    assert status == 0
    assert "metrics: mean_reward=0.9" in text
    assert f"restore candidates (restore_from = latest): {ckpt(3)}, {ckpt(2)}, {ckpt(1)}" in text
    status, text = run_cli(str(tmp_path), "--restore-from", "best:mean_reward", "--json")
    assert json.loads(text)["restore"] == {
        "restore_from": "best:mean_reward",
        "order": [ckpt(1), ckpt(2)],
    }
    status, text = run_cli(str(tmp_path), "--restore-from", "snapshot:../x")
    assert status == 2
