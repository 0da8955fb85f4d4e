"""``Shared``: the one lock around the core, what watchers receive and whom a change wakes."""

from __future__ import annotations

import asyncio

from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import RuntimeConfig
from turnpoint.participant_sdk._core import ParticipantCore, WorkKey
from turnpoint.participant_sdk._shared import Shared
from turnpoint.protocol import EpisodeState


def make_shared() -> Shared:
    # The runtime asks its core to record events; Shared records only while one watches.
    core = ParticipantCore(record_events=True)
    return Shared(core, RuntimeConfig(), clock=lambda: 0.0, wall_clock=lambda: 0.0)


def key(name: str) -> WorkKey:
    return WorkKey(EpisodeId(name, 0), "run")


async def admit(shared: Shared, name: str) -> None:
    async with shared.changing() as core:
        core.admit(key(name), EpisodeState.RUNNING, shared.now())


async def test_a_watcher_receives_the_changes_made_while_it_watches_and_no_others() -> None:
    shared = make_shared()
    await admit(shared, "before")
    assert not shared.view.record_events
    first = shared.add_watcher()
    await admit(shared, "watched")
    assert [event.episode.rollout_id for event in first.events] == ["watched"]
    assert first.wake.is_set()
    shared.remove_watcher(first)
    await admit(shared, "unwatched")
    second = shared.add_watcher()
    await admit(shared, "again")
    assert [event.episode.rollout_id for event in second.events] == ["again"]
    shared.remove_watcher(second)


async def test_a_waiter_for_admission_wakes_when_it_opens_and_not_before() -> None:
    shared = make_shared()
    checkpoint = "ckpt-000000000001"
    async with shared.changing() as core:
        core.begin_prepare(checkpoint, None, shared.now())

    async def parked() -> None:
        async with shared.cond:
            await shared.wait_admission_open()

    waiter = asyncio.create_task(parked())
    # Negative outcomes, bounded by short real timeouts: it cannot finish while closed,
    # also after a change that leaves admission closed.
    done, _ = await asyncio.wait([waiter], timeout=0.05)
    assert not done
    async with shared.changing() as core:
        core.renew(checkpoint, 30.0, shared.now())
    done, _ = await asyncio.wait([waiter], timeout=0.05)
    assert not done
    async with shared.changing() as core:
        core.resume(checkpoint, shared.now())
    async with asyncio.timeout(5):
        await waiter


def test_the_core_is_changed_only_inside_changing() -> None:
    # One writer: the shared state hands the mutable core out only with the lock held
    # (changing); what everyone else gets, with or without the lock, is a view.
    shared = make_shared()
    assert not hasattr(shared, "core")
    for mutator in ("admit", "set_state", "begin_prepare", "resume", "observe_fence", "forget"):
        assert not hasattr(shared.view, mutator)


async def test_locked_reads_the_core_under_the_lock_without_publishing() -> None:
    shared = make_shared()
    async with shared.locked() as view:
        assert shared.cond.locked()
        assert view is shared.view and view.admission_open
    assert not shared.cond.locked()
