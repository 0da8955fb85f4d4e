"""The guess environment seen from a trainer: its rollouts and its training samples.

What a trainer needs to know about the example environment and nothing about turnpoint,
kept here so that ``embedded_trainer.py`` shows only the embedding.
"""

from __future__ import annotations

from collections.abc import Sequence

from turnpoint.apps.demo._learner import Sample
from turnpoint.apps.examples._participants import GUESS, GUESS_GROUP
from turnpoint.apps.examples._task import make_prompt
from turnpoint.trainer import Rollout, RolloutOutcome, RolloutResult


def guess_rollouts(group: int, size: int, seed: int, agents: Sequence[str]) -> list[Rollout]:
    """The ``size`` siblings of prompt group ``group``: even groups score each sibling
    alone (``guess``), odd ones as a group (``guess-group``); agents in turn."""
    environment = GUESS if group % 2 == 0 else GUESS_GROUP
    gid, task = f"g{group:05d}", make_prompt(group, seed).to_dict()
    return [
        Rollout(
            rollout_id=f"{gid}-s{i}",
            prompt_group_id=gid,
            sibling_index=i,
            group_size=size,
            environment=environment,
            instance=agents[(group * size + i) % len(agents)],
            task={
                "task": task,
                "environment": environment,
                "prompt_group_id": gid,
                "sibling_index": i,
                "group_size": size,
            },
        )
        for i in range(size)
    ]


def guess_sample(result: RolloutResult) -> Sample:
    """A rollout's result as a policy-gradient sample; a failed one trains with reward 0."""
    done = result.outcome is RolloutOutcome.COMPLETED
    out = result.output
    turns = out.get("turns", []) if done else []
    return Sample(
        group_id=result.prompt_group_id,
        turn_prompts=tuple(tuple(int(t) for t in p) for p in out.get("prompts", [])),
        turn_completions=tuple(tuple(int(t) for t in turn["completion"]) for turn in turns),
        reward=float(out.get("reward", 0.0)) if done else 0.0,
    )
