"""How many times a job may restore onto fresh participants before it gives up.

A lost participant (its process died or stopped answering) costs the rollouts since the
last published snapshot, not the run: the job restarts every participant fresh and
restores (docs/spec.md section 7.11). A job that keeps losing participants must still
end, with a clear reason, instead of looping: :class:`RestartBudget` allows
``max_restarts`` restarts within a sliding ``window_s``, with a growing pause between
them so that a crash loop does not spin.

Pure: no asyncio, no clock (``now`` is an argument).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartDecision:
    """Whether to restart now, after how long a pause, and why (for the log)."""

    allowed: bool
    pause_s: float
    reason: str


class RestartBudget:
    def __init__(
        self,
        max_restarts: int,
        window_s: float,
        *,
        first_pause_s: float = 0.5,
        max_pause_s: float = 30.0,
    ) -> None:
        if max_restarts < 0 or window_s <= 0:
            raise ValueError("max_restarts must be >= 0 and window_s > 0")
        self._max = max_restarts
        self._window_s = window_s
        self._first_pause_s = first_pause_s
        self._max_pause_s = max_pause_s
        self._restarts: deque[float] = deque()

    @property
    def used(self) -> int:
        return len(self._restarts)

    def decide(self, now: float, cause: str) -> RestartDecision:
        """Record a restart at ``now`` if the budget allows one; say why either way."""
        while self._restarts and now - self._restarts[0] >= self._window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self._max:
            return RestartDecision(
                False,
                0.0,
                f"{cause}: {len(self._restarts)} restart(s) in the last {self._window_s:g}s "
                f"already, the most allowed (max_restarts={self._max}); the run ends",
            )
        pause = min(self._max_pause_s, self._first_pause_s * 2 ** len(self._restarts))
        self._restarts.append(now)
        return RestartDecision(
            True,
            pause,
            f"{cause}: restart {len(self._restarts)} of at most {self._max} in "
            f"{self._window_s:g}s, after {pause:g}s",
        )
