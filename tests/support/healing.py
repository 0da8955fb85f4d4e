"""A trainer facade that heals in place, as the heal tests build it (docs/spec.md
section 7.15): a fast liveness watch, no periodic snapshots, the given launcher."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tests.support.participants import TOKEN
from turnpoint.trainer import (
    Checkpointing,
    CoordinatorConfig,
    Launcher,
    TorchAnchorSource,
    torch_anchor_loader,
)


def healing_facade(
    root: Path,
    participants: Mapping[str, str],
    launcher: Launcher,
    *,
    lost_after_s: float = 2.0,
    config: Mapping[str, Any] | None = None,
    **options: Any,
) -> Checkpointing:
    """``Checkpointing`` over ``participants`` that watches liveness every 0.25 s, calls
    one lost after ``lost_after_s`` and heals it through ``launcher``; ``config`` adds
    to the coordinator's configuration, ``options`` to the facade's."""
    model = torch.nn.Linear(2, 2)
    return Checkpointing(
        CoordinatorConfig(
            snapshot_root=root,
            control_timeout_s=10.0,
            liveness_interval_s=0.25,
            participant_lost_after_s=lost_after_s,
            **(config or {}),
        ),
        participants,
        token=TOKEN,
        anchor=TorchAnchorSource(model, None, step=lambda: 0),
        load_anchor=torch_anchor_loader(model, None),
        periodic=False,
        final_snapshot=False,
        watch_liveness=True,
        launcher=launcher,
        **options,
    )
