"""The participant SDK: what a Gym server links to take part in turnpoint checkpoints.

Implement a kind, host it in a :class:`ParticipantRuntime` and serve the runtime with
``turnpoint.server.host_participant``. Everything here speaks plain dataclasses.

The kinds (subclass one and implement its hooks):

- :class:`Agent`: episodes that run turn by turn; :class:`EpisodeContext` is what
  ``Agent.run`` gets, :class:`SavedTurn` where a restored attempt continues. Its tool
  calls (``ctx.call``, ``ctx.verify``) go through a :class:`ResourcesConnection`
  (``turnpoint.server.ResourcesClient`` over gRPC), keyed so that each runs once
  across retries and restores (:class:`EffectConflictError` when a key is re-sent
  with another call).
- :class:`ResourcesServer`: tools, sandboxes, verifiers; ``verify`` returns a
  :class:`Verdict`. :class:`RecoveryMode` and :class:`VerifyMode` (from
  :mod:`turnpoint.protocol`) say what a checkpoint may do with its sessions.
- :class:`PolicyModel`: generations under admission control, a
  :class:`GenerateRequest` in, :class:`GenerateChunk` out.

Token-prefix recovery (docs/spec.md section 5.5): :class:`Generation`,
:class:`GenerationRequest`, :class:`WeightsChange`.

Hosting: :class:`ParticipantRuntime` with its :class:`RuntimeConfig`, and the
:class:`SnapshotStore` it writes :class:`Record` s to (:class:`SnapshotEntry` is what
one participant's part of a snapshot holds).

Errors (all :class:`turnpoint.errors.TurnpointError` carrying a :class:`Reason`, which
is ``turnpoint.errors.Reason`` named here too): :class:`ParticipantError`, :class:`TransientError`
(a hook's "try again"), :class:`ConfigurationError`, and the store's
:class:`StoreError`, :class:`CorruptSnapshotError`, :class:`SnapshotConflictError`.

Elsewhere: what a wire adapter of the runtime needs (its replies, the hook failure
mapping) is :mod:`turnpoint.participant_sdk.advanced`; the deterministic store fault
injector for tests is :mod:`turnpoint.participant_sdk.testing`; sandbox providers
(files and processes as session state) are :mod:`turnpoint.participant_sdk.sandboxes`; the protocol's
vocabulary (phases, fences, readiness, receipts) is :mod:`turnpoint.protocol`.
"""

from turnpoint.errors import Reason
from turnpoint.protocol import RecoveryMode, VerifyMode

from ._agent import Agent, EpisodeContext, SavedTurn
from ._effects import EffectConflictError
from ._failures import ParticipantError, TransientError
from ._model import GenerateChunk, GenerateRequest, PolicyModel
from ._resources import ConfigurationError, ResourcesServer, Verdict
from ._runtime import ParticipantRuntime
from ._shared import RuntimeConfig
from ._store import SnapshotConflictError, SnapshotStore
from ._store_format import CorruptSnapshotError, Record, SnapshotEntry, StoreError
from ._token_prefix import Generation, GenerationRequest, WeightsChange
from ._tool_client import ResourcesConnection

__all__ = [
    "Agent",
    "ConfigurationError",
    "CorruptSnapshotError",
    "EffectConflictError",
    "EpisodeContext",
    "GenerateChunk",
    "GenerateRequest",
    "Generation",
    "GenerationRequest",
    "ParticipantError",
    "ParticipantRuntime",
    "PolicyModel",
    "Reason",
    "Record",
    "RecoveryMode",
    "ResourcesConnection",
    "ResourcesServer",
    "RuntimeConfig",
    "SavedTurn",
    "SnapshotConflictError",
    "SnapshotEntry",
    "SnapshotStore",
    "StoreError",
    "TransientError",
    "Verdict",
    "VerifyMode",
    "WeightsChange",
]
