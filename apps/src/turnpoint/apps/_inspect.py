"""``turnpoint inspect <root>``: list the published snapshots and verify their bytes.

For every published snapshot under a root (newest first) the report gives its checkpoint
id, step, creation time, participants, how many episodes it continues and restarts, and
whether it is the one ``LATEST`` names; then it verifies every digest the manifest
names: the trainer anchor's tree digest and, for each participant, its own manifest and
records files (size and sha256 over the whole file). A snapshot is reported ``OK`` or
with the first mismatch found. The command exits non-zero on any mismatch, so that it
can guard a restore or a copy of the snapshot root in a script. It ends with the restore
candidates: the metrics each snapshot recorded and the order a restore by
``--restore-from`` (latest, a named snapshot, the best by a metric) tries them in
(docs/spec.md section 7.14), computed as the restorer computes it.

The checks read everything they hash (blocking I/O): call :func:`inspect_root` from a
thread when in async code.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

from turnpoint.storage import StorageError, open_storage
from turnpoint.trainer.restore.choice import (
    RestoreChoice,
    RestoreChoiceError,
    metrics_of,
    rank_candidates,
)
from turnpoint.trainer.restore.restorer import published_candidates
from turnpoint.trainer.storage.layout import SnapshotLayout
from turnpoint.trainer.storage.manifest import (
    MANIFEST_NAME,
    JSONValue,
    ManifestError,
    SnapshotManifest,
)
from turnpoint.trainer.storage.objects import StoreLayout
from turnpoint.trainer.storage.verify import snapshot_mismatch

EXIT_OK: Final = 0
EXIT_MISMATCH: Final = 1
EXIT_NO_ROOT: Final = 2


@dataclass(frozen=True, slots=True)
class SnapshotReport:
    """One published snapshot: what its manifest says and whether its bytes match.

    ``problem`` is the first mismatch found (None: every digest matched). When the
    manifest itself cannot be read, the fields it would have filled stay empty.
    """

    checkpoint_id: str
    latest: bool
    step: int | None = None
    created_at: float | None = None
    participants: tuple[str, ...] = ()
    continued: int = 0
    restarts: int = 0
    files_checked: int = 0
    problem: str | None = None
    metrics: tuple[tuple[str, float], ...] = ()

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "latest": self.latest,
            "step": self.step,
            "created_at": self.created_at,
            "participants": list(self.participants),
            "continued": self.continued,
            "restarts": self.restarts,
            "files_checked": self.files_checked,
            "ok": self.ok,
            "problem": self.problem,
            "metrics": dict(self.metrics),
        }


@dataclass(frozen=True, slots=True)
class InspectReport:
    """Every published snapshot under ``root``, newest first.

    ``latest_problem`` is set when ``LATEST`` is unreadable or names a snapshot that is
    not published: publication never leaves it so, so it counts as a mismatch.
    """

    root: Path | str
    latest: str | None
    snapshots: tuple[SnapshotReport, ...]
    latest_problem: str | None = None
    restore_from: str = "latest"
    restore_order: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.latest_problem is None and all(snapshot.ok for snapshot in self.snapshots)

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "root": str(self.root),
            "latest": self.latest,
            "latest_problem": self.latest_problem,
            "ok": self.ok,
            "snapshots": [snapshot.to_dict() for snapshot in self.snapshots],
            "restore": {"restore_from": self.restore_from, "order": list(self.restore_order)},
        }

    def render(self) -> str:
        """The human-readable report the command prints."""
        lines = [f"snapshots under {self.root}"]
        if self.latest_problem is not None:
            lines.append(f"LATEST: MISMATCH: {self.latest_problem}")
        if not self.snapshots:
            lines.append("no published snapshots")
        for snapshot in self.snapshots:
            lines.append("")
            lines.append(snapshot.checkpoint_id + ("  (LATEST)" if snapshot.latest else ""))
            if snapshot.step is not None and snapshot.created_at is not None:
                lines.append(f"  step {snapshot.step}, created {_format_time(snapshot.created_at)}")
                names = ", ".join(snapshot.participants) or "none"
                lines.append(f"  participants ({len(snapshot.participants)}): {names}")
                lines.append(
                    f"  episodes: {snapshot.continued} continued, {snapshot.restarts} restarted"
                )
            if snapshot.metrics:
                shown = ", ".join(f"{name}={value:g}" for name, value in snapshot.metrics)
                lines.append(f"  metrics: {shown}")
            verdict = "OK" if snapshot.problem is None else f"MISMATCH: {snapshot.problem}"
            lines.append(f"  digests ({snapshot.files_checked} checked): {verdict}")
        if self.snapshots:
            lines.append("")
            order = ", ".join(self.restore_order) or "none matches: a restore would fail"
            lines.append(f"restore candidates (restore_from = {self.restore_from}): {order}")
        if self.snapshots or self.latest_problem is not None:
            failed = sum(not snapshot.ok for snapshot in self.snapshots)
            lines.append("")
            if self.ok:
                lines.append(f"{len(self.snapshots)} snapshot(s), every digest matches")
            else:
                lines.append(
                    f"{failed} of {len(self.snapshots)} snapshot(s) failed verification"
                    + ("; LATEST is broken" if self.latest_problem is not None else "")
                )
        return "\n".join(lines)


def _format_time(epoch_seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(epoch_seconds, tz=datetime.UTC)
    return moment.isoformat(timespec="seconds")


def inspect_root(
    root: str | os.PathLike[str], restore_from: RestoreChoice | None = None
) -> InspectReport:
    """List the published snapshots under ``root``, newest first, verifying each, and
    the order a restore by ``restore_from`` (default: latest) would try them in
    (docs/spec.md section 7.14).

    ``root`` may be a storage URL (``s3://bucket/prefix``, docs/spec.md section 8.12):
    then every object is read from the store and hashed here. Raises
    ``FileNotFoundError`` when ``root`` is not a directory, and
    :class:`~turnpoint.storage.StorageError` when the storage cannot be reached.
    """
    choice = restore_from or RestoreChoice()
    if isinstance(root, str) and "://" in root:
        storage = open_storage(root)
        storage.check()
        store = StoreLayout(storage)
        try:
            return _inspect_layout(store, storage.url, choice)
        finally:
            store.close()
    path = Path(root)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    return _inspect_layout(SnapshotLayout(path), path, choice)


def _inspect_layout(
    layout: SnapshotLayout | StoreLayout, root: Path | str, choice: RestoreChoice
) -> InspectReport:
    latest: str | None = None
    latest_problem: str | None = None
    try:
        latest = layout.latest()
    except ManifestError as error:
        latest_problem = error.message
    snapshots = tuple(
        _inspect_snapshot(layout, checkpoint_id, checkpoint_id == latest)
        for checkpoint_id in layout.list_published()
    )
    candidates, _unreadable = published_candidates(layout)
    order = tuple(c.checkpoint_id for c in rank_candidates(choice, candidates))
    return InspectReport(root, latest, snapshots, latest_problem, str(choice), order)


def _inspect_snapshot(
    layout: SnapshotLayout | StoreLayout, checkpoint_id: str, latest: bool
) -> SnapshotReport:
    try:
        manifest = SnapshotManifest.from_json(layout.manifest_bytes(checkpoint_id))
    except (OSError, StorageError, ManifestError) as error:
        return SnapshotReport(checkpoint_id, latest, problem=f"{MANIFEST_NAME}: {error}")
    files_checked = 0
    problem: str | None = f"{MANIFEST_NAME} describes {manifest.checkpoint_id!r}"
    if manifest.checkpoint_id == checkpoint_id:
        files_checked, problem = snapshot_mismatch(layout, checkpoint_id, manifest)
    return SnapshotReport(
        checkpoint_id=checkpoint_id,
        latest=latest,
        step=manifest.step,
        created_at=manifest.created_at,
        participants=tuple(entry.instance for entry in manifest.participants),
        continued=len(manifest.continued),
        restarts=len(manifest.restarts),
        files_checked=files_checked,
        problem=problem,
        metrics=tuple(sorted(metrics_of(manifest.extra).items())),
    )


def inspect_command(
    root: str | os.PathLike[str],
    *,
    as_json: bool = False,
    out: TextIO | None = None,
    restore_from: str = "latest",
) -> int:
    """What ``turnpoint inspect`` runs: print the report; 0 when every digest matches,
    1 on any mismatch, 2 when ``root`` is not a directory or the choice is malformed."""
    stream = sys.stdout if out is None else out
    try:
        choice = RestoreChoice.parse(restore_from)
    except RestoreChoiceError as error:
        print(f"turnpoint inspect: {error}", file=sys.stderr if out is None else stream)
        return EXIT_NO_ROOT
    try:
        report = inspect_root(root, choice)
    except (FileNotFoundError, StorageError) as error:
        print(f"turnpoint inspect: {error}", file=sys.stderr if out is None else stream)
        return EXIT_NO_ROOT
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True), file=stream)
    else:
        print(report.render(), file=stream)
    return EXIT_OK if report.ok else EXIT_MISMATCH
