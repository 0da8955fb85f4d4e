"""Where snapshots live on disk, and how they are published, loaded and retired.

docs/spec.md sections 8.1 and 8.8-8.10. The manifest's own format is
:mod:`turnpoint.trainer.storage.manifest`.

Layout on disk
--------------
::

    <root>/
      LATEST                        id of the newest published snapshot
      <checkpoint_id>/
        <instance>/...              each participant's own store (docs/spec.md section 8.2)
        trainer/anchor/...          the trainer anchor (model, optimizer, step, loader)
        MANIFEST.json               written last: its presence is what "published" means

Two designs were possible. One stages a whole snapshot in a hidden directory and renames
it into place. The other, used here, writes every part in its final place and makes the
top-level ``MANIFEST.json`` the commit record, as a database does with its commit log
entry. Staging-and-rename does not fit this protocol: participants build their paths from
the validated checkpoint id (``<root>/<checkpoint_id>/<instance>``; nothing in a request
may name another path, and a hidden ``.staging-*`` name is not a valid id), so their
files would have to be moved under them, and a retry of their commit would write into a
directory that no longer exists.

Publication therefore goes: every file and directory the trainer wrote in the snapshot
is fsynced (the participants' are durable from their commit answers, docs/spec.md
section 8.4, and the anchor's tree from its source's return, section 8.8: neither is
synced again); the manifest is written to a temporary file in
``<root>`` and fsynced; it is hard-linked to ``<checkpoint_id>/MANIFEST.json``, which is
atomic and never replaces an existing manifest (exclusive create without the risk of a
half-written file under the final name); the snapshot directory is fsynced; then
``LATEST`` is replaced atomically (temporary file, fsync, ``os.replace``, fsync of the
root, which also makes the temporary manifest name's removal durable). One fsync per
file and per directory. A crash at any point leaves
``LATEST`` naming a complete snapshot (the previous one, or the new one once its manifest
is linked) or nothing. A snapshot directory without a manifest is a partial that
:meth:`SnapshotLayout.clean_partial` removes, unless it is the one being written now.
Retention unlinks a snapshot's manifest before deleting its files, so a crash during a
deletion leaves a partial, never a published snapshot with missing bytes.

The durable steps are the core's :mod:`turnpoint._files`:
:func:`~turnpoint._files.create_file` for the manifest,
:func:`~turnpoint._files.replace_file` for ``LATEST``.

Everything here blocks (fsync, hashing): the async side calls it through
``asyncio.to_thread``.
"""

from __future__ import annotations

import enum
import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from turnpoint._files import (
    TEMP_SUFFIX,
    create_file,
    fsync_dir,
    fsync_file,
    fsync_tree,
    replace_file,
)
from turnpoint.ids import InvalidIdError, checkpoint_sequence
from turnpoint.trainer.storage.manifest import (
    ANCHOR_DIR,
    LATEST_NAME,
    MANIFEST_NAME,
    TRAINER_DIR,
    ManifestError,
    SnapshotManifest,
    check_id,
)

_MANIFEST_PREFIX = ".MANIFEST-"
_LATEST_PREFIX = ".LATEST-"
_TMP_PREFIXES = (_MANIFEST_PREFIX, _LATEST_PREFIX)
_CHUNK = 1 << 20


# -- digests ---------------------------------------------------------------------------


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _walk_files(directory: Path) -> Iterator[tuple[str, Path]]:
    """(relative POSIX path, path) of every regular file below ``directory``, sorted."""
    found: list[tuple[str, Path]] = []
    for current, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in filenames:
            path = Path(current, name)
            mode = path.lstat().st_mode
            if not stat.S_ISREG(mode):
                raise ManifestError(f"{path}: not a regular file (symlinks are not followed)")
            found.append((path.relative_to(directory).as_posix(), path))
        for name in dirnames:
            path = Path(current, name)
            if path.is_symlink():
                raise ManifestError(f"{path}: symlinked directory (symlinks are not followed)")
    found.sort()
    return iter(found)


def tree_digest(directory: Path) -> str:
    """sha256 over the listing of every file below ``directory``: digest, size, path.

    docs/spec.md section 8.8, item 2. Any change of a byte, a name, or a file added or
    removed changes the digest.
    """
    if not directory.is_dir() or directory.is_symlink():
        raise ManifestError(f"{directory}: no such directory")
    listing = hashlib.sha256()
    for relative, path in _walk_files(directory):
        size = path.stat().st_size
        listing.update(f"{_file_sha256(path)}  {size}  {relative}\n".encode())
    return listing.hexdigest()


# -- the layout ------------------------------------------------------------------------


class PublishStep(enum.Enum):
    """Points in :meth:`SnapshotLayout.publish` after which a crash can be injected."""

    VERIFIED = "verified"
    TREE_SYNCED = "tree_synced"
    MANIFEST_STAGED = "manifest_staged"
    MANIFEST_LINKED = "manifest_linked"
    SNAPSHOT_SYNCED = "snapshot_synced"
    LATEST_STAGED = "latest_staged"
    LATEST_MOVED = "latest_moved"


class PublishedSnapshots:
    """What every layout decides the same way over its own reads (a directory's files or
    a store's objects, docs/spec.md sections 8.9 and 8.12): what ``LATEST`` may name, what
    a published manifest must say of itself and its anchor, and which snapshots a
    retention keeps. Subclasses read and delete; this decides."""

    def latest(self) -> str | None:
        raise NotImplementedError

    def is_published(self, checkpoint_id: str) -> bool:
        raise NotImplementedError

    def list_published(self) -> list[str]:
        raise NotImplementedError

    def _checked_latest(self, text: bytes, where: str) -> str:
        """The checkpoint id ``LATEST``'s bytes name, which must be published."""
        try:
            checkpoint_id = text.decode("ascii").strip()
            sequence_of(checkpoint_id)
        except (UnicodeDecodeError, ManifestError):
            raise ManifestError(f"{where}: does not hold a checkpoint id: {text!r}") from None
        if not self.is_published(checkpoint_id):
            raise ManifestError(
                f"{where} names {checkpoint_id!r}, which is not a published snapshot",
                checkpoint_id=checkpoint_id,
            )
        return checkpoint_id

    def _read_latest_leniently(self) -> str | None:
        try:
            return self.latest()
        except ManifestError:
            return None

    def _doomed(self, keep: int) -> list[str]:
        """The published snapshots beyond the newest ``keep``, newest first; the one
        ``LATEST`` names is always kept."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        published = self.list_published()
        protected = set(published[:keep])
        latest = self._read_latest_leniently()
        if latest is not None:
            protected.add(latest)
        return [c for c in published if c not in protected]


def parse_published(data: bytes, checkpoint_id: str, where: str) -> SnapshotManifest:
    """A published manifest, strictly parsed; it must describe ``checkpoint_id``."""
    manifest = SnapshotManifest.from_json(data)
    if manifest.checkpoint_id != checkpoint_id:
        raise ManifestError(
            f"{where} describes {manifest.checkpoint_id!r}, not {checkpoint_id!r}",
            checkpoint_id=checkpoint_id,
            field="checkpoint_id",
        )
    return manifest


def check_anchor_digest(manifest: SnapshotManifest, digest: str) -> None:
    """The trainer anchor as read must match the digest its manifest records."""
    if digest != manifest.anchor.sha256:
        raise ManifestError(
            f"snapshot {manifest.checkpoint_id!r}: trainer anchor does not match its digest "
            f"(found {digest}, manifest says {manifest.anchor.sha256})",
            checkpoint_id=manifest.checkpoint_id,
            field="anchor.sha256",
        )


class SnapshotLayout(PublishedSnapshots):
    """Publishes, lists, loads and retires snapshots under one root directory.

    ``after_step`` is called after each :class:`PublishStep`; tests raise from it to
    simulate a crash at that point (a named, deterministic fault).
    """

    def __init__(
        self, root: str | Path, *, after_step: Callable[[PublishStep], None] | None = None
    ) -> None:
        self.root = Path(root)
        self._after_step = after_step
        self._in_progress: str | None = None

    # -- paths -------------------------------------------------------------------------

    def path(self, checkpoint_id: str) -> Path:
        """``<root>/<checkpoint_id>``; the id is validated, so it is one safe component."""
        return self.root / check_id(checkpoint_id, "checkpoint_id")

    def trainer_dir(self, checkpoint_id: str) -> Path:
        return self.path(checkpoint_id) / TRAINER_DIR

    def anchor_dir(self, checkpoint_id: str) -> Path:
        return self.path(checkpoint_id) / ANCHOR_DIR

    def is_published(self, checkpoint_id: str) -> bool:
        manifest = self.path(checkpoint_id) / MANIFEST_NAME
        try:
            return stat.S_ISREG(manifest.lstat().st_mode)
        except FileNotFoundError:
            return False

    @property
    def in_progress(self) -> str | None:
        """The snapshot begun and not yet published or discarded, if any."""
        return self._in_progress

    # -- writing -----------------------------------------------------------------------

    def begin(self, checkpoint_id: str) -> Path:
        """Prepare ``<root>/<checkpoint_id>`` for a new snapshot and return it.

        Call before any participant commits to this id. A leftover of an earlier,
        unpublished attempt at the same id is removed first: it was never published, and
        mixing two cuts in one directory would break the snapshot. An id that is already
        published, or not newer than the newest published one, is refused.
        """
        sequence = sequence_of(checkpoint_id)
        snapshot = self.path(checkpoint_id)
        if self.is_published(checkpoint_id):
            raise ManifestError(
                f"snapshot {checkpoint_id!r} is already published",
                checkpoint_id=checkpoint_id,
            )
        newest = self.list_published()
        if newest and sequence <= checkpoint_sequence(newest[0]):
            raise ManifestError(
                f"checkpoint id {checkpoint_id!r} is not newer than the published "
                f"{newest[0]!r}: checkpoint sequences must increase",
                checkpoint_id=checkpoint_id,
            )
        if snapshot.exists():
            shutil.rmtree(snapshot)
        (snapshot / TRAINER_DIR).mkdir(parents=True)
        self._in_progress = checkpoint_id
        return snapshot

    def discard(self, checkpoint_id: str) -> bool:
        """Delete an unpublished snapshot (an aborted round). Published ones are refused."""
        if self.is_published(checkpoint_id):
            raise ManifestError(
                f"snapshot {checkpoint_id!r} is published; use retain() to delete snapshots",
                checkpoint_id=checkpoint_id,
            )
        if self._in_progress == checkpoint_id:
            self._in_progress = None
        snapshot = self.path(checkpoint_id)
        if not snapshot.exists():
            return False
        shutil.rmtree(snapshot)
        return True

    def publish(
        self, snapshot: Path, manifest: SnapshotManifest, *, verify_artifacts: bool = False
    ) -> Path:
        """Make ``snapshot`` durable and published, then point ``LATEST`` at it.

        Checks first that every file the manifest names is there with its recorded size
        (and, with ``verify_artifacts``, its digest) and that the anchor digest matches
        the files on disk; a manifest naming bytes that are not there is never written.
        """
        checkpoint_id = manifest.checkpoint_id
        expected = self.path(checkpoint_id)
        # The same path needs no resolving (a realpath is an lstat per component).
        if Path(snapshot) != expected and Path(snapshot).resolve() != expected.resolve():
            raise ManifestError(
                f"manifest for {checkpoint_id!r} cannot be published in {snapshot}; "
                f"its directory is {expected}",
                checkpoint_id=checkpoint_id,
            )
        if not expected.is_dir():
            raise ManifestError(
                f"snapshot directory {expected} does not exist; call begin() first",
                checkpoint_id=checkpoint_id,
            )
        if self.is_published(checkpoint_id):
            raise ManifestError(
                f"snapshot {checkpoint_id!r} is already published", checkpoint_id=checkpoint_id
            )
        self._verify_contents(expected, manifest, verify_artifacts=verify_artifacts)
        self._step(PublishStep.VERIFIED)

        # The trainer's own parts only: each participant's files and directory were
        # durable before its commit answered (docs/spec.md section 8.4), the anchor's
        # before its source returned it (section 8.8), and the snapshot directory itself
        # is synced once the manifest is linked.
        anchor = expected / manifest.anchor.path
        for child in sorted(expected.iterdir()):
            if child.name in manifest.instances:
                continue
            if child.is_dir() and not child.is_symlink():
                fsync_tree(child, durable=anchor)
            elif stat.S_ISREG(child.lstat().st_mode):
                fsync_file(child)
        self._step(PublishStep.TREE_SYNCED)

        # Temporary files are removed on ordinary errors only; after a crash they are
        # left for clean_partial(), which is what a crash test must see too. A hard link
        # is atomic and never replaces: exclusive create of a file that is complete from
        # its first instant.
        try:
            create_file(
                expected / MANIFEST_NAME,
                manifest.to_json(),
                temp_dir=self.root,
                temp_prefix=f"{_MANIFEST_PREFIX}{checkpoint_id}-",
                staged=lambda: self._step(PublishStep.MANIFEST_STAGED),
                linked=lambda: self._step(PublishStep.MANIFEST_LINKED),
                # The root is synced once LATEST has moved; a temporary name that a
                # crash brings back is removed by clean_partial().
                sync_temp_dir=False,
            )
        except FileExistsError:
            raise ManifestError(
                f"snapshot {checkpoint_id!r} was published concurrently",
                checkpoint_id=checkpoint_id,
            ) from None
        if self._in_progress == checkpoint_id:
            self._in_progress = None
        self._step(PublishStep.SNAPSHOT_SYNCED)

        current = self._read_latest_leniently()
        if current is None or checkpoint_sequence(current) < manifest.sequence:
            self._move_latest(checkpoint_id)
        else:
            # LATEST stays: the root still has to be synced once (see create_file above).
            fsync_dir(self.root)
        return expected

    def _move_latest(self, checkpoint_id: str) -> None:
        replace_file(
            self.root / LATEST_NAME,
            f"{checkpoint_id}\n".encode("ascii"),
            temp_prefix=_LATEST_PREFIX,
            staged=lambda: self._step(PublishStep.LATEST_STAGED),
        )
        self._step(PublishStep.LATEST_MOVED)

    def _verify_contents(
        self, snapshot: Path, manifest: SnapshotManifest, *, verify_artifacts: bool
    ) -> None:
        checkpoint_id = manifest.checkpoint_id
        anchor_digest = tree_digest(snapshot / manifest.anchor.path)
        if anchor_digest != manifest.anchor.sha256:
            raise ManifestError(
                f"snapshot {checkpoint_id!r}: trainer anchor digest is {anchor_digest}, "
                f"manifest says {manifest.anchor.sha256}",
                checkpoint_id=checkpoint_id,
                field="anchor.sha256",
            )
        for entry in manifest.participants:
            named = list(entry.artifacts)
            if entry.manifest is not None:
                named.append(entry.manifest)
            for artifact in named:
                path = snapshot / artifact.path
                try:
                    info = path.lstat()
                except FileNotFoundError:
                    raise ManifestError(
                        f"snapshot {checkpoint_id!r}: {artifact.path} is missing",
                        checkpoint_id=checkpoint_id,
                        field="participants",
                    ) from None
                if not stat.S_ISREG(info.st_mode) or info.st_size != artifact.size_bytes:
                    raise ManifestError(
                        f"snapshot {checkpoint_id!r}: {artifact.path} has {info.st_size} "
                        f"bytes, manifest says {artifact.size_bytes}",
                        checkpoint_id=checkpoint_id,
                        field="participants",
                    )
                if verify_artifacts and _file_sha256(path) != artifact.sha256:
                    raise ManifestError(
                        f"snapshot {checkpoint_id!r}: {artifact.path} does not match its sha256",
                        checkpoint_id=checkpoint_id,
                        field="participants",
                    )

    def _step(self, step: PublishStep) -> None:
        if self._after_step is not None:
            self._after_step(step)

    # -- reading -----------------------------------------------------------------------

    def latest(self) -> str | None:
        """The id ``LATEST`` names, or ``None`` when nothing was published yet.

        A ``LATEST`` that is garbled or names a snapshot that is not published is
        reported, not hidden: publication never leaves it so, someone else did.
        """
        path = self.root / LATEST_NAME
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise ManifestError(f"{path}: unreadable: {error}") from None
        return self._checked_latest(text, str(path))

    def list_published(self) -> list[str]:
        """Published snapshot ids, newest (highest checkpoint sequence) first."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        found: list[tuple[int, str]] = []
        for entry in entries:
            sequence = sequence_or_none(entry.name)
            if sequence is None or not entry.is_dir(follow_symlinks=False):
                continue
            if self.is_published(entry.name):
                found.append((sequence, entry.name))
        found.sort(reverse=True)
        return [name for _, name in found]

    def manifest_bytes(self, checkpoint_id: str) -> bytes:
        """The published manifest's bytes, unchecked (``FileNotFoundError`` if none)."""
        return (self.path(checkpoint_id) / MANIFEST_NAME).read_bytes()

    def load(self, checkpoint_id: str) -> SnapshotManifest:
        """Parse a published manifest strictly and verify the trainer anchor digest."""
        snapshot = self.path(checkpoint_id)
        path = snapshot / MANIFEST_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ManifestError(
                f"snapshot {checkpoint_id!r} is not published (no {MANIFEST_NAME})",
                checkpoint_id=checkpoint_id,
            ) from None
        manifest = parse_published(data, checkpoint_id, str(path))
        check_anchor_digest(manifest, tree_digest(snapshot / manifest.anchor.path))
        return manifest

    # -- housekeeping ------------------------------------------------------------------

    def retain(self, keep: int) -> list[str]:
        """Delete published snapshots beyond the newest ``keep``; returns what went.

        The snapshot ``LATEST`` names is always kept. Each deletion unpublishes first
        (manifest unlinked and synced), so a crash midway leaves a partial that
        :meth:`clean_partial` removes, never a published snapshot with missing files.
        """
        doomed = self._doomed(keep)
        for checkpoint_id in reversed(doomed):  # oldest first
            snapshot = self.path(checkpoint_id)
            (snapshot / MANIFEST_NAME).unlink()
            fsync_dir(snapshot)
            shutil.rmtree(snapshot)
        if doomed:
            fsync_dir(self.root)
        return doomed

    def clean_partial(self) -> list[str]:
        """Remove unpublished snapshot directories and stale temporary files.

        The snapshot begun by this layout and not yet published is left alone; every
        other snapshot directory without a manifest is a crash leftover or an aborted
        round. Names this module did not create are never touched.
        """
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        removed: list[str] = []
        for entry in sorted(entries, key=lambda item: item.name):
            name = entry.name
            if name.startswith(_TMP_PREFIXES) and name.endswith(TEMP_SUFFIX):
                if entry.is_file(follow_symlinks=False):
                    Path(entry.path).unlink(missing_ok=True)
                    removed.append(name)
                continue
            if sequence_or_none(name) is None or not entry.is_dir(follow_symlinks=False):
                continue
            if name == self._in_progress or self.is_published(name):
                continue
            shutil.rmtree(entry.path)
            removed.append(name)
        if removed:
            fsync_dir(self.root)
        return removed


def sequence_of(checkpoint_id: str) -> int:
    """The checkpoint sequence of a valid id; a bad one is a :class:`ManifestError`."""
    check_id(checkpoint_id, "checkpoint_id")
    try:
        return checkpoint_sequence(checkpoint_id)
    except InvalidIdError as error:
        raise ManifestError(
            f"checkpoint id {checkpoint_id!r}: {error.why}", checkpoint_id=checkpoint_id
        ) from None


def sequence_or_none(name: str) -> int | None:
    """The checkpoint sequence ``name`` has, or None for a name that is no checkpoint id."""
    try:
        return checkpoint_sequence(name)
    except InvalidIdError:
        return None
