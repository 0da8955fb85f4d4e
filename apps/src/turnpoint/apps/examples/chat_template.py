"""The guessing task's chat template: OpenAI messages to :class:`Token` s and back.

The vocabulary is words, one per token: ``bos``, ``eos``, ``turn``, ``range``, the digits
``0`` to ``9``, ``higher``, ``lower``, ``correct`` and ``invalid``; a message's content is
such words separated by white space (case ignored). The prompt is ``bos``, then each
message in order, an assistant message preceded by ``turn``, and a last ``turn``: the
model speaks next. So the messages ``user: "range 2 5"``, ``assistant: "3"``,
``tool: "higher"`` are exactly :func:`~turnpoint.apps.examples.encode_context` of that
task and turn. A completion's text is its words joined by single spaces, ``eos`` (which
ends it) left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from turnpoint.apps.examples._task import Token
from turnpoint.server.openai_api import ChatMessage, TemplateError

_WORDS: Final[dict[int, str]] = {
    **{int(token): token.name.lower() for token in Token},
    **{Token.DIGIT_0 + digit: str(digit) for digit in range(10)},
}
_TOKENS: Final = {word: int(token) for token, word in _WORDS.items()}
MODEL_NAME: Final = "turnpoint-tiny-guess"


class GuessChatTemplate:
    """:class:`~turnpoint.server.openai_api.ChatTemplate` over the guessing vocabulary."""

    def prompt(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]:
        tokens = [int(Token.BOS)]
        for index, message in enumerate(messages):
            if message.role == "assistant":
                tokens.append(int(Token.TURN))
            for word in message.content.lower().split():
                token = _TOKENS.get(word)
                if token is None:
                    shown = word if len(word) <= 20 else word[:20] + "..."
                    raise TemplateError(index, f"'{shown}' is not a word of the model's vocabulary")
                tokens.append(token)
        tokens.append(int(Token.TURN))
        return tuple(tokens)

    def text(self, token_ids: Sequence[int]) -> str:
        return " ".join(_WORDS[token] for token in token_ids if token != Token.EOS)

    def is_end(self, token_id: int) -> bool:
        return token_id == Token.EOS
