"""Participants as Ray actors on any node of a cluster (the ``ray`` extra).

Importing this module imports ray; ``import turnpoint.server`` does not import it.

A :class:`ParticipantFleet` launches :class:`ParticipantGroup` s: N replicas of one kind
of participant, each group with its own :class:`Placement` (CPUs and custom resources per
actor, spread over the nodes that offer them, or left to Ray's scheduler). Every actor is
a :class:`ParticipantActor`: it builds its participants with the group's picklable
``build`` callable and hosts each one's real gRPC server
(:func:`~turnpoint.server.host_participant`) on its node's address as Ray reports it,
port picked by the OS, and advertises ``host:port``. The coordinator never imports this
module: it takes :meth:`ParticipantFleet.endpoints`, a plain ``{instance: address}``
mapping, as it would take any other list of addresses.

Replacements. A participant is fresh in every actor process: a restore needs fresh
participants (docs/spec.md section 4.10). A group with ``max_restarts`` > 0 is restarted
by Ray after its process dies (the node still alive); :meth:`ParticipantFleet.refresh`
starts its participants again and returns the instances that came back, on new ports. A
node lost with its actors is a job restart (docs/spec.md section 7.12):
:meth:`ParticipantFleet.restart` stops every actor and launches fresh ones on the nodes
alive now; or, healing in place (section 7.15), the coordinator's launcher is the fleet
itself: :meth:`ParticipantFleet.replace` ends what is left of one participant's actor and
launches it again on a node alive now, the rest of the fleet untouched. A spread (or pinned) placement is a hard node affinity, so Ray never
restarts an actor of a lost node elsewhere behind the job's back.

:class:`LocalCluster` starts a head and more nodes on this machine
(``ray.cluster_utils.Cluster``), every address on loopback, for tests, the demo and the
bench; :func:`connect` joins a cluster.

Shared storage. Every node writes under the same snapshot root, so on real machines
that root is a shared filesystem (the same path on every node).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import ray
from ray._private import ray_constants
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from turnpoint.auth import load_token
from turnpoint.participant_sdk import ParticipantRuntime
from turnpoint.server._grpc_server import ServerOptions
from turnpoint.server._hosted_participant import HostedParticipant, host_participant

__all__ = [
    "ActorReport",
    "BuildParticipant",
    "Built",
    "FleetEndpoint",
    "FleetError",
    "FleetOptions",
    "LocalCluster",
    "ParticipantActor",
    "ParticipantFleet",
    "ParticipantGroup",
    "Placement",
    "RayParticipants",
    "alive_nodes",
    "connect",
]

_LOG = logging.getLogger(__name__)
# ray ships no complete stubs: its untyped calls go through this alias.
_RAY: Any = ray

Closer: TypeAlias = Callable[[], Awaitable[None]]
Built: TypeAlias = ParticipantRuntime | tuple[ParticipantRuntime, Sequence[Closer]]
"""What a build returns: the runtime, and optionally what to close after it stops."""
BuildParticipant: TypeAlias = Callable[[str], Built | Awaitable[Built]]
"""Builds the participant of one instance name inside its actor; must pickle (a module
level function, a ``functools.partial`` of one, or an instance of a module level class)."""

DEFAULT_START_TIMEOUT_S: Final = 120.0
DEFAULT_STOP_TIMEOUT_S: Final = 30.0
_LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1"})
_MIB: Final = 1024 * 1024
_RESTARTING_POLL_S: Final = 0.2
# A local cluster notices a removed node in about eight seconds instead of Ray's default
# twenty. A health check fails fast only when nothing listens at the raylet's port: a
# killed node, or a raylet that registered but has not opened its server yet, which on
# two busy cores took over five seconds in CI and got a live node declared dead. So the
# first check waits long enough for any start-up, and after it eight refused checks in
# a row are needed; a live raylet answers each within Ray's ten second timeout.
_HEALTH_CHECKS: Final = {
    "health_check_initial_delay_ms": 15_000,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 8,
}


class FleetError(RuntimeError):
    """A participant actor that did not start, stop or come back in time.

    ``lost``: its process or node went away (not its participants' own failure), so the
    same start may succeed on another node."""

    def __init__(self, message: str, *, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost


# ---------------------------------------------------------------------- what to launch


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the actors of a group run and what each one reserves.

    ``resources`` are custom resources per actor (``{"gpu_box": 1}``): only nodes that
    offer them are used, and their amounts bound how many actors a node takes.
    ``spread`` places the group's actors one node after the other over those nodes (a
    hard node affinity, chosen when the actor is launched); False leaves the choice to
    Ray's scheduler. ``node_id`` pins every actor of the group to that node.
    """

    num_cpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    spread: bool = True
    node_id: str | None = None

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or any(amount < 0 for amount in self.resources.values()):
            raise ValueError("a placement reserves no negative amount")


@dataclass(frozen=True, kw_only=True)
class ParticipantGroup:
    """One kind of participant: its instances, how to build one, where they run.

    ``kind`` is what the coordinator's topology calls it (``agent``, ``resources``,
    ``model``). ``per_actor`` participants share one actor process (lightweight ones:
    each still has its own server and port); ``max_restarts`` is Ray's, per actor.
    """

    kind: str
    instances: tuple[str, ...]
    build: BuildParticipant
    placement: Placement = field(default_factory=Placement)
    per_actor: int = 1
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if not self.instances:
            raise ValueError("a group has at least one instance")
        if len(set(self.instances)) != len(self.instances):
            raise ValueError(f"instance names repeat in group {self.kind!r}")
        if self.per_actor < 1 or self.max_restarts < 0:
            raise ValueError("per_actor must be >= 1 and max_restarts >= 0")

    @classmethod
    def replicas(
        cls, name: str, count: int, *, kind: str, build: BuildParticipant, **options: Any
    ) -> ParticipantGroup:
        """``count`` instances named ``name-0`` .. ``name-{count-1}``."""
        return cls(
            kind=kind,
            instances=tuple(f"{name}-{index}" for index in range(count)),
            build=build,
            **options,
        )

    def actor_instances(self) -> list[tuple[str, ...]]:
        """The instances of each actor: consecutive chunks of ``per_actor``."""
        return [
            self.instances[start : start + self.per_actor]
            for start in range(0, len(self.instances), self.per_actor)
        ]


@dataclass(frozen=True, kw_only=True)
class FleetOptions:
    """How every actor serves: ``server`` is the template of each participant's server
    (its host and port are replaced by the node's address and an OS-picked port).

    The token: ``server.token`` travels to the actors through Ray; ``token_file`` is read
    on each actor's node instead (the same path everywhere), so the token never leaves
    the file system. With neither, ``$TURNPOINT_TOKEN`` of the actor's process. The
    data-plane token (docs/spec.md section 10.2) likewise: ``server.data_token``, else
    ``data_token_file`` read on the actor's node, else none (the token serves both roles).

    ``environment``: variables every actor's process gets (Ray's ``runtime_env``), for
    what a node does not have of its own: the snapshot store's endpoint, for one
    (docs/spec.md section 8.12). Credentials a node holds already (an instance role, a
    config file) are better left there than sent through the cluster.
    """

    server: ServerOptions = field(default_factory=ServerOptions)
    token_file: str | None = None
    data_token_file: str | None = None
    environment: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S


@dataclass(frozen=True)
class ActorReport:
    """What a started actor says: where it runs and the address of each participant."""

    node_id: str
    host: str
    actor_incarnation: str
    addresses: Mapping[str, str]
    pid: int


@dataclass(frozen=True)
class FleetEndpoint:
    """One participant as the coordinator's topology needs it, and where it runs."""

    instance: str
    kind: str
    address: str
    node_id: str


# ---------------------------------------------------------------------- the actor


class ParticipantActor:
    """Hosts some participants' gRPC servers inside a Ray actor's event loop.

    Ray runs ``__init__`` again in a new process after a restart, so every start of the
    actor process builds fresh participants (a new ``actor_incarnation``).
    """

    def __init__(
        self, instances: Sequence[str], build: BuildParticipant, options: FleetOptions
    ) -> None:
        self._instances = tuple(instances)
        self._build = build
        self._options = options
        self._incarnation = secrets.token_hex(8)
        self._hosted: dict[str, HostedParticipant] = {}
        self._report: ActorReport | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> ActorReport:
        """Build and serve every participant (once per process); returns where they are."""
        async with self._lock:
            if self._report is None:
                self._report = await self._start()
            return self._report

    async def _start(self) -> ActorReport:
        if len(self._instances) > 1:
            # Each participant would own a process and its thread pool; here several
            # share a loop, so their commits' fsyncs must not queue in a pool of a few.
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(len(self._instances) + 4, thread_name_prefix="turnpoint")
            )
        host: str = _RAY.util.get_node_ip_address()
        node_id = ray.get_runtime_context().get_node_id()
        template = self._options.server
        token = template.token
        if token is None and template.token_sha256 is None:
            # Given the control token's digest, the actor never reads the token.
            token = await asyncio.to_thread(load_token, self._options.token_file)
        data_token = template.data_token
        if data_token is None and self._options.data_token_file is not None:
            data_token = await asyncio.to_thread(load_token, self._options.data_token_file)
        server = dataclasses.replace(
            template, host=host, port=0, token=token, data_token=data_token
        )
        try:
            for instance in self._instances:
                built = self._build(instance)
                if inspect.isawaitable(built):
                    built = await built
                runtime, closers = built if isinstance(built, tuple) else (built, ())
                hosted = host_participant(runtime, server)
                hosted.on_close.extend(closers)
                await hosted.start()
                self._hosted[instance] = hosted
        except BaseException:
            await self.stop(0.0)
            raise
        addresses = {name: hosted.address for name, hosted in self._hosted.items()}
        return ActorReport(node_id, host, self._incarnation, addresses, os.getpid())

    async def serve_until_stopped(self) -> None:
        """Returns once every server stopped; the driver watches this call."""
        await asyncio.gather(
            *(hosted.server.wait_for_termination() for hosted in self._hosted.values())
        )

    async def stop(self, grace_s: float) -> None:
        """Drain every server (``grace_s``), then close the runtimes."""
        hosted, self._hosted = list(self._hosted.values()), {}
        await asyncio.gather(*(item.stop(grace_s) for item in hosted))


# ---------------------------------------------------------------------- one actor, seen from the driver


@functools.cache
def _actor_class() -> Any:
    return ray.remote(ParticipantActor)


async def _resolve(ref: Any) -> Any:
    return await ref


class RayParticipants:
    """One launched :class:`ParticipantActor` and its participants, seen from the driver.

    A watch on its ``serve_until_stopped`` call notices when the actor ends: stopped
    (status 0), its process or node lost (``ended_status`` -9) or failed (1).
    """

    KILLED: Final = -9

    def __init__(
        self, group: ParticipantGroup, instances: tuple[str, ...], actor: Any, node_id: str | None
    ) -> None:
        self.group = group
        self.instances = instances
        self.planned_node = node_id
        self._actor = actor
        self._report: ActorReport | None = None
        self._watch: asyncio.Task[int] | None = None
        self.last_error = ""

    @classmethod
    def launch(
        cls,
        group: ParticipantGroup,
        instances: Sequence[str],
        options: FleetOptions,
        *,
        node_id: str | None,
        name: str | None = None,
    ) -> RayParticipants:
        """Create the actor (on ``node_id`` if given); :meth:`start` serves it."""
        placement = group.placement
        actor_options: dict[str, Any] = {
            "num_cpus": placement.num_cpus,
            "max_restarts": group.max_restarts,
            "max_concurrency": 1000,
        }
        if placement.resources:
            actor_options["resources"] = dict(placement.resources)
        if node_id is not None:
            actor_options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            )
        if name is not None:
            actor_options["name"] = name
        if options.environment:
            actor_options["runtime_env"] = {"env_vars": dict(options.environment)}
        actor = (
            _actor_class().options(**actor_options).remote(tuple(instances), group.build, options)
        )
        return cls(group, tuple(instances), actor, node_id)

    @property
    def report(self) -> ActorReport:
        if self._report is None:
            raise FleetError(f"participants {', '.join(self.instances)} have not started")
        return self._report

    def endpoints(self) -> list[FleetEndpoint]:
        report = self.report
        return [
            FleetEndpoint(name, self.group.kind, report.addresses[name], report.node_id)
            for name in self.instances
        ]

    async def start(self, timeout_s: float) -> ActorReport:
        """Serve (again, after a restart by Ray); bounded, and the actor is killed if it
        does not answer in time."""
        try:
            report = await asyncio.wait_for(self._call_start(), timeout_s)
        except TimeoutError:
            self.kill_now()
            raise FleetError(
                f"participants {', '.join(self.instances)} did not start within "
                f"{timeout_s:g}s (their Ray actor never answered)"
            ) from None
        except ray.exceptions.RayError as error:
            self.kill_now()
            lost = isinstance(error, ray.exceptions.RayActorError) and not error.actor_init_failed
            raise FleetError(
                f"participants {', '.join(self.instances)} did not start (their Ray actor "
                f"failed): {error}",
                lost=lost,
            ) from None
        assert isinstance(report, ActorReport)
        fresh = self._report is None or report.actor_incarnation != self._report.actor_incarnation
        self._report = report
        if fresh or self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(
                self._watch_serving(self._actor.serve_until_stopped.remote())
            )
        return report

    async def _call_start(self) -> Any:
        while True:
            try:
                return await self._actor.start.remote()
            except ray.exceptions.ActorUnavailableError:
                # Ray is restarting it: the call may or may not have run, and start is
                # idempotent, so ask again once it is back (bounded by the caller).
                await asyncio.sleep(_RESTARTING_POLL_S)

    async def _watch_serving(self, ref: Any) -> int:
        try:
            await ref
        except ray.exceptions.RayActorError as error:
            self.last_error = str(error)
            return self.KILLED
        except ray.exceptions.RayTaskError as error:
            self.last_error = str(error)
            return 1
        return 0

    def ended_status(self) -> int | None:
        """None while serving; 0 once stopped, negative if its process or node was lost."""
        if self._watch is None or not self._watch.done():
            return None
        return self._watch.result()

    async def wait_ended(self) -> int:
        assert self._watch is not None
        return await self._watch

    def kill_now(self) -> None:
        """``ray.kill``, as a crash would; Ray does not restart it."""
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(self._actor, no_restart=True)

    def crash(self) -> None:
        """Kill the actor's process and let Ray restart it (``max_restarts`` allowing)."""
        ray.kill(self._actor, no_restart=False)

    async def kill(self) -> None:
        self.kill_now()
        if self._watch is not None:
            await self._watch

    async def stop(self, grace_s: float, timeout_s: float) -> int:
        """Drain and end the actor; killed if that takes more than ``timeout_s``.
        Returns the status its watch saw (0: stopped cleanly)."""
        try:
            await asyncio.wait_for(_resolve(self._actor.stop.remote(grace_s)), timeout_s)
            status = await asyncio.wait_for(self.wait_ended(), timeout_s)
        except TimeoutError:
            await self.kill()
            raise FleetError(
                f"participants {', '.join(self.instances)} (a Ray actor) did not stop within "
                f"{timeout_s:g}s and were killed"
            ) from None
        except ray.exceptions.RayError as error:
            await self.kill()
            self.last_error = str(error)
            return self.KILLED
        # Stopped cleanly; free the actor's worker process now.
        self.kill_now()
        return status


# ---------------------------------------------------------------------- nodes


def alive_nodes(num_cpus: float = 0.0, resources: Mapping[str, float] | None = None) -> list[str]:
    """Ids of the alive nodes that offer ``num_cpus`` and ``resources`` (in total), the
    head node last (it is the cluster's, and losing it loses the cluster)."""
    wanted = dict(resources or {})
    if num_cpus:
        wanted["CPU"] = num_cpus
    found: list[tuple[bool, str]] = []
    for node in _RAY.nodes():
        if not node.get("Alive"):
            continue
        offered = node.get("Resources", {})
        if all(offered.get(key, 0.0) >= amount for key, amount in wanted.items()):
            head = "node:__internal_head__" in offered
            found.append((head, str(node["NodeID"])))
    return [node_id for _, node_id in sorted(found)]


class _Spreader:
    """Chooses the node of each actor that spreads: one node after the other over the
    nodes that fit its placement, alive at the time of the choice."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def node_for(self, placement: Placement) -> str | None:
        if placement.node_id is not None:
            return placement.node_id
        if not placement.spread:
            return None
        nodes = alive_nodes(placement.num_cpus, placement.resources)
        if not nodes:
            raise FleetError(
                f"no alive Ray node offers {placement.num_cpus:g} CPU and "
                f"{dict(placement.resources)}"
            )
        return nodes[next(self._turn) % len(nodes)]


# ---------------------------------------------------------------------- the fleet


class ParticipantFleet:
    """Every participant of a job, as Ray actors; ``async with`` starts and stops it."""

    def __init__(self, groups: Sequence[ParticipantGroup], options: FleetOptions) -> None:
        names = [name for group in groups for name in group.instances]
        if len(set(names)) != len(names):
            raise ValueError("an instance name appears in two groups")
        self._groups = tuple(groups)
        self._options = options
        self._actors: list[RayParticipants] = []
        self._stopping: set[str] = set()
        self._spreader = _Spreader()

    async def __aenter__(self) -> ParticipantFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def actors(self) -> tuple[RayParticipants, ...]:
        return tuple(self._actors)

    async def start(self) -> None:
        """Launch and serve every group; all or nothing."""
        spreader = self._spreader
        # Interleave the groups' actors, so that each kind spreads over the nodes too.
        planned = [
            (group, instances) for group in self._groups for instances in group.actor_instances()
        ]
        actors = [
            RayParticipants.launch(
                group, instances, self._options, node_id=spreader.node_for(group.placement)
            )
            for group, instances in planned
        ]
        self._actors = actors
        results = await asyncio.gather(
            *(actor.start(self._options.start_timeout_s) for actor in actors),
            return_exceptions=True,
        )
        failures = [result for result in results if isinstance(result, BaseException)]
        if failures:
            await self.kill()
            raise failures[0]

    def endpoints(self, kind: str | None = None) -> dict[str, str]:
        """``{instance: address}`` of every participant (of ``kind``): what the
        coordinator is given."""
        return {
            endpoint.instance: endpoint.address
            for endpoint in self.describe()
            if kind is None or endpoint.kind == kind
        }

    def describe(self) -> list[FleetEndpoint]:
        return [endpoint for actor in self._actors for endpoint in actor.endpoints()]

    def lost(self) -> list[str]:
        """Instances whose actor ended without being stopped (a crash, a lost node)."""
        return [
            name
            for actor in self._actors
            if actor.ended_status() not in (None, 0)
            for name in actor.instances
        ]

    async def refresh(self) -> list[str]:
        """Start again the actors Ray restarted; returns their instances, now fresh
        participants on new addresses. An actor that cannot come back raises
        :class:`FleetError` (its node is gone, or its restarts are spent)."""
        back: list[str] = []
        for actor in self._actors:
            if actor.ended_status() in (None, 0) or actor.group.max_restarts == 0:
                continue
            await actor.start(self._options.start_timeout_s)
            back.extend(actor.instances)
        return back

    async def replace(self, instance: str) -> str:
        """A launcher for healing in place (the trainer's ``Launcher``): end the actor
        serving ``instance``, whatever is left of it (a paused process must never come
        back beside its replacement), launch it again on its node if that is alive, else
        on another that fits its placement, and return the replacement's address once it serves.

        Only an actor of one participant is replaced: the others of a shared actor would
        come back fresh behind the coordinator's back, so :class:`FleetError` says so and
        the job restarts instead. Also :class:`FleetError` when no node fits or the
        replacement does not start.
        """
        index = next(
            (n for n, actor in enumerate(self._actors) if instance in actor.instances), None
        )
        if index is None:
            raise FleetError(f"no participant {instance} in this fleet")
        old = self._actors[index]
        if old.instances != (instance,):
            raise FleetError(
                f"participant {instance} shares its Ray actor with "
                f"{', '.join(n for n in old.instances if n != instance)}: replacing it alone "
                "is not possible (a job restart replaces them)"
            )
        await old.kill()
        group = old.group
        # Its own node while that lives (the fleet's spread stays as it was), else the next.
        placement = group.placement
        fits = alive_nodes(placement.num_cpus, placement.resources) if placement.spread else []
        node = old.planned_node if old.planned_node in fits else self._spreader.node_for(placement)
        new = RayParticipants.launch(group, old.instances, self._options, node_id=node)
        self._actors[index] = new
        await new.start(self._options.start_timeout_s)
        (endpoint,) = new.endpoints()
        return endpoint.address

    async def restart(self) -> None:
        """A job restart: end every actor, then launch the whole fleet fresh on the nodes
        alive now (docs/spec.md section 7.12)."""
        await self.kill()
        await self.start()

    async def kill(self) -> None:
        actors, self._actors = self._actors, []
        await asyncio.gather(*(actor.kill() for actor in actors))

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain every participant (agents first: they are clients of the others).

        Every actor is ended either way; then :class:`FleetError` names those that did
        not stop cleanly (killed after the timeout, or already lost)."""
        grace = self._options.server.grace_seconds if grace_s is None else grace_s
        actors, self._actors = self._actors, []
        failures: list[str] = []
        for wave in (
            [a for a in actors if a.group.kind == "agent"],
            [a for a in actors if a.group.kind != "agent"],
        ):
            results = await asyncio.gather(
                *(a.stop(grace, self._options.stop_timeout_s) for a in wave),
                return_exceptions=True,
            )
            for actor, result in zip(wave, results, strict=True):
                if isinstance(result, FleetError):
                    failures.append(str(result))
                elif isinstance(result, BaseException):
                    raise result
                elif result != 0:
                    failures.append(
                        f"participants {', '.join(actor.instances)} ended with status "
                        f"{result}: {actor.last_error}"
                    )
        if failures:
            raise FleetError("\n".join(failures))


# ---------------------------------------------------------------------- clusters


def _keep_loopback(address: str | None) -> None:
    """Ray rewrites a loopback cluster address to this machine's routable one (it
    assumes other nodes reach the head there). A cluster whose every node is on this
    machine's loopback must be joined at the loopback address itself."""
    host = (address or "").rpartition(":")[0] or address or ""
    if host in _LOOPBACK:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def _quiet() -> dict[str, Any]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return {"log_to_driver": False, "logging_level": logging.ERROR}


def connect(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Join the cluster at ``address``, or start a local Ray instance (no dashboard,
    worker logs kept out of the terminal). Call it before an event loop runs."""
    if address is None:
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 2,
            include_dashboard=False,
            ignore_reinit_error=True,
            **_quiet(),
        )
        return
    _keep_loopback(address)
    ray.init(address=address, **_quiet())


def _wait_node_dead(node_id: str, timeout_s: float = 60.0) -> None:
    """Block until the cluster counts ``node_id`` dead: a lost node's actors die at once,
    but the cluster learns of it only when the node's health checks fail."""
    deadline = time.monotonic() + timeout_s
    while node_id in alive_nodes():
        if time.monotonic() > deadline:
            raise FleetError(f"node {node_id} still counts as alive after {timeout_s:g}s")
        time.sleep(0.2)


def _descendants(root: int) -> list[int]:
    """Every process below ``root``, from ``/proc`` (a local cluster runs on Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                ppid = int(stat.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone since the listing
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    queue = [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


class LocalCluster:
    """A head and ``nodes - 1`` more Ray nodes on this machine, every one on loopback,
    each offering ``resources``; small on purpose (a CPU and an 80 MiB object store per
    node by default). Blocking: make it before an event loop runs, and
    :meth:`shutdown` it."""

    def __init__(
        self,
        nodes: int,
        *,
        num_cpus: int = 1,
        resources: Mapping[str, float] | None = None,
        object_store_mib: int = 80,
    ) -> None:
        from ray.cluster_utils import Cluster

        if nodes < 1:
            raise ValueError("a cluster has at least one node")
        _quiet()
        node_args: dict[str, Any] = {
            "num_cpus": num_cpus,
            "resources": dict(resources or {}),
            "object_store_memory": object_store_mib * _MIB,
            "node_ip_address": "127.0.0.1",
        }
        head_args = {**node_args, "include_dashboard": False, "_system_config": _HEALTH_CHECKS}
        cluster: Any = Cluster(initialize_head=True, head_node_args=head_args)
        self._cluster = cluster
        try:
            self._workers = [self._cluster.add_node(**node_args) for _ in range(nodes - 1)]
            self._cluster.wait_for_nodes()
        except BaseException:
            self._cluster.shutdown()
            raise

    @property
    def address(self) -> str:
        return str(self._cluster.address)

    def connect(self) -> None:
        """Make this process the cluster's driver."""
        connect(self.address)

    def remove_node(self, node_id: str, *, wait: bool = True, timeout_s: float = 60.0) -> None:
        """Take a node (not the head) away, as if its machine went down: its raylet and
        every process it started (the workers, and the actors' servers in them) are
        killed at once. With ``wait``, returns once the cluster counts the node dead
        (within ``timeout_s``); until then Ray may still place a new actor there."""
        for node in self._workers:
            if node.node_id == node_id:
                break
        else:
            raise ValueError(f"{node_id} is not a removable node of this cluster")
        # Ray's own removal kills the raylet alone; its workers notice a second or more
        # later, and serve every call in between, so a machine loss would not be one.
        (raylet,) = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]
        for pid in _descendants(raylet.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._cluster.remove_node(node, allow_graceful=False)
        self._workers.remove(node)
        if wait:
            _wait_node_dead(node_id, timeout_s)

    def worker_node_ids(self) -> list[str]:
        return [str(node.node_id) for node in self._workers]

    def shutdown(self) -> None:
        """Disconnect the driver and stop every node."""
        if ray.is_initialized():
            _RAY.shutdown()
        self._cluster.shutdown()
