"""What every control operation of the coordinator shares: request ids, lease renewal.

docs/spec.md sections 2.8, 4 and 7.3. The
:class:`~turnpoint.trainer.control.coordinator.Coordinator` holds one
:class:`~turnpoint.trainer.control.client.ParticipantControlClient` per participant
instance and turns each protocol operation into one bounded fan-out:

- every request carries the coordinator's Fence (id and epoch) and a request id decided
  once per (operation, checkpoint, instance): a retry, by this coordinator or by the
  snapshot pump on its next tick, sends the very same id, so a participant that acted
  on a request whose reply was lost replays or joins instead of acting twice;
- every fan-out has a deadline (the operation's timeout plus the reply grace) and calls
  still running at it are cancelled (:func:`~turnpoint.trainer.control.fanout.fan_out`);
- every failure is classified (:func:`~turnpoint.trainer.control.client.classify`):
  retryable when it is not-ready or every failing instance failed with an infrastructure
  error, an invariant break otherwise (docs/spec.md section 7.5).

:class:`Renewer` keeps the leases of an open checkpoint or restore alive in the
background while anything is slow, on the schedule
:class:`~turnpoint.trainer.snapshots.core.RenewalSchedule` decides; a renew that
hangs is abandoned before the next one is due and never holds up the checkpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from typing import Any, Final, Protocol

from turnpoint.ids import EpisodeId, InvalidIdError
from turnpoint.protocol import ParticipantKind
from turnpoint.trainer.config import CoordinatorConfig
from turnpoint.trainer.control.client import (
    request_id_source,
)
from turnpoint.trainer.control.failures import Failure, MalformedReplyError
from turnpoint.trainer.control.fanout import FanoutResult
from turnpoint.trainer.snapshots.core import RenewalSchedule
from turnpoint.v1 import types_pb2

_LOG = logging.getLogger(__name__)

JOINING_ATTEMPTS: Final = 2
"""A commit, retire or restore that ran out of time keeps working on the participant; one
retry with the same request joins that work (docs/spec.md section 4.3) instead of giving
up."""
JOINING_RETRY_PAUSE_S: Final = 0.25
"""The pause before that retry (docs/spec.md section 7.3 item 3): a failure that broke the
connection would otherwise be retried at once on the connection still being torn down."""
# Resume order (docs/spec.md section 7.4 step 8): what rollouts depend on reopens first.
# Checkpoints whose released participants are remembered (a resume of an older one
# is sent to everyone named, which is harmless: resuming is idempotent).
_RELEASED_REMEMBERED: Final = 8
_RESUME_ORDER: Final = (
    (ParticipantKind.RESOURCES,),
    (ParticipantKind.MODEL,),
    (ParticipantKind.AGENT, ParticipantKind.ENVIRONMENT),
)


class _RequestIds:
    """Request ids decided once per (operation, key, instance), kept for recent keys.

    A key is a checkpoint or restore id, or a digest of what a retire/forget names. The
    bound only has to cover the keys a retry can still name: the open checkpoint and
    the few before it whose release the pump may still retry.
    """

    def __init__(self, max_keys: int = 64) -> None:
        self._max_keys = max_keys
        self._ids: OrderedDict[str, dict[tuple[str, str], str]] = OrderedDict()
        self._new_id = request_id_source()

    def get(self, operation: str, key: str, instance: str) -> str:
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = {}
            while len(self._ids) > self._max_keys:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        request_id = ids.get((operation, instance))
        if request_id is None:
            request_id = ids[(operation, instance)] = self._new_id()
        return request_id


def content_key(operation: str, items: Mapping[str, Sequence[object]]) -> str:
    """A stable key for a retire or forget: the same content gets the same request ids."""
    digest = hashlib.sha256()
    for instance in sorted(items):
        digest.update(f"{instance}:{','.join(sorted(map(str, items[instance])))};".encode())
    return f"{operation}-{digest.hexdigest()[:24]}"


def episodes_of(
    messages: Iterable[types_pb2.EpisodeId], instance: str, operation: str
) -> tuple[EpisodeId, ...]:
    try:
        return tuple(EpisodeId(m.rollout_id, m.attempt) for m in messages)
    except InvalidIdError as error:
        raise MalformedReplyError(
            instance, operation, f"reply names a bad episode: {error}"
        ) from None


class Renewing(Protocol):
    """What a :class:`Renewer` needs of the coordinator."""

    @property
    def config(self) -> CoordinatorConfig: ...

    def ending(self, checkpoint_id: str) -> frozenset[str]: ...

    async def renew_round(
        self, checkpoint_id: str, instances: Sequence[str], window_s: float
    ) -> FanoutResult[Any]: ...


class Renewer:
    """Keeps the leases of one checkpoint (or restore) alive in the background.

    Its task starts only when the first renewal is due (a timer until then): most
    prepares end long before it, and should not pay for a task that only waits.
    """

    def __init__(self, operations: Renewing, checkpoint_id: str, instances: Iterable[str]) -> None:
        self._operations = operations
        self._checkpoint_id = checkpoint_id
        self._instances = tuple(sorted(instances))
        self._kick = asyncio.Event()
        self._schedule: RenewalSchedule | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.failures: dict[str, Failure] = {}

    def start(self, *, renew_now: bool = False) -> None:
        config = self._operations.config
        loop = asyncio.get_running_loop()
        self._schedule = RenewalSchedule(
            interval_s=config.renew_interval_s,
            control_timeout_s=config.control_timeout_s,
            now=loop.time(),
            renew_now=renew_now,
        )
        if self._task is None and self._timer is None:
            wait_s = self._schedule.wait_s(loop.time())
            if wait_s > 0:
                self._timer = loop.call_later(wait_s, self._spawn)
            else:
                self._spawn()

    def _spawn(self) -> None:
        self._timer = None
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"renew-{self._checkpoint_id}")

    def renew_now(self) -> None:
        if self._schedule is not None:
            self._schedule.renew_now()
            if self._timer is not None:
                self._timer.cancel()
                self._spawn()
        self._kick.set()

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        schedule = self._schedule
        assert schedule is not None
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), schedule.wait_s(loop.time()))
            self._kick.clear()
            if not schedule.due(loop.time()):
                continue
            # Who ended the checkpoint in its commit, or was told to resume, holds no
            # lease any more.
            ending = self._operations.ending(self._checkpoint_id)
            result = await self._operations.renew_round(
                self._checkpoint_id,
                tuple(n for n in self._instances if n not in ending),
                schedule.window_s,
            )
            schedule.renewed(loop.time())
            for name in result.responses:
                self.failures.pop(name, None)
            self.failures.update(result.failures)
