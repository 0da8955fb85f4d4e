"""The learning half of the demo: tiny policy, guessing task, policy-gradient update.

Everything runs in one process with no servers. The last test plays the whole loop the
demo's servers will play (prompts -> multi-turn generation with tool feedback -> both
verifiers -> update) and checks that the reward really rises.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator, Sequence

import pytest
import torch

from turnpoint.apps.demo._learner import (
    Sample,
    group_advantages,
    policy_gradient_step,
)
from turnpoint.apps.examples._policy_model import TinyPolicy
from turnpoint.apps.examples._task import (
    GROUP_WEIGHT,
    MAX_NEW_TOKENS_PER_TURN,
    VOCAB_SIZE,
    Reply,
    Task,
    Token,
    ToolSession,
    Turn,
    encode_context,
    episode_answer,
    group_rewards,
    is_finished,
    make_prompt,
    parse_guess,
    per_sibling_reward,
    tool_call,
)


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    # The demo runs each process on one torch thread; tiny tensors gain nothing from more.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _model(seed: int = 0) -> TinyPolicy:
    return TinyPolicy(VOCAB_SIZE, eos_token=Token.EOS, seed=seed)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _score(model: TinyPolicy, prompt: Sequence[int], tokens: Sequence[int]) -> float:
    with torch.no_grad():
        return float(model.sequence_logprob(prompt, tokens))


def _digit(value: int) -> int:
    return Token.DIGIT_0 + value


# -- the model -----------------------------------------------------------------------


def test_same_seed_gives_same_weights_and_leaves_global_rng_alone() -> None:
    rng_before = torch.random.get_rng_state()
    first, second, other = _model(seed=3), _model(seed=3), _model(seed=4)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    for (name, a), (_, b), (_, c) in zip(
        first.state_dict().items(),
        second.state_dict().items(),
        other.state_dict().items(),
        strict=True,
    ):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name


def test_generation_is_deterministic_for_a_seeded_generator() -> None:
    model = _model()
    prompt = encode_context(make_prompt(0, seed=1), [])
    assert model.generate(prompt, 8, 1.0, _generator(11)) == model.generate(
        prompt, 8, 1.0, _generator(11)
    )
    # A different generator seed must be able to change the sample, or the generator is unused.
    draws = {tuple(model.generate(prompt, 8, 1.0, _generator(seed))[0]) for seed in range(20)}
    assert len(draws) > 1


def test_generation_respects_max_new_tokens_and_stops_at_eos() -> None:
    model = _model()
    prompt = encode_context(make_prompt(0, seed=1), [])
    generator = _generator(0)
    saw_eos = False
    for max_new_tokens in (0, 1, 3, 8):
        for _ in range(50):
            tokens, logprobs = model.generate(prompt, max_new_tokens, 1.0, generator)
            assert len(tokens) == len(logprobs) <= max_new_tokens
            assert Token.EOS not in tokens[:-1]
            if tokens and tokens[-1] == Token.EOS:
                saw_eos = True
            else:
                assert len(tokens) == max_new_tokens
    assert saw_eos

    # Make EOS overwhelmingly likely: the generation must end right after it.
    with torch.no_grad():
        model.head.bias[Token.EOS] = 50.0
    tokens, _ = model.generate(prompt, 8, 1.0, generator)
    assert tokens == [Token.EOS]


def test_iterator_form_streams_the_same_tokens_without_leaking_no_grad() -> None:
    model = _model()
    prompt = encode_context(make_prompt(2, seed=1), [])
    expected_tokens, expected_logprobs = model.generate(prompt, 6, 0.8, _generator(5))

    stream = model.iter_generate(prompt, 6, 0.8, _generator(5))
    first = next(stream)
    # Between tokens the consumer's own code runs; it must still be able to build graphs.
    assert torch.is_grad_enabled()
    rest = list(stream)
    assert [first.token, *(item.token for item in rest)] == expected_tokens
    assert [first.logprob, *(item.logprob for item in rest)] == expected_logprobs


def test_greedy_generation_picks_the_most_likely_token() -> None:
    model = _model()
    prompt = encode_context(make_prompt(0, seed=1), [])
    tokens, _ = model.generate(prompt, 4, 0.0, _generator(0))
    again, _ = model.generate(prompt, 4, 0.0, _generator(99))
    assert tokens == again
    context = list(prompt)
    for token in tokens:
        scores = torch.stack(
            [model.sequence_logprob(context, [candidate]) for candidate in range(VOCAB_SIZE)]
        )
        assert int(torch.argmax(scores)) == token
        context.append(token)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reported_logprobs_match_the_trainers_recomputation(temperature: float) -> None:
    model = _model()
    generator = _generator(3)
    pairs: list[tuple[list[int], list[int]]] = []
    reported: list[float] = []
    for group_index in range(6):
        prompt = encode_context(make_prompt(group_index, seed=2), [])
        # Prompts of different lengths so that the batch really is padded.
        prompt = prompt + [_digit(group_index)] * group_index
        tokens, logprobs = model.generate(prompt, 5, temperature, generator)
        pairs.append((prompt, tokens))
        reported.append(sum(logprobs))
    batched = model.sequence_logprobs(pairs, temperature)
    one_by_one = torch.stack(
        [model.sequence_logprob(prompt, tokens, temperature) for prompt, tokens in pairs]
    )
    assert torch.allclose(batched, torch.tensor(reported), atol=1e-5)
    assert torch.allclose(batched, one_by_one, atol=1e-5)


def test_sequence_logprob_is_differentiable_and_empty_completion_scores_zero() -> None:
    model = _model()
    prompt = encode_context(make_prompt(0, seed=0), [])
    scores = model.sequence_logprobs([(prompt, [_digit(3), Token.EOS]), (prompt, [])])
    assert float(scores.detach()[1]) == 0.0
    torch.autograd.backward(scores.sum())
    assert model.embed.weight.grad is not None
    assert float(model.embed.weight.grad.abs().sum()) > 0.0


def test_rejects_tokens_outside_the_vocabulary_and_empty_prompts() -> None:
    model = _model()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate([VOCAB_SIZE], 2, 1.0, _generator(0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.sequence_logprob([Token.BOS], [-1])
    with pytest.raises(ValueError, match="empty"):
        model.generate([], 2, 1.0, _generator(0))
    # The streaming form refuses when called, before anyone pulls a token.
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.iter_generate([Token.BOS], -1, 1.0, _generator(0))


def test_state_bytes_round_trip_carries_weights_and_version() -> None:
    trained = _model(seed=0)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.1)
    trained.weights_version = 7

    fresh = _model(seed=1)
    fresh.load_state_bytes(trained.state_bytes())

    assert fresh.weights_version == 7
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    prompt = encode_context(make_prompt(0, seed=0), [])
    assert fresh.generate(prompt, 8, 1.0, _generator(4)) == trained.generate(
        prompt, 8, 1.0, _generator(4)
    )


def test_load_state_bytes_refuses_foreign_payloads() -> None:
    buffer = io.BytesIO()
    torch.save({"format": "something-else", "state_dict": {}}, buffer)
    model = _model()
    with pytest.raises(ValueError, match="not a TinyPolicy"):
        model.load_state_bytes(buffer.getvalue())
    wider = TinyPolicy(VOCAB_SIZE, eos_token=Token.EOS, hidden_dim=32)
    with pytest.raises(RuntimeError):
        model.load_state_bytes(wider.state_bytes())
    assert model.weights_version == 0


# -- the task ------------------------------------------------------------------------


def test_prompts_are_deterministic_valid_and_json_round_trip() -> None:
    tasks = [make_prompt(index, seed=5) for index in range(200)]
    assert tasks == [make_prompt(index, seed=5) for index in range(200)]
    assert tasks != [make_prompt(index, seed=6) for index in range(200)]
    for task in tasks:
        assert task.low <= task.target <= task.high
        assert 1 <= task.high - task.low <= 3
        assert Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task
    assert len({(task.low, task.high, task.target) for task in tasks}) > 20


def test_task_from_dict_is_strict() -> None:
    data = make_prompt(0, seed=0).to_dict()
    with pytest.raises(ValueError, match="unknown fields \\['extra'\\]"):
        Task.from_dict({**data, "extra": 1})
    with pytest.raises(ValueError, match="digits"):
        Task.from_dict({**data, "target": "3"})
    with pytest.raises(ValueError, match="lie in"):
        Task.from_dict({**data, "low": 0, "high": 1, "target": 5})
    with pytest.raises(ValueError, match="max_turns"):
        Task.from_dict({**data, "max_turns": True})


def test_tool_replies_are_pure_and_follow_the_target() -> None:
    task = Task(prompt_id="p0", seed=0, group_index=0, low=3, high=6, target=5, max_turns=3)
    start = ToolSession()
    assert tool_call(task, start, {"guess": 3}).reply is Reply.HIGHER
    assert tool_call(task, start, {"guess": 6}).reply is Reply.LOWER
    correct = tool_call(task, start, {"guess": 5})
    assert correct.reply is Reply.CORRECT
    assert correct.session == ToolSession(calls=1, solved=True)
    for bad in (None, True, "5", 10, -1, 5.0):
        result = tool_call(task, start, {"guess": bad})
        assert result.reply is Reply.INVALID
        assert result.session.calls == 1  # a wasted call still spends a turn
    assert tool_call(task, start, {}).reply is Reply.INVALID
    # Same input, same output; the input session is never changed.
    assert tool_call(task, start, {"guess": 3}) == tool_call(task, start, {"guess": 3})
    assert start == ToolSession()

    spent = ToolSession(calls=3)
    assert tool_call(task, spent, {"guess": 5}).reply is Reply.INVALID
    assert ToolSession.from_dict(json.loads(json.dumps(correct.session.to_dict()))) == (
        correct.session
    )


def test_context_grows_turn_by_turn_and_never_shows_the_target() -> None:
    task = make_prompt(3, seed=0)
    turns = [
        Turn((_digit(1), Token.EOS), Reply.HIGHER),
        Turn((Token.TURN,), Reply.INVALID),
        Turn((_digit(4), _digit(9)), Reply.CORRECT),
    ]
    contexts = [encode_context(task, turns[:count]) for count in range(len(turns) + 1)]
    assert contexts[0] == [Token.BOS, Token.RANGE, _digit(task.low), _digit(task.high), Token.TURN]
    for shorter, longer, turn in zip(contexts, contexts[1:], turns, strict=False):
        assert longer == [*shorter, *turn.completion, turn.reply.token, Token.TURN]

    other_target = Task.from_dict(
        {**task.to_dict(), "target": task.low if task.target != task.low else task.high}
    )
    assert encode_context(other_target, turns) == encode_context(task, turns)

    assert [turn.guess for turn in turns] == [1, None, 4]
    assert episode_answer(turns) == (1, None, 4)
    assert parse_guess([Token.EOS]) is None
    assert not is_finished(task, turns[:2])
    assert is_finished(task, turns)
    assert is_finished(task, [Turn((_digit(task.target),), Reply.CORRECT)])
    assert Turn.from_dict(json.loads(json.dumps(turns[2].to_dict()))) == turns[2]


def test_per_sibling_reward_is_in_range_and_rewards_early_hits() -> None:
    task = Task(prompt_id="p0", seed=0, group_index=0, low=2, high=4, target=3, max_turns=3)
    choices: list[int | None] = [None, *range(10)]
    for length in range(4):
        for answer in itertools.product(choices, repeat=length):
            reward = per_sibling_reward(task, answer)
            assert reward == per_sibling_reward(task, list(answer))
            assert 0.0 <= reward <= 1.0
    assert per_sibling_reward(task, (3,)) == 1.0
    assert per_sibling_reward(task, ()) == 0.0
    assert per_sibling_reward(task, (None, None, None)) == 0.0
    # Hitting sooner beats hitting later; being close beats being far.
    assert per_sibling_reward(task, (2, 3)) > per_sibling_reward(task, (0, 2, 3))
    assert per_sibling_reward(task, (4, 2, 4)) > per_sibling_reward(task, (9, 0, 9))
    with pytest.raises(ValueError, match="list of per-turn guesses"):
        per_sibling_reward(task, "3")


def test_group_rewards_need_every_sibling() -> None:
    task = Task(prompt_id="p0", seed=0, group_index=0, low=2, high=4, target=3, max_turns=3)
    answers: list[tuple[int | None, ...]] = [(2, 4, 2), (0, 1, 2), (9, 9, 9), (None,)]
    rewards = group_rewards(task, answers)
    assert len(rewards) == len(answers)
    assert all(0.0 <= reward <= 1.0 for reward in rewards)

    # Only sibling 0's answer changes, and sibling 1's reward moves with it.
    better_zero = group_rewards(task, [(3,), *answers[1:]])
    assert better_zero[0] > rewards[0]
    assert better_zero[1] < rewards[1]
    assert better_zero[1] == pytest.approx(
        (1 - GROUP_WEIGHT) * per_sibling_reward(task, answers[1])
        + GROUP_WEIGHT * per_sibling_reward(task, answers[1])
    )

    assert group_rewards(task, [(3,)] * 4) == [1.0] * 4
    assert group_rewards(task, [(None,)] * 4) == [0.0] * 4
    with pytest.raises(ValueError, match="at least one"):
        group_rewards(task, [])


# -- the update ----------------------------------------------------------------------


def _sample(group_id: str, reward: float, digit: int) -> Sample:
    prompt = tuple(encode_context(make_prompt(0, seed=0), []))
    return Sample(group_id, (prompt,), ((_digit(digit), Token.EOS),), reward)


def test_group_advantages_are_normalised_per_group() -> None:
    samples = [
        _sample("a", 1.0, 1),
        _sample("a", 0.0, 2),
        _sample("b", 0.5, 3),
        _sample("a", 0.5, 4),
        _sample("b", 0.5, 5),
        _sample("c", 0.9, 6),
    ]
    advantages = group_advantages(samples)
    group_a = [advantages[0], advantages[1], advantages[3]]
    assert sum(group_a) == pytest.approx(0.0, abs=1e-9)
    assert sum(value * value for value in group_a) / 3 == pytest.approx(1.0, rel=1e-4)
    assert advantages[0] > advantages[3] > advantages[1]
    assert advantages[2] == advantages[4] == 0.0  # equal rewards teach nothing
    assert advantages[5] == 0.0  # a lone sibling has no baseline


def test_sample_rejects_mismatched_turns() -> None:
    with pytest.raises(ValueError, match="1 prompts but 0 completions"):
        Sample("g", ((1,),), (), 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        Sample("g", (), (), float("nan"))


def test_policy_gradient_step_moves_toward_the_better_sibling_deterministically() -> None:
    samples = [_sample("g", 1.0, 7), _sample("g", 0.0, 2)]
    prompt = samples[0].turn_prompts[0]
    good, bad = samples[0].turn_completions[0], samples[1].turn_completions[0]

    results = []
    for _ in range(2):
        model = _model(seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        before_good, before_bad = _score(model, prompt, good), _score(model, prompt, bad)
        stats = policy_gradient_step(model, optimizer, samples)
        assert _score(model, prompt, good) > before_good
        assert _score(model, prompt, bad) < before_bad
        results.append((stats, [p.detach().clone() for p in model.parameters()]))

    (stats, weights), (stats_again, weights_again) = results
    assert stats == stats_again
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_again, strict=True))
    assert stats.weights_version == 1
    assert stats.mean_reward == 0.5
    assert stats.num_samples == 2
    assert stats.num_groups == 1
    assert stats.num_tokens == 4
    assert stats.grad_norm > 0.0


# -- the whole loop ------------------------------------------------------------------


def _train(seed: int, steps: int, groups: int, siblings: int) -> list[float]:
    """Play the demo's loop in process and return the mean reward of every step."""
    model = _model(seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = _generator(seed)
    curve: list[float] = []
    for step in range(steps):
        samples: list[Sample] = []
        for slot in range(groups):
            task = make_prompt(step * groups + slot, seed)
            episodes: list[tuple[list[Turn], list[tuple[int, ...]]]] = []
            for _ in range(siblings):
                turns: list[Turn] = []
                prompts: list[tuple[int, ...]] = []
                session = ToolSession()
                while not is_finished(task, turns):
                    context = encode_context(task, turns)
                    tokens, _ = model.generate(context, MAX_NEW_TOKENS_PER_TURN, 1.0, generator)
                    result = tool_call(task, session, {"guess": parse_guess(tokens)})
                    session = result.session
                    turns.append(Turn(tuple(tokens), result.reply))
                    prompts.append(tuple(context))
                episodes.append((turns, prompts))
            answers = [episode_answer(turns) for turns, _ in episodes]
            # Half the prompts go to each verifier, as in the demo's two environments.
            if slot % 2:
                rewards = group_rewards(task, answers)
            else:
                rewards = [per_sibling_reward(task, answer) for answer in answers]
            for (turns, prompts), reward in zip(episodes, rewards, strict=True):
                completions = tuple(turn.completion for turn in turns)
                samples.append(Sample(task.prompt_id, tuple(prompts), completions, reward))
        curve.append(policy_gradient_step(model, optimizer, samples).mean_reward)
    assert model.weights_version == steps
    return curve


def test_mean_reward_rises_over_a_short_run() -> None:
    curve = _train(seed=0, steps=50, groups=8, siblings=4)
    window = 10
    first = sum(curve[:window]) / window
    last = sum(curve[-window:]) / window
    assert last - first > 0.15, (first, last, curve)
