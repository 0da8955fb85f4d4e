"""What a trainer watches through :class:`Checkpointing`'s options, against real
participants on 127.0.0.1:0: each snapshot's report, each attempt's transitions, the
metrics, and the liveness watch that ends a run whose participant is gone (the options
the demo trainer is built on, docs/embedding.md)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from tests.support.participants import TOKEN, start_topology
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    CoordinatorMetrics,
    ParticipantLostError,
    SnapshotOutcome,
    SnapshotReport,
    SnapshotState,
    TorchAnchorSource,
    torch_anchor_loader,
)

GROUP_SIZE = 2
BOUND_S = 60.0


async def test_every_snapshot_is_reported_its_transitions_told_and_counted(
    tmp_path: Path,
) -> None:
    reports: list[SnapshotReport] = []
    transitions: list[tuple[str, SnapshotState, SnapshotState]] = []
    metrics = CoordinatorMetrics(CollectorRegistry())
    model = torch.nn.Linear(2, 2)
    async with start_topology(tmp_path / "p", agents=1, group_size=GROUP_SIZE) as topology:
        participants = {n: h.address for n, h in topology.participants.items()}
        async with Checkpointing(
            CoordinatorConfig(snapshot_root=topology.root, control_timeout_s=10.0),
            participants,
            token=TOKEN,
            anchor=TorchAnchorSource(model, None, step=lambda: 0),
            load_anchor=torch_anchor_loader(model, None),
            periodic=False,
            metrics=metrics,
            on_snapshot=reports.append,
            on_transition=lambda attempt, old, new, _now: transitions.append((attempt, old, new)),
        ) as ckpt:
            for rollout in guess_rollouts(0, GROUP_SIZE, 0, ckpt.agents):
                ckpt.dispatch(rollout, data_loader=1)
            first = await ckpt.snapshot_now()
            assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
            second = await ckpt.snapshot_now()
    # The two asked for, then the final one of a clean exit (nothing changed since the
    # second: skipped), each reported the same way.
    assert reports == ckpt.reports and reports[:2] == [first, second] and len(reports) == 3
    assert reports[2].outcome is SnapshotOutcome.SKIPPED, reports[2]
    assert first.outcome is SnapshotOutcome.PUBLISHED, first
    for report in reports:
        told = [(old, new) for attempt, old, new in transitions if attempt == report.checkpoint_id]
        assert told[0][0] is SnapshotState.NEW
        assert told[-1][1] is SnapshotState(report.outcome.value)
        # One chain: each transition starts where the previous one ended.
        assert all(a[1] is b[0] for a, b in itertools.pairwise(told))
    counted = sum(
        sample.value
        for family in metrics.registry.collect()
        if family.name == "turnpoint_snapshots"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["outcome"] == "published"
    )
    assert counted == sum(r.outcome is SnapshotOutcome.PUBLISHED for r in reports)


async def test_a_participant_gone_silent_ends_the_run_with_participant_lost(
    tmp_path: Path,
) -> None:
    lost: list[ParticipantLostError] = []
    model = torch.nn.Linear(2, 2)
    async with start_topology(tmp_path / "p", agents=1, group_size=GROUP_SIZE) as topology:
        participants = {n: h.address for n, h in topology.participants.items()}
        checkpointing = Checkpointing(
            CoordinatorConfig(
                snapshot_root=topology.root,
                control_timeout_s=10.0,
                liveness_interval_s=0.2,
                participant_lost_after_s=1.0,
            ),
            participants,
            token=TOKEN,
            anchor=TorchAnchorSource(model, None, step=lambda: 0),
            load_anchor=torch_anchor_loader(model, None),
            periodic=False,
            watch_liveness=True,
            on_participant_lost=lost.append,
        )
        with pytest.raises(ParticipantLostError) as ended:
            async with checkpointing as ckpt:
                await topology.tools.stop(0)
                # Nothing is dispatched: only the watch can end this wait.
                async with asyncio.timeout(BOUND_S):
                    while True:
                        await ckpt.wait_groups(1, timeout_s=1.0)
    assert lost == [ended.value]
    assert "tools" in ended.value.lost
