"""Saved attempts a running participant has moved past (docs/spec.md section 4.16 item 3).

A trainer restored alone restores into participants that outlived its predecessor. A
rollout the snapshot saved as attempt N may have been finished, retried or healed there
since: each participant that has seen N+1 refuses the RestoreRunning with
``STALE_ATTEMPT``, listing every such saved attempt and the highest attempt it has seen
of its rollout (metadata ``stale_episodes``, section 9.5). The coordinator reruns those
rollouts from their prompts above that attempt and restores the rest in one more round
(section 7.7 item 7).

Pure: the refusals come in as reasons and metadata, never as messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from turnpoint.errors import Reason
from turnpoint.ids import EpisodeId, InvalidIdError, validate_attempt, validate_id

STALE_EPISODES_KEY = "stale_episodes"


def parse_stale_episodes(text: str) -> dict[EpisodeId, int] | None:
    """``rollout_id#attempt:seen_through,...`` as a participant lists it; ``None`` when
    anything in it is malformed (the refusal is then an ordinary failure)."""
    listed: dict[EpisodeId, int] = {}
    for item in text.split(","):
        episode_text, colon, seen_text = item.partition(":")
        rollout_id, hash_mark, attempt_text = episode_text.partition("#")
        if not (colon and hash_mark):
            return None
        if not (attempt_text.isascii() and attempt_text.isdigit()):
            return None
        if not (seen_text.isascii() and seen_text.isdigit()):
            return None
        try:
            episode = EpisodeId(
                validate_id(rollout_id, "rollout_id"),
                validate_attempt(int(attempt_text), "attempt"),
            )
        except InvalidIdError:
            return None
        seen = int(seen_text)
        if seen <= episode.attempt:
            return None
        listed[episode] = max(seen, listed.get(episode, seen))
    return listed


def stale_refusals(
    refusals: Iterable[tuple[Reason | None, Mapping[str, str]]],
) -> dict[str, int] | None:
    """Per rollout, the highest attempt the refusing participants have seen, when every
    refusal of a restore is a stale-scope ``STALE_ATTEMPT`` that lists its attempts;
    ``None`` when any is something else (the restore then failed as section 7.7 item 7
    says) or when there is no refusal at all."""
    seen: dict[str, int] = {}
    any_refusal = False
    for reason, metadata in refusals:
        any_refusal = True
        text = metadata.get(STALE_EPISODES_KEY)
        if reason is not Reason.STALE_ATTEMPT or not text:
            return None
        listed = parse_stale_episodes(text)
        if not listed:
            return None
        for episode, through in listed.items():
            seen[episode.rollout_id] = max(through, seen.get(episode.rollout_id, through))
    return seen if any_refusal else None


def merge_stale(known: Mapping[str, int], more: Mapping[str, int]) -> dict[str, int]:
    """Two rounds' findings together, the higher attempt per rollout."""
    merged = dict(known)
    for rollout_id, through in more.items():
        merged[rollout_id] = max(through, merged.get(rollout_id, through))
    return merged
