"""The weight sync's decisions: request ids, when to retry, and what a give-up says.

Pure: no grpc, no asyncio, no clock of its own (``now`` is an argument), so that a test
drives minutes of retries in microseconds. :class:`~._weight_sync.WeightSync` adapts it
to the wire (docs/spec.md section 6.11).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from turnpoint.errors import Reason
from turnpoint.trainer.errors import CoordinatorError
from turnpoint.trainer.rollouts.values import doubling_pause_s

_MAX_REQUEST_ID = 256


@dataclass(frozen=True, slots=True)
class WeightSyncSettings:
    """How hard one push tries each policy server.

    ``call_timeout_s`` bounds one ``UpdateWeights`` call. It must leave room for the
    model's own generations: a model that must not swap weights under a streaming
    generation answers only once they ended (docs/spec.md section 5.4 item 4).
    ``max_attempts`` and ``total_s`` bound the retries of one server's push; between
    attempts the pause doubles from ``backoff_initial_s`` up to ``backoff_max_s``.
    """

    call_timeout_s: float = 30.0
    max_attempts: int = 10
    total_s: float = 60.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("call_timeout_s", "total_s", "backoff_initial_s", "backoff_max_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ValueError(f"max_attempts must be an integer, got {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be at least backoff_initial_s")


def weights_request_id(epoch: int, version: int, instance: str) -> str:
    """The one request id of pushing ``version`` to ``instance`` by the coordinator of
    ``epoch``: every retry sends it again, so the policy server answers a retry of a
    push it already installed from its record instead of installing twice (docs/spec.md
    section 2.8)."""
    request_id = f"weights-e{epoch}-v{version}-{instance}"
    if len(request_id) > _MAX_REQUEST_ID:
        raise ValueError(f"request id longer than {_MAX_REQUEST_ID} characters: {request_id!r}")
    return request_id


class GiveUp(enum.Enum):
    """Why a push to one server stopped trying."""

    NOT_TRANSIENT = "not_transient"
    ATTEMPTS = "attempts"
    TIME = "time"


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """After a failed attempt: try again after ``pause_s``, or give up (``give_up``)."""

    give_up: GiveUp | None
    pause_s: float
    reason: str

    @property
    def retry(self) -> bool:
        return self.give_up is None


def backoff_s(settings: WeightSyncSettings, attempts_made: int) -> float:
    """The pause after the ``attempts_made``-th failed attempt (1-based)."""
    return doubling_pause_s(settings.backoff_initial_s, settings.backoff_max_s, attempts_made)


def decide_retry(
    settings: WeightSyncSettings,
    *,
    attempts_made: int,
    started_at: float,
    now: float,
    transient: bool,
) -> RetryDecision:
    """Whether a push whose ``attempts_made``-th attempt just failed tries again.

    A failure that is not transient (a refusal a retry would only repeat) gives up at
    once. Otherwise the push retries after the backoff, unless it made
    ``max_attempts`` attempts or the pause would end past ``total_s`` after
    ``started_at``.
    """
    if not transient:
        return RetryDecision(GiveUp.NOT_TRANSIENT, 0.0, "the failure is not transient")
    if attempts_made >= settings.max_attempts:
        return RetryDecision(
            GiveUp.ATTEMPTS, 0.0, f"{attempts_made} attempt(s) made, the most allowed"
        )
    pause_s = backoff_s(settings, attempts_made)
    if now + pause_s >= started_at + settings.total_s:
        return RetryDecision(
            GiveUp.TIME,
            0.0,
            f"{now - started_at:.1f}s spent; another attempt would end past {settings.total_s:g}s",
        )
    return RetryDecision(None, pause_s, f"transient; attempt {attempts_made + 1} in {pause_s:g}s")


def call_timeout_s(settings: WeightSyncSettings, *, started_at: float, now: float) -> float:
    """The timeout of the next attempt: ``call_timeout_s``, clamped to the time the push
    has left (never below a tenth of a second, so a last attempt can still answer)."""
    left = started_at + settings.total_s - now
    return max(0.1, min(settings.call_timeout_s, left))


class WeightSyncError(CoordinatorError):
    """A push of new weights to a policy server failed for good.

    ``instance`` is the server, ``version`` the weights version pushed, ``attempts`` the
    attempts made and ``status`` the last failure as the wire said it (the gRPC code,
    with the protocol reason when the server sent one). ``reason`` is that failure's
    reason, or ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED`` for a transport failure that ran
    out of retries, or ``PROTOCOL_VIOLATION`` for any other failure without a reason.
    ``installed_version`` is set when the server refused the version for being below
    the one it holds (:func:`installed_version_refused`).
    """

    def __init__(
        self,
        reason: Reason,
        *,
        instance: str,
        version: int,
        attempts: int,
        status: str,
        detail: str,
        installed_version: int | None = None,
    ) -> None:
        super().__init__(
            reason,
            f"pushing weights version {version} to {instance} failed after {attempts} "
            f"attempt(s); last status {status}: {detail}",
            {
                "participant": instance,
                "weights_version": str(version),
                "attempts": str(attempts),
                "status": status,
            },
        )
        self.instance = instance
        self.version = version
        self.attempts = attempts
        self.status = status
        self.detail = detail
        self.installed_version = installed_version
        if installed_version is not None:
            self.metadata["installed_version"] = str(installed_version)

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_weight_sync_error,
            (
                self.reason,
                self.instance,
                self.version,
                self.attempts,
                self.status,
                self.detail,
                self.installed_version,
            ),
        )


def _rebuild_weight_sync_error(
    reason: Reason,
    instance: str,
    version: int,
    attempts: int,
    status: str,
    detail: str,
    installed_version: int | None,
) -> WeightSyncError:
    return WeightSyncError(
        reason,
        instance=instance,
        version=version,
        attempts=attempts,
        status=status,
        detail=detail,
        installed_version=installed_version,
    )


def installed_version_refused(reason: Reason | None, metadata: Mapping[str, str]) -> int | None:
    """The newer version a policy server holds, when a push was refused for going below
    it (docs/spec.md section 5.4 item 4: ``INVALID_ARGUMENT``, metadata ``field`` =
    ``weights_version`` and ``installed_version``); ``None`` for any other failure.
    Read from the reason and metadata only, never from the message."""
    if reason is not Reason.INVALID_ARGUMENT or metadata.get("field") != "weights_version":
        return None
    text = metadata.get("installed_version", "")
    if not text.isascii() or not text.isdigit():
        return None
    return int(text)


def restored_push_version(restored: int, refused_at: Iterable[int]) -> int:
    """The version a restored trainer pushes its restored weights at (docs/spec.md
    section 6.11 item 6): the snapshot's ``restored`` version, unless a policy server
    that kept running holds a newer one (``refused_at``: the installed versions named by
    the refusals); then one above the newest of those, so that every server installs
    the restored weights and every later version is above anything a server holds."""
    newest = max(refused_at, default=None)
    if newest is None or newest < restored:
        return restored
    return newest + 1


def give_up_reason(reason: Reason | None, code_name: str | None, transient: bool) -> Reason:
    """The reason a :class:`WeightSyncError` carries for the last failure."""
    if reason is not None:
        return reason
    if code_name == "DEADLINE_EXCEEDED":
        return Reason.DEADLINE_EXCEEDED
    if transient:
        return Reason.UNAVAILABLE
    return Reason.PROTOCOL_VIOLATION


# The key of the manifest's ``extra`` that holds the weights version (docs/spec.md
# section 8.6), written and read only here.
WEIGHTS_VERSION_KEY = "weights_version"


def weights_extra(version: int | None) -> dict[str, int]:
    """The manifest ``extra`` entry recording ``version`` (nothing before any)."""
    return {} if version is None else {WEIGHTS_VERSION_KEY: version}


def weights_version_of(extra: Mapping[str, object], checkpoint_id: str) -> int | None:
    """The weights version a snapshot recorded; ``None`` if it recorded none. A value
    that is not an integer >= 0 is a bad manifest (``INVALID_CHECKPOINT_STATE``)."""
    if WEIGHTS_VERSION_KEY not in extra:
        return None
    value = extra[WEIGHTS_VERSION_KEY]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CoordinatorError(
            Reason.INVALID_CHECKPOINT_STATE,
            f"snapshot {checkpoint_id!r}: extra.{WEIGHTS_VERSION_KEY} must be an integer "
            f">= 0, got {value!r}",
            {"checkpoint_id": checkpoint_id, "field": f"extra.{WEIGHTS_VERSION_KEY}"},
        )
    return value
