"""The storage interface, the same suite over a directory, a shared mount and S3 (moto).

docs/spec.md section 8.12.
"""

from __future__ import annotations

import pytest

from tests.support.storage import fail_next_puts, make_bucket
from turnpoint.storage import (
    ObjectExistsError,
    ObjectInfo,
    ObjectMissingError,
    Storage,
    StorageAccessError,
    TransientStorageError,
    open_storage,
)


def test_put_get_list_delete(storage: Storage) -> None:
    storage.put("c-1/agent/records-a.jsonl", b"one\n")
    storage.put("c-1/agent/MANIFEST.json", b"{}\n")
    storage.put("c-2/LATEST", b"x")
    assert storage.get("c-1/agent/records-a.jsonl") == b"one\n"
    assert storage.list("c-1/") == [
        ObjectInfo("c-1/agent/MANIFEST.json", 3),
        ObjectInfo("c-1/agent/records-a.jsonl", 4),
    ]
    assert [info.key for info in storage.list()] == [
        "c-1/agent/MANIFEST.json",
        "c-1/agent/records-a.jsonl",
        "c-2/LATEST",
    ]
    assert storage.size("c-2/LATEST") == 1
    assert storage.delete("c-2/LATEST") is True
    assert storage.delete("c-2/LATEST") is False
    assert storage.size("c-2/LATEST") is None
    with pytest.raises(ObjectMissingError) as missing:
        storage.get("c-2/LATEST")
    assert missing.value.key == "c-2/LATEST"


def test_put_replaces_and_create_never_does(storage: Storage) -> None:
    storage.put("LATEST", b"old")
    storage.put("LATEST", b"new")
    assert storage.get("LATEST") == b"new"
    storage.create("c-1/MANIFEST.json", b"first")
    with pytest.raises(ObjectExistsError):
        storage.create("c-1/MANIFEST.json", b"second")
    assert storage.get("c-1/MANIFEST.json") == b"first"


def test_get_with_a_limit_reads_one_byte_more_at_most(storage: Storage) -> None:
    storage.put("blob", b"0123456789")
    assert storage.get("blob", limit=3) == b"0123"
    assert storage.get("blob", limit=100) == b"0123456789"


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", ".hidden", "a/"])
def test_a_key_is_ids_only(storage: Storage, key: str) -> None:
    with pytest.raises(ValueError, match="storage key"):
        storage.put(key, b"x")


def test_urls() -> None:
    assert open_storage("/tmp/x").url == "file:///tmp/x"
    assert open_storage("file:///tmp/x?mount=shared").url == "file:///tmp/x?mount=shared"
    with pytest.raises(ValueError, match="file:// or s3://"):
        open_storage("gs://bucket/x")
    with pytest.raises(ValueError, match="without credentials") as error:
        open_storage("s3://AKIA:secret@bucket/x")
    assert "secret" not in str(error.value)
    with pytest.raises(ValueError, match="the only option is mount"):
        open_storage("file:///tmp/x?mount=nfs")


def test_a_failing_put_is_retried_then_typed_transient(moto_endpoint: str) -> None:
    storage = open_storage(f"s3://{make_bucket(moto_endpoint)}/p")
    failed = fail_next_puts(storage, 1)
    storage.put("a", b"x")  # boto3's standard retry absorbs one 503
    assert failed.failed == 1
    failed.stop()
    assert storage.get("a") == b"x"
    failed = fail_next_puts(storage, 100)
    with pytest.raises(TransientStorageError) as error:
        storage.put("b", b"y")
    assert error.value.transient
    assert storage.size("b") is None


def test_refused_credentials_are_a_clear_error_at_check(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moto import settings

    bucket = make_bucket(moto_endpoint)
    # moto checks signatures against its IAM users once this count is used up.
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNUNKNOWN00")
    storage = open_storage(f"s3://{bucket}/p")
    with pytest.raises(StorageAccessError) as error:
        storage.check()
    assert not error.value.transient
    assert "refused" in error.value.message


def test_a_missing_bucket_is_a_clear_error_at_check(moto_endpoint: str) -> None:
    with pytest.raises(StorageAccessError):
        open_storage("s3://no-such-bucket-here/p").check()


def test_bench_storage_prints_both_storages_and_their_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from turnpoint.apps._cli import main

    assert main(["bench-storage", "--sizes", "2", "--records", "2", "--anchor-mib", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:4]]
    assert [row[:2] for row in rows] == [["2", "local"], ["2", "s3"]]
    # The torch DCP anchor on both: DCP's two files (metadata, one shard) as two objects,
    # the same bytes, and the store's write and load as ratios over local disk.
    assert lines[4] == "" and "torch DCP anchor" in lines[5]
    anchor_rows = [line.split() for line in lines[7:]]
    assert [row[0] for row in anchor_rows] == ["local", "s3"]
    assert anchor_rows[0][3] == anchor_rows[1][3] == "2"
    assert anchor_rows[0][4] == anchor_rows[1][4] and float(anchor_rows[1][4]) > 0.9
    assert len(anchor_rows[1]) == 7
    # Same snapshot on both: 2 records + 2 manifests, the anchor, the manifest, LATEST.
    assert rows[0][8] == rows[1][8] == "7"
    # commit, publish and the publication's four phases, objects, MiB and two ratios.
    assert len(rows[1]) == 12
    verify, anchor, manifest, latest = (float(value) for value in rows[1][4:8])
    # Parts of the publication, each printed to the millisecond.
    assert verify + anchor + manifest + latest <= float(rows[1][3]) + 0.005
