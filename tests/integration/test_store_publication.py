"""Publication without rename (docs/spec.md section 8.13), over every kind of storage.

The same suite runs on a directory, a shared mount and S3 (moto on loopback): publish,
load, retention, a crash after every publication step, corruption of every kind of
object, and a store that fails puts.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.storage import LaggingListing, fail_next_puts, make_bucket
from tests.unit.test_manifest import ckpt, make_manifest
from turnpoint.protocol import ArtifactRef
from turnpoint.storage import Storage, TransientStorageError, open_storage
from turnpoint.trainer.storage.layout import PublishStep, tree_digest
from turnpoint.trainer.storage.manifest import (
    ANCHOR_DIR,
    LATEST_NAME,
    MANIFEST_NAME,
    ManifestError,
    SnapshotManifest,
)
from turnpoint.trainer.storage.objects import StoreLayout, owned_staging


@pytest.fixture
def layout(storage: Storage, tmp_path: Path) -> Iterator[StoreLayout]:
    opened = StoreLayout(storage, staging=tmp_path / "staging")
    yield opened
    opened.close()


def _put(storage: Storage, key: str, data: bytes) -> ArtifactRef:
    storage.put(key, data)
    return ArtifactRef(
        "/".join(key.split("/")[1:]),
        hashlib.sha256(data).hexdigest(),
        len(data),
        data.count(b"\n"),
    )


def prepare(layout: StoreLayout, sequence: int) -> SnapshotManifest:
    """begin, the anchor in staging, the participant's objects in the store."""
    checkpoint_id = ckpt(sequence)
    snapshot = layout.begin(checkpoint_id)
    anchor = snapshot / ANCHOR_DIR
    (anchor / "optim").mkdir(parents=True)
    (anchor / "weights.bin").write_bytes(b"w" * 100 + bytes([sequence % 256]))
    (anchor / "optim" / "state.bin").write_bytes(b"o" * 10)
    # Names as DCP writes them, which are not valid key components: stored escaped.
    (anchor / ".metadata").write_bytes(b"m" * 5)
    (anchor / "__0_0.distcp").write_bytes(b"d" * 7)
    records = _put(
        layout.storage, f"{checkpoint_id}/agent-0/records-1.jsonl", b'{"a": 1}\n{"b": 2}\n'
    )
    own = _put(layout.storage, f"{checkpoint_id}/agent-0/MANIFEST.json", b"{}")
    return make_manifest(
        checkpoint_id,
        anchor_digest=tree_digest(anchor),
        agent_artifacts=(records,),
        agent_manifest=own,
    )


def publish(layout: StoreLayout, sequence: int) -> SnapshotManifest:
    manifest = prepare(layout, sequence)
    layout.publish(layout.path(manifest.checkpoint_id), manifest)
    return manifest


def fresh(layout: StoreLayout, tmp_path: Path, name: str = "restarted") -> StoreLayout:
    """Another process's view: the same storage URL, nothing local."""
    return StoreLayout(open_storage(layout.storage.url), staging=tmp_path / name)


def usable(layout: StoreLayout) -> str | None:
    """What a restore picks (docs/spec.md 7.7): the newest snapshot that passes."""
    for checkpoint_id in layout.list_published():
        try:
            manifest = layout.load(checkpoint_id)
            layout.verify_artifacts(manifest)
        except ManifestError:
            continue
        return checkpoint_id
    return None


def test_publish_then_load_elsewhere(layout: StoreLayout, tmp_path: Path) -> None:
    assert layout.latest() is None
    manifest = publish(layout, 1)
    other = fresh(layout, tmp_path)
    assert other.latest() == ckpt(1)
    assert other.list_published() == [ckpt(1)]
    assert other.load(ckpt(1)) == manifest
    # The anchor is back on local disk, whole, for the anchor's own loader.
    assert (other.anchor_dir(ckpt(1)) / "optim" / "state.bin").read_bytes() == b"o" * 10
    assert (other.anchor_dir(ckpt(1)) / ".metadata").read_bytes() == b"m" * 5
    assert other.storage.size(f"{ckpt(1)}/{ANCHOR_DIR}/x--_5F_5F0_5F0.distcp") == 7
    assert other.storage.get(f"{ckpt(1)}/{MANIFEST_NAME}") == manifest.to_json()
    assert other.storage.get(LATEST_NAME) == f"{ckpt(1)}\n".encode()
    other.verify_artifacts(manifest)


def test_publish_refuses_objects_that_are_not_there(layout: StoreLayout) -> None:
    publish(layout, 1)
    manifest = prepare(layout, 2)
    layout.storage.delete(f"{ckpt(2)}/agent-0/records-1.jsonl")
    with pytest.raises(ManifestError, match="is missing"):
        layout.publish(layout.path(ckpt(2)), manifest)
    layout.storage.put(f"{ckpt(2)}/agent-0/records-1.jsonl", b"x")
    with pytest.raises(ManifestError, match="has 1 bytes"):
        layout.publish(layout.path(ckpt(2)), manifest)
    assert not layout.is_published(ckpt(2))
    assert layout.latest() == ckpt(1)


class _Crash(Exception):
    """Stands for the process dying: nothing after it runs, no cleanup."""


@pytest.mark.parametrize("crash_after", list(PublishStep))
def test_crash_at_any_step_never_publishes_half(
    storage: Storage, tmp_path: Path, crash_after: PublishStep
) -> None:
    publish(StoreLayout(storage, staging=tmp_path / "first"), 1)

    def fail(step: PublishStep) -> None:
        if step is crash_after:
            raise _Crash(step.value)

    crashing = StoreLayout(storage, staging=tmp_path / "crashing", after_step=fail)
    manifest = prepare(crashing, 2)
    with pytest.raises(_Crash):
        crashing.publish(crashing.path(ckpt(2)), manifest)

    restarted = fresh(crashing, tmp_path)
    steps = list(PublishStep)
    newly_published = steps.index(crash_after) >= steps.index(PublishStep.MANIFEST_LINKED)
    assert restarted.is_published(ckpt(2)) == newly_published
    # LATEST never names nothing; a manifest newer than LATEST is trusted by restore.
    latest = restarted.latest()
    assert latest == (ckpt(2) if crash_after is PublishStep.LATEST_MOVED else ckpt(1))
    for checkpoint_id in restarted.list_published():
        restarted.verify_artifacts(restarted.load(checkpoint_id))
    assert usable(restarted) == (ckpt(2) if newly_published else ckpt(1))

    removed = restarted.clean_partial()
    assert removed == ([] if newly_published else [ckpt(2)])
    assert not storage.list(f"{ckpt(2)}/") or newly_published
    publish(restarted, 3)
    assert restarted.latest() == ckpt(3)


def _flip_byte(storage: Storage, key: str) -> None:
    data = bytearray(storage.get(key))
    data[len(data) // 2] ^= 0x01
    storage.put(key, bytes(data))


def _truncate(storage: Storage, key: str) -> None:
    storage.put(key, storage.get(key)[:-7])


CORRUPTIONS: dict[str, Callable[[Storage, str], None]] = {
    "flipped byte in a record": lambda s, c: _flip_byte(s, f"{c}/agent-0/records-1.jsonl"),
    "flipped byte in the anchor": lambda s, c: _flip_byte(s, f"{c}/{ANCHOR_DIR}/weights.bin"),
    "missing record": lambda s, c: s.delete(f"{c}/agent-0/records-1.jsonl"),
    "missing anchor file": lambda s, c: s.delete(f"{c}/{ANCHOR_DIR}/optim/state.bin"),
    "missing escaped anchor file": lambda s, c: s.delete(f"{c}/{ANCHOR_DIR}/x--.metadata"),
    "truncated manifest": lambda s, c: _truncate(s, f"{c}/{MANIFEST_NAME}"),
    "flipped byte in the manifest": lambda s, c: _flip_byte(s, f"{c}/{MANIFEST_NAME}"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corruption_is_detected_and_restore_falls_back(
    layout: StoreLayout, tmp_path: Path, corruption: str
) -> None:
    publish(layout, 1)
    publish(layout, 2)
    CORRUPTIONS[corruption](layout.storage, ckpt(2))
    other = fresh(layout, tmp_path)
    with pytest.raises(ManifestError):
        other.verify_artifacts(other.load(ckpt(2)))
    assert usable(other) == ckpt(1)


def test_retention_deletes_only_what_no_retained_manifest_names(
    layout: StoreLayout, tmp_path: Path
) -> None:
    for sequence in range(1, 6):
        publish(layout, sequence)
    layout.storage.put(LATEST_NAME, f"{ckpt(2)}\n".encode())
    layout.storage.put("operator-notes/README", b"not ours")
    assert layout.retain(2) == [ckpt(3), ckpt(1)]
    assert layout.list_published() == [ckpt(5), ckpt(4), ckpt(2)]
    assert layout.storage.list(f"{ckpt(1)}/") == []
    assert layout.storage.size("operator-notes/README") == 8
    other = fresh(layout, tmp_path)
    for checkpoint_id in other.list_published():
        other.verify_artifacts(other.load(checkpoint_id))


def test_clean_partial_spares_the_snapshot_being_written(layout: StoreLayout) -> None:
    publish(layout, 1)
    layout.storage.put(f"{ckpt(4)}/agent-0/records-1.jsonl", b"orphan")
    layout.begin(ckpt(6))
    layout.storage.put(f"{ckpt(6)}/agent-0/records-1.jsonl", b"being written")
    assert layout.clean_partial() == [ckpt(4)]
    assert layout.storage.size(f"{ckpt(6)}/agent-0/records-1.jsonl") is not None


def test_a_lagging_listing_never_costs_a_published_snapshot(
    storage: Storage, tmp_path: Path
) -> None:
    """The manifest is the newest object of a publication, the likeliest to be missing
    from a listing that lags: partial cleanup must not take the snapshot for a partial."""
    lagging = LaggingListing(storage)
    layout = StoreLayout(lagging, staging=tmp_path / "staging")
    publish(layout, 1)
    publish(layout, 2)
    lagging.hidden = 2  # the manifest of 2 and LATEST
    assert layout.list_published() == [ckpt(1)]
    assert layout.clean_partial() == []
    lagging.hidden = 0
    other = fresh(layout, tmp_path)
    other.verify_artifacts(other.load(ckpt(2)))
    assert usable(other) == ckpt(2)


def test_restore_under_a_lagging_listing_picks_a_whole_snapshot(
    storage: Storage, tmp_path: Path
) -> None:
    lagging = LaggingListing(storage)
    layout = StoreLayout(lagging, staging=tmp_path / "staging")
    publish(layout, 1)
    before = len(storage.list())
    publish(layout, 2)
    written_by_2 = len(storage.list()) - before + 1  # and LATEST, replaced
    for hidden in range(written_by_2 + 1):
        lagging.hidden = hidden
        restored = StoreLayout(lagging, staging=tmp_path / f"restore-{hidden}")
        picked = usable(restored)
        # Hiding LATEST alone hides nothing a restore reads; hiding more hides 2 whole.
        assert picked == (ckpt(2) if hidden <= 1 else ckpt(1)), hidden
        restored.verify_artifacts(restored.load(picked))


def test_a_store_failing_puts_publishes_nothing_and_the_retry_does(
    moto_endpoint: str, tmp_path: Path
) -> None:
    storage = open_storage(f"s3://{make_bucket(moto_endpoint)}/job")
    layout = StoreLayout(storage, staging=tmp_path / "staging")
    publish(layout, 1)
    manifest = prepare(layout, 2)
    faults = fail_next_puts(storage, 100)
    with pytest.raises(TransientStorageError):
        layout.publish(layout.path(ckpt(2)), manifest)
    assert not layout.is_published(ckpt(2))
    assert usable(fresh(layout, tmp_path)) == ckpt(1)
    faults.stop()
    # The snapshot is retried: a new attempt, as the driver's next round makes.
    publish(layout, 3)
    assert layout.latest() == ckpt(3)


def test_the_trainer_is_configured_by_url(storage_location: str, tmp_path: Path) -> None:
    from turnpoint.trainer.advanced import bump_epoch
    from turnpoint.trainer.config import CoordinatorConfig
    from turnpoint.trainer.storage.layout import SnapshotLayout
    from turnpoint.trainer.storage.objects import open_layout

    config = CoordinatorConfig(snapshot_root=storage_location)
    expected = Path if "://" not in storage_location else str
    assert isinstance(config.snapshot_root, expected)
    assert bump_epoch(config.snapshot_root).epoch == 1
    assert bump_epoch(config.snapshot_root).epoch == 2
    layout = open_layout(config.snapshot_root)
    assert isinstance(layout, SnapshotLayout if expected is Path else StoreLayout)


def test_refused_credentials_stop_the_trainer_at_startup(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moto import settings

    from turnpoint.storage import StorageAccessError
    from turnpoint.trainer.storage.objects import open_layout

    url = f"s3://{make_bucket(moto_endpoint)}/job"
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageAccessError) as error:
        open_layout(url)
    assert "not-the-secret" not in str(error.value)


def test_inspect_verifies_every_digest_from_the_url_alone(
    layout: StoreLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    from turnpoint.apps._cli import main

    publish(layout, 1)
    publish(layout, 2)
    url = layout.storage.url
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert ckpt(1) in out and ckpt(2) in out
    _flip_byte(layout.storage, f"{ckpt(1)}/agent-0/records-1.jsonl")
    assert main(["inspect", url]) == 1
    assert "agent-0: agent-0/records-1.jsonl has sha256" in capsys.readouterr().out
    layout.storage.delete(f"{ckpt(2)}/{ANCHOR_DIR}/weights.bin")
    assert main(["inspect", url, "--json"]) == 1
    assert "trainer anchor" in capsys.readouterr().out


def test_a_staging_directory_whose_owner_died_is_removed_by_the_next_one(tmp_path: Path) -> None:
    """A trainer killed mid-snapshot cannot remove its staging directory; the next
    default staging directory on the machine does, and spares those of live owners and
    directories it did not make."""
    owner = (
        "import sys, time; from pathlib import Path; "
        "from turnpoint.trainer.storage.objects import owned_staging; "
        "directory, _ = owned_staging(Path(sys.argv[1])); "
        "(directory / 'anchor').write_bytes(b'half'); "
        "print(directory, flush=True); time.sleep(120)"
    )
    started = [
        subprocess.Popen(
            [sys.executable, "-c", owner, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        dead, alive = (Path(process.stdout.readline().strip()) for process in started)  # type: ignore[union-attr]
        started[0].kill()
        started[0].wait()
        foreign = tmp_path / "turnpoint-staging-by-hand"
        foreign.mkdir()

        mine, lock = owned_staging(tmp_path)
        os.close(lock)

        assert not dead.exists()
        assert (alive / "anchor").read_bytes() == b"half"
        assert foreign.is_dir() and mine.is_dir()
    finally:
        for process in started:
            process.kill()
            process.wait()
