"""Recovery levels: how finely each environment's unfinished rollouts can continue.

docs/spec.md section 7: one setting, ``target_level`` (``token``, ``turn``, ``sibling``
or ``prompt_group``, finest to coarsest). Each environment gets the finest level at or
below the target that everything it depends on supports, derived from ``Describe``;
``token`` also needs every policy model that serves no one environment in particular to
cut generations (docs/spec.md section 5.5).
The decision is data: it carries the reasons it was lowered, so the coordinator can log
one warning per lowered environment and tests can assert on the reasons.

Pure: no grpc, no asyncio, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from turnpoint.protocol import RecoveryLevel


@dataclass(frozen=True, slots=True)
class EnvironmentMember:
    """What ``Describe`` said about one participant an environment's rollouts use."""

    instance: str
    kind: str  # "agent", "resources", "model", "environment"
    recovery_mode: str  # "stateless", "exported", "restart_only"
    supported_levels: frozenset[RecoveryLevel]
    group_scored: bool = False
    group_size: int = 0


@dataclass(frozen=True, slots=True)
class LevelDecision:
    """The effective level of one environment and why it differs from the target."""

    environment: str
    target: RecoveryLevel
    effective: RecoveryLevel
    reasons: tuple[str, ...]
    group_scored: bool

    @property
    def lowered(self) -> bool:
        return self.effective > self.target

    def warning(self) -> str:
        why = "; ".join(self.reasons)
        return (
            f"environment {self.environment!r}: recovery level lowered from "
            f"{self.target.label} to {self.effective.label} ({why})"
        )


def _coarsest_needed(member: EnvironmentMember) -> tuple[RecoveryLevel, str | None]:
    if member.recovery_mode == "restart_only":
        # Its sessions start over, so a saved turn that depends on them cannot continue.
        return RecoveryLevel.SIBLING, f"{member.instance} is restart-only"
    levels = member.supported_levels
    if levels and RecoveryLevel.TURN not in levels and RecoveryLevel.TOKEN not in levels:
        finest = min(levels)
        return finest, f"{member.instance} supports {finest.label} at the finest"
    if RecoveryLevel.TOKEN not in levels:
        # Only a participant that says so cuts (a model) or records cuts (an agent).
        return RecoveryLevel.TURN, f"{member.instance} cannot cut generations"
    return RecoveryLevel.TOKEN, None


def decide_levels(
    target: RecoveryLevel,
    environments: Mapping[str, Iterable[EnvironmentMember]],
    models: Iterable[EnvironmentMember] = (),
) -> dict[str, LevelDecision]:
    """Each environment's effective level: the finest at or below ``target`` it supports.

    ``models`` are the policy models of no environment: any environment's agents may
    call them, so each counts for every environment (only ``token`` depends on them).
    """
    shared = tuple(models)
    decisions: dict[str, LevelDecision] = {}
    for environment, members in sorted(environments.items()):
        effective = target
        reasons: list[str] = []
        group_scored = False
        for member in sorted(members, key=lambda m: m.instance):
            group_scored = group_scored or member.group_scored
            needed, reason = _coarsest_needed(member)
            if needed > target and reason is not None:
                reasons.append(reason)
            effective = max(effective, needed)
        for model in sorted(shared, key=lambda m: m.instance):
            needed, reason = _coarsest_needed(model)
            needed = min(needed, RecoveryLevel.TURN)  # a model holds no turn to lose
            if needed > target and reason is not None:
                reasons.append(reason)
            effective = max(effective, needed)
        decisions[environment] = LevelDecision(
            environment=environment,
            target=target,
            effective=effective,
            reasons=tuple(reasons),
            group_scored=group_scored,
        )
    return decisions
