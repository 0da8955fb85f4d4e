"""What a worker of a group knows about its group (docs/spec.md section 3.9): plain data.

Several worker processes share one endpoint; each is its own participant. A worker's
:class:`WorkerSlot` names its group, its own port, the shared port and every member of
the group, so that ``Describe`` on any worker lists them all. The parent
(:class:`~turnpoint.server._worker_group.WorkerGroup`) hands the slot to the worker in an
environment variable, as JSON; a restarted worker gets the very same slot, so its own
port, and the address the coordinator holds for it, stay valid.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Self

from turnpoint.ids import validate_id

WORKER_SLOT_ENV: Final = "TURNPOINT_WORKER_SLOT"
"""The environment variable carrying a worker's :class:`WorkerSlot` as JSON."""


def worker_name(group: str, index: int) -> str:
    """The instance name of worker ``index`` of ``group``: deterministic, so a job that
    restarts finds the same participants in its snapshot."""
    return validate_id(f"{group}-w{index}", "instance name")


@dataclass(frozen=True, slots=True)
class GroupMember:
    """One worker: its instance name and the address where it alone answers."""

    instance: str
    address: str


@dataclass(frozen=True, slots=True)
class GroupRoster:
    """A group's name and its workers, as ``Describe`` reports them."""

    group: str
    members: tuple[GroupMember, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSlot:
    """Everything one worker process needs to take its place in the group."""

    group: str
    index: int
    host: str
    shared_port: int
    own_port: int
    roster: GroupRoster
    parent_pid: int

    @property
    def instance(self) -> str:
        return self.roster.members[self.index].instance

    def to_json(self) -> str:
        return json.dumps(
            {
                "group": self.group,
                "index": self.index,
                "host": self.host,
                "shared_port": self.shared_port,
                "own_port": self.own_port,
                "members": [[m.instance, m.address] for m in self.roster.members],
                "parent_pid": self.parent_pid,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Self:
        """Parse a slot; raises ``ValueError`` on anything malformed."""
        try:
            data = json.loads(text)
            if not isinstance(data, Mapping):
                raise TypeError("not an object")
            group = validate_id(str(data["group"]), "group")
            members = tuple(
                GroupMember(validate_id(str(name), "instance name"), str(address))
                for name, address in data["members"]
            )
            slot = cls(
                group=group,
                index=int(data["index"]),
                host=str(data["host"]),
                shared_port=int(data["shared_port"]),
                own_port=int(data["own_port"]),
                roster=GroupRoster(group, members),
                parent_pid=int(data["parent_pid"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed ${WORKER_SLOT_ENV}: {error}") from error
        if not 0 <= slot.index < len(members):
            raise ValueError(f"malformed ${WORKER_SLOT_ENV}: index {slot.index} out of range")
        return slot
