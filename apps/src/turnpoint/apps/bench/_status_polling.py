"""What serving the status page costs the snapshot path (docs/spec.md section 7.13.1).

The control path of :mod:`._control_overhead` (the real coordinator, N real
participants, prepare, commit, publish, resume) with the trainer's status server
attached as a trainer attaches it (the checkpoint history watching the coordinator, the
API reading the history, the prepare under way and the snapshot root), in blocks of
:data:`BLOCK` back-to-back rounds of two kinds, interleaved (quiet, polled, polled,
quiet, quiet, polled, ...: drift of the machine's load falls on both kinds alike):
**quiet** (nobody asks the server anything) and **polled** (a client thread asks
``/api/job``, ``/api/checkpoints`` and ``/api/snapshots`` every 100 ms the whole block
through, more than the page does: it asks for the snapshots every 5 s). A round is
with its pause about as long as the polling interval, so nearly every polled round
overlaps one round of requests. The figure is the median polled round over the median
quiet round, a ratio taken within one run; the ratio of the means is reported beside
it (it also catches a cost that lands in a minority of rounds, and noise).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from turnpoint.apps.bench._control_overhead import (
    SETTLE_S,
    Fleet,
    Progress,
    _checkpoint_ids,
    _coordinator,
    _SnapshotRounds,
)
from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.advanced import SnapshotLayout
from turnpoint.trainer.status.history import CheckpointHistory
from turnpoint.trainer.status.server import StatusServer, StatusSources

POLL_S: Final = 0.1
BLOCK: Final = 3
PATHS: Final = ("api/job", "api/checkpoints", "api/snapshots")
_ROUND_TIMEOUT_S: Final = 120.0


@dataclass(frozen=True, slots=True)
class StatusPolling:
    """Median (and mean) milliseconds of one snapshot quiet and polled, and the
    requests served."""

    participants: int
    rounds: int
    quiet_ms: float
    polled_ms: float
    requests: int
    quiet_mean_ms: float = 0.0
    polled_mean_ms: float = 0.0

    @property
    def ratio(self) -> float:
        return self.polled_ms / self.quiet_ms

    def to_json(self) -> dict[str, float | int]:
        return {
            "participants": self.participants,
            "rounds": self.rounds,
            "quiet_ms": round(self.quiet_ms, 3),
            "polled_ms": round(self.polled_ms, 3),
            "ratio_polled_vs_quiet": round(self.ratio, 3),
            "quiet_mean_ms": round(self.quiet_mean_ms, 3),
            "polled_mean_ms": round(self.polled_mean_ms, 3),
            "mean_ratio_polled_vs_quiet": round(self.polled_mean_ms / self.quiet_mean_ms, 3),
            "poll_interval_s": POLL_S,
            "requests_served": self.requests,
        }


class _Poller:
    """A client thread asking every path of the API each :data:`POLL_S` while on."""

    def __init__(self, base: str) -> None:
        self._base = base
        self.requests = 0
        self.failures: list[str] = []

    @asynccontextmanager
    async def polling(self) -> AsyncIterator[None]:
        stop = threading.Event()
        asked = threading.Event()
        thread = threading.Thread(target=self._run, args=(stop, asked), daemon=True)
        thread.start()
        try:
            # The round starts once the server has answered a first round of requests
            # (the loop must keep running meanwhile: it is the server's).
            await asyncio.to_thread(asked.wait, _ROUND_TIMEOUT_S)
            yield
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, _ROUND_TIMEOUT_S)

    def _run(self, stop: threading.Event, asked: threading.Event) -> None:
        while True:
            for path in PATHS:
                try:
                    with urllib.request.urlopen(self._base + path, timeout=10) as reply:
                        reply.read()
                    self.requests += 1
                except OSError as error:
                    self.failures.append(f"{path}: {error}")
            asked.set()
            if stop.wait(POLL_S):
                return


async def measure_status_polling(
    root: Path,
    n: int,
    *,
    workers: int,
    rounds: int,
    warmup: int,
    token: str,
    progress: Progress,
    settle_s: float = SETTLE_S,
) -> StatusPolling:
    """``rounds`` quiet and ``rounds`` polled snapshots of ``n`` participants in
    interleaved blocks, after ``warmup`` unpolled ones."""
    fleet_root = root / "status"
    fleet_root.mkdir(parents=True, exist_ok=True)
    progress(f"status page: {n} participants, quiet vs the API polled every {POLL_S:g} s")
    layout = SnapshotLayout(fleet_root)
    ids = await asyncio.to_thread(_checkpoint_ids, layout)
    times: dict[str, list[float]] = {"quiet": [], "polled": []}
    async with Fleet(fleet_root, n, workers, token, baselines=False) as fleet:
        coordinator = await _coordinator(fleet, n)
        history = CheckpointHistory(wall_offset_s=time.time() - time.monotonic())
        coordinator.watch(history)
        server = StatusServer(
            StatusSources(
                history=history,
                layout=layout,
                config=CoordinatorConfig(snapshot_root=fleet_root),
                coordinator=coordinator,
            )
        )
        poller = _Poller(await server.start())
        try:
            async with asyncio.timeout(_ROUND_TIMEOUT_S):
                await coordinator.discover()
            snapshots = _SnapshotRounds(coordinator, layout, ids)
            for _ in range(warmup):
                async with asyncio.timeout(_ROUND_TIMEOUT_S):
                    await snapshots.round()
            for kind, count in _blocks(rounds):
                async with poller.polling() if kind == "polled" else _quiet():
                    for _ in range(count):
                        async with asyncio.timeout(_ROUND_TIMEOUT_S):
                            laps = await snapshots.round()
                        times[kind].append(laps["total"])
                        await asyncio.sleep(settle_s)
        finally:
            await server.close()
            await coordinator.close()
    if poller.failures:
        raise RuntimeError(f"the status API failed while polled: {poller.failures[0]}")
    result = StatusPolling(
        participants=n,
        rounds=rounds,
        quiet_ms=statistics.median(times["quiet"]) * 1000,
        polled_ms=statistics.median(times["polled"]) * 1000,
        requests=poller.requests,
        quiet_mean_ms=statistics.fmean(times["quiet"]) * 1000,
        polled_mean_ms=statistics.fmean(times["polled"]) * 1000,
    )
    progress(
        f"  N={n}: quiet {result.quiet_ms:.1f} ms, polled {result.polled_ms:.1f} ms "
        f"(median ratio {result.ratio:.3f}, means {result.quiet_mean_ms:.1f} / "
        f"{result.polled_mean_ms:.1f} ms, {result.requests} requests served)"
    )
    return result


def _blocks(rounds: int) -> list[tuple[str, int]]:
    """``rounds`` of each kind in blocks of :data:`BLOCK`: Q P P Q Q P P Q ..."""
    left = {"quiet": rounds, "polled": rounds}
    order: list[tuple[str, int]] = []
    index = 0
    while any(left.values()):
        kind = ("quiet", "polled", "polled", "quiet")[index % 4]
        index += 1
        count = min(BLOCK, left[kind])
        if count:
            order.append((kind, count))
            left[kind] -= count
    return order


@asynccontextmanager
async def _quiet() -> AsyncIterator[None]:
    yield
