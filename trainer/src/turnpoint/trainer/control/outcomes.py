"""What coordinated operations report: the errors they raise and the reports they return.

An operation either raises (prepare, commit, restore: :class:`OperationFailed` and its
kinds, naming every participant that failed and why) or reports failures instead of
raising them (resume, retire, forget, renew: :class:`ControlReport`). Classification
follows docs/spec.md section 7.5.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.trainer.control.failures import Failure, FailureKind
from turnpoint.trainer.control.fanout import FanoutError
from turnpoint.trainer.snapshots.core import PrepareVerdict
from turnpoint.v1 import types_pb2


class OperationFailed(FanoutError):
    """One coordinated operation failed on one or more participants.

    ``key`` is the checkpoint or restore id (or the content key of a retire). The
    ``transient`` property (from :class:`FanoutError`) says whether trying again may
    succeed: not-ready or infrastructure failures only (docs/spec.md section 7.5).
    """

    def __init__(self, operation: str, key: str, failures: Mapping[str, Failure]) -> None:
        super().__init__(operation, failures)
        self.key = key
        self.args = (f"{key}: {self.args[0]}",)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.operation, self.key, self.failures))

    @property
    def reasons(self) -> frozenset[Reason]:
        return frozenset(f.reason for f in self.failures.values() if f.reason is not None)


class PrepareFailed(OperationFailed):
    """Not every participant was prepared in time (or one refused).

    ``retire``: attempts the rollout side said must go (unacknowledged completions it no
    longer wants); they can only be retired once the participant is idle again.
    ``release``: the resume that aborted the checkpoint, once :meth:`Coordinator.prepared`
    sent it. ``verdict``: the core's decision (who to resume, why), when the coordinator
    decided it (:func:`~turnpoint.trainer.snapshots.core.decide_prepare`).
    """

    def __init__(
        self,
        checkpoint_id: str,
        failures: Mapping[str, Failure],
        retire: Mapping[str, tuple[EpisodeId, ...]] | None = None,
        verdict: PrepareVerdict | None = None,
        finished_through: int | None = None,
    ) -> None:
        super().__init__("prepare", checkpoint_id, failures)
        self.checkpoint_id = checkpoint_id
        self.retire: dict[str, tuple[EpisodeId, ...]] = dict(retire or {})
        self.verdict = verdict
        self.release: ControlReport | None = None
        # The highest sequence of this id's prefix some participant that refused it
        # STALE_CHECKPOINT has finished (docs/spec.md section 7.2 item 4), if probed.
        self.finished_through = finished_through

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.checkpoint_id, self.failures, self.retire, self.verdict, self.finished_through),
        )

    @property
    def not_ready(self) -> frozenset[str]:
        return frozenset(
            name for name, failure in self.failures.items() if failure.kind is FailureKind.NOT_READY
        )


class CommitFailed(OperationFailed):
    def __init__(self, checkpoint_id: str, failures: Mapping[str, Failure]) -> None:
        super().__init__("commit", checkpoint_id, failures)
        self.checkpoint_id = checkpoint_id

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.checkpoint_id, self.failures))


class RestoreFailed(OperationFailed):
    """A restore failed on at least one participant: its outcome is uncertain everywhere.

    By the time :meth:`Coordinator.restored` raises it, the replacement attempts
    (``replacements``, attempt N+1 of every scoped episode) were retired on every
    participant and every participant was resumed: the caller starts those rollouts over
    from their prompts, with an attempt above the retired one. ``cleanup`` holds what
    failed while cleaning up (each participant's lease reopens it anyway).
    """

    def __init__(
        self,
        restore_id: str,
        failures: Mapping[str, Failure],
        replacements: Iterable[EpisodeId] = (),
        cleanup: Mapping[str, Failure] | None = None,
        seen_since: Mapping[str, int] | None = None,
        replacements_kept: bool = False,
    ) -> None:
        super().__init__("restore", restore_id, failures)
        self.restore_id = restore_id
        self.replacements: tuple[EpisodeId, ...] = tuple(sorted(set(replacements)))
        self.cleanup: dict[str, Failure] = dict(cleanup or {})
        # Every refusal was a running participant's stale scope (docs/spec.md section
        # 4.16 item 3): per rollout, the highest attempt seen there.
        self.seen_since: dict[str, int] | None = None if seen_since is None else dict(seen_since)
        # The replacements were left installed (not retired) for the next round's
        # RestoreRunning, which replaces them: only with ``seen_since``.
        self.replacements_kept = replacements_kept

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (
                self.restore_id,
                self.failures,
                self.replacements,
                self.cleanup,
                self.seen_since,
                self.replacements_kept,
            ),
        )


# ------------------------------------------------------------------------ reports


@dataclass(frozen=True, slots=True)
class ControlReport:
    """The outcome of an operation that reports failures instead of raising them
    (resume, retire, forget): who succeeded, who failed and why."""

    operation: str
    key: str
    succeeded: frozenset[str]
    failures: Mapping[str, Failure]
    durations_s: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_if_failed(self) -> None:
        if self.failures:
            raise OperationFailed(self.operation, self.key, self.failures)

    @staticmethod
    def merge(operation: str, key: str, reports: Iterable[ControlReport]) -> ControlReport:
        succeeded: set[str] = set()
        failures: dict[str, Failure] = {}
        durations: dict[str, float] = {}
        for report in reports:
            succeeded |= report.succeeded
            failures.update(report.failures)
            durations.update(report.durations_s)
        return ControlReport(
            operation,
            key,
            frozenset(succeeded - set(failures)),
            MappingProxyType(failures),
            MappingProxyType(durations),
        )


@dataclass(eq=False)
class PreparedCheckpoint:
    """A checkpoint every participant is prepared for, as :meth:`Coordinator.prepared`
    yields it. ``release`` is set once the context exits (the resume's outcome).
    ``committed_empty``: the instances that committed saved-nothing in their prepare
    (docs/spec.md section 4.6 item 8)."""

    checkpoint_id: str
    readiness: Mapping[str, types_pb2.ReadinessReport]
    restarts: Mapping[str, tuple[EpisodeId, ...]]
    durations_s: Mapping[str, float]
    release: ControlReport | None = None
    renew_failures: dict[str, Failure] = field(default_factory=dict)
    committed_empty: frozenset[str] = frozenset()

    @property
    def all_restarts(self) -> frozenset[EpisodeId]:
        return frozenset(episode for episodes in self.restarts.values() for episode in episodes)


@dataclass(eq=False)
class RestoredCheckpoint:
    """A restore every participant installed, as :meth:`Coordinator.restored` yields it."""

    restore_id: str
    installed: Mapping[str, tuple[EpisodeId, ...]]
    release: ControlReport | None = None
