"""The demo's tool-call audit over synthetic logs (docs/spec.md section 6.12).

One training step of one prompt group (two siblings, two turns each). Each test breaks
one thing a resources server or an agent could get wrong and checks that the audit
names it; the good run checks the counts of the report's ``tool calls:`` line.
"""

from __future__ import annotations

from typing import Any

from turnpoint.apps.demo._report import (
    audit,
    parse_events,
    parse_execution_entries,
    parse_verifier_entries,
)

SIBLINGS = 2
TURNS = 2


class _Logs:
    def __init__(self) -> None:
        self.t = 100.0
        self.executions: list[dict[str, Any]] = []
        self.verifier: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []

    def tick(self) -> float:
        self.t += 0.1
        return self.t

    def execute(self, rollout_id: str, attempt: int, turn: int, reply: str = "higher") -> str:
        execution = f"tools-1-{len(self.executions)}"
        self.executions.append(
            {
                "tools": "tools",
                "execution": execution,
                "rollout_id": rollout_id,
                "attempt": attempt,
                "turn": turn,
                "guess": 3,
                "reply": reply,
                "t": self.tick(),
            }
        )
        return execution

    def verify(
        self, rollout_id: str, attempt: int, history: list[str] | None, reward: float = 0.5
    ) -> None:
        entry: dict[str, Any] = {
            "verifier": "tools",
            "rollout_id": rollout_id,
            "attempt": attempt,
            "reward": reward,
        }
        if history is not None:
            entry["executions"] = history
        self.verifier.append(entry)

    def trained(
        self,
        rollout_id: str,
        attempt: int,
        answered_in: list[int],
        replies: list[str] | None = None,
    ) -> None:
        replies = replies or ["higher"] * len(answered_in)
        turns = [
            {"prompt": [1, turn], "completion": [5], "reply": reply, "answered_in": answered}
            for turn, (reply, answered) in enumerate(zip(replies, answered_in, strict=True))
        ]
        self.samples.append(
            {"rollout_id": rollout_id, "attempt": attempt, "reward": 0.5, "turns": turns}
        )

    def audit(self) -> Any:
        recorded = [
            {
                "t": self.tick(),
                "type": "rollout",
                "incarnation": 1,
                "rollout_id": sample["rollout_id"],
                "attempt": sample["attempt"],
                "group": 0,
                "sibling": int(sample["rollout_id"][-1]),
                "environment": "guess",
                "reward": sample["reward"],
                "resumed": sample["attempt"] > 0,
                "turns": TURNS,
            }
            for sample in self.samples
        ]
        events = [
            {"t": 1.0, "type": "start", "incarnation": 1, "restored_from": None, "step": 0},
            *recorded,
            {
                "t": self.tick(),
                "type": "train_step",
                "incarnation": 1,
                "step": 1,
                "groups": [0],
                "rollouts": self.samples,
                "mean_reward": 0.5,
            },
            {"t": self.tick(), "type": "done", "incarnation": 1, "step": 1},
        ]
        lines = self.executions + self.verifier
        return audit(
            parse_events(events),
            parse_verifier_entries(lines),
            group_size=SIBLINGS,
            executions=parse_execution_entries(lines),
        )


def _good() -> _Logs:
    logs = _Logs()
    for sibling in range(SIBLINGS):
        rollout_id = f"g0-s{sibling}"
        history = [logs.execute(rollout_id, 0, turn) for turn in range(TURNS)]
        logs.verify(rollout_id, 0, history)
        logs.trained(rollout_id, 0, [0] * TURNS)
    return logs


def test_each_call_applied_once_passes_and_is_counted() -> None:
    result = _good().audit()
    assert result.passed, result.reason
    assert result.tools is not None
    assert result.tools.line == "tool calls: 4 executed, each once; 0 answered from the record"


def test_a_call_re_sent_after_a_restore_and_answered_from_the_record_passes() -> None:
    """Attempt 0 ran both turns and verified, then the cut: its agent had sealed turn 0
    only, so the restored attempt 1 re-sent turn 1's call and the verify and got both
    from the record (no execution, no verifier line of attempt 1)."""
    logs = _good()
    logs.samples.pop()
    history = [e["execution"] for e in logs.executions if e["rollout_id"] == "g0-s1"]
    logs.trained("g0-s1", 1, [0, 1])
    result = logs.audit()
    assert result.passed, result.reason
    assert result.tools is not None
    assert result.tools.executed == 4 and result.tools.answered_from_record == 1
    assert len(history) == 2


def test_a_call_applied_twice_fails() -> None:
    """A resources server without the record: the re-sent call of turn 0 ran again."""
    logs = _good()
    logs.samples.pop()
    logs.verifier.pop()
    first = logs.execute("g0-s1", 0, 0)
    again = logs.execute("g0-s1", 1, 0)
    then = logs.execute("g0-s1", 1, 1)
    logs.verify("g0-s1", 1, [first, again, then])
    logs.trained("g0-s1", 1, [0, 1])
    result = logs.audit()
    assert not result.passed
    assert result.reason == (
        f"turn 0 of rollout g0-s1 attempt 1 (trained in step 1) was applied twice: "
        f"executions {first} (attempt 0) and {again} (attempt 1) are both in its "
        "session's history"
    )


def test_a_reply_that_disagrees_with_the_tools_fails() -> None:
    logs = _good()
    logs.samples[0]["turns"][1]["reply"] = "lower"
    result = logs.audit()
    assert not result.passed
    assert result.reason == (
        "turn 1 of rollout g0-s0 attempt 0 was trained with the reply 'lower' but the "
        "tool's execution tools-1-1 replied 'higher'"
    )


def test_an_attempt_run_again_by_a_later_incarnation_is_audited_by_its_own_calls() -> None:
    """A job restart reran g0-s1 from its prompt under the same attempt 0 (its snapshot
    did not hold it) and it scored the same reward: the trained turns are those of the
    second run, whose verdict was logged second."""
    logs = _good()
    logs.samples.pop()
    second = [logs.execute("g0-s1", 0, turn, reply="lower") for turn in range(TURNS)]
    logs.verify("g0-s1", 0, second)
    logs.trained("g0-s1", 0, [0] * TURNS, replies=["lower"] * TURNS)
    result = logs.audit()
    assert result.passed, result.reason
    assert result.tools is not None and result.tools.executed == 4


def test_a_reply_no_run_of_the_attempt_gave_fails() -> None:
    logs = _good()
    logs.samples.pop()
    second = [logs.execute("g0-s1", 0, turn, reply="lower") for turn in range(TURNS)]
    logs.verify("g0-s1", 0, second)
    logs.trained("g0-s1", 0, [0] * TURNS, replies=["higher", "lower"])
    result = logs.audit()
    assert not result.passed
    assert result.reason is not None and "was trained with the reply" in result.reason


def test_a_history_naming_an_execution_nobody_logged_fails() -> None:
    logs = _good()
    logs.verifier[0]["executions"] = ["tools-1-0", "ghost"]
    result = logs.audit()
    assert not result.passed
    assert result.reason == (
        "the session of rollout g0-s0 attempt 0 applied tool execution ghost, which no "
        "resources server logged"
    )


def test_a_turn_trained_without_its_call_fails() -> None:
    logs = _good()
    logs.verifier[1]["executions"] = logs.verifier[1]["executions"][:1]
    result = logs.audit()
    assert not result.passed
    assert result.reason == (
        "rollout g0-s1 attempt 0 trained 2 turns but its session applied the calls of turns [0]"
    )


def test_a_server_that_logs_no_history_is_counted_as_not_audited() -> None:
    logs = _good()
    del logs.verifier[1]["executions"]
    result = logs.audit()
    assert result.passed, result.reason
    assert result.tools is not None
    assert result.tools.line == (
        "tool calls: 2 executed, each once; 0 answered from the record "
        "(1 rollouts not audited: no history logged)"
    )


def test_no_execution_logged_means_no_tool_audit() -> None:
    logs = _good()
    logs.executions.clear()
    for entry in logs.verifier:
        del entry["executions"]
    result = logs.audit()
    assert result.passed and result.tools is None
