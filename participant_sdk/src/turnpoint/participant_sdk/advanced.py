"""For whoever adapts a :class:`~turnpoint.participant_sdk.ParticipantRuntime` to a wire.

``turnpoint.server`` is one such adapter; a Gym server that hosts the runtime its own
way (another RPC stack, another process model) needs the same names:

- the runtime's replies, one frozen dataclass per control operation
  (:class:`PrepareResult`, :class:`CommitResult`, ... :class:`StatusResult`), the
  :class:`Header` every reply carries and the :class:`Description` of ``Describe``;
- what ``watch`` yields (:data:`WatchEvent`: a :class:`ReadinessUpdate` or a
  :class:`BoundaryEvent`) and what ``run_episode`` streams (:class:`BoundaryReport`
  then one :class:`RunResult` with its :class:`RunOutcome`);
- :func:`hook_failure`: how an exception a hook raised becomes the protocol error the
  caller sees (docs/spec.md section 5.1);
- :func:`effect_key` at a :class:`CallPosition`: the key a tool call carries so that a
  retry or a restored attempt is answered from the tool's record (section 6.12);
- :func:`retried`: a call asked again while its server is unreachable, for as long as
  a lost server takes to be replaced where it was (section 7.15), as the SDK's agents
  ask their model and tool calls again.
"""

from ._agent import BoundaryReport, RunOutcome, RunResult
from ._effects import CallPosition, effect_key
from ._failures import hook_failure
from ._results import (
    AcknowledgeResult,
    BoundaryEvent,
    CommitResult,
    Description,
    ForgetResult,
    Header,
    PrepareResult,
    ReadinessUpdate,
    RenewResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
    StatusResult,
    WatchEvent,
)
from ._tool_client import retried

__all__ = [
    "AcknowledgeResult",
    "BoundaryEvent",
    "BoundaryReport",
    "CallPosition",
    "CommitResult",
    "Description",
    "ForgetResult",
    "Header",
    "PrepareResult",
    "ReadinessUpdate",
    "RenewResult",
    "RestoreResult",
    "ResumeResult",
    "RetireResult",
    "RunOutcome",
    "RunResult",
    "StatusResult",
    "WatchEvent",
    "effect_key",
    "hook_failure",
    "retried",
]
