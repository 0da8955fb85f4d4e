"""What the rollout ledger speaks: attempts, receipts, results, and its decisions.

docs/spec.md sections 6.10 and 7.6. Pure values: no grpc, no asyncio, no clock.
:class:`Attempt` is one attempt of a rollout as the
:class:`~turnpoint.trainer.rollouts.ledger.RolloutLedger` tracks it (the ledger alone changes
it); :class:`NextCall` and :class:`Resolution` are the ledger's decisions, each with its
reason.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from turnpoint.ids import EpisodeId
from turnpoint.trainer.rollouts.side import InFlightRollout
from turnpoint.trainer.rollouts.values import (
    Rollout,
    RolloutOutcome,
    RolloutResult,
    saved_rollout_json,
)

# (global reopen count, the instance's own reopen count) when a Run was sent.
GateGeneration = tuple[int, int]


class AttemptPhase(enum.Enum):
    PENDING = "pending"  # waiting for a slot or the gate: owned by nobody
    CALLING = "calling"  # Run sent, no verdict yet: owned by nobody as far as we know
    OWNED = "owned"  # accepted (or installed by a restore): part of the cut
    ENDED = "ended"


@dataclass(eq=False, slots=True)
class Attempt:
    """One attempt of a rollout. Compared by identity (a rerun is another object even
    where an episode repeats); only the ledger changes it, the driver reads it."""

    spec: Rollout
    episode: EpisodeId
    instance: str
    budget_s: float | None
    boundaries_seen: int = 0
    phase: AttemptPhase = AttemptPhase.PENDING
    # Installed by a restore: owned before its Run is sent, so it may pass a closed gate.
    restored: bool = False
    # Some Run of this attempt was accepted, so the participant held it at some point.
    accepted_once: bool = False
    # The participant incarnation that last accepted a Run of it ("" while none said):
    # every re-attach names it, so a process restarted at the same address refuses
    # instead of starting the attempt a second time (docs/spec.md section 6.5 item 5).
    incarnation: str = ""
    # A Run of it was refused by another incarnation: the execution died with the
    # process that accepted it, so no Run of it is sent again; it waits, as for an
    # unreachable participant, for the heal or its abandonment (section 6.10 item 3).
    lost: bool = False
    # Attempts of this rollout started by this client, this one included.
    spent: int = 1
    # Consecutive broken calls without progress.
    broken: int = 0
    # Set while a prepare waits for this attempt's result: a pause before resending
    # should end now (resolve_unacknowledged).
    hurry: bool = False
    # Reused by every Run of this attempt, so that a re-attach is recognised (section 6.5).
    # Drawn by the ledger's request-id source: unique across trainer incarnations.
    request_id: str = field(kw_only=True)

    def result(
        self,
        outcome: RolloutOutcome,
        *,
        output: Mapping[str, Any] | None = None,
        turns: int | None = None,
        active_time_s: float = 0.0,
        error_message: str = "",
        receipt_id: str = "",
    ) -> RolloutResult:
        """How this attempt ended, as the results queue records it; ``receipt_id`` is
        empty when nothing is owed (given up, abandoned)."""
        spec = self.spec
        return RolloutResult(
            episode=self.episode,
            instance=self.instance,
            prompt_group_id=spec.prompt_group_id,
            sibling_index=spec.sibling_index,
            group_size=spec.group_size,
            environment=spec.environment,
            outcome=outcome,
            output=dict(output or {}),
            task=spec.task,
            turns=self.boundaries_seen if turns is None else turns,
            boundaries=self.boundaries_seen,
            active_time_s=active_time_s,
            error_message=error_message,
            receipt_id=receipt_id,
        )

    def saved_json(self) -> dict[str, Any]:
        """``SavedRollout(self.describe(), budget_s, owned).to_json()`` with the task not
        copied yet (the ledger copies a cut's tasks together), without the two objects."""
        spec = self.spec
        return saved_rollout_json(
            self.episode,
            self.instance,
            spec.prompt_group_id,
            spec.sibling_index,
            spec.group_size,
            spec.environment,
            self.boundaries_seen,
            spec.task,
            self.budget_s,
            self.phase is AttemptPhase.OWNED,
        )

    def describe(self) -> InFlightRollout:
        spec = self.spec
        return InFlightRollout(
            episode=self.episode,
            instance=self.instance,
            prompt_group_id=spec.prompt_group_id,
            sibling_index=spec.sibling_index,
            group_size=spec.group_size,
            environment=spec.environment,
            boundaries_seen=self.boundaries_seen,
            task=spec.task,
        )


@dataclass(frozen=True, slots=True)
class Receipt:
    """A completion to acknowledge: on ``instance``, for ``episode``."""

    instance: str
    episode: EpisodeId
    receipt_id: str


@dataclass(frozen=True, slots=True)
class FinalResult:
    """A final ``RunResult`` as the wire reader parsed it (docs/spec.md section 6.3)."""

    outcome: RolloutOutcome
    receipt_id: str
    output: Mapping[str, Any]
    turns: int
    active_time_s: float
    error_message: str = ""


@dataclass(frozen=True, slots=True)
class NextCall:
    """What the driver does after a Run call ended without a result.

    ``again`` False: the attempt ended (abandoned, its rerun queued if attempts remain);
    stop following it. Otherwise send the Run again, after waiting up to ``pause_s``
    (None: no pause, the gate alone decides), a wait cut short by the attempt's
    ``hurry`` and, when ``until_moved`` is set, by a gate generation other than it.
    """

    again: bool
    reason: str
    pause_s: float | None = None
    until_moved: GateGeneration | None = None


class Resolve(enum.Enum):
    ACKNOWLEDGE = "acknowledge"  # the result is recorded: acknowledge the receipt
    WAIT = "wait"  # the owned live attempt may still deliver it: wait, then ask again
    RETIRE = "retire"  # nobody wants it: the attempt is queued for Retire


@dataclass(frozen=True, slots=True)
class Resolution:
    """The decision on a completion a prepare reported unacknowledged (section 6.7 item 3).

    ``receipt``: what to acknowledge (ACKNOWLEDGE). ``attempt``: the live attempt to
    wait for (WAIT), or the one abandoned because it never delivered (RETIRE), whose Run
    the driver stops.
    """

    action: Resolve
    reason: str
    receipt: Receipt | None = None
    attempt: Attempt | None = None


@dataclass(slots=True)
class RolloutStats:
    """Counters of what the client did; the ledger hands out copies."""

    dispatched: int = 0
    accepted: int = 0
    admission_refusals: int = 0
    reattaches: int = 0
    # Re-attaches refused by another incarnation of their participant (section 6.5 item 5).
    lost: int = 0
    abandoned: int = 0
    reruns: int = 0
    groups_retried_whole: int = 0
    given_up: int = 0
    results: int = 0
    acknowledged: int = 0
    ack_failures: int = 0
