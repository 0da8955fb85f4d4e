"""What a person running a job sees (docs/spec.md sections 7.13 and 7.14): the pure
checkpoint history, the REST API and status page the trainer serves beside ``/metrics``.

Nothing is imported here, so the pure history imports alone.
"""
