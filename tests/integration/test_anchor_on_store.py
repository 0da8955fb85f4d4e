"""The torch DCP anchor written onto the snapshot store through DCP's fsspec writer
(docs/spec.md section 8.13.1), single rank.

S3 on loopback (moto's server) and a shared mount: the anchor's objects go straight to
the store (nothing staged locally), publication checks their digest there, and another
process's view (a fresh layout, nothing local but the URL) restores the exact tensors,
both from the restore cache and read straight from the store. A flipped byte in a shard
or a missing shard is refused before DCP reads a byte, and fails the publication.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.storage import make_bucket
from tests.unit.test_manifest import ckpt, make_manifest
from turnpoint.protocol import ArtifactRef
from turnpoint.storage import Storage, open_storage
from turnpoint.trainer.anchors.dcp import AnchorWriter, load_anchor
from turnpoint.trainer.anchors.source import AnchorError
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import ANCHOR_DIR, ManifestError, SnapshotManifest
from turnpoint.trainer.storage.objects import StoreLayout, object_key, stored_tree_digest


@pytest.fixture(params=["s3", "shared"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        endpoint: str = request.getfixturevalue("moto_endpoint")
        return f"s3://{make_bucket(endpoint)}/job"
    return (tmp_path / "mount").absolute().as_uri() + "?mount=shared"


@pytest.fixture
def layout(url: str, tmp_path: Path) -> Iterator[StoreLayout]:
    storage = open_storage(url)
    storage.check()
    opened = StoreLayout(storage, staging=tmp_path / "staging")
    yield opened
    opened.close()


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


def blank() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


def write(layout: StoreLayout, sequence: int) -> tuple[str, torch.nn.Module, Path]:
    """begin, then the anchor through DCP's fsspec writer onto the store; published."""
    checkpoint_id = ckpt(sequence)
    snapshot = layout.begin(checkpoint_id)
    model, optimizer = trained()
    writer = AnchorWriter(layout.storage)
    writer.start(snapshot, model, optimizer, step=7, data_loader={"next": 28})
    ref = writer.wait()
    layout.publish(snapshot, manifest_for(layout.storage, checkpoint_id, ref.sha256))
    return checkpoint_id, model, snapshot


def manifest_for(storage: Storage, checkpoint_id: str, anchor_digest: str) -> SnapshotManifest:
    """The manifest of a snapshot whose one participant wrote its objects to the store."""

    def put(name: str, data: bytes) -> ArtifactRef:
        storage.put(f"{checkpoint_id}/agent-0/{name}", data)
        digest = hashlib.sha256(data).hexdigest()
        return ArtifactRef(f"agent-0/{name}", digest, len(data), data.count(b"\n"))

    return make_manifest(
        checkpoint_id,
        anchor_digest=anchor_digest,
        agent_artifacts=(put("records-1.jsonl", b'{"a": 1}\n'),),
        agent_manifest=put("MANIFEST.json", b"{}"),
    )


def assert_same(model: torch.nn.Module, other: torch.nn.Module) -> None:
    for (name, tensor), (_, restored) in zip(
        model.state_dict().items(), other.state_dict().items(), strict=True
    ):
        assert torch.equal(tensor, restored), name


def test_the_anchor_goes_to_the_store_and_restores_from_the_url_alone(
    layout: StoreLayout, url: str, tmp_path: Path
) -> None:
    checkpoint_id, model, snapshot = write(layout, 1)
    # Nothing staged locally: DCP put every file as an object under the anchor's prefix.
    assert not (snapshot / ANCHOR_DIR).exists()
    keys = [info.key for info in layout.storage.list(f"{checkpoint_id}/{ANCHOR_DIR}/")]
    assert f"{checkpoint_id}/{ANCHOR_DIR}/x--.metadata" in keys
    assert any(key.endswith(".distcp") for key in keys) and len(keys) == 2, keys

    # Another process: the URL, a fresh directory, nothing else.
    restarted = StoreLayout(open_storage(url), staging=tmp_path / "elsewhere")
    manifest = restarted.load(checkpoint_id)
    for reads_the_store in (False, True):
        fresh, optimizer = blank()
        state = load_anchor(
            restarted.path(checkpoint_id),
            fresh,
            optimizer,
            expected=manifest.anchor,
            storage=url if reads_the_store else None,
        )
        assert (state.step, state.data_loader) == (7, {"next": 28})
        assert_same(model, fresh)
    restarted.close()


def _shard_key(storage: Storage, checkpoint_id: str) -> str:
    (key,) = [
        info.key
        for info in storage.list(f"{checkpoint_id}/{ANCHOR_DIR}/")
        if info.key.endswith(".distcp")
    ]
    return key


def test_a_damaged_or_missing_shard_is_refused_before_dcp_reads_it(
    layout: StoreLayout, url: str
) -> None:
    checkpoint_id, _, snapshot = write(layout, 1)
    manifest = layout.load(checkpoint_id)
    key = _shard_key(layout.storage, checkpoint_id)
    data = bytearray(layout.storage.get(key))
    data[len(data) // 2] ^= 0x01
    layout.storage.put(key, bytes(data))
    fresh, optimizer = blank()
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(AnchorError, match="corrupt"):
        load_anchor(snapshot, fresh, optimizer, expected=manifest.anchor, storage=url)
    layout.storage.delete(key)
    with pytest.raises(AnchorError, match="corrupt"):
        load_anchor(snapshot, fresh, optimizer, expected=manifest.anchor, storage=url)
    for name, tensor in before.items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_publication_checks_the_stored_anchor_and_an_anchor_is_never_rewritten(
    layout: StoreLayout,
) -> None:
    checkpoint_id = ckpt(2)
    snapshot = layout.begin(checkpoint_id)
    model, optimizer = trained()
    writer = AnchorWriter(layout.storage)
    writer.start(snapshot, model, optimizer, step=1)
    ref = writer.wait()
    with pytest.raises(AnchorError, match="never rewritten"):
        writer.start(snapshot, model, optimizer, step=1)
    layout.storage.delete(_shard_key(layout.storage, checkpoint_id))
    with pytest.raises(ManifestError, match="anchor digest"):
        layout.publish(snapshot, manifest_for(layout.storage, checkpoint_id, ref.sha256))
    assert layout.list_published() == []


def test_the_digest_over_objects_is_the_tree_digest_of_the_same_files(tmp_path: Path) -> None:
    """An anchor staged and put, or written onto the store: one digest (spec 8.8, 8.13)."""
    files = {".metadata": b"m" * 5, "__0_0.distcp": b"d" * 7, "x--odd name": b"o"}
    directory = tmp_path / "anchor"
    directory.mkdir()
    storage = open_storage(str(tmp_path / "store"))
    prefix = f"{ckpt(1)}/{ANCHOR_DIR}"
    for name, data in files.items():
        (directory / name).write_bytes(data)
        storage.put(f"{prefix}/{object_key(name)}", data)
    assert stored_tree_digest(storage, prefix) == tree_digest(directory)
    assert stored_tree_digest(storage, prefix, files) == tree_digest(directory)
    with pytest.raises(ManifestError, match="missing"):
        stored_tree_digest(storage, prefix, [*files, "__1_0.distcp"])
