"""The demo's tool-call audit over the logs of a real resources server (spec 6.12).

The example guess environment's resources server, served on ``127.0.0.1:0`` and driven
as the demo's agent drives it: attempt 0 runs turn 0's call, a snapshot holds the
session, a fresh server restores it for attempt 1, which re-sends turn 0's call with
its key (the agent had sealed turn 0 only), runs turn 1's and verifies. The audit reads
the server's own log. Honest, the re-sent call is answered from the record and the
audit passes; the ``ignores-record`` mutant runs it again and the audit must fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.mutants import IgnoresRecord
from tests.support.participants import TOKEN
from tests.support.scripted import ckpt, host_scripted, restore_id, wire_to
from turnpoint.apps.demo._report import (
    AuditResult,
    audit,
    parse_events,
    parse_execution_entries,
    parse_verifier_entries,
    read_jsonl,
)
from turnpoint.apps.examples._participants import GuessTools, VerifierLog
from turnpoint.apps.examples._task import make_prompt
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import ParticipantRuntime
from turnpoint.participant_sdk._effects import CallPosition, effect_key
from turnpoint.server import ResourcesClient
from turnpoint.v1 import types_pb2

ROLLOUT = "g0-s0"
FIRST = EpisodeId(ROLLOUT, 0)
TASK = {"task": make_prompt(0, 1).to_dict(), "environment": "guess"}


async def _play(root: Path, log: Path, runtime_class: type[ParticipantRuntime]) -> list[str]:
    """The episode across a snapshot and a restore; the replies attempt 1 trained with."""
    turn_0 = {"guess": 1, "turn": 0}
    async with (
        host_scripted(
            root,
            instance="tools",
            resources=GuessTools("tools", VerifierLog(log)),
            runtime_class=runtime_class,
        ) as tools,
        wire_to(tools, "unary") as wire,
    ):
        client = ResourcesClient(tools.address, token=TOKEN)
        try:
            await client.seed(FIRST, TASK)
            await client.call(
                FIRST, "check", turn_0, request_id=effect_key(ROLLOUT, CallPosition(0, 0))
            )
            prepared = await wire.prepare(ckpt(1), lease_s=60)
            assert prepared.phase == types_pb2.PHASE_PREPARED, prepared
            committed = await wire.commit(ckpt(1), "snap-1", [FIRST])
            await wire.resume(ckpt(1))
        finally:
            await client.aclose()
    continued = FIRST.next_attempt()
    async with (
        host_scripted(
            root,
            instance="tools",
            resources=GuessTools("tools", VerifierLog(log)),
            runtime_class=runtime_class,
        ) as tools,
        wire_to(tools, "unary") as wire,
    ):
        restored = await wire.restore(restore_id(1), "snap-1", committed, [FIRST])
        assert len(restored.installed) == 1
        await wire.resume(restore_id(1))
        client = ResourcesClient(tools.address, token=TOKEN)
        try:
            replies = [
                await client.call(
                    continued, "check", turn_0, request_id=effect_key(ROLLOUT, CallPosition(0, 0))
                ),
                await client.call(
                    continued,
                    "check",
                    {"guess": 2, "turn": 1},
                    request_id=effect_key(ROLLOUT, CallPosition(1, 0)),
                ),
            ]
            await client.verify(
                continued, {"guesses": [1, 2]}, request_id=effect_key(ROLLOUT, CallPosition(2, 0))
            )
        finally:
            await client.aclose()
    return [str(reply["reply"]) for reply in replies]


def _audit(log: Path, replies: list[str]) -> AuditResult:
    """The audit of a run that trained attempt 1 of the rollout, alone in its group."""
    lines = read_jsonl(log)
    verifier = parse_verifier_entries(lines)
    reward = next(entry.reward for entry in verifier if entry.attempt == 1)
    turns = [
        {"prompt": [1, turn], "completion": [2], "reply": reply, "answered_in": 1}
        for turn, reply in enumerate(replies)
    ]
    sample: dict[str, Any] = {"rollout_id": ROLLOUT, "attempt": 1, "reward": reward}
    events = [
        {"t": 1.0, "type": "start", "incarnation": 1, "restored_from": None, "step": 0},
        {
            "t": 2.0,
            "type": "rollout",
            "incarnation": 1,
            "group": 0,
            "sibling": 0,
            "environment": "guess",
            "resumed": True,
            "turns": 2,
            **sample,
        },
        {
            "t": 3.0,
            "type": "train_step",
            "incarnation": 1,
            "step": 1,
            "groups": [0],
            "rollouts": [{**sample, "turns": turns}],
            "mean_reward": reward,
        },
        {"t": 4.0, "type": "done", "incarnation": 1, "step": 1},
    ]
    return audit(
        parse_events(events), verifier, group_size=1, executions=parse_execution_entries(lines)
    )


@pytest.mark.parametrize(
    "runtime_class", [ParticipantRuntime, IgnoresRecord], ids=["honest", "ignores-record"]
)
async def test_a_call_re_sent_after_a_restore_is_applied_once_or_the_audit_fails(
    tmp_path: Path, runtime_class: type[ParticipantRuntime]
) -> None:
    log = tmp_path / "verifier-tools.jsonl"
    replies = await _play(tmp_path / "snapshots", log, runtime_class)
    result = _audit(log, replies)
    executions = parse_execution_entries(read_jsonl(log))
    if runtime_class is ParticipantRuntime:
        assert result.passed, result.reason
        assert result.tools is not None
        assert result.tools.line == "tool calls: 2 executed, each once; 1 answered from the record"
        assert [(e.attempt, e.turn) for e in executions] == [(0, 0), (1, 1)]
    else:
        assert [(e.attempt, e.turn) for e in executions] == [(0, 0), (1, 0), (1, 1)]
        assert not result.passed
        assert result.reason is not None
        assert result.reason.startswith(
            f"turn 0 of rollout {ROLLOUT} attempt 1 (trained in step 1) was applied twice"
        ), result.reason
