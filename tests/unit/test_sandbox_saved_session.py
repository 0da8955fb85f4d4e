"""The exported state of a sandbox session (docs/spec.md section 5.7.5 item 2): strict."""

from __future__ import annotations

from typing import Any

import pytest

from turnpoint.participant_sdk.sandboxes import (
    Mount,
    ProcessRecovery,
    SavedSession,
    SnapshotHandle,
)

HANDLE = SnapshotHandle(
    snapshot_id="box.g1.abc",
    provider="turnpoint.local",
    provider_version="1",
    sandbox_id="box",
    generation=1,
    base_digest="0" * 64,
    tree_digest="1" * 64,
    mounts=(Mount("/sandbox", "rw", "sandbox"),),
    processes=ProcessRecovery.RESTART_ONLY,
    restart_commands=(),
    expires_at=2_000.0,
)


def test_a_saved_session_round_trips_through_its_json() -> None:
    saved = SavedSession("/var/sandboxes", HANDLE, {"task": "add"})
    assert SavedSession.from_json(saved.to_json()) == saved


def _with(**changes: Any) -> dict[str, Any]:
    document = SavedSession("/var/sandboxes", HANDLE, {}).to_json()
    for name, value in changes.items():
        if name in ("store", "handle"):
            document["sandbox"][name] = value
        else:
            document[name] = value
    return document


@pytest.mark.parametrize(
    "document",
    [
        {"sandbox": {}},
        _with(extra=1),
        _with(store=7),
        _with(data=[]),
        _with(handle={**HANDLE.to_json(), "generation": "1"}),
        {**_with(), "sandbox": {"store": "/x", "handle": HANDLE.to_json(), "more": 1}},
    ],
)
def test_anything_but_the_exported_shape_is_refused(document: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SavedSession.from_json(document)
