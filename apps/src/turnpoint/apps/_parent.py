"""A child of a supervisor that must not outlive it (the demo's participants and
trainer).

The demo's supervisor starts each child in a process group of its own (so that the
kernel never wakes one that ``--chaos`` paused), so a signal to the supervisor's group
no longer reaches them. Instead each asks the kernel to SIGKILL it when the supervisor
dies: the supervisor names itself in ``$TURNPOINT_PARENT_PID``, and the child, once,
calls :func:`die_with_parent_from_env` (and drops the variable, so that what it starts
in turn is not bound to the supervisor).
"""

from __future__ import annotations

import os
from typing import Final

from turnpoint.server import die_with_parent

PARENT_PID_ENV: Final = "TURNPOINT_PARENT_PID"


def die_with_parent_from_env() -> None:
    """Die with the process ``$TURNPOINT_PARENT_PID`` names, if it is set (at once, if
    that process is no longer this one's parent)."""
    text = os.environ.pop(PARENT_PID_ENV, None)
    if text is None:
        return
    try:
        parent = int(text)
    except ValueError:
        raise ValueError(f"${PARENT_PID_ENV} must be a process id, got {text!r}") from None
    die_with_parent(parent)
