"""Token-prefix recovery: a generation a checkpoint cut, and how it continues.

docs/spec.md section 5.5. A policy model that can cut stops a streaming generation at a
token boundary when a checkpoint closes admission and ends the stream with a cut marker.
The agent keeps what it got as a :class:`Generation`: the prompt, the tokens so far,
their log-probabilities and the weights version of each token. That prefix is part of
the agent's saved turn, so a snapshot saves it and a restore brings it back; the next
request continues from prompt plus prefix with the budget that is left, and the tokens
of every segment are appended in order, never twice and never dropped.

Pure: no grpc, no asyncio, no clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

_FIELDS = frozenset(
    {
        "prompt_token_ids",
        "max_new_tokens",
        "token_ids",
        "logprobs",
        "weights_versions",
        "cuts",
        "finished",
        "discarded_tokens",
    }
)


class WeightsChange(enum.Enum):
    """What to do with a generation whose tokens came from more than one weights version.

    ``KEEP`` trains it as it is (every token carries its version, so the trainer can
    tell); ``RERUN`` discards the generation and asks for it again from the prompt, so
    that every token of the turn comes from one version.
    """

    KEEP = "keep"
    RERUN = "rerun"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request to the policy: the prompt (with any prefix appended) and what is left."""

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    accept_cut: bool


@dataclass(frozen=True, slots=True)
class Generation:
    """A generation of one turn, possibly cut and continued, possibly still unfinished.

    ``token_ids``, ``logprobs`` and ``weights_versions`` are parallel, one entry per
    token. ``cuts`` counts the checkpoints that cut it; ``finished`` is true once the
    model ended it on its own (end of text or ``max_new_tokens``). ``discarded_tokens``
    counts tokens generated and then thrown away by a :attr:`WeightsChange.RERUN`.
    """

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    weights_versions: tuple[int, ...] = ()
    cuts: int = 0
    finished: bool = False
    discarded_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not len(self.token_ids) == len(self.logprobs) == len(self.weights_versions):
            raise ValueError("token_ids, logprobs and weights_versions differ in length")
        if len(self.token_ids) > self.max_new_tokens:
            raise ValueError(
                f"{len(self.token_ids)} tokens exceed max_new_tokens {self.max_new_tokens}"
            )
        if self.cuts < 0 or self.discarded_tokens < 0:
            raise ValueError("cuts and discarded_tokens must be >= 0")

    @property
    def remaining(self) -> int:
        """How many more tokens the model may generate."""
        return self.max_new_tokens - len(self.token_ids)

    @property
    def spans_weight_update(self) -> bool:
        return len(set(self.weights_versions)) > 1

    def matches(self, prompt_token_ids: Sequence[int], max_new_tokens: int) -> bool:
        """Whether this is the generation a request for this prompt and budget continues."""
        return (
            self.prompt_token_ids == tuple(prompt_token_ids)
            and self.max_new_tokens == max_new_tokens
        )

    def next_request(self) -> GenerationRequest:
        """The request that continues from prompt plus prefix (only while unfinished)."""
        if self.finished:
            raise ValueError("the generation is finished; nothing to continue")
        return GenerationRequest(
            self.prompt_token_ids + self.token_ids, self.remaining, accept_cut=True
        )

    def extend(
        self, token_ids: Sequence[int], logprobs: Sequence[float], weights_version: int
    ) -> Generation:
        """Append one streamed chunk's tokens, all produced by ``weights_version``."""
        if len(token_ids) != len(logprobs):
            raise ValueError("a chunk's token_ids and logprobs differ in length")
        if len(self.token_ids) + len(token_ids) > self.max_new_tokens:
            raise ValueError("the model streamed more tokens than max_new_tokens allows")
        return replace(
            self,
            token_ids=self.token_ids + tuple(token_ids),
            logprobs=self.logprobs + tuple(logprobs),
            weights_versions=self.weights_versions + (weights_version,) * len(token_ids),
        )

    def cut(self) -> Generation:
        """A checkpoint cut the stream: keep the prefix, continue later."""
        return replace(self, cuts=self.cuts + 1)

    def finish(self) -> Generation:
        return replace(self, finished=True)

    def discard(self) -> Generation:
        """Throw the tokens away and start again from the prompt (a RERUN)."""
        return Generation(
            self.prompt_token_ids,
            self.max_new_tokens,
            cuts=self.cuts,
            discarded_tokens=self.discarded_tokens + len(self.token_ids),
        )

    # -- saved form (a JSON object inside the agent's record, docs/spec.md section 8) ---

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "max_new_tokens": self.max_new_tokens,
            "token_ids": list(self.token_ids),
            "logprobs": list(self.logprobs),
            "weights_versions": list(self.weights_versions),
            "cuts": self.cuts,
            "finished": self.finished,
            "discarded_tokens": self.discarded_tokens,
        }

    @classmethod
    def from_json(cls, value: object) -> Generation:
        """Parse the saved form strictly; ``ValueError`` names what does not fit."""
        if not isinstance(value, Mapping):
            raise ValueError("generation must be an object")
        if set(value) != _FIELDS:
            raise ValueError(f"generation fields {sorted(value)} are not {sorted(_FIELDS)}")

        def integers(name: str, least: int) -> tuple[int, ...]:
            items = value[name]
            if not isinstance(items, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= least for v in items
            ):
                raise ValueError(f"generation {name} must be a list of integers >= {least}")
            return tuple(items)

        def integer(name: str, least: int) -> int:
            item = value[name]
            if isinstance(item, bool) or not isinstance(item, int) or item < least:
                raise ValueError(f"generation {name} must be an integer >= {least}")
            return item

        logprobs = value["logprobs"]
        if not isinstance(logprobs, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in logprobs
        ):
            raise ValueError("generation logprobs must be a list of finite numbers")
        if not isinstance(value["finished"], bool):
            raise ValueError("generation finished must be a boolean")
        return cls(
            prompt_token_ids=integers("prompt_token_ids", 0),
            max_new_tokens=integer("max_new_tokens", 1),
            token_ids=integers("token_ids", 0),
            logprobs=tuple(float(v) for v in logprobs),
            weights_versions=integers("weights_versions", 0),
            cuts=integer("cuts", 0),
            finished=value["finished"],
            discarded_tokens=integer("discarded_tokens", 0),
        )
