"""The participant's snapshot store (docs/spec.md section 8), on real temporary directories."""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import json
import os
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from turnpoint.ids import EpisodeId, InvalidIdError
from turnpoint.participant_sdk import (
    CorruptSnapshotError,
    Record,
    SnapshotConflictError,
    SnapshotEntry,
    SnapshotStore,
    _store_format,
)
from turnpoint.participant_sdk._store import WriteCancelled, WriteState, WriteTicket
from turnpoint.participant_sdk._store_format import (
    KEPT_LINE_BYTES,
    LONG_TEXT,
    MANIFEST_NAME,
    MAX_PAYLOAD_DEPTH,
    Corruption,
    Manifest,
    PlainRecord,
    UnserialisableRecordError,
    encode_records,
    plain_member,
    plain_record,
    record_lines,
)
from turnpoint.participant_sdk.testing import FaultPoint, StoreFaults
from turnpoint.protocol import ArtifactRef

T = TypeVar("T")

SNAP = "snap-000000000001"
INST = "agent-0"
CKPT = "ckpt-000000000001"
EP_A = EpisodeId("rollout-a", 0)
EP_B = EpisodeId("rollout-b", 3)
EP_C = EpisodeId("rollout-c", 1)
# Generous safety nets so that a broken handshake fails the test instead of hanging it;
# nothing here waits on time to synchronise.
SAFETY_TIMEOUT = 30.0


def sample_records() -> list[Record]:
    return [
        Record(EP_B, "session", {"tool": "bash", "cwd": "/work", "env": {"Z": "1", "A": "2"}}),
        Record(EP_A, "session", {"model": "policy-7", "temperature": 0.7}),
        Record(EP_B, "turn-1", {"messages": [{"role": "user", "content": "héllo ✓"}]}),
        Record(EP_C, "turn-1", {"nothing": None, "flags": [True, False], "n": -12}),
        Record(EP_A, "turn-1", {"reward": 1.5e-3, "big": 2**70}),
    ]


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as executor:
        yield executor


@pytest.fixture
def release(pool: ThreadPoolExecutor) -> Iterator[threading.Event]:
    """Lets a held write go; also set at teardown (before the pool joins its threads), so
    a failing test cannot leave a writer blocked forever."""
    event = threading.Event()
    yield event
    event.set()


def records_path(store: SnapshotStore, snapshot: str, ref: ArtifactRef) -> Path:
    return store.root / snapshot / ref.path


def listing(store: SnapshotStore, snapshot: str = SNAP, instance: str = INST) -> set[str]:
    return set(os.listdir(store.instance_dir(snapshot, instance)))


def forge(
    store: SnapshotStore,
    data: bytes,
    *,
    record_count: int | None = None,
    episodes: list[dict[str, Any]] | None = None,
    snapshot: str = SNAP,
    instance: str = INST,
    manifest_edit: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Write a records file and a manifest that matches it by hand, bypassing the store."""
    directory = store.root / snapshot / instance
    directory.mkdir(parents=True)
    sha256 = hashlib.sha256(data).hexdigest()
    name = f"records-{sha256}.jsonl"
    (directory / name).write_bytes(data)
    document: dict[str, Any] = {
        "schema_version": 1,
        "checkpoint_id": CKPT,
        "instance": instance,
        "artifacts": [
            {
                "path": f"{instance}/{name}",
                "sha256": sha256,
                "size_bytes": len(data),
                "record_count": data.count(b"\n") if record_count is None else record_count,
            }
        ],
        "episodes": episodes if episodes is not None else [{"rollout_id": "r", "attempt": 0}],
    }
    if manifest_edit is not None:
        manifest_edit(document)
    (directory / MANIFEST_NAME).write_text(json.dumps(document))


def line(rollout_id: str = "r", attempt: int = 0, key: str = "k", payload: str = "{}") -> bytes:
    return (
        f'{{"episode":{{"rollout_id":"{rollout_id}","attempt":{attempt}}},'
        f'"key":"{key}","payload":{payload}}}\n'
    ).encode()


def start(pool: ThreadPoolExecutor, fn: Callable[[], T]) -> Future[T]:
    return pool.submit(fn)


# --------------------------------------------------------------------------- round trip


def test_round_trip(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "root")
    records = sample_records()
    entry = store.write(SNAP, INST, CKPT, records)

    assert entry.checkpoint_id == CKPT
    assert entry.episodes == (EP_A, EP_B, EP_C)  # sorted, unique
    (ref,) = entry.artifacts
    data = records_path(store, SNAP, ref).read_bytes()
    assert ref.path == f"{INST}/records-{ref.sha256}.jsonl"
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    assert ref.size_bytes == len(data)
    assert ref.record_count == len(records) == data.count(b"\n")
    manifest_bytes = (store.instance_dir(SNAP, INST) / MANIFEST_NAME).read_bytes()
    assert entry.manifest == ArtifactRef(
        f"{INST}/{MANIFEST_NAME}",
        hashlib.sha256(manifest_bytes).hexdigest(),
        len(manifest_bytes),
        0,
    )
    assert listing(store) == {MANIFEST_NAME, f"records-{ref.sha256}.jsonl"}
    assert store.exists(SNAP, INST)
    assert not store.exists(SNAP, "agent-1")

    for expected in (entry, entry.manifest, None):
        loaded = store.read(SNAP, INST, expected, checkpoint_id=CKPT, artifacts=entry.artifacts)
        assert loaded.entry == entry
        assert loaded.records == tuple(records)  # file order, not episode order
    assert store.read_entry(SNAP, INST) == entry


def test_payload_key_order_is_kept_on_disk_and_on_read(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    payload = {"zeta": 1, "alpha": {"y": 1, "b": 2, "m": 3}, "mid": [{"q": 1, "c": 2}]}
    entry = store.write(SNAP, INST, CKPT, [Record(EP_A, "state", payload)])

    text = records_path(store, SNAP, entry.artifacts[0]).read_text()
    assert text.index('"zeta"') < text.index('"alpha"') < text.index('"mid"')
    assert text.index('"y"') < text.index('"b"') < text.index('"m"')
    (record,) = store.read(SNAP, INST, entry).records
    assert list(record.payload) == ["zeta", "alpha", "mid"]
    assert list(record.payload["alpha"]) == ["y", "b", "m"]
    assert list(record.payload["mid"][0]) == ["q", "c"]
    assert record.payload == payload


def test_same_records_give_the_same_bytes_and_digest(tmp_path: Path) -> None:
    first = SnapshotStore(tmp_path / "one").write(SNAP, INST, CKPT, sample_records())
    second = SnapshotStore(tmp_path / "two").write(SNAP, INST, CKPT, sample_records())
    assert first == second
    assert (tmp_path / "one" / SNAP / first.artifacts[0].path).read_bytes() == (
        tmp_path / "two" / SNAP / second.artifacts[0].path
    ).read_bytes()


def test_empty_export_round_trips(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    entry = store.write(SNAP, INST, CKPT, [])
    assert entry.episodes == ()
    assert entry.artifacts[0].size_bytes == entry.artifacts[0].record_count == 0
    assert store.read(SNAP, INST, entry).records == ()


class Color(enum.IntEnum):
    RED = 1


def test_tuples_and_int_subclasses_come_back_as_plain_json(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    entry = store.write(SNAP, INST, CKPT, [Record(EP_A, "k", {"t": (1, 2), "c": Color.RED})])
    (record,) = store.read(SNAP, INST, entry).records
    assert record.payload == {"t": [1, 2], "c": 1}
    assert type(record.payload["c"]) is int


def test_record_keys_follow_the_id_rules() -> None:
    with pytest.raises(InvalidIdError):
        Record(EP_A, "a/b", {})
    with pytest.raises(TypeError):
        Record("rollout-a#0", "k", {})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- unserialisable


@pytest.mark.parametrize(
    ("payload", "location"),
    [
        ({"ok": 1, "bad": [1, object()]}, "payload['bad'][1]"),
        ({"s": {1, 2}}, "payload['s']"),
        ({"x": float("nan")}, "payload['x']"),
        ({"x": {"y": float("inf")}}, "payload['x']['y']"),
        ({"b": b"bytes"}, "payload['b']"),
        ({"n": {1: "int key"}}, "payload['n']"),
        (["not", "a", "mapping"], "payload"),
    ],
)
def test_unserialisable_payload_fails_before_writing_and_names_the_record(
    tmp_path: Path, payload: Any, location: str
) -> None:
    store = SnapshotStore(tmp_path / "root")
    culprit = EpisodeId("rollout-7", 2)
    records = [Record(EP_A, "fine", {"a": 1}), Record(culprit, "turn-3", payload)]
    with pytest.raises(UnserialisableRecordError) as caught:
        store.write(SNAP, INST, CKPT, records)
    assert caught.value.episode == culprit
    assert caught.value.key == "turn-3"
    assert caught.value.location == location
    assert "rollout-7#2" in str(caught.value) and "turn-3" in str(caught.value)
    assert not (tmp_path / "root").exists()


def _nested(levels: int) -> dict[str, Any]:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(levels):
        node["d"] = {}
        node = node["d"]
    return deep


@pytest.mark.parametrize(
    "member",
    [
        {"ok": 1, "bad": [1, object()]},
        {"n": {1: "int key"}},
        {"x": {"y": float("inf")}},
        {"t": (1, "x" * LONG_TEXT), "c": Color.RED, "f": 0.5, "s": {"deep": ["y" * 5000]}},
        "z" * LONG_TEXT,
        7,
        # Either side of the depth limit: a member is checked at its depth in the payload.
        _nested(MAX_PAYLOAD_DEPTH - 3),
        _nested(MAX_PAYLOAD_DEPTH - 2),
    ],
)
def test_a_member_checked_alone_is_what_a_walk_of_its_payload_makes(member: Any) -> None:
    # An agent's payload is made by the SDK around members it does not own, each checked
    # alone (plain_member): the same copy, the same bytes, the same error.
    def whole() -> PlainRecord:
        return plain_record(Record(EP_A, "run", {"turn_index": 3, "state": member}))

    def alone() -> PlainRecord:
        return PlainRecord(
            EP_A, "run", {"turn_index": 3, "state": plain_member(EP_A, "run", "state", member)}
        )

    try:
        expected = whole()
    except UnserialisableRecordError as error:
        with pytest.raises(UnserialisableRecordError) as caught:
            alone()
        assert (caught.value.episode, caught.value.key, caught.value.location) == (
            error.episode,
            error.key,
            error.location,
        )
        return
    assert list(record_lines([alone()])) == list(record_lines([expected]))


@pytest.mark.parametrize(
    "state",
    [
        {"short": "x"},
        {"long": "y" * (KEPT_LINE_BYTES + 1)},
        {"long": 'quoted "' * LONG_TEXT, "also": "z" * LONG_TEXT},
    ],
)
def test_a_record_written_again_is_the_same_line_and_a_short_one_is_not_encoded_again(
    state: dict[str, Any],
) -> None:
    record = plain_record(Record(EP_A, "run", {"turn_index": 1, "state": state}))
    ((_, first),) = record_lines([record])
    ((_, second),) = record_lines([record])
    assert second == first
    assert json.loads(first)["payload"]["state"] == state
    # A short line is kept and written as it is; a long one is encoded again (its long
    # strings checked for escapes once).
    assert (second is first) is (len(first) <= KEPT_LINE_BYTES)


def test_too_deep_payload_is_unserialisable(tmp_path: Path) -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(200):
        node["d"] = {}
        node = node["d"]
    with pytest.raises(UnserialisableRecordError, match="nested deeper"):
        SnapshotStore(tmp_path).write(SNAP, INST, CKPT, [Record(EP_A, "k", deep)])


# --------------------------------------------------------------------------- damage


def written(tmp_path: Path) -> tuple[SnapshotStore, SnapshotEntry, Path]:
    store = SnapshotStore(tmp_path)
    entry = store.write(SNAP, INST, CKPT, sample_records())
    return store, entry, records_path(store, SNAP, entry.artifacts[0])


def refuses(
    store: SnapshotStore, kind: Corruption, expected: SnapshotEntry | ArtifactRef | None = None
) -> list[EpisodeId]:
    """Assert the read fails with ``kind``; return the episodes ``select`` was asked about."""
    asked: list[EpisodeId] = []

    def select(episode: EpisodeId) -> bool:
        asked.append(episode)
        return True

    with pytest.raises(CorruptSnapshotError) as caught:
        store.read(SNAP, INST, expected, select)
    assert caught.value.kind is kind, caught.value
    assert (caught.value.snapshot, caught.value.instance) == (SNAP, INST)
    return asked


def test_tampered_byte_is_caught_before_any_record_is_used(tmp_path: Path) -> None:
    store, entry, path = written(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert refuses(store, Corruption.DIGEST_MISMATCH, entry) == []


def test_truncated_records_file(tmp_path: Path) -> None:
    store, entry, path = written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    assert refuses(store, Corruption.SIZE_MISMATCH, entry) == []
    path.write_bytes(data + line())
    assert refuses(store, Corruption.SIZE_MISMATCH, entry) == []


def test_missing_files(tmp_path: Path) -> None:
    store, entry, path = written(tmp_path)
    path.unlink()
    refuses(store, Corruption.MISSING, entry)
    (store.instance_dir(SNAP, INST) / MANIFEST_NAME).unlink()
    refuses(store, Corruption.MISSING, entry)
    assert not store.exists(SNAP, INST)


def test_wrong_record_count(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    forge(store, line() + line(key="j"), record_count=3)
    assert refuses(store, Corruption.RECORD_COUNT_MISMATCH) == []


@pytest.mark.parametrize(
    "data",
    [
        line()[:-1],  # no final newline: ends mid-record
        b"{not json}\n",
        line(payload='{"a":1,"a":2}'),
        line(payload='{"x":NaN}'),
        line(payload="[1,2]"),
        line(rollout_id="../x"),
        line(key="a/b"),
        b'{"episode":{"rollout_id":"r","attempt":0},"key":"k","payload":{},"extra":1}\n',
        b'{"episode":{"rollout_id":"r","attempt":true},"key":"k","payload":{}}\n',
        b"\xff\xfe\n",
    ],
)
def test_malformed_record_with_matching_digest(tmp_path: Path, data: bytes) -> None:
    store = SnapshotStore(tmp_path)
    forge(store, data, record_count=max(data.count(b"\n"), 1))
    assert refuses(store, Corruption.RECORD_INVALID) == []


def test_episodes_in_manifest_must_match_the_records(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    forge(store, line("r") + line("s"), episodes=[{"rollout_id": "r", "attempt": 0}])
    assert refuses(store, Corruption.EPISODES_MISMATCH) == []


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        target: Any = document
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "kind"),
    [
        (_set(["comment"], "hi"), Corruption.MANIFEST_INVALID),
        (_set(["artifacts", 0, "extra"], 1), Corruption.MANIFEST_INVALID),
        (_set(["schema_version"], 2), Corruption.MANIFEST_INVALID),
        (_set(["instance"], "agent-9"), Corruption.MANIFEST_INVALID),
        (_set(["checkpoint_id"], "../x"), Corruption.MANIFEST_INVALID),
        (_set(["artifacts", 0, "sha256"], "AB" * 32), Corruption.MANIFEST_INVALID),
        (_set(["artifacts", 0, "sha256"], "ab" * 31), Corruption.MANIFEST_INVALID),
        (_set(["artifacts", 0, "size_bytes"], -1), Corruption.MANIFEST_INVALID),
        (_set(["artifacts", 0, "record_count"], "1"), Corruption.MANIFEST_INVALID),
        (_set(["artifacts"], []), Corruption.MANIFEST_INVALID),
        (_set(["episodes"], [{"rollout_id": "r", "attempt": 0}] * 2), Corruption.MANIFEST_INVALID),
        (_set(["artifacts", 0, "path"], "agent-0/other.jsonl"), Corruption.MANIFEST_INVALID),
        (_set(["artifacts", 0, "path"], "../../outside.jsonl"), Corruption.PATH_ESCAPE),
        (_set(["artifacts", 0, "path"], "/etc/passwd"), Corruption.PATH_ESCAPE),
        (_set(["artifacts", 0, "path"], "agent-1/records.jsonl"), Corruption.PATH_ESCAPE),
    ],
)
def test_manifest_is_parsed_strictly(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], kind: Corruption
) -> None:
    store = SnapshotStore(tmp_path)
    forge(store, line(), manifest_edit=edit)
    assert refuses(store, kind) == []


def test_manifest_with_duplicate_keys_is_invalid(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    forge(store, line())
    path = store.instance_dir(SNAP, INST) / MANIFEST_NAME
    path.write_text(path.read_text()[:-1] + ', "schema_version": 1}')
    refuses(store, Corruption.MANIFEST_INVALID)


def test_read_checks_what_the_caller_expects(tmp_path: Path) -> None:
    store, entry, _ = written(tmp_path)
    other = SnapshotStore(tmp_path / "other").write(SNAP, INST, CKPT, [Record(EP_A, "k", {})])
    refuses(store, Corruption.UNEXPECTED_CONTENT, other)
    refuses(store, Corruption.UNEXPECTED_CONTENT, other.manifest)
    with pytest.raises(CorruptSnapshotError) as caught:
        store.read(SNAP, INST, entry, checkpoint_id="ckpt-000000000002")
    assert caught.value.kind is Corruption.UNEXPECTED_CONTENT
    with pytest.raises(CorruptSnapshotError) as caught:
        store.read(SNAP, INST, entry.manifest, artifacts=other.artifacts)
    assert caught.value.kind is Corruption.UNEXPECTED_CONTENT


def test_a_consistent_rewrite_of_the_manifest_is_caught_by_its_reference(tmp_path: Path) -> None:
    store, entry, _ = written(tmp_path)
    path = store.instance_dir(SNAP, INST) / MANIFEST_NAME
    path.write_text(path.read_text().replace(CKPT, "ckpt-000000000009"))
    assert refuses(store, Corruption.UNEXPECTED_CONTENT, entry.manifest) == []


def test_select_keeps_chosen_records_but_verifies_the_whole_file(tmp_path: Path) -> None:
    store, entry, path = written(tmp_path)
    loaded = store.read(SNAP, INST, entry, lambda episode: episode.rollout_id == "rollout-b")
    assert [(r.episode, r.key) for r in loaded.records] == [(EP_B, "session"), (EP_B, "turn-1")]
    assert loaded.entry == entry

    # Damage a record of an episode nobody selects: the read still fails.
    data = path.read_bytes()
    index = data.index(b"rollout-c")
    path.write_bytes(data[:index] + b"rollout-x" + data[index + len(b"rollout-c") :])
    assert refuses(store, Corruption.DIGEST_MISMATCH, entry) == []


# --------------------------------------------------------------------------- publication


def test_manifest_is_never_replaced(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    entry = store.write(SNAP, INST, CKPT, sample_records())
    manifest = store.instance_dir(SNAP, INST) / MANIFEST_NAME
    before = (manifest.read_bytes(), manifest.stat().st_ino, listing(store))

    with pytest.raises(SnapshotConflictError) as caught:
        store.write(SNAP, INST, "ckpt-000000000002", [Record(EP_A, "k", {"v": 2})])
    assert caught.value.published_checkpoint_id == CKPT
    assert caught.value.checkpoint_id == "ckpt-000000000002"
    with pytest.raises(SnapshotConflictError):
        store.write(SNAP, INST, CKPT, [Record(EP_A, "k", {"v": 2})])  # same id, other content

    # The same write again (a retry after a lost reply) gets the published entry.
    assert store.write(SNAP, INST, CKPT, sample_records()) == entry
    assert (manifest.read_bytes(), manifest.stat().st_ino, listing(store)) == before
    assert store.read(SNAP, INST, entry).records == tuple(sample_records())


@pytest.mark.parametrize("same_checkpoint", [True, False])
def test_writer_that_loses_the_race_leaves_the_winner_untouched(
    tmp_path: Path, pool: ThreadPoolExecutor, release: threading.Event, same_checkpoint: bool
) -> None:
    # Two stores on one root behave like two processes; the loser is held inside its
    # records write (after its fast-path check) while the winner publishes.
    faults = StoreFaults()
    loser_store = SnapshotStore(tmp_path, faults=faults)
    winner_store = SnapshotStore(tmp_path)
    reached = faults.slow_write(release)
    loser_ckpt = CKPT if same_checkpoint else "ckpt-000000000002"
    loser = start(pool, lambda: loser_store.write(SNAP, INST, loser_ckpt, sample_records()))
    assert reached.wait(SAFETY_TIMEOUT)

    entry = winner_store.write(SNAP, INST, CKPT, sample_records())
    published = records_path(winner_store, SNAP, entry.artifacts[0])
    inode = published.stat().st_ino
    release.set()

    if same_checkpoint:
        assert loser.result(SAFETY_TIMEOUT) == entry
    else:
        with pytest.raises(SnapshotConflictError):
            loser.result(SAFETY_TIMEOUT)
    assert listing(winner_store) == {MANIFEST_NAME, published.name}
    assert published.stat().st_ino == inode
    assert winner_store.read(SNAP, INST, entry).records == tuple(sample_records())


@pytest.mark.parametrize("same_records", [False, True])
def test_racing_writers_publish_exactly_once(
    tmp_path: Path, pool: ThreadPoolExecutor, same_records: bool
) -> None:
    # With the same records every writer produces the same digest-named file, so a
    # loser that cleaned up carelessly would delete the file the winner's manifest names.
    writers = 8
    for round_number in range(5):
        instance = f"agent-{round_number}"
        barrier = threading.Barrier(writers)
        stores = [SnapshotStore(tmp_path) for _ in range(writers)]

        def write(
            index: int,
            store: SnapshotStore,
            instance: str = instance,
            barrier: threading.Barrier = barrier,
        ) -> SnapshotEntry:
            records = [Record(EP_A, "turn-1", {"writer": 0 if same_records else index})]
            barrier.wait(SAFETY_TIMEOUT)
            return store.write(SNAP, instance, f"ckpt-{index:012d}", records)

        futures = [pool.submit(write, i, store) for i, store in enumerate(stores)]
        entries = []
        for future in futures:
            with contextlib.suppress(SnapshotConflictError):
                entries.append(future.result(SAFETY_TIMEOUT))
        assert len(entries) == 1
        (winner,) = entries
        assert set(os.listdir(tmp_path / SNAP / instance)) == {
            MANIFEST_NAME,
            f"records-{winner.artifacts[0].sha256}.jsonl",
        }
        (record,) = stores[0].read(SNAP, instance, winner).records
        if not same_records:
            assert f"ckpt-{record.payload['writer']:012d}" == winner.checkpoint_id


def test_racing_identical_writers_all_get_the_published_entry(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    writers = 8
    barrier = threading.Barrier(writers)

    def write() -> SnapshotEntry:
        barrier.wait(SAFETY_TIMEOUT)
        return SnapshotStore(tmp_path).write(SNAP, INST, CKPT, sample_records())

    entries = {f.result(SAFETY_TIMEOUT) for f in [pool.submit(write) for _ in range(writers)]}
    assert len(entries) == 1
    (entry,) = entries
    assert listing(SnapshotStore(tmp_path)) == {
        MANIFEST_NAME,
        f"records-{entry.artifacts[0].sha256}.jsonl",
    }


def test_a_manifest_planted_during_publication_is_not_replaced(
    tmp_path: Path, pool: ThreadPoolExecutor, release: threading.Event
) -> None:
    # A writer that ignores the directory lock (another tool, another version) creates
    # its manifest while ours is publishing: ours must fail rather than replace it.
    faults = StoreFaults()
    store = SnapshotStore(tmp_path / "root", faults=faults)
    reached = faults.block_at(FaultPoint.MANIFEST_WRITE, release)
    writing = start(pool, lambda: store.write(SNAP, INST, CKPT, sample_records()))
    assert reached.wait(SAFETY_TIMEOUT)

    other = SnapshotStore(tmp_path / "other")
    planted = other.write(SNAP, INST, "ckpt-000000000002", [Record(EP_A, "k", {"v": 2})])
    for name in os.listdir(other.instance_dir(SNAP, INST)):
        (store.instance_dir(SNAP, INST) / name).write_bytes(
            (other.instance_dir(SNAP, INST) / name).read_bytes()
        )
    release.set()
    with pytest.raises(SnapshotConflictError):
        writing.result(SAFETY_TIMEOUT)
    assert listing(store) == {MANIFEST_NAME, f"records-{planted.artifacts[0].sha256}.jsonl"}
    assert store.read(SNAP, INST, planted).records == (Record(EP_A, "k", {"v": 2}),)


def test_leftovers_of_a_dead_writer_are_replaced_before_publishing(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    directory = store.instance_dir(SNAP, INST)
    directory.mkdir(parents=True)
    stale = directory / f"records-{'0' * 64}.jsonl"
    stale.write_bytes(b"half a file")
    entry = store.write(SNAP, INST, CKPT, sample_records())
    assert listing(store) == {MANIFEST_NAME, f"records-{entry.artifacts[0].sha256}.jsonl"}


# --------------------------------------------------------------------------- cancellation


def test_cancel_before_the_write_starts(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "root")
    ticket = WriteTicket()
    assert ticket.cancel() is WriteState.CANCELLED
    with pytest.raises(WriteCancelled) as caught:
        store.write(SNAP, INST, CKPT, sample_records(), ticket=ticket)
    assert caught.value.checkpoint_id == CKPT
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("point", [FaultPoint.RECORDS_WRITE, FaultPoint.PUBLISH])
def test_cancel_before_publication_leaves_nothing(
    tmp_path: Path, pool: ThreadPoolExecutor, release: threading.Event, point: FaultPoint
) -> None:
    faults = StoreFaults()
    store = SnapshotStore(tmp_path, faults=faults)
    reached = faults.block_at(point, release)
    ticket = WriteTicket()
    writing = start(pool, lambda: store.write(SNAP, INST, CKPT, sample_records(), ticket=ticket))
    assert reached.wait(SAFETY_TIMEOUT)
    if point is FaultPoint.PUBLISH:
        # The records are durable under their digest name at this point.
        assert any(name.startswith("records-") for name in listing(store))

    assert ticket.cancel() is WriteState.CANCELLED
    release.set()
    with pytest.raises(WriteCancelled):
        writing.result(SAFETY_TIMEOUT)
    assert ticket.state is WriteState.CANCELLED
    assert listing(store) == set()
    assert not store.exists(SNAP, INST)
    # The directory stays writable: the next checkpoint's write publishes normally.
    assert store.write(SNAP, INST, CKPT, sample_records()).checkpoint_id == CKPT


def test_cancel_during_publication_waits_for_it(
    tmp_path: Path, pool: ThreadPoolExecutor, release: threading.Event
) -> None:
    faults = StoreFaults()
    store = SnapshotStore(tmp_path, faults=faults)
    reached = faults.block_at(FaultPoint.MANIFEST_WRITE, release)
    ticket = WriteTicket()
    writing = start(pool, lambda: store.write(SNAP, INST, CKPT, sample_records(), ticket=ticket))
    assert reached.wait(SAFETY_TIMEOUT)

    assert ticket.cancel() is WriteState.PUBLISHING
    assert ticket.state is WriteState.PUBLISHING
    assert not store.exists(SNAP, INST)
    release.set()
    assert ticket.wait(SAFETY_TIMEOUT) is WriteState.PUBLISHED
    assert store.exists(SNAP, INST)
    entry = writing.result(SAFETY_TIMEOUT)
    assert store.read(SNAP, INST, entry).records == tuple(sample_records())
    assert ticket.cancel() is WriteState.PUBLISHED


def test_a_ticket_serves_one_write(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    ticket = WriteTicket()
    store.write(SNAP, INST, CKPT, sample_records(), ticket=ticket)
    assert ticket.state is WriteState.PUBLISHED
    with pytest.raises(ValueError, match="exactly one write"):
        store.write(SNAP, "agent-1", CKPT, sample_records(), ticket=ticket)
    assert ticket.state is WriteState.PUBLISHED


# --------------------------------------------------------------------------- faults


def test_full_disk_leaves_nothing_and_a_retry_writes_the_same_digest(tmp_path: Path) -> None:
    faults = StoreFaults()
    store = SnapshotStore(tmp_path / "root", faults=faults)
    faults.fail_writes(1, errno.ENOSPC)
    ticket = WriteTicket()
    with pytest.raises(OSError) as caught:
        store.write(SNAP, INST, CKPT, sample_records(), ticket=ticket)
    assert caught.value.errno == errno.ENOSPC
    assert ticket.state is WriteState.FAILED
    assert ticket.cancel() is WriteState.FAILED
    assert listing(store) == set()
    assert not store.exists(SNAP, INST)

    entry = store.write(SNAP, INST, CKPT, sample_records())
    clean = SnapshotStore(tmp_path / "clean").write(SNAP, INST, CKPT, sample_records())
    assert entry == clean
    assert faults.hits(FaultPoint.RECORDS_WRITE) == 2


@pytest.mark.parametrize("point", [FaultPoint.PUBLISH, FaultPoint.MANIFEST_WRITE])
def test_failure_late_in_the_write_leaves_nothing(tmp_path: Path, point: FaultPoint) -> None:
    faults = StoreFaults()
    store = SnapshotStore(tmp_path, faults=faults)
    faults.fail_at(point, 1, errno.EIO)
    with pytest.raises(OSError) as caught:
        store.write(SNAP, INST, CKPT, sample_records())
    assert caught.value.errno == errno.EIO
    assert listing(store) == set()
    assert store.write(SNAP, INST, CKPT, sample_records()).checkpoint_id == CKPT


def test_faults_from_a_spec_string(tmp_path: Path) -> None:
    faults = StoreFaults.from_spec("records_write:1:EDQUOT, manifest_write:1")
    store = SnapshotStore(tmp_path, faults=faults)
    with pytest.raises(OSError) as caught:
        store.write(SNAP, INST, CKPT, sample_records())
    assert caught.value.errno == errno.EDQUOT
    with pytest.raises(OSError) as caught:
        store.write(SNAP, INST, CKPT, sample_records())
    assert caught.value.errno == errno.ENOSPC
    store.write(SNAP, INST, CKPT, sample_records())
    for bad in ["nowhere:1", "records_write", "records_write:x", "records_write:1:NOPE"]:
        with pytest.raises(ValueError):
            StoreFaults.from_spec(bad)


# --------------------------------------------------------------------------- paths


BAD_IDS = ["../x", ".hidden", "a/b", "..", "", "/abs", "x" * 129]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_bad_ids_are_rejected_before_touching_disk(tmp_path: Path, bad: str) -> None:
    root = tmp_path / "root"
    store = SnapshotStore(root)
    attempts: list[Callable[[], object]] = [
        lambda: store.write(bad, INST, CKPT, sample_records()),
        lambda: store.write(SNAP, bad, CKPT, sample_records()),
        lambda: store.write(SNAP, INST, bad, sample_records()),
        lambda: store.read(bad, INST, None),
        lambda: store.read(SNAP, bad, None),
        lambda: store.exists(bad, INST),
        lambda: store.exists(SNAP, bad),
        lambda: store.delete_snapshot_dir(bad),
    ]
    for attempt in attempts:
        with pytest.raises(InvalidIdError):
            attempt()
    assert not root.exists()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_symlink_under_the_root_cannot_lead_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / SNAP).symlink_to(outside, target_is_directory=True)
    store = SnapshotStore(root)
    with pytest.raises(CorruptSnapshotError) as caught:
        store.write(SNAP, INST, CKPT, sample_records())
    assert caught.value.kind is Corruption.PATH_ESCAPE
    with pytest.raises(CorruptSnapshotError):
        store.read(SNAP, INST, None)
    assert os.listdir(outside) == []


def test_a_symlinked_instance_directory_cannot_lead_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / SNAP).mkdir(parents=True)
    outside.mkdir()
    (root / SNAP / INST).symlink_to(outside, target_is_directory=True)
    store = SnapshotStore(root)
    with pytest.raises(CorruptSnapshotError) as caught:
        store.write(SNAP, INST, CKPT, sample_records())
    assert caught.value.kind is Corruption.PATH_ESCAPE
    assert os.listdir(outside) == []


def test_a_symlinked_root_is_where_the_snapshots_go(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "root").symlink_to(real, target_is_directory=True)
    store = SnapshotStore(tmp_path / "root")
    store.write(SNAP, INST, CKPT, sample_records())
    assert store.read(SNAP, INST, None)
    assert (real / SNAP / INST).is_dir()


def test_a_symlinked_records_file_is_refused(tmp_path: Path) -> None:
    store, entry, path = written(tmp_path / "root")
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)
    refuses(store, Corruption.PATH_ESCAPE, entry)


def test_delete_snapshot_dir(tmp_path: Path) -> None:
    store, _, _ = written(tmp_path)
    store.write(SNAP, "agent-1", CKPT, sample_records())
    assert store.delete_snapshot_dir(SNAP) is True
    assert not (tmp_path / SNAP).exists()
    assert store.delete_snapshot_dir(SNAP) is False


def test_artifact_refs_validate_themselves() -> None:
    good = ArtifactRef(f"{INST}/records-{'a' * 64}.jsonl", "a" * 64, 10, 1)
    assert good.size_bytes == 10
    for path, sha256, size, count in [
        ("../records.jsonl", "a" * 64, 1, 1),
        ("/abs/x", "a" * 64, 1, 1),
        ("a/b/c", "a" * 64, 1, 1),
        ("agent-0/x", "A" * 64, 1, 1),
        ("agent-0/x", "a" * 63, 1, 1),
        ("agent-0/x", "a" * 64, -1, 1),
        ("agent-0/x", "a" * 64, 1, True),
    ]:
        with pytest.raises(ValueError):
            ArtifactRef(path, sha256, size, count)


class _Level(enum.IntEnum):
    HIGH = 3


class _Text(str):
    pass


def test_this_python_s_c_encoder_is_made_once_and_used() -> None:
    """The writer makes its C encoder once per file, not once per record as
    ``JSONEncoder.encode`` does: on the CPython the project runs on, that encoder takes
    the arguments given and writes what ``JSONEncoder`` does."""
    assert _store_format._c_encoder_works()
    assert _store_format._C_ENCODER


@pytest.mark.parametrize("c_encoder", [True, False], ids=["c-encoder", "json-encoder"])
def test_each_record_line_is_the_compact_ascii_json_of_its_three_fields(
    c_encoder: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/spec.md section 8.2 item 3: what the writer builds line by line (without a
    dict per line) is exactly the compact ASCII JSON of episode, key and payload, with
    the C encoder made once or (a Python whose C encoder differs) ``JSONEncoder``."""
    monkeypatch.setattr(_store_format, "_C_ENCODER", c_encoder)
    payloads: list[dict[str, Any]] = [
        {},
        {"text": 'quote " backslash \\ newline \n unicode \u00fc \u2028 \U0001f600'},
        {"n": [1, -2.5, 1e-07, 2**70, True, None, _Level.HIGH], "t": ("a", {"b": []})},
        {"z": 1, "a": {"nested": {"deep": "x" * 3000}}},
        # Long strings are checked for what JSON escapes and copied when nothing needs it;
        # each of these has exactly one character that does, at its end.
        {
            "hex": os.urandom(2048).hex(),
            "long": ["a" * 5000 + tail for tail in ('"', "\\", "\n", "\x1f", "\x7f", "\u00e9")],
            "x" * 2000: _Text("b" * 3000),
            "in a list": [os.urandom(1024).hex(), 1.5, [os.urandom(600).hex()]],
        },
        # A long string copied as it is stands in the encoder's output for a moment as
        # the escaped string "\x00": payloads that hold that string (or an escape that
        # looks like it) beside long strings must come out the same.
        {"a": "c" * 2000, "b": "\x00", "d": ["e" * 1500, '"\x00', "\x00\x00"]},
        {"\x00": "f" * 4000, "g": {"\x00": "\x00"}, "h": "i" * 1024},
        {"j": "k" * 1024, "l": "\u0000", "m": "\\u0000", "n": "o" * 1023},
    ]
    records = [
        Record(EpisodeId(rollout, attempt), key, payload)
        for (rollout, attempt, key), payload in zip(
            (
                ("r-1", 0, "run"),
                ("R.2_x", 7, "turn-3"),
                ("9", 12, "a.b"),
                ("r-1", 1, "s"),
                ("long", 0, "state"),
                ("nul", 0, "state"),
                ("nul", 1, "state"),
                ("nul", 2, "state"),
            ),
            payloads,
            strict=True,
        )
    ]
    data, ref, episodes = encode_records("inst", records)
    expected = "".join(
        json.dumps(
            {
                "episode": {"rollout_id": r.episode.rollout_id, "attempt": r.episode.attempt},
                "key": r.key,
                "payload": r.payload,
            },
            ensure_ascii=True,
            separators=(",", ":"),
        )
        + "\n"
        for r in records
    ).encode("ascii")
    assert data == expected
    assert ref.sha256 == hashlib.sha256(data).hexdigest() and ref.record_count == 8
    assert episodes == tuple(sorted(r.episode for r in records))


@pytest.mark.parametrize("count", [0, 1, 3])
def test_a_manifest_is_the_indented_json_of_its_fields(count: int) -> None:
    """docs/spec.md section 8.3: what the writer builds without a dict per episode is
    exactly ``json.dumps(..., indent=2)`` of the manifest's fields."""
    episodes = tuple(EpisodeId(f"r-{k}.x_{k}", k * 7) for k in range(count))
    refs = (ArtifactRef(f"{INST}/records-{'a' * 64}.jsonl", "a" * 64, 123, count),)
    manifest = Manifest(CKPT, INST, refs if count else (), episodes)
    document = {
        "schema_version": 1,
        "checkpoint_id": CKPT,
        "instance": INST,
        "artifacts": [
            {"path": r.path, "sha256": r.sha256, "size_bytes": 123, "record_count": count}
            for r in manifest.artifacts
        ],
        "episodes": [{"rollout_id": e.rollout_id, "attempt": e.attempt} for e in episodes],
    }
    expected = json.dumps(document, indent=2, ensure_ascii=True) + "\n"
    assert manifest.to_bytes() == expected.encode("ascii")


def test_the_records_file_is_never_whole_in_memory(tmp_path: Path) -> None:
    """The lines go to the file as they are encoded: what a write allocates is a few
    lines, not the file (once as text and once as bytes, as it was)."""
    records = [
        Record(EpisodeId(f"r-{k}", 0), "state", {"hex": os.urandom(8192).hex()}) for k in range(300)
    ]
    tracemalloc.start()
    try:
        entry = SnapshotStore(tmp_path).write(SNAP, INST, CKPT, records)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = entry.artifacts[0].size_bytes
    assert size > 4 << 20 and peak < size // 8
    loaded = SnapshotStore(tmp_path).read(SNAP, INST, entry)
    assert [r.payload for r in loaded.records] == [r.payload for r in records]
