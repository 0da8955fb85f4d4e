"""Healing one lost participant in place: which episodes are restored where.

docs/spec.md section 7.15. When one participant is lost and replaced under the same
instance name, only the rollouts that depended on it are cut back to the last published
snapshot C; every other rollout keeps running. :func:`plan_heal` decides, from C's
manifest, the rollouts in flight now and the lost instance:

- which live rollouts the loss touches: every rollout of a lost agent; for a lost
  resources server, every rollout with a session there (C's exports say where C's
  sessions live; a rollout C does not place is taken to depend on every resources
  server of its environment, since agents, not the trainer, choose the server);
- which of those continue from C as attempt N+1 (the attempt still running is the one C
  saved, at a level that continues turns) and which rerun from their prompts;
- the restore scope of the fresh replacement (Restore, section 4.10) and of each live
  participant (RestoreRunning with ``retire_unscoped`` false, section 4.16): every
  participant that exported a continued episode in C gets it back, nothing else;
- which live attempts must be retired before a rerun (the rerun's old attempt where it
  may still run: its agent, its environment's resources servers);
- which prompt groups rerun whole, their finished siblings included: a group-scored
  group with a session on a lost resources server and a sibling that finished (its
  result awaits training). The verifier's group state went with the lost server, and a
  finished sibling never submits again, so siblings continued from C would wait for it
  forever; the whole group reruns from its prompts instead.

A lost policy model touches no episode: it holds none (section 5.4 item 5); its
replacement needs the trainer's current weights before it takes calls.

Pure: no grpc, no asyncio, no clock. :func:`restore_id_for` numbers every restore of a
coordinator epoch, the start's and each heal's (section 2.6 item 4).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.protocol import ParticipantKind, RecoveryLevel
from turnpoint.trainer.rollouts.side import InFlightRollout
from turnpoint.trainer.snapshots.levels import LevelDecision
from turnpoint.trainer.storage.manifest import SnapshotManifest

RESTORE_EPOCH_STRIDE: Final = 10**9
"""Restore sequences of epoch ``e`` are ``e * RESTORE_EPOCH_STRIDE + n``: ``n`` = 0 for
the start's restore, 1, 2, ... for each heal (the same stride as checkpoint ids)."""

# Who runs rollouts; a combined environment also holds its own rollouts' sessions, so
# only a resources server holds sessions of rollouts that run elsewhere.
_ROLLOUT_KINDS: Final = frozenset({ParticipantKind.AGENT, ParticipantKind.ENVIRONMENT})


def restore_id_for(epoch: int, heal: int = 0) -> str:
    """The restore id of coordinator ``epoch``'s start (``heal`` 0) or of its ``heal``-th
    heal (1, 2, ...). Strictly increasing in (epoch, heal), so a later restore always
    supersedes an earlier one at every participant (docs/spec.md section 2.6 item 4)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise ValueError(f"epoch must be an integer >= 1, got {epoch!r}")
    if isinstance(heal, bool) or not isinstance(heal, int) or not 0 <= heal < RESTORE_EPOCH_STRIDE:
        raise ValueError(f"heal must be an integer in [0, {RESTORE_EPOCH_STRIDE}), got {heal!r}")
    return make_checkpoint_id("restore", epoch * RESTORE_EPOCH_STRIDE + heal)


@dataclass(frozen=True, slots=True)
class Member:
    """One participant of the topology, as the heal needs it."""

    instance: str
    kind: ParticipantKind
    environment: str = ""


class HealRerunReason(enum.Enum):
    """Why a touched rollout reruns from its prompt instead of continuing from C."""

    # It started after C (or C did not save it): there is no saved turn to go back to.
    NOT_IN_SNAPSHOT = "not_in_snapshot"
    # The attempt running now is not the one C saved (it was retried or continued since).
    ATTEMPT_MOVED = "attempt_moved"
    # Its environment's effective level is coarser than turn.
    LEVEL = "level"
    # A sibling of its prompt group reruns and the group is scored (or restored) whole.
    GROUP = "group"
    # Its group is scored by a lost resources server and a sibling already finished:
    # the group reruns whole, the finished siblings too (:attr:`HealPlan.regroup`).
    GROUP_FINISHED = "group_finished"


@dataclass(frozen=True, slots=True)
class HealContinue:
    """Continue ``rollout`` (its saved attempt N, still running) as N+1 on its agent.

    ``rollout`` is the live rollout with ``boundaries_seen`` as C saved it: the N+1
    restarts from C's boundary, so the boundaries seen since are seen again."""

    rollout: InFlightRollout

    @property
    def episode(self) -> EpisodeId:
        return self.rollout.episode.next_attempt()


@dataclass(frozen=True, slots=True)
class HealRerun:
    """Start ``rollout`` over from its prompt as ``attempt`` on its agent."""

    rollout: InFlightRollout
    attempt: int
    reason: HealRerunReason

    @property
    def episode(self) -> EpisodeId:
        return EpisodeId(self.rollout.episode.rollout_id, self.attempt)


@dataclass(frozen=True, slots=True)
class HealPlan:
    """What healing ``lost`` does (see the module docstring). Every sequence is sorted."""

    lost: Member
    # The snapshot continued from ("" when none was published).
    checkpoint_id: str
    restore_id: str
    # Restore (section 4.10) onto the fresh replacement of ``lost``.
    replacement_scope: tuple[EpisodeId, ...]
    # RestoreRunning, retire_unscoped false (section 4.16), per live participant; only
    # participants with a non-empty scope are listed.
    running_scope: Mapping[str, tuple[EpisodeId, ...]]
    # Live attempts to retire before their reruns start, per live participant.
    retire: Mapping[str, tuple[EpisodeId, ...]]
    continued: tuple[HealContinue, ...]
    rerun: tuple[HealRerun, ...]
    # Live rollouts the loss does not touch: they keep running.
    untouched: tuple[str, ...]
    # The replacement must get the trainer's current weights before it takes calls.
    push_weights: bool = False
    # Prompt groups whose finished siblings (results not trained yet) rerun from their
    # prompts too, with the group's live siblings (reason GROUP_FINISHED).
    regroup: tuple[str, ...] = ()

    @property
    def touched(self) -> int:
        return len(self.continued) + len(self.rerun)

    @property
    def reason(self) -> str:
        """One line for a log or a report."""
        return (
            f"{self.lost.instance} ({self.lost.kind.value}) lost: {len(self.continued)} "
            f"rollout(s) continue from {self.checkpoint_id}, {len(self.rerun)} rerun from "
            f"their prompts, {len(self.untouched)} keep running"
        )


def plan_heal(
    manifest: SnapshotManifest | None,
    live: Sequence[InFlightRollout],
    lost: str,
    members: Iterable[Member],
    levels: Mapping[str, LevelDecision],
    *,
    target: RecoveryLevel,
    restore_id: str,
    retired: Iterable[EpisodeId] = (),
    finished_groups: Iterable[str] = (),
) -> HealPlan:
    """Decide how to heal the loss of ``lost`` (see the module docstring).

    ``manifest`` is the last published snapshot C (``None`` before any: every touched
    rollout reruns from its prompt); ``live`` the rollouts in flight now
    (per the attempt ledger); ``members`` the topology (``lost`` among them); ``levels``
    each environment's effective recovery level as discovery decided it; an environment
    no participant describes has the configuration's ``target`` level, as at a restore. ``retired`` are attempts retired earlier (a heal that failed after its
    retire): a rerun goes above them, as a participant refuses every attempt up to one.
    ``finished_groups`` are the prompt groups with a finished sibling whose result waits
    for the rest of its group (the ledger's queue).
    """
    topology = {member.instance: member for member in members}
    if lost not in topology:
        raise ValueError(f"lost instance {lost!r} is not in the topology")
    lost_member = topology[lost]
    live_by_id: dict[str, InFlightRollout] = {}
    for rollout in live:
        rollout_id = rollout.episode.rollout_id
        if rollout_id in live_by_id:
            raise ValueError(f"rollout {rollout_id!r} is in flight twice")
        live_by_id[rollout_id] = rollout

    continued_at_cut = manifest.continued if manifest is not None else ()
    saved = {placed.episode.rollout_id: placed for placed in continued_at_cut}
    boundaries_at_cut: dict[str, int] = {}
    for raw in manifest.rollout_state.in_flight if manifest is not None else ():
        saved_id, seen = raw.get("rollout_id"), raw.get("boundaries_seen", 0)
        if isinstance(saved_id, str) and isinstance(seen, int) and not isinstance(seen, bool):
            boundaries_at_cut[saved_id] = max(0, seen)
    exporters: dict[EpisodeId, list[str]] = {}
    placed_sessions: dict[str, set[str]] = {}
    for entry in manifest.participants if manifest is not None else ():
        for episode in entry.exported:
            exporters.setdefault(episode, []).append(entry.instance)
            if entry.kind is ParticipantKind.RESOURCES:
                placed_sessions.setdefault(episode.rollout_id, set()).add(entry.instance)
    session_servers: dict[str, list[str]] = {}
    for member in topology.values():
        if member.kind is ParticipantKind.RESOURCES:
            session_servers.setdefault(member.environment, []).append(member.instance)

    def sessions_of(rollout: InFlightRollout) -> set[str]:
        """The resources servers where ``rollout`` may hold sessions: where C placed them
        if C saved this very attempt there, else every one of its environment."""
        placed = saved.get(rollout.episode.rollout_id)
        known = placed_sessions.get(rollout.episode.rollout_id)
        if placed is not None and placed.episode == rollout.episode and known:
            return set(known)
        return set(session_servers.get(rollout.environment, ()))

    def depends_on_lost(rollout: InFlightRollout) -> bool:
        if lost_member.kind in _ROLLOUT_KINDS and rollout.instance == lost:
            return True
        return lost_member.kind is ParticipantKind.RESOURCES and lost in sessions_of(rollout)

    touched = {rid for rid, rollout in live_by_id.items() if depends_on_lost(rollout)}

    def rerun_reason(rollout: InFlightRollout) -> HealRerunReason | None:
        placed = saved.get(rollout.episode.rollout_id)
        if placed is None:
            return HealRerunReason.NOT_IN_SNAPSHOT
        if placed.episode != rollout.episode or placed.instance != rollout.instance:
            return HealRerunReason.ATTEMPT_MOVED
        if effective(rollout.environment) > RecoveryLevel.TURN:
            return HealRerunReason.LEVEL
        return None

    def effective(environment: str) -> RecoveryLevel:
        decision = levels.get(environment)
        return target if decision is None else decision.effective

    reasons = {rid: rerun_reason(live_by_id[rid]) for rid in touched}
    # A group-scored group whose verifier was the lost server, with a sibling that
    # finished: that sibling's answer went with the server and is never submitted again.
    finished = set(finished_groups)
    regroup: set[str] = set()
    if lost_member.kind is ParticipantKind.RESOURCES:
        for rid in touched:
            rollout = live_by_id[rid]
            decision = levels.get(rollout.environment)
            scored = decision is not None and decision.group_scored
            if scored and rollout.prompt_group_id in finished:
                reasons[rid] = HealRerunReason.GROUP_FINISHED
                regroup.add(rollout.prompt_group_id)
    # A scored (or whole-group) prompt group whose sibling reruns reruns whole: its live
    # siblings elsewhere are pulled in, as a restore does (section 7.7 item 5).
    whole_groups = {
        live_by_id[rid].prompt_group_id
        for rid, why in reasons.items()
        if why is not None and _group_reruns_whole(levels.get(live_by_id[rid].environment), target)
    }
    for rid, rollout in live_by_id.items():
        if rollout.prompt_group_id in whole_groups and reasons.get(rid) is None:
            touched.add(rid)
            reasons[rid] = HealRerunReason.GROUP

    burned: dict[str, int] = {}
    for episode in retired:
        burned[episode.rollout_id] = max(burned.get(episode.rollout_id, -1), episode.attempt)

    continued: list[HealContinue] = []
    rerun: list[HealRerun] = []
    replacement_scope: list[EpisodeId] = []
    running_scope: dict[str, list[EpisodeId]] = {}
    retire: dict[str, list[EpisodeId]] = {}
    for rid in sorted(touched):
        rollout = live_by_id[rid]
        why = reasons[rid]
        if why is None:
            saved_boundaries = boundaries_at_cut.get(rid, 0)
            continued.append(HealContinue(replace(rollout, boundaries_seen=saved_boundaries)))
            for instance in exporters.get(rollout.episode, ()):
                if instance == lost:
                    replacement_scope.append(rollout.episode)
                else:
                    running_scope.setdefault(instance, []).append(rollout.episode)
            continue
        placed = saved.get(rid)
        attempt = 1 + max(
            rollout.episode.attempt,
            placed.episode.attempt if placed is not None else -1,
            burned.get(rid, -1),
        )
        rerun.append(HealRerun(rollout, attempt, why))
        for instance in {rollout.instance, *sessions_of(rollout)} - {lost}:
            retire.setdefault(instance, []).append(rollout.episode)

    return HealPlan(
        lost=lost_member,
        checkpoint_id=manifest.checkpoint_id if manifest is not None else "",
        restore_id=restore_id,
        replacement_scope=tuple(sorted(replacement_scope)),
        running_scope=_frozen(running_scope),
        retire=_frozen(retire),
        continued=tuple(continued),
        rerun=tuple(rerun),
        untouched=tuple(sorted(set(live_by_id) - touched)),
        push_weights=lost_member.kind is ParticipantKind.MODEL,
        regroup=tuple(sorted(regroup)),
    )


def _group_reruns_whole(decision: LevelDecision | None, target: RecoveryLevel) -> bool:
    if decision is None:
        return target is RecoveryLevel.PROMPT_GROUP
    return decision.group_scored or decision.effective is RecoveryLevel.PROMPT_GROUP


def _frozen(scopes: Mapping[str, list[EpisodeId]]) -> Mapping[str, tuple[EpisodeId, ...]]:
    return MappingProxyType(
        {instance: tuple(sorted(episodes)) for instance, episodes in sorted(scopes.items())}
    )
