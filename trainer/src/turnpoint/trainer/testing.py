"""Hooks for tests and for the demo's deterministic crashes: the points of a snapshot at
which a test (or ``turnpoint demo --crash-at``) acts, the publication's steps, and
:class:`SnapshotHooks`, which :class:`~turnpoint.trainer.Checkpointing` takes as
``testing_hooks`` to watch both. Not for production trainers.
"""

from typing import TYPE_CHECKING

from turnpoint._faces import lazy_names

if TYPE_CHECKING:
    from turnpoint.trainer.snapshots.attempt import SnapshotPoint as SnapshotPoint
    from turnpoint.trainer.snapshots.attempt import points_of as points_of
    from turnpoint.trainer.snapshots.hooks import SnapshotHooks as SnapshotHooks
    from turnpoint.trainer.storage.layout import PublishStep as PublishStep

# Each name and the module that owns it.
_OWNERS = {
    "PublishStep": "turnpoint.trainer.storage.layout",
    "SnapshotHooks": "turnpoint.trainer.snapshots.hooks",
    "SnapshotPoint": "turnpoint.trainer.snapshots.attempt",
    "points_of": "turnpoint.trainer.snapshots.attempt",
}

__all__ = sorted(_OWNERS)

if not TYPE_CHECKING:  # type checkers take the names from the imports above
    __getattr__, __dir__ = lazy_names(globals(), _OWNERS)
