"""The snapshot store's on-disk format: records files and participant manifests.

docs/spec.md sections 8.2 and 8.3 define the bytes; section 8.5 what a reader checks.
Encoding serialises every record before anything is written, so a payload that is not
plain JSON fails the write naming the episode, key and location. Decoding is strict
(duplicate keys, NaN/Infinity, unknown or missing fields are all refused) and raises
:class:`CorruptSnapshotError` with the :class:`Corruption` kind that says why.

Pure functions over bytes: no file I/O here; :mod:`._store` reads and writes the files.
"""

from __future__ import annotations

import copy
import enum
import functools
import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _escape_ascii
from pathlib import Path
from typing import Any, Final, NoReturn

from turnpoint._json import JSONProblem, StrictJSONError, dumps_indented, loads_strict
from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId, sorted_episodes, validate_id
from turnpoint.protocol import ArtifactRef

from ._failures import ParticipantError

SCHEMA_VERSION: Final = 1
MANIFEST_NAME: Final = "MANIFEST.json"
# Deep enough for any real turn state, shallow enough that neither our encoder nor the
# stdlib decoder can hit the interpreter's recursion limit on a hostile file.
MAX_PAYLOAD_DEPTH: Final = 100
RECORDS_NAME: Final = re.compile(r"records-(?P<sha256>[0-9a-f]{64})\.jsonl")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_MANIFEST_FIELDS: Final = frozenset(
    {"schema_version", "checkpoint_id", "instance", "artifacts", "episodes"}
)
_ARTIFACT_FIELDS: Final = frozenset({"path", "sha256", "size_bytes", "record_count"})
_EPISODE_FIELDS: Final = frozenset({"rollout_id", "attempt"})
_RECORD_FIELDS: Final = frozenset({"episode", "key", "payload"})
# How dumps_indented ends a manifest whose episode list is empty.
_NO_EPISODES: Final = "[]\n}"


# --------------------------------------------------------------------------- errors


class StoreError(ParticipantError):
    """Root of the store's own errors. ``OSError`` from the disk is never wrapped.

    Each carries the reason a commit or restore reports for it (docs/spec.md section 9.3).
    """

    _reason = Reason.INVALID_CHECKPOINT_STATE

    def __init__(self, message: str, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(self._reason, message, metadata)

    def __reduce__(self) -> tuple[object, ...]:
        # The subclasses' own arguments, so a copy or pickle rebuilds the same error.
        return (_rebuild, (type(self), self.__dict__.copy(), self.args))


def _rebuild(
    cls: type[StoreError], state: dict[str, object], args: tuple[object, ...]
) -> StoreError:
    error = cls.__new__(cls)
    error.__dict__.update(state)
    error.args = args
    return error


class Corruption(enum.Enum):
    """Why a snapshot directory cannot be used (all map to ``INVALID_CHECKPOINT_STATE``)."""

    MISSING = "missing"
    MANIFEST_INVALID = "manifest_invalid"
    PATH_ESCAPE = "path_escape"
    UNEXPECTED_CONTENT = "unexpected_content"
    SIZE_MISMATCH = "size_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    RECORD_COUNT_MISMATCH = "record_count_mismatch"
    RECORD_INVALID = "record_invalid"
    EPISODES_MISMATCH = "episodes_mismatch"


class CorruptSnapshotError(StoreError):
    """A snapshot directory is missing, damaged or not what the caller expected."""

    def __init__(self, snapshot: str, instance: str, kind: Corruption, detail: str) -> None:
        self.snapshot = snapshot
        self.instance = instance
        self.kind = kind
        self.detail = detail
        super().__init__(
            f"snapshot {snapshot!r} of instance {instance!r} is unusable ({kind.value}): {detail}",
            {"snapshot": snapshot, "corruption": kind.value},
        )


class UnserialisableRecordError(StoreError):
    """A record's payload is not plain JSON; raised before anything is written."""

    def __init__(self, episode: EpisodeId, key: str, location: str, why: str) -> None:
        self.episode = episode
        self.key = key
        self.location = location
        self.why = why
        super().__init__(
            f"record {key!r} of episode {episode} cannot be saved: {location}: {why}",
            {"episode": str(episode), "key": key, "location": location},
        )


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, slots=True)
class Record:
    """One piece of exported state: ``key`` names what it holds (``"session"``, ``"turn-3"``).

    ``payload`` must be plain JSON (mappings with string keys, lists, tuples, strings,
    finite numbers, booleans, None); its key order is kept on disk and on read. A
    restored payload is a ``dict`` and tuples come back as lists. The payload is left
    out of the hash so that records with dict payloads stay hashable.
    """

    episode: EpisodeId
    key: str
    payload: Mapping[str, Any] = field(hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.episode, EpisodeId):
            raise TypeError(f"episode must be an EpisodeId, not {type(self.episode).__name__}")
        if type(self.key) is str:
            _checked_key(self.key)
        else:
            validate_id(self.key, "record key")


@functools.lru_cache(maxsize=256)
def _checked_key(key: str) -> str:
    """A record key, validated once: a commit makes a record or two per episode and a
    participant uses a handful of keys (a failed check raises and is not cached)."""
    return validate_id(key, "record key")


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    """A published instance directory: what a commit replies and a restore is given.

    ``manifest`` names ``MANIFEST.json`` itself (its ``record_count`` is 0: a manifest
    holds no records); ``artifacts`` are the files it lists; ``episodes`` are the
    exported episodes, sorted and unique.
    """

    checkpoint_id: str
    manifest: ArtifactRef
    artifacts: tuple[ArtifactRef, ...]
    episodes: tuple[EpisodeId, ...]


@dataclass(frozen=True, slots=True)
class LoadedSnapshot:
    """The verified entry and the selected records, in file order."""

    entry: SnapshotEntry
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class Manifest:
    """A participant manifest's content (docs/spec.md section 8.3)."""

    checkpoint_id: str
    instance: str
    artifacts: tuple[ArtifactRef, ...]
    episodes: tuple[EpisodeId, ...]

    def to_bytes(self) -> bytes:
        document = {
            "schema_version": SCHEMA_VERSION,
            "checkpoint_id": self.checkpoint_id,
            "instance": self.instance,
            "artifacts": [
                {
                    "path": ref.path,
                    "sha256": ref.sha256,
                    "size_bytes": ref.size_bytes,
                    "record_count": ref.record_count,
                }
                for ref in self.artifacts
            ],
            "episodes": [],
        }
        text = dumps_indented(document)
        if self.episodes:
            # The episodes as dumps_indented writes them, without a dict each (a
            # manifest lists every exported episode): valid ids are [A-Za-z0-9._-],
            # which JSON quotes as they are, and an attempt is an int.
            listed = ",".join(
                [
                    f'\n    {{\n      "rollout_id": "{episode.rollout_id}",\n      "attempt": '
                    f"{int.__repr__(episode.attempt)}\n    }}"
                    for episode in self.episodes
                ]
            )
            text = f"{text.removesuffix(_NO_EPISODES)}[{listed}\n  ]\n}}"
        return (text + "\n").encode("ascii")


# --------------------------------------------------------------------------- encoding


class _BadValue(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        self.location: list[str] = []


# The exact types :func:`_plain` passes through unchanged (a float is checked).
_PLAIN_ATOMS: Final = frozenset({str, int, bool, type(None)})
# A string at least this long is worth checking for characters JSON must escape: the
# check runs in C several times faster than the escaping, and most large state (hex,
# base64, token text) has none.
LONG_TEXT: Final = 1024


class _LongText:
    """A string of at least :data:`LONG_TEXT` characters in a plain payload: the
    encoder's ``default`` hook writes it between its quotes as it is when JSON escapes
    nothing in it (checked in the writer, off the loop), and escapes it otherwise."""

    __slots__ = ("clean", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        # Whether JSON escapes nothing in it, once checked: a record kept for the next
        # snapshot (an agent's parked episode) is not checked again.
        self.clean: bool | None = None


# The ASCII characters a JSON string holds as they are.
_UNESCAPED: Final = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')


def _plain(value: Any, depth: int) -> Any:
    """Copy ``value`` as plain JSON data, refusing anything that would not round-trip;
    every string of at least :data:`LONG_TEXT` characters is wrapped in a
    :class:`_LongText` for the encoder."""
    kind = type(value)
    # Exact types first: this runs for every value of every record.
    if kind is str:
        return value if len(value) < LONG_TEXT else _LongText(value)
    if kind is int or kind is bool or value is None:
        return value
    # A dict or a list is none of the atoms: it skips their subclass checks.
    if kind is not dict and kind is not list:
        if kind is float or isinstance(value, float):
            if not math.isfinite(value):
                raise _BadValue(f"{value!r} is not a JSON number")
            return float(value)
        if isinstance(value, str):
            return _plain(str(value), depth)
        if isinstance(value, int):
            # bool is final, so this is an int subclass such as an IntEnum.
            return int(value)
    if depth >= MAX_PAYLOAD_DEPTH:
        raise _BadValue(f"nested deeper than {MAX_PAYLOAD_DEPTH} levels")
    if kind is dict or isinstance(value, Mapping):
        copy: dict[str, Any] = {}
        for key, item in value.items():
            # json.dumps would turn 1 into "1" silently, and {1: a, "1": b} into a
            # duplicate key: the restored payload would not be the saved one.
            if not isinstance(key, str):
                raise _BadValue(f"key {key!r} is not a string")
            # The plain atoms inline: most members are, and a call each is most of the walk.
            atom = type(item)
            if atom in _PLAIN_ATOMS and (atom is not str or len(item) < LONG_TEXT):
                copy[key] = item
                continue
            try:
                copy[key] = _plain(item, depth + 1)
            except _BadValue as error:
                error.location.append(f"[{key!r}]")
                raise
        return copy
    if kind is list or isinstance(value, (list, tuple)):
        items: list[Any] = []
        for index, item in enumerate(value):
            atom = type(item)
            if atom in _PLAIN_ATOMS and (atom is not str or len(item) < LONG_TEXT):
                items.append(item)
                continue
            try:
                items.append(_plain(item, depth + 1))
            except _BadValue as error:
                error.location.append(f"[{index}]")
                raise
        return items
    raise _BadValue(f"{kind.__name__} is not JSON-serialisable")


def needs_no_escape(text: str) -> bool:
    """Whether JSON (ASCII only) writes ``text`` between its quotes as it is."""
    return (
        text.isascii()
        and '"' not in text
        and "\\" not in text
        and "\n" not in text
        and not text.encode("ascii").translate(None, _UNESCAPED)
    )


# Exactly these types are immutable JSON values: a copy may share them.
_JSON_ATOMS: Final = frozenset({str, int, float, bool, type(None)})
# Below this depth a value is copied by the plain-JSON walk; anything deeper (or a
# cycle, which no JSON has) goes to copy.deepcopy, which copes with both.
_FAST_COPY_DEPTH: Final = 32


def json_copy(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` that shares nothing mutable with it.

    What ``copy.deepcopy`` returns, faster for plain JSON: dicts with string keys and
    lists are rebuilt, the immutable atoms shared, every other object deep-copied.
    """
    kind = type(value)
    if kind in _JSON_ATOMS:
        return value
    if depth < _FAST_COPY_DEPTH:
        if kind is dict:
            copied = {}
            for key, item in value.items():
                if type(key) is not str:
                    return copy.deepcopy(value)
                # Atoms inline: a call per member is most of the cost of a copy.
                copied[key] = item if type(item) in _JSON_ATOMS else json_copy(item, depth + 1)
            return copied
        if kind is list:
            return [
                item if type(item) in _JSON_ATOMS else json_copy(item, depth + 1) for item in value
            ]
    return copy.deepcopy(value)


def json_copy_object(value: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`json_copy` of a mapping, as a plain dict."""
    copied: dict[str, Any] = json_copy(value if type(value) is dict else dict(value))
    return copied


class PlainRecord:
    """A record checked and copied for encoding (:func:`plain_record`): its payload is
    plain JSON of its own, sharing only immutable strings and numbers with what was
    exported, so that what the participant does after the export (a commit that
    releases admission before its write) cannot change what is written, and the writer
    encodes it without walking it again. Its long strings are :class:`_LongText`: the
    payload is for :func:`record_lines` only.

    A record that is written again unchanged (an agent keeps its parked episodes'
    records from one snapshot to the next) is not encoded again: the writer keeps its
    line (``line``) when it is at most :data:`KEPT_LINE_BYTES` long, and a longer one's
    long strings remember whether they needed escaping."""

    __slots__ = ("episode", "key", "line", "payload")

    def __init__(self, episode: EpisodeId, key: str, payload: dict[str, Any]) -> None:
        self.episode = episode
        self.key = key
        self.payload = payload
        self.line: bytes | None = None


# The longest records-file line a PlainRecord keeps once encoded: a parked episode's
# line costs its length in memory for as long as the record is kept, and a longer
# record's time goes to its bytes (hashed every time), not to its encoding.
KEPT_LINE_BYTES: Final = 4096


def plain_record(record: Record | PlainRecord) -> PlainRecord:
    """``record`` checked and copied as plain JSON (one walk of its payload);
    :class:`UnserialisableRecordError` names the episode, key and location of a value
    that would not round-trip."""
    if type(record) is PlainRecord:
        return record
    if not isinstance(record, Record):
        raise TypeError(f"records must be Record instances, not {type(record).__name__}")
    # The exact type first: an ABC check costs more than encoding a small record.
    if type(record.payload) is not dict and not isinstance(record.payload, Mapping):
        raise UnserialisableRecordError(
            record.episode,
            record.key,
            "payload",
            f"must be a mapping, not {type(record.payload).__name__}",
        )
    payload = _checked_copy(record.episode, record.key, "payload", record.payload, 1)
    return PlainRecord(record.episode, record.key, payload)


def plain_member(episode: EpisodeId, key: str, name: str, value: Any) -> Any:
    """``value`` checked and copied as the member ``name`` of a record's payload, as
    :func:`plain_record` does each member: for a payload the SDK itself makes around a
    few members it does not own, which a walk of the whole payload would visit again.
    :class:`UnserialisableRecordError` names the same location."""
    return _checked_copy(episode, key, f"payload[{name!r}]", value, 2)


def _checked_copy(episode: EpisodeId, key: str, where: str, value: Any, depth: int) -> Any:
    """:func:`_plain` of ``value`` (at ``depth`` in its record's payload, at ``where``),
    a value that would not round-trip named in an :class:`UnserialisableRecordError`."""
    try:
        return _plain(value, depth)
    except _BadValue as error:
        at = where + "".join(reversed(error.location))
        raise UnserialisableRecordError(episode, key, at, error.why) from None


_ENCODER_SETTINGS: Final[dict[str, Any]] = {
    "ensure_ascii": True,
    "allow_nan": False,
    "check_circular": False,
    "separators": (",", ":"),
}


def _c_encoder_works() -> bool:
    """Whether this Python's C encoder takes the arguments :func:`_payload_encoder` gives
    it and writes what ``JSONEncoder`` does with the same settings."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return False
    try:
        chunks = make(None, None, _escape_ascii, None, ":", ",", False, False, False)
        probe = {"a": [1, 2.5, True, None, "\u00e9\n"], "b": {}}
        return "".join(chunks(probe, 0)) == json.JSONEncoder(**_ENCODER_SETTINGS).encode(probe)
    except TypeError:  # another signature than this Python's
        return False


_C_ENCODER: Final = _c_encoder_works()


def _payload_encoder(default: Callable[[Any], Any]) -> Callable[[Any], str]:
    """The compact ASCII JSON of a plain payload, ``default`` called for what is not
    JSON. ``JSONEncoder.encode`` makes a C encoder for every call, which costs more than
    encoding a small payload: one is made here with the arguments ``JSONEncoder(
    **_ENCODER_SETTINGS)`` would give it (``JSONEncoder`` itself where that is not this
    Python's C encoder)."""
    if not _C_ENCODER:
        return json.JSONEncoder(**_ENCODER_SETTINGS, default=default).encode
    chunks = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
        None, default, _escape_ascii, None, ":", ",", False, False, False
    )

    def encode(payload: Any) -> str:
        return "".join(chunks(payload, 0))

    return encode


# What a long string copied as it is stands for in the encoder's output, before it is
# put in: the escaped string "\x00". A payload holding that very string makes the
# count of these come out wrong, and that record is encoded again escaping every string.
_MARK: Final = "\x00"
_MARKED: Final = _escape_ascii(_MARK)


def record_lines(records: Iterable[Record | PlainRecord]) -> Iterator[tuple[EpisodeId, bytes]]:
    """Each record's line of the records file, in order, with its episode: the compact
    ASCII JSON of ``{"episode": ..., "key": ..., "payload": ...}`` and a newline. A
    :class:`Record` is checked and copied first (:func:`plain_record`); a
    :class:`PlainRecord` is encoded as it is."""
    verbatim: list[str] = []
    escape_all = False

    def long_text(value: Any) -> str:
        if type(value) is not _LongText:
            raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
        text = value.text
        if escape_all:
            return text
        clean = value.clean
        if clean is None:
            clean = value.clean = needs_no_escape(text)
        if not clean:
            return text
        verbatim.append(text)
        return _MARK

    encode = _payload_encoder(long_text)
    for item in records:
        record = plain_record(item)
        episode = record.episode
        kept = record.line
        if kept is not None:
            yield episode, kept
            continue
        # What encoding {"episode": {...}, "key": ..., "payload": ...} gives, without
        # building and walking that dict: the ids are valid ids, [A-Za-z0-9._-] only,
        # which JSON quotes as they are, and the attempt is an int.
        head = (
            f'{{"episode":{{"rollout_id":"{episode.rollout_id}","attempt":'
            f'{int.__repr__(episode.attempt)}}},"key":"{record.key}","payload":'
        )
        body = encode(record.payload)
        if verbatim:
            pieces = body.split(_MARKED)
            if len(pieces) == len(verbatim) + 1:
                parts = [head, pieces[0]]
                for text, piece in zip(verbatim, pieces[1:], strict=True):
                    parts += ('"', text, '"', piece)
                parts.append("}\n")
                line = "".join(parts)
            else:
                escape_all = True
                line = f"{head}{encode(record.payload)}}}\n"
                escape_all = False
            verbatim.clear()
        else:
            line = f"{head}{body}}}\n"
        # ASCII-only output: the bytes cannot depend on a locale or hold a lone surrogate.
        encoded = line.encode("ascii")
        if len(encoded) <= KEPT_LINE_BYTES:
            record.line = encoded
        yield episode, encoded


class RecordsFile:
    """What the lines of one records file add up to, line by line: its digest, size,
    line count and episodes, which name and describe the file (:meth:`ref`)."""

    __slots__ = ("_digest", "_episodes", "lines", "size")

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._episodes: set[EpisodeId] = set()
        self.lines = 0
        self.size = 0

    def add(self, episode: EpisodeId, line: bytes) -> bytes:
        """Count ``line`` (of ``episode``) in; returns it."""
        self._digest.update(line)
        self._episodes.add(episode)
        self.lines += 1
        self.size += len(line)
        return line

    def ref(self, instance: str) -> ArtifactRef:
        sha256 = self._digest.hexdigest()
        return ArtifactRef(f"{instance}/records-{sha256}.jsonl", sha256, self.size, self.lines)

    def episodes(self) -> tuple[EpisodeId, ...]:
        return tuple(sorted_episodes(self._episodes))


def encode_records(
    instance: str, records: Iterable[Record | PlainRecord]
) -> tuple[bytes, ArtifactRef, tuple[EpisodeId, ...]]:
    """Serialise every record (so nothing is written if one fails) and describe the file.
    A :class:`PlainRecord` was checked and copied already and is encoded as it is."""
    described = RecordsFile()
    data = b"".join([described.add(episode, line) for episode, line in record_lines(records)])
    return data, described.ref(instance), described.episodes()


def entry_of(manifest: Manifest, manifest_bytes: bytes) -> SnapshotEntry:
    """What a commit replies for ``manifest``: its own reference, artifacts and episodes."""
    ref = ArtifactRef(
        f"{manifest.instance}/{MANIFEST_NAME}",
        hashlib.sha256(manifest_bytes).hexdigest(),
        len(manifest_bytes),
        0,
    )
    return SnapshotEntry(manifest.checkpoint_id, ref, manifest.artifacts, manifest.episodes)


# --------------------------------------------------------------------------- decoding


def _strict_json(text: str) -> Any:
    """Parse JSON refusing duplicate keys and NaN/Infinity (ValueError on any problem)."""
    try:
        return loads_strict(text)
    except StrictJSONError as error:
        # The store's own wording, kept from before the parser was shared.
        if error.problem is JSONProblem.DUPLICATE_KEY:
            raise ValueError(f"duplicate key {error.key!r}") from None
        if error.problem is JSONProblem.CONSTANT:
            raise ValueError(f"{error.constant} is not valid JSON") from None
        raise ValueError(error.detail) from None


def _object(value: Any, fields: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object")
    if value.keys() != fields:
        unknown = sorted(value.keys() - fields)
        missing = sorted(fields - value.keys())
        raise ValueError(f"{what}: unknown fields {unknown}, missing fields {missing}")
    return value


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0")
    return value


def _parse_episode(value: Any, seen: dict[tuple[str, int], EpisodeId] | None = None) -> EpisodeId:
    fields = _object(value, _EPISODE_FIELDS, "episode")
    rollout_id, attempt = fields["rollout_id"], fields["attempt"]
    if not isinstance(rollout_id, str):
        raise ValueError("episode rollout_id must be a string")
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        raise ValueError("episode attempt must be an integer")
    if seen is None:
        return EpisodeId(rollout_id, attempt)  # InvalidIdError is a ValueError
    # Records of one episode share one validated EpisodeId instead of re-validating.
    episode = seen.get((rollout_id, attempt))
    if episode is None:
        episode = seen[rollout_id, attempt] = EpisodeId(rollout_id, attempt)
    return episode


def parse_manifest(snapshot: str, instance: str, directory: Path, data: bytes) -> Manifest:
    """Parse and check a participant manifest read from ``directory`` (section 8.5 item 2)."""

    def invalid(detail: str, kind: Corruption = Corruption.MANIFEST_INVALID) -> NoReturn:
        raise CorruptSnapshotError(snapshot, instance, kind, f"{MANIFEST_NAME}: {detail}")

    try:
        document = _object(_strict_json(data.decode("utf-8")), _MANIFEST_FIELDS, "manifest")
        version = document["schema_version"]
        if isinstance(version, bool) or version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {version!r} is not {SCHEMA_VERSION}")
        checkpoint_id = validate_id(document["checkpoint_id"], "checkpoint_id")
        if document["instance"] != instance:
            raise ValueError(f"names instance {document['instance']!r}")
        raw_artifacts = document["artifacts"]
        if not isinstance(raw_artifacts, list) or len(raw_artifacts) != 1:
            raise ValueError(f"schema {SCHEMA_VERSION} lists exactly one records file")
        raw_episodes = document["episodes"]
        if not isinstance(raw_episodes, list):
            raise ValueError("episodes must be a list")
        episodes = tuple(_parse_episode(item) for item in raw_episodes)
        if any(a >= b for a, b in itertools.pairwise(episodes)):
            raise ValueError("episodes must be sorted and unique")
        artifacts: list[ArtifactRef] = []
        for item in raw_artifacts:
            fields = _object(item, _ARTIFACT_FIELDS, "artifact")
            path, sha256 = fields["path"], fields["sha256"]
            if not isinstance(sha256, str) or not _SHA256_HEX.fullmatch(sha256):
                raise ValueError(f"sha256 {sha256!r} is not 64 lowercase hex characters")
            if not isinstance(path, str):
                raise ValueError("artifact path must be a string")
            target = (directory.parent / path).resolve()
            if target.parent != directory.resolve():
                invalid(
                    f"artifact path {path!r} leaves the instance directory", Corruption.PATH_ESCAPE
                )
            if path != f"{instance}/records-{sha256}.jsonl":
                raise ValueError(f"artifact path {path!r} does not match its digest")
            artifacts.append(
                ArtifactRef(
                    path,
                    sha256,
                    _count(fields["size_bytes"], "size_bytes"),
                    _count(fields["record_count"], "record_count"),
                )
            )
    except ValueError as error:
        invalid(str(error))
    return Manifest(checkpoint_id, instance, tuple(artifacts), episodes)


def decode_records(snapshot: str, instance: str, ref: ArtifactRef, data: bytes) -> Iterator[Record]:
    """Yield the records of a verified file; the caller consumes all before using any."""

    def invalid(kind: Corruption, detail: str) -> NoReturn:
        raise CorruptSnapshotError(snapshot, instance, kind, f"{ref.path}: {detail}")

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        invalid(Corruption.RECORD_INVALID, str(error))
    # Every record ends with a newline, so the split leaves exactly one empty tail.
    lines = text.split("\n")
    if lines.pop() != "":
        invalid(Corruption.RECORD_INVALID, "ends mid-record")
    if len(lines) != ref.record_count:
        invalid(
            Corruption.RECORD_COUNT_MISMATCH,
            f"holds {len(lines)} records, the manifest says {ref.record_count}",
        )
    seen: dict[tuple[str, int], EpisodeId] = {}
    for number, line in enumerate(lines, start=1):
        try:
            fields = _object(_strict_json(line), _RECORD_FIELDS, "record")
            payload = fields["payload"]
            if not isinstance(payload, dict):
                raise ValueError("payload must be an object")
            record = Record(_parse_episode(fields["episode"], seen), fields["key"], payload)
        except (ValueError, TypeError) as error:
            invalid(Corruption.RECORD_INVALID, f"line {number}: {error}")
        yield record
