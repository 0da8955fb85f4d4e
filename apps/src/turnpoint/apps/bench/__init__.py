"""``turnpoint bench``: what the control path costs, measured on this machine.

Five figures (the README's "Benchmarks" section defines them; docs/spec.md section 3 has
the reference transport figures):

- the control path of one snapshot (prepare, commit, publish, resume) through the real
  coordinator and real participants, every snapshot root on tmpfs, against a no-op
  bidi gRPC round trip (the floor) and a no-op HTTP+JSON call (the control plane this
  project replaces), for growing numbers of participants hosted in a few worker
  processes;
- the durable commit: the same snapshot on disk, with the fsyncs it takes;
- the rollout throughput of the demo trainer with periodic snapshots vs none, and the
  admission-closed seconds per snapshot;
- the participant SDK's bookkeeping per episode;
- the time from a cold start after a crash to the first redispatched rollout.

:func:`run_bench` runs them and returns a :class:`BenchReport`;
:func:`add_bench_parser` registers the ``bench`` subcommand.

The names are loaded on first use: the measurements pull in the trainer (and torch),
which neither ``turnpoint --help`` nor the bench's own worker processes should pay for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turnpoint.apps.bench._bench import BenchReport, run_bench
    from turnpoint.apps.bench._cli import add_bench_parser, render_table
    from turnpoint.apps.bench._control_overhead import OverheadRow
    from turnpoint.apps.bench._options import (
        FULL_SIZES,
        QUICK_SIZES,
        BenchOptions,
        WorkloadOptions,
    )
    from turnpoint.apps.bench._workload import RestoreResult, ThroughputResult

__all__ = [
    "FULL_SIZES",
    "QUICK_SIZES",
    "BenchOptions",
    "BenchReport",
    "OverheadRow",
    "RestoreResult",
    "ThroughputResult",
    "WorkloadOptions",
    "add_bench_parser",
    "render_table",
    "run_bench",
]

_MODULE_OF = {
    "FULL_SIZES": "_options",
    "QUICK_SIZES": "_options",
    "BenchOptions": "_options",
    "WorkloadOptions": "_options",
    "BenchReport": "_bench",
    "run_bench": "_bench",
    "add_bench_parser": "_cli",
    "render_table": "_cli",
    "OverheadRow": "_control_overhead",
    "RestoreResult": "_workload",
    "ThroughputResult": "_workload",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
