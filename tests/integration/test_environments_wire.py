"""The counter, Blackjack and the workplace served over gRPC, played by the play agent.

The agent's choices come from the tiny policy; each episode runs to its verifier, whose
reward the result carries and (Blackjack, the workplace) the verifier log records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.participants import TOKEN, host_example
from turnpoint.apps.conformance._kit import Kit, Workload, episode
from turnpoint.apps.conformance._wire import Target
from turnpoint.apps.examples._build import ExampleSpec
from turnpoint.convert import struct_to_dict
from turnpoint.v1 import rollout_service_pb2

TASKS = {
    "counter": {"target": 4},
    "blackjack": {"seed": 5},
    "workplace": {"seed": 3},
}


@pytest.mark.parametrize("environment", sorted(TASKS))
async def test_the_play_agent_plays_each_environment_to_its_verifier(
    tmp_path: Path, environment: str
) -> None:
    log = tmp_path / "verifier.jsonl"

    def spec(instance: str, **extra: object) -> ExampleSpec:
        return ExampleSpec(instance=instance, root=tmp_path, token=TOKEN, **extra)  # type: ignore[arg-type]

    policy = await host_example("model", "tiny-policy", spec("policy"))
    tools = await host_example(
        "resources", environment, ExampleSpec(environment, tmp_path, TOKEN, verifier_log=log)
    )
    agent = await host_example(
        "agent",
        "play",
        spec("agent-0", policy_address=policy.address, resources={environment: tools.address}),
    )
    target = Target(agent.address, TOKEN, call_timeout_s=10.0)
    try:
        kit = Kit(target, workload=Workload(), lease_s=1.0, episode_bound_s=60.0)
        await kit.discover()
        task = {"task": TASKS[environment], "environment": environment}
        result = await kit.run(episode("r-1"), task=task).finished()
        assert result.outcome == rollout_service_pb2.RUN_OUTCOME_COMPLETED, result.error_message
        output = struct_to_dict(result.result)
        assert 1 <= len(output["turns"]) == len(output["prompts"]) <= 3
        if environment != "counter":  # the guide's counter keeps no log
            logged = [json.loads(line) for line in log.read_text().splitlines()]
            verdicts = [e for e in logged if "verifier" in e]
            assert [(e["rollout_id"], e["reward"]) for e in verdicts] == [("r-1", output["reward"])]
            # Each turn's tool call ran once, and the agent kept the reply the tool gave.
            executions = [e for e in logged if "execution" in e]
            assert verdicts[0]["executions"] == [e["execution"] for e in executions]
            assert [(e["turn"], e["reply"]) for e in executions] == [
                (turn, step["reply"]) for turn, step in enumerate(output["turns"])
            ]
    finally:
        await target.close()
        for hosted in (agent, tools, policy):
            await hosted.stop(0)
