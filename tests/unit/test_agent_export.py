"""What an agent's commit writes for episodes parked across several snapshots.

An agent that exports the states it sealed (``Agent.export_states`` as it is) keeps each
parked episode's record from one snapshot to the next: a turn and a task that did not
change are not checked, copied or encoded again. The participant runtime in process, a
real store on tmp_path, an agent whose episodes park on model calls the test answers.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import turnpoint.participant_sdk._agent as agent_module
from tests.support.fakes import boundary_of, state_of
from tests.unit.test_participant_runtime import (
    EP_A,
    EP_B,
    FENCE,
    INSTANCE,
    bounded,
    ckpt,
    hosted,
    make_runtime,
    rid,
    start_episode,
)
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import Agent, EpisodeContext, ParticipantRuntime, SnapshotStore
from turnpoint.protocol import EpisodeState


class ModelWaitingAgent(Agent):
    """Seals a boundary, then waits on a model call the test answers (parked there
    through any number of snapshots); the state is the list of replies so far."""

    def __init__(self) -> None:
        self.replies: defaultdict[EpisodeId, asyncio.Queue[str]] = defaultdict(asyncio.Queue)
        self.tasks: dict[EpisodeId, Mapping[str, Any]] = {}

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        self.tasks[ctx.episode] = task
        history: list[str] = []
        for turn in range(int(task["turns"])):
            await ctx.boundary(turn, {"history": history, "long": "x" * 5000 if turn else ""})
            history.append(await ctx.model_call(self.replies[ctx.episode].get))
        return {"history": history}


def written(store: SnapshotStore, snapshot: str) -> tuple[bytes, dict[str, Any]]:
    """The published records file's bytes and each record's payload by rollout id."""
    (records,) = (store.root / snapshot / INSTANCE).glob("records-*.jsonl")
    data = records.read_bytes()
    lines = [json.loads(line) for line in data.splitlines() if line]
    return data, {line["episode"]["rollout_id"]: line["payload"] for line in lines}


async def snapshot(
    runtime: ParticipantRuntime, store: SnapshotStore, n: int
) -> tuple[bytes, dict[str, Any]]:
    """Prepare, commit (releasing) and resume ckpt(n) with both episodes in scope."""
    await bounded(runtime.prepare(FENCE, rid(), ckpt(n), lease_s=60))
    result = await bounded(
        runtime.commit(FENCE, rid(), ckpt(n), ckpt(n), [EP_A, EP_B], release=True)
    )
    assert result.released and set(result.exported) == {EP_A, EP_B}
    await bounded(runtime.resume(FENCE, rid(), ckpt(n)))
    return written(store, ckpt(n))


async def parked_on_model(runtime: ParticipantRuntime, *episodes: EpisodeId) -> None:
    await bounded(
        runtime.wait_until(
            lambda core: all(
                state_of(core, episode) is EpisodeState.AWAITING_MODEL for episode in episodes
            )
        )
    )


async def test_a_parked_episode_is_written_again_as_it_was_and_anew_once_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    plain_member = agent_module.plain_member

    def counted(episode: EpisodeId, key: str, name: str, value: Any) -> Any:
        made.append(f"{episode.rollout_id}.{name}")
        return plain_member(episode, key, name, value)

    monkeypatch.setattr(agent_module, "plain_member", counted)
    agent = ModelWaitingAgent()
    store = SnapshotStore(tmp_path)
    async with hosted(make_runtime(store, agent=agent)) as runtime:
        for episode in (EP_A, EP_B):
            await start_episode(runtime, episode)
        await parked_on_model(runtime, EP_A, EP_B)

        first, payloads = await snapshot(runtime, store, 1)
        assert sorted(made) == [
            "rollout-a.state",
            "rollout-a.task",
            "rollout-b.state",
            "rollout-b.task",
        ]
        assert payloads["rollout-a"]["state"] == {"history": [], "long": ""}

        # Nothing changed: the same records, none of them made again.
        made.clear()
        again, _ = await snapshot(runtime, store, 2)
        assert again == first and made == []

        # The agent changed a task it was given in place: that record is made anew.
        agent.tasks[EP_A]["note"] = "changed"  # type: ignore[index]
        changed, payloads = await snapshot(runtime, store, 3)
        assert payloads["rollout-a"]["task"] == {"turns": 3, "note": "changed"}
        assert made == ["rollout-a.task", "rollout-a.state"]

        # A model reply: EP_B seals its next turn (a long state, whose line is not kept)
        # and parks again; only its record is new, twice running.
        sealed: list[int] = []
        await runtime.wait_until(lambda core: not sealed.append(boundary_of(core, EP_B)))
        agent.replies[EP_B].put_nowait("reply-1")
        await bounded(runtime.wait_until(lambda core: boundary_of(core, EP_B) > sealed[0]))
        await parked_on_model(runtime, EP_B)
        for n in (4, 5):
            made.clear()
            data, payloads = await snapshot(runtime, store, n)
            assert payloads["rollout-b"]["state"] == {"history": ["reply-1"], "long": "x" * 5000}
            assert payloads["rollout-a"]["task"] == {"turns": 3, "note": "changed"}
            assert made == (["rollout-b.task", "rollout-b.state"] if n == 4 else [])
            assert data.split(b"\n")[0] == changed.split(b"\n")[0]  # EP_A's line, as it was
