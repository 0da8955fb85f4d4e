"""The embedded example trainer (apps/examples/embedded_trainer.py) against real participants.

The participants are real gRPC servers hosted in the test process on 127.0.0.1:0; the
trainer is a real process. One test SIGKILLs it mid-run and runs it again: it must resume
from a snapshot and train every prompt group exactly once. Another sends SIGTERM: the
trainer snapshots once more and exits 0, and the next run restores that snapshot. The
chaos test loses every reply of the policy server to the trainer for two seconds
mid-run, from a weight push's reply on (through the loopback fault proxy): the weight pushes are retried, the run ends
without a restart, every group trained once and every weights version installed once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.participants import TOKEN, start_topology
from turnpoint.apps.chaos._proxy import FaultProxy, ProxyMode
from turnpoint.apps.examples._participants import TinyPolicyServer
from turnpoint.trainer.advanced import SnapshotLayout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 60
GROUPS_PER_STEP = 2
GROUP_SIZE = 2


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return entries


async def poll(predicate: Any, timeout_s: float, what: str) -> None:
    """Bounded polling of a file the trainer process writes."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Job:
    def __init__(self, tmp: Path, root: Path, addresses: dict[str, str]) -> None:
        self.root = root  # the participants write their parts of each snapshot here
        self.log = tmp / "trained.jsonl"
        participants = self.participants = tmp / "participants.json"
        self.write_participants(addresses)
        token = tmp / "token"
        token.write_text(TOKEN, encoding="utf-8")
        self.argv = [
            sys.executable, "-m", "turnpoint.apps.examples.embedded_trainer",
            "--participants", str(participants), "--token-file", str(token),
            "--snapshot-root", str(self.root), "--log", str(self.log),
            "--steps", str(STEPS), "--groups-per-step", str(GROUPS_PER_STEP),
            "--group-size", str(GROUP_SIZE), "--every-steps", "4", "--interval", "1.5",
        ]  # fmt: skip

    def write_participants(self, addresses: dict[str, str]) -> None:
        self.participants.write_text(json.dumps(addresses), encoding="utf-8")

    async def start(self) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(*self.argv, env=os.environ.copy())

    def published(self) -> list[str]:
        return SnapshotLayout(self.root).list_published() if self.root.exists() else []

    def entries(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_log(self.log) if e["type"] == kind]


def assert_every_group_trained_once(entries: list[dict[str, Any]]) -> None:
    groups = trained_lineage(entries)
    counts = Counter(groups)
    assert all(n == 1 for n in counts.values()), counts
    assert set(groups) == {f"g{g:05d}" for g in range(STEPS * GROUPS_PER_STEP)}


def trained_lineage(entries: list[dict[str, Any]]) -> list[str]:
    """The groups the final model was trained on: each restart discards the steps after
    the step it resumed from (they were trained into a model that was thrown away)."""
    lineage: dict[int, list[str]] = {}
    for entry in entries:
        if entry["type"] == "start":
            lineage = {s: g for s, g in lineage.items() if s <= entry["step"]}
        elif entry["type"] == "train":
            assert entry["step"] not in lineage, f"step {entry['step']} trained twice"
            lineage[entry["step"]] = entry["groups"]
    assert sorted(lineage) == list(range(1, STEPS + 1)), sorted(lineage)
    return [group for step in sorted(lineage) for group in lineage[step]]


async def test_sigkill_mid_run_resumes_and_trains_every_group_once(tmp_path: Path) -> None:
    async with start_topology(tmp_path / "p", agents=2, group_size=GROUP_SIZE) as topology:
        job = Job(tmp_path, topology.root, {n: h.address for n, h in topology.participants.items()})
        first = await job.start()
        await poll(
            lambda: len(job.published()) >= 2 and len(job.entries("train")) >= 5,
            120,
            "two published snapshots and five steps",
        )
        first.kill()
        killed_at = time.time()
        assert await first.wait() == -signal.SIGKILL
        trained_before = len(job.entries("train"))
    # A job restart restores onto fresh participants (docs/spec.md section 7.11).
    async with start_topology(tmp_path / "p", agents=2, group_size=GROUP_SIZE) as topology:
        job.write_participants({n: h.address for n, h in topology.participants.items()})
        second = await job.start()
        assert await asyncio.wait_for(second.wait(), 180) == 0
        starts = job.entries("start")
        assert len(starts) == 2 and starts[1]["restored_from"] is not None
        assert starts[1]["step"] > 0
        resumed_training = [e for e in job.entries("train")[trained_before:]]
        print(f"SIGKILL -> first resumed step: {resumed_training[0]['t'] - killed_at:.2f} s")
        assert_every_group_trained_once(read_log(job.log))
        assert job.entries("done")


async def test_sigterm_takes_a_final_snapshot_exits_0_and_the_next_run_restores_it(
    tmp_path: Path,
) -> None:
    async with start_topology(tmp_path / "p", agents=2, group_size=GROUP_SIZE) as topology:
        job = Job(tmp_path, topology.root, {n: h.address for n, h in topology.participants.items()})
        first = await job.start()
        await poll(lambda: len(job.entries("train")) >= 8, 120, "eight steps")
        before = set(job.published())
        first.send_signal(signal.SIGTERM)
        terminated_at = time.monotonic()
        assert await asyncio.wait_for(first.wait(), 60) == 0
        print(f"SIGTERM -> exit: {time.monotonic() - terminated_at:.2f} s")
        after = job.published()
        final = after[0]  # newest first
        assert final not in before, (before, after)
    async with start_topology(tmp_path / "p", agents=2, group_size=GROUP_SIZE) as topology:
        job.write_participants({n: h.address for n, h in topology.participants.items()})
        second = await job.start()
        assert await asyncio.wait_for(second.wait(), 180) == 0
        starts = job.entries("start")
        assert starts[1]["restored_from"] == final
        groups = trained_lineage(read_log(job.log))
        assert sorted(Counter(groups).values()) == [1] * STEPS * GROUPS_PER_STEP


LOST_REPLIES_S = 2.0
FAULT_AT_VERSION = 9
"""The weights version whose push starts the fault: training is under way by then."""


async def test_chaos_policy_replies_lost_for_two_seconds_cost_retries_not_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer reaches the policy server only through the fault proxy (its control
    calls and its weight pushes; the agents reach it directly), and the proxy loses
    every reply for two seconds, from the reply to the ninth step's weight push on."""
    installed: list[int] = []
    install = TinyPolicyServer.update_weights
    fault: list[FaultProxy] = []

    async def recording_install(self: TinyPolicyServer, weights_version: int, state: bytes) -> int:
        # The SDK calls the model only to install (a replayed request id is answered
        # from its record): each call is one install.
        answered = await install(self, weights_version, state)
        installed.append(weights_version)
        if weights_version == FAULT_AT_VERSION:
            # The fault begins with this push's reply, written once this returns: a
            # push always meets it. (Begun from outside, at a step seen in the log, it
            # could fall while a snapshot parked every rollout: no step, so no push,
            # came in it once in CI.)
            proxy = fault[0]
            proxy.drop_replies_now()
            asyncio.get_running_loop().call_later(LOST_REPLIES_S, proxy.set_mode, ProxyMode.PASS)
        return answered

    monkeypatch.setattr(TinyPolicyServer, "update_weights", recording_install)
    async with (
        start_topology(tmp_path / "p", agents=2, group_size=GROUP_SIZE) as topology,
        FaultProxy(topology.policy.address) as proxy,
    ):
        fault.append(proxy)
        addresses = {n: h.address for n, h in topology.participants.items()}
        addresses[topology.policy.runtime.instance_name] = proxy.address
        job = Job(tmp_path, topology.root, addresses)
        trainer = await job.start()
        assert await asyncio.wait_for(trainer.wait(), 180) == 0
    assert proxy.stats.cut > 0, "no reply was lost"
    assert len(job.entries("start")) == 1, "the trainer restarted"
    assert_every_group_trained_once(read_log(job.log))
    pushes = job.entries("weights")
    assert [p["version"] for p in pushes] == list(range(1, STEPS + 1))
    assert pushes[FAULT_AT_VERSION - 1]["retried"] > 0, "the push that began the fault"
    # Version 0 is the open's push of the initial weights; each step's version after it.
    assert installed == list(range(STEPS + 1)), Counter(installed)
