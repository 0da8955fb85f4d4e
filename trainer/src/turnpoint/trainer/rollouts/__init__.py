"""The rollout side (docs/spec.md sections 6 and 7.6): the rollout client, its pure
ledger, attempts, rollout values, the Run-stream reader and rollout deadlines.

Nothing is imported here, so a pure module of this package imports alone.
"""
