"""What serving the status page costs the snapshot path (docs/spec.md section 7.13.1).

The control path of :mod:`._control_overhead` (the real coordinator, N real
participants, prepare, commit, publish, resume) with the trainer's status server
attached as a trainer attaches it (the checkpoint history watching the coordinator, the
API reading the history, the prepare under way and the snapshot root), in blocks of
:data:`BLOCK` back-to-back rounds of two kinds, interleaved (quiet, polled, polled,
quiet, quiet, polled, ...: drift of the machine's load falls on both kinds alike):
**quiet** (nobody asks the server anything) and **polled** (a client asks
``/api/job``, ``/api/checkpoints`` and ``/api/snapshots`` every 100 ms the whole block
through from another process, as a browser would, more than the page does: it asks for
the snapshots every 5 s). A round is
with its pause about as long as the polling interval, so nearly every polled round
overlaps one round of requests. The figure is the median polled round over the median
quiet round, a ratio taken within one run; the ratio of the means is reported beside
it (it also catches a cost that lands in a minority of rounds, and noise).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
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


# The client: another process, as a browser is, so that only the server's work lands in
# the trainer's process. It prints how many requests it has made after each round.
_POLLER: Final = """
import sys, time, urllib.request
base, interval, paths = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
made = 0
while True:
    for path in paths:
        with urllib.request.urlopen(base + path, timeout=10) as reply:
            reply.read()
        made += 1
    print(made, flush=True)
    time.sleep(interval)
"""


class _Poller:
    """A client process asking every path of the API each :data:`POLL_S` while on."""

    def __init__(self, base: str) -> None:
        self._base = base
        self.requests = 0

    @asynccontextmanager
    async def polling(self) -> AsyncIterator[None]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _POLLER,
            self._base,
            str(POLL_S),
            *PATHS,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        made = 0
        try:
            # The block starts once the server has answered a first round of requests.
            first = await asyncio.wait_for(process.stdout.readline(), _ROUND_TIMEOUT_S)
            if not first:
                raise RuntimeError(f"the status API poller failed: {await _stderr(process)}")
            made = int(first)
            yield
            if process.returncode is not None:
                raise RuntimeError(f"the status API poller failed: {await _stderr(process)}")
        finally:
            if process.returncode is None:
                process.terminate()
            rest, _ = await asyncio.wait_for(process.communicate(), _ROUND_TIMEOUT_S)
            counts = [int(line) for line in rest.split()]
            self.requests += counts[-1] if counts else made


async def _stderr(process: asyncio.subprocess.Process) -> str:
    assert process.stderr is not None
    return (await process.stderr.read()).decode(errors="replace")[-500:]


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
