"""``turnpoint bench-heal``: one participant SIGKILLed, healed in place vs a job restart.

The figure of issue 24: with 64 participants and 256 episodes in flight, one agent
process is SIGKILLed; how many turns are recomputed, and how long until the fleet is
whole again, when the trainer heals it in place (docs/spec.md section 7.15) and when the
job restarts whole (section 7.11 item 2). Both ways run in the same command on the same
workload, one after the other on fresh fleets; the figures are the ratios heal over
restart (:class:`~._heal_figures.HealFigure`), the absolute numbers beside.

The fleet (:mod:`._heal_fleet`): the participant guide's counter tools and counting
agents, a turn every ``turn_delay_s``, the survivors hosted by a few processes and the
victim agent alone in its own, started by a :class:`LocalProcessLauncher`. The trainer
is the real :class:`Checkpointing` facade in this process, watching liveness. Each way:

1. every episode is dispatched round-robin over the agents and seals ``warm_turns``
   turns; one snapshot C is published; every episode then seals ``advance_turns`` more
   (the work a recovery may throw away); the victim is SIGKILLed;
2. **heal**: the facade, given the launcher, finds the victim lost, has it replaced and
   restores its episodes from C; the others keep running. Whole: every episode of the
   heal's plan runs again (its agent accepted its new attempt, restored from C or
   rerun from its prompt);
3. **restart**: the facade, given no launcher, ends the run on the loss; as the demo's
   supervisor does, every participant process is SIGKILLed and the trainer closed,
   then the whole fleet is started again and a new trainer incarnation (the next epoch)
   restores C. Whole: every restored episode runs again (accepted as its new attempt).
   The trainer runs in this process, so its own restart (an interpreter and torch) is
   not counted: the restart's time is a lower bound.

Turns recomputed (:func:`~._heal_figures.turns_recomputed`) count, per episode cut back,
the turns it had sealed (at the SIGKILL; for the restart, at the teardown, since the
survivors run on until then) above the one it resumes from.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from turnpoint.apps.bench._heal_figures import (
    REGRESSION_MARGIN,
    TURNS_RATIO_MUST,
    HealFigure,
    RecoveryFigures,
    Way,
    turns_recomputed,
)
from turnpoint.apps.bench._heal_fleet import (
    ENVIRONMENT,
    TOOLS,
    FleetProcess,
    HealBenchError,
    fleet_argv,
    fleet_env,
    fleet_job,
)

if TYPE_CHECKING:
    from turnpoint.trainer import Checkpointing, Launcher, LocalProcessLauncher, Rollout
    from turnpoint.trainer.advanced import RolloutClient
    from turnpoint.trainer.restore.heal import HealPlan

Progress = Callable[[str], None]

# An episode never finishes within a run: only the recovery moves it.
_TARGET: Final = 10**6
_START_TIMEOUT_S: Final = 120.0
_EPISODES_PER_PARTICIPANT: Final = 4


@dataclass(frozen=True, slots=True)
class HealOptions:
    """The fleet and its pace (see the module docstring). ``processes`` host the
    survivors (the victim has its own); ``timeout_s`` bounds each wait."""

    participants: int = 64
    episodes: int = 256
    turn_delay_s: float = 1.0
    warm_turns: int = 1
    advance_turns: int = 2
    lost_after_s: float = 2.0
    processes: int = 2
    timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.participants < 2:
            raise ValueError("participants must be >= 2: the tools server and an agent")
        agents = self.participants - 1
        if self.episodes < agents:
            raise ValueError(
                f"episodes must be >= the {agents} agents, so that the victim holds one"
            )
        if self.warm_turns < 1 or self.advance_turns < 1 or self.processes < 1:
            raise ValueError("warm_turns, advance_turns and processes must be >= 1")
        if not (self.turn_delay_s > 0 and self.lost_after_s > 0 and self.timeout_s > 0):
            raise ValueError("the turn delay, the loss bound and the timeout must be > 0")

    @classmethod
    def sized(cls, participants: int, turn_delay_s: float) -> HealOptions:
        """The full bench's figure: four episodes per participant (256 at 64), and a
        participant silent for two turns (at least 1 s) taken for lost."""
        return cls(
            participants=participants,
            episodes=_EPISODES_PER_PARTICIPANT * participants,
            turn_delay_s=turn_delay_s,
            lost_after_s=max(1.0, 2 * turn_delay_s),
        )

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(f"agent-{index}" for index in range(self.participants - 1))

    @property
    def victim(self) -> str:
        return self.agents[-1]


@dataclass
class _Fleet:
    """The processes of one fleet; the victim's is the launcher's."""

    groups: list[FleetProcess]
    launcher: LocalProcessLauncher | None
    addresses: dict[str, str]

    async def kill_all(self) -> None:
        """SIGKILL every participant process, as the demo's supervisor stops a job."""
        if self.launcher is not None:
            await self.launcher.aclose()
        for group in self.groups:
            await group.kill()


class _NotingLauncher:
    """The fleet's launcher, noting when the trainer first asks for a replacement: the
    moment the heal acts on the loss."""

    def __init__(self, launcher: LocalProcessLauncher) -> None:
        self._launcher = launcher
        self.asked_at: float | None = None

    async def replace(self, instance: str) -> str:
        if self.asked_at is None:
            self.asked_at = time.perf_counter()
        return await self._launcher.replace(instance)


def _shares(names: Sequence[str], processes: int) -> list[list[str]]:
    shares: list[list[str]] = [[] for _ in range(min(processes, max(1, len(names))))]
    for index, name in enumerate(names):
        shares[index % len(shares)].append(name)
    return shares


async def _start_fleet(root: Path, options: HealOptions, token: str) -> _Fleet:
    from turnpoint.trainer import LocalProcessLauncher

    survivors = list(options.agents[:-1])
    shares = _shares(survivors, options.processes)
    first = FleetProcess(
        fleet_job(root, shares[0], turn_delay_s=options.turn_delay_s),
        [TOOLS, *shares[0]],
        token,
    )
    groups = [first]
    fleet = _Fleet(groups, None, {})
    try:
        fleet.addresses.update(await first.start(_START_TIMEOUT_S))
        tools = fleet.addresses[TOOLS]
        for share in shares[1:]:
            job = fleet_job(root, share, turn_delay_s=options.turn_delay_s, tools_address=tools)
            groups.append(FleetProcess(job, share, token))
        victim_job = fleet_job(
            root, [options.victim], turn_delay_s=options.turn_delay_s, tools_address=tools
        )
        launcher = fleet.launcher = LocalProcessLauncher(
            {options.victim: fleet_argv(victim_job)},
            env=fleet_env(token),
            start_timeout_s=_START_TIMEOUT_S,
        )
        started = await asyncio.gather(
            *(group.start(_START_TIMEOUT_S) for group in groups[1:]),
            launcher.start(options.victim),
        )
        for found in started[:-1]:
            assert isinstance(found, dict)
            fleet.addresses.update(found)
        victim_address = started[-1]
        assert isinstance(victim_address, str)
        fleet.addresses[options.victim] = victim_address
    except BaseException:
        await fleet.kill_all()
        raise
    return fleet


def _boundaries(client: RolloutClient) -> dict[str, int]:
    return {r.episode.rollout_id: r.boundaries_seen for r in client.in_flight()}


def _attempts(client: RolloutClient) -> dict[str, int]:
    return {r.episode.rollout_id: r.episode.attempt for r in client.in_flight()}


def _running_again(
    client: RolloutClient, episodes: Iterable[str], attempts: Mapping[str, int]
) -> bool:
    """Every one of ``episodes`` runs again: its agent accepted a later attempt than
    the one in ``attempts`` (the one the SIGKILL or the teardown stopped)."""
    live = _attempts(client)
    return all(live.get(rid, -1) > attempts.get(rid, -1) for rid in episodes)


def _saved_boundaries(root: Path, checkpoint_id: str) -> dict[str, int]:
    """What snapshot ``checkpoint_id`` saved of each episode: its boundaries seen.
    Blocking: reads the manifest."""
    from turnpoint.trainer.advanced import SnapshotLayout

    manifest = SnapshotLayout(root).load(checkpoint_id)
    saved: dict[str, int] = {}
    for raw in manifest.rollout_state.in_flight:
        rollout_id, seen = raw.get("rollout_id"), raw.get("boundaries_seen", 0)
        if isinstance(rollout_id, str) and isinstance(seen, int):
            saved[rollout_id] = seen
    return saved


def _trainer(
    root: Path,
    addresses: Mapping[str, str],
    options: HealOptions,
    token: str,
    *,
    launcher: Launcher | None = None,
    on_lost: Callable[[Exception], None] | None = None,
) -> Checkpointing:
    from turnpoint.trainer import (
        Checkpointing,
        CoordinatorConfig,
        FileAnchorSource,
        RolloutClientSettings,
        file_anchor_loader,
    )

    # The trainer's state does not matter here, only that a restore loads it: a few
    # bytes without torch, so that the measured restart pays for no import.
    return Checkpointing(
        CoordinatorConfig(
            snapshot_root=root,
            control_timeout_s=10.0,
            liveness_interval_s=min(0.25, options.lost_after_s / 4),
            participant_lost_after_s=options.lost_after_s,
        ),
        dict(addresses),
        token=token,
        anchor=FileAnchorSource(step=lambda: 0, state=lambda: b"bench-heal"),
        load_anchor=file_anchor_loader(lambda _state, _step: None),
        periodic=False,
        final_snapshot=False,
        watch_liveness=on_lost is not None,
        on_participant_lost=on_lost,
        launcher=launcher,
        # A dead agent's Runs are re-attached, not given up, until the recovery takes
        # them over: the recovery, not the rollout client, decides their fate.
        rollout_settings=RolloutClientSettings(
            max_concurrency=options.episodes, reattach_attempts=1000
        ),
    )


def _rollouts(options: HealOptions) -> list[Rollout]:
    from turnpoint.trainer import Rollout

    agents = options.agents
    return [
        Rollout(
            rollout_id=f"count-{index}",
            prompt_group_id=f"g-{index}",
            sibling_index=0,
            group_size=1,
            environment=ENVIRONMENT,
            task={"target": _TARGET},
            instance=agents[index % len(agents)],
        )
        for index in range(options.episodes)
    ]


async def _one_way(
    way: Way, root: Path, options: HealOptions, token: str, progress: Progress
) -> RecoveryFigures:
    from turnpoint.trainer import SnapshotOutcome

    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    bound = options.timeout_s
    fleet = await _start_fleet(root, options, token)
    lost = asyncio.Event()
    lost_at: list[float] = []

    def on_lost(_error: Exception) -> None:
        lost_at.append(time.perf_counter())
        lost.set()

    try:
        assert fleet.launcher is not None
        noting = _NotingLauncher(fleet.launcher)
        ckpt = _trainer(
            root,
            fleet.addresses,
            options,
            token,
            launcher=noting if way == "heal" else None,
            on_lost=on_lost,
        )
        async with ckpt:
            client = ckpt.rollouts
            for rollout in _rollouts(options):
                ckpt.dispatch(rollout)

            def all_at(turns: Callable[[str], int]) -> bool:
                seen = _boundaries(client)
                return len(seen) == options.episodes and all(
                    n >= turns(rid) for rid, n in seen.items()
                )

            await client.wait_for(lambda: all_at(lambda _rid: options.warm_turns), bound)
            report = await ckpt.snapshot_now()
            if report.outcome is not SnapshotOutcome.PUBLISHED:
                raise HealBenchError(f"snapshot {report.checkpoint_id} failed: {report.detail}")
            checkpoint_id = report.checkpoint_id
            saved = await asyncio.to_thread(_saved_boundaries, root, checkpoint_id)
            if len(saved) != options.episodes:
                raise HealBenchError(
                    f"{checkpoint_id} saved {len(saved)} of {options.episodes} episodes"
                )
            await client.wait_for(
                lambda: all_at(lambda rid: saved[rid] + options.advance_turns), bound
            )
            reached, attempts = _boundaries(client), _attempts(client)
            progress(f"  {way}: {checkpoint_id} published; SIGKILL of {options.victim}")
            killed = time.perf_counter()
            await fleet.launcher.kill(options.victim)
            if way == "heal":
                healed = await _healed(
                    ckpt, options, checkpoint_id, reached, attempts, killed, lost
                )
                assert noting.asked_at is not None  # the heal asked for its replacement
                return replace(healed, detected_s=noting.asked_at - killed)
            async with asyncio.timeout(bound):
                await lost.wait()
            # The supervisor stops every participant; the survivors ran on until now.
            await fleet.kill_all()
            for rollout_id, seen in _boundaries(client).items():
                reached[rollout_id] = max(reached.get(rollout_id, 0), seen)
    finally:
        await fleet.kill_all()
    progress(f"  restart: {options.participants} participants started again, restoring")
    restarted = await _restarted(
        root, options, token, checkpoint_id, saved, reached, attempts, killed
    )
    return replace(restarted, detected_s=lost_at[0] - killed)


async def _healed(
    ckpt: Checkpointing,
    options: HealOptions,
    checkpoint_id: str,
    reached: Mapping[str, int],
    attempts: Mapping[str, int],
    killed: float,
    failed: asyncio.Event,
) -> RecoveryFigures:
    client = ckpt.rollouts

    def whole() -> bool:
        if not ckpt.heals:
            return False
        return _running_again(client, _resumed_from_heal(ckpt.heals[0]), attempts)

    # The facade reports a loss it could not heal (the heal failed, or another
    # participant was lost): that ends the measurement at once, not at the timeout.
    waits = [
        asyncio.ensure_future(client.wait_for(whole, options.timeout_s)),
        asyncio.ensure_future(failed.wait()),
    ]
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    healed = time.perf_counter()
    if waits[0] not in done:
        raise HealBenchError(f"{options.victim} was not healed in place: the run ended")
    waits[0].result()  # a timeout is raised here
    (plan,) = ckpt.heals
    if plan.checkpoint_id != checkpoint_id:
        raise HealBenchError(f"the heal restored {plan.checkpoint_id}, not {checkpoint_id}")
    resumed_from = _resumed_from_heal(plan)
    return RecoveryFigures(
        "heal",
        episodes_in_flight=options.episodes,
        episodes_cut_back=len(resumed_from),
        turns_recomputed=turns_recomputed(reached, resumed_from),
        time_to_whole_s=healed - killed,
        processes_started=1,
        checkpoint_id=checkpoint_id,
    )


def _resumed_from_heal(plan: HealPlan) -> dict[str, int]:
    resumed = {s.rollout.episode.rollout_id: s.rollout.boundaries_seen for s in plan.continued}
    resumed.update({r.rollout.episode.rollout_id: 0 for r in plan.rerun})
    return resumed


async def _restarted(
    root: Path,
    options: HealOptions,
    token: str,
    checkpoint_id: str,
    saved: Mapping[str, int],
    reached: Mapping[str, int],
    attempts: Mapping[str, int],
    killed: float,
) -> RecoveryFigures:
    fleet = await _start_fleet(root, options, token)
    try:
        async with _trainer(root, fleet.addresses, options, token) as ckpt:
            resumed = ckpt.resumed
            if resumed.checkpoint_id != checkpoint_id:
                raise HealBenchError(f"the restart restored {resumed.checkpoint_id}")
            resumed_from = {rid: saved[rid] for rid in resumed.resumed_rollout_ids}
            for rerun in resumed.rerun_by_instance.values():
                resumed_from.update(dict.fromkeys(rerun, 0))
            client = ckpt.rollouts
            await client.wait_for(
                lambda: _running_again(client, resumed_from, attempts), options.timeout_s
            )
            whole = time.perf_counter()
    finally:
        await fleet.kill_all()
    return RecoveryFigures(
        "restart",
        episodes_in_flight=options.episodes,
        episodes_cut_back=len(resumed_from),
        turns_recomputed=turns_recomputed(reached, resumed_from),
        time_to_whole_s=whole - killed,
        processes_started=len(fleet.groups) + 1,
        checkpoint_id=checkpoint_id,
    )


@contextlib.contextmanager
def _scratch(root: Path | None) -> Iterator[Path]:
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        yield root
        return
    with tempfile.TemporaryDirectory(
        prefix="turnpoint-bench-heal-", ignore_cleanup_errors=True
    ) as scratch:
        yield Path(scratch)


async def measure_heal_in_place(
    options: HealOptions, progress: Progress, root: Path | None = None
) -> HealFigure:
    """Both ways on fresh fleets under ``root`` (a temporary directory if None)."""
    token = secrets.token_hex(24)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    progress(
        f"heal in place vs job restart: {options.participants} participants, "
        f"{options.episodes} episodes, a turn every {options.turn_delay_s:g} s"
    )
    with _scratch(root) as scratch:
        heal = await _one_way("heal", scratch / "heal", options, token, progress)
        progress(f"  heal: whole again after {heal.time_to_whole_s:.2f} s")
        restart = await _one_way("restart", scratch / "restart", options, token, progress)
        progress(f"  restart: whole again after {restart.time_to_whole_s:.2f} s")
    return HealFigure(
        participants=options.participants,
        episodes=options.episodes,
        heal=heal,
        restart=restart,
        turn_delay_s=options.turn_delay_s,
        lost_after_s=options.lost_after_s,
        load_average_1m=None if load is None else round(load, 2),
    )


# ----------------------------------------------------------------------- command


def _progress(message: str) -> None:
    print(f"bench-heal: {message}", file=sys.stderr, flush=True)


def _options(args: argparse.Namespace) -> HealOptions:
    return HealOptions(
        participants=args.participants,
        episodes=args.episodes,
        turn_delay_s=args.turn_delay,
        advance_turns=args.advance_turns,
        lost_after_s=args.lost_after,
        processes=args.processes,
        timeout_s=args.timeout,
    )


def add_heal_arguments(parser: argparse.ArgumentParser) -> None:
    """The full ``turnpoint bench``'s options for this figure."""
    defaults = HealOptions()
    parser.add_argument(
        "--heal-participants",
        type=int,
        default=defaults.participants,
        metavar="N",
        help="heal in place vs job restart: participants, four episodes each (default %(default)s)",
    )
    parser.add_argument(
        "--heal-turn-delay",
        type=float,
        default=defaults.turn_delay_s,
        metavar="SECONDS",
        help="heal in place vs job restart: seconds per turn (default %(default)s)",
    )


def heal_in_place_section(
    args: argparse.Namespace, progress: Progress
) -> tuple[dict[str, Any], str]:
    """The full ``turnpoint bench``'s part, as JSON and as text (its ``regressed`` says
    whether ``--check`` fails on it). Raises ``ValueError`` for options out of range."""
    options = HealOptions.sized(args.heal_participants, args.heal_turn_delay)
    root = None if args.root is None else args.root / "heal-in-place"
    figure = asyncio.run(measure_heal_in_place(options, progress, root))
    return figure.to_json(), "\n".join(figure.lines())


def bench_heal_command(args: argparse.Namespace) -> int:
    try:
        options = _options(args)
    except ValueError as error:
        print(f"turnpoint bench-heal: {error}", file=sys.stderr)
        return 2
    try:
        figure = asyncio.run(measure_heal_in_place(options, _progress, args.root))
    except KeyboardInterrupt:
        print("turnpoint bench-heal: interrupted", file=sys.stderr)
        return 130
    except (HealBenchError, TimeoutError, OSError) as error:
        detail = str(error) or "a bounded wait ran out"
        print(f"turnpoint bench-heal: {type(error).__name__}: {detail}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(figure.to_json(), indent=2))
    else:
        print("\n".join(figure.lines()))
    if args.check and figure.regressed:
        print(
            f"turnpoint bench-heal: turns recomputed heal / restart {figure.turns_ratio} is "
            f"past its must-have {TURNS_RATIO_MUST:g} by {REGRESSION_MARGIN:g}x",
            file=sys.stderr,
        )
        return 1
    return 0


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    defaults = HealOptions()
    parser = sub.add_parser(
        "bench-heal",
        help="one participant SIGKILLed: heal in place vs job restart, turns redone and "
        "time to whole",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--participants", type=int, default=defaults.participants)
    parser.add_argument("--episodes", type=int, default=defaults.episodes)
    parser.add_argument(
        "--turn-delay", type=float, default=defaults.turn_delay_s, help="seconds per turn"
    )
    parser.add_argument(
        "--advance-turns",
        type=int,
        default=defaults.advance_turns,
        help="turns each episode seals after the snapshot, before the SIGKILL",
    )
    parser.add_argument(
        "--lost-after",
        type=float,
        default=defaults.lost_after_s,
        help="seconds of silence before the trainer calls a participant lost",
    )
    parser.add_argument(
        "--processes", type=int, default=defaults.processes, help="processes hosting the fleet"
    )
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout_s, help="seconds each wait may take"
    )
    parser.add_argument("--root", type=Path, help="snapshot roots (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 when turns recomputed heal / restart is past {TURNS_RATIO_MUST:g} by "
        f"{REGRESSION_MARGIN:g}x (a count, not a time: the ratio CI holds)",
    )
    parser.set_defaults(handler=bench_heal_command)
