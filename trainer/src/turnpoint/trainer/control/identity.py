"""The coordinator's identity: ``(coordinator_id, epoch)``, sent with every request as its
Fence, and the file that persists it (docs/spec.md sections 2.2 and 8.11)."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from turnpoint.ids import InvalidIdError, validate_id

COORDINATOR_FILE: Final = "coordinator.json"


@dataclass(frozen=True, slots=True)
class CoordinatorIdentity:
    """Who this coordinator is: ``(coordinator_id, epoch)``, sent as the Fence."""

    coordinator_id: str
    epoch: int

    def __post_init__(self) -> None:
        validate_id(self.coordinator_id, "coordinator_id")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise ValueError(f"epoch must be an integer >= 1, got {self.epoch!r}")


def _read_identity(path: Path) -> CoordinatorIdentity | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return _parse_identity(str(path), text)


def _parse_identity(where: str, text: str) -> CoordinatorIdentity:
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) != {"coordinator_id", "epoch"}:
            raise ValueError("expected exactly the keys coordinator_id and epoch")
        return CoordinatorIdentity(raw["coordinator_id"], raw["epoch"])
    except (ValueError, InvalidIdError) as error:
        raise ValueError(f"{where} is not a coordinator identity file: {error}") from None


def bump_epoch(
    snapshot_root: str | Path, *, coordinator_id: str | None = None
) -> CoordinatorIdentity:
    """Increase and persist the coordinator epoch in ``<snapshot_root>/coordinator.json``.

    Call once at every start, before the first control call (docs/spec.md section 2.2). The
    id is ``coordinator_id`` when given, else the stored one, else a new random id; the
    epoch is one more than the stored one (1 the first time). The file is replaced
    atomically and durably (temporary file, fsync, rename, fsync of the directory), so a
    crash leaves the old epoch or the new one, never a torn file. Blocking: from async
    code run it with ``asyncio.to_thread``.
    """
    if isinstance(snapshot_root, str) and "://" in snapshot_root:
        return _bump_on_storage(snapshot_root, coordinator_id)
    root = Path(snapshot_root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / COORDINATOR_FILE
    stored = _read_identity(path)
    chosen = coordinator_id or (
        stored.coordinator_id if stored else f"coord-{secrets.token_hex(6)}"
    )
    identity = CoordinatorIdentity(chosen, (stored.epoch if stored else 0) + 1)
    data = json.dumps({"coordinator_id": identity.coordinator_id, "epoch": identity.epoch})
    staged = root / f".coordinator-{secrets.token_hex(8)}.tmp"
    try:
        with staged.open("x", encoding="utf-8") as handle:
            handle.write(data + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staged, path)
    except OSError:
        staged.unlink(missing_ok=True)
        raise
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return identity


def _bump_on_storage(url: str, coordinator_id: str | None) -> CoordinatorIdentity:
    """:func:`bump_epoch` on a storage URL (docs/spec.md section 8.12): one put, which
    is whole or not at all, so a crash leaves the old epoch or the new one."""
    from turnpoint.storage import ObjectMissingError, open_storage

    storage = open_storage(url)
    storage.check()
    try:
        text = storage.get(COORDINATOR_FILE, limit=4096).decode("utf-8")
    except ObjectMissingError:
        stored = None
    else:
        stored = _parse_identity(f"{url}/{COORDINATOR_FILE}", text)
    chosen = coordinator_id or (
        stored.coordinator_id if stored else f"coord-{secrets.token_hex(6)}"
    )
    identity = CoordinatorIdentity(chosen, (stored.epoch if stored else 0) + 1)
    data = json.dumps({"coordinator_id": identity.coordinator_id, "epoch": identity.epoch})
    storage.put(COORDINATOR_FILE, (data + "\n").encode("utf-8"))
    return identity
