"""The status REST API against a live trainer with real participants on 127.0.0.1:0
(docs/spec.md section 7.13): the history grows, a failed snapshot names its reason and
the participant that caused it, a restore says where it came from, the snapshots on
storage verify, and bad input gets a 4xx JSON answer, never a traceback or a file."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from prometheus_client import CollectorRegistry

from tests.support.participants import TOKEN, start_topology
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    CoordinatorMetrics,
    FailureReason,
    SnapshotOutcome,
    TorchAnchorSource,
    torch_anchor_loader,
)
from turnpoint.trainer.control import coordinator as coordinator_module

GROUP_SIZE = 2
BOUND_S = 60.0


def facade(
    root: Path,
    participants: Mapping[str, str],
    model: torch.nn.Module,
    reward: list[float] | None = None,
    *,
    watch_liveness: bool = False,
    **options: Any,
) -> Checkpointing:
    return Checkpointing(
        CoordinatorConfig(
            snapshot_root=root, control_timeout_s=10.0, resume_retry_pause_s=0, **options
        ),
        participants,
        token=TOKEN,
        anchor=TorchAnchorSource(model, None, step=lambda: 0),
        load_anchor=torch_anchor_loader(model, None),
        periodic=False,
        metrics=CoordinatorMetrics(CollectorRegistry()),
        status_port=0,
        watch_liveness=watch_liveness,
        # Each snapshot here is one the test takes; a final one at exit could make
        # retention drop the snapshot a restore by metric must find.
        final_snapshot=False,
        snapshot_metrics=lambda: {"mean_reward": reward[0]} if reward else {},
    )


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as response:
        assert response.content_type == "application/json", await response.text()
        return response.status, await response.json()


async def test_history_failure_and_restore_are_served_beside_the_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every participant writes in its commit (no saved-nothing in prepare), so the
    # tools server's full disk fails the first snapshot.
    monkeypatch.setattr(coordinator_module, "ACCEPT_SAVED_NOTHING", False)
    root = tmp_path / "p"
    model = torch.nn.Linear(2, 2)
    faults = {"tools": "records_write:2:ENOSPC"}
    async with (
        start_topology(root, agents=1, group_size=GROUP_SIZE, faults=faults) as topology,
        aiohttp.ClientSession() as session,
    ):
        participants = {n: h.address for n, h in topology.participants.items()}
        reward = [0.5]
        # Retention keeps every snapshot of this test: the close's final snapshot must
        # not prune the best one before the next trainer chooses by reward.
        async with facade(root, participants, model, reward, keep_snapshots=10) as ckpt:
            base = ckpt.status_address
            assert base is not None and base.startswith("http://127.0.0.1:")
            for rollout in guess_rollouts(0, GROUP_SIZE, 0, ckpt.agents):
                ckpt.dispatch(rollout, data_loader=1)
            failed = await ckpt.snapshot_now()
            published = await ckpt.snapshot_now()
            assert failed.reason is FailureReason.STORAGE, failed
            assert published.outcome is SnapshotOutcome.PUBLISHED, published

            status, body = await get(session, base + "api/checkpoints")
            assert status == 200 and body["api_version"] == 1
            rows = {row["checkpoint_id"]: row for row in body["checkpoints"]}
            assert list(rows) == [published.checkpoint_id, failed.checkpoint_id]
            assert rows[failed.checkpoint_id]["status"] == "failed"
            assert rows[failed.checkpoint_id]["reason"] == "storage"
            assert rows[failed.checkpoint_id]["caused_by"] == ["tools"]
            shown = rows[published.checkpoint_id]
            assert shown["status"] == "published" and shown["bytes_written"] > 0
            assert set(shown["phases_s"]) >= {"prepare", "commit", "publish"}
            assert body["overview"]["counts"]["published"] == 1
            assert body["summary"]["published"] == 1

            status, body = await get(session, base + f"api/checkpoints/{failed.checkpoint_id}")
            tools = body["checkpoint"]["participants"]["tools"]
            assert tools["caused_failure"] is True and "commit" in tools["failure"]
            status, body = await get(session, base + f"api/checkpoints/{published.checkpoint_id}")
            parts = body["checkpoint"]["participants"]
            assert set(parts) == set(participants)
            assert all(p["prepare_s"] is not None for p in parts.values())
            assert all(p["committed"] for p in parts.values())

            status, body = await get(session, base + "api/job")
            job = body["job"]
            assert set(job["participants"]) == set(participants)
            assert job["admission"]["open"] is True and job["open_snapshot"] is None
            assert [e["kind"] for e in job["events"]] == ["fresh_start"]

            status, body = await get(session, base + "api/snapshots?verify=1")
            assert status == 200
            assert [s["checkpoint_id"] for s in body["snapshots"]] == [published.checkpoint_id]
            assert body["snapshots"][0]["verified"]["ok"] is True
            assert body["snapshots"][0]["metrics"] == {"mean_reward": 0.5}
            assert body["restore"]["order"] == [published.checkpoint_id]

            async with session.get(base + "metrics") as response:
                assert response.status == 200
                assert "turnpoint_snapshots_total" in await response.text()
            async with session.get(base) as response:
                assert response.status == 200 and "<title>" in await response.text()

            # A newer snapshot with a worse reward: the latest, but not the best.
            reward[0] = 0.1
            for rollout in guess_rollouts(1, GROUP_SIZE, 0, ckpt.agents):
                ckpt.dispatch(rollout, data_loader=2)
            newer = await ckpt.snapshot_now()
            assert newer.outcome is SnapshotOutcome.PUBLISHED, newer
        # Closing takes a final snapshot (same reward as the newer one, and newer still).
        final = ckpt.reports[-1]
        assert final.outcome is SnapshotOutcome.PUBLISHED, final
        assert final.checkpoint_id != newer.checkpoint_id

    # Fresh participants on the same root: the next trainer restores the best snapshot
    # by the reward it recorded (not the latest), and says where it came from.
    async with (
        start_topology(root, agents=1, group_size=GROUP_SIZE) as topology,
        aiohttp.ClientSession() as session,
    ):
        participants = {n: h.address for n, h in topology.participants.items()}
        async with facade(root, participants, model, restore_from="best:mean_reward") as ckpt:
            assert ckpt.resumed.checkpoint_id == published.checkpoint_id
            status, body = await get(session, f"{ckpt.status_address}api/job")
            job = body["job"]
            assert job["overview"]["latest"]["restored"] == published.checkpoint_id
            assert job["overview"]["counts"]["restored"] == 1
            # The first trainer's start and clean close, then this one's restore
            # (docs/spec.md 7.13.5).
            assert [(e["kind"], e["epoch"]) for e in job["events"]] == [
                ("fresh_start", 1),
                ("trainer_closed", 1),  # the first trainer closed cleanly: no crash shown
                ("restore", 2),
            ]
            assert job["epoch"] == 2
            status, body = await get(session, f"{ckpt.status_address}api/checkpoints")
            shown = [(r["checkpoint_id"], r["status"], r["epoch"]) for r in body["checkpoints"]]
            assert shown == [
                (final.checkpoint_id, "published", 1),
                (newer.checkpoint_id, "published", 1),
                (published.checkpoint_id, "published", 1),
                (failed.checkpoint_id, "failed", 1),
            ]
            status, body = await get(
                session, f"{ckpt.status_address}api/checkpoints/{failed.checkpoint_id}"
            )
            assert body["checkpoint"]["participants"]["tools"]["caused_failure"] is True
            status, body = await get(session, f"{ckpt.status_address}api/snapshots")
            assert body["restore"] == {
                "restore_from": "best:mean_reward",
                "order": [published.checkpoint_id, final.checkpoint_id, newer.checkpoint_id],
            }


async def test_the_job_shows_each_participant_s_phase_lease_and_admission(
    tmp_path: Path,
) -> None:
    root = tmp_path / "p"
    model = torch.nn.Linear(2, 2)
    async with (
        start_topology(root, agents=1, group_size=GROUP_SIZE) as topology,
        aiohttp.ClientSession() as session,
    ):
        participants = {n: h.address for n, h in topology.participants.items()}
        async with facade(
            root,
            participants,
            model,
            watch_liveness=True,
            liveness_interval_s=0.2,
            participant_lost_after_s=30.0,
        ) as ckpt:
            url = f"{ckpt.status_address}api/job"
            # Poll (bounded) until the liveness watch's first round has answered.
            async with asyncio.timeout(BOUND_S):
                while True:
                    code, body = await get(session, url)
                    assert code == 200, body
                    shown = body["job"]["participants"]
                    if all(p["status"] is not None for p in shown.values()):
                        break
                    await asyncio.sleep(0.05)
    assert set(shown) == set(participants)
    for participant in shown.values():
        assert participant["status"]["phase"] == "idle"
        assert participant["status"]["admission_open"] is True
        assert participant["status"]["lease_expires_at"] is None


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("api/checkpoints/no-such-checkpoint", 404),
        ("api/checkpoints?limit=99999999999999999999", 400),
        ("api/checkpoints?limit=-1", 400),
        ("api/checkpoints?status=exploded", 400),
        ("api/checkpoints?colour=red", 400),
        ("api/checkpoints?limit=1&limit=2", 400),
        ("api/snapshots/..%2F..%2Fetc%2Fpasswd", 400),
        # The server folds dot segments before routing: this is "api/", not a snapshot.
        ("api/snapshots/%2e%2e", 404),
        ("api/snapshots/no-such-snapshot", 404),
        ("api/snapshots?verify=maybe", 400),
        ("api/snapshots/" + "x" * 5000, 400),
        ("api/nothing-here", 404),
        ("static/..%2F..%2Fserver.py", 404),
        ("static/app.py", 404),
    ],
)
async def test_bad_input_gets_a_4xx_json_message_and_no_file(
    tmp_path: Path, path: str, status: int
) -> None:
    root = tmp_path / "p"
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the snapshot root\n")
    model = torch.nn.Linear(2, 2)
    async with (
        start_topology(root, agents=1, group_size=GROUP_SIZE) as topology,
        aiohttp.ClientSession() as session,
    ):
        participants = {n: h.address for n, h in topology.participants.items()}
        async with facade(root, participants, model) as ckpt:
            url = f"{ckpt.status_address}{path}"
            async with session.get(url) as response:
                text = await response.text()
                assert response.status == status, text
                assert response.content_type == "application/json", text
                body = await response.json()
    assert body["error"]["status"] == status and body["error"]["message"]
    assert "Traceback" not in text and "outside the snapshot root" not in text
