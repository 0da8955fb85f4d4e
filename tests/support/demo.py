"""The demo command and the short run the end-to-end demo tests share."""

from __future__ import annotations

import sys

DEMO = (sys.executable, "-m", "turnpoint.apps._cli", "demo")
SHORT = (
    "--steps",
    "8",
    "--groups-per-step",
    "2",
    "--group-size",
    "2",
    "--agents",
    "2",
    "--snapshot-interval",
    "0.2",
    # Episodes of a few tenths of a second instead of milliseconds: every snapshot then
    # cuts rollouts mid-episode, whatever the machine's speed.
    "--turn-delay",
    "0.1",
    "--no-progress",
)
