"""The conformance kit's checks of the HTTP faces (docs/spec.md section 12): the OpenAI
endpoint in front of the example policy and the egress relay in front of a harness pass
them, and a defect of each is failed by its check.

The policy is hosted over gRPC (the kit's target) with the endpoint in front of it; the
relay's credentials come from the relay itself (an episode opened, then its harness
replaced), as an opaque agent would issue them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.participants import TOKEN
from turnpoint.apps.conformance._kit import HttpFace, Workload
from turnpoint.apps.conformance._report import ConformanceReport, Outcome, render_table
from turnpoint.apps.conformance._runner import ConformanceOptions, run_conformance
from turnpoint.apps.examples._participants import TinyPolicyServer, new_policy
from turnpoint.apps.examples.chat_template import MODEL_NAME, GuessChatTemplate
from turnpoint.ids import EpisodeId
from turnpoint.participant_sdk import ParticipantRuntime, SnapshotStore
from turnpoint.server import ServerOptions, host_participant
from turnpoint.server.openai_api import (
    ChatEndpoint,
    EgressRelay,
    EndpointOptions,
    RelayOptions,
)
from turnpoint.server.openai_api import _endpoint as endpoint_module

API_KEY = "sk-policy-endpoint"
WORKLOAD = {"chat": {"messages": [{"role": "user", "content": "range 2 5"}], "max_tokens": 3}}
CHECKS = ("openai-endpoint", "egress-relay")


@asynccontextmanager
async def policy_behind_an_endpoint(root: Path) -> AsyncIterator[tuple[str, ChatEndpoint]]:
    runtime = ParticipantRuntime(
        "policy", SnapshotStore(root), model=TinyPolicyServer(new_policy(0))
    )
    hosted = await host_participant(runtime, ServerOptions(port=0, token=TOKEN)).start()
    options = EndpointOptions(model=MODEL_NAME, api_key=API_KEY, max_tokens=8)
    try:
        async with ChatEndpoint(runtime, GuessChatTemplate(), options) as endpoint:
            yield hosted.address, endpoint
    finally:
        await hosted.stop(0)


async def conformance(address: str, **faces: Any) -> ConformanceReport:
    options = ConformanceOptions(
        address, TOKEN, workload=Workload.from_mapping(WORKLOAD), only=CHECKS, **faces
    )
    return await run_conformance(options)


async def test_the_reference_endpoint_and_relay_pass_their_checks(tmp_path: Path) -> None:
    async with policy_behind_an_endpoint(tmp_path) as (address, endpoint):
        relay_options = RelayOptions(endpoint.base_url, MODEL_NAME, upstream_api_key=API_KEY)
        async with EgressRelay(relay_options) as relay:
            episode = relay.open_episode(EpisodeId("kit-episode", 0))
            replaced = episode.api_key
            live = episode.rerun()
            report = await conformance(
                address,
                openai_endpoint=HttpFace(endpoint.base_url, API_KEY),
                relay=HttpFace(relay.base_url, live, replaced),
            )
            recorded = episode.record.states()
    assert report.failed() == [], render_table(report)
    outcomes = {result.name: result.outcome for result in report.results}
    assert outcomes == {"openai-endpoint": Outcome.PASS, "egress-relay": Outcome.PASS}
    assert "fenced_generation" in report.result("egress-relay").detail
    # The relay recorded the kit's two answered calls and none of its refused ones.
    assert len(recorded) == 2


async def test_without_their_faces_both_checks_skip_saying_what_to_give(tmp_path: Path) -> None:
    async with policy_behind_an_endpoint(tmp_path) as (address, _):
        report = await conformance(address)
    assert {r.name: r.outcome for r in report.results} == dict.fromkeys(CHECKS, Outcome.SKIP)
    assert "--openai-endpoint" in report.result("openai-endpoint").detail


async def test_an_endpoint_that_answers_bad_json_with_a_traceback_fails_its_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def trusting(body: bytes) -> Mapping[str, Any]:
        return json.loads(body)  # type: ignore[no-any-return]

    monkeypatch.setattr(endpoint_module, "parse_json", trusting)
    async with policy_behind_an_endpoint(tmp_path) as (address, endpoint):
        report = await conformance(address, openai_endpoint=HttpFace(endpoint.base_url, API_KEY))
    result = report.result("openai-endpoint")
    assert result.outcome is Outcome.FAIL, render_table(report)
    assert "a body not JSON" in result.detail and "500" in result.detail
