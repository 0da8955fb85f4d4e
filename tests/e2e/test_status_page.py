"""The status page in a real browser (docs/spec.md section 7.13): Debian's Chromium,
driven by Playwright with that executable (nothing is downloaded).

The first test opens the page a live trainer serves in this process while real
participants on 127.0.0.1:0 take snapshots. One tools call is held open so that a prepare
waits: the page must name the participant it waits for and its blocker; after it
publishes, a row's drill-down must list every participant.

The second opens the page of a ``turnpoint demo`` run, as a user would, while the job
runs: after the demo's crash and restart, the restored job's tools server holds its tool
calls (``--hold-tools-after-restart``) until the test releases them, so the second
trainer's snapshots wait in prepare. Meanwhile the page must show that blocker, the crash
of the first trainer, the restore and every snapshot both trainers published (as the
demo's ``events.jsonl`` records them), and drill down to the participants of the snapshot
restored. Released, the run must finish and pass its audit.

The screenshots go to ``$TURNPOINT_ARTIFACTS/status-page`` and ``.../status-page-demo``
(default ``artifacts/``, which git ignores) for CI to keep. The page showing its error
banner, or an empty history once snapshots were published, fails a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from playwright.async_api import Page, async_playwright
from prometheus_client import CollectorRegistry

from tests.support.demo import DEMO, SHORT
from tests.support.participants import TOKEN, HostedParticipant, start_topology
from tests.support.scripted import poll
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


def artifacts(name: str = "status-page") -> Path:
    folder = Path(os.environ.get("TURNPOINT_ARTIFACTS") or REPO / "artifacts") / name
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


# ---------------------------------------------------------------------- during a demo run

DEMO_TIMEOUT_S = 120.0
_PAGE_LINE = re.compile(r"^status page: (?P<address>http://127\.0\.0\.1:\d+/) ")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written or cut
            events.append(json.loads(line))
    return events


class DemoRun:
    """``turnpoint demo`` in a process group of its own, its output read as it comes."""

    def __init__(self, process: asyncio.subprocess.Process, out: Path) -> None:
        self.process = process
        self.out = out
        self.lines: list[str] = []
        self.page_address: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            text = line.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(text)
            match = _PAGE_LINE.match(text)
            if match and not self.page_address.done():
                self.page_address.set_result(match["address"])
        if not self.page_address.done():
            self.page_address.set_exception(AssertionError(self.context()))

    def events(self) -> list[dict[str, Any]]:
        return _jsonl(self.out / "events.jsonl")

    def of(self, kind: str, incarnation: int | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events()
            if e.get("type") == kind and incarnation in (None, e.get("incarnation"))
        ]

    def context(self) -> str:
        return "demo stdout:\n" + "\n".join(self.lines[-40:])

    async def finish(self) -> int:
        status = await asyncio.wait_for(self.process.wait(), DEMO_TIMEOUT_S)
        await self._reading
        return status

    async def kill(self) -> None:
        """Whatever failed: end the demo and every participant it started."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)


async def test_the_page_of_a_demo_run_shows_the_blocker_the_crash_the_restore_and_every_snapshot(
    tmp_path: Path,
) -> None:
    shots = artifacts("status-page-demo")
    out = tmp_path / "out"
    release = tmp_path / "release-tools"
    process = await asyncio.create_subprocess_exec(
        *DEMO,
        *SHORT,
        "--hold-tools-after-restart",
        str(release),
        "--out",
        str(out),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    demo = DemoRun(process, out)
    try:
        # Printed at start, before any participant: the same port across the restart.
        address = await asyncio.wait_for(demo.page_address, BOUND_S)
        # The restored job's tools calls are held: from its start on, the second trainer
        # cannot finish the job, and its page stays up.
        await poll(lambda: bool(demo.of("start", 2)), DEMO_TIMEOUT_S)
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
            )
            try:
                page = await browser.new_page(viewport={"width": 1400, "height": 1100})
                await page.goto(address)
                await _the_page_shows_the_held_run(page, demo, shots)
            finally:
                await browser.close()
        release.touch()
        status = await demo.finish()
        assert status == 0, demo.context()
        assert "audit: passed" in demo.lines, demo.context()
    finally:
        release.touch()  # a held call must never outlive a failed test
        await demo.kill()
    assert (shots / "live-blocker.png").stat().st_size > 0
    assert (shots / "drill-down.png").stat().st_size > 0


async def _the_page_shows_the_held_run(page: Page, demo: DemoRun, shots: Path) -> None:
    # The second trainer's snapshot waits for the held tools call.
    blocker = page.locator('#live .blocker[data-participant="tools"]')
    await blocker.locator("li").first.wait_for(timeout=BOUND_MS)
    shown = await blocker.inner_text()
    assert "waiting for tools" in shown and "request_in_flight" in shown, shown
    open_id = await page.locator("#live p").first.inner_text()
    assert open_id.startswith("ck-002"), open_id  # the restored trainer's epoch

    # The crash of the first trainer and the second's restore, as the demo logged it.
    restored = demo.of("restore", 2)
    assert len(restored) == 1, demo.context()
    restored_id = restored[0]["checkpoint_id"]
    crash = page.locator('#events li[data-kind="trainer_ended"][data-epoch="1"]')
    await crash.wait_for(timeout=BOUND_MS)
    assert "CRASH" in await crash.inner_text()
    restore = page.locator(f'#events li[data-kind="restore"][data-checkpoint="{restored_id}"]')
    await restore.wait_for(timeout=BOUND_MS)
    assert await restore.get_attribute("data-epoch") == "2"

    # Every snapshot either trainer published. Nothing publishes while tools holds a
    # call in flight, and each trainer logs a snapshot before it takes the next: the
    # log is complete for as long as the blocker stands.
    published = [e["checkpoint_id"] for e in demo.of("snapshot") if e["outcome"] == "published"]
    assert any(i.startswith("ck-001") for i in published), demo.context()
    for checkpoint_id in published:
        row = page.locator(f'#history tbody tr[data-id="{checkpoint_id}"]')
        await row.locator(".status-published").wait_for(timeout=BOUND_MS)
    on_page = {
        await row.get_attribute("data-id")
        for row in await page.locator("#history tbody tr:has(.status-published)").all()
    }
    # The first trainer may have died between publishing a snapshot and logging it:
    # that one is the newest published, the one restored.
    assert on_page - set(published) <= {restored_id}, (on_page, published)
    assert await page.locator("#history-empty").is_hidden()
    await page.screenshot(path=str(shots / "live-blocker.png"), full_page=True)
    await no_error_banner(page)

    # Drill down to the snapshot the restart restored: every participant took part.
    await page.locator(f'#history tbody tr[data-id="{restored_id}"]').click()
    await page.locator("#detail-id").get_by_text(restored_id).wait_for(timeout=BOUND_MS)
    topology = json.loads((demo.out / "topology.json").read_text(encoding="utf-8"))
    for participant in topology["participants"]:
        name = participant["instance"]
        await page.locator(f'#detail tbody tr[data-participant="{name}"]').wait_for(
            timeout=BOUND_MS
        )
    await page.screenshot(path=str(shots / "drill-down.png"), full_page=True)
    await no_error_banner(page)
