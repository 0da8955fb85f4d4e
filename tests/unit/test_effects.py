"""The pure parts of exactly-once effects (docs/spec.md section 6.12): the call key, the
bounded reply record, its export codec."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnpoint.errors import Reason
from turnpoint.participant_sdk import EffectConflictError
from turnpoint.participant_sdk._effects import (
    EFFECTS_FIELD,
    CallPosition,
    EffectRecord,
    call_fingerprint,
    effect_key,
    parse_effect_key,
    split_payload,
)

rollout_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
positions = st.builds(
    CallPosition, st.one_of(st.none(), st.integers(0, 10_000)), st.integers(0, 1000)
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)


@given(rollout_ids, positions)
def test_a_key_names_its_rollout_and_position_and_nothing_else(
    rollout: str, position: CallPosition
) -> None:
    key = effect_key(rollout, position)
    # No attempt in the key: every attempt of the rollout sends the same one.
    assert parse_effect_key(key) == (rollout, position)
    assert len(key) <= 256


def test_keys_of_other_clients_are_not_parsed() -> None:
    assert parse_effect_key("call-r1-0-3") is None
    assert parse_effect_key("fx:r1:x:0") is None
    with pytest.raises(ValueError):
        effect_key("r1", CallPosition(-1, 0))


@given(arguments)
def test_a_fingerprint_is_blind_to_how_ints_and_key_order_travelled(
    args: dict[str, object],
) -> None:
    as_floats = json.loads(json.dumps(args), parse_int=float)
    reordered = dict(reversed(list(args.items())))
    assert call_fingerprint("call", "deal", args) == call_fingerprint("call", "deal", as_floats)
    assert call_fingerprint("call", "deal", args) == call_fingerprint("call", "deal", reordered)
    assert call_fingerprint("call", "deal", args) != call_fingerprint("call", "hit", args)


def test_a_recorded_call_answers_and_a_diverging_one_is_refused_by_name() -> None:
    record = EffectRecord()
    key = effect_key("r1", CallPosition(2, 0))
    fingerprint = call_fingerprint("call", "deal", {"n": 1})
    assert record.lookup(key, "call", "deal", fingerprint) is None
    record.record(key, "call", "deal", fingerprint, {"card": 7})
    assert record.lookup(key, "call", "deal", fingerprint) == {"card": 7}
    cases = {
        "arguments": ("call", "deal", call_fingerprint("call", "deal", {"n": 2})),
        "tool": ("call", "hit", fingerprint),
        "operation": ("verify", "deal", fingerprint),
    }
    for divergence, (operation, tool, other) in cases.items():
        with pytest.raises(EffectConflictError) as raised:
            record.lookup(key, operation, tool, other)
        assert raised.value.divergence == divergence
        assert raised.value.reason is Reason.INVALID_ARGUMENT
        assert raised.value.metadata["request_id"] == key


@settings(max_examples=60)
@given(st.integers(1, 8), st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), max_size=40))
def test_the_record_is_bounded_and_never_lets_a_forgotten_sdk_key_run_again(
    limit: int, calls: list[tuple[int, int]]
) -> None:
    record = EffectRecord(limit)
    made: list[str] = []
    for turn, index in calls:
        key = effect_key("r", CallPosition(turn, index))
        fingerprint = call_fingerprint("call", "t", {"i": index})
        if key in record:
            continue
        try:
            if record.lookup(key, "call", "t", fingerprint) is not None:
                continue
        except EffectConflictError as error:
            # Safe side: a key at or before the latest forgotten position is refused,
            # even one that arrives late, out of order (it cannot tell the two apart).
            assert error.divergence == "forgotten"
            continue
        record.record(key, "call", "t", fingerprint, {"turn": turn})
        made.append(key)
        assert len(record) <= limit
    # Every key made is either answered from the record or refused as forgotten: none
    # would run a second time.
    for key in made:
        parsed = parse_effect_key(key)
        assert parsed is not None
        fingerprint = call_fingerprint("call", "t", {"i": parsed[1].index})
        try:
            assert record.lookup(key, "call", "t", fingerprint) is not None
        except EffectConflictError as error:
            assert error.divergence == "forgotten"


@given(
    st.integers(1, 5),
    st.lists(
        st.tuples(
            positions, arguments, st.dictionaries(st.text(max_size=4), json_values, max_size=3)
        ),
        max_size=8,
    ),
)
def test_export_and_restore_round_trip(
    limit: int, calls: list[tuple[CallPosition, dict[str, object], dict[str, object]]]
) -> None:
    record = EffectRecord(limit)
    for position, args, reply in calls:
        key = effect_key("r", position)
        fingerprint = call_fingerprint("call", "t", args)
        if key not in record:
            try:
                record.lookup(key, "call", "t", fingerprint)
            except EffectConflictError:
                continue
            record.record(key, "call", "t", fingerprint, reply)
    exported = json.loads(json.dumps(record.to_json()))
    restored = EffectRecord.from_json(exported)
    assert restored.to_json() == record.to_json()
    state, again = split_payload({"server": 1, EFFECTS_FIELD: exported})
    assert state == {"server": 1}
    assert again is not None and again.to_json() == record.to_json()


@pytest.mark.parametrize(
    "bad",
    [
        None,
        {"format": 2, "limit": 1, "replies": []},
        {"format": 1, "limit": 0, "replies": []},
        {"format": 1, "limit": 1, "replies": [{"key": "k"}]},
        {"format": 1, "limit": 1, "replies": "x"},
        {"format": 1, "limit": 1, "forgotten_through": {"turn": -1, "index": 0}, "replies": []},
    ],
)
def test_a_malformed_record_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        EffectRecord.from_json(bad)


def test_a_payload_without_a_record_is_the_servers_state() -> None:
    assert split_payload({"a": 1}) == ({"a": 1}, None)
