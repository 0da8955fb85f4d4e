"""The trainer anchor a snapshot starts with (docs/spec.md section 7.4 step 1, 8.8)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from turnpoint.errors import Reason
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.storage.manifest import AnchorRef


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
