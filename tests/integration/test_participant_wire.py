"""The participant SDK and its servicers over real gRPC on 127.0.0.1:0 (issue 3).

One test per rule of the participant's side of the protocol, named for the behaviour.
Every test runs once per control door (``door``: the unary calls, or the ControlSession
stream that carries the same requests), so a behaviour cannot hold on one door and not
the other. The participants are scripted (``tests/support/scripted.py``): episodes reach
their boundaries exactly when the test releases them, and waits go through the
participant's own condition or a bounded poll, never a sleep.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from tests.support.fakes import FakeClock, boundary_of, expect, state_of
from tests.support.participants import METADATA, ControlDoor
from tests.support.scripted import (
    FAST,
    FENCE,
    TOKEN,
    GroupTools,
    ModelFailed,
    RestartTools,
    ScriptedAgent,
    ScriptedTools,
    Wire,
    bounded,
    ckpt,
    expect_deadline,
    host_scripted,
    poll,
    restore_id,
    rid,
    wire_to,
)
from turnpoint._status import error_from_rpc
from turnpoint.convert import enum_from_proto, episode_to_proto
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import SnapshotStore, TransientError
from turnpoint.participant_sdk._store_format import MANIFEST_NAME
from turnpoint.participant_sdk.testing import FaultPoint, StoreFaults
from turnpoint.protocol import ArtifactRef, EpisodeState
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2 as ro_pb
from turnpoint.v1 import types_pb2

EP_A = EpisodeId("rollout-a", 0)
EP_B = EpisodeId("rollout-b", 0)
EP_C = EpisodeId("rollout-c", 0)
EP_D = EpisodeId("rollout-d", 0)
TASK: dict[str, Any] = {"turns": 3}
MODEL_TASK: dict[str, Any] = {"turns": 2, "model": True}

PREPARED = types_pb2.PHASE_PREPARED
PREPARING = types_pb2.PHASE_PREPARING
IDLE = types_pb2.PHASE_IDLE
RESTORED = types_pb2.PHASE_RESTORED


@pytest.fixture(params=["unary", "session"])
def door(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "snapshots"


@asynccontextmanager
async def serve(root: Path, door: str, **kinds: Any) -> AsyncIterator[Wire]:
    async with (
        host_scripted(root, config=WIDE_MARGIN, **kinds) as hosted,
        wire_to(hosted, door) as wire,
    ):
        yield wire


# Calls with short deadlines (0.3 to 0.5 s) are answered this share of their time before
# it, not the default tenth: 30 to 50 ms was less than a loaded machine takes to carry the
# answer back, and the caller's deadline expired first. Long deadlines keep the 0.5 s.
WIDE_MARGIN = replace(FAST, reply_margin_fraction=0.8)


def counts(readiness: types_pb2.ReadinessReport) -> dict[EpisodeState, int]:
    result: dict[EpisodeState, int] = {}
    for item in readiness.counts:
        state = enum_from_proto(types_pb2.EpisodeState, EpisodeState, item.state, "state")
        assert state is not None
        result[state] = item.count
    return result


def episodes(messages: Any) -> list[EpisodeId]:
    return [EpisodeId(m.rollout_id, m.attempt) for m in messages]


def _written(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()} if directory.exists() else set()


def manifest_ref(committed: pb.CommitResponse) -> ArtifactRef:
    m = committed.manifest
    return ArtifactRef(m.path, m.sha256, m.size_bytes, m.record_count)


async def park(wire: Wire, agent: ScriptedAgent, checkpoint: str, *running: EpisodeId) -> Any:
    """Prepare ``checkpoint`` and let each running episode seal one turn and park."""
    prepare = asyncio.create_task(wire.prepare(checkpoint, lease_s=60))
    await wire.until(lambda core: core.active_checkpoint_id == checkpoint)
    for episode in running:
        agent.release(episode)
    prepared = await bounded(prepare)
    assert prepared.phase == PREPARED, prepared
    return prepared


async def committed_snapshot(
    root: Path, door: str, running: tuple[EpisodeId, ...], snapshot: str = "snap-1"
) -> pb.CommitResponse:
    """Episodes one turn in, committed into ``snapshot``; the participant is then stopped."""
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        for episode in running:
            await wire.start(episode, TASK)
        await park(wire, agent, ckpt(1), *running)
        committed = await wire.commit(ckpt(1), snapshot, running)
        await wire.resume(ckpt(1))
    return committed


# ====================================================================== prepare


async def test_prepare_waits_until_every_running_episode_parked_and_a_repeat_replays_the_answer(
    root: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        await wire.start(EP_A, TASK)
        await wire.start(EP_B, TASK)
        request_id = rid("prepare")
        prepare = asyncio.create_task(wire.prepare(ckpt(1), lease_s=60, request_id=request_id))
        await wire.until(lambda core: core.phase.name == "PREPARING")
        agent.release(EP_A)
        await wire.until(lambda core: state_of(core, EP_A) is EpisodeState.PARKED)
        assert not prepare.done()  # B still runs between two boundaries
        agent.release(EP_B)
        prepared = await bounded(prepare)
        assert prepared.phase == PREPARED and prepared.readiness.ready
        assert prepared.readiness.blocker_count == 0
        assert counts(prepared.readiness) == {EpisodeState.PARKED: 2}
        # Parked inside the boundary call: neither ran past its first boundary.
        assert boundary_of(wire.core, EP_A) == boundary_of(wire.core, EP_B) == 1
        for again in (
            await wire.prepare(ckpt(1)),
            await wire.prepare(ckpt(1), request_id=request_id),
        ):
            assert again.phase == PREPARED and again.checkpoint_id == ckpt(1)
            assert again.readiness == prepared.readiness


async def test_a_prepare_not_ready_by_its_deadline_answers_with_capped_blockers_and_the_full_count(
    root: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        for episode in (EP_A, EP_B, EP_C):
            await wire.start(episode, TASK)
        timeout_s = 0.5
        # Answered before the caller's deadline, or this times out (both doors).
        async with asyncio.timeout(timeout_s):
            report = await wire.prepare(ckpt(1), max_blockers=2, timeout_s=timeout_s)
        assert report.phase == PREPARING and not report.readiness.ready
        assert report.readiness.blocker_count == 3
        assert len(report.readiness.blockers) == 2
        assert {b.state for b in report.readiness.blockers} == {types_pb2.EPISODE_STATE_RUNNING}
        status = await wire.status()
        assert status.phase == PREPARING and not status.admission_open
        refused = await wire.run(EP_D, TASK).refused()
        assert refused.reason is Reason.ADMISSION_CLOSED
        await wire.resume(ckpt(1))
        assert (await wire.status()).admission_open
        await wire.start(EP_D, TASK)


async def test_a_prepare_whose_admission_close_fails_part_way_reopens_admission(
    root: Path, door: str
) -> None:
    agent, tools = ScriptedAgent(), ScriptedTools()
    tools.close_fails = True  # the agent closes first, then the tools' hook fails
    async with serve(root, door, instance="env-0", agent=agent, resources=tools) as wire:
        # The hook's failure is data on both doors: HOOK_FAILED with the exception's
        # type, never UNKNOWN, and none of its text on the wire.
        with pytest.raises(TurnpointError) as failure:
            await wire.prepare(ckpt(1))
        assert failure.value.reason is Reason.HOOK_FAILED
        assert failure.value.metadata["exception"] == "RuntimeError"
        assert "broken" not in failure.value.message
        status = await wire.status()
        assert status.phase == IDLE and status.admission_open
        assert status.active_checkpoint_id == ""
        assert agent.opened == 1  # the half that had closed was reopened
        await wire.start(EP_A, TASK)
        tools.close_fails = False
        assert (await wire.prepare(ckpt(1), timeout_s=0.5)).phase == PREPARING


async def test_resume_interrupts_a_waiting_prepare_and_a_late_commit_for_that_id_is_stale(
    root: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        await wire.start(EP_A, TASK)
        prepare = asyncio.create_task(wire.prepare(ckpt(1)))
        await wire.until(lambda core: core.phase.name == "PREPARING")
        resumed = await wire.resume(ckpt(1))
        assert resumed.ended_active and resumed.phase == IDLE
        await expect(Reason.STALE_CHECKPOINT, bounded(prepare))
        await expect(Reason.STALE_CHECKPOINT, wire.commit(ckpt(1), "snap-1", [EP_A]))
        await expect(Reason.STALE_CHECKPOINT, wire.prepare(ckpt(1)))
        assert (await wire.status()).admission_open


# ====================================================================== lease


async def test_lease_expiry_resumes_a_participant_whose_coordinator_went_quiet_and_renew_keeps_a_slow_one(
    root: Path, door: str
) -> None:
    lease_s = 1.0
    async with serve(root, door, agent=ScriptedAgent()) as wire:
        await wire.start(EP_A, TASK)
        prepared = await wire.prepare(ckpt(1), lease_s=lease_s, timeout_s=0.3)
        assert prepared.phase == PREPARING
        loop = asyncio.get_running_loop()
        until = loop.time() + 2 * lease_s
        renewals = 0
        # A slow but live coordinator: renewing a tenth of a lease apart, for two leases.
        while loop.time() < until:
            renewed = await wire.renew(ckpt(1), lease_s=lease_s)
            assert renewed.phase == PREPARING
            renewals += 1
            await asyncio.sleep(lease_s / 10)
        status = await wire.status()
        assert status.lease_expiries == 0 and not status.admission_open and renewals > 10
        # The coordinator goes quiet: the lease runs out and the participant resumes itself.
        await wire.until(lambda core: core.lease_expiries == 1)
        status = await wire.status()
        assert status.phase == IDLE and status.admission_open
        assert not status.HasField("lease_expires_at") and status.lease_expiries == 1
        await expect(Reason.STALE_CHECKPOINT, wire.renew(ckpt(1)))
        await expect(Reason.STALE_CHECKPOINT, wire.commit(ckpt(1), "snap-1", []))


# ====================================================================== commit


async def test_commit_rechecks_readiness(root: Path, door: str) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        await wire.start(EP_A, MODEL_TASK)
        await wire.until(lambda core: state_of(core, EP_A) is EpisodeState.AWAITING_MODEL)
        prepared = await wire.prepare(ckpt(1))
        assert prepared.phase == PREPARED
        assert counts(prepared.readiness) == {EpisodeState.AWAITING_MODEL: 1}
        # The model call fails: the episode runs again, so readiness regressed.
        agent.reply(EP_A, ModelFailed("the model server went away"))
        await wire.until(lambda core: state_of(core, EP_A) is EpisodeState.RUNNING)
        error = await expect(Reason.INVALID_PHASE, wire.commit(ckpt(1), "snap-1", [EP_A]))
        assert error.metadata["blocker_count"] == "1"
        assert (await wire.status()).phase == PREPARING
        agent.release(EP_A)  # it reaches its next boundary and parks there
        await wire.until(lambda core: state_of(core, EP_A) is EpisodeState.PARKED)
        committed = await wire.commit(ckpt(1), "snap-1", [EP_A])
        assert episodes(committed.exported) == [EP_A]


async def test_a_commit_retried_while_its_write_runs_awaits_that_write(
    root: Path, door: str
) -> None:
    faults = StoreFaults()
    release = threading.Event()
    reached = faults.slow_write(release)
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent, faults=faults) as wire:
        await wire.start(EP_A, TASK)
        await park(wire, agent, ckpt(1), EP_A)
        await expect_deadline(wire.commit(ckpt(1), "snap-1", [EP_A], timeout_s=0.5))
        assert reached.is_set()
        # A retry while the write is held joins it: it too runs out of time, no new write.
        await expect_deadline(wire.commit(ckpt(1), "snap-1", [EP_A], timeout_s=0.5))
        assert faults.hits(FaultPoint.RECORDS_WRITE) == 1
        retry = asyncio.create_task(wire.commit(ckpt(1), "snap-1", [EP_A]))
        release.set()
        committed = await bounded(retry)
        assert episodes(committed.exported) == [EP_A]
        assert faults.hits(FaultPoint.RECORDS_WRITE) == 1
        assert len(agent.exports) == 1
        assert await wire.commit(ckpt(1), "snap-1", [EP_A]) == committed


async def test_a_commit_retried_after_a_failed_write_stores_the_same_records(
    root: Path, door: str
) -> None:
    faults = StoreFaults()
    faults.fail_writes(1)  # ENOSPC
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent, faults=faults) as wire:
        await wire.start(EP_A, TASK)
        await park(wire, agent, ckpt(1), EP_A)
        error = await expect(Reason.STORAGE_UNAVAILABLE, wire.commit(ckpt(1), "snap-1", [EP_A]))
        assert error.transient
        assert not SnapshotStore(root).exists("snap-1", wire.instance)
        committed = await wire.commit(ckpt(1), "snap-1", [EP_A])
        assert len(agent.exports) == 1  # the same records, never a new cut
        loaded = SnapshotStore(root).read("snap-1", wire.instance, manifest_ref(committed))
        assert [r.payload["state"] for r in loaded.records] == [agent.exports[0][EP_A]]
        assert [r.payload["state"] for r in loaded.records] == [{"history": [0]}]


@pytest.mark.parametrize(
    ("raised", "reason", "shown"),
    [
        (ConnectionError("db at 10.1.2.3:5432 refused"), Reason.UNAVAILABLE, "ConnectionError"),
        (TimeoutError("sandbox /secret/path slow"), Reason.UNAVAILABLE, "TimeoutError"),
        (TransientError("tool backend overloaded"), Reason.UNAVAILABLE, "overloaded"),
        (KeyError("/home/user/.token"), Reason.HOOK_FAILED, "KeyError"),
    ],
    ids=["connection", "timeout", "transient", "unexpected"],
)
async def test_a_failing_export_is_a_typed_transient_error_and_the_retry_commits(
    root: Path, door: str, raised: Exception, reason: Reason, shown: str
) -> None:
    """A hook's failure is data: a reason the coordinator retries on, the exception's
    type named, its text (hosts, paths) never on the wire; the retry exports again."""
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        await wire.start(EP_A, TASK)
        await park(wire, agent, ckpt(1), EP_A)
        agent.export_error = raised
        error = await expect(reason, wire.commit(ckpt(1), "snap-1", [EP_A]))
        assert error.transient
        assert shown in error.message
        for secret in ("10.1.2.3", "/secret", ".token"):
            assert secret not in error.message and secret not in str(error.metadata)
        committed = await wire.commit(ckpt(1), "snap-1", [EP_A])
        assert episodes(committed.exported) == [EP_A]


async def test_the_same_commit_id_with_other_arguments_conflicts(root: Path, door: str) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        for episode in (EP_A, EP_B):
            await wire.start(episode, TASK)
        await park(wire, agent, ckpt(1), EP_A, EP_B)
        committed = await wire.commit(ckpt(1), "snap-1", [EP_A, EP_B])
        await expect(Reason.CHECKPOINT_CONFLICT, wire.commit(ckpt(1), "snap-1", [EP_A]))
        await expect(Reason.CHECKPOINT_CONFLICT, wire.commit(ckpt(1), "snap-2", [EP_A, EP_B]))
        # The same arguments, scope in another order, still get the recorded answer.
        assert await wire.commit(ckpt(1), "snap-1", [EP_B, EP_A]) == committed
        assert not (root / "snap-2").exists()


async def test_resume_stops_an_unpublished_write_and_no_manifest_appears_after_it(
    root: Path, door: str
) -> None:
    faults = StoreFaults()
    release = threading.Event()
    reached = faults.slow_write(release)
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent, faults=faults) as wire:
        await wire.start(EP_A, TASK)
        await park(wire, agent, ckpt(1), EP_A)
        await expect_deadline(wire.commit(ckpt(1), "snap-1", [EP_A], timeout_s=0.5))
        assert reached.is_set()
        resumed = await wire.resume(ckpt(1))
        assert resumed.ended_active and (await wire.status()).admission_open
        release.set()
        directory = root / "snap-1" / wire.instance
        # The stopped writer removes its own temporary file and publishes nothing.
        await poll(lambda: not any(directory.iterdir()))
        assert not (directory / MANIFEST_NAME).exists()
        await expect(Reason.STALE_CHECKPOINT, wire.commit(ckpt(1), "snap-1", [EP_A]))
    assert not any(directory.iterdir())


# ====================================================================== restore


def _tamper_records(root: Path, committed: pb.CommitResponse) -> None:
    path = root / "snap-1" / committed.artifacts[0].path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _tamper_manifest(root: Path, committed: pb.CommitResponse) -> None:
    path = root / "snap-1" / committed.manifest.path
    path.write_text(path.read_text().replace('"attempt": 0', '"attempt": 5'))


@pytest.mark.parametrize("tamper", [_tamper_records, _tamper_manifest], ids=["records", "manifest"])
async def test_restore_rejects_a_corrupt_or_tampered_file_and_installs_nothing(
    root: Path, door: str, tamper: Any
) -> None:
    committed = await committed_snapshot(root, door, (EP_A, EP_B))
    tamper(root, committed)
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as fresh:
        error = await expect(
            Reason.INVALID_CHECKPOINT_STATE,
            fresh.restore(restore_id(1), "snap-1", committed, [EP_A, EP_B]),
        )
        assert error.metadata["snapshot"] == "snap-1"
        status = await fresh.status()
        assert status.phase == IDLE and status.admission_open
        assert list(status.readiness.counts) == [] and list(fresh.core.entries()) == []
        assert fresh.core.fresh
        await fresh.start(EP_C, TASK)  # open for new work, nothing restored
        # The entry is in the table once accepted; the agent's own code starts a moment
        # later, on its own task.
        await poll(lambda: bool(agent.started))
        assert agent.started == [(EP_C, None)]


async def test_restore_installs_attempt_n_plus_1_and_stays_closed_until_resume(
    root: Path, door: str
) -> None:
    committed = await committed_snapshot(root, door, (EP_A, EP_B))
    agent = ScriptedAgent()
    next_a = EP_A.next_attempt()
    async with serve(root, door, agent=agent) as fresh:
        restored = await fresh.restore(restore_id(1), "snap-1", committed, [EP_A])
        assert episodes(restored.installed) == [next_a] and restored.phase == RESTORED
        status = await fresh.status()
        assert status.phase == RESTORED and not status.admission_open
        assert counts(status.readiness) == {EpisodeState.RESTORED: 1}
        assert (await fresh.run(EP_C, TASK).refused()).reason is Reason.ADMISSION_CLOSED
        assert (await fresh.run(EP_A, TASK).refused()).reason is Reason.STALE_ATTEMPT
        # The replacement may be invoked, but parks before doing any work.
        call = fresh.run(next_a, TASK)
        await fresh.until(lambda core: state_of(core, next_a) is EpisodeState.PARKED)
        assert agent.started == []
        await fresh.resume(restore_id(1))
        assert (await fresh.status()).admission_open
        agent.release(next_a, 2)
        result = await call.done()
        assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED
        assert call.boundaries == [2, 3] and call.accepted
        assert [saved.state for _, saved in agent.started if saved] == [{"history": [0]}]


# ====================================================================== retire / forget


async def test_retire_replies_only_after_the_work_stopped(root: Path, door: str) -> None:
    agent = ScriptedAgent()
    agent.cancel_gate = asyncio.Event()
    async with serve(root, door, agent=agent) as wire:
        call = await wire.start(EP_A, TASK)
        retire = asyncio.create_task(wire.retire([EP_A]))
        await bounded(agent.cancelling.wait())
        assert not retire.done()
        assert state_of(wire.core, EP_A) is EpisodeState.RETIRING
        agent.cancel_gate.set()
        assert episodes((await bounded(retire)).stopped) == [EP_A]
        assert state_of(wire.core, EP_A) is None
        assert (await call.refused()).reason is Reason.STALE_ATTEMPT


async def test_a_late_request_of_a_retired_attempt_is_refused_until_forget(
    root: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        await wire.start(EP_A, TASK)
        assert episodes((await wire.retire([EP_A])).stopped) == [EP_A]
        assert (await wire.run(EP_A, TASK).refused()).reason is Reason.STALE_ATTEMPT
        assert (await wire.status()).refused_rollouts == 1
        assert (await wire.forget(["rollout-a"])).forgotten == 1
        assert (await wire.status()).refused_rollouts == 0
        await wire.start(EP_A, TASK)


async def test_forget_is_refused_while_a_retire_has_not_freed_its_state(
    root: Path, door: str
) -> None:
    agent = ScriptedAgent()
    agent.cancel_gate = asyncio.Event()
    async with serve(root, door, agent=agent) as wire:
        await wire.start(EP_A, TASK)
        retire = asyncio.create_task(wire.retire([EP_A]))
        await bounded(agent.cancelling.wait())
        await expect(Reason.RETIRE_INCOMPLETE, wire.forget(["rollout-a"]))
        agent.cancel_gate.set()
        await bounded(retire)
        assert (await wire.forget(["rollout-a"])).forgotten == 1


# ====================================================================== agents


async def test_a_parked_episodes_budget_does_not_run_while_parked(root: Path, door: str) -> None:
    clock = FakeClock()
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent, clock=clock) as wire:
        call = wire.run(EP_A, {"turns": 2}, budget_s=10)
        await wire.until(lambda core: state_of(core, EP_A) is not None)
        clock.advance(3)
        prepare = asyncio.create_task(wire.prepare(ckpt(1), lease_s=10**6))
        await wire.until(lambda core: core.active_checkpoint_id == ckpt(1))
        agent.release(EP_A)
        assert (await bounded(prepare)).phase == PREPARED
        clock.advance(3600)  # an hour parked by a slow checkpoint
        await wire.resume(ckpt(1))
        agent.release(EP_A)
        result = await call.done()
        assert result.outcome == ro_pb.RUN_OUTCOME_COMPLETED
        assert result.active_time.ToNanoseconds() == 3 * 10**9


async def test_a_model_reply_arriving_during_a_checkpoint_is_held(root: Path, door: str) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        call = await wire.start(EP_A, MODEL_TASK)
        await wire.until(lambda core: state_of(core, EP_A) is EpisodeState.AWAITING_MODEL)
        prepared = await wire.prepare(ckpt(1))
        assert prepared.phase == PREPARED
        agent.reply(EP_A, "seven")
        await poll(lambda: agent.model_returned == 1)
        await wire.status()  # a round trip: the episode had every chance to run on
        assert state_of(wire.core, EP_A) is EpisodeState.AWAITING_MODEL
        assert boundary_of(wire.core, EP_A) == 1
        committed = await wire.commit(ckpt(1), "snap-1", [EP_A])
        loaded = SnapshotStore(root).read("snap-1", wire.instance, manifest_ref(committed))
        saved = loaded.records[0].payload
        assert (saved["boundary_index"], saved["state"]) == (1, {"history": [0]})
        await wire.resume(ckpt(1))
        result = await call.done()
        assert call.boundaries == [1, 2]
        assert dict(result.result)["history"] == [0, "seven"]


async def test_a_reinvoked_run_attaches_or_returns_the_kept_result_and_never_runs_twice(
    root: Path, door: str
) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        first = await wire.start(EP_A, TASK)
        agent.release(EP_A, 2)
        await wire.until(lambda core: boundary_of(core, EP_A) == 2)
        # The caller saw boundary 1 before it lost the stream; it invokes Run again.
        second = wire.run(EP_A, TASK, boundaries_seen=1)
        await poll(lambda: second.boundaries == [2])
        agent.release(EP_A)
        done = await second.done()
        assert second.boundaries == [2, 3]
        assert await first.done() == done
        # Invoked once more after completion: the kept result, same receipt.
        third = wire.run(EP_A, TASK)
        assert await third.done() == done and done.HasField("receipt")
        assert len(agent.started) == 1
        # The completion is owed until acknowledged, then prepare is ready.
        report = await wire.prepare(ckpt(1), timeout_s=0.3)
        assert report.readiness.blockers[0].receipt == done.receipt
        await wire.resume(ckpt(1))
        assert await wire.acknowledge([done.receipt]) == 1
        assert (await wire.prepare(ckpt(2))).readiness.ready


async def test_a_cancelled_run_leaves_no_unacknowledged_completion(root: Path, door: str) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        sealed = await wire.start(EP_A, TASK)
        unsealed = await wire.start(EP_B, TASK)
        agent.release(EP_A)
        await poll(lambda: sealed.boundaries == [1])
        await sealed.cancel()  # the trainer gave up: gRPC cancels the call
        await unsealed.cancel()
        await wire.until(
            lambda core: (
                state_of(core, EP_A) is EpisodeState.PARKED and state_of(core, EP_B) is None
            )
        )
        prepared = await wire.prepare(ckpt(1))
        assert prepared.phase == PREPARED and prepared.readiness.ready
        assert EpisodeState.COMPLETED_UNACKED not in counts(prepared.readiness)
        # The boundary it had sealed stays committable.
        committed = await wire.commit(ckpt(1), "snap-1", [EP_A, EP_B])
        assert episodes(committed.exported) == [EP_A]


# ====================================================================== resources


async def test_a_group_scored_verify_in_flight_does_not_block_prepare(
    root: Path, door: str
) -> None:
    tools = GroupTools()
    async with serve(root, door, instance="tools-0", resources=tools) as wire:
        await wire.seed(EP_A)
        gate = tools.hold("verify")
        verify = asyncio.create_task(wire.verify(EP_A, {"guess": 3}))
        await bounded(tools.entered["verify"].wait())
        prepared = await wire.prepare(ckpt(1))
        assert prepared.phase == PREPARED and prepared.readiness.ready
        gate.set()
        committed = await wire.commit(ckpt(1), "snap-1", [EP_A])
        assert episodes(committed.exported) == [EP_A]
        await wire.resume(ckpt(1))
        assert await bounded(verify) == 1.0


async def test_a_restart_only_session_never_blocks_never_parks_is_never_exported_and_is_reported(
    root: Path, door: str
) -> None:
    tools = RestartTools()
    async with serve(root, door, instance="tools-0", resources=tools) as wire:
        await wire.seed(EP_A)
        gate = tools.hold("slow")
        slow = asyncio.create_task(wire.call_tool(EP_A, "slow"))
        await bounded(tools.entered["slow"].wait())
        prepared = await wire.prepare(ckpt(1))
        assert prepared.phase == PREPARED and prepared.readiness.ready
        assert episodes(prepared.readiness.restarts) == [EP_A]
        # Not parked: its calls keep running through the checkpoint.
        assert (await wire.call_tool(EP_A, "fast"))["calls"] == 1
        await expect(Reason.RESTART_IN_SCOPE, wire.commit(ckpt(1), "snap-1", [EP_A]))
        committed = await wire.commit(ckpt(1), "snap-1", [])
        assert list(committed.exported) == [] and committed.artifacts[0].record_count == 0
        status = await wire.status()
        assert episodes(status.readiness.restarts) == [EP_A]
        gate.set()
        assert (await bounded(slow))["calls"] == 2


# ====================================================================== security


@pytest.mark.parametrize("token", [None, "wrong-token-456"], ids=["no-token", "wrong-token"])
async def test_a_control_call_without_the_right_token_is_unauthenticated(
    root: Path, door: str, token: str | None
) -> None:
    async with host_scripted(root, agent=ScriptedAgent()) as hosted:
        control = ControlDoor(hosted.address, door, token=token)
        try:
            prepare = pb.PrepareRequest(fence=FENCE, request_id=rid(), checkpoint_id=ckpt(1))
            error = await expect(Reason.UNAUTHENTICATED, control.call(prepare))
            assert token is None or token not in str(error) + repr(error.metadata)
        finally:
            await control.close()
        assert hosted.runtime.core.phase.name == "IDLE" and hosted.runtime.core.epoch == 0


async def test_a_lower_epoch_is_fenced_but_a_replayed_request_id_gets_its_answer(
    root: Path, door: str
) -> None:
    newer = types_pb2.Fence(coordinator_id="coord", epoch=2)
    async with serve(root, door, agent=ScriptedAgent()) as wire:
        answered = await wire.resume(ckpt(1), request_id="resume-old")
        wire.fence = newer
        assert (await wire.prepare(ckpt(2))).header.epoch == 2
        replayed = await wire.resume(ckpt(1), request_id="resume-old", fence=FENCE)
        assert (replayed.phase, replayed.ended_active) == (answered.phase, answered.ended_active)
        error = await expect(
            Reason.FENCED, wire.resume(ckpt(2), request_id="resume-new", fence=FENCE)
        )
        assert error.metadata["epoch"] == "2"
        status = await wire.status()
        assert status.phase == PREPARED and status.active_checkpoint_id == ckpt(2)


@pytest.mark.parametrize("bad", ["../escape", "a/b", "..", "/etc", "x\\y", ".hidden"])
async def test_ids_with_path_characters_are_invalid_argument_and_change_nothing(
    root: Path, door: str, bad: str
) -> None:
    agent = ScriptedAgent()
    async with serve(root, door, agent=agent) as wire:
        await wire.start(EP_A, TASK)
        await park(wire, agent, ckpt(1), EP_A)
        before = await wire.status()
        bad_episode = types_pb2.EpisodeId(rollout_id=bad, attempt=0)
        good = episode_to_proto(EP_A)
        requests: list[Any] = [
            pb.PrepareRequest(fence=FENCE, request_id=rid(), checkpoint_id=bad),
            pb.RenewRequest(fence=FENCE, request_id=rid(), checkpoint_id=bad),
            pb.CommitRequest(fence=FENCE, request_id=rid(), checkpoint_id=bad, snapshot="snap-1"),
            pb.CommitRequest(
                fence=FENCE, request_id=rid(), checkpoint_id=ckpt(1), snapshot=bad, scope=[good]
            ),
            pb.CommitRequest(
                fence=FENCE,
                request_id=rid(),
                checkpoint_id=ckpt(1),
                snapshot="snap-1",
                scope=[good, bad_episode],
            ),
            pb.ResumeRequest(fence=FENCE, request_id=rid(), checkpoint_id=bad),
            pb.RetireRequest(fence=FENCE, request_id=rid(), episodes=[bad_episode]),
            pb.ForgetRequest(fence=FENCE, request_id=rid(), rollout_ids=[bad]),
            pb.RestoreRequest(
                fence=FENCE,
                request_id=rid(),
                restore_id=restore_id(1),
                snapshot=bad,
                entry=pb.ManifestEntry(
                    manifest=types_pb2.ArtifactRef(
                        path=f"{bad}/{MANIFEST_NAME}", sha256="0" * 64, size_bytes=1
                    )
                ),
            ),
        ]
        for request in requests:
            error = await expect(Reason.INVALID_ARGUMENT, wire.door.call(request))
            assert error.code_name == "INVALID_ARGUMENT"
        after = await wire.status()
        assert (after.phase, after.active_checkpoint_id) == (
            before.phase,
            before.active_checkpoint_id,
        )
        assert after.readiness == before.readiness and after.lease_expiries == 0
        # Nothing was written, inside the root or next to it.
        assert _written(root.parent) <= {"snapshots"} and _written(root) == set()
        # Nothing changed: the checkpoint commits as it would have.
        committed = await wire.commit(ckpt(1), "snap-1", [EP_A])
        assert episodes(committed.exported) == [EP_A]


async def test_an_abandoned_session_call_is_cancelled_in_the_participant(root: Path) -> None:
    """The coordinator's client cancels a call it stopped waiting for; on the session
    door that is a cancel message, and the participant's handler sees the cancellation
    as it would on the unary door (docs/spec.md section 3.2)."""
    from turnpoint.trainer.control.client import ParticipantControlClient

    agent = ScriptedAgent()
    agent.close_gate = asyncio.Event()
    async with host_scripted(root, agent=agent) as hosted:
        client = ParticipantControlClient(hosted.address, token=TOKEN, participant_name="agent-0")
        try:
            await client.call(pb.GetStatusRequest(), 5)  # the session is open
            preparing = asyncio.create_task(
                client.call(
                    pb.PrepareRequest(
                        fence=FENCE, request_id="p-1", checkpoint_id=ckpt(1), max_blockers=4
                    ),
                    30,
                )
            )
            await bounded(agent.close_gate_reached.wait())
            preparing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await preparing
            await bounded(agent.close_cancelled.wait())
        finally:
            agent.close_gate.set()
            await client.close()


async def test_the_data_plane_is_fenced_like_the_control_plane(root: Path) -> None:
    """docs/spec.md section 6.9: a Run or an Acknowledge from a coordinator the control
    plane has fenced out is refused FENCED; one without a fence (a tool) is not fenced; a
    higher epoch is adopted."""
    from turnpoint.v1 import rollout_service_pb2_grpc as ro_grpc

    agent = ScriptedAgent()
    async with host_scripted(root, agent=agent) as hosted, wire_to(hosted, "unary") as wire:
        current = types_pb2.Fence(coordinator_id="coord", epoch=5)
        await wire.door.call(pb.DescribeRequest(fence=current))  # the control plane
        stub = ro_grpc.RolloutServiceStub(wire.channel)

        def run(rollout: str, fence: types_pb2.Fence | None) -> Any:
            request = ro_pb.RunRequest(
                request_id=f"run-{rollout}",
                episode=episode_to_proto(EpisodeId(rollout, 0)),
                task=struct_pb2.Struct(fields={"turns": struct_pb2.Value(number_value=1)}),
            )
            if fence is not None:
                request.fence.CopyFrom(fence)
            return stub.Run(request, metadata=METADATA, timeout=5)

        async def refused(call: Any) -> TurnpointError:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
            carried = error_from_rpc(caught.value)
            assert carried is not None
            return carried

        stale = types_pb2.Fence(coordinator_id="coord-old", epoch=3)
        assert (await refused(run("r-stale", stale))).reason is Reason.FENCED
        usurper = types_pb2.Fence(coordinator_id="other", epoch=5)
        assert (await refused(run("r-same-epoch", usurper))).reason is Reason.FENCED
        ack = ro_pb.AcknowledgeRequest(request_id="ack-1", fence=stale)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Acknowledge(ack, metadata=METADATA, timeout=5)
        carried = error_from_rpc(caught.value)
        assert carried is not None and carried.reason is Reason.FENCED
        # Not fenced: no fence at all (a tool), or the current coordinator.
        for rollout, fence in (("r-tool", None), ("r-current", current)):
            call = run(rollout, fence)
            agent.release(EpisodeId(rollout, 0))
            outcomes = [m.WhichOneof("event") async for m in call]
            assert outcomes[-1] == "result"
        # A higher epoch is adopted: the old coordinator's control calls are fenced now.
        newer = types_pb2.Fence(coordinator_id="coord-2", epoch=6)
        call = run("r-newer", newer)
        agent.release(EpisodeId("r-newer", 0))
        assert [m.WhichOneof("event") async for m in call][-1] == "result"
        await expect(
            Reason.FENCED,
            wire.door.call(pb.ResumeRequest(fence=current, request_id="x", checkpoint_id=ckpt(9))),
        )
