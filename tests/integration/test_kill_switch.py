"""The kill switch's status probe against real participants (``GetStatus`` on the wire).

``prepare-sent`` and ``commit-sent`` land once some participant reports that it holds
the checkpoint, or has written its part of it: the probe must read exactly that.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.participants import TOKEN, start_topology
from turnpoint.apps.demo._kill_switch import StatusProbe
from turnpoint.ids import EpisodeId
from turnpoint.trainer import CoordinatorConfig
from turnpoint.trainer.advanced import Coordinator
from turnpoint.v1 import types_pb2

HOLDING = {types_pb2.PHASE_PREPARING, types_pb2.PHASE_PREPARED}
WROTE = {types_pb2.PHASE_COMMITTED}


async def test_the_probe_sees_a_checkpoint_held_then_written_then_released(
    tmp_path: Path,
) -> None:
    config = CoordinatorConfig(snapshot_root=tmp_path, control_timeout_s=5.0)
    async with start_topology(tmp_path, agents=1) as topology:
        endpoints = {name: hosted.address for name, hosted in topology.participants.items()}
        probe = StatusProbe(endpoints, token=TOKEN)
        coordinator = Coordinator(
            endpoints, token=TOKEN, coordinator_id="coord", epoch=1, config=config
        )
        async with coordinator:
            await coordinator.discover()
            try:
                await probe.connect()
                assert not await probe.any_in("ck-1", HOLDING)

                prepared = await coordinator.prepare("ck-1")
                assert await probe.any_in("ck-1", HOLDING)
                assert not await probe.any_in("ck-1", WROTE)
                assert not await probe.any_in("ck-2", HOLDING)

                scope: dict[str, list[EpisodeId]] = {}
                await coordinator.commit(prepared.checkpoint_id, "ck-1", scope)
                # Each commit ended the checkpoint (docs/spec.md section 4.8 item 9): the
                # participants are idle, and their status names what they wrote.
                assert await probe.any_in("ck-1", WROTE)
                assert not await probe.any_in("ck-1", HOLDING)

                await coordinator.resume("ck-1")
                assert not await probe.any_in("ck-1", HOLDING)
                assert not await probe.any_in("ck-2", WROTE)
            finally:
                await probe.aclose()
