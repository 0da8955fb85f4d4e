"""The coordinator's whole path on an object store (docs/spec.md sections 8.12, 8.13):
:class:`Checkpointing` with ``snapshot_root="s3://..."`` (moto on loopback) takes real
snapshot rounds with real participants whose stores get the same URL, and a second
trainer with fresh participants, started in an empty directory, restores from the URL
alone: the DCP anchor (written onto the store by DCP's fsspec writer), the saved
rollouts and the group-scored group that was half done.
A slow store slows a snapshot, a stalled one fails it, and neither ever holds the loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from tests.support.participants import TOKEN, Topology, start_topology
from tests.support.storage import SlowStore, make_bucket
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.storage import open_storage
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    FailureReason,
    SnapshotOutcome,
    TorchAnchorSource,
    torch_anchor_loader,
)
from turnpoint.trainer.storage.objects import StoreLayout

GROUP_SIZE = 2
BOUND_S = 60.0


def _facade(
    topology: Topology,
    url: str,
    model: torch.nn.Module,
    control_timeout_s: float = 10.0,
    anchor_storage: str | None = None,
    **options: Any,
) -> Checkpointing:
    return Checkpointing(
        CoordinatorConfig(snapshot_root=url, control_timeout_s=control_timeout_s),
        {n: h.address for n, h in topology.participants.items()},
        token=TOKEN,
        anchor=TorchAnchorSource(model, None, step=lambda: 0, storage=anchor_storage),
        load_anchor=torch_anchor_loader(model, None),
        periodic=False,
        **options,
    )


async def test_snapshot_rounds_on_s3_and_a_restore_from_the_url_alone(
    moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{make_bucket(moto_endpoint)}/job"
    first_run = tmp_path / "first"
    first_run.mkdir()
    monkeypatch.chdir(first_run)
    torch.manual_seed(7)
    trained = torch.nn.Linear(2, 2)
    async with (
        start_topology(url, agents=1, group_size=GROUP_SIZE) as topology,
        # The anchor goes onto the store through DCP's fsspec writer (spec 8.13.1).
        _facade(topology, url, trained, anchor_storage=url) as ckpt,
    ):
        for rollout in guess_rollouts(0, GROUP_SIZE, 0, ckpt.agents):
            ckpt.dispatch(rollout, data_loader=1)
        # Group 1 is group-scored: its first sibling waits at its verify for the
        # second, which is dispatched only after the restore.
        waiting, held_back = guess_rollouts(1, GROUP_SIZE, 0, ckpt.agents)
        ckpt.dispatch(waiting, data_loader=2)
        first = await ckpt.snapshot_now()
        assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
        (trained_on,) = ckpt.take_ready_groups(1)
        assert {r.prompt_group_id for r in trained_on} == {"g00000"}
        await ckpt.rollouts.wait_for(
            lambda: any(r.boundaries_seen >= 1 for r in ckpt.rollouts.in_flight()), BOUND_S
        )
        second = await ckpt.snapshot_now()
    assert first.outcome is SnapshotOutcome.PUBLISHED, first
    assert second.outcome is SnapshotOutcome.PUBLISHED, second
    # The final snapshot at exit: published, or skipped when nothing changed since (the
    # waiting sibling may still cross boundaries after the second cut: timing decides).
    newest = [
        r.checkpoint_id for r in reversed(ckpt.reports) if r.outcome is SnapshotOutcome.PUBLISHED
    ]
    final = next(r for r in reversed(ckpt.reports) if r.outcome is SnapshotOutcome.PUBLISHED)
    # Nothing of the run is on local disk: the participants and the trainer wrote only
    # to the store (the trainer's anchor staging directory is gone with it).
    assert list(first_run.iterdir()) == []

    # Every published snapshot is whole, read back by a process that has only the URL.
    store = StoreLayout(open_storage(url), staging=tmp_path / "inspect")
    published = store.list_published()
    assert published[0] == final.checkpoint_id == store.latest()
    # Retention keeps the newest two (keep_snapshots): the first is gone if the final
    # one was published.
    assert published == newest[:2] and second.checkpoint_id in published
    for checkpoint_id in published:
        manifest = store.load(checkpoint_id)
        store.verify_artifacts(manifest)
        assert {e.instance for e in manifest.participants} == set(topology.participants)
    store.close()

    # Another machine's worth of process: fresh participants, an empty directory.
    second_run = tmp_path / "second"
    second_run.mkdir()
    monkeypatch.chdir(second_run)
    restored_model = torch.nn.Linear(2, 2)
    assert not torch.equal(restored_model.weight, trained.weight)
    async with (
        start_topology(url, agents=1, group_size=GROUP_SIZE) as topology,
        _facade(topology, url, restored_model, anchor_storage=url, status_port=0) as ckpt,
        aiohttp.ClientSession() as session,
    ):
        assert ckpt.resumed.checkpoint_id == final.checkpoint_id
        assert ckpt.resumed.resumed_rollout_ids == {waiting.rollout_id}
        assert torch.equal(restored_model.weight, trained.weight)
        # The status API lists and verifies the snapshots on the store (spec 7.13).
        async with session.get(f"{ckpt.status_address}api/snapshots?verify=1") as response:
            assert response.status == 200, await response.text()
            listing = await response.json()
        assert [s["checkpoint_id"] for s in listing["snapshots"]] == published
        assert all(s["verified"]["ok"] for s in listing["snapshots"]), listing
        assert listing["snapshot_root"] == url
        # The half-done group finishes: its saved sibling continued, the other joins.
        ckpt.dispatch(held_back, data_loader=3)
        assert await ckpt.wait_groups(1, timeout_s=BOUND_S)
        (group,) = ckpt.take_ready_groups(1)
        assert {r.rollout_id for r in group} == {waiting.rollout_id, held_back.rollout_id}
    assert ckpt.reports[-1].outcome is SnapshotOutcome.PUBLISHED
    assert list(second_run.iterdir()) == []


async def test_a_slow_store_slows_a_snapshot_and_a_stalled_one_fails_it_never_the_loop(
    slow_store: SlowStore, moto_endpoint: str
) -> None:
    """docs/spec.md section 8.12 item 6: every store call runs in a thread; a slow store
    makes a slower snapshot, one that stalls past the commit deadline fails it (typed,
    transient) and the next one publishes."""
    url = f"s3://{make_bucket(moto_endpoint)}/job"
    loop_thread = threading.get_ident()
    slow_store.delay_s = 0.02
    async with (
        start_topology(url, agents=1, group_size=GROUP_SIZE) as topology,
        _facade(topology, url, torch.nn.Linear(2, 2), control_timeout_s=2.0) as ckpt,
    ):
        # A sibling of a group-scored group waits at its verify for the whole test:
        # every snapshot cuts it, so every participant commit writes to the store.
        waiting, _ = guess_rollouts(1, GROUP_SIZE, 0, ckpt.agents)
        ckpt.dispatch(waiting, data_loader=1)
        await ckpt.rollouts.wait_for(
            lambda: any(r.boundaries_seen >= 1 for r in ckpt.rollouts.in_flight()), BOUND_S
        )
        slow = await ckpt.snapshot_now()
        assert slow.outcome is SnapshotOutcome.PUBLISHED, slow

        ckpt.dispatch(guess_rollouts(2, GROUP_SIZE, 0, ckpt.agents)[0], data_loader=2)
        slow_store.hold()
        stalled = asyncio.create_task(ckpt.snapshot_now())
        # A participant's commit write is stuck in the store, and the loop goes on: this
        # wait's answer comes back through it.
        assert await asyncio.to_thread(slow_store.held.wait, BOUND_S)
        failed = await stalled
        slow_store.release()
        assert failed.outcome is SnapshotOutcome.FAILED, failed
        assert failed.reason is FailureReason.TIMEOUT, failed

        ckpt.dispatch(guess_rollouts(4, GROUP_SIZE, 0, ckpt.agents)[0], data_loader=3)
        again = await ckpt.snapshot_now()
        assert again.outcome is SnapshotOutcome.PUBLISHED, again
    assert slow_store.senders and loop_thread not in slow_store.senders
    store = StoreLayout(open_storage(url))
    published = store.list_published()
    assert again.checkpoint_id in published and failed.checkpoint_id not in published
    for checkpoint_id in published:
        store.verify_artifacts(store.load(checkpoint_id))
    store.close()
