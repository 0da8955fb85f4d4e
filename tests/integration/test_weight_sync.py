"""The weight sync against a real policy server on 127.0.0.1:0 (docs/spec.md section 5.4).

A lost reply, a broken connection or a deadline costs a retry under the same request
id, never the trainer, and never a second install: the policy server answers a retry
of an update it already made from its record. Faults are the chaos proxy's (a real
loopback TCP proxy that cuts connections as the server replies) and a deadline that
runs out while the model waits; the retry pause is where each test switches the fault
off, so nothing waits on a clock. Every test ends on what the model installed: each
version exactly once. The facade records the version in its snapshots, and a restore
onto fresh policy servers pushes the restored weights at that version.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.support.participants import TOKEN
from turnpoint.apps.chaos._proxy import FaultProxy, ProxyMode
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import (
    GenerateChunk,
    GenerateRequest,
    ParticipantRuntime,
    PolicyModel,
    SnapshotStore,
)
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    SnapshotOutcome,
    TorchAnchorSource,
    WeightSync,
    WeightSyncError,
    WeightSyncSettings,
    torch_anchor_loader,
)

BOUND_S = 30.0
# Retries are paced by the tests' pause hooks, not by these numbers.
SETTINGS = WeightSyncSettings(call_timeout_s=10.0, max_attempts=20, total_s=BOUND_S)


@dataclass
class RecordingPolicy(PolicyModel):
    """Records every install; ``hold`` (when set) keeps an install waiting until
    ``release`` is set, as a model waiting for its own generations would."""

    installs: list[tuple[int, bytes]] = field(default_factory=list)
    hold: asyncio.Event | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    calls: int = 0

    async def generate(
        self, episode: EpisodeId, request: GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        yield GenerateChunk((), (), True, self.installed_version)

    @property
    def installed_version(self) -> int:
        return self.installs[-1][0] if self.installs else 0

    async def update_weights(self, weights_version: int, state: bytes) -> int:
        self.calls += 1
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        self.installs.append((weights_version, state))
        return weights_version


@asynccontextmanager
async def policy_server(
    root: Path, model: RecordingPolicy, name: str = "policy"
) -> AsyncIterator[HostedParticipant]:
    runtime = ParticipantRuntime(name, SnapshotStore(root), model=model)
    async with host_participant(runtime, ServerOptions(port=0, token=TOKEN)) as hosted:
        yield hosted


@dataclass
class Pauses:
    """The retry pause: counts the retries and runs ``on_retry`` with the count, then
    yields once (no waiting: the test decides when the fault ends)."""

    on_retry: Callable[[int], Awaitable[None] | None] = lambda _: None
    count: int = 0

    async def __call__(self, _seconds: float) -> None:
        self.count += 1
        result = self.on_retry(self.count)
        if result is not None:
            await result
        await asyncio.sleep(0)


async def test_replies_lost_for_a_while_cost_retries_and_each_version_is_installed_once(
    tmp_path: Path,
) -> None:
    model = RecordingPolicy()
    async with AsyncExitStack() as stack:
        hosted = await stack.enter_async_context(policy_server(tmp_path, model))
        proxy = await stack.enter_async_context(FaultProxy(hosted.address))
        lost_in_push = 0

        def fault_ends_after_two_retries(_count: int) -> None:
            nonlocal lost_in_push
            lost_in_push += 1
            if lost_in_push == 2:
                proxy.set_mode(ProxyMode.PASS)

        sync = WeightSync(
            {"policy": proxy.address},
            token=TOKEN,
            epoch=1,
            settings=SETTINGS,
            sleep=Pauses(fault_ends_after_two_retries),
        )
        for version in (1, 2, 3):
            lost_in_push = 0
            proxy.set_mode(ProxyMode.DROP_REPLIES)
            report = await asyncio.wait_for(sync.push(version, b"w%d" % version), BOUND_S)
            assert report.version == version
            # Replies lost until the second retry's pause turned the fault off.
            assert 2 <= report.attempts["policy"] <= 3
    assert proxy.stats.cut >= 6
    assert model.installs == [(1, b"w1"), (2, b"w2"), (3, b"w3")]
    assert sync.installed == {"policy": 3} and sync.version == 3


async def test_a_retry_after_the_deadline_joins_the_install_under_way_and_never_repeats_it(
    tmp_path: Path,
) -> None:
    """The model is still installing (waiting for its generations) when the call's
    deadline runs out; the caller going away does not stop the install, and the retry,
    under the same request id, joins it: the model is asked once."""
    hold = asyncio.Event()
    model = RecordingPolicy(hold=hold)
    async with policy_server(tmp_path, model) as hosted:

        async def let_the_install_finish(count: int) -> None:
            assert model.entered.is_set()  # the first call reached the model
            hold.set()

        sync = WeightSync(
            {"policy": hosted.address},
            token=TOKEN,
            epoch=1,
            settings=WeightSyncSettings(call_timeout_s=0.3, max_attempts=5, total_s=BOUND_S),
            sleep=Pauses(let_the_install_finish),
        )
        report = await asyncio.wait_for(sync.push(5, b"five"), BOUND_S)
    assert report.attempts == {"policy": 2}
    assert model.calls == 1
    assert model.installs == [(5, b"five")]


async def test_a_new_epoch_pushing_the_installed_version_again_installs_nothing(
    tmp_path: Path,
) -> None:
    """After a restart the trainer pushes its restored weights under new request ids; a
    server that holds that version already answers it as installed."""
    model = RecordingPolicy()
    async with policy_server(tmp_path, model) as hosted:
        first = WeightSync({"policy": hosted.address}, token=TOKEN, epoch=1, settings=SETTINGS)
        await first.push(4, b"four")
        again = WeightSync({"policy": hosted.address}, token=TOKEN, epoch=2, settings=SETTINGS)
        assert (await again.push(4, b"four")).attempts == {"policy": 1}
    assert model.installs == [(4, b"four")]


async def test_a_refusal_is_not_retried_and_names_the_server(tmp_path: Path) -> None:
    model = RecordingPolicy()
    pauses = Pauses()
    async with policy_server(tmp_path, model) as hosted:
        await WeightSync({"policy": hosted.address}, token=TOKEN, epoch=1).push(4, b"four")
        older = WeightSync(
            {"policy": hosted.address}, token=TOKEN, epoch=2, settings=SETTINGS, sleep=pauses
        )
        with pytest.raises(WeightSyncError) as refused:
            await older.push(3, b"three")
    assert refused.value.reason is Reason.INVALID_ARGUMENT
    assert (refused.value.instance, refused.value.attempts, pauses.count) == ("policy", 1, 0)
    assert "INVALID_ARGUMENT" in refused.value.status
    assert model.installs == [(4, b"four")]


async def test_a_push_that_exhausts_its_attempts_raises_naming_the_server_and_status(
    tmp_path: Path,
) -> None:
    model = RecordingPolicy()
    async with policy_server(tmp_path, model) as hosted, FaultProxy(hosted.address) as proxy:
        proxy.set_mode(ProxyMode.BLACKHOLE)
        pauses = Pauses()
        sync = WeightSync(
            {"policy": proxy.address},
            token=TOKEN,
            epoch=1,
            settings=WeightSyncSettings(call_timeout_s=5.0, max_attempts=3, total_s=BOUND_S),
            sleep=pauses,
        )
        with pytest.raises(WeightSyncError) as gave_up:
            await asyncio.wait_for(sync.push(1, b"one"), BOUND_S)
    error = gave_up.value
    assert (error.instance, error.version, error.attempts, pauses.count) == ("policy", 1, 3, 2)
    assert error.reason is Reason.UNAVAILABLE and error.status == "UNAVAILABLE"
    assert model.installs == []


def _checkpointing(
    root: Path,
    participants: dict[str, str],
    model: torch.nn.Module,
    *,
    final_snapshot: bool = True,
) -> Checkpointing:
    return Checkpointing(
        CoordinatorConfig(snapshot_root=root, control_timeout_s=10.0),
        participants,
        token=TOKEN,
        anchor=TorchAnchorSource(model, None, step=lambda: 0),
        load_anchor=torch_anchor_loader(model, None),
        periodic=False,
        weights=lambda: b"trainer-weights",
        weight_sync=SETTINGS,
        final_snapshot=final_snapshot,
    )


async def test_a_snapshot_records_the_weights_version_and_a_restore_pushes_it_again(
    tmp_path: Path,
) -> None:
    root = tmp_path / "snapshots"
    first_policy = RecordingPolicy()
    async with (
        policy_server(root, first_policy) as hosted,
        _checkpointing(root, {"policy": hosted.address}, torch.nn.Linear(2, 2)) as ckpt,
    ):
        assert ckpt.resumed.weights_version is None
        assert first_policy.installs == [(0, b"trainer-weights")]  # pushed at open
        await ckpt.push_weights(7)
        report = await ckpt.snapshot_now()
        assert report.outcome is SnapshotOutcome.PUBLISHED
        published = report.checkpoint_id

    # The job restarts: a fresh policy server on the same root, a new coordinator epoch.
    fresh_policy = RecordingPolicy()
    async with (
        policy_server(root, fresh_policy) as hosted,
        _checkpointing(root, {"policy": hosted.address}, torch.nn.Linear(2, 2)) as ckpt,
    ):
        assert ckpt.resumed.checkpoint_id == published
        assert ckpt.resumed.weights_version == 7
        assert ckpt.weights_version == 7
        assert fresh_policy.installs == [(7, b"trainer-weights")]
        with pytest.raises(ValueError):
            await ckpt.push_weights(6)  # versions never go down


async def test_a_trainer_restarted_into_running_policy_servers_pushes_above_what_they_hold(
    tmp_path: Path,
) -> None:
    """docs/spec.md section 6.11 item 6. The trainer pushes 7, snapshots, pushes 9 and
    dies; the policy servers keep running. The next incarnation restores the snapshot
    (version 7) into them where they run: they refuse 7 (they hold 9), so the restored
    weights go to every server at 10, and the trainer's later versions go above it."""
    root = tmp_path / "snapshots"
    models = {"policy-a": RecordingPolicy(), "policy-b": RecordingPolicy()}
    async with AsyncExitStack() as servers:
        addresses = {
            name: (await servers.enter_async_context(policy_server(root, model, name))).address
            for name, model in models.items()
        }
        first = _checkpointing(root, addresses, torch.nn.Linear(2, 2), final_snapshot=False)
        async with first as ckpt:
            await ckpt.push_weights(7, b"seven")
            published = (await ckpt.snapshot_now()).checkpoint_id
            await ckpt.push_weights(9, b"nine")  # after the snapshot: lost with the trainer

        async with _checkpointing(root, addresses, torch.nn.Linear(2, 2)) as ckpt:
            assert ckpt.resumed.checkpoint_id == published
            assert ckpt.resumed.weights_version == 7
            pushed = ckpt.resumed.weights_pushed
            assert pushed is not None and pushed.version == 10
            assert ckpt.weights_version == 10
            with pytest.raises(ValueError):
                await ckpt.push_weights(9)
            await ckpt.push_weights(11, b"eleven")
    for model in models.values():
        assert [version for version, _ in model.installs] == [0, 7, 9, 10, 11]
        assert model.installs[3] == (10, b"trainer-weights")
