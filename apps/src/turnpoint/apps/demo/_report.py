"""The demo's logs, its report and the exactly-once audit: pure functions over parsed events.

The trainer writes ``<out>/events.jsonl``, one JSON object per line. Every object has
``t`` (wall-clock seconds), ``type`` and ``incarnation`` (1 for the first trainer
process, 2 for the one started after the crash, ...). The types this module reads:

- ``start``: ``restored_from`` (a checkpoint id or null) and ``step``, the number of
  training steps already done when the incarnation starts (0 for a fresh run, the
  restored snapshot's step after a restore).
- ``progress`` (about twice a second): ``step``, ``in_flight``, ``published``,
  ``admission_closed``, ``queue``.
- ``rollout``: a result the trainer recorded: ``rollout_id``, ``attempt``, ``group``
  (the prompt group's index in data order: 0, 1, 2, ...; an integer, or a string id
  that ends in it, such as ``g00012``), ``sibling`` (0..N-1),
  ``environment``, ``reward``, ``resumed`` (continued from a saved turn), ``turns``.
- ``train_step``: ``step`` (1-based: the step just completed), ``groups`` (prompt group
  indexes), ``rollouts`` (``rollout_id``, ``attempt``, ``reward`` of each sample) and
  ``mean_reward``.
- ``snapshot``: ``checkpoint_id``, ``outcome`` (``published``, ``failed`` or
  ``skipped``), ``reason``, ``t_start``, ``t_end``, ``admission_closed_s``, ``phases``.
- ``restore``: ``checkpoint_id``, ``resumed_from_turn``, ``rerun_from_prompt``,
  ``groups_retried_whole``, ``seconds``.
- ``heal``: a lost participant replaced in place (docs/spec.md section 7.15):
  ``lost`` (its instance), ``participant_kind``, ``checkpoint_id`` (the snapshot the
  touched rollouts went back to, or null), ``continued`` and ``rerun`` (the rollouts
  restored: continued from a saved turn, rerun from their prompts) and ``running`` (the
  rollouts in flight at that moment, touched or not), ``step``.
- ``done``: ``step``.

Types this module does not know are ignored, so the trainer may log more; a known type
with a missing or mistyped field is an :class:`EventLogError`.

A ``train_step`` sample may also carry ``turns``: the tokens training took from it, one
``{prompt, completion}`` per turn (token id lists).

The supervisor writes ``<out>/supervisor.jsonl`` (``crash`` and ``restart`` with their
``t``; ``agent_lost`` and, for each participant it replaced at the trainer's request,
``replaced`` with its ``instance``) and every verifier appends ``{verifier, rollout_id, attempt, reward}`` to
``<out>/verifier-<instance>.jsonl``, with ``executions``: the ids of the tool executions
its session applied, in order (when the server logs them). A resources server that logs
its tool executions appends one line per execution to the same file: ``tools``,
``execution`` (an id unique in the run), ``rollout_id``, ``attempt``, ``turn``, ``reply``
and ``t``. The policy appends one line per generation it
streamed to ``<out>/generations-<instance>.jsonl`` as the stream ends: ``request_id``,
``rollout_id``, ``attempt``, ``prompt`` and ``tokens`` (token id lists), ``finished``
(false when a checkpoint cut it or it was stopped), ``t_start`` and ``t_end``.

**The audit** replays the run as training saw it. A crashed incarnation's train steps
after the step its successor restored are rolled back (the successor's steps replace
them); what remains is the *effective lineage*. Over it: every prompt group is trained
exactly once and the groups cover 0..G-1 without a gap; every trained group has exactly
its N siblings, each once (no completed rollout lost, none counted twice); and every
reward the trainer trained with is one a verifier returned for that rollout attempt.

**The token audit** (docs/spec.md section 5.5 item 8), when the trainer logged the turns it
trained and the policy logged its generations. The *audited* generations are those of a
rollout the effective lineage trained, by the trained attempt or an earlier one.

1. Every trained turn's completion is tiled, in order, by audited generations of that
   rollout: the first asked with the turn's prompt, each next one with the prompt plus
   the tokens so far, each but the last cut and the last finished, their tokens equal to
   the completion's. So every trained token was streamed by the policy, at that place.
2. No generation tiles two places: no token is trained twice.
3. Every audited generation that training did not take is explained: it began before
   a restore and ended after the snapshot that restore went back to began (work of an
   incarnation the restore replaced, which that snapshot cannot hold whole: *discarded
   by restores*), or it belongs to an attempt older than the trained one (work the
   trained attempt did not carry over, such as a turn not yet sealed at the snapshot:
   *superseded*), or it ended on its own in the trained attempt and did not stream a
   cut prefix training took again (a turn asked again after a lost reply: *retried*).
   A cut of the trained attempt that training did not take (its prefix regenerated
   instead of continued), or a generation that streamed a trained cut prefix again,
   fails the audit.
4. A cut a restored snapshot saved is continued: a generation cut within the snapshot's
   window, of a rollout whose next attempt was trained resumed from its saved turn, is
   trained, not generated again.

**The tool-call audit** (docs/spec.md section 6.12), when the resources servers logged
their executions. The history of a trained rollout is the list of executions its
session had applied when the verifier scored it (the verifier entry of the trained
attempt, or of the attempt it continued, whose reward training took). In it every turn
of the rollout is applied exactly once (a call re-sent after a restore or a lost reply
that ran the tool again shows as a turn applied twice), every execution is one a
resources server logged, and the reply training took for each turn is the reply the
tool gave. A turn answered in a later attempt than the one whose execution produced it
(``answered_in`` in the trained turn) was *answered from the record*.

**The sandbox audit** (docs/spec.md section 5.7.5), when a resources server logged
restored sandboxes (the coding environment): one line per session a restore brought
back, ``sandbox``, ``rollout_id``, ``attempt``, ``generation``, ``cut_digest`` (the tree
digest its snapshot recorded at the cut) and ``restored_digest`` (the digest of the tree
the restore made, measured). Every restored tree must equal its digest at the cut. That
no command's effect is applied twice is the tool-call audit's: the coding environment
logs its executions like the other servers.

**The egress audit** (docs/spec.md sections 12.6 to 12.9), when the agents are opaque
(``--agent opaque``): a ``rollout`` event then carries ``egress``, the relay's record of
the episode at its end (``calls``: each call id, ``g<generation>-c<n>`` for a model call
and ``g<generation>-t<n>`` for a tool call, to its disposition; ``replayed``;
``reruns``). Of every trained rollout, every call has one final disposition (none is
left ``active_prefix``), and its trained turns are its completed calls: one completed
model call and one completed tool call per turn (at least, when the episode was rerun
from its prompt). Each call is recorded once under its id, so no model call or tool call
crossed into training twice; the trained tokens themselves are the token audit's.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

REWARD_TOLERANCE = 1e-9
"""Trainer and verifier rewards are the same float written twice; allow only rounding."""

_MEAN_TOLERANCE = 1e-6


class DemoError(Exception):
    """Root of the demo's errors: the message says what went wrong and what to change."""


class EventLogError(DemoError):
    """A log line is not what its contract says."""


class LineageError(DemoError):
    """The incarnations' train steps do not form one history."""


# ---------------------------------------------------------------------- parsed events


@dataclass(frozen=True, slots=True)
class Start:
    incarnation: int
    t: float
    restored_from: str | None
    step: int


@dataclass(frozen=True, slots=True)
class Progress:
    incarnation: int
    t: float
    step: int
    in_flight: int
    published: int
    admission_closed: bool
    queue: int


@dataclass(frozen=True, slots=True)
class RolloutResult:
    incarnation: int
    t: float
    rollout_id: str
    attempt: int
    group: int
    sibling: int
    environment: str
    reward: float
    resumed: bool
    turns: int
    # An opaque agent's relay record of the episode (the egress audit), else None.
    egress: Mapping[str, Any] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt)


@dataclass(frozen=True, slots=True)
class TrainedTurn:
    """One turn training took: the prompt it was generated from and its completion."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    # The tool's reply the turn carried, and the attempt that got it (tool-call audit).
    reply: str | None = None
    answered_in: int | None = None


@dataclass(frozen=True, slots=True)
class TrainedRollout:
    rollout_id: str
    attempt: int
    reward: float
    # None when the trainer did not log the tokens (no token audit then).
    turns: tuple[TrainedTurn, ...] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt)


@dataclass(frozen=True, slots=True)
class TrainStep:
    incarnation: int
    t: float
    step: int
    groups: tuple[int, ...]
    rollouts: tuple[TrainedRollout, ...]
    mean_reward: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    incarnation: int
    t: float
    checkpoint_id: str
    outcome: str
    reason: str | None
    t_start: float
    t_end: float
    admission_closed_s: float | None
    phases: Mapping[str, float]
    # Unfinished rollouts the cut continues from a saved turn, and restarts from prompt.
    continued: int
    restarts: int

    @property
    def attempted(self) -> bool:
        return self.outcome in ("published", "failed")


@dataclass(frozen=True, slots=True)
class Restore:
    incarnation: int
    t: float
    checkpoint_id: str
    resumed_from_turn: int
    rerun_from_prompt: int
    groups_retried_whole: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Done:
    incarnation: int
    t: float
    step: int


@dataclass(frozen=True, slots=True)
class Heal:
    """One lost participant replaced in place: what it cost against what was running."""

    incarnation: int
    t: float
    lost: str
    checkpoint_id: str | None
    continued: int
    rerun: int
    running: int

    @property
    def restored(self) -> int:
        return self.continued + self.rerun


Event = Start | Progress | RolloutResult | TrainStep | Snapshot | Restore | Heal | Done


@dataclass(frozen=True, slots=True)
class EventLog:
    """The trainer's events by type, each tuple in log order."""

    starts: tuple[Start, ...] = ()
    progress: tuple[Progress, ...] = ()
    rollouts: tuple[RolloutResult, ...] = ()
    train_steps: tuple[TrainStep, ...] = ()
    snapshots: tuple[Snapshot, ...] = ()
    restores: tuple[Restore, ...] = ()
    dones: tuple[Done, ...] = ()
    heals: tuple[Heal, ...] = ()

    @property
    def times(self) -> list[float]:
        groups: Sequence[Sequence[Event]] = (
            self.starts,
            self.progress,
            self.rollouts,
            self.train_steps,
            self.snapshots,
            self.restores,
            self.dones,
        )
        return [event.t for events in groups for event in events]


@dataclass(frozen=True, slots=True)
class SupervisorEvent:
    """``crash`` or ``restart`` (or anything else the supervisor records), with its time."""

    type: str
    t: float
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class VerifierEntry:
    verifier: str
    rollout_id: str
    attempt: int
    reward: float
    # The tool executions the session had applied, in order; None when not logged.
    executions: tuple[str, ...] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt)


@dataclass(frozen=True, slots=True)
class ExecutionEntry:
    """One run of a tool by a resources server."""

    tools: str
    execution: str
    rollout_id: str
    attempt: int
    turn: int
    reply: str
    t: float


@dataclass(frozen=True, slots=True)
class SandboxEntry:
    """One sandbox a restore brought back, with its tree's digest at the cut and after."""

    sandbox: str
    rollout_id: str
    attempt: int
    generation: int
    cut_digest: str
    restored_digest: str
    processes: str | None = None  # what the restore did with the processes, and why


@dataclass(frozen=True, slots=True)
class GenerationEntry:
    """One generation the policy streamed: ``finished`` false when it was cut or stopped."""

    policy: str
    request_id: str
    rollout_id: str
    attempt: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finished: bool
    t_start: float
    t_end: float

    @property
    def cut(self) -> bool:
        return not self.finished and bool(self.tokens)


class _Fields:
    """Typed reads of one JSON object; every error names the event and the field."""

    def __init__(self, raw: Mapping[str, Any], what: str) -> None:
        self._raw = raw
        self._what = what

    def _get(self, key: str) -> Any:
        if key not in self._raw:
            raise EventLogError(f"{self._what} has no {key!r}")
        return self._raw[key]

    def _wrong(self, key: str, wanted: str) -> EventLogError:
        return EventLogError(f"{self._what}: {key!r} must be {wanted}, got {self._raw[key]!r}")

    def group(self, key: str) -> int:
        index = _group_index(self._get(key))
        if index is None:
            raise self._wrong(key, "a prompt group index (an integer, or an id ending in one)")
        return index

    def integer(self, key: str) -> int:
        value = self._get(key)
        # bool is an int to Python but never a count or an index here.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(key, "an integer")
        return value

    def number(self, key: str) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong(key, "a number")
        return float(value)

    def optional_number(self, key: str) -> float | None:
        if self._raw.get(key) is None:
            return None
        return self.number(key)

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def optional_text(self, key: str) -> str | None:
        if self._raw.get(key) is None:
            return None
        return self.text(key)

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false")
        return value

    def items(self, key: str) -> list[Any]:
        value = self._get(key)
        if not isinstance(value, list):
            raise self._wrong(key, "a list")
        return value

    def tokens(self, key: str) -> tuple[int, ...]:
        values = self.items(key)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise self._wrong(key, "a list of token ids")
        return tuple(values)

    def mapping(self, key: str) -> Mapping[str, Any]:
        value = self._raw.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self._wrong(key, "an object")
        return value


_TRAILING_DIGITS = re.compile(r"(\d+)$")


def _group_index(value: object) -> int | None:
    """A prompt group's index: an integer, or the number a string id such as g00012 ends in."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and (match := _TRAILING_DIGITS.search(value)):
        return int(match[1])
    return None


def parse_event(raw: Mapping[str, Any], where: str = "event") -> Event | None:
    """One trainer event, or None for a type this module does not read."""
    kind = raw.get("type")
    fields = _Fields(raw, f"{where} ({kind})" if isinstance(kind, str) else where)
    kind = fields.text("type")
    incarnation = fields.integer("incarnation")
    t = fields.number("t")
    if kind == "start":
        return Start(incarnation, t, fields.optional_text("restored_from"), fields.integer("step"))
    if kind == "progress":
        return Progress(
            incarnation,
            t,
            fields.integer("step"),
            fields.integer("in_flight"),
            fields.integer("published"),
            fields.flag("admission_closed"),
            fields.integer("queue"),
        )
    if kind == "rollout":
        return RolloutResult(
            incarnation,
            t,
            fields.text("rollout_id"),
            fields.integer("attempt"),
            fields.group("group"),
            fields.integer("sibling"),
            fields.text("environment"),
            fields.number("reward"),
            fields.flag("resumed"),
            fields.integer("turns"),
            fields.mapping("egress") or None,
        )
    if kind == "train_step":
        groups = []
        for index, group in enumerate(fields.items("groups")):
            group_index = _group_index(group)
            if group_index is None:
                raise EventLogError(
                    f"{where} (train_step): groups[{index}] must be a prompt group index "
                    f"(an integer, or an id ending in one), got {group!r}"
                )
            groups.append(group_index)
        rollouts = []
        for index, item in enumerate(fields.items("rollouts")):
            if not isinstance(item, dict):
                raise EventLogError(f"{where} (train_step): rollouts[{index}] must be an object")
            what = f"{where} (train_step) rollouts[{index}]"
            sample = _Fields(item, what)
            turns = None
            if item.get("turns") is not None:
                turns = []
                for number, turn in enumerate(sample.items("turns")):
                    if not isinstance(turn, dict):
                        raise EventLogError(f"{what}: turns[{number}] must be an object")
                    fields_of_turn = _Fields(turn, f"{what} turns[{number}]")
                    answered_in = turn.get("answered_in")
                    turns.append(
                        TrainedTurn(
                            fields_of_turn.tokens("prompt"),
                            fields_of_turn.tokens("completion"),
                            fields_of_turn.optional_text("reply"),
                            None if answered_in is None else fields_of_turn.integer("answered_in"),
                        )
                    )
            rollouts.append(
                TrainedRollout(
                    sample.text("rollout_id"),
                    sample.integer("attempt"),
                    sample.number("reward"),
                    None if turns is None else tuple(turns),
                )
            )
        return TrainStep(
            incarnation,
            t,
            fields.integer("step"),
            tuple(groups),
            tuple(rollouts),
            fields.number("mean_reward"),
        )
    if kind == "snapshot":
        outcome = fields.text("outcome")
        if outcome not in ("published", "failed", "skipped"):
            raise EventLogError(
                f"{where} (snapshot): outcome must be published, failed or skipped, got {outcome!r}"
            )
        phases = {}
        for name, seconds in fields.mapping("phases").items():
            if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                raise EventLogError(f"{where} (snapshot): phase {name!r} must be seconds")
            phases[str(name)] = float(seconds)
        return Snapshot(
            incarnation,
            t,
            fields.text("checkpoint_id"),
            outcome,
            fields.optional_text("reason"),
            fields.number("t_start"),
            fields.number("t_end"),
            fields.optional_number("admission_closed_s"),
            phases,
            fields.integer("continued"),
            fields.integer("restarts"),
        )
    if kind == "restore":
        return Restore(
            incarnation,
            t,
            fields.text("checkpoint_id"),
            fields.integer("resumed_from_turn"),
            fields.integer("rerun_from_prompt"),
            fields.integer("groups_retried_whole"),
            fields.number("seconds"),
        )
    if kind == "done":
        return Done(incarnation, t, fields.integer("step"))
    if kind == "heal":
        heal = Heal(
            incarnation,
            t,
            fields.text("lost"),
            fields.optional_text("checkpoint_id"),
            fields.integer("continued"),
            fields.integer("rerun"),
            fields.integer("running"),
        )
        if min(heal.continued, heal.rerun) < 0 or heal.restored > heal.running:
            raise EventLogError(
                f"{where} (heal): continued and rerun must be >= 0 and at most running "
                f"together, got {heal.continued} + {heal.rerun} of {heal.running}"
            )
        return heal
    return None


def parse_events(raw_events: Iterable[Mapping[str, Any]]) -> EventLog:
    """The trainer's events sorted by type; raises :class:`EventLogError` naming the line."""
    buckets: dict[type[Event], list[Any]] = defaultdict(list)
    for number, raw in enumerate(raw_events, start=1):
        event = parse_event(raw, f"events.jsonl line {number}")
        if event is not None:
            buckets[type(event)].append(event)
    return EventLog(
        starts=tuple(buckets[Start]),
        progress=tuple(buckets[Progress]),
        rollouts=tuple(buckets[RolloutResult]),
        train_steps=tuple(buckets[TrainStep]),
        snapshots=tuple(buckets[Snapshot]),
        restores=tuple(buckets[Restore]),
        dones=tuple(buckets[Done]),
        heals=tuple(buckets[Heal]),
    )


def parse_supervisor_events(raw_events: Iterable[Mapping[str, Any]]) -> list[SupervisorEvent]:
    events = []
    for number, raw in enumerate(raw_events, start=1):
        fields = _Fields(raw, f"supervisor.jsonl line {number}")
        detail = {k: v for k, v in raw.items() if k not in ("type", "t")}
        events.append(SupervisorEvent(fields.text("type"), fields.number("t"), detail))
    return events


def parse_verifier_entries(
    raw_entries: Iterable[Mapping[str, Any]], source: str = "verifier log"
) -> list[VerifierEntry]:
    """The verifier lines of a resources server's log (its tool executions skipped)."""
    entries = []
    for number, raw in enumerate(raw_entries, start=1):
        if "execution" in raw or "sandbox" in raw:
            continue
        fields = _Fields(raw, f"{source} line {number}")
        executions = None
        if raw.get("executions") is not None:
            names = fields.items("executions")
            if not all(isinstance(name, str) for name in names):
                raise fields._wrong("executions", "a list of execution ids")
            executions = tuple(names)
        entries.append(
            VerifierEntry(
                fields.text("verifier"),
                fields.text("rollout_id"),
                fields.integer("attempt"),
                fields.number("reward"),
                executions,
            )
        )
    return entries


def parse_execution_entries(
    raw_entries: Iterable[Mapping[str, Any]], source: str = "resources log"
) -> list[ExecutionEntry]:
    """The tool executions of a resources server's log (its verifier lines skipped)."""
    entries = []
    for number, raw in enumerate(raw_entries, start=1):
        if "execution" not in raw:
            continue
        fields = _Fields(raw, f"{source} line {number}")
        entries.append(
            ExecutionEntry(
                fields.text("tools"),
                fields.text("execution"),
                fields.text("rollout_id"),
                fields.integer("attempt"),
                fields.integer("turn"),
                fields.text("reply"),
                fields.number("t"),
            )
        )
    return entries


def parse_sandbox_entries(
    raw_entries: Iterable[Mapping[str, Any]], source: str = "resources log"
) -> list[SandboxEntry]:
    """The restored sandboxes of a resources server's log (its other lines skipped)."""
    entries = []
    for number, raw in enumerate(raw_entries, start=1):
        if "sandbox" not in raw:
            continue
        fields = _Fields(raw, f"{source} line {number}")
        entries.append(
            SandboxEntry(
                fields.text("sandbox"),
                fields.text("rollout_id"),
                fields.integer("attempt"),
                fields.integer("generation"),
                fields.text("cut_digest"),
                fields.text("restored_digest"),
                fields.optional_text("processes"),
            )
        )
    return entries


def parse_generation_entries(
    raw_entries: Iterable[Mapping[str, Any]], source: str = "generation log"
) -> list[GenerationEntry]:
    entries = []
    for number, raw in enumerate(raw_entries, start=1):
        fields = _Fields(raw, f"{source} line {number}")
        entries.append(
            GenerationEntry(
                fields.text("policy"),
                fields.text("request_id"),
                fields.text("rollout_id"),
                fields.integer("attempt"),
                fields.tokens("prompt"),
                fields.tokens("tokens"),
                fields.flag("finished"),
                fields.number("t_start"),
                fields.number("t_end"),
            )
        )
    return entries


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file as an object; a missing file is empty. Blocking."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    objects = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise EventLogError(f"{path.name} line {number} is not JSON: {error.msg}") from None
        if not isinstance(value, dict):
            raise EventLogError(f"{path.name} line {number} is not a JSON object")
        objects.append(value)
    return objects


@dataclass(frozen=True, slots=True)
class RunLogs:
    events: EventLog
    supervisor: tuple[SupervisorEvent, ...]
    verifier: tuple[VerifierEntry, ...]
    # Empty when no policy logged its generations (no token audit then).
    generations: tuple[GenerationEntry, ...] = ()
    # Empty when no resources server logged its tool executions (no tool-call audit).
    executions: tuple[ExecutionEntry, ...] = ()
    # Empty when no resources server logged restored sandboxes (no sandbox audit).
    sandboxes: tuple[SandboxEntry, ...] = ()


def load_run(out: Path) -> RunLogs:
    """The logs of a demo run under ``out``. Blocking: call through a thread."""
    events = parse_events(read_jsonl(out / "events.jsonl"))
    supervisor = parse_supervisor_events(read_jsonl(out / "supervisor.jsonl"))
    verifier: list[VerifierEntry] = []
    executions: list[ExecutionEntry] = []
    sandboxes: list[SandboxEntry] = []
    for path in sorted(out.glob("verifier-*.jsonl")):
        lines = read_jsonl(path)
        verifier.extend(parse_verifier_entries(lines, path.name))
        executions.extend(parse_execution_entries(lines, path.name))
        sandboxes.extend(parse_sandbox_entries(lines, path.name))
    generations: list[GenerationEntry] = []
    for path in sorted(out.glob("generations-*.jsonl")):
        generations.extend(parse_generation_entries(read_jsonl(path), path.name))
    return RunLogs(
        events,
        tuple(supervisor),
        tuple(verifier),
        tuple(generations),
        tuple(executions),
        tuple(sandboxes),
    )


# ---------------------------------------------------------------------- the audit


@dataclass(frozen=True, slots=True)
class Lineage:
    """The train steps that count (in step order) and those a restore rolled back."""

    steps: tuple[TrainStep, ...]
    rolled_back: tuple[TrainStep, ...]


def effective_lineage(log: EventLog) -> Lineage:
    """Replay the incarnations in order: each one's start step cuts its predecessors'.

    Raises :class:`LineageError` when the history cannot be one run: an incarnation
    without a start, one that restores a step nobody trained, or a step out of order.
    """
    starts: dict[int, Start] = {}
    for start in log.starts:
        if start.incarnation in starts:
            raise LineageError(f"incarnation {start.incarnation} started twice")
        starts[start.incarnation] = start
    steps_of: dict[int, list[TrainStep]] = defaultdict(list)
    for step in log.train_steps:
        steps_of[step.incarnation].append(step)
    for incarnation in steps_of:
        if incarnation not in starts:
            raise LineageError(f"incarnation {incarnation} trained without a start event")
    effective: list[TrainStep] = []
    rolled_back: list[TrainStep] = []
    for incarnation in sorted(starts):
        start = starts[incarnation]
        if start.step > len(effective):
            origin = f"restored from {start.restored_from}" if start.restored_from else "fresh"
            raise LineageError(
                f"incarnation {incarnation} starts at step {start.step} ({origin}) but only "
                f"{len(effective)} steps were trained before it"
            )
        rolled_back.extend(effective[start.step :])
        del effective[start.step :]
        for step in steps_of[incarnation]:
            if step.step != len(effective) + 1:
                raise LineageError(
                    f"incarnation {incarnation} logged train step {step.step} after step "
                    f"{len(effective)}"
                )
            effective.append(step)
    return Lineage(tuple(effective), tuple(rolled_back))


@dataclass(frozen=True, slots=True)
class TokenAudit:
    """The token audit's counts, in tokens (see the module docstring)."""

    generated: int = 0
    """Every token the policy streamed, in every generation it logged."""
    trained: int = 0
    """Tokens of the trained turns: each streamed once and trained once."""
    cut_continued: int = 0
    """Trained tokens streamed before a cut and then continued from (``cuts`` cuts)."""
    cuts: int = 0
    discarded_by_restores: int = 0
    """Streamed, not trained, by generations begun before a restore (lost work)."""
    superseded: int = 0
    """Streamed, not trained, by an attempt older than the one trained."""
    retried: int = 0
    """Streamed, not trained, by a generation that ended on its own in the trained
    attempt and whose turn was asked again (a turn redone after a lost reply)."""
    not_trained: int = 0
    """Streamed for rollouts the effective lineage never trained (in flight at the end,
    or whose steps a restore rolled back and that were trained as another attempt)."""

    @property
    def line(self) -> str:
        return (
            f"tokens: {self.generated} generated, {self.trained} trained (each exactly once), "
            f"{self.cut_continued} cut and continued ({self.cuts} cuts), "
            f"{self.discarded_by_restores} discarded by restores, "
            f"{self.superseded} of superseded attempts, "
            f"{self.retried} of turns retried within their attempt, "
            f"{self.not_trained} of rollouts not trained"
        )


@dataclass(frozen=True, slots=True)
class ToolAudit:
    """The tool-call audit's counts (see the module docstring)."""

    executed: int = 0
    """Executions in the trained rollouts' histories: each a turn applied once."""
    answered_from_record: int = 0
    """Turns whose reply a later attempt got from the session's record."""
    unaudited_rollouts: int = 0
    """Trained rollouts whose verifier logged no history (a server that does not log)."""

    @property
    def line(self) -> str:
        line = (
            f"tool calls: {self.executed} executed, each once; "
            f"{self.answered_from_record} answered from the record"
        )
        if self.unaudited_rollouts:
            line += f" ({self.unaudited_rollouts} rollouts not audited: no history logged)"
        return line


_FINAL_DISPOSITIONS = frozenset(("never_started", "completed", "terminal_failure", "excluded"))


@dataclass(frozen=True, slots=True)
class EgressAudit:
    """The egress audit's counts (see the module docstring)."""

    rollouts: int = 0
    dispositions: Mapping[str, int] = field(default_factory=dict)
    replayed: int = 0
    reruns: int = 0

    @property
    def line(self) -> str:
        calls = sum(self.dispositions.values())
        shown = ", ".join(
            f"{n} {d.replace('_', ' ')}" for d, n in sorted(self.dispositions.items())
        )
        return (
            f"egress: {calls} model and tool calls of {self.rollouts} trained rollouts, each "
            f"with one final disposition ({shown}); {self.replayed} answered from the record "
            f"after a restore, {self.reruns} episodes rerun from the prompt"
        )


@dataclass(frozen=True, slots=True)
class SandboxAudit:
    """The sandbox audit's count (see the module docstring)."""

    restored: int = 0
    """Sandboxes a restore brought back, each tree equal to its digest at the cut."""
    processes: tuple[str, ...] = ()
    """What those restores did with the sandboxes' processes, each said once."""

    @property
    def line(self) -> str:
        line = f"sandboxes: {self.restored} restored, each tree equal to its digest at the cut"
        if self.processes:
            line += f"; processes {'; '.join(self.processes)}"
        return line


@dataclass(frozen=True, slots=True)
class AuditResult:
    passed: bool
    reason: str | None = None
    steps: int = 0
    groups: int = 0
    rollouts: int = 0
    rolled_back_steps: int = 0
    # None when the token audit did not run (no turns or no generations logged).
    tokens: TokenAudit | None = None
    # None when the tool-call audit did not run (no tool executions logged).
    tools: ToolAudit | None = None
    # None when the sandbox audit did not run (no restored sandbox logged).
    sandboxes: SandboxAudit | None = None
    # None when the egress audit did not run (no opaque agent's record logged).
    egress: EgressAudit | None = None

    @property
    def line(self) -> str:
        return "audit: passed" if self.passed else f"audit: FAILED: {self.reason}"


class _AuditFailure(Exception):
    pass


def audit(
    log: EventLog,
    verifier: Sequence[VerifierEntry],
    *,
    group_size: int,
    expected_steps: int | None = None,
    groups_per_step: int | None = None,
    generations: Sequence[GenerationEntry] = (),
    executions: Sequence[ExecutionEntry] = (),
    sandboxes: Sequence[SandboxEntry] = (),
) -> AuditResult:
    """The exactly-once audit of a finished run (see the module docstring).

    ``expected_steps`` and ``groups_per_step``, when given, are checked too: a run that
    stops early or trains short steps is not the run that was asked for. With
    ``generations`` (the policy's log) and the trained turns in the train steps, the
    token audit runs too; with ``executions`` (the resources servers' logs), the
    tool-call audit; with ``sandboxes`` (restored sandboxes logged), the sandbox audit.
    """
    try:
        lineage = effective_lineage(log)
    except LineageError as error:
        return AuditResult(False, str(error))
    try:
        _check_finished(log, lineage, expected_steps)
        groups = _check_groups(lineage, groups_per_step)
        rollouts = _check_rollouts(log, lineage, group_size)
        _check_rewards(lineage, verifier)
        tokens = _check_tokens(log, lineage, generations)
        tools = _check_tool_calls(lineage, verifier, executions)
        restored = _check_sandboxes(sandboxes)
        egress = _check_egress(log, lineage)
    except _AuditFailure as failure:
        return AuditResult(False, str(failure), rolled_back_steps=len(lineage.rolled_back))
    return AuditResult(
        True,
        None,
        steps=len(lineage.steps),
        groups=groups,
        rollouts=rollouts,
        rolled_back_steps=len(lineage.rolled_back),
        tokens=tokens,
        tools=tools,
        sandboxes=restored,
        egress=egress,
    )


def _check_egress(log: EventLog, lineage: Lineage) -> EgressAudit | None:
    """The egress audit (module docstring); None when no relay record was logged."""
    records = {result.key: result.egress for result in log.rollouts if result.egress is not None}
    if not records:
        return None
    dispositions: Counter[str] = Counter()
    rollouts = replayed = reruns = 0
    for step in lineage.steps:
        for sample in step.rollouts:
            record = records.get(sample.key)
            if record is None:
                raise _AuditFailure(
                    f"rollout {sample.rollout_id} attempt {sample.attempt} was trained but its "
                    "agent logged no relay record of it"
                )
            name = f"rollout {sample.rollout_id} attempt {sample.attempt}"
            calls = record.get("calls")
            if not isinstance(calls, dict):
                raise _AuditFailure(f"the relay record of {name} has no calls")
            unsettled = sorted(c for c, d in calls.items() if d not in _FINAL_DISPOSITIONS)
            if unsettled:
                raise _AuditFailure(
                    f"calls {_few(unsettled)} of {name} ended without a final disposition"
                )
            rerun = len(record.get("reruns") or [])
            if sample.turns is not None:
                for kind, what in (("c", "model"), ("t", "tool")):
                    done = sum(
                        1
                        for call, d in calls.items()
                        if d == "completed" and call.partition("-")[2].startswith(kind)
                    )
                    turns = len(sample.turns)
                    if done < turns or (not rerun and done != turns):
                        raise _AuditFailure(
                            f"{name} trained {turns} turns but its relay completed {done} "
                            f"{what} calls"
                        )
            dispositions.update(calls.values())
            replayed += int(record.get("replayed", 0))
            reruns += rerun
            rollouts += 1
    return EgressAudit(rollouts, dict(dispositions), replayed, reruns)


def _check_finished(log: EventLog, lineage: Lineage, expected_steps: int | None) -> None:
    if not log.starts:
        raise _AuditFailure("the trainer logged no start event")
    last = max(start.incarnation for start in log.starts)
    done = [d for d in log.dones if d.incarnation == last]
    if not done:
        raise _AuditFailure(f"the run did not finish: incarnation {last} logged no done event")
    if done[-1].step != len(lineage.steps):
        raise _AuditFailure(
            f"the done event says step {done[-1].step} but the effective lineage has "
            f"{len(lineage.steps)} steps"
        )
    if expected_steps is not None and len(lineage.steps) != expected_steps:
        raise _AuditFailure(
            f"the run trained {len(lineage.steps)} effective steps, not the {expected_steps} asked for"
        )


def _check_groups(lineage: Lineage, groups_per_step: int | None) -> int:
    trained_in: dict[int, int] = {}
    for step in lineage.steps:
        if groups_per_step is not None and len(step.groups) != groups_per_step:
            raise _AuditFailure(
                f"step {step.step} trained {len(step.groups)} prompt groups, not the "
                f"{groups_per_step} per step asked for"
            )
        for group in step.groups:
            if group in trained_in:
                where = (
                    f"step {step.step}"
                    if trained_in[group] == step.step
                    else f"steps {trained_in[group]} and {step.step}"
                )
                raise _AuditFailure(f"prompt group {group} was trained twice ({where})")
            trained_in[group] = step.step
    missing = sorted(set(range(len(trained_in))) - set(trained_in))
    if missing:
        which = f"group {missing[0]} was" if len(missing) == 1 else f"groups {_few(missing)} were"
        raise _AuditFailure(
            f"prompt {which} never trained, though groups up to {max(trained_in)} were"
        )
    return len(trained_in)


def _index_rollouts(log: EventLog) -> dict[tuple[str, int], list[RolloutResult]]:
    recorded: dict[tuple[str, int], list[RolloutResult]] = defaultdict(list)
    for result in log.rollouts:
        recorded[result.key].append(result)
    return recorded


def _recording_seen_by(
    recordings: Sequence[RolloutResult], step: TrainStep
) -> RolloutResult | None:
    """The latest recording of an attempt that the step could have trained on.

    The same attempt may be recorded by two incarnations: once in a stretch a restore
    rolled back, and again after it (an attempt that had not started when the snapshot
    was cut starts under the same number). The step trained on the one its own
    incarnation recorded before it, else on one an earlier incarnation handed over.
    """
    visible = [
        r
        for r in recordings
        if r.incarnation < step.incarnation or (r.incarnation == step.incarnation and r.t <= step.t)
    ]
    return max(visible, key=lambda r: (r.incarnation, r.t), default=None)


def _check_rollouts(log: EventLog, lineage: Lineage, group_size: int) -> int:
    recorded = _index_rollouts(log)
    step_of_key: dict[tuple[str, int], int] = {}
    trained_attempt: dict[str, tuple[int, int]] = {}
    siblings: dict[int, dict[int, str]] = defaultdict(dict)
    for step in lineage.steps:
        groups = set(step.groups)
        for sample in step.rollouts:
            name = f"rollout {sample.rollout_id} attempt {sample.attempt}"
            if sample.key in step_of_key:
                raise _AuditFailure(
                    f"{name} was counted twice (steps {step_of_key[sample.key]} and {step.step})"
                )
            if sample.rollout_id in trained_attempt:
                attempt, first = trained_attempt[sample.rollout_id]
                raise _AuditFailure(
                    f"rollout {sample.rollout_id} was trained twice: attempt {attempt} in "
                    f"step {first} and attempt {sample.attempt} in step {step.step}"
                )
            step_of_key[sample.key] = step.step
            trained_attempt[sample.rollout_id] = (sample.attempt, step.step)
            result = _recording_seen_by(recorded.get(sample.key, ()), step)
            if result is None:
                raise _AuditFailure(
                    f"{name} was trained in step {step.step} but the trainer never recorded it"
                )
            if result.group not in groups:
                raise _AuditFailure(
                    f"{name} belongs to prompt group {result.group}, which step {step.step} "
                    "does not list"
                )
            if abs(result.reward - sample.reward) > REWARD_TOLERANCE:
                raise _AuditFailure(
                    f"{name} was recorded with reward {result.reward!r} but trained with "
                    f"{sample.reward!r} in step {step.step}"
                )
            if result.sibling in siblings[result.group]:
                other = siblings[result.group][result.sibling]
                raise _AuditFailure(
                    f"prompt group {result.group} sibling {result.sibling} was counted twice "
                    f"({other} and {name})"
                )
            siblings[result.group][result.sibling] = name
        for group in step.groups:
            have = set(siblings[group])
            expected = set(range(group_size))
            if have != expected:
                lost = sorted(expected - have)
                extra = sorted(have - expected)
                detail = f"lost siblings {_few(lost)}" if lost else ""
                if extra:
                    detail += ("; " if detail else "") + f"unexpected siblings {_few(extra)}"
                raise _AuditFailure(
                    f"prompt group {group} was trained in step {step.step} with "
                    f"{len(have)} of {group_size} siblings ({detail})"
                )
        if step.rollouts:
            mean = sum(s.reward for s in step.rollouts) / len(step.rollouts)
            if abs(mean - step.mean_reward) > _MEAN_TOLERANCE:
                raise _AuditFailure(
                    f"step {step.step} logs mean reward {step.mean_reward!r} but its rollouts "
                    f"average {mean!r}"
                )
    return len(step_of_key)


def _check_rewards(lineage: Lineage, verifier: Sequence[VerifierEntry]) -> None:
    """Each trained reward is one a verifier returned for that rollout: by the trained
    attempt, or by an earlier one whose recorded verdict the trained attempt, continuing
    its session, was answered with (docs/spec.md section 6.12)."""
    returned: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for entry in verifier:
        returned[entry.rollout_id].append((entry.attempt, entry.reward))
    for step in lineage.steps:
        for sample in step.rollouts:
            name = f"rollout {sample.rollout_id} attempt {sample.attempt}"
            rewards = [
                reward
                for attempt, reward in returned.get(sample.rollout_id, ())
                if attempt <= sample.attempt
            ]
            if not rewards:
                raise _AuditFailure(
                    f"{name} was trained in step {step.step} but no verifier returned a "
                    "reward for it"
                )
            if not any(abs(r - sample.reward) <= REWARD_TOLERANCE for r in rewards):
                raise _AuditFailure(
                    f"{name} was trained with reward {sample.reward!r} but the verifier "
                    f"returned {_few(rewards)}"
                )


def _check_sandboxes(sandboxes: Sequence[SandboxEntry]) -> SandboxAudit | None:
    """The sandbox audit (module docstring); None when no restored sandbox was logged."""
    if not sandboxes:
        return None
    for entry in sandboxes:
        if entry.restored_digest != entry.cut_digest:
            raise _AuditFailure(
                f"sandbox {entry.sandbox} of rollout {entry.rollout_id} attempt "
                f"{entry.attempt} was restored as generation {entry.generation} with tree "
                f"{entry.restored_digest[:12]}, but its snapshot recorded "
                f"{entry.cut_digest[:12]} at the cut"
            )
    said = dict.fromkeys(entry.processes for entry in sandboxes if entry.processes)
    return SandboxAudit(len(sandboxes), tuple(said))


def _check_tool_calls(
    lineage: Lineage, verifier: Sequence[VerifierEntry], executions: Sequence[ExecutionEntry]
) -> ToolAudit | None:
    """The tool-call audit (module docstring); None when no execution was logged."""
    if not executions:
        return None
    by_id: dict[str, ExecutionEntry] = {}
    for entry in executions:
        if entry.execution in by_id:
            raise _AuditFailure(f"tool execution {entry.execution} was logged twice")
        by_id[entry.execution] = entry
    histories: dict[str, list[VerifierEntry]] = defaultdict(list)
    for verdict in verifier:
        if verdict.executions is not None:
            histories[verdict.rollout_id].append(verdict)
    executed = from_record = unaudited = 0
    for step in lineage.steps:
        for sample in step.rollouts:
            name = f"rollout {sample.rollout_id} attempt {sample.attempt}"
            scored = [
                v
                for v in histories.get(sample.rollout_id, ())
                if v.attempt <= sample.attempt and abs(v.reward - sample.reward) <= REWARD_TOLERANCE
            ]
            if not scored:
                unaudited += 1
                continue
            history = _session_history(scored, sample, by_id)
            applied: dict[int, ExecutionEntry] = {}
            for execution_id in history:
                logged = by_id.get(execution_id)
                if logged is None:
                    raise _AuditFailure(
                        f"the session of {name} applied tool execution {execution_id}, "
                        "which no resources server logged"
                    )
                entry = logged
                if entry.rollout_id != sample.rollout_id or entry.attempt > sample.attempt:
                    raise _AuditFailure(
                        f"the session of {name} applied tool execution {execution_id} of "
                        f"rollout {entry.rollout_id} attempt {entry.attempt}"
                    )
                twice = applied.get(entry.turn)
                if twice is not None:
                    raise _AuditFailure(
                        f"turn {entry.turn} of {name} (trained in step {step.step}) was "
                        f"applied twice: executions {twice.execution} (attempt "
                        f"{twice.attempt}) and {entry.execution} (attempt {entry.attempt}) "
                        "are both in its session's history"
                    )
                applied[entry.turn] = entry
            executed += len(applied)
            turns = sample.turns
            if turns is None or any(turn.reply is None for turn in turns):
                continue
            if sorted(applied) != list(range(len(turns))):
                raise _AuditFailure(
                    f"{name} trained {len(turns)} turns but its session applied the calls "
                    f"of turns {sorted(applied)}"
                )
            for index, turn in enumerate(turns):
                ran = applied[index]
                if turn.reply != ran.reply:
                    raise _AuditFailure(
                        f"turn {index} of {name} was trained with the reply {turn.reply!r} "
                        f"but the tool's execution {ran.execution} replied {ran.reply!r}"
                    )
                if turn.answered_in is not None and turn.answered_in > ran.attempt:
                    from_record += 1
    return ToolAudit(executed, from_record, unaudited)


def _session_history(
    scored: Sequence[VerifierEntry], sample: TrainedRollout, by_id: Mapping[str, ExecutionEntry]
) -> tuple[str, ...]:
    """The executions of the verdict ``sample`` was trained with: the newest attempt's.
    A job restart can run the same attempt again (a rollout its snapshot did not hold
    starts over under the same attempt), with the same reward by chance: of several
    verdicts of that attempt, the one whose replies are the trained turns' (else the
    first logged, which the reply check then reports)."""
    newest = max(v.attempt for v in scored)
    verdicts = [v for v in scored if v.attempt == newest]
    trained = [turn.reply for turn in sample.turns or ()]
    for verdict in verdicts:
        replies: dict[int, str | None] = {}
        for execution_id in verdict.executions or ():
            entry = by_id.get(execution_id)
            if entry is not None:
                replies[entry.turn] = entry.reply
        if [replies.get(turn) for turn in range(len(trained))] == trained:
            return verdict.executions or ()
    return verdicts[0].executions or ()


def _check_tokens(
    log: EventLog, lineage: Lineage, generations: Sequence[GenerationEntry]
) -> TokenAudit | None:
    """The token audit (module docstring, items 1-4); None when it cannot run."""
    trained = [sample for step in lineage.steps for sample in step.rollouts]
    if not generations or not trained or any(sample.turns is None for sample in trained):
        return None
    streamed = [g for g in generations if g.tokens]
    trained_attempt = {sample.rollout_id: sample.attempt for sample in trained}
    # Audited: a generation of a trained rollout by the trained attempt or an earlier one.
    by_prompt: dict[tuple[str, tuple[int, ...]], list[GenerationEntry]] = defaultdict(list)
    for entry in streamed:
        if entry.attempt <= trained_attempt.get(entry.rollout_id, -1):
            by_prompt[(entry.rollout_id, entry.prompt)].append(entry)
    used: dict[GenerationEntry, str] = {}
    # Each cut training took, with the prompt of the turn it belongs to.
    cut_turns: list[tuple[GenerationEntry, tuple[int, ...]]] = []
    tokens_trained = cut_continued = cuts = 0
    for step in lineage.steps:
        for sample in step.rollouts:
            for index, turn in enumerate(sample.turns or ()):
                where = (
                    f"turn {index} of rollout {sample.rollout_id} attempt {sample.attempt} "
                    f"(trained in step {step.step})"
                )
                for entry in _tile(by_prompt, sample, turn, used, where):
                    used[entry] = where
                    if entry.cut:
                        cut_turns.append((entry, turn.prompt))
                        cuts += 1
                        cut_continued += len(entry.tokens)
                tokens_trained += len(turn.completion)
    discarded = superseded = retried = not_trained = 0
    for entry in streamed:
        if entry in used:
            continue
        attempt = trained_attempt.get(entry.rollout_id)
        if attempt is None or entry.attempt > attempt:
            not_trained += len(entry.tokens)
        elif _rolled_back(log, entry):
            _check_cut_continued(log, entry, attempt)
            discarded += len(entry.tokens)
        elif entry.attempt < attempt:
            superseded += len(entry.tokens)
        elif entry.cut:
            raise _AuditFailure(_generated_again(entry, used))
        elif (cut := _regenerated_cut(entry, cut_turns)) is not None:
            raise _AuditFailure(
                f"generation {entry.request_id} of rollout {entry.rollout_id} attempt "
                f"{entry.attempt} streamed again the cut prefix of generation "
                f"{cut.request_id}, which training took in {used[cut]}"
            )
        else:
            retried += len(entry.tokens)
    return TokenAudit(
        generated=sum(len(g.tokens) for g in streamed),
        trained=tokens_trained,
        cut_continued=cut_continued,
        cuts=cuts,
        discarded_by_restores=discarded,
        superseded=superseded,
        retried=retried,
        not_trained=not_trained,
    )


def _regenerated_cut(
    entry: GenerationEntry, cut_turns: Sequence[tuple[GenerationEntry, tuple[int, ...]]]
) -> GenerationEntry | None:
    """A cut training took whose prefix ``entry`` streamed again: asked after the cut
    ended, for the same turn, from a point before the cut's last token."""
    for cut, turn_prompt in cut_turns:
        reached = cut.prompt + cut.tokens
        if (
            cut.rollout_id == entry.rollout_id
            and cut.t_end <= entry.t_start
            and len(turn_prompt) <= len(entry.prompt) < len(reached)
            and reached[: len(entry.prompt)] == entry.prompt
            and entry.prompt[: len(turn_prompt)] == turn_prompt
        ):
            return cut
    return None


def _tile(
    by_prompt: Mapping[tuple[str, tuple[int, ...]], Sequence[GenerationEntry]],
    sample: TrainedRollout,
    turn: TrainedTurn,
    used: Mapping[GenerationEntry, str],
    where: str,
) -> list[GenerationEntry]:
    """The generations whose tokens make up the turn's completion, in order (item 1)."""
    completion = turn.completion
    chain: list[GenerationEntry] = []
    offset = 0
    while offset < len(completion):
        context = turn.prompt + completion[:offset]
        fitting = []
        for entry in by_prompt.get((sample.rollout_id, context), ()):
            end = offset + len(entry.tokens)
            # A cut is followed by at least one more token; a finished one ends the turn.
            if completion[offset:end] == entry.tokens and (end == len(completion)) == (
                entry.finished
            ):
                fitting.append(entry)
        fresh = [entry for entry in fitting if entry not in used and entry not in chain]
        if not fresh:
            if fitting:
                other = used.get(fitting[-1], where)
                raise _AuditFailure(
                    f"tokens {offset}..{offset + len(fitting[-1].tokens) - 1} of {where} were "
                    f"trained twice: generation {fitting[-1].request_id} is also {other}"
                )
            raise _AuditFailure(
                f"token {offset} of {where} was never streamed by the policy: no generation "
                f"of that rollout asked with the turn's prompt plus the {offset} tokens "
                "before it streamed the tokens trained there"
            )
        # Several fit when a restore's lost work streamed the same tokens before: the
        # latest is the one training took.
        entry = max(fresh, key=lambda e: (e.attempt, e.t_end))
        chain.append(entry)
        offset += len(entry.tokens)
    return chain


def _restore_after(log: EventLog, entry: GenerationEntry) -> tuple[Restore, Snapshot | None] | None:
    """The first restore after the generation began, and the snapshot it went back to."""
    after = [r for r in log.restores if r.t > entry.t_start]
    if not after:
        return None
    restore = min(after, key=lambda r: r.t)
    snapshot = next(
        (
            s
            for s in log.snapshots
            if s.checkpoint_id == restore.checkpoint_id and s.outcome == "published"
        ),
        None,
    )
    return restore, snapshot


def _rolled_back(log: EventLog, entry: GenerationEntry) -> bool:
    """Item 3: begun before a restore, and ended after the snapshot it went back to began
    (so the snapshot cannot have saved all of it)."""
    found = _restore_after(log, entry)
    if found is None:
        return False
    _, snapshot = found
    return snapshot is None or entry.t_end >= snapshot.t_start


def _check_cut_continued(log: EventLog, entry: GenerationEntry, trained_attempt: int) -> None:
    """Item 4: a cut a restored snapshot saved, of a rollout resumed from it, is trained."""
    if not entry.cut or trained_attempt != entry.attempt + 1:
        return
    resumed = any(
        r.rollout_id == entry.rollout_id and r.attempt == trained_attempt and r.resumed
        for r in log.rollouts
    )
    found = _restore_after(log, entry)
    if not resumed or found is None:
        return
    _, snapshot = found
    if snapshot is not None and snapshot.t_start <= entry.t_end <= snapshot.t_end:
        raise _AuditFailure(
            f"the cut prefix of generation {entry.request_id} (rollout "
            f"{entry.rollout_id} attempt {entry.attempt}, {len(entry.tokens)} tokens) was "
            f"saved by snapshot {snapshot.checkpoint_id} but attempt {trained_attempt}, "
            "resumed from it, did not continue it"
        )


def _generated_again(entry: GenerationEntry, used: Mapping[GenerationEntry, str]) -> str:
    name = (
        f"generation {entry.request_id} of rollout {entry.rollout_id} attempt "
        f"{entry.attempt} ({len(entry.tokens)} tokens)"
    )
    end = entry.prompt + entry.tokens
    for other, where in used.items():
        if (
            other.rollout_id == entry.rollout_id
            and other.t_start >= entry.t_end
            and len(other.prompt) < len(end)
            and end[: len(other.prompt)] == other.prompt
        ):
            kind = "its cut prefix" if entry.cut else "its tokens"
            return (
                f"{name} was streamed but never trained: {kind} was generated again by "
                f"generation {other.request_id}, trained in {where}"
            )
    return f"{name} was streamed but never trained, and no restore discarded it"


def _few(items: Sequence[Any], limit: int = 5) -> str:
    shown = ", ".join(repr(i) if isinstance(i, float) else str(i) for i in items[:limit])
    return f"{shown}, ... ({len(items)} in all)" if len(items) > limit else shown


# ---------------------------------------------------------------------- the report


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class SnapshotSummary:
    attempted: int
    published: int
    failed: int
    skipped: int
    failure_reasons: tuple[tuple[str, int], ...]
    admission_closed_p50_s: float | None
    admission_closed_p99_s: float | None


@dataclass(frozen=True, slots=True)
class HealSummary:
    """One fault healed in place: the rollouts restored of those running then."""

    lost: str
    restored: int
    running: int


@dataclass(frozen=True, slots=True)
class RecoverySummary:
    crashes: int
    # Job restarts: the trainer and every participant started again.
    restarts: int
    restored_from: tuple[str, ...]
    resumed_from_turn: int
    rerun_from_prompt: int
    groups_retried_whole: int
    restore_seconds: tuple[float, ...]
    # Participants the supervisor replaced in place, and each heal's cost.
    participants_replaced: int = 0
    heals: tuple[HealSummary, ...] = ()
    # Trainer restarts: the trainer alone started again, restored into the participants
    # that kept running (docs/spec.md section 7.11 item 3), none of them restarted.
    trainer_restarts: int = 0

    @property
    def restored_per_running(self) -> float | None:
        """Rollouts restored per rollout running, over every heal (None: no heal)."""
        running = sum(h.running for h in self.heals)
        if not self.heals:
            return None
        return sum(h.restored for h in self.heals) / running if running else 0.0


@dataclass(frozen=True, slots=True)
class RewardSummary:
    window: int
    first_mean: float | None
    last_mean: float | None


@dataclass(frozen=True, slots=True)
class DemoReport:
    snapshots: SnapshotSummary
    recovery: RecoverySummary
    rewards: RewardSummary
    rollouts_recorded: int
    effective_steps: int
    rolled_back_steps: int
    audit: AuditResult

    @property
    def exit_status(self) -> int:
        return 0 if self.audit.passed else 1


def _trainer_only(event: SupervisorEvent) -> bool:
    """A ``restart`` that started the trainer alone (``participants_restarted`` 0)."""
    return event.detail.get("participants_restarted") == 0


def _snapshot_summary(snapshots: Sequence[Snapshot]) -> SnapshotSummary:
    attempted = [s for s in snapshots if s.attempted]
    failed = [s for s in attempted if s.outcome == "failed"]
    reasons = Counter(s.reason or "unknown" for s in failed)
    closed = [s.admission_closed_s for s in attempted if s.admission_closed_s is not None]
    return SnapshotSummary(
        attempted=len(attempted),
        published=sum(1 for s in attempted if s.outcome == "published"),
        failed=len(failed),
        skipped=sum(1 for s in snapshots if s.outcome == "skipped"),
        failure_reasons=tuple(sorted(reasons.items())),
        admission_closed_p50_s=percentile(closed, 50),
        admission_closed_p99_s=percentile(closed, 99),
    )


def _reward_summary(steps: Sequence[TrainStep]) -> RewardSummary:
    if not steps:
        return RewardSummary(0, None, None)
    # A fifth of the run at each end: enough steps to smooth the noise of one batch.
    window = max(1, len(steps) // 5)
    first = [s.mean_reward for s in steps[:window]]
    last = [s.mean_reward for s in steps[-window:]]
    return RewardSummary(window, sum(first) / len(first), sum(last) / len(last))


def build_report(
    logs: RunLogs,
    *,
    group_size: int,
    expected_steps: int | None = None,
    groups_per_step: int | None = None,
) -> DemoReport:
    events = logs.events
    result = audit(
        events,
        logs.verifier,
        group_size=group_size,
        expected_steps=expected_steps,
        groups_per_step=groups_per_step,
        generations=logs.generations,
        executions=logs.executions,
        sandboxes=logs.sandboxes,
    )
    try:
        lineage = effective_lineage(events)
    except LineageError:
        lineage = Lineage((), ())
    recovery = RecoverySummary(
        crashes=sum(1 for e in logs.supervisor if e.type == "crash"),
        restarts=sum(1 for e in logs.supervisor if e.type == "restart" and not _trainer_only(e)),
        trainer_restarts=sum(
            1 for e in logs.supervisor if e.type == "restart" and _trainer_only(e)
        ),
        restored_from=tuple(r.checkpoint_id for r in events.restores),
        resumed_from_turn=sum(r.resumed_from_turn for r in events.restores),
        rerun_from_prompt=sum(r.rerun_from_prompt for r in events.restores),
        groups_retried_whole=sum(r.groups_retried_whole for r in events.restores),
        restore_seconds=tuple(r.seconds for r in events.restores),
        participants_replaced=sum(1 for e in logs.supervisor if e.type == "replaced"),
        heals=tuple(HealSummary(h.lost, h.restored, h.running) for h in events.heals),
    )
    return DemoReport(
        snapshots=_snapshot_summary(events.snapshots),
        recovery=recovery,
        rewards=_reward_summary(lineage.steps),
        rollouts_recorded=len({r.key for r in events.rollouts}),
        effective_steps=len(lineage.steps),
        rolled_back_steps=len(lineage.rolled_back),
        audit=result,
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_report(
    report: DemoReport,
    console: Console,
    *,
    timeline: Path | None = None,
    warnings: Sequence[str] = (),
) -> None:
    """Print the report; its last line is ``audit: passed`` or ``audit: FAILED: ...``."""
    table = Table(title="turnpoint demo", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    snaps = report.snapshots
    table.add_row(
        "training steps", f"{report.effective_steps} ({report.rolled_back_steps} rolled back)"
    )
    table.add_row("rollouts recorded", str(report.rollouts_recorded))
    table.add_row(
        "snapshots",
        f"{snaps.attempted} attempted, {snaps.published} published, {snaps.failed} failed, "
        f"{snaps.skipped} skipped",
    )
    if snaps.failure_reasons:
        table.add_row(
            "snapshot failures",
            ", ".join(f"{reason} x{count}" for reason, count in snaps.failure_reasons),
        )
    table.add_row(
        "admission closed",
        f"p50 {_seconds(snaps.admission_closed_p50_s)}, p99 {_seconds(snaps.admission_closed_p99_s)}",
    )
    recovery = report.recovery
    table.add_row("crashes / job restarts", f"{recovery.crashes} / {recovery.restarts}")
    table.add_row(
        "trainer restarts",
        f"{recovery.trainer_restarts} (participants restarted: 0)"
        if recovery.trainer_restarts
        else "0",
    )
    table.add_row("participants replaced", str(recovery.participants_replaced))
    if recovery.heals:
        table.add_row(
            "healed in place",
            ", ".join(f"{h.lost}: {h.restored} of {h.running} restored" for h in recovery.heals)
            + "; every other rollout kept running",
        )
    if recovery.restored_from:
        table.add_row(
            "restored from",
            ", ".join(
                f"{cid} ({seconds:.2f} s)"
                for cid, seconds in zip(
                    recovery.restored_from, recovery.restore_seconds, strict=True
                )
            ),
        )
    table.add_row(
        "rollouts after restore",
        f"{recovery.resumed_from_turn} resumed from a saved turn, "
        f"{recovery.rerun_from_prompt} rerun from the prompt",
    )
    table.add_row("groups retried whole", str(recovery.groups_retried_whole))
    rewards = report.rewards
    table.add_row(
        "mean reward",
        f"{_reward(rewards.first_mean)} (first {rewards.window} steps) -> "
        f"{_reward(rewards.last_mean)} (last {rewards.window} steps)",
    )
    if report.audit.passed:
        table.add_row(
            "exactly once",
            f"{report.audit.groups} prompt groups, {report.audit.rollouts} rollouts, "
            "each trained once with the verifier's reward",
        )
    console.print(table)
    for warning in warnings:
        console.print(Text(f"warning: {warning}", style="yellow"), soft_wrap=True)
    if timeline is not None:
        console.print(Text(f"timeline: {timeline}"), soft_wrap=True)
    if report.audit.tokens is not None:
        console.print(Text(report.audit.tokens.line), soft_wrap=True)
    if report.audit.tools is not None:
        console.print(Text(report.audit.tools.line), soft_wrap=True)
    if report.audit.egress is not None:
        console.print(Text(report.audit.egress.line), soft_wrap=True)
    if report.audit.sandboxes is not None:
        console.print(Text(report.audit.sandboxes.line), soft_wrap=True)
    style = "bold green" if report.audit.passed else "bold red"
    console.print(Text(report.audit.line, style=style), soft_wrap=True)
