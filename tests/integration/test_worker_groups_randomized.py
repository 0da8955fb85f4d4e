"""Randomized runs of a real job whose agent server is a group of worker processes.

docs/spec.md section 3.9. The agent ``agent-0`` is a :class:`WorkerGroup` of two or
three real ``turnpoint serve`` workers sharing one port; the policy and the two
resources servers are real servers in this process; the trainer is the real
:class:`Checkpointing` facade, given only ``agent-0``'s shared address. Hypothesis
draws what the first incarnation of the job does (dispatch prompt groups, train steps,
take snapshots, in any order) and which worker dies; then:

1. discovery found the workers, each an agent of its own, and rollouts ran on them;
2. a worker killed with SIGKILL is back on its own port as a fresh incarnation, and the
   trainer's liveness watch calls it lost for that (its state is gone);
3. the job restarts (every worker restarted in place, the other servers fresh on their
   ports, a new trainer), restores the newest published snapshot by the workers'
   stable names, and trains to the end;
4. every prompt group of the run is trained exactly once, every trained rollout on a
   worker, with the rewards of a finished rollout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.support.participants import TOKEN
from turnpoint.apps.examples._build import ExampleSpec, build_example
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.auth import auth_metadata
from turnpoint.server import HostedParticipant, ServerOptions, WorkerGroup, host_participant
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    ParticipantLostError,
    RolloutOutcome,
    SnapshotOutcome,
    TorchAnchorSource,
    torch_anchor_loader,
)
from turnpoint.trainer.advanced import watch_liveness
from turnpoint.trainer.control.fanout import FanoutResult
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(110)

BOUND_S = 45.0
GROUP = "agent-0"
GROUP_SIZE = 2
TOTAL_GROUPS = 5
ACTIONS = ("dispatch", "step", "snapshot")


@dataclass
class Servers:
    """The policy and resources servers, in this process, each on a port it keeps."""

    root: Path
    hosted: dict[str, HostedParticipant] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    async def start(self) -> None:
        """Start them fresh (a job restart): on the ports they had, if they had any."""
        specs = {
            "policy": ("model", "tiny-policy"),
            "tools": ("resources", "guess"),
            "group-tools": ("resources", "guess-group"),
        }
        for instance, (kind, example) in specs.items():
            spec = ExampleSpec(instance=instance, root=self.root, token=TOKEN, group_size=2)
            runtime, closers = build_example(kind, example, spec)
            options = ServerOptions(port=self.ports.get(instance, 0), token=TOKEN)
            hosted = host_participant(runtime, options)
            hosted.on_close.extend(closers)
            self.hosted[instance] = await hosted.start()
            self.ports[instance] = hosted.port

    async def stop(self) -> None:
        for hosted in self.hosted.values():
            await hosted.stop(0)
        self.hosted.clear()

    def address(self, instance: str) -> str:
        return f"127.0.0.1:{self.ports[instance]}"


def agent_command(servers: Servers) -> tuple[str, ...]:
    return (
        *(sys.executable, "-m", "turnpoint.apps._cli", "serve"),
        *("--kind", "agent", "--example", "guess", "--root", str(servers.root)),
        *("--policy", servers.address("policy")),
        *("--resources", f"guess={servers.address('tools')}"),
        *("--resources", f"guess-group={servers.address('group-tools')}"),
        # Episodes of a few turns with a pause in each: snapshots cut some mid-way.
        *("--turn-delay", "0.05"),
    )


@asynccontextmanager
async def running_job(root: Path, workers: int) -> AsyncIterator[tuple[Servers, WorkerGroup]]:
    servers = Servers(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNPOINT_TOKEN")}
    env["TURNPOINT_TOKEN"] = TOKEN
    async with AsyncExitStack() as stack:
        await servers.start()
        stack.push_async_callback(servers.stop)
        group = WorkerGroup(GROUP, workers, agent_command(servers), env=env)
        await asyncio.wait_for(group.start(), BOUND_S)
        stack.push_async_callback(group.stop)
        yield servers, group


class Trainer:
    """One incarnation of the trainer: the facade, a step counter and what it trained."""

    def __init__(self, root: Path, endpoints: dict[str, str], lineage: dict[int, list[str]]):
        self.model = torch.nn.Linear(2, 2)
        self.step = 0
        self.next_group = 0
        self.lineage = lineage
        self.published: list[str] = []
        self.instances: list[str] = []
        self.ckpt = Checkpointing(
            CoordinatorConfig(snapshot_root=root, control_timeout_s=10.0),
            endpoints,
            token=TOKEN,
            anchor=TorchAnchorSource(self.model, None, step=lambda: self.step),
            load_anchor=torch_anchor_loader(self.model, None),
            periodic=False,
            # The first trainer's close stands in for its death with the job: no
            # snapshot at exit, only those the scenario takes.
            final_snapshot=False,
        )

    async def open(self) -> None:
        resumed = await asyncio.wait_for(self.ckpt.open(), BOUND_S)
        self.step = resumed.step
        if isinstance(resumed.data_loader, int):
            self.next_group = resumed.data_loader
        # The steps after the restored one were trained into a model now thrown away.
        for step in [s for s in self.lineage if s > self.step]:
            del self.lineage[step]

    @property
    def untrained(self) -> int:
        return self.next_group - sum(len(groups) for groups in self.lineage.values())

    async def act(self, action: str) -> None:
        if action == "dispatch" and self.next_group < TOTAL_GROUPS:
            index, self.next_group = self.next_group, self.next_group + 1
            for rollout in guess_rollouts(index, GROUP_SIZE, 0, self.ckpt.agents):
                self.ckpt.dispatch(rollout, data_loader=self.next_group)
        elif action == "step" and self.untrained > 0:
            assert await self.ckpt.wait_groups(1, timeout_s=BOUND_S), "no group finished"
            async with self.ckpt.step_lock:
                (results,) = self.ckpt.take_ready_groups(1)
                for result in results:
                    assert result.outcome is RolloutOutcome.COMPLETED, result
                    assert "reward" in result.output, result.output
                    self.instances.append(result.instance)
                self.step += 1
                assert self.step not in self.lineage
                self.lineage[self.step] = [results[0].prompt_group_id]
        elif action == "snapshot":
            report = await asyncio.wait_for(self.ckpt.snapshot_now(), BOUND_S)
            if report.outcome is SnapshotOutcome.PUBLISHED:
                self.published.append(report.checkpoint_id)

    async def run(self, actions: Sequence[str]) -> None:
        for action in actions:
            await self.act(action)

    async def finish(self) -> None:
        while self.next_group < TOTAL_GROUPS or self.untrained > 0:
            await self.act("dispatch")
            await self.act("step")


class ProbeRounds:
    """The coordinator as the liveness watch's prober, telling when a round was done."""

    def __init__(self, trainer: Trainer) -> None:
        self._coordinator = trainer.ckpt.coordinator
        self.probed = asyncio.Event()

    @property
    def instances(self) -> tuple[str, ...]:
        return self._coordinator.instances

    async def status_round(self, timeout_s: float) -> FanoutResult[Any]:
        result = await self._coordinator.status_round(timeout_s)
        self.probed.set()
        return result


async def incarnation_of(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        response: pb.DescribeResponse = await pb_grpc.CheckpointControlServiceStub(
            channel
        ).Describe(pb.DescribeRequest(), metadata=auth_metadata(TOKEN), timeout=BOUND_S)
        return response.header.incarnation


async def scenario(root: Path, workers: int, before: Sequence[str], victim: int) -> None:
    lineage: dict[int, list[str]] = {}
    async with running_job(root, workers) as (servers, group):
        members = {m.instance: m.address for m in group.members}
        endpoints = {
            GROUP: group.shared_address,
            **{name: servers.address(name) for name in ("policy", "tools", "group-tools")},
        }
        first = Trainer(root, endpoints, lineage)
        await first.open()
        prober = ProbeRounds(first)
        watch = asyncio.create_task(watch_liveness(prober, interval_s=0.2, lost_after_s=BOUND_S))
        try:
            assert first.ckpt.agents == tuple(sorted(members))
            assert {n: first.ckpt.coordinator.endpoints[n] for n in members} == members
            await first.run(before)
            # At least one published snapshot with whatever is in flight now.
            await first.run(["dispatch", "snapshot"])
            assert first.published, "no snapshot was published"
            index = victim % workers
            killed = group.members[index]
            incarnation = await incarnation_of(killed.address)
            pid = group.pid(index)
            assert pid is not None
            await asyncio.wait_for(prober.probed.wait(), BOUND_S)
            os.kill(pid, signal.SIGKILL)
            await group.wait_restarted(index, 1, BOUND_S)
            assert await incarnation_of(killed.address) != incarnation
            with pytest.raises(ParticipantLostError) as lost:
                await asyncio.wait_for(watch, BOUND_S)
            assert lost.value.lost == lost.value.restarted == (killed.instance,)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await first.ckpt.aclose()  # the trainer dies with the job: no last snapshot
        trained_first = list(first.instances)

        # The job restart: every participant fresh at the address it had, a new trainer.
        await servers.stop()
        await group.restart_all(BOUND_S)
        await servers.start()
        second = Trainer(root, endpoints, lineage)
        await second.open()
        try:
            assert second.ckpt.resumed.checkpoint_id == first.published[-1]
            assert second.ckpt.agents == tuple(sorted(members))
            await second.finish()
        finally:
            await second.ckpt.aclose()

    trained = [group for step in sorted(lineage) for group in lineage[step]]
    assert sorted(lineage) == list(range(1, len(lineage) + 1))
    counts = Counter(trained)
    assert all(n == 1 for n in counts.values()), counts
    assert set(trained) == {f"g{g:05d}" for g in range(TOTAL_GROUPS)}
    ran_on = set(trained_first) | set(second.instances)
    assert ran_on <= set(members) and len(ran_on) >= 2, ran_on


def _run(workers: int, before: Sequence[str], victim: int) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="worker-groups-") as tmp:
        asyncio.run(scenario(Path(tmp) / "snapshots", workers, before, victim))


plans = st.lists(st.sampled_from(ACTIONS), min_size=2, max_size=8)
examples: Callable[[Callable[..., None]], Callable[..., None]] = settings(
    max_examples=2, deadline=None, suppress_health_check=list(HealthCheck)
)


@pytest.mark.parametrize("workers", [2, 3])
@examples
@given(before=plans, victim=st.integers(min_value=0, max_value=2))
def test_a_job_over_a_worker_group_trains_every_group_once_through_a_worker_kill(
    workers: int, before: list[str], victim: int
) -> None:
    _run(workers, before, victim)
