"""The status page in a real browser (docs/spec.md section 7.13): Debian's Chromium,
driven by Playwright with that executable (nothing is downloaded), opens the page a live
trainer serves while real participants on 127.0.0.1:0 take snapshots. One tools call is
held open so that a prepare waits: the page must name the participant it waits for and
its blocker; after it publishes, a row's drill-down must list every participant. The
screenshots go to ``$TURNPOINT_ARTIFACTS/status-page`` (default ``artifacts/``, which
git ignores) for CI to keep. The page showing its error banner, or an empty history once
snapshots were published, fails the test.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from playwright.async_api import Page, async_playwright
from prometheus_client import CollectorRegistry

from tests.support.participants import TOKEN, HostedParticipant, start_topology
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    CoordinatorMetrics,
    SnapshotOutcome,
    TorchAnchorSource,
    torch_anchor_loader,
)

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
GROUP_SIZE = 2
# A safety net for waits on things that must happen; never a synchronisation device.
BOUND_MS = 30_000
BOUND_S = BOUND_MS / 1000
REPO = Path(__file__).resolve().parents[2]


def artifacts() -> Path:
    folder = Path(os.environ.get("TURNPOINT_ARTIFACTS") or REPO / "artifacts") / "status-page"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class HeldToolCalls:
    """Holds every call of one resources server until :meth:`release` (a named,
    deterministic fault: the tools call of a turn stays in flight, so a prepare waits)."""

    def __init__(self, hosted: HostedParticipant) -> None:
        resources = hosted.runtime.resources
        assert resources is not None
        self._server: Any = resources._server
        self._call = self._server.call
        self.entered = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        self._open.clear()
        self._server.call = self._held

    def release(self) -> None:
        self._open.set()

    async def _held(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        await self._open.wait()
        return await self._call(*args, **kwargs)


async def no_error_banner(page: Page) -> None:
    banner = page.locator("#error")
    if await banner.is_visible():
        raise AssertionError(f"the page shows an error: {await banner.inner_text()}")


async def test_the_page_shows_the_live_blocker_and_drills_down_to_participants(
    tmp_path: Path,
) -> None:
    shots = artifacts()
    model = torch.nn.Linear(2, 2)
    async with start_topology(tmp_path / "p", agents=1, group_size=GROUP_SIZE) as topology:
        participants: Mapping[str, str] = {n: h.address for n, h in topology.participants.items()}
        held = HeldToolCalls(topology.tools)
        async with (
            Checkpointing(
                CoordinatorConfig(snapshot_root=topology.root, control_timeout_s=60.0),
                participants,
                token=TOKEN,
                anchor=TorchAnchorSource(model, None, step=lambda: 0),
                load_anchor=torch_anchor_loader(model, None),
                periodic=False,
                metrics=CoordinatorMetrics(CollectorRegistry()),
                status_port=0,
                snapshot_metrics=lambda: {"mean_reward": 0.25},
            ) as ckpt,
            async_playwright() as playwright,
        ):
            address = ckpt.status_address
            assert address is not None
            for rollout in guess_rollouts(0, GROUP_SIZE, 0, ckpt.agents):
                ckpt.dispatch(rollout, data_loader=1)
            first = await ckpt.snapshot_now()
            assert first.outcome is SnapshotOutcome.PUBLISHED, first

            browser = await playwright.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
            )
            try:
                page = await browser.new_page(viewport={"width": 1400, "height": 1100})
                await page.goto(address)
                row = page.locator(f'#history tbody tr[data-id="{first.checkpoint_id}"]')
                await row.wait_for(timeout=BOUND_MS)
                await no_error_banner(page)

                # The next group's tools call stays in flight: the prepare waits for it.
                held.hold()
                for rollout in guess_rollouts(2, GROUP_SIZE, 0, ckpt.agents):
                    ckpt.dispatch(rollout, data_loader=2)
                async with asyncio.timeout(BOUND_S):
                    await held.entered.wait()
                snapshot = asyncio.create_task(ckpt.snapshot_now())
                # The blocker's episodes are listed once tools reported its readiness.
                blocker = page.locator('#live .blocker[data-participant="tools"]')
                await blocker.locator("li").first.wait_for(timeout=BOUND_MS)
                shown = await blocker.inner_text()
                assert "waiting for tools" in shown and "request_in_flight" in shown, shown
                await page.screenshot(path=str(shots / "live-blocker.png"), full_page=True)
                await no_error_banner(page)

                held.release()
                second = await asyncio.wait_for(snapshot, BOUND_S)
                assert second.outcome is SnapshotOutcome.PUBLISHED, second
                latest = page.locator(f'#history tbody tr[data-id="{second.checkpoint_id}"]')
                await latest.locator(".status-published").wait_for(timeout=BOUND_MS)
                await page.get_by_text("no snapshot under way").wait_for(timeout=BOUND_MS)
                assert await page.locator("#history-empty").is_hidden()

                await latest.click()
                for name in participants:
                    cell = page.locator(f'#detail tbody tr[data-participant="{name}"]')
                    await cell.wait_for(timeout=BOUND_MS)
                assert second.checkpoint_id in await page.locator("#detail-id").inner_text()
                restore = page.locator(f'#restore tbody tr[data-snapshot="{second.checkpoint_id}"]')
                await restore.wait_for(timeout=BOUND_MS)
                await page.screenshot(path=str(shots / "drill-down.png"), full_page=True)
                await no_error_banner(page)
            finally:
                held.release()
                await browser.close()
    assert (shots / "live-blocker.png").stat().st_size > 0
    assert (shots / "drill-down.png").stat().st_size > 0
