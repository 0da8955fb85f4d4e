"""The participant SDK: what a Gym server links to take part in turnpoint checkpoints.

Implement a kind (:class:`Agent`, :class:`ResourcesServer` or :class:`PolicyModel`) and
host it in a :class:`ParticipantRuntime`; the wire adapters in ``turnpoint.server`` call
the runtime's methods one to one. Everything here speaks plain dataclasses; errors are
``turnpoint.errors.TurnpointError`` carrying a :class:`turnpoint.errors.Reason`.
"""

from turnpoint.protocol import (
    Blocker,
    CompletionReceipt,
    EpisodeState,
    Fence,
    ParticipantKind,
    Phase,
    ReadinessReport,
    RecoveryLevel,
    RecoveryMode,
    VerifyMode,
)

from ._agent import (
    Agent,
    BoundaryReport,
    EpisodeContext,
    RunOutcome,
    RunResult,
    SavedTurn,
)
from ._failures import ParticipantError, TransientError, hook_failure
from ._generation import Generation, GenerationRequest, WeightsChange
from ._model import GenerateChunk, GenerateRequest, PolicyModel
from ._resources import ConfigurationError, ResourcesServer, Verdict
from ._runtime import (
    AcknowledgeResult,
    BoundaryEvent,
    CommitResult,
    Description,
    ForgetResult,
    Header,
    ParticipantRuntime,
    PrepareResult,
    ReadinessUpdate,
    RenewResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
    StatusResult,
    WatchEvent,
)
from ._shared import RuntimeConfig
from ._store import (
    ArtifactRef,
    CorruptSnapshotError,
    FaultHook,
    FaultPoint,
    Record,
    SnapshotConflictError,
    SnapshotEntry,
    SnapshotStore,
    StoreError,
)

__all__ = [
    "AcknowledgeResult",
    "Agent",
    "ArtifactRef",
    "Blocker",
    "BoundaryEvent",
    "BoundaryReport",
    "CommitResult",
    "CompletionReceipt",
    "ConfigurationError",
    "CorruptSnapshotError",
    "Description",
    "EpisodeContext",
    "EpisodeState",
    "FaultHook",
    "FaultPoint",
    "Fence",
    "ForgetResult",
    "GenerateChunk",
    "GenerateRequest",
    "Generation",
    "GenerationRequest",
    "Header",
    "ParticipantError",
    "ParticipantKind",
    "ParticipantRuntime",
    "Phase",
    "PolicyModel",
    "PrepareResult",
    "ReadinessReport",
    "ReadinessUpdate",
    "Record",
    "RecoveryLevel",
    "RecoveryMode",
    "RenewResult",
    "ResourcesServer",
    "RestoreResult",
    "ResumeResult",
    "RetireResult",
    "RunOutcome",
    "RunResult",
    "RuntimeConfig",
    "SavedTurn",
    "SnapshotConflictError",
    "SnapshotEntry",
    "SnapshotStore",
    "StatusResult",
    "StoreError",
    "TransientError",
    "Verdict",
    "VerifyMode",
    "WatchEvent",
    "WeightsChange",
    "hook_failure",
]
