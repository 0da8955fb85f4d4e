"""Request ids (docs/spec.md section 2.8): decided once per (operation, key, instance)
and reused on every retry; never the same for two coordinators."""

from __future__ import annotations

from turnpoint.trainer.control.client import request_id_source
from turnpoint.trainer.control.operations import _RequestIds


def test_an_operation_gets_one_id_for_its_key_and_instance_and_no_other_shares_it() -> None:
    ids = _RequestIds()
    first = ids.get("prepare", "ck-1", "agent-0")
    assert ids.get("prepare", "ck-1", "agent-0") == first
    others = {
        ids.get("commit", "ck-1", "agent-0"),
        ids.get("prepare", "ck-2", "agent-0"),
        ids.get("prepare", "ck-1", "agent-1"),
    }
    assert len(others | {first}) == 4


def test_two_coordinators_never_send_the_same_id() -> None:
    # A participant replays the answer it gave a request id: a new coordinator reusing
    # one would get an old answer instead of its own.
    one, two = _RequestIds(), _RequestIds()
    assert one.get("prepare", "ck-1", "agent-0") != two.get("prepare", "ck-1", "agent-0")
    first, second = request_id_source(), request_id_source()
    drawn = [first() for _ in range(1000)] + [second() for _ in range(1000)]
    assert len(set(drawn)) == 2000 and all(0 < len(i) <= 256 for i in drawn)


def test_old_keys_are_forgotten_beyond_the_bound() -> None:
    ids = _RequestIds(max_keys=2)
    kept = ids.get("resume", "ck-1", "agent-0")
    ids.get("resume", "ck-2", "agent-0")
    assert ids.get("resume", "ck-1", "agent-0") == kept  # recently used: kept
    ids.get("resume", "ck-3", "agent-0")  # ck-2 is now the oldest and goes
    assert ids.get("resume", "ck-1", "agent-0") == kept
