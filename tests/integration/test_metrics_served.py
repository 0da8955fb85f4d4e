"""Metrics served over HTTP, scraped mid-run (docs/spec.md section 7.10).

A guide resources server and agent server (docs/participant.md) each serve their own
metrics (``ServerOptions(metrics_port=0)``); the coordinator's
:class:`~turnpoint.trainer.CoordinatorMetrics` registry is served the way the demo
trainer serves it. Scrapes between snapshots show the phase seconds adding up to the
total, and the counters for published and failed snapshots, refusals, retried commits,
lease expiries, retried snapshots and restores moving when those things happen. The
snapshots are taken by a :class:`SnapshotPump`, which retries failed ones as a run does.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_participant_guide import TOKEN, Anchor, counting, eventually
from turnpoint.apps.examples.guide_agent import CounterAgent
from turnpoint.apps.examples.guide_resources import CounterTools
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import ParticipantRuntime, RuntimeConfig, SnapshotStore
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.server.advanced import serve_metrics
from turnpoint.trainer import CoordinatorConfig, SnapshotOutcome
from turnpoint.trainer.advanced import (
    AgentEndpoint,
    Coordinator,
    CoordinatorMetrics,
    Restorer,
    RolloutClient,
    SnapshotDriver,
    SnapshotLayout,
    SnapshotPump,
)
from turnpoint.trainer.anchors.source import WrittenAnchor

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HeldTools(CounterTools):
    """Exports wait on ``release`` while ``hold`` is set: the lease can run out meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.exporting = asyncio.Event()
        self.release = asyncio.Event()

    async def export_sessions(self, episodes: Sequence[EpisodeId]) -> Mapping[EpisodeId, Any]:
        if self.hold:
            self.exporting.set()
            await self.release.wait()
        return await super().export_sessions(episodes)


class FlakyAnchor(Anchor):
    """The trainer anchor; ``fail_next`` makes the next write hit a full disk."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = False

    async def write(self, snapshot: Path) -> WrittenAnchor:
        if self.fail_next:
            self.fail_next = False
            raise OSError(28, "No space left on device")
        return await super().write(snapshot)


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@contextlib.asynccontextmanager
async def served(
    root: Path, clock: FakeClock
) -> AsyncIterator[tuple[HostedParticipant, HostedParticipant, HeldTools]]:
    config = RuntimeConfig(default_lease_s=60.0)
    tools = HeldTools()
    tools_runtime = ParticipantRuntime(
        "counter-tools", SnapshotStore(root), resources=tools, config=config, clock=clock
    )
    options = ServerOptions(port=0, token=TOKEN, metrics_port=0)
    hosted_tools = await host_participant(tools_runtime, options).start()
    agent = CounterAgent(hosted_tools.address, TOKEN, turn_delay_s=0.05)
    agent_runtime = ParticipantRuntime("agent-0", SnapshotStore(root), agent=agent, config=config)
    hosted_agent = host_participant(agent_runtime, options)
    hosted_agent.on_close.append(agent.aclose)
    await hosted_agent.start()
    try:
        yield hosted_tools, hosted_agent, tools
    finally:
        await hosted_agent.stop(0)
        await hosted_tools.stop(0)


async def test_participant_and_coordinator_metrics_move_mid_run(tmp_path: Path) -> None:
    config = CoordinatorConfig(
        snapshot_root=tmp_path,
        control_timeout_s=2.0,
        resume_retry_pause_s=0.0,
        max_consecutive_failures=5,
    )
    layout = SnapshotLayout(tmp_path)
    metrics = CoordinatorMetrics(CollectorRegistry())
    endpoint = serve_metrics(metrics.registry, 0)
    clock = FakeClock()
    try:
        async with served(tmp_path, clock) as (hosted_tools, hosted_agent, held):
            participant = hosted_tools.server.metrics_address
            assert participant is not None and hosted_agent.server.metrics_address is not None
            addresses = {"counter-tools": hosted_tools.address, "agent-0": hosted_agent.address}
            coordinator = Coordinator(
                addresses,
                token=TOKEN,
                coordinator_id="coord-m",
                epoch=1,
                config=config,
                metrics=metrics,
            )
            await coordinator.discover()
            endpoints = {"agent-0": AgentEndpoint(hosted_agent.address, TOKEN)}
            async with coordinator, RolloutClient(endpoints) as client:
                # Longer than the whole test: each participant ends the checkpoint in its
                # commit, so the episode goes on between the snapshots, and the restore
                # below must still find it in flight.
                client.dispatch(replace(counting("metered"), task={"target": 100_000}))
                await eventually(lambda: any(len(s["totals"]) > 2 for s in held.sessions.values()))
                anchor = FlakyAnchor()
                driver = SnapshotDriver(
                    coordinator=coordinator,
                    rollouts=client,
                    anchor=anchor,
                    layout=layout,
                    config=config,
                    epoch=1,
                    metrics=metrics,
                )
                pump = SnapshotPump(driver, config)

                # A published snapshot: its phases add up to its total.
                anchor.step += 1
                assert (await pump.tick()).outcome is SnapshotOutcome.PUBLISHED
                mid = await asyncio.to_thread(scrape, endpoint.address)
                assert value(mid, "turnpoint_snapshots_total", outcome="published", reason="") == 1
                phases = total(mid, "turnpoint_snapshot_phase_seconds_sum")
                whole = total(mid, "turnpoint_snapshot_seconds_sum")
                assert whole > 0 and abs(phases - whole) < 1e-6, (phases, whole)
                seen = await asyncio.to_thread(scrape, participant)
                assert (
                    value(
                        seen,
                        "turnpoint_participant_control_calls_total",
                        operation="commit",
                        outcome="ok",
                    )
                    >= 1
                )
                assert value(seen, "turnpoint_participant_status_up") == 1
                assert value(seen, "turnpoint_participant_admission_open") == 1
                assert value(seen, "turnpoint_participant_phase", phase="idle") == 1

                # A flaky backend: the snapshot fails, counted on both sides.
                held.backend_up = False
                anchor.step += 1
                assert (await pump.tick()).outcome is SnapshotOutcome.FAILED
                held.backend_up = True
                after = await asyncio.to_thread(scrape, endpoint.address)
                assert total(after, "turnpoint_snapshots_total") == 2
                assert total(after, "turnpoint_snapshot_retries_total") == 0
                assert (
                    value(
                        after,
                        "turnpoint_snapshots_total",
                        outcome="failed",
                        reason="participant_unavailable",
                    )
                    == 1
                )
                assert (
                    value(
                        after,
                        "turnpoint_control_refusals_total",
                        operation="commit",
                        reason="UNAVAILABLE",
                    )
                    >= 1
                )
                seen = await asyncio.to_thread(scrape, participant)
                failed_commits = value(
                    seen,
                    "turnpoint_participant_control_calls_total",
                    operation="commit",
                    outcome="unavailable",
                )
                assert failed_commits >= 1
                assert (
                    value(
                        seen,
                        "turnpoint_participant_control_refusals_total",
                        operation="commit",
                        reason="unavailable",
                    )
                    == failed_commits
                )

                # The retry (a new id: the participants saw the failed one) finds the
                # lease running out while an export hangs: both sides count an expiry.
                held.hold = True
                anchor.step += 1
                attempt = asyncio.create_task(pump.tick())
                await asyncio.wait_for(held.exporting.wait(), 10)
                seen = await asyncio.to_thread(scrape, participant)
                assert value(seen, "turnpoint_participant_admission_open") == 0
                clock.now += 10_000
                assert await hosted_tools.runtime.check_lease() is not None
                held.hold = False
                held.release.set()
                report = await attempt
                assert report.outcome is SnapshotOutcome.FAILED, report
                seen = await asyncio.to_thread(scrape, participant)
                assert value(seen, "turnpoint_participant_lease_expiries_total") == 1
                assert value(seen, "turnpoint_participant_admission_open") == 1
                after = await asyncio.to_thread(scrape, endpoint.address)
                assert value(after, "turnpoint_lease_expiries_total") >= 1
                assert value(after, "turnpoint_snapshot_retries_total", how="new_id") == 1
                # The next retry fails before any participant sees it: a full disk.
                anchor.fail_next = True
                anchor.step += 1
                failed = await pump.tick()
                assert failed.outcome is SnapshotOutcome.FAILED, failed
                after = await asyncio.to_thread(scrape, endpoint.address)
                assert value(after, "turnpoint_snapshot_retries_total", how="new_id") == 2
                assert value(after, "turnpoint_snapshots_total", outcome="failed", reason="storage")
                # Its retry takes the very same id, and publishes.
                report = await pump.tick()
                assert report.outcome is SnapshotOutcome.PUBLISHED, report
                assert report.checkpoint_id == failed.checkpoint_id
                after = await asyncio.to_thread(scrape, endpoint.address)
                assert value(after, "turnpoint_snapshot_retries_total", how="same_id") == 1
                assert total(after, "turnpoint_snapshot_retries_total") == 3
                published = value(
                    after, "turnpoint_snapshots_total", outcome="published", reason=""
                )
                assert published == 2
                assert total(after, "turnpoint_snapshots_total") == 5

        # A restore onto fresh servers moves the restore counters.
        async with served(tmp_path, FakeClock()) as (fresh_tools, fresh_agent, _):
            addresses = {"counter-tools": fresh_tools.address, "agent-0": fresh_agent.address}
            coordinator = Coordinator(
                addresses,
                token=TOKEN,
                coordinator_id="coord-m",
                epoch=2,
                config=config,
                metrics=metrics,
            )
            async with coordinator:
                restorer = Restorer(
                    coordinator, layout, config, load_anchor=lambda s, a: 1, metrics=metrics
                )
                assert await restorer.restore() is not None
            after = await asyncio.to_thread(scrape, endpoint.address)
            assert value(after, "turnpoint_rollouts_restored_total", how="resumed") == 1
            seen = await asyncio.to_thread(scrape, fresh_tools.server.metrics_address or "")
            assert (
                value(
                    seen,
                    "turnpoint_participant_control_calls_total",
                    operation="restore_running",  # it serves it: docs/spec.md 4.16
                    outcome="ok",
                )
                == 1
            )
    finally:
        endpoint.close()
