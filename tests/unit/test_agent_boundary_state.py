"""The state an agent hands to ``ctx.boundary`` is copied there (docs/spec.md 5.2 item 6).

What a snapshot saves is the state *at the boundary*: whatever the agent does with its
own objects afterwards (it keeps playing the next turn until it parks) must not reach
the saved turn, at any depth, and nothing the SDK hands back aliases the agent's objects.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tests.support.fakes import state_of
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import (
    Agent,
    EpisodeContext,
    ParticipantRuntime,
    SavedTurn,
    SnapshotStore,
)
from turnpoint.participant_sdk._agent import _copied_state
from turnpoint.protocol import EpisodeState, Fence, Phase

FENCE = Fence("coord", 1)
EPISODE = EpisodeId("rollout-a", 0)
SEALED = {"history": [{"turn": 0, "tags": ["a"]}], "notes": {"seen": ["a"]}, "count": 0}


class MutatingAgent(Agent):
    """Seals boundary 1, then changes every level of its state and waits on a model call."""

    def __init__(self) -> None:
        self.mutated = asyncio.Event()
        self.last_boundary: SavedTurn | None = None
        self.exported: dict[EpisodeId, Mapping[str, Any]] = {}
        self._never: asyncio.Future[None] | None = None

    async def _wait_forever(self) -> None:
        self._never = asyncio.get_running_loop().create_future()
        await self._never

    async def run(self, ctx: EpisodeContext, task: Mapping[str, Any]) -> Mapping[str, Any]:
        state: dict[str, Any] = {
            "history": [{"turn": 0, "tags": ["a"]}],
            "notes": {"seen": ["a"]},
            "count": 0,
        }
        await ctx.boundary(0, state)
        state["history"][0]["turn"] = 99
        state["history"][0]["tags"].append("b")
        state["history"].append({"turn": 1})
        state["notes"]["seen"].append("b")
        state["count"] = 1
        state["extra"] = True
        self.last_boundary = ctx.last_boundary
        self.mutated.set()
        # Parked at the boundary (AWAITING_MODEL): a checkpoint exports boundary 1 now.
        await ctx.model_call(self._wait_forever)
        return {}

    async def export_states(
        self, states: Mapping[EpisodeId, SavedTurn]
    ) -> Mapping[EpisodeId, Mapping[str, Any]]:
        self.exported = {episode: saved.state for episode, saved in states.items()}
        return self.exported


async def test_what_the_agent_changes_after_a_boundary_is_not_what_is_saved(
    tmp_path: Path,
) -> None:
    store = SnapshotStore(tmp_path / "snapshots")
    agent = MutatingAgent()
    runtime = ParticipantRuntime("agent-0", store, agent=agent)
    try:
        stream = await runtime.accept_run(EPISODE, {"turns": 1})
        async with asyncio.timeout(5):
            await agent.mutated.wait()
            assert await runtime.wait_until(
                lambda core: state_of(core, EPISODE) is EpisodeState.AWAITING_MODEL, 5
            )
            checkpoint = make_checkpoint_id("ckpt", 1)
            prepared = await runtime.prepare(FENCE, "req-1", checkpoint, lease_s=60)
            assert prepared.phase is Phase.PREPARED
            result = await runtime.commit(FENCE, "req-2", checkpoint, "snap-1", [EPISODE])
        assert result.exported == (EPISODE,)
        assert agent.last_boundary is not None and agent.last_boundary.state == SEALED
        assert agent.exported[EPISODE] == SEALED
        loaded = store.read("snap-1", "agent-0", result.manifest)
        assert loaded.records[0].payload["state"] == SEALED
        assert loaded.records[0].payload["boundary_index"] == 1
        await stream.aclose()
    finally:
        await runtime.aclose()


def _mutable_parts(value: Any) -> list[Any]:
    """Every dict and list inside ``value`` (by identity), ``value`` included."""
    found: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            if isinstance(item, list):
                found.append(item)
            stack.extend(item)
    return found


def test_the_copy_shares_no_dict_or_list_with_the_agent() -> None:
    inner = [1, 2]
    state = {
        "json": {"a": [{"b": [1.5, None, True, "s"]}], "n": 3},
        "twice": [inner, inner],
        "tuple": ("x", inner),
        "int_keys": {1: inner},
        "ordered": OrderedDict(k=inner),
    }
    copied = _copied_state(state)
    assert copied == state
    theirs = {id(part) for part in _mutable_parts(state)}
    assert not theirs & {id(part) for part in _mutable_parts(copied)}
    # What plain JSON cannot hold is deep-copied, not shared.
    assert copied["int_keys"][1] is not inner and copied["ordered"]["k"] is not inner
    assert type(copied["ordered"]) is OrderedDict


def test_a_mapping_that_is_not_a_dict_becomes_a_dict() -> None:
    frozen = {"history": [1]}
    copied = _copied_state(MappingProxyType(frozen))
    assert type(copied) is dict and copied == frozen
    assert copied["history"] is not frozen["history"]


def test_deep_and_cyclic_states_are_still_copied() -> None:
    deep: dict[str, Any] = {}
    level = deep
    for _ in range(200):
        level["next"] = {}
        level = level["next"]
    assert _copied_state(deep) == deep
    cyclic: dict[str, Any] = {"items": []}
    cyclic["items"].append(cyclic)
    copied = _copied_state(cyclic)
    assert copied is not cyclic and copied["items"] is not cyclic["items"]
