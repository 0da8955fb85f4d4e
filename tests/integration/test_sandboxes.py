"""Real sandboxes under the local provider: generations, fencing, all-or-none restores.

docs/spec.md section 5.7. Every test runs its commands under bubblewrap: the provider is
opened with ``Isolation.BWRAP`` required, so a machine without it fails here rather than
quietly testing a weaker sandbox (``./dev setup`` installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from turnpoint.errors import Reason
from turnpoint.participant_sdk.sandboxes import (
    Capability,
    DuplicateRestoreError,
    Isolation,
    IsolationUnavailableError,
    LocalSandboxProvider,
    ProcessRecovery,
    ProviderStateError,
    Refusal,
    ResourceLimits,
    Sandbox,
    SandboxExistsError,
    SandboxFencedError,
    SandboxPathError,
    SnapshotExpiredError,
    SnapshotHandle,
    SnapshotNotFoundError,
    SnapshotRefusedError,
    StaleHandleError,
)

BOUND_S = 10.0
RUN_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def provider(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalSandboxProvider]:
    opened = await LocalSandboxProvider.open(
        tmp_path / "provider",
        isolation=Isolation.BWRAP,
        limits=ResourceLimits(output_bytes=4096, file_bytes=1 << 20),
        clock=clock,
    )
    yield opened
    await opened.close()


async def _sh(provider: LocalSandboxProvider, sandbox: Sandbox, script: str) -> bytes:
    result = await provider.exec(sandbox, ["sh", "-c", script], timeout_seconds=RUN_S)
    assert result.exit_code == 0, result
    return result.stdout


async def _eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll an async condition nothing notifies about (a file a process writes), bounded."""
    async with asyncio.timeout(BOUND_S):
        while not await check():  # noqa: ASYNC110 - nothing to wait on: a file
            await asyncio.sleep(0.01)


async def test_processes_are_confined_to_their_tree(provider: LocalSandboxProvider) -> None:
    report = provider.isolation
    assert (report.mechanism, report.network_isolated, report.filesystem_confined) == (
        Isolation.BWRAP,
        True,
        True,
    )
    assert provider.capability is Capability.SNAPSHOT
    box = await provider.create("box")
    assert await _sh(provider, box, "pwd; touch made") == b"/sandbox\n"
    assert await provider.read_file(box, "made") == b""
    escape = await provider.exec(
        box, ["sh", "-c", "echo x > /etc/escaped || echo x > /usr/escaped"], timeout_seconds=RUN_S
    )
    assert escape.exit_code != 0
    assert not _on_host("/etc/escaped") and not _on_host("/usr/escaped")
    # Only loopback exists in the sandbox's network namespace.
    links = await _sh(provider, box, "cat /proc/net/dev")
    assert [line.split(b":")[0].strip() for line in links.splitlines()[2:]] == [b"lo"]


def _on_host(path: str) -> bool:
    return Path(path).exists()


async def test_a_command_is_bounded_in_time_output_and_file_size(
    provider: LocalSandboxProvider,
) -> None:
    box = await provider.create("box")
    slow = await provider.exec(box, ["sleep", "60"], timeout_seconds=0.2)
    assert (slow.timed_out, slow.exit_code) == (True, None)
    loud = await provider.exec(box, ["sh", "-c", "yes | head -c 100000"], timeout_seconds=RUN_S)
    assert (len(loud.stdout), loud.output_truncated, loud.exit_code) == (4096, True, 0)
    big = await provider.exec(
        box, ["sh", "-c", "head -c 2000000 /dev/zero > big"], timeout_seconds=RUN_S
    )
    assert big.exit_code != 0
    assert len(await provider.read_file(box, "big")) == 1 << 20
    assert "file_bytes" in provider.isolation.limits_enforced


async def test_a_file_written_after_the_snapshot_is_gone_after_restore(
    provider: LocalSandboxProvider,
) -> None:
    box = await provider.create("box")
    await provider.write_file(box, "src/task.py", b"x = 1\n")
    await _sh(provider, box, "echo cut > state")
    handle = await provider.snapshot(box, retention_seconds=60)
    await provider.write_file(box, "after.txt", b"late")
    await _sh(provider, box, "echo later >> state; rm src/task.py")

    [restored] = await provider.restore([handle], attempt=1)

    assert restored.sandbox == Sandbox("box", 2)
    new = restored.sandbox
    assert await _sh(provider, new, "ls -R") == b".:\nsrc\nstate\n\n./src:\ntask.py\n"
    assert await provider.read_file(new, "state") == b"cut\n"
    assert await provider.read_file(new, "src/task.py") == b"x = 1\n"


async def test_a_destroyed_sandbox_comes_back_from_its_snapshot_past_its_last_generation(
    provider: LocalSandboxProvider,
) -> None:
    """Its episode ended after the cut; a restore of that cut still needs it."""
    box = await provider.create("box")
    await provider.write_file(box, "kept", b"yes")
    handle = await provider.snapshot(box, retention_seconds=60)
    await provider.destroy("box")

    [restored] = await provider.restore([handle], attempt=1)

    assert restored.sandbox == Sandbox("box", 2)
    assert await provider.read_file(restored.sandbox, "kept") == b"yes"
    with pytest.raises(SandboxFencedError):
        await provider.read_file(box, "kept")
    with pytest.raises(DuplicateRestoreError):
        await provider.restore([handle], attempt=1)
    with pytest.raises(SandboxExistsError):
        await provider.create("box")


async def test_the_old_generation_is_fenced(provider: LocalSandboxProvider) -> None:
    box = await provider.create("box")
    handle = await provider.snapshot(box, retention_seconds=60)
    running = asyncio.create_task(
        provider.exec(box, ["sh", "-c", "echo up > starts; exec sleep 60"], timeout_seconds=60)
    )
    await _eventually(lambda: _starts(provider, box, b"up\n"))
    [restored] = await provider.restore([handle], attempt=1)

    calls = [
        provider.exec(box, ["true"], timeout_seconds=RUN_S),
        provider.write_file(box, "x", b"x"),
        provider.read_file(box, "x"),
        provider.snapshot(box, retention_seconds=60),
        provider.start(box, ["sleep", "60"]),
    ]
    for call in calls:
        with pytest.raises(SandboxFencedError) as fenced:
            await call
        assert (fenced.value.generation, fenced.value.active) == (1, 2)
        assert fenced.value.reason is Reason.FENCED
    # The command that ran in the old generation was killed by the restore.
    with pytest.raises(SandboxFencedError):
        await asyncio.wait_for(running, BOUND_S)
    await _sh(provider, restored.sandbox, "true")


async def test_a_started_process_is_declared_restart_only_and_started_again(
    provider: LocalSandboxProvider,
) -> None:
    box = await provider.create("box")
    server = ("sh", "-c", "echo up >> starts; exec sleep 600")
    await provider.start(box, server)
    await _eventually(lambda: _starts(provider, box, b"up\n"))
    handle = await provider.snapshot(box, retention_seconds=60)
    assert handle.processes is ProcessRecovery.RESTART_ONLY
    assert handle.restart_commands == (server,)

    [restored] = await provider.restore([handle], attempt=1)

    assert restored.restarted == (server,)
    await _eventually(lambda: _starts(provider, restored.sandbox, b"up\nup\n"))


async def _starts(provider: LocalSandboxProvider, sandbox: Sandbox, want: bytes) -> bool:
    try:
        return await provider.read_file(sandbox, "starts") == want
    except FileNotFoundError:
        return False


async def test_a_partial_restore_of_several_sandboxes_activates_none(
    provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    boxes = [await provider.create(name) for name in ("alpha", "beta", "gamma")]
    for box in boxes:
        await provider.write_file(box, "who", box.sandbox_id.encode())
    handles = [await provider.snapshot(box, retention_seconds=60) for box in boxes]
    await provider.write_file(boxes[0], "who", b"changed after the cut")
    # gamma's only chunk is damaged: it is the last one materialized.
    store = tmp_path / "provider" / "store" / "chunks"
    digest = hashlib.sha256(b"gamma").hexdigest()
    (store / digest[:2] / f"{digest}.zst").write_bytes(b"not zstd")
    trees_before = sorted((tmp_path / "provider" / "sandboxes").rglob("g*"))

    with pytest.raises(SnapshotRefusedError) as refused:
        await provider.restore(handles, attempt=1)

    assert refused.value.kind is Refusal.CHUNK_CORRUPT
    assert sorted((tmp_path / "provider" / "sandboxes").rglob("g*")) == trees_before
    assert await provider.read_file(boxes[0], "who") == b"changed after the cut"
    for box in boxes:
        await _sh(provider, box, "true")  # generation 1 of each is still the live one
    # The same restore without the damaged sandbox goes through, under the same attempt.
    restored = await provider.restore(handles[:2], attempt=1)
    assert [r.sandbox for r in restored] == [Sandbox("alpha", 2), Sandbox("beta", 2)]
    assert await provider.read_file(restored[0].sandbox, "who") == b"alpha"


async def test_restore_refusals_are_typed(provider: LocalSandboxProvider, clock: FakeClock) -> None:
    box = await provider.create("box")
    handle = await provider.snapshot(box, retention_seconds=60)

    with pytest.raises(SnapshotNotFoundError):
        await provider.restore([replace(handle, snapshot_id="box.g1.000000000000")], attempt=1)
    with pytest.raises(SnapshotNotFoundError):
        await provider.restore([replace(handle, snapshot_id="../../state")], attempt=1)
    stale_handles = {
        "tree_digest": replace(handle, tree_digest="0" * 64),
        "generation": replace(handle, generation=7),
        "provider_version": replace(handle, provider_version="0"),
    }
    for field, stale_handle in stale_handles.items():
        with pytest.raises(StaleHandleError) as stale:
            await provider.restore([stale_handle], attempt=1)
        assert stale.value.field == field

    [restored] = await provider.restore([handle], attempt=1)
    for attempt in (1, 0):
        with pytest.raises(DuplicateRestoreError) as duplicate:
            await provider.restore([handle], attempt=attempt)
        assert duplicate.value.restored_attempt == 1
    with pytest.raises(DuplicateRestoreError):
        await provider.restore([handle, handle], attempt=5)
    await _sh(provider, restored.sandbox, "true")  # none of the refusals touched it

    clock.now += 60
    with pytest.raises(SnapshotExpiredError) as expired:
        await provider.restore([handle], attempt=2)
    assert expired.value.reason is Reason.NOT_FOUND


async def test_a_handle_is_durable_across_a_new_provider(
    provider: LocalSandboxProvider, tmp_path: Path, clock: FakeClock
) -> None:
    box = await provider.create("box")
    await provider.write_file(box, "kept", b"yes")
    saved = json.dumps(
        (await provider.snapshot(box, retention_seconds=60)).to_json()
    )  # what a participant keeps with its session
    await provider.write_file(box, "kept", b"no")

    reopened = await LocalSandboxProvider.open(
        tmp_path / "provider", isolation=Isolation.BWRAP, clock=clock
    )
    [restored] = await reopened.restore([SnapshotHandle.from_json(json.loads(saved))], attempt=1)
    assert await reopened.read_file(restored.sandbox, "kept") == b"yes"
    with pytest.raises(SandboxFencedError):
        await reopened.read_file(box, "kept")


async def test_a_clone_is_a_separate_copy(provider: LocalSandboxProvider) -> None:
    box = await provider.create("box")
    await provider.write_file(box, "f", b"original")
    copy = await provider.clone(box, "copy")
    await provider.write_file(copy, "f", b"changed")
    assert await provider.read_file(box, "f") == b"original"
    assert copy == Sandbox("copy", 1)
    await provider.destroy("box")
    with pytest.raises(SandboxFencedError) as fenced:
        await provider.read_file(box, "f")
    assert fenced.value.active is None
    assert await provider.read_file(copy, "f") == b"changed"
    with pytest.raises(SandboxExistsError):
        await provider.clone(copy, "copy")
    # Made again under its id, the sandbox starts past its old generations: the handle
    # kept from before the destroy still reaches nothing.
    again = await provider.create("box")
    assert again == Sandbox("box", 2)
    with pytest.raises(SandboxFencedError):
        await provider.read_file(box, "f")
    with pytest.raises(SandboxExistsError):
        await provider.create("box")


async def test_file_calls_stay_inside_the_tree(provider: LocalSandboxProvider) -> None:
    box = await provider.create("box")
    for path in ("../escaped", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(SandboxPathError):
            await provider.write_file(box, path, b"x")
    await _sh(provider, box, "ln -s /etc out; ln -s /etc/hostname name")
    with pytest.raises(SandboxPathError):
        await provider.write_file(box, "out/escaped", b"x")
    with pytest.raises(SandboxPathError):
        await provider.read_file(box, "name")
    # A tree that links outside itself cannot be snapshotted: a restore would refuse it.
    with pytest.raises(SnapshotRefusedError) as refused:
        await provider.snapshot(box, retention_seconds=60)
    assert refused.value.kind is Refusal.SYMLINK_ESCAPE


async def test_prune_removes_what_only_expired_snapshots_hold(
    provider: LocalSandboxProvider, clock: FakeClock
) -> None:
    box = await provider.create("box")
    await provider.write_file(box, "shared", b"in both snapshots")
    await provider.write_file(box, "old", b"only in the first")
    first = await provider.snapshot(box, retention_seconds=10)
    await provider.write_file(box, "old", b"only in the second")
    second = await provider.snapshot(box, retention_seconds=100)

    clock.now += 10
    pruned = await provider.prune()

    assert pruned.snapshots == (first.snapshot_id,)
    assert pruned.manifests == 1 and pruned.bytes_freed > 0
    with pytest.raises(SnapshotNotFoundError):
        await provider.restore([first], attempt=1)
    [restored] = await provider.restore([second], attempt=1)
    assert await provider.read_file(restored.sandbox, "shared") == b"in both snapshots"
    assert await provider.read_file(restored.sandbox, "old") == b"only in the second"
    assert (await provider.prune()).snapshots == ()


def _processes_under(root: Path) -> list[int]:
    """Host processes whose working directory lies under ``root`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue  # gone, or a zombie
            if cwd.startswith(f"{root}/"):
                found.append(int(entry.name))
    return found


async def test_a_cancelled_exec_kills_its_command(
    provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    box = await provider.create("box")
    trees = tmp_path / "provider" / "sandboxes"
    running = asyncio.create_task(
        provider.exec(box, ["sh", "-c", "echo up > starts; exec sleep 60"], timeout_seconds=60)
    )
    await _eventually(lambda: _starts(provider, box, b"up\n"))
    assert _processes_under(trees) != []
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await _eventually(lambda: _none_under(trees))


async def _none_under(root: Path) -> bool:
    return _processes_under(root) == []


def _processes_naming(root: Path) -> list[int]:
    """Host processes whose command line names a path under ``root``: bwrap, and the
    init of each sandbox's pid namespace (their working directory is inside the
    sandbox's own mounts, so :func:`_processes_under` cannot see them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if f"{root}/".encode() in command:
                found.append(int(entry.name))
    return found


async def test_a_command_cancelled_at_any_moment_of_its_start_leaves_nothing_running(
    provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    """Cancelled while bwrap was still setting the sandbox up, a command used to escape:
    bwrap was killed and the sandbox, in a session of its own, went on running with the
    command's pipes open, so that the cancelled call itself hung until the command
    ended. The cancellations sweep the start-up window in steps of a millisecond."""
    box = await provider.create("box")
    trees = tmp_path / "provider" / "sandboxes"
    for step in range(40):
        running = asyncio.create_task(provider.exec(box, ["sleep", "60"], timeout_seconds=60))
        await asyncio.sleep(step / 1000)
        running.cancel()
        async with asyncio.timeout(BOUND_S):
            with contextlib.suppress(asyncio.CancelledError):
                await running
    await _eventually(lambda: _nothing_naming(trees))


async def _nothing_naming(root: Path) -> bool:
    return _processes_naming(root) == []


async def test_a_machine_without_the_isolation_asked_for_is_refused_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-binaries-here"))
    with pytest.raises(IsolationUnavailableError) as refused:
        await LocalSandboxProvider.open(tmp_path / "strict", isolation=Isolation.BWRAP)
    assert refused.value.mechanism == "bwrap"
    weakest = await LocalSandboxProvider.open(tmp_path / "lenient")
    report = weakest.isolation
    assert (report.mechanism, report.network_isolated, report.filesystem_confined) == (
        Isolation.NONE,
        False,
        False,
    )
    assert report.limits_enforced == ()
    assert any("prlimit is missing" in note for note in report.notes)


async def test_a_damaged_state_file_opens_nothing(
    provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    await provider.create("box")
    state = tmp_path / "provider" / "state.json"
    document = json.loads(await asyncio.to_thread(state.read_text))
    outside = {**document, "retired": {}}
    outside["sandboxes"]["box"]["directory"] = "../../../outside"
    for damaged in ({"state_version": 1, "sandboxes": {}}, outside):
        await asyncio.to_thread(state.write_text, json.dumps(damaged))
        with pytest.raises(ProviderStateError):
            await LocalSandboxProvider.open(tmp_path / "provider", isolation=Isolation.BWRAP)


_FAKE_CRIU = """#!/bin/sh
echo "Error (criu/util.c:642): exited, status=1" >&2
echo "Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds" >&2
echo "Error (criu/kerndat.c:1615): kerndat_vdso_fill_symtable failed" >&2
exit 1
"""


@pytest.mark.parametrize(
    ("script", "said"),
    [
        (None, "criu is not installed"),
        (_FAKE_CRIU, "criu check fails on kernel {kernel}: vdso: Unexpected rt vDSO area bounds"),
        ("#!/bin/sh\nexit 0\n", "criu check passes on kernel {kernel}; provider version 1"),
    ],
    ids=["missing", "refused", "passes"],
)
async def test_the_report_says_why_processes_are_restart_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str | None, said: str
) -> None:
    """Section 5.7.4 item 4: CRIU is tried, and the report says what came of it."""
    if os.geteuid() != 0:
        said = "criu needs root" if script else said
    binaries = tmp_path / "bin"
    binaries.mkdir()
    if script is not None:
        (binaries / "criu").write_text(script)
        (binaries / "criu").chmod(0o755)
    for tool in ("bwrap", "prlimit"):
        (binaries / tool).symlink_to(shutil.which(tool) or tool)
    monkeypatch.setenv("PATH", str(binaries))
    opened = await LocalSandboxProvider.open(tmp_path / "provider", isolation=Isolation.BWRAP)
    try:
        report = opened.isolation
        assert report.processes is ProcessRecovery.RESTART_ONLY
        assert report.processes_why.startswith(said.format(kernel=platform.release()))
        box = await opened.create("box")
        assert (await opened.snapshot(box, retention_seconds=60)).processes is report.processes
    finally:
        await opened.close()
