"""The participant guide's resources server: a counter tool (docs/participant.md).

Sessions are EXPORTED (docs/spec.md section 5.3 item 1) and keep the total before every
turn, so a tool call that names its turn gets the same reply again after a restore
(section 5.2 item 8). ``backend_up = False`` fails exports as a flaky backend does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    ParticipantError,
    RecoveryMode,
    ResourcesServer,
    TransientError,
    Verdict,
)

Fields = Mapping[str, Any]  # a task, tool arguments, an answer or a session: plain JSON


class CounterTools(ResourcesServer):
    recovery_mode: ClassVar[RecoveryMode] = RecoveryMode.EXPORTED
    environment: ClassVar[str] = "counter"

    def __init__(self) -> None:
        self.sessions: dict[EpisodeId, dict[str, Any]] = {}
        self.backend_up = True  # while False, exports fail transiently

    async def seed(self, episode: EpisodeId, task: Fields) -> None:
        target = _integer(task.get("target"), "target")
        # Idempotent: a retried seed keeps the session it made.
        self.sessions.setdefault(episode, {"target": target, "totals": [0]})

    def _session(self, episode: EpisodeId) -> dict[str, Any]:
        if episode not in self.sessions:
            raise ParticipantError(Reason.NOT_FOUND, f"no session for {episode}")
        return self.sessions[episode]

    async def call(self, episode: EpisodeId, tool: str, arguments: Fields) -> Fields:
        session = self._session(episode)
        if tool != "add":
            raise ParticipantError(Reason.INVALID_ARGUMENT, f"no tool {tool!r}")
        turn, step = _integer(arguments.get("turn"), "turn"), _integer(arguments.get("add"), "add")
        if not 0 <= turn < len(session["totals"]):
            raise ParticipantError(Reason.INVALID_ARGUMENT, f"turn {turn} is not yet reached")
        # Answer from the session as it was before this turn: a replay gets the same reply.
        session["totals"] = [*session["totals"][: turn + 1], session["totals"][turn] + step]
        return {"total": session["totals"][-1]}

    async def verify(self, episode: EpisodeId, answer: Fields) -> Verdict:
        session = self._session(episode)
        return Verdict(1.0 if _integer(answer.get("total"), "total") == session["target"] else 0.0)

    async def close(self, episode: EpisodeId) -> None:
        self.sessions.pop(episode, None)

    async def export_sessions(self, episodes: Sequence[EpisodeId]) -> Mapping[EpisodeId, Fields]:
        if not self.backend_up:
            raise TransientError("session backend unavailable")  # retried, not fatal
        return {e: copy.deepcopy(self.sessions[e]) for e in episodes if e in self.sessions}

    def validate_session(self, episode: EpisodeId, state: Fields) -> None:
        # Everything restore_session relies on, types included: a truncated or damaged
        # state is refused here, before any session of the snapshot is installed.
        totals = state.get("totals")
        if set(state) != {"target", "totals"} or not isinstance(state["target"], int):
            raise ValueError("a counter session holds exactly an integer target and totals")
        if not isinstance(totals, list) or not totals or not all(type(t) is int for t in totals):
            raise ValueError("a counter session holds a non-empty list of integer totals")

    async def restore_session(self, saved: EpisodeId, episode: EpisodeId, state: Fields) -> None:
        self.sessions[episode] = copy.deepcopy(dict(state))

    async def retire_session(self, episode: EpisodeId) -> None:
        self.sessions.pop(episode, None)


def _integer(value: Any, field: str) -> int:
    """Struct numbers arrive as floats; input that does not fit is INVALID_ARGUMENT."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ParticipantError(Reason.INVALID_ARGUMENT, f"{field} must be an integer")
    return int(value)
