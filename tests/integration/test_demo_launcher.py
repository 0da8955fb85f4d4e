"""The demo's launcher over loopback: the trainer's Launcher asks the supervisor.

A real :class:`LaunchService` on ``127.0.0.1:0`` over a stand-in process table; the
trainer side is :class:`SupervisorLauncher`, exactly as the demo trainer builds it.
"""

from __future__ import annotations

import asyncio

import pytest

from turnpoint.apps.demo._heal import LaunchService, ReplaceRefused, SupervisorLauncher
from turnpoint.trainer import LaunchError

TOKEN = "run-token"


class _Table:
    """A process table that replaces agents and refuses anything else."""

    def __init__(self) -> None:
        self.replaced: list[str] = []
        self.running = 0
        self.most_at_once = 0

    async def replace(self, instance: str) -> str:
        if not instance.startswith("agent-"):
            raise ReplaceRefused(f"{instance} is wired into every agent; the job restarts")
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        await asyncio.sleep(0)  # let a concurrent request in, were it not serialised
        self.running -= 1
        self.replaced.append(instance)
        return f"127.0.0.1:{50000 + len(self.replaced)}"


async def test_a_replacement_returns_its_address_one_at_a_time() -> None:
    table = _Table()
    service = await LaunchService(TOKEN, table.replace).start()
    try:
        launcher = SupervisorLauncher(service.address, TOKEN, timeout_s=10.0)
        addresses = await asyncio.gather(launcher.replace("agent-0"), launcher.replace("agent-1"))
    finally:
        await service.close()

    assert sorted(addresses) == ["127.0.0.1:50001", "127.0.0.1:50002"]
    assert sorted(table.replaced) == ["agent-0", "agent-1"]
    assert table.most_at_once == 1


async def test_a_refusal_is_a_launch_error_with_the_reason() -> None:
    table = _Table()
    service = await LaunchService(TOKEN, table.replace).start()
    try:
        launcher = SupervisorLauncher(service.address, TOKEN, timeout_s=10.0)
        with pytest.raises(LaunchError, match="wired into every agent") as caught:
            await launcher.replace("tools")
    finally:
        await service.close()

    assert caught.value.instance == "tools"
    assert table.replaced == []


async def test_a_wrong_token_replaces_nothing() -> None:
    table = _Table()
    service = await LaunchService(TOKEN, table.replace).start()
    try:
        launcher = SupervisorLauncher(service.address, "not-the-token", timeout_s=10.0)
        with pytest.raises(LaunchError, match="unauthenticated"):
            await launcher.replace("agent-0")
    finally:
        await service.close()

    assert table.replaced == []


async def test_no_supervisor_is_a_launch_error() -> None:
    service = await LaunchService(TOKEN, _Table().replace).start()
    address = service.address
    await service.close()

    # (Whatever answers on that port now, if anything, is not a launch service.)
    with pytest.raises(LaunchError) as caught:
        await SupervisorLauncher(address, TOKEN, timeout_s=10.0).replace("agent-0")
    assert caught.value.instance == "agent-0"
