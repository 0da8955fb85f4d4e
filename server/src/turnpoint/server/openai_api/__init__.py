"""An OpenAI-compatible HTTP endpoint in front of a policy participant (the ``openai``
extra: aiohttp; docs/spec.md section 12).

Importing this module imports aiohttp; ``import turnpoint.server`` does not import it.

:class:`ChatEndpoint` serves ``POST /v1/chat/completions`` (whole or streamed as
server-sent events) and ``GET /v1/models`` for one :class:`~turnpoint.participant_sdk.
ParticipantRuntime` hosting a policy model, configured by :class:`EndpointOptions`.
Every call names its episode in the ``X-Turnpoint-Rollout`` and ``X-Turnpoint-Attempt``
headers and goes through the participant's admission: held while a snapshot is open.
A :class:`ChatTemplate` turns :class:`ChatMessage` s into prompt tokens and tokens into
text; it raises :class:`TemplateError` for text its model cannot read.
"""

from turnpoint.server.openai_api._chat import (
    ATTEMPT_HEADER,
    ROLLOUT_HEADER,
    ChatMessage,
    ChatTemplate,
    TemplateError,
)
from turnpoint.server.openai_api._endpoint import ChatEndpoint, EndpointOptions

__all__ = [
    "ATTEMPT_HEADER",
    "ROLLOUT_HEADER",
    "ChatEndpoint",
    "ChatMessage",
    "ChatTemplate",
    "EndpointOptions",
    "TemplateError",
]
