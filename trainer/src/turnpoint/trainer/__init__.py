"""The coordinator a trainer embeds: snapshots, restore, rollout deadlines, rollouts.

This face is what a trainer author needs (docs/embedding.md):

- the facade: :class:`Checkpointing` (open and restore, dispatch, snapshot, close),
  :class:`Resumed`, :class:`Preempted`, :data:`Participants`;
- its configuration: :class:`CoordinatorConfig`, :class:`ConfigError`;
- rollouts: :class:`Rollout`, :class:`RolloutResult`, :class:`RolloutOutcome`,
  :class:`RolloutClientSettings`, and :class:`RecoveryLevel`;
- the trainer anchor: :class:`AnchorSource` (what a snapshot writes first),
  :class:`FileAnchorSource` and :func:`file_anchor_loader` (no torch needed),
  :class:`TorchAnchorSource`, :func:`torch_anchor_loader` and :class:`DistributedAnchor`
  (torch distributed checkpoint, loaded on first use), :data:`AnchorLoader`;
- the weight sync: :class:`WeightSync` (also through
  :meth:`Checkpointing.push_weights`), :class:`WeightSyncSettings`,
  :class:`WeightSyncReport`, :class:`WeightSyncError`;
- what snapshots report: :class:`SnapshotReport`, :class:`SnapshotOutcome`,
  :class:`FailureReason`, and the states an attempt passes through,
  :class:`SnapshotState` (``Checkpointing(on_transition=...)``);
- healing a lost participant in place (``Checkpointing(launcher=...)``): the
  :class:`Launcher` the job supplies, :class:`LocalProcessLauncher`,
  :class:`StableAddressLauncher` (a worker group's or a pod's own supervisor restarts
  it), :class:`LaunchError`;
- the coordinator's Prometheus metrics: :class:`CoordinatorMetrics`
  (``Checkpointing(metrics=...)``);
- the errors, all :class:`CoordinatorError`: :class:`NoUsableSnapshotError`,
  :class:`RestoreRefusedError`,
  :class:`SnapshotFailuresError`, :class:`SnapshotInvariantError`,
  :class:`ParticipantLostError`, :class:`AnchorError`, :class:`WeightSyncError`,
  :class:`LaunchError`, :class:`HealRefusedError`.

Those assembling their own loop from the parts (the coordinator, the rollout client, the
snapshot driver and pump, the restorer) import :mod:`turnpoint.trainer.advanced`; test
and demo hooks are in :mod:`turnpoint.trainer.testing`. The implementation is organised
by concern: ``control`` (the coordinator and its client), ``rollouts``, ``snapshots``,
``storage`` (snapshots on disk), ``restore`` and ``anchors``.

Names load on first use, so importing this package imports nothing else: a pure module
such as :mod:`turnpoint.trainer.rollouts.ledger` imports alone, and a trainer on another
framework never loads torch.
"""

from typing import TYPE_CHECKING

from turnpoint._faces import lazy_names

if TYPE_CHECKING:
    from turnpoint.protocol import RecoveryLevel as RecoveryLevel
    from turnpoint.trainer.anchors.dcp import TorchAnchorSource as TorchAnchorSource
    from turnpoint.trainer.anchors.file import FileAnchorSource as FileAnchorSource
    from turnpoint.trainer.anchors.file import file_anchor_loader as file_anchor_loader
    from turnpoint.trainer.anchors.ranks import DistributedAnchor as DistributedAnchor
    from turnpoint.trainer.anchors.source import AnchorError as AnchorError
    from turnpoint.trainer.anchors.source import AnchorSource as AnchorSource
    from turnpoint.trainer.checkpointing import Checkpointing as Checkpointing
    from turnpoint.trainer.checkpointing import HealRefusedError as HealRefusedError
    from turnpoint.trainer.checkpointing import Participants as Participants
    from turnpoint.trainer.checkpointing import Preempted as Preempted
    from turnpoint.trainer.checkpointing import Resumed as Resumed
    from turnpoint.trainer.config import ConfigError as ConfigError
    from turnpoint.trainer.config import CoordinatorConfig as CoordinatorConfig
    from turnpoint.trainer.control.liveness import ParticipantLostError as ParticipantLostError
    from turnpoint.trainer.errors import CoordinatorError as CoordinatorError
    from turnpoint.trainer.metrics import CoordinatorMetrics as CoordinatorMetrics
    from turnpoint.trainer.restore.launcher import Launcher as Launcher
    from turnpoint.trainer.restore.launcher import LaunchError as LaunchError
    from turnpoint.trainer.restore.launcher import LocalProcessLauncher as LocalProcessLauncher
    from turnpoint.trainer.restore.launcher import (
        StableAddressLauncher as StableAddressLauncher,
    )
    from turnpoint.trainer.restore.restorer import AnchorLoader as AnchorLoader
    from turnpoint.trainer.restore.restorer import NoUsableSnapshotError as NoUsableSnapshotError
    from turnpoint.trainer.restore.restorer import RestoreRefusedError as RestoreRefusedError
    from turnpoint.trainer.restore.restorer import torch_anchor_loader as torch_anchor_loader
    from turnpoint.trainer.rollouts.values import Rollout as Rollout
    from turnpoint.trainer.rollouts.values import RolloutClientSettings as RolloutClientSettings
    from turnpoint.trainer.rollouts.values import RolloutOutcome as RolloutOutcome
    from turnpoint.trainer.rollouts.values import RolloutResult as RolloutResult
    from turnpoint.trainer.snapshots.attempt import SnapshotState as SnapshotState
    from turnpoint.trainer.snapshots.pump import SnapshotFailuresError as SnapshotFailuresError
    from turnpoint.trainer.snapshots.pump import SnapshotInvariantError as SnapshotInvariantError
    from turnpoint.trainer.snapshots.report import FailureReason as FailureReason
    from turnpoint.trainer.snapshots.report import SnapshotOutcome as SnapshotOutcome
    from turnpoint.trainer.snapshots.report import SnapshotReport as SnapshotReport
    from turnpoint.trainer.weights.core import WeightSyncError as WeightSyncError
    from turnpoint.trainer.weights.core import WeightSyncSettings as WeightSyncSettings
    from turnpoint.trainer.weights.sync import WeightSync as WeightSync
    from turnpoint.trainer.weights.sync import WeightSyncReport as WeightSyncReport

# Each name and the module that owns it.
_OWNERS = {
    "AnchorError": "turnpoint.trainer.anchors.source",
    "AnchorLoader": "turnpoint.trainer.restore.restorer",
    "AnchorSource": "turnpoint.trainer.anchors.source",
    "Checkpointing": "turnpoint.trainer.checkpointing",
    "ConfigError": "turnpoint.trainer.config",
    "CoordinatorConfig": "turnpoint.trainer.config",
    "CoordinatorError": "turnpoint.trainer.errors",
    "CoordinatorMetrics": "turnpoint.trainer.metrics",
    "DistributedAnchor": "turnpoint.trainer.anchors.ranks",
    "FailureReason": "turnpoint.trainer.snapshots.report",
    "FileAnchorSource": "turnpoint.trainer.anchors.file",
    "HealRefusedError": "turnpoint.trainer.checkpointing",
    "LaunchError": "turnpoint.trainer.restore.launcher",
    "Launcher": "turnpoint.trainer.restore.launcher",
    "LocalProcessLauncher": "turnpoint.trainer.restore.launcher",
    "NoUsableSnapshotError": "turnpoint.trainer.restore.restorer",
    "ParticipantLostError": "turnpoint.trainer.control.liveness",
    "Participants": "turnpoint.trainer.checkpointing",
    "Preempted": "turnpoint.trainer.checkpointing",
    "RecoveryLevel": "turnpoint.protocol",
    "RestoreRefusedError": "turnpoint.trainer.restore.restorer",
    "Resumed": "turnpoint.trainer.checkpointing",
    "Rollout": "turnpoint.trainer.rollouts.values",
    "RolloutClientSettings": "turnpoint.trainer.rollouts.values",
    "RolloutOutcome": "turnpoint.trainer.rollouts.values",
    "RolloutResult": "turnpoint.trainer.rollouts.values",
    "SnapshotFailuresError": "turnpoint.trainer.snapshots.pump",
    "SnapshotInvariantError": "turnpoint.trainer.snapshots.pump",
    "SnapshotOutcome": "turnpoint.trainer.snapshots.report",
    "SnapshotReport": "turnpoint.trainer.snapshots.report",
    "SnapshotState": "turnpoint.trainer.snapshots.attempt",
    "StableAddressLauncher": "turnpoint.trainer.restore.launcher",
    "TorchAnchorSource": "turnpoint.trainer.anchors.dcp",
    "WeightSync": "turnpoint.trainer.weights.sync",
    "WeightSyncError": "turnpoint.trainer.weights.core",
    "WeightSyncReport": "turnpoint.trainer.weights.sync",
    "WeightSyncSettings": "turnpoint.trainer.weights.core",
    "file_anchor_loader": "turnpoint.trainer.anchors.file",
    "torch_anchor_loader": "turnpoint.trainer.restore.restorer",
}

__all__ = sorted(_OWNERS)

if not TYPE_CHECKING:  # type checkers take the names from the imports above
    __getattr__, __dir__ = lazy_names(globals(), _OWNERS)
