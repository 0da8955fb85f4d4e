"""turnpoint: checkpoint control protocol for agentic-RL trainers and Gym servers.

The core (this package's own modules): :mod:`turnpoint.ids`, :mod:`turnpoint.errors`,
:mod:`turnpoint.protocol` (the protocol's vocabulary), :mod:`turnpoint.auth`, and the
generated :mod:`turnpoint.v1`. The libraries built on it:

- :mod:`turnpoint.participant_sdk`: what a Gym server links to take part.
- :mod:`turnpoint.server`: hosts participants as gRPC servers.
- :mod:`turnpoint.trainer`: the coordinator a trainer embeds.

The applications (the ``turnpoint`` command, demo, bench, example participants) live in
:mod:`turnpoint.apps`; no library imports them.
"""

from turnpoint.ids import EpisodeId, InvalidIdError
from turnpoint.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "EpisodeId", "InvalidIdError", "__version__"]

__version__ = "0.1.0"
