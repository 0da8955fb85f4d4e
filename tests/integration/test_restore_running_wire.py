"""RestoreRunning over real gRPC on 127.0.0.1:0 (docs/spec.md section 4.16, issue 24).

A restore into a participant that already holds work: it retires what it replaces and
installs the saved episodes as N+1 beside live work, replays a repeat, refuses a stale
attempt and an older coordinator, and is listed as a capability only where it is served.
Every test runs through both control doors, as tests/integration/test_participant_wire.py
does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakes import boundary_of, expect, state_of
from tests.support.scripted import (
    FAST,
    FENCE,
    ScriptedAgent,
    Wire,
    bounded,
    ckpt,
    host_scripted,
    restore_id,
    rid,
    wire_to,
)
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.protocol import EpisodeState
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2 as ro_pb
from turnpoint.v1 import types_pb2

EP_A = EpisodeId("rollout-a", 0)
EP_B = EpisodeId("rollout-b", 0)
EP_C = EpisodeId("rollout-c", 0)
TASK: dict[str, Any] = {"turns": 3}
RESTORED = types_pb2.PHASE_RESTORED


@pytest.fixture(params=["unary", "session"])
def door(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


@asynccontextmanager
async def serve(root: Path, door: str, agent: ScriptedAgent, **config: Any) -> AsyncIterator[Wire]:
    async with (
        host_scripted(root, agent=agent, config=replace(FAST, **config)) as hosted,
        wire_to(hosted, door) as wire,
    ):
        yield wire


def episodes(messages: Any) -> list[EpisodeId]:
    return [EpisodeId(m.rollout_id, m.attempt) for m in messages]


async def snapshot_one_turn_in(wire: Wire, agent: ScriptedAgent, *running: EpisodeId) -> Any:
    """Prepare, let each running episode seal its first turn, commit snap-1, resume."""
    prepare = asyncio.create_task(wire.prepare(ckpt(1), lease_s=60))
    await wire.until(lambda core: core.active_checkpoint_id == ckpt(1))
    for episode in running:
        agent.release(episode)
    assert (await bounded(prepare)).phase == types_pb2.PHASE_PREPARED
    committed = await wire.commit(ckpt(1), "snap-1", running)
    await wire.resume(ckpt(1))
    return committed


async def test_describe_lists_the_capability_only_where_it_is_served(
    tmp_path: Path, door: str
) -> None:
    async with serve(tmp_path, door, ScriptedAgent()) as wire:
        described = await wire.door.call(pb.DescribeRequest())
        assert list(described.capabilities) == [pb.CAPABILITY_RESTORE_RUNNING]
    async with serve(tmp_path, door, ScriptedAgent(), restore_running=False) as wire:
        described = await wire.door.call(pb.DescribeRequest())
        assert list(described.capabilities) == []
        await expect(
            Reason.INVALID_ARGUMENT,
            wire.restore_running(restore_id(1), "snap-1", pb.CommitResponse(), []),
        )


async def test_it_installs_n_plus_1_into_a_running_participant_whose_other_work_goes_on(
    tmp_path: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(tmp_path, door, agent) as wire:
        run_a = await wire.start(EP_A, TASK)
        run_b = await wire.start(EP_B, TASK)
        committed = await snapshot_one_turn_in(wire, agent, EP_A, EP_B)
        agent.release(EP_A)  # A moves past the snapshot: that turn is what is redone
        await wire.until(lambda core: boundary_of(core, EP_A) == 2)
        run_c = await wire.start(EP_C, TASK)  # started after the snapshot, never saved
        healed = await wire.restore_running(restore_id(1), "snap-1", committed, [EP_A])
        next_a = EP_A.next_attempt()
        assert episodes(healed.installed) == [next_a] and healed.phase == RESTORED
        assert episodes(healed.retired) == [EP_A]
        assert (await run_a.refused()).reason is Reason.STALE_ATTEMPT
        assert state_of(wire.core, next_a) is EpisodeState.RESTORED
        assert state_of(wire.core, EP_B) is EpisodeState.RUNNING
        assert state_of(wire.core, EP_C) is EpisodeState.RUNNING
        await wire.resume(restore_id(1))
        # The replacement continues from the saved turn; the live episodes finish as if
        # nothing had happened.
        call = wire.run(next_a, TASK)
        agent.release(next_a, 2)
        assert (await call.done()).outcome == ro_pb.RUN_OUTCOME_COMPLETED
        assert call.boundaries == [2, 3]
        for episode, run_call in ((EP_B, run_b), (EP_C, run_c)):
            agent.release(episode, 3)
            assert (await run_call.done()).outcome == ro_pb.RUN_OUTCOME_COMPLETED
        restored = [saved.state for episode, saved in agent.started if episode == next_a and saved]
        assert restored == [{"history": [0]}]


async def test_a_repeat_replays_and_a_stale_attempt_is_refused_after_n_plus_1_exists(
    tmp_path: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(tmp_path, door, agent) as wire:
        await wire.start(EP_A, TASK)
        committed = await snapshot_one_turn_in(wire, agent, EP_A)
        request_id = rid("heal")
        first = await wire.restore_running(
            restore_id(1), "snap-1", committed, [EP_A], request_id=request_id
        )
        for again in (
            await wire.restore_running(
                restore_id(1), "snap-1", committed, [EP_A], request_id=request_id
            ),
            await wire.restore_running(restore_id(1), "snap-1", committed, [EP_A]),
        ):
            assert again.installed == first.installed and again.retired == first.retired
        await expect(
            Reason.CHECKPOINT_CONFLICT,
            wire.restore_running(restore_id(1), "snap-1", committed, []),
        )
        await wire.resume(restore_id(1))
        # Attempt N is dead here now: on the data plane, and as a scope to continue.
        assert (await wire.run(EP_A, TASK).refused()).reason is Reason.STALE_ATTEMPT
        await expect(
            Reason.STALE_ATTEMPT,
            wire.restore_running(restore_id(2), "snap-1", committed, [EP_A]),
        )
        await expect(
            Reason.STALE_CHECKPOINT,
            wire.restore_running(restore_id(1), "snap-1", committed, [EP_A]),
        )
        assert state_of(wire.core, EP_A.next_attempt()) is EpisodeState.RESTORED


async def test_an_older_coordinators_late_call_is_fenced_and_changes_nothing(
    tmp_path: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(tmp_path, door, agent) as wire:
        await wire.start(EP_A, TASK)
        committed = await snapshot_one_turn_in(wire, agent, EP_A)
        newer = types_pb2.Fence(coordinator_id=FENCE.coordinator_id, epoch=FENCE.epoch + 1)
        await wire.restore_running(
            restore_id(2), "snap-1", committed, [EP_A], retire_unscoped=True, fence=newer
        )
        await wire.resume(restore_id(2), fence=newer)
        error = await expect(
            Reason.FENCED,
            wire.restore_running(restore_id(3), "snap-1", committed, [EP_A.next_attempt()]),
        )
        assert error.metadata["epoch"] == str(newer.epoch)
        assert state_of(wire.core, EP_A.next_attempt()) is EpisodeState.RESTORED
        assert (await wire.status()).admission_open


async def test_retire_unscoped_frees_the_fenced_incarnations_work_without_refusing_it(
    tmp_path: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(tmp_path, door, agent) as wire:
        await wire.start(EP_A, TASK)
        committed = await snapshot_one_turn_in(wire, agent, EP_A)
        run_c = await wire.start(EP_C, TASK)
        healed = await wire.restore_running(
            restore_id(1), "snap-1", committed, [EP_A], retire_unscoped=True
        )
        assert episodes(healed.retired) == [EP_A, EP_C]
        assert (await run_c.refused()).reason is Reason.STALE_ATTEMPT
        assert state_of(wire.core, EP_C) is None
        await wire.resume(restore_id(1))
        # The new incarnation may run that rollout again under the same attempt.
        again = await wire.start(EP_C, TASK)
        agent.release(EP_C, 3)
        assert (await again.done()).outcome == ro_pb.RUN_OUTCOME_COMPLETED
