"""The coordinator, the snapshot driver and the restorer against real grpc.aio servers.

Every participant is a scripted control participant (``tests.support.scripted``) on
``127.0.0.1:0`` serving both the unary calls and ``ControlSession``. By default it
behaves like a well-mannered participant (prepares when its work is parked, writes real
files on commit, records finished ids); a test replaces one operation's handler to make
it hang, refuse, break its stream or answer something malformed.

The rollout side and the trainer anchor are the small fakes of ``tests.support.fakes``:
this file is about the control plane, the snapshot steps and what ends up on disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from tests.support.fakes import FakeAnchor, FakeRollouts
from tests.support.participants import TOKEN as REAL_TOKEN
from tests.support.participants import Topology as RealTopology
from tests.support.participants import start_topology
from tests.support.scripted import (
    BreakSession,
    ControlHandler,
    ScriptedControl,
    hang,
    poll,
    serve_control,
)
from turnpoint.apps.examples._task import make_prompt
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.protocol import ParticipantKind, Phase, RecoveryLevel
from turnpoint.trainer import (
    CoordinatorConfig,
    CoordinatorError,
    FailureReason,
    Rollout,
    RolloutOutcome,
    SnapshotFailuresError,
    SnapshotOutcome,
)
from turnpoint.trainer.advanced import (
    AgentEndpoint,
    CommitFailed,
    Coordinator,
    CoordinatorMetrics,
    InFlightRollout,
    PrepareFailed,
    RestoreFailed,
    Restorer,
    RolloutClient,
    SnapshotDriver,
    SnapshotLayout,
    SnapshotManifest,
    SnapshotPhase,
    SnapshotPump,
    apply_plan,
    bump_epoch,
)
from turnpoint.trainer.control import coordinator as coordinator_module
from turnpoint.trainer.control.failures import FailureKind
from turnpoint.trainer.restore.restorer import RerunReason
from turnpoint.trainer.storage.layout import tree_digest
from turnpoint.trainer.storage.manifest import AnchorRef, TrainerRolloutState
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

TOKEN = "coordinator-test-token"
# A safety net for waits on events that must happen; never a synchronisation device.
BOUND_S = 10.0

KINDS = {
    "agent": types_pb2.PARTICIPANT_KIND_AGENT,
    "resources": types_pb2.PARTICIPANT_KIND_RESOURCES,
    "model": types_pb2.PARTICIPANT_KIND_MODEL,
}


def episode_pb(episode: EpisodeId) -> types_pb2.EpisodeId:
    return types_pb2.EpisodeId(rollout_id=episode.rollout_id, attempt=episode.attempt)


def episodes_of(messages: Iterable[types_pb2.EpisodeId]) -> list[EpisodeId]:
    return [EpisodeId(m.rollout_id, m.attempt) for m in messages]


class Scripted(ScriptedControl):
    """One scripted participant: protocol-ish defaults, per-operation overrides."""

    def __init__(self, name: str, kind: str, root: Path) -> None:
        super().__init__(name)
        self.kind = kind
        self.root = root
        self.finished: set[str] = set()
        self.active: str | None = None
        # Prepare is ready while this is set; the blockers are reported otherwise.
        self.ready = asyncio.Event()
        self.ready.set()
        self.blockers: list[types_pb2.Blocker] = []
        self.restarts: list[EpisodeId] = []
        self.watch: asyncio.Queue[pb.WatchBoundariesResponse] = asyncio.Queue()

    # -- the core ----------------------------------------------------------------------

    def readiness(self) -> types_pb2.ReadinessReport:
        ready = self.ready.is_set()
        return types_pb2.ReadinessReport(
            ready=ready,
            blocker_count=0 if ready else len(self.blockers),
            blockers=[] if ready else self.blockers,
            restarts=[episode_pb(e) for e in self.restarts],
        )

    def push_readiness(self, phase: types_pb2.Phase.ValueType = types_pb2.PHASE_PREPARING) -> None:
        self.watch.put_nowait(
            pb.WatchBoundariesResponse(
                header=self.header(), readiness=self.readiness(), phase=phase
            )
        )

    async def unscripted(self, op: str, request: Any, timeout_s: float) -> Any:
        handler: ControlHandler = getattr(self, f"default_{op}")
        return await handler(request, timeout_s)

    async def watch_boundaries(self) -> AsyncGenerator[pb.WatchBoundariesResponse, None]:
        yield pb.WatchBoundariesResponse(
            header=self.header(), readiness=self.readiness(), phase=types_pb2.PHASE_IDLE
        )
        while True:
            yield await self.watch.get()

    async def default_describe(self, request: pb.DescribeRequest, timeout_s: float) -> Any:
        return pb.DescribeResponse(
            header=self.header(),
            kind=KINDS[self.kind],
            instance_name=self.name,
            protocol_version="turnpoint.v1",
            recovery_mode=types_pb2.RECOVERY_MODE_EXPORTED,
            verify_mode=types_pb2.VERIFY_MODE_REPLAY,
            supported_levels=[types_pb2.RECOVERY_LEVEL_TURN],
            environment="" if self.kind == "model" else "math",
            phase=types_pb2.PHASE_IDLE,
        )

    async def default_prepare(self, request: pb.PrepareRequest, timeout_s: float) -> Any:
        ck = request.checkpoint_id
        if ck in self.finished:
            raise TurnpointError(Reason.STALE_CHECKPOINT, f"{ck} is finished")
        self.active = ck
        # Answer before the call's deadline, keeping a reply margin (as the SDK does).
        try:
            async with asyncio.timeout(timeout_s * 0.8):
                await self.ready.wait()
        except TimeoutError:
            pass
        ready = self.ready.is_set()
        return pb.PrepareResponse(
            header=self.header(),
            phase=types_pb2.PHASE_PREPARED if ready else types_pb2.PHASE_PREPARING,
            readiness=self.readiness(),
            checkpoint_id=ck,
        )

    async def default_renew(self, request: pb.RenewRequest, timeout_s: float) -> Any:
        if request.checkpoint_id != self.active:
            raise TurnpointError(Reason.INVALID_PHASE, "not active")
        return pb.RenewResponse(header=self.header(), phase=types_pb2.PHASE_PREPARED)

    async def default_commit(self, request: pb.CommitRequest, timeout_s: float) -> Any:
        exported = [] if self.kind == "model" else sorted(episodes_of(request.scope))
        response = pb.CommitResponse(
            header=self.header(),
            checkpoint_id=request.checkpoint_id,
            exported=[episode_pb(e) for e in exported],
        )
        if exported:
            records = "".join(json.dumps({"episode": str(e)}) + "\n" for e in exported)
            response.artifacts.append(
                self._write(request.snapshot, "records.jsonl", records.encode())
            )
            response.manifest.CopyFrom(self._write(request.snapshot, "MANIFEST.json", b"{}\n"))
        return response

    def _write(self, snapshot: str, name: str, data: bytes) -> types_pb2.ArtifactRef:
        path = self.root / snapshot / self.name / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return types_pb2.ArtifactRef(
            path=f"{self.name}/{name}",
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            record_count=data.count(b"\n"),
        )

    async def default_resume(self, request: pb.ResumeRequest, timeout_s: float) -> Any:
        ended = self.active == request.checkpoint_id
        self.finished.add(request.checkpoint_id)
        if ended:
            self.active = None
        return pb.ResumeResponse(
            header=self.header(), phase=types_pb2.PHASE_IDLE, ended_active=ended
        )

    async def default_restore(self, request: pb.RestoreRequest, timeout_s: float) -> Any:
        self.active = request.restore_id
        installed = [episode_pb(e.next_attempt()) for e in episodes_of(request.scope)]
        return pb.RestoreResponse(
            header=self.header(),
            restore_id=request.restore_id,
            installed=installed,
            phase=types_pb2.PHASE_RESTORED,
        )

    async def default_retire(self, request: pb.RetireRequest, timeout_s: float) -> Any:
        return pb.RetireResponse(header=self.header(), stopped=request.episodes)

    async def default_forget(self, request: pb.ForgetRequest, timeout_s: float) -> Any:
        return pb.ForgetResponse(header=self.header(), forgotten=len(request.rollout_ids))

    async def default_get_status(self, request: pb.GetStatusRequest, timeout_s: float) -> Any:
        return pb.GetStatusResponse(header=self.header(), phase=types_pb2.PHASE_IDLE)


# ----------------------------------------------------------------------- harness


@dataclass
class Fleet:
    root: Path
    servers: list[grpc.aio.Server] = field(default_factory=list)
    participants: dict[str, Scripted] = field(default_factory=dict)
    coordinators: list[Coordinator] = field(default_factory=list)

    async def start(self, name: str, kind: str = "agent", *, session: bool = True) -> Scripted:
        participant = Scripted(name, kind, self.root)
        self.servers.append(await serve_control(participant, TOKEN, session=session))
        self.participants[name] = participant
        return participant

    def config(self, **overrides: Any) -> CoordinatorConfig:
        settings: dict[str, Any] = {
            "snapshot_root": self.root,
            "control_timeout_s": 2.0,
            "reply_grace_s": 0.5,
            "prepare_timeout_s": 2.0,
            "resume_retry_pause_s": 0.0,
            "snapshot_interval_s": 60.0,
        }
        settings.update(overrides)
        return CoordinatorConfig(**settings)

    async def coordinator(self, config: CoordinatorConfig, *, epoch: int = 1) -> Coordinator:
        coordinator = Coordinator(
            {name: p.address for name, p in self.participants.items()},
            token=TOKEN,
            coordinator_id="coord-test",
            epoch=epoch,
            config=config,
            metrics=CoordinatorMetrics(CollectorRegistry()),
        )
        self.coordinators.append(coordinator)
        await coordinator.discover()
        return coordinator

    async def close(self) -> None:
        for coordinator in self.coordinators:
            await coordinator.close()
        for server in self.servers:
            await server.stop(None)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    fleet = Fleet(tmp_path)
    try:
        yield fleet
    finally:
        await fleet.close()


def failing(reason: Reason, times: int, then: ControlHandler) -> ControlHandler:
    """Refuse ``times`` calls with ``reason``, then behave like ``then``."""
    left = [times]

    async def handler(request: Any, timeout_s: float) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise TurnpointError(reason, f"scripted {reason.name}")
        return await then(request, timeout_s)

    return handler


def rollout(episode: EpisodeId, instance: str = "agent-0") -> InFlightRollout:
    return InFlightRollout(
        episode=episode,
        instance=instance,
        prompt_group_id="g1",
        sibling_index=0,
        group_size=1,
        environment="math",
        boundaries_seen=2,
        task={"prompt": "2+2"},
    )


def driver_for(
    fleet: Fleet, coordinator: Coordinator, config: CoordinatorConfig, rollouts: FakeRollouts
) -> SnapshotDriver:
    return real_driver(coordinator, SnapshotLayout(fleet.root), config, rollouts)


# ------------------------------------------------------------------------ discovery


async def test_discover_reports_each_participant_and_fences_every_request(fleet: Fleet) -> None:
    agent = await fleet.start("agent-0")
    await fleet.start("res-0", "resources")
    await fleet.start("model-0", "model", session=False)
    coordinator = await fleet.coordinator(fleet.config(), epoch=7)

    topology = coordinator.topology

    assert topology.kind("agent-0") is ParticipantKind.AGENT
    assert topology.agents == ("agent-0",)
    assert topology.of_kind(ParticipantKind.MODEL) == ("model-0",)
    assert [m.instance for m in topology.environments()["math"]] == ["agent-0", "res-0"]
    assert topology.participants["res-0"].supported_levels == {RecoveryLevel.TURN}
    (describe,) = agent.calls("describe")
    assert (describe.fence.coordinator_id, describe.fence.epoch) == ("coord-test", 7)


async def test_discover_rejects_another_protocol_version(fleet: Fleet) -> None:
    odd = await fleet.start("agent-0")

    async def old_version(request: Any, timeout_s: float) -> Any:
        response = await odd.default_describe(request, timeout_s)
        response.protocol_version = "turnpoint.v0"
        return response

    odd.script["describe"] = old_version
    with pytest.raises(CoordinatorError) as info:
        await fleet.coordinator(fleet.config())
    assert not info.value.transient
    assert "turnpoint.v0" in str(info.value)


def test_bump_epoch_persists_and_increases(tmp_path: Path) -> None:
    first = bump_epoch(tmp_path)
    second = bump_epoch(tmp_path)
    renamed = bump_epoch(tmp_path, coordinator_id="run-b")

    assert first.epoch == 1 and second.epoch == 2 and renamed.epoch == 3
    assert second.coordinator_id == first.coordinator_id
    assert json.loads((tmp_path / "coordinator.json").read_text()) == {
        "coordinator_id": "run-b",
        "epoch": 3,
    }
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator.json"]
    (tmp_path / "coordinator.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a coordinator identity file"):
        bump_epoch(tmp_path)


# -------------------------------------------------------------------------- prepare


async def test_a_not_ready_prepare_resumes_every_instance_including_the_ready_ones(
    fleet: Fleet,
) -> None:
    ready = await fleet.start("agent-0")
    busy = await fleet.start("res-0", "resources")
    busy.ready.clear()
    busy.blockers = [
        types_pb2.Blocker(
            episode=episode_pb(EpisodeId("r1", 0)), state=types_pb2.EPISODE_STATE_REQUEST_IN_FLIGHT
        )
    ]
    coordinator = await fleet.coordinator(fleet.config(prepare_timeout_s=0.6))

    with pytest.raises(PrepareFailed) as info:
        async with coordinator.prepared("ck-000000000001"):
            raise AssertionError("the body must not run")

    error = info.value
    assert error.not_ready == {"res-0"}
    assert error.transient
    assert error.release is not None and error.release.ok
    for participant in (ready, busy):
        assert [r.checkpoint_id for r in participant.calls("resume")] == ["ck-000000000001"]
        assert participant.finished == {"ck-000000000001"}


async def test_a_repeated_prepare_round_keeps_its_request_id(
    fleet: Fleet,
) -> None:
    slow = await fleet.start("agent-0")
    slow.ready.clear()
    first_answer = asyncio.Event()
    default = slow.default_prepare

    async def prepare(request: Any, timeout_s: float) -> Any:
        response = await default(request, timeout_s)
        first_answer.set()
        return response

    slow.script["prepare"] = prepare
    # Rounds of 0.5 s under a 30 s deadline: the first answers not ready, the next one
    # (sent when the readiness stream reports the change) finds it ready.
    coordinator = await fleet.coordinator(
        fleet.config(control_timeout_s=0.5, reply_grace_s=0.1, prepare_timeout_s=30.0)
    )
    preparing = asyncio.create_task(coordinator.prepare("ck-000000000001"))
    async with asyncio.timeout(BOUND_S):
        await first_answer.wait()
    slow.ready.set()
    slow.push_readiness(types_pb2.PHASE_PREPARED)

    async with asyncio.timeout(BOUND_S):
        prepared = await preparing

    assert prepared.checkpoint_id == "ck-000000000001"
    ids = slow.request_ids("prepare")
    assert len(ids) == 2 and len(set(ids)) == 1


@pytest.mark.parametrize("session", [True, False], ids=["session", "unary"])
async def test_a_stuck_instance_times_out_and_the_healthy_one_is_still_resumed(
    fleet: Fleet, session: bool
) -> None:
    healthy = await fleet.start("agent-0")
    stuck = await fleet.start("agent-1", session=session)
    stuck.script["prepare"] = hang
    coordinator = await fleet.coordinator(fleet.config(prepare_timeout_s=1.0, reply_grace_s=0.2))

    async with asyncio.timeout(BOUND_S):
        with pytest.raises(PrepareFailed) as info:
            async with coordinator.prepared("ck-000000000001"):
                raise AssertionError("the body must not run")

    failure = info.value.failures["agent-1"]
    assert (failure.kind, failure.code) == (
        FailureKind.TRANSIENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    assert set(info.value.failures) == {"agent-1"}
    assert [r.checkpoint_id for r in healthy.calls("resume")] == ["ck-000000000001"]
    assert [r.checkpoint_id for r in stuck.calls("resume")] == ["ck-000000000001"]
    if not session:
        # The call the coordinator stopped waiting for was cancelled on the participant.
        await stuck.until(lambda: [op for op, _ in stuck.cancelled] == ["prepare"])


async def test_a_participant_given_up_on_fails_the_prepare_under_way_at_once(
    fleet: Fleet,
) -> None:
    """docs/spec.md section 7.15 item 7: a participant declared lost (a paused process
    answers nothing) fails every call at once, the prepare waiting on it and the
    abort's resume, so the snapshot fails now instead of holding the heal for its
    timeouts; the live participants are still resumed."""
    healthy = await fleet.start("agent-0")
    paused = await fleet.start("tools", "resources")
    paused.script["prepare"] = hang
    paused.script["resume"] = hang
    # Timeouts far beyond the test's bound: only giving up can end the prepare in time.
    coordinator = await fleet.coordinator(
        fleet.config(control_timeout_s=600.0, prepare_timeout_s=600.0, resume_attempts=3)
    )

    async def prepare() -> None:
        async with coordinator.prepared("ck-000000000001"):
            raise AssertionError("the body must not run")

    preparing = asyncio.create_task(prepare())
    await paused.until(lambda: len(paused.calls("prepare")) == 1)
    coordinator.give_up_on(["tools"])

    async with asyncio.timeout(BOUND_S):
        with pytest.raises(PrepareFailed) as info:
            await preparing
    failure = info.value.failures["tools"]
    assert (failure.kind, failure.code) == (FailureKind.TRANSIENT, grpc.StatusCode.UNAVAILABLE)
    assert set(info.value.failures) == {"tools"}
    assert [r.checkpoint_id for r in healthy.calls("resume")] == ["ck-000000000001"]
    # Nothing more reached the lost participant: its resume failed before it was sent.
    assert paused.calls("resume") == []


async def test_an_unacknowledged_completion_is_resolved_while_prepare_waits(
    fleet: Fleet,
) -> None:
    agent = await fleet.start("agent-0")
    agent.ready.clear()
    done = EpisodeId("r1", 0)
    agent.blockers = [
        types_pb2.Blocker(
            episode=episode_pb(done),
            state=types_pb2.EPISODE_STATE_COMPLETED_UNACKED,
            receipt=types_pb2.CompletionReceipt(episode=episode_pb(done), receipt_id="rcpt-1"),
        )
    ]
    rollouts = FakeRollouts()
    # Acknowledging is what makes the participant ready.
    rollouts.on_resolve = agent.ready.set
    # One round would last 24 s: only the readiness stream can end it within the bound.
    coordinator = await fleet.coordinator(
        fleet.config(control_timeout_s=30.0, prepare_timeout_s=30.0)
    )

    preparing = asyncio.create_task(
        coordinator.prepare("ck-000000000001", resolve=rollouts.resolve_unacknowledged)
    )
    await agent.until(lambda: bool(agent.calls("prepare")))
    # The prepare is still waiting (its round lasts up to 30 s): the stream tells first.
    agent.push_readiness()

    async with asyncio.timeout(BOUND_S):
        prepared = await preparing

    assert prepared.checkpoint_id == "ck-000000000001"
    assert rollouts.resolved == [("agent-0", done, "rcpt-1")]


async def test_a_completion_that_must_be_retired_fails_prepare_at_once(fleet: Fleet) -> None:
    agent = await fleet.start("agent-0")
    agent.ready.clear()
    done = EpisodeId("r1", 0)
    agent.blockers = [
        types_pb2.Blocker(
            episode=episode_pb(done),
            state=types_pb2.EPISODE_STATE_COMPLETED_UNACKED,
            receipt=types_pb2.CompletionReceipt(episode=episode_pb(done), receipt_id="rcpt-1"),
        )
    ]
    rollouts = FakeRollouts()
    rollouts.decision = "retire"
    # The round in flight would last 24 s: it is abandoned as soon as the verdict is in.
    coordinator = await fleet.coordinator(
        fleet.config(control_timeout_s=30.0, prepare_timeout_s=30.0)
    )

    async def announce() -> None:
        await agent.until(lambda: bool(agent.calls("prepare")))
        agent.push_readiness()

    announcing = asyncio.create_task(announce())
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(PrepareFailed) as info:
            async with coordinator.prepared(
                "ck-000000000001", resolve=rollouts.resolve_unacknowledged
            ):
                raise AssertionError("the body must not run")
    await announcing

    assert info.value.not_ready == {"agent-0"}
    assert info.value.retire == {"agent-0": (done,)}
    assert [r.checkpoint_id for r in agent.calls("resume")] == ["ck-000000000001"]


# ----------------------------------------------------------------- held checkpoints


@pytest.mark.parametrize("session", [True, False], ids=["session", "unary"])
async def test_a_hung_renew_does_not_hang_the_checkpoint(fleet: Fleet, session: bool) -> None:
    agent = await fleet.start("agent-0", session=session)
    agent.script["renew"] = hang
    config = fleet.config(
        control_timeout_s=1.0, reply_grace_s=0.1, renew_interval_s=0.2, lease_s=1.0
    )
    coordinator = await fleet.coordinator(config)

    async with asyncio.timeout(BOUND_S):
        async with coordinator.prepared("ck-000000000001") as prepared:
            # The renewal right after prepare is on its way and will never be answered.
            await agent.until(lambda: bool(agent.calls("renew")))
            await coordinator.commit("ck-000000000001", "ck-000000000001", {})

    assert prepared.release is not None and prepared.release.ok
    assert [r.checkpoint_id for r in agent.calls("resume")] == ["ck-000000000001"]
    if not session:
        await agent.until(lambda: ("renew", agent.request_ids("renew")[0]) in agent.cancelled)


async def test_a_hung_resume_keeps_the_original_failure(fleet: Fleet) -> None:
    await fleet.start("agent-0")
    stuck = await fleet.start("res-0", "resources")
    stuck.script["resume"] = hang
    config = fleet.config(control_timeout_s=0.5, reply_grace_s=0.1, resume_attempts=2)
    coordinator = await fleet.coordinator(config)

    async with asyncio.timeout(BOUND_S):
        with pytest.raises(RuntimeError, match="the trainer's own failure") as info:
            async with coordinator.prepared("ck-000000000001") as prepared:
                raise RuntimeError("the trainer's own failure")

    assert not isinstance(info.value, CoordinatorError)
    assert prepared.release is not None
    assert set(prepared.release.failures) == {"res-0"}
    # Tried twice, with the same request id.
    ids = stuck.request_ids("resume")
    assert len(ids) == 2 and len(set(ids)) == 1


@pytest.mark.parametrize(
    ("stray", "problem"),
    [
        (types_pb2.EpisodeId(rollout_id="stranger", attempt=0), "outside the scope"),
        # Not even a valid id: the reply is malformed before any scope is looked at.
        (types_pb2.EpisodeId(rollout_id="no/slashes", attempt=0), "bad episode"),
        # The scope's rollout with another attempt is another episode.
        (types_pb2.EpisodeId(rollout_id="r1", attempt=1), "outside the scope"),
    ],
)
async def test_commit_rejects_exports_outside_the_scope(
    fleet: Fleet, stray: types_pb2.EpisodeId, problem: str
) -> None:
    agent = await fleet.start("agent-0")

    async def overreach(request: Any, timeout_s: float) -> Any:
        response = await agent.default_commit(request, timeout_s)
        response.exported.append(stray)
        return response

    agent.script["commit"] = overreach
    coordinator = await fleet.coordinator(fleet.config())

    with pytest.raises(CommitFailed) as info:
        async with coordinator.prepared("ck-000000000001"):
            await coordinator.commit(
                "ck-000000000001", "ck-000000000001", {"agent-0": [EpisodeId("r1", 0)]}
            )

    assert not info.value.transient
    assert problem in str(info.value)
    assert agent.finished == {"ck-000000000001"}


# -------------------------------------------------------------------------- restore


def restorable_manifest(ck: str = "ck-000000000001") -> SnapshotManifest:
    from turnpoint.protocol import ArtifactRef
    from turnpoint.trainer.storage.manifest import ParticipantEntry, PlacedEpisode

    digest = "a" * 64
    saved = EpisodeId("r1", 0)
    return SnapshotManifest(
        checkpoint_id=ck,
        step=3,
        created_at=1.0,
        anchor=AnchorRef(sha256=digest),
        participants=(
            ParticipantEntry(
                instance="agent-0",
                kind=ParticipantKind.AGENT,
                artifacts=(ArtifactRef("agent-0/records.jsonl", digest, 10, 1),),
                manifest=ArtifactRef("agent-0/MANIFEST.json", digest, 3, 0),
                exported=(saved,),
            ),
            ParticipantEntry(instance="model-0", kind=ParticipantKind.MODEL),
        ),
        continued=(PlacedEpisode(saved, "agent-0"),),
        rollout_state=TrainerRolloutState(attempts={"r1": 0}),
    )


async def test_a_restore_failure_on_one_instance_retires_and_resumes_everywhere(
    fleet: Fleet,
) -> None:
    agent = await fleet.start("agent-0")
    model = await fleet.start("model-0", "model")
    model.script["restore"] = failing(Reason.INVALID_CHECKPOINT_STATE, 1, model.default_restore)
    coordinator = await fleet.coordinator(fleet.config())
    scope = {"agent-0": [EpisodeId("r1", 0)]}

    with pytest.raises(RestoreFailed) as info:
        async with coordinator.restored(
            "restore-000000000001", "ck-000000000001", restorable_manifest(), scope
        ):
            raise AssertionError("the body must not run")

    assert info.value.replacements == (EpisodeId("r1", 1),)
    assert info.value.cleanup == {}
    assert not info.value.transient
    for participant in (agent, model):
        ops = [op for op, _, _ in participant.received if op in ("retire", "resume")]
        assert ops == ["retire", "resume"]
        (retire,) = participant.calls("retire")
        assert episodes_of(retire.episodes) == [EpisodeId("r1", 1)]
        assert [r.checkpoint_id for r in participant.calls("resume")] == ["restore-000000000001"]


async def test_a_restore_reply_naming_another_checkpoint_is_rejected(fleet: Fleet) -> None:
    agent = await fleet.start("agent-0")
    model = await fleet.start("model-0", "model")

    async def confused(request: Any, timeout_s: float) -> Any:
        response = await agent.default_restore(request, timeout_s)
        response.restore_id = "restore-000000000099"
        return response

    agent.script["restore"] = confused
    coordinator = await fleet.coordinator(fleet.config())

    with pytest.raises(RestoreFailed) as info:
        async with coordinator.restored(
            "restore-000000000001",
            "ck-000000000001",
            restorable_manifest(),
            {"agent-0": [EpisodeId("r1", 0)]},
        ):
            raise AssertionError("the body must not run")

    failure = info.value.failures["agent-0"]
    assert failure.kind is FailureKind.INVARIANT
    assert "restore-000000000099" in failure.detail
    assert [r.checkpoint_id for r in model.calls("resume")] == ["restore-000000000001"]
    assert len(agent.calls("retire")) == 1


async def test_a_body_failure_retires_the_restored_attempts_before_reopening(
    fleet: Fleet,
) -> None:
    agent = await fleet.start("agent-0")
    await fleet.start("model-0", "model")
    coordinator = await fleet.coordinator(fleet.config())

    with pytest.raises(RuntimeError, match="cannot take them over"):
        async with coordinator.restored(
            "restore-000000000001",
            "ck-000000000001",
            restorable_manifest(),
            {"agent-0": [EpisodeId("r1", 0)]},
        ) as restored:
            assert restored.installed["agent-0"] == (EpisodeId("r1", 1),)
            raise RuntimeError("cannot take them over")

    assert [op for op, _, _ in agent.received][-3:] == ["restore", "retire", "resume"]


# ------------------------------------------------------------ driver and pump


async def test_a_snapshot_publishes_what_the_participants_wrote(fleet: Fleet) -> None:
    agent = await fleet.start("agent-0")
    await fleet.start("res-0", "resources")
    await fleet.start("model-0", "model")
    config = fleet.config()
    coordinator = await fleet.coordinator(config)
    rollouts = FakeRollouts()
    rollouts.rollouts = [rollout(EpisodeId("r1", 0))]
    driver = driver_for(fleet, coordinator, config, rollouts)

    report = await driver.take()

    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    layout = SnapshotLayout(fleet.root)
    assert layout.latest() == report.checkpoint_id
    manifest = layout.load(report.checkpoint_id)
    assert manifest.participant("agent-0").exported == (EpisodeId("r1", 0),)
    # The resources server exported its session of the same episode next to the agent.
    assert manifest.participant("res-0").exported == (EpisodeId("r1", 0),)
    assert [p.episode for p in manifest.continued] == [EpisodeId("r1", 0)]
    (commit,) = agent.calls("commit")
    assert commit.snapshot == report.checkpoint_id
    assert sum(report.phases.values()) == pytest.approx(report.total_s)
    assert rollouts.open and not rollouts.deadlines.held


async def test_a_committed_checkpoint_whose_release_failed_is_released_with_the_same_id(
    fleet: Fleet,
) -> None:
    agent = await fleet.start("agent-0")
    await fleet.start("model-0", "model")
    config = fleet.config(resume_attempts=2)
    coordinator = await fleet.coordinator(config)
    rollouts = FakeRollouts()
    agent.script["resume"] = failing(Reason.DEADLINE_EXCEEDED, 2, agent.default_resume)
    driver = driver_for(fleet, coordinator, config, rollouts)

    published = await driver.take()

    assert published.outcome is SnapshotOutcome.PUBLISHED
    assert published.unreleased == {"agent-0"}
    assert rollouts.closed_to == {"agent-0"} and rollouts.open
    pump = SnapshotPump(driver, config)

    # Nothing changed, so the next attempt is skipped, but the release is retried first.
    again = await pump.tick()

    assert again.outcome is SnapshotOutcome.SKIPPED
    ids = agent.request_ids("resume")
    assert [r.checkpoint_id for r in agent.calls("resume")] == [published.checkpoint_id] * 3
    assert len(set(ids)) == 1
    assert agent.finished == {published.checkpoint_id}
    assert rollouts.closed_to == set()
    assert driver.unreleased == {}


@pytest.mark.parametrize("outage", ["disk_full", "unavailable"])
async def test_a_transient_failure_is_retried_by_the_pump_and_latest_stays(
    fleet: Fleet, outage: str
) -> None:
    await fleet.start("agent-0")
    resources = await fleet.start("res-0", "resources")
    config = fleet.config()
    coordinator = await fleet.coordinator(config)
    rollouts = FakeRollouts()
    rollouts.rollouts = [rollout(EpisodeId("r1", 0))]
    driver = driver_for(fleet, coordinator, config, rollouts)
    pump = SnapshotPump(driver, config)
    first = await pump.tick()
    assert first.outcome is SnapshotOutcome.PUBLISHED
    rollouts.version += 1

    async def outage_handler(request: Any, timeout_s: float) -> Any:
        if outage == "unavailable":
            raise BreakSession
        raise TurnpointError(Reason.STORAGE_UNAVAILABLE, "No space left on device")

    resources.script["commit"] = outage_handler
    failed = await pump.tick()

    expected = (
        FailureReason.STORAGE if outage == "disk_full" else FailureReason.PARTICIPANT_UNAVAILABLE
    )
    assert failed.reason is expected, failed.detail
    assert pump.consecutive_failures == 1
    layout = SnapshotLayout(fleet.root)
    assert layout.latest() == first.checkpoint_id
    assert not (fleet.root / failed.checkpoint_id).exists()
    assert [r.checkpoint_id for r in resources.calls("resume")][-1] == failed.checkpoint_id

    del resources.script["commit"]
    retried = await pump.tick()

    assert retried.outcome is SnapshotOutcome.PUBLISHED, retried.detail
    assert retried.retry_of == failed.checkpoint_id
    assert layout.latest() == retried.checkpoint_id
    assert pump.consecutive_failures == 0


async def test_max_consecutive_failures_ends_the_run(fleet: Fleet) -> None:
    await fleet.start("agent-0")
    busy = await fleet.start("res-0", "resources")
    busy.ready.clear()
    config = fleet.config(prepare_timeout_s=0.5, max_consecutive_failures=2)
    coordinator = await fleet.coordinator(config)
    rollouts = FakeRollouts()
    driver = driver_for(fleet, coordinator, config, rollouts)
    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    pump = SnapshotPump(driver, config, clock=lambda: clock[0], sleep=sleep)

    async with asyncio.timeout(BOUND_S):
        with pytest.raises(
            SnapshotFailuresError, match="2 snapshot attempts failed in a row"
        ) as info:
            await pump.run()

    assert [r.reason for r in info.value.reports] == [FailureReason.NOT_READY] * 2
    assert SnapshotLayout(fleet.root).latest() is None
    # Each failed id was resumed everywhere and the trainer was left open.
    resumed = [r.checkpoint_id for r in busy.calls("resume")]
    assert resumed == [r.checkpoint_id for r in info.value.reports]
    assert rollouts.open and not rollouts.deadlines.held
    assert all(SnapshotPhase.ABORT in r.phases for r in info.value.reports)


# ----------------------------------------------------------------- full restore


async def test_a_restart_restores_the_newest_usable_snapshot_and_plans_the_rest(
    fleet: Fleet,
) -> None:
    agent = await fleet.start("agent-0")
    await fleet.start("model-0", "model")
    config = fleet.config()
    coordinator = await fleet.coordinator(config, epoch=1)
    rollouts = FakeRollouts()
    rollouts.rollouts = [rollout(EpisodeId("r1", 0))]
    driver = driver_for(fleet, coordinator, config, rollouts)
    older = await driver.take()
    rollouts.rollouts = [rollout(EpisodeId("r1", 0)), rollout(EpisodeId("r2", 0))]
    rollouts.version += 1
    newer = await driver.take()
    assert (older.outcome, newer.outcome) == (SnapshotOutcome.PUBLISHED,) * 2
    # The newest snapshot's records were damaged on disk: fall back to the older one.
    damaged = fleet.root / newer.checkpoint_id / "agent-0" / "records.jsonl"
    damaged.write_bytes(damaged.read_bytes().replace(b"r2", b"r9"))

    restarted = await fleet.coordinator(config, epoch=2)
    loaded: list[str] = []

    def load_anchor(snapshot: Path, anchor: AnchorRef) -> int:
        assert tree_digest(snapshot / anchor.path) == anchor.sha256
        loaded.append(snapshot.name)
        return 1

    restorer = Restorer(restarted, SnapshotLayout(fleet.root), config, load_anchor=load_anchor)
    plan = await restorer.restore()

    assert plan is not None
    assert plan.checkpoint_id == older.checkpoint_id
    assert loaded == [older.checkpoint_id]
    assert [(r.episode, r.instance) for r in plan.redispatch] == [(EpisodeId("r1", 1), "agent-0")]
    assert plan.rerun == ()
    restore = agent.calls("restore")[-1]
    assert restore.restore_id == "restore-002000000000"
    assert restore.fence.epoch == 2
    assert episodes_of(restore.scope) == [EpisodeId("r1", 0)]
    assert agent.calls("resume")[-1].checkpoint_id == "restore-002000000000"


async def test_a_failed_restore_turns_every_continuation_into_a_rerun(fleet: Fleet) -> None:
    await fleet.start("agent-0")
    model = await fleet.start("model-0", "model")
    config = fleet.config()
    coordinator = await fleet.coordinator(config)
    rollouts = FakeRollouts()
    rollouts.rollouts = [rollout(EpisodeId("r1", 0))]
    published = await driver_for(fleet, coordinator, config, rollouts).take()
    assert published.outcome is SnapshotOutcome.PUBLISHED
    model.script["restore"] = failing(Reason.INVALID_CHECKPOINT_STATE, 1, model.default_restore)

    restarted = await fleet.coordinator(config, epoch=2)
    restorer = Restorer(
        restarted, SnapshotLayout(fleet.root), config, load_anchor=lambda snapshot, anchor: 1
    )
    plan = await restorer.restore()

    assert plan is not None and plan.restore_failed
    assert plan.redispatch == ()
    assert [(r.episode, r.reason) for r in plan.rerun] == [
        (EpisodeId("r1", 2), RerunReason.RESTORE_FAILED)
    ]


async def test_nothing_published_means_a_fresh_start(fleet: Fleet) -> None:
    await fleet.start("agent-0")
    config = fleet.config()
    coordinator = await fleet.coordinator(config)
    restorer = Restorer(
        coordinator, SnapshotLayout(fleet.root), config, load_anchor=lambda snapshot, anchor: 0
    )

    assert await restorer.restore() is None


# ----------------------------------------------------- real example participants


def example_rollout(rollout_id: str, group: str, sibling: int, environment: str) -> Rollout:
    task = make_prompt(sibling + 10 * len(group), seed=0)
    return Rollout(
        rollout_id=rollout_id,
        prompt_group_id=group,
        sibling_index=sibling,
        group_size=2,
        environment=environment,
        task={
            "task": task.to_dict(),
            "environment": environment,
            "prompt_group_id": group,
            "sibling_index": sibling,
            "group_size": 2,
        },
        instance="agent-0",
    )


def real_driver(
    coordinator: Coordinator, layout: SnapshotLayout, config: CoordinatorConfig, rollouts: Any
) -> SnapshotDriver:
    """The snapshot driver of the tests on real participants: the coordinator's epoch,
    a fake anchor."""
    return SnapshotDriver(
        coordinator=coordinator,
        rollouts=rollouts,
        anchor=FakeAnchor(),
        layout=layout,
        config=config,
        epoch=coordinator.identity.epoch,
    )


async def real_coordinator(
    topology: RealTopology, config: CoordinatorConfig, epoch: int
) -> Coordinator:
    coordinator = Coordinator(
        {name: hosted.address for name, hosted in topology.participants.items()},
        token=REAL_TOKEN,
        coordinator_id="coord-real",
        epoch=epoch,
        config=config,
    )
    await coordinator.discover()
    return coordinator


async def test_real_participants_continue_a_parked_sibling_after_a_restart(
    tmp_path: Path,
) -> None:
    config = CoordinatorConfig(
        snapshot_root=tmp_path, control_timeout_s=5.0, resume_retry_pause_s=0
    )
    layout = SnapshotLayout(tmp_path)
    async with start_topology(tmp_path, agents=1, group_size=2) as topology:
        coordinator = await real_coordinator(topology, config, epoch=1)
        agent = AgentEndpoint(topology.agents[0].address, REAL_TOKEN)
        async with coordinator, RolloutClient({"agent-0": agent}) as client:
            client.dispatch(example_rollout("solo", "gs", 0, "guess"))
            # A group-scored sibling alone can never finish: its verify waits for the
            # other sibling, so it is in flight at the cut whatever the timing.
            client.dispatch(example_rollout("pair-0", "gp", 0, "guess-group"))
            await client.wait_for(
                lambda: (
                    len(client.results()) == 1
                    and any(r.boundaries_seen >= 1 for r in client.in_flight())
                ),
                BOUND_S,
            )
            driver = real_driver(coordinator, layout, config, client)
            report = await driver.take()

    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    manifest = layout.load(report.checkpoint_id)
    pair = EpisodeId("pair-0", 0)
    assert [(p.episode, p.instance) for p in manifest.continued] == [(pair, "agent-0")]
    # The agent saved its turns, the group-scored tools the session of the same episode.
    assert manifest.participant("group-tools").exported == (pair,)
    assert [item["rollout_id"] for item in manifest.rollout_state.queue] == ["solo"]

    # The trainer and every participant start again, fresh, on the same storage.
    async with start_topology(tmp_path, agents=1, group_size=2) as topology:
        coordinator = await real_coordinator(topology, config, epoch=2)
        agent = AgentEndpoint(topology.agents[0].address, REAL_TOKEN)
        async with coordinator, RolloutClient({"agent-0": agent}) as client:
            restorer = Restorer(coordinator, layout, config, load_anchor=lambda snapshot, ref: 1)
            plan = await restorer.restore()
            assert plan is not None and not plan.restore_failed
            assert [r.episode for r in plan.redispatch] == [EpisodeId("pair-0", 1)]
            assert plan.rerun == ()
            apply_plan(plan, client)
            client.dispatch(example_rollout("pair-1", "gp", 1, "guess-group"))
            await client.wait_for(lambda: len(client.results()) == 3, BOUND_S)
            results = {r.rollout_id: r for r in client.results()}

    # Nothing lost, nothing twice: the finished sibling came back from the snapshot, the
    # parked one continued as attempt 1 and was scored with its new sibling.
    assert sorted(results) == ["pair-0", "pair-1", "solo"]
    assert results["solo"].episode == EpisodeId("solo", 0)
    assert results["pair-0"].episode == EpisodeId("pair-0", 1)
    assert results["pair-0"].outcome is RolloutOutcome.COMPLETED
    assert results["pair-1"].outcome is RolloutOutcome.COMPLETED


async def test_real_participant_disk_full_is_retried_and_latest_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nobody exports anything here; the full disk needs the participants to write all
    # the same, as they do for a coordinator that does not accept saved_nothing.
    monkeypatch.setattr(coordinator_module, "ACCEPT_SAVED_NOTHING", False)
    config = CoordinatorConfig(
        snapshot_root=tmp_path, control_timeout_s=5.0, resume_retry_pause_s=0
    )
    layout = SnapshotLayout(tmp_path)
    # Both tries of the first commit hit a full disk on the tools server.
    async with start_topology(tmp_path, faults={"tools": "records_write:2:ENOSPC"}) as topology:
        coordinator = await real_coordinator(topology, config, epoch=1)
        async with coordinator:
            driver = real_driver(coordinator, layout, config, FakeRollouts())
            pump = SnapshotPump(driver, config)

            failed = await pump.tick()

            assert failed.reason is FailureReason.STORAGE, failed.detail
            assert set(failed.failures) == {"tools"}
            assert layout.latest() is None
            # Everyone was released: every participant is idle again.
            assert {h.runtime.phase for h in topology.participants.values()} == {Phase.IDLE}

            retried = await pump.tick()

    assert retried.outcome is SnapshotOutcome.PUBLISHED, retried.detail
    assert retried.retry_of == failed.checkpoint_id
    assert layout.latest() == retried.checkpoint_id
    assert not (tmp_path / failed.checkpoint_id).exists()


async def test_idle_real_participants_commit_in_their_prepare_and_get_no_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/spec.md section 4.6 item 8: nobody holds work, so every participant commits
    # saved-nothing in its prepare, no Commit is sent, and the snapshot records each one
    # as a participant that saved nothing.
    config = CoordinatorConfig(snapshot_root=tmp_path, control_timeout_s=5.0)
    layout = SnapshotLayout(tmp_path)
    async with start_topology(tmp_path) as topology:
        commits: list[str] = []
        for name, hosted in topology.participants.items():
            original = hosted.runtime.commit

            async def counted(
                *args: Any, _name: str = name, _original: Any = original, **kw: Any
            ) -> Any:
                commits.append(_name)
                return await _original(*args, **kw)

            monkeypatch.setattr(hosted.runtime, "commit", counted)
        coordinator = await real_coordinator(topology, config, epoch=1)
        async with coordinator:
            driver = real_driver(coordinator, layout, config, FakeRollouts())
            report = await SnapshotPump(driver, config).tick()
            assert {h.runtime.phase for h in topology.participants.values()} == {Phase.IDLE}

    assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    assert commits == []
    manifest = layout.load(report.checkpoint_id)
    assert {entry.instance for entry in manifest.participants} == set(topology.participants)
    assert all(entry.manifest is None and not entry.artifacts for entry in manifest.participants)
    # Not a file of any participant: only the trainer's anchor and the snapshot manifest.
    assert sorted(p.name for p in (tmp_path / report.checkpoint_id).iterdir()) == [
        "MANIFEST.json",
        "trainer",
    ]


async def test_a_renew_that_crosses_a_commit_or_resume_is_no_lease_expiry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A renew that reaches a participant after the commit or resume this coordinator
    # sent has ended the checkpoint there finds it finished: expected, not a lease that
    # ran out. Only a participant that ended it on its own counts as an expiry.
    config = CoordinatorConfig(
        snapshot_root=tmp_path, control_timeout_s=1.0, lease_s=1.0, renew_interval_s=0.3
    )
    metrics = CoordinatorMetrics(CollectorRegistry())
    async with start_topology(tmp_path, lease_s=1.0) as topology:
        coordinator = Coordinator(
            {name: hosted.address for name, hosted in topology.participants.items()},
            token=REAL_TOKEN,
            coordinator_id="coord-real",
            epoch=1,
            config=config,
            metrics=metrics,
        )
        everyone = set(topology.participants)
        async with coordinator, asyncio.timeout(BOUND_S):
            await coordinator.discover()
            with caplog.at_level(logging.DEBUG, logger=coordinator_module.__name__):
                committed = "ck-000000000001"
                await coordinator.prepare(committed)
                await coordinator.commit(committed, committed, {})
                crossed_commit = await coordinator.renew(committed)

                resumed = "ck-000000000002"
                await coordinator.prepare(resumed)
                assert (await coordinator.resume(resumed)).ok
                crossed_resume = await coordinator.renew(resumed)

            for report in (crossed_commit, crossed_resume):
                assert set(report.failures) == everyone
                assert {f.reason for f in report.failures.values()} == {Reason.STALE_CHECKPOINT}
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert metrics.lease_expiries._value.get() == 0

            # Left prepared with nobody renewing: every lease runs out on its own.
            expired = "ck-000000000003"
            await coordinator.prepare(expired)
            await poll(
                lambda: {h.runtime.phase for h in topology.participants.values()} == {Phase.IDLE}
            )
            await coordinator.renew(expired)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(warned) == sorted(
        f"renew: {name} found the checkpoint finished (lease expired?)" for name in everyone
    )
    assert metrics.lease_expiries._value.get() == len(everyone)
