"""One rank of a small FSDP2 (or DDP) trainer whose anchor is a :class:`DistributedAnchor`.

Run by tests/e2e/test_multirank_anchor.py, one process per rank, on gloo over a file
store::

    python -m tests.support.multirank_trainer --rank R --world N --store FILE \\
        --participants P.json --token-file T --snapshot-root ROOT --out DIR --label L \\
        --steps K [--parallel fsdp|ddp] [--fail-write-rank R] [--out-of-step-rank R] \\
        [--rank0-dies]

Rank 0 opens :class:`Checkpointing` (which restores the newest snapshot, every rank
loading its part), trains ``K`` steps in lockstep with the other ranks, and, if it
trained, takes a snapshot, retried (by the pump) until one publishes, at most three. Then every rank
gathers the full model and optimizer state and rank 0 writes it to ``DIR/state-L.pt``,
and what it saw to ``DIR/rank0-L.json``. ``--out-of-step-rank R`` makes rank R claim
to be a step ahead at the first save; ``--fail-write-rank R`` makes rank R's first DCP
write fail, as a full disk there would; ``--rank0-dies`` makes rank 0 exit abruptly after
its steps. ``ROOT`` may be a storage URL (``s3://...``): every rank then writes its
shards onto the store itself and reads them back from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from turnpoint.trainer import Checkpointing, CoordinatorConfig, DistributedAnchor, SnapshotOutcome
from turnpoint.trainer.storage.objects import open_layout


class Trainer:
    """``fsdp``: the model sharded over the ranks (DTensors); ``ddp``: replicated."""

    def __init__(self, rank: int, world: int, parallel: str) -> None:
        torch.manual_seed(0)
        self.rank = rank
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.model: torch.nn.Module = model
        if parallel == "fsdp":
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # in place
        else:
            self.model = DistributedDataParallel(model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.step = 0

    def train_step(self) -> None:
        """One step; the gradient reduce-scatter keeps the ranks in lockstep."""
        data = torch.Generator().manual_seed(1000 * self.step + self.rank)
        self.optimizer.zero_grad()
        self.model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
        self.optimizer.step()
        self.step += 1

    def full_state(self) -> dict[str, Any]:
        """Every rank must call this (full_tensor gathers)."""

        def full(value: Any) -> Any:
            return value.full_tensor() if isinstance(value, DTensor) else value

        model = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        return {
            "step": self.step,
            "model": {k: full(v) for k, v in model.state_dict().items()},
            "optimizer": {
                index: {k: full(v) for k, v in entry.items()}
                for index, entry in self.optimizer.state_dict()["state"].items()
            },
        }


async def lead(
    args: argparse.Namespace, trainer: Trainer, anchor: DistributedAnchor
) -> dict[str, Any]:
    """Rank 0: the coordinator's rank. Returns what it saw."""
    config = CoordinatorConfig.from_mapping({"snapshot_root": args.snapshot_root})
    layout = open_layout(args.snapshot_root)
    seen: dict[str, Any] = {"reports": []}

    def step_with_the_others() -> None:
        anchor.begin_step()  # the other ranks' follow() returns: they train this step too
        trainer.train_step()

    with anchor:  # on leaving, the other ranks' follow() returns None
        async with Checkpointing(
            config,
            args.participants,
            token=args.token,
            anchor=anchor,
            load_anchor=anchor.load,
            periodic=False,
            # Every snapshot is one the test asks for: a restore run's close must not
            # publish a newer one that the next restore run would pick.
            final_snapshot=False,
        ) as ckpt:
            trainer.step = ckpt.resumed.step
            seen["restored_from"] = ckpt.resumed.checkpoint_id
            restored = anchor.restored
            seen["anchor_data_loader"] = restored.data_loader if restored else None
            for _ in range(args.steps):
                async with ckpt.step_lock:
                    await asyncio.to_thread(step_with_the_others)
            if args.rank0_dies:
                os._exit(3)  # as a SIGKILL would: no close() for the other ranks
            for _ in range(3 if args.steps else 0):
                report = await ckpt.snapshot_now()
                seen["reports"].append(
                    {
                        "checkpoint_id": report.checkpoint_id,
                        "outcome": report.outcome.value,
                        "reason": report.reason.value if report.reason else None,
                        "detail": report.detail,
                        "published": await asyncio.to_thread(layout.list_published),
                    }
                )
                if report.outcome is SnapshotOutcome.PUBLISHED:
                    break
    return seen


def fail_first_write() -> None:
    original = FileSystemWriter.write_data
    failed = False

    def write_data(self: FileSystemWriter, *a: Any, **kw: Any) -> Any:
        nonlocal failed
        if not failed:
            failed = True
            raise OSError(28, "injected: no space left on this rank's disk")
        return original(self, *a, **kw)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign,assignment]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--store", "--participants", "--token-file", "--snapshot-root", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--label", required=True)
    for flag in ("--rank", "--world", "--steps"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--fail-write-rank", type=int, default=-1)
    parser.add_argument("--out-of-step-rank", type=int, default=-1)
    parser.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--rank0-dies", action="store_true")
    args = parser.parse_args(argv)
    args.participants = json.loads(Path(args.participants).read_text(encoding="utf-8"))
    args.token = Path(args.token_file).read_text(encoding="utf-8").strip()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world
    )
    trainer = Trainer(args.rank, args.world, args.parallel)
    # A rank out of step once: it says it is one step ahead at the first save.
    skew = [1] if args.rank == args.out_of_step_rank else []
    anchor = DistributedAnchor(
        trainer.model,
        trainer.optimizer,
        step=lambda: trainer.step + (skew.pop() if skew else 0),
        data_loader=lambda: {"next_batch": trainer.step * 4},
        # A store's URL: every rank writes its shards onto the store itself.
        storage=args.snapshot_root if "://" in args.snapshot_root else None,
    )
    if args.rank == args.fail_write_rank:
        fail_first_write()
    if args.rank == 0:
        seen = asyncio.run(lead(args, trainer, anchor))
        Path(args.out, f"rank0-{args.label}.json").write_text(json.dumps(seen), encoding="utf-8")
    else:
        while (begun := anchor.follow()) is not None:
            trainer.step = begun.step
            trainer.train_step()
        if anchor.restored is not None and args.steps == 0:
            trainer.step = anchor.restored.step
    state = trainer.full_state()
    if args.rank == 0:
        torch.save(state, Path(args.out, f"state-{args.label}.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
