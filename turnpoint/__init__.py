"""turnpoint: checkpoint control protocol for agentic-RL trainers and Gym servers.

Subpackages:

- :mod:`turnpoint.v1`: generated protobuf messages and gRPC stubs (``turnpoint.v1``).
- :mod:`turnpoint.participant_sdk`: what a Gym server links to take part.
- :mod:`turnpoint.server`: hosts participants as gRPC servers; example participants.
- :mod:`turnpoint.trainer`: the coordinator a trainer embeds.
"""

from turnpoint.ids import EpisodeId, InvalidIdError

__all__ = ["PROTOCOL_VERSION", "EpisodeId", "InvalidIdError", "__version__"]

__version__ = "0.1.0"
PROTOCOL_VERSION = "turnpoint.v1"
