"""The core's durable writes (turnpoint._files), strict JSON reader and indented JSON
writer (turnpoint._json).

Every writer and reader of the project goes through these, so what they promise is
checked here once: a failed write leaves no temporary file and the old content, an
exclusive create never replaces, strict JSON refuses what the stdlib would guess at, and
the indented writer writes what the stdlib writes.
"""

from __future__ import annotations

import enum
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fsyncs import record_fsyncs
from turnpoint._files import (
    CHUNK_BYTES,
    create_file,
    fsync_tree,
    replace_file,
    write_new,
    write_temp,
)
from turnpoint._json import (
    FlatObjects,
    JSONProblem,
    StrictJSONError,
    dumps_indented,
    loads_strict,
)


class _Crash(Exception):
    """Stands in for the process dying at a named point."""


def _names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def _umasked(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def _disk_full(path: Path) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# ---------------------------------------------------------------------- writing


def test_write_temp_is_hidden_complete_and_has_the_mode(tmp_path: Path) -> None:
    path = write_temp(tmp_path, ".records-", b"abc", mode=0o600)
    assert path.parent == tmp_path
    assert path.name.startswith(".records-") and path.name.endswith(".tmp")
    assert len(path.name) == len(".records-") + 16 + len(".tmp")
    assert path.read_bytes() == b"abc"
    assert stat.S_IMODE(path.stat().st_mode) == _umasked(0o600)


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    with pytest.raises(OSError) as caught:
        write_temp(tmp_path, ".records-", b"x" * 10, before_chunk=_disk_full)
    assert caught.value.errno == errno.ENOSPC
    assert _names(tmp_path) == []


def test_before_chunk_runs_per_chunk_and_once_for_empty_data(tmp_path: Path) -> None:
    seen: list[Path] = []
    path = write_temp(tmp_path, ".t-", b"x" * (2 * CHUNK_BYTES + 1), before_chunk=seen.append)
    assert seen == [path] * 3
    seen.clear()
    path = write_temp(tmp_path, ".t-", b"", before_chunk=seen.append)
    assert seen == [path] and path.read_bytes() == b""


def test_a_failure_after_some_chunks_leaves_nothing(tmp_path: Path) -> None:
    calls = 0

    def fail_second(path: Path) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise _Crash("cancelled mid-write")

    with pytest.raises(_Crash):
        write_temp(tmp_path, ".t-", b"x" * (CHUNK_BYTES + 1), before_chunk=fail_second)
    assert _names(tmp_path) == []


def test_pieces_are_written_in_order_as_they_are_made(tmp_path: Path) -> None:
    def line(n: int) -> bytes:
        return f"line {n} ".encode() * (n % 7 + 1) + b"\n"

    on_disk_before_the_last: list[int] = []

    def pieces() -> Iterator[bytes]:
        for n in range(3000):
            if n == 2999:
                # The file is written as the pieces come, not once they are all made.
                (temp,) = tmp_path.iterdir()
                on_disk_before_the_last.append(temp.stat().st_size)
            yield line(n)

    path = write_temp(tmp_path, ".t-", pieces())
    assert path.read_bytes() == b"".join(line(n) for n in range(3000))
    assert on_disk_before_the_last[0] > 0


def test_before_chunk_runs_again_after_each_chunk_of_pieces_and_once_for_none(
    tmp_path: Path,
) -> None:
    seen: list[Path] = []
    piece = b"y" * 4096
    count = 2 * CHUNK_BYTES // len(piece) + 1
    path = write_temp(tmp_path, ".t-", (piece for _ in range(count)), before_chunk=seen.append)
    assert path.read_bytes() == piece * count
    assert seen == [path] * 3
    seen.clear()
    path = write_temp(tmp_path, ".t-", iter(()), before_chunk=seen.append)
    assert seen == [path] and path.read_bytes() == b""


def test_a_failure_while_making_pieces_leaves_nothing(tmp_path: Path) -> None:
    def pieces() -> Iterator[bytes]:
        for _ in range(100):
            yield b"z" * 100_000
        raise _Crash("the encoder failed half way")

    with pytest.raises(_Crash):
        write_temp(tmp_path, ".t-", pieces())
    assert _names(tmp_path) == []


def test_a_short_writev_is_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev

    def short(fd: int, buffers: list[bytes]) -> int:
        # The kernel may write less than asked (a signal, a full disk about to fail).
        return real(fd, [bytes(buffers[0])[:3]])

    monkeypatch.setattr(os, "writev", short)
    pieces = [b"abcdef", b"ghij", b"k" * 70_000, b"lmn"]
    path = write_temp(tmp_path, ".t-", iter(pieces))
    assert path.read_bytes() == b"".join(pieces)


def test_write_new_refuses_an_existing_name_and_leaves_it_alone(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.write_bytes(b"theirs")
    with pytest.raises(FileExistsError):
        write_new(theirs, b"ours")
    assert theirs.read_bytes() == b"theirs"


def test_replace_file_replaces_atomically(tmp_path: Path) -> None:
    target = tmp_path / "LATEST"
    replace_file(target, b"one\n", temp_prefix=".LATEST-")
    replace_file(target, b"two\n", temp_prefix=".LATEST-")
    assert target.read_bytes() == b"two\n"
    assert _names(tmp_path) == ["LATEST"]


def test_a_failed_replace_keeps_the_old_content_and_no_temporary_file(tmp_path: Path) -> None:
    # A non-empty directory under the name makes the rename itself fail.
    target = tmp_path / "pointer"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(OSError):
        replace_file(target, b"new", temp_prefix=".pointer-")
    assert _names(tmp_path) == ["pointer"]
    assert _names(target) == ["keep"]


def test_a_crash_between_staging_and_rename_leaves_only_the_temporary_file(
    tmp_path: Path,
) -> None:
    target = tmp_path / "LATEST"
    target.write_bytes(b"old\n")

    def crash() -> None:
        raise _Crash("staged")

    with pytest.raises(_Crash):
        replace_file(target, b"new\n", temp_prefix=".LATEST-", staged=crash)
    assert target.read_bytes() == b"old\n"
    leftovers = [name for name in _names(tmp_path) if name != "LATEST"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".LATEST-")


def test_create_file_creates_whole_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "MANIFEST.json"
    steps: list[str] = []
    create_file(
        target,
        b"{}\n",
        temp_prefix=".manifest-",
        mode=0o644,
        staged=lambda: steps.append("staged"),
        linked=lambda: steps.append("linked" if target.exists() else "not linked"),
    )
    assert steps == ["staged", "linked"]
    assert target.read_bytes() == b"{}\n"
    assert stat.S_IMODE(target.stat().st_mode) == _umasked(0o644)
    assert _names(tmp_path) == ["MANIFEST.json"]


def test_create_file_refuses_an_existing_name(tmp_path: Path) -> None:
    target = tmp_path / "MANIFEST.json"
    target.write_bytes(b"winner")
    with pytest.raises(FileExistsError):
        create_file(target, b"loser", temp_prefix=".manifest-")
    assert target.read_bytes() == b"winner"
    assert _names(tmp_path) == ["MANIFEST.json"]


def test_create_file_stages_in_another_directory(tmp_path: Path) -> None:
    snapshot = tmp_path / "ckpt-1"
    snapshot.mkdir()
    create_file(snapshot / "MANIFEST.json", b"m", temp_prefix=".MANIFEST-", temp_dir=tmp_path)
    assert (snapshot / "MANIFEST.json").read_bytes() == b"m"
    assert _names(tmp_path) == ["ckpt-1"]
    assert _names(snapshot) == ["MANIFEST.json"]


def test_a_failed_create_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "MANIFEST.json"
    with pytest.raises(OSError):
        create_file(target, b"m", temp_prefix=".manifest-", before_chunk=_disk_full)
    assert _names(tmp_path) == []


def test_fsync_tree_syncs_files_and_skips_symlinks(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"1")
    (tmp_path / "link").symlink_to("/nonexistent")
    fsync_tree(tmp_path)  # a followed dangling symlink would raise


def test_fsync_tree_syncs_each_entry_once_children_before_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a/b/f", "a/g", "c/h", "top"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"1")
    synced = record_fsyncs(monkeypatch)
    fsync_tree(tmp_path)
    expected = {str(tmp_path / n) for n in ("a/b/f", "a/b", "a/g", "a", "c/h", "c", "top")}
    assert sorted(synced) == sorted(expected | {str(tmp_path)})
    for path in synced:  # a directory comes after everything it holds
        parent = os.path.dirname(path)
        if parent in synced:
            assert synced.index(parent) > synced.index(path)


def test_fsync_tree_leaves_a_durable_subtree_alone_but_syncs_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "anchor" / "deep").mkdir(parents=True)
    (tmp_path / "anchor" / "deep" / "w").write_bytes(b"1")
    (tmp_path / "anchor" / "m").write_bytes(b"1")
    (tmp_path / "other").write_bytes(b"1")
    synced = record_fsyncs(monkeypatch)
    fsync_tree(tmp_path, durable=tmp_path / "x" / ".." / "anchor")
    assert sorted(synced) == sorted([str(tmp_path / "other"), str(tmp_path)])


# ---------------------------------------------------------------------- strict JSON


def test_strict_json_parses_plain_json_and_keeps_key_order() -> None:
    value = loads_strict('{"b": 1, "a": [1.5, "x", null, true, {"c": {}}]}')
    assert value == {"b": 1, "a": [1.5, "x", None, True, {"c": {}}]}
    assert list(value) == ["b", "a"]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"a": 1, "a": 2}', "a"),
        ('{"x": {"k": 1, "j": 2, "k": 3}}', "k"),
        ('[{"ok": 1}, {"d": 1, "d": 1}]', "d"),
    ],
)
def test_strict_json_rejects_duplicate_keys(text: str, key: str) -> None:
    with pytest.raises(StrictJSONError) as caught:
        loads_strict(text)
    assert caught.value.problem is JSONProblem.DUPLICATE_KEY
    assert caught.value.key == key
    assert str(caught.value) == f"JSON key {key!r} appears twice in one object"
    assert json.loads(text)  # the stdlib would have kept the last value silently


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_strict_json_rejects_non_finite_numbers(constant: str) -> None:
    with pytest.raises(StrictJSONError) as caught:
        loads_strict(f'{{"x": [1, {constant}]}}')
    assert caught.value.problem is JSONProblem.CONSTANT
    assert caught.value.constant == constant
    assert str(caught.value) == f"{constant} is not a JSON number"


def test_strict_json_reports_syntax_with_its_position() -> None:
    with pytest.raises(StrictJSONError) as caught:
        loads_strict('{"a": }')
    assert caught.value.problem is JSONProblem.SYNTAX
    assert "line 1 column 7" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_strict_json_refuses_nesting_that_would_exhaust_the_stack() -> None:
    with pytest.raises(StrictJSONError) as caught:
        loads_strict("[" * 100_000 + "]" * 100_000)
    assert caught.value.problem is JSONProblem.TOO_DEEP
    assert str(caught.value) == "nested too deeply"


# ------------------------------------------------------------------ indented writer


def _stdlib(value: object, sort_keys: bool) -> str:
    return json.dumps(value, indent=2, ensure_ascii=True, allow_nan=False, sort_keys=sort_keys)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=8), children, max_size=5)
        | st.lists(children, max_size=3).map(tuple)
    ),
    max_leaves=40,
)


@given(value=_json_values, sort_keys=st.booleans())
def test_dumps_indented_writes_what_the_stdlib_writes(value: object, sort_keys: bool) -> None:
    assert dumps_indented(value, sort_keys=sort_keys) == _stdlib(value, sort_keys)


_flat_members = st.text() | st.integers()


@given(
    keys=st.lists(st.text(max_size=6), min_size=1, max_size=4, unique=True),
    data=st.data(),
    depth=st.integers(0, 3),
)
def test_flat_objects_are_written_as_the_list_of_their_dicts(
    keys: list[str], data: st.DataObject, depth: int
) -> None:
    rows = data.draw(st.lists(st.tuples(*[_flat_members] * len(keys)), max_size=5))
    dicts = [dict(zip(keys, row, strict=True)) for row in rows]
    # At any depth, as a list member and as an object member.
    flat: object = [FlatObjects(tuple(keys), rows), {"k": FlatObjects(tuple(keys), rows)}]
    plain: object = [dicts, {"k": dicts}]
    for _ in range(depth):
        flat, plain = {"d": [flat]}, {"d": [plain]}
    assert dumps_indented(flat) == _stdlib(plain, sort_keys=False)


def test_flat_objects_refuse_what_is_not_flat() -> None:
    with pytest.raises(TypeError, match="not bool"):
        dumps_indented(FlatObjects(("a",), [(True,)]))
    with pytest.raises(ValueError, match="members"):
        dumps_indented(FlatObjects(("a", "b"), [("x",)]))


class _Count(enum.IntEnum):
    TWO = 2


class _Kind(enum.StrEnum):
    AGENT = "AGENT"


class _Mapping(dict[str, Any]):
    pass


@pytest.mark.parametrize("sort_keys", [False, True])
def test_dumps_indented_matches_the_stdlib_on_subclasses_and_odd_keys(sort_keys: bool) -> None:
    value = {
        "count": _Count.TWO,
        "kind": _Kind.AGENT,
        "nested": _Mapping(b=[1.5, -0.0, 1e300], a={}),
        "unicode": 'naïve \u2603 \U0001f600 "quoted"\n',
        "empty": [[], {}, ()],
    }
    assert dumps_indented(value, sort_keys=sort_keys) == _stdlib(value, sort_keys)
    odd_keys = {7: "int", 2.5: "float", None: "null", True: "true", False: "false"}
    assert dumps_indented(odd_keys) == _stdlib(odd_keys, False)


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_dumps_indented_refuses_non_finite_numbers_as_the_stdlib_does(number: float) -> None:
    for value in ([number], {"x": number}, {number: 1}):
        with pytest.raises(ValueError, match="not JSON compliant"):
            _stdlib(value, False)
        with pytest.raises(ValueError, match="not JSON compliant"):
            dumps_indented(value)


def test_dumps_indented_refuses_what_is_not_json() -> None:
    for value in ({"x": {1, 2}}, [b"bytes"], {("tuple", "key"): 1}):
        with pytest.raises(TypeError):
            _stdlib(value, False)
        with pytest.raises(TypeError):
            dumps_indented(value)
