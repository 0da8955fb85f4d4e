"""The facade fails fast, and only when it matters (docs/spec.md section 6.1 item 3 and
docs/embedding.md), against real participants on 127.0.0.1:0: a rollout for an unknown
agent or environment is refused at dispatch, naming the known ones; a restore the
participants refuse (the trainer restarted alone) ends the start unless a degraded start
is allowed, unless they serve RestoreRunning (a trainer restart then restores into them,
docs/spec.md section 4.16); and leaving cleanly takes a final snapshot of the rollouts
still running."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.participants import TOKEN, Topology, start_topology
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.errors import Reason
from turnpoint.trainer import (
    AnchorError,
    Checkpointing,
    CoordinatorConfig,
    CoordinatorError,
    ParticipantLostError,
    RestoreRefusedError,
    RolloutOutcome,
    SnapshotOutcome,
    TorchAnchorSource,
    torch_anchor_loader,
)
from turnpoint.trainer.advanced import SnapshotLayout

GROUP_SIZE = 2


def _facade(
    topology: Topology, config: dict[str, Any] | None = None, **options: Any
) -> Checkpointing:
    model = torch.nn.Linear(2, 2)
    options.setdefault("anchor", TorchAnchorSource(model, None, step=lambda: 0))
    return Checkpointing(
        CoordinatorConfig(snapshot_root=topology.root, control_timeout_s=10.0, **(config or {})),
        {n: h.address for n, h in topology.participants.items()},
        token=TOKEN,
        load_anchor=torch_anchor_loader(model, None),
        periodic=False,
        **options,
    )


def _parked(agents: tuple[str, ...]) -> Any:
    # Group 1 is group-scored: one sibling alone waits for the other at its verify, so it
    # is unfinished whenever the run ends, whatever the timing.
    return guess_rollouts(1, GROUP_SIZE, 0, agents)[0]


async def test_a_rollout_for_an_unknown_agent_or_environment_is_refused_naming_the_known(
    tmp_path: Path,
) -> None:
    async with (
        start_topology(tmp_path / "p", agents=1, group_size=GROUP_SIZE) as topology,
        _facade(topology, final_snapshot=False) as ckpt,
    ):
        rollout = guess_rollouts(0, GROUP_SIZE, 0, ckpt.agents)[0]
        with pytest.raises(CoordinatorError) as wrong_agent:
            ckpt.dispatch(dataclasses.replace(rollout, instance="agent-9"))
        with pytest.raises(CoordinatorError) as wrong_environment:
            ckpt.dispatch(dataclasses.replace(rollout, environment="gues"))
        assert ckpt.rollouts.stats().dispatched == 0
        ckpt.dispatch(rollout)  # the same rollout, spelled right, runs
        assert ckpt.rollouts.stats().dispatched == 1
    assert wrong_agent.value.reason is Reason.INVALID_ARGUMENT
    assert wrong_agent.value.metadata["field"] == "instance"
    assert "'agent-9'" in str(wrong_agent.value) and "agent-0" in str(wrong_agent.value)
    assert wrong_environment.value.metadata["field"] == "environment"
    assert "guess, guess-group" in str(wrong_environment.value)


async def test_leaving_cleanly_saves_the_unfinished_rollouts_and_a_lone_trainer_restart_is_refused(
    tmp_path: Path,
) -> None:
    # Participants without RestoreRunning (docs/spec.md section 4.16): only a fresh one
    # can be restored.
    async with start_topology(
        tmp_path / "p", agents=1, group_size=GROUP_SIZE, restore_running=False
    ) as topology:
        layout = SnapshotLayout(topology.root)
        async with _facade(topology) as ckpt:
            parked = _parked(ckpt.agents)
            ckpt.dispatch(parked)
            await ckpt.rollouts.wait_for(
                lambda: any(r.boundaries_seen >= 1 for r in ckpt.rollouts.in_flight()), 60.0
            )
        (final,) = ckpt.reports
        assert final.outcome is SnapshotOutcome.PUBLISHED, final
        assert layout.latest() == final.checkpoint_id
        saved = layout.load(final.checkpoint_id)
        assert [r["rollout_id"] for r in saved.rollout_state.in_flight] == [parked.rollout_id]

        # The trainer restarts alone: the participants still hold the first run's
        # episodes, so they refuse the restore, and the start ends there...
        with pytest.raises(RestoreRefusedError) as refused:
            async with _facade(topology, final_snapshot=False):
                raise AssertionError("a refused restore must not start the run")
        assert refused.value.checkpoint_id == final.checkpoint_id
        assert refused.value.failures
        assert "allow_degraded_restore" in str(refused.value)

        # ...unless a degraded start is allowed: the saved rollout starts over.
        async with _facade(topology, allow_degraded_restore=True, final_snapshot=False) as ckpt:
            assert ckpt.resumed.checkpoint_id == final.checkpoint_id
            assert ckpt.resumed.resumed_rollouts == 0
            assert ckpt.resumed.rerun_rollouts == 1


async def test_a_trainer_restart_restores_into_the_running_participants_and_rollouts_go_on(
    tmp_path: Path,
) -> None:
    # Issue 24 item 3: every participant serves RestoreRunning, so trainer B (the next
    # epoch) restores trainer A's last snapshot where the participants run.
    async with start_topology(tmp_path / "p", agents=1, group_size=GROUP_SIZE) as topology:
        first, second = guess_rollouts(1, GROUP_SIZE, 0, topology_agents(topology))
        trainer_a = _facade(topology, final_snapshot=False)
        await trainer_a.open()
        trainer_a.dispatch(first)  # group-scored: it waits at its verify for its sibling
        await trainer_a.rollouts.wait_for(
            lambda: any(r.boundaries_seen >= 1 for r in trainer_a.rollouts.in_flight()), 60.0
        )
        report = await trainer_a.snapshot_now()
        assert report.outcome is SnapshotOutcome.PUBLISHED, report
        await trainer_a.aclose()  # dies: no final snapshot, the participants keep running

        async with _facade(topology, final_snapshot=False) as trainer_b:
            assert trainer_b.resumed.checkpoint_id == report.checkpoint_id
            assert trainer_b.resumed.resumed_rollouts == 1
            assert trainer_b.resumed.rerun_rollouts == 0
            trainer_b.dispatch(second)
            assert await trainer_b.wait_groups(1, timeout_s=60.0)
            (group,) = trainer_b.take_ready_groups(1)
            attempts = {r.episode.rollout_id: r.episode.attempt for r in group}
            assert attempts == {first.rollout_id: 1, second.rollout_id: 0}
            assert {r.outcome for r in group} == {RolloutOutcome.COMPLETED}


async def test_fresh_participants_without_the_capability_are_restored_the_old_way(
    tmp_path: Path,
) -> None:
    root = tmp_path / "p"
    async with start_topology(root, agents=1, group_size=GROUP_SIZE, restore_running=False) as job:
        first, second = guess_rollouts(1, GROUP_SIZE, 0, topology_agents(job))
        async with _facade(job) as trainer_a:
            trainer_a.dispatch(first)
            await trainer_a.rollouts.wait_for(
                lambda: any(r.boundaries_seen >= 1 for r in trainer_a.rollouts.in_flight()), 60.0
            )
    # The job restarts whole (docs/spec.md section 7.11 item 4): fresh processes, same names.
    async with (
        start_topology(root, agents=1, group_size=GROUP_SIZE, restore_running=False) as job,
        _facade(job, final_snapshot=False) as trainer_b,
    ):
        topology = trainer_b.coordinator.topology
        assert not any(p.restore_running for p in topology.participants.values())
        assert trainer_b.resumed.resumed_rollouts == 1
        trainer_b.dispatch(second)
        assert await trainer_b.wait_groups(1, timeout_s=60.0)
        (group,) = trainer_b.take_ready_groups(1)
        assert {r.episode.attempt for r in group} == {0, 1}


def topology_agents(topology: Topology) -> tuple[str, ...]:
    return tuple(h.runtime.instance_name for h in topology.agents)


async def test_no_final_snapshot_when_asked_not_to(tmp_path: Path) -> None:
    async with start_topology(tmp_path / "p", agents=1, group_size=GROUP_SIZE) as topology:
        async with _facade(topology, final_snapshot=False) as ckpt:
            ckpt.dispatch(_parked(ckpt.agents))
        assert ckpt.reports == []
        assert SnapshotLayout(topology.root).latest() is None


async def test_no_final_snapshot_after_the_run_ended_on_a_lost_participant(
    tmp_path: Path,
) -> None:
    async with start_topology(tmp_path / "p", agents=1, group_size=GROUP_SIZE) as topology:
        ckpt = _facade(
            topology,
            {"liveness_interval_s": 0.2, "participant_lost_after_s": 1.0},
            watch_liveness=True,
        )
        await ckpt.open()
        ckpt.dispatch(_parked(ckpt.agents))
        await topology.tools.stop(0)
        with pytest.raises(ParticipantLostError):
            async with asyncio.timeout(60.0):
                while True:
                    await ckpt.wait_groups(1, timeout_s=1.0)
        # Closing explicitly after the failure: no snapshot of a run that lost a
        # participant, and no wait on the one that is gone.
        await ckpt.aclose()
    assert ckpt.reports == []
    assert SnapshotLayout(topology.root).latest() is None


class _FailingAnchor(TorchAnchorSource):
    """An anchor whose first write fails, as a full disk does."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(2, 2), None, step=lambda: 0)
        self.failed = False

    async def write(self, snapshot: Path) -> Any:
        if not self.failed:
            self.failed = True
            raise AnchorError("injected: no space left on device", snapshot)
        return await super().write(snapshot)


@pytest.mark.parametrize("first_write", ["succeeds", "fails"])
async def test_a_closed_facade_is_freed_without_the_garbage_collector(
    tmp_path: Path, first_write: str
) -> None:
    # What a trainer closes must not wait for the cyclic garbage collector: a multi-rank
    # anchor's process groups that live until interpreter teardown abort the process
    # there (exit -6, tests/e2e/test_multirank_anchor.py). Refcounting alone frees it,
    # also after a failed snapshot, whose report keeps the error (and so its traceback).
    async with start_topology(tmp_path / "p", agents=1, group_size=GROUP_SIZE) as topology:
        options = {"anchor": _FailingAnchor()} if first_write == "fails" else {}
        ckpt = _facade(topology, **options)
        async with ckpt:
            ckpt.dispatch(_parked(ckpt.agents))
            report = await ckpt.snapshot_now()
            if first_write == "fails":
                assert report.outcome is SnapshotOutcome.FAILED and report.error is not None
                assert report.error.__traceback__ is not None  # still says where
                report = await ckpt.snapshot_now()
            assert report.outcome is SnapshotOutcome.PUBLISHED, report.detail
        del report
        freed = weakref.ref(ckpt)
        gc.disable()
        try:
            del ckpt
            assert freed() is None, gc.get_referrers(freed())
        finally:
            gc.enable()
