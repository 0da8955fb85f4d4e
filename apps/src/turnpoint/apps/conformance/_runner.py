"""Run every check against one target, in an order that keeps the target usable.

The order matters: a restore needs a participant that never admitted data-plane work,
so every control check runs before the first episode; hostile input runs last, so that
whatever it does to the server cannot disturb another check. After each check the kit
settles the target (resumes what is open, acknowledges, retires and forgets what was
left), so one failure does not cascade into the next check.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from turnpoint.v1 import types_pb2

from ._control_checks import (
    check_control_session,
    check_describe,
    check_errors,
    check_fencing_epoch,
    check_fencing_replay,
    check_watch_boundaries,
)
from ._data_checks import check_acknowledge, check_admission, check_readiness, check_run_stream
from ._effects_checks import check_effects
from ._equivalence import check_equivalence, check_exported_sessions
from ._kit import CheckFailed, CheckSkipped, HttpFace, Kit, Workload
from ._lifecycle_checks import (
    check_commit,
    check_forget,
    check_lease,
    check_restore,
    check_restore_running,
    check_resume,
    check_retire,
)
from ._openai_checks import check_egress_relay, check_openai_endpoint
from ._report import CheckResult, ConformanceReport, Outcome
from ._sandbox_checks import check_sandboxes
from ._token_checks import check_token_cut
from ._transport_checks import (
    check_auth,
    check_credential_roles,
    check_health_reflection,
    check_hostile_input,
)
from ._wire import Refused, Target


@dataclass(frozen=True, slots=True)
class Check:
    """One named rule of the specification and the code that checks it."""

    name: str
    section: str
    run: Callable[[Kit], Awaitable[str]]


CHECKS: tuple[Check, ...] = (
    Check("describe", "4.5", check_describe),
    Check("health-reflection", "3.8", check_health_reflection),
    Check("auth", "10.1", check_auth),
    Check("credential-roles", "10.2", check_credential_roles),
    Check("control-session", "3.2", check_control_session),
    Check("errors", "9", check_errors),
    Check("fencing-epoch", "2.2", check_fencing_epoch),
    Check("fencing-replay", "2.2, 4.3", check_fencing_replay),
    Check("resume", "4.9", check_resume),
    Check("commit", "4.8", check_commit),
    Check("restore", "4.10", check_restore),
    Check("restore-running", "4.16", check_restore_running),
    Check("effects", "6.12", check_effects),
    Check("lease", "4.2", check_lease),
    Check("retire", "4.11", check_retire),
    Check("forget", "4.12", check_forget),
    Check("watch-boundaries", "4.14", check_watch_boundaries),
    Check("admission", "5.1-5.4", check_admission),
    Check("token-cut", "5.5", check_token_cut),
    Check("readiness", "4.1, 4.6", check_readiness),
    Check("run-stream", "6.1-6.6", check_run_stream),
    Check("acknowledge", "6.4", check_acknowledge),
    Check("exported-sessions", "5.3", check_exported_sessions),
    Check("equivalence", "5.6", check_equivalence),
    Check("sandboxes", "5.7", check_sandboxes),
    Check("openai-endpoint", "12.2-12.5", check_openai_endpoint),
    Check("egress-relay", "12.8", check_egress_relay),
    Check("hostile-input", "10.5", check_hostile_input),
)


@dataclass(frozen=True)
class ConformanceOptions:
    """How to reach the target and how the kit behaves."""

    target: str
    token: str | None = None
    workload: Workload = field(default_factory=Workload)
    lease_s: float = 1.0
    call_timeout_s: float = 10.0
    episode_timeout_s: float = 30.0
    only: Sequence[str] = ()
    # Freshly started processes of the target (same instance, same snapshot root), one
    # for each check that restores (effects, equivalence), and that root when the kit
    # may write a damaged copy of a snapshot into it.
    restore_targets: Sequence[str] = ()
    snapshot_root: Path | None = None
    # The target's data-plane token (docs/spec.md section 10.2): the credential-roles
    # check runs with it and is skipped without it.
    data_token: str | None = None
    # The target's HTTP faces (docs/spec.md section 12): the OpenAI endpoint in front of
    # a policy, the egress relay in front of a harness (with a harness's credential).
    openai_endpoint: HttpFace | None = None
    relay: HttpFace | None = None


Progress = Callable[[CheckResult], None]
# The checks that restore the target's sessions into a restore target, in the order the
# given targets go to them: the equivalence check (a restore at every turn boundary)
# first, then the effects check (one re-sent call).
RESTORING_CHECKS = ("equivalence", "effects")


async def run_conformance(
    options: ConformanceOptions, progress: Progress | None = None
) -> ConformanceReport:
    """Every check (or ``options.only``) against ``options.target``, in order."""
    unknown = sorted(set(options.only) - {c.name for c in CHECKS})
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {', '.join(c.name for c in CHECKS)}")
    target = Target(
        options.target,
        options.token,
        call_timeout_s=options.call_timeout_s,
        data_token=options.data_token,
    )
    restore_targets = [
        Kit(
            Target(address, options.token, call_timeout_s=options.call_timeout_s),
            workload=options.workload,
            lease_s=options.lease_s,
            episode_bound_s=options.episode_timeout_s,
        )
        for address in options.restore_targets
    ]
    restoring = [c for c in RESTORING_CHECKS if not options.only or c in options.only]
    kit = Kit(
        target,
        workload=options.workload,
        lease_s=options.lease_s,
        episode_bound_s=options.episode_timeout_s,
        restore_targets=dict(zip(restoring, restore_targets, strict=False)),
        snapshot_root=options.snapshot_root,
        openai_endpoint=options.openai_endpoint,
        relay=options.relay,
    )
    report = ConformanceReport(target=options.target, coordinator_id=kit.coordinator_id)
    try:
        discovery = await _discover(kit)
        report.instance, report.kind = kit.instance, _kind_name(kit)
        report.epoch = kit.epoch
        for check in CHECKS:
            if options.only and check.name not in options.only:
                continue
            started = time.monotonic()
            if discovery is not None and not report.results:
                # The first check to run carries the failure, so the run exits 1.
                outcome, detail = Outcome.FAIL, discovery
            elif discovery is not None:
                outcome, detail = Outcome.SKIP, f"cannot run: {discovery}"
            else:
                outcome, detail = await _run_one(kit, check)
            result = CheckResult(
                check.name, check.section, outcome, detail, time.monotonic() - started
            )
            report.results.append(result)
            if progress is not None:
                progress(result)
        report.epoch = kit.epoch
        if discovery is None:
            report.left_behind = _left_behind(kit)
    finally:
        await target.close()
        for fresh in restore_targets:
            await fresh.target.close()
    return report


async def _discover(kit: Kit) -> str | None:
    """Describe the target; why nothing can run when that fails."""
    try:
        await kit.discover()
    except Refused as refusal:
        hint = ""
        if refusal.error.code is grpc.StatusCode.UNAUTHENTICATED and kit.target.token is None:
            hint = " (the target needs a token: --token-file or $TURNPOINT_TOKEN)"
        return f"Describe failed: {refusal.error.summary()}{hint}"
    return None


async def _run_one(kit: Kit, check: Check) -> tuple[Outcome, str]:
    try:
        detail = await check.run(kit)
        outcome = Outcome.PASS
    except CheckFailed as failure:
        outcome, detail = Outcome.FAIL, str(failure)
    except CheckSkipped as skip:
        outcome, detail = Outcome.SKIP, str(skip)
    except Refused as refusal:
        outcome, detail = (
            Outcome.FAIL,
            f"unexpected refusal: {refusal.error.summary()} {refusal.error.message[:120]!r}",
        )
    except TimeoutError:
        outcome, detail = Outcome.FAIL, "a wait of the check timed out"
    try:
        cleaned = await kit.settle()
        for fresh in kit.used_restore_targets:
            if fresh.epoch:
                cleaned += [f"restore target: {done}" for done in await fresh.settle()]
    except (Refused, CheckFailed) as error:
        cleaned = [f"settling failed: {error}"]
    if cleaned and outcome is not Outcome.PASS:
        detail = f"{detail} [then: {'; '.join(cleaned)}]"
    return outcome, detail


def _kind_name(kit: Kit) -> str:
    try:
        return types_pb2.ParticipantKind.Name(kit.kind).removeprefix("PARTICIPANT_KIND_")  # type: ignore[arg-type]
    except ValueError:
        return f"unknown kind {kit.kind}"


def _left_behind(kit: Kit) -> list[str]:
    return [
        f"the fence of coordinator {kit.coordinator_id} at epoch {kit.epoch}: a coordinator "
        "must start above it (or restart the participant)",
        "finished checkpoint ids with prefix conf*: harmless to other prefixes",
        "with a workload, the participant is no longer fresh (it admitted the kit's "
        "episodes): restart it before it takes part in a restore, unless it lists "
        "CAPABILITY_RESTORE_RUNNING (a coordinator then restores it where it runs)",
        *sorted(set(kit.notes)),
        "one more lease expiry in GetStatus.lease_expiries",
    ]
