"""Providers in several processes over one sandbox root (docs/spec.md section 5.7.4).

A participant restarted while the old one still runs, or a restore target beside a
running server, opens a second provider over the same root. Their changes of
``state.json`` must not lose each other, a generation one of them replaces is fenced in
the other too, and a prune waits for the store lock another process holds.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from turnpoint.participant_sdk.sandboxes import (
    Isolation,
    LocalSandboxProvider,
    Sandbox,
    SandboxFencedError,
)

BOUND_S = 10.0


async def _eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll a condition nothing notifies about (a file, the kernel's lock table), bounded."""
    async with asyncio.timeout(BOUND_S):
        while not await check():  # noqa: ASYNC110 - nothing to wait on
            await asyncio.sleep(0.01)


@pytest.fixture
async def root(tmp_path: Path) -> Path:
    return tmp_path / "provider"


@pytest.fixture
async def pair(root: Path) -> AsyncIterator[tuple[LocalSandboxProvider, LocalSandboxProvider]]:
    # Both opened before either changes anything: each starts from the same copy.
    first = await LocalSandboxProvider.open(root, isolation=Isolation.BWRAP)
    second = await LocalSandboxProvider.open(root, isolation=Isolation.BWRAP)
    yield first, second
    await first.close()
    await second.close()


async def test_changes_from_two_providers_lose_nothing(
    pair: tuple[LocalSandboxProvider, LocalSandboxProvider], root: Path
) -> None:
    first, second = pair
    a = await first.create("a")
    b = await second.create("b")  # from a copy that has not seen "a"
    await first.start(a, ["sleep", "600"])
    await second.destroy("b")

    reopened = await LocalSandboxProvider.open(root, isolation=Isolation.BWRAP)
    handle = await reopened.snapshot(a, retention_seconds=60)
    assert handle.restart_commands == (("sleep", "600"),)
    with pytest.raises(SandboxFencedError):
        await reopened.read_file(b, "x")
    # Made again under its id, "b" starts past the generation the other provider retired.
    assert (await first.create("b")).generation == b.generation + 1
    await reopened.close()


async def test_a_generation_another_process_replaced_is_fenced_here_too(
    pair: tuple[LocalSandboxProvider, LocalSandboxProvider], root: Path
) -> None:
    old, replacement = pair
    box = await old.create("box")
    await old.write_file(box, "kept", b"at the cut")
    handle = await old.snapshot(box, retention_seconds=60)
    await old.write_file(box, "kept", b"after the cut")
    running = asyncio.create_task(
        old.exec(box, ["sh", "-c", "echo up > starts; exec sleep 60"], timeout_seconds=60)
    )
    await _eventually(lambda: _reads(old, box, "starts", b"up\n"))

    [restored] = await replacement.restore([handle], attempt=1)

    assert await replacement.read_file(restored.sandbox, "kept") == b"at the cut"
    with pytest.raises(SandboxFencedError) as fenced:
        await old.write_file(box, "kept", b"from the old process")
    assert (fenced.value.generation, fenced.value.active) == (1, 2)
    # The old process's command in the replaced generation is killed there.
    with pytest.raises(SandboxFencedError):
        await asyncio.wait_for(running, BOUND_S)
    assert await replacement.read_file(restored.sandbox, "kept") == b"at the cut"
    # The old process sees the new generation as the active one, and may use it.
    assert await old.read_file(restored.sandbox, "kept") == b"at the cut"


async def _reads(provider: LocalSandboxProvider, box: Sandbox, path: str, want: bytes) -> bool:
    try:
        return await provider.read_file(box, path) == want
    except FileNotFoundError:
        return False


_HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.readline()
"""


def _blocked_on(path: Path) -> bool:
    """Whether some process waits for a lock on ``path`` (Linux ``/proc/locks``)."""
    inode = os.stat(path).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[fields.index("->") + 5].endswith(f":{inode}"):
            return True
    return False


async def test_a_prune_waits_for_a_capture_another_process_holds(root: Path) -> None:
    provider = await LocalSandboxProvider.open(root, isolation=Isolation.BWRAP)
    lock = root / "store.lock"
    # Another process in the middle of a capture: the lock section 5.7.4 item 5 names.
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLD,
        str(lock),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert await asyncio.wait_for(holder.stdout.readline(), BOUND_S) == b"held\n"
        pruning = asyncio.create_task(provider.prune())
        await _eventually(lambda: asyncio.to_thread(_blocked_on, lock))
        assert not pruning.done()  # it waits in the kernel, not by luck
        holder.stdin.write(b"done\n")
        await holder.stdin.drain()
        pruned = await asyncio.wait_for(pruning, BOUND_S)
        assert pruned.snapshots == ()
    finally:
        if holder.returncode is None:
            holder.kill()
        await holder.wait()
        await provider.close()
    # The lock is the file itself: an exclusive holder now gets it at once.
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
