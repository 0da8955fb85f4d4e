"""The example environment: guess a hidden digit inside a shown range, with a checking tool.

A prompt shows a range ``[low, high]`` of digits and hides a ``target`` inside it. An
episode runs up to ``max_turns`` turns; in each the agent asks the policy for a few tokens,
reads the first digit among them as its guess, and calls the resources server's ``check``
tool, which answers higher, lower, correct or invalid. The reply is appended to the
model's context, so a policy that has learned the task guesses inside the range first and
then moves the way the tool points. The episode's answer (its guess of every turn) goes to
a verifier, which rewards being close early and hitting the target soon.

Two verifiers share the task: :func:`per_sibling_reward` scores one answer alone and
:func:`group_rewards` scores each answer relative to the best of its prompt group, so it
cannot score anyone before all N siblings have answered.

Everything here is pure and deterministic: the same seed gives the same prompts, the
same call gives the same reply, and all state is a small frozen dataclass with a JSON
form that a participant can export into a snapshot.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Self, TypeGuard

from turnpoint.ids import validate_id

MAX_NEW_TOKENS_PER_TURN = 3
"""Tokens the agent asks the policy for in one turn; one digit is all a guess needs."""

GROUP_WEIGHT = 0.25
"""Share of the group-scored reward that depends on the siblings (see :func:`group_rewards`)."""

Answer = tuple[int | None, ...]
"""An episode's answer: the digit guessed in each turn, None for a turn without one."""

# A guess earns something up to this distance from the target: the widest range shown
# is this wide, so any guess inside the shown range already beats a random digit while
# only the exact digit (found through the tool's hints) earns full marks.
_REWARD_RADIUS = 3
# Narrow ranges keep the start near chance (a random digit rarely lands inside) and the
# task learnable in tens of steps by a model of a few ten thousand parameters.
_RANGE_WIDTHS = (1, 2, 3)
_DEFAULT_MAX_TURNS = 3


class Token(IntEnum):
    """The model's vocabulary."""

    BOS = 0
    EOS = 1
    TURN = 2  # the model speaks next
    RANGE = 3  # followed by the low and high digit of the prompt
    DIGIT_0 = 4
    DIGIT_1 = 5
    DIGIT_2 = 6
    DIGIT_3 = 7
    DIGIT_4 = 8
    DIGIT_5 = 9
    DIGIT_6 = 10
    DIGIT_7 = 11
    DIGIT_8 = 12
    DIGIT_9 = 13
    HIGHER = 14
    LOWER = 15
    CORRECT = 16
    INVALID = 17


VOCAB_SIZE = len(Token)


class Reply(StrEnum):
    """What the ``check`` tool answers; the string form is what travels on the wire."""

    HIGHER = "higher"  # the target is above the guess
    LOWER = "lower"  # the target is below the guess
    CORRECT = "correct"
    INVALID = "invalid"  # no digit guessed, or the call budget is spent

    @property
    def token(self) -> Token:
        return _REPLY_TOKENS[self]


_REPLY_TOKENS = {
    Reply.HIGHER: Token.HIGHER,
    Reply.LOWER: Token.LOWER,
    Reply.CORRECT: Token.CORRECT,
    Reply.INVALID: Token.INVALID,
}


def _digit_token(digit: int) -> int:
    return Token.DIGIT_0 + digit


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; True is not a number here.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_digit(value: object) -> TypeGuard[int]:
    return _is_int(value) and 0 <= value <= 9


def _strict_fields(cls_name: str, data: Mapping[str, Any], fields: frozenset[str]) -> None:
    unknown = sorted(set(data) - fields)
    missing = sorted(fields - set(data))
    if unknown or missing:
        raise ValueError(f"{cls_name}: unknown fields {unknown}, missing fields {missing}")


@dataclass(frozen=True, slots=True)
class Task:
    """One prompt. ``target`` rides along because the tool and the verifiers need it; the
    model's context (:func:`encode_context`) never contains it."""

    prompt_id: str
    seed: int
    group_index: int
    low: int
    high: int
    target: int
    max_turns: int = _DEFAULT_MAX_TURNS

    def __post_init__(self) -> None:
        # Tasks arrive from JSON on other processes: check the types, not just the values.
        validate_id(self.prompt_id, "prompt_id")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int: {self}")
        if not _is_int(self.group_index) or self.group_index < 0:
            raise ValueError(f"group_index must be an int >= 0: {self}")
        if not all(_is_digit(value) for value in (self.low, self.high, self.target)):
            raise ValueError(f"low, high and target must be digits: {self}")
        if not self.low <= self.target <= self.high:
            raise ValueError(f"target must lie in [low, high]: {self}")
        if not _is_int(self.max_turns) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1: {self}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_id": self.prompt_id,
            "seed": self.seed,
            "group_index": self.group_index,
            "low": self.low,
            "high": self.high,
            "target": self.target,
            "max_turns": self.max_turns,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        _strict_fields("Task", data, _TASK_FIELDS)
        return cls(**data)


_TASK_FIELDS = frozenset(("prompt_id", "seed", "group_index", "low", "high", "target", "max_turns"))


def make_prompt(group_index: int, seed: int, *, max_turns: int = _DEFAULT_MAX_TURNS) -> Task:
    """The prompt of group ``group_index`` in the prompt stream of ``seed``.

    Each prompt is drawn from its own RNG keyed by ``(seed, group_index)``, so any prompt
    can be rebuilt alone (after a restore, on another process) without replaying the stream.
    """
    if group_index < 0:
        raise ValueError(f"group_index must be >= 0, got {group_index}")
    key = hashlib.sha256(f"turnpoint-guess/{seed}/{group_index}".encode()).digest()
    rng = random.Random(int.from_bytes(key[:8], "big"))
    width = rng.choice(_RANGE_WIDTHS)
    low = rng.randint(0, 9 - width)
    target = rng.randint(low, low + width)
    return Task(
        prompt_id=f"guess-{seed}-{group_index}",
        seed=seed,
        group_index=group_index,
        low=low,
        high=low + width,
        target=target,
        max_turns=max_turns,
    )


@dataclass(frozen=True, slots=True)
class ToolSession:
    """The resources server's state for one episode's ``check`` tool."""

    calls: int = 0
    solved: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "solved": self.solved}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        _strict_fields("ToolSession", data, _SESSION_FIELDS)
        calls, solved = data["calls"], data["solved"]
        if not _is_int(calls) or calls < 0:
            raise ValueError(f"ToolSession.calls must be an int >= 0, got {calls!r}")
        if not isinstance(solved, bool):
            raise ValueError(f"ToolSession.solved must be a bool, got {solved!r}")
        return cls(calls=calls, solved=solved)


_SESSION_FIELDS = frozenset(("calls", "solved"))


@dataclass(frozen=True, slots=True)
class ToolResult:
    reply: Reply
    session: ToolSession


def tool_call(task: Task, session: ToolSession, arguments: Mapping[str, Any]) -> ToolResult:
    """Answer ``check(guess)`` and return the reply with the session after the call.

    ``arguments`` is the call's JSON object, ``{"guess": <digit or null>}``. Anything that
    is not a digit, and any call past the task's turn budget, is answered ``invalid`` (the
    call still counts: a spent turn is spent).
    """
    guess = arguments.get("guess")
    calls = session.calls + 1
    if calls > task.max_turns or not _is_digit(guess):
        return ToolResult(Reply.INVALID, ToolSession(calls=calls, solved=session.solved))
    if guess == task.target:
        return ToolResult(Reply.CORRECT, ToolSession(calls=calls, solved=True))
    reply = Reply.HIGHER if task.target > guess else Reply.LOWER
    return ToolResult(reply, ToolSession(calls=calls, solved=session.solved))


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished turn on the agent's side: what the model said and what the tool replied."""

    completion: tuple[int, ...]
    reply: Reply

    @property
    def guess(self) -> int | None:
        return parse_guess(self.completion)

    def to_dict(self) -> dict[str, Any]:
        return {"completion": list(self.completion), "reply": self.reply.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        _strict_fields("Turn", data, _TURN_FIELDS)
        completion = data["completion"]
        if not isinstance(completion, list | tuple) or not all(
            _is_int(token) and 0 <= token < VOCAB_SIZE for token in completion
        ):
            raise ValueError(f"Turn.completion must be a list of tokens, got {completion!r}")
        return cls(completion=tuple(completion), reply=Reply(data["reply"]))


_TURN_FIELDS = frozenset(("completion", "reply"))


def encode_context(task: Task, turns: Sequence[Turn]) -> list[int]:
    """The model input for the next turn: the shown range, every past turn, then ``TURN``.

    The context of turn k+1 extends the context of turn k by exactly that turn's completion
    and reply, so one episode is a single growing token stream.
    """
    context = [Token.BOS, Token.RANGE, _digit_token(task.low), _digit_token(task.high)]
    for turn in turns:
        context.append(Token.TURN)
        context.extend(turn.completion)
        context.append(turn.reply.token)
    context.append(Token.TURN)
    return [int(token) for token in context]


def parse_guess(completion: Sequence[int]) -> int | None:
    """The first digit the model emitted this turn, or None if it emitted none."""
    for token in completion:
        if Token.DIGIT_0 <= token <= Token.DIGIT_9:
            return token - Token.DIGIT_0
    return None


def is_finished(task: Task, turns: Sequence[Turn]) -> bool:
    """True once the tool said correct or the turn budget is spent."""
    return len(turns) >= task.max_turns or (bool(turns) and turns[-1].reply is Reply.CORRECT)


def episode_answer(turns: Sequence[Turn]) -> Answer:
    """What the agent submits to the verifier: its guess of every turn (None where it made none)."""
    return tuple(turn.guess for turn in turns)


def _closeness(task: Task, guess: object) -> float:
    if not _is_digit(guess):
        return 0.0
    return max(0.0, 1.0 - abs(guess - task.target) / _REWARD_RADIUS)


def per_sibling_reward(task: Task, answer: Sequence[object]) -> float:
    """Reward in [0, 1] for one episode's answer alone: how close it was, averaged over turns.

    Each of the task's ``max_turns`` turns scores the closeness of that turn's guess (1 when
    exact, falling linearly to 0 at a distance of three, 0 for no digit); once a guess is
    exact every remaining turn scores 1, and a turn the agent never played scores 0. So the
    reward grows with every turn spent near the target and is 1 only for a first-turn hit:
    each turn's guess earns credit, not only the last one, which is what lets a policy
    learn the early turns.
    """
    if not isinstance(answer, list | tuple):
        raise ValueError(f"an answer is a list of per-turn guesses, got {type(answer).__name__}")
    total = 0.0
    for turn_index, guess in enumerate(answer[: task.max_turns]):
        if guess == task.target and _is_digit(guess):
            total += task.max_turns - turn_index
            break
        total += _closeness(task, guess)
    return total / task.max_turns


def group_rewards(task: Task, answers: Sequence[Sequence[object]]) -> list[float]:
    """Rewards in [0, 1] for the N sibling answers of one prompt, each relative to the group.

    Sibling i earns ``(1 - GROUP_WEIGHT) * own_i + GROUP_WEIGHT * own_i / best`` where
    ``own`` is :func:`per_sibling_reward` and ``best`` the highest ``own`` in the group: a
    partial success is worth more when no sibling did better. Every sibling's reward can move
    when any other sibling's answer changes, which is why this verifier waits for all N.
    """
    if not answers:
        raise ValueError("group_rewards needs at least one answer")
    own = [per_sibling_reward(task, answer) for answer in answers]
    best = max(own)
    if best == 0.0:
        return [0.0] * len(own)
    return [(1.0 - GROUP_WEIGHT) * value + GROUP_WEIGHT * value / best for value in own]
