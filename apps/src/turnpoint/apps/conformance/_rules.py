"""The protocol rules the checks judge answers by, as functions without I/O.

Each takes what came over the wire and returns the problems found (an empty list when
the answer conforms), so a check reads as "call, then judge" and the judgements can be
tested without a server.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

import grpc

from turnpoint.errors import REASON_CODES, Reason
from turnpoint.v1 import types_pb2

from ._wire import WireError

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")

# docs/spec.md section 4.1 item 5. A request in flight may also be a REPLAY verify,
# which never blocks; the counts therefore bound the blocker count from both sides.
BLOCKING_STATES = frozenset(
    {
        types_pb2.EPISODE_STATE_RUNNING,
        types_pb2.EPISODE_STATE_COMPLETED_UNACKED,
        types_pb2.EPISODE_STATE_RETIRING,
        types_pb2.EPISODE_STATE_REQUEST_IN_FLIGHT,
    }
)
_SURELY_BLOCKING = BLOCKING_STATES - {types_pb2.EPISODE_STATE_REQUEST_IN_FLIGHT}


def phase_name(value: int) -> str:
    try:
        return types_pb2.Phase.Name(value).removeprefix("PHASE_")  # type: ignore[arg-type]
    except ValueError:
        return f"unknown phase {value}"


def state_name(value: int) -> str:
    try:
        return types_pb2.EpisodeState.Name(value).removeprefix("EPISODE_STATE_")  # type: ignore[arg-type]
    except ValueError:
        return f"unknown state {value}"


def error_problems(
    error: WireError, reason: str | Collection[str], keys: Sequence[str] = ()
) -> list[str]:
    """How a refusal breaks docs/spec.md section 9.1 / 9.3 / 9.5 for the expected reason."""
    expected = {reason} if isinstance(reason, str) else set(reason)
    problems: list[str] = []
    if error.problem:
        problems.append(error.problem)
    turnpoint_infos = [info for info in error.infos if info.domain == "turnpoint"]
    if len(error.infos) != 1 or len(turnpoint_infos) != 1:
        problems.append(
            f"{error.code.name} carried {len(error.infos)} ErrorInfo "
            f"({len(turnpoint_infos)} of domain turnpoint), expected exactly one "
            f"[{error.message[:80]!r}]"
        )
        return problems
    got = turnpoint_infos[0].reason
    if got not in expected:
        problems.append(f"reason {got}, expected {' or '.join(sorted(expected))}")
        return problems
    if got not in Reason.__members__:
        problems.append(f"unknown reason {got}")
        return problems
    code_name = REASON_CODES[Reason[got]]
    if error.code is not grpc.StatusCode[code_name]:
        problems.append(f"reason {got} travelled as {error.code.name}, the table says {code_name}")
    missing = [key for key in keys if key not in turnpoint_infos[0].metadata]
    if missing:
        problems.append(f"{got} lacks metadata {', '.join(missing)}")
    return problems


def readiness_problems(
    report: types_pb2.ReadinessReport, phase: int | None = None, cap: int | None = None
) -> list[str]:
    """How a readiness report (and the phase that came with it) breaks section 4.1."""
    problems: list[str] = []
    if report.ready != (report.blocker_count == 0):
        problems.append(f"ready={report.ready} with blocker_count={report.blocker_count}")
    if phase in (types_pb2.PHASE_PREPARED, types_pb2.PHASE_PREPARING) and (
        (phase == types_pb2.PHASE_PREPARED) != report.ready
    ):
        problems.append(f"phase {phase_name(phase)} with ready={report.ready}")
    if len(report.blockers) > report.blocker_count:
        problems.append(f"{len(report.blockers)} blockers listed, count {report.blocker_count}")
    if cap is not None and len(report.blockers) > cap:
        problems.append(f"{len(report.blockers)} blockers listed, above the cap {cap}")
    for blocker in report.blockers:
        if blocker.state not in BLOCKING_STATES:
            problems.append(f"blocker in non-blocking state {state_name(blocker.state)}")
        if blocker.state == types_pb2.EPISODE_STATE_COMPLETED_UNACKED and not (
            blocker.HasField("receipt") and blocker.receipt.receipt_id
        ):
            problems.append("a COMPLETED_UNACKED blocker without its receipt")
    names = [state_name(count.state) for count in report.counts]
    if names != sorted(names):
        problems.append(f"counts not sorted by state name: {names}")
    if any(count.count == 0 for count in report.counts):
        problems.append("counts list a state with zero entries")
    surely = sum(c.count for c in report.counts if c.state in _SURELY_BLOCKING)
    maybe = sum(c.count for c in report.counts if c.state in BLOCKING_STATES)
    if not surely <= report.blocker_count <= maybe:
        problems.append(
            f"blocker_count {report.blocker_count} disagrees with the counts by state "
            f"(between {surely} and {maybe})"
        )
    restarts = [(e.rollout_id.encode(), e.attempt) for e in report.restarts]
    if restarts != sorted(set(restarts)):
        problems.append("restarts not sorted and unique")
    return problems
