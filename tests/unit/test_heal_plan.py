"""Healing one lost participant: the pure decision (docs/spec.md section 7.15).

Two worked cases first (a lost resources server, a lost agent), then hypothesis over
random topologies, snapshots and rollouts in flight, with the invariants of the
decision asserted on every plan: every live rollout is continued, rerun or left alone,
exactly one of those; everything that depended on the lost participant is touched and
nothing else is (except whole prompt groups); a continued episode is restored on every
participant that saved it and nowhere else; reruns go above every attempt seen; nothing
is sent to the lost instance but its replacement's restore. Restore ids increase.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fakes import saved as descriptor
from turnpoint.ids import EpisodeId, checkpoint_sequence
from turnpoint.protocol import ArtifactRef, ParticipantKind, RecoveryLevel
from turnpoint.trainer.restore.heal import (
    HealPlan,
    HealRerunReason,
    Member,
    plan_heal,
    restore_id_for,
)
from turnpoint.trainer.rollouts.side import InFlightRollout
from turnpoint.trainer.snapshots.levels import LevelDecision
from turnpoint.trainer.storage.manifest import (
    AnchorRef,
    ParticipantEntry,
    PlacedEpisode,
    SnapshotManifest,
    TrainerRolloutState,
)

DIGEST = "0" * 64
AGENT, RESOURCES, MODEL = ParticipantKind.AGENT, ParticipantKind.RESOURCES, ParticipantKind.MODEL


def level(environment: str, effective: RecoveryLevel, *, scored: bool = False) -> LevelDecision:
    return LevelDecision(environment, RecoveryLevel.TURN, effective, (), scored)


def rollout(
    rollout_id: str,
    attempt: int,
    agent: str,
    *,
    group: str = "g",
    environment: str = "math",
    boundaries: int = 1,
) -> InFlightRollout:
    return InFlightRollout(
        episode=EpisodeId(rollout_id, attempt),
        instance=agent,
        prompt_group_id=group,
        sibling_index=0,
        group_size=1,
        environment=environment,
        boundaries_seen=boundaries,
    )


def manifest(
    members: Sequence[Member],
    continued: Sequence[InFlightRollout],
    sessions: dict[str, Sequence[EpisodeId]],
) -> SnapshotManifest:
    """Snapshot C: each agent exported its ``continued`` rollouts, each resources server
    the ``sessions`` listed for it."""
    exports: dict[str, list[EpisodeId]] = {m.instance: [] for m in members}
    for saved in continued:
        exports[saved.instance].append(saved.episode)
    for instance, episodes in sessions.items():
        exports[instance].extend(episodes)
    return SnapshotManifest(
        checkpoint_id="ck-000000000007",
        step=3,
        created_at=1.0,
        anchor=AnchorRef(sha256=DIGEST),
        participants=tuple(
            ParticipantEntry(
                instance=m.instance,
                kind=m.kind,
                artifacts=(ArtifactRef(f"{m.instance}/records.jsonl", DIGEST, 1, 1),)
                if exports[m.instance]
                else (),
                manifest=ArtifactRef(f"{m.instance}/MANIFEST.json", DIGEST, 1, 0)
                if exports[m.instance]
                else None,
                exported=tuple(exports[m.instance]),
            )
            for m in members
        ),
        continued=tuple(PlacedEpisode(r.episode, r.instance) for r in continued),
        rollout_state=TrainerRolloutState(
            attempts={r.episode.rollout_id: r.episode.attempt for r in continued},
            in_flight=tuple(descriptor(r) for r in continued),
        ),
    )


TWO_BY_TWO = (
    Member("agent-0", AGENT, "math"),
    Member("agent-1", AGENT, "math"),
    Member("tools-0", RESOURCES, "math"),
    Member("tools-1", RESOURCES, "math"),
    Member("policy", MODEL),
)
TURN_LEVELS = {"math": level("math", RecoveryLevel.TURN)}


def test_a_lost_resources_server_restores_its_sessions_on_the_replacement_and_the_agents_in_place() -> (
    None
):
    a = rollout("a", 0, "agent-0")  # session on tools-0, saved in C: continues
    b = rollout("b", 2, "agent-1")  # session on tools-1: untouched
    c = rollout("c", 0, "agent-1")  # started after C: its environment's servers unknown
    snapshot = manifest(TWO_BY_TWO, [a, b], {"tools-0": [a.episode], "tools-1": [b.episode]})
    a_now = replace(a, boundaries_seen=3)  # two turns past the cut
    plan = plan_heal(
        snapshot,
        [a_now, b, c],
        "tools-0",
        TWO_BY_TWO,
        TURN_LEVELS,
        target=RecoveryLevel.TURN,
        restore_id=restore_id_for(4, 1),
    )
    assert [step.episode for step in plan.continued] == [EpisodeId("a", 1)]
    assert plan.continued[0].rollout == a  # from C's boundary: those two turns are redone
    assert plan.replacement_scope == (a.episode,)
    assert plan.running_scope == {"agent-0": (a.episode,)}
    assert [(r.episode, r.reason) for r in plan.rerun] == [
        (EpisodeId("c", 1), HealRerunReason.NOT_IN_SNAPSHOT)
    ]
    assert plan.retire == {"agent-1": (c.episode,), "tools-1": (c.episode,)}
    assert plan.untouched == ("b",)
    assert not plan.push_weights


def test_a_scored_group_with_a_finished_sibling_reruns_whole_when_its_verifier_is_lost() -> None:
    """The verifier's group state (the finished sibling's answer) went with the lost
    server, and a finished sibling never submits again: the siblings continued from C
    would wait for it forever. The group reruns whole, its finished sibling too."""
    members = (
        Member("agent-0", AGENT, "duel"),
        Member("agent-1", AGENT, "duel"),
        Member("judge", RESOURCES, "duel"),
    )
    levels = {"duel": level("duel", RecoveryLevel.TURN, scored=True)}
    s1 = rollout("s1", 0, "agent-0", group="g7", environment="duel")
    s2 = rollout("s2", 0, "agent-1", group="g7", environment="duel")
    other = rollout("o1", 0, "agent-1", group="g8", environment="duel")
    snapshot = manifest(
        members, [s1, s2, other], {"judge": [s1.episode, s2.episode, other.episode]}
    )

    def heal(finished: Sequence[str]) -> HealPlan:
        return plan_heal(
            snapshot,
            [s1, s2, other],
            "judge",
            members,
            levels,
            target=RecoveryLevel.TURN,
            restore_id=restore_id_for(2, 1),
            finished_groups=finished,
        )

    plan = heal(["g7"])
    assert plan.regroup == ("g7",)
    assert [(r.episode, r.reason) for r in plan.rerun] == [
        (EpisodeId("s1", 1), HealRerunReason.GROUP_FINISHED),
        (EpisodeId("s2", 1), HealRerunReason.GROUP_FINISHED),
    ]
    assert [step.episode for step in plan.continued] == [EpisodeId("o1", 1)]
    # Without a finished sibling every sibling re-submits after its restore: continued.
    assert heal([]).regroup == () and len(heal([]).continued) == 3


def test_a_lost_agent_restores_its_episodes_on_the_replacement_and_their_sessions_in_place() -> (
    None
):
    a = rollout("a", 0, "agent-0")
    moved = rollout("m", 3, "agent-0")  # C saved attempt 1; it was rerun since
    b = rollout("b", 0, "agent-1")
    saved_moved = rollout("m", 1, "agent-0")
    snapshot = manifest(
        TWO_BY_TWO,
        [a, saved_moved, b],
        {"tools-0": [a.episode, saved_moved.episode], "tools-1": [a.episode, b.episode]},
    )
    plan = plan_heal(
        snapshot,
        [a, moved, b],
        "agent-0",
        TWO_BY_TWO,
        TURN_LEVELS,
        target=RecoveryLevel.TURN,
        restore_id=restore_id_for(4, 2),
        retired=[EpisodeId("m", 4)],
    )
    assert plan.replacement_scope == (a.episode,)
    assert plan.running_scope == {"tools-0": (a.episode,), "tools-1": (a.episode,)}
    assert [(r.episode, r.reason) for r in plan.rerun] == [
        (EpisodeId("m", 5), HealRerunReason.ATTEMPT_MOVED)
    ]
    assert plan.retire == {"tools-0": (moved.episode,), "tools-1": (moved.episode,)}
    assert plan.untouched == ("b",)


def test_a_lost_policy_model_touches_no_episode_and_asks_for_the_weights() -> None:
    a = rollout("a", 0, "agent-0")
    plan = plan_heal(
        manifest(TWO_BY_TWO, [a], {"tools-0": [a.episode]}),
        [a],
        "policy",
        TWO_BY_TWO,
        TURN_LEVELS,
        target=RecoveryLevel.TURN,
        restore_id=restore_id_for(1, 1),
    )
    assert plan.touched == 0 and plan.untouched == ("a",) and plan.push_weights
    assert plan.replacement_scope == () and plan.running_scope == {} and plan.retire == {}


def test_restore_ids_increase_across_heals_and_epochs() -> None:
    ids = [
        restore_id_for(epoch, heal) for epoch in (1, 2, 999, 1000) for heal in (0, 1, 7, 10**9 - 1)
    ]
    sequences = [checkpoint_sequence(restore) for restore in ids]
    assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
    assert restore_id_for(3) == "restore-003000000000"


# ------------------------------------------------------------------- properties


@dataclass(frozen=True)
class World:
    members: tuple[Member, ...]
    snapshot: SnapshotManifest
    live: tuple[InFlightRollout, ...]
    levels: dict[str, LevelDecision]
    target: RecoveryLevel
    lost: str
    retired: tuple[EpisodeId, ...]


ENVIRONMENTS = ("math", "code")


@st.composite
def worlds(draw: st.DrawFn) -> World:
    agents = [
        Member(f"agent-{i}", draw(st.sampled_from((AGENT, ParticipantKind.ENVIRONMENT))), env)
        for i, env in enumerate(
            draw(st.lists(st.sampled_from(ENVIRONMENTS), min_size=1, max_size=3))
        )
    ]
    tools = [
        Member(f"tools-{i}", RESOURCES, env)
        for i, env in enumerate(draw(st.lists(st.sampled_from(ENVIRONMENTS), max_size=3)))
    ]
    members = (*agents, *tools, Member("policy", MODEL))
    coarseness = st.sampled_from(
        (RecoveryLevel.TURN, RecoveryLevel.SIBLING, RecoveryLevel.PROMPT_GROUP)
    )
    target = draw(coarseness)
    # An environment no participant describes has no decision: the target applies.
    levels = {
        env: level(env, draw(coarseness), scored=draw(st.booleans()))
        for env in ENVIRONMENTS
        if draw(st.booleans())
    }
    continued: list[InFlightRollout] = []
    live: list[InFlightRollout] = []
    sessions: dict[str, list[EpisodeId]] = {}
    retired: list[EpisodeId] = []
    for index in range(draw(st.integers(0, 10))):
        agent = draw(st.sampled_from(agents))
        rollout_id = f"r{index}"
        group = f"g{draw(st.integers(0, 3))}"
        attempt = draw(st.integers(0, 3))
        here = rollout(
            rollout_id,
            attempt,
            agent.instance,
            group=group,
            environment=agent.environment,
            boundaries=draw(st.integers(0, 3)),
        )
        story = draw(st.sampled_from(("saved", "saved", "moved", "new", "finished")))
        if story in ("saved", "moved", "finished"):
            continued.append(here)
            servers = [t for t in tools if t.environment == agent.environment]
            for server in draw(st.lists(st.sampled_from(servers), unique=True)) if servers else ():
                sessions.setdefault(server.instance, []).append(here.episode)
        if story == "saved" or story == "new":
            live.append(
                replace(here, boundaries_seen=here.boundaries_seen + draw(st.integers(0, 2)))
            )
        elif story == "moved":
            later = attempt + draw(st.integers(1, 2))
            live.append(
                rollout(
                    rollout_id, later, agent.instance, group=group, environment=agent.environment
                )
            )
        if draw(st.booleans()):
            retired.append(EpisodeId(rollout_id, attempt + draw(st.integers(0, 4))))
    lost = draw(st.sampled_from([m.instance for m in members]))
    return World(
        members,
        manifest(members, continued, sessions),
        tuple(live),
        levels,
        target,
        lost,
        tuple(retired),
    )


def _check_invariants(world: World, plan: HealPlan) -> None:
    by_id = {r.episode.rollout_id: r for r in world.live}
    lost = next(m for m in world.members if m.instance == world.lost)
    saved = {p.episode.rollout_id: p for p in world.snapshot.continued}
    at_cut = {
        EpisodeId(raw["rollout_id"], raw["attempt"]): raw["boundaries_seen"]
        for raw in world.snapshot.rollout_state.in_flight
    }
    exporters: dict[EpisodeId, set[str]] = {}
    for entry in world.snapshot.participants:
        for episode in entry.exported:
            exporters.setdefault(episode, set()).add(entry.instance)

    continued = [c.rollout.episode.rollout_id for c in plan.continued]
    rerun = [r.rollout.episode.rollout_id for r in plan.rerun]
    # Every live rollout has exactly one fate.
    assert sorted([*continued, *rerun, *plan.untouched]) == sorted(by_id)

    kinds = {m.instance: m.kind for m in world.members}

    def depends(r: InFlightRollout) -> bool:
        if lost.kind is MODEL:
            return False
        if r.instance == lost.instance:
            return True
        if lost.kind is not RESOURCES:
            return False
        placed = saved.get(r.episode.rollout_id)
        known = (
            {i for i in exporters.get(r.episode, ()) if kinds[i] is RESOURCES}
            if placed is not None and placed.episode == r.episode
            else set()
        )
        return lost.instance in known if known else r.environment == lost.environment

    def effective(environment: str) -> RecoveryLevel:
        decision = world.levels.get(environment)
        return world.target if decision is None else decision.effective

    def scored(environment: str) -> bool:
        decision = world.levels.get(environment)
        return decision is not None and decision.group_scored

    whole = {
        by_id[rid].prompt_group_id
        for rid in rerun
        if scored(by_id[rid].environment)
        or effective(by_id[rid].environment) is RecoveryLevel.PROMPT_GROUP
    }
    for rid in plan.untouched:
        assert not depends(by_id[rid]), f"{rid} depended on {lost.instance} but keeps running"
        assert by_id[rid].prompt_group_id not in whole
    for rid in [*continued, *rerun]:
        assert depends(by_id[rid]) or by_id[rid].prompt_group_id in whole
    if lost.kind is MODEL:
        assert plan.touched == 0 and plan.push_weights

    # A continuation is the very attempt C saved, at a level that continues turns.
    expected_scopes: set[tuple[str, EpisodeId]] = set()
    for step in plan.continued:
        r = step.rollout
        assert saved[r.episode.rollout_id] == PlacedEpisode(r.episode, r.instance)
        assert r == replace(by_id[r.episode.rollout_id], boundaries_seen=at_cut[r.episode])
        assert effective(r.environment) <= RecoveryLevel.TURN
        assert r.prompt_group_id not in whole
        expected_scopes |= {(instance, r.episode) for instance in exporters[r.episode]}
    scopes = {(world.lost, e) for e in plan.replacement_scope} | {
        (instance, e) for instance, episodes in plan.running_scope.items() for e in episodes
    }
    assert scopes == expected_scopes
    assert world.lost not in plan.running_scope and world.lost not in plan.retire
    assert all(plan.running_scope.values()) and all(plan.retire.values())

    # Reruns go above every attempt seen and retire what may still run.
    retired_to_do = {(i, e) for i, episodes in plan.retire.items() for e in episodes}
    for step in plan.rerun:
        r = step.rollout
        assert step.attempt > r.episode.attempt
        placed = saved.get(r.episode.rollout_id)
        assert placed is None or step.attempt > placed.episode.attempt
        for burned in world.retired:
            if burned.rollout_id == r.episode.rollout_id:
                assert step.attempt > burned.attempt
        if r.instance != world.lost:
            assert (r.instance, r.episode) in retired_to_do
    rerun_episodes = {r.rollout.episode for r in plan.rerun}
    assert {e for _, e in retired_to_do} <= rerun_episodes


@settings(max_examples=150, deadline=None)
@given(worlds(), st.randoms(use_true_random=False))
def test_every_heal_touches_what_depended_on_the_lost_participant_and_nothing_else(
    world: World, shuffle: random.Random
) -> None:
    plan = plan_heal(
        world.snapshot,
        world.live,
        world.lost,
        world.members,
        world.levels,
        target=world.target,
        restore_id=restore_id_for(2, 1),
        retired=world.retired,
    )
    _check_invariants(world, plan)
    # The order the rollouts and members come in changes nothing.
    live, members = list(world.live), list(world.members)
    shuffle.shuffle(live)
    shuffle.shuffle(members)
    again = plan_heal(
        world.snapshot,
        live,
        world.lost,
        members,
        world.levels,
        target=world.target,
        restore_id=restore_id_for(2, 1),
        retired=world.retired,
    )
    assert again == plan
