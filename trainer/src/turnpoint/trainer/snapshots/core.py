"""The coordinator's decisions as plain state: the prepare round and commit scoping.

docs/spec.md section 7.4, steps 4 to 7. Like the participant's core
(:mod:`turnpoint.participant_sdk._core`), nothing here imports asyncio or grpc or reads
a clock: every decision that depends on time takes ``now`` (seconds on the caller's
monotonic scale), and every decision is returned as data with a reason a person can
read (torchft's quorum style). The asyncio drivers (:mod:`turnpoint.trainer.snapshots.preparing`,
:mod:`turnpoint.trainer.control.coordinator`, :mod:`turnpoint.trainer.snapshots.driver`) send, wait and write; they ask this module
what to do next.

The prepare round:

- :class:`ParticipantPrepare` is one participant's side: when to send the next round and
  with what timeout, how long to wait after a not-ready answer, when to give up, and what
  a failure means (a broken session is re-sent, a transient failure after a not-ready
  answer is reported not ready, anything else is reported as it is);
- :class:`UnackedLedger` keeps the unacknowledged completions the participants reported,
  each receipt decided once: acknowledged, or retired after the abort (a participant with
  a completion to retire cannot become ready before a resume: it is hopeless);
- :func:`decide_prepare` turns every participant's outcome into a
  :class:`PrepareVerdict`: commit only if every one is ready; otherwise abort, resuming
  every participant (the ready ones included), retiring the stragglers, and retrying
  only if no failure broke an invariant;
- :class:`RenewalSchedule` says when the leases of an open checkpoint are renewed;
- :class:`FinishedProbe` finds how far a participant that refused a fresh id has
  finished (a Resume of a far-future id), so the next id starts above it.

Commit scoping: :func:`scope_commit` (who commits which episodes; restarts never),
:func:`commit_scope_problem` (a scope the coordinator must refuse),
:func:`exported_problem` (a reply that exported outside its scope),
:func:`attribute_commit` (which episodes continue and which restart) and
:func:`installed_problem` (a restore reply that did not install its scope).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from turnpoint.ids import EpisodeId, sorted_episodes
from turnpoint.trainer.rollouts.side import InFlightRollout, UnackedDecision
from turnpoint.trainer.storage.manifest import PlacedEpisode

# docs/spec.md section 7.4 step 4.
NOT_READY_BACKOFF_S: Final = 0.05
"""A participant that answers not ready at once, without a readiness stream to wait on,
gets its next round after this backoff (doubling up to :data:`NOT_READY_BACKOFF_MAX_S`)."""
NOT_READY_BACKOFF_MAX_S: Final = 1.0
MIN_ROUND_S: Final = 1.0
"""No round starts with less time left than this (or :data:`MIN_ROUND_FRACTION` of the
round timeout, whichever is less): the last not-ready answer stands instead."""
MIN_ROUND_FRACTION: Final = 0.2
WATCH_AFTER_S: Final = 0.25
"""A participant still preparing after this long (or a tenth of the prepare deadline)
gets its readiness stream watched."""
WATCH_AFTER_PER_PARTICIPANT_S: Final = 0.001
"""...or after this long per participant prepared, if that is longer: a fan-out's
answers take longer to come back the more participants it asks, and before they are
back a stream per participant only slows them down. A thousand participants answering
from a few busy processes can leave a quarter of a second without an answer while every
one of them is ready, and a thousand streams opened then more than doubled the prepare."""
SESSION_RETRIES: Final = 2
"""Broken sessions a participant's prepare is re-sent on before it gives up."""


WATCH_QUIET_FRACTION: Final = 1.0
"""Streams wait until the prepare fan-out sent and read nothing for this fraction of
:func:`watch_after_s` (docs/spec.md section 7.4 step 4): as long as a participant may
prepare unwatched. A shorter pause is what a thousand participants answering from a
few busy processes look like."""
WATCH_LATEST_FACTOR: Final = 8.0
"""...and are opened at the latest this many times :func:`watch_after_s` after the start."""


def watch_after_s(prepare_timeout_s: float, participants: int = 1) -> float:
    """How long a participant may prepare before its readiness stream is opened, in a
    prepare of ``participants`` participants."""
    after = max(WATCH_AFTER_S, participants * WATCH_AFTER_PER_PARTICIPANT_S)
    return min(after, prepare_timeout_s / 10)


def watch_wait_s(
    now: float,
    *,
    started_at: float,
    last_activity_at: float | None,
    prepare_timeout_s: float,
    participants: int = 1,
) -> float:
    """Seconds until the readiness streams of the participants still preparing are
    opened (0: now).

    Not before :func:`watch_after_s` since the prepare began; and while the fan-out is
    still busy (it sent a request or read an answer less than
    :data:`WATCH_QUIET_FRACTION` of that ago) the coordinator is working through
    requests and answers, not waiting on participants still preparing: a thousand
    streams opened then would only slow it down. At the latest
    :data:`WATCH_LATEST_FACTOR` times :func:`watch_after_s` after the start, so that a
    busy fan-out never keeps a stuck participant's unacknowledged completions waiting
    long.
    """
    after = watch_after_s(prepare_timeout_s, participants)
    due = started_at + after
    if last_activity_at is not None:
        due = max(due, last_activity_at + after * WATCH_QUIET_FRACTION)
    due = min(due, started_at + after * WATCH_LATEST_FACTOR)
    return max(0.0, due - now)


def _names(instances: Iterable[str]) -> str:
    return ", ".join(sorted(instances))


# ------------------------------------------------------------------ one participant


class Answer(enum.Enum):
    """How one prepare round of one participant ended, as the core decides on it."""

    READY = "ready"
    NOT_READY = "not_ready"
    SESSION_BROKEN = "session_broken"  # the same request on a new session joins the wait
    TRANSIENT = "transient"  # UNAVAILABLE, DEADLINE_EXCEEDED, no reply in time
    INVARIANT = "invariant"  # a refusal or a malformed reply no retry can fix


class Step(enum.Enum):
    """What a participant's prepare does next."""

    SEND = "send"  # send a round now, with ``timeout_s``
    WAIT = "wait"  # wait up to ``timeout_s`` (for a readiness change if ``until_change``)
    READY = "ready"  # prepared: done
    NOT_READY = "not_ready"  # give up and report the participant not ready
    FAIL = "fail"  # give up and report the failure as it is


@dataclass(frozen=True, slots=True)
class PrepareDecision:
    step: Step
    reason: str
    timeout_s: float = 0.0
    until_change: bool = False


class ParticipantPrepare:
    """One participant's side of a prepare, under the prepare's one ``deadline``.

    Each round is at most ``round_timeout_s`` and repeats the same request. The driver
    asks :meth:`next_round` before each round, reports how the round ended with
    :meth:`answered`, and after a not-ready answer (once its blockers are handled) asks
    :meth:`wait`. A step of :attr:`Step.READY`, :attr:`Step.NOT_READY` or
    :attr:`Step.FAIL` ends the participant's prepare (:attr:`settled`).
    """

    def __init__(self, instance: str, *, deadline: float, round_timeout_s: float) -> None:
        if round_timeout_s <= 0:
            raise ValueError(f"round_timeout_s must be > 0, got {round_timeout_s}")
        self.instance = instance
        self.deadline = deadline
        self.round_timeout_s = round_timeout_s
        # A round shorter than this would only be answered "not ready" again: the
        # participant keeps a reply margin of its own before the round's deadline.
        self.min_round_s = min(MIN_ROUND_S, MIN_ROUND_FRACTION * round_timeout_s)
        self.backoff_s = NOT_READY_BACKOFF_S
        self.rounds = 0
        self.broken_sessions = 0
        self.answered_not_ready = False
        self.hopeless: str | None = None
        self.settled: Step | None = None

    def _end(self, step: Step, reason: str) -> PrepareDecision:
        self.settled = step
        return PrepareDecision(step, f"{self.instance}: {reason}")

    def mark_hopeless(self, reason: str) -> None:
        """It holds a completion that must be retired: it cannot be ready before a resume."""
        if self.hopeless is None:
            self.hopeless = reason

    def next_round(self, now: float) -> PrepareDecision:
        """Send the next round, or give up."""
        if self.settled is not None:
            raise RuntimeError(f"{self.instance}: the prepare is over ({self.settled.value})")
        left = self.deadline - now
        if self.hopeless is not None:
            return self._end(Step.NOT_READY, f"cannot become ready: {self.hopeless}")
        if left <= 0:
            return self._end(Step.NOT_READY, "the prepare deadline passed")
        if self.answered_not_ready and left < self.min_round_s:
            return self._end(
                Step.NOT_READY,
                f"{left:.3f}s left is less than a round needs ({self.min_round_s:g}s): the "
                "last not-ready answer stands",
            )
        self.rounds += 1
        timeout_s = min(self.round_timeout_s, left)
        return PrepareDecision(
            Step.SEND, f"{self.instance}: round {self.rounds}, {timeout_s:.3f}s", timeout_s
        )

    def answered(self, answer: Answer, now: float) -> PrepareDecision:
        """How a round ended; the decision says what follows."""
        if answer is Answer.READY:
            return self._end(Step.READY, f"prepared after {self.rounds} round(s)")
        if answer is Answer.NOT_READY:
            self.answered_not_ready = True
            return PrepareDecision(Step.WAIT, f"{self.instance}: not ready yet")
        if answer is Answer.SESSION_BROKEN:
            self.broken_sessions += 1
            if self.broken_sessions <= SESSION_RETRIES:
                # The participant may be waiting on the old stream; the same request on
                # a new one joins that wait.
                return self.next_round(now)
        if answer is not Answer.INVARIANT and self.answered_not_ready:
            # It did answer, not ready, before: that is the verdict to report.
            return self._end(Step.NOT_READY, f"not ready, then {answer.value.replace('_', ' ')}")
        return self._end(Step.FAIL, f"failed: {answer.value.replace('_', ' ')}")

    def wait(self, now: float, *, sent_at: float, stream_available: bool) -> PrepareDecision:
        """After a not-ready answer: how long to wait before :meth:`next_round`."""
        if self.hopeless is not None:
            return self._end(Step.NOT_READY, f"cannot become ready: {self.hopeless}")
        backoff_s = self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, NOT_READY_BACKOFF_MAX_S)
        left = self.deadline - now
        name = self.instance
        if left <= 0:
            return PrepareDecision(Step.WAIT, f"{name}: no time left to wait")
        if stream_available:
            return PrepareDecision(
                Step.WAIT, f"{name}: waiting for its readiness to change", left, until_change=True
            )
        if now - sent_at < backoff_s:
            # It answered at once: do not spin on a participant that cannot wait itself.
            return PrepareDecision(
                Step.WAIT,
                f"{name}: answered at once; backing off {backoff_s:g}s",
                min(backoff_s, left),
            )
        return PrepareDecision(Step.WAIT, f"{name}: no readiness stream; next round at once")


# ------------------------------------------------------------ unacknowledged results


@dataclass(frozen=True, slots=True)
class UnackedVerdict:
    instance: str
    episode: EpisodeId
    decision: UnackedDecision
    hopeless: bool
    reason: str


class UnackedLedger:
    """Unacknowledged completions a prepare reported, each receipt decided once.

    docs/spec.md section 7.4 step 4 (and section 6.7): the rollout side acknowledges a
    completion whose result it still wants, or says it must be retired; without a rollout
    side (``can_acknowledge`` false) every one must be retired. A retire can only happen
    once the participant is idle again, so its prepare is hopeless.
    """

    def __init__(self, *, can_acknowledge: bool = True) -> None:
        self.can_acknowledge = can_acknowledge
        self._decided: dict[tuple[str, str], UnackedVerdict] = {}
        self._retire: dict[str, set[EpisodeId]] = {}

    def decided(self, instance: str, receipt_id: str) -> UnackedVerdict | None:
        return self._decided.get((instance, receipt_id))

    def record(
        self, instance: str, episode: EpisodeId, receipt_id: str, decision: str
    ) -> UnackedVerdict:
        """What the rollout side decided (the first decision of a receipt stands)."""
        known = self._decided.get((instance, receipt_id))
        if known is not None:
            return known
        if decision == "acknowledge":
            verdict = UnackedVerdict(
                instance, episode, "acknowledge", False, f"{episode} on {instance}: acknowledged"
            )
        elif decision == "retire":
            self._retire.setdefault(instance, set()).add(episode)
            verdict = UnackedVerdict(
                instance,
                episode,
                "retire",
                True,
                f"{episode} on {instance} must be retired"
                + ("" if self.can_acknowledge else " (nobody can acknowledge it)"),
            )
        else:
            raise ValueError(f"resolve_unacknowledged answered {decision!r}")
        self._decided[(instance, receipt_id)] = verdict
        return verdict

    @property
    def retire(self) -> Mapping[str, tuple[EpisodeId, ...]]:
        return MappingProxyType(
            {name: tuple(sorted(episodes)) for name, episodes in sorted(self._retire.items())}
        )

    @property
    def hopeless(self) -> frozenset[str]:
        return frozenset(self._retire)


# -------------------------------------------------------------------- the verdict


class Outcome(enum.Enum):
    """How one participant's prepare ended, all rounds counted."""

    READY = "ready"
    NOT_READY = "not_ready"
    TRANSIENT = "transient"
    INVARIANT = "invariant"

    @property
    def retryable(self) -> bool:
        return self is not Outcome.INVARIANT


@dataclass(frozen=True, slots=True)
class PrepareVerdict:
    """Commit, or abort; what an abort resumes and retires; whether to try again."""

    checkpoint_id: str
    commit: bool
    outcomes: Mapping[str, Outcome]
    resume: tuple[str, ...]
    retire: Mapping[str, tuple[EpisodeId, ...]]
    retryable: bool
    reason: str

    def of(self, *outcomes: Outcome) -> frozenset[str]:
        return frozenset(name for name, got in self.outcomes.items() if got in outcomes)

    @property
    def ready(self) -> frozenset[str]:
        return self.of(Outcome.READY)


def decide_prepare(
    checkpoint_id: str,
    outcomes: Mapping[str, Outcome],
    retire: Mapping[str, Sequence[EpisodeId]] | None = None,
) -> PrepareVerdict:
    """docs/spec.md section 7.4 steps 4-5: commit only when every participant is ready.

    Otherwise abort: resume the same id on every participant, the ready ones included
    (``resume``), then retire the stragglers (``retire``). The attempt may be retried
    when every failure is not-ready or transient; one invariant failure makes it final.
    """
    if not outcomes:
        raise ValueError("a prepare needs at least one participant")
    frozen = MappingProxyType(dict(sorted(outcomes.items())))
    stragglers = MappingProxyType(
        {name: tuple(sorted(set(e))) for name, e in sorted((retire or {}).items()) if e}
    )
    by_kind = {
        kind: sorted(name for name, got in frozen.items() if got is kind) for kind in Outcome
    }
    if len(by_kind[Outcome.READY]) == len(frozen):
        return PrepareVerdict(
            checkpoint_id,
            True,
            frozen,
            (),
            stragglers,
            True,
            f"{checkpoint_id}: all {len(frozen)} participant(s) prepared: commit",
        )
    retryable = not by_kind[Outcome.INVARIANT]
    parts = [
        f"{len(names)} {kind.value.replace('_', ' ')} ({_names(names)})"
        for kind, names in by_kind.items()
        if names and kind is not Outcome.READY
    ]
    retiring = sum(len(e) for e in stragglers.values())
    reason = (
        f"{checkpoint_id}: abort, {'; '.join(parts)}: resume all {len(frozen)} "
        f"participant(s), the {len(by_kind[Outcome.READY])} ready included"
        + (f", then retire {retiring} straggler(s)" if retiring else "")
        + ("; retry" if retryable else "; an invariant broke, do not retry")
    )
    return PrepareVerdict(
        checkpoint_id, False, frozen, tuple(frozen), stragglers, retryable, reason
    )


# ------------------------------------------------------------ finished sequences

MAX_SEQUENCE: Final = 10**18 - 1
"""The highest sequence a checkpoint id can carry (18 digits, docs/spec.md section 2.6)."""


class FinishedProbe:
    """Finds the highest finished sequence of a participant that refused a fresh id.

    docs/spec.md section 7.2 item 4. A participant that answers ``STALE_CHECKPOINT`` to
    the prepare of an id no participant saw before has finished a higher id of the same
    prefix (a Resume of a far-future id, say), and supersession makes every id up to it
    finished. Each probe is a Renew of a candidate id, which changes nothing: a finished
    id answers ``STALE_CHECKPOINT``, any other ``INVALID_PHASE``. Finished ids form a
    prefix of the sequences, so the probe gallops up from the refused sequence (steps of
    1, 2, 4...) to the first fresh one, then bisects: at most about 120 probes.

    The driver asks :meth:`next_candidate` until it returns None and reports each answer
    with :meth:`observe`; :attr:`finished_through` is then the answer (and
    :attr:`exhausted` says no 18-digit sequence is fresh).
    """

    def __init__(self, refused: int, *, ceiling: int = MAX_SEQUENCE) -> None:
        if not 0 <= refused <= ceiling:
            raise ValueError(f"refused sequence {refused} is outside [0, {ceiling}]")
        self.finished_through = refused  # known finished
        self.first_fresh: int | None = None  # known not finished
        self.ceiling = ceiling
        self.probes = 0
        self._step = 1

    @property
    def exhausted(self) -> bool:
        return self.first_fresh is None and self.finished_through >= self.ceiling

    def next_candidate(self) -> int | None:
        """The next sequence to probe, or None when the answer is known."""
        low, high = self.finished_through, self.first_fresh
        if high is None:
            if low >= self.ceiling:
                return None
            return min(low + self._step, self.ceiling)
        if high - low <= 1:
            return None
        return (low + high) // 2

    def observe(self, candidate: int, finished: bool) -> None:
        self.probes += 1
        if finished:
            self.finished_through = max(self.finished_through, candidate)
            self._step *= 2
        elif self.first_fresh is None or candidate < self.first_fresh:
            self.first_fresh = candidate


# ------------------------------------------------------------------------- leases


class RenewalSchedule:
    """When the leases of an open checkpoint are renewed (docs/spec.md section 7.4).

    Every ``interval_s`` after the last renewal ended, and at once when asked
    (:meth:`renew_now`: right after prepare, since a participant prepared early waited
    for the others). Each renew round is abandoned after :attr:`window_s`, so a hung
    renew never delays the next one.
    """

    def __init__(
        self, *, interval_s: float, control_timeout_s: float, now: float, renew_now: bool = False
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.window_s = min(control_timeout_s, interval_s)
        self._next_at = -math.inf if renew_now else now + interval_s
        self.rounds = 0

    def renew_now(self) -> None:
        self._next_at = -math.inf

    def due(self, now: float) -> bool:
        return now >= self._next_at

    def wait_s(self, now: float) -> float:
        """Seconds until the next renewal is due (0 if it is)."""
        return max(0.0, self._next_at - now)

    def renewed(self, now: float) -> None:
        """A renew round ended at ``now``."""
        self.rounds += 1
        self._next_at = now + self.interval_s


# ----------------------------------------------------------------- commit scoping


@dataclass(frozen=True, slots=True)
class CommitScope:
    """Who commits which episodes (docs/spec.md section 7.4 step 6).

    ``ok`` is false when an in-flight attempt runs on an instance the topology has no
    agent for: an invariant break (``reason`` says which), and ``scopes`` is empty.
    """

    ok: bool
    reason: str
    scopes: Mapping[str, frozenset[EpisodeId]] = field(default_factory=dict)
    candidates: tuple[InFlightRollout, ...] = ()
    restarts: tuple[InFlightRollout, ...] = ()


def scope_commit(
    in_flight: Sequence[InFlightRollout],
    restarts: Collection[EpisodeId],
    *,
    instances: Collection[str],
    agents: Collection[str],
) -> CommitScope:
    """Each agent instance commits its own candidates; every other participant all of
    them (it exports what it holds). Candidates are the in-flight attempts minus every
    restart any participant reported: a restart is in no scope."""
    strangers = sorted({r.instance for r in in_flight} - set(agents))
    if strangers:
        return CommitScope(
            False, f"rollouts run on instance(s) the topology has no agent for: {strangers}"
        )
    candidates = tuple(r for r in in_flight if r.episode not in restarts)
    excluded = tuple(r for r in in_flight if r.episode in restarts)
    everything = frozenset(r.episode for r in candidates)
    scopes = {
        name: (
            frozenset(r.episode for r in candidates if r.instance == name)
            if name in agents
            else everything
        )
        for name in sorted(instances)
    }
    return CommitScope(
        True,
        f"{len(candidates)} candidate(s) over {len(scopes)} participant(s), "
        f"{len(excluded)} restart(s) left out",
        MappingProxyType(scopes),
        candidates,
        excluded,
    )


def commit_scope_problem(
    scope: Mapping[str, Iterable[EpisodeId]],
    instances: Collection[str],
    restarts: Mapping[str, Collection[EpisodeId]],
) -> str | None:
    """Why the coordinator must refuse to send this commit scope, or None.

    A scope may name only known instances and never an episode the instance reported
    as a restart in this checkpoint's prepare.
    """
    unknown = sorted(set(scope) - set(instances))
    if unknown:
        return f"commit scope names unknown instance(s): {', '.join(unknown)}"
    for name in sorted(scope):
        clash = sorted(set(scope[name]) & set(restarts.get(name, ())))
        if clash:
            return (
                f"commit scope of {name} names {len(clash)} episode(s) it reported as "
                f"restarts, e.g. {clash[0]}: leave restarts out of the scope"
            )
    return None


def exported_problem(exported: Iterable[EpisodeId], scope: Collection[EpisodeId]) -> str | None:
    """Why a commit reply's exported episodes are malformed (outside the scope), or None."""
    outside = sorted_episodes(set(exported) - set(scope))
    if outside:
        return f"exported {len(outside)} episode(s) outside the scope, e.g. {outside[0]}"
    return None


@dataclass(frozen=True, slots=True)
class Attribution:
    """What a committed snapshot continues and what it restarts (section 7.4 step 7)."""

    continued: tuple[PlacedEpisode, ...]
    restarted: tuple[PlacedEpisode, ...]
    reason: str


def attribute_commit(
    scope: CommitScope,
    in_flight: Sequence[InFlightRollout],
    exported: Mapping[str, Collection[EpisodeId]],
) -> Attribution:
    """Continued: the candidates their agent instance exported. Restarted: every other
    in-flight attempt (reported restarts, and candidates the agent did not export)."""
    continued = tuple(
        PlacedEpisode(r.episode, r.instance)
        for r in scope.candidates
        if r.episode in exported.get(r.instance, ())
    )
    kept = {placed.episode for placed in continued}
    restarted = tuple(
        PlacedEpisode(r.episode, r.instance) for r in in_flight if r.episode not in kept
    )
    return Attribution(
        continued,
        restarted,
        f"{len(continued)} continued, {len(restarted)} restart(s) "
        f"({len(scope.restarts)} reported, {len(restarted) - len(scope.restarts)} not exported)",
    )


def installed_problem(installed: Sequence[EpisodeId], scope: Collection[EpisodeId]) -> str | None:
    """Why a restore reply did not install exactly attempt N+1 of its scope, or None."""
    wanted = {episode.next_attempt() for episode in scope}
    if set(installed) == wanted and len(installed) == len(wanted):
        return None
    missing = sorted(wanted - set(installed))
    extra = sorted(set(installed) - wanted)
    return (
        f"installed does not match the scope (missing {[str(e) for e in missing[:3]]}, "
        f"unexpected {[str(e) for e in extra[:3]]})"
    )
