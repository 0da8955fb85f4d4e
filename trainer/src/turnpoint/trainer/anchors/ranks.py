"""The trainer anchor across ranks: one torch distributed checkpoint, a shard per rank.

docs/spec.md section 8.8 and section 7.4 step 1. A trainer that runs many ranks embeds
the coordinator on rank 0 only; the anchor is still one DCP checkpoint in
``<snapshot>/trainer/anchor/``, written by every rank together (each its own shard; a
replicated tensor once). :class:`DistributedAnchor` is both the coordinator's
:class:`~turnpoint.trainer.anchors.source.AnchorSource` and its anchor loader on rank 0,
and the servant of rank 0's commands on every other rank.

The ranks agree in lockstep, at step boundaries, so that no anchor collective ever runs
beside a training collective and no rank's state is copied in the middle of its step:

- rank 0 calls :meth:`DistributedAnchor.begin_step` at the start of each training step,
  under the coordinator's step lock, before the step's first collective. The snapshot
  driver writes the anchor under that same lock, so on rank 0 a save or a load always
  falls between two steps;
- every other rank calls :meth:`DistributedAnchor.follow` before each of its steps: it
  serves rank 0's saves and loads until rank 0 begins its next step (the returned
  :class:`~turnpoint.trainer.anchors.dcp.AnchorState` is rank 0's step and data-loader
  position), or ``None`` once rank 0 closed the anchor (:meth:`~DistributedAnchor.close`).

A save is published only when every rank wrote its shard: the ranks first agree that each
can save (a rank that is not at rank 0's step, or whose state cannot be read, refuses),
then DCP writes (a rank's write failure fails the save on every rank), then they agree
that every rank's write succeeded; only then does rank 0 hash the directory and hand the
reference to the coordinator. Any refusal raises :class:`AnchorError` on rank 0, which
fails the snapshot (``storage``, retried) instead of publishing it. Every step that can
fail on one rank alone is followed by such an agreement, so that no rank is left waiting
in a collective the others skipped.

Commands travel on a gloo group of the anchor's own that waits indefinitely (a follower
may wait a whole restore or many minutes of rollouts for the next step); the saves and
loads run on a second gloo group bounded by ``timeout_s``. If rank 0 dies, the followers'
wait ends with a ``RuntimeError`` as soon as its connections close.

Where the anchor lives: on a local snapshot root every rank must see the root at the
same path (a shared filesystem), as DCP's file writer requires. Given the snapshot
``storage`` (an ``s3://`` or ``file://`` URL, the same on every rank), every rank instead
writes its shards onto the store itself through DCP's fsspec writer (:mod:`.store`),
with its own client: the ranks share nothing but the store. The ranks' agreement then
also carries the objects each rank put, and rank 0 takes the anchor's digest over
exactly those (never a listing, which may lag); a load reads every rank's part straight
from the store, after rank 0 checked the digest there.

Resharding: DCP keys every shard by its global offsets, so an anchor written by N ranks
loads on M ranks when the state is replicated (plain tensors the same on every rank, as
with DDP) or sharded as DTensors (FSDP2's ``fully_shard``): each rank reads the pieces it
now owns. State keyed by rank (``f"rng.{rank}"``) does not reshard; keep it out of the
model's and optimizer's state dicts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from turnpoint._json import loads_strict
from turnpoint.storage import Storage, StorageError
from turnpoint.trainer.anchors.dcp import (
    ANCHOR_FORMAT,
    AnchorState,
    _apply_state,
    _empty_trainer_entry,
    _finish,
    _finish_on_store,
    _first_line,
    _fresh_anchor_dir,
    _fresh_anchor_prefix,
    _read_trainer_entry,
    _state_dict,
    _trainer_entry,
    as_storage,
    checked_anchor_dir,
    checked_anchor_prefix,
)
from turnpoint.trainer.anchors.source import AnchorError, WrittenAnchor
from turnpoint.trainer.anchors.store import store_reader, store_writer, written_files
from turnpoint.trainer.storage.manifest import AnchorRef, JSONValue, ManifestError

_LOG = logging.getLogger(__name__)

# Followers wait for rank 0's next command as long as rank 0 takes between two steps.
_WAIT_FOREVER: Final = timedelta(days=365)
# What reading a rank's state or applying a loaded one raises when it does not fit.
_STATE_ERRORS: Final = (
    OSError,
    RuntimeError,
    ValueError,
    TypeError,
    KeyError,
    EOFError,
    CheckpointException,
    AnchorError,
    StorageError,
)


@dataclass(frozen=True, slots=True)
class _Command:
    kind: str  # "save", "load", "step" or "close"
    directory: str = ""  # the anchor's directory, or its key prefix on the store
    step: int = 0
    data_loader: str = "null"  # canonical JSON text, as in the anchor's trainer entry


class DistributedAnchor:
    """The trainer anchor written and loaded by every rank together.

    Construct it on every rank at the same point of the program, after
    ``torch.distributed.init_process_group`` (it creates two gloo groups, a collective
    call). ``step`` and ``data_loader`` are read on each rank; rank 0's are stored.
    ``storage``, the same URL on every rank, keeps the anchor on the store (module
    docstring).

    On rank 0: pass it as ``anchor`` and its :meth:`load` as ``load_anchor`` to
    :class:`~turnpoint.trainer.Checkpointing`, call :meth:`begin_step` at the start of
    each step under ``step_lock``, and :meth:`close` (or leave ``with anchor:``) when
    done. On every other rank: call :meth:`follow` before each step and stop when it
    returns ``None``. See the module docstring for why it works in lockstep.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: Callable[[], int],
        data_loader: Callable[[], JSONValue] = lambda: None,
        timeout_s: float = 1800.0,
        storage: str | Storage | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedAnchor needs torch.distributed initialised first")
        self._model = model
        self._optimizer = optimizer
        self._step = step
        self._data_loader = data_loader
        self.storage = as_storage(storage)
        self._commands = dist.new_group(backend="gloo", timeout=_WAIT_FOREVER)
        self._work = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank(self._work)
        self.world_size = dist.get_world_size(self._work)
        self._lock = threading.Lock()  # rank 0: one command at a time
        self._closed = False
        self.restored: AnchorState | None = None
        """On every rank: what the last successful load held (``None`` before one)."""

    # -- rank 0: the coordinator's side -----------------------------------------------

    @property
    def step(self) -> int:
        return self._step()

    async def write(self, snapshot: Path) -> WrittenAnchor:
        """:class:`AnchorSource`: every rank writes its shard of the anchor into
        ``<snapshot>/trainer/anchor``; returns once all of them have, durably."""
        self._require_rank0("write")
        step = self._step()
        entry = _trainer_entry(step, self._data_loader())
        ref = await asyncio.to_thread(self._save, Path(snapshot), step, entry)
        return WrittenAnchor(ref, step)

    def load(self, snapshot: Path, anchor: AnchorRef) -> int:
        """:data:`~turnpoint.trainer.AnchorLoader`: check the digest, then every rank
        loads its part (resharded when the number of ranks changed); returns the step.
        Blocking: the restorer runs it in a thread."""
        self._require_rank0("load")
        if self.storage is None:
            directory = str(checked_anchor_dir(snapshot, anchor))
        else:
            directory = checked_anchor_prefix(self.storage, Path(snapshot), anchor)
        with self._lock:
            self._send(_Command("load", directory))
            return self._load_together(directory).step

    def begin_step(self) -> None:
        """Rank 0, at the start of each training step (under ``step_lock``): the other
        ranks' :meth:`follow` returns and they train this step with it."""
        self._require_rank0("begin_step")
        loader = json.dumps(self._data_loader(), sort_keys=True, allow_nan=False)
        with self._lock:
            self._send(_Command("step", step=self._step(), data_loader=loader))

    def close(self) -> None:
        """Rank 0: the other ranks' :meth:`follow` returns ``None``. Idempotent; a no-op
        on the other ranks."""
        if self.rank != 0 or self._closed:
            return
        with self._lock:
            self._closed = True
            self._send(_Command("close"))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _save(self, snapshot: Path, step: int, entry: dict[str, Any]) -> AnchorRef:
        if self.storage is not None:
            try:
                prefix = _fresh_anchor_prefix(self.storage, snapshot)
            except StorageError as error:
                raise AnchorError(f"cannot reach {self.storage.url}: {error}", snapshot) from error
            with self._lock:
                self._send(_Command("save", prefix, step, entry["data_loader"]))
                files = self._save_together(prefix, step, entry)
            return _finish_on_store(self.storage, prefix, files)
        directory = _fresh_anchor_dir(snapshot)
        with self._lock:
            self._send(_Command("save", str(directory), step, entry["data_loader"]))
            self._save_together(str(directory), step, entry)
        try:
            return _finish(directory)
        except (OSError, ManifestError) as error:
            raise AnchorError(
                f"cannot make the anchor in {directory} durable: {error}", directory
            ) from error

    def _send(self, command: _Command) -> None:
        if self._closed and command.kind != "close":
            raise RuntimeError("the DistributedAnchor is closed")
        try:
            dist.broadcast_object_list([command], group=self._commands, group_src=0)
        except RuntimeError as error:
            raise AnchorError(
                f"cannot reach the other ranks: {_first_line(error)}", command.directory
            ) from error

    def _require_rank0(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what}() is rank 0's; rank {self.rank} calls follow()")

    # -- every other rank ----------------------------------------------------------------

    def follow(self) -> AnchorState | None:
        """Serve rank 0's saves and loads until it begins its next step, and return its
        step and data-loader position then; ``None`` once rank 0 closed the anchor.

        Call it before each training step, outside any collective. A save or load that
        fails is logged here and raised on rank 0, which fails the snapshot. Raises
        ``RuntimeError`` if rank 0 is gone (its connections closed).
        """
        if self.rank == 0:
            raise RuntimeError("follow() is for ranks other than 0; rank 0 calls begin_step()")
        while True:
            received: list[Any] = [None]
            dist.broadcast_object_list(received, group=self._commands, group_src=0)
            command = received[0]
            if not isinstance(command, _Command):
                raise RuntimeError(f"rank 0 sent {command!r}, not an anchor command")
            directory = command.directory
            try:
                if command.kind == "save":
                    entry = {
                        "format": ANCHOR_FORMAT,
                        "step": command.step,
                        "data_loader": command.data_loader,
                    }
                    self._save_together(directory, command.step, entry)
                elif command.kind == "load":
                    self._load_together(directory)
            except AnchorError as error:
                _LOG.warning("rank %d: %s", self.rank, error.message)
            if command.kind == "step":
                return AnchorState(command.step, loads_strict(command.data_loader))
            if command.kind == "close":
                self._closed = True
                return None

    # -- every rank, together ----------------------------------------------------------

    def _save_together(self, directory: str, step: int, entry: dict[str, Any]) -> list[str]:
        """Every rank writes its part; returns the files every rank put on the store
        (nothing for a local directory, whose digest is taken over the files there)."""
        state: dict[str, Any] = {}
        refusal = None
        own_step = self._step()
        if own_step != step:
            refusal = f"rank {self.rank} is at step {own_step}, rank 0 at {step}: out of step"
        else:
            try:
                state = _state_dict(self._model, self._optimizer)
                state["trainer"] = entry
            except _STATE_ERRORS as error:
                refusal = self._describe(error)
        self._agree("saving the anchor", refusal, directory)
        failure = None
        files: list[str] = []
        try:
            # A write that fails on one rank fails dcp_save on every rank.
            if self.storage is None:
                dcp_save(state, checkpoint_id=Path(directory), process_group=self._work)
            else:
                writer = store_writer(self.storage, directory)
                try:
                    dcp_save(state, storage_writer=writer, process_group=self._work)
                finally:
                    files = written_files(writer, directory)
        except (OSError, RuntimeError, CheckpointException, StorageError) as error:
            failure = self._describe(error)
        written = self._agree("writing the anchor", failure, directory, files)
        return sorted({name for names in written for name in names})

    def _load_together(self, directory: str) -> AnchorState:
        state: dict[str, Any] = {}
        refusal = None
        try:
            state = _state_dict(self._model, self._optimizer)
            state["trainer"] = _empty_trainer_entry()
        except _STATE_ERRORS as error:
            refusal = self._describe(error)
        self._agree("loading the anchor", refusal, directory)
        failure = None
        loaded = None
        try:
            if self.storage is None:
                dcp_load(state, checkpoint_id=Path(directory), process_group=self._work)
            else:
                reader = store_reader(self.storage, directory)
                dcp_load(state, storage_reader=reader, process_group=self._work)
            loaded = _read_trainer_entry(state["trainer"], directory)
            _apply_state(self._model, self._optimizer, state)
        except _STATE_ERRORS as error:
            failure = self._describe(error)
        self._agree("loading the anchor", failure, directory)
        assert loaded is not None
        self.restored = loaded
        return loaded

    def _agree(
        self, what: str, failure: str | None, directory: str, files: list[str] | None = None
    ) -> list[list[str]]:
        """Every rank learns every rank's failure; all raise if any rank failed. Returns
        every rank's ``files`` (what it wrote) when none did."""
        gathered: list[tuple[str | None, list[str]]] = [(None, [])] * self.world_size
        try:
            dist.all_gather_object(gathered, (failure, files or []), group=self._work)
        except RuntimeError as error:
            raise AnchorError(
                f"{what} in {directory}: the ranks could not agree: {_first_line(error)}",
                directory,
            ) from error
        # DCP reports every rank's failure on every rank: each text once.
        failed = list(dict.fromkeys(text for text, _ in gathered if text))
        if failed:
            raise AnchorError(f"{what} in {directory} failed: {'; '.join(failed)}", directory)
        return [names for _, names in gathered]

    def _describe(self, error: BaseException) -> str:
        """The failure with the rank it happened on (DCP says which ranks failed)."""
        if isinstance(error, CheckpointException) and error.failures:
            return "; ".join(
                f"rank {rank}: {type(cause).__name__}: {cause}"
                for rank, (cause, _) in sorted(error.failures.items())
            )
        return f"rank {self.rank}: {type(error).__name__}: {_first_line(error)}"
