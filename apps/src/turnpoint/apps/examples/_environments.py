"""Three environments on the participant SDK, each with exported sessions.

- ``counter``: the smallest, the guide's :class:`.guide_resources.CounterTools` (its
  example of exported state, docs/participant.md).
- :class:`BlackjackTools` (``blackjack``): a hand against a seeded shoe; the state carries
  the generator's exact position (:mod:`._blackjack`).
- :class:`WorkplaceTools` (``workplace``): one SQLite database per episode, tools that
  query and change it, a verifier on the final tables (:mod:`._workplace`); SQLite work
  runs in threads, one session's calls one after the other.

At a cut the resources server may be one call ahead of the agent, so a continued attempt
sends the last call again. The servers here need no replay logic of their own for it:
the agent's calls are keyed (``ctx.call``), and the SDK's resources runtime answers a
key the session's reply record holds without running the tool again (docs/spec.md
section 6.12). Blackjack and the workplace log each execution of a tool that changes the
session (:class:`._participants.ToolExecutions`; the turn is the call's ``turn``
argument) and keep the ids their session applied, for the demo's audit of effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from turnpoint.apps.examples._blackjack import BlackjackStateError, Hand
from turnpoint.apps.examples._participants import ToolExecutions, VerifierLog
from turnpoint.apps.examples._plays import reply_text
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
    """The agent's turn a call names (default: the number of calls applied before it),
    for the audit only: the session applies calls in the order they come."""
    turn = _int(arguments.get("turn", applied), "turn")
    if turn < 0:
        raise ValueError(f"turn must be >= 0, got {turn}")
    return turn


def _executions(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(e, str) for e in value):
        raise ValueError("executions must be a list of execution ids")
    return list(value)


def _missing(episode: EpisodeId) -> ParticipantError:
    return ParticipantError(
        Reason.NOT_FOUND, f"no session for {episode}", {"episode": str(episode)}
    )


def _logged(
    name: str, log: VerifierLog, episode: EpisodeId, verdict: Verdict, executions: list[str]
) -> Verdict:
    """The demo's reward audit: every reward a verifier returned, one line each, with the
    tool executions the session had applied (the audit of effects)."""
    log.write(
        verifier=name,
        rollout_id=episode.rollout_id,
        attempt=episode.attempt,
        reward=verdict.reward,
        executions=list(executions),
    )
    return verdict


# --------------------------------------------------------------------------- blackjack


_HAND_FIELDS = frozenset(("hand", "executions"))


@dataclass
class _Table:
    hand: Hand
    # The ids of the tool executions applied to the hand, in order (the audit's).
    executions: list[str] = field(default_factory=list)


class BlackjackTools(ResourcesServer):
    """``look``, ``hit`` and ``stand`` on a hand dealt from the task's seeded shoe."""

    recovery_mode: ClassVar[RecoveryMode] = RecoveryMode.EXPORTED
    verify_mode: ClassVar[VerifyMode] = VerifyMode.WAIT
    environment: ClassVar[str] = BLACKJACK

    def __init__(self, name: str = BLACKJACK, log: VerifierLog | None = None) -> None:
        self.name, self.log = name, log or VerifierLog(None)
        self.tables: dict[EpisodeId, _Table] = {}
        self.executions = ToolExecutions(name, self.log)

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
            turn = call_turn(arguments, len(table.executions))
        # Not idempotent (a card is dealt): the SDK's reply record answers a re-sent key.
        if tool == "hit":
            table.hand.hit()
        else:
            table.hand.stand()
        view = table.hand.view()
        table.executions.append(self.executions.applied(episode, turn, reply_text(view)))
        return view

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        table = self._table(episode)
        verdict = Verdict(table.hand.reward(), {"outcome": table.hand.outcome()})
        return _logged(self.name, self.log, episode, verdict, table.executions)

    async def close(self, episode: EpisodeId) -> None:
        self.tables.pop(episode, None)

    async def export_sessions(
        self, episodes: Sequence[EpisodeId]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        return {
            e: {"hand": t.hand.to_dict(), "executions": list(t.executions)}
            for e in episodes
            if (t := self.tables.get(e)) is not None
        }

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        _strict(state, _HAND_FIELDS, "a blackjack session")
        Hand.from_dict(state["hand"])
        try:
            _executions(state["executions"])
        except ValueError as error:
            raise BlackjackStateError(str(error)) from None

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        self.tables[episode] = _Table(
            Hand.from_dict(state["hand"]), _executions(state["executions"])
        )

    async def retire_session(self, episode: EpisodeId) -> None:
        self.tables.pop(episode, None)


# --------------------------------------------------------------------------- workplace


_OFFICE_FIELDS = frozenset(("goal", "tables", "executions"))
# The tools that change the tables: each execution is logged for the audit.
_WRITES = frozenset(("schedule", "send_email", "set_balance"))


@dataclass
class _Office:
    goal: dict[str, Any]
    database: sqlite3.Connection
    # The ids of the writing tool executions applied to the tables, in order.
    executions: list[str] = field(default_factory=list)
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
        self.executions = ToolExecutions(name, self.log)

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
                turn = call_turn(arguments, len(office.executions))
                result = await asyncio.to_thread(self._apply, office.database, tool, arguments)
            reply = {"result": result}
            if tool in _WRITES:
                execution = self.executions.applied(episode, turn, reply_text(reply), tool=tool)
                office.executions.append(execution)
            return reply

    @staticmethod
    def _apply(database: sqlite3.Connection, tool: str, arguments: Mapping[str, Any]) -> Any:
        """In a thread: run the tool; a tool that fails changes nothing."""
        database.execute("SAVEPOINT call")
        try:
            reply = run_tool(database, tool, arguments)
        except (ToolInputError, sqlite3.Error) as error:
            database.execute("ROLLBACK TO call")
            database.execute("RELEASE call")
            raise ToolInputError(str(error)) from None
        database.execute("RELEASE call")
        return reply

    async def verify(self, episode: EpisodeId, answer: Mapping[str, Any]) -> Verdict:
        office = self._office(episode)
        async with office.lock:
            reward = await asyncio.to_thread(verify_goal, office.database, office.goal)
        verdict = Verdict(reward, {"goal": dict(office.goal)})
        return _logged(self.name, self.log, episode, verdict, office.executions)

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
                "tables": tables,
                "executions": list(office.executions),
            }
        return exported

    def validate_session(self, episode: EpisodeId, state: Mapping[str, Any]) -> None:
        # Pure decoding only (no database is built here): validation runs on the loop.
        _strict(state, _OFFICE_FIELDS, "a workplace session")
        _check_goal(state["goal"])
        decode_database(state["tables"])
        _executions(state["executions"])

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        database = await asyncio.to_thread(load_database, state["tables"])
        self.offices[episode] = _Office(
            _check_goal(state["goal"]), database, _executions(state["executions"])
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
