"""The heal-in-place figure's arithmetic: turns recomputed and the two ways compared.

``turnpoint bench-heal`` (:mod:`._heal_bench`) SIGKILLs one agent of a running fleet
twice, on the same workload: once healed in place (docs/spec.md section 7.15), once by
the job restart of section 7.11 item 2. Each way yields a :class:`RecoveryFigures`;
:class:`HealFigure` holds both and their ratios (heal over restart: below 1 is better).

A turn is recomputed when it was sealed before the recovery and is sealed again after
it: an episode cut back to the snapshot redoes every turn from its resumed boundary to
the one it had reached; one rerun from its prompt redoes all of them; one that kept
running redoes none. Pure: no clock, no loop, no wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

TURNS_RATIO_MUST: Final = 0.1
"""Turns recomputed healed over restarted must stay below this: a heal cuts back only
what depended on the lost participant (1/64 of the fleet's episodes at the default
size), a restart everything. Counts, not times: ``--check`` holds it."""
REGRESSION_MARGIN: Final = 1.5
"""The bench's margin (``turnpoint bench --check``): past the must-have by this factor."""

Way = Literal["heal", "restart"]
WAYS: Final[tuple[Way, ...]] = ("heal", "restart")


def turns_recomputed(reached: Mapping[str, int], resumed_from: Mapping[str, int]) -> int:
    """Turns sealed again: over every episode cut back (a key of ``resumed_from``, the
    boundary it continues from, 0 for a rerun from its prompt), the boundaries it had
    reached (``reached``, when the recovery stopped it) above that one. An episode
    that reached no further than where it resumes redoes nothing; one absent from
    ``reached`` had sealed nothing this bench saw."""
    for name, values in (("reached", reached), ("resumed_from", resumed_from)):
        bad = sorted(rid for rid, n in values.items() if isinstance(n, bool) or n < 0)
        if bad:
            raise ValueError(f"{name} holds negative or non-integer boundaries for {bad}")
    return sum(max(0, reached.get(rid, 0) - start) for rid, start in resumed_from.items())


def _ratio(part: float, whole: float) -> float | None:
    return None if whole <= 0 else part / whole


@dataclass(frozen=True, slots=True)
class RecoveryFigures:
    """One way of recovering from the SIGKILL of one participant.

    ``episodes_cut_back``: episodes that went back to the snapshot (continued from it
    or rerun from their prompts); ``turns_recomputed`` their turns sealed again (see
    :func:`turns_recomputed`); ``time_to_whole_s``: from the SIGKILL until every
    participant serves again and every episode cut back runs again, accepted by its
    agent as its new attempt (the detection of the loss included, the same bound both
    ways); ``detected_s``: from
    the SIGKILL until the trainer acted on the loss (the heal asked its launcher for a
    replacement; the restart's trainer gave the run up), so that
    :attr:`recovery_s` is what the two ways do differently; ``processes_started``:
    participant processes started to recover.
    """

    way: Way
    episodes_in_flight: int
    episodes_cut_back: int
    turns_recomputed: int
    time_to_whole_s: float
    processes_started: int
    checkpoint_id: str = ""
    detected_s: float = 0.0

    def __post_init__(self) -> None:
        if self.way not in WAYS:
            raise ValueError(f"way must be one of {WAYS}, got {self.way!r}")
        counts = (
            self.episodes_in_flight,
            self.episodes_cut_back,
            self.turns_recomputed,
            self.processes_started,
        )
        if any(n < 0 for n in counts) or not self.time_to_whole_s >= 0:
            raise ValueError("counts and times must be >= 0")
        if not 0 <= self.detected_s <= self.time_to_whole_s:
            raise ValueError(
                f"detected after {self.detected_s} s, not within the {self.time_to_whole_s} s "
                "to whole"
            )
        if self.episodes_cut_back > self.episodes_in_flight:
            raise ValueError(
                f"{self.episodes_cut_back} episodes cut back of {self.episodes_in_flight} in flight"
            )

    @property
    def recovery_s(self) -> float:
        """From the loss found until the fleet is whole."""
        return self.time_to_whole_s - self.detected_s

    def to_json(self) -> dict[str, Any]:
        return {
            "episodes_in_flight": self.episodes_in_flight,
            "episodes_cut_back": self.episodes_cut_back,
            "turns_recomputed": self.turns_recomputed,
            "time_to_whole_s": round(self.time_to_whole_s, 3),
            "detected_s": round(self.detected_s, 3),
            "recovery_s": round(self.recovery_s, 3),
            "processes_started": self.processes_started,
            "checkpoint_id": self.checkpoint_id,
        }


@dataclass(frozen=True, slots=True)
class HealFigure:
    """Heal in place against the job restart, same fleet size, same workload, one run."""

    participants: int
    episodes: int
    heal: RecoveryFigures
    restart: RecoveryFigures
    turn_delay_s: float = 0.0
    lost_after_s: float = 0.0
    # The machine's 1-minute load average when the run began (None: unknown).
    load_average_1m: float | None = None

    def __post_init__(self) -> None:
        if (self.heal.way, self.restart.way) != WAYS:
            raise ValueError("a heal figure holds a heal and a restart, in that order")

    @property
    def turns_ratio(self) -> float | None:
        """Turns recomputed healed over restarted (None when the restart redid none)."""
        return _ratio(self.heal.turns_recomputed, self.restart.turns_recomputed)

    @property
    def time_ratio(self) -> float | None:
        """Time until the fleet is whole, healed over restarted."""
        return _ratio(self.heal.time_to_whole_s, self.restart.time_to_whole_s)

    @property
    def recovery_ratio(self) -> float | None:
        """From the loss found until whole, healed over restarted."""
        return _ratio(self.heal.recovery_s, self.restart.recovery_s)

    @property
    def regressed(self) -> bool:
        """The turns ratio is past :data:`TURNS_RATIO_MUST` by the margin, or missing."""
        turns = self.turns_ratio
        return turns is None or turns > TURNS_RATIO_MUST * REGRESSION_MARGIN

    def to_json(self) -> dict[str, Any]:
        turns, time, recovery = self.turns_ratio, self.time_ratio, self.recovery_ratio
        return {
            "participants": self.participants,
            "episodes": self.episodes,
            "turns_recomputed_heal_vs_restart": None if turns is None else round(turns, 4),
            "time_to_whole_heal_vs_restart": None if time is None else round(time, 3),
            "recovery_heal_vs_restart": None if recovery is None else round(recovery, 3),
            "heal": self.heal.to_json(),
            "restart": self.restart.to_json(),
            "turn_delay_s": self.turn_delay_s,
            "lost_after_s": self.lost_after_s,
            "load_average_1m": self.load_average_1m,
            "turns_ratio_must": TURNS_RATIO_MUST,
            "regressed": self.regressed,
        }

    def lines(self) -> list[str]:
        """The figure as a few lines of text (what ``turnpoint bench-heal`` prints)."""
        turns, time, recovery = self.turns_ratio, self.time_ratio, self.recovery_ratio
        rows = [
            f"Heal in place vs job restart: one agent SIGKILLed, {self.participants} "
            f"participants, {self.episodes} episodes in flight (a turn every "
            f"{self.turn_delay_s:g} s, lost after {self.lost_after_s:g} s of silence, load "
            + ("n/a" if self.load_average_1m is None else f"{self.load_average_1m:.2f}")
            + ")",
            f"{'':>8} {'cut back':>9} {'turns redone':>13} {'to whole s':>11} "
            f"{'found s':>8} {'then s':>7} {'started':>8}",
        ]
        for side in (self.heal, self.restart):
            rows.append(
                f"{side.way:>8} {side.episodes_cut_back:>9} {side.turns_recomputed:>13} "
                f"{side.time_to_whole_s:>11.3f} {side.detected_s:>8.3f} "
                f"{side.recovery_s:>7.3f} {side.processes_started:>8}"
            )
        rows.append(
            "heal / restart: turns recomputed "
            + ("n/a" if turns is None else f"{turns:.4f}")
            + ", time to whole "
            + ("n/a" if time is None else f"{time:.3f}")
            + ", from the loss found to whole "
            + ("n/a" if recovery is None else f"{recovery:.3f}")
        )
        return rows
