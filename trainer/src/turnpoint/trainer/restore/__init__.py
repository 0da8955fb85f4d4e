"""Restoring a run (docs/spec.md sections 7.7 and 7.11): the restorer, its plan, and
the restart budget.

Nothing is imported here, so a pure module of this package imports alone.
"""
