"""The trainer anchor (docs/spec.md section 8.8): the anchor source a snapshot starts
with, the torch distributed checkpoint writer and loader, and the multi-rank anchor.

Nothing is imported here, so a pure module of this package imports alone.
"""
