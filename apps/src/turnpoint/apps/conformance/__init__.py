"""``turnpoint conformance``: check a participant against the specification, over the wire.

The kit acts as a trainer's coordinator against one target (``HOST:PORT``) and runs one
named check per participant rule of docs/spec.md, each citing its section. It drives a
resources server directly and an agent through its own ``Run``; what a task looks like
comes from a workload file. :func:`run_conformance` returns a
:class:`ConformanceReport` (pass, fail or skipped with why, per check);
``turnpoint conformance`` prints it as a table or JSON and exits 1 on any failure.

It imports only the standard library, grpc and protobuf, so it runs on a light install.
"""

from turnpoint.apps.conformance._cli import add_conformance_parser, conformance_command
from turnpoint.apps.conformance._kit import Workload, WorkloadError
from turnpoint.apps.conformance._report import (
    CheckResult,
    ConformanceReport,
    Outcome,
    render_table,
    report_to_json,
)
from turnpoint.apps.conformance._runner import CHECKS, Check, ConformanceOptions, run_conformance

__all__ = [
    "CHECKS",
    "Check",
    "CheckResult",
    "ConformanceOptions",
    "ConformanceReport",
    "Outcome",
    "Workload",
    "WorkloadError",
    "add_conformance_parser",
    "conformance_command",
    "render_table",
    "report_to_json",
    "run_conformance",
]
