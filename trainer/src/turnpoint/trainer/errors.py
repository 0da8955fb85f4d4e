"""The coordinator library's one error root.

Every failure the coordinator raises is a :class:`CoordinatorError`, itself a
:class:`turnpoint.errors.TurnpointError`, and carries a :class:`~turnpoint.errors.Reason`
(docs/spec.md section 9): ``except CoordinatorError`` catches them all, and a caller
branches on ``error.reason`` or ``error.transient``, never on the message.

Pure: no grpc, no asyncio.
"""

from __future__ import annotations

from collections.abc import Mapping

from turnpoint.errors import Reason, TurnpointError


class CoordinatorError(TurnpointError):
    """Root of every error the coordinator library raises."""

    def __init__(
        self, reason: Reason, message: str, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(reason, message, metadata)
