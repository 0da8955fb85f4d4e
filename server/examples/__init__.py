"""Example participants the demo runs: a tiny policy model and the guessing environment.

The pieces here are pure torch and pure Python (no grpc, no asyncio) so that the servers
wrapping them stay thin and the learning loop can be tested in one process:

- :mod:`turnpoint.server.examples._policy_model`: :class:`TinyPolicy`, the model the
  policy server samples from and the trainer updates.
- :mod:`turnpoint.server.examples._task`: the multi-turn guessing task, its tool and its
  two verifiers (per sibling and group-scored).
"""

from turnpoint.server.examples._policy_model import SampledToken, TinyPolicy
from turnpoint.server.examples._task import (
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
