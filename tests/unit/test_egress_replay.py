"""The replay rule, pure (docs/spec.md section 12.7): a restored harness's calls are
answered from the record in order until the cut, then go live; one that asks otherwise
has diverged. And the record a restore installs from a cut."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnpoint.egress import (
    CallState,
    Disposition,
    EgressRecord,
    Refusal,
    RefusalReason,
    ReplayAction,
    replay_decision,
    request_digest,
    tool_digest,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "range 2 5"}], "seed": 1}


def test_a_digest_ignores_key_order_and_transport_but_no_field_of_the_question() -> None:
    reordered = {"seed": 1, "messages": [{"content": "range 2 5", "role": "user"}], "model": "m"}
    assert request_digest(BODY) == request_digest(reordered)
    streamed = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    assert request_digest(BODY) == request_digest(streamed)
    assert request_digest(BODY) != request_digest({**BODY, "seed": 2})
    assert request_digest(BODY) != request_digest({**BODY, "temperature": 0})


def test_a_tool_call_is_compared_by_its_tool_and_body_and_never_matches_a_model_call() -> None:
    assert tool_digest("observe", {"a": 1, "b": 2}) == tool_digest("observe", {"b": 2, "a": 1})
    assert tool_digest("observe", {"a": 1}) != tool_digest("observe", {"a": 2})
    assert tool_digest("observe", {"a": 1}) != tool_digest("other", {"a": 1})
    assert tool_digest("m", BODY) != request_digest(BODY)


@given(
    recorded=st.lists(st.sampled_from(["a", "b", "c"]), max_size=6),
    asked=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=9),
)
def test_a_harness_is_answered_until_the_cut_then_live_unless_it_diverges(
    recorded: list[str], asked: list[str]
) -> None:
    for position, digest in enumerate(asked):
        decision = replay_decision(recorded, position, digest)
        assert decision.position == position
        if position >= len(recorded):
            assert decision.action is ReplayAction.LIVE
        elif recorded[position] == digest:
            assert decision.action is ReplayAction.ANSWER
        else:
            assert decision.action is ReplayAction.DIVERGED
            assert decision.reason
            break  # the harness is stopped at its first divergence


def test_an_empty_record_sends_every_call_live_and_a_negative_position_is_a_bug() -> None:
    assert replay_decision([], 0, "x").action is ReplayAction.LIVE
    with pytest.raises(ValueError):
        replay_decision(["x"], -1, "x")


def test_a_restored_record_keeps_its_calls_settled_and_fences_the_cuts_harness() -> None:
    cut = {
        "c0": Disposition.COMPLETED,
        "c1": Disposition.ACTIVE_PREFIX,
        "c2": Disposition.NEVER_STARTED,
        "c3": Disposition.TERMINAL_FAILURE,
    }
    record = EgressRecord.restored(cut, generation=3)
    assert record.generation == 3
    assert dict(record.states()) == {
        "c0": CallState.COMPLETED,
        "c1": CallState.EXCLUDED,  # its harness is gone: what it streamed is not kept
        "c2": CallState.NEVER_STARTED,
        "c3": CallState.TERMINAL_FAILURE,
    }
    again = record.accept("c0", 3)
    assert isinstance(again, Refusal) and again.reason is RefusalReason.DUPLICATE_CALL
    old = record.accept("c9", 2)
    assert isinstance(old, Refusal) and old.reason is RefusalReason.FENCED_GENERATION
    assert not isinstance(record.accept("c4", 3), Refusal)
