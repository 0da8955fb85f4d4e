"""Exactly-once effects: the key of each tool call and the record of its reply.

docs/spec.md section 6.12. A tool call changes the world (a card dealt, a file
written), so a retry or a restored attempt re-sending it must get the reply it had,
not a second run. The agent's SDK names each call with a key that derives from the
rollout, the turn (the last sealed boundary's ``turn_index``) and the call's index
after that boundary: the same on every attempt, since a restored attempt continues from
that boundary and counts its calls again from 0. The resources runtime keeps each
key's reply with the session (:class:`EffectRecord`, bounded, exported with the session
and restored with it) and answers a key it holds from the record; a key re-sent with
another tool or other arguments is refused (:class:`EffectConflictError`).

Pure: no grpc, no asyncio, no clock.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from turnpoint.errors import Reason
from turnpoint.ids import validate_id

from ._failures import ParticipantError

# The field of a session's record payload that carries its reply record (docs/spec.md
# section 5.3 item 1); a server's own export must not use it.
EFFECTS_FIELD = "turnpoint_effects"
# Replies a session keeps by default: far more than the calls of one turn, which is all
# a retry or a restore ever re-sends.
DEFAULT_REPLY_LIMIT = 256
_KEY_PREFIX = "fx"
_BEFORE_FIRST_BOUNDARY = "s"
_SEPARATOR = ":"
_FINGERPRINT_HEX = 32
_FORMAT = 1


class EffectConflictError(ParticipantError):
    """A call key the record cannot answer: re-sent with another call, or forgotten.

    ``divergence`` says which: ``operation`` (a call key re-sent as a verify or back),
    ``tool`` (another tool), ``arguments`` (other arguments) or ``forgotten`` (the key
    is older than the oldest reply the bounded record still holds). On the wire it is
    ``INVALID_ARGUMENT`` with metadata ``field`` = ``request_id``, ``request_id`` and
    ``divergence``.
    """

    def __init__(self, request_id: str, divergence: str, message: str) -> None:
        super().__init__(
            Reason.INVALID_ARGUMENT,
            message,
            {"field": "request_id", "request_id": request_id, "divergence": divergence},
        )
        self.request_id = request_id
        self.divergence = divergence

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.request_id, self.divergence, self.message))


# ----------------------------------------------------------------------- keys


@dataclass(frozen=True, slots=True, order=True)
class CallPosition:
    """Where a call stands in its rollout: after which turn, and its index after it.

    ``turn`` is None before the episode's first boundary (ordered before every turn).
    """

    turn: int | None
    index: int

    def _order(self) -> tuple[int, int]:
        return (-1 if self.turn is None else self.turn, self.index)

    def before_or_at(self, other: CallPosition) -> bool:
        return self._order() <= other._order()


def effect_key(rollout_id: str, position: CallPosition) -> str:
    """The key of one call: identical on every attempt of the rollout (``fx:r:3:0``)."""
    validate_id(rollout_id, "rollout_id")
    if position.index < 0 or (position.turn is not None and position.turn < 0):
        raise ValueError(f"a call position is never negative, got {position}")
    turn = _BEFORE_FIRST_BOUNDARY if position.turn is None else str(position.turn)
    return _SEPARATOR.join((_KEY_PREFIX, rollout_id, turn, str(position.index)))


def parse_effect_key(key: str) -> tuple[str, CallPosition] | None:
    """The rollout and position an SDK key names; None for any other request id."""
    parts = key.split(_SEPARATOR)
    if len(parts) != 4 or parts[0] != _KEY_PREFIX:
        return None
    _, rollout_id, turn, index = parts
    if not index.isdigit() or not (turn.isdigit() or turn == _BEFORE_FIRST_BOUNDARY):
        return None
    position = CallPosition(None if turn == _BEFORE_FIRST_BOUNDARY else int(turn), int(index))
    return rollout_id, position


def call_fingerprint(operation: str, tool: str, arguments: Mapping[str, Any]) -> str:
    """A digest of what a call asks: the same call gives the same digest on any process.

    Integral floats count as ints, as they do after a trip through a Struct (section 3.7).
    """
    canonical = json.dumps(
        [operation, tool, _integral(dict(arguments))],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_FINGERPRINT_HEX]


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {str(key): _integral(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_integral(item) for item in value]
    return value


# ----------------------------------------------------------------------- the record


@dataclass(frozen=True, slots=True)
class _Entry:
    operation: str
    tool: str
    fingerprint: str
    reply: Mapping[str, Any]


class EffectRecord:
    """The replies of one session's calls, by key; at most ``limit`` of them.

    The oldest reply goes first when the record is full. For SDK keys the record
    remembers the latest position it forgot, and refuses a key at or before it
    (``forgotten``) instead of letting the tool run again; another request id that was
    forgotten runs again.
    """

    def __init__(self, limit: int = DEFAULT_REPLY_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.forgotten_through: CallPosition | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def lookup(
        self, key: str, operation: str, tool: str, fingerprint: str
    ) -> Mapping[str, Any] | None:
        """The recorded reply for this key, None if the call has not run; raises
        :class:`EffectConflictError` if the key was used for another call or forgotten."""
        entry = self._entries.get(key)
        if entry is None:
            parsed = parse_effect_key(key)
            forgotten = self.forgotten_through
            if parsed is not None and forgotten is not None and parsed[1].before_or_at(forgotten):
                raise EffectConflictError(
                    key,
                    "forgotten",
                    f"call {key} is older than the {self.limit} replies the session keeps",
                )
            return None
        check_same_call(
            key, entry.operation, entry.tool, entry.fingerprint, operation, tool, fingerprint
        )
        return entry.reply

    def record(
        self, key: str, operation: str, tool: str, fingerprint: str, reply: Mapping[str, Any]
    ) -> None:
        """Keep a call's reply (a JSON object), dropping the oldest past the limit."""
        self._entries[key] = _Entry(operation, tool, fingerprint, _json_object(reply))
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            dropped, _ = self._entries.popitem(last=False)
            parsed = parse_effect_key(dropped)
            if parsed is not None:
                position = parsed[1]
                forgotten = self.forgotten_through
                if forgotten is None or forgotten.before_or_at(position):
                    self.forgotten_through = position

    # ------------------------------------------------------------------ codec

    def to_json(self) -> dict[str, Any]:
        """The record as one JSON object (the session payload's ``turnpoint_effects``)."""
        forgotten = self.forgotten_through
        return {
            "format": _FORMAT,
            "limit": self.limit,
            "forgotten_through": None
            if forgotten is None
            else {"turn": forgotten.turn, "index": forgotten.index},
            "replies": [
                {
                    "key": key,
                    "operation": entry.operation,
                    "tool": entry.tool,
                    "fingerprint": entry.fingerprint,
                    "reply": _json_object(entry.reply),
                }
                for key, entry in self._entries.items()
            ],
        }

    @classmethod
    def from_json(cls, value: object) -> EffectRecord:
        """Decode :meth:`to_json`; raises ValueError on anything else."""
        if not isinstance(value, Mapping):
            raise ValueError("the reply record must be an object")
        if value.get("format") != _FORMAT:
            raise ValueError(f"the reply record has format {value.get('format')!r}, not {_FORMAT}")
        limit = value.get("limit")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError("the reply record's limit must be an integer >= 1")
        record = cls(limit)
        forgotten = value.get("forgotten_through")
        if forgotten is not None:
            if not isinstance(forgotten, Mapping):
                raise ValueError("forgotten_through must be an object or null")
            turn, index = forgotten.get("turn"), forgotten.get("index")
            if not isinstance(index, int) or not _natural(index):
                raise ValueError("forgotten_through needs an integer index")
            if not (turn is None or (isinstance(turn, int) and _natural(turn))):
                raise ValueError("forgotten_through needs an integer turn, or null")
            record.forgotten_through = CallPosition(turn, index)
        replies = value.get("replies")
        if not isinstance(replies, list) or len(replies) > limit:
            raise ValueError(f"replies must be a list of at most {limit} entries")
        for item in replies:
            if not isinstance(item, Mapping):
                raise ValueError("each reply must be an object")
            key, operation, tool = item.get("key"), item.get("operation"), item.get("tool")
            fingerprint, reply = item.get("fingerprint"), item.get("reply")
            if not all(isinstance(text, str) for text in (key, operation, tool, fingerprint)):
                raise ValueError("a reply needs string key, operation, tool and fingerprint")
            if not isinstance(reply, Mapping):
                raise ValueError(f"the reply of {key} must be an object")
            if key in record._entries:
                raise ValueError(f"the key {key} is recorded twice")
            record._entries[str(key)] = _Entry(
                str(operation), str(tool), str(fingerprint), dict(reply)
            )
        return record


def check_same_call(
    key: str,
    held_operation: str,
    held_tool: str,
    held_fingerprint: str,
    operation: str,
    tool: str,
    fingerprint: str,
) -> None:
    """Refuse a key that names another call than the one it named first."""
    if held_operation != operation:
        raise EffectConflictError(
            key, "operation", f"{key} was a {held_operation}, re-sent as a {operation}"
        )
    if held_tool != tool:
        raise EffectConflictError(
            key, "tool", f"{key} called tool {held_tool!r}, re-sent for {tool!r}"
        )
    if held_fingerprint != fingerprint:
        raise EffectConflictError(
            key, "arguments", f"{key} was re-sent with other arguments than its first call"
        )


def split_payload(payload: Mapping[str, Any]) -> tuple[dict[str, Any], EffectRecord | None]:
    """A session record's payload as the server's own state and the reply record."""
    state = {key: value for key, value in payload.items() if key != EFFECTS_FIELD}
    raw = payload.get(EFFECTS_FIELD)
    return state, None if raw is None else EffectRecord.from_json(raw)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_object(value: Mapping[str, Any]) -> dict[str, Any]:
    copied = json.loads(json.dumps(dict(value), allow_nan=False))
    if not isinstance(copied, dict):
        raise TypeError("a reply must be a JSON object")
    return copied
