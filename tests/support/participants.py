"""Real example participants on 127.0.0.1:0, in-process, for integration tests.

``start_topology`` hosts a policy server, the two resources servers (per-sibling and
group-scored) and N agent servers, each a real gRPC server with token auth, exactly as
``turnpoint serve`` would, and hands back their addresses and runtimes.
``ControlDoor`` sends control requests through either door (unary or ControlSession)
and returns the response or raises the TurnpointError it carried, so one test can
check a behaviour through both.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from turnpoint._status import control_error_to_error, error_from_rpc
from turnpoint.apps.examples._build import ExampleSpec, build_example
from turnpoint.auth import auth_metadata
from turnpoint.convert import duration_from_seconds
from turnpoint.participant_sdk import ParticipantRuntime
from turnpoint.server import HostedParticipant, ServerOptions, host_participant
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import checkpoint_control_service_pb2_grpc as pb_grpc
from turnpoint.v1 import types_pb2

TOKEN = "test-token-123"
METADATA = auth_metadata(TOKEN)
FENCE = types_pb2.Fence(coordinator_id="coord", epoch=1)

_OPERATION_OF = {
    pb.DescribeRequest: ("describe", "Describe"),
    pb.PrepareRequest: ("prepare", "Prepare"),
    pb.RenewRequest: ("renew", "Renew"),
    pb.CommitRequest: ("commit", "Commit"),
    pb.ResumeRequest: ("resume", "Resume"),
    pb.RestoreRequest: ("restore", "Restore"),
    pb.RestoreRunningRequest: ("restore_running", "RestoreRunning"),
    pb.RetireRequest: ("retire", "Retire"),
    pb.ForgetRequest: ("forget", "Forget"),
    pb.GetStatusRequest: ("get_status", "GetStatus"),
}
_ids = itertools.count(1)


def request_id(prefix: str = "rq") -> str:
    return f"{prefix}-{next(_ids)}"


class UntypedControlError(Exception):
    """A ControlSession answer that failed without a protocol reason (a crashed hook)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = next(
            (c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN
        )
        self.message = message


class ControlDoor:
    """Control requests through the unary calls or the ControlSession stream."""

    def __init__(self, address: str, door: str, *, token: str | None = TOKEN) -> None:
        assert door in ("unary", "session")
        self.door = door
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.CheckpointControlServiceStub(self._channel)
        self._metadata = auth_metadata(token) if token else ()
        self._session: Any = None
        self._pending: dict[str, asyncio.Future[pb.ControlSessionResponse]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._broken: grpc.aio.AioRpcError | None = None
        self._answered = False

    async def call(self, request: Any, timeout_s: float = 10.0) -> Any:
        operation, _method = _OPERATION_OF[type(request)]
        if self.door == "unary":
            return await self._unary(request, timeout_s)
        return await self._session_call(operation, request, timeout_s)

    async def _unary(self, request: Any, timeout_s: float) -> Any:
        _operation, method = _OPERATION_OF[type(request)]
        try:
            return await getattr(self._stub, method)(
                request, timeout=timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as error:
            carried = error_from_rpc(error)
            if carried is not None:
                raise carried from None
            raise

    async def _session_call(self, operation: str, request: Any, timeout_s: float) -> Any:
        if self._session is None:
            self._session = self._stub.ControlSession(None, metadata=self._metadata)
            self._reader = asyncio.create_task(self._read())
        if self._broken is not None:
            carried = error_from_rpc(self._broken)
            raise carried if carried is not None else self._broken
        rid = getattr(request, "request_id", "") or request_id("s")
        future: asyncio.Future[pb.ControlSessionResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[rid] = future
        message = pb.ControlSessionRequest(request_id=rid, timeout=duration_from_seconds(timeout_s))
        getattr(message, operation).CopyFrom(request)
        try:
            try:
                await self._session.write(message)
            except asyncio.InvalidStateError:
                # The participant ended the session before this write (it refused it: a
                # bad token): the reader holds the stream's status, its verdict.
                assert self._reader is not None
                await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
                if self._broken is None:
                    raise
                raise self._broken from None
            except grpc.aio.AioRpcError as error:
                if (
                    not self._answered
                    and error.code() is grpc.StatusCode.INTERNAL
                    and error_from_rpc(error) is None
                ):
                    # A write that races the session's refusal makes gRPC end the call
                    # INTERNAL, and the participant's verdict is lost (seen 4 times in 300
                    # tries). As the coordinator does with a session that failed before
                    # any answer (trainer/control/client.py), ask on the unary door.
                    return await self._unary(request, timeout_s)
                raise
            response = await asyncio.wait_for(future, timeout_s + 5)
        except grpc.aio.AioRpcError as error:
            # The participant refused the session itself (a bad token): its verdict.
            carried = error_from_rpc(error)
            if carried is not None:
                raise carried from None
            raise
        finally:
            self._pending.pop(rid, None)
        kind = response.WhichOneof("result")
        if kind == "error":
            carried = control_error_to_error(response.error)
            if carried is None:
                raise UntypedControlError(response.error.code, response.error.message)
            raise carried
        assert kind is not None
        return getattr(response, kind)

    async def _read(self) -> None:
        try:
            async for response in self._session:
                self._answered = True
                future = self._pending.pop(response.request_id, None)
                if future is not None and not future.done():
                    future.set_result(response)
        except grpc.aio.AioRpcError as error:
            self._broken = error
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(error)

    async def close(self) -> None:
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.done_writing()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._channel.close(None)


@dataclass
class Topology:
    root: Path | str
    policy: HostedParticipant
    tools: HostedParticipant
    group_tools: HostedParticipant
    agents: list[HostedParticipant] = field(default_factory=list)

    @property
    def participants(self) -> dict[str, HostedParticipant]:
        hosted = [self.tools, self.group_tools, self.policy, *self.agents]
        return {h.runtime.instance_name: h for h in hosted}

    def runtime(self, instance: str) -> ParticipantRuntime:
        return self.participants[instance].runtime


async def host_example(
    kind: str, example: str, spec: ExampleSpec, *, token: str | None = TOKEN
) -> HostedParticipant:
    runtime, closers = build_example(kind, example, spec)
    hosted = host_participant(runtime, ServerOptions(port=0, token=token))
    hosted.on_close.extend(closers)
    return await hosted.start()


@contextlib.asynccontextmanager
async def start_topology(
    root: Path | str,
    *,
    agents: int = 1,
    group_size: int = 2,
    lease_s: float = 60.0,
    faults: dict[str, str] | None = None,
    verifier_log_dir: Path | None = None,
    restore_running: bool = True,
) -> AsyncIterator[Topology]:
    """Policy, per-sibling tools, group-scored tools and ``agents`` agent servers;
    ``root`` is their snapshot store's directory or storage URL. ``restore_running``
    off: none serves RestoreRunning, as before docs/spec.md section 4.16."""
    faults = faults or {}
    started: list[HostedParticipant] = []

    def spec(instance: str, **extra: Any) -> ExampleSpec:
        log = verifier_log_dir / f"{instance}.jsonl" if verifier_log_dir else None
        return ExampleSpec(
            instance=instance,
            root=root,
            token=TOKEN,
            group_size=group_size,
            lease_s=lease_s,
            faults=faults.get(instance, ""),
            verifier_log=log,
            restore_running=restore_running,
            **extra,
        )

    try:
        policy = await host_example("model", "tiny-policy", spec("policy"))
        started.append(policy)
        tools = await host_example("resources", "guess", spec("tools"))
        started.append(tools)
        group_tools = await host_example("resources", "guess-group", spec("group-tools"))
        started.append(group_tools)
        topology = Topology(root, policy, tools, group_tools)
        for index in range(agents):
            agent = await host_example(
                "agent",
                "guess",
                spec(
                    f"agent-{index}",
                    policy_address=policy.address,
                    resources={"guess": tools.address, "guess-group": group_tools.address},
                ),
            )
            started.append(agent)
            topology.agents.append(agent)
        yield topology
    finally:
        for hosted in reversed(started):
            await hosted.stop(0)


def guess_agent_command(
    instance: str,
    root: Path,
    *,
    group_size: int,
    policy: str,
    tools: str,
    group_tools: str,
    own_port: bool = True,
) -> list[str]:
    """``turnpoint serve`` of the guess example's agent as a process of its own, reaching
    the given policy and resources servers. ``own_port=False``: no host and port (a
    worker group's slot gives them)."""
    where = ["--host", "127.0.0.1", "--port", "0"] if own_port else []
    return [
        *(sys.executable, "-m", "turnpoint.apps._cli", "serve"),
        *("--kind", "agent", "--example", "guess", "--instance", instance),
        *where,
        *("--root", str(root), "--group-size", str(group_size), "--policy", policy),
        *("--resources", f"guess={tools}", "--resources", f"guess-group={group_tools}"),
    ]
