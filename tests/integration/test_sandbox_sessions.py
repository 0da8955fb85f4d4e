"""The coding environment's sessions through checkpoints, over real gRPC.

docs/spec.md section 5.7.5: a :class:`SandboxResourcesServer` exports each session as
its sandbox's snapshot handle and restores it into a new generation. The servers these
tests make themselves require bubblewrap, as tests/integration/test_sandboxes.py does
(``./dev test`` installs it); the one ``turnpoint serve`` builds takes the strongest
isolation the machine has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.support.participants import TOKEN, host_example
from tests.support.scripted import bounded, ckpt, host_scripted, poll, restore_id, wire_to
from turnpoint.apps.examples._build import ExampleSpec
from turnpoint.apps.examples._coding import CodingTools
from turnpoint.apps.examples._coding_tasks import TASKS
from turnpoint.errors import Reason, TurnpointError
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import Verdict
from turnpoint.participant_sdk._effects import CallPosition, effect_key
from turnpoint.participant_sdk.sandboxes import (
    InFlight,
    Isolation,
    LocalSandboxProvider,
    Sandbox,
    SandboxFencedError,
    SandboxNotFoundError,
    SandboxProvider,
    SandboxResourcesServer,
    SandboxSession,
)
from turnpoint.server import ResourcesClient
from turnpoint.v1 import types_pb2

EP = EpisodeId("code-1", 0)
APPEND = ["sh", "-c", "echo ran >> effects.log"]


def _key(turn: int, rollout_id: str = EP.rollout_id) -> str:
    return effect_key(rollout_id, CallPosition(turn, 0))


async def test_a_restored_session_is_its_sandbox_at_the_cut_and_a_resent_call_runs_once(
    tmp_path: Path,
) -> None:
    root, sandboxes = tmp_path / "snapshots", tmp_path / "sandboxes"
    first = CodingTools.on_disk(sandboxes, isolation=Isolation.BWRAP)
    try:
        async with (
            host_scripted(root, instance="coding-0", resources=first) as served,
            wire_to(served, "unary") as wire,
        ):
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                await client.seed(EP, {"task": "add"})
                appended = await client.call(EP, "run", {"argv": APPEND}, request_id=_key(0))
                assert appended["exit_code"] == 0, appended
                prepared = await wire.prepare(ckpt(1), lease_s=60)
                assert prepared.phase == types_pb2.PHASE_PREPARED, prepared
                committed = await wire.commit(ckpt(1), "snap-1", [EP])
                await wire.resume(ckpt(1))
                # Past the cut: a new file and a second line; the crash loses both.
                write = {"path": "after.txt", "content": "lost"}
                await client.call(EP, "write_file", write, request_id=_key(1))
                await client.call(EP, "run", {"argv": APPEND}, request_id=_key(2))
            finally:
                await client.aclose()
    finally:
        await first.aclose()

    continued = EP.next_attempt()
    second = CodingTools.on_disk(sandboxes, isolation=Isolation.BWRAP)
    try:
        async with (
            host_scripted(root, instance="coding-0", resources=second) as served,
            wire_to(served, "unary") as wire,
        ):
            restored = await wire.restore(restore_id(1), "snap-1", committed, [EP])
            assert len(restored.installed) == 1
            await wire.resume(restore_id(1))
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                # The call the cut holds, re-sent: answered from the record, not run.
                again = await client.call(continued, "run", {"argv": APPEND}, request_id=_key(0))
                assert again == appended
                look = {"argv": ["sh", "-c", "ls; cat effects.log"]}
                listing = await client.call(continued, "run", look, request_id=_key(3))
                assert listing["stdout"].split() == [
                    "check.py",
                    "effects.log",
                    "solution.py",
                    "ran",
                ], listing
                # The generation the old process wrote in is fenced and gone.
                provider = await second.provider()
                with pytest.raises(SandboxFencedError) as fenced:
                    await provider.read_file(Sandbox(EP.rollout_id, 1), "effects.log")
                assert fenced.value.active == 2
                assert not list((sandboxes / "sandboxes" / EP.rollout_id).glob("g1-*"))
                # The old attempt is refused by the participant itself.
                with pytest.raises(TurnpointError) as stale:
                    await client.call(EP, "run", {"argv": APPEND}, request_id=_key(4))
                assert stale.value.reason is Reason.STALE_ATTEMPT
            finally:
                await client.aclose()
    finally:
        await second.aclose()

    # Both crash again before another checkpoint: the same cut is restored again, under
    # the same attempt, into a sandbox the last process had restored.
    third = CodingTools.on_disk(sandboxes, isolation=Isolation.BWRAP)
    try:
        async with (
            host_scripted(root, instance="coding-0", resources=third) as served,
            wire_to(served, "unary") as wire,
        ):
            restored = await wire.restore(restore_id(2), "snap-1", committed, [EP])
            assert len(restored.installed) == 1
            await wire.resume(restore_id(2))
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                look = {"argv": ["cat", "effects.log"]}
                again = await client.call(continued, "run", look, request_id=_key(3))
                assert again["stdout"] == "ran\n", again
            finally:
                await client.aclose()
    finally:
        await third.aclose()


async def test_a_session_closed_after_the_cut_is_restored_from_its_snapshot(
    tmp_path: Path,
) -> None:
    """Its sandbox was destroyed with the session; the snapshot brings it back."""
    tools = CodingTools.on_disk(tmp_path / "sandboxes", isolation=Isolation.BWRAP)
    try:
        async with (
            host_scripted(tmp_path / "snapshots", instance="coding-0", resources=tools) as served,
            wire_to(served, "unary") as wire,
        ):
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                await client.seed(EP, {"task": "maximum"})
                fix = {"path": "solution.py", "content": TASKS[1].fixed}
                await client.call(EP, "write_file", fix, request_id=_key(0))
                assert (await wire.prepare(ckpt(1), lease_s=60)).phase == types_pb2.PHASE_PREPARED
                committed = await wire.commit(ckpt(1), "snap-1", [EP])
                await wire.resume(ckpt(1))
                assert await client.close_session(EP)
                restored = await wire.restore_running(restore_id(1), "snap-1", committed, [EP])
                assert len(restored.installed) == 1
                await wire.resume(restore_id(1))
                verdict = await client.verify(EP.next_attempt(), {}, request_id=_key(1))
            finally:
                await client.aclose()
    finally:
        await tools.aclose()
    assert verdict.reward == 1.0 and verdict.details["task"] == "maximum"


async def test_by_default_a_prepare_waits_for_the_command_in_flight(tmp_path: Path) -> None:
    sandboxes = tmp_path / "sandboxes"
    tools = CodingTools.on_disk(sandboxes, isolation=Isolation.BWRAP)
    try:
        async with (
            host_scripted(tmp_path / "snapshots", instance="coding-0", resources=tools) as served,
            wire_to(served, "unary") as wire,
        ):
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                await client.seed(EP, {"task": "add"})
                # The command ends once the test drops a file into its tree.
                script = (
                    "echo started > log; until [ -e go ]; do sleep 0.02; done; echo done >> log"
                )
                running = asyncio.create_task(
                    client.call(EP, "run", {"argv": ["sh", "-c", script]}, request_id=_key(0))
                )
                tree = sandboxes / "sandboxes" / EP.rollout_id
                await poll(lambda: any(tree.glob("g1-*/log")))
                waiting = await wire.prepare(ckpt(1), lease_s=60, max_blockers=1, timeout_s=0.5)
                assert waiting.phase == types_pb2.PHASE_PREPARING
                [blocker] = waiting.readiness.blockers
                assert blocker.state == types_pb2.EPISODE_STATE_REQUEST_IN_FLIGHT
                provider = await tools.provider()
                await provider.write_file(Sandbox(EP.rollout_id, 1), "go", b"")
                assert (await bounded(running))["exit_code"] == 0
                prepared = await wire.prepare(ckpt(1), lease_s=60)
                assert prepared.phase == types_pb2.PHASE_PREPARED, prepared
                committed = await wire.commit(ckpt(1), "snap-1", [EP])
                await wire.resume(ckpt(1))
                await wire.restore_running(restore_id(1), "snap-1", committed, [EP])
                await wire.resume(restore_id(1))
                # The snapshot holds the whole command's work.
                log = await provider.read_file(Sandbox(EP.rollout_id, 2), "log")
                assert log == b"started\ndone\n"
            finally:
                await client.aclose()
    finally:
        await tools.aclose()


async def test_a_cut_level_kills_the_command_in_flight_and_the_snapshot_holds_what_it_did(
    tmp_path: Path,
) -> None:
    sandboxes = tmp_path / "sandboxes"
    tools = CodingTools.on_disk(sandboxes, isolation=Isolation.BWRAP, in_flight=InFlight.CUT)
    try:
        async with (
            host_scripted(tmp_path / "snapshots", instance="coding-0", resources=tools) as served,
            wire_to(served, "unary") as wire,
        ):
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                await client.seed(EP, {"task": "add"})
                slow = ["sh", "-c", "echo started > started.txt; exec sleep 60"]
                running = asyncio.create_task(
                    client.call(EP, "run", {"argv": slow}, request_id=_key(0))
                )
                provider = await tools.provider()
                tree = sandboxes / "sandboxes" / EP.rollout_id
                await poll(lambda: any(tree.glob("g1-*/started.txt")))
                prepared = await wire.prepare(ckpt(1), lease_s=60)
                assert prepared.phase == types_pb2.PHASE_PREPARED, prepared
                assert await bounded(running) == {"cut": True}
                committed = await wire.commit(ckpt(1), "snap-1", [EP])
                await wire.resume(ckpt(1))
                # The snapshot holds what the cut command did before it was killed.
                restored = await wire.restore_running(restore_id(1), "snap-1", committed, [EP])
                assert len(restored.installed) == 1
                await wire.resume(restore_id(1))
                assert await provider.read_file(Sandbox(EP.rollout_id, 2), "started.txt")
                # Admission open again: commands run to their end.
                ran = await client.call(EP.next_attempt(), "run_tests", {}, request_id=_key(1))
                assert ran["passed"] is False and "AssertionError" in ran["stderr"]
            finally:
                await client.aclose()
    finally:
        await tools.aclose()


async def test_turnpoint_serve_hosts_the_coding_environment_and_its_verifier_runs_hidden_tests(
    tmp_path: Path,
) -> None:
    spec = ExampleSpec("coding", tmp_path / "snapshots", TOKEN)
    served = await host_example("resources", "coding", spec)
    client = ResourcesClient(served.address, token=TOKEN)
    try:
        rewards = {}
        for index, task in enumerate(TASKS[:2]):
            episode = EpisodeId(f"code-{index}", 0)
            await client.seed(episode, {"task": task.name})
            with pytest.raises(TurnpointError) as refused:
                await client.call(
                    episode, "run", {"argv": []}, request_id=_key(0, episode.rollout_id)
                )
            assert refused.value.reason is Reason.INVALID_ARGUMENT
            if index == 0:
                fix = {"path": "solution.py", "content": task.fixed}
                await client.call(
                    episode, "write_file", fix, request_id=_key(1, episode.rollout_id)
                )
                tested = await client.call(
                    episode, "run_tests", {}, request_id=_key(2, episode.rollout_id)
                )
                assert tested["passed"] is True, tested
            verdict = await client.verify(episode, {}, request_id=_key(3, episode.rollout_id))
            rewards[task.name] = verdict.reward
    finally:
        await client.aclose()
        await served.stop(0)
    assert rewards == {"add": 1.0, "maximum": 0.0}
    assert (tmp_path / "snapshots" / "sandboxes" / "coding" / "state.json").exists()


async def test_a_participant_configured_with_another_sandbox_root_refuses_the_restore(
    tmp_path: Path,
) -> None:
    root = tmp_path / "snapshots"
    first = CodingTools.on_disk(tmp_path / "sandboxes", isolation=Isolation.BWRAP)
    try:
        async with (
            host_scripted(root, instance="coding-0", resources=first) as served,
            wire_to(served, "unary") as wire,
        ):
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                await client.seed(EP, {"task": "add"})
            finally:
                await client.aclose()
            assert (await wire.prepare(ckpt(1), lease_s=60)).phase == types_pb2.PHASE_PREPARED
            committed = await wire.commit(ckpt(1), "snap-1", [EP])
    finally:
        await first.aclose()

    elsewhere = CodingTools.on_disk(tmp_path / "other-sandboxes", isolation=Isolation.BWRAP)
    try:
        async with (
            host_scripted(root, instance="coding-0", resources=elsewhere) as served,
            wire_to(served, "unary") as wire,
        ):
            with pytest.raises(TurnpointError) as refused:
                await wire.restore(restore_id(1), "snap-1", committed, [EP])
            assert refused.value.reason is Reason.INVALID_CHECKPOINT_STATE
            assert refused.value.metadata["store"] == str(tmp_path / "sandboxes")
            provider = await elsewhere.provider()
            with pytest.raises(SandboxNotFoundError):
                await provider.destroy(EP.rollout_id)  # nothing was made here
    finally:
        await elsewhere.aclose()


class _Notes(SandboxResourcesServer):
    """The smallest sandbox server: one file set up, no tools, every episode passes."""

    async def set_up(self, session: SandboxSession, task: Mapping[str, Any]) -> None:
        await (await self.provider()).write_file(session.sandbox, "notes.txt", b"cut")

    async def tool(
        self, session: SandboxSession, tool: str, arguments: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        return {}

    async def score(self, session: SandboxSession, answer: Mapping[str, Any]) -> Verdict:
        return Verdict(1.0)


async def test_snapshots_whose_retention_lapsed_are_pruned_once_a_checkpoint_ends(
    tmp_path: Path,
) -> None:
    """docs/spec.md section 5.7.5 item 4: nobody calls prune by hand; the end of a
    checkpoint removes what lapsed and keeps the snapshot it just exported."""
    now = [1000.0]
    sandboxes = tmp_path / "sandboxes"

    def open_provider() -> Awaitable[SandboxProvider]:
        return LocalSandboxProvider.open(sandboxes, isolation=Isolation.BWRAP, clock=lambda: now[0])

    def records() -> list[str]:
        return sorted(path.stem for path in (sandboxes / "snapshots").glob("*.json"))

    server = _Notes(open_provider, retention_seconds=60.0, prune_interval_seconds=0.0)
    try:
        async with (
            host_scripted(tmp_path / "snapshots", instance="notes-0", resources=server) as served,
            wire_to(served, "unary") as wire,
        ):
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                await client.seed(EP, {})
                for number in (1, 2):
                    await wire.prepare(ckpt(number), lease_s=60)
                    await wire.commit(ckpt(number), f"snap-{number}", [EP])
                    await wire.resume(ckpt(number))
                    if number == 1:
                        # Its own prune finds nothing lapsed; then the first expires.
                        (first,) = records()
                        now[0] += 120.0
                await poll(lambda: first not in records())
                (second,) = records()
                assert second != first
                # The snapshot just exported still restores: its chunks were kept.
                provider = await server.provider()
                session = server.session(EP)
                handle = await provider.snapshot(session.sandbox, retention_seconds=60.0)
                (restored,) = await provider.restore([handle], attempt=1)
                assert await provider.read_file(restored.sandbox, "notes.txt") == b"cut"
            finally:
                await client.aclose()
    finally:
        await server.aclose()


class _NotesRestoringNothing(_Notes):
    """A restore hook that installs nothing: the episode would go on without its tree."""

    async def restore_session(
        self, saved: EpisodeId, episode: EpisodeId, state: Mapping[str, Any]
    ) -> None:
        return None


@pytest.mark.parametrize("server_type", [_Notes, _NotesRestoringNothing])
async def test_a_restore_asks_whether_the_session_is_held_and_takes_no_snapshot_for_it(
    tmp_path: Path, server_type: type[_Notes]
) -> None:
    """docs/spec.md section 5.6 item 4 through ``holds_session``: asking the export
    instead would snapshot the tree the restore just made."""
    sandboxes = tmp_path / "sandboxes"

    def open_provider() -> Awaitable[SandboxProvider]:
        return LocalSandboxProvider.open(sandboxes, isolation=Isolation.BWRAP)

    def records() -> int:
        return len(list((sandboxes / "snapshots").glob("*.json")))

    server = server_type(open_provider)
    try:
        async with (
            host_scripted(tmp_path / "snapshots", instance="notes-0", resources=server) as served,
            wire_to(served, "unary") as wire,
        ):
            client = ResourcesClient(served.address, token=TOKEN)
            try:
                await client.seed(EP, {})
                await wire.prepare(ckpt(1), lease_s=60)
                committed = await wire.commit(ckpt(1), "snap-1", [EP])
                await wire.resume(ckpt(1))
                exported = records()
                if server_type is _NotesRestoringNothing:
                    with pytest.raises(TurnpointError) as refused:
                        await wire.restore_running(restore_id(1), "snap-1", committed, [EP])
                    assert refused.value.reason is Reason.INVALID_CHECKPOINT_STATE
                    return
                restored = await wire.restore_running(restore_id(1), "snap-1", committed, [EP])
                assert len(restored.installed) == 1
                await wire.resume(restore_id(1))
                assert records() == exported
                verdict = await client.verify(EP.next_attempt(), {}, request_id=_key(0))
                assert verdict.reward == 1.0
            finally:
                await client.aclose()
    finally:
        await server.aclose()
