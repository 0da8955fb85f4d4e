"""The coordinator a trainer embeds: snapshots, restore, rollout deadlines, rollouts.

- :class:`Coordinator` drives control operations over every participant (one
  ``ControlSession`` stream each), fanned out under one deadline.
- :class:`RolloutClient` dispatches rollouts, records boundaries and results,
  acknowledges each result as it arrives and gives up only on spent active budgets.
- :class:`SnapshotDriver` takes one snapshot (docs/spec.md section 7.4, steps 1-8) and
  :class:`SnapshotPump` takes them periodically; :class:`Restorer` picks the newest
  usable snapshot and plans the restore.
- :class:`WeightSync` pushes new policy weights to every policy server, retried under
  one request id per (epoch, version, server) (docs/spec.md section 5.4 item 4).
- :class:`CoordinatorConfig` is the one typed configuration.
"""

from typing import TYPE_CHECKING, Any

from turnpoint.protocol import RecoveryLevel
from turnpoint.trainer._anchor_source import TorchAnchorSource
from turnpoint.trainer._checkpointing import Checkpointing, Participants, Preempted, Resumed
from turnpoint.trainer._config import ConfigError, CoordinatorConfig
from turnpoint.trainer._control_client import ControlCallError, ParticipantControlClient
from turnpoint.trainer._control_outcomes import (
    CommitFailed,
    ControlReport,
    OperationFailed,
    PreparedCheckpoint,
    PrepareFailed,
    RestoredCheckpoint,
    RestoreFailed,
)
from turnpoint.trainer._coordinator import Coordinator
from turnpoint.trainer._deadlines import DeadlineRegistry, Hold
from turnpoint.trainer._errors import CoordinatorError
from turnpoint.trainer._identity import COORDINATOR_FILE, CoordinatorIdentity, bump_epoch
from turnpoint.trainer._inspect import inspect_root
from turnpoint.trainer._interfaces import InFlightRollout, RolloutSide
from turnpoint.trainer._liveness import (
    LivenessTracker,
    ParticipantLostError,
    watch_liveness,
)
from turnpoint.trainer._manifest import (
    AnchorRef,
    ManifestError,
    PublishStep,
    SnapshotLayout,
    SnapshotManifest,
    tree_digest,
)
from turnpoint.trainer._metrics import CoordinatorMetrics
from turnpoint.trainer._recovery import LevelDecision, decide_levels
from turnpoint.trainer._restarts import RestartBudget, RestartDecision
from turnpoint.trainer._restore import (
    NoUsableSnapshotError,
    Redispatch,
    Rerun,
    RestorePlan,
    Restorer,
    apply_plan,
    plan_restore,
    torch_anchor_loader,
)
from turnpoint.trainer._rollout_values import (
    Rollout,
    RolloutClientSettings,
    RolloutOutcome,
    RolloutResult,
)
from turnpoint.trainer._rollouts import AgentEndpoint, RolloutClient
from turnpoint.trainer._snapshot_attempt import (
    SnapshotPhase,
    SnapshotPoint,
    SnapshotState,
    points_of,
)
from turnpoint.trainer._snapshot_pump import (
    SnapshotFailuresError,
    SnapshotInvariantError,
    SnapshotPump,
    SnapshotRunError,
)
from turnpoint.trainer._snapshot_report import FailureReason, SnapshotOutcome, SnapshotReport
from turnpoint.trainer._snapshots import SnapshotDriver
from turnpoint.trainer._topology import ParticipantInfo, Topology
from turnpoint.trainer._weight_sync import WeightSync, WeightSyncReport
from turnpoint.trainer._weight_sync_core import WeightSyncError, WeightSyncSettings

__all__ = [
    "COORDINATOR_FILE",
    "AgentEndpoint",
    "AnchorError",
    "AnchorRef",
    "AnchorWriter",
    "Checkpointing",
    "CommitFailed",
    "ConfigError",
    "ControlCallError",
    "ControlReport",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorError",
    "CoordinatorIdentity",
    "CoordinatorMetrics",
    "DeadlineRegistry",
    "DistributedAnchor",
    "FailureReason",
    "Hold",
    "InFlightRollout",
    "LevelDecision",
    "LivenessTracker",
    "ManifestError",
    "NoUsableSnapshotError",
    "OperationFailed",
    "ParticipantControlClient",
    "ParticipantInfo",
    "ParticipantLostError",
    "Participants",
    "Preempted",
    "PrepareFailed",
    "PreparedCheckpoint",
    "PublishStep",
    "RecoveryLevel",
    "Redispatch",
    "Rerun",
    "RestartBudget",
    "RestartDecision",
    "RestoreFailed",
    "RestorePlan",
    "RestoredCheckpoint",
    "Restorer",
    "Resumed",
    "Rollout",
    "RolloutClient",
    "RolloutClientSettings",
    "RolloutOutcome",
    "RolloutResult",
    "RolloutSide",
    "SnapshotDriver",
    "SnapshotFailuresError",
    "SnapshotInvariantError",
    "SnapshotLayout",
    "SnapshotManifest",
    "SnapshotOutcome",
    "SnapshotPhase",
    "SnapshotPoint",
    "SnapshotPump",
    "SnapshotReport",
    "SnapshotRunError",
    "SnapshotState",
    "Topology",
    "TorchAnchorSource",
    "WeightSync",
    "WeightSyncError",
    "WeightSyncReport",
    "WeightSyncSettings",
    "apply_plan",
    "bump_epoch",
    "decide_levels",
    "inspect_root",
    "load_anchor",
    "plan_restore",
    "points_of",
    "save_anchor",
    "torch_anchor_loader",
    "tree_digest",
    "watch_liveness",
]

if TYPE_CHECKING:
    from turnpoint.trainer._anchor import AnchorError, AnchorWriter, load_anchor, save_anchor
    from turnpoint.trainer._anchor_ranks import DistributedAnchor

# The torch-backed anchor loads on first use, so that importing the coordinator does
# not import torch (a trainer on another framework supplies its own AnchorSource).
_LAZY = {"AnchorError", "AnchorWriter", "load_anchor", "save_anchor"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from turnpoint.trainer import _anchor

        return getattr(_anchor, name)
    if name == "DistributedAnchor":
        from turnpoint.trainer import _anchor_ranks

        return _anchor_ranks.DistributedAnchor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
