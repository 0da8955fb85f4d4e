"""The contract between the snapshot driver and the trainer's rollout side.

The snapshot driver (``_snapshots.py``) runs docs/spec.md section 7.4's steps; the rollout
client (``_rollouts.py``) owns dispatch, deadlines, results and acknowledgements. The
driver only ever talks to the rollout side through :class:`RolloutSide`, so either can
be tested against a small fake of the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from turnpoint.ids import EpisodeId
from turnpoint.trainer.rollouts.deadlines import Hold
from turnpoint.trainer.storage.manifest import RolloutBooks, TrainerRolloutState

UnackedDecision = Literal["acknowledge", "retire"]


@dataclass(frozen=True, slots=True)
class InFlightRollout:
    """An attempt a participant accepted and has not finished (part of the cut)."""

    episode: EpisodeId
    instance: str  # the agent instance that accepted its Run
    prompt_group_id: str
    sibling_index: int
    group_size: int
    environment: str
    boundaries_seen: int
    task: Mapping[str, Any] = field(default_factory=dict)


class RolloutSide(Protocol):
    """What the snapshot driver needs from the trainer's rollout client."""

    @property
    def version(self) -> int:
        """Bumped on every change the cut would see; equal versions mean nothing changed."""
        ...

    def close_dispatch(self) -> None:
        """Stop starting new Runs; Runs not yet accepted wait at the gate (not in the cut)."""
        ...

    def reopen_dispatch(self) -> None: ...

    def close_dispatch_to(self, instance: str) -> None:
        """Stop starting new Runs on one agent instance, whatever the global gate says.

        The snapshot driver calls it when a snapshot was published but the release
        (resume) of that instance failed: the participant is still closed until the pump
        releases it on its next tick (or its lease reopens it), so Runs sent there would
        only be refused. Idempotent.
        """
        ...

    def reopen_dispatch_to(self, instance: str) -> None:
        """Undo :meth:`close_dispatch_to` once the instance was released. Idempotent."""
        ...

    def hold_deadlines(self, name: str) -> Hold:
        """Suspend every rollout budget until the hold is released (holders counted)."""
        ...

    def release_deadlines(self, hold: Hold) -> None: ...

    async def drain_acknowledgements(self, timeout_s: float) -> None:
        """Return once every result already received is recorded and acknowledged."""
        ...

    def in_flight(self) -> Sequence[InFlightRollout]:
        """Accepted, unfinished attempts, per the attempt ledger."""
        ...

    def rollout_state(self) -> TrainerRolloutState:
        """Queue of finished rollouts not yet trained on, loader position, attempt ledger."""
        ...

    def rollout_books(self) -> RolloutBooks:
        """The parts of :meth:`rollout_state` as they are now, copied and not checked
        yet (a cut reads these while dispatch is closed and checks them after)."""
        ...

    async def resolve_unacknowledged(
        self, instance: str, episode: EpisodeId, receipt_id: str
    ) -> UnackedDecision:
        """A prepare reported a completion nobody acknowledged (its Run's cancellation was
        lost, docs/spec.md section 6.7): acknowledge it if the result is still wanted
        (recording it first), else say it must be retired."""
        ...

    def pending_retires(self) -> Mapping[str, Sequence[EpisodeId]]:
        """Abandoned attempts per instance, to retire while participants are idle."""
        ...

    def retired(self, instance: str, episodes: Sequence[EpisodeId]) -> None: ...

    def pending_session_retires(self) -> Sequence[EpisodeId]:
        """Acknowledged attempts whose verified sessions the resources servers keep
        (docs/spec.md section 5.3 item 3), to retire there only."""
        ...

    def sessions_retired(self, episodes: Sequence[EpisodeId]) -> None: ...
