"""The trainer anchor a snapshot starts with (docs/spec.md section 7.4 step 1, 8.8)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from turnpoint.errors import Reason
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.storage.manifest import AnchorRef, JSONValue

if TYPE_CHECKING:
    import torch

__all__ = ["AnchorSource", "TorchAnchorSource", "WrittenAnchor"]


class AnchorError(CoordinatorError):
    """An anchor could not be written, or is missing, corrupt or does not fit the model.

    ``INVALID_CHECKPOINT_STATE``: a restore picks an older snapshot.
    """

    def __init__(self, message: str, path: Path | str) -> None:
        super().__init__(Reason.INVALID_CHECKPOINT_STATE, message, {"path": str(path)})
        self.path = str(path)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.path))


@dataclass(frozen=True, slots=True)
class WrittenAnchor:
    """A durable trainer anchor and the training step it holds."""

    ref: AnchorRef
    step: int


class AnchorSource(Protocol):
    """Writes the trainer anchor (model, optimizer, step, loader position)."""

    @property
    def step(self) -> int:
        """The training step an anchor written now would hold."""
        ...

    async def write(self, snapshot: Path) -> WrittenAnchor:
        """Write the anchor into ``<snapshot>/trainer/anchor`` and return it once durable.

        Blocking work must run in threads. Finish any asynchronous write of an earlier
        anchor first: nothing may reference an anchor that is not durable.
        """
        ...


class TorchAnchorSource:
    """:class:`AnchorSource` over torch distributed checkpoint
    (:class:`~turnpoint.trainer.anchors.dcp.AnchorWriter`).

    ``step`` and ``data_loader`` are read when an anchor is written. torch is imported
    only when this class is used. One process; a trainer on many ranks uses
    :class:`~turnpoint.trainer.anchors.ranks.DistributedAnchor` instead.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        step: Callable[[], int],
        data_loader: Callable[[], JSONValue] = lambda: None,
    ) -> None:
        from turnpoint.trainer.anchors.dcp import AnchorWriter

        self._model = model
        self._optimizer = optimizer
        self._step = step
        self._data_loader = data_loader
        self.writer = AnchorWriter()

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
