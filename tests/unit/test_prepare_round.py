"""One participant's prepare round (turnpoint.trainer.snapshots.preparing) cancelled at the edge."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from turnpoint.trainer.control.failures import CallTimeoutError, NotReadyError
from turnpoint.trainer.snapshots.core import ParticipantPrepare
from turnpoint.trainer.snapshots.preparing import PreparingParticipant, Readiness, Unacked
from turnpoint.v1 import checkpoint_control_service_pb2 as pb


class _FailsWhenReleased:
    """A prepare call that fails once ``release`` is set; it notes a cancellation."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = 0

    async def call(self, request: Any, timeout_s: float) -> Any:
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise CallTimeoutError("agent-0", "Prepare", "no reply")


def _participant(client: Any) -> tuple[PreparingParticipant, ParticipantPrepare, Unacked]:
    loop = asyncio.get_running_loop()
    core = ParticipantPrepare("agent-0", deadline=loop.time() + 10.0, round_timeout_s=1.0)
    unacked = Unacked(None, None)
    participant = PreparingParticipant(
        core=core,
        client=client,
        readiness=Readiness(),
        unacked=unacked,
        on_answer=lambda _name, _response: None,
    )
    return participant, core, unacked


async def test_a_prepare_cancelled_just_as_its_call_fails_leaves_nothing_unretrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    client = _FailsWhenReleased()
    participant, _, _ = _participant(client)
    preparing = asyncio.ensure_future(participant.call(pb.PrepareRequest(checkpoint_id="c-1"), 1.0))
    await asyncio.sleep(0)  # the round starts its call and waits
    client.release.set()  # the call is about to fail...
    preparing.cancel()  # ...as the fan-out's deadline cancels the prepare
    await asyncio.gather(preparing, return_exceptions=True)
    assert preparing.cancelled()
    del preparing
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert [context["message"] for context in reported] == []


async def test_a_round_given_up_as_hopeless_cancels_its_call_and_is_not_ready() -> None:
    client = _FailsWhenReleased()
    participant, core, unacked = _participant(client)
    preparing = asyncio.ensure_future(participant.call(pb.PrepareRequest(checkpoint_id="c-1"), 1.0))
    await asyncio.sleep(0)  # the round's call waits for its reply
    # What Unacked.handle does for a completion that must be retired.
    core.mark_hopeless("r1 must be retired")
    unacked.hopeless("agent-0").set_result(None)
    [outcome] = await asyncio.gather(preparing, return_exceptions=True)
    # The call was cancelled (the participant is told), the prepare itself was not:
    # it ends not ready, its task no longer cancelling.
    assert client.cancelled == 1
    assert isinstance(outcome, NotReadyError), outcome
    assert preparing.cancelling() == 0


async def test_a_deadline_cancel_beside_a_hopeless_round_still_cancels_the_prepare() -> None:
    client = _FailsWhenReleased()
    participant, core, unacked = _participant(client)
    preparing = asyncio.ensure_future(participant.call(pb.PrepareRequest(checkpoint_id="c-1"), 1.0))
    await asyncio.sleep(0)
    core.mark_hopeless("r1 must be retired")
    unacked.hopeless("agent-0").set_result(None)
    preparing.cancel()  # the fan-out's deadline, in the same instant
    await asyncio.gather(preparing, return_exceptions=True)
    assert preparing.cancelled()
    assert client.cancelled == 1
