"""Checking a published snapshot's bytes against its manifest (docs/spec.md section 8.5).

:func:`snapshot_mismatch` is what ``turnpoint inspect`` and the status API's
``?verify=1`` run, on a directory (:func:`first_mismatch`) or an object store: the trainer anchor's tree digest, then every participant file the
manifest names (no symlinks, a regular file, its size, its sha256), stopping at the
first mismatch. Blocking: it reads every byte it hashes; call it from a thread in
async code.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Final

from turnpoint.protocol import ArtifactRef
from turnpoint.storage import ObjectMissingError, Storage, StorageError
from turnpoint.trainer.storage.layout import SnapshotLayout, tree_digest
from turnpoint.trainer.storage.manifest import ManifestError, SnapshotManifest
from turnpoint.trainer.storage.objects import StoreLayout

_CHUNK: Final = 1 << 20


def first_mismatch(directory: Path, manifest: SnapshotManifest) -> tuple[int, str | None]:
    """How many files were checked, and the first one whose bytes do not match."""
    checked = 0
    anchor = manifest.anchor
    try:
        digest = tree_digest(directory / anchor.path)
    except (OSError, ManifestError) as error:
        return checked, f"trainer anchor {anchor.path}: {error}"
    checked += 1
    if digest != anchor.sha256:
        return checked, (
            f"trainer anchor {anchor.path}: tree digest {digest}, manifest says {anchor.sha256}"
        )
    for entry in manifest.participants:
        named = [] if entry.manifest is None else [entry.manifest]
        named += entry.artifacts
        for ref in named:
            problem = check_file(directory, ref)
            checked += 1
            if problem is not None:
                return checked, f"{entry.instance}: {problem}"
    return checked, None


def check_file(directory: Path, ref: ArtifactRef) -> str | None:
    """What is wrong with one file a manifest names (None: its bytes match)."""
    path = directory / ref.path
    try:
        # No symlinks: a snapshot names its own bytes, nothing outside it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"{ref.path} is missing"
    except OSError as error:
        return f"{ref.path} cannot be read: {error.strerror}"
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            return f"{ref.path} is not a regular file"
        if info.st_size != ref.size_bytes:
            return f"{ref.path} has {info.st_size} bytes, manifest says {ref.size_bytes}"
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    found = digest.hexdigest()
    if found != ref.sha256:
        return f"{ref.path} has sha256 {found}, manifest says {ref.sha256}"
    return None


def snapshot_mismatch(
    layout: SnapshotLayout | StoreLayout, checkpoint_id: str, manifest: SnapshotManifest
) -> tuple[int, str | None]:
    """:func:`first_mismatch` of a published snapshot, in a directory or on a store."""
    if not isinstance(layout, StoreLayout):
        return first_mismatch(layout.path(checkpoint_id), manifest)
    try:
        # Fetches the anchor's objects and checks their tree digest.
        layout.load(checkpoint_id)
    except (StorageError, ManifestError) as error:
        return 1, f"trainer anchor {manifest.anchor.path}: {error}"
    checked = 1
    for entry in manifest.participants:
        named = [] if entry.manifest is None else [entry.manifest]
        for ref in [*named, *entry.artifacts]:
            checked += 1
            problem = _check_object(layout.storage, f"{checkpoint_id}/{ref.path}", ref)
            if problem is not None:
                return checked, f"{entry.instance}: {problem}"
    return checked, None


def _check_object(storage: Storage, key: str, ref: ArtifactRef) -> str | None:
    try:
        data = storage.get(key, limit=ref.size_bytes)
    except ObjectMissingError:
        return f"{ref.path} is missing"
    except StorageError as error:
        return f"{ref.path} cannot be read: {error.message}"
    if len(data) != ref.size_bytes:
        more = "more than " if len(data) > ref.size_bytes else ""
        return f"{ref.path} has {more}{len(data)} bytes, manifest says {ref.size_bytes}"
    found = hashlib.sha256(data).hexdigest()
    if found != ref.sha256:
        return f"{ref.path} has sha256 {found}, manifest says {ref.sha256}"
    return None
