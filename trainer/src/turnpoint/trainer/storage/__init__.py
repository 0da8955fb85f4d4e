"""Snapshots on disk (docs/spec.md section 8): the manifest and its bytes, and the
layout that publishes, loads and retires snapshots.

Nothing is imported here, so a pure module of this package imports alone.
"""
