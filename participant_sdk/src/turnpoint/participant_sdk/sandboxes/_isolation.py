"""How the local provider confines a sandbox's processes, and the report of what holds.

Three mechanisms, strongest first (docs/spec.md section 5.7.4):

- ``bwrap`` (Debian's ``bubblewrap``): new user, pid, network, ipc and uts namespaces;
  the sandbox's tree bound read-write at ``/sandbox`` (the working directory), the
  host's system directories read-only, a private ``/tmp``, nothing else of the host
  visible; killed with its parent.
- ``unshare`` (util-linux): new pid and network namespaces; the host's filesystem is
  *not* confined (the working directory is the sandbox's tree).
- ``none``: a plain process group in the sandbox's tree; nothing is confined.

Every mechanism runs under ``prlimit`` when it is present, so the kernel caps CPU
seconds, file size, address space and processes (the process cap does not bind uid 0,
and the report says so). :func:`probe` runs a real command to decide; it never guesses
from the presence of a binary alone.

Processes are restart-only (section 5.7.2 item 3). :func:`probe` also tries CRIU
(``criu check``) and the report says why no process snapshot is taken: CRIU missing, not
root, the kernel refusing it (Debian bookworm's criu 3.17 fails on the vDSO layout of
recent kernels), or, where it passes, that this provider version does not use it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Final

from ._errors import IsolationUnavailableError
from ._provider import Isolation, IsolationReport, Mount, ProcessRecovery, ResourceLimits

SANDBOX_MOUNT: Final = "/sandbox"
_SYSTEM_DIRS: Final = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
_PROBE_SECONDS: Final = 30


def probe(wanted: Isolation | None, scratch: Path) -> IsolationReport:
    """The strongest mechanism that works here (or ``wanted``, which must work:
    :class:`._errors.IsolationUnavailableError` otherwise).

    Blocking: runs a trivial command under each candidate in ``scratch``.
    """
    candidates = [wanted] if wanted is not None else list(Isolation)
    for mechanism in candidates:
        if mechanism is Isolation.NONE or _works(mechanism, scratch):
            return replace(
                _report(mechanism),
                processes=ProcessRecovery.RESTART_ONLY,
                processes_why=why_restart_only(),
            )
    assert wanted is not None  # NONE always works
    raise IsolationUnavailableError(wanted.value)


def why_restart_only() -> str:
    """Why a snapshot holds no process here, after trying CRIU (blocking)."""
    if shutil.which("criu") is None:
        return "criu is not installed"
    if os.geteuid() != 0:
        return "criu needs root"
    try:
        done = subprocess.run(
            ["criu", "check"], capture_output=True, text=True, timeout=_PROBE_SECONDS, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"criu check did not run: {type(error).__name__}"
    kernel = platform.release()
    if done.returncode == 0:
        return f"criu check passes on kernel {kernel}; provider version 1 takes no process snapshot"
    errors = [line for line in (done.stderr + done.stdout).splitlines() if "Error" in line]
    # "Error (criu/vdso.c:381): vdso: ..." -> "vdso: ...": the first cause, not the last.
    causes = [line.split("): ", 1)[-1] for line in errors if "exited, status" not in line]
    cause = causes[0] if causes else f"exit status {done.returncode}"
    return f"criu check fails on kernel {kernel}: {cause}"


def _works(mechanism: Isolation, scratch: Path) -> bool:
    report = _report(mechanism)
    argv = wrap(report, scratch, ["true"], ResourceLimits())
    if shutil.which(argv[0]) is None:
        return False
    try:
        done = subprocess.run(
            argv, cwd=scratch, capture_output=True, timeout=_PROBE_SECONDS, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _report(mechanism: Isolation) -> IsolationReport:
    limits: tuple[str, ...] = ()
    notes: list[str] = []
    if shutil.which("prlimit") is not None:
        limits = ("cpu_seconds", "file_bytes", "address_space_bytes")
        if os.geteuid() == 0:
            notes.append("the process cap does not bind uid 0, which the provider runs as")
        else:
            limits += ("processes",)
    else:
        notes.append("prlimit is missing: no resource cap is enforced")
    if mechanism is Isolation.BWRAP:
        return IsolationReport(mechanism, True, True, True, limits, tuple(notes))
    if mechanism is Isolation.UNSHARE:
        notes.append("the host filesystem is visible and writable: only pid and network are new")
        return IsolationReport(mechanism, True, False, True, limits, tuple(notes))
    notes.append("no namespace: the processes see and reach everything the provider does")
    return IsolationReport(mechanism, False, False, False, limits, tuple(notes))


def mounts(report: IsolationReport) -> tuple[Mount, ...]:
    """What a sandbox's processes see under ``report``: the snapshot's mount manifest."""
    if report.mechanism is Isolation.BWRAP:
        system = tuple(Mount(d, "ro", "host") for d in _SYSTEM_DIRS if os.path.isdir(d))
        return (Mount(SANDBOX_MOUNT, "rw", "sandbox"), *system, Mount("/tmp", "rw", "tmpfs"))
    return (Mount(".", "rw", "sandbox"), Mount("/", "rw", "host"))


def wrap(
    report: IsolationReport,
    tree: Path,
    argv: Sequence[str],
    limits: ResourceLimits,
    *,
    info_fd: int | None = None,
) -> list[str]:
    """The command line that runs ``argv`` confined to ``tree`` under ``report``.

    With ``info_fd`` (bwrap only), bwrap writes its sandbox's facts there as JSON, among
    them ``child-pid``: the init of the sandbox's pid namespace, whose death takes every
    process of the sandbox with it (:func:`namespace_init`)."""
    command = list(argv)
    if report.mechanism is Isolation.BWRAP:
        binds: list[str] = []
        for directory in _SYSTEM_DIRS:
            binds += ["--ro-bind-try", directory, directory]
        info = [] if info_fd is None else ["--info-fd", str(info_fd)]
        command = [
            "bwrap",
            *info,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            *binds,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "--bind",
            str(tree),
            SANDBOX_MOUNT,
            "--chdir",
            SANDBOX_MOUNT,
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            SANDBOX_MOUNT,
            "--",
            *command,
        ]
    elif report.mechanism is Isolation.UNSHARE:
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        command = ["unshare", *user, "--net", "--pid", "--fork", "--kill-child", "--", *command]
    if report.limits_enforced:
        command = [
            "prlimit",
            f"--cpu={limits.cpu_seconds}",
            f"--fsize={limits.file_bytes}",
            f"--as={limits.address_space_bytes}",
            f"--nproc={limits.processes}",
            *command,
        ]
    return command


def namespace_init(info: bytes) -> int | None:
    """The host pid of the sandbox's pid-namespace init from bwrap's ``--info-fd``
    output, or None when bwrap wrote none (it failed before making the sandbox)."""
    try:
        pid = json.loads(info)["child-pid"]
    except (ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) and pid > 0 else None
