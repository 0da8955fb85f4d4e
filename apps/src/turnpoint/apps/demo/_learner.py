"""One policy-gradient update from finished rollouts: REINFORCE with group-relative advantages.

Each sample is one finished episode: the prompt the policy saw and the tokens it produced
in every turn, the verifier's reward and the prompt group it belongs to. A sample's
advantage is its reward minus the mean reward of its group, divided by the group's standard
deviation (the GRPO normalisation), so the baseline needs no value model and a group whose
siblings all scored the same teaches nothing. Log-probabilities are recomputed with the
trainer's own copy of the model rather than trusted from the policy server, which keeps the
update correct even if the server sampled with slightly different weights.

Tool replies and the prompt are context only; just the tokens the policy generated are
scored.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# Keeps the division finite for a group whose rewards are almost but not exactly equal.
_STD_EPSILON = 1e-6


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished episode, turn by turn, with its reward and prompt group."""

    group_id: str
    turn_prompts: tuple[tuple[int, ...], ...]
    turn_completions: tuple[tuple[int, ...], ...]
    reward: float

    def __post_init__(self) -> None:
        if len(self.turn_prompts) != len(self.turn_completions):
            raise ValueError(
                f"sample of group {self.group_id!r} has {len(self.turn_prompts)} prompts "
                f"but {len(self.turn_completions)} completions"
            )
        if not math.isfinite(self.reward):
            raise ValueError(f"sample of group {self.group_id!r} has a non-finite reward")

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(completion) for completion in self.turn_completions)


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one update did. ``grad_norm`` is measured before clipping."""

    loss: float
    mean_reward: float
    grad_norm: float
    num_samples: int
    num_groups: int
    num_tokens: int
    weights_version: int


class TrainablePolicy(Protocol):
    """What the update needs from a model (``TinyPolicy`` is one)."""

    weights_version: int

    def sequence_logprobs(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float = 1.0,
    ) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


def group_advantages(samples: Sequence[Sample]) -> list[float]:
    """Per-sample advantage: reward minus its group's mean, over the group's std.

    A group of one has no baseline to compare with and gets advantage 0, as does every
    sibling of a group whose rewards are all equal.
    """
    by_group: dict[str, list[float]] = {}
    for sample in samples:
        by_group.setdefault(sample.group_id, []).append(sample.reward)
    moments: dict[str, tuple[float, float]] = {}
    for group_id, rewards in by_group.items():
        mean = sum(rewards) / len(rewards)
        variance = sum((reward - mean) ** 2 for reward in rewards) / len(rewards)
        moments[group_id] = (mean, math.sqrt(variance))
    advantages: list[float] = []
    for sample in samples:
        mean, std = moments[sample.group_id]
        advantages.append(0.0 if std == 0.0 else (sample.reward - mean) / (std + _STD_EPSILON))
    return advantages


def policy_gradient_step(
    model: TrainablePolicy,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    *,
    max_grad_norm: float = 1.0,
    temperature: float = 1.0,
) -> StepStats:
    """Apply one REINFORCE update for ``samples`` and bump ``model.weights_version``.

    The loss is ``-mean_i(advantage_i * log p(generated tokens of sample i))``, with the
    log-probability summed over every turn of the episode. ``temperature`` must match the
    one the samples were generated with for the update to be on-policy. Gradients are
    clipped to ``max_grad_norm``. Deterministic for the same model, optimizer state and
    samples.
    """
    if not samples:
        raise ValueError("policy_gradient_step needs at least one sample")
    advantages = group_advantages(samples)
    pairs: list[tuple[Sequence[int], Sequence[int]]] = []
    owners: list[int] = []
    for index, sample in enumerate(samples):
        for prompt, completion in zip(sample.turn_prompts, sample.turn_completions, strict=True):
            pairs.append((prompt, completion))
            owners.append(index)

    parameters = list(model.parameters())
    optimizer.zero_grad(set_to_none=True)
    sample_logprobs = torch.zeros(len(samples))
    if pairs:
        turn_logprobs = model.sequence_logprobs(pairs, temperature)
        sample_logprobs = sample_logprobs.index_add(0, torch.tensor(owners), turn_logprobs)
    advantage_tensor = torch.tensor(advantages, dtype=sample_logprobs.dtype)
    loss = -(advantage_tensor * sample_logprobs).sum() / len(samples)
    if loss.requires_grad:
        torch.autograd.backward(loss)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
    optimizer.step()
    model.weights_version += 1
    return StepStats(
        loss=float(loss.detach()),
        mean_reward=sum(sample.reward for sample in samples) / len(samples),
        grad_norm=grad_norm,
        num_samples=len(samples),
        num_groups=len({sample.group_id for sample in samples}),
        num_tokens=sum(sample.num_generated_tokens for sample in samples),
        weights_version=model.weights_version,
    )
