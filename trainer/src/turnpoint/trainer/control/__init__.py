"""The control plane (docs/spec.md sections 4 and 7.1-7.3): the coordinator, its
client for one participant, the fan-out, identity, topology and liveness.

Nothing is imported here, so a pure module of this package imports alone.
"""
