"""Acceptance tests of the trainer coordinator (issue 4) against real participants.

Every participant is a real SDK runtime served over gRPC on ``127.0.0.1:0``
(``host_scripted`` or the example topology); the trainer side is the real
:class:`Coordinator`, :class:`RolloutClient` and :class:`SnapshotDriver`. Where a test
needs the network to misbehave, a byte-level :class:`Proxy` sits between the trainer and
one participant: it lets the real call run on the participant and then loses its reply,
or keeps a Run going after the trainer cancelled it (a cancellation that never arrived).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.fakes import FakeAnchor, FakeClock
from tests.support.participants import TOKEN, Topology, start_topology
from tests.support.scripted import (
    BOUND_S,
    RestartTools,
    ScriptedAgent,
    ScriptedTools,
    bounded,
    host_scripted,
)
from turnpoint.apps.examples._task import make_prompt
from turnpoint.ids import EpisodeId
from turnpoint.protocol import EpisodeState, RecoveryLevel
from turnpoint.server import HostedParticipant
from turnpoint.trainer import (
    CoordinatorConfig,
    Rollout,
    RolloutClientSettings,
    RolloutOutcome,
    SnapshotOutcome,
)
from turnpoint.trainer.advanced import (
    AgentEndpoint,
    Coordinator,
    PreparedCheckpoint,
    Restorer,
    RolloutClient,
    SnapshotDriver,
    SnapshotLayout,
    apply_plan,
)
from turnpoint.trainer.control import coordinator as coordinator_module
from turnpoint.trainer.restore.restorer import RerunReason
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import rollout_service_pb2 as ro_pb

_CONTROL = "/turnpoint.v1.CheckpointControlService/ControlSession"
_RUN = "/turnpoint.v1.RolloutService/Run"
_ENVIRONMENT = "scripted"


class EnvAgent(ScriptedAgent):
    environment = _ENVIRONMENT


class EnvTools(ScriptedTools):
    environment = _ENVIRONMENT


class RiskyAgent(ScriptedAgent):
    environment = "risky"


class RiskyTools(RestartTools):
    environment = "risky"


# ------------------------------------------------------------------------ the proxy


class Proxy(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Forwards every call, as bytes, to one participant; faults are armed by the test.

    ``lose`` maps a ControlSession operation (``"prepare"``, ``"commit"``, ...) or
    ``"result"`` (a Run's final result) to how many of its replies to lose: the
    participant acted, then the trainer's stream breaks with UNAVAILABLE instead of
    delivering the reply. With ``swallow_cancel`` a Run the trainer cancels keeps going
    upstream, drained by nobody: the participant never hears of the cancellation.
    """

    def __init__(self, upstream: str) -> None:
        self._upstream = grpc.aio.insecure_channel(upstream)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self.lose: dict[str, int] = {}
        self.lost: list[str] = []
        self.swallow_cancel = False
        self.results_seen = 0
        self._detached: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(0)
        for task in self._detached:
            task.cancel()
        await asyncio.gather(*self._detached, return_exceptions=True)
        await self._upstream.close(None)

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method

        async def forward(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for reply in self._forward(method, requests, context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(forward)

    def _lost(self, method: str, reply: bytes) -> str | None:
        kind: str | None
        if method == _CONTROL:
            kind = pb.ControlSessionResponse.FromString(reply).WhichOneof("result")
        elif method == _RUN:
            kind = ro_pb.RunResponse.FromString(reply).WhichOneof("event")
            self.results_seen += kind == "result"
        else:
            return None
        if kind is None or self.lose.get(kind, 0) <= 0:
            return None
        self.lose[kind] -= 1
        self.lost.append(kind)
        return kind

    async def _forward(
        self, method: str, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        metadata = tuple(
            (m.key, m.value) for m in context.invocation_metadata() if m.key == "authorization"
        )
        call = self._upstream.stream_stream(
            method, request_serializer=None, response_deserializer=None
        )(None, metadata=metadata)
        replies: asyncio.Queue[bytes | grpc.aio.AioRpcError | None] = asyncio.Queue()

        async def send() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                async for request in requests:
                    await call.write(request)
                await call.done_writing()

        async def receive() -> None:
            try:
                async for reply in call:
                    replies.put_nowait(reply)
                replies.put_nowait(None)
            except grpc.aio.AioRpcError as error:
                replies.put_nowait(error)

        sender = asyncio.create_task(send())
        receiver = asyncio.create_task(receive())
        detach = False
        try:
            headers = await call.initial_metadata()
            if headers:
                await context.send_initial_metadata(tuple(headers))
            while (reply := await replies.get()) is not None:
                if isinstance(reply, grpc.aio.AioRpcError):
                    await context.abort(
                        reply.code(), reply.details() or "", reply.trailing_metadata() or ()
                    )
                    return
                if self._lost(method, reply) is not None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "reply lost by the proxy")
                    return
                yield reply
        except asyncio.CancelledError:
            detach = self.swallow_cancel and method == _RUN
            raise
        finally:
            sender.cancel()
            if detach:
                # The cancellation stops here: upstream the Run goes on, read by nobody.
                self._detached.add(receiver)
            else:
                call.cancel()
                receiver.cancel()


@contextlib.asynccontextmanager
async def proxied(hosted: HostedParticipant) -> AsyncIterator[Proxy]:
    proxy = Proxy(hosted.address)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


# ------------------------------------------------------------------------ the trainer


@dataclass
class Trainer:
    coordinator: Coordinator
    client: RolloutClient
    driver: SnapshotDriver
    layout: SnapshotLayout
    clock: FakeClock
    config: CoordinatorConfig
    anchor: FakeAnchor = field(default_factory=FakeAnchor)

    def restorer(self) -> Restorer:
        return Restorer(
            self.coordinator, self.layout, self.config, load_anchor=lambda snapshot, ref: 1
        )

    async def prepare_ready(self) -> None:
        """A fresh prepare is ready at once everywhere; then it is released."""
        checkpoint_id = await self.driver.next_checkpoint_id()
        async with self.coordinator.prepared(checkpoint_id) as prepared:
            assert all(r.ready for r in prepared.readiness.values()), prepared.readiness


def config_for(root: Path, **extra: Any) -> CoordinatorConfig:
    return CoordinatorConfig(
        snapshot_root=root, control_timeout_s=5.0, resume_retry_pause_s=0, **extra
    )


@contextlib.asynccontextmanager
async def trainer_for(
    root: Path,
    control: Mapping[str, str],
    agents: Mapping[str, str],
    *,
    clock: FakeClock | None = None,
    epoch: int = 1,
    coordinator_wrapper: Any = None,
    target_level: str = "turn",
) -> AsyncIterator[Trainer]:
    clock = clock or FakeClock()
    config = config_for(root, target_level=target_level)
    layout = SnapshotLayout(root)
    coordinator = Coordinator(
        control, token=TOKEN, coordinator_id="coord-acceptance", epoch=epoch, config=config
    )
    await coordinator.discover()
    client = RolloutClient(
        {name: AgentEndpoint(address, TOKEN) for name, address in agents.items()},
        settings=RolloutClientSettings(
            retry_backoff_s=0.0, admission_backoff_s=0.01, budget_grace_s=0.0
        ),
        clock=clock,
    )
    anchor = FakeAnchor()
    driver = SnapshotDriver(
        coordinator=coordinator
        if coordinator_wrapper is None
        else coordinator_wrapper(coordinator),
        rollouts=client,
        anchor=anchor,
        layout=layout,
        config=config,
        epoch=epoch,
    )
    async with coordinator, client:
        yield Trainer(coordinator, client, driver, layout, clock, config, anchor)


def scripted_rollout(
    rollout_id: str,
    *,
    turns: int = 2,
    group: str | None = None,
    sibling: int = 0,
    size: int = 1,
    budget_s: float | None = None,
    instance: str = "agent-0",
    model: bool = True,
    environment: str = _ENVIRONMENT,
) -> Rollout:
    return Rollout(
        rollout_id=rollout_id,
        prompt_group_id=group or f"g-{rollout_id}",
        sibling_index=sibling,
        group_size=size,
        environment=environment,
        task={"turns": turns, "model": model},
        instance=instance,
        budget_s=budget_s,
    )


def held_by(hosted: HostedParticipant) -> dict[EpisodeId, EpisodeState]:
    return {entry.key.episode: entry.state for entry in hosted.runtime.core.entries()}


async def parked_at(trainer: Trainer, episode: EpisodeId, boundaries: int) -> None:
    def seen() -> bool:
        return any(
            r.episode == episode and r.boundaries_seen >= boundaries
            for r in trainer.client.in_flight()
        )

    await trainer.client.wait_for(seen, BOUND_S)


class CommitGate:
    """The real coordinator, whose commit waits until the test opens the gate: a
    snapshot held open for as long as the test likes, with everything prepared."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self.committing = asyncio.Event()
        self.open = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coordinator, name)

    def held(self, checkpoint: PreparedCheckpoint) -> Any:
        return self._coordinator.held(checkpoint)

    async def commit(
        self, checkpoint_id: str, snapshot: str, scope: Mapping[str, Iterable[EpisodeId]]
    ) -> Any:
        self.committing.set()
        await self.open.wait()
        return await self._coordinator.commit(checkpoint_id, snapshot, scope)


@contextlib.asynccontextmanager
async def gated_trainer(
    root: Path, hosted: HostedParticipant, *, clock: FakeClock | None = None
) -> AsyncIterator[tuple[Trainer, CommitGate]]:
    """A trainer on the one agent ``hosted``, whose commits wait for the gate."""
    gates: list[CommitGate] = []

    def gate(coordinator: Coordinator) -> CommitGate:
        gates.append(CommitGate(coordinator))
        return gates[-1]

    address = {"agent-0": hosted.address}
    async with trainer_for(
        root, address, address, clock=clock, coordinator_wrapper=gate
    ) as trainer:
        yield trainer, gates[0]


# -------------------------------------------------------------- 1. parked deadline


@pytest.mark.parametrize("weight_sync", ["none", "released_during", "released_after"])
async def test_a_rollout_parked_longer_than_its_budget_finishes_is_acknowledged_and_prepare_is_ready(
    tmp_path: Path, weight_sync: str
) -> None:
    clock = FakeClock()
    agent = EnvAgent()
    async with (
        host_scripted(tmp_path, agent=agent, clock=clock) as hosted,
        gated_trainer(tmp_path, hosted, clock=clock) as (trainer, gate),
    ):
        client = trainer.client
        episode = client.dispatch(scripted_rollout("r0", budget_s=10.0))
        await parked_at(trainer, episode, 1)
        sync = client.hold_deadlines("weight-sync") if weight_sync != "none" else None

        taking = asyncio.create_task(trainer.driver.take())
        await bounded(gate.committing.wait())
        # Prepared and held open: the episode waits at its boundary far past its budget.
        clock.advance(60.0)
        assert client.expire_due() == []
        assert held_by(hosted)[episode] is EpisodeState.AWAITING_MODEL
        if sync is not None and weight_sync == "released_during":
            client.release_deadlines(sync)
            sync = None
            clock.advance(60.0)
            # The snapshot still holds: the clocks stay stopped.
            assert client.expire_due() == []
        gate.open.set()
        report = await bounded(taking)
        assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
        if sync is not None:
            clock.advance(60.0)
            # The snapshot ended but the weight sync still holds the clocks.
            assert client.expire_due() == []
            assert client.deadlines_held
            client.release_deadlines(sync)
        assert not client.deadlines_held
        remaining = client.remaining_budget(episode)
        assert remaining is not None and remaining > 0

        agent.reply(episode, "guess")
        result = await bounded(client.next_result())
        assert result.episode == episode
        assert result.outcome is RolloutOutcome.COMPLETED
        await client.drain_acknowledgements(BOUND_S)
        assert held_by(hosted) == {}
        await trainer.prepare_ready()


async def test_a_rollout_dispatched_during_a_snapshot_waits_at_its_agent_and_is_in_no_cut(
    tmp_path: Path,
) -> None:
    # docs/spec.md section 7.4 steps 4 and 6: dispatch reopens once the books are read;
    # the new Run waits at its agent (section 5.2 item 1) until the agent's commit ends
    # the checkpoint (section 4.8 item 9), and the snapshot does not hold it.
    agent = EnvAgent()
    async with (
        host_scripted(tmp_path, agent=agent) as hosted,
        gated_trainer(tmp_path, hosted) as (trainer, gate),
    ):
        client = trainer.client
        first = client.dispatch(scripted_rollout("r0"))
        await parked_at(trainer, first, 1)

        taking = asyncio.create_task(trainer.driver.take())
        await bounded(gate.committing.wait())
        assert client.dispatch_open
        late = client.dispatch(scripted_rollout("r1"))
        # A short real wait for something that must not happen: the Run is neither
        # refused nor admitted while the checkpoint holds the agent.
        await asyncio.sleep(0.3)
        assert late in client.waiting()
        assert late not in held_by(hosted)
        assert client.stats().admission_refusals == 0

        gate.open.set()
        report = await bounded(taking)
        assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
        # Released by its commit: no resume was needed to admit the new Run.
        assert trainer.coordinator.released(report.checkpoint_id) == {"agent-0"}
        await client.wait_for(lambda: any(r.episode == late for r in client.in_flight()), BOUND_S)
        assert client.stats().admission_refusals == 0
        manifest = trainer.layout.load(report.checkpoint_id)
        assert [p.episode for p in manifest.continued] == [first]
        assert [r["rollout_id"] for r in manifest.rollout_state.in_flight] == ["r0"]


# -------------------------------------------------------------- 2. a given-up rollout


async def test_giving_up_cancels_the_run_nothing_is_owed_and_the_next_prepare_is_ready(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    agent = EnvAgent()
    async with (
        host_scripted(tmp_path, agent=agent, clock=clock) as hosted,
        trainer_for(
            tmp_path, {"agent-0": hosted.address}, {"agent-0": hosted.address}, clock=clock
        ) as trainer,
    ):
        client = trainer.client
        episode = client.dispatch(scripted_rollout("r0", budget_s=10.0))
        await parked_at(trainer, episode, 1)
        trainer.clock.advance(11.0)
        assert client.expire_due() == [episode]
        assert await hosted.runtime.wait_until(
            lambda core: (
                all(v.state is not EpisodeState.COMPLETED_UNACKED for v in core.entries())
                and all(v.receipt is None for v in core.entries())
            ),
            BOUND_S,
        )
        assert client.results()[0].outcome is RolloutOutcome.GIVEN_UP
        await trainer.prepare_ready()


# ----------------------------------------------------- 3. a cancellation that never arrives


async def test_a_lost_cancellation_is_resolved_by_the_retire_before_prepare(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    agent = EnvAgent()
    async with (
        host_scripted(tmp_path, agent=agent, clock=clock) as hosted,
        proxied(hosted) as proxy,
        trainer_for(
            tmp_path, {"agent-0": hosted.address}, {"agent-0": proxy.address}, clock=clock
        ) as trainer,
    ):
        client = trainer.client
        proxy.swallow_cancel = True
        # Given up before its first boundary: still queued for Retire, since a resources
        # server may hold its session (docs/spec.md section 7.6 item 2).
        episode = client.dispatch(scripted_rollout("r0", turns=1, budget_s=10.0, model=False))
        await client.wait_for(lambda: [r.episode for r in client.in_flight()] == [episode], BOUND_S)
        clock.advance(11.0)
        assert client.expire_due() == [episode]
        assert client.pending_retires() == {"agent-0": (episode,)}
        # The participant never heard: the episode finishes and its completion waits for
        # an acknowledgement that nobody will send.
        agent.release(episode)
        await poll_state(hosted, episode, EpisodeState.COMPLETED_UNACKED)

        published = await trainer.driver.take()
        # The retire step, while the participant is still idle, retires the attempt and
        # with it the completion nobody will acknowledge: prepare never meets it.
        assert published.outcome is SnapshotOutcome.PUBLISHED, published.detail
        assert held_by(hosted) == {}
        assert client.pending_retires() == {}
        await trainer.prepare_ready()


async def poll_state(hosted: HostedParticipant, episode: EpisodeId, state: EpisodeState) -> None:
    assert await hosted.runtime.wait_until(
        lambda core: any(v.key.episode == episode and v.state is state for v in core.entries()),
        BOUND_S,
    ), f"{episode} never reached {state}"


# ----------------------------------------------------------------- 4. lost replies


@pytest.mark.parametrize("operation", ["prepare", "commit", "resume"])
async def test_a_lost_snapshot_reply_is_retried_and_nothing_is_done_twice(
    tmp_path: Path, operation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if operation == "resume":
        # A participant that ends the checkpoint in its commit needs no resume: this
        # case is the older exchange, where the resume carries the release.
        monkeypatch.setattr(coordinator_module, "RELEASE_IN_COMMIT", False)
    agent = EnvAgent()
    async with (
        host_scripted(tmp_path, agent=agent) as hosted,
        proxied(hosted) as proxy,
        trainer_for(tmp_path, {"agent-0": proxy.address}, {"agent-0": hosted.address}) as trainer,
    ):
        episode = trainer.client.dispatch(scripted_rollout("r0"))
        await parked_at(trainer, episode, 1)
        proxy.lose[operation] = 1

        report = await trainer.driver.take()

        assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
        assert proxy.lost == [operation]
        assert trainer.layout.list_published() == [report.checkpoint_id]
        manifest = trainer.layout.load(report.checkpoint_id)
        assert [p.episode for p in manifest.continued] == [episode]
        # One export of the saved turn, one execution, and the participant reopened.
        assert len(agent.exports) == 1
        assert [started for started, _ in agent.started] == [episode]
        agent.reply(episode, "guess")
        result = await bounded(trainer.client.next_result())
        assert result.outcome is RolloutOutcome.COMPLETED
        await trainer.client.drain_acknowledgements(BOUND_S)
        assert held_by(hosted) == {}


async def test_a_lost_run_result_is_fetched_again_delivered_once_and_acknowledged_once(
    tmp_path: Path,
) -> None:
    agent = EnvAgent()
    async with (
        host_scripted(tmp_path, agent=agent) as hosted,
        proxied(hosted) as proxy,
        trainer_for(tmp_path, {"agent-0": hosted.address}, {"agent-0": proxy.address}) as trainer,
    ):
        client = trainer.client
        proxy.lose["result"] = 1
        episode = client.dispatch(scripted_rollout("r0", turns=1))
        agent.reply(episode, "guess")
        result = await bounded(client.next_result())
        await client.drain_acknowledgements(BOUND_S)

        assert proxy.lost == ["result"]
        assert proxy.results_seen == 2  # lost once, replayed once from the retained result
        assert result.episode == episode and result.outcome is RolloutOutcome.COMPLETED
        assert client.results() == ()
        assert [started for started, _ in agent.started] == [episode]
        assert held_by(hosted) == {}
        assert client.stats().acknowledged == 1
        await trainer.prepare_ready()


async def snapshot_of_a_parked_rollout(root: Path) -> EpisodeId:
    """Publish one snapshot that continues rollout ``r0`` from its first boundary."""
    agent = EnvAgent()
    async with (
        host_scripted(root, agent=agent) as hosted,
        trainer_for(root, {"agent-0": hosted.address}, {"agent-0": hosted.address}) as trainer,
    ):
        episode = trainer.client.dispatch(scripted_rollout("r0"))
        await parked_at(trainer, episode, 1)
        report = await trainer.driver.take()
        assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
    return episode


async def test_a_lost_restore_reply_is_retried_and_the_attempt_installed_once(
    tmp_path: Path,
) -> None:
    saved = await snapshot_of_a_parked_rollout(tmp_path)
    agent = EnvAgent()
    async with (
        host_scripted(tmp_path, agent=agent) as hosted,
        proxied(hosted) as proxy,
        trainer_for(
            tmp_path, {"agent-0": proxy.address}, {"agent-0": hosted.address}, epoch=2
        ) as trainer,
    ):
        # The participant serves RestoreRunning (docs/spec.md section 4.16): that is the
        # restore the coordinator sends it, and whose reply is lost.
        proxy.lose["restore_running"] = 1
        plan = await trainer.restorer().restore()

        assert proxy.lost == ["restore_running"]
        assert plan is not None and not plan.restore_failed
        continued = saved.next_attempt()
        assert [r.episode for r in plan.redispatch] == [continued]
        assert held_by(hosted) == {continued: EpisodeState.RESTORED}
        apply_plan(plan, trainer.client)
        agent.reply(continued, "guess")
        result = await bounded(trainer.client.next_result())
        await trainer.client.drain_acknowledgements(BOUND_S)

    assert result.episode == continued and result.outcome is RolloutOutcome.COMPLETED
    # One execution, continued from the saved turn.
    assert [(e, r is not None) for e, r in agent.started] == [(continued, True)]


async def test_a_lost_retire_reply_is_retried_and_retire_stays_idempotent(
    tmp_path: Path,
) -> None:
    saved = await snapshot_of_a_parked_rollout(tmp_path)
    async with (
        host_scripted(tmp_path, agent=EnvAgent()) as hosted,
        proxied(hosted) as proxy,
        trainer_for(
            tmp_path, {"agent-0": proxy.address}, {"agent-0": hosted.address}, epoch=2
        ) as trainer,
    ):
        plan = await trainer.restorer().restore()
        continued = saved.next_attempt()
        assert plan is not None and [r.episode for r in plan.redispatch] == [continued]
        proxy.lose["retire"] = 1

        first = await trainer.coordinator.retire({"agent-0": [continued]})
        again = await trainer.coordinator.retire({"agent-0": [continued]}, key="once-more")

        assert proxy.lost == ["retire"]
        assert first.ok and again.ok, (first.failures, again.failures)
        assert held_by(hosted) == {}
        await trainer.prepare_ready()


# ------------------------------------------------- 6. a restart-only resources server


@contextlib.asynccontextmanager
async def safe_and_risky(root: Path) -> AsyncIterator[dict[str, HostedParticipant]]:
    """``safe-0`` (an exported environment) and ``risky-0`` (whose tools restart only)."""
    async with (
        host_scripted(root, instance="safe-0", agent=EnvAgent(), resources=EnvTools()) as safe,
        host_scripted(
            root, instance="risky-0", agent=RiskyAgent(), resources=RiskyTools()
        ) as risky,
    ):
        yield {"safe-0": safe, "risky-0": risky}


async def test_a_restart_only_server_lowers_its_environment_once_and_discards_only_its_turns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with safe_and_risky(tmp_path) as hosted:
        addresses = {name: h.address for name, h in hosted.items()}
        async with trainer_for(tmp_path, addresses, addresses) as trainer:
            safe = trainer.client.dispatch(scripted_rollout("safe", instance="safe-0"))
            risky = trainer.client.dispatch(
                scripted_rollout("risky", instance="risky-0", environment="risky")
            )
            await parked_at(trainer, safe, 1)
            await parked_at(trainer, risky, 1)
            report = await trainer.driver.take()
            assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
            manifest = trainer.layout.load(report.checkpoint_id)
            # Both saved their turn: the cut did not know about levels.
            assert sorted(p.episode for p in manifest.continued) == [risky, safe]

    # Each coordinator start warns at discovery (docs/spec.md section 7.1 item 3): count
    # the restarted one's warnings only.
    caplog.clear()
    async with safe_and_risky(tmp_path) as hosted:
        addresses = {name: h.address for name, h in hosted.items()}
        async with trainer_for(tmp_path, addresses, addresses, epoch=2) as trainer:
            with caplog.at_level(logging.WARNING):
                plan = await trainer.restorer().restore()
            lowered = [r for r in caplog.records if "recovery level lowered" in r.getMessage()]
            assert len(lowered) == 1, [r.getMessage() for r in lowered]
            assert "'risky'" in lowered[0].getMessage()
            assert plan is not None
            assert plan.levels["risky"].effective is RecoveryLevel.SIBLING
            assert plan.levels[_ENVIRONMENT].effective is RecoveryLevel.TURN
            # Only the risky turn is discarded; the safe one continues where it was.
            assert [r.episode for r in plan.redispatch] == [safe.next_attempt()]
            assert [(r.episode, r.reason) for r in plan.rerun] == [
                (risky.next_attempt(), RerunReason.LEVEL)
            ]
            assert held_by(hosted["safe-0"]) == {safe.next_attempt(): EpisodeState.RESTORED}
            assert held_by(hosted["risky-0"]) == {}


# ------------------------------------------- 5. a group-scored environment, each level

_GROUP = 3


def group_sibling(sibling: int) -> Rollout:
    task = make_prompt(sibling, seed=0)
    return Rollout(
        rollout_id=f"pair-{sibling}",
        prompt_group_id="gp",
        sibling_index=sibling,
        group_size=_GROUP,
        environment="guess-group",
        task={
            "task": task.to_dict(),
            "environment": "guess-group",
            "prompt_group_id": "gp",
            "sibling_index": sibling,
            "group_size": _GROUP,
        },
        instance="agent-0",
    )


def addresses_of(topology: Topology) -> tuple[dict[str, str], dict[str, str]]:
    control = {name: hosted.address for name, hosted in topology.participants.items()}
    return control, {"agent-0": topology.agents[0].address}


@pytest.mark.parametrize("level", ["turn", "sibling", "prompt_group"])
async def test_a_half_finished_group_scored_group_restores_at_each_level(
    tmp_path: Path, level: str
) -> None:
    async with start_topology(tmp_path, group_size=_GROUP) as topology:
        control, agents = addresses_of(topology)
        async with trainer_for(tmp_path, control, agents) as trainer:
            # Two of three siblings: each verify waits for the third, so both are in
            # flight at the cut, each past its first turn. Not merely past its first
            # boundary: the agent seeds its session on group-tools after boundary 0, so
            # a cut there may come before the session exists (nothing to export).
            first = trainer.client.dispatch(group_sibling(0))
            second = trainer.client.dispatch(group_sibling(1))
            await parked_at(trainer, first, 2)
            await parked_at(trainer, second, 2)
            report = await trainer.driver.take()
            assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail

    async with start_topology(tmp_path, group_size=_GROUP) as topology:
        control, agents = addresses_of(topology)
        async with trainer_for(tmp_path, control, agents, epoch=2, target_level=level) as trainer:
            plan = await trainer.restorer().restore()
            assert plan is not None and not plan.restore_failed
            replacements = [first.next_attempt(), second.next_attempt()]
            if level == "turn":
                # Every sibling can continue: the group continues, nothing reruns.
                assert [r.episode for r in plan.redispatch] == replacements
                assert plan.rerun == () and plan.groups_retried_whole == 0
                assert plan.restore_scope["group-tools"] == (first, second)
            else:
                # No sibling may continue, so the group is retried whole, from prompts.
                assert plan.redispatch == ()
                assert [(r.episode, r.reason) for r in plan.rerun] == [
                    (e, RerunReason.GROUP) for e in replacements
                ]
                assert plan.groups_retried_whole == 1
                assert all(scope == () for scope in plan.restore_scope.values())
            apply_plan(plan, trainer.client)
            trainer.client.dispatch(group_sibling(2))
            await trainer.client.wait_for(lambda: len(trainer.client.results()) == _GROUP, BOUND_S)
            results = {r.rollout_id: r for r in trainer.client.results()}

    assert {r.episode for r in results.values()} == {*replacements, EpisodeId("pair-2", 0)}
    assert {r.outcome for r in results.values()} == {RolloutOutcome.COMPLETED}
