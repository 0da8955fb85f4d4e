"""Reading running participants' stale-scope refusals (docs/spec.md sections 4.16 item 3,
7.7 item 7 and 9.5): the pure part of a trainer restored alone."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId
from turnpoint.trainer.restore.stale import (
    STALE_EPISODES_KEY,
    merge_stale,
    parse_stale_episodes,
    stale_refusals,
)

ROLLOUT_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
LISTED = st.dictionaries(
    ROLLOUT_IDS,
    st.tuples(st.integers(0, 10**6), st.integers(1, 10**6)),
    min_size=1,
    max_size=8,
)


def listing(listed: dict[str, tuple[int, int]]) -> str:
    """As a participant lists them: ``rollout_id#attempt:seen_through``."""
    return ",".join(f"{r}#{a}:{a + above}" for r, (a, above) in sorted(listed.items()))


@settings(max_examples=50)
@given(LISTED)
def test_a_listing_reads_back_whole(listed: dict[str, tuple[int, int]]) -> None:
    assert parse_stale_episodes(listing(listed)) == {
        EpisodeId(r, a): a + above for r, (a, above) in listed.items()
    }


@settings(max_examples=50)
@given(LISTED, LISTED)
def test_several_refusals_give_the_highest_attempt_seen_per_rollout(
    first: dict[str, tuple[int, int]], second: dict[str, tuple[int, int]]
) -> None:
    seen = stale_refusals(
        [
            (Reason.STALE_ATTEMPT, {STALE_EPISODES_KEY: listing(first)}),
            (Reason.STALE_ATTEMPT, {STALE_EPISODES_KEY: listing(second)}),
        ]
    )
    expected: dict[str, int] = {}
    for listed in (first, second):
        for rollout_id, (attempt, above) in listed.items():
            expected[rollout_id] = max(attempt + above, expected.get(rollout_id, 0))
    assert seen == expected


def test_any_other_refusal_or_a_malformed_listing_is_an_ordinary_failure() -> None:
    good = (Reason.STALE_ATTEMPT, {STALE_EPISODES_KEY: "r1#0:1"})
    assert stale_refusals([good]) == {"r1": 1}
    assert stale_refusals([]) is None
    # A heal's refusal (a retired scope) names no list; any other reason is not stale.
    assert stale_refusals([good, (Reason.STALE_ATTEMPT, {"episode": "r2#0"})]) is None
    assert stale_refusals([good, (Reason.INVALID_PHASE, {})]) is None
    for text in ("r1#0", "r1:1", "r1#x:1", "r1#0:0", "r1#2:1", "/bad#0:1", "r1#0:1,", "r1#-1:1"):
        assert parse_stale_episodes(text) is None, text
        assert stale_refusals([(Reason.STALE_ATTEMPT, {STALE_EPISODES_KEY: text})]) is None
    assert merge_stale({"r1": 4, "r2": 1}, {"r1": 2, "r3": 7}) == {"r1": 4, "r2": 1, "r3": 7}
