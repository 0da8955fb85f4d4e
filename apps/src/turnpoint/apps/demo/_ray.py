"""The demo on Ray (``turnpoint demo --ray``): every participant is a Ray actor.

Built on :mod:`turnpoint.server.ray`: each participant is one
:class:`~turnpoint.server.ray.ParticipantActor` that builds its example participant
(:class:`DemoBuild`) and serves it on its node's address with an OS-picked port. The
supervisor finds the endpoints through the actors, writes the same ``topology.json`` as
for processes and runs the trainer as a process of its own, exactly as without Ray. The
injected crash is ``ray.kill`` of one agent actor plus a SIGKILL of the trainer; the job
restart stops the surviving actors (graceful drain) and creates new ones under the same
instance names, spread over the nodes alive at that moment.

Where the actors run. ``ray.init()`` starts a local Ray instance sized for a small box;
``--ray-address`` joins an existing cluster; ``--ray-nodes N`` starts a cluster of a head
and N-1 more nodes on this machine (:class:`~turnpoint.server.ray.LocalCluster`), each
node offering the custom resource ``turnpoint_participant`` (:data:`NODE_SLOTS` of it).
Each actor reserves one slot and no CPU (they mostly wait on sockets); the actors are
spread one node after the other over the nodes that offer slots, the head last.

``--lose-node`` (with ``--ray-nodes``): the injected fault is the loss of a whole node
instead: the node hosting an agent (not the head) is removed from the cluster, and every
participant on it dies with it. Only those are replaced, each on a node alive at that
moment, and the trainer heals each in place (docs/spec.md sections 7.12 and 7.15): it
asks the supervisor, whose table this launcher's actors are in, and the supervisor
starts the agent again here (:meth:`RayLauncher.start`, which never picks a removed
node). The job does not restart. The policy and resources servers then run on the head
node, which is never removed (``servers_on_head``): their addresses are wired into every
agent, so a lost one cannot be healed in place, and the loss would restart the job. A
heal that fails falls back to that job restart. Every start is logged to
``<out>/logs/ray-placement.jsonl`` (generation, instance, node, address; a replacement
is a generation of its own), so a reader (and the tests) can see where each one ran.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from turnpoint.apps.demo._report import DemoError
from turnpoint.apps.demo._supervisor import (
    START_TIMEOUT_S,
    DemoPaths,
    Participant,
    ParticipantSpec,
)
from turnpoint.apps.examples._build import ExampleSpec, build_example
from turnpoint.auth import load_token
from turnpoint.server import ServerOptions
from turnpoint.server.ray import (
    Built,
    FleetError,
    FleetOptions,
    LocalCluster,
    ParticipantGroup,
    Placement,
    RayParticipants,
    alive_nodes,
    connect,
)

NODE_RESOURCE: Final = "turnpoint_participant"
"""The custom resource a node of ``--ray-nodes`` offers and every participant reserves."""
NODE_SLOTS: Final = 8
_GRACE_S: Final = 10.0


@dataclass(frozen=True)
class DemoBuild:
    """Builds one example participant inside its actor (pickled to the actor's node).

    ``peer_token_file``: what the participant presents on its own calls out (an agent's
    to its policy and resources), the run's data-plane token, never the control one
    (docs/spec.md section 10.2)."""

    spec: ParticipantSpec
    snapshot_root: str
    peer_token_file: str

    async def __call__(self, instance: str) -> Built:
        spec = self.spec
        token = await asyncio.to_thread(load_token, self.peer_token_file)
        # The examples import torch: seconds of import that must not stall the loop.
        await asyncio.to_thread(importlib.import_module, "turnpoint.apps.examples._participants")
        example = ExampleSpec(
            instance=instance,
            root=self.snapshot_root,
            token=token,
            policy_address=spec.policy_address,
            resources=dict(spec.resources),
            group_size=spec.group_size if spec.group_size is not None else 4,
            verifier_log=spec.verifier_log,
            generation_log=spec.generation_log,
            seed=spec.seed if spec.seed is not None else 0,
            turn_delay_s=spec.turn_delay_s or 0.0,
            token_delay_s=spec.token_delay_s or 0.0,
            cut_generations=spec.cut_generations,
            hold_calls_until=spec.hold_calls_until,
            sandbox_root=spec.sandbox_root,
        )
        runtime, closers = build_example(spec.kind, spec.example, example)
        return runtime, closers


class RayParticipant:
    """A started participant actor, seen from the supervisor."""

    def __init__(self, spec: ParticipantSpec, actor: RayParticipants) -> None:
        self._spec = spec
        self._actor = actor

    @property
    def spec(self) -> ParticipantSpec:
        return self._spec

    @property
    def address(self) -> str:
        return self._actor.report.addresses[self._spec.instance]

    @property
    def openai_url(self) -> str | None:
        return None  # the opaque agents run in local processes only

    @property
    def node_id(self) -> str:
        return self._actor.report.node_id

    def exit_status(self) -> int | None:
        return self._actor.ended_status()

    async def kill(self) -> None:
        await self._actor.kill()

    async def stop(self, timeout_s: float) -> None:
        try:
            status = await self._actor.stop(_GRACE_S, timeout_s)
        except FleetError as error:
            raise DemoError(f"participant {self._spec.instance}: {error}") from None
        if status != 0:
            raise DemoError(
                f"participant {self._spec.instance} (a Ray actor) ended with status {status}: "
                f"{self._actor.last_error}"
            )

    async def stderr_tail(self) -> str:
        return self._actor.last_error


class RayLauncher:
    """Starts participants as Ray actors; construct it before the event loop runs.

    ``servers_on_head`` (a cluster of ``nodes`` only): the policy and resources servers
    go to the head node, the agents spread over every node, so that removing a node
    other than the head loses agents only (``--lose-node`` heals them in place)."""

    description = "Ray actors"

    def __init__(
        self,
        paths: DemoPaths,
        *,
        address: str | None = None,
        nodes: int | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        num_cpus: int | None = None,
        servers_on_head: bool = False,
    ) -> None:
        if servers_on_head and nodes is None:
            raise ValueError("servers_on_head needs a cluster the demo starts (nodes)")
        self._servers_on_head = servers_on_head
        self._paths = paths
        self._start_timeout_s = start_timeout_s
        self._cluster: LocalCluster | None = None
        resources: dict[str, float] = {}
        if nodes is not None:
            self._cluster = LocalCluster(nodes, resources={NODE_RESOURCE: NODE_SLOTS})
            self._cluster.connect()
            resources = {NODE_RESOURCE: 1}
        else:
            connect(address, num_cpus=num_cpus)
        self._placement = Placement(resources=resources)
        self._options = FleetOptions(
            # The actors check the coordinator's calls against the control token's
            # digest and never hold the token (docs/spec.md section 10.2 item 8).
            server=ServerOptions(
                grace_seconds=_GRACE_S,
                token_sha256=paths.token_digest_file.read_text(encoding="ascii").strip(),
            ),
            data_token_file=str(paths.data_token_file),
            start_timeout_s=start_timeout_s,
            # --storage s3: the store's endpoint and dummy credentials, as for processes.
            environment=paths.store.environment if paths.store is not None else {},
        )
        self._generation = 0
        self._turn = 0
        self._started: dict[str, RayParticipant] = {}
        # Nodes --lose-node removed: dead at once, though the cluster counts them alive
        # until their health checks fail.
        self._removed: set[str] = set()

    def _node_for(self, generation: int, avoid: set[str]) -> str:
        # One node after the other over the nodes alive when the job (re)starts, the head
        # last; every generation starts over from the first one.
        if generation != self._generation:
            self._generation, self._turn = generation, 0
        nodes = [
            n
            for n in alive_nodes(resources=self._placement.resources)
            if n not in avoid and n not in self._removed
        ]
        if not nodes:
            raise DemoError("no alive Ray node can host a participant")
        node = nodes[self._turn % len(nodes)]
        self._turn += 1
        return node

    def _head_node(self) -> str:
        assert self._cluster is not None
        workers = set(self._cluster.worker_node_ids())
        heads = [n for n in alive_nodes(resources=self._placement.resources) if n not in workers]
        if not heads:
            raise DemoError("the Ray head node cannot host a participant")
        return heads[0]

    async def start(self, spec: ParticipantSpec, generation: int) -> RayParticipant:
        group = ParticipantGroup(
            kind=spec.kind,
            instances=(spec.instance,),
            build=DemoBuild(spec, self._paths.snapshot_root, str(self._paths.data_token_file)),
            placement=self._placement,
        )
        failed: set[str] = set()
        while True:
            if self._servers_on_head and spec.kind != "agent":
                node = self._head_node()
            else:
                node = self._node_for(generation, failed)
            actor = RayParticipants.launch(group, group.instances, self._options, node_id=node)
            try:
                await actor.start(self._start_timeout_s)
                break
            except FleetError as error:
                # Its node died a moment ago (and may still count as alive): try another.
                if not error.lost:
                    raise DemoError(f"participant {spec.instance}: {error}") from None
                failed.add(node)
        participant = RayParticipant(spec, actor)
        self._started[spec.instance] = participant
        await asyncio.to_thread(self._log_placement, generation, participant)
        return participant

    def _log_placement(self, generation: int, participant: RayParticipant) -> None:
        line = {
            "generation": generation,
            "instance": participant.spec.instance,
            "kind": participant.spec.kind,
            "node_id": participant.node_id,
            "address": participant.address,
        }
        with (self._paths.logs / "ray-placement.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")

    async def remove_node_of(self, candidates: Sequence[Participant]) -> dict[str, Any]:
        """``--lose-node``: remove the node of the first candidate that is not on the
        head node; returns the node and every participant that was on it."""
        if self._cluster is None:
            raise DemoError("--lose-node needs a cluster the demo started (--ray-nodes)")
        removable = set(self._cluster.worker_node_ids())
        for candidate in candidates:
            started = self._started.get(candidate.spec.instance)
            if started is not None and started.node_id in removable:
                node = started.node_id
                on_node = sorted(
                    name
                    for name, participant in self._started.items()
                    if participant.node_id == node and participant.exit_status() is None
                )
                # Not waiting for the cluster to count it dead: every process on it is
                # already, and the trainer must lose them mid-run, not after its end.
                await asyncio.to_thread(self._cluster.remove_node, node, wait=False)
                self._removed.add(node)
                return {"node_id": node, "instances": on_node}
        raise DemoError("no agent runs on a node that can be removed (only the head)")

    def shutdown(self) -> None:
        """Disconnect; a cluster this launcher started is stopped with it."""
        import ray

        if self._cluster is not None:
            self._cluster.shutdown()
        elif ray.is_initialized():
            ray.shutdown()
