"""A sandbox snapshot's tree manifest: what it lists, its bytes, and what a reader refuses.

docs/spec.md section 5.7.3 defines the format. A manifest lists every directory, regular
file and symbolic link of a tree, parents before children, with permission bits, sizes,
symlink targets and, for a file, the sha256 digests of its content chunks (the chunks
themselves are :mod:`._chunks`' business). Its digest (sha256 of its canonical bytes) is
the tree digest.

:func:`check_manifest` is the whole hostile-input check, run before a restore writes
anything: every path relative and plain, no entry beneath a symlink or without its
directory, no symlink resolving outside the root (followed through the manifest's own
links), and entry and byte caps (:class:`Limits`). Each failure is a
:class:`SnapshotRefusedError` naming its :class:`Refusal`.

Pure: no file I/O, no grpc, no asyncio, no clock.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from turnpoint._json import StrictJSONError, loads_strict

from ._errors import Refusal, SnapshotRefusedError

FORMAT_VERSION: Final = 1
# Files are cut into chunks of this size (the last one shorter); a chunk is the unit of
# deduplication between snapshots and of verification on restore.
CHUNK_BYTES: Final = 1 << 20
PERMISSION_BITS: Final = 0o777
# Symlinks followed while resolving one target, as the kernel's own limit (ELOOP).
MAX_SYMLINK_HOPS: Final = 40
_SHA256_HEX: Final = re.compile(r"[0-9a-f]{64}")
_MANIFEST_FIELDS: Final = frozenset({"format_version", "entries"})
_ENTRY_FIELDS: Final = {
    "dir": frozenset({"path", "type", "mode"}),
    "file": frozenset({"path", "type", "mode", "size", "chunks"}),
    "symlink": frozenset({"path", "type", "target"}),
}


class EntryType(enum.Enum):
    DIR = "dir"
    FILE = "file"
    SYMLINK = "symlink"


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a file: the sha256 of its uncompressed bytes and their count."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Entry:
    """One entry of a tree; ``path`` is relative, ``/``-separated, without ``.`` or ``..``."""

    path: str
    type: EntryType
    mode: int = 0
    size: int = 0
    chunks: tuple[ChunkRef, ...] = ()
    target: str = ""


@dataclass(frozen=True)
class Limits:
    """What a snapshot (taken or restored) may hold; past it, a typed refusal."""

    max_entries: int = 100_000
    max_bytes: int = 1 << 30
    max_path_chars: int = 4096
    max_manifest_bytes: int = 64 << 20


@dataclass(frozen=True)
class TreeManifest:
    entries: tuple[Entry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.entries)

    def chunk_digests(self) -> frozenset[str]:
        return frozenset(c.sha256 for entry in self.entries for c in entry.chunks)

    def encode(self) -> bytes:
        """The canonical bytes: compact JSON, keys sorted, ASCII."""
        return json.dumps(
            {"format_version": FORMAT_VERSION, "entries": [_entry_json(e) for e in self.entries]},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
            allow_nan=False,
        ).encode("ascii")

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()


def _entry_json(entry: Entry) -> dict[str, Any]:
    if entry.type is EntryType.DIR:
        return {"path": entry.path, "type": "dir", "mode": entry.mode}
    if entry.type is EntryType.SYMLINK:
        return {"path": entry.path, "type": "symlink", "target": entry.target}
    return {
        "path": entry.path,
        "type": "file",
        "mode": entry.mode,
        "size": entry.size,
        "chunks": [[c.sha256, c.size] for c in entry.chunks],
    }


def decode_manifest(data: bytes, limits: Limits) -> TreeManifest:
    """Parse manifest bytes strictly and run :func:`check_manifest` on the result."""
    if len(data) > limits.max_manifest_bytes:
        _refuse(Refusal.TOO_MANY_BYTES, "", f"manifest of {len(data)} bytes")
    try:
        document = loads_strict(data.decode("utf-8"))
    except (UnicodeDecodeError, StrictJSONError) as error:
        _refuse(Refusal.MANIFEST_INVALID, "", f"not strict JSON ({type(error).__name__})")
    if not isinstance(document, dict) or set(document) != _MANIFEST_FIELDS:
        _refuse(Refusal.MANIFEST_INVALID, "", "not a manifest object")
    if document["format_version"] != FORMAT_VERSION:
        _refuse(Refusal.MANIFEST_INVALID, "", f"format_version {document['format_version']!r}")
    raw_entries = document["entries"]
    if not isinstance(raw_entries, list):
        _refuse(Refusal.MANIFEST_INVALID, "", "entries is not a list")
    if len(raw_entries) > limits.max_entries:
        _refuse(Refusal.TOO_MANY_ENTRIES, "", f"{len(raw_entries)} > {limits.max_entries}")
    manifest = TreeManifest(tuple(_entry_from_json(raw) for raw in raw_entries))
    check_manifest(manifest, limits)
    return manifest


def _entry_from_json(raw: object) -> Entry:
    if not isinstance(raw, dict) or not isinstance(raw.get("path"), str):
        _refuse(Refusal.MANIFEST_INVALID, "", "an entry without a path")
    path: str = raw["path"]
    fields = _ENTRY_FIELDS.get(raw.get("type"))  # type: ignore[arg-type]
    if fields is None or set(raw) != fields:
        _refuse(Refusal.MANIFEST_INVALID, path, "unknown type or fields")
    kind = EntryType(raw["type"])
    if kind is EntryType.SYMLINK:
        if not isinstance(raw["target"], str):
            _refuse(Refusal.MANIFEST_INVALID, path, "target is not a string")
        return Entry(path, kind, target=raw["target"])
    mode = raw["mode"]
    if not _is_int(mode) or mode & ~PERMISSION_BITS:
        _refuse(Refusal.MANIFEST_INVALID, path, "mode is not permission bits")
    if kind is EntryType.DIR:
        return Entry(path, kind, mode=mode)
    size, chunks = raw["size"], raw["chunks"]
    if not _is_int(size) or not isinstance(chunks, list):
        _refuse(Refusal.MANIFEST_INVALID, path, "size or chunks malformed")
    refs = []
    for chunk in chunks:
        if (
            not isinstance(chunk, list)
            or len(chunk) != 2
            or not isinstance(chunk[0], str)
            or not _is_int(chunk[1])
        ):
            _refuse(Refusal.MANIFEST_INVALID, path, "a chunk is not [sha256, size]")
        refs.append(ChunkRef(chunk[0], chunk[1]))
    return Entry(path, kind, mode=mode, size=size, chunks=tuple(refs))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_manifest(manifest: TreeManifest, limits: Limits) -> None:
    """Refuse a manifest a restore must not write; see the module docstring."""
    if len(manifest.entries) > limits.max_entries:
        _refuse(Refusal.TOO_MANY_ENTRIES, "", f"{len(manifest.entries)} > {limits.max_entries}")
    kinds: dict[str, EntryType] = {}
    targets: dict[str, str] = {}
    total = 0
    for entry in manifest.entries:
        check_path(entry.path, limits)
        if entry.path in kinds:
            _refuse(Refusal.DUPLICATE_PATH, entry.path, "listed twice")
        parent = entry.path.rpartition("/")[0]
        if parent:
            parent_kind = kinds.get(parent)
            if parent_kind is EntryType.SYMLINK:
                _refuse(Refusal.BENEATH_SYMLINK, entry.path, f"{parent!r} is a symlink")
            if parent_kind is not EntryType.DIR:
                _refuse(
                    Refusal.PARENT_MISSING, entry.path, f"{parent!r} is not a directory before it"
                )
        kinds[entry.path] = entry.type
        if entry.type is EntryType.SYMLINK:
            _check_target_text(entry, limits)
            targets[entry.path] = entry.target
            continue
        if entry.mode & ~PERMISSION_BITS or entry.mode < 0:
            _refuse(Refusal.MANIFEST_INVALID, entry.path, "mode is not permission bits")
        if entry.type is EntryType.DIR:
            if entry.size or entry.chunks:
                _refuse(Refusal.MANIFEST_INVALID, entry.path, "a directory with content")
            continue
        _check_chunks(entry)
        total += entry.size
        if total > limits.max_bytes:
            _refuse(Refusal.TOO_MANY_BYTES, entry.path, f"more than {limits.max_bytes} bytes")
    for link, target in targets.items():
        resolve_inside(link, target, targets)


def check_path(path: str, limits: Limits) -> None:
    """A relative ``/``-separated path of plain names, or a refusal."""
    if not path or len(path) > limits.max_path_chars:
        _refuse(Refusal.PATH_ESCAPE, path[:200], "empty or too long")
    if path.startswith("/") or "\x00" in path:
        _refuse(Refusal.PATH_ESCAPE, path, "absolute or holds NUL")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            _refuse(Refusal.PATH_ESCAPE, path, f"component {part!r}")


def _check_target_text(entry: Entry, limits: Limits) -> None:
    target = entry.target
    if not target or len(target) > limits.max_path_chars or "\x00" in target:
        _refuse(Refusal.MANIFEST_INVALID, entry.path, "symlink target empty, too long or NUL")
    if target.startswith("/"):
        _refuse(Refusal.SYMLINK_ESCAPE, entry.path, "absolute target")


def _check_chunks(entry: Entry) -> None:
    if entry.size < 0 or sum(c.size for c in entry.chunks) != entry.size:
        _refuse(Refusal.MANIFEST_INVALID, entry.path, "size is not the sum of its chunks")
    for chunk in entry.chunks:
        if not _SHA256_HEX.fullmatch(chunk.sha256) or not 0 < chunk.size <= CHUNK_BYTES:
            _refuse(Refusal.MANIFEST_INVALID, entry.path, "a chunk digest or size is invalid")


def resolve_inside(link: str, target: str, links: Mapping[str, str]) -> str:
    """Where ``link -> target`` leads, following ``links``; refused if outside the root.

    Resolution is component by component, as the kernel does it: a name that is itself
    a link is replaced by its target before the next ``..`` applies, so a chain of
    links that each stay inside cannot add up to an escape. A loop is refused too.
    """
    stack = link.split("/")[:-1]
    pending = list(reversed(target.split("/")))
    hops = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                _refuse(Refusal.SYMLINK_ESCAPE, link, f"{target!r} leaves the root")
            stack.pop()
            continue
        stack.append(part)
        followed = links.get("/".join(stack))
        if followed is None:
            continue
        hops += 1
        if hops > MAX_SYMLINK_HOPS:
            _refuse(Refusal.SYMLINK_ESCAPE, link, "too many levels of symlinks")
        stack.pop()
        if followed.startswith("/"):
            _refuse(Refusal.SYMLINK_ESCAPE, link, f"{target!r} leads to an absolute target")
        pending.extend(reversed(followed.split("/")))
    return "/".join(stack)


def sorted_entries(entries: Iterable[Entry]) -> tuple[Entry, ...]:
    """Entries in manifest order: by path components, so a directory precedes its content."""
    return tuple(sorted(entries, key=lambda entry: entry.path.split("/")))


def _refuse(kind: Refusal, path: str, detail: str) -> NoReturn:
    raise SnapshotRefusedError(kind, path, detail)
