"""The workplace environment: one SQLite database per episode, its tools, its verifier,
and an exact codec for its tables (plain, blocking Python: the server runs it in threads).

An episode's database holds three tables (``customers``, ``calendar``, ``email``) filled
from the task's seed. The goal, also drawn from the seed, asks the agent to email one
customer and to book a meeting with them on one day; the verifier checks the final
tables for both.

The codec (:func:`dump_database` / :func:`load_database`, for rowid tables) saves every
table's ``CREATE`` statement, its rows in rowid order with their rowids, and every cell
with its storage class: ``null``, ``{"int": "<decimal>"}``, ``{"real": "<16 hex digits
of the IEEE double>"}`` (bit-exact: infinities, -0.0 and NaN payloads survive; SQLite
itself turns a NaN it is given into NULL), ``{"text": "..."}`` and ``{"blob": "<hex>"}``.
Decoding checks everything before it creates anything, so a damaged state installs
nothing.
"""

from __future__ import annotations

import random
import sqlite3
import struct
from collections.abc import Mapping
from typing import Any

SCHEMA = (
    "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, balance REAL, "
    "note TEXT, avatar BLOB)",
    "CREATE TABLE calendar (id INTEGER PRIMARY KEY, title TEXT NOT NULL, day INTEGER NOT "
    "NULL, hour REAL, attendee TEXT)",
    "CREATE TABLE email (id INTEGER PRIMARY KEY, recipient TEXT NOT NULL, subject TEXT, body TEXT)",
)
_NAMES = ("ada", "bo", "cy", "di", "ed", "flo", "gus", "hal")
_DAYS = 5
_CREATE_PREFIXES = ("CREATE TABLE ", "CREATE INDEX ", "CREATE UNIQUE INDEX ")
TOOLS = ("find_customer", "list_day", "schedule", "send_email", "set_balance")


class WorkplaceStateError(ValueError):
    """A saved database cannot be restored: the message says where and why."""


class ToolInputError(ValueError):
    """A tool call's arguments do not fit the tool."""


# --------------------------------------------------------------------------- cells


def encode_cell(value: object) -> Any:
    """One SQLite value as JSON, exact to its storage class and bits."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError("SQLite has no booleans")
    if isinstance(value, int):
        return {"int": str(value)}
    if isinstance(value, float):
        return {"real": struct.pack(">d", value).hex()}
    if isinstance(value, str):
        return {"text": value}
    if isinstance(value, bytes):
        return {"blob": value.hex()}
    raise TypeError(f"{type(value).__name__} is not an SQLite value")


def decode_cell(cell: object) -> Any:
    """The value :func:`encode_cell` wrote; WorkplaceStateError if it is not one."""
    if cell is None:
        return None
    if not isinstance(cell, Mapping) or len(cell) != 1:
        raise WorkplaceStateError(f"a cell is null or one tagged value, not {cell!r}")
    ((tag, text),) = cell.items()
    if not isinstance(text, str):
        raise WorkplaceStateError(f"a {tag} cell holds a string, not {text!r}")
    try:
        if tag == "int":
            number = int(text, 10)
            if not -(2**63) <= number < 2**63:
                raise WorkplaceStateError(f"{text} is outside SQLite's 64-bit integers")
            return number
        if tag == "real":
            if len(text) != 16:
                raise WorkplaceStateError(f"a real cell is 16 hex digits, not {text!r}")
            return struct.unpack(">d", bytes.fromhex(text))[0]
        if tag == "text":
            return text
        if tag == "blob":
            return bytes.fromhex(text)
    except ValueError as error:
        raise WorkplaceStateError(f"bad {tag} cell {text!r}: {error}") from None
    raise WorkplaceStateError(f"unknown cell tag {tag!r}")


# --------------------------------------------------------------------------- tables


def _check_create(sql: object) -> str:
    if not isinstance(sql, str) or not sql.upper().startswith(_CREATE_PREFIXES):
        raise WorkplaceStateError(f"a schema entry is one CREATE TABLE or INDEX, not {sql!r}")
    if not sqlite3.complete_statement(sql + ";") or ";" in sql:
        raise WorkplaceStateError(f"a schema entry is one statement: {sql!r}")
    return sql


def dump_database(connection: sqlite3.Connection) -> dict[str, Any]:
    """Every table (schema, then rows in rowid order with their rowids) as plain JSON."""
    objects = connection.execute(
        "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
        "AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
    ).fetchall()
    tables: list[dict[str, Any]] = []
    indexes: list[str] = []
    for kind, name, sql in objects:
        if kind == "index":
            indexes.append(sql)
        elif kind == "table":
            rows = connection.execute(
                f"SELECT rowid, * FROM {_quoted(name)} ORDER BY rowid"
            ).fetchall()
            tables.append(
                {"sql": sql, "rows": [[encode_cell(cell) for cell in row] for row in rows]}
            )
    return {"tables": tables, "indexes": indexes}


def decode_database(
    state: Mapping[str, Any],
) -> tuple[list[tuple[str, list[list[Any]]]], list[str]]:
    if not isinstance(state, Mapping) or set(state) != {"tables", "indexes"}:
        raise WorkplaceStateError("a database's state holds exactly 'tables' and 'indexes'")
    tables, indexes = state["tables"], state["indexes"]
    if not isinstance(tables, list) or not isinstance(indexes, list):
        raise WorkplaceStateError("tables and indexes are lists")
    decoded: list[tuple[str, list[list[Any]]]] = []
    for number, table in enumerate(tables):
        if not isinstance(table, Mapping) or set(table) != {"sql", "rows"}:
            raise WorkplaceStateError(f"table #{number} holds exactly 'sql' and 'rows'")
        rows = table["rows"]
        if not isinstance(rows, list) or not all(isinstance(row, list) and row for row in rows):
            raise WorkplaceStateError(f"table #{number}: rows are non-empty lists")
        values = [[decode_cell(cell) for cell in row] for row in rows]
        if not all(isinstance(row[0], int) for row in values):
            raise WorkplaceStateError(f"table #{number}: each row starts with its rowid")
        if len({len(row) for row in values}) > 1:
            raise WorkplaceStateError(f"table #{number}: rows of different widths")
        decoded.append((_check_create(table["sql"]), values))
    return decoded, [_check_create(sql) for sql in indexes]


def validate_database(state: Mapping[str, Any]) -> None:
    """Raise WorkplaceStateError unless :func:`load_database` would install ``state``."""
    connection = load_database(state)
    connection.close()


def load_database(state: Mapping[str, Any]) -> sqlite3.Connection:
    """A new in-memory database holding exactly what :func:`dump_database` saved."""
    tables, indexes = decode_database(state)
    connection = new_connection()
    try:
        for sql, rows in tables:
            connection.execute(sql)
            name = connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid DESC LIMIT 1"
            ).fetchone()[0]
            if rows:
                width = len(rows[0])
                columns = len(connection.execute(f"PRAGMA table_info({_quoted(name)})").fetchall())
                if width != columns + 1:
                    raise WorkplaceStateError(
                        f"table {name!r}: rows of {width - 1} values for {columns} columns"
                    )
                marks = ", ".join("?" * width)
                connection.executemany(
                    f"INSERT INTO {_quoted(name)} (rowid, {_column_list(connection, name)}) "
                    f"VALUES ({marks})",
                    rows,
                )
        for sql in indexes:
            connection.execute(sql)
        connection.commit()
    except sqlite3.Error as error:
        connection.close()
        raise WorkplaceStateError(f"the saved schema or rows do not load: {error}") from None
    except BaseException:
        connection.close()
        raise
    return connection


def _quoted(identifier: str) -> str:
    """An SQL identifier quoted, whatever it holds (names come from saved schemas)."""
    return '"' + identifier.replace('"', '""') + '"'


def _column_list(connection: sqlite3.Connection, table: str) -> str:
    columns = connection.execute(f"PRAGMA table_info({_quoted(table)})").fetchall()
    return ", ".join(_quoted(column[1]) for column in columns)


def new_connection() -> sqlite3.Connection:
    # One episode's database is used by one thread at a time (the server serialises
    # each session's calls), but not always the same thread.
    return sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)


# --------------------------------------------------------------------------- the task


def make_goal(seed: int) -> dict[str, Any]:
    rng = random.Random(f"turnpoint-workplace/{seed}")
    return {"customer": rng.choice(_NAMES), "day": rng.randrange(_DAYS)}


def seed_database(seed: int) -> sqlite3.Connection:
    """The episode's starting tables, all drawn from ``seed`` (odd values included)."""
    rng = random.Random(f"turnpoint-workplace/{seed}/tables")
    connection = new_connection()
    for sql in SCHEMA:
        connection.execute(sql)
    odd_balances = (float("inf"), float("-inf"), -0.0, None)
    for index, name in enumerate(_NAMES):
        balance = odd_balances[index] if index < len(odd_balances) else rng.uniform(-50, 500)
        avatar = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 6))) or None
        note = None if rng.random() < 0.3 else f"since {2000 + rng.randrange(25)}"
        connection.execute(
            "INSERT INTO customers (name, balance, note, avatar) VALUES (?, ?, ?, ?)",
            (name, balance, note, avatar),
        )
    for _ in range(rng.randrange(2, 5)):
        connection.execute(
            "INSERT INTO calendar (title, day, hour, attendee) VALUES (?, ?, ?, ?)",
            ("standup", rng.randrange(_DAYS), 9.5, None),
        )
    return connection


def _text(value: object) -> Any:
    """A cell as a tool reply shows it: floats in their repr, so inf, -0.0 and NaN are
    exact on the wire too (a protobuf Struct cannot carry them as numbers to every
    reader), blobs as hex, integers as numbers."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def _argument(arguments: Mapping[str, Any], name: str, kind: type) -> Any:
    value = arguments.get(name)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ToolInputError(f"argument {name!r} must be a {kind.__name__}")
    return value


def run_tool(connection: sqlite3.Connection, tool: str, arguments: Mapping[str, Any]) -> Any:
    """Run one tool against the episode's database and return its reply (plain JSON)."""
    if tool == "find_customer":
        row = connection.execute(
            "SELECT id, name, balance, note, avatar FROM customers WHERE name = ?",
            (_argument(arguments, "name", str),),
        ).fetchone()
        keys = ("id", "name", "balance", "note", "avatar")
        return (
            {"found": False}
            if row is None
            else {"found": True, **dict(zip(keys, map(_text, row), strict=True))}
        )
    if tool == "list_day":
        rows = connection.execute(
            "SELECT id, title, hour, attendee FROM calendar WHERE day = ? ORDER BY rowid",
            (_argument(arguments, "day", int),),
        ).fetchall()
        return {"events": [[_text(cell) for cell in row] for row in rows]}
    if tool == "schedule":
        cursor = connection.execute(
            "INSERT INTO calendar (title, day, hour, attendee) VALUES (?, ?, ?, ?)",
            (
                _argument(arguments, "title", str),
                _argument(arguments, "day", int),
                float(_argument(arguments, "hour", int)),
                _argument(arguments, "attendee", str),
            ),
        )
        return {"event_id": cursor.lastrowid}
    if tool == "send_email":
        cursor = connection.execute(
            "INSERT INTO email (recipient, subject, body) VALUES (?, ?, ?)",
            (
                _argument(arguments, "recipient", str),
                _argument(arguments, "subject", str),
                arguments.get("body") if isinstance(arguments.get("body"), str) else None,
            ),
        )
        return {"email_id": cursor.lastrowid}
    if tool == "set_balance":
        amount = arguments.get("balance")
        if not isinstance(amount, int | float) or isinstance(amount, bool):
            raise ToolInputError("argument 'balance' must be a number")
        cursor = connection.execute(
            "UPDATE customers SET balance = ? WHERE name = ?",
            (float(amount), _argument(arguments, "name", str)),
        )
        return {"updated": cursor.rowcount}
    raise ToolInputError(f"unknown tool {tool!r}; tools: {', '.join(TOOLS)}")


def verify_goal(connection: sqlite3.Connection, goal: Mapping[str, Any]) -> float:
    """Half for an email to the goal's customer, half for a meeting with them that day."""
    customer, day = goal["customer"], goal["day"]
    emailed = connection.execute(
        "SELECT COUNT(*) FROM email WHERE recipient = ?", (customer,)
    ).fetchone()[0]
    met = connection.execute(
        "SELECT COUNT(*) FROM calendar WHERE attendee = ? AND day = ?", (customer, day)
    ).fetchone()[0]
    return 0.5 * (int(emailed) > 0) + 0.5 * (int(met) > 0)
