"""Several workers behind one endpoint, over real gRPC on 127.0.0.1 (docs/spec.md 3.9).

A real group of worker processes (each ``turnpoint serve`` run as a worker of
:class:`WorkerGroup`): ``Describe`` on the shared port lists every worker, answered by
whichever worker the kernel picked; each worker answers at its own address as its own
participant; the real coordinator, given only the group's name and shared address,
discovers the workers; a worker killed with SIGKILL is back on the same port as a fresh
incarnation. Then ``turnpoint serve --workers 2`` itself: SIGTERM drains and ends every
worker, and a parent killed outright takes its workers with it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from turnpoint.auth import auth_metadata
from turnpoint.server import WorkerGroup
from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.advanced import Coordinator, bump_epoch
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc

TOKEN = "worker-group-test-token-0123456789"
BOUND_S = 45.0
SERVE = (sys.executable, "-m", "turnpoint.apps._cli", "serve")
_SERVING = re.compile(r"turnpoint: serving (\S+) (\S+) on (\S+)$")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNPOINT_TOKEN")}
    env["TURNPOINT_TOKEN"] = TOKEN
    return env


def _resources_command(root: Path, *extra: str) -> tuple[str, ...]:
    return (*SERVE, "--kind", "resources", "--example", "guess", "--root", str(root), *extra)


async def describe(address: str) -> pb.DescribeResponse:
    """Describe on a connection of its own (a fresh subchannel pool): on the shared port
    the kernel picks a worker per connection."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.CheckpointControlServiceStub(channel)
        response: pb.DescribeResponse = await stub.Describe(
            pb.DescribeRequest(), metadata=auth_metadata(TOKEN), timeout=BOUND_S
        )
        return response


@asynccontextmanager
async def worker_group(root: Path, count: int) -> AsyncIterator[WorkerGroup]:
    group = WorkerGroup(
        "tools", count, _resources_command(root), env=_env(), start_timeout_s=BOUND_S
    )
    await asyncio.wait_for(group.start(), BOUND_S)
    try:
        yield group
    finally:
        assert await asyncio.wait_for(group.stop(), BOUND_S), "a worker did not exit 0"


async def test_describe_on_the_shared_port_lists_every_worker_and_each_answers_alone(
    tmp_path: Path,
) -> None:
    async with worker_group(tmp_path / "snapshots", 2) as group:
        members = {m.instance: m.address for m in group.members}
        assert sorted(members) == ["tools-w0", "tools-w1"]
        answered: set[str] = set()
        # The kernel spreads connections over the workers by a hash: a few tries see both.
        for _ in range(64):
            response = await describe(group.shared_address)
            assert response.worker_group == "tools"
            assert {w.instance_name: w.address for w in response.workers} == members
            assert response.header.participant_id == response.instance_name
            answered.add(response.instance_name)
            if len(answered) == 2:
                break
        assert answered == set(members)

        incarnations = {}
        for name, address in members.items():
            alone = await describe(address)
            assert (alone.instance_name, alone.header.participant_id) == (name, name)
            incarnations[name] = alone.header.incarnation
        assert len(set(incarnations.values())) == 2, "two workers, two participants"


async def test_the_coordinator_replaces_the_group_by_its_workers(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    async with worker_group(root, 3) as group:
        identity = await asyncio.to_thread(bump_epoch, root, coordinator_id="wire")
        async with Coordinator(
            {"tools": group.shared_address},
            token=TOKEN,
            coordinator_id=identity.coordinator_id,
            epoch=identity.epoch,
            config=CoordinatorConfig(snapshot_root=root, control_timeout_s=10.0),
        ) as coordinator:
            topology = await asyncio.wait_for(coordinator.discover(), BOUND_S)
            members = {m.instance: m.address for m in group.members}
            assert topology.instances == frozenset(members)
            assert dict(coordinator.endpoints) == members
            assert coordinator.instances == ("tools-w0", "tools-w1", "tools-w2")
            # A later discovery describes the workers themselves, and finds the same.
            again = await asyncio.wait_for(coordinator.discover(), BOUND_S)
            assert again.instances == topology.instances


async def test_a_killed_worker_is_back_on_its_own_port_as_a_fresh_incarnation(
    tmp_path: Path,
) -> None:
    async with worker_group(tmp_path / "snapshots", 2) as group:
        victim = group.members[1]
        before = await describe(victim.address)
        other = await describe(group.members[0].address)
        pid = group.pid(1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        new_pid = await group.wait_restarted(1, 1, BOUND_S)
        assert new_pid != pid and group.restarts(0) == 0
        after = await describe(victim.address)
        assert after.instance_name == victim.instance
        assert after.header.incarnation != before.header.incarnation
        # The other worker was never touched.
        assert (await describe(group.members[0].address)).header.incarnation == (
            other.header.incarnation
        )


# ---------------------------------------------------------------------- turnpoint serve


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it serves nothing.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


async def _gone(pids: set[int]) -> None:
    deadline = time.monotonic() + BOUND_S
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"workers still alive: {[p for p in pids if _alive(p)]}")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def serve_group(root: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    process = await asyncio.create_subprocess_exec(
        *_resources_command(root, "--instance", "tools", "--workers", "2"),
        stdout=asyncio.subprocess.PIPE,
        env=_env(),
    )
    try:
        assert process.stdout is not None
        address = None
        async with asyncio.timeout(BOUND_S):
            while address is None and (line := await process.stdout.readline()):
                match = _SERVING.match(line.decode().strip())
                if match is not None:
                    assert match.groups()[:2] == ("resources", "tools")
                    address = match[3]
        assert address is not None, "no serving line"
        yield process, address
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_serve_workers_ends_every_worker_with_the_parent(tmp_path: Path, how: str) -> None:
    async with serve_group(tmp_path / "snapshots") as (process, address):
        response = await describe(address)
        assert response.worker_group == "tools" and len(response.workers) == 2
        workers = _children(process.pid)
        assert len(workers) == 2
        if how == "sigterm":
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), BOUND_S) == 0
        else:
            # Killed outright: the workers must not live on serving the shared port.
            process.kill()
            await process.wait()
        await _gone(workers)
