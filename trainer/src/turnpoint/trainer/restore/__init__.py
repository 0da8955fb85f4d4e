"""Restoring a run (docs/spec.md sections 7.7, 7.11 and 7.15): the restorer, its plan,
the restart budget, and the decision that heals one lost participant in place.

Nothing is imported here, so a pure module of this package imports alone.
"""
