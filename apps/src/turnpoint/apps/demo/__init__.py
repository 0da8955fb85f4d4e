"""``turnpoint demo``: the main job, a real training run through an injected crash.

:func:`demo_command` is the command (:mod:`._command`); the supervisor (:mod:`._supervisor`) starts the
participants and the trainer, injects the crash and restarts the job; :mod:`._report`
holds the event-log contract, the statistics and the exactly-once audit;
:mod:`._timeline` draws the run; :mod:`._progress` shows it live; :mod:`._ray` runs the
participants as Ray actors.
"""

from turnpoint.apps.demo._command import add_demo_parser, demo_command
from turnpoint.apps.demo._progress import EventTail, ProgressState
from turnpoint.apps.demo._report import (
    AuditResult,
    DemoError,
    DemoReport,
    EventLog,
    EventLogError,
    Lineage,
    LineageError,
    RunLogs,
    audit,
    build_report,
    effective_lineage,
    load_run,
    parse_events,
    render_report,
)
from turnpoint.apps.demo._supervisor import (
    CRASH_POINTS,
    LEVELS,
    DemoOptions,
    DemoPaths,
    Launcher,
    Participant,
    ParticipantSpec,
    ProcessLauncher,
    prepare_out_dir,
    run_demo,
    trainer_command,
)
from turnpoint.apps.demo._timeline import render_timeline

__all__ = [
    "CRASH_POINTS",
    "LEVELS",
    "AuditResult",
    "DemoError",
    "DemoOptions",
    "DemoPaths",
    "DemoReport",
    "EventLog",
    "EventLogError",
    "EventTail",
    "Launcher",
    "Lineage",
    "LineageError",
    "Participant",
    "ParticipantSpec",
    "ProcessLauncher",
    "ProgressState",
    "RunLogs",
    "add_demo_parser",
    "audit",
    "build_report",
    "demo_command",
    "effective_lineage",
    "load_run",
    "parse_events",
    "prepare_out_dir",
    "render_report",
    "render_timeline",
    "run_demo",
    "trainer_command",
]
