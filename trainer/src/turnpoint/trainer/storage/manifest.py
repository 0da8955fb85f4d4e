"""The snapshot manifest the trainer publishes: its content, validation and bytes.

docs/spec.md section 7.4, step 7: the manifest names the trainer anchor, every
participant and its artifacts with digests, the continued episodes, the restarts and the
trainer's rollout state; section 8.6 fixes its format.

:class:`SnapshotManifest` and its parts are frozen dataclasses that validate themselves
on construction, so an inconsistent manifest cannot exist in memory, let alone on disk.
Parsing (:meth:`SnapshotManifest.from_json`) is strict: unknown or missing fields,
duplicate JSON keys, duplicate episodes, a digest that is not 64 lowercase hex
characters, a bad id or a schema version this build does not read are all
:class:`ManifestError`. Serialisation is canonical (sorted keys, normalised order of
every set-like list), so equal manifests have equal bytes.

Where the manifest goes on disk, and how it is published, listed, loaded and retired,
is :mod:`turnpoint.trainer.storage.layout`; :class:`~turnpoint.trainer.storage.layout.SnapshotLayout`,
:class:`~turnpoint.trainer.storage.layout.PublishStep` and
:func:`~turnpoint.trainer.storage.layout.tree_digest` stay importable from here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Self, TypeAlias, TypeVar

from turnpoint._json import FlatObjects, JSONProblem, StrictJSONError, dumps_indented, loads_strict
from turnpoint.errors import Reason
from turnpoint.ids import (
    EpisodeId,
    InvalidIdError,
    checkpoint_sequence,
    sorted_episodes,
    validate_attempt,
    validate_id,
)
from turnpoint.protocol import ArtifactRef, ParticipantKind
from turnpoint.trainer.errors import CoordinatorError

SCHEMA_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
LATEST_NAME = "LATEST"
TRAINER_DIR = "trainer"
ANCHOR_DIR = f"{TRAINER_DIR}/anchor"

_HEX = frozenset("0123456789abcdef")

_T = TypeVar("_T")

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"


class ManifestError(CoordinatorError):
    """A manifest or snapshot directory is malformed, inconsistent or incomplete.

    ``INVALID_CHECKPOINT_STATE``: the caller picks an older snapshot (when loading) or
    stops with a clear error (when its own manifest breaks an invariant).
    """

    def __init__(
        self, message: str, *, checkpoint_id: str | None = None, field: str | None = None
    ) -> None:
        metadata = {}
        if checkpoint_id is not None:
            metadata["checkpoint_id"] = checkpoint_id
        if field is not None:
            metadata["field"] = field
        super().__init__(Reason.INVALID_CHECKPOINT_STATE, message, metadata)
        self.checkpoint_id = checkpoint_id
        self.field = field

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_manifest_error, (self.message, self.checkpoint_id, self.field))


def _rebuild_manifest_error(
    message: str, checkpoint_id: str | None, field: str | None
) -> ManifestError:
    return ManifestError(message, checkpoint_id=checkpoint_id, field=field)


# -- value checks ----------------------------------------------------------------------


def _fail(where: str, why: str) -> ManifestError:
    return ManifestError(f"{where}: {why}", field=where)


def _check_digest(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        raise _fail(where, f"must be 64 lowercase hex characters, got {value!r}")
    return value


def _check_count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(where, f"must be an integer >= 0, got {value!r}")
    return value


def check_id(value: object, where: str) -> str:
    """``value`` if it is a valid id, else a :class:`ManifestError` naming ``where``."""
    try:
        return validate_id(value, where)
    except InvalidIdError as error:
        raise _fail(where, error.why + f" (got {value!r})") from None


def _check_relpath(value: object, where: str) -> str:
    """A relative POSIX path whose every component is a valid id (never '..' or '/')."""
    if not isinstance(value, str) or not value:
        raise _fail(where, f"must be a non-empty relative path, got {value!r}")
    for part in value.split("/"):
        try:
            validate_id(part, where)
        except InvalidIdError:
            raise _fail(
                where, f"every component must be a valid id (no '..', '.', '' or '/x'): {value!r}"
            ) from None
    return value


# The C encoder and decoder copy plain JSON many times faster than a walk in Python: a
# cut holds one descriptor per episode in flight. NaN and infinity fail to encode; a
# tuple, or a key that is not a string, comes back unequal; either way the walk below
# then makes the copy, or names what is wrong.
_COPY_ENCODER = json.JSONEncoder(allow_nan=False)
_NOT_PLAIN: Any = object()


def _plain_copy(value: object) -> Any:
    """A deep copy of a container of plain JSON, or ``_NOT_PLAIN``."""
    try:
        copy = json.loads(_COPY_ENCODER.encode(value))
    except (TypeError, ValueError, RecursionError):
        return _NOT_PLAIN
    return copy if copy == value else _NOT_PLAIN


def _check_json(value: object, where: str) -> JSONValue:
    """A deep copy of ``value`` if it is plain JSON (string keys, finite numbers)."""
    if type(value) is dict or type(value) is list:
        copy = _plain_copy(value)
        if copy is not _NOT_PLAIN:
            checked: JSONValue = copy
            return checked
    return _walk_json(value, where)


def _walk_json(value: object, where: str) -> JSONValue:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _fail(where, f"must be a finite number, got {value!r}")
        return value
    if isinstance(value, list | tuple):
        return [_walk_json(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, Mapping):
        copy: dict[str, JSONValue] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _fail(where, f"object keys must be strings, got {key!r}")
            copy[key] = _walk_json(item, f"{where}.{key}")
        return copy
    raise _fail(where, f"is not JSON data: {type(value).__name__}")


def _check_json_object(value: object, where: str) -> dict[str, JSONValue]:
    if not isinstance(value, Mapping):
        raise _fail(where, f"must be a JSON object, got {type(value).__name__}")
    checked = _check_json(value, where)
    assert isinstance(checked, dict)
    return checked


def _check_json_objects(items: Iterable[object], where: str) -> list[dict[str, JSONValue]]:
    """Copies of ``items``, each a JSON object (``where[index]`` names a bad one)."""
    items = list(items)
    if all(type(item) is dict for item in items):
        copies = _plain_copy(items)  # one pass for the whole list
        if copies is not _NOT_PLAIN:
            checked: list[dict[str, JSONValue]] = copies
            return checked
    return [_check_json_object(item, f"{where}[{index}]") for index, item in enumerate(items)]


# -- manifest parts --------------------------------------------------------------------


def _artifact_to_dict(artifact: ArtifactRef) -> dict[str, JSONValue]:
    return {
        "path": artifact.path,
        "sha256": artifact.sha256,
        "size_bytes": artifact.size_bytes,
        "record_count": artifact.record_count,
    }


def _artifact_from_dict(raw: object, where: str) -> ArtifactRef:
    """The one :class:`~turnpoint.protocol.ArtifactRef` validation, failing as a manifest error."""
    fields = _Fields(raw, where)
    path = fields.take("path", _check_relpath)
    sha256 = fields.take("sha256", _check_digest)
    size_bytes = fields.take("size_bytes", _check_count)
    record_count = fields.take("record_count", _check_count)
    fields.done()
    try:
        return ArtifactRef(path, sha256, size_bytes, record_count)
    except InvalidIdError as error:
        raise _fail(f"{where}.{error.field}", error.why) from None


@dataclass(frozen=True, slots=True)
class AnchorRef:
    """The trainer anchor: a directory relative to the snapshot, and its tree digest."""

    sha256: str
    path: str = ANCHOR_DIR

    def __post_init__(self) -> None:
        _check_relpath(self.path, "anchor.path")
        _check_digest(self.sha256, "anchor.sha256")

    def to_dict(self) -> dict[str, JSONValue]:
        return {"path": self.path, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, raw: object, where: str) -> Self:
        fields = _Fields(raw, where)
        result = cls(
            path=fields.take("path", _check_relpath),
            sha256=fields.take("sha256", _check_digest),
        )
        fields.done()
        return result


@dataclass(frozen=True, slots=True)
class PlacedEpisode:
    """An episode and the participant instance that saved it (or reported it)."""

    episode: EpisodeId
    instance: str

    def __post_init__(self) -> None:
        if not isinstance(self.episode, EpisodeId):
            raise _fail("episode", f"must be an EpisodeId, got {self.episode!r}")
        check_id(self.instance, "instance")

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "rollout_id": self.episode.rollout_id,
            "attempt": self.episode.attempt,
            "instance": self.instance,
        }

    @classmethod
    def from_dict(cls, raw: object, where: str) -> Self:
        fields = _Fields(raw, where)
        episode = EpisodeId(
            fields.take("rollout_id", check_id), fields.take("attempt", _check_attempt)
        )
        result = cls(episode=episode, instance=fields.take("instance", check_id))
        fields.done()
        return result


def _check_attempt(value: object, where: str) -> int:
    try:
        return validate_attempt(value, where)
    except InvalidIdError as error:
        raise _fail(where, error.why + f" (got {value!r})") from None


def _episode_objects(episodes: Sequence[EpisodeId]) -> FlatObjects:
    """``[_episode_to_dict(e) for e in episodes]`` for dumps_indented, keys sorted."""
    return FlatObjects(("attempt", "rollout_id"), [(e.attempt, e.rollout_id) for e in episodes])


def _placed_objects(placed: Sequence[PlacedEpisode]) -> FlatObjects:
    """``[p.to_dict() for p in placed]`` for dumps_indented, keys sorted."""
    return FlatObjects(
        ("attempt", "instance", "rollout_id"),
        [(p.episode.attempt, p.instance, p.episode.rollout_id) for p in placed],
    )


def _episode_to_dict(episode: EpisodeId) -> dict[str, JSONValue]:
    return {"rollout_id": episode.rollout_id, "attempt": episode.attempt}


def _episode_from_dict(raw: object, where: str) -> EpisodeId:
    fields = _Fields(raw, where)
    episode = EpisodeId(fields.take("rollout_id", check_id), fields.take("attempt", _check_attempt))
    fields.done()
    return episode


@dataclass(frozen=True, slots=True)
class ParticipantEntry:
    """What one participant instance committed.

    The entry identifies the participant by ``instance`` and ``kind`` only, never by an
    address: after a crash the same instance may come back elsewhere. ``incarnation``
    records which process wrote the files, for diagnostics. Every path lies under the
    instance's own directory. ``manifest`` is the participant's own manifest file; it may
    be absent only for a participant that saved nothing.
    """

    instance: str
    kind: ParticipantKind
    artifacts: tuple[ArtifactRef, ...] = ()
    manifest: ArtifactRef | None = None
    exported: tuple[EpisodeId, ...] = ()
    incarnation: str = ""

    def __post_init__(self) -> None:
        where = f"participant {self.instance!r}"
        check_id(self.instance, "participant.instance")
        if not isinstance(self.kind, ParticipantKind):
            raise _fail(f"{where} kind", f"must be a ParticipantKind, got {self.kind!r}")
        if not isinstance(self.incarnation, str) or len(self.incarnation) > 256:
            raise _fail(f"{where} incarnation", "must be a string of at most 256 characters")
        if not all(isinstance(artifact, ArtifactRef) for artifact in self.artifacts):
            raise _fail(f"{where} artifacts", "must be ArtifactRef values")
        if self.manifest is not None and not isinstance(self.manifest, ArtifactRef):
            raise _fail(f"{where} manifest", "must be an ArtifactRef or None")
        if not all(isinstance(episode, EpisodeId) for episode in self.exported):
            raise _fail(f"{where} exported", "must be EpisodeId values")
        artifacts = tuple(sorted(self.artifacts, key=lambda artifact: artifact.path))
        exported = tuple(sorted_episodes(self.exported))
        object.__setattr__(self, "artifacts", artifacts)
        object.__setattr__(self, "exported", exported)
        paths = [artifact.path for artifact in artifacts]
        if self.manifest is not None:
            paths.append(self.manifest.path)
        for path in paths:
            if not path.startswith(f"{self.instance}/"):
                raise _fail(f"{where} artifact {path!r}", f"must lie under {self.instance + '/'!r}")
        duplicate_path = _first_duplicate(paths)
        if duplicate_path is not None:
            raise _fail(where, f"names file {duplicate_path!r} twice")
        duplicate = _first_duplicate(exported)
        if duplicate is not None:
            raise _fail(f"{where} exported", f"duplicate episode {duplicate}")
        if self.manifest is None and (artifacts or exported):
            raise _fail(f"{where} manifest", "is required when anything was saved")

    def to_dict(self) -> dict[str, JSONValue]:
        return self._dict([_episode_to_dict(episode) for episode in self.exported])

    def _dict(self, exported: Any) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "kind": self.kind.value,
            "incarnation": self.incarnation,
            "artifacts": [_artifact_to_dict(artifact) for artifact in self.artifacts],
            "manifest": None if self.manifest is None else _artifact_to_dict(self.manifest),
            "exported": exported,
        }

    @classmethod
    def from_dict(cls, raw: object, where: str) -> Self:
        fields = _Fields(raw, where)
        kind_name = fields.take("kind", _check_str)
        try:
            kind = ParticipantKind(kind_name)
        except ValueError:
            known = ", ".join(kind.value for kind in ParticipantKind)
            raise _fail(f"{where}.kind", f"unknown kind {kind_name!r} (known: {known})") from None
        manifest_raw = fields.take("manifest", _any)
        result = cls(
            instance=fields.take("instance", check_id),
            kind=kind,
            incarnation=fields.take("incarnation", _check_str),
            artifacts=tuple(
                _artifact_from_dict(item, f"{where}.artifacts[{index}]")
                for index, item in enumerate(fields.take("artifacts", _check_list))
            ),
            manifest=None
            if manifest_raw is None
            else _artifact_from_dict(manifest_raw, f"{where}.manifest"),
            exported=tuple(
                _episode_from_dict(item, f"{where}.exported[{index}]")
                for index, item in enumerate(fields.take("exported", _check_list))
            ),
        )
        fields.done()
        return result


@dataclass(frozen=True, slots=True)
class RolloutBooks:
    """The parts of a :class:`TrainerRolloutState` as the trainer read them at a cut,
    not checked yet: copies, so reading them is all a cut must do while dispatch is
    closed; :meth:`state` checks them (a few milliseconds for a few dozen rollouts)
    once dispatch is open again."""

    queue: tuple[dict[str, JSONValue], ...] = ()
    data_loader: JSONValue = None
    attempts: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    in_flight: tuple[dict[str, JSONValue], ...] = ()

    def state(self) -> TrainerRolloutState:
        """The checked state; raises :class:`ManifestError` for books that break it."""
        return TrainerRolloutState(self.queue, self.data_loader, self.attempts, self.in_flight)


@dataclass(frozen=True, slots=True)
class TrainerRolloutState:
    """The trainer's side of the cut.

    ``queue``: the finished rollouts the trainer recorded but has not trained on yet, as
    JSON objects, in queue order. ``data_loader``: the loader position, any JSON value.
    ``attempts``: the attempt ledger, rollout id -> the attempt the trainer owns.
    ``in_flight``: the rollouts dispatched and not finished, one JSON object each (the
    rollout client's descriptor, task included, so that a restore can rerun any of them
    from its prompt); each names its ``rollout_id`` and ``attempt``, which must agree
    with the ledger, and a rollout appears at most once. Set-like: kept sorted by
    rollout id.
    """

    queue: tuple[dict[str, JSONValue], ...] = ()
    data_loader: JSONValue = None
    attempts: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    in_flight: tuple[dict[str, JSONValue], ...] = ()

    def __post_init__(self) -> None:
        queue = tuple(_check_json_objects(self.queue, "rollout_state.queue"))
        data_loader = _check_json(self.data_loader, "rollout_state.data_loader")
        if not isinstance(self.attempts, Mapping):
            raise _fail("rollout_state.attempts", "must be a mapping of rollout id to attempt")
        attempts = {
            check_id(key, "rollout_state.attempts key"): _check_attempt(
                value, f"rollout_state.attempts[{key!r}]"
            )
            for key, value in sorted(self.attempts.items())
        }
        in_flight = _check_in_flight(self.in_flight, attempts)
        object.__setattr__(self, "queue", queue)
        object.__setattr__(self, "data_loader", data_loader)
        object.__setattr__(self, "attempts", MappingProxyType(attempts))
        object.__setattr__(self, "in_flight", in_flight)

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "queue": list(self.queue),
            "data_loader": self.data_loader,
            "attempts": dict(self.attempts),
            "in_flight": list(self.in_flight),
        }

    @classmethod
    def from_dict(cls, raw: object, where: str) -> Self:
        fields = _Fields(raw, where)
        result = cls(
            queue=tuple(
                _check_json_object(item, f"{where}.queue[{index}]")
                for index, item in enumerate(fields.take("queue", _check_list))
            ),
            data_loader=fields.take("data_loader", _check_json),
            attempts=fields.take("attempts", _check_mapping),
            in_flight=tuple(
                _check_json_object(item, f"{where}.in_flight[{index}]")
                for index, item in enumerate(fields.take("in_flight", _check_list))
            ),
        )
        fields.done()
        return result


def _check_in_flight(
    items: Iterable[object], attempts: Mapping[str, int]
) -> tuple[dict[str, JSONValue], ...]:
    """Copies of the in-flight descriptors, sorted by rollout id, checked against the ledger."""
    if isinstance(items, str | bytes | Mapping) or not isinstance(items, Iterable):
        raise _fail("rollout_state.in_flight", "must be a list of JSON objects")
    checked: dict[str, dict[str, JSONValue]] = {}
    for index, descriptor in enumerate(_check_json_objects(items, "rollout_state.in_flight")):
        where = f"rollout_state.in_flight[{index}]"
        if "rollout_id" not in descriptor or "attempt" not in descriptor:
            raise _fail(where, "must name its rollout_id and attempt")
        rollout_id = check_id(descriptor["rollout_id"], f"{where}.rollout_id")
        attempt = _check_attempt(descriptor["attempt"], f"{where}.attempt")
        if rollout_id in checked:
            raise _fail(where, f"duplicate rollout {rollout_id!r}")
        if attempts.get(rollout_id) != attempt:
            raise _fail(
                where,
                f"{rollout_id}#{attempt} disagrees with the attempt ledger "
                f"({rollout_id!r} -> {attempts.get(rollout_id)!r})",
            )
        checked[rollout_id] = descriptor
    return tuple(checked[rollout_id] for rollout_id in sorted(checked))


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotManifest:
    """The trainer's record of one published snapshot (see the module docstring)."""

    checkpoint_id: str
    step: int
    created_at: float
    anchor: AnchorRef
    participants: tuple[ParticipantEntry, ...]
    continued: tuple[PlacedEpisode, ...] = ()
    restarts: tuple[PlacedEpisode, ...] = ()
    rollout_state: TrainerRolloutState = field(default_factory=TrainerRolloutState)
    extra: Mapping[str, JSONValue] = field(default_factory=lambda: MappingProxyType({}))
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        try:
            self._validate()
        except ManifestError as error:
            if error.checkpoint_id is not None:
                raise
            raise ManifestError(
                f"manifest {self.checkpoint_id!r}: {error.message}",
                checkpoint_id=str(self.checkpoint_id),
                field=error.field,
            ) from None

    def _validate(self) -> None:
        _check_schema_version(self.schema_version)
        check_id(self.checkpoint_id, "checkpoint_id")
        try:
            checkpoint_sequence(self.checkpoint_id)
        except InvalidIdError as error:
            raise _fail("checkpoint_id", error.why) from None
        _check_count(self.step, "step")
        if isinstance(self.created_at, bool) or not isinstance(self.created_at, int | float):
            raise _fail("created_at", f"must be a number, got {self.created_at!r}")
        if not math.isfinite(self.created_at):
            raise _fail("created_at", f"must be finite, got {self.created_at!r}")
        object.__setattr__(self, "created_at", float(self.created_at))
        if not isinstance(self.anchor, AnchorRef):
            raise _fail("anchor", "must be an AnchorRef")
        if not isinstance(self.rollout_state, TrainerRolloutState):
            raise _fail("rollout_state", "must be a TrainerRolloutState")

        if not all(isinstance(entry, ParticipantEntry) for entry in self.participants):
            raise _fail("participants", "must be ParticipantEntry values")
        for label, placed_items in (("continued", self.continued), ("restarts", self.restarts)):
            if not all(isinstance(placed, PlacedEpisode) for placed in placed_items):
                raise _fail(label, "must be PlacedEpisode values")
        participants = tuple(sorted(self.participants, key=lambda entry: entry.instance))
        object.__setattr__(self, "participants", participants)
        duplicate_instance = _first_duplicate(entry.instance for entry in participants)
        if duplicate_instance is not None:
            raise _fail("participants", f"instance {duplicate_instance!r} appears twice")
        if any(entry.instance == TRAINER_DIR for entry in participants):
            raise _fail("participants", f"instance name {TRAINER_DIR!r} is reserved")
        # An episode runs on one participant, its owner (an agent, say), which alone may
        # continue it; resources servers export the sessions they hold for the same
        # episode next to it, so their exports do not count as a second owner.
        exported_by: dict[EpisodeId, str] = {}
        for entry in participants:
            if entry.kind is ParticipantKind.RESOURCES:
                continue
            for episode in entry.exported:
                if episode in exported_by:
                    raise _fail(
                        "participants",
                        f"episode {episode} exported by both {exported_by[episode]!r} "
                        f"and {entry.instance!r}",
                    )
                exported_by[episode] = entry.instance

        continued = tuple(sorted(self.continued, key=_placed_key))
        restarts = tuple(sorted(self.restarts, key=_placed_key))
        object.__setattr__(self, "continued", continued)
        object.__setattr__(self, "restarts", restarts)
        instances = {entry.instance for entry in participants}
        ledger = self.rollout_state.attempts
        seen_rollouts: dict[str, str] = {}
        for label, placed_list in (("continued", continued), ("restarts", restarts)):
            for placed in placed_list:
                episode = placed.episode
                if episode.rollout_id in seen_rollouts:
                    raise _fail(
                        label,
                        f"duplicate episode: rollout {episode.rollout_id!r} already listed "
                        f"in {seen_rollouts[episode.rollout_id]}",
                    )
                seen_rollouts[episode.rollout_id] = label
                if placed.instance not in instances:
                    raise _fail(
                        label, f"episode {episode} names unknown instance {placed.instance!r}"
                    )
                if ledger.get(episode.rollout_id) != episode.attempt:
                    raise _fail(
                        label,
                        f"episode {episode} disagrees with the attempt ledger "
                        f"({episode.rollout_id!r} -> {ledger.get(episode.rollout_id)!r})",
                    )
        for placed in continued:
            if exported_by.get(placed.episode) != placed.instance:
                raise _fail(
                    "continued",
                    f"episode {placed.episode} was not exported by {placed.instance!r}",
                )

        if not isinstance(self.extra, Mapping):
            raise _fail("extra", "must be a JSON object")
        extra = _check_json_object(self.extra, "extra")
        object.__setattr__(self, "extra", MappingProxyType(extra))

    # -- queries -----------------------------------------------------------------------

    @property
    def sequence(self) -> int:
        return checkpoint_sequence(self.checkpoint_id)

    @property
    def instances(self) -> frozenset[str]:
        return frozenset(entry.instance for entry in self.participants)

    def participant(self, instance: str) -> ParticipantEntry:
        for entry in self.participants:
            if entry.instance == instance:
                return entry
        raise KeyError(instance)

    def continued_by_instance(self) -> dict[str, tuple[EpisodeId, ...]]:
        """Each instance's continued episodes (every instance present, maybe empty)."""
        result: dict[str, list[EpisodeId]] = {entry.instance: [] for entry in self.participants}
        for placed in self.continued:
            result[placed.instance].append(placed.episode)
        return {instance: tuple(episodes) for instance, episodes in result.items()}

    def validate_topology(self, live_instances: Iterable[str]) -> None:
        """Raise unless the live participant set is exactly the one that was saved."""
        live = frozenset(live_instances)
        missing = sorted(self.instances - live)
        unexpected = sorted(live - self.instances)
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"saved but not live: {', '.join(missing)}")
            if unexpected:
                parts.append(f"live but not saved: {', '.join(unexpected)}")
            raise ManifestError(
                f"snapshot {self.checkpoint_id!r} was taken with another participant set "
                f"({'; '.join(parts)})",
                checkpoint_id=self.checkpoint_id,
                field="participants",
            )

    # -- (de)serialisation -------------------------------------------------------------

    def to_dict(self) -> dict[str, JSONValue]:
        return self._document(
            ParticipantEntry.to_dict, lambda placed: [item.to_dict() for item in placed]
        )

    def to_json(self) -> bytes:
        """Canonical bytes: equal manifests serialise identically."""
        # Each list of episodes (exported, continued, restarted: one entry per episode of
        # the snapshot) as FlatObjects, which dumps_indented writes as the list of the
        # dicts to_dict has, without making them.
        document = self._document(
            lambda entry: entry._dict(_episode_objects(entry.exported)), _placed_objects
        )
        return (dumps_indented(document, sort_keys=True) + "\n").encode("ascii")

    def _document(
        self,
        participant: Callable[[ParticipantEntry], dict[str, Any]],
        placed: Callable[[tuple[PlacedEpisode, ...]], Any],
    ) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "created_at": self.created_at,
            "anchor": self.anchor.to_dict(),
            "participants": [participant(entry) for entry in self.participants],
            "continued": placed(self.continued),
            "restarts": placed(self.restarts),
            "rollout_state": self.rollout_state.to_dict(),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, raw: object) -> Self:
        fields = _Fields(raw, "manifest")
        # The version first: a newer schema fails on its version, not on its new fields.
        _check_schema_version(fields.take("schema_version", _any))
        checkpoint_id = fields.take("checkpoint_id", check_id)
        try:
            result = cls(
                schema_version=SCHEMA_VERSION,
                checkpoint_id=checkpoint_id,
                step=fields.take("step", _check_count),
                created_at=fields.take("created_at", _check_number),
                anchor=AnchorRef.from_dict(fields.take("anchor", _any), "anchor"),
                participants=tuple(
                    ParticipantEntry.from_dict(item, f"participants[{index}]")
                    for index, item in enumerate(fields.take("participants", _check_list))
                ),
                continued=tuple(
                    PlacedEpisode.from_dict(item, f"continued[{index}]")
                    for index, item in enumerate(fields.take("continued", _check_list))
                ),
                restarts=tuple(
                    PlacedEpisode.from_dict(item, f"restarts[{index}]")
                    for index, item in enumerate(fields.take("restarts", _check_list))
                ),
                rollout_state=TrainerRolloutState.from_dict(
                    fields.take("rollout_state", _any), "rollout_state"
                ),
                extra=fields.take("extra", _check_mapping),
            )
            fields.done()
        except ManifestError as error:
            if error.checkpoint_id is not None:
                raise
            raise ManifestError(
                f"manifest {checkpoint_id!r}: {error.message}",
                checkpoint_id=checkpoint_id,
                field=error.field,
            ) from None
        return result

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        try:
            text = data.decode("utf-8") if isinstance(data, bytes) else data
            raw = loads_strict(text)
        except UnicodeDecodeError as error:
            raise ManifestError(f"manifest is not UTF-8: {error}") from None
        except StrictJSONError as error:
            if error.problem is JSONProblem.SYNTAX:
                raise ManifestError(f"manifest is not valid JSON: {error}") from None
            raise ManifestError(f"manifest: {error}") from None
        return cls.from_dict(raw)


def _check_schema_version(value: object) -> int:
    if isinstance(value, bool) or value != SCHEMA_VERSION:
        raise _fail(
            "schema_version",
            f"unsupported schema version {value!r} (this build reads {SCHEMA_VERSION})",
        )
    assert isinstance(value, int)
    return value


def _placed_key(placed: PlacedEpisode) -> tuple[str, EpisodeId]:
    # By instance, then the episode's own order (rollout id, attempt: a tuple's, in C).
    return (placed.instance, placed.episode)


def _first_duplicate(items: Iterable[Any]) -> Any:
    seen: set[Any] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None


# -- strict field reading --------------------------------------------------------------


def _any(value: object, where: str) -> object:
    return value


def _check_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"must be a string, got {value!r}")
    return value


def _check_number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(where, f"must be a number, got {value!r}")
    return float(value)


def _check_list(value: object, where: str) -> list[object]:
    if not isinstance(value, list):
        raise _fail(where, f"must be a list, got {type(value).__name__}")
    return value


def _check_mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"must be an object, got {type(value).__name__}")
    return value


class _Fields:
    """Reads the fields of one JSON object exactly once; leftovers are unknown fields."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, dict):
            raise _fail(where, f"must be an object, got {type(raw).__name__}")
        self._raw: dict[str, object] = dict(raw)
        self._where = where

    def take(self, name: str, check: Callable[[object, str], _T]) -> _T:
        where = f"{self._where}.{name}"
        if name not in self._raw:
            raise _fail(where, "missing field")
        return check(self._raw.pop(name), where)

    def done(self) -> None:
        if self._raw:
            names = ", ".join(sorted(self._raw))
            raise _fail(self._where, f"unknown field(s): {names}")
