"""Fault injection for the applications: a loopback proxy that loses or delays replies.

``turnpoint demo --chaos N`` kills and pauses processes of the job and, through
:class:`FaultProxy`, loses and delays replies between the trainer and its participants.
"""

from turnpoint.apps.chaos._proxy import FaultProxy, ProxyMode, ProxyStats

__all__ = ["FaultProxy", "ProxyMode", "ProxyStats"]
