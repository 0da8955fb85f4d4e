"""Prometheus metrics of the trainer-side coordinator (docs/spec.md section 7.10).

Every metric lives on a :class:`~prometheus_client.CollectorRegistry` the caller passes
in, never on the process-global one: tests, and several coordinators in one process
(two training runs, a restore next to a live run), would otherwise collide on metric
names or read each other's counts.

Labels stay low-cardinality on purpose: participant *kinds*, not instance names (a run
can have hundreds of instances), and reasons from closed enums.

Snapshot durations come from the attempts themselves: :meth:`CoordinatorMetrics.on_transition`
subscribes to every attempt's transitions (``SnapshotDriver(metrics=...)`` does it) and
observes each phase and the total when the attempt ends, so the phases add up to the
total by construction. Counts by outcome and reason, participant-seconds and the
admission-closed time (dispatch may reopen between transitions, once a cut's books are
read) come from the attempt's report (:meth:`observe_snapshot`); retries
of a failed attempt from the driver as it takes one up (:meth:`retried_snapshot`).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram

from turnpoint.trainer.snapshots.attempt import PhaseTimes, SnapshotState

# Control calls take milliseconds on loopback and up to a minute when a prepare waits
# for slow work; snapshots take seconds to many minutes.
_CALL_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Attempts under way whose times are kept; more only happen if attempts are cancelled.
_ATTEMPTS_TRACKED: Final = 16
_SNAPSHOT_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class CoordinatorMetrics:
    """The coordinator's counters and histograms, registered on ``registry``.

    ``namespace`` prefixes every name (``turnpoint_...`` by default).
    """

    def __init__(self, registry: CollectorRegistry, *, namespace: str = "turnpoint") -> None:
        self.registry = registry
        self.operation_seconds = Histogram(
            "control_operation_seconds",
            "Duration of one control call to one participant",
            ["operation", "kind", "outcome"],
            namespace=namespace,
            registry=registry,
            buckets=_CALL_BUCKETS,
        )
        self.snapshot_seconds = Histogram(
            "snapshot_seconds",
            "Duration of one snapshot attempt, by outcome",
            ["outcome"],
            namespace=namespace,
            registry=registry,
            buckets=_SNAPSHOT_BUCKETS,
        )
        self.snapshot_phase_seconds = Histogram(
            "snapshot_phase_seconds",
            "Time one snapshot attempt spent in each phase; the phases add up to the total",
            ["phase"],
            namespace=namespace,
            registry=registry,
            buckets=_SNAPSHOT_BUCKETS,
        )
        self.admission_closed_seconds = Counter(
            "admission_closed_seconds",
            "Seconds the trainer kept rollout dispatch closed for snapshots",
            namespace=namespace,
            registry=registry,
        )
        self.participant_seconds = Counter(
            "participant_closed_seconds",
            "Participant-seconds of closed admission caused by snapshots "
            "(participants times the time they were held)",
            namespace=namespace,
            registry=registry,
        )
        self.snapshots = Counter(
            "snapshots",
            "Snapshot attempts by outcome (published, skipped, failed) and failure reason",
            ["outcome", "reason"],
            namespace=namespace,
            registry=registry,
        )
        self.refusals = Counter(
            "control_refusals",
            "Control calls a participant refused, by protocol reason",
            ["operation", "reason"],
            namespace=namespace,
            registry=registry,
        )
        self.lease_expiries = Counter(
            "lease_expiries",
            "Checkpoints a participant finished on its own because its lease ran out",
            namespace=namespace,
            registry=registry,
        )
        self.prepare_not_ready = Counter(
            "prepare_not_ready",
            "Prepare answers that were not ready (PREPARING with blockers)",
            ["kind"],
            namespace=namespace,
            registry=registry,
        )
        self.unacknowledged_resolved = Counter(
            "unacknowledged_resolved",
            "Unacknowledged completions a prepare reported, by what the trainer decided",
            ["decision"],
            namespace=namespace,
            registry=registry,
        )
        self.rollouts_restored = Counter(
            "rollouts_restored",
            "Unfinished rollouts after a restore: resumed from a saved turn, or rerun",
            ["how"],
            namespace=namespace,
            registry=registry,
        )
        self.groups_retried_whole = Counter(
            "groups_retried_whole",
            "Prompt groups rerun whole after a restore",
            namespace=namespace,
            registry=registry,
        )
        self.sealed_siblings_discarded = Counter(
            "sealed_siblings_discarded",
            "Finished siblings dropped from the queue because their group is rerun whole",
            namespace=namespace,
            registry=registry,
        )
        self.snapshot_retries = Counter(
            "snapshot_retries",
            "Failed snapshot attempts retried: under the same id (no participant saw it) "
            "or under a new one (the failed id was finished first)",
            ["how"],
            namespace=namespace,
            registry=registry,
        )
        self.release_failures = Counter(
            "release_failures",
            "Participants a snapshot could not release (resume) after publication",
            namespace=namespace,
            registry=registry,
        )
        # Attempts under way, by id: their phase times so far.
        self._attempts: dict[str, PhaseTimes] = {}

    # -- recording helpers -------------------------------------------------------------

    def observe_call(self, operation: str, kind: str, outcome: str, seconds: float) -> None:
        self.operation_seconds.labels(operation, kind, outcome).observe(max(seconds, 0.0))

    def refused(self, operation: str, reason: str) -> None:
        self.refusals.labels(operation, reason).inc()

    def on_transition(
        self, attempt_id: str, old: SnapshotState, new: SnapshotState, now: float
    ) -> None:
        """A snapshot attempt's transition (a :class:`SnapshotDriver` subscriber)."""
        if old is SnapshotState.NEW:
            self._attempts[attempt_id] = PhaseTimes(now)
            while len(self._attempts) > _ATTEMPTS_TRACKED:
                # An attempt that never ended (cancelled with its task): forget it.
                del self._attempts[next(iter(self._attempts))]
        times = self._attempts.get(attempt_id)
        if times is None:
            return  # subscribed mid-attempt: its times are incomplete, leave them out
        times.record(old, new, now)
        if not new.final:
            return
        del self._attempts[attempt_id]
        self.snapshot_seconds.labels(new.value).observe(max(times.total_s, 0.0))
        for phase, seconds in times.phases.items():
            self.snapshot_phase_seconds.labels(phase.value).observe(max(seconds, 0.0))

    def retried_snapshot(self, *, same_id: bool) -> None:
        """An attempt that retries a failed one (the pump handed its id back)."""
        self.snapshot_retries.labels("same_id" if same_id else "new_id").inc()

    def observe_snapshot(
        self,
        *,
        outcome: str,
        reason: str,
        participant_seconds: float,
        admission_closed_s: float = 0.0,
    ) -> None:
        """What only an attempt's report knows: why it failed, for how many, and how
        long dispatch was closed."""
        self.snapshots.labels(outcome, reason).inc()
        self.participant_seconds.inc(max(participant_seconds, 0.0))
        self.admission_closed_seconds.inc(max(admission_closed_s, 0.0))

    def observe_restore(
        self,
        *,
        resumed: int,
        rerun: int,
        groups_retried_whole: int,
        sealed_siblings_discarded: int,
    ) -> None:
        self.rollouts_restored.labels("resumed").inc(resumed)
        self.rollouts_restored.labels("rerun").inc(rerun)
        self.groups_retried_whole.inc(groups_retried_whole)
        self.sealed_siblings_discarded.inc(sealed_siblings_discarded)
