"""What a worker of a group is told by its parent (docs/spec.md section 3.9): plain data."""

from __future__ import annotations

import pytest

from turnpoint.server import WorkerGroup, WorkerSlot
from turnpoint.server._worker_group import worker_slot_from_env
from turnpoint.server._worker_slot import WORKER_SLOT_ENV, worker_name
from turnpoint.server.advanced import GroupMember, GroupRoster


def slot(index: int = 1) -> WorkerSlot:
    members = tuple(GroupMember(worker_name("agent-0", i), f"127.0.0.1:{7001 + i}") for i in (0, 1))
    return WorkerSlot(
        group="agent-0",
        index=index,
        host="127.0.0.1",
        shared_port=7000,
        own_port=7001 + index,
        roster=GroupRoster("agent-0", members),
        parent_pid=4242,
    )


def test_worker_names_are_stable_and_valid_ids() -> None:
    assert worker_name("agent-0", 2) == "agent-0-w2"


def test_a_slot_travels_through_the_environment_unchanged() -> None:
    sent = slot()
    assert worker_slot_from_env({WORKER_SLOT_ENV: sent.to_json()}) == sent
    assert sent.instance == "agent-0-w1"
    assert worker_slot_from_env({}) is None


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"group": "agent-0"}',
        slot().to_json().replace('"index": 1', '"index": 5'),
        slot().to_json().replace('"agent-0-w1"', '"bad name!"'),
    ],
    ids=["not-json", "not-an-object", "missing-fields", "index-out-of-range", "bad-name"],
)
def test_a_malformed_slot_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=WORKER_SLOT_ENV):
        WorkerSlot.from_json(text)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_group_refuses_a_host_clients_cannot_dial(host: str) -> None:
    with pytest.raises(ValueError, match="dialled"):
        WorkerGroup("agent-0", 2, ["true"], host=host)


def test_a_group_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="at least one"):
        WorkerGroup("agent-0", 0, ["true"])
