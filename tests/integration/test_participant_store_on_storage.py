"""The participant's snapshot store on every kind of storage (docs/spec.md 8.4, 8.12).

The same store, its root a directory, a shared mount URL or an s3:// URL (moto on
loopback): round trip, retries, conflicts, corruption, cancellation, and a whole
snapshot published by the trainer from what the participants wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_manifest import ckpt
from tests.unit.test_store import CKPT, EP_A, EP_B, EP_C, INST, SNAP, sample_records
from turnpoint.participant_sdk import (
    CorruptSnapshotError,
    SnapshotConflictError,
    SnapshotStore,
)
from turnpoint.participant_sdk._store import WriteCancelled, WriteTicket
from turnpoint.participant_sdk._store_format import MANIFEST_NAME, Corruption
from turnpoint.protocol import ParticipantKind
from turnpoint.storage import open_storage
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import (
    ANCHOR_DIR,
    AnchorRef,
    ParticipantEntry,
    SnapshotManifest,
)
from turnpoint.trainer.storage.objects import StoreLayout


def _key(snapshot: str, path: str) -> str:
    return f"{snapshot}/{path}"


def test_round_trip_and_retry(storage_location: str) -> None:
    store = SnapshotStore(storage_location)
    records = sample_records()
    entry = store.write(SNAP, INST, CKPT, records)
    assert entry.episodes == (EP_A, EP_B, EP_C)
    (ref,) = entry.artifacts
    assert ref.path == f"{INST}/records-{ref.sha256}.jsonl"
    # A second process with nothing but the URL reads it back.
    reader = SnapshotStore(storage_location)
    assert reader.exists(SNAP, INST) and not reader.exists(SNAP, "agent-1")
    loaded = reader.read(SNAP, INST, entry, checkpoint_id=CKPT)
    assert loaded.records == tuple(records)
    assert reader.read_entry(SNAP, INST) == entry
    # A retry with the same records answers the published entry.
    assert store.write(SNAP, INST, CKPT, records) == entry
    with pytest.raises(SnapshotConflictError):
        store.write(SNAP, INST, CKPT, records[:2])
    with pytest.raises(SnapshotConflictError):
        store.write(SNAP, INST, "ckpt-000000000002", records)
    assert store.delete_snapshot_dir(SNAP) is True
    assert not reader.exists(SNAP, INST)


def _flip(location: str, key: str) -> None:
    storage = open_storage(location)
    data = bytearray(storage.get(key))
    data[len(data) // 2] ^= 0x01
    storage.put(key, bytes(data))


@pytest.mark.parametrize(
    ("spoil", "kind"),
    [
        ("flip_records", Corruption.DIGEST_MISMATCH),
        ("delete_records", Corruption.MISSING),
        ("truncate_manifest", Corruption.MANIFEST_INVALID),
    ],
)
def test_corruption_is_detected_before_any_record_is_used(
    storage_location: str, spoil: str, kind: Corruption
) -> None:
    store = SnapshotStore(storage_location)
    entry = store.write(SNAP, INST, CKPT, sample_records())
    storage = open_storage(storage_location)
    records_key = _key(SNAP, entry.artifacts[0].path)
    manifest_key = _key(SNAP, f"{INST}/{MANIFEST_NAME}")
    if spoil == "flip_records":
        _flip(storage_location, records_key)
    elif spoil == "delete_records":
        storage.delete(records_key)
    else:
        storage.put(manifest_key, storage.get(manifest_key)[:-9])
    with pytest.raises(CorruptSnapshotError) as error:
        SnapshotStore(storage_location).read(SNAP, INST, None)
    assert error.value.kind is kind


def test_a_cancelled_write_publishes_nothing(storage_location: str) -> None:
    ticket = WriteTicket()
    ticket.cancel()
    with pytest.raises(WriteCancelled):
        SnapshotStore(storage_location).write(SNAP, INST, CKPT, sample_records(), ticket=ticket)
    assert not SnapshotStore(storage_location).exists(SNAP, INST)


def test_participants_and_trainer_share_the_storage(storage_location: str, tmp_path: Path) -> None:
    """Participants write through their store, the trainer publishes, a fresh process
    restores from the URL alone."""
    if "://" not in storage_location:
        storage_location = Path(storage_location).absolute().as_uri()
    layout = StoreLayout(open_storage(storage_location), staging=tmp_path / "trainer")
    checkpoint_id = ckpt(1)
    staged = layout.begin(checkpoint_id)
    anchor = staged / ANCHOR_DIR
    anchor.mkdir(parents=True)
    (anchor / "model.pt").write_bytes(b"weights" * 50)
    entries = []
    for number in range(3):
        instance = f"agent-{number}"
        written = SnapshotStore(storage_location).write(
            checkpoint_id, instance, "c-000000000001", sample_records()[number:]
        )
        entries.append(
            ParticipantEntry(
                instance=instance,
                kind=ParticipantKind.RESOURCES,
                artifacts=written.artifacts,
                manifest=written.manifest,
                exported=written.episodes,
            )
        )
    manifest = SnapshotManifest(
        checkpoint_id=checkpoint_id,
        step=3,
        created_at=1.0,
        anchor=AnchorRef(sha256=tree_digest(anchor)),
        participants=tuple(entries),
    )
    layout.publish(staged, manifest, verify_artifacts=True)
    layout.close()

    restored = StoreLayout(open_storage(storage_location), staging=tmp_path / "elsewhere")
    assert restored.latest() == checkpoint_id
    loaded = restored.load(checkpoint_id)
    restored.verify_artifacts(loaded)
    assert (restored.anchor_dir(checkpoint_id) / "model.pt").read_bytes() == b"weights" * 50
    for entry in loaded.participants:
        records = SnapshotStore(storage_location).read(
            checkpoint_id, entry.instance, entry.manifest
        )
        assert {record.episode for record in records.records} == set(entry.exported)
