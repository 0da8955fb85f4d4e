"""The parts behind :class:`~turnpoint.trainer.Checkpointing`, for a trainer that
assembles its own loop (docs/embedding.md names what the facade composes):

- the control plane: :class:`Coordinator` (epoch, discovery, every control operation
  fanned out), its identity (:class:`CoordinatorIdentity`, :func:`bump_epoch`), the
  client for one participant and what operations report or raise;
- rollouts: :class:`RolloutClient` and its deadlines (:class:`DeadlineRegistry`);
- snapshots: :class:`SnapshotDriver` (one snapshot, docs/spec.md section 7.4) and
  :class:`SnapshotPump` (the failure policy, section 7.5);
- restore: :class:`Restorer`, :func:`plan_restore` and :func:`apply_plan` (section 7.7),
  recovery levels (section 7.8) and the restart budget (section 7.11);
- storage: :class:`SnapshotLayout` and :class:`SnapshotManifest` (section 8);
- the torch anchor's writer and loader (torch is imported on first use);
- liveness and metrics.
"""

from typing import TYPE_CHECKING

from turnpoint._faces import lazy_names

if TYPE_CHECKING:
    from turnpoint.trainer.anchors.dcp import AnchorWriter as AnchorWriter
    from turnpoint.trainer.anchors.dcp import load_anchor as load_anchor
    from turnpoint.trainer.anchors.dcp import save_anchor as save_anchor
    from turnpoint.trainer.anchors.source import WrittenAnchor as WrittenAnchor
    from turnpoint.trainer.control.client import (
        ParticipantControlClient as ParticipantControlClient,
    )
    from turnpoint.trainer.control.coordinator import Coordinator as Coordinator
    from turnpoint.trainer.control.failures import ControlCallError as ControlCallError
    from turnpoint.trainer.control.identity import COORDINATOR_FILE as COORDINATOR_FILE
    from turnpoint.trainer.control.identity import CoordinatorIdentity as CoordinatorIdentity
    from turnpoint.trainer.control.identity import bump_epoch as bump_epoch
    from turnpoint.trainer.control.liveness import LivenessTracker as LivenessTracker
    from turnpoint.trainer.control.liveness import watch_liveness as watch_liveness
    from turnpoint.trainer.control.outcomes import CommitFailed as CommitFailed
    from turnpoint.trainer.control.outcomes import ControlReport as ControlReport
    from turnpoint.trainer.control.outcomes import OperationFailed as OperationFailed
    from turnpoint.trainer.control.outcomes import PreparedCheckpoint as PreparedCheckpoint
    from turnpoint.trainer.control.outcomes import PrepareFailed as PrepareFailed
    from turnpoint.trainer.control.outcomes import RestoredCheckpoint as RestoredCheckpoint
    from turnpoint.trainer.control.outcomes import RestoreFailed as RestoreFailed
    from turnpoint.trainer.control.topology import ParticipantInfo as ParticipantInfo
    from turnpoint.trainer.control.topology import Topology as Topology
    from turnpoint.trainer.metrics import CoordinatorMetrics as CoordinatorMetrics
    from turnpoint.trainer.restore.restarts import RestartBudget as RestartBudget
    from turnpoint.trainer.restore.restarts import RestartDecision as RestartDecision
    from turnpoint.trainer.restore.restorer import Redispatch as Redispatch
    from turnpoint.trainer.restore.restorer import Rerun as Rerun
    from turnpoint.trainer.restore.restorer import RestorePlan as RestorePlan
    from turnpoint.trainer.restore.restorer import Restorer as Restorer
    from turnpoint.trainer.restore.restorer import apply_plan as apply_plan
    from turnpoint.trainer.restore.restorer import plan_restore as plan_restore
    from turnpoint.trainer.rollouts.client import AgentEndpoint as AgentEndpoint
    from turnpoint.trainer.rollouts.client import RolloutClient as RolloutClient
    from turnpoint.trainer.rollouts.deadlines import DeadlineRegistry as DeadlineRegistry
    from turnpoint.trainer.rollouts.deadlines import Hold as Hold
    from turnpoint.trainer.rollouts.side import InFlightRollout as InFlightRollout
    from turnpoint.trainer.rollouts.side import RolloutSide as RolloutSide
    from turnpoint.trainer.snapshots.attempt import SnapshotPhase as SnapshotPhase
    from turnpoint.trainer.snapshots.attempt import SnapshotState as SnapshotState
    from turnpoint.trainer.snapshots.driver import SnapshotDriver as SnapshotDriver
    from turnpoint.trainer.snapshots.levels import LevelDecision as LevelDecision
    from turnpoint.trainer.snapshots.levels import decide_levels as decide_levels
    from turnpoint.trainer.snapshots.pump import SnapshotPump as SnapshotPump
    from turnpoint.trainer.snapshots.pump import SnapshotRunError as SnapshotRunError
    from turnpoint.trainer.storage.layout import SnapshotLayout as SnapshotLayout
    from turnpoint.trainer.storage.layout import tree_digest as tree_digest
    from turnpoint.trainer.storage.manifest import AnchorRef as AnchorRef
    from turnpoint.trainer.storage.manifest import ManifestError as ManifestError
    from turnpoint.trainer.storage.manifest import SnapshotManifest as SnapshotManifest

# Each name and the module that owns it.
_OWNERS = {
    "AgentEndpoint": "turnpoint.trainer.rollouts.client",
    "AnchorRef": "turnpoint.trainer.storage.manifest",
    "AnchorWriter": "turnpoint.trainer.anchors.dcp",
    "COORDINATOR_FILE": "turnpoint.trainer.control.identity",
    "CommitFailed": "turnpoint.trainer.control.outcomes",
    "ControlCallError": "turnpoint.trainer.control.failures",
    "ControlReport": "turnpoint.trainer.control.outcomes",
    "Coordinator": "turnpoint.trainer.control.coordinator",
    "CoordinatorIdentity": "turnpoint.trainer.control.identity",
    "CoordinatorMetrics": "turnpoint.trainer.metrics",
    "DeadlineRegistry": "turnpoint.trainer.rollouts.deadlines",
    "Hold": "turnpoint.trainer.rollouts.deadlines",
    "InFlightRollout": "turnpoint.trainer.rollouts.side",
    "LevelDecision": "turnpoint.trainer.snapshots.levels",
    "LivenessTracker": "turnpoint.trainer.control.liveness",
    "ManifestError": "turnpoint.trainer.storage.manifest",
    "OperationFailed": "turnpoint.trainer.control.outcomes",
    "ParticipantControlClient": "turnpoint.trainer.control.client",
    "ParticipantInfo": "turnpoint.trainer.control.topology",
    "PrepareFailed": "turnpoint.trainer.control.outcomes",
    "PreparedCheckpoint": "turnpoint.trainer.control.outcomes",
    "Redispatch": "turnpoint.trainer.restore.restorer",
    "Rerun": "turnpoint.trainer.restore.restorer",
    "RestartBudget": "turnpoint.trainer.restore.restarts",
    "RestartDecision": "turnpoint.trainer.restore.restarts",
    "RestoreFailed": "turnpoint.trainer.control.outcomes",
    "RestorePlan": "turnpoint.trainer.restore.restorer",
    "RestoredCheckpoint": "turnpoint.trainer.control.outcomes",
    "Restorer": "turnpoint.trainer.restore.restorer",
    "RolloutClient": "turnpoint.trainer.rollouts.client",
    "RolloutSide": "turnpoint.trainer.rollouts.side",
    "SnapshotDriver": "turnpoint.trainer.snapshots.driver",
    "SnapshotLayout": "turnpoint.trainer.storage.layout",
    "SnapshotManifest": "turnpoint.trainer.storage.manifest",
    "SnapshotPhase": "turnpoint.trainer.snapshots.attempt",
    "SnapshotPump": "turnpoint.trainer.snapshots.pump",
    "SnapshotRunError": "turnpoint.trainer.snapshots.pump",
    "SnapshotState": "turnpoint.trainer.snapshots.attempt",
    "Topology": "turnpoint.trainer.control.topology",
    "WrittenAnchor": "turnpoint.trainer.anchors.source",
    "apply_plan": "turnpoint.trainer.restore.restorer",
    "bump_epoch": "turnpoint.trainer.control.identity",
    "decide_levels": "turnpoint.trainer.snapshots.levels",
    "load_anchor": "turnpoint.trainer.anchors.dcp",
    "plan_restore": "turnpoint.trainer.restore.restorer",
    "save_anchor": "turnpoint.trainer.anchors.dcp",
    "tree_digest": "turnpoint.trainer.storage.layout",
    "watch_liveness": "turnpoint.trainer.control.liveness",
}

__all__ = sorted(_OWNERS)

if not TYPE_CHECKING:  # type checkers take the names from the imports above
    __getattr__, __dir__ = lazy_names(globals(), _OWNERS)
