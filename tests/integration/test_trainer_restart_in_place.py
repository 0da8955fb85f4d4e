"""A trainer restarted alone restores into the participants that kept running
(docs/spec.md sections 4.16 and 7.7 item 7, issue 24 item 3).

Real participants on 127.0.0.1:0 (policy, both resources servers, one agent), never
restarted. The first trainer parks one group-scored sibling of each of two groups at its
verify (alone, it waits for its sibling forever, so both are in flight whatever the
timing) and publishes snapshot C. After C, as fenced incarnations would have done before
dying (the last of them inside a snapshot, every participant left prepared): group 1's parked sibling finished (its sibling came, the group was trained) and
was retired everywhere (refusal mark 0 = the saved attempt), and group 3's was retried
as attempt 1 and retired on the group-scored resources server (mark 1 = the N+1 a
restore would install). A new trainer then restores C into the same processes:

- group 1's sibling continues from its saved turn as attempt 1, above the mark 0;
- group 3's sibling cannot be installed as attempt 1 (seen there): that server refuses
  it, listing it with its mark, and the coordinator reruns it from its prompt above the
  mark and restores the rest in a second round, under the epoch's next restore id;
- both groups then finish: no participant restarted, nothing lost.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.participants import TOKEN, start_topology
from turnpoint.apps.examples._guess_jobs import guess_rollouts
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    RolloutOutcome,
    SnapshotOutcome,
    TorchAnchorSource,
    torch_anchor_loader,
)
from turnpoint.trainer.advanced import Coordinator, bump_epoch
from turnpoint.trainer.snapshots.driver import EPOCH_STRIDE

GROUP_SIZE = 2
BOUND_S = 60.0


def _trainer(root: Path, participants: dict[str, str]) -> Checkpointing:
    model = torch.nn.Linear(2, 2)
    return Checkpointing(
        CoordinatorConfig(snapshot_root=root, control_timeout_s=10.0),
        participants,
        token=TOKEN,
        anchor=TorchAnchorSource(model, None, step=lambda: 0),
        load_anchor=torch_anchor_loader(model, None),
        periodic=False,
        final_snapshot=False,
    )


async def test_a_new_trainer_restores_into_running_participants_above_what_they_saw(
    tmp_path: Path,
) -> None:
    root = tmp_path / "p"
    async with start_topology(root, agents=1, group_size=GROUP_SIZE) as topology:
        participants = {n: h.address for n, h in topology.participants.items()}
        finished = guess_rollouts(1, GROUP_SIZE, 0, ("agent-0",))
        retried = guess_rollouts(3, GROUP_SIZE, 0, ("agent-0",))
        first = _trainer(root, participants)
        async with first:
            first.dispatch(finished[0])
            first.dispatch(retried[0])
            rollouts = first.rollouts
            await rollouts.wait_for(
                lambda: sum(r.boundaries_seen >= 1 for r in rollouts.in_flight()) == 2, BOUND_S
            )
            report = await first.snapshot_now()
            assert report.outcome is SnapshotOutcome.PUBLISHED, report
            first.dispatch(finished[1])
            assert await first.wait_groups(1, timeout_s=BOUND_S)
            (trained,) = first.take_ready_groups(1)
            assert {r.episode.rollout_id for r in trained} == {r.rollout_id for r in finished}

        # What the incarnations after C did before they died, done here by one of them.
        saved_finished = EpisodeId(finished[0].rollout_id, 0)
        saved_retried = EpisodeId(retried[0].rollout_id, 0)
        identity = bump_epoch(root)
        async with Coordinator(
            participants,
            token=TOKEN,
            coordinator_id=identity.coordinator_id,
            epoch=identity.epoch,
            config=CoordinatorConfig(snapshot_root=root),
        ) as fenced:
            await fenced.discover()
            every = {name: [saved_finished] for name in participants}
            every["agent-0"] = [saved_finished, saved_retried]
            every["group-tools"] = [saved_finished, saved_retried.next_attempt()]
            report_retire = await fenced.retire(every)
            assert not report_retire.failures, report_retire
            # It died inside a snapshot: every participant is left prepared, closed.
            await fenced.prepare(make_checkpoint_id("ck", identity.epoch * EPOCH_STRIDE + 1))

        second = _trainer(root, participants)
        async with second:
            resumed = second.resumed
            assert resumed.checkpoint_id == report.checkpoint_id
            assert (resumed.resumed_rollouts, resumed.rerun_rollouts) == (1, 1)
            # The sibling dispatched after C is new to this trainer: it runs again, as the
            # data loader restored from C would send it.
            second.dispatch(finished[1])
            second.dispatch(retried[1])
            assert await second.wait_groups(2, timeout_s=BOUND_S)
            groups = second.take_ready_groups(2)
        attempts = {r.episode.rollout_id: r.episode.attempt for g in groups for r in g}
        assert attempts[finished[0].rollout_id] == 1  # continued above its mark 0
        assert attempts[retried[0].rollout_id] == 2  # rerun above the seen attempt 1
        assert {r.outcome for g in groups for r in g} == {RolloutOutcome.COMPLETED}
