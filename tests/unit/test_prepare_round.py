"""One participant's prepare round (turnpoint.trainer.snapshots.preparing) cancelled at the edge."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from turnpoint.trainer.control.failures import CallTimeoutError
from turnpoint.trainer.snapshots.core import ParticipantPrepare
from turnpoint.trainer.snapshots.preparing import PreparingParticipant, Readiness, Unacked
from turnpoint.v1 import checkpoint_control_service_pb2 as pb


class _FailsAtOnce:
    async def call(self, request: Any, timeout_s: float) -> Any:
        raise CallTimeoutError("agent-0", "Prepare", "no reply")


async def test_a_prepare_cancelled_just_as_its_call_fails_leaves_nothing_unretrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    participant = PreparingParticipant(
        core=ParticipantPrepare("agent-0", deadline=loop.time() + 10.0, round_timeout_s=1.0),
        client=_FailsAtOnce(),
        readiness=Readiness(),
        unacked=Unacked(None, None),
        on_answer=lambda _name, _response: None,
    )
    preparing = asyncio.ensure_future(participant.call(pb.PrepareRequest(checkpoint_id="c-1"), 1.0))
    await asyncio.sleep(0)  # the round starts its call and waits
    await asyncio.sleep(0)  # the call fails; the round has not woken yet
    preparing.cancel()  # the fan-out's deadline, say
    await asyncio.gather(preparing, return_exceptions=True)
    assert preparing.cancelled()
    del preparing
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert [context["message"] for context in reported] == []
