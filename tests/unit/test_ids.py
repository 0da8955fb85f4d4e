"""Every id rule of docs/spec.md section 2 is enforced by one helper."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest

from turnpoint.ids import (
    EpisodeId,
    InvalidIdError,
    checkpoint_sequence,
    episodes_of,
    make_checkpoint_id,
    sorted_episodes,
    validate_attempt,
    validate_id,
)


@pytest.mark.parametrize(
    "value",
    ["a", "0", "rollout-1", "A.b_c-D", "x" * 128, "9lives", "r.0.1"],
)
def test_valid_ids(value: str) -> None:
    assert validate_id(value) == value


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "empty"),
        ("x" * 129, "128"),
        ("../x", "start"),
        (".hidden", "start"),
        ("-dash", "start"),
        ("_under", "start"),
        ("a/b", "only"),
        ("a\\b", "only"),
        ("a b", "only"),
        ("a\x00b", "only"),
        ("é", "start"),
        ("aé", "only"),
        ("..", "start"),
    ],
)
def test_invalid_ids(value: str, why: str) -> None:
    with pytest.raises(InvalidIdError) as info:
        validate_id(value, "rollout_id")
    assert why in str(info.value)
    assert info.value.field == "rollout_id"


def test_non_string_id_is_refused() -> None:
    with pytest.raises(InvalidIdError):
        validate_id(5)


@pytest.mark.parametrize("attempt", [-1, -100, 1.0, True, "1", None])
def test_invalid_attempts(attempt: object) -> None:
    with pytest.raises(InvalidIdError):
        validate_attempt(attempt)


_ROLLOUT_IDS = ["a", "x" * 128, "A.b_c-D", "", "x" * 129, "-dash", "a/b", "a\nb", "é", 5, None]
_ATTEMPTS = [0, 3, -1, 1.0, True, "1", None]


@pytest.mark.parametrize("rollout_id", _ROLLOUT_IDS)
@pytest.mark.parametrize("attempt", _ATTEMPTS)
def test_episodes_of_wire_fields_are_what_episode_id_makes_or_refuses(
    rollout_id: object, attempt: object
) -> None:
    fields = SimpleNamespace(rollout_id=rollout_id, attempt=attempt)
    good = SimpleNamespace(rollout_id="ok", attempt=0)
    try:
        expected = EpisodeId(rollout_id, attempt)  # type: ignore[arg-type]
    except InvalidIdError as error:
        with pytest.raises(InvalidIdError) as info:
            episodes_of([good, fields])
        assert (str(info.value), info.value.field) == (str(error), error.field)
        return
    made = episodes_of([good, fields])
    assert made == [EpisodeId("ok", 0), expected]
    assert all(type(episode) is EpisodeId for episode in made)


def test_episode_id_validates_both_parts() -> None:
    with pytest.raises(InvalidIdError):
        EpisodeId("../x", 0)
    with pytest.raises(InvalidIdError):
        EpisodeId("ok", -1)
    assert EpisodeId("r1", 2).next_attempt() == EpisodeId("r1", 3)


def test_an_episode_id_is_its_two_fields_checked_and_frozen() -> None:
    """Hashing, equality and order are those of ``(rollout_id, attempt)``, in C; a
    copy or a pickle (Ray ships them between processes) is an EpisodeId again; keyword
    arguments and the field names still work, and nothing can change a field."""
    episode = EpisodeId(rollout_id="r-1", attempt=2)
    assert (episode.rollout_id, episode.attempt) == ("r-1", 2)
    assert hash(episode) == hash(("r-1", 2)) and episode == EpisodeId("r-1", 2)
    assert EpisodeId("r-1", 2) < EpisodeId("r-1", 10) < EpisodeId("r-2", 0)
    assert repr(episode) == "EpisodeId(rollout_id='r-1', attempt=2)"
    assert EpisodeId("r") == EpisodeId("r", 0)
    for copied in (
        copy.copy(episode),
        copy.deepcopy(episode),
        pickle.loads(pickle.dumps(episode)),
    ):
        assert type(copied) is EpisodeId and copied == episode
    with pytest.raises(AttributeError):
        episode.attempt = 3  # type: ignore[misc]
    with pytest.raises(InvalidIdError):
        EpisodeId("r", True)  # type: ignore[arg-type]


def test_sorted_episodes_is_the_rollout_then_attempt_order() -> None:
    episodes = [
        EpisodeId("b", 0),
        EpisodeId("a", 10),
        EpisodeId("a", 2),
        EpisodeId("a-1", 0),
        EpisodeId("A", 3),
        EpisodeId("b", 0),
    ]
    assert sorted_episodes(episodes) == sorted(episodes)
    assert sorted_episodes(episodes)[:3] == [
        EpisodeId("A", 3),
        EpisodeId("a", 2),
        EpisodeId("a", 10),
    ]
    assert sorted_episodes(iter(())) == []


def test_episode_id_text_round_trip() -> None:
    episode = EpisodeId("group-3.s1", 4)
    assert EpisodeId.parse(str(episode)) == episode
    with pytest.raises(InvalidIdError):
        EpisodeId.parse("no-attempt")


def test_checkpoint_ids_carry_an_increasing_sequence_and_sort() -> None:
    ids = [make_checkpoint_id("run1", n) for n in (1, 2, 10, 100)]
    assert [checkpoint_sequence(i) for i in ids] == [1, 2, 10, 100]
    assert sorted(ids) == ids
    with pytest.raises(InvalidIdError):
        checkpoint_sequence("nosequence")
    with pytest.raises(InvalidIdError):
        make_checkpoint_id("../run", 1)
