"""The trainer anchor across ranks (turnpoint.trainer.anchors.ranks) through real snapshots.

Real rank processes on gloo (tests/support/multirank_trainer.py, an FSDP2 model sharded
over the ranks) and real participants on 127.0.0.1:0, the snapshot root an S3 bucket on
moto's server on loopback (each rank writes its own shards onto it through DCP's fsspec
writer, docs/spec.md section 8.13). Two ranks train and snapshot; rank
1 is out of step at the first attempt and its write fails at the second: both fail
unpublished, and the retry publishes. The
processes exit; fresh participants and 2, 1 and 3 ranks restore it: DCP reshards the
sharded model and optimizer, and every restored tensor equals the saved one. A replicated
(DDP) model on a local snapshot root restores on another number of ranks too.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.participants import TOKEN, start_topology
from tests.support.storage import make_bucket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


async def run_ranks(
    tmp: Path,
    root: Path | str,
    addresses: dict[str, str],
    *,
    world: int,
    label: str,
    exits: Sequence[int] | None = None,
    **extra: object,
) -> None:
    participants = tmp / f"participants-{label}.json"
    participants.write_text(json.dumps(addresses), encoding="utf-8")
    token = tmp / "token"
    token.write_text(TOKEN, encoding="utf-8")
    argv = [
        "--world", str(world), "--store", str(tmp / f"store-{label}"),
        "--participants", str(participants), "--token-file", str(token),
        "--snapshot-root", str(root), "--out", str(tmp), "--label", label,
    ]  # fmt: skip
    for flag, value in extra.items():
        argv += [f"--{flag.replace('_', '-')}"] + ([] if value is True else [str(value)])
    started = time.monotonic()
    command = [sys.executable, "-m", "tests.support.multirank_trainer", *argv]
    ranks = [
        await asyncio.create_subprocess_exec(*command, "--rank", str(rank), cwd=REPO)
        for rank in range(world)
    ]
    try:
        codes = await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ranks)), 60)
    finally:
        for rank in ranks:
            if rank.returncode is None:
                rank.kill()
                await rank.wait()
    assert codes == list(exits or [0] * world), codes
    print(f"{label}: {world} rank(s), {time.monotonic() - started:.1f} s")


def assert_same_state(restored: dict[str, Any], saved: dict[str, Any]) -> None:
    assert restored["step"] == saved["step"]
    assert restored["model"].keys() == saved["model"].keys()
    for name, tensor in saved["model"].items():
        assert torch.equal(restored["model"][name], tensor), name
    assert restored["optimizer"].keys() == saved["optimizer"].keys()
    for index, entry in saved["optimizer"].items():
        assert entry.keys() == restored["optimizer"][index].keys()
        for key, value in entry.items():
            assert torch.equal(restored["optimizer"][index][key], value), (index, key)


async def test_two_ranks_snapshot_on_the_store_and_restore_on_two_one_and_three_ranks(
    tmp_path: Path, moto_endpoint: str
) -> None:
    # Every rank writes its shards onto the store itself; the restores read them from
    # it with nothing local (a snapshot root on a directory: the replicated test below).
    root = f"s3://{make_bucket(moto_endpoint)}/job"
    async with start_topology(root) as topology:
        addresses = {name: h.address for name, h in topology.participants.items()}
        await run_ranks(
            tmp_path,
            root,
            addresses,
            world=2,
            label="save",
            steps=STEPS,
            out_of_step_rank=1,
            fail_write_rank=1,
        )
    seen = json.loads((tmp_path / "rank0-save.json").read_text(encoding="utf-8"))
    assert seen["restored_from"] is None
    out_of_step, failed_write, published = seen["reports"]
    # A rank not at rank 0's step refuses before anything is written; a rank whose write
    # fails fails the write everywhere. Either way the snapshot fails, unpublished.
    assert out_of_step["outcome"] == "failed" and out_of_step["reason"] == "storage"
    assert f"rank 1 is at step {STEPS + 1}, rank 0 at {STEPS}" in out_of_step["detail"]
    assert failed_write["outcome"] == "failed" and failed_write["reason"] == "storage"
    detail = failed_write["detail"]
    assert "rank 1: OSError" in detail and "rank 0" not in detail, detail
    assert out_of_step["published"] == failed_write["published"] == []
    # The pump's retry (the same id: no participant saw it) publishes.
    assert published["outcome"] == "published", published
    assert published["checkpoint_id"] == failed_write["checkpoint_id"]
    assert published["published"] == [published["checkpoint_id"]]
    saved = torch.load(tmp_path / "state-save.pt")
    assert saved["step"] == STEPS and saved["optimizer"]

    for world in (2, 1, 3):
        label = f"restore{world}"
        # A restore needs fresh participants (docs/spec.md section 7.11).
        async with start_topology(root) as topology:
            addresses = {name: h.address for name, h in topology.participants.items()}
            await run_ranks(tmp_path, root, addresses, world=world, label=label, steps=0)
        seen = json.loads((tmp_path / f"rank0-{label}.json").read_text(encoding="utf-8"))
        assert seen["restored_from"] == published["checkpoint_id"], (world, seen)
        assert seen["anchor_data_loader"] == {"next_batch": STEPS * 4}
        assert_same_state(torch.load(tmp_path / f"state-{label}.pt"), saved)


async def test_a_replicated_model_written_by_two_ranks_restores_on_one(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    async with start_topology(root) as topology:
        addresses = {name: h.address for name, h in topology.participants.items()}
        await run_ranks(
            tmp_path, root, addresses, world=2, label="save", steps=STEPS, parallel="ddp"
        )
    (report,) = json.loads((tmp_path / "rank0-save.json").read_text(encoding="utf-8"))["reports"]
    assert report["outcome"] == "published", report
    async with start_topology(root) as topology:
        addresses = {name: h.address for name, h in topology.participants.items()}
        await run_ranks(
            tmp_path, root, addresses, world=1, label="restore", steps=0, parallel="ddp"
        )
    seen = json.loads((tmp_path / "rank0-restore.json").read_text(encoding="utf-8"))
    assert seen["restored_from"] == report["checkpoint_id"]
    saved = torch.load(tmp_path / "state-save.pt")
    assert_same_state(torch.load(tmp_path / "state-restore.pt"), saved)


async def test_the_other_ranks_stop_when_rank_0_dies(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    async with start_topology(root) as topology:
        addresses = {name: h.address for name, h in topology.participants.items()}
        # Rank 1 waits in follow() for rank 0's next step; rank 0's connections close.
        await run_ranks(
            tmp_path, root, addresses, world=2, label="die", steps=1, rank0_dies=True, exits=[3, 1]
        )
