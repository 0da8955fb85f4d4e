"""Which retired rollouts may be forgotten (docs/spec.md section 7.6 item 6).

A Retire leaves a refusal mark on the participant so that late calls of the retired
attempt are refused; Forget drops the mark once nothing of that rollout can still
arrive. :class:`RefusalMarks` keeps the marks this coordinator raised (per instance,
with the sequence of the snapshot attempt whose retire raised it last) and decides which
are settled: every retained snapshot was cut after the retire, and neither those
snapshots nor the trainer's own books name the rollout. :class:`RetainedNames` reads,
once per published snapshot, the rollout ids it names.

:class:`RefusalMarks` is pure; :meth:`RetainedNames.read` blocks (it reads manifests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from turnpoint.ids import EpisodeId, checkpoint_sequence
from turnpoint.trainer.storage.manifest import (
    RolloutBooks,
    SnapshotManifest,
    TrainerRolloutState,
)


def rollouts_named(state: TrainerRolloutState | RolloutBooks) -> frozenset[str]:
    """Every rollout a trainer rollout state (or the books it is made of) names: queued,
    unfinished, or in its ledger."""
    named = set(state.attempts)
    for item in (*state.queue, *state.in_flight):
        rollout_id = item.get("rollout_id")
        if isinstance(rollout_id, str):
            named.add(rollout_id)
    return frozenset(named)


class _Layout(Protocol):
    def list_published(self) -> list[str]: ...

    def manifest_bytes(self, checkpoint_id: str) -> bytes: ...


class RefusalMarks:
    """The refusal marks one coordinator raised, and which of them are settled."""

    def __init__(self) -> None:
        # instance -> rollout id -> sequence of the attempt whose retire raised it last
        self._marks: dict[str, dict[str, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._marks)

    def view(self) -> Mapping[str, frozenset[str]]:
        return MappingProxyType({i: frozenset(m) for i, m in self._marks.items()})

    def retired(
        self,
        succeeded: Iterable[str],
        episodes: Mapping[str, Sequence[EpisodeId]],
        sequence: int,
    ) -> None:
        """A retire during the attempt of ``sequence`` succeeded on ``succeeded``."""
        for instance in succeeded:
            marks = self._marks.setdefault(instance, {})
            for episode in episodes.get(instance, ()):
                marks[episode.rollout_id] = max(sequence, marks.get(episode.rollout_id, 0))

    def settled(
        self, oldest_retained: int, named: Iterable[str], closed: Iterable[str]
    ) -> dict[str, tuple[str, ...]]:
        """Per idle instance, the marks that may be forgotten now."""
        named = set(named)
        closed = set(closed)
        chosen = {
            instance: tuple(
                sorted(
                    rollout_id
                    for rollout_id, retired_at in marks.items()
                    if retired_at <= oldest_retained and rollout_id not in named
                )
            )
            for instance, marks in self._marks.items()
            if instance not in closed
        }
        return {instance: ids for instance, ids in chosen.items() if ids}

    def forgotten(self, succeeded: Iterable[str], chosen: Mapping[str, Sequence[str]]) -> None:
        for instance in succeeded:
            marks = self._marks.get(instance, {})
            for rollout_id in chosen.get(instance, ()):
                marks.pop(rollout_id, None)
            if not marks:
                self._marks.pop(instance, None)


class RetainedNames:
    """The rollout ids each published snapshot names, read once per snapshot."""

    def __init__(self) -> None:
        self._named: dict[str, frozenset[str]] = {}

    def remember(self, checkpoint_id: str, state: TrainerRolloutState) -> None:
        self._named[checkpoint_id] = rollouts_named(state)

    def read(self, layout: _Layout) -> tuple[frozenset[str], int | None]:
        """Blocking: the ids every published snapshot names, and the sequence of the
        oldest one (None when nothing is published)."""
        published = layout.list_published()
        for gone in set(self._named) - set(published):
            del self._named[gone]
        named: set[str] = set()
        for checkpoint_id in published:
            ids = self._named.get(checkpoint_id)
            if ids is None:
                data = layout.manifest_bytes(checkpoint_id)
                ids = rollouts_named(SnapshotManifest.from_json(data).rollout_state)
                self._named[checkpoint_id] = ids
            named.update(ids)
        oldest = min(map(checkpoint_sequence, published)) if published else None
        return frozenset(named), oldest
