"""The sandbox chunk store: digests, incremental reuse, corruption, hostile manifests.

docs/spec.md section 5.7.3. Every refusal is checked twice over: the typed error names
its :class:`Refusal`, and neither the target nor anything beside it was written.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import zstandard

from turnpoint.participant_sdk.sandboxes import (
    ChunkStore,
    Limits,
    Refusal,
    SandboxError,
    SnapshotRefusedError,
    TreeManifest,
)
from turnpoint.participant_sdk.sandboxes._format import (
    CHUNK_BYTES,
    ChunkRef,
    Entry,
    EntryType,
    decode_manifest,
)

MiB = 1 << 20


def _listing(root: Path) -> dict[str, tuple[str, int, bytes | str]]:
    """Every entry under ``root``: kind, permission bits, content or link target."""
    found: dict[str, tuple[str, int, bytes | str]] = {}
    for current, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(current, name)
            relative = path.relative_to(root).as_posix()
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                found[relative] = ("link", 0, os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                found[relative] = ("dir", info.st_mode & 0o777, b"")
            else:
                found[relative] = ("file", info.st_mode & 0o777, path.read_bytes())
    return found


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "big.bin").write_bytes(os.urandom(2 * MiB + 123))  # three chunks
    (root / "empty.txt").write_bytes(b"")
    (root / "src" / "pkg" / "mod.py").write_text("print('hello')\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "src" / "readonly").mkdir()
    (root / "src" / "readonly" / "keep").write_text("k")
    (root / "src" / "readonly").chmod(0o555)
    os.symlink("pkg/mod.py", root / "src" / "link")
    os.symlink("../run.sh", root / "src" / "pkg" / "up")
    return root


@pytest.fixture
def store(tmp_path: Path) -> ChunkStore:
    return ChunkStore(tmp_path / "store")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside every restore target: a hostile restore must leave it empty."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


def test_a_restored_tree_equals_the_captured_one(
    tree: Path, store: ChunkStore, tmp_path: Path
) -> None:
    capture = store.capture(tree)
    target = tmp_path / "restored"
    store.restore(store.load(capture.digest), target)
    assert _listing(target) == _listing(tree)
    assert {e.path for e in capture.manifest.entries} == set(_listing(tree))


def test_digests_name_content_and_the_manifest(tree: Path, store: ChunkStore) -> None:
    capture = store.capture(tree)
    big = next(e for e in capture.manifest.entries if e.path == "big.bin")
    data = (tree / "big.bin").read_bytes()
    assert [c.size for c in big.chunks] == [CHUNK_BYTES, CHUNK_BYTES, 123]
    assert big.chunks[0].sha256 == hashlib.sha256(data[:CHUNK_BYTES]).hexdigest()
    assert capture.digest == hashlib.sha256(capture.manifest.encode()).hexdigest()
    assert capture.digest == capture.manifest.digest
    stored = store.root / "chunks" / big.chunks[2].sha256[:2] / f"{big.chunks[2].sha256}.zst"
    assert zstandard.ZstdDecompressor().decompress(stored.read_bytes()) == data[2 * CHUNK_BYTES :]
    (tree / "src" / "pkg" / "mod.py").write_text("print('hellp')\n")
    assert store.capture(tree).digest != capture.digest


def test_a_snapshot_of_an_unchanged_tree_writes_nothing(tree: Path, store: ChunkStore) -> None:
    first = store.capture(tree)
    assert first.chunks_written == len(first.manifest.chunk_digests())
    again = store.capture(tree)
    assert (again.digest, again.chunks_written, again.bytes_written) == (first.digest, 0, 0)
    assert again.chunks_reused == sum(len(e.chunks) for e in first.manifest.entries)


def test_a_change_writes_only_the_chunks_it_touches(tree: Path, store: ChunkStore) -> None:
    store.capture(tree)
    with (tree / "big.bin").open("r+b") as file:
        file.seek(CHUNK_BYTES + 10)
        file.write(b"changed")
    changed = store.capture(tree)
    assert changed.chunks_written == 1
    assert 0 < changed.bytes_written < 2 * CHUNK_BYTES


def _chunk_file(store: ChunkStore, manifest: TreeManifest, path: str) -> tuple[ChunkRef, Path]:
    ref = next(e for e in manifest.entries if e.path == path).chunks[0]
    return ref, store.root / "chunks" / ref.sha256[:2] / f"{ref.sha256}.zst"


def _damage_flip(stored: Path, ref: ChunkRef) -> None:
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))


def _damage_truncate(stored: Path, ref: ChunkRef) -> None:
    stored.write_bytes(stored.read_bytes()[: len(stored.read_bytes()) // 2])


def _damage_other_content(stored: Path, ref: ChunkRef) -> None:
    stored.write_bytes(zstandard.ZstdCompressor().compress(b"x" * ref.size))


def _damage_bomb(stored: Path, ref: ChunkRef) -> None:
    stored.write_bytes(zstandard.ZstdCompressor().compress(bytes(64 * MiB)))


def _damage_missing(stored: Path, ref: ChunkRef) -> None:
    stored.unlink()


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        (_damage_flip, {Refusal.CHUNK_CORRUPT, Refusal.CHUNK_TRUNCATED}),
        (_damage_truncate, {Refusal.CHUNK_TRUNCATED}),
        (_damage_other_content, {Refusal.CHUNK_CORRUPT}),
        (_damage_bomb, {Refusal.CHUNK_CORRUPT}),
        (_damage_missing, {Refusal.CHUNK_MISSING}),
    ],
)
def test_a_damaged_chunk_is_refused_and_the_partial_tree_removed(
    tree: Path,
    store: ChunkStore,
    tmp_path: Path,
    outside: Path,
    damage: Callable[[Path, ChunkRef], None],
    kind: set[Refusal],
) -> None:
    capture = store.capture(tree)
    ref, stored = _chunk_file(store, capture.manifest, "src/pkg/mod.py")
    damage(stored, ref)
    target = tmp_path / "restored"
    with pytest.raises(SnapshotRefusedError) as refused:
        store.restore(capture.manifest, target)
    assert refused.value.kind in kind
    assert refused.value.path == ref.sha256
    assert not target.exists()
    assert list(outside.iterdir()) == []


def test_a_stored_manifest_whose_bytes_changed_is_refused(tree: Path, store: ChunkStore) -> None:
    capture = store.capture(tree)
    path = store.root / "manifests" / f"{capture.digest}.json"
    path.write_bytes(path.read_bytes().replace(b'"mode":493', b'"mode":511', 1))
    with pytest.raises(SnapshotRefusedError) as refused:
        store.load(capture.digest)
    assert refused.value.kind is Refusal.MANIFEST_INVALID


def test_restore_never_writes_over_an_existing_tree(
    tree: Path, store: ChunkStore, tmp_path: Path
) -> None:
    capture = store.capture(tree)
    target = tmp_path / "existing"
    target.mkdir()
    (target / "mine").write_text("keep")
    with pytest.raises(SnapshotRefusedError) as refused:
        store.restore(capture.manifest, target)
    assert refused.value.kind is Refusal.TARGET_EXISTS
    assert _listing(target) == {"mine": ("file", 0o644, b"keep")}


# ------------------------------------------------------------------ hostile manifests


def _d(path: str) -> Entry:
    return Entry(path, EntryType.DIR, mode=0o755)


def _l(path: str, target: str) -> Entry:
    return Entry(path, EntryType.SYMLINK, target=target)


HOSTILE: dict[str, tuple[list[Entry], Refusal]] = {
    "dotdot": ([_d("a"), _d("a/..")], Refusal.PATH_ESCAPE),
    "dotdot_file": ([Entry("../escaped", EntryType.FILE, mode=0o644)], Refusal.PATH_ESCAPE),
    "absolute": ([Entry("/tmp/escaped", EntryType.FILE, mode=0o644)], Refusal.PATH_ESCAPE),
    "dot": ([_d("."), _d("./a")], Refusal.PATH_ESCAPE),
    "empty_component": ([_d("a"), _d("a//b")], Refusal.PATH_ESCAPE),
    "nul": ([_d("a\x00b")], Refusal.PATH_ESCAPE),
    "duplicate": ([_d("a"), _d("a")], Refusal.DUPLICATE_PATH),
    "parent_missing": ([_d("a/b")], Refusal.PARENT_MISSING),
    "parent_is_file": (
        [Entry("f", EntryType.FILE, mode=0o644), _d("f/x")],
        Refusal.PARENT_MISSING,
    ),
    "beneath_symlink": ([_d("d"), _l("l", "d"), _d("l/x")], Refusal.BENEATH_SYMLINK),
    "beneath_symlink_out": ([_l("l", "../outside"), _d("l/x")], Refusal.BENEATH_SYMLINK),
    "symlink_absolute": ([_l("l", "/etc")], Refusal.SYMLINK_ESCAPE),
    "symlink_up": ([_d("a"), _l("a/l", "../../outside")], Refusal.SYMLINK_ESCAPE),
    # Each link stays inside on its own; followed through each other they leave the root.
    "symlink_chain": (
        [_d("a"), _l("a/up", ".."), _l("t", "a/up/a/up/..")],
        Refusal.SYMLINK_ESCAPE,
    ),
    "symlink_via_absolute": ([_l("abs", "/"), _l("t", "abs/etc")], Refusal.SYMLINK_ESCAPE),
    "symlink_loop": ([_l("x", "y"), _l("y", "x")], Refusal.SYMLINK_ESCAPE),
    "mode_setuid": ([Entry("f", EntryType.FILE, mode=0o4755)], Refusal.MANIFEST_INVALID),
    "size_mismatch": ([Entry("f", EntryType.FILE, mode=0o644, size=5)], Refusal.MANIFEST_INVALID),
    "too_many_entries": ([_d(f"d{i:03}") for i in range(11)], Refusal.TOO_MANY_ENTRIES),
    "out_of_order": ([_d("b"), _d("a")], Refusal.MANIFEST_INVALID),
}
SMALL = Limits(max_entries=10, max_bytes=4 * MiB)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_manifest_is_refused_before_anything_is_written(
    case: str, tmp_path: Path, outside: Path
) -> None:
    entries, kind = HOSTILE[case]
    store = ChunkStore(tmp_path / "store", SMALL)
    target = tmp_path / "target"
    with pytest.raises(SnapshotRefusedError) as refused:
        store.restore(TreeManifest(tuple(entries)), target)
    assert refused.value.kind is kind, refused.value
    assert not target.exists()
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "store"]


def test_too_many_bytes_is_refused_from_the_declared_sizes(tmp_path: Path, outside: Path) -> None:
    ref = ChunkRef("0" * 64, CHUNK_BYTES)
    files = [
        Entry(f"f{i}", EntryType.FILE, mode=0o644, size=CHUNK_BYTES, chunks=(ref,))
        for i in range(5)
    ]
    store = ChunkStore(tmp_path / "store", SMALL)
    with pytest.raises(SnapshotRefusedError) as refused:
        store.restore(TreeManifest(tuple(files)), tmp_path / "target")
    assert refused.value.kind is Refusal.TOO_MANY_BYTES
    assert not (tmp_path / "target").exists()


def test_a_symlink_that_stays_inside_is_kept(tmp_path: Path) -> None:
    entries = (_d("a"), _l("a/up", ".."), _d("b"), _l("t", "a/up/b/../a"))
    store = ChunkStore(tmp_path / "store")
    store.restore(TreeManifest(entries), tmp_path / "target")
    assert os.readlink(tmp_path / "target" / "t") == "a/up/b/../a"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (b'{"format_version":1,"entries":[],"entries":[]}', Refusal.MANIFEST_INVALID),
        (b'{"format_version":2,"entries":[]}', Refusal.MANIFEST_INVALID),
        (
            b'{"format_version":1,"entries":[{"path":"a","type":"dev","mode":0}]}',
            Refusal.MANIFEST_INVALID,
        ),
        (
            b'{"format_version":1,"entries":[{"path":"a","type":"dir","mode":0,"x":1}]}',
            Refusal.MANIFEST_INVALID,
        ),
        (
            b'{"format_version":1,"entries":[{"path":"a","type":"dir","mode":true}]}',
            Refusal.MANIFEST_INVALID,
        ),
        (
            b'{"format_version":1,"entries":[{"path":"../a","type":"dir","mode":0}]}',
            Refusal.PATH_ESCAPE,
        ),
        (b"\xff", Refusal.MANIFEST_INVALID),
        (
            b'{"format_version":1,"entries":['
            + b",".join([b'{"path":"a","type":"dir","mode":0}'] * 11)
            + b"]}",
            Refusal.TOO_MANY_ENTRIES,
        ),
    ],
)
def test_manifest_bytes_are_decoded_strictly(text: bytes, kind: Refusal) -> None:
    with pytest.raises(SnapshotRefusedError) as refused:
        decode_manifest(text, SMALL)
    assert refused.value.kind is kind


def test_a_tree_a_restore_would_refuse_is_refused_at_capture(tree: Path, store: ChunkStore) -> None:
    os.symlink("/etc/passwd", tree / "absolute")
    with pytest.raises(SnapshotRefusedError) as refused:
        store.capture(tree)
    assert refused.value.kind is Refusal.SYMLINK_ESCAPE
    assert list((store.root / "manifests").iterdir()) == []


def test_a_bomb_of_small_files_is_refused_at_capture(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb"
    bomb.mkdir()
    for i in range(20):
        (bomb / f"f{i}").write_bytes(b"x")
    store = ChunkStore(tmp_path / "store", SMALL)
    with pytest.raises(SnapshotRefusedError) as refused:
        store.capture(bomb)
    assert refused.value.kind is Refusal.TOO_MANY_ENTRIES
    assert isinstance(refused.value, SandboxError)


def test_special_files_are_skipped_and_said(tree: Path, store: ChunkStore) -> None:
    os.mkfifo(tree / "pipe")
    capture = store.capture(tree)
    assert capture.skipped == ("pipe",)
    assert "pipe" not in {e.path for e in capture.manifest.entries}


def test_the_sizes_are_the_bytes_read(tree: Path, store: ChunkStore) -> None:
    capture = store.capture(tree)
    sizes = {e.path: e.size for e in capture.manifest.entries if e.type is EntryType.FILE}
    assert sizes["big.bin"] == 2 * MiB + 123
    assert capture.manifest.total_bytes == sum(sizes.values())
    assert replace(capture.manifest).digest == capture.digest
