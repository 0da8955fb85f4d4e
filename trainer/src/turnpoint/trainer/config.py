"""The coordinator's configuration: a typed model that says what to fix.

docs/spec.md section 7.9: configuration is a typed model that rejects unknown keys with an
error naming the key and the nearest valid one, and cross-field rules are checked at
startup with messages that say what to change.

Every problem surfaces as one :class:`ConfigError` (never a raw pydantic
``ValidationError``), whichever way the model is built: ``CoordinatorConfig(...)``,
``model_validate``, :meth:`CoordinatorConfig.from_mapping` or
:meth:`CoordinatorConfig.from_file`. The error lists every problem found, each with the
dotted path of the key, so that a user fixes a file in one round.

Defaults follow docs/spec.md section 7.9 (the reference system's): a 60 s control timeout,
a reply grace of ``min(timeout, 5 s)``, lease renewal every ``min(timeout / 3, 10 s)``.
Defaults that derive from another setting are derived from the value the user gave, so
``control_timeout_s = 6`` alone gives a 2 s renewal interval, not the 10 s default.
"""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from turnpoint._json import JSONProblem, StrictJSONError, loads_strict
from turnpoint.errors import Reason
from turnpoint.protocol import RecoveryLevel
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.restore.choice import RestoreChoice, RestoreChoiceError

_RULE_ERROR_TYPE = "config_rule"

# Set while the outermost section validates, so that nested sections report their
# problems to it (with their full key path) instead of raising on their own.
_validating_nested: ContextVar[bool] = ContextVar("_validating_nested", default=False)


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One thing wrong with a configuration.

    ``path`` is the dotted key (empty for a rule about the whole section);
    ``suggestion`` the nearest valid key when ``path`` names an unknown one.
    """

    path: str
    message: str
    suggestion: str | None = None

    def __str__(self) -> str:
        return self.message


class ConfigError(CoordinatorError):
    """A configuration was rejected; ``problems`` says what to change, one item each.

    Deliberately not a ``ValueError``: pydantic would swallow a ``ValueError`` raised
    from inside validation and re-wrap it in its own error type.
    """

    def __init__(self, problems: Sequence[ConfigProblem], source: str | None = None) -> None:
        self.problems = tuple(problems)
        self.source = source
        where = f"{source}: " if source else ""
        if len(self.problems) == 1:
            text = f"{where}{self.problems[0]}"
        else:
            lines = "\n".join(f"  - {problem}" for problem in self.problems)
            text = f"{where}{len(self.problems)} configuration problems:\n{lines}"
        super().__init__(
            Reason.INVALID_ARGUMENT, text, {"keys": ",".join(p.path for p in self.problems)}
        )

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(problem.path for problem in self.problems if problem.path)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.problems, self.source))


class ConfigSection(BaseModel):
    """Base of every configuration section: strict, frozen, unknown keys rejected.

    Subclasses state cross-field rules by overriding :meth:`_derive_defaults` and
    :meth:`_rule_violations`; nested sections are plain fields typed with a subclass.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        allow_inf_nan=False,
        validate_default=True,
    )

    def _derive_defaults(self) -> None:
        """Fill defaults that depend on other settings (only for keys the user left out)."""

    def _rule_violations(self) -> list[str]:
        """Cross-field rules broken by this section, each phrased as what to change."""
        return []

    def _set_derived(self, name: str, value: object) -> None:
        if name not in self.model_fields_set:
            # The model is frozen for its users; this runs once, during validation.
            self.__dict__[name] = value

    @model_validator(mode="wrap")
    @classmethod
    def _validate_section(cls, data: Any, handler: Callable[[Any], Self]) -> Self:
        outermost = not _validating_nested.get()
        token = _validating_nested.set(True)
        try:
            section = handler(data)
        except ValidationError as error:
            if outermost:
                raise ConfigError(_problems_from(cls, error)) from None
            raise
        finally:
            _validating_nested.reset(token)
        section._derive_defaults()
        violations = section._rule_violations()
        if violations:
            if outermost:
                raise ConfigError([ConfigProblem("", text) for text in violations])
            # Inside a parent section: pydantic prefixes the field path for us.
            raise PydanticCustomError(_RULE_ERROR_TYPE, "{text}", {"text": "; ".join(violations)})
        return section


class CoordinatorConfig(ConfigSection):
    """Settings of the trainer-side coordinator (docs/spec.md section 7.9)."""

    control_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one control operation on one participant."""

    reply_grace_s: float = Field(default=5.0, ge=0)
    """Wait past the deadline before a call is abandoned and cancelled; default
    ``min(control_timeout_s, 5)``."""

    renew_interval_s: float = Field(default=10.0, gt=0)
    """Lease renewal period while waiting on anything slow; default
    ``min(control_timeout_s / 3, 10)``."""

    lease_s: float = Field(default=30.0, gt=0)
    """Lease a participant grants per renewal; default ``3 * renew_interval_s`` so that
    two renewals in a row may be lost before the participant resumes itself."""

    prepare_timeout_s: float = Field(default=60.0, gt=0)
    """One deadline for the whole prepare fan-out; default ``control_timeout_s``."""

    snapshot_interval_s: float = Field(default=600.0, gt=0)
    """Period of the snapshot pump; also the admission-closed time that earns a warning."""

    max_consecutive_failures: int = Field(default=3, ge=1)
    """Transient snapshot failures in a row that end the run."""

    keep_snapshots: int = Field(default=2, ge=1)
    """Published snapshots retained; the one ``LATEST`` names is always kept."""

    target_level: RecoveryLevel = Field(default=RecoveryLevel.TURN, strict=False)
    """Finest recovery level wanted; each environment gets the finest it supports."""

    max_blockers_listed: int = Field(default=32, ge=1)
    """Cap on the blockers a prepare report lists (the count is never capped)."""

    fanout_concurrency: int = Field(default=64, ge=1)
    """Control calls in flight at once during a fan-out."""

    resume_attempts: int = Field(default=2, ge=1)
    """Tries of a resume before it is left to the pump and the lease."""

    resume_retry_pause_s: float = Field(default=1.0, ge=0)

    liveness_interval_s: float = Field(default=2.0, gt=0)
    """How often the liveness watch asks every participant for its status."""

    participant_lost_after_s: float = Field(default=15.0, gt=0)
    """A participant that answered nothing for this long is lost (its process died, was
    paused, or its host went away): the job restores onto fresh participants."""

    max_restarts: int = Field(default=3, ge=0)
    """Job restarts (restore from the last published snapshot onto fresh participants)
    allowed within ``restart_window_s``; one more ends the run."""

    restart_window_s: float = Field(default=3600.0, gt=0)

    rollout_budget_s: float | None = Field(default=None, gt=0)
    """Active-time budget of one rollout on the trainer; ``None``: no budget."""

    weights_change: Literal["keep", "rerun"] = "keep"
    """What an agent does with a generation whose tokens came from more than one weights
    version (docs/spec.md section 5.5 item 7): ``keep`` it, or ``rerun`` it from its
    prompt. Sent to the agents on every Run."""

    snapshot_root: Path | str
    """Where the published snapshots and ``LATEST`` live: a directory, or a storage URL
    (``file:///path?mount=shared``, ``s3://bucket/prefix``; docs/spec.md section 8.12)."""

    @field_validator("snapshot_root", mode="before")
    @classmethod
    def _root_path_or_url(cls, value: object) -> object:
        # A URL stays a string (Path would fold its "//"); anything else is a path.
        if isinstance(value, str) and "://" in value:
            return value
        return Path(value) if isinstance(value, str) else value

    restore_from: str = "latest"
    """Which published snapshot a restore uses (docs/spec.md section 7.14): ``latest``,
    ``snapshot:<id>``, or the best by a metric the trainer recorded, ``best:<metric>``
    (highest) or ``best:-<metric>`` (lowest)."""

    def _derive_defaults(self) -> None:
        self._set_derived("reply_grace_s", min(self.control_timeout_s, 5.0))
        self._set_derived("renew_interval_s", min(self.control_timeout_s / 3, 10.0))
        self._set_derived("lease_s", 3 * self.renew_interval_s)
        self._set_derived("prepare_timeout_s", self.control_timeout_s)

    def _rule_violations(self) -> list[str]:
        violations = []
        if self.reply_grace_s > self.control_timeout_s:
            violations.append(
                f"reply_grace_s ({self.reply_grace_s:g}) must not exceed control_timeout_s "
                f"({self.control_timeout_s:g}): lower reply_grace_s or raise control_timeout_s"
            )
        if self.lease_s <= 2 * self.renew_interval_s:
            violations.append(
                f"lease_s ({self.lease_s:g}) must exceed 2 * renew_interval_s "
                f"({2 * self.renew_interval_s:g}) so that one lost renewal does not expire "
                "the lease: raise lease_s or lower renew_interval_s"
            )
        if self.participant_lost_after_s <= self.liveness_interval_s:
            violations.append(
                f"participant_lost_after_s ({self.participant_lost_after_s:g}) must exceed "
                f"liveness_interval_s ({self.liveness_interval_s:g}), or one slow status "
                "answer would count as a lost participant: raise participant_lost_after_s"
            )
        try:
            RestoreChoice.parse(self.restore_from)
        except RestoreChoiceError as error:
            violations.append(f"restore_from: {error}")
        if self.renew_interval_s > self.control_timeout_s:
            violations.append(
                f"renew_interval_s ({self.renew_interval_s:g}) must not exceed "
                f"control_timeout_s ({self.control_timeout_s:g}): leases are renewed while "
                "waiting on a control call, so lower renew_interval_s"
            )
        return violations

    @classmethod
    def from_mapping(cls, raw: Mapping[str, object], *, source: str | None = None) -> Self:
        """Build from a mapping (parsed JSON/TOML, a CLI dict); ``source`` names it in errors."""
        if not isinstance(raw, Mapping):
            raise ConfigError(
                [ConfigProblem("", f"configuration must be a mapping, got {type(raw).__name__}")],
                source,
            )
        try:
            return cls.model_validate(dict(raw))
        except ConfigError as error:
            if source is None:
                raise
            raise ConfigError(error.problems, source) from None

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        """Load a ``.json`` or ``.toml`` file.

        A relative ``snapshot_root`` is taken relative to the file's directory, so that
        a configuration means the same thing whatever the working directory.
        """
        path = Path(path)
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(
                [ConfigProblem("", f"cannot read: {error.strerror}")], source
            ) from None
        except UnicodeDecodeError as error:
            raise ConfigError([ConfigProblem("", f"not UTF-8 text: {error}")], source) from None
        raw = _parse_text(path, text, source)
        if not isinstance(raw, dict):
            raise ConfigError(
                [ConfigProblem("", f"top level must be an object, got {type(raw).__name__}")],
                source,
            )
        root = raw.get("snapshot_root")
        if isinstance(root, str) and root and "://" not in root and not Path(root).is_absolute():
            raw = {**raw, "snapshot_root": str(path.parent / root)}
        return cls.from_mapping(raw, source=source)


def _parse_text(path: Path, text: str, source: str) -> object:
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError([ConfigProblem("", f"invalid TOML: {error}")], source) from None
    if suffix == ".json":
        try:
            return loads_strict(text)
        except StrictJSONError as error:
            if error.problem is JSONProblem.DUPLICATE_KEY:
                problem = ConfigProblem(error.key, f"key {error.key!r} appears twice")
            else:
                problem = ConfigProblem("", f"invalid JSON: {error}")
            raise ConfigError([problem], source) from None
    raise ConfigError(
        [ConfigProblem("", f"unsupported file type {path.suffix!r}: use .json or .toml")],
        source,
    )


# -- turning pydantic errors into problems ---------------------------------------------


def _problems_from(model: type[BaseModel], error: ValidationError) -> list[ConfigProblem]:
    problems = []
    for item in error.errors(include_url=False):
        loc = tuple(str(part) for part in item["loc"])
        path = ".".join(loc)
        kind = item["type"]
        if kind == "extra_forbidden":
            problems.append(_unknown_key(model, loc))
        elif kind == "missing":
            problems.append(ConfigProblem(path, f"missing required key {path!r}"))
        elif kind == _RULE_ERROR_TYPE:
            where = f"in {path!r}: " if path else ""
            problems.append(ConfigProblem(path, f"{where}{item['msg']}"))
        else:
            shown = item.get("input")
            problems.append(ConfigProblem(path, f"{path}: {item['msg']} (got {shown!r})"))
    return problems


def _unknown_key(model: type[BaseModel], loc: tuple[str, ...]) -> ConfigProblem:
    section = _section_at(model, loc[:-1])
    prefix = "".join(f"{part}." for part in loc[:-1])
    key = loc[-1]
    path = prefix + key
    valid = sorted(section.model_fields) if section is not None else []
    matches = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if matches:
        suggestion = prefix + matches[0]
        return ConfigProblem(
            path, f"unknown key {path!r}: did you mean {suggestion!r}?", suggestion
        )
    listing = ", ".join(valid) if valid else "none"
    return ConfigProblem(path, f"unknown key {path!r}; valid keys here: {listing}")


def _section_at(model: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The section class that the key path ``loc`` leads to, if any."""
    current: type[BaseModel] = model
    for part in loc:
        field = current.model_fields.get(part)
        if field is None:
            return None
        found = _model_in(field.annotation)
        if found is None:
            return None
        current = found
    return current


def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
