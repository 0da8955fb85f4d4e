"""``turnpoint bench-storage``: a durable commit on local disk vs an object store.

For each participant count, one snapshot as the protocol writes it: every participant's
records and manifest through its :class:`~turnpoint.participant_sdk.SnapshotStore`
(the commit phase, participants writing in parallel threads), then the trainer's
publication (anchor, manifest, ``LATEST``), first on a local directory (section 8.9,
fsyncs included) and then on an S3 endpoint (section 8.13): moto's server on loopback,
started here, or the one ``--s3-url`` names (boto3's environment gives its endpoint and
credentials). Same run, same records, same sizes; the figure is the ratio object store
over local disk per phase, with the objects and bytes one snapshot writes. The
publication is split by its named steps: verify (the participants' objects: a HEAD each
on the store), anchor (its files put), manifest (the commit write), latest (``LATEST``).

Then the torch DCP anchor itself (a model and its Adam state of about ``--anchor-mib``
MiB): written and loaded on local disk (DCP's file writer, fsync, tree digest) and on the
store through DCP's fsspec writer over the same storage client (docs/spec.md section
8.13.1: every file one put, the digest read back), with its objects and bytes.

Loopback moto is an in-process Python server: the ratio measures the protocol's request
count and the client's cost, not a real store's latency (add that per request).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from turnpoint.apps._object_store import loopback_s3
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import Record, SnapshotStore
from turnpoint.protocol import ParticipantKind
from turnpoint.storage import open_storage
from turnpoint.trainer.storage.layout import PublishStep, SnapshotLayout, tree_digest
from turnpoint.trainer.storage.manifest import (
    ANCHOR_DIR,
    AnchorRef,
    ParticipantEntry,
    SnapshotManifest,
)
from turnpoint.trainer.storage.objects import StoreLayout

_SIZES = (8, 64, 256)
_THREADS = 16
_ANCHOR_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Figure:
    storage: str
    participants: int
    commit_s: float
    publish_s: float
    objects: int
    bytes_written: int
    # The publication's own phases (docs/spec.md sections 8.9, 8.13), by its named steps:
    # verify the participants' objects, put the anchor, commit the manifest, move LATEST.
    verify_s: float = 0.0
    anchor_s: float = 0.0
    manifest_s: float = 0.0
    latest_s: float = 0.0


def _records(instance: int, count: int) -> list[Record]:
    return [
        Record(EpisodeId(f"r{instance}-{n}", 0), "turn-1", {"tokens": list(range(32)), "n": n})
        for n in range(count)
    ]


def _one_snapshot(root: str, participants: int, records: int, sequence: int) -> Figure:
    is_url = "://" in root
    marks: dict[PublishStep, float] = {}

    def mark(step: PublishStep) -> None:
        marks[step] = time.perf_counter()

    layout: SnapshotLayout | StoreLayout = (
        StoreLayout(open_storage(root), after_step=mark)
        if is_url
        else SnapshotLayout(Path(root), after_step=mark)
    )
    checkpoint_id = make_checkpoint_id("bench", sequence)
    staged = layout.begin(checkpoint_id)
    anchor = staged / ANCHOR_DIR
    anchor.mkdir(parents=True)
    (anchor / "model.bin").write_bytes(os.urandom(_ANCHOR_BYTES))
    work = [(f"p-{n}", _records(n, records)) for n in range(participants)]
    started = time.perf_counter()
    store = SnapshotStore(root)
    with ThreadPoolExecutor(_THREADS) as pool:
        written = list(
            pool.map(lambda job: store.write(checkpoint_id, job[0], "c-000000000001", job[1]), work)
        )
    commit_s = time.perf_counter() - started
    entries = tuple(
        ParticipantEntry(
            instance=name,
            kind=ParticipantKind.RESOURCES,
            artifacts=entry.artifacts,
            manifest=entry.manifest,
            exported=entry.episodes,
        )
        for (name, _), entry in zip(work, written, strict=True)
    )
    manifest = SnapshotManifest(
        checkpoint_id=checkpoint_id,
        step=sequence,
        created_at=0.0,
        anchor=AnchorRef(sha256=tree_digest(anchor)),
        participants=entries,
    )
    started = time.perf_counter()
    layout.publish(staged, manifest)
    ended = time.perf_counter()
    publish_s = ended - started
    record_bytes = sum(a.size_bytes for e in written for a in e.artifacts)
    manifests = sum(e.manifest.size_bytes for e in written)
    bytes_written = record_bytes + manifests + _ANCHOR_BYTES + len(manifest.to_json())
    if isinstance(layout, StoreLayout):
        layout.close()
    # records + manifest per participant, the anchor file, the manifest, LATEST
    return Figure(
        "s3" if root.startswith("s3://") else "local",
        participants,
        commit_s,
        publish_s,
        2 * participants + 3,
        bytes_written,
        verify_s=marks[PublishStep.VERIFIED] - started,
        anchor_s=marks[PublishStep.TREE_SYNCED] - marks[PublishStep.VERIFIED],
        manifest_s=marks[PublishStep.MANIFEST_LINKED] - marks[PublishStep.TREE_SYNCED],
        latest_s=ended - marks[PublishStep.SNAPSHOT_SYNCED],
    )


@contextlib.contextmanager
def _loopback_s3() -> Iterator[str]:
    """moto's S3 server on loopback, boto3 in this process pointed at it; yields a URL."""
    with loopback_s3() as store:
        saved = {name: os.environ.get(name) for name in store.environment}
        os.environ.update(store.environment)
        try:
            yield store.url
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@dataclass(frozen=True, slots=True)
class AnchorFigure:
    storage: str
    write_s: float
    load_s: float
    objects: int
    bytes_written: int


def _anchor_on(root: str, mebibytes: int, sequence: int) -> AnchorFigure:
    """One torch DCP anchor written, then loaded into a fresh model, on ``root``."""
    import torch

    from turnpoint.trainer.anchors.dcp import load_anchor, save_anchor

    width = max(1, int((mebibytes * 2**20 / 4 / 3) ** 0.5))  # weights + Adam's two moments

    def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(width, width, bias=False)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(1, width)).sum().backward()
        optimizer.step()
        return model, optimizer

    is_url = "://" in root
    storage = open_storage(root) if is_url else None
    layout: SnapshotLayout | StoreLayout = (
        StoreLayout(storage) if storage is not None else SnapshotLayout(Path(root))
    )
    checkpoint_id = make_checkpoint_id("anchor", sequence)
    snapshot = layout.begin(checkpoint_id)
    model, optimizer = trained()
    started = time.perf_counter()
    ref = save_anchor(snapshot, model, optimizer, step=sequence, storage=storage)
    write_s = time.perf_counter() - started
    if storage is not None:
        stored = storage.list(f"{checkpoint_id}/{ANCHOR_DIR}/")
        objects, size = len(stored), sum(info.size_bytes for info in stored)
    else:
        files = [path for path in (snapshot / ANCHOR_DIR).rglob("*") if path.is_file()]
        objects, size = len(files), sum(path.stat().st_size for path in files)
    fresh, fresh_optimizer = trained()
    started = time.perf_counter()
    load_anchor(snapshot, fresh, fresh_optimizer, expected=ref, storage=storage)
    load_s = time.perf_counter() - started
    layout.discard(checkpoint_id)
    if isinstance(layout, StoreLayout):
        layout.close()
    return AnchorFigure("s3" if is_url else "local", write_s, load_s, objects, size)


def _print_anchor_figures(local_root: str, s3_url: str, mebibytes: int, sequence: int) -> None:
    local = _anchor_on(local_root, mebibytes, sequence)
    remote = _anchor_on(s3_url, mebibytes, sequence)
    print(
        f"\ntorch DCP anchor, about {mebibytes} MiB (model and Adam state): "
        "local file writer vs DCP's fsspec writer onto the store"
    )
    print(
        f"{'storage':>12} {'write s':>9} {'load s':>9} {'objects':>7} {'MiB':>7} "
        f"{'write x':>8} {'load x':>8}"
    )
    for figure in (local, remote):
        ratios = (
            f"{remote.write_s / local.write_s:>8.1f} {remote.load_s / local.load_s:>8.1f}"
            if figure is remote
            else f"{'':>8} {'':>8}"
        )
        print(
            f"{figure.storage:>12} {figure.write_s:>9.3f} {figure.load_s:>9.3f} "
            f"{figure.objects:>7} {figure.bytes_written / 2**20:>7.2f} {ratios}",
            flush=True,
        )


def bench_storage_command(args: argparse.Namespace) -> int:
    sizes = tuple(int(size) for size in args.sizes.split(","))
    with contextlib.ExitStack() as stack:
        local_root = args.root or stack.enter_context(tempfile.TemporaryDirectory())
        s3_url = args.s3_url or stack.enter_context(_loopback_s3())
        print(
            f"local: {local_root}   object store: {s3_url}   records per participant: "
            f"{args.records}",
            flush=True,
        )
        print(
            f"{'participants':>12} {'storage':>7} {'commit s':>9} {'publish s':>9} "
            f"{'verify':>7} {'anchor':>7} {'manifest':>8} {'latest':>7} "
            f"{'objects':>7} {'MiB':>7} {'commit x':>8} {'publish x':>9}"
        )
        for sequence, participants in enumerate(sizes, start=1):
            local = _one_snapshot(str(local_root), participants, args.records, sequence)
            remote = _one_snapshot(s3_url, participants, args.records, sequence)
            for figure in (local, remote):
                ratio = figure is remote
                print(
                    f"{figure.participants:>12} {figure.storage:>7} {figure.commit_s:>9.3f} "
                    f"{figure.publish_s:>9.3f} {figure.verify_s:>7.3f} {figure.anchor_s:>7.3f} "
                    f"{figure.manifest_s:>8.3f} {figure.latest_s:>7.3f} {figure.objects:>7} "
                    f"{figure.bytes_written / 2**20:>7.2f} "
                    + (
                        f"{remote.commit_s / local.commit_s:>8.1f} "
                        f"{remote.publish_s / local.publish_s:>9.1f}"
                        if ratio
                        else f"{'':>8} {'':>9}"
                    ),
                    flush=True,
                )
        if args.anchor_mib > 0:
            # After the snapshots above: checkpoint sequences only increase.
            _print_anchor_figures(str(local_root), s3_url, args.anchor_mib, len(sizes) + 1)
    return 0


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bench-storage",
        help="a durable commit on local disk vs an S3 object store, by participant count",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default=",".join(map(str, _SIZES)), help="e.g. 8,64,256")
    parser.add_argument("--records", type=int, default=20, help="records per participant")
    parser.add_argument("--root", help="local snapshot root (default: a temp dir)")
    parser.add_argument("--s3-url", help="s3://bucket/prefix (default: moto on loopback)")
    parser.add_argument(
        "--anchor-mib",
        type=int,
        default=16,
        help="size of the torch DCP anchor measured on both (0: none)",
    )
    parser.set_defaults(handler=bench_storage_command)
