"""Example participants the demo runs: a tiny policy model and the guessing environment.

The pieces here are pure torch and pure Python (no grpc, no asyncio) so that the servers
wrapping them stay thin and the learning loop can be tested in one process:

- :mod:`turnpoint.apps.examples._policy_model`: :class:`TinyPolicy`, the model the
  policy server samples from and the trainer updates.
- :mod:`turnpoint.apps.examples._task`: the multi-turn guessing task, its tool and its
  two verifiers (per sibling and group-scored).
"""

from typing import TYPE_CHECKING, Any

from turnpoint.apps.examples._task import (
    GROUP_WEIGHT,
    MAX_NEW_TOKENS_PER_TURN,
    VOCAB_SIZE,
    Answer,
    Reply,
    Task,
    Token,
    ToolResult,
    ToolSession,
    Turn,
    encode_context,
    episode_answer,
    group_rewards,
    is_finished,
    make_prompt,
    parse_guess,
    per_sibling_reward,
    tool_call,
)

__all__ = [
    "GROUP_WEIGHT",
    "MAX_NEW_TOKENS_PER_TURN",
    "VOCAB_SIZE",
    "Answer",
    "Reply",
    "SampledToken",
    "Task",
    "TinyPolicy",
    "Token",
    "ToolResult",
    "ToolSession",
    "Turn",
    "encode_context",
    "episode_answer",
    "group_rewards",
    "is_finished",
    "make_prompt",
    "parse_guess",
    "per_sibling_reward",
    "tool_call",
]

if TYPE_CHECKING:
    from turnpoint.apps.examples._policy_model import SampledToken, TinyPolicy

_TORCH_NAMES = frozenset({"SampledToken", "TinyPolicy"})


def __getattr__(name: str) -> Any:
    # Imported on first use: agents and resources servers load this package and need no
    # torch, whose import costs each of their processes seconds at start-up.
    if name in _TORCH_NAMES:
        from turnpoint.apps.examples import _policy_model

        return getattr(_policy_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
