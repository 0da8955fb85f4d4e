"""Blackjack against a seeded shoe: the game and its exact state codec (pure Python).

A hand is dealt from an endless shoe: each card is ``rng.randrange(13)`` of one
:class:`random.Random` seeded from the task. The session's state is the two hands, whether
the hand is over, and the generator's *position* (its Mersenne Twister state, 625 words,
not its seed): a session restored from it deals the very card an uninterrupted one would
have dealt next. Re-seeding instead would deal the first cards of the shoe again.

Tools: ``hit`` (one card to the player; over 21 ends the hand) and ``stand`` (the dealer
draws to 17 and the hand ends). The verifier pays 1 for a win, 0.5 for a push, 0 for a
loss or an unfinished hand.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

# Ranks 1..13 (ace .. king); tens and faces count 10, an ace 1 or 11.
_RANKS = 13
_DEALER_STANDS_AT = 17
_BLACKJACK = 21
_MT_WORDS = 624  # the Mersenne Twister's state words; one more entry is its index
_MT_VERSION = 3
STATE_FIELDS = frozenset(("player", "dealer", "done", "rng"))
_RNG_FIELDS = frozenset(("version", "words", "gauss_next"))


class BlackjackStateError(ValueError):
    """A saved hand cannot be restored: the message says which field and why."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def hand_value(cards: Sequence[int]) -> int:
    """The best total of a hand: one ace counts 11 when that does not bust it."""
    total = sum(min(rank, 10) for rank in cards)
    if 1 in cards and total + 10 <= _BLACKJACK:
        total += 10
    return total


def export_rng(rng: random.Random) -> dict[str, Any]:
    """The generator's exact position as plain JSON (625 ints and the gauss cache)."""
    version, internal, gauss_next = rng.getstate()
    return {"version": version, "words": list(internal), "gauss_next": gauss_next}


def import_rng(state: Mapping[str, Any]) -> random.Random:
    """A generator at the position :func:`export_rng` saved; BlackjackStateError if bad."""
    if not isinstance(state, Mapping) or set(state) != _RNG_FIELDS:
        raise BlackjackStateError(f"rng must hold exactly {sorted(_RNG_FIELDS)}")
    words, gauss_next = state["words"], state["gauss_next"]
    if state["version"] != _MT_VERSION or not _is_int(state["version"]):
        raise BlackjackStateError(f"rng.version must be {_MT_VERSION}")
    if not isinstance(words, list) or len(words) != _MT_WORDS + 1:
        raise BlackjackStateError(f"rng.words must be {_MT_WORDS + 1} integers")
    if not all(_is_int(w) and 0 <= w < 2**32 for w in words[:_MT_WORDS]):
        raise BlackjackStateError("rng.words must be 32-bit unsigned integers")
    if not _is_int(words[-1]) or not 0 <= words[-1] <= _MT_WORDS:
        raise BlackjackStateError(f"rng.words' last entry (the index) must be 0..{_MT_WORDS}")
    if gauss_next is not None and not isinstance(gauss_next, float):
        raise BlackjackStateError("rng.gauss_next must be null or a float")
    rng = random.Random()
    rng.setstate((_MT_VERSION, tuple(words), gauss_next))
    return rng


@dataclass
class Hand:
    """One episode's session: the hands, whether it is over, and the shoe's generator."""

    player: list[int]
    dealer: list[int]
    done: bool
    rng: random.Random

    @classmethod
    def deal(cls, seed: int) -> Self:
        rng = random.Random(seed)
        hand = cls([], [], False, rng)
        for cards in (hand.player, hand.dealer, hand.player, hand.dealer):
            cards.append(hand.draw())
        return hand

    def draw(self) -> int:
        return self.rng.randrange(_RANKS) + 1

    def hit(self) -> None:
        if not self.done:
            self.player.append(self.draw())
            self.done = hand_value(self.player) > _BLACKJACK

    def stand(self) -> None:
        if not self.done:
            while hand_value(self.dealer) < _DEALER_STANDS_AT:
                self.dealer.append(self.draw())
            self.done = True

    def outcome(self) -> str:
        """``win``, ``push``, ``loss``, or ``playing`` while the hand is not over."""
        if not self.done:
            return "playing"
        player, dealer = hand_value(self.player), hand_value(self.dealer)
        if player > _BLACKJACK:
            return "loss"
        if dealer > _BLACKJACK or player > dealer:
            return "win"
        return "push" if player == dealer else "loss"

    def reward(self) -> float:
        return {"win": 1.0, "push": 0.5}.get(self.outcome(), 0.0)

    def view(self) -> dict[str, Any]:
        """What a tool call answers: the player's cards, the dealer's up card (all of the
        dealer's once the hand is over) and the outcome."""
        return {
            "player": list(self.player),
            "player_total": hand_value(self.player),
            "dealer": list(self.dealer) if self.done else self.dealer[:1],
            "done": self.done,
            "outcome": self.outcome(),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "player": list(self.player),
            "dealer": list(self.dealer),
            "done": self.done,
            "rng": export_rng(self.rng),
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Self:
        if not isinstance(state, Mapping) or set(state) != STATE_FIELDS:
            raise BlackjackStateError(f"a hand's state holds exactly {sorted(STATE_FIELDS)}")
        for name in ("player", "dealer"):
            cards = state[name]
            if not isinstance(cards, list) or not all(
                _is_int(c) and 1 <= c <= _RANKS for c in cards
            ):
                raise BlackjackStateError(f"{name} must be a list of ranks 1..{_RANKS}")
        if not isinstance(state["done"], bool):
            raise BlackjackStateError("done must be a bool")
        return cls(
            list(state["player"]), list(state["dealer"]), state["done"], import_rng(state["rng"])
        )
