"""``turnpoint bench-participant``: what the participant side of the protocol costs.

Three figures, each a median so that one slow round (a GC pause, a page-cache flush)
does not move it:

- SDK bookkeeping per episode with no checkpoint open: accept a Run, seal five
  boundaries, finish, acknowledge; in process, no network, an agent that does no work
  of its own. This is the tax every episode pays whether or not a snapshot is ever taken.
- Prepare, Commit and Resume round trips over loopback gRPC for one participant that
  holds N parked episodes (each waiting on a model call right after its boundary, the
  usual turn shape), through both control doors (unary calls and the ControlSession
  stream). Commit includes exporting and durably writing N records.
- Records per second the snapshot store writes (serialise, write, fsync, publish).

Benchmarks print figures; no test asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from turnpoint.auth import auth_metadata
from turnpoint.convert import duration_from_seconds, episode_to_proto
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import (
    Agent,
    EpisodeContext,
    ParticipantRuntime,
    Record,
    SnapshotStore,
)
from turnpoint.participant_sdk.advanced import RunResult
from turnpoint.protocol import EpisodeState
from turnpoint.server import ServerOptions, host_participant
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

BOUNDARIES = 5
INSTANCE = "bench-agent"
_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class BenchConfig:
    episodes: int = 5_000
    parked: int = 1_000
    rounds: int = 5
    records: int = 10_000
    root: Path | None = None

    def __post_init__(self) -> None:
        for name in ("episodes", "parked", "rounds", "records"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass
class BenchReport:
    bookkeeping_us: float = 0.0
    # door -> operation -> median milliseconds
    round_trips_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    records_per_s: float = 0.0

    def lines(self, config: BenchConfig) -> list[str]:
        out = [
            f"sdk bookkeeping per episode (begin + {BOUNDARIES} boundaries + finish + "
            f"acknowledge, no checkpoint open): {self.bookkeeping_us:.1f} us "
            f"(median of {config.episodes} episodes)",
            f"control round trips, loopback, {config.parked} parked episodes "
            f"(median of {config.rounds} rounds):",
        ]
        for door, ops in self.round_trips_ms.items():
            figures = "  ".join(f"{op} {ms:.2f} ms" for op, ms in ops.items())
            out.append(f"  {door:<8} {figures}")
        out.append(
            f"store: {self.records_per_s:,.0f} records/s written "
            f"({config.records} records per write, median of {config.rounds} writes)"
        )
        return out


class _BoundaryAgent(Agent):
    """Seals ``task["boundaries"]`` boundaries; with ``task["park"]`` it then waits on a
    model call that never returns, i.e. it is parked at its last boundary."""

    def __init__(self) -> None:
        self._never: asyncio.Future[None] | None = None

    async def _wait_forever(self) -> None:
        if self._never is None:
            self._never = asyncio.get_running_loop().create_future()
        await self._never

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        state = {"turn": 0}
        for turn in range(int(task["boundaries"])):
            state["turn"] = turn
            await ctx.boundary(turn, state)
        if task.get("park"):
            await ctx.model_call(self._wait_forever)
        return state


# ---------------------------------------------------------------------- bookkeeping


def bookkeeping_cpus() -> tuple[int | None, ...]:
    """The CPUs the bookkeeping repeats take turns on: those this process may run on
    (``(None,)`` where a process cannot be pinned). A machine's cores need not run
    Python equally fast (a virtual one's may share a physical core with a busy
    neighbour), and a process keeps to one for seconds at a time: pinned in turn, every
    core the figure could land on is measured and named."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None or not hasattr(os, "sched_setaffinity"):
        return (None,)
    return tuple(sorted(getaffinity(0)))


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """The calling thread on ``cpu`` alone (nothing for None), as it was afterwards."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def bookkeeping_us(episodes: int, root: Path) -> float:
    """The median microseconds of one episode's SDK bookkeeping, in process."""
    runtime = ParticipantRuntime(INSTANCE, SnapshotStore(root), agent=_BoundaryAgent())
    task = {"boundaries": BOUNDARIES}
    samples: list[float] = []
    async with runtime:
        for index in range(episodes):
            episode = EpisodeId(f"ep-{index}", 0)
            start = time.perf_counter()
            stream = await runtime.accept_run(episode, task)
            result: RunResult | None = None
            async for event in stream:
                if isinstance(event, RunResult):
                    result = event
            assert result is not None and result.receipt is not None
            await runtime.acknowledge([result.receipt])
            samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


# ---------------------------------------------------------------------- round trips


class _Door:
    """Control requests through the unary calls or one open ControlSession."""

    def __init__(self, channel: grpc.aio.Channel, door: str, token: str) -> None:
        self._stub = pb_grpc.CheckpointControlServiceStub(channel)
        self._metadata = auth_metadata(token)
        self._door = door
        self._session: Any = None

    async def call(self, operation: str, request: Any) -> Any:
        if self._door == "unary":
            method = getattr(self._stub, operation.capitalize())
            return await method(request, timeout=_TIMEOUT_S, metadata=self._metadata)
        if self._session is None:
            self._session = self._stub.ControlSession(None, metadata=self._metadata)
        message = pb.ControlSessionRequest(
            request_id=request.request_id, timeout=duration_from_seconds(_TIMEOUT_S)
        )
        getattr(message, operation).CopyFrom(request)
        await self._session.write(message)
        response = await self._session.read()
        which = response.WhichOneof("result")
        if which != operation:
            raise RuntimeError(f"{operation} answered {which}: {response}")
        return getattr(response, which)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.done_writing()
            # Drain to the end of the stream so the session closes cleanly.
            while isinstance(await self._session.read(), pb.ControlSessionResponse):
                pass


async def _round_trips_ms(
    parked: int, rounds: int, root: Path, doors: tuple[str, ...]
) -> dict[str, dict[str, float]]:
    token = secrets.token_urlsafe(24)
    runtime = ParticipantRuntime(INSTANCE, SnapshotStore(root), agent=_BoundaryAgent())
    hosted = host_participant(runtime, ServerOptions(port=0, token=token))
    await hosted.start()
    streams = []
    try:
        episodes = [EpisodeId(f"parked-{index}", 0) for index in range(parked)]
        for episode in episodes:
            streams.append(await runtime.accept_run(episode, {"boundaries": 1, "park": True}))
        settled = await runtime.wait_until(
            lambda core: (
                core.ready and core.recount()[1].get(EpisodeState.AWAITING_MODEL) == parked
            ),
            _TIMEOUT_S,
        )
        if not settled:
            raise RuntimeError("the parked episodes never reached their boundary")
        scope = [episode_to_proto(e) for e in episodes]
        fence = types_pb2.Fence(coordinator_id="bench", epoch=1)
        results: dict[str, dict[str, float]] = {}
        sequence = 0
        async with grpc.aio.insecure_channel(hosted.address) as channel:
            for door_name in doors:
                door = _Door(channel, door_name, token)
                samples: dict[str, list[float]] = {"prepare": [], "commit": [], "resume": []}
                for _ in range(rounds):
                    sequence += 1
                    checkpoint = make_checkpoint_id("bench", sequence)
                    requests = {
                        "prepare": pb.PrepareRequest(
                            fence=fence, request_id=f"p-{sequence}", checkpoint_id=checkpoint
                        ),
                        "commit": pb.CommitRequest(
                            fence=fence,
                            request_id=f"c-{sequence}",
                            checkpoint_id=checkpoint,
                            snapshot=f"snap-{sequence}",
                            scope=scope,
                        ),
                        "resume": pb.ResumeRequest(
                            fence=fence, request_id=f"r-{sequence}", checkpoint_id=checkpoint
                        ),
                    }
                    for operation, request in requests.items():
                        start = time.perf_counter()
                        response = await door.call(operation, request)
                        samples[operation].append(time.perf_counter() - start)
                        if operation == "prepare" and response.phase != types_pb2.PHASE_PREPARED:
                            raise RuntimeError(f"prepare was not ready: {response}")
                        if operation == "commit" and len(response.exported) != parked:
                            raise RuntimeError("commit did not export every parked episode")
                await door.close()
                results[door_name] = {
                    op: statistics.median(values) * 1e3 for op, values in samples.items()
                }
        return results
    finally:
        for stream in streams:
            await stream.aclose()
        await hosted.stop(0)


# ---------------------------------------------------------------------- store


def _records_per_s(count: int, rounds: int, root: Path) -> float:
    store = SnapshotStore(root)
    payload = {"task": {"prompt": "guess the number", "turns": 8}, "history": list(range(16))}
    records = [Record(EpisodeId(f"ep-{index}", 0), "run", payload) for index in range(count)]
    rates: list[float] = []
    for number in range(rounds):
        start = time.perf_counter()
        store.write(f"store-{number}", INSTANCE, make_checkpoint_id("store", number), records)
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


# ---------------------------------------------------------------------- entry points


async def _run(config: BenchConfig, root: Path) -> BenchReport:
    report = BenchReport()
    report.bookkeeping_us = await bookkeeping_us(config.episodes, root / "bookkeeping")
    report.round_trips_ms = await _round_trips_ms(
        config.parked, config.rounds, root / "round-trips", ("unary", "session")
    )
    report.records_per_s = await asyncio.to_thread(
        _records_per_s, config.records, config.rounds, root / "store"
    )
    return report


def run_participant_bench(config: BenchConfig) -> BenchReport:
    """Run the three benchmarks (writes go under ``config.root`` or a temporary dir)."""
    if config.root is not None:
        config.root.mkdir(parents=True, exist_ok=True)
        return asyncio.run(_run(config, config.root))
    with tempfile.TemporaryDirectory(prefix="turnpoint-bench-") as temp:
        return asyncio.run(_run(config, Path(temp)))


def bench_participant_command(args: argparse.Namespace) -> int:
    try:
        config = BenchConfig(
            episodes=args.episodes,
            parked=args.parked,
            rounds=args.rounds,
            records=args.records,
            root=Path(args.root) if args.root else None,
        )
    except ValueError as error:
        print(f"turnpoint bench-participant: {error}")
        return 2
    report = run_participant_bench(config)
    for line in report.lines(config):
        print(line, flush=True)
    return 0


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bench-participant",
        help="measure SDK bookkeeping, control round trips and store throughput",
        description=(
            "Print what the participant side costs: SDK bookkeeping per episode, Prepare/"
            "Commit/Resume round trips over loopback with parked episodes (both control "
            "doors), and records per second written by the snapshot store."
        ),
    )
    parser.add_argument("--episodes", type=int, default=5_000, help="bookkeeping episodes")
    parser.add_argument("--parked", type=int, default=1_000, help="parked episodes held")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per door (and writes)")
    parser.add_argument("--records", type=int, default=10_000, help="records per store write")
    parser.add_argument("--root", help="directory for the snapshots (default: a temp dir)")
    parser.set_defaults(handler=bench_participant_command)
