"""Snapshots on storage without rename: a shared mount or an object store.

docs/spec.md section 8.13. The same snapshot layout as :mod:`.layout` (section 8.1),
kept as objects of a :class:`turnpoint.storage.Storage` under keys
``<checkpoint_id>/...``, published in an order that needs no rename and no directory
fsync:

1. every participant object the manifest names is there with its size (a HEAD per
   object, never a listing: a listing may lag on some stores) and the anchor's tree
   matches its digest (``VERIFIED``);
2. every file of the anchor, which its source wrote into a local staging directory, is
   put under ``<checkpoint_id>/trainer/anchor/`` (``TREE_SYNCED``);
3. the manifest is created with the store's commit write, which never replaces
   (``MANIFEST_STAGED`` just before it, ``MANIFEST_LINKED`` and ``SNAPSHOT_SYNCED``
   after it): its presence is the commit;
4. ``LATEST`` is put when it is missing, unreadable or older (``LATEST_STAGED`` before,
   ``LATEST_MOVED`` after).

A crash anywhere leaves objects without a manifest (a partial, removed by
:meth:`StoreLayout.clean_partial`) or a manifest whose every object is whole;
``LATEST`` only ever names a snapshot whose manifest was created before it. Readers
select by manifest (section 7.7): a manifest newer than ``LATEST`` is trusted, ``LATEST``
is a pointer for people and tools.

Restore reads the anchor back into a local cache directory and checks its tree digest
there before the anchor's loader sees it, so the loaders work on files as before.
Everything here blocks: the async side calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from turnpoint.ids import checkpoint_sequence
from turnpoint.protocol import ArtifactRef
from turnpoint.storage import (
    ObjectExistsError,
    ObjectMissingError,
    Storage,
    check_key,
    open_storage,
)
from turnpoint.trainer.storage.layout import (
    PublishedSnapshots,
    PublishStep,
    SnapshotLayout,
    check_anchor_digest,
    parse_published,
    sequence_of,
    sequence_or_none,
    tree_digest,
)
from turnpoint.trainer.storage.manifest import (
    ANCHOR_DIR,
    LATEST_NAME,
    MANIFEST_NAME,
    TRAINER_DIR,
    ManifestError,
    SnapshotManifest,
    check_id,
)

# Requests in flight at once when checking a snapshot's objects.
_CHECK_THREADS = 16
# A snapshot manifest of a few thousand participants stays far below this; it bounds
# what a tampered object can make a reader allocate.
_MAX_MANIFEST_BYTES = 256 * 1024 * 1024


class StoreLayout(PublishedSnapshots):
    """Publishes, lists, loads and retires snapshots kept in a :class:`Storage`.

    ``staging`` is a local directory for the anchor a source writes before it is put
    and for anchors read back by a restore (default: a fresh temporary directory,
    removed by :meth:`close`, and by the next default layout on the machine when its
    process died without closing it: :func:`owned_staging`). ``after_step`` is the crash-injection hook of
    :class:`~turnpoint.trainer.storage.layout.SnapshotLayout`, at the same named steps.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        staging: str | os.PathLike[str] | None = None,
        after_step: Callable[[PublishStep], None] | None = None,
    ) -> None:
        self.storage = storage
        self._owns_staging = staging is None
        self._staging_lock: int | None = None
        if staging is None:
            self.staging, self._staging_lock = owned_staging()
        else:
            self.staging = Path(staging)
        self._after_step = after_step
        self._in_progress: str | None = None

    @property
    def root(self) -> str:
        """The storage's URL."""
        return self.storage.url

    def close(self) -> None:
        if self._owns_staging:
            shutil.rmtree(self.staging, ignore_errors=True)
        if self._staging_lock is not None:
            os.close(self._staging_lock)
            self._staging_lock = None

    # -- paths -------------------------------------------------------------------------

    def path(self, checkpoint_id: str) -> Path:
        """The local staging (or restore cache) directory of ``checkpoint_id``."""
        return self.staging / check_id(checkpoint_id, "checkpoint_id")

    def trainer_dir(self, checkpoint_id: str) -> Path:
        return self.path(checkpoint_id) / TRAINER_DIR

    def anchor_dir(self, checkpoint_id: str) -> Path:
        return self.path(checkpoint_id) / ANCHOR_DIR

    def is_published(self, checkpoint_id: str) -> bool:
        return self.storage.size(_manifest_key(checkpoint_id)) is not None

    @property
    def in_progress(self) -> str | None:
        return self._in_progress

    # -- writing -----------------------------------------------------------------------

    def begin(self, checkpoint_id: str) -> Path:
        """As :meth:`SnapshotLayout.begin`; returns the local staging directory."""
        sequence = sequence_of(checkpoint_id)
        if self.is_published(checkpoint_id):
            raise ManifestError(
                f"snapshot {checkpoint_id!r} is already published", checkpoint_id=checkpoint_id
            )
        newest = self.list_published()
        if newest and sequence <= checkpoint_sequence(newest[0]):
            raise ManifestError(
                f"checkpoint id {checkpoint_id!r} is not newer than the published "
                f"{newest[0]!r}: checkpoint sequences must increase",
                checkpoint_id=checkpoint_id,
            )
        self._delete_prefix(checkpoint_id)
        snapshot = self.path(checkpoint_id)
        shutil.rmtree(snapshot, ignore_errors=True)
        (snapshot / TRAINER_DIR).mkdir(parents=True)
        self._in_progress = checkpoint_id
        return snapshot

    def discard(self, checkpoint_id: str) -> bool:
        if self.is_published(checkpoint_id):
            raise ManifestError(
                f"snapshot {checkpoint_id!r} is published; use retain() to delete snapshots",
                checkpoint_id=checkpoint_id,
            )
        if self._in_progress == checkpoint_id:
            self._in_progress = None
        staged = self.path(checkpoint_id)
        had_staging = staged.exists()
        shutil.rmtree(staged, ignore_errors=True)
        return self._delete_prefix(checkpoint_id) > 0 or had_staging

    def publish(
        self, snapshot: Path, manifest: SnapshotManifest, *, verify_artifacts: bool = False
    ) -> Path:
        """Upload the anchor, create the manifest (the commit), then move ``LATEST``."""
        checkpoint_id = manifest.checkpoint_id
        staged = self.path(checkpoint_id)
        if Path(snapshot).resolve() != staged.resolve():
            raise ManifestError(
                f"manifest for {checkpoint_id!r} cannot be published from {snapshot}; "
                f"its staging directory is {staged}",
                checkpoint_id=checkpoint_id,
            )
        if self.is_published(checkpoint_id):
            raise ManifestError(
                f"snapshot {checkpoint_id!r} is already published", checkpoint_id=checkpoint_id
            )
        anchor = staged / manifest.anchor.path
        anchor_on_store = not anchor.exists()
        for relative, _ in _files_below(staged):
            try:
                object_key(relative)
            except ValueError as error:
                raise ManifestError(
                    f"snapshot {checkpoint_id!r}: {error}", checkpoint_id=checkpoint_id
                ) from None
        # An anchor source that writes onto the store itself (the torch DCP anchor given
        # the storage) stages nothing: its objects are checked where they are.
        digest = (
            stored_tree_digest(self.storage, f"{checkpoint_id}/{manifest.anchor.path}")
            if anchor_on_store
            else tree_digest(anchor)
        )
        if digest != manifest.anchor.sha256:
            raise ManifestError(
                f"snapshot {checkpoint_id!r}: trainer anchor digest is {digest}, "
                f"manifest says {manifest.anchor.sha256}",
                checkpoint_id=checkpoint_id,
                field="anchor.sha256",
            )
        self.verify_artifacts(manifest, digests=verify_artifacts)
        self._step(PublishStep.VERIFIED)

        for relative, path in _files_below(staged):
            self.storage.put(f"{checkpoint_id}/{object_key(relative)}", path.read_bytes())
        self._step(PublishStep.TREE_SYNCED)

        self._step(PublishStep.MANIFEST_STAGED)
        try:
            self.storage.create(_manifest_key(checkpoint_id), manifest.to_json())
        except ObjectExistsError:
            raise ManifestError(
                f"snapshot {checkpoint_id!r} was published concurrently",
                checkpoint_id=checkpoint_id,
            ) from None
        self._step(PublishStep.MANIFEST_LINKED)
        if self._in_progress == checkpoint_id:
            self._in_progress = None
        self._step(PublishStep.SNAPSHOT_SYNCED)

        current = self._read_latest_leniently()
        if current is None or checkpoint_sequence(current) < manifest.sequence:
            self._step(PublishStep.LATEST_STAGED)
            self.storage.put(LATEST_NAME, f"{checkpoint_id}\n".encode("ascii"))
            self._step(PublishStep.LATEST_MOVED)
        return staged

    def verify_artifacts(self, manifest: SnapshotManifest, *, digests: bool = True) -> None:
        """Every participant object the manifest names: there, its size, its sha256.

        With ``digests=False`` the sizes only (one HEAD per object). The requests run
        ``_CHECK_THREADS`` at a time: a store's cost is its round trips, not its
        bandwidth. Raises :class:`ManifestError` for the first mismatch in the
        manifest's order.
        """
        checkpoint_id = manifest.checkpoint_id
        named = list(_named(manifest))

        def problem(artifact: ArtifactRef) -> str | None:
            key = f"{checkpoint_id}/{artifact.path}"
            if not digests:
                size = self.storage.size(key)
                if size is None:
                    return "is missing"
                if size != artifact.size_bytes:
                    return f"has {size} bytes, manifest says {artifact.size_bytes}"
                return None
            try:
                data = self.storage.get(key, limit=artifact.size_bytes)
            except ObjectMissingError:
                return "is missing"
            if len(data) != artifact.size_bytes:
                return f"has {len(data)} bytes, manifest says {artifact.size_bytes}"
            if hashlib.sha256(data).hexdigest() != artifact.sha256:
                return "does not match its sha256"
            return None

        if len(named) > 1:
            with ThreadPoolExecutor(min(_CHECK_THREADS, len(named))) as pool:
                problems = list(pool.map(problem, named))
        else:
            problems = [problem(artifact) for artifact in named]
        for artifact, why in zip(named, problems, strict=True):
            if why is not None:
                raise ManifestError(
                    f"snapshot {checkpoint_id!r}: {artifact.path} {why}",
                    checkpoint_id=checkpoint_id,
                    field="participants",
                )

    def _step(self, step: PublishStep) -> None:
        if self._after_step is not None:
            self._after_step(step)

    # -- reading -----------------------------------------------------------------------

    def latest(self) -> str | None:
        """The id ``LATEST`` names, or ``None``; a bad ``LATEST`` is reported."""
        try:
            text = self.storage.get(LATEST_NAME, limit=256)
        except ObjectMissingError:
            return None
        return self._checked_latest(text, f"{self.root}/{LATEST_NAME}")

    def list_published(self) -> list[str]:
        """Published snapshot ids (a manifest object exists), newest first."""
        found: list[tuple[int, str]] = []
        for info in self.storage.list():
            name, _, rest = info.key.partition("/")
            sequence = sequence_or_none(name)
            if rest == MANIFEST_NAME and sequence is not None:
                found.append((sequence, name))
        found.sort(reverse=True)
        return [name for _, name in found]

    def manifest_bytes(self, checkpoint_id: str) -> bytes:
        """The published manifest's bytes, unchecked (``ObjectMissingError`` if none)."""
        return self.storage.get(_manifest_key(checkpoint_id), limit=_MAX_MANIFEST_BYTES)

    def load(self, checkpoint_id: str) -> SnapshotManifest:
        """Read and parse the manifest, fetch the anchor into the cache, check its digest."""
        key = _manifest_key(checkpoint_id)
        try:
            data = self.storage.get(key, limit=_MAX_MANIFEST_BYTES)
        except ObjectMissingError:
            raise ManifestError(
                f"snapshot {checkpoint_id!r} is not published (no {MANIFEST_NAME})",
                checkpoint_id=checkpoint_id,
            ) from None
        manifest = parse_published(data, checkpoint_id, f"{self.root}/{key}")
        cache = self.path(checkpoint_id)
        shutil.rmtree(cache, ignore_errors=True)
        prefix = f"{checkpoint_id}/{manifest.anchor.path}/"
        for info in self.storage.list(prefix):
            try:
                target = cache / file_path(info.key.partition("/")[2])
            except ValueError:
                # Not a name publication writes: a stray object under the prefix (the
                # tree digest below then fails if the anchor lacks a file).
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.storage.get(info.key))
        anchor = cache / manifest.anchor.path
        check_anchor_digest(
            manifest, tree_digest(anchor) if anchor.is_dir() else "(no anchor objects)"
        )
        return manifest

    # -- housekeeping ------------------------------------------------------------------

    def retain(self, keep: int) -> list[str]:
        """Delete published snapshots beyond the newest ``keep`` (``LATEST``'s kept).

        Each deletion removes the manifest first, so a crash midway leaves a partial.
        Every key a manifest names lies under its own ``<checkpoint_id>/``, so removing
        a doomed snapshot's prefix deletes nothing a retained manifest names.
        """
        doomed = self._doomed(keep)
        for checkpoint_id in reversed(doomed):  # oldest first
            self.storage.delete(_manifest_key(checkpoint_id))
            self._delete_prefix(checkpoint_id)
            shutil.rmtree(self.path(checkpoint_id), ignore_errors=True)
        return doomed

    def clean_partial(self) -> list[str]:
        """Delete every snapshot's objects that no manifest publishes (not the one in
        progress); names that are not checkpoint ids are never touched. The listing only
        nominates: a snapshot is partial once a read of its manifest key finds none."""
        by_snapshot: dict[str, bool] = {}
        for info in self.storage.list():
            name, _, rest = info.key.partition("/")
            if rest and sequence_or_none(name) is not None:
                by_snapshot[name] = by_snapshot.get(name, False) or rest == MANIFEST_NAME
        removed = []
        for name, published in sorted(by_snapshot.items()):
            # A listing may lag and miss the manifest, the newest object of a
            # publication: only a read of the manifest's own key says it is not there.
            if published or name == self._in_progress or self.is_published(name):
                continue
            self._delete_prefix(name)
            removed.append(name)
        return removed

    def _delete_prefix(self, checkpoint_id: str) -> int:
        objects = self.storage.list(f"{check_id(checkpoint_id, 'checkpoint_id')}/")
        for info in objects:
            self.storage.delete(info.key)
        return len(objects)


# An anchor's files have whatever names its source gives them (DCP writes ``.metadata``
# and ``__0_0.distcp``), and a key component must be a valid id (section 8.12): a name
# that is not one, or that starts with the escape mark, is written as the mark followed
# by the name with every byte outside [A-Za-z0-9.-] as ``_XX`` (hex).
_ESCAPED = "x--"
_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")


def object_key(relative: str) -> str:
    """The key (below ``<checkpoint_id>/``) of the staged file at POSIX path ``relative``.

    docs/spec.md section 8.13: a component that is a valid id and does not start with
    ``x--`` is kept; any other is escaped. ``ValueError`` for a name too long to escape.
    """
    parts = []
    for part in relative.split("/"):
        if _is_key_component(part) and not part.startswith(_ESCAPED):
            parts.append(part)
            continue
        escaped = _ESCAPED + "".join(
            chr(byte) if chr(byte) in _PLAIN else f"_{byte:02X}" for byte in part.encode()
        )
        if not _is_key_component(escaped):
            raise ValueError(f"file name {part!r} is too long to be stored as an object")
        parts.append(escaped)
    return "/".join(parts)


def file_path(key: str) -> str:
    """The relative path :func:`object_key` turned into ``key``; ``ValueError`` if none."""
    parts = []
    for part in check_key(key).split("/"):
        if not part.startswith(_ESCAPED):
            parts.append(part)
            continue
        body, raw = part[len(_ESCAPED) :], bytearray()
        index = 0
        while index < len(body):
            if body[index] == "_":
                raw.append(int(body[index + 1 : index + 3], 16))
                index += 3
            else:
                raw.append(ord(body[index]))
                index += 1
        name = raw.decode()
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"key component {part!r} does not name a file")
        parts.append(name)
    return "/".join(parts)


def stored_tree_digest(storage: Storage, prefix: str, files: Iterable[str] | None = None) -> str:
    """:func:`~turnpoint.trainer.storage.layout.tree_digest` of the files kept as objects
    under ``prefix`` (docs/spec.md section 8.8 item 2, over the files' own names).

    ``files`` names them (relative to ``prefix``) when the writer knows what it wrote,
    so that no listing, which may lag, decides what the digest covers; without it the
    objects under ``prefix`` are listed. ``ManifestError`` when there are none.
    """
    if files is None:
        files = [file_path(info.key)[len(prefix) + 1 :] for info in storage.list(f"{prefix}/")]
    names = sorted(set(files))
    if not names:
        raise ManifestError(f"{storage.url}/{prefix}: no objects")
    listing = hashlib.sha256()
    for name in names:
        try:
            data = storage.get(f"{prefix}/{object_key(name)}")
        except ObjectMissingError:
            raise ManifestError(f"{storage.url}/{prefix}: {name} is missing") from None
        listing.update(f"{hashlib.sha256(data).hexdigest()}  {len(data)}  {name}\n".encode())
    return listing.hexdigest()


def _is_key_component(part: str) -> bool:
    try:
        check_key(part)
    except ValueError:
        return False
    return True


def _manifest_key(checkpoint_id: str) -> str:
    return f"{check_id(checkpoint_id, 'checkpoint_id')}/{MANIFEST_NAME}"


def _named(manifest: SnapshotManifest) -> Iterable[ArtifactRef]:
    for entry in manifest.participants:
        yield from entry.artifacts
        if entry.manifest is not None:
            yield entry.manifest


_STAGING_PREFIX = "turnpoint-staging-"
_STAGING_LOCK = ".owner.lock"


def owned_staging(parent: Path | None = None) -> tuple[Path, int]:
    """A fresh staging directory under ``parent`` (the temporary directory by default)
    and the descriptor of the lock that marks it owned: an exclusive ``flock`` on a file
    inside it, held until the descriptor is closed, which the kernel does when the owner
    dies. Every staging directory there whose lock is free (its owner died without
    removing it: a trainer killed mid-snapshot) is removed first. A lock works across
    processes and pid namespaces on one filesystem, where a pid would not. Blocking."""
    base = Path(tempfile.gettempdir()) if parent is None else parent
    for old in base.glob(f"{_STAGING_PREFIX}*"):
        _remove_if_abandoned(old)
    directory = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=base))
    lock = os.open(directory / _STAGING_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return directory, lock


def _remove_if_abandoned(directory: Path) -> None:
    try:
        lock = os.open(directory / _STAGING_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (made by hand, or by an older version), or gone
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # owned by a live process
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        os.close(lock)


def _files_below(directory: Path) -> list[tuple[str, Path]]:
    found = []
    for current, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in filenames:
            path = Path(current, name)
            found.append((path.relative_to(directory).as_posix(), path))
    return sorted(found)


def open_layout(
    root: str | os.PathLike[str],
    *,
    after_step: Callable[[PublishStep], None] | None = None,
) -> SnapshotLayout | StoreLayout:
    """The layout for ``snapshot_root``: a plain path keeps :class:`SnapshotLayout`
    (section 8.9, unchanged); a URL gets a :class:`StoreLayout` on its storage, checked
    once (:class:`~turnpoint.storage.StorageAccessError` for refused credentials).
    Blocking."""
    if not (isinstance(root, str) and "://" in root):
        return SnapshotLayout(Path(root), after_step=after_step)
    storage = open_storage(root)
    storage.check()
    return StoreLayout(storage, after_step=after_step)
