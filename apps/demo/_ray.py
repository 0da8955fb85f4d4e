"""The demo on Ray (``turnpoint demo --ray``): every participant is a Ray actor.

Each actor is an async actor (:class:`ParticipantActor`) that builds one example
participant with :func:`~turnpoint.server.build_example` and hosts it with
:func:`~turnpoint.server.host_participant` on 127.0.0.1 with an OS-picked port, inside
the actor's own event loop. The supervisor finds the endpoints through the actors
(``actor.address.remote()``), writes the same ``topology.json`` as for processes and runs
the trainer as a process of its own, exactly as without Ray. The injected crash is
``ray.kill`` of one agent actor plus a SIGKILL of the trainer; the job restart stops the
surviving actors (graceful drain) and creates new ones under the same instance names.

``ray.init()`` starts a local cluster sized for a small box (no dashboard, worker logs
kept out of the terminal); ``--ray-address`` joins an existing cluster instead. Actors
reserve no CPU (they mostly wait on sockets) and are pinned to the driver's node: they
listen on loopback, where the trainer, started next to the supervisor, can reach them.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from pathlib import Path
from typing import Any

from turnpoint.apps.demo._report import DemoError
from turnpoint.apps.demo._supervisor import (
    START_TIMEOUT_S,
    DemoPaths,
    ParticipantSpec,
)
from turnpoint.apps.examples._build import ExampleSpec, build_example
from turnpoint.auth import load_token
from turnpoint.server import HostedParticipant, ServerOptions, host_participant

__all__ = ["ParticipantActor", "RayLauncher", "RayParticipant"]

_KILLED_STATUS = -9
"""What :meth:`RayParticipant.exit_status` reports for an actor that died (as SIGKILL)."""


class ParticipantActor:
    """One example participant serving gRPC from inside a Ray actor's event loop."""

    def __init__(self) -> None:
        self._hosted: HostedParticipant | None = None

    async def start(self, spec: ParticipantSpec, snapshot_root: str, token_file: str) -> str:
        """Build and serve the participant; returns its ``host:port``."""
        token = await asyncio.to_thread(load_token, token_file)
        # The examples import torch: seconds of import that must not stall the loop.
        await asyncio.to_thread(importlib.import_module, "turnpoint.apps.examples._participants")
        example = ExampleSpec(
            instance=spec.instance,
            root=Path(snapshot_root),
            token=token,
            policy_address=spec.policy_address,
            resources=dict(spec.resources),
            group_size=spec.group_size if spec.group_size is not None else 4,
            verifier_log=spec.verifier_log,
            seed=spec.seed if spec.seed is not None else 0,
            turn_delay_s=spec.turn_delay_s or 0.0,
        )
        runtime, closers = build_example(spec.kind, spec.example, example)
        hosted = host_participant(runtime, ServerOptions(host="127.0.0.1", port=0, token=token))
        hosted.on_close.extend(closers)
        await hosted.start()
        self._hosted = hosted
        return hosted.address

    async def address(self) -> str:
        if self._hosted is None:
            raise RuntimeError("the participant has not started")
        return self._hosted.address

    async def serve_until_stopped(self) -> None:
        """Returns once the server drained and stopped; the supervisor watches this call."""
        if self._hosted is not None:
            await self._hosted.server.wait_for_termination()

    async def stop(self, grace_s: float) -> None:
        if self._hosted is not None:
            await self._hosted.stop(grace_s)


async def _resolve(ref: Any) -> Any:
    return await ref


class RayParticipant:
    """A started :class:`ParticipantActor`, seen from the supervisor."""

    def __init__(self, spec: ParticipantSpec, actor: Any, address: str) -> None:
        import ray

        self._ray = ray
        self._spec = spec
        self._actor = actor
        self._address = address
        self._last_error = ""
        self._served = asyncio.get_running_loop().create_task(
            self._watch(actor.serve_until_stopped.remote())
        )

    async def _watch(self, ref: Any) -> int:
        try:
            await ref
        except self._ray.exceptions.RayActorError as error:
            self._last_error = str(error)
            return _KILLED_STATUS
        except self._ray.exceptions.RayTaskError as error:
            self._last_error = str(error)
            return 1
        return 0

    @property
    def spec(self) -> ParticipantSpec:
        return self._spec

    @property
    def address(self) -> str:
        return self._address

    def exit_status(self) -> int | None:
        return self._served.result() if self._served.done() else None

    async def kill(self) -> None:
        self._ray.kill(self._actor, no_restart=True)
        await self._served

    async def stop(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(_resolve(self._actor.stop.remote(10.0)), timeout_s)
            status = await asyncio.wait_for(self._served, timeout_s)
        except TimeoutError:
            await self.kill()
            raise DemoError(
                f"participant {self._spec.instance} (a Ray actor) did not stop within "
                f"{timeout_s:g}s and was killed"
            ) from None
        except self._ray.exceptions.RayError as error:
            await self.kill()
            raise DemoError(
                f"participant {self._spec.instance} (a Ray actor) failed to stop: {error}"
            ) from None
        # Stopped cleanly; the actor's worker process is freed now.
        self._ray.kill(self._actor, no_restart=True)
        if status != 0:
            raise DemoError(
                f"participant {self._spec.instance} (a Ray actor) ended with status {status}: "
                f"{self._last_error}"
            )

    async def stderr_tail(self) -> str:
        return self._last_error


class RayLauncher:
    """Starts participants as Ray actors; construct it before the event loop runs."""

    description = "Ray actors"

    def __init__(
        self,
        paths: DemoPaths,
        *,
        address: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        num_cpus: int | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        self._paths = paths
        self._start_timeout_s = start_timeout_s
        # Nobody reads a usage-stats prompt in a demo.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
        if address is None:
            ray.init(
                num_cpus=num_cpus or os.cpu_count() or 2,
                include_dashboard=False,
                ignore_reinit_error=True,
                **quiet,
            )
        else:
            ray.init(address=address, **quiet)
        node = ray.get_runtime_context().get_node_id()
        self._actor_class: Any = ray.remote(num_cpus=0, max_restarts=0)(ParticipantActor).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        )

    async def start(self, spec: ParticipantSpec, generation: int) -> RayParticipant:
        actor: Any = self._actor_class.remote()
        try:
            await asyncio.wait_for(
                _resolve(
                    actor.start.remote(
                        spec, str(self._paths.snapshots), str(self._paths.token_file)
                    )
                ),
                self._start_timeout_s,
            )
            address = await asyncio.wait_for(
                _resolve(actor.address.remote()), self._start_timeout_s
            )
        except TimeoutError:
            self._ray.kill(actor, no_restart=True)
            raise DemoError(
                f"participant {spec.instance} did not start within {self._start_timeout_s:g}s "
                "(its Ray actor never answered)"
            ) from None
        except self._ray.exceptions.RayError as error:
            self._ray.kill(actor, no_restart=True)
            raise DemoError(
                f"participant {spec.instance} did not start within {self._start_timeout_s:g}s "
                f"(its Ray actor failed); it says:\n    {error}"
            ) from None
        return RayParticipant(spec, actor, str(address))

    def shutdown(self) -> None:
        """Disconnect; a cluster this launcher started is stopped with it."""
        if self._ray.is_initialized():
            self._ray.shutdown()
