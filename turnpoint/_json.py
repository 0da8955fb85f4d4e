"""Strict JSON reading: the one parser for every file turnpoint reads back.

A file that parses in more than one way is refused rather than guessed at: a key that
appears twice in one object (the stdlib keeps the last one silently), ``NaN``,
``Infinity`` and ``-Infinity`` (not JSON, though the stdlib accepts them), and nesting
deep enough to exhaust the interpreter's recursion limit all raise
:class:`StrictJSONError` (docs/spec.md sections 8.5 and 8.6 require this of manifests).

The error carries why (:class:`JSONProblem`) and the offending key or constant, so each
reader wraps it into its own error type and words it for its own users, never by
parsing the message.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Final, NoReturn

__all__ = ["JSONProblem", "StrictJSONError", "loads_strict"]


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
