"""The kit acting as a coordinator: its identity, ids, control calls and episodes.

A :class:`Kit` holds what every check shares: the target's channels, what Describe
said, a fresh random coordinator id with an epoch well above the one the target held,
unique checkpoint, request and rollout ids, and the work a check left running so that
:meth:`Kit.settle` can leave the target idle for the next check whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2, struct_pb2

from turnpoint.auth import ACCEPTED_METADATA_KEY, INCARNATION_METADATA_KEY
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import policy_service_pb2, resources_service_pb2, rollout_service_pb2, types_pb2

from ._rules import error_problems, phase_name
from ._wire import Refused, Target, WireError, wire_error

T = TypeVar("T")

# How far above the epoch the target held the kit starts: a live coordinator restarting
# meanwhile bumps its epoch by one and must not collide with the kit's.
EPOCH_HEADROOM = 1000
# The lease of a checkpoint a check holds open on purpose: it must not run out meanwhile.
HOLD_LEASE_S = 30.0
# How often a bounded wait looks again at something the target offers no event for.
POLL_S = 0.05


class CheckFailed(Exception):
    """The target broke the rule the check is about; the message says how."""


class CheckSkipped(Exception):
    """The check cannot run against this target; the message says why."""


def require(condition: bool, detail: str) -> None:
    if not condition:
        raise CheckFailed(detail)


def require_idle(status: pb.GetStatusResponse, where: str) -> None:
    """The status of an idle participant: no active id, no lease (section 4.13)."""
    require(
        status.phase == types_pb2.PHASE_IDLE,
        f"{where}: phase {phase_name(status.phase)}, expected IDLE",
    )
    require(
        not status.active_checkpoint_id,
        f"{where}: active_checkpoint_id {status.active_checkpoint_id!r} while idle",
    )
    require(not status.HasField("lease_expires_at"), f"{where}: lease_expires_at set while idle")


class WorkloadError(ValueError):
    """The workload file cannot be used."""


@dataclass(frozen=True)
class Workload:
    """What the kit sends on the data plane, which only the environment understands.

    ``task`` is the task of a Run (agents) and of a SeedSession (resources); without it
    the checks that need an episode are skipped. ``answer`` is the Verify answer.
    ``generate`` is the prompt and length of a Generate (models). ``calls`` is a recorded
    episode of a resources server, ``[{"tool": NAME, "arguments": {...}}, ...]``, sent in
    order after the seed: what the equivalence check replays (docs/spec.md section 5.6); the effects check
    sends the first one with a key (section 6.12). ``chat`` holds the messages of a chat
    completion the target's model can read, and its ``max_tokens`` (the
    ``openai-endpoint`` check, section 12.2).
    """

    task: Mapping[str, Any] | None = None
    answer: Mapping[str, Any] = field(default_factory=dict)
    prompt_token_ids: tuple[int, ...] = (1,)
    max_new_tokens: int = 1
    calls: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    chat: tuple[Mapping[str, Any], ...] | None = None
    chat_max_tokens: int = 1

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Workload:
        unknown = sorted(set(data) - {"task", "answer", "generate", "calls", "chat"})
        if unknown:
            raise WorkloadError(
                f"unknown keys {unknown}; valid: task, answer, generate, calls, chat"
            )
        task = data.get("task")
        answer = data.get("answer", {})
        generate = data.get("generate", {})
        if task is not None and not isinstance(task, dict):
            raise WorkloadError("task must be a JSON object")
        if not isinstance(answer, dict) or not isinstance(generate, dict):
            raise WorkloadError("answer and generate must be JSON objects")
        prompt = generate.get("prompt_token_ids", [1])
        length = generate.get("max_new_tokens", 1)
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise WorkloadError("generate.prompt_token_ids must be a list of integers")
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise WorkloadError("generate.max_new_tokens must be an integer >= 1")
        chat, chat_max_tokens = _chat(data.get("chat"))
        calls = _calls(data.get("calls", []))
        return cls(task, answer, tuple(prompt), length, calls, chat, chat_max_tokens)

    @classmethod
    def from_file(cls, path: str | Path) -> Workload:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise WorkloadError(f"cannot read the workload file {str(path)!r}: {error}") from None
        if not isinstance(data, dict):
            raise WorkloadError("the workload file must hold a JSON object")
        return cls.from_mapping(data)


def _chat(raw: object) -> tuple[tuple[Mapping[str, Any], ...] | None, int]:
    if raw is None:
        return None, 1
    messages = raw.get("messages") if isinstance(raw, dict) else None
    max_tokens = raw.get("max_tokens", 1) if isinstance(raw, dict) else None
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        raise WorkloadError("chat must be {messages: [{role, content}, ...], max_tokens: N}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise WorkloadError("chat.max_tokens must be an integer >= 1")
    return tuple(messages), max_tokens


@dataclass(frozen=True, slots=True)
class HttpFace:
    """An HTTP face of the target the kit checks (docs/spec.md section 12): its base URL
    (``http://host:port/v1``) and the key a client of it holds (the endpoint's API key; a
    harness's relay credential); for the relay, a replaced harness's credential too."""

    base_url: str
    key: str | None = None
    fenced_key: str | None = None


def _calls(raw: object) -> tuple[tuple[str, Mapping[str, Any]], ...]:
    if not isinstance(raw, list):
        raise WorkloadError("calls must be a list of {tool, arguments} objects")
    calls: list[tuple[str, Mapping[str, Any]]] = []
    for number, call in enumerate(raw, start=1):
        if not isinstance(call, dict) or set(call) - {"tool", "arguments"}:
            raise WorkloadError(f"call #{number} must be an object with tool and arguments")
        tool, arguments = call.get("tool"), call.get("arguments", {})
        if not isinstance(tool, str) or not tool or not isinstance(arguments, dict):
            raise WorkloadError(f"call #{number}: tool is a name, arguments an object")
        calls.append((tool, arguments))
    return tuple(calls)


def struct(value: Mapping[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(dict(value))
    return message


def duration(seconds: float) -> duration_pb2.Duration:
    message = duration_pb2.Duration()
    message.FromNanoseconds(round(seconds * 1e9))
    return message


def episode(rollout_id: str, attempt: int = 0) -> types_pb2.EpisodeId:
    return types_pb2.EpisodeId(rollout_id=rollout_id, attempt=attempt)


def show(e: types_pb2.EpisodeId) -> str:
    return f"{e.rollout_id}#{e.attempt}"


class RunStream:
    """One ``Run`` call read in the background: boundaries, the result or the error.

    A Run has no gRPC deadline (parked time must not count, section 6.10 item 7); every
    wait on it here is bounded instead.
    """

    def __init__(self, kit: Kit, request: rollout_service_pb2.RunRequest) -> None:
        self.kit = kit
        self.request = request
        self.episode = request.episode
        self.boundaries: list[rollout_service_pb2.BoundaryReport] = []
        self.result: rollout_service_pb2.RunResult | None = None
        self.error: WireError | None = None
        self.headers: list[types_pb2.ResponseHeader] = []
        self.extra: list[str] = []  # anything after the result, or a message with no event
        self.cancelled_by_us = False
        self._changed = asyncio.Condition()
        self._call = kit.target.rollout.Run(request, metadata=kit.target.metadata)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self._call:
                async with self._changed:
                    self.headers.append(message.header)
                    which = message.WhichOneof("event")
                    if self.result is not None:
                        self.extra.append(f"a {which or 'message'} after the result")
                    elif which == "boundary":
                        self.boundaries.append(message.boundary)
                    elif which == "result":
                        self.result = message.result
                    else:
                        self.extra.append("a RunResponse with no event")
                    self._changed.notify_all()
        except grpc.aio.AioRpcError as error:
            if not self.cancelled_by_us:
                self.error = wire_error("Run", error)
        finally:
            async with self._changed:
                self._changed.notify_all()

    @property
    def done(self) -> bool:
        return self._reader.done()

    async def accepted(self) -> bool:
        """Whether the initial metadata said ``turnpoint-accepted: 1`` (section 6.1)."""
        try:
            metadata = await asyncio.wait_for(
                self._call.initial_metadata(), self.kit.episode_bound_s
            )
        except (grpc.aio.AioRpcError, TimeoutError):
            return False
        return any(key == ACCEPTED_METADATA_KEY and value == "1" for key, value in metadata or ())

    async def incarnation(self) -> str:
        """The ``turnpoint-incarnation`` the initial metadata named ("" if none)."""
        try:
            metadata = await asyncio.wait_for(
                self._call.initial_metadata(), self.kit.episode_bound_s
            )
        except (grpc.aio.AioRpcError, TimeoutError):
            return ""
        named = [value for key, value in metadata or () if key == INCARNATION_METADATA_KEY]
        return str(named[0]) if named else ""

    async def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: predicate() or self._reader.done())

        try:
            await asyncio.wait_for(wait(), self.kit.episode_bound_s)
        except TimeoutError:
            raise CheckFailed(
                f"{show(self.episode)}: no {what} within {self.kit.episode_bound_s:.0f} s"
            ) from None

    async def boundary(self, count: int = 1) -> rollout_service_pb2.BoundaryReport:
        """Wait for the ``count``-th boundary report of this call."""
        await self.wait_for(lambda: len(self.boundaries) >= count, f"boundary report #{count}")
        if len(self.boundaries) < count:
            raise CheckFailed(self._ended(f"before boundary report #{count}"))
        return self.boundaries[count - 1]

    async def finished(self) -> rollout_service_pb2.RunResult:
        await self.wait_for(lambda: self._reader.done(), "end of the Run stream")
        if self.result is None:
            raise CheckFailed(self._ended("without a RunResult"))
        return self.result

    async def ended(self) -> None:
        """Wait until the call ended, however it ended."""
        await self.wait_for(lambda: self._reader.done(), "end of the Run stream")

    async def refusal(self, what: str) -> WireError:
        """Wait for the call to end: it must have been refused before any message."""
        await self.ended()
        if self.error is None or self.boundaries or self.result is not None:
            accepted = "answered" if self.error is None else "refused only after a message"
            raise CheckFailed(f"{what}: {accepted}, expected a refusal before any message")
        return self.error

    def _ended(self, when: str) -> str:
        if self.error is not None:
            return f"{show(self.episode)}: the Run ended {self.error.summary()} {when}"
        return f"{show(self.episode)}: the Run stream ended {when}"

    async def cancel(self) -> None:
        self.cancelled_by_us = True
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@dataclass
class _Leftovers:
    """What checks started on the target, so that settle can clean it up."""

    checkpoints: set[str] = field(default_factory=set)
    runs: list[RunStream] = field(default_factory=list)
    receipts: list[types_pb2.CompletionReceipt] = field(default_factory=list)
    sessions: list[types_pb2.EpisodeId] = field(default_factory=list)
    retired: set[str] = field(default_factory=set)


class Kit:
    """The coordinator the checks act as; one per conformance run."""

    def __init__(
        self,
        target: Target,
        *,
        workload: Workload,
        lease_s: float,
        episode_bound_s: float,
        restore_targets: Mapping[str, Kit] | None = None,
        snapshot_root: Path | None = None,
        openai_endpoint: HttpFace | None = None,
        relay: HttpFace | None = None,
    ) -> None:
        self.target = target
        self.openai_endpoint = openai_endpoint
        self.relay = relay
        # Freshly started processes of the target (its instance name, its snapshot
        # root): what a check needs to restore work the target did, since the target is
        # no longer fresh once it served any, and a participant takes one restore only
        # (section 4.10). Each check that restores has one of its own, by check name.
        self.restore_targets = dict(restore_targets or {})
        self.used_restore_targets: list[Kit] = []
        self.workload = workload
        # The snapshot root the targets share, when the kit may write there.
        self.snapshot_root = snapshot_root
        self.lease_s = lease_s
        self.episode_bound_s = episode_bound_s
        self.coordinator_id = f"conformance-{secrets.token_hex(6)}"
        self.epoch = 0
        self.description = pb.DescribeResponse()
        self._prefix = f"conf{secrets.token_hex(4)}"
        self._sequence = 0
        self._counter = 0
        self._left = _Leftovers()
        self.notes: list[str] = []  # what the run left on the target, for the report

    # ------------------------------------------------------------------ identity and ids

    async def discover(self) -> pb.DescribeResponse:
        """Describe without a fence, then pick the kit's epoch above the target's."""
        self.description = await self.describe()
        self.epoch = self.description.header.epoch + EPOCH_HEADROOM
        return self.description

    def take_restore_target(self, check: str) -> Kit | None:
        """The fresh restore target set aside for ``check``, or None (none was left)."""
        fresh = self.restore_targets.pop(check, None)
        if fresh is not None:
            self.used_restore_targets.append(fresh)
        return fresh

    def restore_target_missing(self) -> str:
        """Why a check that restores found no restore target: what to give the kit."""
        if self.restore_targets or self.used_restore_targets:
            return (
                "each --restore-target given went to another check that restores (a "
                "participant takes one restore): give one more"
            )
        return "no --restore-target HOST:PORT (a freshly started process of the target)"

    @property
    def kind(self) -> int:
        return int(self.description.kind)

    @property
    def instance(self) -> str:
        return self.description.instance_name

    @property
    def hosts_agent(self) -> bool:
        return self.kind in (
            types_pb2.PARTICIPANT_KIND_AGENT,
            types_pb2.PARTICIPANT_KIND_ENVIRONMENT,
        )

    @property
    def hosts_resources(self) -> bool:
        return self.kind in (
            types_pb2.PARTICIPANT_KIND_RESOURCES,
            types_pb2.PARTICIPANT_KIND_ENVIRONMENT,
        )

    @property
    def hosts_model(self) -> bool:
        return self.kind == types_pb2.PARTICIPANT_KIND_MODEL

    def fence(
        self, *, epoch: int | None = None, coordinator_id: str | None = None
    ) -> types_pb2.Fence:
        return types_pb2.Fence(
            coordinator_id=self.coordinator_id if coordinator_id is None else coordinator_id,
            epoch=self.epoch if epoch is None else epoch,
        )

    def checkpoint_id(self, prefix: str | None = None) -> str:
        """A new id carrying a sequence above every id the kit used (section 2.6)."""
        self._sequence += 1
        return f"{prefix or self._prefix}-{self._sequence:012d}"

    def other_prefix(self) -> str:
        return f"{self._prefix}x"

    def rid(self, label: str) -> str:
        self._counter += 1
        return f"{self._prefix}-{label}-{self._counter}"

    def rollout(self, label: str) -> str:
        self._counter += 1
        return f"{self._prefix}-{label}-{self._counter}"

    # ------------------------------------------------------------------ control calls

    async def describe(self, fence: types_pb2.Fence | None = None) -> pb.DescribeResponse:
        request = pb.DescribeRequest(fence=fence) if fence is not None else pb.DescribeRequest()
        return await self.target.call(self.target.control.Describe, request, name="Describe")

    async def status(self, max_blockers: int = 0) -> pb.GetStatusResponse:
        response = await self.target.call(
            self.target.control.GetStatus,
            pb.GetStatusRequest(max_blockers=max_blockers),
            name="GetStatus",
        )
        # Section 4.1 item 2 / 4.13: at no observable point may the two disagree.
        require(
            response.admission_open == (response.phase == types_pb2.PHASE_IDLE),
            f"GetStatus: admission_open={response.admission_open} in phase "
            f"{phase_name(response.phase)}",
        )
        return response

    async def prepare(
        self,
        checkpoint_id: str,
        *,
        rid: str | None = None,
        lease_s: float | None = None,
        max_blockers: int = 0,
        timeout_s: float | None = None,
        fence: types_pb2.Fence | None = None,
    ) -> pb.PrepareResponse:
        self._left.checkpoints.add(checkpoint_id)
        request = pb.PrepareRequest(
            fence=self.fence() if fence is None else fence,
            request_id=self.rid("prepare") if rid is None else rid,
            checkpoint_id=checkpoint_id,
            max_blockers=max_blockers,
        )
        if lease_s is not None:
            request.lease.CopyFrom(duration(lease_s))
        return await self.target.call(
            self.target.control.Prepare, request, name="Prepare", timeout_s=timeout_s
        )

    async def renew(
        self,
        checkpoint_id: str,
        *,
        rid: str | None = None,
        lease_s: float | None = None,
        fence: types_pb2.Fence | None = None,
    ) -> pb.RenewResponse:
        request = pb.RenewRequest(
            fence=self.fence() if fence is None else fence,
            request_id=self.rid("renew") if rid is None else rid,
            checkpoint_id=checkpoint_id,
        )
        if lease_s is not None:
            request.lease.CopyFrom(duration(lease_s))
        return await self.target.call(self.target.control.Renew, request, name="Renew")

    async def commit(
        self,
        checkpoint_id: str,
        snapshot: str,
        scope: Sequence[types_pb2.EpisodeId] = (),
        *,
        rid: str | None = None,
    ) -> pb.CommitResponse:
        request = pb.CommitRequest(
            fence=self.fence(),
            request_id=self.rid("commit") if rid is None else rid,
            checkpoint_id=checkpoint_id,
            snapshot=snapshot,
            scope=list(scope),
        )
        return await self.target.call(self.target.control.Commit, request, name="Commit")

    async def resume(
        self,
        checkpoint_id: str,
        *,
        rid: str | None = None,
        fence: types_pb2.Fence | None = None,
        unfenced: bool = False,
    ) -> pb.ResumeResponse:
        request = pb.ResumeRequest(
            request_id=self.rid("resume") if rid is None else rid, checkpoint_id=checkpoint_id
        )
        if not unfenced:
            request.fence.CopyFrom(self.fence() if fence is None else fence)
        return await self.target.call(self.target.control.Resume, request, name="Resume")

    async def restore(
        self,
        restore_id: str,
        snapshot: str,
        entry: pb.ManifestEntry,
        scope: Sequence[types_pb2.EpisodeId] = (),
        *,
        rid: str | None = None,
    ) -> pb.RestoreResponse:
        self._left.checkpoints.add(restore_id)
        request = pb.RestoreRequest(
            fence=self.fence(),
            request_id=self.rid("restore") if rid is None else rid,
            restore_id=restore_id,
            snapshot=snapshot,
            entry=entry,
            scope=list(scope),
            lease=duration(HOLD_LEASE_S),
        )
        return await self.target.call(self.target.control.Restore, request, name="Restore")

    async def restore_running(
        self,
        restore_id: str,
        snapshot: str,
        entry: pb.ManifestEntry,
        scope: Sequence[types_pb2.EpisodeId] = (),
        *,
        rid: str | None = None,
        retire_unscoped: bool = False,
    ) -> pb.RestoreRunningResponse:
        self._left.checkpoints.add(restore_id)
        request = pb.RestoreRunningRequest(
            fence=self.fence(),
            request_id=self.rid("restore-running") if rid is None else rid,
            restore_id=restore_id,
            snapshot=snapshot,
            entry=entry,
            scope=list(scope),
            lease=duration(HOLD_LEASE_S),
            retire_unscoped=retire_unscoped,
        )
        return await self.target.call(
            self.target.control.RestoreRunning, request, name="RestoreRunning"
        )

    async def retire(
        self,
        episodes: Sequence[types_pb2.EpisodeId],
        *,
        rid: str | None = None,
        fence: types_pb2.Fence | None = None,
    ) -> pb.RetireResponse:
        self._left.retired.update(e.rollout_id for e in episodes)
        request = pb.RetireRequest(
            fence=self.fence() if fence is None else fence,
            request_id=self.rid("retire") if rid is None else rid,
            episodes=list(episodes),
        )
        return await self.target.call(self.target.control.Retire, request, name="Retire")

    async def forget(
        self,
        rollout_ids: Sequence[str],
        *,
        rid: str | None = None,
        fence: types_pb2.Fence | None = None,
    ) -> pb.ForgetResponse:
        request = pb.ForgetRequest(
            fence=self.fence() if fence is None else fence,
            request_id=self.rid("forget") if rid is None else rid,
            rollout_ids=list(rollout_ids),
        )
        response = await self.target.call(self.target.control.Forget, request, name="Forget")
        self._left.retired.difference_update(rollout_ids)
        return response

    # ------------------------------------------------------------------ judging answers

    async def refused(
        self,
        call: Awaitable[Any],
        reason: str | Sequence[str],
        what: str,
        *,
        keys: Sequence[str] = (),
    ) -> WireError:
        """Await ``call``, which must fail with ``reason`` carried as section 9 says."""
        try:
            await call
        except Refused as refusal:
            problems = error_problems(refusal.error, reason, keys)
            if problems:
                raise CheckFailed(f"{what}: {'; '.join(problems)}") from None
            return refusal.error
        expected = reason if isinstance(reason, str) else " or ".join(reason)
        raise CheckFailed(f"{what}: answered OK, expected {expected}")

    async def poll(
        self, probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], bound_s: float
    ) -> tuple[T, bool]:
        """Call ``probe`` until ``done`` holds or ``bound_s`` passed: (last value, held)."""
        give_up = time.monotonic() + bound_s
        while True:
            value = await probe()
            if done(value):
                return value, True
            if time.monotonic() >= give_up:
                return value, False
            await asyncio.sleep(POLL_S)

    # ------------------------------------------------------------------ the data plane

    def run(
        self,
        e: types_pb2.EpisodeId,
        *,
        rid: str | None = None,
        task: Mapping[str, Any] | None = None,
        boundaries_seen: int = 0,
        budget_s: float | None = None,
        participant_incarnation: str = "",
    ) -> RunStream:
        """Start a Run of ``e`` with the workload's task (or ``task``); a re-attach names
        the ``participant_incarnation`` that accepted it."""
        chosen = self.workload.task if task is None else task
        request = rollout_service_pb2.RunRequest(
            request_id=rid or f"run-{show(e)}",
            episode=e,
            task=struct(chosen or {}),
            boundaries_seen=boundaries_seen,
            participant_incarnation=participant_incarnation,
        )
        if budget_s is not None:
            request.budget.CopyFrom(duration(budget_s))
        stream = RunStream(self, request)
        self._left.runs.append(stream)
        return stream

    def owe(self, result: rollout_service_pb2.RunResult) -> None:
        """Remember a receipt the check has not acknowledged yet (settle acknowledges it)."""
        if result.HasField("receipt"):
            self._left.receipts.append(result.receipt)

    async def acknowledge(
        self, receipts: Sequence[types_pb2.CompletionReceipt], *, rid: str | None = None
    ) -> rollout_service_pb2.AcknowledgeResponse:
        response = await self.target.call(
            self.target.rollout.Acknowledge,
            rollout_service_pb2.AcknowledgeRequest(
                request_id=self.rid("ack") if rid is None else rid, receipts=list(receipts)
            ),
            name="Acknowledge",
        )
        acked = {r.receipt_id for r in receipts}
        self._left.receipts = [r for r in self._left.receipts if r.receipt_id not in acked]
        return response

    async def seed(
        self,
        e: types_pb2.EpisodeId,
        *,
        group: str = "",
        sibling: int = 0,
        size: int = 1,
        task: Mapping[str, Any] | None = None,
    ) -> resources_service_pb2.SeedSessionResponse:
        self._left.sessions.append(e)
        chosen = self.workload.task if task is None else task
        return await self.target.call(
            self.target.resources.SeedSession,
            resources_service_pb2.SeedSessionRequest(
                request_id=self.rid("seed"),
                episode=e,
                task=struct(chosen or {}),
                prompt_group_id=group,
                sibling_index=sibling,
                group_size=size,
            ),
            name="SeedSession",
            timeout_s=self.episode_bound_s,
        )

    async def verify(
        self, e: types_pb2.EpisodeId, *, timeout_s: float | None = None
    ) -> resources_service_pb2.VerifyResponse:
        return await self.target.call(
            self.target.resources.Verify,
            resources_service_pb2.VerifyRequest(
                request_id=self.rid("verify"), episode=e, answer=struct(self.workload.answer)
            ),
            name="Verify",
            timeout_s=self.episode_bound_s if timeout_s is None else timeout_s,
        )

    async def call(
        self, e: types_pb2.EpisodeId, tool: str, arguments: Mapping[str, Any]
    ) -> resources_service_pb2.CallResponse:
        return await self.target.call(
            self.target.resources.Call,
            resources_service_pb2.CallRequest(
                request_id=self.rid("call"), episode=e, tool=tool, arguments=struct(arguments)
            ),
            name="Call",
            timeout_s=self.episode_bound_s,
        )

    def holds_session(self, e: types_pb2.EpisodeId) -> None:
        """A session the kit did not seed here (a restored one): settle closes it too."""
        self._left.sessions.append(e)

    async def close_session(
        self, e: types_pb2.EpisodeId
    ) -> resources_service_pb2.CloseSessionResponse:
        response = await self.target.call(
            self.target.resources.CloseSession,
            resources_service_pb2.CloseSessionRequest(request_id=self.rid("close"), episode=e),
            name="CloseSession",
            timeout_s=self.episode_bound_s,
        )
        self._left.sessions = [s for s in self._left.sessions if s != e]
        return response

    async def generate(
        self, e: types_pb2.EpisodeId, *, timeout_s: float | None = None
    ) -> list[policy_service_pb2.GenerateResponse]:
        """Generate for ``e`` with the workload's prompt; the chunks, or Refused."""
        call = self.target.policy.Generate(
            policy_service_pb2.GenerateRequest(
                request_id=self.rid("generate"),
                episode=e,
                prompt_token_ids=list(self.workload.prompt_token_ids),
                max_new_tokens=self.workload.max_new_tokens,
            ),
            timeout=self.episode_bound_s if timeout_s is None else timeout_s,
            metadata=self.target.metadata,
        )
        try:
            return [chunk async for chunk in call]
        except grpc.aio.AioRpcError as error:
            raise Refused(wire_error("Generate", error)) from None

    def need_task(self) -> Mapping[str, Any]:
        if self.workload.task is None:
            raise CheckSkipped(
                "no workload task (--workload FILE): the kit cannot invent a task this "
                "environment understands"
            )
        return self.workload.task

    # ------------------------------------------------------------------ between checks

    async def settle(self) -> list[str]:
        """Leave the target idle and clean whatever a check left; what had to be done.

        Runs after every check, passed or failed, so that one failure does not cascade
        into the next check.
        """
        done: list[str] = []
        left = self._left
        for stream in left.runs:
            if not stream.done:
                await stream.cancel()
                done.append(f"cancelled the Run of {show(stream.episode)}")
        try:
            status = await self.status()
        except (Refused, CheckFailed) as error:
            return [*done, f"GetStatus failed while settling: {error}"]
        active = status.active_checkpoint_id
        if status.phase != types_pb2.PHASE_IDLE and active in left.checkpoints:
            with contextlib.suppress(Refused):
                await self.resume(active)
                done.append(f"resumed {active}")
        if left.receipts and self.hosts_agent:
            owed = list(left.receipts)
            with contextlib.suppress(Refused):
                await self.acknowledge(owed)
                done.append(f"acknowledged {len(owed)} receipt(s)")
        unfinished = [s.episode for s in left.runs if s.result is None]
        if unfinished:
            with contextlib.suppress(Refused):
                await self.retire(unfinished)
                done.append(f"retired {len(unfinished)} unfinished episode(s)")
        for session in list(left.sessions):
            with contextlib.suppress(Refused):
                await self.close_session(session)
        if left.retired:
            with contextlib.suppress(Refused):
                await self.forget(sorted(left.retired))
        self._left = _Leftovers(checkpoints=left.checkpoints)
        return done
