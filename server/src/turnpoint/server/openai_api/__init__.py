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

:class:`EgressRelay` (configured by :class:`RelayOptions`) is the only route from an
untrusted harness to that endpoint: per-episode credentials, every call recorded with its
disposition, held while a snapshot is open, replayed after a restore (section 12.7);
its HTTP tools too, each forwarded call keyed in the ``IDEMPOTENCY_HEADER`` (section 12.9).
:class:`OpaqueAgent` is the participant that runs one harness process per episode behind
it, each completed model or tool call a turn boundary; its ``episode_result`` sees the
episode's :class:`RelayEpisode` (the relay's journal of it).
"""

from turnpoint.server.openai_api._chat import (
    ATTEMPT_HEADER,
    ROLLOUT_HEADER,
    ChatMessage,
    ChatTemplate,
    TemplateError,
)
from turnpoint.server.openai_api._endpoint import ChatEndpoint, EndpointOptions
from turnpoint.server.openai_api._opaque_agent import HarnessFailedError, OpaqueAgent
from turnpoint.server.openai_api._relay import (
    IDEMPOTENCY_HEADER,
    EgressRelay,
    RelayEpisode,
    RelayError,
    RelayOptions,
)

__all__ = [
    "ATTEMPT_HEADER",
    "IDEMPOTENCY_HEADER",
    "ROLLOUT_HEADER",
    "ChatEndpoint",
    "ChatMessage",
    "ChatTemplate",
    "EgressRelay",
    "EndpointOptions",
    "HarnessFailedError",
    "OpaqueAgent",
    "RelayEpisode",
    "RelayError",
    "RelayOptions",
    "TemplateError",
]
