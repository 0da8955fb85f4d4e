"""How an agent plays the counter, Blackjack, the workplace and coding with the tiny policy (pure).

The policy speaks the guessing game's vocabulary (:class:`._task.Token`); each
environment here maps its observations into that vocabulary and the first digit of a
completion into one tool call:

- counter (the guide's): the context shows the target; digit ``d`` is ``add(d)``, and
  the answer is the last total.
- blackjack: the context shows the player's total above 11 and the dealer's up card; an
  even digit hits, anything else stands (the last turn always stands).
- workplace: the context shows the goal's day; a digit ``d < 5`` books the goal's customer
  on day ``d``, any other digit emails them.
- coding: the context shows the task's number; a digit ``d < 4`` writes the fixed
  ``solution.py``, ``d < 6`` writes it back as it was given, ``d < 8`` runs the tests
  and any other digit runs a command that appends the turn to ``notes.txt`` (an effect
  that would show if it were applied twice).

A turn's reply comes back as one token: ``CORRECT`` when the environment says the goal
is met or the hand was won, ``HIGHER``/``LOWER`` to say which way to go (the counter) or
that the hand goes on / was lost, ``INVALID`` otherwise. The reward is the verifier's.
Each step also keeps the tool's reply as :func:`reply_text`, the form the resources
servers log each execution's reply in, so the demo's audit compares the two.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnpoint.apps.examples._coding_tasks import SOLUTION, task_of
from turnpoint.apps.examples._task import Token, parse_guess
from turnpoint.apps.examples._workplace import make_goal

MAX_TURNS = 3


def reply_text(reply: Mapping[str, Any]) -> str:
    """A tool's reply as one canonical line (keys sorted), so the tool's log and the
    agent's turn agree. These environments reply with ints, strings, booleans and lists
    only (the workplace shows a real as text), which the wire hands back unchanged."""
    return json.dumps(reply, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Step:
    """One finished turn: the completion, the tool call it became, the reply's token, and
    the tool's reply (:func:`reply_text`)."""

    completion: tuple[int, ...]
    tool: str
    reply_token: int
    reply: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "completion": list(self.completion),
            "tool": self.tool,
            "reply_token": self.reply_token,
            "reply": self.reply,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Step:
        return cls(
            tuple(int(t) for t in data["completion"]),
            str(data["tool"]),
            int(data["reply_token"]),
            str(data["reply"]),
        )


def _digit(value: int) -> int:
    return int(Token.DIGIT_0) + max(0, min(9, value))


def _context(head: Sequence[int], steps: Sequence[Step]) -> list[int]:
    context = [int(Token.BOS), int(Token.RANGE), *head]
    for step in steps:
        context.append(int(Token.TURN))
        context.extend(step.completion)
        context.append(step.reply_token)
    context.append(int(Token.TURN))
    return context


class Play:
    """One environment as the agent sees it (subclasses below)."""

    environment = ""

    def look(self, task: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """A read-only call that shows the start (None: the task shows everything)."""
        return None

    def context(
        self, task: Mapping[str, Any], shown: Mapping[str, Any], steps: Sequence[Step]
    ) -> list[int]:
        raise NotImplementedError

    def action(
        self, task: Mapping[str, Any], completion: Sequence[int], turn: int
    ) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def reply_token(self, task: Mapping[str, Any], reply: Mapping[str, Any]) -> int:
        raise NotImplementedError

    def finished(self, steps: Sequence[Step]) -> bool:
        return len(steps) >= MAX_TURNS or (bool(steps) and steps[-1].reply_token == Token.CORRECT)

    def answer(self, task: Mapping[str, Any], last: Mapping[str, Any]) -> dict[str, Any]:
        """What the verify gets, from the last tool reply (most verifiers read the tables)."""
        return {}


class CounterPlay(Play):
    environment = "counter"

    def context(
        self, task: Mapping[str, Any], shown: Mapping[str, Any], steps: Sequence[Step]
    ) -> list[int]:
        return _context([_digit(0), _digit(int(task["target"]))], steps)

    def action(
        self, task: Mapping[str, Any], completion: Sequence[int], turn: int
    ) -> tuple[str, dict[str, Any]]:
        return "add", {"add": parse_guess(completion) or 0, "turn": turn}

    def reply_token(self, task: Mapping[str, Any], reply: Mapping[str, Any]) -> int:
        total, target = int(reply["total"]), int(task["target"])
        if total == target:
            return int(Token.CORRECT)
        return int(Token.HIGHER if total < target else Token.LOWER)

    def answer(self, task: Mapping[str, Any], last: Mapping[str, Any]) -> dict[str, Any]:
        return {"total": int(last.get("total", 0))}


class BlackjackPlay(Play):
    environment = "blackjack"

    def look(self, task: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        return "look", {}

    def context(
        self, task: Mapping[str, Any], shown: Mapping[str, Any], steps: Sequence[Step]
    ) -> list[int]:
        up = min(int(shown["dealer"][0]), 10) % 10
        return _context([_digit(int(shown["player_total"]) - 12), _digit(up)], steps)

    def action(
        self, task: Mapping[str, Any], completion: Sequence[int], turn: int
    ) -> tuple[str, dict[str, Any]]:
        digit = parse_guess(completion)
        hit = digit is not None and digit % 2 == 0 and turn < MAX_TURNS - 1
        return ("hit" if hit else "stand"), {"turn": turn}

    def reply_token(self, task: Mapping[str, Any], reply: Mapping[str, Any]) -> int:
        outcome = reply["outcome"]
        if outcome == "playing":
            return int(Token.HIGHER)
        return int({"win": Token.CORRECT, "loss": Token.LOWER}.get(outcome, Token.INVALID))

    def finished(self, steps: Sequence[Step]) -> bool:
        return bool(steps) and steps[-1].reply_token != Token.HIGHER


class WorkplacePlay(Play):
    environment = "workplace"

    def context(
        self, task: Mapping[str, Any], shown: Mapping[str, Any], steps: Sequence[Step]
    ) -> list[int]:
        goal = make_goal(int(task["seed"]))
        return _context([_digit(int(goal["day"])), _digit(int(goal["day"]))], steps)

    def action(
        self, task: Mapping[str, Any], completion: Sequence[int], turn: int
    ) -> tuple[str, dict[str, Any]]:
        customer = make_goal(int(task["seed"]))["customer"]
        digit = parse_guess(completion)
        if digit is not None and digit < 5:
            meeting = {"title": "review", "day": digit, "hour": 10, "attendee": customer}
            return "schedule", {**meeting, "turn": turn}
        return "send_email", {"recipient": customer, "subject": "your account", "turn": turn}

    def reply_token(self, task: Mapping[str, Any], reply: Mapping[str, Any]) -> int:
        result = reply.get("result", {})
        return int(Token.CORRECT if isinstance(result, Mapping) and result else Token.INVALID)

    def finished(self, steps: Sequence[Step]) -> bool:
        return len(steps) >= MAX_TURNS


class CodingPlay(Play):
    environment = "coding"

    def context(
        self, task: Mapping[str, Any], shown: Mapping[str, Any], steps: Sequence[Step]
    ) -> list[int]:
        seed = int(task["seed"])
        return _context([_digit(seed % 10), _digit(seed // 10 % 10)], steps)

    def action(
        self, task: Mapping[str, Any], completion: Sequence[int], turn: int
    ) -> tuple[str, dict[str, Any]]:
        chosen = task_of(task)
        digit = parse_guess(completion)
        digit = 9 if digit is None else digit
        if digit < 6:
            content = chosen.fixed if digit < 4 else chosen.source
            return "write_file", {"path": SOLUTION, "content": content, "turn": turn}
        if digit < 8:
            return "run_tests", {"turn": turn}
        note = f"echo {turn} >> notes.txt"
        return "run", {"argv": ["sh", "-c", note], "turn": turn}

    def reply_token(self, task: Mapping[str, Any], reply: Mapping[str, Any]) -> int:
        if reply.get("passed") is True:
            return int(Token.CORRECT)
        if "written" in reply:
            return int(Token.HIGHER)
        return int(Token.LOWER if reply.get("exit_code") is not None else Token.INVALID)


PLAYS: dict[str, Play] = {
    play.environment: play
    for play in (CounterPlay(), BlackjackPlay(), WorkplacePlay(), CodingPlay())
}
