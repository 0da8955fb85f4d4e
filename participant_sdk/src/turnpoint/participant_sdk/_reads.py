"""The control reads: Describe, GetStatus and WatchBoundaries (docs/spec.md sections 4.5,
4.13 and 4.14), and what the participant says about itself.

A mixin of :class:`~._runtime.ParticipantRuntime`: it reads the state the runtime owns
and changes nothing but the epoch a newer fence raises.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from turnpoint.errors import Reason, TurnpointError
from turnpoint.protocol import (
    PROTOCOL_VERSION,
    Fence,
    ParticipantKind,
    Phase,
    ReadinessReport,
    RecoveryLevel,
    RecoveryMode,
    VerifyMode,
)

from ._core import CoreEvent, CoreView
from ._results import BoundaryEvent, Description, Header, ReadinessUpdate, StatusResult, WatchEvent
from ._shared import KindHost, RuntimeConfig, Shared


class ControlReads:
    """Describe, status and watch over the state a :class:`ParticipantRuntime` holds."""

    _instance: str
    _incarnation: str
    _environment: str
    _config: RuntimeConfig
    _shared: Shared
    _hosts: dict[str, KindHost]

    @property
    def instance_name(self) -> str:
        return self._instance

    @property
    def kind(self) -> ParticipantKind:
        kinds = {host.kind for host in self._hosts.values()}
        if kinds == {ParticipantKind.AGENT, ParticipantKind.RESOURCES}:
            return ParticipantKind.ENVIRONMENT
        return kinds.pop()

    @property
    def recovery_mode(self) -> RecoveryMode:
        modes = {host.recovery_mode for host in self._hosts.values()}
        # The weakest mode hosted decides what the participant as a whole can promise.
        for mode in (RecoveryMode.RESTART_ONLY, RecoveryMode.EXPORTED, RecoveryMode.STATELESS):
            if mode in modes:
                return mode
        return RecoveryMode.RESTART_ONLY

    @property
    def phase(self) -> Phase:
        return self._shared.view.phase

    @property
    def core(self) -> CoreView:
        """The pure core's reads, for inspection (tests, tools); it cannot change the core."""
        return self._shared.view

    async def wait_until(
        self, predicate: Callable[[CoreView], bool], timeout_s: float | None = None
    ) -> bool:
        """Wait until ``predicate(core)`` holds (re-checked at every state change).

        For tests and tools; returns False if ``timeout_s`` passed first.
        """
        shared = self._shared
        async with shared.locked() as core:
            return await shared.wait_until(lambda: predicate(core), timeout_s)

    def header(self) -> Header:
        return Header(self._instance, self._incarnation, self._shared.view.epoch)

    async def describe(self, fence: Fence | None = None) -> Description:
        async with self._shared.changing() as core:
            core.observe_fence(fence)
            phase = core.phase
        extra: dict[str, object] = {}
        for host in self._hosts.values():
            extra.update(host.describe())
        mode = self.recovery_mode
        levels = (
            (RecoveryLevel.SIBLING, RecoveryLevel.PROMPT_GROUP)
            if mode is RecoveryMode.RESTART_ONLY
            else (RecoveryLevel.TURN, RecoveryLevel.SIBLING, RecoveryLevel.PROMPT_GROUP)
        )
        if extra.get("cuts_generations") is True and mode is not RecoveryMode.RESTART_ONLY:
            # docs/spec.md section 5.5: a model that cuts, an agent that records cuts.
            levels = (RecoveryLevel.TOKEN, *levels)
        verify_mode = extra.get("verify_mode", VerifyMode.WAIT)
        group_size = extra.get("group_size", 0)
        return Description(
            kind=self.kind,
            instance_name=self._instance,
            incarnation=self._incarnation,
            protocol_version=PROTOCOL_VERSION,
            recovery_mode=mode,
            verify_mode=verify_mode if isinstance(verify_mode, VerifyMode) else VerifyMode.WAIT,
            group_scored=bool(extra.get("group_scored", False)),
            group_size=group_size if isinstance(group_size, int) else 0,
            supported_levels=levels,
            environment=self._environment,
            phase=phase,
            restore_running=self._shared.config.restore_running,
        )

    async def status(self, max_blockers: int = 0) -> StatusResult:
        """GetStatus: read-only."""
        cap = self._cap(max_blockers)
        async with self._shared.locked() as core:
            return StatusResult(
                phase=core.phase,
                active_checkpoint_id=core.active_checkpoint_id,
                lease_expires_at=self._shared.to_wall(core.lease_expires_at),
                readiness=core.readiness(cap),
                admission_open=core.admission_open,
                lease_expiries=core.lease_expiries,
                refused_rollouts=core.refused_rollouts,
                committed_checkpoint_id=self._shared.committed_checkpoint_id,
            )

    async def watch(
        self, max_blockers: int = 0, fence: Fence | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """WatchBoundaries: a readiness report first, then boundary events and new reports.

        Boundary events are pushed as they happen; a new readiness report follows each
        batch of changes that moved readiness (ready, counts, restarts) or the phase.
        """
        cap = self._cap(max_blockers)
        shared = self._shared
        watcher = shared.add_watcher()
        try:
            async with shared.changing() as core:
                core.observe_fence(fence)
                report = core.readiness(cap)
                phase = core.phase
            last = _signature(phase, report)
            yield ReadinessUpdate(phase, report)
            while True:
                await watcher.wake.wait()
                watcher.wake.clear()
                events = list(watcher.events)
                watcher.events.clear()
                view = shared.view
                for event in events:
                    yield self._boundary_event(event, view.phase)
                report = view.readiness(cap)
                signature = _signature(view.phase, report)
                if signature != last or watcher.lagged:
                    watcher.lagged = False
                    last = signature
                    yield ReadinessUpdate(view.phase, report)
        finally:
            shared.remove_watcher(watcher)

    def _boundary_event(self, event: CoreEvent, phase: Phase) -> BoundaryEvent:
        at = self._shared.to_wall(event.at)
        assert at is not None
        return BoundaryEvent(
            event.episode,
            event.state,
            event.boundary_index,
            event.turn_index,
            at,
            phase,
            event.slot,
        )

    def _cap(self, max_blockers: int) -> int:
        if max_blockers < 0:
            raise TurnpointError(
                Reason.INVALID_ARGUMENT, "max_blockers must be >= 0", {"field": "max_blockers"}
            )
        cap = max_blockers or self._config.default_max_blockers
        return min(cap, self._config.max_blockers_limit)

    def _lease_wall(self) -> float | None:
        return self._shared.to_wall(self._shared.view.lease_expires_at)


def _signature(phase: Phase, report: ReadinessReport) -> tuple[object, ...]:
    return (
        phase,
        report.ready,
        report.blocker_count,
        tuple(sorted((s.value, c) for s, c in report.counts.items())),
        report.restarts,
    )
