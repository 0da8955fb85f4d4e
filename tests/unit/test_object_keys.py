"""Anchor file names as object keys (docs/spec.md section 8.13): any name a source
writes round-trips, valid ids stay as they are, and no two names share a key."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnpoint.storage import check_key
from turnpoint.trainer.storage.objects import file_path, object_key

_NAMES = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"), min_size=1, max_size=8
).filter(lambda name: name not in (".", ".."))


@pytest.mark.parametrize(
    ("path", "key"),
    [
        ("trainer/anchor/model.pt", "trainer/anchor/model.pt"),
        ("trainer/anchor/.metadata", "trainer/anchor/x--.metadata"),
        ("trainer/anchor/__0_0.distcp", "trainer/anchor/x--_5F_5F0_5F0.distcp"),
        ("trainer/anchor/x--model.pt", "trainer/anchor/x--x--model.pt"),
    ],
)
def test_known_names(path: str, key: str) -> None:
    assert object_key(path) == key
    assert file_path(key) == path


@given(st.lists(_NAMES, min_size=1, max_size=4), st.lists(_NAMES, min_size=1, max_size=4))
def test_every_name_round_trips_to_a_valid_key_and_none_collide(
    first: list[str], second: list[str]
) -> None:
    key = object_key("/".join(first))
    assert check_key(key) == key
    assert file_path(key) == "/".join(first)
    if first != second:
        assert object_key("/".join(second)) != key


def test_a_name_too_long_to_escape_is_refused() -> None:
    with pytest.raises(ValueError, match="too long"):
        object_key("trainer/anchor/" + "_" * 60)
    with pytest.raises(ValueError):
        file_path("trainer/x--_2E")  # "." names no file
