"""Reading a committed participant snapshot, and writing an altered copy of it.

Some checks judge what a participant saved (its records, docs/spec.md section 8.2) or
feed it a snapshot that is well-formed but says something else: a copy under another
checkpoint id whose records a check has changed, with every digest recomputed
(sections 8.2 and 8.3), so that only the participant's own validation of the states can
refuse it. Both need the snapshot root the kit shares with the target
(``--snapshot-root``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

Records = list[dict[str, Any]]


def read_records(root: Path, snapshot: str, instance: str, refs: pb.ManifestEntry) -> Records:
    """The records the target committed, in file order."""
    source = root / snapshot / instance / Path(refs.artifacts[0].path).name
    return [json.loads(line) for line in source.read_bytes().splitlines()]


def altered_copy(
    root: Path,
    snapshot: str,
    copy: str,
    instance: str,
    refs: pb.ManifestEntry,
    alter: Callable[[Records], None],
) -> pb.ManifestEntry:
    """Write snapshot ``snapshot``'s records, changed in place by ``alter``, as the
    well-formed snapshot ``copy``; the manifest entry a restore of it names."""
    records = read_records(root, snapshot, instance, refs)
    alter(records)
    lines = [json.dumps(r, separators=(",", ":"), ensure_ascii=True).encode() for r in records]
    data = b"".join(line + b"\n" for line in lines)
    digest = hashlib.sha256(data).hexdigest()
    target = root / copy / instance
    target.mkdir(parents=True)
    (target / f"records-{digest}.jsonl").write_bytes(data)
    manifest = json.loads((root / snapshot / instance / "MANIFEST.json").read_bytes())
    artifact = manifest["artifacts"][0]
    artifact.update(path=f"{instance}/records-{digest}.jsonl", sha256=digest, size_bytes=len(data))
    manifest_bytes = (json.dumps(manifest, indent=2) + "\n").encode("ascii")
    (target / "MANIFEST.json").write_bytes(manifest_bytes)
    return pb.ManifestEntry(
        manifest=types_pb2.ArtifactRef(
            path=f"{instance}/MANIFEST.json",
            sha256=hashlib.sha256(manifest_bytes).hexdigest(),
            size_bytes=len(manifest_bytes),
        ),
        artifacts=[
            types_pb2.ArtifactRef(
                path=artifact["path"],
                sha256=digest,
                size_bytes=len(data),
                record_count=refs.artifacts[0].record_count,
            )
        ],
    )
