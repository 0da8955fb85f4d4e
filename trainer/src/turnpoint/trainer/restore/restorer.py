"""Restoring a run from its newest usable snapshot (docs/spec.md section 7.7).

:class:`Restorer` runs the whole restore:

1. discover the live participants;
2. pick the newest published snapshot that passes every check, falling back to older
   ones: its manifest parses strictly, every artifact on disk matches its digest and
   size, and its trainer anchor loads (the anchor loader restores model and optimizer
   in place). A participant set that differs from the live one is an error, not a
   reason to fall back: no older snapshot of this run can fit a topology it never had;
3. take each environment's effective recovery level as discovery decided it from
   ``Describe`` (:attr:`Coordinator.levels`, warned about once, at start-up);
4. plan (:func:`plan_restore`, pure): which unfinished rollouts continue at turn level
   as attempt N+1 on the instance that saved them, which rerun from their prompts, and
   which prompt groups rerun whole;
5. restore the participants (only what continues), keep them closed while that runs,
   then resume them in order (:meth:`Coordinator.restored`). If any participant's
   restore fails, the replacements are retired everywhere, every participant resumed,
   and the plan turns every continuation into a rerun from its prompt (with an attempt
   above the retired one).

The returned :class:`RestorePlan` is for the rollout side to act on
(:func:`apply_plan`): reinstall the trainer state, redispatch the continuations, rerun
the rest. Nothing already in the queue runs again, and a restored episode that no
unfinished rollout claims is an error (:class:`RestorePlanError`), never silently dropped.

Rerun attempt numbers: one above both the ledger and the saved attempt; for a rollout
whose N+1 was installed and then retired (a failed restore), one above that, because a
participant refuses every attempt up to a retired one.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Protocol

from turnpoint.errors import TurnpointError
from turnpoint.ids import (
    EpisodeId,
    InvalidIdError,
    validate_attempt,
    validate_id,
)
from turnpoint.protocol import ArtifactRef, ParticipantKind, RecoveryLevel
from turnpoint.storage import StorageError
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.control.coordinator import Coordinator
from turnpoint.trainer.control.outcomes import RestoreFailed
from turnpoint.trainer.control.topology import Topology
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.metrics import CoordinatorMetrics
from turnpoint.trainer.restore.choice import Candidate, RestoreChoice, metrics_of, rank_candidates
from turnpoint.trainer.restore.heal import restore_id_for
from turnpoint.trainer.restore.stale import merge_stale
from turnpoint.trainer.rollouts.side import InFlightRollout
from turnpoint.trainer.snapshots.levels import LevelDecision, decide_levels
from turnpoint.trainer.storage.layout import SnapshotLayout
from turnpoint.trainer.storage.manifest import (
    AnchorRef,
    JSONValue,
    ManifestError,
    ParticipantEntry,
    SnapshotManifest,
    TrainerRolloutState,
)
from turnpoint.trainer.storage.objects import StoreLayout

if TYPE_CHECKING:
    import torch


_LOG = logging.getLogger(__name__)

_CHUNK: Final = 1 << 20

MAX_STALE_ROUNDS: Final = 4
"""Restore rounds after the first, each after running participants refused saved
attempts they had moved past (docs/spec.md section 7.7 item 7). Each round reruns what
the refusals listed, so it takes more than one only when a participant listed no more
than its cap (64) of them."""

AnchorLoader = Callable[[Path, AnchorRef], int]
"""``(snapshot directory, anchor reference) -> step``: load the trainer anchor in place
(model, optimizer), verifying its digest first; raise on any problem. Blocking: it runs
in a thread."""


def torch_anchor_loader(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> AnchorLoader:
    """An :data:`AnchorLoader` over :func:`~turnpoint.trainer.anchors.dcp.load_anchor`."""
    from turnpoint.trainer.anchors.dcp import load_anchor

    def load(snapshot: Path, anchor: AnchorRef) -> int:
        return load_anchor(snapshot, model, optimizer, expected=anchor).step

    return load


class RestorePlanError(ManifestError):
    """A snapshot whose rollout bookkeeping contradicts itself (a restored episode that
    no unfinished rollout claims, a rollout both finished and unfinished...)."""


class NoUsableSnapshotError(CoordinatorError):
    """Snapshots were published but none passed its checks; ``rejected`` says why each
    was set aside. Starting over silently would lose the run, so this stops it."""

    def __init__(self, rejected: Sequence[tuple[str, str]]) -> None:
        from turnpoint.errors import Reason

        listed = "; ".join(f"{ck}: {why}" for ck, why in rejected)
        super().__init__(
            Reason.INVALID_CHECKPOINT_STATE, f"no published snapshot is usable ({listed})"
        )
        self.rejected = tuple(rejected)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.rejected,))


class RestoreRefusedError(CoordinatorError):
    """Restoring ``checkpoint_id`` failed on some participant (``failures``, by
    instance), and a degraded start, every saved rollout over from its prompt, was not
    allowed. Most often a participant without RestoreRunning is not fresh: the trainer
    restarted alone."""

    def __init__(self, checkpoint_id: str, cause: RestoreFailed) -> None:
        super().__init__(
            cause.reason,
            f"restoring snapshot {checkpoint_id} failed: {cause}. A participant that does "
            "not serve RestoreRunning must be fresh (docs/spec.md sections 4.10, 4.16): "
            "restart it with the trainer, or "
            "allow a degraded start, where every saved rollout starts over from its prompt "
            "(Checkpointing(allow_degraded_restore=True))",
            {"checkpoint_id": checkpoint_id},
        )
        self.checkpoint_id = checkpoint_id
        self.cause = cause
        self.failures = dict(cause.failures)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.checkpoint_id, self.cause))


# ---------------------------------------------------------------------------- plan


class RerunReason(enum.Enum):
    """Why an unfinished rollout reruns from its prompt instead of continuing."""

    # A participant could not capture it (restart-only), or its agent did not export it.
    RESTART = "restart"
    # It was waiting at the trainer's closed gate: no participant owned it.
    NOT_ACCEPTED = "not_accepted"
    # Its environment's effective level is coarser than turn: saved turns are dropped.
    LEVEL = "level"
    # Its prompt group reruns whole (prompt_group level, or a group-scored environment
    # where some sibling cannot continue).
    GROUP = "group"
    # A participant's restore failed: every continuation starts over.
    RESTORE_FAILED = "restore_failed"
    # A participant that kept running has seen its N+1 since the snapshot (the fenced
    # incarnation retried or healed it): N+1 cannot be installed (spec section 4.16).
    SEEN_SINCE = "seen_since"


@dataclass(frozen=True, slots=True)
class Redispatch:
    """Continue ``rollout`` (attempt N as saved) as N+1 on ``instance``, which saved it."""

    rollout: InFlightRollout
    instance: str

    @property
    def episode(self) -> EpisodeId:
        return self.rollout.episode.next_attempt()


@dataclass(frozen=True, slots=True)
class Rerun:
    """Start ``rollout`` over from its prompt as ``attempt``.

    ``rollout`` carries the attempt the ledger holds (what the rollout side expects);
    ``finished`` marks a sibling whose result was dropped from the queue because its
    group reruns whole.
    """

    rollout: InFlightRollout
    attempt: int
    instance: str
    reason: RerunReason
    finished: bool = False

    @property
    def episode(self) -> EpisodeId:
        return EpisodeId(self.rollout.episode.rollout_id, self.attempt)


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What a restore continues, reruns and reinstalls (see the module docstring)."""

    checkpoint_id: str
    restore_id: str
    step: int
    anchor: AnchorRef
    trainer_state: TrainerRolloutState
    levels: Mapping[str, LevelDecision]
    redispatch: tuple[Redispatch, ...]
    rerun: tuple[Rerun, ...]
    restore_scope: Mapping[str, tuple[EpisodeId, ...]]
    dropped_from_queue: tuple[str, ...] = ()
    groups_retried_whole: int = 0
    sealed_siblings_discarded: int = 0
    saved_turns_discarded: int = 0
    restore_failed: bool = False
    # Participants whose resume of the restore id did not succeed (docs/spec.md section
    # 7.7 item 9): still closed, until the snapshot driver's release retry or their lease.
    unreleased: frozenset[str] = frozenset()
    # The manifest's ``extra`` (docs/spec.md section 8.6): what the application kept
    # beside the anchor, the facade's weights version among it.
    extra: Mapping[str, JSONValue] = field(default_factory=lambda: MappingProxyType({}))
    # The manifest's participants: what each committed (the status history's drill-down
    # of a snapshot whose report was lost with its trainer).
    participants: tuple[ParticipantEntry, ...] = ()
    # Restore rounds beyond the first: each one after running participants refused
    # saved attempts they had moved past (docs/spec.md section 7.7 item 7). The restore
    # id is the epoch's ``stale_rounds``-th; a heal numbers its ids above it.
    stale_rounds: int = 0

    @property
    def resumed(self) -> int:
        """Siblings resumed from a saved turn."""
        return len(self.redispatch)

    @property
    def rerun_count(self) -> int:
        """Siblings rerun from their prompts."""
        return len(self.rerun)

    @property
    def lowered(self) -> tuple[LevelDecision, ...]:
        return tuple(d for d in self.levels.values() if d.lowered)


def _descriptor(raw: Mapping[str, JSONValue], where: str, checkpoint_id: str) -> InFlightRollout:
    """An unfinished (or finished, for a queue item) rollout as the rollout side saved it."""

    def fail(why: str) -> RestorePlanError:
        return RestorePlanError(f"{where}: {why}", checkpoint_id=checkpoint_id, field=where)

    def integer(name: str, default: int | None = None) -> int:
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise fail(f"{name} must be an integer >= 0, got {value!r}")
        return value

    try:
        episode = EpisodeId(
            validate_id(raw.get("rollout_id"), "rollout_id"),
            validate_attempt(raw.get("attempt"), "attempt"),
        )
        instance = validate_id(raw.get("instance"), "instance")
        group = validate_id(raw.get("prompt_group_id"), "prompt_group_id")
    except InvalidIdError as error:
        raise fail(str(error)) from None
    environment = raw.get("environment", "")
    task = raw.get("task", {})
    if not isinstance(environment, str):
        raise fail(f"environment must be a string, got {environment!r}")
    if not isinstance(task, Mapping):
        raise fail("task must be an object")
    return InFlightRollout(
        episode=episode,
        instance=instance,
        prompt_group_id=group,
        sibling_index=integer("sibling_index"),
        group_size=integer("group_size"),
        environment=environment,
        boundaries_seen=integer("boundaries_seen", 0),
        task=dict(task),
    )


def plan_restore(
    manifest: SnapshotManifest,
    topology: Topology,
    target: RecoveryLevel,
    *,
    restore_id: str,
    step: int | None = None,
    restore_failed: bool = False,
    retired: Iterable[EpisodeId] = (),
    levels: Mapping[str, LevelDecision] | None = None,
    seen_since: Mapping[str, int] | None = None,
) -> RestorePlan:
    """Decide what every unfinished rollout of ``manifest`` does after the restore.

    Pure. ``restore_failed`` turns every continuation into a rerun (the participants'
    restore failed); ``retired`` are replacement attempts that were installed and then
    retired, whose reruns must use a higher attempt. ``levels`` are the recovery levels
    the coordinator decided at discovery (docs/spec.md section 7.1 item 3); without
    them they are decided here from ``topology`` alike. ``seen_since`` gives, per
    rollout, the highest attempt a running participant has seen since the snapshot (its
    refusal of the restore, :func:`~turnpoint.trainer.restore.stale.stale_refusals`):
    such a rollout reruns from its prompt above it instead of continuing.
    """
    seen = dict(seen_since or {})
    checkpoint_id = manifest.checkpoint_id
    state = manifest.rollout_state

    def fail(why: str, where: str = "rollout_state") -> RestorePlanError:
        return RestorePlanError(
            f"snapshot {checkpoint_id!r}: {why}", checkpoint_id=checkpoint_id, field=where
        )

    saved: dict[str, InFlightRollout] = {}
    accepted: dict[str, bool] = {}
    for index, raw in enumerate(state.in_flight):
        rollout = _descriptor(raw, f"rollout_state.in_flight[{index}]", checkpoint_id)
        saved[rollout.episode.rollout_id] = rollout
        accepted[rollout.episode.rollout_id] = raw.get("accepted", True) is not False
    queued: dict[str, Mapping[str, JSONValue]] = {}
    for queue_item in state.queue:
        rollout_id = queue_item.get("rollout_id")
        if isinstance(rollout_id, str):
            queued[rollout_id] = queue_item
    both = sorted(set(saved) & set(queued))
    if both:
        raise fail(f"rollout {both[0]!r} is both finished (queued) and unfinished")

    continued = {placed.episode.rollout_id: placed for placed in manifest.continued}
    restarts = {placed.episode.rollout_id: placed for placed in manifest.restarts}
    for label, placed_map in (("continued", continued), ("restarts", restarts)):
        for rollout_id, placed in placed_map.items():
            owner = saved.get(rollout_id)
            if owner is None or owner.episode != placed.episode:
                raise fail(
                    f"restored episode {placed.episode} is claimed by no unfinished rollout",
                    label,
                )
            if owner.instance != placed.instance:
                raise fail(
                    f"episode {placed.episode} was saved by {placed.instance!r} but its "
                    f"rollout runs on {owner.instance!r}",
                    label,
                )
    unfinished = set(continued) | set(restarts)
    for entry in manifest.participants:
        for episode in entry.exported:
            if episode.rollout_id not in unfinished or (
                entry.kind is not ParticipantKind.RESOURCES and episode.rollout_id not in continued
            ):
                raise fail(
                    f"{entry.instance!r} saved {episode}, which no unfinished rollout claims",
                    "participants",
                )

    environments: dict[str, list[Any]] = {
        name: list(members) for name, members in topology.environments().items()
    }
    for rollout in saved.values():
        environments.setdefault(rollout.environment, [])
    decided = dict(levels or {})
    levels = decide_levels(
        target, {name: m for name, m in environments.items() if name not in decided}
    ) | {name: decided[name] for name in environments if name in decided}

    retired_ids = {episode.rollout_id: episode.attempt for episode in retired}
    ledger = state.attempts

    def next_attempt(rollout: InFlightRollout) -> int:
        number = max(ledger.get(rollout.episode.rollout_id, -1), rollout.episode.attempt) + 1
        burned = retired_ids.get(rollout.episode.rollout_id)
        number = number if burned is None else max(number, burned + 1)
        moved = seen.get(rollout.episode.rollout_id)
        return number if moved is None else max(number, moved + 1)

    def resumable(rollout_id: str, level: RecoveryLevel) -> bool:
        return (
            rollout_id in continued
            and accepted[rollout_id]
            and level <= RecoveryLevel.TURN  # token: a cut generation continues too
            and not restore_failed
            and rollout_id not in seen
        )

    groups: dict[str, list[InFlightRollout]] = {}
    for rollout in saved.values():
        groups.setdefault(rollout.prompt_group_id, []).append(rollout)
    finished_by_group: dict[str, list[tuple[str, Mapping[str, JSONValue]]]] = {}
    for rollout_id, item in queued.items():
        group = item.get("prompt_group_id")
        if isinstance(group, str):
            finished_by_group.setdefault(group, []).append((rollout_id, item))

    redispatch: list[Redispatch] = []
    rerun: list[Rerun] = []
    dropped: list[str] = []
    groups_whole = sealed_discarded = turns_discarded = 0
    for group_id in sorted(groups):
        siblings = sorted(groups[group_id], key=lambda r: (r.sibling_index, r.episode))
        decision = levels[siblings[0].environment]
        level = decision.effective
        can_resume = {
            r.episode.rollout_id: resumable(r.episode.rollout_id, level) for r in siblings
        }
        whole = level is RecoveryLevel.PROMPT_GROUP or (
            decision.group_scored and not all(can_resume.values())
        )
        for rollout in siblings:
            rollout_id = rollout.episode.rollout_id
            if can_resume[rollout_id] and not whole:
                redispatch.append(Redispatch(rollout, rollout.instance))
                continue
            if rollout_id in continued:
                turns_discarded += 1
            if whole:
                reason = RerunReason.GROUP
            elif restore_failed and rollout_id in continued:
                reason = RerunReason.RESTORE_FAILED
            elif rollout_id in continued and rollout_id in seen and accepted[rollout_id]:
                reason = RerunReason.SEEN_SINCE
            elif not accepted[rollout_id]:
                reason = RerunReason.NOT_ACCEPTED
            elif rollout_id in restarts:
                reason = RerunReason.RESTART
            else:
                reason = RerunReason.LEVEL
            rerun.append(Rerun(rollout, next_attempt(rollout), rollout.instance, reason))
        if whole:
            groups_whole += 1
            for rollout_id, item in sorted(
                finished_by_group.get(group_id, []), key=lambda pair: pair[0]
            ):
                finished = _descriptor(item, f"rollout_state.queue[{rollout_id}]", checkpoint_id)
                dropped.append(rollout_id)
                sealed_discarded += 1
                rerun.append(
                    Rerun(
                        finished,
                        next_attempt(finished),
                        finished.instance,
                        RerunReason.GROUP,
                        finished=True,
                    )
                )

    exporters: dict[EpisodeId, list[str]] = {}
    for entry in manifest.participants:
        for episode in entry.exported:
            exporters.setdefault(episode, []).append(entry.instance)
    scope: dict[str, list[EpisodeId]] = {instance: [] for instance in manifest.instances}
    for action in redispatch:
        for instance in exporters.get(action.rollout.episode, ()):
            scope[instance].append(action.rollout.episode)

    dropped_set = set(dropped)
    trainer_state = TrainerRolloutState(
        queue=tuple(
            item
            for item in state.queue
            if not (isinstance(item.get("rollout_id"), str) and item["rollout_id"] in dropped_set)
        ),
        data_loader=state.data_loader,
        attempts=state.attempts,
        in_flight=state.in_flight,
    )
    return RestorePlan(
        checkpoint_id=checkpoint_id,
        restore_id=restore_id,
        step=manifest.step if step is None else step,
        anchor=manifest.anchor,
        trainer_state=trainer_state,
        levels=MappingProxyType(levels),
        redispatch=tuple(redispatch),
        rerun=tuple(rerun),
        restore_scope=MappingProxyType(
            {instance: tuple(sorted(episodes)) for instance, episodes in scope.items()}
        ),
        dropped_from_queue=tuple(dropped),
        groups_retried_whole=groups_whole,
        sealed_siblings_discarded=sealed_discarded,
        saved_turns_discarded=turns_discarded,
        restore_failed=restore_failed,
        extra=manifest.extra,
        participants=tuple(manifest.participants),
    )


class RestoreTarget(Protocol):
    """What :func:`apply_plan` needs of the rollout client."""

    def install(self, state: TrainerRolloutState) -> Sequence[Any]: ...

    def redispatch(
        self, rollout: InFlightRollout, instance: str | None = None, *, incarnation: str = ""
    ) -> EpisodeId: ...

    def rerun_from_prompt(
        self,
        rollout: InFlightRollout,
        *,
        instance: str | None = None,
        attempt: int | None = None,
    ) -> EpisodeId: ...


def apply_plan(
    plan: RestorePlan, target: RestoreTarget, incarnations: Mapping[str, str] | None = None
) -> None:
    """Reinstall the trainer state, continue what continues, rerun the rest.
    ``incarnations`` (instance -> the incarnation restored into) are what each continued
    attempt's Runs name (docs/spec.md section 6.5 item 5)."""
    target.install(plan.trainer_state)
    for action in plan.redispatch:
        named = (incarnations or {}).get(action.instance, "")
        target.redispatch(action.rollout, action.instance, incarnation=named)
    for rerun in plan.rerun:
        target.rerun_from_prompt(rerun.rollout, instance=rerun.instance, attempt=rerun.attempt)


# ------------------------------------------------------------------------ checking


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_artifacts(layout: SnapshotLayout | StoreLayout, manifest: SnapshotManifest) -> None:
    """Check every participant file the manifest names: present, its size, its sha256.

    Blocking (it reads every byte). Raises :class:`ManifestError` at the first mismatch.
    """
    if isinstance(layout, StoreLayout):
        layout.verify_artifacts(manifest)
        return
    snapshot = layout.path(manifest.checkpoint_id)
    for entry in manifest.participants:
        named: list[ArtifactRef] = list(entry.artifacts)
        if entry.manifest is not None:
            named.append(entry.manifest)
        for artifact in named:
            path = snapshot / artifact.path
            try:
                info = path.lstat()
            except FileNotFoundError:
                raise ManifestError(
                    f"snapshot {manifest.checkpoint_id!r}: {artifact.path} is missing",
                    checkpoint_id=manifest.checkpoint_id,
                    field="participants",
                ) from None
            if not stat.S_ISREG(info.st_mode) or info.st_size != artifact.size_bytes:
                raise ManifestError(
                    f"snapshot {manifest.checkpoint_id!r}: {artifact.path} has "
                    f"{info.st_size} bytes, the manifest says {artifact.size_bytes}",
                    checkpoint_id=manifest.checkpoint_id,
                    field="participants",
                )
            if _file_sha256(path) != artifact.sha256:
                raise ManifestError(
                    f"snapshot {manifest.checkpoint_id!r}: {artifact.path} does not match "
                    "its sha256",
                    checkpoint_id=manifest.checkpoint_id,
                    field="participants",
                )


def published_candidates(
    layout: SnapshotLayout | StoreLayout, known: Mapping[str, Candidate] | None = None
) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Every published snapshot as a restore candidate, newest first, and those whose
    manifest cannot be read (with why). ``known`` candidates are taken as they are (a
    published manifest never changes) instead of read again. Blocking: call it from a
    thread."""
    candidates: list[Candidate] = []
    unreadable: list[tuple[str, str]] = []
    for checkpoint_id in layout.list_published():
        if known is not None and checkpoint_id in known:
            candidates.append(known[checkpoint_id])
            continue
        try:
            manifest = layout.load(checkpoint_id)
        except (ManifestError, OSError, StorageError) as error:
            unreadable.append((checkpoint_id, str(error)))
            continue
        candidates.append(
            Candidate(checkpoint_id, manifest.step, manifest.created_at, metrics_of(manifest.extra))
        )
    return candidates, unreadable


@dataclass(frozen=True, slots=True)
class SelectedSnapshot:
    """The snapshot a restore uses, with its anchor loaded, and the ones set aside."""

    checkpoint_id: str
    manifest: SnapshotManifest
    step: int
    rejected: tuple[tuple[str, str], ...] = field(default=())


class Restorer:
    """Runs a restore (see the module docstring).

    ``load_anchor`` restores the trainer's model and optimizer in place
    (:func:`torch_anchor_loader`); it runs in a thread. When a participant refuses or
    fails the restore, ``allow_degraded`` starts every saved rollout over from its
    prompt (a warning); without it :meth:`restore` raises :class:`RestoreRefusedError`.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        layout: SnapshotLayout | StoreLayout,
        config: CoordinatorConfig,
        *,
        load_anchor: AnchorLoader,
        metrics: CoordinatorMetrics | None = None,
        allow_degraded: bool = True,
    ) -> None:
        self._coordinator = coordinator
        self._layout = layout
        self._config = config
        self._load_anchor = load_anchor
        self._metrics = metrics
        self._allow_degraded = allow_degraded

    async def select(self, topology: Topology) -> SelectedSnapshot | None:
        """The first snapshot the config's ``restore_from`` ranks (docs/spec.md section
        7.14; the newest by default) that passes every check; ``None`` if none was ever
        published. Raises :class:`NoUsableSnapshotError` if some were but none passes
        (or none matches the choice), and :class:`ManifestError` on a topology mismatch."""
        published = await asyncio.to_thread(self._layout.list_published)
        rejected: list[tuple[str, str]] = []
        choice = RestoreChoice.parse(self._config.restore_from)
        if published and choice.kind != "latest":
            candidates, rejected = await asyncio.to_thread(published_candidates, self._layout)
            published = [c.checkpoint_id for c in rank_candidates(choice, candidates)]
            if not published:
                rejected.append((str(choice), "no published snapshot matches this choice"))
        for checkpoint_id in published:
            try:
                manifest = await asyncio.to_thread(self._layout.load, checkpoint_id)
            except (ManifestError, OSError) as error:
                rejected.append((checkpoint_id, str(error)))
                _LOG.warning(
                    "snapshot %s is unusable, trying an older one: %s", checkpoint_id, error
                )
                continue
            topology.check_manifest(manifest)
            try:
                await asyncio.to_thread(verify_artifacts, self._layout, manifest)
                step = await asyncio.to_thread(
                    self._load_anchor, self._layout.path(checkpoint_id), manifest.anchor
                )
            except (TurnpointError, OSError) as error:
                rejected.append((checkpoint_id, str(error)))
                _LOG.warning(
                    "snapshot %s is unusable, trying an older one: %s", checkpoint_id, error
                )
                continue
            return SelectedSnapshot(checkpoint_id, manifest, step, tuple(rejected))
        if rejected:
            raise NoUsableSnapshotError(rejected)
        return None

    async def restore(self, restore_id: str | None = None) -> RestorePlan | None:
        """Restore the run; ``None`` when nothing was ever published (a fresh start).

        ``restore_id`` defaults to :func:`restore_id_for` the coordinator's epoch; then,
        when running participants refuse saved attempts they have moved past, the rest
        is restored in more rounds under the epoch's next restore ids (docs/spec.md
        section 7.7 item 7; at most :data:`MAX_STALE_ROUNDS`), those rollouts rerun from
        their prompts above what was seen. An explicit ``restore_id`` gets one round.
        """
        coordinator = self._coordinator
        epoch = coordinator.identity.epoch
        rounds = MAX_STALE_ROUNDS if restore_id is None else 0
        topology = await coordinator.discover()
        selected = await self.select(topology)
        if selected is None:
            return None
        target = RecoveryLevel.parse(self._config.target_level)
        # Participants that outlived a trainer killed inside a snapshot are still closed
        # under its id: a restore needs them idle (docs/spec.md section 7.7 item 6).
        await coordinator.release_left_open()
        seen_since: dict[str, int] = {}
        kept: set[EpisodeId] = set()
        stale_rounds = 0
        while True:
            round_id = restore_id or restore_id_for(epoch, stale_rounds)
            # The levels discovery decided (and warned about once): the plan uses those.
            plan = plan_restore(
                selected.manifest,
                topology,
                target,
                restore_id=round_id,
                step=selected.step,
                levels=coordinator.levels,
                seen_since=seen_since,
                retired=kept,
            )
            plan = replace(plan, stale_rounds=stale_rounds)
            try:
                async with coordinator.restored(
                    round_id,
                    selected.checkpoint_id,
                    selected.manifest,
                    plan.restore_scope,
                    another_round=stale_rounds < rounds,
                ) as restored:
                    pass
                if restored.release is not None and restored.release.failures:
                    plan = replace(plan, unreleased=frozenset(restored.release.failures))
                break
            except RestoreFailed as error:
                if error.seen_since is not None:
                    seen_since = merge_stale(seen_since, error.seen_since)
                if error.replacements_kept:
                    _LOG.info(
                        "restore %s of %s: %d saved rollout(s) moved on where they ran; "
                        "they rerun from their prompts, the rest is restored again",
                        round_id,
                        selected.checkpoint_id,
                        len(error.seen_since or {}),
                    )
                    kept |= set(error.replacements)
                    stale_rounds += 1
                    continue
                if not self._allow_degraded:
                    raise RestoreRefusedError(selected.checkpoint_id, error) from error
                _LOG.warning(
                    "restore %s of %s failed; every continuation starts over from its prompt: %s",
                    round_id,
                    selected.checkpoint_id,
                    error,
                )
                plan = plan_restore(
                    selected.manifest,
                    topology,
                    target,
                    restore_id=round_id,
                    step=selected.step,
                    restore_failed=True,
                    retired=kept | set(error.replacements),
                    levels=coordinator.levels,
                    seen_since=seen_since,
                )
                # A failed cleanup (its retire or its resume) may leave a participant closed.
                plan = replace(plan, unreleased=frozenset(error.cleanup), stale_rounds=stale_rounds)
                break
        if self._metrics is not None:
            self._metrics.observe_restore(
                resumed=plan.resumed,
                rerun=plan.rerun_count,
                groups_retried_whole=plan.groups_retried_whole,
                sealed_siblings_discarded=plan.sealed_siblings_discarded,
            )
        _LOG.info(
            "restored %s: %d sibling(s) resume from a saved turn, %d rerun, %d group(s) "
            "retried whole, %d finished sibling(s) discarded",
            selected.checkpoint_id,
            plan.resumed,
            plan.rerun_count,
            plan.groups_retried_whole,
            plan.sealed_siblings_discarded,
        )
        return plan
