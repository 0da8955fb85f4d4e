"""The trainer process of ``turnpoint demo``: real RL training that snapshots and restores.

Run by the demo supervisor as ``python -m turnpoint.apps.demo._trainer --topology F
--out DIR --start-on-stdin ...``: spawned while the participants start, so that its
imports (torch) overlap theirs, it reads the topology once the supervisor writes a line
to its stdin. It embeds the coordinator the way any trainer does, through
:class:`~turnpoint.trainer.Checkpointing` (docs/embedding.md), and watches it through
the facade's options (snapshot reports, attempt transitions, metrics, the liveness
watch, the restore report):

- the policy (:func:`~turnpoint.apps.examples._participants.new_policy`) is trained with
  a group-baseline policy-gradient step on the rewards the verifiers return, and every
  step's weights are pushed to the policy server with
  :meth:`~turnpoint.trainer.Checkpointing.push_weights` (rollout deadlines held,
  transient failures retried under the same request ids, the version recorded in each
  snapshot);
- prompt groups come from a deterministic loader (group index ``g`` -> prompt ``g``), half
  of them scored per sibling (``guess``), half group-scored (``guess-group``);
- the facade takes snapshots every ``--snapshot-interval`` seconds while rollouts are in
  flight (with ``--snapshot-blocks``, for ``turnpoint bench``'s on/off throughput, the
  trainer takes them itself in every other pair of blocks of steps);
- it restores the newest usable snapshot first, if the snapshot root holds one (the
  supervisor passes ``--resume`` to every trainer after the first, whose root is
  fresh): the trainer anchor (model, optimizer, step), its queue, loader position and
  attempt ledger, and the unfinished rollouts, which continue as attempt N+1 from their
  saved turns.

Everything the audit needs goes to ``<out>/events.jsonl`` (see ``server/demo``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from turnpoint.apps._heap import freeze_start_up_heap
from turnpoint.apps._parent import die_with_parent_from_env
from turnpoint.apps.demo._fault_window import FAULT_WINDOW, FaultWindows
from turnpoint.apps.demo._heal import PARTICIPANT_LOST_STATUS, SupervisorLauncher
from turnpoint.apps.demo._kill_switch import (
    Fired,
    KillSwitch,
    StatusProbe,
    append_event,
    parse_kill_at,
)
from turnpoint.apps.demo._learner import Sample, policy_gradient_step
from turnpoint.apps.demo._progress import SnapshotStateLog
from turnpoint.apps.examples._participants import GUESS, GUESS_GROUP, new_policy
from turnpoint.apps.examples._task import make_prompt
from turnpoint.storage import StorageError
from turnpoint.trainer import (
    Checkpointing,
    ConfigError,
    CoordinatorConfig,
    CoordinatorMetrics,
    NoUsableSnapshotError,
    ParticipantLostError,
    Resumed,
    Rollout,
    RolloutOutcome,
    RolloutResult,
    SnapshotReport,
    TorchAnchorSource,
    WeightSyncError,
    WeightSyncReport,
    torch_anchor_loader,
)
from turnpoint.trainer.advanced import RolloutClient, SnapshotRunError

# Exit statuses, each with one line on stderr (README.md, "What the demo shows"): 2 the
# topology, token or snapshot root is unusable; 3 the snapshot pump ended the run;
# PARTICIPANT_LOST_STATUS a participant is lost (the supervisor restores the job);
# NO_USABLE_SNAPSHOT_STATUS snapshots were published but none passes its checks;
# WEIGHT_SYNC_STATUS a weight push ran out of retries.
NO_USABLE_SNAPSHOT_STATUS = 5
WEIGHT_SYNC_STATUS = 6
LAUNCH_TIMEOUT_S = 150.0
"""A replacement starts within the supervisor's 120 s per participant (torch imports)."""

_LOG = logging.getLogger("turnpoint.demo.trainer")
LEARNING_RATE = 1e-2


class EventLog:
    """Append-only JSON lines; each line is flushed so a SIGKILL loses at most one."""

    def __init__(self, path: Path, incarnation: int) -> None:
        self._handle = path.open("a", encoding="utf-8")
        self.incarnation = incarnation

    def write(self, kind: str, **fields: Any) -> None:
        entry = {"t": time.time(), "type": kind, "incarnation": self.incarnation, **fields}
        self._handle.write(json.dumps(entry, sort_keys=True) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def _incarnation(path: Path) -> int:
    if not path.exists():
        return 1
    starts = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            starts += json.loads(line).get("type") == "start"
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return starts + 1


def _group_id(group: int) -> str:
    return f"g{group:05d}"


# How long a heal in place takes once the liveness watch found the loss: the replacement
# starting (2 to 5 s on a loaded 2-core machine) and the restore into it.
HEAL_WINDOW_S = 6.0


def failures_allowed(snapshot_interval_s: float, lost_after_s: float) -> int:
    """``max_consecutive_failures`` for the demo: failures in a row must outlast a lost
    participant's whole window (the liveness watch finding it, then its heal, which
    resets the count) and a blip of another link just before it (``--chaos`` holds a link
    up to 1.5 s, and kills a process every few seconds): one attempt per interval over
    that window, one more at its start, and the blip. At the default 3 s: six."""
    window_s = lost_after_s + HEAL_WINDOW_S
    return max(3, math.ceil(window_s / snapshot_interval_s) + 2)


def prompt_of(group: int, cycle: int | None) -> int:
    """The prompt prompt group ``group`` plays: its own, or with ``--prompt-cycle N`` the
    one of ``group`` modulo ``N``, so that every N groups play the same prompts (the
    bench's on/off throughput gives both blocks of a pair the same work, and compares
    only their snapshots)."""
    return group if cycle is None else group % cycle


def snapshots_on_in_block(block: int) -> bool:
    """With ``--snapshot-blocks``: whether block ``block`` takes snapshots. Off, on, on,
    off, then again (ABBA): each pair of blocks (0 and 1, 2 and 3, ...) has one of each
    side, and a machine that speeds up or slows down favours neither side."""
    return block % 4 in (1, 2)


def first_snapshot_phase(block: int) -> float:
    """With ``--snapshot-blocks``: when block ``block``'s first snapshot falls, as a
    fraction of the interval after the block begins. The fractional parts of multiples
    of the golden ratio spread evenly over [0, 1) block after block, so that the
    snapshots do not lock onto one phase of the trainer's pipeline (which begins each
    block by dispatching rollouts whose turns all last alike) in every block."""
    return (block * 0.6180339887498949) % 1.0


async def snapshot_in_blocks(
    snapshot_now: Callable[[], Awaitable[object]],
    steps_done: Callable[[], int],
    stepped: asyncio.Event,
    stop: asyncio.Event,
    *,
    block_steps: int,
    interval_s: float,
) -> None:
    """``--snapshot-blocks``: steps go in blocks of ``block_steps``; in the blocks that
    take snapshots (:func:`snapshots_on_in_block`) one every ``interval_s``, the first
    :func:`first_snapshot_phase` of an interval in (a block of L seconds holds L /
    interval of them on average),
    through ``snapshot_now`` (:meth:`Checkpointing.snapshot_now`, as the facade's timer
    takes them); none in the others. ``stepped`` is set after every step and on ``stop``.
    The bench's on/off throughput compares neighbouring blocks of one run: the same
    processes, seconds apart."""
    loop = asyncio.get_running_loop()
    block = -1
    due: float | None = None
    while not stop.is_set():
        if steps_done() // block_steps != block:
            block = steps_done() // block_steps
            due = (
                loop.time() + interval_s * first_snapshot_phase(block)
                if snapshots_on_in_block(block)
                else None
            )
        stepped.clear()
        if due is None:
            await stepped.wait()
            continue
        try:
            await asyncio.wait_for(stepped.wait(), max(0.0, due - loop.time()))
        except TimeoutError:
            if stop.is_set() or steps_done() // block_steps != block:
                continue  # the block ended as the snapshot fell due: none for it
            await snapshot_now()
            # The next one an interval after this one was due, never in a burst.
            due = max(due + interval_s, loop.time())


class DemoTrainer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        topology = json.loads(Path(args.topology).read_text(encoding="utf-8"))
        self.token = Path(topology["token_file"]).read_text(encoding="utf-8").strip()
        # A directory or a storage URL (docs/spec.md section 8.12).
        self.snapshot_root: str = topology["snapshot_root"]
        self.participants: list[dict[str, str]] = topology["participants"]
        self.out = Path(args.out)
        events = self.out / "events.jsonl"
        incarnation = args.incarnation if args.incarnation is not None else _incarnation(events)
        self.events = EventLog(events, incarnation)
        torch.manual_seed(args.seed)
        self.model = new_policy(args.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LEARNING_RATE)
        self.step = 0
        self.next_group = 0
        # The last step's training figures, recorded in each snapshot's manifest
        # (docs/spec.md section 7.14: restore_from = "best:mean_reward" picks by them).
        self.last_stats: dict[str, float] = {}
        self.resumed: set[str] = set()
        # Test-only fault injection (turnpoint demo --crash-at), set up by run().
        self.kill: KillSwitch | None = None
        self.logged: set[tuple[str, int]] = set()
        self.published = 0
        # Rollouts in flight that the newest snapshot this trainer published cut.
        self.newest_published_cut = 0
        self._heals_logged = 0
        self._healed_at_step: int | None = None
        # The supervisor's timed faults (--fault-windows, _fault_window.py).
        self.fault_windows = FaultWindows(args.fault_windows, args.steps)
        self._ckpt: Checkpointing | None = None  # open, for the windows a report opens
        # Set on every training step (and at the end): the snapshot blocks follow steps.
        self._stepped = asyncio.Event()

    # ------------------------------------------------------------------ set-up

    def _config(self) -> CoordinatorConfig:
        lost_after_s = 6.0
        return CoordinatorConfig.from_mapping(
            {
                "snapshot_root": self.snapshot_root,
                "control_timeout_s": 10.0,
                "prepare_timeout_s": 8.0,
                "snapshot_interval_s": self.args.snapshot_interval,
                "keep_snapshots": 2,
                "target_level": self.args.target_level,
                "max_consecutive_failures": failures_allowed(
                    self.args.snapshot_interval, lost_after_s
                ),
                # Small loopback job: notice a lost participant within seconds.
                "liveness_interval_s": 1.0,
                "participant_lost_after_s": lost_after_s,
                # --max-restarts bounds the heals of each participant too (per hour).
                "max_restarts": self.args.max_restarts,
            }
        )

    def _log_push(self, pushed: WeightSyncReport) -> None:
        """The weight sync, version = training step, is retried through lost replies and
        other transient faults, installed once per version (docs/spec.md section 5.4):
        a push that needed retries is logged."""
        if pushed.retried:
            self.events.write("weights", version=pushed.version, retried=pushed.retried)

    # ------------------------------------------------------------------ rollouts

    def _rollout(self, group: int, sibling: int, agents: Sequence[str]) -> Rollout:
        size = self.args.group_size
        environment = self.args.env
        prompt = prompt_of(group, self.args.prompt_cycle)
        inner = {"seed": _env_seed(self.args.seed, prompt)}
        if environment == GUESS:
            environment = GUESS if group % 2 == 0 else GUESS_GROUP
            inner = make_prompt(prompt, self.args.seed).to_dict()
        group_id = _group_id(group)
        return Rollout(
            rollout_id=f"{group_id}-s{sibling}",
            prompt_group_id=group_id,
            sibling_index=sibling,
            group_size=size,
            environment=environment,
            task={
                "task": inner,
                "environment": environment,
                "prompt_group_id": group_id,
                "sibling_index": sibling,
                "group_size": size,
            },
            instance=agents[(group * size + sibling) % len(agents)],
            budget_s=self.args.rollout_budget,
        )

    def _fill_pipeline(self, ckpt: Checkpointing) -> None:
        total = self.args.steps * self.args.groups_per_step
        trained = self.step * self.args.groups_per_step
        window = self.args.groups_per_step * 2
        size = self.args.group_size
        while self.next_group < total and self.next_group - trained < window:
            for sibling in range(size):
                rollout = self._rollout(self.next_group, sibling, ckpt.agents)
                last = sibling == size - 1  # the loader moves past the group with it
                ckpt.dispatch(
                    rollout, data_loader={"next_group": self.next_group + 1} if last else None
                )
            self.next_group += 1

    def _log_results(self, results: Sequence[RolloutResult]) -> None:
        for result in results:
            key = (result.rollout_id, result.episode.attempt)
            if key in self.logged:
                continue
            self.logged.add(key)
            self.events.write(
                "rollout",
                rollout_id=result.rollout_id,
                attempt=result.episode.attempt,
                group=result.prompt_group_id,
                sibling=result.sibling_index,
                environment=result.environment,
                reward=_reward(result),
                outcome=result.outcome.value,
                resumed=result.rollout_id in self.resumed,
                turns=result.turns,
                # An opaque agent's relay record (the egress audit).
                **({"egress": result.output["egress"]} if "egress" in result.output else {}),
            )
            if self.kill is not None and result.rollout_id in self.resumed:
                # Logged first: a kill event follows the rollout that allowed it.
                self.kill.continuation_seen()

    # ------------------------------------------------------------------ training

    def _train(self, groups: Sequence[Sequence[RolloutResult]]) -> dict[str, Any]:
        samples = []
        for group in groups:
            for result in group:
                output = result.output
                turns = (
                    output.get("turns", []) if result.outcome is RolloutOutcome.COMPLETED else []
                )
                samples.append(
                    Sample(
                        group_id=result.prompt_group_id,
                        turn_prompts=tuple(
                            tuple(int(t) for t in p) for p in output.get("prompts", [])
                        ),
                        turn_completions=tuple(
                            tuple(int(t) for t in turn["completion"]) for turn in turns
                        ),
                        reward=_reward(result),
                    )
                )
        stats = policy_gradient_step(self.model, self.optimizer, samples)
        return {"mean_reward": stats.mean_reward, "loss": stats.loss}

    def _log_heals(self, ckpt: Checkpointing) -> None:
        """A ``heal`` event for each heal not logged yet: what one lost participant cost,
        the rollouts it touched against the ones running at that moment. Called by the
        progress loop and before every training step, so a heal is in the log before
        the step the supervisor's planned crash waits for (the crash may follow at once)."""
        for plan in ckpt.heals[self._heals_logged :]:
            if self._healed_at_step is None:
                self._healed_at_step = self.step
            self.events.write(
                "heal",
                lost=plan.lost.instance,
                participant_kind=plan.lost.kind.value,
                checkpoint_id=plan.checkpoint_id or None,
                continued=len(plan.continued),
                rerun=len(plan.rerun),
                running=plan.touched + len(plan.untouched),
                step=self.step,
            )
        self._heals_logged = len(ckpt.heals)

    async def _progress(self, ckpt: Checkpointing, stop: asyncio.Event) -> None:
        rollouts = ckpt.rollouts
        while not stop.is_set():
            self._log_heals(ckpt)
            self.events.write(
                "progress",
                step=self.step,
                in_flight=len(rollouts.in_flight()),
                published=self.published,
                admission_closed=not rollouts.dispatch_open,
                queue=len(rollouts.results()),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def _watch_results(self, rollouts: RolloutClient, stop: asyncio.Event) -> None:
        """Log each result the moment it arrives (the timeline's throughput)."""
        seen = -1
        while not stop.is_set():
            seen = rollouts.stats().results
            self._log_results(rollouts.results())
            with contextlib.suppress(TimeoutError):
                await rollouts.wait_for(functools.partial(self._news, rollouts, stop, seen), 0.5)

    @staticmethod
    def _news(rollouts: RolloutClient, stop: asyncio.Event, seen: int) -> bool:
        return stop.is_set() or rollouts.stats().results != seen

    def _on_snapshot(self, report: SnapshotReport) -> None:
        outcome = report.outcome.value
        if outcome == "published":
            self.published += 1
            self.newest_published_cut = report.continued + report.restarts
        end = time.time()
        self.events.write(
            "snapshot",
            checkpoint_id=report.checkpoint_id,
            outcome=outcome,
            reason=report.reason.value if report.reason is not None else None,
            t_start=end - report.total_s,
            t_end=end,
            admission_closed_s=report.admission_closed_s,
            phases={phase.value: seconds for phase, seconds in report.phases.items()},
            continued=report.continued,
            restarts=report.restarts,
        )
        if self._ckpt is not None:
            # Mid-wave too: a pipeline that drains between waves may have none in flight
            # before any step, while a snapshot that just cut some finds them running.
            self._hold_fault_window(self._ckpt)

    def _participant_lost(self, error: ParticipantLostError) -> None:
        """The facade's liveness watch found a participant gone: this incarnation is
        abandoned, and the supervisor restores the job onto fresh participants from the
        last published snapshot, exactly as after a crash (spec section 7.11). Exit now
        rather than wind down calls to a participant that is gone (an abort would wait
        out its resume attempts against the lost participant)."""
        print(f"trainer: {error}", file=sys.stderr, flush=True)
        self.events.close()
        os._exit(PARTICIPANT_LOST_STATUS)

    def _record_kill(self, fired: Fired) -> None:
        # Also called from the publishing thread: one O_APPEND write, not self.events.
        event = {"t": time.time(), "type": "kill", "incarnation": self.events.incarnation}
        append_event(self.out / "events.jsonl", event | fired.event())

    # ------------------------------------------------------------------ the run

    async def run(self) -> int:
        config = self._config()
        endpoints = {p["instance"]: p["address"] for p in self.participants}
        metrics = CoordinatorMetrics(_registry())
        kill = None
        if self.args.kill_at is not None:
            # Test-only fault injection (turnpoint demo --crash-at).
            kill = self.kill = KillSwitch(
                self.args.kill_at,
                probe=StatusProbe(endpoints, token=self.token),
                on_fire=self._record_kill,
                # A restored trainer dies only once its restore shows (_start, _log_results).
                restored=self.args.resume,
            )
        checkpointing = Checkpointing(
            config,
            endpoints,
            token=self.token,
            anchor=TorchAnchorSource(
                self.model,
                self.optimizer,
                step=lambda: self.step,
                data_loader=lambda: {"next_group": self.next_group},
                # On a storage URL (--storage s3) the anchor goes onto the store through
                # DCP's fsspec writer; nothing is staged on this machine (spec 8.13.1).
                storage=self.snapshot_root if "://" in self.snapshot_root else None,
            ),
            load_anchor=torch_anchor_loader(self.model, self.optimizer),
            # The fresh policy servers get the trainer's (restored) weights on open.
            weights=self.model.state_bytes,
            metrics=metrics,
            on_snapshot=self._on_snapshot,
            on_transition=SnapshotStateLog(self.events.write),
            watch_liveness=True,
            on_participant_lost=self._participant_lost,
            # The supervisor starts every participant fresh before each restore; what
            # can still fail it is a --chaos fault that lands during the restore, and
            # the demo then reruns the saved rollouts rather than spend a job restart.
            allow_degraded_restore=True,
            testing_hooks=kill,
            # The status page, its API and /metrics on one port (docs/spec.md 7.13).
            status_port=self.args.metrics_port,
            # The supervisor holds the port reserved with SO_REUSEPORT for the whole run.
            status_reuse_port=True,
            snapshot_metrics=lambda: dict(self.last_stats),
            # --snapshot-blocks: the trainer takes them itself, in its on blocks.
            periodic=self.args.snapshot_blocks is None,
            # The supervisor replaces a lost participant under its name, and only what
            # depended on it goes back to the last snapshot (docs/spec.md section 7.15).
            launcher=SupervisorLauncher(self.args.launcher, self.token, timeout_s=LAUNCH_TIMEOUT_S)
            if self.args.launcher is not None
            else None,
        )
        try:
            async with checkpointing as ckpt:
                if ckpt.status_address is not None:
                    print(f"status: {ckpt.status_address}", flush=True)
                self._start(ckpt)
                self._ckpt = ckpt
                # The job is set up (torch, the model, the restore): the collector need
                # never walk that heap again, in a snapshot's prepare least of all
                # (docs/embedding.md, the process's garbage collector).
                freeze_start_up_heap()
                stop = asyncio.Event()
                background = [
                    asyncio.create_task(self._progress(ckpt, stop)),
                    asyncio.create_task(self._watch_results(ckpt.rollouts, stop)),
                ]
                blocks = None
                if self.args.snapshot_blocks is not None:
                    blocks = asyncio.create_task(self._snapshot_in_blocks(ckpt, stop))
                try:
                    await self._train_loop(ckpt, blocks)
                except BaseException:
                    for task in background:
                        task.cancel()
                    raise
                finally:
                    stop.set()
                    self._stepped.set()
                    if blocks is not None:
                        # A snapshot under way finishes, as the facade's own timer's does.
                        await asyncio.gather(blocks, return_exceptions=True)
                    await asyncio.gather(*background, return_exceptions=True)
            # Closed: the snapshot under way at the end was finished first.
        finally:
            if kill is not None:
                await kill.aclose()
        self.events.write("done", step=self.step)
        return 0

    def _start(self, ckpt: Checkpointing) -> None:
        """Log what :meth:`Checkpointing.open` did: the restore, the start, the push."""
        resumed = ckpt.resumed
        if resumed.restored:
            self._adopt(resumed)
        if self.kill is not None and not self.resumed:
            self.kill.continuation_seen()  # nothing resumed: nothing to wait for
        self.events.write(
            "start",
            restored_from=resumed.checkpoint_id,
            step=self.step,
            coordinator_epoch=ckpt.coordinator.identity.epoch,
        )
        if resumed.weights_pushed is not None:
            self._log_push(resumed.weights_pushed)

    def _adopt(self, resumed: Resumed) -> None:
        self.step = resumed.step
        loader = resumed.data_loader
        position = loader.get("next_group", 0) if isinstance(loader, Mapping) else 0
        self.next_group = position if isinstance(position, int) else 0
        self.resumed = set(resumed.resumed_rollout_ids)
        self.events.write(
            "restore",
            checkpoint_id=resumed.checkpoint_id,
            resumed_from_turn=resumed.resumed_rollouts,
            rerun_from_prompt=resumed.rerun_rollouts,
            groups_retried_whole=resumed.groups_retried_whole,
            seconds=resumed.restore_s,
            by_instance=_restored_by_instance(resumed),
        )

    async def _snapshot_in_blocks(self, ckpt: Checkpointing, stop: asyncio.Event) -> None:
        await snapshot_in_blocks(
            ckpt.snapshot_now,
            lambda: self.step,
            self._stepped,
            stop,
            block_steps=self.args.snapshot_blocks,
            interval_s=self.args.snapshot_interval,
        )

    async def _train_loop(self, ckpt: Checkpointing, blocks: asyncio.Task[None] | None) -> None:
        per_step = self.args.groups_per_step
        while self.step < self.args.steps:
            if blocks is not None and blocks.done():
                # The snapshots of the blocks ended (the pump gave up): so does the run.
                blocks.result()
                raise RuntimeError("the snapshot blocks ended before the run")
            self._fill_pipeline(ckpt)
            self._hold_fault_window(ckpt)
            # Raises what ended the run: the pump giving up, a lost participant.
            if not await ckpt.wait_groups(per_step, timeout_s=1.0):
                continue
            async with ckpt.step_lock:
                groups = ckpt.take_ready_groups(per_step)
                self._log_results([r for group in groups for r in group])
                stats = await asyncio.to_thread(self._train, groups)
                self.last_stats = {name: float(value) for name, value in stats.items()}
                self.step += 1
                self._stepped.set()
                state = await asyncio.to_thread(self.model.state_bytes)
            self._log_heals(ckpt)
            self.events.write(
                "train_step",
                step=self.step,
                groups=[group[0].prompt_group_id for group in groups],
                rollouts=[
                    {
                        "rollout_id": r.rollout_id,
                        "attempt": r.episode.attempt,
                        "reward": _reward(r),
                        "turns": _trained_turns(r),
                    }
                    for group in groups
                    for r in group
                ],
                mean_reward=stats["mean_reward"],
                **self._block_of(self.step),
            )
            # No await since the step lock: push_weights names this version before it
            # yields, so a snapshot's anchor holds these weights and records this
            # version with them, pushed or not yet.
            self._log_push(await ckpt.push_weights(_next_version(ckpt, self.step), state))

    def _hold_fault_window(self, ckpt: Checkpointing) -> None:
        """``--fault-windows``: at a window of the supervisor's timed fault, log it and
        stop until the supervisor's ``go`` (:mod:`turnpoint.apps.demo._fault_window`).
        The wait blocks the event loop on purpose: nothing of this trainer moves (no
        step, snapshot or dispatch) while the fault lands."""
        if not self.fault_windows.pending:
            return  # no count of the rollouts in flight at every step for nothing
        in_flight = len(ckpt.rollouts.in_flight())
        window = self.fault_windows.due(
            step=self.step,
            in_flight=in_flight,
            newest_published_cut=self.newest_published_cut,
            healed_at_step=self._healed_at_step,
        )
        if window is None:
            return
        self.events.write(
            FAULT_WINDOW,
            n=window,
            step=self.step,
            in_flight=in_flight,
            newest_published_cut=self.newest_published_cut,
        )
        # An empty line: the supervisor is gone (and takes this process with it).
        sys.stdin.readline()

    def _block_of(self, step: int) -> dict[str, Any]:
        """With ``--snapshot-blocks``: the block step ``step`` was trained in, and its side."""
        size = self.args.snapshot_blocks
        if size is None:
            return {}
        block = (step - 1) // size
        return {"block": block, "snapshots_on": snapshots_on_in_block(block)}


def _next_version(ckpt: Checkpointing, step: int) -> int:
    """The step, unless a policy server that outlived the last trainer holds a newer
    version: the restored trainer pushed above it (docs/spec.md section 4.16, weights),
    and versions never go down."""
    current = ckpt.weights_version
    return step if current is None or step > current else current + 1


def _env_seed(seed: int, group: int) -> int:
    """The task seed of prompt group ``group``: every sibling of a group plays the same
    shoe or the same tables, each group another one."""
    return seed * 1_000_003 + group


def _trained_turns(result: RolloutResult) -> list[dict[str, Any]]:
    """What training took from one rollout: each turn's prompt and completion, as
    :meth:`DemoTrainer._train` reads them (the demo's token audit), with the tool's reply
    and the attempt that got it (the audit of tool calls)."""
    if result.outcome is not RolloutOutcome.COMPLETED:
        return []
    output = result.output
    prompts = output.get("prompts", [])
    answered = output.get("answered_in", [])
    trained = []
    for index, (prompt, turn) in enumerate(zip(prompts, output.get("turns", []), strict=False)):
        entry: dict[str, Any] = {
            "prompt": [int(t) for t in prompt],
            "completion": [int(t) for t in turn["completion"]],
        }
        if isinstance(turn.get("reply"), str):  # the tool's reply as its log shows it
            entry["reply"] = turn["reply"]
        if index < len(answered):
            entry["answered_in"] = int(answered[index])
        trained.append(entry)
    return trained


def _restored_by_instance(resumed: Resumed) -> dict[str, dict[str, int]]:
    """Per agent instance that held them at the cut, the unfinished rollouts that resume
    from a saved turn and those that rerun from the prompt (not accepted at the cut:
    under the empty name)."""
    counts: dict[str, dict[str, int]] = {}
    for instance, ids in resumed.resumed_by_instance.items():
        counts.setdefault(instance, {"resumed": 0, "rerun": 0})["resumed"] += len(ids)
    for instance, ids in resumed.rerun_by_instance.items():
        counts.setdefault(instance, {"resumed": 0, "rerun": 0})["rerun"] += len(ids)
    return counts


def _reward(result: RolloutResult) -> float:
    if result.outcome is not RolloutOutcome.COMPLETED:
        return 0.0
    return float(result.output.get("reward", 0.0))


def _registry() -> Any:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


def _count_of(what: str) -> Callable[[str], int]:
    """An argparse type: a whole number of ``what``, at least one."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {what}, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected {what} >= 1, got {value}")
        return value

    return count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m turnpoint.apps.demo._trainer")
    parser.add_argument("--topology", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--snapshot-interval", type=float, default=3.0)
    parser.add_argument(
        "--snapshot-blocks",
        type=_count_of("steps"),
        default=None,
        metavar="STEPS",
        help="the bench's on/off throughput: steps in blocks of STEPS, snapshots every "
        "--snapshot-interval in blocks 1 and 2 of every four (off, on, on, off), none in "
        "the others; each train_step event names its block",
    )
    parser.add_argument(
        "--prompt-cycle",
        type=_count_of("groups"),
        default=None,
        metavar="GROUPS",
        help="the bench's on/off throughput: prompt group g plays the prompt of g modulo "
        "GROUPS, so that every block of GROUPS groups plays the same prompts",
    )
    parser.add_argument(
        "--target-level", default="turn", choices=["token", "turn", "sibling", "prompt_group"]
    )
    parser.add_argument("--rollout-budget", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env", default=GUESS, choices=[GUESS, "blackjack", "workplace", "coding"])
    parser.add_argument(
        "--resume",
        action="store_true",
        help="a restart of the job: the trainer restores whenever the snapshot root holds "
        "a published snapshot, and the first trainer's root is fresh",
    )
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="heals in place of one participant allowed per hour (the demo's --max-restarts)",
    )
    parser.add_argument(
        "--incarnation",
        type=int,
        default=None,
        metavar="N",
        help="this trainer's incarnation, numbered by the supervisor (default: one more "
        "than the starts logged in <out>/events.jsonl)",
    )
    parser.add_argument(
        "--launcher",
        default=None,
        metavar="HOST:PORT",
        help="the supervisor's launch service: lost participants are replaced in place",
    )
    parser.add_argument(
        "--start-on-stdin",
        action="store_true",
        help="import, then wait for a line on stdin before reading anything of the run: the "
        "supervisor spawns the trainer while the participants start and writes that line "
        "once the topology is written",
    )
    parser.add_argument(
        "--fault-windows",
        type=int,
        default=0,
        metavar="N",
        help="the supervisor's timed faults: at each of the first N windows (see "
        "turnpoint.apps.demo._fault_window) log a fault_window event and stop until a "
        "line on stdin",
    )
    parser.add_argument(
        "--kill-at",
        type=parse_kill_at,
        metavar="POINT[:N]",
        help="test-only fault injection: SIGKILL this process at POINT of the N-th snapshot",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The supervisor's child in a process group of its own: it dies with it.
    die_with_parent_from_env()
    if args.start_on_stdin and not sys.stdin.readline():
        # The supervisor went away before the participants were up: nothing to run.
        print("trainer: not started: stdin closed before the start line", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=os.environ.get("TURNPOINT_LOG", "WARNING"),
        format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(1)
    try:
        trainer = DemoTrainer(args)
    except (OSError, ValueError, KeyError) as error:
        # A topology, token or out directory it cannot use: say which, no traceback.
        print(f"trainer: cannot start: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(trainer.run())
    except (OSError, ConfigError, StorageError) as error:
        # The snapshot root cannot be written or read (a file in its place, no
        # permission, a full disk at start-up, a store that refuses us): one line that
        # says which, no traceback.
        print(
            f"trainer: the snapshot root {trainer.snapshot_root} is unusable: {error}",
            file=sys.stderr,
        )
        return 2
    except SnapshotRunError as error:
        print(f"trainer: the snapshot pump ended the run: {error}", file=sys.stderr)
        return 3
    except ParticipantLostError as error:
        print(f"trainer: {error}", file=sys.stderr)
        return PARTICIPANT_LOST_STATUS
    except NoUsableSnapshotError as error:
        # Snapshots exist but none passes its checks: starting over would lose the run.
        print(f"trainer: cannot restore: {error}", file=sys.stderr)
        return NO_USABLE_SNAPSHOT_STATUS
    except WeightSyncError as error:
        print(f"trainer: the weight sync failed: {error}", file=sys.stderr)
        return WEIGHT_SYNC_STATUS
    finally:
        trainer.events.close()


if __name__ == "__main__":
    sys.exit(main())
