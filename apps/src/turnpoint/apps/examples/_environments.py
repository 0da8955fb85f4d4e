"""Three environments on the participant SDK, each with exported sessions.

- ``counter``: the smallest, the guide's :class:`.guide_resources.CounterTools` (its
  example of exported state, docs/participant.md).
- :class:`BlackjackTools` (``blackjack``): a hand against a seeded shoe; the state carries
  the generator's exact position (:mod:`._blackjack`).
- :class:`WorkplaceTools` (``workplace``): one SQLite database per episode, tools that
  query and change it, a verifier on the final tables (:mod:`._workplace`); SQLite work
  runs in threads, one session's calls one after the other.

Every tool call may name its ``turn`` (the number of calls the session had applied before
it). At a cut the resources server may be one call ahead of the agent, so a continued
attempt may send the last call again, possibly with other arguments (its policy sampled
anew): a call naming the turn before the current one is answered from the session as it
was before that call, never applied on top of it. Each session keeps that one earlier
state, and exports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from turnpoint.apps.examples._blackjack import BlackjackStateError, Hand
from turnpoint.apps.examples._participants import VerifierLog
from turnpoint.apps.examples._workplace import (
    ToolInputError,
    WorkplaceStateError,
    decode_database,
    dump_database,
    load_database,
    make_goal,
    run_tool,
    seed_database,
    verify_goal,
)
from turnpoint.apps.examples.guide_resources import CounterTools
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    ParticipantError,
    RecoveryMode,
    ResourcesServer,
    Verdict,
    VerifyMode,
)

BLACKJACK = "blackjack"
WORKPLACE = "workplace"


@contextlib.contextmanager
def bad_input(field: str, environment: str) -> Iterator[None]:
    """The caller's data did not fit the environment: INVALID_ARGUMENT, not a crash."""
    try:
        yield
    except (ValueError, TypeError, KeyError, OverflowError) as error:
        raise ParticipantError(
            Reason.INVALID_ARGUMENT,
            f"{field} does not fit the {environment} environment: {error}",
            {"field": field},
        ) from None


def _int(value: object, name: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _strict(state: Mapping[str, Any], fields: frozenset[str], what: str) -> None:
    if not isinstance(state, Mapping) or set(state) != fields:
        raise ValueError(f"{what} holds exactly {sorted(fields)}")


def call_turn(arguments: Mapping[str, Any], applied: int) -> int:
    """The turn a call names (default: the next one); only it or the one before it."""
    turn = _int(arguments.get("turn", applied), "turn")
    if turn not in (applied, applied - 1) or turn < 0:
        raise ValueError(f"turn {turn} is neither the next call ({applied}) nor the last")
    return turn


def _missing(episode: EpisodeId) -> ParticipantError:
    return ParticipantError(
        Reason.NOT_FOUND, f"no session for {episode}", {"episode": str(episode)}
    )


def _logged(name: str, log: VerifierLog, episode: EpisodeId, verdict: Verdict) -> Verdict:
    """The demo's reward audit: every reward a verifier returned, one line each."""
    log.write(
        verifier=name,
        rollout_id=episode.rollout_id,
        attempt=episode.attempt,
        reward=verdict.reward,
    )
    return verdict


# --------------------------------------------------------------------------- blackjack


_HAND_FIELDS = frozenset(("hand", "turn", "before"))


@dataclass
class _Table:
    hand: Hand
    turn: int = 0
    before: dict[str, Any] | None = None


class BlackjackTools(ResourcesServer):
    """``look``, ``hit`` and ``stand`` on a hand dealt from the task's seeded shoe."""

    recovery_mode: ClassVar[RecoveryMode] = RecoveryMode.EXPORTED
    verify_mode: ClassVar[VerifyMode] = VerifyMode.WAIT
    environment: ClassVar[str] = BLACKJACK

    def __init__(self, name: str = BLACKJACK, log: VerifierLog | None = None) -> None:
        self.name, self.log = name, log or VerifierLog(None)
        self.tables: dict[EpisodeId, _Table] = {}

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        with bad_input("task", BLACKJACK):
            seed = _int(task["seed"], "seed")
        if episode not in self.tables:
            self.tables[episode] = _Table(Hand.deal(seed))

    def _table(self, episode: EpisodeId) -> _Table:
        table = self.tables.get(episode)
        if table is None:
            raise _missing(episode)
        return table

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        table = self._table(episode)
        if tool == "look":
            return table.hand.view()
        with bad_input("arguments", BLACKJACK):
            if tool not in ("hit", "stand"):
                raise ValueError(f"unknown tool {tool!r}; tools: look, hit, stand")
            turn = call_turn(arguments, table.turn)
            if turn != table.turn and table.before is None:
                raise ValueError("no earlier state to answer the last call from")
        if turn != table.turn:
            assert table.before is not None
            table.hand = Hand.from_dict(table.before)
        table.before = table.hand.to_dict()
        table.turn = turn + 1
        if tool == "hit":
            table.hand.hit()
        else:
            table.hand.stand()
        return table.hand.view()

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        hand = self._table(episode).hand
        verdict = Verdict(hand.reward(), {"outcome": hand.outcome()})
        return _logged(self.name, self.log, episode, verdict)

    async def close(self, episode: EpisodeId) -> None:
        self.tables.pop(episode, None)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        return {
            e: {"hand": t.hand.to_dict(), "turn": t.turn, "before": t.before}
            for e in episodes
            if (t := self.tables.get(e)) is not None
        }

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        _strict(state, _HAND_FIELDS, "a blackjack session")
        Hand.from_dict(state["hand"])
        if state["before"] is not None:
            Hand.from_dict(state["before"])
        if not isinstance(state["turn"], int) or isinstance(state["turn"], bool):
            raise BlackjackStateError("turn must be an integer")

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        before = state["before"]
        self.tables[episode] = _Table(
            Hand.from_dict(state["hand"]), state["turn"], None if before is None else dict(before)
        )

    async def retire_session(self, episode: EpisodeId) -> None:
        self.tables.pop(episode, None)


# --------------------------------------------------------------------------- workplace


_OFFICE_FIELDS = frozenset(("goal", "turn", "tables", "before"))


@dataclass
class _Office:
    goal: dict[str, Any]
    database: sqlite3.Connection
    turn: int = 0
    before: dict[str, Any] | None = None
    # One session's SQLite work runs one call after the other, each in a thread.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _check_goal(goal: object) -> dict[str, Any]:
    _strict(goal, frozenset(("customer", "day")), "a workplace goal")  # type: ignore[arg-type]
    assert isinstance(goal, Mapping)
    if not isinstance(goal["customer"], str):
        raise WorkplaceStateError("goal.customer must be a string")
    return {"customer": goal["customer"], "day": _int(goal["day"], "goal.day")}


class WorkplaceTools(ResourcesServer):
    """Per-episode SQLite tables (customers, calendar, email) and a verifier on them."""

    recovery_mode: ClassVar[RecoveryMode] = RecoveryMode.EXPORTED
    verify_mode: ClassVar[VerifyMode] = VerifyMode.WAIT
    environment: ClassVar[str] = WORKPLACE

    def __init__(self, name: str = WORKPLACE, log: VerifierLog | None = None) -> None:
        self.name, self.log = name, log or VerifierLog(None)
        self.offices: dict[EpisodeId, _Office] = {}

    async def seed(self, episode: EpisodeId, task: Mapping[str, Any]) -> None:
        with bad_input("task", WORKPLACE):
            seed = _int(task["seed"], "seed")
        if episode in self.offices:
            return
        database = await asyncio.to_thread(seed_database, seed)
        if episode in self.offices:  # a concurrent retry of the same seed won
            database.close()
            return
        self.offices[episode] = _Office(make_goal(seed), database)

    def _office(self, episode: EpisodeId) -> _Office:
        office = self.offices.get(episode)
        if office is None:
            raise _missing(episode)
        return office

    async def call(
        self, episode: EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        office = self._office(episode)
        async with office.lock:
            with bad_input("arguments", WORKPLACE):
                turn = call_turn(arguments, office.turn)
                if turn != office.turn and office.before is None:
                    raise ValueError("no earlier state to answer the last call from")
                reply = await asyncio.to_thread(self._apply, office, turn, tool, arguments)
            return {"turn": turn, "result": reply}

    @staticmethod
    def _apply(office: _Office, turn: int, tool: str, arguments: Mapping[str, Any]) -> Any:
        """In a thread: run the tool, from the state before the last call if it repeats
        that call's turn; a tool that fails changes nothing."""
        rewinding = turn != office.turn
        if rewinding:
            assert office.before is not None  # call() refused a rewind without one
            database = load_database(office.before)
        else:
            database = office.database
        before = office.before if rewinding else dump_database(office.database)
        database.execute("SAVEPOINT call")
        try:
            reply = run_tool(database, tool, arguments)
        except (ToolInputError, sqlite3.Error) as error:
            database.execute("ROLLBACK TO call")
            database.execute("RELEASE call")
            if rewinding:
                database.close()
            raise ToolInputError(str(error)) from None
        database.execute("RELEASE call")
        if rewinding:
            office.database.close()
            office.database = database
        office.before, office.turn = before, turn + 1
        return reply

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        office = self._office(episode)
        async with office.lock:
            reward = await asyncio.to_thread(verify_goal, office.database, office.goal)
        return _logged(self.name, self.log, episode, Verdict(reward, {"goal": dict(office.goal)}))

    async def close(self, episode: EpisodeId) -> None:
        office = self.offices.pop(episode, None)
        if office is not None:
            async with office.lock:
                await asyncio.to_thread(office.database.close)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        # The cut holds the sessions still (no call runs during a checkpoint); each dump
        # takes its session's lock only, so other episodes are never stopped for it.
        exported: dict[EpisodeId, Mapping[str, Any]] = {}
        for episode in episodes:
            office = self.offices.get(episode)
            if office is None:
                continue
            async with office.lock:
                tables = await asyncio.to_thread(dump_database, office.database)
            exported[episode] = {
                "goal": dict(office.goal),
                "turn": office.turn,
                "tables": tables,
                "before": office.before,
            }
        return exported

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        # Pure decoding only (no database is built here): validation runs on the loop.
        _strict(state, _OFFICE_FIELDS, "a workplace session")
        _check_goal(state["goal"])
        _int(state["turn"], "turn")
        decode_database(state["tables"])
        if state["before"] is not None:
            decode_database(state["before"])

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        database = await asyncio.to_thread(load_database, state["tables"])
        before = state["before"]
        self.offices[episode] = _Office(
            _check_goal(state["goal"]),
            database,
            int(state["turn"]),
            None if before is None else dict(before),
        )

    async def retire_session(self, episode: EpisodeId) -> None:
        await self.close(episode)


def build_environment(environment: str, name: str, log: VerifierLog) -> ResourcesServer:
    """The resources server of ``environment`` (``counter``, ``blackjack``, ``workplace``)."""
    if environment == "counter":
        return CounterTools()
    if environment == BLACKJACK:
        return BlackjackTools(name, log)
    if environment == WORKPLACE:
        return WorkplaceTools(name, log)
    raise ValueError(f"no environment {environment!r}: counter, blackjack or workplace")
