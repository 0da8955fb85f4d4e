"""A trainer anchor without torch: the trainer's state as bytes, in one file.

A trainer on another framework (JAX, a numpy learner, a service that keeps its weights
elsewhere) hands :class:`FileAnchorSource` two callables: the training step, and its
state serialised as bytes. Each snapshot then holds ``trainer/anchor/state.bin`` and
``trainer/anchor/anchor.json`` (format and step), written and fsynced in a thread before
the snapshot references them (docs/spec.md section 8.8). :func:`file_anchor_loader`
reads them back at restore, after the tree digest is checked against the manifest's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from turnpoint._files import fsync_dir, write_new
from turnpoint.trainer.anchors.source import AnchorError, WrittenAnchor
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import ANCHOR_DIR, AnchorRef, ManifestError

FILE_ANCHOR_FORMAT = "turnpoint-file-anchor-1"
_STATE = "state.bin"
_META = "anchor.json"


class FileAnchorSource:
    """An :class:`~turnpoint.trainer.anchors.source.AnchorSource` writing ``state()``.

    ``step()`` and ``state()`` are called on the event loop when a snapshot starts (the
    step lock held by :class:`~turnpoint.trainer.Checkpointing` keeps them consistent);
    the bytes are written and made durable in a thread.
    """

    def __init__(self, *, step: Callable[[], int], state: Callable[[], bytes]) -> None:
        self._step = step
        self._state = state

    @property
    def step(self) -> int:
        return self._step()

    async def write(self, snapshot: Path) -> WrittenAnchor:
        step = self._step()
        data = self._state()
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"FileAnchorSource: state() returned {type(data).__name__}, not bytes")
        ref = await asyncio.to_thread(_write, Path(snapshot) / ANCHOR_DIR, step, bytes(data))
        return WrittenAnchor(ref, step)


def _write(directory: Path, step: int, data: bytes) -> AnchorRef:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_new(directory / _STATE, data)
        meta = {"format": FILE_ANCHOR_FORMAT, "step": step}
        write_new(directory / _META, json.dumps(meta, sort_keys=True).encode())
        # The files are synced as written; their directory entries are made durable here.
        fsync_dir(directory)
        return AnchorRef(sha256=tree_digest(directory))
    except (OSError, ManifestError) as error:
        raise AnchorError(
            f"cannot write the trainer anchor in {directory}: {error}", directory
        ) from error


def file_anchor_loader(install: Callable[[bytes, int], None]) -> Callable[[Path, AnchorRef], int]:
    """An :data:`~turnpoint.trainer.AnchorLoader` for :class:`FileAnchorSource` anchors.

    The anchor's digest is checked first; then ``install(state, step)`` gets the bytes
    ``state()`` returned and the step they were taken at, and the loader returns the step.
    A missing, corrupt or foreign anchor raises :class:`AnchorError`, and the restore
    picks an older snapshot; ``install`` is not called then.
    """

    def load(snapshot: Path, anchor: AnchorRef) -> int:
        directory = Path(snapshot) / anchor.path
        try:
            digest = tree_digest(directory)
            meta = json.loads((directory / _META).read_bytes())
            data = (directory / _STATE).read_bytes()
        except (OSError, ValueError, ManifestError) as error:
            raise AnchorError(
                f"cannot read the trainer anchor in {directory}: {error}", directory
            ) from error
        if digest != anchor.sha256:
            raise AnchorError(
                f"trainer anchor in {directory} is corrupt: digest {digest}, "
                f"the manifest names {anchor.sha256}",
                directory,
            )
        step = meta.get("step") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or meta.get("format") != FILE_ANCHOR_FORMAT:
            raise AnchorError(f"{directory / _META} is not a file anchor: {meta!r}", directory)
        if type(step) is not int or step < 0:
            raise AnchorError(f"{directory / _META} is not a file anchor: {meta!r}", directory)
        install(data, step)
        return step

    return load
