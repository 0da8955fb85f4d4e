"""The job's checkpoint history as plain state: what the status page and API show.

docs/spec.md section 7.13. :class:`CheckpointHistory` is fed by the events the trainer
already produces and reads no clock: every event carries ``now`` (the monotonic clock
the snapshot driver stamps transitions with); ``wall_offset_s`` turns it into wall time
for people (``wall = now + wall_offset_s``, fixed when the history is made).

- each attempt's transitions (a :class:`~turnpoint.trainer.snapshots.driver.SnapshotDriver`
  subscriber, :meth:`on_transition`): its row, its status, its phases, and whether
  rollout admission is closed right now;
- each control round of a checkpoint (the coordinator's, :meth:`on_calls`): per
  participant its prepare, commit and resume time and its failure;
- what each participant committed (:meth:`on_committed`): bytes, records, episodes;
- each attempt's report (:meth:`on_report`): outcome, reason, detail, who caused it;
- the restore at open (:meth:`on_restore`) and participants lost (:meth:`on_lost`).

It keeps the newest ``keep`` rows; the counts cover the whole process. Rendering is
:meth:`overview`, :meth:`rows_json`, :meth:`get_json`, :meth:`summary` and
:meth:`events_json`, plain JSON values.

Across restarts (docs/spec.md section 7.13.5) the trainer appends what this history
gives it as records (:meth:`started_record`, :meth:`finished_record`,
:meth:`event_record`) to :data:`HISTORY_FILE` under the snapshot root, and the next
process loads them (:meth:`load_past`): earlier processes' rows and events are shown
after this one's, and an attempt that started but never finished (the process ended in
it: a crash) is shown ``interrupted``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from turnpoint.trainer.snapshots.attempt import SnapshotState
from turnpoint.trainer.storage.manifest import JSONValue, ParticipantEntry

if TYPE_CHECKING:
    from turnpoint.trainer.snapshots.report import SnapshotReport

# The control operations whose per-participant times a row keeps (docs/spec.md 7.13.2).
TIMED_OPERATIONS: Final = ("prepare", "commit", "resume")
IN_PROGRESS: Final = "in_progress"
INTERRUPTED: Final = "interrupted"
RESTORED_UNREPORTED: Final = (
    "published, and restored; the trainer that took it ended before it recorded the report"
)
STATUSES: Final = frozenset({IN_PROGRESS, "published", "skipped", "failed", INTERRUPTED})
HISTORY_FILE: Final = "history.jsonl"
"""Under the snapshot root: one record per line (docs/spec.md section 7.13.5)."""
HISTORY_VERSION: Final = 1
_PAST_EVENTS: Final = 200
_S = SnapshotState


@dataclass
class ParticipantTimes:
    """One participant's part of one attempt."""

    seconds: dict[str, float] = field(default_factory=dict)  # operation -> seconds
    answered_at: float | None = None  # monotonic: its latest answer in this attempt
    failure: str | None = None  # "<operation>: <kind>: <detail>"
    bytes_written: int = 0
    records_written: int = 0
    episodes_exported: int = 0
    committed: bool = False


@dataclass
class CheckpointRow:
    """One snapshot attempt (docs/spec.md section 7.13.2)."""

    checkpoint_id: str
    triggered_at: float  # monotonic
    epoch: int = 0
    state: SnapshotState = _S.NEW
    state_since: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    ended_at: float | None = None
    reason: str | None = None
    detail: str = ""
    caused_by: tuple[str, ...] = ()
    retry_of: str | None = None
    continued: int = 0
    restarts: int = 0
    admission_closed_s: float = 0.0
    participants: dict[str, ParticipantTimes] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return self.state.value if self.state.final else IN_PROGRESS

    @property
    def total_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.triggered_at

    @property
    def bytes_written(self) -> int:
        return sum(p.bytes_written for p in self.participants.values())

    @property
    def records_written(self) -> int:
        return sum(p.records_written for p in self.participants.values())

    @property
    def episodes_exported(self) -> int:
        return sum(p.episodes_exported for p in self.participants.values())

    def participant(self, name: str) -> ParticipantTimes:
        return self.participants.setdefault(name, ParticipantTimes())


@dataclass(frozen=True, slots=True)
class RestoreEvent:
    """A restore at open (``checkpoint_id`` None: a fresh start), participants lost, or
    one participant replaced and healed in place (docs/spec.md section 7.15)."""

    kind: str  # "restore" | "fresh_start" | "participants_lost" | "participant_replaced"
    at: float  # monotonic
    epoch: int
    checkpoint_id: str | None = None
    restore_s: float = 0.0
    resumed_rollouts: int = 0
    rerun_rollouts: int = 0
    participants: tuple[str, ...] = ()
    detail: str = ""


class CheckpointHistory:
    """The history of one trainer process (one epoch) of a job; pure, fed by events."""

    def __init__(self, *, wall_offset_s: float, epoch: int = 0, keep: int = 500) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self._wall_offset_s = wall_offset_s
        self.epoch = epoch
        self._keep = keep
        self._rows: OrderedDict[str, CheckpointRow] = OrderedDict()
        self._counts = {"triggered": 0, "published": 0, "skipped": 0, "failed": 0}
        self._latest: dict[str, str] = {}  # status -> checkpoint id
        self.events: list[RestoreEvent] = []
        self.admission_open = True
        self.admission_since: float | None = None
        self._open_attempt: str | None = None
        # Earlier processes' rows (rendered, oldest first) and events.
        self._past: OrderedDict[str, dict[str, JSONValue]] = OrderedDict()
        self._past_events: list[dict[str, JSONValue]] = []

    # -- feeding -------------------------------------------------------------------------

    def on_transition(
        self, attempt_id: str, old: SnapshotState, new: SnapshotState, now: float
    ) -> None:
        """One transition of one attempt (the driver's subscriber signature)."""
        row = self._rows.get(attempt_id)
        if old is _S.NEW or row is None:
            row = CheckpointRow(attempt_id, triggered_at=now, epoch=self.epoch, state_since=now)
            self._rows[attempt_id] = row
            self._rows.move_to_end(attempt_id)
            self._counts["triggered"] += 1
            self._trim()
        if old.is_phase:
            row.phases[old.value] = row.phases.get(old.value, 0.0) + (now - row.state_since)
        row.state = new
        row.state_since = now
        if old is _S.CLOSE:
            self._set_admission(open_=False, now=now)
        elif new is _S.COMMIT or (old is _S.REOPEN and not self.admission_open):
            # Dispatch reopens once the cut's books are read, right before the commit.
            self._set_admission(open_=True, now=now)
        if new.final:
            row.ended_at = now
            self._counts[new.value] += 1
            self._latest[new.value] = attempt_id
            if self._open_attempt == attempt_id:
                self._open_attempt = None
        else:
            self._open_attempt = attempt_id

    def _set_admission(self, *, open_: bool, now: float) -> None:
        if self.admission_open != open_:
            self.admission_open = open_
            self.admission_since = now

    def on_calls(
        self,
        operation: str,
        checkpoint_id: str,
        durations_s: Mapping[str, float],
        failures: Mapping[str, str],
        now: float,
    ) -> None:
        """One control round of ``checkpoint_id``: each participant's seconds and
        failures (described). Rounds of ids with no row (a restore's) are ignored."""
        row = self._rows.get(checkpoint_id)
        if row is None or operation not in TIMED_OPERATIONS:
            return
        for name, seconds in durations_s.items():
            times = row.participant(name)
            times.seconds[operation] = times.seconds.get(operation, 0.0) + max(0.0, seconds)
            if name not in failures:
                times.answered_at = now
        for name, description in failures.items():
            row.participant(name).failure = f"{operation}: {description}"

    def on_committed(self, checkpoint_id: str, entries: Iterable[ParticipantEntry]) -> None:
        row = self._rows.get(checkpoint_id)
        if row is None:
            return
        for entry in entries:
            _commit(row.participant(entry.instance), entry)

    def on_report(self, report: SnapshotReport) -> None:
        row = self._rows.get(report.checkpoint_id)
        if row is None:
            return
        row.reason = report.reason.value if report.reason is not None else None
        row.detail = report.detail
        row.caused_by = tuple(sorted(report.failures))
        row.retry_of = report.retry_of
        row.continued = report.continued
        row.restarts = report.restarts
        row.admission_closed_s = report.admission_closed_s

    def on_restore(
        self,
        *,
        now: float,
        checkpoint_id: str | None,
        restore_s: float = 0.0,
        resumed_rollouts: int = 0,
        rerun_rollouts: int = 0,
        entries: Iterable[ParticipantEntry] = (),
    ) -> None:
        """``entries``: the restored manifest's participants, what the drill-down of a
        snapshot whose report the crash took shows (its manifest is all that is left)."""
        kind = "fresh_start" if checkpoint_id is None else "restore"
        past = self._past.get(checkpoint_id) if checkpoint_id is not None else None
        if past is not None and past.get("status") == INTERRUPTED:
            # What a restore reads was published: the crash took the attempt's report
            # between its publication and the history's write, not the snapshot.
            past["status"] = "published"
            past["detail"] = RESTORED_UNREPORTED
            committed = {e.instance: _commit(ParticipantTimes(), e) for e in entries}
            past["participants"] = {
                name: _participant_json(times) for name, times in sorted(committed.items())
            }
            for measure in ("bytes_written", "records_written", "episodes_exported"):
                past[measure] = sum(getattr(t, measure) for t in committed.values())
        self.events.append(
            RestoreEvent(
                kind,
                now,
                self.epoch,
                checkpoint_id,
                restore_s=restore_s,
                resumed_rollouts=resumed_rollouts,
                rerun_rollouts=rerun_rollouts,
            )
        )

    def on_lost(self, participants: Iterable[str], now: float, detail: str = "") -> None:
        self.events.append(
            RestoreEvent(
                "participants_lost",
                now,
                self.epoch,
                participants=tuple(sorted(participants)),
                detail=detail,
            )
        )

    def on_replaced(
        self,
        participant: str,
        now: float,
        *,
        checkpoint_id: str | None,
        resumed_rollouts: int,
        rerun_rollouts: int,
        untouched_rollouts: int,
    ) -> None:
        """``participant`` was lost and replaced in place: ``resumed_rollouts`` continue
        from ``checkpoint_id``, ``rerun_rollouts`` start over, the others keep running."""
        self.events.append(
            RestoreEvent(
                "participant_replaced",
                now,
                self.epoch,
                checkpoint_id or None,
                resumed_rollouts=resumed_rollouts,
                rerun_rollouts=rerun_rollouts,
                participants=(participant,),
                detail=f"{untouched_rollouts} rollout(s) kept running",
            )
        )

    def _trim(self) -> None:
        while len(self._rows) > self._keep:
            oldest = next(iter(self._rows))
            if oldest == self._open_attempt:
                break
            del self._rows[oldest]

    # -- reading -------------------------------------------------------------------------

    @property
    def open_attempt(self) -> CheckpointRow | None:
        return None if self._open_attempt is None else self._rows.get(self._open_attempt)

    def wall(self, monotonic: float | None) -> float | None:
        return None if monotonic is None else monotonic + self._wall_offset_s

    def get(self, checkpoint_id: str) -> CheckpointRow | None:
        return self._rows.get(checkpoint_id)

    def get_json(self, checkpoint_id: str, *, now: float) -> dict[str, JSONValue] | None:
        """One attempt with its participants: this process's, else an earlier one's."""
        row = self._rows.get(checkpoint_id)
        if row is not None:
            return self.row_json(row, now=now, participants=True)
        past = self._past.get(checkpoint_id)
        return None if past is None else dict(past)

    def overview(self) -> dict[str, JSONValue]:
        restores = [e.checkpoint_id for e in self.events if e.kind == "restore"]
        past_restores = [
            e.get("checkpoint_id") for e in self._past_events if e.get("kind") == "restore"
        ]
        counts: dict[str, int] = dict(self._counts)
        counts[INTERRUPTED] = 0
        for past in self._past.values():
            counts["triggered"] += 1
            status = str(past.get("status"))
            if status in counts:
                counts[status] += 1
        latest: dict[str, JSONValue] = {}
        for status in ("published", "failed", "skipped"):
            found: JSONValue = self._latest.get(status)
            if found is None:
                found = next(
                    (k for k, v in reversed(self._past.items()) if v.get("status") == status),
                    None,
                )
            latest[status] = found
        every_restore = [*past_restores, *restores]
        latest["restored"] = every_restore[-1] if every_restore else None
        shown: dict[str, JSONValue] = dict(counts)
        shown["in_progress"] = 0 if self._open_attempt is None else 1
        shown["restored"] = len(every_restore)
        return {"counts": shown, "latest": latest}

    def rows(self, *, status: str | None = None, limit: int | None = None) -> list[CheckpointRow]:
        """This process's rows, newest first; ``status`` one of :data:`STATUSES`."""
        chosen = [row for row in reversed(self._rows.values()) if status in (None, row.status)]
        return chosen if limit is None else chosen[:limit]

    def rows_json(
        self, *, now: float, status: str | None = None, limit: int | None = None
    ) -> list[dict[str, JSONValue]]:
        """Every row without its participants, newest first: this process's, then the
        earlier ones'."""
        shown = [self.row_json(r, now=now, participants=False) for r in self.rows(status=status)]
        for past in reversed(self._past.values()):
            if status in (None, past.get("status")):
                shown.append({k: v for k, v in past.items() if k != "participants"})
        return shown if limit is None else shown[:limit]

    def row_json(
        self, row: CheckpointRow, *, now: float, participants: bool
    ) -> dict[str, JSONValue]:
        """One row; ``participants`` adds the per-participant drill-down."""
        phases = dict(row.phases)
        if not row.state.final and row.state.is_phase:
            # The phase under way, so far: a live row's phases add up to its age.
            phases[row.state.value] = phases.get(row.state.value, 0.0) + (now - row.state_since)
        answered = [p.answered_at for p in row.participants.values() if p.answered_at is not None]
        out: dict[str, JSONValue] = {
            "checkpoint_id": row.checkpoint_id,
            "epoch": row.epoch,
            "status": row.status,
            "state": row.state.value,
            "reason": row.reason,
            "detail": row.detail,
            "caused_by": list(row.caused_by),
            "retry_of": row.retry_of,
            "triggered_at": self.wall(row.triggered_at),
            "latest_acknowledgement_at": self.wall(max(answered)) if answered else None,
            "ended_at": self.wall(row.ended_at),
            "duration_s": row.total_s if row.total_s is not None else now - row.triggered_at,
            "phases_s": {name: seconds for name, seconds in phases.items()},
            "admission_closed_s": row.admission_closed_s,
            "bytes_written": row.bytes_written,
            "records_written": row.records_written,
            "episodes_exported": row.episodes_exported,
            "continued": row.continued,
            "restarts": row.restarts,
        }
        if participants:
            out["participants"] = {
                name: _participant_json(
                    times,
                    acknowledged_at=self.wall(times.answered_at),
                    caused=name in row.caused_by,
                )
                for name, times in sorted(row.participants.items())
            }
        return out

    def summary(self) -> dict[str, JSONValue]:
        """Minimum, average and maximum over the published rows kept (every process's)."""
        published = [
            row
            for row in self.rows_json(now=0.0, status="published")
            if isinstance(row.get("duration_s"), int | float)
        ]
        measures: dict[str, list[float]] = {
            name: [_number(row.get(name)) for row in published]
            for name in ("duration_s", "admission_closed_s", "bytes_written", "episodes_exported")
        }
        for row in published:
            phases = row.get("phases_s")
            if isinstance(phases, dict):
                for phase, seconds in phases.items():
                    if isinstance(seconds, int | float):
                        measures.setdefault(f"phase_{phase}_s", []).append(float(seconds))
        return {
            "published": len(published),
            "measures": {name: _min_avg_max(values) for name, values in measures.items()},
        }

    def events_json(self) -> list[JSONValue]:
        past: list[JSONValue] = [dict(e) for e in self._past_events]
        return past + [self._event_json(event) for event in self.events]

    def _event_json(self, event: RestoreEvent) -> dict[str, JSONValue]:
        return {
            "kind": event.kind,
            "at": self.wall(event.at),
            "epoch": event.epoch,
            "checkpoint_id": event.checkpoint_id,
            "restore_s": event.restore_s,
            "resumed_rollouts": event.resumed_rollouts,
            "rerun_rollouts": event.rerun_rollouts,
            "participants": list(event.participants),
            "detail": event.detail,
        }

    # -- across restarts -----------------------------------------------------------------

    def started_record(self, checkpoint_id: str) -> dict[str, JSONValue] | None:
        """What to append when an attempt starts: shown interrupted if nothing follows."""
        row = self._rows.get(checkpoint_id)
        if row is None:
            return None
        return {
            "history_version": HISTORY_VERSION,
            "kind": "started",
            "checkpoint_id": checkpoint_id,
            "epoch": row.epoch,
            "triggered_at": self.wall(row.triggered_at),
        }

    def finished_record(self, checkpoint_id: str, *, now: float) -> dict[str, JSONValue] | None:
        """What to append once an attempt's report is in: its row with participants."""
        row = self._rows.get(checkpoint_id)
        if row is None or not row.state.final:
            return None
        return {
            "history_version": HISTORY_VERSION,
            "kind": "checkpoint",
            "checkpoint": self.row_json(row, now=now, participants=True),
        }

    def closed_record(self, *, now: float) -> dict[str, JSONValue]:
        """What to append when the trainer closes cleanly: a process whose last record
        is not this one ended in a crash, a kill or a lost participant."""
        return {
            "history_version": HISTORY_VERSION,
            "kind": "event",
            "event": {"kind": "trainer_closed", "at": self.wall(now), "epoch": self.epoch},
        }

    def event_record(self, event: RestoreEvent) -> dict[str, JSONValue]:
        return {
            "history_version": HISTORY_VERSION,
            "kind": "event",
            "event": self._event_json(event),
        }

    def load_past(self, records: Iterable[object]) -> int:
        """Earlier processes' records, oldest first; what is not a record of this
        version is skipped (a torn last line, a later version). Returns how many were
        taken."""
        taken = 0
        last_epoch: int | None = None
        last_at: JSONValue = None
        closed = False
        for record in records:
            if not isinstance(record, dict) or record.get("history_version") != HISTORY_VERSION:
                continue
            kind = record.get("kind")
            if kind == "started":
                name, epoch = record.get("checkpoint_id"), record.get("epoch")
                if not isinstance(name, str) or not isinstance(epoch, int):
                    continue
                triggered = record.get("triggered_at")
                self._past.pop(name, None)
                self._past[name] = _interrupted(
                    name, epoch, triggered if isinstance(triggered, int | float) else None
                )
            elif kind == "checkpoint":
                row = record.get("checkpoint")
                if not isinstance(row, dict) or not isinstance(row.get("checkpoint_id"), str):
                    continue
                if row.get("status") not in STATUSES:
                    continue
                # An attempt that started keeps its place (where it started).
                self._past[str(row["checkpoint_id"])] = dict(row)
            elif kind == "event":
                event = record.get("event")
                if not isinstance(event, dict):
                    continue
                self._past_events.append(dict(event))
            else:
                continue
            taken += 1
            epoch, at = _epoch_and_time(record)
            if epoch is None:
                continue
            if epoch != last_epoch:
                if last_epoch is not None and not closed:
                    self._past_events.insert(
                        -1 if kind == "event" else len(self._past_events),
                        _ended(last_epoch, last_at),
                    )
                closed = False
            last_epoch, last_at = epoch, at if at is not None else last_at
            closed = closed or (kind == "event" and _kind_of(record) == "trainer_closed")
        if last_epoch is not None and not closed:
            # The last process left no clean close behind it.
            self._past_events.append(_ended(last_epoch, last_at))
        while len(self._past) > self._keep:
            del self._past[next(iter(self._past))]
        del self._past_events[:-_PAST_EVENTS]
        return taken


def _commit(times: ParticipantTimes, entry: ParticipantEntry) -> ParticipantTimes:
    """What one participant committed, as its manifest entry says."""
    times.committed = True
    times.bytes_written = sum(a.size_bytes for a in entry.artifacts) + (
        entry.manifest.size_bytes if entry.manifest is not None else 0
    )
    times.records_written = sum(a.record_count for a in entry.artifacts)
    times.episodes_exported = len(entry.exported)
    return times


def _participant_json(
    times: ParticipantTimes, *, acknowledged_at: float | None = None, caused: bool = False
) -> dict[str, JSONValue]:
    """One participant's drill-down line (one known from a manifest only has no times)."""
    return {
        "prepare_s": times.seconds.get("prepare"),
        "commit_s": times.seconds.get("commit"),
        "resume_s": times.seconds.get("resume"),
        "acknowledged_at": acknowledged_at,
        "failure": times.failure,
        "caused_failure": caused,
        "committed": times.committed,
        "bytes_written": times.bytes_written,
        "records_written": times.records_written,
        "episodes_exported": times.episodes_exported,
    }


def _ended(epoch: int, at: JSONValue) -> dict[str, JSONValue]:
    return {
        "kind": "trainer_ended",
        "at": at,
        "epoch": epoch,
        "detail": f"the trainer of epoch {epoch} ended without closing: a crash, a kill or "
        "a lost participant",
    }


def _kind_of(record: Mapping[str, JSONValue]) -> JSONValue:
    event = record.get("event")
    return event.get("kind") if isinstance(event, dict) else None


def _epoch_and_time(record: Mapping[str, JSONValue]) -> tuple[int | None, JSONValue]:
    """The epoch a record belongs to and its latest time, whatever its kind."""
    inner = record.get("checkpoint") or record.get("event") or record
    if not isinstance(inner, dict):
        return None, None
    epoch = inner.get("epoch")
    at = inner.get("ended_at") or inner.get("at") or inner.get("triggered_at")
    return (epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None), at


def _interrupted(
    checkpoint_id: str, epoch: int, triggered_at: float | None
) -> dict[str, JSONValue]:
    return {
        "checkpoint_id": checkpoint_id,
        "epoch": epoch,
        "status": INTERRUPTED,
        "state": None,
        "reason": None,
        "detail": "the trainer process ended during this attempt (a crash or a kill)",
        "caused_by": [],
        "retry_of": None,
        "triggered_at": triggered_at,
        "latest_acknowledgement_at": None,
        "ended_at": None,
        "duration_s": None,
        "phases_s": {},
        "admission_closed_s": 0.0,
        "bytes_written": 0,
        "records_written": 0,
        "episodes_exported": 0,
        "continued": 0,
        "restarts": 0,
        "participants": {},
    }


def _number(value: JSONValue) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _min_avg_max(values: list[float]) -> JSONValue:
    if not values:
        return None
    total = math.fsum(values)
    return {"min": min(values), "avg": total / len(values), "max": max(values)}
