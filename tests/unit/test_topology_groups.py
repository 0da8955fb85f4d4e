"""Discovery of worker groups (docs/spec.md sections 3.9 and 7.1), without a network.

:func:`group_workers` decides, from one ``Describe`` answer, whether the endpoint called
is a group of workers and which; :meth:`Coordinator.discover` replaces such an endpoint
by its workers and describes each at its own address. The coordinator here talks to
fake callers that answer from a table of addresses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from turnpoint.protocol import PROTOCOL_VERSION
from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.advanced import Coordinator
from turnpoint.trainer.control.client import is_group_answer
from turnpoint.trainer.control.failures import MalformedReplyError
from turnpoint.trainer.control.outcomes import OperationFailed
from turnpoint.trainer.control.topology import group_workers
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

WORKERS = {"agent-0-w0": "127.0.0.1:7001", "agent-0-w1": "127.0.0.1:7002"}


def described(
    instance: str,
    *,
    group: str = "",
    workers: dict[str, str] | None = None,
    answered_by: str | None = None,
    kind: types_pb2.ParticipantKind.ValueType = types_pb2.PARTICIPANT_KIND_AGENT,
) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        header=types_pb2.ResponseHeader(
            participant_id=answered_by or instance, incarnation=f"inc-{instance}"
        ),
        kind=kind,
        instance_name=instance,
        protocol_version=PROTOCOL_VERSION,
        worker_group=group,
        workers=[
            pb.WorkerAddress(instance_name=name, address=address)
            for name, address in (workers or {}).items()
        ],
    )


def group_answer(answered_by: str = "agent-0-w1", **changes: Any) -> pb.DescribeResponse:
    workers = changes.pop("workers", WORKERS)
    return described(answered_by, group="agent-0", workers=workers, **changes)


# ---------------------------------------------------------------------- the pure rule


def test_a_worker_answering_for_its_group_names_every_worker() -> None:
    response = group_answer()
    assert is_group_answer("agent-0", response)
    assert group_workers("agent-0", response) == WORKERS


def test_a_worker_called_at_its_own_address_is_an_ordinary_participant() -> None:
    # It still lists its group, but it answers as the instance it was called as.
    response = described("agent-0-w1", group="agent-0", workers=WORKERS)
    assert not is_group_answer("agent-0-w1", response)
    assert group_workers("agent-0-w1", response) is None


def test_a_participant_alone_on_its_endpoint_is_no_group() -> None:
    assert group_workers("tools", described("tools")) is None
    # Naming another group than the one called is no group answer: the ordinary
    # instance-name rule then rejects it (docs/spec.md section 4.5 item 5).
    assert not is_group_answer("agent-1", group_answer())


@pytest.mark.parametrize(
    ("workers", "answered_by", "header"),
    [
        ({"agent-0-w0": "127.0.0.1:1", "bad name!": "127.0.0.1:2"}, "agent-0-w0", None),
        ({"agent-0-w0": "127.0.0.1:1", "agent-0": "127.0.0.1:2"}, "agent-0-w0", None),
        ({"agent-0-w0": "127.0.0.1:1", "agent-0-w1": ""}, "agent-0-w0", None),
        (WORKERS, "agent-0-w7", None),  # answered by a worker the roster does not list
        (WORKERS, "agent-0-w1", "agent-0-w0"),  # the header names another worker
    ],
    ids=["invalid-name", "the-group-itself", "no-address", "unlisted", "header"],
)
def test_a_roster_that_cannot_be_used_is_a_malformed_reply(
    workers: dict[str, str], answered_by: str, header: str | None
) -> None:
    response = described(answered_by, group="agent-0", workers=workers, answered_by=header)
    with pytest.raises(MalformedReplyError):
        group_workers("agent-0", response)


def test_a_worker_listed_twice_is_a_malformed_reply() -> None:
    response = group_answer("agent-0-w0", workers={"agent-0-w0": "127.0.0.1:1"})
    response.workers.append(pb.WorkerAddress(instance_name="agent-0-w0", address="127.0.0.1:2"))
    with pytest.raises(MalformedReplyError, match="twice"):
        group_workers("agent-0", response)


# ---------------------------------------------------------------------- discovery


class FakeCaller:
    """Answers ``Describe`` from the table of what listens at each address."""

    def __init__(self, name: str, address: str, table: dict[str, pb.DescribeResponse]) -> None:
        self.participant_name = name
        self.address = address
        self._table = table
        self.closed = False

    async def call(self, request: Any, timeout_s: float) -> pb.DescribeResponse:
        assert isinstance(request, pb.DescribeRequest)
        assert not self.closed
        return self._table[self.address]

    async def close(self) -> None:
        self.closed = True


def coordinator(
    tmp_path: Path,
    endpoints: dict[str, str],
    table: dict[str, pb.DescribeResponse],
    monkeypatch: pytest.MonkeyPatch,
) -> Coordinator:
    monkeypatch.setattr(
        Coordinator,
        "_new_client",
        lambda self, name, address: FakeCaller(name, address, table),
    )
    return Coordinator(
        endpoints,
        token="unit-token-0123456789",
        coordinator_id="unit",
        epoch=1,
        config=CoordinatorConfig(snapshot_root=tmp_path),
    )


def shared_table() -> dict[str, pb.DescribeResponse]:
    table = {
        "127.0.0.1:7000": group_answer(),  # the shared port: whichever worker answers
        "127.0.0.1:7100": described("tools", kind=types_pb2.PARTICIPANT_KIND_RESOURCES),
    }
    for name, address in WORKERS.items():
        table[address] = described(name, group="agent-0", workers=WORKERS)
    return table


async def test_discovery_replaces_a_group_by_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoints = {"agent-0": "127.0.0.1:7000", "tools": "127.0.0.1:7100"}
    running = coordinator(tmp_path, endpoints, shared_table(), monkeypatch)
    topology = await running.discover()

    assert topology.instances == {"agent-0-w0", "agent-0-w1", "tools"}
    assert topology.agents == ("agent-0-w0", "agent-0-w1")
    assert dict(running.endpoints) == {**WORKERS, "tools": "127.0.0.1:7100"}
    assert running.instances == ("agent-0-w0", "agent-0-w1", "tools")
    # Each worker was described at its own address: its incarnation is its own.
    assert topology.participants["agent-0-w0"].incarnation == "inc-agent-0-w0"
    # Discovering again describes the workers themselves and changes nothing.
    assert (await running.discover()).instances == topology.instances


async def test_workers_are_found_again_under_the_same_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job restart gives the group's name again; the workers' names are stable, so
    the restore finds the saved topology (docs/spec.md section 3.9 item 4)."""
    table = shared_table()
    first = await coordinator(
        tmp_path, {"agent-0": "127.0.0.1:7000"}, table, monkeypatch
    ).discover()
    table["127.0.0.1:7000"] = group_answer("agent-0-w0")  # another worker answers this time
    again = await coordinator(
        tmp_path, {"agent-0": "127.0.0.1:7000"}, table, monkeypatch
    ).discover()
    assert first.instances == again.instances == frozenset(WORKERS)


async def test_a_worker_name_also_given_as_a_participant_fails_discovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoints = {"agent-0": "127.0.0.1:7000", "agent-0-w1": "127.0.0.1:7002"}
    running = coordinator(tmp_path, endpoints, shared_table(), monkeypatch)
    with pytest.raises(OperationFailed) as caught:
        await running.discover()
    assert "agent-0" in caught.value.failures


async def test_a_worker_that_answers_as_a_group_again_fails_discovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = shared_table()
    # The worker's own address answers for another worker: no participant of its own.
    table["127.0.0.1:7002"] = described("agent-0-w0", answered_by="agent-0-w0")
    running = coordinator(tmp_path, {"agent-0": "127.0.0.1:7000"}, table, monkeypatch)
    with pytest.raises(OperationFailed) as caught:
        await running.discover()
    assert set(caught.value.failures) == {"agent-0-w1"}
