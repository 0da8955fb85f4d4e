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


Told = tuple[str, SnapshotState, SnapshotState]


def attempts_told(transitions: list[Told]) -> list[list[Told]]:
    """The transitions split into attempts, each from its move out of ``NEW``.

    Not grouped by id: an id no participant saw is reused by the next attempt (a
    skipped one among them, docs/spec.md section 7.2 item 1), so one id may name
    several attempts in a row.
    """
    assert transitions and transitions[0][1] is SnapshotState.NEW, transitions
    attempts: list[list[Told]] = []
    for told in transitions:
        if told[1] is SnapshotState.NEW:
            attempts.append([])
        attempts[-1].append(told)
    return attempts


@pytest.mark.parametrize("results_first", [False, True], ids=["dispatched", "results_first"])
async def test_every_snapshot_is_reported_its_transitions_told_and_counted(
    tmp_path: Path, results_first: bool
) -> None:
    reports: list[SnapshotReport] = []
    transitions: list[Told] = []
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
            if results_first:
                # Held open, the window timing otherwise decides: every result is in
                # before the first cut, so the second snapshot finds nothing changed.
                assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
            first = await ckpt.snapshot_now()
            assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
            second = await ckpt.snapshot_now()
    # The two asked for, then the final one of a clean exit (nothing changed since the
    # second: skipped), each reported the same way.
    assert reports == ckpt.reports and reports[:2] == [first, second] and len(reports) == 3
    assert reports[2].outcome is SnapshotOutcome.SKIPPED, reports[2]
    assert first.outcome is SnapshotOutcome.PUBLISHED, first
    if results_first:
        # No participant saw the skipped second's id: the final attempt reuses it.
        assert second.outcome is SnapshotOutcome.SKIPPED, second
        assert reports[2].checkpoint_id == second.checkpoint_id
    attempts = attempts_told(transitions)
    assert [told[0][0] for told in attempts] == [r.checkpoint_id for r in reports]
    for report, told in zip(reports, attempts, strict=True):
        assert {attempt for attempt, _, _ in told} == {report.checkpoint_id}, told
        assert told[-1][2] is SnapshotState(report.outcome.value), told
        # One chain: each transition starts where the previous one ended.
        assert all(a[2] is b[1] for a, b in itertools.pairwise(told)), told
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
