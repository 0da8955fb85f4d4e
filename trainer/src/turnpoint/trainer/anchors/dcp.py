"""The trainer anchor: model, optimizer, step and data-loader position, on disk.

docs/spec.md section 7.4, step 1 (and section 8.8): a snapshot starts from a durable
trainer anchor, written with torch distributed checkpoint (DCP) into
``<snapshot>/trainer/anchor/``. A single process needs no process group:
``no_dist=True`` runs DCP's planner locally. A trainer on many ranks writes the same
format together, a shard per rank: :mod:`turnpoint.trainer.anchors.ranks`.

:class:`AnchorWriter` starts an asynchronous save with ``dcp.async_save``, which copies
the state into CPU memory before it returns (so training may go on mutating the model)
and writes from a background thread. :meth:`AnchorWriter.wait` finishes the write, makes
it durable and returns the :class:`~turnpoint.trainer.storage.manifest.AnchorRef` (the tree
digest) that the manifest records; nothing may name the anchor before that.

The step and the data-loader position are stored inside the DCP checkpoint next to the
tensors. The loader position travels as canonical JSON text, so that loading it never
depends on how DCP merges nested Python containers.

DCP warns once per process that it assumes a single process; that is the intent here,
and the warning is left alone rather than muting it for the whole process.

Loading verifies the tree digest (when the caller has one, as a restore always does)
before DCP reads a byte, because DCP's metadata file is a pickle.

Given the snapshot ``storage`` (an object store or a shared mount, section 8.13), the
anchor is written onto it through DCP's fsspec writer (:mod:`.store`) instead of into
the local directory, under ``<checkpoint_id>/trainer/anchor/``, and publication checks
it there; nothing is staged locally.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

from turnpoint._files import fsync_tree
from turnpoint._json import StrictJSONError, loads_strict
from turnpoint.storage import Storage, StorageError, open_storage
from turnpoint.trainer.anchors.source import AnchorError, WrittenAnchor
from turnpoint.trainer.anchors.store import (
    anchor_prefix,
    store_reader,
    store_writer,
    written_files,
)
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import ANCHOR_DIR, AnchorRef, JSONValue, ManifestError
from turnpoint.trainer.storage.objects import stored_tree_digest

ANCHOR_FORMAT = 1


_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


@dataclass(frozen=True, slots=True)
class AnchorState:
    """What a loaded anchor restores besides the tensors."""

    step: int
    data_loader: JSONValue


def _quiet_single_process() -> None:
    """DCP warns on every save and load without a process group, ``no_dist`` or not,
    and an asynchronous save warns from its own thread, after any scoped filter ended.
    This anchor is the single-process one by design, so the warning says nothing: it is
    filtered for the process, that message alone, each time (a test's filters reset)."""
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)


def _anchor_dir(snapshot: Path) -> Path:
    return Path(snapshot) / ANCHOR_DIR


def _state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _trainer_entry(step: int, data_loader: JSONValue) -> dict[str, Any]:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    try:
        loader_text = json.dumps(data_loader, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"data_loader position must be plain JSON data: {error}") from None
    return {"format": ANCHOR_FORMAT, "step": step, "data_loader": loader_text}


def _fresh_anchor_dir(snapshot: Path) -> Path:
    directory = _anchor_dir(snapshot)
    if directory.exists() and any(directory.iterdir()):
        raise AnchorError(
            f"{directory} already holds an anchor; anchors are never rewritten", directory
        )
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _finish(directory: Path) -> AnchorRef:
    fsync_tree(directory)
    return AnchorRef(sha256=tree_digest(directory), path=ANCHOR_DIR)


def as_storage(storage: str | Storage | None) -> Storage | None:
    """A storage URL opened (nothing is reached yet), a :class:`Storage` as it is."""
    return open_storage(storage) if isinstance(storage, str) else storage


def _fresh_anchor_prefix(storage: Storage, snapshot: Path) -> str:
    prefix = anchor_prefix(snapshot)
    if storage.list(f"{prefix}/"):
        raise AnchorError(
            f"{storage.url}/{prefix} already holds an anchor; anchors are never rewritten",
            prefix,
        )
    return prefix


def _finish_on_store(storage: Storage, prefix: str, files: list[str]) -> AnchorRef:
    """The anchor's reference, its digest over exactly the objects its writers put."""
    try:
        return AnchorRef(sha256=stored_tree_digest(storage, prefix, files), path=ANCHOR_DIR)
    except (ManifestError, StorageError) as error:
        raise AnchorError(
            f"cannot read back the anchor in {storage.url}/{prefix}: {error}", prefix
        ) from error


def save_anchor(
    snapshot: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    data_loader: JSONValue = None,
    storage: str | Storage | None = None,
) -> AnchorRef:
    """Write the anchor synchronously and return its reference for the manifest."""
    writer = AnchorWriter(storage)
    writer.start(snapshot, model, optimizer, step=step, data_loader=data_loader)
    return writer.wait()


class AnchorWriter:
    """One asynchronous anchor save at a time.

    ``start`` returns once the state is copied; ``wait`` (or ``await wait_async()``)
    finishes it. Owned by one caller: it is not meant to be shared between threads.
    With ``storage`` the anchor is written onto it (module docstring).
    """

    def __init__(self, storage: str | Storage | None = None) -> None:
        self.storage = as_storage(storage)
        self._future: Future[Any] | None = None
        self._directory: Path | None = None
        self._prefix: str | None = None
        self._store_writer: Any = None

    @property
    def pending(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._future is not None

    def done(self) -> bool:
        """Whether the pending save (if any) has finished writing; ``wait`` still owed."""
        return self._future is None or self._future.done()

    def start(
        self,
        snapshot: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: int,
        data_loader: JSONValue = None,
    ) -> None:
        """Copy the state and start writing it to ``<snapshot>/trainer/anchor/``."""
        if self._future is not None:
            raise RuntimeError("an anchor save is still pending: wait() for it first")
        state = _state_dict(model, optimizer)
        state["trainer"] = _trainer_entry(step, data_loader)
        if self.storage is not None:
            self._start_on_store(self.storage, Path(snapshot), state)
            return
        directory = _fresh_anchor_dir(Path(snapshot))
        try:
            # DCP would fsync its files itself; wait() fsyncs the whole tree once the
            # write is done, which is the one fsync per file and directory it needs.
            writer = FileSystemWriter(directory, sync_files=False)
            _quiet_single_process()
            result = dcp_async_save(
                state, checkpoint_id=directory, storage_writer=writer, no_dist=True
            )
        except (OSError, RuntimeError, CheckpointException) as error:
            raise AnchorError(
                f"cannot start writing the anchor in {directory}: {error}", directory
            ) from error
        if not isinstance(result, Future):
            # Only a staging that itself runs asynchronously (CUDA) returns a response
            # object; its upload future is what finishing means.
            result = result.upload_completion
        self._future = result
        self._directory = directory

    def _start_on_store(self, storage: Storage, snapshot: Path, state: dict[str, Any]) -> None:
        try:
            prefix = _fresh_anchor_prefix(storage, snapshot)
            writer = store_writer(storage, prefix)
            _quiet_single_process()
            result = dcp_async_save(state, storage_writer=writer, no_dist=True)
        except (OSError, RuntimeError, CheckpointException, StorageError) as error:
            raise AnchorError(
                f"cannot start writing the anchor in {storage.url}: {error}", storage.url
            ) from error
        if not isinstance(result, Future):
            result = result.upload_completion
        self._future = result
        self._prefix = prefix
        self._store_writer = writer

    def wait(self) -> AnchorRef:
        """Block until the pending save is durable; return its reference."""
        future, directory, prefix = self._future, self._directory, self._prefix
        if future is None or (directory is None and prefix is None):
            raise RuntimeError("no anchor save is pending")
        self._future = None
        self._directory = None
        self._prefix = None
        where = directory if directory is not None else f"{self.storage}/{prefix}"
        try:
            future.result()
        except (OSError, RuntimeError, CheckpointException, StorageError) as error:
            raise AnchorError(f"writing the anchor in {where} failed: {error}", where) from error
        if self.storage is not None and prefix is not None:
            writer, self._store_writer = self._store_writer, None
            return _finish_on_store(self.storage, prefix, written_files(writer, prefix))
        assert directory is not None
        try:
            return _finish(directory)
        except (OSError, ManifestError) as error:
            raise AnchorError(
                f"cannot make the anchor in {directory} durable: {error}", directory
            ) from error

    async def wait_async(self) -> AnchorRef:
        """:meth:`wait` off the event loop (hashing and fsync block)."""
        return await asyncio.to_thread(self.wait)


def load_anchor(
    snapshot: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    expected: AnchorRef | None = None,
    storage: str | Storage | None = None,
) -> AnchorState:
    """Restore model and optimizer in place from ``<snapshot>/<anchor path>``, or with
    ``storage`` from the anchor's objects there, read through DCP's fsspec reader.

    With ``expected`` (the manifest's reference) the files are checked against its
    digest before anything is read. Raises :class:`AnchorError` when the anchor is
    missing, corrupt, of another format or does not fit the model and optimizer.
    DCP reads into the live tensors, so an anchor that passes its digest check but fails
    while loading may leave them partly overwritten: load another anchor or start over.
    """
    opened = as_storage(storage)
    directory: Path | str
    if opened is None:
        directory = checked_anchor_dir(snapshot, expected)
        reader = None
    else:
        directory = checked_anchor_prefix(opened, snapshot, expected)
        reader = store_reader(opened, directory)
    state = _state_dict(model, optimizer)
    state["trainer"] = _empty_trainer_entry()
    try:
        _quiet_single_process()
        if reader is None:
            dcp_load(state, checkpoint_id=directory, no_dist=True)
        else:
            dcp_load(state, storage_reader=reader, no_dist=True)
    except (
        OSError,
        RuntimeError,
        ValueError,
        EOFError,
        CheckpointException,
        StorageError,
    ) as error:
        raise AnchorError(
            f"cannot load the trainer anchor in {directory}: {_first_line(error)}", directory
        ) from error
    loaded = _read_trainer_entry(state["trainer"], directory)
    _apply_state(model, optimizer, state)
    return loaded


def checked_anchor_dir(snapshot: Path, expected: AnchorRef | None) -> Path:
    """The anchor directory of ``snapshot``, its digest checked against ``expected``
    (docs/spec.md section 8.8: before a byte of it is read)."""
    directory = Path(snapshot) / (expected.path if expected is not None else ANCHOR_DIR)
    if not directory.is_dir() or not (directory / ".metadata").is_file():
        raise AnchorError(f"no trainer anchor in {directory}", directory)
    if expected is not None:
        try:
            digest = tree_digest(directory)
        except (OSError, ManifestError) as error:
            raise AnchorError(
                f"cannot read the anchor in {directory}: {error}", directory
            ) from error
        if digest != expected.sha256:
            raise AnchorError(
                f"trainer anchor in {directory} is corrupt: digest {digest}, "
                f"manifest says {expected.sha256}",
                directory,
            )
    return directory


def checked_anchor_prefix(storage: Storage, snapshot: Path, expected: AnchorRef | None) -> str:
    """As :func:`checked_anchor_dir` for an anchor kept on ``storage``: the key prefix
    of its objects, their digest checked against ``expected`` before DCP reads one."""
    prefix = f"{anchor_prefix(snapshot).partition('/')[0]}/" + (
        expected.path if expected is not None else ANCHOR_DIR
    )
    try:
        digest = stored_tree_digest(storage, prefix)
    except (ManifestError, StorageError) as error:
        raise AnchorError(
            f"no readable trainer anchor in {storage.url}/{prefix}: {error}", prefix
        ) from error
    if expected is not None and digest != expected.sha256:
        raise AnchorError(
            f"trainer anchor in {storage.url}/{prefix} is corrupt: digest {digest}, "
            f"manifest says {expected.sha256}",
            prefix,
        )
    return prefix


def _empty_trainer_entry() -> dict[str, Any]:
    return {"format": 0, "step": 0, "data_loader": ""}


def _read_trainer_entry(trainer: dict[str, Any], directory: Path | str) -> AnchorState:
    if trainer.get("format") != ANCHOR_FORMAT:
        raise AnchorError(
            f"trainer anchor in {directory} has format {trainer.get('format')!r}, "
            f"this build reads {ANCHOR_FORMAT}",
            directory,
        )
    step = trainer.get("step")
    loader_text = trainer.get("data_loader")
    if isinstance(step, bool) or not isinstance(step, int) or not isinstance(loader_text, str):
        raise AnchorError(f"trainer anchor in {directory} has a malformed trainer entry", directory)
    try:
        data_loader: JSONValue = loads_strict(loader_text)
    except StrictJSONError as error:
        raise AnchorError(
            f"trainer anchor in {directory}: bad data_loader: {error}", directory
        ) from None
    return AnchorState(step=step, data_loader=data_loader)


def _apply_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    # DCP wraps per-rank tracebacks into its message; the last line holds the cause.
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class TorchAnchorSource:
    """:class:`AnchorSource` over torch distributed checkpoint
    (:class:`AnchorWriter`).

    ``step`` and ``data_loader`` are read when an anchor is written. torch is imported
    only when this class is used. One process; a trainer on many ranks uses
    :class:`~turnpoint.trainer.anchors.ranks.DistributedAnchor` instead. ``storage``
    (the snapshot root's URL when it is one) writes the anchor onto the store.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: Callable[[], int],
        data_loader: Callable[[], JSONValue] = lambda: None,
        storage: str | Storage | None = None,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._step = step
        self._data_loader = data_loader
        self.writer = AnchorWriter(storage)

    @property
    def step(self) -> int:
        return self._step()

    async def write(self, snapshot: Path) -> WrittenAnchor:
        if self.writer.pending:
            # Finish the write already under way before anything can reference it.
            await self.writer.wait_async()
        step = self._step()
        await asyncio.to_thread(
            self.writer.start,
            snapshot,
            self._model,
            self._optimizer,
            step=step,
            data_loader=self._data_loader(),
        )
        return WrittenAnchor(await self.writer.wait_async(), step)
