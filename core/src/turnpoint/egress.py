"""The egress relay's record of one episode, pure (docs/spec.md section 12.6).

Every call a harness makes through the relay (a model call, a tool call) that the relay
accepts is in the record, and ends in exactly one :class:`Disposition`:

- ``NEVER_STARTED``: accepted, never forwarded (held while a snapshot was open, and the
  episode ended first);
- ``COMPLETED``: forwarded and answered; the answer is in the relay's custody;
- ``ACTIVE_PREFIX``: forwarded and still streaming when a snapshot was cut: the prefix
  received so far is what that snapshot holds (a disposition *at a cut*, never final:
  the call goes on to one of the others);
- ``TERMINAL_FAILURE``: forwarded or held, and failed for good (the model or tool
  refused it, the episode ended under it);
- ``EXCLUDED``: its harness generation was fenced (replaced) before it settled: whatever
  it brings back later is not recorded.

:class:`EgressRecord` takes events (accept, start, progress, complete, fail, fence, and a
snapshot's prepare, commit and resume) and answers each with data: the
:class:`Transition` s it made, or the :class:`Refusal` that made none. A commit answers
the :class:`Cut`: every accepted call once, with its disposition at that snapshot. No
asyncio, no clock, no I/O: the relay's wire adapter feeds it, and a property test drives
it through every interleaving.

After a restore a fresh harness replays: :func:`replay_decision` says, for each of its
calls in order, whether the record answers it, it goes live (past the cut), or it
diverged from the record (the harness is stopped and the episode reruns from its
prompt). :func:`request_digest` is what a model call is compared by, :func:`tool_digest`
what a tool call is.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType


class Disposition(enum.Enum):
    NEVER_STARTED = "never_started"
    COMPLETED = "completed"
    ACTIVE_PREFIX = "active_prefix"
    TERMINAL_FAILURE = "terminal_failure"
    EXCLUDED = "excluded"


FINAL = frozenset(
    (
        Disposition.NEVER_STARTED,
        Disposition.COMPLETED,
        Disposition.TERMINAL_FAILURE,
        Disposition.EXCLUDED,
    )
)


class CallState(enum.Enum):
    """Where an accepted call is; the last four are its final disposition."""

    HELD = "held"  # accepted, not forwarded yet
    RUNNING = "running"  # forwarded, answer not complete
    NEVER_STARTED = "never_started"
    COMPLETED = "completed"
    TERMINAL_FAILURE = "terminal_failure"
    EXCLUDED = "excluded"

    @property
    def disposition(self) -> Disposition | None:
        """The final disposition, or None while the call is held or running."""
        return _FINAL_OF.get(self)


_FINAL_OF = MappingProxyType(
    {
        CallState.NEVER_STARTED: Disposition.NEVER_STARTED,
        CallState.COMPLETED: Disposition.COMPLETED,
        CallState.TERMINAL_FAILURE: Disposition.TERMINAL_FAILURE,
        CallState.EXCLUDED: Disposition.EXCLUDED,
    }
)


class RefusalReason(enum.Enum):
    DUPLICATE_CALL = "duplicate_call"  # a call id the record holds already
    FENCED_GENERATION = "fenced_generation"  # a harness generation older than the current
    SNAPSHOT_OPEN = "snapshot_open"  # no call starts between prepare and resume
    UNKNOWN_CALL = "unknown_call"
    NOT_RUNNING = "not_running"  # progress or completion of a call not running
    SETTLED = "settled"  # the call has its final disposition already
    CLOSED = "closed"  # the episode's record is closed
    NO_SNAPSHOT = "no_snapshot"  # commit or resume without the prepare
    SNAPSHOT_CONFLICT = "snapshot_conflict"  # another snapshot is open
    COMMITTED = "committed"  # the open snapshot's cut was taken already


@dataclass(frozen=True, slots=True)
class Transition:
    call_id: str
    before: CallState | None  # None: the call entered the record
    after: CallState


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: RefusalReason
    call_id: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class CutEntry:
    disposition: Disposition
    prefix_units: int = 0  # for ACTIVE_PREFIX: the tokens (or bytes) received so far


@dataclass(frozen=True, slots=True)
class Cut:
    """What a snapshot holds of the record: every accepted call once."""

    snapshot: str
    calls: Mapping[str, CutEntry]


Outcome = tuple[Transition, ...] | Refusal


@dataclass(slots=True)
class _Call:
    generation: int
    state: CallState
    prefix_units: int = 0


class EgressRecord:
    """One episode's calls and their dispositions (the module docstring says how)."""

    def __init__(self, generation: int = 0) -> None:
        self._calls: dict[str, _Call] = {}
        self._generation = generation
        self._open_snapshot: str | None = None
        self._committed: str | None = None
        self._closed = False

    @classmethod
    def restored(cls, calls: Mapping[str, Disposition], generation: int) -> EgressRecord:
        """The record a restore installs: a cut's calls, under a new harness ``generation``.

        A call the cut holds as ``active_prefix`` belonged to the replaced harness and
        becomes ``excluded``; every other disposition in a cut is final already. The
        calls keep their ids, so none is recorded twice after the restore.
        """
        record = cls(generation)
        for call_id, disposition in calls.items():
            state = (
                CallState.EXCLUDED
                if disposition is Disposition.ACTIVE_PREFIX
                else CallState(disposition.value)
            )
            # Older than any call the new generation makes: the cut's harness.
            record._calls[call_id] = _Call(generation - 1, state)
        return record

    # ------------------------------------------------------------------ reads

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def open_snapshot(self) -> str | None:
        return self._open_snapshot

    @property
    def closed(self) -> bool:
        return self._closed

    def state(self, call_id: str) -> CallState | None:
        call = self._calls.get(call_id)
        return None if call is None else call.state

    def states(self) -> Mapping[str, CallState]:
        return MappingProxyType({call_id: call.state for call_id, call in self._calls.items()})

    # ------------------------------------------------------------------ calls

    def accept(self, call_id: str, generation: int) -> Outcome:
        """A harness's call arrives. Held (not started) until :meth:`start`."""
        if self._closed:
            return Refusal(RefusalReason.CLOSED, call_id)
        if generation < self._generation:
            return Refusal(
                RefusalReason.FENCED_GENERATION,
                call_id,
                f"generation {generation} was replaced by {self._generation}",
            )
        if call_id in self._calls:
            return Refusal(RefusalReason.DUPLICATE_CALL, call_id)
        # A newer harness's first call fences the older generation.
        fenced = self._exclude_older(generation) if generation > self._generation else ()
        self._calls[call_id] = _Call(generation, CallState.HELD)
        return (*fenced, Transition(call_id, None, CallState.HELD))

    def start(self, call_id: str) -> Outcome:
        """Forward a held call; refused while a snapshot is open (it stays held)."""
        call = self._live(call_id)
        if isinstance(call, Refusal):
            return call
        if call.state is not CallState.HELD:
            return Refusal(RefusalReason.NOT_RUNNING, call_id, "the call started already")
        if self._open_snapshot is not None:
            return Refusal(RefusalReason.SNAPSHOT_OPEN, call_id, self._open_snapshot)
        return (self._move(call_id, call, CallState.RUNNING),)

    def progress(self, call_id: str, units: int) -> Outcome:
        """``units`` more of a running call's answer received (its prefix grows)."""
        if units < 0:
            raise ValueError(f"units must be >= 0, got {units}")
        call = self._running(call_id)
        if isinstance(call, Refusal):
            return call
        call.prefix_units += units
        return ()

    def complete(self, call_id: str) -> Outcome:
        """A running call's whole answer is in the relay's custody."""
        call = self._running(call_id)
        if isinstance(call, Refusal):
            return call
        return (self._move(call_id, call, CallState.COMPLETED),)

    def fail(self, call_id: str) -> Outcome:
        """A held or running call failed for good."""
        call = self._live(call_id)
        if isinstance(call, Refusal):
            return call
        return (self._move(call_id, call, CallState.TERMINAL_FAILURE),)

    def fence(self, generation: int) -> Outcome:
        """A new harness generation replaces the older: its unsettled calls are excluded."""
        if generation <= self._generation:
            return Refusal(
                RefusalReason.FENCED_GENERATION,
                detail=f"generation {generation} is not above {self._generation}",
            )
        return self._exclude_older(generation)

    def close(self) -> Outcome:
        """The episode ended: a held call never started, a running one failed."""
        if self._closed:
            return Refusal(RefusalReason.CLOSED)
        self._closed = True
        moved: list[Transition] = []
        for call_id, call in self._calls.items():
            if call.state is CallState.HELD:
                moved.append(self._move(call_id, call, CallState.NEVER_STARTED))
            elif call.state is CallState.RUNNING:
                moved.append(self._move(call_id, call, CallState.TERMINAL_FAILURE))
        return tuple(moved)

    # ------------------------------------------------------------------ snapshots

    def prepare(self, snapshot: str) -> Outcome:
        """A snapshot opens: no call starts until :meth:`resume` (a repeat is a no-op)."""
        if self._open_snapshot not in (None, snapshot):
            return Refusal(RefusalReason.SNAPSHOT_CONFLICT, detail=str(self._open_snapshot))
        self._open_snapshot = snapshot
        return ()

    def commit(self, snapshot: str) -> Cut | Refusal:
        """The snapshot's view: every accepted call once, with its disposition now.

        Once per snapshot: its cut is written once, so no call is recorded twice in it.
        """
        if self._open_snapshot != snapshot:
            return Refusal(RefusalReason.NO_SNAPSHOT, detail=snapshot)
        if self._committed == snapshot:
            return Refusal(RefusalReason.COMMITTED, detail=snapshot)
        self._committed = snapshot
        calls: dict[str, CutEntry] = {}
        for call_id, call in self._calls.items():
            final = call.state.disposition
            if final is not None:
                calls[call_id] = CutEntry(final)
            elif call.state is CallState.HELD:
                calls[call_id] = CutEntry(Disposition.NEVER_STARTED)
            else:
                calls[call_id] = CutEntry(Disposition.ACTIVE_PREFIX, call.prefix_units)
        return Cut(snapshot, MappingProxyType(calls))

    def resume(self, snapshot: str) -> Outcome:
        """The snapshot closes: held calls may start."""
        if self._open_snapshot != snapshot:
            return Refusal(RefusalReason.NO_SNAPSHOT, detail=snapshot)
        self._open_snapshot = None
        self._committed = None
        return ()

    # ------------------------------------------------------------------ internals

    def _live(self, call_id: str) -> _Call | Refusal:
        call = self._calls.get(call_id)
        if call is None:
            return Refusal(RefusalReason.UNKNOWN_CALL, call_id)
        if call.state.disposition is not None:
            return Refusal(RefusalReason.SETTLED, call_id, call.state.value)
        return call

    def _running(self, call_id: str) -> _Call | Refusal:
        call = self._live(call_id)
        if isinstance(call, _Call) and call.state is not CallState.RUNNING:
            return Refusal(RefusalReason.NOT_RUNNING, call_id, call.state.value)
        return call

    def _exclude_older(self, generation: int) -> tuple[Transition, ...]:
        self._generation = generation
        return tuple(
            self._move(call_id, call, CallState.EXCLUDED)
            for call_id, call in self._calls.items()
            if call.generation < generation and call.state.disposition is None
        )

    @staticmethod
    def _move(call_id: str, call: _Call, after: CallState) -> Transition:
        before = call.state
        call.state = after
        return Transition(call_id, before, after)


# ---------------------------------------------------------------------- replay


_TRANSPORT_FIELDS = frozenset(("stream", "stream_options"))


def request_digest(body: Mapping[str, object]) -> str:
    """What a call is compared by on replay: SHA-256 of its body as canonical JSON.

    Key order, white space and how the answer travels (``stream``, ``stream_options``:
    the relay forwards every call whole) do not count; every other field does (the
    messages, the model, the sampling parameters): a harness that asks anything else has
    diverged.
    """
    asked = {key: value for key, value in body.items() if key not in _TRANSPORT_FIELDS}
    canonical = json.dumps(asked, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def tool_digest(tool: str, body: Mapping[str, object]) -> str:
    """What a tool call is compared by on replay: SHA-256 of the tool's name and its body.

    Never equal to a model call's :func:`request_digest`: the hashed text starts with
    ``tool``, a model call's with the ``{`` of its JSON, so a harness that calls a tool
    where it called the model (or the reverse) has diverged.
    """
    canonical = json.dumps(dict(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"tool\0{tool}\0{canonical}".encode()).hexdigest()


class ReplayAction(enum.Enum):
    ANSWER = "answer"  # answer from the record; nothing is forwarded
    LIVE = "live"  # past the cut: forward, record, as any call
    DIVERGED = "diverged"  # the harness asked something else: stop it, rerun from prompt


@dataclass(frozen=True, slots=True)
class ReplayDecision:
    action: ReplayAction
    position: int  # the call's place in the harness's sequence of calls, from 0
    reason: str = ""


def replay_decision(recorded: Sequence[str], position: int, digest: str) -> ReplayDecision:
    """What a restored harness's call at ``position`` gets (docs/spec.md section 12.7).

    ``recorded`` holds the request digests of the completed calls the cut holds, in the
    order their harness made them. A call within them is answered from the record when
    it asks exactly what was asked there, else it diverged; a call past them is live.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if position >= len(recorded):
        return ReplayDecision(ReplayAction.LIVE, position)
    if recorded[position] == digest:
        return ReplayDecision(ReplayAction.ANSWER, position)
    return ReplayDecision(
        ReplayAction.DIVERGED,
        position,
        f"call {position} asks other than the recorded call {position} "
        f"(of {len(recorded)} recorded)",
    )
