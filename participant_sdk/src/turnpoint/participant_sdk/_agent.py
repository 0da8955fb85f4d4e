"""Agents: episodes that run turn by turn and park at their turn boundaries.

A Gym agent server subclasses :class:`Agent` and implements :meth:`Agent.run`. The SDK
runs each episode as one execution, streams a :class:`BoundaryReport` each time the
episode seals a turn (``await ctx.boundary(...)``), then one :class:`RunResult`.

The state given to ``ctx.boundary`` is what a snapshot saves (deep-copied at the
boundary; plain JSON). ``export_states`` / ``validate_state`` may be overridden to
transform or check it; ``admission_closed`` / ``admission_opened`` are optional hooks.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import functools
import secrets
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar, Final, TypeVar

from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.protocol import (
    CompletionReceipt,
    EpisodeState,
    ParticipantKind,
    RecoveryMode,
)

from ._core import ActiveClock, ParticipantCore, WorkKey
from ._effects import CallPosition, effect_key
from ._model import GenerateChunk
from ._resources import ConfigurationError, Verdict
from ._shared import Shared, invalid_record, logger
from ._store_format import PlainRecord, Record, json_copy, json_copy_object, plain_member
from ._token_prefix import Generation, GenerationRequest, WeightsChange
from ._tool_client import ResourcesConnection, retried

T = TypeVar("T")

SLOT = "run"
_PAYLOAD_FIELDS = frozenset({"task", "boundary_index", "turn_index", "state"})
# docs/spec.md section 5.5: the generation of the turn after the boundary, when a
# checkpoint cut it (or it finished before the next boundary); absent otherwise.
_GENERATION_FIELD = "generation"
# A RERUN of a generation that spans a weight update is retried at most this often; the
# generation is then kept as it is (weight syncs faster than a generation never settle).
_MAX_WEIGHT_RERUNS = 3

# Opens one policy stream for a request (prompt plus any prefix, the budget left).
GenerationStream = Callable[[GenerationRequest], AsyncIterator[GenerateChunk]]


_UNREACHABLE: Final = frozenset({Reason.UNAVAILABLE})


class RunOutcome(enum.Enum):
    COMPLETED = "COMPLETED"  # must be acknowledged
    CANCELLED = "CANCELLED"  # the caller cancelled: nothing owed
    FAILED = "FAILED"  # the agent raised; must be acknowledged
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"  # active time ran out; must be acknowledged

    # Singletons compared by identity: an identity hash is C-level (Enum's is Python).
    __hash__ = object.__hash__


# Members read on every episode, as module constants: reading one off its enum class goes
# through the metaclass, several times slower than a global.
_COMPLETED: Final = RunOutcome.COMPLETED
_CANCELLED: Final = RunOutcome.CANCELLED
_UNACKED: Final = EpisodeState.COMPLETED_UNACKED
_DETAIL: Final = {outcome: outcome.value for outcome in RunOutcome}


@dataclass(frozen=True, slots=True)
class BoundaryReport:
    """The episode sealed a turn. ``boundary_index`` is 1-based and continues across attempts."""

    episode: EpisodeId
    boundary_index: int
    turn_index: int
    sealed_at: float  # seconds since the epoch


@dataclass(frozen=True, slots=True)
class RunResult:
    """The one final message of a run. ``receipt`` is None only when CANCELLED."""

    episode: EpisodeId
    outcome: RunOutcome
    receipt: CompletionReceipt | None
    result: Mapping[str, Any]
    turns: int
    active_time_s: float
    error_message: str = ""


def _slot_setters(cls: type, names: str) -> tuple[Callable[[object, object], None], ...]:
    return tuple(vars(cls)[name].__set__ for name in names.split())


_new = object.__new__
_SET_REPORT = _slot_setters(BoundaryReport, "episode boundary_index turn_index sealed_at")
_SET_RECEIPT = _slot_setters(CompletionReceipt, "episode receipt_id")
_SET_RESULT = _slot_setters(
    RunResult, "episode outcome receipt result turns active_time_s error_message"
)


# The frozen dataclasses' own __init__ sets each field through object.__setattr__; an
# episode builds a report per boundary and a result, and those calls were the largest
# single part of its bookkeeping. These (and _Execution.seal) fill the slots directly.
def _receipt(episode: EpisodeId, receipt_id: str) -> CompletionReceipt:
    receipt = _new(CompletionReceipt)
    set_episode, set_id = _SET_RECEIPT
    set_episode(receipt, episode)
    set_id(receipt, receipt_id)
    return receipt


def _run_result(
    episode: EpisodeId,
    outcome: RunOutcome,
    receipt: CompletionReceipt | None,
    result: Mapping[str, Any],
    turns: int,
    active_time_s: float,
    error_message: str,
) -> RunResult:
    run_result = _new(RunResult)
    set_episode, set_outcome, set_receipt, set_result, set_turns, set_active, set_error = (
        _SET_RESULT
    )
    set_episode(run_result, episode)
    set_outcome(run_result, outcome)
    set_receipt(run_result, receipt)
    set_result(run_result, result)
    set_turns(run_result, turns)
    set_active(run_result, active_time_s)
    set_error(run_result, error_message)
    return run_result


@dataclass(frozen=True, slots=True)
class SavedTurn:
    """The last sealed boundary of an episode: where a restored attempt continues."""

    boundary_index: int
    turn_index: int
    state: Mapping[str, Any]
    # The turn's generation so far (cut by a checkpoint, or finished), docs/spec.md 5.5.
    generation: Generation | None = None


class Agent(abc.ABC):
    """What a Gym agent server implements (the module docstring says how).

    Example::

        class GuessAgent(Agent):
            async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
                # Continue from the saved turn after a restore, else start from the prompt.
                saved = ctx.restored
                history = list(saved.state["history"]) if saved else []
                turn = saved.turn_index + 1 if saved else 0
                while turn < task["max_turns"]:
                    reply = await ctx.model_call(lambda: self.policy.generate(task, history))
                    history.append(await self.tools.check(ctx.episode, reply))
                    await ctx.boundary(turn, {"history": history})  # parks here during a checkpoint
                    turn += 1
                return {"answer": history[-1]}
    """

    # Agents export the state they hand to ctx.boundary, so they can always continue a
    # turn. An agent that cannot continue one (a harness that cannot be replayed)
    # declares RESTART_ONLY: its episodes are restarts (docs/spec.md section 5.2 item 7),
    # never exported, never parked, rerun from their prompts after a restore. An
    # instance may set it (a class whose harnesses differ decides per instance).
    recovery_mode: RecoveryMode = RecoveryMode.EXPORTED
    environment: ClassVar[str] = ""
    # docs/spec.md section 5.5: ``ctx.generate`` asks the policy to cut its generations
    # at a checkpoint and records the cuts. Set it only when the policy server cuts (it
    # lists the token level in Describe): a generation the agent streams blocks its
    # prepare until the stream ends, which a policy that cannot cut never hurries.
    cuts_generations: bool = False
    # What ``ctx.generate`` does with a generation whose tokens span a weight update,
    # when the Run does not say: the coordinator's configuration decides it and sends it
    # on every Run (docs/spec.md section 5.5 item 7); this applies to a Run without it.
    weights_change: WeightsChange = WeightsChange.KEEP

    @abc.abstractmethod
    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        """Run one episode to its result; call ``ctx.boundary`` after each turn."""

    async def export_states(
        self, states: Mapping[EpisodeId, SavedTurn]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        """The state to save for each episode; every one asked for must be returned."""
        return {episode: saved.state for episode, saved in states.items()}

    def validate_state(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        """Raise ValueError if a saved state cannot be continued (checked before any install)."""
        return None

    async def admission_closed(self) -> None:
        """A checkpoint closed admission (a failure makes the prepare fail and reopen)."""
        return None

    async def admission_opened(self) -> None:
        """Admission reopened; may come without a preceding close (after a restore)."""
        return None


class _Stop(enum.Enum):
    CANCELLED = "cancelled"  # the caller cancelled the run
    RETIRED = "retired"
    BUDGET = "budget"
    SHUTDOWN = "shutdown"


_RETIRED: Final = _Stop.RETIRED


class _Execution:
    """One execution of one attempt; replaced by a new object when saved state is claimed."""

    # One is made per episode and read at every boundary.
    __slots__ = (
        "_saved",
        "_sealed",
        "boundaries",
        "boundary_index",
        "budget_s",
        "calls_after_boundary",
        "clock",
        "episode",
        "exported",
        "followers",
        "key",
        "restored",
        "result",
        "runner",
        "stop",
        "task",
        "waiting",
        "weights_change",
    )

    def __init__(
        self,
        episode: EpisodeId,
        task: dict[str, Any],
        saved: SavedTurn | None,
        budget_s: float | None,
        now: float,
        weights_change: WeightsChange | None = None,
    ) -> None:
        self.episode = episode
        self.key = WorkKey(episode, SLOT)
        self.task = task
        self._saved = saved
        # The boundary sealed last, not built into a SavedTurn yet: most boundaries are
        # replaced by the next one before anything (a snapshot, a model call) reads them.
        self._sealed: tuple[int, int, dict[str, Any]] | None = None
        self.boundary_index = 0 if saved is None else saved.boundary_index
        self.restored = saved
        # The record the last snapshot exported, the saved turn and a copy of the task
        # it was made of: the next snapshot writes it again while both are unchanged.
        self.exported: tuple[SavedTurn, dict[str, Any], PlainRecord] | None = None
        self.budget_s = budget_s
        # The Run's say on a generation that spans a weight update; None: the agent's.
        self.weights_change = weights_change
        self.clock = ActiveClock(now)
        self.boundaries: list[BoundaryReport] = []
        self.runner: asyncio.Task[None] | None = None
        self.result: RunResult | None = None
        self.followers = 0
        self.stop: _Stop | None = None
        # Keyed calls made since the last boundary (docs/spec.md section 6.12).
        self.calls_after_boundary = 0
        # Followers waiting for the next boundary or the result: each waits on its own
        # future, so that news of this execution wakes its followers and nobody else's.
        self.waiting: list[asyncio.Future[None]] = []

    def news(self) -> asyncio.Future[None]:
        """What a follower awaits (lock not held) for the next boundary or the result."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        return waiter

    def tell(self) -> None:
        """Wake the followers: a boundary was sealed, or the result set."""
        if self.waiting:
            waiting, self.waiting = self.waiting, []
            for waiter in waiting:
                if not waiter.done():  # a follower cancelled meanwhile
                    waiter.set_result(None)

    def next_call_position(self) -> CallPosition:
        """The position of the next keyed call: the last boundary's turn, its index."""
        if self._sealed is not None:
            turn: int | None = self._sealed[1]
        else:
            turn = None if self._saved is None else self._saved.turn_index
        position = CallPosition(turn, self.calls_after_boundary)
        self.calls_after_boundary += 1
        return position

    @property
    def saved(self) -> SavedTurn | None:
        """The last sealed boundary (sealed here, or the one this attempt continues from)."""
        sealed = self._sealed
        if sealed is not None:
            self._saved = SavedTurn(*sealed)
            self._sealed = None
        return self._saved

    @saved.setter
    def saved(self, saved: SavedTurn) -> None:
        self._saved, self._sealed = saved, None
        self.boundary_index = saved.boundary_index

    @property
    def has_boundary(self) -> bool:
        """Whether there is a sealed boundary (``saved is not None``, without building it)."""
        return self._sealed is not None or self._saved is not None

    def seal(self, turn_index: int, state: dict[str, Any], sealed_at: float) -> int:
        """Make a new boundary, one past the last, the saved turn, and report it to the
        followers; returns its index."""
        index = self.boundary_index = self.boundary_index + 1
        self._sealed = (index, turn_index, state)
        self.calls_after_boundary = 0
        # BoundaryReport(self.episode, index, turn_index, sealed_at), its slots filled
        # directly (see _SET_REPORT).
        report = _new(BoundaryReport)
        set_episode, set_index, set_turn, set_at = _SET_REPORT
        set_episode(report, self.episode)
        set_index(report, index)
        set_turn(report, turn_index)
        set_at(report, sealed_at)
        self.boundaries.append(report)
        if self.waiting:  # most boundaries find their follower busy elsewhere
            self.tell()
        return index

    @property
    def claimable(self) -> bool:
        """Saved state nobody runs: restored, or cancelled after sealing a boundary."""
        cancelled = self.result is not None and self.result.outcome is RunOutcome.CANCELLED
        return self.runner is None and (self.result is None or cancelled) and self.has_boundary


class EpisodeContext:
    """Handed to :meth:`Agent.run`: the episode's identity and its boundary and model calls."""

    __slots__ = ("_ex", "_host")

    def __init__(self, host: AgentHost, execution: _Execution) -> None:
        self._host = host
        self._ex = execution

    @property
    def episode(self) -> EpisodeId:
        return self._ex.episode

    @property
    def restored(self) -> SavedTurn | None:
        """The saved turn this attempt continues from (after a restore), else None."""
        return self._ex.restored

    @property
    def last_boundary(self) -> SavedTurn | None:
        return self._ex.saved

    async def boundary(self, turn_index: int, state: Mapping[str, Any]) -> None:
        """Seal a turn: report it, and park here while a checkpoint holds admission.

        Woken by resume, the episode stays parked if a new checkpoint closed first.
        """
        if turn_index < 0:
            raise ValueError(f"turn_index must be >= 0, got {turn_index}")
        copied = json_copy(state) if type(state) is dict else _copied_state(state)
        host, execution = self._host, self._ex
        shared = host._shared
        # Almost every boundary finds the lock free and admission open: it then takes
        # the lock, records the boundary and releases it without a coroutine of its own.
        core = shared.change_now()
        if core is None:
            await host._seal(execution, turn_index, copied)
            return
        try:
            index = execution.seal(turn_index, copied, shared.wall_clock())
            if not core.seal_boundary(execution.key, index, turn_index, shared.clock()):
                await host._park(core, execution)
        finally:
            shared.changed()

    async def model_call(self, factory: Callable[[], Awaitable[T]]) -> T:
        """Issue a model call that counts as parked at the last boundary.

        Make it right after a boundary (the usual turn shape): a restore continues from
        that boundary and issues the call again. A reply arriving while a checkpoint is
        open is held until resume; a call the model refuses with ADMISSION_CLOSED parks
        and is retried after resume. Before the first boundary it is a plain call.

        Any call that is safe to issue again after a restore fits here, not only model
        calls: a group-scored REPLAY verify, which waits on siblings a checkpoint may
        park, must be made this way or the episode blocks its own checkpoint.
        """
        return await self._host._model_call(self._ex, factory)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        stream: GenerationStream,
    ) -> Generation:
        """The turn's generation, streamed through ``stream``; cut and continued as needed.

        A model call made right after a boundary, like :meth:`model_call` (parked while
        a checkpoint is open). When the agent sets ``cuts_generations``, the request
        accepts cuts: a checkpoint that closes admission cuts the stream at a token
        boundary, the prefix is saved with the boundary, and after resume (or a restore)
        the generation continues from prompt plus prefix; the tokens come back in order,
        each once, each with its weights version. Asked again for the same prompt and
        budget after a restore, it continues the saved generation (or returns it, if it
        had finished). ``stream`` must forward ``accept_cut`` and yield every chunk.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return await self._host._generate(self._ex, tuple(prompt_token_ids), max_new_tokens, stream)

    async def seed(self, resources: ResourcesConnection, task: Mapping[str, Any]) -> bool:
        """Create this episode's session on ``resources`` (a parked call, retried on a
        transient fault: seeding is idempotent). True when it already existed."""
        episode = self.episode
        return await self._host._tool_call(self._ex, lambda: resources.seed(episode, task))

    async def call(
        self, resources: ResourcesConnection, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """Run a tool on ``resources``, exactly once across retries and restores.

        The call's key derives from the rollout, the last boundary's turn and the call's
        index after that boundary (docs/spec.md section 6.12): a restored attempt that
        continues from the boundary re-sends the same keys, and the resources server
        answers each one it already ran from the session's record. So make the same
        calls, in the same order, with the same arguments after each boundary; a key
        re-sent with other arguments fails with
        :class:`~turnpoint.participant_sdk.EffectConflictError`. A parked call like
        :meth:`model_call`; a transient fault (the reply lost, the server unreachable)
        is retried with the same key, at most 3 times.
        """
        episode = self.episode
        key = effect_key(episode.rollout_id, self._ex.next_call_position())
        return await self._host._tool_call(
            self._ex, lambda: resources.call(episode, tool, arguments, request_id=key)
        )

    async def verify(self, resources: ResourcesConnection, answer: Mapping[str, Any]) -> Verdict:
        """Score the final answer on ``resources``: keyed, parked and retried like
        :meth:`call` (a group-scored REPLAY verify included)."""
        episode = self.episode
        key = effect_key(episode.rollout_id, self._ex.next_call_position())
        return await self._host._tool_call(
            self._ex, lambda: resources.verify(episode, answer, request_id=key)
        )

    async def mark_restart(self) -> None:
        """This episode cannot be captured (it starts over after a restore).

        Takes effect at once while no checkpoint is open, else at the next resume.
        """
        async with self._host._shared.changing() as core:
            core.mark_restart(self._ex.key, self._host._shared.now())


def _copied_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a boundary's state that shares nothing mutable with the agent."""
    return json_copy_object(state)


class _ReceiptIds:
    """Receipt ids ``rc-`` + 24 random hex digits: a valid protocol id, unique per completion.

    The random digits are drawn from the OS in batches: one system call per receipt
    cost a tenth of an episode's bookkeeping. Every id still gets its own fresh bytes.
    """

    _DIGITS = 24
    _BATCH = 64

    def __init__(self) -> None:
        self._pool = ""
        self._at = 0

    def next(self) -> str:
        if self._at >= len(self._pool):
            self._pool = secrets.token_hex(self._DIGITS // 2 * self._BATCH)
            self._at = 0
        start = self._at
        self._at += self._DIGITS
        return "rc-" + self._pool[start : self._at]


class AgentHost:
    """Hosts one :class:`Agent`: its executions, their parking and their export."""

    slot = SLOT
    kind = ParticipantKind.AGENT

    def __init__(self, shared: Shared, agent: Agent) -> None:
        if agent.recovery_mode not in (RecoveryMode.EXPORTED, RecoveryMode.RESTART_ONLY):
            raise ConfigurationError(
                f"{type(agent).__name__} declares recovery_mode "
                f"{agent.recovery_mode.name}: an agent is EXPORTED or RESTART_ONLY"
            )
        self._shared = shared
        self._agent = agent
        # An agent that exports the states it sealed (Agent.export_states as it is)
        # exports, for a saved turn, what the SDK holds: the record of a turn and task
        # that did not change since the last snapshot is that snapshot's record.
        self._exports_sealed = getattr(agent.export_states, "__func__", None) is Agent.export_states
        self._executions: dict[EpisodeId, _Execution] = {}
        self._receipt_ids = _ReceiptIds()
        # A restart-only agent's episode is a restart from its start: in no cut, never
        # parked, never blocking a prepare (docs/spec.md section 5.2 item 7).
        self._admitted_state = (
            EpisodeState.RESTART
            if agent.recovery_mode is RecoveryMode.RESTART_ONLY
            else EpisodeState.RUNNING
        )

    @property
    def recovery_mode(self) -> RecoveryMode:
        return self._agent.recovery_mode

    @property
    def _restart_only(self) -> bool:
        return self._agent.recovery_mode is RecoveryMode.RESTART_ONLY

    @property
    def record_key(self) -> str | None:
        return None if self._restart_only else SLOT

    def describe(self) -> Mapping[str, object]:
        return {
            "environment": self._agent.environment,
            "cuts_generations": self._agent.cuts_generations,
        }

    # ------------------------------------------------------------------ data plane

    async def run_episode(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        *,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
        weights_change: WeightsChange | None = None,
    ) -> AsyncGenerator[BoundaryReport | RunResult, None]:
        """Run (or re-attach to) one episode: its boundary reports, then its result.

        A new episode while a checkpoint holds admission is ADMISSION_CLOSED; a restored
        attempt N+1 may start (it parks before doing work). Re-invoked for a completed
        episode it returns the kept result; re-invoked while it runs it attaches (the
        boundaries after ``boundaries_seen``, then live), never a second execution.
        Closing or cancelling the iterator (the gRPC call was cancelled) cancels the
        execution once no other caller follows it: it finishes as CANCELLED, owes no
        acknowledgement, and a boundary it sealed stays committable (a later Run of the
        same attempt continues from it). Adapters must close the iterator
        (``contextlib.aclosing``) when their call ends. ``budget_s`` (None or 0: none) is
        active time: parked time does not count. ``weights_change`` (None: the agent's
        own :attr:`Agent.weights_change`) says what ``ctx.generate`` does with a
        generation that spans a weight update; the coordinator sends it on every Run.
        """
        stream = await self.accept_run(
            episode,
            task,
            boundaries_seen=boundaries_seen,
            budget_s=budget_s,
            weights_change=weights_change,
        )
        async with contextlib.aclosing(stream):
            async for event in stream:
                yield event

    async def accept_run(
        self,
        episode: EpisodeId,
        task: Mapping[str, Any],
        *,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
        weights_change: WeightsChange | None = None,
        wait_for_admission: bool = False,
    ) -> AsyncGenerator[BoundaryReport | RunResult, None]:
        """Accept a Run (raising ADMISSION_CLOSED, STALE_ATTEMPT, ... at once), then follow it.

        With ``wait_for_admission`` a new attempt that arrives while a checkpoint holds
        admission waits (outside the work table: in no cut, blocking no prepare) until
        admission reopens, at most ``run_admission_wait_s``; then it is refused after all
        (docs/spec.md section 5.2 item 1).

        Splitting acceptance from following lets the wire layer tell the caller that the
        participant now owns the attempt before the first boundary (docs/spec.md section
        7: an attempt counts as dispatched only once its Run was accepted). The returned
        stream is the same as :meth:`run_episode`'s and must be closed the same way; a
        stream that is never iterated leaves the execution running, followed by nobody,
        until a caller re-attaches or it is retired.
        """
        if boundaries_seen < 0:
            raise TurnpointError(
                Reason.INVALID_ARGUMENT,
                "boundaries_seen must be >= 0",
                {"field": "boundaries_seen"},
            )
        if budget_s is not None and (budget_s < 0 or budget_s != budget_s):
            raise TurnpointError(
                Reason.INVALID_ARGUMENT, "budget must be >= 0", {"field": "budget"}
            )
        if weights_change is not None and not isinstance(weights_change, WeightsChange):
            raise TurnpointError(
                Reason.INVALID_ARGUMENT,
                f"weights_change must be a WeightsChange, got {weights_change!r}",
                {"field": "weights_change"},
            )
        waited_until: float | None = None
        while True:
            try:
                async with self._shared.changing() as core:
                    execution = self._attach(
                        core, episode, dict(task), budget_s or None, weights_change
                    )
                return self._follow(execution, episode, boundaries_seen)
            except TurnpointError as error:
                if not wait_for_admission or error.reason is not Reason.ADMISSION_CLOSED:
                    raise
                loop = asyncio.get_running_loop()
                if waited_until is None:
                    waited_until = loop.time() + self._shared.config.run_admission_wait_s
                try:
                    async with asyncio.timeout_at(waited_until), self._shared.cond:
                        await self._shared.wait_admission_open()
                except TimeoutError:
                    raise error from None

    async def _follow(
        self, execution: _Execution, episode: EpisodeId, boundaries_seen: int
    ) -> AsyncGenerator[BoundaryReport | RunResult, None]:
        execution.followers += 1
        delivered = False
        seen = 0
        try:
            while True:
                # Boundaries and the result change only inside synchronous steps of a
                # change: reading them between two awaits needs no lock.
                while len(execution.boundaries) <= seen and execution.result is None:
                    await execution.news()
                batch = execution.boundaries[seen:]
                seen = len(execution.boundaries)
                result = execution.result
                for report in batch:
                    if not boundaries_seen or report.boundary_index > boundaries_seen:
                        yield report
                if result is not None:
                    if execution.stop is _RETIRED:
                        raise TurnpointError(
                            Reason.STALE_ATTEMPT,
                            f"{episode} was retired while it ran",
                            {"episode": str(episode)},
                        )
                    delivered = True
                    yield result
                    return
        finally:
            execution.followers -= 1
            if not delivered and execution.followers == 0 and execution.result is None:
                self._cancel(execution, _Stop.CANCELLED)

    def _attach(
        self,
        core: ParticipantCore,
        episode: EpisodeId,
        task: dict[str, Any],
        budget_s: float | None,
        weights_change: WeightsChange | None = None,
    ) -> _Execution:
        now = self._shared.clock()
        existing = self._executions.get(episode)
        if existing is not None:
            # A new execution is checked by admit or claim_restored below.
            core.check_attempt(episode)
        if (
            existing is not None
            and not existing.claimable
            and existing.runner is None
            and existing.result is None
        ):
            self._executions.pop(episode)  # nothing saved, nothing running: start over
            existing = None
        if existing is not None and not existing.claimable:
            _same_task(existing, task)
            if weights_change is not None:
                # A re-attach carries the coordinator's current say; it applies from the
                # generation's next decision on.
                existing.weights_change = weights_change
            return existing
        if existing is not None:
            # Restored (or cancelled at a boundary): this run continues from the saved turn.
            _same_task(existing, task)
            execution = _Execution(episode, task, existing.saved, budget_s, now, weights_change)
            execution.restored = existing.saved
            core.claim_restored(
                execution.key,
                EpisodeState.RUNNING if core.admission_open else EpisodeState.PARKED,
                now,
            )
        else:
            execution = _Execution(episode, task, None, budget_s, now, weights_change)
            # A restart-only agent's episode is a restart from its start: in no cut, never
            # parked, never blocking a prepare (docs/spec.md section 5.2 item 7).
            core.admit(execution.key, self._admitted_state, now)
        self._executions[episode] = execution
        execution.runner = asyncio.get_running_loop().create_task(
            # str(episode) spelled out: its __str__ is a Python call per episode.
            self._execute(execution),
            name=f"turnpoint-run-{episode.rollout_id}#{episode.attempt}",
        )
        return execution

    async def acknowledge(
        self, receipts: Iterable[CompletionReceipt]
    ) -> tuple[int, tuple[CompletionReceipt, ...]]:
        acknowledged = 0
        unknown: list[CompletionReceipt] = []
        async with self._shared.changing() as core:
            for receipt in receipts:
                key = core.acknowledge(receipt)
                if key is None or key.slot != SLOT:
                    unknown.append(receipt)
                    continue
                core.remove(key, self._shared.clock())
                execution = self._executions.get(receipt.episode)
                if (
                    execution is not None
                    and execution.result is not None
                    and (execution.result.receipt is receipt or execution.result.receipt == receipt)
                ):
                    del self._executions[receipt.episode]
                acknowledged += 1
        return acknowledged, tuple(unknown)

    # ------------------------------------------------------------------ executions

    def _cancel(self, execution: _Execution, reason: _Stop) -> None:
        if execution.stop is None and execution.runner is not None:
            execution.stop = reason
            execution.runner.cancel()

    async def _execute(self, execution: _Execution) -> None:
        watchdog = (
            asyncio.create_task(self._watch_budget(execution))
            if execution.budget_s is not None
            else None
        )
        outcome = _COMPLETED
        value: Mapping[str, Any] = {}
        message = ""
        try:
            if execution.restored is not None:
                async with self._shared.changing() as core:
                    await self._hold(core, execution)
            value = await self._agent.run(EpisodeContext(self, execution), execution.task)
            if type(value) is not dict and not isinstance(value, Mapping):
                raise TypeError(f"run returned {type(value).__name__}, not a mapping")
        except asyncio.CancelledError:
            if execution.stop is None:
                execution.stop = _Stop.SHUTDOWN
        except Exception as error:  # noqa: BLE001 - the agent's failure is this episode's result
            outcome = RunOutcome.FAILED
            message = f"{type(error).__name__}: {error}"
        finally:
            if watchdog is not None:
                watchdog.cancel()
        if execution.stop is not None:
            outcome = (
                RunOutcome.BUDGET_EXHAUSTED
                if execution.stop is _Stop.BUDGET
                else RunOutcome.CANCELLED
            )
        async with self._shared.changing() as core:
            self._finish(core, execution, outcome, value, message)

    def _finish(
        self,
        core: ParticipantCore,
        execution: _Execution,
        outcome: RunOutcome,
        value: Mapping[str, Any],
        message: str,
    ) -> None:
        now = self._shared.clock()
        turns = execution.boundary_index
        active = execution.clock.active(now)
        execution.runner = None
        key = execution.key
        mine = self._executions.get(execution.episode) is execution
        if outcome is _CANCELLED:
            execution.result = _run_result(
                execution.episode, outcome, None, {}, turns, active, message
            )
            execution.tell()
            if execution.stop in (_Stop.RETIRED, _Stop.SHUTDOWN) or not mine:
                return  # the retire (or shutdown) frees it
            if execution.has_boundary and not self._restart_only and core.state_of(key) is not None:
                # Nothing owed, but the sealed boundary stays committable and claimable.
                core.set_state(
                    key,
                    EpisodeState.PARKED,
                    now,
                    detail=f"cancelled at boundary {execution.boundary_index}",
                )
            else:
                core.remove(key, now)
                del self._executions[execution.episode]
            return
        # A valid protocol id (the wire validates it), unique per completion.
        receipt = _receipt(execution.episode, self._receipt_ids.next())
        execution.result = _run_result(
            execution.episode, outcome, receipt, dict(value), turns, active, message
        )
        execution.tell()
        if mine and core.state_of(key) is not None:
            core.set_state(key, _UNACKED, now, receipt=receipt, detail=_DETAIL[outcome])

    async def _hold(self, core: ParticipantCore, execution: _Execution) -> None:
        """Park at the last boundary until admission opens (lock held)."""
        shared = self._shared
        if core.runs_on(execution.key, shared.now()):
            return
        await self._park(core, execution)

    async def _park(self, core: ParticipantCore, execution: _Execution) -> None:
        """Park at the last boundary, which does not run on, until admission opens."""
        shared = self._shared
        core.set_state(execution.key, EpisodeState.PARKED, shared.now())
        execution.clock.pause(shared.now())
        await shared.wait_admission_open()
        core.set_state(execution.key, EpisodeState.RUNNING, shared.now())
        execution.clock.resume(shared.now())

    async def _seal(self, execution: _Execution, turn_index: int, state: dict[str, Any]) -> None:
        """Seal a boundary once the lock is free (:meth:`EpisodeContext.boundary`)."""
        shared = self._shared
        async with shared.changing() as core:
            index = execution.seal(turn_index, state, shared.wall_clock())
            if not core.seal_boundary(execution.key, index, turn_index, shared.clock()):
                await self._park(core, execution)

    async def _model_call(self, execution: _Execution, factory: Callable[[], Awaitable[T]]) -> T:
        if not execution.has_boundary:
            return await factory()
        shared = self._shared
        while True:
            async with shared.changing() as core:
                core.set_state(execution.key, EpisodeState.AWAITING_MODEL, shared.now())
                if not core.admission_open:
                    # Closed since the boundary: the call waits, parked, instead of issuing.
                    execution.clock.pause(shared.now())
                    await shared.wait_admission_open()
                    execution.clock.resume(shared.now())
            try:
                reply = await factory()
            except TurnpointError as error:
                if error.reason is not Reason.ADMISSION_CLOSED:
                    await self._running(execution)
                    raise
                await self._after_refusal()
                continue
            except asyncio.CancelledError:
                raise
            except Exception:
                await self._running(execution)
                raise
            async with shared.changing() as core:
                # A reply that arrives while a checkpoint is open is held until resume.
                await shared.wait_admission_open()
                core.set_state(execution.key, EpisodeState.RUNNING, shared.now())
                execution.clock.resume(shared.now())
            return reply

    async def _generate(
        self,
        execution: _Execution,
        prompt: tuple[int, ...],
        max_new_tokens: int,
        stream: GenerationStream,
    ) -> Generation:
        """docs/spec.md section 5.5: stream, record cuts, continue, until it finishes."""
        if execution.saved is None:
            # Before the first boundary there is nowhere to record a cut: a plain call.
            return await retried(
                lambda: self._stream_once(
                    Generation(prompt, max_new_tokens), stream, cuttable=False
                ),
                unreachable_wait_s=self._shared.config.unreachable_wait_s,
                retries=0,
                reasons=_UNREACHABLE,
                what=f"generation of {execution.episode}",
            )
        generation = execution.saved.generation
        if generation is not None and not generation.matches(prompt, max_new_tokens):
            logger.warning(
                "%s asked for another generation than the one saved with its turn; the "
                "saved one (%d tokens) is dropped",
                execution.episode,
                len(generation.token_ids),
            )
            generation = None
        if generation is None:
            generation = Generation(prompt, max_new_tokens)
        cuttable = self._agent.cuts_generations
        reruns = 0
        shared = self._shared
        while True:
            if generation.finished:
                if (
                    self._weights_change(execution) is WeightsChange.RERUN
                    and generation.spans_weight_update
                    and reruns < _MAX_WEIGHT_RERUNS
                ):
                    reruns += 1
                    generation = generation.discard()
                else:
                    await self._keep_generation(execution, generation)
                    return generation
            async with shared.changing() as core:
                core.set_state(execution.key, EpisodeState.AWAITING_MODEL, shared.now())
                if not core.admission_open:
                    execution.clock.pause(shared.now())
                    await shared.wait_admission_open()
                    execution.clock.resume(shared.now())
                if cuttable:
                    # Streaming tokens a snapshot must not lose: block until the stream
                    # ends, which a cutting model hurries at the next token.
                    core.set_state(execution.key, EpisodeState.RUNNING, shared.now())
            try:
                # A policy server lost with the stream open is replaced where it was
                # (docs/spec.md section 7.15): the request is asked again (what it had
                # streamed is dropped) until it answers, or the wait runs out.
                generation = await retried(
                    functools.partial(self._stream_once, generation, stream, cuttable),
                    unreachable_wait_s=self._shared.config.unreachable_wait_s,
                    retries=0,
                    reasons=_UNREACHABLE,
                    what=f"generation of {execution.episode}",
                )
            except TurnpointError as error:
                if error.reason is not Reason.ADMISSION_CLOSED:
                    await self._running(execution)
                    raise
                await self._after_refusal()
                continue
            except asyncio.CancelledError:
                raise
            except Exception:
                await self._running(execution)
                raise
            async with shared.changing() as core:
                # The prefix (or the finished generation) belongs to the saved turn now,
                # so a snapshot taken from here on saves it.
                assert execution.saved is not None
                execution.saved = replace(execution.saved, generation=generation)
                core.set_state(execution.key, EpisodeState.AWAITING_MODEL, shared.now())
                if not core.admission_open:
                    execution.clock.pause(shared.now())
                if generation.finished:
                    # A reply that arrives while a checkpoint is open is held until resume.
                    await shared.wait_admission_open()
                    core.set_state(execution.key, EpisodeState.RUNNING, shared.now())
                    execution.clock.resume(shared.now())
            if not generation.finished:
                # Cut: continue after resume (backing off if only the model closed).
                await self._after_refusal()
                async with shared.changing() as core:
                    execution.clock.resume(shared.now())

    def _weights_change(self, execution: _Execution) -> WeightsChange:
        """The Run's setting (the coordinator's config), else the agent's own default."""
        if execution.weights_change is not None:
            return execution.weights_change
        return self._agent.weights_change

    async def _stream_once(
        self, generation: Generation, stream: GenerationStream, cuttable: bool
    ) -> Generation:
        """One request: append what it streams; a cut leaves the generation unfinished."""
        request = replace(generation.next_request(), accept_cut=cuttable)
        streamed = 0
        chunks = stream(request)
        try:
            async for chunk in chunks:
                if chunk.cut:
                    if chunk.prefix_length != streamed + len(chunk.token_ids):
                        # A lost message: the prefix is not what the model cut at.
                        logger.warning(
                            "a cut generation reported %d tokens but %d arrived; it "
                            "starts again from its prompt",
                            chunk.prefix_length,
                            streamed + len(chunk.token_ids),
                        )
                        return generation.discard().cut()
                    generation = generation.extend(
                        chunk.token_ids, chunk.logprobs, chunk.weights_version
                    )
                    return generation.cut()
                generation = generation.extend(
                    chunk.token_ids, chunk.logprobs, chunk.weights_version
                )
                streamed += len(chunk.token_ids)
                if chunk.done:
                    break
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        return generation.finish()

    async def _keep_generation(self, execution: _Execution, generation: Generation) -> None:
        if execution.saved is None:
            return
        async with self._shared.changing():
            execution.saved = replace(execution.saved, generation=generation)

    async def _running(self, execution: _Execution) -> None:
        async with self._shared.changing() as core:
            core.set_state(execution.key, EpisodeState.RUNNING, self._shared.now())

    async def _tool_call(self, execution: _Execution, factory: Callable[[], Awaitable[T]]) -> T:
        """A keyed call, parked like a model call, retried on a lost reply or connection."""

        def with_retries() -> Awaitable[T]:
            return retried(
                factory,
                unreachable_wait_s=self._shared.config.unreachable_wait_s,
                what=f"tool call of {execution.episode}",
            )

        return await self._model_call(execution, with_retries)

    async def _after_refusal(self) -> None:
        """The model refused with ADMISSION_CLOSED: stay parked, retry after (our) resume."""
        shared = self._shared
        async with shared.locked() as core:
            if core.admission_open:
                # Our own admission is open: the model's checkpoint is not in step with
                # ours, so back off a little (or until ours closes too) before retrying.
                await shared.wait_until(
                    lambda: not core.admission_open, shared.config.model_retry_backoff_s
                )
            await shared.wait_admission_open()

    async def _watch_budget(self, execution: _Execution) -> None:
        budget = execution.budget_s
        assert budget is not None
        shared = self._shared
        async with shared.cond:
            while True:
                spent = execution.clock.active(shared.now())
                if spent >= budget:
                    self._cancel(execution, _Stop.BUDGET)
                    return
                # Paused (parked by a checkpoint): nothing to time until something changes.
                await shared.wait_change(None if execution.clock.paused else budget - spent)

    # ------------------------------------------------------------------ kind hooks

    async def admission_closed(self) -> None:
        now = self._shared.clock()
        for execution in self._awaiting_model():
            execution.clock.pause(now)
        await self._agent.admission_closed()

    async def admission_opened(self) -> None:
        now = self._shared.clock()
        for execution in self._awaiting_model():
            execution.clock.resume(now)
        await self._agent.admission_opened()

    def _awaiting_model(self) -> Iterator[_Execution]:
        """The executions waiting on a model call: parked by a checkpoint, their budget
        clocks stop while it holds admission."""
        executions = self._executions
        for episode in self._shared.view.episodes_in(EpisodeState.AWAITING_MODEL, SLOT):
            execution = executions.get(episode)
            if execution is not None:
                yield execution

    async def export(self, keys: Sequence[WorkKey]) -> list[PlainRecord]:
        saved: dict[EpisodeId, SavedTurn] = {}
        for key in keys:
            execution = self._executions.get(key.episode)
            if execution is None or execution.saved is None:
                raise TurnpointError(
                    Reason.INVALID_CHECKPOINT_STATE,
                    f"{key.episode} has no sealed boundary to export",
                    {"episode": str(key.episode)},
                )
            saved[key.episode] = execution.saved
        sealed = self._exports_sealed
        states: Mapping[EpisodeId, Mapping[str, Any]] = (
            {} if sealed else await self._agent.export_states(MappingProxyType(saved))
        )
        # Plain records at once, each member the SDK does not own (the task the agent was
        # given, the state it exported, a generation) checked and copied alone: the
        # payload around them is made here, and a walk of it would only visit it again.
        records: list[PlainRecord] = []
        executions = self._executions
        for episode, turn in saved.items():
            execution = executions[episode]
            if sealed:
                kept = execution.exported
                # A saved turn is never changed, only replaced; the task is compared.
                if kept is not None and kept[0] is turn and kept[1] == execution.task:
                    records.append(kept[2])
                    continue
                state = turn.state
            elif episode in states:
                state = states[episode]
            else:
                raise TurnpointError(
                    Reason.INVALID_CHECKPOINT_STATE,
                    f"the agent's export left out {episode}",
                    {"episode": str(episode)},
                )
            payload: dict[str, Any] = {
                "task": plain_member(episode, SLOT, "task", execution.task),
                "boundary_index": turn.boundary_index,
                "turn_index": turn.turn_index,
                "state": plain_member(episode, SLOT, "state", state),
            }
            if turn.generation is not None:
                payload[_GENERATION_FIELD] = plain_member(
                    episode, SLOT, _GENERATION_FIELD, turn.generation.to_json()
                )
            record = PlainRecord(episode, SLOT, payload)
            if sealed:
                execution.exported = (turn, json_copy_object(execution.task), record)
            records.append(record)
        return records

    def validate(self, record: Record) -> None:
        payload = record.payload
        if set(payload) - {_GENERATION_FIELD} != _PAYLOAD_FIELDS:
            raise invalid_record(
                record, f"fields {sorted(payload)} are not {sorted(_PAYLOAD_FIELDS)}"
            )
        if _GENERATION_FIELD in payload:
            try:
                Generation.from_json(payload[_GENERATION_FIELD])
            except ValueError as error:
                raise invalid_record(record, str(error)) from error
        index, turn = payload["boundary_index"], payload["turn_index"]
        for name, value, least in (("boundary_index", index, 1), ("turn_index", turn, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise invalid_record(record, f"{name} must be an integer >= {least}")
        if not isinstance(payload["task"], Mapping) or not isinstance(payload["state"], Mapping):
            raise invalid_record(record, "task and state must be objects")
        try:
            self._agent.validate_state(record.episode, payload["state"])
        except (ValueError, TypeError, KeyError) as error:
            raise invalid_record(record, str(error)) from error

    async def install(self, record: Record, episode: EpisodeId) -> WorkKey:
        payload = record.payload
        generation = (
            Generation.from_json(payload[_GENERATION_FIELD])
            if _GENERATION_FIELD in payload
            else None
        )
        saved = SavedTurn(
            payload["boundary_index"], payload["turn_index"], payload["state"], generation
        )
        execution = _Execution(episode, dict(payload["task"]), saved, None, self._shared.now())
        async with self._shared.changing() as core:
            core.install_restored(
                execution.key, saved.boundary_index, saved.turn_index, self._shared.now()
            )
            self._executions[episode] = execution
        return execution.key

    async def stop(self, key: WorkKey) -> None:
        execution = self._executions.get(key.episode)
        if execution is None:
            return
        runner = execution.runner
        if runner is not None:
            self._cancel(execution, _Stop.RETIRED)
            await asyncio.wait([runner])
        if self._executions.get(key.episode) is execution:
            del self._executions[key.episode]

    async def aclose(self) -> None:
        runners = []
        for execution in list(self._executions.values()):
            if execution.runner is not None:
                runners.append(execution.runner)
                self._cancel(execution, _Stop.SHUTDOWN)
        if runners:
            await asyncio.wait(runners)


def _same_task(execution: _Execution, task: Mapping[str, Any]) -> None:
    if execution.task != task:
        raise TurnpointError(
            Reason.INVALID_ARGUMENT,
            f"{execution.episode} is held here with another task",
            {"episode": str(execution.episode), "field": "task"},
        )
