"""What a participant's hooks may raise, and what the coordinator then sees.

A hook is someone else's code (a Gym server's export, a tool call, a verifier): when it
fails, that is data for the coordinator, never a reason to end a training run by itself
(docs/spec.md section 5.1). The mapping, applied by the servers at the wire edge:

====================================================  ===========================  =========
what the hook raises                                  reason on the wire           transient
====================================================  ===========================  =========
:class:`TransientError` (the documented way to say    ``UNAVAILABLE``              yes
"try again": a flaky tool backend, a sandbox that is
restarting)
``ConnectionError``, ``TimeoutError``                 ``UNAVAILABLE``              yes
any other ``TurnpointError``                          its own reason               per reason
any other exception                                   ``HOOK_FAILED``              yes
====================================================  ===========================  =========

The coordinator fails the snapshot (naming the participant and the exception type),
retries it, and ends the run only after ``max_consecutive_failures`` failures in a row.
The exception's text never goes on the wire, since it may hold paths, hosts or
secrets; the participant logs it with its traceback.

Pure: no grpc, no asyncio.
"""

from __future__ import annotations

from collections.abc import Mapping

from turnpoint.errors import Reason, TurnpointError

_MAX_OPERATION_CHARS = 64


class ParticipantError(TurnpointError):
    """Root of the errors the participant SDK raises."""

    def __init__(
        self, reason: Reason, message: str, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(reason, message, metadata)


class TransientError(ParticipantError):
    """Raise from a hook to say "this failed for now; try again".

    The message is for the participant's own log and is sent to the coordinator, so keep
    secrets out of it::

        async def call_tool(self, session, tool, arguments):
            try:
                return await self.backend.call(tool, arguments)
            except BackendOverloaded:
                raise TransientError("tool backend overloaded") from None
    """

    def __init__(self, message: str = "a transient failure", **metadata: str) -> None:
        super().__init__(Reason.UNAVAILABLE, message, metadata)

    def __reduce__(self) -> tuple[object, ...]:
        return (_transient, (self.message, self.metadata))


def _transient(message: str, metadata: Mapping[str, str]) -> TransientError:
    return TransientError(message, **metadata)


def hook_failure(error: Exception, operation: str) -> TurnpointError:
    """The typed error the coordinator sees for ``error`` raised while serving ``operation``."""
    operation = operation[:_MAX_OPERATION_CHARS]
    if isinstance(error, TurnpointError):
        return error
    exception = type(error).__name__
    metadata = {"operation": operation, "exception": exception}
    if isinstance(error, ConnectionError | TimeoutError):
        return ParticipantError(
            Reason.UNAVAILABLE,
            f"{operation}: a participant hook could not reach what it depends on ({exception})",
            metadata,
        )
    return ParticipantError(
        Reason.HOOK_FAILED, f"{operation}: a participant hook raised {exception}", metadata
    )
