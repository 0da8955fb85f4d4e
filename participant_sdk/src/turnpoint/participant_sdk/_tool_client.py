"""What an agent's tool calls go through: a connection to one resources server.

``ctx.call`` / ``ctx.verify`` / ``ctx.seed`` (:class:`~._agent.EpisodeContext`) take a
:class:`ResourcesConnection`: ``turnpoint.server.ResourcesClient`` over gRPC, or
anything else that forwards the request id (an in-process runtime in a test). The
connection does the wire: auth, the value conversions (ints stay ints), the rollout id
and attempt on every request. The context does the protocol: the call's key
(docs/spec.md section 6.12), the parked shape of a call after a boundary (section 5.2
item 4) and the bounded retries of a transient fault, with the same key.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId

from ._resources import Verdict

# A tool call that failed below the tool (the connection, a deadline, a server not
# ready) is tried again, with the same key, this often; backing off from the first
# delay, doubling, up to the last.
TOOL_RETRIES = 3
TOOL_RETRY_FIRST_DELAY_S = 0.2
TOOL_RETRY_MAX_DELAY_S = 2.0
# Reasons a tool call is retried on: its reply may have been lost, and the key makes
# the retry safe. A tool that raised (HOOK_FAILED) is not: it would raise again.
RETRIED_REASONS = frozenset(
    {Reason.UNAVAILABLE, Reason.DEADLINE_EXCEEDED, Reason.NOT_READY, Reason.STORAGE_UNAVAILABLE}
)


T = TypeVar("T")
logger = logging.getLogger("turnpoint.participant_sdk")


async def retried(
    factory: Callable[[], Awaitable[T]],
    *,
    unreachable_wait_s: float,
    retries: int = TOOL_RETRIES,
    reasons: frozenset[Reason] = RETRIED_REASONS,
    what: str = "a call",
) -> T:
    """``factory()``, re-issued on a transient fault: on any of ``reasons`` at most
    ``retries`` times, and on ``UNAVAILABLE`` (the server unreachable) for as long as
    ``unreachable_wait_s`` from its first failure, backing off from the first delay,
    doubling, up to the last. A lost server is replaced where it was (docs/spec.md
    section 7.15): the episode waits for it instead of failing."""
    loop = asyncio.get_running_loop()
    delay = TOOL_RETRY_FIRST_DELAY_S
    first_failure: float | None = None
    for retry in itertools.count():
        try:
            return await factory()
        except TurnpointError as error:
            now = loop.time()
            if first_failure is None:
                first_failure = now
            waiting = error.reason is Reason.UNAVAILABLE and now - first_failure < (
                unreachable_wait_s
            )
            if error.reason not in reasons or (retry >= retries and not waiting):
                raise
            logger.debug("%s retried: %s", what, error.reason)
        await asyncio.sleep(delay)  # a backoff, not a synchronisation
        delay = min(delay * 2, TOOL_RETRY_MAX_DELAY_S)
    raise AssertionError("unreachable")


class ResourcesConnection(Protocol):
    """A client of one resources server, as ``ctx.call`` and ``ctx.verify`` use it.

    Each method raises :class:`turnpoint.errors.TurnpointError` (its ``reason`` typed)
    on failure; a call refused for its key raises
    :class:`~._effects.EffectConflictError`.
    """

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> bool:
        """Create the episode's session; True when it already existed."""
        ...

    async def call(
        self,
        episode: EpisodeId,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        request_id: str,
    ) -> Mapping[str, Any]:
        """Run one tool call, keyed by ``request_id``."""
        ...

    async def verify(
        self, episode: EpisodeId, answer: Mapping[str, Any], *, request_id: str
    ) -> Verdict:
        """Score the final answer, keyed by ``request_id``."""
        ...
