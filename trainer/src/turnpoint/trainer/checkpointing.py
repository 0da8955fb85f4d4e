"""The facade a training loop embeds: open, restore, dispatch, train, snapshot, close.

:class:`Checkpointing` is the one way to assemble a trainer (the demo trainer and the
embedded example are built on it). It composes :class:`Coordinator` (epoch,
discovery), :class:`RolloutClient`, :class:`SnapshotDriver` and :class:`SnapshotPump`
(the failure policy), :class:`Restorer` with :func:`apply_plan`, :class:`WeightSync`
and the liveness watch. It adds a snapshot
policy (every N steps, every T seconds), the weight sync's bookkeeping (the version of
the trainer's weights is recorded in each snapshot and pushed again after a restore,
docs/spec.md section 6.11) and a preemption handler: on SIGTERM one final snapshot
within a deadline, then :class:`Preempted`, which exits the process with status 0.

What a trainer watches goes through options of the facade, never around it: each
snapshot's report (``on_snapshot``), each attempt's transitions (``on_transition``),
the coordinator's metrics (``metrics``), the liveness watch (``watch_liveness``,
``on_participant_lost``) and what a restore did (:class:`Resumed`). The demo trainer is
built on it; the hooks of its deterministic crashes come from
:mod:`turnpoint.trainer.testing` (``testing_hooks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Final, Self

from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.protocol import ParticipantKind
from turnpoint.trainer.anchors.source import AnchorSource
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.control.coordinator import Coordinator
from turnpoint.trainer.control.identity import bump_epoch
from turnpoint.trainer.control.liveness import ParticipantLostError, watch_liveness
from turnpoint.trainer.control.outcomes import ControlReport, OperationFailed, RestoreFailed
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.restore.choice import METRICS_KEY
from turnpoint.trainer.restore.heal import HealPlan, Member, plan_heal, restore_id_for
from turnpoint.trainer.restore.launcher import Launcher
from turnpoint.trainer.restore.restarts import RestartBudget
from turnpoint.trainer.restore.restorer import AnchorLoader, RestorePlan, Restorer, apply_plan
from turnpoint.trainer.rollouts.client import AgentEndpoint, RolloutClient
from turnpoint.trainer.rollouts.values import Rollout, RolloutClientSettings, RolloutResult
from turnpoint.trainer.snapshots.attempt import SnapshotState
from turnpoint.trainer.snapshots.driver import SnapshotDriver, TransitionCallback
from turnpoint.trainer.snapshots.pump import SnapshotPump
from turnpoint.trainer.snapshots.report import SnapshotOutcome, SnapshotReport
from turnpoint.trainer.status.history import HISTORY_FILE, CheckpointHistory
from turnpoint.trainer.status.log import HistoryLog, read_history
from turnpoint.trainer.storage.layout import SnapshotLayout
from turnpoint.trainer.storage.manifest import JSONValue, SnapshotManifest
from turnpoint.trainer.storage.objects import StoreLayout, open_layout
from turnpoint.trainer.weights.core import WeightSyncSettings
from turnpoint.trainer.weights.sync import WeightSync, WeightSyncReport

if TYPE_CHECKING:
    from turnpoint.trainer.metrics import CoordinatorMetrics
    from turnpoint.trainer.snapshots.hooks import SnapshotHooks
    from turnpoint.trainer.status.server import StatusServer

_LOG = logging.getLogger(__name__)
_WAKE_S = 0.25

Participants = (
    Mapping[str, str] | Callable[[], Mapping[str, str]] | Callable[[], Awaitable[Mapping[str, str]]]
)
"""Instance name -> control address, or a discovery callable returning that mapping."""


class Preempted(SystemExit):
    """The process was told to stop (SIGTERM) and its final snapshot is settled.

    A :class:`SystemExit` with status 0: let it propagate and the process exits 0;
    ``except Exception`` in the loop does not swallow it. ``report`` is the final
    snapshot's report (``None`` if it did not finish within the deadline).
    """

    def __init__(self, report: SnapshotReport | None) -> None:
        super().__init__(0)
        self.report = report


@dataclass(frozen=True, slots=True)
class Resumed:
    """What :meth:`Checkpointing.open` found: a fresh start or a restored snapshot.

    The unfinished rollouts of a restored snapshot are already redispatched (resumed
    from their saved turns or rerun from their prompts); the trainer only continues
    from ``step`` and ``data_loader``. ``weights_version`` is the version of the
    trainer's weights the snapshot recorded (``None``: a fresh start, or a snapshot
    taken before any weights were pushed).

    What the restore did, for a trainer's log: ``resumed_by_instance`` names, per agent
    instance that saved them, the rollouts that continue from a saved turn;
    ``rerun_by_instance``, per agent instance that held them at the cut (``""`` for
    those still waiting at the trainer's gate), the rollouts that start over from their
    prompts; ``groups_retried_whole`` counts the prompt groups rerun whole;
    ``restore_s`` is how long the restore took. ``weights_pushed`` is the report of the
    push :meth:`Checkpointing.open` made (``None`` without a ``weights`` callable).
    """

    step: int
    checkpoint_id: str | None = None
    data_loader: JSONValue = None
    resumed_rollouts: int = 0
    rerun_rollouts: int = 0
    weights_version: int | None = None
    groups_retried_whole: int = 0
    restore_s: float = 0.0
    resumed_by_instance: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    rerun_by_instance: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    weights_pushed: WeightSyncReport | None = None

    @property
    def restored(self) -> bool:
        return self.checkpoint_id is not None

    @property
    def resumed_rollout_ids(self) -> frozenset[str]:
        """The rollouts that continue from a saved turn (as attempt N+1)."""
        return frozenset(r for ids in self.resumed_by_instance.values() for r in ids)


def _by_instance(pairs: list[tuple[str, str]]) -> Mapping[str, tuple[str, ...]]:
    grouped: dict[str, list[str]] = {}
    for instance, rollout_id in pairs:
        grouped.setdefault(instance, []).append(rollout_id)
    return MappingProxyType({name: tuple(ids) for name, ids in grouped.items()})


def _incarnations(coordinator: Coordinator) -> dict[str, str]:
    """Each participant's incarnation as the coordinator last described it: the one a
    restore or heal installed its continued attempts into, which their Runs name
    (docs/spec.md section 6.5 item 5)."""
    return {name: p.incarnation for name, p in coordinator.topology.participants.items()}


def _resumed_from(plan: RestorePlan, *, weights_version: int | None, restore_s: float) -> Resumed:
    return Resumed(
        step=plan.step,
        checkpoint_id=plan.checkpoint_id,
        data_loader=plan.trainer_state.data_loader,
        resumed_rollouts=plan.resumed,
        rerun_rollouts=plan.rerun_count,
        weights_version=weights_version,
        groups_retried_whole=plan.groups_retried_whole,
        restore_s=restore_s,
        resumed_by_instance=_by_instance(
            [(action.instance, action.rollout.episode.rollout_id) for action in plan.redispatch]
        ),
        rerun_by_instance=_by_instance(
            [(rerun.rollout.instance, rerun.rollout.episode.rollout_id) for rerun in plan.rerun]
        ),
    )


class HealRefusedError(CoordinatorError):
    """``instance`` was replaced too often to be healed again (``detail`` says how
    often, in which window): the run ends with this reason (docs/spec.md 7.15 item 11)."""

    def __init__(self, instance: str, detail: str) -> None:
        super().__init__(Reason.UNAVAILABLE, detail, {"participant": instance})
        self.instance = instance
        self.detail = detail

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.instance, self.detail))


# Re-attaches of a broken attempt before it is rerun, healing in place: with the backoff
# capped at 2 s, about a minute, time for the liveness watch and the launcher.
HEAL_REATTACH_ATTEMPTS: Final = 30
# A heal's retire on the live participants is tried again after these pauses while its
# failures are transient (a link that dropped for a moment), before the job restarts.
HEAL_RETRY_PAUSES_S: Final = (0.5, 1.0, 2.0)


async def retire_for_heal(
    retire: Callable[..., Awaitable[ControlReport]],
    episodes: Mapping[str, Sequence[EpisodeId]],
    *,
    key: str,
    pauses_s: Sequence[float] = HEAL_RETRY_PAUSES_S,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> ControlReport:
    """A heal's retire (``Coordinator.retire``) of ``episodes``, sent again to the
    participants that failed after each of ``pauses_s`` while every failure is
    retryable: a live participant's link may drop for a moment. The same ``key`` re-sends
    the same request ids, so a retire that got through is joined, not repeated."""
    report = await retire(episodes, key=key)
    for pause_s in pauses_s:
        if not report.failures or not all(f.retryable for f in report.failures.values()):
            break
        await sleep(pause_s)
        report = await retire({name: episodes[name] for name in report.failures}, key=key)
    return report


class Checkpointing:
    """A coordinator a training loop embeds in a few lines.

    ``token`` is the participants' control credential (docs/spec.md section 10.2): it
    opens their data plane too, so the rollouts and weight pushes use it as well. Where
    the participants also hold a data-plane token, that one is the agents' and never
    reaches here.

    ``anchor`` writes the trainer's state into each snapshot and ``load_anchor`` reads it
    back on restore (:class:`TorchAnchorSource` and :func:`torch_anchor_loader` over a
    torch model and optimizer). ``every_steps`` snapshots from :meth:`step_done`; the
    config's ``snapshot_interval_s`` (when ``periodic``) snapshots on a timer. Train each
    step under :attr:`step_lock` so that no snapshot cuts a step in half, and call
    :meth:`step_done` after releasing it.

    ``weights``, if given, serialises the trainer's current weights (blocking: it runs
    in a thread) for the policy servers: :meth:`open` pushes them once the restore is
    done (at the restored snapshot's weights version, else ``initial_weights_version``;
    above the newest version a policy server that kept running holds, if it holds a
    newer one: :attr:`weights_version` says where the trainer stands, and later pushes
    go above it), and :meth:`push_weights` without ``state`` uses it. ``weight_sync`` bounds the
    retries of each push.

    Watching (all optional): ``on_snapshot(report)`` after every snapshot, whoever
    asked for it; ``on_transition(attempt id, old state, new state, now)`` on every
    transition of every attempt (quick, non-blocking: it runs inside the snapshot; the
    id is the checkpoint id, which the next attempt reuses while no participant saw it,
    so each attempt begins with its move out of ``NEW``);
    ``metrics`` (a :class:`CoordinatorMetrics`) fed by the coordinator, the restore and
    every snapshot. ``watch_liveness`` probes the participants every
    ``config.liveness_interval_s`` and ends the run with :class:`ParticipantLostError`
    (raised from :meth:`wait_groups`, :meth:`step_done` and :meth:`dispatch`) once one
    is silent for ``config.participant_lost_after_s``; ``on_participant_lost(error)`` is
    called first, at once (a process that exits there skips winding down calls to a
    participant that is gone). With a ``launcher`` the watch heals a lost participant in
    place instead (:meth:`heal`, docs/spec.md section 7.15) and ends the run only when
    the heal fails; without ``rollout_settings`` the rollout client then re-attaches
    :data:`HEAL_REATTACH_ATTEMPTS` times (about a minute) before it reruns an attempt
    from its prompt, so that the heal continues it. ``testing_hooks`` is for tests and the demo's
    deterministic crashes only (:class:`turnpoint.trainer.testing.SnapshotHooks`).

    Failing fast: :meth:`open` raises :class:`RestoreRefusedError` when a participant
    refuses or fails the restore (most often: it is not fresh and does not serve
    RestoreRunning, docs/spec.md section 4.16, and the trainer restarted alone);
    ``allow_degraded_restore`` starts instead, every saved rollout over from its prompt.
    Participants that serve RestoreRunning are restored where they run. :meth:`dispatch` refuses a rollout for an unknown agent or environment.
    Leaving cleanly takes a final snapshot (``final_snapshot``, on by default).

    Seeing the job (docs/spec.md sections 7.13 and 7.14): :attr:`history` keeps every
    attempt of this run (phases, per-participant times, sizes, failures, the restore).
    ``status_port`` (0: a free one) serves the status page, its REST API and, with
    ``metrics``, ``/metrics`` on ``status_host``; :attr:`status_address` is its address
    once :meth:`open` has started it (it needs aiohttp, ``turnpoint-trainer[status]``).
    ``status_reuse_port`` binds it with ``SO_REUSEPORT``: a job that holds the port
    reserved (a socket bound with it that never listens) keeps the page's address across
    trainer restarts, and no other process can take the port meanwhile.
    ``snapshot_metrics``, if given, is read with the anchor and recorded in each
    snapshot's manifest (``extra["metrics"]``): ``config.restore_from = "best:<name>"``
    restores the best snapshot by one of them.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        participants: Participants,
        *,
        token: str,
        anchor: AnchorSource,
        load_anchor: AnchorLoader,
        every_steps: int | None = None,
        periodic: bool = True,
        rollout_settings: RolloutClientSettings | None = None,
        weights: Callable[[], bytes] | None = None,
        initial_weights_version: int = 0,
        weight_sync: WeightSyncSettings | None = None,
        metrics: CoordinatorMetrics | None = None,
        on_snapshot: Callable[[SnapshotReport], None] | None = None,
        on_transition: TransitionCallback | None = None,
        watch_liveness: bool = False,
        on_participant_lost: Callable[[ParticipantLostError], None] | None = None,
        allow_degraded_restore: bool = False,
        final_snapshot: bool = True,
        testing_hooks: SnapshotHooks | None = None,
        status_port: int | None = None,
        status_host: str = "127.0.0.1",
        status_reuse_port: bool = False,
        snapshot_metrics: Callable[[], Mapping[str, float]] | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.config = config
        self._launcher = launcher
        self._layout: SnapshotLayout | StoreLayout | None = None
        self._heal_count = 0
        self._heal_budgets: dict[str, RestartBudget] = {}
        self.heals: list[HealPlan] = []
        self._status_port = status_port
        self._status_host = status_host
        self._status_reuse_port = status_reuse_port
        self._snapshot_metrics = snapshot_metrics
        self._status: StatusServer | None = None
        self.history = CheckpointHistory(wall_offset_s=time.time() - time.monotonic())
        self._history_log: HistoryLog | None = None
        self._participants = participants
        self._token = token
        self._anchor = anchor
        self._load_anchor = load_anchor
        self._every_steps = every_steps
        self._periodic = periodic
        if rollout_settings is None:
            rollout_settings = RolloutClientSettings(max_concurrency=256)
            if launcher is not None:
                # Healing in place, the heal decides what becomes of a lost participant's
                # attempts (continued from the snapshot): re-attach long enough for the
                # liveness watch to find the loss and the launcher to replace it, rather
                # than rerun each from its prompt (docs/spec.md 7.15 item 9).
                rollout_settings = replace(
                    rollout_settings, reattach_attempts=HEAL_REATTACH_ATTEMPTS
                )
        self._rollout_settings = rollout_settings
        self._weights = weights
        self._initial_weights_version = initial_weights_version
        self._weight_sync_settings = weight_sync
        self._weight_sync: WeightSync | None = None
        self._metrics = metrics
        self._on_snapshot = on_snapshot
        self._on_transition = on_transition
        self._watch_liveness = watch_liveness
        self._on_participant_lost = on_participant_lost
        self._allow_degraded_restore = allow_degraded_restore
        self._final_snapshot = final_snapshot
        self._testing_hooks = testing_hooks
        self.step_lock = asyncio.Lock()
        self._snapshot_lock = asyncio.Lock()
        self._stack = contextlib.AsyncExitStack()
        self._coordinator: Coordinator | None = None
        self._rollouts: RolloutClient | None = None
        self._pump: SnapshotPump | None = None
        self._background: list[asyncio.Task[None]] = []
        self._ticker: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._preempted = asyncio.Event()
        self._final: SnapshotReport | None = None
        self.reports: list[SnapshotReport] = []
        self.resumed = Resumed(step=anchor.step)

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> Resumed:
        """Bump the epoch, discover, restore the newest usable snapshot if any."""
        try:
            return await self._open()
        except BaseException:
            await self._close(finish_snapshot=False)
            raise

    async def _open(self) -> Resumed:
        config = self.config
        root = config.snapshot_root
        identity = await asyncio.to_thread(bump_epoch, root)
        self.history.epoch = identity.epoch
        hooks = self._testing_hooks
        layout = await asyncio.to_thread(
            open_layout, root, after_step=hooks.after_publish_step if hooks else None
        )
        self._layout = layout
        if isinstance(layout, StoreLayout):
            self._stack.callback(layout.close)
        else:
            # Earlier processes' attempts and restores, then this one's appended after
            # them (a local or mounted root; on an object store the history is this
            # process's own, docs/spec.md section 7.13.5).
            history_path = layout.root / HISTORY_FILE
            self.history.load_past(await asyncio.to_thread(read_history, history_path))
            log = self._history_log = HistoryLog(history_path)
            log.start()
            self._stack.push_async_callback(log.aclose)
        if self._status_port is not None:
            await self._start_status(layout)
        endpoints = await self._endpoints()
        coordinator = await self._stack.enter_async_context(
            Coordinator(
                endpoints,
                token=self._token,
                coordinator_id=identity.coordinator_id,
                epoch=identity.epoch,
                config=config,
                metrics=self._metrics,
            )
        )
        self._coordinator = coordinator
        coordinator.watch(self.history)
        if self._status is not None:
            self._status.api.sources.coordinator = coordinator
        topology = await coordinator.discover()
        # The coordinator's endpoints, not the ones given: a worker group is replaced by
        # its workers at discovery, each an agent of its own (docs/spec.md section 3.9).
        agents = {
            name: AgentEndpoint(coordinator.endpoints[name], token=self._token)
            for name in topology.agents
        }
        rollouts = await self._stack.enter_async_context(
            RolloutClient(
                agents,
                # Every Run carries the config's weights_change (docs/spec.md 5.5 item 7).
                settings=replace(self._rollout_settings, weights_change=config.weights_change),
                group_scored=[e for e, d in coordinator.levels.items() if d.group_scored],
                fence=coordinator.fence,
            )
        )
        self._rollouts = rollouts
        restorer = Restorer(
            coordinator,
            layout,
            config,
            load_anchor=self._load_anchor,
            metrics=self._metrics,
            allow_degraded=self._allow_degraded_restore,
        )
        restore_started = time.monotonic()
        plan = await restorer.restore()
        sync = WeightSync(
            {
                # The data-plane address if the server described one (spec section 3.1).
                name: topology.participants[name].data_plane_address or coordinator.endpoints[name]
                for name in topology.of_kind(ParticipantKind.MODEL)
            },
            token=self._token,
            epoch=identity.epoch,
            settings=self._weight_sync_settings,
            rollouts=rollouts,
        )
        self._weight_sync = sync
        restored_version = sync.adopt_restore(plan)
        if plan is not None:
            # A restore of several rounds used the epoch's first restore ids: heals
            # number theirs above them (docs/spec.md section 2.6 item 4).
            self._heal_count = plan.stale_rounds
            apply_plan(plan, rollouts, _incarnations(coordinator))
            rollouts.set_data_loader(plan.trainer_state.data_loader)
            self.resumed = _resumed_from(
                plan,
                weights_version=restored_version,
                restore_s=time.monotonic() - restore_started,
            )
        resumed = self.resumed
        self.history.on_restore(
            now=time.monotonic(),
            checkpoint_id=resumed.checkpoint_id,
            restore_s=resumed.restore_s,
            resumed_rollouts=resumed.resumed_rollouts,
            rerun_rollouts=resumed.rerun_rollouts,
            entries=plan.participants if plan is not None else (),
        )
        self._log_newest_event()
        driver = SnapshotDriver(
            coordinator=coordinator,
            rollouts=rollouts,
            anchor=self._anchor,
            layout=layout,
            config=config,
            epoch=identity.epoch,
            metrics=self._metrics,
            step_lock=self.step_lock,
            manifest_extra=lambda: self._manifest_extra(sync),
        )
        driver.adopt_restore(plan)
        driver.subscribe(self.history.on_transition)
        driver.subscribe(self._log_started)
        if self._on_transition is not None:
            driver.subscribe(self._on_transition)
        if hooks is not None:
            hooks.attach(driver)
        if self._weights is not None:
            # Policy servers get the restored weights at their recorded version; a server
            # that holds that version already answers without installing again, and one
            # that kept running with a newer version gets them above it (spec section
            # 6.11 item 6): the trainer's version then moves up to that one.
            if sync.version is None:
                sync.declare(self._initial_weights_version)
            state = await asyncio.to_thread(self._weights)
            pushed = await sync.push_restored(state)
            self.resumed = replace(self.resumed, weights_pushed=pushed)
        self._pump = SnapshotPump(driver, config)
        if self._periodic:
            self._ticker = asyncio.create_task(self._tick_periodically())
            self._background.append(self._ticker)
        if self._watch_liveness:
            self._background.append(asyncio.create_task(self._watch_participants()))
        return self.resumed

    async def _start_status(self, layout: SnapshotLayout | StoreLayout) -> None:
        # Imported here: aiohttp loads only for a trainer that serves the page.
        from turnpoint.trainer.status.server import StatusServer, StatusSources

        sources = StatusSources(
            history=self.history,
            layout=layout,
            config=self.config,
            registry=self._metrics.registry if self._metrics is not None else None,
        )
        server = StatusServer(
            sources,
            host=self._status_host,
            port=self._status_port or 0,
            reuse_port=self._status_reuse_port,
        )
        await server.start()
        self._status = server
        self._stack.push_async_callback(server.close)

    @property
    def status_address(self) -> str | None:
        """The status page's address (``http://host:port/``), once :meth:`open` started it."""
        return None if self._status is None else self._status.address

    def _log_started(
        self, attempt: str, old: SnapshotState, _new: SnapshotState, _now: float
    ) -> None:
        if old is SnapshotState.NEW and self._history_log is not None:
            self._history_log.append(self.history.started_record(attempt))

    def _manifest_extra(self, sync: WeightSync) -> dict[str, JSONValue]:
        extra = sync.snapshot_extra()
        if self._snapshot_metrics is not None:
            recorded: dict[str, JSONValue] = {
                str(name): float(value) for name, value in self._snapshot_metrics().items()
            }
            extra[METRICS_KEY] = recorded
        return extra

    async def _endpoints(self) -> Mapping[str, str]:
        if not callable(self._participants):
            return dict(self._participants)
        found = self._participants()
        if inspect.isawaitable(found):
            found = await found
        return dict(found)

    async def aclose(self) -> None:
        """Stop the pump, take the final snapshot, then close the rollout client and the
        coordinator.

        A snapshot under way is finished first; if it ended the run (the pump's
        :class:`SnapshotRunError`), that is raised once everything is closed. Then, with
        ``final_snapshot`` (the default), dispatch closes and one last snapshot saves the
        rollouts still unfinished, so that a later run continues from the very end of
        this one, not from the last periodic snapshot.
        """
        await self._close(finish_snapshot=True)

    async def _close(self, *, finish_snapshot: bool) -> None:
        self._stop.set()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        ticker = self._ticker if finish_snapshot else None
        for task in self._background:
            if task is not asyncio.current_task() and task is not ticker:
                task.cancel()
        # The ticker sees the stop at once between snapshots, and after the one under way.
        await asyncio.gather(*self._background, return_exceptions=True)
        try:
            if ticker is not None and not ticker.cancelled() and ticker.exception() is not None:
                raise ticker.exception()  # type: ignore[misc]
            if finish_snapshot and self._final_snapshot and self._pump is not None:
                await self._snapshot_at_exit()
            if self._history_log is not None and (finish_snapshot or self._preempted.is_set()):
                # A clean close: the next trainer does not report this one as a crash.
                self._history_log.append(self.history.closed_record(now=time.monotonic()))
        finally:
            await self._stack.aclose()
            # The driver calls back into this object (its transitions, the manifest's
            # extra), a cycle only the garbage collector would end: a multi-rank
            # anchor's process groups then lived until interpreter teardown, where gloo
            # aborts the process (exit -6) on a clean exit. Dropping the pump ends it.
            self._pump = None

    async def _snapshot_at_exit(self) -> None:
        if self._preempted.is_set():
            return  # the preemption took the final snapshot already
        if self._must_stop():
            # The run ended on a failure (a participant lost): no cut of it is whole.
            _LOG.info("no final snapshot: the run ended on a failure")
            return
        # Nothing new starts after the final cut; what it holds continues on restart.
        self.rollouts.close_dispatch()
        report = await self.snapshot_now()
        self._final = report
        _LOG.info("final snapshot %s %s", report.checkpoint_id, report.outcome.value)

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving on an error (a lost participant, the pump giving up, a preemption):
        # do not wait for a snapshot under way against a participant that may be gone.
        await self._close(finish_snapshot=exc_type is None)

    # ------------------------------------------------------------------ rollouts

    @property
    def rollouts(self) -> RolloutClient:
        if self._rollouts is None:
            raise RuntimeError("Checkpointing is not open")
        return self._rollouts

    @property
    def coordinator(self) -> Coordinator:
        if self._coordinator is None:
            raise RuntimeError("Checkpointing is not open")
        return self._coordinator

    @property
    def agents(self) -> tuple[str, ...]:
        return self.coordinator.topology.agents

    def dispatch(self, rollout: Rollout, *, data_loader: JSONValue = None) -> None:
        """Queue one rollout; ``data_loader`` (if given) is the loader position after it,
        saved with the next snapshot. Raises :class:`CoordinatorError`
        (``INVALID_ARGUMENT``) for an instance that is no agent, or an environment no
        participant describes, naming the known ones."""
        self._check()
        problem = self.coordinator.topology.rollout_problem(rollout.environment, rollout.instance)
        if problem is not None:
            field_name, message = problem
            raise CoordinatorError(
                Reason.INVALID_ARGUMENT,
                f"rollout {rollout.rollout_id!r}: {message}",
                {"rollout_id": rollout.rollout_id, "field": field_name},
            )
        self.rollouts.dispatch(rollout)
        if data_loader is not None:
            self.rollouts.set_data_loader(data_loader)

    async def wait_groups(self, count: int, timeout_s: float | None = None) -> bool:
        """Wait until ``count`` prompt groups are complete; ``False`` on timeout.

        Take them with :meth:`take_ready_groups` under :attr:`step_lock`, in the same
        critical section as the step that trains on them: a snapshot between taking and
        training would save neither the groups nor the step. Raises :class:`Preempted`
        once a SIGTERM's final snapshot is settled, and the pump's
        :class:`SnapshotRunError` if snapshots keep failing.
        """
        await asyncio.sleep(0)  # a loop that finds nothing ready still lets snapshots run
        self._check()
        rollouts = self.rollouts

        def ready() -> bool:
            return rollouts.ready_groups() >= count or self._must_stop()

        loop = asyncio.get_running_loop()
        until = None if timeout_s is None else loop.time() + timeout_s
        # Short waits, so that a preemption (which changes no rollout) is seen promptly.
        while not ready() and (until is None or loop.time() < until):
            left = _WAKE_S if until is None else min(_WAKE_S, max(0.0, until - loop.time()))
            with contextlib.suppress(TimeoutError):
                await rollouts.wait_for(ready, left)
        self._check()
        return rollouts.ready_groups() >= count

    def take_ready_groups(self, count: int | None = None) -> list[tuple[RolloutResult, ...]]:
        return self.rollouts.take_ready_groups(count)

    # ------------------------------------------------------------------ weights

    @property
    def weight_sync(self) -> WeightSync:
        if self._weight_sync is None:
            raise RuntimeError("Checkpointing is not open")
        return self._weight_sync

    @property
    def weights_version(self) -> int | None:
        """The version of the trainer's current weights (restored, or the newest pushed);
        each snapshot records it."""
        return self.weight_sync.version

    async def push_weights(self, version: int, state: bytes | None = None) -> WeightSyncReport:
        """Install the trainer's weights as ``version`` on every policy server.

        ``state`` defaults to the ``weights`` callable's bytes. Versions never go down.
        Lost replies and other transient failures are retried under the same request
        ids (a server installs each version once); rollout deadlines are held meanwhile.
        Raises :class:`WeightSyncError` when a server's push fails for good.

        The version a snapshot records is the newest one handed to this method when
        the snapshot's anchor was written: call it right after the step that produced
        the weights (or under :attr:`step_lock`).
        """
        self._check()
        sync = self.weight_sync
        sync.declare(version)
        if state is None:
            if self._weights is None:
                raise ValueError("push_weights needs state: no weights callable was given")
            state = await asyncio.to_thread(self._weights)
        return await sync.push(version, state)

    # ------------------------------------------------------------------ snapshots

    async def snapshot_now(self) -> SnapshotReport:
        """One snapshot now (under the pump's failure policy)."""
        if self._pump is None:
            raise RuntimeError("Checkpointing is not open")
        async with self._snapshot_lock:
            report = await self._pump.tick()
        self.reports.append(report)
        self.history.on_report(report)
        if self._history_log is not None:
            self._history_log.append(
                self.history.finished_record(report.checkpoint_id, now=time.monotonic())
            )
        if self._on_snapshot is not None:
            self._on_snapshot(report)
        if report.outcome is SnapshotOutcome.FAILED:
            _LOG.warning("snapshot %s failed: %s", report.checkpoint_id, report.detail)
        elif report.outcome is SnapshotOutcome.SKIPPED:
            _LOG.debug("snapshot %s skipped: nothing changed", report.checkpoint_id)
        return report

    async def step_done(self, step: int) -> SnapshotReport | None:
        """Call after each training step (outside :attr:`step_lock`). Returns the report
        of the snapshot it took (every ``every_steps`` steps), else ``None``. Every
        snapshot's report, whoever took it (this, the timer, :meth:`snapshot_now`, the
        final one), goes the same way: to ``on_snapshot`` and to :attr:`reports`."""
        self._check()
        if self._every_steps and step % self._every_steps == 0:
            return await self.snapshot_now()
        return None

    async def _tick_periodically(self) -> None:
        interval = self.config.snapshot_interval_s
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)
            if not self._stop.is_set():
                await self.snapshot_now()

    async def _watch_participants(self) -> None:
        while True:
            try:
                await watch_liveness(
                    self.coordinator,
                    interval_s=self.config.liveness_interval_s,
                    lost_after_s=self.config.participant_lost_after_s,
                )
            except ParticipantLostError as error:
                failed = await self._heal_all(error.lost) if self._launcher is not None else None
                if self._launcher is not None and failed is None:
                    continue  # a new watch: the replacements' incarnations are theirs
                self.history.on_lost(error.lost, time.monotonic(), error.message)
                self._log_newest_event()
                if self._on_participant_lost is not None:
                    self._on_participant_lost(error)
                if isinstance(failed, HealRefusedError):
                    raise failed from error  # replaced too often: the run ends, saying so
                raise error from failed

    async def _heal_all(self, lost: tuple[str, ...]) -> CoordinatorError | ValueError | None:
        """Heal each lost participant in turn; the first failure (the job restarts, or
        ends on :class:`HealRefusedError`), or None once all are healed."""
        for instance in lost:
            try:
                plan = await self.heal(instance)
            except (CoordinatorError, ValueError) as error:
                _LOG.warning("healing %s in place failed: %s", instance, error)
                return error
            _LOG.info("healed in place: %s", plan.reason)
        return None

    async def heal(self, lost: str) -> HealPlan:
        """Replace lost participant ``lost`` through the launcher and restore only what
        depended on it (docs/spec.md section 7.15); every other rollout goes on.

        Under the snapshot lock: :func:`plan_heal` decides from the last published
        snapshot, the rollouts it touches are stopped here, the launcher starts a
        replacement under the same name, the coordinator describes it, the touched
        rollouts' old attempts are retired where they run, the saved episodes restored on the replacement (Restore) and
        the live participants (RestoreRunning, keeping their other work), then each
        touched rollout continues as N+1 or reruns from its prompt. A replaced policy
        model gets the current weights first. Raises (:class:`HealRefusedError` once
        ``lost`` was replaced ``config.max_restarts`` times within
        ``config.restart_window_s``, :class:`LaunchError`, :class:`OperationFailed`,
        ``ValueError`` for a participant that cannot restore where it runs) when the
        heal cannot be done: the job then restarts, or ends with the reason.
        """
        if self._launcher is None:
            raise RuntimeError("heal needs a launcher (Checkpointing(launcher=...))")
        budget = self._heal_budgets.setdefault(
            lost,
            RestartBudget(
                self.config.max_restarts, self.config.restart_window_s, first_pause_s=0.0
            ),
        )
        decision = budget.decide(time.monotonic(), f"{lost} lost")
        if not decision.allowed:
            raise HealRefusedError(lost, decision.reason)
        # A snapshot under way may wait on the lost participant itself (a paused process
        # answers nothing): every call to it fails from now on, so that snapshot fails
        # at once and is taken again after the heal. The heal still waits at most one
        # control timeout for it (a snapshot held elsewhere), then the job restarts.
        self.coordinator.give_up_on([lost])
        try:
            await asyncio.wait_for(self._snapshot_lock.acquire(), self.config.control_timeout_s)
        except TimeoutError:
            raise CoordinatorError(
                Reason.DEADLINE_EXCEEDED,
                f"healing {lost} in place: the snapshot under way did not end within "
                f"{self.config.control_timeout_s:g}s",
                {"participant": lost},
            ) from None
        try:
            plan = await self._heal_locked(lost)
        finally:
            self._snapshot_lock.release()
        self.heals.append(plan)
        if self._pump is not None:
            # The snapshots that failed on the loss do not count towards ending the run.
            self._pump.fleet_healed()
        self.history.on_replaced(
            lost,
            time.monotonic(),
            checkpoint_id=plan.checkpoint_id,
            resumed_rollouts=len(plan.continued),
            rerun_rollouts=len(plan.rerun),
            untouched_rollouts=len(plan.untouched),
        )
        self._log_newest_event()
        return plan

    def _log_newest_event(self) -> None:
        """Append the history's newest event (a restore, a loss, a replacement) to the
        history file, when there is one (a local snapshot root)."""
        if self._history_log is not None:
            self._history_log.append(self.history.event_record(self.history.events[-1]))

    async def _heal_locked(self, lost: str) -> HealPlan:
        """:meth:`heal` under the snapshot lock."""
        assert self._launcher is not None
        coordinator, rollouts = self.coordinator, self.rollouts
        layout = self._layout
        assert layout is not None
        topology = coordinator.topology
        if lost not in topology.participants:
            raise ValueError(f"unknown participant instance {lost!r}")
        is_agent = lost in topology.agents
        if is_agent:
            rollouts.close_dispatch_to(lost)
        try:
            latest = await asyncio.to_thread(layout.latest)
            manifest = None if latest is None else await asyncio.to_thread(layout.load, latest)
            self._heal_count += 1
            plan = plan_heal(
                manifest,
                rollouts.in_flight(),
                lost,
                [Member(name, p.kind, p.environment) for name, p in topology.participants.items()],
                coordinator.levels,
                target=self.config.target_level,
                restore_id=restore_id_for(coordinator.identity.epoch, self._heal_count),
                finished_groups=rollouts.finished_groups(),
            )
            cannot = sorted(
                n for n in plan.running_scope if not topology.participants[n].restore_running
            )
            if cannot:
                raise ValueError(
                    f"{', '.join(cannot)} must be restored where they run but do not "
                    "serve RestoreRunning (docs/spec.md section 4.16)"
                )
            # No await since the plan was made: the touched attempts stop here before
            # anything is sent to the replacement, which must never see them.
            rollouts.end_for_heal(
                [step.rollout.episode for step in plan.continued]
                + [step.rollout.episode for step in plan.rerun]
            )
            address = await self._launcher.replace(lost)
            info = await coordinator.replace_participant(lost, address)
            if is_agent:
                endpoint = AgentEndpoint(info.data_plane_address or address, token=self._token)
                await rollouts.replace_agent(lost, endpoint)
            if info.kind is ParticipantKind.MODEL:
                await self._reweigh(lost, info.data_plane_address or address)
            await self._apply_heal(plan, manifest)
        finally:
            if is_agent:
                rollouts.reopen_dispatch_to(lost)
        return plan

    async def _apply_heal(self, plan: HealPlan, manifest: SnapshotManifest | None) -> None:
        coordinator, rollouts = self.coordinator, self.rollouts
        retired = await retire_for_heal(
            coordinator.retire, plan.retire, key=f"{plan.restore_id}-reruns"
        )
        if retired.failures:
            raise OperationFailed("retire", plan.restore_id, retired.failures)
        scope = {plan.lost.instance: plan.replacement_scope, **plan.running_scope}
        scope = {name: episodes for name, episodes in scope.items() if episodes}
        continued = plan.continued
        if scope and manifest is not None:
            try:
                async with coordinator.restored(
                    plan.restore_id,
                    manifest.checkpoint_id,
                    manifest,
                    scope,
                    instances=scope,
                    retire_unscoped=False,
                ):
                    pass
            except RestoreFailed:
                # Every N+1 was retired where it was installed: start those over from
                # their prompts above it (section 7.7 item 7).
                for step in continued:
                    rollouts.rerun_from_prompt(step.rollout, attempt=step.episode.attempt + 1)
                continued = ()
        restored_into = _incarnations(coordinator)
        for step in continued:
            rollouts.redispatch(
                step.rollout, incarnation=restored_into.get(step.rollout.instance, "")
            )
        for rerun in plan.rerun:
            rollouts.rerun_from_prompt(rerun.rollout, attempt=rerun.attempt)
        for group in plan.regroup:
            rollouts.rerun_finished(group)

    async def _reweigh(self, instance: str, address: str) -> None:
        """A replaced policy model takes the trainer's current weights before calls."""
        sync = self.weight_sync
        sync.replace_server(instance, address)
        if self._weights is not None and sync.version is not None:
            state = await asyncio.to_thread(self._weights)
            await sync.push(sync.version, state)

    # ------------------------------------------------------------------ preemption

    def install_preemption_handler(self, deadline_s: float = 30.0) -> None:
        """On SIGTERM take one final snapshot within ``deadline_s``; the loop then sees
        :class:`Preempted` from :meth:`wait_groups`, :meth:`step_done` or :meth:`dispatch`."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(
            signal.SIGTERM,
            lambda: self._background.append(asyncio.create_task(self._preempt(deadline_s))),
        )

    async def _preempt(self, deadline_s: float) -> None:
        if self._stop.is_set():
            return
        self._stop.set()  # no more periodic ticks
        try:
            self._final = await asyncio.wait_for(self.snapshot_now(), deadline_s)
        except TimeoutError:
            _LOG.warning("the final snapshot did not finish within %.1f s", deadline_s)
        finally:
            # Nothing new starts after the final cut; rollouts in it resume on restart.
            self.rollouts.close_dispatch()
            self._preempted.set()

    def _must_stop(self) -> bool:
        return self._preempted.is_set() or any(
            t.done() and not t.cancelled() and t.exception() is not None for t in self._background
        )

    def _check(self) -> None:
        if self._preempted.is_set():
            raise Preempted(self._final)
        for task in self._background:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
