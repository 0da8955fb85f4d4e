"""Strict JSON reading: the one parser for every file turnpoint reads back; and the one
writer of its indented documents.

A file that parses in more than one way is refused rather than guessed at: a key that
appears twice in one object (the stdlib keeps the last one silently), ``NaN``,
``Infinity`` and ``-Infinity`` (not JSON, though the stdlib accepts them), and nesting
deep enough to exhaust the interpreter's recursion limit all raise
:class:`StrictJSONError` (docs/spec.md sections 8.5 and 8.6 require this of manifests).

The error carries why (:class:`JSONProblem`) and the offending key or constant, so each
reader wraps it into its own error type and words it for its own users, never by
parsing the message.

:func:`dumps_indented` writes what ``json.dumps(value, indent=2, ensure_ascii=True,
allow_nan=False)`` writes, byte for byte, at about twice its speed: with an indent the
stdlib leaves its C encoder for a pure-Python one built of generators, and the snapshot
manifest (docs/spec.md section 8.6: 2-space indent) is written at every publication.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Iterator
from json.encoder import encode_basestring_ascii
from typing import Any, Final, NoReturn


class JSONProblem(enum.Enum):
    """Why a text is not strict JSON."""

    SYNTAX = "syntax"
    DUPLICATE_KEY = "duplicate_key"
    CONSTANT = "constant"
    TOO_DEEP = "too_deep"


class StrictJSONError(ValueError):
    """The text is not strict JSON.

    ``key`` is the duplicated key (``DUPLICATE_KEY``), ``constant`` the refused name
    (``CONSTANT``: ``NaN``, ``Infinity`` or ``-Infinity``); ``detail`` is the stdlib's
    description with line and column for ``SYNTAX``.
    """

    def __init__(
        self, problem: JSONProblem, detail: str, *, key: str = "", constant: str = ""
    ) -> None:
        super().__init__(detail)
        self.problem = problem
        self.detail = detail
        self.key = key
        self.constant = constant


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise StrictJSONError(
                    JSONProblem.DUPLICATE_KEY,
                    f"JSON key {key!r} appears twice in one object",
                    key=key,
                )
            seen.add(key)
    return result


def _no_constant(name: str) -> NoReturn:
    raise StrictJSONError(JSONProblem.CONSTANT, f"{name} is not a JSON number", constant=name)


# One decoder for every call: json.loads with hooks would build a new one each time, and
# the participant store parses one document per record line.
_DECODER: Final = json.JSONDecoder(object_pairs_hook=_unique_pairs, parse_constant=_no_constant)


def loads_strict(text: str) -> Any:
    """Parse one JSON document strictly; :class:`StrictJSONError` on any problem."""
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as error:
        raise StrictJSONError(JSONProblem.SYNTAX, str(error)) from None
    except RecursionError:
        raise StrictJSONError(JSONProblem.TOO_DEEP, "nested too deeply") from None


# --------------------------------------------------------------------------- writing

_INDENT: Final = "  "
_float_repr: Final = float.__repr__
_int_repr: Final = int.__repr__
_escape: Final[Callable[[str], str]] = encode_basestring_ascii


def _float_text(value: float) -> str:
    if math.isfinite(value):
        return _float_repr(value)
    raise ValueError(f"Out of range float values are not JSON compliant: {value!r}")


def _key_text(key: object) -> str:
    # What the stdlib does with a key that is not a string.
    if isinstance(key, str):
        return _escape(key)
    if isinstance(key, float):
        return _escape(_float_text(key))
    if key is True:
        return '"true"'
    if key is False:
        return '"false"'
    if key is None:
        return '"null"'
    if isinstance(key, int):
        return _escape(_int_repr(key))
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


class FlatObjects:
    """A JSON list of objects that all have the same ``keys`` (in the order written:
    sorted, for a sorted document), each member a string or an int (not a bool), one
    tuple of values per object: what :func:`dumps_indented` writes for the list of those
    dicts, without a dict per object or a call per member. A manifest lists every
    exported, continued and restarted episode this way."""

    __slots__ = ("keys", "rows")

    def __init__(self, keys: tuple[str, ...], rows: list[tuple[str | int, ...]]) -> None:
        self.keys = keys
        self.rows = rows

    def render(self, newline: str) -> str:
        """The list's text, its first line continuing the current one, the others
        indented from ``newline``."""
        if not self.rows:
            return "[]"
        if set(map(len, self.rows)) != {len(self.keys)}:
            raise ValueError(f"every flat object has the {len(self.keys)} members {self.keys}")
        inner = newline + _INDENT
        # One template of the object; each column's texts made in C (a str column is
        # escaped, an int column written), then every object formatted from them.
        template = (
            "{"
            + inner
            + _INDENT
            + ("," + inner + _INDENT).join(
                _escape(key).replace("%", "%%") + ": %s" for key in self.keys
            )
            + inner
            + "}"
        )
        columns = [_column_texts(column) for column in zip(*self.rows, strict=True)]
        objects = map(template.__mod__, zip(*columns, strict=True))
        return "[" + inner + ("," + inner).join(objects) + newline + "]"


def _column_texts(column: tuple[str | int, ...]) -> Iterator[str]:
    kinds = set(map(type, column))
    if kinds == {str}:
        return map(_escape, column)  # type: ignore[arg-type]
    if kinds == {int}:
        return map(_int_repr, column)
    return map(_member_text, column)


def _member_text(value: str | int) -> str:
    if type(value) is str:
        return _escape(value)
    if type(value) is int:
        return _int_repr(value)
    raise TypeError(f"a flat object's member is a str or an int, not {type(value).__name__}")


def dumps_indented(value: Any, *, sort_keys: bool = False) -> str:
    """``json.dumps(value, indent=2, ensure_ascii=True, allow_nan=False, sort_keys=...)``.

    The same text, faster. Unlike the stdlib it does not look for cycles: a value that
    contains itself ends in ``RecursionError`` (no JSON document does).
    """
    parts: list[str] = []
    append = parts.append

    def encode(item: Any, newline: str) -> None:
        kind = type(item)
        if kind is str:
            append(_escape(item))
        elif item is None:
            append("null")
        elif item is True:
            append("true")
        elif item is False:
            append("false")
        elif kind is int:
            append(_int_repr(item))
        elif kind is float:
            append(_float_text(item))
        elif kind is FlatObjects:
            append(item.render(newline))
        elif kind is dict or (kind is not list and isinstance(item, dict)):
            if not item:
                append("{}")
                return
            inner = newline + _INDENT
            separator = "{" + inner
            # The keys sorted alone: sorting (key, member) pairs compares tuples.
            for key in sorted(item) if sort_keys else item:
                member = item[key]
                head = separator + (_escape(key) if type(key) is str else _key_text(key))
                # Strings and integers, most members, inline: a call per member was most
                # of the time a large document took.
                member_kind = type(member)
                if member_kind is str:
                    append(head + ": " + _escape(member))
                elif member_kind is int:
                    append(head + ": " + _int_repr(member))
                elif member_kind is FlatObjects:
                    append(head + ": " + member.render(inner))
                else:
                    append(head + ": ")
                    encode(member, inner)
                separator = "," + inner
            append(newline)
            append("}")
        elif kind is list or isinstance(item, (list, tuple)):
            if not item:
                append("[]")
                return
            inner = newline + _INDENT
            separator = "[" + inner
            for member in item:
                member_kind = type(member)
                if member_kind is str:
                    append(separator + _escape(member))
                elif member_kind is int:
                    append(separator + _int_repr(member))
                else:
                    append(separator)
                    encode(member, inner)
                separator = "," + inner
            append(newline)
            append("]")
        elif isinstance(item, str):
            append(_escape(item))
        elif isinstance(item, int):
            append(_int_repr(item))
        elif isinstance(item, float):
            append(_float_text(item))
        else:
            raise TypeError(f"Object of type {kind.__name__} is not JSON serializable")

    encode(value, "\n")
    return "".join(parts)
