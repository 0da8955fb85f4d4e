"""A commit that ends its checkpoint, and Runs that wait for admission (docs/spec.md
sections 4.8 item 9 and 5.2 item 1).

The participant runtime in process, real store on tmp_path, the runtime tests' step
agent. A held write (``StoreFaults.slow_write``) shows what happens between the export
and the durable answer: admission is open again and the work goes on, while the records
written are the ones exported at the cut.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tests.support.fakes import expect, state_of
from tests.unit.test_participant_runtime import (
    EP_A,
    EP_B,
    FENCE,
    INSTANCE,
    Follower,
    StepAgent,
    bounded,
    ckpt,
    hosted,
    make_runtime,
    park_all,
    rid,
    start_episode,
)
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    ParticipantRuntime,
    RuntimeConfig,
    SavedTurn,
    SnapshotStore,
)
from turnpoint.participant_sdk.testing import StoreFaults
from turnpoint.protocol import EpisodeState, Phase


def written_states(store: SnapshotStore, snapshot: str) -> dict[str, object]:
    """The ``state`` of each record the instance's published records file holds."""
    directory = store.root / snapshot / INSTANCE
    (records,) = directory.glob("records-*.jsonl")
    lines = [json.loads(line) for line in records.read_text().splitlines() if line]
    return {line["episode"]["rollout_id"]: line["payload"]["state"] for line in lines}


class LiveStateAgent(StepAgent):
    """Exports one object of its own for every episode and changes it, at every depth,
    as soon as admission reopens: the state a careless agent hands over and keeps using.
    A releasing commit reopens admission before its write starts."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, Any] = {"notes": ["at the cut"], "count": 1}
        self.exported = False

    async def export_states(
        self, states: Mapping[EpisodeId, SavedTurn]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        self.exported = True
        return {episode: self.live for episode in states}

    async def admission_opened(self) -> None:
        if self.exported:
            self.live["notes"].append("after the release")
            self.live["count"] = 2


@asynccontextmanager
async def parked(
    store: SnapshotStore, turns: int = 3, agent: StepAgent | None = None
) -> AsyncIterator[tuple[ParticipantRuntime, StepAgent, Follower]]:
    """An agent whose episode EP_A is parked at its first boundary, ckpt(1) prepared."""
    agent = agent or StepAgent()
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        follower = await start_episode(runtime, EP_A, turns=turns)
        await park_all(runtime, agent, ckpt(1), EP_A)
        yield runtime, agent, follower


async def test_a_releasing_commit_reopens_admission_before_its_write_and_writes_the_cut(
    tmp_path: Path,
) -> None:
    faults = StoreFaults()
    release_write = threading.Event()
    reached = faults.slow_write(release_write)
    store = SnapshotStore(tmp_path, faults=faults)
    async with parked(store) as (runtime, agent, follower):
        commit = asyncio.create_task(
            runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [EP_A], release=True)
        )
        await bounded(asyncio.to_thread(reached.wait))
        # The write is held, yet the checkpoint is over: admission is open, and the
        # episode runs on past the boundary it was cut at.
        assert runtime.phase is Phase.IDLE and not commit.done()
        agent.release(EP_A)
        await bounded(runtime.wait_until(lambda core: len(follower.reports) >= 2))
        release_write.set()
        result = await bounded(commit)
        assert result.released and result.exported == (EP_A,)
        # What was written is the cut (one turn), not what the episode did since.
        assert written_states(store, ckpt(1)) == {"rollout-a": {"history": [0]}}
        agent.release(EP_A)
        assert (await follower.done()).result == {"history": [0, 1, 2]}


async def test_a_releasing_commit_writes_the_exported_state_as_it_was_at_the_cut(
    tmp_path: Path,
) -> None:
    store = SnapshotStore(tmp_path)
    agent = LiveStateAgent()
    async with parked(store, agent=agent) as (runtime, _, _):
        result = await runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [EP_A], release=True)
        assert result.released
        # The agent changed what it exported once admission reopened; the records
        # hold the cut.
        assert agent.live == {"notes": ["at the cut", "after the release"], "count": 2}
        assert written_states(store, ckpt(1)) == {
            "rollout-a": {"notes": ["at the cut"], "count": 1}
        }


async def test_a_releasing_commit_of_state_that_is_not_json_fails_before_it_releases(
    tmp_path: Path,
) -> None:
    agent = LiveStateAgent()
    agent.live["tags"] = {"a", "b"}  # a set: no JSON value
    async with parked(SnapshotStore(tmp_path), agent=agent) as (runtime, _, _):
        error = await expect(
            Reason.INVALID_CHECKPOINT_STATE,
            runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [EP_A], release=True),
        )
        assert error.metadata["location"] == "payload['state']['tags']"
        # Nothing was released: the checkpoint holds admission until its resume.
        assert runtime.phase is not Phase.IDLE
        assert not list((tmp_path / ckpt(1)).glob(f"{INSTANCE}/records-*"))
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert runtime.phase is Phase.IDLE


async def test_a_repeat_of_a_released_commit_replays_it_and_other_arguments_conflict(
    tmp_path: Path,
) -> None:
    async with parked(SnapshotStore(tmp_path)) as (runtime, agent, _):
        first = await runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [EP_A], release=True)
        assert first.released and runtime.phase is Phase.IDLE
        # A lost reply: the coordinator asks again (another session, another id).
        again = await runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [EP_A], release=True)
        assert again == first
        await expect(
            Reason.CHECKPOINT_CONFLICT,
            runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [], release=True),
        )
        # A resume of the ended id changes nothing; the next checkpoint opens as usual
        # and the released commit is forgotten.
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert runtime.phase is Phase.IDLE
        await park_all(runtime, agent, ckpt(2), EP_A)
        await expect(
            Reason.STALE_CHECKPOINT,
            runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [EP_A], release=True),
        )


async def test_without_release_the_commit_keeps_the_checkpoint_until_resume(
    tmp_path: Path,
) -> None:
    async with parked(SnapshotStore(tmp_path)) as (runtime, _, _):
        result = await runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [EP_A])
        assert not result.released and runtime.phase is Phase.COMMITTED
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert runtime.phase is Phase.IDLE


async def test_a_run_that_may_wait_is_admitted_when_the_commit_releases_and_is_in_no_cut(
    tmp_path: Path,
) -> None:
    async with parked(SnapshotStore(tmp_path), turns=2) as (runtime, _, _):
        # Without the flag a new attempt is refused while admission is closed.
        await expect(Reason.ADMISSION_CLOSED, runtime.accept_run(EP_B, {"turns": 1}))
        waiting = asyncio.create_task(
            runtime.accept_run(EP_B, {"turns": 1}, wait_for_admission=True)
        )
        await asyncio.sleep(0)
        # It waits outside the work table: not in the cut, blocking nothing.
        assert not waiting.done()
        assert state_of(runtime.core, EP_B) is None
        again = await runtime.prepare(FENCE, rid(), ckpt(1))
        assert again.readiness.ready
        result = await runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [EP_A], release=True)
        assert result.exported == (EP_A,)
        stream = await bounded(waiting)
        assert state_of(runtime.core, EP_B) is EpisodeState.RUNNING
        await stream.aclose()


async def test_a_run_that_may_wait_is_refused_after_the_configured_wait(
    tmp_path: Path,
) -> None:
    store = SnapshotStore(tmp_path)
    agent = StepAgent()
    config = RuntimeConfig(run_admission_wait_s=0.05)
    async with hosted(make_runtime(store, agent=agent, config=config)) as runtime:
        await park_all(runtime, agent, ckpt(1))
        await expect(
            Reason.ADMISSION_CLOSED,
            runtime.accept_run(EP_B, {"turns": 1}, wait_for_admission=True),
        )
        assert state_of(runtime.core, EP_B) is None
