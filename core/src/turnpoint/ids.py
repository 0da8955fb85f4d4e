"""Identifier rules of the protocol (docs/spec.md section 2), enforced in one place.

Rollout ids, checkpoint ids, restore ids and instance names all follow the same rule:
1-128 characters of ``[A-Za-z0-9._-]``, starting with a letter or digit. Because the
first character can never be a dot and no other path separator is allowed, a valid id
is always a single, harmless path component (never ``.``, ``..`` or ``a/b``), which is
what lets the snapshot store build paths from ids without any further escaping.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple, Self

MAX_ID_LENGTH = 128
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CHECKPOINT_PATTERN = re.compile(r"(?P<prefix>[A-Za-z0-9][A-Za-z0-9._-]*?)-(?P<seq>[0-9]{1,18})")


class InvalidIdError(ValueError):
    """An identifier broke the rules of docs/spec.md section 2.

    ``field`` names what was being validated so that the wire layer can report
    ``INVALID_ARGUMENT`` with the offending field in the error metadata.
    """

    def __init__(self, field: str, value: object, why: str) -> None:
        self.field = field
        self.value = value
        self.why = why
        shown = (
            repr(value)
            if not isinstance(value, str) or len(value) <= 40
            else repr(value[:40] + "...")
        )
        super().__init__(f"invalid {field} {shown}: {why}")


def validate_id(value: object, field: str = "id") -> str:
    """Return ``value`` if it is a valid protocol id, else raise :class:`InvalidIdError`."""
    if not isinstance(value, str):
        raise InvalidIdError(field, value, "must be a string")
    if not value:
        raise InvalidIdError(field, value, "must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(field, value, f"must be at most {MAX_ID_LENGTH} characters")
    if not _ID_PATTERN.fullmatch(value):
        if not value[0].isascii() or not value[0].isalnum():
            raise InvalidIdError(field, value, "must start with a letter or digit")
        raise InvalidIdError(field, value, "may contain only letters, digits, '.', '_' and '-'")
    return value


def validate_attempt(value: object, field: str = "attempt") -> int:
    """Return ``value`` if it is a valid attempt number (an int >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidIdError(field, value, "must be an integer")
    if value < 0:
        raise InvalidIdError(field, value, "must be >= 0")
    return value


class _EpisodeFields(NamedTuple):
    rollout_id: str
    attempt: int = 0


class EpisodeId(_EpisodeFields):
    """One attempt of one rollout: ``(rollout_id, attempt)``.

    Restoring a snapshot continues attempt N as attempt N+1 (:meth:`next_attempt`);
    attempt N is then dead everywhere.

    A tuple of its two fields, checked when made: hashing, equality and order (rollout
    id, then attempt) are the tuple's, in C. A snapshot hashes and compares every
    episode it holds a dozen times on each side of the wire, and the methods a
    dataclass generates are a Python call each.
    """

    __slots__ = ()

    def __new__(cls, rollout_id: str, attempt: int = 0) -> Self:
        validate_id(rollout_id, "rollout_id")
        validate_attempt(attempt)
        return tuple.__new__(cls, (rollout_id, attempt))

    def next_attempt(self) -> EpisodeId:
        return EpisodeId(self.rollout_id, self.attempt + 1)

    def __str__(self) -> str:
        return f"{self.rollout_id}#{self.attempt}"

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse the ``rollout_id#attempt`` form produced by ``str()``."""
        rollout_id, sep, attempt = text.rpartition("#")
        if not sep or not attempt.isdigit():
            raise InvalidIdError("episode", text, "expected 'rollout_id#attempt'")
        return cls(rollout_id, int(attempt))


def episodes_of(items: Iterable[Any]) -> list[EpisodeId]:
    """The :class:`EpisodeId` of each item with ``rollout_id`` and ``attempt`` fields (a
    wire message), checked as ``EpisodeId()`` checks them, in one loop: a commit's scope
    names every episode it continues. The first invalid one raises
    :class:`InvalidIdError`, as ``EpisodeId()`` would."""
    fits = _ID_PATTERN.fullmatch
    make = tuple.__new__
    episodes: list[EpisodeId] = []
    append = episodes.append
    for item in items:
        rollout_id, attempt = item.rollout_id, item.attempt
        if (
            type(attempt) is int
            and attempt >= 0
            and type(rollout_id) is str
            and len(rollout_id) <= MAX_ID_LENGTH
            and fits(rollout_id) is not None
        ):
            append(make(EpisodeId, (rollout_id, attempt)))
        else:
            append(EpisodeId(rollout_id, attempt))  # raises what is wrong with it
    return episodes


def sorted_episodes(episodes: Iterable[EpisodeId]) -> list[EpisodeId]:
    """``sorted(episodes)``: rollout id, then attempt (the tuple's order, in C)."""
    return sorted(episodes)


def make_checkpoint_id(prefix: str, sequence: int) -> str:
    """Build a checkpoint id that carries a strictly increasing sequence number.

    The sequence is zero-padded so that ids also sort lexically in sequence order.
    """
    validate_id(prefix, "checkpoint prefix")
    if sequence < 0:
        raise InvalidIdError("checkpoint sequence", sequence, "must be >= 0")
    return validate_id(f"{prefix}-{sequence:012d}", "checkpoint_id")


def checkpoint_sequence(checkpoint_id: str) -> int:
    """Return the sequence number a checkpoint id carries (its last ``-<digits>``)."""
    validate_id(checkpoint_id, "checkpoint_id")
    match = _CHECKPOINT_PATTERN.fullmatch(checkpoint_id)
    if match is None:
        raise InvalidIdError("checkpoint_id", checkpoint_id, "must end in '-<sequence>'")
    return int(match.group("seq"))
