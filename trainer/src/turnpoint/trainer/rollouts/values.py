"""The rollout client's values and their strict JSON form.

docs/spec.md sections 6.10 and 8.7. Pure: no grpc, no asyncio, no clock.

- :class:`RolloutClientSettings` bounds every wait of the client and every decision of
  the ledger (re-attaches, attempts, budgets); defaults are docs/spec.md section 7.9's.
- :class:`Rollout` is what the training loop dispatches; :class:`RolloutResult` is a
  finished rollout in the results queue; :class:`SavedRollout` is an unfinished one as a
  snapshot records it.
- :class:`_Reader` reads one JSON object of the trainer rollout state strictly (every
  field, nothing else), so a snapshot that does not say exactly what the reference
  writes is refused rather than half understood (docs/spec.md section 8.7).
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Self

from turnpoint.ids import EpisodeId, InvalidIdError, validate_attempt, validate_id
from turnpoint.trainer.rollouts.side import InFlightRollout
from turnpoint.trainer.storage.manifest import JSONValue, ManifestError, TrainerRolloutState

# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutClientSettings:
    """Bounds of the rollout client; every wait it makes is bounded by one of these."""

    # Runs in progress at once (waiting at the gate, sent, or followed).
    max_concurrency: int = 64
    # How long a sent Run may go without the participant's verdict (accepted/refused).
    accept_timeout_s: float = 30.0
    # One Acknowledge call; tried ack_attempts times with the same request id.
    ack_timeout_s: float = 10.0
    ack_attempts: int = 3
    # Consecutive broken calls of one attempt, without progress, before it is abandoned.
    reattach_attempts: int = 3
    # Attempts of one rollout this client starts (reruns included) before it gives up.
    max_attempts: int = 3
    # Pause before the n-th re-attach: retry_backoff_s * 2**(n-1), at most the max.
    retry_backoff_s: float = 0.2
    max_retry_backoff_s: float = 2.0
    # Pause before resending a Run the participant refused while our own gate stayed
    # open (it closed on its own: another holder, a failed resume); never zero, so a
    # closed participant cannot make the client spin.
    admission_backoff_s: float = 0.5
    # How long resolve_unacknowledged waits for a live attempt to deliver its result.
    resolve_timeout_s: float = 5.0
    # The trainer gives up budget + grace after acceptance, so that the participant's
    # own budget (same length, also active time) normally ends the run first with a
    # proper BUDGET_EXHAUSTED result; the trainer's is the backstop.
    budget_grace_s: float = 5.0
    # Budget of rollouts that do not name one; None: no budget.
    default_budget_s: float | None = None
    # Sent on every Run: what the agent does with a generation that spans a weight
    # update (docs/spec.md section 5.5 item 7), the coordinator config's
    # ``weights_change``. None sends it unset: the agent's own setting applies.
    weights_change: Literal["keep", "rerun"] | None = None

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "ack_attempts", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.reattach_attempts, bool) or self.reattach_attempts < 0:
            raise ValueError(f"reattach_attempts must be >= 0, got {self.reattach_attempts!r}")
        for name in ("accept_timeout_s", "ack_timeout_s", "admission_backoff_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in (
            "retry_backoff_s",
            "max_retry_backoff_s",
            "resolve_timeout_s",
            "budget_grace_s",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        _check_budget(self.default_budget_s, "default_budget_s")
        if self.weights_change not in (None, "keep", "rerun"):
            raise ValueError(
                f"weights_change must be None, 'keep' or 'rerun', got {self.weights_change!r}"
            )


def _check_budget(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be None or a positive number of seconds, got {value!r}")
    return float(value)


def doubling_pause_s(initial_s: float, max_s: float, count: int) -> float:
    """The pause before the ``count``-th retry (1-based): ``initial_s`` doubling up to
    ``max_s``; a long run of failures stays at ``max_s`` (2.0**1100 is no float)."""
    exponent = max(0, count - 1)
    if exponent >= 64:
        return max_s
    return min(max_s, initial_s * 2.0**exponent)


def backoff_s(settings: RolloutClientSettings, failures: int) -> float:
    """The pause before the ``failures``-th retry: doubling from ``retry_backoff_s`` up to
    ``max_retry_backoff_s`` (docs/spec.md section 6.10 item 3)."""
    return doubling_pause_s(settings.retry_backoff_s, settings.max_retry_backoff_s, failures)


# --------------------------------------------------------------------------- values


# json.dumps builds an encoder per call when an option differs from its defaults.
_STRICT_ENCODER: Final = json.JSONEncoder(allow_nan=False)


def _plain_json(value: object, what: str) -> dict[str, Any]:
    """A deep copy of ``value`` as a plain JSON object (tuples become lists)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__}")
    try:
        copy = json.loads(_STRICT_ENCODER.encode(value if type(value) is dict else dict(value)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what} is not plain JSON: {error}") from None
    assert isinstance(copy, dict)
    return copy


@dataclass(frozen=True, slots=True)
class Rollout:
    """One rollout to run: a sibling of a prompt group, on one agent instance."""

    rollout_id: str
    prompt_group_id: str
    sibling_index: int
    group_size: int
    environment: str
    task: Mapping[str, Any]
    instance: str
    budget_s: float | None = None

    def __post_init__(self) -> None:
        validate_id(self.rollout_id, "rollout_id")
        validate_id(self.prompt_group_id, "prompt_group_id")
        validate_id(self.instance, "instance")
        if not isinstance(self.environment, str) or not self.environment:
            raise ValueError(f"environment must be a non-empty string, got {self.environment!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ValueError(f"group_size must be an integer, got {self.group_size!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if (
            isinstance(self.sibling_index, bool)
            or not isinstance(self.sibling_index, int)
            or not 0 <= self.sibling_index < self.group_size
        ):
            raise ValueError(
                f"sibling_index must be in [0, {self.group_size}), got {self.sibling_index!r}"
            )
        object.__setattr__(self, "task", _plain_json(self.task, "task"))
        object.__setattr__(self, "budget_s", _check_budget(self.budget_s, "budget_s"))

    @classmethod
    def from_descriptor(
        cls, rollout: InFlightRollout, instance: str, budget_s: float | None
    ) -> Self:
        """The rollout a saved descriptor describes, to run on ``instance``."""
        return cls(
            rollout_id=rollout.episode.rollout_id,
            prompt_group_id=rollout.prompt_group_id,
            sibling_index=rollout.sibling_index,
            group_size=rollout.group_size,
            environment=rollout.environment,
            task=rollout.task,
            instance=instance,
            budget_s=budget_s,
        )


class RolloutOutcome(enum.Enum):
    """How a rollout ended, as the training loop sees it."""

    COMPLETED = "completed"
    # The agent failed; the participant reported the error.
    FAILED = "failed"
    # The participant's own active-time budget ran out.
    BUDGET_EXHAUSTED = "budget_exhausted"
    # The trainer's active-time budget ran out; its Run was cancelled.
    GIVEN_UP = "given_up"
    # No attempt could finish (broken streams, refusals, a protocol error).
    ABANDONED = "abandoned"


_RESULT_FIELDS: Final = frozenset(
    {
        "rollout_id",
        "attempt",
        "instance",
        "prompt_group_id",
        "sibling_index",
        "group_size",
        "environment",
        "outcome",
        "output",
        "task",
        "turns",
        "boundaries",
        "active_time_s",
        "error_message",
        "receipt_id",
    }
)


class _Reader:
    """Strict reading of one JSON object of the rollout state: every field, nothing else."""

    def __init__(self, raw: object, where: str, fields: frozenset[str]) -> None:
        if not isinstance(raw, Mapping):
            raise ManifestError(f"{where}: must be an object", field=where)
        unknown = sorted(set(raw) - fields)
        missing = sorted(fields - set(raw))
        if unknown or missing:
            raise ManifestError(
                f"{where}: unknown field(s) {unknown}, missing field(s) {missing}", field=where
            )
        self._raw = raw
        self._where = where

    def fail(self, name: str, why: str) -> ManifestError:
        return ManifestError(f"{self._where}.{name}: {why}", field=f"{self._where}.{name}")

    def id(self, name: str) -> str:
        try:
            return validate_id(self._raw[name], name)
        except InvalidIdError as error:
            raise self.fail(name, error.why) from None

    def attempt(self, name: str) -> int:
        try:
            return validate_attempt(self._raw[name], name)
        except InvalidIdError as error:
            raise self.fail(name, error.why) from None

    def count(self, name: str) -> int:
        value = self._raw[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(name, f"must be an integer >= 0, got {value!r}")
        return value

    def text(self, name: str) -> str:
        value = self._raw[name]
        if not isinstance(value, str):
            raise self.fail(name, f"must be a string, got {value!r}")
        return value

    def number(self, name: str) -> float:
        value = self._raw[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise self.fail(name, f"must be a number >= 0, got {value!r}")
        return float(value)

    def optional_budget(self, name: str) -> float | None:
        value = self._raw[name]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.fail(name, f"must be null or a number > 0, got {value!r}")
        return float(value)

    def flag(self, name: str) -> bool:
        value = self._raw[name]
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {value!r}")
        return value

    def obj(self, name: str) -> dict[str, Any]:
        try:
            return _plain_json(self._raw[name], name)
        except ValueError as error:
            raise self.fail(name, str(error)) from None


@dataclass(frozen=True, slots=True)
class RolloutResult:
    """One finished rollout in the results queue (what the training loop consumes).

    ``output`` is the agent's result (answer, reward, tokens) as its server defines it;
    ``receipt_id`` is empty when nothing had to be acknowledged (given up, abandoned).
    """

    episode: EpisodeId
    instance: str
    prompt_group_id: str
    sibling_index: int
    group_size: int
    environment: str
    outcome: RolloutOutcome
    output: Mapping[str, Any]
    task: Mapping[str, Any]
    turns: int
    boundaries: int
    active_time_s: float
    error_message: str = ""
    receipt_id: str = ""

    @property
    def rollout_id(self) -> str:
        return self.episode.rollout_id

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "rollout_id": self.episode.rollout_id,
            "attempt": self.episode.attempt,
            "instance": self.instance,
            "prompt_group_id": self.prompt_group_id,
            "sibling_index": self.sibling_index,
            "group_size": self.group_size,
            "environment": self.environment,
            "outcome": self.outcome.value,
            "output": _plain_json(self.output, "output"),
            "task": _plain_json(self.task, "task"),
            "turns": self.turns,
            "boundaries": self.boundaries,
            "active_time_s": self.active_time_s,
            "error_message": self.error_message,
            "receipt_id": self.receipt_id,
        }

    @classmethod
    def from_json(cls, raw: object, where: str = "queue item") -> Self:
        """Parse one queue entry strictly (unknown or missing fields are errors)."""
        read = _Reader(raw, where, _RESULT_FIELDS)
        outcome_text = read.text("outcome")
        try:
            outcome = RolloutOutcome(outcome_text)
        except ValueError:
            raise read.fail("outcome", f"unknown outcome {outcome_text!r}") from None
        return cls(
            episode=EpisodeId(read.id("rollout_id"), read.attempt("attempt")),
            instance=read.id("instance"),
            prompt_group_id=read.id("prompt_group_id"),
            sibling_index=read.count("sibling_index"),
            group_size=read.count("group_size"),
            environment=read.text("environment"),
            outcome=outcome,
            output=read.obj("output"),
            task=read.obj("task"),
            turns=read.count("turns"),
            boundaries=read.count("boundaries"),
            active_time_s=read.number("active_time_s"),
            error_message=read.text("error_message"),
            receipt_id=read.text("receipt_id"),
        )


_SAVED_FIELDS: Final = frozenset(
    {
        "rollout_id",
        "attempt",
        "instance",
        "prompt_group_id",
        "sibling_index",
        "group_size",
        "environment",
        "boundaries_seen",
        "task",
        "budget_s",
        "accepted",
    }
)


def saved_rollout_json(
    episode: EpisodeId,
    instance: str,
    prompt_group_id: str,
    sibling_index: int,
    group_size: int,
    environment: str,
    boundaries_seen: int,
    task: Mapping[str, Any],
    budget_s: float | None,
    accepted: bool,
) -> dict[str, Any]:
    """The descriptor :meth:`SavedRollout.to_json` writes, holding ``task`` itself: the
    caller copies it (:func:`plain_json_copies` copies a cut's tasks in one pass)."""
    return {
        "rollout_id": episode.rollout_id,
        "attempt": episode.attempt,
        "instance": instance,
        "prompt_group_id": prompt_group_id,
        "sibling_index": sibling_index,
        "group_size": group_size,
        "environment": environment,
        "boundaries_seen": boundaries_seen,
        "task": task,
        "budget_s": budget_s,
        "accepted": accepted,
    }


def plain_json_copies(values: list[Mapping[str, Any]], what: str) -> list[dict[str, Any]]:
    """``[_plain_json(value, what) for value in values]``, in one encode and decode."""
    if all(type(value) is dict for value in values):
        try:
            copies = json.loads(_STRICT_ENCODER.encode(values))
        except (TypeError, ValueError):
            pass  # the copy one by one below names the value that is not plain JSON
        else:
            assert isinstance(copies, list)
            return copies
    return [_plain_json(value, what) for value in values]


@dataclass(frozen=True, slots=True)
class SavedRollout:
    """An unfinished rollout as a snapshot records it (``TrainerRolloutState.in_flight``).

    ``rollout`` carries attempt N and the task, so a restore can continue it as N+1
    (:meth:`~turnpoint.trainer.rollouts.ledger.RolloutLedger.redispatch`) or rerun it from its
    prompt (:meth:`~turnpoint.trainer.rollouts.ledger.RolloutLedger.rerun_from_prompt`).
    ``accepted`` says whether a participant owned attempt N at the cut; one that was still
    waiting at the gate was owned by nobody, so nothing of it can have been exported and
    it can only be rerun.
    """

    rollout: InFlightRollout
    budget_s: float | None
    accepted: bool

    def to_json(self) -> dict[str, JSONValue]:
        rollout = self.rollout
        descriptor = saved_rollout_json(
            rollout.episode,
            rollout.instance,
            rollout.prompt_group_id,
            rollout.sibling_index,
            rollout.group_size,
            rollout.environment,
            rollout.boundaries_seen,
            rollout.task,
            self.budget_s,
            self.accepted,
        )
        descriptor["task"] = _plain_json(rollout.task, "task")
        return descriptor

    @classmethod
    def from_json(cls, raw: object, where: str = "in_flight item") -> Self:
        """Parse one in-flight descriptor strictly (unknown or missing fields are errors)."""
        read = _Reader(raw, where, _SAVED_FIELDS)
        rollout = InFlightRollout(
            episode=EpisodeId(read.id("rollout_id"), read.attempt("attempt")),
            instance=read.id("instance"),
            prompt_group_id=read.id("prompt_group_id"),
            sibling_index=read.count("sibling_index"),
            group_size=read.count("group_size"),
            environment=read.text("environment"),
            boundaries_seen=read.count("boundaries_seen"),
            task=read.obj("task"),
        )
        if not 0 <= rollout.sibling_index < rollout.group_size:
            raise read.fail("sibling_index", f"must be in [0, {rollout.group_size})")
        return cls(rollout, read.optional_budget("budget_s"), read.flag("accepted"))


def read_rollout_state(
    state: TrainerRolloutState,
) -> tuple[tuple[RolloutResult, ...], tuple[SavedRollout, ...]]:
    """The queue and the in-flight descriptors of a snapshot's rollout state, read
    strictly and checked against each other and the attempt ledger (docs/spec.md
    section 8.7). Raises :class:`~turnpoint.trainer.storage.manifest.ManifestError`."""
    queue = tuple(
        RolloutResult.from_json(raw, f"rollout_state.queue[{index}]")
        for index, raw in enumerate(state.queue)
    )
    saved = tuple(
        SavedRollout.from_json(raw, f"rollout_state.in_flight[{index}]")
        for index, raw in enumerate(state.in_flight)
    )
    for result in queue:
        if state.attempts.get(result.rollout_id) != result.episode.attempt:
            raise ManifestError(
                f"queued result {result.episode} disagrees with the attempt ledger",
                field="rollout_state.queue",
            )
    queued_ids = {result.rollout_id for result in queue}
    for item in saved:
        if item.rollout.episode.rollout_id in queued_ids:
            raise ManifestError(
                f"rollout {item.rollout.episode.rollout_id!r} is both finished and in flight",
                field="rollout_state.in_flight",
            )
    return queue, saved
