"""Environments broken in one way each, for the conformance kit's equivalence and
sandbox checks.

Each is a resources server whose restore is not exact; the kit must fail it and name
the first call that answers differently from an uninterrupted run, or the sandbox rule
it breaks. Two servers of one
mutant share what a real deployment would share (a database outside the process).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from turnpoint.apps.examples._blackjack import Hand
from turnpoint.apps.examples._coding import CodingTools
from turnpoint.apps.examples._environments import BlackjackTools, WorkplaceTools
from turnpoint.apps.examples.guide_resources import CounterTools
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import RecoveryMode, ResourcesServer, Verdict
from turnpoint.participant_sdk.sandboxes import SnapshotNotFoundError


class ReseededBlackjack(BlackjackTools):
    """Saves the seed and re-seeds on restore: the shoe deals its first cards again."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: dict[EpisodeId, int] = {}

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        await super().seed(episode, task)
        self.seeds[episode] = int(task["seed"])

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        states = await super().export_sessions(episodes)
        return {e: {**state, "seed": self.seeds[e]} for e, state in states.items()}

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        int(state["seed"])  # its own field too: a state cut short is refused, not half-installed
        super().validate_session(episode, {k: v for k, v in state.items() if k != "seed"})

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        await super().restore_session(saved, episode, state)
        hand = Hand.deal(state["seed"])  # a fresh shoe, then the saved cards on the table
        restored = self.tables[episode].hand
        hand.player, hand.dealer, hand.done = restored.player, restored.dealer, restored.done
        self.tables[episode].hand = hand
        self.seeds[episode] = state["seed"]


class BlobsAsTextWorkplace(WorkplaceTools):
    """A table codec that writes a blob as its ``str()``: the column's type is lost."""

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        def lossy(cell: Any) -> Any:
            if isinstance(cell, dict) and "blob" in cell:
                return {"text": str(bytes.fromhex(cell["blob"]))}
            return cell

        tables = {
            **state["tables"],
            "tables": [
                {**table, "rows": [[lossy(cell) for cell in row] for row in table["rows"]]}
                for table in state["tables"]["tables"]
            ],
        }
        await super().restore_session(saved, episode, {**state, "tables": tables})


class _ByRollout(dict[Any, Any]):
    """A store keyed by rollout id alone: every attempt of a rollout is one entry."""

    def __getitem__(self, key: EpisodeId) -> Any:
        return super().__getitem__(key.rollout_id)

    def __setitem__(self, key: EpisodeId, value: Any) -> None:
        super().__setitem__(key.rollout_id, value)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, EpisodeId) and super().__contains__(key.rollout_id)

    def get(self, key: EpisodeId, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(key.rollout_id, default)

    def pop(self, key: EpisodeId, default: Any = None) -> Any:  # type: ignore[override]
        return super().pop(key.rollout_id, default)

    def setdefault(self, key: EpisodeId, default: Any = None) -> Any:  # type: ignore[override]
        return super().setdefault(key.rollout_id, default)


class AttemptBlindBlackjack(BlackjackTools):
    """Keeps its tables in a store shared by every server, keyed by rollout id: the
    restore ignores the attempt number, so attempt N's late calls change attempt N+1."""

    def __init__(self, tables: _ByRollout) -> None:
        super().__init__()
        self.tables = tables


def attempt_blind_pair() -> tuple[AttemptBlindBlackjack, AttemptBlindBlackjack]:
    tables = _ByRollout()
    return AttemptBlindBlackjack(tables), AttemptBlindBlackjack(tables)


class HollowExport(ResourcesServer):
    """Issue 28 item 5: exported mode, but its export returns nothing, its restore does
    nothing and its verify returns a random reward."""

    recovery_mode = RecoveryMode.EXPORTED

    def __init__(self) -> None:
        self.sessions: set[EpisodeId] = set()

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        self.sessions.add(episode)

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        return {"ok": True}

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        return Verdict(random.random())

    async def close(self, episode: EpisodeId) -> None:
        self.sessions.discard(episode)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        return {}

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        return None

    async def retire_session(self, episode: EpisodeId) -> None:
        self.sessions.discard(episode)


class RestoresNothing(CounterTools):
    """Exports honestly, but its restore hook installs nothing."""

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        return None


class StartsOverCoding(CodingTools):
    """Restores a session whose snapshot is gone as a fresh sandbox of its task, instead
    of refusing it (docs/spec.md section 5.7.1 item 6): the episode silently loses
    everything it did before the cut."""

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        try:
            await super().restore_session(saved, episode, state)
        except SnapshotNotFoundError:
            await self.seed(episode, {"task": state["data"]["task"]})
