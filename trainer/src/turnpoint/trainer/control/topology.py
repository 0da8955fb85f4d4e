"""The live participants as discovery found them (docs/spec.md sections 4.5 and 7.1).

:class:`ParticipantInfo` converts one ``DescribeResponse`` at the edge; :class:`Topology`
is the set of them the coordinator works with, and checks that a snapshot was taken with
the same participants.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Self

from turnpoint.ids import InvalidIdError, validate_id
from turnpoint.protocol import (
    PROTOCOL_VERSION,
    ParticipantKind,
    RecoveryLevel,
    RecoveryMode,
    VerifyMode,
)
from turnpoint.trainer.control.client import is_group_answer
from turnpoint.trainer.control.failures import MalformedReplyError
from turnpoint.trainer.snapshots.levels import EnvironmentMember
from turnpoint.trainer.storage.manifest import ManifestError, SnapshotManifest
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

AGENT_KINDS: Final = frozenset({ParticipantKind.AGENT, ParticipantKind.ENVIRONMENT})
"""The kinds rollouts are dispatched to."""


def _enum_from_proto(proto_enum: Any, number: int, sdk_enum: type[Any], prefix: str) -> Any:
    """The SDK member named like the proto value without its prefix; None if unset/unknown."""
    try:
        name: str = proto_enum.Name(number)
    except ValueError:
        return None
    if not name.startswith(prefix) or name.endswith("_UNSPECIFIED"):
        return None
    try:
        return sdk_enum[name.removeprefix(prefix)]
    except KeyError:
        return None


def group_workers(called: str, response: pb.DescribeResponse) -> dict[str, str] | None:
    """The workers (instance name -> own address) when ``response`` is a worker answering
    for its group ``called`` (docs/spec.md section 3.9), else None.

    Raises :class:`MalformedReplyError` for a roster that cannot be used: a worker name
    that is not a valid id, is the group's own name or appears twice, an empty address,
    or an answer from a worker the roster does not list."""
    if not is_group_answer(called, response):
        return None

    def bad(detail: str) -> MalformedReplyError:
        return MalformedReplyError(called, "Describe", detail)

    workers: dict[str, str] = {}
    for worker in response.workers:
        try:
            name = validate_id(worker.instance_name, "instance name")
        except InvalidIdError as error:
            raise bad(f"worker group lists an invalid worker: {error}") from None
        if name == called or name in workers:
            raise bad(f"worker group lists {name!r} twice or as the group itself")
        if not worker.address:
            raise bad(f"worker group gives {name!r} no address")
        workers[name] = worker.address
    answered = response.header.participant_id
    if answered != response.instance_name or answered not in workers:
        raise bad(f"worker {answered!r} answered for the group but is not one of its workers")
    return workers


@dataclass(frozen=True, slots=True)
class ParticipantInfo:
    """What one participant said about itself in ``Describe``."""

    instance: str
    kind: ParticipantKind
    incarnation: str
    protocol_version: str
    recovery_mode: RecoveryMode
    verify_mode: VerifyMode | None
    group_scored: bool
    group_size: int
    supported_levels: frozenset[RecoveryLevel]
    environment: str
    data_plane_address: str = ""
    # Serves RestoreRunning: restorable while it runs (docs/spec.md section 4.16).
    restore_running: bool = False

    @classmethod
    def from_proto(cls, instance: str, response: pb.DescribeResponse) -> Self:
        """Convert a ``DescribeResponse``; raise :class:`MalformedReplyError` if it breaks
        the contract (unknown kind, another protocol version)."""

        def bad(detail: str) -> MalformedReplyError:
            return MalformedReplyError(instance, "Describe", detail)

        kind = _enum_from_proto(
            types_pb2.ParticipantKind, response.kind, ParticipantKind, "PARTICIPANT_KIND_"
        )
        if kind is None:
            raise bad(f"unknown participant kind {response.kind}")
        if response.protocol_version != PROTOCOL_VERSION:
            raise bad(
                f"speaks {response.protocol_version!r}, this coordinator speaks {PROTOCOL_VERSION!r}"
            )
        # Unaudited servers are RESTART_ONLY (docs/spec.md section 4.5): unset means that.
        mode = _enum_from_proto(
            types_pb2.RecoveryMode, response.recovery_mode, RecoveryMode, "RECOVERY_MODE_"
        )
        levels = frozenset(
            RecoveryLevel[name]
            for value in response.supported_levels
            if (name := types_pb2.RecoveryLevel.Name(value).removeprefix("RECOVERY_LEVEL_"))
            in RecoveryLevel.__members__
        )
        return cls(
            instance=instance,
            kind=kind,
            incarnation=response.header.incarnation,
            protocol_version=response.protocol_version,
            recovery_mode=mode if mode is not None else RecoveryMode.RESTART_ONLY,
            verify_mode=_enum_from_proto(
                types_pb2.VerifyMode, response.verify_mode, VerifyMode, "VERIFY_MODE_"
            ),
            group_scored=response.group_scored,
            group_size=response.group_size,
            supported_levels=levels,
            environment=response.environment,
            data_plane_address=response.data_plane_address,
            restore_running=pb.CAPABILITY_RESTORE_RUNNING in response.capabilities,
        )

    @property
    def runs_episodes(self) -> bool:
        """Whether rollouts are dispatched to it (an agent or a combined environment)."""
        return self.kind in AGENT_KINDS

    def member(self) -> EnvironmentMember:
        return EnvironmentMember(
            instance=self.instance,
            kind=self.kind.value.lower(),
            recovery_mode=self.recovery_mode.value.lower(),
            supported_levels=self.supported_levels,
            group_scored=self.group_scored,
            group_size=self.group_size,
        )


@dataclass(frozen=True, slots=True)
class Topology:
    """The live participants, by instance name, as discovery found them."""

    participants: Mapping[str, ParticipantInfo]

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "participants", MappingProxyType(dict(sorted(self.participants.items())))
        )

    @property
    def instances(self) -> frozenset[str]:
        return frozenset(self.participants)

    def kind(self, instance: str) -> ParticipantKind:
        return self.participants[instance].kind

    def of_kind(self, *kinds: ParticipantKind) -> tuple[str, ...]:
        return tuple(sorted(name for name, info in self.participants.items() if info.kind in kinds))

    @property
    def agents(self) -> tuple[str, ...]:
        """Instances rollouts are dispatched to (agents and combined environments)."""
        return self.of_kind(*AGENT_KINDS)

    def environments(self) -> dict[str, tuple[EnvironmentMember, ...]]:
        """Each named environment's participants, for :func:`decide_levels`."""
        grouped: dict[str, list[EnvironmentMember]] = {}
        for info in self.participants.values():
            if info.environment:
                grouped.setdefault(info.environment, []).append(info.member())
        return {name: tuple(members) for name, members in sorted(grouped.items())}

    def rollout_problem(self, environment: str, instance: str) -> tuple[str, str] | None:
        """Why a rollout of ``environment`` on ``instance`` cannot run here, as (field,
        message naming the known ones), or None (docs/spec.md section 6.1 item 3): the
        instance must be an agent, and once any participant describes an environment,
        the rollout's must be one of those described."""
        agents = self.agents
        if instance not in agents:
            return "instance", (
                f"unknown agent instance {instance!r}; the agents are: "
                f"{', '.join(agents) or '(none)'}"
            )
        described = sorted(self.environments())
        if described and environment not in described:
            return "environment", (
                f"unknown environment {environment!r}; the participants describe: "
                f"{', '.join(described)}"
            )
        return None

    def shared_models(self) -> tuple[EnvironmentMember, ...]:
        """Policy models of no environment: any environment's agents may call them."""
        return tuple(
            info.member()
            for info in self.participants.values()
            if info.kind is ParticipantKind.MODEL and not info.environment
        )

    def check_manifest(self, manifest: SnapshotManifest) -> None:
        """Raise :class:`ManifestError` unless the snapshot was taken with these participants."""
        manifest.validate_topology(self.instances)
        for entry in manifest.participants:
            live = self.participants[entry.instance].kind
            if entry.kind is not live:
                raise ManifestError(
                    f"snapshot {manifest.checkpoint_id!r}: {entry.instance!r} was saved as "
                    f"{entry.kind.value} but is live as {live.value}",
                    checkpoint_id=manifest.checkpoint_id,
                    field="participants",
                )
