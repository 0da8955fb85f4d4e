"""Which published snapshot a restore tries first: latest, a named one, or the best by a
metric the trainer recorded (docs/spec.md section 7.14). Pure: values in, order out.

A trainer records metrics in each snapshot's manifest (``extra["metrics"]``, a mapping
of name to number, from ``Checkpointing(snapshot_metrics=...)``). :class:`RestoreChoice`
is what ``CoordinatorConfig.restore_from`` says: ``"latest"``, ``"snapshot:<id>"`` or
``"best:<metric>"`` (highest wins) / ``"best:-<metric>"`` (lowest wins).
:func:`rank_candidates` orders the published snapshots the way a restore tries them;
the first that passes every check is restored (a broken one is skipped with its reason,
as for the latest).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from turnpoint.errors import Reason
from turnpoint.ids import InvalidIdError, validate_id
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.storage.manifest import JSONValue

METRICS_KEY: Final = "metrics"
"""The key of the manifest's ``extra`` under which a trainer's metrics are recorded."""

_METRIC_NAME_MAX: Final = 64


class RestoreChoiceError(CoordinatorError):
    """A restore choice that cannot be parsed (a configuration or request error)."""

    def __init__(self, text: str, why: str) -> None:
        self.text = text
        self.why = why
        super().__init__(
            Reason.INVALID_ARGUMENT, f"restore choice {text!r}: {why}", {"restore_from": text}
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.text, self.why))


@dataclass(frozen=True, slots=True)
class RestoreChoice:
    """How to pick the snapshot a restore uses."""

    kind: Literal["latest", "snapshot", "best"] = "latest"
    snapshot: str | None = None
    metric: str | None = None
    lowest: bool = False

    @classmethod
    def parse(cls, text: str) -> RestoreChoice:
        if text == "latest":
            return cls()
        kind, sep, rest = text.partition(":")
        if sep and kind == "snapshot":
            try:
                validate_id(rest, "snapshot")
            except InvalidIdError as error:
                raise RestoreChoiceError(text, str(error)) from None
            return cls("snapshot", snapshot=rest)
        if sep and kind == "best":
            lowest = rest.startswith("-")
            name = rest[1:] if lowest else rest
            if (
                not name
                or len(name) > _METRIC_NAME_MAX
                or not all(c.isalnum() or c in "_.-" for c in name)
            ):
                raise RestoreChoiceError(
                    text,
                    f"the metric must be 1-{_METRIC_NAME_MAX} letters, digits, '_', '.' or '-'",
                )
            return cls("best", metric=name, lowest=lowest)
        raise RestoreChoiceError(
            text, "use 'latest', 'snapshot:<id>', 'best:<metric>' or 'best:-<metric>'"
        )

    def __str__(self) -> str:
        if self.kind == "snapshot":
            return f"snapshot:{self.snapshot}"
        if self.kind == "best":
            return f"best:{'-' if self.lowest else ''}{self.metric}"
        return "latest"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One published snapshot as a restore candidate (newest first in a listing)."""

    checkpoint_id: str
    step: int
    created_at: float
    metrics: Mapping[str, float]


def metrics_of(extra: Mapping[str, JSONValue]) -> dict[str, float]:
    """The finite numeric metrics a manifest's ``extra`` records (others are ignored)."""
    raw = extra.get(METRICS_KEY)
    if not isinstance(raw, Mapping):
        return {}
    return {
        str(name): float(value)
        for name, value in raw.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    }


def rank_candidates(choice: RestoreChoice, candidates: Iterable[Candidate]) -> list[Candidate]:
    """The order a restore tries ``candidates`` (given newest first).

    ``latest``: as given. ``snapshot``: that one only (none if it is not published).
    ``best``: the ones that recorded the metric, best first (ties: newest first), then
    none of the others: a restore by a metric never silently falls back to a snapshot
    that lacks it.
    """
    listed: Sequence[Candidate] = list(candidates)
    if choice.kind == "latest":
        return list(listed)
    if choice.kind == "snapshot":
        return [c for c in listed if c.checkpoint_id == choice.snapshot]
    metric = choice.metric or ""
    scored = [(index, c) for index, c in enumerate(listed) if metric in c.metrics]
    sign = 1.0 if choice.lowest else -1.0
    scored.sort(key=lambda pair: (sign * pair[1].metrics[metric], pair[0]))
    return [c for _, c in scored]
