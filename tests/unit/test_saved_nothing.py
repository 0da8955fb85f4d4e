"""What a commit costs on disk (docs/spec.md sections 4.8, 4.10 and 8.4).

A participant that exported nothing writes nothing: the runtime answers ``saved_nothing``
only when the coordinator accepts it, replays that answer, and restores from an entry
without manifest; the coordinator refuses a reply that says "saved nothing" and names
files all the same. One that exported something fsyncs each file and directory once.
In process, real store on tmp_path, no network.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.support.fakes import expect
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import (
    ParticipantRuntime,
    Record,
    ResourcesServer,
    SnapshotStore,
    Verdict,
)
from turnpoint.protocol import Fence, ParticipantKind, Phase, RecoveryMode
from turnpoint.trainer.control.client import check_prepare_reply
from turnpoint.trainer.control.coordinator import _entry_from_commit
from turnpoint.trainer.control.failures import MalformedReplyError
from turnpoint.v1 import checkpoint_control_service_pb2 as pb
from turnpoint.v1 import types_pb2

FENCE = Fence("coord", 1)
INSTANCE = "tools-0"
_requests = itertools.count()


def rid() -> str:
    return f"req-{next(_requests)}"


def ckpt(n: int) -> str:
    return make_checkpoint_id("ckpt", n)


class Idle(ResourcesServer):
    """Holds no session: every export is empty."""

    async def seed(self, episode: EpisodeId, task: object) -> None:
        return None

    async def call(self, episode: EpisodeId, tool: str, arguments: object) -> dict[str, int]:
        return {}

    async def verify(self, episode: EpisodeId, answer: object) -> Verdict:
        return Verdict(0.0)

    async def close(self, episode: EpisodeId) -> None:
        return None


class Kept(Idle):
    """Exports each session it holds (an empty state)."""

    recovery_mode = RecoveryMode.EXPORTED

    async def export_sessions(self, episodes: Sequence[EpisodeId]) -> dict[EpisodeId, object]:
        return {episode: {} for episode in episodes}

    async def restore_session(self, saved: object, episode: EpisodeId, state: object) -> None:
        return None

    async def retire_session(self, episode: EpisodeId) -> None:
        return None


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path)


async def test_an_empty_export_writes_no_byte_and_no_fsync_when_the_coordinator_accepts(
    store: SnapshotStore,
) -> None:
    runtime = ParticipantRuntime(INSTANCE, store, resources=Idle())
    try:
        await runtime.prepare(FENCE, rid(), ckpt(1))
        request = rid()
        with mock.patch.object(os, "fsync", wraps=os.fsync) as fsync:
            result = await runtime.commit(
                FENCE, request, ckpt(1), ckpt(1), [], accept_saved_nothing=True
            )
        assert fsync.call_count == 0
        assert result.saved_nothing
        assert (result.manifest, result.artifacts, result.exported) == (None, (), ())
        assert not (store.root / ckpt(1)).exists()
        assert runtime.phase is Phase.COMMITTED
        # A retry replays the same answer, and still writes nothing.
        again = await runtime.commit(
            FENCE, request, ckpt(1), ckpt(1), [], accept_saved_nothing=True
        )
        assert again == result
        assert not (store.root / ckpt(1)).exists()
        await runtime.resume(FENCE, rid(), ckpt(1))
    finally:
        await runtime.aclose()


async def test_an_older_coordinator_still_gets_a_manifest_and_a_records_file(
    store: SnapshotStore,
) -> None:
    runtime = ParticipantRuntime(INSTANCE, store, resources=Idle())
    try:
        await runtime.prepare(FENCE, rid(), ckpt(1))
        result = await runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [])
        assert not result.saved_nothing
        assert result.manifest is not None and len(result.artifacts) == 1
        assert store.exists(ckpt(1), INSTANCE)
    finally:
        await runtime.aclose()


async def test_a_restore_without_manifest_installs_nothing_and_holds_the_participant(
    store: SnapshotStore,
) -> None:
    runtime = ParticipantRuntime(INSTANCE, store, resources=Idle())
    try:
        restore_id = make_checkpoint_id("restore", 1)
        result = await runtime.restore(FENCE, rid(), restore_id, ckpt(1), None, [], [])
        assert result.installed == ()
        assert runtime.phase is Phase.RESTORED
        await runtime.resume(FENCE, rid(), restore_id)
        assert runtime.phase is Phase.IDLE
    finally:
        await runtime.aclose()


async def test_a_restore_without_manifest_refuses_a_scope(store: SnapshotStore) -> None:
    runtime = ParticipantRuntime(INSTANCE, store, resources=Idle())
    try:
        await expect(
            Reason.INVALID_CHECKPOINT_STATE,
            runtime.restore(
                FENCE,
                rid(),
                make_checkpoint_id("restore", 1),
                ckpt(1),
                None,
                [],
                [EpisodeId("r", 0)],
            ),
        )
        # All or nothing: still idle and fresh, a good restore goes through.
        assert runtime.phase is Phase.IDLE
    finally:
        await runtime.aclose()


def _commit_reply(**fields: object) -> pb.CommitResponse:
    return pb.CommitResponse(
        header=types_pb2.ResponseHeader(incarnation="i-1"), checkpoint_id=ckpt(1), **fields
    )


def test_the_coordinator_records_a_participant_that_saved_nothing_without_files() -> None:
    entry = _entry_from_commit(
        INSTANCE, ParticipantKind.RESOURCES, _commit_reply(saved_nothing=True), frozenset()
    )
    assert (entry.manifest, entry.artifacts, entry.exported) == (None, (), ())
    assert entry.to_dict()["manifest"] is None


def test_saved_nothing_naming_a_file_is_a_malformed_reply() -> None:
    manifest = types_pb2.ArtifactRef(
        path=f"{INSTANCE}/MANIFEST.json", sha256="0" * 64, size_bytes=2, record_count=0
    )
    with pytest.raises(MalformedReplyError, match="saved_nothing"):
        _entry_from_commit(
            INSTANCE,
            ParticipantKind.RESOURCES,
            _commit_reply(saved_nothing=True, manifest=manifest),
            frozenset(),
        )


def test_a_write_with_records_makes_one_fsync_per_file_and_per_directory(
    store: SnapshotStore,
) -> None:
    # The coordinator begins the snapshot directory; the participant creates its own.
    (store.root / ckpt(1)).mkdir(parents=True)
    record = Record(EpisodeId("r", 0), "run", {"turn": 1})
    with mock.patch.object(os, "fsync", wraps=os.fsync) as fsync:
        entry = store.write(ckpt(1), INSTANCE, ckpt(1), [record])
    # The records file, the manifest, the instance directory: not the shared snapshot
    # directory, which the publication syncs once for all (docs/spec.md section 8.4).
    assert fsync.call_count == 3
    loaded = store.read(ckpt(1), INSTANCE, entry.manifest)
    assert [r.episode for r in loaded.records] == [EpisodeId("r", 0)]


# -- commit in the prepare (docs/spec.md section 4.6 item 8) ------------------------------


async def test_an_idle_participant_commits_saved_nothing_in_its_prepare(
    store: SnapshotStore,
) -> None:
    runtime = ParticipantRuntime(INSTANCE, store, resources=Idle())
    try:
        request = rid()
        with mock.patch.object(os, "fsync", wraps=os.fsync) as fsync:
            prepared = await runtime.prepare(FENCE, request, ckpt(1), empty_commit_snapshot=ckpt(1))
        assert prepared.committed_empty and prepared.readiness.ready
        assert prepared.phase is Phase.COMMITTED and runtime.phase is Phase.COMMITTED
        assert fsync.call_count == 0 and not (store.root / ckpt(1)).exists()
        # A lost reply's retry, and a new round of the same id, give the same answer.
        for again in (request, rid()):
            replay = await runtime.prepare(FENCE, again, ckpt(1), empty_commit_snapshot=ckpt(1))
            assert (replay.committed_empty, replay.phase) == (True, Phase.COMMITTED)
        # The Commit it stands for replays saved-nothing; any other commit of the id is a
        # conflict, not a second cut.
        commit = await runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [], accept_saved_nothing=True)
        assert commit.saved_nothing
        await expect(
            Reason.CHECKPOINT_CONFLICT,
            runtime.commit(
                FENCE, rid(), ckpt(1), ckpt(1), [EpisodeId("r", 0)], accept_saved_nothing=True
            ),
        )
        await expect(
            Reason.CHECKPOINT_CONFLICT,
            runtime.commit(FENCE, rid(), ckpt(1), ckpt(2), [], accept_saved_nothing=True),
        )
        await runtime.resume(FENCE, rid(), ckpt(1))
        assert runtime.phase is Phase.IDLE
    finally:
        await runtime.aclose()


async def test_without_the_offer_a_prepare_never_commits(store: SnapshotStore) -> None:
    runtime = ParticipantRuntime(INSTANCE, store, resources=Idle())
    try:
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1))
        assert not prepared.committed_empty and prepared.phase is Phase.PREPARED
        result = await runtime.commit(FENCE, rid(), ckpt(1), ckpt(1), [], accept_saved_nothing=True)
        assert result.saved_nothing
    finally:
        await runtime.aclose()


async def test_a_participant_holding_work_waits_for_its_commit(store: SnapshotStore) -> None:
    runtime = ParticipantRuntime(INSTANCE, store, resources=Kept())
    episode = EpisodeId("r", 0)
    try:
        assert not await runtime.seed_session(episode, {})  # a new session
        prepared = await runtime.prepare(FENCE, rid(), ckpt(1), empty_commit_snapshot=ckpt(1))
        assert not prepared.committed_empty and prepared.phase is Phase.PREPARED
        # Its session is in the scope the coordinator sends, and is exported.
        (store.root / ckpt(1)).mkdir(parents=True)
        result = await runtime.commit(
            FENCE, rid(), ckpt(1), ckpt(1), [episode], accept_saved_nothing=True
        )
        assert result.exported == (episode,) and result.manifest is not None
    finally:
        await runtime.aclose()


async def test_a_bad_snapshot_name_in_the_offer_is_refused(store: SnapshotStore) -> None:
    runtime = ParticipantRuntime(INSTANCE, store, resources=Idle())
    try:
        await expect(
            Reason.INVALID_ARGUMENT,
            runtime.prepare(FENCE, rid(), ckpt(1), empty_commit_snapshot="../up"),
        )
        assert runtime.phase is Phase.IDLE
    finally:
        await runtime.aclose()


def _prepare_reply(**fields: Any) -> pb.PrepareResponse:
    return pb.PrepareResponse(
        header=types_pb2.ResponseHeader(incarnation="i-1"), checkpoint_id=ckpt(1), **fields
    )


@pytest.mark.parametrize(
    ("offered", "reply", "problem"),
    [
        ("", _prepare_reply(committed_empty=True, phase=types_pb2.PHASE_COMMITTED), "offered"),
        (ckpt(1), _prepare_reply(committed_empty=True, phase=types_pb2.PHASE_PREPARED), "phase"),
        (ckpt(1), _prepare_reply(phase=types_pb2.PHASE_COMMITTED), "phase"),
    ],
)
def test_the_coordinator_refuses_a_commit_in_a_prepare_it_did_not_offer(
    offered: str, reply: pb.PrepareResponse, problem: str
) -> None:
    request = pb.PrepareRequest(
        request_id=rid(), checkpoint_id=ckpt(1), empty_commit_snapshot=offered
    )
    with pytest.raises(MalformedReplyError, match=problem):
        check_prepare_reply(INSTANCE, request, reply)
