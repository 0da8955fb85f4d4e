"""Checking a published snapshot's bytes against its manifest (docs/spec.md section 8.5).

:func:`first_mismatch` is what ``turnpoint inspect`` and the status API's
``?verify=1`` run: the trainer anchor's tree digest, then every participant file the
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
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import ManifestError, SnapshotManifest

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
