"""The three environments' state codecs: exact round trips, and damaged state refused.

Blackjack's generator position and the workplace's tables must come back exactly (any
position, any table), and a damaged or truncated state must raise before anything is
installed. The sessions' export/restore is checked through the servers' own hooks.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sqlite3
import struct
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnpoint.apps.examples._blackjack import BlackjackStateError, Hand, export_rng, import_rng
from turnpoint.apps.examples._environments import BlackjackTools, WorkplaceTools
from turnpoint.apps.examples._participants import VerifierLog
from turnpoint.apps.examples._plays import reply_text
from turnpoint.apps.examples._workplace import (
    WorkplaceStateError,
    decode_cell,
    dump_database,
    encode_cell,
    load_database,
    new_connection,
    seed_database,
)
from turnpoint.apps.examples.guide_resources import CounterTools
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import ParticipantError

# ---------------------------------------------------------------------- blackjack


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**64), draws=st.integers(0, 1500), gauss=st.booleans())
def test_rng_position_round_trips_exactly(seed: int, draws: int, gauss: bool) -> None:
    rng = random.Random(seed)
    for _ in range(draws):
        rng.randrange(13)
    if gauss:
        rng.gauss(0.0, 1.0)  # leaves a cached second value in the state
    restored = import_rng(export_rng(rng))
    assert restored.getstate() == rng.getstate()
    assert [restored.randrange(13) for _ in range(50)] == [rng.randrange(13) for _ in range(50)]


def test_a_restored_hand_deals_the_next_card_not_the_first() -> None:
    hand = Hand.deal(7)
    for _ in range(3):
        hand.hit()
    restored = Hand.from_dict(hand.to_dict())
    assert restored.rng.getstate() == hand.rng.getstate()
    assert restored.rng.getstate() != Hand.deal(7).rng.getstate()
    assert [restored.draw() for _ in range(20)] == [hand.draw() for _ in range(20)]


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s.pop("rng"),
        lambda s: s["rng"]["words"].pop(),
        lambda s: s["rng"]["words"].__setitem__(-1, 625),
        lambda s: s["rng"]["words"].__setitem__(0, -1),
        lambda s: s["rng"].__setitem__("version", 2),
        lambda s: s.__setitem__("player", [0]),
        lambda s: s.__setitem__("done", 1),
        lambda s: s.__setitem__("extra", 1),
    ],
)
def test_damaged_hands_are_refused(damage: Any) -> None:
    state = Hand.deal(1).to_dict()
    damage(state)
    with pytest.raises(BlackjackStateError):
        Hand.from_dict(state)


# ---------------------------------------------------------------------- workplace cells

_REALS = st.floats(allow_nan=True, allow_infinity=True) | st.builds(
    lambda bits: struct.unpack(">d", struct.pack(">Q", bits))[0], st.integers(0, 2**64 - 1)
)
_CELLS = st.none() | st.integers(-(2**63), 2**63 - 1) | _REALS | st.text() | st.binary()


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack(">d", a) == struct.pack(">d", b)  # NaN payloads and -0.0 too
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(_CELLS)
def test_cells_round_trip_bit_exactly(value: object) -> None:
    assert _same(decode_cell(encode_cell(value)), value)


@pytest.mark.parametrize(
    "cell",
    [
        1,
        1.5,
        "x",
        [1],
        {"int": 1},
        {"int": "1.5"},
        {"int": str(2**63)},
        {"real": "00"},
        {"real": "zz" * 8},
        {"blob": "abc"},
        {"date": "x"},
        {"int": "1", "text": "1"},
    ],
)
def test_damaged_cells_are_refused(cell: object) -> None:
    with pytest.raises(WorkplaceStateError):
        decode_cell(cell)


# ---------------------------------------------------------------------- workplace tables

_COLUMNS = st.lists(
    st.sampled_from(["INTEGER", "REAL", "TEXT", "BLOB", "NUMERIC", ""]), min_size=1, max_size=4
)


@st.composite
def _tables(draw: st.DrawFn) -> sqlite3.Connection:
    connection = new_connection()
    for number in range(draw(st.integers(1, 3))):
        types = draw(_COLUMNS)
        # Any identifier survives, a double quote in a table or column name included.
        table = draw(st.sampled_from([f"t{number}", f'"we""ird {number}"']))
        columns = ", ".join(f'"c""{i}" {t}' for i, t in enumerate(types))
        connection.execute(f"CREATE TABLE {table} ({columns})")
        values = (
            st.none() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text() | st.binary()
        )
        rows = draw(st.lists(st.tuples(*[values] * len(types)), max_size=8))
        marks = ", ".join("?" * len(types))
        connection.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        # Deleting rows leaves gaps in the rowids: the restore must keep them.
        connection.execute(f"DELETE FROM {table} WHERE rowid % 3 = 0")
    return connection


def _contents(connection: sqlite3.Connection) -> list[Any]:
    # Python's sqlite3 gives each cell back as its storage class (int, float, str, bytes).
    names = [r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    quoted = ['"' + name.replace('"', '""') + '"' for name in names]
    return [
        connection.execute(f"SELECT rowid, * FROM {name} ORDER BY rowid").fetchall()
        for name in quoted
    ]


@settings(max_examples=60, deadline=None)
@given(_tables())
def test_any_table_round_trips_exactly(connection: sqlite3.Connection) -> None:
    state = dump_database(connection)
    restored = load_database(state)
    assert dump_database(restored) == state
    for ours, theirs in zip(_contents(restored), _contents(connection), strict=True):
        assert len(ours) == len(theirs)
        for row_a, row_b in zip(ours, theirs, strict=True):
            assert all(_same(a, b) for a, b in zip(row_a, row_b, strict=True))


def test_the_seeded_tables_hold_infinities_nulls_and_blobs() -> None:
    state = dump_database(seed_database(3))
    cells = [cell for table in state["tables"] for row in table["rows"] for cell in row]
    reals = [decode_cell(c) for c in cells if isinstance(c, dict) and "real" in c]
    assert math.inf in reals and -math.inf in reals
    assert None in cells and any(isinstance(c, dict) and "blob" in c for c in cells)
    assert dump_database(load_database(state)) == state


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s.pop("indexes"),
        lambda s: s["tables"].__setitem__(0, {"sql": s["tables"][0]["sql"]}),
        lambda s: s["tables"][0]["rows"][0].pop(),
        lambda s: s["tables"][0]["rows"][0].__setitem__(0, {"text": "1"}),
        lambda s: s["tables"][0].__setitem__("sql", "DROP TABLE customers"),
        lambda s: s["tables"][0].__setitem__("sql", "CREATE TABLE x (a); ATTACH DATABASE 'f' AS f"),
        lambda s: s["tables"][1]["rows"].append(s["tables"][1]["rows"][0]),  # same rowid
    ],
)
def test_damaged_databases_are_refused(damage: Any) -> None:
    state = dump_database(seed_database(5))
    damage(state)
    with pytest.raises(WorkplaceStateError):
        load_database(state)


# ---------------------------------------------------------------------- the servers


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.mark.parametrize(
    ("server", "task", "calls"),
    [
        (
            CounterTools,
            {"target": 5},
            [("add", {"add": 2, "turn": 0}), ("add", {"add": 3, "turn": 1})],
        ),
        (BlackjackTools, {"seed": 11}, [("hit", {}), ("hit", {}), ("stand", {})]),
        (
            WorkplaceTools,
            {"seed": 2},
            [
                ("send_email", {"recipient": "ada", "subject": "hi"}),
                ("set_balance", {"name": "bo", "balance": 12.5}),
                ("schedule", {"title": "t", "day": 1, "hour": 10, "attendee": "ada"}),
            ],
        ),
    ],
)
def test_a_session_restored_at_each_call_answers_like_an_uninterrupted_one(
    server: Any, task: dict[str, Any], calls: list[tuple[str, dict[str, Any]]]
) -> None:
    async def scenario() -> None:
        saved = EpisodeId("r", 0)
        nxt = saved.next_attempt()
        straight = server()
        await straight.seed(saved, task)
        expected = [await straight.call(saved, tool, args) for tool, args in calls]
        answer = {"total": 5}  # the counter's verifier reads it; the others read the session
        expected_reward = (await straight.verify(saved, answer)).reward
        for cut in range(len(calls) + 1):
            first, second = server(), server()
            await first.seed(saved, task)
            for tool, args in calls[:cut]:
                await first.call(saved, tool, args)
            state = (await first.export_sessions([saved]))[saved]
            second.validate_session(nxt, state)
            await second.restore_session(saved, nxt, state)
            assert (await second.export_sessions([nxt]))[nxt] == state
            # The first server goes on (a late attempt N): it cannot touch attempt N+1.
            if cut < len(calls):
                await first.call(saved, *calls[cut])
            answers = [await second.call(nxt, tool, args) for tool, args in calls[cut:]]
            assert answers == expected[cut:]
            assert (await second.verify(nxt, answer)).reward == expected_reward

    _run(scenario())


@pytest.mark.parametrize(
    ("server", "task"),
    [(CounterTools, {"target": 1}), (BlackjackTools, {"seed": 3}), (WorkplaceTools, {"seed": 1})],
    ids=["counter", "blackjack", "workplace"],
)
def test_truncated_session_state_is_refused_before_install(server: Any, task: Any) -> None:
    async def scenario() -> None:
        episode = EpisodeId("r", 0)
        first = server()
        await first.seed(episode, task)
        state = dict((await first.export_sessions([episode]))[episode])
        for truncated in ({}, {k: v for k, v in state.items() if k != max(state)}):
            with pytest.raises((ValueError, TypeError, KeyError)):
                server().validate_session(episode, truncated)

    _run(scenario())


@pytest.mark.parametrize(
    ("server", "task", "calls"),
    [
        (BlackjackTools, {"seed": 4}, [("look", {}), ("hit", {"turn": 0}), ("stand", {"turn": 1})]),
        (
            WorkplaceTools,
            {"seed": 1},
            [
                ("find_customer", {"name": "ada"}),
                ("send_email", {"recipient": "ada", "subject": "hi", "turn": 0}),
                ("schedule", {"title": "t", "day": 1, "hour": 10, "attendee": "ada", "turn": 1}),
            ],
        ),
    ],
    ids=["blackjack", "workplace"],
)
def test_each_change_is_one_logged_execution_the_restored_session_keeps(
    tmp_path: Any, server: Any, task: Any, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    """The demo's audit of effects: a tool that changes the session logs one execution
    (its turn, its reply) and the session names the ones it applied, through a restore
    and in its verifier line. Reads are not executions."""

    async def scenario() -> None:
        saved = EpisodeId("r", 0)
        log = tmp_path / "tools.jsonl"
        first = server("tools", VerifierLog(log, fsync=False))
        await first.seed(saved, task)
        replies = [await first.call(saved, tool, args) for tool, args in calls]
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert [(e["turn"], e["reply"]) for e in lines] == [
            (0, reply_text(replies[1])),
            (1, reply_text(replies[2])),
        ]
        state = (await first.export_sessions([saved]))[saved]
        assert state["executions"] == [e["execution"] for e in lines]
        second = server("tools", VerifierLog(log, fsync=False))
        second.validate_session(saved.next_attempt(), state)
        await second.restore_session(saved, saved.next_attempt(), state)
        await second.verify(saved.next_attempt(), {})
        verdict = json.loads(log.read_text().splitlines()[-1])
        assert verdict["attempt"] == 1 and verdict["executions"] == state["executions"]

    _run(scenario())


def test_a_failing_workplace_tool_changes_nothing() -> None:
    async def scenario() -> None:
        episode = EpisodeId("r", 0)
        tools = WorkplaceTools()
        await tools.seed(episode, {"seed": 1})
        before = await tools.export_sessions([episode])
        with pytest.raises(ParticipantError):
            await tools.call(episode, "schedule", {"title": "t", "day": "monday"})
        with pytest.raises(ParticipantError):
            await tools.call(episode, "drop_tables", {})
        assert await tools.export_sessions([episode]) == before
        await tools.close(episode)

    _run(scenario())


def test_the_environment_cores_import_without_the_wire_or_the_loop() -> None:
    # The games, the table codec and the plays are plain Python a test drives alone; the
    # servers in _environments adapt them to the SDK (and put SQLite on threads).
    cores = "_blackjack, _workplace, _plays"
    probe = (
        f"import sys\nfrom turnpoint.apps.examples import {cores}\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    banned = ("grpc", "asyncio", "turnpoint.v1", "turnpoint.participant_sdk", "torch")
    assert sorted(m for m in loaded if m.split(".")[0] in banned or m.startswith(banned)) == []
