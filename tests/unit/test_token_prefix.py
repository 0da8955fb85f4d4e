"""Token-prefix recovery (docs/spec.md section 5.5), in process: the pure generation
record, the token level's decision, and a cutting policy with a recording agent, each a
ParticipantRuntime on a real store, no network.

The policy streams one token per release, so a test puts the cut exactly where it
wants: a checkpoint closes admission after ``k`` tokens and the policy cuts at the next
token boundary. Every scenario ends with the exactly-once audit over tokens: the
finished turn is the completion an uncut generation gives, and every position of it was
streamed by a policy exactly once, never twice and never lost.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fakes import state_of
from tests.support.token_prefix import (
    EOS,
    PROMPT,
    CountingPolicy,
    CuttingAgent,
    expected_completion,
    in_process,
)
from turnpoint.ids import EpisodeId, make_checkpoint_id
from turnpoint.participant_sdk import (
    GenerateRequest,
    Generation,
    ParticipantRuntime,
    SnapshotStore,
    WeightsChange,
)
from turnpoint.participant_sdk.advanced import CommitResult, RunResult
from turnpoint.protocol import EpisodeState, Fence, Phase, RecoveryLevel
from turnpoint.trainer.advanced import decide_levels
from turnpoint.trainer.snapshots.levels import EnvironmentMember

T = TypeVar("T")

FENCE = Fence("coord", 1)
EP = EpisodeId("rollout-a", 0)
BOUND_S = 10.0
_ids = iter(range(1_000_000))


def rid() -> str:
    return f"req-{next(_ids)}"


def ckpt(n: int) -> str:
    return make_checkpoint_id("ckpt", n)


RESTORE = make_checkpoint_id("restore", 1)


async def bounded(awaitable: Awaitable[T]) -> T:
    async with asyncio.timeout(BOUND_S):
        return await awaitable


# ====================================================================== pure record


def test_a_generation_continues_from_prompt_plus_prefix_with_the_budget_left() -> None:
    generation = Generation((1, 2), 5).extend((3, 4), (-0.1, -0.2), 1).cut()
    request = generation.next_request()
    assert request.prompt_token_ids == (1, 2, 3, 4)
    assert request.max_new_tokens == 3
    assert generation.cuts == 1 and not generation.finished
    finished = generation.extend((5,), (-0.3,), 2).finish()
    assert finished.token_ids == (3, 4, 5)
    assert finished.weights_versions == (1, 1, 2)
    assert finished.spans_weight_update
    with pytest.raises(ValueError, match="finished"):
        finished.next_request()


def test_a_generation_never_holds_more_than_its_budget() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        Generation((1,), 1).extend((2, 3), (0.0, 0.0), 1)


def test_discarding_counts_the_thrown_away_tokens_and_starts_from_the_prompt() -> None:
    generation = Generation((1,), 4).extend((2, 3), (0.0, 0.0), 1).finish().discard()
    assert generation.token_ids == () and not generation.finished
    assert generation.discarded_tokens == 2


def test_the_saved_form_round_trips_and_is_parsed_strictly() -> None:
    generation = Generation((1, 2), 4).extend((3,), (-0.5,), 7).cut()
    assert Generation.from_json(generation.to_json()) == generation
    broken = generation.to_json() | {"token_ids": [3, 4]}
    with pytest.raises(ValueError, match="length"):
        Generation.from_json(broken)
    with pytest.raises(ValueError, match="fields"):
        Generation.from_json(generation.to_json() | {"extra": 1})
    with pytest.raises(ValueError, match="integers"):
        Generation.from_json(generation.to_json() | {"token_ids": [True]})


# ====================================================================== the token level


def _member(name: str, kind: str, levels: Sequence[RecoveryLevel]) -> EnvironmentMember:
    return EnvironmentMember(name, kind, "exported", frozenset(levels))


_TOKEN = (RecoveryLevel.TOKEN, RecoveryLevel.TURN, RecoveryLevel.SIBLING)
_TURN = (RecoveryLevel.TURN, RecoveryLevel.SIBLING)


def test_the_token_level_needs_every_participant_and_every_shared_model_to_cut() -> None:
    cutting = {"math": [_member("agent-0", "agent", _TOKEN)]}
    chosen = decide_levels(RecoveryLevel.TOKEN, cutting, [_member("policy", "model", _TOKEN)])
    assert chosen["math"].effective is RecoveryLevel.TOKEN
    assert not chosen["math"].lowered
    lowered = decide_levels(RecoveryLevel.TOKEN, cutting, [_member("policy", "model", _TURN)])
    assert lowered["math"].effective is RecoveryLevel.TURN
    assert lowered["math"].reasons == ("policy cannot cut generations",)
    assert "lowered from token to turn" in lowered["math"].warning()
    agent_cannot = decide_levels(
        RecoveryLevel.TOKEN,
        {"math": [_member("agent-0", "agent", _TURN)]},
        [_member("policy", "model", _TOKEN)],
    )
    assert agent_cannot["math"].reasons == ("agent-0 cannot cut generations",)


def test_a_turn_target_is_never_made_finer_and_never_warns_about_cutting() -> None:
    chosen = decide_levels(
        RecoveryLevel.TURN,
        {"math": [_member("agent-0", "agent", _TURN)]},
        [_member("policy", "model", _TURN)],
    )
    assert chosen["math"].effective is RecoveryLevel.TURN
    assert chosen["math"].reasons == ()
    assert RecoveryLevel.parse("token") is RecoveryLevel.TOKEN < RecoveryLevel.TURN


# ====================================================================== the two kinds


class Pair:
    """An agent runtime and a policy runtime, each on its own store under ``root``."""

    def __init__(self, root: Path, model: CountingPolicy, *, rerun: bool = False) -> None:
        self.root = root
        self.model = model
        self.policy = ParticipantRuntime("policy", SnapshotStore(root / "policy"), model=model)
        self.agent_kind = CuttingAgent(in_process(self.policy), rerun=rerun)
        self.agent = ParticipantRuntime(
            "agent-0", SnapshotStore(root / "agent"), agent=self.agent_kind
        )

    async def aclose(self) -> None:
        await self.agent.aclose()
        await self.policy.aclose()


class Follower:
    """Follows one Run in the background, as the Run servicer would."""

    def __init__(
        self,
        runtime: ParticipantRuntime,
        episode: EpisodeId,
        task: Any,
        *,
        weights_change: WeightsChange | None = None,
    ) -> None:
        self.result: RunResult | None = None
        stream = runtime.run_episode(episode, task, weights_change=weights_change)
        self.task = asyncio.create_task(self._follow(stream))

    async def _follow(self, stream: Any) -> None:
        async with aclosing(stream):
            async for event in stream:
                if isinstance(event, RunResult):
                    self.result = event

    async def done(self) -> RunResult:
        await bounded(self.task)
        assert self.result is not None
        return self.result


@asynccontextmanager
async def pair(
    model: CountingPolicy, root: Path | None = None, *, rerun: bool = False
) -> AsyncIterator[Pair]:
    """Both runtimes on stores under ``root`` (a process restarted on the same disk
    passes the same root), or under a fresh temporary directory."""
    with tempfile.TemporaryDirectory() as directory:
        both = Pair(root or Path(directory), model, rerun=rerun)
        try:
            yield both
        finally:
            await both.aclose()


async def prepare_both(both: Pair, n: int, *, then: Callable[[], None]) -> None:
    """Prepare checkpoint ``n`` on both, calling ``then`` once the policy has closed."""
    checkpoint = ckpt(n)
    on_agent = asyncio.create_task(both.agent.prepare(FENCE, rid(), checkpoint, timeout_s=5))
    on_policy = asyncio.create_task(both.policy.prepare(FENCE, rid(), checkpoint, timeout_s=5))
    await bounded(both.policy.wait_until(lambda core: core.active_checkpoint_id == checkpoint))
    then()
    agent, policy = await bounded(asyncio.gather(on_agent, on_policy))
    assert agent.phase is Phase.PREPARED, agent.readiness
    assert policy.phase is Phase.PREPARED, policy.readiness


async def commit_both(both: Pair, n: int, scope: Sequence[EpisodeId]) -> CommitResult:
    committed = await both.agent.commit(FENCE, rid(), ckpt(n), f"snap-{n}", scope, timeout_s=5)
    await both.policy.commit(FENCE, rid(), ckpt(n), f"snap-{n}", [], timeout_s=5)
    return committed


async def resume_both(both: Pair, n: int) -> None:
    await both.agent.resume(FENCE, rid(), ckpt(n))
    await both.policy.resume(FENCE, rid(), ckpt(n))


def saved_generation(both: Pair, episode: EpisodeId) -> Generation | None:
    execution = both.agent.agent._executions[episode]  # type: ignore[union-attr]
    saved = execution.saved
    return None if saved is None else saved.generation


def audit(logs: Sequence[CountingPolicy], episode_ids: Sequence[str], length: int) -> None:
    """Exactly once: each completion position of each rollout streamed once, none twice."""
    streamed = Counter(
        (episode.rollout_id, position)
        for model in logs
        for episode, position, _version in model.streamed
        if episode.rollout_id in episode_ids
    )
    wanted = Counter(
        (rollout, len(PROMPT) + index) for rollout in episode_ids for index in range(length)
    )
    assert streamed == wanted


async def cut_scenario(root_model: CountingPolicy, k: int, length: int, *, crash: bool) -> None:
    with tempfile.TemporaryDirectory() as directory:
        await _cut_scenario(Path(directory), root_model, k, length, crash=crash)


async def _cut_scenario(
    root: Path, root_model: CountingPolicy, k: int, length: int, *, crash: bool
) -> None:
    expected = expected_completion(length, root_model.eos_after)
    async with AsyncExitStack() as stack:
        both = await stack.enter_async_context(pair(root_model, root))
        follower = Follower(both.agent, EP, {"turns": 1, "max_new_tokens": length})
        async with root_model.changed:  # admitted at the policy before the checkpoint
            await bounded(root_model.changed.wait_for(lambda: root_model.streaming == 1))
        root_model.release(k)
        await bounded(root_model.wait_streamed(k))
        # The checkpoint closes after k tokens; the policy cuts at the next boundary.
        await prepare_both(both, 1, then=lambda: root_model.release(1))
        generation = saved_generation(both, EP)
        assert generation is not None
        ended_on_its_own = k + 1 >= len(expected)
        assert generation.token_ids == expected[: k + 1]
        assert generation.finished is ended_on_its_own
        assert generation.cuts == (0 if ended_on_its_own else 1)
        assert state_of(both.agent.core, EP) is EpisodeState.AWAITING_MODEL
        committed = await commit_both(both, 1, [EP])
        if not crash:
            await resume_both(both, 1)
            root_model.free = True
            root_model.release(1)
            result = await follower.done()
            assert tuple(result.result["completions"][0]) == expected
            audit([root_model], [EP.rollout_id], len(expected))
            return
    # The job died after the commit: a fresh policy and agent continue from the record.
    fresh_model = CountingPolicy(eos_after=root_model.eos_after, free=True)
    async with pair(fresh_model, root) as fresh:
        await fresh.agent.restore(
            FENCE, rid(), RESTORE, "snap-1", committed.manifest, committed.artifacts, [EP]
        )
        await fresh.agent.resume(FENCE, rid(), RESTORE)
        result = await Follower(
            fresh.agent, EP.next_attempt(), {"turns": 1, "max_new_tokens": length}
        ).done()
        assert tuple(result.result["completions"][0]) == expected
        audit([root_model, fresh_model], [EP.rollout_id], len(expected))
        if ended_on_its_own:
            assert fresh_model.streamed == []  # a finished generation is never asked again


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    data=st.data(),
    length=st.integers(min_value=1, max_value=8),
    crash=st.booleans(),
    ends_early=st.booleans(),
)
def test_a_cut_at_any_token_continues_to_the_same_turn_each_token_once(
    data: st.DataObject, length: int, crash: bool, ends_early: bool
) -> None:
    """Cut positions: before the first token is out (k = 0: the cut lands at the first
    token), mid-stream, at the last token, and a generation that ends on its own (EOS
    or its budget) as the cut arrives; then resumed, or restored after a crash."""
    eos_after = data.draw(st.integers(0, length - 1)) if ends_early and length > 1 else None
    total = len(expected_completion(length, eos_after))
    k = data.draw(st.integers(min_value=0, max_value=total - 1))
    asyncio.run(cut_scenario(CountingPolicy(eos_after=eos_after), k, length, crash=crash))


async def test_a_generation_issued_while_the_policy_is_closed_is_cut_with_no_tokens() -> None:
    model = CountingPolicy(free=True)
    async with pair(model) as both:
        await both.policy.prepare(FENCE, rid(), ckpt(1), timeout_s=5)
        stream = both.policy.generate(EP, GenerateRequest(PROMPT, 4, accept_cut=True))
        async with aclosing(stream):
            chunks = [chunk async for chunk in stream]
        assert [(c.token_ids, c.cut, c.prefix_length) for c in chunks] == [((), True, 0)]
        assert model.streamed == []
        # A caller that does not accept cuts is held at the gate, as always.
        held = both.policy.generate(EP, GenerateRequest(PROMPT, 2, accept_cut=False))
        pending = asyncio.ensure_future(anext(held))
        assert not await both.policy.wait_until(lambda core: pending.done(), 0.05)
        await both.policy.resume(FENCE, rid(), ckpt(1))
        first = await bounded(pending)
        assert first.token_ids == (token_of(0),) and not first.cut
        await held.aclose()


def token_of(index: int) -> int:
    return expected_completion(index + 1, None)[index]


async def test_a_caller_that_does_not_accept_cuts_streams_to_the_end() -> None:
    model = CountingPolicy()
    async with pair(model) as both:
        stream = both.policy.generate(EP, GenerateRequest(PROMPT, 3, accept_cut=False))
        collected: list[int] = []

        async def consume() -> None:
            async with aclosing(stream):
                async for chunk in stream:
                    assert not chunk.cut
                    collected.extend(chunk.token_ids)

        consumer = asyncio.create_task(consume())
        model.release(1)
        await bounded(model.wait_streamed(1))
        prepare = asyncio.create_task(both.policy.prepare(FENCE, rid(), ckpt(1), timeout_s=5))
        await bounded(both.policy.wait_until(lambda core: core.active_checkpoint_id == ckpt(1)))
        model.release(2)
        assert (await bounded(prepare)).phase is Phase.PREPARED
        await bounded(consumer)
        assert tuple(collected) == expected_completion(3, None)


async def test_a_crash_after_the_cut_and_before_the_commit_continues_from_the_last_snapshot(
    tmp_path: Path,
) -> None:
    model = CountingPolicy()
    length = 6
    async with pair(model, tmp_path) as both:
        follower = Follower(both.agent, EP, {"turns": 1, "max_new_tokens": length})
        async with model.changed:
            await bounded(model.changed.wait_for(lambda: model.streaming == 1))
        # Snapshot 1 cuts at the first token.
        await prepare_both(both, 1, then=lambda: model.release(1))
        first = await commit_both(both, 1, [EP])
        await resume_both(both, 1)
        model.release(2)
        await bounded(model.wait_streamed(3))
        # Snapshot 2 cuts again, at four tokens, and the job dies before it commits.
        await prepare_both(both, 2, then=lambda: model.release(1))
        generation = saved_generation(both, EP)
        assert generation is not None and generation.cuts == 2
        assert generation.token_ids == expected_completion(4, None)
        follower.task.cancel()
    fresh_model = CountingPolicy(free=True)
    async with pair(fresh_model, tmp_path) as fresh:
        await fresh.agent.restore(
            FENCE, rid(), RESTORE, "snap-1", first.manifest, first.artifacts, [EP]
        )
        await fresh.agent.resume(FENCE, rid(), RESTORE)
        result = await Follower(
            fresh.agent, EP.next_attempt(), {"turns": 1, "max_new_tokens": length}
        ).done()
    assert tuple(result.result["completions"][0]) == expected_completion(length, None)
    # The trained turn is snapshot 1's one-token prefix plus the restored attempt's
    # tokens: the prefix saved was not generated again; what snapshot 2 never saved was.
    assert [p for _, p, _ in fresh_model.streamed] == [len(PROMPT) + i for i in range(1, length)]
    assert [p for _, p, _ in model.streamed] == [len(PROMPT) + i for i in range(4)]


@pytest.mark.parametrize("change", [WeightsChange.KEEP, WeightsChange.RERUN])
@pytest.mark.parametrize("decided_by", ["agent", "run"])
async def test_a_cut_during_a_weight_sync_tags_every_token_with_its_version(
    change: WeightsChange, decided_by: str
) -> None:
    """``decided_by`` "agent": a Run without the setting (an older coordinator) leaves it
    to the agent's own default; "run": the Run's setting (the coordinator's config)
    wins over an agent default that says the opposite."""
    model = CountingPolicy()
    length = 5
    rerun = change is WeightsChange.RERUN
    if decided_by == "run":
        rerun = not rerun
    async with pair(model, rerun=rerun) as both:
        follower = Follower(
            both.agent,
            EP,
            {"turns": 1, "max_new_tokens": length},
            weights_change=change if decided_by == "run" else None,
        )
        model.release(1)
        await bounded(model.wait_streamed(1))
        # The weight sync waits for the streaming generation; the cut ends it.
        sync = asyncio.create_task(both.policy.update_weights(2, b""))
        await prepare_both(both, 1, then=lambda: model.release(1))
        assert await bounded(sync) == 2
        await commit_both(both, 1, [EP])
        await resume_both(both, 1)
        model.free = True
        model.release(1)
        result = await follower.done()
    assert tuple(result.result["completions"][0]) == expected_completion(length, None)
    versions = result.result["versions"][0]
    generation = both.agent_kind.generations[-1]
    if change is WeightsChange.KEEP:
        assert versions == [1, 1, 2, 2, 2]
        assert generation.spans_weight_update and generation.discarded_tokens == 0
    else:
        assert versions == [2] * length
        # The turn that spanned the update was generated again, wholly under version 2;
        # the first one was thrown away, never trained.
        assert generation.discarded_tokens == length
        assert len(model.streamed) == 2 * length


async def test_a_restore_continues_every_cut_generation(tmp_path: Path) -> None:
    model = CountingPolicy()
    episodes = [EpisodeId(f"rollout-{i}", 0) for i in range(3)]
    length = 6
    async with pair(model, tmp_path) as both:
        for episode in episodes:
            Follower(both.agent, episode, {"turns": 2, "max_new_tokens": length})
        # Every generation admitted at the policy before the checkpoint closes.
        async with model.changed:
            await bounded(model.changed.wait_for(lambda: model.streaming == len(episodes)))
        model.release(4)
        await bounded(model.wait_streamed(4))
        await prepare_both(both, 1, then=lambda: model.release(3))
        cut = {e: saved_generation(both, e) for e in episodes}
        assert all(g is not None and g.cuts == 1 for g in cut.values())
        committed = await commit_both(both, 1, episodes)
    fresh_model = CountingPolicy(free=True)
    async with pair(fresh_model, tmp_path) as fresh:
        await fresh.agent.restore(
            FENCE,
            rid(),
            RESTORE,
            "snap-1",
            committed.manifest,
            committed.artifacts,
            episodes,
        )
        await fresh.agent.resume(FENCE, rid(), RESTORE)
        followers = [
            Follower(fresh.agent, e.next_attempt(), {"turns": 2, "max_new_tokens": length})
            for e in episodes
        ]
        results = [await f.done() for f in followers]
    expected = list(expected_completion(length, None))
    for result in results:
        assert result.result["completions"] == [expected, expected]
    # The first turn's prefixes came from the old policy, the rest from the new one,
    # each position once; the second turn came wholly from the new one.
    for episode in episodes:
        prefix = len(cut[episode].token_ids)  # type: ignore[union-attr]
        old = [p for e, p, _ in model.streamed if e.rollout_id == episode.rollout_id]
        assert sorted(old) == [len(PROMPT) + i for i in range(prefix)]
        new = Counter(p for e, p, _ in fresh_model.streamed if e.rollout_id == episode.rollout_id)
        # Turn 1: the rest of the cut generation; turn 2: the whole generation.
        assert new == Counter(
            [len(PROMPT) + i for i in range(prefix, length)]
            + [len(PROMPT) + i for i in range(length)]
        )
    assert EOS not in expected
