"""A complete RL trainer that embeds turnpoint through :class:`Checkpointing` alone.

It trains TinyPolicy with a group-baseline policy-gradient step on the verifiers'
rewards, pushes each step's weights to the policy server, snapshots every few steps
and seconds, restores on start, and on SIGTERM snapshots once and exits 0. docs/embedding.md says how to run it and which lines are ours.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from turnpoint.apps.demo._learner import policy_gradient_step
from turnpoint.apps.examples._guess_jobs import guess_rollouts, guess_sample
from turnpoint.apps.examples._participants import new_policy
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    TorchAnchorSource,
    torch_anchor_loader,
)


async def train(args: argparse.Namespace, participants: dict[str, str], token: str) -> None:
    torch.manual_seed(args.seed)
    model = new_policy(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"step": 0, "next_group": 0}

    def record(kind: str, **fields: object) -> None:  # one flushed line: a kill loses none
        with open(args.log, "a", encoding="utf-8") as log:
            log.write(json.dumps({"type": kind, "t": time.time(), **fields}) + "\n")

    async with Checkpointing(
        CoordinatorConfig(snapshot_root=args.snapshot_root, snapshot_interval_s=args.interval),
        participants,
        token=token,
        anchor=TorchAnchorSource(model, optimizer, step=lambda: state["step"]),
        load_anchor=torch_anchor_loader(model, optimizer),
        every_steps=args.every_steps,
        weights=model.state_bytes,  # what the policy servers install (run in a thread)
    ) as ckpt:  # restored, and the policy servers hold the (restored) weights
        ckpt.install_preemption_handler(deadline_s=20.0)
        gc.collect()  # the job is set up: keep the collector off this heap for good,
        gc.freeze()  # so that no full collection falls in a snapshot (docs/embedding.md)
        state["step"] = ckpt.resumed.step  # 0, or the restored snapshot's
        if isinstance(position := ckpt.resumed.data_loader, int):  # None on a fresh start
            state["next_group"] = position
        record("start", step=state["step"], restored_from=ckpt.resumed.checkpoint_id)
        total = args.steps * args.groups_per_step
        while state["step"] < args.steps:
            window = (state["step"] + 2) * args.groups_per_step
            while state["next_group"] < min(total, window):
                group, state["next_group"] = state["next_group"], state["next_group"] + 1
                for rollout in guess_rollouts(group, args.group_size, args.seed, ckpt.agents):
                    ckpt.dispatch(rollout, data_loader=state["next_group"])
            if not await ckpt.wait_groups(args.groups_per_step, timeout_s=1.0):
                continue  # none ready within a second: top up the pipeline and wait again
            async with ckpt.step_lock:  # take and train in one step no snapshot cuts
                groups = ckpt.take_ready_groups(args.groups_per_step)
                samples = [guess_sample(r) for g in groups for r in g]
                stats = await asyncio.to_thread(policy_gradient_step, model, optimizer, samples)
                state["step"] += 1
                ids = [g[0].prompt_group_id for g in groups]
                record("train", step=state["step"], groups=ids, reward=stats.mean_reward)
            pushed = await ckpt.push_weights(state["step"])  # retried, installed once
            record("weights", version=pushed.version, retried=pushed.retried)
            await ckpt.step_done(state["step"])
        record("done", step=state["step"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnpoint.apps.examples.embedded_trainer")
    for flag in ("--participants", "--token-file", "--snapshot-root", "--log"):
        parser.add_argument(flag, required=True)
    counts = {"--steps": 12, "--group-size": 2, "--groups-per-step": 2, "--every-steps": 3}
    for flag, default in counts.items():
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=float, default=2.0)
    args = parser.parse_args(argv)
    participants = json.loads(Path(args.participants).read_text(encoding="utf-8"))
    token = Path(args.token_file).read_text(encoding="utf-8").strip()
    torch.set_num_threads(1)
    asyncio.run(train(args, participants, token))  # a SIGTERM ends here with status 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
