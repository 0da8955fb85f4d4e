"""Taking snapshots (docs/spec.md sections 7.4, 7.5 and 7.8): the driver, the pure
attempt and prepare-round core, the pump, reports and recovery levels.

Nothing is imported here, so a pure module of this package imports alone.
"""
