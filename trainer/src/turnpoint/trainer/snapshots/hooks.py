"""What a test (or ``turnpoint demo --crash-at``) hooks into the snapshots a
:class:`~turnpoint.trainer.Checkpointing` takes: its driver, to watch each attempt's
transitions and read the attempt under way, and each step of a publication. Not for
production trainers: exported by :mod:`turnpoint.trainer.testing` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from turnpoint.trainer.snapshots.driver import SnapshotDriver
    from turnpoint.trainer.storage.layout import PublishStep


class SnapshotHooks(Protocol):
    """Given to ``Checkpointing(testing_hooks=...)``.

    :meth:`attach` is called once in :meth:`~turnpoint.trainer.Checkpointing.open`, with
    the driver, before the first snapshot; :meth:`after_publish_step` after each step of
    every publication, in the thread that publishes (it may raise, or end the process,
    to stop a publication there).
    """

    def attach(self, driver: SnapshotDriver) -> None: ...

    def after_publish_step(self, step: PublishStep) -> None: ...
